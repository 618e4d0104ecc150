"""Straight-through history gradients: a read of a committed chunk routes its gradient to the live K/V that the
last forward with gradients wrote for that chunk (``TrainingScope(cache, history_grad="straight_through")``).

Why: Self-Forcing's training rollout writes ``kv_cache["k"][:, a:b] = roped_key`` in the exit step *with*
gradients; the chunk's clean forward then overwrites those slots under ``no_grad``. The values later chunks read
are the clean ones, but autograd's ``CopySlices`` node of the exit step's write still routes the gradient of every
later read of those slots to the exit step's K/V. This module reproduces that routing over the paged cache::

    value read    = clean K/V from the pool            (exactly: clean + 0)
    gradient      -> the recorded live K/V               (clean + (live - live.detach()))

    exit step of chunk c (grad)  : ledger[stream][layer][start_c] = (k_c, v_c)     (replaces an earlier write)
    clean forward of chunk c     : commits the pool copy (no_grad: the ledger is untouched)
    exit step of chunk c+1 (grad): history chunk c reads clean K/V, gradient -> k_c, v_c

As in upstream: reads of chunks never written with gradients in the scope get no gradient; a later
gradient-carrying write of the same chunk replaces the earlier one (and drops the writes recorded at or after its
position: a rewind); a chunk evicted before the read is not read. Writes are keyed by the stream's branch
bookkeeping, its generation (a reset starts a new one) and the chunk's absolute start; a read routes each of its
tokens by absolute position to the write that covers it -- a whole chunk, the kept frames of a trimmed one
(``FrameWindowPolicy``), a content selection's chosen pages (``SelectedFramesPolicy``: copies, read at their own
positions), as a rolling buffer gathered at those slots would.

NOTE: the ledger holds the live K/V of every chunk written with gradients until the scope ends -- the size of the
rollout's K/V, what upstream's own buffer holds -- and each record freezes, per layer, the pieces it routes to, so
a checkpoint recomputation rebuilds the same graph (its values are the same clean K/V).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from ardiff_modules.core.branch import BranchPages
from ardiff_modules.errors import SpecError

#: How a forward with gradients treats the history it reads (see :class:`~ardiff_modules.TrainingScope`).
HistoryGrad = Literal["detached", "straight_through"]
HISTORY_GRADS: tuple[str, ...] = ("detached", "straight_through")


def check_history_grad(owner: str, value: object) -> HistoryGrad:
    """``value`` if it is one of :data:`HISTORY_GRADS`, else :class:`SpecError` naming both."""
    if value not in HISTORY_GRADS:
        raise SpecError(f"{owner}.history_grad: expected one of {HISTORY_GRADS}, got {value!r}")
    return value  # type: ignore[return-value]  # checked just above


@dataclass(frozen=True)
class LiveWrite:
    """The K/V ``[tokens, kv_heads, head_dim]`` (live: they carry gradients) a forward wrote for one chunk."""

    generation: int
    k: torch.Tensor
    v: torch.Tensor


@dataclass(frozen=True)
class LivePiece:
    """A history read routed to a live write: stream ``stream``'s gathered keys ``offset .. offset + len(k)``."""

    stream: int
    offset: int
    k: torch.Tensor
    v: torch.Tensor


class StreamsRead(Protocol):
    """What the ledger reads of a forward's record (``HistoryRead``): its streams and their chunks."""

    #: each stream's branch bookkeeping, and its generation when the forward began
    branches: tuple[BranchPages, ...]
    generations: tuple[int, ...]
    #: per stream, ``(first absolute position, tokens)`` of each pending chunk, in token order
    pending_spans: tuple[tuple[tuple[int, int], ...], ...]

    def exact_spans(self, stream: int) -> Sequence[tuple[int, int]]:
        """``(first absolute position, tokens)`` of each run of ``stream``'s history tokens, in gather order."""
        ...


class LiveWrites:
    """A scope's ledger: per stream (its :class:`BranchPages`), per layer, per chunk start, the last live write."""

    def __init__(self) -> None:
        self._writes: weakref.WeakKeyDictionary[BranchPages, dict[int, dict[int, LiveWrite]]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Live chunk writes recorded (every stream, layer and chunk)."""
        with self._lock:
            return sum(len(chunks) for layers in self._writes.values() for chunks in layers.values())

    def clear(self) -> None:
        """Forget every write (the scope ended)."""
        with self._lock:
            self._writes.clear()

    def record(self, record: StreamsRead, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer ``layer`` of ``record``'s forward wrote ``k``/``v`` ``[streams, seq_len, kv_heads, head_dim]``
        (live) for its pending chunks: each replaces what was recorded at or after the chunk's position."""
        with self._lock:
            for s, branch in enumerate(record.branches):
                generation = record.generations[s]
                chunks = self._writes.setdefault(branch, {}).setdefault(layer, {})
                first = record.pending_spans[s][0][0]
                for start in [p for p, w in chunks.items() if p >= first or w.generation != generation]:
                    del chunks[start]
                at = 0
                for start, tokens in record.pending_spans[s]:
                    chunks[start] = LiveWrite(generation, k[s, at : at + tokens], v[s, at : at + tokens])
                    at += tokens

    def pieces(self, record: StreamsRead, layer: int) -> list[LivePiece]:
        """The live writes ``record``'s history reads of ``layer`` route to: each history token read, at its
        absolute position, to the write of this scope's current generation of its stream that covers it."""
        found: list[LivePiece] = []
        with self._lock:
            for s, branch in enumerate(record.branches):
                chunks = self._writes.get(branch, {}).get(layer, {})
                writes = sorted((p, w) for p, w in chunks.items() if w.generation == record.generations[s])
                offset = 0
                for start, tokens in record.exact_spans(s):
                    found += _covering(s, offset, start, tokens, writes)
                    offset += tokens
        return found


def _covering(
    stream: int, offset: int, start: int, tokens: int, writes: list[tuple[int, LiveWrite]]
) -> list[LivePiece]:
    """The parts of ``writes`` (``(first position, write)``, ascending, disjoint) that a read of positions ``start ..
    start + tokens`` (gathered from ``offset`` on) covers: a run of kept pages lies in one chunk's write, a content
    selection's run of chosen pages may span two."""
    end, found = start + tokens, []
    for first, write in writes:
        lo, hi = max(start, first), min(end, first + write.k.shape[0])
        if lo < hi:
            found.append(LivePiece(stream, offset + lo - start, write.k[lo - first : hi - first],
                                   write.v[lo - first : hi - first]))
    return found


def route_history(history: torch.Tensor, pieces: list[LivePiece], which: int) -> torch.Tensor:
    """``history`` ``[streams, history_keys, kv_heads, head_dim]`` (clean, constant) with the gradient of each
    piece's keys routed to its live K (``which=0``) or V (``1``): ``clean + (live - live.detach())``.

    The values are exactly the clean ones (``x - x`` is 0); ``history`` is returned as is without pieces.
    """
    if not pieces:
        return history
    streams, width = history.shape[:2]
    rest = history.shape[2:]
    rows = []
    for s in range(streams):
        parts, at = [], 0
        for piece in sorted((p for p in pieces if p.stream == s), key=lambda p: p.offset):
            live = (piece.k if which == 0 else piece.v).to(history.dtype)
            if piece.offset > at:
                parts.append(history.new_zeros((piece.offset - at, *rest)))
            parts.append(live - live.detach())
            at = piece.offset + live.shape[0]
        if at < width:
            parts.append(history.new_zeros((width - at, *rest)))
        rows.append(torch.cat(parts))
    return history + torch.stack(rows)
