"""Stateful property test of the session API (``KVCache`` / ``KVState``) against a plain model.

A tiny CPU float32 pool (2 layers, 1 KV head, head_dim 2, chunk_size 2 or 4, page size
1 or 2, sinks 0..2, window 0..3 or unbounded, branches ``("cond", "uncond")``, one
cross cache ``"text"`` of 3 tokens) just big enough that capacity errors happen.

Chunks have **variable lengths**: a forward's pending chunks may each hold any positive
multiple of the page size up to ``chunk_size`` tokens (an image-to-video first chunk of one
latent frame, then full chunks; or mixed patterns such as ``(1, 4, 2)``), passed as
``chunk_lengths=(...)`` or, for one shorter chunk or full chunks only, by ``seq_len`` alone.
Every stream of a forward has the same lengths; different forwards of a branch (a denoising
loop re-prepared with other lengths, later chunks) may differ.
Up to two ``KVCache`` instances live side by side (each with its own pool,
``contiguous_extents``, ``max_forward_contexts`` of 1, 2, 3 or 64, ``check_finite``);
either may be closed at any point and a new one opened.

Model
-----
* per session and branch: every chunk ever committed as a :class:`ChunkRecord` (the page
  tuple the library reported, its token count -- the length the model asked for --, its
  absolute start position -- the model's running sum of committed tokens --, and the pool
  contents it was committed with), the pending chunks with the token count of each, the
  open forward it belongs to, the extent, the cross cache contents;
* per forward: one :class:`TxModel` for the whole transaction (all its streams, of up
  to three sessions), with status open / committed / completed (a denoising forward that
  finished) / aborted / superseded, mirroring
  ``ForwardTransaction``. Finishing any member (``commit_paged_context``, ``abort``,
  ``ctx.commit()/abort()``, the ``with`` exit, ``reset``/``close`` of a member session,
  ``KVCache.close``) finishes every stream of it, or none;
* per cache: the forward-context registry (an LRU ``OrderedDict``: same streams ->
  same reused ``ForwardContext``; beyond ``max_forward_contexts`` the least recently
  used idle one is released), the peak of pages used, and :class:`PoolContents`: what
  every page of the pool must hold. Forwards write K/V carrying a unique id per
  (forward, stream, token, layer), and the model applies each write to the pages it
  says the forward owns (its pending pages, in token order).

Checked after every step
------------------------
* each page's refcount == the references the model counts (visible + pending chunks of
  every open session, extent reservations); pending pages are exclusive; free and used
  pages partition the pool; ``peak_pages_used`` == the model's peak;
* visible history == first S + last W of the committed list (list slicing: sinks and
  windows count chunks, whatever their lengths); ``token_offset`` / ``committed_tokens`` ==
  the tokens the model committed; each visible chunk's ``(start, tokens)`` span and every
  history position; each pending chunk's length; ``open_forward()`` is the model's
  transaction (identity, members, commit flag, chunks);
* every open forward, as its attention sees it: ``positions``, ``key_positions()`` (the
  model's position of every visible key, ``-1`` padding), ``to_dense()`` (history visible,
  block-causal over the model's pending chunk lengths -- or every pending key under the
  ``pending_attention="bidirectional"`` rule, said per forward or by the spec's default --
  ANDed with the token mask), and the
  dense K/V the reference backend gathers for it, per layer, bit for bit == what the model
  says each resident chunk held when committed, position by position, then what this
  forward wrote into its pending chunks;
* the pool, bit for bit, == the model's contents: no write ever lands outside the
  pending pages of an open forward; every visible committed chunk still holds what it
  held when committed (shared/forked pages included) until its pages are freed;
* the context registry (identity and LRU order), each context's ``released`` /
  ``is_active`` and transaction, every tracked transaction's status.

Rules (besides sessions, cross caches, forks and sink sharing): forwards over 1-3 sessions
(denoising or committing, of 1-3 chunks of mixed lengths, ``token_mask``, run through the op
or ``ChunkSelfAttention``, finished
through any member or left open); ``with`` blocks that raise (``Exception``, a custom
``BaseException``, ``KeyboardInterrupt``) or finish the forward inside and keep running; stale
contexts (committed, completed, aborted, superseded, released by the LRU / ``close``); exceptions
injected into a commit or abort (``BranchHistory.plan_commit`` on the 2nd stream,
``PageAllocator.decref``) and a real SIGINT while a commit is applied; a user retention policy
breaking its contract at a commit (``tests/support/policies.py``: bad types, unsorted, duplicates, an evicted
chunk brought back, more than declared, ...: ``SpecError``, nothing changed); NaN/Inf K/V under
``check_finite``; ``plan()`` raising; prompt-switch re-caches (``prepare_recache`` over 1-3 sessions,
``keep_sinks`` either way: positions, key positions, mask, gathered K/V and write-protected sinks checked,
then committed -- records swapped for the rebuilt pages, those in fresh pages copied into ring slots the
commit frees -- or aborted with free order and sessions unchanged,
or refused unchanged); admission; ``KVCache.close()``; misuse across two caches;
rollouts whose first chunk is short (image-to-video) or whose chunks vary; invalid
``chunk_lengths`` (wrong sum, off the page grid, above ``chunk_size``, empty).

Failing operations (misuse, capacity, closed session/cache, a foreign cache's session,
a ``plan()`` that raises, a stale context, an exception injected into a commit, a misbehaving policy) must
change nothing: allocator free order and refcounts, peak, pool contents, context
registry, every transaction and every session are snapshotted before and compared after.
Closing every session (and cache) at the end must free every page.

FP8
---
:class:`FP8SessionStateMachine` runs every rule and check above over an FP8 pool
(``kv_dtype="float8_e4m3fn"``, fixed scales set by ``set_kv_scales`` right after each cache
is created): the model's contents are the FP8 round trip of what each forward wrote, compared
bit for bit (as values and as bytes), and each output is checked against a softmax over them.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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
from ardiff_modules.backends import ReferenceBackend
from ardiff_modules.backends.reference import ReferencePlan
from ardiff_modules.backends.segmented import RelativeSinkPlan
from ardiff_modules.errors import (
    BackendUnavailableError,
    CacheClosedError,
    CapacityError,
    CommitFailedError,
    ForwardFinishedError,
    IncompleteForwardError,
    NonFiniteKVError,
    PendingContextError,
    PlanNotFoundError,
    SequenceLengthError,
    SessionClosedError,
    SpecError,
    TensorMismatchError,
    UnknownBranchError,
    UnknownCacheError,
)
from ardiff_modules.forward import ForwardTransaction
from ardiff_modules.history import BranchHistory
from ardiff_modules.quant import dequantize, quantize
from tests.support.kv_writes import write_every_layer
from tests.support.policies import BAD_KINDS, BAD_MESSAGES, Misbehaving
from tests.support.pool_model import PoolContents, bits, expected_visible, longest_run, same_bits, token_kv

BRANCHES = ("cond", "uncond")
BRANCH_SETS = [("cond",), ("uncond",), ("cond", "uncond"), ("uncond", "cond")]
CHUNK = 2  # chunk_size of the standalone tests below (the machine draws 2 or 4)
#: (chunk_size, page_size) of the machine: 1..4 pages per chunk, so chunks of 1, 2, 3 or 4 tokens.
GEOMETRIES = [(2, 1), (2, 2), (4, 1), (4, 2)]
#: Pages of one pending chunk: ``None`` a full chunk, else that many pages (capped at pages_per_chunk).
CHUNK_PAGES = st.sampled_from([None, None, None, 1, 1, 2, 3])
#: A forward's shape, drawn: the pages of each pending chunk, and whether to pass ``chunk_lengths``
#: even when ``seq_len`` alone would say it (it must whenever the lengths are mixed).
#: The rule between a forward's pending chunks, as the call says it: ``None`` (the spec's default) or by name.
PENDING_RULES = st.sampled_from([None, None, "block_causal", "bidirectional"])
SHAPES = st.tuples(st.lists(CHUNK_PAGES, min_size=1, max_size=3), st.booleans(), PENDING_RULES)
SHAPES_2 = st.tuples(st.lists(CHUNK_PAGES, min_size=1, max_size=2), st.booleans(), PENDING_RULES)
HEAD_DIM = 2
NUM_LAYERS = 2
CROSS_TOKENS = 3
MAX_SESSIONS = 3  # open sessions per cache (a forward batches up to 3 sessions)
MAX_OPEN_CACHES = 2
MAX_CACHES = 4  # closed ones are kept for misuse checks
TRACKED_CONTEXTS = 8

Chunk = tuple[int, ...]
Key = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Shape:
    """The pending chunks of one forward: the tokens of each, and how the call says them."""

    lengths: tuple[int, ...]
    #: ``prepare_forward(..., chunk_lengths=lengths)``; else ``seq_len`` alone (full chunks, or one shorter chunk).
    explicit: bool = False
    #: ``prepare_forward(..., pending_attention=rule)``; ``None``: not passed (the spec's default).
    rule: str | None = None
    #: The rule in force: every pending chunk sees every pending chunk (else block-causal).
    bidirectional: bool = False

    @property
    def num_chunks(self) -> int:
        return len(self.lengths)

    @property
    def seq_len(self) -> int:
        return sum(self.lengths)

    def chunk_of(self) -> torch.Tensor:
        """int64 ``[seq_len]``: the pending chunk of each current token (the model's own lengths)."""
        return torch.repeat_interleave(torch.arange(self.num_chunks), torch.tensor(self.lengths))

    def pending_mask(self) -> torch.Tensor:
        """bool ``[seq_len, seq_len]``: query token i sees pending token j iff chunk(j) <= chunk(i), or always
        under the bidirectional rule."""
        if self.bidirectional:
            return torch.ones(self.seq_len, self.seq_len, dtype=torch.bool)
        chunk_of = self.chunk_of()
        return chunk_of[None, :] <= chunk_of[:, None]


@dataclass(frozen=True)
class ChunkRecord:
    """One committed chunk, as the model sees it."""

    pages: Chunk
    tokens: int  # the length the forward asked for
    start: int  # absolute position of its first token: tokens committed on the branch before it
    data: torch.Tensor  # pool contents [layers, 2, pages, page_size, heads, dim] when committed

    def positions(self) -> list[int]:
        return list(range(self.start, self.start + self.tokens))

    def token_data(self) -> torch.Tensor:
        """``[layers, 2, tokens, heads * dim]``: K and V of every layer, in position order."""
        return self.data.reshape(*self.data.shape[:2], self.tokens, -1)


class Boom(Exception):
    """Injected failure (inside a forward, a commit, a plan or a cross-cache producer)."""


class Halt(BaseException):
    """An injected BaseException that is not an Exception (like a user's own control-flow signal)."""


INTERRUPTS: dict[str, type[BaseException]] = {"boom": Boom, "halt": Halt, "keyboard": KeyboardInterrupt}


class FlakyPlanBackend(ReferenceBackend):
    """The reference backend, whose ``plan()`` raises ``fail`` (an exception type) while it is set."""

    def __init__(self) -> None:
        super().__init__()
        self.fail: type[BaseException] | None = None

    def plan(self, *args, **kwargs):  # signature-agnostic on purpose
        if self.fail is not None:
            raise self.fail("injected failure while planning")
        return super().plan(*args, **kwargs)


@dataclass(eq=False)
class CacheModel:
    cache: KVCache
    backend: FlakyPlanBackend
    extents: bool
    extent_chunks: int
    max_contexts: int
    check_finite: bool
    pool: PoolContents
    label: str
    #: The forward-context registry: key -> context, least recently used first.
    registry: OrderedDict[Key, ForwardContext] = field(default_factory=OrderedDict)
    peak: int = 0
    closed: bool = False


@dataclass(eq=False)
class TxModel:
    """One prepared forward (all its streams), as the model sees it."""

    cm: CacheModel
    streams: list[tuple[SessionModel, str]]
    commit: bool
    shape: Shape
    ctx: ForwardContext
    tx: ForwardTransaction  # the library's transaction object, for identity checks
    token_mask: torch.Tensor | None = None
    status: str = "open"
    #: Layers the forward wrote (a commit needs every one: else IncompleteForwardError, aborted).
    written: set[int] = field(default_factory=set)

    @property
    def is_open(self) -> bool:
        return self.status == "open"

    @property
    def num_chunks(self) -> int:
        return self.shape.num_chunks

    def pending_pages(self) -> list[int]:
        return [p for sm, b in self.streams for c in sm.pending[b] for p in c]


@dataclass(eq=False)
class SessionModel:
    state: KVState
    cm: CacheModel
    closed: bool = False
    #: Every chunk ever committed (evicted ones included), oldest first.
    committed: dict[str, list[ChunkRecord]] = field(default_factory=lambda: {b: [] for b in BRANCHES})
    pending: dict[str, list[Chunk]] = field(default_factory=lambda: {b: [] for b in BRANCHES})
    #: Tokens of each pending chunk (the lengths of the forward that last prepared them).
    pending_tokens: dict[str, list[int]] = field(default_factory=lambda: {b: [] for b in BRANCHES})
    forward: dict[str, TxModel | None] = field(default_factory=lambda: dict.fromkeys(BRANCHES))
    cross: dict[str, float] = field(default_factory=dict)  # branch -> tag of the populated "text" cache
    extent: dict[str, tuple[int, ...] | None] = field(default_factory=lambda: dict.fromkeys(BRANCHES))

    def clear_self_attention(self) -> None:
        for b in BRANCHES:
            self.committed[b] = []
            self.drop_pending(b)
            self.forward[b] = None
            self.extent[b] = None

    def drop_pending(self, b: str) -> None:
        self.pending[b] = []
        self.pending_tokens[b] = []

    def committed_tokens(self, b: str) -> int:
        """Tokens ever committed on ``b`` (evicted included): the absolute position of the next pending token."""
        return sum(rec.tokens for rec in self.committed[b])


def cross_value(tag: float, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.full((CROSS_TOKENS, 1, HEAD_DIM), tag + layer)
    return k, -k


class SessionStateMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.caches: list[CacheModel] = []
        self.sessions: list[SessionModel] = []
        self.contexts: list[ForwardContext] = []  # recently prepared contexts, for stale use / ctx.commit()
        self.ctx_tx: dict[ForwardContext, TxModel] = {}  # every context seen -> its latest transaction
        self.released: set[ForwardContext] = set()  # contexts the model says the cache released
        self.txs: list[TxModel] = []  # recent transactions, whose status is checked
        self.tags = itertools.count(1)
        self.next_id = 1  # K/V ids: one per (forward, stream, token, layer)
        self.gen = torch.Generator().manual_seed(0)
        with torch.random.fork_rng():  # deterministic weights without touching the global RNG
            torch.manual_seed(0)
            # 2 query heads over 1 KV head (GQA), head_dim 2: the layer writes K/V into the tiny pool.
            self.attn = ChunkSelfAttention(2 * HEAD_DIM, 2, num_kv_heads=1, head_dim=HEAD_DIM)

    # ================================================================== setup
    @initialize(
        sink=st.integers(0, 2),
        window=st.sampled_from([0, 1, 2, 3, None]),
        geometry=st.sampled_from(GEOMETRIES),
        pending_default=st.sampled_from(["block_causal", "bidirectional"]),
        pool_chunks=st.integers(3, 18),
        extents=st.booleans(),
        max_contexts=st.sampled_from([1, 2, 3, 64]),
        check_finite=st.booleans(),
        sessions=st.integers(1, MAX_SESSIONS),
        relative=st.booleans(),
    )
    def setup(
        self, sink: int, window: int | None, geometry: tuple[int, int], pending_default: str, pool_chunks: int,
        extents: bool, max_contexts: int, check_finite: bool, sessions: int, relative: bool,
    ) -> None:
        self.chunk, page_size = geometry
        self.spec = KVCacheSpec(
            num_layers=NUM_LAYERS,
            num_kv_heads=1,
            head_dim=HEAD_DIM,
            chunk_size=self.chunk,
            page_size=page_size,
            sink_chunks=sink,
            window_chunks=window,
            branches=BRANCHES,
            cross_attention=(CrossAttentionSpec("text", CROSS_TOKENS),),
            dtype="float32",
            pending_attention=pending_default,
            relative_sinks=relative and sink > 0,
            **self.spec_extra(),
        )
        if self.spec.relative_sinks:
            event("relative-position sinks")
        self.ppc = self.spec.pages_per_chunk
        self.page = page_size
        event(f"geometry: chunk_size={self.chunk} page_size={page_size}, pending rule default {pending_default}")
        cm = self.new_cache(pool_chunks, extents, max_contexts, check_finite)
        for _ in range(sessions):
            self.sessions.append(SessionModel(cm.cache.open_session(), cm))

    def new_cache(self, pool_chunks: int, extents: bool, max_contexts: int, check_finite: bool) -> CacheModel:
        window = self.spec.window_chunks
        extents = extents and window is not None
        extent_chunks = self.spec.sink_chunks + window + 1 if extents else 0
        if extents:
            pool_chunks += extent_chunks  # room for at least one extent
        backend = FlakyPlanBackend()
        cache = KVCache(
            self.spec, num_pages=pool_chunks * self.ppc, device="cpu", backend=backend, contiguous_extents=extents,
            max_forward_contexts=max_contexts, check_finite=check_finite,
        )
        self.configure_cache(cache)
        assert cache.num_forward_contexts == 0 and cache.forward_contexts() == ()
        cm = CacheModel(
            cache, backend, extents, extent_chunks, max_contexts, check_finite, self.pool_model(cache),
            label=f"cache{len(self.caches)}",
        )
        self.caches.append(cm)
        event(f"cache: extents={extents} max_contexts={max_contexts} check_finite={check_finite}")
        return cm

    # ================================================================== hooks (the FP8 machine overrides them)
    def spec_extra(self) -> dict[str, Any]:
        """Extra ``KVCacheSpec`` fields (the float machine: none, a float32 pool)."""
        return {}

    def configure_cache(self, cache: KVCache) -> None:
        """Runs right after a cache is created, before anything is written to it."""

    def pool_model(self, cache: KVCache) -> PoolContents:
        """The model of ``cache``'s pool contents (float32 values, compared bit for bit)."""
        return PoolContents(cache.pool.kv)

    def pool_values(self, cm: CacheModel) -> torch.Tensor:
        """The pool as float32 values ``[layers, 2, pages, page_size, heads, dim]`` (what the model compares)."""
        return cm.cache.pool.kv

    def read_back(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What a forward's keys read back of the ``k``/``v`` ``[..., heads, dim]`` it wrote (float: themselves)."""
        return k, v

    # ================================================================== helpers: selection
    @property
    def open_caches(self) -> list[CacheModel]:
        return [c for c in self.caches if not c.closed]

    @property
    def open_sessions(self) -> list[SessionModel]:
        return [s for s in self.sessions if not s.closed]

    @property
    def closed_sessions(self) -> list[SessionModel]:
        return [s for s in self.sessions if s.closed]

    def sessions_of(self, cm: CacheModel) -> list[SessionModel]:
        return [s for s in self.sessions if s.cm is cm and not s.closed]

    @staticmethod
    def pick(pool: list, index: int):
        return pool[index % len(pool)]

    def pick_streams(
        self, candidates: list[SessionModel], index: int, others: list[int], branch_sets: list[tuple[str, ...]]
    ) -> list[tuple[SessionModel, str]]:
        """Up to three distinct sessions of one cache (the first from ``candidates``), each with a branch set."""
        first = self.pick(candidates, index)
        same = self.sessions_of(first.cm)
        chosen = [first]
        pos = same.index(first)
        for off in others:
            sm = same[(pos + off) % len(same)]
            if sm not in chosen:
                chosen.append(sm)
        return [(sm, b) for sm, bs in zip(chosen, branch_sets) for b in bs]

    def visible_data(self, sm: SessionModel, branch: str) -> list[ChunkRecord]:
        return expected_visible(sm.committed[branch], self.spec.sink_chunks, self.spec.window_chunks)

    def visible(self, sm: SessionModel, branch: str) -> list[Chunk]:
        return [rec.pages for rec in self.visible_data(sm, branch)]

    def m_sink_shift(self, records: list[ChunkRecord], sm: SessionModel, branch: str, first_pending: int) -> int:
        """Tokens the forward adds to the sinks' positions: they end just before the first visible non-sink
        token (the oldest window chunk's, else the first pending one); 0 without relative sinks."""
        if not self.spec.relative_sinks:
            return 0
        sink_ids = {id(r) for r in sm.committed[branch][: self.spec.sink_chunks]}
        sinks = [r for r in records if id(r) in sink_ids]
        rest = [r for r in records if id(r) not in sink_ids]
        if not sinks:
            return 0
        return (rest[0].start if rest else first_pending) - (sinks[-1].start + sinks[-1].tokens)

    def sink_query(self, ctx: ForwardContext, q: torch.Tensor) -> dict[str, torch.Tensor]:
        """``sink_query=`` for ``chunk_attention`` when the cache has relative sinks: ``q`` itself (no RoPE
        here, so the merged two-segment attention must equal the single softmax the model checks)."""
        return {"sink_query": q} if ctx.relative_sinks else {}

    # ================================================================== helpers: chunk lengths
    def shape(self, raw: tuple) -> Shape:
        """A drawn shape ``(pages, explicit[, rule])``: ``None`` a full chunk, ``k`` a chunk of
        ``min(k, pages_per_chunk)`` pages; ``rule`` the ``pending_attention`` the call passes (``None``: none)."""
        pages, explicit, *rest = raw
        rule = rest[0] if rest else None
        lengths = tuple(self.chunk if p is None else min(p, self.ppc) * self.page for p in pages)
        implied = all(n == self.chunk for n in lengths) or len(lengths) == 1
        shape = Shape(lengths, explicit or not implied, rule, (rule or self.spec.pending_attention) == "bidirectional")
        if len(lengths) > 1:
            event(f"multi-chunk forward, pending rule {rule or 'default ' + self.spec.pending_attention}")
        kind = "mixed" if len(set(lengths)) > 1 else "full" if lengths[0] == self.chunk else "short"
        event(f"chunk lengths {kind}, passed as {'chunk_lengths' if shape.explicit else 'seq_len'}")
        return shape

    @property
    def default_bidirectional(self) -> bool:
        return self.spec.pending_attention == "bidirectional"

    def full(self, num_chunks: int = 1) -> Shape:
        return Shape((self.chunk,) * num_chunks, bidirectional=self.default_bidirectional)

    def short(self, pages: int) -> Shape:
        """One chunk of ``pages`` pages (capped): e.g. an image-to-video first chunk of one latent frame."""
        return Shape((min(pages, self.ppc) * self.page,), bidirectional=self.default_bidirectional)

    def reused(self, sm: SessionModel, b: str, shape: Shape) -> int:
        """Leading pending chunks a forward of ``shape`` keeps as they are: those of the same length."""
        k = 0
        old = sm.pending_tokens[b]
        while k < min(len(old), shape.num_chunks) and old[k] == shape.lengths[k]:
            k += 1
        return k

    def chunk_references(self, cm: CacheModel) -> Counter[int]:
        """References to each page of ``cm``'s pool from chunks (visible or pending) of its open sessions."""
        refs: Counter[int] = Counter()
        for sm in self.sessions_of(cm):
            for b in BRANCHES:
                refs.update(p for c in self.visible(sm, b) + sm.pending[b] for p in c)
        return refs

    def slots_of(self, sm: SessionModel, b: str) -> list[Chunk]:
        ext = sm.extent[b] or ()
        return [tuple(ext[i : i + self.ppc]) for i in range(0, len(ext), self.ppc)]

    def free_slots(self, sm: SessionModel, b: str) -> list[Chunk]:
        """Extent slots of a branch that no chunk anywhere references (a fork may still see an evicted one)."""
        refs = self.chunk_references(sm.cm)
        return [slot for slot in self.slots_of(sm, b) if not any(refs[p] for p in slot)]

    def track(self, ctx: ForwardContext) -> None:
        self.contexts = [c for c in self.contexts if c is not ctx][-(TRACKED_CONTEXTS - 1) :] + [ctx]

    # ================================================================== helpers: snapshots
    def snapshot(self) -> tuple:
        """Everything a failed operation must leave untouched (all caches, contexts and transactions)."""
        caches = []
        for cm in self.caches:
            c, alloc = cm.cache, cm.cache.allocator
            head = (
                c.is_closed,
                alloc.free_pages(),
                tuple(alloc.refcount(p) for p in range(alloc.num_pages)),
                alloc.peak_used,
                c.num_forward_contexts,
                tuple(id(x) for x in c.forward_contexts()),
                tuple(sorted(c.sessions)),
            )
            # bit-exact (NaN payloads too); as bytes, as numpy has no float8
            pool = None if c.is_closed else c.pool.kv.view(torch.uint8).numpy().tobytes()
            caches.append((head, pool))
        sessions = []
        for sm in self.sessions:
            st_ = sm.state
            if st_.is_closed:
                sessions.append(("closed", st_.session_id))
                continue
            branches = []
            for b in BRANCHES:
                forward = st_.open_forward(b)
                cross = None
                if st_.is_cross_attention_populated(b, "text"):
                    cross = [(d["k"].tolist(), d["v"].tolist()) for d in st_.get_cross_attention_kv(b, "text")]
                branches.append(
                    (
                        st_.visible_chunks(b),
                        st_.pending_chunks(b),
                        st_.token_offset(b),
                        st_.committed_chunks(b),
                        None if forward is None else (id(forward), forward.status),
                        cross,
                        st_.history(b).extent,
                    )
                )
            sessions.append((st_.session_id, tuple(branches)))
        contexts = tuple(
            (id(ctx), id(ctx.transaction), ctx.transaction.status if ctx.transaction else None, ctx.released)
            for ctx in self.ctx_tx
        )
        txs = tuple((id(t.tx), t.tx.status) for t in self.txs)
        return tuple(caches), tuple(sessions), contexts, txs

    def expect_failure(self, exc, fn: Callable, *args, match: str | None = None, **kwargs) -> BaseException:
        before = self.snapshot()
        with pytest.raises(exc) as info:
            fn(*args, **kwargs)
        if match is not None:
            assert match in str(info.value), f"{info.type.__name__} message {str(info.value)!r} lacks {match!r}"
        after = self.snapshot()
        name = getattr(fn, "__name__", repr(fn))
        assert after == before, f"failed {name} ({info.type.__name__}) changed state: {self.diff(before, after)}"
        return info.value

    @staticmethod
    def diff(before: tuple, after: tuple) -> str:
        """Which parts of two snapshots differ (for failure messages)."""
        labels = ("closed", "free pages", "refcounts", "peak_pages_used", "num_forward_contexts",
                  "forward_contexts() (identity, LRU order)", "session ids")
        out = []
        for i, (a, b) in enumerate(zip(before[0], after[0])):
            out += [f"cache{i} {label}: {x} -> {y}" for label, x, y in zip(labels, a[0], b[0]) if x != y]
            if a[1] != b[1]:
                out.append(f"cache{i} pool contents")
        rest = zip(("sessions", "contexts", "transactions"), before[1:], after[1:])
        out += [f"{label} differ" for label, a, b in rest if a != b]
        return "; ".join(out)

    # ================================================================== helpers: prepare
    def predict_prepare(
        self, cm: CacheModel, streams: list[tuple[SessionModel, str]], shape: Shape, *, via: str,
        mask_ok: bool = True, static: bool = False,
    ) -> type[BaseException] | None:
        """The exception ``prepare_forward`` must raise (in the library's order of checks), or ``None``."""
        if via not in ("cache", "cache_gen") and streams[0][0].closed:
            return SessionClosedError
        if cm.closed:
            return CacheClosedError
        seen = set()
        for sm, b in streams:
            if sm.cm is not cm:
                return SpecError
            if sm.closed:
                return SessionClosedError
            if b not in BRANCHES:
                return UnknownBranchError
            key = (id(sm), b)
            if key in seen:
                return SpecError
            seen.add(key)
        if static and self.spec.window_chunks is None:
            return SpecError
        for sm, b in streams:
            tx = sm.forward[b]
            if tx is not None and tx.commit:
                return PendingContextError
        if not mask_ok:
            return TensorMismatchError
        alloc = cm.cache.allocator
        pages = [n // self.page for n in shape.lengths]
        if not cm.extents:
            # Pending chunks of other lengths are replaced (after the new ones are allocated).
            needed = sum(sum(pages[self.reused(sm, b, shape) :]) for sm, b in streams)
            return CapacityError if needed > alloc.num_free else None
        needed = new_extents = 0
        for sm, b in streams:
            missing = pages[self.reused(sm, b, shape) :]
            if sm.extent[b] is None:
                new_extents += 1
                needed += cm.extent_chunks * self.ppc + sum(missing[cm.extent_chunks :])
            else:  # a free slot takes any chunk (a shorter one uses its first pages)
                needed += sum(missing[len(self.free_slots(sm, b)) :])
        if needed > alloc.num_free:
            return CapacityError
        if new_extents and new_extents * cm.extent_chunks * self.ppc > longest_run(alloc.free_pages()):
            event("extents: no consecutive run for a new extent")
            return CapacityError  # enough pages, but no consecutive run for the new extents
        return None

    def history_tokens(self, sm: SessionModel, b: str) -> int:
        """Keys of a stream's visible history (the sum of its visible chunks' lengths)."""
        return sum(rec.tokens for rec in self.visible_data(sm, b))

    def max_keys(self, streams: list[tuple[SessionModel, str]], shape: Shape) -> int:
        return max(self.history_tokens(sm, b) for sm, b in streams) + shape.seq_len

    def make_mask(self, streams: list[tuple[SessionModel, str]], shape: Shape, bad: str | None = None):
        dims = [len(streams), shape.seq_len, self.max_keys(streams, shape)]
        if bad == "shape":
            dims[2] += 1
        mask = torch.rand(dims, generator=self.gen) < 0.75
        return mask.float() if bad == "dtype" else mask

    def prepare_call(
        self, streams: list[tuple[SessionModel, str]], shape: Shape, commit: bool, via: str,
        token_mask: torch.Tensor | None = None,
    ) -> tuple[Callable[..., Any], tuple, dict]:
        """The library call for this forward: ``state.prepare_forward``, ``cache.prepare_forward`` or the seed's
        ``get_kv_caches`` (which returns the layer list)."""
        seq_len = shape.seq_len
        sm0 = streams[0][0]
        kwargs: dict[str, Any] = {"token_mask": token_mask}
        rule = {} if shape.rule is None else {"pending_attention": shape.rule}
        kwargs.update(rule)
        if shape.explicit:
            # A tuple or a list: any sequence of ints.
            kwargs["chunk_lengths"] = shape.lengths if len(shape.lengths) % 2 else list(shape.lengths)
        if via == "get_kv_caches":
            assert not shape.explicit
            return sm0.state.get_kv_caches, (streams[0][1], seq_len, commit), rule
        if via == "state":
            branches = tuple(b for _, b in streams)
            return sm0.state.prepare_forward, (branches, seq_len, commit), kwargs
        pairs = [(sm.state, b) for sm, b in streams]
        return (
            sm0.cm.cache.prepare_forward,
            ((p for p in pairs) if via == "cache_gen" else pairs, seq_len, commit),  # a generator is consumed once
            kwargs,
        )

    def choose_via(self, streams: list[tuple[SessionModel, str]], via: str, masked: bool, shape: Shape) -> str:
        if len({id(sm) for sm, _ in streams}) > 1:
            return "cache_gen" if via == "cache_gen" else "cache"
        if via == "get_kv_caches" and (len(streams) > 1 or masked or shape.explicit):
            return "state"
        return via

    def start_forward(
        self, streams: list[tuple[SessionModel, str]], shape: Shape, commit: bool, *, via: str = "state",
        masked: bool = False,
    ) -> TxModel | None:
        """Prepare a forward (or check that it fails, changing nothing) and record it in the model."""
        via = self.choose_via(streams, via, masked, shape)
        cm = streams[0][0].cm
        failure = self.predict_prepare(cm, streams, shape, via=via)
        mask = self.make_mask(streams, shape) if masked and failure is None else None
        fn, args, kwargs = self.prepare_call(streams, shape, commit, via, mask)
        if failure is not None:
            event(f"prepare raised {failure.__name__}")
            self.expect_failure(failure, fn, *args, **kwargs)
            return None
        free_before = set(cm.cache.allocator.free_pages())
        used_before = cm.cache.allocator.num_used
        result = fn(*args, **kwargs)
        ctx = result[0].forward if via == "get_kv_caches" else result
        if via == "get_kv_caches":
            assert result is ctx.layers
        return self.m_prepared(streams, shape, commit, ctx, free_before, used_before, mask)

    def m_prepared(
        self, streams: list[tuple[SessionModel, str]], shape: Shape, commit: bool, ctx: ForwardContext,
        free_before: set[int], used_before: int, mask: torch.Tensor | None = None,
    ) -> TxModel:
        """Check a prepared forward against the model and record it (supersede, pages, registry, transaction)."""
        cm = streams[0][0].cm
        # Open denoising forwards of these streams are superseded as a whole (pending pages kept).
        for sm, b in streams:
            old = sm.forward[b]
            if old is not None:
                assert not old.commit, "a stream of an open committing forward was prepared again"
                self.m_finished(old, "superseded")
                event("prepare superseded an open denoising forward")
        fresh: list[int] = []
        num_chunks = shape.num_chunks
        for i, (sm, b) in enumerate(streams):
            old = sm.pending[b]
            new = list(sm.state.pending_chunks(b))
            assert len(new) == num_chunks, f"{b}: {len(new)} pending chunks, expected {num_chunks}"
            assert [len(c) * self.page for c in new] == list(shape.lengths), (
                f"{b}: pending chunks {new} of {self.page}-token pages, expected lengths {shape.lengths}"
            )
            keep = self.reused(sm, b, shape)
            assert new[:keep] == old[:keep], "pending pages of earlier denoising forwards must be reused"
            if keep < min(len(old), num_chunks):
                event("pending chunks of other lengths replaced")
            grown = new[keep:]
            if cm.extents:
                extent = sm.state.history(b).extent
                if sm.extent[b] is None:
                    # Reserved now: S + W + 1 chunk slots of consecutive, previously free pages.
                    assert len(extent) == cm.extent_chunks * self.ppc, f"extent {extent}"
                    assert list(extent) == list(range(extent[0], extent[0] + len(extent))), f"extent {extent}"
                    fresh += list(extent)
                    sm.extent[b] = tuple(extent)
                assert tuple(extent) == sm.extent[b], "a branch's extent must not move until reset/close"
                slots = self.free_slots(sm, b)  # model pending not updated yet: slots free before
                own = {p for c in self.visible(sm, b) + sm.pending[b] for p in c}
                if any(own.isdisjoint(slot) and slot not in slots for slot in self.slots_of(sm, b)):
                    event("extents: an evicted slot waits for a fork that still sees it")
                # The ring takes the lowest free slots first (a shorter chunk their first pages); the
                # overflow is paged.
                ring = grown[: len(slots)]
                assert ring == [slot[: len(c)] for slot, c in zip(slots, ring)], (
                    f"{b}: grew {grown}, free extent slots were {slots}"
                )
                if any(len(c) < self.ppc for c in ring):
                    event("extents: a shorter chunk took part of a ring slot")
                if ring:
                    event("extents: pending chunk took a ring slot")
                if grown[len(ring) :]:
                    event("extents: overflow chunk paged outside the extent")
                grown = grown[len(ring) :]
            fresh += [p for c in grown for p in c]
            sm.pending[b] = new
            sm.pending_tokens[b] = list(shape.lengths)
            # The plan sees exactly the model's visible pages and pending chunks.
            layout = ctx.layout.streams[i]
            assert list(layout.history_pages) == [p for c in self.visible(sm, b) for p in c]
            assert list(layout.pending_pages) == new
            offset = sm.committed_tokens(b)
            assert layout.token_offset == offset, f"{b}: token_offset {layout.token_offset}, model {offset}"
        assert len(set(fresh)) == len(fresh) and set(fresh) <= free_before, (
            f"newly allocated pages {fresh} were not all free ({sorted(free_before)})"
        )
        cm.peak = max(cm.peak, used_before + len(fresh))
        key = tuple((sm.state.session_id, b) for sm, b in streams)
        assert ctx.streams == key
        assert ctx.num_chunks == num_chunks and ctx.seq_len == shape.seq_len
        assert ctx.layout.chunk_lengths == shape.lengths
        assert ctx.commit_current is commit
        assert len(ctx.layers) == NUM_LAYERS
        # The registry: the same streams reuse their context; a new one may evict idle ones (LRU).
        if key in cm.registry:
            assert ctx is cm.registry[key], "the same streams (same order) must get the same ForwardContext"
            cm.registry.move_to_end(key)
            event("context reused")
        else:
            assert ctx not in self.ctx_tx, "a released context was handed out again"
            cm.registry[key] = ctx
            for k in list(cm.registry):
                if len(cm.registry) <= cm.max_contexts:
                    break
                other = cm.registry[k]
                if other is not ctx and not self.model_active(other):
                    del cm.registry[k]
                    self.released.add(other)
                    event("LRU released an idle context")
        lib = ctx.transaction
        assert isinstance(lib, ForwardTransaction) and lib.is_open
        tx = TxModel(cm, list(streams), commit, shape, ctx, lib, mask)
        for sm, b in streams:
            sm.forward[b] = tx
        self.ctx_tx[ctx] = tx
        self.track(ctx)
        self.txs = self.txs[-15:] + [tx]
        event(f"forward over {len({id(sm) for sm, _ in streams})} session(s), {len(streams)} stream(s)")
        self.check_view(tx)
        return tx

    def check_view(self, tx: TxModel) -> None:
        """What an open forward attends to, against the model, stream by stream.

        ``positions`` are the model's next positions (tokens committed before, whatever the chunks'
        lengths); ``key_positions()`` lists each visible chunk's positions (sinks keep theirs after
        evictions) then the pending ones, ``-1`` padding; ``to_dense()`` is the rule over the model's
        chunk lengths (and the token mask); the reference backend's gathered K/V are, key by key,
        what the model says each visible chunk held when committed, then the pending chunks' contents.
        """
        ctx, shape, cm = tx.ctx, tx.shape, tx.cm
        assert tx.is_open and ctx.is_active
        n = shape.seq_len
        key_positions, dense = ctx.key_positions(), ctx.to_dense()
        plan = ctx.plan
        assert isinstance(plan, (ReferencePlan, RelativeSinkPlan)), type(plan)
        width = self.max_keys(tx.streams, shape)
        assert tuple(key_positions.shape) == (len(tx.streams), width), (key_positions.shape, width)
        assert tuple(dense.shape) == (len(tx.streams), n, width), (dense.shape, n, width)
        pool = self.pool_values(cm)
        slots = pool.reshape(NUM_LAYERS, 2, -1, pool.shape[-2] * pool.shape[-1])  # [layers, K/V, token slots, H*D]
        causal = shape.pending_mask()
        for i, (sm, b) in enumerate(tx.streams):
            records = self.visible_data(sm, b)
            offset = sm.committed_tokens(b)
            committed = [r.tokens for r in sm.committed[b]]
            where = f"{sm.state.session_id}/{b} (lengths {shape.lengths}, committed {committed})"
            assert ctx.positions[i].tolist() == list(range(offset, offset + n)), (
                f"{where}: positions {ctx.positions[i].tolist()}, expected from {offset}"
            )
            shift = self.m_sink_shift(records, sm, b, offset)
            assert ctx.sink_shifts[i] == shift, f"{where}: sink shift {ctx.sink_shifts[i]}, expected {shift}"
            if self.spec.relative_sinks:
                assert ctx.sink_positions is not None
                assert ctx.sink_positions[i].tolist() == list(range(offset - shift, offset - shift + n)), where
            else:
                assert ctx.sink_positions is None
            expected = [p for rec in records for p in rec.positions()] + list(range(offset, offset + n))
            keys = len(expected)
            got = key_positions[i].tolist()
            assert got == expected + [-1] * (width - keys), f"{where}: key_positions {got}, expected {expected}"
            mask = torch.zeros(n, width, dtype=torch.bool)
            mask[:, : keys - n] = True
            mask[:, keys - n : keys] = causal
            if tx.token_mask is not None:
                mask &= tx.token_mask[i]
            assert torch.equal(dense[i], mask), f"{where}: to_dense() differs from the rule over the model's lengths"
            # Every layer's K and V at once: [layers, 2, keys, H*D], keys in position order.
            pending = [p for c in sm.pending[b] for p in c]
            want = torch.cat(
                [rec.token_data() for rec in records] + [cm.pool.pages(pending).reshape(NUM_LAYERS, 2, n, -1)], dim=2
            )
            if isinstance(plan, RelativeSinkPlan):  # two segments: the sink keys, then window + pending
                assert isinstance(plan.sinks, ReferencePlan) and isinstance(plan.rest, ReferencePlan)
                sink_ids = {id(r) for r in sm.committed[b][: self.spec.sink_chunks]}
                sink_keys = sum(r.tokens for r in records if id(r) in sink_ids)
                gathered = torch.cat([plan.sinks.gather[i, :sink_keys], plan.rest.gather[i, : keys - sink_keys]])
            else:
                gathered = plan.gather[i, :keys]
            seen = slots[:, :, gathered]
            if not same_bits(seen, want):
                bad = (bits(seen) != bits(want)).any(-1).any(0).any(0).nonzero().flatten().tolist()
                raise AssertionError(
                    f"{where}: the K/V the forward gathers for the keys at positions {[expected[j] for j in bad]} "
                    "are not what the model says was written there"
                )

    def model_active(self, ctx: ForwardContext) -> bool:
        tx = self.ctx_tx.get(ctx)
        return ctx not in self.released and tx is not None and tx.is_open

    # ================================================================== helpers: finishing
    def m_finished(self, tx: TxModel, status: str) -> None:
        """A transaction finishes: every stream at once (model side)."""
        if not tx.is_open:
            return
        for sm, b in tx.streams:
            assert sm.forward[b] is tx
            sm.forward[b] = None
            if status == "aborted":
                sm.drop_pending(b)
            elif status == "committed":
                before = len(self.visible(sm, b)) + len(sm.pending[b])
                assert sm.pending_tokens[b] == list(tx.shape.lengths)
                start = sm.committed_tokens(b)
                for pages, tokens in zip(sm.pending[b], sm.pending_tokens[b]):
                    sm.committed[b].append(ChunkRecord(pages, tokens, start, tx.cm.pool.pages(pages)))
                    start += tokens
                sm.drop_pending(b)
                event("commit evicted chunks" if len(self.visible(sm, b)) < before else "commit without eviction")
                lengths = {rec.tokens for rec in self.visible_data(sm, b)}
                if len(lengths) > 1:
                    event("visible history of mixed chunk lengths")
        tx.status = status

    def m_finish(self, tx: TxModel | None, success: bool) -> None:
        """Success: a committing forward is ``committed``; a denoising one ``completed`` (pending pages kept)."""
        if tx is not None:
            self.m_finished(tx, ("committed" if tx.commit else "completed") if success else "aborted")

    def predict_finish(self, tx: TxModel | None, success: bool) -> type[BaseException] | None:
        """The error when finishing ``tx`` must abort it instead of committing: ``IncompleteForwardError`` (not
        every layer wrote), then ``NonFiniteKVError`` (``check_finite``)."""
        if tx is None or not tx.is_open or not success or not tx.commit:
            return None
        if tx.written != set(range(NUM_LAYERS)):
            return IncompleteForwardError
        if not tx.cm.check_finite:
            return None
        return None if tx.cm.pool.finite(tx.pending_pages()) else NonFiniteKVError

    def finish_call(self, fn: Callable[[], Any], tx: TxModel | None, success: bool) -> None:
        """Run a call that finishes ``tx`` (commit or abort, all streams); a finished ``tx``: a no-op."""
        if tx is None or not tx.is_open:
            before = self.snapshot()
            fn()
            assert self.snapshot() == before, "finishing a finished forward (or none) must change nothing"
            return
        expected = self.predict_finish(tx, success)
        try:
            fn()
            raised = None
        except (NonFiniteKVError, IncompleteForwardError) as exc:
            raised = exc
        if expected is not None:
            assert isinstance(raised, expected), f"a commit that must raise {expected.__name__} gave {raised!r}"
            event("check_finite aborted a commit" if expected is NonFiniteKVError else "an incomplete forward's commit was refused")
            assert tx.tx.status == "aborted", "a refused commit must finish (abort) the forward"
            self.m_finish(tx, False)
        else:
            assert raised is None, f"unexpected {raised!r}"
            self.m_finish(tx, success)

    def settle(self, streams: list[tuple[SessionModel, str]], commit: bool) -> None:
        """Finish (commit or abort) the open committing forwards of ``streams``, so a new forward can run."""
        for sm, b in streams:
            tx = sm.forward[b]
            if tx is not None and tx.commit:
                self.finish(tx, "cpc" if commit else "ctx.abort", tx.streams.index((sm, b)))

    def state_abort(self, sm: SessionModel, branch: str | None) -> None:
        """``state.abort(branch)``: its open forward (all streams) and its leftover pending pages are dropped."""
        names = BRANCHES if branch is None else (branch,)
        sm.state.abort(branch)
        for b in names:
            self.m_finish(sm.forward[b], False)
        for b in names:
            sm.drop_pending(b)

    def finish(self, tx: TxModel, how: str, member: int) -> None:
        sm, b = tx.streams[member % len(tx.streams)]
        if how == "cpc":
            self.finish_call(lambda: sm.state.commit_paged_context(b), sm.forward[b], True)
        elif how == "ctx.commit":
            self.finish_call(tx.ctx.commit, self.ctx_tx[tx.ctx], True)
        elif how == "ctx.abort":
            self.finish_call(tx.ctx.abort, self.ctx_tx[tx.ctx], False)
        elif how == "state.abort":
            self.state_abort(sm, b)
        elif how == "state.abort_all":
            self.state_abort(sm, None)

    def m_session_gone(self, sm: SessionModel) -> None:
        """``close()``/``reset()``: every open forward the session belongs to is aborted (all its streams)."""
        for b in BRANCHES:
            self.m_finish(sm.forward[b], False)

    def m_release_contexts_of(self, sm: SessionModel) -> None:
        sid = sm.state.session_id
        for key in [k for k in sm.cm.registry if any(s == sid for s, _ in k)]:
            self.released.add(sm.cm.registry.pop(key))

    # ================================================================== helpers: running layers
    def layer_inputs(self, ctx: ForwardContext, layer: int, mode: str):
        s, n = ctx.positions.shape
        if mode == "module":
            return (torch.randn(s, n, 2 * HEAD_DIM, generator=self.gen),)
        q = torch.randn(s, n, 2, HEAD_DIM, generator=self.gen)
        k, v = token_kv(self.next_id, s, n, layer, HEAD_DIM)
        self.next_id += s * n
        return q, k, v

    def call_layer(self, ctx: ForwardContext, layer: int, mode: str, inputs=None):
        """One layer's forward without any model bookkeeping (for calls that must fail)."""
        inputs = inputs or self.layer_inputs(ctx, layer, mode)
        with torch.no_grad():
            if mode == "module":
                return self.attn(inputs[0], ctx.layers[layer])
            return chunk_attention(*inputs, ctx.layers[layer], **self.sink_query(ctx, inputs[0]))

    def run_layer(self, tx: TxModel, layer: int, mode: str, nan: tuple[int, int, int, float] | None = None) -> None:
        """One layer of an open forward: the write lands in the model's pending pages; the output is checked."""
        assert tx.is_open
        ctx = tx.ctx
        inputs = self.layer_inputs(ctx, layer, mode)
        s, n = ctx.positions.shape
        if mode == "module":
            x = inputs[0]
            with torch.no_grad():
                y = self.attn(x, ctx.layers[layer])
                k = self.attn.to_k(x).view(s, n, 1, HEAD_DIM)
                v = self.attn.to_v(x).view(s, n, 1, HEAD_DIM)
            assert y.shape == x.shape
        else:
            q, k, v = inputs
            if nan is not None and nan[0] == layer:
                _, stream, token, value = nan
                k[stream % s, token % n, 0, 0] = value
                event("wrote a non-finite K")
            out = chunk_attention(q, k, v, ctx.layers[layer], **self.sink_query(ctx, q))
        for i, (sm, b) in enumerate(tx.streams):
            tx.cm.pool.write(layer, [p for c in sm.pending[b] for p in c], k[i], v[i])
        tx.written.add(layer)
        if mode != "module" and (nan is None or nan[0] != layer):
            self.check_output(tx, layer, q, k, v, out)
            self.check_cross_in_forward(tx, ctx.layers[layer])

    def run(self, tx: TxModel, mode: str, nan: tuple[int, int, int, float] | None = None) -> None:
        if mode == "none":
            return
        layers = [0] if mode == "partial" else range(NUM_LAYERS)
        for layer in layers:
            self.run_layer(tx, layer, "module" if mode == "module" else "op", nan)
        self.check_view(tx)  # what it wrote is what its keys now gather (distinct ids: any mix-up shows)

    def check_output(self, tx: TxModel, layer: int, q, k, v, out) -> None:
        """The output equals a hand-written masked softmax over the model's pages (and the token mask)."""
        n = tx.shape.seq_len
        causal = tx.shape.pending_mask()  # block-causal (or all) over the model's own chunk lengths
        for i, (sm, b) in enumerate(tx.streams):
            hist = [p for c in self.visible(sm, b) for p in c]
            k_now, v_now = self.read_back(layer, k[i], v[i])  # [n, 1, dim]
            keys = torch.cat([tx.cm.pool.tokens(layer, 0, hist), k_now[:, 0]])
            values = torch.cat([tx.cm.pool.tokens(layer, 1, hist), v_now[:, 0]])
            h = self.history_tokens(sm, b)
            assert h == len(hist) * self.page
            mask = torch.cat([torch.ones(n, h, dtype=torch.bool), causal], dim=1)
            if tx.token_mask is not None:
                mask &= tx.token_mask[i, :, : h + n]
            logits = torch.einsum("thd,kd->thk", q[i], keys) * HEAD_DIM**-0.5
            w = torch.softmax(logits.masked_fill(~mask[:, None, :], float("-inf")), dim=-1)
            expect = torch.einsum("thk,kd->thd", w.nan_to_num(0.0), values)
            torch.testing.assert_close(out[i], expect, rtol=1e-5, atol=1e-5)

    def check_cross_in_forward(self, tx: TxModel, layer: LayerContext) -> None:
        """The forward sees each stream's current cross cache, or raises when any stream lacks it."""
        if all(b in sm.cross for sm, b in tx.streams):
            k, v = layer.cross_kv("text")
            for i, (sm, b) in enumerate(tx.streams):
                ek, ev = cross_value(sm.cross[b], layer.layer_index)
                assert torch.equal(k[i], ek) and torch.equal(v[i], ev)
        else:
            with pytest.raises(CrossAttentionNotPopulatedError):
                layer.cross_kv("text")
        with pytest.raises(UnknownCacheError):
            layer.cross_kv("image")

    # ================================================================== rules: caches and sessions
    @precondition(
        lambda self: self.caches
        and len(self.open_caches) < MAX_OPEN_CACHES
        and (len(self.caches) < MAX_CACHES or not self.open_caches)
    )
    @rule(
        pool_chunks=st.integers(3, 18),
        extents=st.booleans(),
        max_contexts=st.sampled_from([1, 2, 3, 64]),
        check_finite=st.booleans(),
    )
    def open_cache(self, pool_chunks: int, extents: bool, max_contexts: int, check_finite: bool) -> None:
        """A second KVCache side by side (or a fresh one after close)."""
        cm = self.new_cache(pool_chunks, extents, max_contexts, check_finite)
        self.sessions.append(SessionModel(cm.cache.open_session(), cm))

    @precondition(lambda self: self.open_caches)
    @rule(index=st.integers(0, 3), twice=st.booleans())
    def close_cache(self, index: int, twice: bool) -> None:
        """``KVCache.close()``: every session closed (their forwards aborted), every page and context released."""
        cm = self.pick(self.open_caches, index)
        cm.cache.close()
        if twice:
            cm.cache.close()  # idempotent
        for sm in self.sessions_of(cm):
            self.m_session_gone(sm)
            sm.closed = True
            sm.clear_self_attention()
            sm.cross.clear()
        self.released.update(cm.registry.values())
        cm.registry.clear()
        cm.closed = True
        alloc = cm.cache.allocator
        assert cm.cache.is_closed and cm.cache.sessions == {}
        assert alloc.num_free == alloc.num_pages and alloc.used_pages() == ()
        alloc.check_invariants()
        assert cm.cache.num_forward_contexts == 0 and cm.cache.forward_contexts() == ()
        event("closed a KVCache")

    @precondition(lambda self: any(len(self.sessions_of(c)) < MAX_SESSIONS for c in self.open_caches))
    @rule(index=st.integers(0, 3), admit=st.booleans(), pending_chunks=st.integers(1, 2), two=st.booleans(),
          reuse_id=st.booleans())
    def open_session(self, index: int, admit: bool, pending_chunks: int, two: bool, reuse_id: bool) -> None:
        """``open_session()`` (one or two; maybe under the id of a closed session), or ``admit_session()``:
        refused (nothing changed) unless it fits at its peak."""
        cm = self.pick([c for c in self.open_caches if len(self.sessions_of(c)) < MAX_SESSIONS], index)
        if not admit:
            for _ in range(2 if two and len(self.sessions_of(cm)) + 1 < MAX_SESSIONS else 1):
                taken = {s.state.session_id for s in self.sessions_of(cm)}
                free_ids = [s.state.session_id for s in self.sessions if s.cm is cm and s.closed]
                free_ids = [sid for sid in free_ids if sid not in taken]
                if reuse_id and free_ids:
                    # A new session under a closed one's id: that id's released contexts must not come back.
                    state = cm.cache.open_session(free_ids[0])
                    event("opened a session under a closed session's id")
                else:
                    state = cm.cache.open_session()
                assert not state.is_closed and state.pages_in_use() == 0 and state.cache is cm.cache
                self.sessions.append(SessionModel(state, cm))
            return
        else:
            if self.spec.window_chunks is None:
                self.expect_failure(SpecError, cm.cache.admit_session, pending_chunks=pending_chunks)
                self.expect_failure(SpecError, cm.cache.can_admit, 1, pending_chunks)
                return
            fits = self.sessions_that_fit(cm, pending_chunks)
            assert cm.cache.sessions_that_fit(pending_chunks) == fits
            assert cm.cache.can_admit(1, pending_chunks) == (fits >= 1)
            assert cm.cache.can_admit(2, pending_chunks) == (fits >= 2)
            if fits < 1:
                event("admission refused")
                self.expect_failure(CapacityError, cm.cache.admit_session, pending_chunks=pending_chunks)
                return
            event("admission accepted")
            state = cm.cache.admit_session(pending_chunks=pending_chunks)
        assert not state.is_closed and state.pages_in_use() == 0 and state.cache is cm.cache
        self.sessions.append(SessionModel(state, cm))

    def sessions_that_fit(self, cm: CacheModel, pending_chunks: int) -> int:
        """Admission arithmetic: sessions at peak (sinks + window + pending per branch, or the extent), plus
        the re-cache reserve."""
        resident = self.spec.sink_chunks + self.spec.window_chunks

        def per_session(pending: int) -> int:
            chunks = max(resident + pending, cm.extent_chunks)
            return len(BRANCHES) * chunks * self.ppc

        alloc = cm.cache.allocator
        # Once for the pool: one session's re-cache beyond its peak (every branch rebuilds R chunks, less
        # the pending chunk / free ring slot the peak already counts).
        reserve = len(BRANCHES) * max(0, resident - 1) * self.ppc
        promised = max(0, len(self.sessions_of(cm)) * per_session(1) + reserve - alloc.num_used)
        return max(0, (alloc.num_free - promised) // per_session(pending_chunks))

    @precondition(lambda self: self.open_sessions)
    @rule(index=st.integers(0, 2 * MAX_SESSIONS), twice=st.booleans())
    def close(self, index: int, twice: bool) -> None:
        """``close()`` aborts every open forward the session belongs to (other sessions' streams too)."""
        sm = self.pick(self.open_sessions, index)
        sm.state.close()
        if twice:
            sm.state.close()  # idempotent
        self.m_session_gone(sm)
        self.m_release_contexts_of(sm)
        sm.closed = True
        sm.clear_self_attention()
        sm.cross.clear()
        assert sm.state.is_closed and sm.state.pages_in_use() == 0
        assert sm.state.session_id not in sm.cm.cache.sessions

    @precondition(lambda self: self.sessions)
    @rule(index=st.integers(0, 4 * MAX_SESSIONS), keep=st.sampled_from([(), ("text",), "text"]))
    def reset(self, index: int, keep) -> None:
        """Reset an open session (its open forwards aborted), or reopen a closed one (refused if its cache closed)."""
        sm = self.pick(self.sessions, index)
        if sm.closed and sm.cm.closed:
            self.expect_failure(CacheClosedError, sm.state.reset, keep_cross_attention=keep)
            return
        if sm.closed and sm.state.session_id in {s.state.session_id for s in self.sessions_of(sm.cm)}:
            event("reset refused: the closed session's id was taken")
            self.expect_failure(SpecError, sm.state.reset, keep_cross_attention=keep, match=repr(sm.state.session_id))
            return
        if sm.closed and len(self.sessions_of(sm.cm)) >= MAX_SESSIONS:
            return
        event("reset reopened a closed session" if sm.closed else "reset an open session")
        sm.state.reset(keep_cross_attention=keep)
        if not sm.closed:
            self.m_session_gone(sm)
        sm.closed = False
        sm.clear_self_attention()
        if not keep:
            sm.cross.clear()
        assert sm.state.session_id in sm.cm.cache.sessions

    # ================================================================== rules: forwards
    @precondition(lambda self: self.open_sessions)
    @rule(
        index=st.integers(0, 8),
        others=st.lists(st.integers(1, 2), max_size=2, unique=True),
        branch_sets=st.lists(st.sampled_from(BRANCH_SETS), min_size=3, max_size=3),
        shape=SHAPES,
        commit=st.booleans(),
        via=st.sampled_from(["state", "cache", "cache_gen", "get_kv_caches"]),
        masked=st.booleans(),
        mode=st.sampled_from(["op", "op", "module", "partial", "none"]),
        how=st.sampled_from(["cpc", "ctx.commit", "ctx.abort", "state.abort", "state.abort_all", "later", "later"]),
        member=st.integers(0, 5),
    )
    def forward(
        self, index: int, others: list[int], branch_sets: list, shape: tuple, commit: bool, via: str,
        masked: bool, mode: str, how: str, member: int,
    ) -> None:
        """A forward over 1-3 sessions (a committing or a denoising one) of 1-3 chunks of any lengths, run, then
        finished through one member."""
        streams = self.pick_streams(self.open_sessions, index, others, branch_sets)
        tx = self.start_forward(streams, self.shape(shape), commit, via=via, masked=masked)
        if tx is None:
            return
        if masked:
            event("forward with a token_mask")
        self.run(tx, mode)
        self.finish(tx, how, member)

    @precondition(lambda self: self.open_sessions)
    @rule(
        index=st.integers(0, 8),
        branches=st.sampled_from(BRANCH_SETS),
        steps=st.integers(1, 6),
        denoise_steps=st.integers(0, 2),
        pattern=st.sampled_from(["full", "i2v", "i2v", "varied"]),
        varied=st.lists(CHUNK_PAGES, min_size=6, max_size=6),
    )
    def rollout(
        self, index: int, branches: tuple[str, ...], steps: int, denoise_steps: int, pattern: str, varied: list
    ) -> None:
        """The generation loop: per chunk, a few denoising forwards then a committing one (reaches eviction).

        ``i2v``: a fresh branch starts with a one-page chunk (image-to-video's 1-latent-frame first
        chunk, said by ``seq_len`` alone), then full chunks; ``varied``: each chunk its own length.
        """
        sm = self.pick(self.open_sessions, index)
        shapes = [self.full()] * steps
        if pattern == "i2v" and all(not sm.committed[b] for b in branches):
            shapes[0] = self.short(1)
            event("rollout: image-to-video first chunk")
        elif pattern == "varied":
            shapes = [self.shape(([p], False)) for p in varied[:steps]]
        self.roll(sm, branches, steps, denoise_steps, shapes)

    def roll(
        self, sm: SessionModel, branches: tuple[str, ...], steps: int, denoise_steps: int = 0,
        shapes: list[Shape] | None = None,
    ) -> None:
        streams = [(sm, b) for b in branches]
        for step in range(steps):
            shape = shapes[step] if shapes else self.full()
            for _ in range(denoise_steps):
                if self.start_forward(streams, shape, False) is None:
                    return
            tx = self.start_forward(streams, shape, True)
            if tx is None:
                return
            self.run(tx, "op")
            self.finish(tx, "cpc", 0)

    @precondition(lambda self: self.contexts)
    @rule(index=st.integers(0, TRACKED_CONTEXTS - 1), success=st.booleans())
    def finish_context(self, index: int, success: bool) -> None:
        """``ctx.commit()`` / ``ctx.abort()`` on an earlier context: its current forward, if open; else a no-op."""
        ctx = self.pick(self.contexts, index)
        self.finish_call(ctx.commit if success else ctx.abort, self.ctx_tx[ctx], success)

    @precondition(lambda self: self.open_sessions)
    @rule(index=st.integers(0, 8), branch=st.sampled_from(BRANCHES))
    def commit_branch(self, index: int, branch: str) -> None:
        """``commit_paged_context`` whatever the branch's state: commits its whole forward (or a no-op)."""
        sm = self.pick(self.open_sessions, index)
        self.finish_call(lambda: sm.state.commit_paged_context(branch), sm.forward[branch], True)

    @precondition(lambda self: self.open_sessions)
    @rule(index=st.integers(0, 8), branch=st.sampled_from((None,) + BRANCHES))
    def abort(self, index: int, branch: str | None) -> None:
        self.state_abort(self.pick(self.open_sessions, index), branch)

    @precondition(lambda self: self.open_sessions)
    @rule(
        index=st.integers(0, 8),
        others=st.lists(st.integers(1, 2), max_size=2, unique=True),
        branch_sets=st.lists(st.sampled_from(BRANCH_SETS), min_size=3, max_size=3),
        shape=SHAPES,
        commit=st.booleans(),
        via=st.sampled_from(["state", "cache"]),
        mode=st.sampled_from(["op", "module"]),
        variant=st.sampled_from(
            ["ok", "ok", "boom", "halt", "keyboard", "ctx.abort", "state.abort", "cpc", "ctx.commit", "reprepare"]
        ),
        inner_commit=st.booleans(),
        inner_with=st.booleans(),
        member=st.integers(0, 5),
        inner_shape=st.one_of(st.none(), SHAPES_2),
    )
    def forward_with_block(
        self, index: int, others: list[int], branch_sets: list, shape: tuple, commit: bool, via: str, mode: str,
        variant: str, inner_commit: bool, inner_with: bool, member: int, inner_shape: tuple | None,
    ) -> None:
        """``with prepare_forward(...)``: commit on success; any exception (BaseException too) aborts every stream.

        Variants: finish the forward inside the block (``ctx.abort()``, ``state.abort(b)``,
        ``commit_paged_context(b)``, ``ctx.commit()``) then keep running the model: the next layer
        raises ForwardFinishedError before touching the pool and the block's exit changes nothing;
        or prepare the same streams again inside a denoising block (same context object, new
        forward, maybe of other chunk lengths): the block's exit must not finish that newer forward.
        """
        streams = self.pick_streams(self.open_sessions, index, others, branch_sets)
        self.settle(streams, inner_commit)
        outer = self.shape(shape)
        via = self.choose_via(streams, via, False, outer)
        if variant == "reprepare":
            commit = False
        cm = streams[0][0].cm
        failure = self.predict_prepare(cm, streams, outer, via=via)
        fn, args, kwargs = self.prepare_call(streams, outer, commit, via)
        if failure is not None:
            self.expect_failure(failure, fn, *args, **kwargs)
            return
        free_before = set(cm.cache.allocator.free_pages())
        used_before = cm.cache.allocator.num_used
        box: dict[str, Any] = {}

        def body() -> None:
            with fn(*args, **kwargs) as fwd:
                tx = box["tx"] = self.m_prepared(streams, outer, commit, fwd, free_before, used_before)
                self.run_layer(tx, 0, mode)
                if variant in INTERRUPTS:
                    raise INTERRUPTS[variant]("injected inside the with block")
                if variant in ("ctx.abort", "state.abort", "cpc", "ctx.commit"):
                    self.finish(tx, variant, member)
                    box["before"] = self.snapshot()
                    self.call_layer(fwd, 1, mode)  # a finished forward: must raise before any write
                    raise AssertionError("a finished forward's layer ran")
                if variant == "reprepare":
                    inner = outer if inner_shape is None else self.shape(inner_shape)
                    box["inner"] = self.reprepare(streams, inner, inner_commit, via, inner_with, mode)
                else:
                    self.run_layer(tx, 1, mode)
                box["outcome"] = self.predict_finish(tx, True)

        if variant in INTERRUPTS:
            with pytest.raises(INTERRUPTS[variant]):
                body()
            event(f"{variant} inside a with block aborted the forward")
            self.m_finish(box["tx"], False)
            return
        if variant in ("ctx.abort", "state.abort", "cpc", "ctx.commit"):
            with pytest.raises(ForwardFinishedError):
                body()
            assert self.snapshot() == box["before"], "a finished forward's layer (or the with exit) changed state"
            event(f"{variant} inside a with block, then the next layer raised")
            return
        try:
            body()
            raised = None
        except NonFiniteKVError as exc:
            raised = exc
        assert (raised is not None) == (box["outcome"] is NonFiniteKVError), f"unexpected {raised!r}"
        self.m_finish(box["tx"], raised is None)
        inner = box.get("inner")
        if inner is not None and not inner_with:
            assert inner.is_open and inner.tx.is_open, "the with exit finished a later forward of its context"
            event("with exit left the re-prepared forward open")

    def reprepare(
        self, streams: list[tuple[SessionModel, str]], shape: Shape, commit: bool, via: str, use_with: bool,
        mode: str,
    ) -> TxModel | None:
        """Inside an open denoising ``with`` block: prepare the same streams again (same context, new forward)."""
        cm = streams[0][0].cm
        failure = self.predict_prepare(cm, streams, shape, via=via)
        fn, args, kwargs = self.prepare_call(streams, shape, commit, via)
        if failure is not None:
            self.expect_failure(failure, fn, *args, **kwargs)
            return None
        outer = streams[0][0].forward[streams[0][1]]
        free_before = set(cm.cache.allocator.free_pages())
        used_before = cm.cache.allocator.num_used
        ctx = fn(*args, **kwargs)
        assert ctx is outer.ctx, "the same streams must get the same context"
        inner = self.m_prepared(streams, shape, commit, ctx, free_before, used_before)
        assert outer.status == "superseded"
        if not use_with:
            self.run(inner, mode)
            return inner
        with ctx:
            self.run(inner, mode)
            outcome = self.predict_finish(inner, True)
        assert outcome is None  # every layer was written: finite
        self.m_finish(inner, True)
        return inner

    @precondition(lambda self: self.contexts)
    @rule(index=st.integers(0, TRACKED_CONTEXTS - 1), layer=st.integers(0, NUM_LAYERS - 1),
          mode=st.sampled_from(["op", "module"]), prefer=st.sampled_from(["any", "kept", "superseded"]))
    def stale_use(self, index: int, layer: int, mode: str, prefer: str) -> None:
        """A finished forward's layers (op or model call): ForwardFinishedError / PlanNotFoundError, pool unchanged.

        A context whose streams were prepared again is open again (reused object): then it is a
        legitimate write.
        """
        pool = {
            "any": self.contexts,
            "kept": [c for c in self.contexts if c not in self.released],
            "superseded": [
                c for c in self.contexts if self.ctx_tx[c].status == "superseded" and c not in self.released
            ],
        }[prefer]
        ctx = self.pick(pool or self.contexts, index)
        tx = self.ctx_tx[ctx]
        if self.model_active(ctx):
            event("stale_use: the context is open again (reused): a legitimate write")
            self.run_layer(tx, layer, mode)
            return
        released = ctx in self.released
        event(f"stale_use of a {'released' if released else tx.status} context")
        exc = (PlanNotFoundError, ForwardFinishedError) if released else ForwardFinishedError
        self.expect_failure(exc, self.call_layer, ctx, layer, mode)

    @precondition(lambda self: self.open_sessions)
    @rule(
        index=st.integers(0, 8),
        others=st.lists(st.integers(1, 2), max_size=2, unique=True),
        branch_sets=st.lists(st.sampled_from(BRANCH_SETS), min_size=3, max_size=3),
        shape=SHAPES_2,
        commit=st.booleans(),
        keep=st.integers(0, 5),
        mode=st.sampled_from(["op", "module"]),
        success=st.booleans(),
        new_shape=st.one_of(st.none(), SHAPES_2),
    )
    def supersede_then_use(
        self, index: int, others: list[int], branch_sets: list, shape: tuple, commit: bool, keep: int, mode: str,
        success: bool, new_shape: tuple | None,
    ) -> None:
        """A denoising forward superseded by a forward over one of its streams: the whole old forward ends
        (every stream, pending pages kept); its context's layers and ``commit()/abort()`` are then inert."""
        streams = self.pick_streams(self.open_sessions, index, others, branch_sets)
        if len(streams) < 2:
            return
        self.settle(streams, success)
        first = self.shape(shape)
        old = self.start_forward(streams, first, False, via="cache")
        if old is None:
            return
        self.run(old, "partial")
        second = first if new_shape is None else self.shape(new_shape)
        new = self.start_forward([streams[keep % len(streams)]], second, commit, via="cache")
        if new is None:
            return
        assert old.status == "superseded" and old.tx.status == "superseded", (
            f"the forward over {old.ctx.streams} is {old.tx.status} after one of its streams was prepared again"
        )
        assert old.ctx is not new.ctx
        if self.model_active(old.ctx):  # pragma: no cover - a different context cannot be open
            raise AssertionError("a superseded forward's context is still active")
        exc = (PlanNotFoundError, ForwardFinishedError) if old.ctx in self.released else ForwardFinishedError
        self.expect_failure(exc, self.call_layer, old.ctx, NUM_LAYERS - 1, mode)
        self.finish_call(old.ctx.commit if success else old.ctx.abort, old, success)  # a no-op
        event("superseded forward: its context raised and its commit/abort was a no-op")

    @precondition(lambda self: self.open_sessions)
    @rule(
        index=st.integers(0, 8),
        others=st.lists(st.integers(1, 2), max_size=2, unique=True),
        branch_sets=st.lists(st.sampled_from(BRANCH_SETS), min_size=3, max_size=3),
        where=st.sampled_from(["plan_commit", "decref", "sigint"]),
        exc=st.sampled_from(["boom", "halt", "keyboard"]),
        via=st.sampled_from(["cpc", "ctx.commit", "with", "with_boom", "state.abort"]),
        then=st.sampled_from(["commit", "abort", "later"]),
        shape=SHAPES_2,
    )
    def interrupted_finish(
        self, index: int, others: list[int], branch_sets: list, where: str, exc: str, via: str, then: str,
        shape: tuple,
    ) -> None:
        """An exception injected while a forward commits or aborts: all streams are finished, or none.

        ``plan_commit`` raises on the 2nd stream (the 1st if there is one): no stream commits and the
        forward is aborted (a failed commit never leaves it open; an ``Exception`` surfaces as
        ``CommitFailedError`` chained to it). ``PageAllocator.decref`` raises on its first call (the abort
        that follows a failed commit too): nothing may change (the forward stays open). ``sigint``: a real
        SIGINT arrives while the 1st stream's commit is applied: it is deferred, every stream is
        committed, then KeyboardInterrupt is raised.
        """
        streams = self.pick_streams(self.open_sessions, index, others, branch_sets)
        self.settle(streams, then == "commit")
        cm = streams[0][0].cm
        if where in ("plan_commit", "sigint") and via in ("with_boom", "state.abort"):
            via = "cpc"  # these hooks are on the commit path
        if where == "sigint" and not self.can_defer_sigint():
            where = "decref"
        injected = KeyboardInterrupt if where == "sigint" else INTERRUPTS[exc]
        # What the caller sees: a failed commit's Exception comes wrapped (CommitFailedError, chained).
        raised_as = (injected, CommitFailedError) if where == "plan_commit" and issubclass(injected, Exception) else injected
        lengths = self.shape(shape)
        calls = {"n": 0}
        patches: list[tuple[Any, str, Any]] = []

        def install() -> None:
            if where == "plan_commit":
                original = BranchHistory.plan_commit
                fail_at = min(2, len(streams))

                def plan_commit(h):
                    calls["n"] += 1
                    if calls["n"] == fail_at:
                        raise injected("injected into plan_commit")
                    return original(h)

                patches.append((BranchHistory, "plan_commit", original))
                BranchHistory.plan_commit = plan_commit
            elif where == "decref":
                alloc = cm.cache.allocator

                def decref(pages):
                    raise injected("injected into decref")

                patches.append((alloc, "decref", None))
                alloc.decref = decref
            else:
                original = BranchHistory.apply_commit

                def apply_commit(h, result):
                    calls["n"] += 1
                    if calls["n"] == 1:
                        os.kill(os.getpid(), signal.SIGINT)  # delivered at the next bytecode: must be deferred
                    return original(h, result)

                patches.append((BranchHistory, "apply_commit", original))
                BranchHistory.apply_commit = apply_commit

        def uninstall() -> None:
            while patches:
                target, name, original = patches.pop()
                if original is None:
                    delattr(target, name)
                else:
                    setattr(target, name, original)

        success = via != "state.abort" and via != "with_boom"
        if via in ("with", "with_boom"):
            failure = self.predict_prepare(cm, streams, lengths, via="cache")
            fn, args, kwargs = self.prepare_call(streams, lengths, True, "cache")
            if failure is not None:
                self.expect_failure(failure, fn, *args, **kwargs)
                return
            free_before, used_before = set(cm.cache.allocator.free_pages()), cm.cache.allocator.num_used
            box: dict[str, Any] = {}

            def body() -> None:
                with fn(*args, **kwargs) as fwd:
                    tx = box["tx"] = self.m_prepared(streams, lengths, True, fwd, free_before, used_before)
                    self.run(tx, "op")
                    box["before"] = self.snapshot()
                    install()
                    if via == "with_boom":
                        raise Boom("the model failed; the abort is interrupted")

            try:
                with pytest.raises(raised_as):
                    body()
            finally:
                uninstall()
            tx, before = box["tx"], box["before"]
        else:
            tx = self.start_forward(streams, lengths, True, via="cache")
            if tx is None:
                return
            self.run(tx, "op")
            sm, b = streams[-1]
            call = {
                "cpc": lambda: sm.state.commit_paged_context(b),
                "ctx.commit": tx.ctx.commit,
                "state.abort": lambda: sm.state.abort(b),
            }[via]
            before = self.snapshot()
            install()
            try:
                with pytest.raises(raised_as) as error:
                    call()
            finally:
                uninstall()
            if isinstance(error.value, CommitFailedError):
                assert isinstance(error.value.__cause__, injected), "a failed commit must name its cause"
        if where == "sigint":
            event("SIGINT during a commit: deferred, all streams committed")
            self.m_finish(tx, True)
        elif where == "plan_commit":
            event(f"{injected.__name__} injected into plan_commit: no stream committed, the forward aborted")
            assert tx.tx.status == "aborted", f"a failed commit left the forward {tx.tx.status}"
            self.m_finish(tx, False)
        else:
            event(f"{injected.__name__} injected into {where} ({'commit' if success else 'abort'}): nothing changed")
            after = self.snapshot()
            assert after == before, f"an interrupted finish changed state: {self.diff(before, after)}"
            assert tx.is_open and tx.tx.is_open
            if then == "commit":
                self.finish(tx, "ctx.commit", 0)
            elif then == "abort":
                self.finish(tx, "ctx.abort", 0)

    @staticmethod
    def can_defer_sigint() -> bool:
        """A real SIGINT is only safe where ``deferred_interrupts`` can hold it (main thread, default handler)."""
        return threading.current_thread() is threading.main_thread() and (
            signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )

    @precondition(lambda self: any(s.cm.check_finite for s in self.open_sessions))
    @rule(
        index=st.integers(0, 8),
        others=st.lists(st.integers(1, 2), max_size=2, unique=True),
        branch_sets=st.lists(st.sampled_from(BRANCH_SETS), min_size=3, max_size=3),
        shape=SHAPES_2,
        commit=st.sampled_from([True, True, False]),
        where=st.tuples(st.integers(0, NUM_LAYERS - 1), st.integers(0, 5), st.integers(0, 5)),
        value=st.sampled_from([float("nan"), float("inf"), float("-inf")]),
        how=st.sampled_from(["cpc", "ctx.commit", "with"]),
    )
    def non_finite_forward(
        self, index: int, others: list[int], branch_sets: list, shape: tuple, commit: bool,
        where: tuple[int, int, int], value: float, how: str,
    ) -> None:
        """``check_finite=True``: a committing forward that wrote NaN/Inf aborts (history unchanged) and raises."""
        candidates = [s for s in self.open_sessions if s.cm.check_finite]
        streams = self.pick_streams(candidates, index, others, branch_sets)
        self.settle(streams, commit)
        nan = (*where, value)
        lengths = self.shape(shape)
        if how != "with":
            tx = self.start_forward(streams, lengths, commit, via="cache")
            if tx is None:
                return
            self.run(tx, "op", nan)
            self.finish(tx, how, 0)
            return
        cm = streams[0][0].cm
        failure = self.predict_prepare(cm, streams, lengths, via="cache")
        fn, args, kwargs = self.prepare_call(streams, lengths, commit, "cache")
        if failure is not None:
            self.expect_failure(failure, fn, *args, **kwargs)
            return
        free_before, used_before = set(cm.cache.allocator.free_pages()), cm.cache.allocator.num_used
        box: dict[str, Any] = {}

        def body() -> None:
            with fn(*args, **kwargs) as fwd:
                tx = box["tx"] = self.m_prepared(streams, lengths, commit, fwd, free_before, used_before)
                self.run(tx, "op", nan)
                box["outcome"] = self.predict_finish(tx, True)

        try:
            body()
            raised = None
        except NonFiniteKVError as exc:
            raised = exc
        assert (raised is not None) == (box["outcome"] is NonFiniteKVError), f"unexpected {raised!r}"
        if raised is not None:
            event("check_finite aborted a commit (with exit)")
        self.m_finish(box["tx"], raised is None)

    # ================================================================== rules: failures that change nothing
    @precondition(lambda self: self.open_sessions)
    @rule(
        index=st.integers(0, 8),
        others=st.lists(st.integers(1, 2), max_size=2, unique=True),
        branch_sets=st.lists(st.sampled_from(BRANCH_SETS), min_size=3, max_size=3),
        shape=SHAPES,
        commit=st.booleans(),
        exc=st.sampled_from(["boom", "halt", "keyboard", "static"]),
    )
    def plan_fails(
        self, index: int, others: list[int], branch_sets: list, shape: tuple, commit: bool, exc: str
    ) -> None:
        """``plan()`` raising after pages were taken (pending chunks of other lengths already replaced):
        allocator, free order, peak, pool, registry all unchanged."""
        streams = self.pick_streams(self.open_sessions, index, others, branch_sets)
        cm = streams[0][0].cm
        static = exc == "static"
        lengths = self.shape(shape)
        failure = self.predict_prepare(cm, streams, lengths, via="cache", static=static)
        fn, args, kwargs = self.prepare_call(streams, lengths, commit, "cache")
        if static:
            kwargs = {"static": True, **({"chunk_lengths": lengths.lengths} if lengths.explicit else {})}
            failure = failure or BackendUnavailableError  # the reference backend has no static plans
        else:
            failure = failure or INTERRUPTS[exc]
            cm.backend.fail = INTERRUPTS[exc]
        try:
            self.expect_failure(failure, fn, *args, **kwargs)
        finally:
            cm.backend.fail = None

    @precondition(lambda self: self.open_sessions)
    @rule(index=st.integers(0, 8), branches=st.sampled_from(BRANCH_SETS), commit=st.booleans())
    def exhaust_capacity(self, index: int, branches: tuple[str, ...], commit: bool) -> None:
        """A forward asking for more pages than are free raises CapacityError and changes nothing."""
        sm = self.pick(self.open_sessions, index)
        free_chunks = sm.cm.cache.allocator.num_free // self.ppc
        num_chunks = max(len(sm.pending[b]) for b in branches) + free_chunks + 1 + sm.cm.extent_chunks
        streams = [(sm, b) for b in branches]
        shape = self.full(num_chunks)
        exc = self.predict_prepare(sm.cm, streams, shape, via="state")
        assert exc is not None, "capacity model broken: one branch alone needs more than is free"
        info = self.expect_failure(exc, sm.state.prepare_forward, branches, shape.seq_len, commit)
        if exc is CapacityError:
            assert info.free == sm.cm.cache.allocator.num_free
            assert info.needed > info.free
            assert str(info.needed) in str(info) and str(info.free) in str(info)

    @precondition(lambda self: self.open_sessions)
    @rule(
        index=st.integers(0, 8),
        others=st.lists(st.integers(1, 2), max_size=2, unique=True),
        branch_sets=st.lists(st.sampled_from(BRANCH_SETS), min_size=3, max_size=3),
        kind=st.sampled_from(BAD_KINDS),
        via=st.sampled_from(["cpc", "ctx.commit", "with"]),
        then=st.sampled_from(["commit", "abort", "later"]),
        shape=SHAPES_2,
    )
    def misbehaving_policy(
        self, index: int, others: list[int], branch_sets: list, kind: str, via: str, then: str, shape: tuple
    ) -> None:
        """A user's retention policy breaks its contract at a commit (on the forward's last stream, after the
        others' commits were computed): SpecError naming the policy, no stream committed, and the forward is
        aborted (a failed commit never leaves it open): its pending pages go, history stays; the invariants
        check it against the model."""
        streams = self.pick_streams(self.open_sessions, index, others, branch_sets)
        self.settle(streams, then == "commit")
        cm = streams[0][0].cm
        lengths = self.shape(shape)
        if via == "with":
            failure = self.predict_prepare(cm, streams, lengths, via="cache")
            fn, args, kwargs = self.prepare_call(streams, lengths, True, "cache")
            if failure is not None:
                self.expect_failure(failure, fn, *args, **kwargs)
                return
            free_before, used_before = set(cm.cache.allocator.free_pages()), cm.cache.allocator.num_used
            fwd = fn(*args, **kwargs)
            tx = self.m_prepared(streams, lengths, True, fwd, free_before, used_before)
        else:
            tx = self.start_forward(streams, lengths, True, via="cache")
            if tx is None:
                return
        self.run(tx, "op")
        sm, b = streams[-1]
        history = sm.state.history(b)
        real = history.policy
        bad = Misbehaving(real)
        bad.arm(kind, resident=history.resident_index, committed=history.committed_chunks)

        def call() -> None:
            if via == "cpc":
                sm.state.commit_paged_context(b)
            elif via == "ctx.commit":
                tx.ctx.commit()
            else:
                with tx.ctx:
                    pass

        history.policy = bad  # NOTE: this branch only; the 1st..n-1th streams' commits compute fine
        try:
            with pytest.raises(SpecError) as info:
                call()
        finally:
            history.policy = real
        message = str(info.value)
        assert "retention policy Misbehaving." in message and BAD_MESSAGES[bad.applied] in message, message
        event(f"misbehaving policy ({bad.applied}) refused at commit")
        assert tx.tx.status == "aborted", f"a refused commit left the forward {tx.tx.status}"
        self.m_finish(tx, False)

    @precondition(lambda self: any(t.is_open and t.commit for s in self.open_sessions for t in s.forward.values() if t))
    @rule(index=st.integers(0, 4 * MAX_SESSIONS), commit=st.booleans(), shape=SHAPES, with_other=st.booleans())
    def replace_uncommitted(self, index: int, commit: bool, shape: tuple, with_other: bool) -> None:
        """Preparing over a stream of an open committing forward raises and changes nothing."""
        candidates = [(s, b) for s in self.open_sessions for b, t in s.forward.items() if t and t.commit]
        sm, b = self.pick(candidates, index)
        lengths = self.shape(shape)
        if with_other:  # an innocent stream first: nothing of it may change either
            other = "uncond" if b == "cond" else "cond"
            streams = [(sm, other), (sm, b)]
            assert self.predict_prepare(sm.cm, streams, lengths, via="state") is PendingContextError
            fn, args, kwargs = self.prepare_call(streams, lengths, commit, "state")
            self.expect_failure(PendingContextError, fn, *args, **kwargs)
            return
        fn, args, kwargs = self.prepare_call([(sm, b)], lengths, commit, "state")
        self.expect_failure(PendingContextError, fn, *args, **kwargs, match=repr(b))

    @precondition(lambda self: self.open_sessions)
    @rule(
        index=st.integers(0, 8),
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
                "mask_shape",
                "mask_dtype",
                "bad_kv_shape",
                "lengths_sum",
                "lengths_grid",
                "lengths_big",
                "lengths_empty",
                "lengths_type",
                "bad_pending_attention",
            ]
        ),
        seq_len=st.sampled_from(["zero", "negative", "one", "chunk+1", "3chunk-1", "chunk+page"]),
        shape=SHAPES,
    )
    def misuse(self, index: int, kind: str, seq_len: str, shape: tuple) -> None:
        sm = self.pick(self.open_sessions, index)
        state = sm.state
        chunk, page = self.chunk, self.page
        if kind.startswith("lengths_"):
            self.bad_chunk_lengths(sm, kind, self.shape(shape))
        elif kind == "unknown_branch_prepare":
            self.expect_failure(UnknownBranchError, state.prepare_forward, ("nope", "cond"), chunk, False, match="nope")
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
            # "chunk+page": a shorter and a full chunk need chunk_lengths; seq_len alone is refused.
            n = {"zero": 0, "negative": -chunk, "one": 1, "chunk+1": chunk + 1, "3chunk-1": 3 * chunk - 1,
                 "chunk+page": chunk + page}[seq_len]
            if n > 0 and n % page == 0 and (n < chunk or n % chunk == 0):
                n = chunk + 1  # one shorter chunk (whole pages), or full chunks, are allowed: not a misuse
            self.expect_failure(SequenceLengthError, state.prepare_forward, ("cond",), n, False, match=str(chunk))
            self.expect_failure(SequenceLengthError, state.get_kv_caches, "uncond", n, True)
        elif kind == "bad_pending_attention":
            # Validated with the arguments, before the streams' states: even under an open committing forward.
            self.expect_failure(
                SpecError, state.prepare_forward, BRANCHES, chunk, False, pending_attention="causal",
                match="pending_attention: expected one of ('block_causal', 'bidirectional'), got 'causal'",
            )
            self.expect_failure(SpecError, state.get_kv_caches, "cond", chunk, True, pending_attention=1)
        elif kind == "seq_none":
            self.expect_failure(SequenceLengthError, state.get_kv_caches, "cond", None, True)
        elif kind == "duplicate_stream":
            exc = self.predict_prepare(sm.cm, [(sm, "cond"), (sm, "cond")], self.full(), via="cache")
            self.expect_failure(exc, sm.cm.cache.prepare_forward, [(state, "cond"), (state, "cond")], chunk, False)
        elif kind == "duplicate_session_id":
            self.expect_failure(SpecError, sm.cm.cache.open_session, state.session_id, match=state.session_id)
        elif kind == "fork_unknown_branch":
            self.expect_failure(UnknownBranchError, state.fork, branches=("cond", "nope"), match="nope")
        elif kind == "fork_duplicate_id":
            self.expect_failure(SpecError, state.fork, state.session_id, match=state.session_id)
        elif kind == "cross_before_populate":
            missing = [b for b in BRANCHES if b not in sm.cross]
            if missing:
                self.expect_failure(CrossAttentionNotPopulatedError, state.get_cross_attention_kv, missing[0], "text")
        elif kind in ("mask_shape", "mask_dtype"):
            streams = [(sm, "cond"), (sm, "uncond")]
            lengths = self.shape(shape)
            exc = self.predict_prepare(sm.cm, streams, lengths, via="state", mask_ok=False)
            mask = self.make_mask(streams, lengths, bad=kind.split("_")[1])
            fn, args, kwargs = self.prepare_call(streams, lengths, False, "state", mask)
            self.expect_failure(exc, fn, *args, **kwargs)
        elif kind == "bad_kv_shape":
            open_ctx = [c for c in self.contexts if self.model_active(c)]
            if open_ctx:
                ctx = open_ctx[0]
                q, k, v = self.layer_inputs(ctx, 0, "op")
                self.expect_failure(TensorMismatchError, chunk_attention, q, k[:, :-1], v, ctx.layers[0])

    def bad_chunk_lengths(self, sm: SessionModel, kind: str, shape: Shape) -> None:
        """Invalid ``chunk_lengths`` are refused (SequenceLengthError) before anything changes: a sum other than
        ``seq_len``, a length off the page grid or above ``chunk_size``, none, a set."""
        chunk, page = self.chunk, self.page
        lengths: Any = list(shape.lengths)
        seq_len = shape.seq_len
        if kind == "lengths_sum":
            seq_len += page
        elif kind == "lengths_grid":
            lengths[-1] = lengths[-1] - 1 if page > 1 else 0  # off the page grid (page 1: an empty chunk)
            seq_len = sum(lengths)
        elif kind == "lengths_big":
            lengths[0] = chunk + page
            seq_len = sum(lengths)
        elif kind == "lengths_empty":
            lengths, seq_len = [], 0
        else:
            lengths = set(lengths)
        # Validated before the streams' states are looked at: even a branch under an open committing forward.
        self.expect_failure(
            SequenceLengthError, sm.state.prepare_forward, BRANCHES, seq_len, False, chunk_lengths=lengths,
            match="chunk_lengths" if kind != "lengths_sum" else "seq_len",
        )
        event(f"invalid chunk_lengths refused ({kind})")

    @precondition(lambda self: self.closed_sessions)
    @rule(
        index=st.integers(0, 4 * MAX_SESSIONS),
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
        exc: type[BaseException] = SessionClosedError
        calls = {
            "prepare": (state.prepare_forward, ("cond",), self.chunk, False),
            "get_kv_caches": (state.get_kv_caches, "cond", self.chunk, True),
            "commit": (state.commit_paged_context, "cond"),
            "abort": (state.abort,),
            "populate": (state.populate_cross_attention, "cond", "text", [cross_value(0.0, 0)] * NUM_LAYERS),
            "clear": (state.clear_cross_attention,),
            "visible": (state.visible_chunks, "uncond"),
            "fork": (state.fork,),
        }
        if self.open_sessions:
            other = self.open_sessions[0]
            calls["share_sinks_from_closed"] = (other.state.share_sinks_from, state, "cond")
            calls["share_cross_from_closed"] = (other.state.share_cross_attention_from, state, "text", "cond")
            if op.startswith("share") and other.cm is not sm.cm:
                exc = SpecError  # another cache's session: refused before its state is looked at
        if op not in calls and op != "batch":
            return  # needs an open session
        if op == "batch":
            # The closed session first: an open stream first could legitimately fail another check.
            streams = [(sm, "cond")] + [(s, "uncond") for s in self.sessions_of(sm.cm)[:1]]
            exc = self.predict_prepare(sm.cm, streams, self.full(), via="cache")
            fn, args = sm.cm.cache.prepare_forward, ([(s.state, b) for s, b in streams], self.chunk, False)
        else:
            fn, *args = calls[op]
        self.expect_failure(exc, fn, *args, match=state.session_id if exc is SessionClosedError else None)

    @precondition(lambda self: any(c.closed for c in self.caches))
    @rule(index=st.integers(0, MAX_CACHES), op=st.sampled_from(["open_session", "admit", "prepare", "close", "fork"]))
    def closed_cache_misuse(self, index: int, op: str) -> None:
        """A closed KVCache refuses new sessions and forwards (CacheClosedError); ``close()`` is idempotent."""
        cm = self.pick([c for c in self.caches if c.closed], index)
        old = [s for s in self.sessions if s.cm is cm]
        if op == "open_session":
            self.expect_failure(CacheClosedError, cm.cache.open_session)
        elif op == "admit":
            self.expect_failure(CacheClosedError, cm.cache.admit_session)
        elif op == "prepare" and old:
            self.expect_failure(CacheClosedError, cm.cache.prepare_forward, [(old[0].state, "cond")], self.chunk, True)
            self.expect_failure(SessionClosedError, old[0].state.prepare_forward, ("cond",), self.chunk, True)
        elif op == "fork" and old:
            self.expect_failure(SessionClosedError, old[0].state.fork)
        elif op == "close":
            before = self.snapshot()
            cm.cache.close()
            assert self.snapshot() == before

    @precondition(lambda self: len([c for c in self.open_caches if self.sessions_of(c)]) >= 2)
    @rule(
        i=st.integers(0, 8),
        j=st.integers(0, 8),
        op=st.sampled_from(["prepare", "batch", "share_sinks", "share_cross"]),
        branch=st.sampled_from(BRANCHES),
    )
    def cross_cache_misuse(self, i: int, j: int, op: str, branch: str) -> None:
        """Sessions of one KVCache cannot be used with another: SpecError, neither cache changes."""
        caches = [c for c in self.open_caches if self.sessions_of(c)]
        a = self.pick(caches, i)
        b = self.pick([c for c in caches if c is not a], j)
        sa, sb = self.sessions_of(a)[i % len(self.sessions_of(a))], self.sessions_of(b)[j % len(self.sessions_of(b))]
        if op == "prepare":
            self.expect_failure(SpecError, a.cache.prepare_forward, [(sb.state, branch)], self.chunk, False)
        elif op == "batch":
            self.expect_failure(
                SpecError, a.cache.prepare_forward, [(sa.state, branch), (sb.state, branch)], self.chunk, True
            )
        elif op == "share_sinks":
            self.expect_failure(SpecError, sa.state.share_sinks_from, sb.state, branch)
        else:
            self.expect_failure(SpecError, sa.state.share_cross_attention_from, sb.state, "text", branch)
        event("cross-cache misuse refused")

    # ================================================================== rules: cross-attention
    @precondition(lambda self: self.open_sessions)
    @rule(
        index=st.integers(0, 8),
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
    @rule(index=st.integers(0, 8))
    def clear_cross(self, index: int) -> None:
        sm = self.pick(self.open_sessions, index)
        visible = {b: sm.state.visible_chunks(b) for b in BRANCHES}
        sm.state.clear_cross_attention()
        sm.cross.clear()
        assert {b: sm.state.visible_chunks(b) for b in BRANCHES} == visible  # self-attention untouched

    @precondition(lambda self: self.open_sessions)
    @rule(i=st.integers(0, 8), j=st.integers(0, 8), branch=st.sampled_from((None,) + BRANCHES))
    def share_cross(self, i: int, j: int, branch: str | None) -> None:
        """Reuse another session's populated cross cache; refused unchanged if any branch lacks it."""
        target = self.pick(self.open_sessions, i)
        source = self.pick(self.sessions_of(target.cm), j)
        names = BRANCHES if branch is None else (branch,)
        if not all(b in source.cross for b in names):
            self.expect_failure(
                CrossAttentionNotPopulatedError, target.state.share_cross_attention_from, source.state, "text", branch
            )
            return
        target.state.share_cross_attention_from(source.state, "text", branch)
        for b in names:
            target.cross[b] = source.cross[b]

    # ================================================================== rules: sharing
    @precondition(lambda self: any(len(self.sessions_of(s.cm)) < MAX_SESSIONS for s in self.open_sessions))
    @rule(
        index=st.integers(0, 8),
        branches=st.sampled_from([None, ("cond",), ("uncond",), ("uncond", "cond"), "cond"]),
        share_cross=st.booleans(),
        pre_steps=st.sampled_from([0, 1, "fill"]),
        parent_steps=st.integers(0, 4),
    )
    def fork(
        self, index: int, branches: tuple[str, ...] | None, share_cross: bool, pre_steps, parent_steps: int
    ) -> None:
        """A child session sharing the parent's resident chunks by refcount (zero pages allocated or written).

        The parent first fills its window a little (``pre_steps``), then moves on after the fork: its
        evictions must neither free nor overwrite pages the child still sees (with extents: an evicted
        slot the child still sees is not reused).
        """
        parent = self.pick([s for s in self.open_sessions if len(self.sessions_of(s.cm)) < MAX_SESSIONS], index)
        names = BRANCHES if branches is None else (branches,) if isinstance(branches, str) else branches
        if pre_steps == "fill":  # sinks and window full: the parent's next commits evict shared chunks
            window = self.spec.window_chunks if self.spec.window_chunks is not None else 1
            pre_steps = max(0, self.spec.sink_chunks + window - min(len(parent.committed[b]) for b in names))
        self.roll(parent, names, pre_steps)
        free_before = parent.cm.cache.allocator.free_pages()
        child_state = parent.state.fork(branches=branches, share_cross_attention=share_cross)
        assert parent.cm.cache.allocator.free_pages() == free_before, "fork must not allocate"
        child = SessionModel(child_state, parent.cm)
        for b in names:
            child.committed[b] = list(parent.committed[b])  # same visible chunks (same contents), same offset
            if share_cross and b in parent.cross:
                child.cross[b] = parent.cross[b]
        self.sessions.append(child)
        event("forked a session")
        self.roll(parent, names, parent_steps)

    @precondition(lambda self: self.open_sessions)
    @rule(i=st.integers(0, 8), j=st.integers(0, 8), branch=st.sampled_from(BRANCHES))
    def share_sinks(self, i: int, j: int, branch: str) -> None:
        """Start an empty branch from another session's sink chunks; a non-empty branch is refused unchanged."""
        target = self.pick(self.open_sessions, i)
        # Prefer a source that has committed chunks on the branch (sinks to share).
        same = sorted(self.sessions_of(target.cm), key=lambda s: not s.committed[branch])
        source = same[j % len(same)] if j % 2 else same[0]
        sinks = self.spec.sink_chunks
        if target.committed[branch] or target.pending[branch]:
            self.expect_failure(SpecError, target.state.share_sinks_from, source.state, branch, match=repr(branch))
            return
        if sinks == 0 or len(source.committed[branch]) < sinks:  # the source must hold all its sinks
            self.expect_failure(SpecError, target.state.share_sinks_from, source.state, branch, match=repr(branch))
            return
        target.state.share_sinks_from(source.state, branch)
        target.committed[branch] = list(source.committed[branch][:sinks])
        target.extent[branch] = None  # an empty branch restarts from scratch (its extent is released)
        event("shared sinks")

    # ================================================================== prompt-switch re-cache
    def m_recache_targets(self, sm: SessionModel, b: str, keep_sinks: bool) -> list[ChunkRecord]:
        """The visible records a re-cache rebuilds: all of them, or all but the sinks (commit order)."""
        sinks = sm.committed[b][: self.spec.sink_chunks] if keep_sinks else []
        return [rec for rec in self.visible_data(sm, b) if not any(rec is s_ for s_ in sinks)]

    def predict_recache(self, streams: list[tuple[SessionModel, str]], keep_sinks: bool) -> type[BaseException] | None:
        cm = streams[0][0].cm
        for sm, b in streams:
            if sm.forward[b] is not None or sm.pending[b]:
                return PendingContextError
            if not self.m_recache_targets(sm, b, keep_sinks):
                return SpecError
        shapes = {tuple(r.tokens for r in self.m_recache_targets(sm, b, keep_sinks)) for sm, b in streams}
        if len(shapes) > 1:
            return SequenceLengthError
        if self.spec.relative_sinks and not keep_sinks:  # rebuilt sinks would sit at their natural distance
            for sm, b in streams:
                records = self.visible_data(sm, b)
                sinks = len(sm.committed[b][: self.spec.sink_chunks])
                if len(records) > sinks and self.m_sink_shift(records, sm, b, sm.committed_tokens(b)):
                    return SpecError
        pages = [n // self.page for n in shapes.pop()]
        # Free ring slots take the first rebuilt chunks (a shorter chunk a slot's first pages), the pool the rest.
        need = sum(sum(pages[len(self.free_slots(sm, b)) :]) for sm, b in streams)
        return CapacityError if need > cm.cache.allocator.num_free else None

    @precondition(lambda self: self.open_sessions)
    @rule(
        index=st.integers(0, 8),
        others=st.lists(st.integers(1, 2), max_size=2, unique=True),
        branch_sets=st.lists(st.sampled_from(BRANCH_SETS), min_size=3, max_size=3),
        keep_sinks=st.booleans(),
        pre_steps=st.integers(0, 3),
        via=st.sampled_from(["state", "cache"]),
        variant=st.sampled_from(["with", "with", "ctx.commit", "cpc", "boom", "ctx.abort", "state.abort", "plan"]),
        layers=st.sampled_from(["all", "partial"]),
    )
    def recache(
        self, index: int, others: list[int], branch_sets: list, keep_sinks: bool, pre_steps: int, via: str,
        variant: str, layers: str,
    ) -> None:
        """Prompt-switch re-cache (``prepare_recache``): rebuild the resident chunks of 1-3 sessions into free
        ring slots then fresh pages, block-causally at their original positions; commit swaps them in on every
        stream at once (offsets, indices unchanged; a fork keeps the old pages), copying those in fresh pages
        into ring slots the commit frees; abort, an exception inside the block or a ``plan()`` failure leave
        the old history bit for bit (free order included); misuse changes nothing."""
        streams = self.pick_streams(self.open_sessions, index, others, branch_sets)
        if via == "state":  # one session
            streams = [(sm, b) for sm, b in streams if sm is streams[0][0]]
        for sm in dict.fromkeys(sm for sm, _ in streams):
            self.roll(sm, tuple(b for s_, b in streams if s_ is sm), pre_steps)
        cm = streams[0][0].cm
        if via == "state":
            fn, args = streams[0][0].state.prepare_recache, (tuple(b for _, b in streams),)
        else:
            fn, args = cm.cache.prepare_recache, ([(sm.state, b) for sm, b in streams],)
        failure = self.predict_recache(streams, keep_sinks)
        if failure is not None or variant == "plan":
            cm.backend.fail = None if failure is not None else Boom
            try:
                self.expect_failure(failure or Boom, fn, *args, keep_sinks=keep_sinks)
            finally:
                cm.backend.fail = None
            event(f"re-cache refused: {(failure or Boom).__name__}")
            return
        targets = {(id(sm), b): self.m_recache_targets(sm, b, keep_sinks) for sm, b in streams}
        free_before, used_before = set(cm.cache.allocator.free_pages()), cm.cache.allocator.num_used
        before = self.snapshot()
        ctx = fn(*args, keep_sinks=keep_sinks)
        lib = ctx.transaction
        assert isinstance(lib, ForwardTransaction) and lib.is_open and lib.recache
        # The forward: fresh pages, original positions, kept sinks visible (never written), block-causal.
        lengths = tuple(r.tokens for r in targets[(id(streams[0][0]), streams[0][1])])
        shape = Shape(lengths)
        fresh: list[int] = []
        for i, (sm, b) in enumerate(streams):
            recs = targets[(id(sm), b)]
            new = list(sm.state.pending_chunks(b))
            assert [len(c) * self.page for c in new] == list(lengths)
            slots = self.free_slots(sm, b)  # this branch's ring: no earlier stream's pending is in it
            ring = new[: len(slots)]
            assert ring == [slot[: len(c)] for slot, c in zip(slots, ring)], f"{b}: re-cache {new}, free slots {slots}"
            if ring:
                event("re-cache: a rebuilt chunk took a free ring slot")
            fresh += [p for c in new[len(ring) :] for p in c]
            kept = [r for r in self.visible_data(sm, b) if not any(r is t for t in recs)]
            positions = [p for r in recs for p in r.positions()]
            assert ctx.positions[i].tolist() == positions, (ctx.positions[i].tolist(), positions)
            history = [p for r in kept for p in r.positions()]
            keys = history + positions
            got = ctx.key_positions()[i].tolist()
            assert got[: len(keys)] == keys and set(got[len(keys) :]) <= {-1}, (got, keys)
            dense = ctx.to_dense()[i]
            assert dense[:, : len(history)].all()
            assert torch.equal(dense[:, len(history) : len(keys)], shape.pending_mask())
            assert {p for r in kept for p in r.pages}.isdisjoint(ctx.layout.write_pages.tolist())
            sm.pending[b], sm.pending_tokens[b] = new, list(lengths)
        assert len(set(fresh)) == len(fresh) and set(fresh) <= free_before, "re-cache pages beyond the ring: fresh"
        cm.peak = max(cm.peak, used_before + len(fresh))
        # The registry (same streams -> same context, LRU), as for any forward.
        key = tuple((sm.state.session_id, b) for sm, b in streams)
        if key in cm.registry:
            assert ctx is cm.registry[key]
            cm.registry.move_to_end(key)
        else:
            cm.registry[key] = ctx
            for k in list(cm.registry):
                if len(cm.registry) <= cm.max_contexts:
                    break
                other = cm.registry[k]
                if other is not ctx and not self.model_active(other):
                    del cm.registry[k]
                    self.released.add(other)
        tx = TxModel(cm, list(streams), True, shape, ctx, lib)
        for sm, b in streams:
            sm.forward[b] = tx
        self.ctx_tx[ctx] = tx
        self.track(ctx)
        self.txs = self.txs[-15:] + [tx]
        # Run the layers (the op): writes land in the fresh pages only.
        plan = ctx.plan
        assert isinstance(plan, (ReferencePlan, RelativeSinkPlan)), type(plan)
        for layer in range(NUM_LAYERS if layers == "all" or cm.check_finite else 1):
            q, k, v = self.layer_inputs(ctx, layer, "op")
            chunk_attention(q, k, v, ctx.layers[layer], **self.sink_query(ctx, q))
            for i, (sm, b) in enumerate(streams):
                cm.pool.write(layer, [p for c in sm.pending[b] for p in c], k[i], v[i])
        pool = self.pool_values(cm)
        slots = pool.reshape(NUM_LAYERS, 2, -1, pool.shape[-2] * pool.shape[-1])
        for i, (sm, b) in enumerate(streams):  # gathered keys: kept sinks as committed, then the fresh pages
            recs = targets[(id(sm), b)]
            kept = [r for r in self.visible_data(sm, b) if not any(r is t for t in recs)]
            pending = [p for c in sm.pending[b] for p in c]
            want = torch.cat(
                [r.token_data() for r in kept] + [cm.pool.pages(pending).reshape(NUM_LAYERS, 2, shape.seq_len, -1)],
                dim=2,
            )
            if isinstance(plan, RelativeSinkPlan):  # kept sinks in the sink segment, the rest in the other
                assert isinstance(plan.sinks, ReferencePlan) and isinstance(plan.rest, ReferencePlan)
                sink_keys = sum(r.tokens for r in kept)
                gathered = torch.cat([plan.sinks.gather[i, :sink_keys], plan.rest.gather[i, : want.shape[2] - sink_keys]])
            else:
                gathered = plan.gather[i, : want.shape[2]]
            assert same_bits(slots[:, :, gathered], want)
        sm0, b0 = streams[0]
        incomplete = not (layers == "all" or cm.check_finite)
        if variant in ("boom", "ctx.abort", "state.abort") or incomplete:
            if variant not in ("boom", "ctx.abort", "state.abort"):  # a commit of a partial re-cache: refused
                with pytest.raises(IncompleteForwardError):
                    if variant == "with":
                        with ctx:
                            pass
                    elif variant == "ctx.commit":
                        ctx.commit()
                    else:
                        sm0.state.commit_paged_context(b0)
                assert lib.status == "aborted", "a refused re-cache commit must abort it"
                event("re-cache of a partial forward refused")
            elif variant == "boom":
                with pytest.raises(Boom), ctx:
                    raise Boom("inside a re-cache")
            elif variant == "ctx.abort":
                ctx.abort()
            else:
                sm0.state.abort(b0)
            for sm, b in streams:
                sm.forward[b] = None
                sm.drop_pending(b)
            tx.status = "aborted"
            after, ci = self.snapshot(), self.caches.index(cm)
            # As before -- free order and refcounts included -- but for the fresh pages' contents (written,
            # then freed: the pool model has them), the peak and the registry (a new forward was prepared).
            assert after[0][ci][0][1:3] == before[0][ci][0][1:3], "an aborted re-cache changed the free list"
            assert after[1] == before[1], "an aborted re-cache changed a session"
            event(f"re-cache aborted ({variant})")
            return
        if variant == "with":
            with ctx:
                pass
        elif variant == "ctx.commit":
            ctx.commit()
        else:
            sm0.state.commit_paged_context(b0)
        assert lib.status == "committed"
        # References once the rebuilt chunks are swapped in (every stream's old chunks let go at once): a ring
        # slot nobody references then is free, and a rebuilt chunk in fresh pages is copied into one -- the old
        # chunk's own slot first, else the lowest -- its fresh pages freed.
        after = self.chunk_references(cm)
        for sm, b in streams:
            after.subtract(p for rec in targets[(id(sm), b)] for p in rec.pages)
        for sm, b in streams:
            ext = set(sm.extent[b] or ())
            free = [slot for slot in self.slots_of(sm, b) if not any(after[p] for p in slot)]
            placed = list(sm.pending[b])
            moving = [j for j, c in enumerate(placed) if c[0] not in ext]
            rest = []
            for j in moving:
                own = targets[(id(sm), b)][j].pages[0]
                slot = next((sl for sl in free if sl[0] == own), None)
                if slot is None:
                    rest.append(j)
                    continue
                free.remove(slot)
                placed[j] = slot[: len(placed[j])]
                event("re-cache: rebuilt chunk copied back into its own ring slot")
            for j in rest:
                if not free:
                    if ext:
                        event("re-cache: rebuilt chunk stays outside the ring (no free slot: a fork shares the old)")
                    continue
                placed[j] = free.pop(0)[: len(placed[j])]
                event("re-cache: rebuilt chunk copied into another free ring slot")
            for src, dst in zip(sm.pending[b], placed):
                if src != dst:
                    cm.pool.copy(src, dst)
            for rec, pages in zip(targets[(id(sm), b)], placed):
                at = next(j for j, r in enumerate(sm.committed[b]) if r is rec)
                sm.committed[b][at] = ChunkRecord(pages, rec.tokens, rec.start, cm.pool.pages(pages))
            sm.forward[b] = None
            sm.drop_pending(b)
        tx.status = "committed"
        event(f"re-cache committed over {len({id(sm) for sm, _ in streams})} session(s), keep_sinks={keep_sinks}")

    # ================================================================== invariants
    @invariant()
    def pages_match_model(self) -> None:
        """Refcounts == references; pending pages exclusive; free/used partition; stats; peak."""
        for cm in self.open_caches:
            alloc = cm.cache.allocator
            chunk_refs = self.chunk_references(cm)
            refs = Counter(chunk_refs)
            for sm in self.sessions_of(cm):
                for b in BRANCHES:
                    refs.update(sm.extent[b] or ())  # the extent's own reservation reference
                    for chunk in sm.pending[b]:
                        shared = [p for p in chunk if chunk_refs[p] != 1]
                        assert not shared, (
                            f"{sm.state.session_id}/{b}: pending pages {shared} are also referenced elsewhere"
                        )
            for page in range(alloc.num_pages):
                assert alloc.refcount(page) == refs[page], (
                    f"{cm.label} page {page}: refcount {alloc.refcount(page)}, referenced {refs[page]} time(s)"
                )
            free, used = alloc.free_pages(), alloc.used_pages()
            assert len(free) == len(set(free)), f"duplicate page in the free list {free}"
            assert not set(free) & set(used), f"pages both free and used: {set(free) & set(used)}"
            assert set(free) | set(used) == set(range(alloc.num_pages))
            alloc.check_invariants()
            stats = cm.cache.stats()
            assert stats.pages_used == len(used) and stats.pages_free == len(free)
            assert alloc.peak_used == stats.peak_pages_used == cm.peak, (
                f"{cm.label}: peak_pages_used {alloc.peak_used}, model {cm.peak}"
            )

    @invariant()
    def sessions_match_model(self) -> None:
        for cm in self.caches:
            assert set(cm.cache.sessions) == {sm.state.session_id for sm in self.sessions_of(cm)}
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
                    f"{self.spec.sink_chunks} + last {self.spec.window_chunks} of {[r.pages for r in sm.committed[b]]}"
                )
                assert list(state.pending_chunks(b)) == sm.pending[b]
                assert state.committed_chunks(b) == len(sm.committed[b])
                assert state.token_offset(b) == sm.committed_tokens(b), (
                    f"{state.session_id}/{b}: token_offset {state.token_offset(b)}, model {sm.committed_tokens(b)} "
                    f"(committed lengths {[r.tokens for r in sm.committed[b]]})"
                )
                history = state.history(b)
                assert history.committed_tokens == sm.committed_tokens(b)
                records = self.visible_data(sm, b)
                assert history.history_spans() == [(r.start, r.tokens) for r in records], (
                    f"{state.session_id}/{b}: spans {history.history_spans()}, model "
                    f"{[(r.start, r.tokens) for r in records]}"
                )
                assert history.history_positions() == [p for r in records for p in r.positions()]
                assert [len(c) * self.page for c in state.pending_chunks(b)] == sm.pending_tokens[b]
                tx, lib = sm.forward[b], state.open_forward(b)
                if tx is None:
                    assert lib is None, f"{state.session_id}/{b}: open forward {lib}, the model has none"
                else:
                    assert lib is tx.tx, f"{state.session_id}/{b}: open forward {lib}, expected {tx.tx}"
                    assert lib.commit_current == tx.commit and lib.num_chunks == tx.num_chunks
                    assert tx.ctx.transaction is lib
                    assert lib.members == tuple((s.state, bb) for s, bb in tx.streams)
                assert state._pending[b] is lib  # the read-only 0.1 view agrees
                populated = state.is_cross_attention_populated(b, "text")
                assert populated == (b in sm.cross)
                if populated:
                    got = state.get_cross_attention_kv(b, "text")
                    assert len(got) == NUM_LAYERS
                    for layer, d in enumerate(got):
                        ek, ev = cross_value(sm.cross[b], layer)
                        assert torch.equal(d["k"], ek) and torch.equal(d["v"], ev)
                assert tuple(state.history(b).extent) == (sm.extent[b] or ())
            held = sum(len(c) for b in BRANCHES for c in self.visible(sm, b) + sm.pending[b])
            held += sum(len(sm.extent[b] or ()) for b in BRANCHES)
            assert state.pages_in_use() == held

    @invariant()
    def pool_contents_match_model(self) -> None:
        """No write outside an open forward's pending pages; committed chunks keep their contents."""
        for cm in self.open_caches:
            pool = self.pool_values(cm)
            bad = cm.pool.mismatched_pages(pool)
            assert not bad, f"{cm.label}: pages {bad} hold contents no open forward wrote there"
            for sm in self.sessions_of(cm):
                for b in BRANCHES:
                    for rec in self.visible_data(sm, b):
                        assert same_bits(pool[:, :, list(rec.pages)], rec.data), (
                            f"{sm.state.session_id}/{b}: committed chunk {rec.pages} changed since its commit"
                        )

    @invariant()
    def forwards_match_model(self) -> None:
        """Context registry (identity, LRU order); each context's state; each tracked transaction's status."""
        for cm in self.caches:
            lib = cm.cache.forward_contexts()
            assert cm.cache.num_forward_contexts == len(lib) == len(cm.registry), (
                f"{cm.label}: {len(lib)} forward contexts, model {len(cm.registry)}"
            )
            assert all(a is b for a, b in zip(lib, cm.registry.values())), (
                f"{cm.label}: forward contexts {[c.streams for c in lib]}, model (LRU first) {list(cm.registry)}"
            )
        for ctx, tx in self.ctx_tx.items():
            assert ctx.released == (ctx in self.released), f"context {ctx.streams}: released={ctx.released}"
            assert ctx.transaction is tx.tx
            assert tx.tx.status == tx.status, f"forward over {ctx.streams}: {tx.tx.status}, model {tx.status}"
            assert ctx.is_active == self.model_active(ctx)
        for tx in self.txs:
            assert tx.tx.status == tx.status, f"forward over {tx.ctx.streams}: {tx.tx.status}, model {tx.status}"

    @invariant()
    def open_forwards_see_model(self) -> None:
        """Every open forward: positions, key positions, dense mask and gathered K/V == the model's (``check_view``)."""
        for cm in self.open_caches:
            for ctx in cm.registry.values():
                if self.model_active(ctx):
                    self.check_view(self.ctx_tx[ctx])

    def teardown(self) -> None:
        if sys.exc_info()[1] is not None:
            return  # a step or invariant failed (hypothesis tears down in a `finally`): do not mask its report
        for sm in self.sessions:
            sm.state.close()
        for cm in self.caches:
            alloc = cm.cache.allocator
            assert alloc.num_free == alloc.num_pages, (
                f"leak: {alloc.used_pages()} still used after closing every session"
            )
            assert all(alloc.refcount(p) == 0 for p in range(alloc.num_pages))
            alloc.check_invariants()
            assert cm.cache.sessions == {}
            assert cm.cache.num_forward_contexts == 0  # closing a session releases its contexts
            cm.cache.close()
        for ctx in self.ctx_tx:
            assert ctx.released and not ctx.is_active


TestSessionStateMachine = pytest.mark.slow(SessionStateMachine.TestCase)
# More and longer runs than the profile's default: this machine is the main leak/consistency net.
TestSessionStateMachine.settings = settings(
    max_examples=settings.default.max_examples * 3 // 2,
    stateful_step_count=settings.default.stateful_step_count * 2,
)


# ====================================================================== FP8 pool
FP8 = torch.float8_e4m3fn
#: Fixed K/V scales ``[layers, 2 (K, V), kv_heads]`` set before any write: a different one per (layer, K|V),
#: so K and V (or two layers) quantized or dequantized with each other's scale read back wrong.
FP8_SCALES = torch.tensor([[[0.01], [0.02]], [[0.03], [0.05]]], dtype=torch.float32)
#: Codes per K/V element: the positive e4m3 bytes 0x00..0x7e (0x7f is NaN); two per token give its id.
_FP8_CODES = 0x7F


def fp8_decode(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A pool's bytes ``[layers, 2, pages, page_size, heads, dim]`` (uint8) as float32, each (layer, K|V) with its scale.

    The library's own ``dequantize`` on the same inputs: what the reference backend reads back.
    """
    out = torch.empty(codes.shape, dtype=torch.float32)
    for layer in range(codes.shape[0]):
        for kind in range(2):
            out[layer, kind] = dequantize(codes[layer, kind].view(FP8), scales[layer, kind], torch.float32)
    return out


class FP8PoolContents(PoolContents):
    """:class:`PoolContents` of an FP8 pool: the bytes the model says each page holds (``codes``) and their
    float32 values (``kv``, inherited comparisons): a write is ``quantize(x, scale)`` of the (layer, K|V)."""

    def __init__(self, pool_kv: torch.Tensor, scales: torch.Tensor) -> None:
        assert pool_kv.dtype == FP8, pool_kv.dtype
        self.scales = scales.clone()
        self.codes = pool_kv.detach().view(torch.uint8).clone()
        self.kv = fp8_decode(self.codes, self.scales)

    def write(self, layer: int, pages, k: torch.Tensor, v: torch.Tensor) -> None:
        shape = (len(pages), *self.kv.shape[3:])
        index = torch.tensor(list(pages), dtype=torch.int64)
        for kind, x in enumerate((k, v)):
            scale = self.scales[layer, kind]
            stored = quantize(x.reshape(-1, *self.kv.shape[-2:]), scale)
            self.codes[layer, kind].index_copy_(0, index, stored.view(torch.uint8).reshape(shape))
            self.kv[layer, kind].index_copy_(0, index, dequantize(stored, scale, torch.float32).reshape(shape))

    def copy(self, src, dst) -> None:  # noqa: ANN001
        super().copy(src, dst)
        self.codes[:, :, list(dst)] = self.codes[:, :, list(src)]

    def mismatched_byte_pages(self, pool_kv: torch.Tensor) -> list[int]:
        """Pages whose FP8 bytes differ between the model and ``pool_kv``."""
        a, b = self.codes, pool_kv.view(torch.uint8)
        diff = (a != b).reshape(a.shape[0], a.shape[1], a.shape[2], -1).any(-1).any(0).any(0)
        return diff.nonzero().flatten().tolist()


class FP8SessionStateMachine(SessionStateMachine):
    """The session machine over an FP8 pool (``kv_dtype="float8_e4m3fn"``, fixed :data:`FP8_SCALES`).

    Every check of :class:`SessionStateMachine` holds with the model's contents being the FP8 round trip
    of what each forward wrote (``dequantize(quantize(x, scale), scale)`` with the layer's K or V scale),
    compared bit for bit: the pool and every visible chunk (as values, and here also as bytes), the K/V
    each open forward gathers, and each output against a softmax over those round-tripped keys/values
    (which catches the backend dequantizing with a wrong scale). K/V carry their id in their FP8 bytes
    (two codes per token), so the gathered keys stay distinguishable after quantization.
    """

    def spec_extra(self) -> dict[str, Any]:
        return {"kv_dtype": "float8_e4m3fn"}

    def configure_cache(self, cache: KVCache) -> None:
        cache.set_kv_scales(FP8_SCALES)

    def pool_model(self, cache: KVCache) -> PoolContents:
        return FP8PoolContents(cache.pool.kv, FP8_SCALES)

    def pool_values(self, cm: CacheModel) -> torch.Tensor:
        return fp8_decode(cm.cache.pool.kv.view(torch.uint8), FP8_SCALES)

    def read_back(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k_scale, v_scale = FP8_SCALES[layer]
        return (
            dequantize(quantize(k, k_scale), k_scale, k.dtype),
            dequantize(quantize(v, v_scale), v_scale, v.dtype),
        )

    def layer_inputs(self, ctx: ForwardContext, layer: int, mode: str):
        """As the float machine's, but K/V ids survive FP8: element codes ``(a, b)`` for K, ``(-b, -a)`` for V."""
        if mode == "module":
            return super().layer_inputs(ctx, layer, mode)
        s, n = ctx.positions.shape
        q = torch.randn(s, n, 2, HEAD_DIM, generator=self.gen)
        ids = torch.arange(self.next_id, self.next_id + s * n) % (_FP8_CODES * _FP8_CODES)
        self.next_id += s * n
        a, b = ids // _FP8_CODES, ids % _FP8_CODES
        k_codes = torch.stack([a, b], dim=-1).to(torch.uint8)  # [s * n, 2]
        v_codes = torch.stack([b, a], dim=-1).to(torch.uint8) | 0x80  # sign bit: negative (0x80 is -0.0)
        k_codes = k_codes.repeat(1, HEAD_DIM // 2)
        v_codes = v_codes.repeat(1, HEAD_DIM // 2)
        k_scale, v_scale = FP8_SCALES[layer]
        k = dequantize(k_codes.view(FP8)[:, None], k_scale, torch.float32)  # [s * n, 1, dim]
        v = dequantize(v_codes.view(FP8)[:, None], v_scale, torch.float32)
        # the ids are exact in FP8: quantizing gives back their codes
        assert torch.equal(quantize(k, k_scale).view(torch.uint8)[:, 0], k_codes)
        assert torch.equal(quantize(v, v_scale).view(torch.uint8)[:, 0], v_codes)
        return q, k.view(s, n, 1, HEAD_DIM), v.view(s, n, 1, HEAD_DIM)

    @invariant()
    def fp8_pool_bytes_match_model(self) -> None:
        """The pool's dtype, its scales (never recalibrated) and its bytes, page by page, == the model's."""
        for cm in self.open_caches:
            pool = cm.cache.pool
            assert pool.kv.dtype == FP8, pool.kv.dtype
            assert same_bits(pool.scales.cpu(), FP8_SCALES), f"{cm.label}: scales {pool.scales.tolist()} changed"
            bad = cm.pool.mismatched_byte_pages(pool.kv)
            assert not bad, f"{cm.label}: pages {bad} hold FP8 bytes no open forward wrote there"


TestFP8SessionStateMachine = pytest.mark.slow(FP8SessionStateMachine.TestCase)
# Fewer runs than the float machine (CI time): half the profile's examples, its step count.
TestFP8SessionStateMachine.settings = settings(max_examples=max(1, settings.default.max_examples // 2))


def test_admission_keeps_its_promise_with_forks() -> None:
    """``sessions_that_fit``: admitted sessions *and the open ones* can all run to their peak.

    (Refusing the admission would also be correct; accepting it and then running out is not.)
    """
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, chunk_size=CHUNK, page_size=CHUNK,
                       sink_chunks=0, window_chunks=2, branches=("main",), dtype="float32")
    cache = KVCache(spec, num_pages=8, backend="reference", contiguous_extents=False)

    def commit_one(state: KVState) -> None:
        write_every_layer(state.prepare_forward(("main",), CHUNK, True).layers)
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


def test_failed_plan_keeps_the_context_registry() -> None:
    """Rule 6: a ``prepare_forward`` whose ``plan()`` raises leaves ``forward_contexts()`` as it was,
    LRU order included (the order decides which context the next new batch releases)."""
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, chunk_size=CHUNK, page_size=CHUNK,
                       sink_chunks=0, window_chunks=2, branches=("a", "b"), dtype="float32")
    backend = FlakyPlanBackend()
    cache = KVCache(spec, num_pages=8, backend=backend, contiguous_extents=False, max_forward_contexts=2)
    state = cache.open_session()
    state.prepare_forward(("a",), CHUNK, False).commit()
    state.prepare_forward(("b",), CHUNK, False).commit()
    before = cache.forward_contexts()
    backend.fail = Boom
    with pytest.raises(Boom):
        state.prepare_forward(("a",), CHUNK, False)
    backend.fail = None
    after = cache.forward_contexts()
    assert [c.streams for c in after] == [c.streams for c in before], "a failed prepare_forward reordered the LRU"
    assert all(x is y for x, y in zip(after, before))


def test_fork_keeps_its_pages_when_the_parent_reuses_its_extent() -> None:
    """A fork still sees a chunk its parent evicted from a contiguous extent: the parent's next chunks
    must not take (and overwrite) that slot; the fork's pages keep exactly what was committed."""
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=HEAD_DIM, chunk_size=CHUNK, page_size=CHUNK,
                       sink_chunks=1, window_chunks=1, branches=("main",), dtype="float32")
    cache = KVCache(spec, num_pages=12, backend="reference", contiguous_extents=True)
    parent = cache.open_session()
    first_id = itertools.count(1, 2 * CHUNK)

    def step(state: KVState) -> None:
        with state.prepare_forward(("main",), CHUNK, True) as fwd:
            k, v = token_kv(next(first_id), 1, CHUNK, 0, HEAD_DIM)
            chunk_attention(torch.zeros(1, CHUNK, 1, HEAD_DIM), k, v, fwd.layers[0])

    step(parent)
    step(parent)  # sink + window full, 2 of the 3 extent slots used
    child = parent.fork()
    seen = {c: cache.pool.kv[:, :, list(c)].clone() for c in child.visible_chunks("main")}
    for _ in range(4):  # evicts the shared window chunk; the parent must not reuse its slot while the child sees it
        step(parent)
        for c, data in seen.items():
            assert same_bits(cache.pool.kv[:, :, list(c)], data), f"the child's chunk {c} was overwritten"
    assert list(child.visible_chunks("main")) == list(seen)
