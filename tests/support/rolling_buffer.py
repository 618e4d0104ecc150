"""Self-Forcing / LongLive's rolling KV buffer, in frames, written from their semantics (no library logic).

The buffer holds at most ``local_attn_size`` frames (``None``: unbounded); the first ``sink_size`` frames
ever written stay forever; writing a chunk appends its frames and, while the buffer is over its size, drops
the oldest frame that is not a sink. A chunk's queries attend to the whole buffer after its own write (the
current chunk counted in the window).

* :func:`chunk_frames` -- the frame ranges of a stream's chunks (a 1-frame first chunk for image-to-video).
* :func:`visible_frames` -- the frames each chunk's queries see in that buffer.
* :func:`rolling_attention` -- the buffer as tensors (a contiguous K/V buffer, SDPA over all of it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def chunk_frames(num_chunks: int, frames_per_chunk: int, independent_first_frame: bool) -> list[range]:
    """Frame indices of each chunk: ``F`` frames each, or 1 then ``F`` each with ``independent_first_frame``."""
    sizes = [1 if (independent_first_frame and c == 0) else frames_per_chunk for c in range(num_chunks)]
    starts = [sum(sizes[:c]) for c in range(num_chunks)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def visible_frames(sink_size: int, local_attn_size: int | None, chunks: list[range]) -> list[list[int]]:
    """The frames in the buffer when each chunk's queries attend (ascending)."""
    buffer: list[int] = []
    seen: list[list[int]] = []
    for frames in chunks:
        buffer.extend(frames)
        while local_attn_size is not None and len(buffer) > local_attn_size:
            del buffer[sink_size]  # the oldest frame after the sinks
        seen.append(list(buffer))
    return seen


def rolling_attention(q_chunks: list[torch.Tensor], k_chunks: list[torch.Tensor], v_chunks: list[torch.Tensor], sink_tokens: int,
                      buffer_tokens: int) -> list[torch.Tensor]:
    """Per chunk ``[streams, tokens, heads, dim]`` outputs of a contiguous rolling K/V buffer (token counts).

    Tensors of one chunk: its q/k/v; the buffer keeps the first ``sink_tokens`` keys and rolls the rest.
    """
    k_buf: torch.Tensor | None = None
    v_buf: torch.Tensor | None = None
    outputs = []
    for q, k, v in zip(q_chunks, k_chunks, v_chunks):
        k_buf = k if k_buf is None else torch.cat([k_buf, k], dim=1)
        v_buf = v if v_buf is None else torch.cat([v_buf, v], dim=1)
        over = k_buf.shape[1] - buffer_tokens
        if over > 0:  # roll: drop the oldest `over` keys after the sinks
            k_buf = torch.cat([k_buf[:, :sink_tokens], k_buf[:, sink_tokens + over:]], dim=1)
            v_buf = torch.cat([v_buf[:, :sink_tokens], v_buf[:, sink_tokens + over:]], dim=1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k_buf.transpose(1, 2), v_buf.transpose(1, 2))
        outputs.append(out.transpose(1, 2))
    return outputs
