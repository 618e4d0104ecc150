"""The warm-start tests' rig: the tiny streaming model over a reference cache, a warm-up's callbacks, a real
generation loop, and a snapshot of everything a warm-up must leave as it found it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import ardiff_modules as am
from tests.support.streaming_model import TinyStreamingModel

CROSS_TOKENS = 5


def model_and_spec(
    chunk: int = 4, page: int = 2, sink: int = 1, window: int | None = 2, branches: tuple[str, ...] = ("cond", "uncond"),
    **spec_fields: Any,
) -> tuple[TinyStreamingModel, am.KVCacheSpec]:
    """The tests' tiny model (seeded, eval) and a float32 spec of its geometry."""
    torch.manual_seed(0)
    model = TinyStreamingModel().eval()
    spec = model.spec(chunk, page, sink, window, branches=branches, text_tokens=CROSS_TOKENS)
    if spec_fields:
        import dataclasses

        spec = dataclasses.replace(spec, **spec_fields)
    return model, spec


def populate(model: TinyStreamingModel, state: am.KVState, seed: int | None = None) -> None:
    """Publish a prompt in every branch of ``state``: zeros (a warm-up's dummy) or seeded noise."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    for branch in state.kv_branch_names:
        text = (torch.randn(CROSS_TOKENS, model.context_dim, generator=g) if g is not None
                else torch.zeros(CROSS_TOKENS, model.context_dim))
        am.populate_cross_attention(state, branch, [b.cross for b in model.blocks], text)


@dataclass
class Calls:
    """What a warm-up's ``run_forward`` saw, and an optional failure to raise at one call."""

    model: Any
    forwards: list[tuple[int, int, bool]]
    raise_at: int | None = None
    error: BaseException | None = None

    def __call__(self, fwd: am.ForwardContext) -> None:
        if self.raise_at is not None and len(self.forwards) == self.raise_at:
            assert self.error is not None
            raise self.error
        self.forwards.append((fwd.num_streams, fwd.seq_len, fwd.commit_current))
        self.model(torch.zeros(fwd.num_streams, fwd.seq_len, 32), fwd.layers)


def calls(model: Any, raise_at: int | None = None, error: BaseException | None = None) -> Calls:
    return Calls(model, [], raise_at, error)


def generate(
    cache: am.KVCache, fn: Callable[..., torch.Tensor], states: Sequence[am.KVState], lengths: Sequence[int], *,
    seed: int, denoising: int = 2, branches: Sequence[str] | None = None,
) -> list[torch.Tensor]:
    """A real generation: per chunk (``lengths``), ``denoising`` forwards then a committing one, every session's
    branches batched in one forward; seeded inputs; returns the committing forwards' outputs."""
    branches = tuple(branches or cache.spec.branches)
    streams = [(s, b) for s in states for b in branches]
    g = torch.Generator().manual_seed(seed)
    outs = []
    with torch.no_grad():
        for length in lengths:
            x = torch.randn(len(streams), length, 32, generator=g)
            options = {} if length == cache.spec.chunk_size else {"chunk_lengths": (length,)}
            for commit in (False,) * denoising + (True,):
                with cache.prepare_forward(streams, length, commit, **options) as fwd:
                    out = fn(x, fwd.layers)
            outs.append(out)
    return outs


@dataclass(frozen=True)
class Snapshot:
    """The cache's state a warm-up must not change (the allocator's peak excepted)."""

    used: tuple[int, ...]
    refcounts: tuple[int, ...]
    free_order: tuple[int, ...]
    sessions: tuple[str, ...]
    histories: tuple[Any, ...]
    contexts: int
    pages: torch.Tensor  # pool contents of every page in use


def snapshot(cache: am.KVCache) -> Snapshot:
    allocator = cache._allocator
    used = allocator.used_pages()
    histories = tuple(
        (sid, b, s.history_chunks(b), s.pending_chunks(b), s.token_offset(b), s.committed_chunks(b))
        for sid, s in sorted(cache.sessions.items()) for b in s.kv_branch_names
    )
    return Snapshot(
        used=used, refcounts=tuple(allocator.refcount(p) for p in used), free_order=allocator.free_pages(),
        sessions=tuple(sorted(cache.sessions)), histories=histories, contexts=cache._forwards.num_contexts,
        pages=cache._pool.kv[:, :, list(used)].clone(),
    )


def assert_unchanged(cache: am.KVCache, before: Snapshot) -> None:
    after = snapshot(cache)
    assert after.sessions == before.sessions  # no scratch session left
    assert after.used == before.used and after.refcounts == before.refcounts
    assert after.free_order == before.free_order
    assert after.histories == before.histories
    assert after.contexts == before.contexts
    assert torch.equal(after.pages, before.pages), "a page in use changed"
    cache._allocator.check_invariants()
