"""What a re-cache holds (issue 24, item 6): over contiguous extents it holds only the rebuilt chunks and gives
them back at its commit (forks included, abort / exception / plan failure restoring pages and free list),
admission leaves room for one re-cache at a time, and the pool copies pages run by run."""

from __future__ import annotations

import copy

import pytest
import torch

import ardiff_modules as am
from ardiff_modules import KVCache
from ardiff_modules.errors import CapacityError, TensorMismatchError
from tests.support.failures import Boom, FlakyPlanBackend
from tests.support.recache_rig import BRANCHES, CHUNK, Rig, Stream, TOL, assert_recache_unchanged, recache_snapshot
from tests.support.streaming_model import TinyStreamingModel


def ring_of(state: am.KVState, branch: str) -> list[tuple[int, ...]]:
    """The branch's extent as chunk slots."""
    return state.branch_pages(branch).extent_slots()


def in_ring(state: am.KVState, branch: str, chunk: tuple[int, ...]) -> bool:
    return any(slot[: len(chunk)] == chunk for slot in ring_of(state, branch))


@pytest.mark.parametrize("keep_sinks", [True, False])
def test_extents_recache_holds_only_the_rebuilt_chunks_and_gives_them_back_at_commit(keep_sinks: bool) -> None:
    """Issue 24, item 6 (CPU analog of Wan2.1 sink 1 + window 6, CFG): while pending, a re-cache holds the
    rebuilt chunks minus the ring's free slot on top of the steady state; at commit the rebuilt chunks in
    fresh pages are copied into their own ring slots, the fresh pages freed (free list as before), so use is
    back at the steady state at once and every later one-chunk forward still sees one contiguous range."""
    rig = Rig(sink=1, window=6, page=2, extents=True)
    for _ in range(10):  # window full and rolled: 1 sink + 6 window chunks resident, 1 free slot per branch
        rig.step()
    alloc, state = rig.cache._allocator, rig.streams[0].state
    steady = 2 * 8 * 2  # branches x (1 + 6 + 1) extent slots x 2 pages
    assert alloc.num_used == steady
    before = {b: state.history_chunks(b) for b in BRANCHES}
    free_slot = {b: [sl for sl in ring_of(state, b) if not any(sl == c for c in before[b])] for b in BRANCHES}
    assert all(len(v) == 1 for v in free_slot.values())
    sink_bytes = {b: rig.cache._pool.kv[:, :, list(before[b][0])].clone() for b in BRANCHES}
    rebuilt = 6 if keep_sinks else 7
    transient = 2 * (rebuilt - 1) * 2  # the free slot takes one rebuilt chunk per branch
    free_before = alloc.free_pages()
    alloc.reset_peak()
    written: dict[str, list[torch.Tensor]] = {}

    def during(fwd: am.ForwardContext) -> None:
        assert alloc.num_used == steady + transient
        for b in BRANCHES:
            pending = state.pending_chunks(b)
            assert pending[0] == free_slot[b][0] and not any(in_ring(state, b, c) for c in pending[1:])
            written[b] = [rig.cache._pool.kv[:, :, list(c)].clone() for c in pending]

    rig.prompt()
    rig.recache(keep_sinks, inside=during)
    assert alloc.num_used == steady and alloc.peak_used == steady + transient
    assert alloc.free_pages() == free_before  # the fresh pages went back exactly where they came from
    for b in BRANCHES:
        now = state.history_chunks(b)
        first = 1 if keep_sinks else 0  # position of the first rebuilt chunk
        # It took the free slot; every other rebuilt chunk is back in its own slot (same page ids).
        assert now == before[b][:first] + (free_slot[b][0],) + before[b][first + 1 :]
        for j, chunk in enumerate(now[first:]):  # what the re-cache forward wrote, now in the ring
            assert torch.equal(rig.cache._pool.kv[:, :, list(chunk)], written[b][j])
        if keep_sinks:
            assert torch.equal(rig.cache._pool.kv[:, :, list(now[0])], sink_bytes[b])
    for _ in range(8):  # later chunks: the oracle's outputs, steady use, one contiguous key range each
        rig.step()
        assert alloc.num_used == steady
        assert rig.last_layout is not None and rig.last_layout.ragged_rows is not None
        assert all(in_ring(state, b, c) for b in BRANCHES for c in state.history_chunks(b))
    rig.cache.close()
    assert alloc.num_free == alloc.num_pages


def test_extents_recache_abort_exception_and_plan_failure_restore_pages_and_free_list() -> None:
    backend = FlakyPlanBackend()
    rig = Rig(sink=1, window=3, page=2, extents=True, backend=backend)
    for _ in range(6):
        rig.step()
    rig.prompt()
    state = rig.streams[0].state
    before = recache_snapshot(rig.cache)
    with pytest.raises(Boom), torch.no_grad(), rig.cache.prepare_recache(rig.members()) as fwd:
        assert any(in_ring(state, b, c) for b in BRANCHES for c in state.pending_chunks(b))  # a free slot taken
        rig.model(rig.recache_input(True), fwd.layers)  # writes the free ring slot and the fresh pages
        raise Boom
    # the ring slot is free again (refcount 1), fresh unallocated
    assert_recache_unchanged(rig.cache, before, peak=False)
    rig.cache.prepare_recache(rig.members(), keep_sinks=False).abort()
    assert_recache_unchanged(rig.cache, before, peak=False)
    before = recache_snapshot(rig.cache)
    backend.fail = Boom
    with pytest.raises(Boom):
        rig.cache.prepare_recache(rig.members())
    backend.fail = None
    assert_recache_unchanged(rig.cache, before)
    for _ in range(2):  # the old history still gives the oracle's outputs
        rig.step()
    rig.recache(keep_sinks=True)
    rig.step()


def test_extents_recache_with_a_fork_swaps_shared_chunks_and_copies_the_rest() -> None:
    """Where a fork shares an old chunk the rebuilt one stays in its fresh pages (the fork keeps reading the
    old, bit for bit); an unshared one is copied into its own slot; a slot the fork lets go between prepare
    and commit takes a rebuilt chunk that lived outside the ring. Exact page ids (cond's extent 0..7)."""
    rig = Rig(sink=1, window=2, page=2, extents=True)
    s = rig.streams[0]
    for _ in range(4):  # c0 -> slot 0, c1 -> 1, c2 -> 2, c3 -> 3 (c1 evicted): resident c0 c2 c3, slot 1 free
        rig.step()
    assert s.state.history_chunks("cond") == ((0, 1), (4, 5), (6, 7))
    child = s.state.fork("child")
    child_naive = copy.deepcopy(s.naive)
    child_bytes = {c: rig.cache._pool.kv[:, :, list(c)].clone() for b in BRANCHES for c in child.history_chunks(b)}
    rig.step()  # c4 -> slot 1; c2 evicted but the child holds slot 2: no free slot left
    assert s.state.history_chunks("cond") == ((0, 1), (6, 7), (2, 3))
    used = rig.cache._allocator.num_used
    assert used == 16  # the two extents; the child only shares
    rig.prompt()
    rig.recache(keep_sinks=True)  # rebuilds c3 (shared with the child) and c4 (the parent's alone)
    # c3' stays in fresh pages 16 17 (the child keeps c3 in slot 3); c4' went back into slot 1; its fresh
    # pages (18 19) were freed. uncond alike (fresh 20..23, c3' at 20 21).
    assert s.state.history_chunks("cond") == ((0, 1), (16, 17), (2, 3))
    assert s.state.history_chunks("uncond") == ((8, 9), (20, 21), (10, 11))
    assert rig.cache._allocator.num_used == used + 2 * 2
    for c, data in child_bytes.items():
        assert torch.equal(rig.cache._pool.kv[:, :, list(c)], data), f"the fork's chunk {c} changed"
    x = torch.randn(2, CHUNK, rig.model.dim, generator=rig.g)
    with torch.no_grad(), child.prepare_forward(BRANCHES, CHUNK, False) as fwd:  # the fork: old history
        out = rig.model(x, fwd.layers)
    torch.testing.assert_close(out, child_naive.forward(BRANCHES, x, False), **TOL)
    child.abort()  # (a denoising forward: the child's history, and the slots it holds, stay)
    rig.step()  # c5: no free slot (the child holds slots 2 and 3): paged, from the pool; c3' evicted
    c5 = s.state.history_chunks("cond")[-1]
    assert not in_ring(s.state, "cond", c5)
    rig.prompt()
    x = rig.recache_input(True)
    fwd = rig.cache.prepare_recache(rig.members())  # rebuilds c4 (slot 1) and c5 (outside): fresh pages
    with torch.no_grad():
        out = rig.model(x, fwd.layers)
    child.close()  # between prepare and commit: slots 2 and 3 are free again
    fwd.commit()
    expected = torch.cat([s.naive.recache(BRANCHES, {b: [s.latents[b][i] for i in rig.rebuilt(s, b, True)]
                                                     for b in BRANCHES})])
    torch.testing.assert_close(out, expected, **TOL)
    # c4'' back into slot 1, c5'' (which had no slot) into the lowest free one: the ring is whole again.
    assert s.state.history_chunks("cond") == ((0, 1), (2, 3), (4, 5))
    assert all(in_ring(s.state, b, c) for b in BRANCHES for c in s.state.history_chunks(b))
    assert rig.cache._allocator.num_used == 16
    for _ in range(3):
        rig.step()
        assert rig.cache._allocator.num_used == 16 and rig.last_layout.ragged_rows is not None
    rig.cache.close()
    assert rig.cache._allocator.num_free == rig.cache._allocator.num_pages


def test_extents_recache_of_a_fork_and_its_parent_together_puts_the_parent_back_in_its_ring() -> None:
    """Both sharers of the old chunks re-cached in one forward: both let go of them at once, so the
    parent's slots are free at commit and its rebuilt chunks are copied into them (the fork, which has no
    extent of its own yet, keeps its rebuilt chunks in fresh pages); outputs equal the oracle."""
    rig = Rig(sink=1, window=2, page=2, extents=True)
    for _ in range(4):
        rig.step()
    parent = rig.streams[0]
    child = Stream(parent.state.fork("child"), copy.deepcopy(parent.naive), copy.deepcopy(parent.latents))
    rig.streams.append(child)
    before = {b: parent.state.history_chunks(b) for b in BRANCHES}
    rig.prompt()
    rig.recache(keep_sinks=True)  # 4 streams, one launch
    for b in BRANCHES:
        # Rebuilt c2 took the free slot 1, rebuilt c3 was copied back into its own slot (3).
        assert parent.state.history_chunks(b) == (before[b][0], ring_of(parent.state, b)[1], before[b][2])
        assert not any(in_ring(parent.state, b, c) for c in child.state.history_chunks(b)[1:])
        assert child.state.history_chunks(b)[0] == before[b][0]  # the shared sink, kept
    assert rig.cache._allocator.num_used == 2 * 4 * 2 + 2 * 2 * 2  # two extents + the child's 2 rebuilt chunks x 2
    for _ in range(3):
        rig.step()
    rig.cache.close()
    assert rig.cache._allocator.num_free == rig.cache._allocator.num_pages


@pytest.mark.parametrize("extents", [False, True])
def test_admission_leaves_room_for_one_recache_at_a_time(extents: bool) -> None:
    """``sessions_that_fit`` keeps ``recache_reserve()`` free once for the pool: with every other session at
    its peak (an open forward holding its pending chunk), any one session can re-cache everything (sinks
    too) -- exactly filling the pool --, and two at once are refused before any change."""
    probe = Rig(sink=1, window=2, page=2, sessions=0, extents=extents).cache
    per_session, reserve = probe.pages_per_session(), probe.recache_reserve()
    assert (per_session, reserve) == (2 * 4 * 2, 2 * (3 - 1) * 2)  # 2 branches x 4 chunks; R - 1 = 2 chunks
    spec = probe.spec
    assert KVCache(spec, num_pages=2 * per_session + reserve, backend="reference").sessions_that_fit() == 2
    tight = KVCache(spec, num_pages=2 * per_session + reserve - 1, backend="reference")
    assert tight.sessions_that_fit() == 1 and tight.sessions_that_fit(recache=False) == 2
    assert tight.can_admit(1) and not tight.can_admit(2) and tight.can_admit(2, recache=False)
    tight.admit_session()
    with pytest.raises(CapacityError, match=f"nor to one session's re-cache \\({reserve} pages\\)"):
        tight.admit_session()
    tight.admit_session(recache=False)

    rig = Rig(sink=1, window=2, page=2, sessions=2, extents=extents, num_pages=2 * per_session + reserve)
    assert rig.cache.sessions_that_fit() == 0
    for _ in range(3):
        rig.step(keep=True)
    rig.prompt()
    for me, other in ((0, 1), (1, 0)):
        busy = rig.streams[other].state.prepare_forward(BRANCHES, CHUNK, False)  # the other one at its peak
        assert rig.cache.sessions_that_fit() == 0
        state = rig.streams[me].state
        x = state.recache_latents(keep_sinks=False)
        with torch.no_grad(), state.prepare_recache(keep_sinks=False) as fwd:
            rig.model(x, fwd.layers)
            assert rig.cache._allocator.num_free == 0  # the reserve, exactly
            assert rig.cache.sessions_that_fit() == 0
        busy.abort()
    before = recache_snapshot(rig.cache)
    with pytest.raises(CapacityError, match="re-cache fewer sessions at a time") as info:
        rig.cache.prepare_recache(rig.members(), keep_sinks=False)  # both at once: twice the reserve
    # Per session the reserve, plus (plain paging) the pending chunk per branch its idle peak leaves unused.
    assert info.value.needed == 2 * reserve + (0 if extents else 2 * 2 * 2)
    assert_recache_unchanged(rig.cache, before)


def test_pool_copy_pages_copies_every_layer_run_by_run() -> None:
    spec = TinyStreamingModel().spec(CHUNK, 2, 1, 2)
    pool = am.KVCache(spec, num_pages=24, backend="reference")._pool
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(3)))
    src, dst = [3, 4, 5, 9, 0, 1, 17], [10, 11, 12, 13, 20, 21, 6]  # runs broken on either side
    want = pool.kv.clone()
    want[:, :, dst] = pool.kv[:, :, src]
    pool.copy_pages(src, dst)
    assert torch.equal(pool.kv, want)
    pool.copy_pages([], [])
    assert torch.equal(pool.kv, want)
    with pytest.raises(TensorMismatchError, match="as many destinations as sources, got 2 and 1"):
        pool.copy_pages([1, 2], [3])
