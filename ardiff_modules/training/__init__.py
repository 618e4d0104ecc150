"""Gradients through the cache: forwards with autograd, activation checkpointing, the training scope.

A forward with gradients (grad mode on and q, k or v requiring grad) attends the visible history as a
constant -- it was written under ``no_grad``, as in every peer -- and its own pending tokens' K/V as the
live tensors: ``softmax(q [K_history ; k]^T * scale) [V_history ; v]``, computed by torch's SDPA over the
gathered history so autograd and SDPA's own backward kernels give q, k and v their gradients. The pool
copy of the pending K/V is written detached, exactly as a forward without gradients writes it (an FP8
pool's rounding reaches the live K/V as a straight-through estimate, so values match the pool's).

Recomputation (``torch.utils.checkpoint``) runs a block's forward again during backward, when the rollout
has moved on: the forward may have committed and its history pages may have been evicted and reused. A
:class:`TrainingScope` holds one reference on the history pages of every forward with gradients inside it
(no copies), and :meth:`TrainingScope.checkpoint` hands each recomputed layer the :class:`HistoryRead` of
its original call, so recomputation reads exactly the K/V the forward saw; leaving the scope drops the
holds. A recomputation without it, or after the scope ended, raises :class:`TrainingScopeError`.

How the history a forward with gradients reads enters the gradient is the scope's ``history_grad``: a constant
(``"detached"``, the default, as above) or ``"straight_through"`` -- the clean values, with the gradient of each
committed chunk's read routed to the live K/V the last forward with gradients wrote for it (Self-Forcing's rolling
buffer does this through autograd's ``CopySlices``; see :mod:`ardiff_modules.training.straight_through`).

Forwards without gradients never come here: their speed and kernels are unchanged.

Modules: ``records`` (what a forward read, capture / replay for recomputation), ``scope`` (:class:`TrainingScope`),
``attend`` (the attention with gradients), ``straight_through`` (the ledger of live writes).
"""

from __future__ import annotations

from ardiff_modules.training.attend import attend_with_grad, history_kv_op
from ardiff_modules.training.records import FROZEN as _FROZEN
from ardiff_modules.training.records import RECORDS as _RECORDS
from ardiff_modules.training.records import (
    HistoryRead,
    HistoryView,
    active_scope,
    capturing,
    in_recomputation,
    read_history,
    replaying,
)
from ardiff_modules.training.scope import TrainingScope, frozen_forward
from ardiff_modules.training.straight_through import HISTORY_GRADS, HistoryGrad, LiveWrites

__all__ = [
    "HISTORY_GRADS", "HistoryGrad", "HistoryRead", "HistoryView", "LiveWrites", "TrainingScope", "_FROZEN", "_RECORDS",
    "active_scope", "attend_with_grad", "capturing", "frozen_forward", "history_kv_op", "in_recomputation",
    "read_history", "replaying",
]
