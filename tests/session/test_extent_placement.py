"""Contiguous extents in a fragmented pool: sessions arriving together take extent-sized holes (serving).

Found on the H200 (``benchmarks/serving.py --preset wan14b-like``, policy ``close_idle``): with two sessions
closed between open ones, two new CFG sessions batched in one forward need four extents; the pool held
them in two holes of two extents each, yet the forward was refused because all four had to be one run.
"""

from __future__ import annotations

import pytest
import torch

import ardiff_modules as am

CHUNK, HEADS, DIM = 4, 2, 8
EXTENT = (1 + 2 + 1) * 2  #: pages of one branch's extent: (sink 1 + window 2 + 1 pending) chunks of 2 pages


def _spec() -> am.KVCacheSpec:
    return am.KVCacheSpec(num_layers=1, num_kv_heads=HEADS, head_dim=DIM, chunk_size=CHUNK, page_size=2,
                          sink_chunks=1, window_chunks=2, branches=("cond", "uncond"), dtype="float32")


def _forward(cache: am.KVCache, states: list[am.KVState], x: torch.Tensor, commit: bool) -> torch.Tensor:
    pairs = [(s, b) for s in states for b in ("cond", "uncond")]
    with cache.prepare_forward(pairs, CHUNK, commit_current=commit) as fwd:
        return am.chunk_attention(x, x, x, fwd.layers[0])


def _holes(cache: am.KVCache) -> None:
    """Three sessions fill the 48-page pool (16 pages each); the first and the last close: two 16-page holes."""
    first = [cache.open_session(f"old{i}") for i in range(3)]
    for s in first:
        _forward(cache, [s], torch.randn(2, CHUNK, HEADS, DIM), commit=True)
    first[0].close()
    first[2].close()
    assert cache._allocator.free_runs() == [(0, 16), (32, 16)]


def test_sessions_arriving_together_take_the_holes_and_equal_a_fresh_pool() -> None:
    fragmented = am.KVCache(_spec(), num_pages=48, contiguous_extents=True)
    _holes(fragmented)
    fresh = am.KVCache(_spec(), num_pages=48, contiguous_extents=True)
    pairs = {c: [c.open_session(f"new{i}") for i in range(2)] for c in (fragmented, fresh)}
    g = torch.Generator().manual_seed(0)
    for step in range(6):  # fills the window, then evicts (the ring wraps inside the extents)
        x = torch.randn(4, CHUNK, HEADS, DIM, generator=g)
        outs = [_forward(c, states, x, commit=step % 2 == 1 or step > 3) for c, states in pairs.items()]
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)
    a, b = pairs[fragmented]
    # One run each, lowest first, in stream order: the first hole, then the second.
    assert [a.branch_pages(n).extent for n in ("cond", "uncond")] == [tuple(range(0, 8)), tuple(range(8, 16))]
    assert [b.branch_pages(n).extent for n in ("cond", "uncond")] == [tuple(range(32, 40)), tuple(range(40, 48))]
    # The pool holds each stream's K where its extent says (the last committed chunk of session b's uncond).
    x = torch.randn(4, CHUNK, HEADS, DIM, generator=g)
    _forward(fragmented, [a, b], x, commit=True)
    last = b.history_chunks("uncond")[-1]
    assert set(last) <= set(range(40, 48))
    k_pages = fragmented._pool.kv[0, 0]  # [pages, page_size, heads, dim]
    assert torch.equal(k_pages[list(last)].reshape(CHUNK, HEADS, DIM), x[3])
    # Every forward kept the streams' key ranges in page order: the ragged (unpaged) kernel path stays open.
    fwd = fragmented.prepare_forward([(s, n) for s in (a, b) for n in ("cond", "uncond")], CHUNK)
    assert fwd._layout.ragged_rows is not None and fwd._layout.ragged_rows.gap_rows >= 1
    fwd.abort()
    for s in (*pairs[fragmented], *pairs[fresh]):
        s.close()


def test_holes_too_small_refuse_before_any_change() -> None:
    cache = am.KVCache(_spec(), num_pages=64, contiguous_extents=True)
    runs = [cache._allocator.allocate_contiguous(4) for _ in range(16)]  # pages 4i .. 4i + 3
    for i in (0, 1, 2, 4, 5, 6, 7, 9, 11, 13, 15):  # free runs of 12, 16, 4, 4, 4, 4 pages: 44 free, 3 extents fit
        cache._allocator.decref(runs[i])
    assert cache._allocator.runs_that_fit(EXTENT) == 3 and cache._allocator.num_free == 44
    states = [cache.open_session(f"new{i}") for i in range(2)]
    free, kv = cache._allocator.free_pages(), cache._pool.kv.clone()
    with pytest.raises(am.CapacityError, match=r"4 new branch extent\(s\) of 8 consecutive pages each, "
                       r"the free runs \[12, 16, 4, 4, 4, 4\] hold only 3 \(44 pages free\)"):
        _forward(cache, states, torch.randn(4, CHUNK, HEADS, DIM), commit=True)
    assert cache._allocator.free_pages() == free and torch.equal(cache._pool.kv, kv)
    assert all(s.branch_pages(n).extent == () and s.pending_chunks(n) == () for s in states for n in ("cond", "uncond"))
    cache._allocator.decref(runs[3])  # pages 12..15 join the 12 and the 16 into one run of 32
    _forward(cache, states, torch.randn(4, CHUNK, HEADS, DIM), commit=True)
    assert sorted(p for s in states for n in ("cond", "uncond") for p in s.branch_pages(n).extent) == list(range(32))


def test_admission_counts_runs_and_the_extents_owed_to_admitted_sessions() -> None:
    """Pages alone would admit two sessions here; the runs hold three extents, a session needs two."""
    cache = am.KVCache(_spec(), num_pages=64, contiguous_extents=True)
    runs = [cache._allocator.allocate_contiguous(4) for _ in range(16)]
    for i in (0, 1, 2, 4, 5, 6, 7, 9, 11, 13, 15):  # free runs of 12, 16, 4, 4, 4, 4 pages: 44 free, 3 extents
        cache._allocator.decref(runs[i])
    assert cache.sessions_that_fit(recache=False) == 1  # 44 pages hold 2 sessions of 16, the runs 3 extents
    first = cache.admit_session("first", recache=False)  # owed 2 extents before its first forward
    assert cache.sessions_that_fit(recache=False) == 0 and not cache.can_admit(recache=False)
    free, sessions = cache._allocator.free_pages(), cache.stats().sessions
    with pytest.raises(am.CapacityError, match=r"needs 2 contiguous extent\(s\) of 8 pages, the free runs hold 3, "
                       r"2 of them owed to open sessions"):
        cache.admit_session("second", recache=False)
    assert cache._allocator.free_pages() == free and cache.stats().sessions == sessions
    _forward(cache, [first], torch.randn(2, CHUNK, HEADS, DIM), commit=True)  # takes its 2 extents: 1 left, none owed
    assert cache._allocator.runs_that_fit(EXTENT) == 1 and cache.sessions_that_fit(recache=False) == 0
    cache._allocator.decref(runs[3])  # pages 12..15 join a run of 12 + 4 + 16 - 16 (first's extents): room again
    fit = cache.sessions_that_fit(recache=False)
    assert fit == cache._allocator.runs_that_fit(EXTENT) // 2 >= 1
    second = cache.admit_session("second", recache=False)
    _forward(cache, [second], torch.randn(2, CHUNK, HEADS, DIM), commit=True)  # what admission promised, it runs
    first.close(), second.close()


def test_suspend_idle_frees_runs_not_only_pages() -> None:
    """With extents, ``admit_session(suspend_idle=True)`` suspends until the runs (not just the page count) hold
    the newcomer's extents; the suspended session's whole ring goes back to the free runs."""
    cache = am.KVCache(_spec(), num_pages=48, contiguous_extents=True, host_budget_bytes=1 << 24)
    olds = [cache.admit_session(f"old{i}", recache=False) for i in range(3)]
    for s in olds:
        _forward(cache, [s], torch.randn(2, CHUNK, HEADS, DIM), commit=True)
    assert cache._allocator.num_free == 0
    new = cache.admit_session("new", recache=False, suspend_idle=[olds[1]])
    assert olds[1].is_suspended and cache._allocator.free_runs() == [(16, 16)]
    _forward(cache, [new], torch.randn(2, CHUNK, HEADS, DIM), commit=True)
    assert [new.branch_pages(n).extent for n in ("cond", "uncond")] == [tuple(range(16, 24)), tuple(range(24, 32))]
