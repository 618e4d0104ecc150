"""``CUDAGraphStep`` frees its graphs *now* when it drops them (``graph.reset()``), not when the last
reference goes: a graph that captured NCCL kernels and is still alive -- held by a reference cycle, a
traceback, a user's variable -- makes ``dist.destroy_process_group()`` hang (pytorch/pytorch#115388; seen on
2x H200). CPU: stand-in graphs record their resets."""

from __future__ import annotations

import contextlib

import pytest
import torch

from ardiff_modules import KVCache
from ardiff_modules.context import ForwardContext
from ardiff_modules.graphs import CUDAGraphStep, _Captured
from tests.support.two_sessions import TWO_SESSIONS_SPEC


class _FakeGraph:
    """What ``CUDAGraphStep`` calls on a graph it drops."""

    def __init__(self) -> None:
        self.resets = 0

    def reset(self) -> None:
        self.resets += 1


def _step_with_graphs(contexts: list[ForwardContext]) -> tuple[CUDAGraphStep, list[_FakeGraph]]:
    step = CUDAGraphStep(lambda *x: x)
    graphs = [_FakeGraph() for _ in contexts]
    for ctx, graph in zip(contexts, graphs):
        step._captured[ctx] = _Captured(graph, [], torch.zeros(1), (ctx._plan_epoch,), frozenset())
    return step, graphs


def _contexts() -> tuple[KVCache, list, list[ForwardContext]]:
    """Two open forwards of two sessions (their contexts: what graphs are keyed by)."""
    cache = KVCache(TWO_SESSIONS_SPEC, num_pages=32, backend="reference")
    states = [cache.open_session("a"), cache.open_session("b")]
    forwards = [cache.prepare_forward([(s, "cond")], TWO_SESSIONS_SPEC.chunk_size) for s in states]
    return cache, states, forwards


def test_clear_resets_every_graph_even_if_referenced_elsewhere() -> None:
    _, _, forwards = _contexts()
    step, graphs = _step_with_graphs(forwards)
    step.clear()
    assert [g.resets for g in graphs] == [1, 1] and step.num_graphs == 0
    step.clear()  # nothing left: no second reset
    assert [g.resets for g in graphs] == [1, 1]


def test_discard_resets_only_that_graph() -> None:
    _, _, forwards = _contexts()
    step, graphs = _step_with_graphs(forwards)
    step.discard(forwards[0])
    assert [g.resets for g in graphs] == [1, 0] and step.num_graphs == 1


def test_graph_of_a_released_context_is_reset_on_the_next_call() -> None:
    cache, states, forwards = _contexts()
    step, graphs = _step_with_graphs(forwards)
    forwards[0].abort()
    states[0].close()  # releases session a's contexts
    assert step.num_graphs == 1
    assert [g.resets for g in graphs] == [1, 0]


def test_a_capture_that_raises_resets_its_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.cuda.graph`` ends the capture even when ``fn`` raised, which can instantiate a graph of what
    was recorded; only the traceback would still hold it, out of reach of ``clear()``."""
    made: list[_FakeGraph] = []

    class _RecordedGraph(_FakeGraph):
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    class _Stream:
        def wait_stream(self, other: object) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _RecordedGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, capture_error_mode="global": contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())

    def failing(*inputs: object) -> torch.Tensor:
        raise RuntimeError("fn failed during capture")

    _, _, forwards = _contexts()
    step = CUDAGraphStep(failing, warmup_iters=0)
    with pytest.raises(RuntimeError, match="failed during capture"):
        step._capture(forwards[0], ())
    assert len(made) == 1 and made[0].resets == 1 and step.num_graphs == 0
