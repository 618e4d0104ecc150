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
* ``library_compiled`` -- the layer path compiled: RMSNorm + RoPE of q and k, the in-graph K/V write and the
                          attention op (bf16 pool); ``library_fp8_compiled`` -- "library FP8, compiled q
                          quantization": the same over the FP8 pool, q quantized by the graph next to its
                          RoPE (``ops.attend_in_graph``) and the op launching FA3's FP8 kernel alone;
                          ``library_fp8_compiled_op_q`` -- the same with q quantized inside the op (the
                          compiled path before issue 28 item 3); each also ``<label>_graph`` (replayed from a
                          CUDA graph: device time alone). Read them against ``ragged_fa3_fp8`` (FA3's FP8
                          kernel alone on pre-quantized q/k/v) and ``compiled_produce_qk`` (the norm + RoPE
                          alone, among the writes)
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

Writes ``attention.json`` (config, ``attention_ms`` medians + ``attention_stats`` median / IQR / p25 /
p75 / samples per path, ratios, TFLOP/s, KV write costs with their stats, host times, run metadata),
``attention.png`` (ratios with IQR error bars) and ``host_profile.txt`` (cProfile of the host path) into
``--out DIR``; by default the committed results, ``benchmarks/results/attention_<device>.json`` / ``.png``
and ``host_profile_<device>.txt`` (``attention_h200.json`` on an H200). The contiguous peers are
``baselines.contiguous_attention`` / ``flex_sink_window`` / ``rolling_memmove``.

    bash .gpu/run.sh python3 -m benchmarks.attention --out $OUT
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks._timing import (
    each_call, interleaved, measure, once, parser, require_gpu, result_path, save_json, stats_dict,
)

SHAPES = {
    "wan1.3b": dict(heads=12, chunk=4680, sink=1, window=6, streams=2, page=120),
    "14b-like": dict(heads=40, chunk=880, sink=1, window=7, streams=2, page=80),
}
D = 128
#: Paths drawn in attention.png, in this order.
PLOT_METHODS = ("ragged_fa3", "library", "library_attend", "library_graph", "library_compiled_graph",
                "library_paged", "library_paged_attend", "ragged_fa3_fp8", "library_fp8", "library_fp8_attend",
                "library_fp8_graph", "library_fp8_compiled_graph", "library_fp8_compiled_op_q_graph",
                "library_fp8_paged", "gather_ragged", "sdpa", "flex", "fa2_mask")
#: The library's paths: (label, contiguous extents, KV storage dtype); with extents also ``<label>_graph``.
LIBRARY_PATHS = (("library", True, None), ("library_paged", False, None),
                 ("library_fp8", True, "float8_e4m3fn"), ("library_fp8_paged", False, "float8_e4m3fn"))
#: The library paths also timed as a compiled layer (norm + RoPE + write + attention): ``<label>_compiled``.
COMPILED_PATHS = ("library", "library_fp8")


def flops(streams: int, q: int, keys: int, heads: int) -> float:
    return 4.0 * streams * q * keys * heads * D


# --------------------------------------------------------------------------------- one shape
@dataclasses.dataclass
class _Shape:
    """One shape's geometry, device and seeded inputs (one pending chunk per stream, the window full)."""

    heads: int
    chunk: int
    sink: int
    window: int
    streams: int
    page: int
    torch: Any = None
    am: Any = None
    dev: Any = None
    spec: Any = None
    rand: Callable[..., Any] | None = None  #: seeded ``randn(*shape)`` on the device, bf16
    q: Any = None  #: [streams, chunk, heads, D], likewise k and v
    k: Any = None
    v: Any = None
    qf: Any = None  #: q as [streams * chunk, heads, D]

    @property
    def history(self) -> int:
        """Chunks of history per stream (sinks + window)."""
        return self.sink + self.window

    @property
    def keys(self) -> int:
        """Visible keys per stream: the history chunks and the pending one."""
        return (self.history + 1) * self.chunk


def _shape(heads: int, chunk: int, sink: int, window: int, streams: int, page: int) -> _Shape:
    """The shape's spec and its seeded q / k / v (the generator's first draws)."""
    import torch

    import ardiff_modules as am

    s = _Shape(heads, chunk, sink, window, streams, page, torch=torch, am=am, dev=torch.device("cuda"))
    s.spec = am.KVCacheSpec(
        num_layers=1, num_kv_heads=heads, head_dim=D, chunk_size=chunk, page_size=page, sink_chunks=sink,
        window_chunks=window, branches=tuple(f"b{i}" for i in range(streams)), dtype="bfloat16",
    )
    g = torch.Generator(device=s.dev).manual_seed(0)
    s.rand = lambda *shape: torch.randn(*shape, device=s.dev, dtype=torch.bfloat16, generator=g)
    s.q, s.k, s.v = (s.rand(streams, chunk, heads, D) for _ in range(3))
    s.qf = s.q.reshape(-1, heads, D)
    return s


@dataclasses.dataclass
class _Library:
    """The library's paths of one shape: what is timed and what the summary reads."""

    fns: dict[str, Callable[[], object]] = dataclasses.field(default_factory=dict)
    #: Timed with the KV writes (not attention): ``compiled_produce_qk`` and its graph.
    write_fns: dict[str, Callable[[], object]] = dataclasses.field(default_factory=dict)
    compiled: tuple[Any, ...] | None = None  #: ``_compiled_layer(shape)``, made on first use
    modes: dict[str, str] = dataclasses.field(default_factory=dict)
    outputs: dict[str, Any] = dataclasses.field(default_factory=dict)
    pool_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    layers: dict[str, Any] = dataclasses.field(default_factory=dict)  #: label -> the timed eager forward's layer
    states: list[Any] = dataclasses.field(default_factory=list)
    static_forwards: list[Any] = dataclasses.field(default_factory=list)
    paged: tuple[Any, Any, Any] | None = None  #: (cache, forward, layer) of ``library_paged`` (bf16, plain paging)


def _library_paths(s: _Shape) -> _Library:
    lib = _Library()
    for label, extents, kv_dtype in LIBRARY_PATHS:
        _add_library_path(s, lib, label, extents, kv_dtype)
    return lib


def _add_library_path(s: _Shape, lib: _Library, label: str, extents: bool, kv_dtype: str | None) -> None:
    """A cache whose window is full (filled, one eviction), then an open forward of the pending chunk:
    ``label`` (write + kernel) and ``label_attend`` (the kernel alone); with extents also ``label_graph``."""
    am, q, k, v = s.am, s.q, s.k, s.v
    cache = am.KVCache(dataclasses.replace(s.spec, kv_dtype=kv_dtype),
                       num_pages=s.streams * (s.history + 2) * s.spec.pages_per_chunk, device=s.dev,
                       backend="flashinfer", contiguous_extents=extents)
    lib.pool_bytes[label] = cache.stats().pool_bytes
    state = cache.open_session()
    lib.states.append(state)
    for _ in range(s.history + 2):  # fill the window and evict once
        with state.prepare_forward(None, s.chunk, commit_current=True) as fwd:
            am.chunk_attention(q, k, v, fwd.layers[0])
    fwd = state.prepare_forward(None, s.chunk, commit_current=False)
    lib.modes[label] = fwd._plan.mode
    lib.outputs[label] = am.chunk_attention(q, k, v, fwd.layers[0])
    _time_forward(s, lib, label, fwd)
    if label == "library_paged":
        lib.paged = (cache, fwd, fwd.layers[0])
    if extents:
        # The same forward as a CUDA graph: a static plan replays ragged FA3 with absolute key offsets.
        sfwd = state.prepare_forward(None, s.chunk, commit_current=False, static=True)
        lib.modes[label + "_graph"] = sfwd._plan.mode
        lib.fns[label + "_graph"] = _graphed(lambda layer=sfwd.layers[0]: am.chunk_attention(q, k, v, layer))
        lib.static_forwards.append(sfwd)
        if label in COMPILED_PATHS:
            _add_compiled_paths(s, lib, label, sfwd)  # its graphs captured while the static forward is open
        _time_forward(s, lib, label, state.prepare_forward(None, s.chunk, commit_current=False))  # back to eager


def _time_forward(s: _Shape, lib: _Library, label: str, fwd: Any) -> None:
    """``label``: ``chunk_attention`` through ``fwd``'s layer; ``label_attend``: its plan's public
    ``attend()`` alone (K/V already written), default scale."""
    am, q, k, v, qf = s.am, s.q, s.k, s.v, s.qf
    layer = lib.layers[label] = fwd.layers[0]
    lib.fns[label] = lambda layer=layer: am.chunk_attention(q, k, v, layer)
    lib.fns[label + "_attend"] = lambda plan=fwd._plan, layer=layer: plan.attend(
        qf, layer.k_cache, layer.v_cache, D**-0.5
    )


def _add_compiled_paths(s: _Shape, lib: _Library, label: str, static_forward: Any) -> None:
    """``<label>_compiled`` (and, over an FP8 pool, ``<label>_compiled_op_q``): the compiled layer path from the
    pre-norm q / k (``s.q``, ``s.k``) through the timed eager forward's layer (``lib.layers[label]``, read at
    call time: it is re-prepared after this); each also ``_graph``, captured now over ``static_forward``."""
    if lib.compiled is None:  # one set of compiled functions per shape (dynamo guards on the pool's dtype)
        lib.compiled = _compiled_layer(s)
    layer_c, layer_op_q_c, produce_c = lib.compiled
    q, k, v = s.q, s.k, s.v
    variants = {label + "_compiled": layer_c}
    if static_forward._fp8_query:
        variants[label + "_compiled_op_q"] = layer_op_q_c
    for name, fn in variants.items():
        lib.fns[name] = lambda fn=fn: fn(q, k, v, lib.layers[label])
        lib.fns[name + "_graph"] = _graphed(lambda fn=fn, layer=static_forward.layers[0]: fn(q, k, v, layer))
    if "compiled_produce_qk" not in lib.write_fns:
        lib.write_fns["compiled_produce_qk"] = lambda: produce_c(q, k)
        lib.write_fns["compiled_produce_qk_graph"] = _graphed(lib.write_fns["compiled_produce_qk"])


def _compiled_layer(s: _Shape) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """``(layer, layer_op_q, produce)`` compiled (``fullgraph``): ``layer(q, k, v, kv)``
    RMSNorm + RoPE of q and k then ``chunk_attention`` (over an FP8 pool the graph quantizes q:
    ``ops.attend_in_graph``); ``layer_op_q``: the same with q handed to the op in bf16 (the op quantizes it:
    the compiled path before); ``produce(q, k)``: the norm + RoPE alone."""
    import torch

    from ardiff_modules.modules.functional import rotate
    from ardiff_modules.ops import write_kv_in_graph

    am, heads, dev = s.am, s.heads, s.dev
    g = torch.Generator(device=dev).manual_seed(2)
    angles = torch.rand(1, s.chunk, 1, D // 2, device=dev, generator=g) * 6.28
    cos = angles.cos().repeat_interleave(2, -1).to(torch.bfloat16)
    sin = angles.sin().repeat_interleave(2, -1).to(torch.bfloat16)
    weight = torch.ones(D, device=dev, dtype=torch.bfloat16)

    def produce(qx: torch.Tensor, kx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        norm = torch.nn.functional.rms_norm
        return rotate(norm(qx, (D,), weight, 1e-6), cos, sin), rotate(norm(kx, (D,), weight, 1e-6), cos, sin)

    def layer(qx: torch.Tensor, kx: torch.Tensor, vx: torch.Tensor, kv: Any) -> torch.Tensor:
        qr, kr = produce(qx, kx)
        return am.chunk_attention(qr, kr, vx, kv)

    def layer_op_q(qx: torch.Tensor, kx: torch.Tensor, vx: torch.Tensor, kv: Any) -> torch.Tensor:
        qr, kr = produce(qx, kx)
        write_kv_in_graph(kr.reshape(-1, heads, D), vx.reshape(-1, heads, D), kv._kv_pool, kv._kv_scales, kv._layer_id,
                          kv._handle_id)
        out = torch.ops.ardiff_modules.paged_attention(qr.reshape(-1, heads, D), kv._kv_pool, kv._layer_id,
                                                       kv._handle_id, D**-0.5, None)
        return out.view(qr.shape)

    return tuple(torch.compile(fn, fullgraph=True, dynamic=False) for fn in (layer, layer_op_q, produce))


def _masked_path(s: _Shape, num_pages: int) -> tuple[Callable[[], object], Any, float]:
    """This library's masked path (FA2 + packed custom mask, all true): ``(fn, session, plan seconds)``."""
    am, q, k, v = s.am, s.q, s.k, s.v
    masked_cache = am.KVCache(s.spec, num_pages=num_pages, device=s.dev, backend="flashinfer")
    mstate = masked_cache.open_session()
    for _ in range(s.history + 1):
        with mstate.prepare_forward(None, s.chunk, commit_current=True) as f2:
            am.chunk_attention(q, k, v, f2.layers[0])
    mask = s.torch.ones(s.streams, s.chunk, s.keys, dtype=s.torch.bool, device=s.dev)
    # One-off: FA2 packs the mask in plan() (device synchronised before and after).
    mfwd, masked_plan_s = once(lambda: mstate.prepare_forward(None, s.chunk, commit_current=False, token_mask=mask))
    return (lambda: am.chunk_attention(q, k, v, mfwd.layers[0])), mstate, masked_plan_s


def _gather_paths(s: _Shape, fwd: Any, kslots: Any, vslots: Any, ragged: Any) -> dict[str, Callable[[], object]]:
    """Gather the visible pages into a contiguous buffer each forward, then ragged FA3 (and the gather alone)."""
    gather = fwd._layout.dense_keys[0].to(s.dev)
    heads, qf = s.heads, s.qf

    def gather_ragged() -> Any:
        kg = kslots[gather].view(-1, heads, D)
        vg = vslots[gather].view(-1, heads, D)
        return ragged.run(qf, kg, vg)

    return {"gather_ragged": gather_ragged, "gather_only": lambda: (kslots[gather], vslots[gather])}


def _eager_write_fns(s: _Shape, fwd: Any, layer: Any, kslots: Any, vslots: Any) -> dict[str, Callable[[], object]]:
    """KV write per layer (K and V of every stream's current chunk) into the plain-paged pool, the ways
    side by side: page / token ``index_copy_``, FlashInfer ``append_paged_kv_cache``, the peers' rolling
    buffer memmove, per-stream slice copies."""
    import flashinfer

    from benchmarks.baselines import rolling_memmove

    torch, dev, heads, chunk, page, streams, k, v = s.torch, s.dev, s.heads, s.chunk, s.page, s.streams, s.k, s.v
    pages = fwd._layout.write_pages.to(dev)
    slots = fwd._layout.write_slots.to(dev)
    kflat, vflat = k.reshape(-1, heads, D), v.reshape(-1, heads, D)

    def page_copy() -> None:
        layer.k_cache.index_copy_(0, pages, kflat.view(-1, page, heads, D))
        layer.v_cache.index_copy_(0, pages, vflat.view(-1, page, heads, D))

    def token_copy() -> None:
        kslots.index_copy_(0, slots, kflat)
        vslots.index_copy_(0, slots, vflat)

    write_fns: dict[str, Callable[[], object]] = {"page_index_copy": page_copy, "token_index_copy": token_copy}
    append_indptr = (torch.arange(streams + 1, dtype=torch.int32) * chunk).to(dev)
    # Append into each stream's pending chunk: a per-stream page table of just that chunk.
    pend = torch.tensor([p for st in fwd._layout.streams for c in st.pending_pages for p in c], dtype=torch.int32,
                        device=dev)
    kv_indptr_pages = (torch.arange(streams + 1, dtype=torch.int32) * (chunk // page)).to(dev)
    last_len = torch.full((streams,), page, dtype=torch.int32, device=dev)
    seq_lens = torch.full((streams,), chunk, dtype=torch.int32, device=dev)
    bi, pos = flashinfer.get_batch_indices_positions(append_indptr, seq_lens, streams * chunk)
    write_fns["flashinfer_append"] = lambda: flashinfer.append_paged_kv_cache(
        kflat, vflat, bi, pos, (layer.k_cache, layer.v_cache), pend, kv_indptr_pages, last_len
    )
    # Rolling buffer as Self-Forcing / LongLive: shift the window by one chunk, write the new chunk at the end.
    roll_k, roll_v = s.rand(streams, s.keys, heads, D), s.rand(streams, s.keys, heads, D)
    write_fns["rolling_memmove"] = rolling_memmove(k, v, roll_k, roll_v, sink_tokens=s.sink * chunk)
    # Contiguous pending slots (contiguous extents): plain per-stream slice copies.
    starts = [min(st.pending_pages[0][0] * page, kslots.shape[0] - chunk) for st in fwd._layout.streams]

    def slice_copy() -> None:
        for i, a in enumerate(starts):
            kslots[a : a + chunk].copy_(k[i])
            vslots[a : a + chunk].copy_(v[i])

    write_fns["contiguous_slice_copy"] = slice_copy
    return write_fns


def _copy_bandwidth(s: _Shape) -> tuple[Any, float]:
    """The device copy bandwidth (GB/s, bytes read + written) of a 1 GiB copy: ``(stats, gbps)``."""
    big = s.torch.empty(1 << 30, dtype=s.torch.uint8, device=s.dev)
    big_out = s.torch.empty_like(big)
    copy_stats = measure(functools.partial(big_out.copy_, big), inner=None)  # Timer.adaptive_autorange
    return copy_stats, 2 * big.numel() / (copy_stats.median_ms * 1e-3) / 1e9


def _accuracy(s: _Shape, contig: Any, kc: Any, vc: Any, outputs: dict[str, Any]) -> dict[str, float]:
    """Accuracy on these random inputs (one layer): FP8 and bf16 against an fp32 recomputation, for scale."""
    from ardiff_modules.quant import DEFAULT_HEADROOM, amax_scale, quantize, quantize_query

    F, heads, qf = s.torch.nn.functional, s.heads, s.qf

    def rel(a: Any, b: Any) -> float:
        return float((a.float() - b.float()).norm() / b.float().norm())

    exact = F.scaled_dot_product_attention(contig.qs.float(), contig.ks.float(), contig.vs.float())
    exact = exact.transpose(1, 2).reshape(-1, heads, D)
    sk, sv = amax_scale(kc, DEFAULT_HEADROOM), amax_scale(vc, DEFAULT_HEADROOM)
    q8s, sq = quantize_query(qf)
    fp8_out = contig.ragged8.run(q8s, quantize(kc, sk), quantize(vc, sv), sq, sk, sv)
    return {
        "bf16_vs_fp32_rel": rel(contig.ragged.run(qf, kc, vc), exact),
        "fp8_vs_fp32_rel": rel(fp8_out, exact),
        "fp8_vs_bf16_rel": rel(outputs["library_fp8"], outputs["library"]),
        "fp8_paged_vs_bf16_rel": rel(outputs["library_fp8_paged"], outputs["library"]),
        # the same layer compiled, q quantized by the graph vs inside the op (same math; fused rounding only)
        "fp8_compiled_q_vs_op_q_rel": rel(outputs["library_fp8_compiled"], outputs["library_fp8_compiled_op_q"]),
        "fp8_compiled_vs_bf16_compiled_rel": rel(outputs["library_fp8_compiled"], outputs["library_compiled"]),
    }


def _summary(s: _Shape, attention: dict[str, Any], write_stats: dict[str, Any], writes: dict[str, float],
             extras: dict[str, Any], *, inner: int, rounds: int) -> dict[str, Any]:
    """One shape's result: medians, stats, ratios, write costs and their shares of the kernel, and ``extras``
    (``copy_bandwidth_gbps``, ``copy_stats``, ``modes``, ``accuracy``, ``pool_bytes``, ``fa2_mask_plan_ms``)."""
    results = {name: st.median_ms for name, st in attention.items()}
    limit = results["ragged_fa3"]
    fl = flops(s.streams, s.chunk, s.keys, s.heads)

    def share(write: str, minus: str | None = None, kernel: str = "library_attend") -> float:
        """A write's time (less ``minus``'s) over the kernel's."""
        return (writes[write] - writes[minus] if minus else writes[write]) / results[kernel]

    return {
        "config": dict(heads=s.heads, head_dim=D, chunk=s.chunk, sink=s.sink, window=s.window, streams=s.streams,
                       page=s.page, visible_keys=s.keys),
        "attention_ms": results,
        "attention_stats": stats_dict(attention),
        "timing": f"torch.utils.benchmark, median (IQR in attention_stats) of {rounds} round-robin samples of "
                  f"{inner} back-to-back calls each",
        "timing_noise": abs(results["ragged_fa3_again"] / results["ragged_fa3"] - 1.0),
        "tflops": {k_: fl / (ms * 1e-3) / 1e12 for k_, ms in results.items() if k_ != "gather_only"},
        "ratio_vs_ragged_fa3": {k_: limit / ms for k_, ms in results.items() if k_ != "gather_only"},
        "kv_write_ms": writes,
        "kv_write_stats": stats_dict(write_stats),
        "write_fraction_of_attention": share("flashinfer_append"),
        # Compiled: (norm + RoPE + write into the pool) - (norm + RoPE returning k, v), over the kernel.
        "compiled_write_fraction_of_attention": share("compiled_produce_and_write", "compiled_produce"),
        "compiled_fp8_write_fraction_of_attention": share("compiled_produce_and_write_fp8", "compiled_produce",
                                                          "library_fp8_attend"),
        # Device time alone (CUDA-graph replays of the compiled functions).
        "compiled_write_device_fraction_of_attention": share("compiled_produce_and_write_graph",
                                                             "compiled_produce_graph"),
        "compiled_fp8_write_device_fraction_of_attention": share("compiled_produce_and_write_fp8_graph",
                                                                 "compiled_produce_graph", "library_fp8_attend"),
        "eager_write_fraction_of_attention": share("flashinfer_append"),
        "graph_ratio_vs_eager": results["library"] / results["library_graph"],
        "fp8_graph_ratio_vs_eager": results["library_fp8"] / results["library_fp8_graph"],
        "write_floor_fraction_of_attention": share("bandwidth_floor"),
        **{key: extras[key] for key in ("copy_bandwidth_gbps", "copy_stats", "modes", "accuracy", "pool_bytes")},
        "fp8_ratio_vs_ragged_fa3": limit / results["library_fp8"],
        "fp8_attend_ratio_vs_ragged_fa3": limit / results["library_fp8_attend"],
        **_compiled_fp8_summary(results, writes),
        "fa2_mask_plan_ms": extras["fa2_mask_plan_ms"],
    }


def _compiled_fp8_summary(results: dict[str, float], writes: dict[str, float]) -> dict[str, float]:
    """The compiled layer paths' figures (device time: CUDA-graph replays): the FP8 one against the FA3 FP8
    kernel alone on pre-quantized q/k/v, against q quantized inside the op, and against bf16."""
    fp8, op_q = results["library_fp8_compiled_graph"], results["library_fp8_compiled_op_q_graph"]
    produce = writes["compiled_produce_qk_graph"]
    kernel = results["ragged_fa3_fp8"]
    return {
        # > 1: quantizing q in the graph is faster than in the op
        "fp8_compiled_q_speedup_vs_op_q": op_q / fp8,
        "fp8_compiled_vs_bf16_compiled_speedup": results["library_compiled_graph"] / fp8,
        # the FP8 kernel alone over the whole compiled FP8 layer path (norm + RoPE + q quantization + write)
        "fp8_kernel_over_fp8_compiled_layer": kernel / fp8,
        "fp8_kernel_over_fp8_compiled_layer_op_q": kernel / op_q,
        # what the layer adds beyond the norm + RoPE, over the kernel (0: nothing but the kernel)
        "fp8_compiled_layer_overhead_vs_kernel": (fp8 - produce - kernel) / kernel,
        "fp8_compiled_layer_op_q_overhead_vs_kernel": (op_q - produce - kernel) / kernel,
    }


def bench_shape(name: str, heads: int, chunk: int, sink: int, window: int, streams: int, page: int, *,
                inner: int = 10, rounds: int = 15) -> dict[str, Any]:
    """Every attention path of one shape timed side by side, then the KV writes, the copy floor, accuracy."""
    from ardiff_modules.pool import KVPool
    from benchmarks.baselines import contiguous_attention, flex_sink_window

    s = _shape(heads, chunk, sink, window, streams, page)
    lib = _library_paths(s)
    cache, fwd, layer = lib.paged  # from here on: the plain-paged bf16 cache, its open forward and layer
    fns = dict(lib.fns)  # every attention path, timed round-robin below
    for label in ("library_compiled", "library_fp8_compiled", "library_fp8_compiled_op_q"):
        lib.outputs[label] = lib.fns[label]()
    # Contiguous K/V holding exactly the visible keys of each stream: the limits.
    kc, vc = s.rand(streams * s.keys, heads, D), s.rand(streams * s.keys, heads, D)
    contig = contiguous_attention(s.qf, kc, vc, streams=streams, chunk=chunk, keys=s.keys)
    fns.update(contig.fns)
    # FlexAttention over a whole timeline of chunks (the history ones and 4 more) with a sink + window block mask.
    total = (s.history + 4) * chunk
    kt, vt = s.rand(streams, heads, total, D), s.rand(streams, heads, total, D)
    fns["flex"] = flex_sink_window(contig.qs, kt, vt, chunk=chunk, sink=sink, window=window)
    fns["fa2_mask"], mstate, masked_plan_s = _masked_path(s, cache.stats().num_pages)
    kslots, vslots = KVPool.token_slots(layer.k_cache), KVPool.token_slots(layer.v_cache)
    fns.update(_gather_paths(s, fwd, kslots, vslots, contig.ragged))
    attention = interleaved(fns, inner=inner, rounds=rounds)

    # KV write cost per layer (K and V of every stream's current chunk), the ways side by side, and the
    # compiled path: K/V written by the graph that computes them (RMSNorm + RoPE of k, then the store,
    # fused by inductor) vs the same graph returning k and v for a separate write. The difference is
    # what the write costs on the compiled path.
    write_fns = _eager_write_fns(s, fwd, layer, kslots, vslots)
    write_fns.update(compiled_write_fns(lib.layers, s.k, s.v, heads, chunk, streams))
    write_fns.update(lib.write_fns)
    write_stats = interleaved(write_fns, inner=inner, rounds=rounds)
    writes = {name_: st.median_ms for name_, st in write_stats.items()}
    # The floor of any separate write: read K and V once, write them once, at the measured copy bandwidth.
    copy_stats, copy_gbps = _copy_bandwidth(s)
    kv_bytes = 2 * s.k.numel() * s.k.element_size()
    writes["bandwidth_floor"] = 2 * kv_bytes / (copy_gbps * 1e9) * 1e3
    for st in (*lib.states, mstate):
        st.abort()
    lib.static_forwards.clear()
    extras = {"copy_bandwidth_gbps": copy_gbps, "copy_stats": copy_stats.as_dict(), "modes": lib.modes,
              "accuracy": _accuracy(s, contig, kc, vc, lib.outputs), "pool_bytes": lib.pool_bytes,
              "fa2_mask_plan_ms": masked_plan_s * 1e3}
    return _summary(s, attention, write_stats, writes, extras, inner=inner, rounds=rounds)


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
        write_kv_in_graph(kr, vr, layer._kv_pool, layer._kv_scales, layer._layer_id, layer.forward._handle_id)

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

    written = range(layers)

    def forward() -> None:
        fwd = state.prepare_forward(None, 4680, commit_current=True)
        # NOTE: what each layer's op records (a commit needs every layer); no model runs here
        fwd._transaction.mark_written(written)
        fwd.commit()
        modes.add(fwd._plan.mode)

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
    from benchmarks._plotting import bars, legend_below, pyplot, save

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
    p.add_argument("--out", type=Path, default=None,
                   help="folder for attention.json / .png, host_profile.txt (default: the committed results, "
                        "benchmarks/results/attention_<device>.json, ...)")
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
    save_json(result_path(args.out, "attention.json"), payload, args=args)
    if not args.no_profile:
        profile_host(result_path(args.out, "host_profile.txt"))
    plot(payload, result_path(args.out, "attention.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
