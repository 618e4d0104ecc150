"""The session state machine over caches that always count frames: a uniform ``FrameWindowPolicy`` or head groups
mixing ``FrameWindowPolicy`` and chunk groups (``retention_shapes``' ``frames`` / ``per_head_frames``), with every
rule of ``tests/session/test_session_properties.py`` -- forks, shared sinks, re-caches, suspend/resume, files, masks,
relative sinks, failures -- and shorter chunks refused (``SequenceLengthError``, nothing changed). The main machine
draws frame shapes in some examples only; this one in all. With ``extents`` drawn a frame lane's extent is one of
frame slots (``core/branch_frame_extent.py``), modelled page for page: the lowest free frame slots for each pending
chunk, overflow in pool pages, a resume / load putting each frame back in its slot, a uniform re-cache's copies into
the slots its commit frees (with groups, lane by lane: each lane's free slots, its ring copies).
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize

from tests.support.session_machine import SessionStateMachine
from tests.support.session_machine.base import SETUP_DRAWS
from tests.support.session_model import retention_shapes


class FrameSessionStateMachine(SessionStateMachine):
    """:class:`SessionStateMachine` whose spec always has a frame lane."""

    @initialize(**{**SETUP_DRAWS, "shape": retention_shapes().filter(lambda s: s[0] in ("frames", "per_head_frames"))})
    def setup(self, **drawn) -> None:  # type: ignore[override]
        super().setup(**drawn)


TestFrameSessionStateMachine = pytest.mark.slow(FrameSessionStateMachine.TestCase)
TestFrameSessionStateMachine.settings = settings(
    max_examples=max(1, settings.default.max_examples * 3 // 4),
    stateful_step_count=settings.default.stateful_step_count * 2,
)
