"""``PagedWanTransformer`` with retention groups and relative sinks (issue 41): each layer's sink query is rotated
at that layer's ``kv.sink_positions`` -- per query head where its lanes' sinks move by different shifts.

Two references from the library's uniform relative-sink path (checked here against the cache-free stock model
with the sink chunk re-roped right before the window): two groups of the *same* policy are the uniform stream (any depth); with different policies, a 1-layer
model's attention output of each head (the input of ``attn1.to_out``) is the uniform stream of that head's policy
(layer-0 K/V depend on the latents only, so a head's output depends on its own policy alone).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("diffusers")

import ardiff_modules as am
from ardiff_modules.integrations.diffusers import enable_paged_attention, wan_cache_spec
from tests.integrations.test_diffusers import (
    BRANCHES, FRAMES, LATENT, SINK, TEXT_TOKENS, WINDOW, make_events, reference_model, run_reference, visible_before,
)
from tests.support.diffusers_wan import tiny_wan

#: short / long windows (their shifts differ once the windows slide) and a group without sinks
POLICIES = {"short": (1, 1), "long": (1, 3), "local": (0, 2)}


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _spec(model, **kwargs) -> am.KVCacheSpec:  # noqa: ANN001
    return wan_cache_spec(model, frames_per_chunk=FRAMES, latent_height=LATENT[0], latent_width=LATENT[1],
                          text_tokens=TEXT_TOKENS, branches=BRANCHES, dtype="float32", **kwargs)


def _stream(model, spec: am.KVCacheSpec, events: list[tuple]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # noqa: ANN001
    """Every forward's output, and block 0's attention output per head ``[streams, seq, heads, head_dim]``."""
    cache = am.KVCache(spec, num_pages=128)
    paged = enable_paged_attention(model, cache)
    attn = model.blocks[0].attn1
    heads: list[torch.Tensor] = []
    hook = attn.to_out[0].register_forward_pre_hook(lambda m, args: heads.append(args[0].unflatten(-1, (attn.heads, -1))))
    state = cache.open_session()
    outs = []
    try:
        with torch.no_grad():
            for event in events:
                if event[0] == "prompt":
                    paged.set_prompt(state, event[1], event[2])
                    continue
                _, x, t, commit, _ = event
                with state.prepare_forward(BRANCHES, spec.chunk_size, commit_current=commit) as fwd:
                    assert fwd.relative_sinks == spec.relative_sinks
                    outs.append(paged(x, t, fwd))
    finally:
        hook.remove()
        paged.remove()
    return outs, heads


def test_two_groups_of_one_policy_equal_the_uniform_relative_sink_stream() -> None:
    """2 layers, heads interleaved over two groups of the uniform policy (every layer's heads over two lanes: per-head
    sink positions, tables ``[streams, seq, heads, dim]``): every forward equals the uniform relative-sink stream,
    while the windows slide (sink shift > 0 from chunk 4)."""
    model = tiny_wan(2, rope_max_seq_len=16)
    events, _ = make_events(8)
    spec = _spec(model, sink_chunks=SINK, window_chunks=WINDOW, relative_sinks=True)
    rows = [[("a", "b")[(h + layer) % 2] for h in range(spec.num_kv_heads)] for layer in range(spec.num_layers)]
    groups = am.HeadRetention({"a": (SINK, WINDOW), "b": (SINK, WINDOW)}, rows)
    grouped = dataclasses.replace(spec, sink_chunks=0, window_chunks=None, head_retention=groups)
    expected, _ = _stream(model, spec, events)
    actual, _ = _stream(model, grouped, events)
    assert len(actual) == len(expected) == 24
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-6, msg=lambda m, i=i: f"forward {i}: {m}")


def test_each_head_equals_the_uniform_stream_of_its_groups_policy() -> None:
    """1 layer of 3 heads in 3 groups (short and long windows, one without sinks: per-head sink positions, the
    short and long shifts differ from chunk 3): each head's attention output, every forward, equals that head's
    output in the uniform relative-sink stream of its group's policy."""
    model = tiny_wan(1, rope_max_seq_len=16, num_attention_heads=3)
    events, _ = make_events(8)
    spec = _spec(model, sink_chunks=SINK, window_chunks=WINDOW)
    names = list(POLICIES)
    groups = am.HeadRetention(POLICIES, [names])
    _, actual = _stream(model, dataclasses.replace(spec, sink_chunks=0, window_chunks=None, relative_sinks=True,
                                                   head_retention=groups), events)
    for h, name in enumerate(names):
        sink, window = POLICIES[name]
        uniform = dataclasses.replace(spec, sink_chunks=sink, window_chunks=window, relative_sinks=sink > 0)
        _, expected = _stream(model, uniform, events)  # sink 0: the natural stream (nothing to move)
        assert len(actual) == len(expected) == 24
        for i, (a, e) in enumerate(zip(actual, expected)):
            torch.testing.assert_close(a[:, :, h], e[:, :, h], atol=1e-5, rtol=1e-5,
                                       msg=lambda m, i=i, name=name: f"head {h} ({name}) forward {i}: {m}")



def test_uniform_relative_sinks_equal_the_stock_model_with_the_sink_reroped_before_the_window() -> None:
    """The anchor of the references above: 1 layer, sink 1 + window 2, the uniform relative-sink stream equals the
    cache-free stock model over the visible chunks with the sink chunk's frames moved right before the oldest
    window chunk (relative RoPE), queries and window keys at their absolute frames."""
    model = tiny_wan(1, rope_max_seq_len=16)
    events, prompts = make_events(8)
    actual, _ = _stream(model, _spec(model, sink_chunks=SINK, window_chunks=WINDOW, relative_sinks=True), events)
    ref_model, ref = reference_model(model)
    current, committed, expected = {"cond": 0, "uncond": 0}, [], []
    with torch.no_grad():
        for event in events:
            if event[0] == "prompt":
                current[event[1]] = event[3]
                continue
            _, x, t, commit, chunk = event
            visible = visible_before(chunk, SINK, WINDOW)
            piece = {"x": x, "t": t, "chunk": chunk, "prompt": torch.tensor([current["cond"], current["uncond"]])}
            pieces = [dict(committed[k], sees=list(range(i))) for i, k in enumerate(visible)]
            if pieces:  # the sink chunk sits right before the oldest window chunk (or the current one)
                pieces[0] = dict(pieces[0], chunk=(visible[1] if len(visible) > 1 else chunk) - 1)
            expected.append(run_reference(ref_model, ref, [*pieces, dict(piece, sees=list(range(len(visible))))],
                                          torch.stack(prompts)))
            if commit:
                committed.append(piece)
    assert len(actual) == len(expected) == 24
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=0, msg=lambda m, i=i: f"forward {i}: {m}")
