"""A stateful property test of a :class:`KVCache` with retention groups (``KVCacheSpec(head_retention=...)``: one
lane per head part): sessions, batched forwards, failures, forks, resets.

The machine drives a small grouped cache (reference backend, float32, 2-3 layers, 2-4 K/V heads, 2-3
retention groups whose windows include 0) with several sessions, and keeps a cache-free model of each
session: a :class:`~tests.heads.oracle.PerHeadOracle` (the committed K/V of every branch; a fork copies
it), the pending chunks each branch holds, the published cross caches, and the denoising forwards left
open. Rules: open / admit a session; a forward over one or several sessions' branches batched (denoise,
commit, an exception inside the ``with`` block, a layer left out of a commit, a denoising forward left
open, a member session reset or closed mid-forward); fork; reset; close; ``abort``; populate / clear a
cross cache. Every forward's outputs equal the oracle's. Invariants after every step: each lane's
allocator is consistent; each page's refcount equals the references the sessions hold on it, and the
pages each lane holds are what its policy keeps (resident chunks + pending chunks, per branch, times
``pages_per_chunk``); every lane holds each branch at the same offset, with the same pending chunks and
the same open forward; no forward is open in some lane and finished in another. After the last
step every session closes and every page of every lane is free.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import ardiff_modules as am
from tests.heads.oracle import PerHeadOracle, grouped, random_qkv, session_budget

BRANCHES = ("cond", "uncond")
CROSS_TOKENS = 3
HEAD_DIM = 4
MAX_SESSIONS = 4  # open at once (the pool is sized for 2 at their peak: admission and capacity refusals happen)


class Interrupted(Exception):
    """Raised inside a forward's ``with`` block by the machine (an exception mid-forward)."""


@dataclass
class SessionModel:
    oracle: PerHeadOracle
    committed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BRANCHES, 0))
    pending: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BRANCHES, 0))
    #: branch -> per-layer (k, v) of the published "text" cache
    cross: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)


@dataclass
class OpenForward:
    """A denoising forward the machine left open: its transaction (one over every lane) and its streams."""

    transactions: tuple[object, ...]
    streams: tuple[tuple[str, str], ...]


class RetentionGroupsMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sessions: dict[str, tuple[am.KVState, SessionModel]] = {}
        self.open: list[OpenForward] = []
        self.gen = torch.Generator().manual_seed(0)

    # ------------------------------------------------------------------ setup
    @initialize(
        layers=st.integers(2, 3), kv_heads=st.integers(2, 4), gqa=st.sampled_from([1, 2]),
        geometry=st.sampled_from([(4, 2), (2, 1), (4, 4)]), groups=st.integers(2, 3),
        sinks=st.lists(st.integers(0, 1), min_size=3, max_size=3), seed=st.integers(0, 2**16),
        max_contexts=st.sampled_from([1, 2, 64]), sessions=st.integers(1, 3), short_first=st.booleans(),
        assign=st.lists(st.integers(0, 2), min_size=12, max_size=12),
    )
    def setup(self, layers: int, kv_heads: int, gqa: int, geometry: tuple[int, int], groups: int,
              sinks: list[int], seed: int, max_contexts: int, sessions: int, short_first: bool,
              assign: list[int]) -> None:
        self.chunk, page = geometry
        names = ["w0", "w1", "w2"][:groups]  # window 0, 1, 2 chunks
        rows = [[names[assign[layer * kv_heads + h] % groups] for h in range(kv_heads)] for layer in range(layers)]
        rows[0][0] = names[0]  # the window-0 group always holds a head
        # NOTE: groups (so lanes) in either order: with the short window last, its small pool is the one a
        # multi-chunk forward overflows, after the lanes before it validated.
        order = names if short_first else names[::-1]
        self.heads = am.HeadRetention({n: (sinks[int(n[1])], int(n[1])) for n in order}, rows)
        self.spec = am.KVCacheSpec(
            num_layers=layers, num_kv_heads=kv_heads, num_qo_heads=kv_heads * gqa, head_dim=HEAD_DIM,
            chunk_size=self.chunk, page_size=page, branches=BRANCHES, dtype="float32",
            cross_attention=(am.CrossAttentionSpec("text", CROSS_TOKENS),),
        )
        spec = grouped(self.spec, self.heads)
        self.cache = am.KVCache(spec, budget_bytes=session_budget(spec, 2), backend="reference",
                                max_forward_contexts=max_contexts)
        self.gen.manual_seed(seed)
        for _ in range(sessions):  # NOTE: most rules need a session; starting with none wastes examples
            self.open_session(admit=False)

    # ------------------------------------------------------------------ helpers
    def pick(self, index: int) -> tuple[str, am.KVState, SessionModel]:
        sid = sorted(self.sessions)[index % len(self.sessions)]
        return (sid, *self.sessions[sid])

    def streams_of(self, picks: list[tuple[int, int]]) -> list[tuple[str, str]]:
        """Distinct ``(session id, branch)`` streams from ``(session index, branch index)`` picks."""
        out: list[tuple[str, str]] = []
        for s, b in picks:
            stream = (self.pick(s)[0], BRANCHES[b])
            if stream not in out:
                out.append(stream)
        return out

    def snapshot(self) -> list[object]:
        """What a refused call must leave unchanged: every lane's free queue, every branch's pages and forward."""
        out: list[object] = [lane.allocator.free_pages() for lane in self.cache._lanes]
        for sid, (session, _) in sorted(self.sessions.items()):
            for branches in session._lane_branches:
                for b in BRANCHES:
                    pages = branches[b]
                    t = pages.transaction if getattr(pages.transaction, "is_open", False) else None
                    out.append((sid, b, pages.history_chunks, pages.pending, pages.token_offset,
                                None if t is None else id(t)))
        return out

    def forwards_finished(self, sids: set[str]) -> None:
        """The open forwards spanning a session of ``sids`` were aborted as a whole: their streams hold no pending."""
        for fwd in [f for f in self.open if any(sid in sids for sid, _ in f.streams)]:
            for sid, b in fwd.streams:
                if sid in self.sessions:
                    self.sessions[sid][1].pending[b] = 0
            self.open.remove(fwd)

    def superseded(self, streams: list[tuple[str, str]]) -> None:
        """A forward over ``streams`` was prepared: the open forwards it overlaps are superseded (pending kept)."""
        self.open = [f for f in self.open if not set(f.streams) & set(streams)]

    def expect_outputs(self, fwd: am.ForwardContext, streams: list[tuple[str, str]], layers: range,
                       written: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Run ``layers`` of ``fwd`` and compare each stream with its session's oracle (block-causal chunks)."""
        n, c = fwd.seq_len, self.chunk
        for layer in layers:
            q, k, v = random_qkv(len(streams), n, self.spec.query_heads, self.spec.num_kv_heads, HEAD_DIM,
                                 self.gen, torch.float32)
            got = am.chunk_attention(q, k, v, fwd.layers[layer])
            for s, (sid, b) in enumerate(streams):
                oracle = self.sessions[sid][1].oracle
                want = torch.cat([oracle.attend(b, layer, q[s, i:i + c], k[s, :i + c], v[s, :i + c])
                                  for i in range(0, n, c)])
                torch.testing.assert_close(got[s], want, atol=1e-5, rtol=1e-5)
            written.append((k, v))

    def check_cross(self, fwd: am.ForwardContext, streams: list[tuple[str, str]], layer: int) -> None:
        published = [self.sessions[sid][1].cross.get(b) for sid, b in streams]
        if any(p is None for p in published):
            with pytest.raises(am.errors.CrossAttentionNotPopulatedError):
                fwd.layers[layer].cross_kv("text")
            return
        k, v = fwd.layers[layer].cross_kv("text")
        for s, entry in enumerate(published):
            assert entry is not None
            torch.testing.assert_close(k[s], entry[layer][0], atol=0, rtol=0)
            torch.testing.assert_close(v[s], entry[layer][1], atol=0, rtol=0)

    # ------------------------------------------------------------------ sessions
    @precondition(lambda self: len(self.sessions) < MAX_SESSIONS)
    @rule(admit=st.booleans())
    def open_session(self, admit: bool) -> None:
        if admit and not self.cache.can_admit(recache=False):
            before = self.snapshot()
            with pytest.raises(am.CapacityError, match="admit_session: a session needs"):
                self.cache.admit_session(recache=False)
            assert self.snapshot() == before
            return
        session = self.cache.admit_session(recache=False) if admit else self.cache.open_session()
        self.sessions[session.session_id] = (session, SessionModel(PerHeadOracle(self.heads)))

    @precondition(lambda self: self.sessions and len(self.sessions) < MAX_SESSIONS)
    @rule(index=st.integers(0, 99), branches=st.sampled_from([BRANCHES, ("cond",), ("uncond",)]),
          share=st.booleans())
    def fork(self, index: int, branches: tuple[str, ...], share: bool) -> None:
        _, session, model = self.pick(index)
        child = session.fork(branches=branches, share_cross_attention=share)
        committed = defaultdict(list, {b: [list(layer) for layer in model.oracle.committed[b]] for b in branches})
        oracle = PerHeadOracle(self.heads, committed=committed)
        copy = SessionModel(oracle)
        for b in branches:
            copy.committed[b] = model.committed[b]
            if share and b in model.cross:
                copy.cross[b] = model.cross[b]
        self.sessions[child.session_id] = (child, copy)

    @precondition(lambda self: self.sessions)
    @rule(index=st.integers(0, 99), keep=st.booleans())
    def reset(self, index: int, keep: bool) -> None:
        sid, session, model = self.pick(index)
        session.reset(keep_cross_attention=("text",) if keep else ())
        self.forwards_finished({sid})
        self.sessions[sid] = (session, SessionModel(PerHeadOracle(self.heads), cross=model.cross if keep else {}))

    @precondition(lambda self: self.sessions)
    @rule(index=st.integers(0, 99))
    def close(self, index: int) -> None:
        sid, session, _ = self.pick(index)
        session.close()
        self.forwards_finished({sid})
        del self.sessions[sid]
        with pytest.raises(am.errors.SessionClosedError):
            session.prepare_forward(None, self.chunk)

    @precondition(lambda self: self.sessions)
    @rule(index=st.integers(0, 99))
    def abort(self, index: int) -> None:
        sid, session, model = self.pick(index)
        session.abort()
        self.forwards_finished({sid})
        model.pending = dict.fromkeys(BRANCHES, 0)

    @precondition(lambda self: self.sessions)
    @rule(index=st.integers(0, 99), branch=st.sampled_from(BRANCHES), clear=st.booleans())
    def cross_attention(self, index: int, branch: str, clear: bool) -> None:
        _, session, model = self.pick(index)
        if clear:
            session.clear_cross_attention()
            model.cross.clear()
            return
        layer_kv = [(torch.randn(CROSS_TOKENS, self.spec.num_kv_heads, HEAD_DIM, generator=self.gen),
                     torch.randn(CROSS_TOKENS, self.spec.num_kv_heads, HEAD_DIM, generator=self.gen))
                    for _ in range(self.spec.num_layers)]
        session.populate_cross_attention(branch, "text", layer_kv)
        model.cross[branch] = layer_kv

    # ------------------------------------------------------------------ forwards
    @precondition(lambda self: self.sessions)
    @rule(
        picks=st.lists(st.tuples(st.integers(0, 99), st.integers(0, 1)), min_size=1, max_size=3),
        chunks=st.sampled_from([1, 1, 2]),
        kind=st.sampled_from(
            ["denoise", "denoise", "commit", "commit", "raise", "skip_layer", "leave_open", "leave_open", "end_session"]
        ),
        where=st.integers(0, 99),
    )
    def forward(self, picks: list[tuple[int, int]], chunks: int, kind: str, where: int) -> None:
        streams = self.streams_of(picks)
        event(f"forward {kind}, {len(streams)} stream(s) of {len({sid for sid, _ in streams})} session(s)")
        commit = kind in ("commit", "skip_layer") or (kind == "end_session" and where % 2 == 0)
        before = self.snapshot()
        try:
            fwd = self.cache.prepare_forward([(self.sessions[sid][0], b) for sid, b in streams],
                                             chunks * self.chunk, commit_current=commit)
        except am.CapacityError:
            event("forward refused: capacity")
            assert self.snapshot() == before  # a refusal by any lane changes no lane
            return
        self.superseded(streams)
        for sid, b in streams:
            self.sessions[sid][1].pending[b] = chunks
        self.check_cross(fwd, streams, where % self.spec.num_layers)
        if kind == "leave_open":
            self.expect_outputs(fwd, streams, range(self.spec.num_layers), [])
            self.open.append(OpenForward((fwd._transaction,), tuple(streams)))
            return
        if kind == "end_session":
            self.end_session_mid_forward(fwd, streams, where)
            return
        self.finish_forward(fwd, streams, kind, where)

    def finish_forward(self, fwd: am.ForwardContext, streams: list[tuple[str, str]], kind: str, where: int) -> None:
        layers = self.spec.num_layers
        written: list[tuple[torch.Tensor, torch.Tensor]] = []
        skipped = where % layers
        if kind == "raise":
            with pytest.raises(Interrupted), fwd:
                self.expect_outputs(fwd, streams, range(where % (layers + 1)), written)
                raise Interrupted
        elif kind == "skip_layer":
            with pytest.raises(am.errors.IncompleteForwardError), fwd:
                self.expect_outputs(fwd, streams, range(skipped), written)
                self.expect_outputs(fwd, streams, range(skipped + 1, layers), written)
        else:
            with fwd:
                self.expect_outputs(fwd, streams, range(layers), written)
        assert fwd.status == {"denoise": "completed", "commit": "committed"}.get(kind, "aborted")
        for s, (sid, b) in enumerate(streams):
            model = self.sessions[sid][1]
            if kind == "denoise":
                continue  # the pending chunks stay for the next forward
            model.pending[b] = 0
            if kind == "commit":
                for i in range(0, fwd.seq_len, self.chunk):
                    model.oracle.commit(b, [(k[s, i:i + self.chunk], v[s, i:i + self.chunk]) for k, v in written])
                    model.committed[b] += 1

    def end_session_mid_forward(self, fwd: am.ForwardContext, streams: list[tuple[str, str]], where: int) -> None:
        """A member session is reset or closed inside the ``with`` block: the forward is finished in every lane,
        its layers refuse to run, and it aborts as a whole (every stream, in every lane)."""
        sid = streams[where % len(streams)][0]
        session, _ = self.sessions[sid]
        # NOTE: a closed session's contexts are released: their op finds no plan (PlanNotFoundError), as for a KVCache.
        with pytest.raises((am.errors.ForwardFinishedError, am.errors.PlanNotFoundError)), fwd:
            self.expect_outputs(fwd, streams, range(where % self.spec.num_layers), [])
            if where % 3:
                session.reset()
                self.sessions[sid] = (session, SessionModel(PerHeadOracle(self.heads)))
            else:
                session.close()
                del self.sessions[sid]
            assert not fwd.is_active and fwd.status in ("aborted", "released")
            self.expect_outputs(fwd, streams, range(1), [])  # raises: the finished forward touches no pool
        self.forwards_finished({sid})
        for other, b in streams:
            if other in self.sessions:
                self.sessions[other][1].pending[b] = 0

    # ------------------------------------------------------------------ invariants
    @invariant()
    def allocators_are_consistent(self) -> None:
        if not hasattr(self, "cache"):
            return
        for lane in self.cache._lanes:
            lane.allocator.check_invariants()

    @invariant()
    def lanes_hold_what_their_policies_keep(self) -> None:
        if not hasattr(self, "cache"):
            return
        ppc = self.spec.pages_per_chunk
        for p, lane in enumerate(self.cache._lanes):
            refs: Counter[int] = Counter()
            expected = 0
            for session, model in self.sessions.values():
                state = session._lane_branches[p]
                for b in BRANCHES:
                    pages = state[b]
                    resident = len(lane.part.policy.history_indices(model.committed[b]))
                    assert len(pages.history_chunks) == resident, (lane.name, b)
                    assert len(pages.pending) == model.pending[b], (lane.name, b)
                    expected += (resident + model.pending[b]) * ppc
                    refs.update(pg for chunk in pages.history_chunks + pages.pending for pg in chunk)
            # Shared (forked) pages count once in the pool, once per reference in the refcounts.
            allocator = lane.allocator
            assert {pg: allocator.refcount(pg) for pg in allocator.used_pages()} == dict(refs)
            assert sum(refs.values()) == expected and allocator.num_used == len(refs)

    @invariant()
    def lanes_are_in_step(self) -> None:
        if not hasattr(self, "cache"):
            return
        for sid, (session, model) in self.sessions.items():
            for b in BRANCHES:
                lanes = session._lane_pages(b)
                assert {p.token_offset for p in lanes} == {model.committed[b] * self.chunk}
                assert {p.committed_chunks for p in lanes} == {model.committed[b]}
                open_in = {getattr(p.transaction, "is_open", False) for p in lanes}
                assert open_in == {any((sid, b) in f.streams for f in self.open)}, (sid, b)
        for f in self.open:
            assert all(t.is_open for t in f.transactions)  # type: ignore[attr-defined]

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        for session, _ in list(self.sessions.values()):
            session.close()
        assert all(lane.allocator.num_used == 0 for lane in self.cache._lanes)
        assert self.cache.stats().bytes_used == 0 and self.cache.sessions == {}
        self.cache.close()


RetentionGroupsMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=25, deadline=None)
TestRetentionGroupsMachine = RetentionGroupsMachine.TestCase
