"""SinkWindowPolicy: exact-index scenarios (pure Python, no torch needed)."""

from __future__ import annotations

import pytest

from ardiff_modules.errors import SpecError
from ardiff_modules.core.retention import CommitResult, SinkWindowPolicy


@pytest.mark.parametrize(
    "sink,window,n,expected",
    [
        (2, 3, 0, []),
        (2, 3, 1, [0]),
        (2, 3, 2, [0, 1]),
        (2, 3, 4, [0, 1, 2, 3]),
        (2, 3, 5, [0, 1, 2, 3, 4]),
        (2, 3, 6, [0, 1, 3, 4, 5]),
        (2, 3, 10, [0, 1, 7, 8, 9]),
        (0, 3, 2, [0, 1]),
        (0, 3, 7, [4, 5, 6]),
        (3, 2, 2, [0, 1]),
        (3, 2, 3, [0, 1, 2]),
        (3, 2, 9, [0, 1, 2, 7, 8]),
        # window 0: only sinks are ever visible
        (0, 0, 0, []),
        (0, 0, 5, []),
        (2, 0, 1, [0]),
        (2, 0, 5, [0, 1]),
        # window None: everything stays visible
        (0, None, 0, []),
        (0, None, 4, [0, 1, 2, 3]),
        (1, None, 6, [0, 1, 2, 3, 4, 5]),
        (1, 1, 6, [0, 5]),
    ],
)
def test_visible_indices(sink, window, n, expected):
    policy = SinkWindowPolicy(sink, window)
    assert policy.history_indices(n) == expected
    assert policy.visible([f"c{i}" for i in range(n)]) == [f"c{i}" for i in expected]


def test_commit_single_chunks_sink_1_window_2():
    policy = SinkWindowPolicy(1, 2)
    r = policy.commit((), (), ["a"])
    assert r == CommitResult(("a",), (), ())
    r = policy.commit(r.sinks, r.window, ["b"])
    assert r == CommitResult(("a",), ("b",), ())
    r = policy.commit(r.sinks, r.window, ["c"])
    assert r == CommitResult(("a",), ("b", "c"), ())
    r = policy.commit(r.sinks, r.window, ["d"])
    assert r == CommitResult(("a",), ("c", "d"), ("b",))
    r = policy.commit(r.sinks, r.window, ["e"])
    assert r == CommitResult(("a",), ("d", "e"), ("c",))


def test_commit_multi_chunk_fills_sinks_first_then_evicts_oldest():
    policy = SinkWindowPolicy(1, 2)
    r = policy.commit((), (), ["a", "b", "c", "d"])
    assert r == CommitResult(("a",), ("c", "d"), ("b",))
    r = policy.commit(r.sinks, r.window, ["e", "f", "g"])
    assert r == CommitResult(("a",), ("f", "g"), ("c", "d", "e"))


def test_commit_multi_chunk_spanning_sinks():
    policy = SinkWindowPolicy(2, 1)
    r = policy.commit((), (), ["a"])
    assert r == CommitResult(("a",), (), ())
    r = policy.commit(r.sinks, r.window, ["b", "c", "d"])
    assert r == CommitResult(("a", "b"), ("d",), ("c",))


def test_commit_sink_0():
    policy = SinkWindowPolicy(0, 2)
    r = policy.commit((), (), ["a", "b"])
    assert r == CommitResult((), ("a", "b"), ())
    r = policy.commit(r.sinks, r.window, ["c"])
    assert r == CommitResult((), ("b", "c"), ("a",))


def test_commit_window_0_evicts_every_non_sink_chunk_at_once():
    policy = SinkWindowPolicy(0, 0)
    r = policy.commit((), (), ["a"])
    assert r == CommitResult((), (), ("a",))
    r = policy.commit(r.sinks, r.window, ["b", "c"])
    assert r == CommitResult((), (), ("b", "c"))

    policy = SinkWindowPolicy(1, 0)
    r = policy.commit((), (), ["a", "b"])
    assert r == CommitResult(("a",), (), ("b",))
    r = policy.commit(r.sinks, r.window, ["c"])
    assert r == CommitResult(("a",), (), ("c",))


def test_commit_window_none_never_evicts():
    policy = SinkWindowPolicy(1, None)
    r = policy.commit((), (), ["a", "b"])
    for name in "cdefg":
        r = policy.commit(r.sinks, r.window, [name])
    assert r == CommitResult(("a",), tuple("bcdefg"), ())


def test_commit_of_nothing_changes_nothing():
    policy = SinkWindowPolicy(1, 2)
    assert policy.commit(("a",), ("b", "c"), []) == CommitResult(("a",), ("b", "c"), ())


@pytest.mark.parametrize("sink,window", [(0, 0), (0, 1), (1, 0), (1, 2), (2, 3), (3, 1), (1, None), (0, None)])
@pytest.mark.parametrize("batch", [1, 2, 3])
def test_commit_matches_visible_of_full_history(sink, window, batch):
    policy = SinkWindowPolicy(sink, window)
    sinks: tuple = ()
    win: tuple = ()
    history: list[int] = []
    evicted: list[int] = []
    for step in range(12):
        new = list(range(step * batch, (step + 1) * batch))
        history.extend(new)
        r = policy.commit(sinks, win, new)
        sinks, win = r.sinks, r.window
        evicted.extend(r.evicted)
        assert list(sinks + win) == policy.visible(history)
        assert sorted(evicted + list(sinks + win)) == history  # nothing lost, nothing duplicated


@pytest.mark.parametrize(
    "sink,window,field_name",
    [(-1, 2, "sink_chunks"), (True, 2, "sink_chunks"), (1.0, 2, "sink_chunks"), (None, 2, "sink_chunks"),
     (0, -1, "window_chunks"), (0, 1.5, "window_chunks"), (0, True, "window_chunks")],
)
def test_policy_validation(sink, window, field_name):
    with pytest.raises(SpecError) as exc_info:
        SinkWindowPolicy(sink, window)
    msg = str(exc_info.value)
    assert f"SinkWindowPolicy.{field_name}" in msg
    assert repr(sink if field_name == "sink_chunks" else window) in msg


@pytest.mark.parametrize(
    "sink,window,actual",
    [(0, 10**12, "window_chunks=1000000000000"), (1, 2**31 - 2, "sink_chunks=1 + window_chunks=2147483646"),
     (10**12, None, "sink_chunks=1000000000000")],
)
def test_a_window_no_int32_offset_can_index_is_refused(sink, window, actual):
    # A chunk holds at least one token: 2**31 - 1 tokens are at most 2**31 - 2 resident chunks + 1 pending.
    with pytest.raises(SpecError) as exc_info:
        SinkWindowPolicy(sink, window)
    msg = str(exc_info.value)
    assert "SinkWindowPolicy: expected at most 2147483646" in msg
    assert "int32" in msg and actual in msg
    assert SinkWindowPolicy(0, 2**31 - 2).max_history_chunks == 2**31 - 2
