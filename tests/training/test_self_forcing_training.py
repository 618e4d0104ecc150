"""Self-Forcing training through the cache (issue 27, item 4): the parameter gradients of a training rollout
of the reference Wan model equal those of a cache-free recomputation and of Self-Forcing's rolling buffer.

The rollout re-states Self-Forcing's ``SelfForcingTrainingPipeline.inference_with_trajectory``: per chunk a
random exit step among the denoising steps (one per chunk, or one for the whole rollout:
``same_step_across_blocks``); the steps before it run without gradients, each re-noising its ``x0``
prediction to the next timestep; the exit step runs with gradients (from chunk ``grad_from`` on, as
upstream keeps only the last frames' gradients) and its ``x0`` is the chunk's output; then the chunk's
clean K/V are written by a forward without gradients at the context timestep (0). One backward of a
stand-in loss at the end, when the pages the early forwards read hold other chunks' K/V since.

The three runners (``tests.support.training_peers``) share one model object, so its ``.grad`` after each
backward is compared parameter by parameter (relative error <= 1e-5, fp32, CPU). Cases: text-to-video with a
batch of two sessions, and image-to-video with a 1-frame first chunk (the sink) and 6-token frames; both
slide the window. The same rollout with every block under ``TrainingScope.checkpoint`` (recomputed in
backward, every free page overwritten with NaN first) gives the plain run's gradients.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.models.wan_causal_dit import WanCausalDiT, WanConfig, build_model
from tests.support.training_peers import (
    CacheFreeWan,
    LibraryWan,
    RollingBufferWan,
    WanRunner,
    poison_free_pages,
)

#: Self-Forcing's ``denoising_step_list`` (1000, 750, 500, 250; the trailing 0 dropped for training).
STEPS = (1000.0, 750.0, 500.0, 250.0)
CONTEXT_T = 0.0  # ``context_noise``: the clean forward's timestep


pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass(frozen=True)
class Case:
    """One training configuration (sizes in latent frames and chunks; sink: one chunk)."""

    streams: int  # batch rows (one session each; CFG off)
    frames_per_chunk: int
    independent_first_frame: bool  # image-to-video: a 1-frame first chunk
    window_chunks: int
    chunks: int
    same_exit: bool  # Self-Forcing's same_step_across_blocks
    grad_from: int  # first chunk whose exit step runs with gradients
    latent: tuple[int, int]  # latent height, width (tokens per frame: a quarter of it)
    seed: int = 0  # of the draws

    def config(self) -> WanConfig:
        h, w = self.latent
        return WanConfig.preset(
            "tiny", latent_height=h, latent_width=w, frames_per_chunk=self.frames_per_chunk, text_tokens=6,
            sink_chunks=1, window_chunks=self.window_chunks,
        )

    def chunk_frames(self) -> list[int]:
        f = self.frames_per_chunk
        return [1 if (self.independent_first_frame and c == 0) else f for c in range(self.chunks)]

    def rolling_frames(self) -> tuple[int, int]:
        """Self-Forcing's ``(sink_size, local_attn_size)`` in frames for this sink + window (current chunk counted)."""
        sink = self.chunk_frames()[0]
        return sink, sink + (self.window_chunks + 1) * self.frames_per_chunk


CASES = {
    # t2v, batch 2, a new exit step per chunk, gradients at every chunk; 9 chunks through a 1 + 2 window.
    "t2v_batch2_exit_per_chunk": Case(2, 2, False, 2, 9, False, 0, (4, 4)),
    # i2v: a 1-frame first chunk (the sink), 3-frame chunks of 6 tokens per frame, window 3, one exit step
    # for the rollout, gradients from chunk 2 on.
    "i2v_first_frame_same_exit": Case(1, 3, True, 3, 8, True, 2, (6, 4), seed=1),
}


@dataclass(eq=False)
class Draws:
    """A rollout's random draws, shared by every runner."""

    texts: list[torch.Tensor]  # per stream [text_tokens, text_dim]
    exits: list[int]  # per chunk: the index in STEPS of the exit step
    noise: list[torch.Tensor]  # per chunk: the initial noise [S, F, C, H, W]
    renoise: list[list[torch.Tensor]]  # per chunk, per step: the noise added towards the next timestep
    weights: list[torch.Tensor]  # per chunk: the stand-in loss's weights on x0


def draw(case: Case, config: WanConfig, seed: int = 0) -> Draws:
    g = torch.Generator().manual_seed(seed)
    exits = torch.randint(len(STEPS), (case.chunks,), generator=g).tolist()
    if case.same_exit:
        exits = [exits[0]] * case.chunks
    latent = (config.in_channels, config.latent_height, config.latent_width)
    shapes = [(case.streams, f, *latent) for f in case.chunk_frames()]
    return Draws(
        texts=[torch.randn(config.text_tokens, config.text_dim, generator=g) for _ in range(case.streams)],
        exits=exits,
        noise=[torch.randn(s, generator=g) for s in shapes],
        renoise=[[torch.randn(s, generator=g) for _ in STEPS] for s in shapes],
        weights=[torch.randn(s, generator=g) for s in shapes],
    )


def add_noise(x0: torch.Tensor, noise: torch.Tensor, t: float) -> torch.Tensor:
    """Flow matching: ``x_t = (1 - sigma) x0 + sigma noise`` with ``sigma = t / 1000``."""
    sigma = t / 1000.0
    return (1 - sigma) * x0 + sigma * noise


def rollout(runner: WanRunner, case: Case, draws: Draws) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One Self-Forcing training rollout: returns the stand-in loss (not yet backpropagated) and each
    chunk's ``x0`` ``[S, F, C, H, W]``."""
    runner.set_prompt(draws.texts)
    loss, outputs = torch.zeros(()), []
    for c, x in enumerate(draws.noise):
        shape = x.shape[:2]  # timesteps per frame [S, F], as upstream
        for i, t in enumerate(STEPS):
            exit_step = i == draws.exits[c]
            with torch.set_grad_enabled(exit_step and c >= case.grad_from):
                flow = runner.forward(x, torch.full(shape, t), commit=False)
                x0 = x - t / 1000.0 * flow  # the x0 prediction of a flow model
            if exit_step:
                break
            x = add_noise(x0, draws.renoise[c][i], STEPS[i + 1])
        outputs.append(x0)
        loss = loss + (x0 * draws.weights[c]).sum()
        with torch.no_grad():  # the clean chunk's K/V become history (context_noise 0)
            runner.forward(add_noise(x0, draws.renoise[c][-1], CONTEXT_T), torch.full(shape, CONTEXT_T), commit=True)
    return loss, outputs


def trainable(config: WanConfig) -> WanCausalDiT:
    return build_model(config, seed=1).requires_grad_(True)


def take_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def worst_relative_error(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert actual.keys() == expected.keys()
    errors = {n: float((actual[n] - e).norm() / e.norm().clamp_min(1e-30)) for n, e in expected.items()}
    errors = {n: err if math.isfinite(err) else math.inf for n, err in errors.items()}  # NaN never passes
    name = max(errors, key=errors.__getitem__)
    return errors[name], name


def train_step(runner: WanRunner, model: WanCausalDiT, case: Case, draws: Draws) -> tuple[dict, list[torch.Tensor]]:
    loss, outputs = rollout(runner, case, draws)
    loss.backward()
    return take_grads(model), [o.detach() for o in outputs]


def library_pages(case: Case, config: WanConfig) -> int:
    """Every chunk of every stream, plus one pending: room for what a TrainingScope holds over the rollout."""
    return case.streams * (case.chunks + 2) * config.frames_per_chunk  # pages of one frame


def resident_pages(case: Case) -> int:
    """The pages of the sink chunk and a full window, per stream (pages of one frame)."""
    return case.streams * (case.chunk_frames()[0] + case.window_chunks * case.frames_per_chunk)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_training_gradients_equal_the_cache_free_and_the_rolling_buffer_peers(case: Case) -> None:
    config = case.config()
    model = trainable(config)
    draws = draw(case, config, case.seed)
    assert len(set(draws.exits)) > 1 or case.same_exit, "a random exit step per chunk"
    assert any(e > 0 for e in draws.exits), "some steps before the exit run without gradients"
    assert case.chunks > 1 + case.window_chunks + 2, "the window slides"
    library = LibraryWan(model, case.streams, library_pages(case, config))
    grads, outputs = train_step(library, model, case, draws)
    assert library.cache.stats().pages_used == resident_pages(case)
    assert any(".attn.k." in n for n in grads) and any(".attn.q." in n for n in grads)
    assert all(g.norm() > 0 for g in grads.values())
    sink, local = case.rolling_frames()
    peers = {
        "cache-free": CacheFreeWan(model, case.streams, 1, case.window_chunks),
        "rolling buffer": RollingBufferWan(model, case.streams, sink, local),
    }
    for name, peer in peers.items():
        peer_grads, peer_outputs = train_step(peer, model, case, draws)
        for c, (a, e) in enumerate(zip(outputs, peer_outputs, strict=True)):
            where = f"{name}, chunk {c}"
            torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5, msg=lambda m, where=where: f"{where}: {m}")
        worst, which = worst_relative_error(grads, peer_grads)
        assert worst <= 1e-5, f"{name}: worst parameter-gradient relative error {worst:.2e} ({which})"


def test_a_window_one_chunk_short_is_seen_in_the_gradients() -> None:
    """The comparison can fail: a rolling buffer one chunk shorter than the library's window differs."""
    case = CASES["t2v_batch2_exit_per_chunk"]
    config = case.config()
    model = trainable(config)
    draws = draw(case, config, case.seed)
    grads, _ = train_step(LibraryWan(model, case.streams, library_pages(case, config)), model, case, draws)
    sink, local = case.rolling_frames()
    short = RollingBufferWan(model, case.streams, sink, local - case.frames_per_chunk)
    worst, _ = worst_relative_error(grads, train_step(short, model, case, draws)[0])
    assert worst > 1e-3


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_checkpointed_blocks_give_the_same_gradients(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block under ``scope.checkpoint`` (recomputed in backward from the pages the scope holds, after
    every free page was overwritten with NaN) gives the gradients of the plain run."""
    config = case.config()
    model = trainable(config)
    draws = draw(case, config, case.seed)
    plain, outputs = train_step(LibraryWan(model, case.streams, library_pages(case, config)), model, case, draws)
    library = LibraryWan(model, case.streams, library_pages(case, config))
    calls: list[int] = []

    def counted(forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def run(*args: object, **kwargs: object) -> torch.Tensor:
            calls.append(1)
            return forward(*args, **kwargs)

        return run

    with am.TrainingScope(library.cache) as scope:
        for block in model.blocks:
            monkeypatch.setattr(block, "forward", functools.partial(scope.checkpoint, counted(block.forward)))
        loss, checkpointed_outputs = rollout(library, case, draws)
        held, first_runs = scope.held_pages, len(calls)
        assert poison_free_pages(library.cache) > 0
        loss.backward()
    assert held > 0
    assert len(calls) > first_runs, "backward recomputed the checkpointed blocks"
    assert library.cache.stats().pages_used == resident_pages(case)
    for a, e in zip(checkpointed_outputs, outputs, strict=True):
        torch.testing.assert_close(a.detach(), e, atol=0, rtol=0)
    worst, which = worst_relative_error(take_grads(model), plain)
    assert worst <= 1e-6, f"worst parameter-gradient relative error {worst:.2e} ({which})"
