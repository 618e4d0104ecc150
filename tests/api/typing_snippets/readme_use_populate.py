"""The "Use" program of docs/getting_started.md, the part that publishes the prompt (mypy must accept it as written)."""

from __future__ import annotations

import torch
from torch import nn

import ardiff_modules as am

dim, heads, text_dim, layers = 16, 2, 8, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = am.ChunkSelfAttention(dim, heads, qk_norm="full")
        self.cross_attn = am.CachedCrossAttention(dim, heads, "text", context_dim=text_dim)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(layers))


def publish(state: am.KVState, model: Model, text_cond: torch.Tensor, text_uncond: torch.Tensor) -> None:
    for branch, text in (("cond", text_cond), ("uncond", text_uncond)):
        am.populate_cross_attention(state, branch, [block.cross_attn for block in model.blocks], text)


def switch_prompt(state: am.KVState, model: Model, new_text: torch.Tensor) -> None:
    """The prompt switch of the re-cache guide: the layer list kept in a variable first."""
    cross_layers = [b.cross_attn for b in model.blocks]
    state.clear_cross_attention()
    am.populate_cross_attention(state, "cond", cross_layers, new_text)
