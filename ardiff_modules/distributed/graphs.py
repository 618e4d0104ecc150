"""``DistributedCUDAGraphStep``: capture a whole parallelized model step as one CUDA graph on every rank.

A thin wrapper of :class:`~ardiff_modules.graphs.CUDAGraphStep`: it takes
a :class:`~ardiff_modules.distributed.DistributedForward` and makes every rank capture at the same
call. Why that matters, and why the rest already works::

    every rank, every forward          host (outside the graph)            device (the graph)
    ──────────────────────────          ────────────────────────            ──────────────────
    cache.prepare_forward(static=True)  allocate, plan into fixed buffers,
                                        vote (gloo)
    step(fwd, x)                        capture vote (gloo) ──> capture ─┬─ warm-up (eager): NCCL
                                                                         │  communicators initialised
                                                                         └─ capture: projections, the
                                                                            all-to-alls (NCCL kernels),
                                                                            K/V writes, attention
                                        or replay ──────────────────────── replay
    with-block exit                     vote (gloo), commit / abort

* Capture runs the step eagerly ``warmup_iters`` times first, and those warm-up runs execute real
  collectives: the peers must be warming up too, or they wait in a collective that never matches.
  So every call starts with one all-reduce over the mesh's host (gloo) group (``verify=True``): each
  rank says whether it would capture, replay, or cannot replay (inputs not as captured, a prompt
  cache the graph reads cleared -- :meth:`CUDAGraphStep.check_replay`). If any rank cannot, all
  raise before any collective; if any rank would capture (its plan object was rebuilt, which can
  depend on its own page ids), every rank captures again -- a replay on some ranks only would leave
  their NCCL kernels waiting on the GPU for peers that never launch theirs, a hang no timeout sees.
* A capture is all or nothing across ranks. Two more host votes, once per capture: after the warm-up
  (every rank done warming up, none failed before capturing) and after the capture (every rank holds
  its graph). A rank whose capture failed raises its own error, the others raise
  :class:`~ardiff_modules.distributed.DistributedForwardError`, and no rank keeps a graph for that
  context (for the reason above: PyTorch does not watch replayed collectives). The forward's ``with``
  block then aborts it on every rank.
* The capture uses ``capture_error_mode="thread_local"``: in ``"global"`` mode an unsafe CUDA call
  from any other thread of the process (a garbage-collected graph or event, a profiler) invalidates
  the capture -- on one rank only, at a time no peer can predict.
* Nothing inside the step synchronises with the host: the all-to-alls are functional collectives
  waited on the device stream, positions are views of the static forward's fixed buffer,
  ``ParallelMesh.local_streams`` / ``gather`` use cached device index tensors, and the votes happen in
  ``prepare_forward``, around a capture and at the end of the ``with`` block, outside the graph.
* A replay launches the captured NCCL kernels: every rank of a group must replay the same graphs in
  the same order (it does when every rank makes the same calls, which the votes already require).
* Teardown: :meth:`DistributedCUDAGraphStep.clear` (or the end of a ``with step:`` block) frees the
  graphs at once; do it before ``dist.destroy_process_group()``, which hangs in ``ncclCommDestroy``
  while a graph holding NCCL kernels is alive (pytorch/pytorch#115388; on 2x H200 every capture and
  replay passed and only the destroy hung).

Limitation: a rank that fails between the capture vote and the end of its capture (e.g. out of memory
in warm-up) leaves its peers waiting in a warm-up collective, like any failure inside the model (see
:mod:`~ardiff_modules.distributed.cache`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ardiff_modules.checks import require_bool, require_int
from ardiff_modules.context import ForwardContext
from ardiff_modules.distributed.cache import DistributedForward
from ardiff_modules.distributed.errors import DistributedForwardError
from ardiff_modules.distributed.mesh import ParallelMesh
from ardiff_modules.errors import SpecError
from ardiff_modules.graphs import CUDAGraphStep


class DistributedCUDAGraphStep:
    """Replays ``fn(*inputs, layers)`` of a parallelized model from a CUDA graph captured on first use,
    in step on every rank of ``mesh``.

    Example (every rank)::

        step = DistributedCUDAGraphStep(model, mesh)     # model: parallelize(model, mesh) done
        with cache.prepare_forward(state, seq_len, commit_current=c, static=True) as fwd:
            out = step(fwd, mesh.scatter(x))             # capture on the first call, replay afterwards
        ...
        step.clear()                                     # before dist.destroy_process_group()

    ``fn`` may also include the output all-gather (``lambda x, layers: mesh.gather(model(x, layers))``).

    Parameters
    ----------
    fn:
        ``fn(*inputs, layers)`` -> a tensor (this rank's part of the step's output).
    mesh:
        The :class:`~ardiff_modules.distributed.ParallelMesh` of the cache.
    clone_outputs:
        As in :class:`~ardiff_modules.graphs.CUDAGraphStep`.
    warmup_iters:
        Eager runs before a capture (at least 1: they initialise the NCCL communicators and NCCL's
        connections for these collectives, which a capture cannot do).
    verify:
        One host all-reduce per call so that every rank captures, or replays, or raises together (see
        the module docstring). ``False`` saves it when the caller guarantees that; a rank that then
        replays alone hangs its peers.
    """

    def __init__(
        self,
        fn: Callable[..., torch.Tensor],
        mesh: ParallelMesh,
        *,
        clone_outputs: bool = True,
        warmup_iters: int = 2,
        verify: bool = True,
    ) -> None:
        if not isinstance(mesh, ParallelMesh):
            raise SpecError(f"DistributedCUDAGraphStep.mesh: expected a ParallelMesh, got {type(mesh).__name__}")
        self.mesh = mesh
        self.verify = require_bool("DistributedCUDAGraphStep.verify", verify)
        self.warmup_iters = require_int("DistributedCUDAGraphStep.warmup_iters", warmup_iters, minimum=1)
        # NOTE: the warm-up is ours (see _warm_up), so the wrapped step captures right away.
        self.step = CUDAGraphStep(
            fn, clone_outputs=clone_outputs, warmup_iters=0, capture_error_mode="thread_local"
        )

    @property
    def num_graphs(self) -> int:
        """Graphs held (one per static forward context)."""
        return self.step.num_graphs

    def clear(self) -> None:
        """Drop every captured graph now; the next call on each context captures again (collective: call it
        on every rank). Call it (or leave a ``with step:`` block) before ``dist.destroy_process_group()``: a
        live graph holding NCCL kernels makes the destroy hang (pytorch/pytorch#115388; seen on 2x H200)."""
        self.step.clear()

    def __enter__(self) -> DistributedCUDAGraphStep:
        return self

    def __exit__(self, *exc: object) -> None:
        self.clear()

    def will_capture(self, forward: DistributedForward | ForwardContext) -> bool:
        """Whether the next call with ``forward`` captures (``True``) or replays (``False``)."""
        return self.step.will_capture(_context(forward))

    def __call__(self, forward: DistributedForward | ForwardContext, *inputs: torch.Tensor) -> torch.Tensor:
        """Capture (every rank at once) or replay the step for ``forward``'s static context.

        ``inputs``: this rank's tensors (e.g. ``mesh.scatter(x)`` ``[local streams, seq_len / P, dim]``).
        Returns ``fn``'s output (a clone unless ``clone_outputs=False``).

        Raises
        ------
        DistributedForwardError
            another rank could not replay (checked before anything ran), or failed to warm up or
            capture (no rank keeps a graph for this context); the failing rank raises its own error.
        """
        ctx = _context(forward)
        if not ctx._static:
            raise SpecError(
                "DistributedCUDAGraphStep: expected a forward prepared with static=True "
                "(cache.prepare_forward(..., static=True)), got a dynamic one"
            )
        capture = self._decide(ctx, inputs)
        if capture:
            self._all_or_none("warm up", lambda: self._warm_up(ctx, inputs), ctx)
            self._all_or_none("capture", lambda: self.step.capture(ctx, *inputs), ctx)
        return self.step(ctx, *inputs)

    def _all_or_none(self, what: str, run: Callable[[], None], ctx: ForwardContext) -> None:
        """``run()`` on this rank, then one host vote: raise on every rank unless it succeeded on all
        (this rank's own error where it failed; no graph of ``ctx`` left anywhere)."""
        error: Exception | None = None
        try:
            run()
        except Exception as e:  # noqa: BLE001 -- reported to the peers by the vote, then re-raised
            error = e
        failed = self.mesh.ranks_where(error is not None)
        if not failed:
            return
        self.step.discard(ctx)
        if error is not None:
            raise error
        raise DistributedForwardError(
            f"DistributedCUDAGraphStep: expected every rank to {what} the step, got a failure on rank(s) "
            f"{list(failed)}; no rank keeps a graph for this forward",
            failed_ranks=failed,
        )

    def _warm_up(self, ctx: ForwardContext, inputs: tuple[torch.Tensor, ...]) -> None:
        """Run the step eagerly ``warmup_iters`` times on a side stream (as PyTorch recommends before a
        capture), then wait for it on the host.

        NOTE: the warm-up's collectives create the NCCL communicators and connections the capture will
        record (a capture cannot create them), and the host sync -- once per capture -- makes sure no
        eager NCCL work is still in flight when capturing begins. The warm-up writes this step's K/V into
        the pending pages; the replay rewrites them identically.
        """
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup_iters):
                self.step.fn(*inputs, ctx.layers)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

    def _decide(self, ctx: ForwardContext, inputs: tuple[torch.Tensor, ...]) -> bool:
        """Capture (``True``) or replay on every rank alike; raise on every rank if one cannot run the step
        (its forward finished or released, or, to replay, inputs / prompt caches not as captured)."""
        capture = self.will_capture(ctx)
        error: Exception | None = None
        try:
            ctx._check_usable("DistributedCUDAGraphStep")
            if not capture:
                self.step.check_replay(ctx, *inputs)
        except Exception as e:  # noqa: BLE001 -- reported to the peers by the vote, then re-raised
            error = e
        if not self.verify:
            if error is not None:
                raise error
            return capture
        votes = self.mesh.host_values(_CANNOT if error is not None else (_CAPTURE if capture else _REPLAY))
        failed = tuple(r for r, v in zip(self.mesh.ranks, votes) if v == _CANNOT)
        if error is not None:
            raise error
        if failed:
            raise DistributedForwardError(
                f"DistributedCUDAGraphStep: expected every rank to be able to replay the step, got rank(s) "
                f"{list(failed)} that cannot (inputs or prompt caches not as captured there); nothing was run",
                failed_ranks=failed,
            )
        # Some rank must capture (a new context, or a rebuilt plan): all recapture, so all replay alike.
        return any(v == _CAPTURE for v in votes)


#: The per-call vote of :meth:`DistributedCUDAGraphStep._decide`.
_REPLAY, _CAPTURE, _CANNOT = 0, 1, 2


def _context(forward: DistributedForward | ForwardContext) -> ForwardContext:
    if isinstance(forward, DistributedForward):
        return forward.context
    if isinstance(forward, ForwardContext):
        return forward
    raise SpecError(
        f"DistributedCUDAGraphStep: expected a DistributedForward (static=True), got {type(forward).__name__}"
    )
