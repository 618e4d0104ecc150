"""Smoke test of ``benchmarks/end_to_end.py`` on the CPU (tiny preset, float32).

The three attention variants (this library, rolling buffer + SDPA, rolling buffer + FlexAttention,
eager on CPU) must produce the same committed outputs after the window has filled and the timed chunk
step has evicted (the rolling buffers memmove), CFG on and off, and the library's KV peak must be
exactly (sinks + window + pending) chunks per branch, the size of the rolling buffers.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import end_to_end  # noqa: E402


def test_end_to_end_cpu_smoke(tmp_path: Path) -> None:
    # warm-up 4 = sink 1 + window 2 + 1 chunks: the buffers are full, so the timed step rolls / evicts.
    argv = ["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--chunks-timed", "1",
            "--warmup-chunks", "4", "--out", str(tmp_path)]
    assert end_to_end.main(argv) == 0
    path = tmp_path / "end_to_end.json"
    assert path.exists()
    payload = json.loads(path.read_text())
    assert payload["agree"] is True
    assert set(payload["results"]) == {"cfg_on", "cfg_off"}
    for setting, streams in (("cfg_on", 2), ("cfg_off", 1)):
        result = payload["results"][setting]
        assert result["streams"] == streams
        variants = result["variants"]
        assert set(variants) == {"library", "rolling_sdpa", "rolling_flex"}
        for name, res in variants.items():
            assert res["rel_err_vs_library"] <= 1e-4, (setting, name, res["rel_err_vs_library"])
            assert len(res["ms_per_chunk_step_all"]) == 1 and res["ms_per_chunk_step"] > 0
            assert res["latent_frames_per_s"] > 0 and res["speedup_vs_rolling_sdpa"] > 0
        assert variants["rolling_flex"]["flex_compiled"] is False  # eager flex on CPU by default
        assert variants["library"]["backend"] == "reference"
        # KV: the library's peak equals the rolling buffers, (sinks + window + pending) chunks per branch.
        assert variants["library"]["kv_peak_bytes"] == variants["rolling_sdpa"]["kv_peak_bytes"]
        assert payload["targets"]["kv_peak_equals_target"][setting] is True
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "end_to_end.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
