"""``chunk_attention`` with gradients: the gathered history (a constant, or straight-through) and the forward's own
live K/V in one SDPA, eagerly or inside a compiled graph (one opaque op finds the record)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ardiff_modules.checks import needs_gqa
from ardiff_modules.context import ForwardContext, LayerContext
from ardiff_modules.errors import SpecError, TrainingScopeError
from ardiff_modules.ops import HANDLES
from ardiff_modules.quant import dequantize, is_quantized, quantize
from ardiff_modules.training.records import (
    REPLAY,
    HistoryRead,
    HistoryView,
    in_recomputation,
    read_history,
)
from ardiff_modules.training.straight_through import route_history


def attend_with_grad(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerContext, *, scale: float,
    sink_query: torch.Tensor | None, return_lse: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``chunk_attention`` with gradients to ``q``, ``k``, ``v`` (and ``sink_query``); shapes as there."""
    streams, n, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    pool = kv._kv_pool
    assert pool is not None
    record: HistoryRead | None = None
    first_call = False
    if torch.compiler.is_compiling():
        view = _compiled_view(k, v, kv, sink_query is not None)
    else:
        rows = (streams * n, kv_heads, head_dim)
        first_call = not in_recomputation()
        record = read_history(kv, k.detach().reshape(rows), v.detach().reshape(rows))
        view = record.view(kv.layer_index, pool, q.dtype)
    k_live, v_live = _as_stored(k, v, view.scales, pool.dtype)
    if record is not None and record.ledger is not None:
        # keyed across lanes: a lane's layer i is write ``lane_base + i`` of the forward
        view = _straight_through(record, record.lane_base + kv.layer_index, view, k_live, v_live, first_call)
    keys = torch.cat([view.k, k_live], dim=1).transpose(1, 2)  # [S, Hkv, K, D]
    values = torch.cat([view.v, v_live], dim=1).transpose(1, 2)
    queries = q.transpose(1, 2)  # [S, H, n, D]
    if sink_query is not None and view.sink_keys is not None:
        # One softmax, two queries: [q_sink, q] . [k, 0] for sink keys and . [0, k] for the others.
        queries = torch.cat([sink_query.transpose(1, 2), queries], dim=-1)
        keys = torch.cat([keys * view.sink_keys, keys * ~view.sink_keys], dim=-1)
    gqa = needs_gqa(heads, kv_heads)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=view.mask, scale=scale, enable_gqa=gqa)
    if view.empty_rows is not None:
        out = out.masked_fill(view.empty_rows, 0)
    out = out.transpose(1, 2)  # [S, n, H, D]
    if not return_lse:
        return out
    logits = queries.float() @ keys.float().repeat_interleave(heads // kv_heads, dim=1).transpose(-1, -2) * scale
    if view.visible is not None:
        logits = logits.masked_fill(~view.visible, float("-inf"))
    return out, torch.logsumexp(logits, dim=-1).transpose(1, 2)  # [S, n, H]


def _straight_through(
    record: HistoryRead, layer: int, view: HistoryView, k_live: torch.Tensor, v_live: torch.Tensor, first_call: bool
) -> HistoryView:
    """``view`` with its history reads routed to the live writes of the scope's ledger; a first call also records
    this forward's live ``k_live``/``v_live`` ``[S, n, Hkv, D]`` (a recomputation reads the originals' routes)."""
    ledger = record.ledger
    assert ledger is not None
    if first_call and layer not in record.live:
        record.live[layer] = ledger.pieces(record, layer)
    pieces = record.live.get(layer, [])
    routed = view._replace(k=route_history(view.k, pieces, 0), v=route_history(view.v, pieces, 1))
    if first_call:
        ledger.record(record, layer, k_live, v_live)
    return routed


def _as_stored(
    k: torch.Tensor, v: torch.Tensor, scales: torch.Tensor | None, kv_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The live ``k``/``v`` with the values the pool stores (FP8 rounding as a straight-through estimate)."""
    if scales is None or not is_quantized(kv_dtype):
        return k, v
    k_round = dequantize(quantize(k.detach(), scales[0], kv_dtype), scales[0], k.dtype)
    v_round = dequantize(quantize(v.detach(), scales[1], kv_dtype), scales[1], v.dtype)
    return k + (k_round - k.detach()), v + (v_round - v.detach())


# ---------------------------------------------------------------------------------------------------
# Compiled graphs: the record is found (and the pending K/V written) inside one opaque op with static
# output shapes -- the history padded to the spec's bound -- so a rollout compiles to one frame.


def _compiled_view(k: torch.Tensor, v: torch.Tensor, kv: LayerContext, sink_query: bool) -> HistoryView:
    fwd = kv.forward
    if fwd._token_mask is not None:
        raise SpecError("chunk_attention (gradients, compiled): expected no token_mask, got one; run that forward eagerly")
    bound = fwd._max_history_tokens
    if bound <= 0:
        raise SpecError(
            "chunk_attention (gradients, compiled): expected a bounded history (KVCacheSpec.window_chunks), got "
            "global attention; compile the training step over a bounded window or run it eagerly"
        )
    hk, hv, valid, pending, sinks, scales = torch.ops.ardiff_modules.history_kv(
        k.detach(), v.detach(), kv._kv_pool, kv._kv_scales, kv._layer_id, fwd._handle_id, bound
    )
    streams, n = k.shape[0], k.shape[1]
    mask = torch.cat([valid[:, None, :].expand(streams, n, bound), pending[None].expand(streams, n, n)], dim=-1)
    sink_keys = None
    if sink_query:
        sink_keys = torch.cat([sinks, sinks.new_zeros((streams, n))], dim=1)[:, None, :, None]
    quantized = kv._kv_pool is not None and is_quantized(kv._kv_pool.dtype)
    return HistoryView(hk.to(k.dtype), hv.to(k.dtype), mask[:, None], sink_keys, None, mask[:, None], scales if quantized else None)


@torch.library.custom_op("ardiff_modules::history_kv", mutates_args=("kv_pool",))
def history_kv_op(
    k: torch.Tensor, v: torch.Tensor, kv_pool: torch.Tensor, kv_scales: torch.Tensor, layer: torch.Tensor,
    handle_id: torch.Tensor, bound: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Write ``k``/``v`` ``[S, n, Hkv, D]`` into the forward's pending pages (first call only) and return its
    history padded to ``bound`` keys: ``k, v [S, bound, Hkv, D]``, ``valid [S, bound]``, the pending
    visibility ``[n, n]``, ``sinks [S, bound]`` and the layer's scales ``[2, Hkv]`` (fresh tensors)."""
    index = int(layer)
    replay = REPLAY.get()
    if replay is not None:
        record = replay.next(index)
    else:
        holder = HANDLES.holder(int(handle_id))
        if not isinstance(holder, ForwardContext):
            raise TrainingScopeError(f"chunk_attention (gradients): expected a forward context, got {type(holder).__name__}")
        layer_context = holder.layers[index]
        rows = (-1, k.shape[2], k.shape[3])
        record = read_history(layer_context, k.reshape(rows), v.reshape(rows), pad_to=bound)
    if record.gather.shape[1] != bound:  # a forward whose first layers ran eagerly (exact width), then compiled
        raise SpecError(
            f"chunk_attention (gradients, compiled): expected the forward's history padded to {bound} keys, got a "
            f"forward read eagerly ({record.gather.shape[1]} keys): run all of a forward's layers compiled or eager"
        )
    if record.ledger is not None:
        raise TrainingScopeError(
            "chunk_attention (gradients, compiled): expected a TrainingScope with history_grad='detached', got "
            "'straight_through' (its ledger of live writes runs eagerly); run the straight-through rollout eagerly"
        )
    view = record.view(index, kv_pool, k.dtype)
    streams = k.shape[0]
    scales = record.scales.get(index)
    return (
        view.k, view.v, record.valid[:, :, 0, 0].clone(), record.pending.to(k.device, copy=True),
        torch.zeros((streams, bound), dtype=torch.bool, device=k.device) if record.sink_keys is None
        else record.sink_keys[:, 0, :bound, 0].clone(),
        torch.ones((2, k.shape[2]), dtype=torch.float32, device=k.device) if scales is None else scales.clone(),
    )


@history_kv_op.register_fake
def _history_kv_fake(k, v, kv_pool, kv_scales, layer, handle_id, bound):  # noqa: ANN001, ANN202
    streams, n, heads, dim = k.shape
    return (
        k.new_empty((streams, bound, heads, dim)), k.new_empty((streams, bound, heads, dim)),
        k.new_empty((streams, bound), dtype=torch.bool), k.new_empty((n, n), dtype=torch.bool),
        k.new_empty((streams, bound), dtype=torch.bool), k.new_empty((2, heads), dtype=torch.float32),
    )
