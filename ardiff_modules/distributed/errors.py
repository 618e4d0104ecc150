"""Errors of multi-rank runs (pure Python). Both derive from the library's base error and a builtin."""

from __future__ import annotations

from ardiff_modules.errors import ARDiffError


class DistributedForwardError(ARDiffError, RuntimeError):
    """A forward was aborted on every rank because another rank failed to prepare or run it; or a vote's
    collective itself failed (a peer killed, or silent past the mesh's timeout).

    Raised on the ranks whose own work was fine; the failing rank re-raises its own exception.
    Every rank's streams were aborted: history is exactly as before the forward, on every rank.
    When the collective failed, this rank's streams were aborted (no forward left open, the pool as
    before the forward), ``failed_ranks`` is empty, the error is chained (``__cause__``) from the
    collective's, and the mesh's process groups are not usable any more.

    Attributes
    ----------
    failed_ranks:
        Global ranks that reported a failure, ascending (empty: the vote itself failed).
    """

    def __init__(self, message: str, *, failed_ranks: tuple[int, ...]) -> None:
        super().__init__(message)
        self.failed_ranks = failed_ranks


class RankDivergenceError(ARDiffError, RuntimeError):
    """Ranks that disagree: the debug consistency check found host-side KV bookkeeping that differs, or a
    vote found ranks at another vote (another forward: a rank skipped or repeated a call) or preparing a
    forward with other arguments. Raised by a vote on every rank, before anything commits; each rank has
    aborted its streams of the forward (nothing changed where the arguments differed).

    Attributes
    ----------
    ranks:
        Global ranks whose digest (or vote) differs from the first rank of their group, ascending.
    """

    def __init__(self, message: str, *, ranks: tuple[int, ...]) -> None:
        super().__init__(message)
        self.ranks = ranks
