"""The attention layers and their checkpoint helpers, under their historical import path.

The code lives in one file per job; this module re-exports it so that
``from ardiff_modules.modules.attention import ...`` keeps working:

- :mod:`~ardiff_modules.modules.self_attention`: :class:`ChunkSelfAttention`;
- :mod:`~ardiff_modules.modules.cross_attention`: :class:`CachedCrossAttention`,
  :func:`populate_cross_attention`;
- :mod:`~ardiff_modules.modules.naming`: checkpoint naming (``param_names``,
  :data:`ATTENTION_PARAM_NAMES`, key renaming);
- :mod:`~ardiff_modules.modules.loading`: building a layer from a Wan2.1 / diffusers module
  (``from_wan`` / ``from_diffusers``);
- :mod:`~ardiff_modules.modules.common`: shared checks and head split / merge.
"""

from __future__ import annotations

from ardiff_modules.modules.common import (  # noqa: F401
    QKNorm,
    _check_context,
    _check_device_dtype,
    _check_input,
    _check_layer_context,
    _check_options,
    _head_geometry,
    _merge_heads,
    _qk_norm,
    _split_heads,
)
from ardiff_modules.modules.cross_attention import CachedCrossAttention, populate_cross_attention
from ardiff_modules.modules.loading import (  # noqa: F401
    _copy_from_source,
    _read_source,
    _source_linear,
    _source_norm,
    _SourceConfig,
)
from ardiff_modules.modules.naming import (  # noqa: F401
    _DIFFUSERS_IGNORED_PREFIXES,
    ATTENTION_PARAM_NAMES,
    PARAM_NAMES,
    ParamNames,
    _check_param_names,
    _CheckpointNamed,
    _OutProjection,
    _rename_attention_keys,
)
from ardiff_modules.modules.self_attention import ChunkSelfAttention

__all__ = [
    "ATTENTION_PARAM_NAMES",
    "PARAM_NAMES",
    "CachedCrossAttention",
    "ChunkSelfAttention",
    "ParamNames",
    "QKNorm",
    "populate_cross_attention",
]
