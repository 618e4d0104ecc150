"""Property tests of ``BranchPages``: a state machine of two histories sharing a small allocator, against
plain lists.

The visible chunks are the first ``S`` plus the last ``W`` of *all* chunks ever committed, computed by list
slicing (never by asking the policy); evicted chunks' pages are freed. The machine also runs with contiguous
extents (``extent_chunks``, ``assign_extent``, ``free_extent_slots``): the ring takes the lowest slot no chunk
references, an evicted slot a fork still sees is not reused, a rolled-back grow changes nothing.
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from ardiff_modules.core.allocator import AllocatorCheckpoint, PageAllocator
from ardiff_modules.errors import CapacityError
from ardiff_modules.core.branch import BranchPages
from ardiff_modules.core.retention import SinkWindowPolicy
from tests.support.pool_model import expected_visible


class BranchHistoryMachine(RuleBasedStateMachine):
    """Two ``BranchPages`` objects sharing a small allocator, against plain lists.

    Model per branch: the list of *all* chunks ever committed (page tuples, as the
    library reports them), the pending chunks and, with contiguous extents
    (``extent_chunks``), the extent's pages. Branch ``b`` may adopt branch ``a``'s
    history (a fork sharing pages by refcount).

    Extents are driven the way ``KVCache`` drives them: before a branch's first pending
    allocation, one run of consecutive free pages (``allocate_contiguous``) is handed to
    ``assign_extent``; the extent holds one reference per page until ``release``. A new
    pending chunk then takes the lowest extent slot no chunk of any branch references
    (``free_extent_slots``: evicted chunks a fork still sees keep their slot busy), the
    rest come from the free list. A grow can be rolled back (``undo_grow`` +
    ``unallocate``, as a failed prepare does): allocator and branch exactly as before.
    """

    def __init__(self) -> None:
        super().__init__()
        self.alloc: PageAllocator | None = None

    @initialize(
        sink=st.integers(0, 2),
        window=st.sampled_from([0, 1, 2, 3, None]),
        pages_per_chunk=st.integers(1, 2),
        pool_chunks=st.integers(3, 12),
        extent=st.sampled_from([None, None, "ring", 1, 2, 4]),
    )
    def setup(self, sink: int, window: int | None, pages_per_chunk: int, pool_chunks: int, extent) -> None:
        self.sink, self.window, self.ppc = sink, window, pages_per_chunk
        self.chunk_size = 2 * pages_per_chunk
        self.policy = SinkWindowPolicy(sink, window)
        if extent == "ring":  # what KVCache(contiguous_extents=True) uses: S + W + 1 slots
            extent = sink + window + 1 if window is not None else None
        self.extent_chunks: int | None = extent
        if extent is not None:
            pool_chunks += extent  # room for at least one extent
        self.alloc = PageAllocator(pool_chunks * pages_per_chunk)
        self.branches = {
            name: BranchPages(self.policy, pages_per_chunk, self.chunk_size, extent) for name in ("a", "b")
        }
        self.committed: dict[str, list[tuple[int, ...]]] = {"a": [], "b": []}
        self.pending: dict[str, list[tuple[int, ...]]] = {"a": [], "b": []}
        self.extent: dict[str, tuple[int, ...]] = {"a": (), "b": ()}

    # ------------------------------------------------------------------ helpers
    def visible(self, name: str) -> list[tuple[int, ...]]:
        return expected_visible(self.committed[name], self.sink, self.window)

    def chunk_refs(self) -> Counter[int]:
        """References from chunks (visible or pending) of both branches."""
        return Counter(p for b in "ab" for c in self.visible(b) + self.pending[b] for p in c)

    def all_refs(self) -> Counter[int]:
        refs = self.chunk_refs()
        for b in "ab":
            refs.update(self.extent[b])  # the reservation: one reference per extent page
        return refs

    def slots(self, name: str) -> list[tuple[int, ...]]:
        ext = self.extent[name]
        return [tuple(ext[i : i + self.ppc]) for i in range(0, len(ext), self.ppc)]

    def free_slots(self, name: str) -> list[tuple[int, ...]]:
        """Extent slots no chunk of either branch references (lowest first)."""
        refs = self.chunk_refs()
        return [slot for slot in self.slots(name) if not any(refs[p] for p in slot)]

    def reused(self, name: str, sizes: list[int]) -> int:
        """Leading pending chunks a forward with these chunk sizes (pages) keeps: same size, same place."""
        old, k = self.pending[name], 0
        while k < min(len(old), len(sizes)) and len(old[k]) == sizes[k]:
            k += 1
        return k

    def expected_needed(self, name: str, n: int | list[int]) -> int:
        sizes = [self.ppc] * n if isinstance(n, int) else list(n)
        missing = sizes[self.reused(name, sizes) :]
        if self.extent_chunks is None:
            return sum(missing)
        if not self.extent[name]:
            return self.extent_chunks * self.ppc + sum(missing[self.extent_chunks :])
        return sum(missing[len(self.free_slots(name)) :])

    def snapshot(self) -> tuple:
        a = self.alloc
        return (
            a.free_pages(),
            tuple(a.refcount(p) for p in range(a.num_pages)),
            a.peak_used,
            {
                n: (h.history_chunks, h.pending, h.committed_chunks, h.extent, h.needs_extent)
                for n, h in self.branches.items()
            },
        )

    def reserve_extent(self, name: str) -> bool:
        """What ``KVCache`` does before a branch's first pending chunk: reserve its extent (or refuse unchanged)."""
        h = self.branches[name]
        assert h.needs_extent == (self.extent_chunks is not None and not self.extent[name])
        if not h.needs_extent:
            return True
        count = self.extent_chunks * self.ppc
        free = sorted(self.alloc.free_pages())
        runs = [free[i] for i in range(len(free) - count + 1) if free[i + count - 1] - free[i] == count - 1]
        if not runs:
            before = self.snapshot()
            with pytest.raises(CapacityError):
                self.alloc.allocate_contiguous(count)
            assert self.snapshot() == before
            event("extent: no consecutive run")
            return False
        pages = tuple(self.alloc.allocate_contiguous(count))
        assert pages == tuple(range(runs[0], runs[0] + count)), f"extent {pages}, lowest free run at {runs[0]}"
        h.assign_extent(pages)
        self.extent[name] = pages
        assert not h.needs_extent and h.extent == pages
        return True

    # ------------------------------------------------------------------ rules
    @rule(name=st.sampled_from("ab"), n=st.integers(0, 4))
    def set_pending(self, name: str, n: int) -> None:
        self.set_pending_sizes(name, [self.ppc] * n)

    @rule(name=st.sampled_from("ab"), sizes=st.lists(st.integers(1, 2), max_size=3))
    def set_pending_mixed(self, name: str, sizes: list[int]) -> None:
        """Chunks of different lengths (an image-to-video first chunk of fewer pages, issue 12)."""
        self.set_pending_sizes(name, [min(s, self.ppc) for s in sizes])

    def set_pending_sizes(self, name: str, sizes: list[int]) -> None:
        h = self.branches[name]
        needed = self.expected_needed(name, sizes)
        assert h.pages_needed(sizes, self.alloc) == needed
        if needed > self.alloc.num_free:
            if h.needs_extent:
                return  # the cache refuses before reserving (its capacity check uses pages_needed, checked above)
            before = self.snapshot()
            with pytest.raises(CapacityError):
                h.set_pending(sizes, self.alloc)
            assert self.snapshot() == before
            return
        k = self.reused(name, sizes)
        if len(sizes) > k and not self.reserve_extent(name):
            return
        old = self.pending[name]
        slots = self.free_slots(name)
        free_before = set(self.alloc.free_pages())
        h.set_pending(sizes, self.alloc)
        assert [len(c) for c in h.pending] == sizes
        assert list(h.pending[:k]) == old[:k], "pending chunks of the same size must be reused in place"
        grown = list(h.pending[k:])
        ring = grown[: len(slots)]
        # The ring takes the lowest free slots first (a shorter chunk their first pages); the rest is paged.
        assert ring == [slot[: len(c)] for slot, c in zip(slots, ring)], f"grew {grown}, free slots {slots}"
        if ring:
            event("extent: pending chunk took a ring slot")
        if len(set(sizes)) > 1:
            event("mixed chunk sizes")
        fresh = [p for c in grown[len(ring) :] for p in c]
        if self.extent_chunks is not None and fresh:
            event("extent: overflow chunk paged outside the extent")
        assert set(fresh) <= free_before and len(set(fresh)) == len(fresh)
        self.pending[name] = list(h.pending)

    @rule(name=st.sampled_from("ab"), n=st.integers(1, 4))
    def grow_then_roll_back(self, name: str, n: int) -> None:
        """A failed prepare: reserve + grow, then ``undo_grow`` + ``unallocate``: exactly as before."""
        h = self.branches[name]
        if self.expected_needed(name, n) > self.alloc.num_free or n <= self.reused(name, [self.ppc] * n):
            return
        before = self.snapshot()
        free_order = self.alloc.free_pages()
        peak = self.alloc.peak_used
        reserved = h.needs_extent
        if not self.reserve_extent(name):
            return
        old = h.pending
        h.replace_pending(n, self.alloc)  # as the cache's Reservation: replaced chunks stay referenced
        fresh = h.undo_grow(old, self.alloc)
        if reserved:
            fresh += list(h.extent)
            h.extent = ()
            self.extent[name] = ()
        if fresh:
            self.alloc.unallocate(fresh, AllocatorCheckpoint(self.alloc.peak_used, free_order if reserved else None))
        self.alloc.peak_used = peak
        assert self.snapshot() == before, "a rolled-back grow must leave allocator and branch exactly as before"
        event("rolled back a grow" + (" (with a new extent)" if reserved else ""))

    @rule(name=st.sampled_from("ab"))
    def commit(self, name: str) -> None:
        h = self.branches[name]
        held_before = self.visible(name) + self.pending[name]
        self.committed[name] += self.pending[name]
        self.pending[name] = []
        freed = h.commit_pending(self.alloc)
        now_visible = self.visible(name)
        evicted = [c for c in held_before if c not in now_visible]
        # Evicted pages are freed unless still referenced: by the other branch (a fork) or an extent.
        refs = self.all_refs()
        expect_freed = [p for c in evicted for p in c if not refs[p]]
        assert sorted(freed) == sorted(expect_freed), f"freed {freed}, expected {expect_freed} (evicted {evicted})"
        if any(p in self.extent[name] for c in evicted for p in c):
            event("extent: evicted a chunk of the extent (slot kept)")
        for p in expect_freed:
            assert self.alloc.refcount(p) == 0 and p in self.alloc.free_pages()

    @rule(name=st.sampled_from("ab"), n=st.integers(1, 3))
    def commit_chunks(self, name: str, n: int) -> None:
        """The common path in one step (so short runs reach eviction): ``n`` pending chunks, then commit."""
        self.set_pending(name, n)
        if len(self.pending[name]) == n:
            self.commit(name)

    @rule(name=st.sampled_from("ab"))
    def drop_pending(self, name: str) -> None:
        self.branches[name].drop_pending(self.alloc)
        self.pending[name] = []

    @rule(name=st.sampled_from("ab"))
    def release(self, name: str) -> None:
        self.branches[name].release(self.alloc)
        self.committed[name] = []
        self.pending[name] = []
        self.extent[name] = ()

    @rule(src=st.sampled_from("ab"), sinks_only=st.booleans())
    def adopt(self, src: str, sinks_only: bool) -> None:
        """The other branch forks ``src``'s committed history, or only its sinks (pages shared by refcount).

        With extents, the shared chunks may lie in ``src``'s extent: their slots stay busy until
        both branches let go of them. The adopting branch releases its own extent.
        """
        dst = "b" if src == "a" else "a"
        self.branches[dst].adopt(self.branches[src], self.alloc, sinks_only=sinks_only)
        self.committed[dst] = list(self.committed[src][: self.sink] if sinks_only else self.committed[src])
        self.pending[dst] = []
        self.extent[dst] = ()

    @invariant()
    def matches_model(self) -> None:
        if self.alloc is None:
            return
        for name, h in self.branches.items():
            visible = self.visible(name)
            assert list(h.history_chunks) == visible, (
                f"branch {name}: visible {h.history_chunks}, expected first {self.sink} + last {self.window} "
                f"of {self.committed[name]}"
            )
            assert list(h.pending) == self.pending[name]
            assert h.committed_chunks == len(self.committed[name])
            page_size = self.chunk_size // self.ppc
            assert h.token_offset == sum(len(c) for c in self.committed[name]) * page_size
            # Every visible token's absolute position: its chunk's start (tokens committed before it) + offset.
            committed = self.committed[name]
            starts = [sum(len(c) for c in committed[:i]) * page_size for i in range(len(committed))]
            indices = expected_visible(list(range(len(committed))), self.sink, self.window)
            assert h.history_positions() == [
                starts[i] + t for i in indices for t in range(len(committed[i]) * page_size)
            ], f"branch {name}: positions of {visible}"
            assert tuple(h.extent) == self.extent[name]
            assert h.free_extent_slots(self.alloc) == self.free_slots(name)
            assert sorted(h.referenced_pages()) == sorted(
                [p for c in visible + self.pending[name] for p in c] + list(self.extent[name])
            )
        refs = self.all_refs()
        for page in range(self.alloc.num_pages):
            assert self.alloc.refcount(page) == refs[page], (
                f"page {page}: refcount {self.alloc.refcount(page)}, referenced {refs[page]} time(s)"
            )
        # Pending pages are written by forwards: nobody else may reference them (extent slots: the reservation).
        chunk_refs = self.chunk_refs()
        for name in "ab":
            for chunk in self.pending[name]:
                assert all(chunk_refs[p] == 1 for p in chunk), f"branch {name}: pending chunk {chunk} is shared"
        free, used = set(self.alloc.free_pages()), set(self.alloc.used_pages())
        assert not free & used and free | used == set(range(self.alloc.num_pages))
        self.alloc.check_invariants()

    def teardown(self) -> None:
        if self.alloc is None or sys.exc_info()[1] is not None:
            return  # nothing built, or a step failed (hypothesis tears down in a `finally`): keep its report
        for h in self.branches.values():
            h.release(self.alloc)
        assert self.alloc.num_free == self.alloc.num_pages
        self.alloc.check_invariants()


TestBranchHistoryMachine = pytest.mark.slow(BranchHistoryMachine.TestCase)
TestBranchHistoryMachine.settings = settings(
    max_examples=settings.default.max_examples * 5,
    stateful_step_count=settings.default.stateful_step_count * 2,
)
