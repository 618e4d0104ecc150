"""``nn.Module`` attention layers and their functional forms."""

from ardiff_modules.modules.attention import (
    CachedCrossAttention,
    ChunkSelfAttention,
    populate_cross_attention,
)
from ardiff_modules.modules.rotary import RotaryEmbedding, VideoRotaryEmbedding
from ardiff_modules.modules.functional import (
    Rope,
    apply_rope,
    cached_cross_attention,
    chunk_attention,
    rotate_half,
)

__all__ = [
    "CachedCrossAttention",
    "ChunkSelfAttention",
    "Rope",
    "RotaryEmbedding",
    "VideoRotaryEmbedding",
    "apply_rope",
    "cached_cross_attention",
    "chunk_attention",
    "populate_cross_attention",
    "rotate_half",
]
