"""Drop-in attention layers for streaming autoregressive video DiTs."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Literal

import torch
from torch import nn

from ardiff_modules.context import LayerContext
from ardiff_modules.checks import require_bool
from ardiff_modules.errors import SpecError, TensorMismatchError
from ardiff_modules.modules.functional import Rope, apply_rope, cached_cross_attention, chunk_attention
from ardiff_modules.spec import _require_int, _require_positive_float
from ardiff_modules.state import KVState

QKNorm = Literal["full", "head"] | None


def _qk_norm(owner: str, kind: QKNorm, num_heads: int, head_dim: int, eps: float) -> nn.Module:
    """The RMSNorm of Q or K: over all heads (``"full"``, Wan) or per head (``"head"``, SD3 / Qwen)."""
    if kind is None:
        return nn.Identity()
    if kind == "full":
        return nn.RMSNorm(num_heads * head_dim, eps=eps)
    if kind == "head":
        return nn.RMSNorm(head_dim, eps=eps)
    raise SpecError(f"{owner}.qk_norm: expected None, 'full' or 'head', got {kind!r}")


def _head_geometry(
    owner: str, dim: int, num_heads: int, num_kv_heads: int | None, head_dim: int | None
) -> tuple[int, int]:
    """Validated ``(num_kv_heads, head_dim)`` with their defaults filled in."""
    _require_int(owner, "dim", dim, minimum=1)
    _require_int(owner, "num_heads", num_heads, minimum=1)
    if num_kv_heads is None:
        num_kv_heads = num_heads
    _require_int(owner, "num_kv_heads", num_kv_heads, minimum=1)
    if num_heads % num_kv_heads:
        raise SpecError(f"{owner}.num_heads: expected a multiple of num_kv_heads={num_kv_heads}, got {num_heads}")
    if head_dim is None:
        # dim // num_heads would silently drop the remainder (64 wide, 5 heads -> 60-wide projections).
        if dim % num_heads:
            raise SpecError(
                f"{owner}.dim: expected a multiple of num_heads={num_heads} (or an explicit head_dim), got {dim}"
            )
        head_dim = dim // num_heads
    _require_int(owner, "head_dim", head_dim, minimum=1)
    return num_kv_heads, head_dim


def _check_options(owner: str, bias: Any, eps: Any) -> float:
    """``bias`` is a bool and ``eps`` a finite number > 0 (checked even without qk_norm: both are config)."""
    require_bool(f"{owner}.bias", bias)
    return _require_positive_float(owner, "eps", eps)


def _check_input(owner: str, name: str, x: Any, rank: str, width: int, weight: torch.Tensor) -> None:
    """``x`` is a floating tensor ``[..., width]`` of the rank ``rank`` names, on ``weight``'s device.

    A dtype other than the weights' is allowed only under autocast (which casts both).
    """
    ndim = rank.count(",") + 1
    if not isinstance(x, torch.Tensor) or x.dim() != ndim or x.shape[-1] != width:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise TensorMismatchError(f"{owner} {name}: expected shape {rank} with width {width}, got {got}")
    if x.device != weight.device:
        raise TensorMismatchError(f"{owner} {name}: expected device {weight.device} (the weights'), got {x.device}")
    if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        raise TensorMismatchError(
            f"{owner} {name}: expected dtype {weight.dtype} (the weights'; or run under autocast), got {x.dtype}"
        )


def _check_layer_context(owner: str, kv: Any, needs: str) -> None:
    """``kv`` has the ``LayerContext`` attribute this layer uses (duck-typed: benchmarks pass look-alikes)."""
    if not hasattr(kv, needs):
        raise SpecError(
            f"{owner} kv: expected a LayerContext (one entry of ForwardContext.layers, with .{needs}), "
            f"got {type(kv).__name__}"
        )


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
        owner = "ChunkSelfAttention"
        self.num_kv_heads, self.head_dim = _head_geometry(owner, dim, num_heads, num_kv_heads, head_dim)
        eps = _check_options(owner, bias, eps)
        self.dim = dim
        self.num_heads = num_heads
        self.qk_norm = qk_norm
        self.norm_q = _qk_norm(owner, qk_norm, num_heads, self.head_dim, eps)
        self.norm_k = _qk_norm(owner, qk_norm, self.num_kv_heads, self.head_dim, eps)
        self.to_q = nn.Linear(dim, num_heads * self.head_dim, bias=bias)
        self.to_k = nn.Linear(dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.to_v = nn.Linear(dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.to_out = nn.Linear(num_heads * self.head_dim, dim, bias=bias)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``[streams, seq_len, dim]`` -> normalised ``q`` ``[streams, seq_len, heads, head_dim]`` and
        ``k``, ``v`` ``[streams, seq_len, kv_heads, head_dim]``, before RoPE (what models with their own
        attention path, and oracles, reuse)."""
        q = _split_heads(self.to_q(x), self.num_heads, self.head_dim, self.qk_norm, self.norm_q)
        k = _split_heads(self.to_k(x), self.num_kv_heads, self.head_dim, self.qk_norm, self.norm_k)
        v = self.to_v(x).view(x.shape[0], x.shape[1], self.num_kv_heads, self.head_dim)
        return q, k, v

    def forward(self, x: torch.Tensor, kv: LayerContext, rope: Rope | None = None) -> torch.Tensor:
        """``x`` ``[streams, seq_len, dim]`` -> ``[streams, seq_len, dim]``."""
        _check_input("ChunkSelfAttention", "x", x, "[streams, seq_len, dim]", self.dim, self.to_q.weight)
        _check_layer_context("ChunkSelfAttention", kv, "k_cache")
        q, k, v = self.project(x)
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
        owner = "CachedCrossAttention"
        if not isinstance(cache_name, str) or not cache_name:
            raise SpecError(f"{owner}.cache_name: expected a non-empty string, got {cache_name!r}")
        self.num_kv_heads, self.head_dim = _head_geometry(owner, dim, num_heads, num_kv_heads, head_dim)
        if context_dim is None:
            context_dim = dim
        _require_int(owner, "context_dim", context_dim, minimum=1)
        eps = _check_options(owner, bias, eps)
        self.cache_name = cache_name
        self.dim = dim
        self.context_dim = context_dim
        self.num_heads = num_heads
        self.qk_norm = qk_norm
        self.norm_q = _qk_norm(owner, qk_norm, num_heads, self.head_dim, eps)
        self.norm_k = _qk_norm(owner, qk_norm, self.num_kv_heads, self.head_dim, eps)
        self.to_q = nn.Linear(dim, num_heads * self.head_dim, bias=bias)
        self.to_k = nn.Linear(context_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.to_v = nn.Linear(context_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.to_out = nn.Linear(num_heads * self.head_dim, dim, bias=bias)

    def project_kv(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``context`` ``[tokens, context_dim]`` -> ``(k, v)`` each ``[tokens, num_kv_heads, head_dim]``."""
        _check_input(
            "CachedCrossAttention.project_kv", "context", context, "[tokens, context_dim]", self.context_dim,
            self.to_k.weight,
        )
        k = _split_heads(self.to_k(context), self.num_kv_heads, self.head_dim, self.qk_norm, self.norm_k)
        v = self.to_v(context).view(context.shape[0], self.num_kv_heads, self.head_dim)
        return k, v

    def forward(self, x: torch.Tensor, kv: LayerContext) -> torch.Tensor:
        """``x`` ``[streams, seq_len, dim]`` -> ``[streams, seq_len, dim]``."""
        _check_input("CachedCrossAttention", "x", x, "[streams, seq_len, dim]", self.dim, self.to_q.weight)
        _check_layer_context("CachedCrossAttention", kv, "cross_kv")
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
    owner = "populate_cross_attention"
    if not isinstance(state, KVState):
        raise SpecError(f"{owner}.state: expected a KVState, got {type(state).__name__}")
    try:
        layers = list(layers)
    except TypeError:  # e.g. a single layer
        raise SpecError(
            f"{owner}.layers: expected an iterable of CachedCrossAttention (one per layer), "
            f"got a {type(layers).__name__}"
        ) from None
    if not layers:
        raise SpecError(f"{owner}.layers: expected at least one CachedCrossAttention (one per layer), got none")
    for i, layer in enumerate(layers):
        if not isinstance(layer, CachedCrossAttention):
            raise SpecError(f"{owner}.layers: expected CachedCrossAttention items, got {type(layer).__name__} at {i}")
    if cache_name is None:
        # Publishing under layer 0's name while another layer reads another cache would be silently wrong.
        names = tuple(layer.cache_name for layer in layers)
        if len(set(names)) != 1:
            raise SpecError(
                f"{owner}.layers: expected one cache_name for all layers (or an explicit cache_name), got {names}"
            )
        cache_name = names[0]

    def projections() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        with torch.no_grad():
            for layer in layers:
                yield layer.project_kv(context)

    state.populate_cross_attention(kv_branch, cache_name, projections())
