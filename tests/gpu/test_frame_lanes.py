"""Frame lanes (``FrameWindowPolicy``: chunks trimmed to their kept frames) on FlashInfer equal the per-head oracle
and the reference backend -- eager, compiled, CUDA graphs, FP8 -- attended paged over the scattered kept pages."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.graphs import CUDAGraphStep
from tests.gpu.test_head_groups import _model_rollout
from tests.heads.oracle import PerHeadOracle, grouped, one_forward, session_budget
from tests.support.gpu import DTYPE, GPU, HEAD_DIM, gpu_model_and_spec

pytestmark = list(GPU)

# a chunk of 120 tokens is 3 frames of 40; Forcing-KV's published numbers (sink 1 frame + last frame) beside a
# wider frame group and a whole-chunk group
HEADS = am.HeadRetention(
    {"fkv": am.FrameWindowPolicy(1, 1, 3), "wide": am.FrameWindowPolicy(1, 4, 3), "chunks": (1, 2)},
    [["fkv", "wide", "fkv", "chunks"], ["fkv", "fkv", "wide", "wide"], ["chunks"] * 2 + ["fkv"] * 2],
)


def _spec(page: int, kv_dtype: str | None = None) -> am.KVCacheSpec:
    return am.KVCacheSpec(
        num_layers=3, num_kv_heads=4, num_qo_heads=8, head_dim=HEAD_DIM, chunk_size=120, page_size=page,
        branches=("cond", "uncond"), dtype="bfloat16", kv_dtype=kv_dtype, head_retention=HEADS,
    )


def _cache(spec: am.KVCacheSpec, backend: str, extents: bool | None = None) -> am.KVCache:
    budget = session_budget(spec, 2, backend=backend)
    return am.KVCache(spec, budget_bytes=budget, device="cuda", backend=backend, contiguous_extents=extents)


@pytest.mark.parametrize("page, extents", [(40, False), (8, False), (8, None)])
def test_flashinfer_frame_lanes_equal_the_per_head_oracle(page: int, extents: bool | None) -> None:
    spec = _spec(page)
    cache = _cache(spec, "flashinfer", extents)
    session = cache.open_session()
    oracle = PerHeadOracle(HEADS)
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):  # frames trimmed, windows slide
        for commit in (False, True):
            got, want = one_forward(session, oracle, spec.branches, 120, commit, gen, spec, dtype=DTYPE)
            torch.testing.assert_close(got.float().cpu(), want, atol=2e-2, rtol=2e-2)
    session.close()
    assert cache.stats().pages_used == 0


# (a clean dynamo before and after: see tests/gpu/test_head_groups.py)
@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("extents", [False, None], ids=["paged", "frame-extents"])
@pytest.mark.parametrize("mode", ["eager", "compiled", "graph"])
def test_a_model_over_frame_lanes_equals_the_reference_backend(mode: str, extents: bool | None) -> None:
    def caches(backend: str):
        model, spec = gpu_model_and_spec()
        frames = am.HeadRetention(
            {"fkv": am.FrameWindowPolicy(1, 1, 2), "wide": am.FrameWindowPolicy(1, 3, 2)},
            [["fkv" if h % 2 else "wide" for h in range(spec.num_kv_heads)] for _ in range(spec.num_layers)],
        )
        spec = grouped(dataclasses.replace(spec, sink_chunks=0, window_chunks=None), frames)
        on = extents if backend == "flashinfer" else None
        budget = session_budget(spec, 1, backend=backend, contiguous_extents=on)
        cache = am.KVCache(spec, budget_bytes=budget, device="cuda", backend=backend, contiguous_extents=on)
        session = cache.open_session()
        gen = torch.Generator().manual_seed(1)
        for branch in spec.branches:
            text = torch.randn(16, model.context_dim, generator=gen).to("cuda", DTYPE)
            am.populate_cross_attention(session, branch, [b.cross for b in model.blocks], text)
        return model, session

    model, ref_session = caches("reference")
    _, session = caches("flashinfer")
    want = _model_rollout(model, model, ref_session, 5, torch.Generator().manual_seed(2))
    if mode == "graph":
        step = CUDAGraphStep(model)
        got = _model_rollout(step, model, session, 5, torch.Generator().manual_seed(2), static=True)
        assert step.num_graphs >= 1
    else:
        fn = torch.compile(model, fullgraph=True) if mode == "compiled" else model
        got = _model_rollout(fn, model, session, 5, torch.Generator().manual_seed(2))
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g.float(), w.float(), atol=5e-2, rtol=5e-2, msg=lambda m, i=i: f"forward {i}: {m}")


def test_fp8_frame_lanes_match_bf16_loosely() -> None:
    spec = _spec(8, kv_dtype="float8_e4m3fn")
    cache = _cache(spec, "flashinfer")
    session = cache.open_session()
    oracle = PerHeadOracle(HEADS)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        got, want = one_forward(session, oracle, spec.branches, 120, True, gen, spec, dtype=DTYPE)
        rel = (got.float().cpu() - want).norm() / want.norm()
        assert rel < 0.1, float(rel)
