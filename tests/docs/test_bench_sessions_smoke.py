"""CPU smoke run of ``benchmarks.sessions`` (tiny shapes): it runs, saves JSON (with spreads and run
metadata) + PNG, forks copy nothing; ``--device cuda`` without CUDA exits 2 with one line."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch
from tests.support.paths import REPO_ROOT


ROOT = REPO_ROOT


def _load_sessions():  # noqa: ANN202
    if str(ROOT) not in sys.path:  # the benchmarks package (`python -m pytest` from the root has it already)
        sys.path.insert(0, str(ROOT))
    return importlib.import_module("benchmarks.sessions")


def test_sessions_benchmark_smoke(tmp_path: Path) -> None:
    module = _load_sessions()
    payload = module.main(["--shape", "tiny", "--device", "cpu", "--sessions", "1", "2", "--layers", "2",
                           "--rounds", "3", "--inner", "1", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "sessions.json").read_text())
    assert saved["shapes"]["tiny"] == payload["shapes"]["tiny"]
    assert (tmp_path / "sessions.png").stat().st_size > 0
    for row in payload["shapes"]["tiny"]:
        assert row["fork_pages_allocated"] == 0 and row["fork_pool_unchanged"] is True
        assert row["batched_ms"] > 0 and row["serial_ms"] > 0
        for key in ("batched", "serial"):
            stats = row[f"{key}_stats"]
            assert stats["median_ms"] == pytest.approx(row[f"{key}_ms"])
            assert stats["p25_ms"] <= stats["median_ms"] <= stats["p75_ms"] and stats["iqr_ms"] >= 0
            assert stats["n_samples"] == 3 and stats["calls_per_sample"] == 1
        assert row["speedup"] == pytest.approx(row["serial_ms"] / row["batched_ms"])
    assert saved["run"]["args"]["rounds"] == 3 and "git" in saved["run"] and "utc" in saved["run"]
    assert saved["env"]["torch"] == torch.__version__


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_sessions_cuda_missing_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _load_sessions().main(["--device", "cuda", "--shape", "tiny"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CUDA is not available" in err[0], err
