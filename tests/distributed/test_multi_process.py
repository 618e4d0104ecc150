"""Multi-process CFG-parallel / Ulysses tests: gloo process groups of 2 and 4 ranks spawned here (CPU, CI).

Each test starts its ranks once and runs several scenarios in them (process start-up is most of
the cost on a 2-core machine); the scenarios live in ``tests/support/distributed_workers.py``. Every scenario compares
with the single-process reference backend, checks page tables across ranks, and injects failures on one
rank. The ``gpu`` variants run the same on NCCL + FlashInfer with 2 CUDA devices.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tests.support import distributed_workers as workers

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)


#: ``fork`` starts ranks warm (they inherit the imported modules): ~3x faster than ``spawn`` on CI.
#: ``ARDIFF_TEST_START=spawn`` switches back (the NCCL tests always spawn: CUDA cannot fork).
START_METHOD = os.environ.get("ARDIFF_TEST_START", "fork")
#: A test whose ranks run longer than this is failed as hung (collectives mismatched across ranks).
DEADLINE_S = 150.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(
    world: int, check: Any, *args: Any, backend: str = "gloo", killed: tuple[int, ...] = (), cuda: bool = False
) -> None:
    """Run ``check(*args)`` on ``world`` fresh processes; a rank's exception fails the test with its traceback.

    ``cuda``: the ranks use CUDA (spawned: a forked child cannot, once the warm-up or an earlier test has).
    ``killed``: ranks that must end by SIGKILL -- their own, or the test's once every other rank has finished
    (a rank left hung on purpose). The other ranks must finish cleanly, whatever happened to those.
    """
    method = "spawn" if backend == "nccl" or cuda else START_METHOD
    if method == "fork":
        workers.warm_up()  # forked ranks inherit what the first library forward imports (~3 s each otherwise)
    limit = DEADLINE_S if backend == "gloo" else 4 * DEADLINE_S  # GPU: first-use kernel JIT builds
    context = mp.start_processes(
        workers.run_worker, args=(world, _free_port(), backend, check, args, limit - 10), nprocs=world,
        join=False, start_method=method,
    )
    deadline = time.monotonic() + limit
    if killed:
        _join_with_killed(context, killed, deadline)
        return
    while not context.join(timeout=1.0):  # raises ProcessRaisedException with a failed rank's traceback
        if time.monotonic() > deadline:
            _kill_all(context)
            pytest.fail(
                f"ranks still running after {limit:.0f} s: a hang (ranks disagreeing on which collective comes "
                "next, e.g. one committed while another aborted)"
            )


def _kill_all(context: Any) -> None:
    for process in context.processes:
        if process.is_alive():
            process.kill()


def _join_with_killed(context: Any, killed: tuple[int, ...], deadline: float) -> None:
    """``context.join`` would kill every rank as soon as one dies: wait for the survivors instead."""
    survivors = [i for i in range(len(context.processes)) if i not in killed]
    while any(context.processes[i].is_alive() for i in survivors):
        if time.monotonic() > deadline:
            _kill_all(context)
            pytest.fail(f"surviving ranks {survivors} still running at the deadline: a hang")
        time.sleep(0.1)
    _kill_all(context)  # ranks left hung on purpose
    for process in context.processes:
        process.join()
    for i in survivors:
        if context.processes[i].exitcode != 0:
            trace = f"exit code {context.processes[i].exitcode}"
            path = context.error_files[i]
            if path is not None and os.path.exists(path) and os.path.getsize(path):
                with open(path, "rb") as fh:
                    trace = pickle.load(fh)
            pytest.fail(f"rank {i} failed:\n{trace}")
    for i in killed:
        code = context.processes[i].exitcode
        assert code == -signal.SIGKILL, f"rank {i}: expected it to end by SIGKILL, got exit code {code}"


def test_two_ranks_sp_cfg_functional_and_failures() -> None:
    """SP-only (MHA, GQA split, MQA replicated) and CFG-only rollouts equal the single process; the functional
    form with LSE; a failure on one rank (in the forward, in prepare, NaN K/V, explicit abort) aborts all."""
    _spawn(2, workers.check_all, 2)


def test_four_ranks_cfg_x_sp() -> None:
    """A 2 x 2 (cfg, sp) mesh and a 4-way SP mesh with replicated kv heads; a failure on rank 3 aborts all."""
    _spawn(4, workers.check_all, 4)


def test_two_ranks_votes_refuse_ranks_out_of_step_and_use_the_group_timeout() -> None:
    """A rank that swallowed a KeyboardInterrupt, or prepares with other arguments (seq_len, commit_current,
    session ids), is refused at the next vote on every rank (RankDivergenceError), nothing commits and nothing
    changes; the vote group waits the process group's timeout (or ParallelMesh's timeout=)."""
    _spawn(2, workers.check_votes)


@pytest.mark.parametrize(("mode", "timeout_s"), [("kill", 30.0), ("hang", 2.0)])
def test_peer_lost_between_prepare_and_commit(mode: str, timeout_s: float) -> None:
    """The peer SIGKILLed (or hung) inside a committing forward: the survivor's commit raises
    DistributedForwardError at once (or after the mesh's timeout), with no open forward, the pool as before, and
    a new forward works."""
    _spawn(2, workers.check_peer_lost, mode, timeout_s, killed=(1,))


def test_example_distributed_generation_equals_one_process() -> None:
    """The multi-process streaming example (Ulysses, then CFG-parallel; a prompt switch) generates the same
    latents as one process, on every rank."""
    _spawn(2, workers.check_example, ("sp", "cfg"))


def test_example_distributed_generation_cfg_x_sp() -> None:
    _spawn(4, workers.check_example, ("cfg,sp",))


@pytest.mark.slow
def test_compiled_fullgraph_one_frame_with_functional_collectives() -> None:
    """A parallelized model compiles with fullgraph=True (dynamo over the all-to-alls, one frame for a rollout
    with commits, denoising forwards, an abort and a reset) and equals the single-process run."""
    _spawn(2, workers.check_compiled, (2,), ("sp",))


@pytest.mark.slow
def test_diffusers_wan_ulysses_compiled_fullgraph() -> None:
    """A stock diffusers Wan model made paged for a 2-rank Ulysses cache compiles with fullgraph=True (block
    hooks, all-to-alls): a frame per timestep layout over a rollout with eviction and a prompt switch, equal to
    one process."""
    _spawn(2, workers.check_diffusers, (2,), ("sp",), "heads", False, True)


# ---------------------------------------------------------------------------------------------- GPU (NCCL)
def _two_gpus() -> bool:
    return _gpus(2)


def _gpus(n: int) -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= n and dist.is_nccl_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA devices and NCCL")
@pytest.mark.parametrize(
    ("shape", "names", "kv_heads", "relative_sinks"),
    [((2,), ("sp",), 4, False), ((2,), ("sp",), 1, False), ((2,), ("cfg",), 2, False), ((2,), ("sp",), 2, True)],
    ids=["sp-mha", "sp-mqa", "cfg", "sp-relative-sinks"],
)
def test_gpu_rollout_nccl_flashinfer(
    shape: tuple[int, ...], names: tuple[str, ...], kv_heads: int, relative_sinks: bool
) -> None:
    """bf16 FlashInfer on 2 GPUs equals the single-GPU run of the same model (on each rank)."""
    _spawn(2, workers.check_rollout, shape, names, 4, kv_heads, relative_sinks, backend="nccl")


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA devices and NCCL")
@pytest.mark.parametrize("names", [("sp",), ("cfg",)], ids=["sp", "cfg"])
def test_gpu_failure_on_one_rank_aborts_on_both(names: tuple[str, ...]) -> None:
    _spawn(2, workers.check_failures, (2,), names, 1, backend="nccl")


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA devices and NCCL")
def test_gpu_compiled_inductor_nccl() -> None:
    """fullgraph=True with inductor over NCCL functional all-to-alls: one frame, equal to the single GPU."""
    _spawn(2, workers.check_compiled, (2,), ("sp",), "inductor", backend="nccl")


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA devices and NCCL")
@pytest.mark.parametrize(
    ("names", "relative_sinks"),
    [(("sp",), False), (("cfg",), False), (("sp",), True)],
    ids=["ulysses", "cfg", "ulysses-relative-sinks"],
)
def test_gpu_cuda_graph_step_nccl(names: tuple[str, ...], relative_sinks: bool) -> None:
    """A whole parallelized step (all-to-alls / all-gather on NCCL, FlashInfer) captured with
    DistributedCUDAGraphStep and replayed over committing and denoising forwards equals the eager
    distributed run and the single GPU; page tables identical across ranks."""
    _spawn(2, workers.check_graph_rollout, (2,), names, relative_sinks, backend="nccl")


@pytest.mark.gpu
@pytest.mark.skipif(not _gpus(4), reason="needs 4 CUDA devices and NCCL")
def test_gpu_cuda_graph_step_nccl_cfg_x_sp() -> None:
    """The same on a 2 x 2 (cfg, sp) mesh (nvidia-h200-x4)."""
    _spawn(4, workers.check_graph_rollout, (2, 2), ("cfg", "sp"), backend="nccl")


def test_two_ranks_retention_groups() -> None:
    """A grouped cache (retention groups, issue 41): CFG-parallel ranks hold whole grouped caches, Ulysses ranks
    the groups of their heads (a group on both ranks is a lane on each); both equal the single-process grouped
    cache, and a failure on one rank aborts on every rank with every lane settled."""
    _spawn(2, workers.check_groups)


def test_two_ranks_retention_groups_with_relative_sinks() -> None:
    """Retention groups + relative sinks (issue 41): CFG-parallel and Ulysses ranks (``ChunkSelfAttention`` layers and
    a stock diffusers Wan model) equal the single-process grouped cache; under Ulysses each rank rotates its tokens'
    sink query for every head at the lanes' own shifts, gathered over the group."""
    _spawn(2, workers.check_relative_sink_groups)
