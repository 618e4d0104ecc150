"""The benchmark scripts' one timing helper, on ``torch.utils.benchmark``, plus run metadata and JSON output.

Timing (every figure is a median with its interquartile range; ratios are taken between medians):

* :func:`interleaved` -- the side-by-side comparison. One ``torch.utils.benchmark.Timer`` per variant;
  after ``warmup`` untimed calls of each, ``rounds`` rounds in which every variant takes one sample in
  turn (so clock ramps and thermal drift hit all variants alike). A sample is ``Timer.timeit(inner)``:
  the Timer's own two untimed warm-up calls, then ``inner`` back-to-back calls between two reads of its
  clock, which synchronises the accelerator before reading the time. The host launches ahead of the GPU
  inside a sample, so per-call Python overhead hides behind GPU work as in a model (and shows where it
  exceeds the kernel time, as it would in a model). The samples are merged with
  ``Measurement.merge``; ``Measurement.median`` / ``.iqr`` are per call.
* :func:`measure` -- one callable alone: the same sampling with a fixed ``inner``, or ``inner=None`` for
  ``Timer.adaptive_autorange`` (block size chosen so the synchronisation is < 0.01 % of a block; blocks
  until the IQR is under ``threshold`` of the median or ``max_run_time`` is spent).
* :func:`each_call` -- a *stateful* sequence whose every call must run exactly once (a chunk step
  advances a stream; ``Timer.timeit`` would insert untimed calls): each call timed alone between two
  reads of the same synchronising clock (``torch.utils.benchmark.utils.timer.timer``); with
  ``sync_end=False`` host time only (the device is synchronised before the call, not after).
* :func:`once` -- one call (first-use costs, set-up), same clock.

Results are :class:`Stats` (``median_ms``, ``iqr_ms``, ``p25_ms``, ``p75_ms``, the per-sample times).
``torch.utils.benchmark`` was chosen over ``triton.testing.do_bench``: ``do_bench`` times one call per
sample and flushes the L2 cache between calls, which measures a kernel in isolation, not several
launches back to back as in a model.

Output: :func:`save_json` adds :func:`environment` (versions, GPU) and :func:`run_metadata` (git commit
and dirty flag, UTC time, command line, a cheap ``torch.utils.collect_env`` summary) to every payload.
:func:`require_gpu` / :func:`fail` give the scripts' one-line exit-2 messages.

Paths: :data:`RESULTS` is the folder of the committed results, one file per benchmark (configuration)
and device; :func:`result_path` gives a script's output path: ``DIR/<name>`` under ``--out DIR``, by
default the committed one, ``results/<stem>_<device><suffix>`` with :func:`device_tag` (``h200``,
``h200x2`` for two of them, ``cpu``). Nothing here imports torch or FlashInfer at import time, so every
script's ``--help`` stays fast.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

#: How the timings were taken, for the JSON and the README.
METHOD = (
    "torch.utils.benchmark: Timer.timeit(inner) samples (2 untimed warm-up calls, then `inner` back-to-back "
    "calls between two accelerator-synchronising clock reads), variants sampled round-robin; "
    "median and IQR (p25..p75) per call; ratios between medians"
)
PREVIOUS_METHOD = "CUDA events, median of 15 round-robin samples of 10 back-to-back calls each (no spread recorded)"
#: The committed results: ``<benchmark>[_<configuration>]_<device>.<ext>``, the newest of each (git keeps the rest).
RESULTS = Path(__file__).resolve().parent / "results"


# --------------------------------------------------------------------------------- statistics
@dataclasses.dataclass(frozen=True)
class Stats:
    """Milliseconds per call: median and spread over the samples (each sample: ``calls_per_sample`` calls)."""

    median_ms: float
    iqr_ms: float
    p25_ms: float
    p75_ms: float
    samples_ms: tuple[float, ...]  #: per-call milliseconds of each sample, in the order taken
    calls_per_sample: int

    @property
    def n_samples(self) -> int:
        return len(self.samples_ms)

    @property
    def rel_iqr(self) -> float:
        """IQR / median: the relative spread."""
        return self.iqr_ms / self.median_ms if self.median_ms > 0 else float("nan")

    @classmethod
    def from_ms(cls, per_call_ms: Sequence[float], calls_per_sample: int = 1) -> Stats:
        """From per-call milliseconds, one value per sample (linear-interpolated quartiles, as ``Measurement``)."""
        values = [float(v) for v in per_call_ms]
        if not values:
            raise ValueError("Stats.from_ms: expected at least one sample")
        if len(values) == 1:
            p25 = p75 = values[0]
        else:
            p25, _, p75 = statistics.quantiles(values, n=4, method="inclusive")
        return cls(statistics.median(values), p75 - p25, p25, p75, tuple(values), calls_per_sample)

    @classmethod
    def from_measurement(cls, measurement: Any, calls_per_sample: int) -> Stats:
        """From a ``torch.utils.benchmark.Measurement`` (seconds per call): its median and IQR."""
        times = [t * 1e3 for t in measurement.times]
        quartiles = cls.from_ms(times, calls_per_sample)
        return dataclasses.replace(
            quartiles, median_ms=measurement.median * 1e3, iqr_ms=measurement.iqr * 1e3
        )

    def as_dict(self, *, samples: bool = True) -> dict[str, Any]:
        """JSON form: ``median_ms``, ``iqr_ms``, ``p25_ms``, ``p75_ms``, ``n_samples``, ``calls_per_sample``."""
        out: dict[str, Any] = {
            "median_ms": self.median_ms, "iqr_ms": self.iqr_ms, "p25_ms": self.p25_ms, "p75_ms": self.p75_ms,
            "n_samples": self.n_samples, "calls_per_sample": self.calls_per_sample,
        }
        if samples:
            out["samples_ms"] = list(self.samples_ms)
        return out

    def __str__(self) -> str:
        return f"{_fmt(self.median_ms)} ms (IQR {_fmt(self.iqr_ms)}, n={self.n_samples}x{self.calls_per_sample})"


def _fmt(ms: float) -> str:
    return f"{ms:.4g}"


def ratios(stats: Mapping[str, Stats], baseline: str, *, faster_is_higher: bool = True) -> dict[str, float]:
    """Ratios of medians against ``stats[baseline]``: ``baseline / x`` (speed) or ``x / baseline`` (time)."""
    ref = stats[baseline].median_ms
    return {k: (ref / s.median_ms if faster_is_higher else s.median_ms / ref) for k, s in stats.items()}


# --------------------------------------------------------------------------------- timing
def clock() -> float:
    """Seconds, after synchronising the accelerator if one is in use (``torch.utils.benchmark``'s timer)."""
    from torch.utils.benchmark.utils.timer import timer

    return timer()


def _sync() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _timer(fn: Callable[[], object], label: str) -> Any:
    import torch
    from torch.utils import benchmark

    # num_threads: the Timer would otherwise pin torch to 1 CPU thread while it times.
    return benchmark.Timer(stmt="fn()", globals={"fn": fn}, label=label, num_threads=torch.get_num_threads())


def interleaved(
    fns: Mapping[str, Callable[[], object]], *, inner: int = 10, rounds: int = 15, warmup: int = 3
) -> dict[str, Stats]:
    """Time every variant side by side: ``rounds`` rounds of one ``Timer.timeit(inner)`` sample per variant.

    Returns :class:`Stats` per variant (milliseconds per call). ``inner`` calls run back to back within a
    sample, so the host launches ahead of the device as in a model; the first call's launch latency
    shows once per sample. Every call of ``fn`` must leave the state as it found it (or in an
    equivalent one): the Timer adds two untimed warm-up calls per sample.
    """
    from torch.utils import benchmark

    if inner < 1 or rounds < 1 or warmup < 0:
        raise ValueError(f"interleaved: expected inner >= 1, rounds >= 1, warmup >= 0; got {inner}, {rounds}, {warmup}")
    timers = {name: _timer(fn, name) for name, fn in fns.items()}
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync()
    taken: dict[str, list[Any]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, timer in timers.items():
            taken[name].append(timer.timeit(inner))
    return {name: Stats.from_measurement(benchmark.Measurement.merge(ms)[0], inner) for name, ms in taken.items()}


def measure(
    fn: Callable[[], object], *, inner: int | None = 10, rounds: int = 15, warmup: int = 3,
    threshold: float = 0.05, min_run_time: float = 0.2, max_run_time: float = 5.0,
) -> Stats:
    """Time one callable: like :func:`interleaved` with a single entry, or, with ``inner=None``,
    ``Timer.adaptive_autorange(threshold, min_run_time, max_run_time)`` (it picks the block size)."""
    if inner is not None:
        return interleaved({"fn": fn}, inner=inner, rounds=rounds, warmup=warmup)["fn"]
    for _ in range(warmup):
        fn()
    _sync()
    m = _timer(fn, "fn").adaptive_autorange(threshold, min_run_time=min_run_time, max_run_time=max_run_time)
    return Stats.from_measurement(m, m.number_per_run)


def once(fn: Callable[[], Any], *, sync_start: bool = True, sync_end: bool = True) -> tuple[Any, float]:
    """``(fn(), seconds)`` for one call, the device synchronised before and (``sync_end``) after it."""
    import timeit

    start = clock() if sync_start else timeit.default_timer()
    result = fn()
    end = clock() if sync_end else timeit.default_timer()
    return result, end - start


def each_call(
    fn: Callable[[], Any], n: int, *, warmup: int = 0, sync_end: bool = True
) -> tuple[Stats, list[Any]]:
    """Time ``n`` calls of a stateful ``fn`` one by one (each exactly once, after ``warmup`` untimed calls).

    Returns the :class:`Stats` (one sample per call) and the calls' results. ``sync_end=False``: host
    time only (the device is synchronised before each call, not after it).
    """
    if n < 1:
        raise ValueError(f"each_call: expected n >= 1, got {n}")
    for _ in range(warmup):
        fn()
    results, ms = [], []
    for _ in range(n):
        result, seconds = once(fn, sync_end=sync_end)
        results.append(result)
        ms.append(seconds * 1e3)
    return Stats.from_ms(ms), results


def stats_dict(stats: Mapping[str, Stats], *, samples: bool = True) -> dict[str, dict[str, Any]]:
    return {name: s.as_dict(samples=samples) for name, s in stats.items()}


# --------------------------------------------------------------------------------- CLI helpers
def fail(prog: str, message: str) -> None:
    """Print ``prog: message`` on one line to stderr and exit with status 2 (a usage / environment error).

    ``prog`` is argparse's: the script's file name, or from Python 3.14 on ``python -m benchmarks.<name>``;
    both print as ``<name>.py``."""
    name = prog.rsplit(".", 1)[-1] + ".py" if " -m " in prog else Path(prog).name
    print(f"{name}: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def require_gpu(prog: str, *, flashinfer: bool = True) -> None:
    """Exit 2 with one line unless CUDA (and, with ``flashinfer``, the flashinfer package) is available.

    FlashInfer is looked up first without importing anything, so where it is missing the script
    exits before paying for ``import torch``.
    """
    need = "a CUDA GPU and FlashInfer" if flashinfer else "a CUDA GPU"
    if flashinfer and importlib.util.find_spec("flashinfer") is None:
        fail(prog, f"needs {need}: the flashinfer package is not installed "
                   "(pip install 'ardiff_modules[flashinfer]'; on the GPU machine: bash .gpu/run.sh python3 ...)")
    import torch

    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        fail(prog, f"needs {need}: CUDA is not available, torch.cuda.is_available() is False{hint}")


def device_tag(device: str = "cuda", world: int = 1) -> str:
    """The device part of a committed result's name: the GPU's name without its vendor, lower case
    (``NVIDIA H200`` -> ``h200``), ``x<world>`` appended for a run over several GPUs (``h200x2``);
    ``cpu`` for ``device="cpu"`` or where CUDA is missing."""
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        name = "cpu"
    else:
        name = torch.cuda.get_device_name().lower().removeprefix("nvidia ").removeprefix("amd ")
        name = re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"
    return name if world <= 1 else f"{name}x{world}"


def result_path(out: Path | None, filename: str, *, device: str = "cuda", world: int = 1) -> Path:
    """Where a script writes ``filename`` (e.g. ``attention.json``): ``out / filename`` when ``--out`` names a
    folder; by default (``out is None``) the committed result, ``RESULTS / <stem>_<device_tag><suffix>``
    (``results/attention_h200.json``)."""
    if out is not None:
        return Path(out) / filename
    name = Path(filename)
    return RESULTS / f"{name.stem}_{device_tag(device, world)}{name.suffix}"


def parser(description: str | None, **kwargs: Any) -> Any:
    """An ``argparse.ArgumentParser`` that keeps the module docstring's layout in ``--help``."""
    import argparse

    return argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                                   **kwargs)


# --------------------------------------------------------------------------------- metadata
def _flashinfer_version() -> str:
    if "flashinfer" not in sys.modules and importlib.util.find_spec("flashinfer") is None:
        return "not installed"
    try:
        return str(importlib.import_module("flashinfer").__version__)
    except Exception as exc:  # noqa: BLE001 - recorded, never fatal
        return f"unavailable: {type(exc).__name__}: {exc}"[:300]


def environment() -> dict[str, Any]:
    """Versions and device: python, torch, CUDA (torch build), cuDNN, flashinfer, GPU name / count, platform."""
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "flashinfer": _flashinfer_version(),
        "platform": platform.platform(),
    }
    try:
        info["cudnn"] = torch.backends.cudnn.version()
    except Exception:  # noqa: BLE001
        info["cudnn"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_count"] = torch.cuda.device_count()
        cap = torch.cuda.get_device_capability()
        info["gpu_capability"] = f"{cap[0]}.{cap[1]}"
    return info


def git_info(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """``{"commit", "dirty"}`` of the checkout holding ``path`` (default: this file), tolerant of no git.

    Where the tree is a copy without ``.git`` (the GPU machine gets one), ``ARDIFF_BENCH_GIT`` is used
    when set, e.g. ``ARDIFF_BENCH_GIT=$(git rev-parse HEAD)$(git diff --quiet HEAD || echo -dirty)``.
    """
    where = Path(path or __file__).resolve()
    where = where if where.is_dir() else where.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
        return {"commit": commit, "dirty": dirty, "source": "git"}
    except Exception as exc:  # noqa: BLE001 - not a checkout, no git, a timeout
        given = os.environ.get("ARDIFF_BENCH_GIT")
        if given:
            return {"commit": given.removesuffix("-dirty"), "dirty": given.endswith("-dirty"),
                    "source": "ARDIFF_BENCH_GIT"}
        return {"commit": None, "dirty": None, "source": f"unknown ({type(exc).__name__})"}


def collect_env_summary(timeout_s: float = 10.0) -> dict[str, Any]:
    """A few ``torch.utils.collect_env`` fields (OS, libc, driver, GPUs, CUDA runtime, CPU model, allocator
    config), collected in a worker thread given ``timeout_s``: ``get_env_info()`` itself lists pip and
    conda packages and takes seconds, so only its cheap parts are called."""
    result: dict[str, Any] = {}

    def cpu_model(ce: Any) -> str | None:
        cpu = ce.get_cpu_info(ce.run) or ""
        return next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if ln.strip().startswith("Model name")),
                    None)

    fields: dict[str, Callable[[Any], Any]] = {
        "os": lambda ce: ce.get_os(ce.run),
        "libc": lambda ce: ce.get_libc_version(),
        "python_platform": lambda ce: ce.get_python_platform(),
        "nvidia_driver": lambda ce: ce.get_nvidia_driver_version(ce.run),
        "nvidia_gpus": lambda ce: ce.get_gpu_info(ce.run),
        "cuda_runtime": lambda ce: ce.get_running_cuda_version(ce.run),
        "cuda_module_loading": lambda ce: ce.get_cuda_module_loading_config(),
        "caching_allocator_config": lambda ce: ce.get_cachingallocator_config(),
        "cpu": cpu_model,
    }

    def work() -> None:
        try:
            import torch.utils.collect_env as ce
        except Exception as exc:  # noqa: BLE001 - recorded, never fatal
            result["error"] = f"{type(exc).__name__}: {exc}"[:300]
            return
        for key, get in fields.items():  # each guarded: versions differ in what collect_env offers
            try:
                result[key] = _jsonable(get(ce))
            except Exception as exc:  # noqa: BLE001
                result[key] = f"unavailable: {type(exc).__name__}"

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        result["error"] = f"timed out after {timeout_s} s"
    return dict(result)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


def run_metadata(args: Any = None) -> dict[str, Any]:
    """What produced a result: git commit + dirty flag, UTC time, command line and parsed args, host."""
    return {
        "git": git_info(),
        "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": list(sys.argv),
        "args": _jsonable(vars(args)) if args is not None and hasattr(args, "__dict__") else _jsonable(args),
        "host": platform.node(),
        "timing_method": METHOD,
        "collect_env": collect_env_summary(),
    }


def save_json(path: Path, payload: dict[str, Any], *, args: Any = None) -> None:
    """Write ``payload`` with ``env`` (:func:`environment`) and ``run`` (:func:`run_metadata`) added if absent.

    Atomically: into a temporary file next to ``path``, then renamed over it, so that a run killed mid-write
    (a device call's time limit) leaves the previous complete file, never a truncated one."""
    payload.setdefault("env", environment())
    payload.setdefault("run", run_metadata(args))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(_jsonable(payload), indent=2, sort_keys=False))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"wrote {path}")
