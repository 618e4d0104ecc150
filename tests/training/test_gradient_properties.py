"""Random rollouts of forwards with and without gradients against the cache-free oracle with autograd
(issue 27, item 4).

Hypothesis draws the sink and the window (small), the page size, GQA, and a rollout: forwards of one or
both branches over 1-3 chunks, committing or not, each with or without gradients (the input requiring
grad), with prompt switches and resets between them; the last forward always has gradients. Optionally
every block runs under ``TrainingScope.checkpoint`` (recomputed in backward; every free page is
overwritten with NaN first). One backward at the end of the rollout: the outputs, the inputs' gradients
and every parameter's gradient must equal ``NaiveStreaming(grad=True)``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

import ardiff_modules as am
from tests.support.streaming_model import LibraryStreaming, NaiveStreaming, TinyStreamingModel
from tests.training.test_gradients import play_with_grad
from tests.support.training_peers import poisoned_before_backward

pytestmark = pytest.mark.usefixtures("one_thread")

CHUNK, MAX_CHUNKS, MAX_STEPS = 4, 3, 12
ROWS = (("cond", "uncond"), ("cond",), ("uncond",))

#: A step ``(kind, rows, chunks, commit, grad)``; a "reset" or "prompt" ignores the rest. Mostly forwards,
#: mostly committing (so that windows slide before the forwards with gradients).
steps = st.lists(
    st.tuples(st.sampled_from(("forward",) * 6 + ("reset", "prompt")), st.sampled_from(ROWS),
              st.integers(1, MAX_CHUNKS), st.sampled_from((True, True, False)), st.booleans()),
    min_size=4, max_size=MAX_STEPS,
)


def events_of(drawn: Sequence[tuple], model: TinyStreamingModel, seed: int) -> tuple[list[tuple], list[bool]]:
    """The rollout of ``drawn`` steps as ``play_with_grad`` events (a prompt first, a forward with gradients
    last) and, per event, whether it runs with gradients."""
    g = torch.Generator().manual_seed(seed)

    def prompt() -> tuple:
        return ("prompt", {b: torch.randn(5, model.context_dim, generator=g) for b in ("cond", "uncond")})

    events, with_grad = [prompt()], [False]
    for step in [*drawn, ("forward", ("cond", "uncond"), 1, False, True)]:
        if step[0] == "forward":
            _, rows, chunks, commit, grad = step
            x = torch.randn(len(rows), chunks * CHUNK, model.dim, generator=g)
            events.append(("forward", rows, x, commit, (CHUNK,) * chunks))
        else:
            events.append(prompt() if step[0] == "prompt" else ("reset",))
            grad = False
        with_grad.append(grad)
    return events, with_grad


def slid_before_a_gradient_forward(events: list[tuple], with_grad: list[bool], sink: int, window: int | None) -> bool:
    """Whether some forward with gradients ran after its branch's window had slid (for the statistics)."""
    committed = {"cond": 0, "uncond": 0}
    for e, grad in zip(events, with_grad):
        if e[0] == "reset":
            committed = dict.fromkeys(committed, 0)
        elif e[0] == "forward":
            rows, commit, lengths = e[1], e[3], e[4]
            if grad and window is not None and any(committed[b] > sink + window for b in rows):
                return True
            for b in rows:
                committed[b] += len(lengths) if commit else 0
    return False


def checkpointed(model: TinyStreamingModel, scope: am.TrainingScope) -> Callable:
    def run(x: torch.Tensor, layers: Sequence) -> torch.Tensor:
        for block, kv in zip(model.blocks, layers):
            x = scope.checkpoint(block, x, kv, model.rope)
        return x

    return run


def param_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def run_library(model: TinyStreamingModel, spec: am.KVCacheSpec, events: list[tuple], with_grad: list[bool],
                checkpoint: bool) -> tuple:
    """``play_with_grad`` through the library (every block checkpointed in a TrainingScope, or not)."""
    chunks = sum(len(e[4]) for e in events if e[0] == "forward")
    library = LibraryStreaming(model, spec, 2 * (chunks + MAX_CHUNKS) * spec.pages_per_chunk)
    if not checkpoint:
        return play_with_grad(library, events, with_grad)
    with am.TrainingScope(library.cache) as scope, poisoned_before_backward(library.cache):
        library.fn = checkpointed(model, scope)
        return play_with_grad(library, events, with_grad)


@settings(max_examples=max(1, settings.default.max_examples // 2))
@given(
    sink=st.integers(0, 2), window=st.sampled_from([1, 2, None]), page=st.sampled_from([1, 2, 4]),
    kv_heads=st.sampled_from([4, 2]), checkpoint=st.booleans(), drawn=steps, seed=st.integers(0, 2**16),
)
def test_random_rollouts_match_the_oracle_with_autograd(
    sink: int, window: int | None, page: int, kv_heads: int, checkpoint: bool, drawn: list[tuple], seed: int
) -> None:
    torch.manual_seed(seed)
    model = TinyStreamingModel(kv_heads=kv_heads, layers=2)
    events, with_grad = events_of(drawn, model, seed)
    slid = slid_before_a_gradient_forward(events, with_grad, sink, window)
    event(f"window slid before a forward with gradients: {slid}")
    event(f"checkpointed: {checkpoint}")
    out_lib, dx_lib, loss_lib = run_library(model, model.spec(CHUNK, page, sink, window), events, with_grad, checkpoint)
    grads_lib = param_grads(model)
    oracle = NaiveStreaming(model, CHUNK, sink, window)
    oracle.grad = True
    out_ref, dx_ref, loss_ref = play_with_grad(oracle, events, with_grad)
    grads_ref = param_grads(model)
    for name, actual, expected in (("output", out_lib, out_ref), ("input gradient", dx_lib, dx_ref)):
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            torch.testing.assert_close(a, e, atol=2e-5, rtol=1e-5, msg=lambda m, i=i, name=name: f"{name} {i}: {m}")
    torch.testing.assert_close(loss_lib, loss_ref, atol=1e-4, rtol=1e-5)
    assert grads_lib.keys() == grads_ref.keys() and any(".attn.to_k." in n for n in grads_lib)
    for n, e in grads_ref.items():
        error = float((grads_lib[n] - e).norm() / e.norm().clamp_min(1e-12))
        assert error <= 1e-5, f"parameter {n}: gradient relative error {error:.2e}"
