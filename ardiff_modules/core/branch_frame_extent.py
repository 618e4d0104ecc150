"""Contiguous extents whose slots are frames: a frame lane's ring (pure Python).

A lane whose policy trims chunks to frames (:class:`~ardiff_modules.core.frame_retention.FrameWindowPolicy`, a
content selection's :class:`~ardiff_modules.core.selected_retention.SelectedFramesPolicy`) keeps single frames
of several chunks: its visible pages are one run only if they sit in one run of page ids whatever chunk they came
from. Its extent is therefore cut into *frame* slots of ``pages_per_frame`` pages, as many as the most frames one
branch sees in a one-chunk forward (:func:`frame_extent_slots`: sink + window frames, the selection's frames and
the pending chunk's frames)::

    FrameWindowPolicy(sink 1, window 1, F=3): 5 frame slots     chunk 0 -> slots 0 1 2
    commit 0 keeps f0 (slot 0) and f2 (slot 2), frees slot 1   chunk 1 -> slots 1 3 4   (visible: 0..4, one run)
    commit 1 keeps f0 and f5 (slot 4), frees 1 2 3             chunk 2 -> slots 1 2 3   (visible: 0..4)

A pending chunk takes ``ceil(pages / pages_per_frame)`` free frame slots, lowest first (not necessarily
adjacent: a chunk's pages are any ids), or -- when fewer are free (a fork still shares an evicted frame) -- fresh
pool pages, the whole chunk (so a chunk is inside the extent iff its first page is, as for chunk slots). A
content selection's reserved pages take free frame slots too; a scoring commit whose current selection sits
in the extent, held by this branch alone, copies the new selection into the current one's pages instead
(:meth:`BranchFrameExtent.selection_in_place`): the reserved pages are released, the selection never leaves the
extent. With every slot in use (sink + window + selection + pending chunk) the visible pages are the whole
extent: one run, attended ragged.
"""

from __future__ import annotations

from collections.abc import Sequence

from ardiff_modules.core.allocator import PageAllocator
from ardiff_modules.core.branch_selection import SelectionJob
from ardiff_modules.core.frame_retention import trims_frames
from ardiff_modules.core.selected_retention import selecting

PageChunk = tuple[int, ...]


def frame_extent_slots(policy: object) -> int | None:
    """Frame slots of a frame lane's extent: the most frames one branch sees in a one-chunk forward (its kept
    sink + window frames, the larger phase's for a phased policy; its selection's frames; the pending chunk's),
    ``None`` when the policy does not trim chunks to frames or keeps unboundedly many."""
    if not trims_frames(policy):
        return None
    kept = getattr(policy, "max_kept_frames", None)
    if not isinstance(kept, int):
        return None
    selected = selecting(policy)
    return kept + (selected.keep_frames if selected is not None else 0) + policy.frames_per_chunk  # type: ignore[attr-defined]


def frame_ring_copies(
    swapped: tuple[PageChunk, ...], moving: Sequence[int], free: Sequence[PageChunk], size: int
) -> tuple[tuple[PageChunk, ...], list[tuple[PageChunk, PageChunk]]]:
    """A re-cache commit's moves into a frame extent (``core/branch_recache.py``'s ``ring_copies``): each rebuilt
    chunk of ``swapped`` at ``moving`` (in fresh pages, trimmed) takes ``ceil(pages / size)`` of the ``free`` frame
    slots, lowest first, while enough are left. Returns the history after the moves and the copies they need."""
    resident, left = list(swapped), list(free)
    copies: list[tuple[PageChunk, PageChunk]] = []
    for i in moving:
        count = -(-len(resident[i]) // size)
        if count > len(left):
            break
        target = tuple(p for slot in left[:count] for p in slot)[: len(resident[i])]
        del left[:count]
        copies.append((resident[i], target))
        resident[i] = target
    return tuple(resident), copies


class BranchFrameExtent:
    """Contiguous-extent methods of a branch's pages, chunk or frame slots (mixed into ``BranchPages``, whose
    fields they read)."""

    pages_per_chunk: int
    pages_per_frame: int
    extent_chunks: int | None
    extent_slot_pages: int
    extent: tuple[int, ...]
    history: tuple[PageChunk, ...]
    pending: tuple[PageChunk, ...]
    pending_selection: tuple[int, ...]
    #: Whether the extent's slots are frames (``pages_per_frame`` pages each) rather than chunks.
    frame_slots: bool = False

    @property
    def needs_extent(self) -> bool:
        """Whether the next pending allocation first reserves a contiguous extent."""
        return self.extent_chunks is not None and not self.extent

    def extent_slots(self) -> list[PageChunk]:
        step = self.extent_slot_pages
        return [tuple(self.extent[i : i + step]) for i in range(0, len(self.extent), step)]

    def free_extent_slots(self, allocator: PageAllocator) -> list[PageChunk]:
        """Extent slots free for a new pending chunk, lowest first.

        A slot is free when no chunk of this branch uses any of its pages (a shorter chunk uses
        a slot's first pages) and nobody else references them (refcount 1: only the
        reservation). NOTE: an evicted chunk may still be visible to a fork sharing it;
        committed pages are immutable, so its slot waits until that fork lets go (meanwhile new
        chunks come from the general pool and run paged). Frame slots: :meth:`free_frame_slots`.
        """
        if self.frame_slots:
            return self.free_frame_slots(allocator)
        used = {page for chunk in self.history + self.pending for page in chunk}
        return [slot for slot in self.extent_slots() if used.isdisjoint(slot) and allocator.exclusive(slot)]

    def assign_extent(self, pages: tuple[int, ...]) -> None:
        """Take ownership of a freshly allocated contiguous extent (its one reference per page)."""
        assert self.extent_chunks is not None and not self.extent
        assert len(pages) == self.extent_chunks * self.extent_slot_pages
        self.extent = pages

    def release_extent(self) -> list[int]:
        """Forget the extent (undoing a reservation); return its pages, still referenced, for the caller to
        unallocate."""
        pages, self.extent = list(self.extent), ()
        return pages

    def selection_pages(self) -> tuple[int, ...]:
        raise NotImplementedError

    def free_frame_slots(self, allocator: PageAllocator) -> list[PageChunk]:
        """Frame slots free for a pending chunk or a reserved selection, lowest first: no page of this branch's
        chunks, selection or reserved selection in it, and nobody else referencing it (only the reservation)."""
        used = {page for chunk in self.history + self.pending for page in chunk}
        used.update(self.selection_pages())
        used.update(self.pending_selection)
        return [slot for slot in self.extent_slots() if used.isdisjoint(slot) and allocator.exclusive(slot)]

    def place_in_frames(self, missing: Sequence[int], free: list[PageChunk]) -> list[PageChunk | None]:
        """Per chunk of ``missing`` (pages each), its pages in ``free`` frame slots (lowest first, consumed from
        ``free``), or ``None``: too few left, it takes pool pages (and so does every later one)."""
        placed: list[PageChunk | None] = []
        size = self.pages_per_frame
        for pages in missing:
            count = -(-pages // size)
            if count > len(free):
                placed.append(None)
                continue
            slots, free[:] = free[:count], free[count:]
            placed.append(tuple(p for slot in slots for p in slot)[:pages])
        return placed

    def frame_pages_needed(self, missing: Sequence[int], allocator: PageAllocator) -> int:
        """Free pages the ``missing`` chunks take: pool pages beside the extent's free frame slots, plus the
        extent itself when not reserved yet (then all of its slots are free)."""
        reserve = 0 if self.extent else (self.extent_chunks or 0) * self.pages_per_frame
        free: list[PageChunk] = self.free_frame_slots(allocator) if self.extent else [()] * (self.extent_chunks or 0)
        placed = self.place_in_frames(missing, free)
        return reserve + sum(pages for pages, chunk in zip(missing, placed) if chunk is None)

    def selection_slots(self, count: int, allocator: PageAllocator) -> PageChunk | None:
        """Where the selection a committing forward makes goes (pure): ``count`` pages of free frame slots of the
        extent, lowest first, when enough are free (after the pending chunks took theirs); ``None``: fresh pool
        pages (``core/reservation.py`` takes the references)."""
        if not (self.frame_slots and self.extent):
            return None
        (pages,) = self.place_in_frames([count], self.free_frame_slots(allocator))
        return pages

    def split_extent(self, pages: Sequence[int]) -> tuple[list[int], list[int]]:
        """``(pages inside the extent, the others)``, in order."""
        extent = set(self.extent)
        return [p for p in pages if p in extent], [p for p in pages if p not in extent]

    def preview_selection(self) -> SelectionJob | None:
        raise NotImplementedError

    def selection_job(self, allocator: PageAllocator) -> SelectionJob | None:
        """What the commit of the pending chunks scores (``BranchSelection.preview_selection``), its destination
        the current selection's pages when :meth:`selection_in_place` (the reserved ones are then released)."""
        job = self.preview_selection()
        if job is not None and self.selection_in_place(allocator):
            return job._replace(destination=self.selection_pages())
        return job

    def replaced_selection(self, job: SelectionJob | None) -> tuple[int, ...]:
        """The pages a scoring commit with ``job`` (this branch's, ``None``: none) releases: the reserved ones when
        the new selection was copied in place, else the current selection's (replaced or dropped)."""
        current = self.selection_pages()
        if job is not None and current and job.destination == current:
            return self.pending_selection
        return current

    def selection_in_place(self, allocator: PageAllocator) -> bool:
        """Whether a scoring commit may copy the new selection into the current one's pages: they sit in this
        branch's frame extent and nobody else references them (a fork, a training hold: they keep reading the old
        one). Decided at the commit (a fork may be made while a forward is open); the committing forward read
        the old selection before (device stream order)."""
        pages = self.selection_pages()
        if not (self.frame_slots and pages and self.extent):
            return False
        extent = set(self.extent)
        return all(p in extent and allocator.refcount(p) == 2 for p in pages)  # (the extent's and the selection's)
