"""LongLive 1.x's attention call and prompt-switch re-cache, drop-in (issue 43, item 3): ``integrations.longlive``.

LongLive's model and ``InteractiveCausalInferencePipeline`` are re-stated in ``tests/support/longlive_pipeline.py``
(its attention returning ``(x, (current_end, local_end_index, update))``, the updates applied after the last block,
``_recache_after_switch`` with ``sink_recache_after_switch``). The loop runs unchanged over that attention and over
the library's layers after ``swap_self_attention``: the latents must agree to 1e-5 (fp32) with switches after one
chunk, before the buffer fills, exactly when it fills and after it slid, ``global_sink`` both ways, batches of 1 and 2,
and global attention. Then the refusals.
"""

from __future__ import annotations

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.integrations.longlive import LongLiveSelfAttention, LongLiveSession, swap_self_attention
from ardiff_modules.integrations.self_forcing import swap_self_attention as swap_self_forcing
from tests.support.longlive_pipeline import TINY, InteractiveCausalInferencePipeline, build_longlive, longlive_twin
from tests.support.wan_rope import wan_freqs

ATOL = 1e-5
PER_FRAME = TINY.tokens_per_frame
BRANCHES = ("video0", "video1")


def make_spec(frames_per_block: int, sink_size: int, local_attn_size: int, batch: int, global_sink: bool,
              **kw: object) -> am.KVCacheSpec:
    """The spec equal to upstream's buffer (``from_frames``) and re-cache (``RecacheRule.longlive``)."""
    policy = am.SinkWindowPolicy.from_frames(
        sink_size=sink_size, local_attn_size=local_attn_size, frames_per_chunk=frames_per_block
    )
    fields: dict[str, object] = {
        "num_layers": TINY.num_layers, "num_kv_heads": TINY.num_heads, "head_dim": TINY.head_dim,
        "chunk_size": frames_per_block * PER_FRAME, "page_size": PER_FRAME, "sink_chunks": policy.sink_chunks,
        "window_chunks": policy.window_chunks, "branches": BRANCHES[:batch], "dtype": "float32",
        "recache": am.RecacheRule.longlive(global_sink=global_sink), **kw,
    }
    return am.KVCacheSpec(**fields)  # type: ignore[arg-type]


def pair(frames_per_block: int, sink_size: int, local_attn_size: int, batch: int, global_sink: bool,
         **swap: object) -> tuple[InteractiveCausalInferencePipeline, InteractiveCausalInferencePipeline, LongLiveSession]:
    """(upstream pipeline, swapped pipeline, its session) over the same random weights."""
    upstream = build_longlive(local_attn_size=local_attn_size, sink_size=sink_size, frames_per_block=frames_per_block,
                              global_sink=global_sink)
    ours = longlive_twin(upstream)
    spec = make_spec(frames_per_block, sink_size, local_attn_size, batch, global_sink)
    if spec.window_chunks is None:
        swap.setdefault("num_pages", 128)
    return upstream, ours, swap_self_attention(ours.generator.model, spec, **swap)  # type: ignore[arg-type]


def prompts(batch: int, count: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 4, TINY.text_dim, generator=g) for _ in range(count)]


def run(pipeline: InteractiveCausalInferencePipeline, frames: int, batch: int, switches: list[int],
        seed: int = 5) -> torch.Tensor:
    """The loop's latents, with the noise and the re-noising draws seeded (the same on both sides)."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(batch, frames, TINY.in_channels, TINY.latent_height, TINY.latent_width, generator=g)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        video, latents = pipeline.inference(noise, text_prompts_list=prompts(batch, len(switches) + 1),
                                            switch_frame_indices=switches, return_latents=True)
    torch.testing.assert_close(video, (latents * 0.5 + 0.5).clamp(0, 1))  # the tuple return, as upstream
    return latents


# ------------------------------------------------------------------ upstream's loop, unchanged, both ways
CONFIGS = [
    # frames per block, sink_size, local_attn_size, batch, chunks, switch frames
    pytest.param(1, 1, 4, 1, 10, [1, 2, 4, 7], id="F1-sink-after-1-before-fill-filled-slid"),
    pytest.param(1, 1, 4, 2, 9, [3, 6], id="F1-sink-batch-2"),
    pytest.param(3, 3, 12, 1, 7, [6, 12, 16], id="F3-longlive-config"),
    pytest.param(1, 0, 3, 2, 8, [2, 5], id="F1-no-sink-batch-2"),
    pytest.param(1, 0, -1, 1, 6, [2, 4], id="F1-global-attention"),
]


@pytest.mark.parametrize("global_sink", [True, False], ids=["global-sink", "moving-sink"])
@pytest.mark.parametrize(("frames_per_block", "sink_size", "local_attn_size", "batch", "chunks", "switches"), CONFIGS)
def test_interactive_loop_over_the_swapped_layers_equals_upstream(
    frames_per_block: int, sink_size: int, local_attn_size: int, batch: int, chunks: int, switches: list[int],
    global_sink: bool,
) -> None:
    upstream, ours, session = pair(frames_per_block, sink_size, local_attn_size, batch, global_sink)
    frames = frames_per_block * chunks
    expected = run(upstream, frames, batch, switches)
    got = run(ours, frames, batch, switches)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert ours.forwards == upstream.forwards  # every re-cache forward ran on both sides
    # the tuple return's indices: upstream's dicts say where the stream is, as upstream's own updates do
    assert [int(c["global_end_index"]) for c in ours.kv_cache1] == [frames * PER_FRAME] * TINY.num_layers
    session.finish()
    for branch in session.branches:
        assert session.state.committed_chunks(branch) == chunks
    session.close()
    assert session.cache.is_closed


@pytest.mark.parametrize("rope_dtype", [torch.float64, torch.float32], ids=["upstream-float64", "library-float32"])
def test_rope_dtype_through_the_recache(rope_dtype: torch.dtype) -> None:
    """Upstream's float64 rotation (the default), re-cache forwards' rebuilt rows included: bit-equal to upstream
    on the CPU (asserted to 1e-6); the library's float32 rotation is an ulp per rotation away (measured 6.7e-6)."""
    upstream, ours, session = pair(3, 3, 12, 1, False, rope_dtype=rope_dtype)
    expected, got = run(upstream, 21, 1, [6, 12, 16]), run(ours, 21, 1, [6, 12, 16])
    torch.testing.assert_close(got, expected, atol=1e-6 if rope_dtype == torch.float64 else ATOL, rtol=0)
    assert session.rope_dtype == rope_dtype
    session.close()
    with pytest.raises(am.SpecError, match=r"rope_dtype: expected torch.float64 .* got torch.float16"):
        pair(1, 1, 4, 1, True, rope_dtype=torch.float16)


def test_two_videos_through_one_pipeline_equal_upstreams() -> None:
    """Each video gets new cache dicts: the session resets with them; an open re-cache is dropped too."""
    upstream, ours, session = pair(1, 1, 4, 1, True)
    for seed in (5, 6):
        torch.testing.assert_close(run(ours, 6, 1, [3], seed), run(upstream, 6, 1, [3], seed), atol=ATOL, rtol=0)
    assert session.committed_tokens == 5 * PER_FRAME  # the second video's chunks but the open last one
    session.close()


# ------------------------------------------------------------------ misuse
def _call(layers: list[LongLiveSelfAttention], start: int, frames: int, kv_cache: dict, batch: int = 1,
          sink_recache: bool = False) -> tuple[torch.Tensor, tuple]:
    """Every block's layer called directly, block 0 first, the way LongLive's blocks call them."""
    x = torch.randn(batch, frames * PER_FRAME, TINY.dim)
    grid = torch.tensor([[frames, TINY.grid_height, TINY.grid_width]] * batch)
    freqs = wan_freqs(TINY.head_dim, 1024)
    info: tuple = ()
    for layer in layers:
        x, info = layer(x, None, grid, freqs, None, kv_cache, start, None, sink_recache)
    return x, info


def _swapped(global_sink: bool = True, local_attn_size: int = 4, **swap: object):  # noqa: ANN202
    _, ours, session = pair(1, 1, local_attn_size, 1, global_sink, **swap)
    return [b.self_attn for b in ours.generator.model.blocks], session


def _state(session: LongLiveSession) -> tuple:
    return session.committed_tokens, session.current_start, session.state.history_chunks("video0")


def test_a_spec_without_longlives_recache_rule_is_refused_before_swapping() -> None:
    model = build_longlive(local_attn_size=4, sink_size=1, frames_per_block=1, global_sink=True).generator.model
    spec = make_spec(1, 1, 4, 1, True, recache=am.RecacheRule())
    with pytest.raises(am.SpecError, match=r"expected a spec with recache=RecacheRule.longlive\(global_sink=True\) "
                                           r"or .* got RecacheRule\(attention='block_causal'"):
        swap_self_attention(model, spec)
    assert not any(isinstance(b.self_attn, LongLiveSelfAttention) for b in model.blocks)  # the model as it was


def test_a_recache_over_the_wrong_frames_is_refused_naming_expected_and_actual() -> None:
    layers, session = _swapped()
    cache = {"global_end_index": torch.tensor([0])}
    for chunk in range(3):
        _, info = _call(layers, chunk * PER_FRAME, 1, cache)
    assert info == (3 * PER_FRAME, 3 * PER_FRAME, None)  # the tuple return: (current_end, local_end_index, None)
    before = _state(session)
    with pytest.raises(am.StreamPositionError, match=r"to end at token 18 \(where the next chunk starts\), got "
                                                     r"tokens \[0, 12\)"):
        _call(layers, 0, 2, cache)  # a re-cache must end where the next chunk starts
    with pytest.raises(am.StreamPositionError, match="end at token 18 .* over a kv_cache that was reset"):
        _call(layers, 0, 3, {"global_end_index": torch.tensor([0])})
    with pytest.raises(am.TensorMismatchError, match=r"expected \[1 \(one row per branch \('video0',\)\), seq_len"):
        _call(layers, 0, 3, cache, batch=2)
    with pytest.raises(am.SpecError, match=r"expected sink_recache_after_switch=False .* got True"):
        _call(layers, 0, 3, cache, sink_recache=True)  # the pipeline's global_sink is not the spec's
    assert _state(session) == before  # every refusal above changed nothing
    _call(layers, 0, 3, cache)  # the re-cache of frames 0..2, as the pipeline runs it
    assert session.rows is None and session.committed_tokens == 3 * PER_FRAME
    _call(layers, 3 * PER_FRAME, 1, cache)  # the next chunk commits it
    session.close()


def test_a_moving_sink_spec_refuses_a_pipeline_keeping_its_sink() -> None:
    layers, session = _swapped(global_sink=False)
    cache = {"global_end_index": torch.tensor([0])}
    for chunk in range(3):
        _call(layers, chunk * PER_FRAME, 1, cache)
    before = _state(session)
    with pytest.raises(am.SpecError, match=r"expected sink_recache_after_switch=True .*global_sink=False\)\), got False"):
        _call(layers, 0, 3, cache)
    assert _state(session) == before
    session.close()


def test_a_window_other_than_upstreams_buffer_is_refused_at_the_recache() -> None:
    """check_window=False runs a wider window on purpose; LongLive's re-cache frames then miss the moved sink."""
    model = build_longlive(local_attn_size=3, sink_size=1, frames_per_block=1, global_sink=False).generator.model
    session = swap_self_attention(model, make_spec(1, 1, 4, 1, False), check_window=False)  # upstream's: 3 frames
    layers = [b.self_attn for b in model.blocks]
    cache = {"global_end_index": torch.tensor([0])}
    for chunk in range(6):
        _call(layers, chunk * PER_FRAME, 1, cache)
    with pytest.raises(am.SpecError, match=r"expected the re-cache's chunks inside upstream's re-cache frames "
                                           r"\(tokens \[18, 36\)\), got a chunk at \[12, 18\)"):
        _call(layers, 3 * PER_FRAME, 3, cache, sink_recache=True)
    # the last chunk's clean forward was committed (LongLive applied it before the switch), the re-cache aborted
    assert session.forward is None and session.committed_tokens == 6 * PER_FRAME
    history = session.state.history_chunks("video0")
    assert session.state.pages_in_use() == sum(len(chunk) for chunk in history) == 3 * session.cache.spec.pages_per_chunk
    session.cache._allocator.check_invariants()
    session.close()


def test_a_longlive_layer_bound_to_a_self_forcing_session_is_refused() -> None:
    model = build_longlive(local_attn_size=4, sink_size=1, frames_per_block=1, global_sink=True).generator.model
    sf = swap_self_forcing(model, make_spec(1, 1, 4, 1, True))
    layer = LongLiveSelfAttention.from_wan(model.blocks[0].self_attn)
    layer.bind(sf, 0)
    with pytest.raises(am.SpecError, match="expected a layer bound to a LongLiveSession, got a SelfForcingSession"):
        _call([layer], 0, 1, {"global_end_index": torch.tensor([0])})
    sf.close()
