"""FP8 KV cache on the GPU: FlashInfer's FP8 paths equal the FP8 reference oracle (within FP8 tolerances).

Ragged FA3 and paged FA3 run FP8 attention (queries quantized per forward, per head); the masked FA2
path runs a bf16 query over FP8 K/V with the scales folded in; CUDA graphs and torch.compile too.
Run on the GPU machine: ``bash .gpu/run.sh python3 -m pytest -m gpu -q``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.graphs import CUDAGraphStep
from ardiff_modules.quant import DEFAULT_HEADROOM, amax_scale
from tests.support.gpu import DTYPE, FP8, GPU, HEAD_DIM, gpu_model_and_spec, gpu_spec, rel_error

pytestmark = list(GPU)


def _fp8_spec(
    chunk: int, page: int, sink: int, window: int | None, qo_heads: int = 4, kv_heads: int = 2
) -> am.KVCacheSpec:
    return gpu_spec(chunk, page, sink, window, qo_heads, kv_heads, kv_dtype=FP8)


def _scales(spec: am.KVCacheSpec) -> torch.Tensor:
    # randn K/V: amax ~4.5; 4x headroom like the default calibration
    return torch.full((spec.num_layers, 2, spec.num_kv_heads), 4.5 * DEFAULT_HEADROOM / 448.0)


@pytest.mark.parametrize("extents", [True, False], ids=["extents", "paged"])
@pytest.mark.parametrize("page", [8, 120])
def test_fp8_flashinfer_equals_fp8_reference_over_rollout(page: int, extents: bool) -> None:
    """Chunk counts 1..4, eviction, 2 sessions batched; pools hold the same FP8 bytes; outputs agree."""
    chunk = 240
    spec = _fp8_spec(chunk, page, 1, 2)
    pages = 4 * 8 * spec.pages_per_chunk
    ref = am.KVCache(spec, num_pages=pages, device="cuda", backend="reference", contiguous_extents=extents)
    fi = am.KVCache(spec, num_pages=pages, device="cuda", backend="flashinfer", contiguous_extents=extents)
    bf16 = am.KVCache(dataclasses.replace(spec, kv_dtype=None), num_pages=pages, device="cuda", backend="flashinfer",
                      contiguous_extents=extents)
    for cache in (ref, fi):
        cache.set_kv_scales(_scales(spec))
    states = {c: [c.open_session(f"s{i}") for i in range(2)] for c in (ref, fi, bf16)}
    g = torch.Generator(device="cuda").manual_seed(0)
    modes, worst_vs_ref, worst_vs_bf16 = set(), 0.0, 0.0
    for step, n in enumerate([1, 2, 1, 3, 1, 4, 1, 1]):
        streams = 4 if step % 2 == 0 else 2
        for commit in (False, True):
            shape = (streams, n * chunk)
            q = torch.randn(*shape, 4, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
            k = torch.randn(*shape, 2, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
            v = torch.randn(*shape, 2, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
            outs = {}
            for cache in (ref, fi, bf16):
                pairs = [(s, b) for s in states[cache][: streams // 2] for b in ("cond", "uncond")]
                with cache.prepare_forward(pairs, n * chunk, commit_current=commit) as fwd:
                    outs[cache] = [am.chunk_attention(q, k, v, layer) for layer in fwd.layers]
                    if cache is fi:
                        modes.add(fwd._plan.mode)
            for a, b, c in zip(outs[fi], outs[ref], outs[bf16]):
                worst_vs_ref = max(worst_vs_ref, rel_error(a, b))
                worst_vs_bf16 = max(worst_vs_bf16, rel_error(a, c))
            # Same quantization, same pages: the FP8 bytes in the two pools are identical.
            assert torch.equal(fi._pool.kv.view(torch.uint8), ref._pool.kv.view(torch.uint8))
    print(f"fp8 flashinfer vs fp8 reference: {worst_vs_ref:.3e}; vs bf16 flashinfer: {worst_vs_bf16:.3e}; {modes}")
    assert worst_vs_ref < 4e-2  # FA3 also quantizes the query (per head, per forward)
    assert worst_vs_bf16 < 8e-2
    assert "paged" in modes and (not extents or "ragged" in modes)


def test_fp8_masked_path_equals_reference_and_lse() -> None:
    """FA2 with a bf16 query over FP8 K/V (scales folded into q and the output) and a token mask."""
    chunk, page = 240, 8
    spec = _fp8_spec(chunk, page, 1, 2)
    caches = [am.KVCache(spec, num_pages=256, device="cuda", backend=b) for b in ("reference", "flashinfer")]
    scales = torch.rand(2, 2, 2, generator=torch.Generator().manual_seed(0)) * 0.04 + 0.02
    for cache in caches:
        cache.set_kv_scales(scales)
    states = [c.open_session() for c in caches]
    g = torch.Generator(device="cuda").manual_seed(1)
    for n in (1, 2, 1, 1):
        q = torch.randn(2, n * chunk, 4, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
        k = torch.randn(2, n * chunk, 2, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
        v = torch.randn_like(k)
        keys = max(len(states[0].history_chunks(b)) for b in ("cond", "uncond")) * chunk + n * chunk
        mask = torch.rand(2, n * chunk, keys, device="cuda", generator=g) > 0.3
        outs = []
        for cache, state in zip(caches, states):
            with state.prepare_forward(None, n * chunk, True, token_mask=mask) as fwd:
                am.chunk_attention(q, k, v, fwd.layers[0])  # a commit needs every layer
                outs.append(am.chunk_attention(q, k, v, fwd.layers[1], return_lse=True))
                if cache.backend.name == "flashinfer":
                    assert fwd._plan.mode == "masked"
        (o_fi, lse_fi), (o_ref, lse_ref) = outs[1], outs[0]
        assert rel_error(o_fi, o_ref) < 1e-2  # no query quantization on this path: bf16 rounding only
        torch.testing.assert_close(lse_fi, lse_ref, atol=2e-2, rtol=1e-3)


def test_fp8_ragged_lse_and_default_calibration() -> None:
    spec = _fp8_spec(240, 120, 0, 2)
    cache = am.KVCache(spec, num_pages=64, device="cuda", backend="flashinfer")
    ref = am.KVCache(spec, num_pages=64, device="cuda", backend="reference")
    g = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(2, 240, 4, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
    k = torch.randn(2, 240, 2, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g) * 3
    v = torch.randn(2, 240, 2, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
    outs = []
    for c in (ref, cache):
        with c.open_session().prepare_forward(None, 240, True) as fwd:
            outs.append(am.chunk_attention(q, k, v, fwd.layers[0], return_lse=True))
            am.chunk_attention(q, k, v, fwd.layers[1])  # a commit needs every layer
            if c is cache:
                assert fwd._plan.mode == "ragged"
    torch.testing.assert_close(cache._pool.scales[0, 0], amax_scale(k.reshape(-1, 2, HEAD_DIM), DEFAULT_HEADROOM))
    torch.testing.assert_close(cache._pool.scales, ref._pool.scales)
    assert rel_error(outs[1][0], outs[0][0]) < 8e-2  # FA3's per-forward FP8 query adds ~3-5 % on random data
    # LSE of FP8 logits (q and k both rounded, k 3x randn): a few hundredths on average; a scale that
    # was not applied (k_scale ~ 0.03 here) would move it by whole units.
    lse_err = (outs[1][1] - outs[0][1]).abs()
    print(f"fp8 ragged LSE error: mean {lse_err.mean().item():.3e}, max {lse_err.max().item():.3e}")
    assert lse_err.mean().item() < 0.05 and lse_err.max().item() < 0.5


def test_fp8_compiled_and_cuda_graph_equal_eager() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    model, spec = gpu_model_and_spec(kv_dtype=FP8)

    def rollout(step_fn, static: bool):  # noqa: ANN001, ANN202
        cache = am.KVCache(spec, num_pages=64, device="cuda", backend="flashinfer")
        cache.set_kv_scales(torch.full((3, 2, 4), 0.05))
        state = cache.open_session()
        g = torch.Generator(device="cuda").manual_seed(0)
        outs = []
        for chunk in range(7):
            if chunk in (0, 4):
                state.clear_cross_attention()
                for b in spec.branches:
                    text = torch.randn(16, 64, device="cuda", dtype=DTYPE, generator=g)
                    am.populate_cross_attention(state, b, [blk.cross for blk in model.blocks], text)
            for commit in (False, True):
                x = torch.randn(2, 256, 512, device="cuda", dtype=DTYPE, generator=g)
                with torch.no_grad(), state.prepare_forward(None, 256, commit, static=static) as fwd:
                    outs.append(step_fn(fwd, x))
        return outs

    eager = rollout(lambda fwd, x: model(x, fwd.layers), static=False)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    comp = rollout(lambda fwd, x: compiled(x, fwd.layers), static=False)
    assert counter.frame_count == 1
    graph_step = CUDAGraphStep(model)
    graphed = rollout(lambda fwd, x: graph_step(fwd, x), static=True)
    assert graph_step.num_graphs == 1
    for e, c, gr in zip(eager, comp, graphed):
        assert rel_error(c, e) < 5e-2  # inductor's bf16 rounding of norms/RoPE moves q/k across FP8 steps
        assert rel_error(gr, e) < 5e-2
