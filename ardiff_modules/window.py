"""Sink + sliding-window policy over a branch's committed chunks (pure Python).

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
from typing import Generic, TypeVar

from ardiff_modules.errors import SpecError

Chunk = TypeVar("Chunk")


@dataclass(frozen=True)
class CommitResult(Generic[Chunk]):
    """Resident chunks after a commit, and the chunks it evicted (oldest first)."""

    sinks: tuple[Chunk, ...]
    window: tuple[Chunk, ...]
    evicted: tuple[Chunk, ...]


@dataclass(frozen=True)
class SinkWindowPolicy:
    """Which committed chunks stay visible: the first ``sink_chunks`` and the last ``window_chunks``."""

    sink_chunks: int
    window_chunks: int | None

    def __post_init__(self) -> None:
        if isinstance(self.sink_chunks, bool) or not isinstance(self.sink_chunks, int) or self.sink_chunks < 0:
            raise SpecError(f"SinkWindowPolicy.sink_chunks: expected an int >= 0, got {self.sink_chunks!r}")
        w = self.window_chunks
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 0):
            raise SpecError(f"SinkWindowPolicy.window_chunks: expected None or an int >= 0, got {w!r}")

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
