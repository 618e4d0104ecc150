"""Multi-GPU benchmark: one chunk step with CFG-parallel, Ulysses sequence parallelism, or neither.

One **chunk step** = 4 denoising forwards (``commit_current=False``) + 1 committing forward of one
chunk with classifier-free guidance (branches ``("cond", "uncond")``), sink 1 + window 6 chunks, over a
stack of Wan-style blocks built from the library's modules (norm -> ``ChunkSelfAttention`` (RMSNorm q/k,
RoPE) -> ``CachedCrossAttention`` to a 512-token prompt -> GELU FFN; the patch embedding, time
modulation and head of a full DiT are left out: they are per-token work that every layout splits alike).
Shapes (``--shapes``):

* ``wan2.1-1.3b`` -- 12 heads x 128 (dim 1536, FFN 8960), 4680-token chunks, 30 blocks.
* ``wan-14b``     -- 40 heads x 128 (dim 5120, FFN 13824), 4680-token chunks, ``--layers-14b`` blocks
                     (default 10 of Wan-14B's 40: the time per block is what matters; ratios do not
                     change with depth).

Layouts on ``N`` GPUs (``--layouts``; the same seeded weights and inputs on every rank):

* ``single``   -- rank 0 alone runs both branches (2 streams, every token, every head): the baseline.
* ``cfg``      -- CFG-parallel: ``cond`` on half the GPUs, ``uncond`` on the other half; with ``N > 2``
                  the halves are Ulysses groups of ``N / 2`` (a ``(2, N/2)`` mesh ``("cfg", "sp")``).
* ``ulysses``  -- Ulysses over all ``N`` GPUs: both branches on every rank, ``1/N`` of the tokens outside
                  attention, ``1/N`` of the heads inside it (2 all-to-alls per self-attention: q/k/v
                  fused, the output; 2 per cross-attention, none with ``--cross-attention tokens``).

``--graph``: every forward is prepared with ``static=True`` and the whole model step is replayed from
a CUDA graph (``CUDAGraphStep`` for ``single``, ``DistributedCUDAGraphStep`` for the parallel layouts:
the all-to-alls and the model in one graph per rank, captured once, NCCL inside), so host launch
overhead is out of the comparison.

Timing: every layout warms up until its window is full and has evicted once, then times
``--steps`` chunk steps one by one (``_timing.each_call``: each step between two reads of
``torch.utils.benchmark``'s clock, which synchronises this rank's device). A step's time is the
slowest rank's (the ranks' per-step times are all-reduced with MAX). Reported: median ms per chunk
step with IQR, speed-up vs ``single`` (targets: CFG-parallel on 2 GPUs >= 1.9x; Ulysses on 2 GPUs at
the 14B shape >= 1.8x), and, for layouts with an SP group, the **all-to-all share** of the step
(target at the 14B shape: <= 10 %), measured two ways:

* ``a2a_share`` -- one extra eager step with CUDA events around each collective only
  (``SequenceParallel.all_to_all``: the NCCL kernel and the wait for the peer; not the layout copies
  around it), summed over the step, divided by the median step time. ``a2a_share_with_layout`` also
  counts the copies that build send buffers and unpack receive buffers (the old, upper-bound figure).
* ``a2a_share_by_removal`` -- the same ``--steps`` steps (eager or graph, as timed) with every
  all-to-all replaced by a local copy of the same size (``send.clone()``: the same bytes written, no
  communication, no waiting for the peer): ``1 - no_comm_ms / ms``. The outputs of those steps are
  wrong (each rank keeps its own blocks); they are timed after the agreement check.

Checked: the last committed forward's outputs (gathered) agree with ``single``'s (relative error
norm <= 3e-2 in bf16); exit status 1 otherwise.

    python -m benchmarks.multi_gpu                                # spawns one process per visible GPU
    torchrun --nproc-per-node 2 -m benchmarks.multi_gpu          # or under torchrun
    python -m benchmarks.multi_gpu --shapes wan-14b --steps 5 --out /tmp/mgpu
    python -m benchmarks.multi_gpu --graph --layouts single,cfg,ulysses --out /tmp/mgpu-graph

Writes ``multi_gpu.json`` (config, per shape and layout: mesh, ms per chunk step (median, IQR,
samples), speed-up vs single, all-to-all ms and shares, agreement; run metadata) and ``multi_gpu.png``
(``multi_gpu_graph.json`` / ``.png`` with ``--graph``) into ``--out DIR``; by default the committed
results, ``benchmarks/results/multi_gpu_<device>x<N>.json`` / ``.png`` (``multi_gpu_h200x2.json``).
Needs CUDA, FlashInfer and at least 2 GPUs; exits 2 with one line otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._plotting import bars, legend_below, pyplot, save, spread, wrap
from benchmarks._timing import Stats, each_call, fail, parser, require_gpu, result_path, save_json

LAYOUTS = ("single", "cfg", "ulysses")
BRANCHES = ("cond", "uncond")
DENOISING_FORWARDS = 4
TARGETS = {"cfg_speedup_2gpu": 1.9, "ulysses_speedup_2gpu_14b": 1.8, "a2a_share_14b_max": 0.10}
TOLERANCE = 3e-2


@dataclass(frozen=True)
class Shape:
    name: str
    dim: int
    heads: int
    ffn: int
    layers: int
    chunk: int = 4680
    page: int = 120
    sink: int = 1
    window: int = 6
    text_tokens: int = 512

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


def shapes(layers_13b: int, layers_14b: int) -> dict[str, Shape]:
    return {
        "wan2.1-1.3b": Shape("wan2.1-1.3b", 1536, 12, 8960, layers_13b),
        "wan-14b": Shape("wan-14b", 5120, 40, 13824, layers_14b),
        # --device cpu: a dry run of every code path (gloo, reference backend), not a measurement.
        "tiny": Shape("tiny", 64, 4, 128, 2, chunk=48, page=16, sink=1, window=2, text_tokens=8),
    }


SHAPE_NAMES = ("wan2.1-1.3b", "wan-14b", "tiny")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--shapes", default=None,
                   help="comma-separated from wan2.1-1.3b, wan-14b, tiny (default: the first two; tiny on CPU)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a dry run on gloo + the reference backend in float32 (checks the code paths, "
                        "measures nothing meaningful)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated subset of {LAYOUTS}")
    p.add_argument("--gpus", type=int, default=None,
                   help="processes to spawn (default: every visible GPU; 2 with --device cpu)")
    p.add_argument("--steps", type=int, default=5, help="chunk steps timed per layout (median reported)")
    p.add_argument("--warmup-steps", type=int, default=None, help="default sink + window + 2 (one eviction)")
    p.add_argument("--layers-13b", type=int, default=30, help="blocks at the 1.3B shape (Wan2.1-1.3B: 30)")
    p.add_argument("--layers-14b", type=int, default=10, help="blocks at the 14B shape (Wan-14B: 40)")
    p.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) the block stack")
    p.add_argument("--graph", action="store_true",
                   help="static forwards, the whole step replayed from a CUDA graph (CUDA only)")
    p.add_argument("--fuse-qkv", choices=("auto", "on", "off"), default="auto",
                   help="SequenceParallel.fuse_qkv: q/k/v in one all-to-all (auto: when a rank has 2+ streams)")
    p.add_argument("--cross-attention", choices=("heads", "tokens"), default="heads",
                   help="Ulysses cross-attention: head shards (2 all-to-alls per block, caches / P) or this "
                        "rank's tokens with every head (no all-to-all, every head cached)")
    p.add_argument("--profile", action="store_true",
                   help="after timing, profile one chunk step per layout on every rank (torch.profiler): writes "
                        "OUT/profile_<shape>_<layout>_rank<r>.txt (default: benchmarks/results/multi_gpu_profile_"
                        "<shape>_<layout>_rank<r>_<device>x<N>.txt), the top device kernels by total time")
    p.add_argument("--no-removal", action="store_true",
                   help="skip the all-to-alls-replaced-by-local-copies variant (saves --steps steps per SP layout)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None,
                   help="folder for multi_gpu.json / .png (default: the committed results, "
                        "benchmarks/results/multi_gpu_<device>x<N>.json / .png)")
    args = p.parse_args(argv)
    args.prog = p.prog
    if args.shapes is None:
        args.shapes = "tiny" if args.device == "cpu" else "wan2.1-1.3b,wan-14b"
    unknown = sorted(set(args.shapes.split(",")) - set(SHAPE_NAMES))
    if unknown:
        fail(p.prog, f"--shapes: expected names from {SHAPE_NAMES}, got {unknown}")
    bad = sorted(set(args.layouts.split(",")) - set(LAYOUTS))
    if bad:
        fail(p.prog, f"--layouts: expected names from {LAYOUTS}, got {bad}")
    if args.steps < 1:
        fail(p.prog, f"--steps: expected >= 1, got {args.steps}")
    if args.graph and args.device != "cuda":
        fail(p.prog, "--graph: CUDA graphs need --device cuda")
    return args


# ----------------------------------------------------------------------------------------- the model
def build_stack(shape: Shape, device: Any, dtype: Any, seed: int) -> Any:
    """``shape.layers`` Wan-style blocks (same weights for a seed on every rank)."""
    import torch
    from torch import nn

    from ardiff_modules import CachedCrossAttention, ChunkSelfAttention
    from ardiff_modules.modules.rotary import RotaryEmbedding

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = shape.dim
            self.norm1 = nn.LayerNorm(d, elementwise_affine=False)
            self.attn = ChunkSelfAttention(d, shape.heads, qk_norm="full", param_names="wan")
            self.norm3 = nn.LayerNorm(d)
            self.cross = CachedCrossAttention(d, shape.heads, "text", qk_norm="full", param_names="wan")
            self.norm2 = nn.LayerNorm(d, elementwise_affine=False)
            self.ffn = nn.Sequential(nn.Linear(d, shape.ffn), nn.GELU(approximate="tanh"), nn.Linear(shape.ffn, d))

        def forward(self, x: Any, kv: Any, rope: Any) -> Any:
            x = x + self.attn(self.norm1(x), kv, rope)
            x = x + self.cross(self.norm3(x), kv)
            return x + self.ffn(self.norm2(x))

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(shape.layers))
            self.rope = RotaryEmbedding(shape.head_dim)

        def forward(self, x: Any, layers: Any) -> Any:
            for block, kv in zip(self.blocks, layers):
                x = block(x, kv, self.rope)
            return x

    cuda = [torch.cuda.current_device()] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), torch.device(device):
        torch.manual_seed(seed)
        stack = Stack()
        for m in stack.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
    return stack.to(dtype).eval().requires_grad_(False)


def kv_spec(shape: Shape, dtype: str) -> Any:
    import ardiff_modules as am

    return am.KVCacheSpec(
        num_layers=shape.layers, num_kv_heads=shape.heads, num_qo_heads=shape.heads, head_dim=shape.head_dim,
        chunk_size=shape.chunk, page_size=shape.page, sink_chunks=shape.sink, window_chunks=shape.window,
        branches=BRANCHES, cross_attention=(am.CrossAttentionSpec("text", shape.text_tokens),), dtype=dtype,
    )


def pages_needed(spec: Any, branches: int) -> int:
    """Per branch: (sinks + window + pending) chunks, plus one spare chunk (the examples' sizing)."""
    return branches * spec.pages_per_branch(1) + spec.pages_per_chunk


# ----------------------------------------------------------------------------------------- one layout
class _Runner:
    """Drives one layout on this rank: prompt, then chunk steps of 4 denoising + 1 committing forward."""

    def __init__(self, layout: str, shape: Shape, args: argparse.Namespace, world: int) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        import ardiff_modules as am
        from ardiff_modules.distributed import DistributedKVCache, ParallelMesh, parallelize

        self.torch, self.dist, self.am = torch, dist, am
        self.layout, self.shape = layout, shape
        self.rank = dist.get_rank()
        cuda = args.device == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.dtype = torch.bfloat16 if cuda else torch.float32
        spec = kv_spec(shape, "bfloat16" if cuda else "float32")
        self.mesh: Any = None
        self.active = layout != "single" or self.rank == 0
        # Idle ranks of the single-GPU baseline hold nothing.
        self.model = build_stack(shape, self.device, self.dtype, args.seed) if self.active else None
        if layout == "single":
            self.cache: Any = am.KVCache(spec, num_pages=pages_needed(spec, 2), device=self.device) if self.active else None
            self.branches = BRANCHES
        else:
            if layout == "cfg":
                dims = ((2,), ("cfg",)) if world == 2 else ((2, world // 2), ("cfg", "sp"))
            else:
                dims = ((world,), ("sp",))
            device_mesh = init_device_mesh(self.device.type, dims[0], mesh_dim_names=dims[1])
            self.mesh = ParallelMesh(device_mesh, BRANCHES, cfg_dim="cfg" if "cfg" in dims[1] else None,
                                     sp_dim="sp" if "sp" in dims[1] else None, cross_attention=args.cross_attention)
            local = self.mesh.local_spec(spec)
            self.cache = DistributedKVCache(spec, self.mesh, num_pages=pages_needed(local, len(local.branches)),
                                            device=self.device)
            parallelize(self.model, self.mesh)
            self.branches = self.mesh.local_branches
            if self.mesh.sp is not None:
                self.mesh.sp.fuse_qkv = {"auto": None, "on": True, "off": False}[args.fuse_qkv]
        self.fn: Callable[..., Any] = self.model
        if args.compile and self.active:
            # dynamic=False: each layout runs the same code at other shapes (see ulysses_rank.py)
            self.fn = torch.compile(self.model, fullgraph=True, dynamic=False)
        #: --graph: the step object replaying ``fn`` (built on first use, again after ``reset_graphs``).
        self.graph = bool(args.graph)
        self.graph_step: Any = None
        # Inputs drawn on the device from one seeded generator: the same values on every rank, no host work.
        self._g = torch.Generator(device=self.device).manual_seed(args.seed + 1)
        self.text = torch.randn(len(BRANCHES), shape.text_tokens, shape.dim, generator=self._g, device=self.device,
                                dtype=self.dtype)
        self.state: Any = None
        if self.active:
            self.state = self.cache.open_session("bench")
            for i, branch in enumerate(BRANCHES):
                if branch in self.branches:
                    am.populate_cross_attention(self.state, branch, [b.cross for b in self.model.blocks], self.text[i])
        self.last: Any = None

    def next_input(self) -> Any:
        # The same latents on every rank (same generator): each rank takes its part.
        return self.torch.randn(len(BRANCHES), self.shape.chunk, self.shape.dim, generator=self._g,
                                device=self.device, dtype=self.dtype)

    def reset_graphs(self) -> None:
        """Drop the captured graphs (every rank): the next graph step captures again."""
        if self.graph_step is not None:
            self.graph_step.clear()
        self.graph_step = None

    def _graph_step(self) -> Any:
        if self.graph_step is None:
            from ardiff_modules.distributed import DistributedCUDAGraphStep
            from ardiff_modules.graphs import CUDAGraphStep

            self.graph_step = (CUDAGraphStep(self.fn) if self.mesh is None
                               else DistributedCUDAGraphStep(self.fn, self.mesh))
        return self.graph_step

    def step(self) -> Any:
        """One chunk step; returns the committing forward's output (this rank's part)."""
        x = self.next_input()
        if not self.active:
            return None
        torch = self.torch
        out = None
        static = self.graph
        with torch.no_grad():
            for i in range(DENOISING_FORWARDS + 1):
                commit = i == DENOISING_FORWARDS
                if self.mesh is None:
                    with self.state.prepare_forward(BRANCHES, self.shape.chunk, commit, static=static) as fwd:
                        out = self._graph_step()(fwd, x) if static else self.fn(x, fwd.layers)
                else:
                    with self.cache.prepare_forward(self.state, self.shape.chunk, commit, static=static) as fwd:
                        local = self.mesh.scatter(x)
                        out = self._graph_step()(fwd, local) if static else self.fn(local, fwd.layers)
        self.last = out
        return out

    def gathered_last(self) -> Any:
        if self.mesh is None:
            return self.last
        return self.mesh.gather(self.last)

    def close(self) -> None:
        self.reset_graphs()
        if self.cache is not None:
            self.cache.close()
        if self.mesh is not None and self.model is not None:
            from ardiff_modules.distributed import parallelize

            parallelize(self.model, None)


class _Mark:
    """A CUDA event with timing, or on the CPU (where collectives are synchronous) a host clock read."""

    def __init__(self, device: Any) -> None:
        import torch

        self.event = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
        self.t = 0.0

    def record(self) -> None:
        import time

        if self.event is not None:
            self.event.record()
        else:
            self.t = time.perf_counter()

    def elapsed_time(self, end: _Mark) -> float:
        """Milliseconds from this mark to ``end`` (CUDA: after a synchronisation)."""
        if self.event is not None:
            return float(self.event.elapsed_time(end.event))
        return (end.t - self.t) * 1e3


@contextlib.contextmanager
def a2a_events(runner: _Runner) -> Any:
    """CUDA events around ``runner``'s SP all-to-alls; yields ``{"collective": pairs, "with_layout": pairs}``.

    ``collective``: around each ``SequenceParallel.all_to_all`` (the NCCL kernel and the wait for the
    peer). ``with_layout``: around each outermost ``to_head_shards[_many]`` / ``to_token_shards`` call
    (also the copies that build the send buffer and unpack the received one).
    """
    pairs: dict[str, list[tuple[Any, Any]]] = {"collective": [], "with_layout": []}
    sp = runner.mesh.sp if runner.mesh is not None else None
    if sp is None:
        yield pairs
        return
    depth = [0]

    def timed(fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            outer = kind == "collective" or depth[0] == 0
            if kind == "with_layout":
                depth[0] += 1
            start, end = _Mark(runner.device), _Mark(runner.device)
            start.record()
            try:
                out = fn(*a, **k)
            finally:
                if kind == "with_layout":
                    depth[0] -= 1
            end.record()
            if outer:
                pairs[kind].append((start, end))
            return out
        return wrapper

    names = ("to_head_shards", "to_head_shards_many", "to_token_shards")
    for name in names:
        setattr(sp, name, timed(getattr(sp, name), "with_layout"))
    sp.all_to_all = timed(sp.all_to_all, "collective")  # type: ignore[method-assign]
    try:
        yield pairs
    finally:
        for name in (*names, "all_to_all"):
            delattr(sp, name)  # back to the class's methods


@contextlib.contextmanager
def local_copies_instead_of_all_to_all(runner: _Runner) -> Any:
    """Replace every all-to-all of ``runner``'s SP group by a local copy of the same size (no communication)."""
    sp = runner.mesh.sp if runner.mesh is not None else None
    if sp is None:
        yield
        return
    sp.all_to_all = lambda send: send.clone()  # type: ignore[method-assign]
    try:
        yield
    finally:
        del sp.all_to_all


def profile_step(runner: _Runner, path: Path) -> None:
    """One chunk step of ``runner`` under ``torch.profiler``; the top device kernels by total time to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        runner.step()
        if runner.device.type == "cuda":
            runner.torch.cuda.synchronize()
    sort = "cuda_time_total" if runner.device.type == "cuda" else "cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=70))


def _a2a_by_events(runner: _Runner, step_ms: float) -> dict[str, Any]:
    """The all-to-alls' time in one extra step, from events around them (slowest rank), and its share of ``step_ms``.

    On the eager, uncompiled model (a compiled graph or a CUDA graph would not see the timing wrappers);
    one step, dynamic forwards.
    """
    import torch
    import torch.distributed as dist

    compiled, graph, runner.fn, runner.graph = runner.fn, runner.graph, runner.model, False
    with a2a_events(runner) as pairs:
        runner.step()
    runner.fn, runner.graph = compiled, graph
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    result: dict[str, Any] = {}
    for kind, key in (("collective", "a2a"), ("with_layout", "a2a_with_layout")):
        ms = torch.tensor(sum(s.elapsed_time(e) for s, e in pairs[kind]), dtype=torch.float64, device=runner.device)
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        result[f"{key}_ms_per_step"] = float(ms)
        result[f"{key}_share"] = float(ms) / step_ms
    result["a2a_calls_per_step"] = len(pairs["collective"])
    return result


def _a2a_by_removal(runner: _Runner, steps: int, step_ms: float) -> dict[str, Any]:
    """The same ``steps`` steps, as timed (eager / compiled / graph), with local copies for the collectives."""
    import torch
    import torch.distributed as dist

    runner.reset_graphs()  # a graph captured with the collectives would keep running them
    with local_copies_instead_of_all_to_all(runner):
        runner.step()  # (re)capture, recompile
        dist.barrier()
        removed, _ = each_call(runner.step, steps)
    runner.reset_graphs()
    mine = torch.tensor(removed.samples_ms, dtype=torch.float64, device=runner.device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    no_comm = Stats.from_ms(mine.tolist())
    return {"no_comm_ms_per_chunk_step": no_comm.median_ms, "no_comm_ms_per_chunk_step_stats": no_comm.as_dict(),
            "a2a_share_by_removal": 1.0 - no_comm.median_ms / step_ms}


def measure_layout(layout: str, shape: Shape, args: argparse.Namespace, world: int,
                   reference: Any) -> tuple[dict[str, Any], Any]:
    """Time ``layout`` on every rank; returns (rank 0's result dict, the gathered last output)."""
    import torch
    import torch.distributed as dist

    runner = _Runner(layout, shape, args, world)
    try:
        warmup = args.warmup_steps if args.warmup_steps is not None else shape.sink + shape.window + 2
        for _ in range(warmup):
            runner.step()
        dist.barrier()
        stats, _ = each_call(runner.step, args.steps)
        # The step of a layout is its slowest rank's: all-reduce MAX per step (idle ranks report 0).
        mine = torch.tensor(stats.samples_ms if runner.active else [0.0] * args.steps, dtype=torch.float64,
                            device=runner.device)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        step = Stats.from_ms(mine.tolist())
        result: dict[str, Any] = {
            "mesh": None if runner.mesh is None else {"cfg": runner.mesh.cfg_size, "sp": runner.mesh.sp_size},
            "gpus": 1 if layout == "single" else world,
            "ms_per_chunk_step": step.median_ms,
            "ms_per_chunk_step_stats": step.as_dict(),
        }
        # The last timed step's output, before the profiling steps below advance the stream once more.
        out = runner.gathered_last() if runner.active else None
        if args.profile and runner.active:
            name = f"profile_{shape.name}_{layout}_rank{dist.get_rank()}.txt"
            profile_step(runner, args.out / name if args.out is not None
                         else result_path(None, f"multi_gpu_{name}", device=args.device, world=world))
        if runner.mesh is not None and runner.mesh.sp is not None:
            result.update(_a2a_by_events(runner, step.median_ms))
            if not args.no_removal:
                result.update(_a2a_by_removal(runner, args.steps, step.median_ms))
        if layout != "single" and reference is not None and out is not None:
            err = float((out.float() - reference.float()).norm() / reference.float().norm().clamp_min(1e-12))
            result["rel_error_vs_single"] = err
            result["agrees"] = err <= TOLERANCE
        return result, out
    finally:
        runner.close()
        del runner
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------- driver
def run_rank(args: argparse.Namespace) -> dict[str, Any] | None:
    """Every rank runs every (shape, layout); rank 0 returns the payload."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    layouts = [name for name in LAYOUTS if name in args.layouts.split(",")]
    table = shapes(args.layers_13b, args.layers_14b)
    results: dict[str, Any] = {}
    agree = True
    for shape_name in args.shapes.split(","):
        shape = table[shape_name]
        per_layout: dict[str, Any] = {}
        reference = None
        for layout in layouts:
            try:
                res, out = measure_layout(layout, shape, args, world, reference)
                if layout == "single":
                    # Every rank needs the reference to check its gathered output: broadcast rank 0's.
                    cuda = args.device == "cuda"
                    ref = out if rank == 0 else torch.empty(
                        len(BRANCHES), shape.chunk, shape.dim, dtype=torch.bfloat16 if cuda else torch.float32,
                        device="cuda" if cuda else "cpu")
                    dist.broadcast(ref, 0)
                    reference = ref
            except Exception as exc:  # noqa: BLE001 - recorded; the other layouts still run
                res = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
                agree = False
            agree &= res.get("agrees", True)
            per_layout[layout] = res
            if rank == 0:
                shares = "".join(
                    f"  {label} {100 * res[key]:.1f}%" for key, label in (
                        ("a2a_share", "a2a"), ("a2a_with_layout_share", "a2a+layout"),
                        ("a2a_share_by_removal", "a2a by removal"))
                    if key in res)
                print(f"{shape_name:12s} {layout:8s} " + (
                    f"{res['ms_per_chunk_step']:9.2f} ms/step{shares}" if "ms_per_chunk_step" in res
                    else res["error"]), flush=True)
        base = per_layout.get("single", {}).get("ms_per_chunk_step")
        for res in per_layout.values():
            if base and "ms_per_chunk_step" in res:
                res["speedup_vs_single"] = base / res["ms_per_chunk_step"]
        results[shape_name] = {"shape": shape.__dict__, "layouts": per_layout}
    if rank != 0:
        return None
    return {
        "benchmark": "multi_gpu",
        "world_size": world,
        "config": {"steps": args.steps, "denoising_forwards": DENOISING_FORWARDS, "branches": BRANCHES,
                   "compile": args.compile, "graph": args.graph, "fuse_qkv": args.fuse_qkv,
                   "cross_attention": args.cross_attention, "device": args.device,
                   "dtype": "bfloat16" if args.device == "cuda" else "float32",
                   "backend": "auto (FlashInfer)" if args.device == "cuda" else "reference (CPU dry run)"},
        "targets": TARGETS,
        "results": results,
        "agree": agree,
    }


def plot(payload: dict[str, Any], path: Path) -> Path | None:
    """ms per chunk step per shape and layout (IQR bars); labels: median ms, speed-up, all-to-all share."""
    plt = pyplot()
    if plt is None:
        return None
    shapes_run = list(payload["results"])
    names: list[str] = []
    for r in payload["results"].values():
        names += [n for n in r["layouts"] if n not in names]
    fig, ax = plt.subplots(figsize=(max(7.0, 2.0 + 1.2 * len(names) * len(shapes_run)), 5.2), layout="constrained")
    width = 0.8 / max(1, len(names))
    top = 0.0
    for i, name in enumerate(names):
        xs, ms, bounds, labels = [], [], [], []
        for j, shape_name in enumerate(shapes_run):
            res = payload["results"][shape_name]["layouts"].get(name)
            if res is None or "ms_per_chunk_step" not in res:
                continue
            xs.append(j + i * width)
            ms.append(res["ms_per_chunk_step"])
            bounds.append(spread(res["ms_per_chunk_step_stats"]))
            label = f"{ms[-1]:.0f}" if ms[-1] >= 100 else f"{ms[-1]:.3g}"
            if "speedup_vs_single" in res and name != "single":
                label += f"\n{res['speedup_vs_single']:.2f}x"
            if "a2a_share" in res:
                label += f"\na2a {100 * res['a2a_share']:.0f}%"
            if "a2a_share_by_removal" in res:
                label += f" / {100 * res['a2a_share_by_removal']:.0f}%"
            labels.append(label)
            top = max(top, ms[-1], bounds[-1][1] if bounds[-1] else 0.0)
        bars(ax, xs, ms, width, bounds=bounds, labels=labels, fontsize=8, label=name)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(shapes_run))], shapes_run)
    ax.set_ylim(0, top * 1.3 if top else 1)
    ax.set_ylabel("ms per chunk step (lower is better)")
    cfg = payload["config"]
    gpu = payload.get("env", {}).get("gpu", "GPU") if cfg.get("device") == "cuda" else "CPU processes (dry run)"
    chunks = sorted({r["shape"]["chunk"] for r in payload["results"].values()})
    modes = "".join(text for key, text in (("compile", ", compiled"), ("graph", ", CUDA graphs")) if cfg.get(key))
    if cfg.get("cross_attention") == "tokens":
        modes += ", Ulysses cross-attention on its own tokens"
    title = (f"CFG-parallel vs Ulysses vs one GPU ({payload['world_size']}x {gpu}); one chunk step = "
             f"{DENOISING_FORWARDS} denoising + 1 commit forward, CFG (2 branches), {'/'.join(map(str, chunks))}-token "
             f"chunks, {cfg.get('dtype', 'bfloat16')}{modes}\n"
             "bar labels: median ms, speed-up vs single, all-to-all share of the step (events around the "
             "collectives / by removal); error bars: IQR")
    ax.set_title(wrap(title, fig, 9), fontsize=9)
    legend_below(fig, ax, ncol=min(len(names), 4))
    return save(plt, fig, path)


def _worker(local_rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    _run_distributed(local_rank, local_rank, world, args)


def _run_distributed(rank: int, local_rank: int, world: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(minutes=10)
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout,
                                device_id=torch.device("cuda", local_rank))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    try:
        payload = run_rank(args)
        if payload is not None:
            name = "multi_gpu_graph" if args.graph else "multi_gpu"
            save_json(result_path(args.out, f"{name}.json", device=args.device, world=world), payload, args=args)
            plot(payload, result_path(args.out, f"{name}.png", device=args.device, world=world))
            if not payload["agree"]:
                print("ERROR: a layout failed or its outputs disagree with single", file=sys.stderr)
        ok = torch.tensor(1 if payload is None or payload["agree"] else 0, device=args.device)
        dist.broadcast(ok, 0)
        if not int(ok):
            raise SystemExit(1)
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":
        require_gpu(args.prog)
    import torch
    import torch.distributed as dist

    if not dist.is_available() or (args.device == "cuda" and not dist.is_nccl_available()):
        fail(args.prog, "needs torch.distributed with NCCL")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        world = int(os.environ["WORLD_SIZE"])
        if world < 2:
            fail(args.prog, f"needs at least 2 GPUs (processes), got WORLD_SIZE={world}")
        try:
            _run_distributed(int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")), world, args)
        except SystemExit as e:
            return int(e.code or 0)
        return 0
    if args.device == "cpu":
        world = args.gpus if args.gpus is not None else 2
        if world < 2:
            fail(args.prog, f"--gpus: expected at least 2 processes, got {world}")
    else:
        world = args.gpus if args.gpus is not None else torch.cuda.device_count()
        if torch.cuda.device_count() < 2 or world < 2 or world > torch.cuda.device_count():
            fail(args.prog, f"needs at least 2 GPUs: {torch.cuda.device_count()} visible, --gpus {args.gpus}")
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    try:
        mp.spawn(_worker, args=(world, port, args), nprocs=world, join=True)
    except mp.ProcessExitedException as e:
        return int(e.exit_code or 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
