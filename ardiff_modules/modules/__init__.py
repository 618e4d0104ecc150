"""``nn.Module`` attention layers and their functional forms.

==================  =================================================================================
``self_attention``  :class:`ChunkSelfAttention`
``cross_attention`` :class:`CachedCrossAttention`, :func:`populate_cross_attention`
``functional``      :func:`chunk_attention`, :func:`cached_cross_attention`, :func:`apply_rope`, :func:`rotate`
``rotary``          :class:`RotaryEmbedding`, :class:`VideoRotaryEmbedding`
``naming``          checkpoint naming of the layers' submodules (``param_names``, ``ATTENTION_PARAM_NAMES``)
``loading``         ``from_wan`` / ``from_diffusers``: a layer from an existing module (config + weights);
                    the layers' checked ``load_state_dict`` (a failed load changes nothing)
``common``          shared checks, q / k norms, head split / merge
==================  =================================================================================
"""

from ardiff_modules.modules.cross_attention import CachedCrossAttention, populate_cross_attention
from ardiff_modules.modules.functional import (
    Rope,
    RopeLayout,
    apply_rope,
    cached_cross_attention,
    chunk_attention,
    rotate,
    rotate_half,
)
from ardiff_modules.modules.naming import ATTENTION_PARAM_NAMES, ParamNames
from ardiff_modules.modules.rotary import RotaryEmbedding, VideoRotaryEmbedding
from ardiff_modules.modules.self_attention import ChunkSelfAttention

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
