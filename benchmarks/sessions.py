"""Sessions benchmark: N sessions batched in one launch per layer vs the same sessions one after another.

For 1, 2, 4, 8 sessions (each with CFG's two branches, windows full), one forward =
``prepare_forward`` (host: allocation, plan) + ``--layers`` layers of ``chunk_attention``:

* ``batched`` -- every session's streams are rows of one plan: one kernel launch per layer;
* ``serial``  -- each session prepares and runs its own forward.

Reported: aggregate tokens/s, latency per chunk forward, the speed-up, KV bytes per session, and the
cost of ``fork`` (host time; pages allocated and bytes written must both be 0).

    bash .gpu/run.sh python3 benchmarks/sessions.py --out benchmarks/results          # H200
    python benchmarks/sessions.py --shape tiny --device cpu --out /tmp/sessions        # CPU smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _timing import environment, save_json  # noqa: E402

import ardiff_modules as am  # noqa: E402

SHAPES = {
    "wan1.3b": dict(heads=12, head_dim=128, chunk=4680, page=120, sink=1, window=6),
    "small-chunk": dict(heads=12, head_dim=128, chunk=880, page=80, sink=1, window=7),
    "tiny": dict(heads=2, head_dim=16, chunk=32, page=8, sink=1, window=2),
}


def _spec(shape: dict, layers: int, dtype: str) -> am.KVCacheSpec:
    return am.KVCacheSpec(
        num_layers=layers, num_kv_heads=shape["heads"], head_dim=shape["head_dim"], chunk_size=shape["chunk"],
        page_size=shape["page"], sink_chunks=shape["sink"], window_chunks=shape["window"],
        branches=("cond", "uncond"), dtype=dtype,
    )


class Timer:
    """Wall time of whole forwards (host + device), synchronised at both ends; variants sampled
    round-robin so drift hits them alike."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def __call__(self, fns: dict, iters: int) -> dict[str, float]:  # noqa: ANN001
        for fn in fns.values():
            fn()
        samples: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(iters):
            for name, fn in fns.items():
                self.sync()
                t0 = time.perf_counter()
                fn()
                self.sync()
                samples[name].append(time.perf_counter() - t0)
        return {name: statistics.median(times) for name, times in samples.items()}


def bench_sessions(shape_name: str, sessions: int, layers: int, device: torch.device, dtype: str, iters: int) -> dict:
    shape = SHAPES[shape_name]
    spec = _spec(shape, layers, dtype)
    pages = sessions * spec.pages_per_chunk * (spec.max_resident_chunks + 2) * 2
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
    for _ in range(spec.max_resident_chunks + 1):
        with cache.prepare_forward(streams, spec.chunk_size, commit_current=True) as fwd:
            run(fwd, slice(None))

    def batched() -> None:
        with cache.prepare_forward(streams, spec.chunk_size, commit_current=False) as fwd:
            run(fwd, slice(None))

    def serial() -> None:
        for i, state in enumerate(states):
            with state.prepare_forward(spec.branches, spec.chunk_size, commit_current=False) as fwd:
                run(fwd, slice(2 * i, 2 * i + 2))

    timer = Timer(device)
    times = timer({"batched": batched, "serial": serial}, iters)
    t_batched, t_serial = times["batched"], times["serial"]
    tokens = 2 * sessions * spec.chunk_size
    modes = sorted({f.plan.mode for f in cache.forward_contexts() if f.plan is not None}) if device.type == "cuda" else []
    result = {
        "sessions": sessions,
        "batched_ms": t_batched * 1e3,
        "serial_ms": t_serial * 1e3,
        "speedup": t_serial / t_batched,
        "batched_tokens_per_s": tokens / t_batched,
        "serial_tokens_per_s": tokens / t_serial,
        "kv_bytes_per_session": cache.pages_per_session() * cache.pool.bytes_per_page,
        "kernel_modes": modes,
    }
    # Fork cost: zero pages, zero bytes written.
    used_before = cache.allocator.num_used
    checksum = cache.pool.kv.float().sum().item() if cache.pool.nbytes < (1 << 31) else None
    t0 = time.perf_counter()
    child = states[0].fork()
    result["fork_host_ms"] = (time.perf_counter() - t0) * 1e3
    result["fork_pages_allocated"] = cache.allocator.num_used - used_before
    if checksum is not None:
        result["fork_pool_unchanged"] = cache.pool.kv.float().sum().item() == checksum
    child.close()
    for state in states:
        state.close()
    assert cache.allocator.num_free == cache.allocator.num_pages
    return result


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(payload["shapes"]), figsize=(5 * len(payload["shapes"]), 4), squeeze=False)
    for ax, (name, rows) in zip(axes[0], payload["shapes"].items()):
        n = [r["sessions"] for r in rows]
        ax.plot(n, [r["batched_tokens_per_s"] / 1e6 for r in rows], "o-", label="batched (one launch per layer)")
        ax.plot(n, [r["serial_tokens_per_s"] / 1e6 for r in rows], "s--", label="serial")
        for r in rows:
            ax.annotate(f"{r['speedup']:.2f}x", (r["sessions"], r["batched_tokens_per_s"] / 1e6), fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)  # differences of a few percent must look like it
        ax.set_xlabel("sessions (2 CFG streams each)")
        ax.set_ylabel("aggregate Mtokens/s")
        ax.set_title(name)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), help="repeatable; default wan1.3b and small-chunk")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--layers", type=int, default=4, help="attention layers per forward")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iters", type=int, default=25)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    shapes = args.shape or ["wan1.3b", "small-chunk"]
    payload: dict = {"env": environment(), "layers": args.layers, "device": str(device), "shapes": {}}
    for name in shapes:
        rows = []
        for n in args.sessions:
            rows.append(bench_sessions(name, n, args.layers, device, dtype, args.iters))
            r = rows[-1]
            print(f"{name:12s} sessions={n}: batched {r['batched_ms']:.2f} ms, serial {r['serial_ms']:.2f} ms, "
                  f"speed-up {r['speedup']:.2f}x, fork {r['fork_host_ms']:.3f} ms / {r['fork_pages_allocated']} pages")
        payload["shapes"][name] = rows
    save_json(args.out / "sessions.json", payload)
    plot(payload, args.out / "sessions.png")
    return payload


if __name__ == "__main__":
    main()
