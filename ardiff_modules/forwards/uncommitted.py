"""A stream that never commits keeps no history: say so once per session (issue 40, item 4).

A generation loop commits each chunk with its last forward (``commit_current=True``: the last denoising
step, or a clean pass). Forgetting it raises nothing -- every forward only overwrites the same pending
pages -- so the video silently loses all temporal context. The manager counts, per stream, the forwards
prepared with ``commit_current=False`` since its last commit (:meth:`UncommittedWatch.count`; a commit, seen
as a new ``BranchPages.committed_chunks``, restarts it) and warns once per session when a stream prepares
more than :data:`UNCOMMITTED_FORWARDS_LIMIT` of them in a row::

    forward:   1  2  3  4 | 5  6  7  8 | ...            Self-Forcing: 4 steps, the 4th commits
    count:     1  2  3  0 | 1  2  3  0 | ...            -> never near the limit
    forgotten: 1  2  3  4   5  6  7  8  ...  128  129    -> warns at 129 (once per session)

Host-side only: one integer per stream per forward, no device work. Re-cache forwards always commit and
are not counted; aborted committing forwards neither count nor reset.
"""

from __future__ import annotations

import os
import sys
import warnings
import weakref
from types import FrameType

from ardiff_modules.core.branch import BranchPages
from ardiff_modules.errors import UncommittedForwardsWarning
from ardiff_modules.forwards.request import Build
from ardiff_modules.session import KVState

#: Forwards without a commit a stream may run in a row before its session warns. Above any one chunk's
#: denoising schedule (Self-Forcing and CausVid: 3-4 steps; 50- or 100-step schedules) so a loop that
#: commits never warns, and at 4 steps per chunk it is 32 chunks -- more than a typical sink + window.
UNCOMMITTED_FORWARDS_LIMIT = 128

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class UncommittedWatch:
    """Counts each stream's forwards without a commit and warns once per session past ``limit``.

    :meth:`before` runs before a forward changes anything (a warning an error filter turns into an exception
    then leaves every session and the pool unchanged); :meth:`after` once the forward began.
    """

    def __init__(self, limit: int = UNCOMMITTED_FORWARDS_LIMIT) -> None:
        self.limit = limit
        #: Sessions already warned (weak: a closed, dropped session is forgotten).
        self.warned: weakref.WeakSet[KVState] = weakref.WeakSet()
        #: Per stream: ``(committed_chunks when last counted, forwards without a commit since)``.
        # NOTE: kept here, not on BranchPages (core stays free of diagnostics): a commit shows as a changed
        # committed_chunks (a reset too, unless the stream never committed -- then the count rightly goes on).
        self.counts: weakref.WeakKeyDictionary[BranchPages, tuple[int, int]] = weakref.WeakKeyDictionary()

    def count(self, pages: BranchPages) -> int:
        """Forwards with ``commit_current=False`` the stream ``pages`` began since its last commit."""
        committed, count = self.counts.get(pages, (0, 0))
        return count if committed == pages.committed_chunks else 0

    def before(self, request: Build) -> None:
        """Warn for each session (once) one of whose streams would pass the limit with this forward."""
        if request.commit_current:  # (a re-cache always commits)
            return
        for (state, branch), pages in zip(request.members, request.branches):
            count = self.count(pages)
            if count >= self.limit and state not in self.warned:
                warnings.warn(_message(state, branch, count + 1, self.limit), UncommittedForwardsWarning,
                              stacklevel=_user_stacklevel())
                self.warned.add(state)

    def after(self, request: Build) -> None:
        """The forward began: count it on each of its streams."""
        if request.commit_current:
            return
        for pages in request.branches:
            self.counts[pages] = (pages.committed_chunks, self.count(pages) + 1)


def _message(state: KVState, branch: str, count: int, limit: int) -> str:
    return (
        f"prepare_forward: {state.session_id!r}/{branch!r} reached {count} forwards in a row with "
        f"commit_current=False (more than {limit}): none of them joined its history, so later chunks cannot "
        "attend to them. Pass commit_current=True to the forward that finishes each chunk (the last denoising "
        "step or the clean pass). Warned once per session; if these forwards are meant not to commit, silence it "
        "with warnings.filterwarnings('ignore', category=ardiff_modules.UncommittedForwardsWarning)"
    )


def _user_stacklevel() -> int:
    """``stacklevel`` (for a ``warnings.warn`` in the caller) of the first frame outside this package."""
    frame: FrameType | None = sys._getframe(2)
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
