"""Caches with retention groups after failures: every lane ends in the same state (offsets, pending chunks, open
forwards).

Each test here began as the regression test of one fix of the removed ``HeadGroupedKVCache`` (one ``KVCache``
per part, driven side by side): a refusal by a later part, a build or the grouped host work failing after some
parts built, an open grouped forward evicted, ``abort()`` keeping pending pages, a commit of a forward one part
finished alone, a Ctrl-C or a failure between two parts' commits, a commit racing a prepare in another thread,
the misuse errors of ``reset``, and what an admission refusal reports. The lanes of one ``KVCache`` are one
``ForwardTransaction``, so parts can no longer drift apart; each test now checks the same failure on the lanes:
nothing changes in any lane, or every lane commits / aborts together (a lane context's commit or abort is the
whole forward's).
"""

from __future__ import annotations

import signal
import threading

import pytest
import torch

import ardiff_modules as am
import ardiff_modules.forwards.manager as manager_module
import ardiff_modules.forwards.manager as manager
from tests.heads.oracle import (
    PerHeadOracle,
    assert_lanes_hold_newest,
    grouped,
    lane_committed,
    lane_open,
    one_forward,
    random_qkv,
    session_budget,
)
from tests.heads.test_head_oracle import make_spec

HEADS = am.HeadRetention({"l": (0, 1), "g": (1, 2)}, [["l", "g"], ["g", "l"]])


def make_cache(sessions: int = 3, **kwargs: object) -> tuple[am.KVCacheSpec, am.KVCache]:
    spec = make_spec(layers=2, kv_heads=2)
    kwargs.setdefault("backend", "reference")
    spec_heads = grouped(spec, HEADS)
    budget = session_budget(spec_heads, sessions)
    return spec, am.KVCache(spec_heads, budget_bytes=budget, **kwargs)  # type: ignore[arg-type]


def snapshot(cache: am.KVCache, order: bool = True) -> list[object]:
    """Every lane's free queue (in order; as a set when not ``order``), each session's pending pages and offsets
    in every lane, and which forwards are open."""
    out: list[object] = [
        lane.allocator.free_pages() if order else sorted(lane.allocator.free_pages()) for lane in cache._lanes
    ]
    for sid, session in sorted(cache.sessions.items()):
        for i, branches in enumerate(session._lane_branches):
            for b, pages in sorted(branches.items()):
                out.append((sid, i, b, pages.history, pages.pending, pages.token_offset,
                            getattr(pages.transaction, "is_open", False)))
    return out


def run_layers(fwd: am.ForwardContext, gen: torch.Generator, streams: int = 2
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer of ``fwd`` over random q/k/v; returns each layer's ``(k, v)``."""
    written = []
    for layer in fwd.layers:
        q, k, v = random_qkv(streams, fwd.seq_len, 2, 2, 8, gen, torch.float32)
        am.chunk_attention(q, k, v, layer)
        written.append((k, v))
    return written


def assert_lanes_agree(cache: am.KVCache) -> None:
    for lane in cache._lanes:
        lane.allocator.check_invariants()
    for session in cache.sessions.values():
        for b in session.kv_branch_names:
            lanes = session._lane_pages(b)
            assert len({p.token_offset for p in lanes}) == 1
            assert len({p.committed_chunks for p in lanes}) == 1
            assert len({len(p.pending) for p in lanes}) == 1
            assert len({id(p.transaction) if getattr(p.transaction, "is_open", False) else None for p in lanes}) == 1


def test_a_later_lane_out_of_pages_leaves_the_open_denoising_forward_in_every_lane() -> None:
    spec, cache = make_cache(sessions=1)
    s = cache.open_session()
    fwd = s.prepare_forward(None, 4)  # denoising, open: its pending pages are reused by the next forward
    last = cache._lanes[-1].allocator
    hog = last.allocate(last.num_free - 1)
    before = snapshot(cache)
    with pytest.raises(am.CapacityError):
        s.prepare_forward(None, 8, commit_current=True)  # two chunks: lane 0 fits, the last lane does not
    assert snapshot(cache) == before and fwd.status == "open"
    last.decref(hog)
    # The open forward still runs and commits (every lane), equal to the oracle afterwards.
    gen = torch.Generator().manual_seed(0)
    run_layers(fwd, gen)
    fwd.commit()
    oracle = PerHeadOracle(HEADS)
    got, want = one_forward(s, oracle, spec.branches, 4, True, gen, spec)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def fail_in_lane(monkeypatch: pytest.MonkeyPatch, cache: am.KVCache, lane: int, error: BaseException,
                 before: object = None) -> None:
    """Planning lane ``lane`` raises ``error`` (after the lanes before it reserved, laid out and planned);
    ``before()`` runs first."""
    real = manager_module._plan_request

    def plan_request(layout: object, request: object, which: object, dtype: object) -> object:
        if which.index == lane:  # type: ignore[attr-defined]
            if before is not None:
                before()  # type: ignore[operator]
            else:
                raise error
        return real(layout, request, which, dtype)  # type: ignore[arg-type]

    monkeypatch.setattr(manager_module, "_plan_request", plan_request)


def test_a_build_failing_in_a_later_lane_rolls_every_lane_back(monkeypatch: pytest.MonkeyPatch) -> None:
    _, cache = make_cache()
    a, b = cache.open_session("a"), cache.open_session("b")
    gen = torch.Generator().manual_seed(1)
    with a.prepare_forward(None, 4, commit_current=True) as fwd:
        run_layers(fwd, gen)
    before = snapshot(cache)
    fail_in_lane(monkeypatch, cache, 1, RuntimeError("plan() failed"))
    with pytest.raises(RuntimeError, match="plan"):
        cache.prepare_forward([(a, "cond"), (b, "uncond")], 8, commit_current=True)
    assert snapshot(cache) == before  # lane 0's reservation undone exactly: pages, free order, nothing open
    # A denoising forward open over a/cond and b/cond: a failed build over one of its streams (or over all of them)
    # changes nothing in any lane -- the open forward stays open everywhere, with its pending chunks.
    monkeypatch.undo()
    open_fwd = cache.prepare_forward([(a, "cond"), (b, "cond")], 4)
    before = snapshot(cache)
    fail_in_lane(monkeypatch, cache, 1, RuntimeError("plan() failed"))
    for streams in ([(a, "cond")], [(a, "cond"), (b, "cond")]):
        with pytest.raises(RuntimeError, match="plan"):
            cache.prepare_forward(streams, 8)
        assert snapshot(cache) == before and open_fwd.status == "open"
        assert all(len(st.pending_chunks("cond")) == 1 for st in (a, b))
        assert_lanes_agree(cache)
    monkeypatch.undo()
    assert a.prepare_forward(None, 4).status == "open"
    assert open_fwd.status == "superseded"  # a/cond's next forward superseded it (b/cond's pending chunk kept)
    assert lane_open(b, "cond") == [False, False] and [len(p.pending) for p in b._lane_pages("cond")] == [1, 1]
    assert_lanes_agree(cache)


def test_a_failure_in_the_forwards_host_work_leaves_every_lane_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    _, cache = make_cache()
    s = cache.open_session()
    before = snapshot(cache)

    def fail(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(manager_module, "_stack_cross", fail)
    with pytest.raises(KeyboardInterrupt):
        s.prepare_forward(None, 4, commit_current=True)
    monkeypatch.undo()
    assert snapshot(cache) == before  # no lane left with an open committing forward the session cannot see
    with s.prepare_forward(None, 4, commit_current=True) as fwd:
        run_layers(fwd, torch.Generator().manual_seed(2))
    assert lane_committed(s, "cond") == [1, 1]


def test_open_forwards_are_never_evicted_so_their_objects_stay() -> None:
    """max_forward_contexts=1, two forwards open: the cache keeps both contexts and their lane contexts (a new
    object would recompile a compiled model / recapture a CUDA graph)."""
    _, cache = make_cache(max_forward_contexts=1)
    a, b = cache.open_session("a"), cache.open_session("b")
    fa = a.prepare_forward(None, 4)
    lanes = fa._lanes
    b.prepare_forward(None, 4)
    again = a.prepare_forward(None, 4)
    assert again is fa and again._lanes == lanes and all(x is y for x, y in zip(again._lanes, lanes))
    # Once a session closes, its forwards (their lane contexts released) are dropped.
    a.close()
    assert fa._released and all(lane._released for lane in lanes)
    kept = cache._forwards.contexts()
    assert kept and all(not f._released and not any(lane._released for lane in f._lanes) for f in kept)


def test_abort_drops_the_pending_pages_denoising_forwards_kept_in_every_lane() -> None:
    spec, cache = make_cache()
    s = cache.open_session()
    gen = torch.Generator().manual_seed(3)
    oracle = PerHeadOracle(HEADS)
    one_forward(s, oracle, spec.branches, 4, True, gen, spec)
    history = s.pages_in_use()
    one_forward(s, oracle, spec.branches, 4, False, gen, spec)  # completed: pending pages kept for reuse
    assert s.pages_in_use() != history
    assert all(len(p.pending) == 1 for b in spec.branches for p in s._lane_pages(b))
    s.abort()
    assert s.pages_in_use() == history  # the kept pending chunks are released, in every lane
    assert all(not p.pending for b in spec.branches for p in s._lane_pages(b))
    assert_lanes_agree(cache)
    with pytest.raises(am.errors.UnknownBranchError):
        s.abort("nope")


def test_aborting_through_a_lane_context_aborts_the_whole_forward() -> None:
    """A lane context shares its forward's transaction: aborting it aborts every lane (history unchanged), and a
    later commit of the forward is a no-op on a finished forward."""
    _, cache = make_cache()
    s = cache.open_session()
    gen = torch.Generator().manual_seed(4)
    before = snapshot(cache, order=False)
    fwd = s.prepare_forward(None, 4, commit_current=True)
    run_layers(fwd, gen)
    fwd._lanes[0].abort()
    assert fwd.status == "aborted" and {lane.status for lane in fwd._lanes} == {"aborted"}
    fwd.commit()
    assert fwd.status == "aborted"
    assert lane_committed(s, "cond") == [0, 0]
    assert snapshot(cache, order=False) == before
    with pytest.raises(am.errors.ForwardFinishedError):
        run_layers(fwd, gen)


def test_a_ctrl_c_between_two_lanes_commits_waits_until_every_lane_committed(
    monkeypatch: pytest.MonkeyPatch, sigint_raises: None
) -> None:
    _, cache = make_cache()
    s = cache.open_session()
    first = cache._lanes[0].allocator
    real = first.decref

    def commit_then_interrupt(pages: object) -> list[int]:
        freed = real(pages)  # type: ignore[arg-type]
        signal.raise_signal(signal.SIGINT)  # arrives after lane 0's commit step, before lane 1's
        return freed

    with pytest.raises(KeyboardInterrupt), s.prepare_forward(None, 4, commit_current=True) as fwd:
        written = run_layers(fwd, torch.Generator().manual_seed(5))
        monkeypatch.setattr(first, "decref", commit_then_interrupt)
    monkeypatch.undo()
    assert lane_committed(s, "cond") == [1, 1]
    assert fwd.status == "committed"
    assert_lanes_hold_newest(cache, s, s.kv_branch_names, written)
    assert_lanes_agree(cache)


def test_a_commit_raising_in_a_later_lane_leaves_no_lane_open_or_committed(monkeypatch: pytest.MonkeyPatch) -> None:
    _, cache = make_cache()
    s = cache.open_session()
    before = snapshot(cache, order=False)

    def broken() -> object:
        raise RuntimeError("device lost")

    monkeypatch.setattr(s._lane_branches[1]["uncond"], "preview_commit", broken)
    fwd = s.prepare_forward(None, 4, commit_current=True)
    with pytest.raises(am.CommitFailedError, match="device lost"), fwd:
        run_layers(fwd, torch.Generator().manual_seed(6))
    assert fwd.status == "aborted" and all(not lane.is_active for lane in fwd._lanes)
    assert all(lane_open(s, b) == [False, False] for b in s.kv_branch_names)
    assert lane_committed(s, "cond") == lane_committed(s, "uncond") == [0, 0]
    assert snapshot(cache, order=False) == before
    assert_lanes_agree(cache)


def test_a_commit_in_another_thread_during_a_prepare_sees_the_forward_before_or_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Thread T commits the forward object while this thread prepares the next forward over the same streams
    (the same object), T reading its transaction while lane 1 plans: T finishes the forward it read (superseded
    by then: a no-op) once the prepare released the lock, and the new forward is open in every lane, never half
    begun."""
    _, cache = make_cache()
    s = cache.open_session()
    fwd = s.prepare_forward(None, 4)  # denoising, open
    real_finish = cache._forwards.finish_forward
    read = threading.Event()

    def finish(transaction: object, success: bool) -> None:
        read.set()  # T read the forward's transaction and now waits for the cache's lock
        real_finish(transaction, success)  # type: ignore[arg-type]

    monkeypatch.setattr(cache._forwards, "finish_forward", finish)
    threads: list[threading.Thread] = []

    def commit_meanwhile() -> None:
        threads.append(threading.Thread(target=fwd.commit))
        threads[0].start()
        assert read.wait(5)

    fail_in_lane(monkeypatch, cache, 1, RuntimeError(), before=commit_meanwhile)
    assert s.prepare_forward(None, 4) is fwd
    threads[0].join(5)
    assert not threads[0].is_alive()
    assert fwd.status == "open" and all(lane.status == "open" for lane in fwd._lanes)
    assert_lanes_agree(cache)
    monkeypatch.undo()
    fwd.commit()
    assert fwd.status == "completed" and all(lane_open(s, b) == [False, False] for b in s.kv_branch_names)
    assert_lanes_agree(cache)


def test_reset_misuse_is_refused_as_kvstate_refuses_it_and_changes_nothing() -> None:
    _, cache = make_cache()
    s = cache.open_session()
    fwd = s.prepare_forward(None, 4)
    before = snapshot(cache)
    with pytest.raises(am.errors.UnknownCacheError, match=r"expected names from \(\)"):
        s.reset(keep_cross_attention=["text"])
    with pytest.raises(am.SpecError, match="expected a collection of cache names, got 3"):
        s.reset(keep_cross_attention=3)  # type: ignore[arg-type]
    assert snapshot(cache) == before and fwd.status == "open"


def test_an_id_taken_refuses_open_and_fork_and_changes_no_lane() -> None:
    spec, cache = make_cache()
    s = cache.open_session("a")
    one_forward(s, PerHeadOracle(HEADS), spec.branches, 4, True, torch.Generator().manual_seed(7), spec)
    cache.open_session("x")
    before = snapshot(cache) + [sorted(cache.sessions)]
    with pytest.raises(am.SpecError, match="'x' which is already open"):
        cache.open_session("x")
    with pytest.raises(am.SpecError, match="'x' which is already open"):
        s.fork("x")
    assert snapshot(cache) + [sorted(cache.sessions)] == before
    assert sorted(cache.sessions) == ["a", "x"]


def test_admission_refusal_names_the_full_lane_and_its_unpromised_pages() -> None:
    _, cache = make_cache(sessions=1)
    cache.admit_session("a", recache=False)
    with pytest.raises(am.CapacityError, match=r"lane 'l/1h': admit_session: a session needs up to 8 pages, only 0 "
                                               r"are free") as info:
        cache.admit_session("b", recache=False)
    assert (info.value.needed, info.value.free) == (8, 0)
    assert sorted(cache.sessions) == ["a"]


def test_check_finite_runs_once_per_lane_before_any_lane_commits(monkeypatch: pytest.MonkeyPatch) -> None:
    """NaN K/V in the last lane: NonFiniteKVError, no lane committed; each lane's pending K/V read once."""
    spec, cache = make_cache(check_finite=True)
    s = cache.open_session()
    gen = torch.Generator().manual_seed(7)
    oracle = PerHeadOracle(HEADS)
    one_forward(s, oracle, spec.branches, 4, True, gen, spec)
    calls: list[int] = []
    real = manager.check_pending_finite  # what the pre-commit check calls, once per lane

    def counted(transaction: object, pool: object, lane: int = 0) -> None:
        calls.append(lane)
        real(transaction, pool, lane)  # type: ignore[arg-type]

    monkeypatch.setattr(manager, "check_pending_finite", counted)
    before = snapshot(cache)
    with pytest.raises(am.NonFiniteKVError):
        with s.prepare_forward(None, 4, commit_current=True) as fwd:
            for layer in fwd.layers:
                q, k, v = random_qkv(2, 4, 2, 2, 8, gen, torch.float32)
                if layer.layer_index == 1:
                    k[:, :, 0] = float("nan")  # layer 1's head 0 is in the last lane ("g" of layer 1)
                am.chunk_attention(q, k, v, layer)
    assert cache._lanes[-1].part.group == "g" and 1 in cache._lanes[-1].part.layers
    assert lane_committed(s, "cond") == [1] * len(cache._lanes)
    # the aborted forward's pending pages are free again (in the queue's order of an abort, as for a uniform cache)
    n = len(cache._lanes)
    assert [sorted(f) for f in snapshot(cache)[:n]] == [sorted(f) for f in before[:n]]
    assert sorted(calls) == sorted(set(calls)) and calls[-1] == n - 1, calls  # no lane checked twice
    calls.clear()
    one_forward(s, oracle, spec.branches, 4, True, gen, spec)  # a finite forward commits, each lane checked once
    assert sorted(calls) == list(range(n))


@pytest.mark.parametrize("how", ["lane context", "commit_paged_context", "finish_forward"])
def test_committing_through_any_handle_commits_every_lane(how: str) -> None:
    """Issue 41: committing one part of the removed grouped forward used to commit that part alone. A lane context,
    a session's ``commit_paged_context`` and the manager's ``finish_forward`` all reach the one transaction: every
    lane commits, its pool holding the forward's K/V, and later forwards run in step (equal to the oracle)."""
    spec, cache = make_cache()
    s = cache.open_session()
    gen = torch.Generator().manual_seed(8)
    oracle = PerHeadOracle(HEADS)
    one_forward(s, oracle, spec.branches, 4, True, gen, spec)
    with s.prepare_forward(None, 4, commit_current=True) as fwd:
        written = run_layers(fwd, gen)
        commit = {
            "lane context": fwd._lanes[0].commit,
            "commit_paged_context": lambda: s.commit_paged_context("cond"),
            "finish_forward": lambda: cache._forwards.finish_forward(fwd._lanes[1]._transaction, True),
        }[how]
        commit()
        assert fwd.status == "committed" and not fwd.is_active
    assert lane_committed(s, "cond") == lane_committed(s, "uncond") == [2, 2]
    assert_lanes_hold_newest(cache, s, spec.branches, written)
    assert_lanes_agree(cache)
    for b, stream in zip(spec.branches, range(2)):
        oracle.commit(b, [(k[stream], v[stream]) for k, v in written])
    got, want = one_forward(s, oracle, spec.branches, 4, True, gen, spec)  # later forwards run in step
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert lane_committed(s, "uncond") == [3, 3]


def test_commit_paged_context_after_a_lane_context_aborted_is_a_no_op() -> None:
    """Aborting through a lane context aborts the forward in every lane; the session's commit then finds nothing
    open (a no-op), and every lane is as before the forward."""
    _, cache = make_cache()
    s = cache.open_session()
    before = snapshot(cache, order=False)
    fwd = s.prepare_forward(None, 4, commit_current=True)
    run_layers(fwd, torch.Generator().manual_seed(9))
    fwd._lanes[0].abort()
    s.commit_paged_context("cond")
    assert fwd.status == "aborted" and lane_committed(s, "cond") == [0, 0]
    assert snapshot(cache, order=False) == before
    assert_lanes_agree(cache)
