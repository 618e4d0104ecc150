"""The session state machine over an FP8 pool: every rule and check of ``tests/session/test_session_properties.py``.

:class:`FP8SessionStateMachine` runs every rule and check of the float machine over an FP8 pool
(``kv_dtype="float8_e4m3fn"``, fixed scales set by ``set_kv_scales`` right after each cache
is created): the model's contents are the FP8 round trip of what each forward wrote, compared
bit for bit (as values and as bytes), and each output is checked against a softmax over them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import invariant

from ardiff_modules import ForwardContext, KVCache
from ardiff_modules.quant import dequantize, quantize
from tests.support.pool_model import PoolContents, same_bits
from tests.support.session_machine import SessionStateMachine
from tests.support.session_model import CacheModel, HEAD_DIM

FP8 = torch.float8_e4m3fn
#: Fixed K/V scales ``[layers, 2 (K, V), kv_heads]`` set before any write: a different one per (layer, K|V),
#: so K and V (or two layers) quantized or dequantized with each other's scale read back wrong.
FP8_SCALES = torch.tensor([[[0.01], [0.02]], [[0.03], [0.05]]], dtype=torch.float32)
#: Codes per K/V element: the positive e4m3 bytes 0x00..0x7e (0x7f is NaN); two per token give its id.
_FP8_CODES = 0x7F


def fp8_decode(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A pool's bytes ``[layers, 2, pages, page_size, heads, dim]`` (uint8) as float32, each (layer, K|V) with its scale.

    The library's own ``dequantize`` on the same inputs: what the reference backend reads back.
    """
    out = torch.empty(codes.shape, dtype=torch.float32)
    for layer in range(codes.shape[0]):
        for kind in range(2):
            out[layer, kind] = dequantize(codes[layer, kind].view(FP8), scales[layer, kind], torch.float32)
    return out


class FP8PoolContents(PoolContents):
    """:class:`PoolContents` of an FP8 pool: the bytes the model says each page holds (``codes``) and their
    float32 values (``kv``, inherited comparisons): a write is ``quantize(x, scale)`` of the (layer, K|V)."""

    def __init__(self, pool_kv: torch.Tensor, scales: torch.Tensor) -> None:
        assert pool_kv.dtype == FP8, pool_kv.dtype
        self.scales = scales.clone()
        self.codes = pool_kv.detach().view(torch.uint8).clone()
        self.kv = fp8_decode(self.codes, self.scales)

    def write(self, layer: int, pages, k: torch.Tensor, v: torch.Tensor) -> None:
        shape = (len(pages), *self.kv.shape[3:])
        index = torch.tensor(list(pages), dtype=torch.int64)
        for kind, x in enumerate((k, v)):
            scale = self.scales[layer, kind]
            stored = quantize(x.reshape(-1, *self.kv.shape[-2:]), scale)
            self.codes[layer, kind].index_copy_(0, index, stored.view(torch.uint8).reshape(shape))
            self.kv[layer, kind].index_copy_(0, index, dequantize(stored, scale, torch.float32).reshape(shape))

    def copy(self, src, dst) -> None:  # noqa: ANN001
        super().copy(src, dst)
        self.codes[:, :, list(dst)] = self.codes[:, :, list(src)]

    def put(self, pages, data: torch.Tensor) -> None:  # noqa: ANN001
        """The bytes too: ``data`` holds round-tripped values, so quantizing them again gives the stored codes.

        NOTE: without this a resumed chunk's bytes stayed those of the pages it left (the float values moved,
        the codes did not), and the byte check flagged pages no forward wrote.
        """
        super().put(pages, data)
        index = list(pages)
        for layer in range(self.codes.shape[0]):
            for kind in range(2):
                stored = quantize(data[layer, kind], self.scales[layer, kind])
                self.codes[layer, kind, index] = stored.view(torch.uint8)

    def mismatched_byte_pages(self, pool_kv: torch.Tensor) -> list[int]:
        """Pages whose FP8 bytes differ between the model and ``pool_kv``."""
        a, b = self.codes, pool_kv.view(torch.uint8)
        diff = (a != b).reshape(a.shape[0], a.shape[1], a.shape[2], -1).any(-1).any(0).any(0)
        return diff.nonzero().flatten().tolist()


class FP8SessionStateMachine(SessionStateMachine):
    """The session machine over an FP8 pool (``kv_dtype="float8_e4m3fn"``, fixed :data:`FP8_SCALES`).

    Every check of :class:`SessionStateMachine` holds with the model's contents being the FP8 round trip
    of what each forward wrote (``dequantize(quantize(x, scale), scale)`` with the layer's K or V scale),
    compared bit for bit: the pool and every visible chunk (as values, and here also as bytes), the K/V
    each open forward gathers, and each output against a softmax over those round-tripped keys/values
    (which catches the backend dequantizing with a wrong scale). K/V carry their id in their FP8 bytes
    (two codes per token), so the gathered keys stay distinguishable after quantization.
    """

    # NOTE: uniform draws only for now: FP8 pools with retention groups work (per-lane scales), but this machine's
    # ids and FP8_SCALES are one kv head's.
    DRAWS_GROUPS = False
    # A uniform SelectedFramesPolicy too: with one 2-wide head and ids below 127 every key here is (0, b), so its
    # scores tie and the model checks that the library kept a top k (ForwardModel.m_choose), then follows its copies.
    DRAWS_SELECTION = True

    def spec_extra(self) -> dict[str, Any]:
        return {"kv_dtype": "float8_e4m3fn"}

    def configure_cache(self, cache: KVCache) -> None:
        cache.set_kv_scales(FP8_SCALES)

    def pool_model(self, cache: KVCache, lane: int = 0) -> PoolContents:
        return FP8PoolContents(cache._lanes[lane].pool.kv, FP8_SCALES)

    def pool_values(self, cm: CacheModel, lane: int = 0) -> torch.Tensor:
        return fp8_decode(cm.cache._lanes[lane].pool.kv.view(torch.uint8), FP8_SCALES)

    def read_back(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k_scale, v_scale = FP8_SCALES[layer]
        return (
            dequantize(quantize(k, k_scale), k_scale, k.dtype),
            dequantize(quantize(v, v_scale), v_scale, v.dtype),
        )

    def layer_inputs(self, ctx: ForwardContext, layer: int, mode: str):
        """As the float machine's, but K/V ids survive FP8: element codes ``(a, b)`` for K, ``(-b, -a)`` for V."""
        if mode == "module":
            return super().layer_inputs(ctx, layer, mode)
        s, n = ctx.positions.shape
        q = torch.randn(s, n, 2, HEAD_DIM, generator=self.gen)
        ids = torch.arange(self.next_id, self.next_id + s * n) % (_FP8_CODES * _FP8_CODES)
        self.next_id += s * n
        a, b = ids // _FP8_CODES, ids % _FP8_CODES
        k_codes = torch.stack([a, b], dim=-1).to(torch.uint8)  # [s * n, 2]
        v_codes = torch.stack([b, a], dim=-1).to(torch.uint8) | 0x80  # sign bit: negative (0x80 is -0.0)
        k_codes = k_codes.repeat(1, HEAD_DIM // 2)
        v_codes = v_codes.repeat(1, HEAD_DIM // 2)
        k_scale, v_scale = FP8_SCALES[layer]
        k = dequantize(k_codes.view(FP8)[:, None], k_scale, torch.float32)  # [s * n, 1, dim]
        v = dequantize(v_codes.view(FP8)[:, None], v_scale, torch.float32)
        # the ids are exact in FP8: quantizing gives back their codes
        assert torch.equal(quantize(k, k_scale).view(torch.uint8)[:, 0], k_codes)
        assert torch.equal(quantize(v, v_scale).view(torch.uint8)[:, 0], v_codes)
        return q, k.view(s, n, 1, HEAD_DIM), v.view(s, n, 1, HEAD_DIM)

    @invariant()
    def fp8_pool_bytes_match_model(self) -> None:
        """The pool's dtype, its scales (never recalibrated) and its bytes, page by page, == the model's."""
        for cm in self.open_caches:
            pool = cm.cache._pool
            assert pool.kv.dtype == FP8, pool.kv.dtype
            assert same_bits(pool.scales.cpu(), FP8_SCALES), f"{cm.label}: scales {pool.scales.tolist()} changed"
            bad = cm.pool.mismatched_byte_pages(pool.kv)
            assert not bad, f"{cm.label}: pages {bad} hold FP8 bytes no open forward wrote there"


TestFP8SessionStateMachine = pytest.mark.slow(FP8SessionStateMachine.TestCase)
# Fewer runs than the float machine (CI time): half the profile's examples, its step count.
TestFP8SessionStateMachine.settings = settings(max_examples=max(1, settings.default.max_examples // 2))
