"""``KVCache``: the pool, the allocator and the backend shared by every session.

It opens sessions (:class:`~ardiff_modules.state.KVState`) and prepares
forwards: one :meth:`KVCache.prepare_forward` call validates, allocates the
pending chunks of every stream, builds the layout and the backend plan, and
returns a :class:`~ardiff_modules.context.ForwardContext` whose layer contexts
every attention layer of the model shares. All host work of a forward happens
here, once.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ardiff_modules.allocator import PageAllocator
from ardiff_modules.backends import AttentionBackend, PlanRequest, resolve_backend
from ardiff_modules.context import ForwardContext, LayerContext
from ardiff_modules.errors import (
    CapacityError,
    PendingContextError,
    SequenceLengthError,
    SpecError,
    TensorMismatchError,
)
from ardiff_modules.history import BranchHistory
from ardiff_modules.ops import PLANS
from ardiff_modules.plan import ForwardLayout, StreamLayout
from ardiff_modules.pool import KVPool, pages_for_budget
from ardiff_modules.spec import KVCacheSpec
from ardiff_modules.state import KVState, PendingForward
from ardiff_modules.window import SinkWindowPolicy


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
    ) -> None:
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
        self.policy = SinkWindowPolicy(spec.sink_chunks, spec.window_chunks)
        self.backend = resolve_backend(backend, self.pool.device, self.pool.dtype, spec.head_dim)
        if contiguous_extents is None:
            contiguous_extents = self.backend.name == "flashinfer" and spec.window_chunks is not None
        if contiguous_extents and spec.window_chunks is None:
            raise SpecError("contiguous_extents=True: expected a bounded window (window_chunks), got None")
        #: Chunk slots of each branch's contiguous extent, or ``None`` for plain paging.
        self.extent_chunks = spec.max_resident_chunks + 1 if contiguous_extents else None  # type: ignore[operator]
        self._sessions: dict[str, KVState] = {}
        if isinstance(max_forward_contexts, bool) or not isinstance(max_forward_contexts, int) or max_forward_contexts < 1:
            raise SpecError(f"max_forward_contexts: expected an int >= 1, got {max_forward_contexts!r}")
        self.max_forward_contexts = max_forward_contexts
        # Insertion order = recency (moved to the end on use): the front is the least recently used.
        self._forwards: dict[tuple[tuple[tuple[str, str], ...], int | None], ForwardContext] = {}
        self._session_ids = itertools.count()

    # ------------------------------------------------------------------ sessions
    @property
    def device(self) -> torch.device:
        return self.pool.device

    @property
    def dtype(self) -> torch.dtype:
        return self.pool.dtype

    @property
    def sessions(self) -> dict[str, KVState]:
        """Open sessions by id (a copy)."""
        return dict(self._sessions)

    def open_session(self, session_id: str | None = None) -> KVState:
        """Open a session with every branch of the spec; no page is allocated until a branch runs."""
        if session_id is None:
            session_id = f"session-{next(self._session_ids)}"
            while session_id in self._sessions:
                session_id = f"session-{next(self._session_ids)}"
        if session_id in self._sessions:
            raise SpecError(f"open_session: expected a new session id, got {session_id!r} which is already open")
        state = KVState(self, session_id)
        self._sessions[session_id] = state
        return state

    def _forget_session(self, state: KVState) -> None:
        """Called by ``KVState.close``: drop the session and its forward contexts."""
        self._sessions.pop(state.session_id, None)
        for key in [k for k in self._forwards if any(sid == state.session_id for sid, _ in k[0])]:
            PLANS.unregister(self._forwards.pop(key).handle)

    # ------------------------------------------------------------------ forwards
    def prepare_forward(
        self,
        streams: Sequence[tuple[KVState, str]],
        seq_len: int,
        commit_current: bool = False,
        *,
        token_mask: torch.Tensor | None = None,
        static: bool = False,
    ) -> ForwardContext:
        """Prepare one forward over ``streams`` (``(session, branch)`` pairs, the batch order).

        Allocates missing pending chunks (reusing those of earlier denoising
        forwards), builds the plan once for all layers, and returns the forward
        context. Raises before changing anything on: misaligned ``seq_len``,
        unknown branch, closed session, duplicate stream, a committing forward
        not yet committed, too few free pages, or a bad ``token_mask``.

        Parameters
        ----------
        token_mask:
            Optional bool ``[num_streams, seq_len, max_keys]`` over the keys in the order of
            :meth:`ForwardContext.to_dense` (visible history, then pending tokens), ANDed with
            the visibility rule: the masked path for masks that are not chunk-structured.
            ``max_keys`` is ``max_visible_keys(...)`` of this forward.
        static:
            Keep every device input of this forward in fixed buffers so that a CUDA graph
            captured once replays correctly after re-planning (see :class:`CUDAGraphStep`).
            Needs the FlashInfer backend and a bounded window.
        """
        chunk = self.spec.chunk_size
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0 or seq_len % chunk:
            raise SequenceLengthError(
                f"seq_len: expected a positive multiple of chunk_size={chunk}, got {seq_len!r}"
            )
        if not streams:
            raise SpecError("prepare_forward: expected at least one (session, branch) stream, got none")
        if static and self.spec.window_chunks is None:
            raise SpecError(
                "prepare_forward(static=True): expected a bounded window (window_chunks is not None) so the "
                "fixed buffers can be sized, got window_chunks=None"
            )
        num_chunks = seq_len // chunk
        histories = []
        keys = []
        for state, branch in streams:
            if state.cache is not self:
                raise SpecError(
                    f"prepare_forward: expected sessions of this KVCache, got {state.session_id!r} of another"
                )
            history = state._history(branch)  # raises on closed session / unknown branch
            key = (state.session_id, branch)
            if key in keys:
                raise SpecError(f"prepare_forward: stream {key} appears twice; expected distinct streams")
            pending = state._pending[branch]
            if pending is not None and pending.commit_current:
                raise PendingContextError(
                    f"Branch {branch!r} of session {state.session_id!r} has a committing forward of "
                    f"{pending.num_chunks} chunk(s) that was neither committed nor aborted; call "
                    f"commit_paged_context({branch!r}) or abort({branch!r}) before preparing the next forward"
                )
            histories.append(history)
            keys.append(key)
        if token_mask is not None:
            expected = (len(histories), seq_len, self.max_visible_keys(histories, num_chunks))
            if not isinstance(token_mask, torch.Tensor) or token_mask.dtype != torch.bool:
                raise TensorMismatchError(f"token_mask: expected a torch.bool tensor, got {token_mask!r:.80}")
            if tuple(token_mask.shape) != expected:
                raise TensorMismatchError(
                    f"token_mask: expected shape {expected} [streams, seq_len, max_keys], got {tuple(token_mask.shape)}"
                )
        needed = sum(h.pages_needed(num_chunks, self.allocator) for h in histories)
        if needed > self.allocator.num_free:
            raise CapacityError(
                f"KV pool out of pages: this forward needs {needed} more pages "
                f"({num_chunks} pending chunk(s) x {self.spec.pages_per_chunk} pages for "
                f"{len(histories)} stream(s), minus pages already pending), only "
                f"{self.allocator.num_free} of {self.allocator.num_pages} are free",
                needed=needed,
                free=self.allocator.num_free,
            )

        need_extent = [h for h in histories if h.needs_extent]
        if need_extent:
            extent_pages = len(need_extent) * self.extent_chunks * self.spec.pages_per_chunk  # type: ignore[operator]
            if extent_pages > self.allocator.longest_free_run():
                raise CapacityError(
                    f"KV pool out of contiguous pages: {len(need_extent)} new branch extent(s) need {extent_pages} "
                    f"consecutive pages, the longest free run is {self.allocator.longest_free_run()} "
                    f"({self.allocator.num_free} free); size the pool larger or pass contiguous_extents=False",
                    needed=extent_pages,
                    free=self.allocator.num_free,
                )

        # Reserve extents, grow pending chunks (cannot fail now), plan; roll back exactly on failure.
        before = [h.pending for h in histories]
        free_before = self.allocator.free_pages() if need_extent else None
        ctx = self._forward_context(tuple(keys), seq_len if static else None)
        try:
            if need_extent:
                # One run for all new branches of the forward: CFG pairs end up adjacent (one ragged launch).
                run = self.allocator.allocate_contiguous(extent_pages)
                step = self.extent_chunks * self.spec.pages_per_chunk  # type: ignore[operator]
                for i, h in enumerate(need_extent):
                    h.assign_extent(tuple(run[i * step : (i + 1) * step]))
            for h in histories:
                if len(h.pending) < num_chunks:
                    h.set_pending(num_chunks, self.allocator)
            layout = ForwardLayout(
                streams=tuple(
                    StreamLayout(tuple(h.history_pages()), h.pending[:num_chunks], h.token_offset)
                    for h in histories
                ),
                chunk_size=chunk,
                page_size=self.spec.page_size,
            )
            request = PlanRequest(
                layout=layout,
                device=self.pool.device,
                dtype=self.pool.dtype,
                num_qo_heads=self.spec.query_heads,
                num_kv_heads=self.spec.num_kv_heads,
                head_dim=self.spec.head_dim,
                token_mask=token_mask,
                static=static,
                max_pages=self._max_plan_pages(len(histories), num_chunks) if static else None,
            )
            plan = self.backend.plan(request, ctx.plan)
            positions = _to_device(layout.positions, self.pool.device, ctx.positions if static else None)
            cross = self._stack_cross(ctx, streams, static)
        except BaseException:
            fresh: list[int] = []
            for h, old in reversed(list(zip(histories, before))):
                fresh = h.undo_grow(old, self.allocator) + fresh
            for h in need_extent:
                fresh += list(h.extent)
                h.extent = ()
            if fresh:
                self.allocator.unallocate(fresh, free_order=free_before)
            raise
        for h in histories:
            if len(h.pending) > num_chunks:
                h.set_pending(num_chunks, self.allocator)  # reuse leaves no surplus behind
        ctx.plan, ctx.layout, ctx.positions, ctx.commit_current = plan, layout, positions, bool(commit_current)
        ctx.set_cross(cross[0], cross[1])
        ctx._stack_keys = cross[2]
        ctx._members = tuple(streams)
        record = PendingForward(commit_current=bool(commit_current), num_chunks=num_chunks, context=ctx)
        for state, branch in streams:
            state._pending[branch] = record
        return ctx

    def max_visible_keys(self, histories: Sequence[BranchHistory], num_chunks: int) -> int:
        """Keys of the widest stream of a forward: visible history plus all pending tokens."""
        return max(len(h.history_pages()) * self.spec.page_size for h in histories) + num_chunks * self.spec.chunk_size

    def _max_plan_pages(self, num_streams: int, num_chunks: int) -> int:
        """Upper bound of the page list of a structural plan (rows of one forward), for fixed buffers."""
        resident = self.spec.max_resident_chunks
        assert resident is not None
        chunks = sum(resident + c for c in range(1, num_chunks + 1))
        return num_streams * chunks * self.spec.pages_per_chunk

    def _forward_context(self, streams: tuple[tuple[str, str], ...], static_len: int | None) -> ForwardContext:
        """The persistent context of these streams (created on first use, then updated in place).

        Static contexts (CUDA-graph replay) are separate per sequence length: their buffers are fixed.
        """
        key = (streams, static_len)
        ctx = self._forwards.pop(key, None)
        if ctx is not None:
            self._forwards[key] = ctx  # most recently used
        else:
            self._evict_idle_contexts(self.max_forward_contexts - 1)
            ctx = ForwardContext(streams=streams, handle=0, plan_id=torch.zeros((), dtype=torch.int64),
                                 chunk_size=self.spec.chunk_size, static=static_len is not None,
                                 _finish=_finish_forward)
            ctx.handle = PLANS.register(ctx)
            ctx.plan_id.fill_(ctx.handle)
            ctx.layers = [
                LayerContext(
                    i, self.pool.k_pages(i), self.pool.v_pages(i), ctx,
                    kv_pool=self.pool.kv, layer_id=torch.tensor(i, dtype=torch.int64),
                )
                for i in range(self.spec.num_layers)
            ]
            self._forwards[key] = ctx
        return ctx

    def _evict_idle_contexts(self, keep: int) -> None:
        """Release least recently used contexts until at most ``keep`` remain; a context some
        branch still has pending (an uncommitted forward) is never released."""
        pending = {
            id(record.context)
            for state in self._sessions.values()
            for record in state._pending.values()
            if record is not None
        }
        for key in list(self._forwards):
            if len(self._forwards) <= keep:
                break
            if id(self._forwards[key]) not in pending:
                PLANS.unregister(self._forwards.pop(key).handle)

    def _stack_cross(
        self, ctx: ForwardContext, streams: Sequence[tuple[KVState, str]], static: bool
    ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, str], dict[str, tuple[int, ...]]]:
        """Per cache name, the streams' cross K/V stacked to ``[layers, streams, tokens, heads, dim]``.

        Restacked only when a stream's cache was (re)populated; a single stream is a view.
        Static contexts copy into buffers allocated once, so captured graphs read the new prompt.
        """
        cross: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        missing: dict[str, str] = {}
        keys: dict[str, tuple[int, ...]] = {}
        for name in self.spec.cross_attention_names:
            entries = [state._cross_entry(branch, name) for state, branch in streams]
            absent = [s for s, e in zip(streams, entries) if e is None]
            if absent:
                who = ", ".join(f"{st.session_id!r}/{b!r}" for st, b in absent)
                missing[name] = (
                    f"Cross-attention cache {name!r} was read before it was populated for {who}; "
                    "call populate_cross_attention() first"
                )
                continue
            stack_key = tuple(e.version for e in entries)
            if ctx._stack_keys.get(name) == stack_key and name in ctx.cross:
                cross[name] = ctx.cross[name]
            elif static:
                k_buf, v_buf = ctx.cross.get(name) or ctx._cross_buffers.get(name) or (None, None)
                if k_buf is None:
                    k_buf = torch.stack([e.k for e in entries], dim=1)
                    v_buf = torch.stack([e.v for e in entries], dim=1)
                    ctx._cross_buffers[name] = (k_buf, v_buf)
                else:
                    torch.stack([e.k for e in entries], dim=1, out=k_buf)
                    torch.stack([e.v for e in entries], dim=1, out=v_buf)
                cross[name] = (k_buf, v_buf)
            elif len(entries) == 1:
                cross[name] = (entries[0].k.unsqueeze(1), entries[0].v.unsqueeze(1))
            else:
                cross[name] = (
                    torch.stack([e.k for e in entries], dim=1),
                    torch.stack([e.v for e in entries], dim=1),
                )
            keys[name] = stack_key
        return cross, missing, keys

    # ------------------------------------------------------------------ admission
    def pages_per_session(self, branches: int | None = None, pending_chunks: int = 1) -> int:
        """Peak pages one session holds: per branch (sinks + window + pending) chunks, or its extent.

        Raises :class:`SpecError` for an unbounded window (no peak exists).
        """
        resident = self.spec.max_resident_chunks
        if resident is None:
            raise SpecError("pages_per_session: expected a bounded window (window_chunks), got None")
        branches = len(self.spec.branches) if branches is None else branches
        chunks = resident + pending_chunks
        if self.extent_chunks is not None:
            chunks = max(chunks, self.extent_chunks)
        return branches * chunks * self.spec.pages_per_chunk

    def committed_growth(self) -> int:
        """Pages open sessions may still take before reaching their peak (admitted, not yet used).

        NOTE: counted over the pool, not per branch: a page shared by forks is in use once, and
        evicting it from one sharer frees nothing while another still holds it.
        """
        if self.spec.max_resident_chunks is None:
            return 0
        return max(0, len(self._sessions) * self.pages_per_session() - self.allocator.num_used)

    def sessions_that_fit(self, pending_chunks: int = 1) -> int:
        """How many more sessions of this spec can run to their peak alongside the open ones."""
        available = self.allocator.num_free - self.committed_growth()
        return max(0, available // self.pages_per_session(pending_chunks=pending_chunks))

    def can_admit(self, num_sessions: int = 1, pending_chunks: int = 1) -> bool:
        """Whether ``num_sessions`` more sessions fit at their peak (see :meth:`sessions_that_fit`)."""
        return self.sessions_that_fit(pending_chunks) >= num_sessions

    def admit_session(self, session_id: str | None = None, pending_chunks: int = 1) -> KVState:
        """Open a session only if it fits at its peak; raises :class:`CapacityError` before any change."""
        if not self.can_admit(1, pending_chunks):
            needed = self.pages_per_session(pending_chunks=pending_chunks)
            free = self.allocator.num_free - self.committed_growth()
            raise CapacityError(
                f"admit_session: a session needs up to {needed} pages, only {max(free, 0)} are free and not "
                f"promised to the {len(self._sessions)} open session(s)",
                needed=needed,
                free=max(free, 0),
            )
        return self.open_session(session_id)

    # ------------------------------------------------------------------ stats
    def stats(self) -> CacheStats:
        sessions = {
            sid: {b: len(h.referenced_pages()) for b, h in state._branches.items()}
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


def _finish_forward(ctx: ForwardContext, success: bool) -> None:
    """Commit (success) or abort every stream of ``ctx`` that still has this forward pending."""
    for state, branch in ctx._members:
        if state.is_closed:
            continue
        record = state._pending.get(branch)
        if record is None or record.context is not ctx:
            continue
        if success:
            state.commit_paged_context(branch)
        else:
            state.abort(branch)
