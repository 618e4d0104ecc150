"""A retention policy that changes at a commit: one policy until ``at_chunk`` chunks are committed, another after.

Forcing-KV keeps the widest window for every head until the clean re-run of block ``ar_start``, then each head
group's own window (layer 0 never switches). :class:`PhasedPolicy` says that for one group::

    PhasedPolicy(before=SinkWindowPolicy(1, 2), after=SinkWindowPolicy(1, 1), at_chunk=4)

    committed n:    1     2       3          4          5           ...
    answer:       before before before   | after      after
    resident:      c0   c0 c1  c0 c1 c2  | c0 c3      c0 c4
                                          ^ the commit that makes n = at_chunk is the first to apply ``after``

**Boundary.** ``history_indices(n)`` (what stays once ``n`` chunks are committed, so what the forward of chunk
``n`` attends) is ``before``'s answer for ``n < at_chunk`` and ``after``'s for ``n >= at_chunk``: the forward of
chunk ``at_chunk - 1`` (and its commit's re-run, which writes it) still sees ``before``'s set; the forward of
chunk ``at_chunk`` is the first to see ``after``'s. Forcing-KV's switch after block ``ar_start`` is
``at_chunk = ar_start + 1``.

**Only narrows.** ``after``'s answer is restricted to what is still resident: a chunk ``before`` evicted never
comes back (``before``'s answer at ``at_chunk - 1`` is the last it gave), so the contract of
:class:`~ardiff_modules.core.retention.RetentionPolicy` (monotone, checked by ``retain`` at each commit) holds
across the switch whatever the two phases are. An ``after`` narrower than ``before`` (Forcing-KV's groups) is
unchanged by it; a wider one only keeps new chunks in its extra room.

**Frames.** When both phases trim chunks to frames (:class:`~ardiff_modules.core.frame_retention.FrameWindowPolicy`,
or any policy with ``kept_frames`` / ``frames_per_chunk``; the same ``frames_per_chunk``), so does this one:
:meth:`PhasedPolicy.kept_frames` switches at the same commit and is restricted the same way (a frame released
never comes back); a chunk is kept while it holds a kept frame. One phase in frames and one in chunks is refused.

**Declared sizes.** ``max_history_chunks`` is the larger of the phases' bounds (``before``'s capped at the
``at_chunk - 1`` chunks it ever sees: an unbounded ``before`` is fine), ``None`` if ``after`` is unbounded.
``sink_chunks`` is the leading chunks every answer keeps: ``after``'s when ``before`` keeps every chunk it sees
(its sinks cover the ``at_chunk - 1`` chunks), else the smaller of the two (equal phases' sinks: those). It is
not the larger: a sink that only one phase keeps is evicted in the other, and ``retain`` checks that the
declared sinks lead every answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ardiff_modules.checks import require_int
from ardiff_modules.core.frame_retention import trims_frames
from ardiff_modules.core.retention import RetentionPolicy, check_declared, check_index_bound, pins_shots
from ardiff_modules.errors import SpecError


@dataclass(frozen=True)
class PhasedPolicy:
    """``before``'s answers until ``at_chunk`` chunks are committed, ``after``'s (never taking back what
    ``before`` evicted) from then on. Module docstring: the boundary, sizes and frames."""

    before: RetentionPolicy
    after: RetentionPolicy
    at_chunk: int

    def __post_init__(self) -> None:
        owner = "PhasedPolicy"
        require_int(f"{owner}.at_chunk", self.at_chunk, minimum=0)
        for name in ("before", "after"):
            policy = getattr(self, name)
            if not isinstance(policy, RetentionPolicy):
                raise SpecError(
                    f"{owner}.{name}: expected a RetentionPolicy (sink_chunks, max_history_chunks, "
                    f"history_indices), got {type(policy).__name__}"
                )
            check_declared(policy)
            if pins_shots(policy):
                raise SpecError(
                    f"{owner}.{name}: expected a policy without a shot sink, got {type(policy).__name__} (a shot "
                    f"sink moves with the stream's shots, not at a fixed commit)"
                )
        framed = trims_frames(self.before), trims_frames(self.after)
        if framed[0] != framed[1]:
            raise SpecError(
                f"{owner}: expected both phases in chunks or both in frames (kept_frames / frames_per_chunk), got "
                f"before {type(self.before).__name__} ({'frames' if framed[0] else 'chunks'}), after "
                f"{type(self.after).__name__} ({'frames' if framed[1] else 'chunks'})"
            )
        if framed[0] and self.before.frames_per_chunk != self.after.frames_per_chunk:  # type: ignore[attr-defined]
            raise SpecError(
                f"{owner}: expected both phases to count the same frames_per_chunk, got before "
                f"{self.before.frames_per_chunk}, after {self.after.frames_per_chunk}"  # type: ignore[attr-defined]
            )
        check_index_bound(
            owner, self.sink_chunks, self.max_history_chunks,
            lambda: f"before {self.before!r} (until chunk {self.at_chunk}), after {self.after!r}",
        )

    # ------------------------------------------------------------------ declared
    @cached_property
    def _last_before(self) -> frozenset[int]:
        """``before``'s last answer (at ``at_chunk - 1`` chunks): what ``after`` may keep of the older chunks
        (asked once, at the first commit after the switch)."""
        last = self.at_chunk - 1
        return frozenset(self.before.history_indices(last)) if last > 0 else frozenset()

    def _before_keeps_all(self) -> bool:
        """Whether ``before`` keeps every chunk it is ever given (its sinks cover the ``at_chunk - 1``)."""
        return self.at_chunk - 1 <= self.before.sink_chunks

    @property
    def sink_chunks(self) -> int:
        """Leading chunks every answer keeps (module docstring)."""
        if self._before_keeps_all():
            return self.after.sink_chunks
        return min(self.before.sink_chunks, self.after.sink_chunks)

    @property
    def max_history_chunks(self) -> int | None:
        """The larger phase's bound, ``before``'s capped at the ``at_chunk - 1`` chunks it sees."""
        after = self.after.max_history_chunks
        if after is None:
            return None
        seen = max(0, self.at_chunk - 1)
        before = self.before.max_history_chunks
        return max(after, seen if before is None else min(before, seen))

    # ------------------------------------------------------------------ answers
    def history_indices(self, num_committed: int) -> list[int]:
        """``before``'s answer while ``num_committed < at_chunk``, else ``after``'s less what ``before`` evicted
        (and, in frames, less the chunks left without a kept frame)."""
        if num_committed < self.at_chunk:
            return list(self.before.history_indices(num_committed))
        answer = list(self.after.history_indices(num_committed))
        last, kept = self.at_chunk - 1, self._last_before
        if last > 0:
            answer = [i for i in answer if i >= last or i in kept]
        if self.frames_per_chunk is not None:
            answer = [i for i in answer if self.kept_frames(i, num_committed)]
        return answer

    @property
    def frames_per_chunk(self) -> int | None:
        """The phases' ``frames_per_chunk`` when they trim chunks to frames, ``None`` otherwise (then this policy
        keeps whole chunks: ``trims_frames`` is false)."""
        return self.before.frames_per_chunk if trims_frames(self.before) else None  # type: ignore[attr-defined]

    def kept_frames(self, index: int, num_committed: int) -> tuple[int, ...]:
        """Frames (0-based within chunk ``index``) that stay once ``num_committed`` chunks are committed: the
        phase's answer, after the switch less the frames ``before`` had released (frame phases only)."""
        if self.frames_per_chunk is None:
            raise SpecError(
                f"PhasedPolicy.kept_frames: expected phases that trim chunks to frames, got "
                f"{type(self.before).__name__} / {type(self.after).__name__} (whole chunks)"
            )
        if num_committed < self.at_chunk:
            return tuple(self.before.kept_frames(index, num_committed))  # type: ignore[attr-defined]
        frames: Any = self.after.kept_frames(index, num_committed)  # type: ignore[attr-defined]
        last = self.at_chunk - 1
        if index < last:  # the chunk lived through before's commits: what it released stays released
            prior = set(self.before.kept_frames(index, last))  # type: ignore[attr-defined]
            frames = [k for k in frames if k in prior]
        return tuple(frames)

    @property
    def sink_frames(self) -> int | None:
        """Leading frames every answer keeps (what a fork of the sinks alone shares), frame phases only."""
        if self.frames_per_chunk is None:
            return None
        before, after = self.before.sink_frames, self.after.sink_frames  # type: ignore[attr-defined]
        if (self.at_chunk - 1) * self.frames_per_chunk <= before:
            return after  # type: ignore[no-any-return]
        return min(before, after)  # type: ignore[no-any-return]

    @property
    def max_kept_frames(self) -> int | None:
        """Most frames a branch keeps at once (admission), frame phases only: the larger phase's, ``before``'s
        capped at the frames of the ``at_chunk - 1`` chunks it sees; ``None`` when unknown or unbounded."""
        f = self.frames_per_chunk
        if f is None:
            return None
        after = getattr(self.after, "max_kept_frames", None)
        if after is None:
            return None
        seen = max(0, self.at_chunk - 1) * f
        before = getattr(self.before, "max_kept_frames", None)
        return max(after, seen if before is None else min(before, seen))  # type: ignore[no-any-return]
