"""A forward over several lanes (retention groups, ``docs/design.md``): one transaction, every lane or none.

Torch-free: two lanes with their own allocators and policies (lane 0 keeps sink 1 + window 1, lane 1 a window of 3),
two streams. Each commit advances every lane by its own policy; a policy that breaks its contract in one lane leaves
every lane exactly as it was (the other lane's preview ran, nothing applied); an abort drops the pending chunks of
every lane, or rolls every lane's reservation back exactly while it is held.
"""

from __future__ import annotations

import pytest

from ardiff_modules.core.allocator import PageAllocator
from ardiff_modules.core.branch import BranchPages
from ardiff_modules.core.recache import RecacheRule
from ardiff_modules.core.reservation import ForwardReservation
from ardiff_modules.core.retention import SinkWindowPolicy
from ardiff_modules.core.transaction import ForwardTransaction, TransactionLane
from ardiff_modules.errors import SpecError
from tests.support.policies import Misbehaving

PAGES_PER_CHUNK, CHUNK = 2, 8
POLICIES = (SinkWindowPolicy(1, 1), SinkWindowPolicy(0, 3))
STREAMS = 2


def make_lanes(policies=POLICIES) -> list[tuple[PageAllocator, list[BranchPages]]]:
    return [(PageAllocator(64), [BranchPages(p, PAGES_PER_CHUNK, CHUNK) for _ in range(STREAMS)]) for p in policies]


def forward(lanes, *, hold: bool = False, commit: bool = True) -> ForwardTransaction:
    """A one-chunk forward over every stream of every lane (pending pages reserved in each lane)."""
    parts = []
    for allocator, branches in lanes:
        reservation = ForwardReservation(branches, [PAGES_PER_CHUNK], allocator, 0)
        if not hold:
            reservation.keep()
        parts.append(TransactionLane(allocator, tuple(branches), reservation if hold else None))
    members = tuple((f"s{i}", "cond") for i in range(STREAMS))
    transaction = ForwardTransaction(members=members, commit_current=commit, num_chunks=1, lanes=tuple(parts))
    transaction.attach()
    return transaction


def state(lanes) -> list:
    """Every lane's bookkeeping and every page's refcount: what must not change when a step is refused."""
    return [
        ([(b.history, b.history_index, b.pending, b.committed_chunks, b.committed_tokens) for b in branches],
         [allocator.refcount(p) for p in range(allocator.num_pages)], allocator.num_free)
        for allocator, branches in lanes
    ]


def test_each_lane_keeps_what_its_policy_keeps_and_frees_the_rest() -> None:
    lanes = make_lanes()
    for n in range(1, 7):
        forward(lanes).commit()
        for (allocator, branches), policy in zip(lanes, POLICIES):
            for b in branches:
                assert list(b.history_index) == list(policy.history_indices(n))
                assert b.committed_chunks == n and b.token_offset == n * CHUNK and b.pending == ()
            # exactly the resident chunks' pages are referenced: the short lane really frees its evicted pages
            assert allocator.num_used == STREAMS * len(policy.history_indices(n)) * PAGES_PER_CHUNK
            allocator.check_invariants()
    assert [len(branches[0].history) for _, branches in lanes] == [2, 3]


def test_a_denoising_forward_completes_in_every_lane_and_keeps_its_pending_pages() -> None:
    lanes = make_lanes()
    t = forward(lanes, commit=False)
    t.commit()
    assert t.status == "completed"
    assert all(len(b.pending) == 1 and b.history == () for _, branches in lanes for b in branches)
    assert all(b.transaction is None for _, branches in lanes for b in branches)


def test_a_policy_breaking_its_contract_in_one_lane_changes_no_lane() -> None:
    bad = Misbehaving(POLICIES[1])
    lanes = make_lanes((POLICIES[0], bad))
    for _ in range(4):
        forward(lanes).commit()
    t = forward(lanes)
    branch = lanes[1][1][0]
    bad.arm("duplicate", resident=branch.history_index, committed=branch.committed_chunks)
    before = state(lanes)
    with pytest.raises(SpecError):
        t.commit()
    assert t.is_open and state(lanes) == before  # lane 0 previewed its commit, nothing was applied anywhere
    bad.disarm()
    t.abort("refused")
    assert t.status == "aborted"
    for allocator, branches in lanes:
        assert all(b.pending == () and b.committed_chunks == 4 for b in branches)
        allocator.check_invariants()


def test_an_abort_rolls_every_lanes_held_reservation_back_exactly() -> None:
    lanes = make_lanes()
    for _ in range(3):
        forward(lanes).commit()
    checkpoints = [(allocator.checkpoint(free_order=True), allocator.peak_used) for allocator, _ in lanes]
    before = state(lanes)
    t = forward(lanes, hold=True)
    assert t.reservation is not None and all(lane.reservation is not None for lane in t.lanes)
    t.abort()
    assert state(lanes) == before
    for (allocator, _), (checkpoint, peak) in zip(lanes, checkpoints):
        assert allocator.checkpoint(free_order=True) == checkpoint and allocator.peak_used == peak


def test_keeping_the_reservation_keeps_it_in_every_lane_and_a_later_abort_drops_the_pending_pages() -> None:
    lanes = make_lanes()
    forward(lanes).commit()
    used = [allocator.num_used for allocator, _ in lanes]
    t = forward(lanes, hold=True)
    t.keep_reservation()
    assert t.reservation is None and all(lane.reservation is None for lane in t.lanes)
    t.abort()
    assert [allocator.num_used for allocator, _ in lanes] == used
    assert all(b.pending == () for _, branches in lanes for b in branches)


def test_a_recache_swaps_every_lanes_rebuilt_chunks_in_at_once() -> None:
    """Each lane rebuilds what its own rule plan says (lane 0: its one window chunk, the sink kept; lane 1: its
    three window chunks); the commit swaps them in in both lanes, commit indices and offsets unchanged, the old
    pages released in each lane's own allocator."""
    lanes = make_lanes()
    for _ in range(5):
        forward(lanes).commit()
    before = [[(b.history_index, b.history_start, b.token_offset) for b in branches] for _, branches in lanes]
    old = [[b.history for b in branches] for _, branches in lanes]
    used = [allocator.num_used for allocator, _ in lanes]
    parts = []
    for allocator, branches in lanes:
        plans = tuple(b.recache_plan(RecacheRule()) for b in branches)
        reservation = ForwardReservation(branches, [PAGES_PER_CHUNK] * len(plans[0].rebuilt), allocator, 0)
        reservation.keep()
        parts.append(TransactionLane(allocator, tuple(branches), None, plans))
    assert [len(p.recache_plans[0].rebuilt) for p in parts] == [1, 3]
    t = ForwardTransaction(members=(("s0", "cond"), ("s1", "cond")), commit_current=True, num_chunks=1,
                           recache=True, lanes=tuple(parts))
    t.attach()
    t.commit()
    assert t.status == "committed"
    for (allocator, branches), was, old_chunks, n in zip(lanes, before, old, used):
        assert [(b.history_index, b.history_start, b.token_offset) for b in branches] == was
        for b, chunks in zip(branches, old_chunks):
            kept = [c for c in b.history if c in chunks]
            assert len(kept) == len(b.sinks)  # only the sink (kept by the rule) is still the old chunk
        assert allocator.num_used == n  # the old window chunks' pages went back to the free list
        allocator.check_invariants()
