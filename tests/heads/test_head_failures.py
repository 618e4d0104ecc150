"""Head-grouped caches after failures: every part ends in the same state (offsets, pending chunks, open forwards).

Each test here is the regression test of one fix: a refusal by a later part, a build or the grouped host
work failing after some parts built, an open grouped forward evicted, ``abort()`` keeping pending pages, a
commit of a forward one part finished alone, a Ctrl-C or a failure between two parts' commits, a commit
racing a prepare in another thread, the misuse errors of ``reset``, and what an admission refusal reports.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

import ardiff_modules as am
from tests.heads.oracle import PerHeadOracle, one_forward, random_qkv
from tests.heads.test_head_oracle import make_spec

HEADS = am.HeadRetention({"l": (0, 1), "g": (1, 2)}, [["l", "g"], ["g", "l"]])


def make_cache(**kwargs: object) -> tuple[am.KVCacheSpec, am.HeadGroupedKVCache]:
    spec = make_spec(layers=2, kv_heads=2)
    kwargs.setdefault("max_sessions", 3)
    return spec, am.HeadGroupedKVCache(spec, HEADS, backend="reference", **kwargs)


def snapshot(cache: am.HeadGroupedKVCache) -> list[object]:
    """Every part's free queue (in order), each session's pending pages and offsets, and which forwards are open."""
    out: list[object] = [c._allocator.free_pages() for c in cache.caches]
    for sid, session in sorted(cache.sessions.items()):
        for p, state in enumerate(session.parts):
            for b in state.kv_branch_names:
                forward = state._open_forward(b)
                out.append((sid, p, b, state.pending_chunks(b), state.token_offset(b), forward is not None))
    return out


def run_layers(fwd: am.HeadGroupedForward, gen: torch.Generator, streams: int = 2) -> None:
    for layer in fwd.layers:
        am.chunk_attention(*random_qkv(streams, fwd.seq_len, 2, 2, 8, gen, torch.float32), layer)


def assert_parts_agree(cache: am.HeadGroupedKVCache) -> None:
    for c in cache.caches:
        c._allocator.check_invariants()
    for session in cache.sessions.values():
        for b in session.kv_branch_names:
            states = session.parts
            assert len({s.token_offset(b) for s in states}) == 1
            assert len({len(s.pending_chunks(b)) for s in states}) == 1
            assert len({s._open_forward(b) is None for s in states}) == 1


def test_a_later_part_out_of_pages_leaves_the_open_denoising_forward_in_every_part() -> None:
    spec, cache = make_cache(max_sessions=1)
    s = cache.open_session()
    fwd = s.prepare_forward(None, 4)  # denoising, open: its pending pages are reused by the next forward
    last = cache.caches[-1]._allocator
    hog = last.allocate(last.num_free - 1)
    before = snapshot(cache)
    with pytest.raises(am.CapacityError):
        s.prepare_forward(None, 8, commit_current=True)  # two chunks: part 0 fits, the last part does not
    assert snapshot(cache) == before and fwd.status == "open"
    last.decref(hog)
    # The open forward still runs and commits (every part), equal to the oracle afterwards.
    gen = torch.Generator().manual_seed(0)
    run_layers(fwd, gen)
    fwd.commit()
    oracle = PerHeadOracle(HEADS)
    got, want = one_forward(s, oracle, spec.branches, 4, True, gen, spec)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_build_failing_in_a_later_part_rolls_every_part_back(monkeypatch: pytest.MonkeyPatch) -> None:
    _, cache = make_cache()
    a, b = cache.open_session("a"), cache.open_session("b")
    gen = torch.Generator().manual_seed(1)
    with a.prepare_forward(None, 4, commit_current=True) as fwd:
        run_layers(fwd, gen)
    before = snapshot(cache)

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("plan() failed")

    monkeypatch.setattr(cache.caches[1]._forwards, "build", refuse)
    with pytest.raises(RuntimeError, match="plan"):
        cache.prepare_forward([(a, "cond"), (b, "uncond")], 8, commit_current=True)
    assert snapshot(cache) == before  # part 0's reservation undone exactly: pages, free order, nothing open
    # A denoising forward open over a/cond and b/cond that part 0 supersedes: aborted in every part, its kept
    # pending chunks dropped in every part (part 0's build had superseded it, part 1 still held it).
    monkeypatch.undo()
    open_fwd = cache.prepare_forward([(a, "cond"), (b, "cond")], 4)
    monkeypatch.setattr(cache.caches[1]._forwards, "build", refuse)
    with pytest.raises(RuntimeError, match="plan"):
        a.prepare_forward(("cond",), 8)
    # (part 0's build superseded it, the others aborted it: "mixed:aborted,superseded", none open)
    assert not any(t.is_open for t in open_fwd.transactions)
    assert all(not st.pending_chunks("cond") for s in (a, b) for st in s.parts)
    assert_parts_agree(cache)
    monkeypatch.undo()
    assert a.prepare_forward(None, 4).status == "open"


def test_a_failure_in_the_grouped_host_work_aborts_every_part(monkeypatch: pytest.MonkeyPatch) -> None:
    _, cache = make_cache()
    s = cache.open_session()
    before = snapshot(cache)

    def fail(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cache, "_stack_cross", fail)
    with pytest.raises(KeyboardInterrupt):
        s.prepare_forward(None, 4, commit_current=True)
    monkeypatch.undo()
    assert snapshot(cache) == before  # no part left with an open committing forward the session cannot see
    with s.prepare_forward(None, 4, commit_current=True) as fwd:
        run_layers(fwd, torch.Generator().manual_seed(2))
    assert s.committed_chunks("cond") == 1


def test_open_grouped_forwards_are_never_evicted_so_their_objects_stay() -> None:
    """max_forward_contexts=1, two forwards open: the parts keep both contexts, and so does the cache the
    grouped forwards over them (a new object would recompile a compiled model / recapture a CUDA graph)."""
    _, cache = make_cache(max_forward_contexts=1)
    a, b = cache.open_session("a"), cache.open_session("b")
    fa = a.prepare_forward(None, 4)
    b.prepare_forward(None, 4)
    assert a.prepare_forward(None, 4) is fa
    # Once a session closes, its forwards (their part contexts released) are dropped.
    a.close()
    assert all(not f._released for f in cache._forwards.values())


def test_abort_drops_the_pending_pages_denoising_forwards_kept_in_every_part() -> None:
    spec, cache = make_cache()
    s = cache.open_session()
    gen = torch.Generator().manual_seed(3)
    oracle = PerHeadOracle(HEADS)
    one_forward(s, oracle, spec.branches, 4, True, gen, spec)
    history = s.pages_in_use()
    one_forward(s, oracle, spec.branches, 4, False, gen, spec)  # completed: pending pages kept for reuse
    assert s.pages_in_use() != history
    s.abort()
    assert s.pages_in_use() == history  # as KVState.abort: the kept pending chunks are released too
    assert_parts_agree(cache)
    with pytest.raises(am.errors.UnknownBranchError):
        s.abort("nope")


def test_committing_a_forward_one_part_finished_alone_aborts_the_others() -> None:
    _, cache = make_cache()
    s = cache.open_session()
    gen = torch.Generator().manual_seed(4)
    fwd = s.prepare_forward(None, 4, commit_current=True)
    run_layers(fwd, gen)
    fwd.parts[0].abort()  # a part context finished directly, behind the grouped forward's back
    with pytest.raises(am.errors.ForwardFinishedError, match="expected the forward open in every part"):
        fwd.commit()
    assert fwd.status == "aborted"
    assert [p.committed_chunks("cond") for p in s.parts] == [0, 0]


def test_a_ctrl_c_between_two_parts_commits_waits_until_every_part_committed(
    monkeypatch: pytest.MonkeyPatch, sigint_raises: None
) -> None:
    _, cache = make_cache()
    s = cache.open_session()
    first = cache.caches[0]
    real = first._forwards.finish_forward

    def commit_then_interrupt(transaction: object, success: bool) -> None:
        real(transaction, success)
        signal.raise_signal(signal.SIGINT)  # arrives after part 0 committed, before part 1

    monkeypatch.setattr(first._forwards, "finish_forward", commit_then_interrupt)
    with pytest.raises(KeyboardInterrupt), s.prepare_forward(None, 4, commit_current=True) as fwd:
        run_layers(fwd, torch.Generator().manual_seed(5))
    assert [p.committed_chunks("cond") for p in s.parts] == [1, 1]
    assert fwd.status == "committed"


def test_a_commit_raising_in_a_later_part_leaves_no_part_open(monkeypatch: pytest.MonkeyPatch) -> None:
    _, cache = make_cache()
    s = cache.open_session()

    def broken(transaction: object, success: bool) -> None:
        if success:
            raise RuntimeError("device lost")

    real = cache.caches[1]._forwards.finish_forward
    monkeypatch.setattr(cache.caches[1]._forwards, "finish_forward", lambda t, ok: broken(t, ok) or real(t, ok))
    with pytest.raises(RuntimeError, match="device lost"), s.prepare_forward(None, 4, commit_current=True) as fwd:
        run_layers(fwd, torch.Generator().manual_seed(6))
    assert all(not p.is_active for p in fwd.parts)
    assert all(p._open_forward(b) is None for p in s.parts for b in s.kv_branch_names)


def test_a_commit_in_another_thread_reads_every_part_after_a_running_prepare(monkeypatch: pytest.MonkeyPatch) -> None:
    """Thread T commits the forward object while this thread prepares the next forward over the same streams
    (the same object): T must not see part 0's new transaction beside part 1's old one."""
    _, cache = make_cache()
    s = cache.open_session()
    fwd = s.prepare_forward(None, 4)  # denoising, open
    real = cache.caches[1]._forwards.build
    threads: list[threading.Thread] = []

    def build_while_committing(*args: object, **kwargs: object) -> object:
        threads.append(threading.Thread(target=fwd.commit))
        threads[0].start()
        time.sleep(0.2)  # T reads its transactions now (or, fixed, waits for the lock first)
        return real(*args, **kwargs)

    monkeypatch.setattr(cache.caches[1]._forwards, "build", build_while_committing)
    assert s.prepare_forward(None, 4) is fwd
    threads[0].join(5)
    assert not threads[0].is_alive()
    assert fwd.status == "completed"  # T completed the new forward in every part, not part 0 alone
    assert_parts_agree(cache)


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


def test_an_id_taken_in_one_part_refuses_open_and_fork_and_changes_nothing() -> None:
    spec, cache = make_cache()
    s = cache.open_session("a")
    one_forward(s, PerHeadOracle(HEADS), spec.branches, 4, True, torch.Generator().manual_seed(7), spec)
    cache.caches[1].open_session("x")  # opened on a part directly
    before = snapshot(cache) + [[sorted(c.sessions) for c in cache.caches]]
    with pytest.raises(am.SpecError, match="'x' which is already open"):
        cache.open_session("x")
    with pytest.raises(am.SpecError, match="'x' which is already open"):
        s.fork("x")
    assert snapshot(cache) + [[sorted(c.sessions) for c in cache.caches]] == before
    assert sorted(cache.sessions) == ["a"]


def test_admission_refusal_names_the_full_part_and_its_unpromised_pages() -> None:
    _, cache = make_cache(max_sessions=1)
    cache.admit_session("a", recache=False)
    with pytest.raises(am.CapacityError, match=r"part 'l/1h' has 0 free pages .* expected at least 8") as info:
        cache.admit_session("b", recache=False)
    assert (info.value.needed, info.value.free) == (8, 0)
    assert sorted(cache.sessions) == ["a"] and all(sorted(c.sessions) == ["a"] for c in cache.caches)


def test_check_finite_runs_once_per_part_before_any_part_commits(monkeypatch: pytest.MonkeyPatch) -> None:
    """NaN K/V in the last part: NonFiniteKVError, no part committed; each part's pending K/V read once."""
    spec, cache = make_cache(check_finite=True)
    s = cache.open_session()
    gen = torch.Generator().manual_seed(7)
    oracle = PerHeadOracle(HEADS)
    one_forward(s, oracle, spec.branches, 4, True, gen, spec)
    calls: list[int] = []
    for p, part in enumerate(cache.caches):
        original = part._forwards.abort_if_non_finite  # what every pre-commit check calls
        monkeypatch.setattr(part._forwards, "abort_if_non_finite", lambda t, p=p, f=original: (calls.append(p), f(t))[1])
    before = snapshot(cache)
    with pytest.raises(am.NonFiniteKVError):
        with s.prepare_forward(None, 4, commit_current=True) as fwd:
            for layer in fwd.layers:
                q, k, v = random_qkv(2, 4, 2, 2, 8, gen, torch.float32)
                if layer.layer_index == 1:
                    k[:, :, 0] = float("nan")  # layer 1's head 0 is in the last part ("l" of layer 1)
                am.chunk_attention(q, k, v, layer)
    assert [p.committed_chunks("cond") for p in s.parts] == [1] * len(s.parts)
    # the aborted forward's pending pages are free again (in the queue's order of an abort, as for a KVCache)
    assert [sorted(f) for f in snapshot(cache)[: len(cache.caches)]] == [sorted(f) for f in before[: len(cache.caches)]]
    assert sorted(calls) == sorted(set(calls)), calls  # no part checked twice
    calls.clear()
    one_forward(s, oracle, spec.branches, 4, True, gen, spec)  # a finite forward commits, each part checked once
    assert sorted(calls) == list(range(len(cache.caches)))


def test_committing_one_part_alone_is_refused_and_the_parts_stay_in_step() -> None:
    """Issue 41: ``fwd.parts[0].commit()`` inside a grouped forward used to commit that part alone; the grouped
    commit then aborted the others ("history is unchanged") and every later forward failed a bare assert."""
    spec, cache = make_cache()
    s = cache.open_session()
    gen = torch.Generator().manual_seed(8)
    oracle = PerHeadOracle(HEADS)
    one_forward(s, oracle, spec.branches, 4, True, gen, spec)
    with s.prepare_forward(None, 4, commit_current=True) as fwd:
        run_layers(fwd, gen)
        before = snapshot(cache)
        for commit_alone in (fwd.parts[0].commit, lambda: s.parts[1].commit_paged_context("cond"),
                             lambda: cache.caches[0]._forwards.finish_forward(fwd.parts[0]._transaction, True)):
            with pytest.raises(am.ParticipantCommitError, match="expected the HeadGroupedForward over"):
                commit_alone()
            assert snapshot(cache) == before and fwd.is_active  # nothing changed, still open
    assert fwd.status == "committed"
    assert [p.committed_chunks("cond") for p in s.parts] == [2, 2]
    assert_parts_agree(cache)
    one_forward(s, oracle, spec.branches, 4, True, gen, spec)  # later forwards run (and match the oracle)
    assert [p.committed_chunks("uncond") for p in s.parts] == [3, 3]


def test_commit_paged_context_after_one_part_aborted_alone_aborts_every_part() -> None:
    """Aborting a part alone stays allowed (history is unchanged), but the session's commit then reaches the
    grouped finish (ForwardFinishedError, the other parts aborted) instead of returning with them still open."""
    _, cache = make_cache()
    s = cache.open_session()
    fwd = s.prepare_forward(None, 4, commit_current=True)
    run_layers(fwd, torch.Generator().manual_seed(9))
    fwd.parts[0].abort()
    with pytest.raises(am.errors.ForwardFinishedError, match="expected the forward open in every part"):
        s.commit_paged_context("cond")
    assert fwd.status == "aborted" and [p.committed_chunks("cond") for p in s.parts] == [0, 0]
    assert_parts_agree(cache)
    s.commit_paged_context("cond")  # nothing open any more: a no-op
