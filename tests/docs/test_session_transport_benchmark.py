"""CPU smoke run of ``benchmarks.session_transport`` (tiny shape, two spawned processes over gloo): it runs, writes
JSON (the four timed calls, the wire baseline, bytes, GB/s, multiples of the chunk step, run metadata), the session
comes back from its round trips bit-identical and the receiver's pool is empty; ``--device cuda`` without CUDA
exits 2 with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from benchmarks import session_transport

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)


def test_session_transport_benchmark_smoke(tmp_path: Path) -> None:
    payload = session_transport.main(["--device", "cpu", "--rounds", "2", "--link-rounds", "2", "--chunks-timed", "1",
                                      "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "session_transport.json").read_text())
    assert payload["ok"] is True and saved["ok"] is True
    check = saved["check"]
    assert check["forward_bit_identical_after_round_trips"] and check["forward_max_abs_diff"] == 0.0
    assert check["latents_equal"] and check["receiver_pool_empty"]
    config, sizes = saved["config"], saved["sizes"]
    assert config["backend"] == "gloo" and config["wire_device"] == "cpu" and config["rounds"] == 2
    assert saved["transport"] == {"requested": "auto", "used": ["wire"]}  # a CPU pool never offers CUDA IPC
    assert sizes["total_bytes"] == sum(v for k, v in sizes.items() if k != "total_bytes")
    assert sizes["pages_bytes"] > 0 and sizes["cross_bytes"] > 0 and sizes["latent_bytes"] > 0
    for name in ("send_0_to_1", "recv_on_1", "send_1_to_0", "recv_on_0"):
        row = saved["moves"][name]
        assert len(row["stats"]["samples_ms"]) == 2 and row["bytes"] == sizes["total_bytes"], name
        assert row["gbps"] == pytest.approx(row["bytes"] / (row["median_ms"] / 1e3) / 1e9)
        assert row["x_chunk_step"] == pytest.approx(row["median_ms"] / saved["chunk_step"]["median_ms"])
    assert set(saved["baselines"]) == {"wire"} and saved["baselines"]["wire"]["gbps"] > 0
    assert saved["run"]["args"]["rounds"] == 2 and "git" in saved["run"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_session_transport_cuda_missing_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        session_transport.main(["--device", "cuda"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CUDA is not available" in err[0], err


def test_session_transport_ipc_on_the_cpu_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        session_transport.main(["--device", "cpu", "--transport", "ipc"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--transport ipc: expected --device cuda" in err[0], err
