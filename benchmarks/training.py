"""Training benchmark (issues 27, 43): a Self-Forcing-style training step through the cache, against the peer.

**The step** (Self-Forcing's ``self_forcing_training.py``, CFG off, one stream): a rollout of ``--frames``
latent frames (21: 7 chunks of 3 frames at Wan2.1-1.3B's 480x832 shape, 4680 tokens per chunk); per chunk a
seeded random exit step among 4 denoising steps, the steps before it under ``no_grad``, the exit step with
gradients, then the clean commit under ``no_grad`` at timestep 0; every block of a forward with gradients
activation-checkpointed; one backward of a stand-in loss (the mean square of the exit predictions) at the end.
The SAME model (``ardiff_modules.models.wan_causal_dit``, random weights, bf16) runs under four variants
(``--variants``, default all), two history-gradient modes each:

* ``library`` -- ``KVCache`` (FlashInfer, contiguous extents: no-grad forwards on ragged FA3), the exit
  forwards on the gradient path (torch SDPA over the gathered history, its flash backward), the rollout
  inside one ``TrainingScope`` (``history_grad="detached"``: the committed history a constant), blocks through
  ``scope.checkpoint``;
* ``library_straight_through`` -- the same in ``TrainingScope(cache, history_grad="straight_through")``:
  upstream Self-Forcing's training signal (a read of a committed chunk routes its gradient to that chunk's
  exit-step K/V, the values read still the clean ones); eager, as straight-through always runs; the scope keeps
  the rollout's live exit-step K/V until it ends;
* ``peer`` -- what the peers write for training: one contiguous K / V buffer per layer for the whole clip
  (a rolling one breaks checkpointing, so they allocate the clip), written in place under ``no_grad``; no-grad
  forwards attend the visible prefix with FlashInfer's ragged FA3 (as Self-Forcing does with FA3 on Hopper),
  forwards with gradients attend ``[prefix (detached) ; live K/V]`` with torch SDPA (flash forward and
  backward); blocks through ``torch.utils.checkpoint`` (non-reentrant);
* ``peer_straight_through`` -- upstream Self-Forcing's own mechanism: the exit step writes its K/V into the
  buffer *with* gradients (``buf[:, a:b] = k``), the clean re-run overwrites the slots under ``no_grad``, and
  autograd's ``CopySlices`` routes every later read of those slots to the exit step's K/V (the buffers are
  detached from the last step's graph before each step). The straight-through library's gradient reference.

Timed: ``--steps`` rounds of one training step of each variant, all alive, side by side (after a warm-up
step each), median and IQR; peak device memory and the KV bytes of each measured alone, beforehand.
Gradients compared (``grad_rel``, relative error per parameter, max and median): ``library`` vs ``peer`` and
``library_straight_through`` vs ``peer_straight_through`` must agree (bf16; the exit code says whether both are
under 0.1); ``library_straight_through`` vs ``library`` (and vs ``peer``) differ by design (the straight-through
signal's size, reported).

**The long rollout** (``--long-frames``, 240: LongLive's streaming long tuning): a window of sink 1 + window 6
chunks, one training step per chunk (its own scope: exit step with gradients, backward, the clean commit),
``--long-layers`` blocks (KV scales linearly in layers): the library's pages stay at sink + window while the
peer's whole-clip buffers grow with the clip. Reported: KV bytes and peak memory against the frame.

On the H200: ``python -m benchmarks.training --out DIR`` writes ``training_<device>.json`` and a plot;
``--long-frames 0`` skips the long rollout; ``--device cpu --preset tiny`` is a smoke run (SDPA for FA3, no
memory figures).
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
#: Every variant, in the order they are measured and timed.
VARIANTS = ("library", "library_straight_through", "peer", "peer_straight_through")
#: Gradient comparisons ``name: (variant, reference, expected)``: "agree" pairs decide the exit code.
COMPARISONS = {
    "library_vs_peer": ("library", "peer", "agree"),
    "library_straight_through_vs_peer_straight_through": ("library_straight_through", "peer_straight_through", "agree"),
    "library_straight_through_vs_library": ("library_straight_through", "library", "differ"),
    "library_straight_through_vs_peer": ("library_straight_through", "peer", "differ"),
}


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
                 dtype: torch.dtype, straight_through: bool = False) -> None:
        self.forward, self.cross = forward, cross
        self.straight_through = straight_through  #: upstream's write with gradients (``CopySlices``)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.k_cache = self.k  # what the library's layer checks look for

    def detach_(self) -> None:
        """Cut the buffers from the last step's graph (their storage kept): a new step's ``CopySlices`` chain."""
        self.k, self.v = self.k.detach(), self.v.detach()
        self.k_cache = self.k

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
        if kv.straight_through and torch.is_grad_enabled() and q.requires_grad:
            # upstream's exit step: the write itself records a CopySlices, so every later read of these slots (the
            # clean re-run overwrites their values under no_grad) routes its gradient to this k / v
            kv.k[:, start : start + n] = k
            kv.v[:, start : start + n] = v
            keys, values = kv.forward.history(kv.k), kv.forward.history(kv.v)
            return _sdpa(q, torch.cat([keys, k], dim=1), torch.cat([values, v], dim=1))
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
                 device: Any, dtype: torch.dtype, straight_through: bool = False) -> None:
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
                self.layers.append(PeerLayer(self.forward_ctx, shape, {TEXT: (k[None], v[None])}, device, dtype,
                                             straight_through))
        self.straight_through = straight_through
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

    def start_step(self) -> None:
        """A new rollout: from chunk 0, the straight-through buffers cut from the last step's graph."""
        self.committed = 0
        if self.straight_through:
            for layer in self.layers:
                layer.detach_()

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
    if name.startswith("library"):
        history_grad = "straight_through" if name.endswith("straight_through") else "detached"
        with am.TrainingScope(runner.cache, history_grad=history_grad) as scope, \
                checkpointed_blocks(model, scope.checkpoint):
            runner.state.reset(keep_cross_attention=("text",))
            loss = rollout_step(runner, model, latents, exits, device)
            loss.backward()
    else:
        with runner.swapped(), checkpointed_blocks(model, lambda block, *a: checkpoint(block, *a, use_reentrant=False)):
            runner.start_step()
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
    """Every variant alive, one training step of each per round (side by side: drift hits them alike)."""
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


def grad_comparisons(grads: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, Any]]:
    """:data:`COMPARISONS` whose two variants ran: the relative error per parameter, max (and which) and median."""
    out: dict[str, dict[str, Any]] = {}
    for label, (name, reference, expected) in COMPARISONS.items():
        if name not in grads or reference not in grads:
            continue
        a, b = grads[name], grads[reference]
        if a.keys() != b.keys():
            raise AssertionError(f"{label}: parameters with gradients differ: {sorted(set(a) ^ set(b))}")
        rel = {n: _rel(a[n], b[n]) for n in b}
        worst = max(rel, key=rel.__getitem__)
        out[label] = {"variant": name, "reference": reference, "expected": expected, "max": rel[worst],
                      "max_param": worst, "median": sorted(rel.values())[len(rel) // 2]}
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--preset", default="wan2.1-1.3b")
    p.add_argument("--frames", type=int, default=21)
    p.add_argument("--steps", type=int, default=6, help="timed rounds (one step of each variant per round)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {', '.join(VARIANTS)} (default: all)")
    p.add_argument("--long-frames", type=int, default=240, help="the long rollout's frames (0: skip it)")
    p.add_argument("--long-layers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        p.error(f"--variants: expected names from {', '.join(VARIANTS)}, got {args.variants!r}")
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
    all_makes = {
        "library": lambda: LibraryRunner(model, config, text, device, dtype),
        # the scope holds what its forwards read and (straight-through) their live K/V; no pages past eviction here
        "library_straight_through": lambda: LibraryRunner(model, config, text, device, dtype),
        "peer": lambda: PeerRunner(model, config, text, chunks, None, device, dtype),
        "peer_straight_through": lambda: PeerRunner(model, config, text, chunks, None, device, dtype,
                                                    straight_through=True),
    }
    makes = {name: all_makes[name] for name in VARIANTS if name in variants}
    runs = {name: measure_variant(name, make, model, latents, exits, device) for name, make in makes.items()}
    grad_rel = grad_comparisons({name: r["grads"] for name, r in runs.items()})
    results = {k: v["result"] for k, v in runs.items()}
    for name, stats in time_interleaved(makes, model, latents, exits, args.steps, device).items():
        results[name].update(ms_per_step=stats.median_ms, ms_per_step_stats=stats.as_dict())
    long: dict[str, Any] = {}
    long_config = dataclasses.replace(WanConfig.preset(args.preset), num_layers=args.long_layers)
    if args.long_frames > 0:
        long_model = build_model(long_config, device=device, dtype=dtype).requires_grad_(True)
        with torch.no_grad():
            long_text = long_model.embed_text(torch.randn(long_config.text_tokens, long_config.text_dim, generator=g,
                                                          device=device, dtype=dtype))
        long = {name: long_rollout(name, long_model, long_config, long_text, args.long_frames, device, dtype,
                                   args.seed) for name in ("library", "peer")}

    def ms(name: str) -> float | None:
        return results[name]["ms_per_step"] if name in results else None

    def peak(name: str) -> float | None:
        return results[name]["peak_memory_bytes"] if name in results else None

    detached = grad_rel.get("library_vs_peer")
    payload = {
        "benchmark": "training", "config": {"preset": args.preset, "frames": args.frames, "chunks": chunks,
                                            "chunk_tokens": config.chunk_size, "exits": exits,
                                            "sink_chunks": config.sink_chunks, "window_chunks": config.window_chunks,
                                            "variants": list(makes)},
        "results": results,
        # the detached library against the peer (issue 27's row), and upstream's mode (issue 43)
        "speedup_vs_peer": _ratio(ms("peer"), ms("library")),
        "memory_ratio_vs_peer": _ratio(peak("library"), peak("peer")),
        "straight_through": {
            "ms_ratio_vs_detached": _ratio(ms("library_straight_through"), ms("library")),
            "memory_ratio_vs_detached": _ratio(peak("library_straight_through"), peak("library")),
            "speedup_vs_peer_straight_through": _ratio(ms("peer_straight_through"), ms("library_straight_through")),
            "memory_ratio_vs_peer_straight_through": _ratio(peak("library_straight_through"),
                                                            peak("peer_straight_through")),
        },
        "grad_rel": grad_rel,
        "grad_rel_err": None if detached is None else {"max": detached["max"], "median": detached["median"]},
        "long_rollout": {"frames": args.long_frames, "layers": args.long_layers,
                         "window_chunks": long_config.window_chunks, **long},
    }
    print(f"training step ({args.frames} frames, {chunks} chunks, exits {exits}):")
    for name, r in results.items():
        print(f"  {name:26s} {r['ms_per_step']:8.0f} ms (IQR {r['ms_per_step_stats']['p25_ms']:.0f}-"
              f"{r['ms_per_step_stats']['p75_ms']:.0f}), peak {_gib(r['peak_memory_bytes'])}, "
              f"KV {r['kv_bytes'] / 2**20:.0f} MiB")
    for label, c in grad_rel.items():
        print(f"  grad rel {label}: max {c['max']:.2e} ({c['max_param']}), median {c['median']:.2e} "
              f"(expected to {c['expected']})")
    if payload["speedup_vs_peer"] is not None:
        print(f"  library vs peer: {payload['speedup_vs_peer']:.2f}x")
    st = payload["straight_through"]
    if st["ms_ratio_vs_detached"] is not None:
        print(f"  straight-through vs detached library: {st['ms_ratio_vs_detached']:.2f}x the time")
    if st["speedup_vs_peer_straight_through"] is not None:
        print(f"  straight-through library vs peer_straight_through: {st['speedup_vs_peer_straight_through']:.2f}x")
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
    long = payload["long_rollout"]
    has_long = "library" in long
    fig, axes = plt.subplots(1, 2 if has_long else 1, figsize=(13 if has_long else 7, 4.5), squeeze=False)
    a = axes[0][0]
    names = list(payload["results"])
    ms = [payload["results"][n]["ms_per_step"] for n in names]
    lo = [payload["results"][n]["ms_per_step_stats"]["p25_ms"] for n in names]
    hi = [payload["results"][n]["ms_per_step_stats"]["p75_ms"] for n in names]
    # detached modes solid, straight-through hatched; library blue, peer orange
    colors = ["C0" if n.startswith("library") else "C1" for n in names]
    bars = a.bar(range(len(names)), ms, yerr=[[m - l for m, l in zip(ms, lo)], [h - m for m, h in zip(ms, hi)]],
                 color=colors)
    for bar, name, row in zip(bars, names, (payload["results"][n] for n in names)):
        if name.endswith("straight_through"):
            bar.set_hatch("//")
        if row.get("peak_memory_bytes") is not None:
            a.annotate(f"{row['peak_memory_bytes'] / 2**30:.1f} GiB", (bar.get_x() + bar.get_width() / 2, 0),
                       xytext=(0, 3), textcoords="offset points", ha="center", fontsize=7, color="white")
    a.set_xticks(range(len(names)), [n.replace("_straight_through", "\nstraight-through") for n in names], fontsize=8)
    a.set_ylabel("ms per training step (median, IQR)")
    speedup = payload.get("speedup_vs_peer")
    a.set_title(f"Self-Forcing-style step, {payload['config']['frames']} frames"
                + (f": library {speedup:.2f}x the peer" if speedup else ""), fontsize=10)
    if not has_long:
        return save(plt, fig, path)
    b = axes[0][1]
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
    agree = [c["max"] for c in payload["grad_rel"].values() if c["expected"] == "agree"]
    return 0 if all(err < 0.1 for err in agree) else 1


if __name__ == "__main__":
    sys.exit(main())
