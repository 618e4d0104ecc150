"""The small cache (:data:`~tests.support.small_cache.SMALL_SPEC`) uniform and with retention groups, and what a
test of a mechanism over lanes checks: every lane's bookkeeping, every lane's pool bytes.

Three geometries of 2 layers x 2 kv heads, sink 1 + window 2 where uniform::

    "uniform"    one lane "all"                       (the spec itself)
    "per-head"   layer 0: heads [l, g], layer 1: [l, l]  ->  lanes l/1h (layer 0), l/2h (layer 1), g/1h (layer 0)
                 l: window 1, g: sink 1 + window 2       (three lanes, pages of 64 and 128 bytes)
    "per-layer"  layer 0: window 1, layer 1: sink 1 + window 2  ->  two lanes of one layer x 2 heads each
    "one-group"  every head in one group (sink 1 + window 2)     ->  one lane "all/2h", named as a group's
    "per-frame"  the per-head map with frame groups (a chunk is 2 frames of one page): l keeps the last frame,
                 g the first frame + the last 3 (chunks trimmed to their kept frames' pages)
"""

from __future__ import annotations

import dataclasses

import torch

import ardiff_modules as am
from ardiff_modules.core.branch import extent_slots_of
from tests.support.small_cache import BOTH, SMALL_SPEC

KINDS = ("uniform", "per-head", "per-layer", "one-group", "per-frame")
PER_HEAD = am.HeadRetention({"l": (0, 1), "g": (1, 2)}, [["l", "g"], ["l", "l"]])
PER_LAYER = am.HeadRetention.per_layer([(0, 1), (1, 2)], 2)
ONE_GROUP = am.HeadRetention.uniform(2, 2, (1, 2))
PER_FRAME = am.HeadRetention(
    {"l": am.FrameWindowPolicy(0, 1, 2), "g": am.FrameWindowPolicy(1, 3, 2)}, [["l", "g"], ["l", "l"]]
)


def spec_of(kind: str, **fields) -> am.KVCacheSpec:
    """:data:`SMALL_SPEC` (``fields`` replaced) as ``kind``: uniform, or with its retention groups."""
    spec = dataclasses.replace(SMALL_SPEC, **fields)
    if kind == "uniform":
        return spec
    heads = {"per-head": PER_HEAD, "per-layer": PER_LAYER, "one-group": ONE_GROUP, "per-frame": PER_FRAME}[kind]
    return dataclasses.replace(spec, sink_chunks=0, window_chunks=None, head_retention=heads)


def make_cache(kind: str, num_pages: int = 32, fields: dict | None = None, **kwargs) -> am.KVCache:
    """A reference-backend cache of :func:`spec_of` (``kwargs``: ``KVCache``'s); ``num_pages`` pages of the whole
    geometry (split between the lanes by their peaks)."""
    return am.KVCache(spec_of(kind, **(fields or {})), num_pages=num_pages, backend="reference", **kwargs)


def lane_books(cache: am.KVCache):
    """Every lane's free queue (in order) and refcounts, and every open session's branches in every lane."""
    lanes = [(lane.allocator.free_pages(), tuple(map(lane.allocator.refcount, range(lane.allocator.num_pages))))
             for lane in cache._lanes]
    sessions = {
        sid: {
            b: tuple(
                (p.history, p.pending, p.extent, p.token_offset, p.committed_chunks, dict(p.recent), sorted(p.latents))
                for p in state._lane_pages(b)
            )
            for b in state.kv_branch_names
        }
        for sid, state in cache.sessions.items()
    }
    return lanes, sessions


def lane_pools(cache: am.KVCache) -> list[torch.Tensor]:
    """Every lane's pool bytes (a copy)."""
    return [lane.pool.kv.view(torch.uint8).clone() for lane in cache._lanes]


def host_books(cache: am.KVCache):
    """Every lane's host pages (ids, refcounts) and bytes."""
    return [(s.pages.pages(), tuple(map(s.pages.refcount, s.pages.pages())), s.pages.nbytes)
            for s in cache._host_tier.stores]


def everything(cache: am.KVCache):
    """What a refusal must leave as it was: bookkeeping and pool bytes of every lane, the host tier's pages."""
    return lane_books(cache), lane_pools(cache), host_books(cache), cache._host_tier.suspended_ids()


def assert_unchanged(cache: am.KVCache, before, *, free_bytes: bool = True) -> None:
    """Nothing changed since :func:`everything`; ``free_bytes=False``: but the bytes of free pages (a copy that
    failed after writing into pages it had reserved, then released them)."""
    books, pools, host, suspended = before
    assert lane_books(cache) == books
    for lane, pool in zip(cache._lanes, pools):
        pages = list(range(lane.allocator.num_pages)) if free_bytes else sorted(lane.allocator.used_pages())
        assert torch.equal(lane.pool.kv.view(torch.uint8)[:, :, pages], pool[:, :, pages])
    assert host_books(cache) == host and cache._host_tier.suspended_ids() == suspended
    assert_clean(cache)


def assert_clean(cache: am.KVCache) -> None:
    for lane in cache._lanes:
        lane.allocator.check_invariants()
    for store in cache._host_tier.stores:
        store.pages.check_invariants()


def history_bytes(cache: am.KVCache, state: am.KVState) -> list[dict[str, torch.Tensor]]:
    """Per lane, per branch: the K/V of its history pages in history order, every layer of the lane (what a
    suspend or a save must preserve: the pool contents, not only the bookkeeping)."""
    out = []
    for i, lane in enumerate(cache._lanes):
        pages = {b: [p for c in state._lane_pages(b)[i].history for p in c] for b in BOTH}
        out.append({b: lane.pool.kv[:, :, pages[b]].clone() for b in BOTH})
    return out


def lane_slots(state: am.KVState) -> list[dict[str, tuple[int | None, ...]]]:
    """Per lane, per branch: each history chunk's extent slot (what a ragged kernel's key order follows)."""
    return [{b: extent_slots_of(state._lane_pages(b)[i]) for b in BOTH} for i in range(len(state._lane_branches))]


def same_history(
    cache: am.KVCache, state: am.KVState, twin_cache: am.KVCache, twin: am.KVState, slots: bool = True
) -> bool:
    """Every lane holds the twin's history: the same chunks (indices, starts), the same bytes, the same extent
    slots (``slots=False``: a fork whose chunks sat in its parent's extent comes back as a ring of its own)."""
    mine, ref = history_bytes(cache, state), history_bytes(twin_cache, twin)
    books = [[(p.history_index, p.history_start, p.committed_tokens) for p in state._lane_pages(b)] for b in BOTH]
    twin_books = [[(p.history_index, p.history_start, p.committed_tokens) for p in twin._lane_pages(b)] for b in BOTH]
    return (
        books == twin_books and (not slots or lane_slots(state) == lane_slots(twin))
        and all(torch.equal(a[b], r[b]) for a, r in zip(mine, ref) for b in BOTH)
    )
