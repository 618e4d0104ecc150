"""A batched commit is atomic (issue 10): an exception or a Ctrl-C between its streams commits neither (the
forward is aborted, not left open), and a SIGINT that arrives while a commit is applied waits until every
stream is committed, then is raised (or, without a Python handler, still ends the process)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from ardiff_modules import KVCache
from ardiff_modules.errors import CommitFailedError
from ardiff_modules.core.branch import BranchPages
from tests.support.small_cache import (
    BOTH,
    CHUNK,
    SMALL_SPEC,
    bit_copy,
    bookkeeping,
    commit_chunk,
    pages_of,
    run_layers,
)


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("how", ["commit_paged_context", "with"])
def test_batched_commit_is_atomic_when_interrupted_between_streams(
    monkeypatch, exc, how: str, small_cache: KVCache
) -> None:
    """A commit that raises between the streams commits neither, and finishes the forward (aborted: issue 24)
    instead of leaving it open for every later forward to trip over."""
    cache = small_cache
    s = cache.open_session("s")
    for i in range(3):
        commit_chunk(s, seed=i)  # sink + full window: the next commit evicts
    before_forward = bookkeeping(cache, ordered=False)
    fwd = s.prepare_forward(BOTH, CHUNK, commit_current=True)
    run_layers(fwd.layers, 2, seed=10)
    kv = bit_copy(cache._pool.kv)
    history = [p for branch in BOTH for p in pages_of(s, branch)]
    calls = []
    real_commit = BranchPages.preview_commit  # the per-stream commit computation

    def flaky(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise exc("injected between the two streams' commits")
        return real_commit(self, *args, **kwargs)

    monkeypatch.setattr(BranchPages, "preview_commit", flaky)
    with pytest.raises(exc, match="injected") as raised:
        if how == "with":
            with fwd:
                pass
        else:
            s.commit_paged_context("cond")
    if exc is RuntimeError:  # a library error that names the cause (chained); Ctrl-C stays a KeyboardInterrupt
        assert isinstance(raised.value, CommitFailedError) and isinstance(raised.value.__cause__, RuntimeError)
    assert len(calls) == 2
    assert s._open_forward("cond") is None and s._open_forward("uncond") is None, "the failed commit left it open"
    assert fwd.status == "aborted"
    assert bookkeeping(cache, ordered=False) == before_forward, "one stream committed without the other"
    assert torch.equal(bit_copy(cache._pool.kv)[:, :, history], kv[:, :, history])
    cache._allocator.check_invariants()
    monkeypatch.undo()
    commit_chunk(s, seed=11)  # the next forward runs (no PendingContextError) and commits both
    assert s.committed_chunks("cond") == s.committed_chunks("uncond") == 4
    assert s._open_forward("cond") is None


def test_sigint_during_a_batched_commit_waits_until_both_streams_are_committed(
    monkeypatch, small_cache: KVCache, sigint_raises: None
) -> None:
    cache = small_cache
    s = cache.open_session("s")
    for i in range(3):
        commit_chunk(s, seed=i)
    real_apply = BranchPages.apply_commit
    applied = []

    def apply_with_ctrl_c(self, result):
        if not applied:
            os.kill(os.getpid(), signal.SIGINT)
            sum(range(1000))  # give the interpreter a few bytecodes to run the handler
        applied.append(self)
        return real_apply(self, result)

    monkeypatch.setattr(BranchPages, "apply_commit", apply_with_ctrl_c)
    fwd = s.prepare_forward(BOTH, CHUNK, commit_current=True)
    run_layers(fwd.layers, 2)
    with pytest.raises(KeyboardInterrupt):
        s.commit_paged_context("cond")
    assert len(applied) == 2
    assert s.committed_chunks("cond") == s.committed_chunks("uncond") == 4
    assert s._open_forward("cond") is None and s._open_forward("uncond") is None
    cache._allocator.check_invariants()
    assert cache._allocator.num_used == 2 * 3 * SMALL_SPEC.pages_per_chunk  # sink + window per branch


def test_deferred_interrupts_holds_sigint_until_the_block_ends(sigint_raises: None) -> None:
    from ardiff_modules.core.transaction import deferred_interrupts

    previous = signal.getsignal(signal.SIGINT)
    reached = []
    with pytest.raises(KeyboardInterrupt), deferred_interrupts():
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(10_000))  # the handler runs here, inside the block
        reached.append("end of block")
    assert reached == ["end of block"]
    assert signal.getsignal(signal.SIGINT) is previous


def test_deferred_sigint_with_the_default_disposition_still_terminates() -> None:
    """SIG_DFL (no Python handler): a Ctrl-C held during an update still ends the process after it."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import os, signal
        from ardiff_modules.core.transaction import deferred_interrupts
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
