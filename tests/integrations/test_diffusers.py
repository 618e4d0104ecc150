"""A stock diffusers ``WanTransformer3DModel`` streamed over the paged cache equals the cache-free model.

The streamed side uses only ``ardiff_modules.integrations.diffusers`` (processors + RoPE hook). The
reference side never touches the library: a deep copy of the same stock model, run on whole frame
sequences, with diffusers' own ``WanAttnProcessor`` given (a) an explicit boolean attention mask (the
visibility rule), (b) RoPE tables gathered from the model's own ``rope.freqs_cos/freqs_sin`` at explicit
absolute frame indices, (c) per-token timesteps (history chunks at their committing timestep).

Two references:

- ``visible context`` (the visibility rule of docs/design.md literally): sink chunks + window chunks + the current chunk
  concatenated along frames, block-causal mask, at their absolute (non-contiguous) frame indices. Exact
  for a 1-layer model only: a committed chunk's layer-0 K/V depend on its own latents and timestep only,
  but from layer 1 on they depend on what the chunk attended to when it was committed, which after an
  eviction includes chunks no longer visible.
- ``whole history`` (any depth): every chunk generated so far, each query chunk masked to exactly what it
  saw when it ran (sinks + the window of its time + itself; the current chunk: sinks + window + itself),
  each committed chunk's cross-attention restricted to the prompt in force when it was committed.
"""

from __future__ import annotations

import copy
import importlib
import time

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers import WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanAttnProcessor, WanRotaryPosEmbed
from torch._dynamo.testing import CompileCounter

import ardiff_modules as am
from ardiff_modules.integrations.diffusers import (
    PagedWanTransformer,
    enable_paged_attention,
    wan_cache_spec,
)
from tests.support.diffusers_wan import TEXT_DIM, tiny_wan

FRAMES = 2  # latent frames per chunk
LATENT = (4, 4)  # latent H, W -> 2 x 2 tokens per frame with patch (1, 2, 2)
TEXT_TOKENS = 7
SINK, WINDOW = 1, 2
BRANCHES = ("cond", "uncond")


@pytest.fixture(autouse=True)
def _one_thread():
    # Two OpenMP threads on a loaded 2-core runner make these tiny matmuls 50x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------------ rollout


def make_events(num_chunks: int, seed: int = 1, switch_at: int = 5) -> tuple[list[tuple], list[torch.Tensor]]:
    """("prompt", branch, embeds, prompt id) and ("forward", x [2,C,F,H,W], t [2], commit, chunk) events."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randn(TEXT_TOKENS, TEXT_DIM, generator=g) for _ in range(3)]
    events: list[tuple] = [("prompt", "cond", prompts[0], 0), ("prompt", "uncond", prompts[1], 1)]
    for chunk in range(num_chunks):
        if chunk == switch_at:  # prompt switch on the cond branch; history is kept
            events.append(("prompt", "cond", prompts[2], 2))
        for t in (900.0, 500.0):  # denoising forwards (different per stream: checks the stream order)
            x = torch.randn(2, 4, FRAMES, *LATENT, generator=g)
            events.append(("forward", x, torch.tensor([t, t - 100.0]), False, chunk))
        x_clean = torch.randn(2, 4, FRAMES, *LATENT, generator=g)  # committed latents differ per stream too
        events.append(("forward", x_clean, torch.zeros(2), True, chunk))
    return events, prompts


def stream(paged: PagedWanTransformer, cache: am.KVCache, events: list[tuple], step=None) -> list[torch.Tensor]:
    step = step or paged
    state = cache.open_session()
    outs = []
    with torch.no_grad():
        for event in events:
            if event[0] == "prompt":
                paged.set_prompt(state, event[1], event[2])
                continue
            _, x, t, commit, _ = event
            with state.prepare_forward(BRANCHES, paged.spec.chunk_size, commit_current=commit) as fwd:
                outs.append(step(x, t, fwd))
    assert state.committed_chunks("cond") == sum(1 for e in events if e[0] == "forward" and e[3])
    assert len(state.history_chunks("cond")) == min(SINK + WINDOW, state.committed_chunks("cond"))  # evicted
    return outs


# ------------------------------------------------------------------------------------------------ reference


class _RefSelf:
    """Reference attn1: stock WanAttnProcessor with an explicit mask and explicit-frame RoPE tables."""

    def __init__(self, ref: dict) -> None:
        self.ref, self.stock = ref, WanAttnProcessor()

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        assert encoder_hidden_states is None and attention_mask is None
        return self.stock(attn, hidden_states, None, self.ref["self_mask"], self.ref["rope"])


class _RefCross:
    """Reference attn2: stock WanAttnProcessor, each query token restricted to its chunk's prompt."""

    def __init__(self, ref: dict) -> None:
        self.ref, self.stock = ref, WanAttnProcessor()

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        return self.stock(attn, hidden_states, encoder_hidden_states, self.ref["cross_mask"], None)


def reference_model(model: WanTransformer3DModel) -> tuple[WanTransformer3DModel, dict]:
    ref_model = copy.deepcopy(model)
    rope = ref_model.rope  # diffusers' table, long enough for every absolute frame of the rollout
    ref_model.rope = WanRotaryPosEmbed(rope.attention_head_dim, rope.patch_size, max_seq_len=1024)
    ref: dict = {}
    for block in ref_model.blocks:
        block.attn1.set_processor(_RefSelf(ref))
        block.attn2.set_processor(_RefCross(ref))
    return ref_model, ref


def explicit_rope(model: WanTransformer3DModel, frames: torch.Tensor, h: int, w: int) -> tuple[torch.Tensor, ...]:
    """Gather the model's own RoPE table at absolute ``frames`` (one per latent frame) x rows x columns."""
    rope = model.rope
    split = [rope.t_dim, rope.h_dim, rope.w_dim]
    tables = []
    for table in (rope.freqs_cos, rope.freqs_sin):
        t_tab, h_tab, w_tab = table.split(split, dim=1)
        n = frames.numel()
        parts = (
            t_tab[frames].view(n, 1, 1, -1).expand(n, h, w, -1),
            h_tab[:h].view(1, h, 1, -1).expand(n, h, w, -1),
            w_tab[:w].view(1, 1, w, -1).expand(n, h, w, -1),
        )
        tables.append(torch.cat(parts, dim=-1).reshape(1, n * h * w, 1, -1))
    return tuple(tables)


def visible_before(chunk: int, sink: int, window: int) -> list[int]:
    """Committed chunks visible to a chunk that runs when ``chunk`` chunks are committed."""
    return [k for k in range(chunk) if k < sink or k >= max(sink, chunk - window)]


def run_reference(
    ref_model: WanTransformer3DModel,
    ref: dict,
    pieces: list[dict],
    prompts: torch.Tensor,
) -> torch.Tensor:
    """Run the stock model on ``pieces`` (chunks in order) and return the last piece's output.

    Each piece: ``x`` [2, C, F, H, W], ``t`` [2], ``chunk`` (absolute index), ``prompt`` [2] prompt ids,
    ``sees`` (indices of earlier pieces it attends to, besides itself). ``prompts`` [P, tokens, text_dim].
    """
    hp, wp = LATENT[0] // 2, LATENT[1] // 2
    per_chunk = FRAMES * hp * wp
    n = len(pieces)
    seq = n * per_chunk
    x = torch.cat([p["x"] for p in pieces], dim=2)
    timestep = torch.cat([p["t"][:, None].expand(2, per_chunk) for p in pieces], dim=1)
    frames = torch.cat([torch.arange(p["chunk"] * FRAMES, (p["chunk"] + 1) * FRAMES) for p in pieces])
    ref["rope"] = explicit_rope(ref_model, frames, hp, wp)
    chunk_mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(pieces):
        chunk_mask[i, i] = True
        for j in p["sees"]:
            chunk_mask[i, j] = True
    ref["self_mask"] = chunk_mask.repeat_interleave(per_chunk, 0).repeat_interleave(per_chunk, 1)[None, None]
    num_prompts, tokens, _ = prompts.shape
    cross = torch.zeros(2, seq, num_prompts * tokens, dtype=torch.bool)
    for i, p in enumerate(pieces):
        for b in range(2):
            pid = int(p["prompt"][b])
            cross[b, i * per_chunk : (i + 1) * per_chunk, pid * tokens : (pid + 1) * tokens] = True
    ref["cross_mask"] = cross[:, None]
    context = prompts.reshape(1, num_prompts * tokens, -1).expand(2, -1, -1)
    out = ref_model(x, timestep, context, return_dict=False)[0]
    return out[:, :, -FRAMES:]


def reference_outputs(model: WanTransformer3DModel, events: list[tuple], prompts: list[torch.Tensor], *,
                      whole_history: bool, relative_frames: bool = False) -> list[torch.Tensor]:
    """The cache-free stock model's output for every forward of ``events`` (see the module docstring)."""
    ref_model, ref = reference_model(model)
    stacked = torch.stack(prompts)
    current = {"cond": 0, "uncond": 0}
    committed: list[dict] = []  # committed[k]: chunk k, with what it saw when it was committed
    outs = []
    with torch.no_grad():
        for event in events:
            if event[0] == "prompt":
                current[event[1]] = event[3]
                continue
            _, x, t, commit, chunk = event
            visible = visible_before(chunk, SINK, WINDOW)
            piece = {"x": x, "t": t, "chunk": chunk, "prompt": torch.tensor([current["cond"], current["uncond"]])}
            if whole_history:  # piece k is chunk k: `sees` indexes chunks
                pieces = committed + [dict(piece, sees=visible)]
            else:  # sinks + window + current, block-causal
                pieces = [dict(committed[k], sees=list(range(i))) for i, k in enumerate(visible)]
                pieces.append(dict(piece, sees=list(range(len(visible)))))
            if relative_frames:  # what diffusers' own rope would do: frames counted from 0 in the input
                pieces = [dict(p, chunk=i) for i, p in enumerate(pieces)]
            outs.append(run_reference(ref_model, ref, pieces, stacked))
            if commit:
                committed.append(dict(piece, sees=visible))
    return outs


def streamed_setup(model: WanTransformer3DModel) -> tuple[PagedWanTransformer, am.KVCache]:
    spec = wan_cache_spec(
        model, frames_per_chunk=FRAMES, latent_height=LATENT[0], latent_width=LATENT[1], text_tokens=TEXT_TOKENS,
        sink_chunks=SINK, window_chunks=WINDOW, branches=BRANCHES, dtype="float32",
    )
    cache = am.KVCache(spec, num_pages=64)
    return enable_paged_attention(model, cache), cache


def assert_all_close(actual: list[torch.Tensor], expected: list[torch.Tensor], events: list[tuple]) -> None:
    forwards = [e for e in events if e[0] == "forward"]
    assert len(actual) == len(expected) == len(forwards)
    for i, (a, e, ev) in enumerate(zip(actual, expected, forwards)):
        torch.testing.assert_close(
            a, e, atol=1e-5, rtol=0, msg=lambda m, i=i, ev=ev: f"forward {i} (chunk {ev[4]}, commit={ev[3]}): {m}"
        )


# ------------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize(
    ("num_layers", "whole_history", "fused"),
    [(1, False, False), (2, True, False), (2, True, True)],
    ids=["1-layer-visible-context", "2-layer-whole-history", "2-layer-whole-history-fused-projections"],
)
def test_streamed_rollout_equals_cache_free_stock_model(num_layers: int, whole_history: bool, fused: bool) -> None:
    """10 chunks, sink 1 + window 2 (evicting from chunk 4 on), CFG branches, 2 denoising + 1 commit per chunk,
    a prompt switch at chunk 5: every forward's output equals the cache-free stock model (float32, 1e-5)."""
    start = time.perf_counter()
    # diffusers' own rope table covers 16 frames here: the rollout's 20 absolute frames go past it.
    model = tiny_wan(num_layers, rope_max_seq_len=16)
    if fused:  # diffusers' fused to_qkv / to_kv projections
        model.fuse_qkv_projections()
    events, prompts = make_events(10)
    expected = reference_outputs(model, events, prompts, whole_history=whole_history)
    paged, cache = streamed_setup(model)
    actual = stream(paged, cache, events)
    assert_all_close(actual, expected, events)
    if not whole_history:
        # The reference can tell: with frames counted from 0 in the visible context (diffusers' own rope),
        # the outputs after the first eviction differ.
        relative = reference_outputs(model, events, prompts, whole_history=False, relative_frames=True)
        assert (actual[-1] - relative[-1]).abs().max() > 1e-3
    assert time.perf_counter() - start < 30


@pytest.mark.slow
def test_compiled_step_is_one_frame_over_the_rollout_and_matches_eager() -> None:
    """``torch.compile(fullgraph=True)`` of the streamed step: one frame over 9 chunks (eviction, commits,
    denoising forwards, a prompt switch), equal to eager."""
    model = tiny_wan(2)
    events, _ = make_events(9, seed=3)
    paged, cache = streamed_setup(model)
    eager = stream(paged, cache, events)
    counter = CompileCounter()

    def step(x: torch.Tensor, t: torch.Tensor, fwd: am.ForwardContext) -> torch.Tensor:
        return paged(x, t, fwd)

    compiled = torch.compile(step, backend=counter, fullgraph=True)
    actual = stream(paged, cache, events, step=compiled)
    assert counter.frame_count == 1, f"expected one compiled frame, got {counter.frame_count}"
    for a, e in zip(actual, eager):
        torch.testing.assert_close(a, e, atol=1e-6, rtol=0)


def test_first_chunk_equals_plain_stock_forward_and_remove_restores_it() -> None:
    model = tiny_wan(2)
    paged, cache = streamed_setup(model)
    state = cache.open_session()
    g = torch.Generator().manual_seed(5)
    prompts = torch.randn(2, TEXT_TOKENS, TEXT_DIM, generator=g)
    x = torch.randn(2, 4, FRAMES, *LATENT, generator=g)
    t = torch.tensor([700.0, 700.0])
    for branch, p in zip(BRANCHES, prompts):
        paged.set_prompt(state, branch, p[None])  # diffusers' [1, tokens, text_dim] works too
    with torch.no_grad():
        stock = model(x, t, prompts, return_dict=False)[0]  # no forward active: diffusers' processors
        with state.prepare_forward(BRANCHES, paged.spec.chunk_size, commit_current=False) as fwd:
            out = paged(x, torch.tensor(700.0), fwd)  # a 0-d timestep is shared by the streams
        torch.testing.assert_close(out, stock, atol=1e-5, rtol=0)
        # Callers of the model itself: activate() a forward around it (its encoder_hidden_states are unused).
        with state.prepare_forward(BRANCHES, paged.spec.chunk_size, commit_current=True) as fwd, paged.activate(fwd):
            again = model(x, t, torch.zeros(2, 1, TEXT_DIM), return_dict=False)[0]
        torch.testing.assert_close(again, stock, atol=1e-5, rtol=0)  # chunk 0 again: the same visible keys
        assert state.committed_chunks("cond") == 1
        paged.remove()
        assert all(type(b.attn1.processor) is WanAttnProcessor for b in model.blocks)
        torch.testing.assert_close(model(x, t, prompts, return_dict=False)[0], stock, atol=0, rtol=0)


def test_remove_in_the_middle_of_a_committing_forward_commits_nothing() -> None:
    """Issue 24: ``remove()`` from inside the model (a hook on block 0) leaves block 1 on diffusers' own
    processor, which never writes the cache: the commit is refused and aborted, history unchanged."""
    model = tiny_wan(2)
    paged, cache = streamed_setup(model)
    state = cache.open_session()
    g = torch.Generator().manual_seed(6)
    for branch, p in zip(BRANCHES, torch.randn(2, TEXT_TOKENS, TEXT_DIM, generator=g)):
        paged.set_prompt(state, branch, p[None])
    x = torch.randn(2, 4, FRAMES, *LATENT, generator=g)
    hook = model.blocks[0].register_forward_hook(lambda *_: paged.remove())
    with torch.no_grad(), pytest.raises(am.errors.IncompleteForwardError, match=r"layer\(s\) 1\b"):
        with state.prepare_forward(BRANCHES, paged.spec.chunk_size, commit_current=True) as fwd:
            paged(x, torch.tensor(700.0), fwd)
    hook.remove()
    assert state.committed_chunks("cond") == state.committed_chunks("uncond") == 0
    assert cache._allocator.num_used == 0 and state._open_forward("cond") is None


def test_sessions_at_different_offsets_batch_in_one_forward() -> None:
    """Two sessions whose histories differ in length (so their streams' absolute positions differ inside one
    forward) batched in one launch give each session's own single-stream outputs."""
    model = tiny_wan(2)
    paged, cache = streamed_setup(model)
    g = torch.Generator().manual_seed(7)
    prompts = torch.randn(2, TEXT_TOKENS, TEXT_DIM, generator=g)
    xs = [torch.randn(2, 4, FRAMES, *LATENT, generator=g) for _ in range(8)]
    t = torch.tensor([400.0, 400.0])

    def run(batched: bool) -> list[torch.Tensor]:
        a, b = cache.open_session(), cache.open_session()
        for state, prompt in ((a, prompts[0]), (b, prompts[1])):
            paged.set_prompt(state, "cond", prompt)
        outs = []
        with torch.no_grad():
            for i, x in enumerate(xs):
                # a alone for 3 chunks, b alone for 2, then both: 1 chunk apart inside each batched forward
                streams = [(a, "cond")] * (i < 3 or i >= 5) + [(b, "cond")] * (i >= 3)
                if batched:
                    with cache.prepare_forward(streams, paged.spec.chunk_size, commit_current=True) as fwd:
                        outs.append(paged(x[: len(streams)], t[: len(streams)], fwd))
                    continue
                parts = []
                for j, stream_ in enumerate(streams):
                    with cache.prepare_forward([stream_], paged.spec.chunk_size, commit_current=True) as fwd:
                        parts.append(paged(x[j : j + 1], t[:1], fwd))
                outs.append(torch.cat(parts))
        for state in (a, b):
            state.close()
        return outs

    for got, want in zip(run(batched=True), run(batched=False)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_image_to_video_model_reads_the_image_cache() -> None:
    """Wan I2V (added K/V projections): the image context is cached per branch too; the first chunk equals the
    stock model (whose processor hard-codes 512 text tokens)."""
    model = tiny_wan(1, image_dim=8, added_kv_proj_dim=32)
    spec = wan_cache_spec(
        model, frames_per_chunk=FRAMES, latent_height=LATENT[0], latent_width=LATENT[1], text_tokens=512,
        image_tokens=3, sink_chunks=1, window_chunks=1, branches=BRANCHES, dtype="float32",
    )
    cache = am.KVCache(spec, num_pages=16)
    paged = enable_paged_attention(model, cache)
    state = cache.open_session()
    g = torch.Generator().manual_seed(6)
    text = torch.randn(2, 512, TEXT_DIM, generator=g)
    image = torch.randn(2, 3, 8, generator=g)
    x = torch.randn(2, 4, FRAMES, *LATENT, generator=g)
    t = torch.tensor([300.0, 300.0])
    with pytest.raises(am.SpecError, match="encoder_hidden_states_image"):
        paged.set_prompt(state, "cond", text[0])
    for b, branch in enumerate(BRANCHES):
        paged.set_prompt(state, branch, text[b], image[b])
    with torch.no_grad():
        with state.prepare_forward(BRANCHES, spec.chunk_size, commit_current=True) as fwd:
            out = paged(x, t, fwd)
        paged.remove()
        stock = model(x, t, text, encoder_hidden_states_image=image, return_dict=False)[0]
    torch.testing.assert_close(out, stock, atol=1e-5, rtol=0)


def test_errors() -> None:
    model = tiny_wan(2)
    paged, cache = streamed_setup(model)
    state = cache.open_session()
    x = torch.randn(2, 4, FRAMES, *LATENT)

    def forward(commit: bool = False) -> am.ForwardContext:
        return state.prepare_forward(BRANCHES, paged.spec.chunk_size, commit_current=commit)

    with torch.no_grad():
        # No prompt for the branches: the first attn2 read raises; the forward is aborted.
        with pytest.raises(am.errors.CrossAttentionNotPopulatedError), forward(True) as fwd:
            paged(x, torch.zeros(2), fwd)
        assert state.committed_chunks("cond") == 0
        for branch in BRANCHES:
            paged.set_prompt(state, branch, torch.randn(TEXT_TOKENS, TEXT_DIM))
        with pytest.raises(am.TensorMismatchError, match="tokens"), forward() as fwd:  # 2 chunks of latents
            paged(torch.randn(2, 4, 2 * FRAMES, *LATENT), torch.zeros(2), fwd)
        with pytest.raises(am.TensorMismatchError, match="timestep"), forward() as fwd:
            paged(x, torch.zeros(3), fwd)
        # Latents the model cannot take: refused by name before the model runs (the patch embedding's conv
        # raised a bare RuntimeError); the pool and the history are as before, the forward still usable.
        with forward(True) as fwd:
            kv = cache._pool.kv.clone()
            for bad, fragments in (
                (torch.randn(2, 3, FRAMES, *LATENT), ["expected [streams, C=4 (the model's", "got (2, 3, 2, 4, 4)"]),
                (x.double(), ["expected dtype torch.float32 (the model's", "got torch.float64"]),
            ):
                with pytest.raises(am.TensorMismatchError) as info:
                    paged(bad, torch.zeros(2), fwd)
                assert all(f in str(info.value) for f in fragments), str(info.value)
                assert torch.equal(cache._pool.kv, kv) and state.committed_chunks("cond") == 0
            paged(x, torch.zeros(2), fwd)
        assert state.committed_chunks("cond") == 1
    with pytest.raises(am.TensorMismatchError, match="encoder_hidden_states"):
        paged.set_prompt(state, "cond", torch.randn(TEXT_TOKENS, TEXT_DIM + 1))
    with pytest.raises(am.TensorMismatchError):  # the spec's 7 text tokens
        paged.set_prompt(state, "cond", torch.randn(TEXT_TOKENS + 1, TEXT_DIM))
    with pytest.raises(am.SpecError, match="already enabled"):
        enable_paged_attention(model, cache)
    with pytest.raises(am.SpecError, match="num_layers"):
        enable_paged_attention(tiny_wan(3), cache)
    with pytest.raises(am.SpecError, match="rope_theta"):
        enable_paged_attention(tiny_wan(2), cache, rope_theta=500.0)
    with pytest.raises(am.SpecError, match="WanTransformer3DModel"):
        enable_paged_attention(torch.nn.Linear(2, 2), cache)
    paged.remove()
    with pytest.raises(am.SpecError, match="remove"), forward() as fwd:
        paged(x, torch.zeros(2), fwd)


def test_missing_diffusers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    integration = importlib.import_module("ardiff_modules.integrations.diffusers")
    monkeypatch.setitem(__import__("sys").modules, "diffusers.models.transformers.transformer_wan", None)
    with pytest.raises(ImportError, match=r"pip install 'ardiff_modules\[diffusers\]'"):
        integration.wan_cache_spec(object(), frames_per_chunk=1, latent_height=2, latent_width=2)


def test_gradient_to_the_current_chunk_equals_the_stock_model() -> None:
    """Training through the processors (issue 27): a denoising forward with gradients after the window slid.
    The gradient of its output w.r.t. its own latents equals the cache-free stock model's over the whole history
    (the history's K/V do not depend on the current latents: block-causal, so the comparison is exact at any
    depth)."""
    model = tiny_wan(2, rope_max_seq_len=16)
    events, prompts = make_events(7)
    grad_at = max(i for i, e in enumerate(events) if e[0] == "forward" and not e[3])  # last chunk's last denoising
    g = torch.Generator().manual_seed(5)
    x = events[grad_at][1].clone().requires_grad_()
    t = events[grad_at][2]
    paged, cache = streamed_setup(model)
    state = cache.open_session()
    with torch.no_grad():
        for event in events[:grad_at]:
            if event[0] == "prompt":
                paged.set_prompt(state, event[1], event[2])
                continue
            with state.prepare_forward(BRANCHES, paged.spec.chunk_size, commit_current=event[3]) as fwd:
                paged(event[1], event[2], fwd)
    with state.prepare_forward(BRANCHES, paged.spec.chunk_size, commit_current=False) as fwd:
        out = paged(x, t, fwd)
    weight = torch.randn(out.shape, generator=g)
    (out * weight).sum().backward()
    # reference: the whole history without gradients, this piece with
    ref_model, ref = reference_model(model)
    current, committed = {"cond": 0, "uncond": 0}, []
    for event in events[:grad_at]:
        if event[0] == "prompt":
            current[event[1]] = event[3]
        elif event[3]:
            committed.append({"x": event[1], "t": event[2], "chunk": event[4], "sees": visible_before(event[4], SINK, WINDOW),
                              "prompt": torch.tensor([current["cond"], current["uncond"]])})
    chunk = events[grad_at][4]
    x_ref = events[grad_at][1].clone().requires_grad_()
    piece = {"x": x_ref, "t": t, "chunk": chunk, "sees": visible_before(chunk, SINK, WINDOW),
             "prompt": torch.tensor([current["cond"], current["uncond"]])}
    expected = run_reference(ref_model, ref, committed + [piece], torch.stack(prompts))
    (expected * weight).sum().backward()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-5, rtol=1e-4)
    assert x.grad.abs().sum() > 0


def test_retention_groups_through_the_diffusers_processor_equal_the_uniform_stream() -> None:
    """The same rollout over ``KVCacheSpec(head_retention=...)``: two groups with the uniform cache's sink and
    window, heads interleaved per layer (each layer's heads split over two lanes, gathered back in head order
    by the processor's ``chunk_attention``): every forward equals the cache-free stock model, as uniform does."""
    import dataclasses

    model = tiny_wan(2, rope_max_seq_len=16)
    events, prompts = make_events(8)
    expected = reference_outputs(model, events, prompts, whole_history=True)  # (2 layers: see the rollout test)
    spec = wan_cache_spec(
        model, frames_per_chunk=FRAMES, latent_height=LATENT[0], latent_width=LATENT[1], text_tokens=TEXT_TOKENS,
        sink_chunks=SINK, window_chunks=WINDOW, branches=BRANCHES, dtype="float32",
    )
    rows = [[("a", "b")[(h + layer) % 2] for h in range(spec.num_kv_heads)] for layer in range(spec.num_layers)]
    heads = am.HeadRetention({"a": (SINK, WINDOW), "b": (SINK, WINDOW)}, rows)
    grouped = dataclasses.replace(spec, sink_chunks=0, window_chunks=None, head_retention=heads)
    cache = am.KVCache(grouped, num_pages=64)
    assert len(cache._lanes) >= 2
    actual = stream(enable_paged_attention(model, cache), cache, events)
    assert_all_close(actual, expected, events)
