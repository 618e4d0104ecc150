"""The session state machine: ``KVCache`` / ``KVState`` driven by random rules and compared, after every step,
with a plain model (``tests/support/session_model.py``); what it checks is described in
``tests/session/test_session_properties.py``, which runs it (``tests/fp8/test_fp8_session_properties.py`` runs it
over an FP8 pool).

One module per subject, each a mixin of the machine: ``base`` (state, setup, hooks, selection, snapshots),
``forward_model`` (predicting, preparing, checking and finishing forwards), then the rules -- ``sessions``,
``forwards``, ``failing_calls``, ``cross_attention``, ``sharing``, ``shots``, ``host_tier``, ``persist``, ``recache`` -- and
``invariants``. Hypothesis collects the rules, preconditions and invariants of every base class, in name order, so
where a rule lives does not change the machine.
"""

from __future__ import annotations

from hypothesis.stateful import precondition

from tests.support.session_machine.base import NOT_YET_WITH_GROUPS, MachineBase
from tests.support.session_machine.cross_attention import CrossAttentionRules
from tests.support.session_machine.failing_calls import FailingCallRules
from tests.support.session_machine.forward_model import ForwardModel
from tests.support.session_machine.forwards import ForwardRules
from tests.support.session_machine.host_tier import HostTierRules
from tests.support.session_machine.invariants import Invariants
from tests.support.session_machine.persist import PersistRules
from tests.support.session_machine.recache import RecacheRules
from tests.support.session_machine.sessions import CacheAndSessionRules
from tests.support.session_machine.sharing import SharingRules
from tests.support.session_machine.shots import ShotRules

__all__ = ["SessionStateMachine"]


class SessionStateMachine(
    CacheAndSessionRules,
    ForwardRules,
    FailingCallRules,
    CrossAttentionRules,
    SharingRules,
    ShotRules,
    HostTierRules,
    PersistRules,
    RecacheRules,
    Invariants,
    ForwardModel,
    MachineBase,
):
    """Every rule and check of the session API over a float32 pool (see the package docstring)."""


# Rules of capabilities not yet supported with retention groups run in uniform draws only (one place:
# NOT_YET_WITH_GROUPS in base.py; the other keys there are draws inside rules / the setup).
for _name in NOT_YET_WITH_GROUPS:
    if hasattr(SessionStateMachine, _name):
        setattr(
            SessionStateMachine, _name,
            precondition(lambda self, _n=_name: self.supports(_n))(getattr(SessionStateMachine, _name)),
        )
