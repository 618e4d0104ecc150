"""``DistributedKVCache``: one local :class:`~ardiff_modules.KVCache` per rank, and forwards that finish
the same way on every rank.

Each rank's cache is built from :meth:`ParallelMesh.local_spec`: its branches, its heads. The host work
(allocation, eviction, plans) is deterministic, so ranks that make the same calls agree without
communicating. What can differ is failure: one rank running out of pages, or raising inside its
forward; or the calls themselves: one rank interrupted that went on, or given other arguments. A
distributed forward therefore votes three times over the mesh's host (gloo) group::

    prepare  arguments ──────────────────────> vote ──┬─ same vote, same arguments everywhere: go on
                                                      └─ else every rank raises; nothing changed anywhere
             local KVCache.prepare_forward ──> vote ──┬─ all ok:  the model runs
                                                      └─ any failed: every rank aborts its streams, raises
    finish   local pre-commit checks ────────> vote ──┬─ all ok:  every rank commits (cannot fail now)
                                                      └─ any failed: every rank aborts its streams, raises

(votes 2 and 3 are the two phases of :mod:`ardiff_modules.core.two_phase`, decided by a vote where a
head-grouped cache decides with a local ``all()``), so no rank is ever left with a half-committed
history: a commit happens only once every rank has said its own commit will succeed (the pre-commit
check runs the same pure computation the commit then repeats). Each vote is one all-reduce of ``mesh
size x 4`` int64: every rank's row is ``(vote, forward number, digest, value)``
(:meth:`ParallelMesh.host_rows`). The forward number (the same on every rank) pairs each vote with
its forward: a rank that caught a ``KeyboardInterrupt`` inside a forward (aborted
there, without a vote) and went on meets its peers' finish vote with its next prepare vote, and every
rank raises :class:`RankDivergenceError` -- none commits -- and takes the largest number (in step
again). The first vote compares a digest of the arguments (session ids, ``seq_len``,
``commit_current``, ...) before anything changed, so ranks given different ones are refused with
nothing to undo.

A failed second vote undoes on every rank what the ranks that prepared did and the others did not: the
local forward is prepared holding its reservation (``ForwardManager.prepare(..., hold=True)``), so the
ranks that prepared roll it back exactly (pending chunks, extents, free order and peak as before); then
every rank aborts the denoising forwards it superseded with every session they span, settles the free
queue in one canonical order, and releases every idle forward context (the ranks that prepared had
published one; plans are rebuilt on next use). Once the vote passed, each rank keeps its reservation.
A vote whose collective itself fails (a peer killed, or silent past the mesh's ``timeout``) aborts this
rank's streams of the forward and raises :class:`DistributedForwardError` chained from the collective's
error.

NOTE: a rank that fails *inside* the model between two collectives of an SP group (the all-to-alls)
leaves its peers waiting in that collective; they surface it as that group's timeout and the group is
then unusable. The votes cover every failure outside collectives: prepare (capacity, validation),
anything raised in the ``with`` block after the model ran on this rank, the ``check_finite`` check, and
any failure in a CFG-only mesh whose ``with`` block runs no collective of its own (``mesh.gather`` is one).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import torch

from ardiff_modules.cache import KVCache
from ardiff_modules.context import ForwardContext, LayerContext
from ardiff_modules.distributed.digest import StateDigest, h64, check_consistency, lane_signature
from ardiff_modules.distributed.errors import DistributedForwardError, RankDivergenceError
from ardiff_modules.distributed.mesh import HOST_WORDS, ParallelMesh, Vote, check_same_vote
from ardiff_modules.errors import SequenceLengthError, SpecError
from ardiff_modules.core.reservation import settle_free_order
from ardiff_modules.core.transaction import ForwardTransaction
from ardiff_modules.core.two_phase import (
    Coordinator,
    Decide,
    Decision,
    Participant,
    Step,
    Word,
    commit_all,
    prepare_all,
    worst,
)
from ardiff_modules.spec import KVCacheSpec
from ardiff_modules.session import ForwardOptions, KVState

logger = logging.getLogger(__name__)


class DistributedKVCache:
    """A rank's share of a multi-GPU KV cache: a local :class:`~ardiff_modules.KVCache` over its branches
    and head shard, and forwards voted over the mesh.

    Parameters
    ----------
    spec:
        The *global* spec (every branch, every head); this rank's is :attr:`spec`.
    mesh:
        The :class:`ParallelMesh`.
    num_pages, budget_bytes, device, backend, contiguous_extents, max_forward_contexts:
        As in :class:`~ardiff_modules.KVCache`, for this rank's pool (``budget_bytes`` is per rank).
    check_finite:
        As in :class:`~ardiff_modules.KVCache`, but checked before the commit vote so that NaN/Inf on
        one rank aborts the forward on every rank.
    debug_checks:
        After every finished forward, run :meth:`check_consistency` (one more small all-gather).

    Notes
    -----
    All methods that change state are collective: every rank of the mesh calls them, in the same order,
    with the same arguments (session ids, ``seq_len``, ``commit_current``).
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        mesh: ParallelMesh,
        *,
        num_pages: int | None = None,
        budget_bytes: int | None = None,
        device: torch.device | str = "cpu",
        backend: Any = "auto",
        contiguous_extents: bool | None = None,
        max_forward_contexts: int = 64,
        check_finite: bool = False,
        debug_checks: bool = False,
    ) -> None:
        if not isinstance(mesh, ParallelMesh):
            raise SpecError(f"DistributedKVCache.mesh: expected a ParallelMesh, got {type(mesh).__name__}")
        for name, value in (("check_finite", check_finite), ("debug_checks", debug_checks)):
            if not isinstance(value, bool):
                raise SpecError(f"DistributedKVCache.{name}: expected a bool, got {value!r}")
        self.mesh = mesh
        self.global_spec = spec
        #: This rank's spec: its branches and head shard.
        self.spec = mesh.local_spec(spec)
        # NOTE: check_finite runs here before the vote; the local cache's own check would abort after it.
        self.cache = KVCache(
            self.spec, num_pages=num_pages, budget_bytes=budget_bytes, device=device, backend=backend,
            contiguous_extents=contiguous_extents, max_forward_contexts=max_forward_contexts, check_finite=False,
        )
        self.check_finite = check_finite
        self.debug_checks = debug_checks
        # The number of the last forward voted on, the same on every rank (each vote of a forward carries it).
        self._forward_number = 0

    def __repr__(self) -> str:
        return f"DistributedKVCache({self.mesh!r}, {self.cache!r})"

    @property
    def local_branches(self) -> tuple[str, ...]:
        return self.mesh.local_branches

    def open_session(self, session_id: str) -> KVState:
        """Open a session (with this rank's branches) under ``session_id``, the same id on every rank."""
        if not isinstance(session_id, str) or not session_id:
            raise SpecError(
                f"DistributedKVCache.open_session: expected a non-empty str session id (the same on every rank), "
                f"got {session_id!r}"
            )
        return self.cache.open_session(session_id)

    def close(self) -> None:
        self.cache.close()

    # ------------------------------------------------------------------ forwards
    def prepare_forward(
        self,
        sessions: KVState | Sequence[KVState],
        seq_len: int,
        commit_current: bool = False,
        *,
        static: bool = False,
        **kwargs: Any,
    ) -> DistributedForward:
        """Prepare one forward of every local branch of ``sessions`` (session-major), on every rank.

        ``seq_len`` is the whole chunk's token count (each rank's model gets ``seq_len / P`` of them);
        ``static=True`` keeps the local forward's device inputs in fixed buffers for CUDA-graph replay
        (:class:`~ardiff_modules.distributed.DistributedCUDAGraphStep`); other ``kwargs`` go to
        :meth:`KVCache.prepare_forward` too. Collective. If any rank fails to prepare, every rank aborts
        its streams (history as before, pending pages dropped) and raises: the rank that failed its own
        exception, the others :class:`DistributedForwardError`.

        Raises :class:`RankDivergenceError` on every rank, before anything changed here, if the ranks
        pass different session ids (or order), ``seq_len``, ``commit_current``, ``static`` or options, or
        are not at the same call (one rank still finishing an earlier forward: that forward is aborted
        on every rank). :class:`DistributedForwardError` chained from the collective's error if a vote
        fails (a peer gone, or silent past ``mesh.timeout``): this rank's forward is aborted.
        """
        number = self._forward_number + 1
        states = self._vote_arguments(number, sessions, seq_len, commit_current, static, kwargs)
        # each lane's free queue: identical on every rank of a row (same calls so far, same lanes)
        free_before = tuple(tuple(lane.allocator.free_pages()) for lane in self.cache._lanes)
        ctx = self._prepare_and_vote(number, states, seq_len, commit_current, static, kwargs, free_before)
        return DistributedForward(self, ctx, states, free_before, number)

    def _vote_arguments(
        self, number: int, sessions: object, seq_len: int, commit_current: bool, static: bool, kwargs: Mapping[str, Any]
    ) -> tuple[KVState, ...]:
        """Vote 1, before anything changes: every rank at this vote, with the same arguments (or nothing happens).

        NOTE: a vote of its own, not a digest in the outcome vote: by then each rank's local prepare has
        superseded the kept denoising forwards of the sessions *it* named, and ranks that named other
        sessions could not undo the same. One more all-reduce per forward buys "nothing changed anywhere".
        """
        states: tuple[KVState, ...] = ()
        refused: Exception | None = None
        try:
            states = _sessions_of(sessions, self.cache)
        except Exception as e:  # noqa: BLE001 - voted, then re-raised
            refused = e
        arguments = _arguments_text(states if refused is None else sessions, seq_len, commit_current, static, kwargs)
        rows = self._vote(Vote.PREPARE, number, h64(arguments), refused is not None, "nothing was prepared here")
        failed = _flagged(self.mesh.ranks, rows)
        if failed:
            if self.debug_checks:  # collective: every rank is on this path
                self.check_consistency()
            if refused is not None:
                raise refused
            raise DistributedForwardError(
                f"prepare_forward: expected every rank to name sessions of its cache, got a refusal on rank(s) "
                f"{list(failed)}; nothing was prepared on any rank",
                failed_ranks=failed,
            )
        differ = tuple(r for r, row in zip(self.mesh.ranks, rows) if row[2] != rows[0][2])
        if differ:
            raise RankDivergenceError(
                f"prepare_forward: expected every rank to prepare forward {number} with the same arguments as rank "
                f"{self.mesh.ranks[0]} (session ids and their order, seq_len, commit_current, static, options), got "
                f"different ones on rank(s) {list(differ)}; this rank's: {arguments}. Nothing was prepared on any rank",
                ranks=differ,
            )
        return states

    def _prepare_and_vote(
        self, number: int, states: tuple[KVState, ...], seq_len: int, commit_current: bool, static: bool,
        kwargs: Mapping[str, Any], free_before: Sequence[Sequence[int]],
    ) -> ForwardContext:
        """Vote 2: the local prepare (its reservation held until the vote), then its outcome on every rank
        (:func:`~ardiff_modules.core.two_phase.prepare_all`, decided by a vote)."""
        touched: tuple[KVState, ...] = ()
        prepared: list[ForwardContext] = []

        def prepare() -> ForwardTransaction | None:
            nonlocal touched
            # What a failed vote must abort identically on every rank: the kept denoising forwards this
            # prepare supersedes, with every session they span.
            touched = self._undo_scope(states)
            if isinstance(seq_len, int) and seq_len % self.mesh.sp_size:
                raise SequenceLengthError(
                    f"DistributedKVCache.prepare_forward: expected seq_len a multiple of the sequence-parallel "
                    f"degree {self.mesh.sp_size}, got {seq_len}"
                )
            streams = [(s, b) for s in states for b in self.local_branches]
            options = ForwardOptions(static=static, **kwargs)  # unknown options raise here: voted too
            prepared.append(self.cache._forwards.prepare(streams, seq_len, commit_current, options, hold=True))
            return prepared[0]._transaction

        def undo(decision: Decision | None) -> None:
            # What a failed vote undoes on every rank alike, after this rank's held forward was rolled back: the
            # sessions the prepare touched aborted and the free queue settled (see _abort_streams); the prepared
            # ranks had published a context (registered, made most recent, maybe evicting an idle one), the
            # others had not: releasing every idle context makes them equal. If every rank failed, nothing
            # changed anywhere and the sessions stay as they were.
            if decision is None or not decision.everyone_failed:
                self._abort_streams(touched, free_before)
                self.cache.release_idle_forward_contexts()
            if decision is not None and self.debug_checks:  # collective: every rank is on this path
                self.check_consistency()

        def refused(decision: Decision) -> DistributedForwardError:
            return DistributedForwardError(
                f"prepare_forward: expected every rank to prepare, got a failure on rank(s) {list(decision.failed)}; "
                "this rank's streams were aborted too (history unchanged)",
                failed_ranks=tuple(r for r in decision.failed if isinstance(r, int)),
            )

        # NOTE: a KeyboardInterrupt in the prepare or the vote is not voted on: prepare_all rolls back and undoes
        # here, and the peers meet this rank's next vote (RankDivergenceError) and undo the same.
        step = Step(self.mesh.rank, prepare, lambda transaction: self.cache._forwards.finish_forward(transaction, False))
        decide = self._decide(Vote.PREPARED, number, "this rank's prepared forward was aborted")
        prepare_all(Coordinator(f"DistributedForward {number}"), [step], decide, undo=undo, refused=refused)
        return prepared[0]

    def _decide(self, kind: Vote, number: int, undone: str) -> Decide:
        """The mesh vote as a two-phase decision: this rank's worst word, every rank's word back."""

        def decide(words: Sequence[tuple[object, Word]]) -> Decision:
            rows = self._vote(kind, number, 0, int(worst(words)), undone)
            return Decision(tuple((rank, Word(row[3])) for rank, row in zip(self.mesh.ranks, rows)))

        return decide

    def _vote(self, kind: Vote, number: int, digest: int, value: int, undone: str) -> tuple[tuple[int, ...], ...]:
        """One host vote of forward ``number``: every rank's row ``(kind, number, digest, value)``.

        Every rank leaves it with the largest forward number voted. Raises on every rank (the caller undoes
        what this rank must take back; ``undone`` says it): :class:`RankDivergenceError` if some rank is
        at another vote (another kind, or another forward); :class:`DistributedForwardError` chained from
        the collective's error if the collective fails (a peer gone, or silent past the mesh's timeout);
        a ``KeyboardInterrupt`` in the collective propagates as it is.
        """
        try:
            rows = self.mesh.host_rows((int(kind), number, digest, int(value)))
        except Exception as e:
            first = (str(e).splitlines() or [""])[0][:300]
            raise DistributedForwardError(
                f"DistributedKVCache: the {kind.label} of forward {number} failed in its collective "
                f"({type(e).__name__}: {first}): a peer is gone, or silent past the vote timeout "
                f"{self.mesh.timeout.total_seconds():g} s; {undone} (history and pool as before the forward). "
                "The mesh's process groups are not usable any more: restart the ranks",
                failed_ranks=(),
            ) from e
        assert len(rows[0]) == HOST_WORDS
        self._forward_number = max(self._forward_number, *(row[1] for row in rows))
        check_same_vote(self.mesh.ranks, rows, "DistributedKVCache")
        return rows

    def _undo_scope(self, states: Sequence[KVState]) -> tuple[KVState, ...]:
        """Before a local prepare over ``states``: every session a failed vote must abort -- ``states`` and the
        other sessions of denoising forwards still open on them, which the prepare would supersede here but a
        rank whose prepare failed aborts whole."""
        touched = list(states)
        for state in states:
            if state.is_closed:
                continue
            for branch in self.local_branches:
                forward = state._open_forward(branch)
                if forward is not None:
                    touched += [s for s, _ in forward.members if s not in touched]
        return tuple(touched)

    def _abort_streams(self, states: Sequence[KVState], free_before: Sequence[Sequence[int]]) -> None:
        """Every rank ends a failed forward in the same state: open forwards aborted, kept pending pages
        dropped, and the free queue in one canonical order.

        NOTE: the page *set* is then the same on every rank, but not the free-queue *order*: ranks may have
        freed the same pages in other orders (a forward aborted whole on one rank, session by session on
        another), so their next allocations would pick other ids. The order is therefore settled to: pages
        free before the forward, in their order then, followed by the others by id -- in every lane
        (``free_before``: each lane's queue before the forward; retention groups have one lane per head part).
        """
        orders = list(free_before) or [()] * len(self.cache._lanes)
        with self.cache.lock:
            self.cache._forwards.abort_sessions(states, free_order=orders[0])
            for lane, order in zip(self.cache._lanes[1:], orders[1:]):
                settle_free_order(lane.allocator, order)

    def settle_finish(self, decision: Decision) -> None:
        """After a finish vote's outcome was applied, whatever it was: the optional consistency check.

        Collective: every rank reaches it, whatever the vote said (a rank raising first would hang the rest).
        """
        if self.debug_checks:
            self.check_consistency()

    def check_consistency(self) -> tuple[StateDigest, ...]:
        """Debug: raise :class:`RankDivergenceError` unless every rank made the same decisions (collective).

        Ranks of one mesh row (same branches) must hold identical page tables, histories, offsets and
        pending pages; all ranks the same sessions and chunk counts. One all-gather of 2 int64 per rank.
        """
        return check_consistency(self.cache, self.mesh.host_group, self._replica_rows())

    def _replica_rows(self) -> tuple[tuple[int, ...], ...]:
        """Ranks whose page tables must be identical: one mesh row (same branches), split by retention lanes
        (Ulysses ranks restrict the groups to their heads: ranks with other lanes hold other pages)."""
        mesh, rows = self.mesh, []
        signatures = [lane_signature(mesh.local_head_retention(self.global_spec, r)) for r in range(mesh.sp_size)]
        for c in range(mesh.cfg_size):
            row = mesh.ranks[c * mesh.sp_size : (c + 1) * mesh.sp_size]
            for signature in dict.fromkeys(signatures):
                rows.append(tuple(rank for rank, s in zip(row, signatures) if s == signature))
        return tuple(rows)


class DistributedForward:
    """One forward of this rank's streams, finished by a vote of every rank.

    Use as a context manager (``with cache.prepare_forward(...) as fwd: model(x, fwd.layers)``): on exit
    every rank votes; all ok -> every rank commits, else every rank aborts and raises. Or call
    :meth:`commit` / :meth:`abort` on every rank.
    """

    def __init__(
        self, owner: DistributedKVCache, context: ForwardContext, sessions: tuple[KVState, ...],
        free_before: Sequence[Sequence[int]] = (), number: int = 0,
    ) -> None:
        self.owner = owner
        self._free_before = tuple(free_before)
        #: The forward's number (the same on every rank): its finish vote carries it.
        self.number = number
        #: The local forward context (this rank's streams).
        self.context = context
        self.sessions = sessions
        self._transaction = context._transaction
        self._done = False

    def __repr__(self) -> str:
        return f"DistributedForward({self.context!r})"

    @property
    def layers(self) -> list[LayerContext]:
        """The local layer contexts (what the model's attention layers take)."""
        return self.context.layers

    @property
    def positions(self) -> torch.Tensor:
        """int64 ``[local streams, seq_len]``: every token's absolute position (all ranks' tokens)."""
        return self.context.positions

    @property
    def local_positions(self) -> torch.Tensor:
        """int64 ``[local streams, seq_len / P]``: this rank's tokens (for RoPE in a model's own layers).

        A view of the context's positions (of its fixed buffer for a ``static`` forward)."""
        sp = self.owner.mesh.sp
        return self.context.positions if sp is None else sp.local_positions(self.context.positions)

    @property
    def local_sink_positions(self) -> torch.Tensor | None:
        """int64 ``[local streams, seq_len / P]``: this rank's tokens' shifted positions for
        relative-position sinks (the query rotated there is ``sink_query``), or ``None`` when the forward
        context has no ``sink_positions``. With retention groups the shift is per lane: this raises
        :class:`SpecError`; use :meth:`layer_sink_positions` (per layer)."""
        if self.context._lanes and self.context.relative_sinks:
            raise SpecError(
                "DistributedForward.local_sink_positions: expected a forward of one retention (a uniform cache), got "
                "one with retention groups, whose lanes' sinks move by different shifts; use "
                "layer_sink_positions(i) for layer i (per query head where its lanes differ)"
            )
        positions = getattr(self.context, "sink_positions", None)
        sp = self.owner.mesh.sp
        return positions if positions is None or sp is None else sp.local_positions(positions)

    def layer_sink_positions(self, index: int) -> torch.Tensor | None:
        """Layer ``index``'s sink positions for this rank's tokens (relative sinks; else ``None``): what its
        layer rotates the sink query at -- ``[local streams, seq_len / P]``, or per query head ``[local streams,
        seq_len / P, heads]`` where the layer's retention-group lanes differ (under Ulysses every query head of
        the layer, gathered over the group: collective, see ``SequenceParallel.local_sink_positions``)."""
        kv = self.context.layers[index]
        sp = self.owner.mesh.sp
        return kv.sink_positions if sp is None else sp.local_sink_positions(kv)

    @property
    def static(self) -> bool:
        """Whether the local forward keeps its device inputs in fixed buffers (CUDA-graph replay)."""
        return self.context._static

    def commit(self) -> None:
        """Collective: commit on every rank if every rank succeeded so far, else abort everywhere and raise.

        Never leaves the forward open: a rank at another vote (:class:`RankDivergenceError`) or a failed
        collective (:class:`DistributedForwardError`, chained from its error) aborts it here and raises."""
        self._finish(None)

    def abort(self) -> None:
        """Collective: abort on every rank (history exactly as before)."""
        self._finish(_LocalAbort())

    def _finish(self, error: BaseException | None) -> None:
        """The finish vote (:func:`~ardiff_modules.core.two_phase.commit_all`, decided by a vote): this rank's
        pre-commit checks, then every rank commits or every rank aborts. ``error``: the ``with`` block's
        exception, or :class:`_LocalAbort` (voted as a failure, not raised)."""
        if self._done:
            return
        self._done = True
        owner = self.owner
        # NOTE: this handle's own transaction, never ``context.transaction``: the context is reused, and a
        # later forward prepared on the same streams (which superseded this one) must not be finished here.
        me = Participant(
            owner.mesh.rank, self._transaction, self._precommit,
            lambda transaction: owner.cache._forwards.finish_forward(transaction, True),  # checked before the vote
            lambda transaction: owner._abort_streams(self.sessions, self._free_before),
        )

        def refused(decision: Decision) -> DistributedForwardError:
            failed = [r for r in decision.failed if isinstance(r, int)]
            return DistributedForwardError(
                f"forward: expected every rank to finish an open forward, got a failure (or a forward already "
                f"finished) on rank(s) {failed}; the forward was aborted on every rank (history unchanged)",
                failed_ranks=tuple(failed),
            )

        # NOTE: commit_all holds Ctrl-C from the finish vote until its outcome is applied on this rank (and the
        # optional consistency check ran): gloo's all-reduce returns only once every rank voted, so an interrupt
        # raised there would abort this rank after its peers had seen it vote to commit -- a silent half-commit
        # that the next forward's numbers cannot see. The wait is bounded by the vote group's timeout.
        # A rank whose forward was already closed votes DONE: with peers still open, that fails the forward.
        try:
            commit_all(
                [me], owner._decide(Vote.FINISH, self.number, "this rank's streams were aborted"), failure=error,
                # where this rank's forward was already closed, only the free-queue order is reset
                undo=lambda decision: owner._abort_streams((), self._free_before),
                settle=owner.settle_finish,
                refused=refused,
            )
        except _LocalAbort:
            pass

    def _precommit(self, transaction: ForwardTransaction) -> None:
        """What could make this rank's commit fail, checked before the vote (pure; changes nothing on success)."""
        if not transaction.commit_current:
            return  # a denoising forward just closes
        for branch in transaction.live_branches():
            branch.preview_commit()  # pure: may raise, changes nothing
        # Every layer wrote, FP8 scales it would fix not degenerate, and (check_finite) no NaN/Inf: on a
        # failure it aborts this rank's forward and raises; the vote then aborts everyone else's.
        self.owner.cache._forwards.abort_if_uncommittable(transaction, check_finite=self.owner.check_finite)

    def __enter__(self) -> DistributedForward:
        self.context._check_usable("DistributedForward.__enter__")
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None and not isinstance(exc, Exception):
            # KeyboardInterrupt / SystemExit: no vote (peers may be gone); abort locally and propagate.
            self._done = True
            if self._transaction is not None and self._transaction.is_open:
                self.owner._abort_streams(self.sessions, self._free_before)
            return
        try:
            self._finish(exc)
        except BaseException as e:
            if e is exc:
                return  # the local exception propagates unchanged
            raise


def _sessions_of(sessions: object, cache: KVCache) -> tuple[KVState, ...]:
    """``sessions`` (one session or a sequence of them) as a tuple, checked to be this cache's."""
    if isinstance(sessions, KVState):
        return (sessions,)
    states = tuple(sessions) if isinstance(sessions, (list, tuple)) else None
    if not states or not all(isinstance(s, KVState) and s.cache is cache for s in states):
        got = type(sessions).__name__ if states is None else [type(s).__name__ for s in states]
        raise SpecError(
            f"DistributedKVCache.prepare_forward: expected one or more sessions opened by this cache, got {got}"
        )
    return states


def _flagged(ranks: Sequence[int], rows: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The ranks whose vote row has a non-zero value (a failure), ascending."""
    return tuple(r for r, row in zip(ranks, rows) if row[3])


def _arguments_text(
    sessions: object, seq_len: object, commit_current: object, static: object, options: Mapping[str, Any]
) -> str:
    """What every rank passes alike to ``prepare_forward``, as the text whose digest the first vote compares:
    session ids in batch order, ``seq_len``, ``commit_current``, ``static`` and the other options (tensors
    by shape and dtype: their device is each rank's own)."""
    if isinstance(sessions, tuple) and all(isinstance(s, KVState) for s in sessions):
        ids: object = [s.session_id for s in sessions]
    else:
        ids = type(sessions).__name__
    extra = "".join(
        f" {name}="
        + (f"Tensor{list(value.shape)}:{value.dtype}" if isinstance(value, torch.Tensor) else repr(value))
        for name, value in sorted(options.items())
    )
    return f"sessions={ids} seq_len={seq_len!r} commit_current={commit_current!r} static={static!r}{extra}"



class _LocalAbort(Exception):
    """An explicit :meth:`DistributedForward.abort`: voted as a failure, not raised."""



