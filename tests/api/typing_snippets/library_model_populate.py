"""The reference model's docstring pattern and the other shapes a layer list takes (mypy must accept them)."""

from __future__ import annotations

import torch
from torch import nn

from ardiff_modules import CachedCrossAttention, KVState, populate_cross_attention
from ardiff_modules.models.wan_causal_dit import WanConfig, build_model


def publish_wan(state: KVState, text: torch.Tensor) -> None:
    model = build_model(WanConfig.preset("tiny"))
    populate_cross_attention(state, "cond", [b.cross for b in model.blocks], model.embed_text(text))


def publish_shapes(state: KVState, context: torch.Tensor) -> None:
    typed: list[CachedCrossAttention] = [CachedCrossAttention(16, 2), CachedCrossAttention(16, 2)]
    populate_cross_attention(state, "cond", typed, context)                        # a list of the class
    populate_cross_attention(state, "cond", nn.ModuleList(typed), context)         # an nn.ModuleList
    populate_cross_attention(state, "cond", tuple(typed), context, cache_name="text")  # a tuple
    populate_cross_attention(state, "cond", (layer for layer in typed), context)  # a generator
