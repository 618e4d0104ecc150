"""Misuses of the modules, the spec, the pool and the masks (issue 10).

Each row of ``CASES`` is one misuse: the call, the library exception it must raise (never a
bare ``TypeError`` / ``ZeroDivisionError`` / ``IndexError`` / plain ``ValueError``, and never
silent acceptance), and two substrings of the message: the expected value and the actual one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ardiff_modules import (
    ARDiffError,
    BackendUnavailableError,
    CachedCrossAttention,
    ChunkSelfAttention,
    KVCache,
    KVCacheSpec,
    RotaryEmbedding,
    SpecError,
    TensorMismatchError,
    VideoRotaryEmbedding,
    apply_rope,
    cached_cross_attention,
    chunk_attention,
    populate_cross_attention,
)
from ardiff_modules.masks import chunk_visibility, chunk_visibility_name, render_chunk_mask
from ardiff_modules.modules import rotate_half
from ardiff_modules.pool import KVPool, bytes_per_page, pages_for_budget, torch_dtype
from tests.support.small_cache import SMALL_SPEC

DIM = 8  # 2 heads x head_dim 4, matching SMALL_SPEC
T = torch.zeros(1, 4, 2, 4)  # [streams, seq_len, heads, head_dim]
POS = torch.arange(4)[None]


def make_env() -> SimpleNamespace:
    """A cache with one session whose "cond" cross cache is populated and one open forward."""
    cache = KVCache(SMALL_SPEC, num_pages=16, backend="reference")
    state = cache.open_session("a")
    cross = [CachedCrossAttention(DIM, 2, "text") for _ in range(SMALL_SPEC.num_layers)]
    populate_cross_attention(state, "cond", cross, torch.randn(3, DIM))
    forward = state.prepare_forward(("cond",), 4)
    return SimpleNamespace(cache=cache, state=state, cross=cross, forward=forward, layer=forward.layers[0])


@dataclass(frozen=True)
class Case:
    id: str
    call: Callable[[SimpleNamespace], Any]
    exc: type[ARDiffError]
    expected: str  # the part of the message naming the expected value
    actual: str  # the part naming the value that was given


CSA, CCA = ChunkSelfAttention, CachedCrossAttention

CASES = [
    # ------------------------------------------------------------------ ChunkSelfAttention
    Case("csa-heads-0", lambda e: CSA(64, 0), SpecError, "ChunkSelfAttention.num_heads: expected an int >= 1", "got 0"),
    Case("csa-heads-bool", lambda e: CSA(64, True), SpecError, "num_heads: expected an int >= 1", "got True (bool)"),
    Case("csa-dim-not-divisible", lambda e: CSA(64, 5), SpecError,
         "ChunkSelfAttention.dim: expected a multiple of num_heads=5", "got 64"),
    Case("csa-dim-0", lambda e: CSA(0, 2), SpecError, "ChunkSelfAttention.dim: expected an int >= 1", "got 0"),
    Case("csa-dim-float", lambda e: CSA(64.0, 4), SpecError, "dim: expected an int >= 1", "got 64.0 (float)"),
    Case("csa-kv-heads-0", lambda e: CSA(64, 4, num_kv_heads=0), SpecError,
         "num_kv_heads: expected an int >= 1", "got 0"),
    Case("csa-kv-heads-not-dividing", lambda e: CSA(64, 4, num_kv_heads=3), SpecError,
         "num_heads: expected a multiple of num_kv_heads=3", "got 4"),
    Case("csa-head-dim-0", lambda e: CSA(64, 4, head_dim=0), SpecError, "head_dim: expected an int >= 1", "got 0"),
    Case("csa-qk-norm-str", lambda e: CSA(64, 4, qk_norm="rms"), SpecError,
         "ChunkSelfAttention.qk_norm: expected None, 'full' or 'head'", "got 'rms'"),
    Case("csa-qk-norm-bool", lambda e: CSA(64, 4, qk_norm=True), SpecError,
         "qk_norm: expected None, 'full' or 'head'", "got True"),
    Case("csa-eps-negative", lambda e: CSA(64, 4, qk_norm="full", eps=-1e-6), SpecError,
         "ChunkSelfAttention.eps: expected a finite number > 0", "got -1e-06"),
    Case("csa-eps-str", lambda e: CSA(64, 4, eps="x"), SpecError, "eps: expected a finite number > 0", "got 'x' (str)"),
    Case("csa-bias-str", lambda e: CSA(64, 4, bias="yes"), SpecError,
         "ChunkSelfAttention.bias: expected a bool", "got 'yes' (str)"),
    Case("csa-x-2d", lambda e: CSA(DIM, 2)(torch.randn(4, DIM), e.layer), TensorMismatchError,
         "ChunkSelfAttention x: expected shape [streams, seq_len, dim] with width 8", "got (4, 8)"),
    Case("csa-x-width", lambda e: CSA(DIM, 2)(torch.randn(1, 4, 6), e.layer), TensorMismatchError,
         "expected shape [streams, seq_len, dim] with width 8", "got (1, 4, 6)"),
    Case("csa-x-dtype", lambda e: CSA(DIM, 2)(torch.randn(1, 4, DIM, dtype=torch.float64), e.layer),
         TensorMismatchError, "ChunkSelfAttention x: expected dtype torch.float32", "got torch.float64"),
    Case("csa-kv-list", lambda e: CSA(DIM, 2)(torch.randn(1, 4, DIM), e.forward.layers), SpecError,
         "ChunkSelfAttention kv: expected a LayerContext", "got list"),
    Case("csa-rope-int", lambda e: CSA(DIM, 2)(torch.randn(1, 4, DIM), e.layer, rope=5), SpecError,
         "apply_rope.rope: expected None, a callable (t, positions) -> t or a (cos, sin) pair", "got 5 (int)"),
    # ------------------------------------------------------------------ CachedCrossAttention
    Case("cca-heads-0", lambda e: CCA(64, 0), SpecError,
         "CachedCrossAttention.num_heads: expected an int >= 1", "got 0"),
    Case("cca-dim-not-divisible", lambda e: CCA(64, 5), SpecError,
         "CachedCrossAttention.dim: expected a multiple of num_heads=5", "got 64"),
    Case("cca-cache-name-empty", lambda e: CCA(64, 4, ""), SpecError,
         "CachedCrossAttention.cache_name: expected a non-empty string", "got ''"),
    Case("cca-cache-name-int", lambda e: CCA(64, 4, 3), SpecError, "cache_name: expected a non-empty string", "got 3"),
    Case("cca-context-dim-0", lambda e: CCA(64, 4, context_dim=0), SpecError,
         "CachedCrossAttention.context_dim: expected an int >= 1", "got 0"),
    Case("cca-kv-heads-not-dividing", lambda e: CCA(64, 4, num_kv_heads=3), SpecError,
         "CachedCrossAttention.num_heads: expected a multiple of num_kv_heads=3", "got 4"),
    Case("cca-qk-norm", lambda e: CCA(64, 4, qk_norm="x"), SpecError,
         "CachedCrossAttention.qk_norm: expected None, 'full' or 'head'", "got 'x'"),
    Case("project-kv-width", lambda e: CCA(DIM, 2).project_kv(torch.randn(3, 6)), TensorMismatchError,
         "CachedCrossAttention.project_kv context: expected shape [tokens, context_dim] with width 8", "got (3, 6)"),
    Case("project-kv-context-dim", lambda e: CCA(DIM, 2, context_dim=12).project_kv(torch.randn(3, DIM)),
         TensorMismatchError, "with width 12", "got (3, 8)"),
    Case("project-kv-3d", lambda e: CCA(DIM, 2).project_kv(torch.randn(2, 3, DIM)), TensorMismatchError,
         "expected shape [tokens, context_dim]", "got (2, 3, 8)"),
    Case("project-kv-list", lambda e: CCA(DIM, 2).project_kv([[0.0] * DIM]), TensorMismatchError,
         "expected shape [tokens, context_dim]", "got list"),
    Case("project-kv-int-dtype", lambda e: CCA(DIM, 2).project_kv(torch.ones(3, DIM, dtype=torch.int64)),
         TensorMismatchError, "expected dtype torch.float32", "got torch.int64"),
    Case("cca-x-2d", lambda e: CCA(DIM, 2)(torch.randn(4, DIM), e.layer), TensorMismatchError,
         "CachedCrossAttention x: expected shape [streams, seq_len, dim] with width 8", "got (4, 8)"),
    Case("cca-kv-forward-context", lambda e: CCA(DIM, 2)(torch.randn(1, 4, DIM), e.forward), SpecError,
         "CachedCrossAttention kv: expected a LayerContext", "got ForwardContext"),
    # ------------------------------------------------------------------ populate_cross_attention
    Case("populate-no-layers", lambda e: populate_cross_attention(e.state, "cond", [], torch.randn(3, DIM)),
         SpecError, "populate_cross_attention.layers: expected at least one CachedCrossAttention", "got none"),
    Case("populate-one-layer", lambda e: populate_cross_attention(e.state, "cond", e.cross[0], torch.randn(3, DIM)),
         SpecError, "expected an iterable of CachedCrossAttention", "got a CachedCrossAttention"),
    Case("populate-self-attention-layers",
         lambda e: populate_cross_attention(e.state, "cond", [CSA(DIM, 2), CSA(DIM, 2)], torch.randn(3, DIM)),
         SpecError, "expected CachedCrossAttention items", "got ChunkSelfAttention at 0"),
    Case("populate-mixed-cache-names",
         lambda e: populate_cross_attention(e.state, "cond", [CCA(DIM, 2, "text"), CCA(DIM, 2, "image")],
                                            torch.randn(3, DIM)),
         SpecError, "expected one cache_name for all layers", "got ('text', 'image')"),
    Case("populate-state-none", lambda e: populate_cross_attention(None, "cond", e.cross, torch.randn(3, DIM)),
         SpecError, "populate_cross_attention.state: expected a KVState", "got NoneType"),
    Case("populate-context-width", lambda e: populate_cross_attention(e.state, "cond", e.cross, torch.randn(3, 6)),
         TensorMismatchError, "project_kv context: expected shape [tokens, context_dim] with width 8", "got (3, 6)"),
    # ------------------------------------------------------------------ RotaryEmbedding
    Case("rope-odd-head-dim", lambda e: RotaryEmbedding(3), SpecError,
         "RotaryEmbedding.head_dim: expected an even int >= 2", "got 3"),
    Case("rope-head-dim-0", lambda e: RotaryEmbedding(0), SpecError, "head_dim: expected an even int >= 2", "got 0"),
    Case("rope-head-dim-float", lambda e: RotaryEmbedding(4.0), SpecError, "expected an even int", "got 4.0 (float)"),
    Case("rope-theta-0", lambda e: RotaryEmbedding(4, theta=0), SpecError,
         "RotaryEmbedding.theta: expected a finite number > 0", "got 0"),
    Case("rope-theta-nan", lambda e: RotaryEmbedding(4, theta=math.nan), SpecError,
         "theta: expected a finite number > 0", "got nan"),
    Case("rope-theta-str", lambda e: RotaryEmbedding(4, theta="1e4"), SpecError,
         "theta: expected a finite number > 0", "got '1e4' (str)"),
    Case("rope-t-head-dim", lambda e: RotaryEmbedding(4)(torch.zeros(1, 4, 2, 8), POS), TensorMismatchError,
         "RotaryEmbedding t: expected shape (streams, seq_len, heads, 4)", "got (1, 4, 2, 8)"),
    Case("rope-positions-shape", lambda e: RotaryEmbedding(4)(T, torch.arange(5)[None]), TensorMismatchError,
         "RotaryEmbedding positions: expected shape (1, 4)", "got (1, 5)"),
    # ------------------------------------------------------------------ VideoRotaryEmbedding
    Case("video-rope-height-0", lambda e: VideoRotaryEmbedding(12, 0, 4), SpecError,
         "VideoRotaryEmbedding.height: expected an int >= 1", "got 0"),
    Case("video-rope-width-negative", lambda e: VideoRotaryEmbedding(12, 4, -1), SpecError,
         "VideoRotaryEmbedding.width: expected an int >= 1", "got -1"),
    Case("video-rope-height-float", lambda e: VideoRotaryEmbedding(12, 2.0, 4), SpecError,
         "height: expected an int >= 1", "got 2.0 (float)"),
    Case("video-rope-head-dim-4", lambda e: VideoRotaryEmbedding(4, 2, 2), SpecError,
         "VideoRotaryEmbedding.head_dim: expected an even int >= 6", "got 4"),
    Case("video-rope-head-dim-odd", lambda e: VideoRotaryEmbedding(7, 2, 2), SpecError,
         "head_dim: expected an even int >= 6", "got 7"),
    Case("video-rope-theta-negative", lambda e: VideoRotaryEmbedding(12, 2, 2, theta=-1.0), SpecError,
         "VideoRotaryEmbedding.theta: expected a finite number > 0", "got -1.0"),
    Case("video-rope-t-head-dim", lambda e: VideoRotaryEmbedding(12, 2, 2)(T, POS), TensorMismatchError,
         "VideoRotaryEmbedding t: expected shape (streams, seq_len, heads, 12)", "got (1, 4, 2, 4)"),
    # ------------------------------------------------------------------ functional
    Case("rotate-half-odd", lambda e: rotate_half(torch.zeros(2, 3)), TensorMismatchError,
         "rotate_half x: expected a tensor whose last dim is even", "got (2, 3)"),
    Case("rotate-half-0d", lambda e: rotate_half(torch.tensor(1.0)), TensorMismatchError,
         "expected a tensor whose last dim is even", "got ()"),
    Case("apply-rope-one-tensor-tuple", lambda e: apply_rope(T, POS, (torch.ones(4),)), SpecError,
         "apply_rope.rope: expected None, a callable (t, positions) -> t or a (cos, sin) pair", "(tuple)"),
    Case("apply-rope-cos-width", lambda e: apply_rope(T, POS, (torch.ones(6), torch.zeros(6))), TensorMismatchError,
         "apply_rope cos: expected a shape broadcastable to t's (1, 4, 2, 4)", "got (6,)"),
    Case("apply-rope-sin-grows-t", lambda e: apply_rope(T, POS, (torch.ones(4), torch.zeros(3, 1, 4, 2, 4))),
         TensorMismatchError, "apply_rope sin: expected a shape broadcastable to t's (1, 4, 2, 4)",
         "got (3, 1, 4, 2, 4)"),
    Case("apply-rope-hook-shape", lambda e: apply_rope(T, POS, lambda t, p: t[..., :2]), TensorMismatchError,
         "apply_rope: expected the rope hook to return t's shape (1, 4, 2, 4)", "got (1, 4, 2, 2)"),
    Case("apply-rope-hook-none", lambda e: apply_rope(T, POS, lambda t, p: None), TensorMismatchError,
         "expected the rope hook to return t's shape (1, 4, 2, 4)", "got NoneType"),
    Case("apply-rope-t-3d", lambda e: apply_rope(torch.zeros(4, 2, 4), POS, (torch.ones(4), torch.zeros(4))),
         TensorMismatchError, "apply_rope t: expected shape (streams, seq_len, heads, head_dim)", "got (4, 2, 4)"),
    Case("chunk-attention-k-list", lambda e: chunk_attention(T, [0.0], T[:, :, :2], e.layer), TensorMismatchError,
         "chunk_attention k: expected a tensor of shape (1, 4, 2, 4)", "got list"),
    Case("cross-attention-kv-list", lambda e: cached_cross_attention(T, e.forward.layers, "text"), SpecError,
         "cached_cross_attention.kv: expected a LayerContext", "got list"),
    Case("cross-attention-scale-0", lambda e: cached_cross_attention(T, e.layer, "text", scale=0.0), SpecError,
         "cached_cross_attention.scale: expected None or a finite number > 0", "got 0.0"),
    Case("cross-attention-scale-str", lambda e: cached_cross_attention(T, e.layer, "text", scale="x"), SpecError,
         "scale: expected None or a finite number > 0", "got 'x'"),
    Case("cross-attention-q-list", lambda e: cached_cross_attention([0.0], e.layer, "text"), TensorMismatchError,
         "cached_cross_attention q: expected a [streams, seq_len, heads, head_dim] tensor", "got list"),
    # ------------------------------------------------------------------ KVCacheSpec
    Case("spec-branches-set", lambda e: KVCacheSpec(2, 2, 4, 4, 2, branches={"cond", "uncond"}), SpecError,
         "KVCacheSpec.branches: expected an ordered tuple", "(a set)"),
    Case("spec-branches-dict", lambda e: KVCacheSpec(2, 2, 4, 4, 2, branches={"cond": 1}), SpecError,
         "KVCacheSpec.branches: expected an ordered tuple", "got {'cond': 1} (a dict)"),
    Case("spec-cross-attention-name", lambda e: KVCacheSpec(2, 2, 4, 4, 2, cross_attention="text"), SpecError,
         "KVCacheSpec.cross_attention: expected a tuple of CrossAttentionSpec", "got 'text'"),
    Case("spec-pages-per-branch-negative", lambda e: SMALL_SPEC.pages_per_branch(-1), SpecError,
         "pending_chunks: expected an int >= 0", "got -1"),
    Case("spec-pages-per-branch-float", lambda e: SMALL_SPEC.pages_per_branch(1.5), SpecError,
         "pending_chunks: expected an int >= 0", "got 1.5 (float)"),
    # ------------------------------------------------------------------ pool
    Case("pool-pages-0", lambda e: KVPool(SMALL_SPEC, 0), SpecError, "KVPool.num_pages: expected an int >= 1", "got 0"),
    Case("pool-pages-float", lambda e: KVPool(SMALL_SPEC, 2.0), SpecError,
         "KVPool.num_pages: expected an int >= 1", "got 2.0 (float)"),
    Case("pool-spec-none", lambda e: KVPool(None, 4), SpecError, "KVPool.spec: expected a KVCacheSpec", "got None"),
    Case("pool-device-unknown", lambda e: KVPool(SMALL_SPEC, 4, "gpu"), SpecError,
         "KVPool.device: expected a torch.device or a device string", "got 'gpu'"),
    Case("pool-device-none", lambda e: KVPool(SMALL_SPEC, 4, None), SpecError,
         "KVPool.device: expected a torch.device or a device string", "got None"),
    Case("pool-device-absent", lambda e: KVPool(SMALL_SPEC, 4, "cuda:99"), BackendUnavailableError,
         "KVPool.device: expected an available device", "got 'cuda:99'"),
    Case("pool-device-meta", lambda e: KVPool(SMALL_SPEC, 4, "meta"), SpecError,
         "KVPool.device: expected a device that holds data", "got 'meta'"),
    Case("cache-device-meta", lambda e: KVCache(SMALL_SPEC, num_pages=4, device=torch.device("meta")), SpecError,
         "KVPool.device: expected a device that holds data", "got device(type='meta')"),
    Case("pool-k-pages-out-of-range", lambda e: e.cache._pool.k_pages(2), SpecError,
         "KVPool.k_pages.layer: expected an int in [0, 2)", "got 2"),
    Case("pool-k-pages-negative", lambda e: e.cache._pool.k_pages(-1), SpecError,
         "KVPool.k_pages.layer: expected an int in [0, 2)", "got -1"),
    Case("pool-v-pages-float", lambda e: e.cache._pool.v_pages(1.0), SpecError,
         "KVPool.v_pages.layer: expected an int in [0, 2)", "got 1.0 (float)"),
    Case("pool-token-slots-3d", lambda e: KVPool.token_slots(torch.zeros(2, 3, 4)), TensorMismatchError,
         "KVPool.token_slots pages: expected a contiguous [num_pages, page_size, heads, head_dim] tensor",
         "got (2, 3, 4)"),
    Case("pool-token-slots-non-contiguous",
         lambda e: KVPool.token_slots(torch.zeros(2, 4, 2, 4).transpose(0, 1)), TensorMismatchError,
         "expected a contiguous [num_pages, page_size, heads, head_dim] tensor", "got (4, 2, 2, 4) (contiguous=False)"),
    Case("pool-dtype-list", lambda e: torch_dtype([]), SpecError,
         "dtype: expected one of ('bfloat16', 'float16', 'float32', 'float8_e4m3fn')", "got []"),
    Case("pool-budget-float", lambda e: pages_for_budget(SMALL_SPEC, 1.5e9), SpecError,
         "pages_for_budget.budget_bytes: expected an int >= 1", "got 1500000000.0 (float)"),
    Case("pool-bytes-per-page-str", lambda e: bytes_per_page("float32"), SpecError,
         "bytes_per_page.spec: expected a KVCacheSpec", "got 'float32' (str)"),
    # ------------------------------------------------------------------ masks
    Case("mask-committed-negative", lambda e: chunk_visibility(-1, 1, 0, None), SpecError,
         "chunk_visibility.num_committed: expected an int >= 0", "got -1"),
    Case("mask-pending-0", lambda e: chunk_visibility(2, 0, 0, None), SpecError,
         "chunk_visibility.num_pending: expected an int >= 1", "got 0"),
    Case("mask-committed-float", lambda e: chunk_visibility(2.0, 1, 0, None), SpecError,
         "num_committed: expected an int >= 0", "got 2.0 (float)"),
    Case("mask-sink-negative", lambda e: chunk_visibility(2, 1, -1, None), SpecError,
         "chunk_visibility.sink_chunks: expected an int >= 0", "got -1"),
    Case("mask-window-float", lambda e: chunk_visibility(2, 1, 0, 1.5), SpecError,
         "chunk_visibility.window_chunks: expected an int >= 0", "got 1.5 (float)"),
    Case("mask-name-sink-negative", lambda e: chunk_visibility_name(-1, None), SpecError,
         "chunk_visibility_name.sink_chunks: expected an int >= 0", "got -1"),
    Case("mask-name-window-str", lambda e: chunk_visibility_name(0, "all"), SpecError,
         "chunk_visibility_name.window_chunks: expected an int >= 0", "got 'all' (str)"),
    Case("render-path-none", lambda e: render_chunk_mask(None, 2, 1, 0, None), SpecError,
         "render_chunk_mask.path: expected a str or os.PathLike", "got None"),
    Case("render-committed-negative", lambda e: render_chunk_mask("never-written.png", -1, 1, 0, None), SpecError,
         "chunk_visibility.num_committed: expected an int >= 0", "got -1"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_misuse_raises_a_specific_error_naming_expected_and_actual(case: Case) -> None:
    env = make_env()
    with pytest.raises(case.exc) as exc_info:
        case.call(env)
    assert type(exc_info.value) is case.exc  # the exact class, not just some ARDiffError
    message = str(exc_info.value)
    assert case.expected in message, message
    assert case.actual in message, message


def test_case_ids_are_unique() -> None:
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize(
    "call",
    [
        lambda: CSA(64, 4, qk_norm="rms"),
        lambda: CCA(64, 4, num_kv_heads=3),
        lambda: RotaryEmbedding(3),
        lambda: VideoRotaryEmbedding(5, 2, 2),
    ],
    ids=["qk-norm", "gqa", "rope-odd", "video-rope-odd"],
)
def test_formerly_plain_value_errors_are_still_value_errors(call: Callable[[], Any]) -> None:
    """Code written against the old plain ``ValueError`` keeps catching them."""
    with pytest.raises(ValueError) as exc_info:
        call()
    assert isinstance(exc_info.value, SpecError)


def test_failed_populate_keeps_the_previous_cache() -> None:
    env = make_env()
    before = env.state.get_cross_attention_kv("cond", "text")
    with pytest.raises(TensorMismatchError):
        populate_cross_attention(env.state, "cond", env.cross, torch.randn(3, 6))
    after = env.state.get_cross_attention_kv("cond", "text")
    for old, new in zip(before, after):
        assert torch.equal(old["k"], new["k"]) and torch.equal(old["v"], new["v"])


def test_valid_edge_inputs_still_work() -> None:
    """Boundary values just inside each validator are accepted, with the same results as before."""
    attn = CSA(64, 5, head_dim=12)  # an explicit head_dim makes a non-divisible dim fine
    assert attn.to_q.out_features == 60 and attn.num_kv_heads == 5
    cross = CCA(8, 2, "image", context_dim=12, num_kv_heads=1, qk_norm="full", eps=1, bias=False)
    assert cross.to_k.in_features == 12 and cross.head_dim == 4
    assert RotaryEmbedding(2, theta=500).inv_freq.shape == (1,)
    assert VideoRotaryEmbedding(6, 1, 1).dims == (2, 2, 2)
    assert SMALL_SPEC.pages_per_branch(0) == 3 * SMALL_SPEC.pages_per_chunk
    assert KVCacheSpec(1, 1, 1, 1, 1, branches=iter(["b", "a"])).branches == ("b", "a")
    pool = KVPool(SMALL_SPEC, 1, torch.device("cpu"))
    assert pool.k_pages(SMALL_SPEC.num_layers - 1).shape == (1, 2, 2, 4)
    assert chunk_visibility(0, 1, 0, 0).tolist() == [[True]]
    assert chunk_visibility_name(0, None) == "sink0_windowall"
    assert pages_for_budget(SMALL_SPEC, bytes_per_page(SMALL_SPEC)) == 1
    # A (cos, sin) pair broadcast over heads, and the identity pair.
    torch.testing.assert_close(apply_rope(T + 1, POS, (torch.ones(1, 4, 1, 4), torch.zeros(1, 4, 1, 4))), T + 1)


def test_dtype_other_than_the_weights_is_allowed_under_autocast() -> None:
    layer = CCA(DIM, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        k, v = layer.project_kv(torch.randn(3, DIM, dtype=torch.bfloat16))
    assert k.shape == v.shape == (3, 2, 4)


def test_layer_context_look_alikes_are_still_accepted() -> None:
    """``kv`` is duck-typed: anything with ``cross_kv`` serves cross-attention (the benchmarks rely on it)."""
    k = v = torch.randn(1, 3, 2, 4)
    look_alike = SimpleNamespace(cross_kv=lambda name: (k, v))
    out = CCA(DIM, 2)(torch.randn(1, 4, DIM), look_alike)
    assert out.shape == (1, 4, DIM)
