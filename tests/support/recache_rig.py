"""The re-cache tests' rig: sessions driven through the library and, in lock step, through the cache-free oracle
(``NaiveStreaming``), their clean latents kept for the re-cache; and a snapshot of everything a failed re-cache
must leave as it was."""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from dataclasses import dataclass, field

import torch

import ardiff_modules as am
from ardiff_modules import KVCache, populate_cross_attention
from tests.support.streaming_model import NaiveStreaming, TinyStreamingModel

CHUNK = 4
BRANCHES = ("cond", "uncond")
TOL = {"atol": 2e-5, "rtol": 2e-5}


@dataclass
class Stream:
    """One session driven through the library and, in lock step, through the cache-free oracle."""

    state: am.KVState
    naive: NaiveStreaming
    #: branch -> clean latent ``[tokens, dim]`` of every committed chunk, by commit index.
    latents: dict[str, list[torch.Tensor]] = field(default_factory=lambda: {b: [] for b in BRANCHES})


class Rig:
    def __init__(
        self, *, sink: int = 1, window: int = 2, page: int = 2, num_pages: int = 400, sessions: int = 1,
        backend: am.AttentionBackend | str = "reference", seed: int = 0, extents: bool = False,
        rule: am.RecacheRule | None = None,
    ) -> None:
        """``rule``: the cache's re-cache rule (``KVCacheSpec.recache``), used by :meth:`recache` when given."""
        torch.manual_seed(seed)
        self.model = TinyStreamingModel().eval()
        self.spec = self.model.spec(CHUNK, page, sink, window)
        self.rule = rule
        if rule is not None:
            self.spec = dataclasses.replace(self.spec, recache=rule)
        self.cache = KVCache(self.spec, num_pages=num_pages, backend=backend, contiguous_extents=extents)
        #: The layout of the last committing forward :meth:`step` ran (its kernel's view of the keys).
        self.last_layout: am.ForwardLayout | None = None
        self.g = torch.Generator().manual_seed(seed + 1)
        self.sink, self.window = sink, window
        self.streams = [
            Stream(self.cache.open_session(f"s{i}"), NaiveStreaming(self.model, CHUNK, sink, window))
            for i in range(sessions)
        ]
        self.prompt()

    def prompt(self) -> None:
        """A new prompt for every branch of every session (``clear_cross_attention`` + populate)."""
        for s in self.streams:
            contexts = {b: torch.randn(5, self.model.context_dim, generator=self.g) for b in BRANCHES}
            s.state.clear_cross_attention()
            for b, c in contexts.items():
                populate_cross_attention(s.state, b, [blk.cross for blk in self.model.blocks], c)
            s.naive.set_prompt(contexts)

    @torch.no_grad()
    def step(self, length: int = CHUNK, *, denoise: int = 1, check: bool = True, keep: bool = False) -> None:
        """``denoise`` denoising forwards then the committing one, for every session, compared with the oracle.

        ``keep``: the committing forward keeps its latents in the library (``keep_latents``)."""
        for s in self.streams:
            for d in range(denoise + 1):
                commit = d == denoise
                x = torch.randn(len(BRANCHES), length, self.model.dim, generator=self.g)
                kept = {"keep_latents": x} if keep and commit else {}
                with s.state.prepare_forward(BRANCHES, length, commit, chunk_lengths=[length], **kept) as fwd:
                    out = self.model(x, fwd.layers)
                    self.last_layout = fwd._layout
                expected = s.naive.forward(BRANCHES, x, commit, [length])
                if check:
                    torch.testing.assert_close(out, expected, **TOL)
                if commit:
                    for i, b in enumerate(BRANCHES):
                        s.latents[b].append(x[i])

    def rebuilt(self, s: Stream, branch: str, keep_sinks: bool) -> list[int]:
        if self.rule is not None:
            return list(s.state.recache_chunk_indices(branch, rule=self.rule))
        return [i for i in s.state.history_chunk_indices(branch) if not (keep_sinks and i < self.sink)]

    def recache_input(self, keep_sinks: bool, streams: list[Stream] | None = None) -> torch.Tensor:
        """``[streams * branches, tokens, dim]``: each stream's rebuilt chunks' latents, in commit order."""
        rows = []
        for s in streams or self.streams:
            for b in BRANCHES:
                rows.append(torch.cat([s.latents[b][i] for i in self.rebuilt(s, b, keep_sinks)]))
        return torch.stack(rows)

    def members(self) -> list[tuple[am.KVState, str]]:
        return [(s.state, b) for s in self.streams for b in BRANCHES]

    @torch.no_grad()
    def recache(
        self, keep_sinks: bool, inside: Callable[[am.ForwardContext], None] | None = None
    ) -> torch.Tensor:
        """One batched re-cache of every stream, checked against the oracle; returns the library's output.

        ``inside(fwd)`` runs after the model wrote the rebuilt chunks, before the commit."""
        x = self.recache_input(keep_sinks)
        how = {"rule": self.rule} if self.rule is not None else {"keep_sinks": keep_sinks}
        with self.cache.prepare_recache(self.members(), **how) as fwd:
            out = self.model(x, fwd.layers)
            if inside is not None:
                inside(fwd)
        n = len(BRANCHES)
        expected = torch.cat([
            s.naive.recache(BRANCHES, {b: [s.latents[b][i] for i in self.rebuilt(s, b, keep_sinks)] for b in BRANCHES},
                            keep_sinks, self._oracle_rule())
            for s in self.streams
        ])
        assert out.shape == expected.shape == (n * len(self.streams), x.shape[1], self.model.dim)
        torch.testing.assert_close(out, expected, **TOL)
        return out


    def _oracle_rule(self) -> tuple[str, str, int] | None:
        r = self.rule
        return None if r is None else (r.attention, r.sinks, r.context_chunks)


def recache_snapshot(cache: KVCache) -> dict:
    """Everything a failed re-cache must leave as it was: bookkeeping, free-list order, history bytes.

    Bytes of every page a chunk holds (resident or pending); not of free ring slots: reserved, but anyone's
    scratch (an aborted forward may have written one)."""
    used = sorted({
        p for state in cache.sessions.values() for b in state.kv_branch_names for h in [state.branch_pages(b)]
        for p in h.history_pages() + h.pending_pages()
    })
    sessions = {
        sid: {
            b: (h.history, h.history_index, h.history_start, h.pending, h.committed_chunks, h.committed_tokens)
            for b in state.kv_branch_names
            for h in [state.branch_pages(b)]
        }
        for sid, state in cache.sessions.items()
    }
    return {
        "free": cache._allocator.free_pages(),
        "refcounts": [cache._allocator.refcount(p) for p in range(cache._allocator.num_pages)],
        "peak": cache._allocator.peak_used,
        "sessions": sessions,
        "used_bytes": cache._pool.kv[:, :, used].clone(),
    }


def assert_recache_unchanged(cache: KVCache, before: dict, *, peak: bool = True) -> None:
    """``peak=False`` after a forward that ran: the high-water mark legitimately saw its fresh pages."""
    after = recache_snapshot(cache)
    for key in ("free", "refcounts", "peak", "sessions")[: None if peak else 2] + (() if peak else ("sessions",)):
        assert after[key] == before[key], key
    assert torch.equal(after["used_bytes"], before["used_bytes"])
    cache._allocator.check_invariants()
