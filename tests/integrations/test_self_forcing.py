"""Self-Forcing's attention call, drop-in (issue 26, item 2): ``ardiff_modules.integrations.self_forcing``.

Self-Forcing's model and ``CausalInferencePipeline`` loop are re-stated in ``tests/support/self_forcing_pipeline.py``
(its rolling-buffer self-attention, ``crossattn_cache``, flow -> x0, denoising with re-noising, the clean
re-run at ``context_noise``). The loop runs unchanged over (a) that upstream attention and (b) the library's
layers after ``swap_self_attention``: the latents must agree to 1e-5 (fp32) through windows filling and
sliding, sinks of 0 / 1 chunk, 1 and 3 frames per chunk, global attention, batches of 1 and 2, and two videos
through one pipeline. Then the binding rule's bookkeeping and every misuse.
"""

from __future__ import annotations

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.integrations.self_forcing import (
    SelfForcingSelfAttention,
    UpstreamRotation,
    self_forcing_rope,
    swap_self_attention,
)
from tests.support.paths import DOCS
from tests.support.rolling_buffer import chunk_frames, visible_frames
from tests.support.self_forcing_pipeline import TINY, CausalInferencePipeline, build_pipeline, roll_and_write, twin
from tests.support.snippets import page_blocks
from tests.support.wan_rope import rope_apply, wan_freqs

ATOL = 1e-5
PER_FRAME = TINY.tokens_per_frame
BRANCHES = ("video0", "video1")
#: The guide page whose Self-Forcing block ``test_porting_guide_block_runs_over_the_restated_pipeline`` runs.
PORTING = DOCS / "guide" / "porting.md"


def make_spec(frames_per_block: int, sink_size: int, local_attn_size: int, batch: int, **kw: object) -> am.KVCacheSpec:
    """The spec equal to upstream's buffer (``from_frames``), one branch per batch row."""
    policy = am.SinkWindowPolicy.from_frames(
        sink_size=sink_size, local_attn_size=local_attn_size, frames_per_chunk=frames_per_block
    )
    fields: dict[str, object] = {
        "num_layers": TINY.num_layers, "num_kv_heads": TINY.num_heads, "head_dim": TINY.head_dim,
        "chunk_size": frames_per_block * PER_FRAME, "page_size": PER_FRAME, "sink_chunks": policy.sink_chunks,
        "window_chunks": policy.window_chunks, "branches": BRANCHES[:batch], "dtype": "float32", **kw,
    }
    return am.KVCacheSpec(**fields)  # type: ignore[arg-type]


def inputs(batch: int, frames: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(batch, frames, TINY.in_channels, TINY.latent_height, TINY.latent_width, generator=g)
    return noise, torch.randn(batch, 4, TINY.text_dim, generator=g)


def run(pipeline: CausalInferencePipeline, noise: torch.Tensor, text: torch.Tensor, seed: int = 5) -> torch.Tensor:
    """The loop, with the re-noising draws seeded (the same draws on both sides)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return pipeline.inference(noise, text)


def pair(frames_per_block: int, sink_size: int, local_attn_size: int, batch: int, **swap: object):  # noqa: ANN201
    """(upstream pipeline, swapped pipeline, its session) over the same random weights."""
    upstream = build_pipeline(local_attn_size=local_attn_size, sink_size=sink_size, frames_per_block=frames_per_block)
    ours = twin(upstream)
    spec = make_spec(frames_per_block, sink_size, local_attn_size, batch)
    if spec.window_chunks is None:
        swap.setdefault("num_pages", 64)
    session = swap_self_attention(ours.generator.model, spec, **swap)  # type: ignore[arg-type]
    return upstream, ours, session


# ------------------------------------------------------------------ the oracle's own buffer
@pytest.mark.parametrize(
    ("frames_per_block", "sink_size", "local_attn_size"), [(1, 0, 3), (1, 1, 4), (3, 3, 12), (3, 0, 9)]
)
def test_the_restated_buffer_holds_the_frames_of_the_rolling_buffer_rule(frames_per_block: int, sink_size: int,
                                                                        local_attn_size: int) -> None:
    """``roll_and_write`` (upstream's dict buffer) holds exactly ``visible_frames`` after every chunk, and a
    re-run of the same chunk changes nothing but its own slots."""
    chunks = chunk_frames(9, frames_per_block, independent_first_frame=False)
    expected = visible_frames(sink_size, local_attn_size, chunks)
    size = local_attn_size * PER_FRAME
    cache = {"k": torch.zeros(1, size, 1, 1), "v": torch.zeros(1, size, 1, 1),
             "global_end_index": torch.tensor([0]), "local_end_index": torch.tensor([0])}
    for frames, seen in zip(chunks, expected):
        start = frames.start * PER_FRAME
        label = torch.arange(start, start + len(frames) * PER_FRAME, dtype=torch.float32).view(1, -1, 1, 1) // PER_FRAME
        for rerun in (1, 2, 3):  # denoising steps, then the clean re-run, at one current_start
            keys, _ = roll_and_write(cache, label + 0.1 * rerun, label, start, sink_size * PER_FRAME, bounded=True)
        held = keys.flatten().floor().view(-1, PER_FRAME)[:, 0].long().tolist()
        assert held == seen, (frames, held, seen)
        # every resident token holds its chunk's last write (the clean re-run), not an earlier step's
        torch.testing.assert_close(keys.flatten() - keys.flatten().floor(), torch.full((keys.numel(),), 0.3))


def test_self_forcing_rope_is_causal_rope_apply() -> None:
    freqs = wan_freqs(TINY.head_dim, 1024)
    x = torch.randn(2, 3 * PER_FRAME, TINY.num_heads, TINY.head_dim, dtype=torch.float64)
    grid = (3, TINY.grid_height, TINY.grid_width)
    cos, sin = self_forcing_rope(freqs, grid, 7, device=x.device, dtype=torch.float64)
    ours = am.apply_rope(x, torch.zeros(2, x.shape[1], dtype=torch.long), (cos, sin))
    torch.testing.assert_close(ours, rope_apply(x, grid, freqs, start_frame=7), atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_upstream_rotation_is_causal_rope_apply_bit_for_bit(dtype: torch.dtype) -> None:
    """The integration's default rotation (``rope_dtype=torch.float64``) is upstream's ``rope_apply(x).type_as(x)``
    exactly, forward and backward (a float64 product rounded once); the library's float32 pair is not always."""
    freqs = wan_freqs(TINY.head_dim, 1024)
    grid = (3, TINY.grid_height, TINY.grid_width)
    x = torch.randn(2, 3 * PER_FRAME, TINY.num_heads, TINY.head_dim).to(dtype).requires_grad_(True)
    twin_x = x.detach().clone().requires_grad_(True)
    cos, sin = self_forcing_rope(freqs, grid, 7, device=x.device, dtype=torch.float64)
    ours = am.apply_rope(x, torch.zeros(2, x.shape[1], dtype=torch.long), UpstreamRotation(cos, sin))
    expected = rope_apply(twin_x, grid, freqs, start_frame=7).type_as(twin_x)
    assert ours.dtype == dtype and torch.equal(ours, expected)
    weights = torch.randn(x.shape).to(dtype)
    (ours * weights).sum().backward()
    (expected * weights).sum().backward()
    assert torch.equal(x.grad, twin_x.grad)
    if dtype == torch.float32:  # the float32 product is an ulp away somewhere: what the float64 one removes
        pair = self_forcing_rope(freqs, grid, 7, device=x.device, dtype=torch.float32)
        assert not torch.equal(am.apply_rope(x.detach(), torch.zeros(2, x.shape[1], dtype=torch.long), pair), expected)
    with pytest.raises(am.TensorMismatchError, match="expected float64 cos / sin .* got torch.float32"):
        UpstreamRotation(cos.float(), sin.float())


@pytest.mark.parametrize("rope_dtype", [torch.float64, torch.float32], ids=["upstream-float64", "library-float32"])
def test_rope_dtype_picks_the_rotation(rope_dtype: torch.dtype) -> None:
    """Both rotations run upstream's loop to 1e-5; the layers get an ``UpstreamRotation`` or a float32 pair."""
    upstream, ours, session = pair(3, 0, 9, 2, rope_dtype=rope_dtype)
    noise, text = inputs(2, 3 * 5)
    torch.testing.assert_close(run(ours, noise, text), run(upstream, noise, text), atol=ATOL, rtol=0)
    rope = session._open.rope if session._open is not None else None
    assert isinstance(rope, UpstreamRotation) == (rope_dtype == torch.float64)
    assert session.rope_dtype == rope_dtype
    session.close()
    for bad in (torch.bfloat16, "float64", None):
        with pytest.raises(am.SpecError, match=r"rope_dtype: expected torch.float64 .* or torch.float32 .*, got"):
            swap_self_attention(build_pipeline(local_attn_size=9, sink_size=0, frames_per_block=3).generator.model,
                                make_spec(3, 0, 9, 1), rope_dtype=bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------ upstream's loop, unchanged, both ways
CONFIGS = [
    pytest.param(1, 0, 3, 1, 10, id="F1-no-sink-window-slides"),
    pytest.param(1, 1, 4, 2, 9, id="F1-sink-1-chunk-batch-2"),
    pytest.param(3, 3, 12, 1, 8, id="F3-sink-1-chunk-window-slides"),
    pytest.param(3, 0, 9, 2, 8, id="F3-no-sink-batch-2"),
    pytest.param(3, 3, 30, 1, 8, id="F3-window-filling-only"),
    pytest.param(1, 0, -1, 1, 8, id="F1-global-attention"),
]


@pytest.mark.parametrize(("frames_per_block", "sink_size", "local_attn_size", "batch", "chunks"), CONFIGS)
def test_upstream_loop_over_the_swapped_layers_equals_upstream(frames_per_block: int, sink_size: int,
                                                             local_attn_size: int, batch: int, chunks: int) -> None:
    upstream, ours, session = pair(frames_per_block, sink_size, local_attn_size, batch)
    noise, text = inputs(batch, frames_per_block * chunks)
    expected = run(upstream, noise, text)
    got = run(ours, noise, text)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    # the last chunk's clean re-run is open until finish(); then the history is upstream's buffer in chunks
    assert session.current_start == (chunks - 1) * frames_per_block * PER_FRAME
    session.finish()
    spec = session.cache.spec
    for branch in spec.branches:
        assert session.state.committed_chunks(branch) == chunks
        resident = chunks if spec.window_chunks is None else min(chunks, spec.sink_chunks + spec.window_chunks)
        assert len(session.state.history_chunks(branch)) == resident
    session.close()
    assert session.cache.is_closed  # made by swap_self_attention from the spec: closed with the session


def test_two_videos_through_one_pipeline_equal_upstreams() -> None:
    """Upstream resets its caches between videos (new index tensors): the session resets with them."""
    upstream, ours, session = pair(3, 3, 12, 1)
    for seed in (1, 2):
        noise, text = inputs(1, 3 * 5, seed=seed)
        torch.testing.assert_close(run(ours, noise, text, seed), run(upstream, noise, text, seed), atol=ATOL, rtol=0)
    assert session.committed_tokens == 4 * 3 * PER_FRAME  # the second video's four committed chunks only
    session.close()


def test_one_model_forward_prepares_one_library_forward() -> None:
    """Host work once per model forward: one prepare_forward per generator call, whatever the blocks."""
    _, ours, session = pair(1, 0, 3, 1)
    prepared = []
    original = session.state.prepare_forward

    def counting(*args: object, **kwargs: object) -> am.ForwardContext:
        prepared.append(args)
        return original(*args, **kwargs)  # type: ignore[arg-type]

    session.state.prepare_forward = counting  # type: ignore[method-assign]
    run(ours, *inputs(1, 4))
    assert ours.forwards == 4 * (len(ours.denoising_step_list) + 1)
    assert len(prepared) == ours.forwards
    session.close()


def test_the_checkpoint_loads_unchanged() -> None:
    upstream, ours, session = pair(3, 3, 12, 1)
    before = upstream.generator.model.state_dict()
    after = ours.generator.model.state_dict()
    assert sorted(after) == sorted(before)  # the same keys (registration order aside)
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    assert all(isinstance(b.self_attn, SelfForcingSelfAttention) for b in ours.generator.model.blocks)
    ours.generator.model.load_state_dict(before, strict=True)
    session.close()


def _porting_block() -> str:
    """The porting guide's python block that swaps Self-Forcing's attention (a ``# fragment``: it needs their
    pipeline)."""
    blocks = [b.source for b in page_blocks(PORTING) if "swap_self_attention(pipeline.generator.model" in b.source]
    assert len(blocks) == 1, f"{PORTING}: expected one python block calling swap_self_attention(pipeline...), got {len(blocks)}"
    return blocks[0]


def test_porting_guide_block_runs_over_the_restated_pipeline() -> None:
    """The porting guide's Self-Forcing block, its sizes line swapped for the tiny model's, as written."""
    source = _porting_block()
    sizes = "blocks, heads, head_dim, frame_seq_length, frames_per_block = 30, 12, 128, 1560, 3"
    assert source.count(sizes) == 1, f"the block of {PORTING.name} no longer has its sizes line"
    tiny = f"{TINY.num_layers}, {TINY.num_heads}, {TINY.head_dim}, {PER_FRAME}, 3"
    source = source.replace(sizes, sizes.split(" = ")[0] + " = " + tiny)
    source = source.replace('"bfloat16"', '"float32"').replace("16 << 30", "1 << 20")
    upstream = build_pipeline(local_attn_size=-1, sink_size=0, frames_per_block=3)
    pipeline = twin(upstream)
    noise, text_embeds = inputs(1, 3 * 7)  # 21 frames, Self-Forcing's default length
    namespace = {"pipeline": pipeline, "noise": noise, "text_prompts": text_embeds, "am": am, "torch": torch}
    with torch.random.fork_rng():
        torch.manual_seed(5)
        exec(compile(source, "<docs/guide/porting.md: Self-Forcing>", "exec"), namespace)  # noqa: S102
    torch.testing.assert_close(namespace["video"], run(upstream, noise, text_embeds), atol=ATOL, rtol=0)


# ------------------------------------------------------------------ misuse
#: block 0's kv_cache dict of the direct calls below (one object: a new one would read as a reset)
KV_CACHE = {"global_end_index": torch.tensor([0])}


def _chunk_call(session_layers: list[SelfForcingSelfAttention], start: int, frames: int = 1, batch: int = 1,
                kv_cache: object = KV_CACHE) -> torch.Tensor:
    """Every block's layer called directly, block 0 first, the way the model calls them."""
    x = torch.randn(batch, frames * PER_FRAME, TINY.dim)
    grid = torch.tensor([[frames, TINY.grid_height, TINY.grid_width]] * batch)
    freqs = wan_freqs(TINY.head_dim, 1024)
    for layer in session_layers:
        x = layer(x, None, grid, freqs, None, kv_cache, start, None)
    return x


def _swapped(frames_per_block: int = 1, sink_size: int = 0, local_attn_size: int = 3, batch: int = 1):  # noqa: ANN202
    _, ours, session = pair(frames_per_block, sink_size, local_attn_size, batch)
    return [b.self_attn for b in ours.generator.model.blocks], session


def test_positions_that_do_not_continue_the_stream_are_refused() -> None:
    layers, session = _swapped()
    cache = {"global_end_index": torch.tensor([0])}
    _chunk_call(layers, 0, kv_cache=cache)
    _chunk_call(layers, 0, kv_cache=cache)  # a re-run: fine
    rerun_or_next = r"expected current_start 0 \(a re-run of the open chunk\), 6 \(the next chunk\), got 3"
    with pytest.raises(am.StreamPositionError, match=rerun_or_next):
        _chunk_call(layers, 3, kv_cache=cache)  # not on a chunk boundary
    _chunk_call(layers, PER_FRAME, kv_cache=cache)  # the next chunk: chunk 0 committed
    _chunk_call(layers, 2 * PER_FRAME, kv_cache=cache)
    with pytest.raises(am.StreamPositionError, match="got 24"):
        _chunk_call(layers, 4 * PER_FRAME, kv_cache=cache)  # a skipped chunk
    with pytest.raises(am.StreamPositionError, match="got 6"):
        _chunk_call(layers, PER_FRAME, kv_cache=cache)  # a rewind that is not a new video
    with pytest.raises(am.StreamPositionError, match="expected current_start an int >= 0, got -6"):
        _chunk_call(layers, -PER_FRAME, kv_cache=cache)
    assert session.committed_tokens == 2 * PER_FRAME and session.current_start == 2 * PER_FRAME  # nothing moved
    _chunk_call(layers, 0, kv_cache=cache)  # a new video: the session reset
    assert session.committed_tokens == 0 and session.current_start == 0
    with pytest.raises(am.StreamPositionError, match="expected current_start=0 after the kv_cache was reset"):
        _chunk_call(layers, PER_FRAME, kv_cache={"global_end_index": torch.tensor([0])})
    with pytest.raises(am.StreamPositionError, match=r"layer 1\): expected current_start=0"):
        layers[1](torch.randn(1, PER_FRAME, TINY.dim), None, torch.tensor([[1, 2, 3]]), wan_freqs(16, 1024), None,
                  cache, PER_FRAME, None)
    session.close()


def test_wrong_inputs_are_refused_naming_expected_and_actual() -> None:
    layers, session = _swapped()
    with pytest.raises(am.errors.SequenceLengthError, match="expected one chunk of chunk_size=6 tokens .* got 18"):
        _chunk_call(layers, 0, frames=3)  # the pipeline's num_frame_per_block is not the spec's chunk
    with pytest.raises(am.TensorMismatchError, match=r"expected \[1 \(one row per branch \('video0',\)\)"):
        _chunk_call(layers, 0, batch=2)
    with pytest.raises(am.SpecError, match="expected kv_cache .* got None"):
        _chunk_call(layers, 0, kv_cache=None)
    x, freqs = torch.randn(1, PER_FRAME, TINY.dim), wan_freqs(TINY.head_dim, 1024)
    with pytest.raises(am.TensorMismatchError, match="expected frames x height x width = 6 tokens, got 1 x 3 x 3"):
        layers[0](x, None, torch.tensor([[1, 3, 3]]), freqs, None, {}, 0, None)
    with pytest.raises(am.TensorMismatchError, match=r"expected at least 3 rows \(frames 0..0, a 2x3 grid\), got 2"):
        layers[0](x, None, torch.tensor([[1, 2, 3]]), freqs[:2], None, {}, 0, None)
    with pytest.raises(am.errors.ForwardFinishedError, match="expected block 0 to have opened the model forward"):
        layers[1](x, None, torch.tensor([[1, 2, 3]]), freqs, None, {}, 0, None)
    _chunk_call(layers, 0)
    with pytest.raises(am.errors.SequenceLengthError, match="expected x of 6 tokens"):
        layers[1](torch.randn(1, 2 * PER_FRAME, TINY.dim), None, torch.tensor([[2, 2, 3]]), freqs, None, {}, 0, None)
    session.close()


def test_calls_after_close_are_refused() -> None:
    layers, session = _swapped()
    _chunk_call(layers, 0)
    session.close()
    session.close()  # idempotent
    for call in (lambda: _chunk_call(layers, PER_FRAME), session.finish, session.reset):
        with pytest.raises(am.errors.SessionClosedError, match="expected an open session, got one closed"):
            call()
    unbound = SelfForcingSelfAttention.from_wan(build_pipeline(local_attn_size=3, sink_size=0, frames_per_block=1)
                                                .generator.model.blocks[0].self_attn)
    with pytest.raises(am.SpecError, match="expected a layer bound to a SelfForcingSession"):
        _chunk_call([unbound], 0)


def test_a_failed_clean_forward_is_not_committed() -> None:
    """A forward whose blocks did not all run is refused at its commit; the next chunk start is then refused."""
    layers, session = _swapped()
    _chunk_call(layers, 0)
    _chunk_call(layers[:1], 0)  # the clean re-run stopped after block 0
    with pytest.raises(am.errors.IncompleteForwardError):
        _chunk_call(layers, PER_FRAME)
    assert session.committed_tokens == 0 and session.forward is None
    with pytest.raises(am.StreamPositionError, match=r"expected current_start 0 \(the next chunk\), got 6"):
        _chunk_call(layers, PER_FRAME)
    session.close()


def test_swap_refuses_what_cannot_match_upstream() -> None:
    def model(local_attn_size: int = 3, sink_size: int = 0) -> torch.nn.Module:
        return build_pipeline(local_attn_size=local_attn_size, sink_size=sink_size, frames_per_block=1).generator.model

    spec = make_spec(1, 0, 3, 1)
    with pytest.raises(am.SpecError, match="expected a model of spec.num_layers=2 blocks .* got 3"):
        swap_self_attention(model(), make_spec(1, 0, 3, 1, num_layers=2))
    with pytest.raises(am.SpecError, match=r"expected self-attention of \(heads, kv_heads, head_dim\)=\(4, 4, 8\)"):
        swap_self_attention(model(), make_spec(1, 0, 3, 1, num_kv_heads=4, head_dim=8))
    with pytest.raises(am.SpecError, match="expected num_pages or budget_bytes for an unbounded window"):
        swap_self_attention(model(), make_spec(1, 0, -1, 1))
    with pytest.raises(am.SpecError, match="expected a spec with relative_sinks=False"):
        swap_self_attention(model(local_attn_size=4, sink_size=1), make_spec(1, 1, 4, 1, relative_sinks=True))
    with pytest.raises(am.SpecError, match="expected a CausalWanModel-shaped model"):
        swap_self_attention(torch.nn.Linear(2, 2), spec)
    with pytest.raises(am.errors.UnknownBranchError, match=r"expected names from \('video0',\), got \['cond'\]"):
        swap_self_attention(model(), spec, branches=("cond",))
    with pytest.raises(am.SpecError, match=r"expected distinct branch names, one per batch row, got \(\)"):
        swap_self_attention(model(), spec, branches=())
    cache = am.KVCache(spec, num_pages=16)
    with pytest.raises(am.SpecError, match="expected num_pages / budget_bytes only with a KVCacheSpec"):
        swap_self_attention(model(), cache, num_pages=4)
    swapped = model()
    session = swap_self_attention(swapped, cache)
    with pytest.raises(am.SpecError, match="got a model already swapped"):
        swap_self_attention(swapped, cache)
    session.close()
    assert not cache.is_closed  # the caller's cache stays the caller's
    # a spec whose window is not upstream's buffer: refused on the first forward, or run on purpose
    narrow = model(local_attn_size=3)
    session = swap_self_attention(narrow, make_spec(1, 0, 4, 1))
    layers = [b.self_attn for b in narrow.blocks]
    upstreams = r"local_attn_size=3 frames.*SinkWindowPolicy\(sink_chunks=0, window_chunks=2\)"
    with pytest.raises(am.SpecError, match=upstreams):
        _chunk_call(layers, 0)
    session.close()
    narrow = model(local_attn_size=3)
    session = swap_self_attention(narrow, make_spec(1, 0, 4, 1), check_window=False)
    _chunk_call([b.self_attn for b in narrow.blocks], 0)
    session.close()
