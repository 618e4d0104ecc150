"""How the model sees a forward: which exception ``prepare_forward`` must raise, the library call that prepares
it, what its attention must see (positions, key positions, mask, gathered K/V), what finishing it does, and
running its layers with K/V that carry their own ids."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import event

from ardiff_modules import ForwardContext, LayerContext, chunk_attention
from ardiff_modules.errors import CrossAttentionNotPopulatedError
from ardiff_modules.backends.reference import ReferencePlan
from ardiff_modules.backends.segmented import RelativeSinkPlan
from ardiff_modules.errors import (
    CacheClosedError,
    CapacityError,
    IncompleteForwardError,
    NonFiniteKVError,
    PendingContextError,
    SequenceLengthError,
    SessionClosedError,
    SpecError,
    TensorMismatchError,
    UnknownBranchError,
    UnknownCacheError,
)
from ardiff_modules.core.transaction import ForwardTransaction
from tests.support.pool_model import bits, longest_run, runs_holding, same_bits, token_kv
from tests.support.session_model import (
    BRANCHES,
    CacheModel,
    ChunkRecord,
    HEAD_DIM,
    NUM_LAYERS,
    SelectedView,
    SessionModel,
    Shape,
    TxModel,
)


#: Scores (cosines, float32 in the library, float64 here) this close count as a tie (:meth:`ForwardModel.m_choose`).
SCORE_TIE = 1e-5

class ForwardModel:
    # ================================================================== helpers: prepare
    def predict_prepare(
        self, cm: CacheModel, streams: list[tuple[SessionModel, str]], shape: Shape, *, via: str,
        mask_ok: bool = True, static: bool = False, commit: bool = False,
    ) -> type[BaseException] | None:
        """The exception ``prepare_forward`` must raise (in the library's order of checks), or ``None``."""
        if via not in ("cache", "cache_gen") and streams[0][0].closed:
            return SessionClosedError
        if cm.closed:
            return CacheClosedError
        seen = set()
        for sm, b in streams:
            if sm.cm is not cm:
                return SpecError
            if sm.closed:
                return SessionClosedError
            if b not in BRANCHES:
                return UnknownBranchError
            key = (id(sm), b)
            if key in seen:
                return SpecError
            seen.add(key)
        if static and self.window is None:
            return SpecError
        if self.framed and any(n != self.chunk for n in shape.lengths):  # a frame lane counts whole chunks
            return SequenceLengthError
        for sm, b in streams:
            tx = sm.forward[b]
            if tx is not None and tx.commit:
                return PendingContextError
        if not mask_ok:
            return TensorMismatchError
        pages = [n // self.page for n in shape.lengths]
        for lane in range(cm.num_lanes):  # every lane must hold the forward (each its own allocator)
            failure = self.predict_lane_capacity(cm, streams, shape, pages, lane, commit)
            if failure is not None:
                return failure
        if commit and self.selects and shape.num_chunks > 1:  # a content selection scores at each chunk's commit
            event("content selection: a committing forward of several chunks refused")
            return SequenceLengthError
        return None

    def m_selection_candidates(self, sm: SessionModel, b: str, lane: int, index: int) -> tuple[int, int] | None:
        """``(first candidate frame, boundary frame)`` the commit of chunk ``index`` of ``sm``/``b`` scores in lane
        ``lane`` (re-stated: the ``F`` frames from ``index F - T``, ``T = min(window_frames, index F - max(sink_frames,
        floor))``, none when ``T < 1``, before ``select_from`` or without kept frames), or ``None``."""
        g = self.lanes[lane]
        if g.select is None:
            return None
        keep, _, select_from, _, _ = g.select
        sink_frames, window_frames, per = g.frames  # type: ignore[misc]
        if index < select_from or not keep:
            return None
        floor = max(sm.floor[b], sm.sink_only[b]) * per
        start = index * per
        in_window = min(window_frames, start - max(sink_frames, floor))  # type: ignore[type-var]
        if in_window < 1:
            return None
        return start - in_window, start - in_window + per

    def m_selection_pages(self, lane: int) -> int:
        g = self.lanes[lane]
        return g.select[0] * (self.ppc // g.frames[2]) if g.select is not None else 0  # type: ignore[index]

    def m_reserved_pages(self, sm: SessionModel, b: str, lane: int, shape: Shape, commit: bool) -> int:
        """Pages a committing forward of ``shape`` reserves in ``lane`` for the selection its commit makes."""
        if not commit:
            return 0
        found = self.m_selection_candidates(sm, b, lane, len(sm.committed[b]) + shape.num_chunks - 1)
        return self.m_selection_pages(lane) if found is not None else 0

    def predict_lane_capacity(
        self, cm: CacheModel, streams: list[tuple[SessionModel, str]], shape: Shape, pages: list[int], lane: int,
        commit: bool = False,
    ) -> type[BaseException] | None:
        alloc = cm.allocator(lane)
        selection = sum(self.m_reserved_pages(sm, b, lane, shape, commit) for sm, b in streams)
        if not cm.extents:
            # Pending chunks of other lengths are replaced (after the new ones are allocated).
            needed = sum(sum(pages[self.reused(sm, b, shape) :]) for sm, b in streams) + selection
            return CapacityError if needed > alloc.num_free else None
        extent_chunks = cm.lane_extent_chunks[lane]
        frames, step = cm.lane_frame_slots[lane], cm.lane_slot_pages[lane]
        needed = new_extents = 0
        for sm, b in streams:
            missing = pages[self.reused(sm, b, shape) :]
            if frames:  # a chunk takes its frames' count of free frame slots, else pool pages (all of it)
                new = sm.lane_extent[lane][b] is None
                free = [()] * extent_chunks if new else self.free_slots(sm, b, lane)
                placed = self.m_place_in_frames(missing, free, step)
                new_extents += new
                needed += new * cm.extent_pages(lane) + sum(n for n, c in zip(missing, placed) if c is None)
            elif sm.lane_extent[lane][b] is None:
                new_extents += 1
                needed += extent_chunks * self.ppc + sum(missing[extent_chunks:])
            else:  # a free slot takes any chunk (a shorter one uses its first pages)
                needed += sum(missing[len(self.free_slots(sm, b, lane)) :])
        needed += selection  # (counted whole, even where free frame slots will hold it)
        if needed > alloc.num_free:
            return CapacityError
        size = cm.extent_pages(lane)
        if new_extents and new_extents > runs_holding(alloc.free_pages(), size):
            event("extents: the free runs hold too few new extents")
            return CapacityError  # enough pages, but too few runs long enough for the new extents
        if new_extents and new_extents * size > longest_run(alloc.free_pages()):
            event("extents: new extents take one hole each")  # not one run for all: lowest holes first
        return None

    def history_tokens(self, sm: SessionModel, b: str, lane: int = 0) -> int:
        """Keys of a stream's visible history in a lane (the sum of its visible chunks' lengths)."""
        return sum(rec.tokens for rec in self.visible_data(sm, b, lane))

    def max_keys(self, streams: list[tuple[SessionModel, str]], shape: Shape, lane: int = 0) -> int:
        return max(self.history_tokens(sm, b, lane) for sm, b in streams) + shape.seq_len

    def union_positions(self, sm: SessionModel, b: str) -> list[int]:
        """A stream's history key positions over every lane (a grouped ``token_mask``'s history columns): each token
        any lane keeps, ascending; a uniform cache: its one lane's keys in their order (a content selection's copy
        of a frame the window still holds is a column of its own)."""
        if not self.grouped:
            return [p for r in self.visible_data(sm, b) for p in r.positions()]
        return sorted({p for lane in range(len(self.lanes)) for r in self.visible_data(sm, b, lane) for p in r.positions()})

    def union_keys(self, streams: list[tuple[SessionModel, str]], shape: Shape) -> int:
        """Columns of a ``token_mask``: the widest stream's union history, then the pending tokens."""
        return max(len(self.union_positions(sm, b)) for sm, b in streams) + shape.seq_len

    def lane_mask(self, tx: TxModel, i: int, lane: int) -> torch.Tensor | None:
        """Stream ``i``'s ``token_mask`` as lane ``lane`` applies it ``[seq_len, lane keys]``: the columns of the
        lane's history positions in the union order, then the pending ones; ``None`` without a mask."""
        if tx.token_mask is None:
            return None
        sm, b = tx.streams[i]
        union = self.union_positions(sm, b)
        where = {p: c for c, p in enumerate(union)}
        hist = [where[p] for r in self.visible_data(sm, b, lane) for p in r.positions()]
        if not self.grouped:  # the lane's own key order
            hist = list(range(len(union)))
        cols = hist + list(range(len(union), len(union) + tx.shape.seq_len))
        return tx.token_mask[i][:, cols]

    def make_mask(self, streams: list[tuple[SessionModel, str]], shape: Shape, bad: str | None = None):
        dims = [len(streams), shape.seq_len, self.union_keys(streams, shape)]
        if bad == "shape":
            dims[2] += 1
        mask = torch.rand(dims, generator=self.gen) < 0.75
        return mask.float() if bad == "dtype" else mask

    def prepare_call(
        self, streams: list[tuple[SessionModel, str]], shape: Shape, commit: bool, via: str,
        token_mask: torch.Tensor | None = None,
    ) -> tuple[Callable[..., Any], tuple, dict]:
        """The library call for this forward: ``state.prepare_forward``, ``cache.prepare_forward`` or the seed's
        ``get_kv_caches`` (which returns the layer list)."""
        seq_len = shape.seq_len
        sm0 = streams[0][0]
        kwargs: dict[str, Any] = {"token_mask": token_mask}
        rule = {} if shape.rule is None else {"pending_attention": shape.rule}
        kwargs.update(rule)
        if shape.explicit:
            # A tuple or a list: any sequence of ints.
            kwargs["chunk_lengths"] = shape.lengths if len(shape.lengths) % 2 else list(shape.lengths)
        if via == "get_kv_caches":
            assert not shape.explicit
            return sm0.state.get_kv_caches, (streams[0][1], seq_len, commit), rule
        if via == "state":
            branches = tuple(b for _, b in streams)
            return sm0.state.prepare_forward, (branches, seq_len, commit), kwargs
        pairs = [(sm.state, b) for sm, b in streams]
        return (
            sm0.cm.cache.prepare_forward,
            ((p for p in pairs) if via == "cache_gen" else pairs, seq_len, commit),  # a generator is consumed once
            kwargs,
        )

    def choose_via(self, streams: list[tuple[SessionModel, str]], via: str, masked: bool, shape: Shape) -> str:
        if len({id(sm) for sm, _ in streams}) > 1:
            return "cache_gen" if via == "cache_gen" else "cache"
        if via == "get_kv_caches" and (len(streams) > 1 or masked or shape.explicit):
            return "state"
        return via

    def start_forward(
        self, streams: list[tuple[SessionModel, str]], shape: Shape, commit: bool, *, via: str = "state",
        masked: bool = False,
    ) -> TxModel | None:
        """Prepare a forward (or check that it fails, changing nothing) and record it in the model."""
        via = self.choose_via(streams, via, masked, shape)
        cm = streams[0][0].cm
        failure = self.predict_prepare(cm, streams, shape, via=via, commit=commit)
        mask = self.make_mask(streams, shape) if masked and failure is None else None
        fn, args, kwargs = self.prepare_call(streams, shape, commit, via, mask)
        if failure is not None:
            event(f"prepare raised {failure.__name__}")
            self.expect_failure(failure, fn, *args, **kwargs)
            return None
        free_before, used_before = self.alloc_before(cm)
        result = fn(*args, **kwargs)
        ctx = result[0].forward if via == "get_kv_caches" else result
        if via == "get_kv_caches":
            assert result is ctx.layers
        return self.m_prepared(streams, shape, commit, ctx, free_before, used_before, mask)

    def m_prepared(
        self, streams: list[tuple[SessionModel, str]], shape: Shape, commit: bool, ctx: ForwardContext,
        free_before: list[set[int]], used_before: list[int], mask: torch.Tensor | None = None,
    ) -> TxModel:
        """Check a prepared forward against the model and record it (supersede, pages in every lane, registry,
        transaction). ``free_before`` / ``used_before``: each lane's free pages and used count before the call."""
        cm = streams[0][0].cm
        # Open denoising forwards of these streams are superseded as a whole (pending pages kept).
        for sm, b in streams:
            old = sm.forward[b]
            if old is not None:
                assert not old.commit, "a stream of an open committing forward was prepared again"
                self.m_finished(old, "superseded")
                event("prepare superseded an open denoising forward")
        lanes = ctx._lane_contexts
        assert len(lanes) == cm.num_lanes, f"{len(lanes)} lane contexts, model {cm.num_lanes} lanes"
        for lane in range(cm.num_lanes):
            self.m_prepared_lane(streams, shape, ctx, lanes[lane], lane, free_before[lane], used_before[lane], commit)
        for i, (sm, b) in enumerate(streams):
            sm.pending_tokens[b] = list(shape.lengths)
        key = tuple((sm.state.session_id, b) for sm, b in streams)
        assert ctx.streams == key
        assert ctx.num_chunks == shape.num_chunks and ctx.seq_len == shape.seq_len
        assert ctx._layout.chunk_lengths == shape.lengths
        assert ctx.commit_current is commit
        assert len(ctx.layers) == NUM_LAYERS
        lib = ctx._transaction
        assert isinstance(lib, ForwardTransaction) and lib.is_open
        tx = self.m_publish(cm, streams, ctx, TxModel(cm, list(streams), commit, shape, ctx, lib, mask))
        event(f"forward over {len({id(sm) for sm, _ in streams})} session(s), {len(streams)} stream(s)")
        self.check_view(tx)
        return tx

    def m_publish(self, cm: Any, streams: list[tuple[SessionModel, str]], ctx: ForwardContext, tx: TxModel) -> TxModel:
        """A prepared forward (or re-cache) ``tx`` in the model: the registry -- the same streams reuse their context,
        a new one may evict idle ones (LRU) -- and the streams' open forward."""
        key = tuple((sm.state.session_id, b) for sm, b in streams)
        if key in cm.registry:
            assert ctx is cm.registry[key], "the same streams (same order) must get the same ForwardContext"
            cm.registry.move_to_end(key)
            event("context reused")
        else:
            assert ctx not in self.ctx_tx, "a released context was handed out again"
            cm.registry[key] = ctx
            for k in list(cm.registry):
                if len(cm.registry) <= cm.max_contexts:
                    break
                other = cm.registry[k]
                if other is not ctx and not self.model_active(other):
                    del cm.registry[k]
                    self.released.add(other)
                    event("LRU released an idle context")
        for sm, b in streams:
            sm.forward[b] = tx
        self.ctx_tx[ctx] = tx
        self.track(ctx)
        self.txs = self.txs[-15:] + [tx]
        return tx

    def m_prepared_lane(
        self, streams: list[tuple[SessionModel, str]], shape: Shape, ctx: ForwardContext, lane_ctx: ForwardContext,
        lane: int, free_before: set[int], used_before: int, commit: bool = False,
    ) -> None:
        """One lane of a prepared forward: reused / grown pending pages, extents, the lane plan's pages; a
        committing forward's reserved selection pages (fresh ones, as many as its commit's selection takes)."""
        cm = streams[0][0].cm
        fresh: list[int] = []
        num_chunks = shape.num_chunks
        for i, (sm, b) in enumerate(streams):
            old = sm.lane_pending[lane][b]
            new = list(sm.state._lane_pages(b)[lane].pending)
            if lane == 0:
                assert new == list(sm.state.pending_chunks(b))
            assert len(new) == num_chunks, f"{b}: {len(new)} pending chunks in lane {lane}, expected {num_chunks}"
            assert [len(c) * self.page for c in new] == list(shape.lengths), (
                f"{b}: pending chunks {new} of {self.page}-token pages in lane {lane}, expected lengths {shape.lengths}"
            )
            keep = self.reused(sm, b, shape)
            assert new[:keep] == old[:keep], "pending pages of earlier denoising forwards must be reused"
            if keep < min(len(old), num_chunks):
                event("pending chunks of other lengths replaced")
            grown = new[keep:]
            frame_free: list = []  # a frame lane: its extent's frame slots still free (for the selection)
            if cm.extents:
                extent = sm.state._lane_pages(b)[lane].extent
                if sm.lane_extent[lane][b] is None:
                    # Reserved now: S + W + 1 chunk slots (a frame lane: its frame slots) of consecutive,
                    # previously free pages.
                    assert len(extent) == cm.extent_pages(lane), f"extent {extent}"
                    assert list(extent) == list(range(extent[0], extent[0] + len(extent))), f"extent {extent}"
                    fresh += list(extent)
                    sm.lane_extent[lane][b] = tuple(extent)
                assert tuple(extent) == sm.lane_extent[lane][b], "a branch's extent must not move until reset/close"
                slots = self.free_slots(sm, b, lane)  # model pending not updated yet: slots free before
                own = {p for c in self.visible(sm, b, lane) + old for p in c} | set(sm.reserved[lane][b])
                if any(own.isdisjoint(slot) and slot not in slots for slot in self.slots_of(sm, b, lane)):
                    event("extents: an evicted slot waits for a fork that still sees it")
                if cm.lane_frame_slots[lane]:
                    # Frame slots: each grown chunk takes its frames' count of the lowest free frame slots (not
                    # necessarily adjacent), else pool pages, the whole chunk.
                    frame_free = list(slots)
                    placed = self.m_place_in_frames([len(c) for c in grown], frame_free, cm.lane_slot_pages[lane])
                    for c, want in zip(grown, placed):
                        assert want is None or c == want, (
                            f"{b}: grew {grown} in lane {lane}, free frame slots were {slots}"
                        )
                    if any(c is not None for c in placed):
                        event("frame extents: pending chunk took frame slots")
                        if any(c is not None and c != tuple(range(c[0], c[0] + len(c))) for c in placed):
                            event("frame extents: a pending chunk in frame slots that are not adjacent")
                    if any(c is None for c in placed):
                        event("frame extents: overflow chunk paged outside the extent")
                    ring = [c for c, want in zip(grown, placed) if want is not None]
                    grown = [c for c, want in zip(grown, placed) if want is None]
                else:
                    # The ring takes the lowest free slots first (a shorter chunk their first pages); the
                    # overflow is paged.
                    ring = grown[: len(slots)]
                    assert ring == [slot[: len(c)] for slot, c in zip(slots, ring)], (
                        f"{b}: grew {grown} in lane {lane}, free extent slots were {slots}"
                    )
                    if any(len(c) < self.ppc for c in ring):
                        event("extents: a shorter chunk took part of a ring slot")
                    if ring:
                        event("extents: pending chunk took a ring slot")
                    if grown[len(ring) :]:
                        event("extents: overflow chunk paged outside the extent")
                    grown = grown[len(ring) :]
            fresh += [p for c in grown for p in c]
            sm.lane_pending[lane][b] = new
            reserved = tuple(sm.state._lane_pages(b)[lane].pending_selection)
            want = self.m_reserved_pages(sm, b, lane, shape, commit)
            assert len(reserved) == want, f"{b} lane {lane}: reserved selection pages {reserved}, expected {want}"
            if reserved:
                event("committing forward reserved selection pages")
            if reserved and sm.reserved[lane][b]:  # (a denoising forward before kept them)
                assert reserved == sm.reserved[lane][b], f"{b} lane {lane}: reserved {reserved}, before {sm.reserved[lane][b]}"
            elif reserved and frame_free:  # the free frame slots left after the pending chunks took theirs
                (inside,) = self.m_place_in_frames([len(reserved)], frame_free, cm.lane_slot_pages[lane])
                if inside is not None:
                    assert reserved == inside, f"{b} lane {lane}: reserved {reserved}, free frame slots {frame_free}"
                    event("frame extents: reserved selection pages in frame slots")
            if reserved and not sm.reserved[lane][b]:
                fresh += [p for p in reserved if p not in set(sm.lane_extent[lane][b] or ())]
            sm.reserved[lane][b] = reserved
            # The plan sees exactly the model's visible pages and pending chunks.
            layout = lane_ctx._layout.streams[i]
            assert list(layout.history_pages) == [p for c in self.visible(sm, b, lane) for p in c], (
                f"{sm.state.session_id}/{b} lane {lane}: the plan's history pages {list(layout.history_pages)}, "
                f"model {self.visible(sm, b, lane)}"
            )
            assert list(layout.pending_pages) == new
            offset = sm.committed_tokens(b)
            assert layout.token_offset == offset, f"{b}: token_offset {layout.token_offset}, model {offset}"
        assert len(set(fresh)) == len(fresh) and set(fresh) <= free_before, (
            f"lane {lane}: newly allocated pages {fresh} were not all free ({sorted(free_before)})"
        )
        cm.peaks[lane] = max(cm.peaks[lane], used_before + len(fresh))

    def check_view(self, tx: TxModel) -> None:
        """What an open forward attends to, against the model, stream by stream.

        ``positions`` are the model's next positions (tokens committed before, whatever the chunks'
        lengths); ``key_positions()`` lists each visible chunk's positions (sinks keep theirs after
        evictions) then the pending ones, ``-1`` padding; ``to_dense()`` is the rule over the model's
        chunk lengths (and the token mask); the reference backend's gathered K/V are, key by key,
        what the model says each visible chunk held when committed, then the pending chunks' contents.
        """
        ctx, shape, cm = tx.ctx, tx.shape, tx.cm
        assert tx.is_open and ctx.is_active
        n = shape.seq_len
        for i, (sm, b) in enumerate(tx.streams):
            offset = sm.committed_tokens(b)
            assert ctx.positions[i].tolist() == list(range(offset, offset + n)), (
                f"{sm.state.session_id}/{b}: positions {ctx.positions[i].tolist()}, expected from {offset}"
            )
        # With retention groups each lane's plan is checked (its history is its group's); the forward's own
        # key_positions() / to_dense() are lane 0's.
        for lane, lane_ctx in enumerate(ctx._lane_contexts):
            self.check_lane_view(tx, lane, lane_ctx)
        if self.grouped and self.spec.relative_sinks:
            self.check_grouped_sink_positions(tx)

    def check_grouped_sink_positions(self, tx: TxModel) -> None:
        """Relative sinks with groups: the forward's own ``sink_positions`` / ``sink_shifts`` refuse; each layer's
        are its one lane's ``[streams, seq_len]`` (natural positions for a lane without sinks), or per query head
        ``[streams, seq_len, heads]`` where several lanes hold its heads (each head at its lane's shift)."""
        ctx, n = tx.ctx, tx.shape.seq_len
        for name in ("sink_positions", "sink_shifts"):
            with pytest.raises(SpecError, match="retention groups"):
                getattr(ctx, name)
        # per stream and lane: the positions the lane's sink query sits at
        want = [
            [
                [p - self.m_sink_shift(self.visible_data(sm, b, lane), sm, b, sm.committed_tokens(b), lane)
                 for p in range(sm.committed_tokens(b), sm.committed_tokens(b) + n)]
                for lane in range(len(self.lanes))
            ]
            for sm, b in tx.streams
        ]
        group = 2  # query heads per kv head
        for layer in range(NUM_LAYERS):
            homes = [self.head_home_of(layer, h)[0] for h in range(self.kv_heads)]
            got = ctx.layers[layer].sink_positions
            if len(set(homes)) == 1:
                expected = torch.tensor([w[homes[0]] for w in want])
            else:
                expected = torch.tensor([[[w[homes[q // group]][t] for q in range(group * self.kv_heads)]
                                          for t in range(n)] for w in want])
            assert got is not None and got.tolist() == expected.tolist(), (
                f"layer {layer} (kv heads in lanes {homes}): sink_positions {got.tolist()}, expected {expected.tolist()}"
            )

    def check_lane_view(self, tx: TxModel, lane: int, lane_ctx: ForwardContext) -> None:
        ctx, shape, cm = tx.ctx, tx.shape, tx.cm
        n = shape.seq_len
        key_positions, dense = lane_ctx.key_positions(), lane_ctx.to_dense()
        plan = lane_ctx._plan
        assert isinstance(plan, (ReferencePlan, RelativeSinkPlan)), type(plan)
        width = self.max_keys(tx.streams, shape, lane)
        assert tuple(key_positions.shape) == (len(tx.streams), width), (key_positions.shape, width, lane)
        assert tuple(dense.shape) == (len(tx.streams), n, width), (dense.shape, n, width, lane)
        pool = self.pool_values(cm, lane)
        layers = pool.shape[0]
        slots = pool.reshape(layers, 2, -1, pool.shape[-2] * pool.shape[-1])  # [layers, K/V, token slots, H*D]
        causal = shape.pending_mask()
        for i, (sm, b) in enumerate(tx.streams):
            records = self.visible_data(sm, b, lane)
            offset = sm.committed_tokens(b)
            committed = [r.tokens for r in sm.committed[b]]
            where = f"{sm.state.session_id}/{b} lane {lane} (lengths {shape.lengths}, committed {committed})"
            # With groups each lane's sinks move by its own shift (a lane without sinks: none, no sink segment).
            shift = self.m_sink_shift(records, sm, b, offset, lane)
            got_shift = lane_ctx.sink_shifts[i] if lane_ctx.sink_shifts else 0
            assert got_shift == shift, f"{where}: sink shift {got_shift}, expected {shift}"
            if self.spec.relative_sinks and self.lanes[lane].sinks:
                assert lane_ctx.sink_positions is not None, where
                assert lane_ctx.sink_positions[i].tolist() == list(range(offset - shift, offset - shift + n)), where
            else:
                assert lane_ctx.sink_positions is None, where
            if any(isinstance(r, SelectedView) for r in records):
                event("a forward attends a content selection")
                if tx.token_mask is not None:
                    event("a forward attends a content selection under a token mask")
                if shift:
                    event("a forward attends a content selection, its sinks shifted (relative sinks)")
            expected = [p for rec in records for p in rec.positions()] + list(range(offset, offset + n))
            keys = len(expected)
            got = key_positions[i].tolist()
            assert got == expected + [-1] * (width - keys), f"{where}: key_positions {got}, expected {expected}"
            mask = torch.zeros(n, width, dtype=torch.bool)
            mask[:, : keys - n] = True
            mask[:, keys - n : keys] = causal
            lane_mask = self.lane_mask(tx, i, lane)
            if lane_mask is not None:
                mask[:, :keys] &= lane_mask
                mask[:, keys:] = False
            assert torch.equal(dense[i], mask), f"{where}: to_dense() differs from the rule over the model's lengths"
            # Every layer's K and V at once: [layers, 2, keys, H*D], keys in position order.
            pending = [p for c in sm.lane_pending[lane][b] for p in c]
            want = torch.cat(
                [rec.token_data(lane) for rec in records]
                + [cm.pools[lane].pages(pending).reshape(layers, 2, n, -1)], dim=2
            )
            if isinstance(plan, RelativeSinkPlan):  # two segments: the sink keys, then window + pending
                assert isinstance(plan.sinks, ReferencePlan) and isinstance(plan.rest, ReferencePlan)
                sink_keys = self.m_sink_split(records, sm, b, offset, lane)[0]
                gathered = torch.cat([plan.sinks.gather[i, :sink_keys], plan.rest.gather[i, : keys - sink_keys]])
            else:
                gathered = plan.gather[i, :keys]
            seen = slots[:, :, gathered]
            if not same_bits(seen, want):
                bad = (bits(seen) != bits(want)).any(-1).any(0).any(0).nonzero().flatten().tolist()
                raise AssertionError(
                    f"{where}: the K/V the forward gathers for the keys at positions {[expected[j] for j in bad]} "
                    "are not what the model says was written there"
                )

    def model_active(self, ctx: ForwardContext) -> bool:
        tx = self.ctx_tx.get(ctx)
        return ctx not in self.released and tx is not None and tx.is_open

    # ================================================================== helpers: finishing
    def m_finished(self, tx: TxModel, status: str) -> None:
        """A transaction finishes: every stream at once (model side)."""
        if not tx.is_open:
            return
        for sm, b in tx.streams:
            assert sm.forward[b] is tx
            sm.forward[b] = None
            if status == "aborted":
                if any(r[b] for r in sm.reserved):  # (the invariants: their references are gone)
                    event("an aborted committing forward returned its reserved selection pages")
                sm.drop_pending(b)
            elif status == "committed":
                if (sm, b) == tx.streams[0]:
                    self.in_place = self.m_in_place(tx)
                before = len(self.visible(sm, b)) + len(sm.pending[b])
                assert sm.pending_tokens[b] == list(tx.shape.lengths)
                start = sm.committed_tokens(b)
                pools = tx.cm.pools
                for c, tokens in enumerate(sm.pending_tokens[b]):
                    pages = [sm.lane_pending[lane][b][c] for lane in range(len(pools))]
                    others = tuple((p, pool.pages(p)) for p, pool in zip(pages[1:], pools[1:]))
                    sm.committed[b].append(ChunkRecord(pages[0], tokens, start, pools[0].pages(pages[0]), others))
                    start += tokens
                self.m_select(sm, b)
                sm.drop_pending(b)
                sm.resident_shot[b] = sm.shot[b]  # this commit applied the current shot
                event("commit evicted chunks" if len(self.visible(sm, b)) < before else "commit without eviction")
                lengths = {rec.tokens for rec in self.visible_data(sm, b)}
                if len(lengths) > 1:
                    event("visible history of mixed chunk lengths")
        tx.status = status

    def m_in_place(self, tx: TxModel) -> set[tuple[int, str, int]]:
        """``(id(session), branch, lane)`` of the streams of ``tx`` whose commit copies the new content selection
        into the current one's pages (``BranchFrameExtent.selection_in_place``), decided for every stream before
        any commits: a frame extent's lane, the current selection's pages all in the branch's extent and held by
        it alone (no fork shares them)."""
        out: set[tuple[int, str, int]] = set()
        cm = tx.cm
        if not (cm.extents and self.selects):
            return out
        for lane in range(cm.num_lanes):
            if not cm.lane_frame_slots[lane]:
                continue
            refs = self.chunk_references(cm, lane)
            for sm, b in tx.streams:
                selected, extent = sm.selected[lane][b], set(sm.lane_extent[lane][b] or ())
                if selected is not None and all(p in extent and refs[p] == 1 for p in selected.pages):
                    out.add((id(sm), b, lane))
        return out

    def m_selection_copied(self, tx: TxModel) -> None:
        """A commit of ``tx`` that failed after the device chose and copied (its bookkeeping unchanged, the forward
        still open): the reserved pages now hold the copies (:meth:`m_select` over the pending chunks as if
        committed), nothing else changed."""
        self.in_place = self.m_in_place(tx)
        for sm, b in tx.streams:
            if not any(r[b] for r in sm.reserved):
                continue
            kept, selected = list(sm.committed[b]), [dict(s) for s in sm.selected]
            start, pools = sm.committed_tokens(b), tx.cm.pools
            for c, tokens in enumerate(sm.pending_tokens[b]):
                pages = [sm.lane_pending[lane][b][c] for lane in range(len(pools))]
                others = tuple((p, pool.pages(p)) for p, pool in zip(pages[1:], pools[1:]))
                sm.committed[b].append(ChunkRecord(pages[0], tokens, start, pools[0].pages(pages[0]), others))
                start += tokens
            try:
                self.m_select(sm, b, adopt=False)
            finally:
                sm.committed[b], sm.selected = kept, selected

    def copied_pages(self, tx: TxModel) -> list[set[int]]:
        """Per lane, the pages a failed commit of ``tx`` may have copied a new selection into: the reserved ones,
        and the current selection's where it is re-chosen in place (:meth:`m_in_place`)."""
        out = self.reserved_pages(tx)
        for sm, b in tx.streams:
            for lane in range(tx.cm.num_lanes):
                if (id(sm), b, lane) in self.m_in_place(tx):
                    out[lane].update(sm.selected[lane][b].pages)  # type: ignore[union-attr]
        return out

    def reserved_pages(self, tx: TxModel) -> list[set[int]]:
        """Per lane, the selection pages ``tx``'s streams reserved."""
        return [{p for sm, b in tx.streams for p in sm.reserved[lane][b]} for lane in range(tx.cm.num_lanes)]

    def m_select(self, sm: SessionModel, b: str, adopt: bool = True) -> None:
        """A commit of a content-selected stream, re-stated: the selection is replaced in every selecting lane.

        Per retention group, from the keys its scoring lane holds of the score layer (the group's heads there,
        concatenated): each candidate frame's token vs the same token of the next frame (the boundary after the
        last), cosine, mean over a patch's tokens, negated; the ``keep_frames * patches_per_frame`` best patches
        (ties: the earlier), ascending; every lane of the group copies those candidate pages (every layer, K and
        V) into the pages its committing forward reserved. No candidates: the selection is dropped."""
        index = len(sm.committed[b]) - 1
        chosen: dict[int, tuple[int, ...] | None] = {}  # group -> chosen page offsets among the candidates' pages
        for lane, g in enumerate(self.lanes):
            if g.select is None:
                continue
            keep, patches, _, score_layer, group = g.select
            found = self.m_selection_candidates(sm, b, lane, index)
            page_frame = self.ppc // g.frames[2]  # type: ignore[index]
            if group not in chosen:
                chosen[group] = None if found is None else self.m_choose(sm, b, group, score_layer, found, keep, patches)
            offsets = chosen[group]
            reserved = sm.reserved[lane][b]
            lib = sm.state._lane_pages(b)[lane].selection if adopt else None
            if offsets == ():  # a non-finite score (check_finite off) or a tie: the order is torch's, not re-stated
                if not adopt:
                    continue
                assert lib is not None, f"{b} lane {lane}: no selection made, expected one"
                offsets = chosen[group] = tuple(lib.resolved())
                tie = self.selection_tie
                if tie is None:
                    event("content selection over a non-finite score: the chosen pages read back")
                else:  # any top k of the tied scores will do: the library's must be one
                    by_patch, kth, pages_patch = tie
                    picked = sorted({o // pages_patch for o in offsets})
                    assert len(picked) * pages_patch == len(offsets) and all(
                        by_patch[n] >= kth - SCORE_TIE for n in picked
                    ), f"{b} lane {lane}: selection offsets {offsets} are not a top {len(picked)} of {by_patch}"
                    event("content selection over tied scores: the library's top k read back and checked")
            if not adopt:
                assert (offsets is None) == (not reserved), (offsets, reserved)
            elif offsets is None:
                assert not reserved and lib is None, f"{b} lane {lane}: a selection {lib} where none is chosen"
                if sm.selected[lane][b] is not None:
                    event("content selection dropped at a commit without candidates")
                sm.selected[lane][b] = None
                continue
            if (id(sm), b, lane) in getattr(self, "in_place", ()) and offsets is not None:
                # copied into the current selection's pages (in its frame extent, held by it alone); the reserved
                # pages are released
                reserved = sm.selected[lane][b].pages  # type: ignore[union-attr]
                event("frame extents: a scoring commit re-chose its selection in place")
            assert not adopt or (lib is not None and tuple(lib.pages) == reserved), (
                f"{b} lane {lane}: selection pages {lib and lib.pages}, reserved (or in place) {reserved}"
            )
            if offsets is None:
                continue
            first = found[0]  # type: ignore[index]
            per = g.frames[2]  # type: ignore[index]
            pages_of = []  # the candidates' pages' contents, in order: [layers, 2, 1, page, heads, dim] each
            ids = []  # and their pages (resident: the window's last frames, then the chunk just committed)
            for f in range(first, first + per):
                rec = sm.committed[b][f // per]
                base = f % per * page_frame
                pages_of += [rec.lane_data(lane)[:, :, base + o : base + o + 1] for o in range(page_frame)]
                ids += [rec.lane_pages(lane)[base + o] for o in range(page_frame)]
            data = torch.cat([pages_of[o] for o in offsets], dim=2)
            pool = sm.cm.pools[lane]
            assert same_bits(pool.pages([ids[o] for o in offsets]), data), "a candidate page changed since its commit"
            pool.copy([ids[o] for o in offsets], reserved)  # the bytes as they are (an FP8 pool's codes too)
            others = ((reserved, data),) * (len(self.lanes) - 1)
            start = first * page_frame * self.page
            sm.selected[lane][b] = SelectedView(
                reserved, len(reserved) * self.page, start, data, others, None, offsets, self.page
            )
            event(f"content selection of {len(offsets)} page(s) made")

    def m_choose(
        self, sm: SessionModel, b: str, group: int, score_layer: int, found: tuple[int, int], keep: int, patches: int
    ) -> tuple[int, ...]:
        """The chosen page offsets among the candidates' pages (see :meth:`m_select`), from the model's records."""
        lane = next(i for i, g in enumerate(self.lanes) if g.select is not None and g.select[4] == group
                    and score_layer in g.layers)
        g = self.lanes[lane]
        inner = g.layers.index(score_layer)
        per = g.frames[2]  # type: ignore[index]
        page_frame = self.ppc // per
        first, boundary = found

        def keys(f: int) -> torch.Tensor:  # [frame tokens, heads * dim] of frame f, float64
            rec = sm.committed[b][f // per]
            base = f % per * page_frame
            k = rec.lane_data(lane)[inner, 0, base : base + page_frame]  # [pages, page, heads, dim]
            return k.reshape(page_frame * self.page, -1).double()

        frames = [keys(f) for f in range(first, boundary + 1)]
        per_patch = page_frame * self.page // patches
        scores = []  # (score, patch number) of every candidate patch
        for i in range(per):
            a, c = frames[i], frames[i + 1]
            # torch's cosine (Forcing-KV's call), in float64: its eps bounds each norm, not their product (which
            # an FP8 pool's tiny keys, norms ~1e-4, fell under)
            cos = torch.nn.functional.cosine_similarity(a, c, dim=-1)
            for p in range(patches):
                scores.append((-float(cos[p * per_patch : (p + 1) * per_patch].mean()), i * patches + p))
        self.selection_tie = None
        if not all(math.isfinite(score) for score, _ in scores):
            return ()
        ranked = sorted(scores, key=lambda x: (-x[0], x[1]))
        best = ranked[: keep * patches]
        pages_patch = page_frame // patches
        if len(ranked) > len(best) and best[-1][0] - ranked[len(best)][0] <= SCORE_TIE:
            # the last kept and the first dropped score tie (within the library's float32 rounding): torch's topk
            # may keep either, so the model reads the library's choice back and checks it is a top k
            self.selection_tie = ({n: score for score, n in scores}, best[-1][0], pages_patch)
            return ()
        return tuple(o for _, n in sorted(best, key=lambda x: x[1]) for o in range(n * pages_patch, (n + 1) * pages_patch))

    def m_finish(self, tx: TxModel | None, success: bool) -> None:
        """Success: a committing forward is ``committed``; a denoising one ``completed`` (pending pages kept)."""
        if tx is not None:
            self.m_finished(tx, ("committed" if tx.commit else "completed") if success else "aborted")

    def predict_finish(self, tx: TxModel | None, success: bool) -> type[BaseException] | None:
        """The error when finishing ``tx`` must abort it instead of committing: ``IncompleteForwardError`` (not
        every layer wrote), then ``NonFiniteKVError`` (``check_finite``)."""
        if tx is None or not tx.is_open or not success or not tx.commit:
            return None
        if tx.written != set(range(NUM_LAYERS)):
            return IncompleteForwardError
        if not tx.cm.check_finite:
            return None
        finite = all(pool.finite(tx.pending_pages(lane)) for lane, pool in enumerate(tx.cm.pools))
        return None if finite else NonFiniteKVError

    def finish_call(self, fn: Callable[[], Any], tx: TxModel | None, success: bool) -> None:
        """Run a call that finishes ``tx`` (commit or abort, all streams); a finished ``tx``: a no-op."""
        if tx is None or not tx.is_open:
            before = self.snapshot()
            fn()
            assert self.snapshot() == before, "finishing a finished forward (or none) must change nothing"
            return
        expected = self.predict_finish(tx, success)
        try:
            fn()
            raised = None
        except (NonFiniteKVError, IncompleteForwardError) as exc:
            raised = exc
        if expected is not None:
            assert isinstance(raised, expected), f"a commit that must raise {expected.__name__} gave {raised!r}"
            event("check_finite aborted a commit" if expected is NonFiniteKVError else "an incomplete forward's commit was refused")
            assert tx.tx.status == "aborted", "a refused commit must finish (abort) the forward"
            self.m_finish(tx, False)
        else:
            assert raised is None, f"unexpected {raised!r}"
            self.m_finish(tx, success)

    def settle(self, streams: list[tuple[SessionModel, str]], commit: bool) -> None:
        """Finish (commit or abort) the open committing forwards of ``streams``, so a new forward can run."""
        for sm, b in streams:
            tx = sm.forward[b]
            if tx is not None and tx.commit:
                self.finish(tx, "cpc" if commit else "ctx.abort", tx.streams.index((sm, b)))

    def state_abort(self, sm: SessionModel, branch: str | None) -> None:
        """``state.abort(branch)``: its open forward (all streams) and its leftover pending pages are dropped."""
        names = BRANCHES if branch is None else (branch,)
        sm.state.abort(branch)
        for b in names:
            self.m_finish(sm.forward[b], False)
        for b in names:
            sm.drop_pending(b)

    def finish(self, tx: TxModel, how: str, member: int) -> None:
        sm, b = tx.streams[member % len(tx.streams)]
        if how == "cpc":
            self.finish_call(lambda: sm.state.commit_paged_context(b), sm.forward[b], True)
        elif how == "ctx.commit":
            self.finish_call(tx.ctx.commit, self.ctx_tx[tx.ctx], True)
        elif how == "ctx.abort":
            self.finish_call(tx.ctx.abort, self.ctx_tx[tx.ctx], False)
        elif how == "state.abort":
            self.state_abort(sm, b)
        elif how == "state.abort_all":
            self.state_abort(sm, None)

    def m_session_gone(self, sm: SessionModel) -> None:
        """``close()``/``reset()``: every open forward the session belongs to is aborted (all its streams)."""
        for b in BRANCHES:
            self.m_finish(sm.forward[b], False)

    def m_release_contexts_of(self, sm: SessionModel) -> None:
        sid = sm.state.session_id
        for key in [k for k in sm.cm.registry if any(s == sid for s, _ in k)]:
            self.released.add(sm.cm.registry.pop(key))

    # ================================================================== helpers: running layers
    def layer_inputs(self, ctx: ForwardContext, layer: int, mode: str):
        s, n = ctx.positions.shape
        heads = self.kv_heads
        if mode == "module":
            return (torch.randn(s, n, 2 * heads * HEAD_DIM, generator=self.gen),)
        q = torch.randn(s, n, 2 * heads, HEAD_DIM, generator=self.gen)
        k, v = token_kv(self.next_id, s, n, layer, HEAD_DIM, heads)
        self.next_id += s * n * heads
        if self.selects:  # keys in every direction: a content selection's cosines far apart (ids: V carries them)
            k = torch.randn(k.shape, generator=self.gen)
        return q, k, v

    def call_layer(self, ctx: ForwardContext, layer: int, mode: str, inputs=None):
        """One layer's forward without any model bookkeeping (for calls that must fail)."""
        inputs = inputs or self.layer_inputs(ctx, layer, mode)
        with torch.no_grad():
            if mode == "module":
                return self.attn(inputs[0], ctx.layers[layer])
            return chunk_attention(*inputs, ctx.layers[layer], **self.sink_query(ctx, inputs[0]))

    def run_layer(self, tx: TxModel, layer: int, mode: str, nan: tuple[int, int, int, float] | None = None) -> None:
        """One layer of an open forward: the write lands in the model's pending pages; the output is checked."""
        assert tx.is_open
        ctx = tx.ctx
        inputs = self.layer_inputs(ctx, layer, mode)
        s, n = ctx.positions.shape
        if mode == "module":
            x = inputs[0]
            with torch.no_grad():
                y = self.attn(x, ctx.layers[layer])
                k = self.attn.to_k(x).view(s, n, self.kv_heads, HEAD_DIM)
                v = self.attn.to_v(x).view(s, n, self.kv_heads, HEAD_DIM)
            assert y.shape == x.shape
        else:
            q, k, v = inputs
            if nan is not None and nan[0] == layer:
                _, stream, token, value = nan
                k[stream % s, token % n, 0, 0] = value
                event("wrote a non-finite K")
            out = chunk_attention(q, k, v, ctx.layers[layer], **self.sink_query(ctx, q))
        for lane, g in enumerate(self.lanes):  # each lane stores its heads of the layer
            if layer not in g.layers:
                continue
            inner = g.layers.index(layer)
            heads = list(g.heads[inner])
            for i, (sm, b) in enumerate(tx.streams):
                pages = [p for c in sm.lane_pending[lane][b] for p in c]
                tx.cm.pools[lane].write(inner, pages, k[i][:, heads], v[i][:, heads])
        tx.written.add(layer)
        if mode != "module" and (nan is None or nan[0] != layer):
            self.check_output(tx, layer, q, k, v, out)
            self.check_cross_in_forward(tx, ctx.layers[layer])

    def run(self, tx: TxModel, mode: str, nan: tuple[int, int, int, float] | None = None) -> None:
        if mode == "none":
            return
        layers = [0] if mode == "partial" else range(NUM_LAYERS)
        for layer in layers:
            self.run_layer(tx, layer, "module" if mode == "module" else "op", nan)
        self.check_view(tx)  # what it wrote is what its keys now gather (distinct ids: any mix-up shows)

    def check_output(self, tx: TxModel, layer: int, q, k, v, out) -> None:
        """The output equals a hand-written masked softmax over the model's pages (and the token mask)."""
        n = tx.shape.seq_len
        causal = tx.shape.pending_mask()  # block-causal (or all) over the model's own chunk lengths
        group = q.shape[2] // self.kv_heads
        for i, (sm, b) in enumerate(tx.streams):
            k_now, v_now = self.read_back(layer, k[i], v[i])  # [n, kv heads, dim]
            expect = torch.empty_like(out[i])
            for head in range(self.kv_heads):  # each kv head reads what its own group keeps
                lane, inner, at = self.head_home_of(layer, head)
                pool = tx.cm.pools[lane]
                hist = [p for c in self.visible(sm, b, lane) for p in c]
                keys = torch.cat([pool.head_tokens(inner, 0, hist, at), k_now[:, head]])
                values = torch.cat([pool.head_tokens(inner, 1, hist, at), v_now[:, head]])
                h = self.history_tokens(sm, b, lane)
                assert h == len(hist) * self.page
                mask = torch.cat([torch.ones(n, h, dtype=torch.bool), causal], dim=1)
                lane_mask = self.lane_mask(tx, i, lane)
                if lane_mask is not None:
                    mask &= lane_mask
                qh = q[i][:, head * group : (head + 1) * group]
                logits = torch.einsum("thd,kd->thk", qh, keys) * HEAD_DIM**-0.5
                w = torch.softmax(logits.masked_fill(~mask[:, None, :], float("-inf")), dim=-1)
                expect[:, head * group : (head + 1) * group] = torch.einsum("thk,kd->thd", w.nan_to_num(0.0), values)
            torch.testing.assert_close(out[i], expect, rtol=1e-5, atol=1e-5)

    def head_home_of(self, layer: int, head: int) -> tuple[int, int, int]:
        """Where kv head ``head`` of model layer ``layer`` lives: (lane, layer in the lane, head in the lane)."""
        if not self.grouped:
            return 0, layer, head
        return self.head_home[(layer, head)]

    def check_cross_in_forward(self, tx: TxModel, layer: LayerContext) -> None:
        """The forward sees each stream's cross cache as of its prepare, or raises when any stream lacked it then."""
        if all(tag is not None for tag in tx.cross):
            k, v = layer.cross_kv("text")
            for i, tag in enumerate(tx.cross):
                ek, ev = self.cross_value(tag, layer.layer_index)
                assert torch.equal(k[i], ek) and torch.equal(v[i], ev)
        else:
            with pytest.raises(CrossAttentionNotPopulatedError):
                layer.cross_kv("text")
        with pytest.raises(UnknownCacheError):
            layer.cross_kv("image")
