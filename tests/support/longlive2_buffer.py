"""LongLive 2.0's KV buffer with its multi-shot sink, re-stated from its code (no library logic).

Upstream ``NVlabs/LongLive`` at ``7860ad9``: ``wan_5b/modules/causal_model.py`` (``CausalWanSelfAttention.forward``'s
cache path and ``CausalWanModel._apply_cache_updates``) and ``pipeline/causal_diffusion_inference.py``
(``_zero_kv_data``, ``_pin_current_chunk``; the per-chunk loop: denoising forwards, then ``_zero_kv_data`` on a
scene cut with ``shot_clean_recache``, the clean forward, then ``_pin_current_chunk`` on a scene cut). One layer,
one stream, bf16 buffers replaced by float tensors, the non-quantized path. Names follow upstream's.

The buffer is ``kv_cache_size = local_attn_size x frame_seqlen`` tokens, the attention ``max_attention_size``
the same (``_set_all_modules_max_attention_size``), so ``window_start`` is always 0 and neither of upstream's
``prepend_sink`` / ``prepend_pinned`` cases is reached (asserted): a forward attends ``buffer[:local_end_index]``
after its own write. Keys are given rotated (absolute RoPE: ``use_relative_rope`` off, upstream's default).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class LongLive2Buffer:
    """One layer's ``kv_cache`` dict and the attention over it (tokens; ``sink_size`` in frames)."""

    def __init__(self, *, sink_size: int, local_attn_size: int, frame_seqlen: int, heads: int, dim: int,
                 multi_shot_sink: bool = True) -> None:
        self.frame_seqlen = frame_seqlen
        self.sink_tokens = sink_size * frame_seqlen
        # pipeline: global_sink_size = sink_size if multi_shot_sink else 0
        self.global_sink_tokens = self.sink_tokens if multi_shot_sink else 0
        self.kv_cache_size = local_attn_size * frame_seqlen
        self.max_attention_size = local_attn_size * frame_seqlen
        self.k = torch.zeros(1, self.kv_cache_size, heads, dim)
        self.v = torch.zeros(1, self.kv_cache_size, heads, dim)
        #: Not upstream's: the absolute position of each buffer token (-1: never written), rolled with it.
        self.pos = torch.full((self.kv_cache_size,), -1, dtype=torch.long)
        #: Not upstream's: the positions each forward attended, in order.
        self.attended: list[list[int]] = []
        self.global_end_index = 0
        self.local_end_index = 0
        self.pinned_start = -1
        self.pinned_len = 0

    def _effective_sink(self) -> tuple[bool, int]:
        has_pinned = self.pinned_start >= 0 and self.pinned_len > 0
        if has_pinned and self.pinned_start == self.global_sink_tokens:
            return has_pinned, self.global_sink_tokens + self.pinned_len
        if has_pinned:
            return has_pinned, self.global_sink_tokens
        return has_pinned, max(self.global_sink_tokens, self.sink_tokens)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, current_start: int) -> torch.Tensor:
        """``q/k/v [1, n, heads, dim]`` of one model forward at token ``current_start``: write, attend, update."""
        n = q.shape[1]
        current_end = current_start + n
        has_pinned, effective_sink = self._effective_sink()
        temp_k, temp_v, temp_pos = self.k.clone(), self.v.clone(), self.pos.clone()
        pinned_shift = 0
        if current_end > self.global_end_index and n + self.local_end_index > self.kv_cache_size:
            num_evicted = n + self.local_end_index - self.kv_cache_size
            num_rolled = self.local_end_index - num_evicted - effective_sink
            local_end = self.local_end_index + current_end - self.global_end_index - num_evicted
            src = slice(effective_sink + num_evicted, effective_sink + num_evicted + num_rolled)
            dst = slice(effective_sink, effective_sink + num_rolled)
            temp_k[:, dst] = temp_k[:, src].clone()
            temp_v[:, dst] = temp_v[:, src].clone()
            temp_pos[dst] = temp_pos[src].clone()
            if has_pinned and self.pinned_start >= effective_sink:
                pinned_shift = num_evicted
        else:
            local_end = self.local_end_index + current_end - self.global_end_index
        temp_k[:, local_end - n:local_end] = k
        temp_v[:, local_end - n:local_end] = v
        temp_pos[local_end - n:local_end] = torch.arange(current_start, current_end)
        window_start = max(0, local_end - self.max_attention_size)
        assert window_start == 0, "kv_cache_size == max_attention_size: the window is the whole buffer"
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), temp_k[:, :local_end].transpose(1, 2), temp_v[:, :local_end].transpose(1, 2)
        ).transpose(1, 2)
        # _apply_cache_updates: the rolled buffer, the pinned anchor, the indices
        self.k, self.v, self.pos = temp_k, temp_v, temp_pos
        self.attended.append(temp_pos[:local_end].tolist())
        self.pinned_start -= pinned_shift
        self.global_end_index, self.local_end_index = current_end, local_end
        return out

    def zero_kv_data(self, current_start: int) -> None:
        """``_zero_kv_data``: keep the global sink, drop the rest; positions run on (``shot_clean_recache``)."""
        self.local_end_index = self.global_sink_tokens
        self.global_end_index = current_start
        self.pinned_start, self.pinned_len = -1, 0

    def pin_current_chunk(self, chunk_tokens: int) -> None:
        """``_pin_current_chunk``: the chunk just written, its first ``min(sink_size, chunk)`` frames pinned."""
        self.pinned_len = min(self.sink_tokens, chunk_tokens)
        self.pinned_start = self.local_end_index - chunk_tokens


SCENE_CUT_PREFIX = "The scene transitions. "  # utils/dataset.py DEFAULT_SCENE_CUT_PREFIX


def is_shot_boundary(raw_prompts: list[str], chunk_index: int) -> bool:
    """``_is_shot_boundary``: not chunk 0, and the chunk's prompt starts with the scene-cut prefix."""
    if chunk_index == 0 or chunk_index >= len(raw_prompts):
        return False
    prompt = raw_prompts[chunk_index]
    return isinstance(prompt, str) and prompt.startswith(SCENE_CUT_PREFIX)


def rope_offsets(raw_prompts: list[str], phi: float) -> list[float]:
    """Per chunk, ``rope_temporal_offset`` in frames: the shot index (shot boundaries so far) times ``phi``."""
    shot, out = 0, []
    for c in range(len(raw_prompts)):
        if is_shot_boundary(raw_prompts, c) and phi != 0.0:
            shot += 1
        out.append(shot * phi)
    return out


def run_longlive2(buffer: LongLive2Buffer, forwards: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]],
                  raw_prompts: list[str], shot_clean_recache: bool, multi_shot_sink: bool = True
                  ) -> list[list[torch.Tensor]]:
    """The pipeline's chunk loop over ``forwards[c]`` (denoising forwards, the clean forward last) of each chunk
    ``c`` prompted ``raw_prompts[c]`` (``_is_scene_cut``: a shot boundary, ``multi_shot_sink``, ``sink_size > 0``).
    Returns each forward's output."""
    outputs = []
    current_start = 0
    for c, chunk in enumerate(forwards):
        is_scene_cut = multi_shot_sink and buffer.sink_tokens > 0 and is_shot_boundary(raw_prompts, c)
        n = chunk[0][0].shape[1]
        outs = [buffer.forward(q, k, v, current_start) for q, k, v in chunk[:-1]]
        if is_scene_cut and shot_clean_recache:
            buffer.zero_kv_data(current_start)
        outs.append(buffer.forward(*chunk[-1], current_start))
        if is_scene_cut:
            buffer.pin_current_chunk(n)
        outputs.append(outs)
        current_start += n
    return outputs
