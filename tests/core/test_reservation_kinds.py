"""One undo concept: a resume's pages are a :class:`Reservation` like a forward's (keep / rollback), and the
host tier's page ids speak the allocator's verbs (pure Python, exact ids)."""

from __future__ import annotations

import pytest

from ardiff_modules.core.allocator import PageAllocator
from ardiff_modules.core.host_pages import HostPages
from ardiff_modules.core.reservation import ForwardReservation, Reservation, ResumeReservation
from ardiff_modules.errors import AllocatorError, CapacityError


def _state(alloc: PageAllocator) -> tuple[object, ...]:
    return alloc.free_pages(), tuple(alloc.refcount(p) for p in range(alloc.num_pages)), alloc.peak_used


def _fragmented() -> PageAllocator:
    """12 pages; 0..3 and 6 in use: the free queue is 7 8 9 10 11 4 5 (runs [4, 5] and [7..11])."""
    alloc = PageAllocator(12)
    alloc.allocate(7)
    alloc.decref([4, 5])
    alloc.reset_peak()
    return alloc


# ------------------------------------------------------------------ ResumeReservation
def test_both_kinds_are_reservations() -> None:
    assert issubclass(ForwardReservation, Reservation) and issubclass(ResumeReservation, Reservation)


def test_a_resume_reservation_rolls_back_exactly() -> None:
    alloc = _fragmented()
    before = _state(alloc)
    reservation = ResumeReservation(alloc, fresh=2, extents=[3])
    assert reservation.extents == [[7, 8, 9]] and reservation.fresh == [10, 11]
    assert reservation.can_roll_back()
    reservation.rollback()
    assert _state(alloc) == before and reservation.spent and not reservation.can_roll_back()


def test_a_kept_resume_reservation_takes_the_shared_references_once() -> None:
    alloc = _fragmented()
    reservation = ResumeReservation(alloc, fresh=1, extents=[])
    reservation.keep([0, reservation.fresh[0]])  # an aliased live page, a page repeated in two chunks
    reservation.keep([0])  # idempotent: nothing more
    assert alloc.refcount(0) == 2 and alloc.refcount(7) == 2 and not reservation.can_roll_back()


def test_a_resume_reservation_that_does_not_fit_changes_nothing() -> None:
    alloc = _fragmented()
    before = _state(alloc)
    with pytest.raises(CapacityError):
        ResumeReservation(alloc, fresh=0, extents=[5, 3])  # the second extent: no run of 3 left
    assert _state(alloc) == before


def test_a_resume_reservation_is_not_exact_after_another_allocation() -> None:
    alloc = _fragmented()
    reservation = ResumeReservation(alloc, fresh=1, extents=[])
    alloc.allocate(1)
    assert not reservation.can_roll_back()


# ------------------------------------------------------------------ HostPages: the allocator's verbs
def test_host_pages_allocate_incref_decref() -> None:
    pages = HostPages(bytes_per_page=10, budget_bytes=100)
    assert pages.allocate(3) == [0, 1, 2]
    pages.incref([1, 1])
    assert [pages.refcount(h) for h in range(3)] == [1, 3, 1]
    assert pages.decref([0, 1]) == [0]
    assert pages.pages() == (1, 2) and pages.nbytes == 20
    assert pages.allocate(1) == [3]  # ids are never reused
    pages.check_invariants()


def test_host_pages_refusals_change_nothing() -> None:
    pages = HostPages(bytes_per_page=10)
    pages.allocate(2)
    with pytest.raises(AllocatorError, match="HostPages.incref: host page 5"):
        pages.incref([0, 5])
    with pytest.raises(AllocatorError, match="HostPages.decref: host page 1 has 1 reference"):
        pages.decref([0, 1, 1])
    assert [pages.refcount(h) for h in range(2)] == [1, 1]


def test_host_pages_charge_and_refund_extra_bytes() -> None:
    pages = HostPages(bytes_per_page=10, budget_bytes=50)
    pages.charge(15)
    assert pages.nbytes == 15 and pages.free_bytes() == 35
    with pytest.raises(CapacityError, match="needs 40 bytes"):
        pages.check_fits("suspend", 4, 0)
    pages.refund(15)
    assert pages.nbytes == 0
