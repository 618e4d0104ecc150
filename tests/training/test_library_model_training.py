"""The library's own model trained like Self-Forcing (issue 43, items 1.1 and 1.2): ``WanCausalDiT`` with upstream's
weights, as the generator of the re-stated ``SelfForcingTrainingPipeline`` (``tests/support/library_training.py``),
inside a straight-through ``TrainingScope`` and with the text projected live in forwards with gradients, gives every
parameter -- the text embedding and the cross-attention ``k`` / ``v`` / ``norm_k`` included -- upstream's gradient:
what the once-projected prompt cache and the constant history could not give.

Upstream's checkpointed blocks project the text in every forward with gradients; its plain blocks fill their
``crossattn_cache`` at the rollout's first forward. The library projects live in every forward with gradients, so
it is compared with checkpointing on (and with it off, at a first forward with gradients: the same thing).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.library_training import LibraryGenerator, library_spec, library_twin, upstream_name
from tests.support.self_forcing_pipeline import TINY
from tests.support.self_forcing_training import SelfForcingTrainingPipeline, build_training_pipeline
from tests.support.wan_rope import rope_apply_fp32
from tests.training.test_upstream_training import CASES, Case, train_step, worst

pytestmark = pytest.mark.usefixtures("one_thread")


def library_step(case: Case, upstream: SelfForcingTrainingPipeline, checkpoint: bool,
                 history_grad: str = "straight_through") -> dict[str, torch.Tensor]:
    model = library_twin(upstream.generator.model)
    spec = library_spec(TINY, batch=case.batch, local_attn_size=case.local_attn_size)
    with LibraryGenerator(model, upstream.scheduler, spec, case.batch * 2 * case.frames, history_grad=history_grad,
                          checkpoint=checkpoint) as generator:
        pipeline = SelfForcingTrainingPipeline(upstream.generator, upstream.settings)
        pipeline.generator = generator  # type: ignore[assignment]  # the same call
        pipeline.generator.model = model
        grads, _ = train_step(pipeline, case)
    return {upstream_name(n): g for n, g in grads.items()}


@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointed", "plain"])
@pytest.mark.parametrize("name", ["global_batch1_shipped", "global_batch2_exit_per_block", "window_batch1_exit_first_step"])
def test_the_library_model_gets_upstreams_gradients(name: str, checkpointing: bool) -> None:
    case = CASES[name]
    if not checkpointing and case.exits[0] != 0:
        pytest.skip("upstream's plain blocks keep the text constant unless the first forward has gradients")
    upstream = build_training_pipeline(local_attn_size=case.local_attn_size, settings=case.settings(),
                                       gradient_checkpointing=checkpointing, rope_fn=rope_apply_fp32)
    expected, _ = train_step(upstream, case)
    actual = library_step(case, upstream, checkpointing)
    assert any("text_embedding" in n for n in actual) and any(".cross_attn.norm_k." in n for n in actual)
    error, which = worst(actual, expected)
    assert error <= 1e-5, f"worst parameter-gradient relative error {error:.2e} ({which})"


def test_with_the_history_detached_the_library_model_is_far_from_upstream() -> None:
    case = CASES["global_batch2_exit_per_block"]
    upstream = build_training_pipeline(local_attn_size=case.local_attn_size, settings=case.settings(),
                                       gradient_checkpointing=True, rope_fn=rope_apply_fp32)
    expected, _ = train_step(upstream, case)
    error, _ = worst(library_step(case, upstream, True, history_grad="detached"), expected)
    assert error > 1e-2
