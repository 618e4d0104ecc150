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
    return statistics.median(_sample_ms(fn, inner) for _ in range(iters))


def _sample_ms(fn: Callable[[], object], inner: int) -> float:
    """Milliseconds per call of ``inner`` back-to-back calls, between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(inner):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / inner


def interleaved_ms(
    fns: dict[str, Callable[[], object]], *, warmup: int = 5, rounds: int = 15, inner: int = 10
) -> dict[str, float]:
    """Median milliseconds per call of each function, sampled round-robin.

    One sample of every function per round, so clock ramps and thermal drift hit all of them
    alike; the ratios between entries are what the benchmarks report.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(_sample_ms(fn, inner))
    return {name: statistics.median(times) for name, times in samples.items()}


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
