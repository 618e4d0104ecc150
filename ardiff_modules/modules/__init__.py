"""``nn.Module`` attention layers and their functional forms."""

from ardiff_modules.modules.attention import (
    ATTENTION_PARAM_NAMES,
    CachedCrossAttention,
    ChunkSelfAttention,
    ParamNames,
    populate_cross_attention,
)
from ardiff_modules.modules.rotary import RotaryEmbedding, VideoRotaryEmbedding
from ardiff_modules.modules.functional import (
    Rope,
    RopeLayout,
    apply_rope,
    cached_cross_attention,
    chunk_attention,
    rotate,
    rotate_half,
)

__all__ = [
    "ATTENTION_PARAM_NAMES",
    "CachedCrossAttention",
    "ChunkSelfAttention",
    "ParamNames",
    "Rope",
    "RopeLayout",
    "RotaryEmbedding",
    "VideoRotaryEmbedding",
    "apply_rope",
    "cached_cross_attention",
    "chunk_attention",
    "populate_cross_attention",
    "rotate",
    "rotate_half",
]
