"""Re-cache with retention groups (issue 41): the rule planned per lane, one forward over the union.

The oracle is cache-free: it keeps every committed chunk's latents and the prompt its K/V were last computed
under, recomputes K/V from scratch, and gives each head the chunks its own group sees -- during the re-cache the
group's kept sinks and the union's rebuilt chunks the rule shows, afterwards the group's policy window.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

import ardiff_modules as am
from ardiff_modules.core.recache import RecacheRule

LAYERS, KV_HEADS, D, DIM, CHUNK, PAGE = 2, 3, 4, 6, 4, 2
TOL = dict(atol=1e-5, rtol=1e-5)
# lane 0 is the SHORT group (declared first): the long group keeps chunks lane 0 evicted.
GROUPS = {"local": (0, 1), "global": (1, 3)}
ROWS = [["global", "local", "local"], ["local", "global", "global"]]


class Model:
    """Per layer, q/k/v are projections of the chunk's latents plus a prompt's bias (no mixing across layers)."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.w = torch.randn(LAYERS, 3, DIM, KV_HEADS * D, generator=g)
        self.bias: dict[int, torch.Tensor] = {}
        self.g = g

    def prompt_bias(self, prompt: int) -> torch.Tensor:
        if prompt not in self.bias:
            self.bias[prompt] = torch.randn(LAYERS, 3, KV_HEADS * D, generator=self.g)
        return self.bias[prompt]

    def qkv(self, x: torch.Tensor, layer: int, prompt: int) -> list[torch.Tensor]:
        """``x [..., n, DIM]`` -> q, k, v ``[..., n, KV_HEADS, D]``."""
        b = self.prompt_bias(prompt)
        return [(x @ self.w[layer, i] + b[layer, i]).unflatten(-1, (KV_HEADS, D)) for i in range(3)]


@dataclass
class Oracle:
    model: Model
    heads: am.HeadRetention
    latents: list[torch.Tensor] = field(default_factory=list)
    version: list[int] = field(default_factory=list)  # the prompt each chunk's K/V were last computed under

    def kv(self, i: int, layer: int, prompt: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        _, k, v = self.model.qkv(self.latents[i], layer, self.version[i] if prompt is None else prompt)
        return k, v

    def policy(self, layer: int, head: int) -> am.RetentionPolicy:
        return self.heads.groups[self.heads.group_of(layer, head)]

    def attend(self, q: torch.Tensor, keys: list[tuple[torch.Tensor, torch.Tensor]], head: int) -> torch.Tensor:
        k = torch.cat([c[0][:, head] for c in keys])
        v = torch.cat([c[1][:, head] for c in keys])
        return F.scaled_dot_product_attention(q[None, :, head][None], k[None, None], v[None, None])[0, 0]

    def forward(self, x: torch.Tensor, prompt: int) -> torch.Tensor:
        """One committing chunk: each head attends its group's window of the committed chunks, then itself."""
        n = len(self.latents)
        out = []
        for layer in range(LAYERS):
            q, k, v = self.model.qkv(x, layer, prompt)
            heads = []
            for h in range(KV_HEADS):
                visible = [self.kv(i, layer) for i in self.policy(layer, h).history_indices(n)]
                heads.append(self.attend(q, visible + [(k, v)], h))
            out.append(torch.stack(heads, 1))
        self.latents.append(x)
        self.version.append(prompt)
        return torch.stack(out)

    def plans(self, rule: RecacheRule) -> tuple[list[int], dict[str, list[int]]]:
        """The union of the groups' rebuilt chunks, and per group its kept sinks outside the union."""
        n = len(self.latents)
        plans = {}
        for name, policy in self.heads.groups.items():
            history = policy.history_indices(n)
            plans[name] = (history, rule.plan(history, n, policy.sink_chunks, set(range(n))))
        union = sorted({i for _, plan in plans.values() for i in plan.rebuilt})
        kept = {name: [h[p] for p in plan.kept if h[p] not in union] for name, (h, plan) in plans.items()}
        return union, kept

    def recache(self, rule: RecacheRule, prompt: int) -> torch.Tensor:
        """The re-cache forward's output ``[layers, tokens, heads, d]``; afterwards the union is re-computed."""
        union, kept = self.plans(rule)
        out = []
        for layer in range(LAYERS):
            new = {i: self.kv(i, layer, prompt) for i in union}
            rows = []
            for t, j in enumerate(union):
                q = self.model.qkv(self.latents[j], layer, prompt)[0]
                shown = union[: t + 1] if rule.attention == "block_causal" else union
                heads = []
                for h in range(KV_HEADS):
                    old = [self.kv(i, layer) for i in kept[self.heads.group_of(layer, h)]]
                    heads.append(self.attend(q, old + [new[i] for i in shown], h))
                rows.append(torch.stack(heads, 1))
            out.append(torch.cat(rows))
        for i in union:
            self.version[i] = prompt
        return torch.stack(out)


def make(rule: RecacheRule, extents: bool = False) -> tuple[am.KVCache, am.KVState, Oracle]:
    heads = am.HeadRetention(GROUPS, ROWS)
    spec = am.KVCacheSpec(
        num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=D, chunk_size=CHUNK, page_size=PAGE,
        branches=("cond",), dtype="float32", head_retention=heads, recache=rule,
    )
    cache = am.KVCache(spec, num_pages=200, backend="reference", contiguous_extents=extents)
    return cache, cache.open_session("s"), Oracle(Model(), heads)


def step(state: am.KVState, oracle: Oracle, g: torch.Generator, prompt: int, keep: bool = True) -> None:
    x = torch.randn(CHUNK, DIM, generator=g)
    kept = {"keep_latents": x[None]} if keep else {}
    outs = []
    with state.prepare_forward(("cond",), CHUNK, True, **kept) as fwd:
        for layer, ctx in enumerate(fwd.layers):
            q, k, v = oracle.model.qkv(x[None], layer, prompt)
            outs.append(am.chunk_attention(q, k, v, ctx)[0])
    torch.testing.assert_close(torch.stack(outs), oracle.forward(x, prompt), **TOL)


def run_recache(state: am.KVState, oracle: Oracle, rule: RecacheRule, prompt: int, commit: bool = True) -> None:
    x = state.recache_latents(("cond",), rule=rule)[0]
    union, _ = oracle.plans(rule)
    assert list(state.recache_chunk_indices("cond", rule=rule)) == union
    torch.testing.assert_close(x, torch.cat([oracle.latents[i] for i in union]))
    outs = []
    fwd = state.prepare_recache(("cond",), rule=rule)
    for layer, ctx in enumerate(fwd.layers):
        q, k, v = oracle.model.qkv(x[None], layer, prompt)
        outs.append(am.chunk_attention(q, k, v, ctx)[0])
    if not commit:
        fwd.abort()
        return
    fwd.commit()
    torch.testing.assert_close(torch.stack(outs), oracle.recache(rule, prompt), **TOL)


def check_pools(cache: am.KVCache, state: am.KVState, oracle: Oracle) -> None:
    """Every lane's history pages hold, for its heads, the K/V the oracle recomputes for that chunk."""
    for lane, h in zip(cache._lanes, state._lane_pages("cond")):
        part = lane.part
        assert part is not None
        assert list(h.history_index) == part.policy.history_indices(len(oracle.latents))
        for li, (layer, heads) in enumerate(zip(part.layers, part.heads)):
            for chunk, index in zip(h.history, h.history_index):
                k, v = oracle.kv(index, layer)
                got_k = lane.pool.k_pages(li)[list(chunk)].flatten(0, 1)
                got_v = lane.pool.v_pages(li)[list(chunk)].flatten(0, 1)
                torch.testing.assert_close(got_k, k[:, list(heads)], **TOL)
                torch.testing.assert_close(got_v, v[:, list(heads)], **TOL)


RULES = {
    "block_causal_keep": RecacheRule(),
    "block_causal_rebuild": RecacheRule.from_keep_sinks(False),
    "longlive": RecacheRule.longlive(),
}


@pytest.mark.parametrize("extents", [False, True])
@pytest.mark.parametrize("chunks", [2, 6])
@pytest.mark.parametrize("name", list(RULES))
def test_grouped_recache_matches_the_per_head_oracle(name: str, chunks: int, extents: bool) -> None:
    rule = RULES[name]
    cache, state, oracle = make(rule, extents)
    g = torch.Generator().manual_seed(1)
    for _ in range(chunks):
        step(state, oracle, g, prompt=0)
    union, _ = oracle.plans(rule)
    lane0 = state._lane_pages("cond")[0]
    # lane 0 (the short group) keeps fewer chunks than the union rebuilds: latents come from any lane
    assert set(union) - set(lane0.history_index) or chunks == 2
    run_recache(state, oracle, rule, prompt=1)
    check_pools(cache, state, oracle)
    for _ in range(3):  # later forwards see the re-cached history; windows keep rolling
        step(state, oracle, g, prompt=1)
    check_pools(cache, state, oracle)
    state.close()
    for lane in cache._lanes:
        assert lane.allocator.num_free == lane.allocator.num_pages


def lane_snapshot(cache: am.KVCache, state: am.KVState) -> list[tuple]:
    rows = []
    for lane, h in zip(cache._lanes, state._lane_pages("cond")):
        used = sorted({p for c in h.history for p in c})
        rows.append((
            h.history, h.history_index, h.history_start, h.pending, h.committed_chunks, h.committed_tokens,
            lane.allocator.free_pages(), [lane.allocator.refcount(p) for p in range(lane.allocator.num_pages)],
            lane.pool.kv[:, :, used].clone(),
        ))
    return rows


@pytest.mark.parametrize("extents", [False, True])
@pytest.mark.parametrize("name", [*RULES, "longlive_move"])
def test_grouped_recache_abort_restores_every_lane_exactly(name: str, extents: bool) -> None:
    rule = RULES.get(name, RecacheRule.longlive(global_sink=False))
    cache, state, oracle = make(rule, extents)
    g = torch.Generator().manual_seed(2)
    for _ in range(5):
        step(state, oracle, g, prompt=0)
    before = lane_snapshot(cache, state)
    run_recache(state, oracle, rule, prompt=1, commit=False)
    after = lane_snapshot(cache, state)
    for a, b in zip(before, after):
        for x, y in zip(a, b):
            if isinstance(x, torch.Tensor):
                assert torch.equal(x, y)
            else:
                assert x == y
    step(state, oracle, g, prompt=0)  # history as before: the old prompt's K/V still attended


def test_grouped_recache_union_and_lane_plans() -> None:
    """6 chunks, local (0 sinks, window 1) and global (1 sink, window 3): the union is global's rebuilt chunks;
    in the local lane everything but its own chunk is context, released at commit."""
    cache, state, oracle = make(RecacheRule())
    g = torch.Generator().manual_seed(3)
    for _ in range(6):
        step(state, oracle, g, prompt=0)
    assert state.recache_chunk_indices("cond") == (3, 4, 5)
    fwd = state.prepare_recache(("cond",))
    assert fwd.positions[0].tolist() == list(range(12, 24))
    lanes = state._lane_pages("cond")
    groups = [lane.part.group for lane in cache._lanes]
    assert groups == ["local", "local", "global", "global"]  # (group, heads per layer): 4 lanes
    assert all(len(h.pending) == 3 for h in lanes)
    free = [lane.allocator.num_free for lane in cache._lanes]
    for layer, ctx in enumerate(fwd.layers):
        q, k, v = oracle.model.qkv(torch.cat(oracle.latents[3:])[None], layer, 1)
        am.chunk_attention(q, k, v, ctx)
    fwd.commit()
    for lane, h, group, was in zip(cache._lanes, lanes, groups, free):
        if group == "local":
            assert h.history_index == (5,)
            assert lane.allocator.num_free == was + 3 * CHUNK // PAGE  # context (2) + the old chunk 5
        else:
            assert h.history_index == (0, 3, 4, 5)
            assert lane.allocator.num_free == was + 3 * CHUNK // PAGE  # the old chunks 3, 4, 5


def test_grouped_recache_of_nothing_is_refused() -> None:
    cache, state, oracle = make(RecacheRule())
    with pytest.raises(am.SpecError, match="at least one resident chunk"):
        state.prepare_recache(("cond",))


@pytest.mark.parametrize("name", ["block_causal", "rebuild_sinks", "longlive"])
@pytest.mark.parametrize("extents", [False, True])
@pytest.mark.parametrize("groups", [GROUPS, {"local": (1, 1), "global": (0, 3)}], ids=["nested", "disjoint"])
def test_admission_keeps_room_for_one_union_recache_in_every_lane(
    name: str, extents: bool, groups: dict[str, tuple[int, int]]
) -> None:
    """With every admitted session at its peak, any one of them can re-cache (admission's promise): in a short
    lane the union's chunks the long lane keeps ride as context chunks, so its reserve counts the union (which
    can exceed any one lane's history: sink 1 + window 1 and sink 0 + window 3 rebuild 4 chunks together)."""
    rule = {"block_causal": RecacheRule(), "rebuild_sinks": RecacheRule.from_keep_sinks(False),
            "longlive": RecacheRule.longlive()}[name]
    heads = am.HeadRetention(groups, ROWS)
    spec = am.KVCacheSpec(
        num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=D, chunk_size=CHUNK, page_size=PAGE,
        branches=("cond",), dtype="float32", head_retention=heads, recache=rule,
    )
    probe = am.KVCache(spec, num_pages=1000, backend="reference", contiguous_extents=extents)
    per_session = [lane.admission.pages_per_session() for lane in probe._lanes]
    reserve = [lane.admission.recache_reserve() for lane in probe._lanes]
    # pools of exactly three sessions' peaks plus the reserve, lane by lane
    cache = am.KVCache(spec, num_pages=1000, backend="reference", contiguous_extents=extents)
    for lane, peak, extra in zip(cache._lanes, per_session, reserve):
        lane.allocator.__init__(3 * peak + extra)  # a fresh allocator of exactly that many pages
    assert cache.sessions_that_fit() == 3
    sessions = [cache.admit_session(f"s{i}") for i in range(3)]
    oracles = [Oracle(Model(), heads) for _ in sessions]
    g = torch.Generator().manual_seed(5)
    for _ in range(5):
        for state, oracle in zip(sessions, oracles):
            step(state, oracle, g, 0)
    for state, oracle in zip(sessions, oracles):
        run_recache(state, oracle, rule, 1)  # no CapacityError: the reserve held every lane's union
