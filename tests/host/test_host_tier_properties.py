"""Property: any sequence of forward / commit / suspend / resume / fork / close over a few sessions leaks
nothing on either tier, keeps the allocator consistent, and every output equals a never-suspended twin's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ardiff_modules as am
from tests.support.small_cache import BOTH, CHUNK, make_small_cache, run_layers

OPS = st.lists(
    st.tuples(st.sampled_from(["commit", "denoise", "suspend", "resume", "fork", "close"]), st.integers(0, 2)),
    min_size=1,
    max_size=25,
)


def _forward(state: am.KVState, commit: bool, seed: int) -> list[torch.Tensor]:
    with state.prepare_forward(BOTH, CHUNK, commit_current=commit) as fwd:
        return run_layers(fwd.layers, 2, CHUNK, seed)


@pytest.mark.parametrize("extents", [False, True], ids=["paged", "extents"])
@settings(deadline=None)
@given(ops=OPS)
def test_suspend_resume_sequences_match_a_twin_and_leak_nothing(extents, ops):
    # NOTE: a tight pool for the suspended side, so freed pages get reused (a stale host alias would show);
    # a roomy one for the twin. A refusal for capacity on our side is skipped on both.
    cache, twin = make_small_cache(40, contiguous_extents=extents), make_small_cache(200, contiguous_extents=extents)
    mine, ref = [cache.open_session("s0")], [twin.open_session("s0")]
    for step, (op, i) in enumerate(ops):
        live = [k for k, s in enumerate(mine) if not s.is_closed]
        if not live:
            break
        k = live[i % len(live)]
        s, t = mine[k], ref[k]
        if op in ("commit", "denoise"):
            if s.is_suspended:
                with pytest.raises(am.SessionSuspendedError):
                    _forward(s, op == "commit", step)
                continue
            try:
                out = _forward(s, op == "commit", step)
            except am.CapacityError:
                continue
            want = _forward(t, op == "commit", step)
            assert all(torch.equal(a, b) for a, b in zip(out, want))
        elif op == "suspend":
            if s.is_suspended or any(s.pending_chunks(b) for b in BOTH):
                continue
            s.suspend()
        elif op == "resume":
            if not s.is_suspended:  # a resident session: refused, nothing changed
                with pytest.raises(am.SessionNotSuspendedError):
                    s.resume()
                continue
            try:
                s.resume()
            except am.CapacityError:
                assert s.is_suspended
        elif op == "fork" and not s.is_suspended and len(mine) < 4:
            s.abort(), t.abort()  # NOTE: a fork shares history only; pending work stays with the parent
            mine.append(s.fork(f"s{len(mine)}")), ref.append(t.fork(f"s{len(ref)}"))
        elif op == "close":
            s.close(), t.close()
        cache._allocator.check_invariants()
        cache._host_tier.pages.check_invariants()
    for s, t in zip(mine, ref):  # one at a time (the pool may not hold them all): each continues as its twin
        if not s.is_closed:
            for other in mine:
                if other is not s and not other.is_closed and not other.is_suspended:
                    other.abort()
                    other.suspend()
            if s.is_suspended:
                s.resume()
            s.abort(), t.abort()
            assert all(torch.equal(a, b) for a, b in zip(_forward(s, True, 99), _forward(t, True, 99)))
    for s in mine:
        s.close()
    assert cache._allocator.num_used == 0 and cache._host_tier.pages.nbytes == 0 and cache._host_tier.num_suspended == 0


@pytest.mark.parametrize("extents", [False, True], ids=["paged", "extents"])
@pytest.mark.parametrize("kind", ["per-head", "per-layer"])
@settings(deadline=None, max_examples=40)
@given(ops=OPS)
def test_grouped_suspend_resume_sequences_match_a_twin_in_every_lane(kind, extents, ops):
    """The property above with retention groups: every lane's allocator and host pages stay consistent, nothing
    leaks in any lane, and every output and every lane's history bytes equal a never-suspended twin's."""
    from tests.support import small_lanes as lanes

    cache, twin = lanes.make_cache(kind, 40, contiguous_extents=extents), lanes.make_cache(kind, 200, contiguous_extents=extents)
    mine, ref = [cache.open_session("s0")], [twin.open_session("s0")]
    for step, (op, i) in enumerate(ops):
        live = [k for k, s in enumerate(mine) if not s.is_closed]
        if not live:
            break
        k = live[i % len(live)]
        s, t = mine[k], ref[k]
        if op in ("commit", "denoise"):
            if s.is_suspended:
                continue
            try:
                out = _forward(s, op == "commit", step)
            except am.CapacityError:
                continue
            assert all(torch.equal(a, b) for a, b in zip(out, _forward(t, op == "commit", step)))
        elif op == "suspend":
            if not s.is_suspended and not any(s.pending_chunks(b) for b in BOTH):
                s.suspend()
        elif op == "resume" and s.is_suspended:
            try:
                s.resume()
            except am.CapacityError:
                assert s.is_suspended
        elif op == "fork" and not s.is_suspended and len(mine) < 4:
            s.abort(), t.abort()
            mine.append(s.fork(f"s{len(mine)}")), ref.append(t.fork(f"s{len(ref)}"))
        elif op == "close":
            s.close(), t.close()
        lanes.assert_clean(cache)
    for s, t in zip(mine, ref):
        if not s.is_closed:
            for other in mine:
                if other is not s and not other.is_closed and not other.is_suspended:
                    other.abort()
                    other.suspend()
            if s.is_suspended:
                s.resume()
            s.abort(), t.abort()
            assert lanes.same_history(cache, s, twin, t, slots=False)
            assert all(torch.equal(a, b) for a, b in zip(_forward(s, True, 99), _forward(t, True, 99)))
    for s in mine:
        s.close()
    assert all(lane.allocator.num_used == 0 for lane in cache._lanes) and cache.tiers().host_bytes == 0
    assert cache._host_tier.num_suspended == 0
