"""What the attention layers share: head geometry and q / k norms, input checks, head split / merge."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from ardiff_modules.checks import require_bool
from ardiff_modules.errors import SpecError, TensorMismatchError
from ardiff_modules.spec import require_field_int, require_field_float

#: The RMSNorm of q / k: over all heads (``"full"``, Wan), per head (``"head"``), or none.
QKNorm = Literal["full", "head"] | None


def apply_qk_norm(owner: str, kind: QKNorm, num_heads: int, head_dim: int, eps: float) -> nn.Module:
    """The RMSNorm of Q or K: over all heads (``"full"``, Wan) or per head (``"head"``, SD3 / Qwen)."""
    if kind is None:
        return nn.Identity()
    if kind == "full":
        return nn.RMSNorm(num_heads * head_dim, eps=eps)
    if kind == "head":
        return nn.RMSNorm(head_dim, eps=eps)
    raise SpecError(f"{owner}.qk_norm: expected None, 'full' or 'head', got {kind!r}")


def head_geometry(
    owner: str, dim: int, num_heads: int, num_kv_heads: int | None, head_dim: int | None
) -> tuple[int, int]:
    """Validated ``(num_kv_heads, head_dim)`` with their defaults filled in."""
    require_field_int(owner, "dim", dim, minimum=1)
    require_field_int(owner, "num_heads", num_heads, minimum=1)
    if num_kv_heads is None:
        num_kv_heads = num_heads
    require_field_int(owner, "num_kv_heads", num_kv_heads, minimum=1)
    if num_heads % num_kv_heads:
        raise SpecError(f"{owner}.num_heads: expected a multiple of num_kv_heads={num_kv_heads}, got {num_heads}")
    if head_dim is None:
        # dim // num_heads would silently drop the remainder (64 wide, 5 heads -> 60-wide projections).
        if dim % num_heads:
            raise SpecError(
                f"{owner}.dim: expected a multiple of num_heads={num_heads} (or an explicit head_dim), got {dim}"
            )
        head_dim = dim // num_heads
    require_field_int(owner, "head_dim", head_dim, minimum=1)
    return num_kv_heads, head_dim


def check_options(owner: str, bias: Any, eps: Any) -> float:
    """``bias`` is a bool and ``eps`` a finite number > 0 (checked even without qk_norm: both are config)."""
    require_bool(f"{owner}.bias", bias)
    return require_field_float(owner, "eps", eps)



def check_input(owner: str, name: str, x: Any, rank: str, width: int, weight: torch.Tensor) -> None:
    """``x`` is a floating tensor ``[..., width]`` of the rank ``rank`` names, on ``weight``'s device.

    A dtype other than the weights' is allowed only under autocast (which casts both).
    """
    ndim = rank.count(",") + 1
    if not isinstance(x, torch.Tensor) or x.dim() != ndim or x.shape[-1] != width:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise TensorMismatchError(f"{owner} {name}: expected shape {rank} with width {width}, got {got}")
    _check_device_dtype(owner, name, x, weight)


def _check_device_dtype(owner: str, name: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.device != weight.device:
        raise TensorMismatchError(f"{owner} {name}: expected device {weight.device} (the weights'), got {x.device}")
    if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        raise TensorMismatchError(
            f"{owner} {name}: expected dtype {weight.dtype} (the weights'; or run under autocast), got {x.dtype}"
        )


def check_context(
    owner: str, name: str, context: Any, width: int, weight: torch.Tensor, streams: int | None = None
) -> torch.Tensor:
    """``context`` ``[tokens, width]`` or ``[1, tokens, width]`` (diffusers' batch of one), or with
    ``streams`` also ``[streams, tokens, width]`` -> a 3-D view ``[1 or streams, tokens, width]``."""
    ok = isinstance(context, torch.Tensor) and context.dim() in (2, 3) and context.shape[-1] == width
    if ok and context.dim() == 3:
        ok = context.shape[0] == 1 or (streams is not None and context.shape[0] == streams)
    if not ok:
        got = tuple(context.shape) if isinstance(context, torch.Tensor) else type(context).__name__
        batched = "[1, tokens, context_dim]" + (f" or [{streams}, tokens, context_dim]" if streams is not None else "")
        raise TensorMismatchError(
            f"{owner} {name}: expected shape [tokens, context_dim] with width {width} (or {batched}), got {got}"
        )
    _check_device_dtype(owner, name, context, weight)
    return context if context.dim() == 3 else context.unsqueeze(0)


def check_layer_context(owner: str, kv: Any, needs: str) -> None:
    """``kv`` has the ``LayerContext`` attribute this layer uses (duck-typed: benchmarks pass look-alikes)."""
    if not hasattr(kv, needs):
        raise SpecError(
            f"{owner} kv: expected a LayerContext (one entry of ForwardContext.layers, with .{needs}), "
            f"got {type(kv).__name__}"
        )



def split_heads(
    t: torch.Tensor, heads: int, head_dim: int, kind: QKNorm = None, norm: nn.Module | None = None
) -> torch.Tensor:
    """``[b, n, heads * head_dim]`` -> ``[b, n, heads, head_dim]``, normalised before (``kind="full"``) or
    after (``"head"``) the split by ``norm``.

    NOTE: ``rearrange(t, "b n (h d) -> b n h d", h=heads)`` spelled as a view: this runs several times
    per layer and forward, where einops' ~8 us of Python per call measurably slows small models in
    eager mode (+5 % for a 30-block, 64-wide model on the CPU). einops serves the once-per-prompt paths.
    """
    if kind == "full":
        t = norm(t)  # type: ignore[misc]
    t = t.view(*t.shape[:-1], heads, head_dim)
    if kind == "head":
        t = norm(t)  # type: ignore[misc]
    return t


def merge_heads(t: torch.Tensor) -> torch.Tensor:
    """``[b, n, heads, head_dim]`` -> ``[b, n, heads * head_dim]`` (``"b n h d -> b n (h d)"``; a reshape for
    the reason :func:`split_heads` gives)."""
    return t.reshape(*t.shape[:-2], -1)
