"""The plain model the session state machine (``tests/support/session_machine/``) compares the library with.

* per session and branch: every chunk ever committed as a :class:`ChunkRecord` (the page tuple the library
  reported, its token count -- the length the model asked for --, its absolute start position -- the model's
  running sum of committed tokens --, and the pool contents it was committed with), the pending chunks with the
  token count of each, the open forward it belongs to, the extent, the cross cache contents
  (:class:`SessionModel`);
* per forward: one :class:`TxModel` for the whole transaction (all its streams, of up to three sessions), with
  status open / committed / completed (a denoising forward that finished) / aborted / superseded, mirroring
  ``ForwardTransaction``;
* per cache: the forward-context registry (an LRU ``OrderedDict``), the peak of pages used, and the pool's
  contents (:class:`CacheModel`);
* the machine's geometry and the strategies its rules draw from (chunk shapes, pending rules, branch sets).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st

from ardiff_modules import ForwardContext, KVCache, KVState
from ardiff_modules.core.transaction import ForwardTransaction
from tests.support.failures import FlakyPlanBackend
from tests.support.pool_model import PoolContents

BRANCHES = ("cond", "uncond")
BRANCH_SETS = [("cond",), ("uncond",), ("cond", "uncond"), ("uncond", "cond")]
#: (chunk_size, page_size) of the machine: 1..4 pages per chunk, so chunks of 1, 2, 3 or 4 tokens.
GEOMETRIES = [(2, 1), (2, 2), (4, 1), (4, 2)]
#: Pages of one pending chunk: ``None`` a full chunk, else that many pages (capped at pages_per_chunk).
CHUNK_PAGES = st.sampled_from([None, None, None, 1, 1, 2, 3])
#: A forward's shape, drawn: the pages of each pending chunk, and whether to pass ``chunk_lengths``
#: even when ``seq_len`` alone would say it (it must whenever the lengths are mixed).
#: The rule between a forward's pending chunks, as the call says it: ``None`` (the spec's default) or by name.
PENDING_RULES = st.sampled_from([None, None, "block_causal", "bidirectional"])
SHAPES = st.tuples(st.lists(CHUNK_PAGES, min_size=1, max_size=3), st.booleans(), PENDING_RULES)
SHAPES_2 = st.tuples(st.lists(CHUNK_PAGES, min_size=1, max_size=2), st.booleans(), PENDING_RULES)
HEAD_DIM = 2
NUM_LAYERS = 2
#: A retention group's ``(sink_chunks, window_chunks)`` (bounded: a cache of several lanes splits its pages by
#: each lane's peak).
SINK_WINDOW = st.tuples(st.integers(0, 2), st.integers(0, 3))


#: A frame group's ``("frames", sink_frames, window_frames, frames_per_chunk)`` (the setup takes the frames per
#: chunk that divide the geometry's pages per chunk: ``gcd(drawn, pages_per_chunk)``).
FRAMES = st.tuples(st.just("frames"), st.integers(0, 3), st.integers(0, 5), st.sampled_from([1, 2, 4]))
#: A content-selected group's ``("selected", sink_frames, window_frames, frames_per_chunk, keep_frames,
#: patches_per_frame, select_from, score_layer)`` (``SelectedFramesPolicy``; the setup takes the frames per chunk
#: and patches per frame that divide the geometry -- gcds --, at most ``frames_per_chunk`` kept frames, and a score
#: layer holding the group's heads).
SELECTED = st.tuples(
    st.just("selected"), st.integers(0, 2), st.integers(1, 4), st.sampled_from([1, 2, 2, 4]),
    st.sampled_from([1, 1, 2, 0]), st.sampled_from([1, 2]), st.sampled_from([0, 0, 1, 2]), st.integers(0, NUM_LAYERS - 1),
)


@st.composite
def retention_shapes(
    draw: st.DrawFn, frames: bool = True, selected: bool = True, only: tuple[str, ...] | None = None
) -> tuple:
    """A retention shape: ``("uniform",)`` (the spec's own sinks / window, one kv head); ``("per_layer", kv_heads,
    policies)`` (``HeadRetention.per_layer``: one ``(sink, window)`` per layer, not all equal); ``("per_head",
    kv_heads, groups, rows)`` (``HeadRetention(groups, rows)``: 2-3 groups of distinct ``(sink, window)``, each
    kv head of each layer in one of them -- ``rows[layer][head]`` a group index --, layer 0 holding heads of
    groups 0 and 1); ``("frames", sink_frames, window_frames | None, frames_per_chunk)`` (a uniform cache of one
    ``FrameWindowPolicy``); ``("per_head_frames", ...)`` as ``per_head`` with groups mixing ``FRAMES`` and chunk
    groups (at least one of each); ``SELECTED`` (a uniform cache of one ``SelectedFramesPolicy``);
    ``("per_head_selected", ...)`` as ``per_head`` with a ``SELECTED`` group (group 0) and chunk or frame groups.
    Uniform half the time, and first (what shrinking goes to); ``only``: these kinds alone (equally often)."""
    kinds = ["uniform", "uniform", "per_layer", "per_head"] + (["frames", "per_head_frames"] if frames else [])
    kinds += ["selected", "per_head_selected"] if frames and selected else []
    kind = draw(st.sampled_from(only or kinds))
    if kind == "uniform":
        return ("uniform",)
    if kind == "frames":
        _, sink, window, per_chunk = draw(FRAMES)
        return ("frames", sink, draw(st.sampled_from([window, window, None])), per_chunk)
    if kind == "selected":
        return draw(SELECTED)
    if kind == "per_layer":
        heads = draw(st.integers(1, 3))
        policies = draw(st.lists(SINK_WINDOW, min_size=NUM_LAYERS, max_size=NUM_LAYERS).filter(lambda p: len(set(p)) > 1))
        return ("per_layer", heads, tuple(policies))
    heads = draw(st.integers(2, 4))
    if kind == "per_head_frames":
        groups = [draw(FRAMES), draw(SINK_WINDOW), *draw(st.lists(FRAMES | SINK_WINDOW, max_size=1))]
        groups = list(dict.fromkeys(draw(st.permutations(groups))))  # a frame group first or not
    elif kind == "per_head_selected":  # the selected group first: layer 0 holds its heads (its score layer)
        groups = list(dict.fromkeys([draw(SELECTED), draw(FRAMES | SINK_WINDOW), *draw(st.lists(FRAMES | SINK_WINDOW, max_size=1))]))
    else:
        groups = draw(st.lists(SINK_WINDOW, min_size=2, max_size=3, unique=True))
    row = st.lists(st.integers(0, len(groups) - 1), min_size=heads, max_size=heads)
    rows = [list(r) for r in draw(st.lists(row, min_size=NUM_LAYERS, max_size=NUM_LAYERS))]
    rows[0][0], rows[0][1] = 0, 1
    return (kind, heads, tuple(groups), tuple(tuple(r) for r in rows))


CROSS_TOKENS = 3
MAX_SESSIONS = 3  # open sessions per cache (a forward batches up to 3 sessions)
MAX_OPEN_CACHES = 2
MAX_CACHES = 4  # closed ones are kept for misuse checks
TRACKED_CONTEXTS = 8

Chunk = tuple[int, ...]
Key = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Shape:
    """The pending chunks of one forward: the tokens of each, and how the call says them."""

    lengths: tuple[int, ...]
    #: ``prepare_forward(..., chunk_lengths=lengths)``; else ``seq_len`` alone (full chunks, or one shorter chunk).
    explicit: bool = False
    #: ``prepare_forward(..., pending_attention=rule)``; ``None``: not passed (the spec's default).
    rule: str | None = None
    #: The rule in force: every pending chunk sees every pending chunk (else block-causal).
    bidirectional: bool = False

    @property
    def num_chunks(self) -> int:
        return len(self.lengths)

    @property
    def seq_len(self) -> int:
        return sum(self.lengths)

    def chunk_of(self) -> torch.Tensor:
        """int64 ``[seq_len]``: the pending chunk of each current token (the model's own lengths)."""
        return torch.repeat_interleave(torch.arange(self.num_chunks), torch.tensor(self.lengths))

    def pending_mask(self) -> torch.Tensor:
        """bool ``[seq_len, seq_len]``: query token i sees pending token j iff chunk(j) <= chunk(i), or always
        under the bidirectional rule."""
        if self.bidirectional:
            return torch.ones(self.seq_len, self.seq_len, dtype=torch.bool)
        chunk_of = self.chunk_of()
        return chunk_of[None, :] <= chunk_of[:, None]


@dataclass(frozen=True)
class LaneModel:
    """One lane of the machine's caches as the model expects it (one for a uniform spec; with retention groups one
    per head part): the retention of its group -- from the drawn groups, never read back from the library -- and
    the model layers / kv heads it stores."""

    sinks: int
    window: int | None
    shot_chunks: int
    #: Model layers this lane stores heads of (its layer ``i`` is model layer ``layers[i]``).
    layers: tuple[int, ...]
    #: ``heads[i]``: the model kv heads of lane layer ``i``, ascending.
    heads: tuple[tuple[int, ...], ...]
    #: A frame lane's ``(sink_frames, window_frames, frames_per_chunk)`` (``sinks`` / ``window``: the chunks holding
    #: them, rounded up); ``None``: a chunk lane.
    frames: tuple[int, int | None, int] | None = None
    #: A content-selected lane's ``(keep_frames, patches_per_frame, select_from, score_layer, group)`` (``group``:
    #: its retention group's index -- the lanes of one group share the choice); ``None``: it never selects.
    select: tuple[int, int, int, int, int] | None = None

    @property
    def num_heads(self) -> int:
        return len(self.heads[0])


@dataclass(frozen=True)
class ChunkRecord:
    """One committed chunk, as the model sees it (its pages and contents in lane 0; ``others``: in lanes 1...)."""

    pages: Chunk
    tokens: int  # the length the forward asked for
    start: int  # absolute position of its first token: tokens committed on the branch before it
    data: torch.Tensor  # pool contents [layers, 2, pages, page_size, heads, dim] when committed
    #: With retention groups: ``(pages, data)`` of lanes 1, 2, ... (lane 0's are ``pages`` / ``data``).
    others: tuple[tuple[Chunk, torch.Tensor], ...] = ()

    def positions(self) -> list[int]:
        return list(range(self.start, self.start + self.tokens))

    @property
    def base(self) -> ChunkRecord:
        """The committed chunk this record shows (itself; a :class:`FrameView`: the whole chunk)."""
        return self

    def spans(self) -> list[tuple[int, int]]:
        """``(first position, tokens)`` of each run of its tokens."""
        return [(self.start, self.tokens)]

    def lane_pages(self, lane: int = 0) -> Chunk:
        return self.pages if lane == 0 else self.others[lane - 1][0]

    def lane_data(self, lane: int = 0) -> torch.Tensor:
        return self.data if lane == 0 else self.others[lane - 1][1]

    def token_data(self, lane: int = 0) -> torch.Tensor:
        """``[lane layers, 2, tokens, lane heads * dim]``: K and V of every layer of the lane, in position order."""
        data = self.lane_data(lane)
        return data.reshape(*data.shape[:2], self.tokens, -1)


@dataclass(frozen=True)
class FrameView(ChunkRecord):
    """What a frame lane holds of a committed chunk (``base``): the pages of its kept frames (``offsets``: their page
    offsets in the chunk as written) in lane ``lane`` -- ``pages`` / ``data`` / ``others`` trimmed there, ``tokens``
    the kept tokens; ``start`` stays the chunk's."""

    whole: ChunkRecord | None = None
    offsets: tuple[int, ...] = ()
    page_size: int = 1

    @property
    def base(self) -> ChunkRecord:
        return self.whole  # type: ignore[return-value]

    def positions(self) -> list[int]:
        size = self.page_size
        return [self.start + o * size + t for o in self.offsets for t in range(size)]

    def spans(self) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        for p in self.positions():
            if out and out[-1][0] + out[-1][1] == p:
                out[-1] = (out[-1][0], out[-1][1] + 1)
            else:
                out.append((p, 1))
        return out


@dataclass(frozen=True)
class SelectedView(FrameView):
    """A content selection as one lane holds it: copies of the chosen candidate pages (``offsets``: their page
    offsets among the candidates' pages, ascending) in the selection's own ``pages`` / ``data`` (every lane slot
    the same: only the owning lane reads it); ``start``: the candidates' first position. Its span is nominal (one
    span at ``start``, as the library reports it without a sync), its positions exact."""

    @property
    def base(self) -> ChunkRecord:
        return self

    def spans(self) -> list[tuple[int, int]]:
        return [(self.start, self.tokens)]


def frame_view(rec: ChunkRecord, lane: int, offsets: tuple[int, ...], page_size: int) -> ChunkRecord:
    """``rec`` as a frame lane ``lane`` holds it: the pages at ``offsets`` (``rec`` itself when it holds them all)."""
    full = rec.lane_pages(lane)
    if len(offsets) == len(full):
        return rec
    pages = tuple(full[o] for o in offsets)
    data = rec.lane_data(lane)[:, :, list(offsets)]
    lanes = [(rec.pages, rec.data), *rec.others]
    lanes[lane] = (pages, data)
    return FrameView(
        lanes[0][0], len(offsets) * page_size, rec.start, lanes[0][1], tuple(lanes[1:]), rec.base, tuple(offsets),
        page_size,
    )


@dataclass(eq=False)
class CacheModel:
    cache: KVCache
    backend: FlakyPlanBackend
    extents: bool
    #: Chunk slots of each lane's extents (``0``: plain paging).
    lane_extent_chunks: list[int]
    max_contexts: int
    check_finite: bool
    #: Each lane's pool contents.
    pools: list[PoolContents]
    label: str
    #: The forward-context registry: key -> context, least recently used first.
    registry: OrderedDict[Key, ForwardContext] = field(default_factory=OrderedDict)
    #: Each lane's peak of pages used.
    peaks: list[int] = field(default_factory=list)
    closed: bool = False
    #: Pages of one extent slot in each lane: a chunk's (chunk slots), or a frame's (a frame lane's frame slots,
    #: ``core/branch_frame_extent.py``); ``[]``: every lane's a chunk's.
    lane_slot_pages: list[int] = field(default_factory=list)
    #: Whether each lane's extent slots are frames (``[]``: none are).
    lane_frame_slots: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.peaks = self.peaks or [0] * len(self.pools)
        self.lane_frame_slots = self.lane_frame_slots or [False] * len(self.pools)

    def extent_pages(self, lane: int = 0) -> int:
        """Pages of one extent of lane ``lane`` (``0``: plain paging)."""
        return self.lane_extent_chunks[lane] * self.lane_slot_pages[lane]

    @property
    def num_lanes(self) -> int:
        return len(self.pools)

    @property
    def pool(self) -> PoolContents:
        """Lane 0's pool contents (a uniform cache's only)."""
        return self.pools[0]

    @property
    def extent_chunks(self) -> int:
        return self.lane_extent_chunks[0]

    @property
    def peak(self) -> int:
        return self.peaks[0]

    @peak.setter
    def peak(self, value: int) -> None:
        self.peaks[0] = value

    def allocator(self, lane: int = 0):  # noqa: ANN201
        return self.cache._lanes[lane].allocator


@dataclass(eq=False)
class TxModel:
    """One prepared forward (all its streams), as the model sees it."""

    cm: CacheModel
    streams: list[tuple[SessionModel, str]]
    commit: bool
    shape: Shape
    ctx: ForwardContext
    tx: ForwardTransaction  # the library's transaction object, for identity checks
    token_mask: torch.Tensor | None = None
    status: str = "open"
    #: Layers the forward wrote (a commit needs every one: else IncompleteForwardError, aborted).
    written: set[int] = field(default_factory=set)
    #: Each stream's cross-cache tag when the forward was prepared (``None``: not populated): a forward reads the
    #: caches stacked at its prepare, so a prompt published while it is open reaches the next forward, not this one.
    cross: list[float | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.cross:
            self.cross = [sm.cross.get(b) for sm, b in self.streams]

    @property
    def is_open(self) -> bool:
        return self.status == "open"

    @property
    def num_chunks(self) -> int:
        return self.shape.num_chunks

    def pending_pages(self, lane: int = 0) -> list[int]:
        return [p for sm, b in self.streams for c in sm.lane_pending[lane][b] for p in c]


@dataclass(eq=False)
class SessionModel:
    state: KVState
    cm: CacheModel
    closed: bool = False
    #: Every chunk ever committed (evicted ones included), oldest first.
    committed: dict[str, list[ChunkRecord]] = field(default_factory=lambda: {b: [] for b in BRANCHES})
    #: Per lane, the pages of each pending chunk (``pending``: lane 0's).
    lane_pending: list[dict[str, list[Chunk]]] = field(default_factory=list)
    #: Tokens of each pending chunk (the lengths of the forward that last prepared them).
    pending_tokens: dict[str, list[int]] = field(default_factory=lambda: {b: [] for b in BRANCHES})
    forward: dict[str, TxModel | None] = field(default_factory=lambda: dict.fromkeys(BRANCHES))
    cross: dict[str, float] = field(default_factory=dict)  # branch -> tag of the populated "text" cache
    #: Per lane, each branch's extent (``extent``: lane 0's).
    lane_extent: list[dict[str, tuple[int, ...] | None]] = field(default_factory=list)
    #: In the host tier (``suspend``): it references no device page until resumed.
    suspended: bool = False
    #: ``drop_window``: commit index below which non-sink chunks were dropped; ``begin_shot``: the commit index
    #: the current shot began at, and the shot the last commit applied (what the resident chunks follow).
    floor: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BRANCHES, 0))
    shot: dict[str, int | None] = field(default_factory=lambda: dict.fromkeys(BRANCHES))
    resident_shot: dict[str, int | None] = field(default_factory=lambda: dict.fromkeys(BRANCHES))
    #: ``share_sinks_from``: the leading chunks (commit indices below it) shared as sinks alone -- a frame lane holds
    #: only their sink frames.
    sink_only: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BRANCHES, 0))
    #: Per lane, each branch's content selection (``None``: none) and the pages its open committing forward
    #: reserved for the next one (``()``: none).
    selected: list[dict[str, SelectedView | None]] = field(default_factory=list)
    reserved: list[dict[str, tuple[int, ...]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        lanes = self.cm.num_lanes
        self.lane_pending = self.lane_pending or [{b: [] for b in BRANCHES} for _ in range(lanes)]
        self.lane_extent = self.lane_extent or [dict.fromkeys(BRANCHES) for _ in range(lanes)]
        self.selected = self.selected or [dict.fromkeys(BRANCHES) for _ in range(lanes)]
        self.reserved = self.reserved or [dict.fromkeys(BRANCHES, ()) for _ in range(lanes)]

    @property
    def pending(self) -> dict[str, list[Chunk]]:
        """Lane 0's pending chunks (every lane has as many, of the same lengths)."""
        return self.lane_pending[0]

    @property
    def extent(self) -> dict[str, tuple[int, ...] | None]:
        return self.lane_extent[0]

    def clear_self_attention(self) -> None:
        for b in BRANCHES:
            self.committed[b] = []
            self.drop_pending(b)
            self.forward[b] = None
            for extent in self.lane_extent:
                extent[b] = None
            self.clear_shots(b)
            self.drop_selection(b)

    def drop_selection(self, b: str) -> None:
        for selected in self.selected:
            selected[b] = None

    def clear_shots(self, b: str) -> None:
        self.floor[b], self.shot[b], self.resident_shot[b], self.sink_only[b] = 0, None, None, 0

    def copy_shots(self, other: SessionModel, b: str) -> None:
        self.floor[b], self.shot[b], self.resident_shot[b] = other.floor[b], other.shot[b], other.resident_shot[b]
        self.sink_only[b] = other.sink_only[b]

    def drop_pending(self, b: str) -> None:
        for pending in self.lane_pending:
            pending[b] = []
        for reserved in self.reserved:  # (a committing forward's reserved selection pages go with its chunks)
            reserved[b] = ()
        self.pending_tokens[b] = []

    def committed_tokens(self, b: str) -> int:
        """Tokens ever committed on ``b`` (evicted included): the absolute position of the next pending token."""
        return sum(rec.tokens for rec in self.committed[b])


def cross_value(tag: float, layer: int, heads: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A cross cache's K/V of one layer: every value ``tag + layer`` (V negated), ``heads`` kv heads."""
    k = torch.full((CROSS_TOKENS, heads, HEAD_DIM), tag + layer)
    return k, -k
