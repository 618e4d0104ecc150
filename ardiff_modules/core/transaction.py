"""One forward's transaction: its member streams, from prepare to commit or abort.

A :class:`ForwardTransaction` is created by ``KVCache.prepare_forward`` once the
pages are reserved and the plan is built, and is *open* until it finishes:

    prepare ──> open ──┬── commit   (all streams: pending -> history, eviction; a denoising
                       │             forward just completes, its pending pages kept for reuse;
                       │             a re-cache swaps its rebuilt chunks in for the resident ones,
                       │             copying those in fresh pages into free ring slots)
                       ├── abort    (all streams: pending dropped, history as before)
                       └── supersede (a denoising forward replaced by the next forward
                                      of one of its streams: pending kept for reuse)

``reset()`` / ``close()`` of a member session abort it; a released context (LRU,
``KVCache.close``) cannot be open. Only while it is open may the forward's layer
contexts touch the pool: the custom op, and ``CUDAGraphStep`` before a replay,
check :attr:`ForwardTransaction.is_open` and raise
:class:`~ardiff_modules.errors.ForwardFinishedError` otherwise.

NOTE: all streams of a forward finish together. Committing one branch of a batched
CFG forward (``KVState.commit_paged_context(branch)``) commits every stream of
that forward, atomically: the new histories are computed first (pure, may raise),
then applied with one allocator call and plain assignments, with SIGINT deferred
(see :func:`deferred_interrupts`) so a Ctrl-C cannot split them.
"""

from __future__ import annotations

import signal
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from ardiff_modules.errors import ForwardFinishedError, IncompleteForwardError

from ardiff_modules.core.allocator import PageAllocator
from ardiff_modules.core.recache import RecachePlan
from ardiff_modules.core.branch import BranchPages, PageChunk
from ardiff_modules.core.branch_selection import Selection, SelectionJob
from ardiff_modules.core.reservation import Reservation

class Coordinator:
    """The multi-participant forward that alone commits its participants' transactions (``core.two_phase``).

    NOTE: here, not in ``two_phase``: a transaction names its coordinator, and ``two_phase`` drives transactions.

    ``name`` names it in :class:`ParticipantCommitError` (e.g. ``"the DistributedForward over [s0/cond]"``).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        # NOTE: the thread inside commit_all, not a flag: another thread committing a participant alone
        # meanwhile is still refused.
        self._finisher: int | None = None

    def __repr__(self) -> str:
        return f"Coordinator({self.name!r})"

    @contextmanager
    def finishing(self) -> Iterator[None]:
        """Inside the block, this thread may commit the participants (what :func:`commit_all` does)."""
        outer, self._finisher = self._finisher, threading.get_ident()
        try:
            yield
        finally:
            self._finisher = outer

    def may_commit(self) -> bool:
        return self._finisher == threading.get_ident()


#: ``completed``: a denoising forward that finished (nothing joins history; "committed" is
#: reserved for forwards whose chunks did).
Status = Literal["open", "committed", "completed", "aborted", "superseded"]


@dataclass(eq=False)
class ForwardTransaction:
    """The forward last prepared over ``members`` (``(session, branch)`` pairs), until it finishes.

    Attributes
    ----------
    members:
        ``(session, branch)`` of each stream, in batch order.
    commit_current:
        Whether a successful finish turns the pending chunks into history.
    num_chunks:
        Pending chunks per stream.
    status:
        ``"open"`` until the forward finishes; then how it finished.
    """

    members: tuple[tuple[Any, str], ...]
    commit_current: bool
    num_chunks: int
    status: Status = "open"
    #: A prompt-switch re-cache (``KVCache.prepare_recache``): its pending chunks (free ring slots, then
    #: fresh pages) rebuild history chunks, swapped in on commit (each lane's ``recache_plans``).
    recache: bool = False
    #: Per member (batch order): clean latents of each pending chunk to keep on commit, or ``()``.
    latents: tuple[tuple[object, ...], ...] = field(default=(), repr=False)
    #: Why the forward finished, for error messages.
    reason: str = ""
    #: Every lane's share of the forward (its allocator, each member's branch pages, its reservation): a lane
    #: is the storage of one retention group (``docs/design.md``); a uniform cache has one. The forward
    #: commits, aborts and is superseded in every lane at once.
    lanes: tuple[TransactionLane, ...] = field(default=(), repr=False)
    #: Layers whose K/V this forward wrote into its pending pages (the custom ops record each write;
    #: a CUDA-graph replay records what its capture wrote). A commit needs every layer.
    written: set[int] = field(default_factory=set, repr=False)
    #: Called with this transaction once it finishes, whatever the outcome (e.g. the FP8 calibration
    #: that this forward's writes started is fixed by its commit and undone by anything else).
    on_close: list[Callable[[ForwardTransaction], None]] = field(default_factory=list, repr=False)
    #: The multi-participant forward this is one participant of (a part of a grouped forward, a rank's share
    #: of a distributed one): only it commits this transaction (``core.two_phase.require_coordinated``).
    coordinator: Coordinator | None = field(default=None, repr=False)
    #: Content-selected lanes: at commit, per lane per member (``lane.branches`` order) a
    #: :class:`~ardiff_modules.core.branch_selection.SelectionJob` or ``None`` -> the chosen offsets of each job
    #: (the device scores and copies: ``ardiff_modules.selection``); ``None``: no lane selects.
    select: Callable[[list[list[SelectionJob | None]]], list[list[Any]]] | None = field(default=None, repr=False)

    @property
    def branches(self) -> tuple[BranchPages, ...]:
        """Each member's branch pages in the first lane (every lane's keep the same offsets and commit counts)."""
        return self.lanes[0].branches if self.lanes else ()

    @property
    def reservation(self) -> Reservation | None:
        """A lane's page reservation while the forward may still be undone exactly (a distributed forward holds
        it until every rank voted); ``None`` once kept. An abort then rolls every lane back instead of dropping."""
        return next((lane.reservation for lane in self.lanes if lane.reservation is not None), None)

    def attach(self) -> None:
        """The forward begins: its branches (in every lane) belong to it (until it finishes)."""
        for lane in self.lanes:
            for b in lane.branches:
                b.attach(self)

    def keep_reservation(self) -> None:
        """The forward stands (a distributed forward's prepare vote passed): release what it replaced, every lane."""
        for lane in self.lanes:
            if lane.reservation is not None:
                lane.reservation.keep()
                lane.reservation = None

    def join(self, coordinator: Coordinator) -> None:
        """This forward is one participant of ``coordinator``'s: only it may commit this one from now on."""
        self.coordinator = coordinator

    @property
    def is_open(self) -> bool:
        return self.status == "open"

    def check_open(self, what: str) -> None:
        """Raise :class:`ForwardFinishedError` unless this forward is open."""
        if self.status != "open":
            raise ForwardFinishedError(
                f"{what}: expected an open forward, got one that was {self.status}"
                f"{' (' + self.reason + ')' if self.reason else ''}; its contexts may no longer read or write "
                "the KV pool. Call prepare_forward()/get_kv_caches() again for the next forward"
            )

    def mark_written(self, layers: Iterable[int]) -> None:
        """Record that this forward wrote the K/V of ``layers`` (host ints; once per layer call, no sync)."""
        self.written.update(layers)

    @contextmanager
    def recording_writes(self) -> Iterator[set[int]]:
        """Collect, in the yielded set, the layers "written" inside the block without counting them for this
        forward: a CUDA-graph capture runs the layers' Python but launches nothing; each replay marks them."""
        outer, self.written = self.written, set()
        try:
            yield self.written
        finally:
            self.written = outer

    def check_complete(self, num_layers: int) -> None:
        """Raise :class:`IncompleteForwardError` unless every layer ``0..num_layers-1`` wrote its K/V.

        A committing forward publishes its pending pages in every layer: a layer that never ran would
        publish whatever those pages held before (another, maybe closed, session's K/V).
        """
        missing = [layer for layer in range(num_layers) if layer not in self.written]
        if missing:
            raise IncompleteForwardError(
                f"commit: expected K/V written by all {num_layers} layers of the forward, got {num_layers - len(missing)}"
                f" (no write from layer(s) {_ranges(missing)}); a forward commits only when every attention layer"
                " ran. The forward was aborted and history is unchanged"
            )

    def live_branches(self, lane: int = 0) -> list[BranchPages]:
        """The member branches of ``lane`` this forward still holds (a closed member session let go of its own)."""
        return self.lanes[lane].live(self) if self.lanes else []

    def close(self, status: Status, reason: str = "") -> None:
        """Mark finished and detach from the branches (their pending pages stay as they are)."""
        self.keep_reservation()  # a held forward superseded (or closed) before its vote: release what it replaced
        for lane in self.lanes:
            for h in lane.branches:
                h.detach(self)
        self.status = status
        self.reason = reason
        listeners, self.on_close = self.on_close, []
        for listener in listeners:
            listener(self)

    def commit(self) -> None:
        """Finish successfully: a committing forward's pending chunks join history on every stream, in every lane.

        Every stream's commit in every lane is computed first (pure: may raise, nothing changed), then applied
        with one allocator call per lane and plain assignments while SIGINT is held: all streams and lanes or none.
        """
        if not self.is_open:
            return
        self.keep_reservation()  # (a held reservation: the forward stands)
        if not self.commit_current:
            self.close("completed")  # a denoising forward: pending pages stay for the next one
            return
        if self.recache:
            self._commit_recache()
            return
        lives = [lane.live(self) for lane in self.lanes]
        previews = [[h.preview_commit() for h in live] for live in lives]
        # Content-selected lanes (core/branch_selection.py): what each commit scores, per lane per member (None:
        # nothing -- not live, or no selection at this commit; the old one is dropped all the same).
        # A selection held in a frame extent by its branch alone is overwritten in place (its reserved pages go
        # instead: ``BranchFrameExtent.selection_job``), decided here: a fork may have been made since the prepare.
        jobs = [[h.selection_job(lane.allocator) if h in live else None for h in lane.branches]
                for lane, live in zip(self.lanes, lives)] if self.select is not None else []
        with deferred_interrupts():
            # NOTE: the device chooses and copies first: if it raises, no bookkeeping changed (the forward aborts).
            # A selection re-chosen in place is overwritten by that copy, so the bookkeeping below must not fail
            # after it (it is allocator refcounts and assignments: only a broken invariant raises there); if it did,
            # an abort would leave the old selection's metadata over the new K/V (the session machine finishes
            # such a forward with a commit: tests/support/session_machine/forwards.py, interrupted_finish).
            chosen = self.select(jobs) if self.select is not None and any(j for js in jobs for j in js) else None
            for n, (lane, live, results) in enumerate(zip(self.lanes, lives, previews)):
                evicted = [page for result in results for chunk in result.evicted for page in chunk]
                # (a content-selected lane: the replaced selections go too; no work for the others)
                selections = _selections(lane.branches, jobs[n], chosen[n] if chosen else None) if jobs else None
                if selections is not None:
                    made = dict(zip(map(id, lane.branches), jobs[n]))
                    evicted += [p for h in live for p in h.replaced_selection(made.get(id(h)))]
                lane.allocator.decref(evicted)
                kept = {id(h): latents for h, latents in zip(lane.branches, self.latents)}
                for h, result in zip(live, results):
                    latents = kept.get(id(h))
                    if latents:
                        h.apply_commit(result, latents)
                    else:
                        h.apply_commit(result)
                    if selections is not None:
                        h.adopt_selection(selections.get(id(h)))
            self.close("committed")

    def _commit_recache(self) -> None:
        """Swap every stream's rebuilt chunks in for the old ones in every lane, all at once (offsets, indices
        unchanged; :meth:`TransactionLane.recache_swap`). Every lane's swap is computed first (pure), then each
        lane's device copy runs and then every lane's bookkeeping, while SIGINT is held."""
        lives = [lane.live(self) for lane in self.lanes]
        swaps = [lane.recache_swap(live) for lane, live in zip(self.lanes, lives)]
        with deferred_interrupts():
            # NOTE: the copies come first: if one raises, no bookkeeping changed and the cache aborts the
            # forward -- but runs copied before the failure (a device error) may have overwritten old ring slots.
            for lane, swap in zip(self.lanes, swaps):
                lane.copy(swap)
            for lane, live, swap in zip(self.lanes, lives, swaps):
                lane.apply_recache_swap(live, swap)
            self.close("committed")

    def abort(self, reason: str = "") -> None:
        """Drop every stream's pending chunks in every lane, all at once; history stays exactly as before."""
        if not self.is_open:
            return
        lives = [lane.live(self) for lane in self.lanes]
        for lane, live in zip(self.lanes, lives):
            if lane.reservation is not None and (len(live) < len(lane.branches) or not lane.reservation.can_roll_back()):
                # The pool changed since the prepare (another forward ran), or a member let go of its branch: the
                # recorded undo is no longer exact. Release what it replaced and drop the pending chunks instead.
                lane.reservation.keep()
                lane.reservation = None
        with deferred_interrupts():
            for lane, live in zip(self.lanes, lives):
                lane.drop(live, self.recache)
            self.close("aborted", reason)


@dataclass(eq=False)
class RecacheSwap:
    """One lane's re-cache commit, computed before anything changes (:meth:`TransactionLane.recache_swap`)."""

    #: Per live branch: the history after the swap (and the ring moves), and the starts of its chunks.
    resident: list[tuple[PageChunk, ...]]
    starts: list[tuple[int, ...]]
    #: Device copies ``src[i] -> dst[i]`` (rebuilt chunks in fresh pages into free ring slots).
    src: list[int]
    dst: list[int]
    #: References dropped (old chunks, context chunks' ring slots) and fresh pages given back, in allocation order.
    released: list[int]
    fresh_order: list[int]


@dataclass(eq=False)
class TransactionLane:
    """One lane's share of a forward: the allocator of its pages, each member's branch pages (batch order), its
    reservation while undoable, and for a re-cache each member's plan and the device copy of the lane's pool.

    ``copy_pages(src, dst)``: page ``src[i]`` -> ``dst[i]`` in every layer, K and V (``KVPool.copy_pages``);
    ``None``: rebuilt chunks are only swapped in, never copied into the ring.
    """

    allocator: PageAllocator
    branches: tuple[BranchPages, ...]
    reservation: Reservation | None = None
    recache_plans: tuple[RecachePlan, ...] = ()
    copy_pages: Callable[[Sequence[int], Sequence[int]], None] | None = None

    def live(self, transaction: object) -> list[BranchPages]:
        """The branches ``transaction`` still holds (a closed member session let go of its own)."""
        return [b for b in self.branches if b.transaction is transaction]

    def recache_swap(self, live: list[BranchPages]) -> RecacheSwap:
        """This lane's re-cache commit (pure: may raise, nothing changed).

        The old pages lose this branch's reference only: a fork sharing them keeps the old history. With
        contiguous extents, a rebuilt chunk in fresh pages is then copied into a ring slot that the commit
        leaves free -- the slot of the chunk it replaces when no fork shares that one
        (:meth:`BranchPages.recache_copies`) -- and its fresh pages are freed: pool use is back at the steady
        state at commit and the ring stays whole (one-chunk forwards keep their one contiguous key range).
        References dropped are counted over every stream at once: two streams of this forward sharing old
        pages (a fork re-cached with its parent) both let go.
        """
        plans = {id(h): plan for h, plan in zip(self.branches, self.recache_plans)}
        swaps = [h.preview_recache_commit(plans[id(h)]) for h in live]
        # Context chunks are dropped: ring slots lose the reference the re-cache added, fresh pages are returned.
        ring = {p for h in live for p in h.split_pending()[0]}
        dropped = [p for _, _, _, chunks in swaps for chunk in chunks for p in chunk]
        released = Counter(page for _, _, old, _ in swaps for page in old)
        released.update(p for p in dropped if p in ring)  # a context chunk's ring slot is free after the commit
        moves = (
            [h.recache_copies(resident, released, self.allocator) for h, (resident, *_) in zip(live, swaps)]
            if self.copy_pages is not None else [(resident, []) for resident, *_ in swaps]
        )
        src = [p for _, copies in moves for fresh, _ in copies for p in fresh]
        dst = [p for _, copies in moves for _, slot in copies for p in slot]
        returned = set(src) | {p for p in dropped if p not in ring}
        # NOTE: unallocate, not decref: the fresh pages go back to the front of the free list in their
        # allocation order, so a fully copied re-cache leaves the free list as it found it.
        fresh_order = [p for h in live for p in h.split_pending()[1] if p in returned]
        return RecacheSwap(
            [resident for resident, _ in moves], [starts for _, starts, _, _ in swaps], src, dst,
            [page for _, _, old, _ in swaps for page in old] + [p for p in dropped if p in ring], fresh_order,
        )

    def copy(self, swap: RecacheSwap) -> None:
        """The swap's device copies (one call; enqueued on the current stream before any later forward's writes,
        so the freed fresh pages are not overwritten before it read them)."""
        if swap.src:
            assert self.copy_pages is not None
            self.copy_pages(swap.src, swap.dst)

    def apply_recache_swap(self, live: list[BranchPages], swap: RecacheSwap) -> None:
        """Adopt the swap (after :meth:`copy`): references, then each branch's history."""
        self.allocator.incref(swap.dst)  # before the decref: a slot's pages never pass through the free list
        self.allocator.decref(swap.released)
        self.allocator.unallocate(swap.fresh_order)
        plans = {id(h): plan for h, plan in zip(self.branches, self.recache_plans)}
        for h, resident, starts in zip(live, swap.resident, swap.starts):
            h.apply_recache_commit(resident, starts, plans[id(h)])

    def drop(self, live: list[BranchPages], recache: bool) -> None:
        """Abort this lane's share: undo its reservation exactly while it is held (a distributed forward before
        its vote passed: the pending chunks it replaced come back, extents it took are given back, free order and
        peak as before), else drop the live branches' pending chunks."""
        if self.reservation is not None:
            self.reservation.rollback()
            self.reservation = None
            return
        if recache:
            # NOTE: a re-cache's fresh pages are never shared (pending pages are not forked): undo their
            # allocation exactly, so the free list is as before the re-cache too; the ring slots it took only
            # lose the reference it added (free slots again).
            split = [h.split_pending() for h in live]
            self.allocator.decref(p for ring, _ in split for p in ring)
            self.allocator.unallocate([p for _, fresh in split for p in fresh])
        else:
            self.allocator.decref([page for h in live for page in h.pending_pages()] + [
                page for h in live for page in h.pending_selection])
        for h in live:
            h.clear_pending()


class PageHold:
    """One extra reference on each of a set of pages, so they are neither freed nor reused while held.

    A training scope holds the history pages a forward with gradients attended until the backward
    (which may recompute that forward) has run: eviction drops the branch's reference, the hold keeps
    the K/V in place. The caller holds the cache's lock around :meth:`take` and :meth:`release`.
    """

    def __init__(self, allocator: PageAllocator, pages: Sequence[int]) -> None:
        self._allocator = allocator
        self.pages = tuple(pages)
        self.held = False

    def take(self) -> None:
        """Add the references (every page must be in use: it is some branch's history)."""
        if not self.held:
            self._allocator.incref(self.pages)
            self.held = True

    def release(self) -> list[int]:
        """Drop the references (idempotent); returns the pages that became free."""
        if not self.held:
            return []
        self.held = False
        return self._allocator.decref(self.pages)


def _selections(
    branches: Sequence[BranchPages], jobs: Sequence[SelectionJob | None], chosen: Sequence[Any] | None
) -> dict[int, Selection]:
    """Each member's new selection by ``id`` of its branch (a job and its chosen offsets); none for the others."""
    if chosen is None:
        return {}
    return {id(h): Selection(job.destination, job.start, job.made_at, offsets)
            for h, job, offsets in zip(branches, jobs, chosen) if job is not None}


def _ranges(values: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"`` (sorted ints)."""
    parts: list[str] = []
    start = prev = values[0]
    for value in values[1:] + [None]:  # type: ignore[list-item]
        if value is not None and value == prev + 1:
            prev = value
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if value is not None:
            start = prev = value
    return ", ".join(parts)


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold SIGINT (``KeyboardInterrupt``) until the block ends, so a multi-step update is not split.

    Only the main thread receives signals in Python, and only there can handlers change; in
    any other thread this is a no-op. A Ctrl-C that arrives inside the block is re-raised
    right after it, once the update is whole.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        previous = signal.getsignal(signal.SIGINT)
    except (ValueError, OSError):  # pragma: no cover - interpreters without signal support
        previous = None
    if previous is None:  # a handler installed outside Python: leave it alone
        yield
        return
    received: list[tuple[int, Any]] = []

    def _hold(signum: int, frame: Any) -> None:
        received.append((signum, frame))

    signal.signal(signal.SIGINT, _hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            if callable(previous):
                previous(*received[0])  # default_int_handler raises KeyboardInterrupt here
            elif previous == signal.SIG_DFL:
                signal.raise_signal(signal.SIGINT)  # the default action (terminate), now that the update is whole
