"""CPU smoke run of benchmarks/sessions.py (tiny shapes): it runs, saves JSON + PNG, forks copy nothing."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_sessions_benchmark_smoke(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_sessions", ROOT / "benchmarks" / "sessions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    payload = module.main(["--shape", "tiny", "--device", "cpu", "--sessions", "1", "2", "--layers", "2",
                           "--iters", "2", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "sessions.json").read_text())
    assert saved["shapes"]["tiny"] == payload["shapes"]["tiny"]
    assert (tmp_path / "sessions.png").stat().st_size > 0
    for row in payload["shapes"]["tiny"]:
        assert row["fork_pages_allocated"] == 0 and row["fork_pool_unchanged"] is True
        assert row["batched_ms"] > 0 and row["serial_ms"] > 0
