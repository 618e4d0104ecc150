"""One attention layer with per-head retention: a cache with retention groups vs a uniform one and the FA3 limits.

Shapes: Wan2.1-1.3B (12 heads, 4680-token chunks, sink 1 + window 6) and the 14B-like one (40 heads,
880-token chunks, sink 1 + window 7), CFG's two streams (``--cfg on``, default) or one (``--cfg off``),
windows full. Head configuration: a Forcing-KV-
like split, ``--local-fraction`` of each layer's heads (default 2/3) "local" -- sink 0 + window 1 (the
previous chunk and the current one) -- the rest keeping the full sink + window; which heads are local is
drawn per layer with a fixed seed (a synthetic assignment: the speed and memory depend on the counts,
not on which heads). Variants, timed side by side (``_timing.interleaved``), each the write of the current
K/V plus the attention, as a layer runs it:

* ``uniform``: a :class:`KVCache`, every head sink + window (contiguous extents: ragged FA3);
* ``grouped``: a :class:`KVCache` whose spec has the split as ``head_retention`` (one lane per head part, one
  ragged FA3 launch per lane);
* ``limit_uniform`` / ``limit_grouped``: FlashInfer's ragged FA3 alone over pre-gathered contiguous keys
  (every head over the full window; the local heads over 2 chunks + the rest over the full window);
* ``limit_grouped_overlap``: the same two launches, the local heads' on a side CUDA stream beside the
  others' (a lane of few heads has fewer query tiles than the H200 has SMs: alone, its last wave idles).

Reports ms per layer call (median, IQR), speed-ups vs ``uniform``, each path against its limit, and the
KV bytes one session holds (grouped / uniform). Writes ``head_retention.json`` and ``.png``
(``results/head_retention_h200.*``). CUDA + FlashInfer only.

    bash .gpu/run.sh python3 -m benchmarks.head_retention --out $OUT
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks._timing import interleaved, parser, require_gpu, result_path, save_json, stats_dict

SHAPES = {  # name: (heads, chunk, sink, window, page)
    "wan2.1-1.3b": (12, 4680, 1, 6, 120),
    "wan14b-like": (40, 880, 1, 7, 80),
}


def forcing_kv_like(num_layers: int, num_heads: int, local_fraction: float, window: tuple[int, int],
                    seed: int = 0) -> Any:
    """A synthetic Forcing-KV-like :class:`HeadRetention`: ``round(local_fraction * heads)`` local heads per layer
    (sink 0 + window 1), drawn per layer with ``seed``; the rest keep ``window`` (sink, window)."""
    import ardiff_modules as am

    rng = random.Random(seed)
    local = round(local_fraction * num_heads)
    heads = {layer: sorted(rng.sample(range(num_heads), local)) for layer in range(num_layers)}
    return am.HeadRetention.from_local_heads(num_layers, num_heads, heads, local=(0, 1), other=window)


def grouped_kv_cache(spec: Any, heads: Any, *, sessions: int = 1, device: Any = "cuda", backend: Any = "flashinfer",
                     **kwargs: Any) -> Any:
    """A :class:`KVCache` of ``spec`` with ``heads`` as its ``head_retention`` (``spec``'s sink / window left at their
    defaults), with room for ``sessions`` sessions at their peak in every lane: ``budget_bytes`` is ``sessions`` x
    the sum of the lanes' peak bytes (the cache splits a budget by each lane's peak; with the backend's contiguous
    extents, a lane's peak is its extents)."""
    import ardiff_modules as am
    from ardiff_modules.backends import resolve_backend
    from ardiff_modules.lanes import admission_of, extent_chunks_of, lane_specs
    from ardiff_modules.pool import bytes_per_page, resolve_device, torch_dtype

    spec = dataclasses.replace(spec, head_retention=heads)
    device = resolve_device("KVPool", device)
    resolved = resolve_backend(backend, device, torch_dtype(spec.dtype), spec.head_dim,
                               kv_dtype=torch_dtype(spec.cache_dtype))
    extents = kwargs.get("contiguous_extents")
    peak = sum(
        admission_of(lane, extent_chunks_of(lane, resolved.name, extents)).pages_per_session() * bytes_per_page(lane)
        for lane, _ in lane_specs(spec)
    )
    return am.KVCache(spec, budget_bytes=sessions * peak, device=device, backend=resolved, **kwargs)


def _filled_session(cache: Any, chunk: int, chunks: int, streams: int, heads: int, dim: int) -> Any:
    """A session whose branches committed ``chunks`` chunks of random K/V (layer 0 only: one layer)."""
    import torch

    import ardiff_modules as am

    state = cache.open_session()
    branches = ("cond", "uncond")[:streams]
    for _ in range(chunks):
        with state.prepare_forward(branches, chunk, commit_current=True) as fwd:
            q, k, v = (torch.randn(streams, chunk, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            am.chunk_attention(q, k, v, fwd.layers[0])
    return state


def _layer_call(state: Any, chunk: int, streams: int, heads: int, dim: int) -> tuple[Callable[[], object], Any]:
    """A denoising forward left open and one layer's write + attention over it (re-runnable: it rewrites the
    same pending pages)."""
    import torch

    import ardiff_modules as am

    fwd = state.prepare_forward(("cond", "uncond")[:streams], chunk, commit_current=False)
    q, k, v = (torch.randn(streams, chunk, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    layer = fwd.layers[0]
    return (lambda: am.chunk_attention(q, k, v, layer)), fwd


def _limit(parts: Sequence[tuple[int, int]], chunk: int, streams: int, dim: int,
           overlap: bool = False) -> Callable[[], object]:
    """Ragged FA3 over contiguous keys for each ``(heads, visible chunks)`` group, back to back; ``overlap``: the
    groups after the first launched on side CUDA streams (forked from and joined back to the current one), so
    their kernels run beside the first's (one group alone may leave SMs idle: few query tiles)."""
    import flashinfer
    import torch

    calls = []
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    for heads, visible in parts:
        keys = visible * chunk
        q = torch.randn(streams * chunk, heads, dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(streams * keys, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa3")
        wrapper.plan(torch.arange(streams + 1, dtype=torch.int32) * chunk,
                     torch.arange(streams + 1, dtype=torch.int32) * keys, heads, heads, dim, causal=False,
                     q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        calls.append((wrapper, q, k, v))
    if not overlap:
        return lambda: [w.run(q, k, v) for w, q, k, v in calls]
    sides = [torch.cuda.Stream() for _ in calls[1:]]

    def overlapped() -> object:
        current = torch.cuda.current_stream()
        outs = []
        for side, (w, q, k, v) in zip(sides, calls[1:]):
            side.wait_stream(current)
            with torch.cuda.stream(side):
                outs.append(w.run(q, k, v))
        w, q, k, v = calls[0]
        outs.append(w.run(q, k, v))
        for side in sides:
            current.wait_stream(side)
        return outs

    return overlapped


def run_shape(name: str, local_fraction: float, rounds: int, streams: int = 2) -> dict[str, Any]:
    import torch

    import ardiff_modules as am

    heads, chunk, sink, window, page = SHAPES[name]
    dim = 128
    spec = am.KVCacheSpec(num_layers=1, num_kv_heads=heads, head_dim=dim, chunk_size=chunk, page_size=page,
                          branches=("cond", "uncond"), dtype="bfloat16")
    uniform = am.KVCache(dataclasses.replace(spec, sink_chunks=sink, window_chunks=window),
                         num_pages=streams * (sink + window + 1) * (chunk // page) + 8, device="cuda",
                         backend="flashinfer")
    config = forcing_kv_like(1, heads, local_fraction, (sink, window))
    grouped = grouped_kv_cache(spec, config, device="cuda", backend="flashinfer")
    full = sink + window
    states = {"uniform": _filled_session(uniform, chunk, full + 2, streams, heads, dim),
              "grouped": _filled_session(grouped, chunk, full + 2, streams, heads, dim)}
    fns, forwards = {}, []
    for key, state in states.items():
        fn, fwd = _layer_call(state, chunk, streams, heads, dim)
        fns[key] = fn
        forwards.append(fwd)
    local = round(local_fraction * heads)
    fns["limit_uniform"] = _limit([(heads, full + 1)], chunk, streams, dim)
    # The long part first: the overlapped row launches it on the current stream, the short one beside it.
    fns["limit_grouped"] = _limit([(heads - local, full + 1), (local, 2)], chunk, streams, dim)
    fns["limit_grouped_overlap"] = _limit([(heads - local, full + 1), (local, 2)], chunk, streams, dim, overlap=True)
    stats = interleaved(fns, inner=10, rounds=rounds, warmup=3)
    modes = [lane._plan.mode for lane in forwards[1]._lanes]
    uniform_bytes = uniform.stats().pages_used * uniform.stats().bytes_per_page
    grouped_bytes = grouped.stats().bytes_used
    for fwd in forwards:
        fwd.abort()
    med = {k: s.median_ms for k, s in stats.items()}
    return {
        "shape": {"heads": heads, "chunk": chunk, "sink": sink, "window": window, "page": page, "streams": streams,
                  "local_heads": local, "local_retention": [0, 1]},
        "plan_modes_grouped": modes,
        "stats": stats_dict(stats),
        "speedup_grouped_vs_uniform": med["uniform"] / med["grouped"],
        "limit_speedup_grouped_vs_uniform": med["limit_uniform"] / med["limit_grouped"],
        "limit_speedup_grouped_overlap_vs_uniform": med["limit_uniform"] / med["limit_grouped_overlap"],
        "uniform_vs_its_limit": med["limit_uniform"] / med["uniform"],
        "grouped_vs_its_limit": med["limit_grouped"] / med["grouped"],
        "kv_bytes": {"uniform": uniform_bytes, "grouped": grouped_bytes, "ratio": grouped_bytes / uniform_bytes},
    }


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.6), squeeze=False)
    for ax, (name, r) in zip(axes[0], results.items()):
        keys = [k for k in ("uniform", "grouped", "limit_uniform", "limit_grouped", "limit_grouped_overlap")
                if k in r["stats"]]
        med = [r["stats"][k]["median_ms"] for k in keys]
        err = [r["stats"][k]["iqr_ms"] / 2 for k in keys]
        ax.bar(keys, med, yerr=err, color=["#888", "#2a7", "#bbb", "#8c8", "#5b5"][: len(keys)])
        ax.set_title(f"{name}: grouped {r['speedup_grouped_vs_uniform']:.2f}x, KV {r['kv_bytes']['ratio']:.2f}x")
        ax.set_ylabel("ms per layer (write + attention)")
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {tuple(SHAPES)}")
    p.add_argument("--local-fraction", type=float, default=2 / 3, help="share of each layer's heads kept local")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--cfg", default="on", help="on (2 streams, the default), off (1 stream) or on,off")
    p.add_argument("--out", type=Path, default=None, help="write head_retention.json/.png here")
    args = p.parse_args(argv)
    require_gpu("head_retention.py")
    cfgs = args.cfg.split(",")
    results = {
        name if cfg == "on" else f"{name}/cfg_off": run_shape(name, args.local_fraction, args.rounds, 2 if cfg == "on" else 1)
        for name in args.shapes.split(",") for cfg in cfgs
    }
    for name, r in results.items():
        print(f"{name}: grouped {r['speedup_grouped_vs_uniform']:.3f}x uniform (limits {r['limit_speedup_grouped_vs_uniform']:.3f}x, "
              f"overlapped {r['limit_speedup_grouped_overlap_vs_uniform']:.3f}x), "
              f"uniform {r['uniform_vs_its_limit']:.3f} / grouped {r['grouped_vs_its_limit']:.3f} of their limits, "
              f"KV {r['kv_bytes']['ratio']:.3f}x, modes {r['plan_modes_grouped']}")
    path = result_path(args.out, "head_retention.json")
    save_json(path, {"results": results}, args=args)
    _plot(results, path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
