"""Wan2.1's RoPE written independently of the library, the way Wan2.1 / Self-Forcing write it.

``rope_params`` builds complex ``e^{i * pos * freq}`` tables in float64 with ``torch.polar`` and ``rope_apply``
multiplies ``view_as_complex(x.reshape(..., -1, 2))`` by them, the time axis offset by ``start_frame``
(Self-Forcing's ``causal_rope_apply``). The reference of the RoPE tests and of the converted Wan layers.
"""

from __future__ import annotations

import torch


def rope_params(max_seq_len: int, dim: int, theta: float = 10000.0) -> torch.Tensor:
    """Wan2.1's ``rope_params``: ``[max_seq_len, dim // 2]`` complex128 ``e^{i * pos * freq}``."""
    assert dim % 2 == 0
    freqs = torch.outer(
        torch.arange(max_seq_len), 1.0 / torch.pow(theta, torch.arange(0, dim, 2).to(torch.float64).div(dim))
    )
    return torch.polar(torch.ones_like(freqs), freqs)


def wan_freqs(head_dim: int, max_seq_len: int, theta: float = 10000.0) -> torch.Tensor:
    """``WanModel.freqs``: the time, height and width tables side by side."""
    d = head_dim
    return torch.cat(
        [
            rope_params(max_seq_len, d - 4 * (d // 6), theta),
            rope_params(max_seq_len, 2 * (d // 6), theta),
            rope_params(max_seq_len, 2 * (d // 6), theta),
        ],
        dim=1,
    )


def rope_apply(x: torch.Tensor, grid: tuple[int, int, int], freqs: torch.Tensor, start_frame: int = 0) -> torch.Tensor:
    """Self-Forcing's ``causal_rope_apply`` for a batch sharing one grid: ``x`` ``[B, f*h*w, n, d]`` ->
    float64 ``[B, f*h*w, n, d]``, frames counted from ``start_frame``."""
    n, c = x.size(2), x.size(3) // 2
    parts = freqs.split([c - 2 * (c // 3), c // 3, c // 3], dim=1)
    f, h, w = grid
    seq_len = f * h * w
    out = []
    for i in range(x.size(0)):
        x_i = torch.view_as_complex(x[i, :seq_len].to(torch.float64).reshape(seq_len, n, -1, 2))
        freqs_i = torch.cat(
            [
                parts[0][start_frame : start_frame + f].view(f, 1, 1, -1).expand(f, h, w, -1),
                parts[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
                parts[2][:w].view(1, 1, w, -1).expand(f, h, w, -1),
            ],
            dim=-1,
        ).reshape(seq_len, 1, -1)
        out.append(torch.view_as_real(x_i * freqs_i).flatten(2))
    return torch.stack(out)


def rope_apply_fp32(x: torch.Tensor, grid: tuple[int, int, int], freqs: torch.Tensor, start_frame: int = 0) -> torch.Tensor:
    """:func:`rope_apply` with another rounding: the same float64 angles, their cos / sin rounded to float32 first and
    the pairs rotated in float32 (``x * cos + i x * sin``), where upstream multiplies in float64 and rounds once.

    Not upstream's: what tells rounding from semantics in a comparison (a model rotating this way and one rotating
    upstream's way differ by about an ulp per rotation, which a rollout grows)."""
    c = x.size(3) // 2
    parts = freqs.split([c - 2 * (c // 3), c // 3, c // 3], dim=1)
    f, h, w = grid
    angles = torch.cat(
        [
            parts[0][start_frame : start_frame + f].view(f, 1, 1, -1).expand(f, h, w, -1),
            parts[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
            parts[2][:w].view(1, 1, w, -1).expand(f, h, w, -1),
        ],
        dim=-1,
    ).reshape(f * h * w, 1, -1)
    cos = angles.real.repeat_interleave(2, dim=-1).to(torch.float32)
    sin = angles.imag.repeat_interleave(2, dim=-1).to(torch.float32)
    t = x.float()
    even, odd = t.unflatten(-1, (-1, 2)).unbind(-1)
    turned = torch.stack((-odd, even), dim=-1).flatten(-2)
    return t * cos + turned * sin
