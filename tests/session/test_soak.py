"""Soak: thousands of random forwards across several sessions, every output against the cache-free oracle.

Random churn on the reference backend -- 1- and 2-chunk forwards, denoising forwards then a committing
one, batched CFG, the seed's per-branch API, forwards batched across sessions, aborted forwards (an
exception in the ``with`` block, ``abort()``), denoising forwards left open and superseded, forks
(all or one branch, cross caches shared or not), resets (prompt kept or not), prompt switches, sessions
opened and closed. Every output is compared with :class:`streaming_model.NaiveStreaming` (plain lists
of K/V, no pages) within 1e-5; after every operation each allocator reference is accounted for by
some session's chunks (no leak), the pool is sized to the admission bound (a leak would soon raise
CapacityError), and at the end every page is free.

``ARDIFF_SOAK_STEPS`` sets the number of operations (default 1500: ~1700 forwards, each checked; ~30 s).
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

import pytest
import torch

from ardiff_modules import KVCache, KVState, populate_cross_attention
from tests.support.streaming_model import NaiveStreaming, TinyStreamingModel

pytestmark = pytest.mark.slow

STEPS = int(os.environ.get("ARDIFF_SOAK_STEPS", "1500"))
CHUNK, PAGE, SINK, WINDOW = 4, 2, 1, 2
BOTH = ("cond", "uncond")
MAX_SESSIONS = 4
MAX_CHUNKS = 2  # chunks per forward
TOL = 1e-5


@dataclass(eq=False)
class Session:
    state: KVState
    oracle: NaiveStreaming


class Soak:
    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.model = TinyStreamingModel(kv_heads=2, layers=2).eval()
        spec = self.model.spec(CHUNK, PAGE, SINK, WINDOW)
        probe = KVCache(spec, num_pages=spec.pages_per_chunk, backend="reference")
        # Exactly what MAX_SESSIONS sessions may hold at their peak: a leaked page soon shows as CapacityError.
        self.bound = MAX_SESSIONS * probe.pages_per_session(pending_chunks=MAX_CHUNKS)
        probe.close()
        self.cache = KVCache(spec, num_pages=self.bound, backend="reference", max_forward_contexts=8)
        self.sessions: list[Session] = []
        self.forwards = 0
        self.counts: Counter[str] = Counter()

    # ------------------------------------------------------------------ helpers
    def text(self) -> torch.Tensor:
        return torch.randn(5, self.model.context_dim, generator=self.gen)

    def prompt(self, s: Session, branches=BOTH) -> None:
        for branch in branches:
            context = self.text()
            populate_cross_attention(s.state, branch, [b.cross for b in self.model.blocks], context)
            s.oracle.text[branch] = context

    def ensure_prompt(self, s: Session) -> None:
        missing = [b for b in BOTH if not s.state.is_cross_attention_populated(b, "text")]
        assert all(b not in s.oracle.text for b in missing)
        self.prompt(s, missing)

    def new_oracle(self) -> NaiveStreaming:
        return NaiveStreaming(self.model, CHUNK, SINK, WINDOW)

    def open(self) -> Session:
        s = Session(self.cache.open_session(), self.new_oracle())
        self.prompt(s)
        self.sessions.append(s)
        return s

    def pick(self) -> Session:
        return self.rng.choice(self.sessions)

    def forward(self, streams: list[tuple[Session, str]], n: int, commit: bool, *, seed_api: bool = False) -> None:
        """One forward through the library, checked row by row against the oracle."""
        for s, _ in streams:
            self.ensure_prompt(s)
        x = torch.randn(len(streams), n * CHUNK, self.model.dim, generator=self.gen)
        sessions = {id(s) for s, _ in streams}
        with torch.no_grad():
            if seed_api:
                ((s, branch),) = streams
                out = self.model(x, s.state.get_kv_caches(branch, n * CHUNK, commit_current=commit))
                s.state.commit_paged_context(branch)
            elif len(sessions) == 1:
                with streams[0][0].state.prepare_forward([b for _, b in streams], n * CHUNK, commit) as fwd:
                    out = self.model(x, fwd.layers)
            else:
                with self.cache.prepare_forward([(s.state, b) for s, b in streams], n * CHUNK, commit) as fwd:
                    out = self.model(x, fwd.layers)
            for i, (s, branch) in enumerate(streams):
                expected, chunk_kv = s.oracle._stream(branch, x[i : i + 1])
                torch.testing.assert_close(
                    out[i : i + 1],
                    expected,
                    atol=TOL,
                    rtol=TOL,
                    msg=lambda m, i=i, branch=branch: f"forward {self.forwards} stream {i} ({branch}): {m}",
                )
                if commit:
                    s.oracle.committed[branch].extend(chunk_kv)
        self.forwards += 1

    def streams_of(self, s: Session) -> list[tuple[Session, str]]:
        kind = self.rng.random()
        if kind < 0.6:
            return [(s, b) for b in BOTH]
        if kind < 0.75:
            return [(s, b) for b in reversed(BOTH)]
        return [(s, self.rng.choice(BOTH))]

    # ------------------------------------------------------------------ operations
    def op_chunk(self) -> None:
        """Denoising forwards (0-2), then the committing one, for one session."""
        s = self.pick()
        n = self.rng.randint(1, MAX_CHUNKS)
        streams = self.streams_of(s)
        seed_api = len(streams) == 1 and self.rng.random() < 0.5
        for _ in range(self.rng.randint(0, 2)):
            self.forward(streams, n, False, seed_api=seed_api)
        self.forward(streams, n, True, seed_api=seed_api)

    def op_batched(self) -> None:
        """One forward over streams of several sessions (denoising or committing)."""
        if len(self.sessions) < 2:
            return self.op_chunk()
        chosen = self.rng.sample(self.sessions, self.rng.randint(2, len(self.sessions)))
        streams = [(s, b) for s in chosen for b in (BOTH if self.rng.random() < 0.5 else (self.rng.choice(BOTH),))]
        self.forward(streams, self.rng.randint(1, MAX_CHUNKS), self.rng.random() < 0.5)
        return None

    def op_open_denoise(self) -> None:
        """A denoising forward left open: superseded by the next forward of its streams, or aborted by reset/close."""
        s = self.pick()
        self.forward_left_open(s)

    def forward_left_open(self, s: Session) -> None:
        self.ensure_prompt(s)
        n = self.rng.randint(1, MAX_CHUNKS)
        x = torch.randn(2, n * CHUNK, self.model.dim, generator=self.gen)
        fwd = s.state.prepare_forward(BOTH, n * CHUNK, commit_current=False)
        with torch.no_grad():
            out = self.model(x, fwd.layers)
            for i, branch in enumerate(BOTH):
                expected, _ = s.oracle._stream(branch, x[i : i + 1])
                torch.testing.assert_close(out[i : i + 1], expected, atol=TOL, rtol=TOL)
        self.forwards += 1

    def op_abort(self) -> None:
        s = self.pick()
        self.ensure_prompt(s)
        n = self.rng.randint(1, MAX_CHUNKS)
        commit = self.rng.random() < 0.5
        x = torch.randn(2, n * CHUNK, self.model.dim, generator=self.gen)
        if self.rng.random() < 0.5:
            with (
                pytest.raises(RuntimeError, match="injected"),
                torch.no_grad(),
                s.state.prepare_forward(BOTH, n * CHUNK, commit_current=commit) as fwd,
            ):
                self.model(x, fwd.layers)
                raise RuntimeError("injected model failure")
        else:
            fwd = s.state.prepare_forward(BOTH, n * CHUNK, commit_current=commit)
            with torch.no_grad():
                self.model(x, fwd.layers)
            (fwd.abort if self.rng.random() < 0.5 else s.state.abort)()
        assert all(s.state.pending_chunks(b) == () for b in BOTH)

    def op_fork(self) -> None:
        if len(self.sessions) >= MAX_SESSIONS:
            return self.op_close()
        parent = self.pick()
        branches = BOTH if self.rng.random() < 0.7 else (self.rng.choice(BOTH),)
        share = self.rng.random() < 0.7
        child = Session(parent.state.fork(branches=branches, share_cross_attention=share), self.new_oracle())
        for b in branches:
            child.oracle.committed[b] = list(parent.oracle.committed[b])
            if share and b in parent.oracle.text:
                child.oracle.text[b] = parent.oracle.text[b]
        self.sessions.append(child)
        return None

    def op_reset(self) -> None:
        s = self.pick()
        keep = self.rng.random() < 0.5
        s.state.reset(keep_cross_attention=("text",) if keep else ())
        s.oracle.committed = defaultdict(list)
        if not keep:
            s.oracle.text = {}

    def op_prompt(self) -> None:
        s = self.pick()
        s.state.clear_cross_attention()
        s.oracle.text = {}
        self.prompt(s)

    def op_close(self) -> None:
        if len(self.sessions) <= 1:
            return self.op_open()
        s = self.pick()
        s.state.close()
        self.sessions.remove(s)
        return None

    def op_open(self) -> None:
        if len(self.sessions) >= MAX_SESSIONS:
            return self.op_close()
        self.open()
        return None

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """Every reference is some session's chunk; positions agree with the oracle."""
        refs: Counter[int] = Counter()
        for s in self.sessions:
            for b in BOTH:
                for chunk in s.state.history_chunks(b) + s.state.pending_chunks(b):
                    refs.update(chunk)
                assert s.state.token_offset(b) == len(s.oracle.committed[b]) * CHUNK
                assert len(s.state.history_chunks(b)) == len(s.oracle.visible(b))
        alloc = self.cache._allocator
        held = {p: alloc.refcount(p) for p in range(alloc.num_pages) if alloc.refcount(p)}
        assert held == dict(refs), "allocator references that no session accounts for (leak) or vice versa"
        alloc.check_invariants()

    def run(self, steps: int) -> None:
        ops = [
            ("chunk", 10),
            ("batched", 4),
            ("open_denoise", 2),
            ("abort", 2),
            ("fork", 1),
            ("reset", 1),
            ("prompt", 1),
            ("close", 1),
            ("open", 1),
        ]
        names, weights = zip(*ops)
        self.open()
        self.open()
        for _ in range(steps):
            name = self.rng.choices(names, weights)[0]
            self.counts[name] += 1
            getattr(self, f"op_{name}")()
            self.check()


@pytest.mark.parametrize("seed", [0])
def test_soak_random_churn_matches_the_cache_free_oracle(seed: int) -> None:
    soak = Soak(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: intra-op threads only add overhead (and oversubscribe CI runners)
    start = time.perf_counter()
    try:
        soak.run(STEPS)
    finally:
        torch.set_num_threads(threads)
    elapsed = time.perf_counter() - start
    cache = soak.cache
    stats = cache.stats()
    print(
        f"soak: {STEPS} operations, {soak.forwards} forwards checked, {dict(soak.counts)}, "
        f"peak {stats.peak_pages_used}/{cache._allocator.num_pages} pages, {elapsed:.1f} s"
    )
    assert soak.forwards >= STEPS
    # Flat usage: never above what MAX_SESSIONS sessions hold at their peak (the pool is exactly that big).
    assert stats.peak_pages_used <= soak.bound
    for s in soak.sessions:
        s.state.close()
    assert cache._allocator.num_free == cache._allocator.num_pages, "pages leaked"
    assert cache._forwards.num_contexts == 0
    cache._allocator.check_invariants()
    cache.close()
