"""Retention chosen by content: a frame window plus the patches of the leaving frames a score keeps (pure Python).

Forcing-KV's "temporal" heads keep, besides a sink and the last ``Lt`` frames, the sub-frame *patches* of the
frames leaving that window which are least similar to the next frame -- chosen at every commit from the keys,
so the host cannot know them without waiting for the device. :class:`SelectedFramesPolicy` says *where* the
choice is made; the device says *what* is chosen::

    frames_per_chunk F = 3, sink 1, window 1, keep 1 frame of patches (P = 2 patches a frame):
    commit of chunk 2 (frames 6 7 8): candidates = f5 f6 f7 (the frames leaving the window), boundary = f8
        scores: patch p of candidate i vs patch p of frame i + 1 (the next one)   -> keep the 2 best patches
    the forwards of chunk 3 see: f0 | kept patches (copies) | f8 | chunk 3

At the commit of chunk ``n`` (when :meth:`SelectedFramesPolicy.candidates` says so) the branch's *selection*
is replaced: the candidate frames' pages are scored on the device, the chosen ones copied into
``selected_pages`` fresh pages (reserved when the committing forward was prepared) in ascending position order,
and the previous selection's pages released -- one page copy per commit, never per forward; the host learns
the chosen offsets only if it asks (a suspend, a file, a token mask: ``Selection.offsets``). As a
:class:`~ardiff_modules.core.retention.RetentionPolicy` this is its frame window
(:class:`~ardiff_modules.core.frame_retention.FrameWindowPolicy`): the candidates are always resident at the
commit that scores them (the window's last ``T <= Lt`` frames before the chunk, then the chunk's own), so
memory is exactly the sink, the window and ``keep_frames`` frames of patches.

**The candidates** are Forcing-KV's (``dynamic_compression``): for the chunk starting at frame ``s = n F``,
``T = min(window_frames, s - sink_frames)``; none when ``T < 1`` or ``n < select_from``; otherwise the ``F``
frames ``s - T .. s - T + F - 1`` (the ``T`` window frames then the chunk's first ``F - T``) and the *boundary*
frame ``s - T + F`` after them. Early on (``T < window_frames``) some candidates are still window frames: their
selected patches are then attended twice, as Forcing-KV does (the copy is its own page).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ardiff_modules.checks import require_int
from ardiff_modules.core.frame_retention import FrameWindowPolicy
from ardiff_modules.errors import SpecError

#: Scores the candidates' patches (torch side: ``ardiff_modules.selection``): ``(candidates, boundary)`` keys
#: ``[streams, frames, frame_tokens, features]`` and ``[streams, frame_tokens, features]`` -> ``[streams, frames,
#: patches_per_frame]``, higher = keep. ``None``: Forcing-KV's rule (minus the mean cosine to the next frame).
PatchScorer = Callable[[Any, Any], Any]


@dataclass(frozen=True)
class SelectedFramesPolicy:
    """Sink ``sink_frames`` + the last ``window_frames`` frames + ``keep_frames`` frames' worth of patches chosen by
    content from the frames leaving the window at each commit (module docstring).

    ``patches_per_frame`` (``P``): a frame is cut into ``P`` patches of consecutive tokens (whole pages each:
    checked against the cache's geometry); ``keep_frames * P`` patches are kept. ``select_from``: the first chunk
    whose commit selects (Forcing-KV: ``ar_start + 1``). ``score_layer``: the model layer whose keys (this group's
    heads there) score for every layer of the group (Forcing-KV: 1). ``scorer``: see :data:`PatchScorer`.
    """

    sink_frames: int
    window_frames: int
    frames_per_chunk: int
    keep_frames: int
    patches_per_frame: int = 1
    select_from: int = 0
    score_layer: int = 1
    scorer: PatchScorer | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        owner = "SelectedFramesPolicy"
        require_int(f"{owner}.window_frames", self.window_frames, minimum=1)
        require_int(f"{owner}.patches_per_frame", self.patches_per_frame, minimum=1)
        require_int(f"{owner}.keep_frames", self.keep_frames, minimum=0)
        require_int(f"{owner}.select_from", self.select_from, minimum=0)
        require_int(f"{owner}.score_layer", self.score_layer, minimum=0)
        if self.keep_frames > self.frames_per_chunk:
            raise SpecError(
                f"{owner}.keep_frames: expected at most the frames_per_chunk={self.frames_per_chunk} candidate "
                f"frames' worth of patches, got {self.keep_frames}"
            )
        if self.scorer is not None and not callable(self.scorer):
            raise SpecError(f"{owner}.scorer: expected a callable or None, got {type(self.scorer).__name__}")
        self.window  # noqa: B018 -- validates sink / window / frames_per_chunk (FrameWindowPolicy's checks)

    @property
    def window(self) -> FrameWindowPolicy:
        """The sink and window every commit keeps whole: this policy's retention."""
        return FrameWindowPolicy(self.sink_frames, self.window_frames, self.frames_per_chunk)

    # ------------------------------------------------------------------ RetentionPolicy (the frame window's)
    @property
    def sink_chunks(self) -> int:
        return self.window.sink_chunks

    @property
    def window_chunks(self) -> int | None:
        return self.window.window_chunks

    @property
    def max_history_chunks(self) -> int | None:
        return self.window.max_history_chunks

    @property
    def max_kept_frames(self) -> int | None:
        """Frames kept whole at once (the selection's pages are counted apart: :attr:`keep_patches`)."""
        return self.window.max_kept_frames

    def history_indices(self, num_committed: int) -> list[int]:
        return self.window.history_indices(num_committed)

    def kept_frames(self, index: int, num_committed: int) -> tuple[int, ...]:
        return self.window.kept_frames(index, num_committed)

    # ------------------------------------------------------------------ the selection
    @property
    def keep_patches(self) -> int:
        """Patches the selection holds (``keep_frames * patches_per_frame``)."""
        return self.keep_frames * self.patches_per_frame

    def selected_pages(self, pages_per_frame: int) -> int:
        """Pages of one selection (``keep_frames`` frames' worth)."""
        return self.keep_frames * pages_per_frame

    def candidates(self, index: int, floor: int = 0) -> tuple[int, int] | None:
        """``(first candidate frame, boundary frame)`` scored at the commit of chunk ``index`` (absolute frame
        numbers; the candidates are the ``frames_per_chunk`` frames from the first), or ``None``: no selection
        then (the previous one is dropped all the same).

        ``floor``: the first frame the window may hold (a stream whose window was dropped -- ``drop_window`` -- or
        that started from shared sinks holds no frame between its sinks and the floor): the window frames leaving
        are counted from ``max(sink_frames, floor)``, so candidates are always frames the stream holds."""
        if index < self.select_from or not self.keep_frames:
            return None
        start = index * self.frames_per_chunk
        in_window = min(self.window_frames, start - max(self.sink_frames, floor))
        if in_window < 1:
            return None
        first = start - in_window
        return first, first + self.frames_per_chunk


def selecting(policy: object) -> SelectedFramesPolicy | None:
    """The :class:`SelectedFramesPolicy` of ``policy`` (itself, or a phase of a
    :class:`~ardiff_modules.core.phased_retention.PhasedPolicy`), or ``None``: it never selects."""
    if isinstance(policy, SelectedFramesPolicy):
        return policy
    for phase in ("after", "before"):
        inner = getattr(policy, phase, None)
        found = selecting(inner) if inner is not None else None
        if found is not None:
            return found
    return None


def selection_pages_of(policy: object, pages_per_chunk: int) -> int:
    """Pages one selection of ``policy`` holds in a lane of ``pages_per_chunk`` pages a chunk (``0``: it never
    selects): what admission, fixed plan buffers and a file's header count."""
    selected = selecting(policy)
    return selected.selected_pages(pages_per_chunk // selected.frames_per_chunk) if selected is not None else 0


def candidates_at(policy: object, index: int, floor: int = 0) -> tuple[int, int] | None:
    """:meth:`SelectedFramesPolicy.candidates` of the phase of ``policy`` that the commit of chunk ``index`` runs
    under (a phased policy's ``after`` once that commit makes ``at_chunk`` chunks), ``None`` for any other policy.
    ``floor``: the first frame the window may hold (see :meth:`SelectedFramesPolicy.candidates`)."""
    if isinstance(policy, SelectedFramesPolicy):
        return policy.candidates(index, floor)
    at = getattr(policy, "at_chunk", None)
    if isinstance(at, int):
        phase = policy.after if index + 1 >= at else policy.before  # type: ignore[attr-defined]
        return candidates_at(phase, index, floor)
    return None


def check_selection_geometry(owner: str, policy: object, pages_per_frame: int) -> None:
    """:class:`SpecError` unless a selecting policy's patches are whole pages of a frame."""
    selected = selecting(policy)
    if selected is None:
        return
    patches = selected.patches_per_frame
    if pages_per_frame % patches:
        raise SpecError(
            f"{owner}: expected a frame's {pages_per_frame} page(s) to split into patches_per_frame={patches} "
            f"patches of whole pages (a patch is a run of pages), got {pages_per_frame / patches:g} pages a patch"
        )
