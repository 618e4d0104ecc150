"""Head-grouped caches on FlashInfer equal the reference backend (eager, compiled, CUDA graphs); each part
runs its own ragged FA3 plan (no mask)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.graphs import CUDAGraphStep
from tests.heads.oracle import PerHeadOracle, one_forward
from tests.support.gpu import DTYPE, GPU, HEAD_DIM, gpu_model_and_spec

pytestmark = list(GPU)

HEADS = am.HeadRetention(
    {"local": (0, 1), "global": (1, 2)},
    [["global", "local", "local", "global"], ["local", "local", "global", "global"], ["local"] * 4],
)


def _spec(page: int, kv_dtype: str | None = None) -> am.KVCacheSpec:
    return am.KVCacheSpec(
        num_layers=3, num_kv_heads=4, num_qo_heads=8, head_dim=HEAD_DIM, chunk_size=120, page_size=page,
        branches=("cond", "uncond"), dtype="bfloat16", kv_dtype=kv_dtype,
    )


@pytest.mark.parametrize("page", [1, 8, 120])
def test_flashinfer_equals_the_per_head_oracle_and_runs_ragged_per_part(page: int) -> None:
    spec = _spec(page)
    cache = am.HeadGroupedKVCache(spec, HEADS, max_sessions=1, device="cuda", backend="flashinfer")
    session = cache.open_session()
    oracle = PerHeadOracle(HEADS)
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):  # windows fill (local after 1, global after 3) and evict
        for commit in (False, True):
            got, want = one_forward(session, oracle, spec.branches, 120, commit, gen, spec, dtype=DTYPE)
            torch.testing.assert_close(got.float().cpu(), want, atol=2e-2, rtol=2e-2)
    with session.prepare_forward(None, 120) as fwd:
        assert {p._plan.mode for p in fwd.parts} == {"ragged"}, [p._plan.mode for p in fwd.parts]


def _model_rollout(fn, model, session, chunks: int, gen: torch.Generator, static: bool = False) -> list[torch.Tensor]:
    outs = []
    with torch.no_grad():
        for _ in range(chunks):
            for commit in (False, True):
                x = torch.randn(2, 256, model.dim, generator=gen).to("cuda", DTYPE)
                with session.prepare_forward(None, 256, commit_current=commit, static=static) as fwd:
                    outs.append(fn(fwd, x) if static else fn(x, fwd.layers))
    return outs


def _caches(backend: str):
    model, spec = gpu_model_and_spec()
    spec = dataclasses.replace(spec, sink_chunks=0, window_chunks=None)
    cache = am.HeadGroupedKVCache(spec, HEADS, max_sessions=1, device="cuda", backend=backend)
    session = cache.open_session()
    gen = torch.Generator().manual_seed(1)
    for branch in spec.branches:
        text = torch.randn(16, model.context_dim, generator=gen).to("cuda", DTYPE)
        am.populate_cross_attention(session, branch, [b.cross for b in model.blocks], text)
    return model, session


@pytest.mark.parametrize("mode", ["eager", "compiled", "graph"])
def test_a_model_over_a_grouped_cache_equals_the_reference_backend(mode: str) -> None:
    model, ref_session = _caches("reference")
    _, session = _caches("flashinfer")
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


def test_fp8_parts_calibrate_and_match_bf16_loosely() -> None:
    spec = _spec(8, kv_dtype="float8_e4m3fn")
    cache = am.HeadGroupedKVCache(spec, HEADS, max_sessions=1, device="cuda", backend="flashinfer")
    session = cache.open_session()
    oracle = PerHeadOracle(HEADS)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        got, want = one_forward(session, oracle, spec.branches, 120, True, gen, spec, dtype=DTYPE)
        rel = (got.float().cpu() - want).norm() / want.norm()
        assert rel < 0.1, float(rel)
    assert all(c._pool.quantizer is not None for c in cache.caches)
