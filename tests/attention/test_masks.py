"""Chunk-level visibility pictures agree with the token-level oracle mask."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.masks import chunk_visibility, chunk_visibility_name, render_chunk_mask
from tests.support.kv_writes import write_every_layer


def test_chunk_visibility_rule() -> None:
    mask = chunk_visibility(num_committed=6, num_pending=2, sink_chunks=1, window_chunks=3)
    expected = torch.tensor(
        [[1, 0, 0, 1, 1, 1, 1, 0], [1, 0, 0, 1, 1, 1, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(mask, expected)
    assert chunk_visibility(2, 1, 0, None).all()
    assert chunk_visibility_name(1, None) == "sink1_windowall"


@pytest.mark.parametrize("sink,window", [(1, 2), (0, 1), (2, None)])
def test_chunk_mask_matches_to_dense(sink: int, window: int | None) -> None:
    spec = am.KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, chunk_size=4, page_size=2, sink_chunks=sink,
                          window_chunks=window, dtype="float32")
    state = am.KVCache(spec, num_pages=64).open_session()
    for _ in range(5):
        committing = state.prepare_forward(None, 4, commit_current=True)
        write_every_layer(committing.layers)
        committing.commit()
    fwd = state.prepare_forward(None, 12)  # 3 pending chunks
    dense = fwd.to_dense()[0]  # [12, keys]: visible history keys then pending keys
    chunks = chunk_visibility(5, 3, sink, window)
    visible = chunks[:, :5].sum(dim=1)
    assert (visible == len(state.history_chunks("main"))).all()
    # Token level == chunk level expanded over the visible columns (history all visible, pending block-causal).
    compact = torch.cat([chunks[:, :5][:, chunks[0, :5]], chunks[:, 5:]], dim=1)
    assert torch.equal(dense, compact.repeat_interleave(4, 0).repeat_interleave(4, 1))


def test_render_chunk_mask(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = render_chunk_mask(tmp_path / "mask.png", 8, 2, 1, 3)
    assert path.stat().st_size > 1000


def test_op_with_a_released_plan_raises_plan_not_found() -> None:
    spec = am.KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, chunk_size=4, page_size=2, dtype="float32")
    cache = am.KVCache(spec, num_pages=8)
    state = cache.open_session()
    layer = state.get_kv_caches("main", 4)[0]
    x = torch.randn(1, 4, 1, 4)
    am.chunk_attention(x, x, x, layer)
    state.close()  # unregisters the session's plans
    with pytest.raises(am.errors.PlanNotFoundError, match="No attention plan is registered under handle"):
        am.chunk_attention(x, x, x, layer)
