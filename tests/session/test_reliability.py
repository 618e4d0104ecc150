"""Reliability holes of issue 10, one test per hole (each failed on the code before the fix).

A forward is one transaction over all its streams. Once it finished (commit, abort, ``reset()`` /
``close()`` of a member session, superseded by the next forward of a stream, its context released
by the cache) its layer contexts must not touch the pool: the custom op raises before writing, in
eager and compiled code. Batched commits are atomic (exceptions and Ctrl-C included), streams never
see each other's data (padding included), ``KVCache.close()`` frees everything, ``check_finite``
keeps NaN/Inf out of history, and a backward through the op is refused.

Only public API is used; "unchanged" is checked bit for bit on the pool and on the allocator.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

from ardiff_modules import (
    ChunkSelfAttention,
    CrossAttentionSpec,
    KVCache,
    KVCacheSpec,
    KVState,
    SpecError,
    chunk_attention,
    populate_cross_attention,
)
from ardiff_modules.errors import (
    CacheClosedError,
    CommitFailedError,
    ForwardFinishedError,
    IncompleteForwardError,
    InferenceOnlyError,
    NonFiniteKVError,
    PlanNotFoundError,
)
from ardiff_modules.history import BranchHistory
from tests.support.streaming_model import TinyStreamingModel

CHUNK = 4
HEADS = 2
DIM = 4
BOTH = ("cond", "uncond")
SPEC = KVCacheSpec(
    num_layers=2,
    num_kv_heads=2,
    head_dim=DIM,
    chunk_size=CHUNK,
    page_size=2,
    sink_chunks=1,
    window_chunks=2,
    branches=BOTH,
    cross_attention=(CrossAttentionSpec("text", 3),),
    dtype="float32",
)
#: What a released context may raise instead of ForwardFinishedError (its plan handle is gone).
RELEASED = (ForwardFinishedError, PlanNotFoundError)


# ---------------------------------------------------------------------------- helpers
def make_cache(num_pages: int = 32, **kwargs) -> KVCache:
    return KVCache(SPEC, num_pages=num_pages, backend="reference", **kwargs)


def tensors(streams: int, n: int = CHUNK, *, fill: float | None = None, seed: int = 0):
    """q, k, v of ``streams`` streams and ``n`` tokens (``fill``: a constant, so a stray write shows)."""
    shape = (streams, n, HEADS, DIM)
    if fill is not None:
        return tuple(torch.full(shape, float(fill)) for _ in range(3))
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=g) for _ in range(3))


def run_layers(layers, streams: int, n: int = CHUNK, seed: int = 0) -> list[torch.Tensor]:
    """One attention call per layer, as a model makes them."""
    return [chunk_attention(*tensors(streams, n, seed=seed + i), layer) for i, layer in enumerate(layers)]


def commit_chunk(state: KVState, branches=BOTH, n: int = CHUNK, seed: int = 0) -> None:
    with state.prepare_forward(branches, n, commit_current=True) as fwd:
        run_layers(fwd.layers, len(branches), n, seed)


def bits(t: torch.Tensor) -> torch.Tensor:
    """A float tensor's bit pattern (NaN == NaN, -0.0 != 0.0)."""
    return t.detach().clone().view(torch.int32)


def bookkeeping(cache: KVCache, *, ordered: bool = True):
    """Allocator (free queue, refcounts) and every open session's branches, via public API."""
    alloc = cache.allocator
    free = alloc.free_pages() if ordered else tuple(sorted(alloc.free_pages()))
    sessions = {
        sid: {
            b: (
                state.visible_chunks(b),
                state.pending_chunks(b),
                state.token_offset(b),
                state.committed_chunks(b),
                id(state.open_forward(b)) if state.open_forward(b) is not None else None,
            )
            for b in state.kv_branch_names
        }
        for sid, state in cache.sessions.items()
    }
    return free, tuple(alloc.refcount(p) for p in range(alloc.num_pages)), sessions


def pages_of(state: KVState, branch: str) -> list[int]:
    return [p for chunk in state.visible_chunks(branch) for p in chunk]


def assert_refused(cache: KVCache, layers, streams: int, n: int = CHUNK, errors=ForwardFinishedError) -> None:
    """Every stale layer context raises ``errors`` in the op; the pool and the bookkeeping are bit-identical."""
    kv, before = bits(cache.pool.kv), bookkeeping(cache)
    for layer in layers:
        with pytest.raises(errors):
            chunk_attention(*tensors(streams, n, fill=1e4), layer)
    assert torch.equal(bits(cache.pool.kv), kv), "a finished forward wrote into the pool"
    assert bookkeeping(cache) == before
    cache.allocator.check_invariants()


# ---------------------------------------------------------------------------- (a) finished forwards refuse
@pytest.mark.parametrize("commit_current", [True, False], ids=["committing", "denoising"])
@pytest.mark.parametrize("api", ["with", "seed"])
def test_committed_forward_cannot_write(commit_current: bool, api: str) -> None:
    """After the commit its pending pages are history (committing) or kept for the next forward (denoising)."""
    cache = make_cache()
    a = cache.open_session("a")
    commit_chunk(a)
    if api == "with":
        with a.prepare_forward(BOTH, CHUNK, commit_current=commit_current) as fwd:
            run_layers(fwd.layers, 2, seed=10)
        layers, streams = fwd.layers, 2
    else:  # the seed's per-branch API
        layers, streams = a.get_kv_caches("cond", CHUNK, commit_current=commit_current), 1
        run_layers(layers, 1, seed=10)
        a.commit_paged_context("cond")
    assert a.open_forward("cond") is None and a.open_forward("uncond") is None
    assert a.committed_chunks("cond") == 1 + commit_current
    assert_refused(cache, layers, streams)


def test_finished_forward_cannot_write_through_the_lse_op() -> None:
    """``chunk_attention(..., return_lse=True)`` is another custom op: it checks the forward too."""
    cache = make_cache()
    a = cache.open_session("a")
    commit_chunk(a)
    with a.prepare_forward(BOTH, CHUNK, commit_current=True) as fwd:
        out, lse = chunk_attention(*tensors(2), fwd.layers[0], return_lse=True)
        chunk_attention(*tensors(2), fwd.layers[1], return_lse=True)  # a commit needs every layer
    assert out.shape == (2, CHUNK, HEADS, DIM) and lse.shape == (2, CHUNK, HEADS)
    kv = bits(cache.pool.kv)
    with pytest.raises(ForwardFinishedError):
        chunk_attention(*tensors(2, fill=1e4), fwd.layers[1], return_lse=True)
    assert torch.equal(bits(cache.pool.kv), kv)


def test_aborted_forward_cannot_write_into_pages_given_to_another_session() -> None:
    cache = make_cache(num_pages=8)
    a, b = cache.open_session("a"), cache.open_session("b")
    commit_chunk(a)  # a: pages 0..3
    fwd = a.prepare_forward(BOTH, CHUNK, commit_current=True)
    run_layers(fwd.layers, 2, seed=10)
    pending = {p for br in BOTH for chunk in a.pending_chunks(br) for p in chunk}
    fwd.abort()
    assert a.committed_chunks("cond") == 1 and a.pending_chunks("cond") == ()
    commit_chunk(b, seed=20)  # the only free pages are the aborted forward's
    assert {p for br in BOTH for p in pages_of(b, br)} == pending
    assert_refused(cache, fwd.layers, 2)


def test_reset_session_forward_cannot_write() -> None:
    cache = make_cache(num_pages=8)
    a, b = cache.open_session("a"), cache.open_session("b")
    commit_chunk(a)
    fwd = a.prepare_forward(BOTH, CHUNK, commit_current=True)
    run_layers(fwd.layers, 2, seed=10)
    a.reset()
    assert a.open_forward("cond") is None and a.committed_chunks("cond") == 0
    assert cache.allocator.num_free == 8
    commit_chunk(b, seed=20)  # reuses a's old pages
    assert_refused(cache, fwd.layers, 2)


def test_closing_a_member_session_finishes_the_whole_forward() -> None:
    """A batched forward over (a, cond) and (b, cond): a.close() aborts b's stream too; nothing is committed."""
    cache = make_cache(num_pages=12)
    a, b = cache.open_session("a"), cache.open_session("b")
    commit_chunk(a, ("cond",))
    commit_chunk(b, ("cond",), seed=5)
    b_history = pages_of(b, "cond")
    with cache.prepare_forward([(a, "cond"), (b, "cond")], CHUNK, commit_current=True) as fwd:
        run_layers(fwd.layers, 2, seed=10)
        a.close()
        assert b.open_forward("cond") is None and b.pending_chunks("cond") == ()
        assert_refused(cache, fwd.layers, 2, errors=RELEASED)
    # The with block exits normally: the forward already finished, nothing gets committed.
    assert b.committed_chunks("cond") == 1 and pages_of(b, "cond") == b_history
    assert cache.allocator.num_used == len(b_history)
    c = cache.open_session("c")
    commit_chunk(c, seed=30)  # takes a's and the aborted forward's pages
    assert_refused(cache, fwd.layers, 2, errors=RELEASED)


def test_superseded_denoising_forward_cannot_write() -> None:
    """The next forward of one of its streams supersedes a denoising forward; its pending pages move on."""
    cache = make_cache()
    a = cache.open_session("a")
    commit_chunk(a)
    old = a.prepare_forward(BOTH, CHUNK, commit_current=False)
    run_layers(old.layers, 2, seed=10)
    new = a.prepare_forward(("cond",), CHUNK, commit_current=False)  # another context, same cond pages
    assert new is not old and a.open_forward("uncond") is None
    run_layers(new.layers, 1, seed=20)
    assert_refused(cache, old.layers, 2)
    new.commit()


def test_lru_evicted_context_cannot_write_into_reallocated_pages() -> None:
    cache = KVCache(SPEC, num_pages=4, backend="reference", max_forward_contexts=1)
    a, b = cache.open_session("a"), cache.open_session("b")
    commit_chunk(a, ("cond",))  # pages 0, 1
    fwd = a.prepare_forward(("cond",), CHUNK, commit_current=False)
    run_layers(fwd.layers, 1, seed=10)
    fwd.commit()  # a denoising forward: its pending pages stay reserved ...
    pending = {p for chunk in a.pending_chunks("cond") for p in chunk}
    a.abort("cond")  # ... until dropped
    commit_chunk(b, ("cond",), seed=20)  # a new context (the LRU releases a's) on a's old pending pages
    assert set(pages_of(b, "cond")) == pending
    assert cache.num_forward_contexts == 1 and fwd.released
    assert_refused(cache, fwd.layers, 1, errors=RELEASED)


def test_finished_forward_cannot_write_into_fork_shared_pages() -> None:
    cache = make_cache()
    a = cache.open_session("a")
    commit_chunk(a)
    with a.prepare_forward(BOTH, CHUNK, commit_current=True) as fwd:
        run_layers(fwd.layers, 2, seed=10)
    child = a.fork("child")
    shared = pages_of(child, "cond") + pages_of(child, "uncond")
    assert shared == pages_of(a, "cond") + pages_of(a, "uncond")
    assert all(cache.allocator.refcount(p) == 2 for p in shared)
    assert_refused(cache, fwd.layers, 2)


# ---------------------------------------------------------------------------- (b) abort inside the block
def test_abort_inside_the_with_block_stops_the_model() -> None:
    cache = make_cache()
    a = cache.open_session("a")
    commit_chunk(a)
    before = bookkeeping(cache, ordered=False)
    history = bits(cache.pool.kv[:, :, pages_of(a, "cond") + pages_of(a, "uncond")])
    kv = None
    with pytest.raises(ForwardFinishedError), a.prepare_forward(BOTH, CHUNK, commit_current=True) as fwd:
        for i, layer in enumerate(fwd.layers):  # the model keeps running after the abort
            chunk_attention(*tensors(2, fill=float(i + 1)), layer)
            if i == 0:
                fwd.abort()
                kv = bits(cache.pool.kv)
    assert torch.equal(bits(cache.pool.kv), kv), "layer 1 wrote after the abort"
    assert bookkeeping(cache, ordered=False) == before
    assert torch.equal(bits(cache.pool.kv[:, :, pages_of(a, "cond") + pages_of(a, "uncond")]), history)
    commit_chunk(a, seed=3)  # the session goes on
    assert a.committed_chunks("cond") == 2


# ---------------------------------------------------------------------------- (c) compiled code
def _compiled_setup(backend):
    torch.manual_seed(0)
    model = TinyStreamingModel().eval()
    spec = model.spec(CHUNK, 2, 1, 2)
    cache = KVCache(spec, num_pages=64, backend="reference")
    state = cache.open_session("s")
    for branch in spec.branches:
        populate_cross_attention(state, branch, [blk.cross for blk in model.blocks], torch.randn(5, model.context_dim))
    return model, cache, state, torch.compile(model, backend=backend, fullgraph=True)


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_model_refuses_finished_forwards() -> None:
    """inductor, fullgraph: the op's runtime check fires inside compiled code, before any write."""
    counter = CompileCounterWithBackend("inductor")
    model, cache, state, compiled = _compiled_setup(counter)
    x = torch.randn(2, CHUNK, model.dim)
    with torch.no_grad():
        with state.prepare_forward(BOTH, CHUNK, commit_current=True) as fwd:
            compiled(x, fwd.layers)
        kv = bits(cache.pool.kv)
        with pytest.raises(ForwardFinishedError):  # committed
            compiled(x, fwd.layers)
        assert torch.equal(bits(cache.pool.kv), kv)
        fwd = state.prepare_forward(BOTH, CHUNK, commit_current=True)
        fwd.abort()
        kv = bits(cache.pool.kv)
        with pytest.raises(ForwardFinishedError):  # aborted
            compiled(x, fwd.layers)
        assert torch.equal(bits(cache.pool.kv), kv)
        fwd = state.prepare_forward(BOTH, CHUNK, commit_current=True)
        state.reset(keep_cross_attention=("text",))
        with pytest.raises(ForwardFinishedError):  # reset
            compiled(x, fwd.layers)
        assert torch.equal(bits(cache.pool.kv), kv)
        with state.prepare_forward(BOTH, CHUNK, commit_current=True) as fwd:  # valid again: same graph
            compiled(x, fwd.layers)
    assert state.committed_chunks("cond") == 1
    assert counter.frame_count == 1


@pytest.mark.usefixtures("fresh_dynamo")
def test_rollout_with_finish_checks_compiles_to_one_frame() -> None:
    counter = CompileCounter()
    model, cache, state, compiled = _compiled_setup(counter)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for chunk in range(6):  # past the window: evictions
            for step in range(3):
                commit = step == 2
                x = torch.randn(2, CHUNK, model.dim, generator=g)
                with state.prepare_forward(BOTH, CHUNK, commit_current=commit) as fwd:
                    compiled(x, fwd.layers)
                    if chunk == 3 and step == 1:
                        fwd.abort()  # a finish check inside the block
                        with pytest.raises(ForwardFinishedError):
                            compiled(x, fwd.layers)
                kv = bits(cache.pool.kv)
                with pytest.raises(ForwardFinishedError):
                    compiled(x, fwd.layers)
                assert torch.equal(bits(cache.pool.kv), kv)
    assert state.committed_chunks("cond") == 6
    assert counter.frame_count == 1, f"expected one compiled frame, got {counter.frame_count}"


# ---------------------------------------------------------------------------- (d) isolation
def test_nan_in_another_sessions_page0_does_not_reach_a_batched_stream() -> None:
    """Reference backend pads short streams with slot 0: session A's NaN/Inf there must not leak into B."""
    cache = make_cache()
    a, b = cache.open_session("a"), cache.open_session("b")
    with a.prepare_forward(("cond",), 2 * CHUNK, commit_current=True) as fwd:
        for layer in fwd.layers:
            q, k, v = tensors(1, 2 * CHUNK)
            k[...] = float("nan")
            v[...] = float("inf")
            chunk_attention(q, k, v, layer)
    assert pages_of(a, "cond")[0] == 0
    commit_chunk(b, ("cond",), seed=1)  # fewer keys than A: B's rows are padded
    q, k, v = tensors(2, seed=2)
    with cache.prepare_forward([(a, "cond"), (b, "cond")], CHUNK, commit_current=False) as fwd:
        batched = [chunk_attention(q, k, v, layer)[1] for layer in fwd.layers]
    alone_cache = make_cache()
    alone = alone_cache.open_session("b")
    commit_chunk(alone, ("cond",), seed=1)
    with alone.prepare_forward(("cond",), CHUNK, commit_current=False) as fwd:
        expected = [chunk_attention(q[1:], k[1:], v[1:], layer)[0] for layer in fwd.layers]
    for got, want in zip(batched, expected):
        assert torch.isfinite(got).all(), "session A's NaN/Inf reached session B"
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------- (e) atomic batched commit
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("how", ["commit_paged_context", "with"])
def test_batched_commit_is_atomic_when_interrupted_between_streams(monkeypatch, exc, how: str) -> None:
    """A commit that raises between the streams commits neither, and finishes the forward (aborted: issue 24)
    instead of leaving it open for every later forward to trip over."""
    cache = make_cache()
    s = cache.open_session("s")
    for i in range(3):
        commit_chunk(s, seed=i)  # sink + full window: the next commit evicts
    before_forward = bookkeeping(cache, ordered=False)
    fwd = s.prepare_forward(BOTH, CHUNK, commit_current=True)
    run_layers(fwd.layers, 2, seed=10)
    kv = bits(cache.pool.kv)
    history = [p for branch in BOTH for p in pages_of(s, branch)]
    calls = []
    real_commit = BranchHistory.plan_commit  # the per-stream commit computation

    def flaky(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise exc("injected between the two streams' commits")
        return real_commit(self, *args, **kwargs)

    monkeypatch.setattr(BranchHistory, "plan_commit", flaky)
    with pytest.raises(exc, match="injected") as raised:
        if how == "with":
            with fwd:
                pass
        else:
            s.commit_paged_context("cond")
    if exc is RuntimeError:  # a library error that names the cause (chained); Ctrl-C stays a KeyboardInterrupt
        assert isinstance(raised.value, CommitFailedError) and isinstance(raised.value.__cause__, RuntimeError)
    assert len(calls) == 2
    assert s.open_forward("cond") is None and s.open_forward("uncond") is None, "the failed commit left it open"
    assert fwd.status == "aborted"
    assert bookkeeping(cache, ordered=False) == before_forward, "one stream committed without the other"
    assert torch.equal(bits(cache.pool.kv)[:, :, history], kv[:, :, history])
    cache.allocator.check_invariants()
    monkeypatch.undo()
    commit_chunk(s, seed=11)  # the next forward runs (no PendingContextError) and commits both
    assert s.committed_chunks("cond") == s.committed_chunks("uncond") == 4
    assert s.open_forward("cond") is None


def test_sigint_during_a_batched_commit_waits_until_both_streams_are_committed(monkeypatch) -> None:
    cache = make_cache()
    s = cache.open_session("s")
    for i in range(3):
        commit_chunk(s, seed=i)
    real_apply = BranchHistory.apply_commit
    applied = []

    def apply_with_ctrl_c(self, result):
        if not applied:
            os.kill(os.getpid(), signal.SIGINT)
            sum(range(1000))  # give the interpreter a few bytecodes to run the handler
        applied.append(self)
        return real_apply(self, result)

    monkeypatch.setattr(BranchHistory, "apply_commit", apply_with_ctrl_c)
    fwd = s.prepare_forward(BOTH, CHUNK, commit_current=True)
    run_layers(fwd.layers, 2)
    with pytest.raises(KeyboardInterrupt):
        s.commit_paged_context("cond")
    assert len(applied) == 2
    assert s.committed_chunks("cond") == s.committed_chunks("uncond") == 4
    assert s.open_forward("cond") is None and s.open_forward("uncond") is None
    cache.allocator.check_invariants()
    assert cache.allocator.num_used == 2 * 3 * SPEC.pages_per_chunk  # sink + window per branch


def test_deferred_interrupts_holds_sigint_until_the_block_ends() -> None:
    from ardiff_modules.forward import deferred_interrupts

    previous = signal.getsignal(signal.SIGINT)
    reached = []
    with pytest.raises(KeyboardInterrupt), deferred_interrupts():
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(10_000))  # the handler runs here, inside the block
        reached.append("end of block")
    assert reached == ["end of block"]
    assert signal.getsignal(signal.SIGINT) is previous


# ---------------------------------------------------------------------------- (f) argument holes
def test_generator_of_streams_is_prepared_and_committed() -> None:
    cache = make_cache()
    a, b = cache.open_session("a"), cache.open_session("b")
    with cache.prepare_forward(((s, "cond") for s in (a, b)), CHUNK, commit_current=True) as fwd:
        assert fwd.num_streams == 2
        run_layers(fwd.layers, 2)
    assert a.committed_chunks("cond") == b.committed_chunks("cond") == 1
    assert cache.allocator.num_used == 2 * SPEC.pages_per_chunk


@pytest.mark.parametrize("value", ["no", 1, None])
def test_commit_current_must_be_a_bool(value) -> None:
    cache = make_cache()
    s = cache.open_session("s")
    before = bookkeeping(cache)
    with pytest.raises(SpecError, match="commit_current"):
        s.prepare_forward(BOTH, CHUNK, commit_current=value)
    with pytest.raises(SpecError, match="commit_current"):
        cache.prepare_forward([(s, "cond")], CHUNK, value)
    assert bookkeeping(cache) == before


def test_branches_as_a_set_raise() -> None:
    cache = make_cache()
    s = cache.open_session("s")
    before = bookkeeping(cache)
    with pytest.raises(SpecError):
        s.prepare_forward({"cond", "uncond"}, CHUNK)
    with pytest.raises(SpecError):
        cache.prepare_forward({(s, "cond"), (s, "uncond")}, CHUNK)
    with pytest.raises(SpecError):
        s.fork(branches={"cond"})
    assert bookkeeping(cache) == before and cache.sessions.keys() == {"s"}


def test_fork_with_one_branch_name_forks_only_that_branch() -> None:
    cache = make_cache()
    s = cache.open_session("s")
    for branch in BOTH:
        s.populate_cross_attention(branch, "text", [(torch.ones(3, 2, 4), torch.ones(3, 2, 4))] * 2)
    commit_chunk(s)
    child = s.fork(branches="cond")
    assert child.visible_chunks("cond") == s.visible_chunks("cond")
    assert child.committed_chunks("cond") == 1
    assert child.visible_chunks("uncond") == () and child.committed_chunks("uncond") == 0
    assert child.is_cross_attention_populated("cond", "text")
    assert not child.is_cross_attention_populated("uncond", "text")


def test_share_cross_attention_from_another_cache_raises() -> None:
    cache, other_cache = make_cache(), make_cache()
    s, other = cache.open_session("s"), other_cache.open_session("o")
    other.populate_cross_attention("cond", "text", [(torch.ones(3, 2, 4), torch.ones(3, 2, 4))] * 2)
    with pytest.raises(SpecError):
        s.share_cross_attention_from(other, "text", "cond")
    assert not s.is_cross_attention_populated("cond", "text")


@pytest.mark.parametrize("streams", ["none", "none-second", "none-session"])
def test_none_stream_raises(streams: str) -> None:
    cache = make_cache()
    s = cache.open_session("s")
    before = bookkeeping(cache)
    bad = {"none": [None], "none-second": [(s, "cond"), None], "none-session": [(None, "cond")]}[streams]
    with pytest.raises(SpecError):
        cache.prepare_forward(bad, CHUNK)
    assert bookkeeping(cache) == before


@pytest.mark.parametrize("pending_chunks", [0, -1])
def test_admission_rejects_non_positive_pending_chunks(pending_chunks: int) -> None:
    cache = make_cache()
    with pytest.raises(SpecError, match="pending_chunks"):
        cache.sessions_that_fit(pending_chunks=pending_chunks)
    with pytest.raises(SpecError, match="pending_chunks"):
        cache.can_admit(1, pending_chunks=pending_chunks)
    with pytest.raises(SpecError, match="pending_chunks"):
        cache.admit_session(pending_chunks=pending_chunks)
    assert cache.sessions == {}


def test_failed_plan_leaves_peak_and_forward_contexts_unchanged(monkeypatch) -> None:
    cache = make_cache()
    a, b = cache.open_session("a"), cache.open_session("b")
    commit_chunk(a)
    peak, contexts, before = cache.stats().peak_pages_used, cache.num_forward_contexts, bookkeeping(cache)

    def broken_plan(request, previous):
        raise RuntimeError("injected plan failure")

    monkeypatch.setattr(cache.backend, "plan", broken_plan)
    with pytest.raises(RuntimeError, match="injected"):
        cache.prepare_forward([(a, "cond"), (b, "cond"), (b, "uncond")], 2 * CHUNK, commit_current=True)
    assert cache.stats().peak_pages_used == peak
    assert cache.num_forward_contexts == contexts
    assert bookkeeping(cache) == before
    monkeypatch.undo()
    commit_chunk(b)  # and the cache still works
    assert cache.num_forward_contexts == contexts + 1


def test_token_mask_hiding_every_key_of_a_query_gives_zeros() -> None:
    cache = make_cache()
    s = cache.open_session("s")
    commit_chunk(s)
    q, k, v = tensors(2, seed=7)
    with s.prepare_forward(BOTH, CHUNK, commit_current=False) as fwd:
        plain = chunk_attention(q, k, v, fwd.layers[0])
    max_keys = len(pages_of(s, "cond")) * SPEC.page_size + CHUNK
    mask = torch.ones(2, CHUNK, max_keys, dtype=torch.bool)
    mask[0, 1] = False
    mask[1, 3] = False
    with s.prepare_forward(BOTH, CHUNK, commit_current=False, token_mask=mask) as fwd:
        masked = chunk_attention(q, k, v, fwd.layers[0])
    assert torch.isfinite(masked).all()
    assert torch.equal(masked[0, 1], torch.zeros_like(masked[0, 1]))
    assert torch.equal(masked[1, 3], torch.zeros_like(masked[1, 3]))
    keep = torch.ones(2, CHUNK, dtype=torch.bool)
    keep[0, 1] = keep[1, 3] = False
    torch.testing.assert_close(masked[keep], plain[keep])


# ---------------------------------------------------------------------------- (g) KVCache.close
def test_cache_close_frees_everything_is_idempotent_and_refuses_later_calls() -> None:
    cache = make_cache()
    a = cache.open_session("a")
    a.populate_cross_attention("cond", "text", [(torch.ones(3, 2, 4), torch.ones(3, 2, 4))] * 2)
    commit_chunk(a)
    child = a.fork("child")
    fwd = cache.prepare_forward([(a, "cond"), (child, "uncond")], CHUNK, commit_current=True)  # in flight
    run_layers(fwd.layers, 2)
    cache.close()
    assert cache.is_closed and a.is_closed and child.is_closed
    assert cache.sessions == {} and cache.num_forward_contexts == 0
    assert cache.allocator.num_free == cache.allocator.num_pages
    cache.allocator.check_invariants()
    assert cache.pool.kv.numel() == 0, "the pool's memory was not released"
    cache.close()  # idempotent
    assert cache.is_closed
    for call in (
        lambda: cache.open_session(),
        lambda: cache.admit_session(),
        lambda: cache.prepare_forward([(a, "cond")], CHUNK),
        lambda: a.reset(),
    ):
        with pytest.raises(CacheClosedError):
            call()
    with pytest.raises(RELEASED):
        chunk_attention(*tensors(2), fwd.layers[0])
    fwd.commit()  # finished already: nothing to do
    assert cache.allocator.num_free == cache.allocator.num_pages


def test_cache_is_a_context_manager() -> None:
    with make_cache() as cache:
        s = cache.open_session()
        commit_chunk(s)
    assert cache.is_closed and s.is_closed and cache.allocator.num_free == cache.allocator.num_pages
    with pytest.raises(RuntimeError, match="body failed"), make_cache() as failing:
        commit_chunk(failing.open_session())
        raise RuntimeError("body failed")
    assert failing.is_closed and failing.allocator.num_free == failing.allocator.num_pages


# ---------------------------------------------------------------------------- (h) check_finite
def _commit_with_bad_value(state: KVState, bad: float) -> None:
    """A batched committing forward whose uncond stream writes one non-finite value, in the last layer."""
    with state.prepare_forward(BOTH, CHUNK, commit_current=True) as fwd:
        for i, layer in enumerate(fwd.layers):
            q, k, v = tensors(2, seed=100 + i)
            if i == len(fwd.layers) - 1:
                v[1, 2, 0, 3] = bad
            chunk_attention(q, k, v, layer)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_check_finite_aborts_a_non_finite_commit(bad: float) -> None:
    cache = make_cache(check_finite=True)
    s = cache.open_session("s")
    commit_chunk(s)
    history = pages_of(s, "cond") + pages_of(s, "uncond")
    before, kv = bookkeeping(cache, ordered=False), bits(cache.pool.kv[:, :, history])
    with pytest.raises(NonFiniteKVError):
        _commit_with_bad_value(s, bad)
    assert bookkeeping(cache, ordered=False) == before  # both streams aborted, history as it was
    assert torch.equal(bits(cache.pool.kv[:, :, history]), kv)
    cache.allocator.check_invariants()
    commit_chunk(s, seed=9)  # the next forward works
    assert s.committed_chunks("cond") == s.committed_chunks("uncond") == 2


def test_check_finite_is_off_by_default() -> None:
    cache = make_cache()
    s = cache.open_session("s")
    commit_chunk(s)
    _commit_with_bad_value(s, float("nan"))
    assert s.committed_chunks("cond") == s.committed_chunks("uncond") == 2


def test_abort_if_non_finite_called_before_the_commit() -> None:
    """The public check (what a distributed forward runs before its vote): finite K/V change nothing and the
    forward still commits; NaN aborts every stream of the forward at once, history and pool bytes unchanged."""
    cache = make_cache()  # check_finite off: only the explicit call checks
    s = cache.open_session("s")
    commit_chunk(s)
    other = make_cache()
    with s.prepare_forward(BOTH, CHUNK, commit_current=True) as fwd:
        for i, layer in enumerate(fwd.layers):
            chunk_attention(*tensors(2, seed=100 + i), layer)
        cache.abort_if_non_finite(fwd.transaction)
        with pytest.raises(SpecError, match="expected a ForwardTransaction"):
            cache.abort_if_non_finite(fwd)  # type: ignore[arg-type]
        with pytest.raises(SpecError, match="of another cache"):
            other.abort_if_non_finite(fwd.transaction)
        assert fwd.transaction.is_open
    assert s.committed_chunks("cond") == s.committed_chunks("uncond") == 2
    history = pages_of(s, "cond") + pages_of(s, "uncond")
    before, kv = bookkeeping(cache, ordered=False), bits(cache.pool.kv[:, :, history])
    fwd = s.prepare_forward(BOTH, CHUNK, commit_current=True)
    for i, layer in enumerate(fwd.layers):
        q, k, v = tensors(2, seed=200 + i)
        if i == 0:
            k[1, 0, 1, 2] = float("nan")  # the uncond stream only: both streams must abort
        chunk_attention(q, k, v, layer)
    with pytest.raises(NonFiniteKVError, match=r"stream\(s\) \[\('s', 'uncond'\)\]"):
        cache.abort_if_non_finite(fwd.transaction)
    assert not fwd.transaction.is_open
    cache.abort_if_non_finite(fwd.transaction)  # closed: a no-op
    fwd.commit()  # finished already: nothing to do
    assert bookkeeping(cache, ordered=False) == before
    assert torch.equal(bits(cache.pool.kv[:, :, history]), kv)
    cache.allocator.check_invariants()
    commit_chunk(s, seed=9)
    assert s.committed_chunks("cond") == s.committed_chunks("uncond") == 3


# ---------------------------------------------------------------------------- (j) partial forwards (issue 24)
def _stale_pages_setup() -> tuple[KVCache, KVState, set[int]]:
    """Session ``a`` committed one chunk of constant K/V (1e3) in every layer and closed: its pages are free
    but still hold its K/V. Returns the cache, a fresh session ``b`` and those pages."""
    cache = make_cache(num_pages=4)  # one chunk of both branches: b's pending pages are a's old ones
    a = cache.open_session("a")
    with a.prepare_forward(BOTH, CHUNK, commit_current=True) as fwd:
        for layer in fwd.layers:
            chunk_attention(*tensors(2, fill=1e3), layer)
    stale = {p for branch in BOTH for p in pages_of(a, branch)}
    a.close()
    return cache, cache.open_session("b"), stale


@pytest.mark.parametrize("how", ["with", "ctx.commit", "commit_paged_context"])
def test_a_forward_that_ran_only_some_layers_is_not_committed(how: str) -> None:
    """Unwritten layers of the pending pages hold a closed session's K/V: committing would make them b's history."""
    cache, b, stale = _stale_pages_setup()
    fwd = b.prepare_forward(BOTH, CHUNK, commit_current=True)
    assert {p for branch in BOTH for chunk in b.pending_chunks(branch) for p in chunk} == stale
    chunk_attention(*tensors(2, seed=3), fwd.layers[0])  # layer 1 never runs (an early return, a removed hook)
    with pytest.raises(IncompleteForwardError, match=r"all 2 layers.*layer\(s\) 1\b") as raised:
        if how == "with":
            with fwd:
                pass
        elif how == "ctx.commit":
            fwd.commit()
        else:
            b.commit_paged_context("uncond")
    assert isinstance(raised.value, RuntimeError) and "aborted" in str(raised.value)
    assert fwd.status == "aborted" and b.open_forward("cond") is None
    assert b.committed_chunks("cond") == b.committed_chunks("uncond") == 0 and cache.allocator.num_used == 0
    cache.allocator.check_invariants()
    commit_chunk(b, seed=4)  # a complete forward commits; its history holds its own K/V, not a's
    for branch in BOTH:
        for page in pages_of(b, branch):
            assert not bool((cache.pool.kv[:, :, page] == 1e3).any()), "a closed session's K/V in b's history"


def test_a_forward_where_no_layer_ran_is_not_committed() -> None:
    cache, b, _ = _stale_pages_setup()
    with pytest.raises(IncompleteForwardError, match=r"got 0 \(no write from layer\(s\) 0-1\)"):
        with b.prepare_forward(BOTH, CHUNK, commit_current=True):
            pass
    assert b.committed_chunks("cond") == 0 and cache.allocator.num_used == 0


def test_a_denoising_forward_may_run_some_layers() -> None:
    """Nothing of a denoising forward becomes history: a partial one completes (the commit rewrites all)."""
    cache = make_cache()
    s = cache.open_session("s")
    with s.prepare_forward(BOTH, CHUNK, commit_current=False) as fwd:
        chunk_attention(*tensors(2), fwd.layers[0])
    assert fwd.status == "completed"
    commit_chunk(s)
    assert s.committed_chunks("cond") == 1


def test_a_recache_that_ran_only_some_layers_keeps_the_valid_old_window() -> None:
    cache = make_cache()
    s = cache.open_session("s")
    for i in range(4):
        commit_chunk(s, seed=i)  # sink + window 2 (one chunk evicted)
    visible = {b: s.visible_chunks(b) for b in BOTH}
    history = [p for b in BOTH for p in pages_of(s, b)]
    kv, free = bits(cache.pool.kv)[:, :, history], sorted(cache.allocator.free_pages())
    with pytest.raises(IncompleteForwardError):
        with s.prepare_recache(BOTH) as fwd:
            q, k, v = tensors(2, fwd.seq_len, seed=9)
            chunk_attention(q, k, v, fwd.layers[0])
    assert {b: s.visible_chunks(b) for b in BOTH} == visible, "the old window was thrown away"
    assert torch.equal(bits(cache.pool.kv)[:, :, history], kv)
    assert sorted(cache.allocator.free_pages()) == free and s.open_forward("cond") is None
    cache.allocator.check_invariants()


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compiled_forward_that_skips_a_layer_is_not_committed() -> None:
    """The compiled write path (``kv_write_slots`` gate + in-graph ``index_put_``) records writes too."""
    cache, b, _ = _stale_pages_setup()
    counter = CompileCounter()

    @torch.compile(backend=counter, fullgraph=True)
    def first_layers(q, k, v, layers):
        return [chunk_attention(q, k, v, layer) for layer in layers]

    q, k, v = tensors(2, seed=5)
    with pytest.raises(IncompleteForwardError):
        with b.prepare_forward(BOTH, CHUNK, commit_current=True) as fwd:
            first_layers(q, k, v, fwd.layers[:1])
    assert b.committed_chunks("cond") == 0 and cache.allocator.num_used == 0
    with b.prepare_forward(BOTH, CHUNK, commit_current=True) as fwd:
        first_layers(q, k, v, fwd.layers[:1])
        first_layers(q, k, v, fwd.layers[1:])
    assert b.committed_chunks("cond") == 1


# ---------------------------------------------------------------------------- (i) backward
def test_backward_through_chunk_attention_raises_inference_only() -> None:
    cache = make_cache()
    s = cache.open_session("s")
    with s.prepare_forward(BOTH, CHUNK, commit_current=False) as fwd:
        q, k, v = (t.requires_grad_() for t in tensors(2))
        out = chunk_attention(q, k, v, fwd.layers[0])
        with pytest.raises(InferenceOnlyError):
            out.sum().backward()


def test_backward_through_chunk_self_attention_module_raises_inference_only() -> None:
    """The common accident: a model in training mode (parameters require grad), no torch.no_grad()."""
    cache = make_cache()
    s = cache.open_session("s")
    attn = ChunkSelfAttention(HEADS * DIM, HEADS, qk_norm="head")
    with s.prepare_forward(BOTH, CHUNK, commit_current=False) as fwd:
        out = attn(torch.randn(2, CHUNK, HEADS * DIM), fwd.layers[0])
        with pytest.raises(InferenceOnlyError):
            out.sum().backward()


def test_deferred_sigint_with_the_default_disposition_still_terminates() -> None:
    """SIG_DFL (no Python handler): a Ctrl-C held during an update still ends the process after it."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import os, signal
        from ardiff_modules.forward import deferred_interrupts
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        with deferred_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            print("inside", flush=True)
        print("still alive", flush=True)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert "inside" in done.stdout and "still alive" not in done.stdout
    assert done.returncode != 0
