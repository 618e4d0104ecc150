"""Which CFG-parallel rank runs which KV branch (pure Python, no torch).

Branches are placed over the ``cfg`` mesh dimension in contiguous blocks of equal size, in the spec's
branch order, unless a ``branch -> coordinate`` map says otherwise::

    branches ("cond", "uncond"), cfg size 2           -> rank 0: ("cond",)         rank 1: ("uncond",)
    branches ("cond", "uncond", "img", "txt"), size 2 -> rank 0: ("cond", "uncond") rank 1: ("img", "txt")

NOTE: every coordinate gets the same number of branches: the user's model then sees the same batch on
every rank, and outputs gather with one fixed-size all-gather.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ardiff_modules.checks import is_int, require_int
from ardiff_modules.errors import SpecError, UnknownBranchError


def place_branches(
    branches: Sequence[str], cfg_size: int, placement: Mapping[str, int] | None = None
) -> tuple[tuple[str, ...], ...]:
    """Branches of each CFG coordinate ``0..cfg_size-1``, each in the spec's order.

    Parameters
    ----------
    branches:
        The spec's branches (their order is the global batch order).
    cfg_size:
        Size of the CFG mesh dimension (1: every branch on every rank).
    placement:
        Optional ``branch -> coordinate`` for every branch; default: contiguous equal blocks.
    """
    require_int("place_branches.cfg_size", cfg_size, minimum=1)
    names = tuple(branches)
    if len(names) % cfg_size:
        raise SpecError(
            f"CFG parallelism: expected the number of branches to be a multiple of the cfg mesh size {cfg_size} "
            f"(each rank runs the same number of branches), got {len(names)} branches {names}"
        )
    per_rank = len(names) // cfg_size
    if placement is None:
        return tuple(names[c * per_rank : (c + 1) * per_rank] for c in range(cfg_size))
    if not isinstance(placement, Mapping):
        raise SpecError(f"CFG placement: expected a mapping branch -> cfg coordinate, got {type(placement).__name__}")
    unknown = sorted(set(placement) - set(names), key=str)
    if unknown:
        raise UnknownBranchError(f"CFG placement: unknown branch(es) {unknown}; expected names from {names}")
    missing = [b for b in names if b not in placement]
    if missing:
        raise SpecError(f"CFG placement: expected a coordinate for every branch, got none for {missing}")
    for branch, coord in placement.items():
        if not is_int(coord) or not 0 <= coord < cfg_size:
            raise SpecError(
                f"CFG placement[{branch!r}]: expected a cfg coordinate in [0, {cfg_size}), got {coord!r}"
            )
    blocks = tuple(tuple(b for b in names if placement[b] == c) for c in range(cfg_size))
    sizes = [len(block) for block in blocks]
    if any(size != per_rank for size in sizes):
        raise SpecError(
            f"CFG placement: expected {per_rank} branch(es) on every cfg coordinate, got {sizes} branches "
            f"per coordinate"
        )
    return blocks
