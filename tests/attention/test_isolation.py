"""Streams never see each other's data (padding included), and a query whose token mask hides every key
outputs zeros, on the reference backend (issue 10). ``tests/gpu/test_isolation.py`` checks FlashInfer."""

from __future__ import annotations

import torch

from ardiff_modules import KVCache, chunk_attention
from tests.support.small_cache import BOTH, CHUNK, SMALL_SPEC, commit_chunk, make_small_cache, pages_of, tensors


def test_nan_in_another_sessions_page0_does_not_reach_a_batched_stream(small_cache: KVCache) -> None:
    """Reference backend pads short streams with slot 0: session A's NaN/Inf there must not leak into B."""
    cache = small_cache
    a, b = cache.open_session("a"), cache.open_session("b")
    with a.prepare_forward(("cond",), 2 * CHUNK, commit_current=True) as fwd:
        for layer in fwd.layers:
            q, k, v = tensors(1, 2 * CHUNK)
            k[...] = float("nan")
            v[...] = float("inf")
            chunk_attention(q, k, v, layer)
    assert pages_of(a, "cond")[0] == 0
    commit_chunk(b, ("cond",), seed=1)  # fewer keys than A: B's rows are padded
    q, k, v = tensors(2, seed=2)
    with cache.prepare_forward([(a, "cond"), (b, "cond")], CHUNK, commit_current=False) as fwd:
        batched = [chunk_attention(q, k, v, layer)[1] for layer in fwd.layers]
    alone_cache = make_small_cache()
    alone = alone_cache.open_session("b")
    commit_chunk(alone, ("cond",), seed=1)
    with alone.prepare_forward(("cond",), CHUNK, commit_current=False) as fwd:
        expected = [chunk_attention(q[1:], k[1:], v[1:], layer)[0] for layer in fwd.layers]
    for got, want in zip(batched, expected):
        assert torch.isfinite(got).all(), "session A's NaN/Inf reached session B"
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_token_mask_hiding_every_key_of_a_query_gives_zeros(small_cache: KVCache) -> None:
    cache = small_cache
    s = cache.open_session("s")
    commit_chunk(s)
    q, k, v = tensors(2, seed=7)
    with s.prepare_forward(BOTH, CHUNK, commit_current=False) as fwd:
        plain = chunk_attention(q, k, v, fwd.layers[0])
    max_keys = len(pages_of(s, "cond")) * SMALL_SPEC.page_size + CHUNK
    mask = torch.ones(2, CHUNK, max_keys, dtype=torch.bool)
    mask[0, 1] = False
    mask[1, 3] = False
    with s.prepare_forward(BOTH, CHUNK, commit_current=False, token_mask=mask) as fwd:
        masked = chunk_attention(q, k, v, fwd.layers[0])
    assert torch.isfinite(masked).all()
    assert torch.equal(masked[0, 1], torch.zeros_like(masked[0, 1]))
    assert torch.equal(masked[1, 3], torch.zeros_like(masked[1, 3]))
    keep = torch.ones(2, CHUNK, dtype=torch.bool)
    keep[0, 1] = keep[1, 3] = False
    torch.testing.assert_close(masked[keep], plain[keep])
