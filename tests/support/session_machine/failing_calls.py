"""Rules: calls that must fail and change nothing -- ``plan()`` raising, capacity, a user retention policy
breaking its contract, replacing a committing forward, misuse (bad arguments, chunk lengths), closed sessions
and caches, another cache's session."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from ardiff_modules import chunk_attention
from ardiff_modules.errors import CrossAttentionNotPopulatedError
from ardiff_modules.errors import (
    BackendUnavailableError,
    CacheClosedError,
    CapacityError,
    PendingContextError,
    SequenceLengthError,
    SessionClosedError,
    SpecError,
    TensorMismatchError,
    UnknownBranchError,
    UnknownCacheError,
)
from tests.support.policies import BAD_KINDS, BAD_MESSAGES, Misbehaving
from tests.support.failures import INTERRUPTS
from tests.support.session_model import (
    BRANCHES,
    BRANCH_SETS,
    MAX_CACHES,
    MAX_SESSIONS,
    NUM_LAYERS,
    SHAPES,
    SHAPES_2,
    SessionModel,
    Shape,
)


class FailingCallRules:
    # ================================================================== rules: failures that change nothing
    @precondition(lambda self: self.open_sessions)
    @rule(
        index=st.integers(0, 8),
        others=st.lists(st.integers(1, 2), max_size=2, unique=True),
        branch_sets=st.lists(st.sampled_from(BRANCH_SETS), min_size=3, max_size=3),
        shape=SHAPES,
        commit=st.booleans(),
        exc=st.sampled_from(["boom", "halt", "keyboard", "static"]),
    )
    def plan_fails(
        self, index: int, others: list[int], branch_sets: list, shape: tuple, commit: bool, exc: str
    ) -> None:
        """``plan()`` raising after pages were taken (pending chunks of other lengths already replaced):
        allocator, free order, peak, pool, registry all unchanged."""
        streams = self.pick_streams(self.open_sessions, index, others, branch_sets)
        cm = streams[0][0].cm
        static = exc == "static"
        lengths = self.shape(shape)
        failure = self.predict_prepare(cm, streams, lengths, via="cache", static=static, commit=commit)
        fn, args, kwargs = self.prepare_call(streams, lengths, commit, "cache")
        if static:
            kwargs = {"static": True, **({"chunk_lengths": lengths.lengths} if lengths.explicit else {})}
            failure = failure or BackendUnavailableError  # the reference backend has no static plans
        else:
            failure = failure or INTERRUPTS[exc]
            cm.backend.fail = INTERRUPTS[exc]
        try:
            self.expect_failure(failure, fn, *args, **kwargs)
        finally:
            cm.backend.fail = None

    @precondition(lambda self: self.open_sessions)
    @rule(index=st.integers(0, 8), branches=st.sampled_from(BRANCH_SETS), commit=st.booleans())
    def exhaust_capacity(self, index: int, branches: tuple[str, ...], commit: bool) -> None:
        """A forward asking for more pages than are free raises CapacityError and changes nothing."""
        sm = self.pick(self.open_sessions, index)
        free_chunks = max(sm.cm.allocator(lane).num_free for lane in range(sm.cm.num_lanes)) // self.ppc
        extent_chunks = max(sm.cm.lane_extent_chunks)
        num_chunks = max(len(sm.pending[b]) for b in branches) + free_chunks + 1 + extent_chunks
        streams = [(sm, b) for b in branches]
        shape = self.full(num_chunks)
        exc = self.predict_prepare(sm.cm, streams, shape, via="state", commit=commit)
        assert exc is not None, "capacity model broken: one branch alone needs more than is free"
        info = self.expect_failure(exc, sm.state.prepare_forward, branches, shape.seq_len, commit)
        if exc is CapacityError and not self.grouped:
            assert info.free == sm.cm.cache._allocator.num_free
            assert info.needed > info.free
            assert str(info.needed) in str(info) and str(info.free) in str(info)
        elif exc is CapacityError:  # the first lane that is full is named, with its numbers
            free = [sm.cm.allocator(lane).num_free for lane in range(sm.cm.num_lanes)]
            assert info.free in free, (info.free, free)
            assert info.needed > info.free
            assert str(info.needed) in str(info) and str(info.free) in str(info)

    @precondition(lambda self: self.open_sessions)
    @rule(
        index=st.integers(0, 8),
        others=st.lists(st.integers(1, 2), max_size=2, unique=True),
        branch_sets=st.lists(st.sampled_from(BRANCH_SETS), min_size=3, max_size=3),
        kind=st.sampled_from(BAD_KINDS),
        via=st.sampled_from(["cpc", "ctx.commit", "with"]),
        then=st.sampled_from(["commit", "abort", "later"]),
        shape=SHAPES_2,
    )
    def misbehaving_policy(
        self, index: int, others: list[int], branch_sets: list, kind: str, via: str, then: str, shape: tuple
    ) -> None:
        """A user's retention policy breaks its contract at a commit (on the forward's last stream, after the
        others' commits were computed): SpecError naming the policy, no stream committed, and the forward is
        aborted (a failed commit never leaves it open): its pending pages go, history stays; the invariants
        check it against the model."""
        streams = self.pick_streams(self.open_sessions, index, others, branch_sets)
        self.settle(streams, then == "commit")
        cm = streams[0][0].cm
        lengths = self.shape(shape)
        if via == "with":
            failure = self.predict_prepare(cm, streams, lengths, via="cache", commit=True)
            fn, args, kwargs = self.prepare_call(streams, lengths, True, "cache")
            if failure is not None:
                self.expect_failure(failure, fn, *args, **kwargs)
                return
            free_before, used_before = self.alloc_before(cm)
            fwd = fn(*args, **kwargs)
            tx = self.m_prepared(streams, lengths, True, fwd, free_before, used_before)
        else:
            tx = self.start_forward(streams, lengths, True, via="cache")
            if tx is None:
                return
        self.run(tx, "op")
        sm, b = streams[-1]
        history = sm.state.branch_pages(b)
        real = history.policy
        bad = Misbehaving(real)
        bad.arm(kind, resident=history.history_index, committed=history.committed_chunks, floor=history.window_floor)

        def call() -> None:
            if via == "cpc":
                sm.state.commit_paged_context(b)
            elif via == "ctx.commit":
                tx.ctx.commit()
            else:
                with tx.ctx:
                    pass

        history.policy = bad  # NOTE: this branch only; the 1st..n-1th streams' commits compute fine
        try:
            with pytest.raises(SpecError) as info:
                call()
        finally:
            history.policy = real
        message = str(info.value)
        assert "retention policy Misbehaving." in message and BAD_MESSAGES[bad.applied] in message, message
        event(f"misbehaving policy ({bad.applied}) refused at commit")
        assert tx.tx.status == "aborted", f"a refused commit left the forward {tx.tx.status}"
        self.m_finish(tx, False)

    @precondition(lambda self: any(t.is_open and t.commit for s in self.open_sessions for t in s.forward.values() if t))
    @rule(index=st.integers(0, 4 * MAX_SESSIONS), commit=st.booleans(), shape=SHAPES, with_other=st.booleans())
    def replace_uncommitted(self, index: int, commit: bool, shape: tuple, with_other: bool) -> None:
        """Preparing over a stream of an open committing forward raises and changes nothing."""
        candidates = [(s, b) for s in self.open_sessions for b, t in s.forward.items() if t and t.commit]
        sm, b = self.pick(candidates, index)
        lengths = self.shape(shape)
        if with_other:  # an innocent stream first: nothing of it may change either
            other = "uncond" if b == "cond" else "cond"
            streams = [(sm, other), (sm, b)]
            assert self.predict_prepare(sm.cm, streams, lengths, via="state") is PendingContextError
            fn, args, kwargs = self.prepare_call(streams, lengths, commit, "state")
            self.expect_failure(PendingContextError, fn, *args, **kwargs)
            return
        fn, args, kwargs = self.prepare_call([(sm, b)], lengths, commit, "state")
        self.expect_failure(PendingContextError, fn, *args, **kwargs, match=repr(b))

    @precondition(lambda self: self.open_sessions)
    @rule(
        index=st.integers(0, 8),
        kind=st.sampled_from(
            [
                "unknown_branch_prepare",
                "unknown_branch_commit",
                "unknown_branch_abort",
                "unknown_branch_populate",
                "unknown_cache",
                "unknown_keep",
                "misaligned",
                "seq_none",
                "duplicate_stream",
                "duplicate_session_id",
                "cross_before_populate",
                "fork_unknown_branch",
                "fork_duplicate_id",
                "mask_shape",
                "mask_dtype",
                "bad_kv_shape",
                "lengths_sum",
                "lengths_grid",
                "lengths_big",
                "lengths_empty",
                "lengths_type",
                "bad_pending_attention",
            ]
        ),
        seq_len=st.sampled_from(["zero", "negative", "one", "chunk+1", "3chunk-1", "chunk+page"]),
        shape=SHAPES,
    )
    def misuse(self, index: int, kind: str, seq_len: str, shape: tuple) -> None:
        sm = self.pick(self.open_sessions, index)
        state = sm.state
        chunk, page = self.chunk, self.page
        if kind.startswith("lengths_"):
            self.bad_chunk_lengths(sm, kind, self.shape(shape))
        elif kind == "unknown_branch_prepare":
            self.expect_failure(UnknownBranchError, state.prepare_forward, ("nope", "cond"), chunk, False, match="nope")
        elif kind == "unknown_branch_commit":
            self.expect_failure(UnknownBranchError, state.commit_paged_context, "nope", match="nope")
        elif kind == "unknown_branch_abort":
            self.expect_failure(UnknownBranchError, state.abort, "nope", match="nope")
        elif kind == "unknown_branch_populate":
            self.expect_failure(
                UnknownBranchError, state.populate_cross_attention, "nope", "text", [self.cross_value(0.0, 0)] * NUM_LAYERS
            )
        elif kind == "unknown_cache":
            self.expect_failure(
                UnknownCacheError, state.populate_cross_attention, "cond", "image", [self.cross_value(0.0, 0)] * NUM_LAYERS,
                match="image",
            )
        elif kind == "unknown_keep":
            self.expect_failure(UnknownCacheError, state.reset, keep_cross_attention=("text", "image"), match="image")
        elif kind == "misaligned":
            # "chunk+page": a shorter and a full chunk need chunk_lengths; seq_len alone is refused.
            n = {"zero": 0, "negative": -chunk, "one": 1, "chunk+1": chunk + 1, "3chunk-1": 3 * chunk - 1,
                 "chunk+page": chunk + page}[seq_len]
            if n > 0 and n % page == 0 and (n < chunk or n % chunk == 0):
                n = chunk + 1  # one shorter chunk (whole pages), or full chunks, are allowed: not a misuse
            self.expect_failure(SequenceLengthError, state.prepare_forward, ("cond",), n, False, match=str(chunk))
            self.expect_failure(SequenceLengthError, state.get_kv_caches, "uncond", n, True)
        elif kind == "bad_pending_attention":
            # Validated with the arguments, before the streams' states: even under an open committing forward.
            self.expect_failure(
                SpecError, state.prepare_forward, BRANCHES, chunk, False, pending_attention="causal",
                match="pending_attention: expected one of ('block_causal', 'bidirectional'), got 'causal'",
            )
            self.expect_failure(SpecError, state.get_kv_caches, "cond", chunk, True, pending_attention=1)
        elif kind == "seq_none":
            self.expect_failure(SequenceLengthError, state.get_kv_caches, "cond", None, True)
        elif kind == "duplicate_stream":
            exc = self.predict_prepare(sm.cm, [(sm, "cond"), (sm, "cond")], self.full(), via="cache")
            self.expect_failure(exc, sm.cm.cache.prepare_forward, [(state, "cond"), (state, "cond")], chunk, False)
        elif kind == "duplicate_session_id":
            self.expect_failure(SpecError, sm.cm.cache.open_session, state.session_id, match=state.session_id)
        elif kind == "fork_unknown_branch":
            self.expect_failure(UnknownBranchError, state.fork, branches=("cond", "nope"), match="nope")
        elif kind == "fork_duplicate_id":
            self.expect_failure(SpecError, state.fork, state.session_id, match=state.session_id)
        elif kind == "cross_before_populate":
            missing = [b for b in BRANCHES if b not in sm.cross]
            if missing:
                self.expect_failure(CrossAttentionNotPopulatedError, state.get_cross_attention_kv, missing[0], "text")
        elif kind in ("mask_shape", "mask_dtype") and self.supports("token_mask"):
            streams = [(sm, "cond"), (sm, "uncond")]
            lengths = self.shape(shape)
            exc = self.predict_prepare(sm.cm, streams, lengths, via="state", mask_ok=False)
            mask = self.make_mask(streams, lengths, bad=kind.split("_")[1])
            fn, args, kwargs = self.prepare_call(streams, lengths, False, "state", mask)
            self.expect_failure(exc, fn, *args, **kwargs)
        elif kind == "bad_kv_shape":
            open_ctx = [c for c in self.contexts if self.model_active(c)]
            if open_ctx:
                ctx = open_ctx[0]
                q, k, v = self.layer_inputs(ctx, 0, "op")
                # (with the sink query relative sinks need: only k is wrong; a grouped layer checks the sink query
                # before the shares check k's tokens, a uniform one after)
                self.expect_failure(
                    TensorMismatchError, chunk_attention, q, k[:, :-1], v, ctx.layers[0], **self.sink_query(ctx, q)
                )

    def bad_chunk_lengths(self, sm: SessionModel, kind: str, shape: Shape) -> None:
        """Invalid ``chunk_lengths`` are refused (SequenceLengthError) before anything changes: a sum other than
        ``seq_len``, a length off the page grid or above ``chunk_size``, none, a set."""
        chunk, page = self.chunk, self.page
        lengths: Any = list(shape.lengths)
        seq_len = shape.seq_len
        if kind == "lengths_sum":
            seq_len += page
        elif kind == "lengths_grid":
            lengths[-1] = lengths[-1] - 1 if page > 1 else 0  # off the page grid (page 1: an empty chunk)
            seq_len = sum(lengths)
        elif kind == "lengths_big":
            lengths[0] = chunk + page
            seq_len = sum(lengths)
        elif kind == "lengths_empty":
            lengths, seq_len = [], 0
        else:
            lengths = set(lengths)
        # Validated before the streams' states are looked at: even a branch under an open committing forward.
        self.expect_failure(
            SequenceLengthError, sm.state.prepare_forward, BRANCHES, seq_len, False, chunk_lengths=lengths,
            match="chunk_lengths" if kind != "lengths_sum" else "seq_len",
        )
        event(f"invalid chunk_lengths refused ({kind})")

    @precondition(lambda self: self.closed_sessions)
    @rule(
        index=st.integers(0, 4 * MAX_SESSIONS),
        op=st.sampled_from(
            [
                "prepare", "get_kv_caches", "commit", "abort", "populate", "clear", "visible", "batch", "fork",
                "share_sinks_from_closed", "share_cross_from_closed",
            ]
        ),
    )
    def closed_session_misuse(self, index: int, op: str) -> None:
        sm = self.pick(self.closed_sessions, index)
        state = sm.state
        exc: type[BaseException] = SessionClosedError
        calls = {
            "prepare": (state.prepare_forward, ("cond",), self.chunk, False),
            "get_kv_caches": (state.get_kv_caches, "cond", self.chunk, True),
            "commit": (state.commit_paged_context, "cond"),
            "abort": (state.abort,),
            "populate": (state.populate_cross_attention, "cond", "text", [self.cross_value(0.0, 0)] * NUM_LAYERS),
            "clear": (state.clear_cross_attention,),
            "visible": (state.history_chunks, "uncond"),
            "fork": (state.fork,),
        }
        if self.open_sessions:
            other = self.open_sessions[0]
            calls["share_sinks_from_closed"] = (other.state.share_sinks_from, state, "cond")
            calls["share_cross_from_closed"] = (other.state.share_cross_attention_from, state, "text", "cond")
            if op.startswith("share") and other.cm is not sm.cm:
                exc = SpecError  # another cache's session: refused before its state is looked at
        if op not in calls and op != "batch":
            return  # needs an open session
        if op == "batch":
            # The closed session first: an open stream first could legitimately fail another check.
            streams = [(sm, "cond")] + [(s, "uncond") for s in self.sessions_of(sm.cm)[:1]]
            exc = self.predict_prepare(sm.cm, streams, self.full(), via="cache")
            fn, args = sm.cm.cache.prepare_forward, ([(s.state, b) for s, b in streams], self.chunk, False)
        else:
            fn, *args = calls[op]
        self.expect_failure(exc, fn, *args, match=state.session_id if exc is SessionClosedError else None)

    @precondition(lambda self: any(c.closed for c in self.caches))
    @rule(index=st.integers(0, MAX_CACHES), op=st.sampled_from(["open_session", "admit", "prepare", "close", "fork"]))
    def closed_cache_misuse(self, index: int, op: str) -> None:
        """A closed KVCache refuses new sessions and forwards (CacheClosedError); ``close()`` is idempotent."""
        cm = self.pick([c for c in self.caches if c.closed], index)
        old = [s for s in self.sessions if s.cm is cm]
        if op == "open_session":
            self.expect_failure(CacheClosedError, cm.cache.open_session)
        elif op == "admit":
            self.expect_failure(CacheClosedError, cm.cache.admit_session)
        elif op == "prepare" and old:
            self.expect_failure(CacheClosedError, cm.cache.prepare_forward, [(old[0].state, "cond")], self.chunk, True)
            self.expect_failure(SessionClosedError, old[0].state.prepare_forward, ("cond",), self.chunk, True)
        elif op == "fork" and old:
            self.expect_failure(SessionClosedError, old[0].state.fork)
        elif op == "close":
            before = self.snapshot()
            cm.cache.close()
            assert self.snapshot() == before

    @precondition(lambda self: len([c for c in self.open_caches if self.sessions_of(c)]) >= 2)
    @rule(
        i=st.integers(0, 8),
        j=st.integers(0, 8),
        op=st.sampled_from(["prepare", "batch", "share_sinks", "share_cross"]),
        branch=st.sampled_from(BRANCHES),
    )
    def cross_cache_misuse(self, i: int, j: int, op: str, branch: str) -> None:
        """Sessions of one KVCache cannot be used with another: SpecError, neither cache changes."""
        caches = [c for c in self.open_caches if self.sessions_of(c)]
        a = self.pick(caches, i)
        b = self.pick([c for c in caches if c is not a], j)
        sa, sb = self.sessions_of(a)[i % len(self.sessions_of(a))], self.sessions_of(b)[j % len(self.sessions_of(b))]
        if op == "prepare":
            self.expect_failure(SpecError, a.cache.prepare_forward, [(sb.state, branch)], self.chunk, False)
        elif op == "batch":
            self.expect_failure(
                SpecError, a.cache.prepare_forward, [(sa.state, branch), (sb.state, branch)], self.chunk, True
            )
        elif op == "share_sinks":
            self.expect_failure(SpecError, sa.state.share_sinks_from, sb.state, branch)
        else:
            self.expect_failure(SpecError, sa.state.share_cross_attention_from, sb.state, "text", branch)
        event("cross-cache misuse refused")
