"""``HostArena``: the host tier's page memory -- pinned slabs of page rows, allocated once and reused.

Pinning host memory is slow (``cudaHostAlloc``: about a second per few GiB), far slower than the copy
itself (~55 GB/s over the H200's link), so a suspend must not pin a fresh block each time. The arena
keeps slabs ``[rows, layers, 2, page_size, heads, head_dim * itemsize]`` uint8 (pinned when the pool is
on CUDA) and a free list of rows with the allocator's verbs: a suspend allocates rows (lowest first, so one
session's pages form long runs), a host page whose last reference goes decrefs its row (each row has one
reference, its host page's), and slabs are kept for the next suspend. A slab is grown
for at least ``min_slab_bytes`` (capped by the host budget), and :meth:`reserve` pins ahead of time (a
server's warm start). Copies go run by run: consecutive rows of one slab move in one ``copy_``.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

import torch

#: One host page's place: (slab index, row).
Row = tuple[int, int]


class HostArena:
    """Pinned page rows for the host tier (see the module docstring).

    Parameters
    ----------
    page_shape:
        One page's raw shape ``(layers, 2, page_size, heads, head_dim * itemsize)`` (uint8).
    pinned:
        Pin the slabs (a CUDA pool: asynchronous copies need page-locked memory).
    min_slab_bytes:
        The least a new slab holds (rounded up to whole pages).
    max_rows:
        The most rows all slabs may hold together (the host budget in pages; ``None``: unbounded).
    """

    def __init__(
        self, page_shape: Sequence[int], pinned: bool, min_slab_bytes: int = 1 << 30, max_rows: int | None = None
    ) -> None:
        self.page_shape = tuple(page_shape)
        self.pinned = pinned
        self.page_bytes = int(torch.Size(self.page_shape).numel())
        self.min_slab_rows = max(1, -(-min_slab_bytes // self.page_bytes))
        self.max_rows = max_rows
        self.slabs: list[torch.Tensor] = []
        # NOTE: its own free list, not a PageAllocator's: rows are (slab, row) pairs whose number grows with
        # each slab (the allocator's ids are a fixed range), and a suspend wants the lowest rows (long runs,
        # one copy_ each) where the allocator hands out pages FIFO. Sorted, so taking and giving back rows in
        # any order is exact: the list is always the same for the same free set.
        self._free: list[Row] = []

    @property
    def capacity_rows(self) -> int:
        return sum(s.shape[0] for s in self.slabs)

    @property
    def free_rows(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        """Host bytes the slabs hold (used or not)."""
        return self.capacity_rows * self.page_bytes

    def reserve(self, rows: int) -> None:
        """Make at least ``rows`` rows free now (pinning a new slab if needed; capped by ``max_rows``)."""
        missing = rows - len(self._free)
        if missing <= 0:
            return
        size = max(missing, self.min_slab_rows)
        if self.max_rows is not None:
            size = max(missing, min(size, self.max_rows - self.capacity_rows))
        slab = torch.empty((size, *self.page_shape), dtype=torch.uint8, pin_memory=self.pinned)
        index = len(self.slabs)
        self.slabs.append(slab)
        self._free.extend((index, r) for r in range(size))
        self._free.sort()

    def allocate(self, count: int) -> list[Row]:
        """``count`` free rows, lowest first, each with its one reference (pinning a slab if needed; the caller
        decrefs them if its copy fails)."""
        self.reserve(count)
        rows, self._free = self._free[:count], self._free[count:]
        return rows

    def decref(self, rows: Sequence[Row]) -> None:
        """Drop each row's one reference: it is free again (for the next suspend; the slab is kept)."""
        for row in rows:
            bisect.insort(self._free, row)

    def row(self, place: Row) -> torch.Tensor:
        slab, row = place
        return self.slabs[slab][row]

    def copy_in(self, places: Sequence[Row], source: torch.Tensor) -> None:
        """``source[i]`` (``[n, *page_shape]``, any device) into row ``places[i]``, asynchronously when pinned."""
        for slab, row, start, n in _runs(places):
            self.slabs[slab][row : row + n].copy_(source[start : start + n], non_blocking=self.pinned)

    def runs(self, places: Sequence[Row]) -> Iterator[tuple[int, int, torch.Tensor]]:
        """``(first index, count, rows view)`` of each run of consecutive rows of one slab in ``places``."""
        for slab, row, start, n in _runs(places):
            yield start, n, self.slabs[slab][row : row + n]


def _runs(places: Sequence[Row]) -> Iterator[tuple[int, int, int, int]]:
    """``(slab, first row, first index, count)`` of each maximal run ``places[i..i+count)`` of consecutive rows."""
    i = 0
    while i < len(places):
        slab, row = places[i]
        n = 1
        while i + n < len(places) and places[i + n] == (slab, row + n):
            n += 1
        yield slab, row, i, n
        i += n
