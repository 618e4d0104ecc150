"""Reference backend (any device): gather the visible pages, dense mask, SDPA.

This is the oracle every other backend is tested against: it applies the
visibility rule of DESIGN.md section 1 literally, as a boolean mask over the
gathered keys (``ForwardLayout.to_dense()``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ardiff_modules.backends.base import AttentionBackend, AttentionPlan, PlanRequest
from ardiff_modules.errors import BackendUnavailableError
from ardiff_modules.pool import KVPool


class ReferencePlan(AttentionPlan):
    def __init__(self, request: PlanRequest) -> None:
        layout, device = request.layout, request.device
        gather, mask = layout.dense_keys
        self.num_streams = layout.num_streams
        self.seq_len = layout.seq_len
        self.write_pages = layout.write_pages.to(device, non_blocking=True)
        self.gather = gather.to(device, non_blocking=True)
        # NOTE: streams with fewer keys are padded with slot 0, which belongs to some other stream
        # (or is free). A masked key still enters SDPA's matmul (0 * NaN = NaN), so padded keys
        # and values are zeroed after the gather: another stream's NaN/Inf can never leak in.
        lengths = torch.tensor([len(s.history_pages) + sum(map(len, s.pending_pages)) for s in layout.streams])
        padded = torch.arange(gather.shape[1])[None, :] >= (lengths * layout.page_size)[:, None]
        self.padding = padded[:, None, :, None].to(device) if bool(padded.any()) else None  # [S, 1, K, 1]
        mask = mask.to(device, non_blocking=True)
        self.empty_rows = None
        if request.token_mask is not None:
            mask = mask & request.token_mask.to(device)
            # A query that sees no key: SDPA gives NaN; the backends' contract is a zero output.
            self.empty_rows = ~mask.any(dim=-1)[:, None, :, None]  # [S, 1, n, 1]
        self.mask = mask[:, None]  # [S, 1, n, K]: broadcast over heads

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        page_shape = (-1, *k_cache.shape[1:])
        k_cache.index_copy_(0, self.write_pages, _as(k.reshape(page_shape), k_cache.dtype))
        v_cache.index_copy_(0, self.write_pages, _as(v.reshape(page_shape), v_cache.dtype))
        k_slots = KVPool.token_slots(k_cache)
        v_slots = KVPool.token_slots(v_cache)
        s, n = self.num_streams, self.seq_len
        keys = _as(k_slots[self.gather].transpose(1, 2), q.dtype)  # [S, Hkv, K, D], attended in the compute dtype
        values = _as(v_slots[self.gather].transpose(1, 2), q.dtype)
        if self.padding is not None:
            keys = keys.masked_fill(self.padding, 0)
            values = values.masked_fill(self.padding, 0)
        queries = q.reshape(s, n, q.shape[1], q.shape[2]).transpose(1, 2)  # [S, H, n, D]
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=self.mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        if self.empty_rows is not None:
            out = out.masked_fill(self.empty_rows, 0)
        out = out.transpose(1, 2).reshape(s * n, q.shape[1], v.shape[2])
        if not return_lse:
            return out
        return out, self._lse(queries, keys, scale)

    def _lse(self, queries: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
        """float32 ``[S * n, H]`` log-sum-exp of the masked, scaled logits (``-inf`` where no key is visible)."""
        s, heads, n, _ = queries.shape
        keys = keys.repeat_interleave(heads // keys.shape[1], dim=1)  # GQA: one key head per query group
        logits = torch.matmul(queries.float(), keys.float().transpose(-1, -2)) * scale  # [S, H, n, K]
        lse = torch.logsumexp(logits.masked_fill(~self.mask, float("-inf")), dim=-1)
        return lse.transpose(1, 2).reshape(s * n, heads)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


class ReferenceBackend(AttentionBackend):
    """Gather + dense-mask SDPA. Correct everywhere, fast nowhere."""

    name = "reference"
    replans_in_place = False  # every forward gets a new plan object

    def check_supported(
        self, device: torch.device, dtype: torch.dtype, head_dim: int, kv_dtype: torch.dtype | None = None
    ) -> None:
        return None

    def plan(self, request: PlanRequest, previous: AttentionPlan | None) -> ReferencePlan:
        if request.static:
            raise BackendUnavailableError(
                "static plans (CUDA-graph replay) need the 'flashinfer' backend; the reference backend "
                "re-sizes its gathered keys every forward"
            )
        return ReferencePlan(request)
