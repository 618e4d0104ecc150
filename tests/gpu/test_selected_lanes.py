"""Content-selected lanes (``SelectedFramesPolicy``: patches of the leaving frames chosen on the device at each scoring
commit, copied into the selection's pages) on FlashInfer equal the reference backend -- eager, compiled, CUDA graphs
(the selection runs at commit, outside the captured step) -- and the chosen pages do not depend on the backend."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.graphs import CUDAGraphStep
from tests.gpu.test_head_groups import _model_rollout
from tests.heads.oracle import grouped, session_budget
from tests.support.gpu import DTYPE, GPU, gpu_model_and_spec

pytestmark = list(GPU)


def _session(backend: str, kv_dtype: str | None = None, extents: bool | None = None):  # noqa: ANN202
    """The bf16 tiny model (chunks of 256 tokens = 2 frames of 2 pages) over a cache whose odd heads keep sink 1
    frame + the last frame + 1 frame of patches chosen (2 patches a frame) from the first commit after chunk 1."""
    model, spec = gpu_model_and_spec(kv_dtype=kv_dtype)
    selected = am.SelectedFramesPolicy(1, 1, 2, keep_frames=1, patches_per_frame=2, select_from=1, score_layer=1)
    heads = am.HeadRetention(
        {"temporal": selected, "spatial": am.FrameWindowPolicy(1, 1, 2)},
        [["temporal" if h % 2 else "spatial" for h in range(spec.num_kv_heads)] for _ in range(spec.num_layers)],
    )
    spec = grouped(dataclasses.replace(spec, sink_chunks=0, window_chunks=None), heads)
    budget = session_budget(spec, 1, backend=backend, contiguous_extents=extents)
    cache = am.KVCache(spec, budget_bytes=budget, device="cuda", backend=backend, contiguous_extents=extents)
    session = cache.open_session()
    gen = torch.Generator().manual_seed(1)
    for branch in spec.branches:
        text = torch.randn(16, model.context_dim, generator=gen).to("cuda", DTYPE)
        am.populate_cross_attention(session, branch, [b.cross for b in model.blocks], text)
    return model, cache, session


def _selections(cache: am.KVCache, session: am.KVState) -> list[tuple[int, ...]]:
    lanes = [lane for lane in cache._lanes if lane.part is not None and lane.part.group == "temporal"]
    return [session._lane_pages(b)[lane.index].selection.resolved() for lane in lanes for b in cache.spec.branches]


# (a clean dynamo before and after: see tests/gpu/test_head_groups.py)
@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("extents", [False, None], ids=["paged", "frame-extents"])
@pytest.mark.parametrize("mode", ["eager", "compiled", "graph"])
def test_a_model_over_selected_lanes_equals_the_reference_backend(mode: str, extents: bool | None) -> None:
    """Plain paging (paged FA3) and frame-slot extents (ragged FA3 once the window is full, the selection copied in
    place) both equal the reference backend, and choose the same patches."""
    model, ref_cache, ref_session = _session("reference")
    _, cache, session = _session("flashinfer", extents=extents)
    want = _model_rollout(model, model, ref_session, 6, torch.Generator().manual_seed(2))
    if mode == "graph":
        step = CUDAGraphStep(model)
        got = _model_rollout(step, model, session, 6, torch.Generator().manual_seed(2), static=True)
        assert step.num_graphs >= 1
    else:
        fn = torch.compile(model, fullgraph=True) if mode == "compiled" else model
        got = _model_rollout(fn, model, session, 6, torch.Generator().manual_seed(2))
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g.float(), w.float(), atol=5e-2, rtol=5e-2, msg=lambda m, i=i: f"forward {i}: {m}")
    assert _selections(cache, session) == _selections(ref_cache, ref_session)


def test_fp8_selected_lanes_match_bf16_loosely() -> None:
    model, _, bf16 = _session("flashinfer")
    _, _, fp8 = _session("flashinfer", kv_dtype="float8_e4m3fn")
    want = _model_rollout(model, model, bf16, 5, torch.Generator().manual_seed(3))
    got = _model_rollout(model, model, fp8, 5, torch.Generator().manual_seed(3))
    for g, w in zip(got, want):
        assert float((g.float() - w.float()).norm() / w.float().norm()) < 0.1
