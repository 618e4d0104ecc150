"""Rules: suspending a session to the host tier and resuming it (``KVState.suspend`` / ``resume``)."""

from __future__ import annotations

import torch
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from ardiff_modules.errors import (
    CapacityError, CrossAttentionNotPopulatedError, PendingContextError, SessionNotSuspendedError,
    SessionSuspendedError,
)
from tests.support.session_model import BRANCHES, NUM_LAYERS, ChunkRecord, SelectedView, SessionModel

#: What a user may do to a suspended session's prompt (issue 40: the newer state wins at resume).
PROMPT_OPS = ("populate", "clear", "share_out", "share_in", "reset_keep", "query")


class HostTierRules:
    # ================================================================== rules: the host tier
    @precondition(lambda self: self.open_sessions)
    @rule(
        index=st.integers(0, 8), others_run=st.booleans(), victim=st.integers(0, 8),
        prompt_ops=st.lists(st.tuples(st.sampled_from(PROMPT_OPS), st.sampled_from(BRANCHES), st.integers(0, 8)),
                            max_size=3),
    )
    def suspend_and_resume(self, index: int, others_run: bool, victim: int, prompt_ops: list) -> None:
        """A round trip through the host tier. Refused (nothing changed) with pending work; while suspended the
        session refuses forwards, forks and a second suspend, and its device pages are free for others (with
        ``others_run`` another session commits a chunk, so freed pages get reused); its prompt stays the user's
        to change (``prompt_ops``: publish, clear, share either way, reset keeping it, read it back), the newer
        state winning at resume; resume brings every visible chunk back bit for bit (the invariants check the pool
        and the cross caches against the model), shared pages shared again, or -- no room left -- refuses
        unchanged (then the suspended session is closed, dropping its host copy); a session a reset made resident
        refuses a resume."""
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
        for op, branch, pick in prompt_ops:
            if state.is_suspended:
                self._prompt_while_suspended(sm, op, branch, pick)
        if not state.is_suspended:  # a reset made it resident
            self.expect_failure(SessionNotSuspendedError, state.resume, match=repr(state.session_id))
            event("a reset while suspended: resume refused")
            return
        records = [{b: self.visible_data(sm, b, lane) for b in BRANCHES} for lane in range(cm.num_lanes)]
        images = {(b, lane): self.m_frame_image(sm, b, lane)
                  for b in BRANCHES for lane in range(cm.num_lanes) if cm.lane_frame_slots[lane]}
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
        self.m_check_frame_layout(sm.state, images, cm, "resumed")
        self._remap_resumed(sm, records)
        for lane in range(cm.num_lanes):  # a resume takes its pages (fresh + extents) at once in every lane
            cm.peaks[lane] = max(cm.peaks[lane], cm.allocator(lane).num_used)
        event("suspended and resumed a session")

    def _prompt_while_suspended(self, sm: SessionModel, op: str, branch: str, pick: int) -> None:
        """One prompt change (or read) on the suspended ``sm``, mirrored in the model; answers as if resident."""
        state = sm.state
        others = [s for s in self.sessions_of(sm.cm) if s is not sm and not s.suspended]
        if op == "populate":
            tag = float(next(self.tags))
            state.populate_cross_attention(branch, "text", (self.cross_value(tag, layer) for layer in range(NUM_LAYERS)))
            sm.cross[branch] = tag
        elif op == "clear":
            state.clear_cross_attention()
            sm.cross.clear()
        elif op in ("share_out", "share_in") and others:
            other = self.pick(others, pick)
            source, target = (sm, other) if op == "share_out" else (other, sm)
            if branch not in source.cross:
                self.expect_failure(
                    CrossAttentionNotPopulatedError, target.state.share_cross_attention_from, source.state, "text",
                    branch,
                )
                return
            target.state.share_cross_attention_from(source.state, "text", branch)
            target.cross[branch] = source.cross[branch]
        elif op == "reset_keep":
            state.reset(keep_cross_attention=("text",))
            sm.suspended = False
            self.m_session_gone(sm)
            sm.clear_self_attention()
            assert sm.cm.cache._host_tier.num_suspended == 0 or not state.is_suspended
        elif op == "query":
            assert state.is_cross_attention_populated(branch, "text") == (branch in sm.cross)
            if branch in sm.cross:
                got = state.get_cross_attention_kv(branch, "text")
                for layer, d in enumerate(got):
                    ek, ev = self.cross_value(sm.cross[branch], layer)
                    assert torch.equal(d["k"], ek) and torch.equal(d["v"], ev)
        event(f"suspended prompt op: {op}")

    def m_check_frame_layout(self, state, images: dict, cm, how: str) -> None:  # noqa: ANN001
        """A resumed (or loaded) session's frame-slot lanes: a branch with kept chunks has a fresh extent (one run)
        and every frame in the slot it had (``images``: :meth:`m_frame_image` before), the selection too; a branch
        without any, no extent."""
        for (b, lane), image in images.items():
            history = state._lane_pages(b)[lane]
            extent, step = tuple(history.extent), cm.lane_slot_pages[lane]
            where = f"{state.session_id}/{b} lane {lane} ({how})"
            if not image[0]:
                assert not extent, f"{where}: an extent {extent} without a kept chunk"
                continue
            assert len(extent) == cm.extent_pages(lane) and list(extent) == list(range(extent[0], extent[0] + len(extent))), (
                f"{where}: extent {extent}"
            )
            laid, selection = self.m_frame_layout(image, extent, step)
            assert list(history.history_chunks) == laid, (
                f"{where}: chunks {list(history.history_chunks)}, expected {laid} (frame slots {image[1]}, extent {extent})"
            )
            if selection is not None:
                assert tuple(history.selection.pages) == selection, (
                    f"{where}: selection {history.selection.pages}, expected {selection} (slots {image[3]})"
                )
            event(f"frame extents: every frame back in its slot ({how})")

    def _remap_resumed(self, sm: SessionModel, records: list[dict[str, list[ChunkRecord]]]) -> None:
        """The model of a resumed session, lane by lane (``records[lane][b]``: the chunks the lane kept when
        suspended): its kept chunks now live in the pages the library reports for the lane (same lengths, same
        order, the contents they were committed with); its extent is the lane's fresh ring. A chunk a lane had
        evicted keeps its stale pages there (never visible again in that lane)."""
        for b in BRANCHES:
            moved: dict[int, dict[int, tuple[int, ...]]] = {}  # id(record) -> lane -> its new pages
            for lane, kept in enumerate(records):
                history = sm.state._lane_pages(b)[lane]
                chunks = list(history.history_chunks)
                selected = [r for r in kept[b] if isinstance(r, SelectedView)]  # the selection comes back too
                kept[b] = [r for r in kept[b] if not isinstance(r, SelectedView)]
                lib = history.selection
                assert (lib is None) == (not selected), f"{sm.state.session_id}/{b} lane {lane}: selection {lib}"
                if selected:
                    assert lib.resolved() == selected[0].offsets and lib.start == selected[0].start, lib
                    sm.cm.pools[lane].put(lib.pages, selected[0].data)
                    sm.selected[lane][b] = self.m_moved_selection(selected[0], tuple(lib.pages))
                    event("a resume brought a content selection back")
                assert [len(c) for c in chunks] == [len(r.lane_pages(lane)) for r in kept[b]], (
                    f"{sm.state.session_id}/{b} lane {lane}: resumed chunks {chunks}, model "
                    f"{[r.lane_pages(lane) for r in kept[b]]}"
                )
                for rec, pages in zip(kept[b], chunks):
                    sm.cm.pools[lane].put(pages, rec.lane_data(lane))
                    moved.setdefault(id(rec.base), {})[lane] = tuple(pages)
                sm.lane_extent[lane][b] = tuple(history.extent) or None
            for rec in list(sm.committed[b]):
                if id(rec) in moved:
                    self.m_relocate(sm, b, rec, moved[id(rec)])

    def _close_suspended(self, sm: SessionModel) -> None:
        sm.state.close()
        sm.suspended = False
        assert not sm.state.is_suspended and sm.cm.cache._host_tier.num_suspended == 0
        self.m_session_gone(sm)
        self.m_release_contexts_of(sm)
        sm.closed = True
        sm.clear_self_attention()
        sm.cross.clear()
