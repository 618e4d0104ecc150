"""``chunk_attention(..., return_lse=True)``: the log-sum-exp every backend returns, against float64.

Sequence parallelism merges partial attentions by their LSE, so it must be the natural-log LSE of
the *scaled* logits over exactly the visible keys (the visibility rule), ``-inf`` where none is.
"""

from __future__ import annotations

import pytest
import torch

import ardiff_modules as am
from tests.support.gpu import NEEDS_GPU


def _float64_attention(q, keys, values, mask, scale):  # noqa: ANN001, ANN202
    """``q [n, H, D]``, keys/values ``[K, Hkv, D]``, mask ``[n, K]`` -> (out [n, H, D], lse [n, H])."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    logits = torch.einsum("nhd,khd->hnk", q.double(), k) * scale
    logits = logits.masked_fill(~mask[None], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [H, n]
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    out = torch.einsum("hnk,khd->nhd", weights, v)
    return out, lse.transpose(0, 1)


def _check_rollout(device: str, backend: str, dtype: torch.dtype, atol: float, extents: bool | None = None) -> None:
    chunk, heads, kv_heads, head_dim = (16, 4, 2, 8) if backend == "reference" else (240, 4, 2, 128)
    spec = am.KVCacheSpec(
        num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, chunk_size=chunk, page_size=chunk // 2,
        sink_chunks=1, window_chunks=2, branches=("cond", "uncond"), num_qo_heads=heads,
        dtype={torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype],
    )
    cache = am.KVCache(spec, num_pages=64, device=device, backend=backend, contiguous_extents=extents)
    state = cache.open_session()
    g = torch.Generator(device=device).manual_seed(0)
    scale = 0.3
    for step, n in enumerate([1, 2, 1, 1, 3, 1]):
        seq = n * chunk
        q = torch.randn(2, seq, heads, head_dim, device=device, generator=g).to(dtype)
        k = torch.randn(2, seq, kv_heads, head_dim, device=device, generator=g).to(dtype)
        v = torch.randn(2, seq, kv_heads, head_dim, device=device, generator=g).to(dtype)
        with state.prepare_forward(None, seq, commit_current=True) as fwd:
            out, lse = am.chunk_attention(q, k, v, fwd.layers[0], scale=scale, return_lse=True)
            gather, mask = fwd._layout.dense_keys
            slots = cache._pool.kv[0].reshape(2, -1, kv_heads, head_dim)
        assert lse.shape == (2, seq, heads) and lse.dtype == torch.float32
        for s in range(2):
            ref_out, ref_lse = _float64_attention(q[s], slots[0][gather[s]], slots[1][gather[s]], mask[s].to(device), scale)
            torch.testing.assert_close(lse[s].double(), ref_lse, atol=atol, rtol=0)
            torch.testing.assert_close(out[s].double(), ref_out, atol=atol * 4, rtol=atol * 4)


def test_reference_lse_equals_float64() -> None:
    _check_rollout("cpu", "reference", torch.float32, atol=1e-4)


def test_lse_of_a_query_that_sees_nothing_is_minus_inf() -> None:
    spec = am.KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, chunk_size=4, page_size=2, dtype="float32")
    cache = am.KVCache(spec, num_pages=8)
    state = cache.open_session()
    mask = torch.ones(1, 4, 4, dtype=torch.bool)
    mask[0, 1] = False
    q = torch.randn(1, 4, 1, 4)
    with state.prepare_forward(None, 4, token_mask=mask) as fwd:
        out, lse = am.chunk_attention(q, q, q, fwd.layers[0], return_lse=True)
    assert lse[0, 1, 0] == float("-inf") and torch.isfinite(lse[0, [0, 2, 3]]).all()
    assert torch.count_nonzero(out[0, 1]) == 0


def test_lse_compiles_in_one_frame() -> None:
    from torch._dynamo.testing import CompileCounter

    spec = am.KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=8, chunk_size=4, page_size=2, sink_chunks=1,
                          window_chunks=1, dtype="float32")
    cache = am.KVCache(spec, num_pages=32)
    state = cache.open_session()
    counter = CompileCounter()
    attend = torch.compile(lambda q, kv: am.chunk_attention(q, q, q, kv, return_lse=True), backend=counter,
                           fullgraph=True)
    for _ in range(4):
        q = torch.randn(1, 4, 2, 8)
        with state.prepare_forward(None, 4, commit_current=True) as fwd:
            out, lse = attend(q, fwd.layers[0])
            ref_out, ref_lse = am.chunk_attention(q, q, q, fwd.layers[0], return_lse=True)
        torch.testing.assert_close(lse, ref_lse)
    assert counter.frame_count == 1


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.parametrize("extents", [True, False], ids=["ragged", "paged"])
def test_flashinfer_lse_equals_float64(extents: bool) -> None:
    _check_rollout("cuda", "flashinfer", torch.bfloat16, atol=2e-2, extents=extents)
