"""Smoke test of examples/serving_host_tier.py (CPU): sessions get suspended and resumed, nothing leaks."""

from __future__ import annotations

import sys

from tests.support.paths import EXAMPLES

sys.path.insert(0, str(EXAMPLES))

import serving_host_tier  # noqa: E402


def test_serving_host_tier_example_runs_and_uses_both_tiers(capsys) -> None:
    records = serving_host_tier.main(["--ticks", "10"])
    assert len(records) == 10 and "resident" in capsys.readouterr().out
    assert max(r["suspended"] for r in records) >= 1 and max(r["host_bytes"] for r in records) > 0
    assert max(r["resident"] for r in records) >= 2
