"""The training scope: it holds the history pages its forwards with gradients read (a checkpoint recomputation
reads them again in backward), hands ``torch.utils.checkpoint`` frozen copies of the forward contexts, and chooses
how those forwards treat the history they read (``history_grad``: detached, or straight-through as Self-Forcing's
rolling buffer routes it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ardiff_modules.context import ForwardContext, LayerContext
from ardiff_modules.core.allocator import PageAllocator
from ardiff_modules.core.transaction import PageHold
from ardiff_modules.errors import SpecError, TrainingScopeError
from ardiff_modules.training.records import (
    ADOPTED,
    FROZEN,
    RECORDS_LOCK,
    SCOPES,
    HistoryRead,
    ScopedCache,
    forget,
    open_scopes,
    Replay,
    capturing,
)
from ardiff_modules.training.straight_through import HistoryGrad, LiveWrites, check_history_grad

T = TypeVar("T")


class TrainingScope:
    """Forwards with gradients whose backward may recompute them: their history stays readable until exit.

    ::

        with am.TrainingScope(cache) as scope:
            for chunk in rollout:                      # no_grad denoising steps, one exit step with grad
                x = scope.checkpoint(block, x, kv)    # per block: recomputed in backward from the held pages
            loss.backward()
        # holds dropped: evicted pages are free again

    Every forward with gradients of ``cache`` inside the scope takes one reference on the history pages
    it read (its pending pages are its own tokens: recomputed, never read back), released on exit, so
    peak memory is the rollout's sink + window plus what the scope's forwards saw evicted since. The
    pages a scope holds are in use for admission: keep a scope to one training step.

    ``history_grad`` chooses what the history a forward with gradients reads contributes to the gradient:

    - ``"detached"`` (default): a constant. Only a chunk's own forward trains on its K/V.
    - ``"straight_through"``: the values read stay the committed (clean) K/V, but the gradient of a read of a
      committed chunk flows to the K/V the last forward with gradients in this scope wrote for that chunk
      (Self-Forcing's exit step): what upstream's in-place writes into its rolling buffer do through autograd's
      ``CopySlices``. Chunks never written with gradients in the scope stay constants. Eager only; the scope
      keeps those live K/V (one rollout's K/V) until it ends.
    """

    def __init__(self, cache: ScopedCache, *, history_grad: HistoryGrad = "detached") -> None:
        if not hasattr(cache, "_allocator") or not hasattr(cache, "lock"):
            raise SpecError(f"TrainingScope.cache: expected a KVCache, got {type(cache).__name__}")
        self.history_grad: HistoryGrad = check_history_grad("TrainingScope", history_grad)
        self.cache = cache
        self.records: list[HistoryRead] = []
        #: The live K/V writes reads are routed to (``"straight_through"`` only).
        self.ledger: LiveWrites | None = LiveWrites() if history_grad == "straight_through" else None
        self._entered = False
        self.closed = False

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open" if self._entered else "new"
        return f"TrainingScope(history_grad={self.history_grad!r}, records={len(self.records)}, {state})"

    def __enter__(self) -> TrainingScope:
        if self._entered or self.closed:
            raise TrainingScopeError("TrainingScope: expected a new scope, got one that was already entered")
        self._entered = True
        SCOPES.set((*open_scopes(), self))
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> TrainingScope:
        """Open the scope without making it active in this context: it holds only the forwards
        :meth:`adopt` is given (what an integration that drives the forwards itself uses). Close with :meth:`close`."""
        if self._entered or self.closed:
            raise TrainingScopeError("TrainingScope.start: expected a new scope, got one that was already entered")
        self._entered = True
        return self

    def adopt(self, fwd: ForwardContext) -> None:
        """Hold the record of ``fwd``'s open forward (built by its first layer with gradients), whatever scopes
        are active where it runs. Raises :class:`TrainingScopeError` once the scope ended."""
        if self.closed or not self._entered:
            raise TrainingScopeError("TrainingScope.adopt: expected an entered scope, got one not entered or ended")
        fwd._check_usable("TrainingScope.adopt")
        assert fwd._transaction is not None  # check_usable raised otherwise
        with RECORDS_LOCK:
            ADOPTED[fwd._transaction] = self

    def close(self) -> None:
        """Drop every hold and leave the active scopes; records read after this raise
        :class:`TrainingScopeError`. Idempotent.

        Scopes may close in any order: closing an outer scope before an inner one removes only the outer one
        (the inner one stays active and keeps holding what its forwards read). A scope closed in another thread
        or context than the one that entered it releases its holds all the same and holds nothing after.
        """
        # NOTE: not ContextVar.reset(token): a token restores the whole stack as it was at __enter__, which
        # after an out-of-order close would revive the closed outer scope and drop the open inner one (and
        # it raises in any context but the entering one, before the holds were released).
        SCOPES.set(tuple(s for s in open_scopes() if s is not self))
        with self.cache.lock:
            self.closed = True  # under the lock: a concurrent hold() sees it and takes nothing
            for record in self.records:
                record.end("a forward of a TrainingScope that has ended (its held pages were released)")
            self.records.clear()
            if self.ledger is not None:
                self.ledger.clear()

    def hold(self, record: HistoryRead) -> bool:
        """Hold ``record``'s history pages until the scope ends; ``False`` (nothing held) once it has ended."""
        with self.cache.lock:
            if self.closed:
                return False
            hold = PageHold(self._allocator_of(record), record.history_pages)
            hold.take()
            record.attach(hold, self.ledger)
            self.records.append(record)
            return True

    def _allocator_of(self, record: HistoryRead) -> PageAllocator:
        """The allocator of the lane ``record`` read (the first lane's for a uniform cache or a record without a
        page store)."""
        lanes = getattr(self.cache, "_lanes", ())
        for lane in lanes:
            if lane.pool.kv is record.kv_pool:
                return lane.allocator
        if len(lanes) > 1:
            raise TrainingScopeError(
                f"TrainingScope: expected a forward of this scope's cache (one of its {len(lanes)} lanes' page "
                "stores), got a record of another page store"
            )
        return self.cache._allocator

    @property
    def held_pages(self) -> int:
        """References this scope holds (a page read by several forwards counts once per forward)."""
        return sum(len(r.hold.pages) for r in self.records if r.hold is not None)

    def _contexts(self) -> tuple[Any, Any]:
        """``context_fn`` of ``torch.utils.checkpoint``: the first run records which history each layer call
        read, the recomputation reads the same."""
        frames: list[tuple[HistoryRead, int]] = []
        return capturing(frames), Replay(frames).active()

    def checkpoint(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)`` whose recomputation sees the
        forward the first run saw (``kwargs`` go to ``fn``).

        The layer contexts among ``args`` (a :class:`LayerContext`, a list of them, a :class:`ForwardContext`)
        are handed to ``fn`` as frozen copies of this forward -- its positions, cross-attention caches,
        layout -- because the cache reuses the live objects for the next forward of the same streams; and
        each layer's recomputation reads the history pages its first call read (held by this scope).
        """
        if self.closed or not self._entered:
            raise TrainingScopeError("TrainingScope.checkpoint: expected an entered scope, got one not entered or ended")
        frozen = tuple(_freeze(a) for a in args)
        return torch_checkpoint(fn, *frozen, use_reentrant=False, context_fn=self._contexts, **kwargs)


def frozen_forward(fwd: ForwardContext) -> ForwardContext:
    """A copy of ``fwd`` that keeps describing its current forward (one per forward, shared by its layers)."""
    fwd._check_usable("TrainingScope.checkpoint")
    transaction = fwd._transaction
    assert transaction is not None  # check_usable raised otherwise
    with RECORDS_LOCK:
        frozen = FROZEN.get(transaction)
    if frozen is None:
        lanes = tuple(_frozen_copy(lane, ()) for lane in fwd._lanes)
        frozen = _frozen_copy(fwd, lanes)
        with RECORDS_LOCK:
            FROZEN[transaction] = frozen
        transaction.on_close.append(forget)
    return frozen


def _frozen_copy(fwd: ForwardContext, lanes: tuple[ForwardContext, ...]) -> ForwardContext:
    """A copy of ``fwd`` and its layers; with retention groups (``lanes``: the frozen lane contexts) each layer's
    shares point into the frozen lanes, so a recomputation never reads a later forward's lane contexts."""
    frozen = dataclasses.replace(
        fwd, layers=[], _cross=dict(fwd._cross), _cross_missing=dict(fwd._cross_missing), _entered=[], _lanes=lanes
    )
    for layer in fwd.layers:
        shares = tuple(
            dataclasses.replace(share, context=lanes[share.lane].layers[share.context.layer_index])
            for share in layer._shares
        )
        frozen.layers.append(dataclasses.replace(layer, forward=frozen, cross=dict(layer.cross), _shares=shares))
    return frozen


def _freeze(arg: Any) -> Any:
    """``arg`` with its layer / forward contexts replaced by their frozen copies."""
    if isinstance(arg, LayerContext):
        return frozen_forward(arg.forward).layers[arg.layer_index]
    if isinstance(arg, ForwardContext):
        return frozen_forward(arg)
    if isinstance(arg, (list, tuple)) and arg and all(isinstance(a, LayerContext) for a in arg):
        return type(arg)(_freeze(a) for a in arg)
    return arg

