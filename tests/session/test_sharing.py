"""Fork, shared sinks / cross caches, admission and stats, the forward-context registry (serving-grade KV)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

import ardiff_modules as am
from ardiff_modules import CapacityError, KVCache, KVCacheSpec, KVState, chunk_attention
from tests.support.failures import Boom, FlakyPlanBackend
from tests.support.kv_writes import write_every_layer
from tests.support.pool_model import same_bits, token_kv
from tests.support.streaming_model import LibraryStreaming, NaiveStreaming, TinyStreamingModel

CHUNK = 4
#: chunk_size and head_dim of the one-layer, one-head specs of the last tests (found by the session machine)
TINY_CHUNK = TINY_HEAD_DIM = 2


def _sharing_spec(extents_window: int = 2, branches=("cond", "uncond")) -> am.KVCacheSpec:  # noqa: ANN001
    return am.KVCacheSpec(
        num_layers=2, num_kv_heads=2, head_dim=4, chunk_size=CHUNK, page_size=2, sink_chunks=1,
        window_chunks=extents_window, branches=branches, cross_attention=(am.CrossAttentionSpec("text", 3),),
        dtype="float32",
    )


def _commit_forward(state: am.KVState, x: torch.Tensor | None = None) -> None:
    x = torch.randn(len(state.kv_branch_names), CHUNK, 2, 4) if x is None else x
    with state.prepare_forward(None, CHUNK, commit_current=True) as fwd:
        for layer in fwd.layers:
            am.chunk_attention(x, x, x, layer)


@pytest.mark.parametrize("extents", [False, True])
def test_fork_shares_pages_by_refcount_and_copies_nothing(extents: bool) -> None:
    cache = am.KVCache(_sharing_spec(), num_pages=64, backend="reference", contiguous_extents=extents)
    parent = cache.open_session("parent")
    for _ in range(3):
        _commit_forward(parent)
    used_before = cache._allocator.num_used
    kv_before = cache._pool.kv.clone()
    child = parent.fork("child")
    assert cache._allocator.num_used == used_before  # zero pages allocated
    assert torch.equal(cache._pool.kv, kv_before)  # zero bytes written
    for branch in ("cond", "uncond"):
        assert child.history_chunks(branch) == parent.history_chunks(branch)
        assert child.token_offset(branch) == parent.token_offset(branch)
        for chunk in child.history_chunks(branch):
            for page in chunk:
                assert cache._allocator.refcount(page) >= 2


@pytest.mark.parametrize("extents", [False, True])
def test_forks_diverge_and_closing_one_never_changes_the_other(extents: bool) -> None:
    """A fork reproduces the oracle of the parent's history; closing the parent does not affect it."""
    torch.manual_seed(0)
    model = TinyStreamingModel().eval()
    spec = model.spec(CHUNK, 2, 1, 2)
    lib = LibraryStreaming(model, spec, 200)
    lib.cache = am.KVCache(spec, num_pages=200, backend="reference", contiguous_extents=extents)
    lib.state = lib.cache.open_session("s0")
    naive = NaiveStreaming(model, CHUNK, 1, 2)
    g = torch.Generator().manual_seed(3)
    prompt = {b: torch.randn(5, model.context_dim, generator=g) for b in spec.branches}
    for runner in (lib, naive):
        runner.set_prompt(prompt)
    xs = [torch.randn(2, CHUNK, model.dim, generator=g) for _ in range(8)]
    with torch.no_grad():
        for x in xs[:4]:
            lib.forward(spec.branches, x, True)
            naive.forward(spec.branches, x, True)
        child_state = lib.state.fork("child")
        # Diverge: the parent sees xs[4], the child xs[5]; then the parent is closed.
        lib.forward(spec.branches, xs[4], True)
        child = LibraryStreaming.__new__(LibraryStreaming)
        child.model, child.fn, child.cache, child.state = model, model, lib.cache, child_state
        lib.state.close()
        naive_child = copy.copy(naive)
        naive_child.committed = {b: list(v) for b, v in naive.committed.items()}
        for x in xs[5:]:
            torch.testing.assert_close(child.forward(spec.branches, x, True), naive_child.forward(spec.branches, x, True),
                                       atol=2e-5, rtol=2e-5)
    child_state.close()
    assert lib.cache._allocator.num_free == 200


def test_share_sinks_and_cross_attention_between_sessions() -> None:
    cache = am.KVCache(_sharing_spec(), num_pages=64, backend="reference")
    a = cache.open_session("a")
    k = torch.randn(3, 2, 4)
    for branch in ("cond", "uncond"):
        a.populate_cross_attention(branch, "text", [(k, k), (k, k)])
    _commit_forward(a)
    _commit_forward(a)
    b = cache.open_session("b")
    b.share_sinks_from(a, "cond")
    b.share_cross_attention_from(a, "text")
    assert b.history_chunks("cond") == a.history_chunks("cond")[:1]
    assert b.token_offset("cond") == CHUNK and b.history_chunks("uncond") == ()
    assert b.get_cross_attention_kv("cond", "text")[0]["k"].data_ptr() == a.get_cross_attention_kv("cond", "text")[0]["k"].data_ptr()
    with pytest.raises(am.SpecError, match="expected branch 'cond' to be empty"):
        b.share_sinks_from(a, "cond")
    a.close()
    assert b.history_chunks("cond")[0] == (0, 1) and cache._allocator.refcount(0) == 1
    b.close()
    assert cache._allocator.num_free == 64


def test_admission_and_stats() -> None:
    spec = _sharing_spec()
    per_session = 2 * (1 + 2 + 1) * 2  # branches x (sink + window + pending) x pages per chunk
    reserve = 2 * (1 + 2 - 1) * 2  # once for the pool: one session's re-cache beyond its peak
    cache = am.KVCache(spec, num_pages=3 * per_session + reserve + 5, backend="reference")
    assert cache.pages_per_session() == per_session and cache.recache_reserve() == reserve
    assert cache.sessions_that_fit() == 3 and cache.can_admit(3) and not cache.can_admit(4)
    assert cache.sessions_that_fit(recache=False) == 3  # 5 + 8 spare pages: not a 4th session either way
    sessions = [cache.admit_session() for _ in range(3)]
    free_before = cache._allocator.free_pages()
    with pytest.raises(am.CapacityError, match=f"needs up to {per_session} pages"):
        cache.admit_session("too-many")
    assert cache._allocator.free_pages() == free_before and "too-many" not in cache.sessions
    _commit_forward(sessions[0])  # using admitted capacity does not change what else fits
    assert cache.sessions_that_fit() == 0
    stats = cache.stats()
    assert stats.pages_used == 2 * 2 and stats.sessions[sessions[0].session_id] == {"cond": 2, "uncond": 2}
    assert stats.bytes_used == stats.pages_used * stats.bytes_per_page
    assert stats.peak_pages_used == 4
    for s in sessions:
        s.close()
    assert cache.sessions_that_fit() == 3
    unbounded = am.KVCache(am.KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, chunk_size=4, page_size=4,
                                          dtype="float32"), num_pages=4, backend="reference")
    with pytest.raises(am.SpecError, match="bounded window"):
        unbounded.can_admit()


@pytest.mark.parametrize("extents", [False, True])
def test_sessions_batched_in_one_forward_equal_each_session_alone(extents: bool) -> None:
    """Several sessions (own branches, window positions, offsets) as rows of one plan == each run alone."""
    torch.manual_seed(0)
    model = TinyStreamingModel().eval()
    spec = model.spec(CHUNK, 2, 1, 2)
    g = torch.Generator().manual_seed(5)
    prompts = [{b: torch.randn(5, model.context_dim, generator=g) for b in spec.branches} for _ in range(3)]
    batched = am.KVCache(spec, num_pages=400, backend="reference", contiguous_extents=extents)
    alone = am.KVCache(spec, num_pages=400, backend="reference", contiguous_extents=extents)
    caches = {"batched": batched, "alone": alone}
    states = {name: [c.open_session(f"s{i}") for i in range(3)] for name, c in caches.items()}
    for name in caches:
        for state, prompt in zip(states[name], prompts):
            for branch, text in prompt.items():
                am.populate_cross_attention(state, branch, [b.cross for b in model.blocks], text)
    with torch.no_grad():
        for step in range(7):
            # Sessions start at different times: different window fill levels and absolute offsets.
            active = [i for i in range(3) if step >= i]
            x = torch.randn(2 * len(active), CHUNK, model.dim, generator=g)
            streams = [(states["batched"][i], b) for i in active for b in spec.branches]
            with batched.prepare_forward(streams, CHUNK, commit_current=step % 2 == 0) as fwd:
                out = model(x, fwd.layers)
            for row, i in enumerate(active):
                state = states["alone"][i]
                with state.prepare_forward(spec.branches, CHUNK, commit_current=step % 2 == 0) as fwd:
                    expected = model(x[2 * row : 2 * row + 2], fwd.layers)
                torch.testing.assert_close(out[2 * row : 2 * row + 2], expected, atol=2e-5, rtol=2e-5)
    for name in caches:
        assert [s.token_offset("cond") for s in states[name]] == [4 * CHUNK, 3 * CHUNK, 3 * CHUNK]


def test_forward_contexts_are_bounded_lru_and_pending_ones_survive() -> None:
    spec = am.KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, chunk_size=4, page_size=4, sink_chunks=0,
                          window_chunks=1, dtype="float32")
    cache = am.KVCache(spec, num_pages=64, max_forward_contexts=2)
    states = [cache.open_session(f"s{i}") for i in range(4)]
    x = torch.randn(1, 4, 1, 4)
    held = states[0].prepare_forward(None, 4, commit_current=True)  # pending: must survive eviction
    for state in states[1:]:
        with state.prepare_forward(None, 4, commit_current=True) as fwd:
            am.chunk_attention(x, x, x, fwd.layers[0])
    assert cache._forwards.num_contexts <= 3 and held in cache._forwards.contexts()
    am.chunk_attention(x, x, x, held.layers[0])  # still planned and registered
    held.commit()
    batched = cache.prepare_forward([(s, "main") for s in states], 4)
    assert cache._forwards.num_contexts <= 2
    am.chunk_attention(x.repeat(4, 1, 1, 1), x.repeat(4, 1, 1, 1), x.repeat(4, 1, 1, 1), batched.layers[0])
    with pytest.raises(am.SpecError, match="max_forward_contexts"):
        am.KVCache(spec, num_pages=4, max_forward_contexts=0)


def test_admission_keeps_its_promise_with_forks() -> None:
    """``sessions_that_fit``: admitted sessions *and the open ones* can all run to their peak.

    (Refusing the admission would also be correct; accepting it and then running out is not.)
    """
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, chunk_size=TINY_CHUNK, page_size=TINY_CHUNK,
                       sink_chunks=0, window_chunks=2, branches=("main",), dtype="float32")
    cache = KVCache(spec, num_pages=8, backend="reference", contiguous_extents=False)

    def commit_one(state: KVState) -> None:
        write_every_layer(state.prepare_forward(("main",), TINY_CHUNK, True).layers)
        state.commit_paged_context("main")

    parent = cache.open_session("parent")
    commit_one(parent)
    commit_one(parent)  # window full: 2 pages
    child = parent.fork("child")  # shares both pages
    try:
        admitted = [cache.admit_session("admitted")]  # the cache says one more session fits at its peak
    except CapacityError:
        admitted = []
    for state in [child, *admitted]:  # each runs to its peak: 2 committed + 1 pending, all pages its own
        commit_one(state)
        commit_one(state)
        state.prepare_forward(("main",), TINY_CHUNK, False)
    # The parent is still within its own peak (2 committed + 1 pending): this must not run out of pages.
    parent.prepare_forward(("main",), TINY_CHUNK, False)


def test_failed_plan_keeps_the_context_registry() -> None:
    """Rule 6: a ``prepare_forward`` whose ``plan()`` raises leaves ``forward_contexts()`` as it was,
    LRU order included (the order decides which context the next new batch releases)."""
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, chunk_size=TINY_CHUNK, page_size=TINY_CHUNK,
                       sink_chunks=0, window_chunks=2, branches=("a", "b"), dtype="float32")
    backend = FlakyPlanBackend()
    cache = KVCache(spec, num_pages=8, backend=backend, contiguous_extents=False, max_forward_contexts=2)
    state = cache.open_session()
    state.prepare_forward(("a",), TINY_CHUNK, False).commit()
    state.prepare_forward(("b",), TINY_CHUNK, False).commit()
    before = cache._forwards.contexts()
    backend.fail = Boom
    with pytest.raises(Boom):
        state.prepare_forward(("a",), TINY_CHUNK, False)
    backend.fail = None
    after = cache._forwards.contexts()
    assert [c.streams for c in after] == [c.streams for c in before], "a failed prepare_forward reordered the LRU"
    assert all(x is y for x, y in zip(after, before))


def test_fork_keeps_its_pages_when_the_parent_reuses_its_extent() -> None:
    """A fork still sees a chunk its parent evicted from a contiguous extent: the parent's next chunks
    must not take (and overwrite) that slot; the fork's pages keep exactly what was committed."""
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=TINY_HEAD_DIM, chunk_size=TINY_CHUNK,
                       page_size=TINY_CHUNK, sink_chunks=1, window_chunks=1, branches=("main",), dtype="float32")
    cache = KVCache(spec, num_pages=12, backend="reference", contiguous_extents=True)
    parent = cache.open_session()
    first_id = itertools.count(1, 2 * TINY_CHUNK)

    def step(state: KVState) -> None:
        with state.prepare_forward(("main",), TINY_CHUNK, True) as fwd:
            k, v = token_kv(next(first_id), 1, TINY_CHUNK, 0, TINY_HEAD_DIM)
            chunk_attention(torch.zeros(1, TINY_CHUNK, 1, TINY_HEAD_DIM), k, v, fwd.layers[0])

    step(parent)
    step(parent)  # sink + window full, 2 of the 3 extent slots used
    child = parent.fork()
    seen = {c: cache._pool.kv[:, :, list(c)].clone() for c in child.history_chunks("main")}
    for _ in range(4):  # evicts the shared window chunk; the parent must not reuse its slot while the child sees it
        step(parent)
        for c, data in seen.items():
            assert same_bits(cache._pool.kv[:, :, list(c)], data), f"the child's chunk {c} was overwritten"
    assert list(child.history_chunks("main")) == list(seen)
