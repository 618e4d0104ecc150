"""Admission with a host tier: which idle sessions to suspend so that one more session fits.

``KVCache.admit_session(suspend_idle=...)`` asks :meth:`HostTier.suspend_idle
<ardiff_modules.host.tier.HostTier.suspend_idle>`, which plans here before anything moves: the least recently
used idle sessions, one more at a time, until the device pages only they reference (a page a resident fork
shares stays) would let one more session fit at its peak -- in every lane of the cache (a retention group's
lane fills on its own), contiguous runs included::

    idle, LRU first:  [b, d, a]   ->  {b}: lane 0 fits, lane 1 not  ->  {b, d}: both fit  ->  suspend b, d
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Sequence

from ardiff_modules.errors import SpecError
from ardiff_modules.host.extent_room import extent_room
from ardiff_modules.lanes import CacheLane
from ardiff_modules.session import KVState


def candidates(what: str, sessions: Iterable[KVState], chosen: bool | Iterable[KVState]) -> list[KVState]:
    """The sessions a suspension may take: every open one (``True``) or the given ones, checked (sessions of
    this cache, open)."""
    open_now = list(sessions)
    if chosen is True:
        return open_now
    if isinstance(chosen, (bool, KVState)) or not isinstance(chosen, Iterable):
        raise SpecError(f"{what}: expected True, False or an iterable of this cache's sessions, got {chosen!r}")
    given = list(dict.fromkeys(chosen))
    foreign = [s for s in given if not isinstance(s, KVState) or s not in open_now]
    if foreign:
        raise SpecError(
            f"{what}: expected open sessions of this KVCache, got {[getattr(s, 'session_id', s) for s in foreign]}"
        )
    return given


def is_idle(state: KVState, suspended: Collection[KVState]) -> bool:
    """Resident, no open forward and no pending chunk on any branch."""
    if state in suspended:
        return False
    names = state.kv_branch_names
    return not any(
        state._open_forward(n) is not None or any(b.pending for b in state._lane_pages(n)) for n in names
    )


def fits_after(
    lanes: Sequence[CacheLane], resident: Sequence[KVState], chosen: Sequence[KVState], pending_chunks: int,
    recache: bool,
) -> bool:
    """Whether one more session fits at its peak in every lane once ``chosen`` (resident sessions) are suspended."""
    staying = [s for s in resident if s not in chosen]
    for lane in lanes:
        alloc, i = lane.allocator, lane.index
        branches = [s._lane_pages(n)[i] for s in chosen for n in s.kv_branch_names]
        # NOTE: every reference the chosen sessions hold (a history page inside a contiguous extent is held
        # twice: by the extent and by its chunk); a page is freed when they hold all of its.
        refs = Counter(p for b in branches for p in b.referenced_pages())
        freed = {p for p, n in refs.items() if alloc.refcount(p) == n}
        # NOTE: with contiguous extents the freed pages must also leave runs long enough for the new extents.
        room = extent_room(alloc, lane.admission, staying, freed, lane=i)
        n = len(freed)
        fit = lane.admission.sessions_that_fit(
            alloc.num_free + n, alloc.num_used - n, len(staying), room, pending_chunks, recache
        )
        if fit < 1:
            return False
    return True


def choose(
    lanes: Sequence[CacheLane], resident: Sequence[KVState], idle: Sequence[KVState], pending_chunks: int,
    recache: bool,
) -> list[KVState] | None:
    """``[]`` when one more session fits already; else the shortest prefix of ``idle`` (LRU first) whose
    suspension makes room in every lane; ``None`` when suspending every idle session would not."""
    for k in range(len(idle) + 1):
        if fits_after(lanes, resident, idle[:k], pending_chunks, recache):
            return list(idle[:k])
    return None


def history_pages(lanes: Sequence[CacheLane], chosen: Sequence[KVState]) -> list[int]:
    """Per lane, the distinct history pages ``chosen`` hold: what their suspension copies at most (a ring's free
    slot stays)."""
    return [
        len({p for s in chosen for n in s.kv_branch_names for p in s._lane_pages(n)[lane.index].history_pages()})
        for lane in lanes
    ]
