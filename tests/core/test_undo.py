"""The core's one undo: allocator checkpoints, the canonical free order, and a held reservation rolled back.

A distributed forward prepares holding its reservation until every rank voted; an abort before that
must leave the branches, every refcount, the free queue's order, the peak *and the pool's contents*
exactly as before the prepare (the pending pages of the denoising forward it replaced still hold that
forward's K/V).
"""

from __future__ import annotations

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.core.admission import Admission, ExtentRoom
from ardiff_modules.core.allocator import PageAllocator
from ardiff_modules.errors import CapacityError, SpecError
from ardiff_modules.session import ForwardOptions

from tests.support.kv_writes import write_every_layer

CHUNK, PAGE = 8, 4


def _cache(extents: bool) -> am.KVCache:
    spec = am.KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, chunk_size=CHUNK, page_size=PAGE,
                          sink_chunks=1, window_chunks=2, branches=("cond", "uncond"))
    return am.KVCache(spec, num_pages=64, backend="reference", contiguous_extents=extents)


def _snapshot(cache: am.KVCache, state: am.KVState) -> tuple[object, ...]:
    allocator = cache._allocator
    branches = tuple(
        (b.history, b.pending, b.extent, b.committed_chunks)
        for b in (state.branch_pages(name) for name in state.kv_branch_names)
    )
    refcounts = tuple(allocator.refcount(p) for p in range(allocator.num_pages))
    return allocator.free_pages(), refcounts, allocator.peak_used, branches


# ------------------------------------------------------------------ allocator
def test_checkpoint_restores_peak_and_free_order_after_a_contiguous_allocation():
    allocator = PageAllocator(8)
    allocator.decref(allocator.allocate(3)[::-1])  # free queue: 3..7, 2, 1, 0; peak 3
    before = allocator.free_pages()
    checkpoint = allocator.checkpoint(free_order=True)
    pages = allocator.allocate_contiguous(4)  # takes 0..3: the queue is reordered
    assert allocator.peak_used == 4 and allocator.free_pages() != before[4:]
    allocator.unallocate(pages, checkpoint)
    assert allocator.free_pages() == before and allocator.peak_used == 3
    # Without the free order: the pages go back to the front (undoing allocate), the peak as checkpointed.
    checkpoint = allocator.checkpoint()
    allocator.unallocate(allocator.allocate(5), checkpoint)
    assert allocator.free_pages() == before and allocator.peak_used == 3
    allocator.check_invariants()


def test_reorder_free_is_canonical_and_changes_only_the_order():
    a, b = PageAllocator(6), PageAllocator(6)
    pa, pb = a.allocate(4), b.allocate(4)
    a.decref(pa)
    b.decref(pb[::-1])  # the same pages freed in another order
    assert a.free_pages() != b.free_pages()
    first = (5, 3, 9)  # 9 is not free (not even a page): ignored
    for allocator in (a, b):
        peak = allocator.peak_used
        allocator.reorder_free(first)
        assert allocator.peak_used == peak and allocator.num_free == 6
        allocator.check_invariants()
    assert a.free_pages() == b.free_pages() == (5, 3, 0, 1, 2, 4)


# ------------------------------------------------------------------ admission on ints
def test_admission_arithmetic_matches_the_cache():
    cache = _cache(extents=True)
    admission = Admission(2, cache.spec.max_history_chunks, cache.spec.pages_per_chunk, cache.extent_chunks)
    assert admission.pages_per_session() == cache.pages_per_session() == 2 * 4 * 2
    assert admission.recache_reserve() == cache.recache_reserve() == 2 * 2 * 2
    # 64 free pages hold 8 extents of 8 in one run: the page count is the bound here
    assert admission.sessions_that_fit(64, 0, 0, ExtentRoom(8, 0), 1, True) == cache.sessions_that_fit() == (64 - 8) // 16
    cache.open_session()  # owed its 2 extents
    assert cache._host_tier.device_counts(admission) == (64, 0, 1, ExtentRoom(8, 2))
    assert admission.sessions_that_fit(64, 0, 1, ExtentRoom(8, 2), 1, True) == cache.sessions_that_fit() == (64 - 16 - 8) // 16
    with pytest.raises(CapacityError, match="a session needs up to 16 pages, only 8 are free"):
        admission.check_admit(28, 4, 1, None, 1, True)  # 24 promised (a peak + the reserve), 4 of them in use
    # enough pages, too few runs: 3 extents, 2 owed, a session needs 2
    assert admission.sessions_that_fit(64, 0, 1, ExtentRoom(3, 2), 1, True) == 0
    with pytest.raises(CapacityError, match=r"needs 2 contiguous extent\(s\) of 8 pages, the free runs hold 3, 2 of"):
        admission.check_admit(64, 0, 1, ExtentRoom(3, 2), 1, True)
    with pytest.raises(SpecError, match="bounded window"):
        Admission(1, None, 2, None).pages_per_session()


# ------------------------------------------------------------------ the held reservation
@pytest.mark.parametrize("extents", [False, True])
def test_an_aborted_held_reservation_restores_everything_exactly(extents):
    cache = _cache(extents)
    state = cache.open_session("s")
    streams = [(state, "cond"), (state, "uncond")]
    for _ in range(3):  # history, then a kept denoising forward whose pending pages hold its K/V
        with state.prepare_forward(("cond", "uncond"), CHUNK, commit_current=True) as fwd:
            write_every_layer(fwd.layers, seed=1)
    fresh = cache.open_session("fresh")  # a branch with no extent yet: the held prepare reserves one
    kept = state.prepare_forward(("cond", "uncond"), CHUNK, commit_current=False)
    write_every_layer(kept.layers, seed=2)
    pending = [p for name in ("cond", "uncond") for c in state.pending_chunks(name) for p in c]
    written = cache._pool.kv[:, :, pending].clone()
    before, before_fresh = _snapshot(cache, state), _snapshot(cache, fresh)[3]

    two_chunks = ForwardOptions(chunk_lengths=(CHUNK, CHUNK))  # grows pending: the kept chunk is replaced
    held = cache._forwards.prepare(streams + [(fresh, "cond")], 2 * CHUNK, True, two_chunks, hold=True)
    assert held._transaction is not None and held._transaction.reservation is not None
    assert kept._transaction.status == "superseded"
    assert _snapshot(cache, state) != before
    cache._forwards.finish_forward(held._transaction, False)

    assert held._transaction.status == "aborted"
    assert _snapshot(cache, state) == before, "branches, refcounts, free order and peak as before the prepare"
    assert _snapshot(cache, fresh)[3] == before_fresh, "the extent the held prepare reserved was given back"
    assert torch.equal(cache._pool.kv[:, :, pending], written), "the restored pending pages kept their K/V"
    cache._allocator.check_invariants()
    # The restored pending chunks are reused as they are by the next forward of the same length.
    again = state.prepare_forward(("cond", "uncond"), CHUNK, commit_current=True)
    assert [p for c in state.pending_chunks("cond") for p in c] == pending[: len(pending) // 2]
    again.abort()


def test_a_kept_reservation_is_not_rolled_back():
    cache = _cache(extents=False)
    state = cache.open_session("s")
    kept = state.prepare_forward(("cond",), CHUNK, commit_current=False)
    write_every_layer(kept.layers)
    ctx = cache._forwards.prepare([(state, "cond")], 2 * CHUNK, True, ForwardOptions(chunk_lengths=(CHUNK, CHUNK)),
                                 hold=True)
    assert ctx._transaction is not None
    ctx._transaction.keep_reservation()  # the vote passed: the replaced chunk is released now
    assert ctx._transaction.reservation is None
    used = cache._allocator.num_used
    cache._forwards.finish_forward(ctx._transaction, False)  # an ordinary abort: the pending chunks are dropped
    assert state.pending_chunks("cond") == () and cache._allocator.num_used == used - 2 * CHUNK // PAGE
    cache._allocator.check_invariants()


@pytest.mark.parametrize("extents", [False, True])
def test_a_held_reservation_whose_pool_changed_is_dropped_not_rolled_back(extents):
    """Another forward between a held prepare and its abort changes the pool: the recorded free order and peak are
    stale, so the abort drops the forward's pages (and releases what it replaced) instead of restoring them."""
    cache = _cache(extents)
    held_state, other = cache.open_session("held"), cache.open_session("other")
    kept = held_state.prepare_forward(("cond",), CHUNK, commit_current=False)
    write_every_layer(kept.layers)
    held = cache._forwards.prepare([(held_state, "cond")], 2 * CHUNK, True, ForwardOptions(chunk_lengths=(CHUNK, CHUNK)),
                                  hold=True)
    with other.prepare_forward(("cond", "uncond"), CHUNK, commit_current=True) as fwd:  # the pool changes
        write_every_layer(fwd.layers)
    assert held._transaction is not None and not held._transaction.reservation.can_roll_back()
    cache._forwards.finish_forward(held._transaction, False)
    assert held._transaction.status == "aborted" and held_state.pending_chunks("cond") == ()
    assert cache._allocator.peak_used >= cache._allocator.num_used
    cache._allocator.check_invariants()
    held_state.close()
    other.close()
    assert cache._allocator.num_used == 0, "no page of the held forward (nor of what it replaced) leaked"


def test_a_held_forward_superseded_before_its_vote_leaks_nothing():
    """A held denoising forward replaced a longer kept one; a later prepare supersedes it before any keep: closing
    it releases the replaced chunk, so closing the session frees every page."""
    cache = _cache(extents=False)
    state = cache.open_session("s")
    kept = state.prepare_forward(("cond",), 2 * CHUNK, commit_current=False, chunk_lengths=(CHUNK, CHUNK))
    write_every_layer(kept.layers)
    cache._forwards.prepare([(state, "cond")], CHUNK, False, ForwardOptions(), hold=True)  # 2 chunks -> 1
    later = state.prepare_forward(("cond",), CHUNK, commit_current=False)  # supersedes the held one
    assert later._transaction is not None and later._transaction.is_open
    later.abort()
    state.close()
    assert cache._allocator.num_used == 0
    cache._allocator.check_invariants()
