"""LongLive's prompt-switch re-cache, as LongLive runs it (issue 26, item 1).

``RecacheRule.longlive(global_sink=...)`` against ``tests/support/longlive_cache.py``, a re-statement of
LongLive 1.x's rolling buffers and ``_recache_after_switch`` from its published semantics: the same tiny
model's weights, the same latents, prompt switches before the buffer filled, exactly when it filled (the
chunk the next forward evicts is still in LongLive's buffer) and after it slid. Every forward's output is
compared -- the denoising and committing forwards of every chunk, the re-cache forward's rows, and the
chunks after each switch (which read what the re-cache wrote).
"""

from __future__ import annotations

import pytest
import torch

import ardiff_modules as am
from ardiff_modules import KVCache, KVCacheSpec, RecacheRule, SinkWindowPolicy, SpecError, populate_cross_attention
from ardiff_modules.spec import CrossAttentionSpec
from tests.support.longlive_cache import LongLiveCache
from tests.support.streaming_model import TEXT, TinyStreamingModel

BRANCHES = ("cond", "uncond")
FRAME = 2  # tokens per latent frame (one page)
TOL = {"atol": 3e-5, "rtol": 3e-5}


class Pair:
    """One session through the library and a LongLive cache in lock step, CFG's two branches as its batch."""

    def __init__(
        self, *, frames_per_chunk: int, sink_size: int, local_attn_size: int | None, global_sink: bool,
        i2v: bool = False, extents: bool = False, rule: RecacheRule | None = None, seed: int = 0,
    ) -> None:
        torch.manual_seed(seed)
        self.model = TinyStreamingModel().eval()
        self.i2v, self.frames_per_chunk, self.global_sink = i2v, frames_per_chunk, global_sink
        policy = SinkWindowPolicy.from_frames(
            sink_size=sink_size, local_attn_size=local_attn_size, frames_per_chunk=frames_per_chunk,
            independent_first_frame=i2v,
        )
        self.rule = rule if rule is not None else RecacheRule.longlive(global_sink=global_sink)
        m = self.model
        spec = KVCacheSpec(
            num_layers=len(m.blocks), num_kv_heads=m.kv_heads, head_dim=m.dim // m.heads,
            chunk_size=frames_per_chunk * FRAME, page_size=FRAME, sink_chunks=policy.sink_chunks,
            window_chunks=policy.window_chunks, branches=BRANCHES, cross_attention=(CrossAttentionSpec(TEXT, 5),),
            dtype="float32", recache=self.rule,
        )
        self.cache = KVCache(spec, num_pages=600, backend="reference", contiguous_extents=extents)
        self.state = self.cache.open_session("s0")
        self.longlive = LongLiveCache(
            m, frame_tokens=FRAME, sink_frames=sink_size, local_frames=local_attn_size, batch=len(BRANCHES)
        )
        self.g = torch.Generator().manual_seed(seed + 1)
        self.clean: list[torch.Tensor] = []  # [2, chunk tokens, dim] per committed chunk (LongLive's `output`)
        self.prompt()

    def prompt(self) -> None:
        text = torch.randn(len(BRANCHES), 5, self.model.context_dim, generator=self.g)
        self.state.clear_cross_attention()
        for i, b in enumerate(BRANCHES):
            populate_cross_attention(self.state, b, [blk.cross for blk in self.model.blocks], text[i])
        self.longlive.set_prompt(text)

    @property
    def tokens(self) -> int:
        return sum(x.shape[1] for x in self.clean)

    @torch.no_grad()
    def chunk(self, denoise: int = 2) -> None:
        first = self.i2v and not self.clean
        length = FRAME * (1 if first else self.frames_per_chunk)
        for d in range(denoise + 1):
            commit = d == denoise
            x = torch.randn(len(BRANCHES), length, self.model.dim, generator=self.g)
            kept = {"keep_latents": x} if commit else {}
            with self.state.prepare_forward(BRANCHES, length, commit, chunk_lengths=[length], **kept) as fwd:
                out = self.model(x, fwd.layers)
            torch.testing.assert_close(out, self.longlive.forward(x, self.tokens), **TOL)
        self.clean.append(x)

    @torch.no_grad()
    def switch(self) -> tuple[int, ...]:
        """A prompt switch and the re-cache on both sides; returns the rebuilt commit indices."""
        self.prompt()
        rebuilt = self.state.recache_chunk_indices("cond")
        x = self.state.recache_latents()
        assert torch.equal(x, torch.cat([self.clean[i] for i in rebuilt], dim=1))
        with self.state.prepare_recache() as fwd:
            out = self.model(x, fwd.layers)
        expected, start_frame = self.longlive.recache(torch.cat(self.clean, dim=1), self.tokens // FRAME, self.global_sink)
        starts = [sum(c.shape[1] for c in self.clean[:i]) for i in range(len(self.clean) + 1)]
        offset = 0
        for i in rebuilt:  # each rebuilt chunk's rows against LongLive's rows of the same frames
            n = self.clean[i].shape[1]
            at = starts[i] - start_frame * FRAME
            assert at >= 0, (i, start_frame)
            torch.testing.assert_close(out[:, offset : offset + n], expected[:, at : at + n], **TOL)
            offset += n
        self.cache._allocator.check_invariants()
        return rebuilt


CASES = {
    # name: (frames per chunk, sink_size, local_attn_size, i2v) -> sink / window chunks from from_frames
    "F2_sink1_window2": (2, 2, 8, False),
    "F1_sink1_window2": (1, 1, 4, False),
    "F3_nosink_window2": (3, 0, 9, False),
    "F2_sink1_window3": (2, 2, 10, False),
    # NOTE: no sink of 2+ chunks: until its sink region is written, LongLive's attention reads the unwritten
    # (zero) rest of it as keys (the first chunk's queries see zero keys), which no paged cache reproduces.
    "i2v_F2_window2": (2, 1, 7, True),
}


@pytest.mark.parametrize("extents", [False, True])
@pytest.mark.parametrize(
    "case,global_sink",
    # a moving 1-frame sink is refused instead (test_moving_sink_of_another_length_is_refused)
    [(c, g) for c in CASES for g in (True, False) if g or not CASES[c][3]],
)
def test_longlive_recache_matches_longlive(case: str, global_sink: bool, extents: bool) -> None:
    """Switches before the buffer filled, when it just filled, after it slid, and twice in a row."""
    frames, sink_size, local, i2v = CASES[case]
    pair = Pair(frames_per_chunk=frames, sink_size=sink_size, local_attn_size=local, global_sink=global_sink,
                i2v=i2v, extents=extents)
    policy = pair.cache.spec.policy
    buffer_chunks = policy.sink_chunks + policy.window_chunks + 1  # LongLive's local_attn_size, in chunks
    seen = []
    for n in range(1, buffer_chunks + 5):
        pair.chunk()
        if n in (2, buffer_chunks, buffer_chunks + 2, buffer_chunks + 3):
            seen.append(pair.switch())
    for _ in range(3):  # the history the re-cache wrote drives the next chunks, the window keeps sliding
        pair.chunk()
    assert len(seen[1]) == buffer_chunks and seen[1][0] == 0  # just filled: sinks and the evicted chunk rebuilt
    # Slid: the sinks kept (global sink) or the chunks before the context moved into the sink slots.
    assert len(seen[2]) == buffer_chunks - (policy.sink_chunks if global_sink else 0)
    assert seen[2][0] > 0 or not policy.sink_chunks
    pair.cache.close()
    assert pair.cache._allocator.num_free == pair.cache._allocator.num_pages


def test_global_attention_rebuilds_everything_bidirectionally() -> None:
    """``local_attn_size=-1``: nothing is ever evicted; the re-cache rebuilds every chunk, all seeing all."""
    pair = Pair(frames_per_chunk=2, sink_size=0, local_attn_size=None, global_sink=True)
    for n in range(1, 7):
        pair.chunk()
        if n in (3, 5):
            assert pair.switch() == tuple(range(n))
    pair.chunk()


def test_the_library_rule_is_not_longlive() -> None:
    """The default rule (block-causal, resident chunks only) differs from LongLive after a switch -- the
    README must not call it LongLive's -- while the LongLive preset matches (the test above)."""
    pair = Pair(frames_per_chunk=2, sink_size=2, local_attn_size=8, global_sink=True, rule=RecacheRule())
    for _ in range(6):
        pair.chunk()
    with pytest.raises(AssertionError):
        pair.switch()


def test_moving_sink_of_another_length_is_refused() -> None:
    """LongLive's moving sink takes its buffer's first ``sink_size`` frames; with a 1-frame first chunk those are
    not a whole chunk, so the library refuses (``SpecError``, nothing changed) instead of moving a longer one."""
    pair = Pair(frames_per_chunk=2, sink_size=1, local_attn_size=7, global_sink=False, i2v=True)
    for _ in range(6):
        pair.chunk()
    before = (pair.state.branch_pages("cond").history, pair.cache._allocator.free_pages())
    with pytest.raises(SpecError, match="sink slot 0.*2 tokens, got chunk .* of 4"):
        pair.state.prepare_recache()
    assert (pair.state.branch_pages("cond").history, pair.cache._allocator.free_pages()) == before


def test_rule_needing_unremembered_chunks_is_refused() -> None:
    """A cache built for the default rule does not remember evicted chunks: a LongLive re-cache names the fix."""
    torch.manual_seed(0)
    model = TinyStreamingModel().eval()
    cache = KVCache(model.spec(4, 2, 1, 2), num_pages=200, backend="reference")
    state = cache.open_session()
    with pytest.raises(SpecError, match=r"KVCacheSpec\(recache=<this rule>\)"):
        state.prepare_recache(rule=RecacheRule.longlive())
    with pytest.raises(SpecError, match="keep_sinks= or rule=, got both"):
        state.prepare_recache(keep_sinks=True, rule=RecacheRule())
    with pytest.raises(SpecError, match="RecacheRule.sinks: expected one of"):
        RecacheRule(sinks="drop")  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="KVCacheSpec.recache: expected a RecacheRule"):
        KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, chunk_size=4, page_size=2, recache="longlive")  # type: ignore[arg-type]
    assert am.RecacheRule.longlive(global_sink=False) == RecacheRule("bidirectional", "move", 1)
