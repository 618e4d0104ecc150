"""Pure rules of the multi-GPU package, without processes: head split (GQA / MQA), branch placement,
misuse errors, and no import-time side effects."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ardiff_modules.distributed.heads import HeadSharding, check_heads, kv_replication
from ardiff_modules.distributed.placement import place_branches
from ardiff_modules.errors import SpecError, UnknownBranchError
from tests.support.paths import REPO_ROOT


@pytest.mark.parametrize(
    ("heads", "kv", "degree", "local_heads", "local_kv", "kv_ranges"),
    [
        (8, 8, 4, 2, 2, [(0, 2), (2, 4), (4, 6), (6, 8)]),  # MHA: split
        (8, 4, 4, 2, 1, [(0, 1), (1, 2), (2, 3), (3, 4)]),  # GQA, K == P
        (8, 2, 4, 2, 1, [(0, 1), (0, 1), (1, 2), (1, 2)]),  # GQA, K < P: replicated twice
        (8, 1, 4, 2, 1, [(0, 1)] * 4),                      # MQA: replicated on every rank
        (40, 40, 2, 20, 20, [(0, 20), (20, 40)]),           # Wan-14B on 2 GPUs
        (12, 12, 1, 12, 12, [(0, 12)]),                     # no SP
    ],
)
def test_head_sharding_rule(
    heads: int, kv: int, degree: int, local_heads: int, local_kv: int, kv_ranges: list[tuple[int, int]]
) -> None:
    for rank in range(degree):
        s = HeadSharding(heads, kv, degree, rank)
        assert (s.local_heads, s.local_kv_heads) == (local_heads, local_kv)
        assert s.kv_heads_range == kv_ranges[rank]
        assert s.heads_range == (rank * local_heads, (rank + 1) * local_heads)
        # Every query head of this rank reads a kv head this rank holds (GQA group = heads // kv).
        start, stop = s.kv_heads_range
        assert all(start <= h // (heads // kv) < stop for h in range(*s.heads_range))


@pytest.mark.parametrize(
    ("heads", "kv", "degree", "match"),
    [
        (6, 3, 2, "num_kv_heads: expected a multiple of the sequence-parallel degree 2 .* got 3"),
        (12, 6, 4, "num_kv_heads: expected a multiple of the sequence-parallel degree 4 .* got 6"),
        (6, 6, 4, "num_heads: expected a multiple of the sequence-parallel degree 4 .* got 6"),
        (8, 3, 2, "num_heads: expected a multiple of num_kv_heads=3, got 8"),
    ],
)
def test_head_counts_that_do_not_divide_raise_spec_error(heads: int, kv: int, degree: int, match: str) -> None:
    with pytest.raises(SpecError, match=match):
        check_heads("layer", heads, kv, degree)
    with pytest.raises(SpecError):
        HeadSharding(heads, kv, degree, 0)


def test_kv_replication() -> None:
    assert [kv_replication(k, 4) for k in (1, 2, 4, 8)] == [4, 2, 1, 1]
    with pytest.raises(SpecError, match="got num_kv_heads=3"):
        kv_replication(3, 4)


def test_branch_placement() -> None:
    assert place_branches(("cond", "uncond"), 2) == (("cond",), ("uncond",))
    assert place_branches(("cond", "uncond"), 1) == (("cond", "uncond"),)
    assert place_branches(("a", "b", "c", "d"), 2) == (("a", "b"), ("c", "d"))
    assert place_branches(("a", "b", "c", "d"), 2, {"a": 1, "b": 0, "c": 0, "d": 1}) == (("b", "c"), ("a", "d"))


@pytest.mark.parametrize(
    ("branches", "size", "placement", "error", "match"),
    [
        (("a", "b", "c"), 2, None, SpecError, "multiple of the cfg mesh size 2 .* got 3 branches"),
        (("a", "b"), 2, {"a": 0, "b": 0}, SpecError, r"expected 1 branch\(es\) on every cfg coordinate, got \[2, 0\]"),
        (("a", "b"), 2, {"a": 0}, SpecError, r"got none for \['b'\]"),
        (("a", "b"), 2, {"a": 0, "b": 2}, SpecError, r"in \[0, 2\), got 2"),
        (("a", "b"), 2, {"a": 0, "b": 1, "x": 0}, UnknownBranchError, r"unknown branch\(es\) \['x'\]"),
    ],
)
def test_branch_placement_misuse(
    branches: tuple[str, ...], size: int, placement: dict[str, int] | None, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        place_branches(branches, size, placement)


def test_host_vote_rows_of_ranks_at_different_votes_raise_naming_every_rank() -> None:
    """Every rank sees the same rows, so every rank raises the same RankDivergenceError (the ranks unlike the
    first one's vote and forward number); digests and values are left to the caller."""
    from ardiff_modules.distributed import RankDivergenceError
    from ardiff_modules.distributed.mesh import Vote, check_same_vote

    rows = ((Vote.FINISH, 5, 0, 0), (Vote.PREPARE, 6, 123, 0), (Vote.FINISH, 5, 0, 1))
    with pytest.raises(RankDivergenceError, match=(
        "rank 0 at the finish vote of forward 5, rank 1 at the prepare vote of forward 6, rank 2 at the finish vote"
    )) as info:
        check_same_vote((0, 1, 2), rows, "owner")
    assert info.value.ranks == (1,)
    with pytest.raises(RankDivergenceError) as info:
        check_same_vote((4, 5), ((Vote.PREPARE, 2, 0, 0), (Vote.PREPARE, 3, 0, 0)), "owner")
    assert info.value.ranks == (5,)
    check_same_vote((0, 1), ((Vote.PREPARE, 6, 1, 0), (Vote.PREPARE, 6, 2, 1)), "owner")


def test_importing_the_library_does_not_import_the_distributed_package() -> None:
    code = (
        "import sys, ardiff_modules, ardiff_modules.modules; "
        "assert 'ardiff_modules.distributed' not in sys.modules; "
        "import ardiff_modules.distributed, torch.distributed as d; "
        "assert not d.is_initialized(), 'a process group was created at import'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)
