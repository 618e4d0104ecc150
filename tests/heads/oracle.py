"""A cache-free recomputation with per-head visibility, and a rollout driver for head-grouped caches.

:class:`PerHeadOracle` keeps, per branch and layer, the K/V of every committed chunk in a list and, for
each K/V head, reads the visible chunks from that head's own group policy (``history_indices``): no pages,
no parts, no head split. :func:`rollout` drives the same random chunk attention through a
:class:`HeadGroupedKVCache` and the oracle and returns both outputs per forward.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import ardiff_modules as am


@dataclass
class PerHeadOracle:
    heads: am.HeadRetention
    #: branch -> layer -> committed chunks, each ``(k, v)`` ``[chunk, kv_heads, d]``
    committed: dict[str, list[list[tuple[torch.Tensor, torch.Tensor]]]] = field(
        default_factory=lambda: defaultdict(list)
    )

    def _layer_chunks(self, branch: str, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        chunks = self.committed[branch]
        while len(chunks) <= layer:
            chunks.append([])
        return chunks[layer]

    def attend(self, branch: str, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q [n, heads, d]`` over each head's visible history + the current ``k``/``v`` ``[n, kv_heads, d]``
        (one pending chunk: full attention inside it)."""
        history = self._layer_chunks(branch, layer)
        group = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        for h in range(k.shape[1]):
            policy = self.heads.groups[self.heads.group_of(layer, h)]
            visible = [history[i] for i in policy.history_indices(len(history))]
            keys = torch.cat([c[0][:, h] for c in visible] + [k[:, h]])
            values = torch.cat([c[1][:, h] for c in visible] + [v[:, h]])
            for j in range(group):
                qh = q[:, h * group + j]
                out[:, h * group + j] = F.scaled_dot_product_attention(
                    qh[None, None], keys[None, None], values[None, None]
                )[0, 0]
        return out

    def commit(self, branch: str, layer_kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for layer, (k, v) in enumerate(layer_kv):
            self._layer_chunks(branch, layer).append((k.clone(), v.clone()))


def random_qkv(streams: int, n: int, heads: int, kv_heads: int, d: int, gen: torch.Generator, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shape = (streams, n)
    q = torch.randn(*shape, heads, d, generator=gen).to(dtype)
    k = torch.randn(*shape, kv_heads, d, generator=gen).to(dtype)
    v = torch.randn(*shape, kv_heads, d, generator=gen).to(dtype)
    return q, k, v


def one_forward(
    session: am.HeadGroupedSession, oracle: PerHeadOracle, branches: Sequence[str], chunk: int,
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
