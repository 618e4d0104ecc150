"""Host time of one layer's call into the library: the eager op and the compiled path's two ops.

Per backend, one open forward at a tiny shape (1 stream, one 4-token chunk, 1 KV head of 8 dims: the
attention itself costs next to nothing, so what is timed is the host work around it), and per measured call
``--calls`` calls timed one by one (``time.perf_counter_ns``, host time only: the device is never waited for),
after ``--warmup`` untimed ones; the median, p25 and p75 in microseconds:

* ``chunk_attention``: the public eager entry point (``ardiff_modules.chunk_attention``, no grad): the checks,
  the custom op ``ardiff_modules::chunk_attention`` (write + attend) and the reshape of its output;
* ``op_chunk_attention``: the custom op alone, called as ``torch.ops.ardiff_modules.chunk_attention``;
* ``kv_write_slots``: the gate op a compiled graph calls before it writes K/V (the one
  ``ops.write_kv_in_graph`` calls for this pool: ``kv_write_slots_plain`` where the tree has it and the pool is
  not FP8, else ``kv_write_slots``), called through ``torch.ops`` as inductor's generated code calls it;
* ``paged_attention``: the compiled graph's attention op ``ardiff_modules::paged_attention`` (pool only);
* ``plan_run`` / ``plan_attend``: the plan's own ``run`` / ``attend`` (what the ops call): the backend's share,
  so ``op - plan`` is the op's own overhead (handle lookup, write record, torch's custom-op dispatch);
* ``compiled_layer`` (not with ``--no-compile``): ``chunk_attention`` under ``torch.compile`` (inductor,
  fullgraph) on the same layer: the whole compiled layer call, gate + fused write + attention op.

Backends: ``reference`` (the CPU oracle: ``plan_*`` include its gather + SDPA on 4 tokens) and, with
``--cpu``, ``flashinfer-stub``: the FlashInfer backend's host path with FlashInfer's wrappers replaced by
stand-ins whose ``run`` returns an empty output and whose ``append_paged_kv_cache`` does nothing
(``benchmarks.host_time.stub_flashinfer``), so ``plan_*`` time the backend's Python before FlashInfer's
``wrapper.run`` (``FlashInferPlan.attend`` / ``_kernel_query``) -- not FlashInfer's own ``run``. On a GPU
(without ``--cpu``) the backends are ``reference`` and the real ``flashinfer`` at bfloat16, 128-dim heads.

Measures whichever ``ardiff_modules`` comes first on ``sys.path`` (``PYTHONPATH=/path/to/tree`` to compare two
trees, as ``benchmarks/host_time.py`` says). Prints one JSON object and writes it to ``--out DIR``
(``op_host_time.json``; the committed ones: ``results/op_host_time_<label>_cpu.json``).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks._timing import environment, git_info, parser, require_gpu, run_metadata, save_json

#: The measured forward: one stream of one chunk, a window that is full (the steady state).
CHUNK, PAGE, SINKS, WINDOW, WARM_FORWARDS = 4, 4, 1, 2, 5


def time_calls(fn: Callable[[], Any], calls: int, warmup: int) -> dict[str, float]:
    """Median, p25 and p75 microseconds of ``calls`` calls of ``fn`` timed one by one, after ``warmup``."""
    for _ in range(warmup):
        fn()
    clock = time.perf_counter_ns
    samples = []
    for _ in range(calls):
        start = clock()
        fn()
        samples.append((clock() - start) / 1e3)
    q1, q2, q3 = statistics.quantiles(samples, n=4)
    return {"median_us": round(q2, 2), "p25_us": round(q1, 2), "p75_us": round(q3, 2), "n": calls}


@contextlib.contextmanager
def runnable_flashinfer_stub() -> Iterator[Any]:
    """``host_time.stub_flashinfer`` whose wrappers also ``run`` (an empty output of the query's shape, plus a
    float32 LSE with ``return_lse``) and whose ``append_paged_kv_cache`` does nothing: the FlashInfer backend's
    per-layer host path on the CPU, FlashInfer itself left out."""
    import torch

    from benchmarks import host_time

    class RunnableStub(host_time._StubWrapper):
        def run(self, q: Any, *args: Any, return_lse: bool = False, **kwargs: Any) -> Any:
            out = torch.empty_like(q, dtype=torch.bfloat16)
            return (out, torch.empty(q.shape[:2], dtype=torch.float32)) if return_lse else out

    with host_time.stub_flashinfer() as backend:
        fake = sys.modules["flashinfer"]
        fake.BatchPrefillWithPagedKVCacheWrapper = RunnableStub  # type: ignore[attr-defined]
        fake.BatchPrefillWithRaggedKVCacheWrapper = RunnableStub  # type: ignore[attr-defined]
        fake.append_paged_kv_cache = lambda *args, **kwargs: None  # type: ignore[attr-defined]
        yield backend


def _gate(pool: Any) -> tuple[str, Callable[..., Any]]:
    """The write gate op ``write_kv_in_graph`` calls for ``pool`` in the measured tree, as ``(name, call)``."""
    import torch

    from ardiff_modules.quant import is_quantized

    ops = torch.ops.ardiff_modules
    if hasattr(ops, "kv_write_slots_plain") and not is_quantized(pool.dtype):
        return "kv_write_slots_plain", lambda k, v, scales, layer, handle: ops.kv_write_slots_plain(k, v, layer, handle)
    return "kv_write_slots", ops.kv_write_slots


def measure(
    backend: Any, backend_name: str, *, device: str, calls: int, warmup: int, compile_layer: bool
) -> dict[str, Any]:
    """Every measured call of one backend (see the module docstring)."""
    import torch

    import ardiff_modules as am

    heads, dim = (1, 8) if device == "cpu" else (1, 128)
    spec = am.KVCacheSpec(
        num_layers=1, num_kv_heads=heads, head_dim=dim, chunk_size=CHUNK, page_size=PAGE, sink_chunks=SINKS,
        window_chunks=WINDOW, branches=("cond",), dtype="bfloat16",
    )
    cache = am.KVCache(spec, num_pages=4 * (SINKS + WINDOW + 2), device=device, backend=backend)
    state = cache.open_session()
    shape = (1, CHUNK, heads, dim)
    q, k, v = (torch.randn(shape, dtype=torch.bfloat16, device=device) for _ in range(3))
    with torch.no_grad():
        for _ in range(WARM_FORWARDS):  # the window fills: the measured forward is a steady-state one
            with state.prepare_forward(None, CHUNK, commit_current=True) as fwd:
                am.chunk_attention(q, k, v, fwd.layers[0])
        fwd = state.prepare_forward(None, CHUNK, commit_current=False)
        layer = fwd.layers[0]
        pool, scales, layer_id, handle = layer._kv_pool, layer._kv_scales, layer._layer_id, fwd._handle_id
        rows = (q.reshape(CHUNK, heads, dim), k.reshape(CHUNK, heads, dim), v.reshape(CHUNK, heads, dim))
        plan, scale = fwd._plan, dim**-0.5
        k_cache, v_cache = pool[0, 0], pool[0, 1]
        ops = torch.ops.ardiff_modules
        gate_name, gate = _gate(pool)
        measured: dict[str, Callable[[], Any]] = {
            "chunk_attention": lambda: am.chunk_attention(q, k, v, layer),
            "op_chunk_attention": lambda: ops.chunk_attention(*rows, pool, layer_id, handle, scale, None),
            "plan_run": lambda: plan.run(*rows, k_cache, v_cache, scale, layer=0),
            "kv_write_slots": lambda: gate(rows[1], rows[2], scales, layer_id, handle),
            "paged_attention": lambda: ops.paged_attention(rows[0], pool, layer_id, handle, scale, None),
            "plan_attend": lambda: plan.attend(rows[0], k_cache, v_cache, scale, layer=0),
        }
        if compile_layer:
            step = torch.compile(lambda q_, k_, v_, kv: am.chunk_attention(q_, k_, v_, kv), fullgraph=True)
            step(q, k, v, layer)  # compiles
            measured["compiled_layer"] = lambda: step(q, k, v, layer)
        results = {name: time_calls(fn, calls, warmup) for name, fn in measured.items()}
        fwd.abort()
    cache.close()
    return {"backend": backend_name, "device": device, "mode": getattr(plan, "mode", type(plan).__name__),
            "gate_op": gate_name, "calls": results}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--label", default="current", help="name of the measured tree in the output")
    p.add_argument("--calls", type=int, default=3000, help="timed calls per measured call (default 3000)")
    p.add_argument("--warmup", type=int, default=300, help="untimed calls first (default 300)")
    p.add_argument("--cpu", action="store_true", help="no GPU: the reference backend and the FlashInfer stand-in")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled layer (saves the compile time)")
    p.add_argument("--out", type=Path, default=None, help="directory for op_host_time.json")
    args = p.parse_args(argv)
    if args.calls < 4 or args.warmup < 0:
        p.error("--calls must be >= 4 and --warmup >= 0")
    if not args.cpu:
        require_gpu(p.prog)
    import ardiff_modules as am

    rows = []
    kwargs = dict(calls=args.calls, warmup=args.warmup, compile_layer=not args.no_compile)
    if args.cpu:
        rows.append(measure("reference", "reference", device="cpu", **kwargs))  # type: ignore[arg-type]
        with runnable_flashinfer_stub() as stub:
            rows.append(measure(stub, "flashinfer-stub", device="cpu", **kwargs))  # type: ignore[arg-type]
    else:
        for name in ("reference", "flashinfer"):
            rows.append(measure(name, name, device="cuda", **kwargs))  # type: ignore[arg-type]
    payload = {"label": args.label, "package": am.__file__, "package_git": git_info(Path(am.__file__).parent),
               "results": rows}
    for row in rows:  # one line per backend: the medians
        medians = {name: point["median_us"] for name, point in row["calls"].items()}
        print(json.dumps({"label": args.label, "backend": row["backend"], "median_us": medians}), flush=True)
    if args.out is not None:
        save_json(args.out / "op_host_time.json", {**payload, "env": environment()}, args=args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
