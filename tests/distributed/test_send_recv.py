"""``KVCache.send_sessions`` / ``recv_sessions`` (issue 45 item 2) between two gloo ranks on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed.test_multi_process import _spawn
from tests.support import transport_workers

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)


def test_two_ranks_hand_a_fork_family_over_or_keep_it_on_a_refusal() -> None:
    """Refusals on either side (ids, pending work, room) leave the family with the sender, unchanged; the
    handover closes it there and it continues on the receiver bit-identically to a twin, its pages shared."""
    _spawn(2, transport_workers.check_send_recv)


@pytest.mark.parametrize("kind", ["uniform", "per-head", "per-layer", "one-group"])
def test_two_ranks_hand_over_a_grouped_family_or_keep_it_in_every_lane(kind: str) -> None:
    """With retention groups: a receiver of another retention map or without room in one lane refuses before any
    tensor moves (the family stays, every lane unchanged); the handover brings every lane's pages, shared."""
    _spawn(2, transport_workers.check_send_recv_lanes, kind)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_two_processes_on_one_gpu_over_gloo() -> None:
    """CUDA pools in two processes on one GPU, over gloo (NCCL refuses two ranks on one device): the pages are
    staged through the host; the family arrives whole and continues bit-identically."""
    _spawn(2, transport_workers.check_send_recv_cuda, cuda=True)


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and dist.is_nccl_available()),
    reason="needs 2 CUDA devices and NCCL",
)
def test_gpu_two_gpus_over_nccl_send_pages_from_the_pool() -> None:
    """Over NCCL the snapshot's tensors stay on the device (no host copy) and arrive whole."""
    _spawn(2, transport_workers.check_send_recv_cuda, backend="nccl")


@pytest.mark.parametrize(
    ("backend", "cuda", "expected"),
    [("gloo", True, "cpu"), ("nccl", True, "cuda:0"), ("cpu:gloo,cuda:nccl", True, "cuda:0"), ("nccl", False, "cpu")],
)
def test_the_wire_is_the_device_with_nccl_and_the_cpu_with_gloo(
    monkeypatch: pytest.MonkeyPatch, backend: str, cuda: bool, expected: str
) -> None:
    """Pages go straight from a CUDA pool over NCCL (no host staging); gloo carries CPU tensors."""
    from ardiff_modules.host import transport

    monkeypatch.setattr(transport.dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert transport.wire_device(None) == torch.device(expected)
