"""Sessions benchmark: N sessions batched in one launch per layer vs the same sessions one after another.

For 1, 2, 4, 8 sessions (each with CFG's two branches, windows full), one forward =
``prepare_forward`` (host: allocation, plan) + ``--layers`` layers of ``chunk_attention``:

* ``batched`` -- every session's streams are rows of one plan: one kernel launch per layer;
* ``serial``  -- each session prepares and runs its own forward.

Timing (``_timing.interleaved``, ``torch.utils.benchmark``): batched and serial sampled round-robin,
``--rounds`` samples of ``--inner`` back-to-back forwards each (host and device work both count: the
clock synchronises the device at both ends of a sample); medians with IQR, the speed-up is the ratio
of the medians. ``--inner 1`` times whole forwards synchronised at both ends (the method of the
figures recorded before the timing helper was rewritten).

Reported: aggregate tokens/s, latency per chunk forward, the speed-up, KV bytes per session, and the
cost of ``fork`` (host time; pages allocated and bytes written must both be 0).
Runs on CUDA (FlashInfer through ``backend="auto"``, bf16) or on the CPU (the reference backend,
float32; a smoke run: CPU timings say nothing about the GPU). ``--device cuda`` without CUDA exits 2.

Writes ``sessions.json`` (per shape and session count: medians, ``batched_stats`` / ``serial_stats``
with IQR, p25, p75 and samples, speed-up, KV bytes, fork cost; run metadata) and ``sessions.png``
(throughput with IQR error bars, and the speed-up) into ``--out DIR``; by default the committed results,
``benchmarks/results/sessions_<device>.json`` / ``.png``.

    bash .gpu/run.sh python3 -m benchmarks.sessions                                # H200: sessions_h200.*
    python -m benchmarks.sessions --shape tiny --device cpu --out /tmp/sessions    # CPU smoke
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._timing import fail, interleaved, once, parser, result_path, save_json

SHAPES = {
    "wan1.3b": dict(heads=12, head_dim=128, chunk=4680, page=120, sink=1, window=6),
    "small-chunk": dict(heads=12, head_dim=128, chunk=880, page=80, sink=1, window=7),
    "tiny": dict(heads=2, head_dim=16, chunk=32, page=8, sink=1, window=2),
}


def _spec(shape: dict[str, int], layers: int, dtype: str) -> Any:
    import ardiff_modules as am

    return am.KVCacheSpec(
        num_layers=layers, num_kv_heads=shape["heads"], head_dim=shape["head_dim"], chunk_size=shape["chunk"],
        page_size=shape["page"], sink_chunks=shape["sink"], window_chunks=shape["window"],
        branches=("cond", "uncond"), dtype=dtype,
    )


def bench_sessions(shape_name: str, sessions: int, layers: int, device: Any, dtype: str, *, rounds: int,
                   inner: int) -> dict[str, Any]:
    import torch

    import ardiff_modules as am

    shape = SHAPES[shape_name]
    spec = _spec(shape, layers, dtype)
    pages = sessions * spec.pages_per_chunk * (spec.max_history_chunks + 2) * 2
    cache = am.KVCache(spec, num_pages=pages, device=device)
    states = [cache.open_session(f"s{i}") for i in range(sessions)]
    streams = [(s, b) for s in states for b in spec.branches]
    g = torch.Generator(device=device).manual_seed(0)
    tdtype = cache.dtype
    x = torch.randn(2 * sessions, spec.chunk_size, spec.num_kv_heads, spec.head_dim, device=device, dtype=tdtype,
                    generator=g)

    def run(fwd: am.ForwardContext, rows: slice) -> None:
        for layer in fwd.layers:
            am.chunk_attention(x[rows], x[rows], x[rows], layer)

    # Fill every window (committing forwards), batched.
    for _ in range(spec.max_history_chunks + 1):
        with cache.prepare_forward(streams, spec.chunk_size, commit_current=True) as fwd:
            run(fwd, slice(None))

    # Both leave the state as they found it (commit_current=False): safe to repeat within a sample.
    def batched() -> None:
        with cache.prepare_forward(streams, spec.chunk_size, commit_current=False) as fwd:
            run(fwd, slice(None))

    def serial() -> None:
        for i, state in enumerate(states):
            with state.prepare_forward(spec.branches, spec.chunk_size, commit_current=False) as fwd:
                run(fwd, slice(2 * i, 2 * i + 2))

    stats = interleaved({"batched": batched, "serial": serial}, inner=inner, rounds=rounds, warmup=1)
    t_batched, t_serial = stats["batched"].median_ms * 1e-3, stats["serial"].median_ms * 1e-3
    tokens = 2 * sessions * spec.chunk_size
    modes = (sorted({f._plan.mode for f in cache._forwards.contexts() if f._plan is not None})
             if device.type == "cuda" else [])
    result: dict[str, Any] = {
        "sessions": sessions,
        "batched_ms": t_batched * 1e3,
        "serial_ms": t_serial * 1e3,
        "batched_stats": stats["batched"].as_dict(),
        "serial_stats": stats["serial"].as_dict(),
        "speedup": t_serial / t_batched,
        "batched_tokens_per_s": tokens / t_batched,
        "serial_tokens_per_s": tokens / t_serial,
        "tokens_per_forward": tokens,
        "kv_bytes_per_session": cache.pages_per_session() * cache.stats().bytes_per_page,
        "kernel_modes": modes,
    }
    # Fork cost: zero pages, zero bytes written (host time: the device is synchronised before, not after).
    used_before = cache.stats().pages_used
    checksum = cache._pool.kv.float().sum().item() if cache._pool.nbytes < (1 << 31) else None
    child, fork_s = once(states[0].fork, sync_end=False)
    result["fork_host_ms"] = fork_s * 1e3
    result["fork_pages_allocated"] = cache.stats().pages_used - used_before
    if checksum is not None:
        result["fork_pool_unchanged"] = cache._pool.kv.float().sum().item() == checksum
    child.close()
    for state in states:
        state.close()
    assert cache.stats().pages_free == cache.stats().num_pages
    return result


def _throughput_bounds(row: dict[str, Any], key: str) -> tuple[float, float] | None:
    """Mtokens/s at the p75 and p25 times of ``row[key]`` (a slower sample is a lower throughput)."""
    st = row.get(f"{key}_stats")
    if not st:
        return None
    tokens = row.get("tokens_per_forward", row[f"{key}_tokens_per_s"] * row[f"{key}_ms"] / 1e3)
    return tokens / (st["p75_ms"] * 1e-3) / 1e6, tokens / (st["p25_ms"] * 1e-3) / 1e6


def plot(payload: dict[str, Any], path: Path) -> Path | None:
    """Top: aggregate throughput, batched vs serial (IQR error bars); bottom: the speed-up (ratio of medians)."""
    from benchmarks._plotting import bars, legend_below, pyplot, save, wrap, yerr

    plt = pyplot()
    if plt is None:
        return None
    shapes = payload["shapes"]
    fig, axes = plt.subplots(2, len(shapes), figsize=(5.5 * len(shapes), 6.5), squeeze=False, layout="constrained",
                             gridspec_kw={"height_ratios": (3, 2)}, sharex="col")
    has_spread = False
    for col, (name, rows) in enumerate(shapes.items()):
        top, bottom = axes[0][col], axes[1][col]
        n = [r["sessions"] for r in rows]
        for key, style, label in (("batched", "o-", "batched (one launch per layer)"), ("serial", "s--", "serial")):
            values = [r[f"{key}_tokens_per_s"] / 1e6 for r in rows]
            bounds = [_throughput_bounds(r, key) for r in rows]
            has_spread |= any(b is not None for b in bounds)
            top.errorbar(n, values, yerr=yerr(values, bounds), fmt=style, capsize=3, label=label)
        top.set_ylim(bottom=0, top=top.get_ylim()[1] * 1.08)  # from 0: a few percent must look like it
        top.set_ylabel("aggregate Mtokens/s")
        top.set_title(name)
        top.grid(alpha=0.3)
        speed = [r["speedup"] for r in rows]
        bars(bottom, n, speed, [0.5 * v for v in n], labels=[f"{v:.2f}x" for v in speed], fontsize=8,
             color="tab:green", label="speed-up, batched vs serial (ratio of medians)")
        bottom.axhline(1.0, color="k", lw=0.6)
        bottom.set_ylim(0, max(speed) * 1.25)
        bottom.set_ylabel("speed-up (batched / serial)")
        bottom.set_xscale("log", base=2)
        bottom.set_xticks(n, [str(v) for v in n])
        bottom.minorticks_off()
        bottom.set_xlabel("sessions (2 CFG streams each)")
    note = "error bars: IQR" if has_spread else "medians (no spread recorded in this run)"
    gpu = payload.get("env", {}).get("gpu", payload.get("device", "?"))
    title = (f"Sessions batched in one launch per layer vs serial, {payload.get('layers', '?')} attention layers "
             f"per forward ({gpu})\n{note}")
    fig.suptitle(wrap(title, fig), fontsize=10)
    legend_below(fig, axes[0][0], ncol=2)
    return save(plt, fig, path)


def build_parser() -> Any:
    p = parser(__doc__)
    p.add_argument("--shape", action="append", choices=sorted(SHAPES),
                   help="repeatable; default wan1.3b and small-chunk on CUDA, tiny on the CPU")
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8], help="session counts (default 1 2 4 8)")
    p.add_argument("--layers", type=int, default=4, help="attention layers per forward (default 4)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available, else cpu")
    p.add_argument("--rounds", "--iters", dest="rounds", type=int, default=15,
                   help="round-robin samples per variant (default 15; --iters is an alias)")
    p.add_argument("--inner", type=int, default=3, help="back-to-back forwards per sample (default 3)")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for sessions.json / .png (default: the committed results, "
                        "benchmarks/results/sessions_<device>.json / .png)")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = build_parser()
    args = p.parse_args(argv)
    if args.rounds < 1 or args.inner < 1 or args.layers < 1 or min(args.sessions) < 1:
        p.error("--rounds, --inner, --layers and --sessions must be >= 1")
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        fail(p.prog, "--device cuda: CUDA is not available (torch.cuda.is_available() is False); "
                     "use --device cpu for a smoke run")
    device = torch.device(args.device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    shapes = args.shape or (["wan1.3b", "small-chunk"] if device.type == "cuda" else ["tiny"])
    payload: dict[str, Any] = {"layers": args.layers, "device": str(device), "rounds": args.rounds,
                               "inner": args.inner, "shapes": {}}
    for name in shapes:
        rows = []
        for n in args.sessions:
            rows.append(bench_sessions(name, n, args.layers, device, dtype, rounds=args.rounds, inner=args.inner))
            r = rows[-1]
            iqr_b, iqr_s = r["batched_stats"]["iqr_ms"], r["serial_stats"]["iqr_ms"]
            print(f"{name:12s} sessions={n}: batched {r['batched_ms']:.3g} ms (IQR {iqr_b:.2g}), "
                  f"serial {r['serial_ms']:.3g} ms (IQR {iqr_s:.2g}), "
                  f"speed-up {r['speedup']:.2f}x, fork {r['fork_host_ms']:.3f} ms / {r['fork_pages_allocated']} pages")
        payload["shapes"][name] = rows
    save_json(result_path(args.out, "sessions.json", device=args.device), payload, args=args)
    plot(payload, result_path(args.out, "sessions.png", device=args.device))
    return payload


if __name__ == "__main__":
    main()
