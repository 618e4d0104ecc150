"""Per-forward and per-layer contexts handed to the attention modules.

A :class:`ForwardContext` is built by the cache once per forward (host work:
allocation, plan) and holds what every layer shares: the plan handle, the
absolute positions of the current tokens and the stacked cross-attention
caches. Its :class:`LayerContext` list gives each layer its own K/V page
arrays. Both objects are reused across forwards of the same streams, so a
compiled model sees the same Python objects and tensors of the same shapes
every chunk (no recompiles).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, NoReturn

import torch

from ardiff_modules.backends.base import AttentionPlan
from ardiff_modules.errors import CrossAttentionNotPopulatedError, UnknownCacheError
from ardiff_modules.plan import ForwardLayout

if TYPE_CHECKING:
    from ardiff_modules.state import KVState


@dataclass(eq=False)
class LayerContext:
    """What one attention layer needs for one forward.

    Attributes
    ----------
    layer_index:
        Index of the layer in the pool (informational; kernels get the tensors below).
    k_cache, v_cache:
        This layer's pages, ``[num_pages, page_size, num_kv_heads, head_dim]``.
    forward:
        The shared :class:`ForwardContext`.
    cross:
        Cache name -> this layer's ``(k, v)``, each ``[num_streams, tokens, heads, dim]`` (views of
        the forward's stacked caches, so no layer index is needed at run time).
    """

    layer_index: int
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    forward: ForwardContext
    cross: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    #: The whole pool ``[layers, 2, pages, page_size, heads, dim]`` the custom op mutates.
    kv_pool: torch.Tensor | None = None
    #: ``layer_index`` as a CPU int64 scalar: data for the op, so one graph serves all layers.
    layer_id: torch.Tensor | None = None

    @property
    def plan_id(self) -> torch.Tensor:
        """CPU int64 scalar naming this forward's plan in :data:`ardiff_modules.ops.PLANS`."""
        return self.forward.plan_id

    @property
    def positions(self) -> torch.Tensor:
        """Absolute positions of the current tokens, int64 ``[num_streams, seq_len]``."""
        return self.forward.positions

    @property
    def num_streams(self) -> int:
        return self.forward.num_streams

    @property
    def seq_len(self) -> int:
        return self.forward.seq_len

    def cross_kv(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's cross-attention K and V for cache ``name``, each ``[num_streams, tokens, heads, dim]``."""
        pair = self.cross.get(name)
        if pair is None:
            self.forward.raise_missing_cross(name)
        return pair


@dataclass(eq=False)
class ForwardContext:
    """One forward over ``num_streams`` streams (branches of sessions) of ``seq_len`` tokens each.

    Use as a context manager to commit on success and abort on an exception::

        with state.prepare_forward(("cond", "uncond"), seq_len, commit_current=True) as fwd:
            out = model(x, fwd.layers)
        # committed here; on an exception the pending chunks were dropped instead

    NOTE: the context of a set of streams is one object reused by every forward of those
    streams (so compiled models see stable inputs): after the next ``prepare_forward`` of the
    same streams, this object -- its layers, positions, ``commit()`` / ``abort()`` -- describes
    that newer forward.

    Attributes
    ----------
    streams:
        ``(session_id, branch)`` of each stream, in the order of the batch dimension.
    positions:
        int64 ``[num_streams, seq_len]`` absolute token positions (for RoPE), on the pool's device.
    layers:
        One :class:`LayerContext` per layer.
    """

    streams: tuple[tuple[str, str], ...]
    handle: int
    plan_id: torch.Tensor
    chunk_size: int
    plan: AttentionPlan | None = None
    layout: ForwardLayout | None = None
    positions: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    commit_current: bool = False
    layers: list[LayerContext] = field(default_factory=list)
    #: name -> (K, V), each ``[num_layers, num_streams, tokens, heads, dim]``; only fully populated caches.
    cross: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    #: name -> reason a cache is unavailable to this forward.
    cross_missing: dict[str, str] = field(default_factory=dict)
    #: Whether device inputs live in fixed buffers (CUDA-graph replay).
    static: bool = False
    _stack_keys: dict[str, tuple[int, ...]] = field(default_factory=dict)
    _cross_buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _members: tuple[tuple[KVState, str], ...] = ()
    _finish: Callable[[ForwardContext, bool], None] | None = None

    @property
    def num_streams(self) -> int:
        return len(self.streams)

    @property
    def seq_len(self) -> int:
        return self.layout.seq_len if self.layout is not None else 0

    @property
    def num_chunks(self) -> int:
        return self.layout.num_chunks if self.layout is not None else 0

    @property
    def token_offsets(self) -> tuple[int, ...]:
        """Absolute position of each stream's first current token."""
        return tuple(s.token_offset for s in self.layout.streams) if self.layout is not None else ()

    def raise_missing_cross(self, name: str) -> NoReturn:
        if name in self.cross_missing:
            raise CrossAttentionNotPopulatedError(self.cross_missing[name])
        known = tuple(self.cross) + tuple(self.cross_missing)
        raise UnknownCacheError(f"Unknown cross-attention cache {name!r}; expected one of {known}")

    def set_cross(self, cross: dict[str, tuple[torch.Tensor, torch.Tensor]], missing: dict[str, str]) -> None:
        """Publish stacked cross caches; per-layer views are rebuilt only for caches that changed."""
        changed = [name for name in cross if self.cross.get(name) is not cross[name]]
        for layer in self.layers:
            for name in list(layer.cross):
                if name not in cross:
                    del layer.cross[name]
            for name in changed:
                layer.cross[name] = (cross[name][0][layer.layer_index], cross[name][1][layer.layer_index])
        self.cross, self.cross_missing = cross, missing

    def to_dense(self) -> torch.Tensor:
        """The visibility mask of this forward, bool ``[num_streams, seq_len, max_keys]`` (see ``ForwardLayout``)."""
        assert self.layout is not None
        return self.layout.to_dense()

    # ------------------------------------------------------------------ commit / abort
    def commit(self) -> None:
        """Commit every stream (``commit_paged_context`` for each)."""
        assert self._finish is not None
        self._finish(self, True)

    def abort(self) -> None:
        """Drop every stream's pending work; history stays exactly as before."""
        assert self._finish is not None
        self._finish(self, False)

    def __enter__(self) -> ForwardContext:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()
