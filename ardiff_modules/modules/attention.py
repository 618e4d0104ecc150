"""Drop-in attention layers for streaming autoregressive video DiTs."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from ardiff_modules.context import LayerContext
from ardiff_modules.errors import TensorMismatchError
from ardiff_modules.modules.functional import Rope, apply_rope, cached_cross_attention, chunk_attention

if TYPE_CHECKING:
    from ardiff_modules.state import KVState

QKNorm = Literal["full", "head"] | None


def _qk_norm(kind: QKNorm, num_heads: int, head_dim: int, eps: float) -> nn.Module:
    """The RMSNorm of Q or K: over all heads (``"full"``, Wan) or per head (``"head"``, SD3 / Qwen)."""
    if kind is None:
        return nn.Identity()
    if kind == "full":
        return nn.RMSNorm(num_heads * head_dim, eps=eps)
    if kind == "head":
        return nn.RMSNorm(head_dim, eps=eps)
    raise ValueError(f"qk_norm: expected None, 'full' or 'head', got {kind!r}")


def _split_heads(t: torch.Tensor, heads: int, head_dim: int, kind: QKNorm, norm: nn.Module) -> torch.Tensor:
    """``[..., heads * head_dim]`` -> ``[..., heads, head_dim]``, normalised before or after the split."""
    if kind == "full":
        t = norm(t)
    t = t.view(*t.shape[:-1], heads, head_dim)
    if kind == "head":
        t = norm(t)
    return t


class ChunkSelfAttention(nn.Module):
    """Self-attention over the current chunk(s) and the cached sink + window history.

    Projects Q/K/V, optionally RMS-normalises Q and K, applies the RoPE hook at
    the tokens' absolute positions (``kv.positions``), writes K/V into the
    pending pages and attends per the visibility rule, then projects out.

    Parameters
    ----------
    dim:
        Model width.
    num_heads:
        Query heads.
    num_kv_heads:
        K/V heads (GQA when fewer than ``num_heads``); default ``num_heads``.
    head_dim:
        Default ``dim // num_heads``.
    qk_norm:
        ``None``, ``"full"`` (RMSNorm over ``heads * head_dim``, as Wan) or ``"head"``.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        qk_norm: QKNorm = None,
        bias: bool = True,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.head_dim = head_dim or dim // num_heads
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads: expected a multiple of num_kv_heads={self.num_kv_heads}, got {num_heads}")
        self.qk_norm = qk_norm
        self.to_q = nn.Linear(dim, num_heads * self.head_dim, bias=bias)
        self.to_k = nn.Linear(dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.to_v = nn.Linear(dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.to_out = nn.Linear(num_heads * self.head_dim, dim, bias=bias)
        self.norm_q = _qk_norm(qk_norm, num_heads, self.head_dim, eps)
        self.norm_k = _qk_norm(qk_norm, self.num_kv_heads, self.head_dim, eps)

    def _split(self, t: torch.Tensor, heads: int, norm: nn.Module) -> torch.Tensor:
        return _split_heads(t, heads, self.head_dim, self.qk_norm, norm)

    def forward(self, x: torch.Tensor, kv: LayerContext, rope: Rope | None = None) -> torch.Tensor:
        """``x`` ``[streams, seq_len, dim]`` -> ``[streams, seq_len, dim]``."""
        if x.dim() != 3:
            raise TensorMismatchError(f"ChunkSelfAttention x: expected [streams, seq_len, dim], got {tuple(x.shape)}")
        q = self._split(self.to_q(x), self.num_heads, self.norm_q)
        k = self._split(self.to_k(x), self.num_kv_heads, self.norm_k)
        v = self.to_v(x).view(x.shape[0], x.shape[1], self.num_kv_heads, self.head_dim)
        positions = kv.forward.positions
        q, k = apply_rope(q, positions, rope), apply_rope(k, positions, rope)
        out = chunk_attention(q, k, v, kv)
        return self.to_out(out.reshape(x.shape[0], x.shape[1], -1))


class CachedCrossAttention(nn.Module):
    """Cross-attention to a named per-session cache (e.g. ``"text"``) of projected K/V.

    The context is projected once per prompt with :meth:`project_kv` and published for all
    layers with :func:`populate_cross_attention`; every forward reads it from the layer context.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        cache_name: str = "text",
        *,
        context_dim: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        qk_norm: QKNorm = None,
        bias: bool = True,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.cache_name = cache_name
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.head_dim = head_dim or dim // num_heads
        self.qk_norm = qk_norm
        context_dim = context_dim or dim
        self.to_q = nn.Linear(dim, num_heads * self.head_dim, bias=bias)
        self.to_k = nn.Linear(context_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.to_v = nn.Linear(context_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.to_out = nn.Linear(num_heads * self.head_dim, dim, bias=bias)
        self.norm_q = _qk_norm(qk_norm, num_heads, self.head_dim, eps)
        self.norm_k = _qk_norm(qk_norm, self.num_kv_heads, self.head_dim, eps)

    def project_kv(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``context`` ``[tokens, context_dim]`` -> ``(k, v)`` each ``[tokens, num_kv_heads, head_dim]``."""
        if context.dim() != 2:
            raise TensorMismatchError(
                f"CachedCrossAttention.project_kv context: expected [tokens, context_dim], got {tuple(context.shape)}"
            )
        k = _split_heads(self.to_k(context), self.num_kv_heads, self.head_dim, self.qk_norm, self.norm_k)
        v = self.to_v(context).view(context.shape[0], self.num_kv_heads, self.head_dim)
        return k, v

    def forward(self, x: torch.Tensor, kv: LayerContext) -> torch.Tensor:
        """``x`` ``[streams, seq_len, dim]`` -> ``[streams, seq_len, dim]``."""
        s, n, _ = x.shape
        q = _split_heads(self.to_q(x), self.num_heads, self.head_dim, self.qk_norm, self.norm_q)
        out = cached_cross_attention(q, kv, self.cache_name)
        return self.to_out(out.reshape(s, n, -1))


def populate_cross_attention(
    state: KVState,
    kv_branch: str,
    layers: Iterable[CachedCrossAttention],
    context: torch.Tensor,
    cache_name: str | None = None,
) -> None:
    """Project ``context`` (``[tokens, context_dim]``) through every layer and publish atomically.

    Layers are projected lazily, in order, as ``state.populate_cross_attention`` consumes them, so a
    failure part-way (e.g. out of memory) leaves the previous cache visible.
    """
    layers = list(layers)
    name = cache_name or layers[0].cache_name

    def projections() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        with torch.no_grad():
            for layer in layers:
                yield layer.project_kv(context)

    state.populate_cross_attention(kv_branch, name, projections())
