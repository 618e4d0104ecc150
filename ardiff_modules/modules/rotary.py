"""Rotary position embeddings evaluated at the absolute positions a forward context carries.

Keys are cached already rotated, so RoPE must use *absolute* token positions:
``kv.positions`` (``[streams, seq_len]``) counts every token a branch ever
committed, evicted ones included. These modules are RoPE hooks for
:class:`~ardiff_modules.ChunkSelfAttention`: ``rope(t, positions) -> t``.

Pair layout
-----------
``layout="interleaved"`` (the default) rotates channel pairs ``(2i, 2i + 1)``: the complex-number RoPE
of Wan2.1, Self-Forcing, CausVid, LongLive and diffusers' ``WanRotaryPosEmbed`` (``view_as_complex(x)
* freqs_cis``), so their checkpoints load without any weight permutation. ``layout="half"`` rotates
``(i, i + head_dim / 2)`` (GPT-NeoX / Llama's rotate-half).

Precision
---------
The modules hold no tensors (no buffers, no parameters), so ``model.to(torch.bfloat16)`` or
``.half()`` cannot round their frequencies. Every forward computes the angles from the *integer*
positions: frame / row / column are split off in int64, then ``position * inv_freq`` and its cos / sin
are evaluated in float64 (float32 on a device without float64, e.g. MPS) and only cos / sin are cast to
float32 for the rotation, which runs in float32 whatever ``t``'s dtype. Position 10^7 (thousands of
frames of 1560 tokens) rotates as accurately as position 0.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ardiff_modules.errors import SpecError, TensorMismatchError
from ardiff_modules.modules.functional import RopeLayout, check_rope_layout, rotate
from ardiff_modules.ops import HANDLES
from ardiff_modules.spec import require_field_int, require_field_float


def _angle_dtype(device: torch.device) -> torch.dtype:
    """float64, except where the device has none (MPS): float32 there."""
    return torch.float32 if device.type == "mps" else torch.float64


def _inv_freq(
    dim: int, theta: float, device: torch.device | None = None, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """``[dim // 2]`` frequencies ``1 / theta ** (arange(0, dim, 2) / dim)``, Wan's ``rope_params`` expression."""
    return 1.0 / torch.pow(theta, torch.arange(0, dim, 2, device=device, dtype=dtype).div(dim))


def _full_width(half: torch.Tensor, layout: RopeLayout) -> torch.Tensor:
    """``[..., D/2]`` per-pair values -> ``[..., D]`` in ``layout``'s channel order."""
    if layout == "interleaved":
        return torch.stack((half, half), dim=-1).flatten(-2)  # [a0, a0, a1, a1, ...]
    return torch.cat((half, half), dim=-1)  # [a0, a1, ..., a0, a1, ...]


def _require_even_head_dim(owner: str, head_dim: int, minimum: int, why: str = "") -> None:
    expected = f"an even int >= {minimum}{why}"
    try:
        require_field_int(owner, "head_dim", head_dim, minimum=minimum)
    except SpecError:  # one message for every bad head_dim, naming the evenness too
        got = f"{head_dim!r} ({type(head_dim).__name__})"
        raise SpecError(f"{owner}.head_dim: expected {expected}, got {got}") from None
    if head_dim % 2:  # RoPE rotates channel pairs
        raise SpecError(f"{owner}.head_dim: expected {expected}, got {head_dim}")


def _check_positions(owner: str, positions: Any) -> None:
    """``positions`` is an integer tensor (a float or bfloat16 position is already rounded)."""
    if not isinstance(positions, torch.Tensor):
        raise TensorMismatchError(f"{owner} positions: expected an integer tensor, got {type(positions).__name__}")
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise TensorMismatchError(
            f"{owner} positions: expected an integer dtype (e.g. torch.int64, as kv.positions), got {positions.dtype}"
        )


def check_rope_inputs(owner: str, t: Any, positions: Any, head_dim: int) -> None:
    """``t`` ``[streams, seq, heads, head_dim]`` and integer ``positions`` on ``t``'s device: ``[streams, seq]``
    (every head at one position), or per head ``[streams, seq, heads]`` (a layer's sink positions where its
    retention-group lanes differ, ``LayerContext.sink_positions``)."""
    if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[-1] != head_dim:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise TensorMismatchError(f"{owner} t: expected shape (streams, seq_len, heads, {head_dim}), got {got}")
    if isinstance(positions, torch.Tensor) and positions.dim() == 3 and positions.shape[:2] == t.shape[:2]:
        if positions.shape != t.shape[:3]:
            raise TensorMismatchError(
                f"{owner} positions: expected per-head positions of shape {tuple(t.shape[:3])} (t's [streams, "
                f"seq_len, heads]), got {tuple(positions.shape)}"
            )
    elif not isinstance(positions, torch.Tensor) or positions.shape != t.shape[:2]:
        got = tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
        forward = _forward_of(positions)
        if forward is not None:  # the forward's own positions: it is t that is not the forward's tokens
            raise TensorMismatchError(_forward_mismatch(owner, t, forward, head_dim))
        raise TensorMismatchError(
            f"{owner} positions: expected shape {tuple(t.shape[:2])} (t's [streams, seq_len]) or "
            f"{tuple(t.shape[:3])} (per head), got {got}"
        )
    _check_positions(owner, positions)
    if positions.device != t.device:
        raise TensorMismatchError(
            f"{owner}: expected t and positions on one device, got t on {t.device}, positions on {positions.device}"
        )


def _forward_of(positions: Any) -> Any | None:
    """The forward context whose ``positions`` (or ``sink_positions``) tensor this is, or ``None``.

    Error path only: a linear scan of the registered contexts, matched by identity (``kv.positions`` is the
    context's own tensor; sequence-parallel ranks pass a slice, which matches none).
    """
    if not isinstance(positions, torch.Tensor):
        return None
    for holder in HANDLES.holders():
        # (``_sink_positions``: a grouped forward's public one raises; its layers' are checked by shape)
        if getattr(holder, "positions", None) is positions or getattr(holder, "_sink_positions", None) is positions:
            return holder
    return None


def _forward_mismatch(owner: str, t: torch.Tensor, forward: Any, head_dim: int) -> str:
    """``t`` is not shaped as the tokens of ``forward`` (whose positions RoPE got): name what was prepared."""
    streams, seq_len = tuple(forward.positions.shape)
    names = [f"{sid}/{branch}" for sid, branch in forward.streams[:4]]
    more = f", ... (+{len(forward.streams) - 4})" if len(forward.streams) > 4 else ""
    return (
        f"{owner}: expected t of shape ({streams}, {seq_len}, heads, {head_dim}) -- the tokens of the forward "
        f"prepared with seq_len={seq_len} over {streams} stream(s) [{', '.join(names)}{more}], whose positions "
        f"{(streams, seq_len)} RoPE got -- got t of shape {tuple(t.shape)} ({t.shape[0]} stream(s) x "
        f"{t.shape[1]} tokens); run the model on the tokens the forward was prepared for, or prepare it with "
        f"seq_len={t.shape[1]} over {t.shape[0]} stream(s)"
    )


class RotaryBase(nn.Module):
    """Shared forward: ``angles(positions)`` -> float32 ``(cos, sin)`` -> :func:`rotate` in ``layout``."""

    head_dim: int
    layout: RopeLayout

    def angles(self, positions: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Integer ``positions`` ``[...]`` -> ``(cos, sin)`` in ``dtype`` (float32 by default), each
        ``[..., 1, head_dim]`` in this module's layout: for ``[streams, seq]`` positions the ``(cos, sin)`` pair
        that :func:`~ardiff_modules.apply_rope` with ``layout=self.layout`` applies exactly as ``forward``
        does (broadcast over heads); for per-head ``[streams, seq, heads]`` positions drop the ``1`` dim
        (``forward`` does). Evaluated in float64 and rounded once to ``dtype``."""
        angles = self.angles(positions)  # [..., D/2], float64
        cos = _full_width(angles.cos().to(dtype), self.layout)
        sin = _full_width(angles.sin().to(dtype), self.layout)
        return cos.unsqueeze(-2), sin.unsqueeze(-2)

    def forward(self, t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``t`` ``[streams, seq, heads, head_dim]`` rotated at integer ``positions`` ``[streams, seq]`` (or per
        head ``[streams, seq, heads]``); same shape and dtype as ``t`` (computed in float32; in float64 for a
        float64 ``t``)."""
        check_rope_inputs(type(self).__name__, t, positions, self.head_dim)
        compute = torch.float64 if t.dtype == torch.float64 else torch.float32
        cos, sin = self.cos_sin(positions, compute)  # [S, n, 1, D], per head [S, n, H, 1, D]
        if positions.dim() == 3:
            cos, sin = cos.squeeze(-2), sin.squeeze(-2)  # [S, n, H, D]
        return rotate(t, cos, sin, self.layout)


class RotaryEmbedding(RotaryBase):
    """1-D RoPE over the absolute token position.

    ``forward(t [streams, seq, heads, head_dim], positions [streams, seq]) -> t``.

    Parameters
    ----------
    head_dim:
        Channels per head (even).
    theta:
        Frequency base: pair ``i`` turns by ``position / theta ** (2i / head_dim)``.
    layout:
        ``"interleaved"`` (default, like every RoPE of this package and the Wan family / diffusers
        video models: pairs ``(2i, 2i + 1)``) or ``"half"`` (GPT-NeoX / Llama: ``(i, i + head_dim / 2)``).
        Both give the same attention scores for weights trained with them; they differ for a checkpoint
        trained with the other one.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0, *, layout: RopeLayout = "interleaved") -> None:
        super().__init__()
        _require_even_head_dim("RotaryEmbedding", head_dim, 2)
        self.theta = require_field_float("RotaryEmbedding", "theta", theta)
        self.layout = check_rope_layout("RotaryEmbedding.layout", layout)
        self.head_dim = head_dim

    @property
    def inv_freq(self) -> torch.Tensor:
        """``[head_dim // 2]`` float64 frequencies on the CPU (computed; the module stores no tensor)."""
        return _inv_freq(self.head_dim, self.theta)

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """Integer ``positions`` ``[...]`` -> angles ``[..., head_dim // 2]`` (float64; float32 on MPS)."""
        _check_positions("RotaryEmbedding", positions)
        dtype = _angle_dtype(positions.device)
        inv_freq = _inv_freq(self.head_dim, self.theta, positions.device, dtype)
        return positions.to(torch.int64).to(dtype)[..., None] * inv_freq

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, layout={self.layout!r}"


class VideoRotaryEmbedding(RotaryBase):
    """3-D RoPE over (frame, row, column) of latent video tokens, as in Wan2.1.

    A token's absolute position ``p`` is mapped to frame ``p // (height * width)``
    and ``(row, col)`` inside the frame, so frames keep their absolute index across
    window eviction. The head dim is split between the axes like Wan
    (``d - 4 * (d // 6)`` for time, ``2 * (d // 6)`` each for height and width), each axis with
    Wan's frequencies ``1 / theta ** (arange(0, axis_dim, 2) / axis_dim)``, in that order. With the
    default ``layout="interleaved"`` the result equals Wan's / Self-Forcing's ``rope_apply`` (and
    diffusers' ``WanRotaryPosEmbed``) at frame offset ``p // (height * width)``, with no weight
    permutation.

    ``forward(t [streams, seq, heads, head_dim], positions [streams, seq]) -> t``.

    Parameters
    ----------
    head_dim:
        Channels per head (even, >= 6).
    height, width:
        The latent token grid of one frame (after patching): ``height * width`` tokens per frame.
    theta:
        Frequency base of all three axes.
    layout:
        ``"interleaved"`` (default, Wan) or ``"half"``.
    """

    def __init__(
        self, head_dim: int, height: int, width: int, theta: float = 10000.0, *, layout: RopeLayout = "interleaved"
    ) -> None:
        super().__init__()
        # Below 6 the row and column axes would get 0 dims: silently no spatial rotation.
        _require_even_head_dim("VideoRotaryEmbedding", head_dim, 6, " (2 dims each for time, row and column)")
        require_field_int("VideoRotaryEmbedding", "height", height, minimum=1)
        require_field_int("VideoRotaryEmbedding", "width", width, minimum=1)
        self.theta = require_field_float("VideoRotaryEmbedding", "theta", theta)
        self.layout = check_rope_layout("VideoRotaryEmbedding.layout", layout)
        self.head_dim = head_dim
        self.height, self.width = height, width
        axis = 2 * (head_dim // 6)
        self.dims = (head_dim - 2 * axis, axis, axis)  #: channels of (time, row, column)

    @property
    def inv_freq_t(self) -> torch.Tensor:
        """``[dims[0] // 2]`` float64 frequencies of the time axis (CPU)."""
        return _inv_freq(self.dims[0], self.theta)

    @property
    def inv_freq_h(self) -> torch.Tensor:
        """``[dims[1] // 2]`` float64 frequencies of the row axis (CPU)."""
        return _inv_freq(self.dims[1], self.theta)

    @property
    def inv_freq_w(self) -> torch.Tensor:
        """``[dims[2] // 2]`` float64 frequencies of the column axis (CPU)."""
        return _inv_freq(self.dims[2], self.theta)

    def grid(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Integer ``positions`` ``[...]`` -> int64 ``(frame, row, col)``, each ``[...]`` (exact integers)."""
        _check_positions("VideoRotaryEmbedding", positions)
        positions = positions.to(torch.int64)
        per_frame = self.height * self.width
        frame = torch.div(positions, per_frame, rounding_mode="floor")
        inner = positions - frame * per_frame
        row = torch.div(inner, self.width, rounding_mode="floor")
        return frame, row, inner - row * self.width

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """Integer ``positions`` ``[...]`` -> angles ``[..., head_dim // 2]`` (float64; float32 on MPS):
        ``dims[0] // 2`` time, then ``dims[1] // 2`` row, then ``dims[2] // 2`` column angles."""
        frame, row, col = self.grid(positions)
        dtype = _angle_dtype(positions.device)
        device = positions.device
        return torch.cat(
            (
                frame.to(dtype)[..., None] * _inv_freq(self.dims[0], self.theta, device, dtype),
                row.to(dtype)[..., None] * _inv_freq(self.dims[1], self.theta, device, dtype),
                col.to(dtype)[..., None] * _inv_freq(self.dims[2], self.theta, device, dtype),
            ),
            dim=-1,
        )

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, height={self.height}, width={self.width}, theta={self.theta}, "
            f"layout={self.layout!r}"
        )
