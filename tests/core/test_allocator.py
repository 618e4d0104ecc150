"""PageAllocator: exact-id scenarios (pure Python, no torch needed)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from ardiff_modules.core.allocator import PageAllocator
from ardiff_modules.errors import AllocatorError, ARDiffError, CapacityError
from tests.support import paths

REPO_ROOT = str(paths.REPO_ROOT)


def allocator_snapshot(alloc: PageAllocator):
    return (
        alloc.free_pages(),
        tuple(alloc.refcount(p) for p in range(alloc.num_pages)),
        alloc.num_free,
        alloc.num_used,
        alloc.used_pages(),
    )


# ---------------------------------------------------------------------- construction


def test_fresh_allocator():
    alloc = PageAllocator(5)
    assert alloc.num_pages == 5
    assert alloc.num_free == 5
    assert alloc.num_used == 0
    assert alloc.free_pages() == (0, 1, 2, 3, 4)
    assert alloc.used_pages() == ()
    assert [alloc.refcount(p) for p in range(5)] == [0] * 5
    alloc.check_invariants()


@pytest.mark.parametrize("bad", [0, -1, 2.0, "3", True, None])
def test_bad_num_pages(bad):
    with pytest.raises(AllocatorError) as exc_info:
        PageAllocator(bad)
    assert "num_pages" in str(exc_info.value)
    assert "expected an int >= 1" in str(exc_info.value)
    assert repr(bad) in str(exc_info.value)


# ---------------------------------------------------------------------- FIFO allocation


def test_allocate_takes_lowest_ids_first():
    alloc = PageAllocator(8)
    assert alloc.allocate(3) == [0, 1, 2]
    assert alloc.allocate(2) == [3, 4]
    assert alloc.free_pages() == (5, 6, 7)
    assert alloc.used_pages() == (0, 1, 2, 3, 4)
    assert alloc.num_used == 5 and alloc.num_free == 3
    assert [alloc.refcount(p) for p in range(8)] == [1, 1, 1, 1, 1, 0, 0, 0]
    alloc.check_invariants()


def test_allocate_zero_is_a_noop():
    alloc = PageAllocator(3)
    before = allocator_snapshot(alloc)
    assert alloc.allocate(0) == []
    assert allocator_snapshot(alloc) == before


def test_freed_pages_go_to_the_back_of_the_queue():
    alloc = PageAllocator(6)
    assert alloc.allocate(4) == [0, 1, 2, 3]
    assert alloc.decref([1, 0]) == [1, 0]
    assert alloc.free_pages() == (4, 5, 1, 0)
    # Lowest-id-first only for never-used pages; recycled pages come after, in free order.
    assert alloc.allocate(3) == [4, 5, 1]
    assert alloc.free_pages() == (0,)
    assert alloc.allocate(1) == [0]
    assert alloc.free_pages() == ()
    assert alloc.decref([3]) == [3]
    assert alloc.free_pages() == (3,)
    alloc.check_invariants()


def test_allocate_everything_then_release_everything():
    alloc = PageAllocator(4)
    pages = alloc.allocate(4)
    assert pages == [0, 1, 2, 3]
    assert alloc.num_free == 0
    assert alloc.decref(reversed(pages)) == [3, 2, 1, 0]
    assert alloc.free_pages() == (3, 2, 1, 0)
    assert alloc.num_used == 0
    alloc.check_invariants()


# ---------------------------------------------------------------------- refcounts


def test_incref_decref_refcount():
    alloc = PageAllocator(4)
    assert alloc.allocate(2) == [0, 1]
    alloc.incref([0, 1])
    alloc.incref([0])
    assert (alloc.refcount(0), alloc.refcount(1)) == (3, 2)
    assert alloc.decref([0]) == []
    assert alloc.decref([1]) == []
    assert (alloc.refcount(0), alloc.refcount(1)) == (2, 1)
    assert alloc.free_pages() == (2, 3)
    assert alloc.decref([1]) == [1]
    assert alloc.free_pages() == (2, 3, 1)
    assert alloc.decref([0, 0]) == [0]  # one reference dropped per occurrence
    assert alloc.refcount(0) == 0
    assert alloc.free_pages() == (2, 3, 1, 0)
    alloc.check_invariants()


def test_incref_accepts_repeated_ids_and_generators():
    alloc = PageAllocator(3)
    alloc.allocate(1)
    alloc.incref(p for p in (0, 0))
    assert alloc.refcount(0) == 3
    assert alloc.decref(iter([0, 0, 0])) == [0]
    assert alloc.free_pages() == (1, 2, 0)


def test_decref_freed_order_follows_argument_order():
    alloc = PageAllocator(5)
    alloc.allocate(5)
    alloc.incref([2])
    assert alloc.decref([4, 2, 0, 3]) == [4, 0, 3]
    assert alloc.free_pages() == (4, 0, 3)
    assert alloc.refcount(2) == 1


def test_empty_incref_and_decref_are_noops():
    alloc = PageAllocator(3)
    alloc.allocate(1)
    before = allocator_snapshot(alloc)
    alloc.incref([])
    assert alloc.decref([]) == []
    assert allocator_snapshot(alloc) == before


# ---------------------------------------------------------------------- capacity errors change nothing


def test_capacity_error_changes_nothing():
    alloc = PageAllocator(5)
    alloc.allocate(3)
    alloc.decref([1])
    before = allocator_snapshot(alloc)
    with pytest.raises(CapacityError) as exc_info:
        alloc.allocate(4)
    err = exc_info.value
    assert isinstance(err, RuntimeError) and isinstance(err, ARDiffError)
    assert err.needed == 4
    assert err.free == 3
    assert "needed 4" in str(err) and "only 3 of 5" in str(err)
    assert allocator_snapshot(alloc) == before
    # And the pool still works exactly as if nothing had happened.
    assert alloc.allocate(3) == [3, 4, 1]


def test_capacity_error_when_full():
    alloc = PageAllocator(2)
    alloc.allocate(2)
    before = allocator_snapshot(alloc)
    with pytest.raises(CapacityError) as exc_info:
        alloc.allocate(1)
    assert (exc_info.value.needed, exc_info.value.free) == (1, 0)
    assert allocator_snapshot(alloc) == before


@pytest.mark.parametrize("bad", [-1, 1.0, "2", True, None])
def test_allocate_bad_count(bad):
    alloc = PageAllocator(3)
    alloc.allocate(1)
    before = allocator_snapshot(alloc)
    with pytest.raises(AllocatorError) as exc_info:
        alloc.allocate(bad)
    assert "expected a page count >= 0" in str(exc_info.value)
    assert repr(bad) in str(exc_info.value)
    assert allocator_snapshot(alloc) == before


# ---------------------------------------------------------------------- allocator errors change nothing


def test_double_free_raises_and_changes_nothing():
    alloc = PageAllocator(4)
    alloc.allocate(3)
    alloc.decref([1])
    before = allocator_snapshot(alloc)
    with pytest.raises(AllocatorError) as exc_info:
        alloc.decref([1])
    assert "page 1" in str(exc_info.value) and "refcount 0" in str(exc_info.value)
    assert allocator_snapshot(alloc) == before


def test_decref_more_than_held_in_one_call_changes_nothing():
    alloc = PageAllocator(4)
    alloc.allocate(3)
    alloc.incref([2])
    before = allocator_snapshot(alloc)
    # page 0 is fine, page 2 has refcount 2 but 3 drops are requested: nothing may change, not even page 0.
    with pytest.raises(AllocatorError) as exc_info:
        alloc.decref([0, 2, 2, 2])
    msg = str(exc_info.value)
    assert "page 2" in msg and "refcount 2" in msg and "cannot drop 3" in msg
    assert allocator_snapshot(alloc) == before


@pytest.mark.parametrize("bad", [-1, 4, 100, 1.0, "0", None, True])
def test_bad_page_ids_change_nothing(bad):
    alloc = PageAllocator(4)
    alloc.allocate(2)
    before = allocator_snapshot(alloc)
    for op in (alloc.decref, alloc.incref):
        with pytest.raises(AllocatorError) as exc_info:
            op([0, bad])  # a valid id first: it must not be touched either
        assert "expected a page id in [0, 4)" in str(exc_info.value)
        assert repr(bad) in str(exc_info.value)
        assert allocator_snapshot(alloc) == before
    with pytest.raises(AllocatorError):
        alloc.refcount(bad)
    assert allocator_snapshot(alloc) == before


def test_incref_of_free_page_changes_nothing():
    alloc = PageAllocator(4)
    alloc.allocate(2)
    before = allocator_snapshot(alloc)
    with pytest.raises(AllocatorError) as exc_info:
        alloc.incref([0, 1, 3])
    msg = str(exc_info.value)
    assert "page 3 is free" in msg and "refcount >= 1" in msg
    assert allocator_snapshot(alloc) == before


# ---------------------------------------------------------------------- no torch


def test_pure_python_layers_import_without_torch():
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        sys.path.insert(0, {REPO_ROOT!r})
        import ardiff_modules.core.allocator, ardiff_modules.core.retention, ardiff_modules.spec
        import ardiff_modules.errors, ardiff_modules.core.branch
        from ardiff_modules.core.allocator import PageAllocator
        from ardiff_modules.core.branch import BranchPages
        from ardiff_modules.core.retention import SinkWindowPolicy
        alloc = PageAllocator(6)
        h = BranchPages(SinkWindowPolicy(1, 1), pages_per_chunk=2, chunk_size=4)
        for _ in range(3):
            h.set_pending(1, alloc)
            h.commit_pending(alloc)
        assert h.history_chunks == ((0, 1), (4, 5)), h.history_chunks
        assert alloc.free_pages() == (2, 3), alloc.free_pages()
        assert sys.modules["torch"] is None
        print("OK")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "OK"


def test_exclusive_tracks_refcounts_and_rejects_bad_ids():
    alloc = PageAllocator(4)
    alloc.allocate(3)
    assert alloc.exclusive([0, 1, 2]) and alloc.exclusive(())
    alloc.incref([1])
    assert not alloc.exclusive([0, 1]) and alloc.exclusive([0, 2])
    assert not alloc.exclusive([3])  # free: refcount 0
    before = allocator_snapshot(alloc)
    for bad in ([4], [-1], [0, 9]):
        with pytest.raises(AllocatorError, match=r"expected a page id in \[0, 4\)"):
            alloc.exclusive(bad)
    assert allocator_snapshot(alloc) == before
