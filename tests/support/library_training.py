"""The library's reference model (``WanCausalDiT``) as the generator of Self-Forcing's training rollout.

:class:`LibraryGenerator` takes ``DiffusionWrapper``'s call (``noisy [B, F, C, H, W], conditional_dict, timestep
[B, F], kv_cache, crossattn_cache, current_start -> (flow, x0)``) so that the re-stated
``SelfForcingTrainingPipeline`` (``tests/support/self_forcing_training.py``) drives it unedited: one session whose
branches are the batch rows, the prompt published once per rollout (``populate_cross_attention``) and, in forwards
with gradients, embedded and projected live (``WanCausalDiT.forward(text=...)``, as upstream's checkpointed
blocks); the forwards bound the way ``integrations.self_forcing`` binds upstream's (a re-run of the open chunk
aborts and reopens it, the next chunk commits it, ``current_start=0`` starts a video); every block under
``scope.checkpoint`` when checkpointing. ``kv_cache`` / ``crossattn_cache`` are ignored.
"""

from __future__ import annotations

from typing import Any

import torch

import ardiff_modules as am
from ardiff_modules.models.wan_causal_dit import TEXT, WanCausalDiT, build_model
from tests.support.self_forcing_pipeline import FlowMatchScheduler, SelfForcingModel


def library_twin(upstream: SelfForcingModel) -> WanCausalDiT:
    """A ``WanCausalDiT`` of the same config holding ``upstream``'s weights (renamed: ``self_attn`` -> ``attn``,
    ``cross_attn`` -> ``cross``, ``head`` -> ``head.head``, ``head_modulation`` -> ``head.modulation``)."""
    model = build_model(upstream.config)
    renamed = {}
    for name, value in upstream.state_dict().items():
        name = name.replace(".self_attn.", ".attn.").replace(".cross_attn.", ".cross.")
        name = {"head.weight": "head.head.weight", "head.bias": "head.head.bias",
                "head_modulation": "head.modulation"}.get(name, name)
        renamed[name] = value
    model.load_state_dict(renamed, strict=True)
    return model.train().requires_grad_(True)


def upstream_name(name: str) -> str:
    """A ``WanCausalDiT`` parameter's name in upstream's model."""
    name = name.replace(".attn.", ".self_attn.").replace(".cross.", ".cross_attn.")
    return {"head.head.weight": "head.weight", "head.head.bias": "head.bias",
            "head.modulation": "head_modulation"}.get(name, name)


class LibraryGenerator:
    """``WanDiffusionWrapper``'s call over the library's model and cache (see the module docstring)."""

    def __init__(self, model: WanCausalDiT, scheduler: FlowMatchScheduler, spec: am.KVCacheSpec, num_pages: int,
                 *, history_grad: str = "straight_through", checkpoint: bool = False) -> None:
        self.model, self.scheduler, self.checkpoint = model, scheduler, checkpoint
        self.cache = am.KVCache(spec, num_pages=num_pages, backend="reference")
        self.state = self.cache.open_session()
        self.branches = spec.branches
        self.scope = am.TrainingScope(self.cache, history_grad=history_grad)  # type: ignore[arg-type]
        self.open: tuple[int, int, am.ForwardContext] | None = None  # (start, tokens, forward)
        self.text: torch.Tensor | None = None

    def __enter__(self) -> LibraryGenerator:
        self.scope.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.scope.close()
        self.cache.close()

    def __call__(self, noisy_image_or_video: torch.Tensor, conditional_dict: dict[str, torch.Tensor],
                 timestep: torch.Tensor, kv_cache: Any, crossattn_cache: Any,
                 current_start: int) -> tuple[torch.Tensor, torch.Tensor]:
        text = conditional_dict["prompt_embeds"]  # padded with zeros to text_len, as upstream's model pads it
        text = torch.cat([text, text.new_zeros(text.shape[0], self.model.config.text_tokens - text.shape[1],
                                               text.shape[2])], dim=1)
        tokens = noisy_image_or_video.shape[1] * self.model.config.tokens_per_frame
        fwd = self._bind(current_start, tokens, text)
        run_block = self.scope.checkpoint if self.checkpoint and torch.is_grad_enabled() else None
        flow = self.model(noisy_image_or_video, timestep.float(), fwd.layers, run_block=run_block, text=text)
        return flow, self.scheduler_x0(noisy_image_or_video, timestep, flow)

    def scheduler_x0(self, noisy: torch.Tensor, timestep: torch.Tensor, flow: torch.Tensor) -> torch.Tensor:
        """``x0 = x_t - sigma * flow`` in float64, per frame (``DiffusionWrapper.to_x0``)."""
        sigma = self.scheduler.sigma(timestep.flatten()).reshape(-1, 1, 1, 1)
        x0 = noisy.flatten(0, 1).double() - sigma * flow.flatten(0, 1).double()
        return x0.to(flow.dtype).unflatten(0, flow.shape[:2])

    def _bind(self, start: int, tokens: int, text: torch.Tensor) -> am.ForwardContext:
        if self.open is not None and start == self.open[0]:
            self.open[2].abort()  # a re-run of the open chunk: the last overwrite wins
        elif self.open is not None and start == self.open[0] + self.open[1]:
            self.open[2].commit()  # the open forward was the chunk's clean re-run
        else:
            assert start == 0, f"a new video starts at 0, got {start}"
            if self.open is not None:
                self.open[2].abort()
            self.state.reset()
            with torch.no_grad():
                blocks = [b.cross for b in self.model.blocks]
                for branch, row in zip(self.branches, text):
                    am.populate_cross_attention(self.state, branch, blocks, self.model.embed_text(row))
        fwd = self.state.prepare_forward(self.branches, tokens, commit_current=True)
        self.open = (start, tokens, fwd)
        return fwd


def library_spec(config: Any, *, batch: int, local_attn_size: int, frames_per_chunk: int = 3) -> am.KVCacheSpec:
    """The spec of upstream's training buffer (no sink; ``local_attn_size`` frames, current chunk counted; -1 global)."""
    policy = am.SinkWindowPolicy.from_frames(sink_size=0, local_attn_size=local_attn_size,
                                             frames_per_chunk=frames_per_chunk)
    return am.KVCacheSpec(
        num_layers=config.num_layers, num_kv_heads=config.num_heads, head_dim=config.head_dim,
        chunk_size=frames_per_chunk * config.tokens_per_frame, page_size=config.tokens_per_frame,
        sink_chunks=policy.sink_chunks, window_chunks=policy.window_chunks,
        branches=tuple(f"video{i}" for i in range(batch)), dtype="float32",
        cross_attention=(am.CrossAttentionSpec(TEXT, config.text_tokens),),
    )
