"""Rules: ``drop_window`` (the window released, the sinks kept) and ``begin_shot`` (a shot sink pinned by the next
commit, under ``ShotSinkPolicy``), on live sessions -- refused unchanged when the model says so."""

from __future__ import annotations

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from ardiff_modules.errors import PendingContextError, SessionClosedError, SessionSuspendedError, SpecError
from tests.support.session_model import BRANCHES, SessionModel

#: What the rules pass as ``branches``: all, one name, a sequence, a repeated name (refused).
SHOT_BRANCHES = [None, None, "cond", ("uncond",), ("uncond", "cond"), ("cond", "cond")]
#: How often a rule picks a closed session (refused) rather than an open one.
CLOSED = st.sampled_from([False, False, False, False, True])


class ShotRules:
    def m_shot_refusal(self, sm: SessionModel, names: tuple[str, ...], shots: bool) -> tuple[type, str] | None:
        """The error (and a substring of its message) ``drop_window`` / ``begin_shot`` must raise, in the
        library's order of checks; ``None``: it runs."""
        if shots and not self.shot_chunks:
            return SpecError, "pins a shot sink"
        if len(set(names)) != len(names):
            return SpecError, "expected distinct branch names"
        if sm.closed:
            return SessionClosedError, "expected an open session"
        if sm.suspended:
            return SessionSuspendedError, "expected a resident session"
        busy = [b for b in names if sm.forward[b] is not None]
        if busy:
            return PendingContextError, f"got one on {busy}"
        return None

    def m_pick(self, index: int, closed: bool) -> SessionModel:
        """An open session (a closed one when ``closed`` and there is one)."""
        pool = self.closed_sessions if closed and self.closed_sessions else self.open_sessions or self.sessions
        return self.pick(pool, index)

    def m_open_one(self, sm: SessionModel, names: tuple[str, ...], open_first: bool) -> None:
        """With ``open_first``, leave a denoising forward open on the first named branch (the call is refused)."""
        if open_first and not sm.closed and not sm.suspended and sm.forward[names[0]] is None:
            self.start_forward([(sm, names[0])], self.full(), False)

    def m_drop(self, sm: SessionModel, names: tuple[str, ...], branches) -> None:
        """``drop_window(branches)`` of ``sm``: refused unchanged as the model says, else checked and modelled."""
        refusal = self.m_shot_refusal(sm, names, shots=False)
        if refusal is not None:
            self.expect_failure(refusal[0], sm.state.drop_window, branches, match=refusal[1])
            event(f"drop_window refused: {refusal[0].__name__}")
            return
        lanes = range(sm.cm.num_lanes)
        # Each lane keeps its group's sinks (those it holds: a stream that shared sinks may hold fewer; a frame
        # lane's sink chunks only their sink frames: the model's view once the floor is set).
        before = {(b, lane): len(self.visible(sm, b, lane)) for b in names for lane in lanes}
        sm.state.drop_window(branches)
        for b in names:
            sm.floor[b] = len(sm.committed[b])
            if sm.selected[0][b] is not None or any(sel[b] is not None for sel in sm.selected):
                event("drop_window dropped a content selection")
            sm.drop_selection(b)  # the selection goes with the window
            if sm.shot[b] is not None and sm.shot[b] < len(sm.committed[b]):
                sm.shot[b] = None  # a shot that pinned chunks goes with them
        kept = {(b, lane): self.visible(sm, b, lane) for b in names for lane in lanes}
        assert all(len(kept[key]) <= self.lanes[key[1]].sinks for key in kept), kept
        dropped = sum(before[key] - len(kept[key]) for key in kept)
        for b in names:
            for lane, history in zip(lanes, sm.state._lane_pages(b)):
                assert list(history.history_chunks) == kept[b, lane] == self.chunks_visible(sm, b, lane), (
                    f"{sm.state.session_id}/{b} lane {lane}: drop_window kept {history.history_chunks}, "
                    f"expected the sinks {kept[b, lane]}"
                )
        event("drop_window released chunks" if dropped else "drop_window with nothing to release")

    @precondition(lambda self: self.sessions)
    @rule(index=st.integers(0, 8), branches=st.sampled_from(SHOT_BRANCHES), pre_steps=st.integers(0, 3),
          open_first=st.sampled_from([False, False, False, True]), closed=CLOSED)
    def drop_window(self, index: int, branches, pre_steps: int, open_first: bool, closed: bool) -> None:
        """Release every resident chunk but the sinks: their pages lose the branch's reference (the invariants
        check refcounts and the free list), the sinks and any pending chunk stay bit for bit, offsets and commit
        indices run on; refused unchanged with an open forward, suspended, closed or a repeated name."""
        sm = self.m_pick(index, closed)
        names = BRANCHES if branches is None else (branches,) if isinstance(branches, str) else branches
        if not sm.closed and not sm.suspended and pre_steps:
            self.roll(sm, tuple(dict.fromkeys(names)), pre_steps)
        self.m_open_one(sm, names, open_first)
        self.m_drop(sm, names, branches)

    @precondition(lambda self: self.sessions)
    @rule(index=st.integers(0, 8), branches=st.sampled_from(SHOT_BRANCHES), pre_steps=st.integers(0, 2),
          open_first=st.sampled_from([False, False, False, True]), closed=CLOSED, clean=st.booleans(),
          after=st.integers(0, 4))
    def begin_shot(self, index: int, branches, pre_steps: int, open_first: bool, closed: bool, clean: bool,
                   after: int) -> None:
        """The next commit begins a shot: its first ``shot_chunks`` chunks stay until the next shot (the model's
        visible set, checked by the invariants after every step); refused unchanged as ``drop_window``, and
        under a policy that pins no shot. Then, as LongLive 2.0 at a cut: the window dropped (``clean``) and the
        shot's first chunks committed (``after``)."""
        sm = self.m_pick(index, closed)
        names = BRANCHES if branches is None else (branches,) if isinstance(branches, str) else branches
        if not sm.closed and not sm.suspended and pre_steps:
            self.roll(sm, tuple(dict.fromkeys(names)), pre_steps)
        self.m_open_one(sm, names, open_first)
        refusal = self.m_shot_refusal(sm, names, shots=True)
        if refusal is not None:
            self.expect_failure(refusal[0], sm.state.begin_shot, branches, match=refusal[1])
            event(f"begin_shot refused: {refusal[0].__name__}")
            return
        before = self.snapshot()
        sm.state.begin_shot(branches)
        assert self.snapshot() == before, "begin_shot changes no page, chunk or forward"
        for b in names:
            sm.shot[b] = len(sm.committed[b])
        event("begin_shot")
        if clean:  # shot_clean_recache: the window goes before the cut chunk's clean forward
            self.m_drop(sm, names, branches)
        self.roll(sm, tuple(names), after)  # the cut chunk and the shot's next chunks: the pin against evictions
        if after > (self.window or 0) and self.shot_chunks:
            event("a shot sink outlived a full window")
