"""FA3's FP8 kernel against its bf16 kernel at the sizes of retention-group lanes (GPU): is FP8 slower on few heads?

Why: on an H200, Forcing-KV's published Self-Forcing method run by the library, compiled and replayed from CUDA graphs,
took 280.4 ms per chunk step with FP8 K/V against 238.5 ms in bf16 (``end_to_end_graphed_peers_cfg_off_h200.json``),
where at full window FP8 was 1.15x faster. The FP8-only work the compiled graph adds (the per-lane query amax,
quantization fused into existing kernels) accounts for ~2 ms of the ~42 ms (stop 54's reading of the generated code).
What is left is the attention launches themselves: each layer runs one launch per lane, with 1-11 of the 12 heads
over short key spans, so a launch has few work tiles (under one wave of the H200's 132 SMs at few heads), a regime the
full-layer kernel tables (``benchmarks.attention``) never measured.

Per (query heads, visible keys), one stream of one Wan2.1-1.3B chunk (4680 query tokens, head_dim 128), the keys
contiguous (what a lane with frame slots attends: ragged FA3), timed side by side (``_timing.interleaved``):

* ``bf16``      -- FlashInfer's ragged FA3, bf16 q/k/v (what the bf16 lanes launch);
* ``fp8``       -- the same wrapper planned for FP8 q/k/v (FA3's FP8 kernel, per-head scales; q/k/v quantized
                   beforehand: the kernel alone, what the FP8 lanes' op launches);
* ``fp8_q``     -- ``quantize_query`` of the lane's bf16 query plus the FP8 kernel (eager: the quantization as
                   separate kernels, an upper bound of what the compiled graph spends on it).

Key spans (``--keys``, default): the published method's spatial lane (sink frame + last frame + the 3-frame chunk
being denoised: 5 frames, 7800 keys), its temporal lane (plus about a frame of selected patches: 9360) and layer 0's
full window (sink chunk + 6 window chunks + the pending chunk: 24 frames, 37440). Then, from the table, the
attention time of one forward over the benchmark's layer map (``forcing_kv_peer.PUBLISHED_STATIC_PER_LAYER``: per
layer >= 1 one spatial launch of its static heads and one temporal launch of the rest; layer 0 all 12 heads over the
full window), bf16 against FP8, times the 5 forwards of a chunk step: the share of the end-to-end gap these launches
explain.

Writes ``fp8_lanes.json`` (stats per cell, ratios fp8 / bf16, the per-step estimate, run metadata) and
``fp8_lanes.png`` into ``--out DIR`` (default: ``benchmarks/results/fp8_lanes_<device>.*``). Needs CUDA and
FlashInfer (exit status 2 otherwise).

    bash .gpu/run.sh python3 -m benchmarks.fp8_lanes --out $OUT
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks._timing import RESULTS, interleaved, parser, require_gpu, result_path, save_json, stats_dict

#: One Wan2.1-1.3B chunk: 3 latent frames of 1560 tokens; head_dim 128; 12 query heads in a layer.
CHUNK_TOKENS, FRAME_TOKENS, HEAD_DIM, LAYER_HEADS = 4680, 1560, 128, 12
#: Visible keys per lane kind (see the module docstring).
SPATIAL_KEYS, TEMPORAL_KEYS, FULL_KEYS = 5 * FRAME_TOKENS, 6 * FRAME_TOKENS, 24 * FRAME_TOKENS
DEFAULT_HEADS = (1, 2, 3, 4, 5, 6, 8, 11, 12)
#: Forwards per chunk step (4 denoising + 1 commit).
FORWARDS_PER_STEP = 5
#: The end-to-end run whose FP8 gap the per-step estimate is read against (CFG off, compiled + CUDA graph).
END_TO_END = RESULTS / "end_to_end_graphed_peers_cfg_off_h200.json"


def kernels(heads: int, keys: int, device: Any) -> dict[str, Callable[[], object]]:
    """The three timed calls at ``heads`` query heads (as many KV heads) over ``keys`` contiguous keys: the
    wrappers of :func:`benchmarks.baselines.contiguous_attention` (the kernel limits ``attention`` reads its
    paths against), the FP8 one given inputs quantized with per-head scales as the library's are."""
    import torch

    from ardiff_modules.quant import amax_scale, quantize, quantize_query
    from benchmarks.baselines import contiguous_attention

    gen = torch.Generator(device=device).manual_seed(heads * 100003 + keys)
    shape_q, shape_kv = (CHUNK_TOKENS, heads, HEAD_DIM), (keys, heads, HEAD_DIM)
    q = torch.randn(shape_q, generator=gen, device=device, dtype=torch.bfloat16)
    k = torch.randn(shape_kv, generator=gen, device=device, dtype=torch.bfloat16)
    v = torch.randn(shape_kv, generator=gen, device=device, dtype=torch.bfloat16)
    limits = contiguous_attention(q, k, v, streams=1, chunk=CHUNK_TOKENS, keys=keys)
    fp8 = torch.float8_e4m3fn
    k_scale, v_scale = amax_scale(k, 4.0), amax_scale(v, 4.0)
    k8, v8 = quantize(k, k_scale, fp8), quantize(v, v_scale, fp8)
    q8, q_scale = quantize_query(q)
    eight = limits.ragged8

    def fp8_with_query_quantization() -> object:
        q8_now, q_scale_now = quantize_query(q)
        return eight.run(q8_now, k8, v8, q_scale_now, k_scale, v_scale)

    return {
        "bf16": limits.fns["ragged_fa3"],
        "fp8": lambda: eight.run(q8, k8, v8, q_scale, k_scale, v_scale),
        "fp8_q": fp8_with_query_quantization,
    }


def bench_cell(heads: int, keys: int, *, inner: int, rounds: int) -> dict[str, Any]:
    """Median / IQR of each call at one (heads, keys) cell, and the FP8 kernel's time over the bf16 one's."""
    import torch

    fns = kernels(heads, keys, torch.device("cuda"))
    stats = interleaved(fns, inner=inner, rounds=rounds)
    tiles = -(-CHUNK_TOKENS // 128) * heads  # FA3's 128-row query tiles x heads: the launch's work items
    return {
        "heads": heads, "keys": keys, "query_tiles": tiles,
        "stats": stats_dict(stats, samples=False),
        "fp8_over_bf16": stats["fp8"].median_ms / stats["bf16"].median_ms,
        "fp8_q_over_bf16": stats["fp8_q"].median_ms / stats["bf16"].median_ms,
    }


def step_estimate(cells: dict[tuple[int, int], dict[str, Any]], static_per_layer: Sequence[int]) -> dict[str, Any]:
    """Attention ms of one chunk step over ``static_per_layer`` (layer 0 full window, the others two lanes each),
    per timed call, from the measured cells (each needed cell must have been measured), beside the end-to-end gap
    of the committed graphed run (:data:`END_TO_END`) where it is present."""
    needed = [(LAYER_HEADS, FULL_KEYS)] + [
        cell for s in static_per_layer[1:] for cell in ((s, SPATIAL_KEYS), (LAYER_HEADS - s, TEMPORAL_KEYS)) if cell[0]
    ]
    missing = sorted({cell for cell in needed if cell not in cells})
    if missing:
        return {"missing_cells": missing}
    per_forward = {name: sum(cells[cell]["stats"][name]["median_ms"] for cell in needed)
                   for name in ("bf16", "fp8", "fp8_q")}
    return {
        "launches_per_forward": len(needed),
        "ms_per_forward": per_forward,
        "ms_per_chunk_step": {name: ms * FORWARDS_PER_STEP for name, ms in per_forward.items()},
        "fp8_q_minus_bf16_ms_per_chunk_step": (per_forward["fp8_q"] - per_forward["bf16"]) * FORWARDS_PER_STEP,
        "fp8_minus_bf16_ms_per_chunk_step": (per_forward["fp8"] - per_forward["bf16"]) * FORWARDS_PER_STEP,
        "end_to_end_gap": end_to_end_gap(),
    }


def end_to_end_gap() -> dict[str, Any] | None:
    """FP8 minus bf16 ms per chunk step of the method's graphed rows in :data:`END_TO_END` (None without it)."""
    import json

    if not END_TO_END.exists():
        return None
    variants = json.loads(END_TO_END.read_text())["results"]["cfg_off"]["variants"]
    bf16, fp8 = (variants[name]["ms_per_chunk_step"]
                 for name in ("library_heads_compiled_graph", "library_heads_fp8_compiled_graph"))
    return {"source": str(END_TO_END.relative_to(RESULTS.parent.parent)), "bf16_ms": bf16, "fp8_ms": fp8,
            "fp8_minus_bf16_ms": fp8 - bf16}


def plot(payload: dict[str, Any], path: Path) -> Path | None:
    """FP8 kernel time over bf16 per head count, one line per key span (below 1: FP8 faster)."""
    from benchmarks._plotting import legend_below, pyplot, save

    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for keys in sorted({c["keys"] for c in payload["cells"]}):
        row = sorted((c for c in payload["cells"] if c["keys"] == keys), key=lambda c: c["heads"])
        for name, style in (("fp8_over_bf16", "-o"), ("fp8_q_over_bf16", "--x")):
            ax.plot([c["heads"] for c in row], [c[name] for c in row], style,
                    label=f"{keys} keys, {'kernel' if name == 'fp8_over_bf16' else 'q quantize + kernel'}")
    ax.axhline(1.0, color="k", lw=0.6)
    ax.set_xlabel("query heads in the launch (one lane)")
    ax.set_ylabel("FP8 time / bf16 time (lower is better)")
    gpu = payload.get("env", {}).get("gpu", "?")
    ax.set_title(f"FA3 FP8 vs bf16, 4680 queries, head_dim 128, keys contiguous ({gpu})", fontsize=10)
    legend_below(fig, ax, ncol=2)
    return save(plt, fig, path)


def build_parser() -> Any:
    p = parser(__doc__)
    p.add_argument("--out", type=Path, default=None,
                   help="folder for fp8_lanes.json / .png (default: benchmarks/results/fp8_lanes_<device>.*)")
    p.add_argument("--heads", type=int, nargs="+", default=list(DEFAULT_HEADS), help="query heads per launch")
    p.add_argument("--keys", type=int, nargs="+", default=[SPATIAL_KEYS, TEMPORAL_KEYS, FULL_KEYS],
                   help="visible keys per launch")
    p.add_argument("--inner", type=int, default=10, help="back-to-back calls per sample (default 10)")
    p.add_argument("--rounds", type=int, default=10, help="round-robin samples per call (default 10)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks.forcing_kv_peer import PUBLISHED_STATIC_PER_LAYER

    p = build_parser()
    args = p.parse_args(argv)
    if args.inner < 1 or args.rounds < 1 or min(args.heads) < 1 or min(args.keys) < 1:
        p.error("--inner, --rounds, --heads and --keys must be >= 1")
    require_gpu(p.prog)
    cells: dict[tuple[int, int], dict[str, Any]] = {}
    for keys in args.keys:
        for heads in args.heads:
            cell = bench_cell(heads, keys, inner=args.inner, rounds=args.rounds)
            cells[heads, keys] = cell
            ms = {name: round(st["median_ms"], 4) for name, st in cell["stats"].items()}
            print(f"heads {heads:2d} keys {keys:5d} tiles {cell['query_tiles']:3d}: {ms} "
                  f"fp8/bf16 {cell['fp8_over_bf16']:.3f}, with q quantization {cell['fp8_q_over_bf16']:.3f}")
    # The layer map needs (heads, keys) cells for its split's head counts: measure the missing ones now.
    for static in sorted(set(PUBLISHED_STATIC_PER_LAYER[1:])):
        for cell_key in ((static, SPATIAL_KEYS), (LAYER_HEADS - static, TEMPORAL_KEYS), (LAYER_HEADS, FULL_KEYS)):
            if cell_key not in cells and cell_key[0] > 0:
                cells[cell_key] = bench_cell(*cell_key, inner=args.inner, rounds=args.rounds)
    estimate = step_estimate(cells, PUBLISHED_STATIC_PER_LAYER)
    print("published layer map, per chunk step:", estimate)
    payload = {"config": {"chunk_tokens": CHUNK_TOKENS, "head_dim": HEAD_DIM, "layer_heads": LAYER_HEADS,
                          "static_per_layer": list(PUBLISHED_STATIC_PER_LAYER)},
               "cells": list(cells.values()), "published_map_estimate": estimate}
    save_json(result_path(args.out, "fp8_lanes.json"), payload, args=args)
    plot(payload, result_path(args.out, "fp8_lanes.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
