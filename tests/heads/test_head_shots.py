"""``drop_window`` / ``begin_shot`` on a session of a cache with retention groups: every lane at once, each group
by its own policy; a refusal in any lane changes no lane (issue 43 item 3)."""

from __future__ import annotations

import pytest
import torch

import ardiff_modules as am
from tests.heads.oracle import random_qkv
from tests.heads.test_head_failures import snapshot
from tests.heads.test_head_oracle import grouped_cache, make_spec

SHOTS = am.HeadRetention({"l": (0, 1), "g": am.ShotSinkPolicy(1, 2, 1)}, [["l", "g"], ["g", "l"]])
PLAIN = am.HeadRetention({"l": (0, 1), "g": (1, 2)}, [["l", "g"], ["g", "l"]])


def step(session: am.KVState, spec: am.KVCacheSpec, gen: torch.Generator, commit: bool = True) -> None:
    with session.prepare_forward(("cond", "uncond"), spec.chunk_size, commit_current=commit) as fwd:
        for ctx in fwd.layers:
            am.chunk_attention(*random_qkv(2, spec.chunk_size, spec.query_heads, spec.num_kv_heads, spec.head_dim,
                                           gen, torch.float32), ctx)


def indices(session: am.KVState) -> dict[str, tuple[int, ...]]:
    return {type(lane.spec.policy).__name__: pages.history_index
            for lane, pages in zip(session.cache._lanes, session._lane_pages("cond"))}


def test_each_group_drops_and_pins_by_its_own_policy() -> None:
    spec = make_spec(layers=2, kv_heads=2)
    cache = grouped_cache(spec, SHOTS, sessions=2)
    session, gen = cache.open_session(), torch.Generator().manual_seed(0)
    for _ in range(3):
        step(session, spec, gen)
    session.begin_shot()
    for _ in range(4):
        step(session, spec, gen)
    assert indices(session) == {"SinkWindowPolicy": (6,), "ShotSinkPolicy": (0, 3, 6)}
    used = [lane.allocator.num_used for lane in cache._lanes]
    session.drop_window("cond")
    assert indices(session) == {"SinkWindowPolicy": (), "ShotSinkPolicy": (0,)}
    freed = [before - lane.allocator.num_used for before, lane in zip(used, cache._lanes)]
    assert sorted(freed) == sorted([spec.pages_per_chunk, 2 * spec.pages_per_chunk])  # l: its window, g: 2 chunks
    step(session, spec, gen)
    assert [p.token_offset for p in session._lane_pages("cond")] == [8 * spec.chunk_size] * 2
    session.close()
    assert all(lane.allocator.num_used == 0 for lane in cache._lanes)


def test_a_refusal_in_any_lane_changes_no_lane() -> None:
    spec = make_spec(layers=2, kv_heads=2)
    cache = grouped_cache(spec, SHOTS, sessions=2)
    session, gen = cache.open_session(), torch.Generator().manual_seed(1)
    for _ in range(3):
        step(session, spec, gen)
    fwd = session.prepare_forward(("cond",), spec.chunk_size, commit_current=False)
    before = snapshot(cache)
    for op in (session.drop_window, session.begin_shot):
        with pytest.raises(am.PendingContextError, match=r"got one on \['cond'\]"):
            op()
        assert snapshot(cache) == before
    fwd.abort()
    plain = grouped_cache(spec, PLAIN, sessions=2)
    other = plain.open_session()
    with pytest.raises(am.SpecError, match=r"expected a cache whose retention \(or one retention group's\) pins a "
                                           r"shot sink"):
        other.begin_shot()
