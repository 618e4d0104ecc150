"""Head-grouped caches against a cache-free recomputation with per-head visibility, and their contracts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ardiff_modules as am
from ardiff_modules.head_cache import part_spec
from tests.heads.oracle import PerHeadOracle, one_forward, random_qkv


def make_spec(layers: int = 3, kv_heads: int = 4, group: int = 1, chunk: int = 4, page: int = 2,
              branches: tuple[str, ...] = ("cond", "uncond")) -> am.KVCacheSpec:
    return am.KVCacheSpec(
        num_layers=layers, num_kv_heads=kv_heads, num_qo_heads=kv_heads * group, head_dim=8, chunk_size=chunk,
        page_size=page, branches=branches, dtype="float32",
    )


@st.composite
def head_configs(draw: st.DrawFn) -> tuple[am.KVCacheSpec, am.HeadRetention]:
    layers = draw(st.integers(1, 3))
    kv_heads = draw(st.integers(1, 4))
    group = draw(st.sampled_from([1, 2]))
    chunk, page = draw(st.sampled_from([(4, 2), (4, 4), (6, 3), (3, 1)]))
    names = ["a", "b", "c"][: draw(st.integers(1, 3))]
    groups = {n: (draw(st.integers(0, 2)), draw(st.integers(0, 3))) for n in names}
    rows = [[draw(st.sampled_from(names)) for _ in range(kv_heads)] for _ in range(layers)]
    branches = ("cond", "uncond")[: draw(st.integers(1, 2))]
    return make_spec(layers, kv_heads, group, chunk, page, branches), am.HeadRetention(groups, rows)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=head_configs(), schedule=st.lists(st.integers(0, 2), min_size=1, max_size=7), seed=st.integers(0, 99))
def test_every_forward_equals_the_per_head_recomputation(config, schedule, seed) -> None:
    """Random head assignments, retentions (window 0 included), GQA, page sizes, 1-2 branches; each chunk
    takes 0-2 denoising forwards then a commit: every head sees exactly its group's chunks."""
    spec, heads = config
    gen = torch.Generator().manual_seed(seed)
    with am.HeadGroupedKVCache(spec, heads, max_sessions=1, backend="reference") as cache:
        session = cache.open_session("s")
        oracle = PerHeadOracle(heads)
        for denoise in schedule:
            for step in range(denoise + 1):
                got, want = one_forward(session, oracle, spec.branches, spec.chunk_size, step == denoise, gen, spec)
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # Memory is per part: each holds exactly its group's resident chunks, only for its heads and layers.
        for part, state in zip(cache.part_list, session.parts):
            resident = len(part.policy.history_indices(len(schedule)))
            assert state.pages_in_use() == len(spec.branches) * resident * spec.pages_per_chunk, part.name
        session.close()
        assert cache.bytes_in_use() == 0


def test_one_policy_split_across_parts_equals_a_plain_cache() -> None:
    """Two groups with the same retention, heads scattered: outputs equal one KVCache over all heads (the
    split, the per-part writes and the merge back into head order lose nothing)."""
    spec = make_spec(layers=2, kv_heads=4, group=2)
    heads = am.HeadRetention({"x": (1, 2), "y": (1, 2)}, [["y", "x", "y", "y"], ["x", "y", "x", "x"]])
    plain = am.KVCache(dataclasses.replace(spec, sink_chunks=1, window_chunks=2), num_pages=64, backend="reference")
    grouped = am.HeadGroupedKVCache(spec, heads, max_sessions=1, backend="reference")
    a, b = plain.open_session("p"), grouped.open_session("g")
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


def test_short_groups_free_their_pages_and_admission_counts_each_part() -> None:
    spec = make_spec(layers=2, kv_heads=4)
    heads = am.HeadRetention.from_local_heads(2, 4, {0: [1, 2, 3], "1": [0]}, local=(0, 1), other=(1, 4))
    cache = am.HeadGroupedKVCache(spec, heads, max_sessions=2, backend="reference")
    assert cache.part_names == ("local/1h", "local/3h", "other/1h", "other/3h")
    assert cache.sessions_that_fit(recache=False) == 2
    s = cache.open_session()
    oracle = PerHeadOracle(heads)
    gen = torch.Generator().manual_seed(1)
    for _ in range(8):
        one_forward(s, oracle, spec.branches, 4, True, gen, spec)
    # local: 1 chunk per branch; other: sink + 4 window chunks = 5, 2 pages per chunk, 2 branches.
    assert s.pages_in_use() == {"local/1h": 4, "local/3h": 4, "other/1h": 20, "other/3h": 20}
    uniform_bytes = 2 * 2 * (5 + 0) * 2 * 4 * 4 * 8 * 4  # branches x layers x chunks x pages x page x heads x d x K,V x fp32 / 2
    assert s.bytes_in_use() == sum(
        n * c._pool.bytes_per_page for n, c in zip(s.pages_in_use().values(), cache.caches)
    )
    assert s.bytes_in_use() < 0.75 * uniform_bytes
    assert cache.sessions_that_fit(recache=False) == 1
    cache.admit_session("b", recache=False)
    with pytest.raises(am.CapacityError, match="pages per part"):
        cache.admit_session("c", recache=False)
    assert set(cache.sessions) == {s.session_id, "b"}


def test_a_forward_commits_in_every_part_or_in_none() -> None:
    """A layer left out of a committing forward: the parts holding it refuse, and no part commits."""
    spec = make_spec(layers=3, kv_heads=2)
    heads = am.HeadRetention({"l": (0, 1), "g": (1, 2)}, [["l", "g"], ["l", "l"], ["g", "g"]])
    cache = am.HeadGroupedKVCache(spec, heads, max_sessions=1, backend="reference")
    s = cache.open_session()
    oracle = PerHeadOracle(heads)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        one_forward(s, oracle, spec.branches, 4, True, gen, spec)
    before = (s.pages_in_use(), [p.committed_chunks("cond") for p in s.parts])
    with pytest.raises(am.errors.IncompleteForwardError):
        with s.prepare_forward(None, 4, commit_current=True) as fwd:
            for layer in fwd.layers[:2]:  # layer 2 ("g" only) never runs
                am.chunk_attention(*random_qkv(2, 4, 2, 2, 8, gen, torch.float32), layer)
    assert (s.pages_in_use(), [p.committed_chunks("cond") for p in s.parts]) == before
    assert fwd.status == "aborted"
    # History is intact: the next forwards still equal the oracle.
    for commit in (False, True):
        got, want = one_forward(s, oracle, spec.branches, 4, commit, gen, spec)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_part_out_of_pages_leaves_no_part_with_an_open_forward() -> None:
    spec = make_spec(layers=1, kv_heads=2, branches=("main",))
    heads = am.HeadRetention({"l": (0, 1), "g": (1, 2)}, [["l", "g"]])
    cache = am.HeadGroupedKVCache(spec, heads, max_sessions=1, backend="reference")
    s = cache.open_session()
    hog = cache.caches[-1]._allocator.allocate(cache.caches[-1]._allocator.num_free - 1)  # the last part is full
    with pytest.raises(am.CapacityError):
        s.prepare_forward(None, 4, commit_current=True)
    assert all(p._open_forward("main") is None for p in s.parts)
    assert s.pages_in_use() == {"l/1h": 0, "g/1h": 0}
    cache.caches[-1]._allocator.decref(hog)
    oracle = PerHeadOracle(heads)
    got, want = one_forward(s, oracle, ("main",), 4, True, torch.Generator().manual_seed(3), spec)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fork_shares_every_part_and_reset_and_close_release_them() -> None:
    spec = make_spec(layers=2, kv_heads=2)
    heads = am.HeadRetention({"l": (0, 1), "g": (1, 2)}, [["l", "g"], ["g", "l"]])
    cache = am.HeadGroupedKVCache(spec, heads, max_sessions=3, backend="reference")
    s = cache.open_session("a")
    oracle = PerHeadOracle(heads)
    gen = torch.Generator().manual_seed(4)
    for _ in range(4):
        one_forward(s, oracle, spec.branches, 4, True, gen, spec)
    used = [c._allocator.num_used for c in cache.caches]
    child = s.fork("b")
    assert [c._allocator.num_used for c in cache.caches] == used  # shared by refcount: no page copied
    forked = PerHeadOracle(heads, committed={b: [list(layer) for layer in oracle.committed[b]] for b in spec.branches})
    got, want = one_forward(child, forked, spec.branches, 4, True, gen, spec)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    child.reset()
    assert child.token_offset("cond") == 0 and sum(child.pages_in_use().values()) == 0
    s.close()
    child.close()
    assert all(c._allocator.num_used == 0 for c in cache.caches)
    assert cache.sessions == {}


def test_cross_attention_lives_on_the_grouped_session() -> None:
    spec = dataclasses.replace(make_spec(layers=2, kv_heads=2), cross_attention=(am.CrossAttentionSpec("text", 3),))
    heads = am.HeadRetention({"l": (0, 1), "g": (1, 2)}, [["l", "g"], ["g", "l"]])
    cache = am.HeadGroupedKVCache(spec, heads, max_sessions=1, backend="reference")
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


def test_a_budget_that_leaves_a_part_without_a_page_is_refused_as_kvcache_refuses_it() -> None:
    """``budget_bytes=10`` used to build 1-page parts (more than the budget) instead of refusing."""
    spec = make_spec(layers=2, kv_heads=2)
    heads = am.HeadRetention({"l": (0, 1), "g": (1, 2)}, [["l", "g"], ["g", "l"]])
    # Each part: 2 layers x 1 head, a page 2 layers x (K, V) x 2 tokens x 8 dims x 4 bytes = 256 bytes. One
    # session's peak, 2 branches x (history + 1 pending) chunks x 2 pages: l 8 pages (2048 bytes), g 16 (4096).
    # l's share, budget x 2048 / 6144, holds a page from 768 bytes on.
    for budget, empty in ((10, r"l/1h \(256 bytes a page\), g/1h \(256 bytes a page\)"),
                          (767, r"l/1h \(256 bytes a page\)")):
        with pytest.raises(am.SpecError, match=rf"budget_bytes: expected at least 768 bytes \(one page in every "
                                               rf"part.*got {budget}: no page for {empty}$"):
            am.HeadGroupedKVCache(spec, heads, budget_bytes=budget, backend="reference")
    with pytest.raises(am.SpecError, match="expected at least one page"):
        am.KVCache(part_spec(spec, heads.parts()[0]), budget_bytes=10)
    cache = am.HeadGroupedKVCache(spec, heads, budget_bytes=768, backend="reference")
    assert [c._pool.num_pages for c in cache.caches] == [1, 2]
    cache.close()


def test_misuse_is_refused_with_the_expected_error() -> None:
    spec = make_spec(layers=2, kv_heads=2)
    heads = am.HeadRetention({"l": (0, 1), "g": (1, 2)}, [["l", "g"], ["g", "l"]])
    with pytest.raises(am.SpecError, match="expected sink_chunks/window_chunks/retention left"):
        am.HeadGroupedKVCache(dataclasses.replace(spec, window_chunks=3), heads, max_sessions=1)
    with pytest.raises(am.SpecError, match="2 layers x 2 kv heads"):
        am.HeadGroupedKVCache(spec, am.HeadRetention.uniform(3, 2, (1, 2)), max_sessions=1)
    with pytest.raises(am.SpecError, match="bounded window"):
        am.HeadGroupedKVCache(spec, am.HeadRetention.uniform(2, 2, (1, None)), max_sessions=1)
    with pytest.raises(am.SpecError, match="exactly one of max_sessions / budget_bytes"):
        am.HeadGroupedKVCache(spec, heads)
    cache = am.HeadGroupedKVCache(spec, heads, budget_bytes=1 << 20, backend="reference")
    s = cache.open_session()
    with pytest.raises(am.errors.UnknownBranchError):
        s.prepare_forward(("nope",), 4)
    with pytest.raises(am.errors.SequenceLengthError):
        s.prepare_forward(None, 5)
    q, k, v = random_qkv(2, 4, 2, 2, 8, torch.Generator().manual_seed(0), torch.float32)
    with s.prepare_forward(None, 4) as fwd:
        with pytest.raises(am.SpecError, match="gradients through a HeadGroupedKVCache"):
            am.chunk_attention(q.requires_grad_(), k, v, fwd.layers[0])
        with pytest.raises(am.TensorMismatchError):
            am.chunk_attention(q.detach()[:, :, :1], k, v, fwd.layers[0])
    with pytest.raises(am.errors.ForwardFinishedError):
        am.chunk_attention(q.detach(), k, v, fwd.layers[0])
    s.close()
    with pytest.raises(am.errors.SessionClosedError):
        s.prepare_forward(None, 4)
