"""A branch's content-selected pages: where they sit in its history and what a commit scores (pure Python).

:class:`BranchSelection` is the part of :class:`~ardiff_modules.core.branch.BranchPages` a
:class:`~ardiff_modules.core.selected_retention.SelectedFramesPolicy` uses. The selection is one run of pages
between the sink chunks and the window (:meth:`BranchSelection.with_selection`), replaced at each commit that
scores (:meth:`BranchSelection.preview_selection` names the candidates' pages and the reserved destination;
``core/transaction.py`` has the device choose and copy, then adopts it). Which candidate pages were chosen is
device data (:class:`Selection`'s ``offsets``): positions are exact only when asked (:meth:`selection_spans`);
everywhere else the selection counts as its candidates' first position.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from ardiff_modules.core.frame_retention import Kept, page_runs
from ardiff_modules.core.retention import RetentionPolicy
from ardiff_modules.core.selected_retention import SelectedFramesPolicy, candidates_at, selecting

PageChunk = tuple[int, ...]


class ResolvableOffsets(Protocol):
    """The chosen candidate page offsets while on the device (``ardiff_modules.selection``): :meth:`resolve` reads
    them (a device sync: cold paths only -- a suspend, a file, a token mask)."""

    def resolve(self) -> tuple[int, ...]: ...


class Selection(NamedTuple):
    """A branch's selected pages: copies of the chosen candidate pages, in ascending position order."""

    pages: tuple[int, ...]
    #: Absolute position of the first candidate token (candidates are consecutive frames).
    start: int
    #: Commit index of the chunk whose commit chose it.
    made_at: int
    #: Offsets of the chosen pages among the candidates' pages, ascending: a tuple, or a device handle.
    offsets: tuple[int, ...] | ResolvableOffsets

    def resolved(self) -> tuple[int, ...]:
        """The chosen offsets as host ints (:meth:`ResolvableOffsets.resolve` when still on the device)."""
        return self.offsets if isinstance(self.offsets, tuple) else tuple(self.offsets.resolve())

    def host(self) -> Selection:
        """This selection with its offsets on the host (what an image or a file keeps)."""
        return self._replace(offsets=self.resolved())


class SelectionJob(NamedTuple):
    """One branch's scoring at a commit: the device scores ``candidates`` against ``boundary`` (the frame after
    them), keeps ``len(destination)`` of the candidate pages and copies them into ``destination``."""

    candidates: tuple[int, ...]
    boundary: tuple[int, ...]
    destination: tuple[int, ...]
    start: int
    made_at: int


class BranchSelection:
    """Selection methods of a branch's pages (mixed into ``BranchPages``, whose fields they read)."""

    policy: RetentionPolicy
    pages_per_chunk: int
    pages_per_frame: int
    history: tuple[PageChunk, ...]
    history_index: tuple[int, ...]
    history_kept: tuple[Kept | None, ...]
    pending: tuple[PageChunk, ...]
    committed_chunks: int
    window_floor: int
    #: The current selection (``None``: none -- before the first scoring commit, or the policy never selects).
    selection: Selection | None = None
    #: Pages reserved by an open committing forward for the selection its commit makes (``()``: none).
    pending_selection: tuple[int, ...] = ()

    @property
    def page_size(self) -> int:
        raise NotImplementedError

    def selection_pages_needed(self, num_chunks: int) -> int:
        """Pages a committing forward of ``num_chunks`` chunks reserves for the selection its commit makes."""
        policy = selecting(self.policy)
        if policy is None or self._candidates(policy, self.committed_chunks + num_chunks - 1) is None:
            return 0
        return policy.selected_pages(self.pages_per_frame)

    def _candidates(self, policy: SelectedFramesPolicy, index: int) -> tuple[int, int] | None:
        """The candidates the commit of chunk ``index`` scores: never frames below the window's floor (a dropped
        window, a stream started from shared sinks: it holds no frame between its sinks and the floor)."""
        return candidates_at(self.policy, index, self.window_floor * policy.frames_per_chunk)

    def reserve_selection(self, pages: tuple[int, ...]) -> None:
        """Hold ``pages`` (freshly allocated, one reference each) for the selection of the open committing forward."""
        self.pending_selection = pages

    def unreserve_selection(self) -> tuple[int, ...]:
        """Forget the reserved selection pages (undoing :meth:`reserve_selection`); return them, still referenced."""
        pages, self.pending_selection = self.pending_selection, ()
        return pages

    def adopt_selection(self, selection: Selection | None) -> None:
        """At commit: ``selection`` (made in the reserved pages, or ``None``) replaces the current one, whose
        references the caller drops."""
        self.selection, self.pending_selection = selection, ()

    def restore_selection(self, selection: Selection | None, pages: tuple[int, ...]) -> None:
        """A resume or a load: ``selection`` (an image's, host offsets) comes back in ``pages`` (its pages' new ids,
        in its order; the caller took their references)."""
        assert len(pages) == (len(selection.pages) if selection is not None else 0), "load_branch: selection pages"
        self.selection = selection._replace(pages=pages) if selection is not None else None
        self.pending_selection = ()

    def selection_pages(self) -> tuple[int, ...]:
        return self.selection.pages if self.selection is not None else ()

    def _sink_count(self) -> int:
        """Leading history chunks that are sink chunks (the selection sits after them)."""
        sinks, count = self.policy.sink_chunks, 0
        while count < len(self.history_index) and self.history_index[count] < sinks:
            count += 1
        return count

    def with_selection(self, per_chunk: list, selected: object) -> list:
        """``per_chunk`` (one entry per history chunk, in order) with ``selected`` inserted after the sink chunks
        when there is a selection."""
        if self.selection is None:
            return per_chunk
        at = self._sink_count()
        return [*per_chunk[:at], selected, *per_chunk[at:]]

    def selection_spans(self, exact: bool = False) -> list[tuple[int, int]]:
        """``(first position, tokens)`` of the selection: its candidates' first position for all of it, or with
        ``exact`` one span per run of chosen pages (reads the offsets: a device sync while they are there)."""
        s = self.selection
        if s is None:
            return []
        size = self.page_size
        if not exact:
            return [(s.start, len(s.pages) * size)]
        return [(s.start + first * size, pages * size) for first, pages in page_runs(s.resolved())]

    def _frame_pages(self, frame: int) -> tuple[int, ...]:
        """Pages of absolute frame ``frame``, in the history (trimmed or not) or the pending chunks."""
        policy = selecting(self.policy)
        assert policy is not None
        chunk, k = divmod(frame, policy.frames_per_chunk)
        wanted = range(k * self.pages_per_frame, (k + 1) * self.pages_per_frame)
        if chunk >= self.committed_chunks:
            pages = self.pending[chunk - self.committed_chunks]
            return tuple(pages[o] for o in wanted)
        j = self.history_index.index(chunk)
        kept = self.history_kept[j] if self.history_kept else None
        held = dict(zip(range(len(self.history[j])) if kept is None else kept.offsets, self.history[j]))
        return tuple(held[o] for o in wanted)

    def preview_selection(self) -> SelectionJob | None:
        """What the commit of the pending chunks scores (pure), or ``None`` (the selection is then dropped)."""
        policy = selecting(self.policy)
        if policy is None or not self.pending:
            return None
        index = self.committed_chunks + len(self.pending) - 1
        found = self._candidates(policy, index)
        if found is None:
            return None
        first, boundary = found
        candidates = tuple(p for f in range(first, boundary) for p in self._frame_pages(f))
        assert len(self.pending_selection) == policy.selected_pages(self.pages_per_frame), "selection not reserved"
        start = first * self.pages_per_frame * self.page_size
        return SelectionJob(candidates, self._frame_pages(boundary), self.pending_selection, start, index)
