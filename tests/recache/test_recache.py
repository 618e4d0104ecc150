"""Transactional prompt-switch re-cache (issue 16, item 2).

After ``clear_cross_attention`` + a new prompt, ``prepare_recache`` runs one forward over the resident
chunks' clean latents: rebuilt chunk ``j`` sees the kept sinks and rebuilt chunks ``0..j`` at its original
absolute positions, writes fresh pages only, and its commit swaps every stream's rebuilt chunks in at once.
Abort / an exception / a failed prepare leave the old history -- pages, refcounts, free list, pool bytes --
exactly as before. The oracle is ``NaiveStreaming.recache`` (cache-free, dense).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

import ardiff_modules as am
from ardiff_modules import KVCache, populate_cross_attention
from ardiff_modules.errors import (
    CapacityError,
    LatentsNotKeptError,
    PendingContextError,
    SequenceLengthError,
    SessionClosedError,
    SpecError,
    TensorMismatchError,
    UnknownBranchError,
)
from tests.support.failures import Boom, FlakyPlanBackend
from tests.support.kv_writes import write_every_layer
from tests.support.streaming_model import NaiveStreaming, TEXT, TinyStreamingModel

CHUNK = 4
BRANCHES = ("cond", "uncond")
TOL = {"atol": 2e-5, "rtol": 2e-5}


@dataclass
class Stream:
    """One session driven through the library and, in lock step, through the cache-free oracle."""

    state: am.KVState
    naive: NaiveStreaming
    #: branch -> clean latent ``[tokens, dim]`` of every committed chunk, by commit index.
    latents: dict[str, list[torch.Tensor]] = field(default_factory=lambda: {b: [] for b in BRANCHES})


class Rig:
    def __init__(
        self, *, sink: int = 1, window: int = 2, page: int = 2, num_pages: int = 400, sessions: int = 1,
        backend: am.AttentionBackend | str = "reference", seed: int = 0, extents: bool = False,
    ) -> None:
        torch.manual_seed(seed)
        self.model = TinyStreamingModel().eval()
        self.spec = self.model.spec(CHUNK, page, sink, window)
        self.cache = KVCache(self.spec, num_pages=num_pages, backend=backend, contiguous_extents=extents)
        #: The layout of the last committing forward :meth:`step` ran (its kernel's view of the keys).
        self.last_layout: am.ForwardLayout | None = None
        self.g = torch.Generator().manual_seed(seed + 1)
        self.sink, self.window = sink, window
        self.streams = [
            Stream(self.cache.open_session(f"s{i}"), NaiveStreaming(self.model, CHUNK, sink, window))
            for i in range(sessions)
        ]
        self.prompt()

    def prompt(self) -> None:
        """A new prompt for every branch of every session (``clear_cross_attention`` + populate)."""
        for s in self.streams:
            contexts = {b: torch.randn(5, self.model.context_dim, generator=self.g) for b in BRANCHES}
            s.state.clear_cross_attention()
            for b, c in contexts.items():
                populate_cross_attention(s.state, b, [blk.cross for blk in self.model.blocks], c)
            s.naive.set_prompt(contexts)

    @torch.no_grad()
    def step(self, length: int = CHUNK, *, denoise: int = 1, check: bool = True, keep: bool = False) -> None:
        """``denoise`` denoising forwards then the committing one, for every session, compared with the oracle.

        ``keep``: the committing forward keeps its latents in the library (``keep_latents``)."""
        for s in self.streams:
            for d in range(denoise + 1):
                commit = d == denoise
                x = torch.randn(len(BRANCHES), length, self.model.dim, generator=self.g)
                kept = {"keep_latents": x} if keep and commit else {}
                with s.state.prepare_forward(BRANCHES, length, commit, chunk_lengths=[length], **kept) as fwd:
                    out = self.model(x, fwd.layers)
                    self.last_layout = fwd.layout
                expected = s.naive.forward(BRANCHES, x, commit, [length])
                if check:
                    torch.testing.assert_close(out, expected, **TOL)
                if commit:
                    for i, b in enumerate(BRANCHES):
                        s.latents[b].append(x[i])

    def rebuilt(self, s: Stream, branch: str, keep_sinks: bool) -> list[int]:
        return [i for i in s.state.resident_chunk_indices(branch) if not (keep_sinks and i < self.sink)]

    def recache_input(self, keep_sinks: bool, streams: list[Stream] | None = None) -> torch.Tensor:
        """``[streams * branches, tokens, dim]``: each stream's rebuilt chunks' latents, in commit order."""
        rows = []
        for s in streams or self.streams:
            for b in BRANCHES:
                rows.append(torch.cat([s.latents[b][i] for i in self.rebuilt(s, b, keep_sinks)]))
        return torch.stack(rows)

    def members(self) -> list[tuple[am.KVState, str]]:
        return [(s.state, b) for s in self.streams for b in BRANCHES]

    @torch.no_grad()
    def recache(
        self, keep_sinks: bool, inside: Callable[[am.ForwardContext], None] | None = None
    ) -> torch.Tensor:
        """One batched re-cache of every stream, checked against the oracle; returns the library's output.

        ``inside(fwd)`` runs after the model wrote the rebuilt chunks, before the commit."""
        x = self.recache_input(keep_sinks)
        with self.cache.prepare_recache(self.members(), keep_sinks=keep_sinks) as fwd:
            out = self.model(x, fwd.layers)
            if inside is not None:
                inside(fwd)
        n = len(BRANCHES)
        expected = torch.cat([
            s.naive.recache(BRANCHES, {b: [s.latents[b][i] for i in self.rebuilt(s, b, keep_sinks)] for b in BRANCHES},
                            keep_sinks)
            for s in self.streams
        ])
        assert out.shape == expected.shape == (n * len(self.streams), x.shape[1], self.model.dim)
        torch.testing.assert_close(out, expected, **TOL)
        return out


def snapshot(cache: KVCache) -> dict:
    """Everything a failed re-cache must leave as it was: bookkeeping, free-list order, history bytes.

    Bytes of every page a chunk holds (resident or pending); not of free ring slots: reserved, but anyone's
    scratch (an aborted forward may have written one)."""
    used = sorted({
        p for state in cache.sessions.values() for b in state.kv_branch_names for h in [state.history(b)]
        for p in h.history_pages() + h.pending_pages()
    })
    sessions = {
        sid: {
            b: (h.resident, h.resident_index, h.resident_start, h.pending, h.committed_chunks, h.committed_tokens)
            for b in state.kv_branch_names
            for h in [state.history(b)]
        }
        for sid, state in cache.sessions.items()
    }
    return {
        "free": cache.allocator.free_pages(),
        "refcounts": [cache.allocator.refcount(p) for p in range(cache.allocator.num_pages)],
        "peak": cache.allocator.peak_used,
        "sessions": sessions,
        "used_bytes": cache.pool.kv[:, :, used].clone(),
    }


def assert_unchanged(cache: KVCache, before: dict, *, peak: bool = True) -> None:
    """``peak=False`` after a forward that ran: the high-water mark legitimately saw its fresh pages."""
    after = snapshot(cache)
    for key in ("free", "refcounts", "peak", "sessions")[: None if peak else 2] + (() if peak else ("sessions",)):
        assert after[key] == before[key], key
    assert torch.equal(after["used_bytes"], before["used_bytes"])
    cache.allocator.check_invariants()


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
    before = {b: state.visible_chunks(b) for b in BRANCHES}
    offsets = {b: state.token_offset(b) for b in BRANCHES}
    rig.prompt()
    rig.recache(keep_sinks)
    for b in BRANCHES:
        h = state.history(b)
        assert state.token_offset(b) == offsets[b] and h.pending == ()
        kept = [c for c, i in zip(before[b], h.resident_index) if keep_sinks and i < sink]
        assert list(h.sinks if keep_sinks else ())[: len(kept)] == kept  # sinks kept: the very same pages
        rebuilt = [c for c, i in zip(h.resident, h.resident_index) if not (keep_sinks and i < sink)]
        assert {p for c in rebuilt for p in c}.isdisjoint(p for c in before[b] for p in c)  # fresh pages
    for _ in range(4):  # the next chunks see the re-cached history, the window keeps rolling
        rig.step()
    rig.cache.close()
    assert rig.cache.allocator.num_free == rig.cache.allocator.num_pages


def test_recache_positions_are_the_original_ones() -> None:
    """After eviction the rebuilt chunks are sinks + the last W: their positions are not one run."""
    rig = Rig(sink=1, window=2, page=2)
    for length in (2, 4, 4, 4, 4):  # chunk starts 0, 2, 6, 10, 14; resident: 0 (sink), 10, 14
        rig.step(length)
    state = rig.streams[0].state
    assert state.history("cond").resident_start == (0, 10, 14)
    rig.prompt()
    fwd = state.prepare_recache(keep_sinks=False)
    assert fwd.layout.chunk_lengths == (2, 4, 4)
    expected = [0, 1, 10, 11, 12, 13, 14, 15, 16, 17]
    assert fwd.positions.tolist() == [expected, expected]
    assert fwd.key_positions()[0].tolist() == expected  # no kept history: keys are the rebuilt chunks
    fwd.abort()
    fwd = state.prepare_recache(keep_sinks=True)
    assert fwd.positions.tolist()[0] == expected[2:]
    assert fwd.key_positions()[0].tolist() == [0, 1] + expected[2:]  # the kept sink, then the rebuilt chunks
    # Sinks are write-protected: no sink page is written by the re-cache forward.
    sink_pages = set(state.history("cond").sinks[0]) | set(state.history("uncond").sinks[0])
    assert sink_pages.isdisjoint(fwd.layout.write_pages.tolist())
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
    assert all(not s.state.history(b).pending for s in rig.streams for b in BRANCHES)


def test_fork_keeps_the_old_history() -> None:
    """A fork sharing the old pages keeps reading them: the swap only drops the re-cached session's refs."""
    rig = Rig(sink=1, window=2, page=2)
    for _ in range(4):
        rig.step()
    s = rig.streams[0]
    child = s.state.fork("child")
    child_naive = copy.deepcopy(s.naive)
    old = {b: s.state.visible_chunks(b) for b in BRANCHES}
    rig.prompt()
    rig.recache(keep_sinks=True)
    assert all(child.visible_chunks(b) == old[b] for b in BRANCHES)
    x = torch.randn(2, CHUNK, rig.model.dim, generator=rig.g)
    with torch.no_grad(), child.prepare_forward(BRANCHES, CHUNK, True) as fwd:
        out = rig.model(x, fwd.layers)
    torch.testing.assert_close(out, child_naive.forward(BRANCHES, x, True), **TOL)
    child.close()
    rig.cache.close()
    assert rig.cache.allocator.num_free == rig.cache.allocator.num_pages


# ---------------------------------------------------------------------- failures change nothing
def test_exception_inside_the_block_keeps_the_old_history() -> None:
    rig = Rig(sink=1, window=2, page=2)
    for _ in range(4):
        rig.step()
    rig.prompt()
    before = snapshot(rig.cache)
    with pytest.raises(Boom), torch.no_grad(), rig.cache.prepare_recache(rig.members()) as fwd:
        rig.model(rig.recache_input(True), fwd.layers)  # writes the fresh pages
        raise Boom
    assert_unchanged(rig.cache, before, peak=False)
    with pytest.raises(am.ForwardFinishedError), torch.no_grad():
        rig.model(rig.recache_input(True), fwd.layers)  # the aborted re-cache cannot write any more
    # Explicit abort, and a member session reset/close, release only the fresh pages too.
    fwd = rig.cache.prepare_recache(rig.members())
    fwd.abort()
    assert_unchanged(rig.cache, before, peak=False)
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
    before = snapshot(rig.cache)
    backend.fail = Boom
    with pytest.raises(Boom):
        rig.cache.prepare_recache(rig.members())
    backend.fail = None
    assert_unchanged(rig.cache, before)
    rig.recache(keep_sinks=False)
    rig.step()


def test_capacity_error_before_any_change() -> None:
    # 2 branches x (1 sink + 2 window + 1 pending) chunks x 2 pages = 16 pages at peak; after a commit 12 used.
    rig = Rig(sink=1, window=2, page=2, num_pages=17)
    for _ in range(4):
        rig.step()
    rig.prompt()
    assert rig.cache.allocator.num_free == 5  # re-caching the window needs 2 x 2 x 2 = 8 fresh pages
    before = snapshot(rig.cache)
    with pytest.raises(CapacityError, match="needs 8 fresh pages") as info:
        rig.cache.prepare_recache(rig.members())
    assert (info.value.needed, info.value.free) == (8, 5)
    assert_unchanged(rig.cache, before)
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
    before = snapshot(rig.cache)
    fwd = rig.cache.prepare_recache(rig.members())
    s1.state.reset(keep_cross_attention=(TEXT,))  # aborts the whole re-cache (both sessions)
    assert fwd.status == "aborted"
    assert snapshot(rig.cache)["sessions"]["s0"] == before["sessions"]["s0"]
    fwd = s0.state.prepare_recache()
    s0.state.close()
    assert fwd.status == "released" and fwd.transaction is not None and fwd.transaction.status == "aborted"
    assert rig.cache.allocator.num_used == 0  # s1 was reset, s0 closed: no page held, fresh ones included
    rig.cache.close()
    assert rig.cache.allocator.num_free == rig.cache.allocator.num_pages


# ---------------------------------------------------------------------- misuse
def test_misuse_raises_specific_errors_and_changes_nothing() -> None:
    rig = Rig(sink=1, window=2, page=2)
    state = rig.streams[0].state
    before = snapshot(rig.cache)
    with pytest.raises(SpecError, match="expected at least one resident chunk to rebuild.*got 0 resident"):
        state.prepare_recache()  # nothing committed yet
    assert_unchanged(rig.cache, before)
    rig.step(CHUNK)
    before = snapshot(rig.cache)
    with pytest.raises(SpecError, match=r"keep_sinks=True\), got 1 resident chunk\(s\), 1 of them sinks"):
        state.prepare_recache()  # only the sink is resident: nothing to rebuild when it is kept
    with pytest.raises(SpecError, match="prepare_recache.keep_sinks: expected a bool, got 1"):
        state.prepare_recache(keep_sinks=1)  # type: ignore[arg-type]
    with pytest.raises(UnknownBranchError, match="Unknown KV branch 'nope'"):
        state.prepare_recache(("nope",))
    assert_unchanged(rig.cache, before)
    rig.step(CHUNK)
    rig.step(CHUNK)
    # An open forward on a stream: refused, naming it.
    fwd = state.prepare_forward(BRANCHES, CHUNK, True)
    before = snapshot(rig.cache)
    with pytest.raises(PendingContextError, match="expected branch 'cond' of session 's0' to be idle.*open forward"):
        state.prepare_recache()
    assert_unchanged(rig.cache, before)
    fwd.abort()
    # Pending chunks kept by a finished denoising forward: refused too (abort them first).
    with torch.no_grad(), state.prepare_forward(BRANCHES, CHUNK, False) as fwd:
        rig.model(torch.zeros(2, CHUNK, rig.model.dim), fwd.layers)
    before = snapshot(rig.cache)
    with pytest.raises(PendingContextError, match=r"got 1 pending chunk\(s\) kept by a denoising forward"):
        state.prepare_recache()
    assert_unchanged(rig.cache, before)
    state.abort()
    # While a re-cache is open, a forward of its streams is refused (it must be committed or aborted).
    recache = state.prepare_recache()
    before = snapshot(rig.cache)
    with pytest.raises(PendingContextError, match="neither committed nor aborted"):
        state.prepare_forward(BRANCHES, CHUNK, False)
    with pytest.raises(PendingContextError, match="to be idle"):
        state.prepare_recache()
    assert_unchanged(rig.cache, before)
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
    before = snapshot(rig.cache)
    with pytest.raises(SequenceLengthError, match=r"same lengths.*'s0/cond': \[4, 2\].*'s1/cond': \[4, 4\]"):
        rig.cache.prepare_recache(rig.members())
    assert_unchanged(rig.cache, before)


# ---------------------------------------------------------------------- kept latents
def test_kept_latents_follow_the_window_and_drive_the_recache() -> None:
    """``keep_latents`` on committing forwards: the library keeps a copy per resident chunk (pruned with
    eviction), and ``recache_latents`` hands back exactly the rebuilt chunks' latents."""
    rig = Rig(sink=1, window=2, page=2)
    state = rig.streams[0].state
    for length in (2, 4, 4, 4, 4):
        rig.step(length, keep=True)
    for b in BRANCHES:
        h = state.history(b)
        assert set(h.latents) == set(h.resident_index) == {0, 3, 4}  # evicted chunks' latents are gone
    for keep_sinks in (True, False):
        torch.testing.assert_close(state.recache_latents(keep_sinks=keep_sinks), rig.recache_input(keep_sinks),
                                   rtol=0, atol=0)
    # Copies: a caller reusing its latent buffer in place does not change what was kept.
    x = torch.zeros(2, CHUNK, rig.model.dim)
    with torch.no_grad(), state.prepare_forward(BRANCHES, CHUNK, True, keep_latents=x) as fwd:
        rig.model(x, fwd.layers)
    x.fill_(7.0)
    assert state.history("cond").latents[5].abs().sum() == 0  # type: ignore[union-attr]
    rig.streams[0].naive.forward(BRANCHES, torch.zeros(2, CHUNK, rig.model.dim), True)
    for i, b in enumerate(BRANCHES):
        rig.streams[0].latents[b].append(torch.zeros(CHUNK, rig.model.dim))
    # The re-cache over the kept latents equals the oracle; a fork shares the kept latents.
    rig.prompt()
    child = state.fork("child")
    assert child.history("cond").latents == state.history("cond").latents
    x = state.recache_latents(keep_sinks=True)
    with torch.no_grad(), state.prepare_recache(keep_sinks=True) as fwd:
        out = rig.model(x, fwd.layers)
    s = rig.streams[0]
    expected = s.naive.recache(BRANCHES, {b: [s.latents[b][i] for i in rig.rebuilt(s, b, True)] for b in BRANCHES})
    torch.testing.assert_close(out, expected, **TOL)
    assert set(state.history("cond").latents) == {0, 4, 5}  # a re-cache keeps them: the same chunks
    rig.step(keep=True)


def test_kept_latents_misuse() -> None:
    rig = Rig(sink=1, window=2, page=2)
    state = rig.streams[0].state
    rig.step()
    rig.step(keep=True)
    before = snapshot(rig.cache)
    with pytest.raises(LatentsNotKeptError, match=r"chunks \[0, 1\] of 's0'/'cond', got none for chunk\(s\) \[0\]"):
        state.recache_latents(keep_sinks=False)
    assert state.recache_latents(keep_sinks=True).shape == (2, CHUNK, rig.model.dim)
    x = torch.zeros(2, CHUNK, rig.model.dim)
    with pytest.raises(SpecError, match="expected a committing forward.*got commit_current=False"):
        state.prepare_forward(BRANCHES, CHUNK, False, keep_latents=x)
    with pytest.raises(TensorMismatchError, match=r"expected shape \[num_streams=2, seq_len=4, ...\], got \(1, 4, 32\)"):
        state.prepare_forward(BRANCHES, CHUNK, True, keep_latents=x[:1])
    with pytest.raises(TensorMismatchError, match="expected a tensor"):
        state.prepare_forward(BRANCHES, CHUNK, True, keep_latents=[1])  # type: ignore[arg-type]
    assert_unchanged(rig.cache, before)
    # An aborted forward keeps nothing.
    state.prepare_forward(BRANCHES, CHUNK, True, keep_latents=x).abort()
    assert set(state.history("cond").latents) == {1}
    state.reset()
    assert state.history("cond").latents == {}


def test_recache_latents_readable_while_a_denoising_forward_is_open() -> None:
    """``recache_latents`` only reads what was kept: an open denoising forward does not stop it
    (``prepare_recache`` itself still requires idle streams)."""
    rig = Rig(sink=1, window=2, page=2)
    state = rig.streams[0].state
    for length in (4, 4, 4):
        rig.step(length, keep=True)
    expected = state.recache_latents(keep_sinks=True)
    fwd = state.prepare_forward(BRANCHES, CHUNK, False)  # a denoising forward, open
    torch.testing.assert_close(state.recache_latents(keep_sinks=True), expected, rtol=0, atol=0)
    with pytest.raises(PendingContextError):
        state.prepare_recache(keep_sinks=True)
    fwd.abort()


# ---------------------------------------------------------------------- contiguous extents: memory (issue 24, 6)
def ring_of(state: am.KVState, branch: str) -> list[tuple[int, ...]]:
    """The branch's extent as chunk slots."""
    return state.history(branch).extent_slots()


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
    alloc, state = rig.cache.allocator, rig.streams[0].state
    steady = 2 * 8 * 2  # branches x (1 + 6 + 1) extent slots x 2 pages
    assert alloc.num_used == steady
    before = {b: state.visible_chunks(b) for b in BRANCHES}
    free_slot = {b: [sl for sl in ring_of(state, b) if not any(sl == c for c in before[b])] for b in BRANCHES}
    assert all(len(v) == 1 for v in free_slot.values())
    sink_bytes = {b: rig.cache.pool.kv[:, :, list(before[b][0])].clone() for b in BRANCHES}
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
            written[b] = [rig.cache.pool.kv[:, :, list(c)].clone() for c in pending]

    rig.prompt()
    rig.recache(keep_sinks, inside=during)
    assert alloc.num_used == steady and alloc.peak_used == steady + transient
    assert alloc.free_pages() == free_before  # the fresh pages went back exactly where they came from
    for b in BRANCHES:
        now = state.visible_chunks(b)
        first = 1 if keep_sinks else 0  # position of the first rebuilt chunk
        # It took the free slot; every other rebuilt chunk is back in its own slot (same page ids).
        assert now == before[b][:first] + (free_slot[b][0],) + before[b][first + 1 :]
        for j, chunk in enumerate(now[first:]):  # what the re-cache forward wrote, now in the ring
            assert torch.equal(rig.cache.pool.kv[:, :, list(chunk)], written[b][j])
        if keep_sinks:
            assert torch.equal(rig.cache.pool.kv[:, :, list(now[0])], sink_bytes[b])
    for _ in range(8):  # later chunks: the oracle's outputs, steady use, one contiguous key range each
        rig.step()
        assert alloc.num_used == steady
        assert rig.last_layout is not None and rig.last_layout.ragged_rows is not None
        assert all(in_ring(state, b, c) for b in BRANCHES for c in state.visible_chunks(b))
    rig.cache.close()
    assert alloc.num_free == alloc.num_pages


def test_extents_recache_abort_exception_and_plan_failure_restore_pages_and_free_list() -> None:
    backend = FlakyPlanBackend()
    rig = Rig(sink=1, window=3, page=2, extents=True, backend=backend)
    for _ in range(6):
        rig.step()
    rig.prompt()
    state = rig.streams[0].state
    before = snapshot(rig.cache)
    with pytest.raises(Boom), torch.no_grad(), rig.cache.prepare_recache(rig.members()) as fwd:
        assert any(in_ring(state, b, c) for b in BRANCHES for c in state.pending_chunks(b))  # a free slot taken
        rig.model(rig.recache_input(True), fwd.layers)  # writes the free ring slot and the fresh pages
        raise Boom
    assert_unchanged(rig.cache, before, peak=False)  # the ring slot is free again (refcount 1), fresh unallocated
    rig.cache.prepare_recache(rig.members(), keep_sinks=False).abort()
    assert_unchanged(rig.cache, before, peak=False)
    before = snapshot(rig.cache)
    backend.fail = Boom
    with pytest.raises(Boom):
        rig.cache.prepare_recache(rig.members())
    backend.fail = None
    assert_unchanged(rig.cache, before)
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
    assert s.state.visible_chunks("cond") == ((0, 1), (4, 5), (6, 7))
    child = s.state.fork("child")
    child_naive = copy.deepcopy(s.naive)
    child_bytes = {c: rig.cache.pool.kv[:, :, list(c)].clone() for b in BRANCHES for c in child.visible_chunks(b)}
    rig.step()  # c4 -> slot 1; c2 evicted but the child holds slot 2: no free slot left
    assert s.state.visible_chunks("cond") == ((0, 1), (6, 7), (2, 3))
    used = rig.cache.allocator.num_used
    assert used == 16  # the two extents; the child only shares
    rig.prompt()
    rig.recache(keep_sinks=True)  # rebuilds c3 (shared with the child) and c4 (the parent's alone)
    # c3' stays in fresh pages 16 17 (the child keeps c3 in slot 3); c4' went back into slot 1; its fresh
    # pages (18 19) were freed. uncond alike (fresh 20..23, c3' at 20 21).
    assert s.state.visible_chunks("cond") == ((0, 1), (16, 17), (2, 3))
    assert s.state.visible_chunks("uncond") == ((8, 9), (20, 21), (10, 11))
    assert rig.cache.allocator.num_used == used + 2 * 2
    for c, data in child_bytes.items():
        assert torch.equal(rig.cache.pool.kv[:, :, list(c)], data), f"the fork's chunk {c} changed"
    x = torch.randn(2, CHUNK, rig.model.dim, generator=rig.g)
    with torch.no_grad(), child.prepare_forward(BRANCHES, CHUNK, False) as fwd:  # the fork: old history
        out = rig.model(x, fwd.layers)
    torch.testing.assert_close(out, child_naive.forward(BRANCHES, x, False), **TOL)
    child.abort()  # (a denoising forward: the child's history, and the slots it holds, stay)
    rig.step()  # c5: no free slot (the child holds slots 2 and 3): paged, from the pool; c3' evicted
    c5 = s.state.visible_chunks("cond")[-1]
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
    assert s.state.visible_chunks("cond") == ((0, 1), (2, 3), (4, 5))
    assert all(in_ring(s.state, b, c) for b in BRANCHES for c in s.state.visible_chunks(b))
    assert rig.cache.allocator.num_used == 16
    for _ in range(3):
        rig.step()
        assert rig.cache.allocator.num_used == 16 and rig.last_layout.ragged_rows is not None
    rig.cache.close()
    assert rig.cache.allocator.num_free == rig.cache.allocator.num_pages


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
    before = {b: parent.state.visible_chunks(b) for b in BRANCHES}
    rig.prompt()
    rig.recache(keep_sinks=True)  # 4 streams, one launch
    for b in BRANCHES:
        # Rebuilt c2 took the free slot 1, rebuilt c3 was copied back into its own slot (3).
        assert parent.state.visible_chunks(b) == (before[b][0], ring_of(parent.state, b)[1], before[b][2])
        assert not any(in_ring(parent.state, b, c) for c in child.state.visible_chunks(b)[1:])
        assert child.state.visible_chunks(b)[0] == before[b][0]  # the shared sink, kept
    assert rig.cache.allocator.num_used == 2 * 4 * 2 + 2 * 2 * 2  # two extents + the child's 2 rebuilt chunks x 2
    for _ in range(3):
        rig.step()
    rig.cache.close()
    assert rig.cache.allocator.num_free == rig.cache.allocator.num_pages


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
            assert rig.cache.allocator.num_free == 0  # the reserve, exactly
            assert rig.cache.sessions_that_fit() == 0
        busy.abort()
    before = snapshot(rig.cache)
    with pytest.raises(CapacityError, match="re-cache fewer sessions at a time") as info:
        rig.cache.prepare_recache(rig.members(), keep_sinks=False)  # both at once: twice the reserve
    # Per session the reserve, plus (plain paging) the pending chunk per branch its idle peak leaves unused.
    assert info.value.needed == 2 * reserve + (0 if extents else 2 * 2 * 2)
    assert_unchanged(rig.cache, before)


def test_pool_copy_pages_copies_every_layer_run_by_run() -> None:
    spec = TinyStreamingModel().spec(CHUNK, 2, 1, 2)
    pool = am.KVCache(spec, num_pages=24, backend="reference").pool
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
