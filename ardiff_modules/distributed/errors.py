"""Errors of multi-rank runs (pure Python). Both derive from the library's base error and a builtin."""

from __future__ import annotations

from ardiff_modules.errors import ARDiffError


class DistributedForwardError(ARDiffError, RuntimeError):
    """A forward was aborted on every rank because another rank failed to prepare or run it.

    Raised on the ranks whose own work was fine; the failing rank re-raises its own exception.
    Every rank's streams were aborted: history is exactly as before the forward, on every rank.

    Attributes
    ----------
    failed_ranks:
        Global ranks that reported a failure, ascending.
    """

    def __init__(self, message: str, *, failed_ranks: tuple[int, ...]) -> None:
        super().__init__(message)
        self.failed_ranks = failed_ranks


class RankDivergenceError(ARDiffError, RuntimeError):
    """The debug consistency check found ranks whose host-side KV bookkeeping disagrees.

    Attributes
    ----------
    ranks:
        Global ranks whose digest differs from the first rank of their group, ascending.
    """

    def __init__(self, message: str, *, ranks: tuple[int, ...]) -> None:
        super().__init__(message)
        self.ranks = ranks
