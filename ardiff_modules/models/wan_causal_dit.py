"""A compact Wan2.1-style *causal* video DiT built from ``ardiff_modules`` layers: the reference model.

Shipped in the package (``from ardiff_modules.models.wan_causal_dit import WanConfig, build_model``); the
examples, benchmarks and tests all run this one model.

The architecture follows Wan2.1's ``WanModel`` (text-to-video) block for block, made causal the
way Self-Forcing / CausVid make it causal: self-attention goes through the paged sink + window KV
cache instead of attending to the whole clip.

::

    latents [S, F, C, H, W]                                     S = streams (CFG branches batched)
      -> patch_embedding  Conv3d(C, dim, kernel=stride=(1, 2, 2))  -> tokens [S, F*h*w, dim]
      -> blocks x L:
           x = x + gate1 * SelfAttn(LN(x) * (1 + scale1) + shift1)     ChunkSelfAttention, qk_norm="full",
                                                                       3-D RoPE at kv.positions
           x = x + CrossAttn(LN_affine(x))                             CachedCrossAttention("text"), qk_norm="full"
           x = x + gate2 * FFN(LN(x) * (1 + scale2) + shift2)          Linear -> GELU(tanh) -> Linear
      -> head: LN(x) * (1 + scale) + shift -> Linear -> unpatchify     -> [S, F, C, H, W]

    timestep [S] or [S, F] -> sinusoidal(freq_dim) -> time_embedding MLP -> e   [S, F, dim]
                                                 -> time_projection      -> e0  [S, F, 6, dim]
    (shift/scale/gate per block = block.modulation + e0, per frame, as Wan / Self-Forcing)

Positions: RoPE uses ``LayerContext.positions`` (``kv.positions``), the *absolute* token positions of
the current chunk, so frame ``p // (h * w)`` keeps counting across window eviction and restarts at 0
after ``state.reset()``. Text conditioning is projected once per prompt: ``embed_text`` (Wan's
``text_embedding`` MLP) followed by :func:`ardiff_modules.populate_cross_attention`, which runs each
block's K/V projection and publishes the "text" cache of one branch for all layers at once.

Weights
-------
**No weights are downloadable from here**: models are randomly initialised from a seed
(:func:`build_model`), which is all the examples and tests need. To run a real checkpoint, build the
model with the matching :class:`WanConfig` and load your own state dict::

    from ardiff_modules.convert import convert_wan_state_dict

    model = build_model(WanConfig.preset("wan2.1-1.3b"), device="cuda")
    # a checkpoint in Wan2.1's own key layout (blocks.N.self_attn.q, blocks.N.cross_attn.o, ...):
    state_dict = torch.load(path, map_location="cuda")
    model.load_state_dict(convert_wan_state_dict(state_dict, "wan", self_attn="attn", cross_attn="cross"))

Parameter names are Wan's (``patch_embedding``, ``text_embedding``, ``time_embedding``,
``time_projection``, ``blocks.N.{norm3, ffn, modulation}``, ``head.{head, modulation}``, and inside the
attention layers ``q``, ``k``, ``v``, ``o``, ``norm_q``, ``norm_k``: ``param_names="wan"``); only the
blocks' attention attributes are called ``attn`` / ``cross`` instead of ``self_attn`` / ``cross_attn``,
which :func:`ardiff_modules.convert.convert_wan_state_dict` renames. No weight is permuted: the 3-D RoPE
(:class:`~ardiff_modules.modules.rotary.VideoRotaryEmbedding`) pairs channels ``(2i, 2i + 1)`` exactly like
Wan's complex ``rope_apply``. Checkpoints of Self-Forcing & co. wrap the same keys (e.g. a ``model.``
prefix): strip it first. Equivalence is checked against a reference implementation of Wan's attention
and RoPE (tests/docs/test_examples.py, tests/integrations/test_convert.py), not against released weights.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ardiff_modules.context import LayerContext
from ardiff_modules.errors import TensorMismatchError
from ardiff_modules.modules import CachedCrossAttention, ChunkSelfAttention
from ardiff_modules.modules.rotary import VideoRotaryEmbedding
from ardiff_modules.spec import CrossAttentionSpec, KVCacheSpec, dtype_name

TEXT = "text"  #: name of the cross-attention cache
BRANCHES = ("cond", "uncond")  #: CFG branches, batched in one forward


# ---------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class WanConfig:
    """Geometry of the causal DiT and of its KV cache.

    ``latent_height`` / ``latent_width`` are the VAE latent size *before* patching; one latent frame
    becomes ``(latent_height // 2) * (latent_width // 2)`` tokens with the default (1, 2, 2) patch.
    """

    name: str
    num_layers: int
    dim: int
    num_heads: int
    ffn_dim: int
    latent_height: int
    latent_width: int
    text_tokens: int
    text_dim: int
    in_channels: int = 16
    out_channels: int = 16
    patch_size: tuple[int, int, int] = (1, 2, 2)
    freq_dim: int = 256
    frames_per_chunk: int = 3
    sink_chunks: int = 1
    window_chunks: int = 2
    page_size: int | None = None  #: tokens per KV page; ``None`` = one latent frame
    eps: float = 1e-6
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.dim % self.num_heads:
            raise ValueError(f"WanConfig.dim: expected a multiple of num_heads={self.num_heads}, got {self.dim}")
        if self.patch_size[0] != 1:
            raise ValueError(f"WanConfig.patch_size: expected a temporal patch of 1 (causal chunks), got {self.patch_size}")
        if self.latent_height % self.patch_size[1] or self.latent_width % self.patch_size[2]:
            raise ValueError(
                f"WanConfig: latent {self.latent_height}x{self.latent_width} is not divisible by the patch "
                f"{self.patch_size[1:]}"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def grid_height(self) -> int:
        return self.latent_height // self.patch_size[1]

    @property
    def grid_width(self) -> int:
        return self.latent_width // self.patch_size[2]

    @property
    def tokens_per_frame(self) -> int:
        return self.grid_height * self.grid_width

    @property
    def chunk_size(self) -> int:
        """Tokens per autoregressive chunk (``frames_per_chunk`` latent frames)."""
        return self.frames_per_chunk * self.tokens_per_frame

    @property
    def kv_page_size(self) -> int:
        return self.page_size if self.page_size is not None else self.tokens_per_frame

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> WanConfig:  # (each field's own type: replace checks names)
        """One of :data:`PRESETS` (``"tiny"``, ``"wan2.1-1.3b"``), optionally with fields overridden."""
        try:
            config = PRESETS[name]
        except KeyError:
            raise ValueError(f"WanConfig.preset: expected one of {sorted(PRESETS)}, got {name!r}") from None
        return replace(config, **overrides) if overrides else config


PRESETS: dict[str, WanConfig] = {
    # CPU default: 16 tokens per frame (8x8 latent, 2x2 patches), 48-token chunks, a 2-chunk window.
    "tiny": WanConfig(
        name="tiny", num_layers=2, dim=64, num_heads=4, ffn_dim=256, latent_height=8, latent_width=8,
        text_tokens=8, text_dim=32, freq_dim=64, sink_chunks=1, window_chunks=2,
    ),
    # Wan2.1-T2V-1.3B at 480x832: 60x104 latents -> 30x52 = 1560 tokens per latent frame, 4680 per chunk.
    # Sink 1 + window 6 chunks = Self-Forcing's local_attn_size 21 frames with 3 frames per chunk
    # (DESIGN.md section 1: window = 21 / 3 - 1 - 1). Pages of 120 tokens (39 per chunk).
    "wan2.1-1.3b": WanConfig(
        name="wan2.1-1.3b", num_layers=30, dim=1536, num_heads=12, ffn_dim=8960, latent_height=60,
        latent_width=104, text_tokens=512, text_dim=4096, freq_dim=256, sink_chunks=1, window_chunks=6,
        page_size=120,
    ),
    # Wan-14B-like attention shape for launch-overhead measurements (benchmarks only, CUDA): 40 heads of
    # 128 (dim 5120, Wan2.1-14B's width), 880-token chunks (one 44x80 latent frame), sink 1 + window 7,
    # pages of 80 tokens; 10 blocks instead of 40 so random weights fit next to the baselines' buffers.
    "wan14b-like": WanConfig(
        name="wan14b-like", num_layers=10, dim=5120, num_heads=40, ffn_dim=13824, latent_height=44,
        latent_width=80, frames_per_chunk=1, text_tokens=512, text_dim=4096, freq_dim=256, sink_chunks=1,
        window_chunks=7, page_size=80,
    ),
}


def default_dtype(device: torch.device | str) -> torch.dtype:
    """float32 on CPU, bfloat16 on CUDA (the model and the KV pool use the same dtype)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


@contextlib.contextmanager
def torch_threads(requested: int | None, preset: str, device: str) -> Iterator[None]:
    """Run with ``requested`` torch intra-op CPU threads, restoring the previous count on exit.

    Default (``None``): 1 for the tiny preset on CPU, whose small ops only lose to threading
    overhead; torch's own count otherwise.
    """
    threads = 1 if requested is None and preset == "tiny" and device == "cpu" else requested
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def make_kv_spec(config: WanConfig, device: torch.device | str = "cpu", branches: Sequence[str] = BRANCHES) -> KVCacheSpec:
    """The :class:`KVCacheSpec` matching ``config``: one KV layer per block, a ``"text"`` cross cache."""
    dtype = dtype_name(default_dtype(device))  # the spec's field holds the name (it takes torch dtypes too)
    return KVCacheSpec(
        num_layers=config.num_layers,
        num_kv_heads=config.num_heads,
        num_qo_heads=config.num_heads,
        head_dim=config.head_dim,
        chunk_size=config.chunk_size,
        page_size=config.kv_page_size,
        sink_chunks=config.sink_chunks,
        window_chunks=config.window_chunks,
        branches=tuple(branches),
        cross_attention=(CrossAttentionSpec(TEXT, config.text_tokens),),
        dtype=dtype,
    )


def kv_pool_pages(spec: KVCacheSpec, *, streams: int | None = None, pending_chunks: int = 1, slack_chunks: int = 1) -> int:
    """Pages for one session: per branch (sinks + window + pending) chunks, plus ``slack_chunks`` spare chunks.

    ``spec.pages_per_branch`` is the peak a branch holds once its window is full (or, with contiguous
    extents on FlashInfer, what it reserves up front).
    """
    streams = len(spec.branches) if streams is None else streams
    per_branch = spec.pages_per_branch(pending_chunks)
    if per_branch is None:
        raise ValueError("kv_pool_pages: expected a bounded window (window_chunks), got None")
    return streams * per_branch + slack_chunks * spec.pages_per_chunk


# ----------------------------------------------------------------------------------------- model
def sinusoidal_embedding(dim: int, timesteps: torch.Tensor) -> torch.Tensor:
    """Wan's 1-D sinusoidal embedding: ``[N]`` -> ``[N, dim]`` as ``cat(cos, sin)`` (float32)."""
    half = dim // 2
    freqs = torch.pow(10000.0, -torch.arange(half, device=timesteps.device, dtype=torch.float32) / half)
    angles = timesteps.float()[:, None] * freqs[None]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


class WanCausalBlock(nn.Module):
    """One Wan attention block with the library's cached attention layers."""

    def __init__(self, config: WanConfig) -> None:
        super().__init__()
        dim, eps = config.dim, config.eps
        self.norm1 = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.attn = ChunkSelfAttention(dim, config.num_heads, qk_norm="full", eps=eps, param_names="wan")
        self.norm3 = nn.LayerNorm(dim, eps=eps, elementwise_affine=True)  # Wan: cross_attn_norm=True
        self.cross = CachedCrossAttention(dim, config.num_heads, TEXT, qk_norm="full", eps=eps, param_names="wan")
        self.norm2 = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(dim, config.ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(config.ffn_dim, dim))
        self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    def forward(
        self, x: torch.Tensor, e0: torch.Tensor, kv: LayerContext, rope: nn.Module,
        token_frames: torch.Tensor | None = None, context: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x`` ``[S, N, dim]``; ``e0`` ``[S, F, 6, dim]`` (per-frame modulation) -> ``[S, N, dim]``.

        ``token_frames`` ``[N]`` (int64): the frame of each token of ``x`` when ``x`` is not whole frames
        (a sequence-parallel rank's block of tokens); ``None``: ``x`` is all ``F`` frames in order.
        ``context`` ``[S or 1, tokens, dim]``: the embedded text, projected live by the cross-attention when
        it trains (see :meth:`CachedCrossAttention.forward`); ``None``: the published cache.
        """
        s, n, d = x.shape
        frames = e0.shape[1]
        shift1, scale1, gate1, shift2, scale2, gate2 = (self.modulation[:, None] + e0).unbind(dim=2)  # [S, F, dim]
        modulate, gated = _modulation(s, n, d, frames, token_frames)

        x = x + gated(self.attn(modulate(self.norm1(x), shift1, scale1), kv, rope), gate1)
        x = x + (self.cross(self.norm3(x), kv) if context is None else self.cross(self.norm3(x), kv, context=context))
        return x + gated(self.ffn(modulate(self.norm2(x), shift2, scale2)), gate2)


def _modulation(s: int, n: int, d: int, frames: int, token_frames: torch.Tensor | None) -> tuple[Callable, Callable]:
    """``modulate(h, shift, scale)`` and ``gated(h, gate)`` for ``h`` ``[S, N, d]`` and per-frame ``[S, F, d]``
    factors: by a view over whole frames, or (``token_frames``) by each token's frame."""
    if token_frames is None:
        def modulate(h: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return (h.view(s, frames, -1, d) * (1 + scale[:, :, None]) + shift[:, :, None]).view(s, n, d)

        def gated(h: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
            return (h.view(s, frames, -1, d) * gate[:, :, None]).view(s, n, d)
    else:
        def modulate(h: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return h * (1 + scale[:, token_frames]) + shift[:, token_frames]

        def gated(h: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
            return h * gate[:, token_frames]
    return modulate, gated


class WanHead(nn.Module):
    """Final modulated norm and projection to ``prod(patch) * out_channels`` per token."""

    def __init__(self, config: WanConfig) -> None:
        super().__init__()
        dim = config.dim
        self.norm = nn.LayerNorm(dim, eps=config.eps, elementwise_affine=False)
        self.head = nn.Linear(dim, math.prod(config.patch_size) * config.out_channels)
        self.modulation = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)

    def forward(self, x: torch.Tensor, e: torch.Tensor, token_frames: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[S, N, dim]``, ``e`` ``[S, F, dim]`` -> ``[S, N, prod(patch) * C]`` (``token_frames`` as in
        :class:`WanCausalBlock`)."""
        s, n, d = x.shape
        shift, scale = (self.modulation[:, None] + e[:, :, None]).unbind(dim=2)  # [S, F, dim]
        modulate, _ = _modulation(s, n, d, e.shape[1], token_frames)
        return self.head(modulate(self.norm(x), shift, scale))


class WanCausalDiT(nn.Module):
    """Wan2.1-style causal video DiT over the paged KV cache.

    ``forward(latents, timestep, layers)``:

    latents:
        ``[S, F, C, H, W]`` noisy latent frames of the current chunk(s), one row per stream
        (e.g. CFG's ``("cond", "uncond")`` batched in one forward). ``F`` must be a multiple of
        ``frames_per_chunk`` and ``S`` the number of streams of the forward context.
    timestep:
        ``[S]`` (one timestep per stream) or ``[S, F]`` (per frame, as Self-Forcing's diffusion
        forcing); values in ``[0, 1000]``, a tensor (a Python float would specialise a compiled graph).
    layers:
        ``ForwardContext.layers`` of a ``prepare_forward`` over those streams, one per block.
    run_block:
        how each block is called: ``run_block(block, x, e0, kv, rope, token_frames)`` -> ``x`` (and
        ``context=`` with ``text``); ``None`` calls the block. Training passes
        :meth:`ardiff_modules.TrainingScope.checkpoint` to recompute every block in the backward instead of
        keeping its activations (``examples/training_rollout.py --checkpoint``).
    text:
        The text-encoder states (``[tokens, text_dim]`` or ``[S, tokens, text_dim]``) when the text embedding
        and the cross-attention K/V should train: forwards with gradients embed and project them live (see
        :meth:`live_context`); forwards without read the published cache (the text is unused).

    Returns the flow prediction ``[S, F, C_out, H, W]`` (float, the model's dtype).
    """

    def __init__(self, config: WanConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.dim
        self.patch_embedding = nn.Conv3d(config.in_channels, dim, kernel_size=config.patch_size, stride=config.patch_size)
        self.text_embedding = nn.Sequential(nn.Linear(config.text_dim, dim), nn.GELU(approximate="tanh"), nn.Linear(dim, dim))
        self.time_embedding = nn.Sequential(nn.Linear(config.freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.blocks = nn.ModuleList(WanCausalBlock(config) for _ in range(config.num_layers))
        self.head = WanHead(config)
        self.rope = VideoRotaryEmbedding(config.head_dim, config.grid_height, config.grid_width, theta=config.rope_theta)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Wan's initialisation, except the output head (Wan zeroes it; a random demo model then does nothing)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        nn.init.xavier_uniform_(self.patch_embedding.weight.flatten(1))
        for seq in (self.text_embedding, self.time_embedding):
            for module in seq:
                if isinstance(module, nn.Linear):
                    nn.init.normal_(module.weight, std=0.02)

    # ---------------------------------------------------------------- conditioning
    def embed_text(self, text: torch.Tensor) -> torch.Tensor:
        """Text-encoder states ``[tokens, text_dim]`` -> cross-attention context ``[tokens, dim]``.

        Publish it per branch with
        ``populate_cross_attention(state, branch, [b.cross for b in model.blocks], model.embed_text(text))``.
        """
        if text.dim() != 2 or text.shape[-1] != self.config.text_dim:
            raise TensorMismatchError(
                f"embed_text: expected [tokens, {self.config.text_dim}], got {tuple(text.shape)}"
            )
        return self.text_embedding(text.to(self.patch_embedding.weight.dtype))

    def live_context(self, text: torch.Tensor | None) -> torch.Tensor | None:
        """In a forward with gradients, ``text`` (``[tokens, text_dim]`` shared by the streams, or ``[S, tokens,
        text_dim]``) embedded live -> ``[1 or S, tokens, dim]`` for the blocks' cross-attention to project (the
        text embedding and cross K/V then train, as Self-Forcing's checkpointed blocks recompute them); ``None``
        without ``text`` or without grad mode (the published cache serves, as in inference)."""
        if text is None or not torch.is_grad_enabled():
            return None
        rows = text if text.dim() == 3 else text[None] if text.dim() == 2 else None
        if rows is None or rows.shape[-1] != self.config.text_dim:
            raise TensorMismatchError(
                f"WanCausalDiT text: expected [tokens, {self.config.text_dim}] or [streams, tokens, "
                f"{self.config.text_dim}], got {tuple(text.shape)}"
            )
        return self.text_embedding(rows.to(self.patch_embedding.weight.dtype))

    # ---------------------------------------------------------------- patches
    def patchify(self, latents: torch.Tensor) -> torch.Tensor:
        """``[S, F, C, H, W]`` -> tokens ``[S, F * h * w, dim]`` (frame-major, then row, column)."""
        x = self.patch_embedding(latents.transpose(1, 2))  # [S, dim, F, h, w]
        return x.flatten(2).transpose(1, 2)

    def unpatchify(self, tokens: torch.Tensor, frames: int) -> torch.Tensor:
        """``[S, F * h * w, ph * pw * C]`` -> ``[S, F, C, H, W]`` (Wan's channel order ``(p, q, r, c)``)."""
        c = self.config
        _, ph, pw = c.patch_size
        s = tokens.shape[0]
        u = tokens.view(s, frames, c.grid_height, c.grid_width, ph, pw, c.out_channels)
        u = u.permute(0, 1, 6, 2, 4, 3, 5)  # [S, F, C, h, ph, w, pw]
        return u.reshape(s, frames, c.out_channels, c.grid_height * ph, c.grid_width * pw)

    # ---------------------------------------------------------------- forward
    def forward(
        self, latents: torch.Tensor, timestep: torch.Tensor, layers: Sequence[LayerContext],
        run_block: Callable[..., torch.Tensor] | None = None, text: torch.Tensor | None = None,
    ) -> torch.Tensor:
        c = self.config
        context = self.live_context(text)
        if latents.dim() != 5 or tuple(latents.shape[2:]) != (c.in_channels, c.latent_height, c.latent_width):
            raise TensorMismatchError(
                f"WanCausalDiT latents: expected [streams, frames, {c.in_channels}, {c.latent_height}, "
                f"{c.latent_width}], got {tuple(latents.shape)}"
            )
        if len(layers) != len(self.blocks):
            raise TensorMismatchError(f"WanCausalDiT layers: expected {len(self.blocks)} layer contexts, got {len(layers)}")
        s, frames = latents.shape[:2]
        if timestep.dim() == 1 and timestep.shape[0] == s:
            timestep = timestep[:, None].expand(s, frames)
        if tuple(timestep.shape) != (s, frames):
            raise TensorMismatchError(
                f"WanCausalDiT timestep: expected [{s}] or [{s}, {frames}], got {tuple(timestep.shape)}"
            )
        dtype = self.patch_embedding.weight.dtype
        x = self.patchify(latents.to(dtype))
        t = sinusoidal_embedding(c.freq_dim, timestep.reshape(-1)).to(dtype)
        e = self.time_embedding(t)  # [S*F, dim]
        e0 = self.time_projection(e).view(s, frames, 6, c.dim)
        e = e.view(s, frames, c.dim)
        sp = self.sequence_parallel
        token_frames = None
        if sp is not None:  # Ulysses: this rank runs its contiguous block of tokens through the blocks
            x = sp.shard_tokens(x, dim=1)
            token_frames = sp.shard_tokens(torch.arange(frames * c.tokens_per_frame, device=x.device) // c.tokens_per_frame, dim=0)
        for block, kv in zip(self.blocks, layers):
            if context is not None:  # training the text: every block projects it live
                x = (block if run_block is None else functools.partial(run_block, block))(
                    x, e0, kv, self.rope, token_frames, context=context
                )
            elif run_block is None:
                x = block(x, e0, kv, self.rope, token_frames)
            else:  # e.g. TrainingScope.checkpoint: the block is recomputed in the backward
                x = run_block(block, x, e0, kv, self.rope, token_frames)
        x = self.head(x, e, token_frames)
        if sp is not None:
            x = sp.gather_tokens(x, dim=1)  # every rank returns the whole chunk
        return self.unpatchify(x, frames)

    @property
    def sequence_parallel(self) -> Any:
        """The Ulysses group the attention layers were given by ``ardiff_modules.distributed.parallelize``
        (``None``: single process). With it, ``forward`` takes and returns whole chunks like without, and
        runs only this rank's ``1 / P`` of the tokens through the blocks."""
        # getattr: a baseline may swap the attention layers for ones without the hook (benchmarks' rolling buffers)
        return getattr(self.blocks[0].attn, "sequence_parallel", None) if len(self.blocks) else None


def build_model(
    config: WanConfig | str = "tiny",
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> WanCausalDiT:
    """A randomly initialised :class:`WanCausalDiT` (deterministic for a seed), in eval mode.

    Parameters are created directly on ``device`` and cast to ``dtype`` (default
    :func:`default_dtype`: float32 on CPU, bfloat16 on CUDA, matching :func:`make_kv_spec`).
    The global RNG is left untouched.
    """
    if isinstance(config, str):
        config = WanConfig.preset(config)
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), torch.device(device):
        torch.manual_seed(seed)
        model = WanCausalDiT(config)
    return model.to(dtype).eval().requires_grad_(False)
