"""Admission arithmetic on plain ints: what one session can hold at its peak, what stays promised.

``KVCache.pages_per_session`` / ``recache_reserve`` / ``sessions_that_fit`` / ``can_admit`` /
``admit_session`` are these functions over the live counts (open sessions, pages free and in use).
"""

from __future__ import annotations

from dataclasses import dataclass

from ardiff_modules.checks import require_int
from ardiff_modules.errors import CapacityError, SpecError


@dataclass(frozen=True)
class ExtentRoom:
    """Contiguous room for new extents (contiguous extents only): ``runs``, the extents the free page runs hold
    side by side (``PageAllocator.runs_that_fit``); ``promised``, how many of them open sessions are owed --
    their branches that have not reserved an extent yet (a session reserves them at its first forward)."""

    runs: int
    promised: int


@dataclass(frozen=True)
class Admission:
    """The geometry admission needs: branches per session, the most history chunks a branch holds
    (``None``: unbounded window, no peak), pages per chunk, extent slots (``None``: plain paging), and the
    evicted chunks the cache's re-cache rule rebuilds as context (``RecacheRule.context_chunks``)."""

    branches: int
    max_history_chunks: int | None
    pages_per_chunk: int
    extent_chunks: int | None
    recache_context_chunks: int = 0
    #: The most history pages a branch holds when fewer than its chunks' (a frame policy trims chunks to their
    #: kept frames, ``core/frame_retention.py``); ``None``: ``max_history_chunks x pages_per_chunk``.
    max_history_pages: int | None = None
    #: Pages of a branch's content selection, held besides its chunks (a content-selected lane): on the device a
    #: committing forward also reserves the next one beside it (twice this at the peak); on the host a suspended
    #: branch keeps one (no forward is open).
    selection_pages: int = 0
    #: Pages of one extent slot (``None``: a chunk's; a frame lane's frame slots: a frame's).
    extent_slot_pages: int | None = None

    def _history_pages(self, what: str, selections: int = 2) -> int:
        """A branch's peak history pages: its chunks' (trimmed: their kept pages) and ``selections`` selections."""
        chunks = self._bounded(what) * self.pages_per_chunk
        kept = chunks if self.max_history_pages is None else min(chunks, self.max_history_pages)
        return kept + selections * self.selection_pages

    def _bounded(self, what: str) -> int:
        if self.max_history_chunks is None:
            raise SpecError(f"{what}: expected a bounded window (window_chunks), got None")
        return self.max_history_chunks

    @property
    def extent_pages(self) -> int | None:
        """Pages of one branch's contiguous extent (``None``: plain paging)."""
        slot = self.pages_per_chunk if self.extent_slot_pages is None else self.extent_slot_pages
        return None if self.extent_chunks is None else self.extent_chunks * slot

    def pages_per_session(self, branches: int | None = None, pending_chunks: int = 1) -> int:
        """Peak pages one session holds: per branch its history (trimmed chunks: their kept pages) and pending
        chunks, or its extent."""
        self._bounded("pages_per_session")
        require_int("pages_per_session.pending_chunks", pending_chunks, minimum=1)
        if branches is not None:
            require_int("pages_per_session.branches", branches, minimum=1, below=self.branches + 1)
        branches = self.branches if branches is None else branches
        pages = self._history_pages("pages_per_session") + pending_chunks * self.pages_per_chunk
        extent = self.extent_pages
        if extent is not None:
            pages = max(pages, extent)
        return branches * pages

    def host_pages_per_session(self) -> int:
        """Peak host pages one suspended session holds: per branch its committed history and its content selection
        (no pending chunk nor reserved selection: a session with pending work cannot suspend; an extent comes back
        as a ring, only its chunks travel)."""
        return self.branches * self._history_pages("sessions_that_fit(tier='host')", selections=1)

    def sessions_that_fit_host(self, free_bytes: int | None, bytes_per_page: int) -> int:
        """How many more sessions at their peak the host tier's ``free_bytes`` hold (pages only)."""
        per_session = self.host_pages_per_session()
        if free_bytes is None:
            raise SpecError(
                "sessions_that_fit(tier='host'): expected a bounded host tier (KVCache(host_budget_bytes=...)), "
                "got host_budget_bytes=None (unbounded: every session fits)"
            )
        return max(0, free_bytes // (per_session * bytes_per_page))

    def recache_reserve(self) -> int:
        """Pages admission keeps free, once for the pool, so that one session can re-cache at its peak.

        ``branches x (max_history_chunks + context - 1) x pages_per_chunk``: the most a re-cache of one whole
        session (every branch, sinks included) holds beyond that session's peak. An idle branch holds at
        most ``R = max_history_chunks`` history chunks; the re-cache adds up to ``R`` rebuilt ones (moved
        sinks replace the sinks) and the rule's context chunks,
        less what the peak already counts -- the pending chunk (plain paging), or the ring's free slot
        (contiguous extents, ``R + 1`` slots). So with every open session at its peak, any *one* of them
        can re-cache (:meth:`prepare_recache`'s capacity check passes); several sessions re-caching at the
        same moment may not fit (:class:`CapacityError`, nothing changed: re-cache them one after another).
        Raises :class:`SpecError` for an unbounded window.
        """
        history = self._bounded("recache_reserve")
        return self.branches * max(0, history + self.recache_context_chunks - 1) * self.pages_per_chunk

    def unpromised(self, free: int, used: int, sessions: int, recache: bool) -> int:
        """Free pages not promised to ``sessions`` open sessions' peaks (nor, with ``recache``, to the reserve).

        NOTE: the reserve is counted against the same promise as the peaks (``max`` with the pages in
        use), so a re-cache in flight, whose transient is in use, does not count twice.
        """
        promised = sessions * self.pages_per_session() + (self.recache_reserve() if recache else 0)
        return free - max(0, promised - used)

    def sessions_that_fit(
        self, free: int, used: int, sessions: int, room: ExtentRoom | None, pending_chunks: int, recache: bool
    ) -> int:
        """How many more sessions can run to their peak alongside ``sessions`` open ones; with contiguous
        extents (``room``) also how many sets of ``branches`` extents the free runs hold beyond those owed."""
        per_session = self.pages_per_session(pending_chunks=pending_chunks)
        fit = max(0, self.unpromised(free, used, sessions, recache) // per_session)
        return fit if room is None else min(fit, self.sessions_in_runs(room))

    def sessions_in_runs(self, room: ExtentRoom) -> int:
        """Sessions whose extents (one per branch) the free runs hold after the extents owed to open sessions.

        NOTE: exact for the allocator's placement: every extent has the same size and takes the lowest run
        that fits, which lowers the runs' count by exactly one whichever run it is.
        """
        return max(0, (room.runs - room.promised) // self.branches)

    def check_admit(
        self, free: int, used: int, sessions: int, room: ExtentRoom | None, pending_chunks: int, recache: bool
    ) -> None:
        """Raise :class:`CapacityError` unless one more session fits at its peak (``KVCache.admit_session``)."""
        if self.sessions_that_fit(free, used, sessions, room, pending_chunks, recache) >= 1:
            return
        if room is not None and self.sessions_that_fit(free, used, sessions, None, pending_chunks, recache) >= 1:
            size = self.extent_pages  # a room exists only with contiguous extents
            assert size is not None
            raise CapacityError(
                f"admit_session: a session needs {self.branches} contiguous extent(s) of {size} pages, the free "
                f"runs hold {room.runs}, {room.promised} of them owed to open sessions' branches that have not "
                f"reserved theirs yet (enough pages are free, not in runs that long)",
                needed=self.branches * size,
                free=free,
            )
        needed = self.pages_per_session(pending_chunks=pending_chunks)
        unpromised = max(self.unpromised(free, used, sessions, recache), 0)
        reserve = f" nor to one session's re-cache ({self.recache_reserve()} pages)" if recache else ""
        raise CapacityError(
            f"admit_session: a session needs up to {needed} pages, only {unpromised} are free and not "
            f"promised to the {sessions} open session(s){reserve}",
            needed=needed,
            free=unpromised,
        )
