"""A tiny streaming DiT built from the library's modules, for the diagnostics that need a small model.

``compile_vs_eager`` (compiled vs eager rollouts) and ``nccl_graph_probe`` (its ``library`` stage) use
it. The same model as ``tests/streaming_model.py``'s ``TinyStreamingModel`` (the same modules created in
the same order, so a seed gives the same weights), kept here so that no benchmark imports from ``tests/``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ardiff_modules import CachedCrossAttention, ChunkSelfAttention, CrossAttentionSpec, KVCacheSpec
from ardiff_modules.modules.rotary import RotaryEmbedding

TEXT = "text"  #: the cross-attention cache's name


class TinyBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, context_dim: int, qk_norm: str | None) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = ChunkSelfAttention(dim, heads, num_kv_heads=kv_heads, qk_norm=qk_norm)
        self.norm2 = nn.LayerNorm(dim)
        self.cross = CachedCrossAttention(dim, heads, TEXT, context_dim=context_dim, num_kv_heads=kv_heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor, kv: Any, rope: Any) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), kv, rope)
        x = x + self.cross(self.norm2(x), kv)
        return x + self.mlp(x)


class TinyStreamingModel(nn.Module):
    """``layers`` blocks of self-attention (paged KV cache), cross-attention to a ``"text"`` cache and an MLP."""

    def __init__(
        self, dim: int = 32, heads: int = 4, kv_heads: int = 4, layers: int = 3, context_dim: int = 24,
        qk_norm: str | None = "head",
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TinyBlock(dim, heads, kv_heads, context_dim, qk_norm) for _ in range(layers))
        self.rope = RotaryEmbedding(dim // heads)
        self.dim, self.heads, self.kv_heads, self.context_dim = dim, heads, kv_heads, context_dim

    def forward(self, x: torch.Tensor, layers: Any) -> torch.Tensor:
        for block, kv in zip(self.blocks, layers):
            x = block(x, kv, self.rope)
        return x

    def spec(self, chunk_size: int, page_size: int, sink: int, window: int,
             branches: tuple[str, ...] = ("cond", "uncond"), text_tokens: int = 5) -> KVCacheSpec:
        """A float32 cache spec for this model (one ``"text"`` cross-attention cache of ``text_tokens``)."""
        return KVCacheSpec(
            num_layers=len(self.blocks), num_kv_heads=self.kv_heads, head_dim=self.dim // self.heads,
            chunk_size=chunk_size, page_size=page_size, sink_chunks=sink, window_chunks=window,
            branches=branches, cross_attention=(CrossAttentionSpec(TEXT, text_tokens),), dtype="float32",
        )
