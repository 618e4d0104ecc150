"""Reference backend (any device): gather the visible pages, dense mask, SDPA.

This is the oracle every other backend is tested against: it applies the
visibility rule of DESIGN.md section 1 literally, as a boolean mask over the
gathered keys (``ForwardLayout.to_dense()``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ardiff_modules.backends.base import AttentionBackend, AttentionPlan
from ardiff_modules.plan import ForwardLayout
from ardiff_modules.pool import KVPool


class ReferencePlan(AttentionPlan):
    def __init__(self, layout: ForwardLayout, device: torch.device) -> None:
        gather, mask = layout.dense_keys
        self.num_streams = layout.num_streams
        self.seq_len = layout.seq_len
        self.write_slots = layout.write_slots.to(device, non_blocking=True)
        self.gather = gather.to(device, non_blocking=True)
        self.mask = mask[:, None].to(device, non_blocking=True)  # [S, 1, n, K]: broadcast over heads

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        k_slots = KVPool.token_slots(k_cache)
        v_slots = KVPool.token_slots(v_cache)
        k_slots.index_copy_(0, self.write_slots, k)
        v_slots.index_copy_(0, self.write_slots, v)
        s, n = self.num_streams, self.seq_len
        keys = k_slots[self.gather].transpose(1, 2)  # [S, Hkv, K, D]
        values = v_slots[self.gather].transpose(1, 2)
        queries = q.view(s, n, q.shape[1], q.shape[2]).transpose(1, 2)  # [S, H, n, D]
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=self.mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        return out.transpose(1, 2).reshape(s * n, q.shape[1], v.shape[2])


class ReferenceBackend(AttentionBackend):
    """Gather + dense-mask SDPA. Correct everywhere, fast nowhere."""

    name = "reference"

    def check_supported(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
        return None

    def plan(self, layout: ForwardLayout, device: torch.device, previous: AttentionPlan | None) -> ReferencePlan:
        return ReferencePlan(layout, device)
