"""``torch.library`` custom ops: the only place a layer's forward touches the KV cache.

FlashInfer's ``wrapper.run()`` cannot be traced by dynamo, so the write-and-
attend step is one opaque custom op with a fake (meta) implementation and
explicit ``mutates_args``. Custom ops cannot take Python objects, so the plan
is found through a *handle*: a CPU int64 scalar tensor (data, not a Python int,
so a new forward, session or layer never specialises the compiled graph)
resolved in the single :data:`HANDLES` registry.

Under ``torch.compile`` the write leaves the opaque op (:func:`write_kv_in_graph`): inductor fuses
it into the kernel that produces K/V (norm, RoPE, FP8 quantization, store into the pool) and the
attention op only reads the pool (:func:`paged_attention_op`).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Protocol, cast

import torch

from ardiff_modules.backends.base import AttentionPlan
from ardiff_modules.errors import PlanNotFoundError
from ardiff_modules.quant import is_quantized, quantize


class PlanHolder(Protocol):
    """Anything registered in :data:`HANDLES`: it exposes the current plan of its forward."""

    plan: AttentionPlan | None

    def check_usable(self, what: str = ...) -> None:
        """Raise unless the forward is open (a finished forward must not touch the pool)."""

    def record_write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer ``layer`` is about to write ``k``/``v`` into the open forward's pending pages."""


class HandleTable:
    """Maps plan handles to their holders (weakly: a dropped forward frees its entry)."""

    def __init__(self) -> None:
        self._holders: weakref.WeakValueDictionary[int, PlanHolder] = weakref.WeakValueDictionary()
        self._ids = itertools.count(1)
        # Caches in several threads register and drop contexts concurrently.
        self._lock = threading.Lock()

    def register(self, holder: PlanHolder) -> int:
        with self._lock:
            handle = next(self._ids)
            self._holders[handle] = holder
        return handle

    def unregister(self, handle: int) -> None:
        with self._lock:
            self._holders.pop(handle, None)

    def get(self, handle: int) -> AttentionPlan:
        """The plan of an open forward; raises if the handle is unknown or its forward finished."""
        return self._holder(handle).plan  # type: ignore[return-value]

    def get_for_write(self, handle: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> AttentionPlan:
        """:meth:`get`, recording that ``layer`` writes ``k``/``v`` in this forward (a commit needs every layer;
        an FP8 pool calibrates an uncalibrated layer from them): host work, no sync."""
        holder = self._holder(handle)
        holder.record_write(layer, k, v)
        return holder.plan  # type: ignore[return-value]

    def holder(self, handle: int) -> PlanHolder:
        """What ``handle`` names, once its forward was checked to be open (the gradient path's ops)."""
        return self._holder(handle)

    def _holder(self, handle: int) -> PlanHolder:
        with self._lock:
            holder = self._holders.get(handle)
        if holder is None:
            raise PlanNotFoundError(
                f"No attention plan is registered under handle {handle}: the forward context was "
                "released (session closed or context dropped); call get_kv_caches()/prepare_forward() again"
            )
        holder.check_usable("chunk_attention")
        if holder.plan is None:
            raise PlanNotFoundError(f"Plan handle {handle} is registered but has no plan yet")
        return holder

    def __len__(self) -> int:
        return len(self._holders)


#: The one registry of plans (explicit, documented; entries die with their forward contexts).
HANDLES = HandleTable()


@torch.library.custom_op("ardiff_modules::chunk_attention", mutates_args=("kv_pool",))
def chunk_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: torch.Tensor,
    handle_id: torch.Tensor,
    scale: float,
    q_sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write ``k``/``v`` into the pending pages of layer ``layer`` of ``kv_pool`` and attend.

    ``q`` is ``[tokens, heads, head_dim]`` (streams flattened, stream-major), ``k``/``v``
    ``[tokens, kv_heads, head_dim]``, ``kv_pool`` the whole pool ``[layers, 2, pages, page_size,
    kv_heads, head_dim]``; ``layer`` and ``handle_id`` are CPU int64 scalars; ``q_sink`` (like ``q``)
    the query that attends the sinks when they sit at relative positions. Returns
    ``[tokens, heads, head_dim_v]``.

    NOTE: the op mutates the one pool tensor, never per-layer views of it: several aliased
    mutated inputs send torch.compile down its "synthetic base" path, which was measured to
    corrupt the cache on CUDA. The layer index is data (a CPU tensor), so one graph serves
    every layer and reading it is not a device sync.
    """
    plan, index, k_cache, v_cache = _resolve(kv_pool, layer, handle_id, (k, v))
    return cast(torch.Tensor, plan.run(q, k, v, k_cache, v_cache, scale, layer=index, **_sink_query(plan, q_sink)))


def _resolve(
    kv_pool: torch.Tensor, layer: torch.Tensor, handle_id: torch.Tensor,
    writes: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[AttentionPlan, int, torch.Tensor, torch.Tensor]:
    """The open forward's plan (raises if it finished), the layer index and this layer's K and V pages;
    ``writes``: the ``(k, v)`` this call writes (recorded on the forward first)."""
    index = int(layer)
    plan = HANDLES.get(int(handle_id)) if writes is None else HANDLES.get_for_write(int(handle_id), index, *writes)
    return plan, index, kv_pool[index, 0], kv_pool[index, 1]


def _sink_query(plan: AttentionPlan, q_sink: torch.Tensor | None) -> dict[str, Any]:
    """``q_sink`` as a keyword for plans whose sinks sit at relative positions (a forward before any sink
    is resident runs one segment and ignores it)."""
    return {"q_sink": q_sink} if plan.uses_sink_query else {}


@chunk_attention_op.register_fake
def _chunk_attention_fake(q, k, v, kv_pool, layer, handle_id, scale, q_sink=None):  # noqa: ANN001, ANN202
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]))


@torch.library.custom_op("ardiff_modules::chunk_attention_lse", mutates_args=("kv_pool",))
def chunk_attention_lse_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: torch.Tensor,
    handle_id: torch.Tensor,
    scale: float,
    q_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunk_attention_op` that also returns the float32 ``[tokens, heads]`` natural-log LSE.

    A separate op (not a flag) so the common path's schema and output stay one tensor.
    """
    plan, index, k_cache, v_cache = _resolve(kv_pool, layer, handle_id, (k, v))
    return cast(
        "tuple[torch.Tensor, torch.Tensor]",
        plan.run(q, k, v, k_cache, v_cache, scale, return_lse=True, layer=index, **_sink_query(plan, q_sink)),
    )


@chunk_attention_lse_op.register_fake
def _chunk_attention_lse_fake(q, k, v, kv_pool, layer, handle_id, scale, q_sink=None):  # noqa: ANN001, ANN202
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2])), q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)


# ---------------------------------------------------------------------------------------------------
# Compiled path: K/V written by the graph that produces them, attention over the pool alone.


@torch.library.custom_op("ardiff_modules::kv_write_slots", mutates_args=("kv_scales",))
def kv_write_slots_op(
    k: torch.Tensor, v: torch.Tensor, kv_scales: torch.Tensor, layer: torch.Tensor, handle_id: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate before a compiled graph writes ``k``/``v`` ``[tokens, kv_heads, head_dim]`` into the pool.

    Raises unless the forward is open (a finished forward must not write, and the write happens
    before the attention op would check), records the write on the forward (a commit needs every
    layer), calibrates an uncalibrated FP8 layer's scales
    (``kv_scales`` ``[layers, 2, kv_heads]``, mutated then), and returns, on the pool's device, the
    int64 ``[tokens]`` token slots (``page * page_size + offset``) of the current tokens and the
    int64 ``[1]`` layer index -- fresh tensors, so the write depends on this op, and no CPU tensor
    enters the graph (inductor would copy it to the device each call, which a CUDA graph cannot
    capture).
    """
    index = int(layer)
    plan = HANDLES.get_for_write(int(handle_id), index, k, v)  # records the write; calibrates the pool's scales if needed
    quantizer = plan.quantizer
    if (
        quantizer is not None and quantizer.state(index) == "provisional"
        and kv_scales.data_ptr() != quantizer.scales.data_ptr()
    ):
        # NOTE: ``kv_scales`` may be the graph's functional copy of them (any backend but inductor's
        # in-place rewrite), taken before this call may have calibrated: it must hold the calibrated
        # values too, both for the in-graph quantization that reads it and for the copy-back at the end
        # of the graph (while the scales are provisional only: fixed ones were in the copy already).
        kv_scales[index].copy_(quantizer.scales[index])
    slots = plan.write_slots
    return slots.clone(), torch.full((1,), index, dtype=torch.int64, device=slots.device)


@kv_write_slots_op.register_fake
def _kv_write_slots_fake(k, v, kv_scales, layer, handle_id):  # noqa: ANN001, ANN202
    return k.new_empty((k.shape[0],), dtype=torch.int64), k.new_empty((1,), dtype=torch.int64)


def write_kv_in_graph(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_pool: torch.Tensor,
    kv_scales: torch.Tensor,
    layer: torch.Tensor,
    handle_id: torch.Tensor,
) -> None:
    """Write ``k``/``v`` ``[tokens, kv_heads, head_dim]`` into layer ``layer``'s pending slots of ``kv_pool``.

    For compiled graphs: traceable torch (an ``index_put_`` on the whole pool, quantized first for an
    FP8 pool), so inductor fuses it with whatever computes ``k``/``v``. Eager callers use the custom
    op, whose backend write (FlashInfer's ``append_paged_kv_cache``) is faster than an eager scatter.

    NOTE: the ``index_put_`` indexes the pool tensor itself with (layer, K|V, page, offset). Writing
    through a view of it (``pool.view(-1, heads, dim)[slots]``) makes functionalization rebuild the
    base from the view, and inductor then clones and copies back the *whole pool* each call;
    ``tests/compile/test_compile_write.py`` checks the generated code for that.
    """
    slots, layer_index = torch.ops.ardiff_modules.kv_write_slots(k, v, kv_scales, layer, handle_id)
    page_size = kv_pool.shape[3]
    pages, offsets = slots // page_size, slots % page_size
    if is_quantized(kv_pool.dtype):
        k_scale, v_scale = kv_scales[layer_index][0]
        k = quantize(k, k_scale, kv_pool.dtype)
        v = quantize(v, v_scale, kv_pool.dtype)
    else:
        k, v = k.to(kv_pool.dtype), v.to(kv_pool.dtype)
    kv_pool.index_put_((layer_index, torch.zeros_like(slots), pages, offsets), k)
    kv_pool.index_put_((layer_index, torch.ones_like(slots), pages, offsets), v)


@torch.library.custom_op("ardiff_modules::paged_attention", mutates_args=())
def paged_attention_op(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: torch.Tensor,
    handle_id: torch.Tensor,
    scale: float,
    q_sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attend ``q`` ``[tokens, heads, head_dim]`` over layer ``layer`` of ``kv_pool``, whose pending
    pages already hold the current K/V (:func:`write_kv_in_graph`); ``[tokens, heads, head_dim_v]``."""
    plan, index, k_cache, v_cache = _resolve(kv_pool, layer, handle_id)
    return cast(torch.Tensor, plan.attend(q, k_cache, v_cache, scale, layer=index, **_sink_query(plan, q_sink)))


@paged_attention_op.register_fake
def _paged_attention_fake(q, kv_pool, layer, handle_id, scale, q_sink=None):  # noqa: ANN001, ANN202
    return q.new_empty((q.shape[0], q.shape[1], kv_pool.shape[-1]))


@torch.library.custom_op("ardiff_modules::paged_attention_lse", mutates_args=())
def paged_attention_lse_op(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: torch.Tensor,
    handle_id: torch.Tensor,
    scale: float,
    q_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`paged_attention_op` that also returns the float32 ``[tokens, heads]`` natural-log LSE."""
    plan, index, k_cache, v_cache = _resolve(kv_pool, layer, handle_id)
    return cast(
        "tuple[torch.Tensor, torch.Tensor]",
        plan.attend(q, k_cache, v_cache, scale, return_lse=True, layer=index, **_sink_query(plan, q_sink)),
    )


@paged_attention_lse_op.register_fake
def _paged_attention_lse_fake(q, kv_pool, layer, handle_id, scale, q_sink=None):  # noqa: ANN001, ANN202
    return (
        q.new_empty((q.shape[0], q.shape[1], kv_pool.shape[-1])),
        q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32),
    )
