"""Checkpoint loading of the attention layers, in one place.

- Build a layer from an existing Wan2.1 / diffusers attention module: read its config, copy its weights
  (what ``ChunkSelfAttention.from_wan`` / ``from_diffusers`` and ``CachedCrossAttention.from_wan`` /
  ``from_diffusers`` use). Wan's and diffusers' RoPE pairs channels ``(2i, 2i + 1)``, the default layout
  of :mod:`ardiff_modules.modules.rotary`: no weight permutation. diffusers' fused projections
  (``fuse_projections()``: ``to_qkv`` / ``to_kv`` / ``to_added_kv``, what its processor then runs) are
  the source of those weights, not the unfused ``to_q`` / ``to_k`` / ``to_v`` they were made from.
- :class:`CheckpointLayer`: the layers' ``load_state_dict`` validates the whole dict before copying any
  tensor, so a failed load leaves the layer unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import torch
from torch import nn

from ardiff_modules.errors import SpecError, StateDictMismatchError, TensorMismatchError
from ardiff_modules.modules.common import QKNorm
from ardiff_modules.modules.naming import (
    DIFFUSERS_IGNORED_PREFIXES,
    ATTENTION_PARAM_NAMES,
    PARAM_NAMES,
    CheckpointNamed,
    rename_attention_keys,
)
from ardiff_modules.spec import require_field_int


@dataclass(frozen=True)
class SourceConfig:
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


class _Projection(NamedTuple):
    """One projection's ``weight`` ``[out, in]`` and ``bias`` ``[out]`` (or ``None``): a slice of a fused one."""

    weight: torch.Tensor
    bias: torch.Tensor | None


#: diffusers' fused projection -> the roles it holds, in its output order (``WanAttention.fuse_projections``).
_FUSED = {"to_qkv": ("q", "k", "v"), "to_kv": ("k", "v"), "to_added_kv": ("k_img", "v_img")}


def _fused_projections(owner: str, module: nn.Module) -> dict[str, _Projection]:
    """Role -> weights of a diffusers ``WanAttention`` whose projections are fused (else ``{}``).

    NOTE: after ``fuse_projections()`` diffusers' processor runs ``to_qkv`` (self-attention) or
    ``to_q`` + ``to_kv`` (cross-attention), and ``to_added_kv`` for image context; the unfused
    ``to_k`` / ``to_v`` (...) it was made from stay registered but are no longer read, so they go
    stale when the fused weights change (a LoRA fused into them, a fused checkpoint) or may have been
    deleted. The fused weights are what the module computes with: they are split back here, the way
    its processor splits their output (``.chunk(n, dim=-1)``).
    """
    if getattr(module, "fused_projections", False) is not True:
        return {}
    kind = type(module).__name__
    names = ["to_kv" if getattr(module, "is_cross_attention", False) else "to_qkv"]
    if getattr(module, "added_kv_proj_dim", None) is not None:
        names.append("to_added_kv")
    out: dict[str, _Projection] = {}
    for name in names:
        linear = getattr(module, name, None)
        weight = getattr(linear, "weight", None)
        roles = _FUSED[name]
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] % len(roles):
            got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(linear).__name__
            raise SpecError(
                f"{owner}: expected {kind}.{name} (fused_projections=True) to be an nn.Linear of "
                f"{len(roles)} equal projections, got {got}"
            )
        bias = getattr(linear, "bias", None)
        weights = weight.chunk(len(roles))
        biases = bias.chunk(len(roles)) if isinstance(bias, torch.Tensor) else (None,) * len(roles)
        out.update({role: _Projection(w, b) for role, w, b in zip(roles, weights, biases)})
    return out


def _source_linear(
    owner: str, module: nn.Module, source: str, role: str, fused: Mapping[str, _Projection] | None = None
) -> nn.Module | _Projection | None:
    """The projection of ``role`` (an ``nn.Linear``, or a slice of a fused one in ``fused``), ``None`` if absent."""
    if fused and role in fused:
        return fused[role]
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


def _weight(linear: nn.Module | _Projection) -> torch.Tensor:
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


def read_source(owner: str, module: Any, source: str, heads_attr: str, cross: bool) -> SourceConfig:
    """Geometry, bias, qk-norm kind and eps of a Wan (``source="wan"``) or diffusers attention module."""
    if not isinstance(module, nn.Module):
        raise SpecError(f"{owner}: expected a {source} attention nn.Module, got {type(module).__name__}")
    kind = type(module).__name__
    fused = _fused_projections(owner, module) if source == "diffusers" else {}
    found = {role: _source_linear(owner, module, source, role, fused) for role in ("q", "k", "v", "o")}
    missing = [ATTENTION_PARAM_NAMES[source][r] for r, m in found.items() if m is None]
    if missing:
        raise SpecError(f"{owner}: expected a {source} attention module with {', '.join(missing)}, got {kind}")
    linears = {r: m for r, m in found.items() if m is not None}  # all of them (none missing)
    heads = require_field_int(f"{owner}: {kind}", heads_attr, getattr(module, heads_attr, None), minimum=1)
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
    img = _source_linear(owner, module, source, "k_img", fused), _source_linear(owner, module, source, "v_img", fused)
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
    return SourceConfig(
        dim=dim, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, context_dim=k_w.shape[1],
        qk_norm=qk_norm, bias=biases.pop(), eps=float(eps), image_context_dim=image_context_dim,
    )



_Layer = TypeVar("_Layer", bound="CheckpointNamed")


def copy_from_source(owner: str, layer: _Layer, module: nn.Module, source: str) -> _Layer:
    """Load a copy of ``module``'s parameters into the meta-built ``layer`` (strict: every key maps)."""
    state = {
        k: v for k, v in module.state_dict().items()
        if not (source == "diffusers" and k.startswith(DIFFUSERS_IGNORED_PREFIXES))
    }
    if source == "diffusers":  # fused projections: their slices replace the (stale or deleted) unfused copies
        for role, projection in _fused_projections(owner, module).items():
            path = ATTENTION_PARAM_NAMES[source][role]
            state[f"{path}.weight"] = projection.weight
            if projection.bias is not None:
                state[f"{path}.bias"] = projection.bias
    mapped = rename_attention_keys(state, source, layer.param_names)
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


# ---------------------------------------------------------------------------------------------- load_state_dict


def _loads_like_stock_torch(layer: nn.Module) -> bool:
    """Every submodule loads with ``nn.Module``'s own rules (no load hooks, no custom loader, no extra state).

    Only then are the keys and shapes of ``layer.state_dict()`` exactly what ``load_state_dict`` accepts.
    """
    stock_load, stock_extra = nn.Module._load_from_state_dict, nn.Module.set_extra_state
    return all(
        type(m)._load_from_state_dict is stock_load and type(m).set_extra_state is stock_extra
        and not m._load_state_dict_pre_hooks and not m._load_state_dict_post_hooks
        and not m._state_dict_hooks and not m._state_dict_pre_hooks
        for m in layer.modules()
    )


def _naming_hint(layer: CheckpointNamed, keys: set[Any], expected: set[str]) -> str:
    """A hint when ``keys`` renamed from another ``param_names`` naming (a Wan or diffusers dict) are the layer's."""
    if not all(isinstance(k, str) for k in keys):
        return ""
    placeholders = dict.fromkeys(keys, torch.empty(0))  # only the keys are renamed
    for other in PARAM_NAMES:
        if other == layer.param_names:
            continue
        try:
            renamed = set(rename_attention_keys(placeholders, other, layer.param_names))
        except SpecError:  # two keys collide in that naming: not it
            continue
        if renamed == expected:
            return (
                f"; renamed from {other!r} naming they match: convert_attention_state_dict(state_dict, {other!r}, "
                f"{layer.param_names!r}), or build the layer with param_names={other!r}"
            )
    return ""


def _check_state_dict(layer: CheckpointNamed, state_dict: Any, strict: bool, assign: bool) -> None:
    """Raise :class:`StateDictMismatchError` if ``layer.load_state_dict(state_dict, strict, assign)`` would fail.

    The failures torch's loader reports only after copying every tensor that did match: with ``strict``
    a missing or unexpected key; whatever ``strict``, a value that is not a tensor, of another shape
    than the layer's, or (copied, ``assign=False``) a meta tensor without data.
    """
    owner = f"{type(layer).__name__}.load_state_dict"
    if not isinstance(state_dict, Mapping):
        raise StateDictMismatchError(
            f"{owner}: expected a mapping of key -> tensor, got {type(state_dict).__name__}; nothing was loaded"
        )
    expected = layer.state_dict(keep_vars=True)
    problems = []
    if strict:
        missing = [k for k in expected if k not in state_dict]
        unexpected = [k for k in state_dict if k not in expected]
        if missing or unexpected:
            hint = _naming_hint(layer, set(state_dict), set(expected))
            problems.append(
                f"the keys of this layer (param_names={layer.param_names!r}), got missing {missing}, "
                f"unexpected {unexpected}{hint}"
            )
    for key, target in expected.items():
        if key not in state_dict:
            continue
        value = state_dict[key]
        if not torch.overrides.is_tensor_like(value):
            problems.append(f"{key} to be a tensor, got {type(value).__name__}")
        elif tuple(value.shape) != tuple(target.shape):
            problems.append(f"{key} of shape {tuple(target.shape)}, got {tuple(value.shape)}")
        elif not assign and value.is_meta and not target.is_meta:
            problems.append(f"{key} to hold data (it is copied), got a meta tensor")
    if problems:
        raise StateDictMismatchError(f"{owner}: expected " + "; expected ".join(problems) + "; nothing was loaded")


class CheckpointLayer(CheckpointNamed):
    """The layers' base: checkpoint naming, and a ``load_state_dict`` that checks the whole dict first
    (a failed load changes no parameter or buffer).

    torch's own loader copies every tensor that matches and raises only at the end, leaving a layer
    half-loaded after a truncated, misnamed or mis-shaped checkpoint. Semantics are otherwise torch's:
    ``strict=False`` loads the keys present and returns the missing / unexpected ones (a shape mismatch
    still raises), ``assign`` as in torch.
    """

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``, validated first; raises :class:`StateDictMismatchError` (a
        ``RuntimeError``, as torch's) naming the missing, unexpected and mis-shaped keys, changing nothing.

        A layer with a submodule that loads by its own rules (load hooks, a custom
        ``_load_from_state_dict`` such as a quantized Linear's) is loaded by torch as it is.
        """
        if _loads_like_stock_torch(self):
            _check_state_dict(self, state_dict, strict, assign)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)
