"""Gradients through the cache: forwards with autograd, activation checkpointing, the training scope.

A forward with gradients (grad mode on and q, k or v requiring grad) attends the visible history as a
constant -- it was written under ``no_grad``, as in every peer -- and its own pending tokens' K/V as the
live tensors: ``softmax(q [K_history ; k]^T * scale) [V_history ; v]``, computed by torch's SDPA over the
gathered history so autograd and SDPA's own backward kernels give q, k and v their gradients. The pool
copy of the pending K/V is written detached, exactly as a forward without gradients writes it (an FP8
pool's rounding reaches the live K/V as a straight-through estimate, so values match the pool's).

Recomputation (``torch.utils.checkpoint``) runs a block's forward again during backward, when the rollout
has moved on: the forward may have committed and its history pages may have been evicted and reused. A
:class:`TrainingScope` holds one reference on the history pages of every forward with gradients inside it
(no copies), and :meth:`TrainingScope.checkpoint` hands each recomputed layer the :class:`HistoryRead` of
its original call, so recomputation reads exactly the K/V the forward saw; leaving the scope drops the
holds. A recomputation without it, or after the scope ended, raises :class:`TrainingScopeError`.

Forwards without gradients never come here: their speed and kernels are unchanged.
"""

from __future__ import annotations

import contextvars
import dataclasses
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypeVar

import torch
import torch.nn.functional as F

from ardiff_modules.checks import needs_gqa
from ardiff_modules.context import ForwardContext, LayerContext
from ardiff_modules.core.transaction import ForwardTransaction, PageHold
from ardiff_modules.core.allocator import PageAllocator
from ardiff_modules.errors import InferenceOnlyError, SpecError, TrainingScopeError
from ardiff_modules.layout import page_token_slots
from ardiff_modules.ops import HANDLES, write_kv_in_graph
from ardiff_modules.quant import dequantize, is_quantized, quantize

T = TypeVar("T")


class ScopedCache(Protocol):
    """What a :class:`TrainingScope` needs of its cache (``KVCache``): the allocator, the forward manager, the lock."""

    _allocator: PageAllocator

    @property
    def _forwards(self) -> object: ...
    @property
    def lock(self) -> threading.RLock: ...


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
        )

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

_RECORDS: weakref.WeakKeyDictionary[ForwardTransaction, HistoryRead] = weakref.WeakKeyDictionary()
#: One frozen copy of each forward's context that ``TrainingScope.checkpoint`` handed out (while it is open).
_FROZEN: weakref.WeakKeyDictionary[ForwardTransaction, ForwardContext] = weakref.WeakKeyDictionary()
_RECORDS_LOCK = threading.Lock()
_SCOPES: contextvars.ContextVar[tuple[TrainingScope, ...]] = contextvars.ContextVar("ardiff_training_scopes", default=())
_CAPTURE: contextvars.ContextVar[list[tuple[HistoryRead, int]] | None] = contextvars.ContextVar("ardiff_capture", default=None)
_REPLAY: contextvars.ContextVar[_Replay | None] = contextvars.ContextVar("ardiff_replay", default=None)


def _open_scopes() -> tuple[TrainingScope, ...]:
    """This context's active scopes, less those closed elsewhere (another thread or context)."""
    return tuple(s for s in _SCOPES.get() if not s.closed)


def _in_backward() -> bool:
    """Whether autograd's engine is running (a recomputation under ``torch.utils.checkpoint``)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def read_history(kv: LayerContext, k_rows: torch.Tensor, v_rows: torch.Tensor, pad_to: int | None = None) -> HistoryRead:
    """The :class:`HistoryRead` of this layer call; a first call also writes ``k_rows``/``v_rows``
    (``[tokens, kv_heads, head_dim]``, detached) into the forward's pending pages (a recomputation never writes)."""
    replay = _REPLAY.get()
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
    capture = _CAPTURE.get()
    if capture is not None:
        capture.append((record, kv.layer_index))
    return record


def _record_of(fwd: ForwardContext, pad_to: int | None) -> HistoryRead:
    """One record per forward (built by its first layer with gradients: host work once per forward)."""
    transaction = fwd._transaction
    assert transaction is not None
    with _RECORDS_LOCK:
        record = _RECORDS.get(transaction)
    if record is not None:
        return record
    record = HistoryRead.of(fwd, pad_to)
    # The innermost open scope of this cache holds it; a closed one still listed (closed in another thread or
    # context, whose stack it could not edit) refuses, and the next one out takes the record.
    for scope in reversed(_SCOPES.get()):
        if scope.cache._forwards is fwd._owner and scope.hold(record):
            break
    with _RECORDS_LOCK:
        _RECORDS[transaction] = record
    # NOTE: the record refers to its transaction, so the weak key alone would never let the entry go: drop it
    # when the forward finishes (no first call can come after; replays hold their records themselves).
    transaction.on_close.append(_forget)
    return record


def _forget(transaction: ForwardTransaction) -> None:
    with _RECORDS_LOCK:
        _RECORDS.pop(transaction, None)
        _FROZEN.pop(transaction, None)


class _Replay:
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
        token = _REPLAY.set(self)
        try:
            yield
        finally:
            _REPLAY.reset(token)


@contextmanager
def _capturing(frames: list[tuple[HistoryRead, int]]) -> Iterator[None]:
    token = _CAPTURE.set(frames)
    try:
        yield
    finally:
        _CAPTURE.reset(token)


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
    """

    def __init__(self, cache: ScopedCache) -> None:
        if not hasattr(cache, "_allocator") or not hasattr(cache, "lock"):
            raise SpecError(f"TrainingScope.cache: expected a KVCache, got {type(cache).__name__}")
        self.cache = cache
        self.records: list[HistoryRead] = []
        self._entered = False
        self.closed = False

    def __enter__(self) -> TrainingScope:
        if self._entered or self.closed:
            raise TrainingScopeError("TrainingScope: expected a new scope, got one that was already entered")
        self._entered = True
        _SCOPES.set((*_open_scopes(), self))
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        _SCOPES.set(tuple(s for s in _open_scopes() if s is not self))
        with self.cache.lock:
            self.closed = True  # under the lock: a concurrent hold() sees it and takes nothing
            for record in self.records:
                record.ended = "a forward of a TrainingScope that has ended (its held pages were released)"
                if record.hold is not None:
                    record.hold.release()
            self.records.clear()

    def hold(self, record: HistoryRead) -> bool:
        """Hold ``record``'s history pages until the scope ends; ``False`` (nothing held) once it has ended."""
        with self.cache.lock:
            if self.closed:
                return False
            hold = PageHold(self.cache._allocator, record.history_pages)
            hold.take()
            record.hold = hold
            self.records.append(record)
            return True

    @property
    def held_pages(self) -> int:
        """References this scope holds (a page read by several forwards counts once per forward)."""
        return sum(len(r.hold.pages) for r in self.records if r.hold is not None)

    def _contexts(self) -> tuple[Any, Any]:
        """``context_fn`` of ``torch.utils.checkpoint``: the first run records which history each layer call
        read, the recomputation reads the same."""
        frames: list[tuple[HistoryRead, int]] = []
        return _capturing(frames), _Replay(frames).active()

    def checkpoint(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)`` whose recomputation sees the
        forward the first run saw (``kwargs`` go to ``fn``).

        The layer contexts among ``args`` (a :class:`LayerContext`, a list of them, a :class:`ForwardContext`)
        are handed to ``fn`` as frozen copies of this forward -- its positions, cross-attention caches,
        layout -- because the cache reuses the live objects for the next forward of the same streams; and
        each layer's recomputation reads the history pages its first call read (held by this scope).
        """
        from torch.utils.checkpoint import checkpoint

        if self.closed or not self._entered:
            raise TrainingScopeError("TrainingScope.checkpoint: expected an entered scope, got one not entered or ended")
        frozen = tuple(_freeze(a) for a in args)
        return checkpoint(fn, *frozen, use_reentrant=False, context_fn=self._contexts, **kwargs)


def frozen_forward(fwd: ForwardContext) -> ForwardContext:
    """A copy of ``fwd`` that keeps describing its current forward (one per forward, shared by its layers)."""
    fwd._check_usable("TrainingScope.checkpoint")
    transaction = fwd._transaction
    assert transaction is not None  # check_usable raised otherwise
    with _RECORDS_LOCK:
        frozen = _FROZEN.get(transaction)
    if frozen is None:
        frozen = dataclasses.replace(
            fwd, layers=[], _cross=dict(fwd._cross), _cross_missing=dict(fwd._cross_missing), _entered=[]
        )
        frozen.layers.extend(dataclasses.replace(layer, forward=frozen, cross=dict(layer.cross)) for layer in fwd.layers)
        with _RECORDS_LOCK:
            _FROZEN[transaction] = frozen
        transaction.on_close.append(_forget)
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


def attend_with_grad(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerContext, *, scale: float,
    sink_query: torch.Tensor | None, return_lse: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``chunk_attention`` with gradients to ``q``, ``k``, ``v`` (and ``sink_query``); shapes as there."""
    streams, n, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    pool = kv._kv_pool
    assert pool is not None
    if torch.compiler.is_compiling():
        view = _compiled_view(k, v, kv, sink_query is not None)
    else:
        rows = (streams * n, kv_heads, head_dim)
        record = read_history(kv, k.detach().reshape(rows), v.detach().reshape(rows))
        view = record.view(kv.layer_index, pool, q.dtype)
    k_live, v_live = _as_stored(k, v, view.scales, pool.dtype)
    keys = torch.cat([view.k, k_live], dim=1).transpose(1, 2)  # [S, Hkv, K, D]
    values = torch.cat([view.v, v_live], dim=1).transpose(1, 2)
    queries = q.transpose(1, 2)  # [S, H, n, D]
    if sink_query is not None and view.sink_keys is not None:
        # One softmax, two queries: [q_sink, q] . [k, 0] for sink keys and . [0, k] for the others.
        queries = torch.cat([sink_query.transpose(1, 2), queries], dim=-1)
        keys = torch.cat([keys * view.sink_keys, keys * ~view.sink_keys], dim=-1)
    gqa = needs_gqa(heads, kv_heads)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=view.mask, scale=scale, enable_gqa=gqa)
    if view.empty_rows is not None:
        out = out.masked_fill(view.empty_rows, 0)
    out = out.transpose(1, 2)  # [S, n, H, D]
    if not return_lse:
        return out
    logits = queries.float() @ keys.float().repeat_interleave(heads // kv_heads, dim=1).transpose(-1, -2) * scale
    if view.visible is not None:
        logits = logits.masked_fill(~view.visible, float("-inf"))
    return out, torch.logsumexp(logits, dim=-1).transpose(1, 2)  # [S, n, H]


class HistoryView(NamedTuple):
    """One layer's share of a :class:`HistoryRead`: the gathered history and the masks, as tensors."""

    k: torch.Tensor  # [S, Kh, Hkv, D], a constant
    v: torch.Tensor
    mask: torch.Tensor | None  # bool [S, 1, n, Kh + n] (rows without keys opened), None: all visible
    sink_keys: torch.Tensor | None  # bool [S, 1, Kh + n, 1]
    empty_rows: torch.Tensor | None  # bool [S, 1, n, 1]
    visible: torch.Tensor | None  # the mask before rows without keys were opened
    scales: torch.Tensor | None  # float32 [2, Hkv] (FP8 pools), else None


def _as_stored(
    k: torch.Tensor, v: torch.Tensor, scales: torch.Tensor | None, kv_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The live ``k``/``v`` with the values the pool stores (FP8 rounding as a straight-through estimate)."""
    if scales is None or not is_quantized(kv_dtype):
        return k, v
    k_round = dequantize(quantize(k.detach(), scales[0], kv_dtype), scales[0], k.dtype)
    v_round = dequantize(quantize(v.detach(), scales[1], kv_dtype), scales[1], v.dtype)
    return k + (k_round - k.detach()), v + (v_round - v.detach())


# ---------------------------------------------------------------------------------------------------
# Compiled graphs: the record is found (and the pending K/V written) inside one opaque op with static
# output shapes -- the history padded to the spec's bound -- so a rollout compiles to one frame.


def _compiled_view(k: torch.Tensor, v: torch.Tensor, kv: LayerContext, sink_query: bool) -> HistoryView:
    fwd = kv.forward
    if fwd._token_mask is not None:
        raise SpecError("chunk_attention (gradients, compiled): expected no token_mask, got one; run that forward eagerly")
    bound = fwd._max_history_tokens
    if bound <= 0:
        raise SpecError(
            "chunk_attention (gradients, compiled): expected a bounded history (KVCacheSpec.window_chunks), got "
            "global attention; compile the training step over a bounded window or run it eagerly"
        )
    hk, hv, valid, pending, sinks, scales = torch.ops.ardiff_modules.history_kv(
        k.detach(), v.detach(), kv._kv_pool, kv._kv_scales, kv._layer_id, fwd._handle_id, bound
    )
    streams, n = k.shape[0], k.shape[1]
    mask = torch.cat([valid[:, None, :].expand(streams, n, bound), pending[None].expand(streams, n, n)], dim=-1)
    sink_keys = None
    if sink_query:
        sink_keys = torch.cat([sinks, sinks.new_zeros((streams, n))], dim=1)[:, None, :, None]
    quantized = kv._kv_pool is not None and is_quantized(kv._kv_pool.dtype)
    return HistoryView(hk.to(k.dtype), hv.to(k.dtype), mask[:, None], sink_keys, None, mask[:, None], scales if quantized else None)


@torch.library.custom_op("ardiff_modules::history_kv", mutates_args=("kv_pool",))
def history_kv_op(
    k: torch.Tensor, v: torch.Tensor, kv_pool: torch.Tensor, kv_scales: torch.Tensor, layer: torch.Tensor,
    handle_id: torch.Tensor, bound: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Write ``k``/``v`` ``[S, n, Hkv, D]`` into the forward's pending pages (first call only) and return its
    history padded to ``bound`` keys: ``k, v [S, bound, Hkv, D]``, ``valid [S, bound]``, the pending
    visibility ``[n, n]``, ``sinks [S, bound]`` and the layer's scales ``[2, Hkv]`` (fresh tensors)."""
    index = int(layer)
    replay = _REPLAY.get()
    if replay is not None:
        record = replay.next(index)
    else:
        holder = HANDLES.holder(int(handle_id))
        if not isinstance(holder, ForwardContext):
            raise TrainingScopeError(f"chunk_attention (gradients): expected a forward context, got {type(holder).__name__}")
        layer_context = holder.layers[index]
        rows = (-1, k.shape[2], k.shape[3])
        record = read_history(layer_context, k.reshape(rows), v.reshape(rows), pad_to=bound)
    if record.gather.shape[1] != bound:  # a forward whose first layers ran eagerly (exact width), then compiled
        raise SpecError(
            f"chunk_attention (gradients, compiled): expected the forward's history padded to {bound} keys, got a "
            f"forward read eagerly ({record.gather.shape[1]} keys): run all of a forward's layers compiled or eager"
        )
    view = record.view(index, kv_pool, k.dtype)
    streams = k.shape[0]
    scales = record.scales.get(index)
    return (
        view.k, view.v, record.valid[:, :, 0, 0].clone(), record.pending.to(k.device, copy=True),
        torch.zeros((streams, bound), dtype=torch.bool, device=k.device) if record.sink_keys is None
        else record.sink_keys[:, 0, :bound, 0].clone(),
        torch.ones((2, k.shape[2]), dtype=torch.float32, device=k.device) if scales is None else scales.clone(),
    )


@history_kv_op.register_fake
def _history_kv_fake(k, v, kv_pool, kv_scales, layer, handle_id, bound):  # noqa: ANN001, ANN202
    streams, n, heads, dim = k.shape
    return (
        k.new_empty((streams, bound, heads, dim)), k.new_empty((streams, bound, heads, dim)),
        k.new_empty((streams, bound), dtype=torch.bool), k.new_empty((n, n), dtype=torch.bool),
        k.new_empty((streams, bound), dtype=torch.bool), k.new_empty((2, heads), dtype=torch.float32),
    )
