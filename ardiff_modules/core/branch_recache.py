"""A branch's re-cache bookkeeping: which chunks a prompt switch rebuilds and how they swap in (pure Python).

:class:`BranchRecache` is the part of :class:`~ardiff_modules.core.branch.BranchPages` a re-cache forward
uses (``forwards/`` plans it, ``core/transaction.py`` commits it): the rebuilt chunks are pending chunks
that replace history slots at commit, keeping commit indices, starts and (under a frame policy) each slot's
trim; with contiguous extents, rebuilt chunks in fresh pages move back into ring slots
(:func:`ring_copies`).
"""

from __future__ import annotations

from collections.abc import Mapping

from ardiff_modules.core.allocator import PageAllocator
from ardiff_modules.core.branch_frame_extent import frame_ring_copies
from ardiff_modules.core.frame_retention import Kept, trim_chunk
from ardiff_modules.core.recache import RecachePlan, RecacheRule
from ardiff_modules.core.retention import RetentionPolicy

PageChunk = tuple[int, ...]


class BranchRecache:
    """Re-cache methods of a branch's pages (mixed into ``BranchPages``, whose fields they read)."""

    policy: RetentionPolicy
    pages_per_chunk: int
    extent: tuple[int, ...]
    history: tuple[PageChunk, ...]
    history_index: tuple[int, ...]
    history_start: tuple[int, ...]
    history_kept: tuple[Kept | None, ...]
    pending: tuple[PageChunk, ...]
    committed_chunks: int
    latents: dict[int, object]
    recent: dict[int, tuple[int, int]]
    window_floor: int
    frame_slots: bool
    extent_slot_pages: int

    @property
    def sinks(self) -> tuple[PageChunk, ...]:
        raise NotImplementedError

    def full_pages(self, j: int) -> int:
        raise NotImplementedError

    def chunk_spans(self, j: int) -> list[tuple[int, int]]:
        raise NotImplementedError

    def extent_slots(self) -> list[PageChunk]:
        raise NotImplementedError

    def selection_pages(self) -> tuple[int, ...]:
        raise NotImplementedError

    def adopt_selection(self, selection: None) -> None:
        raise NotImplementedError

    def recache_plan(self, rule: RecacheRule) -> RecachePlan:
        """Which chunks a re-cache under ``rule`` rebuilds, and what each replaces (pure)::

            history:   [s0 | c5  c6  c7]      RecacheRule()               -> rebuild c5 c6 c7 (s0 read, never written)
                                              RecacheRule(sinks="rebuild") -> rebuild s0 c5 c6 c7
                                              RecacheRule.longlive()       -> rebuild c4 (context) c5 c6 c7
        """
        return rule.plan(
            self.history_index, self.committed_chunks, self.policy.sink_chunks, self.recent.keys(), self.window_floor
        )

    def recache_chunk(self, index: int) -> tuple[int, int]:
        """``(absolute start, pages)`` of committed chunk ``index``: resident, or remembered after eviction."""
        if index in self.history_index:
            position = self.history_index.index(index)
            return self.history_start[position], self.full_pages(position)
        return self.recent[index]

    def recache_layout_parts(
        self, plan: RecachePlan, starts: tuple[int, ...] | None = None
    ) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...], tuple[int, ...]]:
        """``(history pages, history spans, starts of the rebuilt chunks)`` of a re-cache forward: the kept sinks
        (none when the plan rebuilds them); each rebuilt chunk at its original absolute start, RoPE positions as
        generated (``starts`` when given: only another lane may know them)."""
        pages = tuple(p for i in plan.kept for p in self.history[i])
        spans = tuple(span for i in plan.kept for span in self.chunk_spans(i))
        starts = starts if starts is not None else tuple(self.recache_chunk(i)[0] for i in plan.rebuilt)
        return pages, spans, starts

    def preview_recache_commit(
        self, plan: RecachePlan
    ) -> tuple[tuple[PageChunk, ...], tuple[int, ...], list[int], tuple[PageChunk, ...]]:
        """The history after swapping the rebuilt (pending) chunks in (pure).

        Returns ``(history chunks, history starts, old pages to release, pending chunks to drop)``: a
        context chunk's pending pages are dropped; a moved sink takes its slot with its own start.
        Commit indices are unchanged: the same slots, re-computed.
        """
        assert len(plan.rebuilt) == len(self.pending), "re-cache pending chunks do not match the plan"
        resident, starts = list(self.history), list(self.history_start)
        old: list[int] = []
        dropped: list[PageChunk] = []
        for index, slot, fresh in zip(plan.rebuilt, plan.replaces, self.pending):
            if slot is None:
                dropped.append(fresh)
                continue
            old.extend(resident[slot])
            kept = self.history_kept[slot] if self.history_kept else None
            if kept is not None:  # rebuilt whole, held trimmed as before (its pages beyond the trim released)
                fresh, _, gone = trim_chunk(fresh, None, kept.offsets)
                old.extend(gone)
            resident[slot] = fresh
            starts[slot] = self.recache_chunk(index)[0]
        old.extend(self.selection_pages())  # a content selection holds the old prompt's K/V: dropped (re-chosen at
        return tuple(resident), tuple(starts), old, tuple(dropped)  # the next scoring commit)

    def recache_copies(
        self, swapped: tuple[PageChunk, ...], released: Mapping[int, int], allocator: PageAllocator
    ) -> tuple[tuple[PageChunk, ...], list[tuple[PageChunk, PageChunk]]]:
        """Move rebuilt chunks in fresh pages into ring slots the commit frees (pure; see :func:`ring_copies`)."""
        return ring_copies(self, swapped, released, allocator)

    def split_pending(self) -> tuple[list[int], list[int]]:
        """``(ring pages, fresh pages)`` of the pending chunks: those in extent slots (one reference on top
        of the reservation) and those taken from the general pool (their only reference)."""
        extent = set(self.extent)
        ring = [p for chunk in self.pending if chunk and chunk[0] in extent for p in chunk]
        fresh = [p for chunk in self.pending if not (chunk and chunk[0] in extent) for p in chunk]
        return ring, fresh

    def apply_recache_commit(self, resident: tuple[PageChunk, ...], starts: tuple[int, ...], plan: RecachePlan) -> None:
        """Adopt :meth:`preview_recache_commit`'s history; the caller drops the old and dropped pages' references.

        A moved sink's slot keeps its commit index (the policy keeps sinks by index) but holds the moved
        chunk's K/V at that chunk's positions: its kept latents follow it into the slot.
        """
        if plan.moved:
            latents = dict(self.latents)
            for index, slot in zip(plan.rebuilt, plan.replaces):
                if slot is not None and slot < len(self.sinks):
                    sink = self.history_index[slot]
                    latents.pop(sink, None)
                    if index in self.latents:
                        latents[sink] = self.latents[index]
            self.latents = latents
        self.history, self.history_start, self.pending = resident, starts, ()
        self.adopt_selection(None)


def ring_copies(
    branch: BranchRecache, swapped: tuple[PageChunk, ...], released: Mapping[int, int], allocator: PageAllocator
) -> tuple[tuple[PageChunk, ...], list[tuple[PageChunk, PageChunk]]]:
    """Move rebuilt chunks that sit in fresh pages into ring slots free once the commit is applied (pure).

    ``swapped``: :meth:`BranchPages.preview_recache_commit`'s history chunks; ``released``: how many references
    the whole commit drops from each page (every stream's old chunks). Returns the history chunks
    after the moves and the ``(fresh chunk, ring slot chunk)`` copies they need. A slot is free
    after the commit when only the extent's reservation still references its pages (refcount minus
    released == 1): the old chunk it held was this branch's alone (no fork shares it), or it was
    already free. A rebuilt chunk takes the slot of the chunk it replaces when that one is free
    (the resident page ids stay as they were), else the lowest free slot; with no free slot left it
    stays in its fresh pages (the plain swap). Rebuilt chunks already in ring slots never move::

        extent: [ s0 | c5 | c6 | free ]     re-cache of c5 c6 (sink kept), one free slot
        pending:  c5' -> free slot,  c6' -> fresh pages
        commit:   c5' stays in its slot (c5's slot frees), c6' copied into c6's slot, fresh freed
        extent: [ s0 | free | c6' | c5' ]   the ring is whole, no page outside it
    """
    if not branch.extent:
        return swapped, []
    step = branch.pages_per_chunk
    extent = set(branch.extent)
    refcount = allocator.refcount
    free = [slot for slot in branch.extent_slots() if all(refcount(p) - released.get(p, 0) == 1 for p in slot)]
    moving = [i for i, chunk in enumerate(swapped) if chunk != branch.history[i] and chunk[0] not in extent]
    if branch.frame_slots:  # frame slots: a (trimmed) rebuilt chunk takes one free slot per frame, lowest first
        return frame_ring_copies(swapped, moving, free, branch.extent_slot_pages)
    resident = list(swapped)
    copies: list[tuple[PageChunk, PageChunk]] = []
    by_start = {slot[0]: slot for slot in free}
    rest = []
    for i in moving:  # first pass: back into the slot of the chunk it replaces
        slot = by_start.get(branch.history[i][0])
        if slot is None:
            rest.append(i)
            continue
        free.remove(slot)
        copies.append((resident[i], slot[: len(resident[i])]))
        resident[i] = slot[: len(resident[i])]
    for i in rest:  # then the lowest free slots (a shorter chunk takes a slot's first pages)
        if not free:
            break
        slot = free.pop(0)
        assert len(slot) == step and len(resident[i]) <= step
        copies.append((resident[i], slot[: len(resident[i])]))
        resident[i] = slot[: len(resident[i])]
    return tuple(resident), copies
