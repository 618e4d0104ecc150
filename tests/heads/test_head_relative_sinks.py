"""Relative sinks with retention groups (issue 41): each group's sinks move by its own shift.

The oracle is cache-free and re-rotates: it keeps every committed chunk's *unrotated* K/V and, per K/V head,
reads the chunks that head's group keeps (``history_indices``); the group's sink keys are rotated at their
position plus the group's shift (``first visible non-sink token - end of the sinks``, the first pending token
when no window chunk is visible), every other key at its own position. The cache keeps keys rotated once and
attends each lane's sinks with the sink query rotated at the layer's ``kv.sink_positions`` -- per query head
where the layer's lanes differ.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import ardiff_modules as am

LAYERS, KV_HEADS, GQA, D, DIM, CHUNK, PAGE = 3, 3, 2, 8, 12, 4, 2
HEADS = KV_HEADS * GQA
TOL = dict(atol=2e-5, rtol=2e-5)
# short and long windows (different shifts once they slide), and a group without sinks
GROUPS = {"short": (1, 1), "long": (2, 3), "local": (0, 2)}
ROWS = [
    ["short", "long", "local"],  # three lanes: per-head sink positions
    ["long", "long", "long"],  # one lane: its own [streams, seq_len]
    ["local", "short", "short"],  # a sinkless lane and a sink lane
]
ROPE = am.RotaryEmbedding(D)


def make_cache(rows=ROWS, groups=GROUPS, pages: int = 400) -> am.KVCache:
    spec = am.KVCacheSpec(
        num_layers=len(rows), num_kv_heads=KV_HEADS, num_qo_heads=HEADS, head_dim=D, chunk_size=CHUNK,
        page_size=PAGE, branches=("main",), dtype="float32", head_retention=am.HeadRetention(groups, rows),
        relative_sinks=True,
    )
    return am.KVCache(spec, num_pages=pages, backend="reference")


class Oracle:
    """Per stream and layer, the committed chunks' unrotated ``(k, v)`` ``[CHUNK, kv_heads, d]``."""

    def __init__(self, heads: am.HeadRetention) -> None:
        self.heads = heads
        self.chunks: dict[str, list[list[tuple[torch.Tensor, torch.Tensor]]]] = defaultdict(
            lambda: [[] for _ in range(heads.num_layers)]
        )

    def shift(self, stream: str, layer: int, head: int, first_pending: int) -> int:
        policy = self.heads.groups[self.heads.group_of(layer, head)]
        visible = policy.history_indices(len(self.chunks[stream][layer]))
        sinks = [i for i in visible if i < policy.sink_chunks]
        if not sinks:
            return 0
        rest = [i for i in visible if i >= policy.sink_chunks]
        first = rest[0] * CHUNK if rest else first_pending
        return first - (sinks[-1] + 1) * CHUNK

    def attend(self, stream: str, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int
               ) -> torch.Tensor:
        """Raw ``q [n, heads, d]``, ``k``/``v [n, kv_heads, d]`` of the pending chunk at ``start`` -> like ``q``."""
        history = self.chunks[stream][layer]
        assert start == len(history) * CHUNK
        out = torch.empty_like(q)
        pos = torch.arange(start, start + q.shape[0])
        for h in range(KV_HEADS):
            policy = self.heads.groups[self.heads.group_of(layer, h)]
            shift = self.shift(stream, layer, h, start)
            keys, values = [], []
            for i in policy.history_indices(len(history)):
                at = torch.arange(i * CHUNK, (i + 1) * CHUNK) + (shift if i < policy.sink_chunks else 0)
                keys.append(rot(history[i][0][:, h], at))
                values.append(history[i][1][:, h])
            keys.append(rot(k[:, h], pos))
            values.append(v[:, h])
            kk, vv = torch.cat(keys), torch.cat(values)
            for j in range(GQA):
                qh = rot(q[:, h * GQA + j], pos)
                attended = F.scaled_dot_product_attention(qh[None, None], kk[None, None], vv[None, None])
                out[:, h * GQA + j] = attended[0, 0]
        return out

    def commit(self, stream: str, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.chunks[stream][layer].append((k.clone(), v.clone()))


def rot(t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``t [n, d]`` rotated at ``positions [n]``."""
    return ROPE(t[None, :, None], positions[None])[0, :, 0]


def library_layer(q, k, v, kv):  # noqa: ANN001, ANN201
    """The functional form of the guide: q and k at ``kv.positions``, the sink query at ``kv.sink_positions``."""
    return am.chunk_attention(ROPE(q, kv.positions), ROPE(k, kv.positions), v, kv,
                              sink_query=ROPE(q, kv.sink_positions))


def rollout(cache: am.KVCache, chunks: int, seed: int = 0, layer_fn: Callable = library_layer,
            late_start: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Session ``a`` alone for ``late_start`` chunks, then ``a`` and ``b`` batched (their shifts differ): each
    chunk one denoising forward and one committing forward, both compared with the oracle."""
    g = torch.Generator().manual_seed(seed)
    heads = cache.spec.head_retention
    oracle = Oracle(heads)
    a, b = cache.open_session("a"), cache.open_session("b")
    results = []
    for c in range(chunks):
        names = ["a"] if c < late_start else ["a", "b"]
        states = {"a": a, "b": b}
        for commit in (False, True):
            qkv = [[torch.randn(len(names), CHUNK, n, D, generator=g) for n in (HEADS, KV_HEADS, KV_HEADS)]
                   for _ in range(heads.num_layers)]
            with cache.prepare_forward([(states[n], "main") for n in names], CHUNK, commit) as fwd:
                assert fwd.relative_sinks
                got = torch.stack([layer_fn(*qkv[i], kv) for i, kv in enumerate(fwd.layers)])
            want = torch.stack([
                torch.stack([
                    oracle.attend(n, i, q[s], k[s], v[s], states[n].token_offset("main") - (CHUNK if commit else 0))
                    for s, n in enumerate(names)
                ])
                for i, (q, k, v) in enumerate(qkv)
            ])
            if commit:
                for i, (_, k, v) in enumerate(qkv):
                    for s, n in enumerate(names):
                        oracle.commit(n, i, k[s], v[s])
            results.append((got, want))
    return results


def test_grouped_rollout_matches_the_rerotating_per_head_oracle() -> None:
    """12 chunks: every group's window slides (the long group's from chunk 5), two sessions at different lengths
    batched: forward for forward equal to the oracle that rotates each head's sinks at its group's shift."""
    results = rollout(make_cache(), 12)
    for i, (got, want) in enumerate(results):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, i=i: f"forward {i}: {m}")


def test_the_per_head_oracle_sees_each_groups_shift() -> None:
    """Sensitivity: natural sinks (every head's sink query at its own positions) disagree with the oracle once a
    window slid -- in the heads of each sink group, while the sinkless group agrees."""
    natural = rollout(make_cache(), 8, layer_fn=lambda q, k, v, kv: am.chunk_attention(
        ROPE(q, kv.positions), ROPE(k, kv.positions), v, kv, sink_query=ROPE(q, kv.positions)))
    got, want = natural[-1]  # chunk 7: short (1 + 1) and long (2 + 3) have both slid
    diff = (got - want).abs().amax(dim=(1, 2, 4))  # [layers, heads]
    for layer, row in enumerate(ROWS):
        for h, group in enumerate(row):
            err = diff[layer, h * GQA : (h + 1) * GQA].max()
            assert (err > 1e-3) if GROUPS[group][0] else (err < 1e-5), (layer, h, group, float(err))


def test_layer_and_forward_sink_positions() -> None:
    """A layer of several lanes gets per-head sink positions (each head at its lane's shift; a sinkless lane's
    heads at their natural positions); a layer of one lane its lane's ``[streams, seq_len]``; the forward's own
    ``sink_positions`` / ``sink_shifts`` refuse (no one tensor is right for every head)."""
    cache = make_cache()
    state = cache.open_session()
    for c in range(8):
        with state.prepare_forward(("main",), CHUNK, True) as fwd:
            q, k, v = (torch.randn(1, CHUNK, n, D) for n in (HEADS, KV_HEADS, KV_HEADS))
            for kv in fwd.layers:
                library_layer(q, k, v, kv)
    with state.prepare_forward(("main",), CHUNK, False) as fwd:  # chunk 8 at 32: 8 committed
        positions = torch.arange(32, 36)
        # short (1 + 1): sink 0 ends at 4, window chunk 7 starts at 28: shift 24; long (2 + 3): 20 - 8 = 12
        shift = {"short": 24, "long": 12, "local": 0}
        per_head = fwd.layers[0].sink_positions
        assert per_head.shape == (1, CHUNK, HEADS)
        for h, group in enumerate(ROWS[0]):
            for j in range(GQA):
                assert per_head[0, :, h * GQA + j].tolist() == (positions - shift[group]).tolist(), (h, group)
        assert fwd.layers[1].sink_positions.tolist() == [(positions - 12).tolist()]
        assert fwd.layers[2].sink_positions.shape == (1, CHUNK, HEADS)
        assert fwd.relative_sinks
        with pytest.raises(am.SpecError, match="retention groups"):
            fwd.sink_positions  # noqa: B018
        with pytest.raises(am.SpecError, match="retention groups"):
            fwd.sink_shifts  # noqa: B018
        fwd.abort()


def test_a_layer_without_sink_lanes_takes_or_skips_the_sink_query() -> None:
    """A layer whose lanes have no sink chunks attends no sink segment: its sink query may be given (ignored) or
    left out; a layer with a sink lane requires it."""
    rows = [["local", "local", "local"], ["short", "local", "local"]]
    cache = make_cache(rows)
    state = cache.open_session()
    g = torch.Generator().manual_seed(1)
    for c in range(5):
        with state.prepare_forward(("main",), CHUNK, True) as fwd:
            q, k, v = (torch.randn(1, CHUNK, n, D, generator=g) for n in (HEADS, KV_HEADS, KV_HEADS))
            assert fwd.layers[0].sink_positions.tolist() == fwd.positions.tolist()  # natural: nothing moves
            with_query = library_layer(q, k, v, fwd.layers[0])
            without = am.chunk_attention(ROPE(q, fwd.positions), ROPE(k, fwd.positions), v, fwd.layers[0])
            torch.testing.assert_close(with_query, without)
            with pytest.raises(am.SpecError, match="expected sink_query"):
                am.chunk_attention(ROPE(q, fwd.positions), ROPE(k, fwd.positions), v, fwd.layers[1])
            library_layer(q, k, v, fwd.layers[1])


@pytest.mark.parametrize("rope_kind", ["module", "callable"])
def test_chunk_self_attention_end_to_end(rope_kind: str) -> None:
    """``ChunkSelfAttention`` with a grouped spec rotates its sink query per head from the layer's
    ``kv.sink_positions`` (the shared-table path of the package's RoPE, and a plain callable) and matches the
    oracle over a rollout whose windows slide."""
    torch.manual_seed(0)
    layers = [am.ChunkSelfAttention(DIM, HEADS, num_kv_heads=KV_HEADS, head_dim=D).eval() for _ in ROWS]
    rope = ROPE if rope_kind == "module" else (lambda t, p: ROPE(t, p))
    cache = make_cache()
    state = cache.open_session()
    oracle = Oracle(cache.spec.head_retention)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for c in range(9):
            for commit in (False, True):
                x = [torch.randn(1, CHUNK, DIM, generator=g) for _ in ROWS]
                with state.prepare_forward(("main",), CHUNK, commit) as fwd:
                    got = [layer(x[i], kv, rope) for i, (layer, kv) in enumerate(zip(layers, fwd.layers))]
                for i, layer in enumerate(layers):
                    q, k, v = (t[0] for t in layer.project(x[i]))
                    out = oracle.attend("main", i, q, k, v, c * CHUNK)
                    want = layer.to_out(out.flatten(-2))[None]
                    torch.testing.assert_close(got[i], want, **TOL, msg=lambda m, c=c, i=i: f"chunk {c} layer {i}: {m}")
                    if commit:
                        oracle.commit("main", i, k, v)


def test_rope_modules_take_per_head_positions() -> None:
    """``RotaryEmbedding`` / ``VideoRotaryEmbedding`` rotate each head at its own positions; a per-head tensor of
    the wrong head count is refused."""
    t = torch.randn(2, 5, 3, 12)
    per_head = torch.randint(0, 100, (2, 5, 3))
    for rope in (am.RotaryEmbedding(12), am.VideoRotaryEmbedding(12, 2, 2)):
        got = rope(t, per_head)
        for h in range(3):
            torch.testing.assert_close(got[:, :, h : h + 1], rope(t[:, :, h : h + 1], per_head[:, :, h]))
        with pytest.raises(am.TensorMismatchError, match="per-head"):
            rope(t, per_head[:, :, :2])


class _Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            am.ChunkSelfAttention(DIM, HEADS, num_kv_heads=KV_HEADS, head_dim=D) for _ in ROWS
        )

    def forward(self, x: torch.Tensor, layers: list) -> torch.Tensor:
        for block, kv in zip(self.blocks, layers):
            x = x + block(x, kv, ROPE)
        return x


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_grouped_relative_sinks_is_one_frame_equal_to_eager() -> None:
    """``fullgraph=True`` over a rollout whose windows slide, denoising and committing forwards: one frame, equal to
    eager (the per-head sink positions keep their shape: no recompile when the lanes' shifts start to differ)."""
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    model = _Stack().eval()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    caches = [make_cache(), make_cache()]
    states = [c.open_session("a") for c in caches]
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for c in range(9):
            for commit in (False, True):
                x = torch.randn(1, CHUNK, DIM, generator=g)
                outs = []
                for state, fn in zip(states, (model, compiled)):
                    with state.prepare_forward(("main",), CHUNK, commit) as fwd:
                        outs.append(fn(x, fwd.layers))
                torch.testing.assert_close(outs[1], outs[0], **TOL)
    assert counter.frame_count == 1
