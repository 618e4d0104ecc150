"""Self-Forcing's drop-in layers (``swap_self_attention``) over a cache with retention groups (issue 41).

Two groups with upstream's own retention split every layer's heads (so the cache has two lanes and every layer
two shares): the upstream loop over the swapped layers equals upstream's rolling buffer, through the window
sliding, from a grouped spec and from a grouped ``KVCache``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.integrations.self_forcing import swap_self_attention
from tests.integrations.test_self_forcing import ATOL, inputs, make_spec, run
from tests.support.self_forcing_pipeline import TINY, build_pipeline, twin


def grouped_spec(frames_per_block: int, sink_size: int, local_attn_size: int) -> am.KVCacheSpec:
    spec = make_spec(frames_per_block, sink_size, local_attn_size, 1)
    policy = spec.policy
    rows = [["a" if h % 2 else "b" for h in range(TINY.num_heads)] for _ in range(TINY.num_layers)]
    return dataclasses.replace(
        spec, sink_chunks=0, window_chunks=None, num_qo_heads=TINY.num_heads,
        head_retention=am.HeadRetention({"a": policy, "b": policy}, rows),
    )


@pytest.mark.parametrize("given", ["spec", "cache"])
def test_upstream_loop_over_a_grouped_cache_equals_upstream(given: str) -> None:
    upstream = build_pipeline(local_attn_size=3, sink_size=1, frames_per_block=1)
    ours = twin(upstream)
    spec = grouped_spec(1, 1, 3)
    target = spec if given == "spec" else am.KVCache(spec, num_pages=64, backend="reference")
    session = swap_self_attention(ours.generator.model, target, **({"num_pages": 64} if given == "spec" else {}))
    assert len(session.cache._lanes) == 2
    noise, text = inputs(1, 6)
    torch.testing.assert_close(run(ours, noise, text), run(upstream, noise, text), atol=ATOL, rtol=0)
    session.close()
