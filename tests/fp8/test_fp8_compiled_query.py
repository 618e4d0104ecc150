"""FP8 query quantized by the compiled graph (issue 28 item 3), on the CPU.

FlashInfer's FA3 over an FP8 pool needs an FP8 query. Eagerly the plan quantizes it inside the opaque op;
under ``torch.compile`` the layer's graph quantizes it next to the norm / RoPE that produce it and the op
(``ardiff_modules::paged_attention_fp8``) receives ``(q8, q_scale)``. FlashInfer needs a GPU, so these tests
run a *spy* backend: the reference backend posing as FA3 over an FP8 pool (``takes_fp8_query``), which
records the query each layer hands it and attends the dequantized FP8 query -- the FA3 semantics, exactly.
The GPU tests (``tests/gpu/test_fp8_compiled_query.py``) run the real kernels.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend
from torch._inductor.utils import run_and_get_code

import ardiff_modules as am
from ardiff_modules.backends.base import AttentionPlan, PlanRequest, fold_softmax_scale
from ardiff_modules.backends.flashinfer import FlashInferPlan
from ardiff_modules.backends.reference import ReferenceBackend, ReferencePlan
from ardiff_modules.backends.segmented import RelativeSinkPlan
from ardiff_modules.ops import attend_in_graph
from ardiff_modules.quant import KVQuantizer, dequantize, quantize_query
from tests.support.streaming_model import LibraryStreaming, play, play_event, rollout_events, tiny_model_and_spec

FP8 = "float8_e4m3fn"
CHUNK = 4


class SpyPlan(ReferencePlan):
    """A reference plan that takes an FP8 query like FA3 over an FP8 pool (not with a token mask, like FA2).

    Records ``(q dtype, q_scale dtype and shape or None, q, q_scale)`` per ``attend``; quantizes the query
    itself when it gets a 16-bit one (what ``FlashInferPlan`` does eagerly) and attends ``q8 * q_scale``.
    """

    def __init__(self, request: PlanRequest, calls: list[tuple[Any, ...]]) -> None:
        super().__init__(request)
        self.masked = request.token_mask is not None
        self.dtype = request.dtype
        self.calls = calls

    @property
    def takes_fp8_query(self) -> bool:
        return self.quantizer is not None and not self.masked

    def attend(  # type: ignore[override]
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, return_lse: bool = False,
        *, layer: int = 0, q_scale: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        self.calls.append((q.dtype, None if q_scale is None else (q_scale.dtype, tuple(q_scale.shape)), q.clone(),
                           None if q_scale is None else q_scale.clone()))
        if self.takes_fp8_query:
            if q_scale is None:  # eager: the plan quantizes (FlashInferPlan's _kernel_query)
                q, q_scale = quantize_query(fold_softmax_scale(q, scale))
            else:
                assert scale == pytest.approx(q.shape[-1] ** -0.5)  # the op passes the kernel's default
            q, scale = dequantize(q, q_scale, self.dtype), q.shape[-1] ** -0.5
        return super().attend(q, k_cache, v_cache, scale, return_lse, layer=layer)


class SpyBackend(ReferenceBackend):
    name = "spy-fa3"

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def plan(self, request: PlanRequest, previous: AttentionPlan | None) -> SpyPlan:
        return SpyPlan(request, self.calls)


class SpyStreaming(LibraryStreaming):
    """:class:`LibraryStreaming` over a cache of the spy backend."""

    def __init__(self, model: torch.nn.Module, spec: am.KVCacheSpec, num_pages: int, fn: Any = None) -> None:
        self.model = model
        self.fn = model if fn is None else fn
        self.backend = SpyBackend()
        self.cache = am.KVCache(spec, num_pages=num_pages, backend=self.backend)
        self.state = self.cache.open_session("s0")


SPEC = am.KVCacheSpec(
    num_layers=2, num_kv_heads=2, head_dim=8, chunk_size=CHUNK, page_size=2, sink_chunks=1, window_chunks=2,
    branches=("cond", "uncond"), dtype="float32", num_qo_heads=4, kv_dtype=FP8,
)


def _qkv(seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """``q [2, CHUNK, 4 heads, 8]`` (heads of very different ranges), ``k``, ``v`` ``[2, CHUNK, 2, 8]``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, CHUNK, 4, 8, generator=g) * torch.tensor([1.0, 3.0, 0.2, 7.0])[:, None]
    k, v = torch.randn(2, CHUNK, 2, 8, generator=g), torch.randn(2, CHUNK, 2, 8, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


# ------------------------------------------------------------------ the flag


def _flag(cache: am.KVCache, **forward: Any) -> bool:
    state = cache.open_session()
    fwd = state.prepare_forward(None, CHUNK, **forward)
    flag = fwd._fp8_query
    fwd.abort()
    state.close()
    return flag


def test_the_flag_is_true_only_for_a_plan_whose_kernel_takes_an_fp8_query() -> None:
    assert _flag(am.KVCache(SPEC, num_pages=16, backend="reference")) is False  # SDPA over dequantized K/V
    assert _flag(am.KVCache(dataclasses.replace(SPEC, kv_dtype=None), num_pages=16, backend=SpyBackend())) is False
    assert _flag(am.KVCache(SPEC, num_pages=16, backend=SpyBackend())) is True
    mask = torch.ones(2, CHUNK, CHUNK, dtype=torch.bool)
    assert _flag(am.KVCache(SPEC, num_pages=16, backend=SpyBackend()), token_mask=mask) is False  # FA2 + mask


def test_flashinfer_plans_take_an_fp8_query_on_fa3_over_an_fp8_pool_only() -> None:
    """``FlashInferPlan.takes_fp8_query`` from what its object fixes (FlashInfer itself needs a GPU: the GPU
    tests check real plans in every mode)."""
    quantizer = KVQuantizer(torch.ones(2, 2, 2), torch.float8_e4m3fn)
    for q, masked, expected in [(quantizer, False, True), (quantizer, True, False), (None, False, False)]:
        plan = FlashInferPlan.__new__(FlashInferPlan)  # no plan(): only the two fields the flag reads
        plan.quantizer, plan.masked = q, masked
        assert plan.takes_fp8_query is expected, (q, masked)


def test_relative_sinks_keep_the_flag_false_in_every_forward() -> None:
    """The one-segment forwards (no sink resident yet) would say True and the two-segment ones False: a flip
    within the rollout would recompile, so relative sinks keep the 16-bit query throughout."""
    spec = dataclasses.replace(SPEC, relative_sinks=True)
    cache = am.KVCache(spec, num_pages=64, backend=SpyBackend())
    state = cache.open_session()
    flags = []
    for step in range(5):
        q, k, v = _qkv(step)
        with state.prepare_forward(None, CHUNK, commit_current=True) as fwd:
            flags.append(fwd._fp8_query)
            for layer in fwd.layers:
                am.chunk_attention(q, k, v, layer, sink_query=q)
    assert flags == [False] * 5


# ------------------------------------------------------------------ the op


def test_eager_layers_hand_the_op_the_16_bit_query_as_before() -> None:
    cache = am.KVCache(SPEC, num_pages=16, backend=SpyBackend())
    q, k, v = _qkv(1)
    with cache.open_session().prepare_forward(None, CHUNK, commit_current=True) as fwd:
        assert fwd._fp8_query
        for layer in fwd.layers:
            am.chunk_attention(q, k, v, layer)
    assert [c[:2] for c in cache.backend.calls] == [(torch.float32, None)] * 2


def _compiled_q8(dtype: torch.dtype, scale: float | None) -> tuple[list[tuple[Any, ...]], torch.Tensor]:
    """The ``(q8, q_scale)`` each layer's compiled graph hands the FP8 op, and the eager query."""
    cache = am.KVCache(dataclasses.replace(SPEC, dtype=dtype), num_pages=16, backend=SpyBackend())
    q, k, v = _qkv(2, dtype=dtype)
    attend = torch.compile(am.chunk_attention, fullgraph=True)
    with torch.no_grad(), cache.open_session().prepare_forward(None, CHUNK, commit_current=True) as fwd:
        for layer in fwd.layers:
            attend(q, k, v, layer, scale=scale)
    return cache.backend.calls, q


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("scale", [None, 0.05], ids=["default-scale", "custom-scale"])
def test_compiled_graph_hands_the_op_the_same_fp8_query_as_eager_quantization(scale: float | None) -> None:
    """Same math as the eager path (``fold_softmax_scale`` then ``quantize_query``): the same FP8 bytes and
    scales (float32 compute on the CPU: inductor's fused kernel rounds exactly like eager)."""
    calls, q = _compiled_q8(torch.float32, scale)
    assert [c[:2] for c in calls] == [(torch.float8_e4m3fn, (torch.float32, (4,)))] * 2
    rows = q.reshape(-1, 4, 8)
    expected_q8, expected_scale = quantize_query(fold_softmax_scale(rows, 8**-0.5 if scale is None else scale))
    for _, _, q8, q_scale in calls:
        assert torch.equal(q8.view(torch.uint8), expected_q8.view(torch.uint8))
        assert torch.equal(q_scale, expected_scale)


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_bf16_query_quantization_matches_eager_up_to_fused_rounding() -> None:
    """In bf16 inductor may skip the bf16 rounding of ``q / scale`` before the FP8 cast: a value can land
    one FP8 step away, nothing more (the scales are exact: the amax is)."""
    calls, q = _compiled_q8(torch.bfloat16, None)
    expected_q8, expected_scale = quantize_query(q.reshape(-1, 4, 8))
    for _, _, q8, q_scale in calls:
        assert torch.equal(q_scale, expected_scale)
        step = (q8.float() - expected_q8.float()).abs() / expected_q8.float().abs().clamp(min=2.0**-6)
        assert float(step.max()) <= 2.0**-3 + 1e-6  # within one e4m3 step (3 mantissa bits)
        assert float((q8.view(torch.uint8) != expected_q8.view(torch.uint8)).float().mean()) < 0.05


_Q8 = re.compile(r"empty_strided_cpu\(\((\d+), (\d+), (\d+)\), \([0-9, ]*\), torch\.float8_e4m3fn\)")


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_model_quantizes_q_in_its_graph_and_equals_eager_over_a_rollout() -> None:
    """A whole compiled model over a rollout (prompt switch, reset, eviction): one frame; every layer's op
    gets FP8 q + float32 [heads] scales, quantized by the graph (an FP8 buffer of q's shape, the per-head amax
    fused with the RoPE rotation); outputs equal the eager rollout within FP8 rounding of fused intermediates."""
    model, spec = tiny_model_and_spec(kv_dtype=FP8)
    events = rollout_events(10, CHUNK, model.dim, model.context_dim, fixed_shape=True)
    eager_runner = SpyStreaming(model, spec, 64)
    eager = play(eager_runner, events)
    assert {c[:2] for c in eager_runner.backend.calls} == {(torch.float32, None)}
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    runner = SpyStreaming(model, spec, 64, fn=compiled)
    runner.set_prompt(events[0][1])
    with torch.no_grad(), runner.state.prepare_forward(("cond", "uncond"), CHUNK, commit_current=True) as fwd:
        _, codes = run_and_get_code(compiled, events[1][2], fwd.layers)
    code = "\n".join(codes)
    assert code.count("paged_attention_fp8.default(") == len(model.blocks)
    assert "paged_attention.default(" not in code and "chunk_attention" not in code
    tokens, heads, dim = 2 * CHUNK, model.heads, model.dim // model.heads
    assert _Q8.findall(code).count((str(tokens), str(heads), str(dim))) == len(model.blocks), "q8 made in the graph"
    kernels = set(re.findall(r"\b(cpp_fused_\w+)", code))
    amax = [name for name in kernels if "linalg_vector_norm" in name]
    assert amax and all("stack" in name for name in amax), f"per-head amax not fused with RoPE: {sorted(kernels)}"
    runner = SpyStreaming(model, spec, 64, fn=compiled)
    actual = play(runner, events)
    assert counter.frame_count == 1, f"expected one compiled frame over the rollout, got {counter.frame_count}"
    assert {c[:2] for c in runner.backend.calls} == {(torch.float8_e4m3fn, (torch.float32, (model.heads,)))}
    for i, (a, e) in enumerate(zip(actual, eager)):
        torch.testing.assert_close(a, e, atol=3e-2, rtol=3e-2, msg=lambda m, i=i: f"forward {i}: {m}")


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_a_masked_forward_inside_an_fp8_rollout_adds_one_graph_and_takes_the_16_bit_query() -> None:
    """A token_mask forward runs FA2 (flag False): one more graph, reused by the later masked forwards; the
    unmasked forwards around it keep the first graph."""
    counter = CompileCounter()
    attend = torch.compile(am.chunk_attention, backend=counter, fullgraph=True)
    cache = am.KVCache(SPEC, num_pages=64, backend=SpyBackend())
    state = cache.open_session()
    for step in range(6):
        q, k, v = _qkv(10 + step)
        history = len(state.history_chunks("cond")) * CHUNK
        mask = torch.ones(2, CHUNK, history + CHUNK, dtype=torch.bool) if step in (2, 4) else None
        cache.backend.calls.clear()
        with torch.no_grad(), state.prepare_forward(None, CHUNK, commit_current=True, token_mask=mask) as fwd:
            assert fwd._fp8_query is (mask is None)
            outs = [attend(q, k, v, layer) for layer in fwd.layers]
        expected = torch.float32 if mask is not None else torch.float8_e4m3fn
        assert {c[0] for c in cache.backend.calls} == {expected}, step
        assert all(bool(torch.isfinite(o).all()) for o in outs)
    assert counter.frame_count == 2, f"expected the unmasked and the masked graph, got {counter.frame_count}"


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_lse_through_the_fp8_op_equals_eager() -> None:
    cache = am.KVCache(SPEC, num_pages=32, backend=SpyBackend())
    attend = torch.compile(am.chunk_attention, fullgraph=True)
    state = cache.open_session()
    for step in range(3):
        q, k, v = _qkv(20 + step)
        with torch.no_grad(), state.prepare_forward(None, CHUNK, commit_current=False) as fwd:
            eager = [am.chunk_attention(q, k, v, layer, return_lse=True) for layer in fwd.layers]
        with torch.no_grad(), state.prepare_forward(None, CHUNK, commit_current=True) as fwd:
            comp = [attend(q, k, v, layer, return_lse=True) for layer in fwd.layers]
        for (oe, le), (oc, lc) in zip(eager, comp):
            assert oc.dtype == torch.float32 and lc.dtype == torch.float32 and lc.shape == (2, CHUNK, 4)
            torch.testing.assert_close(oc, oe, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lc, le, atol=1e-5, rtol=1e-5)
    assert {c[0] for c in cache.backend.calls[-2:]} == {torch.float8_e4m3fn}


def test_the_fp8_op_refuses_plans_and_tensors_that_do_not_fit() -> None:
    q, k, v = _qkv(3)
    rows = q.reshape(-1, 4, 8)
    q8, q_scale = quantize_query(rows)
    op = torch.ops.ardiff_modules.paged_attention_fp8
    reference = am.KVCache(SPEC, num_pages=16, backend="reference")
    with reference.open_session().prepare_forward(None, CHUNK) as fwd:
        layer = fwd.layers[0]
        with pytest.raises(am.SpecError, match="expected a plan whose kernel takes an FP8 query"):
            op(q8, q_scale, layer._kv_pool, layer._layer_id, layer._handle_id, torch.float32)
        fwd.abort()
    spy = am.KVCache(SPEC, num_pages=16, backend=SpyBackend())
    with spy.open_session().prepare_forward(None, CHUNK) as fwd:
        layer = fwd.layers[0]
        args = (layer._kv_pool, layer._layer_id, layer._handle_id, torch.float32)
        with pytest.raises(am.TensorMismatchError, match="expected a float8_e4m3fn .* got torch.float32"):
            op(rows, q_scale, *args)
        with pytest.raises(am.TensorMismatchError, match=r"expected float32 of shape \(4,\).* got .* \(2,\)"):
            op(q8, q_scale[:2], *args)
        with pytest.raises(am.SpecError, match="expected no q_sink with fp8_query=True"):
            attend_in_graph(rows, *args[:3], 8**-0.5, rows, fp8_query=True)
        out = op(q8, q_scale, *args)  # the real call, for the shapes and dtype the fake impl promises
        assert out.shape == (2 * CHUNK, 4, 8) and out.dtype == torch.float32
        fwd.abort()


def test_plans_that_attend_the_compute_dtype_query_refuse_a_q_scale() -> None:
    """``AttentionPlan.attend`` declares the ``q_scale`` the FP8 op passes (issue 44 item 5: mypy found the op
    calling it with a keyword the interface lacked); the reference and relative-sinks plans, which attend the
    compute-dtype query, refuse one with a :class:`SpecError` naming expected and actual, the pool unchanged."""
    assert "q_scale" in inspect.signature(AttentionPlan.attend).parameters
    q, k, v = _qkv(5)
    q8, q_scale = quantize_query(q.reshape(-1, 4, 8))
    for relative in (False, True):
        spec = dataclasses.replace(SPEC, kv_dtype=None, relative_sinks=relative)
        cache = am.KVCache(spec, num_pages=32, backend="reference")
        state = cache.open_session()
        for _ in range(4):  # past the first eviction: a relative-sinks forward runs two segments
            with state.prepare_forward(None, CHUNK, True) as fwd:
                for layer in fwd.layers:
                    am.chunk_attention(q, k, v, layer, sink_query=q if relative else None)  # (no RoPE: any query)
        with state.prepare_forward(None, CHUNK) as fwd:
            plan = fwd._plan
            assert plan is not None and isinstance(plan, RelativeSinkPlan) is relative
            pages = (cache._pool.k_pages(0), cache._pool.v_pages(0))
            before = cache._pool.kv.clone()
            with pytest.raises(am.SpecError, match=r"attend: expected q_scale=None .* got a torch.float32 tensor"):
                plan.attend(q8, *pages, 8**-0.5, layer=0, q_scale=q_scale)
            assert torch.equal(cache._pool.kv, before)
            fwd.abort()


def test_fake_impls_promise_what_the_ops_return() -> None:
    """``torch.library.opcheck``: the fake (meta) impl and AOT dispatch of both FP8 ops on an open forward (its
    schema check compares FP8 inputs with a multiply CPU float8 lacks)."""
    q, k, v = _qkv(4)
    cache = am.KVCache(SPEC, num_pages=16, backend=SpyBackend())
    with cache.open_session().prepare_forward(None, CHUNK, commit_current=True) as fwd:
        for layer in fwd.layers:  # the pool holds this forward's K/V, as the compiled write leaves it
            am.chunk_attention(q, k, v, layer)
        q8, q_scale = quantize_query(q.reshape(-1, 4, 8))
        layer = fwd.layers[1]
        args = (q8, q_scale, layer._kv_pool, layer._layer_id, layer._handle_id, torch.float32)
        for op in (torch.ops.ardiff_modules.paged_attention_fp8, torch.ops.ardiff_modules.paged_attention_fp8_lse):
            torch.library.opcheck(op, args, test_utils=("test_faketensor", "test_aot_dispatch_static"))


@pytest.mark.usefixtures("fresh_dynamo")
def test_no_recompiles_of_the_op_path_across_a_rollout_with_the_eager_counter() -> None:
    """The quick-loop guard: dynamo's graph (no inductor) over a short rollout is one frame."""
    model, spec = tiny_model_and_spec(kv_dtype=FP8)
    counter = CompileCounter()
    runner = SpyStreaming(model, spec, 64, fn=torch.compile(model, backend=counter, fullgraph=True))
    for event in rollout_events(4, CHUNK, model.dim, model.context_dim, fixed_shape=True):
        play_event(runner, event)
    assert counter.frame_count == 1
    assert {c[:2] for c in runner.backend.calls} == {(torch.float8_e4m3fn, (torch.float32, (model.heads,)))}


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_the_benchmark_rows_compiled_layer_functions_trace_and_take_the_paths_they_name() -> None:
    """``benchmarks.attention``'s "library FP8, compiled q quantization" rows on the CPU (spy backend, no
    timing): ``layer`` hands the op an FP8 query, ``layer_op_q`` the bf16 one (the op quantizes), and they agree."""
    from benchmarks.attention import D, _compiled_layer, _Shape

    heads, chunk = 2, 16
    shape = _Shape(heads, chunk, 1, 1, 2, 8, torch=torch, am=am, dev=torch.device("cpu"))
    spec = am.KVCacheSpec(num_layers=1, num_kv_heads=heads, head_dim=D, chunk_size=chunk, page_size=8,
                          sink_chunks=1, window_chunks=1, branches=("b0", "b1"), dtype="bfloat16", kv_dtype=FP8)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, chunk, heads, D, generator=g).bfloat16() for _ in range(3))
    layer, layer_op_q, produce = _compiled_layer(shape)
    cache = am.KVCache(spec, num_pages=32, backend=SpyBackend())
    state = cache.open_session()
    for _ in range(3):  # the window full
        with state.prepare_forward(None, chunk, commit_current=True) as fwd:
            am.chunk_attention(q, k, v, fwd.layers[0])
    fwd = state.prepare_forward(None, chunk, commit_current=False)
    calls = cache.backend.calls
    calls.clear()
    out = layer(q, k, v, fwd.layers[0])
    out_op_q = layer_op_q(q, k, v, fwd.layers[0])
    qr, kr = produce(q, k)
    assert [c[0] for c in calls] == [torch.float8_e4m3fn, torch.bfloat16]
    assert out.shape == out_op_q.shape == qr.shape == (2, chunk, heads, D) and kr.shape == qr.shape
    # fused vs materialized bf16 RoPE output before the FP8 cast: a few query values one FP8 step apart
    assert float((out.float() - out_op_q.float()).norm() / out_op_q.float().norm()) < 3e-2
    fwd.abort()
