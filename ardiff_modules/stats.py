"""``CacheStats``: a snapshot of one cache's pool usage."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ardiff_modules.lanes import CacheLane
from ardiff_modules.session import KVState


@dataclass(frozen=True)
class LaneStats:
    """One lane's pool usage (a retention group's heads in the layers that hold equally many of them)."""

    num_pages: int
    pages_used: int
    pages_free: int
    peak_pages_used: int
    bytes_per_page: int
    pool_bytes: int
    bytes_used: int


@dataclass(frozen=True)
class CacheStats:
    """Snapshot of pool usage.

    With retention groups the page counts and bytes are summed over the lanes (``peak_pages_used``: each
    lane's peak, summed), ``bytes_per_page`` is the first lane's, and ``lanes`` has each lane's own numbers.
    """

    num_pages: int
    pages_used: int
    pages_free: int
    peak_pages_used: int
    bytes_per_page: int
    pool_bytes: int
    bytes_used: int
    cross_attention_bytes: int
    sessions: dict[str, dict[str, int]]  # session -> branch -> pages referenced (every lane)
    #: Lane name (``"all"`` for a uniform cache, ``"<group>/<heads>h"``) -> its usage.
    lanes: dict[str, LaneStats] = field(default_factory=dict, compare=False)


def lane_stats(lane: CacheLane) -> LaneStats:
    allocator, pool = lane.allocator, lane.pool
    return LaneStats(
        num_pages=allocator.num_pages, pages_used=allocator.num_used, pages_free=allocator.num_free,
        peak_pages_used=allocator.peak_used, bytes_per_page=pool.bytes_per_page, pool_bytes=pool.nbytes,
        bytes_used=allocator.num_used * pool.bytes_per_page,
    )


def cache_stats(lanes: Sequence[CacheLane], sessions: Iterable[KVState]) -> CacheStats:
    """The snapshot (the caller holds the cache's lock)."""
    sessions = list(sessions)
    per_lane = {lane.name: lane_stats(lane) for lane in lanes}
    rows = list(per_lane.values())
    return CacheStats(
        num_pages=sum(r.num_pages for r in rows),
        pages_used=sum(r.pages_used for r in rows),
        pages_free=sum(r.pages_free for r in rows),
        peak_pages_used=sum(r.peak_pages_used for r in rows),
        bytes_per_page=rows[0].bytes_per_page,
        pool_bytes=sum(r.pool_bytes for r in rows),
        bytes_used=sum(r.bytes_used for r in rows),
        cross_attention_bytes=sum(state.cross_attention_bytes() for state in sessions),
        sessions={
            state.session_id: {
                b: sum(len(pages.referenced_pages()) for pages in state._lane_pages(b)) for b in state.kv_branch_names
            }
            for state in sessions
        },
        lanes=per_lane,
    )
