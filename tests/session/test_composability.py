"""The composability contract (issue 41): every capability x {uniform, per-layer, per-head} retention.

One ``KVCache`` serves all three: a uniform spec, and ``KVCacheSpec(head_retention=...)`` with one retention
per layer (LightX2V-style) or per head (Forcing-KV-style). Each capability runs a small rollout through the
cache and a cache-free per-head oracle (:class:`Oracle`: every committed chunk's K/V kept in a list, each head
reading the chunks its own group's policy keeps, ``history_indices``) and compares every output. The heads may
also count frames (``per_frame``), switch at a commit (``per_phase``) or keep frames chosen by content
(``per_selected``: the oracle re-states the choice). Capabilities that live elsewhere have their own grouped
tests: re-cache, relative sinks, masks (``tests/heads``; a content selection's pairs: ``test_selected_pairs.py``),
the host tier and session files (``tests/host``), training scopes and distributed caches (``tests/training``,
``tests/distributed``), compile and CUDA graphs (``tests/compile``, ``tests/gpu``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F

import ardiff_modules as am
from ardiff_modules.errors import KVScalesFixedError

LAYERS, KV_HEADS, GQA, DIM, CHUNK, PAGE = 3, 4, 2, 8, 8, 4
FRAMES = 2  #: frames of a chunk under the per-frame groups (a frame = one page)
BRANCHES = ("cond", "uncond")


def _retentions() -> dict[str, am.HeadRetention | None]:
    return {
        "uniform": None,
        "per_layer": am.HeadRetention.per_layer([(1, 1), (0, 2), (1, 3)], KV_HEADS),
        "per_head": am.HeadRetention.from_local_heads(LAYERS, KV_HEADS, {0: [1, 2], 1: [0, 3], 2: [1]},
                                                     local=(0, 1), other=(1, 3)),
        # Forcing-KV-style frames: a chunk is FRAMES frames; local heads keep the last frame, the others the
        # first frame + the last 3 (chunks trimmed to their kept frames' pages)
        "per_frame": am.HeadRetention.from_local_heads(
            LAYERS, KV_HEADS, {0: [1, 2], 1: [0, 3], 2: [1]},
            local=am.FrameWindowPolicy(0, 1, FRAMES), other=am.FrameWindowPolicy(1, 3, FRAMES),
        ),
        # Forcing-KV's switch: local heads keep the others' window until 3 chunks are committed, then 1 chunk
        "per_phase": am.HeadRetention.from_local_heads(
            LAYERS, KV_HEADS, {0: [1, 2], 1: [0, 3], 2: [1]},
            local=am.PhasedPolicy(am.SinkWindowPolicy(1, 3), am.SinkWindowPolicy(1, 1), 3), other=(1, 3),
        ),
        # Forcing-KV's temporal heads: sink frame + last frame + one frame chosen by content (layer 1's keys of
        # the group's heads) from the frames leaving the window at each commit from the second on
        "per_selected": am.HeadRetention.from_local_heads(
            LAYERS, KV_HEADS, {0: [1, 2], 1: [0, 3], 2: [1]},
            local=am.SelectedFramesPolicy(1, 1, FRAMES, keep_frames=1, select_from=1, score_layer=1),
            other=am.FrameWindowPolicy(1, 3, FRAMES),
        ),
    }


UNIFORM = am.SinkWindowPolicy(1, 3)


def _spec(retention: am.HeadRetention | None) -> am.KVCacheSpec:
    spec = am.KVCacheSpec(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=DIM, chunk_size=CHUNK, page_size=PAGE,
                          branches=BRANCHES, dtype="float32", num_qo_heads=KV_HEADS * GQA)
    if retention is None:
        return dataclasses.replace(spec, sink_chunks=UNIFORM.sink_chunks, window_chunks=UNIFORM.window_chunks)
    return dataclasses.replace(spec, head_retention=retention)


class Oracle:
    """Per stream and layer, the committed chunks' ``(k, v)`` ``[tokens, kv_heads, d]``; each head reads the
    chunks its group's policy keeps (a content-selected group also its selection: :meth:`select`)."""

    def __init__(self, retention: am.HeadRetention | None) -> None:
        self.retention = retention
        self.chunks: dict[str, list[list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        #: stream -> chunks it took from another stream by ``share_sinks_from``: a head holds only those its
        #: own group pins as sinks (the others were never shared: an empty window).
        self.shared_sinks: dict[str, int] = {}
        #: stream -> group -> per layer the selected tokens' ``(k, v)`` ``[tokens, kv_heads, d]`` (copies)
        self.selected: dict[str, dict[str, list[tuple[torch.Tensor, torch.Tensor]]]] = {}

    def policy(self, layer: int, head: int) -> am.RetentionPolicy:
        if self.retention is None:
            return UNIFORM
        return self.retention.groups[self.retention.group_of(layer, head)]

    def history(self, stream: str, layer: int, head: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        chunks = self.chunks.get(stream, [[] for _ in range(LAYERS)])[layer]
        policy = self.policy(layer, head)
        shared = self.shared_sinks.get(stream, 0)
        kept = [i for i in policy.history_indices(len(chunks)) if i >= shared or i < policy.sink_chunks]
        selected = self.selected.get(stream, {}).get(self.retention.group_of(layer, head) if self.retention else "")
        if isinstance(policy, am.SelectedFramesPolicy):
            policy = policy.window
        if not isinstance(policy, am.FrameWindowPolicy):
            return [chunks[i] for i in kept]
        # stream frame g = i * F + f stays when a sink frame, or (not a shared sink) among the last window frames
        f, total, size = policy.frames_per_chunk, len(chunks) * policy.frames_per_chunk, CHUNK // FRAMES
        out = []
        for i in kept:
            frames = [j for j in range(f) if i * f + j < policy.sink_frames
                      or i >= shared and i * f + j >= total - policy.window_frames]
            rows = [r for j in frames for r in range(j * size, (j + 1) * size)]
            out.append((chunks[i][0][rows], chunks[i][1][rows]))
        return out + ([selected[layer]] if selected else [])

    def attend(self, stream: str, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               lengths: Sequence[int], bidirectional: bool) -> torch.Tensor:
        """``q [n, heads, d]``, ``k``/``v [n, kv_heads, d]``: pending chunks of ``lengths`` (block-causal or not)."""
        out = torch.empty_like(q)
        starts = [sum(lengths[:c]) for c in range(len(lengths) + 1)]
        for h in range(KV_HEADS):
            past = self.history(stream, layer, h)
            hk = [c[0][:, h] for c in past]
            hv = [c[1][:, h] for c in past]
            for c in range(len(lengths)):
                end = starts[-1] if bidirectional else starts[c + 1]
                keys = torch.cat(hk + [k[:end, h]])
                values = torch.cat(hv + [v[:end, h]])
                for j in range(GQA):
                    qh = q[starts[c]:starts[c + 1], h * GQA + j]
                    out[starts[c]:starts[c + 1], h * GQA + j] = F.scaled_dot_product_attention(
                        qh[None, None], keys[None, None], values[None, None])[0, 0]
        return out

    def commit(self, stream: str, per_layer: Sequence[tuple[torch.Tensor, torch.Tensor]],
               lengths: Sequence[int]) -> None:
        layers = self.chunks.setdefault(stream, [[] for _ in range(LAYERS)])
        starts = [sum(lengths[:c]) for c in range(len(lengths) + 1)]
        for layer, (k, v) in enumerate(per_layer):
            for c in range(len(lengths)):
                layers[layer].append((k[starts[c]:starts[c + 1]].clone(), v[starts[c]:starts[c + 1]].clone()))
        for group, policy in (self.retention.groups.items() if self.retention else ()):
            if isinstance(policy, am.SelectedFramesPolicy):
                self.select(stream, group, policy)

    def select(self, stream: str, group: str, policy: am.SelectedFramesPolicy) -> None:
        """At the commit of chunk ``c``: the ``F`` frames from ``c F - T`` (``T = min(window, c F - max(sink,
        floor))``; none when ``T < 1`` or ``c < select_from``), each scored by the cosine of its keys (score layer,
        the group's heads concatenated) with the next frame's; the least similar ``keep_frames`` kept, their K/V
        copied from every layer. One page a frame here: a frame is a patch."""
        layers, size = self.chunks[stream], CHUNK // FRAMES
        index, floor = len(layers[0]) - 1, self.shared_sinks.get(stream, 0) * FRAMES
        self.selected.setdefault(stream, {}).pop(group, None)
        start = index * FRAMES
        in_window = min(policy.window_frames, start - max(policy.sink_frames, floor))
        if index < policy.select_from or in_window < 1:
            return
        assert self.retention is not None
        frames = list(range(start - in_window, start - in_window + FRAMES + 1))  # the candidates, then the boundary

        def rows(layer: int, f: int) -> tuple[torch.Tensor, torch.Tensor]:
            k, v = layers[layer][f // FRAMES]
            return k[f % FRAMES * size:(f % FRAMES + 1) * size], v[f % FRAMES * size:(f % FRAMES + 1) * size]

        heads = [h for h in range(KV_HEADS) if self.retention.group_of(policy.score_layer, h) == group]
        keys = [rows(policy.score_layer, f)[0][:, heads].flatten(1) for f in frames]
        scores = [float(F.cosine_similarity(keys[i], keys[i + 1], dim=-1).mean()) for i in range(FRAMES)]
        kept = sorted(sorted(range(FRAMES), key=scores.__getitem__)[:policy.keep_frames])
        self.selected[stream][group] = [
            tuple(torch.cat([rows(layer, frames[i])[j] for i in kept]) for j in (0, 1))  # type: ignore[misc]
            for layer in range(LAYERS)
        ]


def step(state: am.KVState, oracle: Oracle, stream: str, gen: torch.Generator, *, commit: bool,
         lengths: Sequence[int] = (CHUNK,), pending: str = "block_causal", grad: bool = False) -> float:
    """One forward of every branch of ``state`` through the cache and the oracle; the largest difference
    (outputs, and with ``grad`` the q/k/v gradients of a random loss)."""
    n = sum(lengths)
    worst = 0.0
    written: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {b: [] for b in BRANCHES}
    with state.prepare_forward(BRANCHES, n, commit_current=commit, chunk_lengths=list(lengths),
                               pending_attention=pending) as fwd:  # type: ignore[arg-type]
        for layer, ctx in enumerate(fwd.layers):
            q = torch.randn(len(BRANCHES), n, KV_HEADS * GQA, DIM, generator=gen)
            k = torch.randn(len(BRANCHES), n, KV_HEADS, DIM, generator=gen)
            v = torch.randn(len(BRANCHES), n, KV_HEADS, DIM, generator=gen)
            weight = torch.randn(q.shape, generator=gen)
            inputs = [t.clone().requires_grad_(grad) for t in (q, k, v)]
            got = am.chunk_attention(*inputs, ctx)
            refs = [t.clone().requires_grad_(grad) for t in (q, k, v)]
            want = torch.stack([
                oracle.attend(f"{stream}/{b}", layer, refs[0][s], refs[1][s], refs[2][s], lengths,
                              pending == "bidirectional")
                for s, b in enumerate(BRANCHES)
            ])
            worst = max(worst, float((got - want).abs().max()))
            if grad:
                (got * weight).sum().backward()
                (want * weight).sum().backward()
                worst = max(worst, *(float((a.grad - b.grad).abs().max()) for a, b in zip(inputs, refs)))
            for s, b in enumerate(BRANCHES):
                written[b].append((k[s], v[s]))
    if commit:
        for b in BRANCHES:
            oracle.commit(f"{stream}/{b}", written[b], lengths)
    return worst


def rollout(state: am.KVState, oracle: Oracle, stream: str, gen: torch.Generator, chunks: int, **kw: object) -> float:
    """``chunks`` chunk steps of two denoising forwards and one commit each."""
    worst = 0.0
    for _ in range(chunks):
        for commit in (False, False, True):
            worst = max(worst, step(state, oracle, stream, gen, commit=commit, **kw))  # type: ignore[arg-type]
    return worst


# ---------------------------------------------------------------------------------------------- capabilities
def _plain(cache: am.KVCache, oracle: Oracle, gen: torch.Generator) -> float:
    return rollout(cache.open_session("s"), oracle, "s", gen, 6)


def _selects(oracle: Oracle) -> bool:
    return oracle.retention is not None and any(
        isinstance(p, am.SelectedFramesPolicy) for p in oracle.retention.groups.values())


def _multi_chunk_bidirectional(cache: am.KVCache, oracle: Oracle, gen: torch.Generator) -> float:
    state = cache.open_session("s")
    worst = rollout(state, oracle, "s", gen, 2)
    for pending in ("block_causal", "bidirectional"):
        if _selects(oracle):  # NOTE: each chunk's commit scores its own leaving frames: refused, nothing changed
            used = cache.stats().pages_used
            with pytest.raises(am.errors.SequenceLengthError, match="expected one chunk per committing forward"):
                step(state, oracle, "s", gen, commit=True, lengths=(CHUNK, CHUNK), pending=pending)
            assert state.committed_chunks("cond") == 2 and cache.stats().pages_used == used
            worst = max(worst, step(state, oracle, "s", gen, commit=False, lengths=(CHUNK, CHUNK), pending=pending))
            continue
        worst = max(worst, step(state, oracle, "s", gen, commit=True, lengths=(CHUNK, CHUNK), pending=pending))
    return max(worst, rollout(state, oracle, "s", gen, 3))


def _short_first_chunk(cache: am.KVCache, oracle: Oracle, gen: torch.Generator) -> float:
    state = cache.open_session("s")
    if oracle.retention is not None and isinstance(
        next(iter(oracle.retention.groups.values())), (am.FrameWindowPolicy, am.SelectedFramesPolicy)
    ):
        # NOTE: a frame policy counts frames by commit index: a shorter chunk is refused before anything changes
        with pytest.raises(am.errors.SequenceLengthError, match="whole chunks of chunk_size=8 tokens"):
            step(state, oracle, "s", gen, commit=True, lengths=(PAGE,))
        assert state.committed_chunks("cond") == 0 and cache.stats().pages_used == 0
        return rollout(state, oracle, "s", gen, 5)
    worst = step(state, oracle, "s", gen, commit=True, lengths=(PAGE,))
    return max(worst, rollout(state, oracle, "s", gen, 5))


def _fork(cache: am.KVCache, oracle: Oracle, gen: torch.Generator) -> float:
    parent = cache.open_session("s")
    worst = rollout(parent, oracle, "s", gen, 4)
    child = parent.fork("f")
    for b in BRANCHES:
        oracle.chunks[f"f/{b}"] = copy.deepcopy(oracle.chunks[f"s/{b}"])
        oracle.selected[f"f/{b}"] = dict(oracle.selected.get(f"s/{b}", {}))  # (a fork shares the selection)
    worst = max(worst, rollout(child, oracle, "f", gen, 3), rollout(parent, oracle, "s", gen, 3))
    child.close()
    return max(worst, rollout(parent, oracle, "s", gen, 1))


def _share_sinks(cache: am.KVCache, oracle: Oracle, gen: torch.Generator) -> float:
    source = cache.open_session("s")
    worst = rollout(source, oracle, "s", gen, 5)
    sinks = max(p.sink_chunks for p in (oracle.retention.groups.values() if oracle.retention else [UNIFORM]))
    late = cache.open_session("late")
    for b in BRANCHES:
        late.share_sinks_from(source, b)
        oracle.chunks[f"late/{b}"] = [layer[:sinks] for layer in oracle.chunks[f"s/{b}"]]
        oracle.shared_sinks[f"late/{b}"] = sinks
        assert late.committed_chunks(b) == sinks
    return max(worst, rollout(late, oracle, "late", gen, 4))


def _gradients(cache: am.KVCache, oracle: Oracle, gen: torch.Generator) -> float:
    state = cache.open_session("s")
    worst = rollout(state, oracle, "s", gen, 4)
    for commit in (False, True):
        worst = max(worst, step(state, oracle, "s", gen, commit=commit, grad=True))
    return worst


def _abort_restores_every_lane(cache: am.KVCache, oracle: Oracle, gen: torch.Generator) -> float:
    state = cache.open_session("s")
    worst = rollout(state, oracle, "s", gen, 5)
    pools = [lane.pool.kv.clone() for lane in cache._lanes]
    used = [lane.allocator.num_used for lane in cache._lanes]
    histories = [[tuple(p.history) for p in state._lane_pages(b)] for b in BRANCHES]
    snapshot = copy.deepcopy(oracle.chunks)
    with pytest.raises(RuntimeError, match="boom"):
        with state.prepare_forward(BRANCHES, CHUNK, commit_current=True) as fwd:
            q = torch.randn(2, CHUNK, KV_HEADS * GQA, DIM, generator=gen)
            kv = torch.randn(2, CHUNK, KV_HEADS, DIM, generator=gen)
            for ctx in fwd.layers:
                am.chunk_attention(q, kv, kv, ctx)
            raise RuntimeError("boom")
    state.abort()
    assert [lane.allocator.num_used for lane in cache._lanes] == used
    assert [[tuple(p.history) for p in state._lane_pages(b)] for b in BRANCHES] == histories
    for lane, before in zip(cache._lanes, pools):  # committed pages of every lane hold what they held
        for b in BRANCHES:
            pages = [p for chunk in state._lane_pages(b)[lane.index].history for p in chunk]
            assert torch.equal(lane.pool.kv[:, :, pages], before[:, :, pages])
    oracle.chunks = snapshot
    return max(worst, rollout(state, oracle, "s", gen, 2))


CAPABILITIES: dict[str, Callable[[am.KVCache, Oracle, torch.Generator], float]] = {
    "plain_cfg": _plain,
    "multi_chunk_bidirectional": _multi_chunk_bidirectional,
    "short_first_chunk": _short_first_chunk,
    "fork": _fork,
    "share_sinks_from": _share_sinks,
    "gradients": _gradients,
    "abort_restores_every_lane": _abort_restores_every_lane,
}


@pytest.mark.parametrize("retention", list(_retentions()))
@pytest.mark.parametrize("capability", list(CAPABILITIES))
def test_capability_composes_with_retention(capability: str, retention: str) -> None:
    heads = _retentions()[retention]
    cache = am.KVCache(_spec(heads), num_pages=96, backend="reference")
    oracle = Oracle(heads)
    worst = CAPABILITIES[capability](cache, oracle, torch.Generator().manual_seed(7))
    assert worst < 1e-5, f"{capability} x {retention}: max difference {worst}"
    for session in list(cache.sessions.values()):
        session.close()
    assert cache.stats().pages_used == 0  # every lane's pages came back


def test_grouped_caches_really_differ_from_uniform() -> None:
    """The oracle sees the groups: the per-head cache against a uniform oracle differs (the matrix can fail)."""
    heads = _retentions()["per_head"]
    cache = am.KVCache(_spec(heads), num_pages=96, backend="reference")
    assert _plain(cache, Oracle(None), torch.Generator().manual_seed(7)) > 1e-2


# ---------------------------------------------------------------------------------------------- per-lane resources
def test_fp8_scales_scatter_to_every_lane_and_dequantize_each_head() -> None:
    """``set_kv_scales([layers, 2, kv_heads])`` gives each lane its layers' heads; every lane stores its heads'
    K/V quantized with those scales (pool contents read back within FP8 rounding), ``kv_scales`` gathers them."""
    heads = _retentions()["per_head"]
    spec = dataclasses.replace(_spec(heads), kv_dtype="float8_e4m3fn")
    cache = am.KVCache(spec, num_pages=96, backend="reference")
    scales = torch.rand(LAYERS, 2, KV_HEADS) + 0.5
    cache.set_kv_scales(scales)
    assert torch.equal(cache.kv_scales, scales)
    for lane in cache._lanes:
        assert lane.part is not None
        for i, (layer, kv_heads) in enumerate(zip(lane.part.layers, lane.part.heads)):
            assert torch.equal(lane.pool.scales[i], scales[layer][:, list(kv_heads)])
    state = cache.open_session("s")
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(2, CHUNK, KV_HEADS, DIM, generator=gen)
    with state.prepare_forward(BRANCHES, CHUNK, commit_current=True) as fwd:
        for ctx in fwd.layers:
            am.chunk_attention(torch.randn(2, CHUNK, KV_HEADS * GQA, DIM, generator=gen), k, k, ctx)
    for lane in cache._lanes:
        assert lane.part is not None
        (page, *_), = state._lane_pages("cond")[lane.index].history
        for i, (layer, kv_heads) in enumerate(zip(lane.part.layers, lane.part.heads)):
            stored = lane.pool.kv[i, 0, page].float() * lane.pool.scales[i, 0][None, :, None]
            torch.testing.assert_close(stored, k[0, :PAGE, list(kv_heads)], atol=0.1, rtol=0.07)
    with pytest.raises(KVScalesFixedError):
        cache.set_kv_scales(scales)  # pages were written with these scales: refused, nothing changed
    assert torch.equal(cache.kv_scales, scales)


def test_admission_with_groups_is_the_fullest_lane() -> None:
    """A session fits when it fits in every lane at its peak; the refusal names the lane that is full."""
    heads = _retentions()["per_head"]
    cache = am.KVCache(_spec(heads), budget_bytes=60_000, backend="reference")
    per_lane = [lane.admission.pages_per_session() for lane in cache._lanes]
    fit = min(lane.allocator.num_pages // pages for lane, pages in zip(cache._lanes, per_lane))
    assert cache.sessions_that_fit(recache=False) == fit >= 1
    assert cache.pages_per_session() == sum(per_lane)
    for i in range(fit):
        cache.admit_session(f"s{i}", recache=False)
    with pytest.raises(am.CapacityError, match="lane '"):
        cache.admit_session("one too many", recache=False)
    assert len(cache.sessions) == fit
    assert sum(row.num_pages for row in cache.stats().lanes.values()) == cache.stats().num_pages
