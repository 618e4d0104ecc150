"""Time to first chunk of a fresh process, cold and warm (``ardiff_modules.warm_start``).

A server starts, builds the model and the ``KVCache``, and waits; then a session arrives: it opens, publishes
its prompt (CFG: cond + uncond) and asks for its first chunk -- one chunk step, 4 denoising forwards
(timesteps 1000, 750, 500, 250) and the committing one (t = 0), both branches batched, as
``benchmarks.end_to_end`` runs it. **TTFC** (time to first chunk) is the session's wall time from its arrival
until that chunk's output is ready (the device synchronised). Each row runs in a **fresh process** (so no
kernel, compile or allocator cache of an earlier row is warm), the same model (``ardiff_modules.models.
wan_causal_dit``, random weights from one seed), the same inputs:

* ``eager_cold``              -- the eager model; nothing done before the session (first-use costs land in it);
* ``eager_warm_up``           -- the eager model; ``am.warm_up(cache, ...)`` before the session (its own time
                                 reported as ``warm_up_s``);
* ``compiled_cold``           -- ``am.CompiledStep(model, dynamic=False)`` with an empty
                                 ``TORCHINDUCTOR_CACHE_DIR``: the TTFC includes the compile; after the rollout the
                                 process saves torch's compile cache (``am.save_compile_cache``) for the next rows;
* ``compiled_loaded``         -- another empty cache dir; ``am.load_compile_cache`` of that file first
                                 (``load_s``), then the session: the compile hits the loaded entries (dynamo
                                 still traces, inductor's code generation is skipped);
* ``compiled_loaded_warm_up`` -- the same, plus ``am.warm_up`` before the session: the trace and the first
                                 forwards' costs move out of the session.

Each process also runs ``--chunks`` chunk steps in all (reported: the median of the later ones, the steady
state), and reports its phases (imports, model + cache build, load, warm-up) and, compiled, the graphs compiled
before and during the session and inductor's FX-graph cache hits / misses. Each child prints one JSON line; the
parent collects them. A row that fails (or overruns ``--child-timeout``) is recorded with its error and the
run goes on (exit status 1).

Sizes: ``--preset wan2.1-1.3b`` (default on CUDA: 30 blocks, 4680-token chunks, sink 1 + window 6, CFG, bf16)
or ``tiny`` (default on the CPU, float32, the reference backend: a smoke run, CPU timings say nothing about the
GPU). ``--layers N`` cuts the model to its first N blocks (said in the output and the JSON): a cold compile of
the 30-block model takes about 96 s on an H200, one of 10 blocks about a third. On the CPU the compiled rows
need a C++ compiler (skipped otherwise, with the reason). Measured on a 2-core CPU (torch 2.13), a loaded
process hits the FX-graph cache yet still spends half or more of the cold compile time (its C++ kernels are built again
in the fresh cache dir); on CUDA inductor bundles the built Triton kernels into those entries (torch's default,
``bundle_triton_into_fx_graph_cache``), which is where a loaded compile saves its time.

Writes ``warm_start.json`` (config, rows, run metadata) and ``warm_start.png`` (TTFC per row beside the time
spent before the session) into ``--out DIR``; by default ``benchmarks/results/warm_start_<device>.json`` /
``.png``.

    bash .gpu/run.sh python3 -m benchmarks.warm_start --out $OUT                  # H200, wan2.1-1.3b
    bash .gpu/run.sh python3 -m benchmarks.warm_start --layers 10 --out $OUT      # a shallower model
    python -m benchmarks.warm_start --device cpu --chunks 2 --out /tmp/warm       # CPU smoke (tiny preset)
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks._timing import clock, fail, parser, result_path, save_json  # noqa: E402

ROWS = ("eager_cold", "eager_warm_up", "compiled_cold", "compiled_loaded", "compiled_loaded_warm_up")
TIMESTEPS = (1000.0, 750.0, 500.0, 250.0)  #: the denoising forwards of a chunk step (then one at t = 0 commits)
ROOT = Path(__file__).resolve().parents[1]
CACHE_FILE = "compile_cache.bin"
COMPILE_THREADS = "TORCHINDUCTOR_COMPILE_THREADS"  #: passed on to the rows (the other TORCHINDUCTOR_* are not)


def build_parser() -> Any:
    p = parser(__doc__)
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available, else cpu")
    p.add_argument("--preset", default=None, help="model geometry (default: wan2.1-1.3b on CUDA, tiny on CPU)")
    p.add_argument("--layers", type=int, default=None, help="cut the model to its first N blocks (default: all)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {ROWS}")
    p.add_argument("--chunks", type=int, default=3, help="chunk steps each process runs (the first is the TTFC)")
    p.add_argument("--cfg", choices=("on", "off"), default="on", help="CFG: both branches batched (on) or cond only")
    p.add_argument("--backend", default="auto", help="the KVCache backend (default auto)")
    p.add_argument("--child-timeout", type=float, default=280.0, help="seconds per row's process (default 280)")
    p.add_argument("--allow-big-cpu", action="store_true", help="allow a large preset on the CPU")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for warm_start.json / .png (default: benchmarks/results/warm_start_<device>.*)")
    # Internal: one row in this process (the parent starts a fresh one per row), and the compile cache's file.
    p.add_argument("--child", choices=ROWS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--cache-file", type=Path, default=None, help=argparse.SUPPRESS)
    return p


# ------------------------------------------------------------------ one row, in its own process
def child(args: Any) -> dict[str, Any]:
    """One row in this (fresh) process: build, load / warm up as the row says, then the session; the phases."""
    phases: dict[str, float] = {}
    start = time.perf_counter()  # (clock() would import torch first: the imports are a phase of their own)
    import torch

    import ardiff_modules as am
    from ardiff_modules.models.wan_causal_dit import WanConfig, build_model, kv_pool_pages, make_kv_spec

    phases["import_s"] = time.perf_counter() - start
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = WanConfig.preset(args.preset, **({"num_layers": args.layers} if args.layers else {}))
    branches = ("cond", "uncond") if args.cfg == "on" else ("cond",)
    t = clock()
    model = build_model(config, seed=0, device=device, dtype=dtype)
    spec = make_kv_spec(config, device, branches)
    cache = am.KVCache(spec, num_pages=kv_pool_pages(spec, slack_chunks=0), device=device, backend=args.backend)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        text = model.embed_text(torch.randn(config.text_tokens, config.text_dim, generator=g).to(device))
        dummy = torch.zeros_like(text)
    latents = [torch.randn(1, config.frames_per_chunk, config.in_channels, config.latent_height, config.latent_width,
                           generator=g).to(device, dtype).expand(len(branches), -1, -1, -1, -1).contiguous()
               for _ in range(args.chunks)]
    ts = [torch.full((len(branches),), v, device=device) for v in (*TIMESTEPS, 0.0)]
    phases["build_s"] = clock() - t
    compiled = args.child.startswith("compiled")
    step = am.CompiledStep(model, dynamic=False) if compiled else model
    crosses = [block.cross for block in model.blocks]
    result: dict[str, Any] = {"row": args.child, "backend": cache.backend.name}
    if args.child.startswith("compiled_loaded"):
        t = clock()
        result["loaded"] = am.load_compile_cache(args.cache_file)
        phases["load_s"] = clock() - t

    def run_forward(fwd: Any) -> None:
        frames = fwd.seq_len // config.tokens_per_frame
        x = torch.zeros(fwd.num_streams, frames, config.in_channels, config.latent_height, config.latent_width,
                        device=device, dtype=dtype)
        step(x, torch.zeros(fwd.num_streams, device=device), fwd.layers)

    def setup(state: Any) -> None:
        for branch in state.kv_branch_names:
            am.populate_cross_attention(state, branch, crosses, dummy)

    if args.child.endswith("warm_up"):
        with torch.no_grad():
            report = am.warm_up(cache, run_forward, setup_session=setup)
        phases["warm_up_s"] = report.seconds
        result["warm_up"] = {"forwards": report.forwards, "shapes": len(report.shapes),
                             "stages": [{"streams": s.streams, "chunks": s.chunks, "seconds": s.seconds}
                                        for s in report.stages]}
    frames_before = step.frame_count if compiled else None
    result.update(_session(am, cache, step, branches, crosses, text, latents, ts))
    result["process_to_first_chunk_s"] = result.pop("first_chunk_at") - T0  # clock() reads perf_counter too
    if compiled:
        from torch._dynamo.utils import counters  # reported only: which compiles hit the FX-graph cache

        result["frames_before_session"] = frames_before
        result["frames_during_session"] = step.frame_count - frames_before
        result["fxgraph_cache"] = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
    if args.child == "compiled_cold":
        t = clock()
        result["saved_bytes"] = am.save_compile_cache(args.cache_file)
        phases["save_s"] = clock() - t
    result["phases"] = phases
    return result


def _session(am: Any, cache: Any, step: Any, branches: tuple[str, ...], crosses: list, text: Any, latents: list,
             ts: list) -> dict[str, Any]:
    """The session: arrives, publishes its prompt, runs ``len(latents)`` chunk steps; TTFC and the steady state."""
    import torch

    arrival = clock()
    chunk_s = []
    with torch.no_grad():
        state = cache.open_session("user")
        for branch in branches:
            am.populate_cross_attention(state, branch, crosses, text)
        for x in latents:
            t = clock()
            for i, timestep in enumerate(ts):
                with state.prepare_forward(branches, cache.spec.chunk_size, commit_current=i == len(ts) - 1) as fwd:
                    out = step(x, timestep, fwd.layers)
            end = clock()
            chunk_s.append(end - (arrival if not chunk_s else t))
            if len(chunk_s) == 1:
                first = end
    state.close()
    return {"ttfc_s": chunk_s[0], "first_chunk_at": first, "chunk_s": chunk_s,
            "steady_chunk_s": statistics.median(chunk_s[1:]) if len(chunk_s) > 1 else None,
            "output_finite": bool(torch.isfinite(out).all())}


# ------------------------------------------------------------------ the parent
def _child_env(device: str, cache_dir: Path) -> dict[str, str]:
    # No inductor setting of the parent reaches a row (a cache dir would make it warm), except the number of
    # compile workers: a choice of the machine, not a cache (the CPU smoke test passes 1: no worker pool to start).
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR_") or k == COMPILE_THREADS}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)  # empty for every process: nothing compiled is warm
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run_row(row: str, args: Any, work: Path) -> dict[str, Any]:
    """``row`` in a fresh process with an empty inductor cache dir; its JSON line, or the error."""
    argv = [sys.executable, "-m", "benchmarks.warm_start", "--child", row, "--device", args.device, "--preset",
            args.preset, "--chunks", str(args.chunks), "--cfg", args.cfg, "--backend", args.backend,
            "--cache-file", str(work / CACHE_FILE)]
    if args.layers:
        argv += ["--layers", str(args.layers)]
    started = time.perf_counter()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=args.child_timeout,
                              env=_child_env(args.device, work / f"inductor_{row}"), check=False)
    except subprocess.TimeoutExpired:
        return {"row": row, "error": f"timed out after {args.child_timeout:.0f} s"}
    wall = time.perf_counter() - started
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"row": row, "error": f"exit status {done.returncode}", "stderr": done.stderr[-4000:]}
    return {**json.loads(lines[-1]), "process_wall_s": wall}


def skip_reason(row: str, device: str, rows: Sequence[str]) -> str | None:
    if row.startswith("compiled") and device == "cpu" and not any(
            shutil.which(c) for c in (os.environ.get("CXX") or "g++", "g++", "c++", "clang++")):
        return "inductor on the CPU needs a C++ compiler (g++ / c++ / clang++): none found"
    if row.startswith("compiled_loaded") and "compiled_cold" not in rows:
        return "needs the compiled_cold row (it saves the compile cache this row loads)"
    return None


def _print_row(r: dict[str, Any]) -> None:
    if "skipped" in r or "error" in r:
        print(f"{r['row']:<24s} {'skipped: ' + r['skipped'] if 'skipped' in r else 'FAILED: ' + r['error']}",
              flush=True)
        return
    ph = r["phases"]
    before = ", ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in ph.items() if k in ("load_s", "warm_up_s"))
    steady = f", steady chunk {r['steady_chunk_s']:.3f} s" if r.get("steady_chunk_s") else ""
    frames = (f", graphs compiled before/during the session {r['frames_before_session']}/"
              f"{r['frames_during_session']}" if "frames_during_session" in r else "")
    print(f"{r['row']:<24s} TTFC {r['ttfc_s']:8.3f} s{steady}; before the session: {before or 'nothing'}; "
          f"process start to first chunk {r['process_to_first_chunk_s']:.2f} s{frames}", flush=True)


def plot(payload: dict[str, Any], path: Path) -> Path | None:
    """Per row: the session's TTFC beside the time spent before the session (load + warm-up)."""
    from benchmarks._plotting import bars, legend_below, pyplot, save, wrap

    plt = pyplot()
    if plt is None:
        return None
    rows = [r for r in payload["rows"] if "ttfc_s" in r]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(rows) + 2), 4.6), layout="constrained")
    xs = list(range(len(rows)))
    ttfc = [r["ttfc_s"] for r in rows]
    before = [r["phases"].get("load_s", 0.0) + r["phases"].get("warm_up_s", 0.0) for r in rows]
    bars(ax, [x - 0.2 for x in xs], ttfc, 0.4, labels=[f"{v:.2f} s" for v in ttfc], color="tab:red",
         label="time to first chunk (the session's wait)")
    bars(ax, [x + 0.2 for x in xs], before, 0.4, labels=[f"{v:.2f} s" for v in before], color="tab:gray",
         label="before the session: load_compile_cache + warm_up")
    ax.set_xticks(xs, [r["row"] for r in rows], fontsize=8)
    ax.set_ylabel("seconds")
    ax.grid(axis="y", alpha=0.3)
    cfg = payload["config"]
    depth = f"{cfg['layers']} of {cfg['preset_layers']} blocks (cut)" if cfg["layers_cut"] else f"{cfg['layers']} blocks"
    title = (f"Time to first chunk, each row a fresh process: {cfg['preset']} ({depth}), CFG {cfg['cfg']}, "
             f"{cfg['device']} ({payload.get('env', {}).get('gpu', cfg['device'])}); one chunk step = 4 denoising + "
             "1 committing forward")
    fig.suptitle(wrap(title, fig, 9), fontsize=9)
    legend_below(fig, ax, ncol=2)
    return save(plt, fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args)), flush=True)
        return 0
    rows = tuple(r.strip() for r in args.rows.split(",") if r.strip())
    if not rows or any(r not in ROWS for r in rows):
        p.error(f"--rows: expected names from {ROWS}, got {list(rows)}")
    if args.chunks < 1 or (args.layers is not None and args.layers < 1):
        p.error("--chunks and --layers must be >= 1")
    import torch

    from ardiff_modules.models.wan_causal_dit import PRESETS

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        fail(p.prog, "--device cuda: CUDA is not available (torch.cuda.is_available() is False); "
                     "use --device cpu for a smoke run")
    args.preset = args.preset or ("wan2.1-1.3b" if args.device == "cuda" else "tiny")
    if args.preset not in PRESETS:
        p.error(f"--preset: expected one of {sorted(PRESETS)}, got {args.preset!r}")
    if args.device == "cpu" and args.preset != "tiny" and not args.allow_big_cpu:
        p.error(f"--preset {args.preset} on CPU: expected --device cuda (or pass --allow-big-cpu)")
    preset_layers = PRESETS[args.preset].num_layers
    layers = min(args.layers or preset_layers, preset_layers)
    cut = layers < preset_layers
    print(f"warm_start: {args.preset}, {layers} of {preset_layers} blocks" + (" (MODEL DEPTH CUT: --layers)" if cut
          else "") + f", CFG {args.cfg}, {args.device}; rows {', '.join(rows)}; each a fresh process", flush=True)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="warm_start_") as work:
        for row in rows:
            reason = skip_reason(row, args.device, rows)
            failed_cold = row.startswith("compiled_loaded") and any(
                r["row"] == "compiled_cold" and not r.get("saved_bytes") for r in results)
            if reason is None and failed_cold:
                reason = "compiled_cold saved no compile cache (it failed, or torch had nothing to save)"
            result = {"row": row, "skipped": reason} if reason else run_row(row, args, Path(work))
            results.append(result)
            _print_row(result)
    payload = {"config": {"device": args.device, "preset": args.preset, "layers": layers, "preset_layers": preset_layers,
                          "layers_cut": cut, "cfg": args.cfg, "chunks": args.chunks, "backend": args.backend,
                          "ttfc": "session arrival (open_session + prompt) to the first chunk step's output, device "
                                  "synchronised; each row a fresh process with an empty TORCHINDUCTOR_CACHE_DIR"},
               "rows": results}
    save_json(result_path(args.out, "warm_start.json", device=args.device), payload, args=args)
    plot(payload, result_path(args.out, "warm_start.png", device=args.device))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
