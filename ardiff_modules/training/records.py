"""What a forward with gradients read: :class:`HistoryRead` (one per forward, shared by its layers), found again
by a recomputation (``torch.utils.checkpoint``) through the capture / replay of :class:`TrainingScope.checkpoint`
or of an integration's layer, and held by the innermost open :class:`~ardiff_modules.training.TrainingScope` of
its cache (or the scope a forward was adopted by).
"""

from __future__ import annotations

import contextvars
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from ardiff_modules.context import ForwardContext, LayerContext
from ardiff_modules.core.branch import BranchPages
from ardiff_modules.core.transaction import ForwardTransaction, PageHold
from ardiff_modules.core.allocator import PageAllocator
from ardiff_modules.errors import InferenceOnlyError, SpecError, TrainingScopeError
from ardiff_modules.lanes import CacheLane
from ardiff_modules.layout import StreamLayout, page_token_slots
from ardiff_modules.ops import write_kv_in_graph
from ardiff_modules.quant import dequantize, is_quantized

from ardiff_modules.training.straight_through import LivePiece, LiveWrites


class ScopedCache(Protocol):
    """What a :class:`TrainingScope` needs of its cache (``KVCache``): its lanes (each lane's allocator holds the
    pages its forwards read), the forward manager, the lock."""

    _allocator: PageAllocator
    _lanes: tuple[CacheLane, ...]

    @property
    def _forwards(self) -> object: ...

    @property
    def lock(self) -> threading.RLock: ...


class HoldingScope(Protocol):
    """What the records need of a :class:`~ardiff_modules.training.TrainingScope` (defined above this module)."""

    @property
    def cache(self) -> ScopedCache: ...

    @property
    def closed(self) -> bool: ...

    def hold(self, record: HistoryRead) -> bool: ...


@dataclass(eq=False)
class HistoryRead:
    """What one forward with gradients attends besides its own tokens: the same for all its layers.

    Attributes
    ----------
    gather:
        int64 ``[streams, history_keys]`` token slots (``page * page_size + offset``) of each stream's visible
        history, oldest first, padded with slot 0 (``history_keys``: the widest stream's, or a fixed bound).
    valid:
        bool ``[streams, history_keys, 1, 1]``: which gathered keys are history (not padding).
    mask:
        bool ``[streams, 1, seq_len, history_keys + seq_len]`` over ``[history ; pending]``, or ``None`` when
        every query sees every key. Rows that see no key are all ``True`` here (SDPA stays finite) and
        zeroed afterwards (:attr:`empty_rows`).
    sink_keys:
        bool ``[streams, 1, history_keys + seq_len, 1]``: keys attended with the sink query (sinks at relative
        positions), or ``None``.
    """

    transaction: ForwardTransaction
    gather: torch.Tensor
    valid: torch.Tensor
    mask: torch.Tensor | None
    sink_keys: torch.Tensor | None
    empty_rows: torch.Tensor | None
    visible: torch.Tensor | None  # the mask before empty rows were opened (for the LSE)
    #: bool ``[seq_len, seq_len]`` on the CPU: which pending keys each pending query sees (block-causal or
    #: bidirectional); what compiled graphs build their mask from.
    pending: torch.Tensor
    #: Every stream's history pages (what a scope holds; a page two streams share appears twice).
    history_pages: tuple[int, ...] = ()
    #: layer -> its FP8 scales ``[2, kv_heads]`` when the forward wrote (recomputation reads these).
    scales: dict[int, torch.Tensor] = field(default_factory=dict)
    hold: PageHold | None = None
    #: Why it may no longer be read ("" while it may).
    ended: str = ""
    #: Each stream's branch bookkeeping (batch order) and its generation when the forward began (a reset
    #: starts a new one): what a straight-through ledger keys its writes by.
    branches: tuple[BranchPages, ...] = ()
    generations: tuple[int, ...] = ()
    #: Per stream, ``(first absolute position, tokens)`` of each visible history chunk, in gather order (a content
    #: selection as one span at its candidates' first position: :meth:`exact_spans` has its tokens' own).
    history_spans: tuple[tuple[tuple[int, int], ...], ...] = ()
    #: Per stream, a content-selected stream's exact spans (``StreamLayout.exact_spans``: the chosen pages'
    #: positions are device data, read -- a sync -- only by a straight-through ledger), else ``None``.
    selection_spans: tuple[Callable[[], Sequence[tuple[int, int]]] | None, ...] = ()
    #: Per stream, ``(first absolute position, tokens)`` of each pending chunk, in token order.
    pending_spans: tuple[tuple[tuple[int, int], ...], ...] = ()
    #: The holding scope's ledger of live K/V writes when its ``history_grad`` is ``"straight_through"``.
    ledger: LiveWrites | None = None
    #: layer -> the live K/V this forward's history reads are routed to (frozen at the layer's first call, so a
    #: recomputation builds the same graph).
    live: dict[int, list[LivePiece]] = field(default_factory=dict)
    #: The page store ``[layers, 2, pages, ...]`` of the lane this record read (with retention groups a forward
    #: has one record per lane: the scope holds its pages in that lane's allocator).
    kv_pool: torch.Tensor | None = None
    #: Where the lane's layers count among the forward's writes (``ForwardContext._write_base``): ``lane_base +
    #: layer`` names one lane layer across the lanes (what the straight-through ledger keys its writes by).
    lane_base: int = 0

    @classmethod
    def of(cls, fwd: ForwardContext, pad_to: int | None = None) -> HistoryRead:
        """The record of ``fwd``'s open forward; ``pad_to``: a fixed number of history keys (compiled graphs)."""
        layout = fwd._layout
        assert layout is not None and fwd._transaction is not None  # the write gate checked the forward
        page_size, n, device = layout.page_size, layout.seq_len, fwd.positions.device
        slots = [page_token_slots(torch.tensor(s.history_pages, dtype=torch.int64), page_size) for s in layout.streams]
        lengths = [t.numel() for t in slots]
        width = max(lengths) if pad_to is None else pad_to
        if max(lengths) > width:
            raise SpecError(f"chunk_attention (gradients): expected at most {width} history keys, got {max(lengths)}")
        gather = torch.zeros((len(slots), width), dtype=torch.int64)
        valid = torch.zeros((len(slots), width), dtype=torch.bool)
        for i, t in enumerate(slots):
            gather[i, : t.numel()], valid[i, : t.numel()] = t, True
        chunk = layout.query_chunk
        pending = torch.ones((n, n), dtype=torch.bool) if layout.bidirectional else chunk[None, :] <= chunk[:, None]
        mask = _visibility(fwd, valid, pending, pad_to is not None)
        empty = None if mask is None else ~mask.any(dim=-1, keepdim=True)  # [S, n, 1]
        if empty is not None and not bool(empty.any()):
            empty = None  # no query row sees no key: nothing to open
        opened = mask if mask is None or empty is None else mask | empty
        sink_keys = None
        if layout.splits_sinks:
            sink_keys = torch.zeros((len(slots), width + n), dtype=torch.bool)
            for i, s in enumerate(layout.streams):
                sink_keys[i, : s.sink_pages * page_size] = True
            sink_keys = sink_keys[:, None, :, None].to(device)
        return cls(
            transaction=fwd._transaction, gather=gather.to(device), valid=valid[:, :, None, None].to(device),
            mask=None if opened is None else opened[:, None].to(device), sink_keys=sink_keys,
            empty_rows=None if empty is None else empty[:, None].to(device),
            visible=None if mask is None else mask[:, None].to(device), pending=pending,
            history_pages=tuple(p for s in layout.streams for p in s.history_pages),
            branches=fwd._transaction.branches,
            generations=tuple(b.generation for b in fwd._transaction.branches),
            history_spans=tuple(s.history_spans for s in layout.streams),
            selection_spans=tuple(s.exact_spans for s in layout.streams),
            pending_spans=tuple(_pending_spans(s, page_size) for s in layout.streams),
            kv_pool=fwd.layers[0]._kv_pool if fwd.layers else None, lane_base=fwd._write_base,
        )

    def exact_spans(self, stream: int) -> Sequence[tuple[int, int]]:
        """``(first absolute position, tokens)`` of each run of ``stream``'s history tokens, in gather order, at
        their own positions (a content selection's chosen pages too: a device sync while they are there)."""
        exact = self.selection_spans[stream] if self.selection_spans else None
        return self.history_spans[stream] if exact is None else exact()

    def attach(self, hold: PageHold, ledger: LiveWrites | None) -> None:
        """Held by a scope: ``hold`` keeps the history pages, ``ledger`` (straight-through scopes) routes the reads."""
        self.hold, self.ledger = hold, ledger

    def end(self, reason: str) -> None:
        """The holding scope ended: release the pages; later reads raise :class:`TrainingScopeError` naming ``reason``."""
        self.ended = reason
        if self.hold is not None:
            self.hold.release()

    def check_readable(self, what: str) -> None:
        """Raise :class:`TrainingScopeError` unless the pages hold what the forward read."""
        if self.ended:
            raise TrainingScopeError(f"{what}: expected the history a forward with gradients read, got {self.ended}")
        if self.hold is None and not self.transaction.is_open:
            raise TrainingScopeError(
                f"{what}: expected the history a forward with gradients read, got a forward that was "
                f"{self.transaction.status} outside a TrainingScope (its pages may hold other K/V since); "
                "run the rollout inside `with am.TrainingScope(cache) as scope:` and checkpoint with scope.checkpoint"
            )

    def history(self, layer: int, pool: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The gathered history K and V of ``layer``, each ``[streams, history_keys, kv_heads, head_dim]`` in
        ``dtype`` (constants: no gradient), padding zeroed."""
        out = []
        for which in (0, 1):
            pages = pool[layer, which]  # [pages, page_size, kv_heads, head_dim]
            rows = pages.reshape(-1, *pages.shape[2:])
            raw = rows.view(torch.uint8) if is_quantized(rows.dtype) else rows  # FP8 has no gather kernel everywhere
            seen = raw[self.gather].view(rows.dtype)
            if is_quantized(rows.dtype):
                seen = dequantize(seen, self.scales[layer][which], dtype)
            out.append(seen.to(dtype).masked_fill(~self.valid, 0))
        return out[0], out[1]

    def view(self, layer: int, pool: torch.Tensor, dtype: torch.dtype) -> HistoryView:
        """Layer ``layer``'s history and the forward's masks."""
        hk, hv = self.history(layer, pool, dtype)
        return HistoryView(hk, hv, self.mask, self.sink_keys, self.empty_rows, self.visible, self.scales.get(layer))


class HistoryView(NamedTuple):
    """One layer's share of a :class:`HistoryRead`: the gathered history and the masks, as tensors."""

    k: torch.Tensor  # [S, Kh, Hkv, D], a constant (or clean values routing their gradient: straight-through)
    v: torch.Tensor
    mask: torch.Tensor | None  # bool [S, 1, n, Kh + n] (rows without keys opened), None: all visible
    sink_keys: torch.Tensor | None  # bool [S, 1, Kh + n, 1]
    empty_rows: torch.Tensor | None  # bool [S, 1, n, 1]
    visible: torch.Tensor | None  # the mask before rows without keys were opened
    scales: torch.Tensor | None  # float32 [2, Hkv] (FP8 pools), else None


def _pending_spans(stream: StreamLayout, page_size: int) -> tuple[tuple[int, int], ...]:
    """``(first absolute position, tokens)`` of each pending chunk of ``stream``."""
    lengths = [len(pages) * page_size for pages in stream.pending_pages]
    if stream.pending_starts:
        return tuple(zip(stream.pending_starts, lengths))
    starts, at = [], stream.token_offset
    for n in lengths:
        starts.append(at)
        at += n
    return tuple(zip(starts, lengths))


def _visibility(fwd: ForwardContext, valid: torch.Tensor, pending: torch.Tensor, always: bool) -> torch.Tensor | None:
    """bool ``[streams, seq_len, history_keys + seq_len]`` over ``[history ; pending]`` (``None``: all visible)."""
    n, width = pending.shape[0], valid.shape[1]
    if not always and fwd._token_mask is None and bool(valid.all()) and bool(pending.all()):
        return None
    streams = valid.shape[0]
    mask = torch.cat([valid[:, None, :].expand(-1, n, -1), pending[None].expand(streams, -1, -1)], dim=-1)
    if fwd._token_mask is not None:  # in to_dense order: [history_s ; pending ; padding] per stream
        user = fwd._token_mask.cpu()
        for i in range(streams):
            h = int(valid[i].sum())
            mask[i, :, :h] &= user[i, :, :h]
            mask[i, :, width:] &= user[i, :, h : h + n]
    return mask


# ---------------------------------------------------------------------------------------------------
# Which record a layer call reads: its forward's (first call), or the original call's (recomputation).

#: Each open forward's records, one per lane (keyed by the lane's ``_write_base``; a uniform cache has one, 0).
RECORDS: weakref.WeakKeyDictionary[ForwardTransaction, dict[int, HistoryRead]] = weakref.WeakKeyDictionary()
#: One frozen copy of each forward's context that ``TrainingScope.checkpoint`` handed out (while it is open).
FROZEN: weakref.WeakKeyDictionary[ForwardTransaction, ForwardContext] = weakref.WeakKeyDictionary()
RECORDS_LOCK = threading.Lock()
SCOPES: contextvars.ContextVar[tuple[HoldingScope, ...]] = contextvars.ContextVar("ardiff_training_scopes", default=())
CAPTURE: contextvars.ContextVar[list[tuple[HistoryRead, int]] | None] = contextvars.ContextVar("ardiff_capture", default=None)
REPLAY: contextvars.ContextVar[Replay | None] = contextvars.ContextVar("ardiff_replay", default=None)
#: Forwards a scope adopted (``TrainingScope.adopt``): it holds their records whatever scopes are active.
ADOPTED: weakref.WeakKeyDictionary[ForwardTransaction, HoldingScope] = weakref.WeakKeyDictionary()


def open_scopes() -> tuple[HoldingScope, ...]:
    """This context's active scopes, less those closed elsewhere (another thread or context)."""
    return tuple(s for s in SCOPES.get() if not s.closed)


def active_scope(cache: object) -> HoldingScope | None:
    """The innermost scope of ``cache`` open in this context, or ``None``."""
    for scope in reversed(open_scopes()):
        if scope.cache is cache:
            return scope
    return None


def in_recomputation() -> bool:
    """Whether a layer call is a recomputation: a replay is active or autograd's engine is running."""
    return REPLAY.get() is not None or _in_backward()


def _in_backward() -> bool:
    """Whether autograd's engine is running (a recomputation under ``torch.utils.checkpoint``)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def read_history(kv: LayerContext, k_rows: torch.Tensor, v_rows: torch.Tensor, pad_to: int | None = None) -> HistoryRead:
    """The :class:`HistoryRead` of this layer call; a first call also writes ``k_rows``/``v_rows``
    (``[tokens, kv_heads, head_dim]``, detached) into the forward's pending pages (a recomputation never writes)."""
    replay = REPLAY.get()
    if replay is not None:
        return replay.next(kv.layer_index)
    if _in_backward():
        raise TrainingScopeError(
            "chunk_attention: expected a recomputation under TrainingScope.checkpoint (it hands each layer the "
            "history its first call read), got one under plain torch.utils.checkpoint: by backward the forward "
            "may have committed, its context describe a later forward and its pages hold other K/V. Checkpoint "
            "with `with am.TrainingScope(cache) as scope: x = scope.checkpoint(block, x, kv, ...)`"
        )
    fwd = kv.forward
    if fwd._static:
        raise InferenceOnlyError(
            "chunk_attention: expected a forward without static=True for gradients (CUDA-graph replays have "
            "no backward), got a static forward; prepare the training forwards with static=False"
        )
    assert kv._kv_pool is not None and kv._kv_scales is not None and kv._layer_id is not None
    # The gate checks the forward is open, records the layer's write and calibrates an FP8 layer.
    write_kv_in_graph(k_rows, v_rows, kv._kv_pool, kv._kv_scales, kv._layer_id, fwd._handle_id)
    record = _record_of(fwd, pad_to)
    if is_quantized(kv._kv_pool.dtype) and kv.layer_index not in record.scales:
        record.scales[kv.layer_index] = kv._kv_scales[kv.layer_index].clone()
    capture = CAPTURE.get()
    if capture is not None:
        capture.append((record, kv.layer_index))
    return record


def _record_of(fwd: ForwardContext, pad_to: int | None) -> HistoryRead:
    """One record per forward and lane (built by the lane's first layer with gradients: host work once per
    forward and lane); ``fwd`` is the lane's context (the forward's own for a uniform cache)."""
    transaction = fwd._transaction
    assert transaction is not None
    with RECORDS_LOCK:
        lanes = RECORDS.get(transaction)
        record = None if lanes is None else lanes.get(fwd._write_base)
    if record is not None:
        return record
    record = HistoryRead.of(fwd, pad_to)
    # The innermost open scope of this cache holds it; a closed one still listed (closed in another thread or
    # context, whose stack it could not edit) refuses, and the next one out takes the record.
    with RECORDS_LOCK:
        adopted = ADOPTED.get(transaction)  # every lane's record (dropped when the forward finishes)
    if adopted is None or not adopted.hold(record):
        for scope in reversed(SCOPES.get()):
            if scope.cache._forwards is fwd._owner and scope.hold(record):
                break
    with RECORDS_LOCK:
        first = transaction not in RECORDS
        RECORDS.setdefault(transaction, {})[fwd._write_base] = record
    if first:
        # NOTE: the record refers to its transaction, so the weak key alone would never let the entry go: drop
        # it when the forward finishes (no first call can come after; replays hold their records themselves).
        transaction.on_close.append(forget)
    return record


def forget(transaction: ForwardTransaction) -> None:
    with RECORDS_LOCK:
        RECORDS.pop(transaction, None)
        FROZEN.pop(transaction, None)
        ADOPTED.pop(transaction, None)


class Replay:
    """The records a checkpointed region's first run read, handed out in the same order on recomputation."""

    def __init__(self, frames: list[tuple[HistoryRead, int]]) -> None:
        self.frames = frames
        self.cursor = 0

    def next(self, layer: int) -> HistoryRead:
        if self.cursor >= len(self.frames):
            raise TrainingScopeError(
                f"chunk_attention: expected the recomputation to call the layers its first run called "
                f"({len(self.frames)} call(s)), got call {self.cursor + 1} (layer {layer})"
            )
        record, first_layer = self.frames[self.cursor]
        if first_layer != layer:
            raise TrainingScopeError(
                f"chunk_attention: expected the recomputation's call {self.cursor + 1} to be layer {first_layer} "
                f"as in its first run, got layer {layer}"
            )
        record.check_readable("chunk_attention (recomputation)")
        self.cursor += 1
        return record

    @contextmanager
    def active(self) -> Iterator[None]:
        self.cursor = 0
        token = REPLAY.set(self)
        try:
            yield
        finally:
            REPLAY.reset(token)


@contextmanager
def capturing(frames: list[tuple[HistoryRead, int]]) -> Iterator[None]:
    """Inside the block, each first layer call with gradients appends ``(its record, its layer)`` to ``frames``."""
    token = CAPTURE.set(frames)
    try:
        yield
    finally:
        CAPTURE.reset(token)


@contextmanager
def replaying(frames: list[tuple[HistoryRead, int]]) -> Iterator[None]:
    """Inside the block, layer calls read ``frames`` (what :func:`capturing` recorded) in order: a recomputation."""
    with Replay(frames).active():
        yield
