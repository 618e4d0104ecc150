"""Training benchmark (issue 27): a Self-Forcing-style training step through the cache, against the peer.

**The step** (Self-Forcing's ``self_forcing_training.py``, CFG off, one stream): a rollout of ``--frames``
latent frames (21: 7 chunks of 3 frames at Wan2.1-1.3B's 480x832 shape, 4680 tokens per chunk); per chunk a
seeded random exit step among 4 denoising steps, the steps before it under ``no_grad``, the exit step with
gradients, then the clean commit under ``no_grad`` at timestep 0; every block of a forward with gradients
activation-checkpointed; one backward of a stand-in loss (the mean square of the exit predictions) at the end.
The SAME model (``ardiff_modules.models.wan_causal_dit``, random weights, bf16) runs under two caches:

* ``library`` -- ``KVCache`` (FlashInfer, contiguous extents: no-grad forwards on ragged FA3), the exit
  forwards on the gradient path (torch SDPA over the gathered history, its flash backward), the rollout
  inside one ``TrainingScope``, blocks through ``scope.checkpoint``;
* ``peer`` -- what the peers write for training: one contiguous K / V buffer per layer for the whole clip
  (a rolling one breaks checkpointing, so they allocate the clip), written in place under ``no_grad``; no-grad
  forwards attend the visible prefix with FlashInfer's ragged FA3 (as Self-Forcing does with FA3 on Hopper),
  forwards with gradients attend ``[prefix (detached) ; live K/V]`` with torch SDPA (flash forward and
  backward); blocks through ``torch.utils.checkpoint`` (non-reentrant).

Timed: ``--steps`` rounds of one training step of each variant, both alive, side by side (after a warm-up
step each), median and IQR; peak device memory and the KV bytes of each measured alone, beforehand. The parameter gradients of the two must agree (bf16: relative error reported).

**The long rollout** (``--long-frames``, 240: LongLive's streaming long tuning): a window of sink 1 + window 6
chunks, one training step per chunk (its own scope: exit step with gradients, backward, the clean commit),
``--long-layers`` blocks (KV scales linearly in layers): the library's pages stay at sink + window while the
peer's whole-clip buffers grow with the clip. Reported: KV bytes and peak memory against the frame.

On the H200: ``python -m benchmarks.training --out DIR`` writes ``training_<device>.json`` and a plot;
``--device cpu --preset tiny`` is a smoke run (SDPA for FA3, no memory figures).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from benchmarks._plotting import pyplot, save
from benchmarks.baselines import RollingSelfAttention
from benchmarks._timing import Stats, clock, parser, require_gpu, result_path, save_json

TIMESTEPS = (1000.0, 750.0, 500.0, 250.0)


def _reset_memory(device: torch.device) -> int:
    """Collect, empty the allocator's cache and reset the peak; returns the bytes allocated now (CUDA)."""
    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _peak(device: torch.device, base: int) -> int | None:
    return torch.cuda.max_memory_allocated() - base if device.type == "cuda" else None


# --------------------------------------------------------------------------------- the peer's cache
class PeerForward:
    """What the blocks read from ``kv.forward``: the positions (the peer keeps its offsets on the host)."""

    def __init__(self) -> None:
        self.positions = torch.empty(0, dtype=torch.int64)
        self.sink_positions = None
        self.start = 0  #: the current chunk's first token in the buffer
        self.sink_tokens = 0
        self.window_tokens: int | None = None  #: ``None``: every earlier token is visible

    def history(self, buf: torch.Tensor) -> torch.Tensor:
        """The visible history in ``buf`` (a view when it is one range, else the sink and window joined)."""
        if self.window_tokens is None or self.start - self.window_tokens <= self.sink_tokens:
            return buf[:, : self.start]
        return torch.cat([buf[:, : self.sink_tokens], buf[:, self.start - self.window_tokens : self.start]], dim=1)


class PeerLayer:
    """One layer's whole-clip K / V buffers (``[1, clip_tokens, heads, dim]``) and its prompt's K / V."""

    def __init__(self, forward: PeerForward, shape: tuple[int, ...], cross: dict[str, Any], device: Any,
                 dtype: torch.dtype) -> None:
        self.forward, self.cross = forward, cross
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.k_cache = self.k  # what the library's layer checks look for

    def cross_kv(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cross[name]


class RaggedFA3:
    """FlashInfer's ragged FA3 over one contiguous prefix, planned once per (queries, keys) shape."""

    def __init__(self, heads: int, head_dim: int, device: Any, dtype: torch.dtype) -> None:
        import flashinfer

        self.workspace = torch.empty(256 << 20, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD", backend="fa3")
        self.heads, self.head_dim, self.dtype, self.shape = heads, head_dim, dtype, None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, keys = q.shape[1], k.shape[1]
        if self.shape != (n, keys):
            self.wrapper.plan(torch.tensor([0, n], dtype=torch.int32), torch.tensor([0, keys], dtype=torch.int32),
                              self.heads, self.heads, self.head_dim, causal=False, q_data_type=self.dtype,
                              kv_data_type=self.dtype)
            self.shape = (n, keys)
        return self.wrapper.run(q[0], k[0], v[0])[None]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


class PeerSelfAttention(RollingSelfAttention):
    """A block's ``ChunkSelfAttention`` projections / norms / RoPE (``RollingSelfAttention``'s) over the
    whole-clip buffer: ``attend`` (FA3) for forwards without gradients, SDPA over ``[history ; live K/V]`` with."""

    def cached_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: PeerLayer) -> torch.Tensor:  # type: ignore[override]
        start, n = kv.forward.start, q.shape[1]
        with torch.no_grad():  # the buffer holds the last write of each slot, detached
            kv.k[:, start : start + n].copy_(k)
            kv.v[:, start : start + n].copy_(v)
        keys, values = kv.forward.history(kv.k), kv.forward.history(kv.v)
        if torch.is_grad_enabled() and q.requires_grad:
            return _sdpa(q, torch.cat([keys, k], dim=1), torch.cat([values, v], dim=1))
        return self.attend(q, torch.cat([keys, kv.k[:, start : start + n]], 1), torch.cat([values, kv.v[:, start : start + n]], 1))


class PeerRunner:
    """The model over whole-clip buffers (the peer): ``forward(x, t, commit, grad)``."""

    def __init__(self, model: nn.Module, config: Any, text: torch.Tensor, clip_chunks: int, window: int | None,
                 device: Any, dtype: torch.dtype) -> None:
        from ardiff_modules.models.wan_causal_dit import TEXT

        self.model, self.chunk, self.sink, self.window = model, config.chunk_size, config.sink_chunks, window
        self.forward_ctx = PeerForward()
        self.forward_ctx.sink_tokens = config.sink_chunks * config.chunk_size
        self.forward_ctx.window_tokens = None if window is None else window * config.chunk_size
        shape = (1, clip_chunks * config.chunk_size, config.num_heads, config.head_dim)
        fa3 = RaggedFA3(config.num_heads, config.head_dim, device, dtype) if device.type == "cuda" else _sdpa
        self.layers = []
        with torch.no_grad():
            for block in model.blocks:
                k, v = block.cross.project_kv(text)
                self.layers.append(PeerLayer(self.forward_ctx, shape, {TEXT: (k[None], v[None])}, device, dtype))
        self.fa3 = fa3
        self.committed = 0
        self._arange = torch.arange(config.chunk_size, device=device)

    def forward(self, x: torch.Tensor, t: torch.Tensor, commit: bool, step: Callable[..., torch.Tensor]) -> torch.Tensor:
        # A context object per forward (the peers pass current_start per call): a recomputation under
        # torch.utils.checkpoint must see this forward's offsets, not a later one's.
        f = copy.copy(self.forward_ctx)
        f.start = self.committed * self.chunk
        f.positions = (self._arange + f.start)[None]
        layers = [copy.copy(layer) for layer in self.layers]
        for layer in layers:
            layer.forward = f
        out = step(x, t, layers)
        if commit:
            self.committed += 1
        return out

    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.k, layer.v))

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """The model's self-attention over these buffers (its own projections, norms, RoPE); restored on exit."""
        originals = [block.attn for block in self.model.blocks]
        try:
            for block in self.model.blocks:
                block.attn = PeerSelfAttention(block.attn, self.fa3)
            yield
        finally:
            for block, attn in zip(self.model.blocks, originals):
                block.attn = attn

    def close(self) -> None:
        self.layers.clear()


class LibraryRunner:
    """The model over a ``KVCache`` (one session, CFG off)."""

    def __init__(self, model: nn.Module, config: Any, text: torch.Tensor, device: Any, dtype: torch.dtype,
                 held_chunks: int = 0) -> None:
        import ardiff_modules as am
        from ardiff_modules.models.wan_causal_dit import kv_pool_pages, make_kv_spec

        spec = dataclasses.replace(make_kv_spec(config, device, ("cond",)), dtype=dtype)
        self.spec = spec
        # history + pending (+ ``held_chunks``: what a scope holds past eviction, one per chunk it commits)
        pages = kv_pool_pages(spec, slack_chunks=held_chunks)
        self.cache = am.KVCache(spec, num_pages=pages, device=device, backend="auto")
        self.state = self.cache.open_session()
        am.populate_cross_attention(self.state, "cond", [b.cross for b in model.blocks], text)

    def forward(self, x: torch.Tensor, t: torch.Tensor, commit: bool, step: Callable[..., torch.Tensor]) -> torch.Tensor:
        with self.state.prepare_forward(("cond",), self.spec.chunk_size, commit_current=commit) as fwd:
            return step(x, t, fwd.layers)

    def kv_bytes(self) -> int:
        stats = self.cache.stats()
        return stats.peak_pages_used * stats.bytes_per_page

    def close(self) -> None:
        self.state.close()
        self.cache.close()


@contextlib.contextmanager
def checkpointed_blocks(model: nn.Module, wrap: Callable[..., torch.Tensor]) -> Iterator[None]:
    """Every block called through ``wrap(block, *args)`` (activation checkpointing); restored on exit."""
    originals = list(model.blocks)

    class Wrapped(nn.Module):
        def __init__(self, block: nn.Module) -> None:
            super().__init__()
            self.block = block

        @property
        def attn(self) -> nn.Module:  # what the model reads off its first block
            return self.block.attn

        def forward(self, *args: Any) -> torch.Tensor:
            if torch.is_grad_enabled():
                return wrap(self.block, *args)
            return self.block(*args)

    model.blocks = nn.ModuleList(Wrapped(b) for b in originals)
    try:
        yield
    finally:
        model.blocks = nn.ModuleList(originals)


# --------------------------------------------------------------------------------- the training step
def rollout_step(runner: Any, model: nn.Module, latents: Sequence[torch.Tensor], exits: Sequence[int],
                 device: Any, grad_chunks: Sequence[int] | None = None) -> torch.Tensor:
    """One Self-Forcing-style rollout; returns the loss (backward not run)."""
    losses = []
    zero = torch.zeros(1, device=device)
    for c, (x, exit_step) in enumerate(zip(latents, exits)):
        with torch.no_grad():
            for s in range(exit_step):
                runner.forward(x, torch.full((1,), TIMESTEPS[s], device=device), False, model)
        grad = grad_chunks is None or c in grad_chunks
        with torch.set_grad_enabled(grad):
            pred = runner.forward(x, torch.full((1,), TIMESTEPS[exit_step], device=device), False, model)
        if grad:
            losses.append(pred.float().square().mean())
        with torch.no_grad():
            runner.forward(x, zero, True, model)
    return torch.stack(losses).sum()


def _training_step(name: str, runner: Any, model: nn.Module, latents: Sequence[torch.Tensor],
                   exits: Sequence[int], device: Any) -> torch.Tensor:
    import ardiff_modules as am

    model.zero_grad(set_to_none=True)
    if name == "library":
        with am.TrainingScope(runner.cache) as scope, checkpointed_blocks(model, scope.checkpoint):
            runner.state.reset(keep_cross_attention=("text",))
            loss = rollout_step(runner, model, latents, exits, device)
            loss.backward()
    else:
        with runner.swapped(), checkpointed_blocks(model, lambda block, *a: checkpoint(block, *a, use_reentrant=False)):
            runner.committed = 0
            loss = rollout_step(runner, model, latents, exits, device)
            loss.backward()
    return loss.detach()


def measure_variant(name: str, make: Callable[[], Any], model: nn.Module, latents: Sequence[torch.Tensor],
                    exits: Sequence[int], device: Any) -> dict[str, Any]:
    """Peak memory and gradients of one training step (after a warm-up step), this variant alone on the device."""
    base = _reset_memory(device)
    runner = make()
    _training_step(name, runner, model, latents, exits, device)  # warm-up: plans, kernels, allocator
    loss = float(_training_step(name, runner, model, latents, exits, device))
    result = {"loss": loss, "peak_memory_bytes": _peak(device, base), "kv_bytes": runner.kv_bytes()}
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    runner.close()
    model.zero_grad(set_to_none=True)
    return {"result": result, "grads": grads}


def time_interleaved(makes: dict[str, Callable[[], Any]], model: nn.Module, latents: Sequence[torch.Tensor],
                     exits: Sequence[int], rounds: int, device: Any) -> dict[str, Stats]:
    """Both variants alive, one training step of each per round (side by side: drift hits both alike)."""
    runners = {name: make() for name, make in makes.items()}
    for name, runner in runners.items():
        _training_step(name, runner, model, latents, exits, device)
    ms: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, runner in runners.items():
            start = clock()
            _training_step(name, runner, model, latents, exits, device)
            ms[name].append((clock() - start) * 1e3)
    for runner in runners.values():
        runner.close()
    model.zero_grad(set_to_none=True)
    return {name: Stats.from_ms(v) for name, v in ms.items()}


def long_rollout(name: str, model: nn.Module, config: Any, text: torch.Tensor, frames: int, device: Any,
                 dtype: torch.dtype, seed: int) -> dict[str, Any]:
    """One training step per chunk over ``frames`` frames: KV bytes and peak memory against the frame."""
    import ardiff_modules as am

    chunks = frames // config.frames_per_chunk
    g = torch.Generator(device=device).manual_seed(seed)
    base = _reset_memory(device)
    runner = (LibraryRunner(model, config, text, device, dtype, held_chunks=1) if name == "library"
              else PeerRunner(model, config, text, chunks, config.window_chunks, device, dtype))
    shape = (1, config.frames_per_chunk, config.in_channels, config.latent_height, config.latent_width)
    points = []
    start = clock()
    for c in range(chunks):
        x = torch.randn(shape, generator=g, device=device, dtype=dtype)
        exit_step = int(torch.randint(len(TIMESTEPS), (1,), generator=g, device=device))
        model.zero_grad(set_to_none=True)
        if name == "library":
            with am.TrainingScope(runner.cache) as scope, checkpointed_blocks(model, scope.checkpoint):
                rollout_step(runner, model, [x], [exit_step], device).backward()
        else:
            with runner.swapped(), checkpointed_blocks(model, lambda block, *a: checkpoint(block, *a, use_reentrant=False)):
                rollout_step(runner, model, [x], [exit_step], device).backward()
        if (c + 1) % max(1, chunks // 20) == 0 or c + 1 == chunks:
            # the library's pages in use; the peer's whole-clip buffers (allocated up front)
            kv = runner.cache.stats().bytes_used if name == "library" else \
                runner.kv_bytes()
            points.append({"frame": (c + 1) * config.frames_per_chunk, "kv_bytes": kv,
                           "peak_memory_bytes": _peak(device, base)})
    seconds = clock() - start
    allocated = runner.kv_bytes()
    runner.close()
    model.zero_grad(set_to_none=True)
    return {"points": points, "seconds": seconds, "kv_allocated_bytes": allocated}


def _gib(b: int | None) -> str:
    return "n/a" if b is None else f"{b / 2**30:.2f} GiB"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--preset", default="wan2.1-1.3b")
    p.add_argument("--frames", type=int, default=21)
    p.add_argument("--steps", type=int, default=6, help="timed rounds (one step of each variant per round)")
    p.add_argument("--long-frames", type=int, default=240)
    p.add_argument("--long-layers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        require_gpu(p.prog)
    from ardiff_modules.models.wan_causal_dit import WanConfig, build_model

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = WanConfig.preset(args.preset)
    chunks = args.frames // config.frames_per_chunk
    # the whole clip visible (Self-Forcing trains 21 frames with global attention): sink 1 + the rest
    config = dataclasses.replace(config, window_chunks=max(config.window_chunks, chunks - 1 - config.sink_chunks))
    model = build_model(config, device=device, dtype=dtype).requires_grad_(True)
    g = torch.Generator(device=device).manual_seed(args.seed)
    with torch.no_grad():
        text = model.embed_text(torch.randn(config.text_tokens, config.text_dim, generator=g, device=device, dtype=dtype))
    shape = (1, config.frames_per_chunk, config.in_channels, config.latent_height, config.latent_width)
    latents = [torch.randn(shape, generator=g, device=device, dtype=dtype) for _ in range(chunks)]
    exits = [int(e) for e in torch.randint(len(TIMESTEPS), (chunks,), generator=g, device=device)]
    makes = {
        "library": lambda: LibraryRunner(model, config, text, device, dtype),
        "peer": lambda: PeerRunner(model, config, text, chunks, None, device, dtype),
    }
    runs = {name: measure_variant(name, make, model, latents, exits, device) for name, make in makes.items()}
    rel = {n: _rel(runs["library"]["grads"][n], runs["peer"]["grads"][n]) for n in runs["peer"]["grads"]}
    results = {k: v["result"] for k, v in runs.items()}
    for name, stats in time_interleaved(makes, model, latents, exits, args.steps, device).items():
        results[name].update(ms_per_step=stats.median_ms, ms_per_step_stats=stats.as_dict())
    lib, peer = results["library"], results["peer"]
    long_config = dataclasses.replace(WanConfig.preset(args.preset), num_layers=args.long_layers)
    long_model = build_model(long_config, device=device, dtype=dtype).requires_grad_(True)
    with torch.no_grad():
        long_text = long_model.embed_text(torch.randn(long_config.text_tokens, long_config.text_dim, generator=g,
                                                      device=device, dtype=dtype))
    long = {name: long_rollout(name, long_model, long_config, long_text, args.long_frames, device, dtype, args.seed)
            for name in ("library", "peer")}
    payload = {
        "benchmark": "training", "config": {"preset": args.preset, "frames": args.frames, "chunks": chunks,
                                            "chunk_tokens": config.chunk_size, "exits": exits,
                                            "sink_chunks": config.sink_chunks, "window_chunks": config.window_chunks},
        "results": results,
        "speedup_vs_peer": peer["ms_per_step"] / lib["ms_per_step"],
        "memory_ratio_vs_peer": lib["peak_memory_bytes"] / peer["peak_memory_bytes"] if device.type == "cuda" else None,
        "grad_rel_err": {"max": max(rel.values()), "median": sorted(rel.values())[len(rel) // 2]},
        "long_rollout": {"frames": args.long_frames, "layers": args.long_layers,
                         "window_chunks": long_config.window_chunks, **long},
    }
    print(f"training step ({args.frames} frames, {chunks} chunks, exits {exits}): library {lib['ms_per_step']:.0f} ms "
          f"(peak {_gib(lib['peak_memory_bytes'])}), peer {peer['ms_per_step']:.0f} ms "
          f"(peak {_gib(peer['peak_memory_bytes'])}): {payload['speedup_vs_peer']:.2f}x; "
          f"grad rel err max {payload['grad_rel_err']['max']:.2e}")
    for name, r in long.items():
        last = r["points"][-1]
        print(f"long rollout {name}: {r['seconds']:.1f} s, KV at frame {last['frame']}: {last['kv_bytes'] / 2**20:.0f} MiB, "
              f"peak {_gib(last['peak_memory_bytes'])}")
    path = result_path(args.out, "training.json", device=args.device)
    save_json(path, payload, args=args)
    plot(payload, path.with_suffix(".png"))
    return payload


def plot(payload: dict[str, Any], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(payload["results"])
    ms = [payload["results"][n]["ms_per_step"] for n in names]
    lo = [payload["results"][n]["ms_per_step_stats"]["p25_ms"] for n in names]
    hi = [payload["results"][n]["ms_per_step_stats"]["p75_ms"] for n in names]
    a.bar(names, ms, yerr=[[m - l for m, l in zip(ms, lo)], [h - m for m, h in zip(ms, hi)]], color=["C0", "C1"])
    a.set_ylabel("ms per training step (median, IQR)")
    a.set_title(f"Self-Forcing-style step, {payload['config']['frames']} frames: {payload['speedup_vs_peer']:.2f}x")
    long = payload["long_rollout"]
    for i, name in enumerate(("library", "peer")):
        pts = long[name]["points"]
        b.plot([p["frame"] for p in pts], [p["kv_bytes"] / 2**30 for p in pts], f"C{i}-", label=f"{name} KV")
        if pts and pts[0]["peak_memory_bytes"] is not None:
            b.plot([p["frame"] for p in pts], [p["peak_memory_bytes"] / 2**30 for p in pts], f"C{i}--",
                   label=f"{name} peak memory")
    b.set_xlabel("frame")
    b.set_ylabel("GiB")
    b.set_title(f"{long['frames']}-frame rollout, {long['layers']} layers, one step per chunk")
    b.legend(fontsize=8)
    return save(plt, fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    payload = run(argv)
    return 0 if payload["grad_rel_err"]["max"] < 0.1 else 1


if __name__ == "__main__":
    sys.exit(main())
