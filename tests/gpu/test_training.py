"""Training through the cache on the H200 (issue 27): gradients with FlashInfer pools equal the reference
backend's (bf16 and FP8; the no-grad forwards on FA3, the gradient forwards on torch SDPA's flash backward
over the gathered history), checkpointed recomputation reads the held pages after every free page was
overwritten, and a compiled training rollout equals eager in two frames."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import ardiff_modules as am
from tests.support.gpu import GPU, gpu_model_and_spec, rel_error
from tests.support.streaming_model import LibraryStreaming, rollout_events
from tests.support.training_peers import poisoned_before_backward
from tests.training.test_gradients import _grad_events, play_with_grad

pytestmark = list(GPU)

CHUNK = 256


def _library(model, spec, backend: str, extents: bool = True, fn=None) -> LibraryStreaming:  # noqa: ANN001
    runner = LibraryStreaming.__new__(LibraryStreaming)
    runner.model, runner.fn = model, (fn if fn is not None else model)
    runner.cache = am.KVCache(spec, num_pages=2 * 14 * spec.pages_per_chunk, device="cuda", backend=backend,
                              contiguous_extents=extents if backend == "flashinfer" else None)
    runner.state = runner.cache.open_session("s0")
    return runner


def _events(model, fixed: bool = True):  # noqa: ANN001, ANN202
    g = torch.Generator().manual_seed(0)
    events = rollout_events(8, CHUNK, model.dim, model.context_dim, fixed_shape=fixed)
    # on the GPU in bf16
    out = []
    for e in events:
        if e[0] == "forward":
            out.append((e[0], e[1], e[2].cuda().to(torch.bfloat16), *e[3:]))
        elif e[0] == "prompt":  # the spec's 16-token prompt
            out.append((e[0], {b: torch.randn(16, model.context_dim, generator=g).cuda().to(torch.bfloat16)
                               for b in e[1]}))
        else:
            out.append(e)
    return out


def _grads(model) -> dict[str, torch.Tensor]:  # noqa: ANN001
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
@pytest.mark.parametrize("extents", [True, False], ids=["extents", "paged"])
def test_flashinfer_training_rollout_equals_reference(kv_dtype: str | None, extents: bool) -> None:
    model, spec = gpu_model_and_spec(kv_dtype=kv_dtype)
    model.requires_grad_(True)
    events = _events(model)
    with_grad = _grad_events(events, 3, seed=1)
    runs = []
    for backend in ("reference", "flashinfer"):
        library = _library(model, spec, backend, extents)
        if kv_dtype is not None:
            library.cache.set_kv_scales(torch.full((spec.num_layers, 2, spec.num_kv_heads), 0.05, device="cuda"))
        outs, dxs, _ = play_with_grad(library, events, with_grad)
        runs.append((outs, dxs, _grads(model), library.cache._pool.kv.clone()))
    (ro, rdx, rg, rpool), (fo, fdx, fg, fpool) = runs
    assert max(rel_error(a, b) for a, b in zip(fo, ro)) < 2e-2
    assert max(rel_error(a, b) for a, b in zip(fdx, rdx)) < 3e-2
    worst = max(rel_error(fg[n], rg[n]) for n in rg)
    assert worst < 3e-2, f"parameter gradients differ by {worst:.2e}"
    assert sum(with_grad) >= 5


def test_checkpointed_training_reads_the_held_pages_on_cuda() -> None:
    model, spec = gpu_model_and_spec()
    model.requires_grad_(True)
    events = _events(model)
    with_grad = _grad_events(events, 3, seed=2)
    plain = _library(model, spec, "flashinfer")
    play_with_grad(plain, events, with_grad)
    expected = _grads(model)
    library = _library(model, spec, "flashinfer")
    with am.TrainingScope(library.cache) as scope:

        def run(x, layers):  # noqa: ANN001, ANN202
            for block, kv in zip(model.blocks, layers):
                x = scope.checkpoint(block, x, kv, model.rope)
            return x

        library.fn = run
        with poisoned_before_backward(library.cache) as poisoned:
            play_with_grad(library, events, with_grad)
        assert poisoned and all(count > 0 for count in poisoned)
    actual = _grads(model)
    worst = max(rel_error(actual[n], expected[n]) for n in expected)
    assert worst < 1e-2, f"checkpointed gradients differ by {worst:.2e}"


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_training_rollout_on_cuda_equals_eager_in_two_frames() -> None:
    model, spec = gpu_model_and_spec()
    model.requires_grad_(True)
    spec = dataclasses.replace(spec)
    events = _events(model)
    with_grad = _grad_events(events, 3, seed=3)
    counter = CompileCounterWithBackend("inductor")
    runs = []
    for fn in (None, torch.compile(model, backend=counter, fullgraph=True)):
        library = _library(model, spec, "flashinfer", fn=fn)
        outs, _, _ = play_with_grad(library, events, with_grad)
        runs.append((outs, _grads(model)))
    (eo, eg), (co, cg) = runs
    assert max(rel_error(a, b) for a, b in zip(co, eo)) < 3e-2
    assert max(rel_error(cg[n], eg[n]) for n in eg) < 5e-2
    assert counter.frame_count == 2, f"expected 2 frames (inference, training), got {counter.frame_count}"
