"""Checkpoint-compatible layers and converters (issue 12, items 3 and 7).

Wan2.1's attention modules are re-written here minimally with Wan's exact parameter names
(``WanRMSNorm``, ``WanSelfAttention``, ``WanT2VCrossAttention``, ``WanI2VCrossAttention``) and Wan's
forward (full attention, complex RoPE from ``tests/support/wan_rope.py``). diffusers' ``WanAttention`` is imported
from diffusers when it is installed (those cases skip otherwise). Each converted layer must give the
original module's output (float32, 1e-5): self-attention through a ``KVCache`` (reference backend),
chunk by chunk, against the original's full attention over the chunks so far.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ardiff_modules import CrossAttentionSpec, KVCache, KVCacheSpec, SpecError, TensorMismatchError
from ardiff_modules.errors import StateDictMismatchError
from ardiff_modules.convert import attention_key_map, convert_attention_state_dict, convert_wan_state_dict
from ardiff_modules.modules import (
    ATTENTION_PARAM_NAMES,
    CachedCrossAttention,
    ChunkSelfAttention,
    VideoRotaryEmbedding,
    populate_cross_attention,
)
from tests.support.wan_rope import rope_apply, wan_freqs

DIM, HEADS, HEAD_DIM = 48, 4, 12
H, W, FRAMES_PER_CHUNK = 2, 3, 2
CHUNK = FRAMES_PER_CHUNK * H * W
TEXT_TOKENS, IMAGE_TOKENS = 7, 5
ATOL = 1e-5


# ------------------------------------------------------------------ Wan2.1's modules, minimal
class WanRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x.float()).type_as(x) * self.weight

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Wan's ``flash_attention`` without lengths: ``[B, L, N, D]`` in and out."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


class WanSelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, window_size=(-1, -1), qk_norm: bool = True, eps: float = 1e-6) -> None:  # noqa: ANN001
        assert dim % num_heads == 0
        super().__init__()
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.window_size = window_size
        self.qk_norm = qk_norm
        self.eps = eps
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm_q = WanRMSNorm(dim, eps=eps) if qk_norm else nn.Identity()
        self.norm_k = WanRMSNorm(dim, eps=eps) if qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor, grid: tuple[int, int, int], freqs: torch.Tensor, start_frame: int = 0) -> torch.Tensor:
        b, s, n, d = *x.shape[:2], self.num_heads, self.head_dim
        q = self.norm_q(self.q(x)).view(b, s, n, d)
        k = self.norm_k(self.k(x)).view(b, s, n, d)
        v = self.v(x).view(b, s, n, d)
        q = rope_apply(q, grid, freqs, start_frame).float()
        k = rope_apply(k, grid, freqs, start_frame).float()
        return self.o(attention(q, k, v).flatten(2))


class WanT2VCrossAttention(WanSelfAttention):
    def forward(self, x: torch.Tensor, context: torch.Tensor, context_lens: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        b, n, d = x.size(0), self.num_heads, self.head_dim
        q = self.norm_q(self.q(x)).view(b, -1, n, d)
        k = self.norm_k(self.k(context)).view(b, -1, n, d)
        v = self.v(context).view(b, -1, n, d)
        return self.o(attention(q, k, v).flatten(2))


class WanI2VCrossAttention(WanSelfAttention):
    def __init__(self, dim: int, num_heads: int, window_size=(-1, -1), qk_norm: bool = True, eps: float = 1e-6) -> None:  # noqa: ANN001
        super().__init__(dim, num_heads, window_size, qk_norm, eps)
        self.k_img = nn.Linear(dim, dim)
        self.v_img = nn.Linear(dim, dim)
        self.norm_k_img = WanRMSNorm(dim, eps=eps) if qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor, context: torch.Tensor, context_lens: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        image_context_length = context.shape[1] - TEXT_TOKENS  # Wan: T5_CONTEXT_TOKEN_NUMBER (512)
        context_img = context[:, :image_context_length]
        context = context[:, image_context_length:]
        b, n, d = x.size(0), self.num_heads, self.head_dim
        q = self.norm_q(self.q(x)).view(b, -1, n, d)
        k = self.norm_k(self.k(context)).view(b, -1, n, d)
        v = self.v(context).view(b, -1, n, d)
        k_img = self.norm_k_img(self.k_img(context_img)).view(b, -1, n, d)
        v_img = self.v_img(context_img).view(b, -1, n, d)
        img_x = attention(q, k_img, v_img).flatten(2)
        x = attention(q, k, v).flatten(2)
        return self.o(x + img_x)


def randomize(module: nn.Module, seed: int) -> nn.Module:
    """Random weights everywhere (norm weights too, so a wrong mapping cannot hide behind ones)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 1.0) + (1.0 if p.dim() == 1 else 0.0))
    return module.eval()


def diffusers_wan():  # noqa: ANN201
    return pytest.importorskip("diffusers.models.transformers.transformer_wan")


# ------------------------------------------------------------------ harness
def make_layer_cache(cross: tuple[CrossAttentionSpec, ...] = (), branches: tuple[str, ...] = ("cond",)) -> KVCache:
    spec = KVCacheSpec(
        num_layers=1, num_kv_heads=HEADS, head_dim=HEAD_DIM, chunk_size=CHUNK, page_size=H * W,
        sink_chunks=1, window_chunks=4, branches=branches, cross_attention=cross, dtype="float32",
    )
    return KVCache(spec, num_pages=16 * spec.pages_per_chunk, backend="reference")


def stream_self_attention(layer: ChunkSelfAttention, x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[1, chunks * CHUNK, DIM]`` through the paged cache one committed chunk at a time."""
    state = make_layer_cache().open_session()
    rope = VideoRotaryEmbedding(HEAD_DIM, H, W)
    outs = []
    with torch.no_grad():
        for c in range(x.shape[1] // CHUNK):
            with state.prepare_forward(("cond",), CHUNK, commit_current=True) as fwd:
                outs.append(layer(x[:, c * CHUNK : (c + 1) * CHUNK], fwd.layers[0], rope))
    state.close()
    return torch.cat(outs, dim=1)


def check_chunks_against_full_attention(layer: ChunkSelfAttention, reference, chunks: int = 3) -> None:  # noqa: ANN001
    """Chunk ``c``'s rows of the original's full attention over chunks ``0..c`` equal the streamed output
    (keys of the earlier chunks are visible, RoPE at absolute frames)."""
    x = torch.randn(1, chunks * CHUNK, DIM, generator=torch.Generator().manual_seed(7))
    streamed = stream_self_attention(layer, x)
    with torch.no_grad():
        for c in range(chunks):
            full = reference(x[:, : (c + 1) * CHUNK], c + 1)
            torch.testing.assert_close(
                streamed[:, c * CHUNK : (c + 1) * CHUNK], full[:, c * CHUNK :], atol=ATOL, rtol=ATOL,
                msg=lambda m, c=c: f"chunk {c}: {m}",
            )


# ------------------------------------------------------------------ self-attention
@pytest.mark.parametrize("param_names", ["wan", "ardiff", "diffusers"])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_from_wan_self_attention_equals_wans_attention(param_names: str, qk_norm: bool) -> None:
    wan = randomize(WanSelfAttention(DIM, HEADS, qk_norm=qk_norm), seed=1)
    layer = ChunkSelfAttention.from_wan(wan, param_names=param_names)
    assert (layer.qk_norm, layer.param_names, layer.head_dim) == ("full" if qk_norm else None, param_names, HEAD_DIM)
    if param_names == "wan":
        assert list(layer.state_dict()) == list(wan.state_dict()) or set(layer.state_dict()) == set(wan.state_dict())
    freqs = wan_freqs(HEAD_DIM, 64)
    check_chunks_against_full_attention(layer, lambda x, chunks: wan(x, (chunks * FRAMES_PER_CHUNK, H, W), freqs))


def test_wan_checkpoint_loads_strictly_into_wan_named_layers() -> None:
    wan = randomize(WanSelfAttention(DIM, HEADS), seed=2)
    layer = ChunkSelfAttention(DIM, HEADS, qk_norm="full", param_names="wan")
    layer.load_state_dict(wan.state_dict(), strict=True)
    assert sorted(layer.state_dict()) == sorted(["q.weight", "q.bias", "k.weight", "k.bias", "v.weight", "v.bias",
                                                 "o.weight", "o.bias", "norm_q.weight", "norm_k.weight"])
    assert layer.to_q is layer.get_submodule("q") and layer.to_out is layer.get_submodule("o")
    freqs = wan_freqs(HEAD_DIM, 64)
    check_chunks_against_full_attention(layer, lambda x, chunks: wan(x, (chunks * FRAMES_PER_CHUNK, H, W), freqs), 2)
    # ardiff / diffusers naming load the same checkpoint after renaming only.
    for names in ("ardiff", "diffusers"):
        other = ChunkSelfAttention(DIM, HEADS, qk_norm="full", param_names=names)
        other.load_state_dict(convert_attention_state_dict(wan.state_dict(), "wan", names), strict=True)
        for a, b in zip(other.parameters(), layer.parameters()):
            assert torch.equal(a, b)


@pytest.mark.parametrize("param_names", ["diffusers", "wan"])
def test_from_diffusers_self_attention_equals_diffusers_attention(param_names: str) -> None:
    dw = diffusers_wan()
    attn = randomize(dw.WanAttention(DIM, heads=HEADS, dim_head=HEAD_DIM, eps=1e-6, processor=dw.WanAttnProcessor()), 3)
    rope = dw.WanRotaryPosEmbed(HEAD_DIM, (1, 2, 2), max_seq_len=64)
    layer = ChunkSelfAttention.from_diffusers(attn, param_names=param_names)
    if param_names == "diffusers":
        assert set(layer.state_dict()) == set(attn.state_dict())
        assert layer.to_out is layer.get_submodule("to_out") and layer.to_out[0] is layer.get_submodule("to_out.0")
        fresh = ChunkSelfAttention(DIM, HEADS, qk_norm="full", param_names="diffusers")
        fresh.load_state_dict(attn.state_dict(), strict=True)

    def reference(x: torch.Tensor, chunks: int) -> torch.Tensor:
        # diffusers counts frames from 0 inside its input: the whole visible context starts at frame 0.
        rotary = rope(torch.zeros(1, 16, chunks * FRAMES_PER_CHUNK, 2 * H, 2 * W))
        return attn(x, None, None, rotary)

    check_chunks_against_full_attention(layer, reference)


# ------------------------------------------------------------------ cross-attention
def cross_outputs(layer: CachedCrossAttention, x: torch.Tensor, contexts: dict[str, dict[str, torch.Tensor]]) -> torch.Tensor:
    """Populate each branch's caches (``contexts[branch][cache] = context``) and run one forward."""
    first = next(iter(contexts.values()))
    cross = tuple(CrossAttentionSpec(name, c.shape[-2]) for name, c in first.items())
    branches = tuple(contexts)
    state = make_layer_cache(cross, branches).open_session()
    for branch, caches in contexts.items():
        for name, context in caches.items():
            populate_cross_attention(state, branch, [layer], context, cache_name=name)
    with torch.no_grad(), state.prepare_forward(branches, x.shape[1], commit_current=False) as fwd:
        out = layer(x, fwd.layers[0])
    state.close()
    return out


@pytest.mark.parametrize("param_names", ["wan", "ardiff", "diffusers"])
def test_from_wan_t2v_cross_attention_equals_wans_with_cfg_branches(param_names: str) -> None:
    wan = randomize(WanT2VCrossAttention(DIM, HEADS), seed=4)
    layer = CachedCrossAttention.from_wan(wan, param_names=param_names)
    assert layer.image_cache_name is None and layer.cache_name == "text"
    if param_names == "wan":
        assert set(layer.state_dict()) == set(wan.state_dict())
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, CHUNK, DIM, generator=g)
    cond, uncond = torch.randn(1, TEXT_TOKENS, DIM, generator=g), torch.randn(TEXT_TOKENS, DIM, generator=g)
    # diffusers-style batched [1, tokens, dim] and plain [tokens, dim] contexts both populate.
    out = cross_outputs(layer, x, {"cond": {"text": cond}, "uncond": {"text": uncond}})
    with torch.no_grad():
        expected = torch.cat([wan(x[:1], cond), wan(x[1:], uncond[None])])
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=ATOL)
        # Without a cache: the context given directly, batched per stream or shared by all.
        torch.testing.assert_close(layer(x, context=torch.cat([cond, uncond[None]])), expected, atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(layer(x, context=cond), torch.cat([wan(x[:1], cond), wan(x[1:], cond)]),
                                   atol=ATOL, rtol=ATOL)
        k, v = layer.project_kv(cond)
        k2, v2 = layer.project_kv(cond[0])
        assert k.shape == (TEXT_TOKENS, HEADS, HEAD_DIM) and torch.equal(k, k2) and torch.equal(v, v2)


@pytest.mark.parametrize("param_names", ["wan", "diffusers"])
def test_from_wan_i2v_cross_attention_equals_wans(param_names: str) -> None:
    wan = randomize(WanI2VCrossAttention(DIM, HEADS), seed=6)
    layer = CachedCrossAttention.from_wan(wan, image_cache_name="clip", param_names=param_names)
    assert layer.image_cache_name == "clip" and layer.image_context_dim == DIM
    if param_names == "wan":
        assert set(layer.state_dict()) == set(wan.state_dict())
        assert {"k_img.weight", "v_img.bias", "norm_k_img.weight"} <= set(layer.state_dict())
        strict = CachedCrossAttention(DIM, HEADS, qk_norm="full", param_names="wan", image_cache_name="image")
        strict.load_state_dict(wan.state_dict(), strict=True)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, CHUNK, DIM, generator=g)
    image, text = torch.randn(1, IMAGE_TOKENS, DIM, generator=g), torch.randn(1, TEXT_TOKENS, DIM, generator=g)
    with torch.no_grad():
        expected = wan(x, torch.cat([image, text], dim=1))
        out = cross_outputs(layer, x, {"cond": {"text": text, "clip": image}})
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(layer(x, context=text, image_context=image[0]), expected, atol=ATOL, rtol=ATOL)


def test_from_diffusers_cross_attention_t2v_and_i2v_equal_diffusers() -> None:
    dw = diffusers_wan()
    text_tokens = 512  # diffusers' WanAttnProcessor hard-codes the T5 length when splitting I2V context
    g = torch.Generator().manual_seed(8)
    x = torch.randn(1, CHUNK, DIM, generator=g)
    text = torch.randn(1, text_tokens, DIM, generator=g)
    image = torch.randn(1, IMAGE_TOKENS, DIM, generator=g)
    t2v = randomize(dw.WanAttention(DIM, heads=HEADS, dim_head=HEAD_DIM, eps=1e-6, cross_attention_dim_head=HEAD_DIM,
                                    processor=dw.WanAttnProcessor()), 9)
    i2v = randomize(dw.WanAttention(DIM, heads=HEADS, dim_head=HEAD_DIM, eps=1e-6, added_kv_proj_dim=DIM,
                                    cross_attention_dim_head=HEAD_DIM, processor=dw.WanAttnProcessor()), 10)
    with torch.no_grad():
        layer = CachedCrossAttention.from_diffusers(t2v)
        assert set(layer.state_dict()) == set(t2v.state_dict()) and layer.image_cache_name is None
        out = cross_outputs(layer, x, {"cond": {"text": text}})
        torch.testing.assert_close(out, t2v(x, text), atol=ATOL, rtol=ATOL)

        layer = CachedCrossAttention.from_diffusers(i2v)
        assert set(layer.state_dict()) == set(i2v.state_dict())
        assert {"add_k_proj.weight", "add_v_proj.bias", "norm_added_k.weight"} <= set(layer.state_dict())
        expected = i2v(x, torch.cat([image, text], dim=1))
        out = cross_outputs(layer, x, {"cond": {"text": text, "image": image}})
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=ATOL)
        strict = CachedCrossAttention(DIM, HEADS, qk_norm="full", param_names="diffusers", image_cache_name="image")
        strict.load_state_dict(i2v.state_dict(), strict=True)
        torch.testing.assert_close(strict(x, context=text, image_context=image), expected, atol=ATOL, rtol=ATOL)
        # A Wan I2V checkpoint renamed to diffusers' keys loads into diffusers' own module.
        wan = randomize(WanI2VCrossAttention(DIM, HEADS), seed=11)
        i2v.load_state_dict(convert_attention_state_dict(wan.state_dict(), "wan", "diffusers"), strict=True)
        torch.testing.assert_close(
            i2v(x, torch.cat([image, text], dim=1)),
            CachedCrossAttention.from_wan(wan)(x, context=text, image_context=image), atol=ATOL, rtol=ATOL,
        )


def test_from_diffusers_ignores_fused_projection_copies() -> None:
    dw = diffusers_wan()
    attn = randomize(dw.WanAttention(DIM, heads=HEADS, dim_head=HEAD_DIM, processor=dw.WanAttnProcessor()), 12)
    attn.fuse_projections()
    assert any(k.startswith("to_qkv.") for k in attn.state_dict())
    layer = ChunkSelfAttention.from_diffusers(attn)
    assert not any(k.startswith("to_qkv.") for k in layer.state_dict())
    assert torch.equal(layer.to_k.weight, attn.to_k.weight)


_UNFUSED = {"to_qkv": ("to_q", "to_k", "to_v"), "to_kv": ("to_k", "to_v"), "to_added_kv": ("add_k_proj", "add_v_proj")}


@pytest.mark.parametrize("unfused", ["stale", "deleted"])
@pytest.mark.parametrize("kind", ["self", "t2v", "i2v"])
def test_from_diffusers_copies_the_fused_projections_the_module_runs(kind: str, unfused: str) -> None:
    """After ``fuse_projections()`` diffusers runs ``to_qkv`` (self), ``to_q`` + ``to_kv`` (cross) and
    ``to_added_kv`` (I2V); the unfused copies go stale once the fused weights change (a LoRA fused into
    them, a fused checkpoint loaded) or may be deleted. The layer computes what the stock fused module does."""
    dw = diffusers_wan()
    extra = {"self": {}, "t2v": {"cross_attention_dim_head": HEAD_DIM},
             "i2v": {"cross_attention_dim_head": HEAD_DIM, "added_kv_proj_dim": DIM}}[kind]
    attn = randomize(dw.WanAttention(DIM, heads=HEADS, dim_head=HEAD_DIM, eps=1e-6, processor=dw.WanAttnProcessor(),
                                     **extra), 16)
    attn.fuse_projections()
    fused = [name for name in _UNFUSED if hasattr(attn, name)]
    assert fused == {"self": ["to_qkv"], "t2v": ["to_kv"], "i2v": ["to_kv", "to_added_kv"]}[kind]
    g = torch.Generator().manual_seed(17)
    with torch.no_grad():
        for name in fused:  # the weights the module runs change; the unfused copies do not follow
            for p in getattr(attn, name).parameters():
                p.add_(0.5 * torch.randn(p.shape, generator=g))
    if unfused == "deleted":  # what stock diffusers still reads stays: to_q (cross), add_k_proj (its I2V test)
        for path in {"self": ("to_q", "to_k", "to_v")}.get(kind, ("to_k", "to_v")):
            delattr(attn, path)
    g = torch.Generator().manual_seed(18)
    if kind == "self":
        layer = ChunkSelfAttention.from_diffusers(attn)
        rope = dw.WanRotaryPosEmbed(HEAD_DIM, (1, 2, 2), max_seq_len=64)

        def reference(x: torch.Tensor, chunks: int) -> torch.Tensor:
            return attn(x, None, None, rope(torch.zeros(1, 16, chunks * FRAMES_PER_CHUNK, 2 * H, 2 * W)))

        check_chunks_against_full_attention(layer, reference)
        return
    layer = CachedCrossAttention.from_diffusers(attn)
    x = torch.randn(1, CHUNK, DIM, generator=g)
    text = torch.randn(1, 512, DIM, generator=g)  # diffusers' I2V processor hard-codes 512 text tokens
    contexts = {"text": text}
    with torch.no_grad():
        if kind == "i2v":
            contexts["image"] = image = torch.randn(1, IMAGE_TOKENS, DIM, generator=g)
            expected = attn(x, torch.cat([image, text], dim=1))
        else:
            expected = attn(x, text)
        torch.testing.assert_close(cross_outputs(layer, x, {"cond": contexts}), expected, atol=ATOL, rtol=ATOL)


def test_from_diffusers_refuses_a_fused_module_without_its_fused_projection() -> None:
    dw = diffusers_wan()
    attn = dw.WanAttention(DIM, heads=HEADS, dim_head=HEAD_DIM, processor=dw.WanAttnProcessor())
    attn.fuse_projections()
    del attn.to_qkv
    with pytest.raises(SpecError, match=r"expected WanAttention.to_qkv \(fused_projections=True\) to be an nn.Linear "
                                        r"of 3 equal projections, got NoneType"):
        ChunkSelfAttention.from_diffusers(attn)


def test_from_copies_weights_dtype_device_and_mode() -> None:
    wan = randomize(WanSelfAttention(DIM, HEADS), seed=13).to(torch.bfloat16).requires_grad_(False)
    layer = ChunkSelfAttention.from_wan(wan, param_names="ardiff")
    assert layer.to_q.weight.dtype == torch.bfloat16 and layer.to_q.weight.device.type == "cpu"
    assert not layer.training and not any(p.requires_grad for p in layer.parameters())
    assert layer.eps == wan.eps and layer.norm_q.eps == wan.norm_q.eps
    before = layer.to_q.weight.clone()
    with torch.no_grad():
        wan.q.weight.add_(1.0)
    assert torch.equal(layer.to_q.weight, before)  # a copy, not a view


def test_submodules_swapped_by_checkpoint_name_are_the_ones_used() -> None:
    """LoRA / quantization tools replace submodules by name (``setattr(parent, "q", ...)``,
    ``get_submodule("to_out.0")``): the layer must use the replacement, whatever its naming."""
    x = torch.randn(1, 3, DIM)
    for names, path in (("wan", "q"), ("ardiff", "to_q"), ("diffusers", "to_q")):
        layer = CachedCrossAttention(DIM, HEADS, param_names=names)
        zero = nn.Linear(DIM, DIM)
        nn.init.zeros_(zero.weight), nn.init.zeros_(zero.bias)
        parent, _, leaf = path.rpartition(".")
        setattr(layer.get_submodule(parent), leaf, zero)
        assert layer.to_q is zero
    layer = ChunkSelfAttention(DIM, HEADS, param_names="diffusers")
    zero = nn.Linear(DIM, DIM)
    nn.init.zeros_(zero.weight), nn.init.zeros_(zero.bias)
    layer.get_submodule("to_out")[0] = zero
    with torch.no_grad():
        assert torch.equal(layer.to_out(x), torch.zeros_like(x))
    assert isinstance(layer.get_submodule("to_out.1"), nn.Dropout)


# ------------------------------------------------------------------ converters
def test_key_maps_and_round_trips() -> None:
    assert attention_key_map("wan", "diffusers")["o"] == "to_out.0"
    assert attention_key_map("diffusers", "wan")["add_k_proj"] == "k_img"
    wan = randomize(WanI2VCrossAttention(DIM, HEADS), seed=14).state_dict()
    there = convert_attention_state_dict(wan, "wan", "diffusers")
    back = convert_attention_state_dict(convert_attention_state_dict(there, "diffusers", "ardiff"), "ardiff", "wan")
    assert list(back) == list(wan) and all(back[k] is wan[k] for k in wan)
    assert set(there) == {f"{p}.{leaf}" for p in ("to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj")
                          for leaf in ("weight", "bias")} | {"norm_q.weight", "norm_k.weight", "norm_added_k.weight"}
    for names, table in ATTENTION_PARAM_NAMES.items():
        assert set(table) == {"q", "k", "v", "o", "norm_q", "norm_k", "k_img", "v_img", "norm_k_img"}, names


class _WanBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = WanSelfAttention(DIM, HEADS)
        self.cross_attn = WanI2VCrossAttention(DIM, HEADS)
        self.ffn = nn.Linear(DIM, DIM)


class _OurBlock(nn.Module):
    def __init__(self, param_names: str) -> None:
        super().__init__()
        self.attn = ChunkSelfAttention(DIM, HEADS, qk_norm="full", param_names=param_names)
        self.cross = CachedCrossAttention(DIM, HEADS, qk_norm="full", param_names=param_names, image_cache_name="image")
        self.ffn = nn.Linear(DIM, DIM)


@pytest.mark.parametrize("param_names", ["ardiff", "wan", "diffusers"])
def test_convert_wan_state_dict_for_a_whole_model(param_names: str) -> None:
    wan = randomize(nn.ModuleDict({"blocks": nn.ModuleList([_WanBlock(), _WanBlock()])}), seed=15)
    ours = nn.ModuleDict({"blocks": nn.ModuleList([_OurBlock(param_names), _OurBlock(param_names)])})
    prefixed = {f"model.{k}": v for k, v in wan.state_dict().items()}  # Self-Forcing-style prefix, kept
    converted = convert_wan_state_dict(prefixed, param_names, self_attn="attn", cross_attn="cross")
    ours.load_state_dict({k.removeprefix("model."): v for k, v in converted.items()}, strict=True)
    x = torch.randn(1, CHUNK, DIM)
    text, image = torch.randn(1, TEXT_TOKENS, DIM), torch.randn(1, IMAGE_TOKENS, DIM)
    with torch.no_grad():
        block, mine = wan["blocks"][1], ours["blocks"][1]
        torch.testing.assert_close(mine.cross(x, context=text, image_context=image),
                                   block.cross_attn(x, torch.cat([image, text], dim=1)), atol=ATOL, rtol=ATOL)
        assert torch.equal(mine.attn.to_v.weight, block.self_attn.v.weight)
        assert torch.equal(mine.ffn.weight, block.ffn.weight)


# ------------------------------------------------------------------ misuse
def test_conversion_and_layer_misuse() -> None:
    with pytest.raises(SpecError, match="param_names: expected 'ardiff', 'wan' or 'diffusers', got 'hf'"):
        ChunkSelfAttention(DIM, HEADS, param_names="hf")
    with pytest.raises(SpecError, match="expected a wan attention module with q, k, v, o, got Linear"):
        ChunkSelfAttention.from_wan(nn.Linear(4, 4))
    wan = WanSelfAttention(DIM, HEADS)
    wan.norm_q, wan.norm_k = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
    with pytest.raises(SpecError, match="norm_q to be an RMSNorm or nn.Identity, got LayerNorm"):
        ChunkSelfAttention.from_wan(wan)
    wan = WanSelfAttention(DIM, HEADS)
    wan.o = nn.Linear(DIM, DIM, bias=False)
    with pytest.raises(SpecError, match="all of WanSelfAttention's projections with a bias or all without"):
        ChunkSelfAttention.from_wan(wan)
    with pytest.raises(SpecError, match="expected a self-attention module, got WanI2VCrossAttention"):
        ChunkSelfAttention.from_wan(WanI2VCrossAttention(DIM, HEADS))
    layer = CachedCrossAttention(DIM, HEADS, param_names="wan", image_cache_name="image")
    with pytest.raises(TensorMismatchError, match=r"expected shape \[tokens, context_dim\] with width 48 .* got \(2, 3, 48\)"):
        layer.project_kv(torch.randn(2, 3, DIM))
    with pytest.raises(SpecError, match="project_kv.cache_name: expected None or one of \\('text', 'image'\\), got 'clip'"):
        layer.project_kv(torch.randn(3, DIM), "clip")
    with pytest.raises(SpecError, match="expected context and image_context"):
        layer(torch.randn(1, 4, DIM), context=torch.randn(3, DIM))
    with pytest.raises(SpecError, match="image_cache_name: expected None or a non-empty string other than"):
        CachedCrossAttention(DIM, HEADS, image_cache_name="text")
    with pytest.raises(SpecError, match="image_context_dim: expected None without image_cache_name"):
        CachedCrossAttention(DIM, HEADS, image_context_dim=8)
    with pytest.raises(SpecError, match="expected a layer built with image_cache_name"):
        CachedCrossAttention(DIM, HEADS).to_k_img  # noqa: B018
    state = make_layer_cache((CrossAttentionSpec("text", 3), CrossAttentionSpec("clip", 3))).open_session()
    with pytest.raises(SpecError, match="populate_cross_attention.cache_name: expected 'text' or 'image'"):
        populate_cross_attention(state, "cond", [layer], torch.randn(3, DIM), cache_name="clip")
    # kv and context together project live when training (issue 43): an I2V layer then needs the image context too
    with state.prepare_forward(("cond",), CHUNK, commit_current=False) as fwd, pytest.raises(
        SpecError, match="expected context and image_context .* to project the K/V from the context, got context"
    ):
        layer(torch.randn(1, CHUNK, DIM), fwd.layers[0], context=torch.randn(3, DIM))
    state.close()
    with pytest.raises(SpecError, match="two keys map onto 'q.weight'"):
        convert_attention_state_dict({"q.weight": torch.zeros(1), "to_q.weight": torch.zeros(1)}, "ardiff", "wan")
    # Not a state dict: named, not an AttributeError from deep inside.
    with pytest.raises(SpecError, match="convert_wan_state_dict.state_dict: expected a mapping .* got NoneType"):
        convert_wan_state_dict(None)  # type: ignore[arg-type]
    with pytest.raises(SpecError, match=r"convert_attention_state_dict.state_dict: expected a mapping .* got list"):
        convert_attention_state_dict([("q.weight", torch.zeros(1))], "wan", "ardiff")  # type: ignore[arg-type]
    with pytest.raises(SpecError, match=r"convert_attention_state_dict.state_dict: expected str keys, got 0 \(int\)"):
        convert_attention_state_dict({0: torch.zeros(1)}, "wan", "ardiff", modules="self_attn")  # type: ignore
    with pytest.raises(SpecError, match="convert_attention_state_dict.modules: expected attribute names .* got 5"):
        convert_attention_state_dict({}, "wan", "ardiff", modules=5)  # type: ignore[arg-type]


# ------------------------------------------------------------------ load_state_dict
def _layer_under_test(kind: str) -> nn.Module:
    torch.manual_seed(19)
    if kind == "self":
        return ChunkSelfAttention(DIM, HEADS, qk_norm="full")
    return CachedCrossAttention(DIM, HEADS, qk_norm="head", param_names="diffusers", image_cache_name="image")


def _tensors(layer: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (persistent or not), by object: a failed load must keep the objects too."""
    return {**dict(layer.named_parameters()), **dict(layer.named_buffers())}


def _good_state_dict(layer: nn.Module) -> dict[str, torch.Tensor]:
    """A full, valid state dict whose every value differs from the layer's."""
    return {k: v.detach() + 1.0 for k, v in layer.state_dict().items()}


def _truncated(sd: dict, layer: nn.Module) -> dict:
    return dict(list(sd.items())[:3])


def _other_naming(sd: dict, layer: nn.Module) -> dict:
    return convert_attention_state_dict(sd, layer.param_names, "wan")


def _extra_key(sd: dict, layer: nn.Module) -> dict:
    return {**sd, "to_q.lora_A.weight": torch.zeros(4, DIM)}


def _mis_shaped(sd: dict, layer: nn.Module) -> dict:
    last = list(sd)[-1]  # torch's loader would have copied every key before it
    return {**sd, last: torch.zeros(sd[last].shape[0] + 1, *sd[last].shape[1:])}


def _not_a_tensor(sd: dict, layer: nn.Module) -> dict:
    return {**sd, "norm_k.weight": sd["norm_k.weight"].tolist()}


def _meta_tensor(sd: dict, layer: nn.Module) -> dict:
    return {**sd, "to_v.bias": sd["to_v.bias"].to("meta")}


LOAD_FAILURES = {
    "truncated": (_truncated, True, ["expected the keys of this layer", "missing [", "'to_v.weight'", "unexpected []"]),
    "other-naming": (_other_naming, True, ["unexpected ['q.weight'", "renamed from 'wan' naming they match: "
                                           "convert_attention_state_dict(state_dict, 'wan', "]),
    "extra-key": (_extra_key, True, ["got missing [], unexpected ['to_q.lora_A.weight']"]),
    "mis-shaped": (_mis_shaped, True, ["of shape (", "got ("]),
    "mis-shaped-not-strict": (_mis_shaped, False, ["of shape (", "got ("]),
    "not-a-tensor": (_not_a_tensor, False, ["expected norm_k.weight to be a tensor, got list"]),
    "meta-tensor": (_meta_tensor, True, ["expected to_v.bias to hold data (it is copied), got a meta tensor"]),
    "not-a-mapping": (lambda sd, layer: list(sd.items()), True, ["expected a mapping of key -> tensor, got list"]),
}


@pytest.mark.parametrize("kind", ["self", "cross-i2v"])
@pytest.mark.parametrize("case", list(LOAD_FAILURES))
def test_failed_load_state_dict_leaves_the_layer_unchanged(case: str, kind: str) -> None:
    """torch's ``load_state_dict`` copies every matching tensor and raises at the end (a half-loaded layer);
    the layers check the whole dict first: every parameter and buffer is bit-identical (the same objects)
    after a failed load, and the error is a RuntimeError as torch's, naming expected and actual."""
    layer = _layer_under_test(kind)
    make, strict, fragments = LOAD_FAILURES[case]
    bad = make(_good_state_dict(layer), layer)
    objects = _tensors(layer)
    before = {k: v.detach().clone() for k, v in objects.items()}
    with pytest.raises(StateDictMismatchError) as info:
        layer.load_state_dict(bad, strict=strict)
    assert isinstance(info.value, RuntimeError)
    text = str(info.value)
    assert text.startswith(f"{type(layer).__name__}.load_state_dict: expected") and text.endswith("nothing was loaded")
    for fragment in fragments:
        assert fragment in text, text
    after = _tensors(layer)
    assert after.keys() == objects.keys() and all(after[k] is objects[k] for k in objects)
    for key, value in before.items():
        assert torch.equal(after[key], value), key


def test_load_state_dict_otherwise_keeps_torchs_semantics() -> None:
    """Valid loads equal ``nn.Module.load_state_dict`` (strict, ``strict=False`` with its missing / unexpected
    keys, ``assign``); a shape mismatch raises with ``strict=False`` too, as in torch, but copies nothing."""
    layer = _layer_under_test("self")
    twin = _layer_under_test("self")
    sd = _good_state_dict(layer)
    partial = {**dict(list(sd.items())[:4]), "extra.weight": torch.zeros(1)}
    got, want = layer.load_state_dict(partial, strict=False), nn.Module.load_state_dict(twin, partial, strict=False)
    assert got == want and got.missing_keys and got.unexpected_keys == ["extra.weight"]
    for (key, a), b in zip(layer.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(a, b), key
    bad = {**partial, "to_out.bias": torch.zeros(DIM + 1)}
    with pytest.raises(StateDictMismatchError, match=r"expected to_out.bias of shape \(48,\), got \(49,\)"):
        layer.load_state_dict(bad, strict=False)
    with pytest.raises(RuntimeError, match="size mismatch"):  # torch's own loader: it copied the rest first
        nn.Module.load_state_dict(twin, {**bad, "to_q.weight": sd["to_q.weight"] + 1}, strict=False)
    assert not torch.equal(twin.to_q.weight, layer.to_q.weight)
    assert layer.load_state_dict(sd) == nn.Module.load_state_dict(twin, sd)  # strict: all keys
    for (key, a), b in zip(layer.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(a, b), key
    fresh = {k: v.clone() for k, v in sd.items()}
    layer.load_state_dict(fresh, assign=True)
    assert layer.to_q.weight.data_ptr() == fresh["to_q.weight"].data_ptr()


def test_load_state_dict_with_a_load_hook_is_torchs() -> None:
    """A submodule that loads by its own rules (here a pre-hook renaming Wan keys) is loaded by torch as
    is: the up-front check must not refuse what that hook makes loadable."""
    layer = _layer_under_test("self")
    wan_named = convert_attention_state_dict(_good_state_dict(layer), "ardiff", "wan")

    def rename(module, state_dict, prefix, *args) -> None:  # noqa: ANN001, ANN002
        for key in [k for k in state_dict if k.startswith(prefix)]:
            renamed = convert_attention_state_dict({key[len(prefix):]: state_dict[key]}, "wan", "ardiff")
            state_dict[prefix + next(iter(renamed))] = state_dict.pop(key)

    layer.register_load_state_dict_pre_hook(rename)
    layer.load_state_dict(wan_named)
    assert torch.equal(layer.to_q.weight, wan_named["q.weight"])


@pytest.mark.parametrize("param_names", ["wan", "diffusers"])
def test_checkpoint_named_layers_compile_fullgraph_one_frame(param_names: str) -> None:
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    try:
        layer = ChunkSelfAttention(DIM, HEADS, qk_norm="full", param_names=param_names).eval()
        cross = CachedCrossAttention(DIM, HEADS, qk_norm="full", param_names=param_names, image_cache_name="image")
        rope = VideoRotaryEmbedding(HEAD_DIM, H, W)

        def step(x: torch.Tensor, kv) -> torch.Tensor:  # noqa: ANN001
            return cross(layer(x, kv, rope), kv)

        counter = CompileCounter()
        compiled = torch.compile(step, backend=counter, fullgraph=True)
        state = make_layer_cache((CrossAttentionSpec("text", 3), CrossAttentionSpec("image", 2))).open_session()
        populate_cross_attention(state, "cond", [cross], torch.randn(1, 3, DIM))
        populate_cross_attention(state, "cond", [cross], torch.randn(2, DIM), cache_name="image")
        with torch.no_grad():
            for _ in range(6):
                x = torch.randn(1, CHUNK, DIM)
                with state.prepare_forward(("cond",), CHUNK, commit_current=True) as fwd:
                    torch.testing.assert_close(compiled(x, fwd.layers[0]), step(x, fwd.layers[0]))
        assert counter.frame_count == 1
        state.close()
    finally:
        torch._dynamo.reset()
