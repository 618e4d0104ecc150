"""CPU smoke run of ``python -m benchmarks.multi_gpu``: ``--help``, the one-line exit without 2 GPUs, and a gloo dry run that
measures the Ulysses all-to-all."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT as ROOT

BENCH = [sys.executable, "-m", "benchmarks.multi_gpu"]  # from the repository root (cwd=ROOT)


def test_multi_gpu_benchmark_help_and_one_line_exit_without_gpus() -> None:
    import torch

    run = subprocess.run([*BENCH, "--help"], cwd=ROOT, check=False, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "--layouts" in run.stdout, run.stderr
    if torch.cuda.device_count() >= 2:
        pytest.skip("2 GPUs present: the exit-2 path is not reachable here")
    run = subprocess.run([*BENCH, "--steps", "1"], cwd=ROOT, check=False, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("multi_gpu.py: needs"), run.stderr


def test_multi_gpu_benchmark_cpu_dry_run_measures_the_all_to_all(tmp_path: Path) -> None:
    """``--device cpu`` runs every code path on gloo: the Ulysses layout reports the collective-only share,
    the share with layout copies and the share by removal; q/k/v go in one all-to-all (2 streams per rank)."""
    import json

    cmd = [*BENCH, "--device", "cpu", "--layouts", "single,ulysses", "--steps", "1",
           "--warmup-steps", "1", "--out", str(tmp_path)]
    run = subprocess.run(cmd, cwd=ROOT, check=False, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads((tmp_path / "multi_gpu.json").read_text())["results"]["tiny"]["layouts"]["ulysses"]
    assert result["agrees"], result
    # 5 forwards x 2 blocks x (1 fused q/k/v + 1 output + 2 cross-attention) all-to-alls.
    assert result["a2a_calls_per_step"] == 5 * 2 * 4, result
    for key in ("a2a_share", "a2a_with_layout_share", "a2a_share_by_removal", "no_comm_ms_per_chunk_step"):
        assert isinstance(result[key], float), (key, result)
    assert 0 < result["a2a_ms_per_step"] <= result["a2a_with_layout_ms_per_step"], result
    run = subprocess.run([*BENCH, "--device", "cpu", "--graph"], cwd=ROOT, check=False,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--graph: CUDA graphs need --device cuda" in run.stderr, run.stderr
