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
class ChunkRecord:
    """One committed chunk, as the model sees it."""

    pages: Chunk
    tokens: int  # the length the forward asked for
    start: int  # absolute position of its first token: tokens committed on the branch before it
    data: torch.Tensor  # pool contents [layers, 2, pages, page_size, heads, dim] when committed

    def positions(self) -> list[int]:
        return list(range(self.start, self.start + self.tokens))

    def token_data(self) -> torch.Tensor:
        """``[layers, 2, tokens, heads * dim]``: K and V of every layer, in position order."""
        return self.data.reshape(*self.data.shape[:2], self.tokens, -1)


@dataclass(eq=False)
class CacheModel:
    cache: KVCache
    backend: FlakyPlanBackend
    extents: bool
    extent_chunks: int
    max_contexts: int
    check_finite: bool
    pool: PoolContents
    label: str
    #: The forward-context registry: key -> context, least recently used first.
    registry: OrderedDict[Key, ForwardContext] = field(default_factory=OrderedDict)
    peak: int = 0
    closed: bool = False


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

    def pending_pages(self) -> list[int]:
        return [p for sm, b in self.streams for c in sm.pending[b] for p in c]


@dataclass(eq=False)
class SessionModel:
    state: KVState
    cm: CacheModel
    closed: bool = False
    #: Every chunk ever committed (evicted ones included), oldest first.
    committed: dict[str, list[ChunkRecord]] = field(default_factory=lambda: {b: [] for b in BRANCHES})
    pending: dict[str, list[Chunk]] = field(default_factory=lambda: {b: [] for b in BRANCHES})
    #: Tokens of each pending chunk (the lengths of the forward that last prepared them).
    pending_tokens: dict[str, list[int]] = field(default_factory=lambda: {b: [] for b in BRANCHES})
    forward: dict[str, TxModel | None] = field(default_factory=lambda: dict.fromkeys(BRANCHES))
    cross: dict[str, float] = field(default_factory=dict)  # branch -> tag of the populated "text" cache
    extent: dict[str, tuple[int, ...] | None] = field(default_factory=lambda: dict.fromkeys(BRANCHES))
    #: In the host tier (``suspend``): it references no device page until resumed.
    suspended: bool = False
    #: ``drop_window``: commit index below which non-sink chunks were dropped; ``begin_shot``: the commit index
    #: the current shot began at, and the shot the last commit applied (what the resident chunks follow).
    floor: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BRANCHES, 0))
    shot: dict[str, int | None] = field(default_factory=lambda: dict.fromkeys(BRANCHES))
    resident_shot: dict[str, int | None] = field(default_factory=lambda: dict.fromkeys(BRANCHES))

    def clear_self_attention(self) -> None:
        for b in BRANCHES:
            self.committed[b] = []
            self.drop_pending(b)
            self.forward[b] = None
            self.extent[b] = None
            self.clear_shots(b)

    def clear_shots(self, b: str) -> None:
        self.floor[b], self.shot[b], self.resident_shot[b] = 0, None, None

    def copy_shots(self, other: SessionModel, b: str) -> None:
        self.floor[b], self.shot[b], self.resident_shot[b] = other.floor[b], other.shot[b], other.resident_shot[b]

    def drop_pending(self, b: str) -> None:
        self.pending[b] = []
        self.pending_tokens[b] = []

    def committed_tokens(self, b: str) -> int:
        """Tokens ever committed on ``b`` (evicted included): the absolute position of the next pending token."""
        return sum(rec.tokens for rec in self.committed[b])


def cross_value(tag: float, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.full((CROSS_TOKENS, 1, HEAD_DIM), tag + layer)
    return k, -k
