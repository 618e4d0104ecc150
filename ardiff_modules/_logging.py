"""The package's logging conventions (pure Python: no torch).

Every module logs through ``logging.getLogger(__name__)``, i.e. under the ``ardiff_modules``
logger tree; the library installs no handler and sets no level. Nothing is logged per layer:
host decisions are logged once per forward (DEBUG) or once per process (WARNING).

No ``NullHandler`` is attached to ``ardiff_modules`` on purpose: the only WARNINGs the package
emits (e.g. ``backend="auto"`` falling back to the slow reference backend on a GPU) should reach
users who never configured logging, through Python's last-resort handler (stderr). Silence them
with ``logging.getLogger("ardiff_modules").setLevel(logging.ERROR)``; see the fallback's own fix
(e.g. ``backend="reference"``) to avoid the cause.
"""

from __future__ import annotations

import logging
import threading

__all__ = ["warn_once"]

_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def warn_once(logger: logging.Logger, key: str, msg: str, *args: object) -> bool:
    """Log ``msg % args`` at WARNING on ``logger`` the first time ``(logger, key)`` is seen in this process.

    Thread-safe; returns whether it logged. ``key`` names the distinct reason (one warning per reason,
    not per call site or per object).
    """
    ident = (logger.name, key)
    with _warned_lock:
        if ident in _warned:
            return False
        _warned.add(ident)
    logger.warning(msg, *args)
    return True


def _reset_warn_once() -> None:
    """Forget which warnings were given (tests)."""
    with _warned_lock:
        _warned.clear()
