"""CPU smoke run of ``benchmarks.session_files`` (tiny shape, plain paging and contiguous extents): it runs, writes
JSON (spreads, bytes, GB/s, multiples of the chunk step, run metadata) + PNG, its checks pass, and a load that copies
no pages fails them (``ok`` false, exit status 1: a fast-but-wrong path cannot pass); ``--device cuda`` without CUDA
exits 2 with one line."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from tests.support.paths import REPO_ROOT

pytest.importorskip("safetensors")
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
FAST = ["--device", "cpu", "--shape", "tiny", "--chunks-timed", "1", "--rounds", "2", "--tier-rounds", "2",
        "--link-rounds", "2"]


def _module():  # noqa: ANN202
    if str(REPO_ROOT) not in sys.path:  # the benchmarks package (`python -m pytest` from the root has it already)
        sys.path.insert(0, str(REPO_ROOT))
    return importlib.import_module("benchmarks.session_files")


@pytest.mark.parametrize("extents", ["auto", "on"])  # on: the CUDA layout (rings in a pool of exactly one session)
def test_session_files_benchmark_smoke(tmp_path: Path, extents: str) -> None:
    payload = _module().main([*FAST, "--extents", extents, "--dir", str(tmp_path), "--out", str(tmp_path / "out")])
    saved = json.loads((tmp_path / "out" / "session_files.json").read_text())
    assert saved["ok"] is True and payload["ok"] is True
    assert saved["check"]["load_forward_bit_identical"] and saved["check"]["resume_forward_bit_identical"]
    assert saved["check"]["load_latents_equal"] and saved["check"]["load_pool_empty_after_close"]
    assert saved["check"]["load_forward_max_abs_diff"] == 0.0
    # The warm-up leaves the ring in slot order, as a load / resume lays it out: the kernels sum in the same order.
    rings = saved["check"]["ring_offsets_equal_after_load"], saved["check"]["ring_offsets_equal_after_resume"]
    assert rings == ((True, True) if extents == "on" else (None, None))
    sizes, config = saved["sizes"], saved["config"]
    assert config["layout"] == ("contiguous extents (ring)" if extents == "on" else "plain paging")
    assert config["rounds_done"] == 2 and config["keep_latents"] is True and config["forwards_per_chunk_step"] == 5
    # The file holds every committed page once, the text caches and the kept latents (and its header).
    assert sizes["committed_chunks_per_branch"] == {"cond": 3, "uncond": 3}  # sink 1 + window 2
    assert sizes["page_bytes"] + sizes["cross_bytes"] + sizes["latent_bytes"] < sizes["file_bytes"]
    assert sizes["latent_bytes"] > 0 and sizes["cross_bytes"] > 0
    step = saved["chunk_step"]["median_ms"]
    for name in ("save", "save_fsync", "load", "suspend", "resume"):
        row = saved["ops"][name]
        st = row["stats"]
        assert st["p25_ms"] <= st["median_ms"] <= st["p75_ms"] and st["iqr_ms"] >= 0, name
        assert row["gbps"] == pytest.approx(row["bytes"] / (row["median_ms"] / 1e3) / 1e9)
        assert row["x_chunk_step"] == pytest.approx(row["median_ms"] / step)
    assert saved["ops"]["save"]["bytes"] == sizes["file_bytes"]
    for name in ("disk_write", "disk_write_fsync", "disk_read", "d2h", "h2d"):
        assert saved["baselines"][name]["bytes"] == sizes["file_bytes"] and saved["baselines"][name]["gbps"] > 0
    assert not any(tmp_path.glob("ardiff_session_files_*")), "the temporary files are removed"
    assert saved["run"]["args"]["rounds"] == 2 and "git" in saved["run"]
    assert saved["env"]["torch"] == torch.__version__
    if HAS_MATPLOTLIB:
        assert (tmp_path / "out" / "session_files.png").stat().st_size > 0


def test_session_files_benchmark_catches_a_wrong_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ardiff_modules.host import files

    monkeypatch.setattr(files, "_copy_pages", lambda *args: None)  # "fast": the pages never reach the pool
    payload = _module().main([*FAST, "--rounds", "1", "--dir", str(tmp_path), "--out", str(tmp_path / "out")])
    assert payload["ok"] is False and payload["check"]["load_forward_bit_identical"] is False
    assert payload["check"]["resume_forward_bit_identical"] is True  # the host tier was not touched


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_session_files_cuda_missing_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _module().main(["--device", "cuda"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CUDA is not available" in err[0], err
