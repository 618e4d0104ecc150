"""What the manager builds from a forward's request (:class:`Build`: validated, nothing changed yet).

A forward and a re-cache differ only in their validated request -- which pages each stream
reserves, how its layout reads the history, whether the commit swaps chunks in -- so both run
through one build path (:meth:`ForwardManager.build`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from ardiff_modules.core.branch import BranchPages
from ardiff_modules.core.recache import RecachePlan
from ardiff_modules.layout import StreamLayout
from ardiff_modules.session import KVState
from ardiff_modules.spec import PendingAttention


@dataclass(frozen=True)
class Build:
    """A validated request, ready to reserve, lay out, plan and begin (nothing changed yet)."""

    #: ``(session, branch)`` per stream, in batch order, and their pages.
    members: tuple[tuple[KVState, str], ...]
    branches: tuple[BranchPages, ...]
    #: Pages of each pending chunk every stream reserves.
    chunk_pages: tuple[int, ...]
    commit_current: bool
    pending_attention: PendingAttention
    #: Pages of a new contiguous extent (``0``: none is reserved -- plain paging, or a re-cache).
    extent_pages: int = 0
    token_mask: torch.Tensor | None = None
    static: bool = False
    #: Per member: clean latents of each pending chunk to keep on commit, or ``()``.
    latents: tuple[tuple[object, ...], ...] = ()
    #: A prompt-switch re-cache (its commit swaps the rebuilt chunks in); ``recache_plans``: per member, which
    #: chunks it rebuilds and what each replaces (``RecacheRule.plan``).
    recache: bool = False
    recache_plans: tuple[RecachePlan, ...] = ()
    #: "prepare_forward" / "prepare_recache": names the call in errors and logs.
    what: str = "prepare_forward"
    #: Per lane of the cache (retention groups; one when uniform), each member's pages there, and the pages of a
    #: new extent there (``0``: none).
    lane_branches: tuple[tuple[BranchPages, ...], ...] = ()
    lane_extent_pages: tuple[int, ...] = ()
    #: A re-cache: per lane each member's plan (with retention groups over the union of the lanes' rebuilt chunks),
    #: and per member the union chunks' absolute starts (``forwards/lane_recache.py``; ``()``: from the branch).
    lane_recache_plans: tuple[tuple[RecachePlan, ...], ...] = ()
    recache_starts: tuple[tuple[int, ...], ...] = ()
    #: Per lane, the ``token_mask`` it plans with, in its own key order (with retention groups the caller's mask
    #: is over the union key order: ``forwards/lane_masks.py``); ``None`` entries: no mask.
    lane_token_masks: tuple[torch.Tensor | None, ...] = ()

    @property
    def key(self) -> tuple[tuple[tuple[str, str], ...], int | None]:
        """The context registry's key: the streams, and the sequence length of a static (CUDA-graph) forward."""
        streams = tuple((state.session_id, branch) for state, branch in self.members)
        return streams, (self.seq_len if self.static else None)

    @property
    def seq_len(self) -> int:
        return sum(self.chunk_pages) * (self.branches[0].page_size if self.branches else 0)

    def stream_layouts(
        self, relative_sinks: bool, lane_branches: tuple[BranchPages, ...] | None = None, lane: int = 0
    ) -> tuple[StreamLayout, ...]:
        """Each stream's layout once its pending chunks are reserved (in lane ``lane``, whose branch pages are
        ``lane_branches``, each member's pages there; default the first lane's).

        A forward reads the whole history; a re-cache reads only the kept sinks, and each rebuilt
        chunk keeps the absolute start it was generated at (so RoPE positions are the original ones).
        """
        branches = self.branches if lane_branches is None else lane_branches
        if not self.recache:
            num_chunks = len(self.chunk_pages)
            return tuple(
                StreamLayout(
                    tuple(b.history_pages()), b.pending[:num_chunks], b.token_offset, tuple(b.history_spans()),
                    sink_pages=b.sink_pages() if relative_sinks else 0,
                    exact_spans=None if b.selection is None else partial(b.history_spans, True),
                )
                for b in branches
            )
        layouts = []
        for s, (b, plan) in enumerate(zip(branches, self.lane_recache_plans[lane])):
            known = self.recache_starts[s] if self.recache_starts else None
            history_pages, spans, starts = b.recache_layout_parts(plan, known)
            sink_pages = b.sink_pages(plan.kept) if relative_sinks else 0  # the kept sinks (their sink frames)
            layouts.append(StreamLayout(history_pages, b.pending, starts[0], spans, starts, sink_pages))
        return tuple(layouts)
