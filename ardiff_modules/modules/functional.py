"""Functional entry points for models that keep their own projections."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Union, cast, overload

import torch

from ardiff_modules.checks import compute_dtype_mismatch, require_positive_float
from ardiff_modules.context import LayerContext
from ardiff_modules.cross import cached_cross_attention  # noqa: F401  (re-exported: the functional forms)
from ardiff_modules.errors import SpecError, TensorMismatchError
from ardiff_modules.head_shares import merge_heads, take_heads
from ardiff_modules.ops import attend_in_graph, chunk_attention_eager, write_kv_in_graph
from ardiff_modules.training import attend_with_grad

#: A RoPE hook: ``(t [streams, seq, heads, dim], positions [streams, seq]) -> t`` or a ``(cos, sin)`` pair.
Rope = Union[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

#: Which channels RoPE rotates together. ``"interleaved"``: ``(2i, 2i + 1)``, the complex-number form of
#: Wan2.1, Self-Forcing, CausVid, LongLive and diffusers' ``WanRotaryPosEmbed`` / ``apply_rotary_emb``.
#: ``"half"``: ``(i, i + dim / 2)``, the rotate-half form of GPT-NeoX / Llama.
RopeLayout = Literal["interleaved", "half"]
ROPE_LAYOUTS: tuple[str, ...] = ("interleaved", "half")


def check_rope_layout(where: str, layout: Any) -> RopeLayout:
    """``layout`` is ``"interleaved"`` or ``"half"`` (:data:`RopeLayout`); ``where`` names the argument."""
    if not isinstance(layout, str) or layout not in ROPE_LAYOUTS:
        raise SpecError(f"{where}: expected 'interleaved' or 'half', got {layout!r}")
    return layout  # type: ignore[return-value]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dim (the ``"half"`` layout: GPT-NeoX / Llama)."""
    # An odd last dim would chunk unevenly and silently return a wrong rotation.
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] % 2:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise TensorMismatchError(f"rotate_half x: expected a tensor whose last dim is even, got {got}")
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    """``[x0, x1, x2, x3, ...] -> [-x1, x0, -x3, x2, ...]`` (the ``"interleaved"`` layout: ``i * z``)."""
    x0, x1 = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((-x1, x0), dim=-1).flatten(-2)


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: RopeLayout = "interleaved") -> torch.Tensor:
    """The one RoPE rotation of the package: ``t * cos + rot(t) * sin``, back to ``t``'s dtype.

    ``t`` ``[..., dim]``; ``cos`` / ``sin`` broadcastable to ``t``, full width ``dim`` in the order of
    ``layout``: ``"interleaved"`` repeats each pair's value twice (``[c0, c0, c1, c1, ...]``, as diffusers'
    ``repeat_interleave_real``) and rotates pairs ``(2i, 2i + 1)`` (the complex product ``z * e^{i angle}``
    of Wan's ``rope_apply``); ``"half"`` repeats the half-width values (``[c0, c1, ..., c0, c1, ...]``) and
    rotates ``(i, i + dim / 2)`` with :func:`rotate_half`. Computed in float32 (float64 for a float64
    ``t``) whatever the dtypes of ``t``, ``cos`` and ``sin``.
    """
    layout = check_rope_layout("rotate.layout", layout)
    if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[-1] % 2:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise TensorMismatchError(f"rotate t: expected a tensor whose last dim is even, got {got}")
    compute = torch.float64 if t.dtype == torch.float64 else torch.float32
    tf = t.to(compute)
    rotated = _rotate_interleaved(tf) if layout == "interleaved" else rotate_half(tf)
    return (tf * cos.to(compute) + rotated * sin.to(compute)).to(t.dtype)


def apply_rope(
    t: torch.Tensor, positions: torch.Tensor, rope: Rope | None, *, layout: RopeLayout = "interleaved"
) -> torch.Tensor:
    """Rotate ``t`` (``[streams, seq, heads, dim]``) by ``rope``.

    ``rope`` is either a callable ``(t, positions) -> t`` (e.g. a
    :class:`~ardiff_modules.modules.rotary.RotaryEmbedding`, which carries its own layout) or a
    ``(cos, sin)`` pair broadcastable to ``[streams, seq, 1, dim]``, applied by :func:`rotate` with
    ``layout`` (default ``"interleaved"``, Wan's / diffusers' pairs ``(2i, 2i + 1)``; ``"half"`` for
    GPT-NeoX's ``(i, i + dim / 2)``). ``layout`` is ignored for a callable.
    """
    layout = check_rope_layout("apply_rope.layout", layout)
    if rope is None:
        return t
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise TensorMismatchError(f"apply_rope t: expected shape (streams, seq_len, heads, head_dim), got {got}")
    if callable(rope):
        out = rope(t, positions)
        if not isinstance(out, torch.Tensor) or out.shape != t.shape:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise TensorMismatchError(
                f"apply_rope: expected the rope hook to return t's shape {tuple(t.shape)}, got {got}"
            )
        return out
    if not (
        isinstance(rope, (tuple, list))
        and len(rope) == 2
        and isinstance(rope[0], torch.Tensor)
        and isinstance(rope[1], torch.Tensor)
    ):
        raise SpecError(
            f"apply_rope.rope: expected None, a callable (t, positions) -> t or a (cos, sin) pair of tensors, "
            f"got {rope!r:.80} ({type(rope).__name__})"
        )
    cos, sin = rope
    if t.shape[-1] % 2:
        raise TensorMismatchError(f"apply_rope t: expected an even head_dim for a (cos, sin) pair, got {t.shape[-1]}")
    for label, r in (("cos", cos), ("sin", sin)):
        # Broadcasting must not grow t: every dim of r is 1 or t's (right-aligned).
        if r.dim() > t.dim() or any(a != 1 and a != b for a, b in zip(r.shape[::-1], t.shape[::-1])):
            raise TensorMismatchError(
                f"apply_rope {label}: expected a shape broadcastable to t's {tuple(t.shape)}, "
                f"e.g. (streams, seq_len, 1, {t.shape[-1]}), got {tuple(r.shape)}"
            )
        if r.device != t.device:
            raise TensorMismatchError(f"apply_rope {label}: expected device {t.device} (t's), got {r.device}")
    return rotate(t, cos, sin, layout)


def _check(
    name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
    dtype_of: str = "",
) -> None:
    """``t`` is a tensor of ``shape``, ``dtype`` and ``device``; ``dtype_of`` names whose dtype it must match
    (empty: the cache's compute dtype, whose message names the fix)."""
    if not isinstance(t, torch.Tensor):
        raise TensorMismatchError(f"chunk_attention {name}: expected a tensor of shape {shape}, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise TensorMismatchError(f"chunk_attention {name}: expected shape {shape}, got {tuple(t.shape)}")
    if t.dtype != dtype and dtype_of:
        raise TensorMismatchError(f"chunk_attention {name}: expected dtype {dtype} ({dtype_of}), got {t.dtype}")
    if t.dtype != dtype:
        raise TensorMismatchError(compute_dtype_mismatch(f"chunk_attention {name}", dtype, t.dtype))
    if t.device != device:
        raise TensorMismatchError(f"chunk_attention {name}: expected device {device}, got {t.device}")


def _check_chunk_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerContext) -> tuple[int, ...]:
    """Validate ``chunk_attention``'s tensors; return ``(streams, seq_len, kv_heads, head_dim)``."""
    if not hasattr(kv, "forward") or not hasattr(kv, "k_cache"):
        raise SpecError(
            f"chunk_attention.kv: expected a LayerContext (one entry of ForwardContext.layers), got {type(kv).__name__}"
        )
    if not isinstance(q, torch.Tensor):  # k and v: _check names their expected shapes
        raise TensorMismatchError(f"chunk_attention q: expected a tensor, got {type(q).__name__}")
    # Shapes come from tensors (guarded by shape), never from Python objects of the context,
    # so a compiled model does not specialise on a session or a chunk.
    streams, seq_len = kv.forward.positions.shape
    pages = kv.k_cache
    kv_heads, head_dim = pages.shape[-2], pages.shape[-1]
    if q.dim() != 4 or q.shape[0] != streams or q.shape[1] != seq_len or q.shape[3] != head_dim:
        raise TensorMismatchError(
            f"chunk_attention q: expected shape ({streams}, {seq_len}, num_heads, {head_dim}), got {tuple(q.shape)}"
        )
    if q.shape[2] % kv_heads != 0:
        raise TensorMismatchError(
            f"chunk_attention q: expected num_heads a multiple of num_kv_heads={kv_heads}, got {q.shape[2]}"
        )
    dtype = kv.forward.dtype  # the compute dtype (the pages may store another, e.g. a quantized kv_dtype)
    _check("q", q, tuple(q.shape), dtype, pages.device)
    _check("k", k, (streams, seq_len, kv_heads, head_dim), dtype, pages.device)
    _check("v", v, (streams, seq_len, kv_heads, head_dim), dtype, pages.device)
    return streams, seq_len, kv_heads, head_dim


def _check_sink_query(sink_query: torch.Tensor | None, q: torch.Tensor, kv: LayerContext) -> None:
    """A sink query exactly when the forward attends its sinks at relative positions, shaped like ``q``."""
    relative = kv.forward.relative_sinks
    if relative and sink_query is None:
        raise SpecError(
            "chunk_attention: expected sink_query (this cache attends its sinks at relative positions, "
            "KVCacheSpec.relative_sinks=True): pass q rotated at kv.sink_positions, got None"
        )
    if not relative and sink_query is not None:
        raise SpecError(
            "chunk_attention: expected no sink_query (KVCacheSpec.relative_sinks=False: sinks sit at their own "
            "positions), got a tensor"
        )
    if sink_query is not None:
        _check("sink_query", sink_query, tuple(q.shape), q.dtype, q.device, dtype_of="q's")


@overload
def chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: LayerContext,
    *,
    scale: float | None = ...,
    return_lse: Literal[False] = ...,
    sink_query: torch.Tensor | None = ...,
) -> torch.Tensor: ...


@overload
def chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: LayerContext,
    *,
    scale: float | None = ...,
    return_lse: Literal[True],
    sink_query: torch.Tensor | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: LayerContext,
    *,
    scale: float | None = ...,
    return_lse: bool,
    sink_query: torch.Tensor | None = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: LayerContext,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    sink_query: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Write this chunk's K/V into the pending pages and attend per the visibility rule.

    Parameters
    ----------
    q:
        ``[streams, seq_len, num_heads, head_dim]`` (already rotated if the model uses RoPE).
    k, v:
        ``[streams, seq_len, num_kv_heads, head_dim]``; ``num_heads`` must be a multiple of
        ``num_kv_heads`` (GQA).
    kv:
        This layer's :class:`~ardiff_modules.context.LayerContext`.
    scale:
        Softmax scale, default ``head_dim ** -0.5``.
    return_lse:
        Also return the float32 ``[streams, seq_len, num_heads]`` natural-log log-sum-exp of each
        query's scaled logits over its visible keys (``-inf`` where none is visible), for merging
        partial attentions.
    sink_query:
        Required when the cache attends its sinks at relative positions (``KVCacheSpec.relative_sinks``,
        ``kv.forward.relative_sinks``), refused otherwise: the same query rotated by RoPE at
        ``kv.sink_positions`` instead of ``kv.positions`` (``[streams, seq_len, num_heads, head_dim]``,
        like ``q``). The sink keys are attended with it, the other keys with ``q``, in one softmax. With
        retention groups ``kv.sink_positions`` may be per query head (``[streams, seq_len, num_heads]``: each
        lane's sinks move by its own shift); the heads of a lane without sink chunks ignore their part.

    Returns
    -------
    ``[streams, seq_len, num_heads, head_dim]`` (and the LSE with ``return_lse``).
    """
    if getattr(kv, "_shares", ()):  # (a wrong type is refused below, naming what it got)
        return _grouped_attention(q, k, v, kv, scale=scale, return_lse=return_lse, sink_query=sink_query)
    streams, seq_len, kv_heads, head_dim = _check_chunk_inputs(q, k, v, kv)
    _check_sink_query(sink_query, q, kv)
    scale = head_dim**-0.5 if scale is None else require_positive_float("chunk_attention.scale", scale, optional=True)
    tokens = streams * seq_len
    sink_grad = sink_query is not None and sink_query.requires_grad
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or sink_grad):
        # History is a constant, this forward's own K/V are live (the pool copy is written detached).
        return attend_with_grad(q, k, v, kv, scale=scale, sink_query=sink_query, return_lse=return_lse)
    q_rows = q.reshape(tokens, q.shape[2], head_dim)
    q_sink = None if sink_query is None else sink_query.reshape(tokens, q.shape[2], head_dim)
    k_rows, v_rows = k.reshape(tokens, kv_heads, head_dim), v.reshape(tokens, kv_heads, head_dim)
    if torch.compiler.is_compiling():
        # In a compiled graph the K/V write is plain torch, fused by inductor into the kernel that
        # computes K/V (no separate write pass); the op then only reads the pool.
        pool, scales, layer_id = kv._kv_pool, kv._kv_scales, kv._layer_id
        assert pool is not None and scales is not None and layer_id is not None  # set by the cache, every layer
        write_kv_in_graph(k_rows, v_rows, pool, scales, layer_id, kv.forward._handle_id)
        # FA3 over an FP8 pool: the query is quantized here too, fused with the norm / RoPE that produced it.
        result = attend_in_graph(
            q_rows, pool, layer_id, kv.forward._handle_id, scale, q_sink,
            fp8_query=kv.forward._fp8_query, return_lse=return_lse,
        )
    else:
        # The custom op ardiff_modules::chunk_attention[_lse], its body called directly where the dispatcher would
        # add nothing but host time (ops.chunk_attention_eager says when).
        result = chunk_attention_eager(
            q_rows, k_rows, v_rows, cast(torch.Tensor, kv._kv_pool), cast(torch.Tensor, kv._layer_id),
            kv.forward._handle_id, scale, q_sink, return_lse=return_lse,
        )
    out, lse = result if isinstance(result, tuple) else (result, None)  # a tuple exactly with return_lse
    out = out.view(streams, seq_len, q.shape[2], head_dim)
    if lse is None:
        return out
    return out, lse.view(streams, seq_len, q.shape[2])


def _check_grouped_sink_query(sink_query: torch.Tensor | None, q: torch.Tensor, kv: LayerContext) -> None:
    """With retention groups: a sink query exactly when the forward attends sinks at relative positions (required
    when a lane of this layer has sinks, accepted and ignored when none has), shaped like ``q``."""
    needed = any(share.context.forward.relative_sinks for share in kv._shares)
    if sink_query is None and needed:
        _check_sink_query(None, q, next(s.context for s in kv._shares if s.context.forward.relative_sinks))
    if sink_query is not None and not kv.forward.relative_sinks:
        _check_sink_query(sink_query, q, kv)  # (raises: the forward has no relative sinks)
    if sink_query is not None:
        _check("sink_query", sink_query, tuple(q.shape), q.dtype, q.device, dtype_of="q's")


def _grouped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: LayerContext,
    *,
    scale: float | None,
    return_lse: bool,
    sink_query: torch.Tensor | None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunk_attention` over a layer whose heads several lanes hold (retention groups): each lane attends
    its heads with its own write, plan and kernels.

    ``q [streams, n, heads, d]`` and ``k``/``v [streams, n, kv_heads, d]`` are split along the heads (views
    where a lane's heads are contiguous), each share runs the one-lane path (gradients included), and the
    outputs (and LSEs) are put back in head order.
    """
    heads, kv_heads = kv._heads
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or (q.shape[2], k.shape[2], v.shape[2]) != (heads, kv_heads, kv_heads):
        raise TensorMismatchError(
            f"chunk_attention: expected q [streams, seq_len, {heads}, head_dim] and k/v [streams, seq_len, "
            f"{kv_heads}, head_dim], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    _check_grouped_sink_query(sink_query, q, kv)
    outs: list[torch.Tensor] = []
    lses: list[torch.Tensor] = []
    for share in kv._shares:
        # (a lane without sink chunks has no sink segment: its heads' part of the sink query is not needed)
        relative = share.context.forward.relative_sinks
        sink = take_heads(sink_query, share.q_heads) if relative and sink_query is not None else None
        result = chunk_attention(
            take_heads(q, share.q_heads), take_heads(k, share.kv_heads), take_heads(v, share.kv_heads),
            share.context, scale=scale, return_lse=return_lse, sink_query=sink,
        )
        if return_lse:
            outs.append(result[0])
            lses.append(result[1])
        else:
            outs.append(result)  # type: ignore[arg-type]  # return_lse=False returns the tensor
    out = merge_heads(outs, kv._merge_order)
    return (out, merge_heads(lses, kv._merge_order)) if return_lse else out
