"""Host time of one forward's bookkeeping (prepare_forward + commit) at Wan2.1-1.3B shapes.

Per layout (contiguous extents, plain paging) and model depth (1 and 30 layers): ``--iters`` committing
forwards with no attention in between, each timed alone (``_timing.each_call``, host time only: the
device is synchronised before each forward, not after), after ``--warmup`` forwards that fill the
windows. Needs CUDA and FlashInfer (exit status 2 otherwise), unless ``--cpu``.

Beside the times, each line counts the host work of one more steady-state forward, run under cProfile:
``calls_per_forward`` (every Python and builtin function call), ``library_calls`` (calls of functions of
the measured ``ardiff_modules``) and ``flashinfer_calls`` (of FlashInfer's Python, i.e. its ``plan()``);
and ``kernel_plans_timed``, the FlashInfer ``plan()`` calls made during the timed forwards (0 once the
windows are full: the row lengths repeat, so the plan is skipped and only the page table is refreshed).
Counts are deterministic where times are noisy: a host path that doubles doubles its count.

``--cpu`` runs the same forwards without a GPU: the pool on the CPU with one KV head of 8 dims (host
work does not depend on the head shape) and FlashInfer's prefill wrappers replaced by host-only stand-ins
(:func:`stub_flashinfer`: ``plan()`` is recorded, nothing is launched), so the FlashInfer backend's own
host path -- layouts, ragged/paged rows, the plan skip, write metadata -- runs as on the H200 minus
FlashInfer's ``plan()`` itself and the host-to-device copies. ``tests/docs/test_benchmarks_smoke.py`` keeps
its call counts under a ceiling.

Measures whichever ``ardiff_modules`` comes first on ``sys.path``: run from the repository root as
``python -m benchmarks.host_time``, that is this checkout's (``-m`` puts the current folder first). To
compare two versions side by side in one run (alternate invocations), put the measured tree first and
keep the current folder off the path with ``-P`` (Python >= 3.11; this checkout's ``benchmarks`` package
still comes from ``$PWD``)::

    for r in 1 2 3; do for tree in /path/to/old $PWD; do
        PYTHONPATH=$tree:$PWD python3 -P -m benchmarks.host_time --label $(basename $tree); done; done

Prints JSON lines: first one ``{"label", "run", "env", "package_git"}`` line (run metadata: git commit
and dirty flag of this checkout and of the measured package's tree, UTC time, versions, command line),
then one line per (layout, layers): median, IQR, p25, p75 of milliseconds per forward and the counts
above. ``--out FILE`` appends the same lines to FILE (the committed ones: ``results/host_time_h200.jsonl``);
``--profile FILE`` writes the cProfile listing of each counted forward.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks._timing import each_call, environment, git_info, parser, require_gpu, run_metadata

#: The Wan2.1-1.3B geometry of the measured forwards (2 branches, 4680-token chunks, 1 sink + 6 window chunks).
CHUNK, PAGE, SINKS, WINDOW, BRANCHES = 4680, 120, 1, 6, ("cond", "uncond")


# --------------------------------------------------------------------------------- FlashInfer on the CPU
class _StubWrapper:
    """FlashInfer's prefill wrapper as the backend uses it on the host: ``plan()`` is counted and keeps the
    paged page table it was given, as FlashInfer 0.7.2.post1 does (the plan skip depends on that); no
    kernel is ever launched (``run()`` does not exist: host_time only prepares and commits)."""

    def __init__(self, workspace: Any, kv_layout: str, use_cuda_graph: bool = False, backend: str = "auto",
                 **buffers: Any) -> None:
        self.use_cuda_graph = use_cuda_graph
        self.plans = 0
        self._paged_kv_indices_buf = buffers.get("paged_kv_indices_buf")

    def plan(self, qo_indptr: Any, kv_indptr: Any, *args: Any, **kwargs: Any) -> None:
        import torch

        self.plans += 1
        # paged: plan(qo_indptr, kv_indptr, kv_indices, last_page_len, ...); ragged: plan(qo, kv, heads, ...)
        if not self.use_cuda_graph and args and isinstance(args[0], torch.Tensor):
            self._paged_kv_indices_buf = args[0]  # FlashInfer: kv_indices.to(device), the same tensor


class _StubEvent:
    def record(self) -> None:
        return None

    def synchronize(self) -> None:
        return None


@contextlib.contextmanager
def stub_flashinfer() -> Iterator[Any]:
    """Within the block, the FlashInfer backend runs on the CPU: yields a backend instance to pass to
    ``KVCache(device="cpu", backend=...)``; everything patched is restored on exit.

    Patched: ``sys.modules["flashinfer"]`` (a module with the two prefill wrappers as :class:`_StubWrapper`
    and the version the plan skip is enabled for), ``torch.cuda.Event`` (no-ops) and the backend's pinned
    staging (identity: pinning needs CUDA).
    """
    import torch

    from ardiff_modules.backends import flashinfer as fib

    fake = types.ModuleType("flashinfer")
    fake.__version__ = getattr(fib, "PLAN_SKIP_VERSIONS", ("0.7.2.post1",))[0]  # type: ignore[attr-defined]
    fake.BatchPrefillWithPagedKVCacheWrapper = _StubWrapper  # type: ignore[attr-defined]
    fake.BatchPrefillWithRaggedKVCacheWrapper = _StubWrapper  # type: ignore[attr-defined]

    class HostOnlyFlashInfer(fib.FlashInferBackend):
        """The FlashInfer backend, accepted on any device, with an empty kernel workspace."""

        def check_supported(self, *args: Any, **kwargs: Any) -> None:
            return None

        def workspace(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            return torch.empty(0, dtype=torch.uint8)

    saved_module = sys.modules.get("flashinfer")
    saved_event, saved_pinned = torch.cuda.Event, fib._pinned
    sys.modules["flashinfer"] = fake
    torch.cuda.Event = _StubEvent  # type: ignore[misc, assignment]
    fib._pinned = lambda t: t
    try:
        yield HostOnlyFlashInfer()
    finally:
        if saved_module is None:
            sys.modules.pop("flashinfer", None)
        else:
            sys.modules["flashinfer"] = saved_module
        torch.cuda.Event = saved_event  # type: ignore[misc]
        fib._pinned = saved_pinned


# --------------------------------------------------------------------------------- counting
def count_calls(fn: Callable[[], Any]) -> tuple[Any, dict[str, int], Any]:
    """``(fn(), counts, profile)``: the function calls made by one call of ``fn`` under cProfile.

    ``counts``: ``calls`` (all Python and builtin calls), ``library_calls`` (of functions defined in the
    imported ``ardiff_modules``) and ``flashinfer_calls`` (in the imported FlashInfer package's files;
    0 for the CPU stand-in). ``profile``: the ``pstats.Stats``.
    """
    import cProfile
    import pstats

    import ardiff_modules as am

    library = str(Path(am.__file__).resolve().parent)
    flashinfer_file = getattr(sys.modules.get("flashinfer"), "__file__", None)
    flashinfer_dir = str(Path(flashinfer_file).resolve().parent) if flashinfer_file else None
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        result = fn()
    finally:
        profiler.disable()
    stats = pstats.Stats(profiler)
    counts = {"calls": 0, "library_calls": 0, "flashinfer_calls": 0}
    # NOTE: counted from the profiler's raw entries, one per code object: pstats keys them by (file, line,
    # name), so the generated __init__ of every dataclass ("<string>", 2, "__init__") collapses into one.
    for entry in profiler.getstats():
        code, calls = entry.code, entry.callcount
        filename = code if isinstance(code, str) else code.co_filename
        name = code if isinstance(code, str) else code.co_name
        if name == "<method 'disable' of '_lsprof.Profiler' objects>":
            continue  # the profiler's own stop
        counts["calls"] += calls
        resolved = str(Path(filename).resolve()) if filename.startswith("/") else filename
        if resolved.startswith(library):
            counts["library_calls"] += calls
        elif flashinfer_dir is not None and resolved.startswith(flashinfer_dir):
            counts["flashinfer_calls"] += calls
    return result, counts, stats


def kernel_plans(plan: Any) -> int | None:
    """FlashInfer ``plan()`` calls made so far by ``plan`` (both segments of a relative-sinks plan);
    ``None`` for a backend that does not count them."""
    parts = [getattr(plan, name) for name in ("rest", "sinks") if hasattr(plan, name)] or [plan]
    counts = [getattr(part, "kernel_plans", None) for part in parts]
    return None if any(c is None for c in counts) else sum(counts)  # type: ignore[arg-type]


def _plans_made(timeline: Sequence[tuple[Any, int | None]], start: tuple[Any, int | None]) -> int | None:
    """FlashInfer ``plan()`` calls along ``(plan object, its kernel_plans)`` per forward, after ``start``."""
    made, (previous, before) = 0, start
    for plan, now in timeline:
        if now is None:
            return None
        made += now - before if plan is previous and before is not None else now  # a new plan counts from 0
        previous, before = plan, now
    return made


# --------------------------------------------------------------------------------- measuring
def open_session(layers: int, extents: bool, *, device: str = "cuda", backend: Any = "flashinfer") -> Any:
    """A cache at the measured geometry (on the CPU: one KV head of 8 dims) and one open session."""
    import ardiff_modules as am

    heads, dim = (12, 128) if device != "cpu" else (1, 8)
    spec = am.KVCacheSpec(
        num_layers=layers, num_kv_heads=heads, head_dim=dim, chunk_size=CHUNK, page_size=PAGE, sink_chunks=SINKS,
        window_chunks=WINDOW, branches=BRANCHES, dtype="bfloat16",
    )
    cache = am.KVCache(spec, num_pages=len(BRANCHES) * (SINKS + WINDOW + 2) * spec.pages_per_chunk, device=device,
                       backend=backend, contiguous_extents=extents)
    return cache.open_session()


def measure(
    layers: int, extents: bool, iters: int, warmup: int = 10, *, device: str = "cuda", backend: Any = "flashinfer",
    profile: list[str] | None = None,
) -> dict[str, Any]:
    """Time ``iters`` steady-state forwards (after ``warmup``), then count the calls of one more.

    ``profile``: if given, the counted forward's cProfile listing is appended to it.
    """
    import ardiff_modules as am

    state = open_session(layers, extents, device=device, backend=backend)

    written = range(layers)

    def forward() -> tuple[Any, int | None, str]:
        fwd = state.prepare_forward(None, CHUNK, commit_current=True)
        # NOTE: what each layer's op records (a commit needs every layer); getattr: older trees compared
        # alternately have no such method (and no such rule)
        mark_written = getattr(fwd._transaction, "mark_written", None)
        if mark_written is not None:
            mark_written(written)
        fwd.commit()
        return fwd._plan, kernel_plans(fwd._plan), getattr(fwd._plan, "mode", type(fwd._plan).__name__)

    last = None
    for _ in range(warmup):  # the windows fill
        last = forward()
    stats, results = each_call(forward, iters, sync_end=False)
    start = (last[0], last[1]) if last is not None else (None, 0)
    plans_timed = _plans_made([(plan, k) for plan, k, _ in results], start)
    (_, _, mode), counts, pstats_ = count_calls(forward)
    if profile is not None:
        out = io.StringIO()
        pstats_.stream = out
        pstats_.sort_stats("tottime").print_stats(40)
        profile.append(f"==== layers={layers} extents={extents} mode={mode} {counts}\n{out.getvalue()}")
    state.cache.close()
    return {"layers": layers, "extents": extents, "median_ms": stats.median_ms, "iqr_ms": stats.iqr_ms,
            "p25_ms": stats.p25_ms, "p75_ms": stats.p75_ms, "n": stats.n_samples, "device": device,
            "modes": sorted({m for *_, m in results}), "kernel_plans_timed": plans_timed,
            "calls_per_forward": counts["calls"], "library_calls": counts["library_calls"],
            "flashinfer_calls": counts["flashinfer_calls"], "package": am.__file__}


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--label", default="current", help="name of the measured tree in the output lines")
    p.add_argument("--iters", type=int, default=100, help="timed forwards per point (default 100)")
    p.add_argument("--warmup", type=int, default=10, help="untimed forwards first, filling the windows (default 10)")
    p.add_argument("--layers", type=int, nargs="+", default=[1, 30], help="model depths to measure (default 1 30)")
    p.add_argument("--cpu", action="store_true",
                   help="no GPU: the CPU with FlashInfer's wrappers stubbed (call counts as on the GPU path)")
    p.add_argument("--out", type=Path, default=None, help="also append the JSON lines to this file")
    p.add_argument("--profile", type=Path, default=None, help="write the cProfile listing of each counted forward")
    args = p.parse_args(argv)
    if args.iters < 1 or args.warmup < 0 or min(args.layers) < 1:
        p.error("--iters and --layers must be >= 1 and --warmup >= 0")
    if not args.cpu:
        require_gpu(p.prog)
    import ardiff_modules as am

    lines: list[dict[str, Any]] = [{
        "label": args.label, "run": run_metadata(args), "env": environment(),
        "package": am.__file__, "package_git": git_info(Path(am.__file__).parent),
    }]
    print(json.dumps(lines[0]), flush=True)
    profile: list[str] | None = [] if args.profile is not None else None
    with stub_flashinfer() if args.cpu else contextlib.nullcontext("flashinfer") as backend:
        device = "cpu" if args.cpu else "cuda"
        for extents in (True, False):
            for layers in args.layers:
                point = measure(layers, extents, args.iters, args.warmup, device=device, backend=backend,
                                profile=profile)
                lines.append({"label": args.label, **point})
                print(json.dumps(lines[-1]), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)
    if args.profile is not None:
        args.profile.parent.mkdir(parents=True, exist_ok=True)
        args.profile.write_text("\n".join(profile or []))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
