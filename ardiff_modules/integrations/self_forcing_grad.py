"""Training through :mod:`ardiff_modules.integrations.self_forcing`: what a swapped model's forwards with gradients
need so that Self-Forcing's ``SelfForcingTrainingPipeline`` runs over it unedited, checkpointing included.

- **A scope of the session's own.** Upstream holds its whole rollout in its buffer, and its exit step's in-place
  write routes later reads' gradients to that step's K/V. The session opens a
  :class:`~ardiff_modules.TrainingScope` (``history_grad`` of :func:`swap_self_attention`, upstream's
  ``"straight_through"`` by default) at its first forward with gradients and adopts each such forward: the pages
  they read stay held for recomputation and their K/V enter the ledger. It ends with the video (the next
  ``current_start=0``, :meth:`reset`, :meth:`close`), after the step's backward. A scope of the cache the user
  entered around the rollout takes precedence (its own ``history_grad``).
- **Recomputation under upstream's own checkpoint call.** ``CausalWanModel`` wraps each block in
  ``torch.utils.checkpoint.checkpoint(block, x, **kwargs, use_reentrant=False)``. In backward the block runs
  again with the same ``kv_cache`` dict and ``current_start``, when the session has moved on (block 0 would open
  a forward, a later block would find none open). Each layer call with gradients is therefore recorded under
  ``(layer, kv_cache dict, current_start)`` with a frozen copy of its layer context, its RoPE and the history it
  read; a recomputation (autograd's engine running, or a replay) finds it there and reads exactly that.

Self-Forcing's exit step is the only forward with gradients of a chunk; two of one layer at one start of one
``kv_cache`` in a video make the key ambiguous, and recomputing such a call raises
:class:`~ardiff_modules.errors.TrainingScopeError`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ardiff_modules.context import ForwardContext, LayerContext
from ardiff_modules.errors import TrainingScopeError
from ardiff_modules.modules import Rope
from ardiff_modules.training import (
    HistoryGrad,
    HistoryRead,
    TrainingScope,
    active_scope,
    capturing,
    frozen_forward,
    replaying,
)

#: The layer's own attention: ``(x, kv, rope) -> out`` (``rope``: the forward's ``UpstreamRotation`` or pair).
Attend = Callable[[torch.Tensor, LayerContext, Rope], torch.Tensor]


@dataclass(frozen=True)
class GradCall:
    """One layer call with gradients, as a recomputation must see it again."""

    kv_cache: Any  # upstream's dict (identity only)
    kv: LayerContext  # a frozen copy: it keeps describing that forward
    rope: Rope
    frames: list[tuple[HistoryRead, int]]
    ambiguous: bool = False


class SessionTraining:
    """The training side of one :class:`~ardiff_modules.integrations.self_forcing.SelfForcingSession`."""

    def __init__(self, cache: Any, history_grad: HistoryGrad) -> None:
        self.cache = cache
        self.history_grad: HistoryGrad = history_grad
        self.scope: TrainingScope | None = None
        self.calls: dict[tuple[int, int, int], GradCall] = {}
        self._adopted: object = None  # the transaction last adopted (one adoption per model forward)

    def adopt(self, forward: ForwardContext) -> None:
        """A layer call with gradients in ``forward``: the forward is held by a user's scope of the cache if one is
        active, else by the session's (opened on first use). Once per model forward."""
        if forward._transaction is self._adopted or active_scope(self.cache) is not None:
            return
        if self.scope is None or self.scope.closed:
            self.scope = TrainingScope(self.cache, history_grad=self.history_grad).start()
        self.scope.adopt(forward)
        self._adopted = forward._transaction

    def run(self, attend: Attend, index: int, x: torch.Tensor, kv: LayerContext, rope: Rope, kv_cache: Any,
            current_start: int) -> torch.Tensor:
        """A first layer call with gradients: ``attend(x, kv, rope)``, recorded for its recomputation."""
        self.adopt(kv.forward)
        frames: list[tuple[HistoryRead, int]] = []
        frozen = frozen_forward(kv.forward).layers[index]
        with capturing(frames):
            out = attend(x, kv, rope)
        if frames:
            key = (index, id(kv_cache), current_start)
            ambiguous = key in self.calls and self.calls[key].kv_cache is kv_cache
            self.calls[key] = GradCall(kv_cache, frozen, rope, frames, ambiguous)
        return out

    def recompute(self, attend: Attend, index: int, x: torch.Tensor, kv_cache: Any, current_start: int) -> torch.Tensor:
        """A recomputation of the call recorded under ``(index, kv_cache, current_start)``: its context, RoPE and
        history. :class:`TrainingScopeError` when none (or more than one) was recorded."""
        call = self.calls.get((index, id(kv_cache), current_start))
        if call is None or call.kv_cache is not kv_cache:
            raise TrainingScopeError(
                f"SelfForcingSelfAttention (layer {index}): expected a recomputation of a call with gradients of this "
                f"video (current_start={current_start}, this block's kv_cache), got none recorded (the video was "
                "reset or the session closed before backward?)"
            )
        if call.ambiguous:
            raise TrainingScopeError(
                f"SelfForcingSelfAttention (layer {index}): expected one call with gradients per layer at "
                f"current_start={current_start} of this kv_cache to recompute, got several in this video"
            )
        with replaying(call.frames):
            return attend(x, call.kv, call.rope)

    def end(self) -> None:
        """The video ended (reset, a new video, close): release the scope and forget the calls."""
        if self.scope is not None:
            self.scope.close()
            self.scope = None
        self.calls.clear()
        self._adopted = None
