"""``check_finite`` keeps NaN/Inf out of history (issue 10): a non-finite committing forward is aborted on every
stream, history and pool bytes unchanged; off by default; ``abort_if_non_finite`` is the same check, called
before the commit."""

from __future__ import annotations

import pytest
import torch

from ardiff_modules import KVCache, KVState, SpecError, chunk_attention
from ardiff_modules.errors import NonFiniteKVError
from tests.support.small_cache import (
    BOTH,
    CHUNK,
    bit_copy,
    bookkeeping,
    commit_chunk,
    make_small_cache,
    pages_of,
    tensors,
)


def _commit_with_bad_value(state: KVState, bad: float) -> None:
    """A batched committing forward whose uncond stream writes one non-finite value, in the last layer."""
    with state.prepare_forward(BOTH, CHUNK, commit_current=True) as fwd:
        for i, layer in enumerate(fwd.layers):
            q, k, v = tensors(2, seed=100 + i)
            if i == len(fwd.layers) - 1:
                v[1, 2, 0, 3] = bad
            chunk_attention(q, k, v, layer)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_check_finite_aborts_a_non_finite_commit(bad: float) -> None:
    cache = make_small_cache(check_finite=True)
    s = cache.open_session("s")
    commit_chunk(s)
    history = pages_of(s, "cond") + pages_of(s, "uncond")
    before, kv = bookkeeping(cache, ordered=False), bit_copy(cache._pool.kv[:, :, history])
    with pytest.raises(NonFiniteKVError):
        _commit_with_bad_value(s, bad)
    assert bookkeeping(cache, ordered=False) == before  # both streams aborted, history as it was
    assert torch.equal(bit_copy(cache._pool.kv[:, :, history]), kv)
    cache._allocator.check_invariants()
    commit_chunk(s, seed=9)  # the next forward works
    assert s.committed_chunks("cond") == s.committed_chunks("uncond") == 2


def test_check_finite_is_off_by_default(small_cache: KVCache) -> None:
    cache = small_cache
    s = cache.open_session("s")
    commit_chunk(s)
    _commit_with_bad_value(s, float("nan"))
    assert s.committed_chunks("cond") == s.committed_chunks("uncond") == 2


def test_abort_if_non_finite_called_before_the_commit(small_cache: KVCache) -> None:
    """The public check (what a distributed forward runs before its vote): finite K/V change nothing and the
    forward still commits; NaN aborts every stream of the forward at once, history and pool bytes unchanged."""
    cache = small_cache  # check_finite off: only the explicit call checks
    s = cache.open_session("s")
    commit_chunk(s)
    other = make_small_cache()
    with s.prepare_forward(BOTH, CHUNK, commit_current=True) as fwd:
        for i, layer in enumerate(fwd.layers):
            chunk_attention(*tensors(2, seed=100 + i), layer)
        cache._forwards.abort_if_non_finite(fwd._transaction)
        with pytest.raises(SpecError, match="expected a ForwardTransaction"):
            cache._forwards.abort_if_non_finite(fwd)  # type: ignore[arg-type]
        with pytest.raises(SpecError, match="of another cache"):
            other._forwards.abort_if_non_finite(fwd._transaction)
        assert fwd._transaction.is_open
    assert s.committed_chunks("cond") == s.committed_chunks("uncond") == 2
    history = pages_of(s, "cond") + pages_of(s, "uncond")
    before, kv = bookkeeping(cache, ordered=False), bit_copy(cache._pool.kv[:, :, history])
    fwd = s.prepare_forward(BOTH, CHUNK, commit_current=True)
    for i, layer in enumerate(fwd.layers):
        q, k, v = tensors(2, seed=200 + i)
        if i == 0:
            k[1, 0, 1, 2] = float("nan")  # the uncond stream only: both streams must abort
        chunk_attention(q, k, v, layer)
    with pytest.raises(NonFiniteKVError, match=r"stream\(s\) \[\('s', 'uncond'\)\]"):
        cache._forwards.abort_if_non_finite(fwd._transaction)
    assert not fwd._transaction.is_open
    cache._forwards.abort_if_non_finite(fwd._transaction)  # closed: a no-op
    fwd.commit()  # finished already: nothing to do
    assert bookkeeping(cache, ordered=False) == before
    assert torch.equal(bit_copy(cache._pool.kv[:, :, history]), kv)
    cache._allocator.check_invariants()
    commit_chunk(s, seed=9)
    assert s.committed_chunks("cond") == s.committed_chunks("uncond") == 3
