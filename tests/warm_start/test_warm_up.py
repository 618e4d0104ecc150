"""``warm_up``: the forwards and shapes it walks, the cache it leaves as it found it, what it refuses, and its
clean-up when the model call raises (CPU, reference backend, float32, tiny dims)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.warm_start import WARM_UP_PREFIX, WarmUpReport, walk_chunks
from tests.support.warm_rig import assert_unchanged, calls, generate, model_and_spec, populate, snapshot


def _cache(spec: am.KVCacheSpec, pages: int = 96, **kw: object) -> am.KVCache:
    return am.KVCache(spec, num_pages=pages, backend="reference", **kw)


def _warm(cache: am.KVCache, model: object, **kw: object) -> tuple[WarmUpReport, list]:
    seen = calls(model)
    with torch.no_grad():
        report = am.warm_up(cache, seen, setup_session=lambda s: populate(model, s), **kw)
    return report, seen.forwards


def _user_session(cache: am.KVCache, model: object, sid: str = "user", chunks: int = 3) -> am.KVState:
    """A session with history (through an eviction for the small windows) and kept pending pages."""
    state = cache.open_session(sid)
    populate(model, state, seed=1)
    generate(cache, model, [state], [cache.spec.chunk_size] * chunks, seed=2)
    with torch.no_grad(), state.prepare_forward(None, cache.spec.chunk_size, commit_current=False) as fwd:
        model(torch.randn(len(cache.spec.branches), cache.spec.chunk_size, 32), fwd.layers)  # pending pages kept
    return state


# ------------------------------------------------------------------ what it walks
@pytest.mark.parametrize(
    ("geometry", "sessions", "lengths", "chunks", "history_chunks"),
    [
        (dict(sink=1, window=2), 1, None, 4, [0, 1, 2, 3]),                        # sinks + window + 1
        (dict(sink=0, window=1), 1, None, 2, [0, 1]),                              # sink 0
        (dict(sink=2, window=0), 1, None, 3, [0, 1, 2]),                           # window 0: sinks only
        (dict(sink=1, window=1, chunk=9, page=3), 1, None, 3, [0, 1, 2]),          # awkward page size
        (dict(sink=1, window=2, chunk=6, page=1), 1, None, 4, [0, 1, 2, 3]),       # one-token pages
        (dict(sink=1, window=2, branches=("main",)), 1, None, 4, [0, 1, 2, 3]),    # one branch
        (dict(sink=1, window=2), 2, None, 4, [0, 1, 2, 3]),                        # one session and two batched
        (dict(sink=1, window=1), (1, 2, 3), None, 3, [0, 1, 2]),                  # every batch size listed
    ],
)
def test_walks_every_chunk_until_the_window_is_full_and_one_chunk_was_evicted(
    geometry: dict, sessions: int | tuple[int, ...], lengths: None, chunks: int, history_chunks: list[int]
) -> None:
    model, spec = model_and_spec(**geometry)
    cache = _cache(spec)
    report, forwards = _warm(cache, model, sessions=sessions)
    batches = (1, sessions) if sessions == 2 else (sessions if isinstance(sessions, tuple) else (1,))
    streams = len(spec.branches)
    assert [(s.sessions, s.streams, s.chunks) for s in report.stages] == [(n, n * streams, chunks) for n in batches]
    assert report.forwards == len(forwards) == len(batches) * chunks * 2  # one denoising + one commit per chunk
    expected = [(n * streams, spec.chunk_size, commit) for n in batches for _ in range(chunks) for commit in (0, 1)]
    assert forwards == expected
    for stage in report.stages:
        commits = [s for s in stage.shapes if s.commit]
        assert [s.history_tokens for s in commits] == [h * spec.chunk_size for h in history_chunks]
        assert len(stage.shapes) == 2 * chunks and stage.seconds > 0
        assert commits[-1].visible_keys == (history_chunks[-1] + 1) * spec.chunk_size
    assert chunks == walk_chunks(spec.policy)
    assert not cache.sessions and cache._allocator.num_used == 0 and cache._forwards.num_contexts == 0


def test_variable_first_chunk_lengths_and_more_denoising_forwards() -> None:
    model, spec = model_and_spec(chunk=4, page=2, sink=1, window=2)
    cache = _cache(spec)
    report, forwards = _warm(cache, model, chunk_lengths=(2, 4), denoising_forwards=3)
    assert [n for _, n, _ in forwards] == [2] * 4 + [4] * 12
    assert [c for _, _, c in forwards] == [False, False, False, True] * 4
    commits = [s for s in report.shapes if s.commit]
    assert [(s.seq_len, s.history_tokens) for s in commits] == [(2, 0), (4, 2), (4, 6), (4, 10)]  # the sink is short


def test_denoising_forwards_zero_commits_every_forward() -> None:
    model, spec = model_and_spec()
    report, forwards = _warm(_cache(spec), model, denoising_forwards=0)
    assert all(commit for _, _, commit in forwards) and report.forwards == 4


def test_a_memory_policy_walks_until_its_longest_history_and_an_eviction() -> None:
    # sink 1 + window 1 + every other evicted chunk (the last 1): the history is full (3) from the 4th chunk on.
    model, spec = model_and_spec(sink=0, window=None, retention=am.SinkWindowMemoryPolicy(1, 1, 2, 1))
    report, _ = _warm(_cache(spec), model)
    assert [s.history_tokens // 4 for s in report.shapes if s.commit] == [0, 1, 2, 3]
    assert walk_chunks(am.SinkWindowMemoryPolicy(1, 1, 2, 1)) == 4 > 1 + 1 + 1


def test_an_unbounded_window_walks_max_chunks() -> None:
    model, spec = model_and_spec(sink=1, window=None)
    report, _ = _warm(_cache(spec), model, max_chunks=5)
    assert [s.history_tokens // 4 for s in report.shapes if s.commit] == [0, 1, 2, 3, 4]


def test_max_chunks_overrides_the_walk() -> None:
    model, spec = model_and_spec(sink=1, window=2)
    report, forwards = _warm(_cache(spec), model, max_chunks=6, branches=("cond",))
    assert report.stages[0].chunks == 6 and report.stages[0].streams == 1 and len(forwards) == 12
    assert [s.history_tokens // 4 for s in report.shapes if s.commit] == [0, 1, 2, 3]  # distinct: full from 3 on


# ------------------------------------------------------------------ the cache afterwards
@pytest.mark.parametrize("extents", [False, True])
def test_leaves_pages_sessions_free_order_and_user_kv_byte_identical(extents: bool) -> None:
    model, spec = model_and_spec(sink=1, window=2)
    cache = _cache(spec, pages=160, contiguous_extents=extents)
    twin = _cache(spec, pages=160, contiguous_extents=extents)  # never warmed up
    users = [_user_session(c, model, sid) for c in (cache, twin) for sid in ("a", "b")]
    before = snapshot(cache)
    report, _ = _warm(cache, model, sessions=3, chunk_lengths=(2, 4))
    assert report.peak_pages_used >= cache._allocator.num_used  # (the one thing left: the high-water mark)
    assert_unchanged(cache, before)
    # The sessions go on as if nothing happened: same outputs, same page ids as in the twin cache.
    for (mine, theirs) in ((users[0], users[2]), (users[1], users[3])):
        out = generate(cache, model, [mine], [4] * 3, seed=5)
        ref = generate(twin, model, [theirs], [4] * 3, seed=5)
        for a, b in zip(out, ref):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert mine.history_chunks("cond") == theirs.history_chunks("cond")
    new = cache.open_session("c")
    assert cache._allocator.free_pages() == twin._allocator.free_pages()
    new.close()


def test_scratch_ids_cannot_collide_and_are_gone_after() -> None:
    model, spec = model_and_spec()
    cache = _cache(spec)
    seen_ids: list[tuple[str, ...]] = []

    def setup(state: am.KVState) -> None:
        populate(model, state)
        seen_ids.append(tuple(cache.sessions))

    user = cache.open_session("session-0")
    with torch.no_grad():
        am.warm_up(cache, calls(model), setup_session=setup, sessions=2)
        am.warm_up(cache, calls(model), setup_session=setup, sessions=2)  # twice: fresh ids again
    scratch = {sid for ids in seen_ids for sid in ids if sid != "session-0"}
    assert len(scratch) == 4 and all(sid.startswith(WARM_UP_PREFIX) for sid in scratch)
    assert tuple(cache.sessions) == ("session-0",) and cache.open_session().session_id == "session-1"
    user.close()


def test_the_allocator_peak_is_the_one_thing_left() -> None:
    model, spec = model_and_spec(sink=1, window=2)
    cache = _cache(spec)
    report, _ = _warm(cache, model, sessions=2)
    assert cache.stats().peak_pages_used == report.peak_pages_used == 2 * 2 * 4 * 2  # 2 sessions x 2 branches x 4 chunks
    cache._allocator.reset_peak()
    assert cache.stats().peak_pages_used == 0


def test_debug_log_line(caplog: pytest.LogCaptureFixture) -> None:
    model, spec = model_and_spec()
    with caplog.at_level(logging.DEBUG, logger="ardiff_modules.warm_start"):
        _warm(_cache(spec), model)
    assert any("warm-up: 8 forwards, 8 distinct shapes" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------ refusals: nothing changed
def _refused(cache: am.KVCache, error: type[BaseException], match: str | None, **kw: object) -> pytest.ExceptionInfo:
    model = kw.pop("model")
    before = snapshot(cache)
    run = kw.pop("run_forward", calls(model))
    kw.setdefault("setup_session", lambda s: populate(model, s))
    with pytest.raises(error, match=match) as info:
        am.warm_up(cache, run, **kw)  # type: ignore[arg-type]
    assert_unchanged(cache, before)
    return info


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        (dict(run_forward=3), am.SpecError, r"warm_up.run_forward: expected a callable, got int"),
        (dict(setup_session="x"), am.SpecError, r"warm_up.setup_session: expected a callable, got str"),
        (dict(branches=("cond", "nope")), am.errors.UnknownBranchError, r"unknown KV branch\(es\) \['nope'\]"),
        (dict(branches=("cond", "cond")), am.SpecError, r"expected distinct branch names"),
        (dict(branches=()), am.SpecError, r"expected distinct branch names, got \[\]"),
        (dict(branches={"cond"}), am.SpecError, r"ordered sequence"),
        (dict(sessions=0), am.SpecError, r"warm_up.sessions: expected an int >= 1, got 0"),
        (dict(sessions=True), am.SpecError, r"warm_up.sessions"),
        (dict(sessions=[]), am.SpecError, r"non-empty sequence"),
        (dict(sessions=(1, 0)), am.SpecError, r"warm_up.sessions\[\]: expected an int >= 1, got 0"),
        (dict(chunk_lengths=(3,)), am.errors.SequenceLengthError, r"multiples of page_size=2 in \[2, chunk_size=4\], got \[3\]"),
        (dict(chunk_lengths=(2, 8)), am.errors.SequenceLengthError, r"got \[2, 8\]"),
        (dict(chunk_lengths=()), am.errors.SequenceLengthError, r"got \[\]"),
        (dict(chunk_lengths=4), am.errors.SequenceLengthError, r"expected a sequence of token counts"),
        (dict(max_chunks=0), am.SpecError, r"warm_up.max_chunks: expected an int >= 1, got 0"),
        (dict(denoising_forwards=-1), am.SpecError, r"warm_up.denoising_forwards: expected an int >= 0"),
        (dict(static=1), am.SpecError, r"warm_up.static: expected a bool"),
    ],
)
def test_bad_arguments_are_refused_before_anything_changes(kw: dict, error: type, match: str) -> None:
    model, spec = model_and_spec()
    cache = _cache(spec)
    _user_session(cache, model)
    _refused(cache, error, match, model=model, **kw)


def test_wrong_cache_and_closed_cache() -> None:
    model, spec = model_and_spec()
    # (a cache with retention groups is a KVCache: tests/warm_start/test_warm_up_groups.py)
    with pytest.raises(am.SpecError, match="warm_up.cache: expected a KVCache, got KVCacheSpec"):
        am.warm_up(spec, calls(model))  # type: ignore[arg-type]
    cache = _cache(spec)
    cache.close()
    with pytest.raises(am.errors.CacheClosedError, match="warm_up: expected an open KVCache"):
        am.warm_up(cache, calls(model))


def test_an_unbounded_window_needs_max_chunks() -> None:
    model, spec = model_and_spec(sink=1, window=None)
    _refused(_cache(spec), am.SpecError, r"warm_up.max_chunks: expected the chunks to walk for an unbounded window",
             model=model)


def test_too_few_pages_is_a_capacity_error() -> None:
    model, spec = model_and_spec(sink=1, window=2)  # one session's peak: 2 branches x 4 chunks x 2 pages = 16
    info = _refused(_cache(spec, pages=31), am.CapacityError, r"need up to 32 pages .* only 31 are free",
                    model=model, sessions=2)
    assert (info.value.needed, info.value.free) == (32, 31)
    _warm(_cache(spec, pages=32), model, sessions=2)  # exactly enough


def test_the_open_sessions_peaks_stay_promised() -> None:
    model, spec = model_and_spec(sink=1, window=2)
    cache = _cache(spec, pages=16 + 15)  # a user session's peak (16) + one page short of a scratch session
    state = cache.open_session("user")
    populate(model, state, seed=1)
    generate(cache, model, [state], [4], seed=2)  # holds 4 pages now, 16 at its peak
    info = _refused(cache, am.CapacityError, r"only 15 are free, not promised to the 1 open session", model=model)
    assert info.value.free == 15 and cache._allocator.num_free == 27
    generate(cache, model, [state], [4] * 4, seed=3)  # the user reaches its peak: the pages were kept for it


def test_the_forward_contexts_of_open_sessions_are_never_released() -> None:
    model, spec = model_and_spec()
    cache = _cache(spec, max_forward_contexts=2)
    _user_session(cache, model, "a")
    _user_session(cache, model, "b")
    _refused(cache, am.SpecError, r"room for 1 forward context\(s\) beside the 2 kept .*max_forward_contexts=2",
             model=model)
    cache.release_idle_forward_contexts()
    _warm(cache, model)


def test_an_fp8_pool_needs_fixed_scales() -> None:
    model, spec = model_and_spec(kv_dtype="float8_e4m3fn")
    cache = _cache(spec)
    _refused(cache, am.SpecError, r"FP8 pool's scales fixed .* call cache.set_kv_scales", model=model)
    cache.set_kv_scales(torch.full((spec.num_layers, 2, spec.num_kv_heads), 0.01))
    scales = cache._pool.scales.clone()
    _warm(cache, model)
    assert torch.equal(cache._pool.scales, scales)  # the dummy K/V fixed nothing
    with pytest.raises(am.errors.KVScalesFixedError):
        cache.set_kv_scales(scales)  # documented: K/V were written with them


# ------------------------------------------------------------------ failures inside: abort, close, re-raise
@pytest.mark.parametrize("at", [0, 1, 5, 9])  # first forward, first commit, mid-walk, in the batched stage
@pytest.mark.parametrize("error", [RuntimeError("model failed"), KeyboardInterrupt()])
def test_an_exception_in_run_forward_cleans_up_and_propagates(at: int, error: BaseException) -> None:
    model, spec = model_and_spec(sink=1, window=2)
    cache = _cache(spec)
    users = [_user_session(cache, model, sid) for sid in ("a", "b")]
    _refused(cache, type(error), "model failed" if isinstance(error, RuntimeError) else None,
             model=model, run_forward=calls(model, raise_at=at, error=error), sessions=2)
    out = generate(cache, model, users, [4] * 2, seed=9)  # the cache takes forwards as before
    assert len(out) == 2


def test_an_exception_in_setup_session_cleans_up() -> None:
    model, spec = model_and_spec()
    cache = _cache(spec)
    _user_session(cache, model)
    before = snapshot(cache)
    opened: list[am.KVState] = []

    def setup(state: am.KVState) -> None:
        opened.append(state)
        if len(opened) == 2:
            raise KeyboardInterrupt
        populate(model, state)

    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        am.warm_up(cache, calls(model), setup_session=setup, sessions=3)
    assert_unchanged(cache, before)
    assert all(state.is_closed for state in opened)


def test_a_commit_the_model_left_incomplete_is_refused_and_cleaned_up() -> None:
    model, spec = model_and_spec()
    cache = _cache(spec)
    before = snapshot(cache)

    def half(fwd: am.ForwardContext) -> None:  # runs the first block only
        model.blocks[0](torch.zeros(fwd.num_streams, fwd.seq_len, 32), fwd.layers[0], model.rope)

    with pytest.raises(am.errors.IncompleteForwardError), torch.no_grad():
        am.warm_up(cache, half, setup_session=lambda s: populate(model, s))
    assert_unchanged(cache, before)


def test_a_missing_prompt_is_the_models_error_and_cleaned_up() -> None:
    model, spec = model_and_spec()
    cache = _cache(spec)
    before = snapshot(cache)
    with pytest.raises(am.errors.CrossAttentionNotPopulatedError), torch.no_grad():
        am.warm_up(cache, calls(model))  # no setup_session: the model's cross-attention has nothing to read
    assert_unchanged(cache, before)


def test_static_forwards_need_flashinfer_and_leave_nothing() -> None:
    model, spec = model_and_spec()
    cache = _cache(spec)
    before = snapshot(cache)
    with pytest.raises(am.ARDiffError, match="static"), torch.no_grad():
        am.warm_up(cache, calls(model), setup_session=lambda s: populate(model, s), static=True)
    assert_unchanged(cache, before)
