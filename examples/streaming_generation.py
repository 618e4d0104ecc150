"""Streaming video generation, Self-Forcing style, over ``ardiff_modules``' paged sink + window KV cache.

A Wan2.1-style causal DiT (``ardiff_modules.models.wan_causal_dit``, random weights) generates a latent video chunk
by chunk. Per chunk:

1. start from Gaussian noise and take ``--steps`` Euler steps of a flow-matching sampler over the
   timesteps ``linspace(1000, 0, steps + 1)`` (``[1000, 750, 500, 250]`` for 4 steps). Each step is ONE
   forward of both classifier-free-guidance branches batched together::

       with state.prepare_forward(("cond", "uncond"), seq_len, commit_current=False) as fwd:
           v = model(x.repeat(2, ...), t, fwd.layers)        # [2, F, C, H, W]
       v = v_uncond + cfg_scale * (v_cond - v_uncond)
       x = x + (sigma_next - sigma) * v

   Denoising forwards write the chunk's K/V into the same pending pages every step and never touch
   history;
2. one clean forward at timestep 0 with ``commit_current=True``: leaving the ``with`` block commits the
   chunk's K/V of both branches into their history (sink + sliding window; older chunks are evicted).

``--commit-forward`` picks which forward commits: ``clean`` (default, the loop above: ``steps + 1``
forwards per chunk) or ``last_step`` (vllm-omni #7816: the last denoising forward is run with
``commit_current=True`` and there is no clean forward, ``steps`` forwards per chunk). With
``last_step`` the history keeps the K/V of that last denoising forward (its input is still noisy), so
later chunks attend to a different history than with ``clean``: one forward fewer per chunk, slightly
different frames (``python -m benchmarks.end_to_end --commit-forward both`` measures both, and the
latents' difference chunk by chunk). A re-cache (``--recache-on-switch``) still rebuilds from the
chunks' clean latents at t=0.

The "text" cross-attention cache is populated per branch (random "prompt embeddings" for ``cond``, a
zero negative prompt for ``uncond``) with :func:`ardiff_modules.populate_cross_attention`.
``--switch-at K`` switches the prompt before chunk K (``state.clear_cross_attention()`` + populate; the
self-attention history is kept, as in LongLive's prompt switching); ``--reset-at K`` restarts the
stream before chunk K (``state.reset()`` + populate). At the end the session is closed and every page
of the pool must be free again.

Commands
--------
::

    python examples/streaming_generation.py                         # tiny preset, CPU, 8 chunks (a few seconds)
    python examples/streaming_generation.py --no-plot               # the same without the figure
    python examples/streaming_generation.py --switch-at 4 --reset-at 6 --out outputs/stream.png
    python examples/streaming_generation.py --commit-forward last_step   # the last denoising forward commits
    python examples/streaming_generation.py --compile               # the torch.compile'd generation script
    python examples/compiled_generation.py                          # the same, as a separate entry point
    python examples/streaming_generation.py --preset wan2.1-1.3b --device cuda --chunks 8
    python examples/streaming_generation.py --preset wan2.1-1.3b --device cuda --cuda-graph

``--compile`` wraps the model step in ``torch.compile(fullgraph=True)`` with a
``torch._dynamo.testing.CompileCounterWithBackend("inductor")`` and prints the compile time, the
median step time after the first and the number of compiled frames. The library's contract is ONE frame for the
whole rollout (window filling and evicting, commit and denoising forwards, prompt switch, reset); the
script exits with status 1 if anything recompiled. ``--cuda-graph`` (CUDA + FlashInfer) prepares every
forward with ``static=True`` and replays one captured graph per (streams, seq_len) through
:class:`ardiff_modules.graphs.CUDAGraphStep`; it combines with ``--compile``.

Outputs (beside ``--out``, default ``outputs/``):

* ``stream.png`` (``--out``): the first three latent channels of each generated frame as RGB (normalised
  over the whole video), frames side by side, a white bar between chunks, 8 chunks per row. With random
  weights it is a smoke picture, not a video: load real weights as ``ardiff_modules.models.wan_causal_dit``
  explains.
* ``streaming_generation.png`` (``--figure``; ``--no-plot`` skips it): the library at work over this run,
  drawn by ``_report_figure.py`` from the data below: (a) KV memory while each chunk is denoised, per
  branch (committed history + pending chunk) and the pool's total, against a contiguous rolling buffer
  of the same visible context (sink + window + current chunk per layer and branch, allocated up front);
  (b) which key chunks each chunk's forward attended to (sinks, window, itself; evicted chunks gray),
  from the forwards' ``to_dense()`` / ``key_positions()`` (from the branches' history spans at shapes where
  the dense mask would be hundreds of MB); (c) wall ms per chunk, warm-up and window filling marked; (d)
  the latent strip.
* ``streaming_generation.json`` (``--json``): the printed summary plus the per-chunk record
  (:class:`StreamRecorder`: pages per branch from ``state.branch_pages``, pool use from ``cache.stats()``,
  visible key chunks, ms per chunk) and the geometry the figure uses.

Requirements: with ``--no-plot`` only torch and ``ardiff_modules`` (the strip PNG is written with the standard
library), so this file runs on its own beside an installed wheel; the figure also needs matplotlib (the
``examples`` extra) and ``_report_figure.py`` beside this file. The wheel holds no examples: take the
``examples/`` folder of the sdist or the repository.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import statistics
import struct
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ardiff_modules import ForwardContext, KVCache, KVState, RecacheRule, populate_cross_attention
from ardiff_modules.models.wan_causal_dit import (
    BRANCHES,
    PRESETS,
    WanConfig,
    build_model,
    default_dtype,
    kv_pool_pages,
    make_kv_spec,
    torch_threads,
)
from ardiff_modules.pool import bytes_per_page

#: The folder of this script: ``_report_figure.py`` (the figure's drawing, ``--no-plot`` skips it) lives beside it.
HERE = Path(__file__).resolve().parent

#: ``--recache-rule``: the library's historical re-cache and LongLive 1.x's two (see ``RecacheRule``).
RECACHE_RULES = {
    "library": RecacheRule(),
    "longlive": RecacheRule.longlive(global_sink=True),
    "longlive-moving-sink": RecacheRule.longlive(global_sink=False),
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Streaming (chunk-by-chunk) generation with a causal Wan-style DiT over a paged KV cache.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model / cache geometry")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--chunks", type=int, default=8, help="chunks to generate (frames_per_chunk latent frames each)")
    p.add_argument("--steps", type=int, default=4,
                   help="denoising forwards per chunk (plus the clean committing forward with --commit-forward clean)")
    p.add_argument(
        "--commit-forward", choices=("clean", "last_step"), default="clean",
        help="which forward commits a chunk's K/V: 'clean' (one extra forward at t=0 on the denoised latent, "
        "steps + 1 forwards per chunk) or 'last_step' (the last denoising forward commits: steps forwards per chunk)",
    )
    p.add_argument("--cfg-scale", type=float, default=5.0, help="classifier-free guidance scale")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, the prompts and the noise")
    p.add_argument("--switch-at", type=int, default=None, metavar="K", help="switch the prompt before chunk K")
    p.add_argument("--reset-at", type=int, default=None, metavar="K", help="reset the session before chunk K")
    p.add_argument(
        "--recache-on-switch", action="store_true",
        help="at --switch-at, rebuild the history's K/V under the new prompt (one transactional forward over "
        "the rebuilt chunks' clean latents, under --recache-rule)",
    )
    p.add_argument(
        "--recache-rule", choices=sorted(RECACHE_RULES), default="library",
        help="which chunks the re-cache rebuilds and how they see each other: 'library' (the window, block-causal, "
        "the sink kept), 'longlive' (LongLive 1.x, global_sink=True: window + the chunk about to leave, "
        "bidirectional), 'longlive-moving-sink' (global_sink=False: the sink moves to the buffer's head)",
    )
    p.add_argument(
        "--relative-sinks", action="store_true",
        help="attend the sink chunk as if it sat just before the oldest window chunk (KVCacheSpec.relative_sinks): "
        "the RoPE distance to the sink stays bounded however long the stream",
    )
    p.add_argument(
        "--report-every", type=int, default=0, metavar="N",
        help="print the pages in use and the ms per chunk every N chunks (long runs: both stay flat)",
    )
    p.add_argument("--out", type=Path, default=Path("outputs/stream.png"), help="PNG strip of the latent frames")
    p.add_argument(
        "--figure", type=Path, default=None,
        help="the run's picture: KV memory, visibility, time per chunk, latent strip (default: "
        "streaming_generation.png beside --out)",
    )
    p.add_argument(
        "--json", type=Path, default=None,
        help="the summary and the per-chunk data the figure draws (default: streaming_generation.json beside --out)",
    )
    p.add_argument("--no-plot", action="store_true", help="skip the figure (the strip and the JSON are still written)")
    p.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) the model step; fail on recompiles")
    p.add_argument("--cuda-graph", action="store_true", help="capture the step once and replay it (CUDA + FlashInfer)")
    p.add_argument(
        "--threads", type=int, default=None,
        help="torch intra-op CPU threads for this run (default: 1 for the tiny preset on CPU, where its small "
        "ops only lose to threading overhead, else torch's default)",
    )
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.add_argument("--allow-big-cpu", action="store_true", help="allow a large preset on CPU (tens of GiB)")
    # Hidden: the compile backend ("eager" / "aot_eager" trace with dynamo only; the tests use it to stay fast).
    p.add_argument("--compile-backend", default="inductor", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.chunks < 1:
        p.error(f"--chunks: expected >= 1, got {args.chunks}")
    if args.steps < 1:
        p.error(f"--steps: expected >= 1, got {args.steps}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads: expected >= 1, got {args.threads}")
    for flag in ("switch_at", "reset_at"):
        k = getattr(args, flag)
        if k is not None and not 0 < k < args.chunks:
            p.error(f"--{flag.replace('_', '-')}: expected a chunk index in 1..{args.chunks - 1}, got {k}")
    check_device_and_preset(p, args)
    if not args.no_plot:
        check_figure_needs(p)
    if args.cuda_graph and args.device != "cuda":
        p.error("--cuda-graph: expected --device cuda (CUDA graphs need a GPU)")
    if args.recache_on_switch and args.switch_at is None:
        p.error("--recache-on-switch: expected --switch-at K too (the re-cache follows the prompt switch)")
    if args.report_every < 0:
        p.error(f"--report-every: expected >= 0, got {args.report_every}")
    if args.figure is None:
        args.figure = args.out.parent / "streaming_generation.png"
    if args.json is None:
        args.json = args.out.parent / "streaming_generation.json"
    if len({args.out.resolve(), args.figure.resolve(), args.json.resolve()}) != 3:
        p.error(
            f"--out, --figure and --json: expected three different files, got {args.out}, {args.figure}, {args.json}"
        )
    return args


def check_device_and_preset(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--device cuda`` needs CUDA; a preset other than tiny needs the GPU unless ``--allow-big-cpu``."""
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available in this torch build / machine")
    if args.preset != "tiny" and args.device == "cpu" and not args.allow_big_cpu:
        spec = make_kv_spec(WanConfig.preset(args.preset), "cpu")
        gib = kv_pool_pages(spec) * bytes_per_page(spec) / 2**30
        p.error(
            f"--preset {args.preset} on CPU: the float32 KV pool alone needs {gib:.1f} GiB; expected --device cuda "
            "(or pass --allow-big-cpu)"
        )


def check_figure_needs(p: argparse.ArgumentParser) -> None:
    """The figure needs ``_report_figure.py`` beside this script and matplotlib: say so before the run, not after.

    ``--no-plot`` needs neither (nor numpy or PIL): the script then runs with torch and ``ardiff_modules`` alone.
    """
    if not (HERE / "_report_figure.py").is_file():
        p.error(
            f"the figure: expected _report_figure.py beside this script in {HERE} (it comes with the examples/ "
            "folder of the sdist or the repository), got none; or pass --no-plot"
        )
    missing = [name for name in ("matplotlib", "numpy") if importlib.util.find_spec(name) is None]
    if missing:
        p.error(
            f"the figure: expected {' and '.join(missing)} installed (pip install 'ardiff_modules[examples]'), "
            "got none; or pass --no-plot"
        )


def draw_figure(summary: dict[str, Any], strip: torch.Tensor, path: Path) -> None:
    """Draw the run's picture with ``_report_figure.draw_report`` (imported here: matplotlib is optional)."""
    if str(HERE) not in sys.path:  # run as a script, its folder is already there; imported, maybe not
        sys.path.insert(0, str(HERE))
    from _report_figure import draw_report

    draw_report(summary, strip.numpy(), path)


# ------------------------------------------------------------------------------------ helpers
class Prompts:
    """Random stand-ins for text-encoder states (seeded), and publishing them into a session."""

    def __init__(self, config: WanConfig, seed: int, model: torch.nn.Module) -> None:
        g = torch.Generator().manual_seed(seed + 1)
        self.model = model
        self.prompts = [torch.randn(config.text_tokens, config.text_dim, generator=g) for _ in range(2)]
        self.negative = torch.zeros(config.text_tokens, config.text_dim)  # "uncond": an empty prompt
        self.current = 0

    @torch.no_grad()
    def publish(self, state: KVState, branches: Sequence[str] = BRANCHES) -> None:
        """Populate the "text" cache of ``branches``: the current prompt (cond), the negative (uncond)."""
        device = next(self.model.parameters()).device
        crosses = [block.cross for block in self.model.blocks]
        texts = {"cond": self.prompts[self.current], "uncond": self.negative}
        for branch in branches:
            populate_cross_attention(state, branch, crosses, self.model.embed_text(texts[branch].to(device)))


def save_strip(
    frames: torch.Tensor, frames_per_chunk: int, path: Path, chunks_per_row: int = 8
) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """Write latent frames ``[T, C, H, W]`` as an RGB PNG (channels 0..2), frames side by side.

    Returns :func:`build_strip`'s image and chunk spans (see it for the layout).
    """
    image, spans = build_strip(frames, frames_per_chunk, chunks_per_row)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_png(image, path)
    return image, spans


def write_png(image: torch.Tensor, path: Path) -> None:
    """Write an RGB image ``[H, W, 3]`` with values in 0..1 as an 8-bit PNG, with the standard library alone.

    NOTE: no matplotlib, PIL or numpy (``Tensor.numpy()`` needs numpy): ``--no-plot`` runs where only torch and
    ``ardiff_modules`` are installed. The strip is small (tens of KB), so ``tolist()`` per run is cheap.
    """
    pixels = (image.float().clamp(0, 1) * 255).round().to(torch.uint8)
    height, width, _ = pixels.shape
    scanlines = b"".join(b"\x00" + bytes(row) for row in pixels.reshape(height, width * 3).tolist())  # filter 0

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, RGB, deflate, no interlace
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(scanlines)) + chunk(b"IEND", b"")
    )


def build_strip(
    frames: torch.Tensor, frames_per_chunk: int, chunks_per_row: int = 8
) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """Latent frames ``[T, C, H, W]`` as an RGB image ``[H', W', 3]`` in 0..1 (channels 0..2), frames side by side.

    Channels are normalised over the whole video (1st..99th percentile), frames upscaled
    (nearest) to at least 64 pixels high, a gray line separates frames and a white bar chunks, ``chunks_per_row`` per row.
    Also returns ``(row, first column, last column + 1)`` of each chunk in the image.
    """
    rgb = frames[:, :3].float()
    if rgb.shape[1] < 3:
        rgb = torch.cat([rgb, rgb[:, :1].expand(-1, 3 - rgb.shape[1], -1, -1)], dim=1)
    flat = rgb.transpose(0, 1).reshape(3, -1)
    lo = flat.quantile(0.01, dim=1)[None, :, None, None]
    hi = flat.quantile(0.99, dim=1)[None, :, None, None]
    rgb = ((rgb - lo) / (hi - lo).clamp_min(1e-6)).clamp(0, 1)
    scale = max(1, math.ceil(64 / rgb.shape[-2]))
    rgb = rgb.repeat_interleave(scale, dim=-2).repeat_interleave(scale, dim=-1)  # [T, 3, H', W']
    chunks = list(rgb.split(frames_per_chunk))
    height, bar = rgb.shape[-2], max(2, scale // 2)
    white = torch.ones(3, height, bar)
    gray = torch.full((3, height, 1), 0.5)  # between frames of one chunk
    rows = []
    spans: list[tuple[int, int, int]] = []
    for r in range(0, len(chunks), chunks_per_row):
        pieces: list[torch.Tensor] = []
        x = 0
        for chunk in chunks[r : r + chunks_per_row]:
            if pieces:
                pieces.append(white)
                x += bar
            start = x
            for i, frame in enumerate(chunk.unbind(0)):
                if i:
                    pieces.append(gray)
                    x += 1
                pieces.append(frame)
                x += frame.shape[-1]
            spans.append((r // chunks_per_row, start, x))
        rows.append(torch.cat(pieces, dim=-1))
    width = max(row.shape[-1] for row in rows)
    rows = [torch.nn.functional.pad(row, (0, width - row.shape[-1]), value=1.0) for row in rows]
    spaced: list[torch.Tensor] = []
    for row in rows:
        if spaced:
            spaced.append(torch.ones(3, bar, width))
        spaced.append(row)
    return torch.cat(spaced, dim=-2).permute(1, 2, 0).contiguous(), spans


class StreamRecorder:
    """Per-chunk measurements of the run, read through the library's public API only.

    For each chunk, right after its last denoising forward (whose pending pages the commit forward reuses,
    so this is what the pool holds while the chunk is denoised and committed; with ``--commit-forward
    last_step``, inside the committing forward before it commits):

    * ``pages``: per branch, ``state.branch_pages(branch)``'s resident (committed, visible) and pending pages,
      the contiguous-extent reservation, and ``cache.stats().sessions`` (every page the branch references);
    * ``pool_pages_used``: ``cache.stats().pages_used`` (distinct pages in use in the whole pool);
    * ``visible_key_chunks``: per branch, the chunks whose keys that forward attended to: the keys that
      ``ForwardContext.to_dense()`` marks visible for the chunk's queries, mapped to chunks by
      ``key_positions()`` (absolute positions, restarting after a reset, hence ``stream_start_chunk``);
      above ``DENSE_LIMIT`` mask elements from ``state.branch_pages(branch).history_spans()`` + the pending chunk
      (``visibility_source`` says which);
    * ``committed_before``: ``state.committed_chunks(branch)`` when the chunk started;
    * ``chunk_ms``: wall time of the chunk's loop body (prompt switch / reset included), this recording excluded.

    Plus ``pages_after_commit`` / ``pool_pages_after_commit`` once the chunk is committed.
    """

    # Above this many mask elements (to_dense() is [streams, seq_len, keys]: ~350 MB at Wan2.1 shapes, and
    # key_positions() builds it too), visibility is read from the branches' history spans instead.
    DENSE_LIMIT = 1 << 24

    def __init__(self, cache: KVCache, state: KVState, branches: Sequence[str], chunk_size: int) -> None:
        self.cache, self.state, self.branches, self.chunk_size = cache, state, tuple(branches), chunk_size
        self.rows: list[dict[str, Any]] = []
        self.overhead_s = 0.0  # time spent recording (excluded from the run's timings)
        self._chunk_overhead = 0.0
        self._chunk_start = 0.0

    def begin_chunk(self, k: int) -> None:
        start = time.perf_counter()
        committed = {b: self.state.committed_chunks(b) for b in self.branches}
        start_chunk = k - committed[self.branches[0]]  # the chunk the stream (re)started at
        self.rows.append({"chunk": k, "committed_before": committed, "stream_start_chunk": start_chunk})
        self._chunk_overhead = time.perf_counter() - start
        self._chunk_start = start

    def during_chunk(self, fwd: ForwardContext) -> None:
        """After a denoising forward of the current chunk (the last one's snapshot is kept)."""
        start = time.perf_counter()
        row = self.rows[-1]
        stats = self.cache.stats()
        referenced = stats.sessions.get(self.state.session_id, {})
        row["pages"] = {}
        for b in self.branches:
            history = self.state.branch_pages(b)
            row["pages"][b] = {
                "resident": len(history.history_pages()),
                "pending": len(history.pending_pages()),
                "extent_reserved": len(history.extent),
                "referenced": referenced.get(b, 0),
            }
        row["pool_pages_used"] = stats.pages_used
        row["visible_key_chunks"], row["visibility_source"] = self._visibility(fwd, row["stream_start_chunk"])
        self._chunk_overhead += time.perf_counter() - start

    def _visibility(self, fwd: ForwardContext, stream_start: int) -> tuple[dict[str, list[int]], str]:
        """Per branch, the (stream-numbered) chunks whose keys this one-chunk forward attended to."""
        spans = {b: self.state.branch_pages(b).history_spans() for b in self.branches}
        max_keys = max(sum(tokens for _, tokens in s) for s in spans.values()) + fwd.seq_len
        out: dict[str, list[int]] = {}
        if len(fwd.streams) * fwd.seq_len * max_keys > self.DENSE_LIMIT:  # large shapes: the history's spans
            for b in self.branches:
                starts = [start for start, _ in spans[b]] + [self.state.token_offset(b)]
                out[b] = sorted({stream_start + start // self.chunk_size for start in starts})
            return out, "history_spans"
        keys = fwd.key_positions()  # [streams, max_keys], absolute positions, -1 = padding
        dense = fwd.to_dense()  # [streams, seq_len, max_keys]: query i sees key j
        queries = fwd.positions.cpu()  # [streams, seq_len]
        for i, (_, branch) in enumerate(fwd.streams):
            if branch not in self.branches:
                continue
            query_chunks = (queries[i] // self.chunk_size).unique()
            if len(query_chunks) != 1:
                raise ValueError(f"expected one query chunk per forward, got {query_chunks.tolist()}")
            seen = dense[i].any(dim=0)
            out[branch] = [stream_start + c for c in (keys[i][seen] // self.chunk_size).unique().tolist()]
        return out, "to_dense"

    def end_chunk(self) -> None:
        start = time.perf_counter()
        row = self.rows[-1]
        stats = self.cache.stats()
        row["pages_after_commit"] = {b: len(self.state.branch_pages(b).history_pages()) for b in self.branches}
        row["pool_pages_after_commit"] = stats.pages_used
        self._chunk_overhead += time.perf_counter() - start
        row["chunk_ms"] = 1e3 * (time.perf_counter() - self._chunk_start - self._chunk_overhead)
        self.overhead_s += self._chunk_overhead


def _progress(iterable: range, enabled: bool) -> Any:
    if not enabled:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is an optional extra (pip install ardiff_modules[examples])
        return iterable
    return tqdm(iterable, desc="chunks", unit="chunk", dynamic_ncols=True)


# ------------------------------------------------------------------------------------ generation
def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Generate per the command line ``argv``; returns the summary (also printed).

    The torch thread count is restored on return (``--threads`` applies to this run only).
    """
    args = parse_args(argv)
    with torch_threads(args.threads, args.preset, args.device):
        return _generate(args)


def _generate(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    config = WanConfig.preset(args.preset)
    dtype = default_dtype(device)
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    # ---- model, cache, session
    t0 = time.perf_counter()
    model = build_model(config, seed=args.seed, device=device, dtype=dtype)
    spec = dataclasses.replace(
        make_kv_spec(config, device), relative_sinks=args.relative_sinks, recache=RECACHE_RULES[args.recache_rule]
    )
    # A re-cache holds the rebuilt chunks beside the old history until it commits: room for them per branch.
    rebuilt_chunks = spec.window_chunks + spec.recache.horizon(spec.sink_chunks)
    num_pages = kv_pool_pages(spec, slack_chunks=1 + (len(BRANCHES) * rebuilt_chunks if args.recache_on_switch else 0))
    cache = KVCache(spec, num_pages=num_pages, device=device)
    if args.cuda_graph and cache.backend.name != "flashinfer":
        raise SystemExit(
            f"--cuda-graph: expected the FlashInfer backend (static plans), got {cache.backend.name!r}; "
            "install flashinfer-python"
        )
    state = cache.open_session("stream")
    prompts = Prompts(config, args.seed, model)
    prompts.publish(state)
    setup_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {config.name}  {params / 1e6:.2f}M params  {config.num_layers} layers  dim {config.dim}  "
        f"{config.num_heads} heads  {config.tokens_per_frame} tokens/frame  {config.frames_per_chunk} frames/chunk  "
        f"({dtype}, {device}, {torch.get_num_threads()} CPU threads, random weights, seed {args.seed})"
    )
    print(
        f"cache: {num_pages} pages x {spec.page_size} tokens ({cache.stats().pool_bytes / 2**20:.1f} MiB), "
        f"sink {spec.sink_chunks} + window {spec.window_chunks} chunks, branches {spec.branches}, "
        f"backend {cache.backend.name}"
    )

    # ---- the model step: eager, compiled and/or CUDA-graph replayed
    step_fn: Callable[..., torch.Tensor] = model
    counter = None
    if args.compile:
        from torch._dynamo.testing import CompileCounterWithBackend

        counter = CompileCounterWithBackend(args.compile_backend)
        step_fn = torch.compile(model, backend=counter, fullgraph=True)
    graph_step = None
    if args.cuda_graph:
        from ardiff_modules.graphs import CUDAGraphStep

        graph_step = CUDAGraphStep(step_fn)

    streams = len(BRANCHES)
    seq_len = config.chunk_size
    forward_times: list[float] = []
    recorder = StreamRecorder(cache, state, BRANCHES, seq_len)

    last_step = args.commit_forward == "last_step"

    def forward(x: torch.Tensor, t: float, commit: bool) -> torch.Tensor:
        """One batched CFG forward of both branches; returns the flow prediction of each [2, F, C, H, W]."""
        xs = x.to(device=device, dtype=dtype).repeat(streams, 1, 1, 1, 1)
        ts = torch.full((streams,), float(t), device=device)
        sync()
        start = time.perf_counter()
        recording = 0.0
        with torch.no_grad(), state.prepare_forward(BRANCHES, seq_len, commit_current=commit, static=args.cuda_graph) as fwd:
            out = graph_step(fwd, xs, ts) if graph_step is not None else step_fn(xs, ts, fwd.layers)
            if commit and last_step:  # NOTE: the chunk's last forward commits: snapshot it before the commit
                sync()
                mark = time.perf_counter()
                recorder.during_chunk(fwd)
                recording = time.perf_counter() - mark
        sync()
        forward_times.append(time.perf_counter() - start - recording)
        if not commit:  # pending pages are kept for the next forward; fwd still describes this one
            recorder.during_chunk(fwd)
        return out.float()

    timesteps = torch.linspace(1000.0, 0.0, args.steps + 1).tolist()
    noise = torch.Generator().manual_seed(args.seed + 2)
    shape = (1, config.frames_per_chunk, config.in_channels, config.latent_height, config.latent_width)
    frames: list[torch.Tensor] = []
    events: list[str] = []
    events_at: list[tuple[int, str]] = []  # (chunk, short label) for the figure

    clean: dict[int, torch.Tensor] = {}  # commit index -> clean latent [1, F, C, H, W] (--recache-on-switch)
    reports: list[dict[str, Any]] = []

    def recache() -> float:
        """Rebuild the history's K/V under the new prompt from its chunks' clean latents; returns seconds."""
        if not state.committed_chunks(BRANCHES[0]):
            return 0.0
        indices = state.recache_chunk_indices(BRANCHES[0])  # what the spec's rule rebuilds, in commit order
        xs = torch.cat([clean[i] for i in indices], dim=1).to(device=device, dtype=dtype).repeat(streams, 1, 1, 1, 1)
        ts = torch.zeros((streams,), device=device)
        sync()
        start = time.perf_counter()
        with torch.no_grad(), state.prepare_recache(BRANCHES) as fwd:  # the spec's rule; commits on success
            model(xs, ts, fwd.layers)  # eager: a multi-chunk shape the compiled step has not seen
        sync()
        return time.perf_counter() - start

    sync()
    t_start = time.perf_counter()
    t_report, pages_report = t_start, []
    for k in _progress(range(args.chunks), not args.no_progress):
        recorder.begin_chunk(k)
        if k == args.switch_at:
            prompts.current = 1
            state.clear_cross_attention()  # prompt switch: history kept, cross caches replaced
            prompts.publish(state)
            if args.recache_on_switch:
                seconds = recache()
                events.append(
                    f"prompt switch before chunk {k}, history re-cached under the new prompt in {1e3 * seconds:.1f} ms "
                    f"(rule {args.recache_rule}: chunks {list(state.recache_chunk_indices('cond'))})"
                )
            else:
                events.append(f"prompt switch before chunk {k} (history kept, offset {state.token_offset('cond')})")
            events_at.append((k, "prompt switch"))
        if k == args.reset_at:
            state.reset()  # drops pages and cross caches, offsets restart at 0
            prompts.publish(state)
            events.append(f"reset before chunk {k}")
            events_at.append((k, "reset"))
            recorder.rows[-1]["committed_before"] = {b: state.committed_chunks(b) for b in BRANCHES}
            recorder.rows[-1]["stream_start_chunk"] = k
        x = torch.randn(shape, generator=noise).to(device)
        for i, (t, t_next) in enumerate(zip(timesteps[:-1], timesteps[1:])):
            v = forward(x, t, commit=last_step and i == args.steps - 1)  # last_step: this forward's K/V -> history
            v = v[1:2] + args.cfg_scale * (v[0:1] - v[1:2])
            x = x + (t_next - t) / 1000.0 * v
        if not last_step:
            forward(x, 0.0, commit=True)  # clean forward at t=0: its K/V become history
        frames.append(x[0].cpu())
        recorder.end_chunk()
        if args.recache_on_switch:  # the clean latents a re-cache may need: resident chunks and the rule's horizon
            committed = state.committed_chunks(BRANCHES[0])
            clean[committed - 1] = x.cpu()
            keep = set(state.history_chunk_indices(BRANCHES[0]))
            keep |= set(range(committed - rebuilt_chunks - spec.sink_chunks - 1, committed))
            for i in [i for i in clean if i not in keep]:
                del clean[i]
        pages_report.append(cache.stats().pages_used)
        if args.report_every and (k + 1) % args.report_every == 0:
            now = time.perf_counter()
            row = {"chunk": k + 1, "pages_used": max(pages_report), "ms_per_chunk": 1e3 * (now - t_report) / len(pages_report)}
            reports.append(row)
            print(f"chunk {row['chunk']:>6}: {row['pages_used']} pages in use (max over the last "
                  f"{len(pages_report)} chunks), {row['ms_per_chunk']:.1f} ms per chunk", flush=True)
            t_report, pages_report = now, []
    sync()
    elapsed = time.perf_counter() - t_start - recorder.overhead_s  # the generation's time, recording excluded

    # ---- summary
    stats = cache.stats()
    summary: dict[str, Any] = {
        "preset": config.name,
        "device": str(device),
        "chunks": args.chunks,
        "frames": args.chunks * config.frames_per_chunk,
        "forwards": len(forward_times),
        "commit_forward": args.commit_forward,
        "forwards_per_chunk": args.steps + (0 if last_step else 1),
        "setup_s": setup_s,
        "seconds": elapsed,
        "chunks_per_s": args.chunks / elapsed,
        "frames_per_s": args.chunks * config.frames_per_chunk / elapsed,
        "first_step_s": forward_times[0],
        "step_ms": 1e3 * statistics.median(forward_times[1:] or forward_times),
        "num_pages": stats.num_pages,
        "pages_used": stats.pages_used,
        "peak_pages": stats.peak_pages_used,
        "session_pages": stats.sessions.get(state.session_id, {}),
        "token_offset": {b: state.token_offset(b) for b in BRANCHES},
        "committed_chunks": {b: state.committed_chunks(b) for b in BRANCHES},
        "events": events,
        "compiled_frames": counter.frame_count if counter is not None else None,
        "recompiles": counter.frame_count - 1 if counter is not None else None,
        "cuda_graphs": graph_step.num_graphs if graph_step is not None else None,
        "reports": reports,
        "relative_sinks": spec.relative_sinks,
        # Per chunk, the clean latent's norm: a cheap fingerprint of what was generated.
        "chunk_norms": [float(f.norm()) for f in frames],
    }
    state.close()
    after = cache.stats()
    summary["pages_used_after_close"] = after.pages_used
    summary["pages_free_after_close"] = after.pages_free
    video = torch.stack(frames).flatten(0, 1)  # [T, C, H, W]
    strip, strip_spans = save_strip(video, config.frames_per_chunk, args.out)
    summary["png"] = str(args.out)
    summary["latent_shape"] = tuple(video.shape)
    summary["steps"] = args.steps
    summary["events_at"] = events_at
    # The figure's data: the spec's geometry and the per-chunk record of this run.
    summary["geometry"] = {
        "branches": list(BRANCHES),
        "num_layers": spec.num_layers,
        "chunk_size": spec.chunk_size,
        "page_size": spec.page_size,
        "pages_per_chunk": spec.pages_per_chunk,
        "frames_per_chunk": config.frames_per_chunk,
        "sink_chunks": spec.sink_chunks,
        "window_chunks": spec.window_chunks,
        "bytes_per_page": stats.bytes_per_page,
        # A contiguous rolling buffer (Self-Forcing style) holding the same visible context: per layer and
        # branch sink + window + the current chunk, allocated up front.
        "rolling_buffer_tokens_per_branch": (spec.sink_chunks + spec.window_chunks + 1) * spec.chunk_size,
    }
    summary["warmup_chunks"] = [0]  # the first forward: lazy initialisation, compilation, graph capture
    summary["per_chunk"] = recorder.rows
    summary["recording_s"] = recorder.overhead_s
    summary["strip_chunk_spans"] = strip_spans
    if not args.no_plot:
        start = time.perf_counter()
        draw_figure(summary, strip, args.figure)
        summary["figure"] = str(args.figure)
        summary["figure_s"] = time.perf_counter() - start
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=1) + "\n")
    summary["json"] = str(args.json)

    for event in events:
        print(f"event: {event}")
    print(
        f"generated {summary['chunks']} chunks / {summary['frames']} latent frames in {elapsed:.2f} s: "
        f"{summary['chunks_per_s']:.2f} chunks/s, {summary['frames_per_s']:.2f} frames/s "
        f"({summary['forwards']} batched CFG forwards: {summary['forwards_per_chunk']} per chunk, "
        + (f"{args.steps} denoising, the last one committing)" if last_step
           else f"{args.steps} denoising + 1 clean committing forward)")
    )
    print(f"step (one forward of {streams} branches x {seq_len} tokens): {summary['step_ms']:.2f} ms median after the first (windows fill during the first sink + window chunks), "
          f"first {1e3 * summary['first_step_s']:.1f} ms")
    print(
        f"KV pages: {summary['pages_used']} in use at the end ({summary['session_pages']}), peak {summary['peak_pages']} of "
        f"{stats.num_pages}; token offset {summary['token_offset']}, committed chunks {summary['committed_chunks']}"
    )
    print(f"after close: {after.pages_used} pages in use, {after.pages_free} free")
    if counter is not None:
        print(
            f"torch.compile({args.compile_backend}, fullgraph=True): compile (first step) {summary['first_step_s']:.2f} s, "
            f"median step after it {summary['step_ms']:.2f} ms, compiled frames {counter.frame_count} "
            f"(recompiles: {summary['recompiles']})"
        )
    if graph_step is not None:
        print(f"CUDA graphs captured: {summary['cuda_graphs']}")  # counted before close() released them
    print(f"wrote {args.out} (latents {summary['latent_shape']})")
    if not args.no_plot:
        print(
            f"wrote {args.figure} (KV memory, visibility, time per chunk, latents; "
            f"drawn in {summary['figure_s']:.2f} s)"
        )
    print(f"wrote {args.json} (summary and per-chunk data)")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; exit status 1 if the compiled step recompiled or pages leaked."""
    summary = run(argv)
    status = 0
    if summary["recompiles"] not in (None, 0):
        print(f"ERROR: expected 1 compiled frame over the rollout, got {summary['compiled_frames']}", file=sys.stderr)
        status = 1
    if summary["pages_used_after_close"] != 0:
        print(f"ERROR: {summary['pages_used_after_close']} pages still in use after close", file=sys.stderr)
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
