"""A tiny model run for bookkeeping tests: every layer of a prepared forward writes its K/V.

A committing forward commits only when every layer of the spec wrote its K/V in that forward
(``IncompleteForwardError`` otherwise). Tests about history, pages and sessions, not about the
attention itself, call :func:`write_every_layer` on the forward's layers before committing.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ardiff_modules import chunk_attention
from ardiff_modules.context import LayerContext


def write_every_layer(layers: Iterable[LayerContext], value: float | None = None, seed: int = 0) -> None:
    """Run :func:`ardiff_modules.chunk_attention` once on each of ``layers`` (writing its K/V).

    ``layers``: a list of :class:`LayerContext` (from ``get_kv_caches`` or ``ForwardContext.layers``).
    ``value``: fill q, k and v with it (``None``: deterministic random values from ``seed``,
    different for each layer).
    """
    for i, layer in enumerate(layers):
        forward = layer.forward
        streams, seq_len = forward.positions.shape
        kv_heads, head_dim = layer.k_cache.shape[-2:]
        owner = forward._owner
        heads = owner.spec.query_heads if owner is not None else kv_heads  # type: ignore[attr-defined]
        device, dtype = layer.k_cache.device, forward.dtype
        q_shape, kv_shape = (streams, seq_len, heads, head_dim), (streams, seq_len, kv_heads, head_dim)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + layer.layer_index * 7919 + i)
        q, k, v = (_values(shape, value, generator, device, dtype) for shape in (q_shape, kv_shape, kv_shape))
        sink_query = q if forward.relative_sinks else None
        chunk_attention(q, k, v, layer, sink_query=sink_query)


def _values(
    shape: tuple[int, ...], value: float | None, generator: torch.Generator, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    if value is not None:
        return torch.full(shape, float(value), device=device, dtype=dtype)
    return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
