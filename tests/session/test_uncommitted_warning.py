"""A stream that never commits warns once per session (issue 40, item 4).

Forgetting ``commit_current=True`` raises nothing: every forward overwrites the same pending pages and the
history stays empty. Past ``UNCOMMITTED_FORWARDS_LIMIT`` forwards in a row without a commit the session
warns, once; loops that commit (denoising steps, Rolling Forcing's joint window, re-caches) never do.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.forwards.uncommitted import UNCOMMITTED_FORWARDS_LIMIT
from tests.support.recache_rig import Rig
from tests.support.small_cache import BOTH, CHUNK, bit_copy, bookkeeping, commit_chunk, make_small_cache, run_layers

LIMIT = 3  # the tests' limit (the default is checked once, below)


def _denoise(state: am.KVState, n: int = CHUNK, **kwargs: object) -> None:
    with state.prepare_forward(BOTH, n, commit_current=False, **kwargs) as fwd:
        run_layers(fwd.layers, len(BOTH), n)


def _count(cache: am.KVCache, state: am.KVState, branch: str = "cond") -> int:
    return cache._forwards.uncommitted.count(state.branch_pages(branch))


def _small(limit: int = LIMIT) -> am.KVCache:
    cache = make_small_cache()
    cache._forwards.uncommitted.limit = limit
    return cache


def test_a_stream_that_never_commits_warns_once_per_session_past_the_limit() -> None:
    cache = _small()
    first, second = cache.open_session("a"), cache.open_session("b")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(LIMIT):
            _denoise(first)
        assert caught == []
        for _ in range(3 * LIMIT):  # past the limit: one warning for the session (not per branch, not per forward)
            _denoise(first)
        for _ in range(LIMIT + 1):
            _denoise(second)  # another session warns on its own
    assert [w.category for w in caught] == [am.UncommittedForwardsWarning] * 2
    message = str(caught[0].message)
    assert f"'a'/'cond' reached {LIMIT + 1} forwards in a row with commit_current=False" in message
    assert "commit_current=True" in message
    assert "warnings.filterwarnings('ignore', category=ardiff_modules.UncommittedForwardsWarning)" in message
    assert "'b'/'cond'" in str(caught[1].message)
    assert caught[0].filename == __file__  # points at the user's prepare_forward call, not the library
    assert first.branch_pages("cond").committed_chunks == 0


def test_the_default_limit_and_the_seed_api() -> None:
    cache = make_small_cache()
    state = cache.open_session()
    with warnings.catch_warnings():
        warnings.simplefilter("error", am.UncommittedForwardsWarning)
        for _ in range(UNCOMMITTED_FORWARDS_LIMIT):  # the seed's per-branch API counts the same
            layers = state.get_kv_caches("cond", CHUNK, commit_current=False)
            run_layers(layers, 1)
            state.commit_paged_context("cond")
        with pytest.raises(am.UncommittedForwardsWarning, match=f"{UNCOMMITTED_FORWARDS_LIMIT + 1} forwards"):
            state.get_kv_caches("cond", CHUNK, commit_current=False)


def test_an_error_filter_raises_before_anything_changed() -> None:
    cache = _small()
    state = cache.open_session()
    commit_chunk(state)
    for _ in range(LIMIT):
        _denoise(state)
    before, pool = bookkeeping(cache), bit_copy(cache._pool.kv)
    with warnings.catch_warnings():
        warnings.simplefilter("error", am.UncommittedForwardsWarning)
        with pytest.raises(am.UncommittedForwardsWarning):
            state.prepare_forward(BOTH, CHUNK, commit_current=False)
    assert bookkeeping(cache) == before and torch.equal(bit_copy(cache._pool.kv), pool)
    assert _count(cache, state) == LIMIT  # the refused forward was not counted


@pytest.mark.parametrize("steps", [1, LIMIT, LIMIT + 2])
def test_denoising_loops_that_commit_never_warn(steps: int) -> None:
    """``steps`` denoising forwards, then the committing one, chunk after chunk (a commit resets the count);
    ``steps`` above the limit is a schedule longer than the limit: that one warns."""
    cache = _small()
    state = cache.open_session()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            for _ in range(steps - 1):
                _denoise(state)
            commit_chunk(state)
    assert len(caught) == (steps - 1 > LIMIT)
    assert _count(cache, state) == 0 and state.branch_pages("cond").committed_chunks == 4


def test_rolling_window_denoising_does_not_warn() -> None:
    """Rolling Forcing: joint bidirectional forwards over the window of chunks, one clean chunk committed each
    step (README "Rolling-window denoising")."""
    cache = _small()
    state = cache.open_session()
    with warnings.catch_warnings():
        warnings.simplefilter("error", am.UncommittedForwardsWarning)
        for _ in range(4 * LIMIT):
            _denoise(state, 2 * CHUNK, pending_attention="bidirectional", chunk_lengths=[CHUNK, CHUNK])
            commit_chunk(state)


def test_recache_forwards_neither_count_nor_warn() -> None:
    rig = Rig()
    rig.cache._forwards.uncommitted.limit = 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", am.UncommittedForwardsWarning)
        for _ in range(3):
            rig.step(denoise=1, check=False)
        rig.prompt()
        rig.recache(keep_sinks=True)
        rig.step(denoise=1, check=False)
    assert _count(rig.cache, rig.streams[0].state) == 0


def test_reset_restarts_the_count_of_a_stream_that_committed() -> None:
    cache = _small()
    state = cache.open_session()
    commit_chunk(state)
    for _ in range(LIMIT):
        _denoise(state)
    assert _count(cache, state) == LIMIT
    state.reset()
    assert _count(cache, state) == 0
