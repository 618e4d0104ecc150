"""LongLive 1.x's own ``CausalWanModel`` and ``InteractiveCausalInferencePipeline`` over the paged KV cache, unchanged.

One call replaces every block's ``self_attn`` and returns the driver of the cache session::

    from ardiff_modules.integrations.longlive import swap_self_attention

    spec = am.KVCacheSpec(num_layers=30, num_kv_heads=12, head_dim=128, chunk_size=3 * 1560, page_size=120,
                          sink_chunks=1, window_chunks=2, branches=("video",), dtype="bfloat16",
                          recache=am.RecacheRule.longlive(global_sink=True))   # sink_size=3, local_attn_size=12
    ll = swap_self_attention(pipeline.generator.model, spec)
    video = pipeline.inference(noise, text_prompts_list=prompts, switch_frame_indices=[40, 80])
    ll.finish()                                                          # commit the last chunk's clean forward

It is :mod:`ardiff_modules.integrations.self_forcing` (LongLive's model is Self-Forcing's, its pipeline
``CausalInferencePipeline``'s subclass) plus what LongLive adds to the attention call:

- **the signature**: ``x, seq_lens, grid_sizes, freqs, block_mask, kv_cache, current_start, cache_start,
  sink_recache_after_switch``; **the tuple return**: ``(y, (current_end, local_end_index, None))``, which
  LongLive's block unpacks and its ``_apply_cache_updates`` turns into ``global_end_index`` /
  ``local_end_index`` fills only (``None``: no K/V to write into its buffers -- they live in the paged pool);
- **the re-cache after a prompt switch** (``_recache_after_switch``): one model forward over the clean
  latents of the last ``min(local_attn_size, current_start_frame)`` frames, starting before the open chunk and
  ending where the next chunk starts. It becomes the library's re-cache under the spec's
  ``recache=RecacheRule.longlive(global_sink=...)`` (the rule that reproduces how LongLive rewrites its buffer).

The binding rule, LongLive's part (the rest is Self-Forcing's: re-run, next chunk, new video)
----------------------------------------------------------------------------------------------
A model forward of **more than one chunk** whose tokens end at the stream's next token (the open forward's
end, or the committed tokens) over the same ``kv_cache`` is a re-cache: the open forward (the last chunk's
clean re-run) is committed, ``prepare_recache`` opens, and each layer attends with the rows of ``x`` that
are the rebuilt chunks (at their own positions: RoPE from ``freqs`` as upstream); the rows LongLive does
not write either (its first ``sink_size`` frames once the buffer slid, with ``global_sink=True``) output
zeros -- LongLive discards the re-cache's output. The re-cache is committed when the next chunk starts
(or by :meth:`~ardiff_modules.integrations.self_forcing.SelfForcingSession.finish`)::

    chunks:   c0 (sink)  c1  c2  c3  c4          sink_size=3, local_attn_size=12, F=3; a switch at frame 15
    x:                   c1  c2  c3  c4          frames 3..14 (c4: the open clean re-run, committed first)
    rebuilt:  c0 kept;       c2 (context) c3 c4  global_sink=True (c1's rows output zeros)
              c1 -> the sink slot, c2 (context) c3 c4   global_sink=False (c0 dropped)

A switch after one chunk re-caches exactly that chunk at ``current_start=0`` (LongLive writes it as a
plain forward): the same as a re-run of the open chunk, and bound as one. ``sink_recache_after_switch`` is
LongLive's ``not global_sink``: a forward passing it other than the spec's rule says is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ardiff_modules.cache import KVCache
from ardiff_modules.context import ForwardContext
from ardiff_modules.core.recache import RecacheRule
from ardiff_modules.errors import SpecError, StreamPositionError, TensorMismatchError
from ardiff_modules.integrations.self_forcing import (
    OpenForward, SelfForcingSelfAttention, SelfForcingSession, check_rope_dtype, swap_layers,
)
from ardiff_modules.modules import ChunkSelfAttention
from ardiff_modules.spec import KVCacheSpec

__all__ = ["LongLiveSelfAttention", "LongLiveSession", "swap_self_attention"]

#: The spec rules a LongLive session runs under (``global_sink`` True, then False).
LONGLIVE_RULES = (RecacheRule.longlive(global_sink=True), RecacheRule.longlive(global_sink=False))

#: What the attention returns beside its output, LongLive's ``(current_end, local_end_index, cache_update_info)``.
CacheUpdate = tuple[int, int, None]


class LongLiveSelfAttention(SelfForcingSelfAttention):
    """A :class:`~ardiff_modules.integrations.self_forcing.SelfForcingSelfAttention` called the way LongLive 1.x
    calls its ``CausalWanSelfAttention`` (one more argument, a tuple returned); made by :func:`swap_self_attention`."""

    def forward(  # type: ignore[override]  # upstream's signature, on purpose
        self,
        x: torch.Tensor,
        seq_lens: Any,
        grid_sizes: torch.Tensor,
        freqs: torch.Tensor,
        block_mask: Any,
        kv_cache: Any = None,
        current_start: int = 0,
        cache_start: int | None = None,
        sink_recache_after_switch: bool = False,
    ) -> tuple[torch.Tensor, CacheUpdate]:
        """``x`` ``[B, L, dim]`` -> ``(y [B, L, dim], (current_end, current_end, None))``.

        ``L`` is one chunk, or a re-cache's frames (more than one chunk). Arguments as
        :meth:`SelfForcingSelfAttention.forward`; ``sink_recache_after_switch`` is checked against the spec's
        ``recache`` rule. The second element is what LongLive's ``_apply_cache_updates`` reads: ``None`` writes
        nothing into upstream's buffers, its indices are filled with ``current_end``.
        """
        session = self.bound_session()
        if not isinstance(session, LongLiveSession):
            raise SpecError(
                f"LongLiveSelfAttention: expected a layer bound to a LongLiveSession, got a {type(session).__name__}"
            )
        if self.layer_index == 0:
            session.advance(x, grid_sizes, freqs, kv_cache, current_start, sink_recache_after_switch)
        kv, rope = session.layer(self.layer_index, x, current_start)
        rows = session.rows
        if rows is None:
            y = ChunkSelfAttention.forward(self, x, kv, rope)
        else:  # a re-cache over part of x: the other rows are never attended (LongLive drops their K/V)
            rebuilt = ChunkSelfAttention.forward(self, x.index_select(1, rows), kv, rope)
            y = rebuilt.new_zeros(x.shape).index_copy(1, rows, rebuilt)
        end = session.open_end
        return y, (end, end, None)


@dataclass
class _OpenRecache(OpenForward):
    """An open re-cache: ``start`` / ``seq_len`` are upstream's ``x``; ``rows`` the rebuilt chunks' rows in it."""

    rows: torch.Tensor | None


class LongLiveSession(SelfForcingSession):
    """:class:`~ardiff_modules.integrations.self_forcing.SelfForcingSession` plus LongLive's re-cache forwards.

    Made by :func:`swap_self_attention`; the spec's ``recache`` must be ``RecacheRule.longlive(global_sink=...)``.
    """

    def __init__(
        self, cache: KVCache, *, branches: Sequence[str] | None = None, owns_cache: bool = False,
        upstream_window: tuple[int, int] | None = None, rope_dtype: torch.dtype = torch.float64,
    ) -> None:
        rule = cache.spec.recache
        if rule not in LONGLIVE_RULES:  # checked before the session opens: nothing to undo
            raise SpecError(
                "LongLiveSession: expected a spec with recache=RecacheRule.longlive(global_sink=True) or "
                f"RecacheRule.longlive(global_sink=False) (LongLive's _recache_after_switch), got {rule}"
            )
        sinks = cache.spec.policy.sink_chunks
        if sinks > 1:
            # NOTE: upstream's recomputes (every forward of a chunk after its first, the clean re-run included) never
            # write inside the sink region: a sink chunk after chunk 0 keeps its *first denoising forward's* K/V,
            # which a cache that commits the clean forward's K/V cannot reproduce.
            raise SpecError(
                "LongLiveSession: expected at most one sink chunk (sink_size <= num_frame_per_block frames; with a "
                f"1-frame image-to-video first chunk, sink_size <= 1), got sink_chunks={sinks}: LongLive 1.x keeps a "
                "sink chunk after the first as its first denoising forward wrote it (its recomputes skip the sink "
                "region); sinks longer than one chunk are not supported yet"
            )
        super().__init__(cache, branches=branches, owns_cache=owns_cache, upstream_window=upstream_window,
                         rope_dtype=rope_dtype)
        #: LongLive's ``global_sink`` (the pipeline's ``args.global_sink``), from the spec's rule.
        self.global_sink = rule == LONGLIVE_RULES[0]

    @property
    def rows(self) -> torch.Tensor | None:
        """Rows of the open re-cache's ``x`` that are its rebuilt chunks; ``None``: every row (or not a re-cache)."""
        return self._open.rows if isinstance(self._open, _OpenRecache) else None

    @property
    def open_end(self) -> int:
        """The token after the open forward's ``x`` (LongLive's ``current_end``); 0 when none is open."""
        return 0 if self._open is None else self._open.start + self._open.seq_len

    def advance(self, x: torch.Tensor, grid_sizes: torch.Tensor, freqs: torch.Tensor, kv_cache: Any,
                current_start: int, sink_recache_after_switch: bool = False) -> None:
        """Block 0 of a model forward: a re-cache (more than one chunk) or Self-Forcing's binding rule."""
        self._check_open("advance")
        self._check_sink_flag(sink_recache_after_switch, None)
        if isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[1] > self.cache.spec.chunk_size:
            self._recache(x, grid_sizes, freqs, kv_cache, self._start(current_start), sink_recache_after_switch)
        else:
            super().advance(x, grid_sizes, freqs, kv_cache, current_start)

    # ------------------------------------------------------------------ the re-cache
    def _recache(self, x: torch.Tensor, grid_sizes: torch.Tensor, freqs: torch.Tensor, kv_cache: Any, start: int,
                 sink_recache_after_switch: bool) -> None:
        """Commit the open forward, open ``prepare_recache`` over the rows of ``x`` it rebuilds."""
        tokens = int(x.shape[1])
        if x.shape[0] != len(self.branches):
            raise TensorMismatchError(
                f"LongLiveSelfAttention x: expected [{len(self.branches)} (one row per branch {self.branches}), "
                f"seq_len, dim], got {tuple(x.shape)}"
            )
        grid = self._grid(grid_sizes, tokens)
        replaced = self._kv_cache_replaced(kv_cache)
        following = self.open_end if self._open is not None else self.committed_tokens
        if replaced or start + tokens != following:
            reset = " over a kv_cache that was reset (a new video starts with one chunk at 0)" if replaced else ""
            raise StreamPositionError(
                f"LongLiveSession: expected a re-cache forward (x of more than one chunk) to end at token {following} "
                f"(where the next chunk starts), got tokens [{start}, {start + tokens}){reset}"
            )
        self._check_sink_flag(sink_recache_after_switch, True)
        tables = self._rope_tables(freqs, grid, start, x)
        # NOTE: the first change. LongLive applied the chunk's clean re-run to its buffers before the switch, so
        # it is committed here and stays committed if the re-cache below is refused.
        self._finish(success=True)
        forward = self.state.prepare_recache(self.branches)
        try:
            rows = self._rebuilt_rows(forward, start, tokens, x.device)
        except BaseException:
            forward.abort()
            raise
        if rows is not None:
            tables = (tables[0].index_select(1, rows), tables[1].index_select(1, rows))
        self._open = _OpenRecache(start, tokens, forward, self._rotation(tables), rows)
        self._marker = (kv_cache, kv_cache.get("global_end_index") if isinstance(kv_cache, Mapping) else None)

    def _rebuilt_rows(self, forward: ForwardContext, start: int, tokens: int,
                      device: torch.device) -> torch.Tensor | None:
        """Rows of ``x`` (tokens ``[start, start + tokens)``) holding each rebuilt chunk, in the re-cache's order."""
        layout = forward._layout
        assert layout is not None  # a begun forward has its layout
        lengths = layout.chunk_lengths
        chunk_starts = {s.pending_starts or tuple(s.token_offset + o for o in layout.chunk_starts[:-1])
                        for s in layout.streams}
        if len(chunk_starts) != 1:
            raise StreamPositionError(
                f"LongLiveSession: expected every branch to rebuild the same chunks (one batch), got starts {chunk_starts}"
            )
        rows: list[int] = []
        for first, length in zip(chunk_starts.pop(), lengths):
            if first < start or first + length > start + tokens:
                raise SpecError(
                    f"LongLiveSession: expected the re-cache's chunks inside upstream's re-cache frames (tokens "
                    f"[{start}, {start + tokens})), got a chunk at [{first}, {first + length}): the spec's "
                    "sink / window is not upstream's local_attn_size buffer"
                )
            rows.extend(range(first - start, first - start + length))
        if rows == list(range(tokens)):
            return None
        return torch.tensor(rows, dtype=torch.long, device=device)

    def _check_sink_flag(self, flag: Any, recache: bool | None) -> None:
        """``sink_recache_after_switch`` is LongLive's ``not global_sink`` on a re-cache (``recache=True``), and
        may be passed as such on a one-chunk re-cache (``None``: any forward); host bools only."""
        moving = not self.global_sink
        if not isinstance(flag, bool) or (flag and not moving) or (recache and flag != moving):
            raise SpecError(
                f"LongLiveSession: expected sink_recache_after_switch={moving} on a re-cache (upstream's not "
                f"global_sink; the spec's recache=RecacheRule.longlive(global_sink={self.global_sink})), got {flag!r}"
            )


def swap_self_attention(
    model: nn.Module,
    cache_or_spec: KVCache | KVCacheSpec,
    *,
    branches: Sequence[str] | None = None,
    num_pages: int | None = None,
    budget_bytes: int | None = None,
    backend: str = "auto",
    check_window: bool = True,
    rope_dtype: torch.dtype = torch.float64,
) -> LongLiveSession:
    """Replace ``model.blocks[i].self_attn`` (LongLive 1.x's ``CausalWanSelfAttention``) by
    :class:`LongLiveSelfAttention` layers driven by one new :class:`LongLiveSession`.

    As :func:`ardiff_modules.integrations.self_forcing.swap_self_attention`; the spec's ``recache`` must be
    ``RecacheRule.longlive(global_sink=...)`` with the pipeline's ``global_sink``, and the default ``num_pages``
    makes room for a re-cache at the session's peak (its history, and as many rebuilt chunks plus one).
    ``rope_dtype``: upstream's float64 rotation (default) or the library's float32 one, as Self-Forcing's.
    """
    check_rope_dtype("swap_self_attention", rope_dtype)
    spec = cache_or_spec.spec if isinstance(cache_or_spec, KVCache) else cache_or_spec
    history = spec.max_history_chunks if isinstance(spec, KVCacheSpec) else None
    session = swap_layers(
        model, cache_or_spec, LongLiveSelfAttention, LongLiveSession, branches=branches, num_pages=num_pages,
        budget_bytes=budget_bytes, backend=backend, check_window=check_window,
        peak_pending_chunks=1 if history is None else history + 1, rope_dtype=rope_dtype,
    )
    assert isinstance(session, LongLiveSession)  # swap_layers builds ``session_type``
    return session
