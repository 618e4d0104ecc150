"""A tiny stock diffusers ``WanTransformer3DModel`` (every weight perturbed), for the diffusers tests and their
multi-process variants. Needs the optional ``diffusers`` extra: import this module only where it is installed."""

from __future__ import annotations

import torch
from diffusers import WanTransformer3DModel

#: The text encoder width the tiny model's ``text_dim`` takes.
TEXT_DIM = 16


def tiny_wan(num_layers: int = 2, seed: int = 0, **overrides) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    config = {
        "patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 16, "in_channels": 4,
        "out_channels": 4, "text_dim": TEXT_DIM, "freq_dim": 16, "ffn_dim": 32, "num_layers": num_layers,
        "cross_attn_norm": True,
    }
    config.update(overrides)
    model = WanTransformer3DModel(**config).eval()
    with torch.no_grad():  # perturb every weight: RMSNorm gains of 1 would hide a skipped norm
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model
