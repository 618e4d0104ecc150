"""Contiguous room for admission: what the free page runs hold in extents, and what open sessions are owed.

With contiguous extents a session's pages are one run per branch, reserved at its first forward. Counting
free pages (:class:`~ardiff_modules.core.admission.Admission`) is then not enough: closed or suspended
sessions leave holes, and pages taken outside extents (forks keeping a slot, re-caches) can cut a hole
below an extent's size. Admission also asks how many extents the runs hold::

    free runs   [ 16 ][  ][ 12 ][ 16 ]   extent = 8 pages -> 2 + 1 + 2 = 5 extents
    owed        1 branch of an admitted session that has not run yet -> 4 left, 2 sessions of 2 branches
"""

from __future__ import annotations

from collections.abc import Iterable

from ardiff_modules.core.admission import Admission, ExtentRoom
from ardiff_modules.core.allocator import PageAllocator
from ardiff_modules.session import KVState


def extent_room(
    allocator: PageAllocator, admission: Admission, resident: Iterable[KVState], freed: Iterable[int] = (),
    *, lane: int = 0,
) -> ExtentRoom | None:
    """The room for new extents (``None`` under plain paging): the runs of the free pages (plus ``freed``,
    pages a caller is about to release) in extents, and the branches of the ``resident`` sessions that hold no
    extent yet (suspended sessions are owed nothing: a resume reserves its own room when it runs); ``lane``: which
    of a grouped cache's lanes ``allocator`` is."""
    size = admission.extent_pages
    if size is None:
        return None
    promised = sum(1 for s in resident for name in s.kv_branch_names if not s._lane_pages(name)[lane].extent)
    return ExtentRoom(allocator.runs_that_fit(size, also_free=freed), promised)
