"""Kept latents of a re-cache (``keep_latents`` / ``recache_latents``, issue 16 item 2): they follow the window
and drive the re-cache, misuse raises and changes nothing, and they stay readable while a denoising forward is
open."""

from __future__ import annotations

import pytest
import torch

from ardiff_modules.errors import LatentsNotKeptError, PendingContextError, SpecError, TensorMismatchError
from tests.support.recache_rig import BRANCHES, CHUNK, Rig, TOL, assert_recache_unchanged, recache_snapshot


def test_kept_latents_follow_the_window_and_drive_the_recache() -> None:
    """``keep_latents`` on committing forwards: the library keeps a copy per resident chunk (pruned with
    eviction), and ``recache_latents`` hands back exactly the rebuilt chunks' latents."""
    rig = Rig(sink=1, window=2, page=2)
    state = rig.streams[0].state
    for length in (2, 4, 4, 4, 4):
        rig.step(length, keep=True)
    for b in BRANCHES:
        h = state.branch_pages(b)
        assert set(h.latents) == set(h.history_index) == {0, 3, 4}  # evicted chunks' latents are gone
    for keep_sinks in (True, False):
        torch.testing.assert_close(state.recache_latents(keep_sinks=keep_sinks), rig.recache_input(keep_sinks),
                                   rtol=0, atol=0)
    # Copies: a caller reusing its latent buffer in place does not change what was kept.
    x = torch.zeros(2, CHUNK, rig.model.dim)
    with torch.no_grad(), state.prepare_forward(BRANCHES, CHUNK, True, keep_latents=x) as fwd:
        rig.model(x, fwd.layers)
    x.fill_(7.0)
    assert state.branch_pages("cond").latents[5].abs().sum() == 0  # type: ignore[union-attr]
    rig.streams[0].naive.forward(BRANCHES, torch.zeros(2, CHUNK, rig.model.dim), True)
    for i, b in enumerate(BRANCHES):
        rig.streams[0].latents[b].append(torch.zeros(CHUNK, rig.model.dim))
    # The re-cache over the kept latents equals the oracle; a fork shares the kept latents.
    rig.prompt()
    child = state.fork("child")
    assert child.branch_pages("cond").latents == state.branch_pages("cond").latents
    x = state.recache_latents(keep_sinks=True)
    with torch.no_grad(), state.prepare_recache(keep_sinks=True) as fwd:
        out = rig.model(x, fwd.layers)
    s = rig.streams[0]
    expected = s.naive.recache(BRANCHES, {b: [s.latents[b][i] for i in rig.rebuilt(s, b, True)] for b in BRANCHES})
    torch.testing.assert_close(out, expected, **TOL)
    assert set(state.branch_pages("cond").latents) == {0, 4, 5}  # a re-cache keeps them: the same chunks
    rig.step(keep=True)


def test_kept_latents_misuse() -> None:
    rig = Rig(sink=1, window=2, page=2)
    state = rig.streams[0].state
    rig.step()
    rig.step(keep=True)
    before = recache_snapshot(rig.cache)
    with pytest.raises(LatentsNotKeptError, match=r"chunks \[0, 1\] of 's0'/'cond', got none for chunk\(s\) \[0\]"):
        state.recache_latents(keep_sinks=False)
    assert state.recache_latents(keep_sinks=True).shape == (2, CHUNK, rig.model.dim)
    x = torch.zeros(2, CHUNK, rig.model.dim)
    with pytest.raises(SpecError, match="expected a committing forward.*got commit_current=False"):
        state.prepare_forward(BRANCHES, CHUNK, False, keep_latents=x)
    with pytest.raises(TensorMismatchError, match=r"expected shape \[num_streams=2, seq_len=4, ...\], got \(1, 4, 32\)"):
        state.prepare_forward(BRANCHES, CHUNK, True, keep_latents=x[:1])
    with pytest.raises(TensorMismatchError, match="expected a tensor"):
        state.prepare_forward(BRANCHES, CHUNK, True, keep_latents=[1])  # type: ignore[arg-type]
    assert_recache_unchanged(rig.cache, before)
    # An aborted forward keeps nothing.
    state.prepare_forward(BRANCHES, CHUNK, True, keep_latents=x).abort()
    assert set(state.branch_pages("cond").latents) == {1}
    state.reset()
    assert state.branch_pages("cond").latents == {}


def test_recache_latents_readable_while_a_denoising_forward_is_open() -> None:
    """``recache_latents`` only reads what was kept: an open denoising forward does not stop it
    (``prepare_recache`` itself still requires idle streams)."""
    rig = Rig(sink=1, window=2, page=2)
    state = rig.streams[0].state
    for length in (4, 4, 4):
        rig.step(length, keep=True)
    expected = state.recache_latents(keep_sinks=True)
    fwd = state.prepare_forward(BRANCHES, CHUNK, False)  # a denoising forward, open
    torch.testing.assert_close(state.recache_latents(keep_sinks=True), expected, rtol=0, atol=0)
    with pytest.raises(PendingContextError):
        state.prepare_recache(keep_sinks=True)
    fwd.abort()


def test_kept_latents_in_the_models_frame_major_layout() -> None:
    """``keep_latents`` in the model's own layout ``[B, F, C, H, W]`` (issue 26 item 4): each chunk keeps its whole
    frames -- a 1-frame first chunk (image-to-video) keeps 1 -- and ``recache_latents`` returns the rebuilt chunks'
    frames concatenated in that layout; token-major and frame-major kept latents do not mix silently."""
    import ardiff_modules as am
    from tests.support.kv_writes import write_every_layer

    spec = am.KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, chunk_size=8, page_size=2, sink_chunks=1,
                          window_chunks=2, branches=("cond", "uncond"), dtype="float32")
    cache = am.KVCache(spec, num_pages=64, backend="reference")
    state = cache.open_session("s")
    per_frame = 2  # tokens per latent frame: a full chunk is 4 frames, the first (i2v) chunk 1
    frames = [torch.randn(2, n, 3, 1, 2, generator=torch.Generator().manual_seed(n + 10 * k))
              for k, n in enumerate((1, 8, 4))]
    # Forwards of 1 frame (the i2v first chunk), 8 frames over two chunks in one forward, then 4 frames.
    for latents, lengths in zip(frames, ((2,), (8, 8), (8,))):
        with state.prepare_forward(("cond", "uncond"), sum(lengths), True, chunk_lengths=lengths,
                                   keep_latents=latents) as fwd:
            write_every_layer(fwd.layers)
    # History: the 1-frame sink chunk 0 and the window chunks 2, 3 (chunk 1, the first half of the second
    # forward, evicted): chunk 2 is the second forward's frames 4..7.
    assert state.history_chunk_indices("cond") == (0, 2, 3)
    window = [frames[1][:, 4:], frames[2]]
    torch.testing.assert_close(state.recache_latents(keep_sinks=True), torch.cat(window, dim=1), rtol=0, atol=0)
    torch.testing.assert_close(state.recache_latents(keep_sinks=False), torch.cat([frames[0], *window], dim=1),
                               rtol=0, atol=0)
    # The re-cache forward runs over those frames' tokens.
    with state.prepare_recache(keep_sinks=True) as fwd:
        assert fwd.seq_len == 16 and fwd._layout.chunk_lengths == (8, 8)  # two rebuilt chunks of 4 frames
        write_every_layer(fwd.layers)
    # Misuse: a 3-D tensor whose length is not seq_len is never read as frames; frames that split a chunk refused.
    with pytest.raises(TensorMismatchError, match=r"expected shape \[num_streams=2, seq_len=8, ...\], got \(2, 4, 3\)"):
        state.prepare_forward(("cond", "uncond"), 8, True, keep_latents=torch.zeros(2, 4, 3))
    with pytest.raises(TensorMismatchError, match=r"every chunk holds whole frames \(chunk tokens \[8\]\)"):
        state.prepare_forward(("cond", "uncond"), 8, True, keep_latents=torch.zeros(2, 3, 3, 1, 2))
    assert state.pending_chunks("cond") == () and state.history_chunk_indices("cond") == (0, 2, 3)
    # A token-major chunk next to frame-major ones: their trailing shapes differ, so the re-cache refuses them.
    with state.prepare_forward(("cond", "uncond"), 8, True, keep_latents=torch.zeros(2, 8, 6)) as fwd:
        write_every_layer(fwd.layers)
    with pytest.raises(TensorMismatchError, match="to share one trailing shape"):
        state.recache_latents(keep_sinks=True)
