"""Drop-in attention layers for streaming autoregressive video DiTs.

Checkpoint layouts
------------------
``param_names`` names a layer's submodules like the checkpoint it must load, so that
``layer.state_dict()`` has the checkpoint's keys and ``load_state_dict(strict=True)`` needs no
conversion (:data:`ATTENTION_PARAM_NAMES`):

==============  ======================  ===================  ==========================================
role            ``"ardiff"`` (default)  ``"wan"``            ``"diffusers"``
==============  ======================  ===================  ==========================================
q, k, v         to_q, to_k, to_v        q, k, v              to_q, to_k, to_v
output          to_out                  o                    to_out.0 (``to_out`` = [Linear, Dropout])
q / k RMSNorm   norm_q, norm_k          norm_q, norm_k       norm_q, norm_k
image k, v      to_k_img, to_v_img      k_img, v_img         add_k_proj, add_v_proj
image k norm    norm_k_img              norm_k_img           norm_added_k
==============  ======================  ===================  ==========================================

``"wan"`` is Wan2.1's ``WanSelfAttention`` / ``WanT2VCrossAttention`` / ``WanI2VCrossAttention`` and
every causal port of it (Self-Forcing, CausVid, LongLive, ...); ``"diffusers"`` is diffusers'
``WanAttention`` (``attn1`` / ``attn2`` of ``WanTransformer3DModel``). Whatever the layout, the
attributes ``to_q``, ``to_k``, ``to_v``, ``to_out`` (and ``to_k_img``, ``to_v_img``, ``norm_k_img``) are
the registered ``nn.Linear`` / norm modules themselves (with diffusers naming ``to_out`` is diffusers'
``[Linear, Dropout]`` list, callable like the Linear), so module-swapping tools (LoRA, quantization)
that replace a submodule by its checkpoint name replace what the layer uses. ``from_wan`` /
``from_diffusers`` build a layer from an existing module (its config and a copy of its weights).
Wan's and diffusers' RoPE pairs channels ``(2i, 2i + 1)``, the default layout of
:mod:`ardiff_modules.modules.rotary`: no weight permutation.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from ardiff_modules.checks import require_bool
from ardiff_modules.context import LayerContext
from ardiff_modules.errors import SpecError, TensorMismatchError
from ardiff_modules.modules.functional import (
    Rope,
    RopeLayout,
    _check_rope_layout,
    apply_rope,
    cached_cross_attention,
    chunk_attention,
)
from ardiff_modules.spec import _require_int, _require_positive_float
from ardiff_modules.state import KVState

QKNorm = Literal["full", "head"] | None

#: Submodule naming of an attention layer: ours, Wan2.1's (and its causal ports'), or diffusers'.
ParamNames = Literal["ardiff", "wan", "diffusers"]
PARAM_NAMES: tuple[str, ...] = ("ardiff", "wan", "diffusers")

#: ``param_names`` -> role -> dotted submodule path. Roles: ``q``, ``k``, ``v``, ``o`` (output
#: projection), ``norm_q``, ``norm_k``, and for image-conditioned (I2V) cross-attention ``k_img``,
#: ``v_img``, ``norm_k_img``. Parameter keys are ``<path>.weight`` / ``<path>.bias``.
ATTENTION_PARAM_NAMES: Mapping[str, Mapping[str, str]] = MappingProxyType(
    {
        "ardiff": MappingProxyType(
            {
                "q": "to_q", "k": "to_k", "v": "to_v", "o": "to_out", "norm_q": "norm_q", "norm_k": "norm_k",
                "k_img": "to_k_img", "v_img": "to_v_img", "norm_k_img": "norm_k_img",
            }
        ),
        "wan": MappingProxyType(
            {
                "q": "q", "k": "k", "v": "v", "o": "o", "norm_q": "norm_q", "norm_k": "norm_k",
                "k_img": "k_img", "v_img": "v_img", "norm_k_img": "norm_k_img",
            }
        ),
        "diffusers": MappingProxyType(
            {
                "q": "to_q", "k": "to_k", "v": "to_v", "o": "to_out.0", "norm_q": "norm_q", "norm_k": "norm_k",
                "k_img": "add_k_proj", "v_img": "add_v_proj", "norm_k_img": "norm_added_k",
            }
        ),
    }
)

#: diffusers keys that duplicate others (fused projections) or that its own loader ignores.
_DIFFUSERS_IGNORED_PREFIXES = ("to_qkv.", "to_kv.", "to_added_kv.", "norm_added_q.")


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


def _check_param_names(owner: str, param_names: Any) -> str:
    if not isinstance(param_names, str) or param_names not in PARAM_NAMES:
        raise SpecError(f"{owner}.param_names: expected 'ardiff', 'wan' or 'diffusers', got {param_names!r}")
    return param_names


def _check_input(owner: str, name: str, x: Any, rank: str, width: int, weight: torch.Tensor) -> None:
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


def _check_context(
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


# ------------------------------------------------------------------------------ checkpoint naming
class _OutProjection(nn.ModuleList):
    """diffusers' ``to_out = ModuleList([Linear, Dropout])``, callable: applies both in order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in self:
            x = module(x)
        return x


class _CheckpointNamed(nn.Module):
    """Registers projections under the names of ``param_names`` and reads them back by role."""

    param_names: str
    _paths: dict[str, str]

    def _init_names(self, owner: str, param_names: Any) -> None:
        self.param_names = _check_param_names(owner, param_names)
        self._paths = dict(ATTENTION_PARAM_NAMES[self.param_names])  # a plain dict: constant under compile

    def _register(self, role: str, module: nn.Module) -> None:
        head, _, index = self._paths[role].partition(".")
        if index:  # diffusers' output projection: to_out = ModuleList([Linear, Dropout])
            self.add_module(head, _OutProjection([module, nn.Dropout(0.0)]))
        else:
            self.add_module(head, module)

    def _role(self, role: str) -> nn.Module:
        """The registered submodule of ``role`` (for diffusers' ``to_out.0``: the whole ``to_out`` list).

        Read from ``_modules`` by name, so a module swapped in later (LoRA, quantization) is the one used;
        never a different object than ``getattr`` / ``get_submodule`` of its registered name.
        """
        head = self._paths[role].partition(".")[0]
        module = self._modules.get(head)
        if module is None:  # not registered (yet): an AttributeError keeps hasattr() / add_module() working
            raise AttributeError(f"{type(self).__name__} has no {role!r} projection ({self._paths[role]!r})")
        return module

    @property
    def to_q(self) -> nn.Linear:
        """The query projection (submodule ``to_q`` / ``q`` / ``to_q`` by ``param_names``)."""
        return self._role("q")  # type: ignore[return-value]

    @property
    def to_k(self) -> nn.Linear:
        """The key projection (``to_k`` / ``k`` / ``to_k``)."""
        return self._role("k")  # type: ignore[return-value]

    @property
    def to_v(self) -> nn.Linear:
        """The value projection (``to_v`` / ``v`` / ``to_v``)."""
        return self._role("v")  # type: ignore[return-value]

    @property
    def to_out(self) -> nn.Module:
        """The output projection: the ``Linear`` (``to_out`` / ``o``), or with diffusers naming the
        ``to_out`` list ``[Linear, Dropout]`` (``to_out[0]`` is the Linear), callable like the Linear."""
        return self._role("o")


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
    linears = {role: _source_linear(owner, module, source, role) for role in ("q", "k", "v", "o")}
    missing = [ATTENTION_PARAM_NAMES[source][r] for r, m in linears.items() if m is None]
    if missing:
        raise SpecError(f"{owner}: expected a {source} attention module with {', '.join(missing)}, got {kind}")
    heads = getattr(module, heads_attr, None)
    _require_int(f"{owner}: {kind}", heads_attr, heads, minimum=1)
    q_w, k_w, v_w, o_w = (linears[r].weight for r in ("q", "k", "v", "o"))  # type: ignore[union-attr]
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
        if img[0] is None or img[1] is None or img[0].weight.shape[0] != k_w.shape[0] \
                or img[1].weight.shape != img[0].weight.shape:
            raise SpecError(f"{owner}: expected {kind}'s image k / v projections to match its key projection")
        image_context_dim = img[0].weight.shape[1]
        linears.update(k_img=img[0], v_img=img[1])
        roles += ["k_img", "v_img"]
    biases = {linears[r].bias is not None for r in roles}  # type: ignore[union-attr]
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


def _rename_attention_keys(
    state_dict: Mapping[str, torch.Tensor], source: str, target: str, prefix: str = ""
) -> dict[str, torch.Tensor]:
    """Keys ``prefix + <source path>.<param>`` -> ``prefix + <target path>.<param>``; other keys unchanged."""
    src, dst = ATTENTION_PARAM_NAMES[source], ATTENTION_PARAM_NAMES[target]
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        new = key
        if key.startswith(prefix):
            rest = key[len(prefix):]
            for role, path in src.items():
                if rest.startswith(path + ".") and "." not in rest[len(path) + 1:]:
                    new = prefix + dst[role] + rest[len(path):]
                    break
        if new in out:
            raise SpecError(f"convert: two keys map onto {new!r} (from {source!r} to {target!r} names)")
        out[new] = value
    return out


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


# ---------------------------------------------------------------------------------------- layers
class ChunkSelfAttention(_CheckpointNamed):
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
        ``None``, ``"full"`` (RMSNorm over ``heads * head_dim``, as Wan and diffusers'
        ``rms_norm_across_heads``) or ``"head"``.
    param_names:
        Submodule names: ``"ardiff"`` (``to_q, to_k, to_v, to_out``), ``"wan"`` (``q, k, v, o``) or
        ``"diffusers"`` (``to_q, to_k, to_v, to_out.0``); ``norm_q`` / ``norm_k`` in all three.
    rope_layout:
        Pair layout used when ``forward`` gets a ``(cos, sin)`` pair as ``rope`` (a RoPE module
        carries its own): ``"interleaved"`` (default; Wan / diffusers) or ``"half"``.
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
        param_names: ParamNames = "ardiff",
        rope_layout: RopeLayout = "interleaved",
    ) -> None:
        super().__init__()
        owner = "ChunkSelfAttention"
        self.num_kv_heads, self.head_dim = _head_geometry(owner, dim, num_heads, num_kv_heads, head_dim)
        self.eps = _check_options(owner, bias, eps)
        self._init_names(owner, param_names)
        self.rope_layout = _check_rope_layout(f"{owner}.rope_layout", rope_layout)
        self.dim = dim
        self.num_heads = num_heads
        self.qk_norm = qk_norm
        self.norm_q = _qk_norm(owner, qk_norm, num_heads, self.head_dim, self.eps)
        self.norm_k = _qk_norm(owner, qk_norm, self.num_kv_heads, self.head_dim, self.eps)
        self._register("q", nn.Linear(dim, num_heads * self.head_dim, bias=bias))
        self._register("k", nn.Linear(dim, self.num_kv_heads * self.head_dim, bias=bias))
        self._register("v", nn.Linear(dim, self.num_kv_heads * self.head_dim, bias=bias))
        self._register("o", nn.Linear(num_heads * self.head_dim, dim, bias=bias))

    @classmethod
    def from_wan(
        cls, module: nn.Module, *, param_names: ParamNames = "wan", rope_layout: RopeLayout = "interleaved"
    ) -> ChunkSelfAttention:
        """A layer equal to a Wan2.1 ``WanSelfAttention`` (or Self-Forcing / CausVid / LongLive's causal
        port: ``q, k, v, o`` Linears, ``norm_q`` / ``norm_k`` RMSNorm or Identity, ``num_heads``),
        holding a copy of its weights on its device and dtype.

        With the default ``param_names="wan"`` the layer's ``state_dict()`` keys equal the module's, so
        ``block.self_attn = ChunkSelfAttention.from_wan(block.self_attn)`` keeps the model's checkpoint
        loading with ``strict=True``. Use a :class:`~ardiff_modules.modules.rotary.VideoRotaryEmbedding`
        (interleaved, as Wan) as its ``rope``.
        """
        owner = "ChunkSelfAttention.from_wan"
        config = _read_source(owner, module, "wan", "num_heads", cross=False)
        return cls._from_source(owner, module, "wan", config, param_names, rope_layout)

    @classmethod
    def from_diffusers(
        cls, module: nn.Module, *, param_names: ParamNames = "diffusers", rope_layout: RopeLayout = "interleaved"
    ) -> ChunkSelfAttention:
        """A layer equal to a diffusers ``WanAttention`` self-attention (``attn1``: ``to_q, to_k, to_v,
        to_out.0``, ``norm_q`` / ``norm_k``, ``heads``), holding a copy of its weights.

        With the default ``param_names="diffusers"`` the layer's ``state_dict()`` keys equal the module's
        (fused ``to_qkv`` copies are not carried over).
        """
        owner = "ChunkSelfAttention.from_diffusers"
        if getattr(module, "is_cross_attention", False) is True:
            raise SpecError(f"{owner}: expected a self-attention WanAttention (attn1), got a cross-attention one")
        config = _read_source(owner, module, "diffusers", "heads", cross=False)
        return cls._from_source(owner, module, "diffusers", config, param_names, rope_layout)

    @classmethod
    def _from_source(
        cls, owner: str, module: nn.Module, source: str, c: _SourceConfig, param_names: Any, rope_layout: Any
    ) -> ChunkSelfAttention:
        with torch.device("meta"):
            layer = cls(
                c.dim, c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, qk_norm=c.qk_norm,
                bias=c.bias, eps=c.eps, param_names=param_names, rope_layout=rope_layout,
            )
        return _copy_from_source(owner, layer, module, source)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``[streams, seq_len, dim]`` -> normalised ``q`` ``[streams, seq_len, heads, head_dim]`` and
        ``k``, ``v`` ``[streams, seq_len, kv_heads, head_dim]``, before RoPE (what models with their own
        attention path, and oracles, reuse)."""
        q = _split_heads(self.to_q(x), self.num_heads, self.head_dim, self.qk_norm, self.norm_q)
        k = _split_heads(self.to_k(x), self.num_kv_heads, self.head_dim, self.qk_norm, self.norm_k)
        v = self.to_v(x).view(x.shape[0], x.shape[1], self.num_kv_heads, self.head_dim)
        return q, k, v

    def forward(self, x: torch.Tensor, kv: LayerContext, rope: Rope | None = None) -> torch.Tensor:
        """``x`` ``[streams, seq_len, dim]`` -> ``[streams, seq_len, dim]``.

        ``rope``: a RoPE module / callable ``(t, positions) -> t`` evaluated at ``kv.positions``, or a
        ``(cos, sin)`` pair broadcastable to ``[streams, seq_len, 1, head_dim]`` in ``rope_layout``.
        """
        _check_input("ChunkSelfAttention", "x", x, "[streams, seq_len, dim]", self.dim, self.to_q.weight)
        _check_layer_context("ChunkSelfAttention", kv, "k_cache")
        q, k, v = self.project(x)
        positions = kv.forward.positions
        q = apply_rope(q, positions, rope, layout=self.rope_layout)
        k = apply_rope(k, positions, rope, layout=self.rope_layout)
        out = chunk_attention(q, k, v, kv)
        return self.to_out(out.reshape(x.shape[0], x.shape[1], -1))

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"qk_norm={self.qk_norm!r}, param_names={self.param_names!r}"
        )


class CachedCrossAttention(_CheckpointNamed):
    """Cross-attention to a named per-session cache (e.g. ``"text"``) of projected K/V.

    The context is projected once per prompt with :meth:`project_kv` and published for all
    layers with :func:`populate_cross_attention`; every forward reads it from the layer context.

    With ``image_cache_name`` the layer is an image-to-video cross-attention (Wan's
    ``WanI2VCrossAttention``, diffusers' ``WanAttention`` with ``added_kv_proj_dim``): separate image
    K/V projections (and K norm) feed a second cache, and the output is
    ``to_out(attn(q, text) + attn(q, image))``. Publish the image cache with
    ``populate_cross_attention(state, branch, layers, image_context, cache_name=image_cache_name)``.

    Parameters
    ----------
    dim:
        Model width (queries).
    num_heads:
        Query heads.
    cache_name:
        The cross cache this layer reads (a ``CrossAttentionSpec`` name of the KV cache's spec).
    context_dim:
        Width of the context; default ``dim``.
    num_kv_heads, head_dim, qk_norm, bias, eps, param_names:
        As :class:`ChunkSelfAttention`.
    image_cache_name:
        The cross cache of the image context (I2V); ``None`` (default) for text-only layers.
    image_context_dim:
        Width of the image context; default ``context_dim``. Only with ``image_cache_name``.
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
        param_names: ParamNames = "ardiff",
        image_cache_name: str | None = None,
        image_context_dim: int | None = None,
    ) -> None:
        super().__init__()
        owner = "CachedCrossAttention"
        if not isinstance(cache_name, str) or not cache_name:
            raise SpecError(f"{owner}.cache_name: expected a non-empty string, got {cache_name!r}")
        self.num_kv_heads, self.head_dim = _head_geometry(owner, dim, num_heads, num_kv_heads, head_dim)
        if context_dim is None:
            context_dim = dim
        _require_int(owner, "context_dim", context_dim, minimum=1)
        if image_cache_name is not None and (not isinstance(image_cache_name, str) or not image_cache_name
                                             or image_cache_name == cache_name):
            raise SpecError(
                f"{owner}.image_cache_name: expected None or a non-empty string other than "
                f"cache_name={cache_name!r}, got {image_cache_name!r}"
            )
        if image_cache_name is None and image_context_dim is not None:
            raise SpecError(
                f"{owner}.image_context_dim: expected None without image_cache_name, got {image_context_dim!r}"
            )
        if image_cache_name is not None:
            image_context_dim = context_dim if image_context_dim is None else image_context_dim
            _require_int(owner, "image_context_dim", image_context_dim, minimum=1)
        self.eps = _check_options(owner, bias, eps)
        self._init_names(owner, param_names)
        self.cache_name = cache_name
        self.image_cache_name = image_cache_name
        self.dim = dim
        self.context_dim = context_dim
        self.image_context_dim = image_context_dim
        self.num_heads = num_heads
        self.qk_norm = qk_norm
        kv_width = self.num_kv_heads * self.head_dim
        self.norm_q = _qk_norm(owner, qk_norm, num_heads, self.head_dim, self.eps)
        self.norm_k = _qk_norm(owner, qk_norm, self.num_kv_heads, self.head_dim, self.eps)
        self._register("q", nn.Linear(dim, num_heads * self.head_dim, bias=bias))
        self._register("k", nn.Linear(context_dim, kv_width, bias=bias))
        self._register("v", nn.Linear(context_dim, kv_width, bias=bias))
        self._register("o", nn.Linear(num_heads * self.head_dim, dim, bias=bias))
        if image_context_dim is not None:
            self._register("k_img", nn.Linear(image_context_dim, kv_width, bias=bias))
            self._register("v_img", nn.Linear(image_context_dim, kv_width, bias=bias))
            self._register("norm_k_img", _qk_norm(owner, qk_norm, self.num_kv_heads, self.head_dim, self.eps))

    @property
    def to_k_img(self) -> nn.Linear:
        """The image-context key projection (``to_k_img`` / ``k_img`` / ``add_k_proj``); I2V layers only."""
        return self._image_role("k_img")  # type: ignore[return-value]

    @property
    def to_v_img(self) -> nn.Linear:
        """The image-context value projection (``to_v_img`` / ``v_img`` / ``add_v_proj``); I2V layers only."""
        return self._image_role("v_img")  # type: ignore[return-value]

    @property
    def norm_k_img(self) -> nn.Module:
        """The image-context key norm (``norm_k_img`` / ``norm_k_img`` / ``norm_added_k``); I2V layers only."""
        return self._image_role("norm_k_img")

    def _image_role(self, role: str) -> nn.Module:
        if self.image_cache_name is None:
            raise SpecError(
                f"CachedCrossAttention.{role}: expected a layer built with image_cache_name, got a text-only one"
            )
        return self._role(role)

    @classmethod
    def from_wan(
        cls, module: nn.Module, cache_name: str = "text", *, image_cache_name: str = "image",
        param_names: ParamNames = "wan",
    ) -> CachedCrossAttention:
        """A layer equal to a Wan2.1 ``WanT2VCrossAttention`` (``q, k, v, o``, ``norm_q`` / ``norm_k``,
        ``num_heads``) or ``WanI2VCrossAttention`` (also ``k_img, v_img, norm_k_img``: the layer then
        reads the image context from ``image_cache_name``), holding a copy of its weights. With the
        default ``param_names="wan"`` its ``state_dict()`` keys equal the module's."""
        owner = "CachedCrossAttention.from_wan"
        config = _read_source(owner, module, "wan", "num_heads", cross=True)
        return cls._from_source(owner, module, "wan", config, cache_name, image_cache_name, param_names)

    @classmethod
    def from_diffusers(
        cls, module: nn.Module, cache_name: str = "text", *, image_cache_name: str = "image",
        param_names: ParamNames = "diffusers",
    ) -> CachedCrossAttention:
        """A layer equal to a diffusers ``WanAttention`` cross-attention (``attn2``: ``to_q, to_k, to_v,
        to_out.0``, ``norm_q`` / ``norm_k``, ``heads``; with ``add_k_proj, add_v_proj, norm_added_k`` for
        I2V, read from ``image_cache_name``), holding a copy of its weights. With the default
        ``param_names="diffusers"`` its ``state_dict()`` keys equal the module's."""
        owner = "CachedCrossAttention.from_diffusers"
        if getattr(module, "is_cross_attention", True) is False:
            raise SpecError(f"{owner}: expected a cross-attention WanAttention (attn2), got a self-attention one")
        config = _read_source(owner, module, "diffusers", "heads", cross=True)
        return cls._from_source(owner, module, "diffusers", config, cache_name, image_cache_name, param_names)

    @classmethod
    def _from_source(
        cls, owner: str, module: nn.Module, source: str, c: _SourceConfig, cache_name: Any, image_cache_name: Any,
        param_names: Any,
    ) -> CachedCrossAttention:
        with torch.device("meta"):
            layer = cls(
                c.dim, c.num_heads, cache_name, context_dim=c.context_dim, num_kv_heads=c.num_kv_heads,
                head_dim=c.head_dim, qk_norm=c.qk_norm, bias=c.bias, eps=c.eps, param_names=param_names,
                image_cache_name=image_cache_name if c.image_context_dim is not None else None,
                image_context_dim=c.image_context_dim,
            )
        return _copy_from_source(owner, layer, module, source)

    def _kv(self, context: torch.Tensor, image: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """3-D ``context`` ``[b, tokens, width]`` -> ``(k, v)`` each ``[b, tokens, kv_heads, head_dim]``."""
        if image:
            k_proj, v_proj, norm = self.to_k_img, self.to_v_img, self.norm_k_img
        else:
            k_proj, v_proj, norm = self.to_k, self.to_v, self.norm_k
        b, n, _ = context.shape
        k = _split_heads(k_proj(context), self.num_kv_heads, self.head_dim, self.qk_norm, norm)
        v = v_proj(context).view(b, n, self.num_kv_heads, self.head_dim)
        return k, v

    def _is_image(self, owner: str, cache_name: str | None) -> bool:
        if cache_name is None or cache_name == self.cache_name:
            return False
        if self.image_cache_name is not None and cache_name == self.image_cache_name:
            return True
        names = (self.cache_name,) + ((self.image_cache_name,) if self.image_cache_name is not None else ())
        raise SpecError(f"{owner}.cache_name: expected None or one of {names}, got {cache_name!r}")

    def project_kv(self, context: torch.Tensor, cache_name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``context`` ``[tokens, context_dim]`` or diffusers' batched ``[1, tokens, context_dim]`` ->
        ``(k, v)`` each ``[tokens, num_kv_heads, head_dim]``.

        ``cache_name``: ``None`` or ``self.cache_name`` projects the (text) context; ``image_cache_name``
        projects an image context (``[tokens, image_context_dim]``) with the image projections.
        """
        owner = "CachedCrossAttention.project_kv"
        image = self._is_image(owner, cache_name)
        return self._project_kv(owner, context, image)

    def _project_kv(self, owner: str, context: Any, image: bool) -> tuple[torch.Tensor, torch.Tensor]:
        width = self.image_context_dim if image else self.context_dim
        weight = (self.to_k_img if image else self.to_k).weight
        context = _check_context(owner, "context", context, width, weight)  # type: ignore[arg-type]
        k, v = self._kv(context, image)
        return k[0], v[0]

    def forward(
        self,
        x: torch.Tensor,
        kv: LayerContext | None = None,
        *,
        context: torch.Tensor | None = None,
        image_context: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x`` ``[streams, seq_len, dim]`` -> ``[streams, seq_len, dim]``.

        With ``kv`` (this layer's ``LayerContext``) it attends to the cached K/V of ``cache_name`` (and
        ``image_cache_name``). Without a cache, pass ``context`` instead: ``[tokens, context_dim]``,
        diffusers' ``[1, tokens, context_dim]`` (both shared by all streams) or ``[streams, tokens,
        context_dim]``, projected and attended directly -- the numbers the cached path gives after
        :func:`populate_cross_attention`; an I2V layer then also needs ``image_context`` (same forms,
        width ``image_context_dim``).
        """
        owner = "CachedCrossAttention"
        _check_input(owner, "x", x, "[streams, seq_len, dim]", self.dim, self.to_q.weight)
        s, n, _ = x.shape
        q = _split_heads(self.to_q(x), self.num_heads, self.head_dim, self.qk_norm, self.norm_q)
        if context is None and image_context is None:
            _check_layer_context(owner, kv, "cross_kv")
            out = cached_cross_attention(q, kv, self.cache_name)  # type: ignore[arg-type]
            if self.image_cache_name is not None:
                out = out + cached_cross_attention(q, kv, self.image_cache_name)  # type: ignore[arg-type]
            return self.to_out(out.reshape(s, n, -1))
        if kv is not None:
            raise SpecError(f"{owner}: expected either kv (the cache) or context, got both")
        if context is None or (self.image_cache_name is None) != (image_context is None):
            needs = "context and image_context (an I2V layer)" if self.image_cache_name else "context only"
            got = ", ".join(n for n, t in (("context", context), ("image_context", image_context)) if t is not None)
            raise SpecError(f"{owner}: expected {needs} without kv, got {got}")
        out = self._attend(q, _check_context(owner, "context", context, self.context_dim, self.to_k.weight, s), False)
        if image_context is not None:
            ctx = _check_context(owner, "image_context", image_context, self.image_context_dim, self.to_k_img.weight, s)  # type: ignore[arg-type]
            out = out + self._attend(q, ctx, True)
        return self.to_out(out.reshape(s, n, -1))

    def _attend(self, q: torch.Tensor, context: torch.Tensor, image: bool) -> torch.Tensor:
        """``q`` ``[S, n, heads, head_dim]`` to a 3-D context (batch 1 or S) -> ``[S, n, heads, head_dim]``."""
        k, v = self._kv(context, image)
        k, v = k.expand(q.shape[0], -1, -1, -1), v.expand(q.shape[0], -1, -1, -1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=q.shape[2] != k.shape[2]
        )
        return out.transpose(1, 2)

    def extra_repr(self) -> str:
        image = f", image_cache_name={self.image_cache_name!r}" if self.image_cache_name is not None else ""
        return (
            f"dim={self.dim}, num_heads={self.num_heads}, cache_name={self.cache_name!r}{image}, "
            f"context_dim={self.context_dim}, qk_norm={self.qk_norm!r}, param_names={self.param_names!r}"
        )


def populate_cross_attention(
    state: KVState,
    kv_branch: str,
    layers: Iterable[CachedCrossAttention],
    context: torch.Tensor,
    cache_name: str | None = None,
) -> None:
    """Project ``context`` (``[tokens, context_dim]`` or ``[1, tokens, context_dim]``) through every layer
    and publish atomically.

    ``cache_name`` defaults to the layers' (common) ``cache_name``. Naming a layer's
    ``image_cache_name`` projects ``context`` with that layer's image projections (I2V).

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
    image = []
    for i, layer in enumerate(layers):
        # An I2V layer must know which of its projections the name means; a text-only layer may
        # publish its projections under any name (as before image caches existed).
        if layer.image_cache_name is not None and cache_name not in (layer.cache_name, layer.image_cache_name):
            raise SpecError(
                f"{owner}.cache_name: expected {layer.cache_name!r} or {layer.image_cache_name!r} "
                f"(layer {i}'s caches), got {cache_name!r}"
            )
        image.append(layer.image_cache_name is not None and cache_name == layer.image_cache_name)

    def projections() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        with torch.no_grad():
            for layer, is_image in zip(layers, image):
                yield layer._project_kv("CachedCrossAttention.project_kv", context, is_image)

    state.populate_cross_attention(kv_branch, cache_name, projections())
