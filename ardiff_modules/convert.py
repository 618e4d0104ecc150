"""Checkpoint converters between the attention-layer namings of Wan2.1, diffusers and this package.

Most ports need none of this: build the layers with the checkpoint's naming
(``ChunkSelfAttention(..., param_names="wan")``, or ``ChunkSelfAttention.from_wan(block.self_attn)``)
and load the checkpoint as it is. These functions rename keys when a model and a checkpoint use
different namings. No weights are permuted: the package's RoPE pairs channels ``(2i, 2i + 1)`` like
Wan and diffusers (``layout="interleaved"``, the default).

Names per role (see :data:`~ardiff_modules.modules.ATTENTION_PARAM_NAMES`):

==============  ======================  ===================  ==========================
role            ``"ardiff"``            ``"wan"``            ``"diffusers"``
==============  ======================  ===================  ==========================
q, k, v, out    to_q, to_k, to_v,       q, k, v, o           to_q, to_k, to_v, to_out.0
                to_out
q / k norm      norm_q, norm_k          norm_q, norm_k       norm_q, norm_k
image k, v      to_k_img, to_v_img      k_img, v_img         add_k_proj, add_v_proj
image k norm    norm_k_img              norm_k_img           norm_added_k
==============  ======================  ===================  ==========================
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ardiff_modules.errors import SpecError
from ardiff_modules.modules.naming import (
    ATTENTION_PARAM_NAMES,
    ParamNames,
    check_param_names,
    rename_attention_keys,
)

__all__ = ["attention_key_map", "convert_attention_state_dict", "convert_wan_state_dict"]


def attention_key_map(source: ParamNames, target: ParamNames) -> dict[str, str]:
    """Submodule path of each attention role in ``source`` naming -> its path in ``target`` naming.

    E.g. ``attention_key_map("wan", "diffusers")["o"] == "to_out.0"``; a parameter key is
    ``<path>.weight`` / ``<path>.bias``.
    """
    src = ATTENTION_PARAM_NAMES[check_param_names("attention_key_map.source", source)]
    dst = ATTENTION_PARAM_NAMES[check_param_names("attention_key_map.target", target)]
    return {src[role]: dst[role] for role in src}


def _check_state_dict(where: str, state_dict: Any) -> None:
    """``state_dict`` is a mapping with string keys (what the renaming reads; the values are not touched)."""
    if not isinstance(state_dict, Mapping):
        raise SpecError(f"{where}: expected a mapping of str -> tensor (a state dict), got {type(state_dict).__name__}")
    bad = next((k for k in state_dict if not isinstance(k, str)), None)
    if bad is not None:
        raise SpecError(f"{where}: expected str keys, got {bad!r} ({type(bad).__name__})")


def _module_names(where: str, modules: str | Iterable[str]) -> tuple[str, ...]:
    names = (modules,) if isinstance(modules, str) else tuple(modules) if isinstance(modules, Iterable) else ()
    if not names or not all(isinstance(n, str) and n and "." not in n for n in names):
        raise SpecError(f"{where}: expected attribute names of attention modules (e.g. 'self_attn'), got {modules!r}")
    return names


def convert_attention_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    source: ParamNames,
    target: ParamNames,
    *,
    modules: str | Iterable[str] | None = None,
    rename: Mapping[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """Rename the attention-layer keys of ``state_dict`` from ``source`` to ``target`` naming.

    Parameters
    ----------
    state_dict:
        Name -> tensor. Tensors are not copied.
    source, target:
        ``"ardiff"``, ``"wan"`` or ``"diffusers"``.
    modules:
        ``None``: ``state_dict`` is one layer's (keys like ``"q.weight"``). Otherwise the attribute
        name(s) of the attention modules in a whole model's state dict (e.g. ``("self_attn",
        "cross_attn")``): in keys ``<anything>.<module>.<path>.<param>`` the role ``<path>`` is renamed
        (other paths under the module are kept), every other key is kept as it is.
    rename:
        Optional new attribute names for those modules (e.g. ``{"self_attn": "attn"}``).

    Returns
    -------
    A new dict; raises :class:`~ardiff_modules.SpecError` if two keys would collide, or if
    ``state_dict`` is not a mapping with str keys.
    """
    where = "convert_attention_state_dict"
    _check_state_dict(f"{where}.state_dict", state_dict)
    check_param_names(f"{where}.source", source)
    check_param_names(f"{where}.target", target)
    if modules is None:
        if rename:
            raise SpecError(f"{where}.rename: expected None without modules, got {rename!r}")
        return rename_attention_keys(state_dict, source, target)
    names = _module_names(f"{where}.modules", modules)
    rename = dict(rename or {})
    unknown = sorted(set(rename) - set(names))
    if unknown or not all(isinstance(v, str) and v and "." not in v for v in rename.values()):
        raise SpecError(f"{where}.rename: expected new attribute names for {names}, got {rename!r}")
    src, dst = ATTENTION_PARAM_NAMES[source], ATTENTION_PARAM_NAMES[target]
    role_of = {path: role for role, path in src.items()}
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        new = key
        parts = key.split(".")
        # The last segment naming one of `modules`: rename it, and the role path after it.
        for i in range(len(parts) - 2, -1, -1):
            if parts[i] in names:
                role = role_of.get(".".join(parts[i + 1 : -1]))
                inner = [dst[role], parts[-1]] if role is not None else parts[i + 1 :]
                new = ".".join([*parts[:i], rename.get(parts[i], parts[i]), *inner])
                break
        if new in out:
            raise SpecError(f"{where}: two keys map onto {new!r} (from {source!r} to {target!r} names)")
        out[new] = value
    return out


def convert_wan_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    param_names: ParamNames = "ardiff",
    *,
    self_attn: str = "self_attn",
    cross_attn: str = "cross_attn",
) -> dict[str, torch.Tensor]:
    """Map a Wan2.1 ``WanModel`` checkpoint (t2v or i2v; Self-Forcing & co. use the same keys, possibly
    under a prefix such as ``model.``, which is kept) onto a model whose blocks hold this package's layers.

    Renames ``<...>.self_attn.{q,k,v,o,norm_q,norm_k}`` and ``<...>.cross_attn.{...,k_img,v_img,norm_k_img}``
    to ``param_names`` naming, under the attribute names ``self_attn`` / ``cross_attn`` of your blocks;
    every other key is kept. Nothing is permuted: with the default interleaved RoPE the attention equals
    Wan's. A model built with ``param_names="wan"`` and Wan's attribute names loads the checkpoint as is.
    """
    _check_state_dict("convert_wan_state_dict.state_dict", state_dict)
    for name, value in (("self_attn", self_attn), ("cross_attn", cross_attn)):
        if not isinstance(value, str) or not value or "." in value:
            raise SpecError(f"convert_wan_state_dict.{name}: expected an attribute name, got {value!r}")
    return convert_attention_state_dict(
        state_dict, "wan", param_names, modules=("self_attn", "cross_attn"),
        rename={"self_attn": self_attn, "cross_attn": cross_attn},
    )
