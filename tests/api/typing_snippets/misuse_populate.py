"""Misuse that mypy must reject (each line marked ``# mypy-error``): the test fails if one passes."""

from __future__ import annotations

import torch

from ardiff_modules import KVState, populate_cross_attention


def misuse(state: KVState, context: torch.Tensor) -> None:
    populate_cross_attention(state, "cond", 3, context)  # mypy-error
    populate_cross_attention(state, "cond", [1, 2], context)  # mypy-error
    populate_cross_attention(state, "cond", ["text"], context)  # mypy-error
