"""Activation checkpointing through the cache (issue 27, item 2).

The backward of a rollout recomputes each checkpointed block long after its forward: the forward has
committed, its history was evicted and -- in a real pool -- reused by later chunks. The tests make that
reuse certain: before the backward every free page of the pool is overwritten with NaN. Inside a
``TrainingScope`` the pages the forwards with gradients read are held, so the recomputed gradients equal
the non-checkpointed ones (and the oracle's); leaving the scope frees them; the misuses raise.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import ardiff_modules as am
from tests.support.streaming_model import LibraryStreaming, NaiveStreaming, TinyStreamingModel, rollout_events
from tests.support.training_peers import poison_free_pages, poisoned_before_backward
from tests.training.test_gradients import CHUNK, _grad_events, _param_grads, _rel, play_with_grad


def _checkpointed(model: TinyStreamingModel, scope: am.TrainingScope):  # noqa: ANN202
    def run(x: torch.Tensor, layers) -> torch.Tensor:  # noqa: ANN001
        for block, kv in zip(model.blocks, layers):
            x = scope.checkpoint(block, x, kv, model.rope)
        return x

    return run


def _rollout(model: TinyStreamingModel, sink: int = 1, window: int = 2):  # noqa: ANN202
    spec = model.spec(CHUNK, 2, sink, window)
    events = rollout_events(12, CHUNK, model.dim, model.context_dim, fixed_shape=True)
    return spec, events, _grad_events(events, 3, seed=4)


def test_checkpointed_rollout_recomputes_from_the_held_pages() -> None:
    torch.manual_seed(0)
    model = TinyStreamingModel()
    spec, events, with_grad = _rollout(model)
    oracle = NaiveStreaming(model, CHUNK, 1, 2)
    oracle.grad = True
    _, dx_ref, _ = play_with_grad(oracle, events, with_grad)
    grads_ref = _param_grads(model)

    library = LibraryStreaming(model, spec, 96)
    used_before = None
    with am.TrainingScope(library.cache) as scope:
        library.fn = _checkpointed(model, scope)
        original = library.forward

        def forward_then_poison(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            out = original(*args, **kwargs)
            poison_free_pages(library.cache)  # every forward: reuse, as early as it could happen
            return out

        library.forward = forward_then_poison
        out_lib, dx_lib, _ = _play_with_backward_hook(library, events, with_grad)
        used_before = library.cache._allocator.num_used
        assert scope.held_pages > 0
    assert library.cache._allocator.num_used < used_before  # the holds were the only references left
    grads_lib = _param_grads(model)
    for a, e in zip(dx_lib, dx_ref, strict=True):
        torch.testing.assert_close(a, e, atol=2e-5, rtol=1e-5)
    assert max(_rel(grads_lib[n], grads_ref[n]) for n in grads_ref) <= 1e-5


def _play_with_backward_hook(library: LibraryStreaming, events, with_grad):  # noqa: ANN001, ANN202
    """``play_with_grad`` with the free pages poisoned once more just before the backward."""
    with poisoned_before_backward(library.cache) as poisoned:
        result = play_with_grad(library, events, with_grad)
    assert poisoned and all(count > 0 for count in poisoned)
    return result


def test_without_holds_the_recomputation_would_read_reused_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same rollout with the holds disabled gives NaN gradients: the test above can see a missing hold."""
    from ardiff_modules.core.transaction import PageHold

    monkeypatch.setattr(PageHold, "take", lambda self: None)  # a hold that references nothing
    monkeypatch.setattr(PageHold, "release", lambda self: [])
    torch.manual_seed(0)
    model = TinyStreamingModel()
    spec, events, with_grad = _rollout(model)
    library = LibraryStreaming(model, spec, 96)
    with am.TrainingScope(library.cache) as scope:
        library.fn = _checkpointed(model, scope)
        _play_with_backward_hook(library, events, with_grad)
    grads = _param_grads(model)
    assert any(not torch.isfinite(g).all() for g in grads.values())


def test_plain_torch_checkpoint_recomputation_is_refused() -> None:
    torch.manual_seed(0)
    model = TinyStreamingModel()
    library = LibraryStreaming(model, model.spec(CHUNK, 2, 1, 2), 64)
    with torch.no_grad():
        library.set_prompt({b: torch.ones(5, model.context_dim) for b in ("cond", "uncond")})

    def plain(x: torch.Tensor, layers) -> torch.Tensor:  # noqa: ANN001
        for block, kv in zip(model.blocks, layers):
            x = checkpoint(block, x, kv, model.rope, use_reentrant=False)
        return x

    library.fn = plain
    out = library.forward(("cond", "uncond"), torch.randn(2, CHUNK, model.dim, requires_grad=True), True)
    with pytest.raises(am.TrainingScopeError, match="plain torch.utils.checkpoint"):
        out.sum().backward()


def test_backward_after_the_scope_ended_is_refused_and_the_pages_are_free() -> None:
    torch.manual_seed(0)
    model = TinyStreamingModel()
    library = LibraryStreaming(model, model.spec(CHUNK, 2, 1, 2), 64)
    with torch.no_grad():
        library.set_prompt({b: torch.ones(5, model.context_dim) for b in ("cond", "uncond")})
        for _ in range(3):
            library.forward(("cond", "uncond"), torch.randn(2, CHUNK, model.dim), True)
    free_before = library.cache._allocator.num_free
    with am.TrainingScope(library.cache) as scope:
        library.fn = _checkpointed(model, scope)
        out = library.forward(("cond", "uncond"), torch.randn(2, CHUNK, model.dim, requires_grad=True), False)
        assert scope.held_pages == 2 * 3 * spec_pages(library)  # both branches' sink + window pages
    assert library.cache._allocator.num_free == free_before - 2 * spec_pages(library)  # only the pending chunk's pages
    with pytest.raises(am.TrainingScopeError, match="TrainingScope that has ended"):
        out.sum().backward()
    with pytest.raises(am.TrainingScopeError, match="already entered"):
        scope.__enter__()


def spec_pages(library: LibraryStreaming) -> int:
    return library.cache.spec.pages_per_chunk


def test_a_long_rollout_with_one_scope_per_step_stays_at_sink_plus_window() -> None:
    """LongLive tunes on rollouts far longer than the window: one scope per training step keeps the pool
    at sink + window + the step's own chunks, however long the rollout."""
    torch.manual_seed(0)
    model = TinyStreamingModel(layers=2)
    spec = model.spec(CHUNK, 2, 1, 2)
    library = LibraryStreaming(model, spec, 64)
    with torch.no_grad():
        library.set_prompt({b: torch.ones(5, model.context_dim) for b in ("cond", "uncond")})
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    peaks = []
    for step in range(30):
        library.cache._allocator.reset_peak()
        with am.TrainingScope(library.cache) as scope:
            library.fn = _checkpointed(model, scope)
            x = torch.randn(2, CHUNK, model.dim, generator=g)
            with torch.no_grad():  # earlier denoising step
                library.forward(("cond", "uncond"), x, False)
            out = library.forward(("cond", "uncond"), x.requires_grad_(), False)  # the exit step
            with torch.no_grad():  # the clean commit
                library.forward(("cond", "uncond"), x.detach(), True)
            out.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        peaks.append(library.cache._allocator.peak_used)
    ppc = spec.pages_per_chunk
    bound = 2 * (1 + 2 + 1 + 1) * ppc  # both branches: sink + window + the pending chunk + the chunk just evicted
    assert max(peaks) <= bound, peaks
    assert library.cache._allocator.num_used == 2 * 3 * ppc
    # nothing per forward outlives it: the records and frozen contexts of finished forwards are gone
    from ardiff_modules import training

    assert len(training._RECORDS) == 0 and len(training._FROZEN) == 0
