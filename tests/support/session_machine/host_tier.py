"""Rules: suspending a session to the host tier and resuming it (``KVState.suspend`` / ``resume``)."""

from __future__ import annotations

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from ardiff_modules.errors import CapacityError, PendingContextError, SessionSuspendedError
from tests.support.session_model import BRANCHES, ChunkRecord, SessionModel


class HostTierRules:
    # ================================================================== rules: the host tier
    @precondition(lambda self: self.open_sessions)
    @rule(index=st.integers(0, 8), others_run=st.booleans(), victim=st.integers(0, 8))
    def suspend_and_resume(self, index: int, others_run: bool, victim: int) -> None:
        """A round trip through the host tier. Refused (nothing changed) with pending work; while suspended the
        session refuses forwards, forks and a second suspend, and its device pages are free for others (with
        ``others_run`` another session commits a chunk, so freed pages get reused); resume brings every visible
        chunk back bit for bit (the invariants check the pool against the model), shared pages shared again,
        or -- no room left -- refuses unchanged (then the suspended session is closed, dropping its host copy)."""
        sm = self.pick(self.open_sessions, index)
        state, cm = sm.state, sm.cm
        if any(sm.forward[b] is not None or sm.pending[b] for b in BRANCHES):
            self.expect_failure(PendingContextError, state.suspend, match=repr(state.session_id))
            event("suspend refused: pending work")
            return
        state.suspend()
        sm.suspended = True
        assert state.is_suspended and state.pages_in_use() == 0
        self.expect_failure(SessionSuspendedError, state.suspend)
        self.expect_failure(SessionSuspendedError, state.fork)
        self.expect_failure(
            SessionSuspendedError, state.prepare_forward, BRANCHES, self.full().seq_len, commit_current=False
        )
        others = [s for s in self.sessions_of(cm) if s is not sm and not any(s.pending[b] for b in BRANCHES)]
        if others_run and others:
            self.roll(self.pick(others, victim), BRANCHES, 1)
        records = {b: self.visible_data(sm, b) for b in BRANCHES}
        try:
            handle = state.resume()
        except CapacityError:
            event("resume refused: no device room (the session is closed instead)")
            assert state.is_suspended
            self._close_suspended(sm)
            return
        handle.wait()
        sm.suspended = False
        assert not state.is_suspended
        self._remap_resumed(sm, records)
        cm.peak = max(cm.peak, cm.cache.allocator.num_used)
        event("suspended and resumed a session")

    def _remap_resumed(self, sm: SessionModel, records: dict[str, list[ChunkRecord]]) -> None:
        """The model of a resumed session: its visible chunks now live in the pages the library reports (same
        lengths, same order, the contents they were committed with); its extent is the fresh ring."""
        for b in BRANCHES:
            chunks = list(sm.state.history_chunks(b))
            assert [len(c) for c in chunks] == [len(r.pages) for r in records[b]], (
                f"{sm.state.session_id}/{b}: resumed chunks {chunks}, model {[r.pages for r in records[b]]}"
            )
            for rec, pages in zip(records[b], chunks):
                sm.cm.pool.kv[:, :, list(pages)] = rec.data
                at = next(j for j, r in enumerate(sm.committed[b]) if r is rec)
                sm.committed[b][at] = ChunkRecord(pages, rec.tokens, rec.start, rec.data)
            sm.extent[b] = tuple(sm.state.branch_pages(b).extent) or None

    def _close_suspended(self, sm: SessionModel) -> None:
        sm.state.close()
        sm.suspended = False
        assert not sm.state.is_suspended and sm.cm.cache.host_tier.num_suspended == 0
        self.m_session_gone(sm)
        self.m_release_contexts_of(sm)
        sm.closed = True
        sm.clear_self_attention()
        sm.cross.clear()
