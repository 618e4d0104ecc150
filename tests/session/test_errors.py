"""Every user-reachable misuse of DESIGN.md section 6.

Each test asserts the specific exception class, that the message names the expected and
the actual value, and that the pool (free queue, refcounts, K/V contents), the session and
another session are exactly as before.
"""

from __future__ import annotations

import pytest
import torch

from ardiff_modules import (
    ARDiffError,
    CachedCrossAttention,
    CapacityError,
    ChunkSelfAttention,
    KVCache,
    KVCacheSpec,
    KVState,
    PendingContextError,
    SpecError,
    TensorMismatchError,
    chunk_attention,
    populate_cross_attention,
)
from ardiff_modules.errors import (
    CrossAttentionNotPopulatedError,
    SequenceLengthError,
    SessionClosedError,
    UnknownBranchError,
    UnknownCacheError,
)
from tests.support.kv_writes import write_every_layer
from tests.support.small_cache import CHUNK
from tests.support.two_sessions import TWO_SESSIONS_SPEC, assert_sessions_unchanged, build, session_snapshot, text_pairs

def message(exc_info) -> str:
    return str(exc_info.value)


# ---------------------------------------------------------------------- misaligned seq_len


@pytest.mark.parametrize("seq_len", [0, -4, 1, 5, 6, 4.0, True, "4"])
@pytest.mark.parametrize("entry", ["get_kv_caches", "prepare_paged_context", "prepare_forward", "cache"])
def test_misaligned_seq_len(entry, seq_len, two_sessions):
    cache, a, b = two_sessions
    before = session_snapshot(cache)
    calls = {
        "get_kv_caches": lambda: a.get_kv_caches("uncond", seq_len, True),
        "prepare_paged_context": lambda: a.prepare_paged_context("uncond", seq_len, True),
        "prepare_forward": lambda: a.prepare_forward(("uncond",), seq_len, True),
        "cache": lambda: cache.prepare_forward([(a, "uncond"), (b, "uncond")], seq_len, True),
    }
    with pytest.raises(SequenceLengthError) as exc_info:
        calls[entry]()
    assert isinstance(exc_info.value, ValueError) and isinstance(exc_info.value, ARDiffError)
    assert "chunk_size=4" in message(exc_info)
    assert f"got {seq_len!r}" in message(exc_info)
    assert_sessions_unchanged(cache, before)


@pytest.mark.parametrize("entry", ["get_kv_caches", "prepare_forward"])
def test_seq_len_none(entry, two_sessions):
    cache, a, b = two_sessions
    before = session_snapshot(cache)
    with pytest.raises(SequenceLengthError) as exc_info:
        if entry == "get_kv_caches":
            a.get_kv_caches("uncond")
        else:
            a.prepare_forward(("uncond",))
    assert "chunk_size=4" in message(exc_info) and "got None" in message(exc_info)
    assert_sessions_unchanged(cache, before)


# ---------------------------------------------------------------------- unknown branch

UNKNOWN_BRANCH_CALLS = {
    "get_kv_caches": lambda a: a.get_kv_caches("negative", CHUNK, True),
    "prepare_forward_batched": lambda a: a.prepare_forward(("uncond", "negative"), CHUNK, True),
    "cache.prepare_forward": lambda a: a.cache.prepare_forward([(a, "uncond"), (a, "negative")], CHUNK, True),
    "commit_paged_context": lambda a: a.commit_paged_context("negative"),
    "abort": lambda a: a.abort("negative"),
    "token_offset": lambda a: a.token_offset("negative"),
    "committed_chunks": lambda a: a.committed_chunks("negative"),
    "history_chunks": lambda a: a.history_chunks("negative"),
    "pending_chunks": lambda a: a.pending_chunks("negative"),
    "is_cross_attention_populated": lambda a: a.is_cross_attention_populated("negative", "text"),
    "populate_cross_attention": lambda a: a.populate_cross_attention("negative", "text", text_pairs()),
    "get_cross_attention_kv": lambda a: a.get_cross_attention_kv("negative", "text"),
}


@pytest.mark.parametrize("call", list(UNKNOWN_BRANCH_CALLS))
def test_unknown_branch(call, two_sessions):
    cache, a, b = two_sessions
    before = session_snapshot(cache)
    with pytest.raises(UnknownBranchError) as exc_info:
        UNKNOWN_BRANCH_CALLS[call](a)
    assert isinstance(exc_info.value, KeyError)
    msg = message(exc_info)
    assert "'negative'" in msg and "('cond', 'uncond')" in msg
    assert not msg.startswith('"')  # readable, not a KeyError repr
    assert_sessions_unchanged(cache, before)


# ---------------------------------------------------------------------- unknown cache name

UNKNOWN_CACHE_CALLS = {
    "is_cross_attention_populated": lambda a: a.is_cross_attention_populated("cond", "prompt"),
    "populate_cross_attention": lambda a: a.populate_cross_attention("cond", "prompt", text_pairs()),
    "get_cross_attention_kv": lambda a: a.get_cross_attention_kv("cond", "prompt"),
    "reset_keep": lambda a: a.reset(keep_cross_attention=("text", "prompt")),
}


@pytest.mark.parametrize("call", list(UNKNOWN_CACHE_CALLS))
def test_unknown_cache_name(call, two_sessions):
    cache, a, b = two_sessions
    before = session_snapshot(cache)
    with pytest.raises(UnknownCacheError) as exc_info:
        UNKNOWN_CACHE_CALLS[call](a)
    assert isinstance(exc_info.value, KeyError)
    msg = message(exc_info)
    assert "'prompt'" in msg
    assert "'text'" in msg and "'image'" in msg  # the expected names
    assert_sessions_unchanged(cache, before)


def test_unknown_cache_name_in_a_forward(two_sessions):
    cache, a, b = two_sessions
    fwd = cache.prepare_forward([(a, "cond")], CHUNK)  # 'text' populated, 'image' not
    before = session_snapshot(cache)
    for layer in fwd.layers:
        with pytest.raises(UnknownCacheError) as exc_info:
            layer.cross_kv("prompt")
        msg = message(exc_info)
        assert "'prompt'" in msg
        assert "'text'" in msg and "'image'" in msg  # every cache of the spec, populated or not
    assert_sessions_unchanged(cache, before)


def test_unknown_cache_name_in_cached_cross_attention(two_sessions):
    cache, a, b = two_sessions
    fwd = cache.prepare_forward([(a, "cond")], CHUNK)
    attn = CachedCrossAttention(8, 2, cache_name="prompt", head_dim=4)
    before = session_snapshot(cache)
    with pytest.raises(UnknownCacheError) as exc_info:
        attn(torch.randn(1, CHUNK, 8), fwd.layers[0])
    assert "'prompt'" in message(exc_info) and "'text'" in message(exc_info)
    assert_sessions_unchanged(cache, before)


# ---------------------------------------------------------------------- closed session

CLOSED_CALLS = {
    "get_kv_caches": lambda s: s.get_kv_caches("cond", CHUNK),
    "prepare_forward": lambda s: s.prepare_forward(None, CHUNK, True),
    "cache.prepare_forward": lambda s: s.cache.prepare_forward(
        [(s.cache.sessions["b"], "uncond"), (s, "uncond")], CHUNK, True
    ),
    "commit_paged_context": lambda s: s.commit_paged_context("cond"),
    "abort": lambda s: s.abort(),
    "token_offset": lambda s: s.token_offset("cond"),
    "history_chunks": lambda s: s.history_chunks("cond"),
    "is_cross_attention_populated": lambda s: s.is_cross_attention_populated("cond", "text"),
    "populate_cross_attention": lambda s: s.populate_cross_attention("cond", "text", text_pairs()),
    "get_cross_attention_kv": lambda s: s.get_cross_attention_kv("cond", "text"),
    "clear_cross_attention": lambda s: s.clear_cross_attention(),
}


@pytest.mark.parametrize("call", list(CLOSED_CALLS))
def test_closed_session(call, two_sessions):
    cache, a, b = two_sessions
    a.close()
    assert a.pages_in_use() == 0
    assert cache._allocator.used_pages() == (6, 7)  # only b's history is left
    before = session_snapshot(cache)  # a is no longer listed: b and the pool are compared
    with pytest.raises(SessionClosedError) as exc_info:
        CLOSED_CALLS[call](a)
    assert isinstance(exc_info.value, RuntimeError)
    msg = message(exc_info)
    assert "'a'" in msg and "closed" in msg and "expected an open session" in msg
    assert_sessions_unchanged(cache, before)
    assert a.is_closed and a.pages_in_use() == 0


# ---------------------------------------------------------------------- cross cache read before populate


@pytest.mark.parametrize("cleared", [False, True])
def test_cross_read_before_populate_via_get(cleared, two_sessions):
    cache, a, b = two_sessions
    if cleared:
        a.clear_cross_attention()  # prompt switch: populated once, now gone
    before = session_snapshot(cache)
    for branch, name in (("uncond", "text"), ("cond", "image")) + ((("cond", "text"),) if cleared else ()):
        with pytest.raises(CrossAttentionNotPopulatedError) as exc_info:
            a.get_cross_attention_kv(branch, name)
        msg = message(exc_info)
        assert f"{name!r}" in msg and f"{branch!r}" in msg and "'a'" in msg
        assert "before it was populated" in msg
        assert isinstance(exc_info.value, RuntimeError)
    assert_sessions_unchanged(cache, before)


def test_cross_read_before_populate_via_layer_context(two_sessions):
    cache, a, b = two_sessions
    fwd = cache.prepare_forward([(a, "uncond"), (b, "cond")], CHUNK)  # text: only b/cond populated
    before = session_snapshot(cache)
    for layer in fwd.layers:
        with pytest.raises(CrossAttentionNotPopulatedError) as exc_info:
            layer.cross_kv("text")
        msg = message(exc_info)
        assert "'text'" in msg and "'a'/'uncond'" in msg and "populate_cross_attention" in msg
        assert "'b'/'cond'" not in msg  # only the stream that is missing it
    with pytest.raises(CrossAttentionNotPopulatedError):
        CachedCrossAttention(8, 2, cache_name="text", head_dim=4)(torch.randn(2, CHUNK, 8), fwd.layers[1])
    assert_sessions_unchanged(cache, before)


# ---------------------------------------------------------------------- pending chunk replaced before commit


@pytest.mark.parametrize("commit_current", [False, True])
def test_pending_committing_forward_replaced(commit_current, two_sessions):
    cache, a, b = two_sessions
    a.get_kv_caches("uncond", CHUNK, commit_current=True)
    before = session_snapshot(cache)
    with pytest.raises(PendingContextError) as exc_info:
        a.get_kv_caches("uncond", CHUNK, commit_current=commit_current)
    msg = message(exc_info)
    assert "'uncond'" in msg and "'a'" in msg and "commit_paged_context('uncond')" in msg
    assert isinstance(exc_info.value, RuntimeError)
    assert_sessions_unchanged(cache, before)


def test_pending_committing_forward_replaced_in_a_batch_allocates_nothing(two_sessions):
    cache, a, b = two_sessions
    a.get_kv_caches("uncond", CHUNK, commit_current=True)
    before = session_snapshot(cache)
    # b/uncond (first in the batch) would need new pages; the guard on a/uncond must stop everything.
    with pytest.raises(PendingContextError):
        cache.prepare_forward([(b, "uncond"), (a, "uncond")], CHUNK, True)
    with pytest.raises(PendingContextError):
        a.prepare_forward(None, 2 * CHUNK, True)  # cond would grow to 2 chunks
    assert_sessions_unchanged(cache, before)


# ---------------------------------------------------------------------- capacity exhausted


def test_capacity_exhausted_single_branch():
    cache, a, b = build(num_pages=12)  # free: 10, 11
    before = session_snapshot(cache)
    with pytest.raises(CapacityError) as exc_info:
        b.prepare_forward(("uncond",), 2 * CHUNK, True)
    err = exc_info.value
    assert (err.needed, err.free) == (4, 2)
    assert "needs 4 more pages" in str(err) and "only 2 of 12 are free" in str(err)
    assert isinstance(err, RuntimeError)
    assert_sessions_unchanged(cache, before)


def test_capacity_exhausted_counts_reused_pending_pages():
    cache, a, b = build(num_pages=12)
    # a/cond already holds one pending chunk: growing it to 3 chunks needs 4 pages, not 6.
    before = session_snapshot(cache)
    with pytest.raises(CapacityError) as exc_info:
        a.prepare_forward(("cond",), 3 * CHUNK)
    assert (exc_info.value.needed, exc_info.value.free) == (4, 2)
    assert_sessions_unchanged(cache, before)
    a.prepare_forward(("cond",), 2 * CHUNK)  # 2 pages: fits
    assert a.pending_chunks("cond") == ((8, 9), (10, 11))


@pytest.mark.parametrize("order", ["fits_first", "fits_second"])
def test_capacity_exhausted_batched_two_branches_allocates_nothing(order):
    cache, a, b = build(num_pages=12)  # 2 free pages: one branch's chunk would fit, not two
    streams = [(b, "cond"), (b, "uncond")] if order == "fits_first" else [(b, "uncond"), (b, "cond")]
    before = session_snapshot(cache)
    with pytest.raises(CapacityError) as exc_info:
        cache.prepare_forward(streams, CHUNK, True)
    assert (exc_info.value.needed, exc_info.value.free) == (4, 2)
    assert "2 stream(s)" in message(exc_info)
    assert_sessions_unchanged(cache, before)
    with pytest.raises(CapacityError):
        b.prepare_forward(None, CHUNK, True)
    assert_sessions_unchanged(cache, before)


def test_capacity_exhausted_batched_across_sessions():
    cache, a, b = build(num_pages=12)
    before = session_snapshot(cache)
    with pytest.raises(CapacityError):
        cache.prepare_forward([(a, "uncond"), (b, "uncond")], CHUNK, True)
    assert_sessions_unchanged(cache, before)


# ---------------------------------------------------------------------- tensor shape / dtype / device


def qkv(streams=1, seq=CHUNK, heads=2, kv_heads=2, dim=4, dtype=torch.float32, device="cpu"):
    q = torch.randn(streams, seq, heads, dim, dtype=dtype, device=device)
    k = torch.randn(streams, seq, kv_heads, dim, dtype=dtype, device=device)
    return q, k, torch.randn_like(k)


def replace(t: tuple, index: int, value) -> tuple:
    out = list(t)
    out[index] = value
    return tuple(out)


@pytest.mark.parametrize(
    "which,bad,fragments",
    [
        ("q", torch.randn(1, 8, 2, 4), ["chunk_attention q", "(1, 4, num_heads, 4)", "(1, 8, 2, 4)"]),
        ("q", torch.randn(2, 4, 2, 4), ["chunk_attention q", "(1, 4, num_heads, 4)", "(2, 4, 2, 4)"]),
        ("q", torch.randn(1, 4, 2, 8), ["chunk_attention q", "(1, 4, num_heads, 4)", "(1, 4, 2, 8)"]),
        ("q", torch.randn(4, 2, 4), ["chunk_attention q", "(4, 2, 4)"]),
        ("q", torch.randn(1, 4, 3, 4), ["chunk_attention q", "num_kv_heads=2", "got 3"]),
        ("k", torch.randn(1, 4, 1, 4), ["chunk_attention k", "(1, 4, 2, 4)", "(1, 4, 1, 4)"]),
        ("k", torch.randn(1, 8, 2, 4), ["chunk_attention k", "(1, 4, 2, 4)", "(1, 8, 2, 4)"]),
        ("v", torch.randn(1, 4, 2, 3), ["chunk_attention v", "(1, 4, 2, 4)", "(1, 4, 2, 3)"]),
        ("q", torch.randn(1, 4, 2, 4, dtype=torch.float64), ["chunk_attention q", "torch.float32", "torch.float64"]),
        ("k", torch.randn(1, 4, 2, 4, dtype=torch.float16), ["chunk_attention k", "torch.float32", "torch.float16"]),
        ("v", torch.randn(1, 4, 2, 4, dtype=torch.bfloat16), ["chunk_attention v", "torch.float32", "torch.bfloat16"]),
        ("q", torch.empty(1, 4, 2, 4, device="meta"), ["chunk_attention q", "expected device cpu", "got meta"]),
        ("k", torch.empty(1, 4, 2, 4, device="meta"), ["chunk_attention k", "expected device cpu", "got meta"]),
        ("v", torch.empty(1, 4, 2, 4, device="meta"), ["chunk_attention v", "expected device cpu", "got meta"]),
    ],
)
def test_chunk_attention_wrong_tensor(which, bad, fragments, two_sessions):
    cache, a, b = two_sessions
    fwd = cache.prepare_forward([(a, "uncond")], CHUNK, True)
    before = session_snapshot(cache)
    args = replace(qkv(), "qkv".index(which), bad)
    with pytest.raises(TensorMismatchError) as exc_info:
        chunk_attention(*args, fwd.layers[1])
    assert isinstance(exc_info.value, ValueError)
    for fragment in fragments:
        assert fragment in message(exc_info), (fragment, message(exc_info))
    assert_sessions_unchanged(cache, before)  # nothing written into the pending pages


def test_chunk_self_attention_wrong_input_rank(two_sessions):
    cache, a, b = two_sessions
    fwd = cache.prepare_forward([(a, "uncond")], CHUNK, True)
    attn = ChunkSelfAttention(8, 2, head_dim=4)
    before = session_snapshot(cache)
    with pytest.raises(TensorMismatchError) as exc_info:
        attn(torch.randn(CHUNK, 8), fwd.layers[0])
    assert "[streams, seq_len, dim]" in message(exc_info) and "(4, 8)" in message(exc_info)
    assert_sessions_unchanged(cache, before)


@pytest.mark.parametrize(
    "make_attn,x,fragments",
    [
        # seq_len of the forward is 4, the input has 8 tokens
        (lambda: ChunkSelfAttention(8, 2, head_dim=4), torch.randn(1, 8, 8), ["(1, 4, num_heads, 4)", "(1, 8, 2, 4)"]),
        # two streams given, the forward has one
        (lambda: ChunkSelfAttention(8, 2, head_dim=4), torch.randn(2, 4, 8), ["(1, 4, num_heads, 4)", "(2, 4, 2, 4)"]),
        # module head_dim does not match the pool's
        (lambda: ChunkSelfAttention(8, 1, head_dim=8), torch.randn(1, 4, 8), ["(1, 4, num_heads, 4)", "(1, 4, 1, 8)"]),
        # module K/V heads do not match the pool's
        (
            lambda: ChunkSelfAttention(8, 2, num_kv_heads=1, head_dim=4),
            torch.randn(1, 4, 8),
            ["chunk_attention k", "(1, 4, 2, 4)", "(1, 4, 1, 4)"],
        ),
        # module runs in float64, the pool is float32
        (
            lambda: ChunkSelfAttention(8, 2, head_dim=4).double(),
            torch.randn(1, 4, 8, dtype=torch.float64),
            ["torch.float32", "torch.float64"],
        ),
    ],
)
def test_chunk_self_attention_wrong_tensor(make_attn, x, fragments, two_sessions):
    cache, a, b = two_sessions
    fwd = cache.prepare_forward([(a, "uncond")], CHUNK, True)
    attn = make_attn()
    before = session_snapshot(cache)
    with pytest.raises(TensorMismatchError) as exc_info:
        attn(x, fwd.layers[0])
    for fragment in fragments:
        assert fragment in message(exc_info), (fragment, message(exc_info))
    assert_sessions_unchanged(cache, before)


def test_cached_cross_attention_wrong_query(two_sessions):
    from ardiff_modules import cached_cross_attention

    cache, a, b = two_sessions
    fwd = cache.prepare_forward([(a, "cond")], CHUNK)
    before = session_snapshot(cache)
    with pytest.raises(TensorMismatchError) as exc_info:
        cached_cross_attention(torch.randn(1, CHUNK, 2, 8), fwd.layers[0], "text")
    assert "(1, 4, 2, 8)" in message(exc_info) and "(1, seq_len, a multiple of 2 heads, 4)" in message(exc_info)
    with pytest.raises(TensorMismatchError) as exc_info:
        cached_cross_attention(torch.randn(1, CHUNK, 2, 4, dtype=torch.float64), fwd.layers[0], "text")
    assert "torch.float32" in message(exc_info) and "torch.float64" in message(exc_info)
    assert_sessions_unchanged(cache, before)


def _with_layer(pairs, layer, which, value):
    pairs = list(pairs)
    k, v = pairs[layer]
    pairs[layer] = (value, v) if which == "k" else (k, value)
    return pairs


@pytest.mark.parametrize(
    "layer,which,bad,fragments",
    [
        (0, "k", torch.zeros(4, 2, 4), ["layer 0 k", "(3, 2, 4)", "(4, 2, 4)"]),
        (1, "v", torch.zeros(3, 1, 4), ["layer 1 v", "(3, 2, 4)", "(3, 1, 4)"]),
        (1, "k", torch.zeros(3, 2, 4, 1), ["layer 1 k", "(3, 2, 4)", "(3, 2, 4, 1)"]),
        (1, "k", [[0.0]], ["layer 1 k", "(3, 2, 4)", "list"]),
        (1, "v", torch.zeros(3, 2, 4, dtype=torch.int64), ["layer 1 v", "floating", "torch.int64"]),
        (1, "k", torch.zeros(3, 2, 4, dtype=torch.bool), ["layer 1 k", "floating", "torch.bool"]),
        (0, "v", torch.empty(3, 2, 4, device="meta"), ["layer 0 v", "expected device cpu", "got meta"]),
    ],
)
def test_populate_cross_attention_wrong_tensor(layer, which, bad, fragments, two_sessions):
    cache, a, b = two_sessions
    before = session_snapshot(cache)
    with pytest.raises(TensorMismatchError) as exc_info:
        a.populate_cross_attention("cond", "text", _with_layer(text_pairs(9.0), layer, which, bad))
    for fragment in fragments:
        assert fragment in message(exc_info), (fragment, message(exc_info))
    assert "'text'" in message(exc_info)
    assert_sessions_unchanged(cache, before)  # a's previous 'text' cache still visible, unchanged


@pytest.mark.parametrize("layers", [0, 1, 3])
def test_populate_cross_attention_wrong_layer_count(layers, two_sessions):
    cache, a, b = two_sessions
    before = session_snapshot(cache)
    with pytest.raises(TensorMismatchError) as exc_info:
        a.populate_cross_attention("cond", "text", text_pairs(9.0, layers=layers))
    assert "expected 2 layers" in message(exc_info)
    assert (f"got {layers}" if layers < 2 else "got more") in message(exc_info)
    assert_sessions_unchanged(cache, before)


def test_populate_cross_attention_module_helper_wrong_shapes(two_sessions):
    cache, a, b = two_sessions
    layers = [CachedCrossAttention(8, 2, cache_name="text", context_dim=6, head_dim=4) for _ in range(2)]
    before = session_snapshot(cache)
    # context of the wrong rank
    with pytest.raises(TensorMismatchError) as exc_info:
        populate_cross_attention(a, "cond", layers, torch.randn(2, 3, 6))  # [1, tokens, dim] is accepted (diffusers)
    assert "[tokens, context_dim]" in message(exc_info) and "(2, 3, 6)" in message(exc_info)
    # wrong token count for the spec's cache
    with pytest.raises(TensorMismatchError) as exc_info:
        populate_cross_attention(a, "cond", layers, torch.randn(5, 6))
    assert "(3, 2, 4)" in message(exc_info) and "(5, 2, 4)" in message(exc_info)
    # second layer projects to the wrong head count
    bad_layers = [layers[0], CachedCrossAttention(8, 1, cache_name="text", context_dim=6, head_dim=4)]
    with pytest.raises(TensorMismatchError) as exc_info:
        populate_cross_attention(a, "cond", bad_layers, torch.randn(3, 6))
    assert "layer 1" in message(exc_info) and "(3, 1, 4)" in message(exc_info)
    assert torch.is_grad_enabled()  # a failure part-way leaves the caller's grad mode as it was (training)
    assert_sessions_unchanged(cache, before)
    populate_cross_attention(a, "cond", layers, torch.randn(3, 6))  # the right shapes work
    assert a.get_cross_attention_kv("cond", "text")[1]["k"].shape == (3, 2, 4)


# ---------------------------------------------------------------------- page_size not dividing chunk_size


@pytest.mark.parametrize("chunk_size,page_size", [(4, 3), (6, 4), (4680, 7), (2, 4)])
def test_page_size_not_dividing_chunk_size(chunk_size, page_size):
    with pytest.raises(SpecError) as exc_info:
        KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, chunk_size=chunk_size, page_size=page_size)
    msg = message(exc_info)
    assert "page_size" in msg and f"chunk_size={chunk_size}" in msg and f"got {page_size}" in msg
    assert isinstance(exc_info.value, ValueError)


# ---------------------------------------------------------------------- duplicate stream


@pytest.mark.parametrize(
    "call",
    [
        lambda cache, a, b: a.prepare_forward(("uncond", "uncond"), CHUNK, True),
        lambda cache, a, b: cache.prepare_forward([(b, "uncond"), (a, "uncond"), (b, "uncond")], CHUNK, True),
        lambda cache, a, b: cache.prepare_forward([(a, "cond"), (a, "cond")], CHUNK),
    ],
    ids=["state", "cache", "cache-pending"],
)
def test_duplicate_stream_in_a_batched_forward(call, two_sessions):
    cache, a, b = two_sessions
    before = session_snapshot(cache)
    with pytest.raises(SpecError) as exc_info:
        call(cache, a, b)
    msg = message(exc_info)
    assert "appears twice" in msg and "expected distinct streams" in msg
    assert "'uncond'" in msg or "'cond'" in msg
    assert_sessions_unchanged(cache, before)


def test_empty_stream_list(two_sessions):
    cache, a, b = two_sessions
    before = session_snapshot(cache)
    with pytest.raises(SpecError) as exc_info:
        a.prepare_forward((), CHUNK)
    assert "expected at least one" in message(exc_info) and "got none" in message(exc_info)
    assert_sessions_unchanged(cache, before)


# ---------------------------------------------------------------------- open_session / reset misuse


def test_open_session_duplicate_id(two_sessions):
    cache, a, b = two_sessions
    before = session_snapshot(cache)
    with pytest.raises(SpecError) as exc_info:
        cache.open_session("b")
    assert "expected a new session id" in message(exc_info) and "'b'" in message(exc_info)
    assert_sessions_unchanged(cache, before)


def test_session_of_another_cache_in_a_forward(two_sessions):
    """A session belongs to the cache that opened it: mixing caches would take pages from one
    allocator and return them to another."""
    cache, a, b = two_sessions
    other_cache = KVCache(TWO_SESSIONS_SPEC, num_pages=16, backend="reference")
    foreign = other_cache.open_session("a")  # same id, other cache
    before, other_before = session_snapshot(cache), session_snapshot(other_cache)
    with pytest.raises(SpecError) as exc_info:
        cache.prepare_forward([(b, "uncond"), (foreign, "cond")], CHUNK, True)
    assert "expected sessions of this KVCache" in message(exc_info) and "'a'" in message(exc_info)
    assert_sessions_unchanged(cache, before)
    assert_sessions_unchanged(other_cache, other_before)


# ---------------------------------------------------------------------- kept latents of a re-cache


def commit_kept(state: KVState, branches: tuple[str, ...], latents: torch.Tensor) -> None:
    """One committing forward over ``branches`` that keeps ``latents`` ``[len(branches), CHUNK, ...]``."""
    with state.prepare_forward(branches, CHUNK, commit_current=True, keep_latents=latents) as fwd:
        write_every_layer(fwd.layers)


@pytest.mark.parametrize(
    ("second", "fragments"),
    [
        (torch.zeros(2, CHUNK, 5), ["'a'/'cond''s rebuilt chunks", "(4, 3) torch.float32", "chunk 1: (4, 5)"]),
        (torch.zeros(2, CHUNK, 3, dtype=torch.float64), ["'a'/'cond''s rebuilt", "chunk 1: (4, 3) torch.float64"]),
    ],
    ids=["trailing-shape", "dtype"],
)
def test_recache_latents_of_mismatched_kept_chunks(second, fragments, two_sessions):
    """Chunks of one stream kept with other trailing shapes (or dtypes) cannot be concatenated: a
    TensorMismatchError naming both, not torch.cat's RuntimeError (or a silent dtype promotion)."""
    cache, a, _ = two_sessions
    a.reset()
    commit_kept(a, TWO_SESSIONS_SPEC.branches, torch.zeros(2, CHUNK, 3))
    commit_kept(a, TWO_SESSIONS_SPEC.branches, second)
    before = session_snapshot(cache)
    with pytest.raises(TensorMismatchError) as exc_info:
        a.recache_latents(keep_sinks=False)
    assert "recache_latents: expected the kept latents of" in message(exc_info)
    for fragment in fragments:
        assert fragment in message(exc_info), message(exc_info)
    assert_sessions_unchanged(cache, before)
    assert a.recache_latents(keep_sinks=True).shape == (2, CHUNK, *second.shape[2:])  # the other chunk alone


def test_recache_latents_of_streams_kept_with_other_trailing_shapes(two_sessions):
    """Two streams kept with other trailing shapes cannot be stacked into one re-cache input."""
    cache, a, _ = two_sessions
    a.reset()
    for _ in range(2):
        commit_kept(a, ("cond",), torch.zeros(1, CHUNK, 3))
        commit_kept(a, ("uncond",), torch.zeros(1, CHUNK, 2, 4))
    before = session_snapshot(cache)
    with pytest.raises(TensorMismatchError) as exc_info:
        a.recache_latents(keep_sinks=False)
    text = message(exc_info)
    assert "expected every stream's kept latents to share one trailing shape" in text
    assert "'a'/'cond': (4, 3) torch.float32" in text and "got 'a'/'uncond': (4, 2, 4) torch.float32" in text
    assert_sessions_unchanged(cache, before)
    assert a.recache_latents(["uncond"], keep_sinks=False).shape == (1, 2 * CHUNK, 2, 4)  # alone: fine
