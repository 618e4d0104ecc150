"""The host tier: suspend a session's K/V to host memory, resume it into fresh device pages.

``KVState.suspend()`` copies the session's committed pages (every branch, every layer, K and V, as raw
bytes: FP8 pages stay FP8, the pool's scales are pool-level and stay), its cross-attention entries and
its kept latents to the host (pinned memory when the pool is on CUDA), then drops its device references:
pages shared with resident sessions (a fork, ``share_sinks_from``) stay resident for them.
``KVState.resume()`` copies them back into fresh device pages and returns a :class:`TransferHandle`::

    resident --suspend()--> suspended --resume()--> resident        (forwards refused while suspended:
        \\                      |                                    SessionSuspendedError; resume() of a
         `---- close() / reset() (a suspended session's host pages are dropped) ----'   resident session:
                                                                                         SessionNotSuspendedError)

The prompt stays the user's to change while the session is away. Every cross-attention call answers on a
suspended session as on a resident one: the session's cross caches are still its ``(name, branch) -> entry``
map, whose entries the suspend swapped for their host copies. ``populate_cross_attention`` /
``clear_cross_attention`` / ``share_cross_attention_from`` / ``reset(keep_cross_attention=...)`` change that map
as usual, and the newer state wins: a resume (or a reset) copies back only the entries that are still the
suspend's host copies; a prompt published while suspended is kept, a cleared one stays cleared.

Both are transactional: everything is copied first, the bookkeeping switched after, so an exception
or a ``KeyboardInterrupt`` during the copy leaves the session fully resident (suspend) or fully
suspended (resume), and refusals (pending work, no device room, a full host budget) change nothing.

Sharing survives the trip (:class:`~ardiff_modules.core.host_pages.HostPages`): a page two suspended
sessions shared is copied to the host once; a resume takes a reference on a live device twin of a host
page (the fork that never left, or a session resumed first) instead of a fresh page. A branch with a
contiguous extent comes back as a ring: a fresh extent, its history chunks re-laid in slot order (those
pages are its own, never shared: a ring must be contiguous).

On CUDA the copies run on a side stream. A suspend makes the current stream wait for its device-to-host
copies before any later kernel may reuse the pages; a resume's handle holds an event that the session's
next ``prepare_forward`` makes the current stream wait on (no host sync). On CPU the handle is complete.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from ardiff_modules.checks import require_int
from ardiff_modules.core.admission import Admission, ExtentRoom
from ardiff_modules.core.allocator import PageAllocator
from ardiff_modules.lanes import CacheLane
from ardiff_modules.core.branch import BranchImage, BranchPages, PageChunk, load_branch, unload_branch
from ardiff_modules.core.host_pages import HostPages
from ardiff_modules.core.reservation import ResumeReservation
from ardiff_modules.cross import CrossEntry, CrossKey
from ardiff_modules.errors import (
    CapacityError, PendingContextError, SessionNotSuspendedError, SessionSuspendedError, SpecError,
)
from ardiff_modules.host.arena import HostArena, Row
from ardiff_modules.host.extent_room import extent_room
from ardiff_modules.host.transfer import TransferHandle
from ardiff_modules.pool import KVPool
from ardiff_modules.session import KVState


@dataclass(frozen=True)
class Suspended:
    """One suspended session: per branch its image and its chunks as host page ids; its host cross entries."""

    images: dict[str, BranchImage]
    chunks: dict[str, tuple[PageChunk, ...]]
    cross: dict[CrossKey, CrossEntry]
    extra_bytes: int

    def host_refs(self) -> list[int]:
        """One entry per host page reference this session holds."""
        return [h for chunks in self.chunks.values() for chunk in chunks for h in chunk]


@dataclass(frozen=True)
class TierReport:
    """Both tiers at a glance (``KVCache.tiers()``)."""

    device_pages_used: int
    device_pages_free: int
    device_bytes_used: int
    host_pages: int
    host_bytes: int
    host_budget_bytes: int | None
    resident: tuple[str, ...]
    suspended: tuple[str, ...]
    #: Host memory the tier's arena holds (pinned on CUDA), used or kept for the next suspend (>= host_bytes' pages).
    host_arena_bytes: int = 0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class HostTier:
    """Suspended sessions' K/V in host memory, keyed by host page id (see the module docstring).

    Parameters
    ----------
    pool, allocator, lock:
        The cache's device pool, its allocator and its lock.
    sessions:
        The cache's open sessions, a live view (their contiguous extents are never aliased).
    budget_bytes:
        The most bytes the host tier holds (``None``: unbounded).
    """

    def __init__(
        self, pool: KVPool, allocator: PageAllocator, lock: threading.RLock,
        sessions: Iterable[KVState], budget_bytes: int | None = None,
    ) -> None:
        self.pool = pool
        self.allocator = allocator
        self.lock = lock
        self._sessions = sessions
        self.pages = HostPages(pool.bytes_per_page, budget_bytes)
        raw = self._raw()
        self._pinned = pool.device.type == "cuda"
        max_rows = None if budget_bytes is None else budget_bytes // pool.bytes_per_page
        #: The page memory: pinned slabs of rows, kept and reused (pinning is slower than copying).
        self.arena = HostArena((*raw.shape[:2], *raw.shape[3:]), self._pinned, (1 << 30) * self._pinned, max_rows)
        #: Host page id -> its row in the arena.
        self._store: dict[int, Row] = {}
        self._suspended: dict[KVState, Suspended] = {}
        self._handles: dict[KVState, TransferHandle] = {}
        self._last_used: dict[KVState, int] = {}
        self._clock = 0
        self._stream: torch.cuda.Stream | None = None

    # ------------------------------------------------------------------ queries
    def is_suspended(self, state: KVState) -> bool:
        return state in self._suspended

    @property
    def num_suspended(self) -> int:
        return len(self._suspended)

    def suspended_ids(self) -> tuple[str, ...]:
        return tuple(s.session_id for s in self._suspended)

    def host_page_tensor(self, host_page: int) -> torch.Tensor:
        """The raw bytes of one held host page, ``[layers, 2, page_size, heads, head_dim * itemsize]`` uint8."""
        return self.arena.row(self._store[host_page])

    def last_used(self, state: KVState) -> int:
        """The tick of the session's last ``prepare_forward`` (0: never)."""
        return self._last_used.get(state, 0)

    def check_resident(self, members: Sequence[tuple[KVState, str]], what: str) -> None:
        """Refuse a forward over a suspended session; otherwise tick the LRU clock and order the current stream
        after a resume's copies (called by every prepare, after the streams were validated)."""
        for state, _ in members:
            if state in self._suspended:
                raise SessionSuspendedError(
                    f"{what}: expected a resident session, got {state.session_id!r} suspended to the host tier "
                    f"(call resume() first)"
                )
        self._clock += 1
        for state, _ in members:
            self._last_used[state] = self._clock
            handle = self._handles.pop(state, None)
            if handle is not None:
                handle.order_current_stream()

    def reserve(self, nbytes: int) -> int:
        """Pin host page memory ahead of time, enough for ``nbytes`` of suspended pages (a server's warm start:
        the first suspends then pay only their copies); returns the arena's bytes. Capped by the host budget."""
        require_int("HostTier.reserve", nbytes, minimum=0)
        with self.lock:
            rows = -(-nbytes // self.pool.bytes_per_page)
            if self.arena.max_rows is not None:
                rows = min(rows, self.arena.max_rows - self.arena.capacity_rows + self.arena.free_rows)
            self.arena.reserve(rows)
            return self.arena.nbytes

    # ------------------------------------------------------------------ suspend
    def suspend(self, state: KVState) -> None:
        """Move ``state`` to the host tier (see the module docstring); refuses, changing nothing, a closed or
        suspended session, one with an open forward or pending chunks, or a host budget too small."""
        with self.lock:
            branches = self.check_idle(state, "suspend")
            alloc, extents = self.allocator, self._extent_pages()
            order = list(dict.fromkeys(p for b in branches.values() for p in b.history_pages()))
            keys = {p: (p, alloc.generation(p)) for p in order}
            reused = {p: h for p in order if (h := self.pages.host_copy_of(keys[p])) is not None}
            new = [p for p in order if p not in reused]
            cross = state._cross_entries()
            distinct = {id(e): e for e in cross.values()}  # an entry shared by two keys travels once
            latents = {name: dict(b.latents) for name, b in branches.items()}
            extra = sum(e.nbytes for e in distinct.values()) + sum(
                _nbytes(t) for kept in latents.values() for t in kept.values() if isinstance(t, torch.Tensor)
            )
            self.pages.check_fits(f"suspend {state.session_id!r}", len(new), extra)
            # Copy first: an exception (or an interrupt) in here leaves the session fully resident.
            rows = self.arena.allocate(len(new))
            try:
                self._copy_pages_to_host(new, rows)
                host_entry = {i: CrossEntry(self._to_host(e.k), self._to_host(e.v), e.version) for i, e in distinct.items()}
                host_cross = {k: host_entry[id(e)] for k, e in cross.items()}
                host_latents = {name: _each_tensor(self._to_host, kept) for name, kept in latents.items()}
                self._after_host_copies()
            except BaseException:
                self.arena.decref(rows)
                raise
            # Then switch the bookkeeping (pure Python, nothing left that can fail on the user's input).
            host_of = dict(reused)
            for row, (h, p) in zip(rows, zip(self.pages.allocate(len(new)), new)):
                self._store[h] = row
                host_of[p] = h
                if p not in extents:  # NOTE: an extent slot is rewritten in place when the ring wraps
                    self.pages.link(h, keys[p])
            occurrences = [host_of[p] for b in branches.values() for p in b.history_pages()]
            self.pages.incref((Counter(occurrences) - Counter(host_of[p] for p in new)).elements())
            chunks = {name: tuple(tuple(host_of[p] for p in c) for c in b.history) for name, b in branches.items()}
            images = {
                name: replace(unload_branch(b, alloc)[0], latents=host_latents[name]) for name, b in branches.items()
            }
            # NOTE: the session keeps its cross map, now over the host copies: a prompt given while it is suspended
            # replaces an entry there and wins at resume (_restore_cross copies back only untouched host copies).
            state._adopt_cross_entries(host_cross)
            self.pages.charge(extra)
            self._suspended[state] = Suspended(images, chunks, host_cross, extra)
            self._handles.pop(state, None)

    def check_idle(self, state: KVState, what: str) -> dict[str, BranchPages]:
        """``state``'s branches if it is open, resident and idle (a suspend's or a save's need); else raises."""
        names = state.kv_branch_names
        branches = {name: state.branch_pages(name) for name in names}  # raises on a closed session
        if state in self._suspended:
            raise SessionSuspendedError(
                f"{what}: expected a resident session, got {state.session_id!r} already suspended "
                f"(resume() first)"
            )
        busy = [name for name in names if state._open_forward(name) is not None or branches[name].pending]
        if busy:
            raise PendingContextError(
                f"{what} {state.session_id!r}: expected no open forward and no pending chunk, got pending work on "
                f"branch(es) {busy} (commit or abort it first)"
            )
        return branches

    def _extent_pages(self) -> set[int]:
        return {p for s in list(self._sessions) for name in s.kv_branch_names for p in s.branch_pages(name).extent}

    # ------------------------------------------------------------------ resume
    def resume(self, state: KVState) -> TransferHandle:
        """Bring ``state`` back into device pages.

        Raises :class:`CapacityError` naming the pages needed and free, changing nothing, when they do not fit;
        :class:`SessionNotSuspendedError` for a session that is not suspended (resident, or resumed already).
        """
        with self.lock:
            record = self._suspended.get(state)
            if record is None:
                state.branch_pages(state.kv_branch_names[0])  # raises on a closed session
                raise SessionNotSuspendedError(
                    f"resume: expected a session suspended to the host tier, got {state.session_id!r} resident "
                    f"(never suspended, or resumed already)"
                )
            branches = {name: state.branch_pages(name) for name in record.images}
            # Pages per ring slot of each branch that comes back as a ring (0: plain paging).
            ring = {n: b.pages_per_chunk if b.extent_chunks is not None and record.chunks[n] else 0
                    for n, b in branches.items()}
            aliases = {h: p for h in set(record.host_refs()) if (p := self._live_twin(h)) is not None}
            plain = [h for name in branches if not ring[name] for c in record.chunks[name] for h in c]
            fresh_hosts = [h for h in dict.fromkeys(plain) if h not in aliases]
            extent_sizes = [b.extent_chunks * ring[n] for n, b in branches.items() if ring[n]]  # type: ignore[operator]
            self._check_device_room(state, len(fresh_hosts), extent_sizes)
            reservation = ResumeReservation(self.allocator, len(fresh_hosts), extent_sizes)
            try:
                fresh = dict(zip(fresh_hosts, reservation.fresh))
                chunks, extents, copies = lay_out(record, ring, aliases, fresh, reservation.extents)
                handle, cross, latents = self._copy_to_device(copies, record, state._cross_entries())
            except BaseException:
                reservation.rollback()
                raise
            # Then switch: one reference per chunk page, less the one each fresh page already has.
            shared = Counter(p for cs in chunks.values() for c in cs for p in c) - Counter(reservation.fresh)
            reservation.keep(shared.elements())
            for name, b in branches.items():
                load_branch(b, replace(record.images[name], latents=latents[name]), chunks[name], extents.get(name, ()))
            for h, q in fresh.items():
                self.pages.link(h, (q, self.allocator.generation(q)))
            self._drop_record(state, record)
            state._adopt_cross_entries(cross)
            self._handles[state] = handle
            return handle

    def _live_twin(self, host_page: int) -> int | None:
        """A device page still holding ``host_page``'s bytes (the same lifetime, in use), if any."""
        key = self.pages.device_copy_of(host_page)
        if key is None:
            return None
        page, generation = key
        alloc = self.allocator
        return page if alloc.refcount(page) > 0 and alloc.generation(page) == generation else None

    def _check_device_room(self, state: KVState, fresh: int, extents: Sequence[int]) -> None:
        needed, free = fresh + sum(extents), self.allocator.num_free
        if needed > free:
            raise CapacityError(
                f"resume {state.session_id!r}: needed {needed} free device pages ({fresh} pages + "
                f"{len(extents)} extent(s) of {extents[0] if extents else 0}), got {free} free of "
                f"{self.allocator.num_pages}",
                needed=needed,
                free=free,
            )

    # ------------------------------------------------------------------ copies (the only torch work)
    def _raw(self) -> torch.Tensor:
        """The pool's K/V as raw bytes ``[layers, 2, pages, page_size, heads, head_dim * itemsize]`` uint8."""
        return self.pool.kv.view(torch.uint8)

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.pool.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.pool.device))  # after kernels writing the pages
        return self._stream

    def _copy_pages_to_host(self, pages: Sequence[int], rows: Sequence[Row]) -> None:
        """Device pages -> their arena rows (on the side stream, asynchronously, when pinned)."""
        if not pages:
            return
        raw = self._raw()
        index = torch.tensor(pages, dtype=torch.long).to(raw.device)
        with _on_stream(self._side_stream() if self._pinned else None):
            # NOTE: index_select over the page dim of a page-major view: one contiguous [n, layers, 2, ...] gather.
            self.arena.copy_in(rows, raw.movedim(2, 0).index_select(0, index))

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of a cross cache or latent tensor (pinned, on the side stream) -- on CPU the tensor itself.

        NOTE: on a CPU pool the "device" already is host memory and these tensors are never rewritten in
        place (a populate publishes a new entry, a commit keeps a new latent), so no copy is needed.
        """
        if not self._pinned or t.device.type != "cuda":
            return t
        with torch.cuda.stream(self._side_stream()):
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            out.copy_(t, non_blocking=True)
        return out

    def _after_host_copies(self) -> None:
        """Order the current stream after the device-to-host copies (the pages are released next: a later
        kernel may rewrite them)."""
        if self._pinned and self._stream is not None:
            torch.cuda.current_stream(self.pool.device).wait_stream(self._stream)

    def _copy_to_device(
        self, copies: Sequence[tuple[int, int]], record: Suspended, cross_now: dict[CrossKey, CrossEntry]
    ) -> tuple[TransferHandle, dict[CrossKey, CrossEntry], dict[str, dict[int, object]]]:
        """Host pages -> their device pages, the cross entries still the suspend's host copies (``cross_now``: the
        session's map today) and the latents back; the handle of the copies."""
        raw = self._raw()
        device = self.pool.device
        stream = self._side_stream() if self._pinned else None
        # Run by run of consecutive arena rows: each run moves in one host-to-device copy, no staging.
        copies = sorted(copies, key=lambda hp: self._store[hp[0]])
        places = [self._store[h] for h, _ in copies]
        with _on_stream(stream):
            for first, count, rows in self.arena.runs(places):
                index = torch.tensor([q for _, q in copies[first : first + count]], dtype=torch.long).to(device)
                raw.index_copy_(2, index, rows.to(device, non_blocking=True).movedim(0, 2))

            def back(t: torch.Tensor) -> torch.Tensor:
                return t.to(device, non_blocking=True)

            cross = _restore_cross(record, cross_now, back)
            latents = {n: _each_tensor(back, img.latents) for n, img in record.images.items()}
        event = None
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
        return TransferHandle(event, (record,)), cross, latents

    # ------------------------------------------------------------------ lifetime and policy
    def _drop_record(self, state: KVState, record: Suspended) -> None:
        self.arena.decref([self._store.pop(h) for h in self.pages.decref(record.host_refs())])
        self.pages.refund(record.extra_bytes)
        del self._suspended[state]

    def forget(self, state: KVState) -> None:
        """``state`` was closed or reset: drop its host pages (a suspended session's K/V is gone); the cross
        entries it still holds as host copies (a reset's ``keep_cross_attention``) come back to the device."""
        with self.lock:
            record = self._suspended.get(state)
            if record is not None:
                device = self.pool.device
                state._adopt_cross_entries(_restore_cross(record, state._cross_entries(), lambda t: t.to(device)))
                self._drop_record(state, record)
            self._handles.pop(state, None)
            self._last_used.pop(state, None)

    def report(self) -> TierReport:
        with self.lock:
            alloc = self.allocator
            resident = tuple(s.session_id for s in list(self._sessions) if s not in self._suspended)
            return TierReport(
                alloc.num_used, alloc.num_free, alloc.num_used * self.pool.bytes_per_page, self.pages.num_pages,
                self.pages.nbytes, self.pages.budget_bytes, resident, self.suspended_ids(), self.arena.nbytes,
            )

    def sessions_that_fit(self, admission: Admission) -> int:
        """How many more suspended sessions at their peak the host budget holds (``KVCache.sessions_that_fit``)."""
        return admission.sessions_that_fit_host(self.pages.free_bytes(), self.pool.bytes_per_page)

    def suspend_idle(
        self, admission: Admission, pending_chunks: int, recache: bool,
        candidates: bool | Iterable[KVState] = True,
    ) -> None:
        """Suspend least recently used idle sessions until one more session fits (``KVCache.admit_session``).

        Idle: resident, no open forward, no pending chunk; LRU by the last ``prepare_forward``. ``candidates``:
        ``True`` for any open session, else only these (sessions of this cache: the server's paused ones --
        NOTE: a session streaming chunk after chunk is idle between two forwards, and the sessions of one
        batched forward share its tick, so only the server can tell "paused" from "between chunks"). The choice is
        planned first (the pages a set frees: those only it references; the host bytes it needs): raises
        :class:`CapacityError`, nothing changed, when suspending every idle session would not make room or
        would not fit the host budget.
        """
        # NOTE: no room from device_counts here: fits() computes it for each choice, from the pages that choice frees.
        free, used, resident = self.allocator.num_free, self.allocator.num_used, len(self._resident())
        what = "admit_session(suspend_idle=True)"

        def fits(freed: set[int], chosen: Sequence[KVState]) -> bool:
            # NOTE: with contiguous extents the freed pages must also leave runs long enough for the new extents.
            room = self.extent_room(admission, freed, chosen)
            n = len(freed)
            return admission.sessions_that_fit(free + n, used - n, resident - len(chosen), room, pending_chunks, recache) >= 1

        with self.lock:
            pool = self._candidates(what, candidates)
            if fits(set(), ()):
                return
            idle = sorted((s for s in pool if self._idle(s)), key=self.last_used)
            for k in range(1, len(idle) + 1):
                chosen = idle[:k]
                branches = [s.branch_pages(n) for s in chosen for n in s.kv_branch_names]
                # NOTE: every reference the chosen sessions hold (a history page inside a contiguous extent is
                # held twice: by the extent and by its chunk); a page is freed when they hold all of its.
                refs = Counter(p for b in branches for p in b.referenced_pages())
                freed = {p for p, n in refs.items() if self.allocator.refcount(p) == n}
                if fits(freed, chosen):
                    history = {p for b in branches for p in b.history_pages()}  # what travels (a ring's free slot stays)
                    self.pages.check_fits(f"{what}: suspending {[s.session_id for s in chosen]}", len(history), 0)
                    for s in chosen:
                        self.suspend(s)
                    return
            raise CapacityError(
                f"{what}: expected idle sessions whose suspension makes room, got {len(idle)} idle session(s) "
                f"{[s.session_id for s in idle]} that do not free enough device pages",
                needed=1,
                free=0,
            )

    def device_counts(self, admission: Admission) -> tuple[int, int, int, ExtentRoom | None]:
        """What device admission decides on: free and used pages, resident sessions (suspended ones are promised
        nothing) and the contiguous room (:meth:`extent_room`)."""
        return self.allocator.num_free, self.allocator.num_used, len(self._resident()), self.extent_room(admission)

    def lane_counts(self, lane: CacheLane) -> tuple[int, int, int, ExtentRoom | None]:
        """:meth:`device_counts` of one lane of a cache with retention groups (its allocator and admission)."""
        if lane.allocator is self.allocator:
            return self.device_counts(lane.admission)
        room = extent_room(lane.allocator, lane.admission, self._resident(), lane=lane.index)
        return lane.allocator.num_free, lane.allocator.num_used, len(self._resident()), room

    def extent_room(
        self, admission: Admission, freed: Iterable[int] = (), leaving: Sequence[KVState] = ()
    ) -> ExtentRoom | None:
        """Contiguous room for admission (``None`` under plain paging): the free runs in extents, less those owed
        to the resident sessions (:func:`~ardiff_modules.host.extent_room.extent_room`); ``freed`` /
        ``leaving``: pages and sessions a suspension would release."""
        return extent_room(self.allocator, admission, [s for s in self._resident() if s not in leaving], freed)

    def _resident(self) -> list[KVState]:
        """The cache's open sessions that are not suspended."""
        return [s for s in list(self._sessions) if s not in self._suspended]

    def _candidates(self, what: str, candidates: bool | Iterable[KVState]) -> list[KVState]:
        """The sessions ``suspend_idle`` may suspend: every open one (``True``) or the given ones, checked."""
        sessions = list(self._sessions)
        if candidates is True:
            return sessions
        if isinstance(candidates, (bool, KVState)) or not isinstance(candidates, Iterable):
            raise SpecError(
                f"{what}: expected True, False or an iterable of this cache's sessions, got {candidates!r}"
            )
        chosen = list(dict.fromkeys(candidates))
        foreign = [s for s in chosen if not isinstance(s, KVState) or s not in sessions]
        if foreign:
            raise SpecError(
                f"{what}: expected open sessions of this KVCache, got {[getattr(s, 'session_id', s) for s in foreign]}"
            )
        return chosen

    def _idle(self, state: KVState) -> bool:
        if state in self._suspended:
            return False
        names = state.kv_branch_names
        return not any(state._open_forward(n) is not None or state.branch_pages(n).pending for n in names)


def _on_stream(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[object]:
    """``torch.cuda.stream(stream)``; no context for ``None`` (a CPU pool, or an unpinned arena)."""
    if stream is None:  # (two returns, not one conditional: older mypy joins the two types to object)
        return contextlib.nullcontext()
    return torch.cuda.stream(stream)


def _each_tensor(move: Callable[[torch.Tensor], torch.Tensor], kept: Mapping[int, object]) -> dict[int, object]:
    """``kept`` (a branch's latents, opaque: tensors or anything else) with its tensors ``move``d, the rest as is."""
    return {i: move(t) if isinstance(t, torch.Tensor) else t for i, t in kept.items()}


def _restore_cross(
    record: Suspended, cross_now: dict[CrossKey, CrossEntry], back: Callable[[torch.Tensor], torch.Tensor]
) -> dict[CrossKey, CrossEntry]:
    """Device copies (``back``) of the entries of ``cross_now`` that are still ``record``'s host copies: the others
    were published while the session was suspended and win (a cleared entry is simply absent)."""
    copied: dict[int, CrossEntry] = {}
    out: dict[CrossKey, CrossEntry] = {}
    for key, entry in cross_now.items():
        if entry is record.cross.get(key):
            if id(entry) not in copied:  # an entry shared by two keys comes back once, still shared
                copied[id(entry)] = CrossEntry(back(entry.k), back(entry.v), entry.version)
            out[key] = copied[id(entry)]
    return out


def lay_out(
    record: Suspended, ring: dict[str, int], aliases: dict[int, int], fresh: dict[int, int], runs: list[list[int]]
) -> tuple[dict[str, tuple[PageChunk, ...]], dict[str, tuple[int, ...]], list[tuple[int, int]]]:
    """Each branch's device chunks, its extent, and the ``(host page, device page)`` copies (by device page).

    A ring branch's chunk takes the first pages of the slot of its fresh extent it had when suspended
    (:func:`ring_slots`; each slot ``ring[name]`` pages); a plain branch takes the aliased (no copy) or the fresh
    page of each host page.
    """
    chunks: dict[str, tuple[PageChunk, ...]] = {}
    extents: dict[str, tuple[int, ...]] = {}
    copies: set[tuple[int, int]] = set()
    run_of = iter(runs)
    for name, host_chunks in record.chunks.items():
        step = ring[name]
        if step:
            run = next(run_of)
            order = ring_slots(record.images[name].slots, len(host_chunks), len(run) // step)
            laid = tuple(tuple(run[i * step : i * step + len(c)]) for i, c in zip(order, host_chunks))
            copies.update(zip((h for c in host_chunks for h in c), (p for c in laid for p in c)))
            chunks[name], extents[name] = laid, tuple(run)
        else:
            device_of = {**aliases, **fresh}
            chunks[name] = tuple(tuple(device_of[h] for h in c) for c in host_chunks)
            copies.update((h, fresh[h]) for c in host_chunks for h in c if h in fresh)
    return chunks, extents, sorted(copies, key=lambda hp: hp[1])


def ring_slots(saved: tuple[int | None, ...], chunks: int, slots: int) -> list[int]:
    """The extent slot of each of ``chunks`` history chunks: the one it had (``saved``, when it names a distinct
    slot for every chunk it places), the lowest free slot for the others (a chunk that sat outside the extent)."""
    if len(saved) != chunks:
        saved = (None,) * chunks
    taken = [s for s in saved if s is not None]
    if len(set(taken)) != len(taken) or any(not 0 <= s < slots for s in taken):
        saved, taken = (None,) * chunks, []
    free = iter(s for s in range(slots) if s not in set(taken))
    return [s if s is not None else next(free) for s in saved]
