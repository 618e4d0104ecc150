"""Host time of one forward's bookkeeping (prepare_forward + commit) at Wan2.1-1.3B shapes.

Measures whichever ``ardiff_modules`` is first on ``PYTHONPATH``, so two versions can be compared
side by side in one run (alternate invocations)::

    for r in 1 2 3; do for tree in /path/to/old $PWD; do
        PYTHONPATH=$tree:$PYTHONPATH python3 benchmarks/host_time.py --label $(basename $tree); done; done

Prints one JSON line per (layout, layers): median and IQR of milliseconds per forward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def measure(layers: int, extents: bool, iters: int) -> dict:
    import torch

    import ardiff_modules as am

    spec = am.KVCacheSpec(
        num_layers=layers, num_kv_heads=12, head_dim=128, chunk_size=4680, page_size=120, sink_chunks=1,
        window_chunks=6, branches=("cond", "uncond"), dtype="bfloat16",
    )
    cache = am.KVCache(spec, num_pages=2 * 9 * spec.pages_per_chunk, device="cuda", backend="flashinfer",
                       contiguous_extents=extents)
    state = cache.open_session()
    times = []
    for i in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fwd = state.prepare_forward(None, 4680, commit_current=True)
        fwd.commit()
        if i >= 10:  # after the windows filled
            times.append((time.perf_counter() - t0) * 1e3)
    q1, _, q3 = statistics.quantiles(times, n=4)
    return {"layers": layers, "extents": extents, "median_ms": statistics.median(times), "iqr_ms": q3 - q1,
            "package": am.__file__}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="current")
    parser.add_argument("--iters", type=int, default=110)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("host_time.py needs CUDA and FlashInfer (run it on the GPU machine)", file=sys.stderr)
        return 2
    for extents in (True, False):
        for layers in (1, 30):
            print(json.dumps({"label": args.label, **measure(layers, extents, args.iters)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
