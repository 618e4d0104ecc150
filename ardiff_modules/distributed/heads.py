"""How Ulysses splits attention heads over a sequence-parallel group (pure Python, no torch).

Each of the ``P`` ranks of the group attends over every token of a chunk with ``1/P`` of the heads:
query heads ``[r * H/P, (r + 1) * H/P)`` on rank ``r``. GQA / MQA key-value heads follow their query
heads::

    H = 8 query heads, K kv heads, P = 4 ranks         rank:      0      1      2      3
    K = 8  (MHA, K % P == 0)   kv heads per rank 2             q 0,1  q 2,3  q 4,5  q 6,7
                                                               kv 0,1 kv 2,3 kv 4,5 kv 6,7
    K = 4  (GQA, K % P == 0)   kv heads per rank 1             kv 0   kv 1   kv 2   kv 3
    K = 2  (GQA, K < P, P % K == 0: replicated)                kv 0   kv 0   kv 1   kv 1
    K = 1  (MQA, replicated on every rank)                     kv 0   kv 0   kv 0   kv 0

Supported: ``H % P == 0`` and either ``K % P == 0`` (the kv heads are split) or ``P % K == 0``
(each rank keeps the one kv head its query heads read; it is replicated ``P / K`` times, so K/V
bytes per rank are ``1/K`` of the total rather than ``1/P``). Anything else (e.g. ``K = 6`` on
``P = 4``) raises :class:`~ardiff_modules.errors.SpecError`: a rank's query heads would read two
partial kv heads.
"""

from __future__ import annotations

from dataclasses import dataclass

from ardiff_modules.checks import require_int
from ardiff_modules.errors import SpecError


@dataclass(frozen=True)
class HeadSharding:
    """The heads rank ``rank`` of a ``degree``-way sequence-parallel group holds.

    Attributes
    ----------
    num_heads, num_kv_heads:
        Global query / key-value heads.
    degree, rank:
        Sequence-parallel group size and this rank's index in it.
    """

    num_heads: int
    num_kv_heads: int
    degree: int
    rank: int

    def __post_init__(self) -> None:
        owner = "HeadSharding"
        require_int(f"{owner}.degree", self.degree, minimum=1)
        require_int(f"{owner}.rank", self.rank, minimum=0, below=self.degree)
        check_heads(owner, self.num_heads, self.num_kv_heads, self.degree)

    @property
    def local_heads(self) -> int:
        """Query heads per rank, ``H / P``."""
        return self.num_heads // self.degree

    @property
    def replication(self) -> int:
        """How many ranks hold each kv head: ``P / K`` when ``K < P``, else 1."""
        return kv_replication(self.num_kv_heads, self.degree)

    @property
    def local_kv_heads(self) -> int:
        """Key-value heads per rank: ``K / P``, or 1 when replicated."""
        return self.num_kv_heads // self.degree if self.replication == 1 else 1

    @property
    def kv_heads_range(self) -> tuple[int, int]:
        """``[start, stop)`` of the global kv heads this rank holds."""
        if self.replication == 1:
            start = self.rank * self.local_kv_heads
            return start, start + self.local_kv_heads
        start = self.rank // self.replication
        return start, start + 1

    @property
    def heads_range(self) -> tuple[int, int]:
        """``[start, stop)`` of the global query heads this rank holds."""
        return self.rank * self.local_heads, (self.rank + 1) * self.local_heads


def kv_replication(num_kv_heads: int, degree: int) -> int:
    """``P / K`` when kv heads are replicated (``K < P``, ``P % K == 0``), else 1 (``K % P == 0``)."""
    if num_kv_heads % degree == 0:
        return 1
    if degree % num_kv_heads == 0:
        return degree // num_kv_heads
    raise SpecError(
        f"sequence parallelism: expected num_kv_heads a multiple of the degree {degree} or a divisor of it "
        f"(replicated kv heads), got num_kv_heads={num_kv_heads}"
    )


def check_heads(owner: str, num_heads: int, num_kv_heads: int, degree: int) -> None:
    """Raise :class:`SpecError` unless ``num_heads`` / ``num_kv_heads`` can be split over ``degree`` ranks."""
    require_int(f"{owner}.num_heads", num_heads, minimum=1)
    require_int(f"{owner}.num_kv_heads", num_kv_heads, minimum=1)
    if num_heads % num_kv_heads:
        raise SpecError(f"{owner}.num_heads: expected a multiple of num_kv_heads={num_kv_heads}, got {num_heads}")
    if num_heads % degree:
        raise SpecError(
            f"{owner}.num_heads: expected a multiple of the sequence-parallel degree {degree} (Ulysses gives each "
            f"rank num_heads / degree query heads), got {num_heads}"
        )
    try:
        kv_replication(num_kv_heads, degree)
    except SpecError:
        raise SpecError(
            f"{owner}.num_kv_heads: expected a multiple of the sequence-parallel degree {degree} (split) or a "
            f"divisor of it (replicated), got {num_kv_heads}"
        ) from None
