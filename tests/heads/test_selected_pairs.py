"""Content-selected retention (``SelectedFramesPolicy``) paired with the other capabilities, each against a
cache-free oracle that re-states the rule on its own (no pages, no lanes; it shares only the library's RoPE and FP8
rounding, the formats the pools store):

    a group keeps its frame window (stream frame ``g`` stays when ``g < sink_frames`` or ``g >= committed_frames -
    window_frames``, and after ``drop_window`` at ``n`` chunks only when ``g >= n F``) plus a *selection*: at the
    commit of chunk ``c >= select_from`` the candidates are the ``F`` frames from ``c F - T``, ``T = min(window,
    c F - max(sink_frames, floor frames))`` (none when ``T < 1``), the boundary the frame after them; each
    candidate patch is scored by the mean cosine of its keys (score layer, the group's heads there, heads
    concatenated) with the same tokens of the next frame; the ``keep_frames * P`` least similar are kept, their
    K/V copied (every layer, the group's heads) and attended until the next scoring commit replaces them.

The re-statement of Forcing-KV's own code (``tests/support/forcing_kv_attention.py``) is the oracle where a whole
model runs (compile, the distributed rollout). Every pair reads the pools too: the pages a lane holds hold the
oracle's K/V, the selection's pages the chosen tokens' (at their exact positions).

Decided here (and in ``docs/design.md``): the selection sits after the sink chunks in a lane's page list and counts
as its candidates' first position (``selection.start``) where positions are nominal; with relative sinks the sinks
sit just before ``selection.start`` (the first visible non-sink position, the selection counted there); a token mask
is given over exact positions; a re-cache and ``drop_window`` drop the selection (re-chosen at the next scoring
commit, over the frames then in the window: after a dropped window or a sinks-only share the window starts at the
floor, so candidates never reach back past it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

import ardiff_modules as am
from ardiff_modules.core.recache import RecacheRule
from ardiff_modules.quant import dequantize, quantize
from tests.support.projection_model import ProjectionModel

LAYERS, KV_HEADS, D, DIM, FRAMES, PAGE = 2, 3, 4, 6, 3, 2
P = 2  # patches a frame: a patch is one page
FT = P * PAGE  # tokens a frame
CHUNK = FRAMES * FT
TOL = dict(atol=1e-5, rtol=1e-5)

# Forcing-KV's published temporal group (sink 1, window 1, one frame of patches, scored on layer 1), and a wide one
# (window 4 > F: the sink chunk also holds window frames early, candidates still in the window are attended twice)
SEL = am.SelectedFramesPolicy(1, 1, FRAMES, keep_frames=1, patches_per_frame=P, select_from=1, score_layer=1)
WIDE = am.SelectedFramesPolicy(1, 4, FRAMES, keep_frames=2, patches_per_frame=P, select_from=1, score_layer=0)
UNIFORM = am.SelectedFramesPolicy(1, 4, FRAMES, keep_frames=2, patches_per_frame=P, select_from=1, score_layer=1)
GROUPS: dict[str, object] = {"sel": SEL, "wide": WIDE, "chunks": (1, 2)}
ROWS = [["sel", "wide", "chunks"], ["chunks", "sel", "sel"]]
KINDS = ["uniform", "groups"]


def as_policy(group: object) -> am.RetentionPolicy:
    return am.SinkWindowPolicy(*group) if isinstance(group, tuple) else group  # type: ignore[misc,return-value]


# ---------------------------------------------------------------------------------------------- the rule, re-stated
def window_of(policy: am.RetentionPolicy) -> tuple[int, int] | None:
    """``(sink frames, window frames)`` of a frame-counted policy, ``None`` for a chunk policy."""
    if isinstance(policy, (am.SelectedFramesPolicy, am.FrameWindowPolicy)):
        return policy.sink_frames, policy.window_frames
    return None


def kept_frames(policy: am.RetentionPolicy, index: int, committed: int, floor: int = 0) -> list[int]:
    """Frames (within chunk ``index``) of the window a head under ``policy`` reads after ``committed`` chunks."""
    frames = window_of(policy)
    if frames is None:
        keep = index in policy.history_indices(committed) and (index < policy.sink_chunks or index >= floor)
        return list(range(FRAMES)) if keep else []
    s, w = frames
    return [f for f in range(FRAMES) if (g := index * FRAMES + f) < s
            or (g >= committed * FRAMES - w and g >= floor * FRAMES)]


def kept_chunks(policy: am.RetentionPolicy, committed: int, floor: int = 0) -> list[int]:
    return [i for i in range(committed) if kept_frames(policy, i, committed, floor)]


def is_sink(policy: am.RetentionPolicy, index: int, frame: int) -> bool:
    frames = window_of(policy)
    return index < policy.sink_chunks if frames is None else index * FRAMES + frame < frames[0]


def candidates(policy: am.RetentionPolicy, index: int, floor: int = 0) -> tuple[list[int], int] | None:
    """``(candidate frames, boundary frame)`` scored at the commit of chunk ``index`` (``floor``: chunks)."""
    if not isinstance(policy, am.SelectedFramesPolicy) or index < policy.select_from or not policy.keep_frames:
        return None
    start = index * FRAMES
    in_window = min(policy.window_frames, start - max(policy.sink_frames, floor * FRAMES))
    if in_window < 1:
        return None
    first = start - in_window
    return list(range(first, first + FRAMES)), first + FRAMES


def choose(keys: list[torch.Tensor], keep: int) -> list[int]:
    """``keys``: the candidates' then the boundary's keys ``[FT, features]`` -> ascending flat patch indices
    (``frame * P + patch``) of the ``keep`` patches least similar to the same patch of the next frame."""
    per = FT // P
    scores = [float(F.cosine_similarity(keys[f][p * per:(p + 1) * per], keys[f + 1][p * per:(p + 1) * per],
                                        dim=-1).mean())
              for f in range(FRAMES) for p in range(P)]
    return sorted(sorted(range(len(scores)), key=lambda i: scores[i])[:keep])


ROPE = am.RotaryEmbedding(D)


def rot(t: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """``t [n, heads, d]`` rotated at ``positions``."""
    return ROPE(t[None], torch.tensor(positions)[None])[0]


# ---------------------------------------------------------------------------------------------- model and oracle
class Model(ProjectionModel):
    """Per layer, q/k/v are projections of the chunk's latents plus a prompt's bias."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(LAYERS, DIM, KV_HEADS, D, seed)


@dataclass
class Selected:
    """A group's selection: the chosen tokens' absolute positions (ascending), their K/V per layer (copies)."""

    positions: list[int]
    start: int
    kv: list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Oracle:
    """One stream: every committed chunk's latents; per group, what each commit index's slot holds (``(source
    chunk, prompt)``) and its selection. ``rope``: keys are stored rotated at their positions (relative sinks)."""

    model: Model
    groups: dict[str, am.RetentionPolicy]
    rows: list[list[str]]
    rope: bool = False
    latents: list[torch.Tensor] = field(default_factory=list)
    held: dict[str, dict[int, tuple[int, int]]] = field(default_factory=dict)
    selection: dict[str, Selected | None] = field(default_factory=dict)
    floor: int = 0
    #: the commit index the current shot began at (a ``ShotSinkPolicy`` group pins its first chunks)
    shot: int | None = None
    #: ``(latents id, prompt, layer)`` -> stored K/V (the latents are kept: ids stay unique)
    memo: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    #: FP8 storage: ``[layers, 2, kv_heads]`` dequantization scales (``None``: float32 storage)
    scales: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.held = {name: {} for name in self.groups}
        self.selection = dict.fromkeys(self.groups)

    @property
    def n(self) -> int:
        return len(self.latents)

    def copy(self) -> Oracle:
        twin = dataclasses.replace(self, latents=list(self.latents))  # (__post_init__ starts it empty)
        twin.held, twin.selection = {k: dict(v) for k, v in self.held.items()}, dict(self.selection)
        twin.floor, twin.shot = self.floor, self.shot
        return twin

    def kv(self, group: str, index: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What a lane of ``group`` stores for chunk ``index``: ``[CHUNK, kv_heads, d]`` K and V."""
        source, prompt = self.held[group][index]
        key = (id(self.latents[source]), prompt, layer)
        if key not in self.memo:
            _, k, v = self.model.qkv(self.latents[source], layer, prompt)
            k = rot(k, list(range(source * CHUNK, (source + 1) * CHUNK))) if self.rope else k
            self.memo[key] = self.stored(k, v, layer)
        return self.memo[key]

    def stored(self, k: torch.Tensor, v: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V as a pool holds them: FP8 with per-(layer, K|V, head) ``scales`` (read back dequantized)."""
        if self.scales is None:
            return k, v
        return tuple(dequantize(quantize(t, self.scales[layer, i]), self.scales[layer, i], torch.float32)
                     for i, t in enumerate((k, v)))  # type: ignore[return-value]

    def frames(self, group: str, index: int) -> list[int]:
        policy = self.groups[group]
        if isinstance(policy, am.ShotSinkPolicy):  # sinks, the shot's pinned chunks, the newest others in the room
            assert policy.window_chunks is not None
            pinned = [] if self.shot is None else [i for i in range(self.shot, self.shot + policy.shot_chunks)
                                                   if i < self.n]
            room = policy.window_chunks - len(pinned)
            others = [i for i in range(policy.sink_chunks, self.n) if i not in pinned and i >= self.floor]
            kept = [*range(policy.sink_chunks), *pinned, *(others[-room:] if room > 0 else [])]
            return list(range(FRAMES)) if index in kept else []
        return kept_frames(policy, index, self.n, self.floor)

    def tokens(self, group: str, layer: int, head: int) -> list[tuple[int, torch.Tensor, torch.Tensor, bool]]:
        """``(position, k, v, sink)`` of every history token a head of ``group`` reads, in the lane's page order:
        the sink chunks, the selection, the other chunks."""
        policy, chunks, selected = self.groups[group], [], []
        for i in range(self.n):
            k, v = self.kv(group, i, layer) if self.frames(group, i) else (None, None)
            chunks.append([(i * CHUNK + f * FT + t, k[f * FT + t, head], v[f * FT + t, head], is_sink(policy, i, f))
                           for f in self.frames(group, i) for t in range(FT)])
        s = self.selection[group]
        if s is not None:
            selected = [(p, k[head], v[head], False) for p, k, v in zip(s.positions, *s.kv[layer])]
        sinks = [t for i, c in enumerate(chunks) for t in c if i < policy.sink_chunks]
        return sinks + selected + [t for i, c in enumerate(chunks) for t in c if i >= policy.sink_chunks]

    def positions(self, group: str) -> list[int]:
        return [p for p, _, _, _ in self.tokens(group, 0, 0)]

    def shift(self, group: str, keys: list[tuple[int, torch.Tensor, torch.Tensor, bool]]) -> int:
        """Relative sinks: the sinks' last token sits just before the first visible non-sink position (the
        selection counted at its candidates' first position), the first pending token when there is none."""
        sinks = [p for p, _, _, s in keys if s]
        if not sinks:
            return 0
        rest = [p for p, _, _, s in keys if not s]
        s = self.selection[group]
        first = min(rest + ([s.start] if s is not None else []), default=self.n * CHUNK)
        return first - (max(sinks) + 1)

    def forward(self, x: torch.Tensor, prompt: int, commit: bool = True, mask: torch.Tensor | None = None,
                columns: dict[int, int] | list[int] | None = None) -> torch.Tensor:
        """One chunk: each head over its group's tokens, then the chunk (``[layers, CHUNK, heads, d]``). ``mask
        [CHUNK, keys]``: with ``columns`` a dict (grouped: absolute position -> column), else over the uniform
        lane's own key order."""
        out = []
        pending = list(range(self.n * CHUNK, (self.n + 1) * CHUNK))
        for layer in range(LAYERS):
            q, k, v = self.model.qkv(x, layer, prompt)
            if self.rope:
                q, k = rot(q, pending), rot(k, pending)
            k, v = self.stored(k, v, layer)
            heads = []
            for h in range(KV_HEADS):
                group = self.rows[layer][h]
                keys = self.tokens(group, layer, h)
                shift = self.shift(group, keys) if self.rope else 0
                kk = torch.stack([rot(kt[None, None], [shift])[0, 0] if s and shift else kt for _, kt, _, s in keys]
                                 + list(k[:, h])) if keys else k[:, h]
                vv = torch.cat([torch.stack([vt for _, _, vt, _ in keys]), v[:, h]]) if keys else v[:, h]
                m = None
                if mask is not None:
                    cols = ([columns[p] for p, _, _, _ in keys] if isinstance(columns, dict)
                            else list(range(len(keys))))
                    base = len(columns) if isinstance(columns, dict) else len(keys)
                    m = mask[:, cols + [base + t for t in range(CHUNK)]][None, None]
                heads.append(F.scaled_dot_product_attention(q[None, None, :, h], kk[None, None], vv[None, None],
                                                            attn_mask=m)[0, 0])
            out.append(torch.stack(heads, 1))
        if commit:
            self.commit(x, prompt)
        return torch.stack(out)

    def commit(self, x: torch.Tensor, prompt: int) -> None:
        index = self.n
        self.latents.append(x)
        for name in self.groups:
            self.held[name][index] = (index, prompt)
        for name, policy in self.groups.items():
            if isinstance(policy, am.SelectedFramesPolicy):
                self.selection[name] = self.select(name, policy, index)

    def select(self, group: str, policy: am.SelectedFramesPolicy, index: int) -> Selected | None:
        found = candidates(policy, index, self.floor)
        if found is None:
            return None
        frames, boundary = found
        heads = [h for h in range(KV_HEADS) if self.rows[policy.score_layer][h] == group]
        keys = []
        for f in frames + [boundary]:
            chunk, inner = divmod(f, FRAMES)
            keys.append(self.kv(group, chunk, policy.score_layer)[0][inner * FT:(inner + 1) * FT, heads].flatten(1))
        kept = choose(keys, policy.keep_frames * P)
        per = FT // P
        positions = [frames[i // P] * FT + (i % P) * per + t for i in kept for t in range(per)]
        kv = []
        for layer in range(LAYERS):
            rows = [self.kv(group, p // CHUNK, layer) for p in positions]
            kv.append((torch.stack([k[p % CHUNK] for (k, _), p in zip(rows, positions)]),
                       torch.stack([v[p % CHUNK] for (_, v), p in zip(rows, positions)])))
        return Selected(positions, frames[0] * FT, kv)

    def drop_window(self) -> None:
        self.floor = self.n
        self.selection = dict.fromkeys(self.groups)
        if self.shot is not None and self.shot < self.n:
            self.shot = None

    # ------------------------------------------------------------------ re-cache (as tests/heads/test_frame_pairs.py)
    def plans(self, rule: RecacheRule) -> tuple[list[int], dict[str, tuple[list[int], am.RecachePlan]]]:
        plans = {}
        for name, policy in self.groups.items():
            history = kept_chunks(policy, self.n)
            plans[name] = (history, rule.plan(history, self.n, policy.sink_chunks, set(range(self.n))))
        return sorted({i for _, plan in plans.values() for i in plan.rebuilt}), plans

    def recache(self, rule: RecacheRule, prompt: int) -> torch.Tensor:
        """The re-cache forward: each union chunk, whole, over its group's kept sinks (trimmed as held; never the
        selection) and the rebuilt chunks the rule shows; then the slots are updated and every selection dropped."""
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
                    old = []
                    for i in kept[group]:
                        r = [f * FT + u for f in kept_frames(self.groups[group], i, self.n) for u in range(FT)]
                        k, v = self.kv(group, i, layer)
                        old.append((k[r, h], v[r, h]))
                    kk = torch.cat([c[0] for c in old] + [new[i][1][:, h] for i in shown])
                    vv = torch.cat([c[1] for c in old] + [new[i][2][:, h] for i in shown])
                    heads.append(F.scaled_dot_product_attention(new[j][0][None, None, :, h], kk[None, None],
                                                                vv[None, None])[0, 0])
                rows.append(torch.stack(heads, 1))
            out.append(torch.cat(rows))
        for name, (history, plan) in plans.items():
            for index, slot in zip(plan.rebuilt, plan.replaces):
                if slot is not None:
                    self.held[name][history[slot]] = (index, prompt)
            for i in union:  # a kept sink the union rebuilds is rebuilt in place (not a slot a moved sink took)
                if i in history and i not in plan.rebuilt and history.index(i) not in plan.replaces:
                    self.held[name][i] = (i, prompt)
        self.selection = dict.fromkeys(self.groups)
        return torch.stack(out)


# ---------------------------------------------------------------------------------------------- the cache side
def spec_of(kind: str, **kw: object) -> am.KVCacheSpec:
    retention: dict[str, object] = (
        {"retention": UNIFORM} if kind == "uniform" else {"head_retention": am.HeadRetention(GROUPS, ROWS)}
    )
    return am.KVCacheSpec(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=D, chunk_size=CHUNK, page_size=PAGE,
                          branches=("cond", "uncond"), dtype="float32", **retention, **kw)  # type: ignore[arg-type]


def oracle_of(kind: str, model: Model, rope: bool = False) -> Oracle:
    if kind == "uniform":
        return Oracle(model, {"all": UNIFORM}, [["all"] * KV_HEADS for _ in range(LAYERS)], rope)
    return Oracle(model, {k: as_policy(v) for k, v in GROUPS.items()}, ROWS, rope)


def make(kind: str, pages: int = 600, extents: bool = False, **kw: object) -> tuple[am.KVCache, Model]:
    cache = am.KVCache(spec_of(kind, **kw), num_pages=pages, backend="reference", contiguous_extents=extents)
    return cache, Model()


Member = tuple[am.KVState, str, Oracle]


def forward(cache: am.KVCache, members: list[Member], g: torch.Generator, prompt: int = 0, commit: bool = True,
            mask: torch.Tensor | None = None, columns: list[dict[int, int] | None] | None = None) -> None:
    """One forward of ``members`` (batched in this order) through the cache and each stream's oracle."""
    x = torch.randn(len(members), CHUNK, DIM, generator=g)
    model = members[0][2].model
    outs = []
    kept = {"keep_latents": x} if commit else {}
    with cache.prepare_forward([(s, b) for s, b, _ in members], CHUNK, commit, token_mask=mask, **kept) as fwd:
        for layer, ctx in enumerate(fwd.layers):
            q, k, v = model.qkv(x, layer, prompt)
            if members[0][2].rope:  # relative sinks: keys stored rotated, the sinks seen from the sink query
                sink_query = ROPE(q, ctx.sink_positions)
                q, k = ROPE(q, ctx.positions), ROPE(k, ctx.positions)
                outs.append(am.chunk_attention(q, k, v, ctx, sink_query=sink_query))
            else:
                outs.append(am.chunk_attention(q, k, v, ctx))
    got = torch.stack(outs, 1)
    for s, (_, b, oracle) in enumerate(members):
        want = oracle.forward(x[s], prompt, commit, None if mask is None else mask[s],
                              None if columns is None else columns[s])
        torch.testing.assert_close(got[s], want, **TOL, msg=lambda m, b=b: f"{b} at chunk {oracle.n}: {m}")


def lane_parts(cache: am.KVCache) -> list[tuple[object, str, tuple[int, ...], list[tuple[int, ...]]]]:
    """Per lane: ``(lane, group, layers, kv heads per layer)``."""
    out = []
    for lane in cache._lanes:
        if lane.part is None:
            out.append((lane, "all", tuple(range(LAYERS)), [tuple(range(KV_HEADS))] * LAYERS))
        else:
            out.append((lane, lane.part.group, lane.part.layers, [tuple(h) for h in lane.part.heads]))
    return out


def check_pools(cache: am.KVCache, state: am.KVState, branch: str, oracle: Oracle) -> None:
    """Every lane holds the window's kept frames' K/V and the selection's chosen tokens' (exact positions)."""
    for (lane, group, layers, heads), h in zip(lane_parts(cache), state._lane_pages(branch)):
        assert list(h.history_index) == [i for i in range(oracle.n) if oracle.frames(group, i)], (group, oracle.n)
        for chunk, index in zip(h.history, h.history_index):
            rows = [f * FT + t for f in oracle.frames(group, index) for t in range(FT)]
            assert len(chunk) * PAGE == len(rows), (group, index, chunk)
            for li, (layer, kv_heads) in enumerate(zip(layers, heads)):
                k, v = oracle.kv(group, index, layer)
                torch.testing.assert_close(read(lane, li, 0, chunk), k[rows][:, kv_heads], **TOL)
                torch.testing.assert_close(read(lane, li, 1, chunk), v[rows][:, kv_heads], **TOL)
        selected = oracle.selection.get(group)
        if selected is None:
            assert h.selection is None, (group, oracle.n)
            continue
        assert h.selection is not None and h.selection.start == selected.start, (group, oracle.n)
        exact = [s + t for s, n in h.selection_spans(exact=True) for t in range(n)]
        assert exact == selected.positions, (group, oracle.n)
        for li, (layer, kv_heads) in enumerate(zip(layers, heads)):
            k, v = selected.kv[layer]
            torch.testing.assert_close(read(lane, li, 0, h.selection.pages), k[:, kv_heads], **TOL)
            torch.testing.assert_close(read(lane, li, 1, h.selection.pages), v[:, kv_heads], **TOL)


def read(lane: object, layer: int, which: int, pages: tuple[int, ...]) -> torch.Tensor:
    """What a lane's pages hold for its layer ``layer``, K (0) or V (1): ``[tokens, lane heads, d]``, float32
    (FP8 dequantized with the pool's per-head scales)."""
    pool = lane.pool  # type: ignore[attr-defined]
    held = pool.kv[layer, which, list(pages)].flatten(0, 1)
    return dequantize(held, pool.scales[layer, which], torch.float32) if held.dtype != torch.float32 else held


def all_free(cache: am.KVCache) -> bool:
    return all(lane.allocator.num_free == lane.allocator.num_pages for lane in cache._lanes)


def selections(state: am.KVState, branch: str) -> list[object]:
    return [h.selection for h in state._lane_pages(branch)]


# ---------------------------------------------------------------------------------------------- 1. CFG x batching
@pytest.mark.parametrize("kind", KINDS)
def test_cfg_branches_select_each_on_their_own_keys(kind: str) -> None:
    """Two branches in every forward (two denoising steps and a commit per chunk, 7 chunks): each branch's
    outputs, its held frames and its selection (positions, contents) equal its own oracle's."""
    cache, model = make(kind)
    state = cache.open_session("s")
    oracles = {b: oracle_of(kind, model) for b in ("cond", "uncond")}
    members = [(state, b, o) for b, o in oracles.items()]
    g = torch.Generator().manual_seed(1)
    for _ in range(7):
        for commit in (False, False, True):
            forward(cache, members, g, commit=commit)
        for b, o in oracles.items():
            check_pools(cache, state, b, o)
    assert any(s is not None for s in selections(state, "cond"))
    chosen = {b: [h.selection.resolved() for h in state._lane_pages(b) if h.selection] for b in oracles}
    assert chosen["cond"] != chosen["uncond"]  # (the branches really chose apart)
    state.close()
    assert all_free(cache)


@pytest.mark.parametrize("kind", KINDS)
def test_two_sessions_at_different_phases_batched_in_one_forward(kind: str) -> None:
    """One forward batches a session before ``select_from`` (its commits choose nothing) with one long past it
    (every commit re-chooses), then both past it, a member of each order: every stream equals its oracle."""
    cache, model = make(kind)
    old, new = cache.open_session("old"), cache.open_session("new")
    g = torch.Generator().manual_seed(2)
    o_old, o_new = oracle_of(kind, model), oracle_of(kind, model)
    for _ in range(4):
        forward(cache, [(old, "cond", o_old)], g)
    for c in range(5):
        members = [(old, "cond", o_old), (new, "uncond", o_new)]
        for commit in (False, True):
            forward(cache, members[::-1] if c % 2 else members, g, commit=commit)
        check_pools(cache, old, "cond", o_old)
        check_pools(cache, new, "uncond", o_new)
        if c == 0:  # the new stream's first commit (chunk 0) chose nothing; the old one's did
            assert all(s is None for s in selections(new, "uncond"))
            assert any(s is not None for s in selections(old, "cond"))
    old.close()
    new.close()
    assert all_free(cache)


# ---------------------------------------------------------------------------------------------- 2. relative sinks
@pytest.mark.parametrize("kind", KINDS)
def test_relative_sinks_sit_just_before_the_selection(kind: str) -> None:
    """``relative_sinks=True``, 7 chunks of a denoising and a committing forward, two branches: each lane's sink
    frames are attended shifted so their last token sits just before ``selection.start`` -- the first visible
    non-sink position, the selection counted at its candidates' first position -- also early on, when the sink
    chunk still holds a window frame after the selection's start (``WIDE`` after 2 chunks: f0 | f2, the selection
    from f1); with no selection, before the first window token as for any frame lane."""
    cache, model = make(kind, relative_sinks=True)
    state = cache.open_session("s")
    oracles = {b: oracle_of(kind, model, rope=True) for b in ("cond", "uncond")}
    members = [(state, b, o) for b, o in oracles.items()]
    g = torch.Generator().manual_seed(3)
    early = False
    for _ in range(7):
        for commit in (False, True):
            forward(cache, members, g, commit=commit)
        for b, o in oracles.items():
            check_pools(cache, state, b, o)
        group, o = "all" if kind == "uniform" else "wide", oracles["cond"]
        # (the sink chunk also holds a window frame, after the selection's start in position, before it in pages)
        early |= o.selection[group] is not None and len(o.frames(group, 0)) > 1
    assert early


# ---------------------------------------------------------------------------------------------- 3. token masks
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunks", [1, 2, 3, 6])
def test_token_mask_over_exact_positions(kind: str, chunks: int) -> None:
    """A ``token_mask`` for two branches after 1 (no selection yet), 2 (a selection whose candidates are still
    window frames: attended twice), 3 and 6 chunks. Grouped: columns are the union of every lane's keys by exact
    absolute position (a selected token at its own position; one column for both copies of a token attended
    twice), then the pending chunk. Uniform: the lane's own key order (sinks, selection, window), a copy each."""
    cache, model = make(kind)
    state = cache.open_session("s")
    oracles = {b: oracle_of(kind, model) for b in ("cond", "uncond")}
    members = [(state, b, o) for b, o in oracles.items()]
    g = torch.Generator().manual_seed(chunks)
    for _ in range(chunks):
        forward(cache, members, g)
    columns: list[dict[int, int] | None] = []
    widths = []
    for o in oracles.values():
        if kind == "uniform":
            columns.append(None)
            widths.append(len(o.positions("all")) + CHUNK)
        else:
            union = sorted({p for name in o.groups for p in o.positions(name)})
            columns.append({p: c for c, p in enumerate(union)})
            widths.append(len(union) + CHUNK)
    keys = max(widths)
    with pytest.raises(am.errors.TensorMismatchError, match=rf"expected shape \(2, {CHUNK}, {keys}\)"):
        state.prepare_forward(None, CHUNK, False, token_mask=torch.ones(2, CHUNK, keys + 1, dtype=torch.bool))
    mask = torch.rand(2, CHUNK, keys, generator=g) < 0.6
    for s, width in enumerate(widths):
        mask[s, :, width - CHUNK:width] |= torch.eye(CHUNK, dtype=torch.bool)  # every query sees itself
    if chunks == 2:  # a token attended twice (candidate and window frame) gets one column: the positions repeat
        doubled = oracles["cond"].positions("all" if kind == "uniform" else "wide")
        assert len(doubled) > len(set(doubled))
    for commit in (False, True):
        forward(cache, members, g, commit=commit, mask=mask, columns=columns)
    for b, o in oracles.items():
        check_pools(cache, state, b, o)


# ---------------------------------------------------------------------------------------------- 4. forks and shares
@pytest.mark.parametrize("kind", KINDS)
def test_fork_shares_the_selection_then_each_chooses_its_own(kind: str) -> None:
    """``fork()`` after 4 chunks shares every lane's selection by refcount; parent and child then diverge (their
    next commits choose from their own keys: the shared selection's pages go back to one reference, then none),
    each equal to its copy of the oracle; ``fork(branches=("cond",))`` starts ``uncond`` empty (no selection)."""
    cache, model = make(kind)
    parent = cache.open_session("p")
    oracles = {b: oracle_of(kind, model) for b in ("cond", "uncond")}
    g = torch.Generator().manual_seed(4)
    for _ in range(4):
        forward(cache, [(parent, b, o) for b, o in oracles.items()], g)
    child = parent.fork("c")
    shared = [(lane, h.selection.pages) for lane, h in zip(cache._lanes, parent._lane_pages("cond")) if h.selection]
    assert shared and selections(child, "cond") == selections(parent, "cond")
    assert all(lane.allocator.refcount(p) == 2 for lane, pages in shared for p in pages)
    copies = {b: o.copy() for b, o in oracles.items()}
    for _ in range(3):
        forward(cache, [(parent, b, o) for b, o in oracles.items()], g, commit=False)
        forward(cache, [(child, b, o) for b, o in copies.items()], g)
        if _ == 0:  # the child re-chose: the shared pages are the parent's alone
            assert all(lane.allocator.refcount(p) == 1 for lane, pages in shared for p in pages)
        forward(cache, [(parent, b, o) for b, o in oracles.items()] + [(child, b, o) for b, o in copies.items()], g)
        for b in oracles:
            check_pools(cache, parent, b, oracles[b])
            check_pools(cache, child, b, copies[b])
    assert all(lane.allocator.refcount(p) == 0 for lane, pages in shared for p in pages)
    one = parent.fork("one", branches=("cond",))
    assert all(s is None for s in selections(one, "uncond")) and one.committed_chunks("uncond") == 0
    fresh, copied = oracle_of(kind, model), oracles["cond"].copy()
    for _ in range(3):
        forward(cache, [(one, "cond", copied), (one, "uncond", fresh)], g)
        check_pools(cache, one, "uncond", fresh)
    for session in (parent, child, one):
        session.close()
    assert all_free(cache)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("before", [2, 5])
def test_shared_sinks_start_without_a_selection_and_choose_from_their_own_window(kind: str, before: int) -> None:
    """``share_sinks_from`` (a sinks-only fork) after 2 and 5 chunks: the new stream holds the sink frames alone,
    no selection; its window starts empty at the sinks (the floor), so a commit's candidates never reach back into
    frames it never held: it chooses nothing until frames past the floor leave its window, then from its own
    keys -- outputs and pools equal an oracle that starts from the sinks with that floor."""
    cache, model = make(kind)
    source = cache.open_session("src")
    o_src = oracle_of(kind, model)
    g = torch.Generator().manual_seed(before)
    for _ in range(before):
        forward(cache, [(source, "cond", o_src)], g)
    late = cache.open_session("late")
    late.share_sinks_from(source, "cond")
    sinks = late.committed_chunks("cond")
    assert sinks == 1 and all(s is None for s in selections(late, "cond"))
    o_late = oracle_of(kind, model)
    o_late.latents = o_src.latents[:sinks]
    o_late.held = {name: {i: held[i] for i in range(sinks)} for name, held in o_src.held.items()}
    o_late.floor = sinks
    check_pools(cache, late, "cond", o_late)
    for c in range(4):
        forward(cache, [(late, "cond", o_late), (source, "cond", o_src)], g, commit=False)
        forward(cache, [(late, "cond", o_late), (source, "cond", o_src)], g)
        check_pools(cache, late, "cond", o_late)
        check_pools(cache, source, "cond", o_src)
    assert any(s is not None for s in selections(late, "cond"))
    late.close()
    source.close()
    assert all_free(cache)


# ---------------------------------------------------------------------------------------------- 5. drop_window, shots
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("before", [1, 2, 5])
def test_drop_window_drops_the_selection_and_the_window_restarts_at_the_floor(kind: str, before: int) -> None:
    """``drop_window`` after 1, 2 and 5 chunks: every lane keeps its sink frames alone and no selection (its pages
    back in the pool); the next commits choose only from frames past the floor (none until one leaves the new
    window), each output and pool equal to the oracle's."""
    cache, model = make(kind)
    state = cache.open_session("s")
    oracles = {b: oracle_of(kind, model) for b in ("cond", "uncond")}
    members = [(state, b, o) for b, o in oracles.items()]
    g = torch.Generator().manual_seed(10 + before)
    for _ in range(before):
        forward(cache, members, g)
    dropped = [(lane, h.selection.pages) for lane, h in zip(cache._lanes, state._lane_pages("cond")) if h.selection]
    assert bool(dropped) == (before > 1)
    state.drop_window()
    for o in oracles.values():
        o.drop_window()
    assert all(lane.allocator.refcount(p) == 0 for lane, pages in dropped for p in pages)
    for _ in range(5):
        forward(cache, members, g, commit=False)
        forward(cache, members, g)
        for b, o in oracles.items():
            check_pools(cache, state, b, o)
    assert any(s is not None for s in selections(state, "cond"))
    state.close()
    assert all_free(cache)


def test_a_selection_beside_a_shot_sink_group() -> None:
    """A selecting group beside a ``ShotSinkPolicy`` group: ``begin_shot`` pins in the shot group only (the
    selection rolls on), ``drop_window`` (LongLive 2.0's shot-clean re-cache) drops the selection and the shot
    group's window and old shot; every output and pool equals the oracle's, the shot group's rule re-stated."""
    groups = {"sel": SEL, "wide": WIDE, "shots": am.ShotSinkPolicy(1, 2, 1)}
    rows = [["sel", "wide", "shots"], ["shots", "sel", "sel"]]
    spec = dataclasses.replace(spec_of("groups"), head_retention=am.HeadRetention(groups, rows))
    cache = am.KVCache(spec, num_pages=600, backend="reference")
    state = cache.open_session("s")
    oracle = Oracle(Model(), groups, rows)  # type: ignore[arg-type]
    members = [(state, "cond", oracle)]
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        forward(cache, members, g)
    state.begin_shot()
    oracle.shot = oracle.n
    for _ in range(3):
        forward(cache, members, g, commit=False)
        forward(cache, members, g)
        check_pools(cache, state, "cond", oracle)
    assert 3 in state._lane_pages("cond")[[lane.part.group for lane in cache._lanes].index("shots")].history_index
    state.drop_window()
    oracle.drop_window()
    check_pools(cache, state, "cond", oracle)
    for _ in range(4):
        forward(cache, members, g, commit=False)
        forward(cache, members, g)
        check_pools(cache, state, "cond", oracle)
    state.close()
    assert all_free(cache)


# ---------------------------------------------------------------------------------------------- 6. re-cache
RULES = {
    "block_causal_keep": RecacheRule(),
    "block_causal_rebuild": RecacheRule.from_keep_sinks(False),
    "longlive": RecacheRule.longlive(),
    "longlive_move": RecacheRule.longlive(global_sink=False),
}


def run_recache(state: am.KVState, oracle: Oracle, rule: RecacheRule, prompt: int, commit: bool = True) -> None:
    x = state.recache_latents(("cond",), rule=rule)[0]
    union, _ = oracle.plans(rule)
    assert list(state.recache_chunk_indices("cond", rule=rule)) == union
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


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("extents", [False, True], ids=["paged", "extents"])
@pytest.mark.parametrize("chunks", [2, 5])
@pytest.mark.parametrize("name", list(RULES))
def test_recache_drops_the_selection_and_the_next_scoring_commit_chooses_again(
    name: str, chunks: int, extents: bool, kind: str
) -> None:
    """Every rule after 2 and 5 chunks: the re-cache forward never attends the selection (the old prompt's K/V),
    its commit releases it; the next commit chooses again over the re-computed window and the new chunk -- every
    output and pool equal to the oracle's, re-cached twice; all pages back at close."""
    rule = RULES[name]
    cache, model = make(kind, extents=extents, recache=rule)
    state = cache.open_session("s")
    oracle = oracle_of(kind, model)
    members = [(state, "cond", oracle)]
    g = torch.Generator().manual_seed(chunks)
    for _ in range(chunks):
        forward(cache, members, g)
    held = [(lane, h, h.selection.pages) for lane, h in zip(cache._lanes, state._lane_pages("cond")) if h.selection]
    assert held
    run_recache(state, oracle, rule, prompt=1)
    assert all(s is None for s in selections(state, "cond"))
    # released: free, or (frame extents) only the extent's reservation and a rebuilt chunk copied into its slot hold it
    assert all(lane.allocator.refcount(p) == h.referenced_pages().count(p) for lane, h, pages in held for p in pages)
    assert all(h.referenced_pages().count(p) == 0 for _, h, pages in held for p in pages if p not in h.extent)
    check_pools(cache, state, "cond", oracle)
    for prompt in (1, 1, 2):
        if prompt == 2:
            run_recache(state, oracle, rule, prompt=2)
            check_pools(cache, state, "cond", oracle)
        forward(cache, members, g, prompt=prompt, commit=False)
        forward(cache, members, g, prompt=prompt)
        check_pools(cache, state, "cond", oracle)
        assert any(s is not None for s in selections(state, "cond"))
    state.close()
    assert all_free(cache)


@pytest.mark.parametrize("kind", KINDS)
def test_an_aborted_recache_keeps_the_selection(kind: str) -> None:
    """A re-cache forward aborted: the selection, its pages and their references are as before, and the next
    forwards still attend it (the old prompt's K/V)."""
    rule = RecacheRule.longlive()
    cache, model = make(kind, recache=rule)
    state = cache.open_session("s")
    oracle = oracle_of(kind, model)
    g = torch.Generator().manual_seed(6)
    for _ in range(5):
        forward(cache, [(state, "cond", oracle)], g)
    before = [(h.selection, lane.allocator.free_pages()) for lane, h in zip(cache._lanes, state._lane_pages("cond"))]
    run_recache(state, oracle, rule, prompt=1, commit=False)
    assert [(h.selection, lane.allocator.free_pages())
            for lane, h in zip(cache._lanes, state._lane_pages("cond"))] == before
    forward(cache, [(state, "cond", oracle)], g, commit=False)
    check_pools(cache, state, "cond", oracle)


# ---------------------------------------------------------------------------------------------- 7. FP8 K/V
#: Per-(layer, K|V, head) scales far apart: a cosine over the heads concatenated changes with them.
FP8_SCALES = torch.tensor([[[0.004, 0.05, 0.6]] * 2, [[0.6, 0.004, 0.05]] * 2])


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_pools_choose_by_the_dequantized_keys(kind: str) -> None:
    """``kv_dtype="float8_e4m3fn"`` with per-head scales 150x apart: the score layer's keys are scored as the
    attention reads them (each head times its scale), so the choice, the copies and every output equal the oracle
    over FP8-rounded K/V; scoring the raw FP8 codes (heads unscaled) would choose otherwise here."""
    cache, model = make(kind, kv_dtype="float8_e4m3fn")
    cache.set_kv_scales(FP8_SCALES)
    state = cache.open_session("s")
    oracles = {b: oracle_of(kind, model) for b in ("cond", "uncond")}
    for o in oracles.values():
        o.scales = FP8_SCALES
    members = [(state, b, o) for b, o in oracles.items()]
    g = torch.Generator().manual_seed(8)
    raw_differs = False
    for _ in range(6):
        forward(cache, members, g, commit=False)
        forward(cache, members, g)
        for b, o in oracles.items():
            check_pools(cache, state, b, o)
            raw_differs |= any(raw_choice(o, group) != s.positions for group, s in o.selection.items() if s)
    assert raw_differs


def raw_choice(oracle: Oracle, group: str) -> list[int]:
    """The positions a score over the raw FP8 codes (no per-head scale) would keep at the last commit."""
    policy = oracle.groups[group]
    assert isinstance(policy, am.SelectedFramesPolicy) and oracle.scales is not None
    found = candidates(policy, oracle.n - 1, oracle.floor)
    assert found is not None
    frames, boundary = found
    heads = [h for h in range(KV_HEADS) if oracle.rows[policy.score_layer][h] == group]
    scale = oracle.scales[policy.score_layer, 0, heads][:, None]
    keys = []
    for f in frames + [boundary]:
        chunk, inner = divmod(f, FRAMES)
        k = oracle.kv(group, chunk, policy.score_layer)[0][inner * FT:(inner + 1) * FT, heads]
        keys.append((k / scale).flatten(1))
    per = FT // P
    return [frames[i // P] * FT + (i % P) * per + t for i in choose(keys, policy.keep_frames * P) for t in range(per)]


# ---------------------------------------------------------------------------------------------- 8. torch.compile
@pytest.mark.parametrize("backend, ar_start", [
    ("count", 1), ("count", 2), pytest.param("inductor", 1, marks=pytest.mark.slow)])
def test_compiled_model_step_over_a_selecting_cache_equals_the_restatement_without_recompiling(
    backend: str, ar_start: int
) -> None:
    """``torch.compile(model, fullgraph=True)`` of a whole model step (Forcing-KV's configuration: spatial heads,
    temporal heads with a selection; ``ar_start = 2``: the temporal group is a ``PhasedPolicy`` around it) over
    two branches, 6 blocks past the switch: every forward equals Forcing-KV's re-statement as the eager model's
    does, one compiled frame, no recompilation as the selection appears and is replaced (dynamo's graphs run
    eagerly; ``inductor``: the CPU code inductor generates, within 1e-4)."""
    from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

    from tests.integrations.test_forcing_kv_selected import Rollout, _cache, _retention, _settings

    frames = (1, 1, 1) if ar_start == 1 else (1, 2, 1)
    retention = _retention(frames, ar_start, 1, 2)
    rollout = Rollout(_cache(retention, 2, ("cond", "uncond")), _settings(frames, ar_start, 1, 2))
    counter = CompileCounter() if backend == "count" else CompileCounterWithBackend("inductor")
    rollout.model = torch.compile(rollout.model, backend=counter, fullgraph=True)  # (the re-statement keeps eager)
    diffs = rollout.blocks(ar_start + 6, denoise=2)
    assert max(diffs) < (1e-5 if backend == "count" else 1e-4), diffs
    assert counter.frame_count == 1, f"expected one compiled frame, got {counter.frame_count}"
    assert any(h.selection is not None for h in rollout.session._lane_pages("cond"))


# ---------------------------------------------------------------------------------------------- 9. training
TRAIN_CHUNKS, STEPS = 6, 3


def train_draws(seed: int = 1) -> tuple[list[list[torch.Tensor]], list[int], list[torch.Tensor]]:
    """Per chunk: the inputs of each denoising step (the last is the clean forward's), the exit step (the one
    forward with gradients), the loss weights; two streams."""
    g = torch.Generator().manual_seed(seed)
    inputs = [[torch.randn(2, CHUNK, DIM, generator=g) for _ in range(STEPS + 1)] for _ in range(TRAIN_CHUNKS)]
    exits = torch.randint(STEPS, (TRAIN_CHUNKS,), generator=g).tolist()
    return inputs, exits, [torch.randn(2, LAYERS, CHUNK, KV_HEADS, D, generator=g) for _ in range(TRAIN_CHUNKS)]


def oracle_training(model: Model, kind: str | Oracle, draws: tuple, detach: bool) -> torch.Tensor:
    """Self-Forcing's rolling buffer, cache-free: per stream and layer a buffer of every position written in place
    (the exit step with gradients, then the clean forward without: a later read of a slot routes its gradient to
    the slot's last live write -- autograd's ``CopySlices``); each head reads its group's positions (the frame
    window and the selection, chosen by :class:`Oracle` from the clean K/V) -- detached, or straight-through."""
    inputs, exits, weights = draws
    streams = [oracle_of(kind, model) if isinstance(kind, str) else kind.copy() for _ in range(2)]
    buffers = [[{n: torch.zeros(TRAIN_CHUNKS * CHUNK, KV_HEADS, D) for n in "kv"} for _ in range(LAYERS)]
               for _ in streams]
    loss = torch.zeros(())

    def run(x: torch.Tensor, c: int) -> torch.Tensor:
        out = []
        own = slice(c * CHUNK, (c + 1) * CHUNK)
        for layer in range(LAYERS):
            q, k, v = model.qkv(x, layer, 0)
            rows = []
            for s, (oracle, buffer) in enumerate(zip(streams, buffers)):
                buffer[layer]["k"][own], buffer[layer]["v"][own] = k[s], v[s]
                heads = []
                for h in range(KV_HEADS):
                    at = torch.tensor([p for p, _, _, _ in oracle.tokens(oracle.rows[layer][h], layer, h)],
                                      dtype=torch.long)
                    hk, hv = buffer[layer]["k"][at, h], buffer[layer]["v"][at, h]
                    if detach:
                        hk, hv = hk.detach(), hv.detach()
                    kk, vv = torch.cat([hk, k[s, :, h]]), torch.cat([hv, v[s, :, h]])
                    heads.append(F.scaled_dot_product_attention(q[s, None, :, h], kk[None], vv[None])[0])
                rows.append(torch.stack(heads, 1))
            out.append(torch.stack(rows))
        return torch.stack(out, 1)

    for c in range(TRAIN_CHUNKS):
        for step in range(exits[c] + 1):
            with torch.set_grad_enabled(step == exits[c]):
                out = run(inputs[c][step], c)
        loss = loss + (out * weights[c]).sum()
        with torch.no_grad():
            run(inputs[c][-1], c)
            for s, oracle in enumerate(streams):
                oracle.commit(inputs[c][-1][s], 0)
    return loss


def library_training(model: Model, cache: am.KVCache, draws: tuple, scope: am.TrainingScope,
                     compiled: bool = False) -> torch.Tensor:
    inputs, exits, weights = draws
    state = cache.open_session()
    loss = torch.zeros(())

    def layers(x: torch.Tensor, kv: list) -> torch.Tensor:  # noqa: ANN001
        return torch.stack([am.chunk_attention(*model.qkv(x, layer, 0), ctx) for layer, ctx in enumerate(kv)], 1)

    fn = torch.compile(layers, backend="aot_eager", fullgraph=True) if compiled else layers

    def run(x: torch.Tensor, commit: bool) -> torch.Tensor:
        with state.prepare_forward(None, CHUNK, commit_current=commit) as fwd:
            return fn(x, fwd.layers)

    for c in range(TRAIN_CHUNKS):
        for step in range(exits[c] + 1):
            with torch.set_grad_enabled(step == exits[c]):
                out = run(inputs[c][step], False)
        loss = loss + (out * weights[c]).sum()
        with torch.no_grad():
            run(inputs[c][-1], True)
    assert any(h.selection is not None for h in state._lane_pages("cond"))
    return loss


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("history_grad", ["detached", "straight_through"])
def test_training_gradients_through_the_selection_equal_a_rolling_buffer(history_grad: str, kind: str) -> None:
    """A Self-Forcing training rollout (6 chunks, an exit step with gradients each, the clean commit without) in a
    ``TrainingScope``: the gradient of the projections equals the rolling-buffer oracle's, detached and
    straight-through -- a read of a selected token routes its gradient to the live K/V the exit step wrote at that
    token's exact position (and a trimmed chunk's kept frames to theirs); the two modes differ here."""
    model = Model()
    model.w.requires_grad_(True)
    draws = train_draws()
    oracle_training(model, kind, draws, detach=history_grad == "detached").backward()
    assert model.w.grad is not None
    expected, model.w.grad = model.w.grad, None
    oracle_training(model, kind, draws, detach=history_grad != "detached").backward()
    assert model.w.grad is not None
    other, model.w.grad = model.w.grad, None
    assert float((other - expected).norm() / expected.norm()) > 1e-2  # (the modes differ: the test tells them apart)
    cache = am.KVCache(spec_of(kind), num_pages=600, backend="reference")
    with am.TrainingScope(cache, history_grad=history_grad) as scope:  # type: ignore[arg-type]
        library_training(model, cache, draws, scope).backward()
    assert model.w.grad is not None
    assert float((model.w.grad - expected).norm() / expected.norm()) <= 1e-5


#: Forcing-KV's widest configuration (``((3, 3, 3), 1, 3, 1, 4)`` in tests/integrations/test_forcing_kv_selected.py):
#: sink 3 + window 3 frames (2 chunks' room) plus every candidate frame kept: 9 frames of history, more than the
#: sink + window chunks hold.
KEEP_ALL = am.SelectedFramesPolicy(3, 3, FRAMES, keep_frames=3, patches_per_frame=P, select_from=1, score_layer=1)


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("policy", [UNIFORM, KEEP_ALL], ids=["uniform", "keep_all"])
def test_compiled_training_pads_the_history_to_room_for_the_selection(policy: am.SelectedFramesPolicy) -> None:
    """The compiled gradient path (``torch.compile(fullgraph=True)``, aot_eager) pads each lane's history to its
    bound: the sink and window chunks *plus the selection's pages* (with ``KEEP_ALL`` the selection alone is a
    chunk: a bound of sink + window chunks is exceeded at the first read of a selection). Detached gradients equal
    the rolling-buffer oracle's."""
    model = Model()
    model.w.requires_grad_(True)
    draws = train_draws()
    oracle = Oracle(model, {"all": policy}, [["all"] * KV_HEADS for _ in range(LAYERS)])
    oracle_training(model, oracle, draws, detach=True).backward()
    assert model.w.grad is not None
    expected, model.w.grad = model.w.grad, None
    spec = dataclasses.replace(spec_of("uniform"), retention=policy)
    cache = am.KVCache(spec, num_pages=600, backend="reference")
    probe = cache.open_session("probe")
    fwd = probe.prepare_forward(None, CHUNK, commit_current=False)
    selection = policy.keep_frames * FT
    assert fwd._max_history_tokens == (policy.max_history_chunks or 0) * CHUNK + selection
    fwd.abort()
    probe.close()
    with am.TrainingScope(cache) as scope:
        library_training(model, cache, draws, scope, compiled=True).backward()
    assert model.w.grad is not None
    assert float((model.w.grad - expected).norm() / expected.norm()) <= 1e-5


# ---------------------------------------------------------------------------------------------- 10. static buffers
@pytest.mark.parametrize("policy", [SEL, UNIFORM, KEEP_ALL], ids=["sel", "uniform", "keep_all"])
def test_static_plan_buffers_hold_the_selection(policy: am.SelectedFramesPolicy) -> None:
    """``prepare_forward(static=True)`` (CUDA graphs) plans into buffers sized once from the spec; it needs
    FlashInfer, so on the CPU this checks the size they get: at every forward of a rollout (two branches) the page
    list of the plan's rows fits the bound -- the sink and window chunks *and* the selection's pages (``KEEP_ALL``'s
    selection overflows a sink + window bound)."""
    from ardiff_modules.forwards.manager import _max_plan_pages

    spec = dataclasses.replace(spec_of("uniform"), retention=policy)
    cache = am.KVCache(spec, num_pages=600, backend="reference")
    state = cache.open_session("s")
    model, g = Model(), torch.Generator().manual_seed(9)
    bound = _max_plan_pages(cache._lanes[0].spec, 2, 1)
    peak, selected = 0, False
    for _ in range(6):
        for commit in (False, True):
            x = torch.randn(2, CHUNK, DIM, generator=g)
            with state.prepare_forward(None, CHUNK, commit) as fwd:
                assert fwd._layout is not None
                peak = max(peak, fwd._layout.structural_rows.kv_page_indices.numel())
                for layer, ctx in enumerate(fwd.layers):
                    am.chunk_attention(*model.qkv(x, layer, 0), ctx)
        selected |= state._lane_pages("cond")[0].selection is not None
    assert selected and peak <= bound, (peak, bound)
    without = 2 * ((policy.max_history_chunks or 0) + 1) * spec.pages_per_chunk  # (the bound before the selection)
    assert (peak > without) == (policy is KEEP_ALL), (peak, without)


# ---------------------------------------------------------------------------------------------- 11. extents, paging
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("extents", [False, True], ids=["paged", "extents"])
def test_selection_beside_contiguous_extents_and_plain_paging(kind: str, extents: bool) -> None:
    """``contiguous_extents=True`` (a ring of chunk slots per branch) and plain paging, two branches, 7 chunks:
    outputs and pools equal the oracle's; with extents every chunk lives in its ring and the selection in pages
    of its own inside the ring too (the ring's slots are frames: the first one reserved at the committing forward's
    prepare in free slots, the next ones copied in place); every page back at close."""
    cache, model = make(kind, extents=extents)
    state = cache.open_session("s")
    oracles = {b: oracle_of(kind, model) for b in ("cond", "uncond")}
    g = torch.Generator().manual_seed(11)
    for _ in range(7):
        forward(cache, [(state, b, o) for b, o in oracles.items()], g, commit=False)
        forward(cache, [(state, b, o) for b, o in oracles.items()], g)
        for b, o in oracles.items():
            check_pools(cache, state, b, o)
            for h in state._lane_pages(b):
                assert bool(h.extent) == extents
                if extents:
                    assert {p for c in h.history for p in c} <= set(h.extent)
                    assert h.selection is None or set(h.selection.pages) <= set(h.extent)
    state.close()
    assert all_free(cache)


# ---------------------------------------------------------------------------------------------- 12. distributed
def check_selection_cfg_parallel_and_ulysses_refusal() -> None:
    """(one rank of a 2-process gloo group) CFG-parallel: each rank holds one branch of Forcing-KV's cache with its
    selection, every forward equals the single-process cache's (itself equal to the re-statement: checked here
    too), its selections the same pages and offsets. Ulysses: a selecting group -- or a uniform selecting cache --
    split over the ranks' heads is refused with the group, the heads and the rule named, before any cache exists."""
    import copy

    import torch.distributed as dist

    from ardiff_modules.distributed import DistributedKVCache, ParallelMesh, parallelize
    from tests.integrations.test_forcing_kv_selected import Rollout, _cache, _retention, _settings
    from tests.support.distributed_workers import _mesh

    torch.manual_seed(0)
    retention = _retention((1, 1, 1), 1, 1, 2)
    reference = Rollout(_cache(retention, 2, ("cond", "uncond")), _settings((1, 1, 1), 1, 1, 2))
    spec = reference.cache.spec
    mesh = ParallelMesh(_mesh((2,), ("cfg",)), spec.branches, cfg_dim="cfg", sp_dim=None)
    cache = DistributedKVCache(spec, mesh, num_pages=96, backend="reference")
    parallel = copy.deepcopy(reference.model)
    parallelize(parallel, mesh)
    state = cache.open_session("s")
    gen = torch.Generator().manual_seed(1)
    texts = torch.randn(2, 5, reference.model.context_dim, generator=gen)
    for i, branch in enumerate(spec.branches):
        am.populate_cross_attention(reference.session, branch, [b.cross for b in reference.model.blocks], texts[i])
        reference.restated[i].set_prompt(texts[i][None])
        if branch in mesh.local_branches:
            am.populate_cross_attention(state, branch, [b.cross for b in parallel.blocks], texts[i])
    (local,) = mesh.local_branches
    for _ in range(6):
        for commit in (False, False, True):
            x = torch.randn(2, 12, reference.model.dim, generator=gen)
            with torch.no_grad(), reference.session.prepare_forward(None, 12, commit_current=commit) as fwd:
                expected = reference.model(x, fwd.layers)
            with torch.no_grad(), cache.prepare_forward(state, 12, commit) as fwd:
                actual = parallel(mesh.scatter(x), fwd.layers)
            torch.testing.assert_close(actual, mesh.scatter(expected), atol=1e-5, rtol=1e-5)
            row = spec.branches.index(local)
            restated = reference.restated[row].forward(x[row][None], commit)
            torch.testing.assert_close(actual, restated, atol=1e-5, rtol=1e-5)
    mine = [(h.selection.pages, h.selection.resolved()) if h.selection else None for h in state._lane_pages(local)]
    theirs = [(h.selection.pages, h.selection.resolved()) if h.selection else None
              for h in reference.session._lane_pages(local)]
    assert any(mine) and [m[1] if m else None for m in mine] == [t[1] if t else None for t in theirs]
    sp = ParallelMesh(_mesh((2,), ("sp",)), spec.branches, cfg_dim=None, sp_dim="sp")
    with pytest.raises(am.SpecError, match=r"expected no content-selected group split across ranks .* got group\(s\) "
                                           r"\['temporal'\] on a rank holding kv heads \[\d, \d\] of 4"):
        DistributedKVCache(spec, sp, num_pages=96, backend="reference")
    uniform = dataclasses.replace(spec, head_retention=None, retention=am.SelectedFramesPolicy(1, 1, 3, 1, 2))
    with pytest.raises(am.SpecError, match=r"expected no content-selected retention split across the 2 "
                                           r"sequence-parallel ranks .* got retention=SelectedFramesPolicy\(.*\) on a "
                                           r"rank holding kv heads \[\d, \d\] of 4"):
        DistributedKVCache(uniform, sp, num_pages=96, backend="reference")
    dist.barrier()


def test_distributed_cfg_parallel_selection_and_the_ulysses_refusal() -> None:
    """CFG-parallel over gloo (2 CPU ranks) equals the single-process selecting cache; Ulysses is refused."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    from tests.distributed.test_multi_process import _spawn

    _spawn(2, check_selection_cfg_parallel_and_ulysses_refusal)
