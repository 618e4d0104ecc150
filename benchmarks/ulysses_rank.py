"""One Ulysses rank's work on one GPU, without communication: where the non-communication overhead goes.

``multi_gpu`` measures Ulysses on 2 GPUs; its ``a2a_share_by_removal`` replaces the all-to-alls by
local copies and still leaves the step slower than half of one GPU's. This script runs, in one process,
the work of **rank 0 of a 2-way Ulysses group** -- half the tokens outside attention, half the heads in
its pool, both CFG branches -- with every all-to-all replaced by a copy of the same size
(``send.clone()``), next to the whole step on one GPU, side by side in one run:

* ``single``   -- the whole chunk step (2 streams x 4680 tokens, every head);
* ``rank``     -- rank 0's share with ``cross_attention="heads"`` (the all-to-alls' layout copies kept);
* ``rank_tokens`` -- the same with ``cross_attention="tokens"`` (no cross-attention all-to-alls);
* ``rank_plain_copies`` -- ``rank`` with the layout copies made element by element (``.contiguous()``)
  instead of as 8-byte words (``ulysses._dense``): what the word copies save.

Reported: ms per chunk step (4 denoising + 1 committing forward) and ``rank / (single / 2)``, the
overhead factor a perfect interconnect would still leave; ``--profile`` writes the top device kernels
of one step of each variant. The model and step are ``multi_gpu``'s (``build_stack``, Wan-14B width by
default, ``--layers`` blocks).

Writes ``ulysses_rank.json`` (``ulysses_rank_compiled.json`` with ``--compile``) and, with ``--profile``,
``profile_ulysses_<variant>.txt`` into ``--out DIR``; by default the committed results,
``benchmarks/results/ulysses_rank_<device>.json`` (``ulysses_rank_compiled_<device>.json``) and
``ulysses_rank_profile_<variant>_<device>.txt``.

    python -m benchmarks.ulysses_rank --out /tmp/ulysses_rank            # CUDA + FlashInfer
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks._timing import each_call, parser, require_gpu, result_path, save_json
from benchmarks.multi_gpu import (
    BRANCHES, DENOISING_FORWARDS, build_stack, kv_spec, pages_needed, profile_step, shapes,
)


class _LocalSequenceParallel:
    """Rank 0 of a ``size``-way Ulysses group in one process: the all-to-all is a same-size local copy."""

    def __new__(cls, size: int, cross_mode: str) -> Any:
        from ardiff_modules.distributed.ulysses import SequenceParallel

        sp = SequenceParallel.__new__(SequenceParallel)
        sp.group, sp.size, sp.rank, sp.fuse_qkv, sp.cross_mode = None, size, 0, None, cross_mode
        sp.all_to_all = lambda send: send.clone()  # type: ignore[method-assign]
        return sp


class _Variant:
    def __init__(self, name: str, shape: Any, args: Any, sp_size: int, cross_mode: str) -> None:
        import torch

        import ardiff_modules as am
        from ardiff_modules.distributed import parallelize

        self.name, self.torch = name, torch
        cuda = args.device == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        dtype, kv_dtype = (torch.bfloat16, "bfloat16") if cuda else (torch.float32, "float32")
        self.model = build_stack(shape, self.device, dtype, args.seed)
        spec = kv_spec(shape, kv_dtype)
        self.sp = None
        if sp_size > 1:
            self.sp = _LocalSequenceParallel(sp_size, cross_mode)
            parallelize(self.model, self.sp)
            heads = shape.heads if cross_mode == "tokens" else shape.heads // sp_size
            spec = am.KVCacheSpec(
                num_layers=spec.num_layers, num_kv_heads=shape.heads // sp_size, num_qo_heads=shape.heads // sp_size,
                head_dim=spec.head_dim, chunk_size=spec.chunk_size, page_size=spec.page_size,
                sink_chunks=spec.sink_chunks, window_chunks=spec.window_chunks, branches=BRANCHES,
                cross_attention=(am.CrossAttentionSpec("text", shape.text_tokens, num_kv_heads=heads),),
                dtype=kv_dtype,
            )
        self.cache = am.KVCache(spec, num_pages=pages_needed(spec, 2), device=self.device)
        self.state = self.cache.open_session("bench")
        g = torch.Generator(device=self.device).manual_seed(args.seed + 1)
        text = torch.randn(2, shape.text_tokens, shape.dim, generator=g, device=self.device, dtype=dtype)
        for i, branch in enumerate(BRANCHES):
            am.populate_cross_attention(self.state, branch, [b.cross for b in self.model.blocks], text[i])
        tokens = shape.chunk // sp_size
        self.x = torch.randn(2, tokens, shape.dim, generator=g, device=self.device, dtype=dtype)
        self.shape = shape
        # --compile: inductor generates (and fuses) the layout copies itself; the word copies are eager-only.
        # dynamic=False: the variants run the same code at other shapes; dynamo would recompile them with
        # dynamic shapes (slower kernels) where one process of a real run compiles one static shape.
        self.fn = torch.compile(self.model, fullgraph=True, dynamic=False) if args.compile else self.model

    def step(self) -> None:
        with self.torch.no_grad():
            for i in range(DENOISING_FORWARDS + 1):
                commit = i == DENOISING_FORWARDS
                with self.state.prepare_forward(BRANCHES, self.shape.chunk, commit) as fwd:
                    self.fn(self.x, fwd.layers)

    def close(self) -> None:
        self.cache.close()


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--shape", choices=("wan-14b", "wan2.1-1.3b", "tiny"), default=None,
                   help="default wan-14b (CUDA), tiny (--device cpu: a dry run of the code paths, not a measurement)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) every variant's stack")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for the JSON and profiles (default: the committed results, "
                        "benchmarks/results/ulysses_rank_<device>.json, ulysses_rank_profile_<variant>_<device>.txt)")
    args = p.parse_args()
    if args.device == "cuda":
        require_gpu(p.prog)
    import torch

    args.shape = args.shape or ("wan-14b" if args.device == "cuda" else "tiny")
    shape = shapes(args.layers, args.layers)[args.shape]
    results: dict[str, Any] = {}
    from unittest import mock

    from ardiff_modules.distributed import ulysses

    variants = (("single", 1, "heads"), ("rank", 2, "heads"), ("rank_tokens", 2, "tokens"),
                ("rank_plain_copies", 2, "heads"))
    if args.compile:  # the word copies are not used under compile: no plain-copies variant
        variants = variants[:3]
    for name, size, cross in variants:
        variant = _Variant(name, shape, args, size, cross)
        plain = mock.patch.object(ulysses, "_words", lambda t: None) if name == "rank_plain_copies" else None
        if plain is not None:
            plain.start()
        for _ in range(shape.sink + shape.window + 2):  # windows full, one eviction
            variant.step()
        stats, _ = each_call(variant.step, args.steps)
        results[name] = {"ms_per_chunk_step": stats.median_ms, "stats": stats.as_dict()}
        if args.profile:
            profile_step(variant, args.out / f"profile_ulysses_{name}.txt" if args.out is not None  # type: ignore[arg-type]
                         else result_path(None, f"ulysses_rank_profile_{name}.txt", device=args.device))
        if plain is not None:
            plain.stop()
        print(f"{args.shape} {name:18s} {stats.median_ms:9.2f} ms/step", flush=True)
        variant.close()
        del variant
        if args.device == "cuda":
            torch.cuda.empty_cache()
    half = results["single"]["ms_per_chunk_step"] / 2
    for name in [v[0] for v in variants[1:]]:
        results[name]["overhead_vs_half_single"] = results[name]["ms_per_chunk_step"] / half
        print(f"{name}: {results[name]['overhead_vs_half_single']:.3f}x half of single "
              f"(an ideal 2-GPU Ulysses speed-up without communication: {2 / results[name]['overhead_vs_half_single']:.2f}x)")
    path = result_path(args.out, "ulysses_rank_compiled.json" if args.compile else "ulysses_rank.json",
                       device=args.device)
    save_json(path, {"config": vars(args) | {"out": str(path.parent)}, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
