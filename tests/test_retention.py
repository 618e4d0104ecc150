"""Retention policies (issue 11): the contract every policy keeps, and a second policy end to end.

``SinkWindowMemoryPolicy`` keeps, beyond sinks + window, every k-th chunk that left the window
(the last M of them). The rollout is compared with the cache-free oracle, whose memory rule is
written independently with list slicing (``tests/streaming_model.py``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from streaming_model import LibraryStreaming, NaiveStreaming, TinyStreamingModel, play, rollout_events

import ardiff_modules as am
from ardiff_modules.history import BranchHistory
from ardiff_modules.allocator import PageAllocator
from ardiff_modules.window import RetentionPolicy, SinkWindowMemoryPolicy, SinkWindowPolicy, retain

policies = st.one_of(
    st.builds(SinkWindowPolicy, st.integers(0, 3), st.one_of(st.none(), st.integers(0, 4))),
    st.builds(SinkWindowMemoryPolicy, st.integers(0, 3), st.integers(0, 4), st.integers(1, 4), st.integers(0, 3)),
)


@given(policies, st.integers(0, 60))
def test_policy_contract(policy: RetentionPolicy, n: int) -> None:
    """Ascending, in range, bounded, sinks first, and monotone (an evicted chunk never comes back)."""
    assert isinstance(policy, RetentionPolicy)
    now = policy.visible_indices(n)
    assert now == sorted(set(now)) and all(0 <= i < n for i in now)
    if policy.max_resident_chunks is not None:
        assert len(now) <= policy.max_resident_chunks
    assert now[: min(policy.sink_chunks, n)] == list(range(min(policy.sink_chunks, n)))
    assert set(policy.visible_indices(n + 1)) <= set(now) | {n}


@given(policies, st.lists(st.integers(1, 3), min_size=1, max_size=25))
def test_retain_matches_visible_indices(policy: RetentionPolicy, commits: list[int]) -> None:
    resident: tuple = ()
    indices: tuple = ()
    committed = 0
    evicted_all: list = []
    for count in commits:
        new = [f"c{committed + i}" for i in range(count)]
        result = retain(policy, resident, indices, committed, new)
        committed += count
        assert list(result.indices) == policy.visible_indices(committed)
        assert list(result.resident) == [f"c{i}" for i in result.indices]
        evicted_all += result.evicted
        resident, indices = result.resident, result.indices
    assert sorted(evicted_all + list(resident), key=lambda c: int(c[1:])) == [f"c{i}" for i in range(committed)]


def test_a_policy_that_brings_a_chunk_back_is_refused() -> None:
    class Forgetful:
        sink_chunks = 0
        max_resident_chunks = 2

        def visible_indices(self, n: int) -> list[int]:
            return [0] if n % 2 else list(range(max(0, n - 1), n))

    with pytest.raises(am.SpecError, match="never bring back an evicted chunk"):
        result = retain(Forgetful(), (), (), 0, ["a", "b"])
        retain(Forgetful(), result.resident, result.indices, 2, ["c"])


def test_memory_policy_example_from_the_docstring() -> None:
    policy = SinkWindowMemoryPolicy(sink_chunks=1, window_chunks=2, memory_every=3, memory_chunks=2)
    assert policy.visible_indices(11) == [0, 4, 7, 9, 10]
    assert policy.max_resident_chunks == 5


def test_branch_history_frees_exactly_the_chunks_the_policy_drops() -> None:
    policy = SinkWindowMemoryPolicy(1, 1, 2, 1)
    alloc = PageAllocator(32)
    h = BranchHistory(policy, pages_per_chunk=1, chunk_size=2)
    for _ in range(7):
        h.set_pending(1, alloc)
        h.commit_pending(alloc)
    # 7 committed: sink 0, window [6], older 1..5, memory candidates 1, 3, 5 -> the last one: 5.
    assert h.resident_index == (0, 5, 6)
    assert alloc.num_used == 3
    alloc.check_invariants()


def test_spec_takes_a_retention_policy() -> None:
    policy = SinkWindowMemoryPolicy(1, 2, 3, 2)
    spec = am.KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, chunk_size=4, page_size=2, retention=policy,
                          dtype="float32")
    assert spec.policy is policy and spec.max_resident_chunks == 5 and spec.pages_per_branch() == 12
    with pytest.raises(am.SpecError, match="left at"):
        am.KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, chunk_size=4, page_size=2, retention=policy,
                       sink_chunks=1)
    with pytest.raises(am.SpecError, match="expected a RetentionPolicy"):
        am.KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, chunk_size=4, page_size=2, retention="sink1")
    assert am.KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, chunk_size=4, page_size=2, sink_chunks=1,
                          window_chunks=2).policy == SinkWindowPolicy(1, 2)


@pytest.mark.parametrize("extents", [False, True], ids=["paged", "extents"])
@pytest.mark.parametrize("sink,window,every,count", [(1, 2, 2, 2), (0, 1, 3, 1), (2, 1, 1, 3)])
def test_memory_policy_rollout_matches_the_cache_free_oracle(
    sink: int, window: int, every: int, count: int, extents: bool
) -> None:
    torch.manual_seed(0)
    model = TinyStreamingModel().eval()
    chunk = 4
    base = model.spec(chunk, 2, 0, None)
    spec = am.KVCacheSpec(
        num_layers=base.num_layers, num_kv_heads=base.num_kv_heads, head_dim=base.head_dim, chunk_size=chunk,
        page_size=2, branches=base.branches, cross_attention=base.cross_attention, dtype="float32",
        retention=SinkWindowMemoryPolicy(sink, window, every, count),
    )
    events = rollout_events(24, chunk, model.dim, model.context_dim)
    pages = 2 * (24 + 8) * spec.pages_per_chunk
    library = LibraryStreaming(model, spec, pages)
    if extents:
        library.cache = am.KVCache(spec, num_pages=pages, backend="reference", contiguous_extents=True)
        library.state = library.cache.open_session("s0")
    expected = play(NaiveStreaming(model, chunk, sink, window, memory=(every, count)), events)
    actual = play(library, events)
    assert len(actual) == len(expected) >= 30
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, e, atol=2e-5, rtol=2e-5, msg=lambda m, i=i: f"forward {i}: {m}")
    # The memory chunks are really resident (more than sinks + window once enough chunks passed).
    visible = library.state.visible_chunks("cond")
    assert len(visible) == min(spec.max_resident_chunks, len(visible)) and len(visible) > sink + window
    library.state.close()
    assert library.cache.allocator.num_free == pages


def test_masks_draw_any_policy(tmp_path) -> None:  # noqa: ANN001
    from ardiff_modules.masks import chunk_visibility, chunk_visibility_name, render_chunk_mask

    policy = SinkWindowMemoryPolicy(1, 2, 3, 2)
    mask = chunk_visibility(11, 2, policy=policy)
    assert mask[0, :11].nonzero().flatten().tolist() == [0, 4, 7, 9, 10]
    assert torch.equal(chunk_visibility(11, 2, 1, 2), chunk_visibility(11, 2, policy=SinkWindowPolicy(1, 2)))
    assert chunk_visibility_name(policy=policy) == "sink1_window2_memory2every3"
    assert render_chunk_mask(tmp_path / "m.png", 11, 2, policy=policy).stat().st_size > 0
    with pytest.raises(am.SpecError, match="left at"):
        chunk_visibility(11, 2, 1, policy=policy)
