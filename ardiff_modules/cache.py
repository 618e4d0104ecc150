"""``KVCache``: the pool, the allocator and the backend shared by every session.

It opens sessions (:class:`~ardiff_modules.session.KVState`) and prepares
forwards: one :meth:`KVCache.prepare_forward` call validates, allocates the
pending chunks of every stream, builds the layout and the backend plan, and
returns a :class:`~ardiff_modules.context.ForwardContext` whose layer contexts
every attention layer of the model shares. All host work of a forward happens
here, once.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import cast

import torch

from ardiff_modules.core.allocator import PageAllocator
from ardiff_modules.backends import AttentionBackend, AttentionPlan, PlanRequest, resolve_backend
from ardiff_modules.backends.segmented import plan_forward
from ardiff_modules.checks import require_bool, require_int
from ardiff_modules.context import ForwardContext, LayerContext
from ardiff_modules.forwards.registry import ContextRegistry
from ardiff_modules.errors import (
    ARDiffError,
    CacheClosedError,
    CapacityError,
    CommitFailedError,
    KVScalesFixedError,
    LatentsNotKeptError,
    NonFiniteKVError,
    SpecError,
    TensorMismatchError,
)
from ardiff_modules.core.transaction import ForwardTransaction
from ardiff_modules.core.branch import BranchPages
from ardiff_modules.layout import ForwardLayout, StreamLayout
from ardiff_modules.pool import KVPool, pages_for_budget, torch_dtype
from ardiff_modules.core.reservation import Reservation
from ardiff_modules.spec import KVCacheSpec, PendingAttention
from ardiff_modules.session import KVState
from ardiff_modules.forwards.validation import (
    check_capacity,
    check_no_open_commit,
    check_recache_capacity,
    check_recache_latents,
    check_recache_sinks_in_place,
    check_token_mask,
    chunk_lengths_of,
    kept_latents,
    pending_attention_of,
    recache_chunk_pages,
    validate_streams,
)
from ardiff_modules.core.retention import RetentionPolicy

#: DEBUG: the cache's geometry when built, each forward prepared / committed / aborted (host side,
#: once per forward; nothing per layer). WARNINGs of the backend choice come from ``ardiff_modules.backends``.
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheStats:
    """Snapshot of pool usage."""

    num_pages: int
    pages_used: int
    pages_free: int
    peak_pages_used: int
    bytes_per_page: int
    pool_bytes: int
    bytes_used: int
    cross_attention_bytes: int
    sessions: dict[str, dict[str, int]]  # session -> branch -> pages referenced


class KVCache:
    """Paged sink+window KV storage for any number of sessions.

    Parameters
    ----------
    spec:
        Geometry and policy.
    num_pages, budget_bytes:
        Pool size, as a page count or a byte budget (exactly one).
    device:
        Device of the pool.
    backend:
        ``"auto"`` (FlashInfer on CUDA when available, else reference),
        ``"reference"``, ``"flashinfer"`` or an :class:`AttentionBackend` instance.
    contiguous_extents:
        Reserve for each branch, on its first forward, one run of consecutive pages holding
        ``sinks + window + 1`` chunks, used as a ring: one-chunk forwards then see one
        contiguous key range and run ragged (unpaged) FA3, the fastest kernel. Same peak
        memory as plain paging once the window is full, reserved up front. ``None`` (default)
        enables it when the backend is FlashInfer and the window is bounded.
    max_forward_contexts:
        Forward contexts (one per distinct batch of streams, each holding kernel plans and their
        buffers) kept for reuse; beyond this the least recently used idle one is released, so
        serving with ever-changing batch compositions does not grow memory.
    check_finite:
        Before a committing forward's chunks join history, check their K/V (every layer) for
        NaN/Inf; on any, abort the forward and raise :class:`NonFiniteKVError`. Costs one device
        sync and a read of the pending pages per commit; off by default.

    Thread safety: every host-side operation of the cache and its sessions (prepare, commit,
    abort, open/close/reset/fork, populate, stats, admission) holds one re-entrant lock, so
    threads may each drive their own sessions concurrently. Kernels take no lock. Two threads
    driving the *same* session still race on what it means (which forward comes first).
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        *,
        num_pages: int | None = None,
        budget_bytes: int | None = None,
        device: torch.device | str = "cpu",
        backend: str | AttentionBackend = "auto",
        contiguous_extents: bool | None = None,
        max_forward_contexts: int = 64,
        check_finite: bool = False,
    ) -> None:
        if not isinstance(spec, KVCacheSpec):
            raise SpecError(f"KVCache.spec: expected a KVCacheSpec, got {type(spec).__name__}")
        if contiguous_extents is not None:
            require_bool("KVCache.contiguous_extents", contiguous_extents)
        require_bool("KVCache.check_finite", check_finite)
        if (num_pages is None) == (budget_bytes is None):
            raise SpecError(
                f"KVCache: expected exactly one of num_pages / budget_bytes, got num_pages={num_pages!r}, "
                f"budget_bytes={budget_bytes!r}"
            )
        if num_pages is None:
            num_pages = pages_for_budget(spec, budget_bytes)  # type: ignore[arg-type]
        self.spec = spec
        self.pool = KVPool(spec, num_pages, device)
        self.allocator = PageAllocator(num_pages)
        self.policy: RetentionPolicy = spec.policy
        self._dtype = torch_dtype(spec.dtype)
        self.backend = resolve_backend(backend, self.pool.device, self._dtype, spec.head_dim, kv_dtype=self.pool.dtype)
        if contiguous_extents is None:
            contiguous_extents = self.backend.name == "flashinfer" and spec.max_history_chunks is not None
        if contiguous_extents and spec.max_history_chunks is None:
            raise SpecError("contiguous_extents=True: expected a bounded window (window_chunks), got None")
        #: Chunk slots of each branch's contiguous extent, or ``None`` for plain paging.
        self.extent_chunks = spec.max_history_chunks + 1 if contiguous_extents else None  # type: ignore[operator]
        self._sessions: dict[str, KVState] = {}
        require_int("KVCache.max_forward_contexts", max_forward_contexts, minimum=1)
        self.max_forward_contexts = max_forward_contexts
        self.check_finite = check_finite
        self._forwards = ContextRegistry(max_forward_contexts)
        self._session_ids = itertools.count()
        self._lock = threading.RLock()
        self._closed = False
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "KVCache: %d pages of %d bytes (%.1f MiB) on %s, backend %r, %s",
                num_pages, self.pool.bytes_per_page, self.pool.nbytes / 2**20, self.pool.device, self.backend.name,
                f"contiguous extents of {self.extent_chunks} chunks per branch" if self.extent_chunks
                else "plain paging (no contiguous extents)",
            )

    def __repr__(self) -> str:
        """One line; reads counters without the lock and never touches the device."""
        spec, allocator = self.spec, self.allocator
        kv_dtype = f", kv_dtype={spec.cache_dtype}" if spec.cache_dtype != spec.dtype else ""
        closed = ", closed" if self._closed else ""
        return (
            f"KVCache(layers={spec.num_layers}, kv_heads={spec.num_kv_heads}, head_dim={spec.head_dim}, "
            f"pages={allocator.num_used}/{allocator.num_pages} used, sessions={len(self._sessions)}, "
            f"backend={self.backend.name!r}, device='{self.pool.device}', dtype={spec.dtype}"
            f"{kv_dtype}{closed})"
        )

    # ------------------------------------------------------------------ sessions
    @property
    def device(self) -> torch.device:
        return self.pool.device

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype: queries, outputs, cross-attention caches."""
        return self._dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        """Storage dtype of the paged K/V."""
        return self.pool.dtype

    def set_kv_scales(self, scales: torch.Tensor) -> None:
        """Fix the FP8 K/V scales instead of calibrating them from each layer's first write.

        ``scales`` ``[num_layers, 2 (K, V), num_kv_heads]``, positive and finite (e.g. from a checkpoint's
        calibration): a stored value is ``round_fp8(k / scale)``, read back as ``stored * scale``. Only
        for ``kv_dtype="float8_e4m3fn"``, and only before any K/V was written (pages quantized with other
        scales would read back wrong): raises :class:`KVScalesFixedError` then, changing nothing.
        """
        with self._lock:
            self._check_open("set_kv_scales")
            quantizer = self.pool.quantizer
            if quantizer is None:
                raise SpecError(
                    f"set_kv_scales: expected a cache with kv_dtype='float8_e4m3fn' (scales only apply to FP8 "
                    f"K/V), got kv_dtype={self.spec.cache_dtype!r}"
                )
            expected = tuple(self.pool.scales.shape)
            if not isinstance(scales, torch.Tensor) or tuple(scales.shape) != expected:
                got = tuple(scales.shape) if isinstance(scales, torch.Tensor) else type(scales).__name__
                raise TensorMismatchError(
                    f"set_kv_scales: expected a tensor of shape {list(expected)} [num_layers, 2 (K, V), "
                    f"num_kv_heads], got {got}"
                )
            if scales.is_meta or scales.is_complex() or scales.dtype == torch.bool:
                raise TensorMismatchError(  # NOTE: a meta tensor has no values to read, complex ones no order
                    f"set_kv_scales: expected a real-valued tensor with data (any device but meta), got dtype "
                    f"{scales.dtype} on {scales.device}"
                )
            values = scales.detach().to("cpu", torch.float32)
            if not bool(torch.isfinite(values).all()) or not bool((values > 0).all()):
                raise TensorMismatchError(
                    f"set_kv_scales: expected positive finite scales, got min {float(values.min())}, "
                    f"max {float(values.max())}"
                )
            if quantizer.written:
                raise KVScalesFixedError(
                    "set_kv_scales: expected to be called before any K/V is written (pages already hold K/V "
                    "quantized with the current scales), got a pool that was written to; open a new cache"
                )
            quantizer.set_scales(values)

    @property
    def lock(self) -> threading.RLock:
        """The re-entrant lock around all host bookkeeping of this cache and its sessions."""
        return self._lock

    @property
    def is_closed(self) -> bool:
        return self._closed

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise CacheClosedError(f"{what}: expected an open KVCache, got one that was closed")

    @property
    def sessions(self) -> dict[str, KVState]:
        """Open sessions by id (a copy)."""
        with self._lock:
            return dict(self._sessions)

    @property
    def num_forward_contexts(self) -> int:
        """Forward contexts kept for reuse now (bounded by ``max_forward_contexts``)."""
        return len(self._forwards)

    def forward_contexts(self) -> tuple[ForwardContext, ...]:
        """The forward contexts kept for reuse, least recently used first."""
        with self._lock:
            return tuple(self._forwards)

    def release_idle_forward_contexts(self) -> int:
        """Release every kept forward context whose forward is not open (their plans are rebuilt, and graphs of
        them captured again, on next use); returns how many. Contexts of open forwards stay."""
        with self._lock:
            kept = len(self._forwards)
            self._forwards.release_where(lambda key: not cast(ForwardContext, self._forwards.get(key)).is_active)
            return kept - len(self._forwards)

    def open_session(self, session_id: str | None = None) -> KVState:
        """Open a session with every branch of the spec; no page is allocated until a branch runs."""
        with self._lock:
            self._check_open("open_session")
            _check_session_id(session_id)
            if session_id is None:
                session_id = f"session-{next(self._session_ids)}"
                while session_id in self._sessions:
                    session_id = f"session-{next(self._session_ids)}"
            if session_id in self._sessions:
                raise SpecError(f"open_session: expected a new session id, got {session_id!r} which is already open")
            state = KVState(self, session_id)
            self._sessions[session_id] = state
            return state

    def reopen_session(self, state: KVState) -> None:
        """Called by ``KVState.reset`` of a closed session: register it again under its id."""
        with self._lock:
            self._check_open("reset")
            if state.session_id in self._sessions and self._sessions[state.session_id] is not state:
                raise SpecError(
                    f"reset: session id {state.session_id!r} was reopened by another session; expected it to be free"
                )
            self._sessions[state.session_id] = state

    def session_closed(self, state: KVState) -> None:
        """Called by ``KVState.close``: drop the session and release its forward contexts."""
        with self._lock:
            if self._sessions.get(state.session_id) is state:
                del self._sessions[state.session_id]
            self._forwards.release_where(lambda key: any(sid == state.session_id for sid, _ in key[0]))

    def close(self) -> None:
        """Close every session, release every forward context and the pool's memory. Idempotent.

        Afterwards the cache refuses new sessions and forwards (:class:`CacheClosedError`);
        contexts still held by the caller raise instead of touching the pool.
        """
        with self._lock:
            if self._closed:
                return
            for state in list(self._sessions.values()):
                state.close()
            self._forwards.release_where(lambda key: True)
            self._closed = True
            self.pool.release()

    def __enter__(self) -> KVCache:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ forwards
    def prepare_forward(
        self,
        streams: Sequence[tuple[KVState, str]],
        seq_len: int,
        commit_current: bool = False,
        *,
        token_mask: torch.Tensor | None = None,
        static: bool = False,
        chunk_lengths: Sequence[int] | None = None,
        pending_attention: PendingAttention | None = None,
        keep_latents: torch.Tensor | None = None,
    ) -> ForwardContext:
        """Prepare one forward over ``streams`` (``(session, branch)`` pairs, the batch order).

        Allocates missing pending chunks (reusing those of earlier denoising
        forwards), builds the plan once for all layers, and returns the forward
        context. Raises before changing anything on: misaligned ``seq_len``,
        unknown branch, closed session, duplicate stream, a committing forward
        not yet committed, too few free pages, or a bad ``token_mask``.

        A denoising forward still open on one of ``streams`` is superseded (closed, its
        pending pages kept for reuse) once this one is prepared; if planning itself fails
        on a backend that re-plans in place, that forward is superseded too (its plan is
        no longer trustworthy), and nothing else changes.

        Parameters
        ----------
        token_mask:
            Optional bool ``[num_streams, seq_len, max_keys]`` over the keys in the order of
            :meth:`ForwardContext.to_dense` (visible history, then pending tokens), ANDed with
            the visibility rule: the masked path for masks that are not chunk-structured.
            ``max_keys`` is ``max_visible_keys(...)`` of this forward. A query that sees no
            key at all gets a zero output.
        static:
            Keep every device input of this forward in fixed buffers so that a CUDA graph
            captured once replays correctly after re-planning (see :class:`CUDAGraphStep`).
            Needs the FlashInfer backend and a bounded window.
        chunk_lengths:
            Tokens of each pending chunk when they are not all ``chunk_size`` (e.g. image-to-video's
            1-latent-frame first chunk): multiples of ``page_size``, at most ``chunk_size``, summing
            to ``seq_len``. Default: ``seq_len // chunk_size`` full chunks, or one shorter chunk when
            ``seq_len`` is a multiple of ``page_size`` below ``chunk_size``. Sinks and windows count
            chunks whatever their lengths; positions count tokens.
        pending_attention:
            How the pending chunks of a multi-chunk forward see each other: ``"block_causal"``
            (pending chunk ``c`` sees pending chunks ``0..c``) or ``"bidirectional"`` (every pending
            chunk sees all pending chunks of its stream: Rolling Forcing's jointly denoised window;
            one kernel row per stream). ``None`` (default): the spec's ``pending_attention``. The
            history (sinks and window) and what a commit does are the same under both.
        keep_latents:
            A committing forward only: the clean latents ``[num_streams, seq_len, ...]`` of its chunks
            (the model's input). On commit a copy of each chunk's slice is kept per branch, for as long
            as that chunk is resident, so a prompt switch can re-cache without the caller storing them
            (:meth:`recache_latents`, :meth:`prepare_recache`). Dropped on abort.
        """
        with self._lock:
            self._check_open("prepare_forward")
            members = validate_streams(streams, self)
            lengths = chunk_lengths_of(self.spec, seq_len, commit_current, static, chunk_lengths)
            pending = pending_attention_of(self.spec, pending_attention)
            histories = [state.branch_pages(branch) for state, branch in members]
            for (state, branch), history in zip(members, histories):
                check_no_open_commit(state, branch, history)
            if token_mask is not None:
                expected = (len(histories), seq_len, self.max_visible_keys(histories, seq_len))
                check_token_mask(token_mask, expected, self.pool.device)
            chunk_pages = [length // self.spec.page_size for length in lengths]
            check_capacity(histories, chunk_pages, self.allocator, self._extent_pages)
            latents = () if keep_latents is None else kept_latents(keep_latents, commit_current, len(members), lengths)
            ctx = self._reserve_and_plan(
                members, histories, chunk_pages, commit_current, token_mask, static, pending
            )
            if ctx.transaction is not None:
                ctx.transaction.latents = latents
            return ctx

    @property
    def _extent_pages(self) -> int:
        return (self.extent_chunks or 0) * self.spec.pages_per_chunk

    def _reserve_and_plan(
        self,
        members: tuple[tuple[KVState, str], ...],
        histories: list[BranchPages],
        chunk_pages: list[int],
        commit_current: bool,
        token_mask: torch.Tensor | None,
        static: bool,
        pending_attention: PendingAttention,
    ) -> ForwardContext:
        """Reserve pages, plan, publish; on any failure roll the pages and the peak back exactly."""
        num_chunks = len(chunk_pages)
        seq_len = sum(chunk_pages) * self.spec.page_size
        key = (tuple((state.session_id, branch) for state, branch in members), seq_len if static else None)
        ctx = self._lookup_context(key)
        reservation = Reservation(histories, chunk_pages, self.allocator, self._extent_pages)
        planning = False
        try:
            layout = ForwardLayout(
                streams=tuple(
                    StreamLayout(
                        tuple(h.history_pages()), h.pending[:num_chunks], h.token_offset, tuple(h.history_spans()),
                        sink_pages=self._relative_sink_pages(h),
                    )
                    for h in histories
                ),
                chunk_size=self.spec.chunk_size,
                page_size=self.spec.page_size,
                pending_attention=pending_attention,
            )
            planning = True
            plan = plan_forward(self.backend, self._plan_request(layout, token_mask, static, num_chunks), ctx.plan)
            positions = self._positions(ctx, layout, static)
            cross = self._stack_cross(ctx, members, static)
        except BaseException:
            reservation.rollback()
            if planning:
                self._drop_half_updated_plan(ctx, "prepare_forward")
            raise
        reservation.keep()
        self._publish(ctx, key, members, histories, plan, layout, positions, cross, commit_current, token_mask)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "forward prepared: %s, %d free pages left, plan %r", ctx, self.allocator.num_free, ctx.plan
            )
        return ctx

    def _relative_sink_pages(self, history: BranchPages) -> int:
        """The stream's resident sink pages when sinks sit at relative positions (``0`` otherwise)."""
        return sum(map(len, history.sinks)) if self.spec.relative_sinks else 0

    def _positions(
        self, ctx: ForwardContext, layout: ForwardLayout, static: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(positions, sink_positions)`` on the pool's device (fixed buffers when ``static``); the second
        only with relative sinks (the positions where the sink query is rotated)."""
        positions = _to_device(layout.positions, self.pool.device, ctx.positions if static else None)
        if not self.spec.relative_sinks:
            return positions, None
        buffer = ctx.sink_positions if static else None
        return positions, _to_device(layout.sink_positions, self.pool.device, buffer)

    def _drop_half_updated_plan(self, ctx: ForwardContext, what: str) -> None:
        """After ``plan()`` raised: a backend that re-plans in place may have left ``ctx.plan`` half-updated,
        so the forward that used it can never run again and the next one plans afresh."""
        if ctx.plan is None or not getattr(self.backend, "replans_in_place", True):
            return
        if ctx.transaction is not None and ctx.transaction.is_open:
            ctx.transaction.close("superseded", f"a later {what} failed while planning")
        ctx.plan = None
        ctx.plan_epoch += 1

    def recache_latents(self, streams: Sequence[tuple[KVState, str]], *, keep_sinks: bool = True) -> torch.Tensor:
        """The kept clean latents a re-cache of ``streams`` runs over, ``[num_streams, seq_len, ...]``.

        Per stream, the latents (``keep_latents`` of their committing forwards) of the chunks
        :meth:`prepare_recache` rebuilds, concatenated in commit order. Raises
        :class:`LatentsNotKeptError` naming the chunks whose latents were not kept; nothing changes.
        """
        with self._lock:
            self._check_open("recache_latents")
            members = validate_streams(streams, self)
            histories = [state.branch_pages(branch) for state, branch in members]
            recache_chunk_pages(members, histories, keep_sinks, idle=False)
            rows = []
            for (state, branch), h in zip(members, histories):
                indices = [h.history_index[i] for i in h.recache_targets(keep_sinks)]
                missing = [i for i in indices if i not in h.latents]
                if missing:
                    raise LatentsNotKeptError(
                        f"recache_latents: expected kept latents of chunks {indices} of {state.session_id!r}/"
                        f"{branch!r}, got none for chunk(s) {missing}; pass keep_latents= to their committing "
                        "forwards, or feed the model your own latents"
                    )
                rows.append([cast(torch.Tensor, h.latents[i]) for i in indices])
            check_recache_latents(members, rows)
            return torch.stack([torch.cat(row) for row in rows])

    def prepare_recache(
        self, streams: Sequence[tuple[KVState, str]], *, keep_sinks: bool = True
    ) -> ForwardContext:
        """Prepare a prompt-switch re-cache: one forward that rebuilds the resident history of ``streams``.

        After ``clear_cross_attention()`` and populating the new prompt, run the model over the clean
        latents of each stream's rebuilt chunks -- every resident chunk (sinks + window) in commit
        order, or all but the sinks with ``keep_sinks=True`` -- concatenated along the sequence,
        ``[num_streams, seq_len, ...]`` with ``seq_len = sum(ctx.layout.chunk_lengths)``. The forward
        writes pages no chunk uses only -- with contiguous extents the branch's free ring slots first
        (one once the window is full), then fresh pages from the pool -- and, block-causally, rebuilt
        chunk ``j`` attends to the kept sinks and rebuilt chunks ``0..j``; ``ctx.positions`` are each
        chunk's original absolute positions (RoPE). While it is pending it holds, per stream, the
        rebuilt chunks' pages minus the free ring slots on top of the old history.

        On commit (``ctx.commit()``, leaving ``with ctx:`` normally, ``commit_paged_context``) every
        stream's rebuilt chunks replace the old ones at once; offsets, commit indices and the window
        are unchanged, the old pages lose this session's reference (a fork keeps reading them). With
        contiguous extents, rebuilt chunks in fresh pages are then copied (one host call for the whole
        forward: all layers, K and V, a strided copy per run of pages) into the ring slots the commit
        frees -- the old chunk's own slot when no fork shares it -- and the fresh pages are freed: pool
        use returns to the steady state at commit and the ring stays whole. Where a fork shares the old
        pages the rebuilt chunk stays in its fresh pages (the fork keeps the old ones) until it is
        evicted. On abort or an exception only the re-cache's pages are released (fresh pages
        unallocated, ring slots free again): the old history is untouched.

        Raises before changing anything: :class:`PendingContextError` if a stream has an open forward
        or pending chunks, :class:`SpecError` if a stream has nothing to rebuild,
        :class:`SequenceLengthError` if batched streams' rebuilt chunk lengths differ,
        :class:`CapacityError` if the fresh pages do not fit (old and new history coexist until commit;
        admission keeps room for one session's re-cache at a time, :meth:`recache_reserve`).
        """
        with self._lock:
            self._check_open("prepare_recache")
            members = validate_streams(streams, self)
            histories = [state.branch_pages(branch) for state, branch in members]
            chunk_pages = recache_chunk_pages(members, histories, keep_sinks)
            if self.spec.relative_sinks and not keep_sinks:
                check_recache_sinks_in_place(members, histories)
            check_recache_capacity(histories, chunk_pages, self.allocator)
            num_chunks = len(chunk_pages)
            key = (tuple((state.session_id, branch) for state, branch in members), None)
            ctx = self._lookup_context(key)
            # NOTE: the rebuilt chunks ride as pending (abort/close/reset release them): free ring slots
            # first, then fresh pages; no new extent (extent_pages=0): a branch without one (a fork that
            # has not run since) rebuilds into fresh pages only.
            reservation = Reservation(histories, chunk_pages, self.allocator, 0)
            planning = False
            try:
                streams_layout = []
                for h in histories:
                    history_pages, spans, starts = h.recache_layout_parts(keep_sinks)
                    sink_pages = len(history_pages) if self.spec.relative_sinks else 0  # the kept sinks
                    streams_layout.append(StreamLayout(history_pages, h.pending, starts[0], spans, starts, sink_pages))
                layout = ForwardLayout(
                    streams=tuple(streams_layout), chunk_size=self.spec.chunk_size, page_size=self.spec.page_size,
                    pending_attention="block_causal",
                )
                planning = True
                plan = plan_forward(self.backend, self._plan_request(layout, None, False, num_chunks), ctx.plan)
                positions = self._positions(ctx, layout, False)
                cross = self._stack_cross(ctx, members, False)
            except BaseException:
                reservation.rollback()
                if planning:
                    self._drop_half_updated_plan(ctx, "prepare_recache")
                raise
            reservation.keep()
            self._publish(
                ctx, key, members, histories, plan, layout, positions, cross, True, None,
                recache=True, keep_sinks=keep_sinks,
            )
            assert ctx.transaction is not None
            ctx.transaction.copy_pages = self.pool.copy_pages
            if logger.isEnabledFor(logging.DEBUG):
                fresh = sum(len(h.split_pending()[1]) for h in histories)
                logger.debug("re-cache prepared: %s, %d fresh pages", ctx, fresh)
            return ctx

    def _plan_request(
        self, layout: ForwardLayout, token_mask: torch.Tensor | None, static: bool, num_chunks: int
    ) -> PlanRequest:
        return PlanRequest(
            layout=layout,
            device=self.pool.device,
            dtype=self._dtype,
            kv_dtype=self.pool.dtype,
            num_qo_heads=self.spec.query_heads,
            num_kv_heads=self.spec.num_kv_heads,
            head_dim=self.spec.head_dim,
            quantizer=self.pool.quantizer,
            token_mask=token_mask,
            static=static,
            max_pages=self._max_plan_pages(layout.num_streams, num_chunks) if static else None,
        )

    def _publish(
        self,
        ctx: ForwardContext,
        key: tuple[tuple[tuple[str, str], ...], int | None],
        members: tuple[tuple[KVState, str], ...],
        histories: list[BranchPages],
        plan: AttentionPlan,
        layout: ForwardLayout,
        positions: tuple[torch.Tensor, torch.Tensor | None],
        cross: tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, str], dict[str, tuple[int, ...]]],
        commit_current: bool,
        token_mask: torch.Tensor | None,
        *,
        recache: bool = False,
        keep_sinks: bool = True,
    ) -> None:
        """Install the new forward: supersede open denoising forwards of its streams, open its transaction."""
        superseded = {id(h.transaction): h.transaction for h in histories if isinstance(h.transaction, ForwardTransaction)}
        if ctx.transaction is not None:
            superseded[id(ctx.transaction)] = ctx.transaction
        for old in superseded.values():
            if old.is_open:
                old.close("superseded", "a later forward of one of its streams was prepared")
        self._forwards.publish(key, ctx)  # registers a new context; most recently used; evicts idle ones
        if plan is not ctx.plan:
            ctx.plan_epoch += 1
        ctx.plan, ctx.layout, ctx.commit_current = plan, layout, commit_current
        ctx.positions, ctx.sink_positions = positions
        ctx.token_mask = token_mask
        ctx.set_cross(cross[0], cross[1])
        ctx.cross_stack.adopt(cross[2])
        transaction = ForwardTransaction(
            members=members, commit_current=commit_current, num_chunks=layout.num_chunks,
            histories=tuple(histories), recache=recache, keep_sinks=keep_sinks,
        )
        for h in histories:
            h.transaction = transaction
        ctx.transaction = transaction

    def finish_forward(self, transaction: ForwardTransaction, success: bool) -> None:
        """Commit (``success``) or abort every stream of ``transaction``, all or none. Idempotent.

        A commit is refused -- the forward aborted, history unchanged, the error raised -- unless
        :meth:`abort_if_uncommittable` passes (every layer wrote; with ``check_finite=True`` finite
        K/V; FP8 scales it would fix not degenerate). The new histories are then computed first (may
        raise: nothing changed), then applied with one allocator call and plain assignments under
        :func:`~ardiff_modules.core.transaction.deferred_interrupts`. Whatever a commit raises, the forward is
        finished (aborted) before the error propagates: a library error as it is, anything else as
        :class:`CommitFailedError` chained to it.
        """
        with self._lock:
            if not transaction.is_open:
                return
            if not success:
                transaction.abort(self.allocator)
            else:
                try:
                    self.abort_if_uncommittable(transaction)
                    transaction.commit(self.allocator)
                except BaseException as error:
                    transaction.abort(self.allocator, f"its commit raised {type(error).__name__}")
                    if isinstance(error, ARDiffError) or not isinstance(error, Exception):
                        raise  # names its cause already / KeyboardInterrupt, SystemExit as they are
                    raise CommitFailedError(
                        f"commit: expected the forward's streams {_stream_names(transaction.members)} to commit, got "
                        f"{type(error).__name__}: {error}; the forward was aborted and history is unchanged"
                    ) from error
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug(
                    "forward %s: %d stream(s) %s, %d pages in use",
                    transaction.status, len(transaction.members), _stream_names(transaction.members),
                    self.allocator.num_used,
                )

    def abort_if_uncommittable(self, transaction: ForwardTransaction, *, check_finite: bool | None = None) -> None:
        """Everything that refuses a commit, checked before it: on failure abort the forward and raise.

        For an open committing forward (``commit_current`` or a re-cache): every layer of the spec
        wrote its K/V (else :class:`IncompleteForwardError`: the unwritten pages hold a previous
        owner's K/V); with ``check_finite`` (default: the cache's) no NaN/Inf in the pending K/V
        (:meth:`abort_if_non_finite`); on an FP8 pool, the scales this commit would fix hold no
        degenerate head (:class:`KVCalibrationError`). Host checks, plus one device sync for each of
        the last two when they apply. A denoising or closed forward is left as it is. Public for
        callers that must decide before committing (a distributed forward votes on it first).
        """
        if not isinstance(transaction, ForwardTransaction):
            raise SpecError(
                f"KVCache.abort_if_uncommittable: expected a ForwardTransaction (fwd.transaction), got "
                f"{type(transaction).__name__}"
            )
        with self._lock:
            if not transaction.is_open or not transaction.commit_current:
                return
            try:
                transaction.check_complete(self.spec.num_layers)
                if self.pool.quantizer is not None:
                    self.pool.quantizer.check_commit(transaction)
            except ARDiffError:
                transaction.abort(self.allocator, "its commit was refused")
                raise
            if self.check_finite if check_finite is None else check_finite:
                self.abort_if_non_finite(transaction)

    def abort_if_non_finite(self, transaction: ForwardTransaction) -> None:
        """Check the pending K/V of an open forward: abort it and raise on NaN/Inf, else change nothing.

        What ``check_finite=True`` runs before a commit (one device sync: call it outside the hot
        path), public for callers that must decide before committing -- e.g. a distributed forward
        that votes on the outcome first. ``transaction``: ``ForwardContext.transaction`` of an open
        forward. Reads every live stream's pending pages (``[2, layers, pages, page_size, kv_heads,
        head_dim]`` of the pool); on NaN/Inf aborts the **whole** forward (all its streams) and raises
        :class:`~ardiff_modules.errors.NonFiniteKVError` naming the streams; a closed forward is a no-op.
        FP8 pools: NaN and Inf are both stored as NaN (``quantize``), so both are detected.
        """
        if not isinstance(transaction, ForwardTransaction):
            raise SpecError(
                f"KVCache.abort_if_non_finite: expected a ForwardTransaction (fwd.transaction), got "
                f"{type(transaction).__name__}"
            )
        if any(state.cache is not self for state, _ in transaction.members):
            raise SpecError("KVCache.abort_if_non_finite: expected a forward of this cache, got one of another cache")
        with self._lock:
            if transaction.is_open:
                self._check_pending_finite(transaction)

    def _check_pending_finite(self, transaction: ForwardTransaction) -> None:
        live = transaction.live_histories()
        owners = [
            (state.session_id, branch, page)
            for (state, branch), h in zip(transaction.members, transaction.histories)
            if h in live
            for page in h.pending_pages()
        ]
        if not owners:
            return
        pages = torch.tensor([page for _, _, page in owners], dtype=torch.int64, device=self.pool.device)
        written = self.pool.kv.index_select(2, pages)
        if self.pool.quantizer is not None:  # no isfinite for FP8; its NaN survives the cast to float
            written = written.float()
        finite = torch.isfinite(written).transpose(0, 2).reshape(len(owners), -1)
        ok = finite.all(dim=1).tolist()  # the one sync
        bad = sorted({(sid, branch) for (sid, branch, _), fine in zip(owners, ok) if not fine})
        if bad:
            transaction.abort(self.allocator, "non-finite K/V")
            raise NonFiniteKVError(
                f"check_finite: expected finite K/V in the pending chunks of a committing forward, got NaN/Inf "
                f"in stream(s) {bad}; the forward was aborted and history is unchanged"
            )

    def abort_forwards_of(self, state: KVState) -> None:
        """Abort every open forward one of ``state``'s branches belongs to (all of their streams)."""
        with self._lock:
            for branch in state.kv_branch_names:
                transaction = state.open_forward(branch)
                if transaction is not None:
                    self.finish_forward(transaction, False)

    def max_visible_keys(self, histories: Sequence[BranchPages], seq_len: int) -> int:
        """Keys of the widest stream of a forward: visible history plus all ``seq_len`` pending tokens."""
        return max(len(h.history_pages()) * self.spec.page_size for h in histories) + seq_len

    def _max_plan_pages(self, num_streams: int, num_chunks: int) -> int:
        """Upper bound of the page list of a structural plan (rows of one forward), for fixed buffers.

        NOTE: the block-causal bound; a bidirectional forward lists fewer pages (one row per stream of
        ``resident + num_chunks`` chunks), so the same buffers serve both rules.
        """
        resident = self.spec.max_history_chunks
        assert resident is not None
        chunks = sum(resident + c for c in range(1, num_chunks + 1))
        return num_streams * chunks * self.spec.pages_per_chunk

    def _lookup_context(
        self, key: tuple[tuple[tuple[str, str], ...], int | None]
    ) -> ForwardContext:
        """The persistent context of these streams, or a new one (registered only once its forward is published).

        Static contexts (CUDA-graph replay) are separate per sequence length: their buffers are fixed.
        """
        ctx = self._forwards.get(key)
        if ctx is not None:
            return ctx  # marked most recently used only once its forward is published
        ctx = ForwardContext(streams=key[0], handle=0, handle_id=torch.zeros((), dtype=torch.int64),
                             chunk_size=self.spec.chunk_size, dtype=self._dtype, static=key[1] is not None,
                             owner=self)
        ctx.layers = [
            LayerContext(
                i, self.pool.k_pages(i), self.pool.v_pages(i), ctx,
                kv_pool=self.pool.kv, layer_id=torch.tensor(i, dtype=torch.int64), kv_scales=self.pool.scales,
            )
            for i in range(self.spec.num_layers)
        ]
        return ctx

    def _stack_cross(
        self, ctx: ForwardContext, streams: Sequence[tuple[KVState, str]], static: bool
    ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, str], dict[str, tuple[int, ...]]]:
        """Per cache name, the streams' cross K/V stacked to ``[layers, streams, tokens, heads, dim]``."""
        names = self.spec.cross_attention_names
        entries = {name: [state.cross_entry(branch, name) for state, branch in streams] for name in names}
        who = [f"{state.session_id!r}/{branch!r}" for state, branch in streams]
        return ctx.cross_stack.restack(names, entries, who, ctx.cross, static)

    # ------------------------------------------------------------------ admission
    def pages_per_session(self, branches: int | None = None, pending_chunks: int = 1) -> int:
        """Peak pages one session holds: per branch (sinks + window + pending) chunks, or its extent.

        Raises :class:`SpecError` for an unbounded window (no peak exists).
        """
        self._check_open("pages_per_session")
        resident = self.spec.max_history_chunks
        if resident is None:
            raise SpecError("pages_per_session: expected a bounded window (window_chunks), got None")
        require_int("pages_per_session.pending_chunks", pending_chunks, minimum=1)
        if branches is not None:
            require_int("pages_per_session.branches", branches, minimum=1, below=len(self.spec.branches) + 1)
        branches = len(self.spec.branches) if branches is None else branches
        chunks = resident + pending_chunks
        if self.extent_chunks is not None:
            chunks = max(chunks, self.extent_chunks)
        return branches * chunks * self.spec.pages_per_chunk

    def recache_reserve(self) -> int:
        """Pages admission keeps free, once for the pool, so that one session can re-cache at its peak.

        ``branches x (max_history_chunks - 1) x pages_per_chunk``: the most a re-cache of one whole
        session (every branch, sinks included) holds beyond that session's peak. An idle branch holds at
        most ``R = max_history_chunks`` resident chunks; the re-cache adds up to ``R`` rebuilt ones,
        less what the peak already counts -- the pending chunk (plain paging), or the ring's free slot
        (contiguous extents, ``R + 1`` slots). So with every open session at its peak, any *one* of them
        can re-cache (:meth:`prepare_recache`'s capacity check passes); several sessions re-caching at the
        same moment may not fit (:class:`CapacityError`, nothing changed: re-cache them one after another).
        Raises :class:`SpecError` for an unbounded window.
        """
        self._check_open("recache_reserve")
        resident = self.spec.max_history_chunks
        if resident is None:
            raise SpecError("recache_reserve: expected a bounded window (window_chunks), got None")
        return len(self.spec.branches) * max(0, resident - 1) * self.spec.pages_per_chunk

    def committed_growth(self) -> int:
        """Pages open sessions may still take before reaching their peak (admitted, not yet used).

        NOTE: counted over the pool, not per branch: a page shared by forks is in use once, and
        evicting it from one sharer frees nothing while another still holds it.
        """
        if self.spec.max_history_chunks is None:
            return 0
        return max(0, len(self._sessions) * self.pages_per_session() - self.allocator.num_used)

    def _unpromised(self, recache: bool) -> int:
        """Free pages not promised to open sessions' peaks (nor, with ``recache``, to :meth:`recache_reserve`).

        NOTE: the reserve is counted against the same promise as the peaks (``max`` with the pages in use),
        so a re-cache in flight, whose transient is in use, does not count twice.
        """
        reserve = self.recache_reserve() if recache else 0
        promised = len(self._sessions) * self.pages_per_session() + reserve
        return self.allocator.num_free - max(0, promised - self.allocator.num_used)

    def sessions_that_fit(self, pending_chunks: int = 1, *, recache: bool = True) -> int:
        """How many more sessions of this spec can run to their peak alongside the open ones.

        ``recache`` (default): also keep :meth:`recache_reserve` free, once for the pool, so that
        every session, at its peak, can re-cache one at a time; ``False`` for a pool that never
        re-caches (admits more sessions).
        """
        with self._lock:
            per_session = self.pages_per_session(pending_chunks=pending_chunks)
            require_bool("sessions_that_fit.recache", recache)
            return max(0, self._unpromised(recache) // per_session)

    def can_admit(self, num_sessions: int = 1, pending_chunks: int = 1, *, recache: bool = True) -> bool:
        """Whether ``num_sessions`` more sessions fit at their peak (see :meth:`sessions_that_fit`)."""
        require_int("can_admit.num_sessions", num_sessions, minimum=1)
        return self.sessions_that_fit(pending_chunks, recache=recache) >= num_sessions

    def admit_session(
        self, session_id: str | None = None, pending_chunks: int = 1, *, recache: bool = True
    ) -> KVState:
        """Open a session only if it fits at its peak (see :meth:`sessions_that_fit`); raises
        :class:`CapacityError` before any change."""
        with self._lock:
            return self._admit_session(session_id, pending_chunks, recache)

    def _admit_session(self, session_id: str | None, pending_chunks: int, recache: bool) -> KVState:
        self._check_open("admit_session")
        _check_session_id(session_id)
        if not self.can_admit(1, pending_chunks, recache=recache):
            needed = self.pages_per_session(pending_chunks=pending_chunks)
            free = self._unpromised(recache)
            reserve = f" nor to one session's re-cache ({self.recache_reserve()} pages)" if recache else ""
            raise CapacityError(
                f"admit_session: a session needs up to {needed} pages, only {max(free, 0)} are free and not "
                f"promised to the {len(self._sessions)} open session(s){reserve}",
                needed=needed,
                free=max(free, 0),
            )
        return self.open_session(session_id)

    # ------------------------------------------------------------------ stats
    def stats(self) -> CacheStats:
        """A consistent snapshot of pool usage (taken under the cache lock)."""
        with self._lock:
            return self._stats()

    def _stats(self) -> CacheStats:
        sessions = {
            sid: {b: len(state.branch_pages(b).referenced_pages()) for b in state.kv_branch_names}
            for sid, state in self._sessions.items()
        }
        cross_bytes = sum(state.cross_attention_bytes() for state in self._sessions.values())
        return CacheStats(
            num_pages=self.allocator.num_pages,
            pages_used=self.allocator.num_used,
            pages_free=self.allocator.num_free,
            peak_pages_used=self.allocator.peak_used,
            bytes_per_page=self.pool.bytes_per_page,
            pool_bytes=self.pool.nbytes,
            bytes_used=self.allocator.num_used * self.pool.bytes_per_page,
            cross_attention_bytes=cross_bytes,
            sessions=sessions,
        )


def _to_device(cpu: torch.Tensor, device: torch.device, out: torch.Tensor | None) -> torch.Tensor:
    """Copy a host tensor to ``device`` without a sync (pinned staging); into ``out`` when given (fixed buffer)."""
    if device.type == "cpu":
        if out is not None and out.shape == cpu.shape:
            return out.copy_(cpu)
        return cpu
    staged = cpu.pin_memory()
    if out is not None and out.shape == cpu.shape and out.device == device:
        return out.copy_(staged, non_blocking=True)
    return staged.to(device, non_blocking=True)


def _stream_names(members: Sequence[tuple[KVState, str]], limit: int = 4) -> str:
    names = [f"{state.session_id}/{branch}" for state, branch in members[:limit]]
    more = f", ... (+{len(members) - limit})" if len(members) > limit else ""
    return "[" + ", ".join(names) + more + "]"


def _check_session_id(session_id: str | None) -> None:
    if session_id is not None and (not isinstance(session_id, str) or not session_id):
        raise SpecError(f"open_session: expected a non-empty str session id or None, got {session_id!r}")


