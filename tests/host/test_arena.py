"""``HostArena``'s free list of rows speaks the allocator's verbs (allocate / decref), lowest rows first."""

from __future__ import annotations

import importlib

import pytest

from ardiff_modules.host.arena import HostArena


def test_the_arena_allocates_the_lowest_rows_and_decref_frees_them_in_any_order() -> None:
    arena = HostArena((1, 2, 2), pinned=False, min_slab_bytes=4 * 4)  # 4 bytes a row, 4 rows a slab
    assert arena.allocate(3) == [(0, 0), (0, 1), (0, 2)]
    assert arena.allocate(2) == [(0, 3), (1, 0)]  # a second slab, grown on demand
    arena.decref([(0, 2), (0, 0)])
    assert arena.free_rows == 5 and arena.capacity_rows == 8
    assert arena.allocate(2) == [(0, 0), (0, 2)]  # lowest first again, whatever order they came back in


@pytest.mark.parametrize("old", ["ardiff_modules.forwards.host_tier", "ardiff_modules.forwards.host_arena",
                                 "ardiff_modules.forwards.extent_room"])
def test_the_host_tier_is_its_own_package_without_shims(old: str) -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)
    host = importlib.import_module("ardiff_modules.host")
    assert {"HostTier", "TierReport", "TransferHandle"} <= set(host.__all__)
