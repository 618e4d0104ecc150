"""One forward of a head-grouped cache: a forward per part, and per layer the heads each part holds.

A :class:`~ardiff_modules.head_cache.HeadGroupedKVCache` keeps one paged cache per *part* (the heads of
one retention group that some layers hold: :mod:`ardiff_modules.core.head_retention`). A forward over
it is one :class:`~ardiff_modules.context.ForwardContext` per part, prepared together, committed all
together or aborted all together (:class:`HeadGroupedForward`); each model layer gets a
:class:`HeadGroupedLayer` naming, for each part that holds some of its heads, which query and K/V
heads those are and that part's :class:`~ardiff_modules.context.LayerContext`.
:func:`~ardiff_modules.chunk_attention` splits q/k/v along the heads, runs each part's kernels (one
plan per part: heads of a part share their key ranges, so no mask), and puts the outputs back in
head order::

    q [streams, n, 12 heads, d] --split--> part "local/8h": heads 1 2 4 5 7 8 10 11 -> ragged FA3, 2 chunks
                                           part "global/4h": heads 0 3 6 9          -> ragged FA3, 8 chunks
                                --merge--> out [streams, n, 12, d]

Cross-attention caches hold every head of every layer and live on the grouped session; the forward
stacks them as a plain forward does (:class:`~ardiff_modules.cross.CrossStack`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch

from ardiff_modules.context import CrossPublisher, CrossReads, ForwardContext, LayerContext, LayerViews
from ardiff_modules.cross import CrossStack
from ardiff_modules.errors import ForwardFinishedError


@dataclass(frozen=True, eq=False)
class LayerShare:
    """The heads one part holds in one layer and that part's layer context.

    ``q_heads`` / ``kv_heads``: a ``slice`` when the heads are one contiguous run (a view, no copy),
    else an int64 index tensor on the pool's device.
    """

    part: int  #: index of the part in the cache (``HeadGroupedForward.parts``)
    q_heads: slice | torch.Tensor
    kv_heads: slice | torch.Tensor
    context: LayerContext


def take_heads(t: torch.Tensor, heads: slice | torch.Tensor) -> torch.Tensor:
    """``t [streams, n, heads, d]`` restricted to ``heads`` (dim 2)."""
    if isinstance(heads, slice):
        return t[:, :, heads]
    return t.index_select(2, heads)


def head_selector(heads: Sequence[int], device: torch.device) -> slice | torch.Tensor:
    """A ``slice`` for a contiguous ascending run of head indices, else an index tensor."""
    if list(heads) == list(range(heads[0], heads[0] + len(heads))):
        return slice(heads[0], heads[0] + len(heads))
    return torch.tensor(list(heads), dtype=torch.int64, device=device)


@dataclass(eq=False, repr=False)
class HeadGroupedLayer(LayerViews):
    """What one attention layer of a head-grouped cache needs for one forward (the ``LayerContext`` surface).

    Attributes
    ----------
    layer_index:
        The model layer.
    forward:
        The shared :class:`HeadGroupedForward`.
    shares:
        One :class:`LayerShare` per part holding heads of this layer, in part order.
    merge_order:
        ``None`` when concatenating the shares' outputs along the heads gives head order; else the int64
        permutation that restores it (``index_select(2, merge_order)``).
    cross:
        Cache name -> this layer's ``(k, v)``, each ``[num_streams, tokens, heads, dim]``.
    """

    layer_index: int
    forward: HeadGroupedForward
    shares: tuple[LayerShare, ...]
    merge_order: torch.Tensor | None
    #: Query and K/V heads of the whole layer (what q / k / v must carry).
    num_heads: int = 0
    num_kv_heads: int = 0
    cross: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def merge(self, outputs: Sequence[torch.Tensor], dim: int = 2) -> torch.Tensor:
        """The shares' outputs (``[streams, n, share heads, ...]``) as one tensor in head order."""
        out = outputs[0] if len(outputs) == 1 else torch.cat(list(outputs), dim=dim)
        return out if self.merge_order is None else out.index_select(dim, self.merge_order)

    def __repr__(self) -> str:
        parts = ", ".join(self.forward.part_names[s.part] for s in self.shares)
        return f"HeadGroupedLayer(layer={self.layer_index}, parts=[{parts}], status={self.forward.status!r})"


@dataclass(eq=False, repr=False)
class HeadGroupedForward(CrossPublisher):
    """One forward over ``streams`` of a head-grouped cache: one :class:`ForwardContext` per part.

    Use as a context manager (commit on success, abort on an exception), like a ``ForwardContext``.
    Reused by every forward of the same streams (compiled models see the same objects).
    """

    streams: tuple[tuple[str, str], ...]
    parts: tuple[ForwardContext, ...]
    part_names: tuple[str, ...]
    #: ``(transactions or this forward, success) -> None``: the cache's all-or-nothing finish (given the forward, it
    #: reads the parts' current transactions under its lock: never half of a prepare running in another thread)
    finish_parts: Any
    layers: list[HeadGroupedLayer] = field(default_factory=list)
    _cross: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _cross_missing: dict[str, str] = field(default_factory=dict)
    _cross_stack: CrossStack = field(default_factory=CrossStack)
    _cross_reads: CrossReads = field(default_factory=lambda: CrossReads())
    _static: bool = False
    _entered: list[tuple[Any, ...]] = field(default_factory=list)

    @classmethod
    def create(
        cls,
        contexts: tuple[ForwardContext, ...],
        part_names: tuple[str, ...],
        finish_parts: Any,
        layer_shares: Sequence[Sequence[tuple[int, int, Any, Any]]],
        merge_orders: Sequence[torch.Tensor | None],
        query_heads: int,
        kv_heads: int,
        *,
        static: bool,
    ) -> HeadGroupedForward:
        """A forward over the part ``contexts``; ``layer_shares[layer]`` lists ``(part, layer in the part, q heads,
        kv heads)`` for each part holding heads of that model layer, ``merge_orders[layer]`` its
        :attr:`HeadGroupedLayer.merge_order`."""
        forward = cls(contexts[0].streams, contexts, part_names, finish_parts, _static=static)
        forward.layers = [
            HeadGroupedLayer(
                layer, forward,
                tuple(LayerShare(p, q, kv, contexts[p].layers[inner]) for p, inner, q, kv in shares),
                order, query_heads, kv_heads,
            )
            for layer, (shares, order) in enumerate(zip(layer_shares, merge_orders))
        ]
        return forward

    # ------------------------------------------------------------------ what layers read
    @property
    def positions(self) -> torch.Tensor:
        """int64 ``[num_streams, seq_len]`` absolute token positions (every part's are equal)."""
        return self.parts[0].positions

    @property
    def sink_positions(self) -> None:
        return None  # relative sinks are refused for head-grouped caches

    @property
    def relative_sinks(self) -> bool:
        return False

    @property
    def chunk_size(self) -> int:
        return self.parts[0].chunk_size

    @property
    def num_streams(self) -> int:
        return len(self.streams)

    @property
    def seq_len(self) -> int:
        return self.parts[0].seq_len

    @property
    def num_chunks(self) -> int:
        return self.parts[0].num_chunks

    @property
    def commit_current(self) -> bool:
        return self.parts[0].commit_current

    @property
    def token_offsets(self) -> tuple[int, ...]:
        return self.parts[0].token_offsets

    @property
    def transactions(self) -> tuple[Any, ...]:
        """The parts' current transactions (what a commit finishes)."""
        return tuple(p._transaction for p in self.parts)

    @property
    def is_active(self) -> bool:
        return all(p.is_active for p in self.parts)

    @property
    def _released(self) -> bool:
        """Whether a part's context was released by its cache (this forward never runs again)."""
        return any(p._released for p in self.parts)

    @property
    def status(self) -> str:
        """``"open"`` or how the forward finished (every part finishes the same way)."""
        states = {p.status for p in self.parts}
        return states.pop() if len(states) == 1 else "mixed:" + ",".join(sorted(states))

    def _check_usable(self, what: str = "chunk_attention") -> None:
        for part in self.parts:
            part._check_usable(what)

    def to_dense(self, part: int) -> torch.Tensor:
        """Part ``part``'s visibility mask, bool ``[num_streams, seq_len, max_keys]`` (``ForwardContext.to_dense``)."""
        return self.parts[part].to_dense()

    # ------------------------------------------------------------------ commit / abort
    def commit(self) -> None:
        """Commit every part of this forward, all together (a denoising forward just closes). Idempotent."""
        self.finish_parts(self, True)

    def abort(self) -> None:
        """Drop every part's pending work; history stays exactly as before. Idempotent."""
        self.finish_parts(self, False)

    def __enter__(self) -> HeadGroupedForward:
        self._check_usable("HeadGroupedForward.__enter__")
        self._entered.append(self.transactions)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        transactions = self._entered.pop() if self._entered else ()
        if transactions:
            self.finish_parts(transactions, exc_type is None)

    def __repr__(self) -> str:
        return (
            f"HeadGroupedForward(streams={self.num_streams}, seq_len={self.seq_len}, commit={self.commit_current}, "
            f"parts={list(self.part_names)}, status={self.status!r}, layers={len(self.layers)})"
        )


def check_open_forward(forward: HeadGroupedForward, what: str) -> None:
    """:class:`ForwardFinishedError` unless every part of ``forward`` is open."""
    if not forward.is_active:
        raise ForwardFinishedError(f"{what}: expected an open forward, got status {forward.status!r}")


def merge_order(order: Sequence[int], device: torch.device) -> torch.Tensor | None:
    """The permutation restoring head order after concatenating the shares' outputs, whose query heads are
    ``order`` (host ints, in concatenation order); ``None`` when that is already head order."""
    if list(order) == list(range(len(order))):
        return None
    inverse = [0] * len(order)
    for position, head in enumerate(order):
        inverse[head] = position
    return torch.tensor(inverse, dtype=torch.int64, device=device)
