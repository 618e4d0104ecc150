"""Move sessions between processes without a file: ``KVCache.send_sessions`` / ``KVCache.recv_sessions`` (issue 45).

What a saved file holds (:mod:`~ardiff_modules.host.files`: each distinct page, cross entry and latent once, a
header naming the spec), sent over a ``torch.distributed`` group point to point, then an answer back; the receiver
checks and opens them exactly as a load does (all or nothing)::

    sender                                    receiver
    snapshot (lock held to the end)  --envelope-->           check the header and every shape: no tensor moved yet
                                     <--- "go" / refusal --  (a refusal: nothing received, nothing allocated)
                                     --- tensors --------->  reserve, copy, open
    close the sent sessions          <------ "ok" ---------  (or "refused: <error>": nothing opened, and the
                                                              sender keeps its sessions, raising the error)

**CUDA IPC between processes of one machine** (``transport="auto"`` or ``"ipc"``; :mod:`~ardiff_modules.host.ipc`).
Opt-in: the default is ``"wire"``, because a CUDA IPC handle opens the sender's whole allocation segment to the
receiver (:mod:`~ardiff_modules.host.ipc`, the trust note): choosing it is the caller's trust decision. The protocol
is tested on the CPU with the CUDA steps faked, and for real by two processes on one GPU
(``tests/distributed/test_send_recv_ipc.py``; passed on an H200, torch 2.11).
A sender whose pool is on CUDA offers IPC in the envelope (its host name and boot id, its GPU's UUID); the
receiver takes it -- ``"go"`` with ``"via": "ipc"`` -- where its own pool is on CUDA, the machine is the same
and the sender's GPU is visible to it (the same GPU, or one it has peer access to). Then no tensor crosses the
group: the sender synchronises its device and sends, as JSON, a handle per tensor (its gathered pages as they
are, copies of the rest); the receiver checks every field against the envelope, maps them, copies from the
sender's memory into its own (the pages straight into its pool), synchronises, drops the mappings and answers::

                                     <--- "go", via ipc --
    share (alive until the answer)   --- handles -------->   check, map; reserve, copy, open; drop the mappings
                                     <------ "ok" --------   (or a refusal, as above)

Two processes on one GPU otherwise go through the host over gloo (NCCL refuses two ranks on one device). Where
a mapping fails (or the sender cannot share), the tensors go over the group after all (the other side is told),
unless a side passed ``transport="ipc"``: then either side refuses with
:class:`~ardiff_modules.errors.TransportUnavailableError` naming why, before anything is received, and the
sessions stay with the sender. ``transport="wire"`` always uses the group.

**Pages straight from the pool** (over the group). The tensors travel on the group's device (:func:`wire_device`):
with NCCL (``"nccl"`` in the group's backend) on the current CUDA device -- each lane's distinct pages gathered from
the pool in one ``index_select`` and sent as they are, received into a device buffer and copied into the pool with
one ``index_copy_``, never through host memory; with gloo on the CPU. gloo carries CPU tensors, so a CUDA pool's
gathered pages cross the host in blocks (:data:`BLOCK_BYTES`) through two pinned buffers on each side: the sender
copies the next block to the host while the wire carries this one, the receiver copies a block into its device
buffer while the next arrives (no whole-session host copy on either side). The control messages (the envelope, the
answers) are small tensors on the same device. A link delivers bytes whole, so a send carries no SHA-256 digests (a
file does); every other check of a load is made, and the envelope's shapes before any tensor moves.

Transactional: the sender keeps its sessions until the receiver answers that it opened them; a refusal or a
failure on either side (a check, room, ids, a lost peer) leaves them where they were. NOTE: if the answer itself
is lost after the receiver opened them (the sender died, or the link broke at that moment), both sides hold
them -- a duplicate, never a loss. Over IPC the receiver's copies come from the sender's memory, which the sender
keeps (and does not touch: it holds the lock) until the answer.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

from ardiff_modules.errors import ARDiffError, SessionTransferError, TransportUnavailableError
from ardiff_modules.host import ipc
from ardiff_modules.host.file_header import HeaderReader, encode
from ardiff_modules.host.files import FileHost, check_layout, check_room, lane_layouts, open_snapshot, snapshot, tensor_names
from ardiff_modules.host.ipc import Transport
from ardiff_modules.session import KVState

#: The dtypes a snapshot's tensors may have (a received envelope naming another is refused).
_DTYPES = {str(d): d for d in (torch.uint8, torch.float32, torch.float16, torch.bfloat16, torch.float64)}

#: Bytes per message of a tensor: a tensor travels in blocks, so that a device tensor over a host wire (gloo) is
#: staged through two pinned host buffers of this size, the copy of one block overlapping the wire of the other.
BLOCK_BYTES = 64 << 20
#: The largest block an envelope may announce (a receiver allocates two staging buffers of it).
MAX_BLOCK_BYTES = 1 << 30

#: Bytes a JSON message (the envelope, an answer) may have: a peer announcing more is refused before any buffer
#: of that size is made (an envelope names every tensor once: far below this for any real snapshot).
MAX_MESSAGE_BYTES = 64 << 20


def send_sessions(
    cache: FileHost, sessions: Iterable[KVState], dst: int, group: Any = None, *, transport: Transport = "wire"
) -> Literal["wire", "ipc"]:
    """Send ``sessions`` (open, resident, idle sessions of ``cache``) to rank ``dst``, whose
    :func:`recv_sessions` opens them; once it has, close them here. Returns how the tensors went: ``"ipc"`` (the
    receiver copied them from this process's GPU memory) or ``"wire"`` (over ``group``).

    ``transport``: ``"wire"`` (default) never offers CUDA IPC, ``"auto"`` offers it when the pool is on CUDA (the
    receiver takes it where it can, see the module docstring), ``"ipc"`` requires it
    (:class:`TransportUnavailableError` naming why when it cannot be used, on both sides, nothing moved).

    Refusals here (not idle, another cache's, a transport) are raised after telling the receiver, which raises
    too; a refusal there (spec, ids, room) comes back as :class:`SessionTransferError` naming it. Either way the
    sessions stay open here, unchanged. The cache's lock is held until the answer: nothing runs on the
    sessions meanwhile.
    """
    if isinstance(sessions, Iterable) and not isinstance(sessions, KVState):
        sessions = list(sessions)  # walked twice: the snapshot, then the close
    wire = wire_device(group)
    block = BLOCK_BYTES
    home = cache._pool.device
    where = f"send_sessions to rank {dst}"
    with cache.lock:
        try:
            offer = ipc.sender_offer(where, home, transport)
            # on the pool's device: a host wire gets them block by block through pinned staging (_send_tensor)
            tensors, header = snapshot(cache, sessions, "send_sessions", device=home)
        except ARDiffError as e:
            _send_json({"refused": f"{type(e).__name__}: {e}"}, dst, group)
            raise
        names = sorted(tensors)
        shapes = [[n, str(tensors[n].dtype), list(tensors[n].shape)] for n in names]
        envelope = {"header": encode(header), "tensors": shapes, "block_bytes": block}
        if offer is not None:
            envelope["ipc"] = offer
        states = list(dict.fromkeys(sessions))
        via: Literal["wire", "ipc"] = "wire"
        shared: dict[str, torch.Tensor] = {}  # what the receiver maps: alive until its final answer
        try:
            _send_json(envelope, dst, group)
            # NOTE: the receiver checks the envelope and says go before any tensor moves: a refusal then is an
            # answer, not a send blocked until the group's timeout with the cache lock held.
            answer = _recv_json(dst, group)
            if answer.get("go") is True and answer.get("via") == "ipc":
                if offer is None:
                    raise SessionTransferError(f"{where}: the receiver chose CUDA IPC, which was not offered")
                required = transport == "ipc" or answer.get("required") is True
                pages = {name for name, _ in tensor_names(cache)}  # gathered by the snapshot: shared as they are
                shared, answer = _send_ipc(where, tensors, pages, home, dst, group, required)
                via = "ipc" if answer.get("via") != "wire" else "wire"  # "wire": it fell back (its mapping failed)
            if answer.get("go") is True or answer.get("via") == "wire":
                for name in names:
                    _send_tensor(tensors[name], dst, group, wire, block)
                answer = _recv_json(dst, group)
        except Exception as e:  # a lost peer, a broken link: nothing was handed over
            if isinstance(e, TransportUnavailableError):
                raise
            raise SessionTransferError(
                f"{where}: expected the receiver's answer, got {type(e).__name__}: {e}; the "
                f"sessions {[s.session_id for s in states]} stay here"
            ) from e
        finally:
            shared.clear()
        if answer.get("ok") is not True:
            error = f"{answer.get('error')!s:.500}"
            raise _refusal_class(error)(
                f"{where}: expected the receiver to open the sessions, got its refusal: {error}; they stay here"
            )
        for state in states:
            state.close()
    return via


def _send_ipc(
    where: str, tensors: dict[str, torch.Tensor], fresh: set[str], home: torch.device, dst: int, group: Any,
    required: bool,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Share the snapshot's tensors with the receiver (it chose IPC) and return them with its next answer: the
    final one, or ``{"via": "wire"}`` where its mapping failed and neither side required IPC (the group carries
    them then). A sharing failure here falls back alike, or is a refusal where IPC is required."""
    try:
        shared, handles = ipc.share(tensors, fresh, home)
    except Exception as e:
        error = f"{where}: expected to share the tensors by CUDA IPC, got {type(e).__name__}: {e}"
        if required:
            _send_json({"refused": f"TransportUnavailableError: {error}"}, dst, group)
            raise TransportUnavailableError(f"{error}; nothing was sent") from e
        _send_json({"via": "wire", "error": error}, dst, group)
        return {}, {"via": "wire"}
    try:
        _send_json({"handles": handles}, dst, group)
    except BaseException:
        ipc.release_encoded(handles)  # never reached the receiver: no one will map them
        raise
    answer = _recv_json(dst, group)
    if answer.get("mapped") is False:
        ipc.release_encoded(handles)  # refused before mapping any: their counters back to 0, the memory freed
    return shared, answer


def recv_sessions(
    cache: FileHost, src: int, group: Any = None, session_ids: Sequence[str] | None = None, *,
    max_latent_bytes: int | None = None, transport: Transport = "wire",
) -> list[KVState]:
    """Receive the sessions rank ``src`` sends (:func:`send_sessions`) and open them, under their ids or
    ``session_ids``, all or nothing; then tell the sender.

    Before any tensor moves, the envelope is checked against this cache: the header (spec, sessions), every
    tensor's shape and dtype that the spec implies (pages, FP8 scales, cross caches), room in the pool, and
    the kept latents' total size at most ``max_latent_bytes`` (default: the pool's size, every lane's with
    retention groups). So a peer cannot
    make this process allocate more than those checks allow.

    ``transport``: ``"wire"`` (default) always the group; ``"auto"`` takes the sender's CUDA IPC offer where this
    pool is on CUDA, on the same machine, and the sender's GPU is visible here (see the module docstring), else
    the group carries the tensors; ``"ipc"`` requires IPC (:class:`TransportUnavailableError`
    naming why it cannot be used, on both sides, before anything is received).

    Raises, opening nothing (and the sender keeps its sessions): what :func:`~ardiff_modules.host.files.load_sessions`
    raises for a snapshot it refuses (spec, ids, room, FP8 scales), :class:`SessionTransferError` for a sender
    that refused or was lost, or an envelope past these bounds.
    """
    where = f"recv_sessions(from rank {src})"
    wire = wire_device(group)
    home = cache._pool.device
    try:
        envelope = _recv_json(src, group)
    except Exception as e:
        raise SessionTransferError(f"{where}: expected a snapshot, got {type(e).__name__}: {e}") from e
    if isinstance(envelope, dict) and "refused" in envelope:
        refusal = f"{envelope['refused']!s:.500}"
        raise _refusal_class(refusal)(f"{where}: expected sessions, got the sender's refusal: {refusal}")
    try:
        ipc.check_transport(transport, where)
        entries = _checked_entries(where, envelope)
        block = _checked_block(where, envelope)
        offer = ipc.checked_offer(where, envelope)
        _check_envelope(cache, where, envelope["header"], entries, max_latent_bytes)
        index, why = ipc.choose(offer, home, transport)
        required = transport == "ipc" or (offer is not None and offer["required"])
        if index is None and required:
            who = "this side" if transport == "ipc" else "the sender"
            raise TransportUnavailableError(
                f"{where}: expected to move the tensors by CUDA IPC ({who} asked for transport='ipc'), but {why}; "
                "nothing was received"
            )
    except ARDiffError as e:
        # The sender waits for this answer (no tensor moved yet).
        _send_json({"go": False, "ok": False, "error": f"{type(e).__name__}: {e}"}, src, group)
        raise
    _send_json({"go": True, "via": "wire" if index is None else "ipc", "required": required}, src, group)
    mapped: dict[str, torch.Tensor] | None = None  # the sender's memory, mapped here: dropped before the answer
    try:
        if index is not None:
            mapped = _map_ipc(where, src, group, entries, index, required, offer["pid"])  # type: ignore[index]
        tensors = {} if mapped is not None else {
            n: _recv_tensor(src, group, dtype, shape, wire, home, block) for n, dtype, shape in entries
        }
    except SessionTransferError:
        raise  # answered already (_map_ipc), or the link is broken
    except Exception as e:
        raise SessionTransferError(f"{where}: expected a snapshot, got {type(e).__name__}: {e}") from e
    return _open_and_answer(cache, where, envelope["header"], entries, tensors, mapped, session_ids, src, group)


def _open_and_answer(
    cache: FileHost, where: str, header: Any, entries: Sequence[tuple[str, str, list[int]]],
    tensors: dict[str, torch.Tensor], mapped: dict[str, torch.Tensor] | None, session_ids: Sequence[str] | None,
    src: int, group: Any,
) -> list[KVState]:
    """Open the received snapshot (``tensors`` over the wire, or ``mapped``: the sender's by IPC), drop the
    mappings, then answer the sender: all or nothing on both sides."""
    home = cache._pool.device
    pages = {name for name, _ in tensor_names(cache)}
    try:
        try:
            if mapped is not None:
                # the pages straight from the sender's memory into the pool (the open gathers them); the rest
                # copied to this device first, as the wire path receives them
                tensors = {
                    n: mapped[n] if n in pages and n in mapped else ipc.own_copy(mapped.get(n), _DTYPES[d], shape, home)
                    for n, d, shape in entries
                }
            states = open_snapshot(cache, where, header, tensors, session_ids, digests=False)
        finally:
            tensors.clear()
    except BaseException as e:
        try:
            ipc.drop(mapped, home, e)
        finally:  # (a device error surfacing at the drop's sync: the sender still gets its answer)
            _send_json({"ok": False, "error": f"{type(e).__name__}: {e}"}, src, group)
        raise
    try:
        ipc.drop(mapped, home, None)  # the first sync after the copies from the sender's memory
    except BaseException as e:  # a copy failed on the device: the opened sessions are not to be trusted
        for state in states:
            state.close()
        _send_json({"ok": False, "error": f"{type(e).__name__}: {e}"}, src, group)
        raise
    _send_json({"ok": True}, src, group)
    return states


def _refusal_class(refusal: str) -> type[SessionTransferError]:
    """The error to raise for the peer's refusal ``"<its error class>: <message>"``: a transport it could not use
    stays a :class:`TransportUnavailableError` on this side too."""
    return TransportUnavailableError if refusal.startswith("TransportUnavailableError") else SessionTransferError


def _map_ipc(
    where: str, src: int, group: Any, entries: Sequence[tuple[str, str, list[int]]], index: int, required: bool,
    sender_pid: int,
) -> dict[str, torch.Tensor] | None:
    """The sender's non-empty tensors mapped by CUDA IPC from its GPU (``cuda:index`` here), after every field of
    its handles is checked; ``None`` where the group carries them instead (the sender could not share them, or a
    mapping failed here, and neither side required IPC: the sender is told). A refusal is answered, then raised."""
    message = _recv_json(src, group)
    if "refused" in message:
        refusal = f"{message['refused']!s:.500}"
        raise _refusal_class(refusal)(f"{where}: expected IPC handles, got the sender's refusal: {refusal}")
    if message.get("via") == "wire" and not required:
        return None  # its sharing failed: the tensors come over the group
    try:
        expected = {n: (_DTYPES[d], shape) for n, d, shape in entries}
        handles = ipc.checked_handles(where, message, expected, index, sender_pid)
        return ipc.open_handles(where, handles)
    except TransportUnavailableError as e:  # a mapping failed (the ones made are dropped already)
        if required:
            _send_json({"ok": False, "error": f"{type(e).__name__}: {e}"}, src, group)
            raise
        _send_json({"via": "wire", "error": str(e)}, src, group)
        return None
    except SessionTransferError as e:  # a malformed handle: nothing was mapped (the sender releases them)
        _send_json({"ok": False, "mapped": False, "error": f"{type(e).__name__}: {e}"}, src, group)
        raise
    except Exception as e:  # whatever else, before any mapping: the sender still waits for an answer
        _send_json({"ok": False, "mapped": False, "error": f"{type(e).__name__}: {e}"}, src, group)
        raise SessionTransferError(f"{where}: expected IPC handles, got {type(e).__name__}: {e}") from e


def _checked_block(where: str, envelope: dict[str, Any]) -> int | None:
    """The envelope's block size in bytes (``None``: a sender that sends each tensor as one message)."""
    block = envelope.get("block_bytes")
    if block is None:
        return None
    if not isinstance(block, int) or isinstance(block, bool) or not 0 < block <= MAX_BLOCK_BYTES:
        raise SessionTransferError(
            f"{where}: expected block_bytes of 1 to {MAX_BLOCK_BYTES} bytes, got {block!r:.100}"
        )
    return block


def _checked_entries(where: str, envelope: object) -> list[tuple[str, str, list[int]]]:
    """The envelope's ``[name, dtype, shape]`` entries, every dtype and shape checked before anything is received."""
    entries = envelope.get("tensors") if isinstance(envelope, dict) else None
    if not isinstance(entries, list) or "header" not in envelope:  # type: ignore[operator]
        raise SessionTransferError(f"{where}: expected an envelope with 'header' and 'tensors', got {envelope!r:.200}")
    for entry in entries:
        ok = isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
        name, dtype, shape = entry if ok else (None, None, None)
        if not ok or dtype not in _DTYPES or not isinstance(shape, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
        ):
            raise SessionTransferError(
                f"{where}: tensor {name!r}: expected [name, one of {sorted(_DTYPES)}, shape], got {entry!r:.200}"
            )
    return [tuple(e) for e in entries]  # type: ignore[misc]


def _check_envelope(
    cache: FileHost, where: str, header: object, entries: Sequence[tuple[str, str, list[int]]],
    max_latent_bytes: int | None,
) -> None:
    """What :func:`~ardiff_modules.host.files.open_snapshot` checks that needs no tensor's bytes, on ``meta``
    tensors of the envelope's shapes: the header, each implied shape and dtype, room; and the latents' size."""
    meta = {name: torch.empty(shape, dtype=_DTYPES[dtype], device="meta") for name, dtype, shape in entries}
    with cache.lock:
        reader = HeaderReader(where, cache.spec, set(meta), lane_layouts(cache))
        saved = reader.read(header)
        check_layout(cache, reader, saved, meta)
        check_room(cache, saved, where)
        bound = sum(lane.pool.nbytes for lane in cache._lanes) if max_latent_bytes is None else max_latent_bytes
        lane_tensors = {name for pair in tensor_names(cache) for name in pair}
    # Every tensor is one the header uses (shape-checked above, or a kept latent): none rides along unchecked.
    latent_names = {
        str(ref) for s in saved for images in s.lanes for image in images.values() for ref in image.latents.values()
    }
    used = {*lane_tensors, *latent_names, *(f"{p}.{kv}" for s in saved for p in s.cross.values() for kv in "kv")}
    unused = sorted(set(meta) - used)
    if unused:
        raise SessionTransferError(f"{where}: expected only tensors the header uses, got also {unused[:4]}")
    latents = sum(meta[name].numel() * meta[name].element_size() for name in latent_names)
    if latents > bound:
        raise SessionTransferError(
            f"{where}: expected kept latents of at most {bound} bytes (max_latent_bytes), got an envelope "
            f"announcing {latents} bytes; nothing was received"
        )


def wire_device(group: Any = None) -> torch.device:
    """The device a send over ``group`` carries its tensors on: the current CUDA device when the group's backend
    is NCCL (``"nccl"``, or a ``"cpu:gloo,cuda:nccl"`` pair), else the CPU (gloo)."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _blocks(nbytes: int, block: int | None) -> list[tuple[int, int]]:
    """``(start, end)`` byte ranges of a tensor's messages (one when ``block`` is ``None``)."""
    step = nbytes if block is None else block
    return [(start, min(start + step, nbytes)) for start in range(0, nbytes, max(step, 1))]


def _staged(wire: torch.device, other: torch.device) -> bool:
    """Whether a tensor on ``other`` crosses a ``wire`` on the host through pinned staging buffers (a CUDA
    tensor over gloo); otherwise it is sent from (received into) the wire's device directly."""
    return wire.type == "cpu" and other.type == "cuda"


def _send_tensor(t: torch.Tensor, dst: int, group: Any, wire: torch.device, block: int) -> None:
    """Send ``t``'s bytes in blocks of ``block``: from ``t`` itself on the wire's device; a CUDA tensor over a host
    wire through two pinned buffers, the device-to-host copy of the next block running during the send of this
    one (``dist.send`` returns once its block is sent, so the buffer it used is free again)."""
    if not t.numel():
        return
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    spans = _blocks(flat.numel(), block)
    if not _staged(wire, flat.device):
        flat = flat.to(wire)
        for start, end in spans:
            dist.send(flat[start:end], dst, group=group)
        return
    stage = [torch.empty(spans[0][1], dtype=torch.uint8, pin_memory=True) for _ in range(min(2, len(spans)))]
    ready: list[torch.cuda.Event] = []

    def copy(i: int) -> None:
        start, end = spans[i]
        stage[i % 2][: end - start].copy_(flat[start:end], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        ready.append(event)

    copy(0)
    for i, (start, end) in enumerate(spans):
        if i + 1 < len(spans):
            copy(i + 1)  # into the other buffer, whose send (block i - 1) has returned
        ready[i].synchronize()
        dist.send(stage[i % 2][: end - start], dst, group=group)


def _recv_tensor(
    src: int, group: Any, dtype: str, shape: list[int], wire: torch.device, home: torch.device, block: int | None
) -> torch.Tensor:
    """One tensor of the envelope (checked by :func:`_checked_entries`), received in blocks (:func:`_send_tensor`)
    onto ``home`` (the pool's device): into it directly from a wire on the same device, through two pinned buffers
    from a host wire into CUDA (the host-to-device copy of a block running during the receive of the next)."""
    t = torch.empty(shape, dtype=_DTYPES[dtype], device=home)
    if not t.numel():
        return t
    flat = t.view(-1).view(torch.uint8)
    spans = _blocks(flat.numel(), block)
    if not _staged(wire, home):
        landing = flat if wire == home else torch.empty_like(flat, device=wire)
        for start, end in spans:
            dist.recv(landing[start:end], src, group=group)
        if landing is not flat:
            flat.copy_(landing)
        return t
    stage = [torch.empty(spans[0][1], dtype=torch.uint8, pin_memory=True) for _ in range(min(2, len(spans)))]
    done: list[torch.cuda.Event | None] = [None] * len(stage)
    for i, (start, end) in enumerate(spans):
        buffer, previous = stage[i % 2], done[i % 2]
        if previous is not None:
            previous.synchronize()  # its copy (block i - 2) has read the buffer
        dist.recv(buffer[: end - start], src, group=group)
        flat[start:end].copy_(buffer[: end - start], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        done[i % 2] = event
    for last in done:
        if last is not None:
            last.synchronize()  # the staging buffers outlive their last copies
    return t


def _send_json(obj: dict[str, Any], dst: int, group: Any) -> None:
    device = wire_device(group)
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(device)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64, device=device), dst, group=group)
    dist.send(data, dst, group=group)


def _recv_json(src: int, group: Any) -> dict[str, Any]:
    device = wire_device(group)
    size = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(size, src, group=group)
    nbytes = int(size.item())
    if not 0 < nbytes <= MAX_MESSAGE_BYTES:
        raise SessionTransferError(
            f"rank {src}: expected a message of 1 to {MAX_MESSAGE_BYTES} bytes, got one announcing {nbytes} bytes"
        )
    data = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dist.recv(data, src, group=group)
    obj = json.loads(bytes(data.cpu().numpy()).decode())
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    return obj
