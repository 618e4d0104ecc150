"""FP8 KV cache (``kv_dtype="float8_e4m3fn"``): semantics on the CPU through the reference backend."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from streaming_model import LibraryStreaming, NaiveStreaming, TinyStreamingModel, play, rollout_events

import ardiff_modules as am
from ardiff_modules.quant import DEFAULT_HEADROOM, FP8_E4M3_MAX, amax_scale, dequantize, quantize, quantize_query

FP8 = "float8_e4m3fn"
CHUNK = 4


def _roundtrip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return dequantize(quantize(x, scale), scale, x.dtype)


# ------------------------------------------------------------------ the format


def test_quantize_roundtrip_error_is_fp8_rounding_and_out_of_range_values_clamp() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 16, generator=g)
    scale = amax_scale(x, DEFAULT_HEADROOM)
    back = _roundtrip(x, scale)
    # e4m3: 3 mantissa bits -> half an ulp is 2^-4 relative for normal numbers.
    normal = (x.abs() / scale[:, None]) >= 2.0**-6
    rel = ((back - x).abs() / x.abs())[normal]
    assert float(rel.max()) <= 2.0**-4 + 1e-6
    huge = torch.full((2, 3, 16), 1e6)
    clamped = _roundtrip(huge, scale)
    assert bool(torch.isfinite(clamped).all())  # torch's plain cast would give NaN
    torch.testing.assert_close(clamped, (FP8_E4M3_MAX * scale)[None, :, None].expand_as(huge))


def test_query_quantization_is_per_head_and_uses_the_whole_range() -> None:
    q = torch.randn(10, 4, 8) * torch.tensor([1.0, 10.0, 0.1, 1000.0])[:, None]
    q8, scale = quantize_query(q)
    assert q8.dtype == torch.float8_e4m3fn and scale.shape == (4,)
    torch.testing.assert_close(q8.float().abs().amax(dim=(0, 2)), torch.full((4,), FP8_E4M3_MAX))


# ------------------------------------------------------------------ the cache

SPEC = am.KVCacheSpec(
    num_layers=2, num_kv_heads=2, head_dim=8, chunk_size=CHUNK, page_size=2, sink_chunks=1, window_chunks=2,
    branches=("cond", "uncond"), cross_attention=(am.CrossAttentionSpec("text", 3),), dtype="bfloat16",
    num_qo_heads=4,
)


def test_fp8_pool_halves_bytes_and_doubles_the_sessions_that_fit() -> None:
    bf16 = am.KVCache(SPEC, budget_bytes=1 << 20, backend="reference")
    fp8 = am.KVCache(dataclasses.replace(SPEC, kv_dtype=FP8), budget_bytes=1 << 20, backend="reference")
    assert fp8.pool.kv.dtype == torch.float8_e4m3fn and fp8.dtype == torch.bfloat16
    assert fp8.pool.bytes_per_page * 2 == bf16.pool.bytes_per_page
    assert fp8.pool.num_pages == 2 * bf16.pool.num_pages
    # Without the re-cache reserve (a page count, the same for both: it costs half the bytes in FP8).
    assert fp8.sessions_that_fit(recache=False) == 2 * bf16.sessions_that_fit(recache=False) > 0
    assert fp8.recache_reserve() == bf16.recache_reserve() > 0
    assert fp8.sessions_that_fit() > bf16.sessions_that_fit()


def test_first_write_calibrates_each_layer_and_later_writes_never_change_the_scales() -> None:
    cache = am.KVCache(dataclasses.replace(SPEC, kv_dtype=FP8), num_pages=32, backend="reference")
    state = cache.open_session()
    g = torch.Generator().manual_seed(1)
    kvs = []
    for step in range(4):
        k = torch.randn(2, CHUNK, 2, 8, generator=g).bfloat16() * (step + 1)
        v = torch.randn(2, CHUNK, 2, 8, generator=g).bfloat16() * (step + 1)
        q = torch.randn(2, CHUNK, 4, 8, generator=g).bfloat16()
        with state.prepare_forward(None, CHUNK, commit_current=True) as fwd:
            for layer, ctx in enumerate(fwd.layers):
                am.chunk_attention(q, k * (layer + 1), v, ctx)
        kvs.append((k, v))
        if step == 0:
            first = cache.pool.scales.clone()
    k0, v0 = kvs[0]
    for layer in range(2):
        expected_k = amax_scale((k0 * (layer + 1)).reshape(-1, 2, 8), DEFAULT_HEADROOM)
        torch.testing.assert_close(first[layer, 0], expected_k)
        torch.testing.assert_close(first[layer, 1], amax_scale(v0.reshape(-1, 2, 8), DEFAULT_HEADROOM))
    torch.testing.assert_close(cache.pool.scales, first)  # 4x larger chunks later: same scales
    assert bool(torch.isfinite(cache.pool.kv.float()).all())


def test_set_kv_scales_before_any_write_only_and_validated() -> None:
    cache = am.KVCache(dataclasses.replace(SPEC, kv_dtype=FP8), num_pages=32, backend="reference")
    with pytest.raises(am.TensorMismatchError, match=r"\[2, 2, 2\]"):
        cache.set_kv_scales(torch.ones(2, 2))
    with pytest.raises(am.TensorMismatchError, match="positive"):
        cache.set_kv_scales(torch.zeros(2, 2, 2))
    cache.set_kv_scales(torch.full((2, 2, 2), 0.5))
    state = cache.open_session()
    x = torch.ones(1, CHUNK, 2, 8, dtype=torch.bfloat16)
    with state.prepare_forward(("cond",), CHUNK) as fwd:
        am.chunk_attention(torch.ones(1, CHUNK, 4, 8, dtype=torch.bfloat16), x, x, fwd.layers[0])
    before = cache.pool.scales.clone()
    with pytest.raises(am.KVScalesFixedError, match="before"):
        cache.set_kv_scales(torch.ones(2, 2, 2))
    torch.testing.assert_close(cache.pool.scales, before)
    # ones / 0.5 = 2 exactly in e4m3
    assert bool((cache.pool.kv[0, 0].float()[cache.pool.kv[0, 0].float() != 0] == 2).all())


def test_set_kv_scales_on_a_float_pool_is_refused() -> None:
    cache = am.KVCache(SPEC, num_pages=8, backend="reference")
    with pytest.raises(am.SpecError, match="float8"):
        cache.set_kv_scales(torch.ones(2, 2, 2))


# ------------------------------------------------------------------ the oracle


class QuantizedOracle(NaiveStreaming):
    """The cache-free oracle with every K/V rounded through FP8 at fixed per-layer scales."""

    def __init__(self, *args, scales: torch.Tensor, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.scales = scales

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _roundtrip(k, self.scales[layer, 0]), _roundtrip(v, self.scales[layer, 1])


@pytest.mark.parametrize(
    "page_size,sink,window,kv_heads",
    [(1, 1, 2, 4), pytest.param(2, 2, 1, 2, marks=pytest.mark.slow), pytest.param(2, 1, None, 1, marks=pytest.mark.slow)],
)
def test_fp8_rollout_equals_the_oracle_with_fp8_rounded_kv(page_size: int, sink: int, window: int | None,
                                                            kv_heads: int) -> None:
    torch.manual_seed(0)
    model = TinyStreamingModel(kv_heads=kv_heads).eval()
    spec = dataclasses.replace(model.spec(CHUNK, page_size, sink, window), kv_dtype=FP8)
    pages = 2 * 24 * spec.pages_per_chunk
    events = rollout_events(16, CHUNK, model.dim, model.context_dim, short_chunk=None)
    scales = torch.rand(spec.num_layers, 2, kv_heads, generator=torch.Generator().manual_seed(3)) * 0.02 + 0.005
    library = LibraryStreaming(model, spec, pages)
    library.cache.set_kv_scales(scales)
    actual = play(library, events)
    expected = play(QuantizedOracle(model, CHUNK, sink, window, scales=scales), events)
    exact = play(NaiveStreaming(model, CHUNK, sink, window), events)
    worst = 0.0
    for i, (a, e, x) in enumerate(zip(actual, expected, exact)):
        torch.testing.assert_close(a, e, atol=3e-5, rtol=3e-5, msg=lambda m, i=i: f"forward {i}: {m}")
        worst = max(worst, float((a - x).norm() / x.norm()))
    assert 0 < worst < 0.1  # FP8 rounding is visible against the unquantized oracle, and small
    library.state.close()
    assert library.cache.allocator.num_free == pages


def test_spec_takes_torch_dtypes_and_names_them() -> None:
    spec = dataclasses.replace(SPEC, dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn)
    assert (spec.dtype, spec.kv_dtype, spec.cache_dtype) == ("bfloat16", "float8_e4m3fn", "float8_e4m3fn")
    with pytest.raises(am.SpecError, match=r"kv_dtype: expected None or one of .* got 'int8'"):
        dataclasses.replace(SPEC, kv_dtype=torch.int8)
    with pytest.raises(am.SpecError, match=r"dtype: expected one of .* got 'float8_e4m3fn'"):
        dataclasses.replace(SPEC, dtype=torch.float8_e4m3fn)  # FP8 is a storage format only
