"""ardiff_modules: paged sink+window KV caches and attention modules for streaming AR video diffusion.

Typical use::

    import ardiff_modules as am

    spec = am.KVCacheSpec(num_layers=30, num_kv_heads=12, head_dim=128, chunk_size=4680, page_size=120,
                          sink_chunks=1, window_chunks=6, branches=("cond", "uncond"),
                          cross_attention=(am.CrossAttentionSpec("text", 512),))
    cache = am.KVCache(spec, budget_bytes=8 << 30, device="cuda")
    state = cache.open_session()
    with state.prepare_forward(("cond", "uncond"), seq_len=4680, commit_current=True) as fwd:
        out = model(x, fwd.layers)      # layers: am.ChunkSelfAttention / am.CachedCrossAttention

``__all__`` lists the public API: what a program, an attention module or an integration needs. Everything
else is importable from its own module only: internals (``ForwardLayout``, ``KVPool``, ``PageAllocator``,
transactions, reservations, the context registry), return types (``ardiff_modules.warm_start.WarmUpReport``,
``ardiff_modules.core.head_retention.HeadPart``), checkpoint conversion (``ardiff_modules.convert``) and the
exceptions that signal a caller's bug (every exception is in ``ardiff_modules.errors``, also ``am.errors``;
the top level re-exports the base class, those a working program handles and those the docs catch).
Changing ``__all__`` is an API change: ``tests/api/test_public_surface.py`` pins it (update CHANGELOG.md).

The torch-dependent names are imported lazily (PEP 562 ``__getattr__``): ``import ardiff_modules``
and the pure-Python layers (``core``, ``spec``, ``checks``, ``errors``) do not import torch.

Logging: every module logs under the ``ardiff_modules`` logger (``logging.getLogger(__name__)``),
with no handler installed by the library; see :mod:`ardiff_modules._logging`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Pure Python (no torch): imported eagerly.
from ardiff_modules.errors import (
    ARDiffError,
    BackendUnavailableError,
    CapacityError,
    CommitFailedError,
    CompileCacheError,
    CompileInputError,
    CompileInputWarning,
    KVCalibrationError,
    NonFiniteKVError,
    ParticipantCommitError,
    PendingContextError,
    SessionFileError,
    SessionNotSuspendedError,
    SessionSuspendedError,
    SessionTransferError,
    SpecError,
    StreamPositionError,
    TensorMismatchError,
    TrainingScopeError,
    UncommittedForwardsWarning,
)
from ardiff_modules.spec import CrossAttentionSpec, KVCacheSpec
from ardiff_modules.core.recache import RecacheRule
from ardiff_modules.core.retention import RetentionPolicy, SinkWindowMemoryPolicy, SinkWindowPolicy
from ardiff_modules.core.shot_sink import ShotSinkPolicy
from ardiff_modules.core.frame_retention import FrameWindowPolicy
from ardiff_modules.core.phased_retention import PhasedPolicy
from ardiff_modules.core.selected_retention import SelectedFramesPolicy
from ardiff_modules.core.head_retention import HeadRetention

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from ardiff_modules.backends.base import AttentionBackend
    from ardiff_modules.backends.flashinfer import FlashInferBackend
    from ardiff_modules.backends.reference import ReferenceBackend
    from ardiff_modules.cache import CacheStats, KVCache
    from ardiff_modules.compiled import CompiledStep
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
    from ardiff_modules.session import KVState
    from ardiff_modules.training import TrainingScope
    from ardiff_modules.warm_start import load_compile_cache, save_compile_cache, warm_up

__version__ = "0.1.0"

# Torch-dependent public names -> the module that defines them (imported on first access).
_LAZY: dict[str, str] = {
    "AttentionBackend": "ardiff_modules.backends.base",
    "CUDAGraphStep": "ardiff_modules.graphs",
    "CacheStats": "ardiff_modules.cache",
    "CompiledStep": "ardiff_modules.compiled",
    "CachedCrossAttention": "ardiff_modules.modules",
    "ChunkSelfAttention": "ardiff_modules.modules",
    "FlashInferBackend": "ardiff_modules.backends.flashinfer",
    "ForwardContext": "ardiff_modules.context",
    "KVCache": "ardiff_modules.cache",
    "KVState": "ardiff_modules.session",
    "LayerContext": "ardiff_modules.context",
    "ReferenceBackend": "ardiff_modules.backends.reference",
    "TrainingScope": "ardiff_modules.training",
    "RotaryEmbedding": "ardiff_modules.modules",
    "VideoRotaryEmbedding": "ardiff_modules.modules",
    "apply_rope": "ardiff_modules.modules",
    "cached_cross_attention": "ardiff_modules.modules",
    "chunk_attention": "ardiff_modules.modules",
    "populate_cross_attention": "ardiff_modules.modules",
    "load_compile_cache": "ardiff_modules.warm_start",
    "save_compile_cache": "ardiff_modules.warm_start",
    "warm_up": "ardiff_modules.warm_start",
}

def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # cache: later lookups are plain module attributes
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "ARDiffError",
    "AttentionBackend",
    "BackendUnavailableError",
    "CUDAGraphStep",
    "CacheStats",
    "CachedCrossAttention",
    "CapacityError",
    "ChunkSelfAttention",
    "CommitFailedError",
    "CompileCacheError",
    "CompileInputError",
    "CompileInputWarning",
    "CompiledStep",
    "CrossAttentionSpec",
    "FlashInferBackend",
    "ForwardContext",
    "FrameWindowPolicy",
    "HeadRetention",
    "KVCache",
    "KVCacheSpec",
    "KVCalibrationError",
    "KVState",
    "LayerContext",
    "NonFiniteKVError",
    "ParticipantCommitError",
    "PendingContextError",
    "PhasedPolicy",
    "RecacheRule",
    "ReferenceBackend",
    "RetentionPolicy",
    "RotaryEmbedding",
    "SelectedFramesPolicy",
    "SessionFileError",
    "SessionNotSuspendedError",
    "SessionSuspendedError",
    "SessionTransferError",
    "ShotSinkPolicy",
    "SinkWindowMemoryPolicy",
    "SinkWindowPolicy",
    "SpecError",
    "StreamPositionError",
    "TensorMismatchError",
    "TrainingScope",
    "TrainingScopeError",
    "UncommittedForwardsWarning",
    "VideoRotaryEmbedding",
    "apply_rope",
    "cached_cross_attention",
    "chunk_attention",
    "load_compile_cache",
    "populate_cross_attention",
    "save_compile_cache",
    "warm_up",
]
