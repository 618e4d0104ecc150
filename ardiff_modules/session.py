"""``KVState``: one session's branches, pending chunks and cross-attention caches.

Its methods are the session-state API serving engines drive per request (``get_kv_caches`` /
``prepare_paged_context``, ``commit_paged_context``, ``populate_cross_attention``,
``is_cross_attention_populated``, ``get_cross_attention_kv``, ``clear_cross_attention``,
``reset``, ``close``), plus batched multi-branch forwards (``prepare_forward``), ``abort`` of a
failed forward, absolute token offsets for RoPE, pending pages reused across denoising forwards,
and zero-copy sharing between sessions (``fork``, ``share_sinks_from``,
``share_cross_attention_from``).

Every method validates before it mutates: a raised exception leaves this
session, every other session and the pool unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ardiff_modules.core.allocator import PageAllocator
from ardiff_modules.checks import require_bool
from ardiff_modules.context import ForwardContext, LayerContext, short_name, short_tuple
from ardiff_modules.cross import CrossEntry, CrossKey, SessionCrossCaches
from ardiff_modules.errors import (
    CrossAttentionNotPopulatedError,
    SequenceLengthError,
    SessionClosedError,
    PendingContextError,
    SessionSuspendedError,
    SpecError,
    UnknownBranchError,
    UnknownCacheError,
)
from ardiff_modules.core.transaction import ForwardTransaction
from ardiff_modules.core.branch import BranchPages, drop_pending, drop_windows
from ardiff_modules.core.recache import RecacheRule
from ardiff_modules.core.retention import pins_shots
from ardiff_modules.spec import KVCacheSpec, PendingAttention

#: Branches (and cross caches) a ``KVState`` repr names before eliding the rest.
_REPR_BRANCHES = 4


@dataclass(frozen=True)
class ForwardOptions:
    """The options of one forward beyond its streams, ``seq_len`` and ``commit_current``
    (``KVCache.prepare_forward``, ``KVState.prepare_forward``).

    Attributes
    ----------
    token_mask:
        Optional bool ``[num_streams, seq_len, max_keys]`` over the keys in the order of
        :meth:`ForwardContext.to_dense` (visible history, then pending tokens), ANDed with
        the visibility rule: the masked path for masks that are not chunk-structured.
        ``max_keys`` is the widest stream's history plus all ``seq_len`` pending tokens (what
        ``to_dense()`` of the same forward without a mask has). A query that sees no
        key at all gets a zero output.
    static:
        Keep every device input of this forward in fixed buffers so that a CUDA graph
        captured once replays correctly after re-planning (see :class:`CUDAGraphStep`).
        Needs the FlashInfer backend and a bounded window.
    chunk_lengths:
        Tokens of each pending chunk when they are not all ``chunk_size`` (e.g. image-to-video's
        1-latent-frame first chunk): multiples of ``page_size``, at most ``chunk_size``, summing
        to ``seq_len``. Default: ``seq_len // chunk_size`` full chunks, or one shorter chunk when
        ``seq_len`` is a multiple of ``page_size`` below ``chunk_size``. Sinks and windows count
        chunks whatever their lengths; positions count tokens.
    pending_attention:
        How the pending chunks of a multi-chunk forward see each other: ``"block_causal"``
        (pending chunk ``c`` sees pending chunks ``0..c``) or ``"bidirectional"`` (every pending
        chunk sees all pending chunks of its stream: Rolling Forcing's jointly denoised window;
        one kernel row per stream). ``None`` (default): the spec's ``pending_attention``. The
        history (sinks and window) and what a commit does are the same under both.
    keep_latents:
        A committing forward only: the clean latents ``[num_streams, seq_len, ...]`` of its chunks
        (the model's input), or in the model's frame-major layout ``[num_streams, frames, C, H, W]``
        (4+ dims; every chunk holds whole frames). On commit a copy of each chunk's slice is kept per
        branch, for as long as that chunk is in the history, so a prompt switch can re-cache without
        the caller storing them (:meth:`recache_latents` returns them in the same layout,
        :meth:`prepare_recache`). Dropped on abort.
    """

    token_mask: torch.Tensor | None = None
    static: bool = False
    chunk_lengths: Sequence[int] | None = None
    pending_attention: PendingAttention | None = None
    keep_latents: torch.Tensor | None = None


class ForwardsHost(Protocol):
    """What a session asks of the forward manager (``KVCache._forwards``)."""

    def prepare(
        self, streams: Sequence[tuple[KVState, str]], seq_len: int, commit_current: bool, options: ForwardOptions
    ) -> ForwardContext: ...
    def prepare_recache(
        self, streams: Sequence[tuple[KVState, str]], keep_sinks: bool | None, rule: RecacheRule | None
    ) -> ForwardContext: ...
    def recache_latents(
        self, streams: Sequence[tuple[KVState, str]], keep_sinks: bool | None, rule: RecacheRule | None
    ) -> torch.Tensor: ...
    def recache_chunk_indices(
        self, streams: Sequence[tuple[KVState, str]], keep_sinks: bool | None, rule: RecacheRule | None
    ) -> list[tuple[int, ...]]: ...
    def finish_forward(self, transaction: ForwardTransaction, success: bool) -> None: ...
    def abort_forwards_of(self, state: KVState) -> None: ...


class SuspendHost(Protocol):
    """What a session asks of the cache's host tier (``KVCache._host_tier``)."""

    def suspend(self, state: KVState) -> None: ...
    def resume(self, state: KVState) -> object: ...
    def is_suspended(self, state: KVState) -> bool: ...
    def forget(self, state: KVState) -> None: ...


class LaneLike(Protocol):
    """What a session uses of one lane of its cache (``CacheLane``): its allocator and retention spec."""

    @property
    def allocator(self) -> PageAllocator: ...
    @property
    def spec(self) -> KVCacheSpec: ...


class SessionHost(Protocol):
    """What a session uses of its cache (``KVCache`` implements it): the spec, the lock, where cross caches live, and
    the cache's private parts -- the pages' allocator (handed to ``core`` calls), the forward manager, the host
    tier -- and session-table hooks. A session is the cache's own: it reaches them; a program does not."""

    spec: KVCacheSpec
    _allocator: PageAllocator
    #: The cache's lanes (``ardiff_modules.lanes.CacheLane``: one per retention group's head part, one when uniform).
    @property
    def _lanes(self) -> Sequence[LaneLike]: ...

    # (read-only: a session never replaces them, and so the cache's concrete classes satisfy them)
    @property
    def _forwards(self) -> ForwardsHost: ...
    @property
    def _host_tier(self) -> SuspendHost: ...
    @property
    def lock(self) -> threading.RLock: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...
    def _new_branch_pages(self, lane: int = 0) -> BranchPages: ...
    def open_session(self, session_id: str | None = None) -> KVState: ...
    def _reopen_session(self, state: KVState) -> None: ...
    def _session_closed(self, state: KVState) -> None: ...


def branch_names(owner: str, branches: Sequence[str] | str | None, default: tuple[str, ...]) -> tuple[str, ...]:
    """Normalise a ``branches`` argument: one name, an ordered sequence of names, or ``None`` (all)."""
    if branches is None:
        return default
    if isinstance(branches, str):
        return (branches,)
    if isinstance(branches, (set, frozenset, Mapping)) or not isinstance(branches, Sequence):
        raise SpecError(
            f"{owner}: expected branch names as an ordered sequence (tuple or list), got {type(branches).__name__}"
        )
    for name in branches:
        if not isinstance(name, str):
            raise SpecError(f"{owner}: expected branch names (str), got {name!r}")
    return tuple(branches)


class KVState(SessionCrossCaches):
    """KV state of one session: any number of branches (e.g. CFG's cond/uncond) and named cross caches.

    Created by :meth:`KVCache.open_session`. Branches allocate lazily: a worker
    that never runs a branch holds no page for it.
    """

    def __init__(self, cache: SessionHost, session_id: str) -> None:
        self.cache = cache
        self.session_id = session_id
        spec = cache.spec
        #: Per lane of the cache, branch -> its pages there (every lane's keep the same offsets and commit counts:
        #: one transaction commits them together). ``_branches`` is the first lane's (a uniform cache's only).
        self._lane_branches: tuple[dict[str, BranchPages], ...] = tuple(
            {b: cache._new_branch_pages(lane) for b in spec.branches} for lane in range(len(cache._lanes))
        )
        self._branches = self._lane_branches[0]
        self._cross: dict[tuple[str, str], CrossEntry] = {}  # (cache name, branch) -> entry
        self._closed = False

    def __repr__(self) -> str:
        """One line, e.g. ``KVState('s0', committed={'cond': 7, 'uncond': 7}, pending={'cond': 1, 'uncond': 1},
        pages=96, cross=('text',), status='open')``; reads counters without the cache lock."""
        return _describe(self, self._branches, self._cross, self._closed)

    # ------------------------------------------------------------------ queries
    @property
    def kv_branch_names(self) -> tuple[str, ...]:
        return tuple(self._branches)

    @property
    def is_closed(self) -> bool:
        return self._closed

    @property
    def is_suspended(self) -> bool:
        """Whether the session's K/V is in the host tier (:meth:`suspend`): no forward until :meth:`resume`."""
        return self.cache._host_tier.is_suspended(self)

    def suspend(self) -> None:
        """Move this session's pages, cross caches and latents to the host tier (see ``host/tier.py``)."""
        self.cache._host_tier.suspend(self)

    def resume(self) -> object:
        """Bring them back into fresh device pages; returns the copies' handle (``.ready()``, ``.wait()``).

        Cross caches published or cleared while suspended win over the suspended ones. Raises
        :class:`~ardiff_modules.errors.SessionNotSuspendedError` when the session is not suspended."""
        return self.cache._host_tier.resume(self)

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosedError(f"Session {self.session_id!r} is closed; expected an open session")

    def branch_pages(self, branch: str) -> BranchPages:
        """The pure bookkeeping of one branch (pages, offsets, its open forward); raises if unknown/closed."""
        self._check_open()
        if not isinstance(branch, str):
            raise UnknownBranchError(
                f"KV branch: expected a branch name (str) from {self.kv_branch_names}, got {branch!r} "
                f"({type(branch).__name__})"
            )
        try:
            return self._branches[branch]
        except KeyError:
            raise UnknownBranchError(
                f"Unknown KV branch {branch!r}; expected one of {self.kv_branch_names}"
            ) from None

    def _check_branch(self, branch: str) -> None:
        self.branch_pages(branch)

    def _lane_pages(self, branch: str) -> tuple[BranchPages, ...]:
        """The pages of ``branch`` in every lane of the cache (one for a uniform cache); raises as
        :meth:`branch_pages`."""
        self.branch_pages(branch)
        return tuple(lane[branch] for lane in self._lane_branches)

    def token_offset(self, branch: str) -> int:
        """Absolute position of the branch's next pending token (tokens ever committed, evicted included)."""
        return self.branch_pages(branch).token_offset

    def committed_chunks(self, branch: str) -> int:
        """Chunks ever committed on ``branch``."""
        return self.branch_pages(branch).committed_chunks

    def history_chunks(self, branch: str) -> tuple[tuple[int, ...], ...]:
        """Page ids of each visible committed chunk (sinks then window), oldest first."""
        return self.branch_pages(branch).history_chunks

    def pending_chunks(self, branch: str) -> tuple[tuple[int, ...], ...]:
        """Page ids of each pending chunk of ``branch``."""
        return self.branch_pages(branch).pending

    def _open_forward(self, branch: str) -> ForwardTransaction | None:
        """The open (not yet committed or aborted) forward ``branch`` belongs to, if any."""
        forward = self.branch_pages(branch).transaction
        return forward if isinstance(forward, ForwardTransaction) and forward.is_open else None

    @property
    def _pending(self) -> dict[str, ForwardTransaction | None]:
        """Branch -> its open forward (read-only view, kept for tests written against 0.1)."""
        return {b: self._open_forward(b) for b in self._branches} if not self._closed else dict.fromkeys(self._branches)

    def pages_in_use(self) -> int:
        """References this session holds on pool pages (all branches)."""
        return sum(len(h.referenced_pages()) for branches in self._lane_branches for h in branches.values())

    # ------------------------------------------------------------------ self-attention
    def get_kv_caches(
        self, kv_branch: str, seq_len: int | None = None, commit_current: bool = False, *,
        pending_attention: PendingAttention | None = None,
    ) -> list[LayerContext]:
        """Per-layer contexts for one forward of ``kv_branch`` over ``seq_len`` pending tokens.

        The per-branch call of serving engines; :meth:`prepare_forward` batches several branches
        (e.g. CFG) in one forward. ``pending_attention`` is as in :meth:`KVCache.prepare_forward`.
        """
        if seq_len is None:
            raise SequenceLengthError(
                f"get_kv_caches: expected seq_len (a multiple of chunk_size={self.cache.spec.chunk_size}), got None"
            )
        return self.prepare_paged_context(kv_branch, seq_len, commit_current, pending_attention=pending_attention)

    def prepare_paged_context(
        self, kv_branch: str, seq_len: int, commit_current: bool, *, pending_attention: PendingAttention | None = None
    ) -> list[LayerContext]:
        """Same as :meth:`get_kv_caches` with ``seq_len`` required (the name some serving engines use)."""
        return self.prepare_forward((kv_branch,), seq_len, commit_current, pending_attention=pending_attention).layers

    def prepare_forward(
        self,
        branches: Sequence[str] | None = None,
        seq_len: int | None = None,
        commit_current: bool = False,
        *,
        token_mask: torch.Tensor | None = None,
        static: bool = False,
        chunk_lengths: Sequence[int] | None = None,
        pending_attention: PendingAttention | None = None,
        keep_latents: torch.Tensor | None = None,
    ) -> ForwardContext:
        """One forward over several branches of this session, batched in that order (e.g. CFG).

        ``branches`` defaults to every branch of the spec. The result is a context
        manager that commits on success and aborts on an exception. ``token_mask``,
        ``static``, ``chunk_lengths``, ``pending_attention`` and ``keep_latents``
        (``[num_branches, seq_len, ...]``) are as in :meth:`KVCache.prepare_forward`.
        """
        self._check_open()
        names = branch_names("prepare_forward", branches, self.kv_branch_names)
        if seq_len is None:
            raise SequenceLengthError(
                f"prepare_forward: expected seq_len (a multiple of chunk_size={self.cache.spec.chunk_size}), got None"
            )
        options = ForwardOptions(token_mask, static, chunk_lengths, pending_attention, keep_latents)
        return self.cache._forwards.prepare([(self, b) for b in names], seq_len, commit_current, options)

    def history_chunk_indices(self, branch: str) -> tuple[int, ...]:
        """Commit index (0-based, evicted chunks counted) of each history chunk of ``branch``, oldest first.

        Which chunks' clean latents a re-cache needs (:meth:`prepare_recache`).
        """
        return self.branch_pages(branch).history_index

    def recache_chunk_indices(
        self, branch: str, *, keep_sinks: bool | None = None, rule: RecacheRule | None = None
    ) -> tuple[int, ...]:
        """Commit indices of the chunks :meth:`prepare_recache` of ``branch`` rebuilds under ``rule``, in the
        order the model is fed their latents (commit order: moved sinks, context chunks, window)."""
        self._check_open()
        names = branch_names("recache_chunk_indices", [branch], self.kv_branch_names)
        return self.cache._forwards.recache_chunk_indices([(self, names[0])], keep_sinks, rule)[0]

    def recache_latents(
        self, branches: Sequence[str] | None = None, *, keep_sinks: bool | None = None, rule: RecacheRule | None = None
    ) -> torch.Tensor:
        """The kept latents :meth:`prepare_recache` of ``branches`` runs over, ``[num_branches, seq_len, ...]``.

        See :meth:`KVCache.recache_latents`.
        """
        self._check_open()
        names = branch_names("recache_latents", branches, self.kv_branch_names)
        return self.cache._forwards.recache_latents([(self, b) for b in names], keep_sinks, rule)

    def prepare_recache(
        self, branches: Sequence[str] | None = None, *, keep_sinks: bool | None = None, rule: RecacheRule | None = None
    ) -> ForwardContext:
        """Re-cache several branches of this session under the current (new) prompt, in one launch.

        ``branches`` defaults to every branch of the spec. Rebuilds the chunks of
        :meth:`recache_chunk_indices` under ``rule`` (default the spec's ``recache``: the history but
        the sinks, block-causal); feed their clean latents concatenated in that order. See
        :meth:`KVCache.prepare_recache` for the semantics.
        """
        self._check_open()
        names = branch_names("prepare_recache", branches, self.kv_branch_names)
        return self.cache._forwards.prepare_recache([(self, b) for b in names], keep_sinks, rule)

    def commit_paged_context(self, kv_branch: str) -> None:
        """After a successful forward: a committing forward's pending chunks join history (no copy).

        Chunks that leave the window are evicted (pages freed when unreferenced).
        After a non-committing (denoising) forward this only closes the forward:
        its pending pages stay reserved and the next forward of the chunk reuses them.

        NOTE: a forward is one transaction: when ``kv_branch`` was prepared together with other
        streams (a batched CFG forward, several sessions), they are all committed now, atomically. A forward
        that is a rank's share of a ``DistributedForward`` is not
        committed alone: :class:`~ardiff_modules.errors.ParticipantCommitError`, nothing changed.
        """
        with self.cache.lock:
            transaction = self._open_forward(kv_branch)
            if transaction is not None:
                self.cache._forwards.finish_forward(transaction, True)

    def abort(self, kv_branch: str | None = None) -> None:
        """Drop the pending work of ``kv_branch`` (or of every branch); history stays exactly as before.

        The open forward the branch belongs to is aborted as a whole (every stream of it).
        """
        with self.cache.lock:
            names = self.kv_branch_names if kv_branch is None else (kv_branch,)
            for b in names:
                self.branch_pages(b)
            for branch in names:
                transaction = self._open_forward(branch)
                if transaction is not None:
                    self.cache._forwards.finish_forward(transaction, False)
            # Pending pages kept by finished denoising forwards (reused by the next one), in every lane.
            for allocator, branches in _each_lane(self):
                drop_pending([branches[b] for b in names], allocator)

    # ------------------------------------------------------------------ shots (core/shot_sink.py)
    def drop_window(self, branches: Sequence[str] | str | None = None) -> None:
        """Release every resident chunk of ``branches`` (default all) but the sinks: the window, memory chunks
        and the shot sink (LongLive 2.0's ``shot_clean_recache`` at a scene cut).

        Offsets (positions, RoPE) and commit indices run on; pending chunks kept by finished denoising forwards
        stay (the clean forward reuses them), so the next forward attends the sinks and its own chunks. A shot
        begun for the next commit (:meth:`begin_shot`) still begins there. Raises before changing anything:
        :class:`~ardiff_modules.errors.PendingContextError` while a forward is open on one of them,
        :class:`~ardiff_modules.errors.SessionSuspendedError`, ``UnknownBranchError``, ``SessionClosedError``.
        """
        with self.cache.lock:
            names = idle_branch_names(self, "drop_window", branches)
            for allocator, lane in _each_lane(self):
                drop_windows([lane[name] for name in names], allocator)

    def begin_shot(self, branches: Sequence[str] | str | None = None) -> None:
        """The next chunk committed on ``branches`` (default all) begins a new shot: its first ``shot_chunks``
        chunks are pinned as the shot sink, which rolling never evicts until the next :meth:`begin_shot`
        (the previous shot sink is an ordinary window chunk from that commit on).

        Needs a retention policy that pins shots (``KVCacheSpec(retention=ShotSinkPolicy(...))``); raises
        :class:`~ardiff_modules.errors.SpecError` otherwise, and as :meth:`drop_window`, before changing anything.
        """
        with self.cache.lock:
            pinning = [i for i, lane in enumerate(self.cache._lanes) if pins_shots(lane.spec.policy)]
            if not pinning:
                got = [lane.spec.policy for lane in self.cache._lanes]
                raise SpecError(
                    f"begin_shot: expected a cache whose retention (or one retention group's) pins a shot sink "
                    f"(ShotSinkPolicy(...)), got {got[0] if len(got) == 1 else got!r}"
                )
            names = idle_branch_names(self, "begin_shot", branches)
            for i in pinning:  # groups that pin shots; the others roll on
                for name in names:
                    self._lane_branches[i][name].begin_shot()

    # ------------------------------------------------------------------ sharing (cross-attention caches: SessionCrossCaches)
    def fork(
        self,
        session_id: str | None = None,
        *,
        branches: Sequence[str] | None = None,
        share_cross_attention: bool = True,
    ) -> KVState:
        """A new session sharing this one's committed history by refcount: zero bytes of KV copied.

        Each forked branch starts from this session's history chunks (sinks + window) and
        absolute offset; the two sessions then diverge independently (committed pages are
        immutable, so sharing them is safe). Pending work is not shared. ``branches`` limits
        which branches are forked (the others start empty); cross-attention caches are shared
        by reference unless ``share_cross_attention=False``.
        """
        with self.cache.lock:
            self._check_open()
            if self.is_suspended:
                raise SessionSuspendedError(f"fork: expected a resident session, got {self.session_id!r} suspended")
            names = branch_names("fork", branches, self.kv_branch_names)
            if not names or len(set(names)) != len(names):
                raise SpecError(f"fork.branches: expected distinct branch names, at least one, got {names}")
            for branch in names:
                self.branch_pages(branch)
            require_bool("fork.share_cross_attention", share_cross_attention)
            child = self.cache.open_session(session_id)
            for branch in names:
                for allocator, parent, into in zip(
                    (lane.allocator for lane in self.cache._lanes), self._lane_pages(branch), child._lane_pages(branch)
                ):
                    into.adopt(parent, allocator)
            if share_cross_attention:
                child._adopt_cross_entries({k: e for k, e in self._cross.items() if k[1] in names})
            return child

    def share_sinks_from(self, other: KVState, kv_branch: str) -> None:
        """Start ``kv_branch`` from ``other``'s sink chunks (same first frames), shared by refcount.

        The branch must be empty (nothing committed or pending). It continues at the absolute
        offset right after the sinks, with an empty window.
        """
        if not isinstance(other, KVState) or other.cache is not self.cache:
            got = "a session of another cache" if isinstance(other, KVState) else type(other).__name__
            raise SpecError(f"share_sinks_from: expected a session of the same KVCache, got {got}")
        with self.cache.lock:
            history, _ = self.branch_pages(kv_branch), other.branch_pages(kv_branch)  # a closed source: refused first
            if history.committed_chunks or history.pending or self.is_suspended:
                raise SpecError(
                    f"share_sinks_from: expected branch {kv_branch!r} to be empty (and resident), got "
                    f"{history.committed_chunks} committed, {len(history.pending)} pending chunk(s)"
                    f"{', suspended' * self.is_suspended}"
                )
            _share_sinks(self, other, kv_branch)

    def share_cross_attention_from(self, other: KVState, cache_name: str, kv_branch: str | None = None) -> None:
        """Reuse ``other``'s populated cache ``cache_name`` (same prompt) by reference, for one or all branches."""
        if not isinstance(other, KVState) or other.cache is not self.cache:
            # Another cache may store other token counts, dtypes or devices: copy through populate instead.
            raise SpecError(
                "share_cross_attention_from: expected a session of the same KVCache, got "
                f"{type(other).__name__ if not isinstance(other, KVState) else 'a session of another cache'}"
            )
        with self.cache.lock:
            names = self.kv_branch_names if kv_branch is None else (kv_branch,)
            entries = []
            for branch in names:
                key = self._cross_key(branch, cache_name)
                entry = other._cross_entry(branch, cache_name)
                if entry is None:
                    raise CrossAttentionNotPopulatedError(
                        f"share_cross_attention_from: cache {cache_name!r} of branch {branch!r} of session "
                        f"{other.session_id!r} was not populated"
                    )
                entries.append((key, other._on_device(entry)))  # a suspended source holds host copies
            self._adopt_cross_entries(dict(entries))

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Release every page and cache of this session (idempotent).

        Open forwards it belongs to are aborted as a whole (their other sessions' streams too).
        """
        with self.cache.lock:
            if self._closed:
                return
            self.cache._forwards.abort_forwards_of(self)
            for allocator, branches in _each_lane(self):
                for history in branches.values():
                    history.release(allocator)
            self._cross.clear()
            self._closed = True
            self.cache._session_closed(self)

    def reset(self, *, keep_cross_attention: Collection[str] = ()) -> None:
        """Release all self-attention pages and restart every branch at offset 0.

        ``keep_cross_attention`` names cross caches that stay valid (e.g. the prompt
        is unchanged across a model-internal window reset); all others are dropped.
        Open forwards the session belongs to are aborted as a whole. A closed session
        is reopened.
        """
        if isinstance(keep_cross_attention, str):
            keep_cross_attention = (keep_cross_attention,)
        if isinstance(keep_cross_attention, Iterable):
            keep_cross_attention = tuple(keep_cross_attention)
        if not isinstance(keep_cross_attention, tuple) or not all(isinstance(n, str) for n in keep_cross_attention):
            raise SpecError(
                f"reset.keep_cross_attention: expected a collection of cache names, got {keep_cross_attention!r}"
            )
        unknown = set(keep_cross_attention) - set(self.cache.spec.cross_attention_names)
        if unknown:
            raise UnknownCacheError(
                f"Unknown cross-attention caches to keep: {sorted(unknown)}; expected names from "
                f"{self.cache.spec.cross_attention_names}"
            )
        with self.cache.lock:
            if self._closed:
                self.cache._reopen_session(self)  # raises (nothing changed) if the id was taken
                self._cross = {k: e for k, e in self._cross.items() if k[0] in keep_cross_attention}
            else:
                self.cache._forwards.abort_forwards_of(self)
                # NOTE: drop first, then forget: the host tier brings back to the device only the kept entries
                # that a suspended session holds as host copies (and its host pages go).
                self._cross = {k: e for k, e in self._cross.items() if k[0] in keep_cross_attention}
                self.cache._host_tier.forget(self)
            for allocator, branches in _each_lane(self):
                for history in branches.values():
                    history.release(allocator)
            self._closed = False


def _each_lane(state: KVState) -> Iterator[tuple[PageAllocator, dict[str, BranchPages]]]:
    """Each lane's allocator and ``state``'s branches there."""
    for lane, branches in zip(state.cache._lanes, state._lane_branches):
        yield lane.allocator, branches


def _share_sinks(state: KVState, other: KVState, kv_branch: str) -> None:
    """``state.share_sinks_from(other, kv_branch)`` once checked: every lane adopts its own sinks of ``other``'s
    branch; the stream's sinks are the most any retention group keeps, and its clock continues after them in
    every lane (a group with fewer sinks keeps only its own)."""
    lanes = state.cache._lanes
    sinks = max(lane.spec.policy.sink_chunks for lane in lanes)
    widest = next(i for i, lane in enumerate(lanes) if lane.spec.policy.sink_chunks == sinks)
    reference = other._lane_pages(kv_branch)[widest]
    if sinks == 0 or len(reference.sinks) < sinks:
        raise SpecError(
            f"share_sinks_from: expected {other.session_id!r}/{kv_branch!r} to hold its {sinks} sink "
            f"chunk(s), got {len(reference.sinks)} committed"
        )
    clock = (sinks, reference.sink_tokens())
    for lane, into, source_pages in zip(lanes, state._lane_pages(kv_branch), other._lane_pages(kv_branch)):
        into.adopt(source_pages, lane.allocator, sinks_only=True, clock=clock)


def idle_branches(state: KVState, what: str, branches: Sequence[str] | str | None) -> list[BranchPages]:
    """The pages (first lane) of ``branches`` of ``state`` for ``what`` (:func:`idle_branch_names`)."""
    return [state.branch_pages(name) for name in idle_branch_names(state, what, branches)]


def idle_branch_names(state: KVState, what: str, branches: Sequence[str] | str | None) -> tuple[str, ...]:
    """``branches`` of ``state`` for ``what``: named once each, the session open and resident, no forward open on
    any of them; raises (nothing changed) otherwise."""
    names = branch_names(what, branches, state.kv_branch_names)
    if not names or len(set(names)) != len(names):
        raise SpecError(f"{what}.branches: expected distinct branch names, at least one, got {names}")
    for name in names:
        state.branch_pages(name)  # closed session, unknown branch
    if state.is_suspended:
        raise SessionSuspendedError(f"{what}: expected a resident session, got {state.session_id!r} suspended")
    busy = [name for name in names if state._open_forward(name) is not None]
    if busy:
        raise PendingContextError(
            f"{what}: expected no open forward on branch(es) {list(names)} of session {state.session_id!r}, got "
            f"one on {busy} (commit or abort it first)"
        )
    return names


def _describe(
    state: KVState, branches: Mapping[str, BranchPages], cross: Mapping[CrossKey, CrossEntry], closed: bool
) -> str:
    """``repr(state)`` (see :meth:`KVState.__repr__`)."""
    shown = list(branches.items())[:_REPR_BRANCHES]
    more = len(branches) - len(shown)

    def per_branch(count: Callable[[BranchPages], int]) -> str:
        items = ", ".join(f"{short_name(name)}: {count(h)}" for name, h in shown)
        return "{" + items + (f", ... +{more}" if more else "") + "}"

    names = short_tuple(sorted({name for name, _ in list(cross)}), _REPR_BRANCHES)
    pages: int | str
    try:
        pages = state.pages_in_use()
    except Exception:  # noqa: BLE001 - a repr must not raise (e.g. another thread mid-update)
        pages = "?"
    status = "closed" if closed else "suspended" if state.is_suspended else "open"
    return (
        f"KVState({short_name(state.session_id)}, committed={per_branch(lambda h: h.committed_chunks)}, "
        f"pending={per_branch(lambda h: len(h.pending))}, pages={pages}, cross={names}, status={status!r})"
    )
