"""The frame mapping against Self-Forcing / LongLive's rolling buffer, on the cache (issue 26 item 3).

A stream of chunks (a 1-frame first chunk for image-to-video, ``chunk_lengths`` for a forward holding two
chunks of different sizes) runs on a cache whose policy is ``SinkWindowPolicy.from_frames``. Each forward's
visibility (``ForwardContext.to_dense()`` over ``key_positions()``) must equal the rolling buffer's
(``tests.support.rolling_buffer``, frames -> tokens), and ``chunk_attention``'s outputs the contiguous
rolling buffer's. The README's rule before issue 26 gives (1, 2) for (sink 3, local 12, F 3) whatever the
first chunk: with a 1-frame first chunk that differs from the buffer, and ``from_frames`` refuses it.
"""

from __future__ import annotations

import pytest
import torch

import ardiff_modules as am
from tests.support.rolling_buffer import chunk_frames, rolling_attention, visible_frames

TOKENS_PER_FRAME, HEADS, DIM = 2, 2, 4
CASES = [
    # sink_size, local_attn_size, frames_per_chunk, independent_first_frame
    pytest.param(1, 7, 3, True, id="i2v-sink1-local7-F3"),
    pytest.param(1, 10, 3, True, id="i2v-sink1-local10-F3"),
    pytest.param(0, 9, 3, True, id="i2v-sink0-local9-F3"),
    pytest.param(4, 10, 3, True, id="i2v-sink4-local10-F3"),
    pytest.param(1, 5, 2, True, id="i2v-sink1-local5-F2"),
    pytest.param(3, 12, 3, False, id="t2v-sink3-local12-F3"),
]


def run_stream(policy: am.RetentionPolicy, chunks: list[range], seed: int = 0):
    """Run ``chunks`` (frame ranges) through a one-layer float32 cache: chunks 0 and 1 in one forward
    (``chunk_lengths``), then one per forward. Per chunk: the visible key positions of its queries (one set
    per query token) and its output; and the q/k/v fed in."""
    f = max(len(c) for c in chunks)
    spec = am.KVCacheSpec(num_layers=1, num_kv_heads=HEADS, head_dim=DIM, chunk_size=f * TOKENS_PER_FRAME,
                          page_size=TOKENS_PER_FRAME, retention=policy, dtype="float32")
    cache = am.KVCache(spec, num_pages=128, backend="reference")
    state = cache.open_session()
    lengths = [len(c) * TOKENS_PER_FRAME for c in chunks]
    g = torch.Generator().manual_seed(seed)
    qkv = [tuple(torch.randn(1, n, HEADS, DIM, generator=g) for _ in range(3)) for n in lengths]
    groups = [[0, 1]] + [[c] for c in range(2, len(chunks))]
    seen, outputs = [], []
    for group in groups:
        sizes = [lengths[c] for c in group]
        q, k, v = (torch.cat([qkv[c][i] for c in group], dim=1) for i in range(3))
        with state.prepare_forward(None, sum(sizes), commit_current=True, chunk_lengths=sizes) as fwd:
            out = am.chunk_attention(q, k, v, fwd.layers[0])
            dense, positions = fwd.to_dense()[0], fwd.key_positions()[0]
        start = 0
        for size in sizes:
            seen.append([set(positions[dense[row]].tolist()) for row in range(start, start + size)])
            outputs.append(out[:, start:start + size])
            start += size
    return seen, outputs, qkv


def buffer_tokens(frames: list[int]) -> set[int]:
    return {frame * TOKENS_PER_FRAME + t for frame in frames for t in range(TOKENS_PER_FRAME)}


@pytest.mark.parametrize(("sink", "local", "f", "i2v"), CASES)
def test_visibility_and_outputs_equal_the_rolling_buffer(sink, local, f, i2v) -> None:
    chunks = chunk_frames(local + 4, f, i2v)
    policy = am.SinkWindowPolicy.from_frames(
        sink_size=sink, local_attn_size=local, frames_per_chunk=f, independent_first_frame=i2v
    )
    seen, outputs, qkv = run_stream(policy, chunks)
    for c, frames in enumerate(visible_frames(sink, local, chunks)):
        assert all(keys == buffer_tokens(frames) for keys in seen[c]), f"chunk {c}: {sorted(seen[c][0])}"
    expected = rolling_attention([t[0] for t in qkv], [t[1] for t in qkv], [t[2] for t in qkv],
                                 sink * TOKENS_PER_FRAME, local * TOKENS_PER_FRAME)
    for c, (got, want) in enumerate(zip(outputs, expected)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"chunk {c}")


def test_the_old_readme_rule_misses_the_buffer_with_a_one_frame_first_chunk() -> None:
    sink, local, f = 3, 12, 3
    old = am.SinkWindowPolicy(sink // f, local // f - sink // f - 1)  # the README's rule before issue 26
    chunks = chunk_frames(local + 4, f, independent_first_frame=True)
    seen, outputs, qkv = run_stream(old, chunks)
    buffer = visible_frames(sink, local, chunks)
    assert any(seen[c][0] != buffer_tokens(frames) for c, frames in enumerate(buffer))
    expected = rolling_attention([t[0] for t in qkv], [t[1] for t in qkv], [t[2] for t in qkv],
                                 sink * TOKENS_PER_FRAME, local * TOKENS_PER_FRAME)
    assert max((got - want).abs().max().item() for got, want in zip(outputs, expected)) > 1e-2
    with pytest.raises(am.SpecError, match="expected whole leading chunks"):
        am.SinkWindowPolicy.from_frames(sink_size=sink, local_attn_size=local, frames_per_chunk=f,
                                        independent_first_frame=True)
