"""Checkpoint naming of the attention layers: which submodule path each role has in each layout.

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
that replace a submodule by its checkpoint name replace what the layer uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal

import torch
from torch import nn

from ardiff_modules.errors import SpecError

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
DIFFUSERS_IGNORED_PREFIXES = ("to_qkv.", "to_kv.", "to_added_kv.", "norm_added_q.")


def check_param_names(owner: str, param_names: Any) -> str:
    if not isinstance(param_names, str) or param_names not in PARAM_NAMES:
        raise SpecError(f"{owner}.param_names: expected 'ardiff', 'wan' or 'diffusers', got {param_names!r}")
    return param_names



class _OutProjection(nn.ModuleList):
    """diffusers' ``to_out = ModuleList([Linear, Dropout])``, callable: applies both in order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in self:
            x = module(x)
        return x


class CheckpointNamed(nn.Module):
    """Registers projections under the names of ``param_names`` and reads them back by role."""

    param_names: str
    _paths: dict[str, str]

    def _init_names(self, owner: str, param_names: Any) -> None:
        self.param_names = check_param_names(owner, param_names)
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



def rename_attention_keys(
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


