"""CausVid through ``integrations.self_forcing`` (issue 43, item 4).

CausVid's model and ``InferencePipeline`` loop, re-stated in ``tests/support/causvid_pipeline.py`` (its
self-attention writing ``[current_start, current_end)`` of a fixed buffer and attending ``[:current_end]``,
``current_end`` passed where Self-Forcing passes ``cache_start``, buffers reused as they are by a second video,
``start_latents``), run unchanged over that attention and over the library's layers: latents equal to 1e-5.
"""

from __future__ import annotations

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.integrations.self_forcing import swap_self_attention
from tests.support.causvid_pipeline import TINY, CausVidInferencePipeline, build_causvid, causvid_twin

ATOL = 1e-5
PER_FRAME = TINY.tokens_per_frame


def global_spec(frames_per_block: int, batch: int, **kw: object) -> am.KVCacheSpec:
    return am.KVCacheSpec(
        num_layers=TINY.num_layers, num_kv_heads=TINY.num_heads, head_dim=TINY.head_dim,
        chunk_size=frames_per_block * PER_FRAME, page_size=PER_FRAME, branches=("video0", "video1")[:batch],
        dtype="float32", **kw,  # type: ignore[arg-type]
    )


def run(pipeline: CausVidInferencePipeline, noise: torch.Tensor, text: torch.Tensor,
        start_latents: torch.Tensor | None = None) -> torch.Tensor:
    with torch.random.fork_rng():
        torch.manual_seed(5)
        return pipeline.inference(noise, text, start_latents)


def latents(batch: int, frames: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, frames, TINY.in_channels, TINY.latent_height, TINY.latent_width, generator=g)


@pytest.mark.parametrize(("frames_per_block", "batch", "extend"), [(3, 1, False), (3, 1, True), (1, 2, False)])
def test_causvid_over_the_library_equals_upstream_for_two_videos(frames_per_block, batch, extend):
    upstream = build_causvid(frames_per_block=frames_per_block)
    ours = causvid_twin(upstream)
    session = swap_self_attention(ours.generator.model, global_spec(frames_per_block, batch), num_pages=64)
    text = torch.randn(batch, 4, TINY.text_dim, generator=torch.Generator().manual_seed(2))
    for video in range(2):  # the second reuses upstream's buffers as they are: it starts again at 0
        noise = latents(batch, 3 * frames_per_block, 10 + video)
        start = latents(batch, frames_per_block, 20 + video) if extend else None
        want, got = run(upstream, noise, text, start), run(ours, noise, text, start)
        assert (got - want).abs().max().item() < ATOL
    session.finish()
    assert session.committed_tokens == 3 * frames_per_block * PER_FRAME  # the second video's chunks only
    session.close()


def test_a_causvid_spec_with_a_window_is_refused_as_not_its_global_attention():
    ours = build_causvid(frames_per_block=1)
    swap_self_attention(ours.generator.model, global_spec(1, 1, window_chunks=2, sink_chunks=1), num_pages=64)
    with pytest.raises(am.SpecError, match=r"sink_size=0, local_attn_size=-1 frames"):
        run(ours, latents(1, 3, 1), torch.randn(1, 4, TINY.text_dim))
