"""The checks after every step (pages, sessions, pool contents, forwards, what open forwards see) and the
teardown (closing everything frees every page)."""

from __future__ import annotations

import sys
from collections import Counter

import torch
from hypothesis.stateful import invariant

from tests.support.pool_model import same_bits
from tests.support.session_model import BRANCHES, NUM_LAYERS, cross_value


class Invariants:
    # ================================================================== invariants
    @invariant()
    def pages_match_model(self) -> None:
        """Refcounts == references; pending pages exclusive; free/used partition; stats; peak."""
        for cm in self.open_caches:
            alloc = cm.cache._allocator
            chunk_refs = self.chunk_references(cm)
            refs = Counter(chunk_refs)
            for sm in self.sessions_of(cm):
                for b in BRANCHES:
                    refs.update(sm.extent[b] or ())  # the extent's own reservation reference
                    for chunk in sm.pending[b]:
                        shared = [p for p in chunk if chunk_refs[p] != 1]
                        assert not shared, (
                            f"{sm.state.session_id}/{b}: pending pages {shared} are also referenced elsewhere"
                        )
            for page in range(alloc.num_pages):
                assert alloc.refcount(page) == refs[page], (
                    f"{cm.label} page {page}: refcount {alloc.refcount(page)}, referenced {refs[page]} time(s)"
                )
            free, used = alloc.free_pages(), alloc.used_pages()
            assert len(free) == len(set(free)), f"duplicate page in the free list {free}"
            assert not set(free) & set(used), f"pages both free and used: {set(free) & set(used)}"
            assert set(free) | set(used) == set(range(alloc.num_pages))
            alloc.check_invariants()
            stats = cm.cache.stats()
            assert stats.pages_used == len(used) and stats.pages_free == len(free)
            assert alloc.peak_used == stats.peak_pages_used == cm.peak, (
                f"{cm.label}: peak_pages_used {alloc.peak_used}, model {cm.peak}"
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
                expected = self.visible(sm, b)
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
                history = state.branch_pages(b)
                assert history.committed_tokens == sm.committed_tokens(b)
                records = self.visible_data(sm, b)
                assert history.history_spans() == [(r.start, r.tokens) for r in records], (
                    f"{state.session_id}/{b}: spans {history.history_spans()}, model "
                    f"{[(r.start, r.tokens) for r in records]}"
                )
                assert history.history_positions() == [p for r in records for p in r.positions()]
                assert [len(c) * self.page for c in state.pending_chunks(b)] == sm.pending_tokens[b]
                tx, lib = sm.forward[b], state._open_forward(b)
                if tx is None:
                    assert lib is None, f"{state.session_id}/{b}: open forward {lib}, the model has none"
                else:
                    assert lib is tx.tx, f"{state.session_id}/{b}: open forward {lib}, expected {tx.tx}"
                    assert lib.commit_current == tx.commit and lib.num_chunks == tx.num_chunks
                    assert tx.ctx._transaction is lib
                    assert lib.members == tuple((s.state, bb) for s, bb in tx.streams)
                assert state._pending[b] is lib  # the read-only 0.1 view agrees
                populated = state.is_cross_attention_populated(b, "text")
                assert populated == (b in sm.cross)
                if populated:
                    got = state.get_cross_attention_kv(b, "text")
                    assert len(got) == NUM_LAYERS
                    for layer, d in enumerate(got):
                        ek, ev = cross_value(sm.cross[b], layer)
                        assert torch.equal(d["k"], ek) and torch.equal(d["v"], ev)
                assert tuple(state.branch_pages(b).extent) == (sm.extent[b] or ())
            held = sum(len(c) for b in BRANCHES for c in self.visible(sm, b) + sm.pending[b])
            held += sum(len(sm.extent[b] or ()) for b in BRANCHES)
            assert state.pages_in_use() == held

    @invariant()
    def pool_contents_match_model(self) -> None:
        """No write outside an open forward's pending pages; committed chunks keep their contents."""
        for cm in self.open_caches:
            pool = self.pool_values(cm)
            bad = cm.pool.mismatched_pages(pool)
            assert not bad, f"{cm.label}: pages {bad} hold contents no open forward wrote there"
            for sm in self.sessions_of(cm):
                for b in BRANCHES:
                    for rec in self.visible_data(sm, b):
                        assert same_bits(pool[:, :, list(rec.pages)], rec.data), (
                            f"{sm.state.session_id}/{b}: committed chunk {rec.pages} changed since its commit"
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
            alloc = cm.cache._allocator
            assert alloc.num_free == alloc.num_pages, (
                f"leak: {alloc.used_pages()} still used after closing every session"
            )
            assert all(alloc.refcount(p) == 0 for p in range(alloc.num_pages))
            alloc.check_invariants()
            assert cm.cache.sessions == {}
            assert cm.cache._forwards.num_contexts == 0  # closing a session releases its contexts
            cm.cache.close()
        for ctx in self.ctx_tx:
            assert ctx._released and not ctx.is_active
