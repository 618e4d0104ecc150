"""The attention op is inference-only (issue 10): a backward through ``chunk_attention`` or
``ChunkSelfAttention`` raises ``InferenceOnlyError``."""

from __future__ import annotations

import pytest
import torch

from ardiff_modules import ChunkSelfAttention, KVCache, chunk_attention
from ardiff_modules.errors import InferenceOnlyError
from tests.support.small_cache import BOTH, CHUNK, DIM, HEADS, tensors


def test_backward_through_chunk_attention_raises_inference_only(small_cache: KVCache) -> None:
    cache = small_cache
    s = cache.open_session("s")
    with s.prepare_forward(BOTH, CHUNK, commit_current=False) as fwd:
        q, k, v = (t.requires_grad_() for t in tensors(2))
        out = chunk_attention(q, k, v, fwd.layers[0])
        with pytest.raises(InferenceOnlyError):
            out.sum().backward()


def test_backward_through_chunk_self_attention_module_raises_inference_only(small_cache: KVCache) -> None:
    """The common accident: a model in training mode (parameters require grad), no torch.no_grad()."""
    cache = small_cache
    s = cache.open_session("s")
    attn = ChunkSelfAttention(HEADS * DIM, HEADS, qk_norm="head")
    with s.prepare_forward(BOTH, CHUNK, commit_current=False) as fwd:
        out = attn(torch.randn(2, CHUNK, HEADS * DIM), fwd.layers[0])
        with pytest.raises(InferenceOnlyError):
            out.sum().backward()
