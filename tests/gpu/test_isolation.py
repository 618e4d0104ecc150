"""Streams never read each other's data on the GPU (ragged, paged and masked kernels), and a query that sees no
key outputs zeros: FlashInfer equals the reference backend.

Run on the GPU machine: ``bash .gpu/run.sh python3 -m pytest -m gpu -q``. Skipped without CUDA/FlashInfer.
"""

from __future__ import annotations

import pytest
import torch

import ardiff_modules as am
from tests.support.gpu import GPU, assert_close_bf16, gpu_qkv, gpu_spec

pytestmark = list(GPU)


@pytest.mark.parametrize("mode", ["ragged", "paged", "masked"])
def test_no_stream_reads_another_streams_nan(mode: str) -> None:
    """Session A's pages (and every free page) hold NaN; session B batched beside A stays finite and exact."""
    chunk = 240
    spec = gpu_spec(chunk, 120, 1, 2)
    seq = (2 if mode == "paged" else 1) * chunk
    outs = {}
    for backend in ("reference", "flashinfer"):
        cache = am.KVCache(spec, num_pages=96, device="cuda", backend=backend, contiguous_extents=mode != "paged")
        cache._pool.kv.fill_(float("nan"))
        a, b = cache.open_session("a"), cache.open_session("b")
        g = torch.Generator(device="cuda").manual_seed(4)
        for i in range(3):
            qa, ka, va = gpu_qkv((2, chunk), g, fill=float("nan"))
            _, kb, vb = gpu_qkv((2, chunk), g)
            pairs = [(a, "cond"), (a, "uncond"), (b, "cond"), (b, "uncond")]
            with cache.prepare_forward(pairs, chunk, True) as fwd:
                for layer in fwd.layers:  # a commit needs every layer
                    am.chunk_attention(torch.cat([qa, qa]), torch.cat([ka, kb]), torch.cat([va, vb]), layer)
        q, k, v = gpu_qkv((2, seq), g)
        mask = None
        if mode == "masked":
            keys = max(len(b.history_chunks(x)) for x in spec.branches) * chunk + seq
            mask = torch.ones(4, seq, keys, dtype=torch.bool, device="cuda")
        _, ka, va = gpu_qkv((2, seq), g, fill=float("inf"))
        pairs = [(a, "cond"), (a, "uncond"), (b, "cond"), (b, "uncond")]
        with cache.prepare_forward(pairs, seq, False, token_mask=mask) as fwd:
            out = am.chunk_attention(torch.cat([q, q]), torch.cat([ka, k]), torch.cat([va, v]), fwd.layers[0])
            if backend == "flashinfer":
                assert fwd._plan.mode == mode
        outs[backend] = out[2:]
        assert torch.isfinite(out[2:]).all(), f"{backend}: session A's NaN/Inf reached session B"
    assert_close_bf16(outs["flashinfer"], outs["reference"])


def test_query_that_sees_no_key_outputs_zeros() -> None:
    chunk = 240
    spec = gpu_spec(chunk, 120, 1, 2)
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = gpu_qkv((2, chunk), g)
    outs = []
    for backend in ("reference", "flashinfer"):
        cache = am.KVCache(spec, num_pages=64, device="cuda", backend=backend)
        state = cache.open_session()
        mask = torch.rand(2, chunk, chunk, device="cuda", generator=torch.Generator(device="cuda").manual_seed(6)) > 0.5
        mask[:, :17] = False  # the first 17 queries of each stream see nothing
        with state.prepare_forward(None, chunk, False, token_mask=mask) as fwd:
            outs.append(am.chunk_attention(q, k, v, fwd.layers[0]))
            if backend == "flashinfer":
                assert fwd._plan.mode == "masked"
    for out in outs:
        assert torch.isfinite(out).all()
        assert torch.count_nonzero(out[:, :17]) == 0
    assert_close_bf16(outs[1], outs[0])
