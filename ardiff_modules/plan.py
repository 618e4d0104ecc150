"""Host-side description of one forward and the CPU index tensors kernels need.

A :class:`ForwardLayout` lists, for each stream (a branch of a session) of a
forward, its visible committed pages and its pending chunks' pages. From it,
once per forward and shared by every layer, we derive:

* ``write_slots``: where each current token's K/V goes (flat token slots);
* structural rows: one attention request per (stream, pending chunk) whose
  page list is exactly its visible pages (history + pending chunks ``0..c``)
  -- FlashInfer's ``qo_indptr / kv_indptr / kv_indices / last_page_len``;
* the dense oracle: per stream, the gathered key slots and the boolean mask of
  the visibility rule (DESIGN.md section 1), used by the reference backend.

Everything here is CPU int tensors; backends copy what they need to the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


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
    """

    history_pages: tuple[int, ...]
    pending_pages: tuple[tuple[int, ...], ...]
    token_offset: int


@dataclass(frozen=True)
class StructuralRows:
    """One attention request per (stream, pending chunk), FlashInfer's paged-KV CSR format.

    Row ``r = stream * num_chunks + chunk`` has queries
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
class ForwardLayout:
    """Pages of every stream of one forward; all streams have ``num_chunks`` pending chunks."""

    streams: tuple[StreamLayout, ...]
    chunk_size: int
    page_size: int

    def __post_init__(self) -> None:
        counts = {len(s.pending_pages) for s in self.streams}
        assert len(counts) == 1 and 0 not in counts, f"streams must share a pending chunk count, got {counts}"

    @property
    def num_streams(self) -> int:
        return len(self.streams)

    @property
    def num_chunks(self) -> int:
        return len(self.streams[0].pending_pages)

    @property
    def seq_len(self) -> int:
        """Pending tokens per stream."""
        return self.num_chunks * self.chunk_size

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
        pages = torch.tensor(
            [p for s in self.streams for chunk in s.pending_pages for p in chunk], dtype=torch.int64
        )
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    @cached_property
    def positions(self) -> torch.Tensor:
        """int64 ``[num_streams, seq_len]``: absolute token position of every current token."""
        starts = torch.tensor([s.token_offset for s in self.streams], dtype=torch.int64)
        return starts[:, None] + torch.arange(self.seq_len, dtype=torch.int64)

    # ------------------------------------------------------------------ structural rows
    @cached_property
    def structural_rows(self) -> StructuralRows:
        indptr = [0]
        indices: list[int] = []
        for stream in self.streams:
            visible = list(stream.history_pages)
            for chunk in stream.pending_pages:
                visible.extend(chunk)  # chunk c sees pending chunks 0..c
                indices.extend(visible)
                indptr.append(len(indices))
        rows = self.num_streams * self.num_chunks
        return StructuralRows(
            qo_indptr=torch.arange(rows + 1, dtype=torch.int32) * self.chunk_size,
            kv_page_indptr=torch.tensor(indptr, dtype=torch.int32),
            kv_page_indices=torch.tensor(indices, dtype=torch.int32),
            kv_last_page_len=torch.full((rows,), self.page_size, dtype=torch.int32),
        )

    # ------------------------------------------------------------------ dense oracle
    @cached_property
    def dense_keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gather_slots, mask)``: the reference backend's gathered keys and visibility mask.

        ``gather_slots`` is int64 ``[num_streams, max_keys]``: per stream, the token
        slots of its history pages then of its pending pages (padded with slot 0).
        ``mask`` is bool ``[num_streams, seq_len, max_keys]``: query ``i`` (pending
        chunk ``i // chunk_size``) sees all history keys and pending chunks ``<=`` its own.
        """
        page_offsets = torch.arange(self.page_size, dtype=torch.int64)
        per_stream = []
        for s in self.streams:
            pages = torch.tensor(list(s.history_pages) + [p for c in s.pending_pages for p in c], dtype=torch.int64)
            per_stream.append((pages[:, None] * self.page_size + page_offsets).reshape(-1))
        max_keys = max(t.numel() for t in per_stream)
        gather = torch.zeros((self.num_streams, max_keys), dtype=torch.int64)
        mask = torch.zeros((self.num_streams, self.seq_len, max_keys), dtype=torch.bool)
        query_chunk = torch.arange(self.seq_len) // self.chunk_size
        for i, (s, slots) in enumerate(zip(self.streams, per_stream)):
            gather[i, : slots.numel()] = slots
            history = len(s.history_pages) * self.page_size
            mask[i, :, :history] = True
            key_chunk = torch.arange(self.seq_len) // self.chunk_size
            mask[i, :, history : history + self.seq_len] = key_chunk[None, :] <= query_chunk[:, None]
        return gather, mask

    def to_dense(self) -> torch.Tensor:
        """The visibility rule as a bool mask ``[num_streams, seq_len, max_keys]`` over the gathered keys."""
        return self.dense_keys[1]
