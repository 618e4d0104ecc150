"""Attention benchmark (GPU): this library's paged path vs the contiguous limits, side by side in one run.

Per shape (one layer, bf16, head_dim 128, one pending chunk per stream, the window full):

* ``library``          -- ``chunk_attention`` through the custom op (K/V append + attention), default
                          layout: contiguous extents -> ragged FA3 over each stream's key range
* ``library_attend``   -- the same plan's kernel alone (no write)
* ``library_graph``    -- ``library`` under a static plan, replayed from a CUDA graph (ragged FA3 over the
                          whole layer with absolute key offsets); ``library_fp8_graph`` likewise
* ``library_paged``    -- ``chunk_attention`` with plain paging (structural paged FA3), as used for
                          multi-chunk forwards and shared pages
* ``library_paged_attend`` -- that kernel alone
* ``ragged_fa3``       -- FlashInfer ragged FA3 over the same visible keys held contiguous (the practical limit);
                          ``ragged_fa3_again`` times the same call under a second name: their spread is the noise
* ``sdpa``             -- torch SDPA on contiguous K/V
* ``flex``             -- compiled FlexAttention over the whole timeline with a sink+window block mask
* ``fa2_mask``         -- this library's masked path (FA2 + packed custom mask, all true)
* ``gather_ragged``    -- gather the visible pages into a contiguous buffer, then ragged FA3

plus the KV write cost per layer (page ``index_copy_``, token ``index_copy_``, FlashInfer
``append_paged_kv_cache``, per-stream slice copies and the rolling-buffer memmove peers use; and the
compiled path: RMSNorm + RoPE of k compiled with and without the in-graph pool write; timed side
by side), the device copy bandwidth (the floor of any separate write) and the host time per forward
(``prepare_forward`` + commit: allocation, eviction, plan) for a 1-layer and a 30-layer model.

Timing (``_timing.py``): every path is sampled round-robin with the others, ``--rounds`` samples of
``--inner`` back-to-back calls each (``torch.utils.benchmark.Timer``); medians with IQR; the ratios to
``ragged_fa3`` are ratios of medians. Needs CUDA and FlashInfer (exit status 2 otherwise).

Writes ``OUT/attention.json`` (config, ``attention_ms`` medians + ``attention_stats`` median / IQR /
p25 / p75 / samples per path, ratios, TFLOP/s, KV write costs with their stats, host times, run
metadata), ``OUT/attention.png`` (ratios with IQR error bars) and ``OUT/host_profile.txt`` (cProfile of
the host path).

    bash .gpu/run.sh python3 benchmarks/attention.py --out benchmarks/results
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if str(HERE.parent) not in sys.path:  # this checkout's package, unless one is installed or on PYTHONPATH
    sys.path.append(str(HERE.parent))
from _timing import each_call, interleaved, measure, once, parser, require_gpu, save_json, stats_dict  # noqa: E402

SHAPES = {
    "wan1.3b": dict(heads=12, chunk=4680, sink=1, window=6, streams=2, page=120),
    "14b-like": dict(heads=40, chunk=880, sink=1, window=7, streams=2, page=80),
}
D = 128
#: Paths drawn in attention.png, in this order.
PLOT_METHODS = ("ragged_fa3", "library", "library_attend", "library_graph", "library_paged",
                "library_paged_attend", "ragged_fa3_fp8", "library_fp8", "library_fp8_attend", "library_fp8_graph",
                "library_fp8_paged", "gather_ragged", "sdpa", "flex", "fa2_mask")


def flops(streams: int, q: int, keys: int, heads: int) -> float:
    return 4.0 * streams * q * keys * heads * D


def bench_shape(name: str, heads: int, chunk: int, sink: int, window: int, streams: int, page: int, *,
                inner: int = 10, rounds: int = 15) -> dict[str, Any]:
    import flashinfer
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import ardiff_modules as am
    from ardiff_modules.pool import KVPool

    dt = torch.bfloat16
    dev = torch.device("cuda")
    resident = sink + window
    keys = (resident + 1) * chunk
    spec = am.KVCacheSpec(
        num_layers=1, num_kv_heads=heads, head_dim=D, chunk_size=chunk, page_size=page, sink_chunks=sink,
        window_chunks=window, branches=tuple(f"b{i}" for i in range(streams)), dtype="bfloat16",
    )
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=dt, generator=g)

    q, k, v = rand(streams, chunk, heads, D), rand(streams, chunk, heads, D), rand(streams, chunk, heads, D)
    qf = q.reshape(-1, heads, D)
    fns: dict[str, Callable[[], object]] = {}  # every attention path, timed round-robin at the end
    modes = {}
    states = []
    outputs: dict[str, torch.Tensor] = {}
    pool_bytes: dict[str, int] = {}
    layers_by_label: dict[str, Any] = {}
    static_forwards: list[Any] = []
    for label, extents, kv_dtype in (
        ("library", True, None), ("library_paged", False, None),
        ("library_fp8", True, "float8_e4m3fn"), ("library_fp8_paged", False, "float8_e4m3fn"),
    ):
        lspec = dataclasses.replace(spec, kv_dtype=kv_dtype)
        cache = am.KVCache(lspec, num_pages=streams * (resident + 2) * spec.pages_per_chunk, device=dev,
                           backend="flashinfer", contiguous_extents=extents)
        pool_bytes[label] = cache.pool.nbytes
        state = cache.open_session()
        states.append(state)
        for _ in range(resident + 2):  # fill the window and evict once
            with state.prepare_forward(None, chunk, commit_current=True) as fwd:
                am.chunk_attention(q, k, v, fwd.layers[0])
        fwd = state.prepare_forward(None, chunk, commit_current=False)
        layer = fwd.layers[0]
        plan = fwd.plan
        modes[label] = plan.mode
        outputs[label] = am.chunk_attention(q, k, v, layer)
        fns[label] = lambda layer=layer: am.chunk_attention(q, k, v, layer)
        # The kernel alone (K/V already written): the plan's public attend(), default scale.
        fns[label + "_attend"] = lambda plan=plan, layer=layer: plan.attend(
            qf, layer.k_cache, layer.v_cache, D**-0.5
        )
        layers_by_label[label] = layer
        if label == "library_paged":
            paged = (cache, fwd, layer)
        if extents:
            # The same forward as a CUDA graph: a static plan replays ragged FA3 with absolute key offsets.
            sfwd = state.prepare_forward(None, chunk, commit_current=False, static=True)
            modes[label + "_graph"] = sfwd.plan.mode
            fns[label + "_graph"] = _graphed(lambda layer=sfwd.layers[0]: am.chunk_attention(q, k, v, layer))
            static_forwards.append(sfwd)
            fwd = state.prepare_forward(None, chunk, commit_current=False)  # back to the eager forward
            layers_by_label[label] = layer = fwd.layers[0]
            fns[label] = lambda layer=layer: am.chunk_attention(q, k, v, layer)
            fns[label + "_attend"] = lambda plan=fwd.plan, layer=layer: plan.attend(
                qf, layer.k_cache, layer.v_cache, D**-0.5
            )
    # From here on, `cache` / `fwd` / `layer` are the plain-paged bf16 ones.
    cache, fwd, layer = paged

    # Contiguous K/V holding exactly the visible keys of each stream.
    kc, vc = rand(streams * keys, heads, D), rand(streams * keys, heads, D)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    qo_indptr = torch.arange(streams + 1, dtype=torch.int32) * chunk
    kv_indptr = torch.arange(streams + 1, dtype=torch.int32) * keys
    ragged.plan(qo_indptr, kv_indptr, heads, heads, D, causal=False, q_data_type=dt, kv_data_type=dt)
    fns["ragged_fa3"] = lambda: ragged.run(qf, kc, vc)
    # FA3's FP8 kernel over the same contiguous keys (per-head scales, query quantized beforehand): the
    # FP8 limit, to read the library's FP8 path against.
    fp8 = torch.float8_e4m3fn
    ragged8 = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa3")
    ragged8.plan(qo_indptr, kv_indptr, heads, heads, D, causal=False, q_data_type=fp8, kv_data_type=fp8,
                 o_data_type=dt)
    unit = torch.ones(heads, device=dev)
    q8, k8, v8 = qf.to(fp8), kc.to(fp8), vc.to(fp8)
    fns["ragged_fa3_fp8"] = lambda: ragged8.run(q8, k8, v8, unit, unit, unit)
    # The same call again under a second name: the spread between the two is the timing noise.
    fns["ragged_fa3_again"] = lambda: ragged.run(qf, kc, vc)

    qs = qf.view(streams, chunk, heads, D).transpose(1, 2)
    ks = kc.view(streams, keys, heads, D).transpose(1, 2)
    vs = vc.view(streams, keys, heads, D).transpose(1, 2)
    fns["sdpa"] = lambda: F.scaled_dot_product_attention(qs, ks, vs)

    # FlexAttention over a whole timeline of chunks with a sink + window block mask.
    total_chunks = resident + 4
    current = total_chunks - 1
    kt = rand(streams, heads, total_chunks * chunk, D)
    vt = rand(streams, heads, total_chunks * chunk, D)

    def sink_window(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        kv_chunk = kv_idx // chunk
        return (kv_chunk < sink) | ((kv_chunk >= current - window) & (kv_chunk <= current))

    def offset_mask(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return sink_window(b, h, q_idx + current * chunk, kv_idx)

    block_mask = create_block_mask(offset_mask, None, None, chunk, total_chunks * chunk, device="cuda")
    flex = torch.compile(flex_attention)
    fns["flex"] = lambda: flex(qs, kt, vt, block_mask=block_mask)

    # This library's masked path (FA2 + custom mask), all-true mask.
    masked_cache = am.KVCache(spec, num_pages=cache.allocator.num_pages, device=dev, backend="flashinfer")
    mstate = masked_cache.open_session()
    for _ in range(resident + 1):
        with mstate.prepare_forward(None, chunk, commit_current=True) as f2:
            am.chunk_attention(q, k, v, f2.layers[0])
    mask = torch.ones(streams, chunk, keys, dtype=torch.bool, device=dev)
    # One-off: FA2 packs the mask in plan() (device synchronised before and after).
    mfwd, masked_plan_s = once(lambda: mstate.prepare_forward(None, chunk, commit_current=False, token_mask=mask))
    fns["fa2_mask"] = lambda: am.chunk_attention(q, k, v, mfwd.layers[0])

    # Gather the visible pages contiguous each forward, then ragged FA3.
    gather = fwd.layout.dense_keys[0].to(dev)
    kslots = KVPool.token_slots(layer.k_cache)
    vslots = KVPool.token_slots(layer.v_cache)

    def gather_ragged() -> torch.Tensor:
        kg = kslots[gather].view(-1, heads, D)
        vg = vslots[gather].view(-1, heads, D)
        return ragged.run(qf, kg, vg)

    fns["gather_ragged"] = gather_ragged
    fns["gather_only"] = lambda: (kslots[gather], vslots[gather])
    attention = interleaved(fns, inner=inner, rounds=rounds)

    # KV write cost per layer (K and V of every stream's current chunk), the ways side by side.
    pages = fwd.layout.write_pages.to(dev)
    slots = fwd.layout.write_slots.to(dev)
    kflat, vflat = k.reshape(-1, heads, D), v.reshape(-1, heads, D)
    write_fns: dict[str, Callable[[], object]] = {}

    def page_copy() -> None:
        layer.k_cache.index_copy_(0, pages, kflat.view(-1, page, heads, D))
        layer.v_cache.index_copy_(0, pages, vflat.view(-1, page, heads, D))

    def token_copy() -> None:
        kslots.index_copy_(0, slots, kflat)
        vslots.index_copy_(0, slots, vflat)

    write_fns["page_index_copy"] = page_copy
    write_fns["token_index_copy"] = token_copy
    append_indptr = (torch.arange(streams + 1, dtype=torch.int32) * chunk).to(dev)
    # Append into each stream's pending chunk: a per-stream page table of just that chunk.
    ppc = chunk // page
    pend = torch.tensor([p for s in fwd.layout.streams for c in s.pending_pages for p in c], dtype=torch.int32,
                        device=dev)
    kv_indptr_pages = (torch.arange(streams + 1, dtype=torch.int32) * ppc).to(dev)
    last_len = torch.full((streams,), page, dtype=torch.int32, device=dev)
    seq_lens = torch.full((streams,), chunk, dtype=torch.int32, device=dev)
    bi, pos = flashinfer.get_batch_indices_positions(append_indptr, seq_lens, streams * chunk)
    write_fns["flashinfer_append"] = lambda: flashinfer.append_paged_kv_cache(
        kflat, vflat, bi, pos, (layer.k_cache, layer.v_cache), pend, kv_indptr_pages, last_len
    )
    # Rolling buffer as Self-Forcing / LongLive: shift the window by one chunk, write the new chunk at the end.
    roll_k = rand(streams, keys, heads, D)
    roll_v = rand(streams, keys, heads, D)
    keep = sink * chunk

    def rolling() -> None:
        for buf, new in ((roll_k, k), (roll_v, v)):
            buf[:, keep:-chunk].copy_(buf[:, keep + chunk :].clone())
            buf[:, -chunk:].copy_(new)

    write_fns["rolling_memmove"] = rolling
    # Contiguous pending slots (contiguous extents): plain per-stream slice copies.
    starts = [min(s.pending_pages[0][0] * page, kslots.shape[0] - chunk) for s in fwd.layout.streams]

    def slice_copy() -> None:
        for i, a in enumerate(starts):
            kslots[a : a + chunk].copy_(k[i])
            vslots[a : a + chunk].copy_(v[i])

    write_fns["contiguous_slice_copy"] = slice_copy
    # Compiled path: K/V written by the graph that computes them (RMSNorm + RoPE of k, then the store,
    # fused by inductor) vs the same graph returning k and v for a separate write. The difference is
    # what the write costs on the compiled path.
    compiled_fns = compiled_write_fns(layers_by_label, k, v, heads, chunk, streams)
    write_fns.update(compiled_fns)
    write_stats = interleaved(write_fns, inner=inner, rounds=rounds)
    writes = {name: st.median_ms for name, st in write_stats.items()}
    # The floor of any separate write: read K and V once, write them once, at the measured copy bandwidth.
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    big_out = torch.empty_like(big)
    copy_stats = measure(functools.partial(big_out.copy_, big), inner=None)  # Timer.adaptive_autorange
    copy_gbps = 2 * big.numel() / (copy_stats.median_ms * 1e-3) / 1e9
    del big, big_out
    kv_bytes = 2 * k.numel() * k.element_size()
    writes["bandwidth_floor"] = 2 * kv_bytes / (copy_gbps * 1e9) * 1e3
    for st in (*states, mstate):
        st.abort()
    del static_forwards

    results = {name: st.median_ms for name, st in attention.items()}

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).norm() / b.float().norm())

    # Accuracy on these random inputs (one layer): FP8 and bf16 against an fp32 recomputation, for scale.
    from ardiff_modules.quant import DEFAULT_HEADROOM, amax_scale, quantize, quantize_query

    exact = F.scaled_dot_product_attention(qs.float(), ks.float(), vs.float()).transpose(1, 2).reshape(-1, heads, D)
    sk, sv = amax_scale(kc, DEFAULT_HEADROOM), amax_scale(vc, DEFAULT_HEADROOM)
    q8s, sq = quantize_query(qf)
    fp8_out = ragged8.run(q8s, quantize(kc, sk), quantize(vc, sv), sq, sk, sv)
    accuracy = {
        "bf16_vs_fp32_rel": rel(ragged.run(qf, kc, vc), exact),
        "fp8_vs_fp32_rel": rel(fp8_out, exact),
        "fp8_vs_bf16_rel": rel(outputs["library_fp8"], outputs["library"]),
        "fp8_paged_vs_bf16_rel": rel(outputs["library_fp8_paged"], outputs["library"]),
    }
    limit = results["ragged_fa3"]
    fl = flops(streams, chunk, keys, heads)
    return {
        "config": dict(heads=heads, head_dim=D, chunk=chunk, sink=sink, window=window, streams=streams, page=page,
                       visible_keys=keys),
        "attention_ms": results,
        "attention_stats": stats_dict(attention),
        "timing": f"torch.utils.benchmark, median (IQR in attention_stats) of {rounds} round-robin samples of "
                  f"{inner} back-to-back calls each",
        "timing_noise": abs(results["ragged_fa3_again"] / results["ragged_fa3"] - 1.0),
        "tflops": {k_: fl / (ms * 1e-3) / 1e12 for k_, ms in results.items() if k_ != "gather_only"},
        "ratio_vs_ragged_fa3": {k_: limit / ms for k_, ms in results.items() if k_ != "gather_only"},
        "kv_write_ms": writes,
        "kv_write_stats": stats_dict(write_stats),
        "write_fraction_of_attention": writes["flashinfer_append"] / results["library_attend"],
        # Compiled: (norm + RoPE + write into the pool) - (norm + RoPE returning k, v), over the kernel.
        "compiled_write_fraction_of_attention": (
            writes["compiled_produce_and_write"] - writes["compiled_produce"]
        ) / results["library_attend"],
        "compiled_fp8_write_fraction_of_attention": (
            writes["compiled_produce_and_write_fp8"] - writes["compiled_produce"]
        ) / results["library_fp8_attend"],
        # Device time alone (CUDA-graph replays of the compiled functions).
        "compiled_write_device_fraction_of_attention": (
            writes["compiled_produce_and_write_graph"] - writes["compiled_produce_graph"]
        ) / results["library_attend"],
        "compiled_fp8_write_device_fraction_of_attention": (
            writes["compiled_produce_and_write_fp8_graph"] - writes["compiled_produce_graph"]
        ) / results["library_fp8_attend"],
        "eager_write_fraction_of_attention": writes["flashinfer_append"] / results["library_attend"],
        "graph_ratio_vs_eager": results["library"] / results["library_graph"],
        "fp8_graph_ratio_vs_eager": results["library_fp8"] / results["library_fp8_graph"],
        "write_floor_fraction_of_attention": writes["bandwidth_floor"] / results["library_attend"],
        "copy_bandwidth_gbps": copy_gbps,
        "copy_stats": copy_stats.as_dict(),
        "modes": modes,
        "accuracy": accuracy,
        "pool_bytes": pool_bytes,
        "fp8_ratio_vs_ragged_fa3": limit / results["library_fp8"],
        "fp8_attend_ratio_vs_ragged_fa3": limit / results["library_fp8_attend"],
        "fa2_mask_plan_ms": masked_plan_s * 1e3,
    }


def _graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` captured as a CUDA graph (warmed up on a side stream first); returns its replay."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def compiled_write_fns(layers: dict[str, Any], k: Any, v: Any, heads: int, chunk: int,
                       streams: int) -> dict[str, Callable[[], object]]:
    """Compiled K/V producers with and without the in-graph pool write (bf16 and FP8 pools)."""
    import torch

    from ardiff_modules.modules.functional import rotate
    from ardiff_modules.ops import write_kv_in_graph

    g = torch.Generator(device="cuda").manual_seed(1)
    angles = torch.rand(1, chunk, 1, D // 2, device="cuda", generator=g) * 6.28
    cos = angles.cos().repeat_interleave(2, -1).to(k.dtype)
    sin = angles.sin().repeat_interleave(2, -1).to(k.dtype)
    weight = torch.ones(D, device="cuda", dtype=k.dtype)

    def produce(kx: torch.Tensor, vx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kn = torch.nn.functional.rms_norm(kx, (D,), weight, 1e-6)
        return rotate(kn, cos, sin).reshape(-1, heads, D), vx.reshape(-1, heads, D)

    def produce_and_write(kx: torch.Tensor, vx: torch.Tensor, layer: Any) -> None:
        kr, vr = produce(kx, vx)
        write_kv_in_graph(kr, vr, layer.kv_pool, layer.kv_scales, layer.layer_id, layer.forward.handle_id)

    produce_c = torch.compile(produce, fullgraph=True, dynamic=False)
    write_c = torch.compile(produce_and_write, fullgraph=True, dynamic=False)
    bf16, fp8 = layers["library"], layers["library_fp8"]
    fns: dict[str, Callable[[], object]] = {
        "compiled_produce": lambda: produce_c(k, v),
        "compiled_produce_and_write": lambda: write_c(k, v, bf16),
        "compiled_produce_and_write_fp8": lambda: write_c(k, v, fp8),
    }
    # The same calls replayed from CUDA graphs: device time alone. Called eagerly one at a time, a
    # compiled function this small is bound by its host time (guards, the gate op), which a model
    # step hides behind the attention kernels or a whole-step graph removes.
    for name in list(fns):
        fns[name + "_graph"] = _graphed(fns[name])
    return fns


def host_time(layers: int, extents: bool, iters: int = 30, warmup: int = 5) -> dict[str, Any]:
    """Host time of prepare_forward + commit (allocation, eviction, plan) at Wan shapes.

    Each forward is timed alone (``each_call``, host only: the device is synchronised before it, not
    after), after ``warmup`` forwards that fill the windows.
    """
    import ardiff_modules as am

    spec = am.KVCacheSpec(
        num_layers=layers, num_kv_heads=12, head_dim=D, chunk_size=4680, page_size=120, sink_chunks=1,
        window_chunks=6, branches=("cond", "uncond"), dtype="bfloat16",
    )
    cache = am.KVCache(spec, num_pages=2 * 9 * spec.pages_per_chunk, device="cuda", backend="flashinfer",
                       contiguous_extents=extents)
    state = cache.open_session()
    modes: set[str] = set()

    def forward() -> None:
        fwd = state.prepare_forward(None, 4680, commit_current=True)
        fwd.commit()
        modes.add(fwd.plan.mode)

    stats, _ = each_call(forward, iters, warmup=warmup, sync_end=False)
    state.close()
    return {"layers": layers, "contiguous_extents": extents, "prepare_plus_commit_ms_median": stats.median_ms,
            "max_ms": max(stats.samples_ms), "stats": stats.as_dict(), "modes": sorted(modes)}


def profile_host(path: Path) -> None:
    """cProfile of prepare_forward + commit (30 layers, both layouts), to find host hot spots."""
    import cProfile
    import io
    import pstats

    out = io.StringIO()
    for extents in (True, False):
        profiler = cProfile.Profile()
        profiler.enable()
        host_time(30, extents, iters=60)
        profiler.disable()
        out.write(f"==== contiguous_extents={extents}\n")
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(40)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(out.getvalue())
    print(f"wrote {path}")


def plot(payload: dict[str, Any], path: Path) -> Path | None:
    """Speed relative to ragged FA3 per path and shape; error bars: the path's IQR mapped onto the ratio."""
    from _plotting import bars, legend_below, pyplot, save

    plt = pyplot()
    if plt is None:
        return None
    shapes = list(payload["shapes"])
    methods = [m for m in PLOT_METHODS if any(m in payload["shapes"][s]["ratio_vs_ragged_fa3"] for s in shapes)]
    fig, ax = plt.subplots(figsize=(11, 5), layout="constrained")
    width = 0.8 / len(shapes)
    has_spread = False
    for i, shape in enumerate(shapes):
        res = payload["shapes"][shape]
        limit = res["attention_ms"]["ragged_fa3"]
        stats = res.get("attention_stats", {})
        ratios = [res["ratio_vs_ragged_fa3"].get(m, float("nan")) for m in methods]
        bounds: list[tuple[float, float] | None] = []
        for m in methods:
            st = stats.get(m)
            # A slower sample (p75 ms) is a lower ratio: the IQR of the path's time, as a ratio to the limit's median.
            bounds.append((limit / st["p75_ms"], limit / st["p25_ms"]) if st else None)
        has_spread |= any(b is not None for b in bounds)
        xs = [x + i * width for x in range(len(methods))]
        bars(ax, xs, ratios, width, bounds=bounds, labels=[f"{r:.2f}" for r in ratios], label=shape)
    ax.set_xticks([x + width * (len(shapes) - 1) / 2 for x in range(len(methods))], methods, rotation=25,
                  ha="right", rotation_mode="anchor")
    ax.axhline(1.0, color="k", lw=0.6)
    ax.margins(y=0.12)
    ax.set_ylabel("speed vs contiguous ragged FA3 (higher is better)")
    gpu = payload.get("env", {}).get("gpu", "?")
    note = "error bars: IQR of each path's time" if has_spread else "medians (no spread recorded in this run)"
    ax.set_title(f"Per-layer attention, one pending chunk, window full ({gpu}); {note}", fontsize=10)
    legend_below(fig, ax, ncol=len(shapes))
    return save(plt, fig, path)


def build_parser() -> Any:
    p = parser(__doc__)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for the outputs")
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES), help="shapes to run")
    p.add_argument("--inner", type=int, default=10, help="back-to-back calls per sample (default 10)")
    p.add_argument("--rounds", type=int, default=15, help="round-robin samples per path (default 15)")
    p.add_argument("--host-iters", type=int, default=30, help="timed forwards per host-time point (default 30)")
    p.add_argument("--no-profile", action="store_true", help="skip the cProfile of the host path")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.inner < 1 or args.rounds < 1 or args.host_iters < 1:
        p.error("--inner, --rounds and --host-iters must be >= 1")
    require_gpu(p.prog)
    payload: dict[str, Any] = {"shapes": {}, "host": []}
    for name in args.shapes:
        res = bench_shape(name, **SHAPES[name], inner=args.inner, rounds=args.rounds)
        payload["shapes"][name] = res
        print(name, {k: round(v, 3) for k, v in res["ratio_vs_ragged_fa3"].items()})
        print("  ms (median, IQR)", {k: f"{st['median_ms']:.4g} ({st['iqr_ms']:.2g})"
                                     for k, st in res["attention_stats"].items()})
        print("  write ms", {k: round(v, 4) for k, v in res["kv_write_ms"].items()})
    for layers in (1, 30):
        for extents in (True, False):
            payload["host"].append(host_time(layers, extents, iters=args.host_iters))
            print("host", {k: v for k, v in payload["host"][-1].items() if k != "stats"})
    save_json(args.out / "attention.json", payload, args=args)
    if not args.no_profile:
        profile_host(args.out / "host_profile.txt")
    plot(payload, args.out / "attention.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
