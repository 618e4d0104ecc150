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

With retention groups (``KVCacheSpec(head_retention=...)``) the cache has one lane per group's head part, each
with its own pages: a suspended session is one record with one image per lane
(:class:`~ardiff_modules.host.lane_store.LaneRecord`), host pages are kept per lane
(:class:`~ardiff_modules.host.lane_store.LaneStore`) under one host byte budget, and a suspend or a resume moves
every lane or none (a resume reserves in every lane, rolled back together on a refusal or a failed copy).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from ardiff_modules.checks import require_int
from ardiff_modules.core.admission import Admission, ExtentRoom
from ardiff_modules.core.allocator import PageAllocator
from ardiff_modules.core.branch import BranchPages, load_branch
from ardiff_modules.core.host_pages import HostPages
from ardiff_modules.core.reservation import ResumeReservation
from ardiff_modules.core.transaction import deferred_interrupts
from ardiff_modules.cross import CrossEntry, CrossKey
from ardiff_modules.errors import CapacityError, PendingContextError, SessionNotSuspendedError, SessionSuspendedError
from ardiff_modules.host import make_room
from ardiff_modules.host.arena import HostArena, Row
from ardiff_modules.host.extent_room import extent_room
from ardiff_modules.host.lane_store import Laid, LaneRecord, LaneStore, OutPlan, check_host_fits, lay_out
from ardiff_modules.host.transfer import TransferHandle
from ardiff_modules.lanes import CacheLane
from ardiff_modules.pool import KVPool
from ardiff_modules.session import KVState


@dataclass(frozen=True)
class Suspended:
    """One suspended session: one :class:`LaneRecord` per lane of the cache; its host cross entries."""

    lanes: tuple[LaneRecord, ...]
    cross: dict[CrossKey, CrossEntry]
    extra_bytes: int


@dataclass(frozen=True)
class TierReport:
    """Both tiers at a glance (``KVCache.tiers()``); with retention groups, summed over the lanes."""

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
    lanes, lock:
        The cache's lanes (``ardiff_modules.lanes.CacheLane``: device pool, allocator, admission each; one for a
        uniform cache) and its lock.
    sessions:
        The cache's open sessions, a live view (their contiguous extents are never aliased).
    budget_bytes:
        The most bytes the host tier holds, every lane together (``None``: unbounded).
    """

    def __init__(
        self, lanes: Sequence[CacheLane], lock: threading.RLock, sessions: Iterable[KVState],
        budget_bytes: int | None = None,
    ) -> None:
        self.lanes = tuple(lanes)
        self.lock = lock
        self._sessions = sessions
        self._pinned = self.lanes[0].pool.device.type == "cuda"
        # NOTE: the arena grows a slab of at least 1 GiB when pinned (pinning is slow); split between the lanes.
        slab = (1 << 30) * self._pinned // len(self.lanes)
        #: Each lane's host pages (the first lane's ``pages`` hold the one budget and the extra bytes).
        self.stores = tuple(LaneStore(lane, budget_bytes, i == 0, slab) for i, lane in enumerate(self.lanes))
        self._suspended: dict[KVState, Suspended] = {}
        self._handles: dict[KVState, TransferHandle] = {}
        self._last_used: dict[KVState, int] = {}
        self._clock = 0
        self._stream: torch.cuda.Stream | None = None

    # The first lane's (a uniform cache's only) parts, named as before lanes.
    @property
    def pool(self) -> KVPool:
        return self.stores[0].pool

    @property
    def allocator(self) -> PageAllocator:
        return self.stores[0].allocator

    @property
    def pages(self) -> HostPages:
        return self.stores[0].pages

    @property
    def arena(self) -> HostArena:
        return self.stores[0].arena

    # ------------------------------------------------------------------ queries
    def is_suspended(self, state: KVState) -> bool:
        return state in self._suspended

    @property
    def num_suspended(self) -> int:
        return len(self._suspended)

    def suspended_ids(self) -> tuple[str, ...]:
        return tuple(s.session_id for s in self._suspended)

    def host_page_tensor(self, host_page: int, lane: int = 0) -> torch.Tensor:
        """The raw bytes of one held host page of ``lane``, ``[layers, 2, page_size, heads, head_dim * itemsize]``
        uint8."""
        store = self.stores[lane]
        return store.arena.row(store.store[host_page])

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
        the first suspends then pay only their copies); returns the arena's bytes (every lane's). Capped by the
        host budget; with retention groups both are split between the lanes by one session's host pages there."""
        require_int("HostTier.reserve", nbytes, minimum=0)
        with self.lock:
            budget = self.pages.budget_bytes
            weights = [1] if len(self.stores) == 1 else [
                s.lane.admission.host_pages_per_session() * s.pool.bytes_per_page for s in self.stores
            ]
            for store, weight in zip(self.stores, weights):
                bpp = store.pool.bytes_per_page
                share = nbytes * weight // sum(weights)
                cap = None if budget is None else budget * weight // sum(weights) // bpp
                store.reserve_rows(-(-share // bpp), cap)
            return self._arena_bytes()

    def _arena_bytes(self) -> int:
        return sum(s.arena.nbytes for s in self.stores)

    # ------------------------------------------------------------------ suspend
    def suspend(self, state: KVState) -> None:
        """Move ``state`` to the host tier (see the module docstring); refuses, changing nothing, a closed or
        suspended session, one with an open forward or pending chunks, or a host budget too small."""
        with self.lock:
            self.check_idle(state, "suspend")
            lanes = [store.branches_of(state) for store in self.stores]
            plans = [store.plan_out(branches, self._sessions) for store, branches in zip(self.stores, lanes)]
            cross = state._cross_entries()
            distinct = {id(e): e for e in cross.values()}  # an entry shared by two keys travels once
            latents = [{name: dict(b.latents) for name, b in branches.items()} for branches in lanes]
            kept = {id(t): t for lane in latents for k in lane.values() for t in k.values() if isinstance(t, torch.Tensor)}
            extra = sum(e.nbytes for e in distinct.values()) + sum(_nbytes(t) for t in kept.values())
            check_host_fits(f"suspend {state.session_id!r}", self.stores, [len(p.new) for p in plans], extra)
            # Copy first: an exception (or an interrupt) in here leaves the session fully resident.
            rows: list[list[Row]] = []
            try:
                for store, plan in zip(self.stores, plans):
                    rows.append(store.take_rows(len(plan.new)))
                self._copy_pages_to_host(plans, rows)
                host_entry = {i: CrossEntry(self._to_host(e.k), self._to_host(e.v), e.version) for i, e in distinct.items()}
                host_cross = {k: host_entry[id(e)] for k, e in cross.items()}
                to_host = _memo(self._to_host)  # a latent kept by several lanes travels once
                host_latents = [{n: _each_tensor(to_host, k) for n, k in lane.items()} for lane in latents]
                self._after_host_copies()
            except BaseException:
                for store, taken in zip(self.stores, rows):
                    store.give_rows(taken)
                raise
            # Then switch the bookkeeping (pure Python, nothing left that can fail on the user's input).
            with deferred_interrupts():
                records = tuple(
                    store.keep_out(plan, taken, branches, lane_latents)
                    for store, plan, taken, branches, lane_latents in zip(self.stores, plans, rows, lanes, host_latents)
                )
                # NOTE: the session keeps its cross map, now over the host copies: a prompt given while it is
                # suspended replaces an entry there and wins at resume (_restore_cross copies back only untouched
                # host copies).
                state._adopt_cross_entries(host_cross)
                self.pages.charge(extra)
                self._suspended[state] = Suspended(records, host_cross, extra)
                self._handles.pop(state, None)

    def check_idle(self, state: KVState, what: str) -> dict[str, BranchPages]:
        """``state``'s branches (the first lane's) if it is open, resident and idle (a suspend's or a save's
        need); else raises."""
        names = state.kv_branch_names
        branches = {name: state.branch_pages(name) for name in names}  # raises on a closed session
        if state in self._suspended:
            raise SessionSuspendedError(
                f"{what}: expected a resident session, got {state.session_id!r} already suspended "
                f"(resume() first)"
            )
        busy = [
            name for name in names
            if state._open_forward(name) is not None or any(b.pending for b in state._lane_pages(name))
        ]
        if busy:
            raise PendingContextError(
                f"{what} {state.session_id!r}: expected no open forward and no pending chunk, got pending work on "
                f"branch(es) {busy} (commit or abort it first)"
            )
        return branches

    # ------------------------------------------------------------------ resume
    def resume(self, state: KVState) -> TransferHandle:
        """Bring ``state`` back into device pages, in every lane or none.

        Raises :class:`CapacityError` naming the pages needed and free (and, with retention groups, the lane),
        changing nothing, when they do not fit; :class:`SessionNotSuspendedError` for a session that is not
        suspended (resident, or resumed already).
        """
        with self.lock:
            record = self._suspended.get(state)
            if record is None:
                state.branch_pages(state.kv_branch_names[0])  # raises on a closed session
                raise SessionNotSuspendedError(
                    f"resume: expected a session suspended to the host tier, got {state.session_id!r} resident "
                    f"(never suspended, or resumed already)"
                )
            lanes = [{n: store.branches_of(state)[n] for n in r.images} for store, r in zip(self.stores, record.lanes)]
            plans = [store.plan_in(r, b) for store, r, b in zip(self.stores, record.lanes, lanes)]
            for store, plan in zip(self.stores, plans):  # every lane checked before any page is taken
                store.check_room(f"resume {state.session_id!r}", plan, store.lane.part is not None)
            reservations: list[ResumeReservation] = []
            try:
                for store, plan in zip(self.stores, plans):
                    reservations.append(ResumeReservation(store.allocator, len(plan.fresh_hosts), plan.extent_sizes))
                fresh = [dict(zip(p.fresh_hosts, r.fresh)) for p, r in zip(plans, reservations)]
                laid = [lay_out(rec, p.ring, p.aliases, f, r.extents)
                        for rec, p, f, r in zip(record.lanes, plans, fresh, reservations)]
                copies = [lane_laid.copies for lane_laid in laid]
                handle, cross, latents = self._copy_to_device(copies, record, state._cross_entries())
            except BaseException:
                for reservation in reversed(reservations):
                    reservation.rollback()
                raise
            with deferred_interrupts():
                for i, (store, reservation) in enumerate(zip(self.stores, reservations)):
                    self._load_lane(store, lanes[i], record.lanes[i], laid[i], latents[i], reservation, fresh[i])
                self._drop_record(state, record)
                state._adopt_cross_entries(cross)
                self._handles[state] = handle
            return handle

    @staticmethod
    def _load_lane(
        store: LaneStore, branches: Mapping[str, BranchPages], record: LaneRecord, laid: Laid,
        latents: Mapping[str, Mapping[int, object]], reservation: ResumeReservation, fresh: Mapping[int, int],
    ) -> None:
        """Switch one lane of a resume: one reference per chunk (and selection) page, less the one each fresh page
        already has; the branches loaded; the fresh pages linked to their host pages."""
        shared = Counter(laid.held()) - Counter(reservation.fresh)
        reservation.keep(shared.elements())
        for name, b in branches.items():
            image = record.images[name]
            load_branch(b, replace(image, latents=latents[name]), laid.chunks[name], laid.extents.get(name, ()),
                        laid.selections.get(name, ()))
        store.keep_in(fresh)

    # ------------------------------------------------------------------ copies (the only torch work)
    def _side_stream(self) -> torch.cuda.Stream:
        device = self.pool.device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        self._stream.wait_stream(torch.cuda.current_stream(device))  # after kernels writing the pages
        return self._stream

    def _copy_pages_to_host(self, plans: Sequence[OutPlan], rows: Sequence[Sequence[Row]]) -> None:
        """Each lane's new pages -> their arena rows (on the side stream, asynchronously, when pinned)."""
        if not any(p.new for p in plans):
            return
        with _on_stream(self._side_stream() if self._pinned else None):
            for store, plan, taken in zip(self.stores, plans, rows):
                store.copy_out(plan.new, taken)

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
        self, copies: Sequence[Sequence[tuple[int, int]]], record: Suspended, cross_now: dict[CrossKey, CrossEntry]
    ) -> tuple[TransferHandle, dict[CrossKey, CrossEntry], list[dict[str, dict[int, object]]]]:
        """Each lane's host pages -> their device pages (``copies``: per lane), the cross entries still the
        suspend's host copies (``cross_now``: the session's map today) and the latents back (per lane); the
        handle of the copies."""
        device = self.pool.device
        stream = self._side_stream() if self._pinned else None
        with _on_stream(stream):
            for store, lane_copies in zip(self.stores, copies):
                store.copy_in(lane_copies)
            back = _memo(lambda t: t.to(device, non_blocking=True))  # a latent kept by several lanes comes back once
            cross = _restore_cross(record, cross_now, back)
            latents = [{n: _each_tensor(back, img.latents) for n, img in r.images.items()} for r in record.lanes]
        event = None
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
        return TransferHandle(event, (record,)), cross, latents

    # ------------------------------------------------------------------ lifetime and policy
    def _drop_record(self, state: KVState, record: Suspended) -> None:
        for store, lane in zip(self.stores, record.lanes):
            store.drop(lane)
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
            allocators = [s.allocator for s in self.stores]
            resident = tuple(s.session_id for s in list(self._sessions) if s not in self._suspended)
            return TierReport(
                sum(a.num_used for a in allocators), sum(a.num_free for a in allocators),
                sum(s.allocator.num_used * s.pool.bytes_per_page for s in self.stores),
                sum(s.pages.num_pages for s in self.stores), sum(s.pages.nbytes for s in self.stores),
                self.pages.budget_bytes, resident, self.suspended_ids(), self._arena_bytes(),
            )

    def sessions_that_fit(self) -> int:
        """How many more suspended sessions at their peak the host budget holds (``KVCache.sessions_that_fit``):
        with retention groups, a session's peak host pages in every lane together."""
        first = self.stores[0]
        free = self.pages.free_bytes()
        if free is None or len(self.stores) == 1:
            return first.lane.admission.sessions_that_fit_host(free, first.pool.bytes_per_page)
        free -= sum(s.pages.nbytes for s in self.stores[1:])
        per_session = sum(s.lane.admission.host_pages_per_session() * s.pool.bytes_per_page for s in self.stores)
        return max(0, free // per_session)

    def suspend_idle(self, pending_chunks: int, recache: bool, candidates: bool | Iterable[KVState] = True) -> None:
        """Suspend least recently used idle sessions until one more session fits (``KVCache.admit_session``).

        Idle: resident, no open forward, no pending chunk; LRU by the last ``prepare_forward``. ``candidates``:
        ``True`` for any open session, else only these (sessions of this cache: the server's paused ones --
        NOTE: a session streaming chunk after chunk is idle between two forwards, and the sessions of one
        batched forward share its tick, so only the server can tell "paused" from "between chunks"). The choice is
        planned first (:func:`~ardiff_modules.host.make_room.choose`: the pages a set frees in every lane, the
        host bytes it needs): raises :class:`CapacityError`, nothing changed, when suspending every idle session
        would not make room or would not fit the host budget.
        """
        what = "admit_session(suspend_idle=True)"
        with self.lock:
            pool = make_room.candidates(what, self._sessions, candidates)
            idle = sorted((s for s in pool if make_room.is_idle(s, self._suspended)), key=self.last_used)
            chosen = make_room.choose(self.lanes, self._resident(), idle, pending_chunks, recache)
            if chosen is None:
                raise CapacityError(
                    f"{what}: expected idle sessions whose suspension makes room, got {len(idle)} idle session(s) "
                    f"{[s.session_id for s in idle]} that do not free enough device pages",
                    needed=1,
                    free=0,
                )
            if chosen:
                ids = [s.session_id for s in chosen]
                check_host_fits(f"{what}: suspending {ids}", self.stores, make_room.history_pages(self.lanes, chosen), 0)
                for s in chosen:
                    self.suspend(s)

    def device_counts(self, admission: Admission) -> tuple[int, int, int, ExtentRoom | None]:
        """:meth:`lane_counts` of the first lane (a uniform cache's only) under ``admission``."""
        return self.lane_counts(dataclasses.replace(self.lanes[0], admission=admission))

    def lane_counts(self, lane: CacheLane) -> tuple[int, int, int, ExtentRoom | None]:
        """What device admission decides on in ``lane``: its free and used pages, the resident sessions (suspended
        ones are promised nothing) and its contiguous room (:func:`~ardiff_modules.host.extent_room.extent_room`)."""
        room = extent_room(lane.allocator, lane.admission, self._resident(), lane=lane.index)
        return lane.allocator.num_free, lane.allocator.num_used, len(self._resident()), room

    def _resident(self) -> list[KVState]:
        """The cache's open sessions that are not suspended."""
        return [s for s in list(self._sessions) if s not in self._suspended]


def _on_stream(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[object]:
    """``torch.cuda.stream(stream)``; no context for ``None`` (a CPU pool, or an unpinned arena)."""
    if stream is None:  # (two returns, not one conditional: older mypy joins the two types to object)
        return contextlib.nullcontext()
    return torch.cuda.stream(stream)


def _memo(move: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``move``, once per tensor object (a tensor several lanes keep is moved once and stays shared)."""
    done: dict[int, torch.Tensor] = {}

    def once(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in done:
            done[id(t)] = move(t)
        return done[id(t)]

    return once


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
