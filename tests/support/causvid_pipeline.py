"""CausVid's causal Wan model and inference loop, re-stated from its published code (tianweiy/CausVid @ ca21150).

CausVid is Self-Forcing's ancestor: the same ``CausalWanModel`` family, with these differences (read from
``causvid/models/wan/causal_model.py`` and ``causal_inference.py``), which is all this module changes of
``tests/support/self_forcing_pipeline.py``:

* ``CausalWanSelfAttention.forward(x, seq_lens, grid_sizes, freqs, block_mask, kv_cache=None, current_start=0,
  current_end=0)``: the chunk's roped K/V written at ``[current_start, current_end)`` of a fixed buffer, the query
  attending ``[:current_end]`` (global attention, no sink, no rolling); the module carries ``window_size`` and no
  ``sink_size`` / ``local_attn_size``. The block passes ``current_end`` positionally where Self-Forcing's passes
  ``cache_start``, so the re-stated model is called with ``cache_start=current_end``.
* the per-block dict holds ``k`` / ``v`` only (no index tensors), and a second video reuses it as it is: it just
  starts again at ``current_start=0`` (only the cross-attention caches' ``is_init`` is reset);
* the wrapper returns ``x0`` alone; the loop's ``start_latents`` (video extension) run once per block at
  timestep 0; the denoising list drops its final 0.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from tests.support.self_forcing_pipeline import (
    TINY, DiffusionWrapper, FlowMatchScheduler, SelfForcingModel, WanRMSNorm, attention, build_pipeline,
)
from tests.support.wan_rope import rope_apply


class CausVidSelfAttention(nn.Module):
    """CausVid's ``CausalWanSelfAttention`` cached path (see the module docstring)."""

    def __init__(self, dim: int, num_heads: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.window_size, self.qk_norm, self.eps = (-1, -1), True, eps
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q, self.norm_k = WanRMSNorm(dim, eps=eps), WanRMSNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor, seq_lens: torch.Tensor, grid_sizes: torch.Tensor, freqs: torch.Tensor,
                block_mask: Any, kv_cache: dict[str, Any] | None = None, current_start: int = 0,
                current_end: int = 0) -> torch.Tensor:
        assert kv_cache is not None, "the re-statement covers the cached (inference) path only"
        b, s, n, d = *x.shape[:2], self.num_heads, self.head_dim
        q = self.norm_q(self.q(x)).view(b, s, n, d)
        k = self.norm_k(self.k(x)).view(b, s, n, d)
        v = self.v(x).view(b, s, n, d)
        frames, height, width = (int(g) for g in grid_sizes[0].tolist())
        start_frame = current_start // (height * width)
        q = rope_apply(q, (frames, height, width), freqs, start_frame).type_as(v)
        k = rope_apply(k, (frames, height, width), freqs, start_frame).type_as(v)
        kv_cache["k"][:, current_start:current_end] = k
        kv_cache["v"][:, current_start:current_end] = v
        return self.o(attention(q, kv_cache["k"][:, :current_end], kv_cache["v"][:, :current_end]).flatten(2))


def causvid_model(seed: int = 0) -> SelfForcingModel:
    """The re-stated causal model with CausVid's self-attention in every block, the same random weights as
    :func:`~tests.support.self_forcing_pipeline.build_pipeline`'s model of that seed."""
    model = build_pipeline(local_attn_size=-1, sink_size=0, frames_per_block=1, seed=seed).generator.model
    for block in model.blocks:
        upstream = block.self_attn
        replacement = CausVidSelfAttention(upstream.dim, upstream.num_heads, upstream.eps)
        replacement.load_state_dict(upstream.state_dict())
        block.self_attn = replacement
    return model


class CausVidWrapper(DiffusionWrapper):
    """CausVid's ``WanDiffusionWrapper``: latents ``[B, F, C, H, W]`` in, ``x0`` alone out."""

    def forward(self, noisy_image_or_video: torch.Tensor, conditional_dict: dict[str, torch.Tensor],  # type: ignore[override]
                timestep: torch.Tensor, kv_cache: list[dict[str, Any]], crossattn_cache: list[dict[str, Any]],
                current_start: int, current_end: int) -> torch.Tensor:
        flow = self.model(noisy_image_or_video.permute(0, 2, 1, 3, 4), t=timestep,
                          context=conditional_dict["prompt_embeds"], seq_len=0, kv_cache=kv_cache,
                          crossattn_cache=crossattn_cache, current_start=current_start,
                          cache_start=current_end).permute(0, 2, 1, 3, 4)  # current_end in cache_start's slot
        return self.to_x0(noisy_image_or_video, timestep, flow)


class CausVidInferencePipeline:
    """CausVid's ``InferencePipeline.inference`` without the text encoder and the VAE (latents in and out)."""

    def __init__(self, generator: CausVidWrapper, *, frames_per_block: int, global_frames: int = 21,
                 denoising_step_list: tuple[int, ...] = (1000, 757, 522, 0)) -> None:
        self.generator, self.scheduler = generator, generator.scheduler
        steps = torch.tensor(denoising_step_list, dtype=torch.long)
        assert steps[-1] == 0
        self.denoising_step_list = torch.cat((self.scheduler.timesteps, torch.tensor([0.0])))[1000 - steps[:-1]]
        c = generator.model.config
        self.num_transformer_blocks, self.frame_seq_length = c.num_layers, c.tokens_per_frame
        self.cache_shape = (global_frames * c.tokens_per_frame, c.num_heads, c.head_dim)
        self.num_frame_per_block = frames_per_block
        self.kv_cache1: list[dict[str, Any]] | None = None
        self.crossattn_cache: list[dict[str, Any]] = []

    def inference(self, noise: torch.Tensor, prompt_embeds: torch.Tensor,
                  start_latents: torch.Tensor | None = None) -> torch.Tensor:
        batch, num_frames = noise.shape[:2]
        f, per_frame = self.num_frame_per_block, self.frame_seq_length
        conditional = {"prompt_embeds": prompt_embeds}
        output = torch.zeros_like(noise)
        if self.kv_cache1 is None:
            self.kv_cache1 = [{"k": noise.new_zeros(batch, *self.cache_shape), "v": noise.new_zeros(batch, *self.cache_shape)}
                              for _ in range(self.num_transformer_blocks)]
            self.crossattn_cache = [{"is_init": False} for _ in range(self.num_transformer_blocks)]
        else:  # a second video: only the cross caches are reset; the K/V buffers are overwritten from 0
            for cross in self.crossattn_cache:
                cross["is_init"] = False
        input_blocks = 0 if start_latents is None else start_latents.shape[1] // f
        for block in range(num_frames // f):
            start, end = block * f * per_frame, (block + 1) * f * per_frame
            noisy = noise[:, block * f : (block + 1) * f]
            if start_latents is not None and block < input_blocks:
                reference = start_latents[:, block * f : (block + 1) * f]
                output[:, block * f : (block + 1) * f] = reference
                self.generator(reference, conditional, torch.zeros(batch, f, dtype=torch.int64), self.kv_cache1,
                               self.crossattn_cache, start, end)
                continue
            for index, step in enumerate(self.denoising_step_list):
                timestep = torch.ones((batch, f), dtype=torch.int64) * step
                denoised = self.generator(noisy, conditional, timestep, self.kv_cache1, self.crossattn_cache, start,
                                          end)
                if index < len(self.denoising_step_list) - 1:
                    following = self.denoising_step_list[index + 1] * torch.ones(batch * f, dtype=torch.long)
                    noisy = self.scheduler.add_noise(
                        denoised.flatten(0, 1), torch.randn_like(denoised.flatten(0, 1)), following
                    ).unflatten(0, denoised.shape[:2])
            output[:, block * f : (block + 1) * f] = denoised
            self.generator(denoised, conditional, timestep * 0, self.kv_cache1, self.crossattn_cache, start, end)
        return output


def build_causvid(*, frames_per_block: int, seed: int = 0) -> CausVidInferencePipeline:
    model = causvid_model(seed).eval().requires_grad_(False)
    return CausVidInferencePipeline(CausVidWrapper(model, FlowMatchScheduler()), frames_per_block=frames_per_block)


def causvid_twin(pipeline: CausVidInferencePipeline) -> CausVidInferencePipeline:
    return CausVidInferencePipeline(copy.deepcopy(pipeline.generator), frames_per_block=pipeline.num_frame_per_block)


__all__ = ["TINY", "CausVidInferencePipeline", "CausVidSelfAttention", "build_causvid", "causvid_twin"]
