"""Self-Forcing / LongLive's frame settings -> chunk counts (issue 26 item 3): ``SinkWindowPolicy.from_frames``.

Their rolling buffer holds ``local_attn_size`` frames, ``sink_size`` of them never evicted, the current chunk
counted. The rule: ``window_chunks = (local_attn_size - sink_size) / F - 1`` and ``sink_chunks`` the leading
chunks the sink fills (``sink_size / F``; with a 1-frame first chunk, ``1 + (sink_size - 1) / F``). Checked
here against the buffer written independently (``tests.support.rolling_buffer``), in frames: the mapping
returns a policy exactly when some sink + window policy reproduces the buffer, and that policy is it.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ardiff_modules.core.retention import SinkWindowPolicy
from ardiff_modules.errors import SpecError
from tests.support.rolling_buffer import chunk_frames, visible_frames

from_frames = SinkWindowPolicy.from_frames


def library_frames(policy: SinkWindowPolicy, chunks: list[range]) -> list[list[int]]:
    """The frames each chunk's queries see under ``policy`` (history chunks, then the chunk itself)."""
    return [
        [f for i in policy.history_indices(c) for f in chunks[i]] + list(chunks[c]) for c in range(len(chunks))
    ]


@pytest.mark.parametrize(
    ("sink", "local", "f", "i2v", "expected"),
    [
        (3, 12, 3, False, (1, 2)),   # LongLive's t2v setting: the README's rule
        (0, 21, 3, False, (0, 6)),
        (0, None, 3, False, (0, None)),
        (3, -1, 3, False, (1, None)),  # their -1: global attention
        (1, 10, 3, True, (1, 2)),    # i2v: the sink is the 1-frame first chunk
        (1, 7, 3, True, (1, 1)),
        (0, 9, 3, True, (0, 2)),     # i2v without a sink: chunk 0 rolls out like any other
        (4, 10, 3, True, (2, 1)),    # i2v: sink = the 1-frame chunk + one 3-frame chunk
        (1, 4, 1, True, (1, 2)),     # F = 1: every chunk is one frame, both rules agree
    ],
)
def test_from_frames_maps_the_settings(sink, local, f, i2v, expected) -> None:
    policy = from_frames(sink_size=sink, local_attn_size=local, frames_per_chunk=f, independent_first_frame=i2v)
    assert (policy.sink_chunks, policy.window_chunks) == expected


@pytest.mark.parametrize(
    ("sink", "local", "f", "i2v", "message"),
    [
        (3, 12, 3, True, "expected whole leading chunks (independent_first_frame: a 1-frame first chunk, then "
                         "3-frame chunks, so 0, 1, 4, 7, ... frames), got 3 frames"),
        (2, 12, 3, True, "got 2 frames (the sink would end inside chunk 1)"),
        (4, 12, 3, False, "expected a multiple of frames_per_chunk=3 (whole chunks: 0, 3, 6, ... frames), got 4"),
        (1, 12, 3, True, "got 12 = 1 + 11 frames; the nearest chunk rules: local_attn_size=10 or 13"),
        (0, 10, 3, False, "got 10 = 0 + 10 frames; the nearest chunk rules: local_attn_size=9 or 12"),
        (3, 5, 3, False, "expected at least sink_size + frames_per_chunk = 6"),
    ],
)
def test_from_frames_refuses_frames_off_chunk_boundaries(sink, local, f, i2v, message) -> None:
    with pytest.raises(SpecError) as caught:
        from_frames(sink_size=sink, local_attn_size=local, frames_per_chunk=f, independent_first_frame=i2v)
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"frames_per_chunk": 0}, "frames_per_chunk: expected an int >= 1, got 0"),
        ({"sink_size": -1}, "sink_size: expected an int >= 0, got -1"),
        ({"local_attn_size": 0}, "local_attn_size: expected None, -1 or an int >= 1, got 0"),
        ({"local_attn_size": 12.0}, "got 12.0 (float)"),
        ({"independent_first_frame": 1}, "independent_first_frame: expected a bool, got 1"),
    ],
)
def test_from_frames_checks_its_arguments(kwargs, message) -> None:
    args = {"sink_size": 3, "local_attn_size": 12, "frames_per_chunk": 3, "independent_first_frame": False}
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        from_frames(**{**args, **kwargs})


def test_the_old_readme_rule_is_wrong_for_a_one_frame_first_chunk() -> None:
    """The README's rule before issue 26 maps (sink 3, local 12, F 3) to (1, 2) whatever the first chunk; with
    a 1-frame first chunk the buffer's sink is chunk 0 plus 2 frames of chunk 1, which (1, 2) does not see."""
    chunks = chunk_frames(8, 3, independent_first_frame=True)
    buffer = visible_frames(3, 12, chunks)
    assert library_frames(SinkWindowPolicy(3 // 3, 12 // 3 - 3 // 3 - 1), chunks) != buffer
    assert buffer[-1][:3] == [0, 1, 2]  # frames 1 and 2 (chunk 1's first two) kept as sinks, frame 3 evicted
    with pytest.raises(SpecError):
        from_frames(sink_size=3, local_attn_size=12, frames_per_chunk=3, independent_first_frame=True)


@given(
    f=st.integers(1, 4),
    sink=st.integers(0, 8),
    extra=st.integers(1, 12),
    i2v=st.booleans(),
)
def test_from_frames_returns_the_policy_that_reproduces_the_buffer_or_refuses(f, sink, extra, i2v) -> None:
    """A policy exactly when one reproduces the rolling buffer (any sink + window searched), and that one."""
    local = sink + max(f, extra)  # the buffer holds the sinks and at least the current chunk
    chunks = chunk_frames(local + 4, f, i2v)  # long enough to roll past the sinks
    buffer = visible_frames(sink, local, chunks)
    matching = [
        (s, w) for s in range(len(chunks) + 1) for w in range(len(chunks) + 1)
        if library_frames(SinkWindowPolicy(s, w), chunks) == buffer
    ]
    try:
        policy = from_frames(sink_size=sink, local_attn_size=local, frames_per_chunk=f, independent_first_frame=i2v)
    except SpecError:
        assert matching == []
    else:
        assert (policy.sink_chunks, policy.window_chunks) in matching
        assert library_frames(policy, chunks) == buffer
