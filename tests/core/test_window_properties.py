"""Property tests of ``SinkWindowPolicy``: the visible chunks are the first ``S`` plus the last ``W`` of *all*
chunks ever committed, computed by list slicing (``tests/support/pool_model.py``'s ``expected_visible``, pinned
here), never by asking the policy; each evicted chunk is reported once, oldest first.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ardiff_modules.errors import SpecError
from ardiff_modules.core.retention import SinkWindowPolicy
from tests.support.pool_model import expected_visible


def test_expected_visible_examples() -> None:
    # Pin the oracle itself (DESIGN.md section 1 and the window.py diagram).
    chunks = [f"c{i}" for i in range(10)]
    assert expected_visible(chunks, 2, 3) == ["c0", "c1", "c7", "c8", "c9"]
    assert expected_visible(chunks[:4], 2, 3) == ["c0", "c1", "c2", "c3"]
    assert expected_visible(chunks, 0, 0) == []
    assert expected_visible(chunks, 1, 0) == ["c0"]
    assert expected_visible(chunks, 0, None) == chunks
    assert expected_visible(chunks[:1], 3, 2) == ["c0"]


windows = st.one_of(st.none(), st.integers(0, 4))


@given(sink=st.integers(0, 3), window=windows, batches=st.lists(st.integers(0, 4), max_size=12))
def test_policy_commit_matches_list_slicing(sink: int, window: int | None, batches: list[int]) -> None:
    """Repeated ``commit`` keeps exactly first S + last W of everything committed; evicts the rest once."""
    policy = SinkWindowPolicy(sink, window)
    sinks: tuple = ()
    win: tuple = ()
    committed: list[int] = []
    evicted_all: list[int] = []
    next_id = 0
    for size in batches:
        new = list(range(next_id, next_id + size))
        next_id += size
        result = policy.commit(sinks, win, new)
        committed += new
        sinks, win = result.sinks, result.window
        evicted_all += result.evicted
        visible = expected_visible(committed, sink, window)
        assert list(sinks + win) == visible
        assert list(sinks) == committed[:sink]
        # Every chunk is either visible or evicted, never both, never twice.
        assert sorted(evicted_all + visible) == committed
        assert evicted_all == [c for c in committed if c not in visible]  # evicted oldest first
        if window is not None:
            assert len(win) <= window


@given(sink=st.integers(0, 4), window=windows, n=st.integers(0, 20))
def test_policy_visible_matches_list_slicing(sink: int, window: int | None, n: int) -> None:
    policy = SinkWindowPolicy(sink, window)
    committed = [f"c{i}" for i in range(n)]
    assert policy.visible(committed) == expected_visible(committed, sink, window)
    assert policy.history_indices(n) == expected_visible(list(range(n)), sink, window)


@pytest.mark.parametrize("sink, window", [(-1, 2), (True, 2), (1, -1), (1, 1.5), (1, False)])
def test_policy_rejects_bad_values(sink: object, window: object) -> None:
    with pytest.raises(SpecError):
        SinkWindowPolicy(sink, window)  # type: ignore[arg-type]
