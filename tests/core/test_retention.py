"""Retention policies (issue 11): the contract every policy keeps, and a second policy end to end.

Issue 24 item 5: a user's policy is checked -- its declared counts when the spec takes it, each answer of
``history_indices`` at each commit -- and a breach is a :class:`SpecError` that changes nothing; admission
agrees with what a valid user policy really keeps.

``SinkWindowMemoryPolicy`` keeps, beyond sinks + window, every k-th chunk that left the window
(the last M of them). The rollout is compared with the cache-free oracle, whose memory rule is
written independently with list slicing (``tests/support/streaming_model.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ardiff_modules as am
from ardiff_modules.core.branch import BranchPages
from ardiff_modules.core.allocator import PageAllocator
from ardiff_modules.core.retention import (
    RetentionPolicy,
    SinkWindowMemoryPolicy,
    SinkWindowPolicy,
    check_declared,
    checked_history_indices,
    retain,
)
from tests.support.policies import BAD_KINDS, BAD_MESSAGES, EvenMemoryPolicy, Misbehaving, contract_holds
from tests.support.streaming_model import LibraryStreaming, NaiveStreaming, TinyStreamingModel, play, rollout_events

policies = st.one_of(
    st.builds(SinkWindowPolicy, st.integers(0, 3), st.one_of(st.none(), st.integers(0, 4))),
    st.builds(SinkWindowMemoryPolicy, st.integers(0, 3), st.integers(0, 4), st.integers(1, 4), st.integers(0, 3)),
)


@given(policies, st.integers(0, 60))
def test_policy_contract(policy: RetentionPolicy, n: int) -> None:
    """Ascending, in range, bounded, sinks first, and monotone (an evicted chunk never comes back)."""
    assert isinstance(policy, RetentionPolicy)
    now = policy.history_indices(n)
    assert now == sorted(set(now)) and all(0 <= i < n for i in now)
    if policy.max_history_chunks is not None:
        assert len(now) <= policy.max_history_chunks
    assert now[: min(policy.sink_chunks, n)] == list(range(min(policy.sink_chunks, n)))
    assert set(policy.history_indices(n + 1)) <= set(now) | {n}


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
        assert list(result.indices) == policy.history_indices(committed)
        assert list(result.history) == [f"c{i}" for i in result.indices]
        evicted_all += result.evicted
        resident, indices = result.history, result.indices
    assert sorted(evicted_all + list(resident), key=lambda c: int(c[1:])) == [f"c{i}" for i in range(committed)]


def test_a_policy_that_brings_a_chunk_back_is_refused() -> None:
    class Forgetful:
        sink_chunks = 0
        max_history_chunks = 2

        def history_indices(self, n: int) -> list[int]:
            return [0] if n % 2 else list(range(max(0, n - 1), n))

    with pytest.raises(am.SpecError, match="never bring back an evicted chunk"):
        result = retain(Forgetful(), (), (), 0, ["a", "b"])
        retain(Forgetful(), result.history, result.indices, 2, ["c"])


def test_memory_policy_example_from_the_docstring() -> None:
    policy = SinkWindowMemoryPolicy(sink_chunks=1, window_chunks=2, memory_every=3, memory_chunks=2)
    assert policy.history_indices(11) == [0, 4, 7, 9, 10]
    assert policy.max_history_chunks == 5


def test_branch_history_frees_exactly_the_chunks_the_policy_drops() -> None:
    policy = SinkWindowMemoryPolicy(1, 1, 2, 1)
    alloc = PageAllocator(32)
    h = BranchPages(policy, pages_per_chunk=1, chunk_size=2)
    for _ in range(7):
        h.set_pending(1, alloc)
        h.commit_pending(alloc)
    # 7 committed: sink 0, window [6], older 1..5, memory candidates 1, 3, 5 -> the last one: 5.
    assert h.history_index == (0, 5, 6)
    assert alloc.num_used == 3
    alloc.check_invariants()


def test_spec_takes_a_retention_policy() -> None:
    policy = SinkWindowMemoryPolicy(1, 2, 3, 2)
    spec = am.KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, chunk_size=4, page_size=2, retention=policy,
                          dtype="float32")
    assert spec.policy is policy and spec.max_history_chunks == 5 and spec.pages_per_branch() == 12
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
    visible = library.state.history_chunks("cond")
    assert len(visible) == min(spec.max_history_chunks, len(visible)) and len(visible) > sink + window
    library.state.close()
    assert library.cache._allocator.num_free == pages


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


# ====================================================================== issue 24 item 5: policies are checked
def tiny_spec(policy: RetentionPolicy, branches: tuple[str, ...] = ("cond", "uncond")) -> am.KVCacheSpec:
    """2 layers, 1 KV head of dim 2, 2-token chunks of two 1-token pages."""
    return am.KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=2, chunk_size=2, page_size=1, branches=branches,
                          dtype="float32", retention=policy)


class Declares:
    """A policy declaring ``sink_chunks`` / ``max_history_chunks`` as given (its answers: the sinks)."""

    def __init__(self, sink_chunks: Any, max_history_chunks: Any) -> None:
        self.sink_chunks = sink_chunks
        self.max_history_chunks = max_history_chunks

    def history_indices(self, num_committed: int) -> list[int]:
        return list(range(min(self.sink_chunks, num_committed)))


@pytest.mark.parametrize(
    "sinks,bound,message",
    [
        (0, -1, "max_history_chunks: expected None or an int >= 0, got -1"),
        (0, "3", "max_history_chunks: expected None or an int >= 0, got '3' (str)"),
        (0, 2.5, "max_history_chunks: expected None or an int >= 0, got 2.5 (float)"),
        (0, 3.0, "max_history_chunks: expected None or an int >= 0, got 3.0 (float)"),
        (0, True, "max_history_chunks: expected None or an int >= 0, got True (bool)"),
        (-1, 2, "sink_chunks: expected an int >= 0, got -1"),
        ("1", 2, "sink_chunks: expected an int >= 0, got '1' (str)"),
        (True, 2, "sink_chunks: expected an int >= 0, got True (bool)"),
        (None, 2, "sink_chunks: expected an int >= 0, got None (NoneType)"),
        (3, 2, "max_history_chunks: expected None or at least sink_chunks=3 (sinks are never evicted), got 2"),
    ],
)
def test_spec_refuses_bad_declared_counts(sinks: Any, bound: Any, message: str) -> None:
    """-1 used to give a ZeroDivisionError in admission, "3" a TypeError, 2.5 float page counts."""
    with pytest.raises(am.SpecError) as info:
        tiny_spec(Declares(sinks, bound))
    assert str(info.value) == f"retention policy Declares.{message}"


@pytest.mark.parametrize("bound", [None, 0, 1, 5])
def test_spec_takes_good_declared_counts(bound: int | None) -> None:
    spec = tiny_spec(Declares(0, bound))
    assert spec.max_history_chunks == bound and check_declared(spec.policy) == (0, bound)
    # The shipped policies at their smallest keep working (0: each chunk sees only itself).
    for policy in (SinkWindowPolicy(0, 0), SinkWindowMemoryPolicy(0, 0, 1, 0), SinkWindowPolicy(2, None)):
        assert tiny_spec(policy).policy is policy


def test_declared_counts_past_the_int32_offsets_are_refused() -> None:
    """A bound of 10**12 chunks used to pass the spec and fail in the allocator, asking for terabytes."""
    with pytest.raises(am.SpecError, match=r"KVCacheSpec.retention: expected at most \d+ resident chunks .*int32.*"
                       r"got Declares with sink_chunks=0, max_history_chunks=1000000000000"):
        tiny_spec(Declares(0, 10**12))
    with pytest.raises(am.SpecError, match=r"SinkWindowMemoryPolicy: expected at most 2147483646 .*memory_chunks=10"):
        SinkWindowMemoryPolicy(1, 2, 3, 10**10)
    with pytest.raises(am.SpecError, match=r"HeadRetention.groups\['a'\]: expected at most 2147483646 .*Declares"):
        am.HeadRetention({"a": Declares(0, 10**12)}, [["a"]])


def test_spec_reports_a_declaration_that_raises() -> None:
    class Broken:
        sink_chunks = 0

        @property
        def max_history_chunks(self) -> int:
            return {}["bound"]  # a user bug: KeyError

        def history_indices(self, num_committed: int) -> list[int]:
            return []

    with pytest.raises(am.SpecError, match=r"Broken\.max_history_chunks: expected an answer, got KeyError: .bound."):
        tiny_spec(Broken())


answers = st.one_of(
    st.lists(st.integers(-2, 12), max_size=8),
    st.lists(st.integers(-2, 12), max_size=8).map(sorted),
    st.lists(st.integers(-2, 12), max_size=8).map(lambda xs: tuple(sorted(set(xs)))),
    st.lists(st.one_of(st.integers(0, 12), st.booleans(), st.floats(0, 12), st.text(max_size=2)), max_size=4),
    st.integers(0, 12).flatmap(lambda a: st.integers(a, 13).map(lambda b: range(a, b))),  # any Sequence
    st.sampled_from([None, "012", {0, 1}, 3, b"01", iter([0, 1])]),
)


@given(
    policies, st.integers(0, 10), st.integers(0, 3), st.data(), answers, st.booleans(),
)
def test_checker_accepts_exactly_the_contract(
    policy: RetentionPolicy, committed: int, new: int, data: st.DataObject, answer: Any, honest: bool
) -> None:
    """Any answer: accepted iff the contract (written independently, ``contract_holds``) holds; then as given."""
    total = committed + new
    # A real resident set: what the policy kept of `committed` chunks.
    resident = policy.history_indices(committed)
    if honest:  # mostly-valid answers: the policy's own, with one index maybe dropped or added
        answer = list(policy.history_indices(total))
        edit = data.draw(st.sampled_from(["none", "drop", "add"]))
        if edit == "drop" and answer:
            answer.pop(data.draw(st.integers(0, len(answer) - 1)))
        elif edit == "add":
            answer = sorted(set(answer) | {data.draw(st.integers(0, total))})

    class Answers:
        sink_chunks = policy.sink_chunks
        max_history_chunks = policy.max_history_chunks

        def history_indices(self, n: int) -> Any:
            assert n == total
            return answer

    ok = contract_holds(answer, total, resident, committed, policy.sink_chunks, policy.max_history_chunks)
    if ok:
        assert checked_history_indices(Answers(), total, resident, committed) == tuple(answer)
        assert retain(Answers(), resident, resident, committed, range(committed, total)).indices == tuple(answer)
    else:
        with pytest.raises(am.SpecError, match=r"^retention policy Answers\.history_indices\(\d+\): expected"):
            checked_history_indices(Answers(), total, resident, committed)


def write_random_layers(fwd: am.ForwardContext, seed: int) -> None:
    """Run every layer's attention op once: the forward writes its pending K/V into the pool."""
    gen = torch.Generator().manual_seed(seed)
    s, n = fwd.positions.shape
    for layer in fwd.layers:
        q, k, v = (torch.randn(s, n, 1, 2, generator=gen) for _ in range(3))
        with torch.no_grad():
            am.chunk_attention(q, k, v, layer)


def branch_state(h: BranchPages) -> tuple:
    return (h.history, h.history_index, h.history_start, h.committed_chunks, h.committed_tokens, h.extent)


def cache_state(cache: am.KVCache, states: list[am.KVState]) -> tuple:
    """Allocator (free order, refcounts) and every branch's history and pending chunks (the pool: separately)."""
    alloc = cache._allocator
    histories = tuple(
        (branch_state(s.branch_pages(b)), s.branch_pages(b).pending) for s in states for b in cache.spec.branches
    )
    return alloc.free_pages(), tuple(alloc.refcount(p) for p in range(alloc.num_pages)), histories


def assert_refused_unchanged(
    cache: am.KVCache, states: list[am.KVState], fwd: am.ForwardContext, call: Any, *matches: str
) -> am.SpecError:
    """``call()`` raises SpecError naming ``matches``; the pool and every session are as before.

    A failed commit aborts its forward (``ForwardManager.finish_forward``): its pending chunks are dropped (their
    pages freed, or kept in the branch's ring with contiguous extents), history is exactly as before.
    A caller checking a policy before committing (``abort_if_uncommittable``) would leave it open instead.
    """
    before, pool = cache_state(cache, states), cache._pool.kv.clone()
    pending = [p for s, b in fwd._transaction.members for p in s.branch_pages(b).pending_pages()]
    with pytest.raises(am.SpecError) as info:
        call()
    for text in matches:
        assert text in str(info.value), f"{str(info.value)!r} lacks {text!r}"
    assert torch.equal(cache._pool.kv, pool), "a refused commit wrote the pool"
    after = cache_state(cache, states)
    if fwd._transaction.is_open:
        assert after == before
    else:  # the abort-on-failed-commit finish
        assert fwd._transaction.status == "aborted"
        assert [h for h, _ in after[2]] == [h for h, _ in before[2]], "a refused commit changed history"
        assert all(p == () for _, p in after[2]), "an aborted commit kept pending chunks"
        history_pages = {p for s in states for b in cache.spec.branches for p in s.branch_pages(b).history_pages()}
        for page, (was, now) in enumerate(zip(before[1], after[1])):  # only pending pages let go
            assert now == was or (page in pending and page not in history_pages and now < was), (page, was, now)
    cache._allocator.check_invariants()
    return info.value


def rolled_cache(policy: RetentionPolicy, chunks: int, *, extents: bool = False, pages: int = 64) -> tuple:
    """A cache of ``policy`` with one session that committed ``chunks`` CFG chunks (both branches)."""
    cache = am.KVCache(tiny_spec(policy), num_pages=pages, backend="reference", contiguous_extents=extents)
    state = cache.open_session("s")
    for i in range(chunks):
        fwd = state.prepare_forward(None, 2, True)
        write_random_layers(fwd, i)
        fwd.commit()
    return cache, state


@pytest.mark.parametrize("extents", [False, True], ids=["paged", "extents"])
@pytest.mark.parametrize("via", ["commit_paged_context", "ctx.commit", "with"])
@pytest.mark.parametrize("kind", BAD_KINDS)
def test_a_policy_breaking_its_contract_at_commit_changes_nothing(kind: str, via: str, extents: bool) -> None:
    """Every way to break the contract, on the 2nd stream of a CFG forward: SpecError, nothing applied.

    The 1st stream's commit was computed fine: it must not be applied alone (all streams or none).
    """
    policy = Misbehaving(SinkWindowPolicy(1, 2))
    cache, state = rolled_cache(policy, 5, extents=extents)  # 5 committed: sink 0, window 3 4; 1 2 evicted
    history = state.branch_pages("uncond")
    assert history.history_index == (0, 3, 4)
    fwd = state.prepare_forward(None, 4, True)  # two chunks per branch: too_many keeps all 5 > 3
    write_random_layers(fwd, 99)
    policy.arm(kind, resident=history.history_index, committed=history.committed_chunks, on_call=2)

    def call() -> None:
        if via == "commit_paged_context":
            state.commit_paged_context("cond")
        elif via == "ctx.commit":
            fwd.commit()
        else:
            with fwd:
                pass

    error = assert_refused_unchanged(cache, [state], fwd, call, BAD_MESSAGES[kind], "retention policy Misbehaving.")
    assert policy.applied == kind
    if kind == "raises":
        assert isinstance(error.__cause__, TypeError)
    policy.disarm()
    if fwd._transaction.is_open:  # the same forward commits once the policy behaves
        fwd.commit()
        assert history.history_index == (0, 5, 6) and state.branch_pages("cond").history_index == (0, 5, 6)
    state.close()
    assert cache._allocator.num_free == cache._allocator.num_pages


def test_a_failing_policy_in_a_multi_session_forward_commits_no_session() -> None:
    """Two sessions' streams in one forward; the policy fails on the last stream: no session commits."""
    policy = Misbehaving(SinkWindowPolicy(1, 1))
    cache = am.KVCache(tiny_spec(policy), num_pages=32, backend="reference")
    a, b = cache.open_session("a"), cache.open_session("b")
    streams = [(a, "cond"), (a, "uncond"), (b, "cond"), (b, "uncond")]
    for i in range(3):
        fwd = cache.prepare_forward(streams, 2, True)
        write_random_layers(fwd, i)
        fwd.commit()
    fwd = cache.prepare_forward(streams, 2, True)
    write_random_layers(fwd, 7)
    h = b.branch_pages("uncond")
    policy.arm("resurrect", resident=h.history_index, committed=h.committed_chunks, on_call=4)
    assert_refused_unchanged(cache, [a, b], fwd, fwd.commit, "[1] already evicted")
    assert policy.calls == 4


def test_a_policy_keeping_more_than_it_declared_is_refused_before_admission_breaks() -> None:
    """Declared 3 (sink + 2 evens), keeps 4 from the 6th chunk on: admission counted 3, so the commit refuses
    (before the fix the next prepare of a session admitted at its peak hit CapacityError)."""

    class Undercounts(EvenMemoryPolicy):
        @property
        def max_history_chunks(self) -> int:
            return self.sink_chunks + self.evens  # the newest chunk forgotten

    spec = tiny_spec(Undercounts(1, 2))
    per_session = 2 * (3 + 1) * spec.pages_per_chunk
    cache = am.KVCache(spec, num_pages=3 * per_session, backend="reference")
    # recache=False: these pools never re-cache (no re-cache reserve), the admission of the policy's peak alone
    assert cache.pages_per_session() == per_session and cache.sessions_that_fit(recache=False) == 3
    states = [cache.admit_session(recache=False) for _ in range(3)]
    streams = [(s, b) for s in states for b in spec.branches]
    for i in range(5):
        fwd = cache.prepare_forward(streams, 2, True)
        write_random_layers(fwd, i)
        fwd.commit()
    fwd = cache.prepare_forward(streams, 2, True)
    write_random_layers(fwd, 5)
    error = assert_refused_unchanged(
        cache, states, fwd, fwd.commit, "Undercounts.history_indices(6): expected at most max_history_chunks=3",
        "got 4: [0, 2, 4, 5]",
    )
    assert not isinstance(error, am.CapacityError)


@pytest.mark.parametrize("extents", [False, True], ids=["paged", "extents"])
def test_admission_agrees_with_a_valid_user_policy(extents: bool) -> None:
    """A user's policy (not a shipped one): the sessions admitted at their peak run forever without
    CapacityError, all at their peak at once fill the pool exactly, and one more is refused."""
    policy = EvenMemoryPolicy(1, 2)  # resident: sink + 2 evens + newest = 4 at most
    spec = tiny_spec(policy)
    per_session = 2 * (4 + 1) * spec.pages_per_chunk
    cache = am.KVCache(spec, num_pages=3 * per_session, backend="reference", contiguous_extents=extents)
    assert cache.pages_per_session() == per_session
    assert cache.sessions_that_fit(recache=False) == 3  # a pool that never re-caches: no re-cache reserve
    states = [cache.admit_session(f"s{i}", recache=False) for i in range(3)]
    assert cache.sessions_that_fit(recache=False) == 0 and not cache.can_admit(recache=False)
    with pytest.raises(am.CapacityError):
        cache.admit_session("one too many", recache=False)
    streams = [(s, b) for s in states for b in spec.branches]
    peak_resident = 0
    for i in range(14):
        if i % 3 == 2:  # one session alone now and then (the others idle at their resident peak)
            fwd = states[i % 2].prepare_forward(None, 2, True)
        else:  # every session at once, each with a denoising forward first
            cache.prepare_forward(streams, 2, False).commit()
            fwd = cache.prepare_forward(streams, 2, True)
        write_random_layers(fwd, i)
        fwd.commit()
        for s in states:
            for b in spec.branches:
                h = s.branch_pages(b)
                assert list(h.history_index) == policy.history_indices(h.committed_chunks)
                peak_resident = max(peak_resident, len(h.history))
    assert peak_resident == policy.max_history_chunks
    assert cache._allocator.peak_used == cache._allocator.num_pages  # the promise is tight, not only safe
    for s in states:
        s.close()
    assert cache._allocator.num_free == cache._allocator.num_pages
