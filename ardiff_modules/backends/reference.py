"""Reference backend (any device): gather the visible pages, dense mask, SDPA.

This is the oracle every other backend is tested against: it applies the
visibility rule (docs/design.md, "Semantics": query chunk ``c`` sees the sink chunks, the window
chunks and pending chunks ``0..c`` -- every pending chunk under
``pending_attention="bidirectional"``) literally, as a boolean mask over the gathered keys
(``ForwardLayout.to_dense()``).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from ardiff_modules.backends.base import AttentionBackend, AttentionPlan, PlanRequest
from ardiff_modules.checks import needs_gqa
from ardiff_modules.errors import BackendUnavailableError
from ardiff_modules.layout import page_token_slots
from ardiff_modules.pool import KVPool
from ardiff_modules.quant import dequantize

logger = logging.getLogger(__name__)


class ReferencePlan(AttentionPlan):
    def __init__(self, request: PlanRequest) -> None:
        layout, device = request.layout, request.device
        gather, mask = layout.dense_keys
        self.num_streams = layout.num_streams
        self.seq_len = layout.seq_len
        self.write_pages = layout.write_pages.to(device, non_blocking=True)
        self.page_size = layout.page_size
        self._write_slots: torch.Tensor | None = None
        self.gather = gather.to(device, non_blocking=True)
        # NOTE: streams with fewer keys are padded with slot 0, which belongs to some other stream
        # (or is free). A masked key still enters SDPA's matmul (0 * NaN = NaN), so padded keys
        # and values are zeroed after the gather: another stream's NaN/Inf can never leak in.
        lengths = torch.tensor([len(s.history_pages) + sum(map(len, s.pending_pages)) for s in layout.streams])
        padded = torch.arange(gather.shape[1])[None, :] >= (lengths * layout.page_size)[:, None]
        self.padding = padded[:, None, :, None].to(device) if bool(padded.any()) else None  # [S, 1, K, 1]
        mask = mask.to(device, non_blocking=True)
        self.empty_rows = None
        if request.token_mask is not None or not layout.pending_visible:
            if request.token_mask is not None:
                mask = mask & request.token_mask.to(device)
            # A query that sees no key (a user mask, or a sink segment of a stream without sinks): SDPA
            # gives NaN; the backends' contract is a zero output.
            self.empty_rows = ~mask.any(dim=-1)[:, None, :, None]  # [S, 1, n, 1]
        self.mask = mask[:, None]  # [S, 1, n, K]: broadcast over heads
        self.quantizer = request.quantizer
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "reference plan: %d stream(s) x %d %s chunk(s), %d tokens each, %d gathered keys per stream, %s",
                self.num_streams, layout.num_chunks, layout.pending_attention, self.seq_len, gather.shape[1],
                "visibility rule AND token_mask" if request.token_mask is not None else "visibility rule",
            )

    def __repr__(self) -> str:
        return f"ReferencePlan(streams={self.num_streams}, seq_len={self.seq_len}, keys={self.gather.shape[1]})"

    @property
    def write_slots(self) -> torch.Tensor:
        """See :attr:`AttentionPlan.write_slots` (derived on first use: only compiled graphs read it)."""
        if self._write_slots is None:
            self._write_slots = page_token_slots(self.write_pages, self.page_size)
        return self._write_slots

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        return_lse: bool = False,
        *,
        layer: int = 0,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        page_shape = (-1, *k_cache.shape[1:])
        if self.quantizer is not None:  # FP8 pool: stored with the layer's scales, read back dequantized
            k_store, v_store = self.quantizer.quantize_layer(layer, k, v)
        else:
            k_store, v_store = _as(k, k_cache.dtype), _as(v, v_cache.dtype)
        _raw(k_cache).index_copy_(0, self.write_pages, _raw(k_store.reshape(page_shape)))
        _raw(v_cache).index_copy_(0, self.write_pages, _raw(v_store.reshape(page_shape)))
        return self.attend(q, k_cache, v_cache, scale, return_lse, layer=layer)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        return_lse: bool = False,
        *,
        layer: int = 0,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        k_slots = KVPool.token_slots(k_cache)
        v_slots = KVPool.token_slots(v_cache)
        s, n = self.num_streams, self.seq_len
        # [S, K, Hkv, D] in the storage dtype
        k_seen = _raw(k_slots)[self.gather].view(k_slots.dtype)
        v_seen = _raw(v_slots)[self.gather].view(v_slots.dtype)
        if self.quantizer is not None:
            k_scale, v_scale = self.quantizer.layer_scales(layer)
            k_seen, v_seen = dequantize(k_seen, k_scale, q.dtype), dequantize(v_seen, v_scale, q.dtype)
        keys = _as(k_seen.transpose(1, 2), q.dtype)  # [S, Hkv, K, D], attended in the compute dtype
        values = _as(v_seen.transpose(1, 2), q.dtype)
        if self.padding is not None:
            keys = keys.masked_fill(self.padding, 0)
            values = values.masked_fill(self.padding, 0)
        queries = q.reshape(s, n, q.shape[1], q.shape[2]).transpose(1, 2)  # [S, H, n, D]
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=self.mask, scale=scale, enable_gqa=needs_gqa(q.shape[1], k_cache.shape[-2])
        )
        if self.empty_rows is not None:
            out = out.masked_fill(self.empty_rows, 0)
        # contiguous like the ops' fake outputs: for one stream the reshape is a strided view
        out = out.transpose(1, 2).reshape(s * n, q.shape[1], v_cache.shape[-1]).contiguous()
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


def _raw(t: torch.Tensor) -> torch.Tensor:
    """FP8 tensors as their bytes: index_copy_ / gathers have no float8 kernels on every device."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


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

    def __repr__(self) -> str:
        return "ReferenceBackend()"
