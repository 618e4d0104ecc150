"""Public read-outs of a forward (issue 12 item 7): ``to_dense()`` includes the ``token_mask``,
``key_positions()`` gives each visible key's absolute position (evicted tokens counted)."""

from __future__ import annotations

import torch

import ardiff_modules as am
from tests.support.kv_writes import write_every_layer

SPEC = am.KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, chunk_size=4, page_size=2, sink_chunks=1,
                      window_chunks=2, dtype="float32")


def test_key_positions_follow_sinks_window_and_mixed_chunk_lengths() -> None:
    cache = am.KVCache(SPEC, num_pages=32)
    state = cache.open_session()
    starts = []
    for seq in (2, 4, 4, 2, 4):  # a short first chunk, then evictions
        starts.append(state.token_offset("main"))
        with state.prepare_forward(None, seq, commit_current=True) as committing:
            write_every_layer(committing.layers)
    with state.prepare_forward(None, 4) as fwd:
        positions = fwd.key_positions()[0].tolist()
        offset = state.token_offset("main")
    # sink = chunk 0 (2 tokens at 0..1); window = the last two committed chunks (starts 10 and 12: 2 + 4 tokens)
    assert starts == [0, 2, 6, 10, 12]
    assert positions == [0, 1, 10, 11, 12, 13, 14, 15] + [offset + i for i in range(4)]
    assert fwd.to_dense().shape == (1, 4, len(positions))


def test_to_dense_ands_the_token_mask_and_pads_with_minus_one() -> None:
    spec = am.KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, chunk_size=4, page_size=2, sink_chunks=1,
                          window_chunks=2, branches=("cond", "uncond"), dtype="float32")
    cache = am.KVCache(spec, num_pages=32)
    state = cache.open_session()
    with state.prepare_forward(("cond",), 4, commit_current=True) as committing:
        write_every_layer(committing.layers)
    mask = torch.ones(2, 4, 8, dtype=torch.bool)
    mask[:, 1, 0] = False
    with state.prepare_forward(None, 4, token_mask=mask) as fwd:
        dense = fwd.to_dense()
        assert not dense[0, 1, 0] and dense[0, 0, 0]
        assert torch.equal(dense, fwd._layout.to_dense() & mask)
        assert fwd.key_positions()[1].tolist() == [0, 1, 2, 3, -1, -1, -1, -1]
