"""``PhasedPolicy``: one retention policy until ``at_chunk`` chunks are committed, another from then on.

The oracle is stateful and asks only the phases: at each commit the branch keeps what the phase of the new count
keeps *of what it still holds* (plus the new chunk), frame by frame for frame phases. The policy under test
answers statelessly (``before``'s last answer restricts ``after``'s): the two must agree at every commit, and
``retain`` must accept every answer (monotone, sinks first, within the declared bound).
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

import ardiff_modules as am
from ardiff_modules.core.allocator import PageAllocator
from ardiff_modules.core.branch import BranchPages
from ardiff_modules.core.frame_retention import trims_frames
from ardiff_modules.core.head_retention import HeadRetention
from ardiff_modules.core.retention import retain
from ardiff_modules.core.shot_sink import ShotSinkPolicy
from ardiff_modules.lanes import admission_of


# ---------------------------------------------------------------------------------------------- the boundary
def test_the_switch_happens_at_the_commit_that_makes_at_chunk() -> None:
    """The docstring's example: before's answer for n < at_chunk (the forward of chunk at_chunk - 1 still sees it),
    after's from n = at_chunk (the forward of chunk at_chunk is the first to see it)."""
    policy = am.PhasedPolicy(am.SinkWindowPolicy(1, 2), am.SinkWindowPolicy(1, 1), 4)
    assert [policy.history_indices(n) for n in range(7)] == [[], [0], [0, 1], [0, 1, 2], [0, 3], [0, 4], [0, 5]]
    assert (policy.sink_chunks, policy.max_history_chunks) == (1, 3)
    assert not trims_frames(policy) and policy.frames_per_chunk is None


def test_frame_phases_trim_by_the_phase_of_the_commit() -> None:
    """Forcing-KV's Self-Forcing numbers with a late switch: sink 1 frame, the widest window 4 frames until 3
    chunks are committed, then 1 frame; chunks of 3 frames."""
    policy = am.PhasedPolicy(am.FrameWindowPolicy(1, 4, 3), am.FrameWindowPolicy(1, 1, 3), 3)
    assert trims_frames(policy) and policy.frames_per_chunk == 3 and policy.sink_frames == 1
    assert policy.history_indices(2) == [0, 1]
    assert [policy.kept_frames(i, 2) for i in (0, 1)] == [(0, 2), (0, 1, 2)]  # frames 0 and 2..5: before's
    assert policy.history_indices(3) == [0, 2]  # after: frame 0 and frame 8
    assert [policy.kept_frames(i, 3) for i in (0, 2)] == [(0,), (2,)]
    assert policy.max_kept_frames == 5  # before's 1 + 4 frames
    wide = am.PhasedPolicy(am.FrameWindowPolicy(1, 9, 3), am.FrameWindowPolicy(1, 1, 3), 3)
    assert wide.max_kept_frames == 6  # before's 10 frames capped at the 2 chunks it sees


def test_a_wider_after_never_brings_back_what_before_evicted() -> None:
    """Window 0 before, 3 after: at the switch the old chunks are gone; after's extra room fills with new ones."""
    policy = am.PhasedPolicy(am.SinkWindowPolicy(1, 0), am.SinkWindowPolicy(1, 3), 4)
    assert [policy.history_indices(n) for n in (3, 4, 5, 6, 7)] == [[0], [0, 3], [0, 3, 4], [0, 3, 4, 5], [0, 4, 5, 6]]
    frames = am.PhasedPolicy(am.FrameWindowPolicy(1, 1, 3), am.FrameWindowPolicy(1, 5, 3), 3)
    assert frames.history_indices(3) == [0, 1, 2] and frames.kept_frames(1, 3) == (2,)  # not frames 4, 5 again
    assert frames.kept_frames(0, 3) == (0,)  # frame 1, 2 went before the switch


def test_sinks_are_the_chunks_every_answer_keeps() -> None:
    """Equal sinks: those. A sink only before keeps is evicted after (and the reverse): the smaller, unless before
    keeps every chunk it ever sees (then after's: Forcing-KV's sink cut would be this)."""
    assert am.PhasedPolicy(am.SinkWindowPolicy(2, 1), am.SinkWindowPolicy(1, 1), 5).sink_chunks == 1
    assert am.PhasedPolicy(am.SinkWindowPolicy(1, 1), am.SinkWindowPolicy(2, 1), 5).sink_chunks == 1
    assert am.PhasedPolicy(am.SinkWindowPolicy(3, 0), am.SinkWindowPolicy(2, 1), 3).sink_chunks == 2
    unbounded = am.PhasedPolicy(am.SinkWindowPolicy(0, None), am.SinkWindowPolicy(0, 2), 6)
    assert unbounded.max_history_chunks == 5  # everything until the switch: the 5 chunks before it
    assert am.PhasedPolicy(am.SinkWindowPolicy(0, 2), am.SinkWindowPolicy(0, None), 6).max_history_chunks is None


@pytest.mark.parametrize("args, message", [
    ((am.SinkWindowPolicy(1, 1), am.FrameWindowPolicy(1, 1, 3), 2), r"both phases in chunks or both in frames"),
    ((am.FrameWindowPolicy(1, 1, 2), am.FrameWindowPolicy(1, 1, 3), 2),
     r"same frames_per_chunk, got before 2, after 3"),
    ((am.SinkWindowPolicy(1, 1), am.SinkWindowPolicy(1, 1), -1), r"PhasedPolicy\.at_chunk: expected an int >= 0"),
    ((am.SinkWindowPolicy(1, 1), am.SinkWindowPolicy(1, 1), 2.0), r"PhasedPolicy\.at_chunk: expected an int"),
    (((1, 1), am.SinkWindowPolicy(1, 1), 2), r"PhasedPolicy\.before: expected a RetentionPolicy"),
    ((am.SinkWindowPolicy(1, 1), ShotSinkPolicy(1, 1, 1), 2), r"PhasedPolicy\.after: expected a policy without a "
                                                              r"shot sink"),
])
def test_what_is_refused(args: tuple, message: str) -> None:
    with pytest.raises(am.SpecError, match=message):
        am.PhasedPolicy(*args)


# ---------------------------------------------------------------------------------------------- the contract
@st.composite
def chunk_policies(draw: st.DrawFn) -> am.RetentionPolicy:
    sinks = draw(st.integers(0, 3))
    window = draw(st.one_of(st.none(), st.integers(0, 4)))
    if window is not None and draw(st.booleans()):
        return am.SinkWindowMemoryPolicy(sinks, window, draw(st.integers(1, 3)), draw(st.integers(0, 2)))
    return am.SinkWindowPolicy(sinks, window)


@st.composite
def frame_policies(draw: st.DrawFn, frames: int) -> am.FrameWindowPolicy:
    return am.FrameWindowPolicy(draw(st.integers(0, 7)), draw(st.one_of(st.none(), st.integers(0, 8))), frames)


@st.composite
def phased(draw: st.DrawFn) -> am.PhasedPolicy:
    if draw(st.booleans()):
        before, after = draw(chunk_policies()), draw(chunk_policies())
    else:
        frames = draw(st.integers(1, 4))
        before, after = draw(frame_policies(frames)), draw(frame_policies(frames))
    return am.PhasedPolicy(before, after, draw(st.integers(0, 9)))


@given(policy=phased(), commits=st.integers(0, 16))
def test_every_commit_keeps_what_the_phase_keeps_of_what_is_still_held(policy: am.PhasedPolicy, commits: int) -> None:
    """One chunk a commit: the policy's answer is the stateful oracle's at every commit, retain takes it (monotone
    across the switch, sinks first, within max_history_chunks), and trimmed frames only shrink, within
    max_kept_frames."""
    frames = policy.frames_per_chunk
    held: dict[int, set[int]] = {}  # oracle: chunk -> frames still held (all frames of a chunk policy: {0})
    resident: tuple[int, ...] = ()
    for n in range(1, commits + 1):
        phase = policy.before if n < policy.at_chunk else policy.after
        candidates = {**held, n - 1: set(range(frames or 1))}
        if frames is None:
            held = {i: f for i, f in candidates.items() if i in phase.history_indices(n)}
        else:
            trimmed = {i: f & set(phase.kept_frames(i, n)) for i, f in candidates.items()}  # type: ignore[attr-defined]
            held = {i: f for i, f in trimmed.items() if f and i in phase.history_indices(n)}
        result = retain(policy, resident, resident, n - 1, [n - 1])  # raises SpecError on a contract breach
        resident = result.indices
        assert list(resident) == sorted(held) == policy.history_indices(n), (n, held)
        assert list(resident[:policy.sink_chunks]) == list(range(min(policy.sink_chunks, n)))
        if frames is not None:
            assert {i: set(policy.kept_frames(i, n)) for i in resident} == held
            if policy.max_kept_frames is not None:
                assert sum(map(len, held.values())) <= policy.max_kept_frames


@given(policy=phased(), n=st.integers(0, 16))
def test_it_answers_like_before_then_like_after_when_after_is_narrower(policy: am.PhasedPolicy, n: int) -> None:
    """Before the switch: before's answer. After it, an after of the same sinks and a window no wider (Forcing-KV's
    groups) is not restricted at all: after's answer, and after's kept frames."""
    if n < policy.at_chunk:
        assert policy.history_indices(n) == list(policy.before.history_indices(n))
        return
    before, after = policy.before, policy.after
    if type(before) is not type(after) or isinstance(after, am.SinkWindowMemoryPolicy):
        return
    fields = ("sink_frames", "window_frames") if policy.frames_per_chunk else ("sink_chunks", "window_chunks")
    sink_b, window_b = (getattr(before, f) for f in fields)
    sink_a, window_a = (getattr(after, f) for f in fields)
    if sink_a != sink_b or (window_b is not None and (window_a is None or window_a > window_b)):
        return
    assert policy.history_indices(n) == list(after.history_indices(n))
    if policy.frames_per_chunk:
        assert all(policy.kept_frames(i, n) == after.kept_frames(i, n) for i in range(n))


# ---------------------------------------------------------------------------------------------- where it plugs in
def test_a_branch_trims_by_the_phase_and_releases_exactly_the_dropped_frames() -> None:
    """BranchPages under a frame PhasedPolicy (2 pages a frame): the pages held are the kept frames', at each
    commit; the switch releases the frames the narrower window drops."""
    policy = am.PhasedPolicy(am.FrameWindowPolicy(1, 4, 3), am.FrameWindowPolicy(1, 1, 3), 3)
    allocator, branch = PageAllocator(64), BranchPages(policy, pages_per_chunk=6, chunk_size=12)
    for n in range(1, 7):
        branch.set_pending(1, allocator)
        branch.commit_pending(allocator)
        kept = {i: policy.kept_frames(i, n) for i in policy.history_indices(n)}
        assert branch.history_index == tuple(kept)
        assert allocator.num_used == 2 * sum(map(len, kept.values())), n
        allocator.check_invariants()
    assert allocator.num_used == 2 * 2  # the sink frame and the last frame


def test_head_retention_writes_and_reads_phased_groups() -> None:
    groups = {"wide": am.FrameWindowPolicy(1, 4, 3),
              "narrow": am.PhasedPolicy(am.FrameWindowPolicy(1, 4, 3), am.FrameWindowPolicy(1, 1, 3), 3),
              "chunks": am.PhasedPolicy(am.SinkWindowPolicy(1, 2), am.SinkWindowPolicy(1, 1), 4)}
    heads = HeadRetention(groups, [["wide", "wide", "wide"], ["wide", "narrow", "chunks"]])
    data = heads.to_dict()
    assert data["groups"]["chunks"] == {"before": {"sink_chunks": 1, "window_chunks": 2},
                                        "after": {"sink_chunks": 1, "window_chunks": 1}, "at_chunk": 4}
    assert HeadRetention.from_dict(data) == heads
    with pytest.raises(am.SpecError, match=r"expected keys before / after / at_chunk, got keys \['after', 'at_chu"):
        HeadRetention({"g": {"after": {"sink_chunks": 0, "window_chunks": 1}, "at_chunk": 2}}, [["g"]])


def test_admission_counts_the_larger_phase_of_kept_frames() -> None:
    """A frame lane's admission holds at most the larger phase's kept frames' pages (before capped at the chunks
    it sees), never the chunks' whole pages."""
    policy = am.PhasedPolicy(am.FrameWindowPolicy(1, 4, 3), am.FrameWindowPolicy(1, 1, 3), 3)
    spec = am.KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, chunk_size=12, page_size=2, retention=policy,
                          dtype="float32")
    admission = admission_of(spec, None)
    assert admission.max_history_chunks == 2 and admission.max_history_pages == 5 * 2
    plain = dataclasses.replace(spec, retention=am.FrameWindowPolicy(1, 4, 3))
    assert admission_of(plain, None).max_history_pages == 5 * 2
    wide = dataclasses.replace(spec, retention=am.PhasedPolicy(am.FrameWindowPolicy(1, 9, 3), policy.after, 3))
    assert admission_of(wide, None).max_history_pages == 6 * 2  # capped at the 2 chunks before the switch
