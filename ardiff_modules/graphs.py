"""Capture a whole model step (all layers) as one CUDA graph and replay it chunk after chunk.

Constraints (all checked or documented):

* the forward must be prepared with ``static=True`` (fixed buffers for the plan,
  the write pages, the positions and the cross-attention caches), on the
  FlashInfer backend, with a bounded window;
* one graph per static forward context, i.e. per (streams, seq_len): a new
  batch composition or chunk count captures a new graph;
* ``plan()`` runs on the host before each replay (``prepare_forward`` does it),
  never inside the capture; the first call warms up (loads kernels) on a side
  stream before capturing;
* inputs are copied into static tensors; outputs are cloned out of the graph's
  static output unless ``clone_outputs=False``;
* a replay is refused (:class:`~ardiff_modules.errors.ForwardFinishedError`) unless the
  forward is open -- the same rule the custom op applies in eager and compiled runs, which a
  replay would bypass -- and (:class:`~ardiff_modules.errors.CrossAttentionNotPopulatedError`)
  when a cross-attention cache the captured step *read* was cleared since (the graph would read
  the old prompt's buffers; caches it never read do not matter);
* a replay records on its forward the layers the capture wrote (what a commit checks: no Python
  runs per layer in a replay); an FP8 layer the graph writes whose provisional calibration was
  undone since (its capturing forward aborted) is captured again, since a replay cannot calibrate;
* graphs of contexts the cache released (LRU, session or cache closed) are dropped on the
  next call, and a context whose plan object was rebuilt is captured again.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from ardiff_modules.checks import require_bool, require_int
from ardiff_modules.context import ForwardContext
from ardiff_modules.core.transaction import ForwardTransaction
from ardiff_modules.errors import SpecError, TensorMismatchError
#: What a graph step replays: a forward of a ``KVCache`` (with retention groups, one lane context per lane).
Forward = ForwardContext

#: ``torch.cuda.graph(capture_error_mode=...)`` values (see :class:`CUDAGraphStep`).
CaptureErrorMode = Literal["global", "thread_local", "relaxed"]
CAPTURE_ERROR_MODES: tuple[str, ...] = ("global", "thread_local", "relaxed")


def _require_context(owner: str, forward: object) -> Forward:
    if not isinstance(forward, ForwardContext):
        raise SpecError(f"{owner}: expected a ForwardContext, got {type(forward).__name__}")
    return forward


def _parts(forward: Forward) -> tuple[ForwardContext, ...]:
    """The lane contexts whose plans and pools a graph of ``forward`` uses (``forward`` itself when uniform)."""
    return forward._lane_contexts


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    output: torch.Tensor
    #: ``ForwardContext._plan_epoch`` of each lane context at capture: the plan buffers the graph reads.
    plan_epoch: tuple[int, ...]
    #: Cross-attention caches the captured step read (their fixed buffers are baked in).
    cross_names: frozenset[str]
    #: Per lane context, the layers (its own indices) whose K/V the captured step writes (each replay marks them
    #: written on its forward).
    written: tuple[frozenset[int], ...] = ()


class CUDAGraphStep:
    """Replays ``fn(*inputs, layers)`` from a CUDA graph captured on first use.

    Example::

        step = CUDAGraphStep(model)            # model(x, layers) -> out
        with state.prepare_forward(branches, seq_len, commit_current=c, static=True) as fwd:
            out = step(fwd, x)                 # capture on the first call, replay afterwards
    """

    def __init__(
        self,
        fn: Callable[..., torch.Tensor],
        *,
        clone_outputs: bool = True,
        warmup_iters: int = 2,
        capture_error_mode: CaptureErrorMode = "global",
    ) -> None:
        if not callable(fn):
            raise SpecError(f"CUDAGraphStep.fn: expected a callable fn(*inputs, layers), got {type(fn).__name__}")
        if capture_error_mode not in CAPTURE_ERROR_MODES:
            raise SpecError(
                f"CUDAGraphStep.capture_error_mode: expected one of {CAPTURE_ERROR_MODES}, got {capture_error_mode!r}"
            )
        self.fn = fn
        self.clone_outputs = require_bool("CUDAGraphStep.clone_outputs", clone_outputs)
        self.warmup_iters = require_int("CUDAGraphStep.warmup_iters", warmup_iters, minimum=0)
        #: ``torch.cuda.graph``'s ``capture_error_mode``: ``"global"`` (PyTorch's default) fails a capture
        #: when *any* thread makes an unsafe CUDA call during it; ``"thread_local"`` only this thread
        #: (what a process with a NCCL watchdog or other CUDA threads wants).
        self.capture_error_mode = capture_error_mode
        # Keyed weakly by context: a context dropped by everyone takes its graph with it.
        self._captured: weakref.WeakKeyDictionary[Forward, _Captured] = weakref.WeakKeyDictionary()

    @property
    def num_graphs(self) -> int:
        self._drop_released()
        return len(self._captured)

    def _drop_released(self) -> None:
        for forward in [f for f in self._captured if f._released]:
            self._release(forward)

    def _release(self, forward: Forward) -> None:
        captured = self._captured.pop(forward, None)
        # reset() frees the CUDA graph now, not when the last reference (a cycle, a traceback) goes: a live
        # graph that captured NCCL kernels makes dist.destroy_process_group() hang (pytorch/pytorch#115388).
        if captured is not None and captured.graph is not None:
            captured.graph.reset()

    def clear(self) -> None:
        """Drop every captured graph now (their memory pools go with them). Call it before
        ``dist.destroy_process_group()`` when a graph captured collectives."""
        for forward in list(self._captured):
            self._release(forward)

    def __call__(self, forward: Forward, *inputs: torch.Tensor) -> torch.Tensor:
        if not isinstance(forward, ForwardContext):
            raise SpecError(f"CUDAGraphStep: expected a ForwardContext (static=True), got {type(forward).__name__}")
        if not forward._static:
            raise SpecError("CUDAGraphStep: expected a forward prepared with static=True, got a dynamic one")
        self._drop_released()
        forward._check_usable("CUDAGraphStep")
        captured = self._captured.get(forward)
        if captured is not None and _stale(captured, forward):
            self._release(forward)  # the plan was rebuilt (its buffers moved), or calibration must run again
            captured = None
        if captured is None:
            captured = self._capture(forward, inputs)
        else:
            self._check_replay(captured, forward, inputs)
            for static, new in zip(captured.inputs, inputs):
                static.copy_(new, non_blocking=True)
        _record_replay_writes(captured, forward)
        captured.graph.replay()
        return captured.output.clone() if self.clone_outputs else captured.output

    def will_capture(self, forward: Forward) -> bool:
        """Whether the next call with ``forward`` captures (``True``: a context without a graph, or whose
        plan object was rebuilt since) or replays (``False``)."""
        captured = self._captured.get(_require_context("CUDAGraphStep.will_capture", forward))
        return captured is None or _stale(captured, forward)

    def check_replay(self, forward: Forward, *inputs: torch.Tensor) -> None:
        """Raise what a replay of ``forward`` with ``inputs`` would raise before running anything (inputs as
        captured; the cross-attention caches the graph reads still published); nothing if it would capture.
        """
        captured = self._captured.get(_require_context("CUDAGraphStep.check_replay", forward))
        if captured is not None and not _stale(captured, forward):
            self._check_replay(captured, forward, inputs)

    @staticmethod
    def _check_replay(captured: _Captured, forward: Forward, inputs: tuple[torch.Tensor, ...]) -> None:
        for name in sorted(captured.cross_names):
            if name not in forward._cross:
                forward._raise_missing_cross(name)
        if len(inputs) != len(captured.inputs):
            raise TensorMismatchError(f"CUDAGraphStep: expected {len(captured.inputs)} inputs as captured, got {len(inputs)}")
        for static, new in zip(captured.inputs, inputs):
            if not isinstance(new, torch.Tensor) or new.shape != static.shape or new.dtype != static.dtype:
                got = f"{tuple(new.shape)} {new.dtype}" if isinstance(new, torch.Tensor) else type(new).__name__
                raise TensorMismatchError(
                    f"CUDAGraphStep: expected input {tuple(static.shape)} {static.dtype} as captured, got {got}"
                )

    def discard(self, forward: Forward) -> None:
        """Drop ``forward``'s graph if there is one (its next call captures again)."""
        self._release(_require_context("CUDAGraphStep.discard", forward))

    def capture(self, forward: Forward, *inputs: torch.Tensor) -> None:
        """Warm up and capture ``fn(*inputs, forward.layers)`` for ``forward`` now, without replaying it
        (the next call replays). Replaces an existing graph of ``forward``. A failed capture raises and
        leaves no graph for ``forward``."""
        if not isinstance(forward, ForwardContext) or not forward._static:
            raise SpecError("CUDAGraphStep.capture: expected a ForwardContext prepared with static=True")
        forward._check_usable("CUDAGraphStep.capture")
        self.discard(forward)
        self._capture(forward, inputs)

    def _capture(self, forward: Forward, inputs: tuple[torch.Tensor, ...]) -> _Captured:
        layers = forward.layers
        parts = _parts(forward)
        static_inputs = [t.clone() for t in inputs]
        forward._cross_reads.clear()  # what this step reads, recorded by the layers as they run
        # Warm up on a side stream (kernel loading, autotuning, allocator pools), as PyTorch recommends.
        # NOTE: warm-up writes this step's K/V into the pending pages (and calibrates an FP8 pool's
        # uncalibrated layers, which a replay cannot); the replay rewrites them identically.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup_iters):
                self.fn(*static_inputs, layers)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # NOTE: the capture launches nothing: its writes count for a forward only when a replay runs them.
        with _transaction(forward).recording_writes() as written:
            try:
                with torch.cuda.graph(graph, capture_error_mode=self.capture_error_mode):
                    output = self.fn(*static_inputs, layers)
            except BaseException:
                # torch.cuda.graph ends the capture even when fn raised, which can instantiate a graph holding
                # what was recorded (NCCL kernels included) that only the traceback still references.
                with contextlib.suppress(Exception):
                    graph.reset()
                raise
        captured = _Captured(
            graph, static_inputs, output, tuple(p._plan_epoch for p in parts), forward._cross_reads.names(),
            _split_writes(written, parts),
        )
        self._captured[forward] = captured
        return captured


def _split_writes(written: set[int], parts: tuple[ForwardContext, ...]) -> tuple[frozenset[int], ...]:
    """The transaction's written layers (each lane's counted from its ``_write_base``) as each lane's own."""
    bounds = [p._write_base for p in parts[1:]] + [max(written, default=-1) + 1]
    return tuple(
        frozenset(layer - p._write_base for layer in written if p._write_base <= layer < end)
        for p, end in zip(parts, bounds)
    )


def _transaction(part: ForwardContext) -> ForwardTransaction:
    transaction = part._transaction
    assert transaction is not None  # check_usable ran
    return transaction


def _stale(captured: _Captured, forward: Forward) -> bool:
    """Whether ``captured`` must be captured again for ``forward``: a part's plan object was rebuilt (the buffers
    the graph reads moved), or an FP8 layer it writes lost its (provisional) scales, which only a Python
    run of the layer sets again."""
    parts = _parts(forward)
    if captured.plan_epoch != tuple(p._plan_epoch for p in parts):
        return True
    for part, written in zip(parts, captured.written):
        quantizer = part._plan.quantizer if part._plan is not None else None
        if quantizer is not None and not all(quantizer.calibrated(layer) for layer in written):
            return True
    return False


def _record_replay_writes(captured: _Captured, forward: Forward) -> None:
    """A replay writes what its capture wrote: record it on the open forward (host work once per replay)."""
    for part, written in zip(_parts(forward), captured.written):
        transaction = _transaction(part)
        assert part._plan is not None
        transaction.mark_written(part._write_base + layer for layer in written)
        if part._plan.quantizer is not None:
            part._plan.quantizer.note_writes(written, transaction)
