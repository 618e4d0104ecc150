"""Retention finer than a chunk: a sink and a window counted in *frames* (pure Python).

A video DiT's chunk is several latent frames (Self-Forcing: 3). Forcing-KV's published configurations keep
"the sink frame + the last frame" for every head: one frame of each chunk around it, not whole chunks.
:class:`FrameWindowPolicy` says which frames of a branch's committed history stay; the branch keeps its
chunks as the unit of everything else (commit indices, offsets, kept latents, re-cache plans, the stream's
clock in every lane) and *trims* a resident chunk down to the pages of its kept frames::

    frames_per_chunk F = 3, sink_frames 1, window_frames 1; after 3 commits (frames 0..8):

    chunk 0: [f0 f1 f2]  -> [f0]        the sink frame (pages of f1, f2 released)
    chunk 1: [f3 f4 f5]  -> evicted     (no kept frame)
    chunk 2: [f6 f7 f8]  -> [f8]        the last frame
    visible to the next forward: f0 f8 + the pending chunk (whole)

A trimmed chunk keeps its commit index and its original start; :class:`Kept` remembers how many pages it
was written with and which of them it still holds, so positions (RoPE of relative sinks, masks, the dense
oracle) and a re-cache (which rebuilds it whole, then trims it the same way) stay exact. At chunk level the
policy is sink + window (:meth:`FrameWindowPolicy.history_indices`): every chunk with a kept frame, so
``retain``'s contract and every capability built on it hold unchanged. Kept frames only ever shrink as
the history grows (a frame that left the window never comes back), so trimming only ever releases pages.

Frames are counted by commit index (chunk ``i`` holds frames ``i F .. i F + F - 1``): every committed chunk
must be a whole chunk of ``F`` frames (the forward validation refuses shorter chunks in a frame lane).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from ardiff_modules.checks import require_int
from ardiff_modules.core.retention import Retained, check_index_bound
from ardiff_modules.errors import SpecError


class Kept(NamedTuple):
    """A trimmed history chunk: the pages it was written with (``full``), and the offsets among them it holds."""

    full: int
    offsets: tuple[int, ...]


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class FrameWindowPolicy:
    """The first ``sink_frames`` frames of a branch and the last ``window_frames`` after them (``None``: all).

    ``frames_per_chunk`` is the chunk's frame count (``KVCacheSpec.chunk_size`` must split into that many
    frames of whole pages). As a :class:`~ardiff_modules.core.retention.RetentionPolicy` it keeps every chunk
    holding a kept frame: ``ceil(sink_frames / F)`` sink chunks and ``ceil(window_frames / F)`` window chunks;
    :meth:`kept_frames` trims each of them to its kept frames at every commit.
    """

    sink_frames: int
    window_frames: int | None
    frames_per_chunk: int

    def __post_init__(self) -> None:
        require_int("FrameWindowPolicy.sink_frames", self.sink_frames, minimum=0)
        if self.window_frames is not None:
            require_int("FrameWindowPolicy.window_frames", self.window_frames, minimum=0, what="None or an int")
        require_int("FrameWindowPolicy.frames_per_chunk", self.frames_per_chunk, minimum=1)
        check_index_bound(
            "FrameWindowPolicy", self.sink_chunks, self.max_history_chunks,
            lambda: f"sink_frames={self.sink_frames} + window_frames={self.window_frames} "
                    f"(frames_per_chunk={self.frames_per_chunk})",
        )

    @property
    def sink_chunks(self) -> int:
        """Leading chunks holding a sink frame (never evicted; the last one may be trimmed)."""
        return _ceil(self.sink_frames, self.frames_per_chunk)

    @property
    def window_chunks(self) -> int | None:
        """Trailing chunks holding a window frame (the oldest may be trimmed)."""
        return None if self.window_frames is None else _ceil(self.window_frames, self.frames_per_chunk)

    @property
    def max_history_chunks(self) -> int | None:
        window = self.window_chunks
        return None if window is None else self.sink_chunks + window

    @property
    def max_kept_frames(self) -> int | None:
        """Most frames a branch keeps at once (the sink and the window frames; ``None``: unbounded)."""
        return None if self.window_frames is None else self.sink_frames + self.window_frames

    def history_indices(self, num_committed: int) -> list[int]:
        """Commit indices of the chunks holding a kept frame among ``num_committed`` (sink + window in chunks)."""
        sinks = min(self.sink_chunks, num_committed)
        window = self.window_chunks
        start = sinks if window is None else max(sinks, num_committed - window)
        return list(range(sinks)) + list(range(start, num_committed))

    def kept_frames(self, index: int, num_committed: int) -> tuple[int, ...]:
        """Frames (0-based within chunk ``index``) that stay once ``num_committed`` chunks are committed."""
        f = self.frames_per_chunk
        first = index * f
        if self.window_frames is None:
            return tuple(range(f))
        window_start = max(self.sink_frames, num_committed * f - self.window_frames)
        return tuple(k for k in range(f) if first + k < self.sink_frames or first + k >= window_start)


def trims_frames(policy: object) -> bool:
    """Whether ``policy`` trims chunks to frames (a :class:`FrameWindowPolicy`, or one with ``kept_frames``)."""
    return callable(getattr(policy, "kept_frames", None)) and isinstance(getattr(policy, "frames_per_chunk", None), int)


def check_frame_geometry(owner: str, policy: object, chunk_size: int, page_size: int) -> None:
    """:class:`SpecError` unless a frame policy's chunk splits into ``frames_per_chunk`` frames of whole pages."""
    if not trims_frames(policy):
        return
    f = policy.frames_per_chunk  # type: ignore[attr-defined]
    if chunk_size % f or (chunk_size // f) % page_size:
        raise SpecError(
            f"{owner}: expected chunk_size={chunk_size} to split into frames_per_chunk={f} frames of whole pages "
            f"(page_size={page_size}), got {chunk_size / f:g} tokens a frame"
        )


def page_runs(offsets: tuple[int, ...]) -> list[tuple[int, int]]:
    """``(first offset, pages)`` of each run of consecutive page offsets (a trimmed chunk's contiguous pieces)."""
    runs: list[tuple[int, int]] = []
    for offset in offsets:
        if runs and runs[-1][0] + runs[-1][1] == offset:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((offset, 1))
    return runs


def sink_offsets(policy: object, index: int, pages_per_frame: int) -> tuple[int, ...]:
    """Page offsets (within chunk ``index``) of its sink frames: what a fork of the sinks alone shares."""
    f, sinks = policy.frames_per_chunk, policy.sink_frames  # type: ignore[attr-defined]
    return tuple(k * pages_per_frame + p for k in range(f) if index * f + k < sinks for p in range(pages_per_frame))


def kept_offsets(policy: object, index: int, num_committed: int, pages_per_frame: int) -> tuple[int, ...]:
    """Page offsets (within chunk ``index``, as written) of the frames ``policy`` keeps."""
    frames = policy.kept_frames(index, num_committed)  # type: ignore[attr-defined]
    return tuple(k * pages_per_frame + p for k in frames for p in range(pages_per_frame))


def trim_chunk(
    chunk: tuple[int, ...], kept: Kept | None, offsets: tuple[int, ...]
) -> tuple[tuple[int, ...], Kept | None, tuple[int, ...]]:
    """``(chunk, its Kept, released pages)`` once ``chunk`` (``kept``: its current trim, ``None``: whole) holds
    only what it holds of ``offsets``: kept offsets only shrink (an offset already released -- or never
    shared, for a fork of the sinks alone -- is not asked back)."""
    full = len(chunk) if kept is None else kept.full
    held = tuple(range(full)) if kept is None else kept.offsets
    if len(offsets) == full:
        return chunk, kept, ()
    want = set(offsets)
    pages = tuple(p for o, p in zip(held, chunk) if o in want)
    released = tuple(p for o, p in zip(held, chunk) if o not in want)
    return pages, Kept(full, tuple(o for o in held if o in want)), released


def trim_retained(
    result: Retained[tuple[int, ...]], held: Mapping[int, Kept | None], policy: object, committed: int,
    pages_per_frame: int,
) -> Retained[tuple[int, ...]]:
    """``result`` (a commit's :func:`~ardiff_modules.core.retention.retain`) with each kept chunk trimmed to its kept
    frames once ``committed`` chunks are committed (``held``: each chunk's current trim by commit index); the
    released pages join ``evicted`` (one allocator call releases both)."""
    chunks: list[tuple[int, ...]] = []
    kept: list[Kept | None] = []
    released: list[tuple[int, ...]] = []
    for index, chunk in zip(result.indices, result.history):
        pages, trim, gone = trim_chunk(chunk, held.get(index), kept_offsets(policy, index, committed, pages_per_frame))
        chunks.append(pages)
        kept.append(trim)
        if gone:
            released.append(gone)
    return Retained(tuple(chunks), result.indices, result.evicted + tuple(released), tuple(kept))
