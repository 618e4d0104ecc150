"""FP8 KV cache (``kv_dtype="float8_e4m3fn"``): semantics on the CPU through the reference backend."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.quant import DEFAULT_HEADROOM, FP8_E4M3_MAX, amax_scale, dequantize, quantize, quantize_query
from tests.support.streaming_model import LibraryStreaming, NaiveStreaming, TinyStreamingModel, play, rollout_events

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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_amax_scale_is_exactly_the_per_head_amax_and_reduces_rows_first(dtype: torch.dtype) -> None:
    """Bit-identical to one reduction over (tokens, dim), but reduced per (token, head) row first: as a single
    reduction a compiled graph gave each head one thread block (57 ms of the FP8 method's 288 ms step, H100)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(37, 5, 24, generator=g) * torch.tensor([1.0, 1e-3, 7.0, 300.0, 0.5])[:, None]).to(dtype)
    x[11, 3, 5] = -4096.0  # the largest magnitude is negative and alone in its head
    expected = x.float().abs().amax(dim=(0, 2)) * (DEFAULT_HEADROOM / FP8_E4M3_MAX)
    assert torch.equal(amax_scale(x, DEFAULT_HEADROOM), expected)

    class FirstReduction(TorchDispatchMode):
        shape: tuple[int, ...] | None = None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            if self.shape is None and func.overloadpacket.__name__ in ("linalg_vector_norm", "amax"):
                self.shape = tuple(out.shape)
            return out

    with FirstReduction() as seen:
        amax_scale(x, DEFAULT_HEADROOM)
    assert seen.shape == (37, 5), f"expected the first reduction over x to keep [tokens, heads], got {seen.shape}"


# ------------------------------------------------------------------ the cache

SPEC = am.KVCacheSpec(
    num_layers=2, num_kv_heads=2, head_dim=8, chunk_size=CHUNK, page_size=2, sink_chunks=1, window_chunks=2,
    branches=("cond", "uncond"), cross_attention=(am.CrossAttentionSpec("text", 3),), dtype="bfloat16",
    num_qo_heads=4,
)


def test_fp8_pool_halves_bytes_and_doubles_the_sessions_that_fit() -> None:
    bf16 = am.KVCache(SPEC, budget_bytes=1 << 20, backend="reference")
    fp8 = am.KVCache(dataclasses.replace(SPEC, kv_dtype=FP8), budget_bytes=1 << 20, backend="reference")
    assert fp8._pool.kv.dtype == torch.float8_e4m3fn and fp8.dtype == torch.bfloat16
    assert fp8._pool.bytes_per_page * 2 == bf16._pool.bytes_per_page
    assert fp8._pool.num_pages == 2 * bf16._pool.num_pages
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
            first = cache._pool.scales.clone()
    k0, v0 = kvs[0]
    for layer in range(2):
        expected_k = amax_scale((k0 * (layer + 1)).reshape(-1, 2, 8), DEFAULT_HEADROOM)
        torch.testing.assert_close(first[layer, 0], expected_k)
        torch.testing.assert_close(first[layer, 1], amax_scale(v0.reshape(-1, 2, 8), DEFAULT_HEADROOM))
    torch.testing.assert_close(cache._pool.scales, first)  # 4x larger chunks later: same scales
    assert bool(torch.isfinite(cache._pool.kv.float()).all())


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
    before = cache._pool.scales.clone()
    with pytest.raises(am.errors.KVScalesFixedError, match="before"):
        cache.set_kv_scales(torch.ones(2, 2, 2))
    torch.testing.assert_close(cache._pool.scales, before)
    # ones / 0.5 = 2 exactly in e4m3
    assert bool((cache._pool.kv[0, 0].float()[cache._pool.kv[0, 0].float() != 0] == 2).all())


@pytest.mark.parametrize(
    ("scales", "got"),
    [
        (torch.ones(2, 2, 2, device="meta"), "dtype torch.float32 on meta"),
        (torch.ones(2, 2, 2, dtype=torch.complex64), "dtype torch.complex64 on cpu"),
        (torch.ones(2, 2, 2, dtype=torch.bool), "dtype torch.bool on cpu"),
    ],
    ids=["meta", "complex", "bool"],
)
def test_set_kv_scales_refuses_tensors_without_real_values(scales: torch.Tensor, got: str) -> None:
    """A meta tensor has no values (reading them raised a bare NotImplementedError); complex / bool ones
    were cast silently (the imaginary part dropped, True -> 1.0). Refused, the scales still uncalibrated."""
    cache = am.KVCache(dataclasses.replace(SPEC, kv_dtype=FP8), num_pages=8, backend="reference")
    before = cache._pool.scales.clone()
    with pytest.raises(am.TensorMismatchError) as info:
        cache.set_kv_scales(scales)
    assert "set_kv_scales: expected a real-valued tensor with data" in str(info.value) and got in str(info.value)
    assert torch.equal(cache._pool.scales, before)
    assert not any(cache._pool.quantizer.calibrated(layer) for layer in range(SPEC.num_layers))


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
    assert library.cache._allocator.num_free == pages


def test_spec_takes_torch_dtypes_and_names_them() -> None:
    spec = dataclasses.replace(SPEC, dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn)
    assert (spec.dtype, spec.kv_dtype, spec.cache_dtype) == ("bfloat16", "float8_e4m3fn", "float8_e4m3fn")
    with pytest.raises(am.SpecError, match=r"kv_dtype: expected None or one of .* got 'int8'"):
        dataclasses.replace(SPEC, kv_dtype=torch.int8)
    with pytest.raises(am.SpecError, match=r"dtype: expected one of .* got 'float8_e4m3fn'"):
        dataclasses.replace(SPEC, dtype=torch.float8_e4m3fn)  # FP8 is a storage format only


# ------------------------------------------------------------------ calibration cannot be poisoned (issue 24)


def _fp8_cache(**kwargs: object) -> am.KVCache:
    return am.KVCache(dataclasses.replace(SPEC, kv_dtype=FP8), num_pages=32, backend="reference", **kwargs)


def _kv(seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, CHUNK, 2, 8, generator=g) * scale).bfloat16()


def _forward(state: am.KVState, ks: list[torch.Tensor], commit: bool = True, vs: list[torch.Tensor] | None = None):
    """One forward over both branches, layer ``i`` writing ``ks[i]`` (and ``vs[i]``, default ``ks[i]``)."""
    q = _kv(99).repeat(1, 1, 2, 1)  # [2, CHUNK, 4 heads, 8]
    with state.prepare_forward(None, CHUNK, commit_current=commit) as fwd:
        for layer, ctx in enumerate(fwd.layers):
            am.chunk_attention(q, ks[layer], ks[layer] if vs is None else vs[layer], ctx)
    return fwd


def _newest_chunk(cache: am.KVCache, state: am.KVState, layer: int, kv: int = 0) -> torch.Tensor:
    """The newest committed chunk of ``state``'s two branches in ``layer`` (K: ``kv=0``), dequantized,
    ``[2, CHUNK, 2, 8]`` like the tensors written."""
    rows = []
    for branch in ("cond", "uncond"):
        pages = list(state.branch_pages(branch).history_pages())[-(CHUNK // SPEC.page_size):]
        stored = cache._pool.kv[layer, kv, pages].reshape(CHUNK, 2, 8)
        rows.append(dequantize(stored, cache._pool.scales[layer, kv], torch.float32))
    return torch.stack(rows)


def _assert_reads_back(cache: am.KVCache, state: am.KVState, written: list[torch.Tensor]) -> None:
    for layer, k in enumerate(written):
        back = _newest_chunk(cache, state, layer)
        assert bool(torch.isfinite(back).all()), f"layer {layer}: committed K/V read back non-finite"
        torch.testing.assert_close(back, k.float(), rtol=2.0**-4, atol=k.float().abs().max().item() * 2.0**-8)


def test_nan_and_inf_in_the_first_chunk_do_not_poison_the_scales_of_later_sessions() -> None:
    cache = _fp8_cache()
    a, b = cache.open_session("a"), cache.open_session("b")
    poisoned = _kv(1)
    poisoned[0, 0, 0, 0], poisoned[1, 1, 1, 3] = float("nan"), float("inf")
    _forward(a, [poisoned, _kv(2)])
    assert bool(torch.isfinite(cache._pool.scales).all()), f"scales poisoned: {cache._pool.scales}"
    finite = torch.where(torch.isfinite(poisoned), poisoned, 0)
    torch.testing.assert_close(cache._pool.scales[0, 0], amax_scale(finite.reshape(-1, 2, 8), DEFAULT_HEADROOM))
    clean = [_kv(3), _kv(4)]
    _forward(b, clean)
    _assert_reads_back(cache, b, clean)  # every later session's K/V read back as written (not NaN)


def test_a_calibrating_forward_that_aborts_fixes_no_scale() -> None:
    cache = _fp8_cache()
    a = cache.open_session("a")
    with pytest.raises(RuntimeError, match="boom"):
        with a.prepare_forward(None, CHUNK, commit_current=True) as fwd:
            for ctx in fwd.layers:
                am.chunk_attention(_kv(99).repeat(1, 1, 2, 1), _kv(5, 1e4), _kv(5, 1e4), ctx)
            raise RuntimeError("boom")
    assert [cache._pool.quantizer.state(i) for i in range(2)] == ["open", "open"]
    cache.set_kv_scales(torch.full((2, 2, 2), 0.25))  # nothing written with the aborted scales survives
    cache2 = _fp8_cache()
    a2 = cache2.open_session("a")
    with pytest.raises(RuntimeError):
        with a2.prepare_forward(None, CHUNK, commit_current=True) as fwd:
            am.chunk_attention(_kv(99).repeat(1, 1, 2, 1), _kv(5, 1e4), _kv(5, 1e4), fwd.layers[0])
            raise RuntimeError("boom")
    clean = [_kv(6), _kv(7)]
    _forward(a2, clean)  # calibrated from its own K/V, not from the aborted forward's 1e4x ones
    torch.testing.assert_close(cache2._pool.scales[0, 0], amax_scale(clean[0].reshape(-1, 2, 8), DEFAULT_HEADROOM))
    assert [cache2._pool.quantizer.state(i) for i in range(2)] == ["fixed", "fixed"]
    _assert_reads_back(cache2, a2, clean)


def test_denoising_forwards_calibrate_provisionally_and_the_commit_fixes_the_scales() -> None:
    cache = _fp8_cache()
    a = cache.open_session("a")
    _forward(a, [_kv(8, 100.0), _kv(8, 100.0)], commit=False)  # completes: its pages are rewritten next
    assert [cache._pool.quantizer.state(i) for i in range(2)] == ["open", "open"]
    fwd = a.prepare_forward(None, CHUNK, commit_current=True)
    for ctx in fwd.layers:
        am.chunk_attention(_kv(99).repeat(1, 1, 2, 1), _kv(9), _kv(9), ctx)
    assert [cache._pool.quantizer.state(i) for i in range(2)] == ["provisional", "provisional"]
    fwd.commit()
    assert [cache._pool.quantizer.state(i) for i in range(2)] == ["fixed", "fixed"]
    torch.testing.assert_close(cache._pool.scales[1, 1], amax_scale(_kv(9).reshape(-1, 2, 8), DEFAULT_HEADROOM))
    with pytest.raises(am.errors.KVScalesFixedError):
        cache.set_kv_scales(torch.ones(2, 2, 2))


def test_an_all_zero_first_chunk_is_refused_instead_of_collapsing_every_later_chunk() -> None:
    cache = _fp8_cache()
    a, b = cache.open_session("a"), cache.open_session("b")
    used, kv = cache._allocator.num_used, cache._pool.kv.clone()
    zero = torch.zeros(2, CHUNK, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(am.KVCalibrationError, match="layer 1 K head 0") as error:
        _forward(a, [_kv(10), zero])
    assert "set_kv_scales" in str(error.value) and isinstance(error.value, ValueError)
    assert a.committed_chunks("cond") == 0 and cache._allocator.num_used == used
    assert [cache._pool.quantizer.state(i) for i in range(2)] == ["open", "open"]
    del kv
    clean = [_kv(11), _kv(12)]
    _forward(b, clean)  # the next real chunk calibrates; its K/V (and everyone's later) read back right
    _assert_reads_back(cache, b, clean)
    _forward(a, [_kv(13), _kv(14)])  # a's later forwards commit normally
    assert a.committed_chunks("cond") == 1


def test_check_finite_refuses_inf_in_an_fp8_pool_and_a_nan_first_chunk_blocks_nothing_later() -> None:
    cache = _fp8_cache(check_finite=True)
    a = cache.open_session("a")
    nan = _kv(15)
    nan[0, 1, 0, 2] = float("nan")
    with pytest.raises(am.NonFiniteKVError):
        _forward(a, [nan, _kv(16)])
    assert a.committed_chunks("cond") == 0
    _forward(a, [_kv(17), _kv(18)])  # not blocked by the first forward's NaN: scales calibrated afresh
    assert a.committed_chunks("cond") == 1 and bool(torch.isfinite(cache._pool.scales).all())
    kv = cache._pool.kv.view(torch.uint8).clone()
    inf = _kv(19)
    inf[1, 2, 1, 5] = float("inf")
    with pytest.raises(am.NonFiniteKVError):
        _forward(a, [_kv(20), inf])  # an Inf is stored as NaN (not a saturated 448), which the check sees
    assert a.committed_chunks("cond") == 1
    history = [p for br in ("cond", "uncond") for p in a.branch_pages(br).history_pages()]
    assert torch.equal(cache._pool.kv.view(torch.uint8)[:, :, history], kv[:, :, history])


def test_quantize_stores_inf_as_nan_and_saturates_large_finite_values() -> None:
    x = torch.tensor([[[1.0, float("inf"), -float("inf"), float("nan"), 1e6, -1e6]]])
    back = dequantize(quantize(x, torch.ones(1)), torch.ones(1), torch.float32)[0, 0]
    assert back[0] == 1 and bool(back[1:4].isnan().all())
    assert back[4] == FP8_E4M3_MAX and back[5] == -FP8_E4M3_MAX
