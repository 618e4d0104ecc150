"""A ``token_mask`` with retention groups: given over the union key order, each lane takes its columns (host only).

Lanes keep different history chunks, so a stream's keys differ per lane. The caller's mask covers every key any
lane sees: per stream, the union of the lanes' history tokens sorted by absolute position, then the ``seq_len``
pending tokens -- ``[streams, seq_len, max over streams of union keys]`` (columns past a stream's keys ignored).
Each lane's plan gets the columns of its own keys (history in its order, then pending), padded with ``False``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ardiff_modules.core.branch import BranchPages


def union_positions(lanes: Sequence[BranchPages]) -> list[int]:
    """A stream's history key positions over its lanes: every token any lane keeps, ascending."""
    return sorted({p for h in lanes for p in h.history_positions()})


def union_max_keys(lane_branches: Sequence[Sequence[BranchPages]], seq_len: int) -> int:
    """Columns of a grouped forward's ``token_mask``: the widest stream's union history plus ``seq_len``."""
    streams = len(lane_branches[0])
    return max(len(union_positions([lane[s] for lane in lane_branches])) for s in range(streams)) + seq_len


def lane_token_masks(
    token_mask: torch.Tensor, lane_branches: Sequence[Sequence[BranchPages]], seq_len: int
) -> tuple[torch.Tensor, ...]:
    """Per lane, ``token_mask``'s columns of that lane's keys (see the module docstring)."""
    streams = len(lane_branches[0])
    columns: list[list[list[int]]] = [[] for _ in lane_branches]
    for s in range(streams):
        lanes = [lane[s] for lane in lane_branches]
        union = union_positions(lanes)
        where = {p: c for c, p in enumerate(union)}
        pending = list(range(len(union), len(union) + seq_len))
        for cols, h in zip(columns, lanes):
            cols.append([where[p] for p in h.history_positions()] + pending)
    masks = []
    for cols in columns:
        out = torch.zeros(streams, seq_len, max(map(len, cols)), dtype=torch.bool, device=token_mask.device)
        for s, row in enumerate(cols):
            out[s, :, : len(row)] = token_mask[s][:, torch.tensor(row, dtype=torch.long, device=token_mask.device)]
        masks.append(out)
    return tuple(masks)
