"""``HeadGroupedKVCache``: per-head and per-layer retention, one paged cache per part.

Build it from the model's :class:`~ardiff_modules.spec.KVCacheSpec` (geometry, branches, cross caches,
dtypes; its ``sink_chunks`` / ``window_chunks`` left at their defaults) and a
:class:`~ardiff_modules.core.head_retention.HeadRetention` (which heads keep which chunks)::

    heads = am.HeadRetention.from_json("forcing_kv_heads.json")
    cache = am.HeadGroupedKVCache(spec, heads, max_sessions=4, device="cuda")
    state = cache.open_session()
    with state.prepare_forward(("cond", "uncond"), seq_len, commit_current=True) as fwd:
        out = model(x, t, fwd.layers)          # the same modules: chunk_attention splits the heads

Each part (:class:`~ardiff_modules.core.head_retention.HeadPart`: the heads of one group that some layers
hold in equal number) is a plain :class:`~ardiff_modules.cache.KVCache` over those layers and heads, with
the group's retention: its own pool, pages, eviction, contiguous extents (ragged FA3), plan and FP8
scales. Sessions, forwards and commits span every part: a forward is prepared in every part or in none,
and commits in every part or in none. Memory is split between the parts by what one session holds at
its peak in each, so admission (``sessions_that_fit``) answers for all of them.

Not supported here (refused with :class:`~ardiff_modules.errors.SpecError`): relative sinks, token
masks, re-cache, ``share_sinks_from``, gradients through the cache, the distributed wrappers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any

import torch

from ardiff_modules.backends import AttentionBackend, resolve_backend
from ardiff_modules.cache import KVCache
from ardiff_modules.checks import require_bool, require_int
from ardiff_modules.context import ForwardContext
from ardiff_modules.core.admission import Admission
from ardiff_modules.core.branch import drop_windows
from ardiff_modules.core.head_retention import HeadPart, HeadRetention
from ardiff_modules.core.retention import pins_shots
from ardiff_modules.core.transaction import ForwardTransaction
from ardiff_modules.core.two_phase import (
    Coordinator,
    Decision,
    Participant,
    Step,
    abort_all,
    commit_all,
    decide_locally,
    prepare_all,
)
from ardiff_modules.cross import CrossEntry, SessionCrossCaches
from ardiff_modules.errors import (
    CacheClosedError,
    CapacityError,
    ForwardFinishedError,
    SequenceLengthError,
    SessionClosedError,
    SpecError,
    UnknownCacheError,
)
from ardiff_modules.forwards.manager import stream_names
from ardiff_modules.forwards.request import Build
from ardiff_modules.head_forward import HeadGroupedForward, HeadGroupedLayer, head_selector, merge_order
from ardiff_modules.pool import KVPool, bytes_per_page, torch_dtype
from ardiff_modules.session import ForwardOptions, KVState, branch_names, idle_branches
from ardiff_modules.session_table import check_session_id
from ardiff_modules.spec import KVCacheSpec, PendingAttention

Streams = Sequence[tuple["HeadGroupedSession", str]]


def part_spec(spec: KVCacheSpec, part: HeadPart) -> KVCacheSpec:
    """The :class:`KVCacheSpec` of one part: its layers and heads, the group's retention, no cross caches."""
    group = spec.query_heads // spec.num_kv_heads
    return dataclasses.replace(
        spec, num_layers=len(part.layers), num_kv_heads=part.num_heads,
        num_qo_heads=None if spec.num_qo_heads is None else part.num_heads * group,
        sink_chunks=0, window_chunks=None, retention=part.policy, cross_attention=(),
    )


def _check_spec(spec: Any, heads: Any) -> None:
    owner = "HeadGroupedKVCache"
    if not isinstance(spec, KVCacheSpec):
        raise SpecError(f"{owner}.spec: expected a KVCacheSpec, got {type(spec).__name__}")
    if not isinstance(heads, HeadRetention):
        raise SpecError(f"{owner}.heads: expected a HeadRetention, got {type(heads).__name__}")
    heads.check_geometry(f"{owner}.heads", spec.num_layers, spec.num_kv_heads)
    if (spec.sink_chunks, spec.window_chunks, spec.retention) != (0, None, None):
        raise SpecError(
            f"{owner}.spec: expected sink_chunks/window_chunks/retention left at (0, None, None) (each head group "
            f"has its own retention), got ({spec.sink_chunks}, {spec.window_chunks}, {spec.retention!r})"
        )
    if spec.relative_sinks:
        raise SpecError(f"{owner}.spec.relative_sinks: expected False (not supported with head groups), got True")


def _part_pages(
    specs: Sequence[KVCacheSpec], names: Sequence[str], max_sessions: int | None, budget_bytes: int | None,
    extents: bool,
) -> list[int]:
    """Pages of each part's pool: ``max_sessions`` sessions at their peak (plus one re-cache reserve), or
    ``budget_bytes`` split by what one session holds at its peak in each part."""
    if (max_sessions is None) == (budget_bytes is None):
        raise SpecError(
            "HeadGroupedKVCache: expected exactly one of max_sessions / budget_bytes, got "
            f"max_sessions={max_sessions!r}, budget_bytes={budget_bytes!r}"
        )
    admissions = []
    for spec in specs:
        history = spec.max_history_chunks
        if history is None:
            raise SpecError(
                "HeadGroupedKVCache: expected every head group to have a bounded window (pools are split by "
                "each part's peak), got a group with window_chunks=None"
            )
        admissions.append(Admission(len(spec.branches), history, spec.pages_per_chunk, history + 1 if extents else None,
                                    spec.recache.context_chunks))
    if max_sessions is not None:
        require_int("HeadGroupedKVCache.max_sessions", max_sessions, minimum=1)
        return [max_sessions * a.pages_per_session() + a.recache_reserve() for a in admissions]
    budget = require_int("HeadGroupedKVCache.budget_bytes", budget_bytes, minimum=1)
    return _split_budget(budget, [a.pages_per_session() for a in admissions], specs, names)


def _split_budget(
    budget: int, session_pages: Sequence[int], specs: Sequence[KVCacheSpec], names: Sequence[str]
) -> list[int]:
    """Pages of each part: ``budget`` bytes split in proportion to one session's peak bytes in each part.

    Raises :class:`SpecError` when a part's share holds no page, as :class:`KVCache` refuses a budget below
    one page (``pages_for_budget``), naming the smallest budget that gives every part one.
    """
    sizes = [bytes_per_page(s) for s in specs]
    peaks = [pages * size for pages, size in zip(session_pages, sizes)]
    total = sum(peaks)
    # Integer arithmetic: exact for any budget (a float share can round a page away).
    pages = [budget * peak // total // size for peak, size in zip(peaks, sizes)]
    if min(pages) >= 1:
        return pages
    # Part p gets a page once budget * peak_p >= size_p * total.
    need = max(-(-size * total // peak) for peak, size in zip(peaks, sizes))
    empty = [f"{name} ({size} bytes a page)" for name, size, n in zip(names, sizes, pages) if n < 1]
    raise SpecError(
        f"HeadGroupedKVCache.budget_bytes: expected at least {need} bytes (one page in every part, as KVCache "
        f"needs one page, with the budget split by each part's peak), got {budget}: no page for {', '.join(empty)}"
    )


class HeadGroupedKVCache:
    """Per-head / per-layer retention over one :class:`KVCache` per part (see the module docstring).

    Parameters
    ----------
    spec:
        The model's geometry and options (``sink_chunks`` / ``window_chunks`` / ``retention`` at defaults).
    heads:
        The group of every (layer, kv head) and each group's retention.
    max_sessions, budget_bytes:
        Size the parts' pools for this many sessions at their peak, or split this many bytes between
        them in proportion to one session's peak (exactly one).
    device, backend, contiguous_extents, max_forward_contexts, check_finite:
        As for :class:`KVCache` (one backend instance shared by every part).
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        heads: HeadRetention,
        *,
        max_sessions: int | None = None,
        budget_bytes: int | None = None,
        device: torch.device | str = "cpu",
        backend: str | AttentionBackend = "auto",
        contiguous_extents: bool | None = None,
        max_forward_contexts: int = 64,
        check_finite: bool = False,
    ) -> None:
        _check_spec(spec, heads)
        self.spec, self.heads = spec, heads
        self.part_list = heads.parts()
        specs = [part_spec(spec, part) for part in self.part_list]
        probe = KVPool(specs[0], 1, device)  # resolves the device and dtypes once, as KVCache would
        shared = resolve_backend(backend, probe.device, torch_dtype(spec.dtype), spec.head_dim, kv_dtype=probe.dtype)
        extents = contiguous_extents if contiguous_extents is not None else shared.name == "flashinfer"
        pages = _part_pages(specs, [p.name for p in self.part_list], max_sessions, budget_bytes, extents)
        self.caches: tuple[KVCache, ...] = tuple(
            KVCache(s, num_pages=n, device=probe.device, backend=shared, contiguous_extents=contiguous_extents,
                    max_forward_contexts=max_forward_contexts, check_finite=False)
            for s, n in zip(specs, pages)
        )
        probe.release()
        self.max_forward_contexts = max_forward_contexts
        # NOTE: the parts are built with check_finite=False and _finish runs the check once, before any part
        # commits (as DistributedKVCache does before its vote): a part's own check would run it a second time,
        # after an earlier part had committed.
        self.check_finite = require_bool("HeadGroupedKVCache.check_finite", check_finite)
        self._lock = threading.RLock()
        self._sessions: dict[str, HeadGroupedSession] = {}
        self._forwards: OrderedDict[tuple[int, ...], HeadGroupedForward] = OrderedDict()
        self._layer_shares, self._merge_orders = self._build_layer_shares()
        self._closed = False

    def _build_layer_shares(self) -> tuple[list[list[tuple[int, int, Any, Any]]], list[torch.Tensor | None]]:
        """Per model layer: ``(part, layer in the part, q heads, kv heads)`` for each part holding heads there,
        and the permutation restoring head order after its parts' outputs are concatenated (built once, from
        host lists: a grouped forward never reads a device tensor back)."""
        group = self.spec.query_heads // self.spec.num_kv_heads
        device = self.caches[0].device
        shares: list[list[tuple[int, int, Any, Any]]] = [[] for _ in range(self.spec.num_layers)]
        order: list[list[int]] = [[] for _ in range(self.spec.num_layers)]
        for p, part in enumerate(self.part_list):
            for inner, (layer, kv_heads) in enumerate(zip(part.layers, part.heads)):
                q_heads = [h * group + j for h in kv_heads for j in range(group)]
                shares[layer].append((p, inner, head_selector(q_heads, device), head_selector(kv_heads, device)))
                order[layer].extend(q_heads)
        return shares, [merge_order(heads, device) for heads in order]

    # ------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        return self.caches[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.caches[0].dtype

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    @property
    def part_names(self) -> tuple[str, ...]:
        return tuple(part.name for part in self.part_list)

    @property
    def is_closed(self) -> bool:
        return self._closed

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise CacheClosedError(f"HeadGroupedKVCache.{what}: expected an open cache, got a closed one")

    def __repr__(self) -> str:
        parts = ", ".join(f"{p.name}: {len(p.layers)} layers, {c._pool.num_pages} pages"
                          for p, c in zip(self.part_list, self.caches))
        return f"HeadGroupedKVCache({parts}; sessions={len(self._sessions)}, closed={self._closed})"

    # ------------------------------------------------------------------ sessions
    @property
    def sessions(self) -> dict[str, HeadGroupedSession]:
        with self._lock:
            return dict(self._sessions)

    def open_session(self, session_id: str | None = None) -> HeadGroupedSession:
        """A new session: one :class:`KVState` per part under one id (all or none)."""
        with self._lock:
            self._check_open("open_session")
            check_session_id(session_id)
            opened: list[KVState] = []
            try:
                for cache in self.caches:
                    opened.append(cache.open_session(session_id if not opened else opened[0].session_id))
            except BaseException:
                for state in opened:
                    state.close()
                raise
            session = HeadGroupedSession(self, tuple(opened))
            self._sessions[session.session_id] = session
            return session

    def register(self, session: HeadGroupedSession) -> None:
        """Track a session made from parts opened elsewhere (``fork``)."""
        with self._lock:
            self._sessions[session.session_id] = session

    def session_closed(self, session: HeadGroupedSession) -> None:
        with self._lock:
            self._sessions.pop(session.session_id, None)
            stale = [key for key, fwd in self._forwards.items() if any(p._released for p in fwd.parts)]
            for key in stale:
                del self._forwards[key]

    def close(self) -> None:
        """Close every session and every part (idempotent)."""
        with self._lock:
            if self._closed:
                return
            for session in list(self._sessions.values()):
                session.close()
            for cache in self.caches:
                cache.close()
            self._forwards.clear()
            self._closed = True

    def __enter__(self) -> HeadGroupedKVCache:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ forwards
    @contextlib.contextmanager
    def _all_locks(self) -> Iterator[None]:
        """This cache's lock, then every part's in part order, for a step that spans the parts.

        NOTE: the parts' locks too, so that a caller driving a part directly (``caches[p]``) never sees a forward
        validated but not built, or committed in one part but not yet in the next. Always taken in this order
        (a part never calls back into this cache), so two such steps cannot deadlock.
        """
        with self._lock, contextlib.ExitStack() as stack:
            for cache in self.caches:
                stack.enter_context(cache.lock)
            yield

    def prepare_forward(
        self,
        streams: Streams,
        seq_len: int,
        commit_current: bool = False,
        *,
        static: bool = False,
        chunk_lengths: Sequence[int] | None = None,
        pending_attention: PendingAttention | None = None,
    ) -> HeadGroupedForward:
        """One forward over ``streams`` (``(session, branch)`` pairs) in every part, or in none.

        As :meth:`KVCache.prepare_forward`. Every part validates the request before any part builds, so
        a refusal by any part (capacity, an open commit, a length, a closed session) raises with every
        part, session and the pool unchanged. Each part then builds holding its reservation; if a build
        (or the grouped forward's own host work) raises, the parts already built are rolled back exactly
        (pending chunks, free order), and a denoising forward open on one of the streams that some part
        superseded meanwhile is aborted in every part, its streams' kept pending chunks dropped (history
        unchanged): every part ends in the same state.
        """
        options = ForwardOptions(static=static, chunk_lengths=chunk_lengths, pending_attention=pending_attention)
        with self._all_locks():
            self._check_open("prepare_forward")
            members = self._members(streams)
            # NOTE: validate in every part first: a refusal by a later part must not find an earlier part's
            # denoising forward already superseded and its pending chunks reshaped (the parts out of step).
            requests = [
                cache._forwards.forward_request([(s.parts[p], b) for s, b in members], seq_len, commit_current, options)
                for p, cache in enumerate(self.caches)
            ]
            previous = _open_transactions(members)
            contexts: list[ForwardContext] = []
            built: list[HeadGroupedForward] = []

            def assemble() -> None:  # the grouped forward's own host work, after every part built
                _check_offsets(contexts)
                built.append(self._forward_for(tuple(contexts), static))
                self._stack_cross(built[0], members, static)

            steps = [
                Step(name, functools.partial(_build_part, cache, request, contexts), _aborter(cache))
                for name, cache, request in zip(self.part_names, self.caches, requests)
            ]
            coordinator = Coordinator(f"the HeadGroupedForward over {stream_names(members)}")
            # Held reservations: a failed step rolls every built part back exactly; then the forwards some part
            # superseded meanwhile are aborted in every part (_abort_split).
            prepare_all(coordinator, [*steps, Step("HeadGroupedForward", assemble)], decide_locally,
                        undo=lambda decision: _abort_split(previous))
            for session, branch in members:
                session.opened(branch, built[0])
            return built[0]

    def _members(self, streams: Streams) -> list[tuple[HeadGroupedSession, str]]:
        if isinstance(streams, (str, bytes)) or not isinstance(streams, Sequence) or not streams:
            raise SpecError(f"prepare_forward.streams: expected a non-empty sequence of (session, branch), got {streams!r}")
        members = []
        for item in streams:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], HeadGroupedSession)):
                raise SpecError(f"prepare_forward.streams: expected (HeadGroupedSession, branch) pairs, got {item!r}")
            if item[0].cache is not self:
                raise SpecError("prepare_forward.streams: expected sessions of this HeadGroupedKVCache, got another's")
            members.append(item)
        return members

    def _forward_for(self, contexts: tuple[ForwardContext, ...], static: bool) -> HeadGroupedForward:
        """The reused grouped forward over these part contexts (the parts reuse theirs per batch of streams)."""
        key = tuple(id(c) for c in contexts)
        forward = self._forwards.get(key)
        if forward is not None and all(a is b for a, b in zip(forward.parts, contexts)):
            self._forwards.move_to_end(key)
            return forward
        forward = HeadGroupedForward.create(contexts, self.part_names, self._finish, self._layer_shares,
                                            self._merge_orders, self.spec.query_heads, self.spec.num_kv_heads,
                                            static=static)
        # NOTE: as the parts' registries: a forward over a released part context never runs again (dropped), and
        # beyond the limit only idle ones go. An open one evicted would get a new object on its next prepare (the
        # parts keep their open contexts): a compiled model would recompile, a CUDAGraphStep capture again.
        for old in [k for k, f in self._forwards.items() if f._released]:
            del self._forwards[old]
        self._forwards[key] = forward
        for old in list(self._forwards):
            if len(self._forwards) <= self.max_forward_contexts:
                break
            if self._forwards[old] is not forward and not self._forwards[old].is_active:
                del self._forwards[old]
        return forward

    def _stack_cross(self, forward: HeadGroupedForward, members: Sequence[tuple[HeadGroupedSession, str]],
                     static: bool) -> None:
        """Stack the streams' cross caches and publish them on ``forward`` (what it was stacked from last)."""
        names = self.spec.cross_attention_names
        entries = {name: [s._cross_entry(b, name) for s, b in members] for name in names}
        who = [f"{s.session_id!r}/{b!r}" for s, b in members]
        stacked, missing, versions = forward._cross_stack.restack(names, entries, who, forward._cross, static)
        forward._set_cross(stacked, missing)
        forward._cross_stack.adopt(versions)  # only once published: a failure above leaves the stack as it was

    def _finish(self, transactions: Sequence[ForwardTransaction | None] | HeadGroupedForward, success: bool) -> None:
        """Commit every part's forward or none: each part's pre-commit checks first, then the commits.

        ``transactions``: one per part, or a grouped forward whose parts' current ones are read under the lock.

        The two phases of :func:`~ardiff_modules.core.two_phase.commit_all`, decided locally (``all()``). Raises
        :class:`ForwardFinishedError` (the open parts aborted) when asked to commit a forward that some part
        finished on its own (a part context aborted directly; committing one alone raises
        :class:`ParticipantCommitError`): committing the others would put their offsets out of step.
        """
        with self._all_locks():
            if isinstance(transactions, HeadGroupedForward):
                transactions = transactions.transactions
            participants = [
                Participant(name, t, functools.partial(cache._forwards.abort_if_uncommittable, check_finite=self.check_finite),
                            _committer(cache), _aborter(cache))
                for name, cache, t in zip(self.part_names, self.caches, transactions)
            ]
            if not success:
                abort_all(participants)
                return
            statuses = {n: (t.status if t is not None else None) for n, t in zip(self.part_names, transactions)}

            def refused(decision: Decision) -> ForwardFinishedError:  # some part finished alone (aborted)
                return ForwardFinishedError(
                    f"commit: expected the forward open in every part, got statuses {statuses}; the open parts were "
                    "aborted and history is unchanged"
                )

            # NOTE: SIGINT held over all the parts' commits (each holds it over its own): a Ctrl-C between two
            # would leave the first part's offsets past the second's for good (commit_all defers it).
            commit_all(participants, decide_locally, refused=refused)

    # ------------------------------------------------------------------ admission and stats
    def sessions_that_fit(self, pending_chunks: int = 1, *, recache: bool = True) -> int:
        """How many more sessions fit at their peak in every part."""
        with self._lock:
            self._check_open("sessions_that_fit")
            return min(c.sessions_that_fit(pending_chunks, recache=recache) for c in self.caches)

    def can_admit(self, num_sessions: int = 1, pending_chunks: int = 1, *, recache: bool = True) -> bool:
        require_int("can_admit.num_sessions", num_sessions, minimum=1)
        return self.sessions_that_fit(pending_chunks, recache=recache) >= num_sessions

    def admit_session(self, session_id: str | None = None, pending_chunks: int = 1, *, recache: bool = True
                      ) -> HeadGroupedSession:
        """Open a session only if it fits at its peak in every part; :class:`CapacityError` before any change."""
        with self._lock:
            self._check_open("admit_session")
            check_session_id(session_id)
            if self.sessions_that_fit(pending_chunks, recache=recache) < 1:
                needed = [c.pages_per_session(pending_chunks=pending_chunks) for c in self.caches]
                p = next(p for p, c in enumerate(self.caches) if c.sessions_that_fit(pending_chunks, recache=recache) < 1)
                full = self.caches[p]
                free = max(0, full._admission.unpromised(full._allocator.num_free, full._allocator.num_used,
                                                        len(full.sessions), recache))
                raise CapacityError(
                    f"admit_session: a session needs {dict(zip(self.part_names, needed))} pages per part; part "
                    f"{self.part_names[p]!r} has {free} free pages not promised to the {len(self._sessions)} open "
                    f"session(s), expected at least {needed[p]}",
                    needed=needed[p], free=free,
                )
            return self.open_session(session_id)

    def pool_bytes(self) -> int:
        """Bytes of every part's pool (what the cache allocated)."""
        return sum(c._pool.nbytes for c in self.caches)

    def bytes_in_use(self) -> int:
        """Bytes of the pages in use in every part."""
        with self._lock:
            return sum(c._allocator.num_used * c._pool.bytes_per_page for c in self.caches)

    def stats(self) -> dict[str, Any]:
        """Per part name, that part's :meth:`KVCache.stats` snapshot."""
        with self._lock:
            return {name: cache.stats() for name, cache in zip(self.part_names, self.caches)}


def _aborter(cache: KVCache) -> Callable[[ForwardTransaction], None]:
    """Abort one part's transaction (rolled back exactly while its reservation is held)."""
    return lambda transaction: cache._forwards.finish_forward(transaction, False)


def _committer(cache: KVCache) -> Callable[[ForwardTransaction], None]:
    """Commit one part's transaction (inside :func:`commit_all`: its coordinator lets it)."""
    return lambda transaction: cache._forwards.finish_forward(transaction, True)


def _build_part(cache: KVCache, request: Build, contexts: list[ForwardContext]) -> ForwardTransaction | None:
    """Build one part's forward holding its reservation; its context is appended to ``contexts``."""
    ctx = cache._forwards.build(request, hold=True)
    contexts.append(ctx)
    return ctx._transaction


def _check_offsets(contexts: Sequence[ForwardContext]) -> None:
    """Every part sees each stream at the same token offset (they commit and reset together)."""
    offsets = {c.token_offsets for c in contexts}
    assert len(offsets) == 1, f"head-grouped parts out of step: token offsets {sorted(offsets)}"


#: Per grouped forward open on a stream of a prepare: its part transactions (what a part's build supersedes).
OpenTransactions = list[tuple[ForwardTransaction, ...]]


def _open_transactions(members: Sequence[tuple[HeadGroupedSession, str]]) -> OpenTransactions:
    """The part transactions of every grouped forward open on one of ``members`` (validated streams)."""
    found: dict[int, tuple[ForwardTransaction, ...]] = {}
    for session, branch in members:
        forward = session.open_forward(branch)
        if forward is not None:
            found[id(forward)] = tuple(t for t in forward.transactions if t is not None)
    return list(found.values())


def _abort_split(previous: OpenTransactions) -> None:
    """After a failed prepare: a grouped forward some part superseded but others still hold open is aborted in
    every part, and its streams' kept pending chunks dropped in every part (``KVState.abort``), so the parts
    agree again (a part that superseded it kept its pending chunks, one that aborted the new forward did not)."""
    for transactions in previous:
        if all(t.is_open for t in transactions):
            continue  # no part superseded it: every part still holds it as it was
        for transaction in transactions:
            for state, branch in transaction.members:
                if not state.is_closed:
                    state.abort(branch)


class HeadGroupedSession(SessionCrossCaches):
    """One generation stream of a :class:`HeadGroupedKVCache`: a :class:`KVState` per part, cross caches here.

    The session API of :class:`KVState` for what head groups support: ``prepare_forward`` /
    ``get_kv_caches`` / ``commit_paged_context`` / ``abort``, cross-attention populate / clear,
    ``fork``, ``reset``, ``close``, and the per-branch counters.
    """

    def __init__(self, cache: HeadGroupedKVCache, parts: tuple[KVState, ...]) -> None:
        self.cache = cache
        self.parts = parts
        self.session_id = parts[0].session_id
        self._cross: dict[tuple[str, str], CrossEntry] = {}
        self._open: dict[str, HeadGroupedForward] = {}
        self._closed = False

    def __repr__(self) -> str:
        status = "closed" if self._closed else "open"
        return f"HeadGroupedSession({self.session_id!r}, parts={len(self.parts)}, status={status!r})"

    # ------------------------------------------------------------------ queries
    @property
    def kv_branch_names(self) -> tuple[str, ...]:
        return self.cache.spec.branches

    @property
    def is_closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosedError(f"Session {self.session_id!r} is closed; expected an open session")

    def _check_branch(self, branch: str) -> None:
        self._check_open()
        self.parts[0].branch_pages(branch)  # unknown branch -> UnknownBranchError

    def token_offset(self, branch: str) -> int:
        return self.parts[0].token_offset(branch)

    def committed_chunks(self, branch: str) -> int:
        return self.parts[0].committed_chunks(branch)

    def pages_in_use(self) -> dict[str, int]:
        """Pages this session references in each part (part name -> pages; one snapshot of every part)."""
        with self.cache.lock:  # NOTE: not between two parts' commits of another thread's forward
            return {name: state.pages_in_use() for name, state in zip(self.cache.part_names, self.parts)}

    def bytes_in_use(self) -> int:
        """Bytes of the pages this session references, over every part."""
        with self.cache.lock:
            return sum(state.pages_in_use() * c._pool.bytes_per_page for state, c in zip(self.parts, self.cache.caches))

    # ------------------------------------------------------------------ self-attention
    def prepare_forward(
        self,
        branches: Sequence[str] | None = None,
        seq_len: int | None = None,
        commit_current: bool = False,
        *,
        static: bool = False,
        chunk_lengths: Sequence[int] | None = None,
        pending_attention: PendingAttention | None = None,
    ) -> HeadGroupedForward:
        """One forward over several branches of this session (as :meth:`KVState.prepare_forward`)."""
        self._check_open()
        names = branch_names("prepare_forward", branches, self.kv_branch_names)
        if seq_len is None:
            raise SequenceLengthError(
                f"prepare_forward: expected seq_len (a multiple of chunk_size={self.cache.spec.chunk_size}), got None"
            )
        return self.cache.prepare_forward([(self, b) for b in names], seq_len, commit_current, static=static,
                                          chunk_lengths=chunk_lengths, pending_attention=pending_attention)

    def get_kv_caches(self, kv_branch: str, seq_len: int | None = None, commit_current: bool = False
                      ) -> list[HeadGroupedLayer]:
        """Per-layer contexts for one forward of ``kv_branch`` (commit with :meth:`commit_paged_context`)."""
        return self.prepare_forward((kv_branch,), seq_len, commit_current).layers

    def opened(self, branch: str, forward: HeadGroupedForward) -> None:
        self._open[branch] = forward

    def open_forward(self, branch: str) -> HeadGroupedForward | None:
        """The open forward ``branch`` belongs to, if any."""
        self._check_branch(branch)
        forward = self._open.get(branch)
        return forward if forward is not None and forward.is_active else None

    def commit_paged_context(self, kv_branch: str) -> None:
        """Commit the open forward ``kv_branch`` belongs to (every part, with its other streams).

        A forward that some part finished alone (a part context aborted directly) is aborted in every part and
        :class:`ForwardFinishedError` raised, as :meth:`HeadGroupedForward.commit` does: never a silent no-op
        that leaves the other parts open.
        """
        self._check_branch(kv_branch)
        forward = self._open.get(kv_branch)
        # NOTE: any part open, not all (open_forward): a half-open forward must reach the grouped finish.
        if forward is None or not any(part.is_active for part in forward.parts):
            return
        forward.commit()

    def abort(self, kv_branch: str | None = None) -> None:
        """Abort the open forward of ``kv_branch`` (or of every branch) as a whole, in every part, and drop the
        pending chunks its finished denoising forwards kept (as :meth:`KVState.abort`); history is unchanged."""
        with self.cache.lock:
            if kv_branch is None:
                self._check_open()
            else:
                self._check_branch(kv_branch)  # unknown branch / closed session: raises before any part changed
            for state in self.parts:
                state.abort(kv_branch)

    # ------------------------------------------------------------------ shots (core/shot_sink.py)
    def drop_window(self, branches: Sequence[str] | str | None = None) -> None:
        """:meth:`KVState.drop_window` in every part at once: each group keeps its own sinks (every part is
        checked before any changes)."""
        with self.cache.lock:
            self._check_open()
            targets = [idle_branches(state, "drop_window", branches) for state in self.parts]
            for state, pages in zip(self.parts, targets):
                drop_windows(pages, state.cache._allocator)

    def begin_shot(self, branches: Sequence[str] | str | None = None) -> None:
        """:meth:`KVState.begin_shot` in the parts whose group pins a shot sink (a ``ShotSinkPolicy`` group);
        :class:`SpecError` when no group does. Every part is checked before any changes."""
        with self.cache.lock:
            self._check_open()
            pinning = [state for state in self.parts if pins_shots(state.cache.spec.policy)]
            if not pinning:
                raise SpecError(
                    "begin_shot: expected a head group whose retention pins a shot sink (ShotSinkPolicy), got "
                    f"{sorted({type(s.cache.spec.policy).__name__ for s in self.parts})}"
                )
            for pages in [idle_branches(state, "begin_shot", branches) for state in pinning]:
                for branch in pages:
                    branch.begin_shot()

    # ------------------------------------------------------------------ sharing and lifetime (cross caches: SessionCrossCaches)
    def fork(self, session_id: str | None = None, *, branches: Sequence[str] | None = None,
             share_cross_attention: bool = True) -> HeadGroupedSession:
        """A new session sharing this one's committed history in every part (zero bytes copied)."""
        require_bool("fork.share_cross_attention", share_cross_attention)
        with self.cache.lock:
            self._check_open()
            children: list[KVState] = []
            try:
                for state in self.parts:
                    sid = session_id if not children else children[0].session_id
                    children.append(state.fork(sid, branches=branches, share_cross_attention=False))
            except BaseException:
                for opened in children:
                    opened.close()
                raise
            child = HeadGroupedSession(self.cache, tuple(children))
            names = branch_names("fork", branches, self.kv_branch_names)
            if share_cross_attention:
                child._adopt_cross_entries({k: e for k, e in self._cross.items() if k[1] in names})
            self.cache.register(child)
            return child

    def share_sinks_from(self, other: HeadGroupedSession, kv_branch: str) -> None:
        raise SpecError(
            "share_sinks_from: not supported on a HeadGroupedKVCache (groups without sinks would not advance "
            "their offset); fork the session instead"
        )

    def close(self) -> None:
        """Release every page of every part and the cross caches (idempotent)."""
        with self.cache.lock:
            if self._closed:
                return
            for state in self.parts:
                state.close()
            self._cross.clear()
            self._open.clear()
            self._closed = True
            self.cache.session_closed(self)

    def reset(self, *, keep_cross_attention: Collection[str] = ()) -> None:
        """Release every part's self-attention pages, restart at offset 0; keep the named cross caches."""
        keep = (keep_cross_attention,) if isinstance(keep_cross_attention, str) else keep_cross_attention
        keep = tuple(keep) if isinstance(keep, Iterable) else ()
        if not isinstance(keep_cross_attention, Iterable) or not all(isinstance(n, str) for n in keep):
            raise SpecError(f"reset.keep_cross_attention: expected a collection of cache names, got {keep_cross_attention!r}")
        unknown = set(keep) - set(self.cache.spec.cross_attention_names)
        if unknown:  # NOTE: the error KVState.reset raises
            raise UnknownCacheError(f"Unknown cross-attention caches to keep: {sorted(unknown)}; expected names from "
                                    f"{self.cache.spec.cross_attention_names}")
        with self.cache.lock:
            if self._closed:
                raise SessionClosedError(f"Session {self.session_id!r} is closed; open a new one")
            for state in self.parts:
                state.reset()
            self._open.clear()
            self._cross = {k: e for k, e in self._cross.items() if k[0] in keep}
