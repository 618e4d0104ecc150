"""Host time of one forward's bookkeeping (prepare_forward + commit) at Wan2.1-1.3B shapes.

Per layout (contiguous extents, plain paging) and model depth (1 and 30 layers): ``--iters`` committing
forwards with no attention in between, each timed alone (``_timing.each_call``, host time only: the
device is synchronised before each forward, not after), after ``--warmup`` forwards that fill the
windows. Needs CUDA and FlashInfer (exit status 2 otherwise).

Measures whichever ``ardiff_modules`` is first on ``PYTHONPATH``, so two versions can be compared
side by side in one run (alternate invocations)::

    for r in 1 2 3; do for tree in /path/to/old $PWD; do
        PYTHONPATH=$tree:$PYTHONPATH python3 benchmarks/host_time.py --label $(basename $tree); done; done

Prints JSON lines: first one ``{"label", "run", "env", "package_git"}`` line (run metadata: git commit
and dirty flag of this checkout and of the measured package's tree, UTC time, versions, command line),
then one line per (layout, layers): median, IQR, p25, p75 of milliseconds per forward. ``--out FILE``
appends the same lines to FILE.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if str(HERE.parent) not in sys.path:  # this checkout's package, unless one is installed or on PYTHONPATH
    sys.path.append(str(HERE.parent))
from _timing import each_call, environment, git_info, parser, require_gpu, run_metadata  # noqa: E402


def measure(layers: int, extents: bool, iters: int, warmup: int = 10) -> dict[str, Any]:
    import ardiff_modules as am

    spec = am.KVCacheSpec(
        num_layers=layers, num_kv_heads=12, head_dim=128, chunk_size=4680, page_size=120, sink_chunks=1,
        window_chunks=6, branches=("cond", "uncond"), dtype="bfloat16",
    )
    cache = am.KVCache(spec, num_pages=2 * 9 * spec.pages_per_chunk, device="cuda", backend="flashinfer",
                       contiguous_extents=extents)
    state = cache.open_session()

    def forward() -> None:
        fwd = state.prepare_forward(None, 4680, commit_current=True)
        fwd.commit()

    stats, _ = each_call(forward, iters, warmup=warmup, sync_end=False)  # warm-up: the windows fill
    return {"layers": layers, "extents": extents, "median_ms": stats.median_ms, "iqr_ms": stats.iqr_ms,
            "p25_ms": stats.p25_ms, "p75_ms": stats.p75_ms, "n": stats.n_samples, "package": am.__file__}


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--label", default="current", help="name of the measured tree in the output lines")
    p.add_argument("--iters", type=int, default=100, help="timed forwards per point (default 100)")
    p.add_argument("--warmup", type=int, default=10, help="untimed forwards first, filling the windows (default 10)")
    p.add_argument("--out", type=Path, default=None, help="also append the JSON lines to this file")
    args = p.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    require_gpu(p.prog)
    import ardiff_modules as am

    lines: list[dict[str, Any]] = [{
        "label": args.label, "run": run_metadata(args), "env": environment(),
        "package": am.__file__, "package_git": git_info(Path(am.__file__).parent),
    }]
    print(json.dumps(lines[0]), flush=True)
    for extents in (True, False):
        for layers in (1, 30):
            lines.append({"label": args.label, **measure(layers, extents, args.iters, args.warmup)})
            print(json.dumps(lines[-1]), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
