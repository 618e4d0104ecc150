"""The machine's state and setup, the hooks the FP8 machine overrides, and helpers: picking caches, sessions and
streams; chunk lengths; snapshots of everything a failed call must leave unchanged."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize

from ardiff_modules import ChunkSelfAttention, CrossAttentionSpec, ForwardContext, HeadRetention, KVCache, KVCacheSpec
from ardiff_modules import FrameWindowPolicy, SelectedFramesPolicy, ShotSinkPolicy, SinkWindowPolicy
from ardiff_modules.errors import SequenceLengthError
from tests.support.pool_model import PoolContents, shot_visible
from tests.support.failures import FlakyPlanBackend
from tests.support.session_model import (
    BRANCHES,
    cross_value,
    CROSS_TOKENS,
    CacheModel,
    Chunk,
    ChunkRecord,
    FrameView,
    GEOMETRIES,
    HEAD_DIM,
    LaneModel,
    MAX_SESSIONS,
    NUM_LAYERS,
    SelectedView,
    SessionModel,
    Shape,
    frame_view,
    TRACKED_CONTEXTS,
    TxModel,
    retention_shapes,
)

#: Capabilities a grouped draw never uses (the model does not know their semantics with retention groups yet). Keys
#: are rule names (those rules get a precondition, ``session_machine/__init__.py``) or a capability a rule or the
#: setup draws (``supports``). Enabling one with groups is deleting its line. Empty: suspend/resume, session files,
#: token masks, re-cache (over plain paging or contiguous extents: ``RecacheRules.recache_grouped``) and relative sinks
#: are modelled per lane.
NOT_YET_WITH_GROUPS: dict[str, str] = {}


#: What the machine's setup draws (the specialised machines replace some: ``@initialize(**{**SETUP_DRAWS, ...})``).
SETUP_DRAWS = dict(
    sink=st.integers(0, 2),
    window=st.sampled_from([0, 1, 2, 3, None]),
    geometry=st.sampled_from(GEOMETRIES),
    pending_default=st.sampled_from(["block_causal", "bidirectional"]),
    pool_chunks=st.integers(3, 18),
    extents=st.booleans(),
    max_contexts=st.sampled_from([1, 2, 3, 64]),
    check_finite=st.booleans(),
    sessions=st.integers(1, MAX_SESSIONS),
    relative=st.booleans(),
    shots=st.sampled_from([0, 1, 1, 2]),
    shape=retention_shapes(),
)


class MachineBase(RuleBasedStateMachine):
    #: Whether the setup draws retention groups (the FP8 machine: uniform only, its ids and scales are one head's).
    DRAWS_GROUPS = True
    #: Whether the setup draws a content-selected cache.
    DRAWS_SELECTION = True

    def __init__(self) -> None:
        super().__init__()
        self.caches: list[CacheModel] = []
        self.sessions: list[SessionModel] = []
        self.contexts: list[ForwardContext] = []  # recently prepared contexts, for stale use / ctx.commit()
        self.ctx_tx: dict[ForwardContext, TxModel] = {}  # every context seen -> its latest transaction
        self.released: set[ForwardContext] = set()  # contexts the model says the cache released
        self.txs: list[TxModel] = []  # recent transactions, whose status is checked
        self.tags = itertools.count(1)
        self.next_id = 1  # K/V ids: one per (forward, stream, token, layer)
        #: ``(id(session), branch, lane)`` whose current commit re-chooses its selection in place (``m_in_place``).
        self.in_place: set[tuple[int, str, int]] = set()
        self.gen = torch.Generator().manual_seed(0)
        with torch.random.fork_rng():  # deterministic weights without touching the global RNG
            torch.manual_seed(0)
            # 2 query heads over 1 KV head (GQA), head_dim 2: the layer writes K/V into the tiny pool.
            self.attn = ChunkSelfAttention(2 * HEAD_DIM, 2, num_kv_heads=1, head_dim=HEAD_DIM)

    # ================================================================== setup
    @initialize(**SETUP_DRAWS)
    def setup(
        self, sink: int, window: int | None, geometry: tuple[int, int], pending_default: str, pool_chunks: int,
        extents: bool, max_contexts: int, check_finite: bool, sessions: int, relative: bool, shots: int,
        shape: tuple = ("uniform",),
    ) -> None:
        self.chunk, page_size = geometry
        self.ppc = self.chunk // page_size
        uniform_kinds = ("uniform", "frames", "selected")
        if shape[0] == "selected" and not self.DRAWS_SELECTION:
            shape = ("uniform",)
        self.grouped = self.DRAWS_GROUPS and shape[0] not in uniform_kinds
        if shape[0] in uniform_kinds[1:] or (shape[0] != "uniform" and not self.grouped):
            shape = shape if shape[0] in uniform_kinds[1:] else ("uniform",)
        if shape[0] in uniform_kinds[1:]:
            # One FrameWindowPolicy (or SelectedFramesPolicy): the chunks holding its kept frames are its sinks /
            # window (rounded up).
            frames = self.m_frames(*shape[1:4])
            sink_frames, window_frames, per_chunk = frames
            self.sinks = -(-sink_frames // per_chunk)
            self.window = None if window_frames is None else -(-window_frames // per_chunk)
            self.shot_chunks = 0
            select = self.m_select_group(shape, per_chunk, 0, [[0]] * NUM_LAYERS) if shape[0] == "selected" else None
            policy = FrameWindowPolicy(*frames) if select is None else SelectedFramesPolicy(*frames, *select[:4])
            retention = {"retention": policy}
            self.kv_heads = 1
            self.lanes = [
                LaneModel(self.sinks, self.window, 0, tuple(range(NUM_LAYERS)), ((0,),) * NUM_LAYERS, frames, select)
            ]
            event(f"frame retention: sink_frames={sink_frames} window_frames={window_frames} per chunk {per_chunk}")
            if select is not None:
                event(f"content selection: keep_frames={select[0]} patches_per_frame={select[1]} from {select[2]}")
        elif self.grouped:
            retention = self.m_groups(shape, shots)
            relative = relative and self.supports("relative_sinks")
        else:
            # A shot sink of `shots` chunks (ShotSinkPolicy: begin_shot pins them) where the window has room for it.
            self.sinks, self.window = sink, window
            self.shot_chunks = min(shots, window) if window is not None else 0
            retention = (
                {"retention": ShotSinkPolicy(sink, window, self.shot_chunks)} if self.shot_chunks
                else {"sink_chunks": sink, "window_chunks": window}
            )
            self.kv_heads = 1
            self.lanes = [LaneModel(sink, window, self.shot_chunks, tuple(range(NUM_LAYERS)), ((0,),) * NUM_LAYERS)]
        if self.shot_chunks:
            event(f"shot sink of {self.shot_chunks} chunk(s)")
        self.spec = KVCacheSpec(
            num_layers=NUM_LAYERS,
            num_kv_heads=self.kv_heads,
            # GQA (2 query heads a kv head): a grouped forward splits the query heads per lane
            num_qo_heads=2 * self.kv_heads if self.grouped else None,
            head_dim=HEAD_DIM,
            chunk_size=self.chunk,
            page_size=page_size,
            branches=BRANCHES,
            cross_attention=(CrossAttentionSpec("text", CROSS_TOKENS),),
            dtype="float32",
            pending_attention=pending_default,
            relative_sinks=relative and self.sinks > 0,
            **retention,
            **self.spec_extra(),
        )
        if self.spec.relative_sinks:
            event("relative-position sinks")
        self.ppc = self.spec.pages_per_chunk
        self.page = page_size
        event(f"geometry: chunk_size={self.chunk} page_size={page_size}, pending rule default {pending_default}")
        cm = self.new_cache(pool_chunks, extents, max_contexts, check_finite)
        for _ in range(sessions):
            self.sessions.append(SessionModel(cm.cache.open_session(), cm))

    def m_frames(self, sink_frames: int, window_frames: int | None, per_chunk: int) -> tuple[int, int | None, int]:
        """A drawn frame group for this geometry: its frames per chunk split a chunk into frames of whole pages."""
        return sink_frames, window_frames, math.gcd(per_chunk, self.ppc)

    def m_select_group(self, group: tuple, per_chunk: int, g: int, rows: list) -> tuple[int, int, int, int, int]:
        """A drawn content-selected group for this geometry: ``(keep_frames, patches_per_frame, select_from,
        score_layer, g)`` -- at most ``per_chunk`` kept frames, patches of whole pages, a score layer holding heads
        of group ``g`` (``rows``: the group of each layer's kv heads)."""
        keep, patches, select_from, score_layer = group[4:8]
        patches = math.gcd(patches, self.ppc // per_chunk)
        if g not in rows[score_layer]:
            score_layer = next(layer for layer, row in enumerate(rows) if g in row)
        return min(keep, per_chunk), patches, select_from, score_layer, g

    @property
    def selects(self) -> bool:
        """Whether a lane chooses frames by content (a committing forward of several chunks is refused)."""
        return any(lane.select is not None for lane in self.lanes)

    @property
    def framed(self) -> bool:
        """Whether a lane counts frames (a forward of shorter chunks is refused)."""
        return any(lane.frames is not None for lane in self.lanes)

    def m_groups(self, shape: tuple, shots: int) -> dict[str, Any]:
        """A grouped draw: the ``head_retention`` spec field, and the model's lanes (``self.lanes``) from the drawn
        groups. ``shots``: the first group pins a shot sink of that many chunks where its window has room."""
        kind, heads = shape[0], shape[1]
        self.kv_heads = heads
        raw = list(dict.fromkeys(shape[2]))
        if kind == "per_layer":
            rows = [[raw.index(policy)] * heads for policy in shape[2]]  # group i: the i-th distinct policy
        else:
            rows = [list(r) for r in shape[3]]
        groups = []  # (sink, window, shot chunks, frames, select) of each group, in declaration order
        for i, group in enumerate(raw):
            if len(group) >= 4:  # a frame group: the chunks holding its kept frames (rounded up)
                frames = self.m_frames(*group[1:4])
                sf, wf, per = frames
                select = self.m_select_group(group, per, i, rows) if group[0] == "selected" else None
                groups.append((-(-sf // per), None if wf is None else -(-wf // per), 0, frames, select))
                continue
            sink, window = group
            groups.append((sink, window, min(shots, window) if i == 0 else 0, None, None))

        def policy(g: int):  # noqa: ANN202
            sink, window, shot, frames, select = groups[g]
            if select is not None:
                return SelectedFramesPolicy(*frames, *select[:4])  # type: ignore[misc]
            if frames is not None:
                return FrameWindowPolicy(*frames)
            return ShotSinkPolicy(sink, window, shot) if shot else SinkWindowPolicy(sink, window)

        if kind == "per_layer":
            heads_map = HeadRetention.per_layer([policy(r[0]) for r in rows], heads)
        else:
            heads_map = HeadRetention({f"g{g}": policy(g) for g in range(len(groups))}, [[f"g{g}" for g in r] for r in rows])
        # The lanes the model expects: per group (declaration order), per heads-per-layer count (ascending), the
        # layers holding that many of its heads (HeadRetention.parts, restated).
        lanes = []
        for g, (sink, window, shot, frames, select) in enumerate(groups):
            found: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
            for layer, row in enumerate(rows):
                mine = tuple(h for h, x in enumerate(row) if x == g)
                if mine:
                    found.setdefault(len(mine), []).append((layer, mine))
            for count in sorted(found):
                layers = tuple(layer for layer, _ in found[count])
                lanes.append(LaneModel(sink, window, shot, layers, tuple(h for _, h in found[count]), frames, select))
        self.lanes = lanes
        # The stream's: the most sinks any group keeps (share_sinks_from), the widest window, the longest shot.
        self.sinks = max(lane.sinks for lane in lanes)
        self.window = max(lane.window for lane in lanes)  # type: ignore[type-var]
        self.shot_chunks = max(lane.shot_chunks for lane in lanes)
        #: model layer -> kv head -> (lane, its layer in the lane, its head in the lane)
        self.head_home = {
            (layer, head): (i, lane.layers.index(layer), lane.heads[lane.layers.index(layer)].index(head))
            for i, lane in enumerate(lanes) for layer in lane.layers for head in lane.heads[lane.layers.index(layer)]
        }
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.attn = ChunkSelfAttention(2 * heads * HEAD_DIM, 2 * heads, num_kv_heads=heads, head_dim=HEAD_DIM)
        event(f"retention groups: {kind}, {heads} kv heads, {len(lanes)} lanes")
        for sink, window, shot, frames, select in groups:
            if select is not None:
                event(f"content-selected group: keep_frames={select[0]} patches_per_frame={select[1]} from {select[2]}")
        return {"head_retention": heads_map}

    def m_extent_slots(self, g: LaneModel) -> int:
        """Slots of a lane's extent: ``sinks + window + 1`` chunks, or -- a frame lane -- its kept sink + window
        frames, its selection's frames and one chunk's frames (``frame_extent_slots``)."""
        if g.frames is None:
            return g.sinks + g.window + 1  # type: ignore[operator]
        sink_frames, window_frames, per = g.frames
        return sink_frames + window_frames + (g.select[0] if g.select is not None else 0) + per  # type: ignore[operator]

    def m_slot_pages(self, g: LaneModel) -> int:
        """Pages of one extent slot of a lane: a chunk's, or a frame lane's frame's."""
        return self.ppc if g.frames is None else self.ppc // g.frames[2]

    def m_lane_pages(self, num_pages: int, lane_extents: list[int]) -> list[int]:
        """Each lane's pages when ``num_pages`` pages of the whole geometry are split by one session's peak bytes
        in each lane (integer arithmetic, as ``lanes.split_budget`` says); ``lane_extents``: each lane's extent
        pages."""
        unit = 2 * self.page * HEAD_DIM * 4  # bytes of one (layer, kv head) of a float32 page
        budget = num_pages * NUM_LAYERS * self.kv_heads * unit
        sizes = [len(g.layers) * g.num_heads * unit for g in self.lanes]
        peaks = [
            len(BRANCHES) * max(self.m_history_pages(g) + self.ppc, e) * size
            for g, e, size in zip(self.lanes, lane_extents, sizes)
        ]
        return [budget * peak // sum(peaks) // size for peak, size in zip(peaks, sizes)]

    def m_history_pages(self, g: LaneModel) -> int:
        """The most history pages a branch of lane ``g`` holds: its sink + window chunks, or -- a frame lane -- at
        most its sink + window frames' pages (trimmed chunks hold only those)."""
        pages = (g.sinks + g.window) * self.ppc  # type: ignore[operator]
        if g.frames is not None:
            sf, wf, per = g.frames
            pages = min(pages, (sf + wf) * (self.ppc // per))  # type: ignore[operator]
        if g.select is not None:  # its selection, and the next one a committing forward reserves beside it
            pages += 2 * g.select[0] * (self.ppc // g.frames[2])  # type: ignore[index]
        return pages

    def supports(self, capability: str) -> bool:
        """Whether this draw may use ``capability`` (:data:`NOT_YET_WITH_GROUPS`)."""
        return not (self.grouped and capability in NOT_YET_WITH_GROUPS)

    def new_cache(self, pool_chunks: int, extents: bool, max_contexts: int, check_finite: bool) -> CacheModel:
        # A chunk lane's extent is a ring of sinks + window + 1 chunk slots; a frame lane's (a lane trimming chunks to
        # frames) one of sink + window + selected + one chunk's frame slots (core/branch_frame_extent.py).
        extents = extents and all(lane.window is not None for lane in self.lanes)
        lane_extents = [self.m_extent_slots(lane) if extents else 0 for lane in self.lanes]
        slot_pages = [self.m_slot_pages(lane) for lane in self.lanes]
        frame_slots = [extents and lane.frames is not None for lane in self.lanes]
        extent_pages = [e * s for e, s in zip(lane_extents, slot_pages)]
        if extents:
            pool_chunks += -(-max(extent_pages) // self.ppc)  # room for at least one extent
            if any(frame_slots):
                event("extents of frame slots")
        num_pages = pool_chunks * self.ppc
        if self.grouped:  # num_pages of the whole geometry, split by each lane's peak: a chunk in the smallest
            while min(self.m_lane_pages(num_pages, extent_pages)) < self.ppc:
                num_pages += self.ppc
        backend = FlakyPlanBackend()
        cache = KVCache(
            self.spec, num_pages=num_pages, device="cpu", backend=backend, contiguous_extents=extents,
            max_forward_contexts=max_contexts, check_finite=check_finite,
        )
        self.configure_cache(cache)
        assert cache._forwards.num_contexts == 0 and cache._forwards.contexts() == ()
        if self.grouped:
            got = [lane.allocator.num_pages for lane in cache._lanes]
            assert got == self.m_lane_pages(num_pages, extent_pages), f"lane pages {got}, model {num_pages}"
        # The library's lanes are the model's: the same layers and heads (their retention is the model's own).
        got = [(lane.layers, lane.part.heads if lane.part is not None else ((0,),) * NUM_LAYERS) for lane in cache._lanes]
        assert got == [(lane.layers, lane.heads) for lane in self.lanes], f"lanes {got}, model {self.lanes}"
        assert [lane.extent_chunks or 0 for lane in cache._lanes] == lane_extents
        assert [lane.frame_slots for lane in cache._lanes] == frame_slots
        assert [lane.extent_pages for lane in cache._lanes] == extent_pages
        cm = CacheModel(
            cache, backend, extents, lane_extents, max_contexts, check_finite,
            [self.pool_model(cache, lane) for lane in range(len(self.lanes))], label=f"cache{len(self.caches)}",
            lane_slot_pages=slot_pages, lane_frame_slots=frame_slots,
        )
        self.caches.append(cm)
        event(f"cache: extents={extents} max_contexts={max_contexts} check_finite={check_finite}")
        return cm

    # ================================================================== hooks (the FP8 machine overrides them)
    def spec_extra(self) -> dict[str, Any]:
        """Extra ``KVCacheSpec`` fields (the float machine: none, a float32 pool)."""
        return {}

    def configure_cache(self, cache: KVCache) -> None:
        """Runs right after a cache is created, before anything is written to it."""

    def pool_model(self, cache: KVCache, lane: int = 0) -> PoolContents:
        """The model of the pool contents of ``cache``'s lane ``lane`` (float32 values, compared bit for bit)."""
        return PoolContents(cache._lanes[lane].pool.kv)

    def pool_values(self, cm: CacheModel, lane: int = 0) -> torch.Tensor:
        """A lane's pool as float32 values ``[lane layers, 2, pages, page_size, lane heads, dim]`` (what the model
        compares)."""
        return cm.cache._lanes[lane].pool.kv

    def read_back(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What a forward's keys read back of the ``k``/``v`` ``[..., heads, dim]`` it wrote (float: themselves)."""
        return k, v

    # ================================================================== helpers: selection
    @property
    def open_caches(self) -> list[CacheModel]:
        return [c for c in self.caches if not c.closed]

    @property
    def open_sessions(self) -> list[SessionModel]:
        return [s for s in self.sessions if not s.closed]

    @property
    def closed_sessions(self) -> list[SessionModel]:
        return [s for s in self.sessions if s.closed]

    def sessions_of(self, cm: CacheModel) -> list[SessionModel]:
        return [s for s in self.sessions if s.cm is cm and not s.closed]

    @staticmethod
    def pick(pool: list, index: int):
        return pool[index % len(pool)]

    def pick_streams(
        self, candidates: list[SessionModel], index: int, others: list[int], branch_sets: list[tuple[str, ...]]
    ) -> list[tuple[SessionModel, str]]:
        """Up to three distinct sessions of one cache (the first from ``candidates``), each with a branch set."""
        first = self.pick(candidates, index)
        same = self.sessions_of(first.cm)
        chosen = [first]
        pos = same.index(first)
        for off in others:
            sm = same[(pos + off) % len(same)]
            if sm not in chosen:
                chosen.append(sm)
        return [(sm, b) for sm, bs in zip(chosen, branch_sets) for b in bs]

    def visible_data(self, sm: SessionModel, branch: str, lane: int = 0) -> list[ChunkRecord]:
        """The committed chunks lane ``lane`` keeps of a stream, under its group's retention."""
        g = self.lanes[lane]
        if g.frames is not None:
            return self.frame_visible(sm, branch, lane)
        return shot_visible(
            sm.committed[branch], g.sinks, g.window, g.shot_chunks, sm.floor[branch], sm.resident_shot[branch]
        )

    def frame_visible(self, sm: SessionModel, branch: str, lane: int) -> list[ChunkRecord]:
        """A frame lane's kept chunks, each trimmed to its kept frames (:class:`FrameView`), re-stated by frame:
        stream frame ``g = i * F + f`` of chunk ``i`` stays when ``g < sink_frames`` or ``g >= committed frames -
        window_frames`` (``None``: all); a chunk shared as a sink alone (``share_sinks_from``) holds its sink frames
        only; a dropped window (``drop_window``) took every chunk below its floor but the sink chunks, and of those
        their window frames (a sink chunk holds only its sink frames from then on)."""
        sink_frames, window_frames, per = self.lanes[lane].frames  # type: ignore[misc]
        committed = sm.committed[branch]
        total = len(committed) * per
        sink_chunks = -(-sink_frames // per)
        page_frame = self.ppc // per
        out: list[ChunkRecord] = []
        held_sinks = 0
        for i, rec in enumerate(committed):
            if i >= sink_chunks and i < sm.floor[branch]:
                continue
            frames = [
                f for f in range(per)
                if i * per + f < sink_frames
                or (i >= sm.sink_only[branch] and i >= sm.floor[branch]
                    and (window_frames is None or i * per + f >= total - window_frames))
            ]
            if frames:
                offsets = tuple(f * page_frame + p for f in frames for p in range(page_frame))
                out.append(frame_view(rec, lane, offsets, self.page))
                held_sinks += i < sink_chunks
        selected = sm.selected[lane][branch]
        if selected is not None:  # after the sink chunks (those it holds)
            out.insert(held_sinks, selected)
        return out

    def visible(self, sm: SessionModel, branch: str, lane: int = 0) -> list[Chunk]:
        """The pages of what lane ``lane`` attends of a stream's history (its chunks, and its content selection)."""
        return [rec.lane_pages(lane) for rec in self.visible_data(sm, branch, lane)]

    def chunks_visible(self, sm: SessionModel, branch: str, lane: int = 0) -> list[Chunk]:
        """:meth:`visible` less a content selection (``history_chunks``: the committed chunks it keeps)."""
        return [r.lane_pages(lane) for r in self.visible_data(sm, branch, lane) if not isinstance(r, SelectedView)]

    def m_relocate(
        self, sm: SessionModel, b: str, rec: ChunkRecord, pages: dict[int, Chunk],
        data: dict[int, torch.Tensor] | None = None,
    ) -> ChunkRecord:
        """``rec`` (a committed chunk of ``sm``/``b``) now in other pages in some lanes (``pages``: lane -> its
        pages; ``data``: lane -> its contents, else the ones it had): the record replaced in that stream only (a
        fork keeps the old one)."""
        data = data or {}
        rec = rec.base
        lanes = range(len(self.lanes))
        pages, data = dict(pages), dict(data)
        for lane, new in list(pages.items()):  # a trimmed chunk moved: its kept pages (the rest are never seen)
            full = rec.lane_pages(lane)
            if len(new) == len(full):
                continue
            view = next(v for v in self.visible_data(sm, b, lane) if v.base is rec)
            assert isinstance(view, FrameView) and len(view.offsets) == len(new), (view, new)
            spliced = list(full)
            for o, p in zip(view.offsets, new):
                spliced[o] = p
            pages[lane] = tuple(spliced)
            if lane in data:
                whole = rec.lane_data(lane).clone()
                whole[:, :, list(view.offsets)] = data[lane]
                data[lane] = whole
        lp = [tuple(pages.get(lane, rec.lane_pages(lane))) for lane in lanes]
        ld = [data.get(lane, rec.lane_data(lane)) for lane in lanes]
        new = ChunkRecord(lp[0], rec.tokens, rec.start, ld[0], tuple(zip(lp[1:], ld[1:])))
        at = next(j for j, r in enumerate(sm.committed[b]) if r is rec)
        sm.committed[b][at] = new
        return new

    def m_moved_selection(self, selected: SelectedView, pages: Chunk) -> SelectedView:
        """``selected`` (a content selection) now in ``pages`` (a resume), the same contents."""
        others = ((pages, selected.data),) * (len(self.lanes) - 1)
        return dataclasses.replace(selected, pages=pages, others=others)

    def cross_value(self, tag: float, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return cross_value(tag, layer, self.kv_heads)

    def m_sink_split(
        self, records: list[ChunkRecord], sm: SessionModel, branch: str, first_pending: int, lane: int = 0
    ) -> tuple[int, int]:
        """``(sink keys, shift)``: the leading keys relative sinks move, and the tokens added to their positions --
        they end just before the first visible non-sink position (the oldest window chunk's, a content selection's
        candidates' first, else the first pending one). The sinks: the sink chunks' runs of held tokens, up to the
        first run of a frame lane's sink chunk that holds no sink frame (a window frame it still holds early on);
        ``(0, 0)`` without relative sinks or sinks."""
        if not self.spec.relative_sinks:
            return 0, 0
        g = self.lanes[lane]
        sink_ids = {id(r) for r in sm.committed[branch][: g.sinks]}  # the lane's group's sinks
        sink_end = None
        keys = 0
        rest: list[int] = []  # first position of each run after the sinks
        leading = True
        for r in records:
            for start, tokens in r.spans():
                is_sink = id(r.base) in sink_ids and (
                    g.frames is None
                    or start < g.frames[0] * (self.ppc // g.frames[2]) * self.page  # holds a sink frame
                )
                if leading and is_sink:
                    keys, sink_end = keys + tokens, start + tokens
                else:
                    leading = False
                    rest.append(start)
        if sink_end is None:
            return 0, 0
        return keys, (min(rest) if rest else first_pending) - sink_end

    def m_sink_shift(
        self, records: list[ChunkRecord], sm: SessionModel, branch: str, first_pending: int, lane: int = 0
    ) -> int:
        """Tokens the forward adds to the sinks' positions (:meth:`m_sink_split`); 0 without relative sinks."""
        return self.m_sink_split(records, sm, branch, first_pending, lane)[1]

    def sink_query(self, ctx: ForwardContext, q: torch.Tensor) -> dict[str, torch.Tensor]:
        """``sink_query=`` for ``chunk_attention`` when the cache has relative sinks: ``q`` itself (no RoPE
        here, so the merged two-segment attention must equal the single softmax the model checks)."""
        return {"sink_query": q} if ctx.relative_sinks else {}

    # ================================================================== helpers: chunk lengths
    def shape(self, raw: tuple) -> Shape:
        """A drawn shape ``(pages, explicit[, rule])``: ``None`` a full chunk, ``k`` a chunk of
        ``min(k, pages_per_chunk)`` pages; ``rule`` the ``pending_attention`` the call passes (``None``: none)."""
        pages, explicit, *rest = raw
        rule = rest[0] if rest else None
        lengths = tuple(self.chunk if p is None else min(p, self.ppc) * self.page for p in pages)
        implied = all(n == self.chunk for n in lengths) or len(lengths) == 1
        shape = Shape(lengths, explicit or not implied, rule, (rule or self.spec.pending_attention) == "bidirectional")
        if len(lengths) > 1:
            event(f"multi-chunk forward, pending rule {rule or 'default ' + self.spec.pending_attention}")
        kind = "mixed" if len(set(lengths)) > 1 else "full" if lengths[0] == self.chunk else "short"
        event(f"chunk lengths {kind}, passed as {'chunk_lengths' if shape.explicit else 'seq_len'}")
        return self.whole_in_frames(shape)

    def whole_in_frames(self, shape: Shape) -> Shape:
        """``shape``; with a frame lane, a shape of shorter chunks is refused (``SequenceLengthError``, nothing
        changed -- asked of a resident session, as the call says it) and the rule goes on with whole chunks."""
        if not self.framed or all(n == self.chunk for n in shape.lengths):
            return shape
        resident = [sm for sm in self.open_sessions if not sm.cm.closed and not sm.suspended]
        if resident:
            sm = resident[len(shape.lengths) % len(resident)]
            fn, args, kwargs = self.prepare_call([(sm, BRANCHES[0])], shape, False, "state")  # type: ignore[attr-defined]
            self.expect_failure(SequenceLengthError, fn, *args, match="whole chunks", **kwargs)
            event("frame lane: shorter chunks refused")
        return Shape((self.chunk,) * shape.num_chunks, shape.explicit, shape.rule, shape.bidirectional)

    @property
    def default_bidirectional(self) -> bool:
        return self.spec.pending_attention == "bidirectional"

    def full(self, num_chunks: int = 1) -> Shape:
        return Shape((self.chunk,) * num_chunks, bidirectional=self.default_bidirectional)

    def short(self, pages: int) -> Shape:
        """One chunk of ``pages`` pages (capped): e.g. an image-to-video first chunk of one latent frame."""
        return self.whole_in_frames(Shape((min(pages, self.ppc) * self.page,), bidirectional=self.default_bidirectional))

    def reused(self, sm: SessionModel, b: str, shape: Shape) -> int:
        """Leading pending chunks a forward of ``shape`` keeps as they are: those of the same length."""
        k = 0
        old = sm.pending_tokens[b]
        while k < min(len(old), shape.num_chunks) and old[k] == shape.lengths[k]:
            k += 1
        return k

    def chunk_references(self, cm: CacheModel, lane: int = 0) -> Counter[int]:
        """References to each page of ``cm``'s pool (lane ``lane``) from chunks (visible or pending) of its open
        sessions."""
        refs: Counter[int] = Counter()
        for sm in self.sessions_of(cm):
            if sm.suspended:
                continue
            for b in BRANCHES:
                refs.update(p for c in self.visible(sm, b, lane) + sm.lane_pending[lane][b] for p in c)
        return refs

    def slots_of(self, sm: SessionModel, b: str, lane: int = 0) -> list[Chunk]:
        """A branch's extent slots in ``lane``: chunk slots, or frame slots (a frame's pages each)."""
        ext = sm.lane_extent[lane][b] or ()
        step = sm.cm.lane_slot_pages[lane] if sm.cm.lane_slot_pages else self.ppc
        return [tuple(ext[i : i + step]) for i in range(0, len(ext), step)]

    def free_slots(self, sm: SessionModel, b: str, lane: int = 0) -> list[Chunk]:
        """Extent slots of a branch (in ``lane``) that no chunk anywhere references (a fork may still see an
        evicted one), nor a content selection, nor pages a committing forward reserved for one."""
        refs = self.chunk_references(sm.cm, lane)
        refs.update(p for other in self.sessions_of(sm.cm) for bb in BRANCHES for p in other.reserved[lane][bb])
        return [slot for slot in self.slots_of(sm, b, lane) if not any(refs[p] for p in slot)]

    @staticmethod
    def m_place_in_frames(sizes: list[int], free: list[Chunk], step: int) -> list[Chunk | None]:
        """Frame slots, re-stated: per chunk of ``sizes`` pages, the pages of the ``ceil(pages / step)`` lowest
        ``free`` frame slots (``step`` pages each; consumed from ``free``), or ``None`` when too few are left (it
        takes pool pages)."""
        placed: list[Chunk | None] = []
        for n in sizes:
            count = -(-n // step)
            if count > len(free):
                placed.append(None)
                continue
            placed.append(tuple(p for slot in free[:count] for p in slot)[:n])
            del free[:count]
        return placed

    def m_frame_image(self, sm: SessionModel, b: str, lane: int) -> tuple[list[Chunk], list[tuple[int, ...]], Chunk,
                                                                          tuple[int, ...]]:
        """What a suspend or a save records of a frame-slot lane's branch (``frame_slots_of``, re-stated): its kept
        chunks' pages and the frame slot of each of their frames, its selection's pages and slots. Where every page
        sits in the branch's extent, the slots they have; else (a fork's shared pages outside its extent, or no
        extent) consecutive slots in attention order (the selection after the sink chunks it holds)."""
        step = sm.cm.lane_slot_pages[lane]
        records = self.visible_data(sm, b, lane)
        pages = [r.lane_pages(lane) for r in records]
        extent = sm.lane_extent[lane][b] or ()
        offset = {p: i for i, p in enumerate(extent)}
        if extent and all(p in offset for c in pages for p in c):
            slots = [tuple(offset[c[i]] // step for i in range(0, len(c), step)) for c in pages]
        else:
            slots, first = [], 0
            for c in pages:
                count = -(-len(c) // step)
                slots.append(tuple(range(first, first + count)))
                first += count
        at = next((i for i, r in enumerate(records) if isinstance(r, SelectedView)), None)
        if at is None:
            return pages, slots, (), ()
        return pages[:at] + pages[at + 1 :], slots[:at] + slots[at + 1 :], pages[at], slots[at]

    def m_frame_layout(
        self, image: tuple, extent: tuple[int, ...], step: int
    ) -> tuple[list[Chunk], Chunk | None]:
        """Where a resume or a load puts a frame-slot branch's pages in its fresh ``extent`` (``lane_store.lay_out``,
        re-stated for a frame ring): each frame in the slot :meth:`m_frame_image` names, the selection in its own
        slots when it fits in the ring beside the chunks (else -- ``None`` -- plain pages, and the chunks in
        history order, lowest slots first)."""
        chunks, slots, selection, own = image
        count = len(extent) // step
        frames = [-(-len(c) // step) for c in chunks]
        in_ring = bool(selection) and sum(frames) + -(-len(selection) // step) <= count
        if selection and not in_ring:
            event("frame extents: a resumed selection does not fit the ring (plain pages, chunks in history order)")
            first, slots = 0, []
            for n in frames:
                slots.append(tuple(range(first, first + n)))
                first += n
        laid = [tuple(p for sl in ss for p in extent[sl * step : (sl + 1) * step])[: len(c)] for ss, c in zip(slots, chunks)]
        mine = tuple(p for sl in own for p in extent[sl * step : (sl + 1) * step])[: len(selection)] if in_ring else None
        return laid, mine

    def alloc_before(self, cm: CacheModel) -> tuple[list[set[int]], list[int]]:
        """Each lane's free pages and used count (what ``m_prepared`` checks a forward's new pages against)."""
        lanes = cm.cache._lanes
        return [set(lane.allocator.free_pages()) for lane in lanes], [lane.allocator.num_used for lane in lanes]

    def track(self, ctx: ForwardContext) -> None:
        self.contexts = [c for c in self.contexts if c is not ctx][-(TRACKED_CONTEXTS - 1) :] + [ctx]

    # ================================================================== helpers: snapshots
    def snapshot(self, skip: dict[int, list[set[int]]] | None = None) -> tuple:
        """Everything a failed operation must leave untouched (all caches, contexts and transactions); ``skip``:
        per cache (``id``), per lane, pages whose contents are left out (an open forward's reserved selection
        pages, which a failed commit may have filled)."""
        caches = []
        for cm in self.caches:
            c = cm.cache
            allocs = tuple(
                (lane.allocator.free_pages(), tuple(lane.allocator.refcount(p) for p in range(lane.allocator.num_pages)),
                 lane.allocator.peak_used)
                for lane in c._lanes
            )
            head = (
                c.is_closed,
                tuple(a[0] for a in allocs),
                tuple(a[1] for a in allocs),
                tuple(a[2] for a in allocs),
                c._forwards.num_contexts,
                tuple(id(x) for x in c._forwards.contexts()),
                tuple(sorted(c.sessions)),
            )
            # bit-exact (NaN payloads too); as bytes, as numpy has no float8
            pool = None if c.is_closed else tuple(
                self.pool_bytes(lane.pool.kv, (skip or {}).get(id(cm), [set()] * len(c._lanes))[n])
                for n, lane in enumerate(c._lanes)
            )
            caches.append((head, pool))
        sessions = []
        for sm in self.sessions:
            st_ = sm.state
            if st_.is_closed:
                sessions.append(("closed", st_.session_id))
                continue
            branches = []
            for b in BRANCHES:
                forward = st_._open_forward(b)
                cross = None
                if st_.is_cross_attention_populated(b, "text"):
                    cross = [(d["k"].tolist(), d["v"].tolist()) for d in st_.get_cross_attention_kv(b, "text")]
                branches.append(
                    (
                        st_.history_chunks(b),
                        st_.pending_chunks(b),
                        st_.token_offset(b),
                        st_.committed_chunks(b),
                        None if forward is None else (id(forward), forward.status),
                        cross,
                        tuple((p.history_chunks, p.pending, p.extent, p.window_floor) for p in st_._lane_pages(b)),
                    )
                )
            sessions.append((st_.session_id, tuple(branches)))
        contexts = tuple(
            (id(ctx), id(ctx._transaction), ctx._transaction.status if ctx._transaction else None, ctx._released)
            for ctx in self.ctx_tx
        )
        txs = tuple((id(t.tx), t.tx.status) for t in self.txs)
        return tuple(caches), tuple(sessions), contexts, txs

    @staticmethod
    def pool_bytes(kv: torch.Tensor, skip: set[int]) -> bytes:
        if skip:
            kv = kv.clone()
            kv[:, :, sorted(skip)] = 0
        return kv.view(torch.uint8).numpy().tobytes()

    def expect_failure(self, exc, fn: Callable, *args, match: str | None = None, **kwargs) -> BaseException:
        before = self.snapshot()
        with pytest.raises(exc) as info:
            fn(*args, **kwargs)
        if match is not None:
            assert match in str(info.value), f"{info.type.__name__} message {str(info.value)!r} lacks {match!r}"
        after = self.snapshot()
        name = getattr(fn, "__name__", repr(fn))
        assert after == before, f"failed {name} ({info.type.__name__}) changed state: {self.diff(before, after)}"
        return info.value

    @staticmethod
    def diff(before: tuple, after: tuple) -> str:
        """Which parts of two snapshots differ (for failure messages)."""
        labels = ("closed", "free pages", "refcounts", "peak_pages_used", "num_forward_contexts",
                  "forward_contexts() (identity, LRU order)", "session ids")
        out = []
        for i, (a, b) in enumerate(zip(before[0], after[0])):
            out += [f"cache{i} {label}: {x} -> {y}" for label, x, y in zip(labels, a[0], b[0]) if x != y]
            if a[1] != b[1]:
                out.append(f"cache{i} pool contents")
        rest = zip(("sessions", "contexts", "transactions"), before[1:], after[1:])
        out += [f"{label} differ" for label, a, b in rest if a != b]
        return "; ".join(out)
