"""Diagnostic (GPU): compiled vs eager rollout of a 3-layer bf16 model, per backend and layout.

For FlashInfer with contiguous extents, FlashInfer with plain paging and the reference backend, the
same seeded rollout (``--chunks`` chunks, a denoising and a committing forward each, CFG's two
branches) runs eagerly and under ``torch.compile(model, fullgraph=True)``. Printed per case: each
forward's relative output error (compiled vs eager), the relative difference of the committed K/V in
the pool, and whether the token positions agree. No timing.

Used to find (and then verify the fix of) cache corruption when the custom op mutated aliased
per-layer views; the log of the verifying run is ``results/compile_vs_eager_h200.log``. The model is
``_models.TinyStreamingModel`` (the tests' tiny streaming DiT). Needs CUDA and FlashInfer (exit status 2
otherwise). Prints the rows; with ``--out DIR`` the results also go to ``DIR/compile_vs_eager.json``
(with run metadata: git commit, UTC time, versions, command line).

    bash .gpu/run.sh python3 -m benchmarks.compile_vs_eager
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._timing import parser, require_gpu, save_json

CASES = (("flashinfer", True), ("flashinfer", False), ("reference", False))


def rollout(model: Any, spec: Any, fn: Any, backend: str, extents: bool, chunks: int) -> tuple[list, Any, Any, list]:
    """Outputs and positions of ``chunks`` x (denoising, committing) forwards of ``fn`` over a fresh cache."""
    import torch

    import ardiff_modules as am

    dt = torch.bfloat16
    cache = am.KVCache(spec, num_pages=64, device="cuda", backend=backend, contiguous_extents=extents)
    st = cache.open_session()
    g = torch.Generator(device="cuda").manual_seed(0)
    for b in spec.branches:
        am.populate_cross_attention(st, b, [blk.cross for blk in model.blocks],
                                    torch.randn(16, 64, device="cuda", dtype=dt, generator=g))
    outs, pos = [], []
    for _ in range(chunks):
        for commit in (False, True):
            x = torch.randn(2, spec.chunk_size, 512, device="cuda", dtype=dt, generator=g)
            with torch.no_grad(), st.prepare_forward(None, spec.chunk_size, commit) as f:
                outs.append(fn(x, f.layers))
                pos.append(f.positions.clone())
    return outs, cache, st, pos


def compare(chunks: int) -> list[dict[str, Any]]:
    import torch

    import ardiff_modules as am
    from benchmarks._models import TinyStreamingModel

    dt = torch.bfloat16
    torch.manual_seed(0)
    model = TinyStreamingModel(dim=512, heads=4, kv_heads=4, layers=3, context_dim=64).cuda().to(dt).eval()
    spec = am.KVCacheSpec(
        num_layers=3, num_kv_heads=4, head_dim=128, chunk_size=256, page_size=64, sink_chunks=1, window_chunks=2,
        branches=("cond", "uncond"), cross_attention=(am.CrossAttentionSpec("text", 16),), dtype="bfloat16",
    )
    rows = []
    for backend, extents in CASES:
        torch._dynamo.reset()
        comp = torch.compile(model, fullgraph=True)
        e, ce, se, pe = rollout(model, spec, model, backend, extents, chunks)
        c, cc, sc, pc = rollout(model, spec, comp, backend, extents, chunks)
        errs = [round(((a.float() - b.float()).norm() / b.float().norm()).item(), 4) for a, b in zip(c, e)]
        pages = [p for ch in se.history_chunks("cond") for p in ch]
        pages_c = [p for ch in sc.history_chunks("cond") for p in ch]
        kv_e = ce._pool.kv[:, :, pages].float()
        kv_c = cc._pool.kv[:, :, pages_c].float()
        row = {
            "backend": backend, "contiguous_extents": extents, "out_rel_err": errs,
            "history_pages_eager": pages, "history_pages_compiled": pages_c,
            "pool_rel_diff": ((kv_c - kv_e).norm() / kv_e.norm()).item(),
            "pool_norm_eager": kv_e.norm().item(), "pool_norm_compiled": kv_c.norm().item(),
            "positions_equal": all(torch.equal(a, b) for a, b in zip(pe, pc)),
        }
        rows.append(row)
        print(backend, extents, "out rel err", errs)
        print("   history pages eager", pages, "compiled", pages_c, "pool rel diff", row["pool_rel_diff"],
              "pool norm", row["pool_norm_eager"], row["pool_norm_compiled"])
        print("   positions equal:", row["positions_equal"])
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--chunks", type=int, default=3, help="chunks per rollout (default 3)")
    p.add_argument("--out", type=Path, default=None, help="also write DIR/compile_vs_eager.json")
    args = p.parse_args(argv)
    if args.chunks < 1:
        p.error("--chunks must be >= 1")
    require_gpu(p.prog)
    rows = compare(args.chunks)
    if args.out is not None:
        save_json(args.out / "compile_vs_eager.json", {"cases": rows}, args=args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
