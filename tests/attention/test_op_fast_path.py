"""The eager op's direct call (``ops.chunk_attention_eager``) and the 16-bit write gate (``kv_write_slots_plain``).

``chunk_attention`` runs the body of ``ardiff_modules::chunk_attention`` without the dispatcher where the dispatcher
adds nothing (issue 42 item 4): it must give the op's output and LSE, bump the pool's version as the op does, show
under the op's name in a profile, refuse a finished forward alike, and go through the op under anything that
intercepts it (a dispatch mode, a torch-function mode, an input that requires grad).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ardiff_modules as am
from ardiff_modules import ops
from ardiff_modules.errors import ForwardFinishedError, SpecError

CHUNK, HEADS, DIM = 4, 2, 8


@pytest.fixture
def forward() -> Iterator[tuple[Any, Any, Any]]:
    """An open (non-committing) forward over a full window, its layer 0 and the cache."""
    spec = am.KVCacheSpec(num_layers=2, num_kv_heads=HEADS, head_dim=DIM, chunk_size=CHUNK, page_size=CHUNK,
                          sink_chunks=1, window_chunks=2, branches=("cond",), dtype="float32")
    cache = am.KVCache(spec, num_pages=24, device="cpu", backend="reference")
    state = cache.open_session()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(4):
            with state.prepare_forward(None, CHUNK, commit_current=True) as fwd:
                for layer in fwd.layers:
                    x = torch.randn(1, CHUNK, HEADS, DIM, generator=gen)
                    am.chunk_attention(x, x, x, layer)
    fwd = state.prepare_forward(None, CHUNK, commit_current=False)
    yield fwd, fwd.layers[0], cache
    cache.close()


def _rows(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(CHUNK, HEADS, DIM, generator=gen) for _ in range(3))  # type: ignore[return-value]


class _Counting(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("return_lse", [False, True])
def test_direct_call_equals_the_op(forward: tuple[Any, Any, Any], return_lse: bool) -> None:
    fwd, layer, _ = forward
    q, k, v = _rows(1)
    pool, args = layer._kv_pool, (layer._layer_id, fwd._handle_id, 0.3, None)
    op = torch.ops.ardiff_modules.chunk_attention_lse if return_lse else torch.ops.ardiff_modules.chunk_attention
    with torch.no_grad():
        want = op(q, k, v, pool, *args)
        before = pool.clone()
        version = pool._version
        got = ops.chunk_attention_eager(q, k, v, pool, *args, return_lse=return_lse)
    assert pool._version > version  # as the op's ADInplaceOrView kernel does
    torch.testing.assert_close(pool, before)  # the same K/V written again
    for a, b in zip(got if return_lse else (got,), want if return_lse else (want,)):
        torch.testing.assert_close(a, b)


def test_direct_call_shows_as_the_op_in_a_profile(forward: tuple[Any, Any, Any]) -> None:
    fwd, layer, _ = forward
    q = torch.randn(1, CHUNK, HEADS, DIM)
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        am.chunk_attention(q, q, q, layer)
    assert "ardiff_modules::chunk_attention" in {e.key for e in prof.key_averages()}


def test_dispatcher_taken_under_modes_and_grad(forward: tuple[Any, Any, Any]) -> None:
    fwd, layer, _ = forward
    q, k, v = _rows(2)
    assert not ops._dispatcher_needed(q, k, v, None)
    mode = _Counting()
    with torch.no_grad(), mode:
        am.chunk_attention(q[None], k[None], v[None], layer)
    assert "ardiff_modules.chunk_attention.default" in mode.ops  # the op reached the mode
    with torch.device("cpu"):  # a torch-function mode
        assert ops._dispatcher_needed(q, k, v, None)
    with torch.enable_grad():
        assert ops._dispatcher_needed(q.requires_grad_(), k, v, None)
    with torch.no_grad():
        assert not ops._dispatcher_needed(q, k, v, None)  # grad off: nothing is recorded either way


def test_a_torch_without_the_private_hooks_takes_the_dispatcher(
    forward: tuple[Any, Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The direct call reads private torch hooks; where this torch lacks one, every call goes through the op."""
    fwd, layer, _ = forward
    q, k, v = _rows(3)
    with torch.no_grad():
        want = am.chunk_attention(q[None], k[None], v[None], layer)
    monkeypatch.setattr(ops, "_DIRECT_CALLS", False)
    assert ops._dispatcher_needed(q, k, v, None)

    def direct(*args: Any) -> None:
        raise AssertionError("the direct call ran")

    monkeypatch.setattr(ops, "_body", direct)
    with torch.no_grad():
        torch.testing.assert_close(am.chunk_attention(q[None], k[None], v[None], layer), want)


def test_direct_call_refuses_a_finished_forward(forward: tuple[Any, Any, Any]) -> None:
    fwd, layer, _ = forward
    q = torch.randn(1, CHUNK, HEADS, DIM)
    fwd.abort()
    with torch.no_grad(), pytest.raises(ForwardFinishedError):
        am.chunk_attention(q, q, q, layer)


def test_plain_gate_returns_fresh_layer_slots_and_records(forward: tuple[Any, Any, Any]) -> None:
    fwd, _, _ = forward
    q, k, v = _rows(3)
    layer = fwd.layers[1]
    slots = fwd._plan.write_slots
    gate = torch.ops.ardiff_modules.kv_write_slots_plain(k, v, layer._layer_id, fwd._handle_id)
    assert gate.data_ptr() != slots.data_ptr()  # fresh: inductor may reuse what an extern op returned
    assert torch.equal(gate % (1 << ops.LAYER_SHIFT), slots) and bool((gate >> ops.LAYER_SHIFT == 1).all())
    assert 1 in fwd._transaction.written
    fwd.abort()
    with pytest.raises(ForwardFinishedError):
        torch.ops.ardiff_modules.kv_write_slots_plain(k, v, layer._layer_id, fwd._handle_id)


def test_plain_gate_refuses_an_fp8_plan_before_recording() -> None:
    spec = am.KVCacheSpec(num_layers=1, num_kv_heads=HEADS, head_dim=DIM, chunk_size=CHUNK, page_size=CHUNK,
                          sink_chunks=1, window_chunks=2, branches=("cond",), dtype="float32",
                          kv_dtype="float8_e4m3fn")
    cache = am.KVCache(spec, num_pages=24, device="cpu", backend="reference")
    fwd = cache.open_session().prepare_forward(None, CHUNK, commit_current=False)
    q, k, v = _rows(4)
    with pytest.raises(SpecError, match="kv_write_slots_plain"):
        torch.ops.ardiff_modules.kv_write_slots_plain(k, v, fwd.layers[0]._layer_id, fwd._handle_id)
    assert not fwd._transaction.written
    cache.close()
