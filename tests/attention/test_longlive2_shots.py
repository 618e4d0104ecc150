"""LongLive 2.0's multi-shot sink on the cache, against its buffer re-stated from upstream (issue 43 item 3).

A stream of chunks, each denoised by two forwards and then written by its clean forward, some of them scene
cuts, runs twice: through ``tests.support.longlive2_buffer`` (upstream's ``CausalWanSelfAttention`` buffer with
``pinned_start`` / ``pinned_len``, ``_zero_kv_data``, ``_pin_current_chunk``) and through a one-layer float32
cache under ``ShotSinkPolicy.from_frames`` driven by ``integrations.longlive2.LongLive2Shots`` from the same
per-chunk prompts (``begin_shot`` at a cut, ``drop_window`` before its clean forward with ``shot_clean_recache``).
Every forward must attend exactly the key positions the buffer holds (``to_dense()`` over ``key_positions()``)
and give the same output within 1e-5; keys are rotated at the cache's ``kv.positions`` (plus upstream's
``multi_shot_rope_offset``), the buffer's at upstream's ``current_start``: positions must run on across a
dropped window.
"""

from __future__ import annotations

import random

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.integrations.longlive2 import LongLive2Shots
from tests.support.longlive2_buffer import SCENE_CUT_PREFIX, LongLive2Buffer, rope_offsets, run_longlive2

TOKENS_PER_FRAME, HEADS, DIM, DENOISE = 2, 2, 8, 2
CASES = [
    # sink_size, local_attn_size, frames_per_chunk (frames); upstream's config: 8, 32, 8
    pytest.param(8, 32, 8, id="upstream-sink8-local32-F8"),
    pytest.param(2, 8, 2, id="sink2-local8-F2"),
    pytest.param(2, 12, 2, id="sink2-local12-F2"),
    pytest.param(4, 12, 2, id="sink4-local12-F2"),
]
SCHEDULES = [
    pytest.param({3}, id="one-cut"),
    pytest.param({1, 2}, id="cut-after-sink-and-again"),
    pytest.param({4, 6, 7, 11}, id="several"),
    pytest.param("random", id="random"),
]


def stream(num_chunks: int, chunk_tokens: int, seed: int) -> list[list[tuple[torch.Tensor, ...]]]:
    """Raw (unrotated) q, k, v ``[1, tokens, heads, dim]`` of every forward of every chunk."""
    g = torch.Generator().manual_seed(seed)
    return [[tuple(torch.randn(1, chunk_tokens, HEADS, DIM, generator=g) for _ in range(3))
             for _ in range(DENOISE + 1)] for _ in range(num_chunks)]


def prompts_with_cuts(num_chunks: int, cuts: set[int]) -> list[str]:
    """One prompt per chunk; a cut chunk's starts with upstream's scene-cut prefix."""
    return [(SCENE_CUT_PREFIX if c in cuts else "") + f"shot text {c}" for c in range(num_chunks)]


def run_cache(shots: LongLive2Shots, policy: am.ShotSinkPolicy, forwards, phi: float):
    """The stream on the cache, driven by ``LongLive2Shots``: per forward, its output and the key positions each
    query attended."""
    n = forwards[0][0][0].shape[1]
    spec = am.KVCacheSpec(num_layers=1, num_kv_heads=HEADS, head_dim=DIM, chunk_size=n,
                          page_size=TOKENS_PER_FRAME, retention=policy, dtype="float32")
    cache = am.KVCache(spec, num_pages=256, backend="reference")
    state = cache.open_session()
    rope = am.RotaryEmbedding(DIM)
    outputs, attended = [], []
    for c, chunk in enumerate(forwards):
        shots.chunk_start(state, c)
        offset = round(shots.rope_offset(c) * TOKENS_PER_FRAME)  # 1-D RoPE here: frames -> tokens
        outs = []
        for i, (q, k, v) in enumerate(chunk):
            last = i == len(chunk) - 1
            if last:
                shots.before_clean_forward(state, c)
            with state.prepare_forward(None, n, commit_current=last) as fwd:
                kv = fwd.layers[0]
                positions = kv.positions + offset
                outs.append(am.chunk_attention(rope(q, positions), rope(k, positions), v, kv))
                dense, keys = fwd.to_dense()[0], fwd.key_positions()[0]
                attended.append([sorted(keys[dense[row]].tolist()) for row in range(n)])
        outputs.append(outs)
    return outputs, attended, state


def run_upstream(sink: int, local: int, forwards, prompts: list[str], clean: bool, phi: float):
    buffer = LongLive2Buffer(sink_size=sink, local_attn_size=local, frame_seqlen=TOKENS_PER_FRAME, heads=HEADS, dim=DIM)
    rope = am.RotaryEmbedding(DIM)
    n = forwards[0][0][0].shape[1]
    offsets = rope_offsets(prompts, phi)
    rotated = []
    for c, chunk in enumerate(forwards):
        # current_start: positions run on; the shot's temporal offset in frames
        positions = torch.arange(c * n, (c + 1) * n).unsqueeze(0) + round(offsets[c] * TOKENS_PER_FRAME)
        rotated.append([(rope(q, positions), rope(k, positions), v) for q, k, v in chunk])
    return run_longlive2(buffer, rotated, prompts, clean), buffer.attended


@pytest.mark.parametrize("clean", [False, True], ids=["pin-only", "shot_clean_recache"])
@pytest.mark.parametrize("cuts", SCHEDULES)
@pytest.mark.parametrize(("sink", "local", "f"), CASES)
def test_every_forward_equals_upstreams_buffer(sink, local, f, cuts, clean) -> None:
    num_chunks = 14
    if cuts == "random":
        rng = random.Random(sink * 100 + local * 10 + f + clean)
        cuts = {c for c in range(1, num_chunks) if rng.random() < 0.3}
    policy = am.ShotSinkPolicy.from_frames(sink_size=sink, local_attn_size=local, frames_per_chunk=f)
    if clean:  # a cut inside the global sink: upstream attends the chunk twice (the next test)
        cuts = {c for c in cuts if c >= policy.sink_chunks}
    forwards = stream(num_chunks, f * TOKENS_PER_FRAME, seed=len(cuts) + sink)
    prompts, phi = prompts_with_cuts(num_chunks, cuts), 3.0
    shots = LongLive2Shots(prompts, sink_size=sink, shot_clean_recache=clean, multi_shot_rope_offset=phi)
    assert shots.policy(local_attn_size=local, frames_per_chunk=f) == policy
    want, want_keys = run_upstream(sink, local, forwards, prompts, clean, phi)
    got, got_keys, state = run_cache(shots, policy, forwards, phi)
    flat_want = [o for outs in want for o in outs]
    flat_got = [o for outs in got for o in outs]
    for i, (keys, upstream) in enumerate(zip(got_keys, want_keys)):
        chunk, step = divmod(i, DENOISE + 1)
        assert all(row == sorted(upstream) for row in keys), (
            f"chunk {chunk} forward {step}: cache attends {keys[0]}, upstream's buffer {sorted(upstream)}"
        )
        torch.testing.assert_close(flat_got[i], flat_want[i], rtol=1e-5, atol=1e-5, msg=f"chunk {chunk} forward {step}")
    assert state.token_offset("main") == num_chunks * f * TOKENS_PER_FRAME  # positions ran on
    bound = policy.max_history_chunks
    assert bound is not None and len(state.history_chunks("main")) <= bound


def test_a_clean_recache_cut_inside_the_global_sink_is_where_upstream_duplicates_keys() -> None:
    """sink_size = 2 chunks, a cut at chunk 1: ``_zero_kv_data`` sets ``local_end_index`` to the global sink's end,
    past the chunk's denoised K/V, and the clean forward writes the chunk again after it: upstream attends chunk 1
    twice (stale and clean). The cache keeps chunk 1 as a sink (a cut inside the sinks pins nothing) and attends
    each key once: the one place the two differ, on purpose."""
    sink, local, f, prompts = 4, 12, 2, prompts_with_cuts(6, {1})
    forwards = stream(6, f * TOKENS_PER_FRAME, seed=3)
    _, want_keys = run_upstream(sink, local, forwards, prompts, True, 0.0)
    policy = am.ShotSinkPolicy.from_frames(sink_size=sink, local_attn_size=local, frames_per_chunk=f)
    shots = LongLive2Shots(prompts, sink_size=sink, shot_clean_recache=True)
    _, got_keys, state = run_cache(shots, policy, forwards, 0.0)
    clean_forward_of_chunk_1 = DENOISE + 1 + DENOISE
    assert sorted(want_keys[clean_forward_of_chunk_1]) == [0, 1, 2, 3, 4, 4, 5, 5, 6, 6, 7, 7]
    assert got_keys[clean_forward_of_chunk_1][0] == list(range(8))
    assert state.history_chunk_indices("main")[:2] == (0, 1)


def test_a_cache_without_the_shot_sink_differs_from_upstream() -> None:
    """The same stream under plain sink + window (no pin): some forward after a cut attends other keys."""
    sink, local, f, prompts = 2, 8, 2, prompts_with_cuts(10, {2})
    forwards = stream(10, f * TOKENS_PER_FRAME, seed=1)
    _, want_keys = run_upstream(sink, local, forwards, prompts, False, 0.0)
    plain = am.ShotSinkPolicy(1, 2, 0)  # shot_chunks=0: begin_shot pins nothing
    shots = LongLive2Shots(prompts, sink_size=sink)
    _, got_keys, _ = run_cache(shots, plain, forwards, 0.0)
    assert any(keys[0] != sorted(up) for keys, up in zip(got_keys, want_keys))


def test_from_frames_names_what_does_not_fall_on_chunks() -> None:
    with pytest.raises(am.SpecError, match=r"ShotSinkPolicy.from_frames.sink_size: expected a multiple"):
        am.ShotSinkPolicy.from_frames(sink_size=3, local_attn_size=32, frames_per_chunk=8)
    with pytest.raises(am.SpecError, match="room for the shot sink"):
        am.ShotSinkPolicy.from_frames(sink_size=8, local_attn_size=16, frames_per_chunk=8)
    upstream = am.ShotSinkPolicy.from_frames(sink_size=8, local_attn_size=32, frames_per_chunk=8)
    assert upstream == am.ShotSinkPolicy(1, 2, 1)
    no_sink = am.ShotSinkPolicy.from_frames(sink_size=0, local_attn_size=24, frames_per_chunk=8)
    assert no_sink == am.ShotSinkPolicy(0, 2, 0)


def test_longlive2_shots_reads_prompts_as_upstream() -> None:
    prompts = [SCENE_CUT_PREFIX + "a", "b", SCENE_CUT_PREFIX + "c", None, SCENE_CUT_PREFIX + "e"]
    shots = LongLive2Shots(prompts, sink_size=8, multi_shot_rope_offset=8)
    assert [shots.is_shot_boundary(c) for c in range(6)] == [False, False, True, False, True, False]  # never chunk 0
    assert [shots.rope_offset(c) for c in range(5)] == [0.0, 0.0, 8.0, 8.0, 16.0]
    no_sink = LongLive2Shots(prompts, sink_size=0, multi_shot_rope_offset=8)
    assert not no_sink.is_scene_cut(2) and no_sink.rope_offset(4) == 16.0  # boundaries still move RoPE
    off = LongLive2Shots(prompts, sink_size=8, multi_shot_sink=False)
    assert not off.is_scene_cut(2) and off.policy(local_attn_size=32, frames_per_chunk=8).shot_chunks == 0
    for bad, match in [({"prompts": "one"}, "one prompt per chunk"), ({"sink_size": -1}, "sink_size"),
                       ({"shot_clean_recache": 1}, "shot_clean_recache"), ({"multi_shot_rope_offset": "8"}, "frames")]:
        with pytest.raises(am.SpecError, match=match):
            LongLive2Shots(**{"prompts": prompts, "sink_size": 8, **bad})
