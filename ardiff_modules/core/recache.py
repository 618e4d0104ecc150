"""Re-cache rules: which chunks a prompt-switch re-cache rebuilds, and how they see each other (pure Python).

A re-cache runs the model once over clean latents of committed chunks under a new prompt and swaps the
K/V it writes in for the old. Peers differ in three choices, which a :class:`RecacheRule` names:

* ``attention`` -- among the rebuilt chunks: ``"block_causal"`` (chunk ``j`` sees rebuilt chunks
  ``0..j``) or ``"bidirectional"`` (every rebuilt chunk sees every other; LongLive's cache path ignores
  the block mask it builds);
* ``context_chunks`` -- how many of the chunks the window most recently evicted are rebuilt too, as
  *context*: attended by the re-cache forward, never kept (LongLive's buffer still holds the chunk the
  next forward evicts, so its re-cache includes it);
* ``sinks`` -- ``"keep"`` (never rebuilt: their K/V stay, visible to every rebuilt chunk), ``"rebuild"``
  (rebuilt with the others, in place), ``"keep_after_slide"`` (rebuilt while the re-cache reaches back
  to them -- nothing but its context evicted yet -- kept once the window slid past: LongLive's
  ``global_sink=True``), ``"move"`` (rebuilt in place until the window slid past them; after that the
  sink slots take the ``sink_chunks`` chunks just before the oldest rebuilt one, rebuilt at their own
  positions: LongLive's ``global_sink=False``).

A branch with ``n`` committed chunks, ``S`` sinks, window ``W`` (sink + window, ``context_chunks=1``)::

    committed:  c0 | c1  c2  c3  c4 | c5  c6  c7         S=1, W=3, n=8
    "keep":     c0 kept;                  c5 c6 c7 rebuilt
    LongLive:   c0 kept;              c4 (context) c5 c6 c7 rebuilt, bidirectional   (global_sink=True)
    "move":     c3 -> sink slot; c4 (context) c5 c6 c7, bidirectional; c0 dropped    (global_sink=False)

The rule only does arithmetic on commit indices (:meth:`RecacheRule.plan`); the branch maps the plan
onto its pages (``core/branch.py``).
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass
from typing import Literal, get_args

from ardiff_modules.checks import is_int
from ardiff_modules.errors import SpecError

RecacheSinks = Literal["keep", "rebuild", "keep_after_slide", "move"]
RECACHE_SINK_MODES: tuple[str, ...] = get_args(RecacheSinks)
RecacheAttention = Literal["block_causal", "bidirectional"]
RECACHE_ATTENTION_MODES: tuple[str, ...] = get_args(RecacheAttention)


@dataclass(frozen=True)
class RecachePlan:
    """One branch's re-cache, in commit indices (pure data).

    ``kept``: history positions kept as they are (the kept sinks: attended, never written).
    ``rebuilt``: commit indices of the rebuilt chunks in forward order (commit order).
    ``replaces``: per rebuilt chunk, the history position whose chunk it replaces on commit, or ``None``
    for a context chunk (attended by the re-cache, its pages released at commit).
    ``moved``: the sink slots take chunks other than the sinks (``"move"`` once the window slid).
    """

    kept: tuple[int, ...]
    rebuilt: tuple[int, ...]
    replaces: tuple[int | None, ...]
    moved: bool = False

    def rebuilds_sinks(self, num_sinks: int) -> bool:
        """Whether a rebuilt chunk lands in one of the first ``num_sinks`` history positions (the sinks)."""
        return any(p is not None and p < num_sinks for p in self.replaces)

    @property
    def num_kept_chunks(self) -> int:
        """Rebuilt chunks that stay in the history after the commit (all but the context)."""
        return sum(p is not None for p in self.replaces)


@dataclass(frozen=True)
class RecacheRule:
    """Which committed chunks a prompt-switch re-cache rebuilds, and how they see each other.

    The default (block-causal, sinks kept, no context) is this library's historical re-cache;
    :meth:`longlive` is LongLive 1.x's ``_recache_after_switch``. See the module docstring.
    """

    attention: RecacheAttention = "block_causal"
    sinks: RecacheSinks = "keep"
    context_chunks: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.attention, str) or self.attention not in RECACHE_ATTENTION_MODES:
            raise SpecError(f"RecacheRule.attention: expected one of {RECACHE_ATTENTION_MODES}, got {self.attention!r}")
        if not isinstance(self.sinks, str) or self.sinks not in RECACHE_SINK_MODES:
            raise SpecError(f"RecacheRule.sinks: expected one of {RECACHE_SINK_MODES}, got {self.sinks!r}")
        if not is_int(self.context_chunks) or self.context_chunks < 0:
            raise SpecError(f"RecacheRule.context_chunks: expected an int >= 0, got {self.context_chunks!r}")

    @classmethod
    def longlive(cls, *, global_sink: bool = True) -> RecacheRule:
        """LongLive 1.x's re-cache after a prompt switch (``InteractiveCausalInferencePipeline``).

        It rebuilds its whole rolling buffer -- the last ``local_attn_size`` frames: sinks, window and the
        chunk the next forward evicts -- in one forward whose cache path attends without a mask
        (bidirectional). ``global_sink=True`` keeps the sinks' K/V once the buffer slid past them (before,
        the buffer starts at frame 0 and they are rebuilt too); ``global_sink=False`` zeroes the cache and
        lets the buffer's first ``sink_size`` frames become the sinks.
        """
        if not isinstance(global_sink, bool):
            raise SpecError(f"RecacheRule.longlive: expected global_sink a bool, got {global_sink!r}")
        return cls("bidirectional", "keep_after_slide" if global_sink else "move", 1)

    @classmethod
    def from_keep_sinks(cls, keep_sinks: bool) -> RecacheRule:
        """The historical ``keep_sinks=`` switch: block-causal, sinks kept or rebuilt, no context."""
        return cls("block_causal", "keep" if keep_sinks else "rebuild", 0)

    def horizon(self, sink_chunks: int) -> int:
        """Evicted chunks a branch must remember (start, length, latents) for this rule to run."""
        return self.context_chunks + (sink_chunks if self.sinks == "move" else 0)

    def plan(
        self, history_index: Sequence[int], num_committed: int, sink_chunks: int, remembered: Set[int],
        window_floor: int = 0,
    ) -> RecachePlan:
        """The re-cache of a branch whose history holds commit indices ``history_index`` (pure).

        ``remembered``: evicted commit indices whose start and length the branch still knows. Raises
        :class:`SpecError` when the rule needs an evicted chunk the branch no longer knows. ``window_floor``:
        the non-sink chunks below it were dropped (``KVState.drop_window``: a shot cut), not evicted -- never
        context, never new sinks, and a window that slid only past them has not slid.
        """
        sink_positions = [p for p, i in enumerate(history_index) if i < sink_chunks]
        resident = set(history_index)
        dropped = window_floor > min(sink_chunks, num_committed)  # drop_window released chunks after the sinks
        evicted = [i for i in range(max(sink_chunks, window_floor), num_committed) if i not in resident]
        context = evicted[len(evicted) - self.context_chunks :] if self.context_chunks else []
        # An evicted chunk older than the context, or a dropped one: the rebuilt chunks no longer reach the sinks.
        slid = len(context) < len(evicted) or dropped
        self._require_known(context, remembered, "context")
        # (commit index, history position it replaces or None): the window / memory chunks, the context.
        entries: list[tuple[int, int | None]] = [(i, p) for p, i in enumerate(history_index) if i >= sink_chunks]
        entries += [(i, None) for i in context]
        kept: tuple[int, ...] = ()
        moved = False
        oldest = min((i for i, _ in entries), default=num_committed)
        new_sinks = range(oldest - len(sink_positions), oldest)
        if self.sinks == "move" and slid and sink_positions and new_sinks.start >= window_floor:
            # The sink slots take the chunks just before the oldest rebuilt one (LongLive: its buffer's head);
            # never dropped ones (a "move" after a drop that would take them keeps the sinks instead).
            self._require_known([i for i in new_sinks if i not in resident], remembered, "new sink")
            entries += list(zip(new_sinks, sink_positions))
            moved = True
        elif self.sinks == "rebuild" or (self.sinks != "keep" and not slid):
            entries += [(history_index[p], p) for p in sink_positions]
        else:
            kept = tuple(sink_positions)
        entries.sort(key=lambda entry: entry[0])
        return RecachePlan(kept, tuple(i for i, _ in entries), tuple(p for _, p in entries), moved)

    @staticmethod
    def _require_known(indices: Sequence[int], remembered: Set[int], what: str) -> None:
        missing = [i for i in indices if i not in remembered]
        if missing:
            raise SpecError(
                f"prepare_recache: expected the branch to remember evicted chunk(s) {missing} (this rule's {what}), "
                "got none: the cache's KVCacheSpec(recache=...) rule remembers fewer evicted chunks; build the "
                "cache with this rule"
            )
