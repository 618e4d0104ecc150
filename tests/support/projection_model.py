"""The toy model of the frame and selection pair tests (``tests/heads/test_frame_pairs.py``,
``test_selected_pairs.py``): per layer, q/k/v are linear projections of a chunk's latents plus a per-prompt bias,
no mixing across layers -- so an oracle can recompute any chunk's K/V of any layer from its latents alone."""

from __future__ import annotations

import torch


class ProjectionModel:
    """``layers`` x (q, k, v) projections ``[dim, kv_heads * head_dim]`` drawn from ``seed``; biases per prompt id,
    drawn on first use (in the order prompts are first asked for)."""

    def __init__(self, layers: int, dim: int, kv_heads: int, head_dim: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.shape = (layers, kv_heads, head_dim)
        self.w = torch.randn(layers, 3, dim, kv_heads * head_dim, generator=g)
        self.bias: dict[int, torch.Tensor] = {}
        self.g = g

    def qkv(self, x: torch.Tensor, layer: int, prompt: int) -> list[torch.Tensor]:
        """``x`` ``[tokens, dim]`` -> ``[q, k, v]``, each ``[tokens, kv_heads, head_dim]``, under prompt ``prompt``."""
        layers, kv_heads, head_dim = self.shape
        if prompt not in self.bias:
            self.bias[prompt] = torch.randn(layers, 3, kv_heads * head_dim, generator=self.g)
        b = self.bias[prompt]
        return [(x @ self.w[layer, i] + b[layer, i]).unflatten(-1, (kv_heads, head_dim)) for i in range(3)]
