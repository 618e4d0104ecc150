"""FlashInfer with a shot sink and dropped windows equals the reference backend (issue 43 item 3): ragged over
contiguous extents and paged, relative sinks, an FP8 pool, and a static CUDA-graph step replayed across a cut."""

from __future__ import annotations

import pytest
import torch

import ardiff_modules as am
from tests.support.gpu import GPU, gpu_qkv, gpu_spec

pytestmark = list(GPU)

CHUNK = 240
#: Per chunk: ``(begin_shot, drop_window before its clean forward)``.
CUTS = {3: (True, False), 5: (True, True), 6: (False, True), 9: (True, False), 10: (True, True)}


def shot_spec(page: int, sink: int, window: int, **extra: object) -> am.KVCacheSpec:
    # NOTE: the retention in the same construction: a spec with relative sinks and no sink chunk is refused.
    return gpu_spec(CHUNK, page, 0, None, retention=am.ShotSinkPolicy(sink, window, 1), **extra)


@pytest.mark.parametrize("extents", [True, False], ids=["extents", "paged"])
@pytest.mark.parametrize("page,sink,window,extra", [
    (8, 1, 2, {}), (120, 2, 3, {}), (240, 1, 3, {}), (8, 1, 2, {"kv_dtype": "float8_e4m3fn"}),
    (8, 1, 2, {"relative_sinks": True}),
], ids=["p8", "p120-s2", "p240", "fp8", "relative"])
def test_flashinfer_shots_equal_reference(page: int, sink: int, window: int, extra: dict, extents: bool) -> None:
    """Per chunk two denoising forwards and a clean one; cuts pin, some drop the window first. Both caches hold the
    same history (page ids aside); outputs within bf16 / FP8 tolerance."""
    spec = shot_spec(page, sink, window, **extra)
    pages = 3 * (sink + window + 3) * spec.pages_per_chunk
    ref = am.KVCache(spec, num_pages=pages, device="cuda", backend="reference")
    fi = am.KVCache(spec, num_pages=pages, device="cuda", backend="flashinfer", contiguous_extents=extents)
    states = {c: c.open_session() for c in (ref, fi)}
    relative = bool(extra.get("relative_sinks"))
    tol = 6e-2 if "kv_dtype" in extra else 2e-2
    g = torch.Generator(device="cuda").manual_seed(0)
    for c in range(13):
        shot, drop = CUTS.get(c, (False, False))
        for step in range(3):
            clean = step == 2
            q, k, v, sq = gpu_qkv((2, CHUNK), g, sink_query=True)
            outs = []
            for cache, state in states.items():
                if shot and step == 0:
                    state.begin_shot()
                if drop and clean:
                    state.drop_window()
                with state.prepare_forward(None, CHUNK, commit_current=clean) as fwd:
                    kwargs = {"sink_query": sq} if relative else {}
                    outs.append([am.chunk_attention(q, k, v, layer, **kwargs) for layer in fwd.layers])
            for a, b in zip(*outs):
                torch.testing.assert_close(b.float(), a.float(), atol=tol, rtol=tol, msg=f"chunk {c} step {step}")
        assert states[ref].history_chunk_indices("cond") == states[fi].history_chunk_indices("cond")
    assert states[fi].history_chunk_indices("cond")[:sink] == tuple(range(sink))
    for state in states.values():
        state.close()
    assert fi._allocator.num_used == 0 and ref._allocator.num_used == 0


def test_a_static_graph_step_replays_across_cuts_and_dropped_windows() -> None:
    """``CUDAGraphStep`` captured once (static plans, fixed buffers sized by ``max_history_chunks``) replays every
    forward of a stream with cuts and drops, equal to eager FlashInfer."""
    spec = shot_spec(8, 1, 2)
    pages = 32 * spec.pages_per_chunk
    eager_cache = am.KVCache(spec, num_pages=pages, device="cuda", backend="flashinfer", contiguous_extents=True)
    graph_cache = am.KVCache(spec, num_pages=pages, device="cuda", backend="flashinfer", contiguous_extents=True)
    eager, graphed = eager_cache.open_session(), graph_cache.open_session()

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layers) -> torch.Tensor:  # noqa: ANN001
        return torch.stack([am.chunk_attention(q, k, v, layer) for layer in layers])

    step = am.CUDAGraphStep(attend)
    g = torch.Generator(device="cuda").manual_seed(4)
    for c in range(12):
        shot, drop = CUTS.get(c, (False, False))
        for state in (eager, graphed):
            if shot:
                state.begin_shot()
        for i in range(3):
            clean = i == 2
            q, k, v = gpu_qkv((2, CHUNK), g)
            if drop and clean:
                eager.drop_window()
                graphed.drop_window()
            with eager.prepare_forward(None, CHUNK, commit_current=clean) as fwd:
                want = attend(q, k, v, fwd.layers)
            with graphed.prepare_forward(None, CHUNK, commit_current=clean, static=True) as fwd:
                got = step(fwd, q, k, v)
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2, msg=f"chunk {c} step {i}")
    assert eager.history_chunk_indices("cond") == graphed.history_chunk_indices("cond") == (0, 10, 11)
