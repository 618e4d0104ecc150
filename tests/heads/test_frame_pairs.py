"""Frame-level retention (``FrameWindowPolicy``) paired with the other capabilities, each against a cache-free
oracle that re-states the frame rule on its own:

    stream frame ``g = chunk_index * F + f`` stays when ``g < sink_frames`` or ``g >= committed_frames -
    window_frames`` (and, after ``KVState.drop_window`` at ``n`` committed chunks, a non-sink frame stays only when
    ``g >= n * F``: the window was dropped).

A chunk group (``SinkWindowPolicy``) keeps whole chunks (``history_indices``). Every check reads the pools too:
the pages a lane holds for a chunk hold exactly the K/V of that chunk's kept frames (in frame order).

Re-cache semantics (decided here, as ``tests/heads/test_head_recache.py`` treats chunk groups): the re-cache
forward recomputes the union's chunks as the rule shows them -- *whole* (a chunk is rebuilt whole: its latents
are per chunk, and it is pending while rebuilt), exactly as a chunk group's heads see union chunks their own
window does not keep (context). Sinks the rule keeps are attended as they are held: trimmed to their kept frames.
At commit each rebuilt chunk is trimmed like the slot it replaces (a moved sink keeps the sink slot's frame
offsets of the moved chunk), and later forwards see the frame rule over the recomputed K/V.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

import ardiff_modules as am
from ardiff_modules.core.recache import RecacheRule
from tests.support.projection_model import ProjectionModel

LAYERS, KV_HEADS, D, DIM, FRAMES, PAGE = 2, 3, 4, 6, 3, 2
CHUNK = FRAMES * PAGE  # a frame = one page
FT = CHUNK // FRAMES  # tokens a frame
TOL = dict(atol=1e-5, rtol=1e-5)
# Forcing-KV's "sink frame + last frame", a wider frame group whose sink chunk also holds window frames early on,
# and a chunk group beside them
GROUPS = {"fkv": am.FrameWindowPolicy(1, 1, FRAMES), "wide": am.FrameWindowPolicy(2, 4, FRAMES), "chunks": (1, 2)}
ROWS = [["fkv", "wide", "chunks"], ["chunks", "fkv", "wide"]]
UNIFORM = am.FrameWindowPolicy(2, 4, FRAMES)
# frame groups alone: the union of their keys holds trimmed chunks too (a chunk group keeps whole ones)
FRAME_GROUPS = {"fkv": am.FrameWindowPolicy(1, 1, FRAMES), "wide": am.FrameWindowPolicy(2, 4, FRAMES)}
FRAME_ROWS = [["fkv", "wide", "wide"], ["wide", "fkv", "fkv"]]


# ---------------------------------------------------------------------------------------------- the frame rule
def kept_frames(policy: am.RetentionPolicy, index: int, committed: int, floor: int = 0) -> list[int]:
    """Frames (within chunk ``index``) a head under ``policy`` reads once ``committed`` chunks are committed (a
    chunk policy: every frame of the chunks ``history_indices`` keeps; ``floor``: ``drop_window`` at that many)."""
    if not isinstance(policy, am.FrameWindowPolicy):
        return list(range(FRAMES)) if index in policy.history_indices(committed) else []
    s, w = policy.sink_frames, policy.window_frames
    total = committed * FRAMES
    out = []
    for f in range(FRAMES):
        g = index * FRAMES + f
        if g < s or ((w is None or g >= total - w) and g >= floor * FRAMES):
            out.append(f)
    return out


def kept_chunks(policy: am.RetentionPolicy, committed: int, floor: int = 0) -> list[int]:
    return [i for i in range(committed) if kept_frames(policy, i, committed, floor)] if isinstance(
        policy, am.FrameWindowPolicy) else [i for i in policy.history_indices(committed)
                                             if i < policy.sink_chunks or i >= floor]


def rows_of(frames: list[int]) -> list[int]:
    return [r for f in frames for r in range(f * FT, (f + 1) * FT)]


def as_policy(group: object) -> am.RetentionPolicy:
    return am.SinkWindowPolicy(*group) if isinstance(group, tuple) else group  # type: ignore[misc,return-value]


# ---------------------------------------------------------------------------------------------- model and oracle
class Model(ProjectionModel):
    """Per layer, q/k/v are projections of the chunk's latents plus a prompt's bias (no mixing across layers)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(LAYERS, DIM, KV_HEADS, D, seed)


@dataclass
class Oracle:
    """Every committed chunk's latents; per group, what each commit index's slot holds: ``(source chunk, prompt)``
    (a moved sink slot holds another chunk's K/V)."""

    model: Model
    groups: dict[str, am.RetentionPolicy]
    rows: list[list[str]]
    latents: list[torch.Tensor] = field(default_factory=list)
    held: dict[str, dict[int, tuple[int, int]]] = field(default_factory=dict)
    floor: int = 0

    def __post_init__(self) -> None:
        self.held = {name: {} for name in self.groups}

    @property
    def n(self) -> int:
        return len(self.latents)

    def kv(self, group: str, index: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        source, prompt = self.held[group][index]
        _, k, v = self.model.qkv(self.latents[source], layer, prompt)
        return k, v

    def history(self, group: str, layer: int, head: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        policy = self.groups[group]
        out = []
        for i in kept_chunks(policy, self.n, self.floor):
            r = rows_of(kept_frames(policy, i, self.n, self.floor))
            k, v = self.kv(group, i, layer)
            out.append((k[r, head], v[r, head]))
        return out

    def forward(self, x: torch.Tensor, prompt: int, commit: bool = True,
                mask: torch.Tensor | None = None, columns: dict[int, int] | None = None) -> torch.Tensor:
        """One chunk: each head over its group's kept frames, then the chunk itself (``[layers, CHUNK, heads, d]``).
        ``mask [CHUNK, keys]`` with ``columns`` (absolute position -> column; pending columns follow)."""
        out = []
        for layer in range(LAYERS):
            q, k, v = self.model.qkv(x, layer, prompt)
            heads = []
            for h in range(KV_HEADS):
                group = self.rows[layer][h]
                past = self.history(group, layer, h)
                kk = torch.cat([c[0] for c in past] + [k[:, h]])
                vv = torch.cat([c[1] for c in past] + [v[:, h]])
                m = None
                if mask is not None:
                    assert columns is not None
                    pos = [p for p in self.positions(group)]
                    cols = [columns[p] for p in pos] + [len(columns) + t for t in range(CHUNK)]
                    m = mask[:, cols][None, None]
                heads.append(F.scaled_dot_product_attention(q[None, None, :, h], kk[None, None], vv[None, None],
                                                            attn_mask=m)[0, 0])
            out.append(torch.stack(heads, 1))
        if commit:
            for name in self.groups:
                self.held[name][self.n] = (self.n, prompt)
            self.latents.append(x)
        return torch.stack(out)

    def positions(self, group: str) -> list[int]:
        """Absolute positions of the history tokens ``group`` keeps (no moved sinks), in order."""
        policy = self.groups[group]
        return [i * CHUNK + r for i in kept_chunks(policy, self.n, self.floor)
                for r in rows_of(kept_frames(policy, i, self.n, self.floor))]

    # ------------------------------------------------------------------ re-cache
    def plans(self, rule: RecacheRule) -> tuple[list[int], dict[str, tuple[list[int], am.RecachePlan]]]:
        """The union of the groups' rebuilt chunks (planned over each group's kept chunks), and each group's plan."""
        plans = {}
        for name, policy in self.groups.items():
            history = kept_chunks(policy, self.n)
            plans[name] = (history, rule.plan(history, self.n, policy.sink_chunks, set(range(self.n))))
        return sorted({i for _, plan in plans.values() for i in plan.rebuilt}), plans

    def recache(self, rule: RecacheRule, prompt: int) -> torch.Tensor:
        """The re-cache forward (``[layers, union tokens, heads, d]``): each union chunk, whole, over its group's
        kept sinks (trimmed as held) and the rebuilt chunks the rule shows (whole); then the slots are updated."""
        union, plans = self.plans(rule)
        kept = {name: [h[p] for p in plan.kept if h[p] not in union] for name, (h, plan) in plans.items()}
        out = []
        for layer in range(LAYERS):
            new = {i: self.model.qkv(self.latents[i], layer, prompt) for i in union}
            rows = []
            for t, j in enumerate(union):
                shown = union[: t + 1] if rule.attention == "block_causal" else union
                heads = []
                for h in range(KV_HEADS):
                    group = self.rows[layer][h]
                    policy = self.groups[group]
                    old = []
                    for i in kept[group]:
                        r = rows_of(kept_frames(policy, i, self.n))
                        k, v = self.kv(group, i, layer)
                        old.append((k[r, h], v[r, h]))
                    kk = torch.cat([c[0] for c in old] + [new[i][1][:, h] for i in shown])
                    vv = torch.cat([c[1] for c in old] + [new[i][2][:, h] for i in shown])
                    q = new[j][0][:, h]
                    heads.append(F.scaled_dot_product_attention(q[None, None], kk[None, None], vv[None, None])[0, 0])
                rows.append(torch.stack(heads, 1))
            out.append(torch.cat(rows))
        for name, (history, plan) in plans.items():
            for index, slot in zip(plan.rebuilt, plan.replaces):
                if slot is not None:
                    self.held[name][history[slot]] = (index, prompt)
            for i in union:  # a kept sink the union rebuilds is rebuilt in place (not a slot a moved sink took)
                if i in history and i not in plan.rebuilt and history.index(i) not in plan.replaces:
                    self.held[name][i] = (i, prompt)
        return torch.stack(out)


# ---------------------------------------------------------------------------------------------- the cache side
def make(kind: str, rule: RecacheRule | None = None, extents: bool = False, relative_sinks: bool = False,
         pages: int = 400) -> tuple[am.KVCache, am.KVState, Oracle]:
    if kind == "uniform":
        retention: dict[str, object] = {"retention": UNIFORM}
        groups, rows = {"all": UNIFORM}, [["all"] * KV_HEADS for _ in range(LAYERS)]
    else:
        declared, rows = (GROUPS, ROWS) if kind == "groups" else (FRAME_GROUPS, FRAME_ROWS)
        retention = {"head_retention": am.HeadRetention(declared, rows)}
        groups = {k: as_policy(v) for k, v in declared.items()}
    spec = am.KVCacheSpec(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=D, chunk_size=CHUNK, page_size=PAGE,
                          branches=("cond",), dtype="float32", recache=rule or RecacheRule(),
                          relative_sinks=relative_sinks, **retention)  # type: ignore[arg-type]
    cache = am.KVCache(spec, num_pages=pages, backend="reference", contiguous_extents=extents)
    return cache, cache.open_session("s"), Oracle(Model(), groups, rows)


def lane_parts(cache: am.KVCache) -> list[tuple[object, str, tuple[int, ...], list[tuple[int, ...]]]]:
    """Per lane: ``(lane, group, layers, heads per layer)``."""
    out = []
    for lane in cache._lanes:
        if lane.part is None:
            out.append((lane, "all", tuple(range(LAYERS)), [tuple(range(KV_HEADS))] * LAYERS))
        else:
            out.append((lane, lane.part.group, lane.part.layers, [tuple(h) for h in lane.part.heads]))
    return out


def step(state: am.KVState, oracle: Oracle, g: torch.Generator, prompt: int, commit: bool = True) -> None:
    x = torch.randn(CHUNK, DIM, generator=g)
    outs = []
    kept = {"keep_latents": x[None]} if commit else {}
    with state.prepare_forward(("cond",), CHUNK, commit, **kept) as fwd:
        for layer, ctx in enumerate(fwd.layers):
            q, k, v = oracle.model.qkv(x[None], layer, prompt)
            outs.append(am.chunk_attention(q, k, v, ctx)[0])
    torch.testing.assert_close(torch.stack(outs), oracle.forward(x, prompt, commit), **TOL)


def check_pools(cache: am.KVCache, state: am.KVState, oracle: Oracle) -> None:
    """Every lane keeps the frame rule's chunks, each holding exactly its kept frames' K/V (the oracle's)."""
    for (lane, group, layers, heads), h in zip(lane_parts(cache), state._lane_pages("cond")):
        policy = oracle.groups[group]
        assert list(h.history_index) == kept_chunks(policy, oracle.n, oracle.floor), (group, h.history_index)
        for j, (chunk, index) in enumerate(zip(h.history, h.history_index)):
            rows = rows_of(kept_frames(policy, index, oracle.n, oracle.floor))
            assert len(chunk) * PAGE == len(rows), (group, index, chunk)
            if oracle.held[group][index][0] == index:  # not a moved sink: its spans are its kept frames
                assert h.chunk_spans(j) == _runs([index * CHUNK + r for r in rows]), (group, index)
            for li, (layer, kv_heads) in enumerate(zip(layers, heads)):
                k, v = oracle.kv(group, index, layer)
                got_k = lane.pool.k_pages(li)[list(chunk)].flatten(0, 1)
                got_v = lane.pool.v_pages(li)[list(chunk)].flatten(0, 1)
                torch.testing.assert_close(got_k, k[rows][:, list(kv_heads)], **TOL)
                torch.testing.assert_close(got_v, v[rows][:, list(kv_heads)], **TOL)


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    for p in positions:
        if spans and spans[-1][0] + spans[-1][1] == p:
            spans[-1] = (spans[-1][0], spans[-1][1] + 1)
        else:
            spans.append((p, 1))
    return spans


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


def snapshot(cache: am.KVCache, state: am.KVState) -> list[tuple]:
    rows = []
    for lane, h in zip(cache._lanes, state._lane_pages("cond")):
        used = sorted({p for c in h.history for p in c})
        rows.append((
            h.history, h.history_index, h.history_start, h.history_kept, h.pending, h.committed_chunks,
            h.committed_tokens, dict(h.recent), lane.allocator.free_pages(),
            [lane.allocator.refcount(p) for p in range(lane.allocator.num_pages)], lane.pool.kv[:, :, used].clone(),
        ))
    return rows


RULES = {
    "block_causal_keep": RecacheRule(),
    "block_causal_rebuild": RecacheRule.from_keep_sinks(False),
    "longlive": RecacheRule.longlive(),
    "longlive_move": RecacheRule.longlive(global_sink=False),
}


# ---------------------------------------------------------------------------------------------- 1. re-cache x frames
@pytest.mark.parametrize("kind", ["uniform", "groups", "frames"])
@pytest.mark.parametrize("extents", [False, True], ids=["paged", "extents"])
@pytest.mark.parametrize("chunks", [2, 3, 7])
@pytest.mark.parametrize("name", list(RULES))
def test_recache_of_trimmed_chunks_matches_the_frame_oracle(name: str, chunks: int, extents: bool, kind: str) -> None:
    """Every rule, after 2 (a window frame inside the sink chunk), 3 and 7 chunks (windows slid, sinks moved):
    the re-cache forward, the pools after it (rebuilt chunks trimmed like their slots; with extents copied into
    ring slots' first pages), then three forwards whose windows keep rolling, twice re-cached."""
    rule = RULES[name]
    cache, state, oracle = make(kind, rule, extents)
    g = torch.Generator().manual_seed(chunks)
    for _ in range(chunks):
        step(state, oracle, g, prompt=0)
    check_pools(cache, state, oracle)
    run_recache(state, oracle, rule, prompt=1)
    check_pools(cache, state, oracle)
    for _ in range(3):
        step(state, oracle, g, prompt=1, commit=False)
        step(state, oracle, g, prompt=1)
        check_pools(cache, state, oracle)
    run_recache(state, oracle, rule, prompt=2)
    check_pools(cache, state, oracle)
    step(state, oracle, g, prompt=2)
    check_pools(cache, state, oracle)
    if extents:  # the ring stays whole: every resident page is an extent page
        for h in state._lane_pages("cond"):
            assert set(h.history_pages()) <= set(h.extent)
    state.close()
    for lane in cache._lanes:
        assert lane.allocator.num_free == lane.allocator.num_pages


@pytest.mark.parametrize("kind", ["uniform", "groups"])
@pytest.mark.parametrize("extents", [False, True], ids=["paged", "extents"])
@pytest.mark.parametrize("name", list(RULES))
def test_recache_abort_restores_every_frame_lane_exactly(name: str, extents: bool, kind: str) -> None:
    rule = RULES[name]
    cache, state, oracle = make(kind, rule, extents)
    g = torch.Generator().manual_seed(2)
    for _ in range(6):
        step(state, oracle, g, prompt=0)
    before = snapshot(cache, state)
    run_recache(state, oracle, rule, prompt=1, commit=False)
    after = snapshot(cache, state)
    for a, b in zip(before, after):
        for x, y in zip(a, b):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    step(state, oracle, g, prompt=0)  # the old prompt's trimmed K/V still attended
    check_pools(cache, state, oracle)


def test_recache_forward_attends_rebuilt_chunks_whole_and_kept_sinks_trimmed() -> None:
    """The layout of a re-cache forward: under "sink frame + last frame" after 4 chunks, the kept sink is its
    sink frame alone (one page at 0), the rebuilt chunk (3) is pending whole at its own positions."""
    policy = am.FrameWindowPolicy(1, 1, FRAMES)
    spec = am.KVCacheSpec(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=D, chunk_size=CHUNK, page_size=PAGE,
                          branches=("cond",), dtype="float32", retention=policy)
    cache = am.KVCache(spec, num_pages=100, backend="reference")
    state = cache.open_session("s")
    oracle = Oracle(Model(), {"all": policy}, [["all"] * KV_HEADS] * LAYERS)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        step(state, oracle, g, prompt=0)
    (h,) = state._lane_pages("cond")
    assert h.history_index == (0, 3) and h.history_spans() == [(0, FT), (3 * CHUNK + 2 * FT, FT)]
    fwd = state.prepare_recache(("cond",))
    assert fwd.positions[0].tolist() == list(range(3 * CHUNK, 4 * CHUNK))
    assert [len(c) for c in h.pending] == [FRAMES]  # whole while pending
    fwd.abort()
    run_recache(state, oracle, RecacheRule(), prompt=1)
    check_pools(cache, state, oracle)


# ---------------------------------------------------------------------------------------------- 6. shots x frames
@pytest.mark.parametrize("kind", ["uniform", "groups", "frames"])
@pytest.mark.parametrize("before", [1, 2, 5])
def test_drop_window_keeps_the_sink_frames_alone(kind: str, before: int) -> None:
    """``drop_window`` after 1 chunk (the sink chunk also holds window frames), 2 and 5: every lane keeps its sink
    frames alone -- a window frame inside a sink chunk goes too -- and later commits never bring a dropped frame
    back; each held page's K/V and every later forward equal the frame oracle's (floor: the drop)."""
    cache, state, oracle = make(kind)
    g = torch.Generator().manual_seed(before)
    for _ in range(before):
        step(state, oracle, g, prompt=0)
    state.drop_window("cond")
    oracle.floor = oracle.n
    check_pools(cache, state, oracle)
    for _ in range(4):
        step(state, oracle, g, prompt=0, commit=False)
        step(state, oracle, g, prompt=0)
        check_pools(cache, state, oracle)
    state.close()
    for lane in cache._lanes:
        assert lane.allocator.num_free == lane.allocator.num_pages


def test_drop_window_beside_a_shot_sink_group() -> None:
    """A frame group beside a ``ShotSinkPolicy`` group: ``begin_shot`` pins in the shot group only; ``drop_window``
    leaves the frame lane its sink frames, each kept page's contents the oracle's."""
    groups = {"fkv": am.FrameWindowPolicy(1, 1, FRAMES), "wide": am.FrameWindowPolicy(2, 4, FRAMES),
              "shots": am.ShotSinkPolicy(1, 2, 1)}
    rows = [["fkv", "wide", "shots"], ["shots", "fkv", "wide"]]
    spec = am.KVCacheSpec(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=D, chunk_size=CHUNK, page_size=PAGE,
                          branches=("cond",), dtype="float32", head_retention=am.HeadRetention(groups, rows))
    cache = am.KVCache(spec, num_pages=400, backend="reference")
    state = cache.open_session("s")
    # the shot group's chunk rule is stated by its own history_indices (tests/heads/test_head_shots.py)
    oracle = Oracle(Model(), groups, rows)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        step(state, oracle, g, prompt=0)
    state.begin_shot()
    step(state, oracle, g, prompt=0)
    state.drop_window("cond")
    oracle.floor = oracle.n
    for lane, h in zip(cache._lanes, state._lane_pages("cond")):
        group = lane.part.group
        if group == "shots":
            assert h.history_index == (0,)
            continue
        policy = groups[group]
        assert list(h.history_index) == kept_chunks(policy, oracle.n, oracle.floor)
        assert [k.offsets if k else None for k in h.history_kept] == [
            tuple(kept_frames(policy, i, oracle.n, oracle.floor)) if len(kept_frames(policy, i, oracle.n, oracle.floor))
            < FRAMES else None for i in h.history_index]
    state.close()


# ---------------------------------------------------------------------------------------------- 2. relative sinks x frames
ROPE = am.RotaryEmbedding(D)


def rot(t: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """``t [n, d]`` rotated at ``positions``."""
    return ROPE(t[None, :, None], torch.tensor(positions)[None])[0, :, 0]


def relative_oracle(chunks: list[tuple[torch.Tensor, torch.Tensor]], policy: am.RetentionPolicy, head: int,
                    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One head over unrotated committed ``chunks`` (``[CHUNK, kv_heads, d]`` each) and its pending chunk: sink
    tokens (a frame policy's sink frames, a chunk policy's sink chunks) rotated at their position plus the shift
    that puts the last of them just before the first visible non-sink token (the first pending token when none)."""
    n, start = len(chunks), len(chunks) * CHUNK
    tokens = []  # (position, is sink, chunk, row)
    for i in kept_chunks(policy, n):
        for r in rows_of(kept_frames(policy, i, n)):
            p = i * CHUNK + r
            sink = p < policy.sink_frames * FT if isinstance(policy, am.FrameWindowPolicy) else i < policy.sink_chunks
            tokens.append((p, sink, i, r))
    sinks = [p for p, s, _, _ in tokens if s]
    rest = [p for p, s, _, _ in tokens if not s]
    shift = (rest[0] if rest else start) - (sinks[-1] + 1) if sinks else 0
    keys = [rot(chunks[i][0][r : r + 1, head], [p + (shift if s else 0)]) for p, s, i, r in tokens]
    values = [chunks[i][1][r : r + 1, head] for _, _, i, r in tokens]
    pos = list(range(start, start + CHUNK))
    kk = torch.cat(keys + [rot(k[:, head], pos)])
    vv = torch.cat(values + [v[:, head]])
    return F.scaled_dot_product_attention(rot(q[:, head], pos)[None, None], kk[None, None], vv[None, None])[0, 0]


@pytest.mark.parametrize("kind", ["uniform", "groups", "frames"])
def test_relative_sinks_shift_the_sink_frames_alone(kind: str) -> None:
    """Trimmed sink chunks at relative positions: 7 chunks, a denoising and a committing forward each. Early on a
    window frame sits inside the sink chunk (``FrameWindowPolicy(1, 1, 3)`` after one chunk holds f0 and f2; ``(2,
    4, 3)`` f0 f1 f2): the sinks are the sink frames, shifted to sit just before the first visible non-sink
    frame (f2 there), exactly as once the window left the sink chunk."""
    cache, state, oracle = make(kind, relative_sinks=True)
    groups, rows = oracle.groups, oracle.rows
    g = torch.Generator().manual_seed(0)
    history: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(LAYERS)]
    for c in range(7):
        for commit in (False, True):
            qkv = [[torch.randn(1, CHUNK, KV_HEADS, D, generator=g) for _ in range(3)] for _ in range(LAYERS)]
            with state.prepare_forward(("cond",), CHUNK, commit) as fwd:
                got = torch.stack([
                    am.chunk_attention(ROPE(q, kv.positions), ROPE(k, kv.positions), v, kv,
                                       sink_query=ROPE(q, kv.sink_positions))[0]
                    for (q, k, v), kv in zip(qkv, fwd.layers)
                ])
            want = torch.stack([
                torch.stack([relative_oracle(history[layer], groups[rows[layer][h]], h, q[0], k[0], v[0])
                             for h in range(KV_HEADS)], 1)
                for layer, (q, k, v) in enumerate(qkv)
            ])
            torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=lambda m, c=c: f"chunk {c}: {m}")
            if commit:
                for layer, (_, k, v) in enumerate(qkv):
                    history[layer].append((k[0].clone(), v[0].clone()))


# ---------------------------------------------------------------------------------------------- 3. token masks x frames
@pytest.mark.parametrize("kind", ["uniform", "groups", "frames"])
@pytest.mark.parametrize("chunks", [1, 2, 3, 6])
def test_token_mask_over_the_union_of_kept_frames(kind: str, chunks: int) -> None:
    """``token_mask`` columns: the union of every group's kept-frame tokens by absolute position, then the pending
    chunk -- its width counts trimmed pages; each head masked by its own keys' columns equals the oracle."""
    cache, state, oracle = make(kind)
    g = torch.Generator().manual_seed(chunks)
    for _ in range(chunks):
        step(state, oracle, g, prompt=0)
    union = sorted({p for name in oracle.groups for p in oracle.positions(name)})
    columns = {p: c for c, p in enumerate(union)}
    keys = len(union) + CHUNK
    with pytest.raises(am.errors.TensorMismatchError, match=rf"expected shape \(1, {CHUNK}, {keys}\)"):
        state.prepare_forward(("cond",), CHUNK, False, token_mask=torch.ones(1, CHUNK, keys + FT, dtype=torch.bool))
    mask = torch.rand(1, CHUNK, keys, generator=g) < 0.6
    mask[0, :, keys - CHUNK:] |= torch.eye(CHUNK, dtype=torch.bool)  # every query sees at least itself
    x = torch.randn(CHUNK, DIM, generator=g)
    outs = []
    with state.prepare_forward(("cond",), CHUNK, False, token_mask=mask) as fwd:
        for layer, ctx in enumerate(fwd.layers):
            q, k, v = oracle.model.qkv(x[None], layer, 0)
            outs.append(am.chunk_attention(q, k, v, ctx)[0])
    torch.testing.assert_close(torch.stack(outs), oracle.forward(x, 0, False, mask[0], columns), **TOL)


@pytest.mark.parametrize("used", [True, False])
def test_a_shorter_chunk_is_refused_only_where_a_frame_group_holds_heads(used: bool) -> None:
    """A frame group counts frames by commit index: a shorter chunk is refused (nothing changed) when it holds heads;
    a declared frame group that holds none stores and counts nothing, so the chunk is accepted."""
    chunk, page = 12, 2
    frames = am.FrameWindowPolicy(1, 1, 3)
    rows = [["frames", "wide"], ["wide", "wide"]] if used else [["wide", "wide"]] * 2
    spec = am.KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, chunk_size=chunk, page_size=page,
                          branches=("cond",), dtype="float32",
                          head_retention=am.HeadRetention({"wide": am.SinkWindowPolicy(1, 2), "frames": frames}, rows))
    cache = am.KVCache(spec, num_pages=64, backend="reference")
    state = cache.open_session("s")
    if used:
        with pytest.raises(am.errors.SequenceLengthError, match="whole chunks of chunk_size=12 tokens"):
            state.prepare_forward(("cond",), page, True)
        assert state.committed_chunks("cond") == 0 and cache.stats().pages_used == 0
    else:
        with state.prepare_forward(("cond",), page, True) as fwd:
            for layer, ctx in enumerate(fwd.layers):
                x = torch.randn(1, page, 2, 4)
                am.chunk_attention(x, x, x, ctx)
        assert state.committed_chunks("cond") == 1
