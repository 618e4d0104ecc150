"""The library's streaming rollout equals the cache-free oracle, forward for forward."""

from __future__ import annotations

import pytest
import torch
from tests.support.streaming_model import LibraryStreaming, NaiveStreaming, TinyStreamingModel, play, rollout_events

CHUNK = 4
SLOW = pytest.mark.slow  # the quick loop (-m "not slow") keeps one case of each oracle test
CASES = [
    # page_size, sink, window, kv_heads
    pytest.param(1, 1, 2, 4, id="page1-sink1-win2"),
    pytest.param(4, 0, 3, 4, id="page=chunk-sink0-win3", marks=SLOW),
    pytest.param(2, 2, 1, 2, id="page2-sink2-win1-gqa", marks=SLOW),
    pytest.param(2, 1, None, 4, id="page2-sink1-unbounded", marks=SLOW),
    pytest.param(2, 1, 0, 4, id="page2-sink1-win0", marks=SLOW),
    pytest.param(4, 0, 0, 1, id="page=chunk-nohistory-mqa", marks=SLOW),
]


@pytest.mark.parametrize("page_size,sink,window,kv_heads", CASES)
def test_rollout_matches_cache_free_oracle(page_size: int, sink: int, window: int | None, kv_heads: int) -> None:
    torch.manual_seed(0)
    model = TinyStreamingModel(kv_heads=kv_heads).eval()
    spec = model.spec(CHUNK, page_size, sink, window)
    num_chunks = 16
    pages = 2 * (num_chunks + 8) * spec.pages_per_chunk
    events = rollout_events(num_chunks, CHUNK, model.dim, model.context_dim)
    library = LibraryStreaming(model, spec, pages)
    expected = play(NaiveStreaming(model, CHUNK, sink, window), events)
    actual = play(library, events)
    assert len(actual) == len(expected) >= 30  # 10 chunk steps x (2 denoise + 1 commit), 16 chunks
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, e, atol=2e-5, rtol=2e-5, msg=lambda m, i=i: f"forward {i}: {m}")
    # Peak residency per branch is bounded by (sinks + window + pending) chunks; all pages free on close.
    library.state.close()
    assert library.cache._allocator.num_free == pages


def test_history_is_visible_and_window_evicts() -> None:
    """Sanity check that the oracle comparison is sensitive: outputs depend on the visible history."""
    torch.manual_seed(0)
    model = TinyStreamingModel().eval()
    spec = model.spec(CHUNK, 2, 1, 1)
    events = rollout_events(6, CHUNK, model.dim, model.context_dim)
    lib = play(LibraryStreaming(model, spec, 200), events)
    no_history = play(NaiveStreaming(model, CHUNK, 0, 0), events)
    # First forward has no history: identical. Later ones see history: different.
    torch.testing.assert_close(lib[0], no_history[0])
    assert not torch.allclose(lib[-1], no_history[-1], atol=1e-3)


@pytest.mark.parametrize(
    "page_size,sink,window", [(2, 1, 2), pytest.param(1, 0, 3, marks=SLOW), pytest.param(2, 2, 1, marks=SLOW)]
)
def test_mixed_chunk_lengths_match_the_cache_free_oracle(page_size: int, sink: int, window: int) -> None:
    """Image-to-video style first chunk of half a chunk, then full chunks, and multi-chunk forwards that
    mix a short chunk in: sinks and windows count chunks, positions count tokens (issue 12)."""
    torch.manual_seed(0)
    model = TinyStreamingModel().eval()
    spec = model.spec(CHUNK, page_size, sink, window)
    events = rollout_events(16, CHUNK, model.dim, model.context_dim, short_chunk=CHUNK // 2)
    assert any(len(e[4]) > 1 and len(set(e[4])) > 1 for e in events if e[0] == "forward")
    pages = 2 * (16 + 8) * spec.pages_per_chunk
    library = LibraryStreaming(model, spec, pages)
    expected = play(NaiveStreaming(model, CHUNK, sink, window), events)
    actual = play(library, events)
    assert len(actual) == len(expected) >= 30
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, e, atol=2e-5, rtol=2e-5, msg=lambda m, i=i: f"forward {i}: {m}")
    assert library.state.token_offset("cond") == library.state.branch_pages("cond").committed_tokens
    library.state.close()
    assert library.cache._allocator.num_free == pages
