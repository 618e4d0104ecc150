"""``LaneStore``: one lane's pages on the host -- host page ids, arena rows, the copies to and from its device pool.

A cache has one lane (a uniform cache) or one per retention group's head part (:mod:`ardiff_modules.lanes`);
each lane has its own page store and page ids, so the host tier keeps one store per lane::

    lane "local/1h": device pool [layers, 2, pages, ...]  <--copies-->  arena rows  <--  HostPages (ids, aliases)
    lane "other/1h": device pool ...                      <--copies-->  arena rows  <--  HostPages ...

A suspended session holds one :class:`LaneRecord` per lane (its branches' images and chunks as that lane's host
page ids); the tier (:mod:`~ardiff_modules.host.tier`) runs a suspend or a resume over every lane as one
transaction. Pages are never shared between lanes (their bytes differ), so aliases are per lane. One host byte
budget covers every lane: the first lane's :class:`~ardiff_modules.core.host_pages.HostPages` holds it (and the
bytes of cross caches and latents), :func:`check_host_fits` checks it over all lanes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import NamedTuple

import torch

from ardiff_modules.core.branch import BranchImage, BranchPages, PageChunk, unload_branch
from ardiff_modules.core.host_pages import DeviceKey, HostPages
from ardiff_modules.errors import CapacityError
from ardiff_modules.host.arena import HostArena, Row
from ardiff_modules.lanes import CacheLane
from ardiff_modules.session import KVState


@dataclass(frozen=True)
class LaneRecord:
    """One lane of a suspended session (or of a file): per branch its image and its chunks as host page ids, and
    the pages of its content selection (branches without one absent)."""

    images: dict[str, BranchImage]
    chunks: dict[str, tuple[PageChunk, ...]]
    selections: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def host_refs(self) -> list[int]:
        """One entry per host page reference this lane of the session holds."""
        return [h for chunks in self.chunks.values() for chunk in chunks for h in chunk] + [
            h for pages in self.selections.values() for h in pages
        ]


def file_record(images: dict[str, BranchImage]) -> LaneRecord:
    """The record of one lane of a file's session: its images' chunks and selections (page indices of the file)."""
    return LaneRecord(
        images, {n: img.history for n, img in images.items()},
        {n: img.selection.pages for n, img in images.items() if img.selection is not None},
    )


class Laid(NamedTuple):
    """One lane of a session laid out in device pages (:func:`lay_out`): each branch's chunks, its extent (ring
    branches) and its selection's pages, and the ``(host page, device page)`` copies."""

    chunks: dict[str, tuple[PageChunk, ...]]
    extents: dict[str, tuple[int, ...]]
    copies: list[tuple[int, int]]
    selections: dict[str, tuple[int, ...]]

    def held(self) -> list[int]:
        """One entry per device page reference the branches hold (their chunks' and selections' pages)."""
        return [p for cs in self.chunks.values() for c in cs for p in c] + [
            p for pages in self.selections.values() for p in pages
        ]


@dataclass(frozen=True)
class OutPlan:
    """What a suspend copies out of one lane: its distinct history pages, those with a live host copy (reused,
    no copy) and the new ones (copied), their device lifetimes, and the pages inside contiguous extents (never
    aliased: an extent slot is rewritten in place when the ring wraps)."""

    keys: dict[int, DeviceKey]
    reused: dict[int, int]
    new: list[int]
    extents: set[int]


@dataclass(frozen=True)
class InPlan:
    """What a resume brings back into one lane: pages per ring slot of each branch (0: plain paging), the host
    pages with a live device twin (a reference, no copy), the host pages that need a fresh page, the extents."""

    ring: dict[str, int]
    aliases: dict[int, int]
    fresh_hosts: list[int]
    extent_sizes: list[int]


class LaneStore:
    """One lane's host pages (see the module docstring).

    Parameters
    ----------
    lane:
        The cache's lane (its pool, allocator, admission).
    budget_bytes:
        The host tier's budget (``None``: unbounded); it bounds this lane's arena, and the first lane's
        :attr:`pages` hold it.
    first:
        Whether this is the first lane (the one whose ``pages`` hold the budget and the extra bytes).
    min_slab_bytes:
        The least a new arena slab holds.
    """

    def __init__(self, lane: CacheLane, budget_bytes: int | None, first: bool, min_slab_bytes: int) -> None:
        self.lane = lane
        self.pool, self.allocator = lane.pool, lane.allocator
        bpp = self.pool.bytes_per_page
        self.pages = HostPages(bpp, budget_bytes if first else None)
        raw = self.raw()
        max_rows = None if budget_bytes is None else budget_bytes // bpp
        #: The page memory: pinned slabs of rows, kept and reused (pinning is slower than copying).
        self.arena = HostArena((*raw.shape[:2], *raw.shape[3:]), self.pool.device.type == "cuda", min_slab_bytes, max_rows)
        #: Host page id -> its row in the arena.
        self.store: dict[int, Row] = {}

    @property
    def name(self) -> str:
        return self.lane.name

    def raw(self) -> torch.Tensor:
        """The lane's K/V as raw bytes ``[layers, 2, pages, page_size, heads, head_dim * itemsize]`` uint8."""
        return self.pool.kv.view(torch.uint8)

    def branches_of(self, state: KVState) -> dict[str, BranchPages]:
        """``state``'s branches in this lane."""
        return {name: state._lane_pages(name)[self.lane.index] for name in state.kv_branch_names}

    # ------------------------------------------------------------------ suspend
    def plan_out(self, branches: Mapping[str, BranchPages], sessions: Iterable[KVState]) -> OutPlan:
        """What a suspend of ``branches`` copies (``sessions``: the cache's open ones, whose extents are never
        aliased)."""
        alloc, i = self.allocator, self.lane.index
        extents = {p for s in list(sessions) for name in s.kv_branch_names for p in s._lane_pages(name)[i].extent}
        order = list(dict.fromkeys(p for b in branches.values() for p in b.history_pages()))
        keys = {p: (p, alloc.generation(p)) for p in order}
        reused = {p: h for p in order if (h := self.pages.host_copy_of(keys[p])) is not None}
        return OutPlan(keys, reused, [p for p in order if p not in reused], extents)

    def take_rows(self, count: int) -> list[Row]:
        """``count`` arena rows for a suspend's copies (:meth:`give_rows` if they fail)."""
        return self.arena.allocate(count)

    def give_rows(self, rows: Sequence[Row]) -> None:
        self.arena.decref(rows)

    def copy_out(self, pages: Sequence[int], rows: Sequence[Row]) -> None:
        """Device pages -> their arena rows (on the current stream: the tier's side stream when pinned)."""
        if not pages:
            return
        raw = self.raw()
        index = torch.tensor(pages, dtype=torch.long).to(raw.device)
        # NOTE: index_select over the page dim of a page-major view: one contiguous [n, layers, 2, ...] gather.
        self.arena.copy_in(rows, raw.movedim(2, 0).index_select(0, index))

    def keep_out(
        self, plan: OutPlan, rows: Sequence[Row], branches: Mapping[str, BranchPages],
        latents: Mapping[str, Mapping[int, object]],
    ) -> LaneRecord:
        """The copies stand: host page ids for the rows, references for every chunk page, the branches unloaded
        (their device references dropped); the lane's record (pure bookkeeping, nothing that can fail)."""
        host_of = dict(plan.reused)
        for row, h, p in zip(rows, self.pages.allocate(len(plan.new)), plan.new):
            self.store[h] = row
            host_of[p] = h
            if p not in plan.extents:  # NOTE: an extent slot is rewritten in place when the ring wraps
                self.pages.link(h, plan.keys[p])
        occurrences = [host_of[p] for b in branches.values() for p in b.history_pages()]
        self.pages.incref((Counter(occurrences) - Counter(host_of[p] for p in plan.new)).elements())
        chunks = {name: tuple(tuple(host_of[p] for p in c) for c in b.history) for name, b in branches.items()}
        selections = {name: tuple(host_of[p] for p in b.selection_pages()) for name, b in branches.items()
                      if b.selection is not None}
        images = {
            name: replace(unload_branch(b, self.allocator)[0], latents=dict(latents[name]))
            for name, b in branches.items()
        }
        return LaneRecord(images, chunks, selections)

    # ------------------------------------------------------------------ resume
    def plan_in(self, record: LaneRecord, branches: Mapping[str, BranchPages]) -> InPlan:
        """How ``record`` comes back into ``branches``: rings, aliases to live device twins, fresh pages."""
        ring = {n: b.extent_slot_pages if ring_fits(b.extent_chunks, b.extent_slot_pages, record.chunks[n]) else 0
                for n, b in branches.items()}
        aliases = {h: p for h in set(record.host_refs()) if (p := self.live_twin(h)) is not None}
        plain = [h for name in branches if not ring[name] for c in record.chunks[name] for h in c]
        # a selection comes back in the free slots of its branch's frame ring (each member of a family its own copy,
        # as ring chunks: the keys keep the order they were summed in), else in plain pages
        in_ring = {name for name, b in branches.items()
                   if b.frame_slots and selection_in_ring(record, name, ring[name], b.extent_chunks)}
        plain += [h for name, pages in record.selections.items() if name not in in_ring for h in pages]
        fresh = [h for h in dict.fromkeys(plain) if h not in aliases]
        extents = [b.extent_chunks * ring[n] for n, b in branches.items() if ring[n]]  # type: ignore[operator]
        return InPlan(ring, aliases, fresh, extents)

    def live_twin(self, host_page: int) -> int | None:
        """A device page still holding ``host_page``'s bytes (the same lifetime, in use), if any."""
        key = self.pages.device_copy_of(host_page)
        if key is None:
            return None
        page, generation = key
        alloc = self.allocator
        return page if alloc.refcount(page) > 0 and alloc.generation(page) == generation else None

    def check_room(self, what: str, plan: InPlan, grouped: bool) -> None:
        """:class:`CapacityError` (nothing changed) unless the lane's free pages hold ``plan``'s fresh pages and
        extents; ``grouped``: the message names the lane."""
        fresh, extents = len(plan.fresh_hosts), plan.extent_sizes
        needed, free = fresh + sum(extents), self.allocator.num_free
        if needed > free:
            lane = f"lane {self.name!r}: " if grouped else ""
            raise CapacityError(
                f"{what}: {lane}needed {needed} free device pages ({fresh} pages + {len(extents)} extent(s) of "
                f"{extents[0] if extents else 0}), got {free} free of {self.allocator.num_pages}",
                needed=needed,
                free=free,
            )

    def copy_in(self, copies: Sequence[tuple[int, int]]) -> None:
        """Host pages -> their device pages, ``(host page, device page)`` pairs (on the current stream)."""
        raw = self.raw()
        # Run by run of consecutive arena rows: each run moves in one host-to-device copy, no staging.
        copies = sorted(copies, key=lambda hp: self.store[hp[0]])
        places = [self.store[h] for h, _ in copies]
        for first, count, rows in self.arena.runs(places):
            index = torch.tensor([q for _, q in copies[first : first + count]], dtype=torch.long).to(raw.device)
            raw.index_copy_(2, index, rows.to(raw.device, non_blocking=True).movedim(0, 2))

    def keep_in(self, fresh: Mapping[int, int]) -> None:
        """The resume stands: each fresh device page now has its host page's bytes (an alias for later suspends)."""
        for h, q in fresh.items():
            self.pages.link(h, (q, self.allocator.generation(q)))

    # ------------------------------------------------------------------ lifetime
    def drop(self, record: LaneRecord) -> None:
        """A suspended session left the tier: its host references go (rows of pages no longer held are free)."""
        self.arena.decref([self.store.pop(h) for h in self.pages.decref(record.host_refs())])

    def reserve_rows(self, rows: int, cap_rows: int | None) -> None:
        """Make ``rows`` arena rows free now, the arena holding at most ``cap_rows`` (``None``: no cap)."""
        if cap_rows is not None:
            rows = min(rows, cap_rows - self.arena.capacity_rows + self.arena.free_rows)
        self.arena.reserve(rows)


def check_host_fits(
    what: str, stores: Sequence[LaneStore], new_pages: Sequence[int], extra_bytes: int
) -> None:
    """Raise :class:`CapacityError` (nothing changed) unless ``new_pages`` (per lane) and ``extra_bytes`` fit the
    one host budget (held by the first lane's pages) beside what every lane holds."""
    first = stores[0].pages
    if len(stores) == 1:
        first.check_fits(what, new_pages[0], extra_bytes)
        return
    used = sum(s.pages.nbytes for s in stores)
    free = None if first.budget_bytes is None else first.budget_bytes - used
    needed = sum(n * s.pool.bytes_per_page for n, s in zip(new_pages, stores)) + extra_bytes
    if free is not None and needed > free:
        pages = ", ".join(f"{n} of {s.pool.bytes_per_page} bytes in lane {s.name!r}" for n, s in zip(new_pages, stores))
        raise CapacityError(
            f"{what}: the host tier needs {needed} bytes (pages: {pages}; + {extra_bytes} bytes of cross caches and "
            f"latents), only {free} of its budget {first.budget_bytes} bytes are free",
            needed=needed,
            free=free,
        )


def lay_out(
    record: LaneRecord, ring: Mapping[str, int], aliases: Mapping[int, int], fresh: Mapping[int, int],
    runs: Sequence[Sequence[int]],
) -> Laid:
    """Each branch's device chunks, its extent, its selection's pages, and the ``(host page, device page)`` copies
    (by device page).

    A ring branch's chunk takes the first pages of the slot of its fresh extent it had when suspended
    (:func:`ring_slots`; each slot ``ring[name]`` pages); a plain branch takes the aliased (no copy) or the fresh
    page of each host page; a content selection takes its frame ring's slots when it fits there
    (:func:`selection_in_ring`), else the aliased or fresh pages.
    """
    chunks: dict[str, tuple[PageChunk, ...]] = {}
    extents: dict[str, tuple[int, ...]] = {}
    copies: set[tuple[int, int]] = set()
    run_of = iter(runs)
    device_of = {**aliases, **fresh}
    run_by = dict(zip((n for n in record.chunks if ring[n]), runs))
    in_ring = {n for n, run in run_by.items() if selection_in_ring(record, n, ring[n], len(run) // ring[n])}
    selections = {name: tuple(device_of[h] for h in pages) for name, pages in record.selections.items()
                  if name not in in_ring}
    copies.update((h, fresh[h]) for name, pages in record.selections.items() if name not in in_ring
                  for h in pages if h in fresh)
    for name, host_chunks in record.chunks.items():
        step = ring[name]
        if step:
            run = list(next(run_of))
            image, slots = record.images[name], len(run) // step
            groups = [-(-len(c) // step) for c in host_chunks]  # slots each chunk takes (frame slots: its frames)
            own = record.selections.get(name, ())
            own_groups = -(-len(own) // step) if name in in_ring else 0
            placed = saved_frame_slots(image.frame_slots, image.selection_slots, groups, own_groups, slots)
            own_slots: list[int] | None = None
            if placed is not None:  # a frame ring: each frame where its keys keep their order (frame_slots_of)
                per_chunk, own_slots = placed
            elif any(s is not None for s in image.slots) and all(len(c) <= step for c in host_chunks):
                per_chunk = [[i] for i in ring_slots(image.slots, len(host_chunks), slots)]
            else:  # in history order, lowest slots first (a frame extent's chunk takes a slot per frame)
                starts = accumulate(groups[:-1], initial=0)
                per_chunk = [list(range(i, i + g)) for i, g in zip(starts, groups)]
            laid = tuple(tuple(p for s in ss for p in run[s * step : (s + 1) * step])[: len(c)]
                         for ss, c in zip(per_chunk, host_chunks))
            copies.update(zip((h for c in host_chunks for h in c), (p for c in laid for p in c)))
            chunks[name], extents[name] = laid, tuple(run)
            if own_groups:  # (a frame ring's own selection: the slots it had, else its lowest free slots)
                used = {s for ss in per_chunk for s in ss}
                free = own_slots if own_slots else [s for s in range(slots) if s not in used]
                selections[name] = tuple(p for s in free for p in run[s * step : (s + 1) * step])[: len(own)]
                copies.update(zip(own, selections[name]))
        else:
            chunks[name] = tuple(tuple(device_of[h] for h in c) for c in host_chunks)
            copies.update((h, fresh[h]) for c in host_chunks for h in c if h in fresh)
    return Laid(chunks, extents, sorted(copies, key=lambda hp: hp[1]), selections)


def selection_in_ring(record: LaneRecord, name: str, step: int, slots: int | None) -> bool:
    """Whether branch ``name``'s content selection comes back in its frame ring (``step`` pages a slot; 0: no ring)
    of ``slots`` slots: it has one, and it fits beside the branch's chunks."""
    own = record.selections.get(name, ())
    return bool(own) and bool(step) and ring_fits(slots, step, (*record.chunks[name], own))


def saved_frame_slots(
    frame_slots: Sequence[Sequence[int]], selection_slots: Sequence[int], groups: Sequence[int],
    selection_groups: int, slots: int,
) -> tuple[list[list[int]], list[int]] | None:
    """The frame slots of a frame ring's chunks (``groups[i]`` frames each) and its selection (``selection_groups``
    frames; 0: not in the ring) that the image names (:func:`~ardiff_modules.core.branch.frame_slots_of`), when
    they match and fit: distinct and inside ``slots``; else ``None`` (lay them out in history order)."""
    own = list(selection_slots) if selection_groups else []
    if len(frame_slots) != len(groups) or any(len(ss) != g for ss, g in zip(frame_slots, groups)) or (
        len(own) != selection_groups
    ):
        return None
    taken = [s for ss in frame_slots for s in ss] + own
    if len(set(taken)) != len(taken) or not all(0 <= s < slots for s in taken):
        return None
    return [list(ss) for ss in frame_slots], own


def ring_fits(slots: int | None, step: int, chunks: Sequence[PageChunk]) -> bool:
    """Whether ``chunks`` (a branch's history) come back in an extent of ``slots`` slots of ``step`` pages (``None``:
    plain paging): some chunk, each taking ``ceil(pages / step)`` slots (a chunk slot: one; frame slots: its frames)."""
    return slots is not None and bool(chunks) and sum(-(-len(c) // step) for c in chunks) <= slots


def ring_slots(saved: tuple[int | None, ...], chunks: int, slots: int) -> list[int]:
    """The extent slot of each of ``chunks`` history chunks: the one it had (``saved``, when it names a distinct
    slot for every chunk it places), the lowest free slot for the others (a chunk that sat outside the extent)."""
    if len(saved) != chunks:
        saved = (None,) * chunks
    taken = [s for s in saved if s is not None]
    if len(set(taken)) != len(taken) or any(not 0 <= s < slots for s in taken):
        saved, taken = (None,) * chunks, []
    free = iter(s for s in range(slots) if s not in set(taken))
    return [s if s is not None else next(free) for s in saved]
