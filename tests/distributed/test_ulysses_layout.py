"""The Ulysses layout copies move 8-byte words where they can: bit-identical to plain copies, with fallbacks."""

from __future__ import annotations

import pytest
import torch

from ardiff_modules.distributed.ulysses import _cat, _dense, _words


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8])
def test_dense_equals_contiguous_bitwise(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(2, 6, 4, 3, 16, generator=g) * 100).to(dtype)
    for dims in [(2, 0, 1, 3, 4), (1, 2, 0, 3, 4), (1, 0, 2, 3, 4)]:
        view = t.permute(*dims)
        out = _dense(view)
        assert out.is_contiguous() and out.dtype == dtype and out.shape == view.shape
        assert torch.equal(out.view(torch.uint8), view.contiguous().view(torch.uint8))  # the same bytes
        assert _words(view) is not None  # the word path ran (16 elements of 1-4 bytes: whole words)


def test_words_refuses_views_it_cannot_make() -> None:
    t = torch.zeros(4, 6, dtype=torch.bfloat16)
    assert _words(t[:, 1:]) is None  # last dim 5: not a multiple of 4 elements
    assert _words(t[:, 2:]) is None  # storage offset 2 elements: not word aligned
    assert _words(t.t()) is None  # last dim not contiguous
    assert _words(torch.zeros(3, dtype=torch.float64)) is None  # already 8 bytes
    odd = torch.zeros(4, 6, dtype=torch.bfloat16)[:, :4]  # row stride 6: not a multiple of 4
    assert _words(odd) is None
    assert torch.equal(_dense(odd), odd.contiguous())  # the plain copy then


def test_cat_equals_torch_cat_bitwise() -> None:
    g = torch.Generator().manual_seed(1)
    parts = [torch.randn(2, 3, 5, h, 8, generator=g).to(torch.bfloat16).permute(2, 0, 1, 3, 4) for h in (4, 2, 2)]
    out = _cat(parts, dim=3)
    assert torch.equal(out, torch.cat(parts, dim=3)) and out.dtype == torch.bfloat16
    mixed = [*parts[:2], parts[2][..., :7]]  # one input without a word view: plain cat
    with pytest.raises(RuntimeError):
        _cat(mixed, dim=3)  # shapes differ in the last dim: torch.cat's own error
    last = _cat([parts[0], parts[0]], dim=-1)  # along the last dim: plain cat
    assert torch.equal(last, torch.cat([parts[0], parts[0]], dim=-1))


def test_words_checks_every_stride_and_cat_keeps_dtypes_apart() -> None:
    storage = torch.arange(400, dtype=torch.float32).to(torch.bfloat16)
    odd = storage.as_strided((2, 1, 3, 8), (24, 5, 64, 1))  # a size-1 dim with a stride of 5: no word view
    assert _words(odd) is None
    assert torch.equal(_dense(odd), odd.contiguous())
    a, b = torch.randn(2, 3, 8).to(torch.bfloat16), torch.randn(2, 3, 8).to(torch.float16)
    assert torch.equal(_cat([a, b], dim=1), torch.cat([a, b], dim=1))  # promoted values, not mixed bits
