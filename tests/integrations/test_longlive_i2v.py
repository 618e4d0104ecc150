"""LongLive 1.x image-to-video through ``integrations.longlive`` (issue 43 item 3).

LongLive 1.x's own pipelines take no ``initial_latent`` (NVlabs/LongLive ``v1.0``: ``CausalInferencePipeline.inference``
and ``InteractiveCausalInferencePipeline.inference`` generate ``F``-frame blocks from noise only); its model is
Self-Forcing's, and its pipeline class derives from Self-Forcing's ``CausalInferencePipeline``, whose
``inference(noise, prompts, initial_latent)`` with ``independent_first_frame`` is the image-to-video loop. So
LongLive 1.x image-to-video is that loop (re-stated in ``tests/support/self_forcing_pipeline.py``) over LongLive's
model (``tests/support/longlive_pipeline.py``), then a prompt switch (``_recache_after_switch``) and the next
chunks: upstream's buffers and the swapped layers under ``SinkWindowPolicy.from_frames(...,
independent_first_frame=True)`` and ``RecacheRule.longlive`` agree to 1e-5 (fp32). What is still refused says
which feature is missing: a moving sink (``global_sink=False``) once the window slid past a 1-frame sink, and
sinks longer than one chunk.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.integrations.longlive import LongLiveSession, swap_self_attention
from tests.support.longlive_pipeline import TINY, InteractiveCausalInferencePipeline, build_longlive, longlive_twin
from tests.support.self_forcing_pipeline import CausalInferencePipeline

ATOL = 1e-5
PER_FRAME = TINY.tokens_per_frame
F = 3


def i2v_pair(sink_size: int, local_attn_size: int, global_sink: bool, batch: int = 1, independent: bool = True
             ) -> tuple[InteractiveCausalInferencePipeline, InteractiveCausalInferencePipeline, LongLiveSession]:
    upstream = build_longlive(local_attn_size=local_attn_size, sink_size=sink_size, frames_per_block=F,
                              global_sink=global_sink)
    upstream.args = dataclasses.replace(upstream.args, independent_first_frame=independent)
    ours = longlive_twin(upstream)
    policy = am.SinkWindowPolicy.from_frames(sink_size=sink_size, local_attn_size=local_attn_size,
                                             frames_per_chunk=F, independent_first_frame=independent)
    spec = am.KVCacheSpec(
        num_layers=TINY.num_layers, num_kv_heads=TINY.num_heads, head_dim=TINY.head_dim, chunk_size=F * PER_FRAME,
        page_size=PER_FRAME, retention=policy, branches=("video0", "video1")[:batch], dtype="float32",
        recache=am.RecacheRule.longlive(global_sink=global_sink),
    )
    return upstream, ours, swap_self_attention(ours.generator.model, spec, num_pages=160)


def latents(batch: int, frames: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, frames, TINY.in_channels, TINY.latent_height, TINY.latent_width, generator=g)


def prompt(batch: int, seed: int) -> dict[str, torch.Tensor]:
    return {"prompt_embeds": torch.randn(batch, 4, TINY.text_dim, generator=torch.Generator().manual_seed(seed))}


def image_to_video_then_switch(pipeline: InteractiveCausalInferencePipeline, batch: int, frames: int,
                               image_frames: int, after: int) -> torch.Tensor:
    """The image-to-video loop, a prompt switch, then ``after`` more chunks (denoised, then their clean re-run);
    returns every latent the model produced."""
    with torch.random.fork_rng():
        torch.manual_seed(5)
        initial = latents(batch, image_frames, 3) if image_frames else None
        out = CausalInferencePipeline.inference(pipeline, latents(batch, frames, 1), prompt(batch, 2)["prompt_embeds"],
                                                initial)
        start, new = out.shape[1], prompt(batch, 7)
        pipeline._recache_after_switch(out, start, new)
        produced = [out]
        for chunk in range(after):
            denoised = pipeline._denoise(latents(batch, F, 9 + chunk), new, start * PER_FRAME)
            pipeline._generator(denoised, new, torch.zeros(batch, F, dtype=torch.int64), start * PER_FRAME)
            produced.append(denoised)
            start += F
    return torch.cat(produced, dim=1)


@pytest.mark.parametrize("global_sink", [True, False], ids=["global-sink", "moving-sink"])
@pytest.mark.parametrize(
    ("sink_size", "local_attn_size", "frames", "image_frames", "batch"),
    [
        pytest.param(1, 10, 0, 1, 1, id="switch-right-after-the-image"),
        pytest.param(1, 10, 3, 1, 1, id="switch-after-one-block"),
        pytest.param(1, 10, 9, 1, 2, id="switch-when-the-buffer-fills-batch-2"),
        pytest.param(0, -1, 6, 1, 1, id="global-attention"),
        pytest.param(1, 10, 12, 1, 1, id="switch-after-the-window-slid"),
        pytest.param(1, 10, 13, 0, 1, id="generated-first-frame-slid"),
    ],
)
def test_image_to_video_then_a_switch_equals_upstream(sink_size, local_attn_size, frames, image_frames, batch,
                                                      global_sink) -> None:
    upstream, ours, session = i2v_pair(sink_size, local_attn_size, global_sink, batch)
    slid = local_attn_size != -1 and image_frames + frames > local_attn_size
    if slid and not global_sink and sink_size:
        # LongLive moves its sink to the buffer's head: a full chunk into the 1-frame sink's slot.
        want = image_to_video_then_switch(upstream, batch, frames, image_frames, 2)
        with pytest.raises(am.SpecError, match=r"sinks of another length than the chunks, e\.g\. a 1-frame "
                                               r"image-to-video first chunk, cannot move"):
            image_to_video_then_switch(ours, batch, frames, image_frames, 2)
        assert want.isfinite().all()
        session.close()
        return
    want = image_to_video_then_switch(upstream, batch, frames, image_frames, 2)
    got = image_to_video_then_switch(ours, batch, frames, image_frames, 2)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < ATOL
    session.finish()
    first = session.state.history_chunks(session.branches[0])[0]
    assert len(first) == 1  # the 1-frame first chunk (one page) is the sink, or the oldest chunk
    session.close()


@pytest.mark.parametrize(("sink_size", "independent"), [(6, False), (4, True)], ids=["t2v-2-chunk-sink", "i2v-1+3"])
def test_sinks_longer_than_one_chunk_are_refused_naming_why(sink_size, independent) -> None:
    """Upstream's recomputes never write inside the sink region, so a sink chunk after chunk 0 keeps its first
    denoising forward's K/V: not what a cache committing the clean forward holds (they differ by ~1 here)."""
    with pytest.raises(am.SpecError, match=r"expected at most one sink chunk .* got sink_chunks=2: LongLive 1\.x "
                                           r"keeps a sink chunk after the first as its first denoising forward wrote"):
        i2v_pair(sink_size, 12 if not independent else 10, True, independent=independent)
