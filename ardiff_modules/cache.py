"""``KVCache``: the pool, the allocator and the backend shared by every session -- a facade.

It opens sessions (:class:`~ardiff_modules.session.KVState`), reports usage, and hands every forward
to its :class:`~ardiff_modules.forwards.ForwardManager` (validate -> reserve -> lay out -> plan ->
begin; finish), whose contexts every attention layer of the model shares. Admission is arithmetic
on ints (:class:`~ardiff_modules.core.admission.Admission`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from types import TracebackType

import torch

from ardiff_modules.backends import AttentionBackend, resolve_backend
from ardiff_modules.checks import require_bool, require_choice, require_int
from ardiff_modules.context import ForwardContext
from ardiff_modules.core.allocator import PageAllocator, reset_peak
from ardiff_modules.core.branch import BranchPages
from ardiff_modules.core.recache import RecacheRule
from ardiff_modules.core.retention import RetentionPolicy
from ardiff_modules.errors import CacheClosedError, SpecError
from ardiff_modules.forwards import ForwardManager
from ardiff_modules.host.files import load_sessions, save_sessions
from ardiff_modules.host.tier import HostTier, TierReport
from ardiff_modules.host.transport import recv_sessions, send_sessions
from ardiff_modules import lanes
from ardiff_modules.lanes import build_lanes
from ardiff_modules.pool import resolve_device, torch_dtype
from ardiff_modules.session import ForwardOptions, KVState
from ardiff_modules.session_table import SessionTable, check_session_id
from ardiff_modules.spec import KVCacheSpec, PendingAttention
from ardiff_modules.stats import CacheStats, cache_stats

#: DEBUG: the cache's geometry when built, each forward prepared / committed / aborted (host side,
#: once per forward; nothing per layer). WARNINGs of the backend choice come from ``ardiff_modules.backends``.
logger = logging.getLogger(__name__)


#: ``(session, branch)`` streams of one call, and an optional re-cache rule.
Streams = Sequence[tuple[KVState, str]]
Rule = RecacheRule | None

class KVCache:
    """Paged sink+window KV storage for any number of sessions.

    Thread safety: every host-side operation of the cache and its sessions (prepare, commit, abort, open/close/
    reset/fork, populate, stats, admission) holds one re-entrant lock, so threads may each drive their own sessions
    concurrently; kernels take no lock. Two threads driving the *same* session race on which forward comes first.

    Parameters
    ----------
    spec:
        Geometry and policy.
    num_pages, budget_bytes:
        Pool size, as a page count or a byte budget (exactly one).
    device:
        Device of the pool.
    backend:
        ``"auto"`` (FlashInfer on CUDA when available, else reference),
        ``"reference"``, ``"flashinfer"`` or an :class:`AttentionBackend` instance.
    contiguous_extents:
        Reserve for each branch, on its first forward, one run of consecutive pages holding
        ``sinks + window + 1`` chunks, used as a ring: one-chunk forwards then see one
        contiguous key range and run ragged (unpaged) FA3, the fastest kernel. Same peak
        memory as plain paging once the window is full, reserved up front (frame lanes: a ring of
        frame slots). ``None`` (default): on with FlashInfer and a bounded window; ``False``: paged.
    max_forward_contexts:
        Forward contexts (one per distinct batch of streams, each holding kernel plans and their
        buffers) kept for reuse; beyond this the least recently used idle one is released, so
        serving with ever-changing batch compositions does not grow memory.
    check_finite:
        Before a committing forward's chunks join history, check their K/V (every layer) for
        NaN/Inf; on any, abort the forward and raise :class:`NonFiniteKVError`. Costs one device
        sync and a read of the pending pages per commit; off by default.
    host_budget_bytes:
        Bytes the host tier of suspended sessions may hold (``None``: unbounded; ``KVState.suspend``).
    """
    # Sessions as safetensors files (host/files.py, extra "persist") and over torch.distributed (host/transport.py).
    save_sessions, load_sessions, send_sessions, recv_sessions = save_sessions, load_sessions, send_sessions, recv_sessions

    def __init__(
        self,
        spec: KVCacheSpec,
        *,
        num_pages: int | None = None,
        budget_bytes: int | None = None,
        device: torch.device | str = "cpu",
        backend: str | AttentionBackend = "auto",
        contiguous_extents: bool | None = None,
        max_forward_contexts: int = 64,
        check_finite: bool = False,
        host_budget_bytes: int | None = None,
    ) -> None:
        _check_arguments(
            spec, num_pages, budget_bytes, contiguous_extents, max_forward_contexts, check_finite, host_budget_bytes
        )
        self.spec = spec
        # NOTE: the engine's parts are private: the session, the host tier's files, warm-up and the distributed
        # cache (this package) reach them; a program uses the methods below.
        device = resolve_device("KVPool", device)
        self._dtype = torch_dtype(spec.dtype)
        self.backend = resolve_backend(backend, device, self._dtype, spec.head_dim, kv_dtype=torch_dtype(spec.cache_dtype))
        #: One lane per retention group's head part (``ardiff_modules.lanes``); a uniform cache has one, whose
        #: pool, allocator, admission and extents keep their names.
        self._lanes = build_lanes(spec, num_pages, budget_bytes, device, self.backend.name, contiguous_extents)
        first = self._lanes[0]
        self._pool, self._allocator, self._admission = first.pool, first.allocator, first.admission
        self.max_forward_contexts = max_forward_contexts
        self._lock = threading.RLock()
        self._sessions = SessionTable()
        self._host_tier = HostTier(self._lanes, self._lock, self._sessions, host_budget_bytes)
        self._forwards = ForwardManager(
            self, spec, self._lanes, self.backend, dtype=self._dtype, max_contexts=max_forward_contexts,
            check_finite=check_finite, lock=self._lock, host_tier=self._host_tier,
        )
        self._closed = False
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("KVCache: %s", _geometry(self))

    def __repr__(self) -> str:
        """One line; reads counters without the lock and never touches the device."""
        return _describe(self)

    # ------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        return self._pool.device

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype: queries, outputs, cross-attention caches."""
        return self._dtype

    @property
    def extent_chunks(self) -> int | None:
        """Slots of each branch's contiguous extent (a frame lane's: frames), or ``None`` (plain paging)."""
        return self._lanes[0].extent_chunks

    @property
    def policy(self) -> RetentionPolicy:
        """The retention policy every branch follows (``spec.policy``)."""
        return self.spec.policy

    @property
    def kv_dtype(self) -> torch.dtype:
        """Storage dtype of the paged K/V."""
        return self._pool.dtype

    @property
    def check_finite(self) -> bool:
        """Whether a commit first checks the pending K/V for NaN/Inf (settable; see the class docstring)."""
        return self._forwards.check_finite

    @check_finite.setter
    def check_finite(self, value: bool) -> None:
        require_bool("KVCache.check_finite", value)
        self._forwards.check_finite = value

    @property
    def lock(self) -> threading.RLock:
        """The re-entrant lock around all host bookkeeping of this cache and its sessions."""
        return self._lock

    @property
    def is_closed(self) -> bool:
        return self._closed

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise CacheClosedError(f"{what}: expected an open KVCache, got one that was closed")

    def set_kv_scales(self, scales: torch.Tensor) -> None:
        """Fix the FP8 K/V scales instead of calibrating them from each layer's first write.

        ``scales`` ``[num_layers, 2 (K, V), num_kv_heads]``, positive and finite (e.g. from a checkpoint's
        calibration): a stored value is ``round_fp8(k / scale)``, read back as ``stored * scale``. Only
        for ``kv_dtype="float8_e4m3fn"``, and only before any K/V was written (pages quantized with other
        scales would read back wrong): raises :class:`KVScalesFixedError` then, changing nothing.
        """
        with self._lock:
            self._check_open("set_kv_scales")
            lanes.set_kv_scales(self._lanes, scales, self.spec.num_layers, self.spec.num_kv_heads)

    @property
    def kv_scales(self) -> torch.Tensor:
        """The pool's K/V scales, float32 ``[num_layers, 2 (K, V), num_kv_heads]``: ones for a float pool, an FP8
        pool's calibrated (or :meth:`set_kv_scales`) values. Read it, do not write it (it is the pool's own tensor)."""
        return lanes.kv_scales(self._lanes, self.spec.num_layers, self.spec.num_kv_heads)

    # ------------------------------------------------------------------ sessions
    @property
    def sessions(self) -> dict[str, KVState]:
        """Open sessions by id (a copy)."""
        with self._lock:
            return self._sessions.as_dict()

    def open_session(self, session_id: str | None = None) -> KVState:
        """Open a session with every branch of the spec; no page is allocated until a branch runs."""
        with self._lock:
            self._check_open("open_session")
            return self._sessions.open(session_id, lambda sid: KVState(self, sid))

    def _new_branch_pages(self, lane: int = 0) -> BranchPages:
        """A branch's empty page bookkeeping in ``lane`` under its retention and extents (what a session holds)."""
        return self._lanes[lane].new_branch_pages()

    def _reopen_session(self, state: KVState) -> None:
        """Called by ``KVState.reset`` of a closed session: register it again under its id."""
        with self._lock:
            self._check_open("reset")
            self._sessions.reopen(state)

    def _session_closed(self, state: KVState) -> None:
        """Called by ``KVState.close``: drop the session and release its forward contexts."""
        with self._lock:
            self._sessions.remove(state)
            self._forwards.release_contexts_of(state.session_id)
            self._host_tier.forget(state)

    def close(self) -> None:
        """Close every session, release every forward context and the pool's memory. Idempotent.

        Afterwards the cache refuses new sessions and forwards (:class:`CacheClosedError`);
        contexts still held by the caller raise instead of touching the pool.
        """
        with self._lock:
            if self._closed:
                return
            for state in self._sessions:
                state.close()
            self._forwards.close()
            self._closed = True
            for lane in self._lanes:
                lane.pool.release()

    def __enter__(self) -> KVCache:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ forwards (the manager's)
    def release_idle_forward_contexts(self) -> int:
        """Release every kept context whose forward is not open (plans rebuilt, graphs recaptured on next use)."""
        return self._forwards.release_idle_contexts()

    def prepare_forward(
        self,
        streams: Sequence[tuple[KVState, str]],
        seq_len: int,
        commit_current: bool = False,
        *,
        token_mask: torch.Tensor | None = None,
        static: bool = False,
        chunk_lengths: Sequence[int] | None = None,
        pending_attention: PendingAttention | None = None,
        keep_latents: torch.Tensor | None = None,
    ) -> ForwardContext:
        """Prepare one forward over ``streams`` (``(session, branch)`` pairs, the batch order).

        Allocates missing pending chunks (reusing those of earlier denoising
        forwards), builds the plan once for all layers, and returns the forward
        context. Raises before changing anything on: misaligned ``seq_len``,
        unknown branch, closed session, duplicate stream, a committing forward
        not yet committed, too few free pages, or a bad ``token_mask``.

        A denoising forward still open on one of ``streams`` is superseded (closed, its
        pending pages kept for reuse) once this one is prepared; if planning itself fails
        on a backend that re-plans in place, that forward is superseded too (its plan is
        no longer trustworthy), and nothing else changes.

        Options (``token_mask``, ``static``, ``chunk_lengths``, ``pending_attention``, ``keep_latents``):
        see :class:`~ardiff_modules.session.ForwardOptions`.
        """
        options = ForwardOptions(token_mask, static, chunk_lengths, pending_attention, keep_latents)
        return self._forwards.prepare(streams, seq_len, commit_current, options)

    def recache_latents(self, streams: Streams, *, keep_sinks: bool | None = None, rule: Rule = None) -> torch.Tensor:
        """The kept clean latents (``keep_latents``) a re-cache of ``streams`` runs over, ``[num_streams, seq_len,
        ...]``, in commit order. Raises :class:`LatentsNotKeptError` naming the chunks not kept; nothing changes."""
        return self._forwards.recache_latents(streams, keep_sinks, rule)

    def prepare_recache(self, streams: Streams, *, keep_sinks: bool | None = None, rule: Rule = None) -> ForwardContext:
        """Prepare a prompt-switch re-cache: one forward that rebuilds the history of ``streams``.

        After ``clear_cross_attention()`` and populating the new prompt, run the model over the clean
        latents of each stream's rebuilt chunks (:meth:`recache_latents`). ``rule`` (:class:`RecacheRule`,
        default ``spec.recache``; ``keep_sinks=`` the historical switch) says which chunks are rebuilt and
        how they see each other. Commit swaps every stream's rebuilt chunks in at once; abort releases only
        the re-cache's pages. The contract: :meth:`ForwardManager.prepare_recache
        <ardiff_modules.forwards.ForwardManager.prepare_recache>`.
        """
        return self._forwards.prepare_recache(streams, keep_sinks, rule)

    # ------------------------------------------------------------------ admission (ints: core.admission)
    def pages_per_session(self, branches: int | None = None, pending_chunks: int = 1) -> int:
        """Peak pages one session holds: per branch (sinks + window + pending) chunks, or its extent (raises
        :class:`SpecError` for an unbounded window); with retention groups summed over the lanes (``stats().lanes``)."""
        self._check_open("pages_per_session")
        return sum(lane.admission.pages_per_session(branches, pending_chunks) for lane in self._lanes)

    def recache_reserve(self) -> int:
        """Pages admission keeps free, once for the pool, so that one session can re-cache at its peak
        (``branches x (max_history_chunks - 1) x pages_per_chunk``; see :meth:`Admission.recache_reserve
        <ardiff_modules.core.admission.Admission.recache_reserve>`); :class:`SpecError` for an unbounded window."""
        self._check_open("recache_reserve")
        return sum(lane.admission.recache_reserve() for lane in self._lanes)

    def sessions_that_fit(self, pending_chunks: int = 1, *, recache: bool = True, tier: str = "device") -> int:
        """How many more sessions can run to their peak alongside the open ones; ``tier="host"``: how many more
        the host tier holds suspended at their peak (their pages; cross caches and latents add bytes: :meth:`tiers`).
        ``recache`` (default): keep :meth:`recache_reserve` free, so every session can re-cache one at a time.
        Contiguous extents: also the extents the free runs hold (:mod:`~ardiff_modules.host.extent_room`)."""
        with self._lock:
            self.pages_per_session(pending_chunks=pending_chunks)  # open, bounded, pending_chunks checked first
            require_bool("sessions_that_fit.recache", recache)
            if require_choice("sessions_that_fit.tier", tier, ("device", "host")) == "host":
                return self._host_tier.sessions_that_fit()
            return lanes.sessions_that_fit(self._lanes, self._host_tier.lane_counts, pending_chunks, recache)

    def can_admit(self, num_sessions: int = 1, pending_chunks: int = 1, *, recache: bool = True) -> bool:
        """Whether ``num_sessions`` more sessions fit at their peak (see :meth:`sessions_that_fit`)."""
        require_int("can_admit.num_sessions", num_sessions, minimum=1)
        return self.sessions_that_fit(pending_chunks, recache=recache) >= num_sessions

    def admit_session(
        self, session_id: str | None = None, pending_chunks: int = 1, *, recache: bool = True,
        suspend_idle: bool | Iterable[KVState] = False,
    ) -> KVState:
        """Open a session only if it fits at its peak (see :meth:`sessions_that_fit`); raises :class:`CapacityError`
        before any change. ``suspend_idle``: first suspend least recently used idle sessions to make room -- any
        (``True``) or only those given (the ones the server knows are paused; :meth:`HostTier.suspend_idle
        <ardiff_modules.host.tier.HostTier.suspend_idle>`)."""
        with self._lock:
            self._check_open("admit_session")
            check_session_id(session_id)
            self.sessions_that_fit(pending_chunks, recache=recache)  # the argument checks, in their order
            if suspend_idle is not False:
                self._host_tier.suspend_idle(pending_chunks, recache, suspend_idle)
            lanes.check_admit(self._lanes, self._host_tier.lane_counts, pending_chunks, recache)
            return self.open_session(session_id)

    def tiers(self) -> TierReport:
        """Device and host tiers: pages and bytes used, the host budget, sessions resident and suspended."""
        return self._host_tier.report()

    def reserve_host(self, nbytes: int) -> int:
        """Pin host memory ahead for ``nbytes`` of suspended pages (a server's warm start: the first suspends then
        pay only their copies); returns the host arena's bytes, capped by ``host_budget_bytes``."""
        return self._host_tier.reserve(nbytes)

    # ------------------------------------------------------------------ stats
    def stats(self) -> CacheStats:
        """A consistent snapshot of pool usage (taken under the cache lock)."""
        with self._lock:
            return cache_stats(self._lanes, self._sessions)

    def reset_peak(self) -> None:
        """Restart ``stats().peak_pages_used`` from the pages in use now (e.g. a peak per training step)."""
        with self._lock:
            for lane in self._lanes:
                reset_peak(lane.allocator)


def _check_arguments(
    spec: object, num_pages: int | None, budget_bytes: int | None, contiguous_extents: bool | None,
    max_forward_contexts: int, check_finite: bool, host_budget_bytes: int | None,
) -> None:
    """``KVCache``'s arguments checked (before anything is built)."""
    if not isinstance(spec, KVCacheSpec):
        raise SpecError(f"KVCache.spec: expected a KVCacheSpec, got {type(spec).__name__}")
    if contiguous_extents is not None:
        require_bool("KVCache.contiguous_extents", contiguous_extents)
    require_bool("KVCache.check_finite", check_finite)
    require_int("KVCache.max_forward_contexts", max_forward_contexts, minimum=1)
    if host_budget_bytes is not None:
        require_int("KVCache.host_budget_bytes", host_budget_bytes, minimum=0)
    if (num_pages is None) == (budget_bytes is None):
        raise SpecError(
            f"KVCache: expected exactly one of num_pages / budget_bytes, got num_pages={num_pages!r}, "
            f"budget_bytes={budget_bytes!r}"
        )
    if num_pages is not None:
        require_int("KVCache.num_pages", num_pages, minimum=1)
    else:
        require_int("KVCache.budget_bytes", budget_bytes, minimum=1)


def _geometry(cache: KVCache) -> str:
    """The DEBUG line of a new cache: pages, bytes, device, backend, extents (per lane with groups)."""
    rows = []
    for lane in cache._lanes:
        pool = lane.pool
        slots = "frames" if lane.frame_slots else "chunks"
        extents = f"extents of {lane.extent_chunks} {slots}" if lane.extent_chunks else "plain paging"
        rows.append(f"{lane.name}: {pool.num_pages} pages of {pool.bytes_per_page} bytes ({pool.nbytes / 2**20:.1f} MiB), "
                    f"{extents}")
    return f"{'; '.join(rows)} on {cache.device}, backend {cache.backend.name!r}"


def _describe(cache: KVCache) -> str:
    """``repr(cache)``: one line; reads counters without the lock and never touches the device."""
    spec = cache.spec
    used = sum(lane.allocator.num_used for lane in cache._lanes)
    total = sum(lane.allocator.num_pages for lane in cache._lanes)
    groups = f", groups={tuple(spec.head_retention.groups)}, lanes={len(cache._lanes)}" if spec.head_retention else ""
    kv_dtype = f", kv_dtype={spec.cache_dtype}" if spec.cache_dtype != spec.dtype else ""
    closed = ", closed" if cache.is_closed else ""
    return (
        f"KVCache(layers={spec.num_layers}, kv_heads={spec.num_kv_heads}, head_dim={spec.head_dim}, "
        f"pages={used}/{total} used{groups}, sessions={len(cache._sessions)}, "
        f"backend={cache.backend.name!r}, device='{cache.device}', dtype={spec.dtype}"
        f"{kv_dtype}{closed})"
    )
