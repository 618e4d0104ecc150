"""The package's argument validators (pure Python): one for ints, bools and positive floats.

Each raises the library's error (``SpecError`` unless told otherwise) with a message that names
the argument, the expected and the actual value.
"""

from __future__ import annotations

import math
from typing import Any

from ardiff_modules.errors import ARDiffError, SpecError


def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool`` (``True`` is an int to Python, never a count to us)."""
    return isinstance(value, int) and not isinstance(value, bool)


def require_int(
    where: str,
    value: Any,
    *,
    minimum: int,
    below: int | None = None,
    what: str = "an int",
    error: type[ARDiffError] = SpecError,
) -> int:
    """``value`` is an int in ``[minimum, below)``; ``where`` names it (``"KVCacheSpec.page_size"``)."""
    expected = f"{what} >= {minimum}" if below is None else f"{what} in [{minimum}, {below})"
    if not is_int(value):
        raise error(f"{where}: expected {expected}, got {value!r} ({type(value).__name__})")
    if value < minimum or (below is not None and value >= below):
        raise error(f"{where}: expected {expected}, got {value}")
    return value


def require_bool(where: str, value: Any, error: type[ARDiffError] = SpecError) -> bool:
    if not isinstance(value, bool):
        raise error(f"{where}: expected a bool, got {value!r} ({type(value).__name__})")
    return value


def require_choice(where: str, value: Any, choices: tuple[str, ...], error: type[ARDiffError] = SpecError) -> str:
    """``value`` is one of ``choices`` (strings)."""
    if not isinstance(value, str) or value not in choices:
        raise error(f"{where}: expected one of {choices}, got {value!r}")
    return value


def require_positive_float(
    where: str, value: Any, *, optional: bool = False, error: type[ARDiffError] = SpecError
) -> float:
    """``value`` is a finite real number > 0 (an int or a float, not a bool): eps, theta, scale.

    ``optional`` only words the message (the caller lets ``None`` through before calling).
    """
    expected = "None or a finite number > 0" if optional else "a finite number > 0"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"{where}: expected {expected}, got {value!r} ({type(value).__name__})")
    if not (value > 0 and math.isfinite(value)):  # also rejects NaN (every comparison is False)
        raise error(f"{where}: expected {expected}, got {value!r}")
    return float(value)


def compute_dtype_mismatch(where: str, expected: Any, got: Any) -> str:
    """The message for a tensor that is not in the cache's compute dtype (``KVCacheSpec.dtype``).

    ``expected`` / ``got``: dtypes (``torch.bfloat16``) or names. The spec's default is bfloat16, so an
    fp32 model that leaves ``dtype`` out lands here at its first forward: the message names both fixes.
    """
    want, have = (str(d).removeprefix("torch.") for d in (expected, got))
    default = ", the default" if want == "bfloat16" else ""
    return (
        f"{where}: expected dtype torch.{want} (the cache's compute dtype, KVCacheSpec.dtype={want!r}{default}), "
        f"got torch.{have}: build the cache with KVCacheSpec(..., dtype={have!r}) to match the model, or run "
        f"the model in {want} (model.to(torch.{want}) and {want} inputs)"
    )


def needs_gqa(num_qo_heads: int, num_kv_heads: int) -> bool:
    """SDPA's ``enable_gqa``: whether the query heads differ from the kv heads.

    NOTE: a branch, not ``bool(a != b)``: under torch.compile with dynamic shapes the comparison is a
    SymBool, which SDPA refuses as ``enable_gqa`` (dynamo keeps ``bool()`` of it symbolic); an ``if``
    makes dynamo guard on it and pass a constant.
    """
    if num_qo_heads != num_kv_heads:  # noqa: SIM103 -- the branch is the point (see the note)
        return True
    return False
