"""Debug check that every rank made the same host-side decisions: one all-gather of two digests.

Allocation, eviction, admission and plans are deterministic functions of the calls a rank made, so
ranks agree without communicating -- as long as every rank made the same calls. This check proves it
(or names who diverged) with one all-gather of two 64-bit digests per rank over the host group:

- ``replica``: everything a rank's bookkeeping holds (session ids, per local branch the token
  offset, committed chunks, resident and pending page ids, open forward, populated cross caches,
  pool counters). Ranks of one mesh row hold the same branches and must match exactly -- their page
  tables are identical.
- ``progress``: what every rank must agree on whatever its branches (session ids and, per session,
  the distinct ``(committed chunks, token offset, pending chunks)`` of its branches, which advance
  together in a distributed forward). Compared over the whole mesh.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ardiff_modules.cache import KVCache
from ardiff_modules.core.head_retention import HeadRetention
from ardiff_modules.distributed.errors import RankDivergenceError
from ardiff_modules.lanes import CacheLane

# torch 2.13 renamed it (same signature); older torch has only the old name.
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class StateDigest:
    """One rank's digests (signed 64-bit, from BLAKE2b: stable across processes, unlike ``hash``)."""

    replica: int
    progress: int


def h64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def describe_state(cache: KVCache) -> tuple[str, str]:
    """The canonical text of ``cache``'s bookkeeping: ``(replica, progress)`` (what the digests hash)."""
    replica: list[str] = [
        f"pages{_lane_label(lane)} used={lane.allocator.num_used} free={lane.allocator.num_free}"
        for lane in cache._lanes
    ]
    progress: list[str] = []
    with cache.lock:
        for sid, state in sorted(cache.sessions.items()):
            replica.append(f"session {sid!r}")
            steps = set()
            for branch in state.kv_branch_names:
                forward = state._open_forward(branch)
                for lane, h in zip(cache._lanes, state._lane_pages(branch)):
                    replica.append(
                        f"  {branch!r}{_lane_label(lane)}: offset={h.token_offset} committed={h.committed_chunks} "
                        f"resident={list(h.history_chunks)} pending={list(h.pending)} extent={list(h.extent)} "
                        f"open={forward.commit_current if forward is not None else None} "
                        f"shot={h.shot_start} floor={h.window_floor}"
                    )
                h = state.branch_pages(branch)
                steps.add((h.committed_chunks, h.token_offset, len(h.pending)))
            replica.append(f"  cross={sorted(state._cross_entries())}")
            progress.append(f"session {sid!r}: {sorted(steps)}")
    return "\n".join(replica), "\n".join(progress)


def _lane_label(lane: CacheLane) -> str:
    """``""`` for a uniform cache's one lane (the text as it always was), else `` lane <layers>x<group>/<heads>h``."""
    return "" if lane.part is None else f" lane {list(lane.part.layers)}x{lane.name}"


def lane_signature(heads: HeadRetention | None) -> str:
    """What equal page tables need of two ranks' retention groups: the same lanes (group, layers, heads per
    layer), whichever head indices they hold."""
    if heads is None:
        return ""
    return ";".join(f"{list(p.layers)}x{p.name}" for p in heads.parts())


def state_digest(cache: KVCache) -> StateDigest:
    """This rank's :class:`StateDigest` (local, no communication)."""
    replica, progress = describe_state(cache)
    return StateDigest(h64(replica), h64(progress))


def check_consistency(
    cache: KVCache, group: dist.ProcessGroup, replica_groups: tuple[tuple[int, ...], ...]
) -> tuple[StateDigest, ...]:
    """All-gather every rank's digest over ``group`` and raise :class:`RankDivergenceError` on a mismatch.

    Parameters
    ----------
    cache:
        This rank's local cache.
    group:
        A CPU (gloo) group over every rank of the mesh.
    replica_groups:
        Global ranks that hold the same branches (mesh rows); their ``replica`` digests must be equal.

    Returns
    -------
    Every rank's digest, in the group's rank order.
    """
    mine = state_digest(cache)
    size = dist.get_world_size(group)
    out = torch.zeros(size, 2, dtype=torch.int64)
    _all_gather_into(out, torch.tensor([[mine.replica, mine.progress]], dtype=torch.int64), group=group)
    digests = tuple(StateDigest(int(r), int(p)) for r, p in out.tolist())
    ranks = dist.get_process_group_ranks(group)
    by_rank = dict(zip(ranks, digests))
    bad = sorted(r for r in ranks if by_rank[r].progress != by_rank[ranks[0]].progress)
    if bad:
        raise RankDivergenceError(
            f"check_consistency: expected every rank at the same sessions / chunk counts / offsets as rank "
            f"{ranks[0]} (progress digest {by_rank[ranks[0]].progress:#x}), got different ones on rank(s) {bad}",
            ranks=tuple(bad),
        )
    for row in replica_groups:
        bad = sorted(r for r in row if by_rank[r].replica != by_rank[row[0]].replica)
        if bad:
            raise RankDivergenceError(
                f"check_consistency: expected ranks {list(row)} (same branches) to hold identical page tables and "
                f"histories (digest {by_rank[row[0]].replica:#x} on rank {row[0]}), got different ones on rank(s) "
                f"{bad}",
                ranks=tuple(bad),
            )
    return digests
