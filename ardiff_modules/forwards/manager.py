"""The forward manager: prepares every forward and re-cache of one cache, and finishes them.

One build path for both (:meth:`ForwardManager.build`)::

    validated request (Build) -> reservation -> layouts -> plan -> cross stacks -> context.begin
                                     ^ rolled back exactly if anything after it raises

All host work of a forward happens here, once, under the cache's lock; a layer's forward only
launches kernels. The manager owns the context registry (one reused context per batch of streams)
and is the only code that opens and finishes transactions; the pages themselves change only in
``core`` (allocator, branch, reservation, transaction).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import cast

import torch

from ardiff_modules.backends import AttentionBackend, PlanRequest
from ardiff_modules.backends.base import AttentionPlan
from ardiff_modules.backends.segmented import plan_forward
from ardiff_modules.context import ForwardContext
from ardiff_modules.core.branch import BranchPages
from ardiff_modules.core.recache import RecachePlan, RecacheRule
from ardiff_modules.core.reservation import ForwardReservation, settle_free_order
from ardiff_modules.core.transaction import ForwardTransaction, TransactionLane
from ardiff_modules.core.two_phase import require_coordinated
from ardiff_modules.errors import ARDiffError, CacheClosedError, CommitFailedError, LatentsNotKeptError, SpecError
from ardiff_modules.forwards.commit_checks import check_pending_finite
from ardiff_modules.host.tier import HostTier
from ardiff_modules.forwards.registry import ContextKey, ContextRegistry
from ardiff_modules.forwards.request import Build
from ardiff_modules.head_shares import lane_share_map
from ardiff_modules.lanes import CacheLane
from ardiff_modules.selection import lane_selector
from ardiff_modules.forwards.uncommitted import UncommittedWatch
from ardiff_modules.forwards.lane_masks import lane_token_masks, union_max_keys
from ardiff_modules.forwards.lane_recache import lane_recache_plans, merged_latents
from ardiff_modules.forwards.validation import (
    check_lanes_fit,
    check_no_open_commit,
    check_recache_capacity,
    gather_recache_latents,
    check_recache_sinks_in_place,
    check_token_mask,
    chunk_lengths_of,
    kept_latents,
    pending_attention_of,
    recache_plans,
    resolve_recache_rule,
    validate_streams,
)
from ardiff_modules.layout import ForwardLayout
from ardiff_modules.session import ForwardOptions, KVState
from ardiff_modules.spec import KVCacheSpec, max_attended_pages

#: DEBUG: each forward prepared / committed / aborted (host side, once per forward; nothing per layer).
#: NOTE: under the cache's logger name, where users filter a cache's forwards (the manager is its part).
logger = logging.getLogger("ardiff_modules.cache")

Streams = Sequence[tuple[KVState, str]]
#: What ``_stack_cross`` returns: the stacked caches, the missing ones' reasons, the stacked tags.
CrossStacks = tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, str], dict[str, tuple[int, ...]]]


class ForwardManager:
    """Prepares and finishes the forwards of one cache's sessions (see the module docstring).

    ``host`` is the cache the sessions belong to (streams of other caches are refused). The manager owns the
    contexts (its registry): ``ForwardContext.commit()`` / ``abort()`` finish through :meth:`finish_forward`.
    """

    def __init__(
        self, host: object, spec: KVCacheSpec, lanes: Sequence[CacheLane], backend: AttentionBackend,
        *, dtype: torch.dtype, max_contexts: int, check_finite: bool, lock: threading.RLock, host_tier: HostTier,
    ) -> None:
        self.host = host
        #: Suspended sessions (refused here) and the resume copies a forward waits for.
        self.host_tier = host_tier
        self.spec = spec
        #: One lane per retention group's head part (one for a uniform cache): each forward runs in every lane.
        self.lanes = tuple(lanes)
        #: The first lane's (a uniform cache's only) pool and allocator.
        self.pool = self.lanes[0].pool
        self.allocator = self.lanes[0].allocator
        self.backend = backend
        #: The compute dtype (queries, outputs, cross caches); the pool may store K/V in another.
        self.dtype = dtype
        self.extent_chunks = self.lanes[0].extent_chunks
        #: Pages of one contiguous extent (``0``: plain paging).
        self.extent_pages = self.lanes[0].extent_pages
        #: Every lane's layers: what a committing forward must have written (``ForwardContext._write_base``).
        self.lane_layers = sum(lane.spec.num_layers for lane in self.lanes)
        #: With retention groups, each model layer's lane shares and merge order (built once); else ``None``.
        self.shares = lane_share_map(spec, [lane.part for lane in self.lanes], self.pool.device)
        #: With groups and relative sinks, per model layer the lane of each query head (host ints); else ``None``.
        self.head_lanes = _head_lanes(spec, self.lanes) if spec.relative_sinks and self.shares is not None else None
        #: Each lane's ``token_mask`` in a forward without one.
        self.no_masks: tuple[torch.Tensor | None, ...] = (None,) * len(self.lanes)
        self.selector = lane_selector(self.lanes)  # content-selected lanes' choice + copy at commit, else None
        self.check_finite = check_finite
        self.lock = lock
        self.registry = ContextRegistry(max_contexts)
        self.uncommitted = UncommittedWatch()  # warns once per session when a stream runs many forwards uncommitted
        self.closed = False

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise CacheClosedError(f"{what}: expected an open KVCache, got one that was closed")

    def close(self) -> None:
        """The cache closed: release every context; every later request raises :class:`CacheClosedError`."""
        with self.lock:
            self.release_contexts_of(None)
            self.closed = True

    # ------------------------------------------------------------------ requests
    def resident(self, streams: Streams, what: str) -> tuple[tuple[KVState, str], ...]:
        """The validated streams, every session resident (:class:`SessionSuspendedError` otherwise)."""
        members = validate_streams(streams, self.host)
        self.host_tier.check_resident(members, what)
        return members

    def prepare(
        self, streams: Streams, seq_len: int, commit_current: bool, options: ForwardOptions = ForwardOptions(),
        *, hold: bool = False,
    ) -> ForwardContext:
        """Validate, then build one forward over ``streams`` (``KVCache.prepare_forward``).

        ``hold``: keep the reservation undoable (``ForwardTransaction.keep_reservation`` releases what it
        replaced; an abort before that rolls it back exactly) -- a distributed forward's prepare vote.
        """
        with self.lock:
            if self.closed:
                self._check_open("prepare_forward")
            return self.build(self.forward_request(streams, seq_len, commit_current, options), hold=hold)

    def forward_request(
        self, streams: Streams, seq_len: int, commit_current: bool, options: ForwardOptions
    ) -> Build:
        """A forward's request, validated (raises before anything changed)."""
        members = self.resident(streams, "prepare_forward")
        lengths = chunk_lengths_of(self.spec, seq_len, commit_current, options.static, options.chunk_lengths)
        pending = pending_attention_of(self.spec, options.pending_attention)
        branches = tuple(state.branch_pages(branch) for state, branch in members)
        lane_branches = (branches,) if len(self.lanes) == 1 else _lane_branches(members, len(self.lanes))
        for (state, branch), pages in zip(members, branches):
            check_no_open_commit(state, branch, pages)
        lane_masks = self.no_masks
        if options.token_mask is not None:
            grouped = len(self.lanes) > 1
            keys = union_max_keys(lane_branches, seq_len) if grouped else self.max_visible_keys(branches, seq_len)
            check_token_mask(options.token_mask, (len(branches), seq_len, keys), self.pool.device)
            # (with groups given over the union key order: each lane takes its columns)
            lane_masks = (
                lane_token_masks(options.token_mask, lane_branches, seq_len) if grouped else (options.token_mask,)
            )
        chunk_pages = tuple(length // self.spec.page_size for length in lengths)
        check_lanes_fit(self.lanes, lane_branches, chunk_pages, commit_current, self.selector is not None)
        latents = (
            () if options.keep_latents is None
            else kept_latents(options.keep_latents, commit_current, len(members), lengths)
        )
        return Build(
            members=members, branches=branches, chunk_pages=chunk_pages, commit_current=commit_current,
            pending_attention=pending, extent_pages=self.extent_pages, token_mask=options.token_mask,
            static=options.static, latents=latents, lane_branches=lane_branches,
            lane_extent_pages=tuple(lane.extent_pages for lane in self.lanes), lane_token_masks=lane_masks,
        )

    def prepare_recache(
        self, streams: Streams, keep_sinks: bool | None = None, rule: RecacheRule | None = None
    ) -> ForwardContext:
        """Prepare a prompt-switch re-cache: one forward that rebuilds the history of ``streams``.

        After ``clear_cross_attention()`` and populating the new prompt, run the model over the clean
        latents of each stream's rebuilt chunks (:meth:`recache_latents`), concatenated along the
        sequence in commit order, ``[num_streams, seq_len, ...]`` with ``seq_len =
        sum(ctx._layout.chunk_lengths)``. Which chunks are rebuilt and how they see each other is the
        ``rule`` (:class:`~ardiff_modules.core.recache.RecacheRule`; default the spec's ``recache``, which
        defaults to block-causal with the sinks kept; ``keep_sinks=`` is the historical switch):

        * block-causal: rebuilt chunk ``j`` attends to the kept sinks and rebuilt chunks ``0..j``;
          bidirectional (LongLive): every rebuilt chunk attends to all of them and the kept sinks;
        * context chunks (LongLive's chunk about to leave its buffer) are rebuilt and attended by
          this forward only, their pages released at commit;
        * ``ctx.positions`` are each chunk's original absolute positions (RoPE); a moved sink keeps
          its own positions.

        The forward writes pages no chunk uses only -- with contiguous extents the branch's free ring
        slots first, then fresh pages from the pool. On commit (``ctx.commit()``, leaving ``with ctx:``
        normally, ``commit_paged_context``) every stream's rebuilt chunks replace the old ones at once;
        offsets, commit indices and the window are unchanged, the old pages lose this session's
        reference (a fork keeps reading them). With contiguous extents, rebuilt chunks in fresh pages
        are then copied (one host call for the whole forward) into the ring slots the commit frees and
        the fresh pages freed: pool use returns to the steady state at commit. On abort or an exception
        only the re-cache's pages are released: the old history is untouched.

        Raises before changing anything: :class:`PendingContextError` if a stream has an open forward
        or pending chunks, :class:`SpecError` if a stream has nothing to rebuild or the rule cannot run
        (an evicted chunk it needs is not remembered, a sink would change length, relative sinks moved),
        :class:`SequenceLengthError` if batched streams' rebuilt chunk lengths differ,
        :class:`CapacityError` if the fresh pages do not fit (old and new history coexist until commit;
        admission keeps room for one session's re-cache at a time, ``KVCache.recache_reserve``).
        """
        with self.lock:
            self._check_open("prepare_recache")
            rule = self.recache_rule(keep_sinks, rule)
            members = self.resident(streams, "prepare_recache")
            return self.build(_recache_request(self.lanes, members, rule, self.spec.relative_sinks))

    def recache_latents(
        self, streams: Streams, keep_sinks: bool | None = None, rule: RecacheRule | None = None
    ) -> torch.Tensor:
        """The kept clean latents a re-cache of ``streams`` under ``rule`` runs over (``KVCache.recache_latents``)."""
        with self.lock:
            self._check_open("recache_latents")
            rule = self.recache_rule(keep_sinks, rule)
            members = self.resident(streams, "recache_latents")
            lanes = _lane_branches(members, len(self.lanes))
            if len(self.lanes) == 1:
                plans, _ = recache_plans(members, lanes[0], rule, idle=False)
                return gather_recache_latents(members, [b.latents for b in lanes[0]], [p.rebuilt for p in plans])
            union = lane_recache_plans(members, lanes, rule, idle=False)
            latents = [merged_latents([branches[s] for branches in lanes]) for s in range(len(members))]
            return gather_recache_latents(members, latents, union.rebuilt)

    def recache_chunk_indices(
        self, streams: Streams, keep_sinks: bool | None = None, rule: RecacheRule | None = None
    ) -> list[tuple[int, ...]]:
        """Per stream, the commit indices a re-cache under ``rule`` rebuilds, in forward order (nothing changes)."""
        with self.lock:
            self._check_open("recache_chunk_indices")
            rule = self.recache_rule(keep_sinks, rule)
            members = self.resident(streams, "recache_chunk_indices")
            lanes = _lane_branches(members, len(self.lanes))
            if len(self.lanes) == 1:
                return [plan.rebuilt for plan in recache_plans(members, lanes[0], rule, idle=False)[0]]
            return list(lane_recache_plans(members, lanes, rule, idle=False).rebuilt)

    def recache_rule(self, keep_sinks: bool | None, rule: RecacheRule | None) -> RecacheRule:
        """The rule a re-cache runs under, checked against what every lane's branches remember."""
        resolved = rule
        for lane in self.lanes:  # (each group has its own sinks: a "move" rule needs as many evicted chunks more)
            resolved = resolve_recache_rule(keep_sinks, rule, self.spec.recache, lane.spec.policy.sink_chunks)
        assert resolved is not None
        return resolved

    # ------------------------------------------------------------------ the build path
    def build(self, request: Build, *, hold: bool = False) -> ForwardContext:
        """Reserve, lay out, plan and begin ``request``'s forward in every lane; on any failure undo every lane's
        reservation exactly.

        A denoising forward still open on one of its streams is superseded (closed, its pending pages
        kept for reuse) once this one begins; if planning itself fails on a backend that re-plans in
        place, that forward is superseded too (its plan is no longer trustworthy), and nothing else changes.
        """
        self.uncommitted.before(request)  # before any change: an error filter raising it changes nothing
        key = request.key
        ctx = self._context(key)
        reservations: list[ForwardReservation] = []
        layouts: list[ForwardLayout] = []
        plans: list[AttentionPlan] = []
        planning, selects = False, self.selector is not None  # (selecting lanes reserve the next selection)
        try:
            for lane, lane_ctx, branches, extent_pages in zip(
                self.lanes, ctx._lanes or (ctx,), request.lane_branches, request.lane_extent_pages
            ):  # (one lane: a uniform cache)
                reservations.append(ForwardReservation(branches, request.chunk_pages, lane.allocator, extent_pages,
                                                       selects and request.commit_current and not request.recache))
                streams = request.stream_layouts(self.spec.relative_sinks, branches, lane.index)
                layout = ForwardLayout(
                    streams=streams, chunk_size=self.spec.chunk_size,
                    page_size=self.spec.page_size, pending_attention=request.pending_attention,
                )
                layouts.append(layout)
                planning = True
                plans.append(plan_forward(self.backend, _plan_request(layout, request, lane, self.dtype), lane_ctx._plan))
            positions = _positions(self, ctx, layouts, request.static)
            cross = _stack_cross(ctx, request.members, request.static, self.spec.cross_attention_names)
        except BaseException:
            for reservation in reversed(reservations):
                reservation.rollback()
            if planning and getattr(self.backend, "replans_in_place", True):
                for lane_ctx in ctx._lane_contexts:
                    lane_ctx._drop_plan(f"a later {request.what} failed while planning")
            raise
        if not hold:
            for reservation in reservations:
                reservation.keep()
        try:
            self._begin(ctx, key, request, reservations if hold else None, plans, layouts, positions, cross)
        except BaseException:
            if hold:
                for reservation in reversed(reservations):
                    if reservation.can_roll_back():  # (a kept reservation is the forward's own pending pages)
                        reservation.rollback()
            raise
        self.uncommitted.after(request)
        if logger.isEnabledFor(logging.DEBUG):
            if request.recache:
                fresh = sum(len(b.split_pending()[1]) for b in request.branches)
                logger.debug("re-cache prepared: %s, %d fresh pages", ctx, fresh)
            else:
                logger.debug("forward prepared: %s, %d free pages left, plan %r", ctx, self.allocator.num_free, ctx._plan)
        return ctx

    def _begin(
        self, ctx: ForwardContext, key: ContextKey, request: Build, held: list[ForwardReservation] | None,
        plans: list[AttentionPlan], layouts: list[ForwardLayout],
        positions: Positions, cross: CrossStacks,
    ) -> None:
        """Supersede the streams' open denoising forwards, publish ``ctx`` and begin its forward: one transaction
        over every lane (``held``: the lanes' reservations, kept undoable until the forward stands)."""
        for b in request.branches:  # supersede the open denoising forwards of these streams
            if isinstance(b.transaction, ForwardTransaction) and b.transaction.is_open:
                b.transaction.close("superseded", "a later forward of one of its streams was prepared")
        self.registry.publish(key, ctx)  # registers a new context; most recently used; evicts idle ones
        lanes: list[TransactionLane] = []
        for lane, branches in zip(self.lanes, request.lane_branches):
            lanes.append(TransactionLane(
                lane.allocator, branches, held[lane.index] if held is not None else None,
                request.lane_recache_plans[lane.index] if request.recache else (),
                lane.pool.copy_pages if request.recache else None,
            ))
        transaction = ForwardTransaction(
            members=request.members, commit_current=request.commit_current, num_chunks=layouts[0].num_chunks,
            recache=request.recache, latents=request.latents, lanes=tuple(lanes), select=self.selector,
        )
        transaction.attach()
        # NOTE: with groups the context describes its first lane (plan, layout, and so that mask's columns).
        ctx._begin(transaction, plans[0], layouts[0], positions[0], cross, request.lane_token_masks[0], positions[2])
        for part, plan, layout, mask, pair in zip(ctx._lanes, plans, layouts, request.lane_token_masks, positions[1]):
            part._begin(transaction, plan, layout, pair, ({}, {}, {}), mask)  # (each lane its own sink positions)

    def _context(self, key: ContextKey) -> ForwardContext:
        """The persistent context of these streams, or a new one (registered only once its forward begins).

        Static contexts (CUDA-graph replay) are separate per sequence length: their buffers are fixed.
        """
        ctx = self.registry.get(key)
        if ctx is not None:
            return ctx  # marked most recently used only once its forward begins
        static = key[1] is not None
        if self.shares is None:
            return ForwardContext._create(key[0], self.pool, dtype=self.dtype, static=static, owner=self)
        heads = (self.spec.query_heads, self.spec.num_kv_heads)
        return ForwardContext._create_grouped(
            key[0], tuple(lane.pool for lane in self.lanes), self.shares[0], self.shares[1], heads,
            chunk_size=self.spec.chunk_size, dtype=self.dtype, static=static, owner=self,
        )

    def max_visible_keys(self, branches: Sequence[BranchPages], seq_len: int) -> int:
        """Keys of the widest stream of a forward: its history plus all ``seq_len`` pending tokens."""
        return max(len(b.history_pages()) * self.spec.page_size for b in branches) + seq_len

    # ------------------------------------------------------------------ finishing
    def finish_forward(self, transaction: ForwardTransaction, success: bool) -> None:
        """Commit (``success``) or abort every stream of ``transaction``, all or none (``fwd.commit()``). Idempotent.

        A commit is refused (aborted, history unchanged, the error raised) unless :meth:`abort_if_uncommittable`
        passes; whatever it raises, the forward is aborted first (a non-library error as :class:`CommitFailedError`).
        Committing one participant of a multi-participant forward alone: :class:`ParticipantCommitError`, no change.
        """
        with self.lock:
            if not transaction.is_open:
                return
            if success:
                # NOTE: a part of a grouped forward (a rank's share of a distributed one) commits only with the
                # others: committed alone, its history would run a chunk ahead of theirs for good.
                require_coordinated(transaction, stream_names(transaction.members))
            if not success:
                transaction.abort()
            else:
                try:
                    self.abort_if_uncommittable(transaction)
                    transaction.commit()
                except BaseException as error:
                    transaction.abort(f"its commit raised {type(error).__name__}")
                    if isinstance(error, ARDiffError) or not isinstance(error, Exception):
                        raise  # names its cause already / KeyboardInterrupt, SystemExit as they are
                    raise CommitFailedError(
                        f"commit: expected the forward's streams {stream_names(transaction.members)} to commit, got "
                        f"{type(error).__name__}: {error}; the forward was aborted and history is unchanged"
                    ) from error
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug(
                    "forward %s: %d stream(s) %s, %d pages in use", transaction.status, len(transaction.members),
                    stream_names(transaction.members), self.allocator.num_used,
                )

    def abort_if_uncommittable(self, transaction: ForwardTransaction, check_finite: bool | None = None) -> None:
        """Every check that refuses a commit, run before it (a grouped or distributed vote): on a failure abort the
        forward and raise. Every layer wrote (:class:`IncompleteForwardError`), the FP8 scales it would fix are
        sound (:class:`KVCalibrationError`), with ``check_finite`` (default: the cache's) no NaN/Inf."""
        _require_transaction("abort_if_uncommittable", transaction)
        with self.lock:
            if not transaction.is_open or not transaction.commit_current:
                return
            try:
                transaction.check_complete(self.lane_layers)
                for lane in self.lanes:
                    if lane.pool.quantizer is not None:
                        lane.pool.quantizer.check_commit(transaction)
            except ARDiffError:
                transaction.abort("its commit was refused")
                raise
            if self.check_finite if check_finite is None else check_finite:
                self.abort_if_non_finite(transaction)

    def abort_if_non_finite(self, transaction: ForwardTransaction) -> None:
        """Check the pending K/V of an open forward: on NaN/Inf abort the whole forward and raise
        :class:`NonFiniteKVError` naming the streams, else change nothing. One device sync (what ``check_finite=True``
        runs before a commit); a closed forward is a no-op."""
        _require_transaction("abort_if_non_finite", transaction)
        if any(state.cache is not self.host for state, _ in transaction.members):
            raise SpecError(
                "ForwardManager.abort_if_non_finite: expected a forward of this cache, got one of another cache"
            )
        with self.lock:
            for i, lane in enumerate(self.lanes):
                if transaction.is_open:  # (a lane's NaN aborts the whole forward)
                    check_pending_finite(transaction, lane.pool, i)

    def abort_forwards_of(self, state: KVState) -> None:
        """Abort every open forward one of ``state``'s branches belongs to (all of their streams)."""
        with self.lock:
            for branch in state.kv_branch_names:
                transaction = state._open_forward(branch)
                if transaction is not None:
                    self.finish_forward(transaction, False)

    def abort_sessions(self, states: Sequence[KVState], free_order: Sequence[int] | None = None) -> None:
        """Abort the open forwards and drop the kept pending chunks of ``states`` (``KVState.abort``); with
        ``free_order`` (the free queue before a failed distributed forward), then settle the free queue in the
        order every rank agrees on (:func:`~ardiff_modules.core.reservation.settle_free_order`)."""
        with self.lock:
            for state in states:
                if isinstance(state, KVState) and state.cache is self.host and not state.is_closed:
                    state.abort()
            if free_order is not None:
                settle_free_order(self.allocator, free_order)

    # ------------------------------------------------------------------ contexts
    @property
    def num_contexts(self) -> int:
        """Forward contexts kept for reuse now (bounded by the cache's ``max_forward_contexts``)."""
        return len(self.registry)

    def contexts(self) -> tuple[ForwardContext, ...]:
        """The forward contexts kept for reuse, least recently used first."""
        with self.lock:
            return tuple(self.registry)

    def release_idle_contexts(self) -> int:
        """Release every kept context whose forward is not open; returns how many."""
        with self.lock:
            kept = len(self.registry)
            self.registry.release_where(lambda key: not cast(ForwardContext, self.registry.get(key)).is_active)
            return kept - len(self.registry)

    def release_contexts_of(self, session_id: str | None) -> None:
        """Release the contexts of one session's streams (``None``: every context)."""
        with self.lock:
            self.registry.release_where(lambda key: session_id is None or any(sid == session_id for sid, _ in key[0]))


def _lane_branches(members: Sequence[tuple[KVState, str]], num_lanes: int) -> tuple[tuple[BranchPages, ...], ...]:
    """Per lane, each member's pages there."""
    pages = [state._lane_pages(branch) for state, branch in members]
    return tuple(tuple(row[lane] for row in pages) for lane in range(num_lanes))


def _require_transaction(what: str, transaction: object) -> None:
    if not isinstance(transaction, ForwardTransaction):
        raise SpecError(
            f"ForwardManager.{what}: expected a ForwardTransaction (a forward context's _transaction), "
            f"got {type(transaction).__name__}"
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


def stream_names(members: Sequence[tuple[object, str]], limit: int = 4) -> str:
    """``[s0/cond, s0/uncond, ...]`` for messages (at most ``limit`` named)."""
    names = [f"{getattr(state, 'session_id', state)}/{branch}" for state, branch in members[:limit]]
    more = f", ... (+{len(members) - limit})" if len(members) > limit else ""
    return "[" + ", ".join(names) + more + "]"


def _max_plan_pages(spec: KVCacheSpec, num_streams: int, num_chunks: int) -> int:
    """Upper bound of the page list of a structural plan (rows of one forward) in a lane of ``spec``, for fixed
    buffers.

    NOTE: the block-causal bound; a bidirectional forward lists fewer pages (one row per stream of
    ``history + num_chunks`` chunks), so the same buffers serve both rules.
    """
    history = max_attended_pages(spec)  # (a content selection's pages on top of the sink and window chunks)
    assert history is not None
    return num_streams * sum(history + c * spec.pages_per_chunk for c in range(1, num_chunks + 1))


def _recache_request(
    lanes: Sequence[CacheLane], members: tuple[tuple[KVState, str], ...], rule: RecacheRule, relative_sinks: bool
) -> Build:
    """A re-cache's validated request: ``rule`` planned in every lane (with groups, over the union of the lanes'
    rebuilt chunks: ``forwards/lane_recache.py``), relative sinks in place and the rebuilt chunks' room checked
    in every lane (raises before anything changed)."""
    lane_branches = _lane_branches(members, len(lanes))
    lane_plans: tuple[tuple[RecachePlan, ...], ...]
    starts: tuple[tuple[int, ...], ...]
    if len(lanes) == 1:
        plans, chunk_pages = recache_plans(members, lane_branches[0], rule)
        lane_plans, starts = (plans,), ()
    else:
        union = lane_recache_plans(members, lane_branches, rule)
        plans, chunk_pages, lane_plans, starts = union.plans[0], list(union.chunk_pages), union.plans, union.starts
    for lane, branches, lane_plan in zip(lanes, lane_branches, lane_plans):
        if relative_sinks:
            check_recache_sinks_in_place(members, branches, lane_plan)
        check_recache_capacity(branches, chunk_pages, lane.allocator)
    # NOTE: the rebuilt chunks ride as pending (abort/close/reset release them): free ring slots first,
    # then fresh pages; no new extent (extent_pages=0): a branch without one (a fork that has not run
    # since) rebuilds into fresh pages only.
    return Build(
        members=members, branches=lane_branches[0], chunk_pages=tuple(chunk_pages), commit_current=True,
        pending_attention=rule.attention, recache=True, recache_plans=plans, what="prepare_recache",
        lane_branches=lane_branches, lane_extent_pages=(0,) * len(lanes),
        lane_recache_plans=lane_plans, recache_starts=starts, lane_token_masks=(None,) * len(lanes),
    )


def _positions(
    manager: ForwardManager, ctx: ForwardContext, layouts: Sequence[ForwardLayout], static: bool
) -> Positions:
    """``((positions, sink positions) of the context, of each lane, each grouped layer's sink positions)`` on the
    pool's device (fixed buffers when ``static``); sink positions only with relative sinks.

    With retention groups each lane's sinks move by its own shift (its window differs): a lane's sink positions
    come from its own layout (``None`` for a lane without sink chunks: no sink segment). A layer of one share reads
    its lane's (the natural positions for a lane without sinks), a layer of several shares per query head
    ``[streams, seq_len, heads]``, built once per distinct head-to-lane map. A uniform cache: today's path exactly.
    """
    device = manager.pool.device
    positions = _to_device(layouts[0].positions, device, ctx.positions if static else None)
    head_lanes = manager.head_lanes
    if head_lanes is None:  # a uniform cache (no lane contexts), or groups without relative sinks
        if not manager.spec.relative_sinks:
            return (positions, None), [] if manager.shares is None else [(positions, None)] * len(manager.lanes), ()
        sinks = _to_device(layouts[0].sink_positions, device, ctx._sink_positions if static else None)
        return (positions, sinks), [], ()
    lane_sinks = [
        _to_device(layout.sink_positions, device, lane_ctx._sink_positions if static else None)
        if lane.spec.relative_sinks else None
        for layout, lane_ctx, lane in zip(layouts, ctx._lanes, manager.lanes)
    ]
    # per lane and stream the shift (0 for a lane without sinks: its heads sit at the natural positions)
    shifts = [layout.sink_shifts if sinks is not None else (0,) * layout.num_streams
              for layout, sinks in zip(layouts, lane_sinks)]
    built: dict[tuple[int, ...], torch.Tensor] = {}
    layer_sinks: list[torch.Tensor] = []
    for layer, lanes in zip(ctx.layers, head_lanes):
        if all(lane == lanes[0] for lane in lanes):  # one share: its lane's own tensor
            own = lane_sinks[lanes[0]]
            layer_sinks.append(positions if own is None else own)
            continue
        per_head = built.get(lanes)
        if per_head is None:
            table = torch.tensor([[row[s] for row in (shifts[lane] for lane in lanes)] for s in range(len(shifts[0]))])
            host = layouts[0].positions[:, :, None] - table[:, None, :]  # [streams, seq_len, heads]
            per_head = built[lanes] = _to_device(host, device, layer._sink_positions if static else None)
        layer_sinks.append(per_head)
    # NOTE: the grouped context keeps a non-None marker (a lane's) so that relative_sinks says True; its public
    # sink_positions refuses (no one tensor is right for every head).
    marker = next(s for s in lane_sinks if s is not None)
    return (positions, marker), [(positions, sinks) for sinks in lane_sinks], tuple(layer_sinks)


#: What ``_positions`` returns: ``(positions, sink positions)`` of the context (a grouped context's sink positions:
#: a marker) and of each lane, and each grouped layer's sink positions.
PositionPair = tuple[torch.Tensor, "torch.Tensor | None"]
Positions = tuple[PositionPair, list[PositionPair], tuple[torch.Tensor, ...]]


def _head_lanes(spec: KVCacheSpec, lanes: Sequence[CacheLane]) -> list[tuple[int, ...]]:
    """Per model layer, the lane holding each query head (host ints, from the lanes' parts)."""
    group = spec.query_heads // spec.num_kv_heads
    rows = [[0] * spec.query_heads for _ in range(spec.num_layers)]
    for lane in lanes:
        assert lane.part is not None  # (with groups every lane is a part)
        for layer, kv_heads in zip(lane.part.layers, lane.part.heads):
            for h in kv_heads:
                rows[layer][h * group : (h + 1) * group] = [lane.index] * group
    return [tuple(row) for row in rows]


def _stack_cross(
    ctx: ForwardContext, members: Sequence[tuple[KVState, str]], static: bool, names: tuple[str, ...]
) -> CrossStacks:
    """Per cache name, the streams' cross K/V stacked to ``[layers, streams, tokens, heads, dim]``."""
    entries = {name: [state._cross_entry(branch, name) for state, branch in members] for name in names}
    who = [f"{state.session_id!r}/{branch!r}" for state, branch in members]
    return ctx._cross_stack.restack(names, entries, who, ctx._cross, static)


def _plan_request(layout: ForwardLayout, request: Build, lane: CacheLane, dtype: torch.dtype) -> PlanRequest:
    """One lane's plan request (its heads, its pool's dtype and FP8 scales, its retention's bound)."""
    spec = lane.spec
    return PlanRequest(
        layout=layout,
        device=lane.pool.device,
        dtype=dtype,
        kv_dtype=lane.pool.dtype,
        num_qo_heads=spec.query_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        quantizer=lane.pool.quantizer,
        token_mask=request.lane_token_masks[lane.index],
        static=request.static,
        max_pages=_max_plan_pages(spec, layout.num_streams, layout.num_chunks) if request.static else None,
    )
