"""Caches with retention groups (``KVCacheSpec(head_retention=...)``) against a cache-free recomputation with
per-head visibility, and their contracts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ardiff_modules as am
from ardiff_modules.lanes import lane_spec
from tests.heads.oracle import (
    PerHeadOracle,
    assert_lanes_hold_newest,
    grouped,
    lane_bytes_in_use,
    lane_committed,
    lane_kv,
    lane_names,
    lane_open,
    lane_pages_in_use,
    one_forward,
    random_qkv,
    session_budget,
)


def make_spec(layers: int = 3, kv_heads: int = 4, group: int = 1, chunk: int = 4, page: int = 2,
              branches: tuple[str, ...] = ("cond", "uncond")) -> am.KVCacheSpec:
    return am.KVCacheSpec(
        num_layers=layers, num_kv_heads=kv_heads, num_qo_heads=kv_heads * group, head_dim=8, chunk_size=chunk,
        page_size=page, branches=branches, dtype="float32",
    )


def grouped_cache(spec: am.KVCacheSpec, heads: am.HeadRetention, sessions: int = 1, **kwargs: object) -> am.KVCache:
    """A reference-backend cache of ``spec`` with ``heads`` as its groups, room for ``sessions`` at their peak."""
    spec = grouped(spec, heads)
    kwargs.setdefault("backend", "reference")
    return am.KVCache(spec, budget_bytes=session_budget(spec, sessions), **kwargs)  # type: ignore[arg-type]


@st.composite
def head_configs(draw: st.DrawFn) -> tuple[am.KVCacheSpec, am.HeadRetention]:
    layers = draw(st.integers(1, 3))
    kv_heads = draw(st.integers(1, 4))
    group = draw(st.sampled_from([1, 2]))
    chunk, page = draw(st.sampled_from([(4, 2), (4, 4), (6, 3), (3, 1), (6, 1)]))
    names = ["a", "b", "c"][: draw(st.integers(1, 3))]
    # frames of whole pages per chunk: a group may count its sink and window in frames (trimmed chunks)
    frames = draw(st.sampled_from([f for f in range(1, chunk + 1) if chunk % f == 0 and (chunk // f) % page == 0]))
    groups: dict[str, object] = {
        n: (draw(st.integers(0, 2)), draw(st.integers(0, 3))) if draw(st.booleans())
        else am.FrameWindowPolicy(draw(st.integers(0, 4)), draw(st.integers(0, 5)), frames)
        for n in names
    }
    rows = [[draw(st.sampled_from(names)) for _ in range(kv_heads)] for _ in range(layers)]
    branches = ("cond", "uncond")[: draw(st.integers(1, 2))]
    return make_spec(layers, kv_heads, group, chunk, page, branches), am.HeadRetention(groups, rows)


def resident_pages(policy: object, committed: int, spec: am.KVCacheSpec) -> int:
    """Pages one stream holds under ``policy`` after ``committed`` whole chunks (a frame policy: its kept frames')."""
    indices = policy.history_indices(committed)  # type: ignore[attr-defined]
    if not isinstance(policy, am.FrameWindowPolicy):
        return len(indices) * spec.pages_per_chunk
    frame_pages = spec.pages_per_chunk // policy.frames_per_chunk
    return sum(len(policy.kept_frames(i, committed)) for i in indices) * frame_pages


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=head_configs(), schedule=st.lists(st.integers(0, 2), min_size=1, max_size=7), seed=st.integers(0, 99))
def test_every_forward_equals_the_per_head_recomputation(config, schedule, seed) -> None:
    """Random head assignments, retentions (window 0 included), GQA, page sizes, 1-2 branches; each chunk
    takes 0-2 denoising forwards then a commit: every head sees exactly its group's chunks."""
    spec, heads = config
    gen = torch.Generator().manual_seed(seed)
    with grouped_cache(spec, heads) as cache:
        session = cache.open_session("s")
        oracle = PerHeadOracle(heads)
        for denoise in schedule:
            for step in range(denoise + 1):
                got, want = one_forward(session, oracle, spec.branches, spec.chunk_size, step == denoise, gen, spec)
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # Memory is per lane: each holds exactly its group's resident chunks, only for its heads and layers.
        for lane, used in zip(cache._lanes, lane_pages_in_use(session).values()):
            assert used == len(spec.branches) * resident_pages(lane.part.policy, len(schedule), spec), lane.name
        session.close()
        assert cache.stats().bytes_used == 0


def test_one_policy_split_across_lanes_equals_a_plain_cache() -> None:
    """Two groups with the same retention, heads scattered: outputs equal one KVCache over all heads (the
    split, the per-lane writes and the merge back into head order lose nothing)."""
    spec = make_spec(layers=2, kv_heads=4, group=2)
    heads = am.HeadRetention({"x": (1, 2), "y": (1, 2)}, [["y", "x", "y", "y"], ["x", "y", "x", "x"]])
    plain = am.KVCache(dataclasses.replace(spec, sink_chunks=1, window_chunks=2), num_pages=64, backend="reference")
    cache = grouped_cache(spec, heads)
    a, b = plain.open_session("p"), cache.open_session("g")
    gen = torch.Generator().manual_seed(0)
    for chunk in range(6):
        for commit in (False, True):
            qkv = [random_qkv(2, 4, 8, 4, 8, gen, torch.float32) for _ in range(2)]
            with a.prepare_forward(None, 4, commit_current=commit) as fa, b.prepare_forward(None, 4, commit_current=commit) as fb:
                for layer in range(2):
                    q, k, v = qkv[layer]
                    out_a, lse_a = am.chunk_attention(q, k, v, fa.layers[layer], return_lse=True)
                    out_b, lse_b = am.chunk_attention(q, k, v, fb.layers[layer], return_lse=True)
                    torch.testing.assert_close(out_b, out_a, atol=1e-6, rtol=1e-6)
                    torch.testing.assert_close(lse_b, lse_a, atol=1e-6, rtol=1e-6)


def test_short_groups_free_their_pages_and_admission_counts_each_lane() -> None:
    spec = make_spec(layers=2, kv_heads=4)
    heads = am.HeadRetention.from_local_heads(2, 4, {0: [1, 2, 3], "1": [0]}, local=(0, 1), other=(1, 4))
    cache = grouped_cache(spec, heads, sessions=2)
    assert lane_names(cache) == ("local/1h", "local/3h", "other/1h", "other/3h")
    assert tuple(cache.stats().lanes) == lane_names(cache)
    assert cache.sessions_that_fit(recache=False) == 2
    s = cache.open_session()
    oracle = PerHeadOracle(heads)
    gen = torch.Generator().manual_seed(1)
    for _ in range(8):
        one_forward(s, oracle, spec.branches, 4, True, gen, spec)
    # local: 1 chunk per branch; other: sink + 4 window chunks = 5, 2 pages per chunk, 2 branches.
    assert lane_pages_in_use(s) == {"local/1h": 4, "local/3h": 4, "other/1h": 20, "other/3h": 20}
    assert s.pages_in_use() == sum(lane_pages_in_use(s).values())
    # branches x layers x chunks x pages x page x heads x d x K,V x fp32 / 2
    uniform_bytes = 2 * 2 * (5 + 0) * 2 * 4 * 4 * 8 * 4
    stats = cache.stats()
    assert lane_bytes_in_use(s) == sum(
        n * lane.pool.bytes_per_page for n, lane in zip(lane_pages_in_use(s).values(), cache._lanes)
    ) == stats.bytes_used
    assert {name: row.pages_used for name, row in stats.lanes.items()} == lane_pages_in_use(s)
    assert lane_bytes_in_use(s) < 0.75 * uniform_bytes
    assert cache.sessions_that_fit(recache=False) == 1
    cache.admit_session("b", recache=False)
    with pytest.raises(am.CapacityError, match=r"lane '[a-z]+/\dh': admit_session: a session needs"):
        cache.admit_session("c", recache=False)
    assert set(cache.sessions) == {s.session_id, "b"}


def test_a_forward_commits_in_every_lane_or_in_none() -> None:
    """A layer left out of a committing forward: the lanes holding it refuse, and no lane commits."""
    spec = make_spec(layers=3, kv_heads=2)
    heads = am.HeadRetention({"l": (0, 1), "g": (1, 2)}, [["l", "g"], ["l", "l"], ["g", "g"]])
    cache = grouped_cache(spec, heads)
    s = cache.open_session()
    oracle = PerHeadOracle(heads)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        one_forward(s, oracle, spec.branches, 4, True, gen, spec)
    before = (lane_pages_in_use(s), lane_committed(s, "cond"))
    with pytest.raises(am.errors.IncompleteForwardError):
        with s.prepare_forward(None, 4, commit_current=True) as fwd:
            for layer in fwd.layers[:2]:  # layer 2 ("g" only) never runs
                am.chunk_attention(*random_qkv(2, 4, 2, 2, 8, gen, torch.float32), layer)
    assert (lane_pages_in_use(s), lane_committed(s, "cond")) == before
    assert fwd.status == "aborted"
    # History is intact: the next forwards still equal the oracle.
    for commit in (False, True):
        got, want = one_forward(s, oracle, spec.branches, 4, commit, gen, spec)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_lane_out_of_pages_leaves_no_lane_with_an_open_forward() -> None:
    spec = make_spec(layers=1, kv_heads=2, branches=("main",))
    heads = am.HeadRetention({"l": (0, 1), "g": (1, 2)}, [["l", "g"]])
    cache = grouped_cache(spec, heads)
    s = cache.open_session()
    last = cache._lanes[-1].allocator
    hog = last.allocate(last.num_free - 1)  # the last lane is full
    free = [lane.allocator.free_pages() for lane in cache._lanes]
    with pytest.raises(am.CapacityError):
        s.prepare_forward(None, 4, commit_current=True)
    assert lane_open(s, "main") == [False, False]
    assert lane_pages_in_use(s) == {"l/1h": 0, "g/1h": 0}
    assert [lane.allocator.free_pages() for lane in cache._lanes] == free
    last.decref(hog)
    oracle = PerHeadOracle(heads)
    got, want = one_forward(s, oracle, ("main",), 4, True, torch.Generator().manual_seed(3), spec)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_one_commit_writes_every_lanes_pool_and_an_abort_restores_every_lane_exactly() -> None:
    """The lanes are one transaction: a committed forward's K/V are in every lane's pool (each lane its heads of
    its layers, in the pages its history now lists), and an aborted one leaves every lane's free pages, history
    and pool contents as they were (the free queue's order too while the forward's reservation is undoable: a
    failed prepare, ``tests/heads/test_head_failures.py``; once it ran, its pending pages go back to the queue's
    end, as for a uniform cache)."""
    spec = make_spec(layers=2, kv_heads=3, group=2)
    heads = am.HeadRetention({"l": (0, 1), "g": (1, 2)}, [["l", "g", "l"], ["g", "g", "l"]])
    cache = grouped_cache(spec, heads)
    s = cache.open_session()
    gen = torch.Generator().manual_seed(10)

    def state() -> list[object]:
        out: list[object] = [sorted(lane.allocator.free_pages()) for lane in cache._lanes]
        for i, branches in enumerate(s._lane_branches):
            for b, pages in sorted(branches.items()):
                out.append((i, b, pages.history, pages.pending, pages.committed_chunks, pages.token_offset))
                for layer in range(cache._lanes[i].spec.num_layers):
                    out.extend(t.clone() for t in lane_kv(cache, pages.history_pages(), i, layer))
        return out

    def same(a: list[object], b: list[object]) -> bool:
        return len(a) == len(b) and all(
            torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b)
        )

    for chunk in range(4):
        written = []
        with s.prepare_forward(None, 4, commit_current=True) as fwd:
            for layer in fwd.layers:
                qkv = random_qkv(2, 4, 6, 3, 8, gen, torch.float32)
                am.chunk_attention(*qkv, layer)
                written.append(qkv[1:])
        assert fwd.status == "committed" and lane_committed(s, "cond") == [chunk + 1] * len(cache._lanes)
        assert_lanes_hold_newest(cache, s, spec.branches, written)  # this forward's chunk, in each lane's pages
        before = state()
        for how in ("abort", "raise"):
            fwd = s.prepare_forward(None, 4, commit_current=True)
            for layer in fwd.layers:
                am.chunk_attention(*random_qkv(2, 4, 6, 3, 8, gen, torch.float32), layer)
            if how == "abort":
                fwd.abort()
            else:
                with pytest.raises(RuntimeError, match="interrupted"), fwd:
                    raise RuntimeError("interrupted")
            assert fwd.status == "aborted"
            assert same(state(), before), how


def test_fork_shares_every_lane_and_reset_and_close_release_them() -> None:
    spec = make_spec(layers=2, kv_heads=2)
    heads = am.HeadRetention({"l": (0, 1), "g": (1, 2)}, [["l", "g"], ["g", "l"]])
    cache = grouped_cache(spec, heads, sessions=3)
    s = cache.open_session("a")
    oracle = PerHeadOracle(heads)
    gen = torch.Generator().manual_seed(4)
    for _ in range(4):
        one_forward(s, oracle, spec.branches, 4, True, gen, spec)
    used = [lane.allocator.num_used for lane in cache._lanes]
    child = s.fork("b")
    assert [lane.allocator.num_used for lane in cache._lanes] == used  # shared by refcount: no page copied
    forked = PerHeadOracle(heads, committed={b: [list(layer) for layer in oracle.committed[b]] for b in spec.branches})
    got, want = one_forward(child, forked, spec.branches, 4, True, gen, spec)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    child.reset()
    assert child.token_offset("cond") == 0 and child.pages_in_use() == 0
    assert all(n == 0 for n in lane_pages_in_use(child).values())
    s.close()
    child.close()
    assert all(lane.allocator.num_used == 0 for lane in cache._lanes)
    assert cache.sessions == {}


def test_share_sinks_from_shares_each_lanes_own_sinks_on_one_stream_clock() -> None:
    """Groups with 0, 1 and 2 sink chunks: the new session continues after the stream's 2 sinks in every lane (the
    clock is the same in each), each lane adopts its own group's sinks (no page copied) and an empty window, and
    every later forward equals the per-head recomputation."""
    spec = make_spec(layers=2, kv_heads=3, group=2)
    heads = am.HeadRetention({"l": (0, 1), "s1": (1, 2), "s2": (2, 1)}, [["l", "s1", "s2"], ["s2", "l", "s1"]])
    cache = grouped_cache(spec, heads, sessions=2)
    source = cache.open_session("source")
    oracle = PerHeadOracle(heads)
    gen = torch.Generator().manual_seed(11)
    for _ in range(4):
        one_forward(source, oracle, spec.branches, 4, True, gen, spec)
    used = [lane.allocator.num_used for lane in cache._lanes]
    target = cache.open_session("target")
    for b in spec.branches:
        target.share_sinks_from(source, b)
    assert [lane.allocator.num_used for lane in cache._lanes] == used  # shared by refcount
    for b in spec.branches:
        assert lane_committed(target, b) == [2, 2, 2]
        assert {pages.token_offset for pages in target._lane_pages(b)} == {2 * spec.chunk_size}
        for lane, pages, mine in zip(cache._lanes, source._lane_pages(b), target._lane_pages(b)):
            sinks = lane.spec.policy.sink_chunks
            assert mine.history == pages.history[:sinks] and mine.history_index == tuple(range(sinks)), lane.name
    shared = PerHeadOracle(heads)
    for b in spec.branches:
        shared.share_sinks_from(oracle, b)
    for commit in (False, True, False, True, True, True):
        got, want = one_forward(target, shared, spec.branches, 4, commit, gen, spec)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The source is unchanged by the sharing: it still equals its own recomputation.
    got, want = one_forward(source, oracle, spec.branches, 4, True, gen, spec)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # A source short of the stream's sinks is refused before anything changes.
    young = cache.open_session("young")
    one_forward(young, PerHeadOracle(heads), ("cond",), 4, True, gen, spec)
    late = cache.open_session("late")
    with pytest.raises(am.SpecError, match=r"to hold its 2 sink chunk\(s\), got 1 committed"):
        late.share_sinks_from(young, "cond")
    assert lane_committed(late, "cond") == [0, 0, 0] and late.pages_in_use() == 0


def test_gradients_through_the_lanes_equal_the_per_head_oracles_autograd() -> None:
    """``chunk_attention`` with gradients over a layer whose heads several lanes hold: the outputs and the
    gradients to q, k, v equal autograd through the per-head recomputation, while windows fill and evict (each
    lane's history is its own: a constant, as for a uniform cache)."""
    spec = make_spec(layers=2, kv_heads=2, group=2)
    heads = am.HeadRetention({"l": (0, 1), "g": (1, 2)}, [["l", "g"], ["g", "l"]])
    cache = grouped_cache(spec, heads)
    s = cache.open_session()
    oracle = PerHeadOracle(heads)
    gen = torch.Generator().manual_seed(12)
    for chunk in range(5):
        for commit in (False, True):
            written = []
            with s.prepare_forward(None, 4, commit_current=commit) as fwd:
                for layer, ctx in enumerate(fwd.layers):
                    q, k, v = (t.requires_grad_() for t in random_qkv(2, 4, 4, 2, 8, gen, torch.float32))
                    weight = torch.randn(2, 4, 4, 8, generator=gen)
                    got = am.chunk_attention(q, k, v, ctx)
                    got_grads = torch.autograd.grad((got * weight).sum(), (q, k, v))
                    want = torch.stack([oracle.attend(b, layer, q[i], k[i], v[i]) for i, b in enumerate(spec.branches)])
                    want_grads = torch.autograd.grad((want * weight).sum(), (q, k, v))
                    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
                    for name, g, w in zip("qkv", got_grads, want_grads):
                        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"d{n}: {m}")
                    written.append((k.detach(), v.detach()))
            if commit:
                for i, b in enumerate(spec.branches):
                    oracle.commit(b, [(k[i], v[i]) for k, v in written])


def test_cross_attention_lives_on_the_session() -> None:
    spec = dataclasses.replace(make_spec(layers=2, kv_heads=2), cross_attention=(am.CrossAttentionSpec("text", 3),))
    heads = am.HeadRetention({"l": (0, 1), "g": (1, 2)}, [["l", "g"], ["g", "l"]])
    cache = grouped_cache(spec, heads)
    s = cache.open_session()
    layer_kv = [(torch.randn(3, 2, 8), torch.randn(3, 2, 8)) for _ in range(2)]
    s.populate_cross_attention("cond", "text", layer_kv)
    with pytest.raises(am.errors.CrossAttentionNotPopulatedError):
        with s.prepare_forward(None, 4) as fwd:
            fwd.layers[0].cross_kv("text")  # uncond not populated
    s.populate_cross_attention("uncond", "text", layer_kv)
    with s.prepare_forward(None, 4) as fwd:
        k, v = fwd.layers[1].cross_kv("text")
        assert k.shape == (2, 3, 2, 8)
        torch.testing.assert_close(k[0], layer_kv[1][0])
    s.clear_cross_attention()
    assert not s.is_cross_attention_populated("cond", "text")


def test_a_budget_that_leaves_a_lane_without_a_page_is_refused_as_a_uniform_cache_refuses_it() -> None:
    """``budget_bytes=10`` used to build 1-page lanes (more than the budget) instead of refusing."""
    spec = make_spec(layers=2, kv_heads=2)
    heads = am.HeadRetention({"l": (0, 1), "g": (1, 2)}, [["l", "g"], ["g", "l"]])
    # Each lane: 2 layers x 1 head, a page 2 layers x (K, V) x 2 tokens x 8 dims x 4 bytes = 256 bytes. One
    # session's peak, 2 branches x (history + 1 pending) chunks x 2 pages: l 8 pages (2048 bytes), g 16 (4096).
    # l's share, budget x 2048 / 6144, holds a page from 768 bytes on.
    for budget, empty in ((10, r"l/1h \(256 bytes a page\), g/1h \(256 bytes a page\)"),
                          (767, r"l/1h \(256 bytes a page\)")):
        with pytest.raises(am.SpecError, match=rf"budget_bytes: expected at least 768 bytes \(one page in every "
                                               rf"lane.*got {budget}: no page for {empty}$"):
            am.KVCache(grouped(spec, heads), budget_bytes=budget, backend="reference")
    with pytest.raises(am.SpecError, match="expected at least one page"):
        am.KVCache(lane_spec(spec, heads.parts()[0]), budget_bytes=10)
    cache = am.KVCache(grouped(spec, heads), budget_bytes=768, backend="reference")
    assert [lane.pool.num_pages for lane in cache._lanes] == [1, 2]
    cache.close()
    # num_pages: the budget of a uniform pool of that many pages of the whole geometry (512 bytes a page).
    cache = am.KVCache(grouped(spec, heads), num_pages=3, backend="reference")
    assert [lane.pool.num_pages for lane in cache._lanes] == [2, 4]
    cache.close()


def test_misuse_is_refused_with_the_expected_error() -> None:
    spec = make_spec(layers=2, kv_heads=2)
    heads = am.HeadRetention({"l": (0, 1), "g": (1, 2)}, [["l", "g"], ["g", "l"]])
    with pytest.raises(am.SpecError, match="expected sink_chunks/window_chunks/retention left"):
        dataclasses.replace(spec, window_chunks=3, head_retention=heads)
    with pytest.raises(am.SpecError, match="2 layers x 2 kv heads"):
        grouped(spec, am.HeadRetention.uniform(3, 2, (1, 2)))
    with pytest.raises(am.SpecError, match="bounded window"):
        am.KVCache(grouped(spec, am.HeadRetention({"u": (1, None), "g": (1, 2)}, [["u", "g"], ["g", "u"]])),
                   num_pages=64)
    # One group over every head is the uniform cache: an unbounded window needs no split.
    am.KVCache(grouped(spec, am.HeadRetention.uniform(2, 2, (1, None))), num_pages=64).close()
    with pytest.raises(am.SpecError, match="exactly one of num_pages / budget_bytes"):
        am.KVCache(grouped(spec, heads))
    cache = am.KVCache(grouped(spec, heads), budget_bytes=1 << 20, backend="reference")
    s = cache.open_session()
    with pytest.raises(am.errors.UnknownBranchError):
        s.prepare_forward(("nope",), 4)
    with pytest.raises(am.errors.SequenceLengthError):
        s.prepare_forward(None, 5)
    q, k, v = random_qkv(2, 4, 2, 2, 8, torch.Generator().manual_seed(0), torch.float32)
    with s.prepare_forward(None, 4) as fwd:
        with pytest.raises(am.TensorMismatchError):
            am.chunk_attention(q[:, :, :1], k, v, fwd.layers[0])
    with pytest.raises(am.errors.ForwardFinishedError):
        am.chunk_attention(q, k, v, fwd.layers[0])
    s.close()
    with pytest.raises(am.errors.SessionClosedError):
        s.prepare_forward(None, 4)
