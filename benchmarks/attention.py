"""Attention benchmark (H200): this library's paged path vs the contiguous limits, side by side in one run.

Per shape (one layer, bf16, head_dim 128, one pending chunk per stream, the window full):

* ``library``          -- ``chunk_attention`` through the custom op (K/V append + attention), default
                          layout: contiguous extents -> ragged FA3 over each stream's key range
* ``library_attend``   -- the same plan's kernel alone (no write)
* ``library_paged``    -- ``chunk_attention`` with plain paging (structural paged FA3), as used for
                          multi-chunk forwards and shared pages
* ``library_paged_attend`` -- that kernel alone
* ``ragged_fa3``       -- FlashInfer ragged FA3 over the same visible keys held contiguous (the practical limit)
* ``sdpa``             -- torch SDPA on contiguous K/V
* ``flex``             -- compiled FlexAttention over the whole timeline with a sink+window block mask
* ``fa2_mask``         -- this library's masked path (FA2 + packed custom mask, all true)
* ``gather_ragged``    -- gather the visible pages into a contiguous buffer, then ragged FA3

plus the KV write cost per layer (page ``index_copy_``, token ``index_copy_``, FlashInfer
``append_paged_kv_cache``, and the rolling-buffer memmove peers use) and the host time per forward
(``prepare_forward``: allocation + plan) for a 1-layer and a 30-layer model.

    bash .gpu/run.sh python3 benchmarks/attention.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from _timing import cuda_time_ms, environment, interleaved_ms, save_json

import ardiff_modules as am

SHAPES = {
    "wan1.3b": dict(heads=12, chunk=4680, sink=1, window=6, streams=2, page=120),
    "14b-like": dict(heads=40, chunk=880, sink=1, window=7, streams=2, page=80),
}
D = 128
DT = torch.bfloat16


def flops(streams: int, q: int, keys: int, heads: int) -> float:
    return 4.0 * streams * q * keys * heads * D


def bench_shape(name: str, heads: int, chunk: int, sink: int, window: int, streams: int, page: int) -> dict:
    import flashinfer

    dev = torch.device("cuda")
    resident = sink + window
    keys = (resident + 1) * chunk
    spec = am.KVCacheSpec(
        num_layers=1, num_kv_heads=heads, head_dim=D, chunk_size=chunk, page_size=page, sink_chunks=sink,
        window_chunks=window, branches=tuple(f"b{i}" for i in range(streams)), dtype="bfloat16",
    )
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=DT, generator=g)

    q, k, v = rand(streams, chunk, heads, D), rand(streams, chunk, heads, D), rand(streams, chunk, heads, D)
    qf = q.reshape(-1, heads, D)
    fns: dict[str, Callable[[], object]] = {}  # every attention path, timed round-robin at the end
    modes = {}
    states = []
    for label, extents in (("library", True), ("library_paged", False)):
        cache = am.KVCache(spec, num_pages=streams * (resident + 2) * spec.pages_per_chunk, device=dev,
                           backend="flashinfer", contiguous_extents=extents)
        state = cache.open_session()
        states.append(state)
        for _ in range(resident + 2):  # fill the window and evict once
            with state.prepare_forward(None, chunk, commit_current=True) as fwd:
                am.chunk_attention(q, k, v, fwd.layers[0])
        fwd = state.prepare_forward(None, chunk, commit_current=False)
        layer = fwd.layers[0]
        plan = fwd.plan
        modes[label] = plan.mode
        fns[label] = lambda layer=layer: am.chunk_attention(q, k, v, layer)
        # The kernel alone (K/V already written): the plan's public attend(), default scale.
        fns[label + "_attend"] = lambda plan=plan, layer=layer: plan.attend(
            qf, layer.k_cache, layer.v_cache, D**-0.5
        )
    # From here on, `cache` / `fwd` / `layer` are the plain-paged ones.

    # Contiguous K/V holding exactly the visible keys of each stream.
    kc, vc = rand(streams * keys, heads, D), rand(streams * keys, heads, D)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    qo_indptr = torch.arange(streams + 1, dtype=torch.int32) * chunk
    kv_indptr = torch.arange(streams + 1, dtype=torch.int32) * keys
    ragged.plan(qo_indptr, kv_indptr, heads, heads, D, causal=False, q_data_type=DT, kv_data_type=DT)
    fns["ragged_fa3"] = lambda: ragged.run(qf, kc, vc)
    # The same call again under a second name: the spread between the two is the timing noise.
    fns["ragged_fa3_again"] = lambda: ragged.run(qf, kc, vc)

    qs, ks, vs = qf.view(streams, chunk, heads, D).transpose(1, 2), kc.view(streams, keys, heads, D).transpose(1, 2), vc.view(streams, keys, heads, D).transpose(1, 2)
    fns["sdpa"] = lambda: F.scaled_dot_product_attention(qs, ks, vs)

    # FlexAttention over a whole timeline of chunks with a sink + window block mask.
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

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
    t0 = time.perf_counter()
    mfwd = mstate.prepare_forward(None, chunk, commit_current=False, token_mask=mask)
    torch.cuda.synchronize()
    masked_plan_ms = (time.perf_counter() - t0) * 1e3
    fns["fa2_mask"] = lambda: am.chunk_attention(q, k, v, mfwd.layers[0])

    # Gather the visible pages contiguous each forward, then ragged FA3.
    gather = fwd.layout.dense_keys[0].to(dev)
    kslots = am.KVPool.token_slots(layer.k_cache)
    vslots = am.KVPool.token_slots(layer.v_cache)

    def gather_ragged() -> torch.Tensor:
        kg = kslots[gather].view(-1, heads, D)
        vg = vslots[gather].view(-1, heads, D)
        return ragged.run(qf, kg, vg)

    fns["gather_ragged"] = gather_ragged
    fns["gather_only"] = lambda: (kslots[gather], vslots[gather])
    results = interleaved_ms(fns)

    # KV write cost per layer (K and V of every stream's current chunk).
    pages = fwd.layout.write_pages.to(dev)
    slots = fwd.layout.write_slots.to(dev)
    kflat, vflat = k.reshape(-1, heads, D), v.reshape(-1, heads, D)
    writes: dict[str, float] = {}

    def page_copy() -> None:
        layer.k_cache.index_copy_(0, pages, kflat.view(-1, page, heads, D))
        layer.v_cache.index_copy_(0, pages, vflat.view(-1, page, heads, D))

    def token_copy() -> None:
        kslots.index_copy_(0, slots, kflat)
        vslots.index_copy_(0, slots, vflat)

    writes["page_index_copy"] = cuda_time_ms(page_copy)
    writes["token_index_copy"] = cuda_time_ms(token_copy)
    rows = fwd.layout.structural_rows
    append_indptr = (torch.arange(streams + 1, dtype=torch.int32) * chunk).to(dev)
    # Append into each stream's pending chunk: a per-stream page table of just that chunk.
    ppc = chunk // page
    pend = torch.tensor([p for s in fwd.layout.streams for c in s.pending_pages for p in c], dtype=torch.int32, device=dev)
    kv_indptr_pages = (torch.arange(streams + 1, dtype=torch.int32) * ppc).to(dev)
    last_len = torch.full((streams,), page, dtype=torch.int32, device=dev)
    seq_lens = torch.full((streams,), chunk, dtype=torch.int32, device=dev)
    bi, pos = flashinfer.get_batch_indices_positions(append_indptr, seq_lens, streams * chunk)
    writes["flashinfer_append"] = cuda_time_ms(
        lambda: flashinfer.append_paged_kv_cache(
            kflat, vflat, bi, pos, (layer.k_cache, layer.v_cache), pend, kv_indptr_pages, last_len
        )
    )
    del rows
    # Rolling buffer as Self-Forcing / LongLive: shift the window by one chunk, write the new chunk at the end.
    roll_k = rand(streams, keys, heads, D)
    roll_v = rand(streams, keys, heads, D)
    keep = sink * chunk

    def rolling() -> None:
        for buf, new in ((roll_k, k), (roll_v, v)):
            buf[:, keep:-chunk].copy_(buf[:, keep + chunk :].clone())
            buf[:, -chunk:].copy_(new)

    writes["rolling_memmove"] = cuda_time_ms(rolling)
    # Contiguous pending slots (contiguous extents): plain per-stream slice copies.
    starts = [min(s.pending_pages[0][0] * page, kslots.shape[0] - chunk) for s in fwd.layout.streams]

    def slice_copy() -> None:
        for i, a in enumerate(starts):
            kslots[a : a + chunk].copy_(k[i])
            vslots[a : a + chunk].copy_(v[i])

    writes["contiguous_slice_copy"] = cuda_time_ms(slice_copy)
    # The floor of any separate write: read K and V once, write them once, at the measured copy bandwidth.
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    big_out = torch.empty_like(big)
    copy_gbps = 2 * big.numel() / (cuda_time_ms(lambda: big_out.copy_(big), inner=3) * 1e-3) / 1e9
    del big, big_out
    kv_bytes = 2 * k.numel() * k.element_size()
    writes["bandwidth_floor"] = 2 * kv_bytes / (copy_gbps * 1e9) * 1e3
    for st in (*states, mstate):
        st.abort()

    limit = results["ragged_fa3"]
    fl = flops(streams, chunk, keys, heads)
    return {
        "config": dict(heads=heads, head_dim=D, chunk=chunk, sink=sink, window=window, streams=streams, page=page,
                       visible_keys=keys),
        "attention_ms": results,
        "timing": "CUDA events, median of 15 round-robin samples of 10 back-to-back calls each",
        "timing_noise": abs(results["ragged_fa3_again"] / results["ragged_fa3"] - 1.0),
        "tflops": {k_: fl / (ms * 1e-3) / 1e12 for k_, ms in results.items() if k_ != "gather_only"},
        "ratio_vs_ragged_fa3": {k_: limit / ms for k_, ms in results.items() if k_ != "gather_only"},
        "kv_write_ms": writes,
        "write_fraction_of_attention": writes["flashinfer_append"] / results["library_attend"],
        "write_floor_fraction_of_attention": writes["bandwidth_floor"] / results["library_attend"],
        "copy_bandwidth_gbps": copy_gbps,
        "modes": modes,
        "fa2_mask_plan_ms": masked_plan_ms,
    }


def host_time(layers: int, extents: bool, iters: int = 30) -> dict:
    """Host time of prepare_forward + commit (allocation, eviction, plan) at Wan shapes."""
    spec = am.KVCacheSpec(
        num_layers=layers, num_kv_heads=12, head_dim=D, chunk_size=4680, page_size=120, sink_chunks=1,
        window_chunks=6, branches=("cond", "uncond"), dtype="bfloat16",
    )
    cache = am.KVCache(spec, num_pages=2 * 9 * spec.pages_per_chunk, device="cuda", backend="flashinfer",
                       contiguous_extents=extents)
    state = cache.open_session()
    times = []
    modes = set()
    for i in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fwd = state.prepare_forward(None, 4680, commit_current=True)
        t1 = time.perf_counter()
        fwd.commit()
        t2 = time.perf_counter()
        modes.add(fwd.plan.mode)
        if i >= 5:
            times.append(((t1 - t0) + (t2 - t1)) * 1e3)
    return {"layers": layers, "prepare_plus_commit_ms_median": statistics.median(times), "max_ms": max(times),
            "modes": sorted(modes)}


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
    path.write_text(out.getvalue())
    print(f"wrote {path}")


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(payload["shapes"])
    methods = ["ragged_fa3", "library", "library_attend", "library_paged", "library_paged_attend", "gather_ragged",
               "sdpa", "flex", "fa2_mask"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(shapes)
    for i, shape in enumerate(shapes):
        ratios = [payload["shapes"][shape]["ratio_vs_ragged_fa3"][m] for m in methods]
        bars = ax.bar([x + i * width for x in range(len(methods))], ratios, width, label=shape)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks([x + width * (len(shapes) - 1) / 2 for x in range(len(methods))], methods, rotation=20)
    ax.axhline(1.0, color="k", lw=0.6)
    ax.set_ylabel("speed vs contiguous ragged FA3 (higher is better)")
    ax.set_title(f"Per-layer attention, one pending chunk, window full ({payload['env'].get('gpu', '?')})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    payload = {"env": environment(), "shapes": {}, "host": []}
    for name, shape in SHAPES.items():
        payload["shapes"][name] = bench_shape(name, **shape)
        print(name, {k: round(v, 3) for k, v in payload["shapes"][name]["ratio_vs_ragged_fa3"].items()})
        print("  ms", {k: round(v, 4) for k, v in payload["shapes"][name]["attention_ms"].items()})
        print("  write ms", {k: round(v, 4) for k, v in payload["shapes"][name]["kv_write_ms"].items()})
    for layers in (1, 30):
        for extents in (True, False):
            payload["host"].append(host_time(layers, extents))
        print("host", payload["host"][-1])
    save_json(args.out / "attention.json", payload)
    profile_host(args.out / "host_profile.txt")
    plot(payload, args.out / "attention.png")


if __name__ == "__main__":
    main()
