"""``torch.library`` custom ops: the only place a layer's forward touches the KV cache.

FlashInfer's ``wrapper.run()`` cannot be traced by dynamo, so the write-and-
attend step is one opaque custom op with a fake (meta) implementation and
explicit ``mutates_args``. Custom ops cannot take Python objects, so the plan
is found through a *handle*: a CPU int64 scalar tensor (data, not a Python int,
so a new forward, session or layer never specialises the compiled graph)
resolved in the single :data:`HANDLES` registry.

Under ``torch.compile`` the write leaves the opaque op (:func:`write_kv_in_graph`): inductor fuses
it into the kernel that produces K/V (norm, RoPE, FP8 quantization, store into the pool) and the
attention op only reads the pool (:func:`paged_attention_op`). On FA3 over an FP8 pool the query's
quantization leaves it too (:func:`attend_in_graph`): the graph quantizes q next to the norm / RoPE
that produce it and :func:`paged_attention_fp8_op` only launches the FP8 kernel.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Protocol, TypeAlias, cast

import torch

from ardiff_modules.backends.base import AttentionPlan, fold_softmax_scale
from ardiff_modules.errors import PlanNotFoundError, SpecError, TensorMismatchError
from ardiff_modules.quant import is_quantized, quantize, quantize_query


class PlanHolder(Protocol):
    """Anything registered in :data:`HANDLES`: it exposes the current plan of its forward."""

    _plan: AttentionPlan | None

    def _check_usable(self, what: str = ...) -> None:
        """Raise unless the forward is open (a finished forward must not touch the pool)."""

    def _record_write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
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
        return self._holder(handle)._plan  # type: ignore[return-value]

    def get_for_write(self, handle: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> AttentionPlan:
        """:meth:`get`, recording that ``layer`` writes ``k``/``v`` in this forward (a commit needs every layer;
        an FP8 pool calibrates an uncalibrated layer from them): host work, no sync."""
        holder = self._holder(handle)
        holder._record_write(layer, k, v)
        return holder._plan  # type: ignore[return-value]

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
        holder._check_usable("chunk_attention")
        if holder._plan is None:
            raise PlanNotFoundError(f"Plan handle {handle} is registered but has no plan yet")
        return holder

    def holders(self) -> list[PlanHolder]:
        """Every registered holder, a snapshot (error messages look up which forward a tensor belongs to)."""
        with self._lock:
            return list(self._holders.values())

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


# ---------------------------------------------------------------------------------------------------
# Compiled path over FA3 with an FP8 pool: the query quantized by the graph, the op launches the kernel.


#: What an attention op returns: the output, or ``(output, lse)``.
_Attended: TypeAlias = "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"


def attend_in_graph(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: torch.Tensor,
    handle_id: torch.Tensor,
    scale: float,
    q_sink: torch.Tensor | None = None,
    *,
    fp8_query: bool = False,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attend ``q`` ``[tokens, heads, head_dim]`` over layer ``layer`` of ``kv_pool`` from a compiled graph
    (the current K/V written by :func:`write_kv_in_graph` first); ``[tokens, heads, head_dim_v]`` and, with
    ``return_lse``, the float32 ``[tokens, heads]`` LSE.

    ``fp8_query`` (``ForwardContext._fp8_query``: FA3 over an FP8 pool): the query is quantized here, in
    traced torch -- :func:`~ardiff_modules.backends.base.fold_softmax_scale` then
    :func:`~ardiff_modules.quant.quantize_query`, the math the plan runs eagerly -- and
    :func:`paged_attention_fp8_op` gets ``(q8, q_scale)``. Otherwise :func:`paged_attention_op` gets ``q``.

    NOTE: in the graph, inductor fuses the per-head amax and the FP8 cast into the kernels of the norm /
    RoPE that produce q; inside the opaque op they were several more kernels per layer, each a full pass
    over q. The reduction and the cast are the same ops in the same order as the eager path (no clamp:
    the scale maps the amax to 448), so the FP8 query differs at most by inductor's float32 rounding of
    the fused intermediates.
    """
    ops = torch.ops.ardiff_modules
    if not fp8_query:
        op = ops.paged_attention_lse if return_lse else ops.paged_attention
        return cast(_Attended, op(q, kv_pool, layer, handle_id, scale, q_sink))
    if q_sink is not None:
        raise SpecError(
            "attend_in_graph: expected no q_sink with fp8_query=True (relative-sinks forwards take the 16-bit "
            "query: ForwardContext._fp8_query is False for them), got a tensor"
        )
    q8, q_scale = quantize_query(fold_softmax_scale(q, scale))
    op = ops.paged_attention_fp8_lse if return_lse else ops.paged_attention_fp8
    return cast(_Attended, op(q8, q_scale, kv_pool, layer, handle_id, q.dtype))


def _check_fp8_query(plan: AttentionPlan, q8: torch.Tensor, q_scale: torch.Tensor) -> None:
    """Host checks before an FP8 query reaches ``plan`` (no device sync: metadata only)."""
    if not plan.takes_fp8_query:
        raise SpecError(
            f"paged_attention_fp8: expected a plan whose kernel takes an FP8 query (FA3 over an FP8 pool, "
            f"ForwardContext._fp8_query), got {plan!r}"
        )
    if q8.dtype != torch.float8_e4m3fn or q8.dim() != 3:
        raise TensorMismatchError(
            f"paged_attention_fp8 q8: expected a float8_e4m3fn [tokens, heads, head_dim] tensor, got "
            f"{q8.dtype} of shape {tuple(q8.shape)}"
        )
    if q_scale.dtype != torch.float32 or tuple(q_scale.shape) != (q8.shape[1],) or q_scale.device != q8.device:
        raise TensorMismatchError(
            f"paged_attention_fp8 q_scale: expected float32 of shape ({q8.shape[1]},) on {q8.device} (one scale "
            f"per query head), got {q_scale.dtype} of shape {tuple(q_scale.shape)} on {q_scale.device}"
        )


@torch.library.custom_op("ardiff_modules::paged_attention_fp8", mutates_args=())
def paged_attention_fp8_op(
    q8: torch.Tensor,
    q_scale: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: torch.Tensor,
    handle_id: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """:func:`paged_attention_op` with the query quantized already: ``q8`` float8_e4m3fn ``[tokens, heads,
    head_dim]`` and ``q_scale`` float32 ``[heads]`` (``q8 * q_scale`` is the query, any custom softmax scale
    folded in: the kernel applies ``head_dim ** -0.5``); returns ``[tokens, heads, head_dim_v]`` in
    ``out_dtype`` (the compute dtype). Only for plans that take an FP8 query (``ForwardContext._fp8_query``)."""
    plan, index, k_cache, v_cache = _resolve(kv_pool, layer, handle_id)
    _check_fp8_query(plan, q8, q_scale)
    return cast(torch.Tensor, plan.attend(q8, k_cache, v_cache, q8.shape[-1] ** -0.5, layer=index, q_scale=q_scale))


@paged_attention_fp8_op.register_fake
def _paged_attention_fp8_fake(q8, q_scale, kv_pool, layer, handle_id, out_dtype):  # noqa: ANN001, ANN202
    return q8.new_empty((q8.shape[0], q8.shape[1], kv_pool.shape[-1]), dtype=out_dtype)


@torch.library.custom_op("ardiff_modules::paged_attention_fp8_lse", mutates_args=())
def paged_attention_fp8_lse_op(
    q8: torch.Tensor,
    q_scale: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: torch.Tensor,
    handle_id: torch.Tensor,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`paged_attention_fp8_op` that also returns the float32 ``[tokens, heads]`` natural-log LSE."""
    plan, index, k_cache, v_cache = _resolve(kv_pool, layer, handle_id)
    _check_fp8_query(plan, q8, q_scale)
    return cast(
        "tuple[torch.Tensor, torch.Tensor]",
        plan.attend(q8, k_cache, v_cache, q8.shape[-1] ** -0.5, return_lse=True, layer=index, q_scale=q_scale),
    )


@paged_attention_fp8_lse_op.register_fake
def _paged_attention_fp8_lse_fake(q8, q_scale, kv_pool, layer, handle_id, out_dtype):  # noqa: ANN001, ANN202
    return (
        q8.new_empty((q8.shape[0], q8.shape[1], kv_pool.shape[-1]), dtype=out_dtype),
        q8.new_empty((q8.shape[0], q8.shape[1]), dtype=torch.float32),
    )
