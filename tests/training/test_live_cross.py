"""Cross-attention K/V with gradients (issue 43, item 1.2): Self-Forcing's checkpointed blocks project the cross K/V
from the text every run, with gradients, so its cross-attention ``k`` / ``v`` / ``norm_k`` and its text embedding
train; the library's once-projected prompt cache is a constant. ``CachedCrossAttention`` given both the cache and
the context projects live exactly when something there can train, and ``WanCausalDiT.forward(text=...)`` embeds the
text live in forwards with gradients.
"""

from __future__ import annotations

import functools

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.models.wan_causal_dit import TEXT
from tests.support.training_peers import CacheFreeWan, LibraryWan
from tests.training.test_self_forcing_training import CASES, draw, library_pages, rollout, take_grads, trainable, worst_relative_error

pytestmark = pytest.mark.usefixtures("one_thread")

DIM, HEADS, TOKENS = 16, 2, 5


def published(layer: am.CachedCrossAttention, context: torch.Tensor) -> tuple[am.KVCache, am.LayerContext]:
    spec = am.KVCacheSpec(num_layers=1, num_kv_heads=HEADS, head_dim=DIM // HEADS, chunk_size=4, page_size=2,
                          branches=("a",), dtype="float32", cross_attention=(am.CrossAttentionSpec(TEXT, TOKENS),))
    cache = am.KVCache(spec, num_pages=8, backend="reference")
    state = cache.open_session()
    am.populate_cross_attention(state, "a", [layer], context)
    fwd = state.prepare_forward(("a",), 4, commit_current=False)
    return cache, fwd.layers[0]


def test_the_layer_projects_live_only_when_something_can_train() -> None:
    torch.manual_seed(0)
    layer = am.CachedCrossAttention(DIM, HEADS, TEXT, qk_norm="full")
    context, x = torch.randn(TOKENS, DIM), torch.randn(1, 4, DIM)
    _, kv = published(layer, context)
    with torch.no_grad():
        cached = layer(x, kv)
        assert torch.equal(layer(x, kv, context=context), cached)  # no grad mode: the cache, context unused
    live = layer(x, kv, context=context)
    direct = layer(x, context=context)
    torch.testing.assert_close(live, direct, atol=0, rtol=0)
    live.sum().backward()
    assert layer.to_k.weight.grad is not None and layer.norm_k.weight.grad is not None
    layer.requires_grad_(False)
    text = context.clone().requires_grad_()
    layer(x, kv, context=text).sum().backward()  # the context trains: live
    assert text.grad is not None and text.grad.norm() > 0
    assert torch.equal(layer(x, kv, context=context), cached)  # nothing can train: the cache


@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpointed"])
def test_live_text_trains_the_text_embedding_and_cross_kv_like_the_cache_free_peer(
    checkpoint: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = CASES["t2v_batch2_exit_per_chunk"]
    config = case.config()
    model = trainable(config)
    draws = draw(case, config, case.seed)
    peer = CacheFreeWan(model, case.streams, 1, case.window_chunks)
    peer.live_text = True
    loss, expected_out = rollout(peer, case, draws)
    loss.backward()
    expected = take_grads(model)
    assert any(n.startswith("text_embedding") for n in expected) and any(".cross.k." in n for n in expected)
    library = LibraryWan(model, case.streams, library_pages(case, config), live_text=True)
    with am.TrainingScope(library.cache) as scope:
        if checkpoint:
            for block in model.blocks:
                monkeypatch.setattr(block, "forward", functools.partial(scope.checkpoint, block.forward))
        loss, outputs = rollout(library, case, draws)
        loss.backward()
    for a, e in zip(outputs, expected_out, strict=True):
        torch.testing.assert_close(a.detach(), e.detach(), atol=1e-5, rtol=1e-5)
    worst, which = worst_relative_error(take_grads(model), expected)
    assert worst <= 1e-5, f"{worst:.2e} ({which})"


def test_without_live_text_the_prompt_cache_stays_a_constant() -> None:
    case = CASES["t2v_batch2_exit_per_chunk"]
    config = case.config()
    model = trainable(config)
    loss, _ = rollout(LibraryWan(model, case.streams, library_pages(case, config)), case, draw(case, config, case.seed))
    loss.backward()
    grads = take_grads(model)
    assert not any(n.startswith("text_embedding") for n in grads) and not any(".cross.k." in n for n in grads)
