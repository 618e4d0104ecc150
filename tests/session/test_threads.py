"""Threads each driving their own sessions on ONE shared KVCache (issue 10: ``cache.lock``).

Four worker threads pick operations at random on sessions they own -- open / admit, batched CFG
forwards through a tiny model, single-branch forwards finished by ``commit()`` / ``abort()`` /
the seed's ``commit_paged_context`` / ``abort``, forwards batched across two of their sessions,
denoising forwards left open (superseded later), fork, reset, close, populate, ``stats()``,
``sessions_that_fit()`` -- while a fifth thread reads ``cache.stats()`` in a loop and checks the
bookkeeping under ``cache.lock``. Only :class:`CapacityError` may be raised; at the end every page
is free and no forward context is left.

Knobs (environment): ``ARDIFF_THREAD_OPS`` operations per worker (default 200, a few seconds);
``ARDIFF_THREAD_MODEL=0`` skips the model (host bookkeeping only: prepare / plan / commit / abort),
for long hammers such as ``ARDIFF_THREAD_OPS=100000 ARDIFF_THREAD_MODEL=0``.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import threading
import time
import traceback

import pytest
import torch

from ardiff_modules import CapacityError, KVCache, KVState, populate_cross_attention
from tests.support.streaming_model import TinyStreamingModel

pytestmark = pytest.mark.slow  # a thread hammer, several seconds

OPS = int(os.environ.get("ARDIFF_THREAD_OPS", "200"))
WITH_MODEL = os.environ.get("ARDIFF_THREAD_MODEL", "1") != "0"
WORKERS = 4
MAX_SESSIONS = 3  # per worker
SWITCH_INTERVAL = 1e-5  # seconds (CPython's default is 5e-3)
CHUNK = 4
BOTH = ("cond", "uncond")
TEXT = "text"
OPERATIONS = (
    ("open", 2),
    ("step", 6),
    ("manual", 3),
    ("batched", 2),
    ("open_denoise", 1),
    ("fork", 1),
    ("reset", 1),
    ("close", 1),
    ("populate", 1),
    ("stats", 1),
    ("fit", 1),
)


def _lock(cache: KVCache):
    # The lock is the contract; a cache without one (older code) gets no lock, so the race shows.
    return getattr(cache, "lock", None) or contextlib.nullcontext()


class Worker(threading.Thread):
    def __init__(
        self, index: int, cache: KVCache, model: TinyStreamingModel, errors: list, stop: threading.Event
    ) -> None:
        super().__init__(name=f"worker-{index}", daemon=True)
        self.rng = random.Random(1000 + index)
        self.gen = torch.Generator().manual_seed(index)
        self.cache, self.model, self.errors, self.stop = cache, model, errors, stop
        self.sessions: list[KVState] = []
        self.counts: dict[str, int] = {}
        self.capacity_errors = 0
        names, weights = zip(*OPERATIONS)
        self.names, self.weights = names, weights

    # ------------------------------------------------------------------ helpers
    def _x(self, streams: int, n: int) -> torch.Tensor:
        return torch.randn(streams, n * CHUNK, self.model.dim, generator=self.gen)

    def _prompt(self, state: KVState, branch: str) -> None:
        context = torch.randn(5, self.model.context_dim, generator=self.gen)
        populate_cross_attention(state, branch, [b.cross for b in self.model.blocks], context)

    def _ready(self, state: KVState, branches) -> None:
        if WITH_MODEL:
            for branch in branches:
                if not state.is_cross_attention_populated(branch, TEXT):
                    self._prompt(state, branch)

    def _run(self, fwd, streams: int, n: int) -> None:
        if WITH_MODEL:
            with torch.no_grad():
                out = self.model(self._x(streams, n), fwd.layers)
            assert out.shape == (streams, n * CHUNK, self.model.dim)
            assert torch.isfinite(out).all()

    def _pick(self) -> KVState | None:
        return self.rng.choice(self.sessions) if self.sessions else None

    # ------------------------------------------------------------------ operations
    def op_open(self) -> None:
        if len(self.sessions) < MAX_SESSIONS:
            new = self.cache.admit_session() if self.rng.random() < 0.5 else self.cache.open_session()
            self.sessions.append(new)

    def op_step(self) -> None:
        s = self._pick()
        if s is None:
            return self.op_open()
        n = self.rng.choice((1, 1, 1, 2))
        self._ready(s, BOTH)
        with s.prepare_forward(BOTH, n * CHUNK, commit_current=self.rng.random() < 0.4) as fwd:
            self._run(fwd, 2, n)
        return None

    def op_manual(self) -> None:
        s = self._pick()
        if s is None:
            return
        branch = self.rng.choice(BOTH)
        self._ready(s, (branch,))
        commit = self.rng.random() < 0.5
        if self.rng.random() < 0.5:
            fwd = s.prepare_forward((branch,), CHUNK, commit_current=commit)
        else:
            fwd = s.get_kv_caches(branch, CHUNK, commit_current=commit)[0].forward  # the seed's API
        self._run(fwd, 1, 1)
        finish = self.rng.randrange(4)
        if finish == 0:
            fwd.commit()
        elif finish == 1:
            fwd.abort()
        elif finish == 2:
            s.commit_paged_context(branch)
        else:
            s.abort(branch if self.rng.random() < 0.5 else None)
        return

    def op_batched(self) -> None:
        if len(self.sessions) < 2:
            return self.op_open()
        a, b = self.rng.sample(self.sessions, 2)
        streams = [(a, self.rng.choice(BOTH)), (b, self.rng.choice(BOTH))]
        for state, branch in streams:
            self._ready(state, (branch,))
        fwd = self.cache.prepare_forward(streams, CHUNK, commit_current=self.rng.random() < 0.5)
        self._run(fwd, 2, 1)
        (fwd.commit if self.rng.random() < 0.7 else fwd.abort)()
        return None

    def op_open_denoise(self) -> None:
        """A denoising forward left open: the next forward of its streams supersedes it (or reset/close aborts it)."""
        s = self._pick()
        if s is None:
            return
        self._ready(s, BOTH)
        fwd = s.prepare_forward(BOTH, CHUNK, commit_current=False)
        self._run(fwd, 2, 1)

    def op_fork(self) -> None:
        s = self._pick()
        if s is not None and len(self.sessions) < MAX_SESSIONS:
            self.sessions.append(s.fork(share_cross_attention=self.rng.random() < 0.8))

    def op_reset(self) -> None:
        s = self._pick()
        if s is not None:
            s.reset(keep_cross_attention=(TEXT,) if self.rng.random() < 0.5 else ())

    def op_close(self) -> None:
        s = self._pick()
        if s is not None:
            s.close()
            self.sessions.remove(s)

    def op_populate(self) -> None:
        s = self._pick()
        if s is not None and WITH_MODEL:
            self._prompt(s, self.rng.choice(BOTH))
        elif s is not None:
            s.clear_cross_attention()

    def op_stats(self) -> None:
        st = self.cache.stats()
        assert st.pages_used + st.pages_free == st.num_pages

    def op_fit(self) -> None:
        assert self.cache.sessions_that_fit() >= 0
        self.cache.can_admit(1)

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        name = "start"
        try:
            for _ in range(OPS):
                if self.stop.is_set():
                    break
                name = self.rng.choices(self.names, self.weights)[0]
                self.counts[name] = self.counts.get(name, 0) + 1
                try:
                    getattr(self, f"op_{name}")()
                except CapacityError:
                    self.capacity_errors += 1
            name = "close all"
            for s in self.sessions:
                s.close()
            self.sessions.clear()
        except BaseException:  # noqa: BLE001 - reported by the test
            self.errors.append((self.name, name, traceback.format_exc()))
            self.stop.set()


def _watch(cache: KVCache, errors: list, done: threading.Event, stop: threading.Event, reads: list) -> None:
    """Reads stats in a loop; under the lock, every allocator reference is some open session's."""
    try:
        while not done.is_set() and not stop.is_set():
            st = cache.stats()
            assert st.pages_used + st.pages_free == st.num_pages, st
            assert st.peak_pages_used <= st.num_pages
            cache.sessions_that_fit()
            with _lock(cache):
                cache._allocator.check_invariants()
                alloc = cache._allocator
                refs = sum(alloc.refcount(p) for p in range(alloc.num_pages))
                held = sum(s.pages_in_use() for s in cache.sessions.values())
                assert refs == held, f"allocator holds {refs} references, the open sessions {held}"
            reads.append(1)
    except BaseException:  # noqa: BLE001
        errors.append(("stats", "stats loop", traceback.format_exc()))
        stop.set()


def test_threads_drive_their_own_sessions_on_one_cache() -> None:
    torch.manual_seed(0)
    model = TinyStreamingModel(dim=16, heads=2, kv_heads=2, layers=2, context_dim=8).eval()
    spec = model.spec(CHUNK, 2, 1, 2)
    # ~2/3 of what 12 sessions need at their peak: CapacityError happens, but most ops go through.
    cache = KVCache(spec, num_pages=160, backend="reference", max_forward_contexts=6)
    errors: list = []
    stop, done = threading.Event(), threading.Event()
    reads: list = []
    workers = [Worker(i, cache, model, errors, stop) for i in range(WORKERS)]
    watcher = threading.Thread(target=_watch, args=(cache, errors, done, stop, reads), name="stats", daemon=True)
    threads, interval = torch.get_num_threads(), sys.getswitchinterval()
    torch.set_num_threads(1)
    sys.setswitchinterval(SWITCH_INTERVAL)  # switch threads often: races show up in fewer operations
    start = time.perf_counter()
    try:
        watcher.start()
        for w in workers:
            w.start()
        deadline = start + max(600.0, OPS * 0.05)
        for w in workers:
            w.join(timeout=max(1.0, deadline - time.perf_counter()))
        done.set()
        watcher.join(timeout=60)
    finally:
        stop.set()
        torch.set_num_threads(threads)
        sys.setswitchinterval(interval)
    elapsed = time.perf_counter() - start
    alive = [t.name for t in (*workers, watcher) if t.is_alive()]
    assert not alive, f"threads still running (deadlock?): {alive}"
    assert not errors, "\n".join(f"[{who}] during {op}:\n{tb}" for who, op, tb in errors)
    ops = sum(sum(w.counts.values()) for w in workers)
    capacity = sum(w.capacity_errors for w in workers)
    print(
        f"{WORKERS} threads x {OPS} ops (model={WITH_MODEL}): {ops} ops, {capacity} CapacityError, "
        f"{len(reads)} stats reads, {elapsed:.1f} s"
    )
    assert ops == WORKERS * OPS
    assert capacity < ops / 2, "the pool is too small for this test to exercise much"
    assert reads, "the stats thread never completed a read"
    cache._allocator.check_invariants()
    assert cache.sessions == {}
    assert cache._allocator.num_free == cache._allocator.num_pages, "pages leaked"
    assert cache._forwards.num_contexts == 0
