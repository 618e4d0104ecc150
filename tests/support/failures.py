"""Injected failures: the tests' own exception, a ``BaseException`` that is not an ``Exception``, and the reference
backend whose ``plan()`` raises on demand (the session machine, the re-cache tests, the forward-context tests)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

from ardiff_modules.backends import ReferenceBackend


class Boom(Exception):
    """Injected failure (inside a forward, a commit, a plan or a cross-cache producer)."""


class Halt(BaseException):
    """An injected BaseException that is not an Exception (like a user's own control-flow signal)."""


INTERRUPTS: dict[str, type[BaseException]] = {"boom": Boom, "halt": Halt, "keyboard": KeyboardInterrupt}


@contextmanager
def default_sigint() -> Iterator[None]:
    """Python's own SIGINT handler (``KeyboardInterrupt``) inside the block, the previous disposition after it.

    A test that sends itself SIGINT needs it: a suite started in the background or under ``nohup`` inherits
    SIGINT *ignored* (and spawned ranks inherit that too), so the signal would never arrive. Main thread only.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class FlakyPlanBackend(ReferenceBackend):
    """The reference backend, whose ``plan()`` raises ``fail`` (an exception type) while it is set."""

    def __init__(self) -> None:
        super().__init__()
        self.fail: type[BaseException] | None = None

    def plan(self, *args, **kwargs):  # signature-agnostic on purpose
        if self.fail is not None:
            raise self.fail("injected failure while planning")
        return super().plan(*args, **kwargs)
