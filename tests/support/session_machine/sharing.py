"""Rules: forks sharing resident chunks by refcount, and sessions sharing another session's sinks."""

from __future__ import annotations

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from ardiff_modules.errors import SpecError
from tests.support.session_model import BRANCHES, MAX_SESSIONS, SessionModel


class SharingRules:
    # ================================================================== rules: sharing
    @precondition(lambda self: any(len(self.sessions_of(s.cm)) < MAX_SESSIONS for s in self.open_sessions))
    @rule(
        index=st.integers(0, 8),
        branches=st.sampled_from([None, ("cond",), ("uncond",), ("uncond", "cond"), "cond"]),
        share_cross=st.booleans(),
        pre_steps=st.sampled_from([0, 1, "fill"]),
        parent_steps=st.integers(0, 4),
    )
    def fork(
        self, index: int, branches: tuple[str, ...] | None, share_cross: bool, pre_steps, parent_steps: int
    ) -> None:
        """A child session sharing the parent's resident chunks by refcount (zero pages allocated or written).

        The parent first fills its window a little (``pre_steps``), then moves on after the fork: its
        evictions must neither free nor overwrite pages the child still sees (with extents: an evicted
        slot the child still sees is not reused).
        """
        parent = self.pick([s for s in self.open_sessions if len(self.sessions_of(s.cm)) < MAX_SESSIONS], index)
        names = BRANCHES if branches is None else (branches,) if isinstance(branches, str) else branches
        if pre_steps == "fill":  # sinks and window full: the parent's next commits evict shared chunks
            window = self.window if self.window is not None else 1
            pre_steps = max(0, self.sinks + window - min(len(parent.committed[b]) for b in names))
        self.roll(parent, names, pre_steps)
        lanes = parent.cm.cache._lanes
        free_before = [lane.allocator.free_pages() for lane in lanes]
        child_state = parent.state.fork(branches=branches, share_cross_attention=share_cross)
        assert [lane.allocator.free_pages() for lane in lanes] == free_before, "fork must not allocate (any lane)"
        child = SessionModel(child_state, parent.cm)
        for b in names:
            child.committed[b] = list(parent.committed[b])  # same visible chunks (same contents), same offset
            child.copy_shots(parent, b)  # the same dropped window and shot
            for lane, selected in enumerate(parent.selected):  # the same content selection (its pages shared)
                child.selected[lane][b] = selected[b]
            if any(selected[b] is not None for selected in parent.selected):
                event("fork shared a content selection")
            if share_cross and b in parent.cross:
                child.cross[b] = parent.cross[b]
        self.sessions.append(child)
        event("forked a session")
        self.roll(parent, names, parent_steps)

    @precondition(lambda self: self.open_sessions)
    @rule(i=st.integers(0, 8), j=st.integers(0, 8), branch=st.sampled_from(BRANCHES))
    def share_sinks(self, i: int, j: int, branch: str) -> None:
        """Start an empty branch from another session's sink chunks; a non-empty branch is refused unchanged."""
        target = self.pick(self.open_sessions, i)
        # Prefer a source that has committed chunks on the branch (sinks to share).
        same = sorted(self.sessions_of(target.cm), key=lambda s: not s.committed[branch])
        source = same[j % len(same)] if j % 2 else same[0]
        sinks = self.sinks
        if target.committed[branch] or target.pending[branch]:
            self.expect_failure(SpecError, target.state.share_sinks_from, source.state, branch, match=repr(branch))
            return
        if sinks == 0 or len(source.committed[branch]) < sinks:  # the source must hold all its sinks
            self.expect_failure(SpecError, target.state.share_sinks_from, source.state, branch, match=repr(branch))
            return
        target.state.share_sinks_from(source.state, branch)
        target.committed[branch] = list(source.committed[branch][:sinks])
        target.clear_shots(branch)  # only the sinks: no shot
        target.drop_selection(branch)  # (nor a content selection)
        target.sink_only[branch] = sinks  # a frame lane holds only their sink frames
        # The stream's sinks are the most any group keeps: a group keeping fewer never shared the chunks between
        # its sinks and the clock (dropped, as below a dropped window); uniform: all of them are sinks.
        target.floor[branch] = sinks
        for extent in target.lane_extent:
            extent[branch] = None  # an empty branch restarts from scratch (its extent is released)
        event("shared sinks")
