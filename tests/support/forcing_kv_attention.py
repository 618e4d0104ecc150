"""Forcing-KV's attention cache, re-stated cache-free from its published code (no library logic).

Source: zju-jiyicheng/Forcing-KV at ``50ac1f454348e7f0a2e54bde71e1652b20c09fe6``,
``wan/modules/causal_model_forcingkv.py``: ``CausalWanSelfAttention.forward`` and ``dynamic_compression``,
``CausalWanModel._apply_offline_head_allocation`` and ``_forward_inference``. Per layer, in frames of
``HW`` tokens, blocks of 3 frames, ``S`` sink frames, windows ``Ls`` (spatial heads = the head file's
``static_head``), ``Lt`` (temporal heads = ``dynamic_head``), ``H = max(Ls, Lt)``, switch after block ``a``:

* layer 0 always, every layer up to block ``a``: every head sees ``[sink, last H non-sink frames, block]``;
* layers >= 1 from block ``a + 1``: spatial heads ``[sink, last Ls frames, block]``, temporal heads
  ``[sink, dynamic patches, last Lt frames, block]``;
* the dynamic patches a block ``c`` reads were chosen at the clean re-run of block ``c - 1`` (when that one
  ran after the switch): candidates = the ``T = min(Lt, non-sink frames before c - 1)`` frames then in the
  window and the first ``3 - T`` frames of block ``c - 1``; boundary = the frame after them; layer 1's
  temporal keys (batch row 0) score each candidate patch by the mean token cosine with the same patch of
  the next frame; the ``Ld * P`` lowest, ascending, are what every layer >= 1 keeps of its temporal heads.

Cache-free: each layer's K/V of every committed frame in a list (the keys after RoPE: what Forcing-KV
stores); a forward derives each group's keys by index arithmetic, and the dynamic patches by re-scoring the
committed keys of layer 1 (the keys Forcing-KV scored are the ones it stored). A commit is the clean re-run
(Forcing-KV writes at timestep 0 only). The model is :class:`~tests.support.streaming_model.TinyStreamingModel`
(its weights; the blocks' math written out as in :class:`~tests.support.streaming_model.NaiveStreaming`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tests.support.streaming_model import TinyStreamingModel

#: Frames per AR block (hard-coded 3 in Forcing-KV).
BLOCK = 3


def select_patches(candidates: torch.Tensor, boundary: torch.Tensor, num_frame_patch: int, keep: int) -> torch.Tensor:
    """Forcing-KV's layer-1 choice: ``candidates`` ``[3, HW, features]`` (the candidate frames' keys, heads
    flattened), ``boundary`` ``[HW, features]`` (the frame after them) -> the ascending flat indices
    ``frame * P + patch`` of the ``keep`` patches least similar to the same patch of the next frame."""
    chain = torch.cat([candidates, boundary[None]])  # [4, HW, features]
    per_patch = chain.shape[1] // num_frame_patch
    current = chain[:BLOCK].reshape(BLOCK, num_frame_patch, per_patch, -1)
    following = chain[1:].reshape(BLOCK, num_frame_patch, per_patch, -1)
    scores = F.cosine_similarity(current, following, dim=-1).mean(dim=2)  # [3, P]
    if keep == 0:
        return torch.empty(0, dtype=torch.long)
    return torch.sort(torch.topk(scores.reshape(-1), k=keep, largest=False).indices).values


@dataclass(frozen=True)
class ForcingKVSettings:
    """The method's numbers (frames), the head file's spatial heads per layer (layer 0's unused)."""

    frame_tokens: int
    sink_frames: int
    spatial_frames: int
    temporal_frames: int
    ar_start: int
    static_heads: tuple[tuple[int, ...], ...]
    dynamic: bool = False
    dynamic_frames: int = 0
    num_frame_patch: int = 1
    retention_ratio: float = 0.5

    @property
    def keep_patches(self) -> int:
        return self.dynamic_frames * self.num_frame_patch if self.dynamic else 0

    def check(self) -> None:
        """What Forcing-KV raises on (and the sink it would cut at the switch: not modelled)."""
        assert self.sink_frames <= BLOCK * (self.ar_start + 1), "a sink longer than the blocks before the switch"
        if self.dynamic:
            assert 1 <= self.temporal_frames <= BLOCK, "dynamic mode: temporal_context_length 1-3 frames"
            assert self.frame_tokens % self.num_frame_patch == 0, "frame tokens divisible by num_frame_patch"
            by_ratio = int(round(BLOCK * self.num_frame_patch * min(1.0, max(0.0, self.retention_ratio))))
            assert by_ratio == self.keep_patches, "dynamic capacity and sim_retention_ratio are inconsistent"


class ForcingKVCacheFree:
    """One batch of streams through Forcing-KV's caches; a forward is one 3-frame block."""

    def __init__(self, model: TinyStreamingModel, settings: ForcingKVSettings, batch: int) -> None:
        settings.check()
        self.model, self.s, self.batch = model, settings, batch
        #: per layer, per committed frame: (k, v) ``[batch, HW, kv_heads, head_dim]``
        self.frames: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in model.blocks]
        self.text: torch.Tensor | None = None  # [batch, text_tokens, context_dim]
        self.kv_heads = model.blocks[0].attn.num_kv_heads

    def set_prompt(self, text: torch.Tensor) -> None:
        self.text = text

    @property
    def committed_frames(self) -> int:
        return len(self.frames[0])

    # ------------------------------------------------------------------ what each group sees
    def sink_and_rest(self) -> tuple[list[int], list[int]]:
        """Committed frame indices: the sink (the first ``S``), then the rest oldest first."""
        n = self.committed_frames
        return list(range(min(self.s.sink_frames, n))), list(range(min(self.s.sink_frames, n), n))

    def switched(self) -> bool:
        """Whether this block reads the head groups: block ``a`` was re-run clean (committed)."""
        return self.committed_frames // BLOCK > self.s.ar_start

    def candidates(self) -> tuple[list[int], int] | None:
        """``(candidate frames, boundary frame)`` scored at the clean re-run of the previous block, or ``None``
        when it chose nothing (ran before the switch, no dynamic mode, or an empty temporal window)."""
        previous = self.committed_frames // BLOCK - 1
        if not self.s.keep_patches or previous <= self.s.ar_start:
            return None
        start = BLOCK * previous
        in_window = min(self.s.temporal_frames, start - self.s.sink_frames)
        if in_window < 1:  # dynamic_compression returns 0 (and resets the shared indices)
            return None
        first = start - in_window
        return list(range(first, first + BLOCK)), first + BLOCK

    def selection(self) -> tuple[list[int], torch.Tensor] | None:
        """``(candidate frames, kept flat patch indices)``: layer 1 scores, batch row 0, its temporal heads."""
        found = self.candidates()
        if found is None:
            return None
        frames, boundary = found
        heads = self.temporal_heads(1)
        keys = [self.frames[1][f][0][0][:, heads].flatten(1) for f in frames + [boundary]]  # [HW, heads * d]
        kept = select_patches(torch.stack(keys[:BLOCK]), keys[BLOCK], self.s.num_frame_patch, self.s.keep_patches)
        return frames, kept

    def temporal_heads(self, layer: int) -> list[int]:
        return [h for h in range(self.kv_heads) if h not in self.s.static_heads[layer]]

    def groups(self, layer: int, selection: tuple[list[int], torch.Tensor] | None) -> list[tuple[list[int], list]]:
        """``(kv heads, kept parts)`` per group, each part a list of ``(k, v)`` ``[batch, tokens, heads, d]``
        in Forcing-KV's concatenation order (the current block is appended by the caller)."""
        sink, rest = self.sink_and_rest()
        last = self.last_of(rest)
        if layer == 0 or not self.switched():
            every = list(range(self.kv_heads))
            widest = max(self.s.spatial_frames, self.s.temporal_frames)
            return [(every, self._frames(layer, sink + last(widest), every))]
        spatial = list(self.s.static_heads[layer])
        temporal = self.temporal_heads(layer)
        return [
            (spatial, self._frames(layer, sink + last(self.s.spatial_frames), spatial)),
            (temporal, self._frames(layer, sink, temporal) + self._patches(layer, selection, temporal)
             + self._frames(layer, last(self.s.temporal_frames), temporal)),
        ]

    @staticmethod
    def last_of(rest: list[int]) -> Callable[[int], list[int]]:
        """``last(count)``: the newest ``count`` frames of ``rest`` (none for ``count <= 0``)."""
        return lambda count: rest[max(0, len(rest) - count):] if count > 0 else []

    def _frames(self, layer: int, frames: Sequence[int], heads: list[int]) -> list:
        return [(self.frames[layer][f][0][:, :, heads], self.frames[layer][f][1][:, :, heads]) for f in frames]

    def _patches(self, layer: int, selection: tuple[list[int], torch.Tensor] | None, heads: list[int]) -> list:
        """This layer's K/V of the kept patches (same positions in every layer), ascending flat index."""
        if selection is None:
            return []
        frames, kept = selection
        per_patch = self.s.frame_tokens // self.s.num_frame_patch
        parts = []
        for index in kept.tolist():
            frame, patch = frames[index // self.s.num_frame_patch], index % self.s.num_frame_patch
            k, v = self.frames[layer][frame]
            span = slice(patch * per_patch, (patch + 1) * per_patch)
            parts.append((k[:, span][:, :, heads], v[:, span][:, :, heads]))
        return parts

    # ------------------------------------------------------------------ the model
    @torch.no_grad()
    def forward(self, x: torch.Tensor, commit: bool) -> torch.Tensor:
        """``x`` ``[batch, 3 * HW, dim]``: the next block (a denoising pass, or the clean re-run with ``commit``)."""
        n = x.shape[1]
        assert n == BLOCK * self.s.frame_tokens, "one 3-frame block per forward"
        start = self.committed_frames * self.s.frame_tokens
        positions = torch.arange(start, start + n)[None].expand(self.batch, n)
        selection = self.selection() if self.switched() else None
        written = []
        h = x
        for layer, block in enumerate(self.model.blocks):
            a = block.attn
            q, k, v = a.project(block.norm1(h))
            q, k = self.model.rope(q, positions), self.model.rope(k, positions)
            o = self._attend(q, k, v, self.groups(layer, selection), a.num_heads // a.num_kv_heads)
            h = h + a.to_out(o.reshape(self.batch, n, -1))
            h = h + self._cross(block, h)
            h = h + block.mlp(h)
            written.append((k, v))
        if commit:
            ft = self.s.frame_tokens
            for layer, (k, v) in enumerate(written):
                self.frames[layer] += [(k[:, f * ft:(f + 1) * ft], v[:, f * ft:(f + 1) * ft]) for f in range(BLOCK)]
        return h

    @staticmethod
    def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: list, rep: int) -> torch.Tensor:
        """Each group's query heads over ``[kept parts, current block]``, no mask; outputs put back in head order."""
        out = torch.empty_like(q)
        for heads, parts in groups:
            if not heads:
                continue
            q_heads = [h * rep + r for h in heads for r in range(rep)]
            keys = torch.cat([p[0] for p in parts] + [k[:, :, heads]], dim=1)
            values = torch.cat([p[1] for p in parts] + [v[:, :, heads]], dim=1)
            out[:, :, q_heads] = F.scaled_dot_product_attention(
                q[:, :, q_heads].transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), enable_gqa=rep > 1,
            ).transpose(1, 2)
        return out

    def _cross(self, block: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        c = block.cross
        assert self.text is not None
        ck, cv = (torch.stack(t) for t in zip(*(c.project_kv(text) for text in self.text)))
        qc = c.to_q(block.norm2(h)).view(self.batch, h.shape[1], c.num_heads, c.head_dim)
        oc = F.scaled_dot_product_attention(
            qc.transpose(1, 2), ck.transpose(1, 2), cv.transpose(1, 2), enable_gqa=c.num_heads != c.num_kv_heads,
        ).transpose(1, 2)
        return c.to_out(oc.reshape(self.batch, h.shape[1], -1))
