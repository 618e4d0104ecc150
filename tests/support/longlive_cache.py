"""LongLive 1.x's KV cache and prompt-switch re-cache, re-stated from its published semantics (no library logic).

LongLive (NVlabs/LongLive, ``wan/modules/causal_model.py`` ``CausalWanSelfAttention.forward`` with a
``kv_cache``, ``_apply_cache_updates``, and ``pipeline/interactive_causal_inference.py``
``_recache_after_switch``), per layer and batch row, in tokens:

* a contiguous buffer of ``local_attn_size`` frames (``cache_size`` tokens), ``global_end`` (tokens ever
  written) and ``local_end`` (the buffer's end); the first ``sink_size`` frames are the sink region;
* a forward at ``current_start`` writing ``s`` tokens: if it goes past ``global_end`` and would overflow,
  the tokens after the sink region roll left by the overflow (the oldest leave); the new K/V land at
  ``[local_end - s, local_end)`` -- in a *recompute* (``current_end <= global_end`` and ``current_start >
  0``) never inside the sink region, unless ``sink_recache_after_switch``; the queries attend, without a
  mask, to the sink region and the buffer up to ``local_end``; indices advance only when not a recompute;
* ``_recache_after_switch(output, current_start_frame)``: with ``global_sink=False`` zero every buffer
  (indices kept); run the model once over the last ``min(local_attn_size, current_start_frame)`` frames of
  the clean output at ``current_start = recache_start_frame * frame_tokens`` (a recompute), with
  ``sink_recache_after_switch = not global_sink``.

The model is :class:`~tests.support.streaming_model.TinyStreamingModel` (its weights; the blocks' math
written out as in :class:`~tests.support.streaming_model.NaiveStreaming`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.support.streaming_model import TinyStreamingModel


class LongLiveCache:
    """One batch of streams through LongLive's rolling buffers; ``local_frames=None`` is ``local_attn_size=-1``."""

    def __init__(
        self, model: TinyStreamingModel, *, frame_tokens: int, sink_frames: int, local_frames: int | None,
        batch: int, max_tokens: int = 4096,
    ) -> None:
        self.model, self.frame_tokens, self.batch = model, frame_tokens, batch
        self.local_frames = local_frames
        self.sink_tokens = sink_frames * frame_tokens
        self.cache_size = max_tokens if local_frames is None else local_frames * frame_tokens
        a = model.blocks[0].attn
        shape = (batch, self.cache_size, a.num_kv_heads, a.head_dim)
        self.k = [torch.zeros(shape) for _ in model.blocks]
        self.v = [torch.zeros(shape) for _ in model.blocks]
        self.global_end = [0] * len(model.blocks)
        self.local_end = [0] * len(model.blocks)
        self.text: torch.Tensor | None = None  # [batch, text_tokens, context_dim]

    def set_prompt(self, text: torch.Tensor) -> None:
        self.text = text

    @torch.no_grad()
    def forward(self, x: torch.Tensor, current_start: int, sink_recache_after_switch: bool = False) -> torch.Tensor:
        """``x`` ``[batch, s, dim]`` at absolute token ``current_start``; the cache updates after every layer ran."""
        n = x.shape[1]
        positions = torch.arange(current_start, current_start + n)[None].expand(self.batch, n)
        updates = []
        h = x
        for layer, block in enumerate(self.model.blocks):
            a = block.attn
            q, k, v = a.project(block.norm1(h))
            q, k = self.model.rope(q, positions), self.model.rope(k, positions)
            keys, values, update = self._attend_cache(layer, k, v, current_start, sink_recache_after_switch)
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                enable_gqa=a.num_heads != a.num_kv_heads,
            ).transpose(1, 2)
            h = h + a.to_out(o.reshape(self.batch, n, -1))
            c = block.cross
            assert self.text is not None
            ck, cv = (torch.stack(t) for t in zip(*(c.project_kv(text) for text in self.text)))
            qc = c.to_q(block.norm2(h)).view(self.batch, n, c.num_heads, c.head_dim)
            oc = F.scaled_dot_product_attention(
                qc.transpose(1, 2), ck.transpose(1, 2), cv.transpose(1, 2), enable_gqa=c.num_heads != c.num_kv_heads,
            ).transpose(1, 2)
            h = h + c.to_out(oc.reshape(self.batch, n, -1))
            h = h + block.mlp(h)
            updates.append(update)
        for layer, update in enumerate(updates):
            self._apply(layer, update)
        return h

    def _attend_cache(self, layer: int, k: torch.Tensor, v: torch.Tensor, current_start: int, sink_recache: bool):  # noqa: ANN202
        """LongLive's temporary buffer for this layer's attention, and the update to apply after the forward."""
        return attend_buffer(
            self.k[layer], self.v[layer], k, v, current_start=current_start, global_end=self.global_end[layer],
            local_end=self.local_end[layer], sink_tokens=self.sink_tokens, bounded=self.local_frames is not None,
            sink_recache=sink_recache,
        )

    def _apply(self, layer: int, update: tuple) -> None:
        ends = apply_update(self.k[layer], self.v[layer], update)
        if ends is not None:
            self.global_end[layer], self.local_end[layer] = ends

    @torch.no_grad()
    def recache(self, output: torch.Tensor, current_start_frame: int, global_sink: bool) -> tuple[torch.Tensor, int]:
        """``_recache_after_switch`` over ``output`` ``[batch, frames * frame_tokens, dim]`` (the clean latents so
        far); returns the re-cache forward's output and its first frame (``recache_start_frame``)."""
        if not global_sink:
            for t in (*self.k, *self.v):
                t.zero_()
        if current_start_frame == 0:
            return output[:, :0], 0
        frames = current_start_frame if self.local_frames is None else min(self.local_frames, current_start_frame)
        start_frame = current_start_frame - frames
        ft = self.frame_tokens
        x = output[:, start_frame * ft : current_start_frame * ft]
        out = self.forward(x, start_frame * ft, sink_recache_after_switch=not global_sink)
        return out, start_frame


def attend_buffer(
    buf_k: torch.Tensor, buf_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, current_start: int, global_end: int,
    local_end: int, sink_tokens: int, bounded: bool, sink_recache: bool,
) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """LongLive's ``CausalWanSelfAttention`` cache step for one layer: ``k`` / ``v`` ``[B, n, heads, d]`` at
    ``current_start`` over the buffers ``[B, size, heads, d]`` (left untouched) and their indices.

    Returns the keys / values the queries attend (the sink region and the buffer up to ``local_end``: its
    ``max_attention_size`` is the buffer's size) and the update :func:`apply_update` applies after the forward.
    """
    n, size = k.shape[1], buf_k.shape[1]
    current_end = current_start + n
    local_end_old = local_end
    is_recompute = current_end <= global_end and current_start > 0
    temp_k, temp_v = buf_k.clone(), buf_v.clone()
    sink = sink_tokens
    roll = None
    if bounded and current_end > global_end and n + local_end_old > size:
        evicted = n + local_end_old - size
        rolled = local_end_old - evicted - sink
        local_end = local_end_old + current_end - global_end - evicted
        for t in (temp_k, temp_v):
            t[:, sink : sink + rolled] = t[:, sink + evicted : sink + evicted + rolled].clone()
        roll = (sink, rolled, evicted)
    else:
        local_end = local_end_old + current_end - global_end
    local_start = local_end - n
    write_start = max(local_start, sink) if is_recompute else local_start
    if sink_recache and roll is None:
        write_start = local_start
    offset = max(0, write_start - local_start)
    new_k, new_v = k[:, offset:], v[:, offset:]
    if local_end > write_start:
        temp_k[:, write_start:local_end], temp_v[:, write_start:local_end] = new_k, new_v
    if sink > 0:
        start = max(sink, local_end - (size - sink))
        keys = torch.cat([temp_k[:, :sink], temp_k[:, start:local_end]], dim=1)
        values = torch.cat([temp_v[:, :sink], temp_v[:, start:local_end]], dim=1)
    else:
        start = max(0, local_end - size)
        keys, values = temp_k[:, start:local_end], temp_v[:, start:local_end]
    return keys, values, (roll, write_start, local_end, new_k, new_v, current_end, is_recompute)


def apply_update(buf_k: torch.Tensor, buf_v: torch.Tensor, update: tuple) -> tuple[int, int] | None:
    """LongLive's ``_apply_cache_updates`` for one layer: roll and write the buffers in place; returns the new
    ``(global_end, local_end)``, or ``None`` for a recompute (indices never move back)."""
    roll, write_start, local_end, new_k, new_v, current_end, is_recompute = update
    for buf, new in ((buf_k, new_k), (buf_v, new_v)):
        if roll is not None:
            sink, rolled, evicted = roll
            buf[:, sink : sink + rolled] = buf[:, sink + evicted : sink + evicted + rolled].clone()
        if local_end > write_start:
            buf[:, write_start:local_end] = new
    return None if is_recompute else (current_end, local_end)
