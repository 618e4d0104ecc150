"""The misuse tests' starting point: two sessions of one small cache with history, an open denoising forward
and populated cross caches (:func:`build`, also the ``two_sessions`` fixture), and a snapshot of everything
a refused call must leave as it was (:func:`session_snapshot`, :func:`assert_sessions_unchanged`)."""

from __future__ import annotations

import dataclasses

import torch

from ardiff_modules import CrossAttentionSpec, KVCache, KVState
from tests.support.kv_writes import write_every_layer
from tests.support.small_cache import CHUNK, SMALL_SPEC

#: :data:`~tests.support.small_cache.SMALL_SPEC` with a second cross cache, ``"image"`` of 2 tokens.
TWO_SESSIONS_SPEC = dataclasses.replace(
    SMALL_SPEC, cross_attention=(CrossAttentionSpec("text", 3), CrossAttentionSpec("image", 2))
)


def _commit_seed_chunk(state: KVState, branch: str) -> None:
    write_every_layer(state.get_kv_caches(branch, CHUNK, commit_current=True))
    state.commit_paged_context(branch)


def text_pairs(seed: float = 1.0, layers: int = 2, tokens: int = 3):
    return [(torch.full((tokens, 2, 4), seed + i), torch.full((tokens, 2, 4), -(seed + i))) for i in range(layers)]


def build(num_pages: int = 16):
    """Two sessions with history, a pending denoise forward and a populated cross cache.

    Pages: a/cond history (0,1) (2,3); a/uncond history (4,5); b/cond history (6,7);
    a/cond pending (8,9) from an open denoising forward. Free: 10..15.
    """
    cache = KVCache(TWO_SESSIONS_SPEC, num_pages=num_pages, backend="reference")
    a = cache.open_session("a")
    b = cache.open_session("b")
    _commit_seed_chunk(a, "cond")
    _commit_seed_chunk(a, "cond")
    _commit_seed_chunk(a, "uncond")
    _commit_seed_chunk(b, "cond")
    a.get_kv_caches("cond", CHUNK, commit_current=False)
    a.populate_cross_attention("cond", "text", text_pairs(1.0))
    b.populate_cross_attention("cond", "text", text_pairs(5.0))
    # Non-trivial pool contents, so an unwanted write would show.
    cache._pool.kv.copy_(torch.randn_like(cache._pool.kv))
    return cache, a, b


def session_snapshot(cache: KVCache) -> dict:
    """Allocator (free order, refcounts), every session (branches, cross caches, closed) and the pool's K/V."""
    alloc = cache._allocator
    sessions = {}
    for sid, state in cache.sessions.items():
        branches = {}
        for branch in state.kv_branch_names:
            record = state._open_forward(branch)
            branches[branch] = (
                state.history_chunks(branch),
                state.pending_chunks(branch),
                state.token_offset(branch),
                state.committed_chunks(branch),
                None if record is None else (record.commit_current, record.num_chunks, id(record)),
                tuple(
                    n for n in TWO_SESSIONS_SPEC.cross_attention_names if state.is_cross_attention_populated(branch, n)
                ),
            )
        cross = {key: (e.version, e.k.clone(), e.v.clone()) for key, e in state._cross_entries().items()}
        sessions[sid] = (branches, cross, state.is_closed)
    return {
        "free": alloc.free_pages(),
        "refs": tuple(alloc.refcount(p) for p in range(alloc.num_pages)),
        "sessions": sessions,
        "kv": cache._pool.kv.clone(),
    }


def assert_sessions_unchanged(cache: KVCache, before: dict) -> None:
    """``cache`` is exactly as :func:`session_snapshot` saw it; the allocator's invariants hold."""
    after = session_snapshot(cache)
    assert after["free"] == before["free"]
    assert after["refs"] == before["refs"]
    assert torch.equal(after["kv"], before["kv"]), "pool K/V contents changed"
    assert after["sessions"].keys() == before["sessions"].keys()
    for sid, (branches, cross, closed) in before["sessions"].items():
        a_branches, a_cross, a_closed = after["sessions"][sid]
        assert a_branches == branches, sid
        assert a_closed == closed
        assert a_cross.keys() == cross.keys()
        for key, (version, k, v) in cross.items():
            a_version, a_k, a_v = a_cross[key]
            assert a_version == version and torch.equal(a_k, k) and torch.equal(a_v, v), (sid, key)
    cache._allocator.check_invariants()
