"""Rules: opening and closing caches and sessions, admission, ``reset``."""

from __future__ import annotations

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from ardiff_modules.errors import CacheClosedError, CapacityError, SpecError
from tests.support.pool_model import runs_holding
from tests.support.session_model import BRANCHES, CacheModel, MAX_CACHES, MAX_OPEN_CACHES, MAX_SESSIONS, SessionModel


class CacheAndSessionRules:
    # ================================================================== rules: caches and sessions
    @precondition(
        lambda self: self.caches
        and len(self.open_caches) < MAX_OPEN_CACHES
        and (len(self.caches) < MAX_CACHES or not self.open_caches)
    )
    @rule(
        pool_chunks=st.integers(3, 18),
        extents=st.booleans(),
        max_contexts=st.sampled_from([1, 2, 3, 64]),
        check_finite=st.booleans(),
    )
    def open_cache(self, pool_chunks: int, extents: bool, max_contexts: int, check_finite: bool) -> None:
        """A second KVCache side by side (or a fresh one after close)."""
        cm = self.new_cache(pool_chunks, extents, max_contexts, check_finite)
        self.sessions.append(SessionModel(cm.cache.open_session(), cm))

    @precondition(lambda self: self.open_caches)
    @rule(index=st.integers(0, 3), twice=st.booleans())
    def close_cache(self, index: int, twice: bool) -> None:
        """``KVCache.close()``: every session closed (their forwards aborted), every page and context released."""
        cm = self.pick(self.open_caches, index)
        cm.cache.close()
        if twice:
            cm.cache.close()  # idempotent
        for sm in self.sessions_of(cm):
            self.m_session_gone(sm)
            sm.closed = True
            sm.clear_self_attention()
            sm.cross.clear()
        self.released.update(cm.registry.values())
        cm.registry.clear()
        cm.closed = True
        assert cm.cache.is_closed and cm.cache.sessions == {}
        for lane in cm.cache._lanes:
            alloc = lane.allocator
            assert alloc.num_free == alloc.num_pages and alloc.used_pages() == (), f"lane {lane.name}"
            alloc.check_invariants()
        assert cm.cache._forwards.num_contexts == 0 and cm.cache._forwards.contexts() == ()
        event("closed a KVCache")

    @precondition(lambda self: any(len(self.sessions_of(c)) < MAX_SESSIONS for c in self.open_caches))
    @rule(index=st.integers(0, 3), admit=st.booleans(), pending_chunks=st.integers(1, 2), two=st.booleans(),
          reuse_id=st.booleans())
    def open_session(self, index: int, admit: bool, pending_chunks: int, two: bool, reuse_id: bool) -> None:
        """``open_session()`` (one or two; maybe under the id of a closed session), or ``admit_session()``:
        refused (nothing changed) unless it fits at its peak."""
        cm = self.pick([c for c in self.open_caches if len(self.sessions_of(c)) < MAX_SESSIONS], index)
        if not admit:
            for _ in range(2 if two and len(self.sessions_of(cm)) + 1 < MAX_SESSIONS else 1):
                taken = {s.state.session_id for s in self.sessions_of(cm)}
                free_ids = [s.state.session_id for s in self.sessions if s.cm is cm and s.closed]
                free_ids = [sid for sid in free_ids if sid not in taken]
                if reuse_id and free_ids:
                    # A new session under a closed one's id: that id's released contexts must not come back.
                    state = cm.cache.open_session(free_ids[0])
                    event("opened a session under a closed session's id")
                else:
                    state = cm.cache.open_session()
                assert not state.is_closed and state.pages_in_use() == 0 and state.cache is cm.cache
                self.sessions.append(SessionModel(state, cm))
            return
        else:
            if self.window is None:
                self.expect_failure(SpecError, cm.cache.admit_session, pending_chunks=pending_chunks)
                self.expect_failure(SpecError, cm.cache.can_admit, 1, pending_chunks)
                return
            fits = self.sessions_that_fit(cm, pending_chunks)
            assert cm.cache.sessions_that_fit(pending_chunks) == fits
            assert cm.cache.can_admit(1, pending_chunks) == (fits >= 1)
            assert cm.cache.can_admit(2, pending_chunks) == (fits >= 2)
            if fits < 1:
                event("admission refused")
                self.expect_failure(CapacityError, cm.cache.admit_session, pending_chunks=pending_chunks)
                return
            event("admission accepted")
            state = cm.cache.admit_session(pending_chunks=pending_chunks)
        assert not state.is_closed and state.pages_in_use() == 0 and state.cache is cm.cache
        self.sessions.append(SessionModel(state, cm))

    def sessions_that_fit(self, cm: CacheModel, pending_chunks: int) -> int:
        """Admission arithmetic, per lane (the fewest any lane holds): sessions at peak (sinks + window + pending
        per branch, or the extent), plus the re-cache reserve; with extents, also the sessions whose extents the
        free runs hold beyond the extents owed to open sessions' branches that hold none yet."""
        return min(self.lane_sessions_that_fit(cm, pending_chunks, lane) for lane in range(cm.num_lanes))

    def union_chunks(self) -> int:
        """The most chunks one re-cache rebuilds over every lane: sink + window groups keep a prefix and a suffix
        (the widest sinks + the widest window); with a shot sink, which pins chunks anywhere, or a frame group, the
        lanes' sum."""
        context = self.spec.recache.context_chunks
        if any(g.shot_chunks or g.frames is not None for g in self.lanes):  # only sink + window chunk groups
            return sum(g.sinks + g.window for g in self.lanes) + context  # type: ignore[operator]
        return max(g.sinks for g in self.lanes) + max(g.window for g in self.lanes) + context  # type: ignore[type-var]

    def lane_sessions_that_fit(self, cm: CacheModel, pending_chunks: int, lane: int) -> int:
        g = self.lanes[lane]
        resident = g.sinks + g.window
        extent = cm.extent_pages(lane)  # (chunk slots, or a frame lane's frame slots)

        def per_session(pending: int) -> int:  # a frame lane's history: at most its kept frames' pages
            pages = max(self.m_history_pages(g) + pending * self.ppc, extent)
            return len(BRANCHES) * pages

        alloc = cm.allocator(lane)
        # Once for the pool: one session's re-cache beyond its peak (every branch rebuilds R chunks, less
        # the pending chunk / free ring slot the peak already counts). With several lanes one forward rebuilds
        # the union of the lanes' chunks, the ones a lane does not keep riding there as context chunks.
        rebuilt = resident if cm.num_lanes == 1 else max(resident + self.spec.recache.context_chunks, self.union_chunks())
        reserve = len(BRANCHES) * max(0, rebuilt - 1) * self.ppc
        promised = max(0, len(self.sessions_of(cm)) * per_session(1) + reserve - alloc.num_used)
        fit = max(0, (alloc.num_free - promised) // per_session(pending_chunks))
        if not cm.extents:
            return fit
        owed = sum(1 for sm in self.sessions_of(cm) for b in BRANCHES if sm.lane_extent[lane][b] is None)
        runs = runs_holding(alloc.free_pages(), extent)
        return min(fit, max(0, (runs - owed) // len(BRANCHES)))

    @precondition(lambda self: self.open_sessions)
    @rule(index=st.integers(0, 2 * MAX_SESSIONS), twice=st.booleans())
    def close(self, index: int, twice: bool) -> None:
        """``close()`` aborts every open forward the session belongs to (other sessions' streams too)."""
        sm = self.pick(self.open_sessions, index)
        sm.state.close()
        if twice:
            sm.state.close()  # idempotent
        self.m_session_gone(sm)
        self.m_release_contexts_of(sm)
        sm.closed = True
        sm.clear_self_attention()
        sm.cross.clear()
        assert sm.state.is_closed and sm.state.pages_in_use() == 0
        assert sm.state.session_id not in sm.cm.cache.sessions

    @precondition(lambda self: self.sessions)
    @rule(index=st.integers(0, 4 * MAX_SESSIONS), keep=st.sampled_from([(), ("text",), "text"]))
    def reset(self, index: int, keep) -> None:
        """Reset an open session (its open forwards aborted), or reopen a closed one (refused if its cache closed)."""
        sm = self.pick(self.sessions, index)
        if sm.closed and sm.cm.closed:
            self.expect_failure(CacheClosedError, sm.state.reset, keep_cross_attention=keep)
            return
        if sm.closed and sm.state.session_id in {s.state.session_id for s in self.sessions_of(sm.cm)}:
            event("reset refused: the closed session's id was taken")
            self.expect_failure(SpecError, sm.state.reset, keep_cross_attention=keep, match=repr(sm.state.session_id))
            return
        if sm.closed and len(self.sessions_of(sm.cm)) >= MAX_SESSIONS:
            return
        event("reset reopened a closed session" if sm.closed else "reset an open session")
        sm.state.reset(keep_cross_attention=keep)
        if not sm.closed:
            self.m_session_gone(sm)
        sm.closed = False
        sm.clear_self_attention()
        if not keep:
            sm.cross.clear()
        assert sm.state.session_id in sm.cm.cache.sessions
