"""Streaming video generation, Self-Forcing style, over ``ardiff_modules``' paged sink + window KV cache.

A Wan2.1-style causal DiT (``examples/wan_causal_dit.py``, random weights) generates a latent video chunk
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
    python examples/streaming_generation.py --switch-at 4 --reset-at 6 --out outputs/stream.png
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

The output PNG shows the first three latent channels of each generated frame as RGB (normalised over
the whole video), frames side by side, a white bar between chunks, 8 chunks per row. With random
weights it is a smoke picture, not a video: load real weights as ``wan_causal_dit`` explains.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script from anywhere

from wan_causal_dit import (  # noqa: E402
    BRANCHES,
    PRESETS,
    WanConfig,
    build_model,
    default_dtype,
    kv_pool_pages,
    make_kv_spec,
    torch_threads,
)

from ardiff_modules import KVCache, KVState, populate_cross_attention  # noqa: E402
from ardiff_modules.pool import bytes_per_page  # noqa: E402


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Streaming (chunk-by-chunk) generation with a causal Wan-style DiT over a paged KV cache.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model / cache geometry")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--chunks", type=int, default=8, help="chunks to generate (frames_per_chunk latent frames each)")
    p.add_argument("--steps", type=int, default=4, help="denoising forwards per chunk (plus one committing forward)")
    p.add_argument("--cfg-scale", type=float, default=5.0, help="classifier-free guidance scale")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, the prompts and the noise")
    p.add_argument("--switch-at", type=int, default=None, metavar="K", help="switch the prompt before chunk K")
    p.add_argument("--reset-at", type=int, default=None, metavar="K", help="reset the session before chunk K")
    p.add_argument("--out", type=Path, default=Path("outputs/stream.png"), help="PNG strip of the latent frames")
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
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available in this torch build / machine")
    if args.preset != "tiny" and args.device == "cpu" and not args.allow_big_cpu:
        spec = make_kv_spec(WanConfig.preset(args.preset), "cpu")
        gib = kv_pool_pages(spec) * bytes_per_page(spec) / 2**30
        p.error(
            f"--preset {args.preset} on CPU: the float32 KV pool alone needs {gib:.1f} GiB; expected --device cuda "
            "(or pass --allow-big-cpu)"
        )
    if args.cuda_graph and args.device != "cuda":
        p.error("--cuda-graph: expected --device cuda (CUDA graphs need a GPU)")
    return args


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
    def publish(self, state: KVState) -> None:
        """Populate the "text" cache of both branches: the current prompt (cond) and the negative (uncond)."""
        device = next(self.model.parameters()).device
        crosses = [block.cross for block in self.model.blocks]
        for branch, text in (("cond", self.prompts[self.current]), ("uncond", self.negative)):
            populate_cross_attention(state, branch, crosses, self.model.embed_text(text.to(device)))


def save_strip(frames: torch.Tensor, frames_per_chunk: int, path: Path, chunks_per_row: int = 8) -> None:
    """Write latent frames ``[T, C, H, W]`` as an RGB PNG (channels 0..2), frames side by side.

    Channels are normalised over the whole video (1st..99th percentile), frames upscaled
    (nearest) to at least 64 pixels high, a gray line separates frames and a white bar chunks, ``chunks_per_row`` per row.
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
    for r in range(0, len(chunks), chunks_per_row):
        pieces: list[torch.Tensor] = []
        for chunk in chunks[r : r + chunks_per_row]:
            if pieces:
                pieces.append(white)
            for i, frame in enumerate(chunk.unbind(0)):
                if i:
                    pieces.append(gray)
                pieces.append(frame)
        rows.append(torch.cat(pieces, dim=-1))
    width = max(row.shape[-1] for row in rows)
    rows = [torch.nn.functional.pad(row, (0, width - row.shape[-1]), value=1.0) for row in rows]
    spaced: list[torch.Tensor] = []
    for row in rows:
        if spaced:
            spaced.append(torch.ones(3, bar, width))
        spaced.append(row)
    image = torch.cat(spaced, dim=-2).permute(1, 2, 0).contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import matplotlib.image  # the examples extra: pip install ardiff_modules[examples]
    except ImportError:
        from PIL import Image  # matplotlib's own dependency, often present without it

        Image.fromarray((image * 255).round().to(torch.uint8).numpy()).save(path)
    else:
        matplotlib.image.imsave(path, image.numpy())


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
    spec = make_kv_spec(config, device)
    num_pages = kv_pool_pages(spec)
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

    def forward(x: torch.Tensor, t: float, commit: bool) -> torch.Tensor:
        """One batched CFG forward of both branches; returns the flow prediction of each [2, F, C, H, W]."""
        xs = x.to(device=device, dtype=dtype).repeat(streams, 1, 1, 1, 1)
        ts = torch.full((streams,), float(t), device=device)
        sync()
        start = time.perf_counter()
        with torch.no_grad(), state.prepare_forward(BRANCHES, seq_len, commit_current=commit, static=args.cuda_graph) as fwd:
            out = graph_step(fwd, xs, ts) if graph_step is not None else step_fn(xs, ts, fwd.layers)
        sync()
        forward_times.append(time.perf_counter() - start)
        return out.float()

    timesteps = torch.linspace(1000.0, 0.0, args.steps + 1).tolist()
    noise = torch.Generator().manual_seed(args.seed + 2)
    shape = (1, config.frames_per_chunk, config.in_channels, config.latent_height, config.latent_width)
    frames: list[torch.Tensor] = []
    events: list[str] = []

    sync()
    t_start = time.perf_counter()
    for k in _progress(range(args.chunks), not args.no_progress):
        if k == args.switch_at:
            prompts.current = 1
            state.clear_cross_attention()  # prompt switch: history kept, cross caches replaced
            prompts.publish(state)
            events.append(f"prompt switch before chunk {k} (history kept, offset {state.token_offset('cond')})")
        if k == args.reset_at:
            state.reset()  # drops pages and cross caches, offsets restart at 0
            prompts.publish(state)
            events.append(f"reset before chunk {k}")
        x = torch.randn(shape, generator=noise).to(device)
        for t, t_next in zip(timesteps[:-1], timesteps[1:]):
            v = forward(x, t, commit=False)
            v = v[1:2] + args.cfg_scale * (v[0:1] - v[1:2])
            x = x + (t_next - t) / 1000.0 * v
        forward(x, 0.0, commit=True)  # clean forward at t=0: its K/V become history
        frames.append(x[0].cpu())
    sync()
    elapsed = time.perf_counter() - t_start

    # ---- summary
    stats = cache.stats()
    summary: dict[str, Any] = {
        "preset": config.name,
        "device": str(device),
        "chunks": args.chunks,
        "frames": args.chunks * config.frames_per_chunk,
        "forwards": len(forward_times),
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
    }
    state.close()
    after = cache.stats()
    summary["pages_used_after_close"] = after.pages_used
    summary["pages_free_after_close"] = after.pages_free
    video = torch.stack(frames).flatten(0, 1)  # [T, C, H, W]
    save_strip(video, config.frames_per_chunk, args.out)
    summary["png"] = str(args.out)
    summary["latent_shape"] = tuple(video.shape)

    for event in events:
        print(f"event: {event}")
    print(
        f"generated {summary['chunks']} chunks / {summary['frames']} latent frames in {elapsed:.2f} s: "
        f"{summary['chunks_per_s']:.2f} chunks/s, {summary['frames_per_s']:.2f} frames/s "
        f"({summary['forwards']} batched CFG forwards, {args.steps} denoising + 1 commit per chunk)"
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
        print(f"CUDA graphs captured: {graph_step.num_graphs}")
    print(f"wrote {args.out} (latents {summary['latent_shape']})")
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
