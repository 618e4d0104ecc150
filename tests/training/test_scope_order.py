"""Training scopes close cleanly in any order, and in any thread (issue 40, item 3).

Closing an outer scope before an inner one used to restore the scope stack as it was before the outer one
was entered: the closed outer scope became active again and held every later gradient forward's pages
forever, while the still-open inner scope held nothing (its recomputation then failed). Checked with the
allocator's counts and the pool's contents, not only with the scopes' flags.
"""

from __future__ import annotations

import threading

import torch

import ardiff_modules as am
from ardiff_modules.cache import KVCache
from ardiff_modules.session import KVState
from tests.support.small_cache import BOTH, CHUNK, commit_chunk, make_small_cache, tensors
from tests.support.training_peers import poison_free_pages


def _session_with_history() -> tuple[KVCache, KVState]:
    cache = make_small_cache()
    state = cache.open_session()
    for seed in range(3):  # sink + window full: a gradient forward reads 3 chunks of history per branch
        commit_chunk(state, seed=seed)
    return cache, state


def _grad_forward(state: KVState, scope: am.TrainingScope | None = None) -> tuple[torch.Tensor, ...]:
    """One non-committing gradient forward on layer 0 (through ``scope.checkpoint`` when given); returns
    ``(out, q, k, v)``."""
    q, k, v = (t.requires_grad_() for t in tensors(2, seed=7))
    with state.prepare_forward(BOTH, CHUNK, commit_current=False) as fwd:
        if scope is None:
            out = am.chunk_attention(q, k, v, fwd.layers[0])
        else:
            out = scope.checkpoint(lambda *a: am.chunk_attention(*a), q, k, v, fwd.layers[0])
    return out, q, k, v


def _references(cache: KVCache) -> int:
    """Every reference the allocator counts (sessions' and scopes' alike)."""
    return sum(cache._allocator.refcount(p) for p in cache._allocator.used_pages())


def test_closing_the_outer_scope_first_leaves_the_inner_one_holding_and_nothing_leaks() -> None:
    cache, state = _session_with_history()
    ppc = cache.spec.pages_per_chunk
    outer, inner = am.TrainingScope(cache), am.TrainingScope(cache)
    outer.__enter__()
    inner.__enter__()
    outer.close()
    _grad_forward(state)
    history = 2 * 3 * ppc  # both branches' sink + window
    assert (outer.held_pages, inner.held_pages) == (0, history)
    used, references = cache._allocator.num_used, _references(cache)
    for seed in range(3):  # evict the window chunks the forward read: only the inner scope keeps them in use
        commit_chunk(state, seed=10 + seed)
    assert cache._allocator.num_used == used - 2 * ppc + 2 * 2 * ppc  # - the dropped pending chunk + the evicted
    inner.close()
    assert cache._allocator.num_used == used - 2 * ppc and _references(cache) == references - history - 2 * ppc
    references = _references(cache)
    _grad_forward(state)  # after both closed, no scope holds a later forward (the outer one used to, forever)
    assert (outer.held_pages, inner.held_pages) == (0, 0)
    assert _references(cache) == references + 2 * ppc  # its own pending chunk only
    state.close()
    assert cache._allocator.num_used == 0 and cache._allocator.num_free == cache._allocator.num_pages


def test_the_inner_scope_recomputes_after_the_outer_one_closed_first() -> None:
    """Its checkpoint recomputes from its held pages, after they were evicted and poisoned: gradients equal a
    backward without checkpointing (it used to raise TrainingScopeError: nothing was held)."""
    cache, state = _session_with_history()
    out, *inputs = _grad_forward(state)
    out.square().sum().backward()
    expected = [t.grad for t in inputs]

    cache, state = _session_with_history()
    outer, inner = am.TrainingScope(cache), am.TrainingScope(cache)
    outer.__enter__()
    inner.__enter__()
    outer.close()
    out, *inputs = _grad_forward(state, inner)
    for seed in range(3):
        commit_chunk(state, seed=10 + seed)
    assert poison_free_pages(cache) > 0
    out.square().sum().backward()
    for got, want in zip((t.grad for t in inputs), expected, strict=True):
        torch.testing.assert_close(got, want)
    inner.close()
    state.close()
    assert cache._allocator.num_used == 0


def test_a_scope_closed_in_another_thread_releases_its_holds_and_holds_nothing_after() -> None:
    cache, state = _session_with_history()
    scope = am.TrainingScope(cache).__enter__()
    _grad_forward(state)
    assert scope.held_pages > 0
    references = _references(cache) - scope.held_pages
    errors: list[BaseException] = []

    def close() -> None:
        try:
            scope.close()  # its token belongs to this thread's context: reset() used to raise, leaking the holds
        except BaseException as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    worker = threading.Thread(target=close)
    worker.start()
    worker.join()
    assert errors == [] and scope.held_pages == 0 and _references(cache) == references
    _grad_forward(state)  # still listed in this thread's stack, but closed: it takes nothing
    assert scope.held_pages == 0 and _references(cache) == references
    with am.TrainingScope(cache) as fresh:  # a new scope here works as usual
        _grad_forward(state)
        assert fresh.held_pages > 0 and _references(cache) == references + fresh.held_pages
    assert _references(cache) == references
    state.close()
    assert cache._allocator.num_used == 0
