"""Rules: forwards over 1-3 sessions (denoising or committing, 1-3 chunks of mixed lengths, token masks, the op
or the module), rollouts, finishing through any member, ``with`` blocks that raise or finish inside, stale
contexts, superseded forwards, interrupted commits and aborts (an injected exception, a real SIGINT),
non-finite K/V under ``check_finite``."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from ardiff_modules.errors import CommitFailedError, ForwardFinishedError, NonFiniteKVError, PlanNotFoundError
from ardiff_modules.core.branch import BranchPages
from tests.support.failures import INTERRUPTS, Boom
from tests.support.session_model import (
    BRANCHES,
    BRANCH_SETS,
    CHUNK_PAGES,
    NUM_LAYERS,
    SHAPES,
    SHAPES_2,
    SessionModel,
    Shape,
    TRACKED_CONTEXTS,
    TxModel,
)


class ForwardRules:
    # ================================================================== rules: forwards
    @precondition(lambda self: self.open_sessions)
    @rule(
        index=st.integers(0, 8),
        others=st.lists(st.integers(1, 2), max_size=2, unique=True),
        branch_sets=st.lists(st.sampled_from(BRANCH_SETS), min_size=3, max_size=3),
        shape=SHAPES,
        commit=st.booleans(),
        via=st.sampled_from(["state", "cache", "cache_gen", "get_kv_caches"]),
        masked=st.booleans(),
        mode=st.sampled_from(["op", "op", "module", "partial", "none"]),
        how=st.sampled_from(["cpc", "ctx.commit", "ctx.abort", "state.abort", "state.abort_all", "later", "later"]),
        member=st.integers(0, 5),
    )
    def forward(
        self, index: int, others: list[int], branch_sets: list, shape: tuple, commit: bool, via: str,
        masked: bool, mode: str, how: str, member: int,
    ) -> None:
        """A forward over 1-3 sessions (a committing or a denoising one) of 1-3 chunks of any lengths, run, then
        finished through one member."""
        streams = self.pick_streams(self.open_sessions, index, others, branch_sets)
        masked = masked and self.supports("token_mask")
        tx = self.start_forward(streams, self.shape(shape), commit, via=via, masked=masked)
        if tx is None:
            return
        if masked:
            event("forward with a token_mask")
        self.run(tx, mode)
        self.finish(tx, how, member)

    @precondition(lambda self: self.open_sessions)
    @rule(
        index=st.integers(0, 8),
        branches=st.sampled_from(BRANCH_SETS),
        steps=st.integers(1, 6),
        denoise_steps=st.integers(0, 2),
        pattern=st.sampled_from(["full", "i2v", "i2v", "varied"]),
        varied=st.lists(CHUNK_PAGES, min_size=6, max_size=6),
    )
    def rollout(
        self, index: int, branches: tuple[str, ...], steps: int, denoise_steps: int, pattern: str, varied: list
    ) -> None:
        """The generation loop: per chunk, a few denoising forwards then a committing one (reaches eviction).

        ``i2v``: a fresh branch starts with a one-page chunk (image-to-video's 1-latent-frame first
        chunk, said by ``seq_len`` alone), then full chunks; ``varied``: each chunk its own length.
        """
        sm = self.pick(self.open_sessions, index)
        shapes = [self.full()] * steps
        if pattern == "i2v" and all(not sm.committed[b] for b in branches):
            shapes[0] = self.short(1)
            event("rollout: image-to-video first chunk")
        elif pattern == "varied":
            shapes = [self.shape(([p], False)) for p in varied[:steps]]
        self.roll(sm, branches, steps, denoise_steps, shapes)

    def roll(
        self, sm: SessionModel, branches: tuple[str, ...], steps: int, denoise_steps: int = 0,
        shapes: list[Shape] | None = None,
    ) -> None:
        streams = [(sm, b) for b in branches]
        for step in range(steps):
            shape = shapes[step] if shapes else self.full()
            for _ in range(denoise_steps):
                if self.start_forward(streams, shape, False) is None:
                    return
            tx = self.start_forward(streams, shape, True)
            if tx is None:
                return
            self.run(tx, "op")
            self.finish(tx, "cpc", 0)

    @precondition(lambda self: self.contexts)
    @rule(index=st.integers(0, TRACKED_CONTEXTS - 1), success=st.booleans())
    def finish_context(self, index: int, success: bool) -> None:
        """``ctx.commit()`` / ``ctx.abort()`` on an earlier context: its current forward, if open; else a no-op."""
        ctx = self.pick(self.contexts, index)
        self.finish_call(ctx.commit if success else ctx.abort, self.ctx_tx[ctx], success)

    @precondition(lambda self: self.open_sessions)
    @rule(index=st.integers(0, 8), branch=st.sampled_from(BRANCHES))
    def commit_branch(self, index: int, branch: str) -> None:
        """``commit_paged_context`` whatever the branch's state: commits its whole forward (or a no-op)."""
        sm = self.pick(self.open_sessions, index)
        self.finish_call(lambda: sm.state.commit_paged_context(branch), sm.forward[branch], True)

    @precondition(lambda self: self.open_sessions)
    @rule(index=st.integers(0, 8), branch=st.sampled_from((None,) + BRANCHES))
    def abort(self, index: int, branch: str | None) -> None:
        self.state_abort(self.pick(self.open_sessions, index), branch)

    @precondition(lambda self: self.open_sessions)
    @rule(
        index=st.integers(0, 8),
        others=st.lists(st.integers(1, 2), max_size=2, unique=True),
        branch_sets=st.lists(st.sampled_from(BRANCH_SETS), min_size=3, max_size=3),
        shape=SHAPES,
        commit=st.booleans(),
        via=st.sampled_from(["state", "cache"]),
        mode=st.sampled_from(["op", "module"]),
        variant=st.sampled_from(
            ["ok", "ok", "boom", "halt", "keyboard", "ctx.abort", "state.abort", "cpc", "ctx.commit", "reprepare"]
        ),
        inner_commit=st.booleans(),
        inner_with=st.booleans(),
        member=st.integers(0, 5),
        inner_shape=st.one_of(st.none(), SHAPES_2),
    )
    def forward_with_block(
        self, index: int, others: list[int], branch_sets: list, shape: tuple, commit: bool, via: str, mode: str,
        variant: str, inner_commit: bool, inner_with: bool, member: int, inner_shape: tuple | None,
    ) -> None:
        """``with prepare_forward(...)``: commit on success; any exception (BaseException too) aborts every stream.

        Variants: finish the forward inside the block (``ctx.abort()``, ``state.abort(b)``,
        ``commit_paged_context(b)``, ``ctx.commit()``) then keep running the model: the next layer
        raises ForwardFinishedError before touching the pool and the block's exit changes nothing;
        or prepare the same streams again inside a denoising block (same context object, new
        forward, maybe of other chunk lengths): the block's exit must not finish that newer forward.
        """
        streams = self.pick_streams(self.open_sessions, index, others, branch_sets)
        self.settle(streams, inner_commit)
        outer = self.shape(shape)
        via = self.choose_via(streams, via, False, outer)
        if variant == "reprepare":
            commit = False
        cm = streams[0][0].cm
        failure = self.predict_prepare(cm, streams, outer, via=via, commit=commit)
        fn, args, kwargs = self.prepare_call(streams, outer, commit, via)
        if failure is not None:
            self.expect_failure(failure, fn, *args, **kwargs)
            return
        free_before, used_before = self.alloc_before(cm)
        box: dict[str, Any] = {}

        def body() -> None:
            with fn(*args, **kwargs) as fwd:
                tx = box["tx"] = self.m_prepared(streams, outer, commit, fwd, free_before, used_before)
                self.run_layer(tx, 0, mode)
                if variant in INTERRUPTS:
                    raise INTERRUPTS[variant]("injected inside the with block")
                if variant in ("ctx.abort", "state.abort", "cpc", "ctx.commit"):
                    self.finish(tx, variant, member)
                    box["before"] = self.snapshot()
                    self.call_layer(fwd, 1, mode)  # a finished forward: must raise before any write
                    raise AssertionError("a finished forward's layer ran")
                if variant == "reprepare":
                    inner = outer if inner_shape is None else self.shape(inner_shape)
                    box["inner"] = self.reprepare(streams, inner, inner_commit, via, inner_with, mode)
                else:
                    self.run_layer(tx, 1, mode)
                box["outcome"] = self.predict_finish(tx, True)

        if variant in INTERRUPTS:
            with pytest.raises(INTERRUPTS[variant]):
                body()
            event(f"{variant} inside a with block aborted the forward")
            self.m_finish(box["tx"], False)
            return
        if variant in ("ctx.abort", "state.abort", "cpc", "ctx.commit"):
            with pytest.raises(ForwardFinishedError):
                body()
            assert self.snapshot() == box["before"], "a finished forward's layer (or the with exit) changed state"
            event(f"{variant} inside a with block, then the next layer raised")
            return
        try:
            body()
            raised = None
        except NonFiniteKVError as exc:
            raised = exc
        assert (raised is not None) == (box["outcome"] is NonFiniteKVError), f"unexpected {raised!r}"
        self.m_finish(box["tx"], raised is None)
        inner = box.get("inner")
        if inner is not None and not inner_with:
            assert inner.is_open and inner.tx.is_open, "the with exit finished a later forward of its context"
            event("with exit left the re-prepared forward open")

    def reprepare(
        self, streams: list[tuple[SessionModel, str]], shape: Shape, commit: bool, via: str, use_with: bool,
        mode: str,
    ) -> TxModel | None:
        """Inside an open denoising ``with`` block: prepare the same streams again (same context, new forward)."""
        cm = streams[0][0].cm
        failure = self.predict_prepare(cm, streams, shape, via=via, commit=commit)
        fn, args, kwargs = self.prepare_call(streams, shape, commit, via)
        if failure is not None:
            self.expect_failure(failure, fn, *args, **kwargs)
            return None
        outer = streams[0][0].forward[streams[0][1]]
        free_before, used_before = self.alloc_before(cm)
        ctx = fn(*args, **kwargs)
        assert ctx is outer.ctx, "the same streams must get the same context"
        inner = self.m_prepared(streams, shape, commit, ctx, free_before, used_before)
        assert outer.status == "superseded"
        if not use_with:
            self.run(inner, mode)
            return inner
        with ctx:
            self.run(inner, mode)
            outcome = self.predict_finish(inner, True)
        assert outcome is None  # every layer was written: finite
        self.m_finish(inner, True)
        return inner

    @precondition(lambda self: self.contexts)
    @rule(index=st.integers(0, TRACKED_CONTEXTS - 1), layer=st.integers(0, NUM_LAYERS - 1),
          mode=st.sampled_from(["op", "module"]), prefer=st.sampled_from(["any", "kept", "superseded"]))
    def stale_use(self, index: int, layer: int, mode: str, prefer: str) -> None:
        """A finished forward's layers (op or model call): ForwardFinishedError / PlanNotFoundError, pool unchanged.

        A context whose streams were prepared again is open again (reused object): then it is a
        legitimate write.
        """
        pool = {
            "any": self.contexts,
            "kept": [c for c in self.contexts if c not in self.released],
            "superseded": [
                c for c in self.contexts if self.ctx_tx[c].status == "superseded" and c not in self.released
            ],
        }[prefer]
        ctx = self.pick(pool or self.contexts, index)
        tx = self.ctx_tx[ctx]
        if self.model_active(ctx):
            event("stale_use: the context is open again (reused): a legitimate write")
            self.run_layer(tx, layer, mode)
            return
        released = ctx in self.released
        event(f"stale_use of a {'released' if released else tx.status} context")
        exc = (PlanNotFoundError, ForwardFinishedError) if released else ForwardFinishedError
        self.expect_failure(exc, self.call_layer, ctx, layer, mode)

    @precondition(lambda self: self.open_sessions)
    @rule(
        index=st.integers(0, 8),
        others=st.lists(st.integers(1, 2), max_size=2, unique=True),
        branch_sets=st.lists(st.sampled_from(BRANCH_SETS), min_size=3, max_size=3),
        shape=SHAPES_2,
        commit=st.booleans(),
        keep=st.integers(0, 5),
        mode=st.sampled_from(["op", "module"]),
        success=st.booleans(),
        new_shape=st.one_of(st.none(), SHAPES_2),
    )
    def supersede_then_use(
        self, index: int, others: list[int], branch_sets: list, shape: tuple, commit: bool, keep: int, mode: str,
        success: bool, new_shape: tuple | None,
    ) -> None:
        """A denoising forward superseded by a forward over one of its streams: the whole old forward ends
        (every stream, pending pages kept); its context's layers and ``commit()/abort()`` are then inert."""
        streams = self.pick_streams(self.open_sessions, index, others, branch_sets)
        if len(streams) < 2:
            return
        self.settle(streams, success)
        first = self.shape(shape)
        old = self.start_forward(streams, first, False, via="cache")
        if old is None:
            return
        self.run(old, "partial")
        second = first if new_shape is None else self.shape(new_shape)
        new = self.start_forward([streams[keep % len(streams)]], second, commit, via="cache")
        if new is None:
            return
        assert old.status == "superseded" and old.tx.status == "superseded", (
            f"the forward over {old.ctx.streams} is {old.tx.status} after one of its streams was prepared again"
        )
        assert old.ctx is not new.ctx
        if self.model_active(old.ctx):  # pragma: no cover - a different context cannot be open
            raise AssertionError("a superseded forward's context is still active")
        exc = (PlanNotFoundError, ForwardFinishedError) if old.ctx in self.released else ForwardFinishedError
        self.expect_failure(exc, self.call_layer, old.ctx, NUM_LAYERS - 1, mode)
        self.finish_call(old.ctx.commit if success else old.ctx.abort, old, success)  # a no-op
        event("superseded forward: its context raised and its commit/abort was a no-op")

    @precondition(lambda self: self.open_sessions)
    @rule(
        index=st.integers(0, 8),
        others=st.lists(st.integers(1, 2), max_size=2, unique=True),
        branch_sets=st.lists(st.sampled_from(BRANCH_SETS), min_size=3, max_size=3),
        where=st.sampled_from(["preview_commit", "decref", "sigint"]),
        exc=st.sampled_from(["boom", "halt", "keyboard"]),
        via=st.sampled_from(["cpc", "ctx.commit", "with", "with_boom", "state.abort"]),
        then=st.sampled_from(["commit", "abort", "later"]),
        shape=SHAPES_2,
    )
    def interrupted_finish(
        self, index: int, others: list[int], branch_sets: list, where: str, exc: str, via: str, then: str,
        shape: tuple,
    ) -> None:
        """An exception injected while a forward commits or aborts: all streams are finished, or none.

        ``preview_commit`` raises on the 2nd stream (the 1st if there is one): no stream commits and the
        forward is aborted (a failed commit never leaves it open; an ``Exception`` surfaces as
        ``CommitFailedError`` chained to it). ``PageAllocator.decref`` raises on its first call (the abort
        that follows a failed commit too): nothing may change (the forward stays open). ``sigint``: a real
        SIGINT arrives while the 1st stream's commit is applied: it is deferred, every stream is
        committed, then KeyboardInterrupt is raised.
        """
        streams = self.pick_streams(self.open_sessions, index, others, branch_sets)
        self.settle(streams, then == "commit")
        cm = streams[0][0].cm
        if where in ("preview_commit", "sigint") and via in ("with_boom", "state.abort"):
            via = "cpc"  # these hooks are on the commit path
        if where == "sigint" and not self.can_defer_sigint():
            where = "decref"
        injected = KeyboardInterrupt if where == "sigint" else INTERRUPTS[exc]
        # What the caller sees: a failed commit's Exception comes wrapped (CommitFailedError, chained).
        raised_as = (injected, CommitFailedError) if where == "preview_commit" and issubclass(injected, Exception) else injected
        lengths = self.shape(shape)
        calls = {"n": 0}
        patches: list[tuple[Any, str, Any]] = []

        def install() -> None:
            if where == "preview_commit":
                original = BranchPages.preview_commit
                fail_at = min(2, len(streams))

                def preview_commit(h):
                    calls["n"] += 1
                    if calls["n"] == fail_at:
                        raise injected("injected into preview_commit")
                    return original(h)

                patches.append((BranchPages, "preview_commit", original))
                BranchPages.preview_commit = preview_commit
            elif where == "decref":

                def decref(pages):
                    raise injected("injected into decref")

                for lane in cm.cache._lanes:  # the first decref in any lane raises
                    patches.append((lane.allocator, "decref", None))
                    lane.allocator.decref = decref
            else:
                original = BranchPages.apply_commit

                def apply_commit(h, result):
                    calls["n"] += 1
                    if calls["n"] == 1:
                        os.kill(os.getpid(), signal.SIGINT)  # delivered at the next bytecode: must be deferred
                    return original(h, result)

                patches.append((BranchPages, "apply_commit", original))
                BranchPages.apply_commit = apply_commit

        def uninstall() -> None:
            while patches:
                target, name, original = patches.pop()
                if original is None:
                    delattr(target, name)
                else:
                    setattr(target, name, original)

        success = via != "state.abort" and via != "with_boom"
        if via in ("with", "with_boom"):
            failure = self.predict_prepare(cm, streams, lengths, via="cache", commit=True)
            fn, args, kwargs = self.prepare_call(streams, lengths, True, "cache")
            if failure is not None:
                self.expect_failure(failure, fn, *args, **kwargs)
                return
            free_before, used_before = self.alloc_before(cm)
            box: dict[str, Any] = {}

            def body() -> None:
                with fn(*args, **kwargs) as fwd:
                    tx = box["tx"] = self.m_prepared(streams, lengths, True, fwd, free_before, used_before)
                    self.run(tx, "op")
                    box["before"] = self.snapshot({id(cm): self.copied_pages(tx)})
                    install()
                    if via == "with_boom":
                        raise Boom("the model failed; the abort is interrupted")

            try:
                with pytest.raises(raised_as):
                    body()
            finally:
                uninstall()
            tx, before = box["tx"], box["before"]
        else:
            tx = self.start_forward(streams, lengths, True, via="cache")
            if tx is None:
                return
            self.run(tx, "op")
            sm, b = streams[-1]
            call = {
                "cpc": lambda: sm.state.commit_paged_context(b),
                "ctx.commit": tx.ctx.commit,
                "state.abort": lambda: sm.state.abort(b),
            }[via]
            before = self.snapshot({id(cm): self.copied_pages(tx)})
            install()
            try:
                with pytest.raises(raised_as) as error:
                    call()
            finally:
                uninstall()
            if isinstance(error.value, CommitFailedError):
                assert isinstance(error.value.__cause__, injected), "a failed commit must name its cause"
        if where == "sigint":
            event("SIGINT during a commit: deferred, all streams committed")
            self.m_finish(tx, True)
        elif where == "preview_commit":
            event(f"{injected.__name__} injected into preview_commit: no stream committed, the forward aborted")
            assert tx.tx.status == "aborted", f"a failed commit left the forward {tx.tx.status}"
            self.m_finish(tx, False)
        else:
            event(f"{injected.__name__} injected into {where} ({'commit' if success else 'abort'}): nothing changed")
            after = self.snapshot({id(cm): self.copied_pages(tx)})  # (a commit: its selection copied, or not)
            assert after == before, f"an interrupted finish changed state: {self.diff(before, after)}"
            if success and self.selects:
                self.m_selection_copied(tx)
            assert tx.is_open and tx.tx.is_open
            if success and self.selects and self.in_place:
                # NOTE (a library limitation, reported): a commit that re-chooses a selection in place (its frame
                # extent's pages) copies into the pages the branch still names as its current selection before the
                # bookkeeping; an exception after that copy (here: in decref) leaves the forward open and the old
                # selection's pages holding the new choice. Only finishing the commit makes the stream whole again
                # (it copies the same choice again): the machine does that instead of an abort or a later finish.
                event("frame extents: a commit re-choosing in place was interrupted after its copy (then committed)")
                then = "commit"
            if then == "commit":
                self.finish(tx, "ctx.commit", 0)
            elif then == "abort":
                self.finish(tx, "ctx.abort", 0)

    @staticmethod
    def can_defer_sigint() -> bool:
        """A real SIGINT is only safe where ``deferred_interrupts`` can hold it (main thread, default handler)."""
        return threading.current_thread() is threading.main_thread() and (
            signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )

    @precondition(lambda self: any(s.cm.check_finite for s in self.open_sessions))
    @rule(
        index=st.integers(0, 8),
        others=st.lists(st.integers(1, 2), max_size=2, unique=True),
        branch_sets=st.lists(st.sampled_from(BRANCH_SETS), min_size=3, max_size=3),
        shape=SHAPES_2,
        commit=st.sampled_from([True, True, False]),
        where=st.tuples(st.integers(0, NUM_LAYERS - 1), st.integers(0, 5), st.integers(0, 5)),
        value=st.sampled_from([float("nan"), float("inf"), float("-inf")]),
        how=st.sampled_from(["cpc", "ctx.commit", "with"]),
    )
    def non_finite_forward(
        self, index: int, others: list[int], branch_sets: list, shape: tuple, commit: bool,
        where: tuple[int, int, int], value: float, how: str,
    ) -> None:
        """``check_finite=True``: a committing forward that wrote NaN/Inf aborts (history unchanged) and raises."""
        candidates = [s for s in self.open_sessions if s.cm.check_finite]
        streams = self.pick_streams(candidates, index, others, branch_sets)
        self.settle(streams, commit)
        nan = (*where, value)
        lengths = self.shape(shape)
        if how != "with":
            tx = self.start_forward(streams, lengths, commit, via="cache")
            if tx is None:
                return
            self.run(tx, "op", nan)
            self.finish(tx, how, 0)
            return
        cm = streams[0][0].cm
        failure = self.predict_prepare(cm, streams, lengths, via="cache", commit=commit)
        fn, args, kwargs = self.prepare_call(streams, lengths, commit, "cache")
        if failure is not None:
            self.expect_failure(failure, fn, *args, **kwargs)
            return
        free_before, used_before = self.alloc_before(cm)
        box: dict[str, Any] = {}

        def body() -> None:
            with fn(*args, **kwargs) as fwd:
                tx = box["tx"] = self.m_prepared(streams, lengths, commit, fwd, free_before, used_before)
                self.run(tx, "op", nan)
                box["outcome"] = self.predict_finish(tx, True)

        try:
            body()
            raised = None
        except NonFiniteKVError as exc:
            raised = exc
        assert (raised is not None) == (box["outcome"] is NonFiniteKVError), f"unexpected {raised!r}"
        if raised is not None:
            event("check_finite aborted a commit (with exit)")
        self.m_finish(box["tx"], raised is None)
