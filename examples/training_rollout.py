"""A tiny Self-Forcing-style training loop through ``ardiff_modules``' paged sink + window KV cache.

Self-Forcing trains a causal video DiT on its *own* rollouts: every training step generates a video chunk
by chunk exactly as inference does, with the KV cache, and back-propagates through the rollout. Here the
model is the package's reference causal Wan DiT (``ardiff_modules.models.wan_causal_dit``, random weights),
one stream (the "cond" branch: the generator is trained without CFG), and per training step:

1. ``state.reset()`` (a new video, its prompt published again), ``cache.reset_peak()``;
2. ``with am.TrainingScope(cache) as scope:`` around everything below, so that a forward with gradients keeps
   the history pages it read until the backward (``--checkpoint`` recomputes every block from them);
3. per chunk (``--chunks``, default 8: the tiny preset's sink 1 + window 2 slides several times), an exit
   step drawn with ``torch.randint`` over the ``--steps`` denoising steps (a generator seeded by
   ``(--seed, step)``, so every rank of a data-parallel job draws the same exits without a broadcast).
   Timesteps are ``linspace(1000, 0, steps + 1)[:-1]`` (``[1000, 750, 500, 250]``), a flow-matching model:
   ``x_t = (1 - s) x0 + s noise`` with ``s = t / 1000`` and the flow ``v = noise - x0``, so each forward's
   clean prediction is ``x0 = x_t - s v``:

   * the steps before the exit run under ``torch.no_grad``: a denoising forward (``commit_current=False``),
     then ``x0`` is re-noised to the next timestep with fresh noise;
   * the exit step runs with gradients (only for the last ``--grad-chunks`` chunks; earlier chunks exit
     under ``no_grad`` too, Self-Forcing's gradient window over the last frames). It attends its history as
     a constant (written under ``no_grad``) and its own K/V live. Its ``x0`` is the chunk's output;
   * the clean commit forward under ``no_grad``: ``x0`` (detached) re-noised to ``--context-noise``
     (default 0: the clean latent) with ``commit_current=True``; its K/V join the history, the window slides.

4. the loss, a **stand-in**: the MSE of every chunk's exit prediction ``x0`` to a fixed random target video
   (seeded; chunks that exited without gradients add constants). Self-Forcing's real loss is DMD
   (distribution matching against a teacher's and a critic's scores), which needs two more models; what
   matters for the cache is the same: gradients flow into every exit forward of the rollout;
5. ``loss.backward()``, the gradient norm clipped (``--max-grad-norm``) and reported, one AdamW step.
   Leaving the scope drops its holds: the session is back at sink + window chunks.

What gets no gradient: the cross-attention K/V projections and the text embedding (the prompt's K/V are
projected once per prompt, under ``no_grad``, and cached), as in the peers' cached cross-attention.

Precision: on CUDA the model computes in bfloat16 (the KV pool's dtype) while AdamW updates float32 master
weights copied back into the model after each step (what FSDP's mixed precision does in Self-Forcing); a
bf16-only AdamW would lose updates below bf16's resolution. Latents, noise, ``x0`` and the loss stay float32.

Commands
--------
::

    python examples/training_rollout.py                           # tiny preset, CPU, 3 steps (a few seconds)
    python examples/training_rollout.py --checkpoint              # recompute every block in the backward
    python examples/training_rollout.py --grad-chunks 2           # gradients through the last 2 chunks only
    python examples/training_rollout.py --compile                 # torch.compile(fullgraph=True) the model
    python examples/training_rollout.py --device cuda --preset wan2.1-1.3b --checkpoint

Prints per step the loss, the gradient norm, the step time, the peak pages in use
(``cache.stats().peak_pages_used`` since the step's ``reset_peak()``), the page references the scope held at
the backward and the pages in use after it. ``--compile`` counts the compiled frames
(``CompileCounterWithBackend``): two for the whole run (grad mode is part of dynamo's guards: one graph
for the ``no_grad`` forwards, one for the exit forwards with gradients). The summary goes to
``--json`` (default ``outputs/training_rollout.json``). Exit status 1 if a loss or gradient norm is not
finite, pages stayed in use beyond sink + window after a step, or the compiled model recompiled.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import ardiff_modules as am
from ardiff_modules.models.wan_causal_dit import (
    PRESETS,
    WanCausalDiT,
    WanConfig,
    build_model,
    kv_pool_pages,
    make_kv_spec,
    torch_threads,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling example, when run from anywhere

from streaming_generation import Prompts, check_device_and_preset  # noqa: E402

BRANCH = ("cond",)  #: the generator trains without CFG: one stream
#: Compiled frames expected for the whole run: one graph without gradients, one with.
COMPILED_FRAMES = 2


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Self-Forcing-style training steps (rollout with the paged KV cache, backward, AdamW).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model / cache geometry")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--train-steps", type=int, default=3, help="training steps (one rollout + backward + AdamW each)")
    p.add_argument("--chunks", type=int, default=8, help="chunks per rollout (frames_per_chunk latent frames each)")
    p.add_argument("--steps", type=int, default=4, help="denoising steps per chunk (the exit step is one of them)")
    p.add_argument(
        "--grad-chunks", type=int, default=None, metavar="K",
        help="only the last K chunks' exit forwards run with gradients (default: every chunk)",
    )
    p.add_argument("--context-noise", type=float, default=0.0, help="timestep of the clean commit forward (0..1000)")
    p.add_argument("--checkpoint", action="store_true", help="run every block through scope.checkpoint")
    p.add_argument(
        "--history-grad", choices=("detached", "straight_through"), default="detached",
        help="the scope's history gradients: a constant, or routed to each chunk's exit-step K/V (Self-Forcing's)",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) the model; fail on recompiles")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument("--max-grad-norm", type=float, default=10.0, help="clip the gradients' total norm to this")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, the prompt, the target and the noise")
    p.add_argument("--json", type=Path, default=Path("outputs/training_rollout.json"), help="the summary")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: 1 for tiny on CPU)")
    p.add_argument("--allow-big-cpu", action="store_true", help="allow a large preset on CPU (tens of GiB)")
    # Hidden: the compile backend ("aot_eager" traces forward and backward without inductor; tests stay fast).
    p.add_argument("--compile-backend", default="inductor", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for flag in ("train_steps", "chunks", "steps"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')}: expected >= 1, got {getattr(args, flag)}")
    if args.grad_chunks is None:
        args.grad_chunks = args.chunks
    if not 0 <= args.grad_chunks <= args.chunks:
        p.error(f"--grad-chunks: expected 0..{args.chunks} (--chunks), got {args.grad_chunks}")
    if not 0.0 <= args.context_noise < 1000.0:
        p.error(f"--context-noise: expected a timestep in [0, 1000), got {args.context_noise}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads: expected >= 1, got {args.threads}")
    if args.compile and args.checkpoint:
        # TrainingScope.checkpoint is host code (it freezes the forward's contexts under the cache's lock), which
        # dynamo cannot trace into a fullgraph model.
        p.error("--checkpoint with --compile: expected one of them (scope.checkpoint does not trace under fullgraph=True)")
    if args.compile and args.history_grad == "straight_through":
        p.error("--history-grad straight_through with --compile: expected one of them (the ledger runs eagerly)")
    check_device_and_preset(p, args)
    return args


# ------------------------------------------------------------------------------------ optimizer
class MasterWeightsAdamW:
    """AdamW over float32 master copies of the model's trainable parameters.

    A float32 model is its own master (nothing copied). A bfloat16 model's gradients are cast to float32,
    clipped and applied to the masters, which are then copied back into the model.
    """

    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float, max_grad_norm: float) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in self.params]
        self.optimizer = torch.optim.AdamW(self.masters, lr=lr, weight_decay=weight_decay)
        self.max_grad_norm = max_grad_norm

    def step(self) -> dict[str, Any]:
        """Clip, update, zero the gradients. Returns ``grad_norm`` (the total norm before clipping),
        ``update_norm`` (of the change of the master weights) and ``params_without_grad`` (the names of the
        parameters no gradient reached; AdamW skips them)."""
        for param, master in zip(self.params, self.masters):
            if master is not param:
                master.grad = None if param.grad is None else param.grad.float()
        with_grad = [m for m in self.masters if m.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(with_grad, self.max_grad_norm) if with_grad else torch.zeros(())
        before = [m.detach().clone() for m in with_grad]
        self.optimizer.step()
        update = sum(float((m.detach() - b).double().square().sum()) for m, b in zip(with_grad, before))
        without = [n for n, m in zip(self.names, self.masters) if m.grad is None]
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for param, master in zip(self.params, self.masters):
                param.grad = None
                if master is not param:
                    param.copy_(master)
        return {"grad_norm": float(norm), "update_norm": math.sqrt(update), "params_without_grad": without}


# ------------------------------------------------------------------------------------ the rollout
@dataclass
class Trainer:
    """The model, its cache and session, and one training step (:meth:`train_step`)."""

    args: argparse.Namespace
    config: WanConfig
    model: WanCausalDiT
    step_fn: Callable[..., torch.Tensor]
    cache: am.KVCache
    state: am.KVState
    prompts: Prompts
    optimizer: MasterWeightsAdamW
    target: torch.Tensor  # float32 [chunks, F, C, H, W], the stand-in loss's fixed target

    @property
    def device(self) -> torch.device:
        return self.target.device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def forward(
        self, x: torch.Tensor, t: float, *, commit: bool, scope: am.TrainingScope | None = None
    ) -> torch.Tensor:
        """One forward of the chunk ``x`` ``[1, F, C, H, W]`` (float32) at timestep ``t``; returns the clean
        prediction ``x0 = x - (t / 1000) v`` (float32). Gradients iff grad mode is on; ``scope``: checkpoint
        every block through it."""
        dtype = self.model.patch_embedding.weight.dtype
        ts = torch.full((1,), t, device=self.device)  # a tensor: the compiled graph does not specialise on t
        run_block = scope.checkpoint if scope is not None and self.args.checkpoint else None
        with self.state.prepare_forward(BRANCH, self.config.chunk_size, commit_current=commit) as fwd:
            v = self.step_fn(x.to(dtype), ts, fwd.layers, run_block=run_block)
        return x - (t / 1000.0) * v.float()

    def chunk(self, exit_step: int, grad: bool, noise: torch.Generator, scope: am.TrainingScope) -> torch.Tensor:
        """Denoise one chunk until ``exit_step``, then commit it; returns the exit forward's ``x0``."""
        timesteps = torch.linspace(1000.0, 0.0, self.args.steps + 1).tolist()[:-1]
        shape = (1, self.config.frames_per_chunk, self.config.in_channels, self.config.latent_height,
                 self.config.latent_width)

        def fresh_noise() -> torch.Tensor:
            return torch.randn(shape, generator=noise).to(self.device)

        x = fresh_noise()
        with torch.no_grad():  # the steps before the exit: their outputs only feed the next step's input
            for i in range(exit_step):
                x0 = self.forward(x, timesteps[i], commit=False)
                s = timesteps[i + 1] / 1000.0
                x = (1 - s) * x0 + s * fresh_noise()
        with torch.set_grad_enabled(grad):  # the exit step: the chunk's output
            x0 = self.forward(x, timesteps[exit_step], commit=False, scope=scope)
        s = self.args.context_noise / 1000.0
        with torch.no_grad():  # the clean commit: its K/V become the next chunks' history
            self.forward((1 - s) * x0.detach() + s * fresh_noise(), self.args.context_noise, commit=True)
        return x0

    def train_step(self, step: int) -> dict[str, Any]:
        """One rollout of ``--chunks`` chunks inside a :class:`TrainingScope`, the backward, one AdamW step."""
        args, cache = self.args, self.cache
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)  # the same on every rank
        exits = torch.randint(args.steps, (args.chunks,), generator=g).tolist()
        self.state.reset()  # a new video per step
        self.prompts.publish(self.state, BRANCH)
        cache.reset_peak()
        self.sync()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        with am.TrainingScope(cache, history_grad=args.history_grad) as scope:
            outputs = [
                self.chunk(exit_step, k >= args.chunks - args.grad_chunks, g, scope) for k, exit_step in enumerate(exits)
            ]
            loss = torch.nn.functional.mse_loss(torch.cat(outputs), self.target)  # the stand-in loss
            if loss.requires_grad:
                loss.backward()
            held = scope.held_pages  # references the scope took (one per gradient forward and page)
            update = self.optimizer.step()
        self.sync()
        return {
            "step": step,
            "loss": float(loss.detach()),
            **update,
            "exit_steps": exits,
            "step_s": time.perf_counter() - start,
            "peak_pages": cache.stats().peak_pages_used,
            "held_pages": held,
            "pages_after_step": cache.stats().pages_used,
            # activations, weights, optimizer state and the KV pool together
            "cuda_peak_gib": torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None,
        }


# ------------------------------------------------------------------------------------ the run
def build_trainer(args: argparse.Namespace) -> tuple[Trainer, Any]:
    """The model (trainable), the cache sized for the step's holds, the session; and the compile counter."""
    device = torch.device(args.device)
    config = WanConfig.preset(args.preset)
    model = build_model(config, seed=args.seed, device=device).requires_grad_(True).train()
    spec = make_kv_spec(config, device, branches=BRANCH)
    # Per step the pool holds sink + window + the pending chunk, plus the evicted chunks the scope still
    # holds for the backward: fewer than --grad-chunks (those read by gradient forwards, minus the window).
    cache = am.KVCache(spec, num_pages=kv_pool_pages(spec, slack_chunks=max(1, args.grad_chunks)), device=device)
    state = cache.open_session("train")
    step_fn: Callable[..., torch.Tensor] = model
    counter = None
    if args.compile:
        from torch._dynamo.testing import CompileCounterWithBackend

        counter = CompileCounterWithBackend(args.compile_backend)
        step_fn = torch.compile(model, backend=counter, fullgraph=True)
    g = torch.Generator().manual_seed(args.seed + 3)
    target = torch.randn(
        (args.chunks, config.frames_per_chunk, config.in_channels, config.latent_height, config.latent_width), generator=g
    )
    optimizer = MasterWeightsAdamW(model, args.lr, args.weight_decay, args.max_grad_norm)
    trainer = Trainer(args, config, model, step_fn, cache, state, Prompts(config, args.seed, model), optimizer,
                      target.to(device))
    return trainer, counter


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train per the command line ``argv``; returns the summary (also printed and written to ``--json``)."""
    args = parse_args(argv)
    with torch_threads(args.threads, args.preset, args.device):
        return _train(args)


def _train(args: argparse.Namespace) -> dict[str, Any]:
    trainer, counter = build_trainer(args)
    config, spec = trainer.config, trainer.cache.spec
    params = sum(p.numel() for p in trainer.model.parameters())
    print(
        f"model: {config.name}  {params / 1e6:.2f}M params  {config.num_layers} layers  dim {config.dim}  "
        f"({trainer.model.patch_embedding.weight.dtype} compute, float32 AdamW, {args.device}, random weights)"
    )
    print(
        f"cache: {trainer.cache.stats().num_pages} pages x {spec.page_size} tokens ({spec.pages_per_chunk} per chunk), "
        f"sink {spec.sink_chunks} + window {spec.window_chunks} chunks; rollout {args.chunks} chunks x {args.steps} "
        f"steps, gradients through the last {args.grad_chunks}, checkpoint {args.checkpoint}, compile {args.compile}"
    )
    window_used = min(spec.window_chunks, max(0, args.chunks - spec.sink_chunks))
    # with contiguous extents (FlashInfer on CUDA) a branch's sinks and window live in one ring of
    # extent_chunks slots (sink + window + the pending chunk's slot), allocated whole
    extent = trainer.cache.extent_chunks
    resident = (extent if extent is not None else spec.sink_chunks + window_used) * spec.pages_per_chunk
    rows = []
    for step in range(args.train_steps):
        row = trainer.train_step(step)
        rows.append(row)
        print(
            f"step {step}: loss {row['loss']:.5f}  grad norm {row['grad_norm']:.4g}  {row['step_s']:.2f} s  "
            f"peak {row['peak_pages']} pages  held {row['held_pages']} page refs at the backward  "
            f"{row['pages_after_step']} pages after (sink + window{' ring' if trainer.cache.extent_chunks else ''}: {resident})"
            + (f"  CUDA peak {row['cuda_peak_gib']:.1f} GiB" if row["cuda_peak_gib"] is not None else ""),
            flush=True,
        )
    summary = _summary(args, trainer, counter, rows, resident)
    trainer.state.close()
    summary["pages_used_after_close"] = trainer.cache.stats().pages_used
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=1) + "\n")
    summary["json"] = str(args.json)
    if counter is not None:
        print(f"torch.compile({args.compile_backend}, fullgraph=True): compiled frames {counter.frame_count} "
              f"(expected {COMPILED_FRAMES}: without and with gradients)")
    print(f"wrote {args.json}")
    return summary


def _summary(
    args: argparse.Namespace, trainer: Trainer, counter: Any, rows: list[dict[str, Any]], resident: int
) -> dict[str, Any]:
    spec = trainer.cache.spec
    return {
        "preset": trainer.config.name,
        "device": args.device,
        "compute_dtype": str(trainer.model.patch_embedding.weight.dtype),
        "train_steps": args.train_steps,
        "chunks": args.chunks,
        "steps": args.steps,
        "grad_chunks": args.grad_chunks,
        "context_noise": args.context_noise,
        "checkpoint": args.checkpoint,
        "compile": args.compile,
        "compiled_frames": counter.frame_count if counter is not None else None,
        "num_pages": trainer.cache.stats().num_pages,
        "pages_per_chunk": spec.pages_per_chunk,
        "sink_chunks": spec.sink_chunks,
        "window_chunks": spec.window_chunks,
        "resident_pages": resident,  # sink + window chunks (the window's ring with extents): held after each step
        "per_step": rows,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; exit status 1 on a non-finite loss or gradient, leaked pages or a recompile."""
    summary = run(argv)
    problems = []
    for row in summary["per_step"]:
        if not (math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])):
            problems.append(f"step {row['step']}: loss {row['loss']}, grad norm {row['grad_norm']}")
        if row["pages_after_step"] != summary["resident_pages"]:
            problems.append(f"step {row['step']}: expected {summary['resident_pages']} pages in use after the step "
                            f"(sink + window, the window's ring with contiguous extents), got {row['pages_after_step']}")
    if summary["compiled_frames"] not in (None, COMPILED_FRAMES):
        problems.append(f"expected {COMPILED_FRAMES} compiled frames, got {summary['compiled_frames']}")
    if summary["pages_used_after_close"] != 0:
        problems.append(f"expected 0 pages in use after close, got {summary['pages_used_after_close']}")
    for problem in problems:
        print(f"ERROR: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
