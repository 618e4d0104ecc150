"""``benchmarks.fp8_lanes`` on the CPU: its three timed calls attend what they claim (over a FlashInfer stand-in that
computes attention from the scales it is given), and the per-step estimate adds the layer map's launches."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

from benchmarks import fp8_lanes


class _AttendingWrapper:
    """A ragged prefill wrapper that attends in float32, dequantizing FP8 inputs with the per-head scales of ``run``."""

    def __init__(self, workspace: torch.Tensor, layout: str, backend: str = "auto") -> None:
        assert layout == "NHD" and backend in ("auto", "fa3")  # (baselines.contiguous_attention's: FA3 on Hopper)
        self.planned: dict[str, Any] = {}

    def plan(self, qo_indptr, kv_indptr, heads, kv_heads, dim, **kwargs) -> None:  # noqa: ANN001
        assert qo_indptr.device.type == "cpu" and kv_indptr.device.type == "cpu"
        self.planned = {"heads": heads, "kv_heads": kv_heads, "dim": dim, **kwargs}

    def run(self, q, k, v, *scales):  # noqa: ANN001, ANN201
        fp8 = self.planned["q_data_type"] == torch.float8_e4m3fn
        assert (len(scales) == 3) == fp8, "FP8 runs take (scale_q, scale_k, scale_v); bf16 runs none"
        assert q.dtype == k.dtype == v.dtype == self.planned["q_data_type"]
        if fp8:
            q, k, v = (x.float() * s.float()[:, None] for x, s in zip((q, k, v), scales))
        out = torch.nn.functional.scaled_dot_product_attention(
            q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1))
        return out.transpose(0, 1).to(self.planned.get("o_data_type") or self.planned["q_data_type"])  # (FlashInfer's default)


@pytest.fixture
def attending_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("flashinfer")
    fake.BatchPrefillWithRaggedKVCacheWrapper = _AttendingWrapper  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", fake)


def test_the_three_calls_attend_the_same_keys(attending_flashinfer: None) -> None:
    """bf16, the FP8 kernel on pre-quantized inputs and the FP8 kernel after quantizing q agree to FP8's precision
    with the exact attention (a swapped scale or an unquantized input would be off by orders of magnitude)."""
    calls = fp8_lanes.kernels(2, fp8_lanes.FRAME_TOKENS, torch.device("cpu"))
    assert set(calls) == {"bf16", "fp8", "fp8_q"}
    outs = {name: fn().float() for name, fn in calls.items()}
    reference = outs["bf16"]
    assert reference.shape == (fp8_lanes.CHUNK_TOKENS, 2, fp8_lanes.HEAD_DIM)
    for name in ("fp8", "fp8_q"):
        rel = (outs[name] - reference).norm() / reference.norm()
        assert rel < 0.1, (name, float(rel))
    assert torch.equal(outs["fp8"], outs["fp8_q"])  # the same quantization, once ahead and once per call


def _cell(heads: int, keys: int, bf16: float, fp8: float) -> dict[str, Any]:
    stat = lambda ms: {"median_ms": ms}  # noqa: E731
    return {"heads": heads, "keys": keys, "stats": {"bf16": stat(bf16), "fp8": stat(fp8), "fp8_q": stat(fp8 + 0.01)}}


def test_step_estimate_adds_each_layers_two_lanes_and_layer_zero() -> None:
    """Layer 0: all heads over the full window; each later layer one spatial and one temporal launch (none for an
    empty lane); five forwards per chunk step; a cell the map needs but the run lacks is named, not guessed."""
    static = (9, 2, 0)  # layer 0's entry is unused; layer 2 has no spatial heads: one launch
    cells = {
        (12, fp8_lanes.FULL_KEYS): _cell(12, fp8_lanes.FULL_KEYS, 3.0, 2.5),
        (2, fp8_lanes.SPATIAL_KEYS): _cell(2, fp8_lanes.SPATIAL_KEYS, 0.2, 0.3),
        (10, fp8_lanes.TEMPORAL_KEYS): _cell(10, fp8_lanes.TEMPORAL_KEYS, 1.0, 1.1),
        (12, fp8_lanes.TEMPORAL_KEYS): _cell(12, fp8_lanes.TEMPORAL_KEYS, 1.2, 1.3),
    }
    est = fp8_lanes.step_estimate(cells, static)
    assert est["launches_per_forward"] == 4
    assert est["ms_per_forward"]["bf16"] == pytest.approx(3.0 + 0.2 + 1.0 + 1.2)
    assert est["ms_per_forward"]["fp8"] == pytest.approx(2.5 + 0.3 + 1.1 + 1.3)
    assert est["fp8_minus_bf16_ms_per_chunk_step"] == pytest.approx((5.2 - 5.4) * 5)
    assert est["fp8_q_minus_bf16_ms_per_chunk_step"] == pytest.approx((5.24 - 5.4) * 5)
    gap = est["end_to_end_gap"]
    assert gap is not None and gap["fp8_minus_bf16_ms"] == pytest.approx(280.376492 - 238.465883, abs=1e-3)
    del cells[2, fp8_lanes.SPATIAL_KEYS]
    assert fp8_lanes.step_estimate(cells, static) == {"missing_cells": [(2, fp8_lanes.SPATIAL_KEYS)]}


def test_plot_draws_one_line_per_key_span(tmp_path) -> None:  # noqa: ANN001
    pytest.importorskip("matplotlib")
    cells = [{**_cell(h, keys, 1.0, 1.0 + h / 100), "fp8_over_bf16": 1.0 + h / 100, "fp8_q_over_bf16": 1.1}
             for keys in (7800, 9360) for h in (1, 4, 12)]
    path = fp8_lanes.plot({"cells": cells, "env": {"gpu": "test"}}, tmp_path / "fp8_lanes.png")
    assert path is not None and path.stat().st_size > 0
