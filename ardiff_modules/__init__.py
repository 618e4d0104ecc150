"""ardiff_modules: paged sink+window KV caches and attention modules for streaming AR video diffusion.

Typical use::

    spec = KVCacheSpec(num_layers=30, num_kv_heads=12, head_dim=128, chunk_size=4680, page_size=120,
                       sink_chunks=1, window_chunks=6, branches=("cond", "uncond"),
                       cross_attention=(CrossAttentionSpec("text", 512),))
    cache = KVCache(spec, budget_bytes=8 << 30, device="cuda")
    state = cache.open_session()
    with state.prepare_forward(("cond", "uncond"), seq_len=4680, commit_current=True) as fwd:
        out = model(x, fwd.layers)      # layers: ChunkSelfAttention / CachedCrossAttention
"""

from ardiff_modules.allocator import PageAllocator
from ardiff_modules.cache import CacheStats, KVCache
from ardiff_modules.context import ForwardContext, LayerContext
from ardiff_modules.errors import (
    AllocatorError,
    ARDiffError,
    BackendUnavailableError,
    CapacityError,
    CrossAttentionNotPopulatedError,
    PendingContextError,
    PlanNotFoundError,
    SequenceLengthError,
    SessionClosedError,
    SpecError,
    TensorMismatchError,
    UnknownBranchError,
    UnknownCacheError,
)
from ardiff_modules.modules import (
    CachedCrossAttention,
    ChunkSelfAttention,
    apply_rope,
    cached_cross_attention,
    chunk_attention,
    populate_cross_attention,
)
from ardiff_modules.plan import ForwardLayout, StreamLayout
from ardiff_modules.pool import KVPool
from ardiff_modules.spec import CrossAttentionSpec, KVCacheSpec
from ardiff_modules.state import KVState
from ardiff_modules.window import SinkWindowPolicy

__version__ = "0.1.0"

__all__ = [
    "ARDiffError",
    "AllocatorError",
    "BackendUnavailableError",
    "CacheStats",
    "CachedCrossAttention",
    "CapacityError",
    "ChunkSelfAttention",
    "CrossAttentionNotPopulatedError",
    "CrossAttentionSpec",
    "ForwardContext",
    "ForwardLayout",
    "KVCache",
    "KVCacheSpec",
    "KVPool",
    "KVState",
    "LayerContext",
    "PageAllocator",
    "PendingContextError",
    "PlanNotFoundError",
    "SequenceLengthError",
    "SessionClosedError",
    "SinkWindowPolicy",
    "SpecError",
    "StreamLayout",
    "TensorMismatchError",
    "UnknownBranchError",
    "UnknownCacheError",
    "apply_rope",
    "cached_cross_attention",
    "chunk_attention",
    "populate_cross_attention",
]
