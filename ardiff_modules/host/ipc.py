"""CUDA IPC for :mod:`~ardiff_modules.host.transport`: the receiver maps the sender's device tensors and copies them
device to device, no host staging (two processes on one GPU, or on GPUs with peer access, of one machine).

What crosses the link is JSON, never a pickle (the library loads no pickled data):

- the sender's **offer** in the envelope (:func:`offer`): its machine (host name and boot id) and GPU (UUID), its
  process id, whether its caller required IPC; the receiver checks it (:func:`checked_offer`) and decides
  (:func:`choose`): IPC only where its own pool is on CUDA, the machine is the same, another process, and the
  sender's GPU is visible here (its own, or one it has peer access to);
- the **handles** (:func:`share`): per tensor the fields of ``torch.multiprocessing.reductions.reduce_tensor``'s
  ``rebuild_cuda_tensor`` arguments, bytes in base64, classes and dtype by name; the receiver validates every
  field against the envelope's entry for that tensor (:func:`checked_handles`) before anything touches CUDA, and
  maps them (:func:`open_handles`) with ``rebuild_cuda_tensor``.

The sender synchronises its device before sharing, so the receiver never waits on the sender's IPC events: torch
opens one per tensor for that wait and never destroys it (a leak per receive); each handle goes without its event.

NOTE: torch counts the receiver's mappings in a shared-memory counter per tensor; the sender's memory is freed (or
reused) only once the receiver dropped its mappings. The receiver drops them before its final answer, or releases
the counters of handles it could not map; a receiver that dies while it holds them leaves that memory with torch's
IPC limbo in the sender until the sender exits.

NOTE: IPC trusts the peer as far as the machine does. A handle opens the sender's whole allocation segment to the
receiver (not just the tensor), and the receiver's checks bound what it allocates and which counter it decrements
(a slot of the sender's own counter file), not what a hostile handle maps: an offset past the mapped segment may
read the receiver's own memory without any CUDA error (other sessions' pages, say). A handle of another type than
a plain ``cudaIpcMemHandle_t`` (``expandable_segments``), with which torch would import file descriptors from the
pid it names, is refused (:func:`is_plain_handle`). Use IPC between processes that trust each other;
``transport="wire"`` (the default) on either side keeps their memory apart.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import socket
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypedDict

import torch
from torch.multiprocessing import reductions

from ardiff_modules.errors import SessionTransferError, SpecError, TransportUnavailableError

#: How ``send_sessions`` / ``recv_sessions`` move the tensors: ``"auto"`` (CUDA IPC where both sides can, else the
#: group), ``"wire"`` (the group: NCCL, or gloo through the host) or ``"ipc"`` (CUDA IPC or a refusal).
Transport = Literal["auto", "wire", "ipc"]
TRANSPORTS: tuple[str, ...] = ("auto", "wire", "ipc")

#: The classes a handle may name (what ``reduce_tensor`` gives for a plain tensor): nothing else is rebuilt.
_TENSOR_CLASSES: dict[str, type] = {"Tensor": torch.Tensor}
_STORAGE_CLASSES: dict[str, type] = {"TypedStorage": torch.storage.TypedStorage}
#: torch's reference-counter files (``at::NewProcessWideShmHandle``: ``/torch_<pid>_<counter>``, in later
#: releases ``/torch_<pid>_<random>_<counter>``): a shared-memory name of torch's, never a path.
_REF_COUNTER = re.compile(r"/torch_[0-9]{1,20}(?:_[0-9]{1,20}){1,2}")
#: Counters per file (``CUDA_IPC_REF_COUNTER_FILE_SIZE``): the receiver decrements slot ``ref_counter_offset`` of
#: that file when it drops a mapping, so an offset past it would write past the file.
_REF_COUNTER_SLOTS = 10000
#: Bytes an encoded handle may have before it is decoded (a plain one has 66; see :func:`is_plain_handle`).
MAX_HANDLE_BYTES = 1 << 20
#: torch's handle of a plain cudaMalloc block (``CUDACachingAllocator::shareIpcHandle``): its format version (2),
#: the type ``'c'`` (``SHAREABLE_CUDA_MALLOC``), then the ``cudaIpcMemHandle_t``. The other type (``'e'``,
#: ``expandable_segments``) makes the receiver import file descriptors from a process the handle names: refused.
_PLAIN_HANDLE_PREFIX = bytes([2]) + b"c"
#: The largest storage size or offset a handle may announce (far above any GPU's memory).
_MAX_BYTES = 1 << 50
_CUDA_IPC_HANDLE_SIZE = 64
_HANDLE_FIELDS = frozenset({
    "name", "tensor_cls", "shape", "stride", "offset", "storage_cls", "dtype", "handle", "storage_bytes",
    "storage_offset", "ref_counter", "ref_counter_offset",
})
_OFFER_FIELDS = frozenset({"host", "boot_id", "device", "pid", "required"})


class Offer(TypedDict):
    """The sender's offer to share by CUDA IPC, as the envelope's ``"ipc"`` field carries it."""

    host: str
    boot_id: str | None
    device: str
    pid: int
    required: bool


def check_transport(transport: object, where: str) -> None:
    if transport not in TRANSPORTS:
        raise SpecError(f"{where}: expected transport one of {TRANSPORTS}, got {transport!r}")


def machine() -> tuple[str, str | None]:
    """This machine: its host name and its boot id (``None`` where the kernel has none): two processes with the
    same pair share one kernel, hence one set of GPUs."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        boot = None
    return socket.gethostname(), boot


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def local_index(uuid: str) -> int | None:
    """The index here of the GPU with ``uuid`` (``None``: not visible to this process)."""
    if not torch.cuda.is_available():
        return None
    return next((i for i in range(torch.cuda.device_count()) if device_uuid(i) == uuid), None)


def offer(device: torch.device, required: bool) -> Offer | None:
    """What the sender announces for a pool on ``device`` (``None``: not on CUDA, no IPC)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    host, boot = machine()
    try:  # NOTE: never raises: the receiver waits for the envelope
        uuid = device_uuid(device.index if device.index is not None else torch.cuda.current_device())
    except Exception:  # noqa: BLE001  # a torch or device without UUIDs: no IPC offered
        return None
    return {"host": host, "boot_id": boot, "device": uuid, "pid": os.getpid(), "required": required}


def sender_offer(where: str, home: torch.device, transport: str) -> Offer | None:
    """The envelope's offer for a pool on ``home`` under ``transport`` (``None``: none); a refusal where ``"ipc"``
    cannot be."""
    check_transport(transport, where)
    if transport == "wire":
        return None
    made = offer(home, required=transport == "ipc")
    if made is None and transport == "ipc":
        raise TransportUnavailableError(
            f"{where}: expected a pool on CUDA to share by CUDA IPC (transport='ipc'), got one on {home}; "
            "nothing was sent"
        )
    return made


def _is_int(x: object, low: int = 0, high: int = _MAX_BYTES) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and low <= x <= high


def _is_text(x: object, longest: int) -> bool:
    return isinstance(x, str) and 0 < len(x) <= longest and x.isprintable()


def checked_offer(where: str, envelope: Mapping[str, Any]) -> Offer | None:
    """The envelope's offer, every field checked (``None``: the sender offers no IPC)."""
    raw = envelope.get("ipc")
    if raw is None:
        return None
    ok = (
        isinstance(raw, dict) and set(raw) == _OFFER_FIELDS and _is_text(raw["host"], 255)
        and (raw["boot_id"] is None or _is_text(raw["boot_id"], 64)) and _is_text(raw["device"], 128)
        and _is_int(raw["pid"], 1, 1 << 32) and isinstance(raw["required"], bool)
    )
    if not ok:
        raise SessionTransferError(
            f"{where}: expected an IPC offer {{host, boot_id, device, pid, required}}, got {raw!r:.200}"
        )
    return raw  # type: ignore[return-value]  # checked field by field above


def choose(offer: Offer | None, home: torch.device, transport: str) -> tuple[int | None, str]:
    """The receiver's choice: the index here of the sender's GPU to map its tensors from, or ``None`` and why not
    (the group carries them then)."""
    if transport == "wire":
        return None, "this side asked for the wire (transport='wire')"
    if offer is None:
        return None, "the sender offered none (its pool is not on CUDA, or it asked for the wire)"
    if home.type != "cuda":
        return None, f"this pool is on {home}, not on CUDA"
    host, boot = machine()
    if (offer["host"], offer["boot_id"]) != (host, boot):
        return None, (f"the sender runs on another machine (host {offer['host']!r}, boot id {offer['boot_id']!r}; "
                      f"here {host!r}, {boot!r})")
    if offer["pid"] == os.getpid():
        return None, "the sender is this process (CUDA cannot map a process's own memory by IPC)"
    try:  # NOTE: never raises: the sender waits for the answer
        index = local_index(offer["device"])
        if index is None:
            return None, f"the sender's GPU {offer['device']} is not visible to this process"
        mine = home.index if home.index is not None else torch.cuda.current_device()
        if index != mine and not torch.cuda.can_device_access_peer(mine, index):
            return None, f"this pool's cuda:{mine} has no peer access to the sender's GPU (cuda:{index} here)"
    except Exception as e:  # noqa: BLE001
        return None, f"this process could not look up the sender's GPU ({type(e).__name__}: {e})"
    return index, ""


def share(
    tensors: Mapping[str, torch.Tensor], fresh: set[str], device: torch.device
) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """The sender's side: the tensors to keep alive until the receiver's final answer, and their handles.

    ``fresh``: names of tensors the snapshot made (the gathered pages), shared as they are; the others (the pool's
    scales, a session's cross entries and latents) are copied first, so that no live tensor of the cache is handed
    to another process. Empty tensors are not shared (the receiver makes them)."""
    shared = {
        n: t if n in fresh else t.clone(memory_format=torch.contiguous_format)
        for n, t in sorted(tensors.items()) if t.numel()
    }
    torch.cuda.synchronize(device)  # the gathers and copies are complete before another process reads them
    handles: list[tuple[Any, ...]] = []
    try:
        for name, t in shared.items():
            rebuild, args = reductions.reduce_tensor(t.detach())
            if rebuild is not reductions.rebuild_cuda_tensor:
                raise TransportUnavailableError(f"tensor {name!r} on {t.device} cannot be shared by CUDA IPC")
            handles.append(args)
            if not is_plain_handle(args[7]):  # (an expandable segment: the receiver would refuse it)
                raise TransportUnavailableError(
                    f"tensor {name!r}: expected memory of a plain cudaMalloc block to share by CUDA IPC, got another "
                    f"kind of handle (type byte {args[7][1:2]!r}; PYTORCH_CUDA_ALLOC_CONF expandable_segments?)"
                )
    except BaseException:
        for args in handles:  # no receiver will map these: their counters back to 0, so the memory is freed
            release(args)
        raise
    return shared, [encode(name, args) for name, args in zip(shared, handles)]


def encode(name: str, args: Sequence[Any]) -> dict[str, Any]:
    """``rebuild_cuda_tensor``'s arguments (``reduce_tensor``'s) as JSON; the device goes as the offer's UUID, the
    event not at all (the sender synchronised), ``requires_grad`` is always false."""
    (tensor_cls, size, stride, offset, storage_cls, dtype, _device, handle, storage_bytes, storage_offset,
     _requires_grad, ref_counter, ref_counter_offset, _event, _event_sync) = args
    return {
        "name": name, "tensor_cls": tensor_cls.__name__, "shape": list(size), "stride": list(stride),
        "offset": int(offset), "storage_cls": storage_cls.__name__, "dtype": str(dtype),
        "handle": base64.b64encode(handle).decode("ascii"), "storage_bytes": int(storage_bytes),
        "storage_offset": int(storage_offset), "ref_counter": ref_counter.decode("ascii"),
        "ref_counter_offset": int(ref_counter_offset),
    }


def is_plain_handle(handle: bytes) -> bool:
    """Whether ``handle`` is torch's handle of a plain cudaMalloc block: the only kind this transport maps."""
    return len(handle) == len(_PLAIN_HANDLE_PREFIX) + _CUDA_IPC_HANDLE_SIZE and handle.startswith(_PLAIN_HANDLE_PREFIX)


def _contiguous_stride(shape: Sequence[int]) -> list[int]:
    stride, step = [], 1
    for n in reversed(shape):
        stride.append(step)
        step *= max(n, 1)
    return stride[::-1]


def checked_handles(
    where: str, message: object, expected: Mapping[str, tuple[torch.dtype, list[int]]], device_index: int,
    sender_pid: int,
) -> list[tuple[str, tuple[Any, ...]]]:
    """The handles message, validated against the envelope's entries (``expected``: name -> dtype and shape, each
    checked already): exactly one handle per non-empty tensor, of its dtype and shape, contiguous, inside the
    storage it names, the counter inside its file, and that file the sender's (``sender_pid``: the offer's pid;
    torch names a counter file after the process that shares: dropping a mapping decrements that counter, so a
    peer naming another process's file could make this one free that process's memory). Returns ``(name,
    rebuild_cuda_tensor's arguments)`` pairs; raises :class:`SessionTransferError` naming the first bad field --
    before anything touches CUDA."""
    handles = message.get("handles") if isinstance(message, dict) else None
    wanted = {n for n, (_, shape) in expected.items() if all(shape)}
    if not isinstance(handles, list) or len(handles) != len(wanted):
        raise SessionTransferError(
            f"{where}: expected {len(wanted)} IPC handles (one per non-empty tensor), got {message!r:.200}"
        )
    out: list[tuple[str, tuple[Any, ...]]] = []
    for entry in handles:
        name = entry.get("name") if isinstance(entry, dict) else None

        def bad(field: str, want: str) -> SessionTransferError:
            got = entry.get(field) if isinstance(entry, dict) else entry
            return SessionTransferError(
                f"{where}: IPC handle of {name!r:.100}: expected {field} {want}, got {got!r:.200}; nothing was mapped"
            )

        if not isinstance(entry, dict) or set(entry) != _HANDLE_FIELDS:
            raise bad("fields", f"exactly {sorted(_HANDLE_FIELDS)}")
        if not isinstance(name, str) or name not in wanted or any(n == name for n, _ in out):
            raise bad("name", "a non-empty tensor of the envelope, once")
        dtype, shape = expected[name]
        if not isinstance(entry["tensor_cls"], str) or entry["tensor_cls"] not in _TENSOR_CLASSES:
            raise bad("tensor_cls", f"one of {sorted(_TENSOR_CLASSES)}")
        if not isinstance(entry["storage_cls"], str) or entry["storage_cls"] not in _STORAGE_CLASSES:
            raise bad("storage_cls", f"one of {sorted(_STORAGE_CLASSES)}")
        if entry["dtype"] != str(dtype):
            raise bad("dtype", f"{dtype} (the envelope's)")
        if entry["shape"] != shape:
            raise bad("shape", f"{shape} (the envelope's)")
        if entry["stride"] != _contiguous_stride(shape):
            raise bad("stride", f"{_contiguous_stride(shape)} (contiguous)")
        if not _is_int(entry["offset"]):
            raise bad("offset", "an element offset of at least 0")
        handle = _b64(entry["handle"])
        if handle is None or not is_plain_handle(handle):
            raise bad("handle", f"base64 of torch's handle of a plain cudaMalloc block ({_PLAIN_HANDLE_PREFIX!r} and "
                                f"{_CUDA_IPC_HANDLE_SIZE} bytes)")
        numel = 1
        for n in shape:
            numel *= n
        needed = (entry["offset"] + numel) * dtype.itemsize
        if not _is_int(entry["storage_bytes"], needed):
            raise bad("storage_bytes", f"at least the {needed} bytes the tensor spans")
        if not _is_int(entry["storage_offset"]):
            raise bad("storage_offset", "a byte offset of at least 0")
        ref = entry["ref_counter"]
        if not isinstance(ref, str) or not _REF_COUNTER.fullmatch(ref) or not ref.startswith(f"/torch_{sender_pid}_"):
            raise bad("ref_counter", f"a torch reference-counter name of the sender, /torch_{sender_pid}[_<n>]_<n>")
        if not _is_int(entry["ref_counter_offset"], 0, _REF_COUNTER_SLOTS - 1):
            raise bad("ref_counter_offset", f"a counter slot of 0 to {_REF_COUNTER_SLOTS - 1}")
        args = (
            _TENSOR_CLASSES[entry["tensor_cls"]], torch.Size(shape), tuple(entry["stride"]), entry["offset"],
            _STORAGE_CLASSES[entry["storage_cls"]], dtype, device_index, handle, entry["storage_bytes"],
            entry["storage_offset"], False, ref.encode("ascii"), entry["ref_counter_offset"],
            bytes(_CUDA_IPC_HANDLE_SIZE), False,  # no event to wait on: the sender synchronised
        )
        out.append((name, args))
    return out


def _b64(text: object) -> bytes | None:
    if not isinstance(text, str) or len(text) > 2 * MAX_HANDLE_BYTES:
        return None
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        return None


def open_handles(where: str, handles: Sequence[tuple[str, tuple[Any, ...]]]) -> dict[str, torch.Tensor]:
    """Map the checked handles (:func:`checked_handles`): the sender's tensors, readable here until dropped. A
    mapping that fails drops the ones made and releases the counters of the rest (best effort), then raises
    :class:`TransportUnavailableError`."""
    mapped: dict[str, torch.Tensor] = {}
    for i, (name, args) in enumerate(handles):
        try:
            mapped[name] = reductions.rebuild_cuda_tensor(*args)
        except Exception as e:
            mapped.clear()  # their storages release their counters as they go
            # NOTE: torch consumed this handle's counter if it made (or found) a storage for it before failing (the
            # storage's deleter, or its cache hit, releases it): releasing it again would count one mapping twice.
            consumed = (args[7], args[9]) in reductions.shared_cache
            for _, rest in handles[i + 1 if consumed else i:]:
                release(rest)
            raise TransportUnavailableError(
                f"{where}: expected to map the sender's tensor {name!r} by CUDA IPC, got {type(e).__name__}: {e}"
            ) from e
    return mapped


def own_copy(mapped: torch.Tensor | None, dtype: torch.dtype, shape: list[int], home: torch.device) -> torch.Tensor:
    """A tensor of the pool's device holding ``mapped``'s bytes (``None``: an empty tensor, never shared). The
    receiver copies everything but the pages: the session keeps its latents and cross entries, never the sender's
    memory; the pages are copied into the pool by the open itself."""
    out = torch.empty(shape, dtype=dtype, device=home)
    if mapped is not None:
        out.copy_(mapped)
    return out


def drop(mapped: dict[str, torch.Tensor] | None, home: torch.device, error: BaseException | None) -> None:
    """Let go of the sender's memory once every copy from it is done, before the final answer (the sender frees
    it then). An error's frames may hold mapped tensors too: their locals are cleared."""
    if not mapped:
        return
    for device in {home, *(t.device for t in mapped.values())}:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    if error is not None:
        traceback.clear_frames(error.__traceback__)
    mapped.clear()


def release(args: tuple[Any, ...]) -> None:
    """Release the sender's counter of a handle never mapped here (else its memory would stay in torch's IPC limbo
    there); best effort, as torch's own release."""
    _release_counter(args[11], args[12])


def release_encoded(handles: Sequence[dict[str, Any]]) -> None:
    """The sender's side of :func:`release`: its own handles (:func:`share`'s, encoded), which the receiver refused
    without mapping any or which never reached it."""
    for handle in handles:
        _release_counter(handle["ref_counter"].encode("ascii"), handle["ref_counter_offset"])


def _release_counter(name: bytes, offset: int) -> None:
    try:
        torch.UntypedStorage._release_ipc_counter_cuda(name, offset)  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001  # a sender gone, or no CUDA build: nothing left to release
        pass
