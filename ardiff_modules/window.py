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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, runtime_checkable

from ardiff_modules.checks import require_int
from ardiff_modules.errors import SpecError

Chunk = TypeVar("Chunk")


@dataclass(frozen=True)
class CommitResult(Generic[Chunk]):
    """Resident chunks after a commit, and the chunks it evicted (oldest first)."""

    sinks: tuple[Chunk, ...]
    window: tuple[Chunk, ...]
    evicted: tuple[Chunk, ...]


@runtime_checkable
class RetentionPolicy(Protocol):
    """What stays resident after a commit.

    Contract (property-tested for the policies here): ``visible_indices(n)`` is ascending, within
    ``range(n)``, holds at most ``max_resident_chunks`` indices, always starts with
    ``range(min(sink_chunks, n))``, and is *monotone*: ``visible_indices(n + 1)`` is a subset of
    ``visible_indices(n) + [n]`` (an evicted chunk never comes back, so its pages can be freed).
    """

    @property
    def sink_chunks(self) -> int:
        """Leading chunks never evicted (what ``share_sinks_from`` shares); 0 if none."""

    @property
    def max_resident_chunks(self) -> int | None:
        """Most chunks ever resident at once (``None``: unbounded); sizes extents, admission, buffers."""

    def visible_indices(self, num_committed: int) -> list[int]:
        """Indices (0-based, commit order) of the resident chunks among ``num_committed``."""


@dataclass(frozen=True)
class Retained(Generic[Chunk]):
    """Resident chunks after a commit with their commit indices, and the chunks it evicted."""

    resident: tuple[Chunk, ...]
    indices: tuple[int, ...]
    evicted: tuple[Chunk, ...]


def retain(
    policy: RetentionPolicy,
    resident: Sequence[Chunk],
    indices: Sequence[int],
    num_committed: int,
    new_chunks: Sequence[Chunk],
) -> Retained[Chunk]:
    """Commit ``new_chunks`` after ``num_committed`` chunks and apply ``policy`` (pure).

    ``resident`` / ``indices`` are the currently resident chunks and their commit indices.
    Raises :class:`SpecError` if the policy asks to keep a chunk that was already evicted.
    """
    total = num_committed + len(new_chunks)
    candidates = list(zip(indices, resident)) + list(zip(range(num_committed, total), new_chunks))
    keep = policy.visible_indices(total)
    wanted = set(keep)
    available = {i for i, _ in candidates}
    if not wanted <= available:
        raise SpecError(
            f"{type(policy).__name__}.visible_indices({total}): expected a subset of the resident chunks and the "
            f"new ones {sorted(available)}, got {keep} (a policy may never bring back an evicted chunk)"
        )
    kept = [(i, c) for i, c in candidates if i in wanted]
    return Retained(
        resident=tuple(c for _, c in kept),
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

    @property
    def max_resident_chunks(self) -> int | None:
        return None if self.window_chunks is None else self.sink_chunks + self.window_chunks

    def visible_indices(self, num_committed: int) -> list[int]:
        """Indices (0-based, in commit order) of the visible chunks among ``num_committed``."""
        sinks = min(self.sink_chunks, num_committed)
        if self.window_chunks is None:
            start = sinks
        else:
            start = max(sinks, num_committed - self.window_chunks)
        return list(range(sinks)) + list(range(start, num_committed))

    def visible(self, committed: Sequence[Chunk]) -> list[Chunk]:
        """The visible chunks of a full committed history (the plain-list model)."""
        return [committed[i] for i in self.visible_indices(len(committed))]

    def commit(
        self, sinks: Sequence[Chunk], window: Sequence[Chunk], new_chunks: Sequence[Chunk]
    ) -> CommitResult[Chunk]:
        """Append ``new_chunks`` to a resident history and evict what leaves the window.

        ``sinks``/``window`` are the currently resident chunks (as returned by a
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

    @property
    def max_resident_chunks(self) -> int:
        return self.sink_chunks + self.window_chunks + self.memory_chunks

    def visible_indices(self, num_committed: int) -> list[int]:
        s, every = self.sink_chunks, self.memory_every
        sinks = min(s, num_committed)
        start = max(s, num_committed - self.window_chunks)  # first window chunk
        memory: list[int] = []
        if self.memory_chunks and start > s:
            last = (start - 1 - s) // every  # the newest candidate below the window
            first = max(0, last - self.memory_chunks + 1)
            memory = [s + j * every for j in range(first, last + 1)]
        return list(range(sinks)) + memory + list(range(start, num_committed))
