"""Sessions that outlive the process: ``KVCache.save_sessions`` / ``KVCache.load_sessions`` (issue 45).

A save writes what a suspend keeps (:mod:`~ardiff_modules.host.tier`): every branch's committed pages as raw
bytes (FP8 pages stay FP8, with the pool's scales), its positions, cross-attention entries and kept latents --
into a **safetensors** file (tensors and a JSON header, no pickle: loading a file never runs code), whose
header (:mod:`~ardiff_modules.host.file_header`) names the format version and the spec. A load is a resume from
that file::

    save:  sessions (resident, idle) --copy pages once each--> file      (the sessions and the pool unchanged)
    load:  file --read, check everything--> reserve fresh pages --copy--> open the sessions   (all or nothing)

Sharing survives the trip: a page held by several saved branches (a fork, ``share_sinks_from``, a shared
prompt's entry) is written once and comes back as one page referenced by each (plain paging; with contiguous
extents each branch comes back as a ring in its own extent, as after a resume). A file of another spec, a
truncated, corrupted (per-tensor SHA-256 digests) or hostile one raises
:class:`~ardiff_modules.errors.SessionFileError`; ids already open :class:`~ardiff_modules.errors.SessionIdClashError`;
too few free pages :class:`~ardiff_modules.errors.CapacityError` -- each before anything is allocated.

With retention groups (one lane per group's head part, :mod:`ardiff_modules.lanes`) the file holds each lane's
pages and scales (``pages.<lane>``, ``scales.<lane>``) and its header names the retention map and the lanes
(:mod:`~ardiff_modules.host.file_header`): a load checks and reserves in every lane before anything changes.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Protocol, cast

import torch

from ardiff_modules.core.allocator import PageAllocator
from ardiff_modules.core.branch import BranchImage, branch_image, load_branch
from ardiff_modules.core.branch_selection import Selection
from ardiff_modules.core.reservation import ResumeReservation
from ardiff_modules.core.transaction import deferred_interrupts
from ardiff_modules.cross import CrossEntry, publish_entry
from ardiff_modules.errors import CacheClosedError, CapacityError, SessionFileError, SessionIdClashError, SpecError
from ardiff_modules.host.file_header import (
    FORMAT, FORMAT_VERSION, METADATA_KEY, HeaderReader, LaneLayout, SavedSession, encode, retention_map, spec_fields,
)
from ardiff_modules.host.lane_store import Laid, LaneRecord, file_record, lay_out, ring_fits, selection_in_ring
from ardiff_modules.host.tier import HostTier
from ardiff_modules.lanes import CacheLane
from ardiff_modules.pool import KVPool
from ardiff_modules.session import KVState
from ardiff_modules.session_table import check_session_id
from ardiff_modules.spec import KVCacheSpec

PathLike = str | os.PathLike[str]


class FileHost(Protocol):
    """What save / load use of a ``KVCache``."""

    spec: KVCacheSpec
    # (the cache's private parts: session files are the cache's own code)
    _pool: KVPool
    _allocator: PageAllocator
    _lanes: Sequence[CacheLane]
    _host_tier: HostTier

    @property
    def lock(self) -> Any: ...
    @property
    def is_closed(self) -> bool: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def extent_chunks(self) -> int | None: ...
    @property
    def sessions(self) -> dict[str, KVState]: ...
    def open_session(self, session_id: str | None = None) -> KVState: ...


# ---------------------------------------------------------------------------------------------------- save
def save_sessions(cache: FileHost, path: PathLike, sessions: Iterable[KVState]) -> None:
    """Write ``sessions`` (open, resident, idle sessions of ``cache``) to ``path`` (see the module docstring).

    Refuses, writing nothing: a session of another cache or closed (:class:`SpecError` /
    :class:`SessionClosedError`), suspended (:class:`SessionSuspendedError`), with an open forward or a pending
    chunk (:class:`PendingContextError`). The file is written next to ``path`` and renamed over it: a crash
    mid-write leaves any previous file whole.
    """
    tensors, header = snapshot(cache, sessions, "save_sessions")
    _write(path, tensors, header)


def snapshot(
    cache: FileHost, sessions: Iterable[KVState], what: str, device: torch.device | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and header of ``sessions``, checked (open, of ``cache``, resident, idle).

    ``device=None`` (a file): CPU copies that share no memory with the cache, and a SHA-256 digest of each in the
    header. Else (a send): the tensors on ``device`` without digests -- each lane's distinct pages gathered in one
    ``index_select`` on the pool (a fresh tensor), the scales, cross entries and latents as the cache holds them
    when they are already there (the sender holds the cache's lock until they are sent); nothing goes through host
    memory when ``device`` is the pool's."""
    with cache.lock:
        if cache.is_closed:
            raise CacheClosedError(f"{what}: expected an open KVCache, got one that was closed")
        return _snapshot(cache, _checked_sessions(cache, sessions, what), device)


def _checked_sessions(cache: FileHost, sessions: Iterable[KVState], what: str) -> list[KVState]:
    if isinstance(sessions, KVState) or not isinstance(sessions, Iterable):
        raise SpecError(f"{what}: expected an iterable of sessions, got {type(sessions).__name__}")
    states = list(dict.fromkeys(sessions))
    foreign = [s for s in states if not isinstance(s, KVState) or s.cache is not cache]
    if foreign:
        raise SpecError(
            f"{what}: expected sessions of this KVCache, got {[getattr(s, 'session_id', s) for s in foreign]}"
        )
    for state in states:
        cache._host_tier.check_idle(state, what)  # open, resident, no pending work
    return states


def tensor_names(cache: FileHost) -> list[tuple[str, str]]:
    """Each lane's pages and scales tensor names: ``pages`` and ``scales`` for a uniform cache, else
    ``pages.<lane>`` and ``scales.<lane>`` (one group's map too: its one lane is named)."""
    if cache.spec.head_retention is None:
        return [("pages", "scales")]
    return [(f"pages.{lane.name}", f"scales.{lane.name}") for lane in cache._lanes]


def lane_layouts(cache: FileHost) -> tuple[LaneLayout, ...] | None:
    """The cache's lanes as its files name them (``None``: a uniform cache, the spec itself)."""
    if cache.spec.head_retention is None:
        return None
    return tuple(LaneLayout(lane.name, lane.spec, lane.layers, lane.part.heads) for lane in cache._lanes)  # type: ignore[union-attr]


def _snapshot(
    cache: FileHost, states: Sequence[KVState], device: torch.device | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and header: each distinct page (per lane), cross entry and latent once (see :func:`snapshot`)."""
    tensors: dict[str, torch.Tensor] = {}
    indices, counts = [], []
    for lane, (pages_name, scales_name) in zip(cache._lanes, tensor_names(cache)):
        order = list(dict.fromkeys(
            p for s in states for n in s.kv_branch_names for p in s._lane_pages(n)[lane.index].history_pages()
        ))
        raw = lane.pool.kv.view(torch.uint8)
        # NOTE: page-major, one row per page as the host tier's arena holds them: one gather (index_select on the
        # page dim of a page-major view writes a fresh contiguous tensor), not a gather and then a transpose copy.
        index = torch.tensor(order, dtype=torch.long, device=raw.device)
        tensors[pages_name], tensors[scales_name] = raw.movedim(2, 0).index_select(0, index), lane.pool.scales
        indices.append({p: i for i, p in enumerate(order)})
        counts.append(len(order))
    names: dict[int, str] = {}  # id(tensor or entry) -> its name in the file (each shared one written once)

    def name_of(obj: Any, prefix: str) -> str:
        if id(obj) not in names:
            names[id(obj)] = f"{prefix}.{len([n for n in names.values() if n.startswith(prefix)])}"
            if isinstance(obj, CrossEntry):
                tensors[names[id(obj)] + ".k"], tensors[names[id(obj)] + ".v"] = obj.k, obj.v
            else:
                tensors[names[id(obj)]] = obj
        return names[id(obj)]

    sessions = []
    for state in states:
        lanes = [
            {n: _branch_header(branch_image(state._lane_pages(n)[lane.index]), index, name_of)
             for n in state.kv_branch_names}
            for lane, index in zip(cache._lanes, indices)
        ]
        grouped = cache.spec.head_retention is not None
        branches: dict[str, Any] = {"lanes": lanes} if grouped else {"branches": lanes[0]}
        cross = [[c, b, name_of(e, "cross")] for (c, b), e in state._cross_entries().items()]
        sessions.append({"id": state.session_id, **branches, "cross": cross})
    quantizers = [lane.pool.quantizer for lane in cache._lanes]
    header: dict[str, Any] = {
        "format": FORMAT, "version": FORMAT_VERSION, "spec": spec_fields(cache.spec),
        "scales_fixed": all(q is not None and q.all_calibrated for q in quantizers), "sessions": sessions,
    }
    if device is None:
        # NOTE: clone where .to("cpu") returned the live tensor (a CPU pool): the file is written after the lock is
        # released, and a later forward (an FP8 calibration) must not change what the digests describe.
        tensors = {k: _host_copy(t) for k, t in tensors.items()}
        header["digests"] = {k: _digest(t) for k, t in tensors.items()}
    else:
        tensors = {k: t.detach().to(device).contiguous() for k, t in tensors.items()}
    layouts = lane_layouts(cache)
    if layouts is None:
        header["pages"] = counts[0]
    else:
        header["head_retention"] = retention_map(cache.spec.head_retention)  # type: ignore[arg-type]
        header["lanes"] = [{**lane.describe(), "pages": n} for lane, n in zip(layouts, counts)]
    return tensors, header


def _branch_header(image: BranchImage, index: Mapping[int, int], name_of: Any) -> dict[str, Any]:
    return {
        "history": [[index[p] for p in chunk] for chunk in image.history],
        "history_index": list(image.history_index), "history_start": list(image.history_start),
        "committed_chunks": image.committed_chunks, "committed_tokens": image.committed_tokens,
        "latents": {str(i): name_of(t, "latent") for i, t in image.latents.items()},
        "recent": {str(i): list(span) for i, span in image.recent.items()},
        "slots": list(image.slots),
        "shot_start": image.shot_start, "window_floor": image.window_floor,
        # (only a frame policy trims chunks: other files stay as they were)
        **({"kept": [None if k is None else [k.full, list(k.offsets)] for k in image.kept]} if image.kept else {}),
        # (only a content-selected lane has a selection, and only between two commits that score)
        **({"selection": _selection_header(image.selection, index)} if image.selection is not None else {}),
        # (only a frame lane: where each frame goes in a frame extent, so a load keeps the keys' order)
        **({"frame_slots": [list(s) for s in image.frame_slots], "selection_slots": list(image.selection_slots)}
           if image.frame_slots else {}),
    }


def _selection_header(selection: Selection, index: Mapping[int, int]) -> dict[str, Any]:
    """A branch's content selection in the header: its pages (indices of the lane's tensor), the first candidate
    position, the commit that chose it and the chosen offsets among the candidates' pages."""
    return {"pages": [index[p] for p in selection.pages], "start": selection.start, "made_at": selection.made_at,
            "offsets": list(selection.resolved())}


#: Tensors larger than this are digested in blocks of this many bytes, hashed in parallel (:func:`_digest`).
DIGEST_BLOCK_BYTES = 64 << 20
#: The prefix of a block digest (``"tree:"`` + SHA-256 of the blocks' SHA-256 digests, in order).
_TREE = "tree:"


def _digest(t: torch.Tensor, like: str | None = None) -> str:
    """SHA-256 of a CPU tensor's bytes: safetensors checks offsets, not contents, so corruption shows here.

    A tensor above :data:`DIGEST_BLOCK_BYTES` (a lane's pages: gigabytes) is hashed in blocks on a thread pool
    (``hashlib`` releases the GIL) and digested as ``"tree:" + SHA-256(block digests)``: one thread's SHA-256 runs at
    ~1 GB/s, which made hashing most of a save's and a load's time. ``like``: the digest to compare with (a file's),
    computed the same way -- a plain SHA-256 (files written before block digests) is checked as one.
    """
    data = memoryview(cast(Any, t.reshape(-1).view(torch.uint8).numpy()))  # (a view: no copy of the bytes)
    tree = data.nbytes > DIGEST_BLOCK_BYTES if like is None else like.startswith(_TREE)
    if not tree:
        return hashlib.sha256(data).hexdigest()
    step = DIGEST_BLOCK_BYTES
    blocks = [data[i : i + step] for i in range(0, data.nbytes, step)]
    with ThreadPoolExecutor(max_workers=min(len(blocks), os.cpu_count() or 1)) as pool:
        parts = list(pool.map(lambda block: hashlib.sha256(block).digest(), blocks))
    return _TREE + hashlib.sha256(b"".join(parts)).hexdigest()


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError as e:  # an optional dependency: the extra "persist"
        raise ImportError(
            "save_sessions / load_sessions need the safetensors package: pip install 'ardiff_modules[persist]'"
        ) from e
    return safetensors


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor that shares no memory with ``t``."""
    out = t.detach().to("cpu").contiguous()
    return out.clone() if out.data_ptr() == t.data_ptr() else out


def _write(path: PathLike, tensors: dict[str, torch.Tensor], header: dict[str, Any]) -> None:
    st = _safetensors()
    target = os.fspath(path)
    partial = f"{target}.partial"
    try:
        st.torch.save_file(tensors, partial, metadata={METADATA_KEY: encode(header)})
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


# ---------------------------------------------------------------------------------------------------- load
def load_sessions(cache: FileHost, path: PathLike, session_ids: Sequence[str] | None = None) -> list[KVState]:
    """Open the sessions saved in ``path`` (in their saved order), under their saved ids or ``session_ids``.

    They continue bit-identically to the saved ones. Refuses, changing nothing (no session, no page, no scale):
    a file that is not a sessions file, truncated, corrupted, of another format version or another spec
    (:class:`SessionFileError`, naming the field); ids already open (:class:`SessionIdClashError`); too few
    free pages (:class:`CapacityError`, before anything is allocated); FP8 scales that differ from the ones
    this pool already quantized with (:class:`SessionFileError`).
    """
    tensors, metadata = _read(path)
    return open_snapshot(cache, f"load_sessions({os.fspath(path)})", metadata.get(METADATA_KEY), tensors, session_ids)


def open_snapshot(
    cache: FileHost, where: str, header: object, tensors: Mapping[str, torch.Tensor],
    session_ids: Sequence[str] | None, *, digests: bool = True,
) -> list[KVState]:
    """Open the sessions of a snapshot (header text and tensors: a file's, or received): check, reserve, copy,
    open -- all or nothing (see :func:`load_sessions`); ``where`` names the operation and source in messages.
    ``digests=False`` (received over a link, which delivers bytes whole): no per-tensor SHA-256 check, every
    other check kept. The tensors may be on any device (a CUDA pool's, received over NCCL)."""
    with cache.lock:
        if cache.is_closed:
            raise CacheClosedError(f"{where}: expected an open KVCache, got one that was closed")
        reader = HeaderReader(where, cache.spec, set(tensors), lane_layouts(cache))
        saved = reader.read(header)
        if digests:
            _check_digests(reader, tensors)
        check_layout(cache, reader, saved, tensors)
        ids = _new_ids(cache, saved, session_ids, where)
        scales = _scales_to_adopt(cache, reader, tensors)
        return _install(cache, saved, ids, tensors, scales, where)


def _read(path: PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor (on the CPU) and the metadata; anything safetensors refuses is a :class:`SessionFileError`."""
    st = _safetensors()
    try:
        with st.safe_open(os.fspath(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            return {k: f.get_tensor(k) for k in f.keys()}, metadata
    except OSError:
        raise  # no such file, no permission: the caller's environment, not the file's contents
    except Exception as e:  # NOTE: safetensors raises its own error types (and others) on a malformed file
        raise SessionFileError(
            f"load_sessions({os.fspath(path)}): expected a safetensors sessions file, got one that cannot be "
            f"read ({type(e).__name__}: {e})"
        ) from None


def _check_digests(reader: HeaderReader, tensors: Mapping[str, torch.Tensor]) -> None:
    """Every tensor has the header's digest (a file's tensors: safetensors checks offsets, not contents)."""
    digests = reader.dict_(reader.header.get("digests"), "header.digests")
    if sorted(digests) != sorted(tensors):
        raise reader.fail("header.digests", f"a digest of each tensor {sorted(tensors)}", sorted(digests))
    for name, t in tensors.items():
        digest = _digest(t, like=str(digests[name]))
        if digests[name] != digest:
            raise reader.fail(
                f"tensor {name!r}", f"bytes of SHA-256 {str(digests[name])[:16]}... (the header's)",
                f"SHA-256 {digest[:16]}...: a corrupted file",
            )


def check_layout(
    cache: FileHost, reader: HeaderReader, saved: Sequence[SavedSession], tensors: Mapping[str, torch.Tensor]
) -> None:
    """Every tensor the header names has the shape and dtype this cache implies (works on ``meta`` tensors: a
    receiver checks an envelope before receiving anything)."""
    for lane, n, (pages_name, scales_name) in zip(cache._lanes, reader.lane_pages, tensor_names(cache)):
        raw = lane.pool.kv
        page_shape = (n, raw.shape[0], raw.shape[1], *raw.shape[3:-1], raw.shape[-1] * raw.element_size())
        _expect(reader, tensors, pages_name, page_shape, torch.uint8)
        _expect(reader, tensors, scales_name, tuple(lane.pool.scales.shape), torch.float32)
    spec = cache.spec
    for s in saved:
        for (name, _), prefix in s.cross.items():
            c = spec.cross_attention_spec(name)
            shape = (spec.num_layers, c.tokens, c.num_kv_heads or spec.num_kv_heads, c.head_dim or spec.head_dim)
            for kv in ("k", "v"):
                _expect(reader, tensors, f"{prefix}.{kv}", shape, cache.dtype)
        for image in (image for images in s.lanes for image in images.values()):
            for ref in map(str, image.latents.values()):  # tensor names here (checked by the header reader)
                if ref not in tensors or not tensors[ref].is_floating_point():
                    raise reader.fail(f"latent {ref!r}", "a floating-point tensor of the file", ref in tensors)


def _expect(
    reader: HeaderReader, tensors: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    t = tensors.get(name)
    if t is None or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        got = None if t is None else f"{list(t.shape)} {t.dtype}"
        raise reader.fail(f"tensor {name!r}", f"{list(shape)} {dtype}", got)


def _new_ids(
    cache: FileHost, saved: Sequence[SavedSession], session_ids: Sequence[str] | None, where: str
) -> list[str]:
    if session_ids is None:
        ids = [s.session_id for s in saved]
    else:
        if isinstance(session_ids, str) or not isinstance(session_ids, Sequence) or len(session_ids) != len(saved):
            raise SpecError(
                f"{where.split('(')[0]}.session_ids: expected None or a sequence of {len(saved)} ids (one per saved "
                "session), "
                f"got {session_ids!r:.200}"
            )
        ids = list(session_ids)
        for sid in ids:
            check_session_id(sid)
        if None in ids or len(set(ids)) != len(ids):
            raise SpecError(f"{where.split('(')[0]}.session_ids: expected distinct non-empty ids, got {ids}")
    clash = [sid for sid in ids if sid in cache.sessions]
    if clash:
        raise SessionIdClashError(
            f"{where}: expected ids not open in this cache, got {clash} already open (close them, or pass "
            f"session_ids=[...])"
        )
    return ids


def _scales_to_adopt(
    cache: FileHost, reader: HeaderReader, tensors: Mapping[str, torch.Tensor]
) -> list[torch.Tensor | None]:
    """Per lane, the FP8 scales its pool takes from the file (``None``: keep its own, which equal them or don't
    matter); every lane is checked before any adopts.

    NOTE: FP8 pages are raw bytes quantized with the saving pool's scales: they read back right only under
    those scales, so a pool that already quantized with other scales is refused."""
    out: list[torch.Tensor | None] = []
    for lane, (_, name) in zip(cache._lanes, tensor_names(cache)):
        quantizer, pool = lane.pool.quantizer, lane.pool
        if quantizer is None or reader.header.get("scales_fixed") is not True:
            out.append(None)
            continue
        scales = tensors[name]
        if not bool(torch.isfinite(scales).all()) or not bool((scales > 0).all()):
            raise reader.fail(f"tensor {name!r}", "positive finite FP8 scales", f"min {float(scales.min())}")
        if quantizer.written and not torch.equal(scales.to(pool.scales.device), pool.scales):
            raise reader.fail(
                "spec field 'kv_scales'" + (f" (lane {lane.name!r})" if lane.part is not None else ""),
                "the FP8 scales this pool already quantized its pages with",
                f"scales differing by up to {float((scales.cpu() - pool.scales.cpu()).abs().max()):.3g}",
            )
        out.append(None if quantizer.written else scales)
    return out


def _install(
    cache: FileHost, saved: Sequence[SavedSession], ids: Sequence[str], tensors: Mapping[str, torch.Tensor],
    scales: Sequence[torch.Tensor | None], where: str,
) -> list[KVState]:
    """Reserve (in every lane), copy, then open: an error before the sessions open rolls every lane's reservation
    back exactly."""
    rooms = check_room(cache, saved, where)
    reservations: list[ResumeReservation] = []
    try:
        laid = []  # per lane, per session: (chunks, extents, copies)
        for room in rooms:  # every lane reserved before any copy: a later lane's refusal leaves every pool as it was
            reservations.append(ResumeReservation(room.lane.allocator, len(room.fresh), room.extents))
        for room, reservation, (pages_name, _) in zip(rooms, reservations, tensor_names(cache)):
            fresh, runs = dict(zip(room.fresh, reservation.fresh)), iter(reservation.extents)
            lane_laid = [lay_out(record, ring, {}, fresh, [next(runs) for step in ring.values() if step])
                         for record, ring in zip(room.records, room.rings)]
            copies = sorted({c for laid_out in lane_laid for c in laid_out.copies})
            _copy_pages(room.lane.pool, tensors[pages_name], copies)
            laid.append(lane_laid)
        device = cache._pool.device
        latents = {k: t.to(device) for k, t in tensors.items() if k.startswith("latent.")}
        entries = {p: publish_entry(tensors[f"{p}.k"].to(device), tensors[f"{p}.v"].to(device))
                   for s in saved for p in s.cross.values()}
    except BaseException:
        for reservation in reversed(reservations):
            reservation.rollback()
        raise
    # Then switch (pure bookkeeping): one reference per chunk (and selection) page, less the one each fresh page
    # already has.
    with deferred_interrupts():
        for lane_laid, reservation in zip(laid, reservations):
            held = Counter(p for laid_out in lane_laid for p in laid_out.held())
            reservation.keep((held - Counter(reservation.fresh)).elements())
        for lane, lane_scales in zip(cache._lanes, scales):
            if lane_scales is not None:
                lane.pool.quantizer.adopt_scales(lane_scales)  # type: ignore[union-attr]
        return [
            _open(cache, sid, s, [lane_laid[k] for lane_laid in laid], latents, entries)
            for k, (sid, s) in enumerate(zip(ids, saved))
        ]


@dataclass(frozen=True)
class LaneRoom:
    """How the saved sessions' pages come back into one lane (as a resume lays them out): one record per session,
    pages per ring slot of each branch (0: plain paging), the distinct plain pages, the extent sizes."""

    lane: CacheLane
    records: list[LaneRecord]
    rings: list[dict[str, int]]
    fresh: list[int]
    extents: list[int]


def check_room(cache: FileHost, saved: Sequence[SavedSession], where: str) -> list[LaneRoom]:
    """Each lane's :class:`LaneRoom`; :class:`CapacityError` (naming the lane with groups) if one lane's free
    pages do not hold its part (nothing allocated, every lane checked first)."""
    rooms = []
    for lane in cache._lanes:
        step, extent_chunks = lane.extent_slot_pages, lane.extent_chunks
        records = [file_record(s.lanes[lane.index]) for s in saved]
        rings = [{n: step if ring_fits(extent_chunks, step, cs) else 0 for n, cs in r.chunks.items()} for r in records]
        plain = [p for r, ring in zip(records, rings) for n, cs in r.chunks.items() if not ring[n] for c in cs for p in c]
        # a selection comes back in its frame ring's free slots when it fits there (lane_store.selection_in_ring)
        plain += [p for r, ring in zip(records, rings) for n, pages in r.selections.items()
                  if not (lane.frame_slots and selection_in_ring(r, n, ring.get(n, 0), extent_chunks)) for p in pages]
        fresh = list(dict.fromkeys(plain))
        extents = [lane.extent_pages for ring in rings for size in ring.values() if size]
        needed, free = len(fresh) + sum(extents), lane.allocator.num_free
        if needed > free:
            name = f"lane {lane.name!r}: " if lane.part is not None else ""
            raise CapacityError(
                f"{where}: {name}needed {needed} free device pages ({len(fresh)} pages + {len(extents)} extent(s)), "
                f"got {free} free of {lane.allocator.num_pages}",
                needed=needed,
                free=free,
            )
        rooms.append(LaneRoom(lane, records, rings, fresh, extents))
    return rooms


def _copy_pages(pool: KVPool, pages: torch.Tensor, copies: Sequence[tuple[int, int]]) -> None:
    """File pages -> their device pages (``(file page, device page)`` pairs), one index copy."""
    if not copies:
        return
    raw = pool.kv.view(torch.uint8)
    source = pages.index_select(0, torch.tensor([h for h, _ in copies], dtype=torch.long, device=pages.device))
    index = torch.tensor([q for _, q in copies], dtype=torch.long, device=raw.device)
    raw.index_copy_(2, index, source.to(raw.device).movedim(0, 2))


def _open(
    cache: FileHost, sid: str, saved: SavedSession,
    laid: Sequence[Laid], latents: Mapping[str, torch.Tensor], entries: Mapping[str, CrossEntry],
) -> KVState:
    """Open one loaded session over its laid-out pages in every lane (references taken), its latents and cross
    entries."""
    state = cache.open_session(sid)
    for i, (images, lane_laid) in enumerate(zip(saved.lanes, laid)):
        for name, image in images.items():
            kept = {k: latents[t] for k, t in image.latents.items()}  # type: ignore[index]
            load_branch(state._lane_pages(name)[i], replace(image, latents=kept), lane_laid.chunks[name],
                        lane_laid.extents.get(name, ()), lane_laid.selections.get(name, ()))
    state._adopt_cross_entries({key: entries[prefix] for key, prefix in saved.cross.items()})
    return state
