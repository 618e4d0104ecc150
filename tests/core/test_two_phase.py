"""The two-phase helper of multi-participant forwards (``core/two_phase.py``), over plain caches.

Two caches stand for two participants (parts of a grouped cache, ranks of a mesh); ``decide`` is either the
local ``all()`` or a stand-in for a mesh vote whose peer failed, or whose collective raised. A no-go leaves
every pool's contents, every allocator (free order, refcounts, peak) and every session exactly as before the
prepare; a kept participant cannot be committed alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.core.two_phase import (
    Coordinator,
    Decision,
    Participant,
    Step,
    Word,
    commit_all,
    decide_locally,
    prepare_all,
)
from ardiff_modules.errors import ARDiffError
from ardiff_modules.session import ForwardOptions

from tests.core.test_undo import CHUNK, _cache, _snapshot
from tests.support.kv_writes import write_every_layer


class PeerFailed(ARDiffError, RuntimeError):
    """What ``refused`` raises here when a (stand-in) peer said no."""


def _participants(extents: bool) -> list[tuple[am.KVCache, am.KVState]]:
    """Two caches, each with a session holding history and a kept denoising forward's pending chunk (its K/V
    written): the prepare below grows that chunk, so the rollback must restore it, pages and contents."""
    out = []
    for seed in (1, 2):
        cache = _cache(extents)
        state = cache.open_session("s")
        for _ in range(3):
            with state.prepare_forward(("cond", "uncond"), CHUNK, commit_current=True) as fwd:
                write_every_layer(fwd.layers, seed=seed)
        kept = state.prepare_forward(("cond", "uncond"), CHUNK, commit_current=False)
        write_every_layer(kept.layers, seed=seed + 10)
        kept.commit()  # completed: its pending pages stay for the next forward
        out.append((cache, state))
    return out


def _steps(parts: Sequence[tuple[am.KVCache, am.KVState]], held: list[am.ForwardContext]) -> list[Step]:
    def run(cache: am.KVCache, state: am.KVState) -> object:
        ctx = cache._forwards.prepare([(state, "cond"), (state, "uncond")], 2 * CHUNK, True,
                                     ForwardOptions(chunk_lengths=(CHUNK, CHUNK)), hold=True)
        held.append(ctx)
        return ctx._transaction

    return [Step(i, lambda c=c, s=s: run(c, s), lambda t, c=c: c._forwards.finish_forward(t, False))
            for i, (c, s) in enumerate(parts)]


def _state(parts: Sequence[tuple[am.KVCache, am.KVState]]) -> list[object]:
    return [(_snapshot(c, s), c._pool.kv.clone()) for c, s in parts]


def _same(a: list[object], b: list[object]) -> bool:
    return all(sa == sb and torch.equal(ka, kb) for (sa, ka), (sb, kb) in zip(a, b))  # type: ignore[misc]


def _peer_says_no(words: Sequence[tuple[object, Word]]) -> Decision:
    return Decision((*words, ("peer", Word.FAILED)))


def _collective_fails(words: Sequence[tuple[object, Word]]) -> Decision:
    raise RuntimeError("gloo: connection reset by peer")


@pytest.mark.parametrize("extents", [False, True])
@pytest.mark.parametrize("decide", [_peer_says_no, _collective_fails], ids=["no-go", "decide-raised"])
def test_a_failed_decide_rolls_every_participant_back_exactly(extents: bool, decide: object) -> None:
    parts = _participants(extents)
    before = _state(parts)
    held: list[am.ForwardContext] = []
    undone: list[object] = []
    with pytest.raises((PeerFailed, RuntimeError)):
        prepare_all(Coordinator("test forward"), _steps(parts, held), decide,  # type: ignore[arg-type]
                    undo=undone.append, refused=lambda d: PeerFailed(f"refused: {d.failed}"))
    assert len(held) == 2 and all(ctx._transaction.status == "aborted" for ctx in held)
    assert _same(_state(parts), before), "pool contents, free order, refcounts, peak and branches as before"
    assert undone == ([Decision(((0, Word.READY), (1, Word.READY), ("peer", Word.FAILED)))]
                      if decide is _peer_says_no else [None])
    for cache, _ in parts:
        cache._allocator.check_invariants()


def test_a_failing_step_stops_the_others_and_raises_its_own_error() -> None:
    parts = _participants(extents=True)
    before = _state(parts)
    held: list[am.ForwardContext] = []
    steps = _steps(parts, held)
    boom = Step("late", lambda: (_ for _ in ()).throw(am.CapacityError("no pages", needed=1, free=0)))
    with pytest.raises(am.CapacityError, match="no pages"):
        prepare_all(Coordinator("test forward"), [steps[0], boom, steps[1]], decide_locally)
    assert len(held) == 1 and _same(_state(parts), before)


def test_kept_participants_commit_only_together() -> None:
    parts = _participants(extents=False)
    held: list[am.ForwardContext] = []
    decision = prepare_all(Coordinator("the test forward"), _steps(parts, held), decide_locally)
    assert decision.go and all(ctx._transaction.reservation is None for ctx in held)
    for ctx in held:
        write_every_layer(ctx.layers, seed=3)
    before = _state(parts)
    with pytest.raises(am.ParticipantCommitError, match="expected the test forward to commit all its participants"):
        held[0].commit()
    with pytest.raises(am.ParticipantCommitError, match=r"streams \[s/cond, s/uncond\]"):
        parts[1][1].commit_paged_context("cond")
    assert _same(_state(parts), before) and all(ctx.is_active for ctx in held)
    participants = [
        Participant(i, ctx._transaction, c._forwards.abort_if_uncommittable, lambda t, c=c: c._forwards.finish_forward(t, True),
                    lambda t, c=c: c._forwards.finish_forward(t, False))
        for i, ((c, _), ctx) in enumerate(zip(parts, held))
    ]
    assert commit_all(participants, decide_locally).go
    assert [s.committed_chunks("cond") for _, s in parts] == [5, 5]
