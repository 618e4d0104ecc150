"""The open sessions of one cache by id, and the ids of new ones."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

from ardiff_modules.errors import SpecError
from ardiff_modules.session import KVState


class SessionTable:
    """Open sessions by id (one :class:`KVState` per id); ``session-<n>`` ids for unnamed ones."""

    def __init__(self) -> None:
        self._sessions: dict[str, KVState] = {}
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[KVState]:
        return iter(list(self._sessions.values()))

    def as_dict(self) -> dict[str, KVState]:
        return dict(self._sessions)

    def open(self, session_id: str | None, make: Callable[[str], KVState]) -> KVState:
        """Register ``make(id)`` under ``session_id`` (a new ``session-<n>`` when ``None``); refuses an open id."""
        check_session_id(session_id)
        if session_id is None:
            session_id = f"session-{next(self._ids)}"
            while session_id in self._sessions:
                session_id = f"session-{next(self._ids)}"
        if session_id in self._sessions:
            raise SpecError(f"open_session: expected a new session id, got {session_id!r} which is already open")
        state = make(session_id)
        self._sessions[session_id] = state
        return state

    def reopen(self, state: KVState) -> None:
        """Register a closed session again under its id (``KVState.reset``); refuses if another took it."""
        if state.session_id in self._sessions and self._sessions[state.session_id] is not state:
            raise SpecError(
                f"reset: session id {state.session_id!r} was reopened by another session; expected it to be free"
            )
        self._sessions[state.session_id] = state

    def remove(self, state: KVState) -> None:
        if self._sessions.get(state.session_id) is state:
            del self._sessions[state.session_id]


def check_session_id(session_id: str | None) -> None:
    if session_id is not None and (not isinstance(session_id, str) or not session_id):
        raise SpecError(f"open_session: expected a non-empty str session id or None, got {session_id!r}")
