"""User retention policies for the tests (no library logic): a valid custom one, a misbehaving wrapper, and
the contract written independently as a predicate.

* :class:`EvenMemoryPolicy` -- a policy a user could write: the sinks, the newest chunk and the last
  ``evens`` even-indexed chunks; bounded, monotone, not one of the shipped policies.
* :class:`Misbehaving` -- wraps a valid policy and, once armed, breaks the contract in one way
  (:data:`BAD_KINDS`) at its ``on_call``-th answer, then behaves again.
* :func:`contract_holds` -- whether an answer of ``history_indices`` keeps the contract of
  ``ardiff_modules.core.retention.RetentionPolicy`` (list operations, not the library's checker).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ardiff_modules.core.retention import RetentionPolicy

#: Ways :class:`Misbehaving` breaks the contract (the first 14 change the answer, ``declared`` the declaration).
BAD_KINDS = (
    "negative", "str", "float", "bool", "none", "set", "string", "unsorted", "duplicate", "resurrect", "too_many",
    "not_offered", "no_sinks", "raises", "declared",
)
#: A substring of the SpecError message each kind must produce (the expected or the actual value).
BAD_MESSAGES = {
    "negative": "in range(",
    "str": "(str) at position",
    "float": "(float) at position",
    "bool": "(bool) at position",
    "none": "got None (NoneType)",
    "set": "(set)",
    "string": "(str)",
    "unsorted": "strictly ascending",
    "duplicate": "twice",
    "resurrect": "never bring back an evicted chunk",
    "too_many": "expected at most max_history_chunks=",
    "not_offered": "in range(",
    "no_sinks": "first (sink_chunks=",
    "raises": "TypeError: a bug in the user's policy",
    "declared": "max_history_chunks: expected None or an int >= 0, got -1",
}


@dataclass(frozen=True)
class EvenMemoryPolicy:
    """The first ``sink_chunks``, the newest chunk and the last ``evens`` even-indexed chunks after the sinks::

        committed: c0 | c1 c2 c3 c4 c5      sink 1, evens 2 -> c0 c2 c4 c5 (4 = 1 + 2 + 1 resident)
    """

    sink_chunks: int
    evens: int

    @property
    def max_history_chunks(self) -> int:
        return self.sink_chunks + self.evens + 1

    def history_indices(self, num_committed: int) -> list[int]:
        sinks = min(self.sink_chunks, num_committed)
        evens = [i for i in range(sinks, num_committed) if i % 2 == 0]
        keep = set(range(sinks)) | set(evens[len(evens) - self.evens :] if self.evens else ())
        if num_committed > sinks:
            keep.add(num_committed - 1)
        return sorted(keep)


class Misbehaving:
    """``base``'s answers until :meth:`arm`; then its ``on_call``-th answer breaks the contract as ``kind`` says.

    ``resident`` / ``committed`` (given to :meth:`arm`) are the branch's resident commit indices and chunks
    committed before the failing commit: ``resurrect`` and ``too_many`` need them to break exactly one rule.
    A kind that cannot apply to this answer (``unsorted`` of one index, nothing evicted yet) falls back to
    ``not_offered``; :attr:`applied` says which kind was used.
    """

    def __init__(self, base: RetentionPolicy) -> None:
        self.base = base
        self.kind: str | None = None
        self.applied: str | None = None
        self.calls = 0
        self.on_call = 1
        self.history: tuple[int, ...] = ()
        self.committed = 0
        self.floor = 0

    def arm(self, kind: str, *, resident: Sequence[int], committed: int, on_call: int = 1, floor: int = 0) -> None:
        """``floor``: the branch's ``window_floor`` (chunks it dropped: asking for one is no breach)."""
        assert kind in BAD_KINDS, kind
        self.kind, self.applied, self.calls, self.on_call = kind, None, 0, on_call
        self.history, self.committed, self.floor = tuple(resident), committed, floor

    def disarm(self) -> None:
        self.kind = None

    @property
    def sink_chunks(self) -> int:
        return self.base.sink_chunks

    @property
    def max_history_chunks(self) -> Any:
        if self.kind == "declared":
            self.applied = "declared"
            return -1
        return self.base.max_history_chunks

    def history_indices(self, num_committed: int) -> Any:
        return self._answer(num_committed, list(self.base.history_indices(num_committed)))

    def shot_history_indices(self, num_committed: int, shot_start: int | None) -> Any:
        """A shot policy's answer (``ShotSinkPolicy``), broken the same way."""
        return self._answer(num_committed, list(self.base.shot_history_indices(num_committed, shot_start)))

    def _answer(self, num_committed: int, good: list[int]) -> Any:
        if self.kind is None or self.kind == "declared":
            return good
        self.calls += 1
        if self.calls != self.on_call:
            return good
        return self._break(self.kind, num_committed, good)

    def _break(self, kind: str, n: int, good: list[int]) -> Any:
        sinks = min(self.base.sink_chunks, n)
        dropped = range(self.base.sink_chunks, self.floor)
        evicted = [i for i in range(self.committed) if i not in self.history and i not in dropped]
        offered = sorted(set(self.history) | set(range(self.committed, n)))
        bound = self.base.max_history_chunks
        # The library takes a dropped chunk (window floor) out of an answer before checking it (retention.py,
        # checked_history_indices): a breach made only of dropped chunks is no breach there.
        kept = [i for i in good if i not in dropped]
        applies = {
            "unsorted": len(kept) >= 2,
            "duplicate": len(kept) >= 1,
            "resurrect": bool(evicted),
            "too_many": bound is not None and len(offered) > bound,
            "no_sinks": sinks >= 1,
        }
        if not applies.get(kind, True):
            kind = "not_offered"
        self.applied = kind
        last = good[-1] if good else 0
        if kind == "negative":
            return [-1, *good]
        if kind == "str":
            return [*good[:-1], str(last)]
        if kind == "float":
            return [*good[:-1], last + 0.5]
        if kind == "bool":
            return [*good[:-1], True]
        if kind == "none":
            return None
        if kind == "set":
            return set(good)
        if kind == "string":
            return "".join(map(str, good))
        if kind == "unsorted":
            return good[::-1]
        if kind == "duplicate":
            return [*good, kept[-1]]
        if kind == "resurrect":
            return sorted([*good, evicted[-1]])
        if kind == "too_many":
            return offered
        if kind == "no_sinks":
            return good[1:]
        if kind == "raises":
            raise TypeError("a bug in the user's policy")
        assert kind == "not_offered", kind
        return [*good, n]


def contract_holds(
    answer: Any, total: int, resident: Sequence[int], committed: int, sinks: int, bound: int | None
) -> bool:
    """Whether ``answer`` (of ``history_indices(total)``) keeps the contract, written with list operations."""
    if not isinstance(answer, (list, tuple, range)):
        return False
    items = list(answer)
    if any(type(i) is not int for i in items):
        return False
    offered = set(resident) | set(range(committed, total))
    return (
        items == sorted(set(items))
        and set(items) <= offered
        and items[: min(sinks, total)] == list(range(min(sinks, total)))
        and (bound is None or len(items) <= bound)
    )
