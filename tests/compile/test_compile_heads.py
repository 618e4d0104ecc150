"""A model over a cache with retention groups (``KVCacheSpec(head_retention=...)``) compiles as one frame and never
recompiles over a rollout."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

import ardiff_modules as am
from tests.heads.oracle import session_budget
from tests.support.streaming_model import TinyStreamingModel

CHUNK = 4
HEADS = am.HeadRetention(
    {"local": (0, 1), "global": (1, 2)},
    [["global", "local", "local", "global"], ["local", "local", "global", "global"], ["local"] * 4],
)


def _model_and_cache() -> tuple[TinyStreamingModel, am.KVCache]:
    torch.manual_seed(0)
    model = TinyStreamingModel().eval()
    spec = dataclasses.replace(model.spec(CHUNK, 2, 0, None), sink_chunks=0, window_chunks=None, head_retention=HEADS)
    return model, am.KVCache(spec, budget_bytes=session_budget(spec, 2), backend="reference")


def _rollout(fn, model: TinyStreamingModel, cache: am.KVCache, chunks: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    session = cache.open_session()
    outs = []
    for branch in ("cond", "uncond"):
        text = torch.randn(5, model.context_dim, generator=gen)
        am.populate_cross_attention(session, branch, [b.cross for b in model.blocks], text)
    with torch.no_grad():
        for chunk in range(chunks):
            for commit in (False, True):
                x = torch.randn(2, CHUNK, model.dim, generator=gen)
                with session.prepare_forward(None, CHUNK, commit_current=commit) as fwd:
                    outs.append(fn(x, fwd.layers))
            if chunk == 4:  # prompt switch mid-stream
                session.clear_cross_attention()
                for branch in ("cond", "uncond"):
                    text = torch.randn(5, model.context_dim, generator=gen)
                    am.populate_cross_attention(session, branch, [b.cross for b in model.blocks], text)
    session.close()
    return outs


@pytest.mark.slow
def test_inductor_fullgraph_over_a_grouped_cache_matches_eager_without_recompiles() -> None:
    model, cache = _model_and_cache()
    eager = _rollout(model, model, cache, 7)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    actual = _rollout(compiled, model, cache, 7)
    for i, (a, e) in enumerate(zip(actual, eager)):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4, msg=lambda m, i=i: f"forward {i}: {m}")
    assert counter.frame_count == 1


def test_windows_filling_and_evicting_per_group_do_not_recompile() -> None:
    model, cache = _model_and_cache()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    eager = _rollout(model, model, cache, 6)
    actual = _rollout(compiled, model, cache, 6)
    torch.testing.assert_close(torch.stack(actual), torch.stack(eager), atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 1, f"expected one compiled frame, got {counter.frame_count}"
