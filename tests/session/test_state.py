"""KVState / KVCache scenarios on tiny CPU pools, with exact page ids.

Geometry used throughout: 2 layers, 2 KV heads, head_dim 4, chunk_size 4, page_size 2
(so a chunk is 2 pages), 1 sink chunk, a window of 2 chunks, branches ("cond", "uncond"),
float32, reference backend. One page costs 2 layers x (K, V) x 2 tokens x 2 heads x 4 dims x
4 bytes = 256 bytes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ardiff_modules import (
    CacheStats,
    CapacityError,
    CrossAttentionSpec,
    ForwardContext,
    KVCache,
    KVCacheSpec,
    KVState,
    LayerContext,
    PendingContextError,
    SpecError,
    TensorMismatchError,
    chunk_attention,
)
from ardiff_modules.errors import (
    CrossAttentionNotPopulatedError,
    ForwardFinishedError,
    SessionClosedError,
    UnknownCacheError,
)
from ardiff_modules.backends import ReferenceBackend
from tests.support.kv_writes import write_every_layer

SPEC = KVCacheSpec(
    num_layers=2,
    num_kv_heads=2,
    head_dim=4,
    chunk_size=4,
    page_size=2,
    sink_chunks=1,
    window_chunks=2,
    branches=("cond", "uncond"),
    cross_attention=(
        CrossAttentionSpec("text", 3),
        CrossAttentionSpec("image", 2, num_kv_heads=1, head_dim=8),
    ),
    dtype="float32",
)
CHUNK = SPEC.chunk_size
BYTES_PER_PAGE = 256


def make_cache(num_pages: int = 16, **overrides) -> KVCache:
    spec = dataclasses.replace(SPEC, **overrides) if overrides else SPEC
    return KVCache(spec, num_pages=num_pages, backend="reference")


def commit_chunks(state: KVState, branch: str = "cond", chunks: int = 1) -> None:
    write_every_layer(state.get_kv_caches(branch, chunks * CHUNK, commit_current=True))
    state.commit_paged_context(branch)


def write_layers(layers: list[LayerContext], value: float) -> None:
    """Run chunk_attention on every layer with K = value + layer, V = -(value + layer)."""
    for layer in layers:
        streams, seq_len = layer.positions.shape
        q = torch.randn(streams, seq_len, 2, 4)
        k = torch.full((streams, seq_len, 2, 4), float(value + layer.layer_index))
        out = chunk_attention(q, k, -k, layer)
        assert out.shape == (streams, seq_len, 2, 4)


def page_values(cache: KVCache, pages) -> list[torch.Tensor]:
    """Per layer, (K, V) of ``pages`` (cloned)."""
    idx = list(pages)
    return [(cache._pool.k_pages(i)[idx].clone(), cache._pool.v_pages(i)[idx].clone()) for i in range(2)]


def assert_pages_hold(cache: KVCache, pages, value: float) -> None:
    for layer, (k, v) in enumerate(page_values(cache, pages)):
        assert torch.all(k == value + layer), (layer, k)
        assert torch.all(v == -(value + layer)), (layer, v)


def cross_pairs(name: str = "text", seed: float = 1.0, layers: int = 2):
    spec = SPEC.cross_attention_spec(name)
    shape = (spec.tokens, spec.num_kv_heads or SPEC.num_kv_heads, spec.head_dim or SPEC.head_dim)
    return [
        (torch.full(shape, seed + 10 * i), torch.full(shape, -(seed + 10 * i)))
        for i in range(layers)
    ]


def branch_snapshot(state: KVState, branch: str):
    return (
        state.history_chunks(branch),
        state.pending_chunks(branch),
        state.token_offset(branch),
        state.committed_chunks(branch),
    )


# ---------------------------------------------------------------------- sessions and lazy allocation


def test_open_session_allocates_nothing():
    cache = make_cache()
    state = cache.open_session("a")
    assert isinstance(state, KVState)
    assert state.kv_branch_names == ("cond", "uncond")
    assert state.num_layers == 2
    assert not state.is_closed
    assert state.pages_in_use() == 0
    assert cache._allocator.free_pages() == tuple(range(16))
    for branch in ("cond", "uncond"):
        assert branch_snapshot(state, branch) == ((), (), 0, 0)
    assert cache.sessions == {"a": state}


def test_lazy_per_branch_allocation_unused_branch_holds_no_pages():
    cache = make_cache()
    state = cache.open_session("a")
    layers = state.get_kv_caches("cond", CHUNK)
    assert [type(layer) for layer in layers] == [LayerContext, LayerContext]
    assert [layer.layer_index for layer in layers] == [0, 1]
    assert state.pending_chunks("cond") == ((0, 1),)
    assert state.pending_chunks("uncond") == ()
    assert state.history_chunks("uncond") == ()
    assert cache._allocator.free_pages() == tuple(range(2, 16))
    assert cache.stats().sessions == {"a": {"cond": 2, "uncond": 0}}
    for _ in range(3):
        commit_chunks(state, "cond")
    assert cache.stats().sessions == {"a": {"cond": 6, "uncond": 0}}
    assert state.pages_in_use() == 6


def test_layer_contexts_view_the_pool():
    cache = make_cache()
    state = cache.open_session("a")
    layers = state.get_kv_caches("cond", CHUNK)
    for i, layer in enumerate(layers):
        assert layer.k_cache.data_ptr() == cache._pool.k_pages(i).data_ptr()
        assert layer.v_cache.data_ptr() == cache._pool.v_pages(i).data_ptr()
        assert layer.k_cache.shape == (16, 2, 2, 4)
        assert layer.num_streams == 1 and layer.seq_len == CHUNK
        assert torch.equal(layer.positions, torch.arange(4)[None])


# ---------------------------------------------------------------------- denoising reuses pending pages


def test_denoise_forwards_reuse_pending_pages():
    cache = make_cache()
    state = cache.open_session("a")
    for step in range(3):
        layers = state.get_kv_caches("cond", CHUNK, commit_current=False)
        write_layers(layers, 100 + step)
        assert state.pending_chunks("cond") == ((0, 1),)
        assert state.history_chunks("cond") == ()
        assert cache._allocator.free_pages() == tuple(range(2, 16))  # no churn
        if step % 2:  # closing a denoising forward keeps its pages reserved
            state.commit_paged_context("cond")
            assert state.pending_chunks("cond") == ((0, 1),)
    assert_pages_hold(cache, (0, 1), 102)
    # The clean (committing) forward is one more overwrite of the same pages.
    layers = state.get_kv_caches("cond", CHUNK, commit_current=True)
    assert state.pending_chunks("cond") == ((0, 1),)
    assert cache._allocator.free_pages() == tuple(range(2, 16))
    write_layers(layers, 7)
    state.commit_paged_context("cond")
    assert state.history_chunks("cond") == ((0, 1),)
    assert state.pending_chunks("cond") == ()
    assert cache._allocator.free_pages() == tuple(range(2, 16))
    assert [cache._allocator.refcount(p) for p in (0, 1)] == [1, 1]
    assert_pages_hold(cache, (0, 1), 7)


def test_forward_context_is_reused_across_forwards_of_the_same_streams():
    cache = make_cache()
    state = cache.open_session("a")
    fwd1 = state.prepare_forward(("cond",), CHUNK, commit_current=False)
    fwd1.commit()
    fwd2 = state.prepare_forward(("cond",), CHUNK, commit_current=True)
    assert fwd2 is fwd1
    assert fwd2.layers[0] is fwd1.layers[0]
    write_every_layer(fwd2.layers)
    fwd2.commit()
    assert state.history_chunks("cond") == ((0, 1),)


def test_release_idle_forward_contexts_keeps_open_ones():
    cache = make_cache()
    a, b = cache.open_session("a"), cache.open_session("b")
    idle = a.prepare_forward(("cond",), CHUNK, commit_current=True)
    write_every_layer(idle.layers)
    idle.commit()
    open_fwd = b.prepare_forward(("cond",), CHUNK, commit_current=False)
    assert cache._forwards.num_contexts == 2
    assert cache.release_idle_forward_contexts() == 1
    assert cache._forwards.contexts() == (open_fwd,) and idle._released and open_fwd.is_active
    open_fwd.commit()  # still usable
    again = a.prepare_forward(("cond",), CHUNK, commit_current=True)  # a fresh context for a's streams
    assert again is not idle and not again._released
    write_every_layer(again.layers)
    again.commit()
    assert a.committed_chunks("cond") == 2


# ---------------------------------------------------------------------- commit


def test_commit_turns_pending_into_history_without_copying():
    cache = make_cache()
    state = cache.open_session("a")
    kv_ptr = cache._pool.kv.data_ptr()
    layers = state.get_kv_caches("cond", CHUNK, commit_current=True)
    pending = state.pending_chunks("cond")
    assert pending == ((0, 1),)
    write_layers(layers, 5)
    state.commit_paged_context("cond")
    assert state.history_chunks("cond") == pending  # same page ids
    assert_pages_hold(cache, (0, 1), 5)  # same data, in place
    assert cache._pool.kv.data_ptr() == kv_ptr
    assert state.token_offset("cond") == CHUNK
    assert state.committed_chunks("cond") == 1


def test_commit_with_nothing_pending_is_a_noop():
    cache = make_cache()
    state = cache.open_session("a")
    state.commit_paged_context("cond")
    assert branch_snapshot(state, "cond") == ((), (), 0, 0)
    commit_chunks(state)
    before = (branch_snapshot(state, "cond"), cache._allocator.free_pages())
    state.commit_paged_context("cond")
    state.commit_paged_context("cond")
    assert (branch_snapshot(state, "cond"), cache._allocator.free_pages()) == before


def test_eviction_frees_oldest_window_chunk_and_next_allocation_reuses_it():
    # Exactly (1 sink + 2 window + 1 pending) chunks of pages.
    cache = make_cache(num_pages=8)
    state = cache.open_session("a")
    commit_chunks(state)  # c0 -> sink
    commit_chunks(state)  # c1
    commit_chunks(state)  # c2
    assert state.history_chunks("cond") == ((0, 1), (2, 3), (4, 5))
    assert cache._allocator.free_pages() == (6, 7)

    write_every_layer(state.get_kv_caches("cond", CHUNK, commit_current=True))
    assert state.pending_chunks("cond") == ((6, 7),)
    assert cache._allocator.free_pages() == ()
    state.commit_paged_context("cond")  # c3 evicts c1
    assert state.history_chunks("cond") == ((0, 1), (4, 5), (6, 7))
    assert cache._allocator.free_pages() == (2, 3)
    assert cache._allocator.refcount(2) == 0

    write_every_layer(state.get_kv_caches("cond", CHUNK, commit_current=True))
    assert state.pending_chunks("cond") == ((2, 3),)  # the evicted chunk's pages
    state.commit_paged_context("cond")  # c4 evicts c2
    assert state.history_chunks("cond") == ((0, 1), (6, 7), (2, 3))
    assert cache._allocator.free_pages() == (4, 5)

    commit_chunks(state)  # c5 evicts c3
    assert state.history_chunks("cond") == ((0, 1), (2, 3), (4, 5))
    assert cache._allocator.free_pages() == (6, 7)
    assert state.committed_chunks("cond") == 6  # evicted chunks included
    assert state.token_offset("cond") == 6 * CHUNK
    cache._allocator.check_invariants()


def test_sinks_are_never_evicted_and_offsets_keep_advancing():
    cache = make_cache(num_pages=8)
    state = cache.open_session("a")
    for n in range(1, 21):
        layers = state.get_kv_caches("cond", CHUNK, commit_current=True)
        assert torch.equal(layers[0].positions, torch.arange((n - 1) * CHUNK, n * CHUNK)[None])
        write_every_layer(layers)
        state.commit_paged_context("cond")
        visible = state.history_chunks("cond")
        assert visible[0] == (0, 1)
        assert len(visible) == min(n, 3)
        assert state.committed_chunks("cond") == n
        assert state.token_offset("cond") == n * CHUNK
        assert cache._allocator.num_used == 2 * len(visible)


def test_window_none_never_evicts():
    cache = make_cache(num_pages=12, window_chunks=None)
    state = cache.open_session("a")
    for _ in range(5):
        commit_chunks(state)
    assert state.history_chunks("cond") == ((0, 1), (2, 3), (4, 5), (6, 7), (8, 9))
    assert cache._allocator.free_pages() == (10, 11)


def test_window_zero_and_sink_zero_keeps_nothing_but_advances_offsets():
    cache = make_cache(num_pages=4, sink_chunks=0, window_chunks=0)
    state = cache.open_session("a")
    for n in range(1, 4):
        layers = state.get_kv_caches("cond", CHUNK, commit_current=True)
        assert layers[0].forward._layout.streams[0].history_pages == ()
        write_every_layer(layers)
        state.commit_paged_context("cond")
        assert state.history_chunks("cond") == ()
        assert state.token_offset("cond") == n * CHUNK
        assert cache._allocator.num_free == 4


# ---------------------------------------------------------------------- multi-chunk forwards


def test_multi_chunk_forwards_commit_and_evict():
    cache = make_cache()
    state = cache.open_session("a")
    fwd = state.prepare_forward("cond", 2 * CHUNK, commit_current=True)
    assert fwd.num_chunks == 2 and fwd.seq_len == 8
    assert state.pending_chunks("cond") == ((0, 1), (2, 3))
    write_every_layer(fwd.layers)
    state.commit_paged_context("cond")
    assert state.history_chunks("cond") == ((0, 1), (2, 3))
    assert state.token_offset("cond") == 8

    fwd = state.prepare_forward("cond", 3 * CHUNK, commit_current=True)
    assert state.pending_chunks("cond") == ((4, 5), (6, 7), (8, 9))
    assert torch.equal(fwd.positions, torch.arange(8, 20)[None])
    assert fwd.token_offsets == (8,)
    # History visible to the forward: sink + window, then the pending chunks block-causally.
    rows = fwd._layout.structural_rows
    assert rows.kv_page_indptr.tolist() == [0, 6, 14, 24]
    assert rows.kv_page_indices.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    write_every_layer(fwd.layers)
    state.commit_paged_context("cond")
    assert state.history_chunks("cond") == ((0, 1), (6, 7), (8, 9))
    assert cache._allocator.free_pages() == (10, 11, 12, 13, 14, 15, 2, 3, 4, 5)
    assert state.committed_chunks("cond") == 5
    assert state.token_offset("cond") == 20


def test_multi_chunk_denoise_shrinks_and_grows_pending():
    cache = make_cache()
    state = cache.open_session("a")
    state.get_kv_caches("cond", 2 * CHUNK)
    assert state.pending_chunks("cond") == ((0, 1), (2, 3))
    state.get_kv_caches("cond", CHUNK)  # fewer chunks: the surplus is freed, the first chunk kept
    assert state.pending_chunks("cond") == ((0, 1),)
    assert cache._allocator.free_pages() == tuple(range(4, 16)) + (2, 3)
    write_every_layer(state.get_kv_caches("cond", 2 * CHUNK, commit_current=True))  # more: the first is reused
    assert state.pending_chunks("cond") == ((0, 1), (4, 5))
    state.commit_paged_context("cond")
    assert state.history_chunks("cond") == ((0, 1), (4, 5))
    assert state.pending_chunks("cond") == ()


# ---------------------------------------------------------------------- the seed's guard


def test_committing_forward_replaced_before_commit_raises():
    cache = make_cache()
    state = cache.open_session("a")
    state.get_kv_caches("cond", CHUNK, commit_current=True)
    before = (branch_snapshot(state, "cond"), cache._allocator.free_pages())
    for commit_current in (True, False):
        with pytest.raises(PendingContextError) as exc_info:
            state.get_kv_caches("cond", CHUNK, commit_current=commit_current)
        assert "'cond'" in str(exc_info.value) and "'a'" in str(exc_info.value)
        assert isinstance(exc_info.value, RuntimeError)
    assert (branch_snapshot(state, "cond"), cache._allocator.free_pages()) == before
    # Another branch is independent.
    state.get_kv_caches("uncond", CHUNK, commit_current=True)
    assert state.pending_chunks("uncond") == ((2, 3),)


def test_committing_forward_can_be_replaced_after_commit():
    cache = make_cache()
    state = cache.open_session("a")
    write_every_layer(state.get_kv_caches("cond", CHUNK, commit_current=True))
    state.commit_paged_context("cond")
    state.get_kv_caches("cond", CHUNK, commit_current=True)
    assert state.pending_chunks("cond") == ((2, 3),)


def test_committing_forward_can_be_replaced_after_abort():
    cache = make_cache()
    state = cache.open_session("a")
    state.get_kv_caches("cond", CHUNK, commit_current=True)
    state.abort("cond")
    assert cache._allocator.free_pages() == tuple(range(2, 16)) + (0, 1)
    state.get_kv_caches("cond", CHUNK, commit_current=True)
    assert state.pending_chunks("cond") == ((2, 3),)


def test_non_committing_forwards_can_be_replaced_freely():
    cache = make_cache()
    state = cache.open_session("a")
    for _ in range(4):
        state.get_kv_caches("cond", CHUNK, commit_current=False)
    state.get_kv_caches("cond", CHUNK, commit_current=True)  # a denoise forward may be followed by the clean one
    assert state.pending_chunks("cond") == ((0, 1),)
    with pytest.raises(PendingContextError):
        state.get_kv_caches("cond", CHUNK, commit_current=False)


def test_seq_len_required_by_get_kv_caches():
    from ardiff_modules.errors import SequenceLengthError

    cache = make_cache()
    state = cache.open_session("a")
    with pytest.raises(SequenceLengthError):
        state.get_kv_caches("cond")
    assert state.prepare_paged_context("cond", CHUNK, False)[0].seq_len == CHUNK


# ---------------------------------------------------------------------- abort


def test_abort_restores_history_exactly_and_frees_pending_pages():
    cache = make_cache()
    state = cache.open_session("a")
    for value in (1, 2):
        layers = state.get_kv_caches("cond", CHUNK, commit_current=True)
        write_layers(layers, value)
        state.commit_paged_context("cond")
    history = state.history_chunks("cond")
    assert history == ((0, 1), (2, 3))
    hist_before = page_values(cache, (0, 1, 2, 3))
    snap = branch_snapshot(state, "cond")
    refs = [cache._allocator.refcount(p) for p in range(16)]
    free_set = set(cache._allocator.free_pages())

    layers = state.get_kv_caches("cond", 2 * CHUNK, commit_current=True)
    assert state.pending_chunks("cond") == ((4, 5), (6, 7))
    write_layers(layers, 99)
    state.abort("cond")

    assert branch_snapshot(state, "cond") == snap
    assert [cache._allocator.refcount(p) for p in range(16)] == refs
    assert set(cache._allocator.free_pages()) == free_set
    for (k0, v0), (k1, v1) in zip(hist_before, page_values(cache, (0, 1, 2, 3))):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    # The next forward of the chunk works normally.
    commit_chunks(state)
    assert state.history_chunks("cond") == ((0, 1), (2, 3), (8, 9))


def test_abort_all_branches():
    cache = make_cache()
    state = cache.open_session("a")
    commit_chunks(state, "uncond")
    state.prepare_forward(None, CHUNK, commit_current=True)
    assert state.pending_chunks("cond") == ((2, 3),)
    assert state.pending_chunks("uncond") == ((4, 5),)
    state.abort()
    assert state.pending_chunks("cond") == () and state.pending_chunks("uncond") == ()
    assert state.history_chunks("uncond") == ((0, 1),)
    assert state.pages_in_use() == 2
    state.abort()  # nothing pending: a no-op
    assert state.pages_in_use() == 2


def test_abort_of_a_denoise_forward_frees_its_reserved_pages():
    cache = make_cache()
    state = cache.open_session("a")
    state.get_kv_caches("cond", CHUNK)
    state.commit_paged_context("cond")  # closes the forward, keeps the pages reserved
    assert state.pending_chunks("cond") == ((0, 1),)
    state.abort("cond")
    assert state.pending_chunks("cond") == ()
    assert cache._allocator.num_free == 16


# ---------------------------------------------------------------------- context-manager form


def test_context_manager_commits_on_success():
    cache = make_cache()
    state = cache.open_session("a")
    with state.prepare_forward(("cond", "uncond"), CHUNK, commit_current=True) as fwd:
        assert isinstance(fwd, ForwardContext)
        assert fwd.streams == (("a", "cond"), ("a", "uncond"))
        write_layers(fwd.layers, 3)
    assert state.history_chunks("cond") == ((0, 1),)
    assert state.history_chunks("uncond") == ((2, 3),)
    assert state.pending_chunks("cond") == state.pending_chunks("uncond") == ()
    assert state.token_offset("cond") == state.token_offset("uncond") == CHUNK
    assert_pages_hold(cache, (0, 1, 2, 3), 3)


def test_context_manager_aborts_on_exception_and_history_is_exactly_as_before():
    cache = make_cache()
    state = cache.open_session("a")
    with state.prepare_forward(("cond", "uncond"), CHUNK, commit_current=True) as fwd:
        write_layers(fwd.layers, 3)
    snaps = {b: branch_snapshot(state, b) for b in ("cond", "uncond")}
    hist = page_values(cache, (0, 1, 2, 3))
    refs = [cache._allocator.refcount(p) for p in range(16)]

    with pytest.raises(RuntimeError, match="boom"):
        with state.prepare_forward(("cond", "uncond"), CHUNK, commit_current=True) as fwd:
            assert state.pending_chunks("cond") == ((4, 5),)
            write_layers(fwd.layers, 42)
            raise RuntimeError("boom")

    assert {b: branch_snapshot(state, b) for b in ("cond", "uncond")} == snaps
    assert [cache._allocator.refcount(p) for p in range(16)] == refs
    for (k0, v0), (k1, v1) in zip(hist, page_values(cache, (0, 1, 2, 3))):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    # Nothing is left pending: a new committing forward is allowed.
    with state.prepare_forward(("cond", "uncond"), CHUNK, commit_current=True) as fwd:
        write_every_layer(fwd.layers)
    assert state.committed_chunks("cond") == 2


def test_context_manager_denoise_success_keeps_pending_and_exception_drops_it():
    cache = make_cache()
    state = cache.open_session("a")
    with state.prepare_forward("cond", CHUNK, commit_current=False):
        pass
    assert state.pending_chunks("cond") == ((0, 1),)
    assert state.history_chunks("cond") == ()
    with pytest.raises(ValueError):
        with state.prepare_forward("cond", CHUNK, commit_current=False):
            raise ValueError("bad step")
    assert state.pending_chunks("cond") == ()
    assert cache._allocator.num_free == 16


def test_context_manager_exit_skips_branches_committed_by_hand():
    cache = make_cache()
    state = cache.open_session("a")
    with state.prepare_forward(("cond", "uncond"), CHUNK, commit_current=True) as fwd:
        write_every_layer(fwd.layers)
        state.commit_paged_context("cond")  # issue 10: one forward commits all its streams together
        assert state.history_chunks("cond") == ((0, 1),)
        assert state.history_chunks("uncond") == ((2, 3),) and state.pending_chunks("uncond") == ()
        state.commit_paged_context("uncond")  # the seed's per-branch loop: already committed, a no-op
    assert state.history_chunks("cond") == ((0, 1),)
    assert state.history_chunks("uncond") == ((2, 3),)
    assert state.committed_chunks("cond") == 1  # not committed twice


def test_plan_failure_rolls_back_the_allocation():
    class FlakyBackend(ReferenceBackend):
        fail = True

        def plan(self, *args, **kwargs):  # signature-agnostic: only the failure matters here
            if self.fail:
                raise RuntimeError("plan failed")
            return super().plan(*args, **kwargs)

    backend = FlakyBackend()
    cache = KVCache(SPEC, num_pages=16, backend=backend)
    state = cache.open_session("a")
    other = cache.open_session("b")
    backend.fail = False
    commit_chunks(state)
    commit_chunks(other)
    snaps = (branch_snapshot(state, "cond"), branch_snapshot(other, "cond"))
    refs = [cache._allocator.refcount(p) for p in range(16)]
    free = cache._allocator.free_pages()
    backend.fail = True
    with pytest.raises(RuntimeError, match="plan failed"):
        cache.prepare_forward([(state, "cond"), (other, "cond")], CHUNK, commit_current=True)
    assert (branch_snapshot(state, "cond"), branch_snapshot(other, "cond")) == snaps
    assert [cache._allocator.refcount(p) for p in range(16)] == refs
    assert cache._allocator.free_pages() == free  # exactly: free-queue order included
    backend.fail = False
    commit_chunks(state)  # no stale pending record blocks the branch
    assert state.committed_chunks("cond") == 2


# ---------------------------------------------------------------------- batched forwards


def test_batched_multi_branch_forward_and_per_branch_commit():
    cache = make_cache()
    state = cache.open_session("a")
    commit_chunks(state, "uncond")  # uncond is one chunk ahead
    fwd = state.prepare_forward(None, CHUNK, commit_current=True)  # default: every branch, spec order
    assert fwd.streams == (("a", "cond"), ("a", "uncond"))
    assert state.pending_chunks("cond") == ((2, 3),)
    assert state.pending_chunks("uncond") == ((4, 5),)
    assert torch.equal(fwd.positions, torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]]))
    assert fwd.token_offsets == (0, 4)
    assert fwd.layers[0].num_streams == 2

    write_every_layer(fwd.layers)
    state.commit_paged_context("cond")  # commits the whole forward: cond and uncond together (issue 10)
    assert state.history_chunks("cond") == ((2, 3),)
    assert state.history_chunks("uncond") == ((0, 1), (4, 5)) and state.pending_chunks("uncond") == ()
    with pytest.raises(ForwardFinishedError):
        fwd.layers[0].forward._check_usable()
    state.commit_paged_context("uncond")  # the seed's per-branch loop: already committed, a no-op
    assert state.history_chunks("uncond") == ((0, 1), (4, 5))
    assert state.token_offset("uncond") == 8 and state.token_offset("cond") == 4


def test_batched_forward_order_follows_the_request():
    cache = make_cache()
    state = cache.open_session("a")
    fwd = state.prepare_forward(("uncond", "cond"), CHUNK)
    assert fwd.streams == (("a", "uncond"), ("a", "cond"))
    assert state.pending_chunks("uncond") == ((0, 1),)
    assert state.pending_chunks("cond") == ((2, 3),)
    assert fwd._layout.write_slots.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]


def test_batched_forward_over_two_sessions():
    cache = make_cache()
    a = cache.open_session("a")
    b = cache.open_session("b")
    commit_chunks(b)
    fwd = cache.prepare_forward([(a, "cond"), (b, "cond")], CHUNK, commit_current=True)
    assert fwd.streams == (("a", "cond"), ("b", "cond"))
    assert a.pending_chunks("cond") == ((2, 3),)
    assert b.pending_chunks("cond") == ((4, 5),)
    write_layers(fwd.layers, 8)
    fwd.commit()
    assert a.history_chunks("cond") == ((2, 3),)
    assert b.history_chunks("cond") == ((0, 1), (4, 5))
    assert_pages_hold(cache, (2, 3, 4, 5), 8)
    assert cache.stats().sessions == {"a": {"cond": 2, "uncond": 0}, "b": {"cond": 4, "uncond": 0}}


def test_capacity_error_in_state_changes_nothing():
    cache = make_cache(num_pages=6)
    state = cache.open_session("a")
    commit_chunks(state)
    commit_chunks(state)
    before = (branch_snapshot(state, "cond"), cache._allocator.free_pages())
    with pytest.raises(CapacityError) as exc_info:
        state.prepare_forward("cond", 2 * CHUNK)
    assert (exc_info.value.needed, exc_info.value.free) == (4, 2)
    assert (branch_snapshot(state, "cond"), cache._allocator.free_pages()) == before
    state.prepare_forward("cond", CHUNK)  # one chunk still fits
    assert state.pending_chunks("cond") == ((4, 5),)


# ---------------------------------------------------------------------- reset / close


def populate(state: KVState, branch: str, name: str = "text", seed: float = 1.0) -> None:
    state.populate_cross_attention(branch, name, cross_pairs(name, seed))


def test_reset_frees_pages_zeroes_offsets_and_drops_cross_caches():
    cache = make_cache()
    state = cache.open_session("a")
    other = cache.open_session("b")
    commit_chunks(other)
    for _ in range(4):
        commit_chunks(state, "cond")
    commit_chunks(state, "uncond")
    state.get_kv_caches("cond", CHUNK, commit_current=True)  # pending work is dropped too
    populate(state, "cond")
    populate(other, "cond")
    other_snap = branch_snapshot(other, "cond")

    state.reset()
    for branch in ("cond", "uncond"):
        assert branch_snapshot(state, branch) == ((), (), 0, 0)
        assert not state.is_cross_attention_populated(branch, "text")
    assert state.pages_in_use() == 0
    assert cache._allocator.num_used == 2  # only the other session's chunk
    assert branch_snapshot(other, "cond") == other_snap
    assert other.is_cross_attention_populated("cond", "text")
    assert not state.is_closed and cache.sessions["a"] is state
    commit_chunks(state)  # starts over at offset 0
    assert state.token_offset("cond") == CHUNK


def test_reset_keeps_named_cross_caches():
    cache = make_cache()
    state = cache.open_session("a")
    commit_chunks(state)
    populate(state, "cond", "text", 1.0)
    populate(state, "uncond", "text", 2.0)
    populate(state, "cond", "image", 3.0)
    state.reset(keep_cross_attention=("text",))
    assert state.is_cross_attention_populated("cond", "text")
    assert state.is_cross_attention_populated("uncond", "text")
    assert not state.is_cross_attention_populated("cond", "image")
    assert torch.all(state.get_cross_attention_kv("uncond", "text")[1]["k"] == 12.0)
    assert state.pages_in_use() == 0
    state.reset(keep_cross_attention="text")  # a bare name is one name
    assert state.is_cross_attention_populated("cond", "text")


def test_reset_with_unknown_cache_name_changes_nothing():
    cache = make_cache()
    state = cache.open_session("a")
    commit_chunks(state)
    state.get_kv_caches("cond", CHUNK)
    populate(state, "cond")
    before = (branch_snapshot(state, "cond"), cache._allocator.free_pages(), state._cross_entries())
    with pytest.raises(UnknownCacheError) as exc_info:
        state.reset(keep_cross_attention=("text", "prompt"))
    assert "'prompt'" in str(exc_info.value) and "'text'" in str(exc_info.value)
    assert (branch_snapshot(state, "cond"), cache._allocator.free_pages(), state._cross_entries()) == before


def test_reset_reopens_a_closed_session():
    cache = make_cache()
    state = cache.open_session("a")
    commit_chunks(state)
    state.close()
    state.reset()
    assert not state.is_closed
    assert cache.sessions == {"a": state}
    commit_chunks(state)
    assert state.history_chunks("cond") == ((2, 3),)


def test_reset_of_a_closed_session_whose_id_was_reused_raises():
    cache = make_cache()
    old = cache.open_session("a")
    old.close()
    new = cache.open_session("a")
    with pytest.raises(SpecError) as exc_info:
        old.reset()
    assert "'a'" in str(exc_info.value)
    assert old.is_closed
    assert cache.sessions == {"a": new}


def test_close_frees_every_page_and_is_idempotent():
    cache = make_cache()
    state = cache.open_session("a")
    other = cache.open_session("b")
    for _ in range(5):
        commit_chunks(state, "cond")
    commit_chunks(state, "uncond")
    state.prepare_forward(None, CHUNK, commit_current=True)
    populate(state, "cond")
    commit_chunks(other)
    other_snap = branch_snapshot(other, "cond")

    state.close()
    assert state.is_closed
    assert state.pages_in_use() == 0
    assert cache._allocator.used_pages() == other.history_chunks("cond")[0]
    assert cache.sessions == {"b": other}
    assert "a" not in cache.stats().sessions
    assert branch_snapshot(other, "cond") == other_snap
    state.close()
    assert cache._allocator.num_used == 2
    other.close()
    assert cache._allocator.num_free == 16
    assert cache.stats().cross_attention_bytes == 0
    cache._allocator.check_invariants()


CLOSED_CALLS = {
    "get_kv_caches": lambda s: s.get_kv_caches("cond", CHUNK),
    "prepare_paged_context": lambda s: s.prepare_paged_context("cond", CHUNK, True),
    "prepare_forward": lambda s: s.prepare_forward(None, CHUNK),
    "commit_paged_context": lambda s: s.commit_paged_context("cond"),
    "abort": lambda s: s.abort(),
    "abort_branch": lambda s: s.abort("cond"),
    "token_offset": lambda s: s.token_offset("cond"),
    "committed_chunks": lambda s: s.committed_chunks("cond"),
    "history_chunks": lambda s: s.history_chunks("cond"),
    "pending_chunks": lambda s: s.pending_chunks("cond"),
    "is_cross_attention_populated": lambda s: s.is_cross_attention_populated("cond", "text"),
    "populate_cross_attention": lambda s: s.populate_cross_attention("cond", "text", cross_pairs()),
    "get_cross_attention_kv": lambda s: s.get_cross_attention_kv("cond", "text"),
    "clear_cross_attention": lambda s: s.clear_cross_attention(),
    "cache.prepare_forward": lambda s: s.cache.prepare_forward([(s, "cond")], CHUNK),
}


@pytest.mark.parametrize("call", list(CLOSED_CALLS))
def test_every_call_after_close_raises_session_closed(call):
    cache = make_cache()
    state = cache.open_session("a")
    other = cache.open_session("b")
    commit_chunks(state)
    commit_chunks(other)
    populate(state, "cond")
    state.close()
    free = cache._allocator.free_pages()
    with pytest.raises(SessionClosedError) as exc_info:
        CLOSED_CALLS[call](state)
    assert "'a'" in str(exc_info.value) and "closed" in str(exc_info.value)
    assert cache._allocator.free_pages() == free
    assert other.history_chunks("cond") == ((2, 3),)


def test_close_during_a_context_manager_forward():
    cache = make_cache()
    state = cache.open_session("a")
    with state.prepare_forward("cond", CHUNK, commit_current=True):
        state.close()
    assert cache._allocator.num_free == 16


# ---------------------------------------------------------------------- cross-attention


def test_cross_attention_populate_get_is_populated():
    cache = make_cache()
    state = cache.open_session("a")
    assert not state.is_cross_attention_populated("cond", "text")
    pairs = cross_pairs("text", 1.0)
    state.populate_cross_attention("cond", "text", pairs)
    assert state.is_cross_attention_populated("cond", "text")
    assert not state.is_cross_attention_populated("uncond", "text")
    assert not state.is_cross_attention_populated("cond", "image")
    layers = state.get_cross_attention_kv("cond", "text")
    assert len(layers) == 2
    for (k, v), entry in zip(pairs, layers):
        assert set(entry) == {"k", "v"}
        assert entry["k"].shape == (3, 2, 4)
        assert torch.equal(entry["k"], k) and torch.equal(entry["v"], v)
    # The cache holds a copy: mutating the source does not change it.
    pairs[0][0].fill_(123.0)
    assert torch.all(state.get_cross_attention_kv("cond", "text")[0]["k"] == 1.0)
    # Own head count / head dim.
    state.populate_cross_attention("cond", "image", cross_pairs("image", 5.0))
    assert state.get_cross_attention_kv("cond", "image")[1]["v"].shape == (2, 1, 8)
    assert cache._allocator.num_used == 0  # cross caches do not use pool pages


def test_cross_attention_dtype_is_converted_to_the_pool_dtype():
    cache = make_cache()
    state = cache.open_session("a")
    pairs = [(k.double(), v.double()) for k, v in cross_pairs()]
    state.populate_cross_attention("cond", "text", pairs)
    assert state.get_cross_attention_kv("cond", "text")[0]["k"].dtype == torch.float32


def test_cross_attention_repopulate_replaces():
    cache = make_cache()
    state = cache.open_session("a")
    populate(state, "cond", seed=1.0)
    populate(state, "cond", seed=2.0)
    assert torch.all(state.get_cross_attention_kv("cond", "text")[0]["k"] == 2.0)


def test_cross_attention_visible_in_forward_contexts():
    cache = make_cache()
    state = cache.open_session("a")
    populate(state, "cond", seed=1.0)
    populate(state, "uncond", seed=2.0)
    fwd = state.prepare_forward(None, CHUNK)
    k, v = fwd.layers[1].cross_kv("text")
    assert k.shape == (2, 3, 2, 4)
    assert torch.all(k[0] == 11.0) and torch.all(k[1] == 12.0)
    assert torch.all(v[0] == -11.0)
    with pytest.raises(CrossAttentionNotPopulatedError):
        fwd.layers[0].cross_kv("image")
    fwd.commit()
    # Re-populating is seen by the next forward of the same (reused) context.
    populate(state, "uncond", seed=3.0)
    fwd = state.prepare_forward(None, CHUNK)
    k, _ = fwd.layers[0].cross_kv("text")
    assert torch.all(k[0] == 1.0) and torch.all(k[1] == 3.0)


def test_clear_cross_attention_keeps_self_attention_history():
    cache = make_cache()
    state = cache.open_session("a")
    other = cache.open_session("b")
    for _ in range(2):
        commit_chunks(state)
    state.get_kv_caches("cond", CHUNK)
    populate(state, "cond")
    populate(state, "uncond", "image")
    populate(other, "cond")
    snap = branch_snapshot(state, "cond")
    free = cache._allocator.free_pages()
    state.clear_cross_attention()
    assert not state.is_cross_attention_populated("cond", "text")
    assert not state.is_cross_attention_populated("uncond", "image")
    assert branch_snapshot(state, "cond") == snap
    assert cache._allocator.free_pages() == free
    assert other.is_cross_attention_populated("cond", "text")
    with pytest.raises(CrossAttentionNotPopulatedError):
        state.get_cross_attention_kv("cond", "text")
    # A forward after the prompt switch sees no stale cross cache.
    state.commit_paged_context("cond")
    fwd = state.prepare_forward("cond", CHUNK)
    with pytest.raises(CrossAttentionNotPopulatedError):
        fwd.layers[0].cross_kv("text")


def _assert_still(state: KVState, seed: float) -> None:
    layers = state.get_cross_attention_kv("cond", "text")
    for i, entry in enumerate(layers):
        assert torch.all(entry["k"] == seed + 10 * i)
        assert torch.all(entry["v"] == -(seed + 10 * i))


def test_populate_atomic_when_the_generator_raises_part_way():
    cache = make_cache()
    state = cache.open_session("a")
    populate(state, "cond", seed=1.0)
    fwd = state.prepare_forward("cond", CHUNK)
    fwd.commit()

    def gen():
        yield cross_pairs(seed=2.0)[0]
        raise MemoryError("out of memory while projecting layer 1")

    with pytest.raises(MemoryError):
        state.populate_cross_attention("cond", "text", gen())
    assert state.is_cross_attention_populated("cond", "text")
    _assert_still(state, 1.0)
    fwd = state.prepare_forward("cond", CHUNK)
    assert torch.all(fwd.layers[0].cross_kv("text")[0] == 1.0)


def test_populate_atomic_on_wrong_shape_at_layer_1():
    cache = make_cache()
    state = cache.open_session("a")
    populate(state, "cond", seed=1.0)
    pairs = cross_pairs(seed=2.0)
    pairs[1] = (torch.zeros(3, 2, 5), torch.zeros(3, 2, 4))
    with pytest.raises(TensorMismatchError) as exc_info:
        state.populate_cross_attention("cond", "text", pairs)
    assert "layer 1" in str(exc_info.value)
    assert "(3, 2, 4)" in str(exc_info.value) and "(3, 2, 5)" in str(exc_info.value)
    _assert_still(state, 1.0)


@pytest.mark.parametrize("count", [0, 1, 3])
def test_populate_atomic_on_wrong_layer_count(count):
    cache = make_cache()
    state = cache.open_session("a")
    populate(state, "cond", seed=1.0)
    with pytest.raises(TensorMismatchError) as exc_info:
        state.populate_cross_attention("cond", "text", cross_pairs(seed=2.0, layers=count))
    assert "expected 2 layers" in str(exc_info.value)
    _assert_still(state, 1.0)


@pytest.mark.parametrize("count", [1, 3])
def test_populate_with_wrong_layer_count_leaves_unpopulated_cache_unpopulated(count):
    cache = make_cache()
    state = cache.open_session("a")
    with pytest.raises(TensorMismatchError):
        state.populate_cross_attention("cond", "text", cross_pairs(layers=count))
    assert not state.is_cross_attention_populated("cond", "text")


# ---------------------------------------------------------------------- stats and sizing


def test_stats():
    cache = make_cache()
    stats = cache.stats()
    assert stats == CacheStats(
        num_pages=16,
        pages_used=0,
        pages_free=16,
        peak_pages_used=0,
        bytes_per_page=BYTES_PER_PAGE,
        pool_bytes=16 * BYTES_PER_PAGE,
        bytes_used=0,
        cross_attention_bytes=0,
        sessions={},
    )
    a = cache.open_session("a")
    b = cache.open_session("b")
    commit_chunks(a)
    a.get_kv_caches("uncond", 2 * CHUNK)
    commit_chunks(b)
    populate(a, "cond", "text")  # 2 layers x 3 tokens x 2 heads x 4 dims x 4 bytes x (K, V) = 384
    populate(b, "uncond", "image")  # 2 layers x 2 tokens x 1 head x 8 dims x 4 bytes x (K, V) = 256
    stats = cache.stats()
    assert stats.pages_used == 8 and stats.pages_free == 8
    assert stats.peak_pages_used == 8 and stats.bytes_used == 8 * BYTES_PER_PAGE
    assert stats.sessions == {"a": {"cond": 2, "uncond": 4}, "b": {"cond": 2, "uncond": 0}}
    assert stats.cross_attention_bytes == 384 + 256
    assert cache._pool.nbytes == stats.pool_bytes


@pytest.mark.parametrize(
    "budget,pages", [(BYTES_PER_PAGE, 1), (1000, 3), (5 * BYTES_PER_PAGE, 5), (5 * BYTES_PER_PAGE + 255, 5)]
)
def test_budget_bytes_sizing(budget, pages):
    cache = KVCache(SPEC, budget_bytes=budget)
    assert cache._allocator.num_pages == pages
    assert cache._pool.num_pages == pages
    assert cache._pool.kv.shape == (2, 2, pages, 2, 2, 4)
    assert cache._pool.nbytes == pages * BYTES_PER_PAGE <= budget
    assert cache.dtype == torch.float32
    assert cache.device == torch.device("cpu")


def test_budget_bytes_depends_on_dtype():
    spec = dataclasses.replace(SPEC, dtype="bfloat16")
    assert KVCache(spec, budget_bytes=1000)._allocator.num_pages == 7  # 128-byte pages


@pytest.mark.parametrize("budget", [BYTES_PER_PAGE - 1, 0, -5, 1000.0, True])
def test_budget_bytes_errors(budget):
    with pytest.raises(SpecError) as exc_info:
        KVCache(SPEC, budget_bytes=budget)
    assert "budget_bytes" in str(exc_info.value)
    assert repr(budget) in str(exc_info.value) or str(budget) in str(exc_info.value)


def test_exactly_one_of_num_pages_and_budget_bytes():
    with pytest.raises(SpecError) as exc_info:
        KVCache(SPEC)
    assert "num_pages=None" in str(exc_info.value) and "budget_bytes=None" in str(exc_info.value)
    with pytest.raises(SpecError) as exc_info:
        KVCache(SPEC, num_pages=4, budget_bytes=4096)
    assert "num_pages=4" in str(exc_info.value) and "budget_bytes=4096" in str(exc_info.value)


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_bad_num_pages(bad):
    with pytest.raises(SpecError) as exc_info:
        KVCache(SPEC, num_pages=bad)
    assert "num_pages" in str(exc_info.value) and repr(bad) in str(exc_info.value)


# ---------------------------------------------------------------------- open_session


def test_open_session_duplicate_id():
    cache = make_cache()
    a = cache.open_session("a")
    commit_chunks(a)
    free = cache._allocator.free_pages()
    with pytest.raises(SpecError) as exc_info:
        cache.open_session("a")
    assert "'a'" in str(exc_info.value) and "already open" in str(exc_info.value)
    assert cache.sessions == {"a": a}
    assert cache._allocator.free_pages() == free
    assert a.history_chunks("cond") == ((0, 1),)
    a.close()
    b = cache.open_session("a")  # the id is free again after close
    assert b is not a and cache.sessions == {"a": b}


def test_open_session_automatic_ids_skip_taken_ones():
    cache = make_cache()
    taken = cache.open_session("session-1")
    first = cache.open_session()
    second = cache.open_session()
    assert first.session_id == "session-0"
    assert second.session_id == "session-2"
    assert cache.sessions == {"session-1": taken, "session-0": first, "session-2": second}


def test_populate_stores_data_not_an_autograd_graph():
    """Projections made with grad enabled must not keep their graph (and parameters' grads) alive in the cache."""
    cache = make_cache()
    state = cache.open_session("a")
    weight = torch.ones(3, 2, 4, requires_grad=True)
    state.populate_cross_attention("cond", "text", [(weight * 2, weight * 3)] * 2)
    entry = state.get_cross_attention_kv("cond", "text")[0]
    assert not entry["k"].requires_grad and entry["k"].grad_fn is None
    assert not entry["v"].requires_grad and entry["v"].grad_fn is None
    assert torch.all(entry["k"] == 2.0) and torch.all(entry["v"] == 3.0)
    fwd = state.prepare_forward("cond", CHUNK)
    assert not fwd.layers[0].cross_kv("text")[0].requires_grad
