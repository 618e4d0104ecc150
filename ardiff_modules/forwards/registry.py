"""The cache's forward contexts, kept for reuse in least-recently-used order (bounded).

One :class:`~ardiff_modules.context.ForwardContext` per distinct batch of streams (and per
sequence length for static, CUDA-graph contexts) is reused forward after forward, so compiled
models see the same objects. Beyond ``limit`` the least recently used *idle* context is released
(its plan registry entry and plan buffers dropped); a context whose forward is open never is.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from ardiff_modules.context import ForwardContext
from ardiff_modules.ops import HANDLES

#: ``((session id, branch), ...), static sequence length or None``.
ContextKey = tuple[tuple[tuple[str, str], ...], int | None]


class ContextRegistry:
    """Forward contexts by key; order = recency (the front is the least recently used)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._contexts: OrderedDict[ContextKey, ForwardContext] = OrderedDict()

    def __len__(self) -> int:
        return len(self._contexts)

    def __iter__(self) -> Iterator[ForwardContext]:
        return iter(self._contexts.values())

    def get(self, key: ContextKey) -> ForwardContext | None:
        """The context of ``key`` without touching its recency (a failed prepare must not reorder)."""
        return self._contexts.get(key)

    def publish(self, key: ContextKey, ctx: ForwardContext) -> None:
        """A forward of ``ctx`` was published: register it if new, mark it most recently used, evict idle ones."""
        if key in self._contexts:
            self._contexts.move_to_end(key)
            return
        for holder in (ctx, *ctx._lanes):  # a grouped forward's lane contexts hold the plans its layers run
            holder._assign_handle(HANDLES.register(holder))
        self._contexts[key] = ctx
        for old in list(self._contexts):
            if len(self._contexts) <= self.limit:
                break
            candidate = self._contexts[old]
            if candidate is not ctx and not candidate.is_active:
                self.release(old)

    def release(self, key: ContextKey) -> None:
        ctx = self._contexts.pop(key)
        for holder in (ctx, *ctx._lanes):
            HANDLES.unregister(holder._handle)
        ctx._release()

    def release_where(self, predicate: Callable[[ContextKey], bool]) -> None:
        for key in [k for k in self._contexts if predicate(k)]:
            self.release(key)
