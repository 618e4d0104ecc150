"""A re-cache with retention groups: the rule planned per lane, one forward over the union (pure, host only).

Each lane plans the rule over its own branch pages (its group's policy keeps other chunks). The forward rebuilds
the *union* of the lanes' rebuilt chunks, in commit order; in each lane, every union chunk is::

    rebuilt by the lane's own plan      -> replaces what the plan says (a slot, or context: released at commit)
    a kept sink of the lane             -> rebuilt in place (one K/V per chunk per forward: the lane's heads
                                           would otherwise see the chunk twice, old and new)
    anything else                       -> a context chunk of the lane: attended per the rule, released at commit

so every head of every rebuilt chunk sees its group's kept sinks and the rebuilt chunks the rule shows. The
positions of a union chunk are the stream's (one clock): taken from whichever lane still knows the chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ardiff_modules.core.branch import BranchPages
from ardiff_modules.core.recache import RecachePlan, RecacheRule
from ardiff_modules.errors import SequenceLengthError, SpecError
from ardiff_modules.forwards.validation import stream_recache_plan
from ardiff_modules.session import KVState


@dataclass(frozen=True)
class LaneRecache:
    """A validated re-cache over lanes: per lane each member's plan (over the union), per member the union's
    commit indices and absolute starts, and the pages of each union chunk (the same for every member)."""

    plans: tuple[tuple[RecachePlan, ...], ...]
    rebuilt: tuple[tuple[int, ...], ...]
    starts: tuple[tuple[int, ...], ...]
    chunk_pages: tuple[int, ...]


def lane_recache_plans(
    members: Sequence[tuple[KVState, str]], lane_branches: Sequence[Sequence[BranchPages]], rule: RecacheRule,
    *, idle: bool = True,
) -> LaneRecache:
    """Plan ``rule`` in every lane and extend each lane's plan to the union (see the module docstring).

    Raises like :func:`~ardiff_modules.forwards.validation.recache_plans`: a stream not idle, nothing resident to
    rebuild in any lane, batched streams whose union chunks differ in length.
    """
    per_lane = [
        [stream_recache_plan(state, branch, h, rule, idle) for (state, branch), h in zip(members, branches)]
        for branches in lane_branches
    ]
    rebuilt, starts, shapes = [], [], []
    lanes_plans: list[list[RecachePlan]] = [[] for _ in lane_branches]
    for s, (state, branch) in enumerate(members):
        own = [per_lane[lane][s] for lane in range(len(lane_branches))]
        union = tuple(sorted({i for plan in own for i in plan.rebuilt}))
        known = [_chunk_of(i, [branches[s] for branches in lane_branches]) for i in union]
        extended = [_extend(plan, union, branches[s]) for plan, branches in zip(own, lane_branches)]
        if not any(plan.num_kept_chunks for plan in extended):
            counts = [len(branches[s].history) for branches in lane_branches]
            raise SpecError(
                f"prepare_recache: expected at least one resident chunk to rebuild on {state.session_id!r}/{branch!r} "
                f"({rule}) in some lane, got resident chunk counts {counts} per lane, none rebuilt"
            )
        for plans, plan in zip(lanes_plans, extended):
            plans.append(plan)
        rebuilt.append(union)
        starts.append(tuple(start for start, _ in known))
        shapes.append(tuple(pages for _, pages in known))
    if len(set(shapes)) != 1:
        page = lane_branches[0][0].page_size
        got = {f"{s.session_id}/{b}": [n * page for n in shape] for (s, b), shape in zip(members, shapes)}
        raise SequenceLengthError(
            f"prepare_recache: expected every stream to rebuild chunks of the same lengths (one launch), got "
            f"token lengths {got} (the union over retention groups); re-cache them in separate calls"
        )
    return LaneRecache(tuple(tuple(p) for p in lanes_plans), tuple(rebuilt), tuple(starts), shapes[0])


def _chunk_of(index: int, lanes: Sequence[BranchPages]) -> tuple[int, int]:
    """``(absolute start, pages)`` of committed chunk ``index`` from the first lane that still knows it."""
    for h in lanes:
        if index in h.history_index or index in h.recent:
            return h.recache_chunk(index)
    raise AssertionError(f"re-cache chunk {index} is known to no lane")  # a lane's own plan rebuilds it


def _extend(plan: RecachePlan, union: tuple[int, ...], h: BranchPages) -> RecachePlan:
    """``plan`` (one lane's) over the union: its own chunks as planned, its kept sinks in the union rebuilt in
    place, every other union chunk a context chunk of the lane."""
    own = dict(zip(plan.rebuilt, plan.replaces))
    kept = list(plan.kept)
    replaces: list[int | None] = []
    for index in union:
        if index in own:
            replaces.append(own[index])
            continue
        slot = h.history_index.index(index) if index in h.history_index else None
        if slot is not None and slot in kept:
            kept.remove(slot)
            replaces.append(slot)
        else:
            replaces.append(None)
    return RecachePlan(tuple(kept), union, tuple(replaces), plan.moved)


def merged_latents(lanes: Sequence[BranchPages]) -> dict[int, object]:
    """A stream's kept latents over its lanes: a chunk's are kept while any lane retains or may rebuild it."""
    merged: dict[int, object] = {}
    for h in reversed(lanes):
        merged.update(h.latents)
    return merged
