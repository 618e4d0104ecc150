"""Build a layer from an existing Wan2.1 / diffusers attention module: read its config, copy its weights.

What ``ChunkSelfAttention.from_wan`` / ``from_diffusers`` and ``CachedCrossAttention.from_wan`` /
``from_diffusers`` use. Wan's and diffusers' RoPE pairs channels ``(2i, 2i + 1)``, the default layout
of :mod:`ardiff_modules.modules.rotary`: no weight permutation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from ardiff_modules.errors import SpecError, TensorMismatchError
from ardiff_modules.modules.common import QKNorm
from ardiff_modules.modules.naming import (
    _DIFFUSERS_IGNORED_PREFIXES,
    ATTENTION_PARAM_NAMES,
    _CheckpointNamed,
    _rename_attention_keys,
)
from ardiff_modules.spec import _require_int


@dataclass(frozen=True)
class _SourceConfig:
    """What ``from_wan`` / ``from_diffusers`` read off an existing attention module."""

    dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_dim: int
    qk_norm: QKNorm
    bias: bool
    eps: float
    image_context_dim: int | None


def _source_linear(owner: str, module: nn.Module, source: str, role: str) -> nn.Module | None:
    path = ATTENTION_PARAM_NAMES[source][role]
    try:
        linear = module.get_submodule(path)
    except AttributeError:
        return None
    weight = getattr(linear, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise SpecError(
            f"{owner}: expected {type(module).__name__}.{path} to be an nn.Linear, got {type(linear).__name__}"
        )
    return linear


def _weight(linear: nn.Module) -> torch.Tensor:
    """The ``weight`` of a linear :func:`_source_linear` returned (checked there to be a 2-D tensor)."""
    weight = linear.weight
    assert isinstance(weight, torch.Tensor)
    return weight


def _source_norm(
    owner: str, module: nn.Module, source: str, role: str, heads: int, head_dim: int
) -> tuple[QKNorm, float | None]:
    """The kind (None / "full" / "head") and eps of the source's q / k RMSNorm."""
    path = ATTENTION_PARAM_NAMES[source][role]
    norm = getattr(module, path, None)
    if norm is None or isinstance(norm, nn.Identity):
        return None, None
    where = f"{type(module).__name__}.{path}"
    # Only an RMSNorm maps onto ours: a LayerNorm's weights would load and compute something else.
    if not (isinstance(norm, nn.RMSNorm) or type(norm).__name__.endswith("RMSNorm")):
        raise SpecError(f"{owner}: expected {where} to be an RMSNorm or nn.Identity, got {type(norm).__name__}")
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or getattr(norm, "bias", None) is not None:
        raise SpecError(f"{owner}: expected {where} to be an RMSNorm with a weight and no bias, got {norm!r}")
    if weight.numel() == heads * head_dim:
        kind: QKNorm = "full"
    elif weight.numel() == head_dim:
        kind = "head"
    else:
        raise SpecError(
            f"{owner}: expected {where} over {heads * head_dim} (all heads) or {head_dim} (one head) channels, "
            f"got {tuple(weight.shape)}"
        )
    eps = getattr(norm, "eps", None)
    if eps is None:
        eps = getattr(module, "eps", None)
    if eps is None:
        raise SpecError(f"{owner}: expected {where} to have an explicit eps, got None")
    return kind, float(eps)


def _read_source(owner: str, module: Any, source: str, heads_attr: str, cross: bool) -> _SourceConfig:
    """Geometry, bias, qk-norm kind and eps of a Wan (``source="wan"``) or diffusers attention module."""
    if not isinstance(module, nn.Module):
        raise SpecError(f"{owner}: expected a {source} attention nn.Module, got {type(module).__name__}")
    kind = type(module).__name__
    found = {role: _source_linear(owner, module, source, role) for role in ("q", "k", "v", "o")}
    missing = [ATTENTION_PARAM_NAMES[source][r] for r, m in found.items() if m is None]
    if missing:
        raise SpecError(f"{owner}: expected a {source} attention module with {', '.join(missing)}, got {kind}")
    linears = {r: m for r, m in found.items() if m is not None}  # all of them (none missing)
    heads = _require_int(f"{owner}: {kind}", heads_attr, getattr(module, heads_attr, None), minimum=1)
    q_w, k_w, v_w, o_w = (_weight(linears[r]) for r in ("q", "k", "v", "o"))
    dim, inner = q_w.shape[1], q_w.shape[0]
    if inner % heads:
        raise SpecError(f"{owner}: expected {kind}'s query width {inner} to be a multiple of {heads_attr}={heads}")
    head_dim = inner // heads
    if k_w.shape[0] % head_dim or v_w.shape != k_w.shape or (heads * head_dim) % k_w.shape[0]:
        raise SpecError(
            f"{owner}: expected {kind}'s key / value projections to give heads of {head_dim} channels, "
            f"got k {tuple(k_w.shape)}, v {tuple(v_w.shape)}"
        )
    if tuple(o_w.shape) != (dim, inner):
        raise SpecError(f"{owner}: expected {kind}'s output projection of shape {(dim, inner)}, got {tuple(o_w.shape)}")
    if not cross and k_w.shape[1] != dim:
        raise SpecError(f"{owner}: expected {kind}'s key input width {dim} (self-attention), got {k_w.shape[1]}")
    kv_heads = k_w.shape[0] // head_dim
    roles = ["q", "k", "v", "o"]
    image_context_dim = None
    img = _source_linear(owner, module, source, "k_img"), _source_linear(owner, module, source, "v_img")
    if img[0] is not None or img[1] is not None:
        if not cross:
            raise SpecError(
                f"{owner}: expected a self-attention module, got {kind} with image-context projections "
                f"(an I2V cross-attention: use CachedCrossAttention)"
            )
        if img[0] is None or img[1] is None or _weight(img[0]).shape[0] != k_w.shape[0] \
                or _weight(img[1]).shape != _weight(img[0]).shape:
            raise SpecError(f"{owner}: expected {kind}'s image k / v projections to match its key projection")
        image_context_dim = _weight(img[0]).shape[1]
        linears.update(k_img=img[0], v_img=img[1])
        roles += ["k_img", "v_img"]
    biases = {linears[r].bias is not None for r in roles}
    if len(biases) != 1:
        raise SpecError(f"{owner}: expected all of {kind}'s projections with a bias or all without, got a mix")
    norms = [_source_norm(owner, module, source, "norm_q", heads, head_dim),
             _source_norm(owner, module, source, "norm_k", kv_heads, head_dim)]
    if image_context_dim is not None:
        norms.append(_source_norm(owner, module, source, "norm_k_img", kv_heads, head_dim))
    if len({n for n, _ in norms}) != 1 or len({e for n, e in norms if n is not None}) > 1:
        raise SpecError(f"{owner}: expected {kind}'s q / k norms of one kind and eps, got {norms}")
    qk_norm, eps = norms[0]
    if eps is None:
        eps = getattr(module, "eps", None) or 1e-6
    return _SourceConfig(
        dim=dim, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, context_dim=k_w.shape[1],
        qk_norm=qk_norm, bias=biases.pop(), eps=float(eps), image_context_dim=image_context_dim,
    )



_Layer = TypeVar("_Layer", bound="_CheckpointNamed")


def _copy_from_source(owner: str, layer: _Layer, module: nn.Module, source: str) -> _Layer:
    """Load a copy of ``module``'s parameters into the meta-built ``layer`` (strict: every key maps)."""
    state = {
        k: v for k, v in module.state_dict().items()
        if not (source == "diffusers" and k.startswith(_DIFFUSERS_IGNORED_PREFIXES))
    }
    mapped = _rename_attention_keys(state, source, layer.param_names)
    expected = layer.state_dict()
    missing, unexpected = sorted(set(expected) - set(mapped)), sorted(set(mapped) - set(expected))
    if missing or unexpected:
        raise SpecError(
            f"{owner}: expected {type(module).__name__}'s parameters to map onto the layer one to one, "
            f"got missing {missing}, unexpected {unexpected}"
        )
    for key, value in mapped.items():
        if value.shape != expected[key].shape:
            raise TensorMismatchError(
                f"{owner}: expected {key} of shape {tuple(expected[key].shape)}, got {tuple(value.shape)}"
            )
    layer.load_state_dict({k: v.detach().clone() for k, v in mapped.items()}, strict=True, assign=True)
    layer.requires_grad_(any(p.requires_grad for p in module.parameters()))
    return layer.train(module.training)

