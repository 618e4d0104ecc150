"""Ranks of the CUDA IPC transport tests (``tests/distributed/test_send_recv_ipc.py``): rank 0 sends, rank 1 receives.

On the CPU (CI) the protocol runs whole with the CUDA steps replaced (:func:`fake_ipc`): the sender's offer is
made for its CPU pool, the receiver accepts it, "sharing" writes each tensor's bytes to a file in a folder both
ranks know and "mapping" reads them back -- so the negotiation, the handles' checks, the fallbacks, the refusals
and the copies into the receiver's pool run as they do on a GPU. On a GPU (``gpu`` tests) nothing is replaced.
"""

from __future__ import annotations

import gc
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import ardiff_modules as am
from ardiff_modules.errors import TransportUnavailableError
from ardiff_modules.host import files, ipc, transport
from ardiff_modules.host.file_header import encode
from tests.support.small_cache import BOTH, bookkeeping, make_small_cache, pages_of
from tests.support.transport_workers import _family, continues_like_twin, received_on_cuda_like_twin, step

FAKE_GPU = "fake-gpu-uuid"


def _shared_folder() -> Path:
    box: list[Any] = [tempfile.mkdtemp(prefix="ardiff_fake_ipc_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def fake_ipc(folder: Path, *, map_fails: bool = False) -> dict[str, int]:
    """Replace the CUDA steps of :mod:`~ardiff_modules.host.ipc` in this process (see the module docstring);
    returns counters of the calls (``shared``, ``mapped``, ``released``)."""
    calls = {"shared": 0, "mapped": 0}

    def offer(device: torch.device, required: bool) -> ipc.Offer:
        host, boot = ipc.machine()
        return {"host": host, "boot_id": boot, "device": FAKE_GPU, "pid": 1, "required": required}

    def share(
        tensors: Mapping[str, torch.Tensor], fresh: set[str], device: torch.device
    ) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
        calls["shared"] += 1
        shared = {n: t if n in fresh else t.clone() for n, t in sorted(tensors.items()) if t.numel()}
        handles = []
        for i, (name, t) in enumerate(shared.items()):  # a file per tensor, by number (a lane's name has a "/")
            t.contiguous().view(-1).view(torch.uint8).numpy().tofile(folder / str(i))
            handle = b"\x02c" + str(i).encode().ljust(64, b"\0")  # torch's plain format, the file's number inside
            args = (torch.Tensor, t.shape, t.stride(), 0, torch.storage.TypedStorage, t.dtype, 0, handle,
                    t.numel() * t.element_size(), 0, False, b"/torch_1_2_3", i, bytes(64), True)
            handles.append(ipc.encode(name, args))
        return shared, handles

    real_choose = ipc.choose

    def choose(offer: ipc.Offer | None, home: torch.device, transport: str) -> tuple[int | None, str]:
        if offer is not None and offer["device"] == FAKE_GPU and transport != "wire":
            return 0, ""
        return real_choose(offer, home, transport)

    def open_handles(where: str, handles: Sequence[tuple[str, tuple[Any, ...]]]) -> dict[str, torch.Tensor]:
        calls["mapped"] += 1
        if map_fails:
            raise TransportUnavailableError(f"{where}: expected to map, got an injected failure")
        out = {}
        for name, args in handles:
            assert args[6] == 0 and args[14] is False and args[10] is False  # the local device, no event
            data = torch.from_numpy(np.fromfile(folder / args[7][2:].rstrip(b"\0").decode(), dtype=np.uint8))
            out[name] = data.view(args[5]).reshape(args[1])
        return out

    ipc.offer, ipc.share, ipc.choose, ipc.open_handles = offer, share, choose, open_handles  # type: ignore[assignment]
    return calls


def _no_wire(*args: Any, **kwargs: Any) -> torch.Tensor:
    raise AssertionError("a tensor went over the group although the receiver mapped them")


def _recv_without_wire(cache: am.KVCache) -> tuple[am.KVState, am.KVState]:
    """``recv_sessions(0, transport="auto")`` with any tensor over the group failing the test: all by IPC."""
    real_recv, transport._recv_tensor = transport._recv_tensor, _no_wire  # type: ignore[assignment]
    try:
        a, child = cache.recv_sessions(0, transport="auto")
    finally:
        transport._recv_tensor = real_recv  # type: ignore[assignment]
    return a, child


def _expect(error: type[BaseException], text: str, fn: Callable[[], Any]) -> BaseException:
    try:
        fn()
    except error as e:
        assert text in str(e), e
        return e
    raise AssertionError(f"expected {error.__name__} ({text})")


def _unchanged_then_sent_by_wire(cache: Any, a: Any, child: Any, before: Any, pool: torch.Tensor) -> None:
    """The sender after its refusals: the family and the pool as they were; then ``"auto"`` sends by the group."""
    assert bookkeeping(cache) == before and torch.equal(cache._pool.kv, pool)
    assert cache.send_sessions([a, child], 1, transport="auto") == "wire"
    assert a.is_closed and child.is_closed and cache._allocator.num_used == 0


def _nothing_then_received_by_wire(cache: Any) -> None:
    """The receiver after its refusals: nothing opened or allocated; then the family arrives by the group, the
    fork's shared pages shared again."""
    assert cache.sessions == {} and cache._allocator.num_used == 0
    a, child = cache.recv_sessions(0, transport="auto")
    assert [pages_of(child, b)[:2] == pages_of(a, b)[:2] for b in BOTH] == [True, True]


def check_cpu_pools_never_use_ipc() -> None:
    """Real (no fakes): a CPU pool offers no IPC, so ``"auto"`` takes the wire; ``"ipc"`` on either side is refused
    by both with :class:`TransportUnavailableError` naming why, nothing moved, nothing allocated."""
    rank = dist.get_rank()
    cache = make_small_cache()
    if rank == 0:
        a, child = _family(cache)
        before, pool = bookkeeping(cache), cache._pool.kv.clone()
        _expect(TransportUnavailableError, "expected a pool on CUDA",
                lambda: cache.send_sessions([a, child], 1, transport="ipc"))
        _expect(TransportUnavailableError, "the sender offered none",
                lambda: cache.send_sessions([a, child], 1, transport="auto"))
        bogus: Any = "shm"
        _expect(am.SpecError, "expected transport one of", lambda: cache.send_sessions([a, child], 1, transport=bogus))
        _unchanged_then_sent_by_wire(cache, a, child, before, pool)
        return
    _expect(TransportUnavailableError, "sender's refusal: TransportUnavailableError",
            lambda: cache.recv_sessions(0, transport="auto"))
    _expect(TransportUnavailableError, "this side asked for transport='ipc'",
            lambda: cache.recv_sessions(0, transport="ipc"))
    _expect(am.SessionTransferError, "sender's refusal: SpecError", lambda: cache.recv_sessions(0, transport="auto"))
    _nothing_then_received_by_wire(cache)


def check_fake_ipc_handover() -> None:
    """The IPC protocol with the CUDA steps faked: a refusal after the mapping (an injected copy failure) leaves
    the family with the sender and nothing in the receiver; a mapping failure falls back to the wire under
    ``"auto"`` and is refused under ``"ipc"``; the handover by "IPC" moves no tensor over the group and the family
    continues bit-identically to a twin that never left."""
    rank = dist.get_rank()
    folder = _shared_folder()
    calls = fake_ipc(folder)
    cache = make_small_cache()
    if rank == 0:
        a, child = _family(cache)
        before, pool = bookkeeping(cache), cache._pool.kv.clone()
        _expect(am.SessionTransferError, "refusal: RuntimeError: injected",
                lambda: cache.send_sessions([a, child], 1, transport="auto"))
        _expect(TransportUnavailableError, "injected failure",
                lambda: cache.send_sessions([a, child], 1, transport="auto"))
        assert bookkeeping(cache) == before and torch.equal(cache._pool.kv, pool) and calls["shared"] == 2
        dist.barrier()
        # its mapping failed there: the group carried them
        assert cache.send_sessions([a, child], 1, transport="auto") == "wire"
        dist.barrier()
        a, child = _family(cache)
        assert cache.send_sessions([a, child], 1, transport="ipc") == "ipc"
        assert a.is_closed and child.is_closed and cache._allocator.num_used == 0
        return
    real_copy = files._copy_pages

    def broken_copy(*args: Any) -> None:
        raise RuntimeError("injected")

    files._copy_pages = broken_copy  # type: ignore[assignment]
    try:  # reserved, then failed: the reservation rolled back, nothing opened
        _expect(RuntimeError, "injected", lambda: cache.recv_sessions(0, transport="auto"))
    finally:
        files._copy_pages = real_copy  # type: ignore[assignment]
    assert cache.sessions == {} and cache._allocator.num_used == 0 and calls["mapped"] == 1
    fails = fake_ipc(folder, map_fails=True)
    _expect(TransportUnavailableError, "injected failure", lambda: cache.recv_sessions(0, transport="ipc"))
    assert cache.sessions == {} and cache._allocator.num_used == 0
    dist.barrier()
    a, child = cache.recv_sessions(0, transport="auto")  # "auto": the mapping fails, the group carries them
    assert fails["mapped"] == 2 and set(cache.sessions) == {"a", "child"}  # the forced receive, then this one
    a.close()
    child.close()
    dist.barrier()
    calls = fake_ipc(folder)
    twin_cache = make_small_cache()
    twin_a, twin_child = _family(twin_cache)
    a, child = _recv_without_wire(cache)
    assert calls["mapped"] == 1 and cache._allocator.num_used == twin_cache._allocator.num_used
    continues_like_twin(cache, (a, child), (twin_a, twin_child), range(10, 13))


def check_sender_cannot_share() -> None:
    """The sender's sharing fails (a CUDA IPC it cannot do): under ``"ipc"`` both sides refuse, the family unchanged
    here and nothing allocated there; under ``"auto"`` the group carries the tensors instead."""
    rank = dist.get_rank()
    calls = fake_ipc(_shared_folder())
    cache = make_small_cache()
    if rank == 0:

        def cannot(*args: Any) -> Any:
            raise RuntimeError("no IPC here")

        ipc.share = cannot  # type: ignore[assignment]
        a, child = _family(cache)
        before, pool = bookkeeping(cache), cache._pool.kv.clone()
        _expect(TransportUnavailableError, "no IPC here", lambda: cache.send_sessions([a, child], 1, transport="ipc"))
        _unchanged_then_sent_by_wire(cache, a, child, before, pool)
        return
    _expect(TransportUnavailableError, "sender's refusal: TransportUnavailableError",
            lambda: cache.recv_sessions(0, transport="auto"))
    _nothing_then_received_by_wire(cache)
    assert calls["mapped"] == 0


def check_hostile_handles() -> None:
    """Rank 0 plays a sender that offers IPC and then sends malformed handles: each is refused before anything is
    mapped or allocated (the fake mapping is never called), the receiver's pool untouched."""
    rank = dist.get_rank()
    folder = _shared_folder()
    calls = fake_ipc(folder)
    cache = make_small_cache()
    if rank == 1:
        for _ in range(3):
            _expect(am.SessionTransferError, "IPC handle", lambda: cache.recv_sessions(0, transport="auto"))
        assert calls["mapped"] == 0 and cache.sessions == {} and cache._allocator.num_used == 0
        return
    a, child = _family(cache)
    tensors, header = files.snapshot(cache, [a, child], "test")
    entries = [[n, str(t.dtype), list(t.shape)] for n, t in sorted(tensors.items())]
    _, handles = ipc.share(tensors, {"pages"}, cache._pool.device)
    first = handles[0]
    hostile = (
        [{**first, "ref_counter_offset": 1 << 20}, *handles[1:]],  # a write past torch's counter file
        [{**first, "storage_bytes": 1}, *handles[1:]],  # a tensor reaching past its storage
        [{**first, "tensor_cls": "Parameter"}, *handles[1:]],  # a class off the allow-list
    )
    for crafted in hostile:
        envelope = {"header": encode(header), "tensors": entries, "block_bytes": 1024,
                    "ipc": ipc.offer(cache._pool.device, False)}
        transport._send_json(envelope, 1, None)
        answer = transport._recv_json(1, None)
        assert answer == {"go": True, "via": "ipc", "required": False}, answer
        transport._send_json({"handles": crafted}, 1, None)
        answer = transport._recv_json(1, None)
        assert answer.get("ok") is False and "IPC handle" in answer["error"], answer
        assert answer.get("mapped") is False, answer  # so a real sender releases its counters (transport._send_ipc)


# ------------------------------------------------------------------ CUDA (gpu tests: two processes on one GPU)
def _cuda_family(cache: am.KVCache, folder: Path) -> tuple[am.KVState, am.KVState]:
    """The family built on the CPU (the helpers' tensors are CPU ones), loaded into the CUDA pool."""
    cpu = make_small_cache()
    cpu.save_sessions(folder / "family.safetensors", list(_family(cpu)))
    a, child = cache.load_sessions(folder / "family.safetensors")
    return a, child


def check_cuda_ipc_refused_then_handed_over(transport_name: str) -> None:
    """A CUDA IPC receive refused after the mapping (an injected copy failure): the family stays with the sender,
    bit for bit, and the sender's shared memory is free again (the receiver dropped its mappings before it
    answered); then the handover by IPC: no tensor over the group, the pages byte for byte, and -- saved there and
    loaded on the CPU -- the family continues bit-identically to a twin that never left."""
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    cache = am.KVCache(make_small_cache().spec, num_pages=32, device=device, backend="reference")
    folder = Path(tempfile.mkdtemp(prefix=f"ardiff_ipc_cuda_{rank}_"))
    if rank == 0:
        a, child = _cuda_family(cache, folder)
        sent = {b: cache._pool.kv[:, :, pages_of(child, b)].view(torch.uint8).cpu() for b in BOTH}
        dist.broadcast_object_list([sent], src=0)
        before, pool = bookkeeping(cache), cache._pool.kv.clone()
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated(device)
        _expect(am.SessionTransferError, "refusal: RuntimeError: injected",
                lambda: cache.send_sessions([a, child], 1, transport=transport_name))  # type: ignore[arg-type]
        assert bookkeeping(cache) == before and torch.equal(cache._pool.kv, pool)
        gc.collect()
        torch.cuda.ipc_collect()
        assert torch.cuda.memory_allocated(device) == allocated, (torch.cuda.memory_allocated(device), allocated)
        dist.barrier()
        assert cache.send_sessions([a, child], 1, transport=transport_name) == "ipc"  # type: ignore[arg-type]
        assert a.is_closed and child.is_closed and cache._allocator.num_used == 0
        return
    received: list[Any] = [None]
    dist.broadcast_object_list(received, src=0)
    real_copy = files._copy_pages

    def broken_copy(*args: Any) -> None:
        raise RuntimeError("injected")

    files._copy_pages = broken_copy  # type: ignore[assignment]
    try:
        _expect(RuntimeError, "injected", lambda: cache.recv_sessions(0, transport="auto"))
    finally:
        files._copy_pages = real_copy  # type: ignore[assignment]
    assert cache.sessions == {} and cache._allocator.num_used == 0
    dist.barrier()
    twin_cache = make_small_cache()
    _family(twin_cache)  # the twins: received_on_cuda_like_twin finds them by id
    a, child = _recv_without_wire(cache)
    received_on_cuda_like_twin(cache, (a, child), twin_cache, received[0], device, folder)
