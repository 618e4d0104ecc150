"""CPU smoke test of ``benchmarks.serving`` (tiny preset): the four policies over one trace with more sessions
than the pool holds; every metric reported for every policy; the suspend policy's outputs equal the queue's
(where no session ever leaves the device), chunks after a resume included; nothing leaks; suspend's TTFC p90
at most queue's on a trace that guarantees it; ``--device cuda`` without CUDA exits 2 with one line."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from benchmarks import replot, serving

# Six users, one arriving per tick, each streaming 3 bursts of 1-2 chunks with 5-6 idle ticks between them, on a
# pool for 2. Under queue a session holds its room for >= 3 + 10 ticks, so the third and later arrivals wait
# >= 10 ticks (each lasting at least one chunk step, the tick floor); under suspend a paused resident is
# suspended for a newcomer, which streams in its arrival tick. So suspend's TTFC p90 <= queue's by construction.
TRACE = ["--device", "cpu", "--preset", "tiny", "--sessions", "6", "--resident", "2", "--arrival-gap", "1",
         "--bursts", "3", "--burst-chunks", "1,2", "--pause-ticks", "5,6", "--seed", "3"]
METRICS = ("ttfc_s", "ttfc_ticks", "rtf", "rtf_aggregate", "continuous_play_ratio", "frames_per_gpu_second",
           "frames_per_busy_second", "host_ms_per_tick", "resume", "suspend", "reprefill", "peak", "sessions_served",
           "sessions_finished", "chunks_delivered", "clock_s", "busy_s")
TRANSFER = ("count", "host_ms", "device_ms", "latency_ms", "fraction_of_chunk_step", "bytes_total", "gbps",
            "gbps_vs_link")


def test_serving_benchmark_cpu(tmp_path: Path) -> None:
    assert serving.main([*TRACE, "--out", str(tmp_path)]) == 0  # 1 if the outputs or a leak check failed
    payload = json.loads((tmp_path / "serving.json").read_text())
    assert payload["ok"] is True and set(payload["policies"]) == set(serving.POLICIES)
    config = payload["config"]
    assert config["compute"] == "model" and config["forwards_per_chunk_step"] == 5 and config["branches"] == [
        "cond", "uncond"]
    assert config["chunk_step_ms"] > 0 and payload["link_bandwidth"]["memcpy"]
    chunks = sum(t["chunks"] for t in payload["trace"])
    for name, res in payload["policies"].items():
        m = res["metrics"]
        assert set(METRICS) <= set(m), (name, set(METRICS) - set(m))
        for key in ("resume", "suspend", "reprefill"):
            assert set(TRANSFER) <= set(m[key]), (name, key)
        for key in ("ttfc_s", "rtf", "host_ms_per_tick"):
            assert {"p50", "p90"} <= set(m[key]) and m[key]["p50"] is not None, (name, key)
        assert 0 <= m["continuous_play_ratio"] <= 1 and m["frames_per_gpu_second"] > 0
        # More sessions than the pool holds were served, every chunk of the trace delivered.
        assert m["sessions_finished"] == m["sessions_total"] == 6 > config["resident"], name
        assert m["chunks_delivered"] == chunks and not m["truncated"]
        assert m["peak"]["resident"] <= config["resident"] and m["peak"]["device_bytes"] <= config["pool_bytes"]
        # No page leaks: after every session closed, the pool is free and the host tier empty.
        leak = res["leak_check"]
        assert leak["ok"] and leak["device_pages_used"] == 0 and leak["device_pages_free"] == config["pool_pages"]
        assert leak["host_pages"] == 0 and leak["host_bytes"] == 0 and leak["suspended"] == 0
        assert len(res["sessions"]) == 6 and len(res["ticks"]) == m["ticks"]
    p = {name: res["metrics"] for name, res in payload["policies"].items()}
    # The policies did what they are: suspend moved sessions through the host tier, close_idle re-prefilled.
    assert p["suspend"]["resumes"] > 0 and p["suspend"]["peak"]["host_bytes"] > 0 and p["suspend"]["closes"] == 0
    assert p["suspend"]["resume"]["count"] == p["suspend"]["resumes"] and p["suspend"]["resume"]["bytes_total"] > 0
    assert p["close_idle"]["closes"] > 0 and p["close_idle"]["reprefill"]["forwards"] > 0
    assert p["close_idle"]["suspends"] == 0 and p["queue"]["suspends"] == p["queue"]["closes"] == 0
    assert p["queue"]["peak"]["waiting"] > 0 and p["queue"]["peak"]["host_bytes"] == 0
    # migrate moved paused sessions to the second replica and back (no host tier, no close), each move timed.
    m = p["migrate"]
    assert m["migrations"] == m["migrate_out"]["count"] + m["migrate_in"]["count"] and m["migrate_in"]["count"] > 0
    assert m["migrate_out"]["bytes_total"] > 0 and m["peak"]["replica"] > 0 and m["peak"]["replica_bytes"] > 0
    assert m["suspends"] == m["closes"] == 0 and m["peak"]["host_bytes"] == 0
    assert m["ttfc_ticks"]["p90"] < p["queue"]["ttfc_ticks"]["p90"]  # a newcomer streams once a paused one moved
    assert payload["policies"]["migrate"]["leak_check"]["replica_pages_used"] == 0
    # TTFC: suspend at most queue (by construction of TRACE), in ticks and in seconds.
    assert p["suspend"]["ttfc_ticks"]["p90"] < p["queue"]["ttfc_ticks"]["p90"]
    assert p["suspend"]["ttfc_s"]["p90"] <= p["queue"]["ttfc_s"]["p90"]
    # The outputs check: every chunk of suspend equals queue's (torch.equal), chunks after a resume included.
    check = payload["check"]
    assert check["enabled"] and check["exact"] and check["ok"] and not check["mismatches"]
    pair = check["pairs"]["suspend_vs_queue"]
    assert pair["compared"] == pair["equal"] == chunks and pair["max_abs_diff"] == 0.0
    assert pair["after_resume"] >= p["suspend"]["resumes"] > 0  # every resume's next chunk compared
    moved = check["pairs"]["migrate_vs_queue"]  # bit-identical after every move back
    assert moved["compared"] == moved["equal"] == chunks and moved["after_resume"] >= m["migrate_in"]["count"] > 0
    close = check["pairs"]["close_idle_vs_queue"]
    assert close["compared"] == close["equal"] > 0 and close["compared"] + close["skipped_after_rebuild"] == chunks
    assert payload["run"]["args"]["sessions"] == 6 and "git" in payload["run"]
    if importlib.util.find_spec("matplotlib") is not None:  # the figure redraws from the stored JSON
        written = replot.replot(tmp_path, tmp_path / "png")
        assert [p.name for p in written] == ["serving.png"] and written[0].read_bytes()[:4] == b"\x89PNG"


def test_serving_attention_compute_cpu(tmp_path: Path) -> None:
    payload = serving.run([*TRACE, "--compute", "attention", "--sessions", "4", "--denoise-steps", "1",
                           "--out", str(tmp_path)])
    assert payload["ok"] and payload["config"]["compute"] == "attention"
    assert payload["config"]["forwards_per_chunk_step"] == 2
    # No positions in attention mode: close_idle's rebuilt sessions equal queue's too.
    close = payload["check"]["pairs"]["close_idle_vs_queue"]
    assert close["skipped_after_rebuild"] == 0 and close["after_resume"] > 0 and close["compared"] == close["equal"]


def test_serving_trace_is_deterministic() -> None:
    a, b = serving.make_trace(5, 7), serving.make_trace(5, 7)
    assert a == b and a != serving.make_trace(5, 8)
    assert [t.arrival for t in a] == sorted(t.arrival for t in a) and all(len(t.pauses) == len(t.bursts) - 1 for t in a)
    assert serving.pct([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5 and serving.pct([], 0.9) is None


def test_serving_help() -> None:
    with pytest.raises(SystemExit) as exc:
        serving.main(["--help"])
    assert exc.value.code == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_serving_cuda_missing_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        serving.main(["--device", "cuda"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CUDA is not available" in err[0], err


def test_serving_with_extents_in_a_fragmented_pool_cpu(tmp_path: Path) -> None:
    """Like the H200 run (sessions on a pool for 3, contiguous extents): ``close_idle`` reopens sessions into
    holes left between resident ones, several arriving in one tick; their extents take the holes (once
    refused: all of a forward's new extents had to be one run -- this trace's first refusal came at 8 sessions)."""
    payload = serving.run(["--device", "cpu", "--preset", "tiny", "--compute", "attention", "--sessions", "8",
                           "--resident", "3", "--denoise-steps", "1", "--extents", "--out", str(tmp_path)])
    assert payload["ok"] and payload["config"]["contiguous_extents"] is True
    for policy in serving.POLICIES:
        assert payload["policies"][policy]["metrics"]["sessions_finished"] == 8


@pytest.mark.parametrize("scope", ["model", "blocks"])
def test_serving_compiled_cfg_off_cpu(tmp_path: Path, scope: str) -> None:
    """The issue-45 setting's flags (``--compile --cfg off``; the eager dynamo backend on the CPU): one stream per
    session, every batch size compiled before the timed trace (no graph compiled inside it), the four policies
    served, migrate's moves within the CUDA tolerance of queue (a lone forward and a batched one round differently
    on the CPU with one stream)."""
    payload = serving.run(["--device", "cpu", "--preset", "tiny", "--sessions", "4", "--resident", "2",
                           "--arrival-gap", "1", "--bursts", "2", "--burst-chunks", "1,2", "--pause-ticks", "3,4",
                           "--seed", "3", "--cfg", "off", "--compile", "--compile-backend", "eager",
                           "--compile-scope", scope, "--out", str(tmp_path)])
    config = payload["config"]
    assert config["compile_scope"] == scope
    assert payload["ok"] and config["branches"] == ["cond"] and config["cfg"] == "off" and config["compiled"]
    assert config["compile_warmup_s"] > 0 and not payload["check"]["exact"]
    for name, res in payload["policies"].items():
        assert res["metrics"]["graphs_compiled_during_play"] == 0, name
        assert res["metrics"]["sessions_finished"] == 4, name
    assert payload["policies"]["migrate"]["metrics"]["migrations"] > 0
    assert payload["check"]["pairs"]["migrate_vs_queue"]["after_resume"] > 0


def test_serving_compile_needs_the_model() -> None:
    with pytest.raises(SystemExit):
        serving.parse_args(["--device", "cpu", "--compute", "attention", "--compile"])
