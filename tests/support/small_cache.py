"""A small float32 cache on the reference backend and the helpers that drive it through the public API only.

2 layers, 2 KV heads, head_dim 4, chunks of 4 tokens in pages of 2, sink 1 + window 2, branches ``("cond",
"uncond")``, a 3-token ``"text"`` cross cache (:data:`SMALL_SPEC`). "Unchanged" is checked bit for bit on the
pool (:func:`bit_copy`) and on the allocator and sessions (:func:`bookkeeping`).
"""

from __future__ import annotations

import torch

from ardiff_modules import CrossAttentionSpec, KVCache, KVCacheSpec, KVState, chunk_attention
from ardiff_modules.errors import ForwardFinishedError, PlanNotFoundError

CHUNK = 4
HEADS = 2
DIM = 4
BOTH = ("cond", "uncond")
SMALL_SPEC = KVCacheSpec(
    num_layers=2,
    num_kv_heads=2,
    head_dim=DIM,
    chunk_size=CHUNK,
    page_size=2,
    sink_chunks=1,
    window_chunks=2,
    branches=BOTH,
    cross_attention=(CrossAttentionSpec("text", 3),),
    dtype="float32",
)
#: What a released context may raise instead of ForwardFinishedError (its plan handle is gone).
RELEASED = (ForwardFinishedError, PlanNotFoundError)


def make_small_cache(num_pages: int = 32, **kwargs) -> KVCache:
    """A :data:`SMALL_SPEC` cache on the reference backend (``kwargs``: ``KVCache``'s, e.g. ``check_finite``);
    the ``small_cache`` fixture is one with the defaults."""
    return KVCache(SMALL_SPEC, num_pages=num_pages, backend="reference", **kwargs)


def tensors(streams: int, n: int = CHUNK, *, fill: float | None = None, seed: int = 0):
    """q, k, v of ``streams`` streams and ``n`` tokens (``fill``: a constant, so a stray write shows)."""
    shape = (streams, n, HEADS, DIM)
    if fill is not None:
        return tuple(torch.full(shape, float(fill)) for _ in range(3))
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=g) for _ in range(3))


def run_layers(layers, streams: int, n: int = CHUNK, seed: int = 0) -> list[torch.Tensor]:
    """One attention call per layer, as a model makes them."""
    return [chunk_attention(*tensors(streams, n, seed=seed + i), layer) for i, layer in enumerate(layers)]


def commit_chunk(state: KVState, branches=BOTH, n: int = CHUNK, seed: int = 0) -> None:
    with state.prepare_forward(branches, n, commit_current=True) as fwd:
        run_layers(fwd.layers, len(branches), n, seed)


def bit_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of a float32 tensor's bit pattern (NaN == NaN, -0.0 != 0.0): a snapshot later writes do not change."""
    return t.detach().clone().view(torch.int32)


def bookkeeping(cache: KVCache, *, ordered: bool = True):
    """Allocator (free queue, refcounts) and every open session's branches, via public API."""
    alloc = cache._allocator
    free = alloc.free_pages() if ordered else tuple(sorted(alloc.free_pages()))
    sessions = {
        sid: {
            b: (
                state.history_chunks(b),
                state.pending_chunks(b),
                state.token_offset(b),
                state.committed_chunks(b),
                id(state._open_forward(b)) if state._open_forward(b) is not None else None,
            )
            for b in state.kv_branch_names
        }
        for sid, state in cache.sessions.items()
    }
    return free, tuple(alloc.refcount(p) for p in range(alloc.num_pages)), sessions


def pages_of(state: KVState, branch: str) -> list[int]:
    return [p for chunk in state.history_chunks(branch) for p in chunk]
