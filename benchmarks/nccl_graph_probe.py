"""Diagnose CUDA-graph capture of NCCL functional collectives, stage by stage (run with torchrun).

    torchrun --nproc-per-node 2 benchmarks/nccl_graph_probe.py [--stages raw,raw_thread_local,library]

Stages:
  raw               an all_to_all_single (functional collective) captured in a CUDA graph with the default
                    capture_error_mode, replayed 3 times, checked against an eager all-to-all.
  raw_thread_local  the same with capture_error_mode="thread_local".
  library           DistributedCUDAGraphStep over a tiny parallelized model (FlashInfer, Ulysses), replayed
                    over committing forwards, checked against the eager distributed step.

Every rank prints a line per step with a timestamp, and dumps every thread's Python stack if it is still
running after ``--dump-after`` seconds (a hang shows where each rank waits). Not a test: a tool to find
where a capture hangs on a given torch / NCCL.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
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


def stage_library() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    import _distributed_workers as workers

    say(f"library: check_graph_rollout(({dist.get_world_size()},), ('sp',)) starting")
    workers.check_graph_rollout((dist.get_world_size(),), ("sp",))
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
