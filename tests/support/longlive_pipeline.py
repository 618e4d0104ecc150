"""LongLive 1.x's causal Wan model and interactive inference loop, re-stated from its published code.

Written from NVlabs/LongLive @ 2462895 (the last 1.x commit, before "LongLive 2.0"): ``wan/modules/causal_model.py``
(``CausalWanSelfAttention``, ``CausalWanAttentionBlock``, ``CausalWanModel._forward_inference`` /
``_apply_cache_updates``) and ``pipeline/interactive_causal_inference.py`` (``InteractiveCausalInferencePipeline``:
``inference`` and ``_recache_after_switch``), with no library code in the attention: the oracle of
``tests/integrations/test_longlive.py``. LongLive's model is Self-Forcing's, so this module changes only what
LongLive changes of ``tests/support/self_forcing_pipeline.py``:

* ``CausalWanSelfAttention.forward(..., current_start, cache_start, sink_recache_after_switch)`` never writes its
  ``kv_cache``: it attends a temporary copy (rolled and written as LongLive does:
  :func:`tests.support.longlive_cache.attend_buffer`) and returns ``(x, (current_end, local_end_index, update))``;
  the block passes the flag positionally and returns ``(x, that tuple)``;
* the model applies every block's update after the last block (``_apply_cache_updates``: ``None`` only fills the
  indices; a recompute -- ``current_end <= global_end_index`` and ``current_start > 0`` -- never moves them);
* the interactive loop: new cache dicts per video (the window's ``local_attn_size`` frames, or every output frame
  for global attention), and before the first chunk at or after each switch frame ``_recache_after_switch``: with
  ``global_sink=False`` the K/V buffers zeroed (indices kept), the cross caches cleared, one forward over the
  clean latents of the last ``min(local_attn_size, current_start_frame)`` frames at ``context_noise`` with
  ``sink_recache_after_switch=not global_sink``; returns ``(video, latents)`` with ``return_latents``.

The text encoder and the VAE are left out: prompts are their embeddings ``[B, tokens, text_dim]``, the "video" is
the latents scaled as upstream scales the decoded pixels.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from ardiff_modules.models.wan_causal_dit import WanConfig
from tests.support.longlive_cache import apply_update, attend_buffer
from tests.support.self_forcing_pipeline import (
    TINY, CausalInferencePipeline, DiffusionWrapper, FlowMatchScheduler, LoopSettings, RollingSelfAttention,
    SelfForcingModel, attention, randomize,
)


class LongLiveAttention(RollingSelfAttention):
    """LongLive 1.x's ``CausalWanSelfAttention`` cached path (see the module docstring)."""

    def __init__(self, dim: int, num_heads: int, local_attn_size: int = -1, sink_size: int = 0, qk_norm: bool = True,
                 eps: float = 1e-6) -> None:
        super().__init__(dim, num_heads, local_attn_size, sink_size, qk_norm, eps)
        self.max_attention_size = 32760 if local_attn_size == -1 else local_attn_size * 1560  # upstream's 1560

    def forward(self, x: torch.Tensor, seq_lens: torch.Tensor, grid_sizes: torch.Tensor, freqs: torch.Tensor,
                block_mask: Any, kv_cache: dict[str, Any] | None = None, current_start: int = 0,
                cache_start: int | None = None, sink_recache_after_switch: bool = False) -> Any:
        assert kv_cache is not None, "the re-statement covers the cached (inference) path only"
        q, k, v, per_frame = self.qkv_rope(x, grid_sizes, freqs, current_start)
        # attend_buffer bounds the window by the buffer's size: upstream's max_attention_size is never smaller here
        assert self.max_attention_size >= kv_cache["k"].shape[1]
        keys, values, update = attend_buffer(
            kv_cache["k"], kv_cache["v"], k, v, current_start=current_start,
            global_end=int(kv_cache["global_end_index"].item()), local_end=int(kv_cache["local_end_index"].item()),
            sink_tokens=self.sink_size * per_frame, bounded=self.local_attn_size != -1,
            sink_recache=sink_recache_after_switch,
        )
        current_end, local_end = current_start + x.shape[1], update[2]
        return self.o(attention(q, keys, values).flatten(2)), (current_end, local_end, update)


class LongLiveModel(SelfForcingModel):
    """``CausalWanModel`` of LongLive 1.x in inference: Self-Forcing's blocks over :class:`LongLiveAttention`,
    the blocks' cache updates applied after the last block."""

    def __init__(self, c: WanConfig, *, local_attn_size: int = -1, sink_size: int = 0) -> None:
        super().__init__(c, local_attn_size=local_attn_size, sink_size=sink_size)
        for block in self.blocks:
            block.self_attn = LongLiveAttention(c.dim, c.num_heads, local_attn_size, sink_size, True, c.eps)

    def apply_cache_updates(self, kv_cache: list[dict[str, Any]], infos: list[tuple[int, Any]]) -> None:
        """``_apply_cache_updates``: roll and write each block's buffers; fill the indices unless a recompute."""
        for index, (current_end, local_end, update) in infos:
            cache = kv_cache[index]
            ends = (current_end, local_end) if update is None else apply_update(cache["k"], cache["v"], update)
            if ends is not None:
                cache["global_end_index"].fill_(ends[0])
                cache["local_end_index"].fill_(ends[1])

    def _prepare_blockwise_causal_attn_mask(self, device: torch.device, num_frames: int, frame_seqlen: int,
                                            num_frame_per_block: int, local_attn_size: int) -> None:
        """Upstream builds flex attention's ``BlockMask`` here; its cached path never reads it (``None``)."""
        return None


@dataclass
class InteractiveSettings(LoopSettings):
    """What ``InteractiveCausalInferencePipeline`` reads from its args beyond Self-Forcing's."""

    global_sink: bool = True


class InteractiveCausalInferencePipeline(CausalInferencePipeline):
    """``InteractiveCausalInferencePipeline`` of LongLive 1.x without the text encoder and the VAE."""

    def __init__(self, generator: DiffusionWrapper, args: InteractiveSettings) -> None:
        super().__init__(generator, args)
        self.global_sink = args.global_sink

    def _recache_after_switch(self, output: torch.Tensor, current_start_frame: int,
                              new_conditional_dict: dict[str, torch.Tensor]) -> None:
        assert self.kv_cache1 is not None
        if not self.global_sink:
            for cache in self.kv_cache1:
                cache["k"].zero_()
                cache["v"].zero_()
        self._clear_cross()
        if current_start_frame == 0:
            return
        frames = current_start_frame if self.local_attn_size == -1 else min(self.local_attn_size, current_start_frame)
        recache_start_frame = current_start_frame - frames
        frames_to_recache = output[:, recache_start_frame:current_start_frame]
        model = self.generator.model
        model.block_mask = model._prepare_blockwise_causal_attn_mask(
            frames_to_recache.device, num_frames=frames, frame_seqlen=self.frame_seq_length,
            num_frame_per_block=self.num_frame_per_block, local_attn_size=self.local_attn_size,
        )
        context_timestep = torch.ones([frames_to_recache.shape[0], frames], dtype=torch.int64) * self.args.context_noise
        with torch.no_grad():
            self._generator(frames_to_recache, new_conditional_dict, context_timestep,
                            recache_start_frame * self.frame_seq_length, sink_recache_after_switch=not self.global_sink)
        self._clear_cross()

    def _clear_cross(self) -> None:
        for block in self.crossattn_cache:
            block["k"].zero_()
            block["v"].zero_()
            block["is_init"] = False

    def inference(self, noise: torch.Tensor, *, text_prompts_list: list[torch.Tensor],  # type: ignore[override]
                  switch_frame_indices: list[int], return_latents: bool = False) -> Any:
        """``noise`` ``[B, frames, C, H, W]``; prompt ``i`` (embeddings ``[B, tokens, text_dim]``) from the first chunk
        at or after ``switch_frame_indices[i - 1]``. Returns the "video", or ``(video, latents)``."""
        batch, num_frames = noise.shape[:2]
        assert len(switch_frame_indices) == len(text_prompts_list) - 1 and num_frames % self.num_frame_per_block == 0
        cond_list = [{"prompt_embeds": prompt} for prompt in text_prompts_list]
        output = torch.zeros_like(noise)
        frames = self.local_attn_size if self.local_attn_size != -1 else num_frames
        self._initialize_kv_cache(batch, noise.dtype, frames * self.frame_seq_length)
        self.generator.model.local_attn_size = self.local_attn_size
        target = 32760 if self.local_attn_size == -1 else self.local_attn_size * self.frame_seq_length
        for module in self.generator.model.modules():  # _set_all_modules_max_attention_size
            if hasattr(module, "max_attention_size"):
                module.max_attention_size = target
        segment, start_frame = 0, 0
        next_switch = switch_frame_indices[0] if switch_frame_indices else None
        for _ in range(num_frames // self.num_frame_per_block):
            if next_switch is not None and start_frame >= next_switch:
                segment += 1
                self._recache_after_switch(output, start_frame, cond_list[segment])
                next_switch = switch_frame_indices[segment] if segment < len(switch_frame_indices) else None
            f, current_start = self.num_frame_per_block, start_frame * self.frame_seq_length
            denoised = self._denoise(noise[:, start_frame : start_frame + f], cond_list[segment], current_start)
            output[:, start_frame : start_frame + f] = denoised
            context_timestep = torch.full((batch, f), self.args.context_noise, dtype=torch.int64)
            self._generator(denoised, cond_list[segment], context_timestep, current_start)
            start_frame += f
        video = (output * 0.5 + 0.5).clamp(0, 1)  # upstream decodes with the VAE first
        return (video, output) if return_latents else video

    def _initialize_kv_cache(self, batch: int, dtype: torch.dtype, size: int) -> None:
        """New per-block dicts every video (``_initialize_kv_cache`` and ``_initialize_crossattn_cache``)."""
        heads, head_dim = self.cache_shape
        text_tokens = self.generator.model.config.text_tokens
        self.kv_cache1 = [
            {"k": torch.zeros(batch, size, heads, head_dim, dtype=dtype),
             "v": torch.zeros(batch, size, heads, head_dim, dtype=dtype),
             "global_end_index": torch.tensor([0], dtype=torch.long),
             "local_end_index": torch.tensor([0], dtype=torch.long)}
            for _ in range(self.num_transformer_blocks)
        ]
        self.crossattn_cache = [
            {"k": torch.zeros(batch, text_tokens, heads, head_dim, dtype=dtype),
             "v": torch.zeros(batch, text_tokens, heads, head_dim, dtype=dtype), "is_init": False}
            for _ in range(self.num_transformer_blocks)
        ]


def build_longlive(*, local_attn_size: int, sink_size: int, frames_per_block: int, global_sink: bool,
                   config: WanConfig = TINY, seed: int = 0) -> InteractiveCausalInferencePipeline:
    """An interactive pipeline over a :class:`LongLiveModel` with random weights, fp32, eval mode."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = randomize(LongLiveModel(config, local_attn_size=local_attn_size, sink_size=sink_size))
    generator = DiffusionWrapper(model.eval().requires_grad_(False), FlowMatchScheduler())
    settings = InteractiveSettings(num_frame_per_block=frames_per_block, global_sink=global_sink)
    return InteractiveCausalInferencePipeline(generator, settings)


def longlive_twin(pipeline: InteractiveCausalInferencePipeline) -> InteractiveCausalInferencePipeline:
    """A second pipeline over a copy of the same model: one to swap, one to keep upstream's."""
    return InteractiveCausalInferencePipeline(copy.deepcopy(pipeline.generator), pipeline.args)  # type: ignore[arg-type]


__all__ = ["TINY", "InteractiveCausalInferencePipeline", "LongLiveAttention", "LongLiveModel", "build_longlive",
           "longlive_twin"]
