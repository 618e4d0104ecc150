"""One-time costs on a fresh process (GPU): import, first plan and first run of each FlashInfer path.

A server pays these once per process; a benchmark's first variant pays them in its warm-up.
Each phase is wall time with the device synchronised at both ends.

    bash .gpu/run.sh python3 benchmarks/first_use.py
"""

from __future__ import annotations

import time

import torch

T0 = time.perf_counter()


def phase(name: str, fn) -> object:  # noqa: ANN001
    torch.cuda.synchronize()
    t = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    print(f"{name:<44s} {time.perf_counter() - t:8.3f} s", flush=True)
    return result


def main() -> None:
    phase("cuda init", lambda: torch.zeros(1, device="cuda"))
    am = phase("import ardiff_modules", lambda: __import__("ardiff_modules"))
    phase("import flashinfer", lambda: __import__("flashinfer"))
    spec = am.KVCacheSpec(num_layers=2, num_kv_heads=12, head_dim=128, chunk_size=4680, page_size=120,
                          sink_chunks=1, window_chunks=6, branches=("cond", "uncond"), dtype="bfloat16")
    cache = phase("KVCache (flashinfer, extents)", lambda: am.KVCache(spec, num_pages=2 * 10 * spec.pages_per_chunk,
                                                                       device="cuda", backend="flashinfer"))
    state = cache.open_session()
    x = torch.randn(2, 2 * 4680, 12, 128, device="cuda", dtype=torch.bfloat16)

    def forward(chunks: int, commit: bool) -> str:
        with state.prepare_forward(None, chunks * 4680, commit_current=commit) as fwd:
            for layer in fwd.layers:
                am.chunk_attention(x[:, : chunks * 4680], x[:, : chunks * 4680], x[:, : chunks * 4680], layer)
            return fwd.plan.mode

    for i in range(3):
        mode = phase(f"one-chunk forward #{i}", lambda: forward(1, True))
        print(f"    mode {mode}")
    for i in range(2):
        mode = phase(f"two-chunk forward #{i}", lambda: forward(2, True))
        print(f"    mode {mode}")
    mask = torch.ones(2, 4680, 8 * 4680, dtype=torch.bool, device="cuda")

    def masked() -> None:
        fwd = state.prepare_forward(None, 4680, commit_current=False, token_mask=mask)
        for layer in fwd.layers:
            am.chunk_attention(x[:, :4680], x[:, :4680], x[:, :4680], layer)
        state.abort()

    phase("masked (FA2) forward #0", masked)
    phase("masked (FA2) forward #1", masked)
    print(f"{'total':<44s} {time.perf_counter() - T0:8.3f} s")


if __name__ == "__main__":
    main()
