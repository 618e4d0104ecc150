"""One KV branch's pages: committed history chunks and pending chunks (pure Python).

A chunk is a tuple of page ids (``pages_per_chunk`` of them). The branch holds
one reference on every page it lists; all page bookkeeping goes through the
:class:`~ardiff_modules.core.allocator.PageAllocator`, eviction through the branch's
:class:`~ardiff_modules.core.retention.RetentionPolicy` (sink + window by default)::

    sinks (never evicted) | window (last W committed) | pending (being denoised)
          written once          committed = immutable      overwritten by every
                                                           denoising forward

Committed pages are immutable, which is what makes sharing them by refcount
(forks) safe. Methods validate first and mutate last, so a raised exception
leaves the branch and the allocator unchanged.

Contiguous extents (optional, ``extent_chunks``): the branch reserves one run
of consecutive page ids holding ``sinks + window + 1`` chunk slots, used as a
ring -- a new pending chunk takes the lowest free slot, which after the window
fills is the slot of the chunk just evicted::

    extent:  [ slot0 | slot1 | slot2 | slot3 ]      sink=1, window=2
    chunk 0 -> slot0 (sink)   chunk 1 -> slot1   chunk 2 -> slot2   chunk 3 -> slot3
    commit 3 evicts chunk 1;  chunk 4 -> slot1   (visible: slots 0..3, one range)

so a one-chunk forward's visible keys are always one contiguous token range,
attended without paging. The extent holds one reference on each of its pages
(the reservation); resident and pending chunks inside it hold one more. A
re-cache fills the free slots first and, at commit, copies the rebuilt chunks
that did not fit back into the slots it frees (:meth:`BranchPages.recache_copies`). A lane that trims chunks
to frames cuts its extent into frame slots instead (``frame_slots``; ``core/branch_frame_extent.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate

from ardiff_modules.core.allocator import PageAllocator
from ardiff_modules.core.frame_retention import Kept, page_runs, sink_offsets, trim_chunk, trim_retained, trims_frames
from ardiff_modules.core.branch_frame_extent import BranchFrameExtent
from ardiff_modules.core.branch_recache import BranchRecache, PageChunk, ring_copies
from ardiff_modules.core.branch_selection import BranchSelection, Selection
from ardiff_modules.core.retention import RetentionPolicy, Retained, retain
from ardiff_modules.core.selected_retention import selecting

__all__ = ["BranchImage", "BranchPages", "PageChunk", "ring_copies"]


class BranchPages(BranchSelection, BranchFrameExtent, BranchRecache):
    """Resident committed chunks, pending chunks and the absolute token offset of one branch."""

    def __init__(
        self, policy: RetentionPolicy, pages_per_chunk: int, chunk_size: int, extent_chunks: int | None = None,
        recache_horizon: int = 0, frame_slots: bool = False,
    ) -> None:
        self.policy = policy
        self.pages_per_chunk = pages_per_chunk
        self.chunk_size = chunk_size
        #: Slots of the contiguous extent to reserve on first use (``None``: plain paging): chunks, or with
        #: ``frame_slots`` frames (``core/branch_frame_extent.py``).
        self.extent_chunks = extent_chunks
        self.extent: tuple[int, ...] = ()
        #: Resident committed chunks, oldest first, and their commit indices (what the policy keeps).
        self.history: tuple[PageChunk, ...] = ()
        self.history_index: tuple[int, ...] = ()
        #: Absolute position of the first token of each history chunk.
        self.history_start: tuple[int, ...] = ()
        #: Per history chunk, its trim under a frame policy (``core/frame_retention.py``; ``None``: whole);
        #: ``()``: no chunk is trimmed (every policy but a frame policy).
        self.history_kept: tuple[Kept | None, ...] = ()
        #: Pages of one frame when the policy trims chunks to frames (``0``: it does not).
        self.pages_per_frame = pages_per_chunk // policy.frames_per_chunk if trims_frames(policy) else 0  # type: ignore[attr-defined]
        self.frame_slots = frame_slots and extent_chunks is not None and self.pages_per_frame > 0
        #: Pages of one extent slot (a chunk's, or a frame's with ``frame_slots``).
        self.extent_slot_pages = self.pages_per_frame if self.frame_slots else pages_per_chunk
        #: Whether the policy chooses pages by content at some commit (``core/branch_selection.py``).
        self.selects = selecting(policy) is not None
        self.pending: tuple[PageChunk, ...] = ()
        #: Chunks ever committed (evicted ones included).
        self.committed_chunks = 0
        #: Tokens ever committed (evicted ones included): drives absolute positions. Chunks may
        #: differ in length (e.g. a 1-frame first chunk), so this is not chunks x chunk_size.
        self.committed_tokens = 0
        #: The open forward whose pending chunks these are (opaque here; see ``core/transaction.py``).
        self.transaction: object | None = None
        #: Clean latents kept on request (``keep_latents``), by commit index: opaque here (tensors), only
        #: ever of history chunks and remembered evicted ones -- pruned in the same step. Read by a re-cache.
        self.latents: dict[int, object] = {}
        #: Evicted chunks a re-cache rule may rebuild as context or new sinks (``RecacheRule.horizon``): the
        #: last ``recache_horizon`` non-sink chunks evicted, commit index -> (absolute start, pages).
        self.recache_horizon = recache_horizon
        self.recent: dict[int, tuple[int, int]] = {}
        #: Bumped by :meth:`release` (a reset or close): positions restart at 0 in a new generation, so what was
        #: recorded of the old one (a straight-through ledger's writes) never matches the new chunks.
        self.generation = 0
        #: Commit index at which the current shot began (:meth:`begin_shot`; ``None``: none): a shot policy pins
        #: its first chunks. ``window_floor``: non-sink chunks below it were dropped (:meth:`preview_drop_window`).
        self.shot_start: int | None = None
        self.window_floor = 0

    def attach(self, transaction: object) -> None:
        """The branch's pending chunks now belong to ``transaction`` (an open forward)."""
        self.transaction = transaction

    def detach(self, transaction: object) -> None:
        """``transaction`` finished: the branch belongs to no forward (unless a later one took it already)."""
        if self.transaction is transaction:
            self.transaction = None

    # ------------------------------------------------------------------ queries
    @property
    def page_size(self) -> int:
        return self.chunk_size // self.pages_per_chunk

    @property
    def token_offset(self) -> int:
        """Absolute position of the first pending token (tokens ever committed)."""
        return self.committed_tokens

    @property
    def history_chunks(self) -> tuple[PageChunk, ...]:
        """Visible committed chunks, oldest first (sinks, then whatever the policy keeps)."""
        return self.history

    @property
    def sinks(self) -> tuple[PageChunk, ...]:
        """The history chunks the policy never evicts (its first ``sink_chunks``)."""
        return tuple(c for c, i in zip(self.history, self.history_index) if i < self.policy.sink_chunks)

    def history_spans(self, exact: bool = False) -> list[tuple[int, int]]:
        """``(first absolute position, tokens)`` of each run of history tokens, in :meth:`history_pages` order:
        one per history chunk, or one per run of kept pages of a trimmed chunk; a content selection as one span at
        its candidates' first position, or with ``exact`` one per run of chosen pages (a device sync)."""
        if self.selection is not None:  # (content-selected lanes: core/branch_selection.py)
            chosen = self.selection_spans(exact)
            chunks = self.with_selection([self.chunk_spans(j) for j in range(len(self.history))], chosen)
            return [span for spans in chunks for span in spans]
        if self.history_kept:
            return [span for j in range(len(self.history)) for span in self.chunk_spans(j)]
        size = self.page_size
        return [(start, len(chunk) * size) for chunk, start in zip(self.history, self.history_start)]

    def chunk_spans(self, j: int) -> list[tuple[int, int]]:
        """``(first absolute position, tokens)`` of each run of kept pages of history chunk ``j``."""
        size, start = self.page_size, self.history_start[j]
        kept = self.history_kept[j] if self.history_kept else None
        if kept is None:
            return [(start, len(self.history[j]) * size)]
        return [(start + first * size, pages * size) for first, pages in page_runs(kept.offsets)]

    def full_pages(self, j: int) -> int:
        """Pages history chunk ``j`` was written with (more than it holds once trimmed)."""
        kept = self.history_kept[j] if self.history_kept else None
        return len(self.history[j]) if kept is None else kept.full

    def sink_tokens(self) -> int:
        """Tokens the sink chunks were written with (trimmed or not): the clock after them."""
        return sum(self.full_pages(j) for j, i in enumerate(self.history_index) if i < self.policy.sink_chunks) * (
            self.page_size
        )

    def sink_pages(self, positions: Sequence[int] | None = None) -> int:
        """Leading pages of the history chunks at ``positions`` (default all, in order) that relative sinks shift:
        every page of the sink chunks, or under a frame policy the runs of held pages holding a sink frame -- a
        window frame a sink chunk also holds early on (``FrameWindowPolicy(1, 1, 3)`` after one chunk: f0 and f2)
        is not a sink, so the gap before it is closed as the gap before any window token is."""
        total = 0
        for j in range(len(self.history)) if positions is None else positions:
            index = self.history_index[j]
            if index >= self.policy.sink_chunks:
                break
            kept = self.history_kept[j] if self.history_kept else None
            if kept is None:
                total += len(self.history[j])
                continue
            sinks = set(sink_offsets(self.policy, index, self.pages_per_frame))
            for first, pages in page_runs(kept.offsets):
                if sinks.isdisjoint(range(first, first + pages)):
                    return total  # the sinks lead the history: what follows is window
                total += pages
        return total

    def history_positions(self) -> list[int]:
        """Absolute position of every token of the history chunks, in :meth:`history_pages` order."""
        return [start + t for start, tokens in self.history_spans(exact=True) for t in range(tokens)]

    def history_pages(self) -> list[int]:
        if self.selection is not None:
            return [page for chunk in self.with_selection(list(self.history), self.selection.pages) for page in chunk]
        return [page for chunk in self.history_chunks for page in chunk]

    def pending_pages(self) -> list[int]:
        return [page for chunk in self.pending for page in chunk]

    def referenced_pages(self) -> list[int]:
        """Every page this branch holds a reference on (one entry per reference, extent reservation included)."""
        return self.history_pages() + self.pending_pages() + list(self.pending_selection) + list(self.extent)

    def reusable_pending(self, chunk_pages: Sequence[int]) -> int:
        """How many leading pending chunks a forward with these chunk sizes (in pages) reuses as they are."""
        k = 0
        while k < min(len(self.pending), len(chunk_pages)) and len(self.pending[k]) == chunk_pages[k]:
            k += 1
        return k

    def pages_needed(self, chunks: int | Sequence[int], allocator: PageAllocator) -> int:
        """Free pages :meth:`replace_pending` would allocate (plus the extent if not yet reserved)."""
        chunk_pages = self._chunk_pages(chunks)
        missing = chunk_pages[self.reusable_pending(chunk_pages) :]
        if self.extent_chunks is None:
            return sum(missing)
        if self.frame_slots:
            return self.frame_pages_needed(missing, allocator)
        if not self.extent:
            return self.extent_chunks * self.pages_per_chunk + sum(missing[self.extent_chunks :])
        return sum(missing[len(self.free_extent_slots(allocator)) :])

    def _chunk_pages(self, chunks: int | Sequence[int]) -> list[int]:
        """``chunks`` full chunks, or the size in pages of each chunk."""
        return [self.pages_per_chunk] * chunks if isinstance(chunks, int) else list(chunks)

    # ------------------------------------------------------------------ mutation
    def set_pending(self, chunks: int | Sequence[int], allocator: PageAllocator) -> None:
        """Make the branch hold exactly these pending chunks (a count of full chunks, or pages per chunk).

        Leading pending chunks of the right size are reused (denoising forwards overwrite them
        in place); the rest are allocated, surplus or mismatched ones freed. Raises
        :class:`~ardiff_modules.errors.CapacityError` before changing anything.
        """
        stale = self.replace_pending(chunks, allocator)
        allocator.decref(page for chunk in stale for page in chunk)

    def replace_pending(self, chunks: int | Sequence[int], allocator: PageAllocator) -> tuple[PageChunk, ...]:
        """Like :meth:`set_pending`, but return the replaced chunks still referenced (caller releases them).

        Keeping them referenced until the forward is published lets :meth:`undo_grow` restore
        the previous pending chunks exactly if planning fails.
        """
        chunk_pages = self._chunk_pages(chunks)
        k = self.reusable_pending(chunk_pages)
        missing = chunk_pages[k:]
        stale = self.pending[k:]
        if self.frame_slots:  # frame slots: a chunk takes several free ones (lowest first), or pool pages (all of it)
            placed = self.place_in_frames(missing, self.free_frame_slots(allocator))
            pool = iter(allocator.allocate(sum(n for n, c in zip(missing, placed) if c is None)))
            allocator.incref(p for c in placed if c is not None for p in c)
            grown = tuple(c if c is not None else tuple(next(pool) for _ in range(n)) for n, c in zip(missing, placed))
            self.pending = self.pending[:k] + grown
            return stale
        # Free slots are computed before anything changes; a slot fits any chunk (<= a full chunk).
        slots = [slot[:n] for slot, n in zip(self.free_extent_slots(allocator), missing)]
        fresh = allocator.allocate(sum(missing[len(slots) :]))
        allocator.incref(p for slot in slots for p in slot)
        new: list[PageChunk] = list(slots)
        start = 0
        for n in missing[len(slots) :]:
            new.append(tuple(fresh[start : start + n]))
            start += n
        self.pending = self.pending[:k] + tuple(new)
        return stale

    def undo_grow(self, old_pending: tuple[PageChunk, ...], allocator: PageAllocator) -> list[int]:
        """Roll pending back to ``old_pending`` after a failed prepare; return the fresh pages to unallocate.

        Extent slots only lose the reference :meth:`replace_pending` added; freshly allocated
        pages are returned (still referenced) so the caller can undo their allocation exactly.
        The replaced chunks kept their references, so restoring ``old_pending`` is exact.
        """
        k = 0
        while k < min(len(old_pending), len(self.pending)) and old_pending[k] is self.pending[k]:
            k += 1
        grown = self.pending[k:]
        extent = set(self.extent)
        in_extent = [c for c in grown if c and c[0] in extent]
        allocator.decref(p for c in in_extent for p in c)
        self.pending = old_pending
        return [p for c in grown if not (c and c[0] in extent) for p in c]

    def commit_pending(self, allocator: PageAllocator) -> list[int]:
        """Turn pending chunks into history (no copy), evict per the policy; return freed pages."""
        result = self.preview_commit()
        freed = allocator.decref(page for chunk in result.evicted for page in chunk)
        self.apply_commit(result)
        return freed

    def preview_commit(self) -> Retained[PageChunk]:
        """What committing the pending chunks would do (pure: nothing changes).

        Raises :class:`~ardiff_modules.errors.SpecError` when the policy breaks its contract
        (:func:`~ardiff_modules.core.retention.retain` checks its answer): the branch and the pool stay as
        they were. With :meth:`apply_commit`, lets a forward over several branches compute every
        branch's commit first and apply them all with one allocator call (all or none).
        """
        result = retain(
            self.policy, self.history, self.history_index, self.committed_chunks, self.pending,
            shot_start=self.shot_start, window_floor=self.window_floor,
        )
        if not self.pages_per_frame:
            return result
        held = dict(zip(self.history_index, self.history_kept or (None,) * len(self.history)))
        return trim_retained(result, held, self.policy, self.committed_chunks + len(self.pending), self.pages_per_frame)

    def apply_commit(self, result: Retained[PageChunk], latents: Sequence[object] = ()) -> None:
        """Adopt a :meth:`preview_commit` result; the caller drops the references of ``result.evicted``.

        ``latents``: the committed chunks' clean latents to keep (one per pending chunk), or ``()``.
        """
        kept = dict(self.latents)
        kept.update({self.committed_chunks + i: latent for i, latent in enumerate(latents)})
        starts = dict(zip(self.history_index, self.history_start))
        pages = (
            {i: self.full_pages(j) for j, i in enumerate(self.history_index)} if self.history_kept
            else dict(zip(self.history_index, map(len, self.history)))  # (no call per chunk: once per commit and stream)
        )
        position = self.committed_tokens
        for offset, chunk in enumerate(self.pending):
            starts[self.committed_chunks + offset] = position
            pages[self.committed_chunks + offset] = len(chunk)
            position += len(chunk) * self.page_size
        self.committed_chunks += len(self.pending)
        self.committed_tokens = position
        self.history, self.history_index, self.pending = result.history, result.indices, ()
        self.history_start = tuple(starts[i] for i in result.indices)
        self.history_kept = result.kept
        if self.recache_horizon:
            resident = set(result.indices)
            evicted = {i: (starts[i], pages[i]) for i in starts if i not in resident}
            recent = {**self.recent, **evicted}
            keep = sorted(i for i in recent if i >= self.policy.sink_chunks)[-self.recache_horizon :]
            self.recent = {i: recent[i] for i in keep}
        # Evicted chunks' latents go in the same step (but those a re-cache rule still remembers).
        self.latents = {i: kept[i] for i in (*result.indices, *self.recent) if i in kept}

    # ------------------------------------------------------------------ shots (core/shot_sink.py)
    def preview_drop_window(self) -> Retained[PageChunk]:
        """The history with only its sinks left (pure): ``evicted`` are the window chunks (memory, shot sink)."""
        sinks = self.policy.sink_chunks
        kept = [(c, i) for c, i in zip(self.history, self.history_index) if i < sinks]
        gone = tuple(c for c, i in zip(self.history, self.history_index) if i >= sinks)
        trims = tuple(k for k, i in zip(self.history_kept, self.history_index) if i < sinks)
        if self.pages_per_frame:  # a sink chunk may hold window frames too (early on): they go with the window
            cut = [trim_chunk(c, k, sink_offsets(self.policy, i, self.pages_per_frame))
                   for (c, i), k in zip(kept, trims or (None,) * len(kept))]
            kept = [(pages, i) for (pages, _, _), (_, i) in zip(cut, kept)]
            trims = tuple(k for _, k, _ in cut)
            gone += tuple(released for _, _, released in cut if released)
        return Retained(tuple(c for c, _ in kept), tuple(i for _, i in kept), gone + (self.selection_pages(),), trims)

    def apply_drop_window(self, result: Retained[PageChunk]) -> None:
        """Adopt :meth:`preview_drop_window`; the caller drops the references of ``result.evicted``.

        Offsets and commit indices run on; the dropped chunks are forgotten (no later commit keeps them, no
        re-cache rebuilds them), and so is a shot that already pinned chunks (one beginning at the next commit
        stays).
        """
        starts = dict(zip(self.history_index, self.history_start))
        self.history, self.history_index = result.history, result.indices
        self.history_start = tuple(starts[i] for i in result.indices)
        self.history_kept = result.kept
        self.selection = None
        self.window_floor = self.committed_chunks
        self.recent = {}
        self.latents = {i: t for i, t in self.latents.items() if i in starts and i in result.indices}
        if self.shot_start is not None and self.shot_start < self.committed_chunks:
            self.shot_start = None

    def begin_shot(self) -> None:
        """The next committed chunk begins a new shot: a shot policy pins it (and the next ones it pins) from
        that commit on, instead of the current shot's chunks (ordinary window chunks from then on)."""
        self.shot_start = self.committed_chunks

    def clear_pending(self) -> None:
        """Forget the pending chunks (and reserved selection pages); the caller drops their references."""
        self.pending = self.pending_selection = ()

    def drop_pending(self, allocator: PageAllocator) -> list[int]:
        """Release pending chunks; history is untouched."""
        freed = allocator.decref(self.pending_pages() + list(self.pending_selection))
        self.pending = self.pending_selection = ()
        return freed

    def release(self, allocator: PageAllocator) -> list[int]:
        """Drop every reference (history, pending, extent) and start over at offset 0."""
        freed = allocator.decref(self.referenced_pages())
        self.history = self.pending = ()
        self.history_index = self.history_start = ()
        self.history_kept = ()
        self.selection, self.pending_selection = None, ()
        self.latents = {}
        self.recent = {}
        self.extent = ()
        self.committed_chunks = 0
        self.committed_tokens = 0
        self.shot_start, self.window_floor = None, 0
        self.transaction = None
        self.generation += 1
        return freed

    def adopt(
        self, other: BranchPages, allocator: PageAllocator, *, sinks_only: bool = False,
        clock: tuple[int, int] | None = None,
    ) -> None:
        """Share ``other``'s committed history by refcount (a fork): zero pages copied. ``sinks_only``: just the
        sink chunks (sessions that start from the same first frame), continuing after them with an empty window,
        or after ``clock`` ``(chunks, tokens)`` (a lane whose group keeps fewer sinks than the stream has)."""
        count = len(other.sinks) if sinks_only else len(other.history)
        resident, indices, starts = other.history[:count], other.history_index[:count], other.history_start[:count]
        written = other.sink_tokens() if sinks_only else other.committed_tokens
        kept = other.history_kept[:count]
        if sinks_only and self.pages_per_frame:  # a frame lane shares the sink frames alone (its window starts empty)
            trims = [trim_chunk(c, k, sink_offsets(self.policy, i, self.pages_per_frame))
                     for c, k, i in zip(resident, kept or (None,) * count, indices)]
            resident, kept = tuple(t[0] for t in trims), tuple(t[1] for t in trims)
        selection = None if sinks_only else other.selection
        allocator.incref([p for chunk in resident for p in chunk] + list(selection.pages if selection else ()))
        self.release(allocator)
        self.history, self.history_index, self.history_start = resident, indices, starts
        self.selection = selection
        self.history_kept = kept
        self.recent = {} if sinks_only else dict(other.recent)
        self.latents = {i: other.latents[i] for i in (*indices, *self.recent) if i in other.latents}  # shared
        self.committed_chunks = len(resident) if sinks_only else other.committed_chunks
        self.committed_tokens = written
        self.shot_start, self.window_floor = (None, 0) if sinks_only else (other.shot_start, other.window_floor)
        if clock is not None:  # the chunks between this lane's sinks and the clock were never shared: dropped
            self.committed_chunks, self.committed_tokens = clock
            self.window_floor = clock[0]


def drop_pending(branches: Sequence[BranchPages], allocator: PageAllocator) -> list[int]:
    """Release the pending chunks of ``branches`` (kept by finished denoising forwards) with one allocator call,
    in branch order; history is untouched. Returns the pages that became free."""
    freed = allocator.decref([p for b in branches for p in b.pending_pages()] + [p for b in branches for p in b.pending_selection])
    for b in branches:
        b.clear_pending()
    return freed


def drop_windows(branches: Sequence[BranchPages], allocator: PageAllocator) -> list[int]:
    """Drop the window (every resident chunk but the sinks) of ``branches`` with one allocator call; offsets,
    commit indices and pending chunks are untouched (:meth:`BranchPages.apply_drop_window`). Returns the pages
    that became free (a fork or a training hold sharing a chunk keeps it)."""
    results = [b.preview_drop_window() for b in branches]
    freed = allocator.decref(p for r in results for chunk in r.evicted for p in chunk)
    for b, r in zip(branches, results):
        b.apply_drop_window(r)
    return freed

# ------------------------------------------------------------------ host tier (suspend / resume)
@dataclass(frozen=True)
class BranchImage:
    """What a suspended branch keeps of its :class:`BranchPages` besides page references (:func:`unload_branch`).

    ``history`` lists the device page ids the chunks had when suspended (released since: names, not
    references); the rest is the bookkeeping a resume restores as it was.
    """

    history: tuple[PageChunk, ...]
    history_index: tuple[int, ...]
    history_start: tuple[int, ...]
    committed_chunks: int
    committed_tokens: int
    latents: Mapping[int, object]
    recent: Mapping[int, tuple[int, int]]
    #: Per history chunk, the slot of the contiguous extent it sat in (``None``: outside it, or no extent), so a
    #: resume puts it back in the same slot: the ring's keys keep their order, and a ragged kernel, which reads
    #: the ring in slot order, sums them in the same order (bit-identical outputs after a resume or a load).
    slots: tuple[int | None, ...] = ()
    shot_start: int | None = None
    window_floor: int = 0
    #: Per history chunk, its trim under a frame policy (``BranchPages.history_kept``); ``()``: none trimmed.
    kept: tuple[Kept | None, ...] = ()
    #: The content selection (``BranchPages.selection``, its offsets on the host; ``pages``: device page ids when
    #: suspended, like ``history``), ``None``: none.
    selection: Selection | None = None
    #: A frame lane's (:func:`frame_slots_of`): per history chunk the frame slot of each of its frames, and the
    #: selection's (``()``: none) -- ``slots`` for frames, so that a resume into a frame extent puts every frame
    #: where the keys keep the order they were summed in.
    frame_slots: tuple[tuple[int, ...], ...] = ()
    selection_slots: tuple[int, ...] = ()


def unload_branch(branch: BranchPages, allocator: PageAllocator) -> tuple[BranchImage, list[int]]:
    """Suspend ``branch``: its image, and every reference it held dropped (the pages that became free).

    The branch must have no pending chunk (the caller refuses a session with pending work); it is left
    empty at offset 0, holding nothing (a close while suspended releases nothing twice).
    """
    assert not branch.pending, "unload_branch: pending chunks must be finished first"
    image = branch_image(branch)
    generation = branch.generation
    freed = branch.release(allocator)
    branch.generation = generation  # the same stream, resumed later: not a new one (release bumps it for a reset)
    return image, freed


def branch_image(branch: BranchPages) -> BranchImage:
    """What :func:`load_branch` restores of ``branch`` (its committed state; nothing released, nothing copied). A
    content selection's offsets are read to the host (a device sync while they are still there: a cold path)."""
    return BranchImage(
        branch.history, branch.history_index, branch.history_start, branch.committed_chunks,
        branch.committed_tokens, dict(branch.latents), dict(branch.recent), extent_slots_of(branch), branch.shot_start,
        branch.window_floor, branch.history_kept, branch.selection.host() if branch.selection is not None else None,
        *frame_slots_of(branch),
    )


def frame_slots_of(branch: BranchPages) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """A frame lane's frame slots for a resume into a frame extent: per history chunk the slot of each of its
    frames, and the selection's (``()``: none); ``((), ())`` for a lane that does not trim chunks to frames.

    Where every page sits in the branch's extent, the slots they have (a ragged kernel summed the keys in slot
    order). Otherwise (plain paging, or a fork's shared pages outside its extent: it attended paged, in history
    order with the selection after the sink chunks) consecutive slots in that order, which the keys keep."""
    step = branch.pages_per_frame
    if not step:
        return (), ()
    offset = {p: i for i, p in enumerate(branch.extent)} if branch.frame_slots else {}
    selection = branch.selection.pages if branch.selection is not None else ()
    if offset and all(p in offset for p in (*branch.history_pages(), *selection)):
        def slots(pages: Sequence[int]) -> tuple[int, ...]:
            return tuple(offset[pages[i]] // step for i in range(0, len(pages), step))

        return tuple(slots(c) for c in branch.history), slots(selection)
    frames = [-(-len(pages) // step) for pages in branch.with_selection(list(branch.history), selection)]
    starts = accumulate(frames[:-1], initial=0)
    per = [tuple(range(start, start + n)) for start, n in zip(starts, frames)]  # attention order
    own = per.pop(branch._sink_count()) if branch.selection is not None else ()
    return tuple(per), own


def extent_slots_of(branch: BranchPages) -> tuple[int | None, ...]:
    """Per history chunk, the index of the extent slot it sits in (``None``: outside the extent, or none; a frame
    extent's chunks too: a resume lays them out in its frame slots in history order)."""
    if not branch.extent or branch.frame_slots:
        return tuple(None for _ in branch.history)
    first, step = branch.extent[0], branch.pages_per_chunk
    inside = set(branch.extent)
    return tuple((c[0] - first) // step if c and c[0] in inside else None for c in branch.history)


def load_branch(
    branch: BranchPages, image: BranchImage, chunks: Sequence[PageChunk], extent: tuple[int, ...] = (),
    selection: Sequence[int] = (),
) -> None:
    """Resume ``branch`` from ``image`` with its chunks in ``chunks`` (references already taken by the caller:
    :class:`~ardiff_modules.core.reservation.ResumeReservation`), inside ``extent`` (its reservation's references
    taken too) or plain paged; ``selection``: the pages of ``image``'s content selection (references taken too), in
    its order."""
    assert not branch.history and not branch.pending and not branch.extent, "load_branch: expected an empty branch"
    assert list(map(len, chunks)) == list(map(len, image.history)), "load_branch: chunk sizes changed"
    branch.extent = extent
    branch.history, branch.history_index = tuple(chunks), image.history_index
    branch.history_start = image.history_start
    branch.committed_chunks, branch.committed_tokens = image.committed_chunks, image.committed_tokens
    branch.latents, branch.recent = dict(image.latents), dict(image.recent)
    branch.shot_start, branch.window_floor = image.shot_start, image.window_floor
    branch.history_kept = image.kept
    branch.restore_selection(image.selection, tuple(selection))
