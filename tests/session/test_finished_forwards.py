"""A finished forward never touches the pool (issue 10: each test failed on the code before its fix).

A forward is one transaction over all its streams. Once it finished (commit, abort, ``reset()`` / ``close()``
of a member session, superseded by the next forward of a stream, its context released by the cache) its layer
contexts must not touch the pool: the custom op raises before writing, in eager and compiled code. An abort
inside the ``with`` block stops the model's later layers too.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

from ardiff_modules import KVCache, chunk_attention, populate_cross_attention
from ardiff_modules.errors import ForwardFinishedError
from tests.support.small_cache import (
    BOTH,
    CHUNK,
    DIM,
    HEADS,
    RELEASED,
    SMALL_SPEC,
    bit_copy,
    bookkeeping,
    commit_chunk,
    make_small_cache,
    pages_of,
    run_layers,
    tensors,
)
from tests.support.streaming_model import tiny_model_and_spec


def assert_refused(cache: KVCache, layers, streams: int, n: int = CHUNK, errors=ForwardFinishedError) -> None:
    """Every stale layer context raises ``errors`` in the op; the pool and the bookkeeping are bit-identical."""
    kv, before = bit_copy(cache._pool.kv), bookkeeping(cache)
    for layer in layers:
        with pytest.raises(errors):
            chunk_attention(*tensors(streams, n, fill=1e4), layer)
    assert torch.equal(bit_copy(cache._pool.kv), kv), "a finished forward wrote into the pool"
    assert bookkeeping(cache) == before
    cache._allocator.check_invariants()


@pytest.mark.parametrize("commit_current", [True, False], ids=["committing", "denoising"])
@pytest.mark.parametrize("api", ["with", "seed"])
def test_committed_forward_cannot_write(commit_current: bool, api: str, small_cache: KVCache) -> None:
    """After the commit its pending pages are history (committing) or kept for the next forward (denoising)."""
    cache = small_cache
    a = cache.open_session("a")
    commit_chunk(a)
    if api == "with":
        with a.prepare_forward(BOTH, CHUNK, commit_current=commit_current) as fwd:
            run_layers(fwd.layers, 2, seed=10)
        layers, streams = fwd.layers, 2
    else:  # the seed's per-branch API
        layers, streams = a.get_kv_caches("cond", CHUNK, commit_current=commit_current), 1
        run_layers(layers, 1, seed=10)
        a.commit_paged_context("cond")
    assert a._open_forward("cond") is None and a._open_forward("uncond") is None
    assert a.committed_chunks("cond") == 1 + commit_current
    assert_refused(cache, layers, streams)


def test_finished_forward_cannot_write_through_the_lse_op(small_cache: KVCache) -> None:
    """``chunk_attention(..., return_lse=True)`` is another custom op: it checks the forward too."""
    cache = small_cache
    a = cache.open_session("a")
    commit_chunk(a)
    with a.prepare_forward(BOTH, CHUNK, commit_current=True) as fwd:
        out, lse = chunk_attention(*tensors(2), fwd.layers[0], return_lse=True)
        chunk_attention(*tensors(2), fwd.layers[1], return_lse=True)  # a commit needs every layer
    assert out.shape == (2, CHUNK, HEADS, DIM) and lse.shape == (2, CHUNK, HEADS)
    kv = bit_copy(cache._pool.kv)
    with pytest.raises(ForwardFinishedError):
        chunk_attention(*tensors(2, fill=1e4), fwd.layers[1], return_lse=True)
    assert torch.equal(bit_copy(cache._pool.kv), kv)


def test_aborted_forward_cannot_write_into_pages_given_to_another_session() -> None:
    cache = make_small_cache(num_pages=8)
    a, b = cache.open_session("a"), cache.open_session("b")
    commit_chunk(a)  # a: pages 0..3
    fwd = a.prepare_forward(BOTH, CHUNK, commit_current=True)
    run_layers(fwd.layers, 2, seed=10)
    pending = {p for br in BOTH for chunk in a.pending_chunks(br) for p in chunk}
    fwd.abort()
    assert a.committed_chunks("cond") == 1 and a.pending_chunks("cond") == ()
    commit_chunk(b, seed=20)  # the only free pages are the aborted forward's
    assert {p for br in BOTH for p in pages_of(b, br)} == pending
    assert_refused(cache, fwd.layers, 2)


def test_reset_session_forward_cannot_write() -> None:
    cache = make_small_cache(num_pages=8)
    a, b = cache.open_session("a"), cache.open_session("b")
    commit_chunk(a)
    fwd = a.prepare_forward(BOTH, CHUNK, commit_current=True)
    run_layers(fwd.layers, 2, seed=10)
    a.reset()
    assert a._open_forward("cond") is None and a.committed_chunks("cond") == 0
    assert cache._allocator.num_free == 8
    commit_chunk(b, seed=20)  # reuses a's old pages
    assert_refused(cache, fwd.layers, 2)


def test_closing_a_member_session_finishes_the_whole_forward() -> None:
    """A batched forward over (a, cond) and (b, cond): a.close() aborts b's stream too; nothing is committed."""
    cache = make_small_cache(num_pages=12)
    a, b = cache.open_session("a"), cache.open_session("b")
    commit_chunk(a, ("cond",))
    commit_chunk(b, ("cond",), seed=5)
    b_history = pages_of(b, "cond")
    with cache.prepare_forward([(a, "cond"), (b, "cond")], CHUNK, commit_current=True) as fwd:
        run_layers(fwd.layers, 2, seed=10)
        a.close()
        assert b._open_forward("cond") is None and b.pending_chunks("cond") == ()
        assert_refused(cache, fwd.layers, 2, errors=RELEASED)
    # The with block exits normally: the forward already finished, nothing gets committed.
    assert b.committed_chunks("cond") == 1 and pages_of(b, "cond") == b_history
    assert cache._allocator.num_used == len(b_history)
    c = cache.open_session("c")
    commit_chunk(c, seed=30)  # takes a's and the aborted forward's pages
    assert_refused(cache, fwd.layers, 2, errors=RELEASED)


def test_superseded_denoising_forward_cannot_write(small_cache: KVCache) -> None:
    """The next forward of one of its streams supersedes a denoising forward; its pending pages move on."""
    cache = small_cache
    a = cache.open_session("a")
    commit_chunk(a)
    old = a.prepare_forward(BOTH, CHUNK, commit_current=False)
    run_layers(old.layers, 2, seed=10)
    new = a.prepare_forward(("cond",), CHUNK, commit_current=False)  # another context, same cond pages
    assert new is not old and a._open_forward("uncond") is None
    run_layers(new.layers, 1, seed=20)
    assert_refused(cache, old.layers, 2)
    new.commit()


def test_lru_evicted_context_cannot_write_into_reallocated_pages() -> None:
    cache = KVCache(SMALL_SPEC, num_pages=4, backend="reference", max_forward_contexts=1)
    a, b = cache.open_session("a"), cache.open_session("b")
    commit_chunk(a, ("cond",))  # pages 0, 1
    fwd = a.prepare_forward(("cond",), CHUNK, commit_current=False)
    run_layers(fwd.layers, 1, seed=10)
    fwd.commit()  # a denoising forward: its pending pages stay reserved ...
    pending = {p for chunk in a.pending_chunks("cond") for p in chunk}
    a.abort("cond")  # ... until dropped
    commit_chunk(b, ("cond",), seed=20)  # a new context (the LRU releases a's) on a's old pending pages
    assert set(pages_of(b, "cond")) == pending
    assert cache._forwards.num_contexts == 1 and fwd._released
    assert_refused(cache, fwd.layers, 1, errors=RELEASED)


def test_finished_forward_cannot_write_into_fork_shared_pages(small_cache: KVCache) -> None:
    cache = small_cache
    a = cache.open_session("a")
    commit_chunk(a)
    with a.prepare_forward(BOTH, CHUNK, commit_current=True) as fwd:
        run_layers(fwd.layers, 2, seed=10)
    child = a.fork("child")
    shared = pages_of(child, "cond") + pages_of(child, "uncond")
    assert shared == pages_of(a, "cond") + pages_of(a, "uncond")
    assert all(cache._allocator.refcount(p) == 2 for p in shared)
    assert_refused(cache, fwd.layers, 2)


def test_abort_inside_the_with_block_stops_the_model(small_cache: KVCache) -> None:
    cache = small_cache
    a = cache.open_session("a")
    commit_chunk(a)
    before = bookkeeping(cache, ordered=False)
    history = bit_copy(cache._pool.kv[:, :, pages_of(a, "cond") + pages_of(a, "uncond")])
    kv = None
    with pytest.raises(ForwardFinishedError), a.prepare_forward(BOTH, CHUNK, commit_current=True) as fwd:
        for i, layer in enumerate(fwd.layers):  # the model keeps running after the abort
            chunk_attention(*tensors(2, fill=float(i + 1)), layer)
            if i == 0:
                fwd.abort()
                kv = bit_copy(cache._pool.kv)
    assert torch.equal(bit_copy(cache._pool.kv), kv), "layer 1 wrote after the abort"
    assert bookkeeping(cache, ordered=False) == before
    assert torch.equal(bit_copy(cache._pool.kv[:, :, pages_of(a, "cond") + pages_of(a, "uncond")]), history)
    commit_chunk(a, seed=3)  # the session goes on
    assert a.committed_chunks("cond") == 2


def _compiled_setup(backend):
    model, spec = tiny_model_and_spec()
    cache = KVCache(spec, num_pages=64, backend="reference")
    state = cache.open_session("s")
    for branch in spec.branches:
        populate_cross_attention(state, branch, [blk.cross for blk in model.blocks], torch.randn(5, model.context_dim))
    return model, cache, state, torch.compile(model, backend=backend, fullgraph=True)


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_model_refuses_finished_forwards() -> None:
    """inductor, fullgraph: the op's runtime check fires inside compiled code, before any write."""
    counter = CompileCounterWithBackend("inductor")
    model, cache, state, compiled = _compiled_setup(counter)
    x = torch.randn(2, CHUNK, model.dim)
    with torch.no_grad():
        with state.prepare_forward(BOTH, CHUNK, commit_current=True) as fwd:
            compiled(x, fwd.layers)
        kv = bit_copy(cache._pool.kv)
        with pytest.raises(ForwardFinishedError):  # committed
            compiled(x, fwd.layers)
        assert torch.equal(bit_copy(cache._pool.kv), kv)
        fwd = state.prepare_forward(BOTH, CHUNK, commit_current=True)
        fwd.abort()
        kv = bit_copy(cache._pool.kv)
        with pytest.raises(ForwardFinishedError):  # aborted
            compiled(x, fwd.layers)
        assert torch.equal(bit_copy(cache._pool.kv), kv)
        fwd = state.prepare_forward(BOTH, CHUNK, commit_current=True)
        state.reset(keep_cross_attention=("text",))
        with pytest.raises(ForwardFinishedError):  # reset
            compiled(x, fwd.layers)
        assert torch.equal(bit_copy(cache._pool.kv), kv)
        with state.prepare_forward(BOTH, CHUNK, commit_current=True) as fwd:  # valid again: same graph
            compiled(x, fwd.layers)
    assert state.committed_chunks("cond") == 1
    assert counter.frame_count == 1


@pytest.mark.usefixtures("fresh_dynamo")
def test_rollout_with_finish_checks_compiles_to_one_frame() -> None:
    counter = CompileCounter()
    model, cache, state, compiled = _compiled_setup(counter)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for chunk in range(6):  # past the window: evictions
            for step in range(3):
                commit = step == 2
                x = torch.randn(2, CHUNK, model.dim, generator=g)
                with state.prepare_forward(BOTH, CHUNK, commit_current=commit) as fwd:
                    compiled(x, fwd.layers)
                    if chunk == 3 and step == 1:
                        fwd.abort()  # a finish check inside the block
                        with pytest.raises(ForwardFinishedError):
                            compiled(x, fwd.layers)
                kv = bit_copy(cache._pool.kv)
                with pytest.raises(ForwardFinishedError):
                    compiled(x, fwd.layers)
                assert torch.equal(bit_copy(cache._pool.kv), kv)
    assert state.committed_chunks("cond") == 6
    assert counter.frame_count == 1, f"expected one compiled frame, got {counter.frame_count}"
