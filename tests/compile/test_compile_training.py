"""A training step through the cache under ``torch.compile(fullgraph=True)`` (issue 27, item 3).

Self-Forcing's step: denoising forwards without gradients, one exit forward with gradients, the clean
commit without. Compiled with inductor, forward and backward, the gradients equal eager ones over a
rollout that fills and slides the window, and the whole rollout is one frame (no recompiles): the
gradient path's history is padded to the spec's bound inside one opaque op.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import ardiff_modules as am
from tests.support.streaming_model import LibraryStreaming, TinyStreamingModel
from tests.support.training_peers import poisoned_before_backward

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_dynamo")]

CHUNK = 4


def _rollout(library: LibraryStreaming, model: TinyStreamingModel, chunks: int, seed: int = 0):  # noqa: ANN202
    """Per chunk: a no-grad denoising forward, the exit forward with gradients, a no-grad clean commit;
    one backward at the end. Returns the exit outputs and the parameter gradients."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        library.set_prompt({b: torch.randn(5, model.context_dim, generator=g) for b in ("cond", "uncond")})
    loss, outs = torch.zeros(()), []
    for _ in range(chunks):
        x = torch.randn(2, CHUNK, model.dim, generator=g)
        with torch.no_grad():
            library.forward(("cond", "uncond"), x, False)
        out = library.forward(("cond", "uncond"), x.clone().requires_grad_(), False)
        loss = loss + (out * torch.randn(out.shape, generator=g)).sum()
        outs.append(out.detach())
        with torch.no_grad():
            library.forward(("cond", "uncond"), x, True)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return outs, grads


@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
def test_compiled_training_rollout_equals_eager_in_one_frame(kv_dtype: str | None) -> None:
    torch.manual_seed(0)
    model = TinyStreamingModel()
    spec = model.spec(CHUNK, 2, 1, 2)
    if kv_dtype is not None:
        spec = dataclasses.replace(spec, kv_dtype=kv_dtype)
    scales = torch.full((spec.num_layers, 2, spec.num_kv_heads), 0.02)
    runs = []
    counter = CompileCounterWithBackend("inductor")
    for fn in (None, torch.compile(model, backend=counter, fullgraph=True)):
        library = LibraryStreaming(model, spec, 96, fn=fn)
        if kv_dtype is not None:
            library.cache.set_kv_scales(scales)
        runs.append(_rollout(library, model, chunks=7))
    (eager_out, eager_grads), (compiled_out, compiled_grads) = runs
    for a, e in zip(compiled_out, eager_out, strict=True):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)
    assert eager_grads.keys() == compiled_grads.keys()
    for name, e in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], e, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    # no-grad forwards and the grad forward are two graphs (grad mode is part of the guard); nothing more
    assert counter.frame_count == 2, f"expected 2 frames (inference and training), got {counter.frame_count}"


def test_compiled_training_refuses_global_attention() -> None:
    torch.manual_seed(0)
    model = TinyStreamingModel()
    library = LibraryStreaming(model, model.spec(CHUNK, 2, 1, None), 64, fn=torch.compile(model, fullgraph=True))
    with torch.no_grad():
        library.set_prompt({b: torch.ones(5, model.context_dim) for b in ("cond", "uncond")})
    with pytest.raises(Exception, match="bounded history"):
        library.forward(("cond", "uncond"), torch.randn(2, CHUNK, model.dim, requires_grad=True), False)
    assert am.KVCache  # the cache is still usable eagerly


def test_compiled_blocks_under_scope_checkpoint_equal_eager() -> None:
    """Blocks compiled (fullgraph) and checkpointed from outside through ``scope.checkpoint``: the recomputation
    runs the compiled block again and reads the history its first run read (the free pages poisoned first)."""
    torch.manual_seed(0)
    model = TinyStreamingModel()
    spec = model.spec(CHUNK, 2, 1, 2)
    # One backend for every block: the blocks share their code (parameters are graph inputs), so the 2nd and
    # 3rd block reuse the 1st one's compiled graphs (2 frames -- no-grad and grad -- instead of 6).
    counter = CompileCounterWithBackend("inductor")
    compiled_blocks = [torch.compile(block, backend=counter, fullgraph=True) for block in model.blocks]
    runs = []
    for blocks in (list(model.blocks), compiled_blocks):
        library = LibraryStreaming(model, spec, 96)
        with am.TrainingScope(library.cache) as scope:

            def run(x, layers, blocks=blocks):  # noqa: ANN001, ANN202
                for block, kv in zip(blocks, layers):
                    x = scope.checkpoint(block, x, kv, model.rope)
                return x

            library.fn = run
            with poisoned_before_backward(library.cache) as poisoned:
                runs.append(_rollout(library, model, chunks=6))
            assert poisoned and all(count > 0 for count in poisoned)
    (_, eager), (_, compiled) = runs
    assert counter.frame_count == 2, f"expected the blocks to share 2 frames, got {counter.frame_count}"
    for name, e in eager.items():
        torch.testing.assert_close(compiled[name], e, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
