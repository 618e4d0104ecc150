"""``send_sessions`` / ``recv_sessions`` by CUDA IPC (``transport=``, :mod:`ardiff_modules.host.ipc`).

On the CPU: the negotiation (a CPU pool never offers IPC, a mismatched machine or device makes the receiver take the
wire, ``transport="ipc"`` on a CPU pool is refused on both sides and changes nothing), the checks of the offer and
of every handle field (pure functions), and the whole protocol between two gloo ranks with the CUDA steps faked
(``tests/support/ipc_workers.py``). The ``gpu`` tests run it for real: two processes on one GPU.
"""

from __future__ import annotations

import base64
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ardiff_modules.errors import SessionTransferError, TransportUnavailableError
from ardiff_modules.host import ipc
from tests.distributed.test_multi_process import _spawn
from tests.support import ipc_workers

GLOO = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)
CUDA = torch.device("cuda", 0)


def _offer(**changes: Any) -> ipc.Offer:
    host, boot = ipc.machine()
    offer: dict[str, Any] = {"host": host, "boot_id": boot, "device": "gpu-0", "pid": os.getpid() + 1,
                             "required": False}
    return {**offer, **changes}  # type: ignore[typeddict-item]


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPUs ``gpu-0`` (index 0) and ``gpu-1`` (index 1) visible here, without peer access between them."""
    monkeypatch.setattr(ipc, "local_index", {"gpu-0": 0, "gpu-1": 1}.get)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: False)


def test_a_cpu_pool_offers_no_ipc() -> None:
    assert ipc.offer(torch.device("cpu"), False) is None
    assert ipc.offer(torch.device("cpu"), True) is None


@pytest.mark.usefixtures("two_gpus")
def test_the_receiver_takes_ipc_only_from_its_own_machine_and_a_gpu_it_reaches() -> None:
    host, boot = ipc.machine()
    assert ipc.choose(_offer(), CUDA, "auto") == (0, "")
    assert ipc.choose(_offer(), CUDA, "ipc") == (0, "")
    refused = {
        "asked for the wire": ipc.choose(_offer(), CUDA, "wire"),
        "offered none": ipc.choose(None, CUDA, "auto"),
        "not on CUDA": ipc.choose(_offer(), torch.device("cpu"), "auto"),
        "another machine": ipc.choose(_offer(host=host + "-other"), CUDA, "auto"),
        "another machine ": ipc.choose(_offer(boot_id="another-boot"), CUDA, "auto"),
        "is this process": ipc.choose(_offer(pid=os.getpid()), CUDA, "auto"),
        "not visible": ipc.choose(_offer(device="gpu-9"), CUDA, "auto"),
        "no peer access": ipc.choose(_offer(device="gpu-1"), CUDA, "auto"),
    }
    for why, (index, reason) in refused.items():
        assert index is None and why.strip() in reason, (why, reason)


def test_a_failed_device_lookup_is_a_reason_not_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """The peer waits for the answer: choosing never raises (nor does offering, see its NOTE)."""
    def broken(uuid: str) -> int:
        raise RuntimeError("CUDA driver error")

    monkeypatch.setattr(ipc, "local_index", broken)
    index, reason = ipc.choose(_offer(), CUDA, "auto")
    assert index is None and "could not look up" in reason and "CUDA driver error" in reason


def test_another_gpu_with_peer_access_is_mapped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ipc, "local_index", {"gpu-1": 1}.get)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: (a, b) == (0, 1))
    assert ipc.choose(_offer(device="gpu-1"), CUDA, "auto") == (1, "")


@pytest.mark.parametrize("hostile", [
    "yes", {}, {"host": "h"}, {**_offer(), "extra": 1}, {**_offer(), "pid": True}, {**_offer(), "pid": 0},
    {**_offer(), "host": ""}, {**_offer(), "host": "h\n"}, {**_offer(), "boot_id": 5}, {**_offer(), "device": ["x"]},
    {**_offer(), "required": "true"}, {**_offer(), "host": "h" * 256},
])
def test_a_malformed_offer_is_refused(hostile: object) -> None:
    with pytest.raises(SessionTransferError, match="IPC offer"):
        ipc.checked_offer("w", {"ipc": hostile})


def test_an_offer_is_read_back() -> None:
    assert ipc.checked_offer("w", {}) is None
    assert ipc.checked_offer("w", {"ipc": _offer(boot_id=None)}) == _offer(boot_id=None)


# ---------------------------------------------------------------------------------------------- handles
ARGS = (torch.Tensor, torch.Size([2, 3]), (3, 1), 1, torch.storage.TypedStorage, torch.float16, 4,
        b"\x02c" + bytes(64), 14, 512, False, b"/torch_12_345_6", 7, b"\x09" * 64, True)
EXPECTED = {"pages": (torch.float16, [2, 3]), "latent.0": (torch.float32, [0, 3])}


def _handle(**changes: Any) -> dict[str, Any]:
    return {**ipc.encode("pages", ARGS), **changes}


@pytest.mark.parametrize("name", ["/torch_12_6", "/torch_12_345_6"])  # torch's two name formats
def test_a_reference_counter_of_either_format_is_taken(name: str) -> None:
    [(_, args)] = ipc.checked_handles("w", {"handles": [_handle(ref_counter=name)]}, EXPECTED, 0, 12)
    assert args[11] == name.encode()


def test_a_handle_goes_as_json_and_comes_back_as_rebuild_cuda_tensors_arguments() -> None:
    entry = _handle()
    assert entry["handle"] == base64.b64encode(ARGS[7]).decode() and entry["ref_counter"] == "/torch_12_345_6"
    [(name, args)] = ipc.checked_handles("w", {"handles": [entry]}, EXPECTED, 3, 12)
    # the receiver's device index, no event to open (the sender synchronised), never requires_grad
    assert name == "pages" and args == (*ARGS[:6], 3, *ARGS[7:10], False, *ARGS[11:13], bytes(64), False)


@pytest.mark.parametrize(("field", "value"), [
    ("tensor_cls", "Parameter"), ("tensor_cls", "builtins.eval"), ("storage_cls", "UntypedStorage"),
    ("dtype", "torch.float32"), ("dtype", None), ("shape", [2, 4]), ("shape", "2,3"), ("stride", [1, 2]),
    ("offset", -1), ("offset", True), ("offset", 1.0), ("handle", "not base64!"), ("handle", ""),
    ("handle", "<too long>"), ("handle", 7), ("handle", "<expandable>"), ("handle", "<short>"),
    ("handle", "<version 1>"),
    ("storage_bytes", 13), ("storage_bytes", "14"), ("storage_offset", -1), ("storage_offset", 1 << 60),
    ("ref_counter", "/etc/passwd"), ("ref_counter", "/torch_1_2_3/../../x"), ("ref_counter", "torch_1_2_3"),
    ("ref_counter", b"/torch_1_2_3"), ("ref_counter", "/torch_1"), ("ref_counter", "/torch_1_2_3_4"),
    ("ref_counter", "/torch_1_2\n"), ("ref_counter", "/torch_13_345_6"), ("ref_counter", "/torch_123_345_6"),
    ("ref_counter_offset", 10000), ("ref_counter_offset", -1),
    ("ref_counter_offset", False), ("name", "latent.0"), ("name", "pages.x"), ("name", ["pages"]),
    ("tensor_cls", ["Tensor"]), ("storage_cls", {"a": 1}), ("dtype", ["torch.float16"]),
])
def test_a_hostile_handle_field_is_refused_before_anything_is_mapped(field: str, value: object) -> None:
    """Each field checked against the envelope's entry (storage_bytes: the tensor's 6 elements after an offset of 1,
    14 bytes; the empty latent has no handle)."""
    raw = {"<too long>": bytes(ipc.MAX_HANDLE_BYTES + 1), "<expandable>": b"\x02e" + bytes(64),
           "<short>": b"\x02c" + bytes(63), "<version 1>": b"\x01c" + bytes(64)}
    if isinstance(value, str) and value in raw:
        value = base64.b64encode(raw[value]).decode()
    with pytest.raises(SessionTransferError, match=f"expected {field}"):
        ipc.checked_handles("w", {"handles": [_handle(**{field: value})]}, EXPECTED, 0, 12)


@pytest.mark.parametrize("message", [
    {}, {"handles": "x"}, {"handles": []}, {"handles": [_handle(), _handle()]}, {"handles": [["pages"]]},
    {"handles": [{k: v for k, v in _handle().items() if k != "dtype"}]}, {"handles": [_handle(extra=1)]},
])
def test_a_malformed_handles_message_is_refused(message: object) -> None:
    with pytest.raises(SessionTransferError, match="IPC handle"):
        ipc.checked_handles("w", message, EXPECTED, 0, 12)


def test_a_failed_mapping_drops_the_made_ones_and_releases_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender's memory is freed only once every counter is released: the handles never mapped are."""
    made: list[str] = []

    def rebuild(*args: Any) -> torch.Tensor:
        if args[12] == 2:
            raise RuntimeError("cudaIpcOpenMemHandle failed")
        made.append(args[11])
        return torch.zeros(1)

    released: list[int] = []
    monkeypatch.setattr(ipc.reductions, "rebuild_cuda_tensor", rebuild)
    monkeypatch.setattr(ipc, "release", lambda args: released.append(args[12]))
    handles = [(f"t{i}", (*ARGS[:12], i, *ARGS[13:])) for i in range(4)]
    with pytest.raises(TransportUnavailableError, match="'t2'.*cudaIpcOpenMemHandle failed"):
        ipc.open_handles("w", handles)
    assert len(made) == 2 and released == [2, 3]


def test_a_mapping_that_failed_after_torch_made_its_storage_is_not_released_twice(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch made (or found) the failing handle's storage before the failure: that storage releases the counter,
    so the receiver releases only the handles after it."""
    handles = [(f"t{i}", (*ARGS[:12], i, *ARGS[13:])) for i in range(3)]

    def rebuild(*args: Any) -> torch.Tensor:
        if args[12] == 1:
            ipc.reductions.shared_cache[(args[7], args[9])] = None  # what torch records once the storage exists
            raise RuntimeError("rebuilding the tensor failed")
        return torch.zeros(1)

    released: list[int] = []
    monkeypatch.setattr(ipc.reductions, "shared_cache", {})
    monkeypatch.setattr(ipc.reductions, "rebuild_cuda_tensor", rebuild)
    monkeypatch.setattr(ipc, "release", lambda args: released.append(args[12]))
    with pytest.raises(TransportUnavailableError, match="'t1'"):
        ipc.open_handles("w", handles)
    assert released == [2]


def test_the_sender_shares_its_gathered_pages_and_copies_of_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """No live tensor of the cache is handed over (copies of the scales, cross entries, latents); empty ones are not
    shared; the device is synchronised first. A sharing failure releases the counters of the handles made."""
    reduced: list[torch.Tensor] = []

    def reduce(t: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
        if len(reduced) == 2:
            raise RuntimeError("cudaIpcGetMemHandle failed")
        reduced.append(t)
        return ipc.reductions.rebuild_cuda_tensor, (*ARGS[:12], len(reduced), *ARGS[13:])

    synced: list[torch.device] = []
    released: list[int] = []
    monkeypatch.setattr(ipc.reductions, "reduce_tensor", reduce)
    monkeypatch.setattr(torch.cuda, "synchronize", synced.append)
    monkeypatch.setattr(ipc, "release", lambda args: released.append(args[12]))
    pages, scales, empty = torch.ones(4, dtype=torch.uint8), torch.ones(2), torch.ones(0)
    shared, handles = ipc.share({"pages": pages, "scales": scales, "latent.0": empty}, {"pages"}, CUDA)
    assert synced == [CUDA] and list(shared) == ["pages", "scales"] and [h["name"] for h in handles] == list(shared)
    assert shared["pages"] is pages and shared["scales"] is not scales and torch.equal(shared["scales"], scales)
    assert reduced[0] is not pages and reduced[0].data_ptr() == pages.data_ptr()  # a detached view, the same memory
    reduced.clear()
    with pytest.raises(RuntimeError, match="cudaIpcGetMemHandle"):
        ipc.share({"pages": pages, "scales": scales, "cross.0.k": scales}, {"pages"}, CUDA)
    assert released == [1, 2]  # the two made before the failure (the third raised)


# ---------------------------------------------------------------------------------------------- two ranks, CPU
@GLOO
def test_cpu_pools_take_the_wire_and_refuse_a_forced_ipc_on_both_sides() -> None:
    _spawn(2, ipc_workers.check_cpu_pools_never_use_ipc)


@GLOO
def test_the_ipc_protocol_with_faked_cuda_steps() -> None:
    """Refused after the mapping, a failed mapping (fallback under auto, refusal under ipc), then the handover: no
    tensor over the group, the family continuing bit-identically to a twin."""
    _spawn(2, ipc_workers.check_fake_ipc_handover)


@GLOO
def test_a_sender_that_cannot_share_is_refused_under_ipc_and_takes_the_wire_under_auto() -> None:
    _spawn(2, ipc_workers.check_sender_cannot_share)


@GLOO
def test_hostile_handles_are_refused_before_anything_is_mapped() -> None:
    _spawn(2, ipc_workers.check_hostile_handles)


# ---------------------------------------------------------------------------------------------- GPU
@GLOO
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("transport", ["auto", "ipc"])
def test_gpu_two_processes_on_one_gpu_by_cuda_ipc(transport: str) -> None:
    """Two processes on one GPU (gloo for the control messages): a receive refused after the mapping leaves the
    family with the sender and frees the shared memory; then the family moves by IPC (auto picks it), no tensor
    over the group, and continues bit-identically to a twin that never left."""
    _spawn(2, ipc_workers.check_cuda_ipc_refused_then_handed_over, transport, cuda=True)


@pytest.mark.parametrize("failure", ["refused_unmapped", "send_failed", "refused_mapped"])
def test_the_sender_releases_its_counters_exactly_when_no_receiver_mapped_them(
    monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """A refusal answered before any mapping ("mapped": false) or a handles message that never left: the sender
    releases every handle's counter (else torch keeps its copy of the pages until the process exits); a refusal
    after mapping (the receiver dropped its mappings, which decrement them): no release here, never twice."""
    from ardiff_modules.host import transport

    handles = [{"ref_counter": "/torch_12_345_6", "ref_counter_offset": i} for i in range(3)]
    released: list[tuple[bytes, int]] = []
    monkeypatch.setattr(ipc, "share", lambda tensors, fresh, home: ({}, handles))
    monkeypatch.setattr(ipc, "_release_counter", lambda name, offset: released.append((name, offset)))

    def send(obj: dict, dst: int, group: object) -> None:
        if failure == "send_failed" and "handles" in obj:
            raise RuntimeError("link lost")

    answer = {"ok": False, "error": "SessionTransferError: x"}
    if failure != "refused_mapped":
        answer["mapped"] = False
    monkeypatch.setattr(transport, "_send_json", send)
    monkeypatch.setattr(transport, "_recv_json", lambda src, group: dict(answer))
    if failure == "send_failed":
        with pytest.raises(RuntimeError, match="link lost"):
            transport._send_ipc("w", {}, set(), torch.device("cpu"), 1, None, False)
    else:
        assert transport._send_ipc("w", {}, set(), torch.device("cpu"), 1, None, False)[1] == answer
    want = [] if failure == "refused_mapped" else [(b"/torch_12_345_6", i) for i in range(3)]
    assert released == want


def test_the_sender_shares_no_expandable_segment_and_releases_what_it_shared(monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory of an expandable segment (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) is not shared: the
    sender raises TransportUnavailableError (under ``"auto"`` the group carries the tensors) and releases the counter
    of every handle it made, that one's too (no receiver will map them)."""
    kinds = iter([b"\x02c", b"\x02e"])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(ipc.reductions, "reduce_tensor", lambda t: (
        ipc.reductions.rebuild_cuda_tensor, (*ARGS[:7], next(kinds) + bytes(64), *ARGS[8:11], b"/torch_9_9_9", t.numel(),
                                             *ARGS[13:])))
    released: list[tuple[bytes, int]] = []
    monkeypatch.setattr(ipc, "_release_counter", lambda name, offset: released.append((name, offset)))
    tensors = {"a": torch.zeros(3), "b": torch.zeros(5), "c": torch.zeros(7)}
    with pytest.raises(TransportUnavailableError, match="plain cudaMalloc block"):
        ipc.share(tensors, set(tensors), torch.device("cpu"))
    assert released == [(b"/torch_9_9_9", 3), (b"/torch_9_9_9", 5)]  # a (plain) and b (expandable); c never made
