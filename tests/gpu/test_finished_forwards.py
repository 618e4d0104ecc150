"""A finished forward never touches the pool on the GPU, eagerly, compiled or through a CUDA-graph replay.

Finished (committed, aborted) forwards are refused before any write; a graph step never replays a finished
forward, a cleared prompt it read, a context the cache released or a half-updated plan, and captures again
where a replay would be wrong (an aborted FP8 calibration); a capture alone writes nothing.
Run on the GPU machine: ``bash .gpu/run.sh python3 -m pytest -m gpu -q``. Skipped without CUDA/FlashInfer.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.backends.flashinfer import FlashInferPlan
from ardiff_modules.graphs import CUDAGraphStep
from tests.support.gpu import DTYPE, GPU, assert_close_model, gpu_model_and_spec, gpu_qkv, gpu_spec

pytestmark = list(GPU)


@pytest.mark.parametrize("seq_chunks", [1, 2], ids=["ragged", "paged"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_finished_forward_cannot_touch_the_pool(seq_chunks: int, compiled: bool) -> None:
    chunk = 240
    spec = gpu_spec(chunk, 120, 1, 2)
    cache = am.KVCache(spec, num_pages=64, device="cuda", backend="flashinfer")
    state = cache.open_session()
    g = torch.Generator(device="cuda").manual_seed(0)
    attend = torch.compile(am.chunk_attention, fullgraph=True) if compiled else am.chunk_attention
    q, k, v = gpu_qkv((2, seq_chunks * chunk), g)
    with state.prepare_forward(None, seq_chunks * chunk, commit_current=True) as fwd:
        attend(q, k, v, fwd.layers[0])
        attend(q, k, v, fwd.layers[1])  # a commit needs every layer
        mode = fwd._plan.mode
    assert mode == ("ragged" if seq_chunks == 1 else "paged")
    torch.cuda.synchronize()
    before = cache._pool.kv.clone()
    with pytest.raises(am.errors.ForwardFinishedError, match="committed"):
        attend(q, k * 7, v * 7, fwd.layers[0])
    torch.cuda.synchronize()
    assert torch.equal(cache._pool.kv, before)
    # abort() inside the block while the model keeps running: refused, nothing written.
    with pytest.raises(am.errors.ForwardFinishedError, match="aborted"):
        with state.prepare_forward(None, seq_chunks * chunk, commit_current=True) as fwd:
            fwd.abort()
            attend(q, k * 3, v * 3, fwd.layers[1])
    torch.cuda.synchronize()
    assert torch.equal(cache._pool.kv, before)


def test_graph_replay_refuses_finished_forward_and_cleared_prompt() -> None:
    model, spec = gpu_model_and_spec()
    cache = am.KVCache(spec, num_pages=64, device="cuda", backend="flashinfer")
    state = cache.open_session()
    g = torch.Generator(device="cuda").manual_seed(1)

    def populate() -> None:
        for b in spec.branches:
            text = torch.randn(16, 64, device="cuda", dtype=DTYPE, generator=g)
            am.populate_cross_attention(state, b, [blk.cross for blk in model.blocks], text)

    populate()
    step = CUDAGraphStep(model)
    x = torch.randn(2, spec.chunk_size, 512, device="cuda", dtype=DTYPE, generator=g)
    with torch.no_grad():
        with state.prepare_forward(None, spec.chunk_size, False, static=True) as fwd:
            step(fwd, x)
        torch.cuda.synchronize()
        before = cache._pool.kv.clone()
        with pytest.raises(am.errors.ForwardFinishedError):
            step(fwd, x)  # a replay would rewrite pages after the forward finished
        torch.cuda.synchronize()
        assert torch.equal(cache._pool.kv, before)
        state.clear_cross_attention()  # prompt switch without re-populating: eager raises, so must a replay
        with pytest.raises(am.errors.CrossAttentionNotPopulatedError):
            with state.prepare_forward(None, spec.chunk_size, False, static=True) as fwd:
                step(fwd, x)
        populate()
        with state.prepare_forward(None, spec.chunk_size, True, static=True) as fwd:
            replayed = step(fwd, x)
            state.abort()  # redo the same forward eagerly for comparison
        with state.prepare_forward(None, spec.chunk_size, True) as fwd:
            eager = model(x, fwd.layers)
    assert step.num_graphs == 1
    assert_close_model(replayed, eager)


def test_graphs_are_released_with_their_contexts() -> None:
    model, spec = gpu_model_and_spec()
    cache = am.KVCache(spec, num_pages=256, device="cuda", backend="flashinfer", max_forward_contexts=2)
    step = CUDAGraphStep(model)
    g = torch.Generator(device="cuda").manual_seed(2)
    text = torch.randn(16, 64, device="cuda", dtype=DTYPE, generator=g)
    counts = []
    with torch.no_grad():
        for i in range(6):  # churn: each session captures its own graph, then closes
            state = cache.open_session(f"s{i}")
            for b in spec.branches:
                am.populate_cross_attention(state, b, [blk.cross for blk in model.blocks], text)
            x = torch.randn(2, spec.chunk_size, 512, device="cuda", dtype=DTYPE, generator=g)
            with state.prepare_forward(None, spec.chunk_size, True, static=True) as fwd:
                step(fwd, x)
            if i % 2:
                state.close()
            counts.append(step.num_graphs)
    assert max(counts) <= 2 + 1, counts  # bounded by the context LRU, not by the stream's length
    cache.close()
    assert step.num_graphs == 0


def test_failed_replan_ends_the_forward_and_recaptures(monkeypatch: pytest.MonkeyPatch) -> None:
    model, spec = gpu_model_and_spec()
    cache = am.KVCache(spec, num_pages=64, device="cuda", backend="flashinfer")
    state = cache.open_session()
    g = torch.Generator(device="cuda").manual_seed(3)
    for b in spec.branches:
        text = torch.randn(16, 64, device="cuda", dtype=DTYPE, generator=g)
        am.populate_cross_attention(state, b, [blk.cross for blk in model.blocks], text)
    step = CUDAGraphStep(model)
    x = torch.randn(2, spec.chunk_size, 512, device="cuda", dtype=DTYPE, generator=g)
    with torch.no_grad():
        old = state.prepare_forward(None, spec.chunk_size, False, static=True)
        step(old, x)
        original = FlashInferPlan.update

        def half_update(self: FlashInferPlan, request) -> None:  # noqa: ANN001
            self._plan_writes(request.layout)  # the write pages move, then planning fails
            raise RuntimeError("injected plan failure")

        monkeypatch.setattr(FlashInferPlan, "update", half_update)
        with pytest.raises(RuntimeError, match="injected"):
            state.prepare_forward(None, spec.chunk_size, False, static=True)
        monkeypatch.setattr(FlashInferPlan, "update", original)
        with pytest.raises(am.errors.ForwardFinishedError, match="superseded"):
            step(old, x)  # its plan is half-updated: never replayed
        assert state._open_forward("cond") is None
        with state.prepare_forward(None, spec.chunk_size, True, static=True) as fwd:
            replayed = step(fwd, x)
            state.abort()
        with state.prepare_forward(None, spec.chunk_size, True) as fwd:
            eager = model(x, fwd.layers)
    assert step.num_graphs == 1
    assert_close_model(replayed, eager)


def _self_attention_only(x: torch.Tensor, layers: list) -> torch.Tensor:
    """A step that reads no cross-attention cache: q = k = v = x split into 4 heads of 128, per layer."""
    s, n, _ = x.shape
    for layer in layers:
        h = x.view(s, n, 4, 128)
        x = x + am.chunk_attention(h, h, h, layer).reshape(s, n, 512)
    return x


def test_graph_replay_after_clear_cross_attention_when_the_step_reads_no_cross_cache() -> None:
    """Issue 24: the replay check concerns only the caches the captured step read; eager runs there too."""
    model, spec = gpu_model_and_spec()
    cache = am.KVCache(spec, num_pages=64, device="cuda", backend="flashinfer")
    state = cache.open_session()
    g = torch.Generator(device="cuda").manual_seed(3)
    for b in spec.branches:
        am.populate_cross_attention(state, b, [blk.cross for blk in model.blocks],
                                    torch.randn(16, 64, device="cuda", dtype=DTYPE, generator=g))
    step = CUDAGraphStep(_self_attention_only)
    xs = [torch.randn(2, spec.chunk_size, 512, device="cuda", dtype=DTYPE, generator=g) for _ in range(3)]
    outs = []
    with torch.no_grad():
        with state.prepare_forward(None, spec.chunk_size, True, static=True) as fwd:
            outs.append(step(fwd, xs[0]))
        state.clear_cross_attention()  # the captured step never read it
        for x in xs[1:]:
            with state.prepare_forward(None, spec.chunk_size, True, static=True) as fwd:
                outs.append(step(fwd, x))  # replays (a commit: the replay recorded every layer's write)
    assert step.num_graphs == 1 and state.committed_chunks("cond") == 3
    eager_cache = am.KVCache(spec, num_pages=64, device="cuda", backend="flashinfer")
    eager_state = eager_cache.open_session()
    with torch.no_grad():
        for x, got in zip(xs, outs):
            with eager_state.prepare_forward(None, spec.chunk_size, True) as fwd:
                assert_close_model(got, _self_attention_only(x, fwd.layers))


def test_fp8_graph_captured_in_an_aborted_calibrating_forward_is_captured_again() -> None:
    """The capturing forward calibrated the FP8 scales provisionally, then aborted (undone): a replay cannot
    calibrate, so the next call captures again; the commit then fixes scales from its own K/V."""
    _, spec = gpu_model_and_spec()
    spec = dataclasses.replace(spec, kv_dtype="float8_e4m3fn")
    cache = am.KVCache(spec, num_pages=64, device="cuda", backend="flashinfer")
    state = cache.open_session()
    g = torch.Generator(device="cuda").manual_seed(4)
    step = CUDAGraphStep(_self_attention_only)
    big = torch.randn(2, spec.chunk_size, 512, device="cuda", dtype=DTYPE, generator=g) * 100
    x = torch.randn(2, spec.chunk_size, 512, device="cuda", dtype=DTYPE, generator=g)
    with torch.no_grad():
        fwd = state.prepare_forward(None, spec.chunk_size, True, static=True)
        step(fwd, big)
        assert cache._pool.quantizer.state(0) == "provisional"
        fwd.abort()
        assert cache._pool.quantizer.state(0) == "open"
        with state.prepare_forward(None, spec.chunk_size, True, static=True) as fwd:
            assert step.will_capture(fwd)
            step(fwd, x)
    assert [cache._pool.quantizer.state(i) for i in range(spec.num_layers)] == ["fixed"] * spec.num_layers
    eager_cache = am.KVCache(spec, num_pages=64, device="cuda", backend="flashinfer")
    eager_state = eager_cache.open_session()
    with torch.no_grad(), eager_state.prepare_forward(None, spec.chunk_size, True) as fwd:
        _self_attention_only(x, fwd.layers)
    # from x, not from the aborted 100x (same kernels on the same inputs as the eager run)
    torch.testing.assert_close(cache._pool.scales, eager_cache._pool.scales, rtol=1e-2, atol=1e-6)


def test_a_capture_alone_writes_nothing_so_its_forward_cannot_commit() -> None:
    """``capture()`` launches nothing: its recorded writes count only when a replay runs them (issue 24 review)."""
    _, spec = gpu_model_and_spec()
    cache = am.KVCache(spec, num_pages=64, device="cuda", backend="flashinfer")
    state = cache.open_session()
    x = torch.randn(2, spec.chunk_size, 512, device="cuda", dtype=DTYPE)
    step = CUDAGraphStep(_self_attention_only, warmup_iters=0)
    with torch.no_grad():
        fwd = state.prepare_forward(None, spec.chunk_size, True, static=True)
        step.capture(fwd, x)
        with pytest.raises(am.errors.IncompleteForwardError):
            fwd.commit()
        with state.prepare_forward(None, spec.chunk_size, True, static=True) as fwd:
            step(fwd, x)  # the next forward replays the graph: the replay records its writes, so it commits
    assert state.committed_chunks("cond") == 1
    fp8 = am.KVCache(dataclasses.replace(spec, kv_dtype="float8_e4m3fn"), num_pages=64, device="cuda",
                     backend="flashinfer")
    with torch.no_grad(), pytest.raises(am.SpecError, match="before a CUDA-graph capture"):
        with fp8.open_session().prepare_forward(None, spec.chunk_size, True, static=True) as fwd:
            CUDAGraphStep(_self_attention_only, warmup_iters=0)(fwd, x)  # nothing calibrated the layers yet
