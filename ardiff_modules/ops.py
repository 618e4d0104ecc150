"""``torch.library`` custom ops: the only place a layer's forward touches the KV cache.

FlashInfer's ``wrapper.run()`` cannot be traced by dynamo, so the write-and-
attend step is one opaque custom op with a fake (meta) implementation and
explicit ``mutates_args``. Custom ops cannot take Python objects, so the plan
is found through a *handle*: a CPU int64 scalar tensor (data, not a Python int,
so a new forward, session or layer never specialises the compiled graph)
resolved in the single :data:`PLANS` registry.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Protocol, cast

import torch

from ardiff_modules.backends.base import AttentionPlan
from ardiff_modules.errors import PlanNotFoundError


class PlanHolder(Protocol):
    """Anything registered in :data:`PLANS`: it exposes the current plan of its forward."""

    plan: AttentionPlan | None

    def check_usable(self, what: str = ...) -> None:
        """Raise unless the forward is open (a finished forward must not touch the pool)."""


class PlanRegistry:
    """Maps plan handles to their holders (weakly: a dropped forward frees its entry)."""

    def __init__(self) -> None:
        self._holders: weakref.WeakValueDictionary[int, PlanHolder] = weakref.WeakValueDictionary()
        self._ids = itertools.count(1)
        # Caches in several threads register and drop contexts concurrently.
        self._lock = threading.Lock()

    def register(self, holder: PlanHolder) -> int:
        with self._lock:
            handle = next(self._ids)
            self._holders[handle] = holder
        return handle

    def unregister(self, handle: int) -> None:
        with self._lock:
            self._holders.pop(handle, None)

    def get(self, handle: int) -> AttentionPlan:
        """The plan of an open forward; raises if the handle is unknown or its forward finished."""
        with self._lock:
            holder = self._holders.get(handle)
        if holder is None:
            raise PlanNotFoundError(
                f"No attention plan is registered under handle {handle}: the forward context was "
                "released (session closed or context dropped); call get_kv_caches()/prepare_forward() again"
            )
        holder.check_usable("chunk_attention")
        if holder.plan is None:
            raise PlanNotFoundError(f"Plan handle {handle} is registered but has no plan yet")
        return holder.plan

    def __len__(self) -> int:
        return len(self._holders)


#: The one registry of plans (explicit, documented; entries die with their forward contexts).
PLANS = PlanRegistry()


@torch.library.custom_op("ardiff_modules::chunk_attention", mutates_args=("kv_pool",))
def chunk_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: torch.Tensor,
    plan_id: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Write ``k``/``v`` into the pending pages of layer ``layer`` of ``kv_pool`` and attend.

    ``q`` is ``[tokens, heads, head_dim]`` (streams flattened, stream-major), ``k``/``v``
    ``[tokens, kv_heads, head_dim]``, ``kv_pool`` the whole pool ``[layers, 2, pages, page_size,
    kv_heads, head_dim]``; ``layer`` and ``plan_id`` are CPU int64 scalars. Returns
    ``[tokens, heads, head_dim_v]``.

    NOTE: the op mutates the one pool tensor, never per-layer views of it: several aliased
    mutated inputs send torch.compile down its "synthetic base" path, which was measured to
    corrupt the cache on CUDA. The layer index is data (a CPU tensor), so one graph serves
    every layer and reading it is not a device sync.
    """
    plan, index, k_cache, v_cache = _resolve(kv_pool, layer, plan_id)
    return cast(torch.Tensor, plan.run(q, k, v, k_cache, v_cache, scale, layer=index))


def _resolve(
    kv_pool: torch.Tensor, layer: torch.Tensor, plan_id: torch.Tensor
) -> tuple[AttentionPlan, int, torch.Tensor, torch.Tensor]:
    """The open forward's plan (raises if it finished), the layer index and this layer's K and V pages."""
    plan = PLANS.get(int(plan_id))
    index = int(layer)
    return plan, index, kv_pool[index, 0], kv_pool[index, 1]


@chunk_attention_op.register_fake
def _chunk_attention_fake(q, k, v, kv_pool, layer, plan_id, scale):  # noqa: ANN001, ANN202
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]))


@torch.library.custom_op("ardiff_modules::chunk_attention_lse", mutates_args=("kv_pool",))
def chunk_attention_lse_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: torch.Tensor,
    plan_id: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunk_attention_op` that also returns the float32 ``[tokens, heads]`` natural-log LSE.

    A separate op (not a flag) so the common path's schema and output stay one tensor.
    """
    plan, index, k_cache, v_cache = _resolve(kv_pool, layer, plan_id)
    return cast(
        "tuple[torch.Tensor, torch.Tensor]", plan.run(q, k, v, k_cache, v_cache, scale, return_lse=True, layer=index)
    )


@chunk_attention_lse_op.register_fake
def _chunk_attention_lse_fake(q, k, v, kv_pool, layer, plan_id, scale):  # noqa: ANN001, ANN202
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2])), q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)
