"""Property tests of ``PageAllocator``: a state machine against a ``dict page -> refcount`` and a multiset of
held references.

After every step: refcount of each page == the model's reference count; free and used pages partition the pool
and are disjoint; failed operations change nothing; releasing every reference at the end frees every page.
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ardiff_modules.core.allocator import AllocatorCheckpoint, PageAllocator
from ardiff_modules.errors import AllocatorError, CapacityError


class AllocatorMachine(RuleBasedStateMachine):
    """``PageAllocator`` against a ``dict page -> refcount`` and a multiset of held references."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc: PageAllocator | None = None
        self.model: dict[int, int] = {}
        self.held: list[int] = []  # one entry per reference we own

    @initialize(num_pages=st.integers(1, 12))
    def setup(self, num_pages: int) -> None:
        self.alloc = PageAllocator(num_pages)
        self.model = dict.fromkeys(range(num_pages), 0)

    # ------------------------------------------------------------------ helpers
    def snapshot(self) -> tuple:
        a = self.alloc
        return a.free_pages(), tuple(a.refcount(p) for p in range(a.num_pages)), a.num_free, a.num_used

    def model_free(self) -> set[int]:
        return {p for p, rc in self.model.items() if rc == 0}

    # ------------------------------------------------------------------ rules
    @rule(count=st.integers(0, 14))
    def allocate(self, count: int) -> None:
        free_before = self.alloc.free_pages()
        if count > len(self.model_free()):
            before = self.snapshot()
            with pytest.raises(CapacityError) as info:
                self.alloc.allocate(count)
            assert info.value.needed == count and info.value.free == len(free_before)
            assert str(count) in str(info.value)
            assert self.snapshot() == before
            return
        pages = self.alloc.allocate(count)
        assert len(pages) == count and len(set(pages)) == count
        assert set(pages) <= set(free_before), f"allocated non-free pages {pages}, free was {free_before}"
        for p in pages:
            self.model[p] = 1
        self.held.extend(pages)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def incref(self, data: st.DataObject) -> None:
        used = sorted({p for p in self.held})
        pages = data.draw(st.lists(st.sampled_from(used), min_size=1, max_size=4), label="incref pages")
        self.alloc.incref(pages)
        for p in pages:
            self.model[p] += 1
        self.held.extend(pages)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def decref(self, data: st.DataObject) -> None:
        idx = data.draw(
            st.lists(st.integers(0, len(self.held) - 1), min_size=1, max_size=len(self.held), unique=True),
            label="references to drop",
        )
        pages = [self.held[i] for i in idx]
        free_before = self.alloc.free_pages()
        freed = self.alloc.decref(pages)
        expect_freed = []
        for p in pages:
            self.model[p] -= 1
            if self.model[p] == 0:
                expect_freed.append(p)
        for i in sorted(idx, reverse=True):
            del self.held[i]
        assert freed == expect_freed
        # NOTE: freed pages join the back of the FIFO queue (vLLM BlockPool order).
        assert self.alloc.free_pages() == free_before + tuple(expect_freed)

    @rule(data=st.data(), extra=st.integers(1, 2), with_valid=st.booleans())
    def double_free(self, data: st.DataObject, extra: int, with_valid: bool) -> None:
        """Dropping more references than a page has (free pages included) fails and changes nothing."""
        page = data.draw(st.sampled_from(sorted(self.model)), label="over-freed page")
        pages = [page] * (self.model[page] + extra)
        if with_valid:
            others = [p for p in self.held if p != page]
            if others:
                pages = [others[0]] + pages  # a valid drop first: must not be applied either
        before = self.snapshot()
        with pytest.raises(AllocatorError) as info:
            self.alloc.decref(pages)
        assert f"page {page}" in str(info.value)
        assert self.snapshot() == before

    @precondition(lambda self: any(rc == 0 for rc in self.model.values()))
    @rule(data=st.data())
    def incref_free_page(self, data: st.DataObject) -> None:
        page = data.draw(st.sampled_from(sorted(self.model_free())), label="free page")
        pages = ([self.held[0]] if self.held else []) + [page]
        before = self.snapshot()
        with pytest.raises(AllocatorError):
            self.alloc.incref(pages)
        assert self.snapshot() == before

    @rule(bad=st.sampled_from(["neg", "too_big", "bool", "str"]), op=st.sampled_from(["incref", "decref", "refcount"]))
    def invalid_page_id(self, bad: str, op: str) -> None:
        value = {"neg": -1, "too_big": self.alloc.num_pages, "bool": True, "str": "0"}[bad]
        before = self.snapshot()
        with pytest.raises(AllocatorError):
            if op == "refcount":
                self.alloc.refcount(value)
            else:
                getattr(self.alloc, op)(([self.held[0]] if self.held else []) + [value])
        assert self.snapshot() == before

    @rule(count=st.integers(0, 8))
    def allocate_contiguous(self, count: int) -> None:
        """The lowest run of ``count`` consecutive free ids, or CapacityError (also when merely fragmented)."""
        before = self.snapshot()
        if count < 1:
            with pytest.raises(AllocatorError):
                self.alloc.allocate_contiguous(count)
            assert self.snapshot() == before
            return
        free = sorted(self.model_free())
        expected = None
        for i in range(len(free) - count + 1):
            if free[i + count - 1] - free[i] == count - 1:
                expected = list(range(free[i], free[i] + count))
                break
        if expected is None:
            with pytest.raises(CapacityError) as info:
                self.alloc.allocate_contiguous(count)
            assert info.value.needed == count and info.value.free == len(free)
            assert self.snapshot() == before
            return
        free_order = self.alloc.free_pages()
        pages = self.alloc.allocate_contiguous(count)
        assert pages == expected, f"allocate_contiguous({count}) gave {pages}, lowest free run is {expected}"
        assert self.alloc.free_pages() == tuple(p for p in free_order if p not in pages)
        for p in pages:
            self.model[p] = 1
        self.held.extend(pages)

    @rule(count=st.integers(1, 6), contiguous=st.booleans(), bad_order=st.booleans())
    def allocate_then_unallocate(self, count: int, contiguous: bool, bad_order: bool) -> None:
        """``unallocate`` undoes the latest allocation exactly, free-queue order included."""
        before = self.snapshot()
        free_order = self.alloc.free_pages()
        try:
            pages = self.alloc.allocate_contiguous(count) if contiguous else self.alloc.allocate(count)
        except CapacityError:
            assert self.snapshot() == before
            return
        if bad_order:  # a free_order that does not match free + returned pages: rejected, nothing changed
            mid = self.snapshot()
            with pytest.raises(AllocatorError):
                self.alloc.unallocate(pages, AllocatorCheckpoint(self.alloc.peak_used, free_order[1:]))
            assert self.snapshot() == mid
        self.alloc.unallocate(pages, AllocatorCheckpoint(self.alloc.peak_used, free_order if contiguous else None))
        assert self.snapshot() == before

    @precondition(lambda self: any(rc >= 2 for rc in self.model.values()))
    @rule(data=st.data())
    def unallocate_shared_page(self, data: st.DataObject) -> None:
        """Only freshly allocated pages (refcount exactly 1) can be unallocated."""
        page = data.draw(st.sampled_from(sorted(p for p, rc in self.model.items() if rc >= 2)), label="shared page")
        before = self.snapshot()
        with pytest.raises(AllocatorError):
            self.alloc.unallocate([page])
        assert self.snapshot() == before

    @rule(count=st.sampled_from([-1, True, 1.0]))
    def invalid_count(self, count: object) -> None:
        before = self.snapshot()
        with pytest.raises(AllocatorError):
            self.alloc.allocate(count)  # type: ignore[arg-type]
        assert self.snapshot() == before

    # ------------------------------------------------------------------ invariants
    @invariant()
    def refcounts_match_model(self) -> None:
        if self.alloc is None:
            return
        assert Counter(self.held) == Counter({p: rc for p, rc in self.model.items() if rc})
        for page, rc in self.model.items():
            assert self.alloc.refcount(page) == rc, f"page {page}: refcount {self.alloc.refcount(page)}, model {rc}"

    @invariant()
    def free_and_used_partition_the_pool(self) -> None:
        if self.alloc is None:
            return
        free, used = self.alloc.free_pages(), self.alloc.used_pages()
        assert len(free) == len(set(free)), f"duplicate in free list {free}"
        assert not set(free) & set(used)
        assert set(free) | set(used) == set(range(self.alloc.num_pages))
        assert set(free) == self.model_free()
        assert self.alloc.num_free == len(free) and self.alloc.num_used == len(used)
        self.alloc.check_invariants()

    @invariant()
    def free_runs_match_the_model(self) -> None:
        """``free_runs`` / ``runs_that_fit`` recomputed from the model's free set: maximal runs, lowest first."""
        if self.alloc is None:
            return
        free = sorted(self.model_free())
        runs: list[list[int]] = []
        for page in free:
            if runs and runs[-1][-1] == page - 1:
                runs[-1].append(page)
            else:
                runs.append([page])
        assert self.alloc.free_runs() == [(r[0], len(r)) for r in runs]
        assert self.alloc.longest_free_run() == max((len(r) for r in runs), default=0)
        for size in (1, 2, 3, 5):
            assert self.alloc.runs_that_fit(size) == sum(len(r) // size for r in runs)

    def teardown(self) -> None:
        if self.alloc is None or sys.exc_info()[1] is not None:
            return  # nothing built, or a step failed (hypothesis tears down in a `finally`): keep its report
        self.alloc.decref(self.held)
        self.held = []
        assert self.alloc.num_free == self.alloc.num_pages
        assert self.alloc.used_pages() == ()
        assert all(self.alloc.refcount(p) == 0 for p in range(self.alloc.num_pages))
        self.alloc.check_invariants()


TestAllocatorMachine = pytest.mark.slow(AllocatorMachine.TestCase)
# Pure Python and cheap: many more runs than the profile's default.
TestAllocatorMachine.settings = settings(max_examples=settings.default.max_examples * 5)


@pytest.mark.parametrize("case", ["duplicate_pages", "duplicate_free_order"])
def test_unallocate_rejects_duplicates(case: str) -> None:
    alloc = PageAllocator(4)
    free_order = alloc.free_pages()
    pages = alloc.allocate(2)
    before = (alloc.free_pages(), [alloc.refcount(p) for p in range(4)])
    with pytest.raises(AllocatorError):
        if case == "duplicate_pages":
            alloc.unallocate([pages[0], pages[0]])
        else:
            alloc.unallocate(pages, AllocatorCheckpoint(alloc.peak_used, (free_order[0],) + free_order))
    assert (alloc.free_pages(), [alloc.refcount(p) for p in range(4)]) == before
    alloc.check_invariants()


def test_allocator_rejects_bad_sizes() -> None:
    for bad in (0, -3, True, 2.0):
        with pytest.raises(AllocatorError):
            PageAllocator(bad)  # type: ignore[arg-type]
