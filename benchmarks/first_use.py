"""One-time costs in a fresh process (GPU): imports, CUDA init, first plan and first run of each FlashInfer path.

A server pays these once per process; a benchmark's first variant pays them in its warm-up. Phases, in
order: ``import torch``, CUDA init, ``import ardiff_modules``, ``import flashinfer``, building a
``KVCache`` (FlashInfer, contiguous extents), three one-chunk forwards, two two-chunk forwards (the
structural paged path) and two masked (FA2) forwards, each of 2 layers at Wan2.1-1.3B shapes. Each
phase runs exactly once and is timed alone (``_timing.once``: wall time, the device synchronised
before and after it), so there is no spread: run the script several times in fresh processes for one.

Printed per phase (seconds) and in total since the interpreter started this script (the committed
output: ``results/first_use_h200.log``). With ``--out DIR`` also ``DIR/first_use.json`` (phases, kernel
modes, run metadata: git commit, UTC time, versions, command line). Needs CUDA and FlashInfer (exit
status 2 otherwise; checked without importing either, so the import phases stay cold).

    bash .gpu/run.sh python3 -m benchmarks.first_use [--out DIR]
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import importlib.util  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks._timing import fail, once, parser, save_json  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--out", type=Path, default=None, help="also write DIR/first_use.json")
    args = p.parse_args(argv)
    if importlib.util.find_spec("flashinfer") is None:  # looked up, not imported: the import phase stays cold
        fail(p.prog, "needs a CUDA GPU and FlashInfer: the flashinfer package is not installed "
                     "(pip install 'ardiff_modules[flashinfer]'; on the GPU machine: bash .gpu/run.sh python3 ...)")
    phases: list[dict[str, Any]] = []

    def phase(name: str, fn: Callable[[], Any], *, sync: bool = True) -> Any:
        result, seconds = once(fn, sync_start=sync, sync_end=sync)
        phases.append({"phase": name, "s": seconds})
        print(f"{name:<44s} {seconds:8.3f} s", flush=True)
        return result

    torch = phase("import torch", lambda: __import__("torch"), sync=False)
    if not torch.cuda.is_available():
        fail(p.prog, "needs a CUDA GPU and FlashInfer: CUDA is not available, torch.cuda.is_available() is False")
    phase("cuda init", lambda: torch.zeros(1, device="cuda"), sync=False)
    am = phase("import ardiff_modules", lambda: __import__("ardiff_modules"))
    phase("import flashinfer", lambda: __import__("flashinfer"))
    spec = am.KVCacheSpec(num_layers=2, num_kv_heads=12, head_dim=128, chunk_size=4680, page_size=120,
                          sink_chunks=1, window_chunks=6, branches=("cond", "uncond"), dtype="bfloat16")
    cache = phase("KVCache (flashinfer, extents)", lambda: am.KVCache(spec, num_pages=2 * 10 * spec.pages_per_chunk,
                                                                       device="cuda", backend="flashinfer"))
    state = cache.open_session()
    x = torch.randn(2, 2 * 4680, 12, 128, device="cuda", dtype=torch.bfloat16)
    modes: dict[str, str] = {}

    def forward(chunks: int, commit: bool) -> str:
        with state.prepare_forward(None, chunks * 4680, commit_current=commit) as fwd:
            for layer in fwd.layers:
                am.chunk_attention(x[:, : chunks * 4680], x[:, : chunks * 4680], x[:, : chunks * 4680], layer)
            return fwd._plan.mode

    for i in range(3):
        modes[f"one-chunk forward #{i}"] = mode = phase(f"one-chunk forward #{i}", lambda: forward(1, True))
        print(f"    mode {mode}")
    for i in range(2):
        modes[f"two-chunk forward #{i}"] = mode = phase(f"two-chunk forward #{i}", lambda: forward(2, True))
        print(f"    mode {mode}")
    mask = torch.ones(2, 4680, 8 * 4680, dtype=torch.bool, device="cuda")

    def masked() -> None:
        fwd = state.prepare_forward(None, 4680, commit_current=False, token_mask=mask)
        for layer in fwd.layers:
            am.chunk_attention(x[:, :4680], x[:, :4680], x[:, :4680], layer)
        state.abort()

    phase("masked (FA2) forward #0", masked)
    phase("masked (FA2) forward #1", masked)
    total = time.perf_counter() - T0
    print(f"{'total':<44s} {total:8.3f} s")
    if args.out is not None:
        save_json(args.out / "first_use.json", {"phases": phases, "modes": modes, "total_s": total,
                                                "timing": "each phase once, wall time, device synchronised "
                                                          "before and after (except the imports / CUDA init)"},
                  args=args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
