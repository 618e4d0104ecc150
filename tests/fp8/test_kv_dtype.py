"""KV storage dtype separate from the compute dtype (issue 11): ``KVCacheSpec(kv_dtype=...)``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.backends.flashinfer import FlashInferBackend

SPEC = am.KVCacheSpec(
    num_layers=2, num_kv_heads=2, head_dim=8, chunk_size=4, page_size=2, sink_chunks=1, window_chunks=2,
    branches=("cond", "uncond"), cross_attention=(am.CrossAttentionSpec("text", 3),), dtype="float32",
    num_qo_heads=4,
)


def _rollout(spec: am.KVCacheSpec, round_kv: bool) -> list[torch.Tensor]:
    cache = am.KVCache(spec, num_pages=64, backend="reference")
    state = cache.open_session()
    g = torch.Generator().manual_seed(0)
    outs = []
    for step in range(6):
        n = 2 if step == 3 else 1
        q = torch.randn(2, 4 * n, 4, 8, generator=g)
        k = torch.randn(2, 4 * n, 2, 8, generator=g)
        v = torch.randn(2, 4 * n, 2, 8, generator=g)
        if round_kv:
            k, v = k.bfloat16().float(), v.bfloat16().float()
        with state.prepare_forward(None, 4 * n, commit_current=True) as fwd:
            outs += [am.chunk_attention(q, k, v, layer) for layer in fwd.layers]
    return outs


def test_bf16_kv_under_fp32_compute_equals_fp32_with_rounded_kv() -> None:
    """Storing K/V in bfloat16 is exactly rounding them once; attention still runs in float32."""
    low = dataclasses.replace(SPEC, kv_dtype="bfloat16")
    cache = am.KVCache(low, num_pages=8, backend="reference")
    assert cache._pool.kv.dtype == torch.bfloat16 and cache.dtype == torch.float32
    assert cache.kv_dtype == torch.bfloat16
    assert cache._pool.bytes_per_page * 2 == am.KVCache(SPEC, num_pages=8)._pool.bytes_per_page
    assert tuple(cache._pool.scales.shape) == (2, 2, 2)
    for a, b in zip(_rollout(low, round_kv=False), _rollout(SPEC, round_kv=True)):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_inputs_must_be_in_the_compute_dtype_and_cross_caches_stay_in_it() -> None:
    low = dataclasses.replace(SPEC, kv_dtype="bfloat16")
    cache = am.KVCache(low, num_pages=8, backend="reference")
    state = cache.open_session()
    state.populate_cross_attention("cond", "text", [(torch.ones(3, 2, 8), torch.ones(3, 2, 8))] * 2)
    assert state.get_cross_attention_kv("cond", "text")[0]["k"].dtype == torch.float32
    with state.prepare_forward(("cond",), 4) as fwd:
        bf = torch.zeros(1, 4, 2, 8, dtype=torch.bfloat16)
        with pytest.raises(am.TensorMismatchError, match="expected dtype torch.float32"):
            am.chunk_attention(torch.zeros(1, 4, 4, 8, dtype=torch.bfloat16), bf, bf, fwd.layers[0])
        fwd.abort()


def test_kv_dtype_is_validated() -> None:
    with pytest.raises(am.SpecError, match="kv_dtype"):
        dataclasses.replace(SPEC, kv_dtype="int8")
    assert dataclasses.replace(SPEC, kv_dtype=None).cache_dtype == "float32"


def test_flashinfer_refuses_a_kv_dtype_other_than_the_compute_dtype() -> None:
    with pytest.raises(am.BackendUnavailableError, match="kv_dtype"):
        FlashInferBackend().check_supported(torch.device("cuda"), torch.bfloat16, 128, torch.float16)
