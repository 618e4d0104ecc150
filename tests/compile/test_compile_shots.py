"""Compile contract with scene cuts: ``begin_shot`` and ``drop_window`` between forwards never recompile (issue 43)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import ardiff_modules as am
from tests.support.streaming_model import tiny_model_and_spec

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_dynamo")]

CHUNK = 4


@pytest.mark.parametrize("dynamic", [None, False])
def test_no_recompiles_across_shots_and_dropped_windows(dynamic: bool | None) -> None:
    model, spec = tiny_model_and_spec(sink=1, window=2)
    spec = dataclasses.replace(spec, sink_chunks=0, window_chunks=None, retention=am.ShotSinkPolicy(1, 2, 1))
    cache = am.KVCache(spec, num_pages=64, backend="reference")
    state = cache.open_session()
    g = torch.Generator().manual_seed(0)
    for branch in spec.branches:
        am.populate_cross_attention(state, branch, [b.cross for b in model.blocks], torch.randn(5, model.context_dim,
                                                                                                 generator=g))
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=dynamic)
    cuts, clean = {3, 6, 7, 11}, {6, 11}
    with torch.no_grad():
        for c in range(14):
            if c in cuts:
                state.begin_shot()
            for step in range(3):
                if step == 2 and c in clean:
                    state.drop_window()  # the clean forward attends the sink and itself: fewer keys
                with state.prepare_forward(spec.branches, CHUNK, commit_current=step == 2) as fwd:
                    compiled(torch.randn(2, CHUNK, model.dim, generator=g), fwd.layers)
    assert counter.frame_count == 1, f"expected one compiled frame, got {counter.frame_count}"
    assert state.history_chunk_indices("cond") == (0, 11, 13)
