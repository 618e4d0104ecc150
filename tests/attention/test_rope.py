"""RoPE pair layouts and precision (issue 12, items 1 and 2).

The references are written independently of the library, the way Wan2.1 / Self-Forcing write
them (``tests/support/wan_rope.py``: ``rope_params`` builds complex ``e^{i * pos * freq}`` tables in float64
with ``torch.polar`` and ``rope_apply`` multiplies ``view_as_complex(x.reshape(..., -1, 2))`` by them, the
time axis offset by ``start_frame``, Self-Forcing's ``causal_rope_apply``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ardiff_modules import KVCache, KVCacheSpec, SpecError, TensorMismatchError
from ardiff_modules.modules import (
    ChunkSelfAttention,
    RotaryEmbedding,
    VideoRotaryEmbedding,
    apply_rope,
    rotate,
    rotate_half,
)
from tests.support.wan_rope import rope_apply, wan_freqs

# Wan2.1-1.3B at 480x832: 30 x 52 latent tokens per frame, 128 channels per head.
WAN_HEAD_DIM, WAN_H, WAN_W = 128, 30, 52


# ------------------------------------------------------------------ references written here
def rope_1d_complex(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """1-D complex RoPE: ``x`` ``[S, n, heads, d]``, ``positions`` ``[S, n]`` -> float64."""
    d = x.shape[-1]
    inv = 1.0 / torch.pow(theta, torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.to(torch.float64)[..., None, None] * inv  # [S, n, 1, d/2]
    xc = torch.view_as_complex(x.to(torch.float64).reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * torch.polar(torch.ones_like(angles), angles)).flatten(-2)


def half_to_interleaved(d: int) -> torch.Tensor:
    """Channel order taking a ``"half"``-layout vector to ``"interleaved"``: ``x_int = x_half[..., perm]``."""
    perm = torch.empty(d, dtype=torch.long)
    perm[0::2] = torch.arange(d // 2)
    perm[1::2] = torch.arange(d // 2, d)
    return perm


def frame_positions(frames: list[int], per_frame: int) -> torch.Tensor:
    return torch.cat([torch.arange(f * per_frame, (f + 1) * per_frame) for f in frames])[None]


# ------------------------------------------------------------------ layouts
@pytest.mark.parametrize("start_frame", [0, 1, 21, 1023, 1024, 4_999, 9_999])
def test_video_rope_default_equals_wans_complex_rope_up_to_ten_thousand_frames(start_frame: int) -> None:
    g = torch.Generator().manual_seed(start_frame)
    frames = 2
    per_frame = WAN_H * WAN_W
    x = torch.randn(1, frames * per_frame, 2, WAN_HEAD_DIM, generator=g)
    expected = rope_apply(x, (frames, WAN_H, WAN_W), wan_freqs(WAN_HEAD_DIM, 10_001), start_frame)
    rope = VideoRotaryEmbedding(WAN_HEAD_DIM, WAN_H, WAN_W)  # default: as in Wan2.1, no permutation
    assert rope.layout == "interleaved" and rope.dims == (44, 42, 42)
    positions = torch.arange(start_frame * per_frame, (start_frame + frames) * per_frame)[None]
    out = rope(x, positions)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [6, 10, 12, 14, 16, 64])
def test_video_rope_axis_split_matches_wan_for_every_head_dim(head_dim: int) -> None:
    h, w, frames, start = 3, 5, 4, 123
    x = torch.randn(2, frames * h * w, 3, head_dim, generator=torch.Generator().manual_seed(head_dim))
    rope = VideoRotaryEmbedding(head_dim, h, w, theta=500.0)
    positions = torch.arange(start * h * w, (start + frames) * h * w).expand(2, -1)
    expected = rope_apply(x, (frames, h, w), wan_freqs(head_dim, start + frames, theta=500.0), start)
    torch.testing.assert_close(rope(x, positions).double(), expected, atol=2e-6, rtol=1e-5)


def test_half_layout_is_the_interleaved_rotation_in_rotate_half_channel_order() -> None:
    """``"half"`` pairs (i, i + d/2): the same rotation as Wan's once channels are reordered."""
    h, w, d = 2, 3, 16
    perm = half_to_interleaved(d)
    x_half = torch.randn(1, 4 * h * w, 2, d, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(7 * h * w, 11 * h * w)[None]
    out_half = VideoRotaryEmbedding(d, h, w, layout="half")(x_half, positions)
    expected = rope_apply(x_half[..., perm], (4, h, w), wan_freqs(d, 11), start_frame=7)
    torch.testing.assert_close(out_half[..., perm].double(), expected, atol=2e-6, rtol=1e-5)
    # 1-D: both layouts against the complex reference.
    positions = torch.tensor([[0, 1, 2, 4095, 4096, 10**7]])
    x = torch.randn(1, 6, 2, d, generator=torch.Generator().manual_seed(2))
    reference = rope_1d_complex(x, positions)
    torch.testing.assert_close(RotaryEmbedding(d)(x, positions).double(), reference, atol=2e-6, rtol=1e-5)
    out = RotaryEmbedding(d, layout="half")(x[..., torch.argsort(perm)], positions)
    torch.testing.assert_close(out[..., perm].double(), reference, atol=2e-6, rtol=1e-5)


def test_rotate_half_layout_is_gpt_neox() -> None:
    """``"half"`` is the textbook ``x * cos + rotate_half(x) * sin`` with ``cat(freqs, freqs)``."""
    d = 8
    x = torch.randn(2, 5, 3, d, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    positions = torch.arange(10).view(2, 5) * 997
    inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    emb = torch.cat([positions[..., None].double() * inv] * 2, dim=-1)[:, :, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    expected = x * emb.cos() + torch.cat((-x2, x1), dim=-1) * emb.sin()
    torch.testing.assert_close(RotaryEmbedding(d, layout="half")(x, positions), expected, atol=1e-12, rtol=1e-12)
    assert torch.equal(rotate_half(torch.arange(4.0)), torch.tensor([-2.0, -3.0, 0.0, 1.0]))


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_cos_sin_pair_through_apply_rope_equals_the_module(layout: str) -> None:
    rope = VideoRotaryEmbedding(12, 2, 2, layout=layout)
    t = torch.randn(2, 8, 3, 12, generator=torch.Generator().manual_seed(4))
    positions = torch.arange(16).view(2, 8) + 40_000
    cos, sin = rope.cos_sin(positions)
    assert cos.shape == sin.shape == (2, 8, 1, 12) and cos.dtype == torch.float32
    assert torch.equal(apply_rope(t, positions, (cos, sin), layout=layout), rope(t, positions))
    assert torch.equal(apply_rope(t, positions, rope), rope(t, positions))
    other = "half" if layout == "interleaved" else "interleaved"
    assert not torch.allclose(apply_rope(t, positions, (cos, sin), layout=other), rope(t, positions))


def test_diffusers_style_cos_sin_pair_is_interleaved() -> None:
    """diffusers' ``WanRotaryPosEmbed`` gives ``repeat_interleave``d cos / sin; ``apply_rope``'s default
    layout applies them like diffusers' ``apply_rotary_emb`` (the complex product)."""
    d, n = 8, 6
    x = torch.randn(1, n, 2, d, generator=torch.Generator().manual_seed(5))
    angles = torch.arange(n, dtype=torch.float64)[:, None] * (1.0 / 10000.0 ** (torch.arange(0, d, 2) / d))
    cos = angles.cos().repeat_interleave(2, dim=-1).float()[None, :, None]
    sin = angles.sin().repeat_interleave(2, dim=-1).float()[None, :, None]
    positions = torch.arange(n)[None]
    torch.testing.assert_close(apply_rope(x, positions, (cos, sin)).double(), rope_1d_complex(x, positions),
                               atol=2e-6, rtol=1e-5)


def test_diffusers_wan_rotary_pos_embed_matches_when_installed() -> None:
    diffusers_wan = pytest.importorskip("diffusers.models.transformers.transformer_wan")
    d, f, h, w = 24, 3, 4, 6
    rope_d = diffusers_wan.WanRotaryPosEmbed(d, (1, 2, 2), max_seq_len=64)
    cos, sin = rope_d(torch.zeros(1, 4, f, 2 * h, 2 * w))  # [1, f*h*w, 1, d], frames from 0
    ours = VideoRotaryEmbedding(d, h, w)
    oc, os_ = ours.cos_sin(torch.arange(f * h * w)[None])
    torch.testing.assert_close(oc, cos.float(), atol=1e-6, rtol=0)
    torch.testing.assert_close(os_, sin.float(), atol=1e-6, rtol=0)


def test_layout_and_position_misuse() -> None:
    with pytest.raises(SpecError, match="RotaryEmbedding.layout: expected 'interleaved' or 'half', got 'neox'"):
        RotaryEmbedding(8, layout="neox")
    with pytest.raises(SpecError, match="VideoRotaryEmbedding.layout"):
        VideoRotaryEmbedding(12, 2, 2, layout=None)
    t, positions = torch.zeros(1, 4, 2, 8), torch.arange(4)[None]
    with pytest.raises(SpecError, match="apply_rope.layout: expected 'interleaved' or 'half', got 'x'"):
        apply_rope(t, positions, (torch.ones(8), torch.zeros(8)), layout="x")
    with pytest.raises(SpecError, match="rotate.layout"):
        rotate(t, torch.ones(8), torch.zeros(8), "complex")
    with pytest.raises(SpecError, match="ChunkSelfAttention.rope_layout"):
        ChunkSelfAttention(16, 2, rope_layout="rotate_half")
    with pytest.raises(TensorMismatchError, match="positions: expected an integer dtype .* got torch.bfloat16"):
        RotaryEmbedding(8)(t, positions.to(torch.bfloat16))
    with pytest.raises(TensorMismatchError, match="got torch.float32"):
        VideoRotaryEmbedding(12, 2, 2).cos_sin(positions.float())


# ------------------------------------------------------------------ precision
def test_modules_hold_no_tensor_that_to_dtype_could_round() -> None:
    model = nn.ModuleList([RotaryEmbedding(128), VideoRotaryEmbedding(128, WAN_H, WAN_W)])
    assert not list(model.buffers()) and not list(model.parameters()) and not model.state_dict()
    model.to(torch.bfloat16)
    assert model[0].inv_freq.dtype == torch.float64 and model[1].inv_freq_t.dtype == torch.float64
    torch.testing.assert_close(model[0].inv_freq, 1.0 / 10000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))


def test_cos_sin_after_bf16_cast_equal_float64_up_to_ten_million_tokens() -> None:
    """Neighbouring tokens stay distinct and every angle is exact to float32 rounding of cos / sin."""
    video = VideoRotaryEmbedding(WAN_HEAD_DIM, WAN_H, WAN_W).to(torch.bfloat16)
    flat = RotaryEmbedding(WAN_HEAD_DIM).to(torch.bfloat16)
    positions = torch.cat([torch.arange(0, 64), torch.arange(4680, 4744), torch.arange(10**7 - 64, 10**7 + 64)])[None]
    per_frame = WAN_H * WAN_W
    frame, inner = positions // per_frame, positions % per_frame
    row, col = inner // WAN_W, inner % WAN_W

    def freqs(d: int) -> torch.Tensor:
        return 1.0 / torch.pow(10000.0, torch.arange(0, d, 2, dtype=torch.float64) / d)

    angles = torch.cat(
        [frame[..., None].double() * freqs(44), row[..., None].double() * freqs(42), col[..., None].double() * freqs(42)],
        dim=-1,
    )
    cos, sin = video.cos_sin(positions)
    torch.testing.assert_close(cos[:, :, 0, 0::2].double(), angles.cos(), atol=1e-7, rtol=0)
    torch.testing.assert_close(sin[:, :, 0, 1::2].double(), angles.sin(), atol=1e-7, rtol=0)
    angles_1d = positions[..., None].double() * freqs(WAN_HEAD_DIM)
    cos, sin = flat.cos_sin(positions)
    torch.testing.assert_close(cos[:, :, 0, 0::2].double(), angles_1d.cos(), atol=1e-7, rtol=0)
    torch.testing.assert_close(sin[:, :, 0, 0::2].double(), angles_1d.sin(), atol=1e-7, rtol=0)
    # Two neighbouring tokens at 10^7 rotate differently (bf16 positions would have merged them).
    assert not torch.equal(cos[0, -1], cos[0, -2])


def test_bf16_rotation_is_the_float64_rotation_rounded_once() -> None:
    rope = VideoRotaryEmbedding(WAN_HEAD_DIM, WAN_H, WAN_W).to(torch.bfloat16)
    per_frame = WAN_H * WAN_W
    t = torch.randn(1, 2 * per_frame, 2, WAN_HEAD_DIM, generator=torch.Generator().manual_seed(6)).bfloat16()
    positions = frame_positions([0, 9_999], per_frame)
    out = rope(t, positions)
    assert out.dtype == torch.bfloat16
    reference = torch.cat(
        [rope_apply(t[:, :per_frame], (1, WAN_H, WAN_W), wan_freqs(WAN_HEAD_DIM, 10_000), 0),
         rope_apply(t[:, per_frame:], (1, WAN_H, WAN_W), wan_freqs(WAN_HEAD_DIM, 10_000), 9_999)], dim=1,
    )
    # One bf16 rounding of the exact result: |err| <= 2^-8 |ref| (+ float32 noise on tiny values).
    err = (out.double() - reference).abs()
    assert (err <= reference.abs() * 2.0**-8 + 1e-6).all(), err.max()


class _Spy(nn.Module):
    """A RoPE hook that records what the wrapped module is given and returns."""

    def __init__(self, rope: nn.Module) -> None:
        super().__init__()
        self.rope = rope
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def forward(self, t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.rope(t, positions)
        self.calls.append((t, positions.clone(), out))
        return out


def test_thousand_chunk_bf16_rollout_rope_error_stays_flat() -> None:
    """A bf16 model streams 1000 chunks (3 frames each, 3000 frames) through the cache: at every chunk the
    keys it rotates are the float64 rotation of its bf16 keys rounded once -- chunk 999 as chunk 1."""
    h, w, frames_per_chunk, heads, head_dim = 4, 4, 3, 2, 12
    chunk = frames_per_chunk * h * w
    spec = KVCacheSpec(
        num_layers=1, num_kv_heads=heads, head_dim=head_dim, chunk_size=chunk, page_size=h * w,
        sink_chunks=1, window_chunks=1, branches=("cond",), dtype="bfloat16",
    )
    cache = KVCache(spec, num_pages=4 * spec.pages_per_chunk, backend="reference")
    state = cache.open_session()
    torch.manual_seed(0)
    layer = ChunkSelfAttention(heads * head_dim, heads, qk_norm="full").to(torch.bfloat16).eval()
    spy = _Spy(VideoRotaryEmbedding(head_dim, h, w)).to(torch.bfloat16)
    freqs = wan_freqs(head_dim, 3_001)
    errors = []
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for c in range(1000):
            x = torch.randn(1, chunk, heads * head_dim, generator=g).bfloat16()
            with state.prepare_forward(("cond",), chunk, commit_current=True) as fwd:
                out = layer(x, fwd.layers[0], spy)
            assert torch.isfinite(out).all()
            (_, q_pos, _), (k_in, k_pos, k_out) = spy.calls
            spy.calls.clear()
            expected_pos = torch.arange(c * chunk, (c + 1) * chunk)[None]
            assert torch.equal(k_pos, expected_pos) and torch.equal(q_pos, expected_pos)
            reference = rope_apply(k_in, (frames_per_chunk, h, w), freqs, start_frame=c * frames_per_chunk)
            err = (k_out.double() - reference).abs()
            # relative to each element's own bf16 rounding unit
            errors.append(float((err / (reference.abs() * (2.0**-8 + 1e-6) + 1e-6)).max()))
    errors_t = torch.tensor(errors)
    assert errors_t.max() <= 1.0, f"a chunk exceeds one bf16 rounding: max {errors_t.max():.3f} at {errors_t.argmax()}"
    first, last = errors_t[:100].mean(), errors_t[-100:].mean()
    assert last <= first * 1.25 + 0.02, f"error grows with the chunk index: first 100 {first:.3f}, last 100 {last:.3f}"
    state.close()


def test_compiled_video_rope_fullgraph_one_frame_across_positions() -> None:
    torch._dynamo.reset()
    try:
        rope = VideoRotaryEmbedding(WAN_HEAD_DIM, WAN_H, WAN_W).to(torch.bfloat16)
        from torch._dynamo.testing import CompileCounterWithBackend

        counter = CompileCounterWithBackend("inductor")
        compiled = torch.compile(rope, backend=counter, fullgraph=True)
        t = torch.randn(1, 96, 2, WAN_HEAD_DIM).bfloat16()
        for start in (0, 4680, 9_999 * 1560):
            positions = torch.arange(start, start + 96)[None]
            torch.testing.assert_close(compiled(t, positions), rope(t, positions), atol=0, rtol=0)
        assert counter.frame_count == 1
    finally:
        torch._dynamo.reset()
