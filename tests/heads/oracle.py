"""A cache-free recomputation with per-head visibility, and a rollout driver for caches with retention groups.

:class:`PerHeadOracle` keeps, per branch and layer, the K/V of every committed chunk in a list and, for
each K/V head, reads the visible chunks from that head's own group policy (``history_indices``): no pages,
no lanes, no head split. :func:`one_forward` drives the same random chunk attention through a
:class:`~ardiff_modules.KVCache` built with ``KVCacheSpec(head_retention=...)`` (one *lane* per head part:
``ardiff_modules.lanes``) and the oracle and returns both outputs per forward. The helpers below read a
session's or a cache's lanes (``cache._lanes``, ``state._lane_branches``) and size a budget for ``n``
sessions at their peak.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

import ardiff_modules as am
from ardiff_modules.lanes import admission_of, extent_chunks_of, lane_specs
from ardiff_modules.pool import bytes_per_page


@dataclass
class PerHeadOracle:
    heads: am.HeadRetention
    #: branch -> layer -> committed chunks, each ``(k, v)`` ``[chunk, kv_heads, d]``, or ``(k, v, holders)``: a chunk
    #: only the kv heads in ``holders`` hold (:meth:`share_sinks_from`)
    committed: dict[str, list[list[tuple[Any, ...]]]] = field(
        default_factory=lambda: defaultdict(list)
    )

    def _layer_chunks(self, branch: str, layer: int) -> list[tuple[Any, ...]]:
        chunks = self.committed[branch]
        while len(chunks) <= layer:
            chunks.append([])
        return chunks[layer]

    def attend(self, branch: str, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q [n, heads, d]`` over each head's visible history + the current ``k``/``v`` ``[n, kv_heads, d]``
        (one pending chunk: full attention inside it). Differentiable in ``q``, ``k``, ``v`` (history is a
        constant, as in the cache)."""
        history = self._layer_chunks(branch, layer)
        group = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        for h in range(k.shape[1]):
            policy = self.heads.groups[self.heads.group_of(layer, h)]
            # (a chunk with holders -- shared sinks -- is there only for the heads that hold it)
            visible = [
                (i, history[i]) for i in policy.history_indices(len(history))
                if len(history[i]) == 2 or h in history[i][2]
            ]
            # (a shared sink chunk -- with holders -- holds its sink frames alone: the fork's window started empty)
            rows = [_kept_rows(policy, i, len(history), c[0].shape[0], len(c) == 3) for i, c in visible]
            keys = torch.cat([c[0][r, h] for r, (_, c) in zip(rows, visible)] + [k[:, h]])
            values = torch.cat([c[1][r, h] for r, (_, c) in zip(rows, visible)] + [v[:, h]])
            for j in range(group):
                qh = q[:, h * group + j]
                out[:, h * group + j] = F.scaled_dot_product_attention(
                    qh[None, None], keys[None, None], values[None, None]
                )[0, 0]
        return out

    def commit(self, branch: str, layer_kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for layer, (k, v) in enumerate(layer_kv):
            self._layer_chunks(branch, layer).append((k.detach().clone(), v.detach().clone()))

    def share_sinks_from(self, other: PerHeadOracle, branch: str) -> None:
        """As ``KVState.share_sinks_from``: ``branch`` continues after the stream's sinks (the most any group keeps:
        the clock is the same for every head), and each head holds only its own group's sink chunks of them (its
        window starts empty)."""
        sinks = max(policy.sink_chunks for policy in self.heads.groups.values())
        rows = []
        for layer, chunks in enumerate(other.committed[branch]):
            kept = self.heads.layers[layer]
            row = []
            for i, c in enumerate(chunks[:sinks]):
                holders = frozenset(h for h, group in enumerate(kept) if self.heads.groups[group].sink_chunks > i)
                row.append((c[0], c[1], holders & c[2] if len(c) == 3 else holders))
            rows.append(row)
        self.committed[branch] = rows


def _kept_rows(policy: Any, index: int, committed: int, tokens: int, sinks_only: bool = False) -> list[int] | slice:
    """Rows of chunk ``index`` a head under ``policy`` reads: every row, or its kept frames' under a frame policy
    (frames counted from the commit index, stated here from the policy's frame rule alone)."""
    if not isinstance(policy, am.FrameWindowPolicy):
        return slice(None)
    # stream frame g = index * F + f stays when it is a sink frame or among the last `window` committed frames
    per_chunk, sink, window = policy.frames_per_chunk, policy.sink_frames, policy.window_frames
    frame, total = tokens // per_chunk, committed * per_chunk
    frames = [f for f in range(per_chunk) if (g := index * per_chunk + f) < sink
              or not sinks_only and (window is None or g >= total - window)]
    return [r for f in frames for r in range(f * frame, (f + 1) * frame)]


def random_qkv(streams: int, n: int, heads: int, kv_heads: int, d: int, gen: torch.Generator, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shape = (streams, n)
    q = torch.randn(*shape, heads, d, generator=gen).to(dtype)
    k = torch.randn(*shape, kv_heads, d, generator=gen).to(dtype)
    v = torch.randn(*shape, kv_heads, d, generator=gen).to(dtype)
    return q, k, v


def one_forward(
    session: am.KVState, oracle: PerHeadOracle, branches: Sequence[str], chunk: int,
    commit: bool, gen: torch.Generator, spec: am.KVCacheSpec, dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of ``branches`` through the cache and the oracle: ``(cache out, oracle out)``, each
    ``[layers, streams, chunk, heads, d]`` (the cache's on its device, the oracle's float32 on the CPU, from
    the same ``dtype``-rounded inputs); commits both when ``commit``."""
    heads, kv_heads, d = spec.query_heads, spec.num_kv_heads, spec.head_dim
    device = session.cache.device
    got, want, written = [], [], []
    with session.prepare_forward(tuple(branches), chunk, commit_current=commit) as fwd:
        for layer, ctx in enumerate(fwd.layers):
            qkv = random_qkv(len(branches), chunk, heads, kv_heads, d, gen, dtype)
            got.append(am.chunk_attention(*(t.to(device) for t in qkv), ctx))
            q, k, v = (t.float() for t in qkv)
            want.append(torch.stack([oracle.attend(b, layer, q[s], k[s], v[s]) for s, b in enumerate(branches)]))
            written.append((k, v))
    if commit:
        for s, branch in enumerate(branches):
            oracle.commit(branch, [(k[s], v[s]) for k, v in written])
    return torch.stack(got), torch.stack(want)


# ---------------------------------------------------------------------- caches with retention groups


def grouped(spec: am.KVCacheSpec, heads: am.HeadRetention) -> am.KVCacheSpec:
    """``spec`` with ``heads`` as its retention groups (sink / window left at their defaults)."""
    return dataclasses.replace(spec, head_retention=heads)


def session_budget(spec: am.KVCacheSpec, sessions: int, backend: str = "reference",
                   contiguous_extents: bool | None = None) -> int:
    """``budget_bytes`` that gives every lane of ``spec`` (a spec with ``head_retention``) room for exactly
    ``sessions`` sessions at their peak (no re-cache reserve): the budget is split by each lane's peak bytes, so
    ``sessions`` x the sum of the lanes' peak bytes gives each lane ``sessions`` x its peak pages."""
    total = 0
    for lane, _ in lane_specs(spec):
        admission = admission_of(lane, extent_chunks_of(lane, backend, contiguous_extents))
        total += admission.pages_per_session() * bytes_per_page(lane)
    return sessions * total


def lane_names(cache: am.KVCache) -> tuple[str, ...]:
    return tuple(lane.name for lane in cache._lanes)


def lane_pages_in_use(state: am.KVState) -> dict[str, int]:
    """Pages ``state`` references in each lane (lane name -> pages)."""
    return {
        lane.name: sum(len(pages.referenced_pages()) for pages in branches.values())
        for lane, branches in zip(state.cache._lanes, state._lane_branches)
    }


def lane_bytes_in_use(state: am.KVState) -> int:
    """Bytes of the pages ``state`` references, over every lane (their pages differ in bytes)."""
    return sum(n * lane.pool.bytes_per_page for n, lane in zip(lane_pages_in_use(state).values(), state.cache._lanes))


def lane_committed(state: am.KVState, branch: str) -> list[int]:
    """Chunks ever committed on ``branch`` in each lane."""
    return [pages.committed_chunks for pages in state._lane_pages(branch)]


def lane_open(state: am.KVState, branch: str) -> list[bool]:
    """Whether ``branch`` belongs to an open forward, in each lane."""
    return [getattr(pages.transaction, "is_open", False) for pages in state._lane_pages(branch)]


def lane_kv(cache: am.KVCache, pages: Sequence[int], lane: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What lane ``lane``'s pool holds in ``pages`` for its layer ``layer``: ``(k, v)`` ``[tokens, lane heads, d]``
    (pages in order, float32 on the CPU)."""
    pool = cache._lanes[lane].pool
    index = torch.tensor(list(pages), dtype=torch.int64, device=pool.device)
    k = pool.k_pages(layer).index_select(0, index).flatten(0, 1)
    v = pool.v_pages(layer).index_select(0, index).flatten(0, 1)
    return k.float().cpu(), v.float().cpu()


def assert_lanes_hold_newest(
    cache: am.KVCache, state: am.KVState, branches: Sequence[str], written: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """Each lane's newest history chunk of each of ``branches`` (the forward's streams, in order) holds what the
    forward wrote there: ``written[layer]`` ``(k, v)`` ``[streams, chunk, kv_heads, d]``, the lane's heads of each of
    its layers, exactly."""
    for i, lane in enumerate(cache._lanes):
        assert lane.part is not None
        for inner, (layer, kv_heads) in enumerate(zip(lane.part.layers, lane.part.heads)):
            for stream, branch in enumerate(branches):
                newest = state._lane_branches[i][branch].history[-1]
                k, v = lane_kv(cache, newest, i, inner)
                heads = list(kv_heads)
                torch.testing.assert_close(k, written[layer][0][stream][:, heads].float(), atol=0, rtol=0,
                                           msg=lambda m: f"lane {lane.name} layer {layer} {branch} K: {m}")
                torch.testing.assert_close(v, written[layer][1][stream][:, heads].float(), atol=0, rtol=0,
                                           msg=lambda m: f"lane {lane.name} layer {layer} {branch} V: {m}")
