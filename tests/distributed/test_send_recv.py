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


def test_two_ranks_hand_over_a_family_in_blocks_of_bytes() -> None:
    """Each tensor sent as many messages, cutting elements: the family arrives whole and continues bit-identically."""
    _spawn(2, transport_workers.check_send_recv_in_blocks)


def test_an_envelope_announcing_a_hostile_block_size_is_refused() -> None:
    """The receiver allocates staging buffers of the announced block: none, a non-int or past the bound is refused."""
    from ardiff_modules.errors import SessionTransferError
    from ardiff_modules.host import transport

    assert transport._checked_block("w", {}) is None
    assert transport._checked_block("w", {"block_bytes": 4096}) == 4096
    for hostile in (0, -1, True, 1.5, "64", transport.MAX_BLOCK_BYTES + 1):
        with pytest.raises(SessionTransferError, match="block_bytes"):
            transport._checked_block("w", {"block_bytes": hostile})


@pytest.mark.parametrize(("nbytes", "block"), [(0, 7), (1, 7), (7, 7), (8, 7), (20, 7), (20, None), (5, 100)])
def test_blocks_cover_every_byte_once_in_order(nbytes: int, block: int | None) -> None:
    from ardiff_modules.host import transport

    spans = transport._blocks(nbytes, block)
    covered = [b for start, end in spans for b in range(start, end)]
    assert covered == list(range(nbytes))
    assert all(end - start <= (block or nbytes) and end > start for start, end in spans)


@pytest.mark.parametrize("kind", ["uniform", "per-head", "per-layer", "one-group"])
def test_two_ranks_hand_over_a_grouped_family_or_keep_it_in_every_lane(kind: str) -> None:
    """With retention groups: a receiver of another retention map or without room in one lane refuses before any
    tensor moves (the family stays, every lane unchanged); the handover brings every lane's pages, shared."""
    _spawn(2, transport_workers.check_send_recv_lanes, kind)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_two_processes_on_one_gpu_over_gloo() -> None:
    """CUDA pools in two processes on one GPU, over gloo (NCCL refuses two ranks on one device) with
    ``transport="wire"`` (else CUDA IPC: test_send_recv_ipc.py): the pages are staged through the host; the family
    arrives whole and continues bit-identically."""
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
