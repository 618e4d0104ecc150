"""Rules: populating (atomically, also when the producer fails), clearing and sharing cross caches."""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from ardiff_modules.errors import CrossAttentionNotPopulatedError
from ardiff_modules.errors import TensorMismatchError
from tests.support.failures import Boom
from tests.support.session_model import BRANCHES, CROSS_TOKENS, HEAD_DIM, NUM_LAYERS


class CrossAttentionRules:
    # ================================================================== rules: cross-attention
    @precondition(lambda self: self.open_sessions)
    @rule(
        index=st.integers(0, 8),
        branch=st.sampled_from(BRANCHES),
        mode=st.sampled_from(["ok", "ok", "raise_midway", "bad_shape", "too_few", "too_many"]),
    )
    def populate_cross(self, index: int, branch: str, mode: str) -> None:
        sm = self.pick(self.open_sessions, index)
        tag = float(next(self.tags))

        def layers():
            for layer in range(NUM_LAYERS + (1 if mode == "too_many" else 0)):
                if mode == "raise_midway" and layer == NUM_LAYERS - 1:
                    raise Boom("producer failed after the first layer")
                if mode == "too_few" and layer == NUM_LAYERS - 1:
                    return
                if mode == "bad_shape" and layer == NUM_LAYERS - 1:
                    bad = (CROSS_TOKENS + 1, self.kv_heads, HEAD_DIM)
                    yield torch.zeros(bad), torch.zeros(bad)
                    return
                yield self.cross_value(tag, layer)

        if mode == "ok":
            sm.state.populate_cross_attention(branch, "text", layers())
            sm.cross[branch] = tag
            return
        exc = Boom if mode == "raise_midway" else TensorMismatchError
        self.expect_failure(exc, sm.state.populate_cross_attention, branch, "text", layers())

    @precondition(lambda self: self.open_sessions)
    @rule(index=st.integers(0, 8))
    def clear_cross(self, index: int) -> None:
        sm = self.pick(self.open_sessions, index)
        visible = {b: sm.state.history_chunks(b) for b in BRANCHES}
        sm.state.clear_cross_attention()
        sm.cross.clear()
        assert {b: sm.state.history_chunks(b) for b in BRANCHES} == visible  # self-attention untouched

    @precondition(lambda self: self.open_sessions)
    @rule(i=st.integers(0, 8), j=st.integers(0, 8), branch=st.sampled_from((None,) + BRANCHES))
    def share_cross(self, i: int, j: int, branch: str | None) -> None:
        """Reuse another session's populated cross cache; refused unchanged if any branch lacks it."""
        target = self.pick(self.open_sessions, i)
        source = self.pick(self.sessions_of(target.cm), j)
        names = BRANCHES if branch is None else (branch,)
        if not all(b in source.cross for b in names):
            self.expect_failure(
                CrossAttentionNotPopulatedError, target.state.share_cross_attention_from, source.state, "text", branch
            )
            return
        target.state.share_cross_attention_from(source.state, "text", branch)
        for b in names:
            target.cross[b] = source.cross[b]
