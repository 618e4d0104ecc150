"""Diagnose CUDA-graph capture of NCCL functional collectives, stage by stage (run with torchrun).

    torchrun --nproc-per-node 2 -m benchmarks.nccl_graph_probe [--stages raw,raw_thread_local,library]

Stages:
  raw               an all_to_all_single (functional collective) captured in a CUDA graph with the default
                    capture_error_mode, replayed 3 times, checked against an eager all-to-all.
  raw_thread_local  the same with capture_error_mode="thread_local".
  library           DistributedCUDAGraphStep over a tiny parallelized model (``_models.TinyStreamingModel``,
                    FlashInfer, Ulysses over every rank): whole steps captured once per static forward
                    context and replayed over a rollout of denoising and committing forwards, checked
                    forward by forward against the same rollout run eagerly. (``tests/test_distributed.py``
                    holds the full check: prompt switch, the single-GPU run, page tables across ranks.)

Every rank prints a line per step with a timestamp, and dumps every thread's Python stack if it is still
running after ``--dump-after`` seconds (a hang shows where each rank waits). Not a test: a tool to find
where a capture hangs on a given torch / NCCL.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import faulthandler
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[rank {dist.get_rank()} {time.monotonic() - T0:7.1f}s] {msg}", flush=True)


def _a2a(x: torch.Tensor) -> torch.Tensor:
    out = funcol.all_to_all_single(x, None, None, dist.group.WORLD)
    return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out


def stage_raw(mode: str) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    x = torch.arange(world * 8, dtype=torch.float32, device="cuda").reshape(world, 8) + 100 * rank
    expected = _a2a(x.clone())
    say(f"raw/{mode}: eager all-to-all done")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _a2a(x * 1)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    say(f"raw/{mode}: warm-up done, capturing")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=mode):
        out = _a2a(x * 1)
    say(f"raw/{mode}: captured")
    for i in range(3):
        graph.replay()
        torch.cuda.synchronize()
        say(f"raw/{mode}: replay {i} equal={torch.equal(out, expected)}")
        # An eager collective on the same communicator between replays (as the tests interleave them).
        eager = _a2a(x * 1)
        torch.cuda.synchronize()
        say(f"raw/{mode}: eager after replay {i} equal={torch.equal(eager, expected)}")
    assert torch.equal(out, expected), (out, expected)
    gathered = funcol.all_gather_tensor(x, 0, dist.group.WORLD)
    gathered = gathered.wait() if isinstance(gathered, funcol.AsyncCollectiveTensor) else gathered
    graph2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph2, capture_error_mode=mode):
        g = funcol.all_gather_tensor(x * 1, 0, dist.group.WORLD)
        g = g.wait() if isinstance(g, funcol.AsyncCollectiveTensor) else g
    graph2.replay()
    graph.replay()
    torch.cuda.synchronize()
    say(f"raw/{mode}: all-gather graph then a2a graph replayed: equal={torch.equal(g, gathered)}")


#: The library stage's model and cache (the tests' sizes: FlashInfer builds head_dim 64).
CHUNK, PAGE, HEADS, KV_HEADS, HEAD_DIM, CONTEXT_DIM = 8, 4, 4, 2, 64, 12
BRANCHES = ("cond", "uncond")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def _library_setup(device: str) -> tuple[torch.nn.Module, list, list, object]:
    """A parallelized tiny model, Ulysses over every rank, two distributed caches (eager, graphed) with the
    prompt populated: ``(parallel model, caches, sessions, mesh)``."""
    from torch.distributed.device_mesh import init_device_mesh

    import ardiff_modules as am
    from ardiff_modules.distributed import DistributedKVCache, ParallelMesh, parallelize
    from benchmarks._models import TinyStreamingModel

    cuda = device == "cuda"
    backend, dtype = ("flashinfer", "bfloat16") if cuda else ("reference", "float32")
    head_dim = HEAD_DIM if cuda else 8
    torch.manual_seed(0)
    model = TinyStreamingModel(dim=head_dim * HEADS, heads=HEADS, kv_heads=KV_HEADS, layers=2,
                               context_dim=CONTEXT_DIM).eval().to(device, getattr(torch, dtype))
    spec = dataclasses.replace(model.spec(CHUNK, PAGE, 1, 2, branches=BRANCHES), dtype=dtype, num_qo_heads=HEADS)
    world = dist.get_world_size()
    mesh = ParallelMesh(init_device_mesh(device, (world,), mesh_dim_names=("sp",)), BRANCHES, cfg_dim=None,
                        sp_dim="sp")
    parallel = copy.deepcopy(model)
    parallelize(parallel, mesh)
    caches = [DistributedKVCache(spec, mesh, num_pages=96, device=device, backend=backend, debug_checks=True)
              for _ in range(2)]
    states = [cache.open_session("s0") for cache in caches]
    text = torch.randn(len(BRANCHES), 5, CONTEXT_DIM, generator=torch.Generator().manual_seed(6))
    for state in states:
        for i, branch in enumerate(BRANCHES):
            if branch in mesh.local_branches:  # each rank populates only its branches (its heads)
                am.populate_cross_attention(state, branch, [blk.cross for blk in parallel.blocks],
                                            text[i].to(device, getattr(torch, dtype)))
    return parallel, caches, states, mesh


def stage_library(device: str = "cuda", steps: int = 7) -> None:
    """``steps`` x (2 denoising + 1 committing forward) of one chunk, eager and as graph replays, compared."""
    from ardiff_modules.distributed import DistributedCUDAGraphStep

    say(f"library: graph rollout, Ulysses over ({dist.get_world_size()},) ranks, starting")
    parallel, (eager_cache, graph_cache), (eager_state, graph_state), mesh = _library_setup(device)
    dtype = next(parallel.parameters()).dtype
    g = torch.Generator().manual_seed(7)

    def whole_step(x: torch.Tensor, layers: list) -> torch.Tensor:  # this rank's tokens in, every token out
        return mesh.gather(parallel(x, layers))

    with DistributedCUDAGraphStep(whole_step, mesh) as step, torch.no_grad():  # graphs freed before the group
        for i in range(3 * steps):
            x = torch.randn(len(BRANCHES), CHUNK, parallel.dim, generator=g).to(device, dtype)
            commit = i % 3 == 2
            with eager_cache.prepare_forward(eager_state, CHUNK, commit) as fwd:
                eager = whole_step(mesh.scatter(x), fwd.layers)
            with graph_cache.prepare_forward(graph_state, CHUNK, commit, static=True) as fwd:
                what = "capture" if step.will_capture(fwd) else "replay"
                graphed = step(fwd, mesh.scatter(x))
            err = _rel(graphed, eager)
            say(f"library: forward {i} ({what}, commit={commit}): rel err vs eager {err:.1e}")
            assert err < 3e-2, f"forward {i}: graph vs eager, rel err {err:.2e}"
    for cache in (eager_cache, graph_cache):
        cache.close()
    say("library: passed")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", default="raw,raw_thread_local,library")
    p.add_argument("--dump-after", type=float, default=90.0, help="dump every thread's stack after this many s")
    args = p.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", timeout=timedelta(seconds=120), device_id=torch.device("cuda", rank))
    faulthandler.dump_traceback_later(args.dump_after, repeat=True, exit=False)
    say(f"torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}")
    for stage in args.stages.split(","):
        try:
            if stage == "raw":
                stage_raw("global")
            elif stage == "raw_thread_local":
                stage_raw("thread_local")
            elif stage == "library":
                stage_library()
            else:
                raise SystemExit(f"unknown stage {stage!r}")
        except Exception as e:  # noqa: BLE001 -- a diagnostic: report and go on to the next stage
            say(f"{stage}: FAILED {type(e).__name__}: {e}")
    faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
