"""The visibility rule as pictures: chunk-level masks and a PNG renderer for docs.

``chunk_visibility`` gives, for the pending chunks of one forward, which absolute chunks
(committed ones, evicted included, then pending ones) each query chunk attends to -- the
visibility rule at chunk granularity: pending query chunk ``c`` sees the resident committed
chunks (the sink chunks and the window chunks, or what a ``RetentionPolicy`` keeps) and pending
chunks ``0..c`` (bidirectional inside a chunk, block-causal across pending chunks), or every
pending chunk under ``pending_attention="bidirectional"`` (Rolling Forcing). The token-level mask
over the gathered keys of a real forward is ``ForwardContext.to_dense()``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ardiff_modules.errors import SpecError
from ardiff_modules.spec import PendingAttention, require_field_int, check_pending_attention
from ardiff_modules.core.retention import RetentionPolicy, SinkWindowMemoryPolicy, SinkWindowPolicy


def _policy(
    owner: str, sink_chunks: int, window_chunks: int | None, policy: RetentionPolicy | None
) -> RetentionPolicy:
    """The rule to draw: ``policy``, or sink + window from the two counts (not both)."""
    if policy is not None:
        if not isinstance(policy, RetentionPolicy):
            raise SpecError(f"{owner}.policy: expected a RetentionPolicy, got {type(policy).__name__}")
        if (sink_chunks, window_chunks) != (0, None):
            raise SpecError(
                f"{owner}: expected sink_chunks/window_chunks left at (0, None) with a policy, got "
                f"({sink_chunks}, {window_chunks})"
            )
        return policy
    require_field_int(owner, "sink_chunks", sink_chunks, minimum=0)
    if window_chunks is not None:
        require_field_int(owner, "window_chunks", window_chunks, minimum=0)
    return SinkWindowPolicy(sink_chunks, window_chunks)


def chunk_visibility(
    num_committed: int,
    num_pending: int,
    sink_chunks: int = 0,
    window_chunks: int | None = None,
    *,
    policy: RetentionPolicy | None = None,
    pending_attention: PendingAttention = "block_causal",
) -> torch.Tensor:
    """Bool ``[num_pending, num_committed + num_pending]``: query chunk ``c`` sees absolute chunk ``j``.

    Columns ``0 .. num_committed - 1`` are committed chunks in commit order (evicted ones are
    all-False columns); the last ``num_pending`` columns are the pending chunks (block-causal, or all
    visible with ``pending_attention="bidirectional"``). The history rule is sink + window, or any
    :class:`RetentionPolicy` given as ``policy``.
    """
    require_field_int("chunk_visibility", "num_committed", num_committed, minimum=0)
    # A forward always has at least one pending (query) chunk.
    require_field_int("chunk_visibility", "num_pending", num_pending, minimum=1)
    policy = _policy("chunk_visibility", sink_chunks, window_chunks, policy)
    rule = check_pending_attention("chunk_visibility.pending_attention", pending_attention)
    mask = torch.zeros(num_pending, num_committed + num_pending, dtype=torch.bool)
    mask[:, policy.history_indices(num_committed)] = True
    pending = torch.arange(num_pending)
    mask[:, num_committed:] = True if rule == "bidirectional" else pending[None, :] <= pending[:, None]
    return mask


def chunk_visibility_name(
    sink_chunks: int = 0, window_chunks: int | None = None, *, policy: RetentionPolicy | None = None,
    pending_attention: PendingAttention = "block_causal",
) -> str:
    """Readable name of a rule, e.g. ``sink1_window6`` or ``sink1_window6_bidirectional`` (attention-gym style)."""
    rule = _policy("chunk_visibility_name", sink_chunks, window_chunks, policy)
    pending = check_pending_attention("chunk_visibility_name.pending_attention", pending_attention)
    suffix = "_bidirectional" if pending == "bidirectional" else ""
    if isinstance(rule, SinkWindowPolicy):
        window = "all" if rule.window_chunks is None else str(rule.window_chunks)
        return f"sink{rule.sink_chunks}_window{window}{suffix}"
    if isinstance(rule, SinkWindowMemoryPolicy):
        return (
            f"sink{rule.sink_chunks}_window{rule.window_chunks}_memory{rule.memory_chunks}"
            f"every{rule.memory_every}{suffix}"
        )
    return type(rule).__name__ + suffix


def render_chunk_mask(
    path: str | Path,
    num_committed: int,
    num_pending: int,
    sink_chunks: int = 0,
    window_chunks: int | None = None,
    *,
    policy: RetentionPolicy | None = None,
    pending_attention: PendingAttention = "block_causal",
) -> Path:
    """Save :func:`chunk_visibility` as a PNG (needs matplotlib); returns the path.

    Draws on a standalone ``Figure`` (no pyplot, no global backend change).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise SpecError(f"render_chunk_mask.path: expected a str or os.PathLike, got {path!r} ({type(path).__name__})")
    # Validates before plotting.
    mask = chunk_visibility(
        num_committed, num_pending, sink_chunks, window_chunks, policy=policy, pending_attention=pending_attention
    )
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("render_chunk_mask needs matplotlib: pip install 'ardiff_modules[examples]'") from exc
    total = mask.shape[1]
    fig = Figure(figsize=(max(4.0, 0.45 * total), max(1.6, 0.45 * num_pending + 1.0)))
    ax = fig.subplots()
    ax.imshow(mask.numpy(), cmap="Blues", vmin=0, vmax=1.4, aspect="equal")
    ax.set_xticks(range(total), [str(j) if j < num_committed else f"p{j - num_committed}" for j in range(total)])
    ax.set_yticks(range(num_pending), [f"p{c}" for c in range(num_pending)])
    ax.axvline(num_committed - 0.5, color="k", lw=1)
    ax.set_xlabel("key chunk (committed, then pending)")
    ax.set_ylabel("query chunk")
    ax.set_title(chunk_visibility_name(sink_chunks, window_chunks, policy=policy, pending_attention=pending_attention))
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
