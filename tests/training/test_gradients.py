"""Gradients through the cache (issue 27): the oracle is the cache-free model with autograd on.

``NaiveStreaming`` with ``grad=True`` computes every forward from plain lists of committed K/V (stored
detached: history is a constant) and the live K/V of the forward's own tokens; the library must give
the same outputs and the same gradients -- to the inputs and to every parameter -- over rollouts that
mix forwards with and without gradients, commit with and without gradients, fill and slide the
window, batch one or both branches, switch the prompt and reset, with the backward run only at the
end (when the pages the early forwards read hold other chunks' K/V since).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ardiff_modules as am
from tests.support.streaming_model import (
    LibraryStreaming,
    NaiveStreaming,
    TinyStreamingModel,
    play_event,
    rollout_events,
)

CHUNK = 4


def _grad_events(events: list[tuple], every: int, seed: int) -> list[bool]:
    """Which forward events run with gradients: about one in ``every``, committing ones included."""
    g = torch.Generator().manual_seed(seed)
    return [e[0] == "forward" and int(torch.randint(every, (1,), generator=g)) == 0 for e in events]


def play_with_grad(runner, events: list[tuple], with_grad: list[bool], seed: int = 7):  # noqa: ANN001
    """Play ``events``; the marked forwards run with gradients and add ``<out, w>`` to the loss.

    Returns ``(outputs, input grads, loss)`` after one backward at the very end.
    """
    g = torch.Generator().manual_seed(seed)
    outputs, inputs, loss = [], [], torch.zeros(())
    for event, grad in zip(events, with_grad):
        if not grad:
            out = play_event(runner, event)
            if out is not None:
                outputs.append(out)
            continue
        _, rows, x, commit, lengths, *rule = event
        x = x.clone().requires_grad_()
        out = runner.forward(rows, x, commit, lengths, *rule)
        loss = loss + (out.float() * torch.randn(out.shape, generator=g).to(out.device)).sum()
        outputs.append(out.detach())
        inputs.append(x)
    loss.backward()
    return outputs, [x.grad for x in inputs], loss.detach()


def _param_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _assert_same(actual, expected, atol: float = 2e-5) -> None:  # noqa: ANN001
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        torch.testing.assert_close(a, e, atol=atol, rtol=1e-5, msg=lambda m, i=i: f"item {i}: {m}")


def _rel(a: torch.Tensor, e: torch.Tensor) -> float:
    return float((a - e).norm() / e.norm().clamp_min(1e-12))


CONFIGS = [
    # name, sink, window, page, kv_heads, pending_attention, relative_sinks
    ("sink1_window2", 1, 2, 2, 4, None, False),
    ("nosink_window1_page1", 0, 1, 1, 2, None, False),
    ("sink2_window3_gqa", 2, 3, 2, 1, None, False),
    ("global", 1, None, 4, 4, None, False),
    ("bidirectional", 1, 2, 2, 4, "alternate", False),
    ("relative_sinks", 1, 2, 2, 4, None, True),
]


@pytest.mark.parametrize("name,sink,window,page,kv_heads,rule,relative", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_rollout_gradients_equal_the_cache_free_oracle(
    name: str, sink: int, window: int | None, page: int, kv_heads: int, rule: str | None, relative: bool
) -> None:
    torch.manual_seed(0)
    model = TinyStreamingModel(kv_heads=kv_heads)
    spec = model.spec(CHUNK, page, sink, window, relative_sinks=relative)
    events = rollout_events(10, CHUNK, model.dim, model.context_dim, pending_attention=rule)
    with_grad = _grad_events(events, 3, seed=1)
    assert sum(with_grad) >= 6
    library = LibraryStreaming(model, spec, 2 * 40 * spec.pages_per_chunk)
    out_lib, dx_lib, loss_lib = play_with_grad(library, events, with_grad)
    grads_lib = _param_grads(model)
    oracle = NaiveStreaming(model, CHUNK, sink, window, relative_sinks=relative)
    oracle.grad = True
    out_ref, dx_ref, loss_ref = play_with_grad(oracle, events, with_grad)
    grads_ref = _param_grads(model)
    _assert_same(out_lib, out_ref)
    _assert_same(dx_lib, dx_ref)
    assert grads_lib.keys() == grads_ref.keys() and any("attn.to_q" in n for n in grads_lib)
    worst = max(_rel(grads_lib[n], grads_ref[n]) for n in grads_ref)
    assert worst <= 1e-5, f"worst parameter-gradient relative error {worst:.2e}"
    torch.testing.assert_close(loss_lib, loss_ref, atol=1e-4, rtol=1e-5)


def test_history_is_a_constant_and_the_pending_kv_are_live() -> None:
    """The gradient of a committed chunk's K/V is zero (it is history), the pending chunk's is not:
    a forward at the first chunk (no history) and one after it get different k/v gradients for the same
    inputs, and the library's equal the oracle's in both."""
    torch.manual_seed(0)
    model = TinyStreamingModel()
    spec = model.spec(CHUNK, 2, 1, 2)
    cache = am.KVCache(spec, num_pages=64, backend="reference")
    state = cache.open_session()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, CHUNK, 4, 8, generator=g) for _ in range(3))
    with torch.no_grad(), state.prepare_forward(("cond",), CHUNK, commit_current=True) as fwd:
        for layer in fwd.layers:
            am.chunk_attention(q, k, v, layer)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    with state.prepare_forward(("cond",), CHUNK, commit_current=False) as fwd:
        out = am.chunk_attention(qg, kg, vg, fwd.layers[0])
    weight = torch.randn(out.shape, generator=g)
    (out * weight).sum().backward()
    # oracle: history = the committed (q, k, v) chunk's K/V as constants
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    keys, values = torch.cat([k, kr], 1), torch.cat([v, vr], 1)
    ref = torch.nn.functional.scaled_dot_product_attention(
        qr.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
    ).transpose(1, 2)
    (ref * weight).sum().backward()
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    for a, e in ((qg, qr), (kg, kr), (vg, vr)):
        torch.testing.assert_close(a.grad, e.grad, atol=1e-6, rtol=1e-6)
    assert kg.grad.abs().sum() > 0


def test_the_pool_copy_is_written_detached_and_equals_a_forward_without_gradients() -> None:
    """The pending pages a forward with gradients writes hold exactly what a forward without gradients
    writes (bit for bit), and committing it makes the same history."""
    torch.manual_seed(0)
    model = TinyStreamingModel()
    spec = model.spec(CHUNK, 2, 1, 2)
    pools = []
    for grad in (False, True):
        library = LibraryStreaming(model, spec, 64)
        with torch.no_grad():
            library.set_prompt({b: torch.ones(5, model.context_dim) for b in ("cond", "uncond")})
        g = torch.Generator().manual_seed(3)
        for step in range(5):
            x = torch.randn(2, CHUNK, model.dim, generator=g)
            with torch.set_grad_enabled(grad):
                out = library.forward(("cond", "uncond"), x.requires_grad_(grad), True)
            assert out.requires_grad == grad
        assert not library.cache._pool.kv.requires_grad
        pools.append(library.cache._pool.kv.clone())
    assert torch.equal(pools[0], pools[1])


def test_fp8_history_gradients_follow_the_stored_values() -> None:
    """FP8 pools: history is read dequantized, the live K/V carry the pool's rounding straight through --
    outputs equal the forward without gradients, gradients equal the oracle with FP8-rounded K/V."""
    torch.manual_seed(0)
    model = TinyStreamingModel()
    spec = dataclasses.replace(model.spec(CHUNK, 2, 1, 2), kv_dtype="float8_e4m3fn")
    scales = torch.rand(spec.num_layers, 2, spec.num_kv_heads, generator=torch.Generator().manual_seed(3)) * 0.02 + 0.01
    events = rollout_events(8, CHUNK, model.dim, model.context_dim, fixed_shape=True)
    with_grad = _grad_events(events, 2, seed=2)
    library = LibraryStreaming(model, spec, 80)
    library.cache.set_kv_scales(scales)
    out_lib, dx_lib, _ = play_with_grad(library, events, with_grad)
    grads_lib = _param_grads(model)

    class Rounded(NaiveStreaming):
        def store(self, layer: int, k: torch.Tensor, v: torch.Tensor):  # noqa: ANN202
            return tuple(
                t + (_fp8(t.detach(), scales[layer, i]) - t.detach()) for i, t in enumerate((k, v))
            )

    oracle = Rounded(model, CHUNK, 1, 2)
    oracle.grad = True
    out_ref, dx_ref, _ = play_with_grad(oracle, events, with_grad)
    grads_ref = _param_grads(model)
    _assert_same(out_lib, out_ref, atol=5e-5)
    _assert_same(dx_lib, dx_ref, atol=5e-5)
    assert max(_rel(grads_lib[n], grads_ref[n]) for n in grads_ref) <= 1e-4


def _fp8(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    from ardiff_modules.quant import dequantize, quantize

    return dequantize(quantize(t, scale, torch.float8_e4m3fn), scale, t.dtype)


def test_forwards_without_gradients_never_take_the_gradient_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """``no_grad`` forwards (and grad mode on with nothing requiring grad) run the custom op as before."""
    import ardiff_modules.modules.functional as functional

    def boom(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the gradient path ran")

    monkeypatch.setattr(functional, "attend_with_grad", boom)
    torch.manual_seed(0)
    model = TinyStreamingModel().requires_grad_(False)
    library = LibraryStreaming(model, model.spec(CHUNK, 2, 1, 2), 64)
    library.set_prompt({b: torch.ones(5, model.context_dim) for b in ("cond", "uncond")})
    for _ in range(3):
        library.forward(("cond", "uncond"), torch.randn(2, CHUNK, model.dim), True)
    with torch.no_grad():
        model.requires_grad_(True)
        library.forward(("cond", "uncond"), torch.randn(2, CHUNK, model.dim), True)
