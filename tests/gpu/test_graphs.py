"""CUDA graphs on the fast path and the compiled K/V write, on the GPU.

* static (CUDA-graph) forwards over contiguous extents replay **ragged** FA3 (two fixed rows per
  stream, absolute key offsets) and equal eager forwards; a static forward that needs the other
  kernel gets a new plan and the step is captured again;
* under ``torch.compile`` the K/V write is part of the generated code (no pool-sized buffer, no
  opaque write-and-attend op) and equals eager, bf16 and FP8.

Run on the GPU machine: ``bash .gpu/run.sh python3 -m pytest -m gpu -q``. Skipped without CUDA/FlashInfer.
"""

from __future__ import annotations

import re

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.backends.flashinfer import FlashInferPlan
from ardiff_modules.graphs import CUDAGraphStep
from tests.support.gpu import DTYPE, FP8, GPU, gpu_model_and_spec, rel_error

pytestmark = list(GPU)


def _flashinfer_rollout(  # noqa: ANN202
    model, spec, step_fn, *, static: bool, extents: bool = True, sessions: int = 1, chunks: int = 7  # noqa: ANN001
):
    """``chunks`` chunk steps (2 denoising + 1 committing forward) of ``sessions`` sessions batched."""
    cache = am.KVCache(spec, num_pages=64 * sessions, device="cuda", backend="flashinfer",
                       contiguous_extents=extents)
    if spec.kv_dtype == FP8:
        cache.set_kv_scales(torch.full((3, 2, 4), 0.05))
    states = [cache.open_session() for _ in range(sessions)]
    g = torch.Generator(device="cuda").manual_seed(0)
    outs, modes = [], []
    streams = [(s, b) for s in states for b in spec.branches]
    for chunk in range(chunks):
        if chunk in (0, 4):
            for state in states:
                state.clear_cross_attention()
                for b in spec.branches:
                    text = torch.randn(16, 64, device="cuda", dtype=DTYPE, generator=g)
                    am.populate_cross_attention(state, b, [blk.cross for blk in model.blocks], text)
        for commit in (False, False, True):
            x = torch.randn(len(streams), 256, 512, device="cuda", dtype=DTYPE, generator=g)
            with torch.no_grad(), cache.prepare_forward(streams, 256, commit_current=commit, static=static) as fwd:
                outs.append(step_fn(fwd, x))
                modes.append(fwd._plan.mode)
    return outs, modes, cache


@pytest.mark.parametrize("kv_dtype", [None, FP8])
@pytest.mark.parametrize("sessions", [1, 2])
def test_static_forwards_replay_ragged_and_equal_eager(kv_dtype: str | None, sessions: int) -> None:
    model, spec = gpu_model_and_spec(kv_dtype=kv_dtype)
    eager, eager_modes, eager_cache = _flashinfer_rollout(model, spec, lambda fwd, x: model(x, fwd.layers),
                                                          static=False, sessions=sessions)
    step = CUDAGraphStep(model)
    graphed, modes, cache = _flashinfer_rollout(model, spec, lambda fwd, x: step(fwd, x), static=True,
                                                sessions=sessions)
    assert set(eager_modes) == {"ragged"}
    assert set(modes) == {"ragged"}, f"expected ragged FA3 replays, got {set(modes)}"
    assert step.num_graphs == 1
    errors = [rel_error(g, e) for g, e in zip(graphed, eager)]
    print(f"graph vs eager, rel err per forward: max {max(errors):.2e}")
    assert max(errors) < (3e-2 if kv_dtype is None else 5e-2)
    # The same K/V went to the same pages.
    pool_err = rel_error(cache._pool.kv.float(), eager_cache._pool.kv.float())
    assert pool_err < 1e-2, f"pools differ by {pool_err:.2e}"


def test_static_plan_switches_kernel_and_recaptures(monkeypatch: pytest.MonkeyPatch) -> None:
    """A static forward that cannot run ragged gets a new (paged) plan: the graph is captured again."""
    model, spec = gpu_model_and_spec()
    eager, _, _ = _flashinfer_rollout(model, spec, lambda fwd, x: model(x, fwd.layers), static=False, chunks=4)
    step = CUDAGraphStep(model)
    calls = {"n": 0}
    original = FlashInferPlan._ragged_eligible

    def eligible(self, request):  # noqa: ANN001, ANN202
        calls["n"] += 1
        # From the 3rd chunk step on, pretend the keys are not contiguous (as after a fork).
        return original(self, request) and request.layout.streams[0].token_offset < 2 * spec.chunk_size

    monkeypatch.setattr(FlashInferPlan, "_ragged_eligible", eligible)
    graphed, modes, _ = _flashinfer_rollout(model, spec, lambda fwd, x: step(fwd, x), static=True, chunks=4)
    assert modes[:6] == ["ragged"] * 6 and set(modes[6:]) == {"paged"}, modes
    assert step.num_graphs == 1  # the ragged graph was dropped with its plan
    for g, e in zip(graphed, eager):
        assert rel_error(g, e) < 3e-2


_ALLOC = re.compile(r"empty_strided_cuda\(\(([0-9, ]*)\)")


@pytest.mark.parametrize("kv_dtype", [None, FP8])
def test_compiled_write_is_in_the_graph_and_equals_eager(kv_dtype: str | None) -> None:
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._inductor.utils import run_and_get_code

    model, spec = gpu_model_and_spec(kv_dtype=kv_dtype)
    eager, _, eager_cache = _flashinfer_rollout(model, spec, lambda fwd, x: model(x, fwd.layers), static=False)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    codes: list[str] = []

    def step(fwd, x):  # noqa: ANN001, ANN202
        if not codes:
            out, code = run_and_get_code(compiled, x, fwd.layers)
            codes.extend(code)
            return out
        return compiled(x, fwd.layers)

    comp, _, cache = _flashinfer_rollout(model, spec, step, static=False)
    assert counter.frame_count == 1
    code = "\n".join(codes)
    assert "kv_write_slots" in code and "chunk_attention" not in code
    layer_numel = cache._pool.kv[0].numel()
    sizes = []
    for shape in _ALLOC.findall(code):
        n = 1
        for dim in filter(None, (d.strip() for d in shape.split(","))):
            n *= int(dim)
        sizes.append(n)
    assert max(sizes) < layer_numel, f"a buffer of {max(sizes)} elements (a layer holds {layer_numel})"
    errors = [rel_error(c, e) for c, e in zip(comp, eager)]
    print(f"compiled (K/V written in the graph) vs eager: max rel err {max(errors):.2e}")
    assert max(errors) < (3e-2 if kv_dtype is None else 5e-2)
    assert rel_error(cache._pool.kv.float(), eager_cache._pool.kv.float()) < (1e-2 if kv_dtype is None else 5e-2)


def test_compiled_cuda_graph_step_replays_in_graph_writes() -> None:
    """CUDAGraphStep over a compiled model: the in-graph write reads the static plan's slot buffer."""
    model, spec = gpu_model_and_spec()
    eager, _, _ = _flashinfer_rollout(model, spec, lambda fwd, x: model(x, fwd.layers), static=False)
    torch._dynamo.reset()
    step = CUDAGraphStep(torch.compile(model, fullgraph=True))
    graphed, modes, _ = _flashinfer_rollout(model, spec, lambda fwd, x: step(fwd, x), static=True)
    assert set(modes) == {"ragged"} and step.num_graphs == 1
    errors = [rel_error(g, e) for g, e in zip(graphed, eager)]
    assert max(errors) < 3e-2, errors
