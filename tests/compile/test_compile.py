"""Compile contract: fullgraph=True, equal to eager, one frame over a whole streaming rollout."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

from ardiff_modules import populate_cross_attention
from tests.support.streaming_model import (
    LibraryStreaming,
    play,
    play_event,
    rollout_events,
    tiny_model_and_spec,
)

# torch.compile (inductor) runs; each test starts from a clean dynamo cache
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_dynamo")]

CHUNK = 4


def test_inductor_fullgraph_matches_eager_over_rollout() -> None:
    model, spec = tiny_model_and_spec()
    events = rollout_events(12, CHUNK, model.dim, model.context_dim, fixed_shape=True)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    eager = play(LibraryStreaming(model, spec, 64), events)
    actual = play(LibraryStreaming(model, spec, 64, fn=compiled), events)
    for i, (a, e) in enumerate(zip(actual, eager)):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4, msg=lambda m, i=i: f"forward {i}: {m}")
    assert counter.frame_count == 1


@pytest.mark.parametrize("dynamic", [None, False])
def test_no_recompiles_across_sessions_eviction_prompt_switch_reset_and_abort(dynamic: bool | None) -> None:
    model, spec = tiny_model_and_spec(sink=1, window=2)
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=dynamic)
    runners = [LibraryStreaming(model, spec, 64, fn=compiled), LibraryStreaming(model, spec, 64, fn=compiled)]
    # Two sessions of one cache too: different sessions must not specialise the graph.
    shared = runners[0].cache.open_session("s1")
    events = rollout_events(14, CHUNK, model.dim, model.context_dim, fixed_shape=True, seed=1)
    for i, event in enumerate(events):
        for runner in runners:
            play_event(runner, event)
        if i == 0:
            for branch in spec.branches:
                populate_cross_attention(shared, branch, [b.cross for b in model.blocks], event[1][branch])
        elif event[0] == "forward":
            with torch.no_grad(), shared.prepare_forward(event[1], CHUNK, commit_current=event[3]) as fwd:
                compiled(event[2], fwd.layers)
        # An exception mid-forward aborts the pending chunk; the next forward must not recompile.
        if i % 7 == 3:
            with pytest.raises(RuntimeError, match="injected"), torch.no_grad():
                with shared.prepare_forward(spec.branches, CHUNK, commit_current=True) as fwd:
                    compiled(event[2] if event[0] == "forward" else torch.randn(2, CHUNK, model.dim), fwd.layers)
                    raise RuntimeError("injected failure")
    assert counter.frame_count == 1, f"expected one compiled frame, got {counter.frame_count}"
    assert shared.committed_chunks("cond") >= 12  # windows filled and evicted


def test_one_graph_per_block_when_blocks_are_compiled_separately() -> None:
    """Per-block compilation (a common pattern) shares one graph: the layer is data, not a constant."""
    model, spec = tiny_model_and_spec()
    counter = CompileCounter()
    for block in model.blocks:
        block.compile(backend=counter, fullgraph=True)
    runner = LibraryStreaming(model, spec, 64)
    events = rollout_events(6, CHUNK, model.dim, model.context_dim, fixed_shape=True)
    play(runner, events)
    assert counter.frame_count == 1, f"expected one graph shared by {len(model.blocks)} blocks, got {counter.frame_count}"


def test_multi_chunk_forward_is_one_new_shape_only() -> None:
    """A forward of a different chunk count is a new input shape: at most one extra graph, then stable."""
    model, spec = tiny_model_and_spec()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    runner = LibraryStreaming(model, spec, 200, fn=compiled)
    runner.set_prompt({b: torch.randn(5, model.context_dim) for b in spec.branches})
    with torch.no_grad():
        for n in (1, 1, 2, 2, 3, 1, 2, 3):
            runner.forward(spec.branches, torch.randn(2, n * CHUNK, model.dim), True)
    assert counter.frame_count <= 2
    assert runner.state.token_offset("cond") == 15 * CHUNK


def test_enable_gqa_flag_is_a_constant_under_dynamic_shapes() -> None:
    """``needs_gqa`` (SDPA's enable_gqa in the cross-attention and reference paths) under dynamic head counts:
    ``bool(a != b)`` stays a SymBool in dynamo and SDPA refuses it; the helper's branch specializes."""
    import torch.nn.functional as F

    from ardiff_modules.checks import needs_gqa

    torch._dynamo.reset()

    @torch.compile(backend="eager", dynamic=True, fullgraph=True)
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=needs_gqa(q.shape[1], k.shape[1]))

    g = torch.Generator().manual_seed(0)
    for heads, kv_heads in ((4, 4), (6, 6), (4, 2), (6, 3)):
        q = torch.randn(1, heads, 5, 8, generator=g)
        k, v = (torch.randn(1, kv_heads, 7, 8, generator=g) for _ in range(2))
        expected = F.scaled_dot_product_attention(q, k, v, enable_gqa=heads != kv_heads)
        torch.testing.assert_close(attend(q, k, v), expected)
