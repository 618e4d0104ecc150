"""Reservations: pages taken for one operation, undone exactly until kept (pure Python).

One undo concept for every operation that takes device pages before it knows it will stand: a
:class:`Reservation` takes its pages at construction, then either :meth:`~Reservation.keep` (the operation
stands) or :meth:`~Reservation.rollback` (put every refcount, the free-queue order and the allocator's peak
back exactly as they were). Two kinds::

    ForwardReservation   a forward or a re-cache: contiguous extents for new branches, the pending chunks
                         grown (reusing those of earlier denoising forwards); keep() releases the chunks
                         it replaced. A distributed forward whose vote failed rolls back through it too.
    ResumeReservation    a resume from the host tier: fresh pages and fresh extents to copy into;
                         keep(shared) adds the references of chunk pages that are not fresh.

Everything after the reservation (planning the kernels, stacking caches, a vote, the host-to-device
copies) may still fail; until :meth:`~Reservation.keep`, :meth:`~Reservation.rollback` is exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ardiff_modules.core.allocator import PageAllocator
from ardiff_modules.core.branch import BranchPages, PageChunk


class Reservation:
    """Pages taken for one operation: :meth:`rollback` until :meth:`keep` (see the module docstring).

    Subclasses take their pages in ``__init__`` after ``super().__init__``, call :meth:`rollback` if that
    fails part-way, then :meth:`_reserved`; they say what a rollback gives back (:meth:`_undo`) and what a
    keep releases (:meth:`_settle`).

    Parameters
    ----------
    allocator:
        The pool's allocator.
    free_order:
        Record the free queue's order (needed when contiguous runs are taken: they reorder the queue).
    """

    def __init__(self, allocator: PageAllocator, free_order: bool) -> None:
        self.allocator = allocator
        # NOTE: the free order only when asked: copying it costs O(free pages).
        self._checkpoint = allocator.checkpoint(free_order=free_order)
        #: Kept or rolled back: nothing is left to undo or to release.
        self.spent = False
        self._changes = -1  # the allocator's change count once reserved

    def _reserved(self) -> None:
        """Every page is taken: from here a rollback is exact while the allocator is unchanged."""
        self._changes = self.allocator.changes

    def _undo(self) -> list[int]:
        """Put the operation's own bookkeeping back; return the freshly allocated pages (one reference each)."""
        raise NotImplementedError

    def _settle(self) -> None:
        """What :meth:`keep` does before the reservation is spent (release replaced pages, add references)."""

    def can_roll_back(self) -> bool:
        """Whether :meth:`rollback` is still exact: not spent, and the allocator unchanged since the reservation
        (another operation's pages in between would make the recorded free order and peak wrong)."""
        return not self.spent and self.allocator.changes == self._changes

    def rollback(self) -> None:
        """Undo the reservation exactly (refcounts, free-queue order, peak). Only before :meth:`keep`."""
        assert not self.spent, "a kept or rolled back reservation cannot be rolled back"
        self.allocator.unallocate(self._undo(), self._checkpoint)
        self.spent = True

    def keep(self) -> None:
        """The operation stands (:meth:`_settle`). Idempotent."""
        if self.spent:
            return
        self._settle()
        self.spent = True


class ForwardReservation(Reservation):
    """Pages reserved for one forward or re-cache; :meth:`rollback` until :meth:`keep`.

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
    commit:
        A committing forward: a content-selected branch also reserves the pages of the selection its commit
        makes (``BranchPages.pending_selection``; free frame slots of its extent first, else pool pages).
    """

    def __init__(
        self, branches: Sequence[BranchPages], chunk_pages: Sequence[int], allocator: PageAllocator,
        extent_pages: int, commit: bool = False,
    ) -> None:
        self.branches = list(branches)
        #: Pending chunks each branch held that this forward replaces (released by :meth:`keep`).
        self._stale: list[tuple[tuple[int, ...], ...]] = []
        self._before: list[tuple[PageChunk, ...]] = [b.pending for b in self.branches]
        self._new_extents = [b for b in self.branches if b.needs_extent] if extent_pages else []
        #: Branches given selection pages by this reservation (undone by a rollback).
        self._selecting: list[BranchPages] = []
        # NOTE: the free order only when an extent is taken: once per forward that reserves an extent.
        super().__init__(allocator, free_order=bool(self._new_extents))
        try:
            if self._new_extents:
                self._take_extents(extent_pages)
            for b in self.branches:
                self._stale.append(b.replace_pending(chunk_pages, allocator))
            if commit and self.branches and self.branches[0].selects:  # (a lane's branches share its policy)
                for b in self.branches:
                    need = b.selection_pages_needed(len(chunk_pages))
                    if need and not b.pending_selection:
                        slots = b.selection_slots(need, allocator)  # (free frame slots of its extent first)
                        if slots is not None:
                            allocator.incref(slots)
                        b.reserve_selection(slots if slots is not None else tuple(allocator.allocate(need)))
                        self._selecting.append(b)
        except BaseException:
            self.rollback()
            raise
        self._reserved()

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

    def _undo(self) -> list[int]:
        """Branches back to their pending chunks before the reservation; their fresh pages and new extents."""
        fresh: list[int] = []
        # allocated last: returned last (pages in frame slots only lose the reference they took)
        parts = [b.split_extent(b.unreserve_selection()) for b in self._selecting]
        self.allocator.decref(p for inside, _ in parts for p in inside)
        selected = [p for _, outside in parts for p in outside]
        self._selecting = []
        for b, old in reversed(list(zip(self.branches, self._before))):
            fresh = b.undo_grow(old, self.allocator) + fresh
        fresh += selected
        for b in self._new_extents:
            fresh += b.release_extent()
        self._stale = []
        return fresh

    def _settle(self) -> None:
        """The forward stands: release the pending chunks it replaced (surplus or resized)."""
        self.allocator.decref(page for stale in self._stale for chunk in stale for page in chunk)
        self._stale = []


class ResumeReservation(Reservation):
    """Fresh device pages for a resume: allocate -> copy into them -> :meth:`keep` (``shared``) | :meth:`rollback`.

    ``fresh`` plain pages (one reference each) and one contiguous run per entry of ``extents`` (its pages'
    one reference is the extent's reservation). Raises :class:`~ardiff_modules.errors.CapacityError` with
    nothing allocated when they do not fit (fragmentation included).

    Parameters
    ----------
    allocator:
        The pool's allocator.
    fresh:
        Plain pages to allocate.
    extents:
        Pages of each contiguous extent to allocate, lowest run first.
    """

    def __init__(self, allocator: PageAllocator, fresh: int, extents: Sequence[int]) -> None:
        # NOTE: the free order only with extents (allocate_contiguous reorders the queue).
        super().__init__(allocator, free_order=bool(extents))
        self.extents: list[list[int]] = []
        self.fresh: list[int] = []
        self._shared: tuple[int, ...] = ()
        try:
            for count in extents:
                self.extents.append(allocator.allocate_contiguous(count))
            self.fresh = allocator.allocate(fresh)
        except BaseException:
            self.rollback()
            raise
        self._reserved()

    def _undo(self) -> list[int]:
        return [p for run in self.extents for p in run] + self.fresh

    def keep(self, shared: Iterable[int] = ()) -> None:
        """The copies stand: take one more reference per entry of ``shared`` (aliased live pages, chunks inside
        an extent on top of its reservation, repeated pages). Idempotent (a second call adds nothing)."""
        if not self.spent:
            self._shared = tuple(shared)
        super().keep()

    def _settle(self) -> None:
        self.allocator.incref(self._shared)


def settle_free_order(allocator: PageAllocator, before: Sequence[int]) -> None:
    """After a distributed forward failed: put the free queue in the order every rank agrees on.

    Ranks that prepared and ranks that did not end a failed forward with the same free page *set*
    but may have freed them in different orders; the next allocations would then pick other ids.
    ``before`` is the free queue before the forward (the same on every rank): its pages first, in
    that order, then the others by id (:meth:`PageAllocator.reorder_free`).
    """
    allocator.reorder_free(before)
