"""Transactional prompt-switch re-cache (issue 16, item 2).

After ``clear_cross_attention`` + a new prompt, ``prepare_recache`` runs one forward over the resident
chunks' clean latents: rebuilt chunk ``j`` sees the kept sinks and rebuilt chunks ``0..j`` at its original
absolute positions, writes fresh pages only, and its commit swaps every stream's rebuilt chunks in at once.
Abort / an exception / a failed prepare leave the old history -- pages, refcounts, free list, pool bytes --
exactly as before. The oracle is ``NaiveStreaming.recache`` (cache-free, dense).
"""

from __future__ import annotations

import copy

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.errors import (
    CapacityError,
    PendingContextError,
    SequenceLengthError,
    SessionClosedError,
    SpecError,
    UnknownBranchError,
)
from tests.support.failures import Boom, FlakyPlanBackend
from tests.support.kv_writes import write_every_layer
from tests.support.recache_rig import BRANCHES, CHUNK, Rig, TOL, assert_recache_unchanged, recache_snapshot
from tests.support.streaming_model import TEXT


# ---------------------------------------------------------------------- the oracle
@pytest.mark.parametrize("keep_sinks", [True, False])
@pytest.mark.parametrize("page,sink,window", [(2, 1, 2), (1, 2, 1), (4, 0, 3)])
def test_recache_matches_cache_free_oracle(page: int, sink: int, window: int, keep_sinks: bool) -> None:
    """Re-cached history and every later chunk equal a cache-free model that regenerated the resident
    chunks from the same latents under the new prompt (window evicted: resident positions not one run)."""
    rig = Rig(sink=sink, window=window, page=page)
    for length in (CHUNK // 2 if page <= 2 else CHUNK, CHUNK, CHUNK, CHUNK, CHUNK, CHUNK):
        rig.step(length)  # a short first chunk where the page allows it (image-to-video)
    state = rig.streams[0].state
    before = {b: state.history_chunks(b) for b in BRANCHES}
    offsets = {b: state.token_offset(b) for b in BRANCHES}
    rig.prompt()
    rig.recache(keep_sinks)
    for b in BRANCHES:
        h = state.branch_pages(b)
        assert state.token_offset(b) == offsets[b] and h.pending == ()
        kept = [c for c, i in zip(before[b], h.history_index) if keep_sinks and i < sink]
        assert list(h.sinks if keep_sinks else ())[: len(kept)] == kept  # sinks kept: the very same pages
        rebuilt = [c for c, i in zip(h.history, h.history_index) if not (keep_sinks and i < sink)]
        assert {p for c in rebuilt for p in c}.isdisjoint(p for c in before[b] for p in c)  # fresh pages
    for _ in range(4):  # the next chunks see the re-cached history, the window keeps rolling
        rig.step()
    rig.cache.close()
    assert rig.cache._allocator.num_free == rig.cache._allocator.num_pages


def test_recache_positions_are_the_original_ones() -> None:
    """After eviction the rebuilt chunks are sinks + the last W: their positions are not one run."""
    rig = Rig(sink=1, window=2, page=2)
    for length in (2, 4, 4, 4, 4):  # chunk starts 0, 2, 6, 10, 14; resident: 0 (sink), 10, 14
        rig.step(length)
    state = rig.streams[0].state
    assert state.branch_pages("cond").history_start == (0, 10, 14)
    rig.prompt()
    fwd = state.prepare_recache(keep_sinks=False)
    assert fwd._layout.chunk_lengths == (2, 4, 4)
    expected = [0, 1, 10, 11, 12, 13, 14, 15, 16, 17]
    assert fwd.positions.tolist() == [expected, expected]
    assert fwd.key_positions()[0].tolist() == expected  # no kept history: keys are the rebuilt chunks
    fwd.abort()
    fwd = state.prepare_recache(keep_sinks=True)
    assert fwd.positions.tolist()[0] == expected[2:]
    assert fwd.key_positions()[0].tolist() == [0, 1] + expected[2:]  # the kept sink, then the rebuilt chunks
    # Sinks are write-protected: no sink page is written by the re-cache forward.
    sink_pages = set(state.branch_pages("cond").sinks[0]) | set(state.branch_pages("uncond").sinks[0])
    assert sink_pages.isdisjoint(fwd._layout.write_pages.tolist())
    # Block-causal over the rebuilt chunks, the kept sink always visible.
    dense = fwd.to_dense()[0].int()
    assert dense[:, :2].all()
    assert dense[0].tolist() == [1, 1, 1, 1, 1, 1, 0, 0, 0, 0]
    assert dense[-1].tolist() == [1] * 10
    fwd.abort()


def test_recache_batches_cfg_and_two_sessions_in_one_launch() -> None:
    rig = Rig(sessions=2, sink=1, window=2, page=2)
    for _ in range(5):
        rig.step()
    rig.prompt()
    fwd = rig.cache.prepare_recache(rig.members())
    assert fwd.num_streams == 4 and fwd.num_chunks == 2  # 2 sessions x CFG, window chunks of each
    fwd.abort()
    rig.recache(keep_sinks=True)
    for _ in range(3):
        rig.step()
    assert all(not s.state.branch_pages(b).pending for s in rig.streams for b in BRANCHES)


def test_fork_keeps_the_old_history() -> None:
    """A fork sharing the old pages keeps reading them: the swap only drops the re-cached session's refs."""
    rig = Rig(sink=1, window=2, page=2)
    for _ in range(4):
        rig.step()
    s = rig.streams[0]
    child = s.state.fork("child")
    child_naive = copy.deepcopy(s.naive)
    old = {b: s.state.history_chunks(b) for b in BRANCHES}
    rig.prompt()
    rig.recache(keep_sinks=True)
    assert all(child.history_chunks(b) == old[b] for b in BRANCHES)
    x = torch.randn(2, CHUNK, rig.model.dim, generator=rig.g)
    with torch.no_grad(), child.prepare_forward(BRANCHES, CHUNK, True) as fwd:
        out = rig.model(x, fwd.layers)
    torch.testing.assert_close(out, child_naive.forward(BRANCHES, x, True), **TOL)
    child.close()
    rig.cache.close()
    assert rig.cache._allocator.num_free == rig.cache._allocator.num_pages


# ---------------------------------------------------------------------- failures change nothing
def test_exception_inside_the_block_keeps_the_old_history() -> None:
    rig = Rig(sink=1, window=2, page=2)
    for _ in range(4):
        rig.step()
    rig.prompt()
    before = recache_snapshot(rig.cache)
    with pytest.raises(Boom), torch.no_grad(), rig.cache.prepare_recache(rig.members()) as fwd:
        rig.model(rig.recache_input(True), fwd.layers)  # writes the fresh pages
        raise Boom
    assert_recache_unchanged(rig.cache, before, peak=False)
    with pytest.raises(am.errors.ForwardFinishedError), torch.no_grad():
        rig.model(rig.recache_input(True), fwd.layers)  # the aborted re-cache cannot write any more
    # Explicit abort, and a member session reset/close, release only the fresh pages too.
    fwd = rig.cache.prepare_recache(rig.members())
    fwd.abort()
    assert_recache_unchanged(rig.cache, before, peak=False)
    # The old history still produces the old-history outputs; a later re-cache still works.
    rig.step()
    rig.recache(keep_sinks=True)
    rig.step()


def test_plan_failure_keeps_everything_unchanged() -> None:
    backend = FlakyPlanBackend()
    rig = Rig(sink=1, window=2, page=2, backend=backend)
    for _ in range(4):
        rig.step()
    rig.prompt()
    before = recache_snapshot(rig.cache)
    backend.fail = Boom
    with pytest.raises(Boom):
        rig.cache.prepare_recache(rig.members())
    backend.fail = None
    assert_recache_unchanged(rig.cache, before)
    rig.recache(keep_sinks=False)
    rig.step()


def test_capacity_error_before_any_change() -> None:
    # 2 branches x (1 sink + 2 window + 1 pending) chunks x 2 pages = 16 pages at peak; after a commit 12 used.
    rig = Rig(sink=1, window=2, page=2, num_pages=17)
    for _ in range(4):
        rig.step()
    rig.prompt()
    assert rig.cache._allocator.num_free == 5  # re-caching the window needs 2 x 2 x 2 = 8 fresh pages
    before = recache_snapshot(rig.cache)
    with pytest.raises(CapacityError, match="needs 8 fresh pages") as info:
        rig.cache.prepare_recache(rig.members())
    assert (info.value.needed, info.value.free) == (8, 5)
    assert_recache_unchanged(rig.cache, before)
    # One branch at a time fits (old and new coexist only until the commit frees the old).
    for b in BRANCHES:
        x = rig.recache_input(True)[BRANCHES.index(b) : BRANCHES.index(b) + 1]
        with torch.no_grad(), rig.streams[0].state.prepare_recache((b,)) as fwd:
            out = rig.model(x, fwd.layers)
        rebuilt = rig.rebuilt(rig.streams[0], b, True)
        expected = rig.streams[0].naive.recache((b,), {b: [rig.streams[0].latents[b][i] for i in rebuilt]})
        torch.testing.assert_close(out, expected, **TOL)
    rig.step()


def test_close_and_reset_during_an_open_recache_release_only_fresh_pages() -> None:
    rig = Rig(sessions=2, sink=1, window=2, page=2)
    for _ in range(3):
        rig.step()
    rig.prompt()
    s0, s1 = rig.streams
    before = recache_snapshot(rig.cache)
    fwd = rig.cache.prepare_recache(rig.members())
    s1.state.reset(keep_cross_attention=(TEXT,))  # aborts the whole re-cache (both sessions)
    assert fwd.status == "aborted"
    assert recache_snapshot(rig.cache)["sessions"]["s0"] == before["sessions"]["s0"]
    fwd = s0.state.prepare_recache()
    s0.state.close()
    assert fwd.status == "released" and fwd._transaction is not None and fwd._transaction.status == "aborted"
    assert rig.cache._allocator.num_used == 0  # s1 was reset, s0 closed: no page held, fresh ones included
    rig.cache.close()
    assert rig.cache._allocator.num_free == rig.cache._allocator.num_pages


# ---------------------------------------------------------------------- misuse
def test_misuse_raises_specific_errors_and_changes_nothing() -> None:
    rig = Rig(sink=1, window=2, page=2)
    state = rig.streams[0].state
    before = recache_snapshot(rig.cache)
    with pytest.raises(SpecError, match="expected at least one resident chunk to rebuild.*got 0 resident"):
        state.prepare_recache()  # nothing committed yet
    assert_recache_unchanged(rig.cache, before)
    rig.step(CHUNK)
    before = recache_snapshot(rig.cache)
    with pytest.raises(SpecError, match=r"sinks='keep'.*\), got 1 resident chunk\(s\), 1 of them sinks"):
        state.prepare_recache()  # only the sink is resident: nothing to rebuild when it is kept
    with pytest.raises(SpecError, match="prepare_recache.keep_sinks: expected a bool, got 1"):
        state.prepare_recache(keep_sinks=1)  # type: ignore[arg-type]
    with pytest.raises(UnknownBranchError, match="Unknown KV branch 'nope'"):
        state.prepare_recache(("nope",))
    assert_recache_unchanged(rig.cache, before)
    rig.step(CHUNK)
    rig.step(CHUNK)
    # An open forward on a stream: refused, naming it.
    fwd = state.prepare_forward(BRANCHES, CHUNK, True)
    before = recache_snapshot(rig.cache)
    with pytest.raises(PendingContextError, match="expected branch 'cond' of session 's0' to be idle.*open forward"):
        state.prepare_recache()
    assert_recache_unchanged(rig.cache, before)
    fwd.abort()
    # Pending chunks kept by a finished denoising forward: refused too (abort them first).
    with torch.no_grad(), state.prepare_forward(BRANCHES, CHUNK, False) as fwd:
        rig.model(torch.zeros(2, CHUNK, rig.model.dim), fwd.layers)
    before = recache_snapshot(rig.cache)
    with pytest.raises(PendingContextError, match=r"got 1 pending chunk\(s\) kept by a denoising forward"):
        state.prepare_recache()
    assert_recache_unchanged(rig.cache, before)
    state.abort()
    # While a re-cache is open, a forward of its streams is refused (it must be committed or aborted).
    recache = state.prepare_recache()
    before = recache_snapshot(rig.cache)
    with pytest.raises(PendingContextError, match="neither committed nor aborted"):
        state.prepare_forward(BRANCHES, CHUNK, False)
    with pytest.raises(PendingContextError, match="to be idle"):
        state.prepare_recache()
    assert_recache_unchanged(rig.cache, before)
    recache.abort()
    state.close()
    with pytest.raises(SessionClosedError):
        state.prepare_recache()


def test_batched_streams_must_rebuild_the_same_lengths() -> None:
    rig = Rig(sessions=2, sink=1, window=2, page=2)
    s0, s1 = rig.streams
    rig.step()
    rig.step()
    rig.step()
    committing = s1.state.prepare_forward(BRANCHES, CHUNK, True)
    write_every_layer(committing.layers)
    committing.commit()  # s1 now has one more window chunk... same count
    with torch.no_grad():
        for length in (CHUNK // 2,):
            committing = s0.state.prepare_forward(BRANCHES, length, True)
            write_every_layer(committing.layers)
            committing.commit()  # s0's newest window chunk is short
    before = recache_snapshot(rig.cache)
    with pytest.raises(SequenceLengthError, match=r"same lengths.*'s0/cond': \[4, 2\].*'s1/cond': \[4, 4\]"):
        rig.cache.prepare_recache(rig.members())
    assert_recache_unchanged(rig.cache, before)


# ---------------------------------------------------------------------- the rules (issue 26, item 1)
RULES = [
    am.RecacheRule("bidirectional", "keep", 0),
    am.RecacheRule("block_causal", "keep", 1),
    am.RecacheRule("bidirectional", "rebuild", 2),
    am.RecacheRule("block_causal", "keep_after_slide", 1),
    am.RecacheRule.longlive(),
]


@pytest.mark.parametrize("extents", [False, True])
@pytest.mark.parametrize("rule", RULES, ids=str)
@pytest.mark.parametrize("page,sink,window", [(2, 1, 2), (4, 0, 3), (1, 2, 1)])
def test_each_rule_matches_a_cache_free_recomputation(
    page: int, sink: int, window: int, rule: am.RecacheRule, extents: bool
) -> None:
    """Every combination of attention / sinks / context chunks equals the oracle's own reading of the rule,
    at switches before, right after and long after the first eviction, and so do the chunks after each."""
    rig = Rig(sink=sink, window=window, page=page, rule=rule, extents=extents, num_pages=600)
    for n in range(1, sink + window + 6):
        rig.step(keep=True)
        if n in (sink + window, sink + window + 1, sink + window + 4):
            rig.prompt()
            rig.recache(True)
            rig.cache._allocator.check_invariants()
    for _ in range(2):
        rig.step()
    rig.cache.close()
    assert rig.cache._allocator.num_free == rig.cache._allocator.num_pages


def test_context_chunks_are_attended_then_released() -> None:
    """A context chunk is rebuilt and attended (the oracle match above) but never kept: after the commit the
    history is sinks + window as before, its pages free again, the reserve counts it."""
    rule = am.RecacheRule("block_causal", "keep", 1)
    rig = Rig(sink=1, window=2, page=2, rule=rule)
    for _ in range(6):
        rig.step(keep=True)
    state = rig.streams[0].state
    assert state.recache_chunk_indices("cond") == (3, 4, 5)  # chunk 3 left the window at the last commit
    used = rig.cache._allocator.num_used
    fwd = state.prepare_recache()
    assert fwd._layout.chunk_lengths == (CHUNK,) * 3
    assert rig.cache._allocator.num_used == used + 2 * 3 * 2  # 2 branches x 3 chunks x 2 pages, context included
    fwd.abort()
    rig.prompt()
    rig.recache(True)
    assert state.history_chunk_indices("cond") == (0, 4, 5) and rig.cache._allocator.num_used == used
    assert rig.cache.recache_reserve() == 2 * (3 + 1 - 1) * 2
