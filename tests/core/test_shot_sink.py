"""``ShotSinkPolicy`` and a branch's shot / dropped window in the core (pure Python, no torch), against list
operations (``tests.support.pool_model.shot_visible``) and the ``RetentionPolicy`` contract (issue 43 item 3)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ardiff_modules import ShotSinkPolicy, SpecError
from ardiff_modules.core.allocator import PageAllocator
from ardiff_modules.core.branch import BranchPages, drop_windows
from ardiff_modules.core.retention import RetentionPolicy, ShotRetentionPolicy, pins_shots, retain
from tests.support.policies import contract_holds
from tests.support.pool_model import shot_visible

shot_policies = st.builds(
    lambda s, w, k: ShotSinkPolicy(s, w, min(k, w) if w is not None else k),
    st.integers(0, 3), st.one_of(st.none(), st.integers(0, 4)), st.integers(0, 2),
)
#: A branch's life: commit 1-2 chunks, begin a shot, drop the window.
events = st.lists(st.sampled_from(["commit", "commit", "commit2", "shot", "drop"]), min_size=1, max_size=40)


@given(shot_policies, st.integers(0, 40), st.one_of(st.none(), st.integers(0, 40)))
def test_every_answer_keeps_the_contract(policy: ShotSinkPolicy, n: int, shot_start: int | None) -> None:
    assert isinstance(policy, RetentionPolicy) and isinstance(policy, ShotRetentionPolicy) and pins_shots(policy)
    answer = policy.shot_history_indices(n, shot_start)
    offered = policy.shot_history_indices(n - 1, shot_start) if n else []
    assert contract_holds(answer, n, offered, max(0, n - 1), policy.sink_chunks, policy.max_history_chunks)
    assert policy.shot_history_indices(n, None) == policy.history_indices(n)
    if shot_start is not None and policy.window_chunks is not None:
        pinned = [i for i in range(max(shot_start, policy.sink_chunks), min(shot_start + policy.shot_chunks, n))]
        assert set(pinned) <= set(answer)  # the shot sink is resident whatever its age


@settings(max_examples=300)  # pure Python: cheap, and shot moves need long scripts
@given(shot_policies, events)
def test_a_branch_follows_the_list_model_and_frees_exactly_what_it_drops(policy: ShotSinkPolicy, script: list) -> None:
    """Commits, shots and drops on a ``BranchPages`` over a real allocator: resident chunks == the list model's,
    every page freed exactly once, nothing leaked at the end."""
    allocator = PageAllocator(400)
    branch = BranchPages(policy, 1, 1)
    committed: list[int] = []  # commit index of every chunk (the model)
    floor, shot, applied = 0, None, None  # the model's dropped window, shot, and the shot the last commit applied
    for event in script:
        if event == "shot":
            branch.begin_shot()
            shot = len(committed)
        elif event == "drop":
            freed = drop_windows([branch], allocator)
            expected = shot_visible(
                committed, policy.sink_chunks, policy.window_chunks, policy.shot_chunks, floor, applied
            )
            assert len(freed) == len(expected) - min(policy.sink_chunks, len(committed))
            floor = len(committed)
            shot = None if shot is not None and shot < len(committed) else shot
        else:
            count = 2 if event == "commit2" else 1
            branch.set_pending(count, allocator)
            branch.commit_pending(allocator)
            committed += list(range(len(committed), len(committed) + count))
            applied = shot
        want = shot_visible(committed, policy.sink_chunks, policy.window_chunks, policy.shot_chunks, floor, applied)
        assert list(branch.history_index) == want
        assert branch.committed_chunks == len(committed) and branch.token_offset == len(committed)
        assert allocator.num_used == len(want)
    allocator.decref(branch.referenced_pages())
    assert allocator.num_used == 0
    allocator.check_invariants()


def test_a_shot_on_a_policy_without_shots_reaches_retain_as_its_error() -> None:
    """``retain`` asks ``shot_history_indices`` only with a shot; a policy without it fails as a policy error."""
    from ardiff_modules import SinkWindowPolicy

    with pytest.raises(SpecError, match=r"SinkWindowPolicy.shot_history_indices\(3, 1\): expected an answer"):
        retain(SinkWindowPolicy(1, 2), (), (), 0, ["a", "b", "c"], shot_start=1)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((1, 1, 2), r"shot_chunks: expected at most window_chunks=1 \(the shot sink takes its room from the window\), "
                    r"got 2"),
        ((1, 2, -1), "ShotSinkPolicy.shot_chunks"),
        ((1, 2, True), "ShotSinkPolicy.shot_chunks"),
        ((-1, 2, 1), "ShotSinkPolicy.sink_chunks"),
        ((1, 2**40, 1), "expected at most"),
    ],
)
def test_bad_declarations_name_expected_and_actual(args: tuple, match: str) -> None:
    with pytest.raises(SpecError, match=match):
        ShotSinkPolicy(*args)


def test_the_docstring_example() -> None:
    policy = ShotSinkPolicy(1, 3, 1)
    assert policy.shot_history_indices(8, 4) == [0, 4, 6, 7]
    assert policy.pinned(8, 4) == range(4, 5) and policy.pinned(8, None) == range(0)
    assert ShotSinkPolicy(1, None, 1).shot_history_indices(5, 2) == [0, 1, 2, 3, 4]


def test_moving_a_shot_never_asks_back_a_chunk_the_last_shot_evicted() -> None:
    """Found by the session machine: with ``shot_chunks=2`` a window that shrank chunk by chunk as the shot's chunks
    arrived evicted chunk 2, and the next shot (one chunk committed, more room) asked for it back. The shot's room is
    reserved whole from its first commit, so nothing evicted is wanted again."""
    policy = ShotSinkPolicy(0, 2, 2)
    allocator, branch = PageAllocator(16), BranchPages(policy, 1, 1)
    branch.begin_shot()
    for _ in range(3):
        branch.set_pending(1, allocator)
        branch.commit_pending(allocator)
    assert branch.history_index == (0, 1)  # the shot's two chunks fill the window: chunk 2 evicted
    branch.begin_shot()
    branch.set_pending(1, allocator)
    branch.commit_pending(allocator)  # raised SpecError ("[2] already evicted") before the fix
    assert branch.history_index == (3,)
    assert policy.shot_history_indices(3, 3) == policy.history_indices(3)  # none of the shot committed yet
