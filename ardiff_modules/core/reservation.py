"""A forward's page reservation and its exact undo (pure Python).

Reserving for a forward of ``num_chunks`` pending chunks over several branches may take a
contiguous extent for branches that have none yet and grows each branch's pending chunks
(reusing those of earlier denoising forwards). Everything after the reservation (planning the
kernels, stacking caches, a distributed forward's vote) may still fail; until :meth:`Reservation.keep`,
:meth:`Reservation.rollback` puts every branch, every refcount, the free-queue order and the
allocator's peak back exactly as they were. Forwards, re-caches and a distributed forward whose
vote failed all undo through it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ardiff_modules.core.allocator import PageAllocator
from ardiff_modules.core.branch import BranchPages, PageChunk


class Reservation:
    """Pages reserved for one forward; :meth:`rollback` until :meth:`keep`.

    Parameters
    ----------
    branches:
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
        self, branches: Sequence[BranchPages], chunk_pages: Sequence[int], allocator: PageAllocator,
        extent_pages: int,
    ) -> None:
        self.branches = list(branches)
        self.allocator = allocator
        #: Pending chunks each branch held that this forward replaces (released by :meth:`keep`).
        self._stale: list[tuple[tuple[int, ...], ...]] = []
        self._before: list[tuple[PageChunk, ...]] = [b.pending for b in self.branches]
        self._new_extents = [b for b in self.branches if b.needs_extent] if extent_pages else []
        # NOTE: the free order only when an extent is taken (allocate_contiguous reorders the queue);
        # copying it costs O(free pages), once per forward that reserves an extent.
        self._checkpoint = allocator.checkpoint(free_order=bool(self._new_extents))
        #: Kept or rolled back: nothing is left to undo or to release.
        self.spent = False
        self._changes = -1  # the allocator's change count once reserved
        try:
            if self._new_extents:
                self._take_extents(extent_pages)
            for b in self.branches:
                self._stale.append(b.replace_pending(chunk_pages, allocator))
        except BaseException:
            self.rollback()
            raise
        self._changes = allocator.changes

    def _take_extents(self, extent_pages: int) -> None:
        """A contiguous extent of ``extent_pages`` pages for each new branch, in increasing page order.

        One run for all when one is free: the forward's new branches (a CFG pair, sessions arriving
        together) then sit side by side, one ragged launch without gap rows. Else one run each, lowest
        first (still increasing: a later extent fits no lower run than the one before), so a pool whose
        free pages are extent-sized holes (sessions closed between open ones) still admits them; ragged
        FA3 spans the holes with query-less gap rows. A failure part-way is undone by :meth:`rollback`
        (the extents taken so far are assigned).
        """
        branches, allocator = self._new_extents, self.allocator
        if allocator.longest_free_run() >= len(branches) * extent_pages:
            run = allocator.allocate_contiguous(len(branches) * extent_pages)
            for i, b in enumerate(branches):
                b.assign_extent(tuple(run[i * extent_pages : (i + 1) * extent_pages]))
            return
        for b in branches:
            b.assign_extent(tuple(allocator.allocate_contiguous(extent_pages)))

    def can_roll_back(self) -> bool:
        """Whether :meth:`rollback` is still exact: not spent, and the allocator unchanged since the reservation
        (another forward's pages in between would make the recorded free order and peak wrong)."""
        return not self.spent and self.allocator.changes == self._changes

    def rollback(self) -> None:
        """Undo the reservation exactly (branches, refcounts, free-queue order, peak). Only before :meth:`keep`."""
        assert not self.spent, "a kept reservation cannot be rolled back"
        fresh: list[int] = []
        for b, old in reversed(list(zip(self.branches, self._before))):
            fresh = b.undo_grow(old, self.allocator) + fresh
        for b in self._new_extents:
            fresh += b.release_extent()
        self.allocator.unallocate(fresh, self._checkpoint)
        self._stale = []
        self.spent = True

    def keep(self) -> None:
        """The forward stands: release the pending chunks it replaced (surplus or resized). Idempotent."""
        if self.spent:
            return
        self.allocator.decref(page for stale in self._stale for chunk in stale for page in chunk)
        self._stale = []
        self.spent = True


def settle_free_order(allocator: PageAllocator, before: Sequence[int]) -> None:
    """After a distributed forward failed: put the free queue in the order every rank agrees on.

    Ranks that prepared and ranks that did not end a failed forward with the same free page *set*
    but may have freed them in different orders; the next allocations would then pick other ids.
    ``before`` is the free queue before the forward (the same on every rank): its pages first, in
    that order, then the others by id (:meth:`PageAllocator.reorder_free`).
    """
    allocator.reorder_free(before)
