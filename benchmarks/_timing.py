"""Shared helpers of the benchmark scripts: CUDA-event timing, JSON + plot output."""

from __future__ import annotations

import json
import platform
import statistics
from collections.abc import Callable
from pathlib import Path

import torch


def cuda_time_ms(fn: Callable[[], object], *, warmup: int = 5, iters: int = 15, inner: int = 10) -> float:
    """Median milliseconds per call of ``fn`` on the current stream, timed with CUDA events.

    Each sample times ``inner`` back-to-back calls, as the layers of a model run: the host
    launches ahead of the GPU, so per-call Python overhead is hidden unless it exceeds the
    kernel time (then it shows, as it would in a model).
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def environment() -> dict[str, str]:
    import importlib

    info = {"python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        info["flashinfer"] = importlib.import_module("flashinfer").__version__
    except Exception as exc:  # noqa: BLE001
        info["flashinfer"] = f"unavailable: {exc}"
    return info


def save_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False))
    print(f"wrote {path}")
