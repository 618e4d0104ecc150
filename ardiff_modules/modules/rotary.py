"""Rotary position embeddings evaluated at the absolute positions a forward context carries.

Keys are cached already rotated, so RoPE must use *absolute* token positions:
``kv.positions`` (``[streams, seq_len]``) counts every token a branch ever
committed, evicted ones included. These modules are RoPE hooks for
:class:`~ardiff_modules.ChunkSelfAttention`: ``rope(t, positions) -> t``.
"""

from __future__ import annotations

import torch
from torch import nn

from ardiff_modules.modules.functional import rotate_half


def _inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


class RotaryEmbedding(nn.Module):
    """1-D RoPE over the token position (rotate-half convention).

    ``forward(t [streams, seq, heads, head_dim], positions [streams, seq]) -> t``.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RotaryEmbedding.head_dim: expected an even number, got {head_dim}")
        self.register_buffer("inv_freq", _inv_freq(head_dim, theta).float(), persistent=False)

    def forward(self, t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        angles = positions.to(self.inv_freq.dtype)[..., None] * self.inv_freq  # [S, n, D/2]
        angles = torch.cat((angles, angles), dim=-1)[:, :, None, :]  # [S, n, 1, D]
        tf = t.float()
        return (tf * angles.cos() + rotate_half(tf) * angles.sin()).to(t.dtype)


class VideoRotaryEmbedding(nn.Module):
    """3-D RoPE over (frame, row, column) of latent video tokens, as in Wan2.1.

    A token's absolute position ``p`` is mapped to frame ``p // (height * width)``
    and ``(row, col)`` inside the frame, so frames keep their absolute index across
    window eviction. The head dim is split between the axes like Wan
    (``d - 4 * (d // 6)`` for time, ``2 * (d // 6)`` each for height and width).

    ``forward(t [streams, seq, heads, head_dim], positions [streams, seq]) -> t``.
    """

    def __init__(self, head_dim: int, height: int, width: int, theta: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"VideoRotaryEmbedding.head_dim: expected an even number, got {head_dim}")
        self.height, self.width = height, width
        axis = 2 * (head_dim // 6)
        self.dims = (head_dim - 2 * axis, axis, axis)
        freqs = [_inv_freq(d, theta).float() for d in self.dims]
        self.register_buffer("inv_freq_t", freqs[0], persistent=False)
        self.register_buffer("inv_freq_h", freqs[1], persistent=False)
        self.register_buffer("inv_freq_w", freqs[2], persistent=False)

    def forward(self, t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        per_frame = self.height * self.width
        frame = torch.div(positions, per_frame, rounding_mode="floor")
        inner = positions - frame * per_frame
        row = torch.div(inner, self.width, rounding_mode="floor")
        col = inner - row * self.width
        angles = torch.cat(
            (
                frame.float()[..., None] * self.inv_freq_t,
                row.float()[..., None] * self.inv_freq_h,
                col.float()[..., None] * self.inv_freq_w,
            ),
            dim=-1,
        )  # [S, n, D/2]
        angles = torch.cat((angles, angles), dim=-1)[:, :, None, :]
        tf = t.float()
        return (tf * angles.cos() + rotate_half(tf) * angles.sin()).to(t.dtype)
