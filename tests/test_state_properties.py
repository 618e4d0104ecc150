"""Stateful property test of the session API (``KVCache`` / ``KVState``) against a plain-list model.

A tiny CPU float32 pool (2 layers, 1 KV head, head_dim 2, chunk_size 2, page size
1 or 2, sinks 0..2, window 0..3 or unbounded, branches ``("cond", "uncond")``, one
cross cache ``"text"`` of 3 tokens) just big enough that capacity errors happen.

Model, per session and branch: the list of *all* chunks ever committed (the page
tuples the library reported), the pending chunks, the open forward record and
the cross cache contents. After every step:

* each page's refcount == the number of places referencing it (every open
  session's visible + pending chunks, from the model);
* free and used pages partition the pool, disjointly;
* each branch's visible history == first S + last W of its committed list (list
  slicing, never the policy); token offsets == committed chunks * chunk_size;
* cross caches hold exactly the last successfully populated values.

Failing operations (misuse, capacity, an exception in a forward or in a
cross-cache producer) must change nothing: the allocator's free list and
refcounts and every session's state are snapshotted before and compared after.
Closing every session at the end must free every page.

Half of the runs with a bounded window use ``contiguous_extents=True``: each branch
then reserves, on its first forward, one run of ``S + W + 1`` consecutive chunk
slots used as a ring (one extra reference per extent page until reset/close).
A backend whose ``plan()`` can be made to raise exercises the rollback of a
prepare that fails after pages were taken. ``fork`` / ``share_sinks_from`` /
``share_cross_attention_from`` share pages and caches between sessions: the
model then simply lists the same chunk in several sessions, and refcounts must
count every one of them.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ardiff_modules import (
    ChunkSelfAttention,
    CrossAttentionNotPopulatedError,
    CrossAttentionSpec,
    ForwardContext,
    KVCache,
    KVCacheSpec,
    KVState,
    LayerContext,
    chunk_attention,
)
from ardiff_modules.errors import (
    CapacityError,
    PendingContextError,
    SequenceLengthError,
    SessionClosedError,
    SpecError,
    TensorMismatchError,
    UnknownBranchError,
    UnknownCacheError,
)
from ardiff_modules.backends import ReferenceBackend

BRANCHES = ("cond", "uncond")
BRANCH_SETS = [("cond",), ("uncond",), ("cond", "uncond"), ("uncond", "cond")]
CHUNK = 2
HEAD_DIM = 2
NUM_LAYERS = 2
CROSS_TOKENS = 3
MAX_SESSIONS = 3

Chunk = tuple[int, ...]


class Boom(Exception):
    """Injected failure (inside a forward, or inside a cross-cache producer)."""


class FlakyPlanBackend(ReferenceBackend):
    """The reference backend, whose ``plan()`` raises :class:`Boom` while ``fail`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = False

    def plan(self, *args, **kwargs):  # signature-agnostic on purpose
        if self.fail:
            raise Boom("injected failure while planning")
        return super().plan(*args, **kwargs)


def expected_visible(committed: list[Chunk], sink: int, window: int | None) -> list[Chunk]:
    """First ``sink`` chunks plus the last ``window`` of the rest (plain slicing)."""
    rest = committed[sink:]
    if window is None:
        return committed[:sink] + rest
    return committed[:sink] + rest[max(0, len(rest) - window) :]


@dataclass
class Record:
    """A prepared forward not yet committed/aborted, as the model sees it."""

    commit: bool
    num_chunks: int
    ctx: ForwardContext


@dataclass
class SessionModel:
    state: KVState
    closed: bool = False
    committed: dict[str, list[Chunk]] = field(default_factory=lambda: {b: [] for b in BRANCHES})
    pending: dict[str, list[Chunk]] = field(default_factory=lambda: {b: [] for b in BRANCHES})
    record: dict[str, Record | None] = field(default_factory=lambda: dict.fromkeys(BRANCHES))
    cross: dict[str, float] = field(default_factory=dict)  # branch -> tag of the populated "text" cache
    extent: dict[str, tuple[int, ...] | None] = field(default_factory=lambda: dict.fromkeys(BRANCHES))

    def clear_self_attention(self) -> None:
        for b in BRANCHES:
            self.committed[b] = []
            self.pending[b] = []
            self.record[b] = None
            self.extent[b] = None


def cross_value(tag: float, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.full((CROSS_TOKENS, 1, HEAD_DIM), tag + layer)
    return k, -k


class SessionStateMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache: KVCache | None = None
        self.sessions: list[SessionModel] = []
        self.contexts: list[ForwardContext] = []  # prepared forwards, for ctx.commit()/abort() later
        self.tags = itertools.count(1)
        self.gen = torch.Generator().manual_seed(0)
        with torch.random.fork_rng():  # deterministic weights without touching the global RNG
            torch.manual_seed(0)
            # 2 query heads over 1 KV head (GQA), head_dim 2: the layer writes K/V into the tiny pool.
            self.attn = ChunkSelfAttention(2 * HEAD_DIM, 2, num_kv_heads=1, head_dim=HEAD_DIM)

    # ================================================================== setup
    @initialize(
        sink=st.integers(0, 2),
        window=st.sampled_from([0, 1, 2, 3, None]),
        page_size=st.sampled_from([1, 2]),
        pool_chunks=st.integers(2, 12),
        extents=st.booleans(),
    )
    def setup(self, sink: int, window: int | None, page_size: int, pool_chunks: int, extents: bool) -> None:
        self.spec = KVCacheSpec(
            num_layers=NUM_LAYERS,
            num_kv_heads=1,
            head_dim=HEAD_DIM,
            chunk_size=CHUNK,
            page_size=page_size,
            sink_chunks=sink,
            window_chunks=window,
            branches=BRANCHES,
            cross_attention=(CrossAttentionSpec("text", CROSS_TOKENS),),
            dtype="float32",
        )
        self.ppc = self.spec.pages_per_chunk
        self.extents = extents and window is not None
        self.extent_chunks = sink + window + 1 if self.extents else 0
        if self.extents:
            pool_chunks += self.extent_chunks  # room for at least one extent
        self.backend = FlakyPlanBackend()
        self.cache = KVCache(
            self.spec, num_pages=pool_chunks * self.ppc, device="cpu", backend=self.backend,
            contiguous_extents=self.extents,
        )
        self.sessions.append(SessionModel(self.cache.open_session()))

    # ================================================================== helpers
    @property
    def open_sessions(self) -> list[SessionModel]:
        return [s for s in self.sessions if not s.closed]

    @property
    def closed_sessions(self) -> list[SessionModel]:
        return [s for s in self.sessions if s.closed]

    def pick(self, pool: list[SessionModel], index: int) -> SessionModel:
        return pool[index % len(pool)]

    def visible(self, sm: SessionModel, branch: str) -> list[Chunk]:
        return expected_visible(sm.committed[branch], self.spec.sink_chunks, self.spec.window_chunks)

    def chunk_references(self) -> Counter[int]:
        """References to each page from chunks (visible or pending) of every open session."""
        refs: Counter[int] = Counter()
        for sm in self.open_sessions:
            for b in BRANCHES:
                refs.update(p for c in self.visible(sm, b) + sm.pending[b] for p in c)
        return refs

    def free_slots(self, sm: SessionModel, b: str) -> list[Chunk]:
        """Extent slots of a branch that no chunk anywhere references (a fork may still see an evicted one)."""
        ext = sm.extent[b]
        if ext is None:
            return []
        refs = self.chunk_references()
        slots = [tuple(ext[i : i + self.ppc]) for i in range(0, len(ext), self.ppc)]
        return [slot for slot in slots if not any(refs[p] for p in slot)]

    @staticmethod
    def longest_run(pages) -> int:
        best = run = 0
        previous = -2
        for p in sorted(pages):
            run = run + 1 if p == previous + 1 else 1
            best, previous = max(best, run), p
        return best

    def snapshot(self) -> tuple:
        """Everything a failed operation must leave untouched."""
        alloc = self.cache.allocator
        sessions = []
        for sm in self.sessions:
            st_ = sm.state
            if st_.is_closed:
                sessions.append(("closed", st_.session_id))
                continue
            branches = []
            for b in BRANCHES:
                rec = st_._pending[b]
                cross = None
                if st_.is_cross_attention_populated(b, "text"):
                    cross = [(d["k"].tolist(), d["v"].tolist()) for d in st_.get_cross_attention_kv(b, "text")]
                branches.append(
                    (
                        st_.visible_chunks(b),
                        st_.pending_chunks(b),
                        st_.token_offset(b),
                        st_.committed_chunks(b),
                        None if rec is None else (rec.commit_current, rec.num_chunks, id(rec.context)),
                        cross,
                        st_._branches[b].extent,
                    )
                )
            sessions.append((st_.session_id, tuple(branches)))
        return (
            alloc.free_pages(),
            tuple(alloc.refcount(p) for p in range(alloc.num_pages)),
            tuple(sorted(self.cache.sessions)),
            tuple(sessions),
        )

    def expect_failure(self, exc: type[BaseException], fn, *args, match: str | None = None, **kwargs) -> None:
        before = self.snapshot()
        with pytest.raises(exc) as info:
            fn(*args, **kwargs)
        if match is not None:
            assert match in str(info.value), f"{exc.__name__} message {str(info.value)!r} lacks {match!r}"
        after = self.snapshot()
        assert after == before, f"failed {fn.__name__} ({exc.__name__}) changed state"

    def predict_prepare(self, streams: list[tuple[SessionModel, str]], num_chunks: int):
        """The exception ``prepare_forward`` must raise (checked in the library's order), or ``None``."""
        seen = set()
        for sm, b in streams:
            if sm.closed:
                return SessionClosedError
            if b not in BRANCHES:
                return UnknownBranchError
            key = (id(sm), b)
            if key in seen:
                return SpecError
            seen.add(key)
            rec = sm.record[b]
            if rec is not None and rec.commit:
                return PendingContextError
        alloc = self.cache.allocator
        if not self.extents:
            needed = sum(max(0, num_chunks - len(sm.pending[b])) * self.ppc for sm, b in streams)
            return CapacityError if needed > alloc.num_free else None
        needed = new_extents = 0
        for sm, b in streams:
            missing = max(0, num_chunks - len(sm.pending[b]))
            if sm.extent[b] is None:
                new_extents += 1
                needed += (self.extent_chunks + max(0, missing - self.extent_chunks)) * self.ppc
            else:
                needed += max(0, missing - len(self.free_slots(sm, b))) * self.ppc
        if needed > alloc.num_free:
            return CapacityError
        if new_extents and new_extents * self.extent_chunks * self.ppc > self.longest_run(alloc.free_pages()):
            event("extents: no consecutive run for a new extent")
            return CapacityError  # enough pages, but no consecutive run for the new extents
        return None

    def after_prepare(
        self, streams: list[tuple[SessionModel, str]], num_chunks: int, commit: bool, ctx: ForwardContext,
        free_before: set[int],
    ) -> None:
        """Check the prepared forward against the model and record its pending chunks."""
        fresh: list[int] = []
        for i, (sm, b) in enumerate(streams):
            old = sm.pending[b]
            new = list(sm.state.pending_chunks(b))
            assert len(new) == num_chunks, f"{b}: {len(new)} pending chunks, expected {num_chunks}"
            keep = min(len(old), num_chunks)
            assert new[:keep] == old[:keep], "pending pages of earlier denoising forwards must be reused"
            grown = new[keep:]
            if self.extents:
                extent = sm.state._branches[b].extent
                if sm.extent[b] is None:
                    # Reserved now: S + W + 1 chunk slots of consecutive, previously free pages.
                    assert len(extent) == self.extent_chunks * self.ppc, f"extent {extent}"
                    assert list(extent) == list(range(extent[0], extent[0] + len(extent))), f"extent {extent}"
                    fresh += list(extent)
                    sm.extent[b] = tuple(extent)
                assert tuple(extent) == sm.extent[b], "a branch's extent must not move until reset/close"
                slots = self.free_slots(sm, b)  # model pending not updated yet: slots free before
                ring = [c for c in grown if c in slots]
                # The ring takes the lowest free slots first; only the overflow is paged.
                assert ring == slots[: len(ring)] and len(ring) == min(len(grown), len(slots)), (
                    f"{b}: grew {grown}, free extent slots were {slots}"
                )
                assert grown[: len(ring)] == ring
                if ring:
                    event("extents: pending chunk took a ring slot")
                if grown[len(ring) :]:
                    event("extents: overflow chunk paged outside the extent")
                grown = grown[len(ring) :]
            fresh += [p for c in grown for p in c]
            assert all(len(c) == self.ppc for c in new)
            sm.pending[b] = new
            sm.record[b] = Record(commit, num_chunks, ctx)
            # The plan sees exactly the model's visible pages and pending chunks.
            layout = ctx.layout.streams[i]
            assert list(layout.history_pages) == [p for c in self.visible(sm, b) for p in c]
            assert list(layout.pending_pages) == new
            offset = len(sm.committed[b]) * CHUNK
            assert layout.token_offset == offset
            assert ctx.positions[i].tolist() == list(range(offset, offset + num_chunks * CHUNK))
        assert len(set(fresh)) == len(fresh) and set(fresh) <= free_before, (
            f"newly allocated pages {fresh} were not all free ({sorted(free_before)})"
        )
        assert ctx.streams == tuple((sm.state.session_id, b) for sm, b in streams)
        assert ctx.num_chunks == num_chunks and ctx.seq_len == num_chunks * CHUNK
        assert ctx.commit_current is commit
        assert len(ctx.layers) == NUM_LAYERS
        self.contexts = [c for c in self.contexts if c is not ctx][-4:] + [ctx]

    def commit_branches(self, sm: SessionModel, branches: tuple[str, ...]) -> None:
        """The seed API's ``commit_paged_context`` per branch, mirrored in the model."""
        for b in branches:
            sm.state.commit_paged_context(b)
            self.model_commit(sm, b)

    def model_commit(self, sm: SessionModel, b: str) -> None:
        rec = sm.record[b]
        if rec is None:
            return
        if rec.commit:
            before = len(self.visible(sm, b)) + len(sm.pending[b])
            sm.committed[b] += sm.pending[b]
            sm.pending[b] = []
            event("commit evicted chunks" if len(self.visible(sm, b)) < before else "commit without eviction")
        sm.record[b] = None

    def model_abort(self, sm: SessionModel, b: str) -> None:
        sm.pending[b] = []
        sm.record[b] = None

    def model_finish(self, ctx: ForwardContext, success: bool) -> None:
        """What ``ctx.commit()`` / ``ctx.abort()`` / leaving its ``with`` does: only streams still on ``ctx``."""
        by_id = {sm.state.session_id: sm for sm in self.sessions}
        for sid, b in ctx.streams:
            sm = by_id[sid]
            if sm.closed:
                continue
            rec = sm.record[b]
            if rec is None or rec.ctx is not ctx:
                continue
            if success:
                self.model_commit(sm, b)
            else:
                self.model_abort(sm, b)

    def run_attention(self, streams: list[tuple[SessionModel, str]], ctx: ForwardContext) -> None:
        """A real forward through every layer, checked against a hand-written softmax over the model's pages."""
        n = ctx.seq_len
        s = len(streams)
        for layer in ctx.layers:
            q = torch.randn(s, n, 2, HEAD_DIM, generator=self.gen)  # 2 query heads over 1 KV head (GQA)
            k = torch.randn(s, n, 1, HEAD_DIM, generator=self.gen)
            v = torch.randn(s, n, 1, HEAD_DIM, generator=self.gen)
            out = chunk_attention(q, k, v, layer)
            k_pages = self.cache.pool.k_pages(layer.layer_index)
            v_pages = self.cache.pool.v_pages(layer.layer_index)
            for i, (sm, b) in enumerate(streams):
                pend = [p for c in sm.pending[b] for p in c]
                # The current K/V landed in the pending pages, in order.
                assert torch.equal(k_pages[pend].reshape(n, 1, HEAD_DIM), k[i])
                assert torch.equal(v_pages[pend].reshape(n, 1, HEAD_DIM), v[i])
                hist = [p for c in self.visible(sm, b) for p in c]
                hk = k_pages[hist].reshape(-1, HEAD_DIM)
                hv = v_pages[hist].reshape(-1, HEAD_DIM)
                for t in range(n):
                    upto = (t // CHUNK + 1) * CHUNK  # own chunk and earlier pending chunks
                    keys = torch.cat([hk, k[i, :upto, 0]])
                    values = torch.cat([hv, v[i, :upto, 0]])
                    w = torch.softmax(q[i, t] @ keys.T * HEAD_DIM**-0.5, dim=-1)
                    torch.testing.assert_close(out[i, t], w @ values, rtol=1e-5, atol=1e-5)
            self.check_cross_in_forward(streams, layer)

    def check_cross_in_forward(self, streams: list[tuple[SessionModel, str]], layer: LayerContext) -> None:
        """The forward sees each stream's current cross cache, or raises when any stream lacks it."""
        if all(b in sm.cross for sm, b in streams):
            k, v = layer.cross_kv("text")
            for i, (sm, b) in enumerate(streams):
                ek, ev = cross_value(sm.cross[b], layer.layer_index)
                assert torch.equal(k[i], ek) and torch.equal(v[i], ev)
        else:
            with pytest.raises(CrossAttentionNotPopulatedError):
                layer.cross_kv("text")
        with pytest.raises(UnknownCacheError):
            layer.cross_kv("image")

    def prepare(
        self, streams: list[tuple[SessionModel, str]], num_chunks: int, commit: bool, run: bool, via_cache: bool
    ) -> ForwardContext | None:
        seq_len = num_chunks * CHUNK
        failure = self.predict_prepare(streams, num_chunks)
        if via_cache:
            call = self.cache.prepare_forward
            args = ([(sm.state, b) for sm, b in streams], seq_len, commit)
        else:
            call = streams[0][0].state.prepare_forward
            args = (tuple(b for _, b in streams), seq_len, commit)
        if failure is not None:
            event(f"prepare raised {failure.__name__}")
            self.expect_failure(failure, call, *args)
            return None
        free_before = set(self.cache.allocator.free_pages())
        ctx = call(*args)
        self.after_prepare(streams, num_chunks, commit, ctx, free_before)
        if run:
            self.run_attention(streams, ctx)
        return ctx

    # ================================================================== rules: sessions
    @precondition(lambda self: self.cache is not None and len(self.open_sessions) < MAX_SESSIONS)
    @rule()
    def open_session(self) -> None:
        state = self.cache.open_session()
        assert not state.is_closed and state.pages_in_use() == 0
        self.sessions.append(SessionModel(state))

    @precondition(lambda self: self.open_sessions)
    @rule(index=st.integers(0, MAX_SESSIONS), twice=st.booleans())
    def close(self, index: int, twice: bool) -> None:
        sm = self.pick(self.open_sessions, index)
        sm.state.close()
        if twice:
            sm.state.close()  # idempotent
        sm.closed = True
        sm.clear_self_attention()
        sm.cross.clear()
        assert sm.state.is_closed and sm.state.pages_in_use() == 0
        assert sm.state.session_id not in self.cache.sessions

    @precondition(lambda self: self.sessions)
    @rule(index=st.integers(0, 2 * MAX_SESSIONS), keep=st.sampled_from([(), ("text",), "text"]))
    def reset(self, index: int, keep) -> None:
        """Reset an open session, or reopen a closed one (at most MAX_SESSIONS open)."""
        pool = self.sessions if len(self.open_sessions) < MAX_SESSIONS else self.open_sessions
        sm = self.pick(pool, index)
        event("reset reopened a closed session" if sm.closed else "reset an open session")
        sm.state.reset(keep_cross_attention=keep)
        sm.closed = False
        sm.clear_self_attention()
        if not keep:
            sm.cross.clear()
        assert sm.state.session_id in self.cache.sessions

    # ================================================================== rules: forwards
    @precondition(lambda self: self.open_sessions)
    @rule(
        index=st.integers(0, MAX_SESSIONS),
        branches=st.sampled_from(BRANCH_SETS),
        num_chunks=st.integers(1, 3),
        run=st.booleans(),
        close_record=st.booleans(),
    )
    def denoise(self, index: int, branches: tuple[str, ...], num_chunks: int, run: bool, close_record: bool) -> None:
        """A non-committing forward: pending chunks (re)used, history untouched."""
        sm = self.pick(self.open_sessions, index)
        streams = [(sm, b) for b in branches]
        ctx = self.prepare(streams, num_chunks, commit=False, run=run, via_cache=False)
        if ctx is not None and close_record:
            self.commit_branches(sm, branches)  # closes the forward; pending pages stay reserved

    @precondition(lambda self: self.open_sessions)
    @rule(
        index=st.integers(0, MAX_SESSIONS),
        branches=st.sampled_from(BRANCH_SETS),
        num_chunks=st.integers(1, 3),
        run=st.booleans(),
        how=st.sampled_from(["commit_paged_context", "ctx.commit", "later"]),
    )
    def commit_forward(self, index: int, branches: tuple[str, ...], num_chunks: int, run: bool, how: str) -> None:
        """A committing forward, then ``commit_paged_context`` per branch (or ``ctx.commit()``, or later)."""
        sm = self.pick(self.open_sessions, index)
        streams = [(sm, b) for b in branches]
        ctx = self.prepare(streams, num_chunks, commit=True, run=run, via_cache=False)
        if ctx is None:
            return
        if how == "commit_paged_context":
            self.commit_branches(sm, branches)
        elif how == "ctx.commit":
            ctx.commit()
            self.model_finish(ctx, True)

    @precondition(lambda self: self.open_sessions)
    @rule(
        index=st.integers(0, MAX_SESSIONS),
        branches=st.sampled_from(BRANCH_SETS),
        steps=st.integers(1, 6),
        denoise_steps=st.integers(0, 2),
    )
    def rollout(self, index: int, branches: tuple[str, ...], steps: int, denoise_steps: int) -> None:
        """The generation loop: per chunk, a few denoising forwards then a committing one (reaches eviction)."""
        self.roll(self.pick(self.open_sessions, index), branches, steps, denoise_steps)

    def roll(self, sm: SessionModel, branches: tuple[str, ...], steps: int, denoise_steps: int = 0) -> None:
        streams = [(sm, b) for b in branches]
        for _ in range(steps):
            for _ in range(denoise_steps):
                if self.prepare(streams, 1, commit=False, run=False, via_cache=False) is None:
                    return
            if self.prepare(streams, 1, commit=True, run=False, via_cache=False) is None:
                return
            self.commit_branches(sm, branches)

    @precondition(lambda self: len(self.open_sessions) >= 2)
    @rule(
        i=st.integers(0, MAX_SESSIONS),
        j=st.integers(1, MAX_SESSIONS),
        b1=st.sampled_from(BRANCHES),
        b2=st.sampled_from(BRANCHES),
        num_chunks=st.integers(1, 2),
        commit=st.booleans(),
        run=st.booleans(),
    )
    def cross_session_forward(
        self, i: int, j: int, b1: str, b2: str, num_chunks: int, commit: bool, run: bool
    ) -> None:
        """One forward batching streams of two different sessions (``KVCache.prepare_forward``)."""
        pool = self.open_sessions
        s1, s2 = pool[i % len(pool)], pool[(i + j) % len(pool)]
        if s1 is s2:
            s2 = pool[(i + 1) % len(pool)]
        self.prepare([(s1, b1), (s2, b2)], num_chunks, commit=commit, run=run, via_cache=True)

    @precondition(lambda self: self.contexts)
    @rule(index=st.integers(0, 4), success=st.booleans())
    def finish_context(self, index: int, success: bool) -> None:
        """``ctx.commit()`` / ``ctx.abort()`` on an earlier forward: only its still-pending streams are touched."""
        ctx = self.contexts[index % len(self.contexts)]
        if success:
            ctx.commit()
        else:
            ctx.abort()
        self.model_finish(ctx, success)

    @precondition(lambda self: self.open_sessions)
    @rule(
        index=st.integers(0, MAX_SESSIONS),
        branches=st.sampled_from(BRANCH_SETS),
        num_chunks=st.integers(1, 3),
        commit=st.booleans(),
        fail=st.booleans(),
        use_module=st.booleans(),
    )
    def forward_with_block(
        self, index: int, branches: tuple[str, ...], num_chunks: int, commit: bool, fail: bool, use_module: bool
    ) -> None:
        """``with state.prepare_forward(...)``: commit on success; an exception inside aborts (history as before)."""
        sm = self.pick(self.open_sessions, index)
        streams = [(sm, b) for b in branches]
        failure = self.predict_prepare(streams, num_chunks)
        seq_len = num_chunks * CHUNK
        if failure is not None:
            self.expect_failure(failure, sm.state.prepare_forward, branches, seq_len, commit)
            return
        free_before = set(self.cache.allocator.free_pages())
        history_before = {b: sm.state.visible_chunks(b) for b in branches}
        box: dict[str, ForwardContext] = {}

        def body() -> None:
            with sm.state.prepare_forward(branches, seq_len, commit) as fwd:
                box["ctx"] = fwd
                self.after_prepare(streams, num_chunks, commit, fwd, free_before)
                if use_module:
                    x = torch.randn(len(branches), seq_len, HEAD_DIM * 2, generator=self.gen)
                    with torch.no_grad():
                        for layer in fwd.layers:
                            y = self.attn(x, layer)
                            assert y.shape == x.shape and torch.isfinite(y).all()
                            # The layer wrote its projected K into the pending pages.
                            pend = [p for c in sm.state.pending_chunks(branches[0]) for p in c]
                            k = self.attn.to_k(x[0]).view(seq_len, 1, HEAD_DIM)
                            written = self.cache.pool.k_pages(layer.layer_index)[pend].reshape(k.shape)
                            torch.testing.assert_close(written, k)
                if fail:
                    raise Boom("injected failure inside the forward")

        if fail:
            with pytest.raises(Boom):
                body()
            for b in branches:
                assert sm.state.visible_chunks(b) == history_before[b]
                assert sm.state.pending_chunks(b) == ()
        else:
            body()
        self.model_finish(box["ctx"], not fail)

    @precondition(lambda self: self.open_sessions)
    @rule(index=st.integers(0, MAX_SESSIONS), branch=st.sampled_from(BRANCHES))
    def commit_branch(self, index: int, branch: str) -> None:
        """``commit_paged_context`` whatever the branch's state (no forward open: a no-op)."""
        sm = self.pick(self.open_sessions, index)
        sm.state.commit_paged_context(branch)
        self.model_commit(sm, branch)

    @precondition(lambda self: self.open_sessions)
    @rule(index=st.integers(0, MAX_SESSIONS), branch=st.sampled_from((None,) + BRANCHES))
    def abort(self, index: int, branch: str | None) -> None:
        sm = self.pick(self.open_sessions, index)
        sm.state.abort(branch)
        for b in BRANCHES if branch is None else (branch,):
            self.model_abort(sm, b)

    # ================================================================== rules: cross-attention
    @precondition(lambda self: self.open_sessions)
    @rule(
        index=st.integers(0, MAX_SESSIONS),
        branch=st.sampled_from(BRANCHES),
        mode=st.sampled_from(["ok", "ok", "raise_midway", "bad_shape", "too_few", "too_many"]),
    )
    def populate_cross(self, index: int, branch: str, mode: str) -> None:
        sm = self.pick(self.open_sessions, index)
        tag = float(next(self.tags))

        def layers():
            for layer in range(NUM_LAYERS + (1 if mode == "too_many" else 0)):
                if mode == "raise_midway" and layer == NUM_LAYERS - 1:
                    raise Boom("producer failed after the first layer")
                if mode == "too_few" and layer == NUM_LAYERS - 1:
                    return
                if mode == "bad_shape" and layer == NUM_LAYERS - 1:
                    yield torch.zeros(CROSS_TOKENS + 1, 1, HEAD_DIM), torch.zeros(CROSS_TOKENS + 1, 1, HEAD_DIM)
                    return
                yield cross_value(tag, layer)

        if mode == "ok":
            sm.state.populate_cross_attention(branch, "text", layers())
            sm.cross[branch] = tag
            return
        exc = Boom if mode == "raise_midway" else TensorMismatchError
        self.expect_failure(exc, sm.state.populate_cross_attention, branch, "text", layers())

    @precondition(lambda self: self.open_sessions)
    @rule(index=st.integers(0, MAX_SESSIONS))
    def clear_cross(self, index: int) -> None:
        sm = self.pick(self.open_sessions, index)
        visible = {b: sm.state.visible_chunks(b) for b in BRANCHES}
        sm.state.clear_cross_attention()
        sm.cross.clear()
        assert {b: sm.state.visible_chunks(b) for b in BRANCHES} == visible  # self-attention untouched

    # ================================================================== rules: sharing
    @precondition(lambda self: self.open_sessions and len(self.open_sessions) < MAX_SESSIONS)
    @rule(
        index=st.integers(0, MAX_SESSIONS),
        branches=st.sampled_from([None, ("cond",), ("uncond",), ("uncond", "cond")]),
        share_cross=st.booleans(),
        parent_steps=st.integers(0, 4),
    )
    def fork(self, index: int, branches: tuple[str, ...] | None, share_cross: bool, parent_steps: int) -> None:
        """A child session sharing the parent's resident chunks by refcount (zero pages allocated)."""
        parent = self.pick(self.open_sessions, index)
        names = BRANCHES if branches is None else branches
        free_before = self.cache.allocator.free_pages()
        child_state = parent.state.fork(branches=branches, share_cross_attention=share_cross)
        assert self.cache.allocator.free_pages() == free_before, "fork must not allocate"
        child = SessionModel(child_state)
        for b in names:
            child.committed[b] = list(parent.committed[b])  # same visible chunks, same offset
            if share_cross and b in parent.cross:
                child.cross[b] = parent.cross[b]
        self.sessions.append(child)
        event("forked a session")
        # The parent moves on: its evictions must not recycle pages the child still sees.
        self.roll(parent, ("cond",) if branches is None else branches, parent_steps)

    @precondition(lambda self: self.open_sessions)
    @rule(i=st.integers(0, MAX_SESSIONS), j=st.integers(0, MAX_SESSIONS), branch=st.sampled_from(BRANCHES))
    def share_sinks(self, i: int, j: int, branch: str) -> None:
        """Start an empty branch from another session's sink chunks; a non-empty branch is refused unchanged."""
        target, source = self.pick(self.open_sessions, i), self.pick(self.open_sessions, j)
        if target.committed[branch] or target.pending[branch]:
            self.expect_failure(SpecError, target.state.share_sinks_from, source.state, branch, match=repr(branch))
            return
        target.state.share_sinks_from(source.state, branch)
        target.committed[branch] = list(source.committed[branch][: self.spec.sink_chunks])
        target.extent[branch] = None  # an empty branch restarts from scratch (its extent is released)
        event("shared sinks" if target.committed[branch] else "shared sinks (none yet)")

    @precondition(lambda self: self.open_sessions)
    @rule(i=st.integers(0, MAX_SESSIONS), j=st.integers(0, MAX_SESSIONS), branch=st.sampled_from((None,) + BRANCHES))
    def share_cross(self, i: int, j: int, branch: str | None) -> None:
        """Reuse another session's populated cross cache; refused unchanged if any branch lacks it."""
        target, source = self.pick(self.open_sessions, i), self.pick(self.open_sessions, j)
        names = BRANCHES if branch is None else (branch,)
        if not all(b in source.cross for b in names):
            self.expect_failure(
                CrossAttentionNotPopulatedError, target.state.share_cross_attention_from, source.state, "text", branch
            )
            return
        target.state.share_cross_attention_from(source.state, "text", branch)
        for b in names:
            target.cross[b] = source.cross[b]

    # ================================================================== rules: misuse
    @precondition(lambda self: self.open_sessions)
    @rule(
        index=st.integers(0, MAX_SESSIONS),
        kind=st.sampled_from(
            [
                "unknown_branch_prepare",
                "unknown_branch_commit",
                "unknown_branch_abort",
                "unknown_branch_populate",
                "unknown_cache",
                "unknown_keep",
                "misaligned",
                "seq_none",
                "duplicate_stream",
                "duplicate_session_id",
                "cross_before_populate",
                "fork_unknown_branch",
                "fork_duplicate_id",
            ]
        ),
        seq_len=st.sampled_from([0, -CHUNK, 1, CHUNK + 1, 3 * CHUNK - 1]),
    )
    def misuse(self, index: int, kind: str, seq_len: int) -> None:
        sm = self.pick(self.open_sessions, index)
        state = sm.state
        if kind == "unknown_branch_prepare":
            self.expect_failure(UnknownBranchError, state.prepare_forward, ("nope", "cond"), CHUNK, False, match="nope")
        elif kind == "unknown_branch_commit":
            self.expect_failure(UnknownBranchError, state.commit_paged_context, "nope", match="nope")
        elif kind == "unknown_branch_abort":
            self.expect_failure(UnknownBranchError, state.abort, "nope", match="nope")
        elif kind == "unknown_branch_populate":
            self.expect_failure(
                UnknownBranchError, state.populate_cross_attention, "nope", "text", [cross_value(0.0, 0)] * NUM_LAYERS
            )
        elif kind == "unknown_cache":
            self.expect_failure(
                UnknownCacheError, state.populate_cross_attention, "cond", "image", [cross_value(0.0, 0)] * NUM_LAYERS,
                match="image",
            )
        elif kind == "unknown_keep":
            self.expect_failure(UnknownCacheError, state.reset, keep_cross_attention=("text", "image"), match="image")
        elif kind == "misaligned":
            self.expect_failure(SequenceLengthError, state.prepare_forward, ("cond",), seq_len, False, match=str(CHUNK))
            self.expect_failure(SequenceLengthError, state.get_kv_caches, "uncond", seq_len, True)
        elif kind == "seq_none":
            self.expect_failure(SequenceLengthError, state.get_kv_caches, "cond", None, True)
        elif kind == "duplicate_stream":
            streams = [(state, "cond"), (state, "cond")]
            exc = self.predict_prepare([(sm, "cond"), (sm, "cond")], 1)
            self.expect_failure(exc, self.cache.prepare_forward, streams, CHUNK, False)
        elif kind == "duplicate_session_id":
            self.expect_failure(SpecError, self.cache.open_session, state.session_id, match=state.session_id)
        elif kind == "fork_unknown_branch":
            self.expect_failure(UnknownBranchError, state.fork, branches=("cond", "nope"), match="nope")
        elif kind == "fork_duplicate_id":
            self.expect_failure(SpecError, state.fork, state.session_id, match=state.session_id)
        elif kind == "cross_before_populate":
            missing = [b for b in BRANCHES if b not in sm.cross]
            if missing:
                self.expect_failure(CrossAttentionNotPopulatedError, state.get_cross_attention_kv, missing[0], "text")

    @precondition(lambda self: any(r is not None and r.commit for s in self.open_sessions for r in s.record.values()))
    @rule(index=st.integers(0, 2 * MAX_SESSIONS), commit=st.booleans(), num_chunks=st.integers(1, 3))
    def replace_uncommitted(self, index: int, commit: bool, num_chunks: int) -> None:
        """Preparing over a branch whose committing forward is still open raises and changes nothing."""
        candidates = [(s, b) for s in self.open_sessions for b, r in s.record.items() if r is not None and r.commit]
        sm, b = candidates[index % len(candidates)]
        self.expect_failure(
            PendingContextError, sm.state.prepare_forward, (b,), num_chunks * CHUNK, commit, match=repr(b)
        )

    @precondition(lambda self: self.open_sessions)
    @rule(index=st.integers(0, MAX_SESSIONS), branches=st.sampled_from(BRANCH_SETS), commit=st.booleans())
    def exhaust_capacity(self, index: int, branches: tuple[str, ...], commit: bool) -> None:
        """A forward asking for more pages than are free raises CapacityError and changes nothing."""
        sm = self.pick(self.open_sessions, index)
        free_chunks = self.cache.allocator.num_free // self.ppc
        num_chunks = max(len(sm.pending[b]) for b in branches) + free_chunks + 1 + self.extent_chunks
        streams = [(sm, b) for b in branches]
        exc = self.predict_prepare(streams, num_chunks)
        if exc is None:  # cannot happen: one branch alone needs more than is free
            raise AssertionError("capacity model broken")
        before = self.snapshot()
        with pytest.raises(exc) as info:
            sm.state.prepare_forward(branches, num_chunks * CHUNK, commit)
        assert self.snapshot() == before
        if exc is CapacityError:
            assert info.value.free == self.cache.allocator.num_free
            assert info.value.needed > info.value.free
            assert str(info.value.needed) in str(info.value) and str(info.value.free) in str(info.value)

    @precondition(lambda self: self.open_sessions)
    @rule(
        index=st.integers(0, MAX_SESSIONS),
        branches=st.sampled_from(BRANCH_SETS),
        num_chunks=st.integers(1, 3),
        commit=st.booleans(),
    )
    def plan_fails(self, index: int, branches: tuple[str, ...], num_chunks: int, commit: bool) -> None:
        """``plan()`` raising after pages were taken: the prepare is rolled back exactly (free-list order too)."""
        sm = self.pick(self.open_sessions, index)
        failure = self.predict_prepare([(sm, b) for b in branches], num_chunks) or Boom
        self.backend.fail = True
        try:
            self.expect_failure(failure, sm.state.prepare_forward, branches, num_chunks * CHUNK, commit)
        finally:
            self.backend.fail = False

    @precondition(lambda self: self.closed_sessions)
    @rule(
        index=st.integers(0, 2 * MAX_SESSIONS),
        op=st.sampled_from(
            [
                "prepare", "get_kv_caches", "commit", "abort", "populate", "clear", "visible", "batch", "fork",
                "share_sinks_from_closed", "share_cross_from_closed",
            ]
        ),
    )
    def closed_session_misuse(self, index: int, op: str) -> None:
        sm = self.pick(self.closed_sessions, index)
        state = sm.state
        calls = {
            "prepare": (state.prepare_forward, ("cond",), CHUNK, False),
            "get_kv_caches": (state.get_kv_caches, "cond", CHUNK, True),
            "commit": (state.commit_paged_context, "cond"),
            "abort": (state.abort,),
            "populate": (state.populate_cross_attention, "cond", "text", [cross_value(0.0, 0)] * NUM_LAYERS),
            "clear": (state.clear_cross_attention,),
            "visible": (state.visible_chunks, "uncond"),
            "fork": (state.fork,),
        }
        if self.open_sessions:
            other = self.open_sessions[0].state
            calls["share_sinks_from_closed"] = (other.share_sinks_from, state, "cond")
            calls["share_cross_from_closed"] = (other.share_cross_attention_from, state, "text", "cond")
        if op not in calls and op != "batch":
            return  # needs an open session
        if op == "batch":
            # The closed session first: an open stream first could legitimately fail another check.
            streams = [(state, "cond")]
            if self.open_sessions:
                streams.append((self.open_sessions[0].state, "uncond"))
            fn, args = self.cache.prepare_forward, (streams, CHUNK, False)
        else:
            fn, *args = calls[op]
        self.expect_failure(SessionClosedError, fn, *args, match=state.session_id)

    # ================================================================== invariants
    @invariant()
    def refcounts_equal_references(self) -> None:
        if self.cache is None:
            return
        alloc = self.cache.allocator
        refs = self.chunk_references()
        for sm in self.open_sessions:
            for b in BRANCHES:
                refs.update(sm.extent[b] or ())  # the extent's own reservation reference
        for page in range(alloc.num_pages):
            assert alloc.refcount(page) == refs[page], (
                f"page {page}: refcount {alloc.refcount(page)}, referenced {refs[page]} time(s) by open sessions"
            )

    @invariant()
    def pending_pages_are_exclusive(self) -> None:
        """Forwards write pending pages: no other chunk (e.g. a fork's history) may reference them."""
        if self.cache is None:
            return
        refs = self.chunk_references()
        for sm in self.open_sessions:
            for b in BRANCHES:
                for chunk in sm.pending[b]:
                    shared = [p for p in chunk if refs[p] != 1]
                    assert not shared, f"{sm.state.session_id}/{b}: pending pages {shared} are also visible elsewhere"

    @invariant()
    def free_and_used_partition_the_pool(self) -> None:
        if self.cache is None:
            return
        alloc = self.cache.allocator
        free, used = alloc.free_pages(), alloc.used_pages()
        assert len(free) == len(set(free)), f"duplicate page in the free list {free}"
        assert not set(free) & set(used), f"pages both free and used: {set(free) & set(used)}"
        assert set(free) | set(used) == set(range(alloc.num_pages))
        alloc.check_invariants()
        stats = self.cache.stats()
        assert stats.pages_used == len(used) and stats.pages_free == len(free)

    @invariant()
    def sessions_match_model(self) -> None:
        if self.cache is None:
            return
        assert set(self.cache.sessions) == {sm.state.session_id for sm in self.open_sessions}
        for sm in self.sessions:
            state = sm.state
            assert state.is_closed == sm.closed
            if sm.closed:
                assert state.pages_in_use() == 0
                continue
            for b in BRANCHES:
                expected = self.visible(sm, b)
                assert list(state.visible_chunks(b)) == expected, (
                    f"{state.session_id}/{b}: visible {state.visible_chunks(b)}, expected first "
                    f"{self.spec.sink_chunks} + last {self.spec.window_chunks} of {sm.committed[b]}"
                )
                assert list(state.pending_chunks(b)) == sm.pending[b]
                assert state.committed_chunks(b) == len(sm.committed[b])
                assert state.token_offset(b) == len(sm.committed[b]) * CHUNK
                rec, lib = sm.record[b], state._pending[b]
                if rec is None:
                    assert lib is None
                else:
                    assert lib is not None and lib.commit_current == rec.commit
                    assert lib.num_chunks == rec.num_chunks and lib.context is rec.ctx
                populated = state.is_cross_attention_populated(b, "text")
                assert populated == (b in sm.cross)
                if populated:
                    got = state.get_cross_attention_kv(b, "text")
                    assert len(got) == NUM_LAYERS
                    for layer, d in enumerate(got):
                        ek, ev = cross_value(sm.cross[b], layer)
                        assert torch.equal(d["k"], ek) and torch.equal(d["v"], ev)
            held = sum(len(c) for b in BRANCHES for c in self.visible(sm, b) + sm.pending[b])
            held += sum(len(sm.extent[b] or ()) for b in BRANCHES)
            assert state.pages_in_use() == held
            for b in BRANCHES:
                assert tuple(state._branches[b].extent) == (sm.extent[b] or ())

    def teardown(self) -> None:
        if self.cache is None:
            return
        for sm in self.sessions:
            sm.state.close()
        alloc = self.cache.allocator
        assert alloc.num_free == alloc.num_pages, f"leak: {alloc.used_pages()} still used after closing every session"
        assert all(alloc.refcount(p) == 0 for p in range(alloc.num_pages))
        alloc.check_invariants()
        assert self.cache.sessions == {}


TestSessionStateMachine = SessionStateMachine.TestCase
# More and longer runs than the profile's default: this machine is the main leak/consistency net.
TestSessionStateMachine.settings = settings(
    max_examples=settings.default.max_examples * 6,
    stateful_step_count=settings.default.stateful_step_count * 2,
)


def test_admission_keeps_its_promise_with_forks() -> None:
    """``sessions_that_fit``: admitted sessions *and the open ones* can all run to their peak.

    (Refusing the admission would also be correct; accepting it and then running out is not.)
    """
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, chunk_size=CHUNK, page_size=CHUNK,
                       sink_chunks=0, window_chunks=2, branches=("main",), dtype="float32")
    cache = KVCache(spec, num_pages=8, backend="reference", contiguous_extents=False)

    def commit_one(state: KVState) -> None:
        state.prepare_forward(("main",), CHUNK, True)
        state.commit_paged_context("main")

    parent = cache.open_session("parent")
    commit_one(parent)
    commit_one(parent)  # window full: 2 pages
    child = parent.fork("child")  # shares both pages
    try:
        admitted = [cache.admit_session("admitted")]  # the cache says one more session fits at its peak
    except CapacityError:
        admitted = []
    for state in [child, *admitted]:  # each runs to its peak: 2 committed + 1 pending, all pages its own
        commit_one(state)
        commit_one(state)
        state.prepare_forward(("main",), CHUNK, False)
    # The parent is still within its own peak (2 committed + 1 pending): this must not run out of pages.
    parent.prepare_forward(("main",), CHUNK, False)
