"""Retention policies: which committed chunks of a branch stay resident (pure Python).

A :class:`RetentionPolicy` names, for a branch with ``n`` committed chunks, the indices of
those still resident (visible to every later forward). The default is sink + sliding window
(:class:`SinkWindowPolicy`); :class:`SinkWindowMemoryPolicy` also keeps every k-th chunk that
left the window as a long-range "memory" frame. Any policy whose resident set only ever loses
chunks (never takes back an evicted one) plugs in: ``KVCacheSpec(retention=...)``.

Sink + sliding window:

A branch's committed chunks, oldest first, with ``sink_chunks = S`` and
``window_chunks = W``::

    committed:  c0  c1 | c2  c3  c4  c5  c6 | c7  c8  c9
                ^sinks^  ^---- evicted ----^ ^- window -^
                 (S=2)                         (W=3)

    visible to a new forward = sinks + window + its own pending chunks

Before ``S + W`` chunks were committed nothing is evicted; the first ``S``
committed chunks are sinks forever. ``W = None`` keeps every chunk.

The policy only does arithmetic on sequences of opaque chunk handles (the
state uses tuples of page ids), so hypothesis can hammer it in microseconds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from ardiff_modules.checks import is_int, require_bool, require_int
from ardiff_modules.errors import ARDiffError, SpecError

Chunk = TypeVar("Chunk")

#: Most tokens (and pages) one stream may see in a forward: the kernels' row offsets are int32 (FlashInfer's
#: ``kv_page_indptr`` / ``kv_page_indices`` count pages, the ragged ``kv_indptr`` tokens; ``layout.py``).
INDEX_LIMIT = 2**31 - 1


def check_index_bound(
    where: str, sinks: int, bound: int | None, counts: Callable[[], str], chunk_size: int | None = None
) -> None:
    """:class:`SpecError` unless a stream's peak visible chunks, plus one pending chunk, fit int32 indices.

    The peak is ``bound`` (``max_history_chunks``) chunks, or the ``sinks`` alone when unbounded (only they
    are promised to stay). Each chunk holds ``chunk_size`` tokens, or (``None``: a policy, which knows no
    geometry) at least one token and one page. ``counts()`` words the actual values for the message
    (``"sink_chunks=1 + window_chunks=1000000000000"``); it is only called on a refusal (policies are
    built on hot paths, e.g. ``KVCacheSpec.policy``).

    NOTE: a larger window could never be attended (its offsets would wrap), and sizing admission, extents
    or a ``max_sessions`` pool from it asks the allocator for terabytes: refused before anything is built.
    """
    chunks = (sinks if bound is None else bound) + 1
    tokens = chunks * (chunk_size or 1)
    if tokens <= INDEX_LIMIT:
        return
    what = "sink_chunks" if bound is None else "resident chunks (max_history_chunks)"
    if chunk_size is None:
        most, unit, got = INDEX_LIMIT - 1, "chunk (each at least one token)", f"{chunks} chunks"
    else:
        most, unit, got = INDEX_LIMIT // chunk_size - 1, f"chunk of chunk_size={chunk_size} tokens", f"{tokens} tokens"
    raise SpecError(
        f"{where}: expected at most {most} {what}, so that they and one pending {unit} fit the kernels' int32 "
        f"token and page offsets (2**31 - 1 = {INDEX_LIMIT}), got {counts()} ({got} with the pending one)"
    )


@dataclass(frozen=True)
class CommitResult(Generic[Chunk]):
    """Resident chunks after a commit, and the chunks it evicted (oldest first)."""

    sinks: tuple[Chunk, ...]
    window: tuple[Chunk, ...]
    evicted: tuple[Chunk, ...]


@runtime_checkable
class RetentionPolicy(Protocol):
    """What stays resident after a commit.

    Contract (property-tested for the policies here): ``sink_chunks`` is an int >= 0 and
    ``max_history_chunks`` ``None`` or an int >= ``sink_chunks`` (``bool`` is not an int);
    ``history_indices(n)`` is a sequence of strictly ascending ints within ``range(n)``, holds at
    most ``max_history_chunks`` indices, always starts with ``range(min(sink_chunks, n))``, and is
    *monotone*: ``history_indices(n + 1)`` is a subset of ``history_indices(n) + [n]`` (an evicted
    chunk never comes back, so its pages can be freed).

    Both are checked, for any policy: the declared values when a ``KVCacheSpec`` takes the policy
    (:func:`check_declared`), each answer at each commit (:func:`retain`). A breach raises
    :class:`~ardiff_modules.errors.SpecError` naming the policy's class, expected and actual,
    before the commit changed anything.
    """

    @property
    def sink_chunks(self) -> int:
        """Leading chunks never evicted (what ``share_sinks_from`` shares); 0 if none."""

    @property
    def max_history_chunks(self) -> int | None:
        """Most chunks ever resident at once (``None``: unbounded); sizes extents, admission, buffers."""

    def history_indices(self, num_committed: int) -> list[int]:
        """Indices (0-based, commit order) of the history chunks among ``num_committed``."""


@runtime_checkable
class ShotRetentionPolicy(RetentionPolicy, Protocol):
    """A :class:`RetentionPolicy` that also pins a movable shot sink (``core/shot_sink.py``).

    ``shot_history_indices(n, shot_start)`` is the answer for a branch whose current shot began at commit
    index ``shot_start`` (``None``: no shot, the same as ``history_indices(n)``); it keeps the contract of
    ``history_indices`` (checked the same way at each commit), ``max_history_chunks`` included.
    """

    @property
    def shot_chunks(self) -> int:
        """Leading chunks of a shot that stay pinned until the next shot begins."""

    def shot_history_indices(self, num_committed: int, shot_start: int | None) -> list[int]:
        """Indices of the history chunks among ``num_committed`` when the current shot began at ``shot_start``."""


def pins_shots(policy: object) -> bool:
    """Whether ``policy`` pins a shot sink (a :class:`ShotRetentionPolicy`: ``shot_chunks`` an int, and
    ``shot_history_indices``); attributes only, nothing called."""
    return callable(getattr(policy, "shot_history_indices", None)) and is_int(getattr(policy, "shot_chunks", None))


@dataclass(frozen=True)
class Retained(Generic[Chunk]):
    """Resident chunks after a commit with their commit indices, and the chunks it evicted."""

    history: tuple[Chunk, ...]
    indices: tuple[int, ...]
    evicted: tuple[Chunk, ...]
    #: Per history chunk, its trim under a frame policy (``core/frame_retention.py``); ``()``: none trimmed.
    kept: tuple[Any, ...] = ()


def _declared(policy: object, name: str) -> object:
    """``policy.<name>``; an exception its property raised becomes a ``SpecError`` naming it (ours pass as they are)."""
    try:
        return getattr(policy, name)
    except ARDiffError:
        raise
    except Exception as exc:
        raise _raised(policy, name, exc) from exc


def check_declared(policy: RetentionPolicy) -> tuple[int, int | None]:
    """``(sink_chunks, max_history_chunks)`` a policy declares, checked: :class:`SpecError` otherwise.

    ``sink_chunks``: an int >= 0; ``max_history_chunks``: ``None`` or an int >= ``sink_chunks``
    (the sinks are resident forever). NOTE: 0 is a valid bound (``SinkWindowPolicy(0, 0)``: each
    chunk sees only itself); -1, ``"3"``, ``2.5`` or ``True`` would size admission and extents
    with nonsense (a division by zero, a ``TypeError``, float page counts), so they stop here.
    """
    sinks, bound = _declared(policy, "sink_chunks"), _declared(policy, "max_history_chunks")
    # NOTE: `type(x) is int` on the hot path (every commit) is the cheap form of is_int (no bool).
    if type(sinks) is int and sinks >= 0 and (bound is None or (type(bound) is int and bound >= sinks)):
        return sinks, bound
    name = type(policy).__name__
    require_int(f"retention policy {name}.sink_chunks", sinks, minimum=0)
    require_int(f"retention policy {name}.max_history_chunks", bound, minimum=0, what="None or an int")
    raise SpecError(
        f"retention policy {name}.max_history_chunks: expected None or at least sink_chunks={sinks} "
        f"(sinks are never evicted), got {bound}"
    )


def _raised(policy: object, what: str, exc: Exception) -> SpecError:
    """The error for a read of the user's policy that raised ``exc`` (not a library error: those propagate)."""
    # NOTE: a user's bug surfaces as the library's policy error, chained to the original.
    return SpecError(
        f"retention policy {type(policy).__name__}.{what}: expected an answer, got {type(exc).__name__}: {exc}"
    )


def checked_history_indices(
    policy: RetentionPolicy, total: int, resident_indices: Sequence[int], num_committed: int, *,
    shot_start: int | None = None, window_floor: int = 0,
) -> tuple[int, ...]:
    """``policy.history_indices(total)`` after checking it against the contract (:class:`SpecError` if not).

    ``resident_indices`` (ascending) are the chunks still resident among the first
    ``num_committed``; chunks ``num_committed .. total - 1`` are the ones being committed. The
    answer must be a sequence (not a string) of strictly ascending ints, each resident or new
    (an evicted chunk never comes back), starting with the sinks, at most ``max_history_chunks``
    of them. Host ints only, O(history chunks): run once per branch and commit, never per layer.

    ``shot_start`` (a :class:`ShotRetentionPolicy` only): ask ``shot_history_indices(total, shot_start)``
    instead. ``window_floor``: chunks ``sink_chunks <= i < window_floor`` were dropped from the window
    (``BranchPages.drop_window``): taken out of the answer before it is checked.
    """
    sinks, bound = check_declared(policy)
    what = f"history_indices({total})" if shot_start is None else f"shot_history_indices({total}, {shot_start})"
    try:
        if shot_start is None:
            answer = policy.history_indices(total)
        else:
            answer = policy.shot_history_indices(total, shot_start)  # type: ignore[attr-defined]
    except ARDiffError:
        raise
    except Exception as exc:
        raise _raised(policy, what, exc) from exc
    if window_floor > sinks and (type(answer) is list or type(answer) is tuple):
        # NOTE: only int indices in the dropped range go; anything malformed stays for the checks below.
        answer = [i for i in answer if not (type(i) is int and sinks <= i < window_floor)]
    # NOTE: one pass over the answer on the hot path (every branch of every commit); the messages
    # are only built by _refuse, when something is wrong.
    if (type(answer) is list or type(answer) is tuple) and (bound is None or len(answer) <= bound):
        keep = tuple(answer)
        resident = set(resident_indices)
        previous = -1
        for index in keep:
            if type(index) is not int or index <= previous or index >= total:
                break
            if index < num_committed and index not in resident:
                break
            previous = index
        else:
            head = min(sinks, total)
            if head == 0 or (len(keep) >= head and keep[head - 1] == head - 1):
                return keep
    # Not the common form (another Sequence, an int subclass) or a breach: _refuse raises for a breach.
    _refuse(policy, answer, total, resident_indices, num_committed, sinks, bound, what)
    return tuple(int(index) for index in answer)


def _refuse(
    policy: RetentionPolicy, answer: Any, total: int, resident_indices: Sequence[int], num_committed: int,
    sinks: int, bound: int | None, what: str = "",
) -> None:
    """Raise the :class:`SpecError` saying which rule ``answer`` breaks (or return if it breaks none)."""
    where = f"retention policy {type(policy).__name__}.{what or f'history_indices({total})'}"
    if not isinstance(answer, Sequence) or isinstance(answer, (str, bytes, bytearray)):
        raise SpecError(f"{where}: expected a sequence of chunk indices, got {answer!r} ({type(answer).__name__})")
    keep = tuple(answer)
    for position, index in enumerate(keep):
        if not is_int(index):
            raise SpecError(
                f"{where}: expected int chunk indices, got {index!r} ({type(index).__name__}) at position "
                f"{position} of {list(keep)}"
            )
    for a, b in zip(keep, keep[1:]):
        if b <= a:
            problem = f"{a} twice" if a == b else f"{b} after {a}"
            raise SpecError(
                f"{where}: expected strictly ascending indices (sorted, distinct), got {list(keep)} ({problem})"
            )
    if keep and (keep[0] < 0 or keep[-1] >= total):
        raise SpecError(
            f"{where}: expected indices of the chunks it was given, in range({total}), got {list(keep)}"
        )
    resident = set(resident_indices)
    back = [i for i in keep if i < num_committed and i not in resident]
    if back:
        raise SpecError(
            f"{where}: expected a subset of the resident chunks and the new ones "
            f"{sorted(resident) + list(range(num_committed, total))}, got {list(keep)}: {back} already evicted "
            "(a policy may never bring back an evicted chunk)"
        )
    head = min(sinks, total)
    if keep[:head] != tuple(range(head)):
        raise SpecError(
            f"{where}: expected the sink chunks {list(range(head))} first (sink_chunks={sinks}), got {list(keep)}"
        )
    if bound is not None and len(keep) > bound:
        raise SpecError(
            f"{where}: expected at most max_history_chunks={bound} indices (what admission and extents are "
            f"sized for), got {len(keep)}: {list(keep)}"
        )


def retain(
    policy: RetentionPolicy,
    resident: Sequence[Chunk],
    indices: Sequence[int],
    num_committed: int,
    new_chunks: Sequence[Chunk],
    *,
    shot_start: int | None = None,
    window_floor: int = 0,
) -> Retained[Chunk]:
    """Commit ``new_chunks`` after ``num_committed`` chunks and apply ``policy`` (pure).

    ``resident`` / ``indices`` are the chunks now in the history and their commit indices;
    ``shot_start`` / ``window_floor`` the branch's shot and dropped window (:func:`checked_history_indices`).
    Raises :class:`SpecError` if the policy breaks its contract (see :func:`checked_history_indices`):
    e.g. it asks to keep a chunk that was already evicted, or more than it declared.
    """
    total = num_committed + len(new_chunks)
    wanted = set(checked_history_indices(
        policy, total, indices, num_committed, shot_start=shot_start, window_floor=window_floor
    ))
    candidates = list(zip(indices, resident)) + list(zip(range(num_committed, total), new_chunks))
    kept = [(i, c) for i, c in candidates if i in wanted]
    return Retained(
        history=tuple(c for _, c in kept),
        indices=tuple(i for i, _ in kept),
        evicted=tuple(c for i, c in candidates if i not in wanted),
    )


@dataclass(frozen=True)
class SinkWindowPolicy:
    """Which committed chunks stay visible: the first ``sink_chunks`` and the last ``window_chunks``."""

    sink_chunks: int
    window_chunks: int | None

    def __post_init__(self) -> None:
        require_int("SinkWindowPolicy.sink_chunks", self.sink_chunks, minimum=0)
        if self.window_chunks is not None:
            require_int("SinkWindowPolicy.window_chunks", self.window_chunks, minimum=0, what="None or an int")
        # Bounded per chunk here (a chunk holds at least one token); KVCacheSpec bounds the tokens.
        check_index_bound("SinkWindowPolicy", self.sink_chunks, self.max_history_chunks, self._counts)

    def _counts(self) -> str:
        """The two counts as a message words them."""
        if self.window_chunks is None:
            return f"sink_chunks={self.sink_chunks} (window_chunks=None)"
        return f"sink_chunks={self.sink_chunks} + window_chunks={self.window_chunks}"

    @property
    def max_history_chunks(self) -> int | None:
        return None if self.window_chunks is None else self.sink_chunks + self.window_chunks

    def history_indices(self, num_committed: int) -> list[int]:
        """Indices (0-based, in commit order) of the visible chunks among ``num_committed``."""
        sinks = min(self.sink_chunks, num_committed)
        if self.window_chunks is None:
            start = sinks
        else:
            start = max(sinks, num_committed - self.window_chunks)
        return list(range(sinks)) + list(range(start, num_committed))

    @classmethod
    def from_frames(
        cls, *, sink_size: int, local_attn_size: int | None, frames_per_chunk: int,
        independent_first_frame: bool = False,
    ) -> SinkWindowPolicy:
        """The policy equal to Self-Forcing / LongLive's rolling KV buffer, given in frames.

        Their buffer holds ``local_attn_size`` latent frames, the first ``sink_size`` of them never
        evicted, the current chunk included; ``frames_per_chunk`` (``F``, their
        ``num_frame_per_block``) frames per chunk; ``local_attn_size`` ``None`` or ``-1``: no eviction.
        With ``independent_first_frame`` (image-to-video) the first chunk holds 1 frame, every later
        one ``F``. The rolling part (``local_attn_size - sink_size`` frames) then holds whole chunks
        whatever the first chunk's size, so ``window_chunks = (local_attn_size - sink_size) / F - 1``
        in both cases, and ``sink_chunks`` is the number of leading chunks the sink frames fill:
        ``sink_size / F``, or with a 1-frame first chunk ``1 + (sink_size - 1) / F`` (0 for no sink).

        Raises :class:`SpecError` naming expected and actual when the frames do not fall on chunk
        boundaries (a sink or a window that cuts a chunk): no chunk rule equals that buffer, so none
        is returned (keep the closest one and pass the exact rule as ``token_mask``).
        """
        sinks, window = chunks_from_frames(sink_size, local_attn_size, frames_per_chunk, independent_first_frame)
        return cls(sinks, window)

    def visible(self, committed: Sequence[Chunk]) -> list[Chunk]:
        """The visible chunks of a full committed history (the plain-list model)."""
        return [committed[i] for i in self.history_indices(len(committed))]

    def commit(
        self, sinks: Sequence[Chunk], window: Sequence[Chunk], new_chunks: Sequence[Chunk]
    ) -> CommitResult[Chunk]:
        """Append ``new_chunks`` to a resident history and evict what leaves the window.

        ``sinks``/``window`` are the chunks now in the history (as returned by a
        previous commit). New chunks fill the sinks first, then the window; the
        oldest window chunks are evicted once it holds more than ``window_chunks``.
        """
        sinks_out = list(sinks)
        window_out = list(window)
        for chunk in new_chunks:
            if len(sinks_out) < self.sink_chunks:
                sinks_out.append(chunk)
            else:
                window_out.append(chunk)
        evicted: list[Chunk] = []
        if self.window_chunks is not None and len(window_out) > self.window_chunks:
            cut = len(window_out) - self.window_chunks
            evicted, window_out = window_out[:cut], window_out[cut:]
        return CommitResult(tuple(sinks_out), tuple(window_out), tuple(evicted))


def chunks_from_frames(
    sink_size: Any, local_attn_size: Any, frames_per_chunk: Any, independent_first_frame: Any,
    where: str = "SinkWindowPolicy.from_frames",
) -> tuple[int, int | None]:
    """``(sink_chunks, window_chunks)`` of :meth:`SinkWindowPolicy.from_frames` (its checks and messages, naming
    ``where``)."""
    f = require_int(f"{where}.frames_per_chunk", frames_per_chunk, minimum=1)
    s = require_int(f"{where}.sink_size", sink_size, minimum=0)
    i2v = require_bool(f"{where}.independent_first_frame", independent_first_frame)
    if i2v:
        # Chunk 0 is frames [0, 1), chunk j >= 1 frames [1 + (j-1)F, 1 + jF): chunk ends at 1, 1+F, 1+2F, ...
        if s != 0 and (s - 1) % f:
            raise SpecError(
                f"{where}.sink_size: expected whole leading chunks (independent_first_frame: a 1-frame first "
                f"chunk, then {f}-frame chunks, so 0, 1, {1 + f}, {1 + 2 * f}, ... frames), got {s} frames "
                f"(the sink would end inside chunk {1 + (s - 1) // f})"
            )
        sinks = 0 if s == 0 else 1 + (s - 1) // f
    else:
        if s % f:
            raise SpecError(
                f"{where}.sink_size: expected a multiple of frames_per_chunk={f} (whole chunks: 0, {f}, "
                f"{2 * f}, ... frames), got {s} = {s // f} x {f} + {s % f} frames"
            )
        sinks = s // f
    if local_attn_size is None or (is_int(local_attn_size) and local_attn_size == -1):
        return sinks, None  # their -1: global attention, nothing evicted
    size = require_int(f"{where}.local_attn_size", local_attn_size, minimum=1, what="None, -1 or an int")
    rolling = size - s  # frames of the buffer that roll: the window and the current chunk
    if rolling < f:
        raise SpecError(
            f"{where}.local_attn_size: expected at least sink_size + frames_per_chunk = {s + f} (the buffer "
            f"holds the sinks and the current chunk), got {size}"
        )
    if rolling % f:
        below, above = s + rolling // f * f, s + (rolling // f + 1) * f
        raise SpecError(
            f"{where}.local_attn_size: expected sink_size + a multiple of frames_per_chunk={f} (the rolling "
            f"part of the buffer holds whole chunks, the current one included), got {size} = {s} + {rolling} "
            f"frames; the nearest chunk rules: local_attn_size={below} or {above}"
        )
    return sinks, rolling // f - 1


@dataclass(frozen=True)
class SinkWindowMemoryPolicy:
    """Sinks + window, plus every ``memory_every``-th chunk that left the window, the last ``memory_chunks`` of them.

    Long streams keep sparse long-range context at a bounded cost (``S + W + M`` chunks)::

        committed:  c0 | c1 c2 c3 c4 c5 c6 c7 c8 | c9 c10        S=1, W=2, every=3, M=2
                    sink  ^     ^        ^          window
                          memory candidates c1, c4, c7 (every 3rd after the sinks); last M=2: c4, c7

    Chunk ``i >= S`` is a memory candidate when ``(i - S) % memory_every == 0``.
    """

    sink_chunks: int
    window_chunks: int
    memory_every: int
    memory_chunks: int

    def __post_init__(self) -> None:
        for name, minimum in (("sink_chunks", 0), ("window_chunks", 0), ("memory_every", 1), ("memory_chunks", 0)):
            require_int(f"SinkWindowMemoryPolicy.{name}", getattr(self, name), minimum=minimum)
        check_index_bound(
            "SinkWindowMemoryPolicy", self.sink_chunks, self.max_history_chunks,
            lambda: f"sink_chunks={self.sink_chunks} + window_chunks={self.window_chunks} + "
                    f"memory_chunks={self.memory_chunks}",
        )

    @property
    def max_history_chunks(self) -> int:
        return self.sink_chunks + self.window_chunks + self.memory_chunks

    def history_indices(self, num_committed: int) -> list[int]:
        s, every = self.sink_chunks, self.memory_every
        sinks = min(s, num_committed)
        start = max(s, num_committed - self.window_chunks)  # first window chunk
        memory: list[int] = []
        if self.memory_chunks and start > s:
            last = (start - 1 - s) // every  # the newest candidate below the window
            first = max(0, last - self.memory_chunks + 1)
            memory = [s + j * every for j in range(first, last + 1)]
        return list(range(sinks)) + memory + list(range(start, num_committed))
