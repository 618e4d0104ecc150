"""Self-Forcing / Wan prompts through the cross-attention cache (docs/guide/porting.md, "4. Prompts").

What upstream does (Self-Forcing ``utils/wan_wrapper.py`` ``WanTextEncoder``, ``wan/modules/causal_model.py``,
``wan/modules/model.py``; re-stated here, not copied): the tokenizer pads every prompt to ``text_len`` =
512 ids, the encoder wrapper zeroes the states after the prompt's own tokens, the DiT pads the states to
``text_len`` again and runs its ``text_embedding`` MLP over all of them, and ``WanT2VCrossAttention``
attends to every one of the ``text_len`` tokens (``context_lens=None``): the padding takes part, and after
the MLP and the projections its keys are not zero. The per-block cross cache it keeps is
``[batch, 512, heads, head_dim]``, one per CFG branch (``crossattn_cache_pos`` / ``_neg``).

So the cache is published with the padded ``text_len`` tokens and ``CrossAttentionSpec(tokens=text_len)``;
publishing the trimmed prompt gives other numbers, and a cache of another length than the spec's is refused.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ardiff_modules import (
    CachedCrossAttention,
    CrossAttentionSpec,
    KVCache,
    KVCacheSpec,
    TensorMismatchError,
    populate_cross_attention,
)
from tests.integrations.test_convert import WanT2VCrossAttention, randomize

TEXT_LEN, TEXT_DIM, DIM, HEADS = 512, 32, 48, 4
CHUNK = 6
#: float32, SDPA against upstream's attention over 512 keys: summation order differs by CPU (measured 1.4e-5 on one
#: 2-core machine); the trimmed prompt below is 1e-2 away, so 1e-4 still tells them apart by 100x.
ATOL = 1e-4


def encoder_states(prompt_tokens: int, seed: int) -> torch.Tensor:
    """What Self-Forcing's text encoder wrapper returns for one prompt: ``[text_len, text_dim]``, the states of
    the prompt's ``prompt_tokens`` tokens, then zeros (it sets ``u[seq_len:] = 0`` over the padded ids)."""
    states = torch.randn(TEXT_LEN, TEXT_DIM, generator=torch.Generator().manual_seed(seed))
    states[prompt_tokens:] = 0.0
    return states


def upstream_context(states: torch.Tensor, text_embedding: nn.Module) -> torch.Tensor:
    """The DiT's context: pad the encoder states with zeros to ``text_len``, then ``text_embedding``."""
    padded = torch.cat([states, states.new_zeros(TEXT_LEN - states.shape[0], states.shape[1])])
    return text_embedding(padded)  # [text_len, dim]


def spec_for(tokens: int) -> KVCacheSpec:
    return KVCacheSpec(
        num_layers=1, num_kv_heads=HEADS, head_dim=DIM // HEADS, chunk_size=CHUNK, page_size=CHUNK,
        sink_chunks=1, window_chunks=1, branches=("cond", "uncond"),
        cross_attention=(CrossAttentionSpec("text", tokens),), dtype="float32",
    )


@pytest.fixture
def wan() -> tuple[WanT2VCrossAttention, nn.Module, CachedCrossAttention]:
    torch.manual_seed(0)
    upstream = randomize(WanT2VCrossAttention(DIM, HEADS), seed=1)
    text_embedding = randomize(nn.Sequential(nn.Linear(TEXT_DIM, DIM), nn.GELU(approximate="tanh"),
                                             nn.Linear(DIM, DIM)), seed=2)
    return upstream, text_embedding, CachedCrossAttention.from_wan(upstream).eval()


def attend(layer: CachedCrossAttention, spec: KVCacheSpec, contexts: dict[str, torch.Tensor],
           x: torch.Tensor) -> torch.Tensor:
    """One denoising forward of both branches through the layer's cache, after publishing ``contexts``."""
    cache = KVCache(spec, num_pages=8, backend="reference")
    state = cache.open_session()
    for branch, context in contexts.items():
        populate_cross_attention(state, branch, [layer], context)
    with torch.no_grad(), state.prepare_forward(("cond", "uncond"), CHUNK, commit_current=False) as fwd:
        return layer(x, fwd.layers[0])


def test_padded_publish_equals_upstream_cross_attention(wan) -> None:  # noqa: ANN001
    upstream, text_embedding, layer = wan
    # cond: a 7-token prompt; uncond: a 20-token negative prompt. Both padded to text_len, as upstream.
    states = {"cond": encoder_states(7, seed=3), "uncond": encoder_states(20, seed=4)}
    x = torch.randn(2, CHUNK, DIM, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        contexts = {b: upstream_context(s, text_embedding) for b, s in states.items()}
        expected = [upstream(x[i : i + 1], contexts[b][None])[0] for i, b in enumerate(("cond", "uncond"))]
    out = attend(layer, spec_for(TEXT_LEN), contexts, x)
    for i, e in enumerate(expected):
        torch.testing.assert_close(out[i], e, atol=ATOL, rtol=ATOL)
    # The padding matters: publishing only the prompt's own 7 tokens (a 7-token cache) gives other numbers.
    with torch.no_grad():
        trimmed = text_embedding(states["cond"][:7])
    short = attend(layer, spec_for(7), {"cond": trimmed, "uncond": trimmed}, x)
    assert (short[0] - expected[0]).abs().max() > 1e-2


@pytest.mark.parametrize("tokens", [TEXT_LEN - 1, TEXT_LEN + 1, 7])
def test_a_cache_of_another_length_than_the_spec_is_refused(wan, tokens: int) -> None:  # noqa: ANN001
    upstream, text_embedding, layer = wan
    cache = KVCache(spec_for(TEXT_LEN), num_pages=8, backend="reference")
    state = cache.open_session()
    with torch.no_grad():
        padded = upstream_context(encoder_states(7, seed=3), text_embedding)
    populate_cross_attention(state, "cond", [layer], padded)
    before = state.get_cross_attention_kv("cond", "text")[0]["k"].clone()
    wrong = torch.randn(tokens, DIM)
    message = (rf"populate_cross_attention\('text'\) layer 0 k: expected shape \({TEXT_LEN}, {HEADS}, 12\) .*"
               rf"got \({tokens}, {HEADS}, 12\): {tokens} tokens where CrossAttentionSpec\('text'\)\.tokens is "
               rf"{TEXT_LEN} \(publish exactly the tokens the model attends to")
    with pytest.raises(TensorMismatchError, match=message):
        populate_cross_attention(state, "cond", [layer], wrong)
    assert torch.equal(state.get_cross_attention_kv("cond", "text")[0]["k"], before)  # the old cache stays
