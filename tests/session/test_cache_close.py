"""``KVCache.close()`` frees every page, context and session, is idempotent and refuses later calls; a cache
is a context manager (issue 10)."""

from __future__ import annotations

import pytest
import torch

from ardiff_modules import KVCache, chunk_attention
from ardiff_modules.errors import CacheClosedError
from tests.support.small_cache import CHUNK, RELEASED, commit_chunk, make_small_cache, run_layers, tensors


def test_cache_close_frees_everything_is_idempotent_and_refuses_later_calls(small_cache: KVCache) -> None:
    cache = small_cache
    a = cache.open_session("a")
    a.populate_cross_attention("cond", "text", [(torch.ones(3, 2, 4), torch.ones(3, 2, 4))] * 2)
    commit_chunk(a)
    child = a.fork("child")
    fwd = cache.prepare_forward([(a, "cond"), (child, "uncond")], CHUNK, commit_current=True)  # in flight
    run_layers(fwd.layers, 2)
    cache.close()
    assert cache.is_closed and a.is_closed and child.is_closed
    assert cache.sessions == {} and cache._forwards.num_contexts == 0
    assert cache._allocator.num_free == cache._allocator.num_pages
    cache._allocator.check_invariants()
    assert cache._pool.kv.numel() == 0, "the pool's memory was not released"
    cache.close()  # idempotent
    assert cache.is_closed
    for call in (
        lambda: cache.open_session(),
        lambda: cache.admit_session(),
        lambda: cache.prepare_forward([(a, "cond")], CHUNK),
        lambda: a.reset(),
    ):
        with pytest.raises(CacheClosedError):
            call()
    with pytest.raises(RELEASED):
        chunk_attention(*tensors(2), fwd.layers[0])
    fwd.commit()  # finished already: nothing to do
    assert cache._allocator.num_free == cache._allocator.num_pages


def test_cache_is_a_context_manager() -> None:
    with make_small_cache() as cache:
        s = cache.open_session()
        commit_chunk(s)
    assert cache.is_closed and s.is_closed and cache._allocator.num_free == cache._allocator.num_pages
    with pytest.raises(RuntimeError, match="body failed"), make_small_cache() as failing:
        commit_chunk(failing.open_session())
        raise RuntimeError("body failed")
    assert failing.is_closed and failing._allocator.num_free == failing._allocator.num_pages
