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
from collections.abc import Callable
from typing import Any, Protocol, TypeAlias, TypeVar, cast

import torch
from torch import _C

from ardiff_modules.backends.base import AttentionPlan, fold_softmax_scale
from ardiff_modules.errors import PlanNotFoundError, SpecError, TensorMismatchError
from ardiff_modules.quant import is_quantized, quantize, quantize_query


def _private_hook(owner: object, name: str) -> Any:
    """``owner.name``, or ``None`` where this torch lacks it (private torch API: the direct calls below need it)."""
    return getattr(owner, name, None)


# NOTE: the direct eager call (chunk_attention_eager) reads torch's dispatch state through private hooks; a torch
# without any of them (they moved between releases before) sends every call through the dispatcher instead.
_get_eval_frame_callback = _private_hook(_private_hook(_private_hook(_C, "_dynamo"), "eval_frame"),
                                         "get_eval_frame_callback")
_DIRECT_CALL_HOOKS = (
    _get_eval_frame_callback,
    _private_hook(_C, "_is_torch_function_mode_enabled"), _private_hook(_C, "_len_torch_dispatch_stack"),
    _private_hook(_private_hook(_C, "_functorch"), "peek_interpreter_stack"), _private_hook(_C, "_any_requires_grad"),
    _private_hook(_C, "_AutoDispatchBelowAutograd"), _private_hook(_private_hook(_C, "_autograd"), "_profiler_enabled"),
)
_DIRECT_CALLS = all(hook is not None for hook in _DIRECT_CALL_HOOKS)


class PlanHolder(Protocol):
    """Anything registered in :data:`HANDLES`: it exposes the current plan of its forward."""

    _plan: AttentionPlan | None

    def _check_usable(self, what: str = ...) -> None:
        """Raise unless the forward is open (a finished forward must not touch the pool)."""

    def _record_write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer ``layer`` is about to write ``k``/``v`` into the open forward's pending pages."""


class HandleTable:
    """Maps plan handles to their holders (weakly: a dropped forward frees its entry).

    NOTE: the ops look a handle up once per layer call, so a lookup takes no lock: it is one read of a plain
    dict (atomic in CPython) and one weak reference call. Register / unregister / snapshot keep the lock (they
    also run from several threads); a holder's weak reference removes its own entry when it dies (a dict
    ``pop``, atomic too: a weakref callback must not take the lock, as it may run inside a locked block's GC).
    Handles are never reused, so a late callback can only remove its own entry.
    """

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref[PlanHolder]] = {}
        self._ids = itertools.count(1)
        # Caches in several threads register and drop contexts concurrently.
        self._lock = threading.Lock()

    def register(self, holder: PlanHolder) -> int:
        with self._lock:
            handle = next(self._ids)
            self._refs[handle] = weakref.ref(holder, _forget(self._refs, handle))
        return handle

    def unregister(self, handle: int) -> None:
        with self._lock:
            self._refs.pop(handle, None)

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
        ref = self._refs.get(handle)  # no lock: see the class NOTE
        holder = ref() if ref is not None else None
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
            refs = list(self._refs.values())
        return [holder for holder in (ref() for ref in refs) if holder is not None]

    def __len__(self) -> int:
        return len(self.holders())


# ---------------------------------------------------------------------------------------------------
# The compiled path's ops that mutate nothing: registered through the low-level Library API.

#: Holds the registrations of :func:`_graph_op` (they live as long as this library object).
_LIB = torch.library.Library("ardiff_modules", "FRAGMENT")

_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def _graph_op(schema: str) -> Callable[[_Fn], _Fn]:
    """Register the decorated function as ``ardiff_modules::<schema>``, an op that mutates nothing; the fake
    impl is registered apart (``torch.library.register_fake(..., lib=_LIB)``).

    NOTE: not ``torch.library.custom_op``, whose autograd and backend kernels are Python wrappers around the
    function (an autograd redispatch, a ``torch._disable_dynamo`` frame, an aliasing check): that machinery
    cost more host time per layer call than the plan's own Python (``benchmarks/op_host_time.py``). Here the
    function is the op's one kernel (``CompositeExplicitAutograd``, as custom_op registers it), with the same
    schema and tag (``pt2_compliant_tag``) and the same fake impl, so graphs see the same op. What differs,
    for ops that mutate nothing: autograd is torch's C++ fallback (these ops never see an input that requires
    grad: ``chunk_attention`` sends those to ``attend_with_grad``; an op called so anyway warns at backward
    instead of raising), and dynamo is kept out of the kernel only where a frame hook is set (compiled graphs
    run with it off, so that costs one C call), by the same ``torch._disable_dynamo`` custom_op uses.
    """
    name = schema.split("(", 1)[0]

    def register(fn: _Fn) -> _Fn:
        _LIB.define(schema, tags=(torch.Tag.pt2_compliant_tag,))
        undynamo = torch._disable_dynamo(fn)
        hook = _get_eval_frame_callback
        if hook is None:  # (a torch without the hook: always keep dynamo out)
            _LIB.impl(name, undynamo, "CompositeExplicitAutograd")
            return fn

        def kernel(*args: Any, **kwargs: Any) -> Any:
            if hook() is None:
                return fn(*args, **kwargs)
            return undynamo(*args, **kwargs)

        _LIB.impl(name, kernel, "CompositeExplicitAutograd")
        return fn

    return register


def _forget(refs: dict[int, weakref.ref[PlanHolder]], handle: int) -> Callable[[weakref.ref[PlanHolder]], None]:
    """The callback of ``handle``'s weak reference: drop its entry (no lock: see :class:`HandleTable`)."""

    def forget(_: weakref.ref[PlanHolder]) -> None:
        refs.pop(handle, None)

    return forget


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
    return cast(torch.Tensor, _write_and_attend(q, k, v, kv_pool, layer, handle_id, scale, q_sink, False))


def _write_and_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_pool: torch.Tensor, layer: torch.Tensor,
    handle_id: torch.Tensor, scale: float, q_sink: torch.Tensor | None, return_lse: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The body of :func:`chunk_attention_op` (``return_lse=False``) and :func:`chunk_attention_lse_op`."""
    plan, index, k_cache, v_cache = _resolve(kv_pool, layer, handle_id, (k, v))
    return plan.run(q, k, v, k_cache, v_cache, scale, return_lse=return_lse, layer=index, **_sink_query(plan, q_sink))


def chunk_attention_eager(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_pool: torch.Tensor, layer: torch.Tensor,
    handle_id: torch.Tensor, scale: float, q_sink: torch.Tensor | None = None, *, return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.ardiff_modules.chunk_attention[_lse](...)`` for eager callers, without the dispatcher where it
    would add nothing (``chunk_attention``'s eager path; the arguments and result are the op's).

    torch's custom-op machinery is Python: its autograd, ADInplaceOrView and backend kernels cost more host time
    per layer call than the plan's own Python (``benchmarks/op_host_time.py``). Where none of them can matter --
    no dynamo frame hook, no torch-function or dispatch mode (fake tensors, tracing, ``torch.device`` contexts),
    no functorch transform, plain tensors, no input that requires grad while grad is on -- the op's body runs
    here exactly as the op would run it: the pool's version counter bumped first (its ADInplaceOrView kernel, which
    inference mode leaves out), then the body below autograd (``_AutoDispatchBelowAutograd``, as its autograd
    kernel's no-grad path), under a ``record_function`` of the op's name while the profiler runs. Anything else
    calls the op.
    """
    if _dispatcher_needed(q, k, v, q_sink):
        op = torch.ops.ardiff_modules.chunk_attention_lse if return_lse else torch.ops.ardiff_modules.chunk_attention
        return cast(_Attended, op(q, k, v, kv_pool, layer, handle_id, scale, q_sink))
    if _C._autograd._profiler_enabled():
        name = "ardiff_modules::chunk_attention_lse" if return_lse else "ardiff_modules::chunk_attention"
        with torch.autograd.profiler.record_function(name):
            return _body(q, k, v, kv_pool, layer, handle_id, scale, q_sink, return_lse)
    return _body(q, k, v, kv_pool, layer, handle_id, scale, q_sink, return_lse)


def _body(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_pool: torch.Tensor, layer: torch.Tensor,
    handle_id: torch.Tensor, scale: float, q_sink: torch.Tensor | None, return_lse: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if not _C.is_inference_mode_enabled():  # (inference mode leaves ADInplaceOrView out: the op bumps nothing)
        torch.autograd.graph.increment_version(kv_pool)  # the op's ADInplaceOrView kernel: kv_pool is mutated
    with _C._AutoDispatchBelowAutograd():
        return _write_and_attend(q, k, v, kv_pool, layer, handle_id, scale, q_sink, return_lse)


def _dispatcher_needed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_sink: torch.Tensor | None) -> bool:
    """Whether an eager call must go through the dispatcher (see :func:`chunk_attention_eager`)."""
    plain = torch.Tensor
    return (
        not _DIRECT_CALLS  # (a torch without the hooks read here)
        or _get_eval_frame_callback() is not None  # inside a compiled region's eager code
        or _C._is_torch_function_mode_enabled()
        or _C._len_torch_dispatch_stack() > 0
        or _C._functorch.peek_interpreter_stack() is not None
        or type(q) is not plain or type(k) is not plain or type(v) is not plain
        or (q_sink is not None and type(q_sink) is not plain)
        or (_C.is_grad_enabled() and _C._any_requires_grad(q, k, v, q_sink))
    )


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
    result = _write_and_attend(q, k, v, kv_pool, layer, handle_id, scale, q_sink, True)
    return cast("tuple[torch.Tensor, torch.Tensor]", result)


@chunk_attention_lse_op.register_fake
def _chunk_attention_lse_fake(q, k, v, kv_pool, layer, handle_id, scale, q_sink=None):  # noqa: ANN001, ANN202
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2])), q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)


# ---------------------------------------------------------------------------------------------------
# Compiled path: K/V written by the graph that produces them, attention over the pool alone.


#: The write gates return each current token's slot plus ``layer << LAYER_SHIFT`` in one int64 tensor: the layer
#: index rides in the high bits, so one fresh tensor (one kernel) carries both (a pool never nears 2**32 slots).
LAYER_SHIFT = 32


def _gate_slots(plan: AttentionPlan, index: int) -> torch.Tensor:
    """``plan.write_slots + (index << LAYER_SHIFT)``: a fresh int64 ``[tokens]`` tensor on the pool's device.

    NOTE: fresh, never a tensor the library keeps: a custom op's output must not alias its inputs, and inductor
    may reuse (overwrite) the buffer an extern op returned once the graph is done with it -- the plan's slots
    (a fixed buffer in static plans) would be corrupted. One out-of-place add, where the two outputs of before
    (``slots.clone()`` and ``torch.full((1,), layer)``) were two kernels and two allocations per layer.
    """
    return plan.write_slots + (index << LAYER_SHIFT)


@torch.library.custom_op("ardiff_modules::kv_write_slots", mutates_args=("kv_scales",))
def kv_write_slots_op(
    k: torch.Tensor, v: torch.Tensor, kv_scales: torch.Tensor, layer: torch.Tensor, handle_id: torch.Tensor
) -> torch.Tensor:
    """The gate before a compiled graph writes ``k``/``v`` ``[tokens, kv_heads, head_dim]`` into an FP8 pool.

    Raises unless the forward is open (a finished forward must not write, and the write happens
    before the attention op would check), records the write on the forward (a commit needs every
    layer), calibrates an uncalibrated FP8 layer's scales
    (``kv_scales`` ``[layers, 2, kv_heads]``, mutated then), and returns, on the pool's device, the
    int64 ``[tokens]`` token slots (``page * page_size + offset``) of the current tokens plus
    ``layer << LAYER_SHIFT`` -- a fresh tensor, so the write depends on this op, and no CPU tensor
    enters the graph (inductor would copy it to the device each call, which a CUDA graph cannot
    capture). A 16-bit pool's graph calls :func:`kv_write_slots_plain_op` instead.
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
    return _gate_slots(plan, index)


@kv_write_slots_op.register_fake
def _kv_write_slots_fake(k, v, kv_scales, layer, handle_id):  # noqa: ANN001, ANN202
    return k.new_empty((k.shape[0],), dtype=torch.int64)


@_graph_op(
    "kv_write_slots_plain(Tensor k, Tensor v, Tensor layer, Tensor handle_id) -> Tensor"
)
def kv_write_slots_plain_op(
    k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor, handle_id: torch.Tensor
) -> torch.Tensor:
    """:func:`kv_write_slots_op` for a 16-bit pool: the same checks, record and slots, nothing mutated.

    A 16-bit pool has no scales to calibrate, so this gate mutates nothing: torch then runs no
    ADInplaceOrView kernel per call and the graph needs no functionalization wrapper around it. A plan
    with FP8 scales is refused before anything is recorded (its graph must calibrate: :func:`kv_write_slots_op`).
    """
    index = int(layer)
    holder = HANDLES.holder(int(handle_id))  # raises unless the forward is open
    plan = holder._plan
    assert plan is not None  # HANDLES.holder checked it
    if plan.quantizer is not None:
        raise SpecError(
            "kv_write_slots_plain: expected a plan over a 16-bit pool (no FP8 scales to calibrate), got one with "
            "FP8 scales; an FP8 pool's graph calls ardiff_modules::kv_write_slots (write_kv_in_graph picks it)"
        )
    holder._record_write(index, k, v)
    return _gate_slots(plan, index)


@torch.library.register_fake("ardiff_modules::kv_write_slots_plain", lib=_LIB)
def _kv_write_slots_plain_fake(k, v, layer, handle_id):  # noqa: ANN001, ANN202
    return k.new_empty((k.shape[0],), dtype=torch.int64)


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
    The gate op is :func:`kv_write_slots_plain_op` for a 16-bit pool, :func:`kv_write_slots_op` (which
    calibrates the scales) for an FP8 one; its output's high bits are the layer index (:data:`LAYER_SHIFT`),
    split off here in traced integer math that inductor fuses into the write.

    NOTE: the ``index_put_`` indexes the pool tensor itself with (layer, K|V, page, offset). Writing
    through a view of it (``pool.view(-1, heads, dim)[slots]``) makes functionalization rebuild the
    base from the view, and inductor then clones and copies back the *whole pool* each call;
    ``tests/compile/test_compile_write.py`` checks the generated code for that.
    """
    ops = torch.ops.ardiff_modules
    quantized = is_quantized(kv_pool.dtype)
    if quantized:
        gate = ops.kv_write_slots(k, v, kv_scales, layer, handle_id)
    else:
        gate = ops.kv_write_slots_plain(k, v, layer, handle_id)
    layer_index = gate[:1] // (1 << LAYER_SHIFT)  # [1]: broadcast against the per-token indices below
    slots = gate % (1 << LAYER_SHIFT)
    page_size = kv_pool.shape[3]
    pages, offsets = slots // page_size, slots % page_size
    if quantized:
        k_scale, v_scale = kv_scales[layer_index][0]
        k = quantize(k, k_scale, kv_pool.dtype)
        v = quantize(v, v_scale, kv_pool.dtype)
    else:
        k, v = k.to(kv_pool.dtype), v.to(kv_pool.dtype)
    kv_pool.index_put_((layer_index, torch.zeros_like(slots), pages, offsets), k)
    kv_pool.index_put_((layer_index, torch.ones_like(slots), pages, offsets), v)


@_graph_op(
    "paged_attention(Tensor q, Tensor kv_pool, Tensor layer, Tensor handle_id, float scale, "
    "Tensor? q_sink=None) -> Tensor"
)
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


@torch.library.register_fake("ardiff_modules::paged_attention", lib=_LIB)
def _paged_attention_fake(q, kv_pool, layer, handle_id, scale, q_sink=None):  # noqa: ANN001, ANN202
    return q.new_empty((q.shape[0], q.shape[1], kv_pool.shape[-1]))


@_graph_op(
    "paged_attention_lse(Tensor q, Tensor kv_pool, Tensor layer, Tensor handle_id, float scale, "
    "Tensor? q_sink=None) -> (Tensor, Tensor)"
)
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


@torch.library.register_fake("ardiff_modules::paged_attention_lse", lib=_LIB)
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


@_graph_op(
    "paged_attention_fp8(Tensor q8, Tensor q_scale, Tensor kv_pool, Tensor layer, Tensor handle_id, "
    "ScalarType out_dtype) -> Tensor"
)
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


@torch.library.register_fake("ardiff_modules::paged_attention_fp8", lib=_LIB)
def _paged_attention_fp8_fake(q8, q_scale, kv_pool, layer, handle_id, out_dtype):  # noqa: ANN001, ANN202
    return q8.new_empty((q8.shape[0], q8.shape[1], kv_pool.shape[-1]), dtype=out_dtype)


@_graph_op(
    "paged_attention_fp8_lse(Tensor q8, Tensor q_scale, Tensor kv_pool, Tensor layer, Tensor handle_id, "
    "ScalarType out_dtype) -> (Tensor, Tensor)"
)
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


@torch.library.register_fake("ardiff_modules::paged_attention_fp8_lse", lib=_LIB)
def _paged_attention_fp8_lse_fake(q8, q_scale, kv_pool, layer, handle_id, out_dtype):  # noqa: ANN001, ANN202
    return (
        q8.new_empty((q8.shape[0], q8.shape[1], kv_pool.shape[-1]), dtype=out_dtype),
        q8.new_empty((q8.shape[0], q8.shape[1]), dtype=torch.float32),
    )
