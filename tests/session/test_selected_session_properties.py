"""The session state machine over caches that choose frames by content: a uniform ``SelectedFramesPolicy`` or head
groups mixing one with chunk or frame groups (``retention_shapes``' ``selected`` / ``per_head_selected``), with
every rule of ``tests/session/test_session_properties.py`` -- forks, shared sinks, re-caches, drop_window / shots,
suspend/resume, files, masks, relative sinks, failures. The model re-states the choice at each scoring commit
(``ForwardModel.m_select``: Forcing-KV's key cosine to the next frame, patch means, the best kept, ascending) from
the K/V it holds, and every check of outputs, gathered K/V, key positions, pages and pool contents covers the
selection's pages; a committing forward of several chunks and shorter chunks are refused (``SequenceLengthError``,
nothing changed). The main machine draws selected shapes in some examples only; this one in all. With ``extents``
drawn the selected (and frame) lanes have extents of frame slots: a committing forward's reserved selection takes the
lowest frame slots its pending chunk left free (else pool pages), and a scoring commit whose selection sits in the
extent, held by its branch alone, re-chooses it in place (``ForwardModel.m_in_place``).
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize

from tests.support.session_machine import SessionStateMachine
from tests.support.session_machine.base import SETUP_DRAWS
from tests.support.session_model import GEOMETRIES, retention_shapes


class SelectedSessionStateMachine(SessionStateMachine):
    """:class:`SessionStateMachine` whose spec always has a content-selected lane."""

    @initialize(**{
        **SETUP_DRAWS,
        # several pages a frame most of the time (patches of whole pages; more than one page kept)
        "geometry": st.sampled_from([(4, 1), (4, 1), *GEOMETRIES]),
        "shape": retention_shapes(only=("selected", "per_head_selected")),
    })
    def setup(self, **drawn) -> None:  # type: ignore[override]
        super().setup(**drawn)


TestSelectedSessionStateMachine = pytest.mark.slow(SelectedSessionStateMachine.TestCase)
TestSelectedSessionStateMachine.settings = settings(
    max_examples=max(1, settings.default.max_examples * 3 // 2),  # (half the examples draw few selections)
    stateful_step_count=settings.default.stateful_step_count * 2,
)
