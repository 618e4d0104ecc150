"""Compiled K/V write: inductor writes K/V into the pool from the kernel that computes them.

Guards three things a compiled model relies on:

* the generated code writes into the pool in place -- no buffer the size of a layer's pages is
  allocated (functionalization cloning the pool and copying it back would be one, every layer);
* compiled outputs, pool contents and FP8 scales equal eager over a rollout;
* a finished forward's layers raise before the compiled graph writes anything (the write is no
  longer inside the opaque op that checks it).
"""

from __future__ import annotations

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from ardiff_modules.errors import ForwardFinishedError
from tests.support.streaming_model import (
    LibraryStreaming,
    play,
    rollout_events,
    tiny_model_and_spec,
)

# inductor compiles; each test starts from a clean dynamo cache
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_dynamo")]

CHUNK = 4
_ALLOC = re.compile(r"empty_strided_cpu\(\(([0-9, ]*)\)")


def _allocated_numels(code: str) -> list[int]:
    numels = []
    for shape in _ALLOC.findall(code):
        n = 1
        for dim in filter(None, (d.strip() for d in shape.split(","))):
            n *= int(dim)
        numels.append(n)
    return numels


@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
def test_compiled_graph_writes_the_pool_in_place(kv_dtype: str | None) -> None:
    model, spec = tiny_model_and_spec(kv_dtype=kv_dtype)
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    runner = LibraryStreaming(model, spec, 64, fn=compiled)
    events = rollout_events(3, CHUNK, model.dim, model.context_dim, fixed_shape=True)
    runner.set_prompt(events[0][1])
    x = events[1][2]
    with torch.no_grad(), runner.state.prepare_forward(("cond", "uncond"), CHUNK, commit_current=True) as fwd:
        _, codes = run_and_get_code(compiled, x, fwd.layers)
    code = "\n".join(codes)
    assert "kv_write_slots" in code and "paged_attention" in code, "expected the compiled write path"
    assert "chunk_attention" not in code, "the opaque write-and-attend op should not be in a compiled graph"
    layer_numel = runner.cache._pool.kv[0].numel()
    big = [n for n in _allocated_numels(code) if n >= layer_numel]
    assert not big, f"expected no pool-sized buffer (>= {layer_numel} elements) in the graph, got {big}"


@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
def test_compiled_write_equals_eager_over_rollout(kv_dtype: str | None) -> None:
    model, spec = tiny_model_and_spec(kv_dtype=kv_dtype)
    events = rollout_events(10, CHUNK, model.dim, model.context_dim, fixed_shape=True)
    eager_runner = LibraryStreaming(model, spec, 64)
    eager = play(eager_runner, events)
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    runner = LibraryStreaming(model, spec, 64, fn=compiled)
    actual = play(runner, events)
    tol = dict(atol=1e-4, rtol=1e-4) if kv_dtype is None else dict(atol=3e-2, rtol=3e-2)
    for i, (a, e) in enumerate(zip(actual, eager)):
        torch.testing.assert_close(a, e, **tol, msg=lambda m, i=i: f"forward {i}: {m}")
    # The pools hold the same K/V (FP8: the same bytes up to one rounding step of a few values).
    got, want = runner.cache._pool.kv.float(), eager_runner.cache._pool.kv.float()
    if kv_dtype is None:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(runner.cache._pool.scales, eager_runner.cache._pool.scales)
        assert (got != want).float().mean() < 0.01, "more than 1% of the FP8 values differ from eager"
        assert runner.cache._pool.quantizer.written


def test_finished_forward_cannot_write_through_a_compiled_graph() -> None:
    model, spec = tiny_model_and_spec()
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    runner = LibraryStreaming(model, spec, 64, fn=compiled)
    events = rollout_events(3, CHUNK, model.dim, model.context_dim, fixed_shape=True)
    runner.set_prompt(events[0][1])
    x = events[1][2]
    with torch.no_grad():
        with runner.state.prepare_forward(("cond", "uncond"), CHUNK, commit_current=True) as fwd:
            compiled(x, fwd.layers)
        before = runner.cache._pool.kv.clone()
        with pytest.raises(ForwardFinishedError):
            compiled(torch.randn_like(x), fwd.layers)  # committed: its pages are history now
    assert torch.equal(runner.cache._pool.kv, before), "a finished forward wrote into the pool"


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fp8_calibration_in_a_compiled_graph_reaches_the_pool(backend: str) -> None:
    """The gate op calibrates the scales the graph quantizes with *and* the pool's, whatever the backend
    (aot_eager keeps the functional copy of the scales that inductor rewrites in place)."""
    model, spec = tiny_model_and_spec(kv_dtype="float8_e4m3fn")
    events = rollout_events(4, CHUNK, model.dim, model.context_dim, fixed_shape=True)
    eager_runner = LibraryStreaming(model, spec, 64)
    eager = play(eager_runner, events)
    runner = LibraryStreaming(model, spec, 64, fn=torch.compile(model, backend=backend, fullgraph=True))
    actual = play(runner, events)
    torch.testing.assert_close(runner.cache._pool.scales, eager_runner.cache._pool.scales)
    assert not torch.equal(runner.cache._pool.scales, torch.ones_like(runner.cache._pool.scales))
    for a, e in zip(actual, eager):
        torch.testing.assert_close(a, e, atol=3e-2, rtol=3e-2)
