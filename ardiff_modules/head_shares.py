"""Which heads of a model layer each lane holds: a layer context's *shares* with retention groups.

A cache with retention groups (``KVCacheSpec.head_retention``) stores each group's heads in a lane of
their own (:mod:`ardiff_modules.lanes`). A model layer's attention then runs once per lane holding some of
its heads: :func:`~ardiff_modules.chunk_attention` splits q/k/v along the heads, runs each share's
kernels over that lane's pages and plan (heads of a lane share their key ranges: no mask), and puts the
outputs back in head order::

    q [streams, n, 12 heads, d] --split--> lane "local/8h": heads 1 2 4 5 7 8 10 11 -> ragged FA3, 2 chunks
                                           lane "other/4h": heads 0 3 6 9          -> ragged FA3, 8 chunks
                                --merge--> out [streams, n, 12, d]

The selectors and merge orders are built once per cache from host lists (no forward reads a device
tensor back); a uniform cache has no shares (its layer contexts are the one lane's).
"""

from __future__ import annotations

from collections.abc import Sequence
import torch

from ardiff_modules.core.head_retention import HeadPart
from ardiff_modules.spec import KVCacheSpec


#: Per model layer: ``(lane, layer in the lane, q heads, kv heads)`` of each lane holding heads there.
ShareMap = list[list[tuple[int, int, slice | torch.Tensor, slice | torch.Tensor]]]


def take_heads(t: torch.Tensor, heads: slice | torch.Tensor) -> torch.Tensor:
    """``t [streams, n, heads, ...]`` restricted to ``heads`` (dim 2)."""
    if isinstance(heads, slice):
        return t[:, :, heads]
    return t.index_select(2, heads)


def head_selector(heads: Sequence[int], device: torch.device) -> slice | torch.Tensor:
    """A ``slice`` for a contiguous ascending run of head indices, else an index tensor."""
    if list(heads) == list(range(heads[0], heads[0] + len(heads))):
        return slice(heads[0], heads[0] + len(heads))
    return torch.tensor(list(heads), dtype=torch.int64, device=device)


def merge_order(order: Sequence[int], device: torch.device) -> torch.Tensor | None:
    """The permutation restoring head order after concatenating the shares' outputs, whose query heads are
    ``order`` (host ints, in concatenation order); ``None`` when that is already head order."""
    if list(order) == list(range(len(order))):
        return None
    inverse = [0] * len(order)
    for position, head in enumerate(order):
        inverse[head] = position
    return torch.tensor(inverse, dtype=torch.int64, device=device)


def share_map(
    parts: Sequence[HeadPart], num_layers: int, gqa_group: int, device: torch.device
) -> tuple[ShareMap, list[torch.Tensor | None]]:
    """Per model layer, the lanes' shares (``(lane, layer in the lane, q heads, kv heads)``, lane order) and the
    merge order of their outputs (``gqa_group``: query heads per kv head)."""
    shares: ShareMap = [[] for _ in range(num_layers)]
    order: list[list[int]] = [[] for _ in range(num_layers)]
    for lane, part in enumerate(parts):
        for inner, (layer, kv_heads) in enumerate(zip(part.layers, part.heads)):
            q_heads = [h * gqa_group + j for h in kv_heads for j in range(gqa_group)]
            shares[layer].append((lane, inner, head_selector(q_heads, device), head_selector(kv_heads, device)))
            order[layer].extend(q_heads)
    return shares, [merge_order(heads, device) for heads in order]


def merge_heads(outputs: Sequence[torch.Tensor], order: torch.Tensor | None, dim: int = 2) -> torch.Tensor:
    """The shares' outputs (``[streams, n, share heads, ...]``) as one tensor in head order."""
    out = outputs[0] if len(outputs) == 1 else torch.cat(list(outputs), dim=dim)
    return out if order is None else out.index_select(dim, order)


def lane_share_map(
    spec: KVCacheSpec, parts: Sequence[HeadPart | None], device: torch.device
) -> tuple[ShareMap, list[torch.Tensor | None]] | None:
    """With retention groups (lanes' ``parts``), each model layer's lane shares and merge order; ``None`` for a
    uniform cache (one lane, no shares)."""
    if spec.head_retention is None:
        return None
    return share_map([p for p in parts if p is not None], spec.num_layers, spec.query_heads // spec.num_kv_heads, device)
