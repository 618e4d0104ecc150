"""A RoPE shape error at a forward's positions names the forward (issue 40, item 4).

RoPE sees ``kv.positions`` ``[streams, seq_len]`` of the forward the user prepared; when the model's tokens
differ, the error used to blame the positions ("positions: expected (2, 12), got (2, 8)"). It now says what
the forward was prepared with -- ``seq_len`` and its streams -- and what the tokens were.
"""

from __future__ import annotations

import pytest
import torch

import ardiff_modules as am
from tests.support.small_cache import BOTH, CHUNK, DIM, HEADS, make_small_cache


def _forward(seq_len: int = 2 * CHUNK) -> am.ForwardContext:
    cache = make_small_cache()
    return cache.open_session("s0").prepare_forward(BOTH, seq_len, commit_current=False)


@pytest.mark.parametrize("rope", [am.VideoRotaryEmbedding(2 * DIM, 2, 2), am.RotaryEmbedding(2 * DIM)])
def test_tokens_not_of_the_forward_name_its_seq_len_and_streams(rope: am.RotaryEmbedding) -> None:
    fwd = _forward()
    t = torch.randn(2, 3 * CHUNK, HEADS, 2 * DIM)
    with pytest.raises(am.TensorMismatchError) as caught:
        rope(t, fwd.layers[0].positions)
    message = str(caught.value)
    assert message.startswith(f"{type(rope).__name__}: expected t of shape (2, 8, heads, 8)")
    assert "prepared with seq_len=8 over 2 stream(s) [s0/cond, s0/uncond]" in message
    assert "got t of shape (2, 12, 2, 8) (2 stream(s) x 12 tokens)" in message
    with pytest.raises(am.TensorMismatchError, match=r"over 2 stream\(s\) .* got t of shape \(1, 8, 2, 8\)"):
        rope(t[:1, : 2 * CHUNK], fwd.positions)  # too few streams


def test_the_layer_names_the_forward_too() -> None:
    """``ChunkSelfAttention`` rotates at ``kv.positions``: x of another length is named against the forward."""
    fwd = _forward()
    layer = am.ChunkSelfAttention(HEADS * DIM, HEADS)
    x = torch.randn(2, 3 * CHUNK, HEADS * DIM)
    with pytest.raises(am.TensorMismatchError, match=r"prepared with seq_len=8 over 2 stream\(s\)"):
        layer(x, fwd.layers[0], am.RotaryEmbedding(DIM))


def test_positions_of_no_forward_keep_the_plain_message() -> None:
    _forward()  # a live forward whose positions these are not
    with pytest.raises(am.TensorMismatchError, match=r"positions: expected shape \(2, 12\) .* got \(2, 8\)"):
        am.RotaryEmbedding(8)(torch.randn(2, 12, 2, 8), torch.zeros(2, 8, dtype=torch.int64))
