"""FlashInfer runs every re-cache rule like the reference backend (issue 26, item 1): LongLive's bidirectional
re-cache with a context chunk and kept or moved sinks, block-causal with context, over plain paging and
contiguous extents (the commit's ring copies), bf16 and FP8 pools; the forwards after each switch read what it
wrote."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ardiff_modules as am
from tests.support.gpu import GPU, gpu_qkv, gpu_spec

pytestmark = list(GPU)

CHUNK = 240
RULES = {
    "longlive": am.RecacheRule.longlive(),
    "longlive_moving_sink": am.RecacheRule.longlive(global_sink=False),
    "block_causal_context": am.RecacheRule("block_causal", "keep_after_slide", 1),
}


@pytest.mark.parametrize("extents", [True, False], ids=["extents", "paged"])
@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("page,kv_dtype", [(8, None), (240, None), (16, "float8_e4m3fn")])
def test_flashinfer_recache_rules_equal_reference(page: int, kv_dtype: str | None, rule: str, extents: bool) -> None:
    spec = dataclasses.replace(gpu_spec(CHUNK, page, 1, 2, kv_dtype=kv_dtype), recache=RULES[rule])
    pages = 2 * 12 * spec.pages_per_chunk
    ref = am.KVCache(spec, num_pages=pages, device="cuda", backend="reference")
    fi = am.KVCache(spec, num_pages=pages, device="cuda", backend="flashinfer", contiguous_extents=extents)
    states = {c: c.open_session("s") for c in (ref, fi)}
    g = torch.Generator(device="cuda").manual_seed(0)
    tol = 6e-2 if kv_dtype else 2e-2
    rebuilt_counts = []

    def run(prepare, seq_len: int) -> None:  # noqa: ANN001
        q, k, v = gpu_qkv((2, seq_len), g)
        outs = []
        for cache in (ref, fi):
            with prepare(states[cache]) as fwd:
                outs.append([am.chunk_attention(q, k, v, layer) for layer in fwd.layers])
        for a, b in zip(*outs):
            torch.testing.assert_close(b.float(), a.float(), atol=tol, rtol=tol)

    for n in range(1, 10):
        for commit in (False, True):
            run(lambda s, c=commit: s.prepare_forward(("cond", "uncond"), CHUNK, commit_current=c), CHUNK)
        if n in (4, 7, 8):  # just filled (the evicted chunk is context, sinks rebuilt), then slid
            rebuilt = states[ref].recache_chunk_indices("cond")
            assert rebuilt == states[fi].recache_chunk_indices("cond")
            rebuilt_counts.append(len(rebuilt))
            run(lambda s: s.prepare_recache(), len(rebuilt) * CHUNK)
            for cache in (ref, fi):
                cache._allocator.check_invariants()
            assert ref._allocator.num_used == 2 * 3 * spec.pages_per_chunk
    assert rebuilt_counts[0] == 4 and rebuilt_counts[1] in (3, 4)
    for cache in (ref, fi):
        cache.close()
        assert cache._allocator.num_free == cache._allocator.num_pages
