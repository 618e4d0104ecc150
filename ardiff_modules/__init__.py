"""ardiff_modules: paged sink+window KV caches and attention modules for streaming AR video diffusion.

Typical use::

    spec = KVCacheSpec(num_layers=30, num_kv_heads=12, head_dim=128, chunk_size=4680, page_size=120,
                       sink_chunks=1, window_chunks=6, branches=("cond", "uncond"),
                       cross_attention=(CrossAttentionSpec("text", 512),))
    cache = KVCache(spec, budget_bytes=8 << 30, device="cuda")
    state = cache.open_session()
    with state.prepare_forward(("cond", "uncond"), seq_len=4680, commit_current=True) as fwd:
        out = model(x, fwd.layers)      # layers: ChunkSelfAttention / CachedCrossAttention

NOTE: the torch-dependent names are imported lazily (PEP 562 ``__getattr__``) so that
the pure-Python layers (``spec``, ``errors``, ``allocator``, ``window``, ``history``)
import without torch, as DESIGN.md section 2 requires.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Pure Python (no torch): imported eagerly.
from ardiff_modules.allocator import PageAllocator
from ardiff_modules.errors import (
    AllocatorError,
    ARDiffError,
    BackendUnavailableError,
    CacheClosedError,
    CapacityError,
    CrossAttentionNotPopulatedError,
    ForwardFinishedError,
    InferenceOnlyError,
    NonFiniteKVError,
    PendingContextError,
    PlanNotFoundError,
    SequenceLengthError,
    SessionClosedError,
    SpecError,
    TensorMismatchError,
    UnknownBranchError,
    UnknownCacheError,
)
from ardiff_modules.spec import CrossAttentionSpec, KVCacheSpec
from ardiff_modules.window import SinkWindowPolicy

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from ardiff_modules.cache import CacheStats, KVCache
    from ardiff_modules.context import ForwardContext, LayerContext
    from ardiff_modules.graphs import CUDAGraphStep
    from ardiff_modules.modules import (
        CachedCrossAttention,
        ChunkSelfAttention,
        RotaryEmbedding,
        VideoRotaryEmbedding,
        apply_rope,
        cached_cross_attention,
        chunk_attention,
        populate_cross_attention,
    )
    from ardiff_modules.layout import ForwardLayout, StreamLayout
    from ardiff_modules.pool import KVPool
    from ardiff_modules.state import KVState

__version__ = "0.1.0"

# Torch-dependent public names -> the module that defines them (imported on first access).
_LAZY: dict[str, str] = {
    "CacheStats": "ardiff_modules.cache",
    "KVCache": "ardiff_modules.cache",
    "ForwardContext": "ardiff_modules.context",
    "LayerContext": "ardiff_modules.context",
    "CachedCrossAttention": "ardiff_modules.modules",
    "ChunkSelfAttention": "ardiff_modules.modules",
    "apply_rope": "ardiff_modules.modules",
    "cached_cross_attention": "ardiff_modules.modules",
    "chunk_attention": "ardiff_modules.modules",
    "populate_cross_attention": "ardiff_modules.modules",
    "ForwardLayout": "ardiff_modules.layout",
    "StreamLayout": "ardiff_modules.layout",
    "KVPool": "ardiff_modules.pool",
    "KVState": "ardiff_modules.state",
    "RotaryEmbedding": "ardiff_modules.modules",
    "VideoRotaryEmbedding": "ardiff_modules.modules",
    "ATTENTION_PARAM_NAMES": "ardiff_modules.modules",
    "ParamNames": "ardiff_modules.modules",
    "RopeLayout": "ardiff_modules.modules",
    "rotate": "ardiff_modules.modules",
    "convert_wan_state_dict": "ardiff_modules.convert",
    "convert_attention_state_dict": "ardiff_modules.convert",
    "SinkWindowMemoryPolicy": "ardiff_modules.window",
    "RetentionPolicy": "ardiff_modules.window",
    "CUDAGraphStep": "ardiff_modules.graphs",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: later lookups are plain module attributes
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "ARDiffError",
    "AllocatorError",
    "BackendUnavailableError",
    "CUDAGraphStep",
    "CacheClosedError",
    "CacheStats",
    "CachedCrossAttention",
    "CapacityError",
    "ChunkSelfAttention",
    "CrossAttentionNotPopulatedError",
    "CrossAttentionSpec",
    "ForwardContext",
    "ForwardFinishedError",
    "ForwardLayout",
    "KVCache",
    "KVCacheSpec",
    "KVPool",
    "InferenceOnlyError",
    "KVState",
    "LayerContext",
    "NonFiniteKVError",
    "PageAllocator",
    "PendingContextError",
    "PlanNotFoundError",
    "RotaryEmbedding",
    "SequenceLengthError",
    "SessionClosedError",
    "SinkWindowPolicy",
    "SpecError",
    "StreamLayout",
    "TensorMismatchError",
    "UnknownBranchError",
    "UnknownCacheError",
    "VideoRotaryEmbedding",
    "ATTENTION_PARAM_NAMES",
    "ParamNames",
    "RetentionPolicy",
    "RopeLayout",
    "SinkWindowMemoryPolicy",
    "apply_rope",
    "convert_attention_state_dict",
    "convert_wan_state_dict",
    "rotate",
    "cached_cross_attention",
    "chunk_attention",
    "populate_cross_attention",
]
