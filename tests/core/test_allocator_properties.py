"""Property tests of the pure-Python layer: ``PageAllocator``, ``SinkWindowPolicy``, ``BranchHistory``.

Every machine keeps a plain model next to the library object and checks, after
every step, that the two agree:

* allocator: refcount of each page == the model's reference count; free and used
  pages partition the pool and are disjoint; failed operations change nothing;
  releasing every reference at the end frees every page.
* window policy / branch history: the visible chunks are the first ``S`` plus the
  last ``W`` of *all* chunks ever committed, computed by list slicing (never by
  asking the policy); evicted chunks' pages are freed. The branch-history machine
  also runs with contiguous extents (``extent_chunks``, ``assign_extent``,
  ``free_extent_slots``): the ring takes the lowest slot no chunk references, an
  evicted slot a fork still sees is not reused, a rolled-back grow changes nothing.
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ardiff_modules.allocator import PageAllocator
from ardiff_modules.errors import AllocatorError, CapacityError, SpecError
from ardiff_modules.history import BranchHistory
from ardiff_modules.window import SinkWindowPolicy


# ---------------------------------------------------------------------------- the plain-list oracle
def expected_visible(committed: list, sink: int, window: int | None) -> list:
    """First ``sink`` chunks plus the last ``window`` of the remaining ones (plain slicing)."""
    sinks = committed[:sink]
    rest = committed[sink:]
    if window is None:
        return sinks + rest
    # NOTE: rest[-0:] is the whole list, hence the explicit start index.
    return sinks + rest[max(0, len(rest) - window) :]


def test_expected_visible_examples() -> None:
    # Pin the oracle itself (DESIGN.md section 1 and the window.py diagram).
    chunks = [f"c{i}" for i in range(10)]
    assert expected_visible(chunks, 2, 3) == ["c0", "c1", "c7", "c8", "c9"]
    assert expected_visible(chunks[:4], 2, 3) == ["c0", "c1", "c2", "c3"]
    assert expected_visible(chunks, 0, 0) == []
    assert expected_visible(chunks, 1, 0) == ["c0"]
    assert expected_visible(chunks, 0, None) == chunks
    assert expected_visible(chunks[:1], 3, 2) == ["c0"]


# ---------------------------------------------------------------------------- allocator
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
                self.alloc.unallocate(pages, free_order=free_order[1:])
            assert self.snapshot() == mid
        self.alloc.unallocate(pages, free_order=free_order if contiguous else None)
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
            alloc.unallocate(pages, free_order=(free_order[0],) + free_order)
    assert (alloc.free_pages(), [alloc.refcount(p) for p in range(4)]) == before
    alloc.check_invariants()


def test_allocator_rejects_bad_sizes() -> None:
    for bad in (0, -3, True, 2.0):
        with pytest.raises(AllocatorError):
            PageAllocator(bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- window policy (pure)
windows = st.one_of(st.none(), st.integers(0, 4))


@given(sink=st.integers(0, 3), window=windows, batches=st.lists(st.integers(0, 4), max_size=12))
def test_policy_commit_matches_list_slicing(sink: int, window: int | None, batches: list[int]) -> None:
    """Repeated ``commit`` keeps exactly first S + last W of everything committed; evicts the rest once."""
    policy = SinkWindowPolicy(sink, window)
    sinks: tuple = ()
    win: tuple = ()
    committed: list[int] = []
    evicted_all: list[int] = []
    next_id = 0
    for size in batches:
        new = list(range(next_id, next_id + size))
        next_id += size
        result = policy.commit(sinks, win, new)
        committed += new
        sinks, win = result.sinks, result.window
        evicted_all += result.evicted
        visible = expected_visible(committed, sink, window)
        assert list(sinks + win) == visible
        assert list(sinks) == committed[:sink]
        # Every chunk is either visible or evicted, never both, never twice.
        assert sorted(evicted_all + visible) == committed
        assert evicted_all == [c for c in committed if c not in visible]  # evicted oldest first
        if window is not None:
            assert len(win) <= window


@given(sink=st.integers(0, 4), window=windows, n=st.integers(0, 20))
def test_policy_visible_matches_list_slicing(sink: int, window: int | None, n: int) -> None:
    policy = SinkWindowPolicy(sink, window)
    committed = [f"c{i}" for i in range(n)]
    assert policy.visible(committed) == expected_visible(committed, sink, window)
    assert policy.visible_indices(n) == expected_visible(list(range(n)), sink, window)


@pytest.mark.parametrize("sink, window", [(-1, 2), (True, 2), (1, -1), (1, 1.5), (1, False)])
def test_policy_rejects_bad_values(sink: object, window: object) -> None:
    with pytest.raises(SpecError):
        SinkWindowPolicy(sink, window)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- branch history
class BranchHistoryMachine(RuleBasedStateMachine):
    """Two ``BranchHistory`` objects sharing a small allocator, against plain lists.

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
            name: BranchHistory(self.policy, pages_per_chunk, self.chunk_size, extent) for name in ("a", "b")
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
                n: (h.resident_chunks, h.pending, h.committed_chunks, h.extent, h.needs_extent)
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
            self.alloc.unallocate(fresh, free_order=free_order if reserved else None)
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
            assert list(h.resident_chunks) == visible, (
                f"branch {name}: visible {h.resident_chunks}, expected first {self.sink} + last {self.window} "
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
