"""Relative-position sinks (``KVCacheSpec.relative_sinks``): the sinks are attended as if they sat just before
the oldest window chunk, without re-rotating a single cached key.

The oracle (``NaiveStreaming(relative_sinks=True)``) is what the peers do: it keeps *unrotated* keys and
re-rotates every visible key in every forward. The library keeps keys rotated once, at their own
positions, and attends the sinks with a second query (``sink_query``) rotated at ``positions - shift``,
merging the two segments by their LSE.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ardiff_modules import (
    ChunkSelfAttention,
    KVCache,
    KVCacheSpec,
    SpecError,
    TensorMismatchError,
    chunk_attention,
    populate_cross_attention,
)
from ardiff_modules.backends.base import merge_attention
from ardiff_modules.backends.segmented import RelativeSinkPlan
from ardiff_modules.modules.rotary import VideoRotaryEmbedding
from tests.support.streaming_model import LibraryStreaming, NaiveStreaming, TinyStreamingModel, play, rollout_events

CHUNK = 4
SLOW = pytest.mark.slow
BRANCHES = ("cond", "uncond")


def _model(kv_heads: int = 4, video: bool = False) -> TinyStreamingModel:
    torch.manual_seed(0)
    model = TinyStreamingModel(kv_heads=kv_heads).eval()
    if video:  # 3-D RoPE: 2x1 tokens per frame, so a chunk of 4 tokens is 2 frames; only time moves
        model.rope = VideoRotaryEmbedding(model.dim // model.heads, 2, 1)
    return model


def _assert_rollouts_close(actual: list[torch.Tensor], expected: list[torch.Tensor], atol: float = 3e-5) -> None:
    assert len(actual) == len(expected) >= 30
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, e, atol=atol, rtol=atol, msg=lambda m, i=i: f"forward {i}: {m}")


@pytest.mark.parametrize(
    "page_size,sink,window,kv_heads,extra",
    [
        pytest.param(2, 1, 2, 4, {}, id="page2-sink1-win2"),
        pytest.param(1, 2, 1, 2, {}, id="page1-sink2-win1-gqa", marks=SLOW),
        pytest.param(2, 1, 0, 4, {}, id="page2-sink1-win0", marks=SLOW),
        pytest.param(2, 1, 2, 4, {"short_chunk": CHUNK // 2}, id="short-chunks", marks=SLOW),
        pytest.param(2, 1, 3, 4, {"pending_attention": "alternate"}, id="bidirectional-alternate", marks=SLOW),
    ],
)
def test_rollout_matches_the_rerotating_oracle(page_size: int, sink: int, window: int, kv_heads: int, extra: dict) -> None:
    """Denoising and committing forwards, multi-chunk forwards (block-causal and bidirectional), short
    chunks, single-branch forwards, a prompt switch and a reset: forward for forward equal to the oracle
    that re-rotates every key."""
    model = _model(kv_heads)
    spec = model.spec(CHUNK, page_size, sink, window, relative_sinks=True)
    events = rollout_events(20, CHUNK, model.dim, model.context_dim, **extra)
    library = LibraryStreaming(model, spec, 2 * 28 * spec.pages_per_chunk)
    expected = play(NaiveStreaming(model, CHUNK, sink, window, relative_sinks=True), events)
    _assert_rollouts_close(play(library, events), expected)


def test_the_oracle_sees_the_shift_natural_sinks_differ_after_the_first_eviction() -> None:
    """Sensitivity: relative and natural sinks agree until the window slides, then differ."""
    model = _model()
    events = rollout_events(10, CHUNK, model.dim, model.context_dim, fixed_shape=True)
    relative = play(NaiveStreaming(model, CHUNK, 1, 2, relative_sinks=True), events)
    natural = play(LibraryStreaming(model, model.spec(CHUNK, 2, 1, 2), 200), events)
    # Chunks 0..3 (12 forwards): sinks end where the window starts; chunk 4 on: the window slid.
    for i in range(12):
        torch.testing.assert_close(relative[i], natural[i], atol=3e-5, rtol=3e-5)
    assert all((relative[i] - natural[i]).abs().max() > 1e-3 for i in range(12, len(natural)))


@pytest.mark.parametrize("video", [False, pytest.param(True, id="video-rope")])
@SLOW
def test_thousand_chunk_stream_error_stays_flat(video: bool) -> None:
    """Over 1000 chunks the library (keys rotated once, at positions up to 4000) stays as close to the
    re-rotating oracle at the end as at the start: no rounding accumulates, nothing drifts."""
    model = _model(video=video)
    spec = model.spec(CHUNK, 2, 1, 3, branches=("main",), relative_sinks=True)
    library = LibraryStreaming(model, spec, 64)
    oracle = NaiveStreaming(model, CHUNK, 1, 3, relative_sinks=True)
    g = torch.Generator().manual_seed(0)
    text = {"main": torch.randn(5, model.context_dim, generator=g)}
    library.set_prompt(text)
    oracle.set_prompt(text)
    errors = []
    for chunk in range(1000):
        x = torch.randn(1, CHUNK, model.dim, generator=g)
        with torch.no_grad():
            a = library.forward(("main",), x, True)
            e = oracle.forward(("main",), x, True)
        errors.append(float((a - e).abs().max()))
    assert library.state.token_offset("main") == 4000
    early, late = max(errors[:100]), max(errors[-100:])
    assert late < 1e-4, f"error at the end of the stream: {late}"
    assert late <= 4 * early + 1e-6, f"error grew over the stream: {early} -> {late}"


def test_sink_shifts_and_sink_positions() -> None:
    """The shift is 0 until the first eviction, then the tokens between the sinks' end and the oldest
    window chunk; a short first chunk counts its own tokens."""
    model = _model()
    spec = model.spec(CHUNK, 2, 1, 2, branches=("main",), relative_sinks=True)
    cache = KVCache(spec, num_pages=64, backend="reference")
    state = cache.open_session()
    populate_cross_attention(state, "main", [b.cross for b in model.blocks], torch.randn(5, model.context_dim))
    shifts, sink_positions = [], []
    for chunk, length in enumerate([2, 4, 4, 4, 4, 4]):  # a 2-token first chunk (the sink)
        with torch.no_grad(), state.prepare_forward(("main",), length, True) as fwd:
            shifts.append(fwd.sink_shifts[0])
            sink_positions.append(fwd.sink_positions[0].tolist())
            model(torch.randn(1, length, model.dim), fwd.layers)
    # offsets 0, 2, 6, 10, 14, 18; resident window chunks start at 2, 2, 2, 6, 10: shift = start - 2
    assert shifts == [0, 0, 0, 0, 4, 8]
    assert sink_positions[-1] == [10, 11, 12, 13]  # positions 18..21 minus 8
    assert isinstance(state.cache._forwards.contexts()[0]._plan, RelativeSinkPlan)


def test_natural_spec_has_no_sink_positions_and_refuses_a_sink_query() -> None:
    model = _model()
    spec = model.spec(CHUNK, 2, 1, 2, branches=("main",))
    state = KVCache(spec, num_pages=16, backend="reference").open_session()
    with torch.no_grad(), state.prepare_forward(("main",), CHUNK, True) as fwd:
        assert fwd.sink_positions is None and fwd.sink_shifts == (0,) and not fwd.relative_sinks
        q = torch.randn(1, CHUNK, 4, 8)
        k = v = torch.randn(1, CHUNK, 4, 8)
        with pytest.raises(SpecError, match="expected no sink_query"):
            chunk_attention(q, k, v, fwd.layers[0], sink_query=q)
        fwd.abort()


def _advanced_state(spec: KVCacheSpec, chunks: int, model: TinyStreamingModel):  # noqa: ANN202
    cache = KVCache(spec, num_pages=64, backend="reference")
    state = cache.open_session("a")
    populate_cross_attention(state, "main", [b.cross for b in model.blocks], torch.randn(5, model.context_dim))
    for _ in range(chunks):
        with torch.no_grad(), state.prepare_forward(("main",), CHUNK, True) as fwd:
            model(torch.randn(1, CHUNK, model.dim), fwd.layers)
    return cache, state


def test_misuse_raises_and_changes_nothing() -> None:
    model = _model()
    with pytest.raises(SpecError, match="relative_sinks: expected sink chunks"):
        model.spec(CHUNK, 2, 0, 2, relative_sinks=True)
    with pytest.raises(SpecError, match="relative_sinks: expected a bool"):
        model.spec(CHUNK, 2, 1, 2, relative_sinks=1)
    spec = model.spec(CHUNK, 2, 1, 2, branches=("main",), relative_sinks=True)
    cache, state = _advanced_state(spec, 5, model)
    free = cache._allocator.num_free
    with torch.no_grad(), state.prepare_forward(("main",), CHUNK, False) as fwd:
        q = torch.randn(1, CHUNK, 4, 8)
        k = v = torch.randn(1, CHUNK, 4, 8)
        with pytest.raises(SpecError, match="expected sink_query"):
            chunk_attention(q, k, v, fwd.layers[0])
        with pytest.raises(TensorMismatchError, match="sink_query: expected shape"):
            chunk_attention(q, k, v, fwd.layers[0], sink_query=q[:, :2])
        attn = model.blocks[0].attn
        cos = sin = torch.ones(1, CHUNK, 1, 8)
        with pytest.raises(SpecError, match="expected a RoPE module or callable with relative_sinks"):
            attn(torch.randn(1, CHUNK, model.dim), fwd.layers[0], (cos, sin))
        fwd.abort()
    # A re-cache that would rebuild the sinks once the window slid: refused, nothing changed.
    history = state.branch_pages("main")
    before = (history.history, history.committed_tokens, cache._allocator.num_free)
    with pytest.raises(SpecError, match="expected keep_sinks=True"):
        state.prepare_recache(("main",), keep_sinks=False)
    assert (history.history, history.committed_tokens, cache._allocator.num_free) == before
    assert cache._allocator.num_free == free
    # Before any eviction the sinks sit where they always did: rebuilding them is fine.
    _, young = _advanced_state(spec, 2, model)
    young.prepare_recache(("main",), keep_sinks=False).abort()


def test_recache_with_kept_sinks_matches_the_oracle() -> None:
    """A prompt-switch re-cache: the rebuilt window chunks see the kept sinks moved just before the
    oldest of them; the re-cached history and the following chunks equal the oracle's."""
    model = _model()
    spec = model.spec(CHUNK, 2, 1, 2, relative_sinks=True)
    events = rollout_events(8, CHUNK, model.dim, model.context_dim, fixed_shape=True)
    library = LibraryStreaming(model, spec, 200)
    oracle = NaiveStreaming(model, CHUNK, 1, 2, relative_sinks=True)
    latents: dict[str, list[torch.Tensor]] = {b: [] for b in BRANCHES}
    for event in events:
        if event[0] == "forward" and event[3]:
            for s, b in enumerate(event[1]):
                latents[b].append(event[2][s])
        for runner in (library, oracle):
            if event[0] == "prompt":
                runner.set_prompt(event[1])
            else:
                with torch.no_grad():
                    runner.forward(event[1], event[2], event[3], event[4])
    g = torch.Generator().manual_seed(3)
    new_prompt = {b: torch.randn(5, model.context_dim, generator=g) for b in BRANCHES}
    library.set_prompt(new_prompt)
    oracle.set_prompt(new_prompt)
    rebuilt = {b: latents[b][-2:] for b in BRANCHES}  # the window's two chunks (sink kept)
    x = torch.stack([torch.cat(rebuilt[b]) for b in BRANCHES])
    with torch.no_grad(), library.state.prepare_recache(BRANCHES) as fwd:
        assert fwd.sink_shifts == (20, 20)  # window chunks 6, 7 start at 24; the sink ends at 4
        got = model(x, fwd.layers)
    want = oracle.recache(BRANCHES, rebuilt)
    torch.testing.assert_close(got, want, atol=3e-5, rtol=3e-5)
    for _ in range(3):  # and the chunks after it
        x = torch.randn(2, CHUNK, model.dim, generator=g)
        with torch.no_grad():
            torch.testing.assert_close(
                library.forward(BRANCHES, x, True), oracle.forward(BRANCHES, x, True), atol=3e-5, rtol=3e-5
            )


def test_forks_and_shared_sinks_read_the_same_pages_at_their_own_shifts() -> None:
    """A fork and a session sharing the sinks advance differently; each equals its own oracle, and the
    sink pages are shared, never written."""
    model = _model()
    spec = model.spec(CHUNK, 2, 1, 2, branches=("main",), relative_sinks=True)
    cache = KVCache(spec, num_pages=96, backend="reference")
    g = torch.Generator().manual_seed(1)
    text = torch.randn(5, model.context_dim, generator=g)
    parent = cache.open_session("parent")
    oracle = NaiveStreaming(model, CHUNK, 1, 2, relative_sinks=True)
    oracle.set_prompt({"main": text})
    populate_cross_attention(parent, "main", [b.cross for b in model.blocks], text)

    def step(state, naive: NaiveStreaming) -> None:  # noqa: ANN001
        x = torch.randn(1, CHUNK, model.dim, generator=g)
        with torch.no_grad(), state.prepare_forward(("main",), CHUNK, True) as fwd:
            got = model(x, fwd.layers)
        torch.testing.assert_close(got, naive.forward(("main",), x, True), atol=3e-5, rtol=3e-5)

    for _ in range(5):
        step(parent, oracle)
    sink_pages = parent.branch_pages("main").sinks[0]
    sink_before = cache._pool.kv[:, :, list(sink_pages)].clone()
    child = parent.fork("child")
    child_oracle = copy.copy(oracle)
    child_oracle.committed = {"main": list(oracle.committed["main"])}
    sharer = cache.open_session("sharer")
    sharer.share_sinks_from(parent, "main")
    populate_cross_attention(sharer, "main", [b.cross for b in model.blocks], text)
    sharer_oracle = copy.copy(oracle)
    sharer_oracle.committed = {"main": list(oracle.committed["main"][:1])}
    for i in range(6):  # different progress: shifts differ between the three
        step(parent, oracle)
        if i % 2:
            step(child, child_oracle)
        if i % 3 == 0:
            step(sharer, sharer_oracle)
    assert child.branch_pages("main").sinks[0] == sink_pages == sharer.branch_pages("main").sinks[0]
    assert torch.equal(cache._pool.kv[:, :, list(sink_pages)], sink_before)


def test_batched_sessions_with_and_without_resident_sinks() -> None:
    """One forward over a long-running session (sinks moved) and a fresh one (no sinks yet): the fresh
    stream's empty sink segment contributes nothing."""
    model = _model()
    spec = model.spec(CHUNK, 2, 1, 2, branches=("main",), relative_sinks=True)
    cache = KVCache(spec, num_pages=96, backend="reference")
    g = torch.Generator().manual_seed(2)
    text = torch.randn(5, model.context_dim, generator=g)
    old, new = cache.open_session("old"), cache.open_session("new")
    oracles = {}
    for state in (old, new):
        populate_cross_attention(state, "main", [b.cross for b in model.blocks], text)
        oracles[state.session_id] = NaiveStreaming(model, CHUNK, 1, 2, relative_sinks=True)
        oracles[state.session_id].set_prompt({"main": text})
    for _ in range(5):
        x = torch.randn(1, CHUNK, model.dim, generator=g)
        with torch.no_grad(), old.prepare_forward(("main",), CHUNK, True) as fwd:
            model(x, fwd.layers)
        oracles["old"].forward(("main",), x, True)
    for _ in range(3):
        x = torch.randn(2, CHUNK, model.dim, generator=g)
        with torch.no_grad(), cache.prepare_forward([(old, "main"), (new, "main")], CHUNK, True) as fwd:
            got = model(x, fwd.layers)
        want = torch.cat([oracles[n].forward(("main",), x[i : i + 1], True) for i, n in enumerate(("old", "new"))])
        torch.testing.assert_close(got, want, atol=3e-5, rtol=3e-5)


def test_token_mask_splits_across_the_two_segments() -> None:
    """An all-true mask changes nothing; a mask hiding the sinks makes relative and natural sinks agree."""
    model = _model()
    outputs = {}
    for relative in (True, False):
        spec = model.spec(CHUNK, 2, 1, 2, branches=("main",), relative_sinks=relative)
        torch.manual_seed(5)
        cache, state = _advanced_state(spec, 4, model)  # shifts 0 so far: the same history either way
        x = torch.randn(1, CHUNK, model.dim)
        keys = cache._forwards.max_visible_keys([state.branch_pages("main")], CHUNK)
        with torch.no_grad():
            with state.prepare_forward(("main",), CHUNK, False) as fwd:
                plain = model(x, fwd.layers)
            ones = torch.ones(1, CHUNK, keys, dtype=torch.bool)
            with state.prepare_forward(("main",), CHUNK, False, token_mask=ones) as fwd:
                torch.testing.assert_close(model(x, fwd.layers), plain, atol=1e-6, rtol=1e-6)
            no_sinks = ones.clone()
            no_sinks[..., :CHUNK] = False  # the sink chunk's keys
            with state.prepare_forward(("main",), CHUNK, False, token_mask=no_sinks) as fwd:
                outputs[relative] = (plain, model(x, fwd.layers))
    torch.testing.assert_close(outputs[True][1], outputs[False][1], atol=3e-5, rtol=3e-5)
    assert (outputs[True][0] - outputs[False][0]).abs().max() > 1e-3


def test_merge_attention_is_one_softmax_and_ignores_an_empty_segment() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 2, 8, generator=g)
    k = torch.randn(10, 2, 8, generator=g)
    v = torch.randn(10, 2, 8, generator=g)

    def attend(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = torch.einsum("thd,khd->thk", q, keys) * 8**-0.5
        return torch.einsum("thk,khd->thd", logits.softmax(-1), values), logits.logsumexp(-1)

    full, full_lse = attend(k, v)
    a, b = attend(k[:3], v[:3]), attend(k[3:], v[3:])
    out, lse = merge_attention(*a, *b)
    torch.testing.assert_close(out, full, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, full_lse, atol=1e-6, rtol=1e-6)
    empty = (torch.full_like(full, float("nan")), torch.full_like(full_lse, float("-inf")))
    out, lse = merge_attention(*empty, full, full_lse)
    torch.testing.assert_close(out, full)
    torch.testing.assert_close(lse, full_lse)


@SLOW
def test_compiled_fullgraph_one_frame_equals_eager() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    model = _model()
    spec = model.spec(CHUNK, 2, 1, 2, relative_sinks=True)
    events = rollout_events(10, CHUNK, model.dim, model.context_dim, fixed_shape=True)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    try:
        eager = play(LibraryStreaming(model, spec, 64), events)
        actual = play(LibraryStreaming(model, spec, 64, fn=compiled), events)
    finally:
        torch._dynamo.reset()
    _assert_rollouts_close(actual, eager, atol=1e-4)
    assert counter.frame_count == 1


def test_module_and_functional_forms_agree() -> None:
    """``ChunkSelfAttention`` rotates the sink query itself; the functional form takes it from the caller."""
    model = _model()
    spec = model.spec(CHUNK, 2, 1, 2, branches=("main",), relative_sinks=True)
    attn: ChunkSelfAttention = model.blocks[0].attn
    outs = []
    for functional in (False, True):
        torch.manual_seed(7)
        _, state = _advanced_state(spec, 5, model)
        x = torch.randn(1, CHUNK, model.dim)
        with torch.no_grad(), state.prepare_forward(("main",), CHUNK, False) as fwd:
            kv = fwd.layers[0]
            if functional:
                q, k, v = attn.project(x)
                sink_query = model.rope(q, kv.sink_positions)
                q, k = model.rope(q, kv.positions), model.rope(k, kv.positions)
                out = chunk_attention(q, k, v, kv, sink_query=sink_query)
                outs.append(attn.to_out(out.flatten(2)))
            else:
                outs.append(attn(x, kv, model.rope))
            fwd.abort()
    torch.testing.assert_close(outs[0], outs[1])


def test_a_plain_rope_callable_gets_the_same_sink_query_as_the_rotary_module() -> None:
    """The module's shared-table path (one of the package's rotary modules) and the generic path (any
    callable ``(t, positions) -> t``, evaluated twice) give the same outputs."""
    model = _model()
    spec = model.spec(CHUNK, 2, 1, 2, branches=("main",), relative_sinks=True)
    attn: ChunkSelfAttention = model.blocks[0].attn
    outs = []
    for rope in (model.rope, lambda t, positions: model.rope(t, positions)):
        torch.manual_seed(7)
        _, state = _advanced_state(spec, 5, model)
        x = torch.randn(1, CHUNK, model.dim)
        with torch.no_grad(), state.prepare_forward(("main",), CHUNK, False) as fwd:
            assert fwd.sink_shifts[0] > 0
            outs.append(attn(x, fwd.layers[0], rope))
            fwd.abort()
    torch.testing.assert_close(outs[0], outs[1])


@pytest.mark.parametrize("pending_attention", ["block_causal", "bidirectional"])
@pytest.mark.parametrize("num_chunks", [1, 3])
def test_random_token_mask_over_a_mixed_batch_splits_columns_exactly(pending_attention: str, num_chunks: int) -> None:
    """Three streams -- window slid, young, no sink yet (a stand-in sink page) -- a random token mask, 1 or 3
    pending chunks. With ``sink_query=q`` the two segments must rebuild exactly the natural single softmax,
    whatever the shifts: any wrong column of the mask split, or a stand-in row leaking in, shows."""
    heads, dim, chunk, page = 2, 8, 4, 2

    def run(relative: bool) -> tuple[torch.Tensor, tuple[int, ...]]:
        g = torch.Generator().manual_seed(num_chunks)
        spec = KVCacheSpec(
            num_layers=1, num_kv_heads=heads, head_dim=dim, chunk_size=chunk, page_size=page, sink_chunks=1,
            window_chunks=2, branches=("main",), dtype="float32", relative_sinks=relative,
            pending_attention=pending_attention,
        )
        cache = KVCache(spec, num_pages=200, backend="reference")
        sessions = [cache.open_session(n) for n in ("old", "young", "new")]

        def step(streams: list, n: int, commit: bool, mask: torch.Tensor | None = None) -> tuple:
            q, k, v = (torch.randn(len(streams), n, heads, dim, generator=g) for _ in range(3))
            with torch.no_grad(), cache.prepare_forward(streams, n, commit, token_mask=mask) as fwd:
                extra = {"sink_query": q} if relative else {}
                out = chunk_attention(q, k, v, fwd.layers[0], **extra)
                shifts = fwd.sink_shifts
                if not commit:
                    fwd.abort()
            return out, shifts

        for _ in range(6):
            step([(sessions[0], "main")], chunk, True)
        for _ in range(2):
            step([(sessions[1], "main")], chunk, True)
        streams = [(s, "main") for s in sessions]
        keys = cache._forwards.max_visible_keys([s.branch_pages("main") for s in sessions], num_chunks * chunk)
        mask = torch.rand(3, num_chunks * chunk, keys, generator=g) > 0.4
        mask[0, 0] = False  # a query that sees no key at all: zeros either way
        return step(streams, num_chunks * chunk, False, mask)

    relative, shifts = run(True)
    natural, _ = run(False)
    assert shifts[0] > 0 and shifts[1] == 0 and shifts[2] == 0
    torch.testing.assert_close(relative, natural, atol=2e-6, rtol=2e-6)
    assert torch.equal(relative[0, 0], torch.zeros_like(relative[0, 0]))


def test_direct_op_call_without_the_sink_query_raises_before_writing() -> None:
    model = _model()
    spec = model.spec(CHUNK, 2, 1, 2, branches=("main",), relative_sinks=True)
    cache, state = _advanced_state(spec, 5, model)
    with torch.no_grad(), state.prepare_forward(("main",), CHUNK, False) as fwd:
        layer = fwd.layers[0]
        pending = list(state.branch_pages("main").pending_pages())
        before = cache._pool.kv[:, :, pending].clone()
        q = torch.randn(CHUNK, 4, 8)
        k = v = torch.ones(CHUNK, 4, 8)
        with pytest.raises(SpecError, match="expected q_sink"):
            torch.ops.ardiff_modules.chunk_attention(q, k, v, layer._kv_pool, layer._layer_id, fwd._handle_id, 0.35)
        assert torch.equal(cache._pool.kv[:, :, pending], before)
        fwd.abort()


def test_a_sink_query_that_requires_grad_gets_its_gradient() -> None:
    """Only the sink query requires grad: the forward takes the gradient path and the sink query gets one."""
    model = _model()
    spec = model.spec(CHUNK, 2, 1, 2, branches=("main",), relative_sinks=True)
    _, state = _advanced_state(spec, 5, model)
    with state.prepare_forward(("main",), CHUNK, False) as fwd:
        q = torch.randn(1, CHUNK, 4, 8)
        k = v = torch.randn(1, CHUNK, 4, 8)
        sink_query = q.clone().requires_grad_()
        out = chunk_attention(q, k, v, fwd.layers[0], sink_query=sink_query)
        assert out.requires_grad
        out.sum().backward()
        assert sink_query.grad is not None and sink_query.grad.abs().sum() > 0
        fwd.abort()
