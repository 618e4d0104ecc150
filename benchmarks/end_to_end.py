"""End-to-end benchmark: a Wan2.1-1.3B-shaped causal DiT, one chunk step, this library vs rolling buffers.

One **chunk step** = 4 denoising forwards (``commit_current=False``, timesteps 1000, 750, 500, 250)
+ 1 committing forward (timestep 0) of one chunk (3 latent frames = 4680 tokens at 480x832), at
sink 1 + window 6 chunks, with classifier-free guidance on (cond + uncond batched in one forward,
2 streams) and off (1 stream). ``--commit-forward last_step`` makes it 4 forwards (below). The SAME
model (``ardiff_modules.models.wan_causal_dit``, random weights from one seed) runs under these
attention variants (the rolling ones are the peers of ``baselines.py``):

* ``library``       -- this library: ``ChunkSelfAttention`` over the paged pool (``KVCache``,
                       ``backend="auto"``: FlashInfer on CUDA with contiguous extents -> ragged FA3,
                       the reference SDPA backend on CPU), ``state.prepare_forward`` per forward.
* ``rolling_fa3``   -- **the baseline** (the peer a user really runs on Hopper): what Self-Forcing /
                       LongLive do, with flash-attn 3. Each block's ``attn`` is swapped for a wrapper
                       that reuses the same projections / norms / RoPE but keeps, per layer, one
                       contiguous K and V buffer ``[streams, (sink + window + 1) * chunk, heads, dim]``;
                       before the first forward of a new chunk, once the buffer is full, the window is
                       shifted left by one chunk with a memmove (``buf[:, s:-C].copy_(buf[:, s+C:].clone())``);
                       every forward writes its K/V into the slot after the resident chunks and attends
                       over the prefix ``buf[:, :resident * C + C]`` with FlashInfer's ragged FA3
                       (``BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="fa3")``,
                       ``causal=False``; the stand-in for ``flash_attn_interface``): one ``plan()`` per
                       (streams, q_len, kv_len) shape, shared by every layer and every later forward of
                       that shape (``baselines.RaggedFA3Attend``). With the window full the prefix is
                       the whole buffer and is flattened to ``[streams * L, h, d]`` without a copy.
                       (The peers also call ``.item()`` on device indices each layer; this baseline
                       keeps its indices on the host, which only favours it.) CUDA + FlashInfer + Hopper
                       + bf16/fp16 only: elsewhere it is reported as skipped (with the reason).
* ``rolling_sdpa``  -- the same buffers attended with ``F.scaled_dot_product_attention`` (the baseline
                       where FA3 cannot run, e.g. on the CPU; a secondary ratio otherwise).
* ``rolling_flex``  -- the same buffers, attended with ``flex_attention`` (no mask: the prefix holds
                       exactly the visible keys), compiled (``dynamic=False``) on CUDA, eager on CPU
                       unless ``--flex-compile on`` (compiled flex on CPU costs seconds per key length).
* ``library_compiled`` (``--compile``, off by default) -- ``torch.compile(model, fullgraph=True)`` over
                       the library's contexts.
* ``rolling_fa3_compiled`` / ``rolling_sdpa_compiled`` (``--compile``) -- ``rolling_fa3`` /
                       ``rolling_sdpa`` with the model compiled (``dynamic=False``) around an opaque cache
                       write + attention (``torch.compiler.disable``: one graph break per layer), the best a
                       rolling buffer with host-side offsets gets from torch.compile without touching the op.
* ``rolling_fa3_compiled_fullgraph`` -- the peer with no graph break: its FA3 call a custom op
                       (``baselines.traceable_fa3``, as the library's op is), the roll and write traced, the
                       model compiled with ``fullgraph=True`` (one graph per fill level while the buffer fills,
                       two once it is full: roll + write, write).
* ``rolling_fa3_compiled_graph`` -- that compiled peer with its two steady-state forwards replayed from
                       hand-captured CUDA graphs (``baselines.RollingGraphRunner``): the peer with every trick
                       on, the one ``library_compiled_graph`` is stated against (``SPEEDUP_PAIRS``).

* ``forcingkv_own`` / ``forcingkv_own_compiled`` / ``forcingkv_own_compiled_graph`` -- **Forcing-KV's own
                       attention path** (``forcing_kv_peer``: its per-layer, per-head-group caches concatenated
                       into fresh tensors every forward, FA3 per group, its content-selected dynamic patches),
                       with its published Self-Forcing configuration (``--forcingkv-heads``: its head file);
                       eager, compiled ``fullgraph=True`` (FA3 a custom op; two graphs: the transient first
                       chunks, before its buffers are full, run eagerly), and that step's two settled forwards
                       replayed from CUDA graphs. The peer for the same method;
                       other semantics than ``library`` (outputs reported, not checked). SDPA on the CPU.
* ``library_heads`` / ``_compiled`` / ``_fp8_compiled`` / ``_compiled_graph`` / ``_fp8_compiled_graph`` -- per-head / frame
                       retention (``--heads``: ``KVCacheSpec.head_retention``); other semantics than ``library``.
                       ``--heads forcingkv``: the ``forcingkv_own*`` peer's configuration (its head map, its
                       ``--forcingkv-dynamic`` setting) handed to ``ForcingKVConfig.head_retention``, the same
                       method by construction: with the dynamic patches a ``SelectedFramesPolicy`` temporal group
                       (``benchmarks/configs/forcingkv_selfforcing_dynamic_wan1.3b.json`` at wan2.1-1.3b). Where a
                       group selects patches the heads rows' KV pages are a patch (``heads_page_size``: 260 tokens
                       at wan2.1-1.3b, the preset's 120 do not split a 1560-token frame into 6 whole-page patches);
                       recorded per row (``page_size``) and in ``config.heads``.

Every variant's rows are also written to ``end_to_end.partial.json`` as it finishes (and when it is skipped or
fails; atomically: a temporary file renamed over it), so a run that overruns its device call keeps what it
measured.

**Baselines.** Every variant's speed-up is stated against a baseline: eager rows (``library``,
``library_fp8``, ``library_graph``, ...) against ``rolling_fa3``, compiled rows (``library_compiled``,
``library_fp8_compiled``, ...) against ``rolling_fa3_compiled``; where those did not run (CPU, no
FlashInfer, not requested, failed) against ``rolling_sdpa`` / ``rolling_sdpa_compiled``
(:func:`select_baselines`). ``speedup_vs_rolling_sdpa`` is kept as a secondary ratio. Every ratio
is a ratio of medians and carries its spread: ``[slow p25 / fast p75, slow p75 / fast p25]``, the
range the ratio takes with both variants' steps anywhere in their IQRs (:func:`speedup`).

**Model FLOP utilisation.** Each variant reports ``flops_per_chunk_step`` (analytic,
:func:`flops_per_chunk_step`: the DiT blocks' linear layers -- self-attention q/k/v/o, cross-attention
q/o (the text K/V are cached), FFN -- plus self-attention ``QK^T`` and ``PV`` over the visible keys and
cross-attention over the text tokens, times forwards per chunk step and streams) and ``mfu`` =
FLOPs / seconds / peak, the peak 989.4 TFLOP/s (H200 SXM, dense bf16) on CUDA (``--peak-tflops``;
recorded in ``config``), ``null`` on the CPU. FP8 variants are read against the same bf16 peak.

**The committing forward** (``--commit-forward``; vllm-omni #7816). ``clean`` (default): the 4
denoising forwards, then one clean forward at t=0 with ``commit_current=True`` (5 forwards per chunk).
``last_step``: the last denoising forward (t=250) is the committing one and there is no clean forward
(4 forwards per chunk); the rolling peers commit the same way (``end_forward(commit=True)`` on that
forward). A last-step commit keeps the K/V of the t=250 forward (of a still noisy input) as history,
so later chunks see a different history. ``both``: the library variants and the ``rolling_fa3``
variants run both ways (the others clean only), each chunk step then follows the sampler (a
flow-matching Euler step after each denoising forward, CFG-combined at ``--cfg-scale``, from seeded
noise over the same timesteps) so that each run produces latents; reported per variant: ms per chunk
step both ways, the speed-up of ``last_step`` (with its spread) and the relative error of the
produced latents chunk by chunk over the measured chunks (warm-up + timed: one rollout), max and final.

Every variant gets identical inputs: seeded latents per chunk (without ``both``, the same latents for
all forwards of a chunk: the sampler arithmetic between forwards is left out, it is negligible next to
a forward), the same text embeddings (cond: seeded random, uncond: zeros), projected once per layer.
Each variant warms up until its window is full and has evicted once (default ``sink + window + 2``
chunks), then times ``--chunks-timed`` chunk steps one by one (``_timing.each_call``: each step between
two reads of ``torch.utils.benchmark``'s clock, which synchronises the device; a chunk step advances
the stream, so every step runs exactly once and is one sample). Reported: the median with its IQR
(p25..p75); the speed-ups are ratios of medians. The variants run one after another in one process
(each holds its own KV: 7-14 GB at wan2.1-1.3b, and the rolling ones swap the model's attention
modules), not interleaved; a variant run both ways is compiled once.

Checked: the outputs of the committing forwards of the timed chunk steps of every variant agree with
the library's (same commit setting) by relative error norm (<= 3e-2 in bf16 / fp16, <= 1e-4 in float32
on CPU, 1e-3 in float32 on CUDA); the exit status is 1 if not. Where the ``library_heads*`` rows run the
``forcingkv_own*`` peer's method (``--heads forcingkv``, or a file with the same policy per head, e.g. the static
JSON with ``--forcingkv-dynamic off``), their outputs are checked against the peer's of the same form at the same
tolerance (:func:`check_same_method`; with CFG on batch row 0 only: Forcing-KV chooses its patches on row 0 for
every row, the library per stream; with dynamic patches in bf16 reported, not counted: the two score the patches
in different precisions). Reported per variant and CFG setting:
ms per chunk step, speed-up vs the baseline and vs ``rolling_sdpa`` (target for the library: >= 1.3x
vs ``rolling_sdpa``), FLOPs and MFU, latent frames/s (``frames_per_chunk / step seconds``) and video frames/s
(``video_frames_per_s`` = latent frames x 4 / step seconds: a Wan VAE decodes 4 video frames per latent frame;
the DiT step alone, excluding the VAE decode and the text encoder), peak allocated memory
(``torch.cuda.max_memory_allocated`` delta over the variant's whole run: cache / buffers, warm-up,
timed steps) and KV bytes: the library's peak pages in use x bytes per page (its pool is sized to
exactly (sinks + window + pending) chunks per branch) vs the rolling buffers.

    python -m benchmarks.end_to_end                                    # CUDA: wan2.1-1.3b, bf16
    python -m benchmarks.end_to_end --preset tiny --device cpu --dtype float32 --out /tmp/e2e
    python -m benchmarks.end_to_end --compile                          # + the compiled rows
    python -m benchmarks.end_to_end --cfg on --variants library,rolling_fa3   # a subset
    python -m benchmarks.end_to_end --commit-forward both --cfg on --variants library,rolling_fa3
    python -m benchmarks.end_to_end --preset tiny --device cpu --dtype float32 --cfg off --heads forcingkv \
        --variants library_heads,forcingkv_own       # the library vs Forcing-KV's own path, the same method

Writes ``end_to_end.json`` (config, per CFG setting: the baselines, per variant ``ms_per_chunk_step``
(median), ``ms_per_chunk_step_stats`` (median, IQR, p25, p75), speed-ups with their spreads, FLOPs,
MFU, frames/s, memory, errors vs the library; with ``both`` the ``last_step`` rows and the
``commit_forward_comparison``; targets; run metadata: git commit, UTC time, versions, command line)
and ``end_to_end.png`` (bars with IQR error bars, the baseline drawn as the reference; skipped if
matplotlib is missing) into ``--out DIR``; by default the committed results,
``benchmarks/results/end_to_end_<device>.json`` / ``.png``. The rolling buffers are
``baselines.RollingKVCache`` & co. ``--device cuda`` without CUDA, or
``--backend flashinfer`` without FlashInfer, exits 2 with one line.
A baseline that fails (compile error, out of memory) is recorded in the JSON with its traceback and
the run goes on (exit status 1); one that cannot run here (FA3 without CUDA / FlashInfer / Hopper) is
recorded as skipped with the reason (exit status unaffected). Sizes at wan2.1-1.3b / bf16: weights
2.8 GB; KV per branch 8 chunks x 4680 tokens x 30 layers x 12 heads x 128 x K,V x 2 B = 6.9 GB
(13.8 GB with CFG), held by one variant at a time. Compiled flex compiles one graph per key length
during the warm-up (8 lengths per CFG setting), which is most of the run's wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import gzip
import importlib.util
import shutil
import statistics
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

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
from ardiff_modules.core.frame_retention import trims_frames
from ardiff_modules.core.selected_retention import candidates_at, selecting
from ardiff_modules.pool import bytes_per_page
from benchmarks._plotting import bars, legend_below, pyplot, save, spread, wrap
from benchmarks._timing import each_call, environment, fail, once, result_path, save_json
from benchmarks import forcing_kv_peer
from benchmarks.head_retention import forcing_kv_like, grouped_kv_cache
from benchmarks.baselines import (
    RaggedFA3Attend,
    RollingGraphRunner,
    RollingRunner,
    traceable_fa3,
    fa3_unavailable_reason,
    make_flex_attend,
    sdpa_attend,
    swapped_attention,
)

VARIANTS = ("library", "rolling_fa3", "rolling_sdpa", "rolling_flex")
#: Variants the flags add (``--compile``, ``--fp8``, ``--graph``); ``--variants`` may also name them directly.
EXTRA_VARIANTS = ("library_compiled", "rolling_fa3_compiled", "rolling_sdpa_compiled", "library_fp8",
                  "library_fp8_compiled", "library_graph", "library_compiled_graph", "library_fp8_graph",
                  "library_fp8_compiled_graph", "library_relative_sinks", "library_relative_sinks_compiled",
                  "library_heads", "library_heads_compiled", "library_heads_fp8_compiled",
                  "library_heads_compiled_graph", "library_heads_fp8_compiled_graph", "rolling_fa3_compiled_fullgraph",
                  "rolling_fa3_compiled_graph",
                  *forcing_kv_peer.VARIANTS)
#: Forcing-KV's own attention path (``forcing_kv_peer``): FA3 on CUDA, SDPA on the CPU.
FORCING_KV_VARIANTS = forcing_kv_peer.VARIANTS
#: The peers attended with FlashInfer's ragged FA3 (CUDA + FlashInfer + Hopper only; skipped elsewhere).
FA3_VARIANTS = ("rolling_fa3", "rolling_fa3_compiled", "rolling_fa3_compiled_fullgraph", "rolling_fa3_compiled_graph")
#: The peer with every trick on: compiled without graph breaks (its FA3 call a custom op), and that compiled
#: step's steady-state forwards replayed from hand-captured CUDA graphs.
FULL_PEERS = ("rolling_fa3_compiled_fullgraph", "rolling_fa3_compiled_graph")
#: Variants whose semantics differ from ``library`` once the window slides (sinks at relative positions):
#: their outputs are reported, not required to agree.
#: The ``library_heads*`` variants attend with per-head retention (``--heads``): fewer keys for the local heads.
OTHER_SEMANTICS = ("library_relative_sinks", "library_relative_sinks_compiled", "library_heads",
                   "library_heads_compiled", "library_heads_fp8_compiled", "library_heads_compiled_graph",
                   "library_heads_fp8_compiled_graph",
                   *FORCING_KV_VARIANTS)
#: The baseline of the eager rows and of the compiled rows: the first of each that was measured.
EAGER_BASELINES = ("rolling_fa3", "rolling_sdpa")
COMPILED_BASELINES = ("rolling_fa3_compiled", "rolling_sdpa_compiled")
#: ``--heads forcingkv``: the library_heads* rows take the forcingkv_own* peer's configuration (the same method).
HEADS_FORCINGKV = "forcingkv"
SECONDARY_BASELINE = "rolling_sdpa"  #: ``speedup_vs_rolling_sdpa``, kept beside the baseline's ratio
TIMESTEPS = (1000.0, 750.0, 500.0, 250.0)  #: denoising forwards of a chunk step; then one at 0 (commit)
SCHEDULE = TIMESTEPS + (0.0,)  #: the sampler's timesteps (``--commit-forward both``): each step goes to the next
COMMIT_FORWARDS = ("clean", "last_step")
TARGET_SPEEDUP = 1.3  #: the library vs rolling_sdpa (the issue's original target)
#: H200 SXM, dense bf16 tensor-core peak (FLOP/s): the MFU's denominator on CUDA unless --peak-tflops.
PEAK_FLOPS_H200 = 989.4e12
#: Video frames a Wan VAE decodes per latent frame (``video_frames_per_s``; the DiT step alone).
VIDEO_FRAMES_PER_LATENT = 4
CFG_BRANCHES = {"cfg_on": ("cond", "uncond"), "cfg_off": ("cond",)}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: (fast, slow) pairs of the targets block: fast's speed-up over slow where both ran (with its spread).
SPEEDUP_PAIRS = (
    ("library", "rolling_fa3"), ("library_fp8", "rolling_fa3"), ("library_graph", "rolling_fa3"),
    ("library_fp8_graph", "rolling_fa3"),
    ("library_compiled", "rolling_fa3_compiled"), ("library_fp8_compiled", "rolling_fa3_compiled"),
    ("library_compiled_graph", "rolling_fa3_compiled"), ("library_fp8_compiled_graph", "rolling_fa3_compiled"),
    ("library", "rolling_sdpa"), ("rolling_fa3", "rolling_sdpa"),
    ("library_compiled", "rolling_sdpa_compiled"), ("library_fp8_compiled", "rolling_sdpa_compiled"),
    ("rolling_fa3_compiled", "rolling_sdpa_compiled"),
    ("library_graph", "library"), ("library_compiled_graph", "library_compiled"),
    ("library_fp8_compiled_graph", "library_fp8_compiled"),
    ("library_heads", "rolling_fa3"), ("library_heads_compiled", "rolling_fa3_compiled"),
    ("library_heads_fp8_compiled", "rolling_fa3_compiled"), ("library_heads_compiled_graph", "rolling_fa3_compiled"),
    ("library_heads", "library"), ("library_heads_compiled", "library_compiled"),
    ("library_compiled", "rolling_fa3_compiled_fullgraph"), ("rolling_fa3_compiled_fullgraph", "rolling_fa3_compiled"),
    ("library_compiled_graph", "rolling_fa3_compiled_graph"), ("library_fp8_compiled_graph", "rolling_fa3_compiled_graph"),
    ("library_heads_compiled_graph", "rolling_fa3_compiled_graph"),
    ("library_heads_fp8_compiled_graph", "rolling_fa3_compiled_graph"),
    ("rolling_fa3_compiled_graph", "rolling_fa3_compiled_fullgraph"),
    # Forcing-KV's own path against the peer with every trick on, and the library's full-window rows against it
    # (other semantics; the library_heads* rows with Forcing-KV's configuration: the pairs below).
    ("forcingkv_own", "rolling_fa3"), ("forcingkv_own_compiled", "rolling_fa3_compiled_fullgraph"),
    ("forcingkv_own_compiled_graph", "rolling_fa3_compiled_graph"),
    ("forcingkv_own_compiled_graph", "forcingkv_own_compiled"),
    ("library_compiled_graph", "forcingkv_own_compiled_graph"), ("library_compiled", "forcingkv_own_compiled"),
    # The library with Forcing-KV's configuration (--heads forcingkv, or its JSON) against Forcing-KV's own path.
    ("library_heads", "forcingkv_own"), ("library_heads_compiled", "forcingkv_own_compiled"),
    ("library_heads_compiled_graph", "forcingkv_own_compiled_graph"),
    ("library_heads_fp8_compiled_graph", "forcingkv_own_compiled_graph"),
)


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
    p.add_argument("--compile", action="store_true",
                   help="also run library_compiled, rolling_fa3_compiled and rolling_sdpa_compiled")
    p.add_argument("--graph", action="store_true",
                   help="also run library_graph: every forward a static plan replayed from one CUDA graph per "
                        "forward shape (CUDAGraphStep; over the compiled model with --compile: "
                        "library_compiled_graph); CUDA only")
    p.add_argument("--fp8", action="store_true",
                   help="also run library_fp8 (and library_fp8_compiled with --compile): KVCacheSpec(kv_dtype="
                        "'float8_e4m3fn'), FP8 attention on FlashInfer; agreement checked at --fp8-tolerance")
    p.add_argument("--fp8-tolerance", type=float, default=0.1,
                   help="largest relative error of an FP8 variant's outputs vs library (default 0.1)")
    p.add_argument("--commit-forward", choices=(*COMMIT_FORWARDS, "both"), default="clean",
                   help="which forward commits a chunk: 'clean' (default: the denoising forwards, then a clean "
                        "forward at t=0 that commits), 'last_step' (the last denoising forward commits: one "
                        "forward fewer per chunk), 'both' (library and rolling_fa3 variants both ways, side by "
                        "side, with the produced latents compared chunk by chunk)")
    p.add_argument("--heads", default=None, metavar="FILE|forcingkv",
                   help="head configuration of the library_heads* variants: a HeadRetention JSON (per-head retention), "
                        "or 'forcingkv': the forcingkv_own* peer's own configuration (--forcingkv-dynamic, "
                        "--forcingkv-heads) built by the library's ForcingKVConfig.head_retention, the same method by "
                        "construction (its outputs checked against the forcingkv_own* rows); default: a synthetic "
                        "Forcing-KV-like split (--local-fraction). A group that selects patches (SelectedFramesPolicy) "
                        "runs with pages of a patch (frame tokens / patches_per_frame: 260 at wan2.1-1.3b) where the "
                        "preset's page size does not split a frame into whole-page patches")
    p.add_argument("--local-fraction", type=float, default=2 / 3,
                   help="without --heads: the share of each layer's heads kept local (sink 0 + window 1); "
                        "the rest keep the preset's sink + window (default 2/3)")
    p.add_argument("--frame-extents", choices=("on", "off"), default="on",
                   help="the library_heads* rows' lanes: contiguous extents (the library's default on FlashInfer: "
                        "frame lanes get frame slots, ragged FA3) or plain paging of every lane "
                        "(KVCache(contiguous_extents=False): paged FA3)")
    p.add_argument("--forcingkv-dynamic", choices=("on", "off"), default="on",
                   help="the forcingkv_own peers' dynamic patches (Forcing-KV's dynamic_temporal_enabled); off: the "
                        "static method, the one FrameWindowPolicy groups (--heads) express")
    p.add_argument("--forcingkv-heads", type=Path, default=None,
                   help="Forcing-KV's head file (configs_head/*.json, read by load_forcing_kv) for the forcingkv_own* "
                        "variants; default: a fixed-seed map with the published Self-Forcing file's per-layer "
                        "static counts (134 of 360)")
    p.add_argument("--cfg-scale", type=float, default=5.0,
                   help="guidance scale of the sampler that --commit-forward both runs (default 5.0)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s for the MFU (default: 989.4, H200 SXM dense bf16, on CUDA; none on CPU)")
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
    p.add_argument("--profile", type=Path, default=None, metavar="DIR",
                   help="after timing, profile one more chunk step of every variant (torch.profiler) into DIR")
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
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        p.error(f"--peak-tflops: expected > 0, got {args.peak_tflops}")
    args.variants = _variants(p, args)
    if args.heads == HEADS_FORCINGKV and WanConfig.preset(args.preset).frames_per_chunk != forcing_kv_peer.BLOCK_FRAMES:
        p.error(f"--heads {HEADS_FORCINGKV}: expected a preset of {forcing_kv_peer.BLOCK_FRAMES}-frame chunks "
                f"(Forcing-KV's blocks), got {args.preset}")
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
        names += ("library_compiled", "rolling_fa3_compiled", "rolling_sdpa_compiled")
    if args.fp8:
        names += ("library_fp8",) + (("library_fp8_compiled",) if args.compile else ())
    if args.graph:
        names += ("library_compiled_graph",) if args.compile else ("library_graph",)
        if args.fp8:
            names += ("library_fp8_compiled_graph",) if args.compile else ("library_fp8_graph",)
    return tuple(dict.fromkeys(names))  # each once, in order


# --------------------------------------------------------------------------------- FLOPs
def flop_terms(config: WanConfig, visible_keys: int) -> dict[str, int]:
    """FLOPs of ONE forward of ONE stream over one chunk, per term, summed over the ``num_layers`` DiT blocks.

    A matmul ``[m, k] @ [k, n]`` counts ``2 m k n``. With ``q = chunk_size`` query tokens, ``D = dim``
    (= heads x head_dim), ``F = ffn_dim``, ``T = text_tokens`` and ``keys = visible_keys``, per block:

    * ``self_attn_qkvo``: the q, k, v and o projections, ``4 x 2 q D D``;
    * ``cross_attn_qo``: cross-attention's q and o projections, ``2 x 2 q D D`` (its K/V over the text
      are cached per prompt: not recomputed per forward);
    * ``ffn``: ``Linear(D, F)`` and ``Linear(F, D)``, ``2 x 2 q D F``;
    * ``self_attention``: ``QK^T`` + ``PV`` over the visible keys, ``4 q keys D``;
    * ``cross_attention``: the same over the text tokens, ``4 q T D``.

    Not counted (each well under 1 % at Wan2.1-1.3B): the patch embedding, time embedding and
    projection, the head, norms, RoPE, modulation, softmax.
    """
    q, d, layers = config.chunk_size, config.dim, config.num_layers
    inner = config.num_heads * config.head_dim
    return {
        "self_attn_qkvo": layers * 4 * 2 * q * d * d,
        "cross_attn_qo": layers * 2 * 2 * q * d * d,
        "ffn": layers * 2 * 2 * q * d * config.ffn_dim,
        "self_attention": layers * 4 * q * visible_keys * inner,
        "cross_attention": layers * 4 * q * config.text_tokens * inner,
    }


def flops_per_chunk_step(config: WanConfig, *, streams: int, visible_keys: int, forwards: int) -> int:
    """FLOPs of one chunk step: :func:`flop_terms` summed, times ``forwards`` per chunk step and ``streams``.

    ``visible_keys``: the keys each stream's forward attends to (:func:`visible_keys`); every forward
    of a chunk step attends to the same ones.
    """
    return streams * forwards * sum(flop_terms(config, visible_keys).values())


def visible_keys(config: WanConfig, committed: int) -> int:
    """Keys one stream's forward attends to after ``committed`` chunks: the resident sinks + window chunks
    (every committed chunk until the window is full) and the pending chunk itself."""
    return (min(committed, config.sink_chunks + config.window_chunks) + 1) * config.chunk_size


def forwards_per_chunk_step(mode: str) -> int:
    """``clean``: the denoising forwards + the clean committing forward; ``last_step``: the denoising ones."""
    return len(TIMESTEPS) + (mode == "clean")


# --------------------------------------------------------------------------------- baselines and ratios
def is_compiled(name: str) -> bool:
    """Whether a variant is a compiled row (stated against the compiled baseline)."""
    return "_compiled" in name


def select_baselines(measured: Iterable[str]) -> dict[str, str | None]:
    """The baseline of the eager rows and of the compiled rows, given the variants that were measured.

    Eager rows: ``rolling_fa3``, else ``rolling_sdpa``. Compiled rows: ``rolling_fa3_compiled``, else
    ``rolling_sdpa_compiled``, else the eager rows' baseline. ``None`` where no peer was measured.
    """
    have = set(measured)
    eager = next((n for n in EAGER_BASELINES if n in have), None)
    compiled = next((n for n in COMPILED_BASELINES if n in have), eager)
    return {"eager": eager, "compiled": compiled}


def baseline_of(name: str, baselines: Mapping[str, str | None]) -> str | None:
    """The baseline ``name``'s speed-up is stated against (:func:`select_baselines`' choice for its kind)."""
    return baselines["compiled" if is_compiled(name) else "eager"]


def _step_stats(res: Mapping[str, Any]) -> dict[str, float]:
    """Median / p25 / p75 ms per chunk step (older results without stats: from the steps, else the median)."""
    stats = res.get("ms_per_chunk_step_stats")
    if stats and "p25_ms" in stats:
        return {k: float(stats[k]) for k in ("median_ms", "p25_ms", "p75_ms")}
    ms = float(res["ms_per_chunk_step"])
    low, high = spread(None, res.get("ms_per_chunk_step_all")) or (ms, ms)
    return {"median_ms": ms, "p25_ms": low, "p75_ms": high}


def speedup(slow: Mapping[str, Any], fast: Mapping[str, Any]) -> dict[str, float]:
    """``slow``'s median ms per chunk step over ``fast``'s (> 1: ``fast`` is faster), with its spread.

    ``iqr_low`` = slow p25 / fast p75 and ``iqr_high`` = slow p75 / fast p25: the range of the ratio
    with both variants' steps anywhere in their IQRs (one timed step each: the ratio itself).
    """
    a, b = _step_stats(slow), _step_stats(fast)
    return {"ratio": a["median_ms"] / b["median_ms"], "iqr_low": a["p25_ms"] / b["p75_ms"],
            "iqr_high": a["p75_ms"] / b["p25_ms"]}


def measured(res: Mapping[str, Any] | None) -> bool:
    """Whether a variant's result holds a timing (not skipped, not failed)."""
    return res is not None and "ms_per_chunk_step" in res


def add_speedups(variants: dict[str, dict[str, Any]], baselines: Mapping[str, str | None]) -> None:
    """Per measured variant: ``baseline``, ``speedup_vs_baseline`` (+ ``_iqr``) and, where ``rolling_sdpa``
    ran, ``speedup_vs_rolling_sdpa`` (+ ``_iqr``)."""
    for name, res in variants.items():
        if not measured(res):
            continue
        for field, base in (("baseline", baseline_of(name, baselines)), (SECONDARY_BASELINE, SECONDARY_BASELINE)):
            if base is None or not measured(variants.get(base)):
                continue
            r = speedup(variants[base], res)
            key = "speedup_vs_baseline" if field == "baseline" else f"speedup_vs_{base}"
            if field == "baseline":
                res["baseline"] = base
            res[key] = r["ratio"]
            res[f"{key}_iqr"] = [r["iqr_low"], r["iqr_high"]]


# --------------------------------------------------------------------------------- runners
class LibraryRunner:
    """A ``KVCache`` sized to exactly (sinks + window + pending) chunks per branch, one session."""

    def __init__(self, model: nn.Module, config: WanConfig, branches: tuple[str, ...], texts: Sequence[torch.Tensor],
                 device: torch.device, dtype: torch.dtype, backend: str, step: Callable[..., torch.Tensor],
                 kv_dtype: str | None = None, graph: bool = False, relative_sinks: bool = False,
                 heads: am.HeadRetention | None = None, page_size: int | None = None,
                 frame_extents: bool = True) -> None:
        """``page_size``: tokens a KV page, default the preset's (``WanConfig.kv_page_size``); ``frame_extents``:
        with ``heads``, the library's default (contiguous extents on FlashInfer: frame lanes' frame slots too),
        else plain paging of every lane (``contiguous_extents=False``)."""
        spec = dataclasses.replace(make_kv_spec(config, device, branches), dtype=dtype,
                                   kv_dtype=kv_dtype, relative_sinks=relative_sinks)
        if page_size is not None:
            spec = dataclasses.replace(spec, page_size=page_size)
        self.spec, self.branches, self.step = spec, branches, step
        #: ``graph``: static forwards replayed from CUDA graphs (one per forward shape: commit or not
        #: share one static context, so one graph serves the whole chunk step).
        self.graph = am.CUDAGraphStep(step) if graph else None
        self.cache: Any
        if heads is None:
            self.cache = am.KVCache(spec, num_pages=kv_pool_pages(spec, slack_chunks=0), device=device, backend=backend)
        else:  # per-head retention: the spec's sink + window become the head groups' (one lane per head part)
            grouped = dataclasses.replace(spec, sink_chunks=0, window_chunks=None)
            self.cache = grouped_kv_cache(grouped, heads, device=device, backend=backend,
                                          **({} if frame_extents else {"contiguous_extents": False}))
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
        lanes = stats.lanes  # one lane ("all") for a uniform cache, one per head part with retention groups
        info = {
            "kv_peak_bytes": sum(s.peak_pages_used * s.bytes_per_page for s in lanes.values()),
            "kv_allocated_bytes": stats.pool_bytes,
            "peak_pages_used": stats.peak_pages_used,
            "pool_pages": stats.num_pages,
            "page_size": self.spec.page_size,
            "layout": "contiguous extents (ring)" if self.cache.extent_chunks is not None else "plain paging",
        }
        if self.cache.spec.head_retention is not None:
            info["lanes"] = {
                lane.name: {"heads_per_layer": part.num_heads, "layers": len(part.layers),
                            "retention": [part.policy.sink_chunks, part.policy.max_history_chunks],
                            "kv_peak_bytes": lanes[lane.name].peak_pages_used * lanes[lane.name].bytes_per_page}
                for lane, part in ((lane, lane.part) for lane in self.cache._lanes)
            }
        return info

    def close(self) -> None:
        self.state.close()


# --------------------------------------------------------------------------------- measurement
def _euler(x: torch.Tensor, v: torch.Tensor, i: int, cfg_scale: float) -> torch.Tensor:
    """The sampler's step after denoising forward ``i``: flow-matching Euler from ``SCHEDULE[i]`` to
    ``SCHEDULE[i + 1]`` with ``v`` CFG-combined (stream 0 cond, 1 uncond); ``x`` ``[streams, F, C, H, W]``
    keeps one latent per stream (all the same)."""
    if v.shape[0] == 2:
        v = v[1:2] + cfg_scale * (v[0:1] - v[1:2])
    return x + (SCHEDULE[i + 1] - SCHEDULE[i]) / 1000.0 * v


def chunk_step(runner: Any, latents: Iterator[torch.Tensor], st: _Setting, mode: str,
                cfg_scale: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk step on the next latent: ``(the committing forward's output, the produced latent)``.

    ``clean``: the denoising forwards, then the clean forward at t=0 commits; ``last_step``: the last
    denoising forward commits. With ``cfg_scale`` (``--commit-forward both``) the sampler moves the latent
    after each denoising forward (:func:`_euler`) and the produced latent is returned; else every forward
    of the chunk gets the same latent and the second item is ``None``.
    """
    x = next(latents)
    last = len(st.ts) - 1
    out = x
    for i, t in enumerate(st.ts):
        out = runner.forward(x, t, mode == "last_step" and i == last)
        if cfg_scale is not None:
            x = _euler(x, out, i, cfg_scale)
    if mode == "clean":
        out = runner.forward(x, st.t_commit, True)
    return out, (x if cfg_scale is not None else None)


def run_variant(
    make_runner: Callable[[], Any], b: _Bench, st: _Setting, mode: str, name: str = "variant"
) -> dict[str, Any]:
    """Warm up, then time ``b.timed`` chunk steps one by one; returns timings, memory, the timed commit
    outputs and (``--commit-forward both``) the produced latents of every chunk of the run.

    Set-up, each warm-up step and each timed step are timed with ``_timing`` (the device synchronised
    before and after each); a chunk step runs exactly once per latent, in the same order for every
    variant, so the timed steps' outputs line up across variants.
    """
    cuda = b.device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.synchronize(b.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(b.device)
        base = torch.cuda.memory_allocated(b.device)
    runner, setup_s = once(make_runner)
    used = st.latents[: b.warmup + b.timed]
    # NOTE: --profile runs one chunk step more, after the timed ones, on the last latents again (its output unused).
    step = functools.partial(chunk_step, runner, iter([*used, used[-1]]), st, mode, b.cfg_scale)
    with torch.no_grad():
        warm, warm_outs = each_call(step, b.warmup) if b.warmup else (None, [])  # one-time costs show here
        stats, outs = each_call(step, b.timed)
        if b.args.profile is not None:
            profile_step(step, b.args.profile / f"profile_{st.name}_{name}_{mode}.txt", cuda)
    # After timing: the copies to the host would synchronise inside it.
    outputs = [out.detach().float().cpu() for out, _ in outs]
    latents = [x.float().cpu() for _, x in [*warm_outs, *outs] if x is not None]
    del outs, warm_outs, step
    if cuda:
        torch.cuda.synchronize(b.device)
        peak = torch.cuda.max_memory_allocated(b.device) - base
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
    return {"result": result, "outputs": outputs, "latents": latents}


def profile_step(step: Callable[[], Any], path: Path, cuda: bool) -> None:
    """One chunk step under ``torch.profiler``: wall time, device-busy time and the top operators, into ``path``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        _, seconds = once(step)
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        f.write(f"wall {seconds * 1e3:.2f} ms, device busy (sum of kernel self times) {device_us / 1e3:.2f} ms\n\n")
        sort = "self_device_time_total" if cuda else "self_cpu_time_total"
        f.write(events.table(sort_by=sort, row_limit=30) + "\n")
        f.write(events.table(sort_by="self_cpu_time_total", row_limit=30) + "\n")
        # The library's own ops, whatever their rank above (issue 42 item 4 compares their host time per call).
        ours = sorted((e for e in events if e.key.startswith("ardiff_modules::")), key=lambda e: e.key)
        f.write("\nardiff_modules ops: calls, CPU total per call (us), self CPU per call (us)\n")
        for e in ours:
            total, own = e.cpu_time_total / e.count, e.self_cpu_time_total / e.count
            f.write(f"  {e.key:44s} {e.count:6d} {total:10.1f} {own:10.1f}\n")
    # The timeline (gaps between kernels show where the host, not the device, sets the pace), gzipped.
    trace = path.with_suffix(".trace.json")
    prof.export_chrome_trace(str(trace))
    with trace.open("rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    trace.unlink()
    print(f"  profile: {path} (wall {seconds * 1e3:.1f} ms, device busy {device_us / 1e3:.1f} ms)")


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
    modes: tuple[str, ...] = ("clean",)  #: commit settings measured; the first one is the primary
    cfg_scale: float | None = None  #: the sampler's guidance scale (``--commit-forward both``), else None
    peak_flops: float | None = None  #: the MFU's denominator (FLOP/s); None on the CPU
    model: nn.Module = None  # type: ignore[assignment]
    params: int = 0
    texts: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  #: branch -> text embedding
    latent_shape: tuple[int, ...] = ()  #: one stream's latents of one chunk, [1, frames, channels, h, w]
    base_latents: list[torch.Tensor] = dataclasses.field(default_factory=list)  #: one per chunk step
    kv_target_per_branch: int = 0  #: bytes of (sinks + window + pending) chunks of one branch
    heads: Any = None  #: the ``library_heads*`` variants' HeadRetention (``--heads``)
    #: the ``library_heads*`` variants' KV page size (tokens): the preset's, or a patch's where the heads select
    heads_page_size: int = 0
    #: whether the ``library_heads*`` rows run the forcingkv_own* peer's method (``--heads forcingkv``, or a file
    #: with the same policy per head, :func:`same_per_head`): their outputs are then checked against the peer's
    #: (:func:`check_same_method`)
    same_method: bool = False
    #: the ``forcingkv_own*`` variants' configuration (None where the preset's chunks are not 3 frames)
    forcing_kv: forcing_kv_peer.ForcingKVPeerConfig | None = None
    #: one compiled step shared by the compiled Forcing-KV variants (its graphs per cache state compiled once)
    forcing_kv_step: Any = None
    #: Setting -> variant -> its rows so far, written as each variant finishes (``end_to_end.partial.json``):
    #: a run that overruns its device call keeps every variant it measured.
    partial: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


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
    both = args.commit_forward == "both"
    peak = args.peak_tflops * 1e12 if args.peak_tflops is not None else (PEAK_FLOPS_H200 if cuda else None)
    b = _Bench(args, device, dtype, config, warmup=resident + 2 if args.warmup_chunks is None else args.warmup_chunks,
               timed=args.chunks_timed, tolerance=tolerance,
               flex_compiled=args.flex_compile == "on" or (args.flex_compile == "auto" and cuda),
               modes=COMMIT_FORWARDS if both else (args.commit_forward,),
               cfg_scale=args.cfg_scale if both else None, peak_flops=peak)
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
    if config.frames_per_chunk == forcing_kv_peer.BLOCK_FRAMES and (
            args.heads == HEADS_FORCINGKV or any(v in FORCING_KV_VARIANTS for v in args.variants)):
        b.forcing_kv = forcing_kv_peer.published_self_forcing(
            config, heads=args.forcingkv_heads, seed=args.seed, dynamic=args.forcingkv_dynamic == "on"
        )
    b.heads = head_config(args, config, b.forcing_kv)
    b.heads_page_size = (heads_page_size(b.heads, config) if any("_heads" in v for v in args.variants)
                         else config.kv_page_size)
    b.same_method = b.forcing_kv is not None and same_per_head(b.heads,
                                                              forcing_kv_peer.library_head_retention(b.forcing_kv))
    return b


def same_per_head(a: am.HeadRetention, b: am.HeadRetention) -> bool:
    """Whether every (layer, kv head) keeps by the same policy in ``a`` and ``b`` (the same method; the groups' names
    and how heads are grouped may differ: e.g. one ``"all"`` group vs equal ``"spatial"`` / ``"temporal"`` ones)."""
    def per_head(h: am.HeadRetention) -> list[list[Any]]:
        return [[h.groups[g] for g in row] for row in h.layers]

    return per_head(a) == per_head(b)


def head_config(args: argparse.Namespace, config: WanConfig,
                forcing_kv: forcing_kv_peer.ForcingKVPeerConfig | None = None) -> am.HeadRetention:
    """``--heads forcingkv``: the library's configuration of the forcingkv_own* peer's method
    (:func:`forcing_kv_peer.library_head_retention` of ``forcing_kv``); ``--heads FILE`` loaded; else the synthetic
    Forcing-KV-like split (``--local-fraction`` of each layer's heads sink 0 + window 1, drawn per layer with
    ``--seed``; the rest the preset's sink + window)."""
    if args.heads == HEADS_FORCINGKV:
        assert forcing_kv is not None, "parse_args checks the preset's chunks"
        return forcing_kv_peer.library_head_retention(forcing_kv)
    if args.heads is not None:
        return am.HeadRetention.from_json(args.heads)
    return forcing_kv_like(config.num_layers, config.num_heads, args.local_fraction,
                           (config.sink_chunks, config.window_chunks), seed=args.seed)


def heads_page_size(heads: am.HeadRetention, config: WanConfig) -> int:
    """The ``library_heads*`` rows' KV page size: the preset's (``WanConfig.kv_page_size``), unless a group selects
    patches (``SelectedFramesPolicy``) and a frame's pages do not split into its ``patches_per_frame`` patches of
    whole pages (``check_selection_geometry``): then one page a patch, ``tokens_per_frame / patches_per_frame``
    (260 at wan2.1-1.3b, P = 6: 1560 / 120 = 13 pages a frame do not split in 6)."""
    page, frame = config.kv_page_size, config.tokens_per_frame
    patches = {p.patches_per_frame for p in map(selecting, heads.groups.values()) if p is not None}
    if all(frame % page == 0 and (frame // page) % n == 0 for n in patches):
        return page
    if len(patches) > 1 or frame % next(iter(patches)):
        raise ValueError(f"--heads: patches_per_frame {sorted(patches)} of {frame}-token frames: expected one count "
                         f"that divides a frame")
    return frame // next(iter(patches))


def head_visible_keys(heads: am.HeadRetention, config: WanConfig, committed: int) -> float:
    """Mean over (layer, head) of the keys a head attends to after ``committed`` chunks (its group's resident
    chunks + the pending one; a content-selected group also its selection, ``keep_frames`` frames' worth, once a
    commit made one): what the FLOPs of a per-head-retention step are counted with."""
    total = 0.0
    for row in heads.layers:
        for group in row:
            policy = heads.groups[group]
            indices = policy.history_indices(committed)
            if trims_frames(policy):  # frames (FrameWindowPolicy, a selection's window, ...): their kept frames
                framed: Any = policy
                frames = framed.frames_per_chunk
                total += sum(len(framed.kept_frames(i, committed)) for i in indices) / frames + 1
                selected = selecting(policy)
                if selected is not None and committed and candidates_at(policy, committed - 1) is not None:
                    total += selected.keep_frames / frames  # the selection the last commit made
            else:
                total += len(indices) + 1
    return total / (heads.num_layers * heads.num_kv_heads) * config.chunk_size


def _print_header(b: _Bench) -> None:
    config, resident = b.config, b.config.sink_chunks + b.config.window_chunks
    forwards = ", ".join(f"{m}: {forwards_per_chunk_step(m)}" for m in b.modes)
    print(
        f"model {config.name}: {b.params / 1e6:.1f}M params, {config.num_layers} layers, {config.num_heads} heads x "
        f"{config.head_dim}, chunk {config.chunk_size} tokens ({config.frames_per_chunk} latent frames), sink "
        f"{config.sink_chunks} + window {config.window_chunks} chunks; {b.dtype}, {b.device}; warm-up {b.warmup} "
        f"chunk steps, {b.timed} timed; flex {'compiled' if b.flex_compiled else 'eager'}; forwards per chunk "
        f"step ({forwards})" + ("; sampler on (produced latents compared)" if b.cfg_scale is not None else "")
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


def skip_reason(name: str, device: torch.device, dtype: torch.dtype, head_dim: int | None = None) -> str | None:
    """Why variant ``name`` cannot run here (reported as skipped, the run goes on); ``None`` if it can."""
    if name in FA3_VARIANTS:
        return fa3_unavailable_reason(device, dtype, head_dim)
    return None


def _skip(name: str, b: _Bench) -> str | None:
    """:func:`skip_reason` at this run's geometry (Forcing-KV's variants also need 3-frame chunks)."""
    if name in FORCING_KV_VARIANTS:
        return forcing_kv_peer.skip_reason(name, b.config, b.device, b.dtype)
    return skip_reason(name, b.device, b.dtype, b.config.head_dim)


def runs_every_mode(name: str) -> bool:
    """Whether ``--commit-forward both`` runs ``name`` both ways: the library variants and ``rolling_fa3*``."""
    return name.startswith("library") or name in FA3_VARIANTS


def _measure(name: str, b: _Bench, st: _Setting, modes: Sequence[str]) -> dict[str, dict[str, Any]]:
    """One variant at one CFG setting, per commit setting in ``modes`` (see :func:`run_variant`): the
    library's, or a peer's rolling buffer. A compiled variant is compiled once for all of ``modes``."""
    model = b.model
    if name.startswith("library"):
        step: Callable[..., torch.Tensor] = model
        if "_compiled" in name:
            _reset_dynamo(b)
            step = torch.compile(model, fullgraph=True, dynamic=False)
        kv_dtype = "float8_e4m3fn" if "fp8" in name else None
        graph, relative = name.endswith("_graph"), "relative_sinks" in name
        heads = b.heads if "_heads" in name else None
        page_size = b.heads_page_size if heads is not None else None

        def make() -> LibraryRunner:
            return LibraryRunner(model, b.config, st.branches, st.texts, b.device, b.dtype, b.args.backend, step,
                                 kv_dtype, graph=graph, relative_sinks=relative, heads=heads, page_size=page_size,
                                 frame_extents=heads is not None and b.args.frame_extents == "on")

        return {mode: run_variant(make, b, st, mode, name) for mode in modes}
    if name in FORCING_KV_VARIANTS:
        return _measure_forcing_kv(name, b, st, modes)
    attend, rolling_step = _rolling_attention(name, b)
    fa3 = attend
    if name in FULL_PEERS:  # FA3 behind a custom op: the compiled model traces whole (no graph break)
        attend = traceable_fa3(cast(RaggedFA3Attend, attend))
    runner_type = RollingGraphRunner if name == "rolling_fa3_compiled_graph" else RollingRunner
    out: dict[str, dict[str, Any]] = {}
    with swapped_attention(model, attend, opaque=rolling_step is not None and name not in FULL_PEERS):
        for mode in modes:
            plans = getattr(fa3, "plans", 0)
            out[mode] = run_variant(lambda: runner_type(model, b.config, st.texts, b.device, b.dtype, rolling_step),
                                    b, st, mode, name)
            if isinstance(fa3, RaggedFA3Attend):
                out[mode]["result"]["fa3_plans"] = fa3.plans - plans
    return out


def _measure_forcing_kv(name: str, b: _Bench, st: _Setting, modes: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Forcing-KV's own path (``forcing_kv_peer``): eager, or compiled with ``fullgraph=True`` (one compiled step
    shared by ``forcingkv_own_compiled`` and ``_compiled_graph`` when they run back to back: its graphs per cache
    state compile once), or that step replayed from CUDA graphs once steady."""
    assert b.forcing_kv is not None
    model, step = b.model, None
    if "_compiled" in name:  # the compiled model, its FA3 op and the swapped modules, kept for the next variant
        if b.forcing_kv_step is None:
            torch._dynamo.reset()
            attend, fa3, kernel = forcing_kv_peer.make_attend(b.device, compiled=True)
            b.forcing_kv_step = (torch.compile(model, dynamic=False, fullgraph=True),
                                 forcing_kv_peer.wrap_attention(model, attend), fa3, kernel)
        step, wrappers, fa3, kernel = b.forcing_kv_step
    else:
        attend, fa3, kernel = forcing_kv_peer.make_attend(b.device, compiled=False)
        wrappers = forcing_kv_peer.wrap_attention(model, attend)
    runner_type = (forcing_kv_peer.ForcingKVGraphRunner if name.endswith("_graph")
                   else forcing_kv_peer.ForcingKVRunner)
    out: dict[str, dict[str, Any]] = {}
    with forcing_kv_peer.swapped_attention(model, wrappers):
        for mode in modes:
            out[mode] = run_variant(lambda: runner_type(model, b.forcing_kv, st.texts, b.device, b.dtype, step, fa3),
                                    b, st, mode, name)
            out[mode]["result"]["attention_kernel"] = kernel
    return out


def _rolling_attention(name: str, b: _Bench) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor] | None]:
    """A rolling variant's attention over the buffer's prefix, and its compiled model (``*_compiled``) or None."""
    if name == "rolling_flex":
        if b.flex_compiled:
            _reset_dynamo(b)
        return make_flex_attend(b.flex_compiled), None
    attend: Callable[..., torch.Tensor] = RaggedFA3Attend() if name.startswith("rolling_fa3") else sdpa_attend
    if not name.endswith("_compiled") and name not in FULL_PEERS:
        return attend, None
    _reset_dynamo(b)
    return attend, torch.compile(b.model, dynamic=False, fullgraph=name in FULL_PEERS)


def _reset_dynamo(b: _Bench) -> None:
    """``torch._dynamo.reset()`` before a variant compiles; the shared Forcing-KV step recompiles after it."""
    torch._dynamo.reset()
    b.forcing_kv_step = None


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _note(name: str, b: _Bench) -> str | None:
    """What a variant's row means beyond its name (the JSON's ``note``)."""
    if name == "rolling_fa3_compiled_fullgraph":
        return ("torch.compile(model, fullgraph=True, dynamic=False): no graph break; the FA3 call a custom op, the "
                "buffer's roll and write traced (a graph per fill level while the buffer fills, two once full)")
    if name == "rolling_fa3_compiled_graph":
        return ("rolling_fa3_compiled_fullgraph with the steady-state forwards (roll + write, write) replayed from "
                "hand-captured CUDA graphs, outputs cloned (as CUDAGraphStep does); the untimed forwards while the "
                "buffer fills run the eager model (a compile per fill level did not fit a device call)")
    if name in FORCING_KV_VARIANTS:
        return forcing_kv_peer.note(name)
    if name.startswith("library_heads"):
        same = (" Forcing-KV's method as the forcingkv_own* peer runs it (same head map and numbers; outputs checked "
                "against it: rel_err_vs_forcingkv_own)" if b.same_method else "")
        selects = any(selecting(p) is not None for p in b.heads.groups.values())
        return ("per-head / frame retention (--heads: KVCacheSpec.head_retention): each head attends its group's "
                "kept keys; different outputs from the full-window library once a window slides, by design;" + same
                + (f" content-selected patches (SelectedFramesPolicy, pages of {b.heads_page_size} tokens: one a "
                   "patch)" if selects else "")
                + (", each forward replayed from a CUDA graph (the commit's patch selection runs after the replay, "
                   "outside it)" if name.endswith("_graph") else ""))
    if name in OTHER_SEMANTICS:
        return ("relative-position sinks (KVCacheSpec.relative_sinks): different outputs once the window slides, "
                "by design; timed for the cost of the second key segment")
    if name == "rolling_flex" and not b.flex_compiled:
        return "eager flex_attention (unfused: materialises the scores); compiled on CUDA"
    if name.endswith("_graph"):
        return ("static forwards, each replayed from a CUDA graph (CUDAGraphStep"
                + (" over torch.compile(model, fullgraph=True))" if "_compiled" in name else ")"))
    if name.startswith("library") and name.endswith("_compiled"):
        return "torch.compile(model, fullgraph=True, dynamic=False)"
    if name == "rolling_fa3":
        return ("FlashInfer ragged FA3 (backend='fa3', causal=False) over the buffer's prefix, the stand-in for "
                "flash_attn_interface; one plan() per (streams, q_len, kv_len) shape shared by every layer")
    if name in ("rolling_sdpa_compiled", "rolling_fa3_compiled"):
        return ("torch.compile(model, dynamic=False) with the rolling cache write + attention opaque "
                "(one graph break per layer)")
    return None


def _annotate(name: str, res: dict[str, Any], errs: list[float], b: _Bench, st: _Setting, mode: str) -> bool | None:
    """Add a measured variant's errors vs the library, agreement, FLOPs / MFU, rates and notes to ``res``;
    returns whether it agrees (``None``: other semantics, reported only)."""
    res["commit_forward"] = mode
    res["rel_err_vs_library"] = max(errs)
    res["rel_err_vs_library_per_step"] = errs
    res["agrees"] = None if name in OTHER_SEMANTICS else (
        res["rel_err_vs_library"] <= (b.args.fp8_tolerance if "fp8" in name else b.tolerance))
    res["latent_frames_per_s"] = b.config.frames_per_chunk / (res["ms_per_chunk_step"] / 1e3)
    res["video_frames_per_s"] = VIDEO_FRAMES_PER_LATENT * res["latent_frames_per_s"]  # the DiT step alone
    res["kv_peak_bytes_per_branch"] = res["kv_peak_bytes"] / st.streams
    # NOTE: the timed steps all see the same visible keys once the window is full (the default warm-up);
    # after a shorter warm-up their FLOPs differ, and the mean is read against the median time.
    keys = [_visible_keys(name, b, b.warmup + i) for i in range(b.timed)]
    flops = [flops_per_chunk_step(b.config, streams=st.streams, visible_keys=k, forwards=forwards_per_chunk_step(mode))
             for k in keys]
    res["visible_keys_per_timed_step"] = keys
    res["flops_per_chunk_step"] = statistics.fmean(flops)
    seconds = res["ms_per_chunk_step"] / 1e3
    res["mfu"] = res["flops_per_chunk_step"] / seconds / b.peak_flops if b.peak_flops else None
    note = _note(name, b)
    if note:
        res["note"] = note
    if name == "rolling_flex":
        res["flex_compiled"] = b.flex_compiled
    if "fp8" in name:
        res["kv_dtype"] = "float8_e4m3fn"
    return res["agrees"]


def _visible_keys(name: str, b: _Bench, committed: int) -> float:
    """Keys one stream's forward attends to (mean over heads) after ``committed`` chunks, per variant."""
    if name in FORCING_KV_VARIANTS:
        assert b.forcing_kv is not None
        return forcing_kv_peer.visible_keys(b.forcing_kv, committed)
    if "_heads" in name:
        return head_visible_keys(b.heads, b.config, committed)
    return visible_keys(b.config, committed)


def _failure(exc: BaseException) -> dict[str, Any]:
    return {"error": f"{type(exc).__name__}: {exc}"[:2000], "agrees": False, "traceback": traceback.format_exc()[-4000:]}


def _measure_setting(b: _Bench, st: _Setting) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]], bool]:
    """Every variant at one CFG setting, one after another, in every commit setting it runs in.

    Returns ``(rows, runs, agree)``: per commit setting the variants' result rows (measured, skipped or
    failed), per commit setting the measured runs (their outputs and latents), whether all agree.
    """
    rows: dict[str, dict[str, Any]] = {m: {} for m in b.modes}
    runs: dict[str, dict[str, Any]] = {m: {} for m in b.modes}
    agree = True
    for name in b.args.variants:
        modes = b.modes if runs_every_mode(name) else b.modes[:1]
        reason = _skip(name, b)
        if reason is not None:
            print(f"  {st.name} {name}: skipped ({reason})", flush=True)
            for mode in modes:
                rows[mode][name] = {"skipped": reason, "agrees": None}
            _save_partial(b, st.name, rows)
            continue
        try:
            measured_modes = _measure(name, b, st, modes)
        except Exception as exc:  # a failing baseline (compile, OOM) is recorded; the library is the reference
            if name == "library":
                raise
            print(f"  {st.name} {name}: FAILED {exc!r:.300}", flush=True)
            for mode in modes:
                rows[mode][name] = _failure(exc)
            agree = False
            gc.collect()
            if b.device.type == "cuda":
                torch.cuda.empty_cache()
            _save_partial(b, st.name, rows)
            continue
        for mode, run in measured_modes.items():
            res, reference = run["result"], runs[mode].get("library", run)["outputs"]
            agrees = _annotate(name, res, [rel_err(o, r) for o, r in zip(run["outputs"], reference)], b, st, mode)
            agree &= agrees is not False
            rows[mode][name], runs[mode][name] = res, run
            print(f"  {st.name} {name} [{mode}]: {res['ms_per_chunk_step']:.2f} ms per chunk step (IQR "
                  f"{res['ms_per_chunk_step_stats']['iqr_ms']:.2g}; setup {res['setup_s']:.1f} s, warm-up "
                  f"{res['warmup_s']:.1f} s), rel err vs library {res['rel_err_vs_library']:.1e}", flush=True)
        check_same_method(b, st, rows, runs)  # as soon as both sides ran (the partial JSON carries it)
        _save_partial(b, st.name, rows)
    agree &= check_same_method(b, st, rows, runs, report=True)
    return rows, runs, agree


def check_same_method(b: _Bench, st: _Setting, rows: dict[str, dict[str, Any]], runs: dict[str, dict[str, Any]],
                      report: bool = False) -> bool:
    """The library_heads* rows against Forcing-KV's own path where they run the same method (``b.same_method``:
    ``--heads forcingkv``, or a file with the same policy per head): per commit setting, each measured
    library_heads* row's committing outputs vs the forcingkv_own* row of the same form
    (``library_heads_compiled_graph`` vs ``forcingkv_own_compiled_graph``, ...; else the first measured, in
    ``--variants`` order), relative error norm per timed step, checked at the run's tolerance (``--fp8-tolerance``
    for an FP8 row). Row 0 of the batch only with CFG on: Forcing-KV chooses the dynamic patches on batch row 0
    for every row, the library per stream (the uncond stream then keeps other patches). Adds
    ``rel_err_vs_forcingkv_own`` (+ ``_per_step``), ``forcingkv_own_reference``, ``forcingkv_own_rows_compared``,
    ``agrees_with_forcingkv_own`` and ``agreement_counted`` to the rows; returns whether all counted rows agree
    (``True`` where nothing is compared). Idempotent.

    Counted (in the exit status) in float32, and in half precision when no group selects patches. With patches in
    bf16 / fp16 the agreement is reported, not counted: the peer scores the patches in the keys' dtype (as upstream),
    the library in float32, so a near-tie between two patches' scores (bf16 keeps ~3 digits) may keep another patch,
    a legitimate difference in the outputs from there on (not measured on a GPU yet)."""
    if not b.same_method:
        return True
    selects = any(selecting(p) is not None for p in b.heads.groups.values())
    counted = b.dtype == torch.float32 or not selects
    ok = True
    for mode, done in runs.items():
        first = next((n for n in b.args.variants if n in FORCING_KV_VARIANTS and n in done), None)
        if first is None:
            continue
        for name, run in done.items():
            if not name.startswith("library_heads"):
                continue
            ref = "forcingkv_own" + name.removeprefix("library_heads")
            ref = ref if ref in done else first
            errs = [rel_err(o[:1], r[:1]) for o, r in zip(run["outputs"], done[ref]["outputs"])]
            tolerance = b.args.fp8_tolerance if "fp8" in name else b.tolerance
            res = rows[mode][name]
            res["forcingkv_own_reference"] = ref
            res["forcingkv_own_rows_compared"] = (
                "all (one stream)" if st.streams == 1 else
                "row 0 (cond): Forcing-KV selects the dynamic patches on batch row 0 for every row, the library per "
                "stream")
            res["rel_err_vs_forcingkv_own"] = max(errs)
            res["rel_err_vs_forcingkv_own_per_step"] = errs
            res["agrees_with_forcingkv_own"] = max(errs) <= tolerance
            res["agreement_counted"] = counted
            ok &= res["agrees_with_forcingkv_own"] or not counted
            if report:
                print(f"  {st.name} {name} [{mode}] vs {ref} (the same method): rel err {max(errs):.1e} "
                      f"({'agrees' if res['agrees_with_forcingkv_own'] else 'DISAGREES'} at {tolerance:g}"
                      f"{'' if counted else '; reported, not counted: bf16 patch scores may tie'})", flush=True)
    return ok


def _save_partial(b: _Bench, setting: str, rows: dict[str, dict[str, Any]]) -> None:
    """Write every row measured so far (per setting, per commit setting) to ``end_to_end.partial.json``."""
    b.partial[setting] = {mode: dict(variants) for mode, variants in rows.items()}
    path = result_path(b.args.out, "end_to_end.partial.json", device=b.args.device)
    save_json(path, {"config": _config(b), "partial": b.partial}, args=b.args)


def _view(variants: dict[str, dict[str, Any]], mode: str) -> dict[str, Any]:
    """One commit setting's rows with their baselines chosen and every speed-up added."""
    baselines = select_baselines(n for n, res in variants.items() if measured(res))
    add_speedups(variants, baselines)
    return {"commit_forward": mode, "forwards_per_chunk_step": forwards_per_chunk_step(mode),
            "baselines": baselines, "variants": variants}


def compare_commit_forwards(clean: Mapping[str, Any], last: Mapping[str, Any]) -> dict[str, Any]:
    """One variant run both ways (``run_variant``'s results): ms per chunk step each way, the speed-up of
    ``last_step`` (with its spread) and the relative error of its produced latents vs ``clean``'s, chunk
    by chunk over the run (warm-up + timed: one rollout from the same noise), max and final."""
    errs = [rel_err(x, ref) for x, ref in zip(last["latents"], clean["latents"])]
    if not errs:
        raise ValueError("compare_commit_forwards: expected produced latents (the sampler of --commit-forward both)")
    r = speedup(clean["result"], last["result"])
    return {
        "ms_per_chunk_step": {"clean": clean["result"]["ms_per_chunk_step"],
                              "last_step": last["result"]["ms_per_chunk_step"]},
        "forwards_per_chunk_step": {m: forwards_per_chunk_step(m) for m in COMMIT_FORWARDS},
        "speedup_last_step_vs_clean": r["ratio"],
        "speedup_last_step_vs_clean_iqr": [r["iqr_low"], r["iqr_high"]],
        "latent_rel_err_per_chunk": errs,
        "latent_rel_err_max": max(errs),
        "latent_rel_err_final": errs[-1],
    }


def _run_setting(b: _Bench, st: _Setting) -> tuple[dict[str, Any], bool]:
    """Every variant at one CFG setting: ``(result, whether all agree)``. The result holds the primary
    commit setting's rows (``variants``, ``baselines``); with ``--commit-forward both`` also the
    ``last_step`` rows and the ``commit_forward_comparison`` per variant run both ways."""
    rows, runs, agree = _measure_setting(b, st)
    result = {"branches": list(st.branches), "streams": st.streams, **_view(rows[b.modes[0]], b.modes[0])}
    if len(b.modes) > 1:
        result["last_step"] = _view(rows["last_step"], "last_step")
        result["commit_forward_comparison"] = {
            name: compare_commit_forwards(run, runs["last_step"][name])
            for name, run in runs["clean"].items() if name in runs["last_step"]
        }
        for name, cmp in result["commit_forward_comparison"].items():
            print(f"  {st.name} {name}: last_step {cmp['speedup_last_step_vs_clean']:.3f}x clean "
                  f"(IQR {cmp['speedup_last_step_vs_clean_iqr'][0]:.3f}..{cmp['speedup_last_step_vs_clean_iqr'][1]:.3f}); "
                  f"latents vs clean: rel err max {cmp['latent_rel_err_max']:.2e}, final "
                  f"{cmp['latent_rel_err_final']:.2e}", flush=True)
    return result, agree


def _speedups(variants_by_setting: Mapping[str, Mapping[str, Any]],
              pairs: Sequence[tuple[str, str]] = SPEEDUP_PAIRS) -> dict[str, dict[str, dict[str, float]]]:
    """``<fast>_vs_<slow>``: per CFG setting where both were measured, :func:`speedup` (ratio + spread)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for fast, slow in pairs:
        per = {s: speedup(v[slow], v[fast]) for s, v in variants_by_setting.items()
               if measured(v.get(fast)) and measured(v.get(slow))}
        if per:
            out[f"{fast}_vs_{slow}"] = per
    return out


def _targets(results: dict[str, Any], kv_target_per_branch: int) -> dict[str, Any]:
    """The speed-ups (each with its spread) and the KV checks, per CFG setting where both sides ran."""
    primary = {s: r["variants"] for s, r in results.items()}
    library_vs_sdpa = {s: v["library"].get("speedup_vs_rolling_sdpa") for s, v in primary.items()}
    targets: dict[str, Any] = {
        "baselines": {s: r["baselines"] for s, r in results.items()},
        "library_speedup_vs_baseline": {
            s: {"baseline": base, **speedup(r["variants"][base], r["variants"]["library"])}
            for s, r in results.items() if (base := r["baselines"]["eager"]) is not None
        },
        "speedups": _speedups(primary),
        "library_speedup_vs_rolling_sdpa": TARGET_SPEEDUP,  # the target, against rolling_sdpa
        "library_speedup": library_vs_sdpa,
        "speedup_met": {s: (v is not None and v >= TARGET_SPEEDUP) for s, v in library_vs_sdpa.items()},
        # time with relative sinks over the same step without: the cost of the second key segment
        "relative_sinks_cost": _speedups(primary, (("library", "library_relative_sinks"),
                                                   ("library_compiled", "library_relative_sinks_compiled"))),
        "relative_sinks_cost_target": 1.02,
        "kv_peak_bytes_per_branch_target": kv_target_per_branch,
        "kv_peak_equals_target": {
            s: v["library"]["kv_peak_bytes_per_branch"] == kv_target_per_branch for s, v in primary.items()
        },
        # per-head retention: the heads variants' peak KV over the uniform library's (issue 28: <= 0.6)
        "heads_kv_ratio": {
            s: {n: res["kv_peak_bytes"] / v["library"]["kv_peak_bytes"] for n, res in v.items()
                if n.startswith("library_heads") and measured(res)}
            for s, v in primary.items()
        },
        # --heads forcingkv (check_same_method): the library's rows of Forcing-KV's method vs Forcing-KV's own path
        "same_method_outputs": {
            s: {n: {"reference": res["forcingkv_own_reference"], "rel_err": res["rel_err_vs_forcingkv_own"],
                    "agrees": res["agrees_with_forcingkv_own"], "counted": res["agreement_counted"],
                    "rows": res["forcingkv_own_rows_compared"]}
                for n, res in v.items() if "rel_err_vs_forcingkv_own" in res}
            for s, v in primary.items()
        },
    }
    if any("last_step" in r for r in results.values()):
        targets["last_step"] = {"speedups": _speedups({s: r["last_step"]["variants"] for s, r in results.items()})}
        targets["last_step_vs_clean"] = {
            s: {n: {"ratio": c["speedup_last_step_vs_clean"], "iqr": c["speedup_last_step_vs_clean_iqr"],
                    "latent_rel_err_max": c["latent_rel_err_max"], "latent_rel_err_final": c["latent_rel_err_final"]}
                for n, c in r["commit_forward_comparison"].items()}
            for s, r in results.items()
        }
    return targets


def _config(b: _Bench) -> dict[str, Any]:
    config, args = b.config, b.args
    return {
        "preset": config.name, "params": b.params, "num_layers": config.num_layers, "dim": config.dim,
        "num_heads": config.num_heads, "head_dim": config.head_dim, "ffn_dim": config.ffn_dim,
        "text_tokens": config.text_tokens, "chunk_size": config.chunk_size,
        "frames_per_chunk": config.frames_per_chunk, "page_size": config.kv_page_size,
        "sink_chunks": config.sink_chunks, "window_chunks": config.window_chunks, "dtype": args.dtype,
        "device": str(b.device), "backend_requested": args.backend,
        "commit_forward": args.commit_forward, "commit_forwards_measured": list(b.modes),
        "timesteps": list(TIMESTEPS) + ([0.0] if b.modes[0] == "clean" else []),
        "forwards_per_chunk_step": forwards_per_chunk_step(b.modes[0]),
        "sampler": (f"flow-matching Euler over {list(SCHEDULE)}, CFG scale {b.cfg_scale}" if b.cfg_scale is not None
                    else "off: every forward of a chunk step gets the same seeded latent"),
        "warmup_chunks": b.warmup, "chunks_timed": b.timed,
        "flex_compiled": b.flex_compiled, "tolerance": b.tolerance, "seed": args.seed,
        "timing": "each timed chunk step one sample between two device-synchronising clock reads "
                  "(torch.utils.benchmark's timer); median and IQR over the timed steps",
        "ratio_spread": "speed-ups are ratios of medians; *_iqr = [slow p25 / fast p75, slow p75 / fast p25]",
        "flops": "analytic (end_to_end.flop_terms): DiT blocks' linears (self-attn q/k/v/o, cross-attn q/o, FFN), "
                 "self-attention QK^T+PV over the visible keys, cross-attention over the text tokens; "
                 "x forwards per chunk step x streams",
        "peak_flops": b.peak_flops,
        "peak_flops_source": (None if b.peak_flops is None else "--peak-tflops" if args.peak_tflops is not None
                              else "H200 SXM dense bf16 (989.4 TFLOP/s)"),
        "torch_threads": torch.get_num_threads(),
        "heads": {"source": _heads_source(b), "config": b.heads.to_dict(), "page_size": b.heads_page_size,
                  "same_method_as_forcingkv_own": b.same_method} if b.heads is not None else None,
        "forcing_kv": b.forcing_kv.to_dict() if b.forcing_kv is not None else None,
        "video_frames_per_s": f"latent frames x {VIDEO_FRAMES_PER_LATENT} (Wan VAE) / DiT chunk-step seconds: the DiT "
                              "step alone, excluding the VAE decode and the text encoder",
    }


def _heads_source(b: _Bench) -> str:
    """Where the library_heads* rows' HeadRetention came from (``config.heads.source``)."""
    args = b.args
    if args.heads == HEADS_FORCINGKV:
        assert b.forcing_kv is not None
        return (f"forcingkv: the forcingkv_own* peer's configuration (dynamic {args.forcingkv_dynamic}; heads "
                f"{b.forcing_kv.heads_source}) via ForcingKVConfig.head_retention")
    if args.heads is not None:
        return str(args.heads)
    return (f"synthetic Forcing-KV-like: {args.local_fraction:.3f} of each layer's heads sink 0 + window 1 "
            f"(seed {args.seed})")


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark per ``argv``; writes the JSON (+ PNG) and returns the payload."""
    args = parse_args(argv)
    limits = {}
    compiles = any(is_compiled(v) for v in args.variants) or args.flex_compile == "on" or (
        args.flex_compile == "auto" and args.device == "cuda" and "rolling_flex" in args.variants)
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


def _ratio_text(r: Mapping[str, float] | None) -> str:
    return "-" if r is None else f"{r['ratio']:.3f}x (IQR {r['iqr_low']:.3f}..{r['iqr_high']:.3f})"


def _row(setting: str, name: str, res: Mapping[str, Any]) -> str:
    """One variant's line of the table."""
    if "skipped" in res:
        return f"{setting:<8}{name:<27}  skipped: {res['skipped'][:90]}"
    if "error" in res:
        return f"{setting:<8}{name:<27}  FAILED: {res['error'][:80]}"
    iqr = res.get("ms_per_chunk_step_stats", {}).get("iqr_ms")
    vs_base, vs_sdpa, mfu = res.get("speedup_vs_baseline"), res.get("speedup_vs_rolling_sdpa"), res.get("mfu")
    ok = "n/a" if res["agrees"] is None else "yes" if res["agrees"] else "NO"
    return (f"{setting:<8}{name:<27}{res['ms_per_chunk_step']:>10.2f}{('-' if iqr is None else f'{iqr:.3g}'):>8}"
            f"{('-' if vs_base is None else f'{vs_base:.3f}x'):>9} {res.get('baseline', '-'):<21}"
            f"{('-' if vs_sdpa is None else f'{vs_sdpa:.2f}x'):>8}{('-' if mfu is None else f'{100 * mfu:.1f}%'):>7}"
            f"{res['latent_frames_per_s']:>9.2f}{res.get('video_frames_per_s', float('nan')):>9.1f}"
            f"{_mib(res['peak_memory_bytes']):>10}{_mib(res['kv_peak_bytes']):>10}"
            f"{res['rel_err_vs_library']:>9.1e}  {ok}")


def print_table(payload: dict[str, Any]) -> None:
    head = (f"{'cfg':<8}{'variant':<27}{'ms/step':>10}{'IQR':>8}{'vs base':>9} {'baseline':<21}{'vs sdpa':>8}"
            f"{'MFU':>7}{'lat fr/s':>9}{'vid fr/s':>9}{'peak MiB':>10}{'KV MiB':>10}{'rel err':>9}  ok")
    for view in ("primary", "last_step"):
        rows = [(s, r if view == "primary" else r.get("last_step")) for s, r in payload["results"].items()]
        rows = [(s, r) for s, r in rows if r is not None]
        if not rows:
            continue
        print(f"commit forward: {rows[0][1]['commit_forward']} ({rows[0][1]['forwards_per_chunk_step']} forwards "
              f"per chunk step)")
        print(head)
        print("-" * len(head))
        for setting, r in rows:
            for name, res in r["variants"].items():
                print(_row(setting, name, res))
    t = payload["targets"]
    print(f"baselines (eager rows / compiled rows): {t['baselines']}")
    for key, per in t["speedups"].items():
        print(f"  {key}: " + "; ".join(f"{s} {_ratio_text(r)}" for s, r in per.items()))
    speedups = {s: None if v is None else round(v, 2) for s, v in t["library_speedup"].items()}
    print(
        f"library speedup vs rolling_sdpa: {speedups} (target >= {t['library_speedup_vs_rolling_sdpa']}); "
        f"library KV peak per branch == (sinks + window + pending) chunks: {t['kv_peak_equals_target']} "
        f"({_mib(t['kv_peak_bytes_per_branch_target'])} MiB); outputs agree: {payload['agree']}"
    )
    for setting, per in t.get("same_method_outputs", {}).items():
        for name, c in per.items():
            print(f"  {setting} {name} vs {c['reference']} (the same method): outputs rel err {c['rel_err']:.1e} "
                  f"({'agree' if c['agrees'] else 'DISAGREE'}{'' if c['counted'] else ', not counted'}; rows: "
                  f"{c['rows'].split(':')[0]})")
    for setting, per in t.get("last_step_vs_clean", {}).items():
        for name, c in per.items():
            print(f"  {setting} {name}: last_step vs clean {c['ratio']:.3f}x (IQR {c['iqr'][0]:.3f}..{c['iqr'][1]:.3f}), "
                  f"latents rel err max {c['latent_rel_err_max']:.2e}, final {c['latent_rel_err_final']:.2e}")


def _step_spread(res: dict[str, Any]) -> tuple[float, float] | None:
    """p25 / p75 ms per chunk step: from the stats, else from the per-step samples (older results)."""
    return spread(res.get("ms_per_chunk_step_stats"), res.get("ms_per_chunk_step_all"))


def _baselines(r: Mapping[str, Any]) -> dict[str, str | None]:
    """A setting's baselines as recorded; older results (rolling_sdpa then): chosen from what they measured."""
    return dict(r.get("baselines") or select_baselines(n for n, res in r["variants"].items() if measured(res)))


def _draw_view(ax: Any, views: Mapping[str, Mapping[str, Any]], names: Sequence[str],
               vs_clean: Mapping[str, Mapping[str, Any]] | None = None) -> bool:
    """One commit setting's bars on ``ax``: per CFG setting a group of bars (ms per chunk step, IQR error
    bars; labels: the median and the speed-up vs the row's baseline). The baselines are the reference:
    their bars hatched, their medians drawn across the group (dashed: eager, dotted: compiled).
    ``vs_clean`` (the ``last_step`` panel): per CFG setting the ``commit_forward_comparison``, whose
    speed-up over the same variant's clean run is added to its label."""
    width = 0.8 / len(names)
    has_spread, top = False, 0.0
    for i, name in enumerate(names):
        xs, ms, bounds, labels, is_base = [], [], [], [], []
        for j, (setting, r) in enumerate(views.items()):
            res, base = r["variants"].get(name), _baselines(r)
            if not measured(res):
                continue
            ref = baseline_of(name, base)
            xs.append(j + i * width)
            ms.append(res["ms_per_chunk_step"])
            bounds.append(_step_spread(res))
            ms_label = f"{ms[-1]:.0f}" if ms[-1] >= 100 else f"{ms[-1]:.3g}"
            if name in base.values():
                labels.append(ms_label + "\nbaseline")
            else:
                ratio = speedup(r["variants"][ref], res)["ratio"] if measured(r["variants"].get(ref)) else None
                labels.append(ms_label + ("" if ratio is None else f"\n{ratio:.2f}x"))
            cmp = (vs_clean or {}).get(setting, {}).get(name)
            if cmp is not None:
                labels[-1] += f"\n{cmp['speedup_last_step_vs_clean']:.2f}x clean"
            is_base.append(name in base.values())
            top = max(top, ms[-1], bounds[-1][1] if bounds[-1] else 0.0)
        has_spread |= any(b is not None for b in bounds)
        container = bars(ax, xs, ms, width, bounds=bounds, labels=labels, fontsize=7, label=name)
        for patch, base_bar in zip(container.patches, is_base):
            if base_bar:
                patch.set_hatch("//")
                patch.set_edgecolor("black")
    for j, r in enumerate(views.values()):
        for kind, style in (("eager", "--"), ("compiled", ":")):
            ref = _baselines(r)[kind]
            if measured(r["variants"].get(ref)) and (kind == "eager" or ref != _baselines(r)["eager"]):
                ax.hlines(r["variants"][ref]["ms_per_chunk_step"], j - width / 2, j + 0.8 - width / 2,
                          colors="black", linestyles=style, linewidth=0.9, zorder=4)
    ticks = [f"CFG {s.removeprefix('cfg_')} ({r['streams']} stream{'s' if r['streams'] != 1 else ''})"
             for s, r in views.items()]
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(views))], ticks)
    ax.set_ylim(0, top * 1.22)  # room for the two-line labels above the tallest bar
    ax.set_ylabel("ms per chunk step (lower is better)")
    return has_spread


def plot(payload: dict[str, Any], path: Path) -> Path | None:
    """ms per chunk step per variant and CFG setting, IQR error bars, the baselines as the reference
    (hatched bars, lines across each group); with ``--commit-forward both`` a second panel for ``last_step``."""
    plt = pyplot()
    if plt is None:
        return None
    results = payload["results"]
    panels = {"primary": results}
    if any("last_step" in r for r in results.values()):
        panels["last_step"] = {s: {"streams": r["streams"], **r["last_step"]} for s, r in results.items()
                               if "last_step" in r}
    names_per_panel = []
    for views in panels.values():
        names: list[str] = []
        for r in views.values():
            names += [n for n, res in r["variants"].items() if measured(res) and n not in names]
        names_per_panel.append(names)
    widest = max(len(n) for n in names_per_panel) * len(results)
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(7.0, 2.2 + 1.1 * widest), 5.2 * len(panels)),
                             layout="constrained", squeeze=False)
    cfg = payload["config"]
    has_spread = False
    for ax, (panel, views), names in zip(axes[:, 0], panels.items(), names_per_panel):
        vs_clean = {s: r.get("commit_forward_comparison", {}) for s, r in results.items()} if panel == "last_step" else None
        has_spread |= _draw_view(ax, views, names, vs_clean)
        mode = next(iter(views.values())).get("commit_forward", cfg.get("commit_forward", "clean"))
        forwards = "4 denoising + 1 commit forward" if mode == "clean" else "4 forwards, the last one commits"
        ax.set_title(f"commit forward: {mode} ({forwards})", fontsize=9, loc="left")
        if len(panels) == 1:
            legend_below(fig, ax, ncol=min(len(names), 4))
        else:  # one legend per panel: their variants differ (last_step runs the library and FA3 rows only)
            ax.legend(fontsize=7, ncol=min(len(names), 4), loc="upper right")
    note = "error bars: IQR over the timed steps" if has_spread else "medians (no spread recorded)"
    title = (f"{cfg['preset']}: one chunk step; sink {cfg['sink_chunks']} + window {cfg['window_chunks']} chunks; "
             f"{cfg['dtype']}, {payload.get('env', {}).get('gpu', cfg['device'])}\n"
             f"bar labels: median ms, speed-up vs the baseline (hatched; line across the group: dashed eager, "
             f"dotted compiled baseline); {note}")
    fig.suptitle(wrap(title, fig, 9), fontsize=9)
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
