"""Host-side description of one forward and the CPU index tensors kernels need.

A :class:`ForwardLayout` lists, for each stream (a branch of a session) of a
forward, its visible committed pages and its pending chunks' pages. From it,
once per forward and shared by every layer, we derive:

* ``write_slots``: where each current token's K/V goes (flat token slots);
* structural rows: one attention request per (stream, pending chunk) whose
  page list is exactly its visible pages (history + pending chunks ``0..c``)
  -- FlashInfer's ``qo_indptr / kv_indptr / kv_indices / last_page_len``; under
  ``pending_attention="bidirectional"`` one request per stream (all its pending
  tokens over history + every pending page);
* the dense oracle: per stream, the gathered key slots and the boolean mask of
  the visibility rule (pending query chunk ``c`` sees the committed history chunks --
  sinks and window -- and pending chunks ``0..c``, or every pending chunk under
  ``"bidirectional"``), used by the reference backend.

Everything here is CPU int tensors; backends copy what they need to the device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import chain

import torch

from ardiff_modules.spec import PendingAttention


def page_token_slots(pages: torch.Tensor, page_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """int64 token slots ``page * page_size + offset`` of every token of ``pages`` (``[n]``, any integer
    dtype and device), flat: ``[n * page_size]``, written into ``out`` when given (fixed buffers)."""
    offsets = torch.arange(page_size, dtype=torch.int64, device=pages.device)
    slots = (pages.to(torch.int64)[:, None] * page_size + offsets).reshape(-1)
    return slots if out is None else out.copy_(slots)


@dataclass(frozen=True)
class StreamLayout:
    """One stream's pages for a forward.

    Attributes
    ----------
    history_pages:
        Visible committed pages (sink chunks then window chunks, oldest first).
    pending_pages:
        Pages of each pending chunk, in chunk order (``num_chunks`` tuples).
    token_offset:
        Absolute position of the stream's first pending token (for RoPE).
    history_spans:
        ``(first absolute position, tokens)`` of each visible committed chunk, in page order: a few
        ints per chunk, expanded to per-token positions only when :attr:`ForwardLayout.key_positions`
        is asked for (never on the hot path).
    pending_starts:
        Absolute position of the first token of each pending chunk when they are not consecutive
        from ``token_offset`` (a re-cache forward rebuilds history chunks at their original
        positions: sinks + the last W chunks are not one run); ``()``: consecutive.
    sink_pages:
        How many leading ``history_pages`` belong to sink chunks. Only set when the sinks are
        attended at relative positions (``KVCacheSpec.relative_sinks``); ``0`` otherwise.
    """

    history_pages: tuple[int, ...]
    pending_pages: tuple[tuple[int, ...], ...]
    token_offset: int
    history_spans: tuple[tuple[int, int], ...] = ()
    pending_starts: tuple[int, ...] = ()
    sink_pages: int = 0
    #: A content-selected stream: its exact :attr:`history_spans` (the chosen pages' positions are device data:
    #: read -- a sync -- only by :attr:`ForwardLayout.key_positions`); ``None``: :attr:`history_spans` are exact.
    exact_spans: Callable[[], Sequence[tuple[int, int]]] | None = field(default=None, compare=False)

    @property
    def first_pending_position(self) -> int:
        """Absolute position of the first pending token."""
        return self.pending_starts[0] if self.pending_starts else self.token_offset

    def split_history(self, page_size: int) -> tuple[int, int]:
        """``(sink spans, sink tokens)``: how many of :attr:`history_spans` and tokens the sink pages cover."""
        tokens, spans = self.sink_pages * page_size, 0
        covered = 0
        while covered < tokens:
            covered += self.history_spans[spans][1]
            spans += 1
        assert covered == tokens, "sink pages must cover whole chunks"
        return spans, tokens

    def sink_shift(self, page_size: int) -> int:
        """Tokens added to the sinks' positions: their last token then sits just before the first visible
        non-sink position (the oldest window chunk's, a content selection's ``start``, or the first pending
        token's when no window chunk is resident). ``0`` without sinks, and until the first eviction.

        The first *position*, not the first span in page order: a content selection follows the sink chunks, which
        early on may still hold a window frame after the selection's start (``SelectedFramesPolicy`` with a window
        wider than a chunk); everywhere else the spans after the sinks ascend, and the two agree."""
        if not self.sink_pages:
            return 0
        spans, _ = self.split_history(page_size)
        start, tokens = self.history_spans[spans - 1]
        after = min((first for first, _ in self.history_spans[spans:]), default=self.first_pending_position)
        return after - (start + tokens)


@dataclass(frozen=True)
class StructuralRows:
    """Attention requests in FlashInfer's paged-KV CSR format: one per (stream, pending chunk), or one
    per stream under ``pending_attention="bidirectional"`` (see :attr:`ForwardLayout.rows_per_stream`).

    Row ``r = stream * rows_per_stream + chunk`` has queries
    ``qo_indptr[r]:qo_indptr[r+1]`` (flat token order of the forward) and pages
    ``kv_page_indices[kv_page_indptr[r]:kv_page_indptr[r+1]]``; every page is
    full (``kv_last_page_len == page_size``) because pages never straddle chunks.
    """

    qo_indptr: torch.Tensor  # int32 [rows + 1]
    kv_page_indptr: torch.Tensor  # int32 [rows + 1]
    kv_page_indices: torch.Tensor  # int32 [nnz pages]
    kv_last_page_len: torch.Tensor  # int32 [rows]

    @property
    def num_rows(self) -> int:
        return self.kv_last_page_len.shape[0]


@dataclass(frozen=True)
class RaggedRows:
    """Rows whose visible keys are each one contiguous token range of the pool: unpaged (ragged) attention.

    Row ``r`` attends to flat token slots ``kv_start + kv_indptr[r] : kv_start + kv_indptr[r+1]``.
    Rows with no queries (``qo_indptr[r] == qo_indptr[r+1]``) only skip the gap between two
    streams' ranges, so one launch covers streams whose ranges are not adjacent.
    """

    qo_indptr: torch.Tensor  # int32 [rows + 1]
    kv_indptr: torch.Tensor  # int32 [rows + 1], relative to kv_start
    kv_start: int
    kv_end: int
    gap_rows: int


@dataclass(frozen=True)
class ForwardLayout:
    """Pages of every stream of one forward; all streams have the same pending chunks' lengths.

    ``chunk_size`` is the spec's (largest) chunk; the pending chunks of a forward may be shorter
    (e.g. a 1-latent-frame first chunk): their lengths come from their pages (:attr:`chunk_lengths`).
    ``pending_attention`` says how the pending chunks see each other: ``"block_causal"`` (chunk
    ``c`` sees pending chunks ``0..c``) or ``"bidirectional"`` (every pending chunk sees all of
    them); the history (sinks and window) is fully visible under both.
    """

    streams: tuple[StreamLayout, ...]
    chunk_size: int
    page_size: int
    pending_attention: PendingAttention = "block_causal"
    #: ``False``: rows see the history alone, never a pending key -- the sink segment of a forward whose
    #: sinks sit at relative positions (:meth:`sinks_only`), one row per stream.
    pending_visible: bool = True

    def __post_init__(self) -> None:
        shapes = {tuple(map(len, s.pending_pages)) for s in self.streams}
        assert len(shapes) == 1 and () not in shapes, f"streams must share pending chunk sizes, got {shapes}"
        assert all(len(s.pending_starts) in (0, len(s.pending_pages)) for s in self.streams)

    @property
    def num_streams(self) -> int:
        return len(self.streams)

    @property
    def num_chunks(self) -> int:
        return len(self.streams[0].pending_pages)

    @property
    def bidirectional(self) -> bool:
        """Whether every pending chunk sees every pending chunk of its stream."""
        return self.pending_attention == "bidirectional"

    @property
    def rows_per_stream(self) -> int:
        """Structural rows (attention requests) per stream: one per pending chunk, or one if bidirectional.

        NOTE: a one-chunk forward is one row either way: the two rules coincide there. A history-only
        layout (``pending_visible=False``) is one row per stream too: every query sees the same keys.
        """
        return 1 if self.bidirectional or not self.pending_visible else self.num_chunks

    @property
    def num_rows(self) -> int:
        """Structural rows of the forward: ``num_streams * rows_per_stream``."""
        return self.num_streams * self.rows_per_stream

    @cached_property
    def row_spans(self) -> tuple[tuple[int, int, int, int], ...]:
        """``(stream, first query, end query, visible keys)`` of each structural row, in row order.

        Queries index the stream's ``seq_len`` pending tokens; the row's keys are the first
        ``visible keys`` of the stream's :meth:`to_dense` order (history, then pending tokens), so a
        row's slice of the dense mask is ``to_dense()[stream, first:end, :visible]``.
        """
        starts = self.chunk_starts
        spans = []
        for s, stream in enumerate(self.streams):
            history = len(stream.history_pages) * self.page_size
            if not self.pending_visible:
                spans.append((s, 0, self.seq_len, history))
                continue
            if self.bidirectional:
                spans.append((s, 0, self.seq_len, history + self.seq_len))
                continue
            for c in range(self.num_chunks):
                spans.append((s, starts[c], starts[c + 1], history + starts[c + 1]))
        return tuple(spans)

    @cached_property
    def chunk_lengths(self) -> tuple[int, ...]:
        """Tokens of each pending chunk (the same for every stream)."""
        return tuple(len(chunk) * self.page_size for chunk in self.streams[0].pending_pages)

    @cached_property
    def chunk_starts(self) -> tuple[int, ...]:
        """Token offset of each pending chunk inside a stream's ``seq_len`` tokens, and ``seq_len`` last."""
        starts = [0]
        for length in self.chunk_lengths:
            starts.append(starts[-1] + length)
        return tuple(starts)

    @property
    def seq_len(self) -> int:
        """Pending tokens per stream."""
        return self.chunk_starts[-1]

    @cached_property
    def query_chunk(self) -> torch.Tensor:
        """int64 ``[seq_len]``: the pending chunk of each current token."""
        return torch.repeat_interleave(torch.arange(self.num_chunks), torch.tensor(self.chunk_lengths))

    # ------------------------------------------------------------------ writes
    @cached_property
    def write_pages(self) -> torch.Tensor:
        """int64 ``[num_streams * seq_len // page_size]``: the page of every ``page_size`` current tokens.

        Current tokens, flat stream-major and reshaped to ``[-1, page_size, H, D]``, are written
        page by page (``index_copy_`` along the page dim): pages never straddle chunks.
        """
        return torch.tensor([p for s in self.streams for chunk in s.pending_pages for p in chunk], dtype=torch.int64)

    @cached_property
    def write_slots(self) -> torch.Tensor:
        """int64 ``[num_streams * seq_len]``: token slot of every current token, flat stream-major."""
        return page_token_slots(self.write_pages, self.page_size)

    @cached_property
    def positions(self) -> torch.Tensor:
        """int64 ``[num_streams, seq_len]``: absolute token position of every current token."""
        starts = torch.tensor([s.token_offset for s in self.streams], dtype=torch.int64)
        positions = starts[:, None] + torch.arange(self.seq_len, dtype=torch.int64)
        for i, s in enumerate(self.streams):
            if s.pending_starts:  # NOTE: re-cache only: chunks at their own (non-consecutive) positions
                positions[i] = torch.cat([
                    start + torch.arange(length, dtype=torch.int64)
                    for start, length in zip(s.pending_starts, self.chunk_lengths)
                ])
        return positions

    # ------------------------------------------------------------------ structural rows
    @cached_property
    def structural_rows(self) -> StructuralRows:
        """The rows of :attr:`row_spans` as paged CSR: each row's pages are exactly its visible pages.

        Block-causal: row ``(stream, c)`` lists history + pending chunks ``0..c``; bidirectional:
        row ``stream`` lists history + every pending chunk (the keys are the same set for all of
        the stream's queries, so one request covers them).
        """
        indptr = [0]
        indices: list[int] = []
        qo = [0]
        for stream in self.streams:
            visible = list(stream.history_pages)
            if not self.pending_visible:  # the history alone, for all of the stream's queries
                indices.extend(visible)
                indptr.append(len(indices))
                qo.append(qo[-1] + self.seq_len)
                continue
            for chunk, length in zip(stream.pending_pages, self.chunk_lengths):
                visible.extend(chunk)  # chunk c sees pending chunks 0..c
                if not self.bidirectional:
                    indices.extend(visible)
                    indptr.append(len(indices))
                    qo.append(qo[-1] + length)
            if self.bidirectional:
                indices.extend(visible)
                indptr.append(len(indices))
                qo.append(qo[-1] + self.seq_len)
        return StructuralRows(
            qo_indptr=torch.tensor(qo, dtype=torch.int32),
            kv_page_indptr=torch.tensor(indptr, dtype=torch.int32),
            kv_page_indices=torch.tensor(indices, dtype=torch.int32),
            kv_last_page_len=torch.full((self.num_rows,), self.page_size, dtype=torch.int32),
        )

    @cached_property
    def ragged_rows(self) -> RaggedRows | None:
        """The forward as contiguous key ranges, or ``None`` when some row's pages are not one run.

        Needs one row per stream (:attr:`rows_per_stream`): one-chunk forwards, or bidirectional
        ones of any chunk count (block-causal rows of a multi-chunk forward overlap). Streams must
        appear in increasing page order with disjoint ranges.
        """
        if self.rows_per_stream != 1:
            return None
        page = self.page_size
        qo = [0]
        kv: list[int] = []
        gaps = 0
        for stream in self.streams:
            # NOTE: chain, not a generator: this runs every forward and a generator costs one Python call
            # per page (~80 of a Wan-shaped forward's ~900 host calls; tests/docs/test_benchmarks_smoke.py)
            pending = tuple(chain.from_iterable(stream.pending_pages)) if self.pending_visible else ()
            pages = sorted(stream.history_pages + pending)
            if not pages:  # a stream that sees no key (a sink segment without sinks): paged
                return None
            first, last = pages[0], pages[-1]
            if last - first + 1 != len(pages):
                return None
            start, end = first * page, (last + 1) * page
            if not kv:
                kv.append(start)
            elif start < kv[-1]:
                return None
            elif start > kv[-1]:  # skip the gap with a query-less row
                qo.append(qo[-1])
                kv.append(start)
                gaps += 1
            qo.append(qo[-1] + self.seq_len)
            kv.append(end)
        base = kv[0]
        return RaggedRows(
            qo_indptr=torch.tensor(qo, dtype=torch.int32),
            kv_indptr=torch.tensor([x - base for x in kv], dtype=torch.int32),
            kv_start=base,
            kv_end=kv[-1],
            gap_rows=gaps,
        )

    # ------------------------------------------------------------------ relative-position sinks
    @property
    def splits_sinks(self) -> bool:
        """Whether some stream attends resident sinks at relative positions: the forward then runs as two
        key segments (:meth:`sinks_only` with the sink query, :meth:`without_sinks` with the query),
        merged by their LSE."""
        return any(s.sink_pages for s in self.streams)

    @cached_property
    def sink_shifts(self) -> tuple[int, ...]:
        """Per stream, the tokens added to its sink keys' positions (:meth:`StreamLayout.sink_shift`)."""
        return tuple(s.sink_shift(self.page_size) for s in self.streams)

    @cached_property
    def sink_positions(self) -> torch.Tensor:
        """int64 ``[num_streams, seq_len]``: the positions at which the queries attend the sinks,
        ``positions - sink_shift``: RoPE scores depend on ``query - key`` positions only, so a query
        rotated there sees each sink key as if it sat ``sink_shift`` tokens later."""
        return self.positions - torch.tensor(self.sink_shifts, dtype=torch.int64)[:, None]

    def without_sinks(self) -> ForwardLayout:
        """This forward minus the sink keys (window + pending): the segment attended at natural positions."""
        streams = []
        for s in self.streams:
            spans, _ = s.split_history(self.page_size)
            streams.append(replace(
                s, history_pages=s.history_pages[s.sink_pages :], history_spans=s.history_spans[spans:], sink_pages=0,
                exact_spans=None,  # (derived: its key positions are not asked for)
            ))
        return replace(self, streams=tuple(streams))

    @property
    def sinkless_streams(self) -> tuple[int, ...]:
        """Streams with no resident sink (e.g. a new session batched with older ones)."""
        return tuple(i for i, s in enumerate(self.streams) if not s.sink_pages)

    def sinks_only(self) -> ForwardLayout:
        """The sink keys alone, one row per stream over all its queries (the segment attended with the
        sink query): a history-only layout (``pending_visible=False``); the pending pages stay for
        :attr:`write_pages` but are never attended.

        NOTE: a stream without sinks (:attr:`sinkless_streams`) gets its first pending page as a stand-in
        key page -- kernels are not asked for key-less rows -- and the merge discards that row's result.
        """
        streams = []
        for s in self.streams:
            if not s.sink_pages:
                stand_in = s.pending_pages[0][0]
                streams.append(replace(
                    s, history_pages=(stand_in,), history_spans=((s.first_pending_position, self.page_size),),
                ))
                continue
            spans, _ = s.split_history(self.page_size)
            streams.append(replace(
                s, history_pages=s.history_pages[: s.sink_pages], history_spans=s.history_spans[:spans], sink_pages=0
            ))
        return replace(self, streams=tuple(streams), pending_visible=False)

    def sink_columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 ``(sink, rest)`` indices into :meth:`to_dense`'s key columns, ``[num_streams, keys]`` each
        (padded with the last column): the columns of :meth:`sinks_only` and :meth:`without_sinks`
        in their own :meth:`to_dense` orders, to split a ``token_mask``."""
        max_keys = self.dense_keys[0].shape[1]
        sink_rows, rest_rows = [], []
        for s in self.streams:
            history = len(s.history_pages) * self.page_size
            sink_tokens = s.sink_pages * self.page_size
            pending = torch.arange(history, history + self.seq_len)
            # a sinkless stream's stand-in keys (see sinks_only) read any column: their result is discarded
            sinks = torch.arange(sink_tokens) if sink_tokens else torch.full((self.page_size,), history)
            sink_rows.append(torch.cat([sinks, pending]))
            rest_rows.append(torch.cat([torch.arange(sink_tokens, history), pending]))
        return _pad_rows(sink_rows, max_keys - 1), _pad_rows(rest_rows, max_keys - 1)

    # ------------------------------------------------------------------ dense oracle
    @cached_property
    def dense_keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gather_slots, mask)``: the reference backend's gathered keys and visibility mask.

        ``gather_slots`` is int64 ``[num_streams, max_keys]``: per stream, the token
        slots of its history pages then of its pending pages (padded with slot 0).
        ``mask`` is bool ``[num_streams, seq_len, max_keys]``: query ``i`` (pending
        chunk ``query_chunk[i]``) sees all history keys and pending chunks ``<=`` its own
        (block-causal), or every pending key (bidirectional); no pending key when
        ``pending_visible`` is false.
        """
        page_offsets = torch.arange(self.page_size, dtype=torch.int64)
        per_stream = []
        for s in self.streams:
            pages = torch.tensor(list(s.history_pages) + [p for c in s.pending_pages for p in c], dtype=torch.int64)
            per_stream.append((pages[:, None] * self.page_size + page_offsets).reshape(-1))
        max_keys = max(t.numel() for t in per_stream)
        gather = torch.zeros((self.num_streams, max_keys), dtype=torch.int64)
        mask = torch.zeros((self.num_streams, self.seq_len, max_keys), dtype=torch.bool)
        query_chunk = self.query_chunk
        for i, (s, slots) in enumerate(zip(self.streams, per_stream)):
            gather[i, : slots.numel()] = slots
            history = len(s.history_pages) * self.page_size
            mask[i, :, :history] = True
            if not self.pending_visible:
                continue
            if self.bidirectional:
                mask[i, :, history : history + self.seq_len] = True
            else:
                key_chunk = query_chunk
                mask[i, :, history : history + self.seq_len] = key_chunk[None, :] <= query_chunk[:, None]
        return gather, mask

    @cached_property
    def key_positions(self) -> torch.Tensor:
        """int64 ``[num_streams, max_keys]``: absolute position of every key in :meth:`to_dense` order
        (visible history, then pending tokens); ``-1`` for padding."""
        max_keys = self.dense_keys[0].shape[1]
        out = torch.full((self.num_streams, max_keys), -1, dtype=torch.int64)
        for i, s in enumerate(self.streams):
            exact = s.history_spans if s.exact_spans is None else s.exact_spans()
            spans = [start + torch.arange(tokens, dtype=torch.int64) for start, tokens in exact]
            history = torch.cat(spans) if spans else torch.empty(0, dtype=torch.int64)
            keys = torch.cat([history, self.positions[i]])
            out[i, : keys.numel()] = keys
        return out

    def to_dense(self) -> torch.Tensor:
        """The visibility rule as a bool mask ``[num_streams, seq_len, max_keys]`` over the gathered keys."""
        return self.dense_keys[1]


def _pad_rows(rows: list[torch.Tensor], fill: int) -> torch.Tensor:
    """Stack int64 rows of different lengths, padded with ``fill``."""
    out = torch.full((len(rows), max(r.numel() for r in rows)), fill, dtype=torch.int64)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r
    return out
