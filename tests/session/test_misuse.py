"""Misuses of the session API, the cache and ``CUDAGraphStep`` (issue 10): each raises the library's
error naming expected and actual, and changes nothing (pool, allocator, sessions)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from ardiff_modules import KVCache, SpecError, TensorMismatchError
from ardiff_modules.errors import (
    CacheClosedError,
    CrossAttentionNotPopulatedError,
    ForwardFinishedError,
    UnknownBranchError,
)
from ardiff_modules.graphs import CUDAGraphStep
from tests.support.kv_writes import write_every_layer
from tests.support.small_cache import BOTH, CHUNK, SMALL_SPEC, bookkeeping, commit_chunk, make_small_cache, run_layers
from tests.support.two_sessions import TWO_SESSIONS_SPEC, assert_sessions_unchanged, session_snapshot

CASES: list[tuple[str, Callable[[Any, Any, Any], Any], type[Exception], str]] = [
    ("branch-as-list", lambda c, a, b: a.token_offset(["cond"]), UnknownBranchError, "expected a branch name (str)"),
    ("abort-branch-list", lambda c, a, b: a.abort(["cond"]), UnknownBranchError, "got ['cond']"),
    ("keep-cross-none", lambda c, a, b: a.reset(keep_cross_attention=None), SpecError, "collection of cache names"),
    ("keep-cross-int", lambda c, a, b: a.reset(keep_cross_attention=3), SpecError, "got 3"),
    ("keep-cross-nested", lambda c, a, b: a.reset(keep_cross_attention=[["text"]]), SpecError, "cache names"),
    ("populate-none", lambda c, a, b: a.populate_cross_attention("cond", "text", None), TensorMismatchError,
     "expected an iterable of 2 (k, v) pairs, got NoneType"),
    ("populate-not-pairs", lambda c, a, b: a.populate_cross_attention("cond", "text", [1, 2]), TensorMismatchError,
     "expected a (k, v) pair"),
    ("share-sinks-none", lambda c, a, b: b.share_sinks_from(None, "cond"), SpecError, "got NoneType"),
    ("share-sinks-empty-source", lambda c, a, b: b.share_sinks_from(b, "uncond"), SpecError,
     "to hold its 1 sink chunk(s), got 0"),
    ("fork-duplicate-branches", lambda c, a, b: a.fork(branches=("cond", "cond")), SpecError, "distinct"),
    ("fork-no-branch", lambda c, a, b: a.fork(branches=()), SpecError, "at least one"),
    ("fork-set", lambda c, a, b: a.fork(branches={"cond"}), SpecError, "ordered sequence"),
    ("open-empty-id", lambda c, a, b: c.open_session(""), SpecError, "non-empty str session id"),
    ("admit-int-id", lambda c, a, b: c.admit_session(3), SpecError, "got 3"),
    ("pages-per-session-branches", lambda c, a, b: c.pages_per_session(branches=5), SpecError, "in [1, 3)"),
    ("streams-as-str", lambda c, a, b: c.prepare_forward("cond", 4), SpecError, "got str"),
    ("streams-none-item", lambda c, a, b: c.prepare_forward([None], 4), SpecError, "got None"),
    ("mask-float", lambda c, a, b: c.prepare_forward([(a, "cond")], 4, token_mask=torch.ones(1, 4, 4)),
     TensorMismatchError, "expected dtype torch.bool, got torch.float32"),
    ("mask-meta", lambda c, a, b: c.prepare_forward(
        [(a, "cond")], 4, token_mask=torch.ones(1, 4, 4, dtype=torch.bool, device="meta")),
     TensorMismatchError, "got one on meta"),
    ("commit-current-str", lambda c, a, b: a.prepare_forward(("cond",), 4, "no"), SpecError, "expected a bool"),
    ("graph-fn", lambda c, a, b: CUDAGraphStep(None), SpecError, "expected a callable"),
    ("graph-warmup", lambda c, a, b: CUDAGraphStep(lambda *x: x, warmup_iters=-1), SpecError, "got -1"),
    ("graph-clone", lambda c, a, b: CUDAGraphStep(lambda *x: x, clone_outputs="no"), SpecError, "a bool"),
    ("graph-call-none", lambda c, a, b: CUDAGraphStep(lambda *x: x)(None), SpecError, "got NoneType"),
    ("graph-capture-mode", lambda c, a, b: CUDAGraphStep(lambda *x: x, capture_error_mode="local"), SpecError,
     "expected one of ('global', 'thread_local', 'relaxed'), got 'local'"),
    ("graph-capture-none", lambda c, a, b: CUDAGraphStep(lambda *x: x).capture(None), SpecError,
     "static=True"),
    ("graph-will-capture-none", lambda c, a, b: CUDAGraphStep(lambda *x: x).will_capture(None), SpecError,
     "expected a ForwardContext, got NoneType"),
    ("graph-discard-none", lambda c, a, b: CUDAGraphStep(lambda *x: x).discard(None), SpecError,
     "expected a ForwardContext, got NoneType"),
    ("graph-check-replay-none", lambda c, a, b: CUDAGraphStep(lambda *x: x).check_replay(None), SpecError,
     "expected a ForwardContext, got NoneType"),
]


@pytest.mark.parametrize("name,call,exc,text", CASES, ids=[c[0] for c in CASES])
def test_session_misuse_raises_and_changes_nothing(
    name: str, call: Callable, exc: type, text: str, two_sessions: tuple
) -> None:
    cache, a, b = two_sessions
    before = session_snapshot(cache)
    with pytest.raises(exc) as info:
        call(cache, a, b)
    assert text in str(info.value), str(info.value)
    assert_sessions_unchanged(cache, before)


def test_admission_queries_on_a_closed_cache_raise(two_sessions: tuple) -> None:
    cache, _, _ = two_sessions
    cache.close()
    for call in (cache.sessions_that_fit, cache.can_admit, cache.pages_per_session, cache.open_session):
        with pytest.raises(CacheClosedError, match="expected an open KVCache"):
            call()


def test_a_finished_forward_cannot_be_entered_again(two_sessions: tuple) -> None:
    cache, a, _ = two_sessions
    fwd = a.prepare_forward(("cond",), TWO_SESSIONS_SPEC.chunk_size, True)
    write_every_layer(fwd.layers)
    fwd.commit()
    with pytest.raises(ForwardFinishedError, match="committed"):
        with fwd:
            pass


def test_reading_a_cross_cache_never_populated_raises(two_sessions: tuple) -> None:
    cache, a, b = two_sessions
    with pytest.raises(CrossAttentionNotPopulatedError):
        b.get_cross_attention_kv("uncond", "text")


@pytest.mark.parametrize(
    "seq_len,lengths,text",
    [
        (7, (4, 2), "expected sum(chunk_lengths)=6, got 7"),
        (5, (4, 1), "expected multiples of page_size=2"),
        (8, (8,), "in [2, chunk_size=4], got [8]"),
        (4, "22", "expected a sequence of token counts, got str"),
        (6, (4, 4), "expected sum(chunk_lengths)=8, got 6"),
        (3, None, "for mixed chunk sizes pass chunk_lengths"),
    ],
)
def test_bad_chunk_lengths_raise_and_change_nothing(
    seq_len: int, lengths, text: str, two_sessions: tuple  # noqa: ANN001
) -> None:
    from ardiff_modules.errors import SequenceLengthError

    cache, a, _ = two_sessions
    before = session_snapshot(cache)
    with pytest.raises(SequenceLengthError) as info:
        a.prepare_forward(("uncond",), seq_len, chunk_lengths=lengths)
    assert text in str(info.value), str(info.value)
    assert_sessions_unchanged(cache, before)


# ---------------------------------------------------------------------- arguments of the session API (issue 10)
def test_generator_of_streams_is_prepared_and_committed(small_cache: KVCache) -> None:
    cache = small_cache
    a, b = cache.open_session("a"), cache.open_session("b")
    with cache.prepare_forward(((s, "cond") for s in (a, b)), CHUNK, commit_current=True) as fwd:
        assert fwd.num_streams == 2
        run_layers(fwd.layers, 2)
    assert a.committed_chunks("cond") == b.committed_chunks("cond") == 1
    assert cache._allocator.num_used == 2 * SMALL_SPEC.pages_per_chunk


@pytest.mark.parametrize("value", ["no", 1, None])
def test_commit_current_must_be_a_bool(value, small_cache: KVCache) -> None:
    cache = small_cache
    s = cache.open_session("s")
    before = bookkeeping(cache)
    with pytest.raises(SpecError, match="commit_current"):
        s.prepare_forward(BOTH, CHUNK, commit_current=value)
    with pytest.raises(SpecError, match="commit_current"):
        cache.prepare_forward([(s, "cond")], CHUNK, value)
    assert bookkeeping(cache) == before


def test_branches_as_a_set_raise(small_cache: KVCache) -> None:
    cache = small_cache
    s = cache.open_session("s")
    before = bookkeeping(cache)
    with pytest.raises(SpecError):
        s.prepare_forward({"cond", "uncond"}, CHUNK)
    with pytest.raises(SpecError):
        cache.prepare_forward({(s, "cond"), (s, "uncond")}, CHUNK)
    with pytest.raises(SpecError):
        s.fork(branches={"cond"})
    assert bookkeeping(cache) == before and cache.sessions.keys() == {"s"}


def test_fork_with_one_branch_name_forks_only_that_branch(small_cache: KVCache) -> None:
    cache = small_cache
    s = cache.open_session("s")
    for branch in BOTH:
        s.populate_cross_attention(branch, "text", [(torch.ones(3, 2, 4), torch.ones(3, 2, 4))] * 2)
    commit_chunk(s)
    child = s.fork(branches="cond")
    assert child.history_chunks("cond") == s.history_chunks("cond")
    assert child.committed_chunks("cond") == 1
    assert child.history_chunks("uncond") == () and child.committed_chunks("uncond") == 0
    assert child.is_cross_attention_populated("cond", "text")
    assert not child.is_cross_attention_populated("uncond", "text")


def test_share_cross_attention_from_another_cache_raises() -> None:
    cache, other_cache = make_small_cache(), make_small_cache()
    s, other = cache.open_session("s"), other_cache.open_session("o")
    other.populate_cross_attention("cond", "text", [(torch.ones(3, 2, 4), torch.ones(3, 2, 4))] * 2)
    with pytest.raises(SpecError):
        s.share_cross_attention_from(other, "text", "cond")
    assert not s.is_cross_attention_populated("cond", "text")


@pytest.mark.parametrize("streams", ["none", "none-second", "none-session"])
def test_none_stream_raises(streams: str, small_cache: KVCache) -> None:
    cache = small_cache
    s = cache.open_session("s")
    before = bookkeeping(cache)
    bad = {"none": [None], "none-second": [(s, "cond"), None], "none-session": [(None, "cond")]}[streams]
    with pytest.raises(SpecError):
        cache.prepare_forward(bad, CHUNK)
    assert bookkeeping(cache) == before


@pytest.mark.parametrize("pending_chunks", [0, -1])
def test_admission_rejects_non_positive_pending_chunks(pending_chunks: int, small_cache: KVCache) -> None:
    cache = small_cache
    with pytest.raises(SpecError, match="pending_chunks"):
        cache.sessions_that_fit(pending_chunks=pending_chunks)
    with pytest.raises(SpecError, match="pending_chunks"):
        cache.can_admit(1, pending_chunks=pending_chunks)
    with pytest.raises(SpecError, match="pending_chunks"):
        cache.admit_session(pending_chunks=pending_chunks)
    assert cache.sessions == {}


def test_failed_plan_leaves_peak_and_forward_contexts_unchanged(monkeypatch, small_cache: KVCache) -> None:
    cache = small_cache
    a, b = cache.open_session("a"), cache.open_session("b")
    commit_chunk(a)
    peak, contexts, before = cache.stats().peak_pages_used, cache._forwards.num_contexts, bookkeeping(cache)

    def broken_plan(request, previous):
        raise RuntimeError("injected plan failure")

    monkeypatch.setattr(cache.backend, "plan", broken_plan)
    with pytest.raises(RuntimeError, match="injected"):
        cache.prepare_forward([(a, "cond"), (b, "cond"), (b, "uncond")], 2 * CHUNK, commit_current=True)
    assert cache.stats().peak_pages_used == peak
    assert cache._forwards.num_contexts == contexts
    assert bookkeeping(cache) == before
    monkeypatch.undo()
    commit_chunk(b)  # and the cache still works
    assert cache._forwards.num_contexts == contexts + 1
