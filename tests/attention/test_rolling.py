"""Rolling-window denoising (Rolling Forcing): ``pending_attention="bidirectional"`` (issue 16, item 3).

The rule: in a forward over ``n`` pending chunks of one stream, every pending query chunk attends to
``sink chunks ∪ window chunks ∪ pending chunks 0..n-1`` -- one softmax over all of it. History and commits
are exactly as under the default ``"block_causal"`` rule. On FlashInfer this is one kernel row per stream
(ragged when the stream's pages are one run, structural paged otherwise), never the masked path.
"""

from __future__ import annotations

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.layout import ForwardLayout, StreamLayout
from ardiff_modules.masks import chunk_visibility, chunk_visibility_name
from tests.support.gpu import NEEDS_GPU, gpu_qkv, gpu_spec
from tests.support.streaming_model import LibraryStreaming, NaiveStreaming, TinyStreamingModel, play, rollout_events

CHUNK = 4
SLOW = pytest.mark.slow


# ---------------------------------------------------------------------- the oracle
ORACLE_CASES = [
    # page_size, sink, window, kv_heads, spec default, per-forward rules
    pytest.param(1, 1, 2, 4, "bidirectional", None, id="page1-sink1-win2-spec-default"),
    pytest.param(2, 1, 2, 4, "block_causal", "alternate", id="page2-sink1-win2-alternating"),
    pytest.param(4, 0, 3, 4, "bidirectional", "alternate", id="page=chunk-sink0-win3-alternating"),
    pytest.param(2, 2, 1, 2, "block_causal", "bidirectional", id="page2-sink2-win1-gqa", marks=SLOW),
    pytest.param(2, 1, None, 4, "bidirectional", None, id="page2-sink1-unbounded", marks=SLOW),
    pytest.param(2, 1, 0, 4, "block_causal", "bidirectional", id="page2-sink1-win0", marks=SLOW),
    pytest.param(4, 0, 0, 1, "bidirectional", "alternate", id="page=chunk-nohistory-mqa", marks=SLOW),
]


@pytest.mark.parametrize("page_size,sink,window,kv_heads,default,per_forward", ORACLE_CASES)
def test_rollout_matches_cache_free_oracle(
    page_size: int, sink: int, window: int | None, kv_heads: int, default: str, per_forward: str | None
) -> None:
    """1..4 pending chunks, windows filling then evicting, CFG batched and single-branch (seed API) forwards,
    a prompt switch and a reset; the rule from the spec's default or said per forward."""
    torch.manual_seed(0)
    model = TinyStreamingModel(kv_heads=kv_heads).eval()
    spec = model.spec(CHUNK, page_size, sink, window, pending_attention=default)
    pages = 2 * (16 + 8) * spec.pages_per_chunk
    events = rollout_events(16, CHUNK, model.dim, model.context_dim, pending_attention=per_forward)
    library = LibraryStreaming(model, spec, pages)
    expected = play(NaiveStreaming(model, CHUNK, sink, window, pending_attention=default), events)
    actual = play(library, events)
    assert len(actual) == len(expected) >= 30
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, e, atol=2e-5, rtol=2e-5, msg=lambda m, i=i: f"forward {i}: {m}")
    library.state.close()
    assert library.cache._allocator.num_free == pages


@pytest.mark.parametrize("page_size,sink,window", [(2, 1, 2), pytest.param(1, 0, 3, marks=SLOW)])
def test_mixed_chunk_lengths_match_the_cache_free_oracle(page_size: int, sink: int, window: int) -> None:
    """A short (image-to-video) chunk first or last inside bidirectional multi-chunk forwards."""
    torch.manual_seed(0)
    model = TinyStreamingModel().eval()
    spec = model.spec(CHUNK, page_size, sink, window, pending_attention="bidirectional")
    events = rollout_events(16, CHUNK, model.dim, model.context_dim, short_chunk=CHUNK // 2)
    assert any(len(e[4]) > 1 and len(set(e[4])) > 1 for e in events if e[0] == "forward")
    library = LibraryStreaming(model, spec, 2 * (16 + 8) * spec.pages_per_chunk)
    expected = play(NaiveStreaming(model, CHUNK, sink, window, pending_attention="bidirectional"), events)
    actual = play(library, events)
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, e, atol=2e-5, rtol=2e-5, msg=lambda m, i=i: f"forward {i}: {m}")


def test_the_oracle_comparison_is_sensitive_to_the_rule() -> None:
    """A bidirectional rollout differs from a block-causal one (so the oracle tests can fail)."""
    torch.manual_seed(0)
    model = TinyStreamingModel().eval()
    events = rollout_events(6, CHUNK, model.dim, model.context_dim, pending_attention="bidirectional")
    bidirectional = play(LibraryStreaming(model, model.spec(CHUNK, 2, 1, 2), 200), events)
    block_causal = play(NaiveStreaming(model, CHUNK, 1, 2), [e[:5] for e in events])
    multi = [i for i, e in enumerate(e for e in events if e[0] == "forward") if len(e[4]) > 1]
    assert multi and all(not torch.allclose(bidirectional[i], block_causal[i], atol=1e-3) for i in multi)


# ---------------------------------------------------------------------- one attention layer
def _qkv(streams: int, n: int, g: torch.Generator, heads: int = 2, dim: int = 4) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(streams, n, heads, dim, generator=g) for _ in range(3))


def test_only_the_last_pending_chunk_agrees_across_rules() -> None:
    """In one layer, the last pending chunk sees every pending chunk under both rules; earlier ones do
    not under block-causal -- and the bidirectional output is the dense softmax over history + all pending."""
    spec = am.KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=4, chunk_size=4, page_size=2, sink_chunks=1,
                          window_chunks=1, branches=("cond", "uncond"), dtype="float32")
    g = torch.Generator().manual_seed(0)
    outs = {}
    for rule in ("block_causal", "bidirectional"):
        cache = am.KVCache(spec, num_pages=64)
        state = cache.open_session()
        g.manual_seed(0)
        for _ in range(3):  # sink + window full + one evicted
            with state.prepare_forward(None, 4, True) as fwd:
                am.chunk_attention(*_qkv(2, 4, g), fwd.layers[0])
        q, k, v = _qkv(2, 12, g)
        with state.prepare_forward(None, 12, False, pending_attention=rule) as fwd:
            outs[rule] = am.chunk_attention(q, k, v, fwd.layers[0])
            keys = cache._pool.kv[0, 0].reshape(-1, 2, 4)[fwd._layout.dense_keys[0]]  # [S, K, H, D] after the write
            values = cache._pool.kv[0, 1].reshape(-1, 2, 4)[fwd._layout.dense_keys[0]]
    assert torch.equal(outs["bidirectional"][:, 8:], outs["block_causal"][:, 8:])
    assert not torch.allclose(outs["bidirectional"][:, :8], outs["block_causal"][:, :8], atol=1e-3)
    dense = torch.softmax(torch.einsum("snhd,skhd->shnk", q, keys) * 0.5, dim=-1)  # every key visible
    torch.testing.assert_close(outs["bidirectional"], torch.einsum("shnk,skhd->snhd", dense, values))


# ---------------------------------------------------------------------- layout rows (exact)
def _rule_layout(streams: list[tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]], rule: str) -> ForwardLayout:
    return ForwardLayout(
        streams=tuple(StreamLayout(h, p, token_offset=0) for h, p in streams), chunk_size=4, page_size=2,
        pending_attention=rule,  # type: ignore[arg-type]
    )


STREAMS = [((10, 11, 12, 13), ((20, 21), (22, 23), (24, 25))), ((), ((30, 31), (32, 33), (34, 35)))]


def test_structural_rows_are_one_per_stream_when_bidirectional() -> None:
    rows = _rule_layout(STREAMS, "bidirectional").structural_rows
    assert rows.qo_indptr.tolist() == [0, 12, 24]
    assert rows.kv_page_indptr.tolist() == [0, 10, 16]
    assert rows.kv_page_indices.tolist() == [10, 11, 12, 13, 20, 21, 22, 23, 24, 25, 30, 31, 32, 33, 34, 35]
    assert rows.kv_last_page_len.tolist() == [2, 2] and rows.num_rows == 2
    assert all(t.dtype == torch.int32 for t in (rows.qo_indptr, rows.kv_page_indptr, rows.kv_page_indices))
    causal = _rule_layout(STREAMS, "block_causal").structural_rows  # unchanged: one row per (stream, chunk)
    assert causal.qo_indptr.tolist() == [0, 4, 8, 12, 16, 20, 24]
    assert causal.kv_page_indptr.tolist() == [0, 6, 14, 24, 26, 30, 36]
    assert causal.kv_page_indices.tolist()[:24] == [10, 11, 12, 13, 20, 21] + [10, 11, 12, 13, 20, 21, 22, 23] + [
        10, 11, 12, 13, 20, 21, 22, 23, 24, 25]


def test_row_spans_and_row_counts() -> None:
    bidirectional, causal = _rule_layout(STREAMS, "bidirectional"), _rule_layout(STREAMS, "block_causal")
    assert (bidirectional.rows_per_stream, bidirectional.num_rows) == (1, 2)
    assert (causal.rows_per_stream, causal.num_rows) == (3, 6)
    assert bidirectional.row_spans == ((0, 0, 12, 20), (1, 0, 12, 12))
    assert causal.row_spans == ((0, 0, 4, 12), (0, 4, 8, 16), (0, 8, 12, 20), (1, 0, 4, 4), (1, 4, 8, 8),
                                (1, 8, 12, 12))
    # Each row's slice of the dense mask is all True exactly up to its visible keys.
    for layout in (bidirectional, causal):
        dense = layout.to_dense()
        for s, first, end, keys in layout.row_spans:
            assert dense[s, first:end, :keys].all() and not dense[s, first:end, keys:].any()


@pytest.mark.parametrize("single", [((0, 1), ((2, 3),)), ((), ((5, 6),)), ((7, 8), ((2, 3),))])
def test_one_chunk_forwards_are_the_same_under_both_rules(single) -> None:  # noqa: ANN001
    a, b = _rule_layout([single], "bidirectional"), _rule_layout([single], "block_causal")
    for name in ("qo_indptr", "kv_page_indptr", "kv_page_indices", "kv_last_page_len"):
        assert torch.equal(getattr(a.structural_rows, name), getattr(b.structural_rows, name))
    assert torch.equal(a.to_dense(), b.to_dense())

    def ragged(layout: ForwardLayout) -> tuple | None:
        r = layout.ragged_rows
        return None if r is None else (r.qo_indptr.tolist(), r.kv_indptr.tolist(), r.kv_start, r.kv_end)

    assert ragged(a) == ragged(b)
    assert (ragged(a) is None) == (single[0] == (7, 8))  # ragged exactly when the pages are one run


def test_ragged_rows_cover_multi_chunk_bidirectional_forwards() -> None:
    """Contiguous pages -> one contiguous key range per stream (ragged FA3), gap rows between streams."""
    streams = [((0, 1, 2, 3), ((4, 5), (6, 7))), ((10, 11), ((12, 13), (14, 15)))]
    ragged = _rule_layout(streams, "bidirectional").ragged_rows
    assert ragged is not None
    assert ragged.qo_indptr.tolist() == [0, 8, 8, 16]
    assert ragged.kv_indptr.tolist() == [0, 16, 20, 32]
    assert (ragged.kv_start, ragged.kv_end, ragged.gap_rows) == (0, 32, 1)
    assert _rule_layout(streams, "block_causal").ragged_rows is None  # overlapping block-causal rows
    assert _rule_layout(STREAMS, "bidirectional").ragged_rows is None  # 10..13 then 20..25: not one run
    assert _rule_layout([((4, 5), ((0, 1), (2, 3)))], "bidirectional").ragged_rows is not None  # order inside: free


def test_dense_mask_is_history_plus_every_pending_key() -> None:
    layout = _rule_layout(STREAMS, "bidirectional")
    gather, mask = layout.dense_keys
    assert tuple(mask.shape) == (2, 12, 20)
    assert mask[0].all()
    assert mask[1, :, :12].all() and not mask[1, :, 12:].any()  # padding of the shorter stream
    assert gather[0].tolist() == [p * 2 + o for p in (10, 11, 12, 13, 20, 21, 22, 23, 24, 25) for o in (0, 1)]


# ---------------------------------------------------------------------- through the cache
def _rolling_spec(page: int = 2, sink: int = 1, window: int | None = 2, **kw) -> am.KVCacheSpec:  # noqa: ANN003
    return am.KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, chunk_size=4, page_size=page, sink_chunks=sink,
                          window_chunks=window, branches=("cond", "uncond"), dtype="float32", **kw)


def _commit_chunks(state: am.KVState, chunks: int, branches=None, **kw) -> None:  # noqa: ANN001, ANN003
    x = torch.randn(1, 4 * chunks, 1, 4)
    with state.prepare_forward(branches, 4 * chunks, True, **kw) as fwd:
        for layer in fwd.layers:
            am.chunk_attention(*(x.expand(fwd.num_streams, -1, -1, -1),) * 3, layer)


@pytest.mark.parametrize("page", [1, 2, 4])
def test_to_dense_and_key_positions_several_sessions_windows_filling_and_evicted(page: int) -> None:
    cache = am.KVCache(_rolling_spec(page), num_pages=200)
    old, fresh = cache.open_session("old"), cache.open_session("fresh")
    _commit_chunks(old, 4)  # 4 chunks in one bidirectional-or-not commit: sink 0, window 2..3, chunk 1 evicted
    assert old.committed_chunks("cond") == 4 and len(old.history_chunks("cond")) == 3
    for n in (1, 2, 3, 4):
        fwd = cache.prepare_forward([(old, "cond"), (fresh, "uncond"), (old, "uncond")], 4 * n,
                                    pending_attention="bidirectional")
        assert fwd._layout.pending_attention == "bidirectional"
        dense, positions = fwd.to_dense(), fwd.key_positions()
        history = list(range(4)) + list(range(8, 16))  # sink chunk 0, window chunks 2 and 3
        pending = list(range(16, 16 + 4 * n))
        assert positions[0].tolist() == history + pending
        assert positions[1].tolist() == list(range(4 * n)) + [-1] * 12
        assert dense[0].all() and dense[2].all()
        assert dense[1, :, : 4 * n].all() and not dense[1, :, 4 * n :].any()
        assert fwd._layout.structural_rows.qo_indptr.tolist() == [0, 4 * n, 8 * n, 12 * n]
        fwd.abort()


def test_the_spec_default_and_a_per_forward_override() -> None:
    cache = am.KVCache(_rolling_spec(pending_attention="bidirectional"), num_pages=64)
    state = cache.open_session()
    assert state.prepare_forward(None, 8)._layout.pending_attention == "bidirectional"
    assert state.prepare_forward(None, 8, pending_attention="block_causal")._layout.pending_attention == "block_causal"
    layers = state.get_kv_caches("cond", 8, pending_attention="bidirectional")
    assert layers[0].forward.to_dense().all()
    layers = state.prepare_paged_context("cond", 8, False, pending_attention="block_causal")
    assert not layers[0].forward.to_dense().all()


def test_commits_are_the_same_under_both_rules() -> None:
    """What joins history (pages, offsets, eviction) does not depend on the rule."""
    views = []
    for rule in ("block_causal", "bidirectional"):
        cache = am.KVCache(_rolling_spec(), num_pages=64)
        state = cache.open_session()
        torch.manual_seed(0)
        for n in (2, 3, 1, 4):
            with state.prepare_forward(None, 4 * n, False, pending_attention=rule):
                pass
            _commit_chunks(state, n, pending_attention=rule)
        views.append((state.history_chunks("cond"), state.token_offset("cond"), state.committed_chunks("uncond"),
                      cache._allocator.free_pages(), cache._pool.kv.clone()))
    assert views[0][:4] == views[1][:4]
    assert torch.equal(views[0][4], views[1][4])


BAD_RULES = ["causal", "Bidirectional", "", 1, True, ("bidirectional",)]


@pytest.mark.parametrize("bad", BAD_RULES)
@pytest.mark.parametrize("via", ["cache", "state", "get_kv_caches", "prepare_paged_context"])
def test_a_bad_rule_raises_and_changes_nothing(bad: object, via: str) -> None:
    cache = am.KVCache(_rolling_spec(), num_pages=64)
    state = cache.open_session("s")
    _commit_chunks(state, 3)
    with state.prepare_forward(None, 8, False):  # a denoising forward left open (superseded by a good prepare)
        pass
    before = (cache._allocator.free_pages(), cache._allocator.peak_used, state.pending_chunks("cond"),
              state.history_chunks("cond"), state.token_offset("cond"), cache._forwards.num_contexts)
    calls = {
        "cache": lambda: cache.prepare_forward([(state, "cond")], 8, pending_attention=bad),
        "state": lambda: state.prepare_forward(None, 8, pending_attention=bad),
        "get_kv_caches": lambda: state.get_kv_caches("cond", 8, pending_attention=bad),
        "prepare_paged_context": lambda: state.prepare_paged_context("cond", 8, False, pending_attention=bad),
    }
    with pytest.raises(am.SpecError, match=r"pending_attention: expected one of \('block_causal', 'bidirectional'\)"
                       rf", got {__import__('re').escape(repr(bad))}"):
        calls[via]()
    after = (cache._allocator.free_pages(), cache._allocator.peak_used, state.pending_chunks("cond"),
             state.history_chunks("cond"), state.token_offset("cond"), cache._forwards.num_contexts)
    assert after == before
    cache._allocator.check_invariants()


def test_a_bad_spec_default_and_bad_mask_arguments_raise() -> None:
    with pytest.raises(am.SpecError, match=r"KVCacheSpec.pending_attention: expected one of .*, got 'rolling'"):
        _rolling_spec(pending_attention="rolling")
    with pytest.raises(am.SpecError, match=r"chunk_visibility.pending_attention: expected one of .*, got None"):
        chunk_visibility(2, 2, pending_attention=None)  # type: ignore[arg-type]


def test_chunk_visibility_bidirectional_matches_to_dense() -> None:
    chunks = chunk_visibility(5, 3, 1, 2, pending_attention="bidirectional")
    assert chunks[:, 5:].all() and torch.equal(chunks[:, :5], chunk_visibility(5, 3, 1, 2)[:, :5])
    assert chunk_visibility_name(1, 2, pending_attention="bidirectional") == "sink1_window2_bidirectional"
    state = am.KVCache(_rolling_spec(window=2), num_pages=64).open_session()
    for _ in range(5):
        _commit_chunks(state, 1)
    dense = state.prepare_forward(("cond",), 12, pending_attention="bidirectional").to_dense()[0]
    compact = torch.cat([chunks[:, :5][:, chunks[0, :5]], chunks[:, 5:]], dim=1)
    assert torch.equal(dense, compact.repeat_interleave(4, 0).repeat_interleave(4, 1))


def test_a_token_mask_is_anded_with_the_bidirectional_rule() -> None:
    cache = am.KVCache(_rolling_spec(), num_pages=64)
    state = cache.open_session()
    _commit_chunks(state, 2)
    mask = torch.rand(2, 8, 16, generator=torch.Generator().manual_seed(0)) < 0.7
    fwd = state.prepare_forward(None, 8, token_mask=mask, pending_attention="bidirectional")
    assert torch.equal(fwd.to_dense(), mask)  # the rule is all True over both streams' 8 + 8 keys


# ---------------------------------------------------------------------- compile
@SLOW
def test_alternating_rules_do_not_recompile() -> None:
    """The rule lives in the host plan, not in the graph: one compiled frame serves both (same shapes)."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyStreamingModel().eval()
    spec = model.spec(CHUNK, 2, 1, 2)
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    events = rollout_events(12, CHUNK, model.dim, model.context_dim, fixed_shape=True)
    # Two pending chunks per forward, the rule alternating forward by forward.
    g = torch.Generator().manual_seed(1)
    forwards = [e for e in events if e[0] != "forward"][:1] + [
        ("forward", ("cond", "uncond"), torch.randn(2, 2 * CHUNK, model.dim, generator=g), i % 3 == 2,
         (CHUNK, CHUNK), ("bidirectional", "block_causal")[(i // 3) % 2])
        for i in range(18)
    ]
    eager = play(LibraryStreaming(model, spec, 200), forwards)
    actual = play(LibraryStreaming(model, spec, 200, fn=compiled), forwards)
    for i, (a, e) in enumerate(zip(actual, eager)):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4, msg=lambda m, i=i: f"forward {i}: {m}")
    assert counter.frame_count == 1, f"expected one compiled frame for both rules, got {counter.frame_count}"
    torch._dynamo.reset()


# ---------------------------------------------------------------------- GPU: FlashInfer == reference
def _gpu_spec(chunk: int, page: int, sink: int, window: int | None) -> am.KVCacheSpec:
    return gpu_spec(chunk, page, sink, window, pending_attention="bidirectional")


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.parametrize("extents", [True, False], ids=["extents", "paged"])
@pytest.mark.parametrize("page", [8, 120, 240])
@pytest.mark.parametrize("sink,window", [(1, 2), (0, 3), (2, 1)])
def test_gpu_flashinfer_bidirectional_equals_reference(page: int, sink: int, window: int, extents: bool) -> None:
    """1..4 pending chunks, windows filling then evicting, 2 sessions x 2 branches batched; one row per stream,
    ragged or structural paged FA3, never the masked path."""
    chunk = 240
    spec = _gpu_spec(chunk, page, sink, window)
    pages = 4 * (sink + window + 5) * spec.pages_per_chunk
    ref = am.KVCache(spec, num_pages=pages, device="cuda", backend="reference")
    fi = am.KVCache(spec, num_pages=pages, device="cuda", backend="flashinfer", contiguous_extents=extents)
    states = {c: [c.open_session(f"s{i}") for i in range(2)] for c in (ref, fi)}
    g = torch.Generator(device="cuda").manual_seed(0)
    modes = set()
    for step, n in enumerate([2, 1, 3, 4, 1, 2, 3, 1, 4]):
        streams = 4 if step % 2 == 0 else 2
        for commit in (False, True):
            q, k, v = gpu_qkv((streams, n * chunk), g)
            outs = []
            for cache in (ref, fi):
                pairs = [(s, b) for s in states[cache][: streams // 2] for b in ("cond", "uncond")]
                with cache.prepare_forward(pairs, n * chunk, commit_current=commit) as fwd:
                    assert fwd._layout.structural_rows.num_rows == streams  # one row per stream
                    outs.append([am.chunk_attention(q, k, v, layer) for layer in fwd.layers])
                    if cache is fi:
                        modes.add(fwd._plan.mode)
            for a, b in zip(*outs):
                torch.testing.assert_close(b.float(), a.float(), atol=2e-2, rtol=2e-2)
    assert "masked" not in modes and modes <= {"ragged", "paged"}, modes
    if extents:  # the ring's free slots give multi-chunk forwards one contiguous run while the window fills
        assert "ragged" in modes


@pytest.mark.gpu
@NEEDS_GPU
def test_gpu_flashinfer_bidirectional_token_mask_and_static_plans() -> None:
    """Needs the flashinfer.py diff of issue 16 item 3 (rows from ``layout.num_rows``, ``_row_masks`` from
    ``layout.row_spans``): the masked FA2 path and static (CUDA-graph) plans under the bidirectional rule."""
    chunk, page = 240, 8
    spec = _gpu_spec(chunk, page, 1, 2)
    ref = am.KVCache(spec, num_pages=64 * spec.pages_per_chunk, device="cuda", backend="reference")
    fi = am.KVCache(spec, num_pages=64 * spec.pages_per_chunk, device="cuda", backend="flashinfer")
    fi_static = am.KVCache(spec, num_pages=64 * spec.pages_per_chunk, device="cuda", backend="flashinfer")
    states = [c.open_session() for c in (ref, fi, fi_static)]
    g = torch.Generator(device="cuda").manual_seed(2)
    for n in (1, 2, 3, 2, 1, 3):
        q, k, v = gpu_qkv((2, n * chunk), g)
        keys = max(len(states[0].history_chunks(b)) for b in ("cond", "uncond")) * chunk + n * chunk
        mask = torch.rand(2, n * chunk, keys, device="cuda", generator=g) > 0.3
        masked = []
        for cache, state in ((ref, states[0]), (fi, states[1])):
            fwd = state.prepare_forward(None, n * chunk, False, token_mask=mask)
            masked.append(am.chunk_attention(q, k, v, fwd.layers[0]))
            fwd.abort()
        torch.testing.assert_close(masked[1].float(), masked[0].float(), atol=2e-2, rtol=2e-2)
        outs = []  # committing forwards on every cache, so all three histories stay equal
        for state, static in ((states[0], False), (states[1], False), (states[2], True)):
            with state.prepare_forward(None, n * chunk, True, static=static) as fwd:
                outs.append(am.chunk_attention(q, k, v, fwd.layers[0]))
                for layer in fwd.layers[1:]:  # a commit needs every layer
                    am.chunk_attention(q, k, v, layer)
                if static:
                    assert fwd._plan.mode in ("ragged", "paged") and fwd._plan.rows == 2  # one row per stream
        for out in outs[1:]:
            torch.testing.assert_close(out.float(), outs[0].float(), atol=2e-2, rtol=2e-2)
