"""The checks after every step (pages, sessions, pool contents, forwards, what open forwards see) and the
teardown (closing everything frees every page)."""

from __future__ import annotations

import sys
from collections import Counter

import torch
from hypothesis.stateful import invariant

from tests.support.pool_model import same_bits
from tests.support.session_model import BRANCHES, NUM_LAYERS


class Invariants:
    # ================================================================== invariants
    @invariant()
    def pages_match_model(self) -> None:
        """Refcounts == references; pending pages exclusive; free/used partition; stats; peak."""
        for cm in self.open_caches:
            stats = cm.cache.stats()
            assert len(stats.lanes) == cm.num_lanes
            for lane in range(cm.num_lanes):
                self.lane_pages_match_model(cm, lane, stats)
            rows = list(stats.lanes.values())
            assert stats.pages_used == sum(r.pages_used for r in rows)
            assert stats.pages_free == sum(r.pages_free for r in rows)
            assert stats.peak_pages_used == sum(cm.peaks)

    def lane_pages_match_model(self, cm, lane: int, stats) -> None:  # noqa: ANN001
        """One lane: its allocator's refcounts == the model's references in it, partition, stats, peak."""
        cache_lane = cm.cache._lanes[lane]
        alloc = cache_lane.allocator
        where = f"{cm.label} lane {lane} ({cache_lane.name})"
        chunk_refs = self.chunk_references(cm, lane)
        refs = Counter(chunk_refs)
        for sm in self.sessions_of(cm):
            for b in BRANCHES:
                refs.update(sm.lane_extent[lane][b] or ())  # the extent's own reservation reference
                refs.update(sm.reserved[lane][b])  # a committing forward's reserved selection pages
                for chunk in sm.lane_pending[lane][b]:
                    shared = [p for p in chunk if chunk_refs[p] != 1]
                    assert not shared, (
                        f"{sm.state.session_id}/{b} {where}: pending pages {shared} are also referenced elsewhere"
                    )
        for page in range(alloc.num_pages):
            assert alloc.refcount(page) == refs[page], (
                f"{where} page {page}: refcount {alloc.refcount(page)}, referenced {refs[page]} time(s)"
            )
        free, used = alloc.free_pages(), alloc.used_pages()
        assert len(free) == len(set(free)), f"{where}: duplicate page in the free list {free}"
        assert not set(free) & set(used), f"{where}: pages both free and used: {set(free) & set(used)}"
        assert set(free) | set(used) == set(range(alloc.num_pages))
        alloc.check_invariants()
        row = stats.lanes[cache_lane.name]
        assert row.pages_used == len(used) and row.pages_free == len(free), where
        assert alloc.peak_used == row.peak_pages_used == cm.peaks[lane], (
            f"{where}: peak_pages_used {alloc.peak_used}, model {cm.peaks[lane]}"
        )

    @invariant()
    def sessions_match_model(self) -> None:
        for cm in self.caches:
            assert set(cm.cache.sessions) == {sm.state.session_id for sm in self.sessions_of(cm)}
        for sm in self.sessions:
            state = sm.state
            assert state.is_closed == sm.closed
            if sm.closed:
                assert state.pages_in_use() == 0
                continue
            for b in BRANCHES:
                expected = self.chunks_visible(sm, b)
                assert list(state.history_chunks(b)) == expected, (
                    f"{state.session_id}/{b}: visible {state.history_chunks(b)}, expected first "
                    f"{self.sinks} + last {self.window} of {[r.pages for r in sm.committed[b]]}"
                )
                assert list(state.pending_chunks(b)) == sm.pending[b]
                assert state.committed_chunks(b) == len(sm.committed[b])
                assert state.token_offset(b) == sm.committed_tokens(b), (
                    f"{state.session_id}/{b}: token_offset {state.token_offset(b)}, model {sm.committed_tokens(b)} "
                    f"(committed lengths {[r.tokens for r in sm.committed[b]]})"
                )
                lanes = state._lane_pages(b)
                assert len(lanes) == sm.cm.num_lanes
                for lane, history in enumerate(lanes):
                    self.lane_matches_model(sm, b, lane, history)
                tx, lib = sm.forward[b], state._open_forward(b)
                if tx is None:
                    assert lib is None, f"{state.session_id}/{b}: open forward {lib}, the model has none"
                else:
                    assert lib is tx.tx, f"{state.session_id}/{b}: open forward {lib}, expected {tx.tx}"
                    assert lib.commit_current == tx.commit and lib.num_chunks == tx.num_chunks
                    assert tx.ctx._transaction is lib
                    assert lib.members == tuple((s.state, bb) for s, bb in tx.streams)
                assert all(h.transaction is lanes[0].transaction for h in lanes), "one transaction over the lanes"
                assert state._pending[b] is lib  # the read-only 0.1 view agrees
                populated = state.is_cross_attention_populated(b, "text")
                assert populated == (b in sm.cross)
                if populated:
                    got = state.get_cross_attention_kv(b, "text")
                    assert len(got) == NUM_LAYERS
                    for layer, d in enumerate(got):
                        ek, ev = self.cross_value(sm.cross[b], layer)
                        assert torch.equal(d["k"], ek) and torch.equal(d["v"], ev)
            held = sum(
                len(c) for lane in range(sm.cm.num_lanes) for b in BRANCHES
                for c in self.visible(sm, b, lane) + sm.lane_pending[lane][b]
            )
            held += sum(len(extent[b] or ()) for extent in sm.lane_extent for b in BRANCHES)
            held += sum(len(reserved[b]) for reserved in sm.reserved for b in BRANCHES)
            assert state.pages_in_use() == held

    def lane_matches_model(self, sm, b: str, lane: int, history) -> None:  # noqa: ANN001
        """One lane of a stream: the chunks its group keeps (pages, spans, positions), pending chunks, extent; the
        stream's clock (every lane's the same)."""
        where = f"{sm.state.session_id}/{b} lane {lane}"
        g = self.lanes[lane]
        expected = self.chunks_visible(sm, b, lane)
        assert list(history.history_chunks) == expected, (
            f"{where}: visible {history.history_chunks}, expected sinks {g.sinks} + window {g.window} "
            f"(shot {g.shot_chunks}) of {[r.lane_pages(lane) for r in sm.committed[b]]}"
        )
        assert list(history.pending) == sm.lane_pending[lane][b], f"{where}: pending {history.pending}"
        assert history.committed_chunks == len(sm.committed[b]), f"{where}: {history.committed_chunks} committed"
        assert history.committed_tokens == sm.committed_tokens(b), where
        assert history.token_offset == sm.committed_tokens(b), where
        records = self.visible_data(sm, b, lane)
        assert history.history_spans() == [s for r in records for s in r.spans()], (
            f"{where}: spans {history.history_spans()}, model {[s for r in records for s in r.spans()]}"
        )
        assert history.history_positions() == [p for r in records for p in r.positions()]
        assert [len(c) * self.page for c in history.pending] == sm.pending_tokens[b]
        assert tuple(history.extent) == (sm.lane_extent[lane][b] or ()), f"{where}: extent {history.extent}"
        selected = sm.selected[lane][b]
        lib = history.selection
        assert (lib is None) == (selected is None), f"{where}: selection {lib}, model {selected}"
        if lib is not None:
            assert tuple(lib.pages) == selected.pages and lib.start == selected.start, f"{where}: selection {lib}"
            assert tuple(lib.resolved()) == selected.offsets, f"{where}: chosen {lib.resolved()}, model {selected.offsets}"
        assert tuple(history.pending_selection) == sm.reserved[lane][b], f"{where}: reserved {history.pending_selection}"

    @invariant()
    def pool_contents_match_model(self) -> None:
        """No write outside an open forward's pending pages; committed chunks keep their contents."""
        for cm in self.open_caches:
            for lane in range(cm.num_lanes):
                pool = self.pool_values(cm, lane)
                bad = cm.pools[lane].mismatched_pages(pool)
                assert not bad, f"{cm.label} lane {lane}: pages {bad} hold contents no open forward wrote there"
                for sm in self.sessions_of(cm):
                    for b in BRANCHES:
                        for rec in self.visible_data(sm, b, lane):
                            pages = list(rec.lane_pages(lane))
                            assert same_bits(pool[:, :, pages], rec.lane_data(lane)), (
                                f"{sm.state.session_id}/{b} lane {lane}: committed chunk {pages} changed since its "
                                "commit"
                            )

    @invariant()
    def forwards_match_model(self) -> None:
        """Context registry (identity, LRU order); each context's state; each tracked transaction's status."""
        for cm in self.caches:
            lib = cm.cache._forwards.contexts()
            assert cm.cache._forwards.num_contexts == len(lib) == len(cm.registry), (
                f"{cm.label}: {len(lib)} forward contexts, model {len(cm.registry)}"
            )
            assert all(a is b for a, b in zip(lib, cm.registry.values())), (
                f"{cm.label}: forward contexts {[c.streams for c in lib]}, model (LRU first) {list(cm.registry)}"
            )
        for ctx, tx in self.ctx_tx.items():
            assert ctx._released == (ctx in self.released), f"context {ctx.streams}: released={ctx._released}"
            assert ctx._transaction is tx.tx
            assert tx.tx.status == tx.status, f"forward over {ctx.streams}: {tx.tx.status}, model {tx.status}"
            assert ctx.is_active == self.model_active(ctx)
        for tx in self.txs:
            assert tx.tx.status == tx.status, f"forward over {tx.ctx.streams}: {tx.tx.status}, model {tx.status}"

    @invariant()
    def open_forwards_see_model(self) -> None:
        """Every open forward: positions, key positions, dense mask and gathered K/V == the model's (``check_view``)."""
        for cm in self.open_caches:
            for ctx in cm.registry.values():
                if self.model_active(ctx):
                    self.check_view(self.ctx_tx[ctx])

    def teardown(self) -> None:
        if sys.exc_info()[1] is not None:
            return  # a step or invariant failed (hypothesis tears down in a `finally`): do not mask its report
        for sm in self.sessions:
            sm.state.close()
        for cm in self.caches:
            for lane in cm.cache._lanes:  # every lane's pages came back
                alloc = lane.allocator
                assert alloc.num_free == alloc.num_pages, (
                    f"leak: lane {lane.name}: {alloc.used_pages()} still used after closing every session"
                )
                assert all(alloc.refcount(p) == 0 for p in range(alloc.num_pages))
                alloc.check_invariants()
            assert cm.cache.sessions == {}
            assert cm.cache._forwards.num_contexts == 0  # closing a session releases its contexts
            cm.cache.close()
        for ctx in self.ctx_tx:
            assert ctx._released and not ctx.is_active
