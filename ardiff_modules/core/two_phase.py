"""The two-phase protocol of a forward with several participants (pure Python).

A forward of a head-grouped cache is one transaction per part; a distributed forward one per rank. Either
finishes all together or not at all, in two phases whose "decide" step is pluggable (:data:`Decide`): a
local ``all()`` over the parts (:func:`decide_locally`), or a vote over the mesh::

    prepare_all   each step prepares, holding its reservation ──> decide ──┬─ go:    keep every reservation
                  (a failing step stops the others: word FAILED)           └─ no-go: roll back every held one
                                                                                     exactly, undo(), raise
    commit_all    each participant checks it can commit ────────> decide ──┬─ go:    commit every one
                  (pure pre-commit checks; a finished one: DONE)   ^       ├─ idle:  every one finished already
                                          SIGINT deferred from here┘       └─ no-go: abort every one, undo(), raise

Once kept, each participant's transaction belongs to its :class:`Coordinator`: committing it alone (a part's
``ForwardContext.commit()``, its session's ``commit_paged_context``, the forward manager's ``finish_forward``) raises
:class:`~ardiff_modules.errors.ParticipantCommitError` with nothing changed (:func:`require_coordinated`),
so the participants' histories cannot drift apart. Aborting one alone stays allowed: history is unchanged,
and the coordinator finds that participant DONE at its finish and aborts the others.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ardiff_modules.core.transaction import Coordinator, deferred_interrupts
from ardiff_modules.errors import ParticipantCommitError

if TYPE_CHECKING:
    from ardiff_modules.core.transaction import ForwardTransaction


class Word(enum.IntEnum):
    """One participant's word in a decision (the int a mesh vote carries; larger is worse)."""

    READY = 0  #: prepared, or checked: it can commit
    DONE = 1  #: its transaction finished already (nothing to commit or abort)
    FAILED = 2  #: its prepare or its pre-commit check failed (or the caller's block raised)


@dataclass(frozen=True)
class Decision:
    """What every participant said: ``(participant, word)`` pairs, here and (for a vote) on every peer."""

    words: tuple[tuple[object, Word], ...]

    @property
    def go(self) -> bool:
        """Every participant is ready: keep / commit."""
        return all(word == Word.READY for _, word in self.words)

    @property
    def idle(self) -> bool:
        """Every participant finished already: nothing to do."""
        return bool(self.words) and all(word == Word.DONE for _, word in self.words)

    @property
    def failed(self) -> tuple[object, ...]:
        """The participants that were not ready."""
        return tuple(who for who, word in self.words if word != Word.READY)

    @property
    def everyone_failed(self) -> bool:
        """No participant was ready (so none changed anything)."""
        return len(self.failed) == len(self.words)


#: This process's ``(participant, word)`` pairs -> the decision of every participant (see the module docstring).
Decide = Callable[[Sequence[tuple[object, Word]]], Decision]


def decide_locally(words: Sequence[tuple[object, Word]]) -> Decision:
    """The local decision: every participant is here, go only if all are ready (``all()``)."""
    return Decision(tuple(words))


def worst(words: Sequence[tuple[object, Word]]) -> Word:
    """This process's word in a vote: the worst of its participants' (``READY`` when it has none)."""
    return max((word for _, word in words), default=Word.READY)


def require_coordinated(transaction: ForwardTransaction, streams: str) -> None:
    """Raise :class:`ParticipantCommitError` when ``transaction`` (over ``streams``, for the message) belongs to
    a :class:`Coordinator` that is not committing it now; changes nothing."""
    coordinator = transaction.coordinator
    if coordinator is None or coordinator.may_commit():
        return
    raise ParticipantCommitError(
        f"commit: expected {coordinator.name} to commit all its participants together (its commit(), its "
        f"session's commit_paged_context, or leaving its with block), got a commit of one participant alone "
        f"(streams {streams}); refused, nothing changed and the forward is still open"
    )


@dataclass(frozen=True)
class Step:
    """One step of :func:`prepare_all`: ``run()`` prepares a participant holding its reservation and returns
    its transaction (``None`` for a step that holds none, e.g. assembling the grouped forward);
    ``abort(transaction)`` rolls it back exactly (the transaction's abort while its reservation is held)."""

    name: object
    run: Callable[[], ForwardTransaction | None]
    abort: Callable[[ForwardTransaction], None] = lambda transaction: None


@dataclass(frozen=True)
class Participant:
    """One participant of :func:`commit_all`: its open (or finished) transaction and how to check, commit and
    abort it. ``check`` runs every pre-commit check (pure when it passes; it may abort the transaction and
    raise); after it passed, ``commit`` cannot fail but for a device error."""

    name: object
    transaction: ForwardTransaction | None
    check: Callable[[ForwardTransaction], None]
    commit: Callable[[ForwardTransaction], None]
    abort: Callable[[ForwardTransaction], None]


def _nothing(decision: Decision | None) -> None:
    return None


def prepare_all(
    coordinator: Coordinator,
    steps: Sequence[Step],
    decide: Decide,
    *,
    undo: Callable[[Decision | None], None] = _nothing,
    refused: Callable[[Decision], BaseException] | None = None,
) -> Decision:
    """Phase one: run ``steps`` in order (the first failure stops the rest), decide, keep or roll back.

    On ``go`` every held transaction keeps its reservation and now belongs to ``coordinator``. Otherwise
    the held ones are rolled back exactly (in reverse order), then ``undo(decision)`` runs (``None`` when
    the decision itself or an interrupt failed: undo everything), and the step's own error is raised, or
    ``refused(decision)`` when this process had none (a peer failed). A ``KeyboardInterrupt`` in a step
    or in ``decide`` rolls back and undoes the same before it propagates.
    """
    held: list[tuple[Step, ForwardTransaction]] = []
    words: list[tuple[object, Word]] = []
    failure: Exception | None = None
    try:
        for step in steps:
            try:
                transaction = step.run()
            except Exception as error:  # noqa: BLE001 -- decided on, then re-raised
                words.append((step.name, Word.FAILED))
                failure = error
                break
            if transaction is not None:
                held.append((step, transaction))
            words.append((step.name, Word.READY))
        decision = decide(words)
    except BaseException:
        _roll_back(held, None, undo)
        raise
    if decision.go:
        for _, transaction in held:
            transaction.join(coordinator)
            transaction.keep_reservation()  # the forward stands: release what it replaced
        return decision
    _roll_back(held, decision, undo)
    if failure is not None:
        raise failure
    assert refused is not None, "a no-go without a local failure needs refused()"
    raise refused(decision)


def _roll_back(
    held: Sequence[tuple[Step, ForwardTransaction]], decision: Decision | None,
    undo: Callable[[Decision | None], None],
) -> None:
    """Roll back every held transaction (the first error raised once all were tried), then ``undo``."""
    first: BaseException | None = None
    for step, transaction in reversed(held):
        try:
            step.abort(transaction)
        except BaseException as error:  # noqa: BLE001 -- keep rolling back the others
            first = first or error
    undo(decision)
    if first is not None:
        raise first


def commit_all(
    participants: Sequence[Participant],
    decide: Decide,
    *,
    failure: BaseException | None = None,
    undo: Callable[[Decision | None], None] = _nothing,
    settle: Callable[[Decision], None] = _nothing,
    refused: Callable[[Decision], BaseException] | None = None,
) -> Decision:
    """Phase two: check every participant, decide, then commit every one or abort every one.

    ``failure``: the caller's block raised (every participant's word is ``FAILED``, nothing is checked).
    From the decision until every participant is committed or aborted, SIGINT is deferred: a Ctrl-C
    cannot split the commits. On ``go`` every open transaction commits (if one raises, the others are
    aborted and the error propagates); when ``idle`` nothing happens; otherwise every open one is aborted,
    ``undo(decision)`` runs, and the error raised is the local one (``failure`` or a failed check), else
    ``refused(decision)``. ``settle(decision)`` runs after every decided outcome, before any raise.
    """
    words, error = _check_words(participants, failure, undo)
    with deferred_interrupts(), contextlib.ExitStack() as stack:
        for coordinator in _coordinators(participants):
            stack.enter_context(coordinator.finishing())
        try:
            decision = decide(words)
            if decision.go:
                for p in participants:
                    if p.transaction is not None and p.transaction.is_open:
                        p.commit(p.transaction)
        except BaseException:
            _abort_open(participants, None, undo)  # committed ones stay committed; no open one is left
            raise
        if not decision.go and not decision.idle:
            _abort_open(participants, decision, undo)
        settle(decision)
    if decision.go or decision.idle:
        return decision
    if error is not None:
        raise error
    assert refused is not None, "a no-go without a local failure needs refused()"
    raise refused(decision)


def _check_words(
    participants: Sequence[Participant], failure: BaseException | None, undo: Callable[[Decision | None], None]
) -> tuple[list[tuple[object, Word]], BaseException | None]:
    """Every participant's word and the local error: ``failure`` -> all FAILED; any finished -> DONE for
    those (the others READY, unchecked: they cannot commit without it); else each checked, stopping at the
    first that fails. A ``KeyboardInterrupt`` in a check aborts every open one and propagates."""
    if failure is not None:
        return [(p.name, Word.FAILED) for p in participants], failure
    done = [p.transaction is None or not p.transaction.is_open for p in participants]
    if any(done):
        return [(p.name, Word.DONE if d else Word.READY) for p, d in zip(participants, done)], None
    words: list[tuple[object, Word]] = []
    try:
        for p in participants:
            assert p.transaction is not None
            try:
                p.check(p.transaction)
            except Exception as error:  # noqa: BLE001 -- decided on, then re-raised
                return words + [(p.name, Word.FAILED)], error
            words.append((p.name, Word.READY))
    except BaseException:
        _abort_open(participants, None, undo)
        raise
    return words, None


def _abort_open(
    participants: Sequence[Participant], decision: Decision | None, undo: Callable[[Decision | None], None]
) -> None:
    """Abort every still open participant (the first error raised once all were tried), then ``undo``."""
    first: BaseException | None = None
    for p in participants:
        if p.transaction is not None and p.transaction.is_open:
            try:
                p.abort(p.transaction)
            except BaseException as error:  # noqa: BLE001 -- keep aborting the others
                first = first or error
    undo(decision)
    if first is not None:
        raise first


def abort_all(participants: Sequence[Participant]) -> None:
    """Abort every still open participant (no decision needed: an abort never needs the others' word)."""
    _abort_open(participants, None, _nothing)


def _coordinators(participants: Sequence[Participant]) -> list[Coordinator]:
    found: dict[int, Coordinator] = {}
    for p in participants:
        coordinator = None if p.transaction is None else p.transaction.coordinator
        if coordinator is not None:
            found.setdefault(id(coordinator), coordinator)
    return list(found.values())
