"""A forward's page reservation and its exact rollback (pure Python, next to ``history.py``).

Reserving for a forward of ``num_chunks`` pending chunks over several branches may take a
contiguous extent for branches that have none yet and grows each branch's pending chunks
(reusing those of earlier denoising forwards). Everything after the reservation (planning the
kernels, stacking caches) may still fail; :meth:`Reservation.rollback` then puts every branch,
every refcount, the free-list order and the allocator's peak back exactly as they were.
"""

from __future__ import annotations

from collections.abc import Sequence

from ardiff_modules.core.allocator import PageAllocator
from ardiff_modules.core.branch import BranchPages, PageChunk


class Reservation:
    """Pages reserved for one forward; :meth:`rollback` until :meth:`keep`.

    Parameters
    ----------
    histories:
        The forward's branches, in batch order.
    chunk_pages:
        Pages of each pending chunk every branch must hold (chunks may differ in length).
    allocator:
        The pool's allocator (capacity was checked by the caller: reserving cannot run out).
    extent_pages:
        Pages of one contiguous extent (``0``: reserve no new extent -- plain paging, or a re-cache,
        which fills the free slots of extents already reserved and takes the rest from the pool).
    """

    def __init__(
        self, histories: Sequence[BranchPages], chunk_pages: Sequence[int], allocator: PageAllocator,
        extent_pages: int,
    ) -> None:
        self.histories = list(histories)
        self.allocator = allocator
        #: Pending chunks each branch held that this forward replaces (released by :meth:`keep`).
        self._stale: list[tuple[tuple[int, ...], ...]] = []
        self._before: list[tuple[PageChunk, ...]] = [h.pending for h in self.histories]
        self._peak = allocator.peak_used
        self._new_extents = [h for h in self.histories if h.needs_extent] if extent_pages else []
        self._free_order = allocator.free_pages() if self._new_extents else None
        try:
            if self._new_extents:
                # One run for all new branches of the forward: CFG pairs end up adjacent (one ragged launch).
                run = allocator.allocate_contiguous(len(self._new_extents) * extent_pages)
                for i, h in enumerate(self._new_extents):
                    h.assign_extent(tuple(run[i * extent_pages : (i + 1) * extent_pages]))
            for h in self.histories:
                self._stale.append(h.replace_pending(chunk_pages, allocator))
        except BaseException:
            self.rollback()
            raise

    def rollback(self) -> None:
        """Undo the reservation exactly (branches, refcounts, free-list order, peak)."""
        fresh: list[int] = []
        for h, old in reversed(list(zip(self.histories, self._before))):
            fresh = h.undo_grow(old, self.allocator) + fresh
        for h in self._new_extents:
            if h.extent:
                fresh += list(h.extent)
                h.extent = ()
        if fresh:
            self.allocator.unallocate(fresh, free_order=self._free_order)
        self.allocator.peak_used = self._peak

    def keep(self) -> None:
        """The forward was published: release the pending chunks it replaced (surplus or resized)."""
        self.allocator.decref(page for stale in self._stale for chunk in stale for page in chunk)
        self._stale = []
