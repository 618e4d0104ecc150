"""A cache's *lanes*: the storage of one retention group in the layers that hold equally many of its heads.

A uniform cache (``KVCacheSpec.head_retention`` unset) has one lane: the whole spec, one pool, one
allocator -- today's engine exactly. With retention groups (:class:`~ardiff_modules.core.head_retention.HeadRetention`)
each :class:`~ardiff_modules.core.head_retention.HeadPart` is a lane::

    spec (30 layers x 12 kv heads)  --head_retention-->  lane "local/8h": 30 layers x 8 heads, window 1
                                                         lane "other/4h": 30 layers x 4 heads, sink 1 + window 6

Each lane has its own page store ``[lane layers, 2, pages, page_size, lane heads, dim]`` and allocator
(page bytes differ per lane, so lanes cannot share page ids without wasting memory), its own retention
(a short group frees its pages as its window slides) and its own admission arithmetic. One memory budget
is split between the lanes in proportion to one session's peak bytes in each (:func:`split_budget`). A
session keeps one ``BranchPages`` per lane and branch; one ``ForwardTransaction`` spans the lanes
(``docs/design.md``, "Retention groups inside the cache").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ardiff_modules.core.admission import Admission, ExtentRoom
from ardiff_modules.core.allocator import PageAllocator
from ardiff_modules.core.branch import BranchPages
from ardiff_modules.core.branch_frame_extent import frame_extent_slots
from ardiff_modules.core.frame_retention import trims_frames
from ardiff_modules.core.head_retention import HeadPart
from ardiff_modules.core.selected_retention import selection_pages_of
from ardiff_modules.core.retention import RetentionPolicy, SinkWindowPolicy
from ardiff_modules.errors import CapacityError, KVScalesFixedError, SpecError, TensorMismatchError
from ardiff_modules.pool import KVPool, bytes_per_page, pages_for_budget
from ardiff_modules.spec import KVCacheSpec


@dataclass(eq=False)
class CacheLane:
    """One lane of a cache: its spec (its layers, heads and retention), page store, allocator and admission.

    ``part`` is ``None`` for the one lane of a uniform cache (every layer and head).
    """

    index: int
    spec: KVCacheSpec
    pool: KVPool
    allocator: PageAllocator
    #: Slots of each branch's contiguous extent in this lane (``None``: plain paging): chunks, or frames.
    extent_chunks: int | None
    admission: Admission
    part: HeadPart | None = None
    #: Whether the extent's slots are frames (a lane trimming chunks to frames: ``core/branch_frame_extent.py``).
    frame_slots: bool = False
    #: Pages of one extent slot: a chunk's, or with frame slots a frame's (``0``: the spec's chunk).
    extent_slot_pages: int = 0

    def __post_init__(self) -> None:
        spec = self.spec
        if not self.extent_slot_pages:  # (a field, not a property: read by every forward's request)
            self.extent_slot_pages = (
                spec.pages_per_chunk // spec.policy.frames_per_chunk if self.frame_slots  # type: ignore[attr-defined]
                else spec.pages_per_chunk
            )

    @property
    def name(self) -> str:
        """``"<group>/<heads>h"`` for a group's lane, ``"all"`` for a uniform cache's."""
        return "all" if self.part is None else self.part.name

    @property
    def extent_pages(self) -> int:
        """Pages of one contiguous extent (``0``: plain paging)."""
        return (self.extent_chunks or 0) * self.extent_slot_pages

    @property
    def layers(self) -> tuple[int, ...]:
        """The model layers this lane stores heads of, ascending (its layer ``i`` is model layer ``layers[i]``)."""
        return tuple(range(self.spec.num_layers)) if self.part is None else self.part.layers

    def new_branch_pages(self) -> BranchPages:
        """A branch's empty page bookkeeping under this lane's retention and extents."""
        spec = self.spec
        horizon = spec.recache.horizon(spec.policy.sink_chunks)
        return BranchPages(spec.policy, spec.pages_per_chunk, spec.chunk_size, self.extent_chunks, horizon,
                           frame_slots=self.frame_slots)


def lane_spec(spec: KVCacheSpec, part: HeadPart) -> KVCacheSpec:
    """The :class:`KVCacheSpec` of one group's lane: its layers and heads, the group's retention, no cross caches
    (those live on the session, for every head)."""
    group = spec.query_heads // spec.num_kv_heads
    return dataclasses.replace(
        spec, num_layers=len(part.layers), num_kv_heads=part.num_heads,
        num_qo_heads=None if spec.num_qo_heads is None else part.num_heads * group,
        sink_chunks=0, window_chunks=None, retention=part.policy, cross_attention=(), head_retention=None,
        # a group without sink chunks has no sinks to move: its lane attends no sink segment
        relative_sinks=spec.relative_sinks and part.policy.sink_chunks > 0,
    )


def lane_specs(spec: KVCacheSpec) -> tuple[tuple[KVCacheSpec, HeadPart | None], ...]:
    """Each lane's spec and part: the spec itself for a uniform cache, one per :class:`HeadPart` with groups."""
    if spec.head_retention is None:
        return ((spec, None),)
    return tuple((lane_spec(spec, part), part) for part in spec.head_retention.parts())


def extent_chunks_of(spec: KVCacheSpec, backend: str, contiguous_extents: bool | None) -> int | None:
    """Slots of each branch's contiguous extent (``None``: plain paging); by default on with FlashInfer and a
    bounded window. Chunk slots (``sinks + window + 1``), or frame slots for a lane that trims chunks to frames
    (:func:`extent_frames_of`)."""
    frames = extent_frames_of(spec)
    if contiguous_extents is None:
        # NOTE: a lane that trims chunks to frames attends single frames of several chunks: only frame slots keep
        # them in one run (ragged FA3; H100, Forcing-KV's Self-Forcing method compiled + graphed: 246.0 vs 255.4 ms
        # per chunk step paged). A frame lane without a bounded frame count would get chunk slots, which do not
        # keep its frames in one run: it stays paged unless asked.
        contiguous_extents = (
            backend == "flashinfer" and spec.max_history_chunks is not None
            and (frames is not None or not trims_frames(spec.policy))
        )
    if contiguous_extents and spec.max_history_chunks is None:
        raise SpecError("contiguous_extents=True: expected a bounded window (window_chunks), got None")
    if not contiguous_extents:
        return None
    return frames if frames is not None else spec.max_history_chunks + 1  # type: ignore[operator]


def extent_frames_of(spec: KVCacheSpec) -> int | None:
    """Frame slots of a frame lane's extent (:func:`~ardiff_modules.core.branch_frame_extent.frame_extent_slots`:
    sink + window + selected + one chunk's frames), ``None`` for any other lane (chunk slots, if any)."""
    return frame_extent_slots(spec.policy)


def admission_of(spec: KVCacheSpec, extent_chunks: int | None, union_chunks: int | None = None) -> Admission:
    """A lane's admission. ``union_chunks``: with several lanes, the most chunks a re-cache rebuilds in any lane
    (history + the rule's context chunks): one forward rebuilds the union, and a lane attends the union's
    chunks it does not keep as context chunks, so its re-cache reserve counts them."""
    history, context = spec.max_history_chunks, spec.recache.context_chunks
    if union_chunks is not None and history is not None:
        context = max(context, union_chunks - history)
    policy = spec.policy
    frames = None
    kept = getattr(policy, "max_kept_frames", None) if trims_frames(policy) else None
    if isinstance(kept, int):
        # the most frames kept at once (a FrameWindowPolicy: its sink and window frames; a PhasedPolicy: the larger
        # phase's), never more (trimmed chunks hold only them); a frame policy that does not say: whole chunks
        frames = kept * (spec.pages_per_chunk // policy.frames_per_chunk)  # type: ignore[attr-defined]
    # a content-selected branch holds its selection (and a committing forward reserves the next one beside it:
    # Admission counts it twice on the device, once on the host)
    selection = selection_pages_of(policy, spec.pages_per_chunk)
    slot = spec.pages_per_chunk // policy.frames_per_chunk if extent_frames_of(spec) is not None else None  # type: ignore[attr-defined]
    return Admission(len(spec.branches), history, spec.pages_per_chunk, extent_chunks, context, frames, selection, slot)


def union_recache_chunks(policies: Sequence[RetentionPolicy], context: int) -> int | None:
    """The most chunks one re-cache of a stream rebuilds over every lane (their union), ``None`` if unbounded.

    Sink + window groups keep a prefix (their sinks) and a suffix (their window), so the union is at most the
    widest sinks plus the widest window; other policies may keep any chunks: the lanes' sum bounds it.
    """
    bounds = [p.max_history_chunks for p in policies]
    if None in bounds:
        return None
    if all(type(p) is SinkWindowPolicy for p in policies):
        sinks = max(p.sink_chunks for p in policies)
        return sinks + max(b - p.sink_chunks for b, p in zip(bounds, policies)) + context  # type: ignore[operator]
    return sum(bounds) + context  # type: ignore[arg-type]


def lane_pages(
    spec: KVCacheSpec, specs: Sequence[KVCacheSpec], admissions: Sequence[Admission], names: Sequence[str],
    num_pages: int | None, budget_bytes: int | None,
) -> list[int]:
    """Pages of each lane's store. One lane: ``num_pages`` (or the budget's pages). Several: the budget
    (``budget_bytes``, or ``num_pages`` pages of the whole geometry: what a uniform cache of this spec would
    allocate) split in proportion to one session's peak bytes in each lane (:func:`split_budget`)."""
    if len(specs) == 1:
        return [num_pages if num_pages is not None else pages_for_budget(specs[0], budget_bytes)]  # type: ignore[arg-type]
    budget = budget_bytes if budget_bytes is not None else num_pages * bytes_per_page(_whole(spec))  # type: ignore[operator]
    peaks = []
    for lane, admission in zip(specs, admissions):
        if lane.max_history_chunks is None:
            raise SpecError(
                "KVCache: expected every retention group to have a bounded window (the budget is split by each "
                f"lane's peak), got lane of {lane.num_kv_heads} heads with an unbounded window"
            )
        peaks.append(admission.pages_per_session())
    return split_budget(budget, peaks, specs, names)


def _whole(spec: KVCacheSpec) -> KVCacheSpec:
    """``spec`` as one uniform lane (for :func:`bytes_per_page` of the whole geometry)."""
    return dataclasses.replace(spec, head_retention=None, relative_sinks=False)  # (bytes only: no sinks to move)


def split_budget(
    budget: int, session_pages: Sequence[int], specs: Sequence[KVCacheSpec], names: Sequence[str]
) -> list[int]:
    """Pages of each lane: ``budget`` bytes split in proportion to one session's peak bytes in each lane.

    Raises :class:`SpecError` when a lane's share holds no page (a uniform cache refuses a budget below one
    page), naming the smallest budget that gives every lane one.
    """
    sizes = [bytes_per_page(s) for s in specs]
    peaks = [pages * size for pages, size in zip(session_pages, sizes)]
    total = sum(peaks)
    # Integer arithmetic: exact for any budget (a float share can round a page away).
    pages = [budget * peak // total // size for peak, size in zip(peaks, sizes)]
    if min(pages) >= 1:
        return pages
    # Lane l gets a page once budget * peak_l >= size_l * total.
    need = max(-(-size * total // peak) for peak, size in zip(peaks, sizes))
    empty = [f"{name} ({size} bytes a page)" for name, size, n in zip(names, sizes, pages) if n < 1]
    raise SpecError(
        f"KVCache.budget_bytes: expected at least {need} bytes (one page in every lane, with the budget split by "
        f"each lane's peak), got {budget}: no page for {', '.join(empty)}"
    )


def build_lanes(
    spec: KVCacheSpec, num_pages: int | None, budget_bytes: int | None, device: torch.device | str,
    backend: str, contiguous_extents: bool | None,
) -> tuple[CacheLane, ...]:
    """The cache's lanes (pools allocated): one for a uniform spec, one per head part with ``head_retention``."""
    pairs = lane_specs(spec)
    specs = [s for s, _ in pairs]
    extents = [extent_chunks_of(s, backend, contiguous_extents) for s in specs]
    union = None if len(specs) == 1 else union_recache_chunks([s.policy for s in specs], specs[0].recache.context_chunks)
    admissions = [admission_of(s, e, union) for s, e in zip(specs, extents)]
    names = ["all" if part is None else part.name for _, part in pairs]
    pages = lane_pages(spec, specs, admissions, names, num_pages, budget_bytes)
    return tuple(
        CacheLane(i, s, KVPool(s, n, device), PageAllocator(n), e, a, part, e is not None and extent_frames_of(s) is not None)
        for i, ((s, part), n, e, a) in enumerate(zip(pairs, pages, extents, admissions))
    )


#: ``lane -> (free pages, used pages, resident sessions, contiguous room)``: what admission decides on in a lane.
LaneCounts = Callable[[CacheLane], tuple[int, int, int, ExtentRoom | None]]


def sessions_that_fit(lanes: Sequence[CacheLane], counts: LaneCounts, pending_chunks: int, recache: bool) -> int:
    """How many more sessions fit at their peak in every lane (the fewest any lane holds)."""
    return min(lane.admission.sessions_that_fit(*counts(lane), pending_chunks, recache) for lane in lanes)


def check_admit(lanes: Sequence[CacheLane], counts: LaneCounts, pending_chunks: int, recache: bool) -> None:
    """Raise :class:`CapacityError` unless one more session fits at its peak in every lane; with groups the
    error names the first lane that is full."""
    for lane in lanes:
        try:
            lane.admission.check_admit(*counts(lane), pending_chunks, recache)
        except CapacityError as error:
            if len(lanes) == 1:
                raise
            raise CapacityError(f"lane {lane.name!r}: {error}", needed=error.needed, free=error.free) from None


def set_kv_scales(lanes: Sequence[CacheLane], scales: torch.Tensor, num_layers: int, num_kv_heads: int) -> None:
    """Fix the FP8 scales ``[num_layers, 2 (K, V), num_kv_heads]`` of the model's heads in every lane (each lane
    takes its layers' heads); every lane is checked before any changes (``KVCache.set_kv_scales``)."""
    if len(lanes) == 1:
        lanes[0].pool.set_kv_scales(scales)
        return
    spec = lanes[0].spec
    expected = (num_layers, 2, num_kv_heads)
    if not isinstance(scales, torch.Tensor) or tuple(scales.shape) != expected:
        got = tuple(scales.shape) if isinstance(scales, torch.Tensor) else type(scales).__name__
        raise TensorMismatchError(
            f"set_kv_scales: expected a tensor of shape {list(expected)} [num_layers, 2 (K, V), num_kv_heads], got {got}"
        )
    if any(lane.pool.quantizer is None or lane.pool.quantizer.written for lane in lanes):
        lanes[0].pool.set_kv_scales(scales[: spec.num_layers, :, : spec.num_kv_heads])  # raises the one error
        raise KVScalesFixedError(
            "set_kv_scales: expected to be called before any K/V is written (a lane's pages already hold K/V "
            "quantized with the current scales), got a pool that was written to; open a new cache"
        )
    parts = [_lane_rows(scales, lane) for lane in lanes]
    for lane, rows in zip(lanes, parts):  # (values are checked by the first lane before any is set)
        lane.pool.set_kv_scales(rows)


def _lane_rows(scales: torch.Tensor, lane: CacheLane) -> torch.Tensor:
    """``scales [layers, 2, heads]`` restricted to ``lane``: ``[lane layers, 2, lane heads]``."""
    assert lane.part is not None
    return torch.stack([scales[layer][:, list(heads)] for layer, heads in zip(lane.part.layers, lane.part.heads)])


def kv_scales(lanes: Sequence[CacheLane], num_layers: int, num_kv_heads: int) -> torch.Tensor:
    """The model's ``[num_layers, 2 (K, V), num_kv_heads]`` scales: the pool's own tensor for one lane, else
    gathered from every lane (a copy)."""
    if len(lanes) == 1:
        return lanes[0].pool.scales
    out = torch.ones((num_layers, 2, num_kv_heads), dtype=torch.float32, device=lanes[0].pool.device)
    for lane in lanes:
        assert lane.part is not None
        for i, (layer, heads) in enumerate(zip(lane.part.layers, lane.part.heads)):
            out[layer][:, list(heads)] = lane.pool.scales[i]
    return out
