"""Functional entry points for models that keep their own projections."""

from __future__ import annotations

from collections.abc import Callable
from typing import Union

import torch
import torch.nn.functional as F

from ardiff_modules.context import LayerContext
from ardiff_modules.errors import TensorMismatchError

#: A RoPE hook: ``(t [streams, seq, heads, dim], positions [streams, seq]) -> t`` or a ``(cos, sin)`` pair.
Rope = Union[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dim (the GPT-NeoX / Llama convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(t: torch.Tensor, positions: torch.Tensor, rope: Rope | None) -> torch.Tensor:
    """Rotate ``t`` (``[streams, seq, heads, dim]``) by ``rope``.

    ``rope`` is either a callable ``(t, positions) -> t`` or a ``(cos, sin)`` pair broadcastable
    to ``[streams, seq, 1, dim]`` applied as ``t * cos + rotate_half(t) * sin``.
    """
    if rope is None:
        return t
    if callable(rope):
        return rope(t, positions)
    cos, sin = rope
    return (t.float() * cos + rotate_half(t.float()) * sin).to(t.dtype)


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...], like: torch.Tensor) -> None:
    if tuple(t.shape) != shape:
        raise TensorMismatchError(f"chunk_attention {name}: expected shape {shape}, got {tuple(t.shape)}")
    if t.dtype != like.dtype:
        raise TensorMismatchError(f"chunk_attention {name}: expected dtype {like.dtype} (the KV pool's), got {t.dtype}")
    if t.device != like.device:
        raise TensorMismatchError(f"chunk_attention {name}: expected device {like.device}, got {t.device}")


def chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: LayerContext,
    *,
    scale: float | None = None,
) -> torch.Tensor:
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

    Returns
    -------
    ``[streams, seq_len, num_heads, head_dim]``.
    """
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
    _check("q", q, tuple(q.shape), pages)
    _check("k", k, (streams, seq_len, kv_heads, head_dim), pages)
    _check("v", v, (streams, seq_len, kv_heads, head_dim), pages)
    tokens = streams * seq_len
    out = torch.ops.ardiff_modules.chunk_attention(
        q.reshape(tokens, q.shape[2], head_dim),
        k.reshape(tokens, kv_heads, head_dim),
        v.reshape(tokens, kv_heads, head_dim),
        kv.kv_pool,
        kv.layer_id,
        kv.forward.plan_id,
        float(scale if scale is not None else head_dim**-0.5),
    )
    return out.view(streams, seq_len, q.shape[2], head_dim)


def cached_cross_attention(
    q: torch.Tensor, kv: LayerContext, cache_name: str, *, scale: float | None = None
) -> torch.Tensor:
    """Attend ``q`` (``[streams, seq_len, num_heads, head_dim]``) to the named cross cache of each stream.

    Returns ``[streams, seq_len, num_heads, head_dim]``.
    """
    k, v = kv.cross_kv(cache_name)  # [streams, tokens, kv_heads, head_dim]
    if q.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise TensorMismatchError(
            f"cached_cross_attention q: expected shape ({k.shape[0]}, seq_len, a multiple of {k.shape[2]} heads, "
            f"{k.shape[3]}), got {tuple(q.shape)}"
        )
    if q.dtype != k.dtype or q.device != k.device:
        raise TensorMismatchError(
            f"cached_cross_attention q: expected dtype {k.dtype} on {k.device}, got {q.dtype} on {q.device}"
        )
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale, enable_gqa=q.shape[2] != k.shape[2]
    )
    return out.transpose(1, 2)
