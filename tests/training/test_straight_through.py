"""``TrainingScope(cache, history_grad="straight_through")`` at the layer level (issue 43, item 1).

The oracle writes each chunk's K/V into a plain per-layer buffer ``[streams, tokens, kv_heads, head_dim]`` the way
Self-Forcing's rolling buffer is written: in place, *with* gradients in the exit step, overwritten under ``no_grad``
by the clean forward, so autograd's ``CopySlices`` routes every later read of a chunk to its last write with
gradients; attention gathers the visible slots (sinks + window + the chunk itself). Two stacked GQA layers, two
streams, sink 1 + window 2 over 6 chunks (the window slides), an exit step per chunk at a random denoising step, the
clean forward committing: every parameter's gradient equals the oracle's, with and without ``scope.checkpoint``,
and across a reset inside the scope (the first video's writes never reach the second's chunks).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ardiff_modules as am
from ardiff_modules.errors import SpecError, TrainingScopeError

pytestmark = pytest.mark.usefixtures("one_thread")

DIM, HEADS, KV_HEADS, CHUNK, SINK, WINDOW, CHUNKS, STEPS = 32, 4, 2, 4, 1, 2, 6, 3
BRANCHES = ("a", "b")


def make_layers(seed: int = 0) -> torch.nn.ModuleList:
    torch.manual_seed(seed)
    return torch.nn.ModuleList(
        am.ChunkSelfAttention(DIM, HEADS, num_kv_heads=KV_HEADS, qk_norm="full") for _ in range(2)
    )


def make_cache() -> am.KVCache:
    spec = am.KVCacheSpec(num_layers=2, num_kv_heads=KV_HEADS, head_dim=DIM // HEADS, chunk_size=CHUNK, page_size=2,
                          sink_chunks=SINK, window_chunks=WINDOW, branches=BRANCHES, dtype="float32")
    return am.KVCache(spec, num_pages=2 * 2 * (CHUNKS + 2) * 2, backend="reference")


def draws(seed: int = 1) -> tuple[list[list[torch.Tensor]], list[int], list[torch.Tensor]]:
    """Per chunk: the inputs of each step (the last is the clean forward's), the exit step, the loss weights."""
    g = torch.Generator().manual_seed(seed)
    inputs = [[torch.randn(2, CHUNK, DIM, generator=g) for _ in range(STEPS + 1)] for _ in range(CHUNKS)]
    exits = torch.randint(STEPS, (CHUNKS,), generator=g).tolist()
    return inputs, exits, [torch.randn(2, CHUNK, DIM, generator=g) for _ in range(CHUNKS)]


# ------------------------------------------------------------------ the oracle: CopySlices over a plain buffer
def visible(c: int) -> list[int]:
    """Committed chunks chunk ``c`` reads: the sinks and the last ``WINDOW`` after them."""
    rest = list(range(SINK, c))
    return list(range(min(SINK, c))) + rest[max(0, len(rest) - WINDOW):]


def oracle_layer(layer: am.ChunkSelfAttention, buffer: dict[str, torch.Tensor], x: torch.Tensor, c: int,
                 detach: bool = False) -> torch.Tensor:
    """One layer's call for chunk ``c``; ``detach``: the history read as a constant (the chunk's own K/V live)."""
    q, k, v = layer.project(x)
    own = slice(c * CHUNK, (c + 1) * CHUNK)
    buffer["k"][:, own] = k  # with gradients in the exit step: the CopySlices upstream's writes leave
    buffer["v"][:, own] = v
    history = torch.tensor([t for d in visible(c) for t in range(d * CHUNK, (d + 1) * CHUNK)], dtype=torch.long)
    keys = torch.cat([buffer["k"][:, history], buffer["k"][:, own]], dim=1)
    values = torch.cat([buffer["v"][:, history], buffer["v"][:, own]], dim=1)
    if detach:
        keys = torch.cat([keys[:, : len(history)].detach(), k], dim=1)
        values = torch.cat([values[:, : len(history)].detach(), v], dim=1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), enable_gqa=True)
    return layer.to_out(out.transpose(1, 2).flatten(2))


def oracle_video(layers: torch.nn.ModuleList, inputs, exits, weights, grad_from: int = 0,  # noqa: ANN001
                 detach: bool = False) -> torch.Tensor:
    buffers = [{n: torch.zeros(2, CHUNKS * CHUNK, KV_HEADS, DIM // HEADS) for n in "kv"} for _ in layers]
    loss = torch.zeros(())

    def run(x: torch.Tensor, c: int) -> torch.Tensor:
        for layer, buffer in zip(layers, buffers):
            x = oracle_layer(layer, buffer, x, c, detach)
        return x

    for c in range(CHUNKS):
        for step in range(exits[c] + 1):
            with torch.set_grad_enabled(step == exits[c] and c >= grad_from):
                out = run(inputs[c][step], c)
        loss = loss + (out * weights[c]).sum()
        with torch.no_grad():
            run(inputs[c][-1], c)
    return loss


# ------------------------------------------------------------------ the library
def library_video(layers, cache, state, inputs, exits, weights, scope, checkpoint: bool, grad_from: int = 0):  # noqa: ANN001, ANN201
    loss = torch.zeros(())

    def run(x: torch.Tensor, commit: bool, grad: bool) -> torch.Tensor:
        fwd = state.prepare_forward(BRANCHES, CHUNK, commit_current=commit)
        for i, layer in enumerate(layers):
            x = scope.checkpoint(layer, x, fwd.layers[i]) if checkpoint and grad else layer(x, fwd.layers[i])
        if commit:
            fwd.commit()
        return x

    for c in range(CHUNKS):
        for step in range(exits[c] + 1):
            grad = step == exits[c] and c >= grad_from
            with torch.set_grad_enabled(grad):
                out = run(inputs[c][step], False, grad)
        loss = loss + (out * weights[c]).sum()
        with torch.no_grad():
            run(inputs[c][-1], True, False)
    return loss


def grads(layers: torch.nn.ModuleList) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in layers.named_parameters() if p.grad is not None}
    layers.zero_grad(set_to_none=True)
    return out


def worst(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    assert actual.keys() == expected.keys()
    return max(float((actual[n] - e).norm() / e.norm().clamp_min(1e-30)) for n, e in expected.items())


@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpointed"])
def test_straight_through_equals_copyslices_over_a_buffer(checkpoint: bool) -> None:
    layers = make_layers()
    inputs, exits, weights = draws()
    assert len(set(exits)) > 1
    oracle_video(layers, inputs, exits, weights).backward()
    expected = grads(layers)
    cache = make_cache()
    state = cache.open_session()
    with am.TrainingScope(cache, history_grad="straight_through") as scope:
        library_video(layers, cache, state, inputs, exits, weights, scope, checkpoint).backward()
        assert scope.ledger is not None and len(scope.ledger) == 2 * 2 * CHUNKS  # streams x layers x chunks
    assert worst(grads(layers), expected) <= 1e-5
    assert scope.ledger is not None and len(scope.ledger) == 0  # released with the scope


def test_detached_is_the_default_and_unchanged() -> None:
    """The default scope reads history as a constant: equal to the oracle with its buffer reads detached."""
    layers = make_layers()
    inputs, exits, weights = draws()
    cache = make_cache()
    state = cache.open_session()
    with am.TrainingScope(cache) as scope:
        assert scope.history_grad == "detached" and scope.ledger is None
        library_video(layers, cache, state, inputs, exits, weights, scope, checkpoint=False).backward()
    detached = grads(layers)
    oracle_video(layers, inputs, exits, weights).backward()
    assert worst(detached, grads(layers)) > 1e-3  # the straight-through path is not there
    oracle_video(layers, inputs, exits, weights, detach=True).backward()
    assert worst(detached, grads(layers)) <= 1e-5


def test_a_reset_inside_the_scope_starts_a_new_generation() -> None:
    """Two videos in one scope: the second one's chunk 0 (clean, never written with gradients in its video) routes
    nothing to the first video's chunk 0 written live at the same position."""
    layers = make_layers()
    first, second = draws(1), draws(2)
    loss = oracle_video(layers, *first) + oracle_video(layers, *second, grad_from=1)
    loss.backward()
    expected = grads(layers)
    cache = make_cache()
    state = cache.open_session()
    with am.TrainingScope(cache, history_grad="straight_through") as scope:
        loss = library_video(layers, cache, state, *first, scope, checkpoint=True)
        state.reset()
        loss = loss + library_video(layers, cache, state, *second, scope, checkpoint=True, grad_from=1)
        loss.backward()
    assert worst(grads(layers), expected) <= 1e-5


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(SpecError, match=r"history_grad: expected one of \('detached', 'straight_through'\), got 'live'"):
        am.TrainingScope(make_cache(), history_grad="live")  # type: ignore[arg-type]


def test_a_compiled_forward_under_a_straight_through_scope_is_refused() -> None:
    layers = make_layers()
    cache = make_cache()
    state = cache.open_session()
    compiled = torch.compile(layers[0], backend="eager", fullgraph=True)
    with am.TrainingScope(cache, history_grad="straight_through"):
        fwd = state.prepare_forward(BRANCHES, CHUNK, commit_current=False)
        with pytest.raises(TrainingScopeError, match="expected a TrainingScope with history_grad='detached'"):
            compiled(torch.randn(2, CHUNK, DIM), fwd.layers[0])
    cache.close()
