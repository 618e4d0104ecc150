"""Per-forward and per-layer contexts handed to the attention modules.

A :class:`ForwardContext` is built by the cache once per forward (host work:
allocation, plan) and holds what every layer shares: the plan handle, the
absolute positions of the current tokens and the stacked cross-attention
caches. Its :class:`LayerContext` list gives each layer its own K/V page
arrays. Both objects are reused across forwards of the same streams, so a
compiled model sees the same Python objects and tensors of the same shapes
every chunk (no recompiles).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, NoReturn, Protocol

import torch

from ardiff_modules.backends.base import AttentionPlan
from ardiff_modules.cross import CrossStack
from ardiff_modules.errors import CrossAttentionNotPopulatedError, ForwardFinishedError, SpecError, UnknownCacheError
from ardiff_modules.core.transaction import ForwardTransaction
from ardiff_modules.head_shares import ShareMap
from ardiff_modules.layout import ForwardLayout
from ardiff_modules.pool import KVPool
from ardiff_modules.spec import max_attended_pages

#: Characters of stream names a ``ForwardContext`` repr shows before eliding the rest.
_STREAMS_WIDTH = 80


def short_name(name: object, limit: int = 24) -> str:
    """``repr(name)``, a long string cut to ``limit`` characters (reprs stay one short line)."""
    if isinstance(name, str) and len(name) > limit:
        name = name[: limit - 3] + "..."
    return repr(name)


def short_tuple(names: Iterable[str], limit: int = 4) -> str:
    """``('text', 'image')`` (each name through :func:`short_name`); more than ``limit`` names are elided."""
    items = list(names)
    if len(items) <= limit:
        return "(" + ", ".join(map(short_name, items)) + ("," if len(items) == 1 else "") + ")"
    return "(" + ", ".join(map(short_name, items[:limit])) + f", ... +{len(items) - limit})"


class TransactionOwner(Protocol):
    """Who finishes a forward's transaction (the cache): commit (``success``) or abort all its streams."""

    def finish_forward(self, transaction: ForwardTransaction, success: bool) -> None: ...


class CrossReads:
    """The names of the cross-attention caches a forward context's layers read, as attributes set to ``True``."""

    def names(self) -> frozenset[str]:
        return frozenset(vars(self))

    def clear(self) -> None:
        vars(self).clear()

    def __repr__(self) -> str:
        return f"CrossReads({sorted(vars(self))})"


class CrossHolder(Protocol):
    """A layer context's cross-attention views (what :func:`publish_cross` updates)."""

    layer_index: int
    cross: dict[str, tuple[torch.Tensor, torch.Tensor]]


def publish_cross(
    layers: Iterable[CrossHolder],
    current: dict[str, tuple[torch.Tensor, torch.Tensor]],
    cross: dict[str, tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """Point each layer's ``cross`` at its view of the stacked caches ``cross`` (name -> K, V ``[layers, ...]``);
    views are rebuilt only for caches not already ``current``; names ``cross`` lacks are dropped."""
    changed = [name for name in cross if current.get(name) is not cross[name]]
    for layer in layers:
        for name in list(layer.cross):
            if name not in cross:
                del layer.cross[name]
        for name in changed:
            layer.cross[name] = (cross[name][0][layer.layer_index], cross[name][1][layer.layer_index])


class LayerViews:
    """What a layer context reads through its ``forward`` (``LayerContext``): positions,
    stream counts and its ``cross`` views; the forward provides ``raise_missing_cross`` / ``note_cross_read``."""

    forward: Any
    cross: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def positions(self) -> torch.Tensor:
        """Absolute positions of the current tokens, int64 ``[num_streams, seq_len]``."""
        return self.forward.positions

    @property
    def sink_positions(self) -> torch.Tensor | None:
        """Where to rotate this layer's sink query (relative sinks only, else ``None``): int64
        ``[num_streams, seq_len]``, or per query head ``[num_streams, seq_len, num_heads]`` in a layer whose
        heads several retention-group lanes hold (each lane's sinks move by its own shift)."""
        return self.forward.sink_positions

    @property
    def num_streams(self) -> int:
        return self.forward.num_streams

    @property
    def seq_len(self) -> int:
        return self.forward.seq_len

    def cross_kv(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's cross-attention K and V for cache ``name``, each ``[num_streams, tokens, heads, dim]``."""
        forward: CrossPublisher = self.forward  # (both forwards are; typed so that the raise below is NoReturn)
        pair = self.cross.get(name)
        if pair is None:
            forward._raise_missing_cross(name)
        forward._note_cross_read(name)  # a Python side effect dynamo replays after a compiled graph
        return pair



class CrossPublisher:
    """A forward's stacked cross caches and their per-layer views (``ForwardContext``)."""

    layers: Any
    _cross: dict[str, tuple[torch.Tensor, torch.Tensor]]
    _cross_missing: dict[str, str]
    _cross_reads: CrossReads

    def _raise_missing_cross(self, name: str) -> NoReturn:
        if name in self._cross_missing:
            raise CrossAttentionNotPopulatedError(self._cross_missing[name])
        known = tuple(self._cross) + tuple(self._cross_missing)
        raise UnknownCacheError(f"Unknown cross-attention cache {name!r}; expected one of {known}")

    def _set_cross(self, cross: dict[str, tuple[torch.Tensor, torch.Tensor]], missing: dict[str, str]) -> None:
        """Publish stacked cross caches; per-layer views are rebuilt only for caches that changed."""
        publish_cross(self.layers, self._cross, cross)
        self._cross, self._cross_missing = cross, missing

    def _note_cross_read(self, name: str) -> None:
        """A layer read cross-attention cache ``name`` (what a captured CUDA graph then depends on)."""
        # NOTE: an attribute store, not ``set.add``: dynamo replays it after a compiled graph without
        # reading (so without guarding on) what was recorded before -- a set would recompile once filled.
        setattr(self._cross_reads, name, True)


def _refuse_forward_sink_view(what: str) -> NoReturn:
    raise SpecError(
        f"ForwardContext.{what}: expected a forward of one retention (a uniform cache), got one with retention "
        "groups, whose lanes' sinks move by different shifts; read each layer's kv.sink_positions ([streams, "
        "seq_len], or per query head [streams, seq_len, heads] where the layer's lanes differ)"
    )


@dataclass(frozen=True, eq=False)
class LayerShare:
    """The heads one lane holds in one model layer, and that lane's layer context.

    ``q_heads`` / ``kv_heads``: a ``slice`` when the heads are one contiguous run (a view, no copy), else an
    int64 index tensor on the pool's device.
    """

    lane: int
    q_heads: slice | torch.Tensor
    kv_heads: slice | torch.Tensor
    context: LayerContext



@dataclass(eq=False, repr=False)
class LayerContext(LayerViews):
    """What one attention layer needs for one forward.

    Attributes
    ----------
    layer_index:
        Index of the layer in the pool (informational; kernels get the tensors below).
    k_cache, v_cache:
        This layer's pages, ``[num_pages, page_size, num_kv_heads, head_dim]``.
    forward:
        The shared :class:`ForwardContext`.
    cross:
        Cache name -> this layer's ``(k, v)``, each ``[num_streams, tokens, heads, dim]`` (views of
        the forward's stacked caches, so no layer index is needed at run time).
    """

    layer_index: int
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    forward: ForwardContext
    cross: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    #: The whole pool ``[layers, 2, pages, page_size, heads, dim]`` the custom op mutates.
    _kv_pool: torch.Tensor | None = None
    #: ``layer_index`` as a CPU int64 scalar: data for the op, so one graph serves all layers.
    _layer_id: torch.Tensor | None = None
    #: The pool's ``[layers, 2, kv_heads]`` FP8 scales (ones for float pools), read by compiled writes.
    _kv_scales: torch.Tensor | None = None
    #: With retention groups: one share per lane holding heads of this layer (``head_shares``); ``chunk_attention``
    #: then runs each share over its lane's layer context. ``()``: the layer's heads are all in one lane (this one).
    _shares: tuple[LayerShare, ...] = ()
    #: The permutation restoring head order after the shares' outputs are concatenated (``None``: already).
    _merge_order: torch.Tensor | None = None
    #: ``(query heads, kv heads)`` of the whole layer, with shares (what q / k / v must carry).
    _heads: tuple[int, int] = (0, 0)
    #: With shares and relative sinks: this layer's sink positions, set by the cache every forward -- its lane's
    #: ``[streams, seq_len]`` with one share, per query head ``[streams, seq_len, heads]`` with several (each head
    #: at its lane's shift; a lane without sink chunks at the natural positions: its share ignores the sink query).
    _sink_positions: torch.Tensor | None = None

    @property
    def sink_positions(self) -> torch.Tensor | None:
        """Where to rotate this layer's sink query (relative sinks only, else ``None``): int64
        ``[num_streams, seq_len]``; per query head ``[num_streams, seq_len, num_heads]`` in a layer whose heads
        several retention-group lanes hold (each lane's sinks move by its own shift: its window differs).
        Entries of the heads of a lane without sink chunks are the natural positions (their sink query is
        ignored)."""
        if self._shares:
            return self._sink_positions
        return self.forward.sink_positions

    @property
    def _handle_id(self) -> torch.Tensor:
        """CPU int64 scalar naming this forward's plan in :data:`ardiff_modules.ops.HANDLES`."""
        return self.forward._handle_id

    def __repr__(self) -> str:
        """One line, e.g. ``LayerContext(layer=3/30, streams=2, seq_len=4680, cross=('text',), status='open')``."""
        fwd = self.forward
        return (
            f"LayerContext(layer={self.layer_index}/{len(fwd.layers)}, streams={fwd.num_streams}, "
            f"seq_len={fwd.seq_len}, cross={short_tuple(self.cross)}, status={fwd.status!r})"
        )


@dataclass(eq=False, repr=False)
class ForwardContext(CrossPublisher):
    """One forward over ``num_streams`` streams (branches of sessions) of ``seq_len`` tokens each.

    Use as a context manager to commit on success and abort on an exception::

        with state.prepare_forward(("cond", "uncond"), seq_len, commit_current=True) as fwd:
            out = model(x, fwd.layers)
        # committed here; on an exception the pending chunks were dropped instead

    NOTE: the context of a set of streams is one object reused by every forward of those
    streams (so compiled models see stable inputs): after the next ``prepare_forward`` of the
    same streams, this object -- its layers, positions, ``commit()`` / ``abort()`` -- describes
    that newer forward. Between a forward's finish (commit, abort, ``reset``/``close`` of a
    member session) and the next ``prepare_forward`` its layers may not touch the pool: the
    attention op raises :class:`~ardiff_modules.errors.ForwardFinishedError`.

    Attributes
    ----------
    streams:
        ``(session_id, branch)`` of each stream, in the order of the batch dimension.
    positions:
        int64 ``[num_streams, seq_len]`` absolute token positions (for RoPE), on the pool's device.
    sink_positions:
        With relative sinks (``KVCacheSpec.relative_sinks``), int64 ``[num_streams, seq_len]``: where
        to rotate the query that attends the sinks (``positions`` minus each stream's
        :attr:`sink_shifts`); ``None`` otherwise. With retention groups the shift is per lane, so the
        forward has no one answer: reading it raises :class:`SpecError`; each layer's
        ``LayerContext.sink_positions`` is what its heads use.
    layers:
        One :class:`LayerContext` per layer.
    """

    streams: tuple[tuple[str, str], ...]
    _handle: int
    _handle_id: torch.Tensor
    chunk_size: int
    #: Compute dtype of q/k/v and outputs (the pool may store K/V in another ``kv_dtype``).
    dtype: torch.dtype = torch.float32
    _plan: AttentionPlan | None = None
    _layout: ForwardLayout | None = None
    positions: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    #: With ``KVCacheSpec.relative_sinks``: int64 ``[num_streams, seq_len]`` positions at which the sink
    #: query is rotated (``positions - sink_shift`` per stream); ``None`` otherwise (and in a lane of a retention
    #: group without sink chunks). A grouped forward keeps its first lane's here (never handed out: see
    #: :attr:`sink_positions`), so ``None`` still says "no relative sinks".
    _sink_positions: torch.Tensor | None = None
    commit_current: bool = False
    layers: list[LayerContext] = field(default_factory=list)
    #: name -> (K, V), each ``[num_layers, num_streams, tokens, heads, dim]``; only fully populated caches.
    _cross: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    #: name -> reason a cache is unavailable to this forward.
    _cross_missing: dict[str, str] = field(default_factory=dict)
    #: Whether device inputs live in fixed buffers (CUDA-graph replay).
    _static: bool = False
    #: Whether this forward's kernel attends with an FP8 query (FA3 over an FP8 pool): a compiled layer then
    #: quantizes q in its own graph and the op only launches the kernel (``ops.attend_in_graph``). Set by
    #: :meth:`begin` from the plan (see the NOTE there).
    _fp8_query: bool = False
    #: The forward's ``token_mask`` (``None``: the visibility rule alone).
    _token_mask: torch.Tensor | None = None
    #: Bumped whenever ``plan`` is replaced by a new object (captured CUDA graphs read its buffers).
    _plan_epoch: int = 0
    #: The cache that finishes this context's transactions.
    _owner: TransactionOwner | None = None
    #: The forward this context describes now (open until committed / aborted / superseded).
    _transaction: ForwardTransaction | None = None
    #: Set when the cache dropped this context (LRU, session or cache closed): it never runs again.
    _released: bool = False
    #: What ``cross`` was stacked from (and the fixed buffers of static contexts).
    _cross_stack: CrossStack = field(default_factory=CrossStack)
    #: The cross-attention caches its layers read (``LayerContext.cross_kv``) since the context was made or
    #: ``CUDAGraphStep`` last cleared it: what a captured graph reads.
    _cross_reads: CrossReads = field(default_factory=lambda: CrossReads())
    #: The spec's bound on a stream's history tokens (sinks + window + memory; ``0``: unbounded): what the
    #: compiled gradient path pads the gathered history to.
    _max_history_tokens: int = 0
    #: With retention groups: one context per lane (its plan, layout, handle and page arrays), sharing this
    #: forward's transaction, positions and status; the layers' shares point into them. ``()``: uniform.
    _lanes: tuple[ForwardContext, ...] = ()
    #: Where this context's layers count in its transaction's ``written`` (a lane's first layer after the
    #: layers of the lanes before it), so a commit sees every lane's every layer.
    _write_base: int = 0
    _entered: list[ForwardTransaction] = field(default_factory=list)

    @classmethod
    def _create(
        cls, streams: tuple[tuple[str, str], ...], pool: KVPool, *, dtype: torch.dtype, static: bool,
        owner: TransactionOwner,
    ) -> ForwardContext:
        """A context for ``streams`` over ``pool``: one :class:`LayerContext` per layer, no forward yet."""
        spec = pool.spec
        history = max_attended_pages(spec)  # (a content selection's pages on top of the sink and window chunks)
        ctx = cls(streams=streams, _handle=0, _handle_id=torch.zeros((), dtype=torch.int64), chunk_size=spec.chunk_size,
                  dtype=dtype, _static=static, _owner=owner,
                  _max_history_tokens=0 if history is None else history * spec.page_size)
        ctx.layers = [
            LayerContext(
                i, pool.k_pages(i), pool.v_pages(i), ctx,
                _kv_pool=pool.kv, _layer_id=torch.tensor(i, dtype=torch.int64), _kv_scales=pool.scales,
            )
            for i in range(spec.num_layers)
        ]
        return ctx

    @classmethod
    def _create_grouped(
        cls, streams: tuple[tuple[str, str], ...], pools: tuple[KVPool, ...], shares: ShareMap,
        merge_orders: list[torch.Tensor | None], heads: tuple[int, int], *, chunk_size: int, dtype: torch.dtype,
        static: bool, owner: TransactionOwner,
    ) -> ForwardContext:
        """A context over several lanes' ``pools``: one lane context per pool, and per model layer a
        :class:`LayerContext` whose ``shares`` (``shares[layer]``: ``(lane, layer in the lane, q heads, kv heads)``)
        name the lane contexts' layers."""
        lanes = []
        base = 0
        for pool in pools:
            lane = cls._create(streams, pool, dtype=dtype, static=static, owner=owner)
            lane._write_base, base = base, base + pool.spec.num_layers
            lanes.append(lane)
        ctx = cls(streams=streams, _handle=0, _handle_id=torch.zeros((), dtype=torch.int64), chunk_size=chunk_size,
                  dtype=dtype, _static=static, _owner=owner, _lanes=tuple(lanes))
        for layer, (row, order) in enumerate(zip(shares, merge_orders)):
            layer_shares = tuple(LayerShare(lane, q, kv, lanes[lane].layers[inner]) for lane, inner, q, kv in row)
            first = layer_shares[0].context
            ctx.layers.append(LayerContext(
                layer, first.k_cache, first.v_cache, ctx, _shares=layer_shares, _merge_order=order, _heads=heads,
            ))
        return ctx

    @property
    def _lane_contexts(self) -> tuple[ForwardContext, ...]:
        """The contexts whose plans the layers run: one per lane (this one for a uniform cache)."""
        return self._lanes or (self,)

    def _assign_handle(self, handle: int) -> None:
        """Registered under ``handle`` in :data:`~ardiff_modules.ops.HANDLES` (the ops find the plan by it)."""
        self._handle = handle
        self._handle_id.fill_(handle)

    def _begin(
        self,
        transaction: ForwardTransaction,
        plan: AttentionPlan,
        layout: ForwardLayout,
        positions: tuple[torch.Tensor, torch.Tensor | None],
        cross: tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, str], dict[str, tuple[int, ...]]],
        token_mask: torch.Tensor | None,
        layer_sinks: tuple[torch.Tensor, ...] = (),
    ) -> None:
        """Describe a new forward: its transaction (open), plan, layout, positions, cross caches, mask (and, with
        retention groups and relative sinks, each layer's sink positions: ``layer_sinks``).

        Supersedes the forward this context described if it is still open (a denoising forward: its
        pending pages stay for reuse).
        """
        if self._transaction is not None and self._transaction.is_open:
            self._transaction.close("superseded", "a later forward of one of its streams was prepared")
        if plan is not self._plan:
            self._plan_epoch += 1
        self._plan, self._layout, self.commit_current = plan, layout, transaction.commit_current
        self.positions, self._sink_positions = positions
        if layer_sinks:
            for layer, sinks in zip(self.layers, layer_sinks):
                layer._sink_positions = sinks
        # NOTE: a Python bool the compiled graph branches on (dynamo guards on it), so it must not flip within
        # a rollout: it is fixed by the cache and the kernel family -- an FP8 pool on FlashInfer FA3 says True
        # in ragged and paged forwards alike; float pools, the reference backend and masked FA2 say False.
        # Relative sinks say False in every forward: their two-segment plan takes the 16-bit query, and the
        # one-segment forwards before a sink is resident would otherwise flip it. A token_mask forward inside
        # an FA3 rollout flips it (FA2): one more compiled graph, kept by dynamo for later such forwards.
        self._fp8_query = plan.takes_fp8_query and self._sink_positions is None
        self._token_mask = token_mask
        self._set_cross(cross[0], cross[1])
        self._cross_stack.adopt(cross[2])
        self._transaction = transaction

    def _drop_plan(self, reason: str) -> None:
        """After ``plan()`` raised on a backend that re-plans in place: the plan may be half-updated, so the
        forward that used it can never run again (superseded) and the next one plans afresh."""
        if self._plan is None:
            return
        if self._transaction is not None and self._transaction.is_open:
            self._transaction.close("superseded", reason)
        self._plan = None
        self._plan_epoch += 1

    @property
    def num_streams(self) -> int:
        return len(self.streams)

    @property
    def status(self) -> str:
        """``"open"``, how its last forward finished (``"committed"``, ``"completed"``, ``"aborted"``,
        ``"superseded"``), ``"released"`` (the cache dropped this context) or ``"unprepared"``."""
        if self._released:
            return "released"
        return self._transaction.status if self._transaction is not None else "unprepared"

    def __repr__(self) -> str:
        """One line, e.g. ``ForwardContext(streams=2 [('s0','cond'),('s0','uncond')], seq_len=64, chunks=1,
        commit=True, status='open', layers=30)``: no tensor, no lock, no device sync."""
        shown: list[str] = []
        width = 0
        for sid, branch in self.streams:
            item = f"({short_name(sid)},{short_name(branch)})"
            if shown and width + len(item) > _STREAMS_WIDTH:
                shown.append(f"... +{self.num_streams - len(shown)}")
                break
            shown.append(item)
            width += len(item) + 1
        bidirectional = self._layout is not None and self._layout.bidirectional
        flags = "".join(
            flag
            for flag, on in (
                (", static", self._static), (", token_mask", self._token_mask is not None),
                (", pending='bidirectional'", bidirectional),
            )
            if on
        )
        return (
            f"ForwardContext(streams={self.num_streams} [{','.join(shown)}], seq_len={self.seq_len}, "
            f"chunks={self.num_chunks}, commit={self.commit_current}, status={self.status!r}, "
            f"layers={len(self.layers)}{flags})"
        )

    @property
    def seq_len(self) -> int:
        return self._layout.seq_len if self._layout is not None else 0

    @property
    def num_chunks(self) -> int:
        return self._layout.num_chunks if self._layout is not None else 0

    @property
    def pending_attention(self) -> str:
        """The rule between this forward's pending chunks: ``"block_causal"`` or ``"bidirectional"``."""
        return self._layout.pending_attention if self._layout is not None else "block_causal"

    @property
    def sink_positions(self) -> torch.Tensor | None:
        """With relative sinks, int64 ``[num_streams, seq_len]``: where to rotate the query that attends the
        sinks (``positions`` minus each stream's :attr:`sink_shifts`); ``None`` otherwise.

        With retention groups each lane's sinks move by their own shift (its window differs), so one tensor for
        the forward would give one lane's view to every head: this raises :class:`SpecError`; read each layer's
        ``LayerContext.sink_positions`` (per query head where the layer's lanes differ).
        """
        if self._lanes and self._sink_positions is not None:
            _refuse_forward_sink_view("sink_positions")
        return self._sink_positions

    @property
    def relative_sinks(self) -> bool:
        """Whether the layers must pass a sink query (``chunk_attention(..., sink_query=...)``)."""
        return self._sink_positions is not None

    @property
    def sink_shifts(self) -> tuple[int, ...]:
        """Per stream, the tokens added to its sinks' positions in this forward (``0``: natural positions;
        always ``0`` without relative sinks). With retention groups and relative sinks the shift is per lane:
        this raises :class:`SpecError` (see :attr:`sink_positions`)."""
        if self._layout is None:
            return ()
        if self._lanes and self._sink_positions is not None:
            _refuse_forward_sink_view("sink_shifts")
        return self._layout.sink_shifts

    @property
    def token_offsets(self) -> tuple[int, ...]:
        """Absolute position of each stream's first current token."""
        return tuple(s.token_offset for s in self._layout.streams) if self._layout is not None else ()

    def to_dense(self) -> torch.Tensor:
        """The mask this forward attends with, bool ``[num_streams, seq_len, max_keys]`` on the CPU.

        The visibility rule over the gathered keys (visible history, then pending tokens; see
        ``ForwardLayout``), ANDed with the forward's ``token_mask`` when one was given.
        """
        dense = self._require_layout("to_dense").to_dense()
        return dense if self._token_mask is None else dense & self._token_mask.cpu()

    def key_positions(self) -> torch.Tensor:
        """int64 ``[num_streams, max_keys]``: absolute position of each key in :meth:`to_dense` order
        (evicted tokens counted, so a sink keeps its original position); ``-1`` for padding."""
        return self._require_layout("key_positions").key_positions

    def _require_layout(self, what: str) -> ForwardLayout:
        if self._layout is None:
            raise ForwardFinishedError(f"ForwardContext.{what}: expected a prepared forward, got none")
        return self._layout

    # ------------------------------------------------------------------ lifetime
    @property
    def is_active(self) -> bool:
        """Whether this context's forward is open: its layers may write and read the pool."""
        return not self._released and self._transaction is not None and self._transaction.is_open

    def _check_usable(self, what: str = "chunk_attention") -> None:
        """Raise :class:`ForwardFinishedError` unless this context's forward is open."""
        if self._released:
            raise ForwardFinishedError(
                f"{what}: expected an open forward, got a context the cache released (its session or the "
                "cache was closed, or it was the least recently used of too many); prepare a new forward"
            )
        if self._transaction is None:
            raise ForwardFinishedError(f"{what}: expected an open forward, got a context with none prepared")
        self._transaction.check_open(what)

    def _record_write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Called by the custom ops before layer ``layer`` writes ``k``/``v`` ``[tokens, kv_heads, head_dim]``
        (the forward is open): the forward records the layer (a commit needs all), and an FP8 pool's
        uncalibrated layer takes provisional scales from them (fixed if this forward commits)."""
        transaction = self._transaction
        assert transaction is not None and self._plan is not None  # check_usable ran first
        transaction.written.add(self._write_base + layer)  # (not mark_written: this runs once per layer call)
        if self._plan.quantizer is not None:
            self._plan.quantizer.calibrate(layer, k, v, transaction)

    def _release(self) -> None:
        """Called by the cache: this context never runs again (plan buffers freed)."""
        self._released = True
        self._plan = None
        for lane in self._lanes:
            lane._release()

    # ------------------------------------------------------------------ commit / abort
    def commit(self) -> None:
        """Commit every stream of this forward, all together (a denoising forward just closes).

        Idempotent: a finished forward is left as it is.
        """
        self._finish(self._transaction, True)

    def abort(self) -> None:
        """Drop every stream's pending work; history stays exactly as before. Idempotent."""
        self._finish(self._transaction, False)

    def _finish(self, transaction: ForwardTransaction | None, success: bool) -> None:
        if transaction is not None and transaction.is_open and self._owner is not None:
            self._owner.finish_forward(transaction, success)

    def __enter__(self) -> ForwardContext:
        self._check_usable("ForwardContext.__enter__")  # a finished forward cannot be entered again
        transaction = self._transaction
        assert transaction is not None  # check_usable raised otherwise
        self._entered.append(transaction)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # Finish the forward this block entered -- not a later one prepared on the same context.
        transaction = self._entered.pop() if self._entered else None
        self._finish(transaction, exc_type is None)
