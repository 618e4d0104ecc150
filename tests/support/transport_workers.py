"""Ranks of the send / recv test (``tests/distributed/test_send_recv.py``): rank 0 sends, rank 1 receives.

Each rank also plays the oracle locally: a twin session that never left, driven by the same forwards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ardiff_modules as am
from ardiff_modules.host import files, transport
from ardiff_modules.host.file_header import encode
from tests.host.test_suspend_resume import populate, step
from tests.support.small_cache import BOTH, bookkeeping, make_small_cache, pages_of


def _family(cache: am.KVCache) -> tuple[am.KVState, am.KVState]:
    """A prompted session three chunks in (kept latents) and a fork one chunk further."""
    a = cache.open_session("a")
    populate(a)
    for seed in range(3):
        step(a, seed, latents=True)
    child = a.fork("child")
    step(child, 7, latents=True)
    return a, child


def continues_like_twin(
    cache: am.KVCache, family: tuple[am.KVState, am.KVState], twins: tuple[am.KVState, am.KVState], seeds: range
) -> None:
    """A received fork family (parent, child) shares its sink pages again, and its next forwards (and the child's
    kept latents) equal the twins' that never left, bit for bit; the receiver's allocator stays consistent."""
    a, child = family
    assert [pages_of(child, b)[:2] == pages_of(a, b)[:2] for b in BOTH] == [True, True]
    for seed in seeds:
        for mine, twin in zip(family, twins):
            out, ref = step(mine, seed, latents=True), step(twin, seed, latents=True)
            assert all(torch.equal(x, y) for x, y in zip(out, ref))
    assert torch.equal(child.recache_latents(), twins[1].recache_latents())
    cache._allocator.check_invariants()


def _refusals(rank: int) -> None:
    """A refusal on either side leaves the sessions with the sender, unchanged; the other side raises too."""
    cache = make_small_cache()
    a, child = _family(cache) if rank == 0 else (None, None)
    if rank == 1:
        clash = cache.open_session("child")
        try:
            cache.recv_sessions(0)
            raise AssertionError("expected SessionIdClashError")
        except am.errors.SessionIdClashError as e:
            assert "'child'" in str(e)
        clash.close()
        try:  # the sender refuses (pending work): told, nothing received
            cache.recv_sessions(0)
            raise AssertionError("expected SessionTransferError")
        except am.SessionTransferError as e:
            assert "sender's refusal: PendingContextError" in str(e), e
        try:  # an envelope it refuses: answered before any tensor moves (the sender is not left blocked)
            cache.recv_sessions(0)
            raise AssertionError("expected SessionTransferError")
        except am.SessionTransferError as e:
            assert "torch.int64" in str(e), e
        # Envelopes past the bounds: each refused before any tensor moves, nothing allocated.
        for expected in ("only tensors the header uses", "max_latent_bytes", "1 to 67108864 bytes"):
            try:
                cache.recv_sessions(0)
                raise AssertionError(f"expected SessionTransferError ({expected})")
            except am.SessionTransferError as e:
                assert expected in str(e), e
        assert cache.sessions == {} and cache._allocator.num_used == 0
        return
    before, pool = bookkeeping(cache), cache._pool.kv.clone()
    try:
        cache.send_sessions([a, child], 1)
        raise AssertionError("expected SessionTransferError")
    except am.SessionTransferError as e:
        assert "refusal: SessionIdClashError" in str(e) and "stay here" in str(e), e
    assert bookkeeping(cache) == before and torch.equal(cache._pool.kv, pool)
    step(child, 8, commit=False)
    try:
        cache.send_sessions([child], 1)
        raise AssertionError("expected PendingContextError")
    except am.PendingContextError:
        pass
    child.abort()
    # A crafted envelope (a dtype the receiver refuses, a huge shape): the receiver answers at once, allocating nothing.
    transport._send_json({"header": "{}", "tensors": [["pages", "torch.int64", [1 << 40]]]}, 1, None)
    answer = transport._recv_json(1, None)
    assert answer.get("go") is False and "torch.int64" in answer["error"], answer
    # A real header with a huge tensor it never uses, then with a latent announced past the pool's size.
    tensors, header = files.snapshot(cache, [a, child], "test")
    entries = [[n, str(t.dtype), list(t.shape)] for n, t in sorted(tensors.items())]
    latent = next(e for e in entries if e[0].startswith("latent."))
    for crafted in (entries + [["cross.99.k", "torch.float32", [1 << 40]]],
                    [e if e is not latent else [e[0], e[1], [1 << 40]] for e in entries]):
        transport._send_json({"header": encode(header), "tensors": crafted}, 1, None)
        answer = transport._recv_json(1, None)
        assert answer.get("go") is False, answer
    # A message announcing more bytes than any envelope has: refused before a buffer of that size is made.
    dist.send(torch.tensor([1 << 40], dtype=torch.int64), 1)


def _receive_family() -> None:
    """Rank 1: a first receive refused for room (nothing allocated), then the family arrives and continues
    bit-identically to a twin family that never left, its pages still shared."""
    twin_cache = make_small_cache()
    twin_a, twin_child = _family(twin_cache)
    small = make_small_cache(num_pages=8)
    try:  # too small: refused before anything is allocated, the sender keeps them (and sends again)
        small.recv_sessions(0)
        raise AssertionError("expected CapacityError")
    except am.CapacityError:
        assert small._allocator.num_used == 0 and small.sessions == {}
    cache = make_small_cache()
    a, child = cache.recv_sessions(0)
    assert cache._allocator.num_used == twin_cache._allocator.num_used
    continues_like_twin(cache, (a, child), (twin_a, twin_child), range(10, 14))


def check_send_recv() -> None:
    rank = dist.get_rank()
    _refusals(rank)
    dist.barrier()
    if rank == 0:
        _send_family()
    else:
        _receive_family()


def check_send_recv_in_blocks() -> None:
    """:func:`check_send_recv` with every tensor cut into messages of 1000 bytes (not a multiple of any element
    size, so a block splits elements): the blocks reassemble byte for byte."""
    transport.BLOCK_BYTES = 1000
    check_send_recv()


def _send_family() -> None:
    """Rank 0: the first send is refused for room and the family stays, unchanged; the second hands it over (closed
    here once the receiver opened it)."""
    cache = make_small_cache()
    a, child = _family(cache)
    before = bookkeeping(cache)
    try:
        cache.send_sessions([a, child], 1)
        raise AssertionError("expected SessionTransferError")
    except am.SessionTransferError as e:
        assert "CapacityError" in str(e), e
    assert bookkeeping(cache) == before
    cache.send_sessions([a, child], 1)
    assert a.is_closed and child.is_closed and cache._allocator.num_used == 0


# ------------------------------------------------------------------ retention groups (tests/support/small_lanes.py)
def check_send_recv_lanes(kind: str) -> None:
    """A grouped fork family: refused by a uniform receiver (another retention map) and by one whose last lane
    has no room -- each before any tensor moves, the family unchanged here in every lane -- then handed over, every
    lane's pages arriving shared, and continuing on the receiver bit-identically to a twin that never left."""
    from tests.support import small_lanes as lanes

    rank = dist.get_rank()
    if rank == 0:
        cache = lanes.make_cache(kind)
        a, child = _family(cache)
        before = lanes.everything(cache)
        for expected in ("SessionFileError", "CapacityError"):
            try:
                cache.send_sessions([a, child], 1)
                raise AssertionError(f"expected SessionTransferError ({expected})")
            except am.SessionTransferError as e:
                assert expected in str(e) and "stay here" in str(e), e
            lanes.assert_unchanged(cache, before)
        used = [lane.allocator.num_used for lane in cache._lanes]
        dist.broadcast_object_list([used], src=0)
        cache.send_sessions([a, child], 1)
        assert a.is_closed and child.is_closed and all(lane.allocator.num_used == 0 for lane in cache._lanes)
        return
    uniform = lanes.make_cache("uniform" if kind != "uniform" else "per-head")
    try:
        uniform.recv_sessions(0)
        raise AssertionError("expected SessionFileError")
    except am.SessionFileError as e:
        assert "header.head_retention" in str(e), e
    assert uniform.sessions == {} and all(lane.allocator.num_used == 0 for lane in uniform._lanes)
    full = lanes.make_cache(kind)
    last = full._lanes[-1].allocator
    last.allocate(last.num_free - 1)
    try:
        full.recv_sessions(0)
        raise AssertionError("expected CapacityError")
    except am.CapacityError as e:
        assert kind == "uniform" or f"lane '{full._lanes[-1].name}'" in str(e), e
    assert full.sessions == {}
    twin_cache = lanes.make_cache(kind)
    twin_a, twin_child = _family(twin_cache)
    received: list[object] = [None]
    dist.broadcast_object_list(received, src=0)
    used = received[0]
    cache = lanes.make_cache(kind)
    a, child = cache.recv_sessions(0)
    assert [lane.allocator.num_used for lane in cache._lanes] == used  # each lane's shared pages arrived once
    for mine, twin in ((a, twin_a), (child, twin_child)):
        assert lanes.same_history(cache, mine, twin_cache, twin)
    for seed in range(10, 13):
        for mine, twin in ((a, twin_a), (child, twin_child)):
            out, ref = step(mine, seed, latents=True), step(twin, seed, latents=True)
            assert all(torch.equal(x, y) for x, y in zip(out, ref))
    lanes.assert_clean(cache)


# ------------------------------------------------------------------ CUDA pools (tests/distributed/test_send_recv.py, gpu)
def check_send_recv_cuda() -> None:
    """A fork family between two CUDA pools over the group (``transport="wire"``: else two processes of one
    machine use CUDA IPC): over NCCL (two GPUs) the pages go from the sender's pool to the
    receiver's without a host copy (the snapshot's tensors are on the device, :func:`files._host_copy` is never
    called); over gloo (one GPU, two processes) they are staged through the host. Either way the family arrives
    with its pages shared, byte for byte, and -- saved there and loaded on the CPU -- continues bit-identically to
    a twin that never left."""
    import tempfile

    rank = dist.get_rank()
    wire = transport.wire_device(None)
    device = torch.device("cuda", torch.cuda.current_device())
    cache = am.KVCache(make_small_cache().spec, num_pages=32, device=device, backend="reference")
    folder = Path(tempfile.mkdtemp(prefix=f"ardiff_send_cuda_{rank}_"))
    if rank == 0:  # the family is built on the CPU (the helpers' tensors are CPU ones) and loaded into the CUDA pool
        cpu = make_small_cache()
        cpu.save_sessions(folder / "family.safetensors", list(_family(cpu)))
        a, child = cache.load_sessions(folder / "family.safetensors")
        sent = {b: cache._pool.kv[:, :, pages_of(child, b)].view(torch.uint8).cpu() for b in BOTH}
        dist.broadcast_object_list([sent], src=0)
        real_snapshot, real_host_copy = files.snapshot, files._host_copy

        def on_the_wire(*args, **kwargs):  # type: ignore[no-untyped-def]
            tensors, header = real_snapshot(*args, **kwargs)
            # on the pool's device, over NCCL and gloo alike: gloo's host copies are blocks through pinned staging
            assert all(t.device == device for t in tensors.values()), {n: t.device for n, t in tensors.items()}
            assert "digests" not in header
            return tensors, header

        def no_host_copy(t: torch.Tensor) -> torch.Tensor:
            raise AssertionError("send_sessions copied a tensor to the host for a file")

        transport.snapshot, files._host_copy = on_the_wire, no_host_copy  # type: ignore[assignment]
        try:
            assert cache.send_sessions([a, child], 1, transport="wire") == "wire"
        finally:
            transport.snapshot, files._host_copy = real_snapshot, real_host_copy  # type: ignore[assignment]
        assert a.is_closed and child.is_closed and cache._allocator.num_used == 0
        return
    received: list[object] = [None]
    dist.broadcast_object_list(received, src=0)
    twin_cache = make_small_cache()
    _family(twin_cache)  # the twins: received_on_cuda_like_twin finds them by id
    a, child = cache.recv_sessions(0, transport="wire")
    received_on_cuda_like_twin(cache, (a, child), twin_cache, received[0], device, folder)


def received_on_cuda_like_twin(
    cache: am.KVCache, family: tuple[am.KVState, am.KVState], twin_cache: am.KVCache, sent: Any,
    device: torch.device, folder: Path,
) -> None:
    """A fork family received into a CUDA pool: its shared pages arrived once, the child's pages hold the bytes the
    sender had (``sent``: branch -> uint8 CPU copy), its latents are on ``device``; saved and loaded into a CPU
    cache, its next forwards equal the twins' (``twin_cache``'s family, never sent) bit for bit."""
    a, child = family
    assert cache._allocator.num_used == twin_cache._allocator.num_used  # shared pages arrived once
    for b in BOTH:
        assert torch.equal(cache._pool.kv[:, :, pages_of(child, b)].view(torch.uint8).cpu(), sent[b])
    assert child.recache_latents().device == device
    cache.save_sessions(folder / "back.safetensors", [a, child])
    a, child = make_small_cache().load_sessions(folder / "back.safetensors")
    twin_a, twin_child = twin_cache.sessions["a"], twin_cache.sessions["child"]
    for seed in range(10, 13):
        for mine, twin in ((a, twin_a), (child, twin_child)):
            out, ref = step(mine, seed, latents=True), step(twin, seed, latents=True)
            assert all(torch.equal(x, y) for x, y in zip(out, ref))
