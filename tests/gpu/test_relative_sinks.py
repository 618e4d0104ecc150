"""FlashInfer with relative-position sinks equals the reference backend (two key segments merged by LSE):
ragged over contiguous extents and structural paged, multi-chunk forwards, a batched stream whose sink
segment is empty, FP8 pools, static plans under CUDA-graph replay, and the compiled write path."""

from __future__ import annotations

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.backends.segmented import RelativeSinkPlan
from tests.support.gpu import GPU, gpu_qkv, gpu_spec

pytestmark = list(GPU)

CHUNK = 240


def _relative_sinks_spec(page: int, sink: int, window: int, kv_dtype: str | None = None) -> am.KVCacheSpec:
    return gpu_spec(CHUNK, page, sink, window, kv_dtype=kv_dtype, relative_sinks=True)


@pytest.mark.parametrize("extents", [True, False], ids=["extents", "paged"])
@pytest.mark.parametrize("page,sink,window,kv_dtype", [
    (8, 1, 2, None), (120, 2, 1, None), (240, 1, 3, None), (8, 1, 2, "float8_e4m3fn"),
])
def test_flashinfer_relative_sinks_equal_reference(
    page: int, sink: int, window: int, kv_dtype: str | None, extents: bool
) -> None:
    """Windows filling then sliding; 1..3 pending chunks; session 1 joins late, so early batched forwards
    have a stream without sinks. Both caches hold the same K/V bytes; outputs within bf16/FP8 tolerance."""
    spec = _relative_sinks_spec(page, sink, window, kv_dtype)
    pages = 4 * (sink + window + 5) * spec.pages_per_chunk
    ref = am.KVCache(spec, num_pages=pages, device="cuda", backend="reference")
    fi = am.KVCache(spec, num_pages=pages, device="cuda", backend="flashinfer", contiguous_extents=extents)
    states = {c: [c.open_session(f"s{i}") for i in range(2)] for c in (ref, fi)}
    g = torch.Generator(device="cuda").manual_seed(0)
    modes, shifts = set(), set()
    tol = 6e-2 if kv_dtype else 2e-2
    for step, n in enumerate([1, 1, 2, 1, 3, 1, 1, 2, 1, 1]):
        sessions = 1 if step < 3 else 2
        for commit in (False, True):
            q, k, v, sq = gpu_qkv((2 * sessions, n * CHUNK), g, sink_query=True)
            outs = []
            for cache in (ref, fi):
                pairs = [(s, b) for s in states[cache][:sessions] for b in ("cond", "uncond")]
                with cache.prepare_forward(pairs, n * CHUNK, commit_current=commit) as fwd:
                    outs.append([am.chunk_attention(q, k, v, layer, sink_query=sq) for layer in fwd.layers])
                    if cache is fi and isinstance(fwd._plan, RelativeSinkPlan):
                        modes.add((fwd._plan.rest.mode, fwd._plan.sinks.mode))
                        shifts.update(fwd.sink_shifts)
            for a, b in zip(*outs):
                torch.testing.assert_close(b.float(), a.float(), atol=tol, rtol=tol)
    assert max(shifts) > 0 and 0 in shifts, shifts
    assert all("masked" not in m for m in modes), modes
    if extents:
        assert ("ragged", "ragged") in modes, modes


def test_flashinfer_relative_sinks_token_mask_static_graph_and_compile() -> None:
    """The masked FA2 path splits the user mask over both segments; static plans replayed from a CUDA graph
    and a compiled fullgraph function (K/V written in the graph) equal eager FlashInfer."""
    spec = _relative_sinks_spec(8, 1, 2)
    pages = 64 * spec.pages_per_chunk
    caches = {
        name: am.KVCache(spec, num_pages=pages, device="cuda", backend=backend, contiguous_extents=extents)
        for name, backend, extents in (
            ("ref", "reference", False), ("fi", "flashinfer", True), ("graph", "flashinfer", True),
            ("compiled", "flashinfer", True),
        )
    }
    states = {name: c.open_session() for name, c in caches.items()}

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sq: torch.Tensor, layers) -> torch.Tensor:  # noqa: ANN001
        return torch.stack([am.chunk_attention(q, k, v, layer, sink_query=sq) for layer in layers])

    step = am.CUDAGraphStep(attend)
    compiled = torch.compile(attend, fullgraph=True, dynamic=False)
    g = torch.Generator(device="cuda").manual_seed(3)
    for chunk in range(7):
        q, k, v, sq = gpu_qkv((2, CHUNK), g, sink_query=True)
        keys = max(len(states["ref"].history_chunks(b)) for b in ("cond", "uncond")) * CHUNK + CHUNK
        mask = torch.rand(2, CHUNK, keys, device="cuda", generator=g) > 0.3
        mask[0, 0] = False  # a query with no key in either segment: zeros (merge_state alone gives NaN)
        masked = []
        for name in ("ref", "fi"):
            fwd = states[name].prepare_forward(None, CHUNK, False, token_mask=mask)
            masked.append(attend(q, k, v, sq, fwd.layers))
            fwd.abort()
        torch.testing.assert_close(masked[1].float(), masked[0].float(), atol=2e-2, rtol=2e-2)
        assert not masked[1][:, 0, 0].any(), "a query that sees no key must output zeros"
        outs = {}
        for name, state in states.items():
            with state.prepare_forward(None, CHUNK, True, static=name == "graph") as fwd:
                if name == "graph":
                    outs[name] = step(fwd, q, k, v, sq)
                elif name == "compiled":
                    outs[name] = compiled(q, k, v, sq, fwd.layers)
                else:
                    outs[name] = attend(q, k, v, sq, fwd.layers)
        torch.testing.assert_close(outs["fi"].float(), outs["ref"].float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(outs["graph"].float(), outs["fi"].float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(outs["compiled"].float(), outs["fi"].float(), atol=1e-2, rtol=1e-2)
    assert max(caches["fi"]._forwards.contexts()[0].sink_shifts) > 0
