"""Rotary position embeddings evaluated at the absolute positions a forward context carries.

Keys are cached already rotated, so RoPE must use *absolute* token positions:
``kv.positions`` (``[streams, seq_len]``) counts every token a branch ever
committed, evicted ones included. These modules are RoPE hooks for
:class:`~ardiff_modules.ChunkSelfAttention`: ``rope(t, positions) -> t``.
"""

from __future__ import annotations

import torch
from torch import nn

from ardiff_modules.errors import SpecError, TensorMismatchError
from ardiff_modules.modules.functional import rotate
from ardiff_modules.spec import _require_int, _require_positive_float


def _inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def _require_even_head_dim(owner: str, head_dim: int, minimum: int, why: str = "") -> None:
    expected = f"an even int >= {minimum}{why}"
    try:
        _require_int(owner, "head_dim", head_dim, minimum=minimum)
    except SpecError:  # one message for every bad head_dim, naming the evenness too
        got = f"{head_dim!r} ({type(head_dim).__name__})"
        raise SpecError(f"{owner}.head_dim: expected {expected}, got {got}") from None
    if head_dim % 2:  # rotate-half pairs dim i with dim i + head_dim / 2
        raise SpecError(f"{owner}.head_dim: expected {expected}, got {head_dim}")


def _check_inputs(owner: str, t: torch.Tensor, positions: torch.Tensor, head_dim: int, freq: torch.Tensor) -> None:
    """``t`` ``[streams, seq, heads, head_dim]`` and ``positions`` ``[streams, seq]`` on the buffers' device."""
    if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[-1] != head_dim:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise TensorMismatchError(f"{owner} t: expected shape (streams, seq_len, heads, {head_dim}), got {got}")
    if not isinstance(positions, torch.Tensor) or positions.shape != t.shape[:2]:
        got = tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise TensorMismatchError(
            f"{owner} positions: expected shape {tuple(t.shape[:2])} (t's [streams, seq_len]), got {got}"
        )
    if t.device != freq.device or positions.device != freq.device:
        raise TensorMismatchError(
            f"{owner}: expected t and positions on the module's device {freq.device}, "
            f"got t on {t.device}, positions on {positions.device}"
        )


class RotaryEmbedding(nn.Module):
    """1-D RoPE over the token position (rotate-half convention).

    ``forward(t [streams, seq, heads, head_dim], positions [streams, seq]) -> t``.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        _require_even_head_dim("RotaryEmbedding", head_dim, 2)
        theta = _require_positive_float("RotaryEmbedding", "theta", theta)
        self.head_dim = head_dim
        self.register_buffer("inv_freq", _inv_freq(head_dim, theta).float(), persistent=False)

    def forward(self, t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        _check_inputs("RotaryEmbedding", t, positions, self.head_dim, self.inv_freq)
        angles = positions.to(self.inv_freq.dtype)[..., None] * self.inv_freq  # [S, n, D/2]
        angles = torch.cat((angles, angles), dim=-1)[:, :, None, :]  # [S, n, 1, D]
        return rotate(t, angles.cos(), angles.sin())


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
        # Below 6 the row and column axes would get 0 dims: silently no spatial rotation.
        _require_even_head_dim("VideoRotaryEmbedding", head_dim, 6, " (2 dims each for time, row and column)")
        _require_int("VideoRotaryEmbedding", "height", height, minimum=1)
        _require_int("VideoRotaryEmbedding", "width", width, minimum=1)
        theta = _require_positive_float("VideoRotaryEmbedding", "theta", theta)
        self.head_dim = head_dim
        self.height, self.width = height, width
        axis = 2 * (head_dim // 6)
        self.dims = (head_dim - 2 * axis, axis, axis)
        freqs = [_inv_freq(d, theta).float() for d in self.dims]
        self.register_buffer("inv_freq_t", freqs[0], persistent=False)
        self.register_buffer("inv_freq_h", freqs[1], persistent=False)
        self.register_buffer("inv_freq_w", freqs[2], persistent=False)

    def forward(self, t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        _check_inputs("VideoRotaryEmbedding", t, positions, self.head_dim, self.inv_freq_t)
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
        return rotate(t, angles.cos(), angles.sin())
