"""``warm_up`` over a cache with retention groups (issue 41): it walks until every lane's window has filled and
evicted, checks room and restores the free queue in every lane, and a real rollout after it equals one on a cache
never warmed (CPU, reference backend)."""

from __future__ import annotations

import dataclasses

import torch

import ardiff_modules as am
from ardiff_modules.warm_start import walk_chunks
from tests.support.warm_rig import calls, generate, model_and_spec, populate

#: 3 layers x 4 kv heads: l (window 1) and g (sink 1 + window 2); lanes l/2h, g/2h, g/4h.
GROUPS = am.HeadRetention({"l": (0, 1), "g": (1, 2)}, [["l", "g", "l", "g"], ["g"] * 4, ["g", "l", "g", "l"]])


def _grouped() -> tuple[object, am.KVCache]:
    model, spec = model_and_spec(sink=0, window=None)
    spec = dataclasses.replace(spec, num_qo_heads=spec.num_kv_heads, head_retention=GROUPS)
    return model, am.KVCache(spec, num_pages=96, backend="reference")


def _lane_state(cache: am.KVCache) -> list[tuple[int, list[int]]]:
    return [(lane.allocator.num_used, lane.allocator.free_pages()) for lane in cache._lanes]


def test_warm_up_walks_the_longest_lane_and_restores_every_lane() -> None:
    model, cache = _grouped()
    assert len(cache._lanes) == 3
    before = _lane_state(cache)
    seen = calls(model)
    with torch.no_grad():
        report = am.warm_up(cache, seen, setup_session=lambda s: populate(model, s))
    chunks = max(walk_chunks(p) for p in GROUPS.groups.values())  # g: 1 + 2 + 1 = 4 (l alone: 2)
    assert chunks == 4 and report.stages[0].chunks == chunks
    assert len(seen.forwards) == 2 * chunks
    assert not cache.sessions and _lane_state(cache) == before  # every lane's queue as it was
    assert report.peak_pages_used > 0

    # A rollout after the warm-up equals one on a fresh grouped cache.
    outs = []
    for c in (cache, _grouped()[1]):
        state = c.open_session("user")
        populate(model, state, seed=1)
        outs.append(generate(c, model, [state], [c.spec.chunk_size] * 5, seed=2))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b)
