"""A committing forward commits only when every layer wrote its K/V (issue 24): a forward that ran only some
layers (or none, or skipped one in compiled code) is aborted with ``IncompleteForwardError`` instead of making a
closed session's stale K/V history; a denoising forward may run some layers; a partial re-cache keeps the old
window."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from ardiff_modules import KVCache, KVState, chunk_attention
from ardiff_modules.errors import IncompleteForwardError
from tests.support.small_cache import BOTH, CHUNK, bit_copy, commit_chunk, make_small_cache, pages_of, tensors


def _stale_pages_setup() -> tuple[KVCache, KVState, set[int]]:
    """Session ``a`` committed one chunk of constant K/V (1e3) in every layer and closed: its pages are free
    but still hold its K/V. Returns the cache, a fresh session ``b`` and those pages."""
    cache = make_small_cache(num_pages=4)  # one chunk of both branches: b's pending pages are a's old ones
    a = cache.open_session("a")
    with a.prepare_forward(BOTH, CHUNK, commit_current=True) as fwd:
        for layer in fwd.layers:
            chunk_attention(*tensors(2, fill=1e3), layer)
    stale = {p for branch in BOTH for p in pages_of(a, branch)}
    a.close()
    return cache, cache.open_session("b"), stale


@pytest.mark.parametrize("how", ["with", "ctx.commit", "commit_paged_context"])
def test_a_forward_that_ran_only_some_layers_is_not_committed(how: str) -> None:
    """Unwritten layers of the pending pages hold a closed session's K/V: committing would make them b's history."""
    cache, b, stale = _stale_pages_setup()
    fwd = b.prepare_forward(BOTH, CHUNK, commit_current=True)
    assert {p for branch in BOTH for chunk in b.pending_chunks(branch) for p in chunk} == stale
    chunk_attention(*tensors(2, seed=3), fwd.layers[0])  # layer 1 never runs (an early return, a removed hook)
    with pytest.raises(IncompleteForwardError, match=r"all 2 layers.*layer\(s\) 1\b") as raised:
        if how == "with":
            with fwd:
                pass
        elif how == "ctx.commit":
            fwd.commit()
        else:
            b.commit_paged_context("uncond")
    assert isinstance(raised.value, RuntimeError) and "aborted" in str(raised.value)
    assert fwd.status == "aborted" and b._open_forward("cond") is None
    assert b.committed_chunks("cond") == b.committed_chunks("uncond") == 0 and cache._allocator.num_used == 0
    cache._allocator.check_invariants()
    commit_chunk(b, seed=4)  # a complete forward commits; its history holds its own K/V, not a's
    for branch in BOTH:
        for page in pages_of(b, branch):
            assert not bool((cache._pool.kv[:, :, page] == 1e3).any()), "a closed session's K/V in b's history"


def test_a_forward_where_no_layer_ran_is_not_committed() -> None:
    cache, b, _ = _stale_pages_setup()
    with pytest.raises(IncompleteForwardError, match=r"got 0 \(no write from layer\(s\) 0-1\)"):
        with b.prepare_forward(BOTH, CHUNK, commit_current=True):
            pass
    assert b.committed_chunks("cond") == 0 and cache._allocator.num_used == 0


def test_a_denoising_forward_may_run_some_layers(small_cache: KVCache) -> None:
    """Nothing of a denoising forward becomes history: a partial one completes (the commit rewrites all)."""
    cache = small_cache
    s = cache.open_session("s")
    with s.prepare_forward(BOTH, CHUNK, commit_current=False) as fwd:
        chunk_attention(*tensors(2), fwd.layers[0])
    assert fwd.status == "completed"
    commit_chunk(s)
    assert s.committed_chunks("cond") == 1


def test_a_recache_that_ran_only_some_layers_keeps_the_valid_old_window(small_cache: KVCache) -> None:
    cache = small_cache
    s = cache.open_session("s")
    for i in range(4):
        commit_chunk(s, seed=i)  # sink + window 2 (one chunk evicted)
    visible = {b: s.history_chunks(b) for b in BOTH}
    history = [p for b in BOTH for p in pages_of(s, b)]
    kv, free = bit_copy(cache._pool.kv)[:, :, history], sorted(cache._allocator.free_pages())
    with pytest.raises(IncompleteForwardError):
        with s.prepare_recache(BOTH) as fwd:
            q, k, v = tensors(2, fwd.seq_len, seed=9)
            chunk_attention(q, k, v, fwd.layers[0])
    assert {b: s.history_chunks(b) for b in BOTH} == visible, "the old window was thrown away"
    assert torch.equal(bit_copy(cache._pool.kv)[:, :, history], kv)
    assert sorted(cache._allocator.free_pages()) == free and s._open_forward("cond") is None
    cache._allocator.check_invariants()


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compiled_forward_that_skips_a_layer_is_not_committed() -> None:
    """The compiled write path (``kv_write_slots`` gate + in-graph ``index_put_``) records writes too."""
    cache, b, _ = _stale_pages_setup()
    counter = CompileCounter()

    @torch.compile(backend=counter, fullgraph=True)
    def first_layers(q, k, v, layers):
        return [chunk_attention(q, k, v, layer) for layer in layers]

    q, k, v = tensors(2, seed=5)
    with pytest.raises(IncompleteForwardError):
        with b.prepare_forward(BOTH, CHUNK, commit_current=True) as fwd:
            first_layers(q, k, v, fwd.layers[:1])
    assert b.committed_chunks("cond") == 0 and cache._allocator.num_used == 0
    with b.prepare_forward(BOTH, CHUNK, commit_current=True) as fwd:
        first_layers(q, k, v, fwd.layers[:1])
        first_layers(q, k, v, fwd.layers[1:])
    assert b.committed_chunks("cond") == 1
