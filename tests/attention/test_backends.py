"""Backend selection, the masked path on the reference backend, and layout options (CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ardiff_modules as am
from ardiff_modules.backends import resolve_backend
from ardiff_modules.backends.flashinfer import FlashInferBackend
from ardiff_modules.pool import KVPool


def _backend_spec(window: int | None = 2) -> am.KVCacheSpec:
    return am.KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=8, chunk_size=4, page_size=2, sink_chunks=1,
                          window_chunks=window, branches=("cond", "uncond"), dtype="float32")


def test_auto_is_reference_on_cpu_and_flashinfer_is_refused_with_the_reason() -> None:
    assert am.KVCache(_backend_spec(), num_pages=8).backend.name == "reference"
    with pytest.raises(am.BackendUnavailableError, match="expected a CUDA device, got cpu"):
        am.KVCache(_backend_spec(), num_pages=8, backend="flashinfer")
    with pytest.raises(am.BackendUnavailableError, match="expected a CUDA device, got cpu"):
        FlashInferBackend().check_supported(torch.device("cpu"), torch.bfloat16, 128)
    with pytest.raises(am.BackendUnavailableError, match=r"expected one of \('auto', 'reference', 'flashinfer'\), got 'fa9'"):
        resolve_backend("fa9", torch.device("cpu"), torch.float32, 8)
    with pytest.raises(am.BackendUnavailableError, match="paged_backend"):
        FlashInferBackend("fa1")


def test_static_forwards_need_flashinfer_and_a_bounded_window() -> None:
    cache = am.KVCache(_backend_spec(), num_pages=16)
    state = cache.open_session()
    free = cache._allocator.free_pages()
    with pytest.raises(am.BackendUnavailableError, match="static plans"):
        state.prepare_forward(None, 4, static=True)
    assert cache._allocator.free_pages() == free and state.pending_chunks("cond") == ()
    unbounded = am.KVCache(_backend_spec(None), num_pages=16).open_session()
    with pytest.raises(am.SpecError, match="bounded window"):
        unbounded.prepare_forward(None, 4, static=True)
    with pytest.raises(am.SpecError, match="bounded window"):
        am.KVCache(_backend_spec(None), num_pages=16, contiguous_extents=True)


def test_extents_default_off_on_reference_and_usable_when_asked() -> None:
    assert am.KVCache(_backend_spec(), num_pages=16).extent_chunks is None
    cache = am.KVCache(_backend_spec(), num_pages=16, contiguous_extents=True)
    assert cache.extent_chunks == 1 + 2 + 1
    state = cache.open_session()
    state.prepare_forward(None, 4).commit()
    assert state.branch_pages("cond").extent == tuple(range(8)) and state.branch_pages("uncond").extent == tuple(range(8, 16))
    fwd = state.prepare_forward(None, 4)
    rows = fwd._layout.ragged_rows
    assert rows is not None and rows.gap_rows == 1  # cond [0, 8) tokens, gap, uncond [16, 24)
    fwd.abort()


@pytest.mark.parametrize("history", [0, 2])
def test_token_mask_on_the_reference_backend(history: int) -> None:
    cache = am.KVCache(_backend_spec(), num_pages=32)
    state = cache.open_session()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 2, 8, generator=g)
    for _ in range(history):
        with state.prepare_forward(None, 4, commit_current=True) as fwd:
            am.chunk_attention(q[:, :4], q[:, :4], q[:, :4], fwd.layers[0])
    keys = min(history, 1 + 2) * 4 + 8
    plain = state.prepare_forward(None, 8)
    expected_plain = am.chunk_attention(q, q, q, plain.layers[0])
    dense = plain.to_dense()
    assert dense.shape == (2, 8, keys)
    state.abort()
    all_true = state.prepare_forward(None, 8, token_mask=torch.ones(2, 8, keys, dtype=torch.bool))
    torch.testing.assert_close(am.chunk_attention(q, q, q, all_true.layers[0]), expected_plain)
    state.abort()
    mask = torch.rand(2, 8, keys, generator=g) > 0.4
    mask[..., keys - 8 : keys - 4] = True  # every query keeps its own chunk: no empty row
    masked = state.prepare_forward(None, 8, token_mask=mask)
    out = am.chunk_attention(q, q, q, masked.layers[0])
    # Oracle: gather the same keys and apply visibility & mask with plain SDPA.
    k_slots = KVPool.token_slots(masked.layers[0].k_cache)
    gather = masked._layout.dense_keys[0]
    keys_t = k_slots[gather].transpose(1, 2)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), keys_t, keys_t, attn_mask=(dense & mask)[:, None])
    torch.testing.assert_close(out, ref.transpose(1, 2))
    state.abort()
    with pytest.raises(am.TensorMismatchError, match=rf"expected shape \(2, 8, {keys}\)"):
        state.prepare_forward(None, 8, token_mask=torch.ones(2, 8, keys + 1, dtype=torch.bool))
    with pytest.raises(am.TensorMismatchError, match="torch.bool"):
        state.prepare_forward(None, 8, token_mask=torch.ones(2, 8, keys))
