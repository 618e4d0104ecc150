"""Self-Forcing image-to-video through ``integrations.self_forcing`` (issue 43, item 2).

Upstream's ``CausalInferencePipeline.inference(noise, prompts, initial_latent=...)`` and its
``independent_first_frame`` ``[1, F, F, ...]`` blocks, re-stated in ``tests/support/self_forcing_pipeline.py``,
run unchanged over upstream's rolling buffer and over the library's layers: the latents agree to 1e-5 (fp32)
with the image alone, the image and input blocks, input blocks only (video extension), a 1-frame first block
generated from noise, global attention and a window that slides past the image sink, batches of 1 and 2.
"""

from __future__ import annotations

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.integrations.self_forcing import swap_self_attention
from tests.support.self_forcing_pipeline import TINY, CausalInferencePipeline, build_pipeline, twin

ATOL = 1e-5
PER_FRAME = TINY.tokens_per_frame


def i2v_spec(frames_per_block: int, sink_size: int, local_attn_size: int, batch: int, independent: bool
             ) -> am.KVCacheSpec:
    policy = am.SinkWindowPolicy.from_frames(
        sink_size=sink_size, local_attn_size=local_attn_size, frames_per_chunk=frames_per_block,
        independent_first_frame=independent,
    )
    return am.KVCacheSpec(
        num_layers=TINY.num_layers, num_kv_heads=TINY.num_heads, head_dim=TINY.head_dim,
        chunk_size=frames_per_block * PER_FRAME, page_size=PER_FRAME, sink_chunks=policy.sink_chunks,
        window_chunks=policy.window_chunks, branches=("video0", "video1")[:batch], dtype="float32",
    )


def latents(batch: int, frames: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, frames, TINY.in_channels, TINY.latent_height, TINY.latent_width, generator=g)


def text_of(batch: int) -> torch.Tensor:
    return torch.randn(batch, 4, TINY.text_dim, generator=torch.Generator().manual_seed(2))


def run(pipeline: CausalInferencePipeline, noise: torch.Tensor, text: torch.Tensor,
        initial: torch.Tensor | None) -> torch.Tensor:
    with torch.random.fork_rng():
        torch.manual_seed(5)
        return pipeline.inference(noise, text, initial)


@pytest.mark.parametrize(
    ("sink_size", "local_attn_size", "independent", "input_frames", "frames", "batch"),
    [
        (0, -1, True, 1, 6, 1),     # the image alone, then two generated blocks (global attention)
        (0, -1, True, 4, 6, 1),     # the image and one input block
        (0, -1, False, 3, 6, 1),    # video extension: one input block of F frames
        (0, -1, True, 0, 7, 2),     # [1, 3, 3] from noise: the first block is one generated frame
        (1, 10, True, 1, 12, 1),    # the image is the sink; the window slides past it
        (1, 10, True, 0, 13, 2),    # the generated first frame is the sink; sliding; batch 2
    ],
)
def test_image_to_video_over_the_library_equals_upstream(sink_size, local_attn_size, independent, input_frames,
                                                         frames, batch):
    upstream = build_pipeline(local_attn_size=local_attn_size, sink_size=sink_size, frames_per_block=3,
                              independent_first_frame=independent)
    ours = twin(upstream)
    spec = i2v_spec(3, sink_size, local_attn_size, batch, independent)
    session = swap_self_attention(ours.generator.model, spec, num_pages=96)
    noise, text = latents(batch, frames, 1), text_of(batch)
    initial = latents(batch, input_frames, 3) if input_frames else None
    want = run(upstream, noise, text, initial)
    got = run(ours, noise, text, initial)
    assert got.shape == want.shape == (batch, input_frames + frames, *noise.shape[2:])
    assert (got - want).abs().max().item() < ATOL
    if initial is not None:
        assert torch.equal(got[:, :input_frames], initial)
    session.finish()
    assert session.committed_tokens == (input_frames + frames) * PER_FRAME
    state, first = session.state, session.branches[0]
    lengths = [len(c) for c in state.history_chunks(first)]
    if independent and spec.sink_chunks:
        assert lengths[0] == 1  # the 1-frame first chunk is the sink, one page of PER_FRAME tokens
    session.close()


def test_a_short_chunk_past_the_first_is_refused_naming_image_to_video():
    upstream = build_pipeline(local_attn_size=-1, sink_size=0, frames_per_block=3)
    ours = twin(upstream)
    session = swap_self_attention(ours.generator.model, i2v_spec(3, 0, -1, 1, False), num_pages=64)
    noise, text = latents(1, 3, 1), text_of(1)
    run(ours, noise, text, None)  # one full chunk, committed at the next forward
    before = session.committed_tokens
    with pytest.raises(am.errors.SequenceLengthError, match=r"image-to-video's independent first frame\), got 6 tokens at "
                                                     r"current_start=18"):
        ours._generator(noise[:, :1], {"prompt_embeds": text}, torch.zeros(1, 1, dtype=torch.int64), 3 * PER_FRAME)
    assert session.committed_tokens == before and session.forward is not None  # the open forward stays as it was
    session.close()


def test_the_window_check_knows_the_first_chunk_was_one_frame():
    """A spec made for text-to-video (``from_frames`` without ``independent_first_frame``) is refused on the first
    full chunk of an image-to-video run whose sink frames then cut differently."""
    upstream = build_pipeline(local_attn_size=10, sink_size=1, frames_per_block=3, independent_first_frame=True)
    ours = twin(upstream)
    wrong = am.KVCacheSpec(
        num_layers=TINY.num_layers, num_kv_heads=TINY.num_heads, head_dim=TINY.head_dim, chunk_size=3 * PER_FRAME,
        page_size=PER_FRAME, sink_chunks=0, window_chunks=2, branches=("video0",), dtype="float32",
    )
    swap_self_attention(ours.generator.model, wrong, num_pages=64)
    noise, text = latents(1, 6, 1), text_of(1)
    with pytest.raises(am.SpecError, match="after a 1-frame first chunk"):
        run(ours, noise, text, latents(1, 1, 3))
