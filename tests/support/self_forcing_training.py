"""Self-Forcing's *training* rollout re-stated from its code: the oracle of ``tests/training/test_upstream_training.py``.

Written from guandeh17/Self-Forcing: ``pipeline/self_forcing_training.py``
(``SelfForcingTrainingPipeline.inference_with_trajectory``: fresh per-rollout caches of ``num_max_frames`` frames,
per block a random exit step among the denoising steps -- the steps before it under ``no_grad`` with re-noising,
the exit step *with* gradients from frame ``num_output_frames - num_max_frames`` on -- then the clean re-run at
``context_noise`` under ``no_grad``), ``wan/modules/causal_model.py`` (``CausalWanSelfAttention``'s cached path:
the chunk's roped K/V written into the block's dict buffer in place -- with gradients in the exit step, so autograd
records a ``CopySlices`` the clean re-run's ``no_grad`` overwrite does not remove -- and attention over the last
``max_attention_size`` tokens; ``_forward_inference``: each block under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` when ``gradient_checkpointing`` and grad are on,
*without* ``crossattn_cache``, so the cross K/V are projected from the text with gradients every time) and
``utils/wan_wrapper.py`` (flow -> x0). The model, wrapper and scheduler are ``tests/support/self_forcing_pipeline.py``'s.

No library code. Small, fp32, random weights; upstream's hard-coded sizes (1560 tokens per frame, a 12 x 128 cache
of 21 frames, ``max_attention_size`` 32760 = 21 frames) are parameters taken from the model and the settings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tests.support.self_forcing_pipeline import (
    TINY,
    DiffusionWrapper,
    FlowMatchScheduler,
    RollingSelfAttention,
    SelfForcingModel,
    attention,
    randomize,
    roll_and_write,
)
from tests.support.wan_rope import rope_apply


class TrainingSelfAttention(RollingSelfAttention):
    """``CausalWanSelfAttention``'s cached path as training runs it: the chunk written into the dict buffer in place
    (with gradients when grad is on: the ``CopySlices`` upstream's writes leave), attention over the buffer's last
    ``max_attention_frames`` frames up to the write's end (upstream: ``local_attn_size`` frames, or 32760 tokens =
    21 frames for global attention)."""

    max_attention_frames: int = 21
    #: Not upstream: read the history as a constant (a hook's ``.detach()``), the chunk's own K/V live.
    detach_history: bool = False

    def forward(self, x: torch.Tensor, seq_lens: torch.Tensor, grid_sizes: torch.Tensor, freqs: torch.Tensor,
                block_mask: Any, kv_cache: dict[str, Any] | None = None, current_start: int = 0,
                cache_start: int | None = None) -> torch.Tensor:
        assert kv_cache is not None, "the training rollout runs the cached path"
        q, k, v, per_frame = self.qkv_rope(x, grid_sizes, freqs, current_start)
        keys, values = roll_and_write(
            kv_cache, k, v, current_start, self.sink_size * per_frame, bounded=self.local_attn_size != -1
        )
        end = keys.shape[1]
        window = slice(max(0, end - self.max_attention_frames * per_frame), end)
        # upstream's flash_attention flattens the batch with torch.cat (a copy): its backward saves the copy, so the
        # later in-place writes into the buffer never invalidate it
        keys, values = keys[:, window].clone(), values[:, window].clone()
        if self.detach_history:
            n = k.shape[1]
            keys = torch.cat([keys[:, :-n].detach(), k], dim=1)
            values = torch.cat([values[:, :-n].detach(), v], dim=1)
        return self.o(attention(q, keys, values).flatten(2))


@dataclass(frozen=True)
class TrainingSettings:
    """What ``SelfForcingTrainingPipeline`` reads (Self-Forcing's DMD config by default, sizes scaled down)."""

    denoising_step_list: tuple[int, ...] = (1000, 750, 500, 250)
    warp_denoising_step: bool = True
    num_frame_per_block: int = 3
    same_step_across_blocks: bool = True
    num_max_frames: int = 21  # the buffer's frames and the frames trained on (upstream: 21 for both)
    context_noise: int = 0


class SelfForcingTrainingPipeline:
    """``SelfForcingTrainingPipeline.inference_with_trajectory`` (text-to-video, no ``initial_latent``)."""

    def __init__(self, generator: DiffusionWrapper, settings: TrainingSettings) -> None:
        self.generator, self.settings, self.scheduler = generator, settings, generator.scheduler
        steps = torch.tensor(settings.denoising_step_list, dtype=torch.long)
        if settings.warp_denoising_step:
            steps = torch.cat((self.scheduler.timesteps, torch.tensor([0.0])))[1000 - steps]
        self.denoising_step_list = steps[:-1] if steps[-1] == 0 else steps
        c = generator.model.config
        self.frame_seq_length, self.num_transformer_blocks = c.tokens_per_frame, c.num_layers
        self.kv_cache1: list[dict[str, Any]] = []
        self.crossattn_cache: list[dict[str, Any]] = []

    def inference_with_trajectory(self, noise: torch.Tensor, exit_flags: list[int],
                                  prompt_embeds: torch.Tensor) -> torch.Tensor:
        """``noise`` ``[B, frames, C, H, W]`` -> the rollout's ``x0`` predictions ``[B, frames, C, H, W]`` (with
        gradients from the exit steps); ``exit_flags``: upstream's ``generate_and_sync_list`` draw, one per block."""
        s = self.settings
        batch, num_frames = noise.shape[:2]
        assert num_frames % s.num_frame_per_block == 0
        self._initialize_caches(batch, noise.dtype, noise.device)
        output = noise.new_zeros(noise.shape)
        conditional = {"prompt_embeds": prompt_embeds}
        start_gradient_frame_index = num_frames - s.num_max_frames
        current_start_frame = 0
        for block_index in range(num_frames // s.num_frame_per_block):
            frames = s.num_frame_per_block
            noisy = noise[:, current_start_frame : current_start_frame + frames]
            start = current_start_frame * self.frame_seq_length
            for index, current_timestep in enumerate(self.denoising_step_list):
                exit_flag = index == exit_flags[0 if s.same_step_across_blocks else block_index]
                timestep = torch.ones([batch, frames], dtype=torch.int64) * current_timestep
                if not exit_flag:
                    with torch.no_grad():
                        _, denoised = self._generator(noisy, conditional, timestep, start)
                        following = self.denoising_step_list[index + 1] * torch.ones([batch * frames], dtype=torch.long)
                        noisy = self.scheduler.add_noise(
                            denoised.flatten(0, 1), torch.randn_like(denoised.flatten(0, 1)), following
                        ).unflatten(0, denoised.shape[:2])
                    continue
                with torch.set_grad_enabled(torch.is_grad_enabled() and current_start_frame >= start_gradient_frame_index):
                    _, denoised = self._generator(noisy, conditional, timestep, start)
                break
            output[:, current_start_frame : current_start_frame + frames] = denoised
            context_timestep = torch.ones_like(timestep) * s.context_noise
            # upstream: ``context_timestep * ones([B * F])`` into an add_noise that flattens 2-D timesteps (it
            # broadcasts at batch 1, its config; flattened first here so batch 2 runs too)
            denoised = self.scheduler.add_noise(
                denoised.flatten(0, 1), torch.randn_like(denoised.flatten(0, 1)),
                context_timestep.flatten() * torch.ones([batch * frames], dtype=torch.long),
            ).unflatten(0, denoised.shape[:2])
            with torch.no_grad():  # the clean re-run: the chunk's slots overwritten without gradients
                self._generator(denoised, conditional, context_timestep, start)
            current_start_frame += frames
        return output

    def _generator(self, x: torch.Tensor, conditional: dict[str, torch.Tensor], timestep: torch.Tensor,
                   current_start: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.generator(x, conditional, timestep, kv_cache=self.kv_cache1, crossattn_cache=self.crossattn_cache,
                              current_start=current_start)

    def _initialize_caches(self, batch: int, dtype: torch.dtype, device: torch.device) -> None:
        """Fresh dicts every rollout, as upstream (its buffer: ``num_max_frames`` frames)."""
        c = self.generator.model.config
        size = self.settings.num_max_frames * self.frame_seq_length
        self.kv_cache1 = [
            {
                "k": torch.zeros(batch, size, c.num_heads, c.head_dim, dtype=dtype, device=device),
                "v": torch.zeros(batch, size, c.num_heads, c.head_dim, dtype=dtype, device=device),
                "global_end_index": torch.tensor([0], dtype=torch.long, device=device),
                "local_end_index": torch.tensor([0], dtype=torch.long, device=device),
            }
            for _ in range(self.num_transformer_blocks)
        ]
        self.crossattn_cache = [{"is_init": False} for _ in range(self.num_transformer_blocks)]


def build_training_pipeline(*, local_attn_size: int, settings: TrainingSettings, seed: int = 0,
                            gradient_checkpointing: bool = False,
                            rope_fn: Callable[..., torch.Tensor] = rope_apply) -> SelfForcingTrainingPipeline:
    """A training pipeline over a :class:`SelfForcingModel` with random weights, every parameter trainable
    (``rope_fn``: upstream's rotation, or ``wan_rope.rope_apply_fp32`` to round as float32 models do)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = randomize(SelfForcingModel(TINY, local_attn_size=local_attn_size, sink_size=0))
    for block in model.blocks:
        trained = TrainingSelfAttention(TINY.dim, TINY.num_heads, local_attn_size, 0, True, TINY.eps)
        trained.load_state_dict(block.self_attn.state_dict())
        trained.max_attention_frames = settings.num_max_frames if local_attn_size == -1 else local_attn_size
        trained.rope_fn = rope_fn  # type: ignore[assignment]  # an instance's plain function
        block.self_attn = trained
    model.gradient_checkpointing = gradient_checkpointing
    return SelfForcingTrainingPipeline(DiffusionWrapper(model.requires_grad_(True), FlowMatchScheduler()), settings)
