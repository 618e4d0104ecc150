"""End-to-end benchmark: a Wan2.1-1.3B-shaped causal DiT, one chunk step, this library vs rolling buffers.

One **chunk step** = 4 denoising forwards (``commit_current=False``, timesteps 1000, 750, 500, 250)
+ 1 committing forward (timestep 0) of one chunk (3 latent frames = 4680 tokens at 480x832), at
sink 1 + window 6 chunks, with classifier-free guidance on (cond + uncond batched in one forward,
2 streams) and off (1 stream). The SAME model (``ardiff_modules.models.wan_causal_dit``, random weights from
one seed) runs under three attention variants (the rolling ones are the peers of ``baselines.py``):

* ``library``       -- this library: ``ChunkSelfAttention`` over the paged pool (``KVCache``,
                       ``backend="auto"``: FlashInfer on CUDA with contiguous extents -> ragged FA3,
                       the reference SDPA backend on CPU), ``state.prepare_forward`` per forward.
* ``rolling_sdpa``  -- what Self-Forcing / LongLive do: each block's ``attn`` is swapped for a wrapper
                       that reuses the same projections / norms / RoPE but keeps, per layer, one
                       contiguous K and V buffer ``[streams, (sink + window + 1) * chunk, heads, dim]``;
                       before the first forward of a new chunk, once the buffer is full, the window is
                       shifted left by one chunk with a memmove (``buf[:, s:-C].copy_(buf[:, s+C:].clone())``);
                       every forward writes its K/V into the slot after the resident chunks and attends
                       over the prefix ``buf[:, :resident * C + C]`` with ``F.scaled_dot_product_attention``.
                       (The peers also call ``.item()`` on device indices each layer; this baseline
                       keeps its indices on the host, which only favours it.)
* ``rolling_flex``  -- the same buffers, attended with ``flex_attention`` (no mask: the prefix holds
                       exactly the visible keys), compiled (``dynamic=False``) on CUDA, eager on CPU
                       unless ``--flex-compile on`` (compiled flex on CPU costs seconds per key length).
* ``library_compiled`` (``--compile``, off by default) -- ``torch.compile(model, fullgraph=True)`` over
                       the library's contexts.
* ``rolling_sdpa_compiled`` (``--compile``) -- ``rolling_sdpa`` with the model compiled
                       (``dynamic=False``) around an opaque cache write + SDPA (one graph break per
                       layer), the best a rolling buffer with host-side offsets gets from torch.compile.

Every variant gets identical inputs: seeded latents per chunk (the same latents for all forwards of
a chunk: the sampler arithmetic between forwards is left out, it is negligible next to a forward),
the same text embeddings (cond: seeded random, uncond: zeros), projected once per layer. Each variant
warms up until its window is full and has evicted once (default ``sink + window + 2`` chunks), then
times ``--chunks-timed`` chunk steps one by one (``_timing.each_call``: each step between two reads of
``torch.utils.benchmark``'s clock, which synchronises the device; a chunk step advances the stream, so
every step runs exactly once and is one sample). Reported: the median with its IQR (p25..p75); the
speed-ups are ratios of medians. The variants run one after another in one process (each holds its own
KV: 7-14 GB at wan2.1-1.3b, and the rolling ones swap the model's attention modules), not interleaved.

Checked: the outputs of the committing forwards of the timed chunk steps of every variant agree with
the library's by relative error norm (<= 3e-2 in bf16 / fp16, <= 1e-4 in float32 on CPU, 1e-3 in
float32 on CUDA); the exit status is 1 if not. Reported per variant and CFG setting: ms per chunk
step, speedup vs ``rolling_sdpa`` (target for the library: >= 1.3x), latent frames/s
(``frames_per_chunk / step seconds``; a Wan VAE decodes about 4 video frames per latent frame),
peak allocated memory (``torch.cuda.max_memory_allocated`` delta over the variant's whole run:
cache / buffers, warm-up, timed steps) and KV bytes: the library's peak pages in use x bytes per page
(its pool is sized to exactly (sinks + window + pending) chunks per branch) vs the rolling buffers.

    python -m benchmarks.end_to_end                                    # CUDA: wan2.1-1.3b, bf16
    python -m benchmarks.end_to_end --preset tiny --device cpu --dtype float32 --out /tmp/e2e
    python -m benchmarks.end_to_end --compile                          # + library_compiled row
    python -m benchmarks.end_to_end --cfg on --variants library,rolling_sdpa   # a subset

Writes ``end_to_end.json`` (config, per CFG setting and variant: ``ms_per_chunk_step`` (median),
``ms_per_chunk_step_stats`` (median, IQR, p25, p75, samples), speed-up, frames/s, memory, errors vs the
library; targets; run metadata: git commit, UTC time, versions, command line) and ``end_to_end.png``
(bars with IQR error bars; skipped if matplotlib is missing) into ``--out DIR``; by default the
committed results, ``benchmarks/results/end_to_end_<device>.json`` / ``.png``. The rolling buffers are
``baselines.RollingKVCache`` & co. ``--device cuda`` without CUDA, or
``--backend flashinfer`` without FlashInfer, exits 2 with one line.
A baseline that fails (compile error, out of memory) is recorded in the JSON with its traceback and
the run goes on (exit status 1). Sizes at wan2.1-1.3b / bf16: weights 2.8 GB; KV per branch 8 chunks
x 4680 tokens x 30 layers x 12 heads x 128 x K,V x 2 B = 6.9 GB (13.8 GB with CFG), held by one
variant at a time. Compiled flex compiles one graph per key length during the warm-up (8 lengths per
CFG setting), which is most of the run's wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import importlib.util
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ardiff_modules as am
from ardiff_modules.models.wan_causal_dit import (
    PRESETS,
    WanConfig,
    build_model,
    kv_pool_pages,
    make_kv_spec,
    torch_threads,
)
from ardiff_modules.pool import bytes_per_page
from benchmarks._plotting import bars, legend_below, pyplot, save, spread, wrap
from benchmarks._timing import Stats, each_call, environment, fail, once, result_path, save_json
from benchmarks.baselines import RollingRunner, make_flex_attend, sdpa_attend, swapped_attention

VARIANTS = ("library", "rolling_sdpa", "rolling_flex")
#: Variants the flags add (``--compile``, ``--fp8``, ``--graph``); ``--variants`` may also name them directly.
EXTRA_VARIANTS = ("library_compiled", "rolling_sdpa_compiled", "library_fp8", "library_fp8_compiled",
                  "library_graph", "library_compiled_graph", "library_fp8_graph", "library_fp8_compiled_graph",
                  "library_relative_sinks", "library_relative_sinks_compiled")
#: Variants whose semantics differ from ``library`` once the window slides (sinks at relative positions):
#: their outputs are reported, not required to agree.
OTHER_SEMANTICS = ("library_relative_sinks", "library_relative_sinks_compiled")
BASELINE = "rolling_sdpa"
TIMESTEPS = (1000.0, 750.0, 500.0, 250.0)  #: denoising forwards of a chunk step; then one at 0 (commit)
TARGET_SPEEDUP = 1.3
CFG_BRANCHES = {"cfg_on": ("cond", "uncond"), "cfg_off": ("cond",)}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="model geometry (default: wan2.1-1.3b on CUDA, tiny on CPU)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--chunks-timed", type=int, default=5, help="chunk steps timed per variant (median reported)")
    p.add_argument("--warmup-chunks", type=int, default=None,
                   help="chunk steps before timing (default sink + window + 2: window full and one eviction)")
    p.add_argument("--cfg", choices=("both", "on", "off"), default="both", help="CFG settings to run")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {VARIANTS} (library is always run: it is the reference); "
                        f"may also name any of {EXTRA_VARIANTS} without their flags")
    p.add_argument("--compile", action="store_true", help="also run library_compiled and rolling_sdpa_compiled")
    p.add_argument("--graph", action="store_true",
                   help="also run library_graph: every forward a static plan replayed from one CUDA graph per "
                        "forward shape (CUDAGraphStep; over the compiled model with --compile: "
                        "library_compiled_graph); CUDA only")
    p.add_argument("--fp8", action="store_true",
                   help="also run library_fp8 (and library_fp8_compiled with --compile): KVCacheSpec(kv_dtype="
                        "'float8_e4m3fn'), FP8 attention on FlashInfer; agreement checked at --fp8-tolerance")
    p.add_argument("--fp8-tolerance", type=float, default=0.1,
                   help="largest relative error of an FP8 variant's outputs vs library (default 0.1)")
    p.add_argument("--flex-compile", choices=("auto", "on", "off"), default="auto",
                   help="compile flex_attention (auto: on CUDA only)")
    p.add_argument("--backend", default="auto", help="the library's KVCache backend")
    p.add_argument("--tolerance", type=float, default=None,
                   help="max relative error norm vs the library "
                   "(default 3e-2 half, 1e-4 float32 CPU, 1e-3 float32 CUDA)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads for this run (default: 1 for tiny on CPU, else torch's default)")
    p.add_argument("--allow-big-cpu", action="store_true", help="allow a large preset on CPU")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for end_to_end.json / .png (default: the committed results, "
                        "benchmarks/results/end_to_end_<device>.json / .png)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    _check_device(p, args)
    if args.preset != "tiny" and args.device == "cpu" and not args.allow_big_cpu:
        p.error(f"--preset {args.preset} on CPU: expected --device cuda (or pass --allow-big-cpu)")
    if args.chunks_timed < 1:
        p.error(f"--chunks-timed: expected >= 1, got {args.chunks_timed}")
    if args.warmup_chunks is not None and args.warmup_chunks < 0:
        p.error(f"--warmup-chunks: expected >= 0, got {args.warmup_chunks}")
    args.variants = _variants(p, args)
    if any(v.endswith("_graph") for v in args.variants) and args.device != "cuda":
        p.error("--graph / *_graph variants: expected --device cuda (CUDA graphs)")
    return args


def _check_device(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill in ``--device`` / ``--preset`` / ``--dtype``; exit 2 with one line where CUDA or FlashInfer is missing."""
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        fail(p.prog, "--device cuda: CUDA is not available (torch.cuda.is_available() is False); "
                     "use --device cpu --preset tiny for a smoke run")
    if args.backend == "flashinfer" and importlib.util.find_spec("flashinfer") is None:
        fail(p.prog, "--backend flashinfer: the flashinfer package is not installed "
                     "(pip install 'ardiff_modules[flashinfer]'; or --backend auto / reference)")
    if args.preset is None:
        args.preset = "wan2.1-1.3b" if args.device == "cuda" else "tiny"
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"


def _variants(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, ...]:
    """``--variants`` plus what ``--compile`` / ``--fp8`` / ``--graph`` add, ``library`` first, each once."""
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    unknown = [v for v in variants if v not in VARIANTS + EXTRA_VARIANTS]
    if unknown:
        p.error(f"--variants: expected names from {VARIANTS + EXTRA_VARIANTS}, got {unknown}")
    names = ("library",) + tuple(v for v in variants if v != "library")
    if args.compile:
        names += ("library_compiled", "rolling_sdpa_compiled")
    if args.fp8:
        names += ("library_fp8",) + (("library_fp8_compiled",) if args.compile else ())
    if args.graph:
        names += ("library_compiled_graph",) if args.compile else ("library_graph",)
        if args.fp8:
            names += ("library_fp8_compiled_graph",) if args.compile else ("library_fp8_graph",)
    return tuple(dict.fromkeys(names))  # each once, in order


# --------------------------------------------------------------------------------- runners
class LibraryRunner:
    """A ``KVCache`` sized to exactly (sinks + window + pending) chunks per branch, one session."""

    def __init__(self, model: nn.Module, config: WanConfig, branches: tuple[str, ...], texts: Sequence[torch.Tensor],
                 device: torch.device, dtype: torch.dtype, backend: str, step: Callable[..., torch.Tensor],
                 kv_dtype: str | None = None, graph: bool = False, relative_sinks: bool = False) -> None:
        spec = dataclasses.replace(make_kv_spec(config, device, branches), dtype=dtype,
                                   kv_dtype=kv_dtype, relative_sinks=relative_sinks)
        self.spec, self.branches, self.step = spec, branches, step
        #: ``graph``: static forwards replayed from CUDA graphs (one per forward shape: commit or not
        #: share one static context, so one graph serves the whole chunk step).
        self.graph = am.CUDAGraphStep(step) if graph else None
        self.cache = am.KVCache(spec, num_pages=kv_pool_pages(spec, slack_chunks=0), device=device, backend=backend)
        self.state = self.cache.open_session()
        crosses = [block.cross for block in model.blocks]
        for branch, text in zip(branches, texts):
            am.populate_cross_attention(self.state, branch, crosses, text)

    @property
    def backend(self) -> str:
        return self.cache.backend.name

    def forward(self, x: torch.Tensor, t: torch.Tensor, commit: bool) -> torch.Tensor:
        static = self.graph is not None
        with self.state.prepare_forward(self.branches, self.spec.chunk_size, commit_current=commit,
                                        static=static) as fwd:
            if self.graph is not None:
                return self.graph(fwd, x, t)
            return self.step(x, t, fwd.layers)

    def kv_info(self) -> dict[str, Any]:
        stats = self.cache.stats()
        return {
            "kv_peak_bytes": stats.peak_pages_used * stats.bytes_per_page,
            "kv_allocated_bytes": stats.pool_bytes,
            "peak_pages_used": stats.peak_pages_used,
            "pool_pages": stats.num_pages,
            "layout": "contiguous extents (ring)" if self.cache.extent_chunks is not None else "plain paging",
        }

    def close(self) -> None:
        self.state.close()


# --------------------------------------------------------------------------------- measurement
def _chunk_step(runner: Any, latents: Iterator[torch.Tensor], timesteps: Sequence[torch.Tensor],
                t_commit: torch.Tensor) -> torch.Tensor:
    """One chunk step on the next latent: the denoising forwards, then the committing one (its output)."""
    x = next(latents)
    for t in timesteps:
        runner.forward(x, t, False)
    return runner.forward(x, t_commit, True)


def run_variant(name: str, make_runner: Callable[[], Any], latents: Sequence[torch.Tensor],
                timesteps: Sequence[torch.Tensor], t_commit: torch.Tensor, warmup: int, timed: int,
                device: torch.device) -> dict[str, Any]:
    """Warm up, then time ``timed`` chunk steps one by one; returns timings, memory and the timed commit outputs.

    Set-up, each warm-up step and each timed step are timed with ``_timing`` (the device synchronised
    before and after each); a chunk step runs exactly once per latent, in the same order for every
    variant, so the timed steps' outputs line up across variants.
    """
    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    runner, setup_s = once(make_runner)
    step = functools.partial(_chunk_step, runner, iter(latents[: warmup + timed]), timesteps, t_commit)
    with torch.no_grad():
        warm: Stats | None = each_call(step, warmup)[0] if warmup else None  # one-time costs show here
        stats, outs = each_call(step, timed)
    outputs = [out.detach().float().cpu() for out in outs]  # after timing: the copies would sync inside it
    del outs, step
    if cuda:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    warmup_steps_s = [ms / 1e3 for ms in warm.samples_ms] if warm else []
    result: dict[str, Any] = {
        "ms_per_chunk_step": stats.median_ms,
        "ms_per_chunk_step_all": list(stats.samples_ms),
        "ms_per_chunk_step_stats": stats.as_dict(samples=False),
        "setup_s": setup_s,
        "warmup_s": sum(warmup_steps_s),
        "warmup_steps_s": warmup_steps_s,
        "peak_memory_bytes": peak if cuda else None,
        **runner.kv_info(),
    }
    if hasattr(runner, "backend"):
        result["backend"] = runner.backend
    runner.close()
    del runner
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return {"result": result, "outputs": outputs}


@dataclasses.dataclass
class _Bench:
    """One run's settings and the inputs every variant shares: the model, text embeddings, seeded latents."""

    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    config: WanConfig
    warmup: int  #: chunk steps before timing
    timed: int  #: chunk steps timed
    flex_compiled: bool
    tolerance: float
    model: nn.Module = None  # type: ignore[assignment]
    params: int = 0
    texts: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  #: branch -> text embedding
    latent_shape: tuple[int, ...] = ()  #: one stream's latents of one chunk, [1, frames, channels, h, w]
    base_latents: list[torch.Tensor] = dataclasses.field(default_factory=list)  #: one per chunk step
    kv_target_per_branch: int = 0  #: bytes of (sinks + window + pending) chunks of one branch


@dataclasses.dataclass
class _Setting:
    """One CFG setting: its branches (streams) and their inputs, the same for every variant."""

    name: str
    branches: tuple[str, ...]
    texts: list[torch.Tensor]
    latents: list[torch.Tensor]
    ts: list[torch.Tensor]  #: the denoising forwards' timesteps
    t_commit: torch.Tensor

    @property
    def streams(self) -> int:
        return len(self.branches)


def _bench(args: argparse.Namespace) -> _Bench:
    """The model (seeded weights), the text embeddings and the latents, drawn in this order from one seed."""
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    cuda = device.type == "cuda"
    config = WanConfig.preset(args.preset)
    resident = config.sink_chunks + config.window_chunks
    tolerance = args.tolerance
    if tolerance is None:
        tolerance = 3e-2 if dtype in (torch.bfloat16, torch.float16) else (1e-3 if cuda else 1e-4)
    b = _Bench(args, device, dtype, config, warmup=resident + 2 if args.warmup_chunks is None else args.warmup_chunks,
               timed=args.chunks_timed, tolerance=tolerance,
               flex_compiled=args.flex_compile == "on" or (args.flex_compile == "auto" and cuda))
    b.model = build_model(config, seed=args.seed, device=device, dtype=dtype)
    b.params = sum(p.numel() for p in b.model.parameters())
    g = torch.Generator().manual_seed(args.seed + 1)
    with torch.no_grad():
        text_cond = b.model.embed_text(torch.randn(config.text_tokens, config.text_dim, generator=g).to(device))
        text_uncond = b.model.embed_text(torch.zeros(config.text_tokens, config.text_dim, device=device))
    b.texts = {"cond": text_cond, "uncond": text_uncond}
    b.latent_shape = (1, config.frames_per_chunk, config.in_channels, config.latent_height, config.latent_width)
    b.base_latents = [torch.randn(b.latent_shape, generator=g).to(device=device, dtype=dtype)
                      for _ in range(b.warmup + b.timed)]
    bpp_spec = dataclasses.replace(make_kv_spec(config, device, ("cond",)), dtype=args.dtype)
    b.kv_target_per_branch = bpp_spec.pages_per_branch(1) * bytes_per_page(bpp_spec)
    return b


def _print_header(b: _Bench) -> None:
    config, resident = b.config, b.config.sink_chunks + b.config.window_chunks
    print(
        f"model {config.name}: {b.params / 1e6:.1f}M params, {config.num_layers} layers, {config.num_heads} heads x "
        f"{config.head_dim}, chunk {config.chunk_size} tokens ({config.frames_per_chunk} latent frames), sink "
        f"{config.sink_chunks} + window {config.window_chunks} chunks; {b.dtype}, {b.device}; warm-up {b.warmup} "
        f"chunk steps, {b.timed} timed; flex {'compiled' if b.flex_compiled else 'eager'}"
    )
    if b.warmup < resident + 1:
        print(f"note: --warmup-chunks {b.warmup} < sink + window + 1 = {resident + 1}: "
              "timed steps are not all steady state")


def _setting(b: _Bench, name: str) -> _Setting:
    branches = CFG_BRANCHES[name]
    streams = len(branches)
    latents = [x.expand(streams, *b.latent_shape[1:]).contiguous() for x in b.base_latents]
    ts = [torch.full((streams,), t, device=b.device) for t in TIMESTEPS]
    return _Setting(name, branches, [b.texts[br] for br in branches], latents, ts, torch.zeros(streams, device=b.device))


def _measure(name: str, b: _Bench, st: _Setting) -> dict[str, Any]:
    """One variant at one CFG setting (see :func:`run_variant`): the library's, or a peer's rolling buffer."""
    model = b.model
    if name.startswith("library"):
        step: Callable[..., torch.Tensor] = model
        if "_compiled" in name:
            torch._dynamo.reset()
            step = torch.compile(model, fullgraph=True, dynamic=False)
        kv_dtype = "float8_e4m3fn" if "fp8" in name else None
        graph = name.endswith("_graph")
        relative = "relative_sinks" in name

        def make(step: Callable[..., torch.Tensor] = step) -> LibraryRunner:
            return LibraryRunner(model, b.config, st.branches, st.texts, b.device, b.dtype, b.args.backend, step,
                                 kv_dtype, graph=graph, relative_sinks=relative)

        return run_variant(name, make, st.latents, st.ts, st.t_commit, b.warmup, b.timed, b.device)
    rolling_step: Callable[..., torch.Tensor] | None = None
    if name == "rolling_flex":
        if b.flex_compiled:
            torch._dynamo.reset()
        attend = make_flex_attend(b.flex_compiled)
    else:
        attend = sdpa_attend
        if name == "rolling_sdpa_compiled":
            torch._dynamo.reset()
            rolling_step = torch.compile(model, dynamic=False)
    with swapped_attention(model, attend, opaque=rolling_step is not None):
        return run_variant(
            name, lambda: RollingRunner(model, b.config, st.texts, b.device, b.dtype, rolling_step),
            st.latents, st.ts, st.t_commit, b.warmup, b.timed, b.device,
        )


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _annotate(name: str, res: dict[str, Any], errs: list[float], b: _Bench, streams: int) -> bool | None:
    """Add a measured variant's errors vs the library, agreement, rates and notes to ``res``; returns
    whether it agrees (``None``: other semantics, reported only)."""
    res["rel_err_vs_library"] = max(errs)
    res["rel_err_vs_library_per_step"] = errs
    res["agrees"] = res["rel_err_vs_library"] <= (b.args.fp8_tolerance if "fp8" in name else b.tolerance)
    if name in OTHER_SEMANTICS:
        res["agrees"] = None
        res["note"] = ("relative-position sinks (KVCacheSpec.relative_sinks): different outputs once the "
                       "window slides, by design; timed for the cost of the second key segment")
    res["latent_frames_per_s"] = b.config.frames_per_chunk / (res["ms_per_chunk_step"] / 1e3)
    res["kv_peak_bytes_per_branch"] = res["kv_peak_bytes"] / streams
    if name == "rolling_flex":
        res["flex_compiled"] = b.flex_compiled
        if not b.flex_compiled:
            res["note"] = "eager flex_attention (unfused: materialises the scores); compiled on CUDA"
    if name.endswith("_compiled") and name.startswith("library"):
        res["note"] = "torch.compile(model, fullgraph=True, dynamic=False)"
    if name.endswith("_graph"):
        res["note"] = ("static forwards, each replayed from a CUDA graph (CUDAGraphStep"
                       + (" over torch.compile(model, fullgraph=True))" if "_compiled" in name else ")"))
    if "fp8" in name:
        res["kv_dtype"] = "float8_e4m3fn"
    if name == "rolling_sdpa_compiled":
        res["note"] = ("torch.compile(model, dynamic=False) with the rolling cache write + SDPA opaque "
                       "(one graph break per layer)")
    return res["agrees"]


def _run_setting(b: _Bench, st: _Setting) -> tuple[dict[str, Any], bool]:
    """Every variant at one CFG setting, one after another: ``(result, whether all agree)``."""
    variants: dict[str, Any] = {}
    reference: list[torch.Tensor] | None = None
    agree = True
    for name in b.args.variants:
        try:
            measured = _measure(name, b, st)
        except Exception as exc:  # a failing baseline (compile, OOM) is recorded; the library is the reference
            if name == "library":
                raise
            print(f"  {st.name} {name}: FAILED {exc!r:.300}", flush=True)
            variants[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000], "agrees": False,
                              "traceback": traceback.format_exc()[-4000:]}
            agree = False
            gc.collect()
            if b.device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        res = measured["result"]
        if name == "library":
            reference = measured["outputs"]
        assert reference is not None
        agrees = _annotate(name, res, [rel_err(o, r) for o, r in zip(measured["outputs"], reference)], b, st.streams)
        if agrees is not None:
            agree &= agrees
        variants[name] = res
        iqr = res["ms_per_chunk_step_stats"]["iqr_ms"]
        print(
            f"  {st.name} {name}: {res['ms_per_chunk_step']:.2f} ms per chunk step (IQR {iqr:.2g}; "
            f"setup {res['setup_s']:.1f} s, "
            f"warm-up {res['warmup_s']:.1f} s), rel err vs library {res['rel_err_vs_library']:.1e}",
            flush=True,
        )
    if "ms_per_chunk_step" in variants.get(BASELINE, {}):
        for res in variants.values():
            if "error" in res:
                continue
            res["speedup_vs_rolling_sdpa"] = variants[BASELINE]["ms_per_chunk_step"] / res["ms_per_chunk_step"]
    return {"branches": list(st.branches), "streams": st.streams, "variants": variants}, agree


def _targets(results: dict[str, Any], kv_target_per_branch: int) -> dict[str, Any]:
    """The speed-ups and KV checks against their targets, per CFG setting where both sides ran."""
    def ratio(slow: str, fast: str) -> dict[str, float]:
        """``slow``'s median chunk step over ``fast``'s, per CFG setting where both ran."""
        return {
            s: r["variants"][slow]["ms_per_chunk_step"] / r["variants"][fast]["ms_per_chunk_step"]
            for s, r in results.items()
            if all("ms_per_chunk_step" in r["variants"].get(n, {}) for n in (slow, fast))
        }

    library_speedups = {s: r["variants"]["library"].get("speedup_vs_rolling_sdpa") for s, r in results.items()}
    graph_speedups = {
        "library_graph_vs_library": ratio("library", "library_graph"),
        "library_compiled_graph_vs_library_compiled": ratio("library_compiled", "library_compiled_graph"),
        "library_fp8_compiled_graph_vs_library_fp8_compiled": ratio("library_fp8_compiled",
                                                                    "library_fp8_compiled_graph"),
    }
    relative_sinks_cost = {  # chunk step with relative sinks over the same step without: the second key segment
        "library_relative_sinks_vs_library": ratio("library_relative_sinks", "library"),
        "library_relative_sinks_compiled_vs_library_compiled": ratio("library_relative_sinks_compiled",
                                                                      "library_compiled"),
    }
    return {
        "library_speedup_vs_rolling_sdpa": TARGET_SPEEDUP,
        "library_speedup": library_speedups,
        "speedup_met": {s: (v is not None and v >= TARGET_SPEEDUP) for s, v in library_speedups.items()},
        # both sides compiled: what torch.compile-native buys over the compiled baseline
        "library_compiled_speedup_vs_rolling_sdpa_compiled": ratio("rolling_sdpa_compiled", "library_compiled"),
        "library_fp8_compiled_speedup_vs_rolling_sdpa_compiled": ratio("rolling_sdpa_compiled",
                                                                       "library_fp8_compiled"),
        "graph_speedups": {k: v for k, v in graph_speedups.items() if v},
        "relative_sinks_cost": {k: v for k, v in relative_sinks_cost.items() if v},
        "relative_sinks_cost_target": 1.02,
        "kv_peak_bytes_per_branch_target": kv_target_per_branch,
        "kv_peak_equals_target": {
            s: r["variants"]["library"]["kv_peak_bytes_per_branch"] == kv_target_per_branch for s, r in results.items()
        },
    }


def _config(b: _Bench) -> dict[str, Any]:
    config, args = b.config, b.args
    return {
        "preset": config.name, "params": b.params, "num_layers": config.num_layers, "dim": config.dim,
        "num_heads": config.num_heads, "head_dim": config.head_dim, "chunk_size": config.chunk_size,
        "frames_per_chunk": config.frames_per_chunk, "page_size": config.kv_page_size,
        "sink_chunks": config.sink_chunks, "window_chunks": config.window_chunks, "dtype": args.dtype,
        "device": str(b.device), "backend_requested": args.backend, "timesteps": list(TIMESTEPS) + [0.0],
        "forwards_per_chunk_step": len(TIMESTEPS) + 1, "warmup_chunks": b.warmup, "chunks_timed": b.timed,
        "flex_compiled": b.flex_compiled, "tolerance": b.tolerance, "seed": args.seed,
        "timing": "each timed chunk step one sample between two device-synchronising clock reads "
                  "(torch.utils.benchmark's timer); median and IQR over the timed steps",
        "torch_threads": torch.get_num_threads(),
    }


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark per ``argv``; writes the JSON (+ PNG) and returns the payload."""
    args = parse_args(argv)
    limits = {}
    compiles = args.compile or args.flex_compile == "on" or (args.flex_compile == "auto" and args.device == "cuda")
    for key in ("recompile_limit", "cache_size_limit") if compiles else ():  # compiled flex: a graph per key length
        if hasattr(torch._dynamo.config, key):
            limits[key] = getattr(torch._dynamo.config, key)
            setattr(torch._dynamo.config, key, max(64, limits[key]))
    try:
        with torch_threads(args.threads, args.preset, args.device):
            return _run(args)
    finally:
        for key, value in limits.items():
            setattr(torch._dynamo.config, key, value)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    b = _bench(args)
    _print_header(b)
    settings = ("cfg_on", "cfg_off") if args.cfg == "both" else (f"cfg_{args.cfg}",)
    results: dict[str, Any] = {}
    agree = True
    for name in settings:
        results[name], setting_agrees = _run_setting(b, _setting(b, name))
        agree &= setting_agrees
    payload: dict[str, Any] = {"env": environment(), "config": _config(b), "results": results,
                               "targets": _targets(results, b.kv_target_per_branch), "agree": agree}
    print_table(payload)
    save_json(result_path(args.out, "end_to_end.json", device=args.device), payload, args=args)
    png = plot(payload, result_path(args.out, "end_to_end.png", device=args.device))
    payload["png"] = str(png) if png else None
    return payload


# --------------------------------------------------------------------------------- output
def _mib(b: float | None) -> str:
    return "-" if b is None else f"{b / 2**20:.1f}"


def _rounded(d: dict[str, float | None]) -> dict[str, float | None]:
    return {k: None if v is None else round(v, 2) for k, v in d.items()}


def print_table(payload: dict[str, Any]) -> None:
    head = (f"{'cfg':<8}{'variant':<23}{'ms/step':>10}{'IQR':>8}{'vs sdpa':>9}{'latent fr/s':>13}{'peak MiB':>10}"
            f"{'KV MiB':>10}{'rel err':>10}  ok")
    print(head)
    print("-" * len(head))
    for setting, r in payload["results"].items():
        for name, res in r["variants"].items():
            if "error" in res:
                print(f"{setting:<8}{name:<23}  FAILED: {res['error'][:80]}")
                continue
            speed = res.get("speedup_vs_rolling_sdpa")
            iqr = res.get("ms_per_chunk_step_stats", {}).get("iqr_ms")
            print(
                f"{setting:<8}{name:<23}{res['ms_per_chunk_step']:>10.2f}{('-' if iqr is None else f'{iqr:.3g}'):>8}"
                f"{('-' if speed is None else f'{speed:.2f}x'):>9}{res['latent_frames_per_s']:>13.2f}"
                f"{_mib(res['peak_memory_bytes']):>10}{_mib(res['kv_peak_bytes']):>10}"
                f"{res['rel_err_vs_library']:>10.1e}  {'n/a' if res['agrees'] is None else 'yes' if res['agrees'] else 'NO'}"
            )
    t = payload["targets"]
    print(
        f"library speedup vs rolling_sdpa: {_rounded(t['library_speedup'])} "
        f"(target >= {t['library_speedup_vs_rolling_sdpa']}); "
        f"library KV peak per branch == (sinks + window + pending) chunks: {t['kv_peak_equals_target']} "
        f"({_mib(t['kv_peak_bytes_per_branch_target'])} MiB); outputs agree: {payload['agree']}"
    )
    if t["library_compiled_speedup_vs_rolling_sdpa_compiled"]:
        print(f"compiled vs compiled (library_compiled vs rolling_sdpa_compiled): "
              f"{_rounded(t['library_compiled_speedup_vs_rolling_sdpa_compiled'])}")
    for label, value in t.get("graph_speedups", {}).items():
        print(f"CUDA-graph step ({label}): {_rounded(value)}")
    if t.get("library_fp8_compiled_speedup_vs_rolling_sdpa_compiled"):
        print(f"compiled vs compiled, FP8 KV (library_fp8_compiled vs rolling_sdpa_compiled): "
              f"{_rounded(t['library_fp8_compiled_speedup_vs_rolling_sdpa_compiled'])}")


def _step_spread(res: dict[str, Any]) -> tuple[float, float] | None:
    """p25 / p75 ms per chunk step: from the stats, else from the per-step samples (older results)."""
    return spread(res.get("ms_per_chunk_step_stats"), res.get("ms_per_chunk_step_all"))


def plot(payload: dict[str, Any], path: Path) -> Path | None:
    """ms per chunk step per variant and CFG setting, IQR error bars; labels: median ms and speed-up."""
    plt = pyplot()
    if plt is None:
        return None
    settings = list(payload["results"])
    names: list[str] = []
    for r in payload["results"].values():
        names += [n for n in r["variants"] if n not in names]
    fig, ax = plt.subplots(figsize=(max(7.0, 2.2 + 1.1 * len(names) * len(settings)), 5.2), layout="constrained")
    width = 0.8 / len(names)
    has_spread = False
    top = 0.0
    for i, name in enumerate(names):
        xs, ms, bounds, labels = [], [], [], []
        for j, setting in enumerate(settings):
            res = payload["results"][setting]["variants"].get(name)
            if res is None or "error" in res:
                continue
            xs.append(j + i * width)
            ms.append(res["ms_per_chunk_step"])
            bounds.append(_step_spread(res))
            speed = res.get("speedup_vs_rolling_sdpa")
            ms_label = f"{ms[-1]:.0f}" if ms[-1] >= 100 else f"{ms[-1]:.3g}"
            labels.append(ms_label + ("" if speed is None else f"\n{speed:.2f}x"))
            top = max(top, ms[-1], bounds[-1][1] if bounds[-1] else 0.0)
        has_spread |= any(b is not None for b in bounds)
        bars(ax, xs, ms, width, bounds=bounds, labels=labels, fontsize=8, label=name)
    ticks = [f"CFG {s.removeprefix('cfg_')} ({payload['results'][s]['streams']} stream"
             f"{'s' if payload['results'][s]['streams'] != 1 else ''})" for s in settings]
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(settings))], ticks)
    ax.set_ylim(0, top * 1.18)  # room for the two-line labels above the tallest bar
    cfg = payload["config"]
    ax.set_ylabel("ms per chunk step (lower is better)")
    note = "error bars: IQR over the timed steps" if has_spread else "medians (no spread recorded)"
    title = (f"{cfg['preset']}: one chunk step = 4 denoising + 1 commit forward; sink {cfg['sink_chunks']} + window "
             f"{cfg['window_chunks']} chunks; {cfg['dtype']}, {payload.get('env', {}).get('gpu', cfg['device'])}\n"
             f"bar labels: median ms, speed-up vs rolling_sdpa; {note}")
    ax.set_title(wrap(title, fig, 9), fontsize=9)
    legend_below(fig, ax, ncol=min(len(names), 4))
    return save(plt, fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; exit status 1 if a variant failed or its outputs disagree with the library's."""
    payload = run(argv)
    if not payload["agree"]:
        print("ERROR: a variant failed or its outputs disagree with the library beyond the tolerance", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
