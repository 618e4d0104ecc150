"""token_mask with retention groups (issue 41): given over the union key order, each lane takes its columns.

The oracle is cache-free: per head, the keys its group keeps (then the pending chunk), each masked by the column
of its absolute position in the union of every group's history tokens.
"""

from __future__ import annotations

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.core.recache import RecacheRule
from ardiff_modules.errors import TensorMismatchError
from tests.heads.test_head_recache import CHUNK, KV_HEADS, LAYERS, TOL, Oracle, make, step


def union_chunks(oracle: Oracle) -> list[int]:
    n = len(oracle.latents)
    return sorted({i for policy in oracle.heads.groups.values() for i in policy.history_indices(n)})


def oracle_masked(oracle: Oracle, x: torch.Tensor, mask: torch.Tensor, prompt: int) -> torch.Tensor:
    """``[layers, CHUNK, heads, d]``: each head over its group's keys, masked by their union columns."""
    n = len(oracle.latents)
    union = union_chunks(oracle)
    col = {i: t * CHUNK for t, i in enumerate(union)}  # a chunk's first column
    pending = len(union) * CHUNK
    out = []
    for layer in range(LAYERS):
        q, k, v = oracle.model.qkv(x, layer, prompt)
        heads = []
        for h in range(KV_HEADS):
            visible = oracle.policy(layer, h).history_indices(n)
            keys = [oracle.kv(i, layer) for i in visible] + [(k, v)]
            cols = [c for i in visible for c in range(col[i], col[i] + CHUNK)] + list(range(pending, pending + CHUNK))
            kk = torch.cat([c[0][:, h] for c in keys])
            vv = torch.cat([c[1][:, h] for c in keys])
            m = mask[:, cols]
            heads.append(torch.nn.functional.scaled_dot_product_attention(
                q[None, None, :, h], kk[None, None], vv[None, None], attn_mask=m[None, None]
            )[0, 0])
        out.append(torch.stack(heads, 1))
    return torch.stack(out)


@pytest.mark.parametrize("chunks", [1, 3, 6])
def test_grouped_token_mask_matches_the_per_head_oracle(chunks: int) -> None:
    cache, state, oracle = make(RecacheRule())
    g = torch.Generator().manual_seed(5)
    for _ in range(chunks):
        step(state, oracle, g, prompt=0)
    keys = len(union_chunks(oracle)) * CHUNK + CHUNK
    mask = torch.rand(1, CHUNK, keys, generator=g) < 0.6
    mask[0, :, keys - CHUNK:] |= torch.eye(CHUNK, dtype=torch.bool)  # every query sees at least itself
    x = torch.randn(CHUNK, 6, generator=g)
    outs = []
    with state.prepare_forward(("cond",), CHUNK, False, token_mask=mask) as fwd:
        for layer, ctx in enumerate(fwd.layers):
            q, k, v = oracle.model.qkv(x[None], layer, 0)
            outs.append(am.chunk_attention(q, k, v, ctx)[0])
    torch.testing.assert_close(torch.stack(outs), oracle_masked(oracle, x, mask[0], 0), **TOL)


def test_grouped_token_mask_of_another_width_is_refused() -> None:
    cache, state, oracle = make(RecacheRule())
    g = torch.Generator().manual_seed(6)
    for _ in range(6):
        step(state, oracle, g, prompt=0)
    keys = len(union_chunks(oracle)) * CHUNK + CHUNK  # global keeps 0, 3, 4, 5; local 5: 4 chunks + pending
    lane0 = state._lane_pages("cond")[0]
    assert keys == 5 * CHUNK and len(lane0.history_pages()) * 2 + CHUNK < keys
    with pytest.raises(TensorMismatchError, match=rf"expected shape \(1, {CHUNK}, {keys}\)"):
        state.prepare_forward(("cond",), CHUNK, False, token_mask=torch.ones(1, CHUNK, keys - CHUNK, dtype=torch.bool))
