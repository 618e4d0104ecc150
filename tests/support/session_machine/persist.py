"""Rules: saving a session to a file and loading it back (``KVCache.save_sessions`` / ``load_sessions``)."""

from __future__ import annotations

import os
import tempfile

import torch
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from ardiff_modules.errors import CapacityError, PendingContextError, SessionIdClashError
from tests.support.pool_model import same_bits
from tests.support.session_model import BRANCHES, NUM_LAYERS, SelectedView


class PersistRules:
    # ================================================================== rules: sessions in files
    @precondition(lambda self: self.open_sessions)
    @rule(index=st.integers(0, 8))
    def save_and_load_a_copy(self, index: int) -> None:
        """Save a session and load the file back as a copy beside it. A save with pending work is refused, a load
        under the session's own id (a clash) or without room is refused, each changing nothing; the copy sees
        what the model says the session sees -- every visible chunk bit for bit, positions, the prompt -- and
        closing it leaves the cache as the model has it."""
        sm = self.pick(self.open_sessions, index)
        state, cache = sm.state, sm.cm.cache
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "session.safetensors")
            if any(sm.forward[b] is not None or sm.pending[b] for b in BRANCHES):
                save = cache.save_sessions
                self.expect_failure(PendingContextError, save, path, [state], match=repr(state.session_id))
                assert not os.path.exists(path)
                event("save refused: pending work")
                return
            cache.save_sessions(path, [state])
            images = {(b, lane): self.m_frame_image(sm, b, lane)
                      for b in BRANCHES for lane in range(sm.cm.num_lanes) if sm.cm.lane_frame_slots[lane]}
            self.expect_failure(SessionIdClashError, cache.load_sessions, path, match=repr(state.session_id))
            copy_id = f"{state.session_id}-copy"
            try:
                before = self.snapshot()
                [copy] = cache.load_sessions(path, [copy_id])
            except CapacityError:
                after = self.snapshot()
                assert after == before, f"a load refused for room changed state: {self.diff(before, after)}"
                event("load refused: no room")
                return
        self.m_check_frame_layout(copy, images, sm.cm, "loaded")
        for lane in range(sm.cm.num_lanes):  # a load takes its pages at once in every lane
            sm.cm.peaks[lane] = max(sm.cm.peaks[lane], sm.cm.allocator(lane).num_used)
        for b in BRANCHES:
            assert copy.token_offset(b) == state.token_offset(b)
            assert copy.history_chunk_indices(b) == state.history_chunk_indices(b)
            mine, theirs = copy.branch_pages(b), state.branch_pages(b)  # the shot and the dropped window too
            assert (mine.shot_start, mine.window_floor) == (theirs.shot_start, theirs.window_floor)
            for lane in range(sm.cm.num_lanes):  # each lane: the chunks its group keeps, in fresh pages
                pool = self.pool_values(sm.cm, lane)  # what the pool holds, as the model compares it (FP8 included)
                history = copy._lane_pages(b)[lane]
                assert history.committed_tokens == state.token_offset(b)
                chunks = history.history_chunks
                records = self.visible_data(sm, b, lane)
                assert history.history_spans() == [s for r in records for s in r.spans()]
                selected = [r for r in records if isinstance(r, SelectedView)]  # the selection travels too
                records = [r for r in records if not isinstance(r, SelectedView)]
                lib = history.selection
                assert (lib is None) == (not selected), f"{copy_id}/{b} lane {lane}: loaded selection {lib}"
                if selected:
                    chunks = (*chunks, tuple(lib.pages))
                    records.append(selected[0])
                    assert lib.resolved() == selected[0].offsets and lib.start == selected[0].start, lib
                    event("a file carried a content selection")
                assert [len(c) for c in chunks] == [len(r.lane_pages(lane)) for r in records], (
                    f"{copy_id}/{b} lane {lane}: loaded {chunks}, model {[r.lane_pages(lane) for r in records]}"
                )
                for pages, rec in zip(chunks, records):
                    assert same_bits(pool[:, :, list(pages)], rec.lane_data(lane)), (
                        f"{copy_id}/{b} lane {lane}: loaded chunk {pages} differs from what was committed"
                    )
                    # the model: the load wrote the chunk's bytes into fresh pages
                    sm.cm.pools[lane].copy(rec.lane_pages(lane), pages)
            assert copy.is_cross_attention_populated(b, "text") == (b in sm.cross)
            if b in sm.cross:
                got = copy.get_cross_attention_kv(b, "text")
                for layer in range(NUM_LAYERS):
                    k, v = self.cross_value(sm.cross[b], layer)
                    assert torch.equal(got[layer]["k"], k) and torch.equal(got[layer]["v"], v)
        copy.close()
        event("saved and loaded a copy")
