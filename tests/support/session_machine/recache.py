"""Rules: prompt-switch re-caches over 1-3 sessions (``keep_sinks`` either way), committed, aborted, raising
inside, or refused unchanged."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from ardiff_modules import chunk_attention
from ardiff_modules.backends.reference import ReferencePlan
from ardiff_modules.backends.segmented import RelativeSinkPlan
from ardiff_modules.errors import (
    CapacityError,
    IncompleteForwardError,
    PendingContextError,
    SequenceLengthError,
    SpecError,
)
from ardiff_modules.core.transaction import ForwardTransaction
from tests.support.pool_model import same_bits
from tests.support.failures import Boom
from tests.support.session_model import (
    BRANCH_SETS, ChunkRecord, NUM_LAYERS, SelectedView, SessionModel, Shape, TxModel,
)


class RecacheRules:
    # ================================================================== prompt-switch re-cache
    def m_recache_targets(self, sm: SessionModel, b: str, keep_sinks: bool) -> list[ChunkRecord]:
        """The visible records a re-cache rebuilds: all of them, or all but the sinks (commit order)."""
        sinks = sm.committed[b][: self.sinks] if keep_sinks else []
        return [rec for rec in self.chunk_records(sm, b) if not any(rec.base is s_ for s_ in sinks)]

    def chunk_records(self, sm: SessionModel, b: str, lane: int = 0) -> list[ChunkRecord]:
        """The committed chunks a lane keeps (a content selection is no chunk: a re-cache neither rebuilds nor attends
        it, and its commit drops it)."""
        return [r for r in self.visible_data(sm, b, lane) if not isinstance(r, SelectedView)]

    def predict_recache(self, streams: list[tuple[SessionModel, str]], keep_sinks: bool) -> type[BaseException] | None:
        cm = streams[0][0].cm
        for sm, b in streams:
            if sm.forward[b] is not None or sm.pending[b]:
                return PendingContextError
            if not self.m_recache_targets(sm, b, keep_sinks):
                return SpecError
        shapes = {tuple(r.base.tokens for r in self.m_recache_targets(sm, b, keep_sinks)) for sm, b in streams}
        if len(shapes) > 1:
            return SequenceLengthError
        if self.spec.relative_sinks and not keep_sinks:  # rebuilt sinks would sit at their natural distance
            for sm, b in streams:
                records = self.visible_data(sm, b)
                sinks = len(sm.committed[b][: self.sinks])
                if len(records) > sinks and self.m_sink_shift(records, sm, b, sm.committed_tokens(b)):
                    return SpecError
        pages = [n // self.page for n in shapes.pop()]
        if cm.lane_frame_slots[0]:  # free frame slots take a rebuilt chunk's frames (lowest first), the pool the rest
            step = cm.lane_slot_pages[0]
            need = sum(n for sm, b in streams
                       for n, c in zip(pages, self.m_place_in_frames(pages, self.free_slots(sm, b), step)) if c is None)
            return CapacityError if need > cm.cache._allocator.num_free else None
        # Free ring slots take the first rebuilt chunks (a shorter chunk a slot's first pages), the pool the rest.
        need = sum(sum(pages[len(self.free_slots(sm, b)) :]) for sm, b in streams)
        return CapacityError if need > cm.cache._allocator.num_free else None

    @precondition(lambda self: self.open_sessions)
    @rule(
        index=st.integers(0, 8),
        others=st.lists(st.integers(1, 2), max_size=2, unique=True),
        branch_sets=st.lists(st.sampled_from(BRANCH_SETS), min_size=3, max_size=3),
        keep_sinks=st.booleans(),
        pre_steps=st.integers(0, 3),
        via=st.sampled_from(["state", "cache"]),
        variant=st.sampled_from(["with", "with", "ctx.commit", "cpc", "boom", "ctx.abort", "state.abort", "plan"]),
        layers=st.sampled_from(["all", "partial"]),
    )
    def recache(
        self, index: int, others: list[int], branch_sets: list, keep_sinks: bool, pre_steps: int, via: str,
        variant: str, layers: str,
    ) -> None:
        """Prompt-switch re-cache (``prepare_recache``): rebuild the resident chunks of 1-3 sessions into free
        ring slots then fresh pages, block-causally at their original positions; commit swaps them in on every
        stream at once (offsets, indices unchanged; a fork keeps the old pages), copying those in fresh pages
        into ring slots the commit frees; abort, an exception inside the block or a ``plan()`` failure leave
        the old history bit for bit (free order included); misuse changes nothing."""
        streams = self.pick_streams(self.open_sessions, index, others, branch_sets)
        if via == "state":  # one session
            streams = [(sm, b) for sm, b in streams if sm is streams[0][0]]
        for sm in dict.fromkeys(sm for sm, _ in streams):
            self.roll(sm, tuple(b for s_, b in streams if s_ is sm), pre_steps)
        cm = streams[0][0].cm
        if via == "state":
            fn, args = streams[0][0].state.prepare_recache, (tuple(b for _, b in streams),)
        else:
            fn, args = cm.cache.prepare_recache, ([(sm.state, b) for sm, b in streams],)
        if self.grouped:
            self.recache_grouped(streams, fn, args, keep_sinks, variant, layers)
            return
        failure = self.predict_recache(streams, keep_sinks)
        if failure is not None or variant == "plan":
            cm.backend.fail = None if failure is not None else Boom
            try:
                self.expect_failure(failure or Boom, fn, *args, keep_sinks=keep_sinks)
            finally:
                cm.backend.fail = None
            event(f"re-cache refused: {(failure or Boom).__name__}")
            return
        targets = {(id(sm), b): self.m_recache_targets(sm, b, keep_sinks) for sm, b in streams}
        free_before, used_before = set(cm.cache._allocator.free_pages()), cm.cache._allocator.num_used
        before = self.snapshot()
        ctx = fn(*args, keep_sinks=keep_sinks)
        lib = ctx._transaction
        assert isinstance(lib, ForwardTransaction) and lib.is_open and lib.recache
        # The forward: fresh pages, original positions, kept sinks visible (never written), block-causal.
        lengths = tuple(r.base.tokens for r in targets[(id(streams[0][0]), streams[0][1])])
        shape = Shape(lengths)
        fresh: list[int] = []
        for i, (sm, b) in enumerate(streams):
            recs = targets[(id(sm), b)]
            new = list(sm.state.pending_chunks(b))
            assert [len(c) * self.page for c in new] == list(lengths)
            slots = self.free_slots(sm, b)  # this branch's ring: no earlier stream's pending is in it
            if cm.lane_frame_slots[0]:  # frame slots: a rebuilt (whole) chunk takes its frames' count of them
                placed = self.m_place_in_frames([len(c) for c in new], list(slots), cm.lane_slot_pages[0])
                assert all(w is None or c == w for c, w in zip(new, placed)), f"{b}: re-cache {new}, free {slots}"
                if any(w is not None for w in placed):
                    event("frame extents: a rebuilt chunk took free frame slots")
                fresh += [p for c, w in zip(new, placed) if w is None for p in c]
            else:
                ring = new[: len(slots)]
                assert ring == [slot[: len(c)] for slot, c in zip(slots, ring)], f"{b}: re-cache {new}, free slots {slots}"
                if ring:
                    event("re-cache: a rebuilt chunk took a free ring slot")
                fresh += [p for c in new[len(ring) :] for p in c]
            kept = [r for r in self.chunk_records(sm, b) if not any(r.base is t.base for t in recs)]
            positions = [p for r in recs for p in r.base.positions()]  # rebuilt whole (a frame lane trims at commit)
            assert ctx.positions[i].tolist() == positions, (ctx.positions[i].tolist(), positions)
            history = [p for r in kept for p in r.positions()]
            keys = history + positions
            got = ctx.key_positions()[i].tolist()
            assert got[: len(keys)] == keys and set(got[len(keys) :]) <= {-1}, (got, keys)
            dense = ctx.to_dense()[i]
            assert dense[:, : len(history)].all()
            assert torch.equal(dense[:, len(history) : len(keys)], shape.pending_mask())
            assert {p for r in kept for p in r.pages}.isdisjoint(ctx._layout.write_pages.tolist())
            sm.pending[b], sm.pending_tokens[b] = new, list(lengths)
        assert len(set(fresh)) == len(fresh) and set(fresh) <= free_before, "re-cache pages beyond the ring: fresh"
        cm.peak = max(cm.peak, used_before + len(fresh))
        # The registry (same streams -> same context, LRU), as for any forward.
        tx = self.m_publish(cm, list(streams), ctx, TxModel(cm, list(streams), True, shape, ctx, lib))
        # Run the layers (the op): writes land in the fresh pages only.
        plan = ctx._plan
        assert isinstance(plan, (ReferencePlan, RelativeSinkPlan)), type(plan)
        for layer in range(NUM_LAYERS if layers == "all" or cm.check_finite else 1):
            q, k, v = self.layer_inputs(ctx, layer, "op")
            chunk_attention(q, k, v, ctx.layers[layer], **self.sink_query(ctx, q))
            for i, (sm, b) in enumerate(streams):
                cm.pool.write(layer, [p for c in sm.pending[b] for p in c], k[i], v[i])
        pool = self.pool_values(cm)
        slots = pool.reshape(NUM_LAYERS, 2, -1, pool.shape[-2] * pool.shape[-1])
        for i, (sm, b) in enumerate(streams):  # gathered keys: kept sinks as committed, then the fresh pages
            recs = targets[(id(sm), b)]
            kept = [r for r in self.chunk_records(sm, b) if not any(r.base is t.base for t in recs)]
            pending = [p for c in sm.pending[b] for p in c]
            want = torch.cat(
                [r.token_data() for r in kept] + [cm.pool.pages(pending).reshape(NUM_LAYERS, 2, shape.seq_len, -1)],
                dim=2,
            )
            if isinstance(plan, RelativeSinkPlan):  # kept sinks in the sink segment, the rest in the other
                assert isinstance(plan.sinks, ReferencePlan) and isinstance(plan.rest, ReferencePlan)
                sink_keys = sum(r.tokens for r in kept)
                gathered = torch.cat([plan.sinks.gather[i, :sink_keys], plan.rest.gather[i, : want.shape[2] - sink_keys]])
            else:
                gathered = plan.gather[i, : want.shape[2]]
            assert same_bits(slots[:, :, gathered], want)
        sm0, b0 = streams[0]
        incomplete = not (layers == "all" or cm.check_finite)
        if variant in ("boom", "ctx.abort", "state.abort") or incomplete:
            if variant not in ("boom", "ctx.abort", "state.abort"):  # a commit of a partial re-cache: refused
                with pytest.raises(IncompleteForwardError):
                    finish_as(variant, ctx, sm0.state, b0)
                assert lib.status == "aborted", "a refused re-cache commit must abort it"
                event("re-cache of a partial forward refused")
            else:
                finish_as(variant, ctx, sm0.state, b0)
            for sm, b in streams:
                sm.forward[b] = None
                sm.drop_pending(b)
            tx.status = "aborted"
            after, ci = self.snapshot(), self.caches.index(cm)
            # As before -- free order and refcounts included -- but for the fresh pages' contents (written,
            # then freed: the pool model has them), the peak and the registry (a new forward was prepared).
            assert after[0][ci][0][1:3] == before[0][ci][0][1:3], "an aborted re-cache changed the free list"
            assert after[1] == before[1], "an aborted re-cache changed a session"
            event(f"re-cache aborted ({variant})")
            return
        finish_as(variant, ctx, sm0.state, b0)
        assert lib.status == "committed"
        # References once the rebuilt chunks are swapped in (every stream's old chunks let go at once): a ring
        # slot nobody references then is free, and a rebuilt chunk in fresh pages is copied into one -- the old
        # chunk's own slot first, else the lowest -- its fresh pages freed.
        if cm.lane_frame_slots[0]:
            self.m_frame_recache_commit(streams, targets)
            tx.status = "committed"
            event(f"re-cache over frame extents committed, keep_sinks={keep_sinks}")
            return
        after = self.chunk_references(cm)
        for sm, b in streams:
            after.subtract(p for rec in targets[(id(sm), b)] for p in rec.pages)
        for sm, b in streams:
            ext = set(sm.extent[b] or ())
            free = [slot for slot in self.slots_of(sm, b) if not any(after[p] for p in slot)]
            placed = list(sm.pending[b])
            moving = [j for j, c in enumerate(placed) if c[0] not in ext]
            rest = []
            for j in moving:
                own = targets[(id(sm), b)][j].pages[0]
                slot = next((sl for sl in free if sl[0] == own), None)
                if slot is None:
                    rest.append(j)
                    continue
                free.remove(slot)
                placed[j] = slot[: len(placed[j])]
                event("re-cache: rebuilt chunk copied back into its own ring slot")
            for j in rest:
                if not free:
                    if ext:
                        event("re-cache: rebuilt chunk stays outside the ring (no free slot: a fork shares the old)")
                    continue
                placed[j] = free.pop(0)[: len(placed[j])]
                event("re-cache: rebuilt chunk copied into another free ring slot")
            for src, dst in zip(sm.pending[b], placed):
                if src != dst:
                    cm.pool.copy(src, dst)
            for rec, pages in zip(targets[(id(sm), b)], placed):
                rec = rec.base
                at = next(j for j, r in enumerate(sm.committed[b]) if r is rec)
                sm.committed[b][at] = ChunkRecord(pages, rec.tokens, rec.start, cm.pool.pages(pages))
            self.m_recache_drops_selection(sm, b)
            sm.forward[b] = None
            sm.drop_pending(b)
        tx.status = "committed"
        event(f"re-cache committed over {len({id(sm) for sm, _ in streams})} session(s), keep_sinks={keep_sinks}")

    def m_frame_recache_commit(self, streams: list[tuple[SessionModel, str]], targets: dict) -> None:
        """A committed re-cache over frame extents (``frame_ring_copies``, re-stated): every stream's rebuilt chunks
        swapped in (trimmed to their kept frames at commit, the selection dropped); then, per stream in history
        order, each kept rebuilt chunk in pool pages is copied into the lowest frame slots of its extent free once
        the whole commit is applied (referenced by no chunk, selection or reservation: a fork may still hold an
        old one), its frames' count of them, while enough are left; its pool pages are freed."""
        cm = streams[0][0].cm
        swapped: dict[tuple[int, str], list[ChunkRecord]] = {}
        for sm, b in streams:
            swapped[(id(sm), b)] = []
            for rec, pages in zip(targets[(id(sm), b)], sm.pending[b]):
                rec = rec.base
                at = next(j for j, r in enumerate(sm.committed[b]) if r is rec)
                new = sm.committed[b][at] = ChunkRecord(pages, rec.tokens, rec.start, cm.pool.pages(pages))
                swapped[(id(sm), b)].append(new)
            self.m_recache_drops_selection(sm, b)
            sm.forward[b] = None
            sm.drop_pending(b)
        step = cm.lane_slot_pages[0]
        for sm, b in streams:
            extent = set(sm.extent[b] or ())
            if not extent:
                continue
            free = self.free_slots(sm, b)  # (the references once the commit is applied)
            for rec in swapped[(id(sm), b)]:
                view = next((v for v in self.visible_data(sm, b) if v.base is rec), None)
                if view is None:
                    continue
                kept = view.lane_pages(0)
                if kept[0] in extent:  # already in frame slots: never moves
                    continue
                count = -(-len(kept) // step)
                if count > len(free):
                    event("frame extents: a rebuilt chunk stays outside the extent (too few free frame slots)")
                    break
                target = tuple(p for slot in free[:count] for p in slot)[: len(kept)]
                del free[:count]
                cm.pool.copy(kept, target)
                self.m_relocate(sm, b, rec, {0: target})
                event("frame extents: a rebuilt chunk copied into free frame slots")

    def m_recache_drops_selection(self, sm: SessionModel, b: str) -> None:
        """A re-cache commit drops a content selection (its K/V are the old prompt's; the next scoring commit
        chooses again)."""
        if any(sel[b] is not None for sel in sm.selected):
            event("re-cache dropped a content selection")
        sm.drop_selection(b)

    # ================================================================== re-cache with retention groups
    def m_lane_targets(self, sm: SessionModel, b: str, keep_sinks: bool, lane: int) -> list[ChunkRecord]:
        """The chunks a lane's own plan rebuilds: those its group keeps, but its sinks with ``keep_sinks``."""
        sinks = sm.committed[b][: self.lanes[lane].sinks] if keep_sinks else []
        return [rec for rec in self.chunk_records(sm, b, lane) if not any(rec.base is s_ for s_ in sinks)]

    def m_union(self, sm: SessionModel, b: str, keep_sinks: bool) -> list[ChunkRecord]:
        """What a grouped re-cache rebuilds: the union of the lanes' rebuilt chunks, in commit order."""
        found = {id(r.base): r.base for lane in range(len(self.lanes)) for r in self.m_lane_targets(sm, b, keep_sinks, lane)}
        return sorted(found.values(), key=lambda r: r.start)

    def predict_recache_grouped(
        self, streams: list[tuple[SessionModel, str]], keep_sinks: bool
    ) -> type[BaseException] | None:
        """``lane_recache_plans`` then, lane by lane, relative sinks in place and room (``_recache_request``)."""
        cm = streams[0][0].cm
        if any(sm.forward[b] is not None or sm.pending[b] for sm, b in streams):
            return PendingContextError
        unions = [self.m_union(sm, b, keep_sinks) for sm, b in streams]
        if not all(unions):
            return SpecError
        shapes = {tuple(r.tokens for r in u) for u in unions}
        if len(shapes) > 1:
            return SequenceLengthError
        pages = [n // self.page for n in shapes.pop()]
        for lane in range(cm.num_lanes):
            if self.spec.relative_sinks:  # a rebuilt sink (another lane's target, rebuilt in place) must not move
                for (sm, b), union in zip(streams, unions):
                    records = self.visible_data(sm, b, lane)
                    sinks = records[: min(self.lanes[lane].sinks, len(sm.committed[b]))]
                    rebuilt = any(any(r.base is u for u in union) for r in sinks)
                    if sinks and rebuilt and len(records) > len(sinks):
                        if self.m_sink_shift(records, sm, b, sm.committed_tokens(b), lane):
                            return SpecError
            if sum(self.m_recache_fresh(sm, b, lane, pages) for sm, b in streams) > cm.allocator(lane).num_free:
                return CapacityError
        return None

    def m_recache_fresh(self, sm: SessionModel, b: str, lane: int, pages: list[int]) -> int:
        """Pool pages a lane's re-cache of a stream takes (``recache_fresh_pages``, re-stated): its free ring slots
        hold the first rebuilt chunks (a frame lane: each chunk its frames' count of free frame slots, lowest first,
        where enough are left), the pool the rest; plain paging (or no extent yet): all of them."""
        if not sm.lane_extent[lane][b]:
            return sum(pages)
        free = self.free_slots(sm, b, lane)
        if sm.cm.lane_frame_slots[lane]:
            placed = self.m_place_in_frames(pages, free, sm.cm.lane_slot_pages[lane])
            return sum(n for n, c in zip(pages, placed) if c is None)
        return sum(pages[len(free) :])

    def m_recache_placed(self, sm: SessionModel, b: str, lane: int, new: list, free: list) -> list[int]:
        """Checks where a lane's rebuilt chunks of a stream went (``new``; ``free``: its free ring slots before the
        prepare): the free slots first, as :meth:`m_recache_fresh` says, the rest in the pool; returns the pool
        pages."""
        where = f"{sm.state.session_id}/{b} lane {lane}"
        if sm.cm.lane_frame_slots[lane]:
            placed = self.m_place_in_frames([len(c) for c in new], list(free), sm.cm.lane_slot_pages[lane])
            assert all(w is None or c == w for c, w in zip(new, placed)), f"{where}: re-cache {new}, free {free}"
            if any(w is not None for w in placed):
                event("grouped re-cache: a rebuilt chunk took free frame slots")
            return [p for c, w in zip(new, placed) if w is None for p in c]
        ring = new[: len(free)]
        assert ring == [slot[: len(c)] for slot, c in zip(free, ring)], f"{where}: re-cache {new}, free slots {free}"
        if ring:
            event("grouped re-cache: a rebuilt chunk took a free ring slot")
        return [p for c in new[len(ring) :] for p in c]

    def recache_grouped(
        self, streams: list[tuple[SessionModel, str]], fn, args: tuple, keep_sinks: bool, variant: str, layers: str,
    ) -> None:
        """A re-cache with retention groups: each lane plans the rule over what its group keeps; one forward
        rebuilds the union (commit order, the stream's positions) in every lane, in the lane's free ring slots first
        (chunk or frame slots: :meth:`m_recache_placed`), then fresh pages (capacity per lane:
        :meth:`m_recache_fresh`); each lane attends its kept chunks (not in the union) then the union
        block-causally; at commit a lane's chunks in the union (its own targets, and its kept sinks another lane
        rebuilds: in place) take the rebuilt pages, the other union chunks (context there) are released, then
        each lane's rebuilt chunks in fresh pages move into the slots the commit frees (:meth:`m_lane_ring_copies`);
        abort changes nothing but the pool's free pages."""
        cm = streams[0][0].cm
        failure = self.predict_recache_grouped(streams, keep_sinks)
        if failure is not None or variant == "plan":
            cm.backend.fail = None if failure is not None else Boom
            try:
                self.expect_failure(failure or Boom, fn, *args, keep_sinks=keep_sinks)
            finally:
                cm.backend.fail = None
            event(f"grouped re-cache refused: {(failure or Boom).__name__}")
            return
        unions = {(id(sm), b): self.m_union(sm, b, keep_sinks) for sm, b in streams}
        # per stream, per lane: the lane's chunks in the union (rebuilt there) and its kept ones (attended as they are)
        mine = {
            (id(sm), b, lane): [r for r in self.visible_data(sm, b, lane) if any(r.base is u for u in unions[(id(sm), b)])]
            for sm, b in streams for lane in range(cm.num_lanes)
        }
        free_before, used_before = self.alloc_before(cm)
        ring = {  # each lane's free ring slots of each stream, before the prepare
            (id(sm), b, lane): self.free_slots(sm, b, lane) if cm.extents else []
            for sm, b in streams for lane in range(cm.num_lanes)
        }
        before = self.snapshot()
        ctx = fn(*args, keep_sinks=keep_sinks)
        lib = ctx._transaction
        assert isinstance(lib, ForwardTransaction) and lib.is_open and lib.recache
        lengths = tuple(r.tokens for r in unions[(id(streams[0][0]), streams[0][1])])
        shape = Shape(lengths)
        for i, (sm, b) in enumerate(streams):
            union = unions[(id(sm), b)]
            positions = [p for r in union for p in r.positions()]
            assert ctx.positions[i].tolist() == positions, (ctx.positions[i].tolist(), positions)
        assert len(ctx._lane_contexts) == cm.num_lanes
        for lane, lane_ctx in enumerate(ctx._lane_contexts):
            fresh: list[int] = []
            for i, (sm, b) in enumerate(streams):
                where = f"{sm.state.session_id}/{b} lane {lane}"
                union = unions[(id(sm), b)]
                new = list(sm.state._lane_pages(b)[lane].pending)
                assert [len(c) * self.page for c in new] == list(lengths), f"{where}: re-cache pending {new}"
                fresh += self.m_recache_placed(sm, b, lane, new, ring[(id(sm), b, lane)])
                sm.lane_pending[lane][b] = new
                kept = [r for r in self.chunk_records(sm, b, lane) if not any(r.base is u for u in union)]
                history = [p for r in kept for p in r.positions()]
                keys = history + [p for r in union for p in r.positions()]
                got = lane_ctx.key_positions()[i].tolist()
                assert got[: len(keys)] == keys and set(got[len(keys) :]) <= {-1}, f"{where}: {got}, expected {keys}"
                dense = lane_ctx.to_dense()[i]
                assert dense[:, : len(history)].all(), where
                assert torch.equal(dense[:, len(history) : len(keys)], shape.pending_mask()), where
                assert not dense[:, len(keys) :].any(), where
                assert {p for r in kept for p in r.lane_pages(lane)}.isdisjoint(lane_ctx._layout.write_pages.tolist())
            assert len(set(fresh)) == len(fresh) and set(fresh) <= free_before[lane], (
                f"lane {lane}: re-cache pages {fresh} were not all free"
            )
            cm.peaks[lane] = max(cm.peaks[lane], used_before[lane] + len(fresh))
        for sm, b in streams:
            sm.pending_tokens[b] = list(lengths)
        tx = self.m_publish(cm, list(streams), ctx, TxModel(cm, list(streams), True, shape, ctx, lib))
        for layer in range(NUM_LAYERS if layers == "all" or cm.check_finite else 1):
            q, k, v = self.layer_inputs(ctx, layer, "op")
            chunk_attention(q, k, v, ctx.layers[layer], **self.sink_query(ctx, q))
            for lane, g in enumerate(self.lanes):
                if layer not in g.layers:
                    continue
                inner = g.layers.index(layer)
                heads = list(g.heads[inner])
                for i, (sm, b) in enumerate(streams):
                    pages = [p for c in sm.lane_pending[lane][b] for p in c]
                    cm.pools[lane].write(inner, pages, k[i][:, heads], v[i][:, heads])
        for lane, lane_ctx in enumerate(ctx._lane_contexts):  # gathered keys: kept as committed, then the fresh pages
            plan = lane_ctx._plan
            assert isinstance(plan, (ReferencePlan, RelativeSinkPlan)), type(plan)
            pool = self.pool_values(cm, lane)
            slots = pool.reshape(pool.shape[0], 2, -1, pool.shape[-2] * pool.shape[-1])
            for i, (sm, b) in enumerate(streams):
                union = unions[(id(sm), b)]
                kept = [r for r in self.chunk_records(sm, b, lane) if not any(r.base is u for u in union)]
                pending = [p for c in sm.lane_pending[lane][b] for p in c]
                want = torch.cat(
                    [r.token_data(lane) for r in kept]
                    + [cm.pools[lane].pages(pending).reshape(pool.shape[0], 2, shape.seq_len, -1)], dim=2
                )
                if isinstance(plan, RelativeSinkPlan):  # kept sinks in the sink segment, the rest in the other
                    sink_keys = sum(r.tokens for r in kept)
                    gathered = torch.cat(
                        [plan.sinks.gather[i, :sink_keys], plan.rest.gather[i, : want.shape[2] - sink_keys]]
                    )
                else:
                    gathered = plan.gather[i, : want.shape[2]]
                assert same_bits(slots[:, :, gathered], want), f"{sm.state.session_id}/{b} lane {lane}: gathered K/V"
        sm0, b0 = streams[0]
        incomplete = not (layers == "all" or cm.check_finite)
        if variant in ("boom", "ctx.abort", "state.abort") or incomplete:
            if variant not in ("boom", "ctx.abort", "state.abort"):
                with pytest.raises(IncompleteForwardError):
                    finish_as(variant, ctx, sm0.state, b0)
                assert lib.status == "aborted", "a refused re-cache commit must abort it"
            else:
                finish_as(variant, ctx, sm0.state, b0)
            for sm, b in streams:
                sm.forward[b] = None
                sm.drop_pending(b)
            tx.status = "aborted"
            after, ci = self.snapshot(), self.caches.index(cm)
            assert after[0][ci][0][1:3] == before[0][ci][0][1:3], "an aborted re-cache changed a lane's free list"
            assert after[1] == before[1], "an aborted re-cache changed a session"
            event(f"grouped re-cache aborted ({variant})")
            return
        finish_as(variant, ctx, sm0.state, b0)
        assert lib.status == "committed"
        # per stream and lane: where each chunk the lane swaps in sits in the history, the pages it replaces
        moved = {
            (id(sm), b, lane): [(self.m_index(sm, b, r), r.lane_pages(lane)) for r in mine[(id(sm), b, lane)]]
            for sm, b in streams for lane in range(cm.num_lanes)
        }
        for sm, b in streams:
            union = unions[(id(sm), b)]
            for j, rec in enumerate(union):
                pages, data = {}, {}
                for lane in range(cm.num_lanes):
                    if any(r.base is rec for r in mine[(id(sm), b, lane)]):  # rebuilt there (else context: released)
                        pages[lane] = sm.lane_pending[lane][b][j]
                        data[lane] = cm.pools[lane].pages(pages[lane])
                self.m_relocate(sm, b, rec, pages, data)
            self.m_recache_drops_selection(sm, b)
            sm.forward[b] = None
            sm.drop_pending(b)
        for lane in range(cm.num_lanes if cm.extents else 0):  # (once every stream's commit is applied)
            for sm, b in streams:
                self.m_lane_ring_copies(sm, b, lane, moved[(id(sm), b, lane)])
        tx.status = "committed"
        contexts = any(len(mine[(id(sm), b, lane)]) < len(unions[(id(sm), b)])
                       for sm, b in streams for lane in range(cm.num_lanes))
        where, what = " over extents" if cm.extents else "", ", with context chunks" if contexts else ""
        event(f"grouped re-cache committed{where}, keep_sinks={keep_sinks}{what}")

    @staticmethod
    def m_index(sm: SessionModel, b: str, rec: ChunkRecord) -> int:
        """Where the committed chunk ``rec`` shows sits in ``sm``/``b``'s history."""
        return next(j for j, r in enumerate(sm.committed[b]) if r is rec.base)

    def m_lane_ring_copies(self, sm: SessionModel, b: str, lane: int, moved: list[tuple[int, tuple]]) -> None:
        """A grouped re-cache commit's moves in one lane's extent (``ring_copies``, re-stated), once the whole commit is
        applied: each chunk the lane swapped in (``moved``: its history index and the pages it replaced, commit
        order) that sits in pool pages is copied into the extent's free slots -- a chunk lane: the replaced chunk's
        own slot when free, else the lowest free one, while any is left; a frame lane: its kept frames' count of the
        lowest, while enough are left -- and its pool pages freed."""
        extent = set(sm.lane_extent[lane][b] or ())
        if not extent:
            return
        frames, step = sm.cm.lane_frame_slots[lane], sm.cm.lane_slot_pages[lane]
        free = self.free_slots(sm, b, lane)
        rest: list[int] = []
        for at, old in moved:
            kept = next(v for v in self.visible_data(sm, b, lane) if v.base is sm.committed[b][at]).lane_pages(lane)
            if kept[0] in extent:  # rebuilt in ring slots: never moves
                continue
            if frames:
                count = -(-len(kept) // step)
                if count > len(free):
                    event("grouped re-cache: a rebuilt chunk stays outside the frame extent (too few free slots)")
                    break
                slot = tuple(p for sl in free[:count] for p in sl)
                del free[:count]
            else:
                slot = next((sl for sl in free if sl[0] == old[0]), None)
                if slot is None:
                    rest.append(at)
                    continue
                free.remove(slot)
            self.m_ring_copy(sm, b, lane, at, slot)
        for at in rest:
            if not free:
                event("grouped re-cache: a rebuilt chunk stays outside the ring (no free slot)")
                break
            self.m_ring_copy(sm, b, lane, at, free.pop(0))

    def m_ring_copy(self, sm: SessionModel, b: str, lane: int, at: int, slot: tuple[int, ...]) -> None:
        """History chunk ``at`` of ``sm``/``b`` copied, in ``lane``, from its (kept) pool pages into ``slot``'s first
        pages."""
        rec = sm.committed[b][at]
        kept = next(v for v in self.visible_data(sm, b, lane) if v.base is rec).lane_pages(lane)
        target = tuple(slot[: len(kept)])
        sm.cm.pools[lane].copy(kept, target)
        self.m_relocate(sm, b, rec, {lane: target})
        event(f"grouped re-cache: a rebuilt chunk copied into {'frame' if sm.cm.lane_frame_slots[lane] else 'ring'} "
              "slots")


def finish_as(variant: str, ctx: Any, state: Any, branch: str) -> None:
    """Finish the re-cache ``ctx`` the way ``variant`` says: abort (``boom``: an exception in ``with ctx``,
    ``ctx.abort``, ``state.abort``) or commit (``with``, ``ctx.commit``, else ``commit_paged_context``)."""
    if variant == "boom":
        with pytest.raises(Boom), ctx:
            raise Boom("inside a re-cache")
    elif variant == "ctx.abort":
        ctx.abort()
    elif variant == "state.abort":
        state.abort(branch)
    elif variant == "with":
        with ctx:
            pass
    elif variant == "ctx.commit":
        ctx.commit()
    else:
        state.commit_paged_context(branch)
