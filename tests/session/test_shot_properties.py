"""The session state machine over caches that always pin a shot sink (``ShotSinkPolicy`` of 1-2 chunks, a bounded
window): every rule of ``tests/session/test_session_properties.py`` -- forks, re-caches, suspend/resume, files,
failures injected into commits, misbehaving policies -- interleaved with ``begin_shot`` (then the shot's chunks) and
``drop_window`` (issue 43 item 3). The main machine draws shot sinks in some examples only; this one in all.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize

from tests.support.session_machine import SessionStateMachine
from tests.support.session_machine.base import SETUP_DRAWS
from tests.support.session_model import retention_shapes


class ShotSessionStateMachine(SessionStateMachine):
    """:class:`SessionStateMachine` whose spec always has a shot sink and a window with room for it."""

    @initialize(**{
        **SETUP_DRAWS, "window": st.integers(1, 3), "shots": st.integers(1, 2),
        "shape": retention_shapes(frames=False),  # a frame group pins no shot: the main machine draws those
    })
    def setup(self, **drawn) -> None:  # type: ignore[override]
        super().setup(**drawn)


TestShotSessionStateMachine = pytest.mark.slow(ShotSessionStateMachine.TestCase)
TestShotSessionStateMachine.settings = settings(
    max_examples=max(1, settings.default.max_examples * 3 // 4),
    stateful_step_count=settings.default.stateful_step_count * 2,
)
