"""Self-Forcing's own training rollout over ``swap_self_attention`` (issue 43, item 1).

``tests/support/self_forcing_training.py`` re-states ``SelfForcingTrainingPipeline.inference_with_trajectory`` and
the cached path of ``CausalWanSelfAttention`` from upstream's code: the exit step writes its roped K/V into the
block's dict buffer *with* gradients and the clean re-run overwrites them under ``no_grad``, so autograd's
``CopySlices`` routes every later read of those slots to the exit step's K/V; with ``gradient_checkpointing`` each
block runs under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` without ``crossattn_cache`` (the
cross K/V projected from the text with gradients every run).

The unedited pipeline runs over two copies of one model with random weights: upstream's attention, and the library's
layers after ``swap_self_attention`` (upstream's mode by default: ``history_grad="straight_through"``, and upstream's
float64 RoPE product: ``rope_dtype=torch.float64``). Every parameter's gradient -- self- and cross-attention
projections, the text embedding, all of them -- must be within 1e-5 relative of upstream's as written, with
checkpointing on and off, batch 1 and 2, global attention and a sliding window (measured: equal, bit for bit, on CPU).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.errors import TrainingScopeError
from ardiff_modules.integrations.self_forcing import SelfForcingSession, swap_self_attention
from tests.support.self_forcing_pipeline import TINY
from tests.support.self_forcing_training import (
    SelfForcingTrainingPipeline,
    TrainingSelfAttention,
    TrainingSettings,
    build_training_pipeline,
)
from tests.support.wan_rope import rope_apply_fp32

pytestmark = pytest.mark.usefixtures("one_thread")

PER_FRAME = TINY.tokens_per_frame
BRANCHES = ("video0", "video1")


@dataclass(frozen=True)
class Case:
    batch: int
    local_attn_size: int  # frames, -1: global (upstream's shipped config)
    same_step: bool  # same_step_across_blocks (shipped: True)
    exits: tuple[int, ...]  # upstream's exit-flag draw, one per block
    frames: int = 12  # 4 blocks of 3
    num_max_frames: int = 12

    def settings(self) -> TrainingSettings:
        return TrainingSettings(same_step_across_blocks=self.same_step, num_max_frames=self.num_max_frames)


CASES = {
    "global_batch1_shipped": Case(1, -1, True, (1, 0, 0, 0)),
    "global_batch2_exit_per_block": Case(2, -1, False, (2, 0, 3, 1)),
    # a 6-frame window (2 blocks: the current one and one committed): chunks evicted before later reads
    "window_batch2_exit_per_block": Case(2, 6, False, (0, 1, 3, 2)),
    "window_batch1_exit_first_step": Case(1, 6, True, (0,)),
}


def spec_for(case: Case) -> am.KVCacheSpec:
    policy = am.SinkWindowPolicy.from_frames(sink_size=0, local_attn_size=case.local_attn_size, frames_per_chunk=3)
    return am.KVCacheSpec(
        num_layers=TINY.num_layers, num_kv_heads=TINY.num_heads, head_dim=TINY.head_dim, chunk_size=3 * PER_FRAME,
        page_size=PER_FRAME, sink_chunks=policy.sink_chunks, window_chunks=policy.window_chunks,
        branches=BRANCHES[: case.batch], dtype="float32",
    )


def draws(case: Case, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (case.batch, case.frames, TINY.in_channels, TINY.latent_height, TINY.latent_width)
    return torch.randn(shape, generator=g), torch.randn(case.batch, 4, TINY.text_dim, generator=g), torch.randn(shape, generator=g)


def train_step(pipeline: SelfForcingTrainingPipeline, case: Case) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One rollout (re-noising draws seeded alike on both sides), a stand-in loss, its backward: the gradients."""
    noise, text, weights = draws(case)
    model = pipeline.generator.model
    model.zero_grad(set_to_none=True)
    with torch.random.fork_rng():
        torch.manual_seed(11)
        output = pipeline.inference_with_trajectory(noise, list(case.exits), text)
    (output * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, output.detach()


def twins(case: Case, checkpointing: bool, **swap: object) -> tuple[SelfForcingTrainingPipeline,
                                                                      SelfForcingTrainingPipeline, SelfForcingSession]:
    upstream = build_training_pipeline(local_attn_size=case.local_attn_size, settings=case.settings(),
                                       gradient_checkpointing=checkpointing)
    ours = SelfForcingTrainingPipeline(copy.deepcopy(upstream.generator), upstream.settings)
    num_pages = case.batch * 2 * case.frames  # every chunk of the rollout, what the session's scope holds
    session = swap_self_attention(ours.generator.model, spec_for(case), num_pages=num_pages, **swap)  # type: ignore[arg-type]
    return upstream, ours, session


def worst(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert actual.keys() == expected.keys(), sorted(set(actual) ^ set(expected))
    errors = {n: float((actual[n] - e).norm() / e.norm().clamp_min(1e-30)) for n, e in expected.items()}
    errors = {n: err if math.isfinite(err) else math.inf for n, err in errors.items()}
    name = max(errors, key=errors.__getitem__)
    return errors[name], name


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_unedited_training_pipeline_gives_upstreams_gradients(case: Case, checkpointing: bool) -> None:
    """Upstream as written (``rope_apply``: complex128) against the integration's default float64 rotation: every
    parameter gradient within 1e-5 relative (measured: 0, bitwise on CPU fp32). With the library's float32 rotation
    instead (``rope_dtype=torch.float32``), the last-ulp differences grown by the rollout left up to 1.6e-5 on the
    cross-attention key bias (a gradient the softmax nearly cancels): the test then fails, as it must."""
    upstream, ours, session = twins(case, checkpointing)
    expected, expected_out = train_step(upstream, case)
    actual, out = train_step(ours, case)
    torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=1e-5)
    # the cross K/V and the text embedding train where upstream projects them with gradients: every checkpointed
    # run, or a crossattn_cache filled by a first forward with gradients (the exit step at the first step)
    trains_text = checkpointing or case.exits[0] == 0
    assert any(".cross_attn.k." in n for n in expected) == trains_text
    assert any("text_embedding" in n for n in expected) == trains_text
    assert all(g.norm() > 0 for g in expected.values())
    error, name = worst(actual, expected)
    assert error <= 1e-5, f"worst parameter-gradient relative error {error:.2e} ({name}) against upstream as written"
    session.close()


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("case", [CASES["global_batch2_exit_per_block"], CASES["window_batch1_exit_first_step"]],
                         ids=["global_batch2_exit_per_block", "window_batch1_exit_first_step"])
def test_the_float32_rotation_is_upstreams_semantics_at_float32_rounding(case: Case, checkpointing: bool) -> None:
    """``rope_dtype=torch.float32`` (the library's rotation) is upstream's pipeline rotating in float32
    (``rope_apply_fp32``: the same angles, float32 cos / sin and product): within 1e-5 of that (measured: equal), so
    what separates it from upstream as written is rounding only, never the semantics of the history gradients."""
    _, ours, session = twins(case, checkpointing, rope_dtype=torch.float32)
    rounded = build_training_pipeline(local_attn_size=case.local_attn_size, settings=case.settings(),
                                      gradient_checkpointing=checkpointing, rope_fn=rope_apply_fp32)
    error, name = worst(train_step(ours, case)[0], train_step(rounded, case)[0])
    assert error <= 1e-5, f"worst parameter-gradient relative error {error:.2e} ({name}), float32 rotation both sides"
    session.close()


def test_detached_history_differs_from_upstream_and_equals_a_detached_upstream() -> None:
    """``history_grad="detached"`` (what the library did before) drops upstream's straight-through path: far from
    upstream as shipped, equal to upstream whose buffer reads are detached."""
    case = CASES["global_batch2_exit_per_block"]
    upstream, ours, session = twins(case, checkpointing=False, history_grad="detached")
    expected, _ = train_step(upstream, case)
    actual, _ = train_step(ours, case)
    error, _ = worst(actual, expected)
    assert error > 1e-2
    for block in upstream.generator.model.blocks:
        assert isinstance(block.self_attn, TrainingSelfAttention)
        block.self_attn.detach_history = True
    detached, _ = train_step(upstream, case)
    error, name = worst(actual, detached)
    assert error <= 1e-5, f"{error:.2e} ({name})"
    session.close()


def test_backward_after_the_next_video_began_is_refused() -> None:
    """The session's scope ends with the video: recomputing an earlier video's block raises, naming why."""
    case = CASES["global_batch1_shipped"]
    _, ours, session = twins(case, checkpointing=True)
    noise, text, weights = draws(case)
    output = ours.inference_with_trajectory(noise, list(case.exits), text)
    with torch.no_grad():
        ours.inference_with_trajectory(noise[:, :3], [0], text)  # the next video resets the session
    with pytest.raises(TrainingScopeError, match="expected a recomputation of a call with gradients"):
        (output * weights).sum().backward()
    session.close()


def test_a_users_scope_takes_precedence() -> None:
    """Inside the user's own ``TrainingScope`` of the cache (detached by default) the session's scope stays unused."""
    case = CASES["global_batch1_shipped"]
    _, ours, session = twins(case, checkpointing=True)
    with am.TrainingScope(session.cache) as scope:
        grads, _ = train_step(ours, case)
        assert scope.held_pages > 0 and scope.history_grad == "detached"
    assert session.training.scope is None
    assert grads
    session.close()


def test_upstreams_checkpoint_routed_to_scope_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    """The outside report's setup: upstream's ``torch.utils.checkpoint.checkpoint`` routed to ``scope.checkpoint`` of a
    straight-through scope the user entered. Its recomputation used to ask the session for the open forward
    (``ForwardFinishedError: ... expected block 0 to have opened the model forward``); it now reads its original call."""
    case = CASES["global_batch2_exit_per_block"]
    upstream, ours, session = twins(case, checkpointing=True)
    expected, _ = train_step(upstream, case)
    with am.TrainingScope(session.cache, history_grad="straight_through") as scope:
        def routed(fn, *args, use_reentrant=None, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            assert use_reentrant is False  # as upstream calls it
            return scope.checkpoint(fn, *args, **kwargs)

        monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", routed)
        actual, _ = train_step(ours, case)
    error, name = worst(actual, expected)
    assert error <= 1e-5, f"{error:.2e} ({name})"
    session.close()


def test_only_the_last_block_trains() -> None:
    """Partial fine-tuning: blocks 0 and 1 (and the embeddings) frozen, so only block 2's layer runs with gradients;
    its forward is still held and its recomputation found (the adoption is per layer call, not block 0's)."""
    case = CASES["global_batch2_exit_per_block"]
    upstream, ours, session = twins(case, checkpointing=True)
    for pipeline in (ours, upstream):
        for name, p in pipeline.generator.model.named_parameters():
            p.requires_grad_(name.startswith("blocks.2.") or name.startswith("head"))
    expected, _ = train_step(upstream, case)
    actual, _ = train_step(ours, case)
    assert any(n.startswith("blocks.2.self_attn.k.") for n in expected)
    assert not any(n.startswith("blocks.1.") for n in expected)
    error, name = worst(actual, expected)
    assert error <= 1e-5, f"{error:.2e} ({name})"
    session.close()


def test_two_forwards_with_gradients_of_one_chunk_are_refused_at_recomputation() -> None:
    """A recomputation finds its call by ``(layer, kv_cache, current_start)``: two calls with gradients there make
    the key ambiguous, and the recomputation says so instead of reading the wrong one."""
    case = CASES["global_batch1_shipped"]
    _, ours, session = twins(case, checkpointing=True)
    noise, text, _ = draws(case)
    ours._initialize_caches(case.batch, noise.dtype, noise.device)
    conditional, t = {"prompt_embeds": text}, torch.full((case.batch, 3), 500.0)
    _, first = ours._generator(noise[:, :3], conditional, t, 0)
    _, second = ours._generator(noise[:, :3], conditional, t, 0)  # the same chunk again, with gradients
    with pytest.raises(TrainingScopeError, match="expected one call with gradients per layer .* got several"):
        (first.sum() + second.sum()).backward()
    session.close()
