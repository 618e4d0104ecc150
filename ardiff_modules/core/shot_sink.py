"""Multi-shot sinks: a second, movable pinned sink that a scene cut sets (pure Python).

What LongLive 2.0 does (``NVlabs/LongLive`` at ``7860ad9``: ``pipeline/causal_diffusion_inference.py``,
``_is_scene_cut`` / ``_zero_kv_data`` / ``_pin_current_chunk``; ``wan_5b/modules/causal_model.py``,
``CausalWanSelfAttention.forward``, the ``pinned_start`` / ``pinned_len`` / ``effective_sink`` arithmetic)::

    inference: multi_shot_sink: true   -> global_sink_size = sink_size (the first sink_size frames, forever)
    a chunk whose prompt starts with "The scene transitions. " (chunk 0 never) is a scene cut:

      denoising forwards    attend as usual: global sink + shot sink + window + the chunk
      shot_clean_recache    (off by default) before the clean forward: local_end_index = the global sink's
                            end, the pin cleared -- the window *and* the old shot sink are dropped, the
                            global sink kept; global_end_index = the chunk's start (positions run on)
      clean forward         writes the chunk's K/V; attends global sink (+ shot sink + window unless dropped)
      pin                   the chunk's first min(sink_size, chunk frames) frames become the shot sink,
                            replacing the previous one (which is then ordinary window data: the oldest, so
                            the next roll evicts it before anything attends again)

    rolling then never evicts the shot sink until the next cut. The buffer stays local_attn_size frames,
    so the shot sink takes its room from the window: visible = global sink + shot sink + the newest chunks
    that fill the rest (while the shot sink is itself among the newest, nothing changes).

    positions keep running (absolute RoPE at each chunk's own frames; ``multi_shot_rope_offset`` adds
    shot_index * phi frames to the current chunk's query and key positions: the model's RoPE, not the cache's).

In chunks (``F`` frames a chunk, ``sink_size`` a multiple of ``F``): ``sink_chunks = sink_size / F``,
``window_chunks = local_attn_size / F - sink_chunks - 1`` and one pinned chunk (``min(sink_size, F) = F``
frames) -- :meth:`ShotSinkPolicy.from_frames`. With ``S=1, W=2`` and a cut at ``c5``::

    committed:  c0 | c1 c2 c3 c4 c5 c6 c7 c8
    after c4:   c0 |          c3 c4                 (sink + window 2)
    after c5:   c0 |             c4 [c5]            c5 pinned (begin_shot before its commit)
    after c6:   c0 |                [c5] c6         the pin counts against the window: 1 left
    after c8:   c0 |                [c5]       c8
    shot_clean_recache: drop_window() before c5's clean forward -> c5 attends c0 + itself;
    after c5:   c0 |                [c5]            c1..c4 released, offsets unchanged

Here a branch holds its shot as the commit index ``shot_start`` at which it began
(:meth:`~ardiff_modules.core.branch.BranchPages.begin_shot`): the pinned chunks are
``[shot_start, shot_start + shot_chunks)``, those committed. ``max_history_chunks`` stays
``sink_chunks + window_chunks`` (the pin's room comes out of the window), so admission, extents and
buffers sized from it hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from ardiff_modules.checks import require_int
from ardiff_modules.core.retention import SinkWindowPolicy, check_index_bound, chunks_from_frames
from ardiff_modules.errors import SpecError


@dataclass(frozen=True)
class ShotSinkPolicy:
    """Sinks + window, plus the first ``shot_chunks`` chunks of the current shot pinned (LongLive 2.0).

    Without a shot (``shot_start=None``) it is :class:`~ardiff_modules.core.retention.SinkWindowPolicy`.
    With one, the shot's first ``shot_chunks`` committed chunks (after the sinks) are resident whatever their
    age, and the newest other chunks fill the ``window_chunks - (pinned)`` left::

        committed:  c0 | c1 c2 c3 [c4] c5 c6 c7     S=1, W=3, shot_chunks=1, shot_start=4
        resident:   c0 |          [c4]    c6 c7     (4 = S + W chunks)

    ``shot_chunks <= window_chunks`` (the pin lives in the window's room); ``window_chunks=None`` keeps
    every chunk, so a pin changes nothing.
    """

    sink_chunks: int
    window_chunks: int | None
    shot_chunks: int = 1

    def __post_init__(self) -> None:
        require_int("ShotSinkPolicy.sink_chunks", self.sink_chunks, minimum=0)
        if self.window_chunks is not None:
            require_int("ShotSinkPolicy.window_chunks", self.window_chunks, minimum=0, what="None or an int")
        require_int("ShotSinkPolicy.shot_chunks", self.shot_chunks, minimum=0)
        if self.window_chunks is not None and self.shot_chunks > self.window_chunks:
            raise SpecError(
                f"ShotSinkPolicy.shot_chunks: expected at most window_chunks={self.window_chunks} (the shot sink "
                f"takes its room from the window), got {self.shot_chunks}"
            )
        check_index_bound(
            "ShotSinkPolicy", self.sink_chunks, self.max_history_chunks,
            lambda: f"sink_chunks={self.sink_chunks} + window_chunks={self.window_chunks}",
        )

    @property
    def max_history_chunks(self) -> int | None:
        return None if self.window_chunks is None else self.sink_chunks + self.window_chunks

    def history_indices(self, num_committed: int) -> list[int]:
        """Resident chunks among ``num_committed`` with no shot: sinks + the last ``window_chunks``."""
        return SinkWindowPolicy(self.sink_chunks, self.window_chunks).history_indices(num_committed)

    def pinned(self, num_committed: int, shot_start: int | None) -> range:
        """Commit indices the shot beginning at ``shot_start`` pins among ``num_committed`` (sinks excluded)."""
        if shot_start is None:
            return range(0)
        return range(max(shot_start, self.sink_chunks), min(shot_start + self.shot_chunks, num_committed))

    def shot_history_indices(self, num_committed: int, shot_start: int | None) -> list[int]:
        """Resident chunks among ``num_committed`` when the current shot began at commit index ``shot_start``.

        Sinks, the pinned chunks (:meth:`pinned`), then the newest ``window_chunks - shot_chunks`` other non-sink
        chunks (the shot's room is reserved from its first commit, its chunks after the sinks counted: a shot
        beginning inside the sinks reserves only its chunks past them); ascending. Monotone: moving the shot
        never asks back a chunk it evicted.
        """
        pinned = self.pinned(num_committed, shot_start)
        if shot_start is None or self.window_chunks is None or num_committed <= shot_start:
            return self.history_indices(num_committed)  # no shot, or none of its chunks committed yet
        # NOTE: the shot's room is taken whole from its first commit on, not chunk by chunk: a window that shrank
        # as the shot's later chunks arrived would have evicted chunks that a wider window (the shot's first
        # commits) still held -- and taking the room back at the next shot would then ask for them again.
        room = self.window_chunks - len(range(max(shot_start, self.sink_chunks), shot_start + self.shot_chunks))
        rest: list[int] = []
        index = num_committed - 1
        while len(rest) < room and index >= self.sink_chunks:
            if index not in pinned:
                rest.append(index)
            index -= 1
        return list(range(min(self.sink_chunks, num_committed))) + sorted([*pinned, *rest])

    @classmethod
    def from_frames(cls, *, sink_size: int, local_attn_size: int | None, frames_per_chunk: int) -> ShotSinkPolicy:
        """LongLive 2.0's buffer with ``multi_shot_sink`` (``global_sink_size = sink_size``), given in frames.

        As :meth:`SinkWindowPolicy.from_frames` for the sinks and the window (a sink or a window that cuts a
        chunk raises :class:`SpecError` naming expected and actual); the shot sink is the cut chunk's first
        ``min(sink_size, frames_per_chunk)`` frames: one whole chunk when ``sink_size >= frames_per_chunk``,
        none when ``sink_size == 0`` (upstream then never pins).
        """
        sinks, window = chunks_from_frames(
            sink_size, local_attn_size, frames_per_chunk, False, where="ShotSinkPolicy.from_frames"
        )
        shot = 1 if sinks else 0
        if window is not None and window < shot:
            raise SpecError(
                f"ShotSinkPolicy.from_frames.local_attn_size: expected room for the shot sink beside the sinks and "
                f"the current chunk (at least sink_size + 2 x frames_per_chunk = {sink_size + 2 * frames_per_chunk}"
                f" frames), got {local_attn_size}"
            )
        return cls(sinks, window, shot)
