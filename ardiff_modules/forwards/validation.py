"""Validation of one forward's request, before anything changes (streams, lengths, mask, capacity).

Every check raises the library's error naming the expected and the actual value; none mutates,
so a refused ``prepare_forward`` leaves every session, the allocator and the pool as they were.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import torch

from ardiff_modules.core.allocator import PageAllocator
from ardiff_modules.checks import is_int, require_bool
from ardiff_modules.errors import (
    LatentsNotKeptError,
    CapacityError,
    PendingContextError,
    SequenceLengthError,
    SpecError,
    TensorMismatchError,
)
from ardiff_modules.core.transaction import ForwardTransaction
from ardiff_modules.core.branch import BranchPages
from ardiff_modules.core.frame_retention import trims_frames
from ardiff_modules.core.recache import RecachePlan, RecacheRule
from ardiff_modules.layout import StreamLayout
from ardiff_modules.spec import KVCacheSpec, PendingAttention, check_pending_attention
from ardiff_modules.session import KVState


def validate_streams(streams: Sequence[tuple[KVState, str]], cache: object) -> tuple[tuple[KVState, str], ...]:
    """The forward's ``(session, branch)`` pairs: ordered, distinct, open, of ``cache``; a tuple."""
    if isinstance(streams, (set, frozenset, dict, str)) or not isinstance(streams, Iterable):
        raise SpecError(
            f"prepare_forward: expected an ordered sequence of (session, branch) pairs, got {type(streams).__name__}"
        )
    members = tuple(streams)  # a generator is consumed once: keep what it gave
    if not members:
        raise SpecError("prepare_forward: expected at least one (session, branch) stream, got none")
    seen = set()
    for item in members:
        if not (
            isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], KVState) and isinstance(item[1], str)
        ):
            raise SpecError(f"prepare_forward: expected (KVState, branch name) pairs, got {item!r:.120}")
        state, branch = item
        if state.cache is not cache:
            raise SpecError(f"prepare_forward: expected sessions of this KVCache, got {state.session_id!r} of another")
        state.branch_pages(branch)  # raises on closed session / unknown branch
        key = (state.session_id, branch)
        if key in seen:
            raise SpecError(f"prepare_forward: stream {key} appears twice; expected distinct streams")
        seen.add(key)
    return members


def chunk_lengths_of(
    spec: KVCacheSpec, seq_len: int, commit_current: bool, static: bool, chunk_lengths: Sequence[int] | None
) -> tuple[int, ...]:
    """Validate the forward's arguments; return the token count of each pending chunk."""
    chunk, page = spec.chunk_size, spec.page_size
    require_bool("prepare_forward.commit_current", commit_current)
    require_bool("prepare_forward.static", static)
    if static and spec.max_history_chunks is None:
        raise SpecError(
            "prepare_forward(static=True): expected a bounded window (window_chunks is not None) so the "
            "fixed buffers can be sized, got window_chunks=None"
        )
    if chunk_lengths is not None:
        return _whole_in_frame_lanes(spec, _checked_lengths(spec, seq_len, chunk_lengths))
    if is_int(seq_len) and seq_len > 0 and seq_len % chunk == 0:
        return (chunk,) * (seq_len // chunk)
    if is_int(seq_len) and 0 < seq_len < chunk and seq_len % page == 0:
        return _whole_in_frame_lanes(spec, (seq_len,))  # one shorter chunk (e.g. a 1-frame first chunk)
    raise SequenceLengthError(
        f"seq_len: expected a positive multiple of chunk_size={chunk} (or one shorter chunk: a multiple of "
        f"page_size={page} below it; for mixed chunk sizes pass chunk_lengths), got {seq_len!r}"
    )


def _whole_in_frame_lanes(spec: KVCacheSpec, lengths: tuple[int, ...]) -> tuple[int, ...]:
    """``lengths``, unless a shorter chunk would be committed where a policy counts frames by commit index."""
    if all(n == spec.chunk_size for n in lengths):
        return lengths
    retention = spec.head_retention
    # (the groups that hold heads: a declared group without any stores nothing, counts nothing)
    policies = [spec.policy] if retention is None else [retention.groups[p.group] for p in retention.parts()]
    framed = [p for p in policies if trims_frames(p)]
    if framed:
        raise SequenceLengthError(
            f"prepare_forward: expected whole chunks of chunk_size={spec.chunk_size} tokens (a FrameWindowPolicy "
            f"counts frames_per_chunk={framed[0].frames_per_chunk} frames in every chunk), got chunk lengths "  # type: ignore[attr-defined]
            f"{list(lengths)}"
        )
    return lengths


def pending_attention_of(spec: KVCacheSpec, pending_attention: str | None) -> PendingAttention:
    """The forward's rule between its pending chunks: ``pending_attention``, or the spec's default for ``None``."""
    if pending_attention is None:
        return spec.pending_attention
    return check_pending_attention("prepare_forward.pending_attention", pending_attention)


def _checked_lengths(spec: KVCacheSpec, seq_len: int, chunk_lengths: Sequence[int]) -> tuple[int, ...]:
    chunk, page = spec.chunk_size, spec.page_size
    if isinstance(chunk_lengths, (str, set, frozenset, dict)) or not isinstance(chunk_lengths, Sequence):
        raise SequenceLengthError(
            f"chunk_lengths: expected a sequence of token counts, got {type(chunk_lengths).__name__}"
        )
    lengths = tuple(chunk_lengths)
    bad = [n for n in lengths if not is_int(n) or not 0 < n <= chunk or n % page]
    if not lengths or bad:
        raise SequenceLengthError(
            f"chunk_lengths: expected multiples of page_size={page} in [{page}, chunk_size={chunk}], got "
            f"{list(lengths)}"
        )
    if seq_len != sum(lengths):
        raise SequenceLengthError(f"seq_len: expected sum(chunk_lengths)={sum(lengths)}, got {seq_len!r}")
    return lengths


def check_token_mask(token_mask: torch.Tensor, expected: tuple[int, int, int], device: torch.device) -> None:
    """``token_mask``: bool, on the CPU or the pool's device, of shape ``expected`` [streams, seq_len, max_keys]."""
    if not isinstance(token_mask, torch.Tensor):
        raise TensorMismatchError(f"token_mask: expected a torch.bool tensor, got {type(token_mask).__name__}")
    if token_mask.dtype != torch.bool:
        raise TensorMismatchError(f"token_mask: expected dtype torch.bool, got {token_mask.dtype}")
    if token_mask.device.type not in ("cpu", device.type):
        raise TensorMismatchError(
            f"token_mask: expected a tensor on the CPU or {device}, got one on {token_mask.device}"
        )
    if tuple(token_mask.shape) != expected:
        raise TensorMismatchError(
            f"token_mask: expected shape {expected} [streams, seq_len, max_keys], got {tuple(token_mask.shape)}"
        )


def check_capacity(
    histories: Sequence[BranchPages], chunk_pages: Sequence[int], allocator: PageAllocator, extent_pages: int,
    commit: bool = False,
) -> None:
    """Raise :class:`CapacityError` unless the forward's pages (and new extents; a committing forward's selection
    pages) fit."""
    needed = sum(h.pages_needed(chunk_pages, allocator) for h in histories)
    if commit and histories and histories[0].selects:  # (a lane's branches share its policy)
        needed += sum(h.selection_pages_needed(len(chunk_pages)) for h in histories)
    if needed > allocator.num_free:
        raise CapacityError(
            f"KV pool out of pages: this forward needs {needed} more pages "
            f"({len(chunk_pages)} pending chunk(s) of {list(chunk_pages)} pages for "
            f"{len(histories)} stream(s), minus pages already pending), only "
            f"{allocator.num_free} of {allocator.num_pages} are free",
            needed=needed,
            free=allocator.num_free,
        )
    new_extents = sum(1 for h in histories if h.needs_extent)
    # NOTE: the extents need not be adjacent (ForwardReservation takes one run for all when it can, else one each).
    if new_extents and new_extents > allocator.runs_that_fit(extent_pages):
        raise CapacityError(
            f"KV pool out of contiguous pages: {new_extents} new branch extent(s) of {extent_pages} consecutive "
            f"pages each, the free runs {[n for _, n in allocator.free_runs()]} hold only "
            f"{allocator.runs_that_fit(extent_pages)} ({allocator.num_free} pages free); size the pool larger "
            f"or pass contiguous_extents=False",
            needed=new_extents * extent_pages,
            free=allocator.num_free,
        )


def check_lanes_fit(
    lanes: Sequence[Any], lane_branches: Sequence[Sequence[BranchPages]], chunk_pages: Sequence[int], commit: bool,
    selecting: bool,
) -> None:
    """:func:`check_capacity` in every lane (``lanes``: the cache's ``CacheLane``); with a content-selected lane
    (``selecting``) a committing forward commits one chunk (:class:`SequenceLengthError`)."""
    for lane, branches in zip(lanes, lane_branches):
        check_capacity(branches, chunk_pages, lane.allocator, lane.extent_pages, commit and selecting)
    if selecting and commit and len(chunk_pages) > 1:
        raise SequenceLengthError(
            f"prepare_forward: expected one chunk per committing forward (a SelectedFramesPolicy scores the frames "
            f"leaving its window at each chunk's commit), got {len(chunk_pages)} chunks"
        )


def check_no_open_commit(state: KVState, branch: str, history: BranchPages) -> None:
    """A committing forward must be committed or aborted before its streams run again."""
    open_forward = history.transaction
    if isinstance(open_forward, ForwardTransaction) and open_forward.is_open and open_forward.commit_current:
        raise PendingContextError(
            f"Branch {branch!r} of session {state.session_id!r} has a committing forward of "
            f"{open_forward.num_chunks} chunk(s) that was neither committed nor aborted; call "
            f"commit_paged_context({branch!r}) or abort({branch!r}) before preparing the next forward"
        )


def resolve_recache_rule(keep_sinks: bool | None, rule: RecacheRule | None, spec_rule: RecacheRule, sink_chunks: int) -> RecacheRule:
    """The rule a re-cache runs under: ``rule``, the historical ``keep_sinks=`` switch, or the spec's.

    Raises :class:`SpecError` for both at once, a non-rule, or a rule needing evicted chunks the cache's
    branches do not remember (``KVCacheSpec(recache=...)`` sizes that memory).
    """
    if keep_sinks is not None and rule is not None:
        raise SpecError(f"prepare_recache: expected keep_sinks= or rule=, got both (keep_sinks={keep_sinks}, rule={rule})")
    if keep_sinks is not None:
        require_bool("prepare_recache.keep_sinks", keep_sinks)
        return RecacheRule.from_keep_sinks(keep_sinks)
    if rule is None:
        return spec_rule
    if not isinstance(rule, RecacheRule):
        raise SpecError(f"prepare_recache.rule: expected a RecacheRule, got {type(rule).__name__}")
    if rule.horizon(sink_chunks) > spec_rule.horizon(sink_chunks):
        raise SpecError(
            f"prepare_recache: expected a rule that needs at most {spec_rule.horizon(sink_chunks)} evicted chunk(s) "
            f"(what KVCacheSpec(recache={spec_rule}) remembers), got {rule} needing {rule.horizon(sink_chunks)}; "
            "build the cache with KVCacheSpec(recache=<this rule>)"
        )
    return rule


def recache_plans(
    members: Sequence[tuple[KVState, str]], histories: Sequence[BranchPages], rule: RecacheRule,
    *, idle: bool = True,
) -> tuple[tuple[RecachePlan, ...], list[int]]:
    """Validate a re-cache request: each stream's plan, and the pages of each chunk it rebuilds (the same for all).

    Each stream must be idle (no open forward, no pending chunk kept by a denoising forward: the
    rebuilt chunks take the pending slot; not checked with ``idle=False``) and keep at least one rebuilt
    chunk; streams batched in one launch must rebuild chunks of the same lengths; a moved sink must have
    the length of the sink it replaces.
    """
    shapes, plans = [], []
    for (state, branch), h in zip(members, histories):
        plan = stream_recache_plan(state, branch, h, rule, idle)
        if not plan.num_kept_chunks:
            raise SpecError(
                f"prepare_recache: expected at least one resident chunk to rebuild on {state.session_id!r}/{branch!r} "
                f"({rule}), got {len(h.history)} resident chunk(s), {len(h.sinks)} of them sinks"
            )
        pages = tuple(h.recache_chunk(i)[1] for i in plan.rebuilt)
        shapes.append(pages)
        plans.append(plan)
    if len(set(shapes)) != 1:
        page = histories[0].page_size
        got = {f"{s.session_id}/{b}": [n * page for n in shape] for (s, b), shape in zip(members, shapes)}
        raise SequenceLengthError(
            f"prepare_recache: expected every stream to rebuild chunks of the same lengths (one launch), got "
            f"token lengths {got}; re-cache them in separate calls"
        )
    return tuple(plans), list(shapes[0])


def stream_recache_plan(state: KVState, branch: str, h: BranchPages, rule: RecacheRule, idle: bool) -> RecachePlan:
    """One stream's re-cache plan in one lane (``h``: its pages there): the stream idle (unless ``idle=False``), a
    moved sink as long as the sink it replaces. An empty plan is the caller's to refuse."""
    forward = h.transaction
    if idle and ((isinstance(forward, ForwardTransaction) and forward.is_open) or h.pending):
        what = "an open forward" if isinstance(forward, ForwardTransaction) and forward.is_open else (
            f"{len(h.pending)} pending chunk(s) kept by a denoising forward"
        )
        raise PendingContextError(
            f"prepare_recache: expected branch {branch!r} of session {state.session_id!r} to be idle (no open "
            f"forward, no pending chunk), got {what}; commit_paged_context({branch!r}) or abort({branch!r}) first"
        )
    plan = h.recache_plan(rule)
    for index, slot in zip(plan.rebuilt, plan.replaces):
        n = h.recache_chunk(index)[1]
        # (the sink's written length: a frame policy holds it trimmed to its sink frames)
        if plan.moved and slot is not None and slot < len(h.sinks) and n != h.full_pages(slot):
            size = h.page_size
            raise SpecError(
                f"prepare_recache: expected the chunk moving into sink slot {slot} of {state.session_id!r}/{branch!r} "
                f"to have the sink's {h.full_pages(slot) * size} tokens, got chunk {index} of {n * size} (sinks "
                "of another length than the chunks, e.g. a 1-frame image-to-video first chunk, cannot move)"
            )
    return plan


def kept_latents(
    keep_latents: torch.Tensor, commit_current: bool, num_streams: int, lengths: Sequence[int]
) -> tuple[tuple[torch.Tensor, ...], ...]:
    """Validate ``keep_latents``; return per stream a copy of each chunk's slice along dim 1.

    Dim 1 is either the forward's tokens (``[num_streams, seq_len, ...]``, token-major) or, for 4+ dims, its
    latent frames in the model's own layout (``[num_streams, frames, C, H, W]``, Self-Forcing's ``[B, F, C, H, W]``;
    Wan's channel-first ``[B, C, F, H, W]``: pass ``x.transpose(1, 2)``):
    ``frames`` divides ``seq_len`` and every chunk holds whole frames (``seq_len / frames`` tokens each), so a
    1-frame first chunk (image-to-video) keeps 1 frame. ``recache_latents`` hands them back in the same layout.

    NOTE: copies, not views: denoising loops commonly reuse their latent buffer in place, and a view of
    one chunk would also keep the whole forward's tensor alive until the last of its chunks is evicted.
    """
    if not isinstance(keep_latents, torch.Tensor):
        raise TensorMismatchError(
            f"prepare_forward.keep_latents: expected a tensor [num_streams, seq_len, ...], got "
            f"{type(keep_latents).__name__}"
        )
    if not commit_current:
        raise SpecError(
            "prepare_forward.keep_latents: expected a committing forward (commit_current=True: the clean "
            "latents of the chunks that join history), got commit_current=False"
        )
    sizes = _latent_units(keep_latents, num_streams, lengths)
    latents = keep_latents.detach()
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    return tuple(
        tuple(latents[s, a:b].clone() for a, b in zip(bounds, bounds[1:])) for s in range(num_streams)
    )


def _latent_units(keep_latents: torch.Tensor, num_streams: int, lengths: Sequence[int]) -> list[int]:
    """Each chunk's extent along ``keep_latents``' dim 1: its tokens (token-major) or its frames (frame-major)."""
    seq_len = sum(lengths)
    shape = tuple(keep_latents.shape)
    units = shape[1] if len(shape) >= 2 else 0
    if len(shape) >= 2 and shape[0] == num_streams and units == seq_len:
        return list(lengths)
    per_frame = seq_len // units if units and seq_len % units == 0 else 0
    # NOTE: frame-major only from 4 dims ([B, F, C, H, W]): a 3-D [B, L, D] with a wrong L that divides seq_len
    # is a token-major mistake, never silently read as frames.
    if len(shape) >= 4 and shape[0] == num_streams and per_frame and all(n % per_frame == 0 for n in lengths):
        return [n // per_frame for n in lengths]
    raise TensorMismatchError(
        f"prepare_forward.keep_latents: expected shape [num_streams={num_streams}, seq_len={seq_len}, ...], got "
        f"{shape}; or frame-major [num_streams={num_streams}, frames, C, H, W, ...] (4+ dims: the model's layout, e.g. "
        f"[B, F, C, H, W]) "
        f"where every chunk holds whole frames (chunk tokens {list(lengths)})"
    )


def check_recache_latents(members: Sequence[tuple[KVState, str]], rows: Sequence[Sequence[torch.Tensor]]) -> None:
    """The kept latents of the rebuilt chunks (``rows[stream][chunk]``, each ``[chunk_len, ...]``) share one
    trailing shape, dtype and device, so that they form one ``[num_streams, seq_len, ...]`` tensor.

    NOTE: each committing forward kept its own ``keep_latents``; nothing tied their trailing shapes together.
    """

    def describe(t: torch.Tensor) -> str:
        return f"{tuple(t.shape)} {t.dtype} on {t.device}"

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape[1:] == b.shape[1:] and a.dtype == b.dtype and a.device == b.device

    names = [f"{state.session_id!r}/{branch!r}" for state, branch in members]
    for name, row in zip(names, rows):  # within one stream: its rebuilt chunks are concatenated
        bad = next((c for c, latent in enumerate(row) if not same(latent, row[0])), None)
        if bad is not None:
            raise TensorMismatchError(
                f"recache_latents: expected the kept latents of {name}'s rebuilt chunks to share one trailing shape, "
                f"dtype and device (chunk 0: {describe(row[0])}), got chunk {bad}: {describe(row[bad])}; feed the "
                "model your own latents"
            )
    for name, row in zip(names[1:], rows[1:]):  # across streams: stacked
        if not same(row[0], rows[0][0]):
            raise TensorMismatchError(
                f"recache_latents: expected every stream's kept latents to share one trailing shape, dtype and "
                f"device ({names[0]}: {describe(rows[0][0])}), got {name}: {describe(row[0])}; re-cache them in "
                "separate calls"
            )


def recache_fresh_pages(history: BranchPages, chunk_pages: Sequence[int], allocator: PageAllocator) -> int:
    """Pool pages a re-cache of ``history`` (idle) takes: its free ring slots hold the first rebuilt chunks.

    What ``ForwardReservation(..., extent_pages=0)`` allocates: no new extent, ``0`` slots without one.
    """
    if history.frame_slots and history.extent:  # (frame slots: a chunk takes several)
        return history.frame_pages_needed(chunk_pages, allocator)
    return sum(chunk_pages[len(history.free_extent_slots(allocator)) :])


def check_recache_capacity(histories: Sequence[BranchPages], chunk_pages: Sequence[int], allocator: PageAllocator) -> None:
    """Raise :class:`CapacityError` unless the rebuilt chunks of every stream fit: free ring slots, then fresh pages.

    Consistent with admission (``KVCache.recache_reserve``): with every other session at its peak, one
    session admitted at its peak always passes this check.
    """
    needed = sum(recache_fresh_pages(h, chunk_pages, allocator) for h in histories)
    if needed > allocator.num_free:
        in_ring = len(histories) * sum(chunk_pages) - needed
        raise CapacityError(
            f"KV pool out of pages: this re-cache needs {needed} fresh pages ({len(chunk_pages)} chunk(s) of "
            f"{list(chunk_pages)} pages for {len(histories)} stream(s), {in_ring} of those pages in free ring slots); "
            f"only {allocator.num_free} of {allocator.num_pages} are free; the old history stays until the new one "
            "is committed: re-cache fewer sessions at a time (admission keeps room for one)",
            needed=needed,
            free=allocator.num_free,
        )


def check_recache_sinks_in_place(
    members: Sequence[tuple[KVState, str]], histories: Sequence[BranchPages], plans: Sequence[RecachePlan]
) -> None:
    """With relative sinks, a re-cache that rebuilds the sinks must not need them moved.

    A rebuilt sink is a pending chunk, which its stream's other rebuilt chunks attend at natural
    distance; once the window has slid (the sinks' shift is not 0, :meth:`StreamLayout.sink_shift`)
    that is not where relative sinks sit, so such a re-cache is refused: keep the sinks (the default).
    """
    for (state, branch), h, plan in zip(members, histories, plans):
        sinks = h.sinks
        if not sinks or not plan.rebuilds_sinks(len(sinks)):
            continue
        if plan.moved:
            raise SpecError(
                f"prepare_recache: expected a rule that keeps the sinks in place for {state.session_id!r}/{branch!r} "
                "with relative_sinks, got one that moves them (sinks=\"move\"): relative sinks are attended at a "
                "shifted position, moved ones would not be"
            )
        if len(sinks) >= len(h.history):  # nothing but sinks is rebuilt: no distance to keep
            continue
        stream = StreamLayout(
            tuple(h.history_pages()), (), h.token_offset, tuple(h.history_spans()), sink_pages=h.sink_pages()
        )
        shift = stream.sink_shift(h.page_size)
        if shift:
            raise SpecError(
                f"prepare_recache: expected keep_sinks=True (the sinks kept) for {state.session_id!r}/{branch!r} with relative_sinks "
                f"(its sinks sit {shift} tokens before its oldest window chunk: rebuilt sinks would be attended "
                "at their natural distance)"
            )


def gather_recache_latents(
    members: Sequence[tuple[KVState, str]], kept: Sequence[Mapping[int, object]], rebuilt: Sequence[Sequence[int]]
) -> torch.Tensor:
    """The kept clean latents of each stream's rebuilt chunks (``rebuilt[stream]``, commit indices, looked up in
    ``kept[stream]``), ``[num_streams, seq_len, ...]`` in commit order; :class:`LatentsNotKeptError` naming the
    chunks not kept."""
    rows = []
    for (state, branch), latents, chunks in zip(members, kept, rebuilt):
        indices = list(chunks)
        missing = [i for i in indices if i not in latents]
        if missing:
            raise LatentsNotKeptError(
                f"recache_latents: expected kept latents of chunks {indices} of {state.session_id!r}/"
                f"{branch!r}, got none for chunk(s) {missing}; pass keep_latents= to their committing "
                "forwards, or feed the model your own latents"
            )
        rows.append([cast(torch.Tensor, latents[i]) for i in indices])
    check_recache_latents(members, rows)
    return torch.stack([torch.cat(row) for row in rows])
