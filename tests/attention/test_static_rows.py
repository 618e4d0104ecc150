"""Fixed ragged rows of static (CUDA-graph) forwards: two rows per stream, absolute key offsets (CPU)."""

from __future__ import annotations

import torch

from ardiff_modules.backends.flashinfer import absolute_ragged_rows
from ardiff_modules.layout import ForwardLayout, StreamLayout


def _static_layout(*streams: tuple[tuple[int, ...], tuple[int, ...]], page: int = 4) -> ForwardLayout:
    return ForwardLayout(
        streams=tuple(StreamLayout(history_pages=h, pending_pages=(p,), token_offset=0) for h, p in streams),
        chunk_size=2 * page,
        page_size=page,
    )


def test_two_rows_per_stream_with_absolute_offsets() -> None:
    # stream 0: pages 3..6 (history 3, 4; pending 5, 6); stream 1 right after: 7..8; stream 2 after a gap: 11..12
    layout = _static_layout(((3, 4), (5, 6)), ((), (7, 8)), ((), (11, 12)))
    rows = absolute_ragged_rows(layout.ragged_rows, 3)
    assert rows.qo_indptr.tolist() == [0, 0, 8, 8, 16, 16, 24]
    assert rows.kv_indptr.tolist() == [0, 12, 28, 28, 36, 44, 52]
    assert rows.kv_start == 0 and rows.gap_rows == 3
    # Each stream's row covers exactly its visible slots.
    kv = rows.kv_indptr.tolist()
    for s, stream in enumerate(layout.streams):
        pages = sorted(stream.history_pages + stream.pending_pages[0])
        assert (kv[2 * s + 1], kv[2 * s + 2]) == (pages[0] * 4, (pages[-1] + 1) * 4)


def test_row_count_is_fixed_whatever_the_gaps() -> None:
    adjacent = absolute_ragged_rows(_static_layout(((0,), (1, 2)), ((), (3, 4))).ragged_rows, 2)
    apart = absolute_ragged_rows(_static_layout(((5,), (6, 7)), ((), (9, 10))).ragged_rows, 2)
    assert adjacent.qo_indptr.numel() == apart.qo_indptr.numel() == 5
    assert adjacent.kv_indptr.dtype == apart.kv_indptr.dtype == torch.int32


def test_page_token_slots_from_device_page_ids_equal_the_layouts() -> None:
    """The plans derive write slots from the int32 page ids they already hold; the same slots as the layout's."""
    from ardiff_modules.layout import page_token_slots

    layout = _static_layout(((3, 4), (5, 6)), ((), (9, 10)))
    expected = layout.write_slots
    assert expected.tolist() == [20, 21, 22, 23, 24, 25, 26, 27, 36, 37, 38, 39, 40, 41, 42, 43]
    got = page_token_slots(layout.write_pages.to(torch.int32), layout.page_size)
    assert got.dtype == torch.int64 and torch.equal(got, expected)
    out = torch.full_like(expected, -1)
    assert page_token_slots(layout.write_pages.to(torch.int32), layout.page_size, out=out) is out
    assert torch.equal(out, expected)
