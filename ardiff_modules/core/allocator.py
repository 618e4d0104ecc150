"""Page ids, a free list and per-page refcounts (pure Python: no torch).

The allocator knows nothing about tensors: a page id is an index into the
pool's page dimension, and the same id addresses that page in every layer.

Shape follows vLLM v1's ``BlockPool``: pages start in a FIFO free queue
(lowest ids first), ``allocate`` pops from the front and takes one reference,
``decref`` returns a page to the back of the queue when its last reference
goes. Refcounts exist from day one so that forks can share committed pages.

Every operation either fully succeeds or raises and changes nothing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ardiff_modules.checks import is_int, require_int
from ardiff_modules.errors import AllocatorError, CapacityError


@dataclass(frozen=True)
class AllocatorCheckpoint:
    """What :meth:`PageAllocator.unallocate` needs to undo allocations exactly: the peak, and (when
    taken with ``free_order=True``) the free queue's order."""

    peak_used: int
    free_order: tuple[int, ...] | None = None


class PageAllocator:
    """Free list and refcounts over ``num_pages`` page ids ``0 .. num_pages - 1``."""

    def __init__(self, num_pages: int) -> None:
        require_int("PageAllocator.num_pages", num_pages, minimum=1, error=AllocatorError)
        self.num_pages = num_pages
        self._refcounts = [0] * num_pages
        # NOTE: bumped on every allocation of a page: a (page, generation) pair names one lifetime of a
        # page, so the host tier can tell a page it copied from a later reuse of the same id.
        self._generations = [0] * num_pages
        # NOTE: a deque, not a set: allocation order is deterministic (tests pin exact ids).
        self._free: deque[int] = deque(range(num_pages))
        #: High-water mark of pages in use (see :meth:`reset_peak`).
        self.peak_used = 0
        #: Mutations so far (any allocation, reference change, undo or reorder): an undo recorded at
        #: change ``n`` is exact only while this is still ``n`` (``Reservation.can_roll_back``).
        self.changes = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def refcount(self, page: int) -> int:
        self._check_ids((page,))
        return self._refcounts[page]

    def generation(self, page: int) -> int:
        """How many times ``page`` was allocated (its current lifetime while in use)."""
        self._check_ids((page,))
        return self._generations[page]

    def exclusive(self, pages: Sequence[int]) -> bool:
        """Whether every page in ``pages`` has exactly one reference (hot path: range-checked in bulk)."""
        if pages and (min(pages) < 0 or max(pages) >= self.num_pages):
            self._check_ids(pages)  # raises, naming the bad id
        refcounts = self._refcounts
        return all(refcounts[p] == 1 for p in pages)

    def free_pages(self) -> tuple[int, ...]:
        """Free page ids in allocation order."""
        return tuple(self._free)

    def used_pages(self) -> tuple[int, ...]:
        return tuple(p for p, rc in enumerate(self._refcounts) if rc > 0)

    # ------------------------------------------------------------------ mutation
    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free pages, each with refcount 1.

        Raises :class:`CapacityError` (nothing allocated) when fewer are free.
        """
        require_int("allocate", count, minimum=0, what="a page count", error=AllocatorError)
        if count > len(self._free):
            raise CapacityError(
                f"KV pool out of pages: needed {count} free pages, only {len(self._free)} of "
                f"{self.num_pages} are free",
                needed=count,
                free=len(self._free),
            )
        pages = [self._free.popleft() for _ in range(count)]
        for page in pages:
            self._refcounts[page] = 1
            self._generations[page] += 1
        self.peak_used = max(self.peak_used, self.num_used)
        self.changes += 1
        return pages

    def free_runs(self, also_free: Iterable[int] = ()) -> list[tuple[int, int]]:
        """``(first page, length)`` of every run of consecutive free page ids, lowest first; ``also_free``:
        pages to count as free too (what the runs would be once they are released)."""
        runs: list[tuple[int, int]] = []
        for page in sorted(set(self._free).union(also_free)):
            if runs and runs[-1][0] + runs[-1][1] == page:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((page, 1))
        return runs

    def longest_free_run(self) -> int:
        """Length of the longest run of consecutive free page ids."""
        return max((length for _, length in self.free_runs()), default=0)

    def runs_that_fit(self, size: int, also_free: Iterable[int] = ()) -> int:
        """How many runs of ``size`` consecutive pages the free pages hold side by side (each free run
        holds ``length // size``): how many contiguous extents of ``size`` pages can still be taken, one
        after another, lowest first (each take lowers the count by exactly one). ``also_free``: as
        :meth:`free_runs`."""
        require_int("runs_that_fit", size, minimum=1, what="a page count", error=AllocatorError)
        return sum(length // size for _, length in self.free_runs(also_free))

    def allocate_contiguous(self, count: int) -> list[int]:
        """Take ``count`` free pages with consecutive ids (the lowest such run), each with refcount 1.

        Raises :class:`CapacityError` (nothing allocated) when no run is long enough,
        including when enough pages are free but fragmented.
        """
        require_int("allocate_contiguous", count, minimum=1, what="a page count", error=AllocatorError)
        start = None
        run = 0
        previous = -2
        for page in sorted(self._free):
            run = run + 1 if page == previous + 1 else 1
            previous = page
            if run == count:
                start = page - count + 1
                break
        if start is None:
            raise CapacityError(
                f"KV pool out of contiguous pages: needed {count} consecutive free pages, {len(self._free)} of "
                f"{self.num_pages} are free but the longest free run is {self.longest_free_run()}",
                needed=count,
                free=len(self._free),
            )
        taken = set(range(start, start + count))
        self._free = deque(p for p in self._free if p not in taken)
        for page in taken:
            self._refcounts[page] = 1
            self._generations[page] += 1
        self.peak_used = max(self.peak_used, self.num_used)
        self.changes += 1
        return list(range(start, start + count))

    def checkpoint(self, *, free_order: bool = False) -> AllocatorCheckpoint:
        """The peak now and, with ``free_order``, the free queue's order (O(free pages): only when an
        :meth:`allocate_contiguous` may follow), for :meth:`unallocate` to restore."""
        return AllocatorCheckpoint(self.peak_used, tuple(self._free) if free_order else None)

    def unallocate(self, pages: Sequence[int], checkpoint: AllocatorCheckpoint | None = None) -> None:
        """Undo the latest allocation of ``pages`` exactly (free-queue order and peak included).

        For rolling back a failed multi-step operation; every page must hold exactly the one
        reference the allocation gave it. Without a ``checkpoint`` the pages go back to the front,
        undoing :meth:`allocate`; a checkpoint taken before (:meth:`checkpoint`) also restores the
        peak, and its free order (needed after :meth:`allocate_contiguous`) the queue's order.
        """
        free_order = checkpoint.free_order if checkpoint is not None else None
        self._check_ids(pages)
        if len(set(pages)) != len(pages):
            raise AllocatorError(f"unallocate: expected distinct page ids, got {list(pages)}")
        for page in pages:
            if self._refcounts[page] != 1:
                raise AllocatorError(
                    f"unallocate: page {page} has refcount {self._refcounts[page]}, expected 1 (freshly allocated)"
                )
        if free_order is not None and (
            len(free_order) != len(self._free) + len(pages) or set(free_order) != set(self._free) | set(pages)
        ):
            raise AllocatorError("unallocate: free_order does not match the free pages plus the pages returned")
        for page in pages:
            self._refcounts[page] = 0
        if free_order is not None:
            self._free = deque(free_order)
        else:
            self._free.extendleft(reversed(pages))
        if checkpoint is not None:
            self.peak_used = checkpoint.peak_used
        self.changes += 1

    def reorder_free(self, first: Sequence[int]) -> None:
        """Put the free queue in a canonical order: the free pages of ``first`` in that order, then every
        other free page by id. Refcounts and the peak are unchanged (ranks that freed the same pages in
        different orders agree again on which ids the next allocations take)."""
        free = set(self._free)
        order = [p for p in first if p in free]
        order += sorted(free.difference(order))
        self._free = deque(order)
        self.changes += 1

    def incref(self, pages: Iterable[int]) -> None:
        """Add one reference to each page (sharing); every page must be in use."""
        pages = tuple(pages)
        self._check_ids(pages)
        for page in pages:
            if self._refcounts[page] == 0:
                raise AllocatorError(f"incref: page {page} is free; expected a page in use (refcount >= 1)")
        for page in pages:
            self._refcounts[page] += 1
        self.changes += 1

    def decref(self, pages: Iterable[int]) -> list[int]:
        """Drop one reference from each page; return the pages that became free.

        A page may appear several times (one reference dropped per occurrence).
        Validated before anything changes: dropping more references than a
        page has raises :class:`AllocatorError` and changes nothing.
        """
        pages = tuple(pages)
        self._check_ids(pages)
        refcounts = self._refcounts
        # Fast path: distinct pages that are all in use (eviction, abort); else count repeats.
        if len(set(pages)) != len(pages) or not all(refcounts[p] for p in pages):
            drops: dict[int, int] = {}
            for page in pages:
                drops[page] = drops.get(page, 0) + 1
            for page, n in drops.items():
                if n > refcounts[page]:
                    raise AllocatorError(
                        f"decref: page {page} has refcount {refcounts[page]}, cannot drop {n} reference(s)"
                    )
        freed = []
        for page in pages:
            self._refcounts[page] -= 1
            if self._refcounts[page] == 0:
                self._free.append(page)
                freed.append(page)
        self.changes += 1
        return freed

    def reset_peak(self) -> None:
        """Restart the high-water mark from the pages in use now."""
        self.peak_used = self.num_used
        self.changes += 1

    # ------------------------------------------------------------------ checks
    def _check_ids(self, pages: Sequence[int]) -> None:
        # Hot path (every page of every forward): C-level type and range checks first.
        if not pages or (set(map(type, pages)) == {int} and min(pages) >= 0 and max(pages) < self.num_pages):
            return
        for page in pages:
            if not is_int(page) or not 0 <= page < self.num_pages:
                raise AllocatorError(f"expected a page id in [0, {self.num_pages}), got {page!r}")

    def check_invariants(self) -> None:
        """Internal consistency: free pages have refcount 0, used ones >= 1, no duplicates."""
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate page in the free queue"
        for page, rc in enumerate(self._refcounts):
            assert rc >= 0, f"page {page} has negative refcount {rc}"
            assert (rc == 0) == (page in free), f"page {page}: refcount {rc} but free={page in free}"


def reset_peak(allocator: PageAllocator) -> None:
    """Restart ``allocator``'s high-water mark (:meth:`PageAllocator.reset_peak`) for ``KVCache.reset_peak``: the
    facade changes allocator state only through ``core``, as the session does (``drop_pending``, ``adopt``)."""
    allocator.reset_peak()
