"""Self-Forcing's causal Wan model and its inference loop, re-stated from its published semantics.

Written from guandeh17/Self-Forcing (``wan/modules/causal_model.py``: ``CausalWanSelfAttention``'s cached path,
``CausalWanAttentionBlock``, ``CausalHead``, ``CausalWanModel._forward_inference``; ``wan/modules/model.py``: the
t2v cross-attention filling its ``crossattn_cache``; ``utils/wan_wrapper.py``: flow -> x0; and
``pipeline/causal_inference.py``: ``CausalInferencePipeline.inference``), with no library code in the
attention: the oracle of ``tests/integrations/test_self_forcing.py``. Small and fp32, random weights; where
upstream hard-codes Wan2.1-1.3B's sizes (30 blocks, ``frame_seq_length`` 1560, a 12 x 128 cache, 32760
global-cache tokens = 21 frames) they are parameters here, taken from the model.

* :func:`roll_and_write` -- upstream's per-block rolling K/V dict (``k``, ``v``, ``global_end_index``,
  ``local_end_index``): a new chunk that does not fit shifts the rolling part left past the sink, a re-run
  of the same chunk overwrites its own slots.
* :class:`RollingSelfAttention` -- ``CausalWanSelfAttention``'s call signature and cached path: RoPE at
  frame ``current_start // frame_seq_length`` (``tests/support/wan_rope.py``), SDPA over the buffer.
* :class:`SelfForcingModel` / :class:`DiffusionWrapper` / :class:`CausalInferencePipeline` -- the model, the
  wrapper returning ``(flow, x0)`` and the loop: per chunk the denoising steps with re-noising, the output,
  then a clean re-run at ``context_noise`` over the same ``current_start``; between videos the caches are
  reset the way upstream resets them (new index tensors, ``is_init`` cleared).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from ardiff_modules.models.wan_causal_dit import WanConfig, sinusoidal_embedding
from tests.support.wan_rope import rope_apply, wan_freqs


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full attention, ``[B, L, heads, d]`` in and out (upstream's ``attention`` / ``flash_attention``)."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


class WanRMSNorm(nn.Module):
    """RMSNorm over the whole width (Wan's q / k norm: ``norm_q`` / ``norm_k`` of ``dim`` channels)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(dim=-1, keepdim=True) + self.eps)).type_as(x) * self.weight


# ------------------------------------------------------------------ the rolling buffer
def roll_and_write(
    cache: dict[str, Any], k: torch.Tensor, v: torch.Tensor, start: int, sink_tokens: int, bounded: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write one chunk's ``k`` / ``v`` ``[B, n, heads, d]`` at absolute token ``start`` into upstream's dict buffer.

    The dict holds ``k`` / ``v`` ``[B, size, heads, d]`` and two one-element counters: ``global_end_index``
    (absolute end of the last write) and ``local_end_index`` (where that write ended inside the buffer). A
    chunk past the last write that does not fit (``bounded``) first drops the oldest non-sink tokens by
    moving the rest of the rolling part left; a chunk ending where the last write ended (a re-run) lands on
    the same slots. Returns the keys / values the chunk's queries attend: the buffer up to the write's end
    (upstream slices the last ``local_attn_size * 1560`` tokens, which is the whole buffer at its sizes).
    """
    n = k.shape[1]
    end = start + n
    size = cache["k"].shape[1]
    local_end, global_end = int(cache["local_end_index"].item()), int(cache["global_end_index"].item())
    if bounded and end > global_end and local_end + n > size:
        drop = local_end + n - size  # the oldest tokens after the sink leave
        keep = local_end - drop - sink_tokens
        for name in ("k", "v"):
            moved = cache[name][:, sink_tokens + drop : sink_tokens + drop + keep].clone()
            cache[name][:, sink_tokens : sink_tokens + keep] = moved
        local_end -= drop
    write_end = local_end + end - global_end
    cache["k"][:, write_end - n : write_end] = k
    cache["v"][:, write_end - n : write_end] = v
    cache["global_end_index"].fill_(end)
    cache["local_end_index"].fill_(write_end)
    return cache["k"][:, :write_end], cache["v"][:, :write_end]


class RollingSelfAttention(nn.Module):
    """``CausalWanSelfAttention`` with a ``kv_cache``: q / k / v of width ``dim``, RMS q / k norms, RoPE from
    ``freqs`` at the chunk's frames, the chunk written into the block's rolling buffer, attention over it."""

    #: upstream's ``causal_rope_apply`` (a test may swap in another rounding: ``wan_rope.rope_apply_fp32``)
    rope_fn = staticmethod(rope_apply)

    def __init__(self, dim: int, num_heads: int, local_attn_size: int = -1, sink_size: int = 0, qk_norm: bool = True,
                 eps: float = 1e-6) -> None:
        super().__init__()
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.local_attn_size, self.sink_size, self.qk_norm, self.eps = local_attn_size, sink_size, qk_norm, eps
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q = WanRMSNorm(dim, eps=eps) if qk_norm else nn.Identity()
        self.norm_k = WanRMSNorm(dim, eps=eps) if qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor, seq_lens: torch.Tensor, grid_sizes: torch.Tensor, freqs: torch.Tensor,
                block_mask: Any, kv_cache: dict[str, Any] | None = None, current_start: int = 0,
                cache_start: int | None = None) -> torch.Tensor:
        assert kv_cache is not None, "the re-statement covers the cached (inference) path only"
        q, k, v, per_frame = self.qkv_rope(x, grid_sizes, freqs, current_start)
        keys, values = roll_and_write(
            kv_cache, k, v, current_start, self.sink_size * per_frame, bounded=self.local_attn_size != -1
        )
        return self.o(attention(q, keys, values).flatten(2))

    def qkv_rope(self, x: torch.Tensor, grid_sizes: torch.Tensor, freqs: torch.Tensor,
                 current_start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """q / k (normed, rotated at the chunk's frames) / v ``[B, L, heads, d]`` and the tokens per frame."""
        b, s, n, d = *x.shape[:2], self.num_heads, self.head_dim
        q = self.norm_q(self.q(x)).view(b, s, n, d)
        k = self.norm_k(self.k(x)).view(b, s, n, d)
        v = self.v(x).view(b, s, n, d)
        frames, height, width = (int(g) for g in grid_sizes[0].tolist())
        per_frame = height * width
        q = self.rope_fn(q, (frames, height, width), freqs, current_start // per_frame).type_as(v)
        k = self.rope_fn(k, (frames, height, width), freqs, current_start // per_frame).type_as(v)
        return q, k, v, per_frame


class T2VCrossAttention(nn.Module):
    """Wan's t2v cross-attention; with a ``crossattn_cache`` dict it projects the context once (``is_init``)."""

    def __init__(self, dim: int, num_heads: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q, self.norm_k = WanRMSNorm(dim, eps=eps), WanRMSNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor, context: torch.Tensor, context_lens: Any,
                crossattn_cache: dict[str, Any] | None = None) -> torch.Tensor:
        b, n, d = x.shape[0], self.num_heads, self.head_dim
        q = self.norm_q(self.q(x)).view(b, -1, n, d)
        if crossattn_cache is not None and crossattn_cache["is_init"]:
            k, v = crossattn_cache["k"], crossattn_cache["v"]
        else:
            k = self.norm_k(self.k(context)).view(b, -1, n, d)
            v = self.v(context).view(b, -1, n, d)
            if crossattn_cache is not None:
                crossattn_cache.update(k=k, v=v, is_init=True)
        return self.o(attention(q, k, v).flatten(2))


# ------------------------------------------------------------------ the model
class CausalBlock(nn.Module):
    """``CausalWanAttentionBlock``: per-frame modulated self-attention, cross-attention, FFN."""

    def __init__(self, c: WanConfig, local_attn_size: int, sink_size: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(c.dim, eps=c.eps, elementwise_affine=False)
        self.self_attn = RollingSelfAttention(c.dim, c.num_heads, local_attn_size, sink_size, True, c.eps)
        self.norm3 = nn.LayerNorm(c.dim, eps=c.eps, elementwise_affine=True)  # cross_attn_norm=True
        self.cross_attn = T2VCrossAttention(c.dim, c.num_heads, c.eps)
        self.norm2 = nn.LayerNorm(c.dim, eps=c.eps, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(c.dim, c.ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(c.ffn_dim, c.dim))
        self.modulation = nn.Parameter(torch.randn(1, 6, c.dim) / c.dim**0.5)

    def forward(self, x: torch.Tensor, e: torch.Tensor, seq_lens: torch.Tensor, grid_sizes: torch.Tensor,
                freqs: torch.Tensor, context: torch.Tensor, context_lens: Any, block_mask: Any,
                kv_cache: dict[str, Any] | None = None, crossattn_cache: dict[str, Any] | None = None,
                current_start: int = 0, cache_start: int | None = None, **attn_kwargs: Any) -> Any:
        """``x`` out; with an attention that returns ``(y, cache info)`` (LongLive's), ``(x, cache info)``.
        ``attn_kwargs`` go to the self-attention positionally after ``cache_start`` (LongLive's extra argument)."""
        frames = e.shape[1]

        def per_frame(h: torch.Tensor) -> torch.Tensor:  # [B, L, dim] -> [B, frames, L / frames, dim]
            return h.unflatten(1, (frames, h.shape[1] // frames))

        shift1, scale1, gate1, shift2, scale2, gate2 = (self.modulation.unsqueeze(1) + e).chunk(6, dim=2)
        y = self.self_attn((per_frame(self.norm1(x)) * (1 + scale1) + shift1).flatten(1, 2), seq_lens, grid_sizes,
                           freqs, block_mask, kv_cache, current_start, cache_start, *attn_kwargs.values())
        info = None
        if isinstance(y, tuple):
            y, info = y
        x = x + (per_frame(y) * gate1).flatten(1, 2)
        x = x + self.cross_attn(self.norm3(x), context, context_lens, crossattn_cache=crossattn_cache)
        y = self.ffn((per_frame(self.norm2(x)) * (1 + scale2) + shift2).flatten(1, 2))
        x = x + (per_frame(y) * gate2).flatten(1, 2)
        return x if info is None else (x, info)


class SelfForcingModel(nn.Module):
    """``CausalWanModel`` (t2v) in inference: ``forward(x [B, C, F, H, W], t [B, F], context, seq_len,
    kv_cache, crossattn_cache, current_start) -> [B, C_out, F, H, W]``."""

    def __init__(self, c: WanConfig, *, local_attn_size: int = -1, sink_size: int = 0) -> None:
        super().__init__()
        self.config, self.local_attn_size, self.sink_size = c, local_attn_size, sink_size
        self.patch_embedding = nn.Conv3d(c.in_channels, c.dim, kernel_size=c.patch_size, stride=c.patch_size)
        self.text_embedding = nn.Sequential(
            nn.Linear(c.text_dim, c.dim), nn.GELU(approximate="tanh"), nn.Linear(c.dim, c.dim)
        )
        self.time_embedding = nn.Sequential(nn.Linear(c.freq_dim, c.dim), nn.SiLU(), nn.Linear(c.dim, c.dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(c.dim, 6 * c.dim))
        self.blocks = nn.ModuleList(CausalBlock(c, local_attn_size, sink_size) for _ in range(c.num_layers))
        self.head_norm = nn.LayerNorm(c.dim, eps=c.eps, elementwise_affine=False)
        self.head = nn.Linear(c.dim, c.out_channels * c.patch_size[1] * c.patch_size[2])
        self.head_modulation = nn.Parameter(torch.randn(1, 2, c.dim) / c.dim**0.5)
        self.freqs = wan_freqs(c.head_dim, 1024)  # a plain attribute, as upstream (never cast by .to())
        self.block_mask: Any = None  # the cache-free path's mask (LongLive's re-cache sets one; the cached path ignores it)
        self.gradient_checkpointing = False  # upstream's flag: blocks under torch.utils.checkpoint when grad is on

    def apply_cache_updates(self, kv_cache: list[dict[str, Any]], infos: list[tuple[int, Any]]) -> None:
        """What a model whose attention returns cache updates does with them (LongLive's ``_apply_cache_updates``)."""
        raise NotImplementedError("Self-Forcing's attention writes its buffer itself")

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, seq_len: int,
                kv_cache: list[dict[str, Any]], crossattn_cache: list[dict[str, Any]], current_start: int = 0,
                cache_start: int = 0, **block_kwargs: Any) -> torch.Tensor:
        c = self.config
        tokens = self.patch_embedding(x)  # [B, dim, F, h, w]
        grid_sizes = torch.tensor([list(tokens.shape[2:])] * x.shape[0], dtype=torch.long)
        tokens = tokens.flatten(2).transpose(1, 2)
        seq_lens = torch.full((x.shape[0],), tokens.shape[1], dtype=torch.long)
        e = self.time_embedding(sinusoidal_embedding(c.freq_dim, t.flatten()).type_as(tokens))
        e0 = self.time_projection(e).unflatten(1, (6, c.dim)).unflatten(0, t.shape)  # [B, F, 6, dim]
        pad = context.new_zeros(context.shape[0], c.text_tokens - context.shape[1], c.text_dim)  # to text_len
        padded = torch.cat([context, pad], dim=1)
        ctx = self.text_embedding(padded)
        infos = []
        for index, block in enumerate(self.blocks):
            kwargs = dict(kv_cache=kv_cache[index], current_start=current_start, cache_start=cache_start, **block_kwargs)
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                # upstream's _forward_inference: no crossattn_cache here (the cross K/V are projected from the
                # context, with gradients, in each run and in the recomputation)
                tokens = torch.utils.checkpoint.checkpoint(
                    block, tokens, e0, seq_lens, grid_sizes, self.freqs, ctx, None, self.block_mask, use_reentrant=False,
                    **kwargs,
                )
            else:
                tokens = block(tokens, e0, seq_lens, grid_sizes, self.freqs, ctx, None, self.block_mask,
                               crossattn_cache=crossattn_cache[index], **kwargs)
            if isinstance(tokens, tuple):  # LongLive's blocks return their cache update, applied after all blocks
                tokens, info = tokens
                infos.append((index, info))
        if infos:
            self.apply_cache_updates(kv_cache, infos)
        e = e.unflatten(0, t.shape).unsqueeze(2)  # [B, F, 1, dim]
        shift, scale = (self.head_modulation.unsqueeze(1) + e).chunk(2, dim=2)
        frames = t.shape[1]
        out = self.head(self.head_norm(tokens).unflatten(1, (frames, -1)) * (1 + scale) + shift)
        return self._unpatchify(out, tuple(grid_sizes[0].tolist()))

    def _unpatchify(self, out: torch.Tensor, grid: tuple[int, ...]) -> torch.Tensor:
        """``[B, F, h*w, ph*pw*C]`` (channels ``(p, q, c)``) -> ``[B, C, F, h*ph, w*pw]``."""
        c = self.config
        (_, ph, pw), (f, h, w) = c.patch_size, grid
        u = out.reshape(out.shape[0], f, h, w, ph, pw, c.out_channels)
        return u.permute(0, 6, 1, 2, 4, 3, 5).reshape(out.shape[0], c.out_channels, f, h * ph, w * pw)


# ------------------------------------------------------------------ the wrapper and the loop
class FlowMatchScheduler:
    """Upstream's flow-matching schedule (``shift``, ``sigma_min=0``, one extra step, 1000 training steps)."""

    def __init__(self, shift: float = 5.0, steps: int = 1000) -> None:
        sigmas = torch.linspace(1.0, 0.0, steps + 1)[:-1]
        self.sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
        self.timesteps = self.sigmas * steps

    def sigma(self, timestep: torch.Tensor) -> torch.Tensor:
        """The sigma of each timestep ``[N]`` (the nearest scheduled one), float64."""
        index = torch.argmin((self.timesteps[None].double() - timestep[:, None].double()).abs(), dim=1)
        return self.sigmas.double()[index]

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        sigma = self.sigma(timestep).reshape(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
        return (1 - sigma) * x0 + sigma * noise


class DiffusionWrapper(nn.Module):
    """``WanDiffusionWrapper``: ``[B, F, C, H, W]`` latents in, ``(flow, x0)`` out (``x0 = x_t - sigma * flow``)."""

    def __init__(self, model: SelfForcingModel, scheduler: FlowMatchScheduler) -> None:
        super().__init__()
        self.model, self.scheduler = model, scheduler

    def forward(self, noisy_image_or_video: torch.Tensor, conditional_dict: dict[str, torch.Tensor],
                timestep: torch.Tensor, kv_cache: list[dict[str, Any]], crossattn_cache: list[dict[str, Any]],
                current_start: int, **model_kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        flow = self.model(noisy_image_or_video.permute(0, 2, 1, 3, 4), t=timestep,
                          context=conditional_dict["prompt_embeds"], seq_len=0, kv_cache=kv_cache,
                          crossattn_cache=crossattn_cache, current_start=current_start,
                          **model_kwargs).permute(0, 2, 1, 3, 4)
        return flow, self.to_x0(noisy_image_or_video, timestep, flow)

    def to_x0(self, noisy: torch.Tensor, timestep: torch.Tensor, flow: torch.Tensor) -> torch.Tensor:
        """``x0 = x_t - sigma * flow`` in float64, per frame (``[B, F, C, H, W]``)."""
        sigma = self.scheduler.sigma(timestep.flatten()).reshape(-1, 1, 1, 1)
        x0 = noisy.flatten(0, 1).double() - sigma * flow.flatten(0, 1).double()
        return x0.to(flow.dtype).unflatten(0, flow.shape[:2])


@dataclass
class LoopSettings:
    """What ``CausalInferencePipeline`` reads from its args (Self-Forcing's DMD config by default)."""

    denoising_step_list: tuple[int, ...] = (1000, 750, 500, 250)
    warp_denoising_step: bool = True
    num_frame_per_block: int = 3
    context_noise: int = 0
    global_cache_frames: int = 21  # upstream's 32760 global-cache tokens = 21 frames of 1560
    independent_first_frame: bool = False  # image-to-video: the first block is 1 frame (upstream's args)


class CausalInferencePipeline:
    """``CausalInferencePipeline.inference`` without the text encoder and the VAE (latents in, latents out)."""

    def __init__(self, generator: DiffusionWrapper, args: LoopSettings) -> None:
        self.generator, self.args, self.scheduler = generator, args, generator.scheduler
        steps = torch.tensor(args.denoising_step_list, dtype=torch.long)
        if args.warp_denoising_step:
            steps = torch.cat((self.scheduler.timesteps, torch.tensor([0.0])))[1000 - steps]
        self.denoising_step_list = steps
        c = generator.model.config
        self.num_transformer_blocks = c.num_layers  # upstream: 30
        self.frame_seq_length = c.tokens_per_frame  # upstream: 1560
        self.cache_shape = (c.num_heads, c.head_dim)  # upstream: (12, 128)
        self.num_frame_per_block = args.num_frame_per_block
        self.local_attn_size = generator.model.local_attn_size
        self.kv_cache1: list[dict[str, Any]] | None = None
        self.crossattn_cache: list[dict[str, Any]] = []
        self.forwards = 0  # model forwards so far (what the tests count host work against)

    def inference(
        self, noise: torch.Tensor, prompt_embeds: torch.Tensor, initial_latent: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``noise`` ``[B, frames, C, H, W]`` -> latents ``[B, input frames + frames, C, H, W]``.

        As upstream: ``frames`` a multiple of ``num_frame_per_block`` (``F``), or ``1 +`` one with
        ``independent_first_frame`` and no ``initial_latent`` (blocks of ``[1, F, F, ...]`` frames);
        ``initial_latent`` ``[B, input frames, C, H, W]`` (image-to-video, video extension) is run once per block
        at timestep 0 to fill the cache first (with ``independent_first_frame``: its first frame alone, then
        blocks of ``F``), and copied to the output's first frames.
        """
        batch, num_frames = noise.shape[:2]
        frames_per_block = self.num_frame_per_block
        independent = self.args.independent_first_frame
        if not independent or initial_latent is not None:
            assert num_frames % frames_per_block == 0
            block_frames = [frames_per_block] * (num_frames // frames_per_block)
        else:  # a [1, F, F, ...] model generating without image conditioning
            assert (num_frames - 1) % frames_per_block == 0
            block_frames = [1] + [frames_per_block] * ((num_frames - 1) // frames_per_block)
        num_input_frames = 0 if initial_latent is None else initial_latent.shape[1]
        if self.kv_cache1 is None:
            self._initialize_caches(batch, noise.dtype, noise.device)
        else:  # upstream's reset between videos: fresh index tensors, cross caches to refill
            for cross in self.crossattn_cache:
                cross["is_init"] = False
            for block in self.kv_cache1:
                block["global_end_index"] = torch.tensor([0], dtype=torch.long, device=noise.device)
                block["local_end_index"] = torch.tensor([0], dtype=torch.long, device=noise.device)
        conditional = {"prompt_embeds": prompt_embeds}
        output = noise.new_zeros(batch, num_input_frames + num_frames, *noise.shape[2:])
        start_frame = 0
        if initial_latent is not None:  # the context: one forward per input block at timestep 0 ([B, 1], as upstream)
            timestep = torch.zeros((batch, 1), dtype=torch.int64)
            input_blocks = [1] * independent + [frames_per_block] * ((num_input_frames - independent) // frames_per_block)
            assert sum(input_blocks) == num_input_frames
            for frames in input_blocks:
                reference = initial_latent[:, start_frame : start_frame + frames]
                output[:, start_frame : start_frame + frames] = reference
                self._generator(reference, conditional, timestep, start_frame * self.frame_seq_length)
                start_frame += frames
        for frames in block_frames:
            noisy = noise[:, start_frame - num_input_frames : start_frame + frames - num_input_frames]
            denoised = self._denoise(noisy, conditional, start_frame * self.frame_seq_length)
            output[:, start_frame : start_frame + frames] = denoised
            context_timestep = torch.full((batch, frames), self.args.context_noise, dtype=torch.int64)
            # the clean re-run: the chunk's K/V rewritten from its output, at the same current_start
            self._generator(denoised, conditional, context_timestep, start_frame * self.frame_seq_length)
            start_frame += frames
        return output

    def _denoise(self, noisy: torch.Tensor, conditional: dict[str, torch.Tensor], current_start: int) -> torch.Tensor:
        batch, frames = noisy.shape[:2]
        denoised = noisy
        for index, step in enumerate(self.denoising_step_list):
            timestep = torch.ones((batch, frames), dtype=torch.int64) * step
            _, denoised = self._generator(noisy, conditional, timestep, current_start)
            if index < len(self.denoising_step_list) - 1:
                following = self.denoising_step_list[index + 1] * torch.ones(batch * frames, dtype=torch.long)
                noise = torch.randn_like(denoised.flatten(0, 1))
                noisy = self.scheduler.add_noise(denoised.flatten(0, 1), noise, following)
                noisy = noisy.unflatten(0, denoised.shape[:2])
        return denoised

    def _generator(self, x: torch.Tensor, conditional: dict[str, torch.Tensor], timestep: torch.Tensor,
                   current_start: int, **model_kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.forwards += 1
        assert self.kv_cache1 is not None
        return self.generator(x, conditional, timestep, kv_cache=self.kv_cache1, crossattn_cache=self.crossattn_cache,
                              current_start=current_start, **model_kwargs)

    def _initialize_caches(self, batch: int, dtype: torch.dtype, device: torch.device) -> None:
        frames = self.local_attn_size if self.local_attn_size != -1 else self.args.global_cache_frames
        size = frames * self.frame_seq_length
        heads, head_dim = self.cache_shape
        self.kv_cache1 = [
            {
                "k": torch.zeros(batch, size, heads, head_dim, dtype=dtype, device=device),
                "v": torch.zeros(batch, size, heads, head_dim, dtype=dtype, device=device),
                "global_end_index": torch.tensor([0], dtype=torch.long, device=device),
                "local_end_index": torch.tensor([0], dtype=torch.long, device=device),
            }
            for _ in range(self.num_transformer_blocks)
        ]
        self.crossattn_cache = [{"is_init": False} for _ in range(self.num_transformer_blocks)]


# ------------------------------------------------------------------ building one
TINY = WanConfig(
    name="self-forcing-tiny", num_layers=3, dim=32, num_heads=2, ffn_dim=64, latent_height=4, latent_width=6,
    text_tokens=5, text_dim=8, in_channels=4, out_channels=4, freq_dim=16,
)  # 2 x 3 = 6 tokens per latent frame, heads of 16 channels


def randomize(model: nn.Module) -> nn.Module:
    """Every parameter drawn from the global generator (norm weights around 1), in registration order."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.2) + (1.0 if p.dim() == 1 else 0.0))
    return model


def build_pipeline(*, local_attn_size: int, sink_size: int, frames_per_block: int, config: WanConfig = TINY,
                   seed: int = 0, independent_first_frame: bool = False) -> CausalInferencePipeline:
    """A pipeline over a :class:`SelfForcingModel` with random weights (norm weights too), fp32, eval mode."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = randomize(SelfForcingModel(config, local_attn_size=local_attn_size, sink_size=sink_size))
    generator = DiffusionWrapper(model.eval().requires_grad_(False), FlowMatchScheduler())
    settings = LoopSettings(num_frame_per_block=frames_per_block, independent_first_frame=independent_first_frame)
    return CausalInferencePipeline(generator, settings)


def twin(pipeline: CausalInferencePipeline) -> CausalInferencePipeline:
    """A second pipeline over a copy of the same model (fresh caches): one to swap, one to keep upstream's."""
    return CausalInferencePipeline(copy.deepcopy(pipeline.generator), pipeline.args)
