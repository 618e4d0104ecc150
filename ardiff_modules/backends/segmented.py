"""Relative-position sinks: one forward as two key segments, merged by their log-sum-exp.

With ``KVCacheSpec(relative_sinks=True)`` a stream's sink keys are attended as if they sat just
before its oldest window chunk (``ForwardLayout.sink_shifts``). Keys stay cached rotated at their
own positions; RoPE scores depend on ``query - key`` only, so the sinks are attended with a second
query, rotated at ``positions - sink_shift`` (``ForwardContext.sink_positions``), and the window and
pending keys with the usual query. Each segment is an ordinary plan of the same backend (ragged,
paged or masked, static for CUDA graphs), and one softmax over both is rebuilt exactly from the two
partial ones::

    lse = logaddexp(lse_sinks, lse_rest)
    out = exp(lse_sinks - lse) * out_sinks + exp(lse_rest - lse) * out_rest

No key is ever re-rotated or re-written: committed pages stay immutable, so forks and sessions
sharing sinks (``share_sinks_from``) read the same pages at their own shifts.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ardiff_modules.backends.base import AttentionBackend, AttentionPlan, PlanRequest, refuse_fp8_query
from ardiff_modules.errors import SpecError
from ardiff_modules.layout import ForwardLayout


class RelativeSinkPlan(AttentionPlan):
    """A forward whose sinks sit at relative positions: ``rest`` (window + pending, with the query; it
    also writes the current K/V) and ``sinks`` (the sink keys, with the sink query), merged.

    Attributes
    ----------
    rest, sinks:
        The two segments' plans, from the same backend.
    """

    def __init__(self, rest: AttentionPlan, sinks: AttentionPlan, sinkless: torch.Tensor | None = None) -> None:
        self.rest = rest
        self.sinks = sinks
        #: bool ``[tokens, 1]`` on the device: tokens of streams without sinks, whose sink-segment row ran over
        #: a stand-in page (``ForwardLayout.sinks_only``) and is discarded; ``None`` if every stream has sinks.
        self.sinkless = sinkless
        self.quantizer = rest.quantizer

    def __repr__(self) -> str:
        return f"RelativeSinkPlan(rest={self.rest!r}, sinks={self.sinks!r})"

    @property
    def write_slots(self) -> torch.Tensor:
        return self.rest.write_slots

    @property
    def uses_sink_query(self) -> bool:
        return True

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        return_lse: bool = False,
        *,
        layer: int = 0,
        q_sink: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        _require_sink_query(q_sink)  # before anything is written
        rest = self.rest.run(q, k, v, k_cache, v_cache, scale, True, layer=layer)
        return self._merge(rest, q_sink, k_cache, v_cache, scale, return_lse, layer)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        return_lse: bool = False,
        *,
        layer: int = 0,
        q_sink: torch.Tensor | None = None,
        q_scale: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        refuse_fp8_query(self, q_scale)  # relative sinks attend the 16-bit query (ForwardContext._fp8_query)
        _require_sink_query(q_sink)
        rest = self.rest.attend(q, k_cache, v_cache, scale, True, layer=layer)
        return self._merge(rest, q_sink, k_cache, v_cache, scale, return_lse, layer)

    def _merge(
        self,
        rest: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        q_sink: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        return_lse: bool,
        layer: int,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        assert q_sink is not None  # _require_sink_query
        out_rest, lse_rest = rest
        out_sink, lse_sink = self.sinks.attend(q_sink, k_cache, v_cache, scale, True, layer=layer)
        if self.sinkless is not None:
            lse_sink = lse_sink.masked_fill(self.sinkless, float("-inf"))
        out, lse = self.rest.merge(out_sink, lse_sink, out_rest, lse_rest)
        return (out, lse) if return_lse else out


def _require_sink_query(q_sink: torch.Tensor | None) -> None:
    """The functional API checks this first; a direct caller of the ops is told here, before any write."""
    if q_sink is None:
        raise SpecError(
            "relative-sinks plan: expected q_sink (the query rotated at sink_positions), got None; "
            "chunk_attention(..., sink_query=...) passes it"
        )


def plan_forward(backend: AttentionBackend, request: PlanRequest, previous: AttentionPlan | None) -> AttentionPlan:
    """``backend.plan`` for one forward, as two merged segments when its sinks sit at relative positions.

    The segments' plans are re-planned in place like any plan (``previous``'s segments are offered
    back), so a steady-state forward costs two plan refreshes and no new objects.
    """
    layout = request.layout
    prev_rest, prev_sinks = (
        (previous.rest, previous.sinks) if isinstance(previous, RelativeSinkPlan) else (previous, None)
    )
    if not layout.splits_sinks:
        return backend.plan(request, prev_rest)
    rest_mask = sink_mask = None
    if request.token_mask is not None:
        sink_cols, rest_cols = (c.to(request.token_mask.device) for c in layout.sink_columns())
        expand = (-1, request.token_mask.shape[1], -1)
        sink_mask = request.token_mask.gather(2, sink_cols[:, None, :].expand(expand))
        rest_mask = request.token_mask.gather(2, rest_cols[:, None, :].expand(expand))
    rest = backend.plan(replace(request, layout=layout.without_sinks(), token_mask=rest_mask), prev_rest)
    sinks = backend.plan(
        replace(request, layout=layout.sinks_only(), token_mask=sink_mask, segment="sinks"), prev_sinks
    )
    sinkless = _sinkless_mask(layout, request.device)
    if isinstance(previous, RelativeSinkPlan) and rest is previous.rest and sinks is previous.sinks:
        if sinkless is None and previous.sinkless is None:
            return previous
        if sinkless is not None and previous.sinkless is not None and previous.sinkless.shape == sinkless.shape:
            previous.sinkless.copy_(sinkless, non_blocking=True)  # in place: a captured graph reads it
            return previous
    return RelativeSinkPlan(rest, sinks, sinkless)


def _sinkless_mask(layout: ForwardLayout, device: torch.device) -> torch.Tensor | None:
    """bool ``[num_streams * seq_len, 1]``: the tokens of streams without a resident sink; ``None`` if none."""
    if not layout.sinkless_streams:
        return None
    mask = torch.zeros(layout.num_streams, layout.seq_len, 1, dtype=torch.bool)
    mask[list(layout.sinkless_streams)] = True
    return mask.reshape(-1, 1).to(device, non_blocking=True)
