"""Misuse of the training path raises the library's errors and changes nothing (issue 27)."""

from __future__ import annotations

import pytest
import torch

import ardiff_modules as am
from tests.support.training_peers import poison_free_pages
from tests.support.small_cache import BOTH, CHUNK, bit_copy, commit_chunk, make_small_cache, tensors


def test_a_gradient_forward_on_a_finished_forward_is_refused_before_it_writes() -> None:
    cache = make_small_cache()
    state = cache.open_session()
    commit_chunk(state)
    fwd = state.prepare_forward(BOTH, CHUNK, commit_current=True)
    with fwd:
        for layer in fwd.layers:
            am.chunk_attention(*tensors(2), layer)
    before = bit_copy(cache._pool.kv)
    q, k, v = (t.requires_grad_() for t in tensors(2, seed=3))
    with pytest.raises(am.errors.ForwardFinishedError):
        am.chunk_attention(q, k, v, fwd.layers[0])
    assert torch.equal(bit_copy(cache._pool.kv), before)


def test_gradient_forwards_check_their_inputs_like_the_others() -> None:
    cache = make_small_cache()
    state = cache.open_session()
    with state.prepare_forward(BOTH, CHUNK, commit_current=False) as fwd:
        q, k, v = (t.requires_grad_() for t in tensors(2))
        with pytest.raises(am.TensorMismatchError, match="expected shape"):
            am.chunk_attention(q[:, :2], k, v, fwd.layers[0])
        with pytest.raises(am.TensorMismatchError, match="dtype"):
            am.chunk_attention(q.double(), k, v, fwd.layers[0])


def test_scope_misuse() -> None:
    with pytest.raises(am.SpecError, match="expected a KVCache"):
        am.TrainingScope(object())  # type: ignore[arg-type]
    cache = make_small_cache()
    scope = am.TrainingScope(cache)
    with pytest.raises(am.TrainingScopeError, match="entered scope"):
        scope.checkpoint(lambda x: x, torch.ones(1, requires_grad=True))
    with scope:
        pass
    with pytest.raises(am.TrainingScopeError, match="already entered"):
        scope.__enter__()


def test_backward_without_recomputation_after_the_scope_needs_nothing_held() -> None:
    """Without checkpointing, autograd saved what the backward needs: a backward after the scope ended (and
    after the pages were reused) is fine, and equals one inside it."""
    results = []
    for inside in (True, False):
        cache = make_small_cache()
        state = cache.open_session()
        commit_chunk(state)
        q, k, v = (t.requires_grad_() for t in tensors(2, seed=4))
        with am.TrainingScope(cache):
            with state.prepare_forward(BOTH, CHUNK, commit_current=False) as fwd:
                out = am.chunk_attention(q, k, v, fwd.layers[0])
            if inside:
                out.sum().backward()
        if not inside:
            for _ in range(4):  # evict and reuse every page the forward read
                commit_chunk(state, seed=9)
            assert poison_free_pages(cache) > 0
            out.sum().backward()
        results.append((q.grad, k.grad, v.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)
