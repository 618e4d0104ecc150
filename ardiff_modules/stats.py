"""``CacheStats``: a snapshot of one cache's pool usage."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ardiff_modules.core.allocator import PageAllocator
from ardiff_modules.pool import KVPool
from ardiff_modules.session import KVState


@dataclass(frozen=True)
class CacheStats:
    """Snapshot of pool usage."""

    num_pages: int
    pages_used: int
    pages_free: int
    peak_pages_used: int
    bytes_per_page: int
    pool_bytes: int
    bytes_used: int
    cross_attention_bytes: int
    sessions: dict[str, dict[str, int]]  # session -> branch -> pages referenced


def cache_stats(allocator: PageAllocator, pool: KVPool, sessions: Iterable[KVState]) -> CacheStats:
    """The snapshot (the caller holds the cache's lock)."""
    sessions = list(sessions)
    return CacheStats(
        num_pages=allocator.num_pages,
        pages_used=allocator.num_used,
        pages_free=allocator.num_free,
        peak_pages_used=allocator.peak_used,
        bytes_per_page=pool.bytes_per_page,
        pool_bytes=pool.nbytes,
        bytes_used=allocator.num_used * pool.bytes_per_page,
        cross_attention_bytes=sum(state.cross_attention_bytes() for state in sessions),
        sessions={
            state.session_id: {b: len(state.branch_pages(b).referenced_pages()) for b in state.kv_branch_names}
            for state in sessions
        },
    )
