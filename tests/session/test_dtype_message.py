"""An fp32 model against a spec that leaves ``dtype`` at its default (bfloat16) (issue 26 item 6, in part).

The mismatch surfaces at the first forward, in ``chunk_attention``'s input check (or, for a model whose first
attention is a cross-attention, ``cached_cross_attention``'s): a ``TensorMismatchError`` with expected and
actual that says the expected dtype is the cache's compute dtype, the spec's default, and names both fixes.
The default itself is unchanged.
"""

from __future__ import annotations

import pytest
import torch

import ardiff_modules as am

FIX = "build the cache with KVCacheSpec(..., dtype='float32') to match the model, or run the model in bfloat16"
EXPECTED = "expected dtype torch.bfloat16 (the cache's compute dtype, KVCacheSpec.dtype='bfloat16', the default)"


def cache_for(dtype: str | None = None) -> am.KVCache:
    extra = {} if dtype is None else {"dtype": dtype}
    spec = am.KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=8, chunk_size=4, page_size=2, sink_chunks=1,
                          window_chunks=2, cross_attention=(am.CrossAttentionSpec("text", 3),), **extra)
    return am.KVCache(spec, num_pages=16, backend="reference")


def test_the_default_dtype_is_still_bfloat16() -> None:
    assert cache_for().spec.dtype == "bfloat16"


def test_an_fp32_layer_on_a_default_spec_names_the_dtype_and_the_fix() -> None:
    cache = cache_for()
    state = cache.open_session()
    attn = am.ChunkSelfAttention(16, 2)  # float32 weights
    with pytest.raises(am.TensorMismatchError) as caught, torch.no_grad():
        with state.prepare_forward(None, 4, commit_current=True) as fwd:
            attn(torch.randn(1, 4, 16), fwd.layers[0])
    message = str(caught.value)
    assert message.startswith("chunk_attention q: " + EXPECTED + ", got torch.float32: ")
    assert FIX in message
    assert state.history_chunk_indices("main") == ()  # the forward aborted, nothing committed
    fixed = cache_for("float32").open_session()
    with torch.no_grad(), fixed.prepare_forward(None, 4, commit_current=True) as fwd:
        attn(torch.randn(1, 4, 16), fwd.layers[0])  # the named fix works
    assert fixed.history_chunk_indices("main") == (0,)


def test_cross_attention_first_says_the_same() -> None:
    cache = cache_for()
    state = cache.open_session()
    cross = am.CachedCrossAttention(16, 2, "text")
    am.populate_cross_attention(state, "main", [cross], torch.randn(3, 16))  # stored in bfloat16
    with state.prepare_forward(None, 4) as fwd, torch.no_grad():
        with pytest.raises(am.TensorMismatchError) as caught:
            cross(torch.randn(1, 4, 16), fwd.layers[0])
        fwd.abort()
    assert str(caught.value).startswith("cached_cross_attention q: " + EXPECTED + ", got torch.float32: ")
    assert FIX in str(caught.value)
