"""Ranks of the send / recv test of a content selection (``tests/host/test_selection_host.py``): rank 0 sends a
parent and its fork after a scoring commit, rank 1 receives them and continues them beside its own twin family and
the re-statement (both ranks drive the same rollout: the same model, prompts and inputs)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

BLOCKS = 4  # past the first scoring commit (block 2) of the published configuration


def check_send_recv_selection() -> None:
    from tests.host.test_selection_host import Twins

    rollout = Twins(pages=160)
    rollout.advance(BLOCKS, check=False)
    child, twin_child = rollout.session.fork("child"), rollout.twin.fork("child")
    if dist.get_rank() == 0:
        rollout.cache.send_sessions([rollout.session, child], 1)
        assert all(lane.allocator.num_used == 0 for lane in rollout.cache._lanes)
        return
    cache = rollout.make()
    parent, received_child = cache.recv_sessions(0)
    check_received_family(rollout, cache, parent, received_child, twin_child)


def check_received_family(rollout: Any, cache: Any, parent: Any, received_child: Any, twin_child: Any) -> None:
    """The receiver's side of a moved selection family (by the group or by CUDA IPC): each lane's pages arrived once
    (the shared selection pages too, refcount 2), the selections equal the twin's, and the family continues
    bit-identically to the twin family (the parent also equal to the re-statement)."""
    from tests.host.test_selection_host import same_selection
    from tests.integrations.test_forcing_kv_selected import _temporal_lanes
    from tests.support import small_lanes as lanes

    twin_used = [lane.allocator.num_used for lane in rollout.twin_cache._lanes]
    assert [lane.allocator.num_used for lane in cache._lanes] == twin_used
    assert same_selection(cache, parent, rollout.twin_cache, rollout.twin)
    for lane in _temporal_lanes(cache):
        pages = parent._lane_pages("cond")[lane.index].selection.pages
        assert received_child._lane_pages("cond")[lane.index].selection.pages == pages
        assert all(lane.allocator.refcount(p) == 2 for p in pages)
    rollout.session = parent
    rollout.advance(2)  # bit-equal to the twin, equal to the re-statement
    for commit in (False, True):
        (out, twin_out), _ = rollout.forward(commit, [received_child, twin_child])
        assert torch.equal(out, twin_out)
    lanes.assert_clean(cache)
