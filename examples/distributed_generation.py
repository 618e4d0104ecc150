"""Streaming video generation over several processes: CFG-parallel and/or Ulysses sequence parallelism.

The Wan2.1-style causal DiT of ``ardiff_modules.models.wan_causal_dit`` (random weights) generates a latent
video chunk by chunk exactly like ``streaming_generation.py`` -- ``--steps`` denoising forwards of both CFG
branches plus one committing forward per chunk, sink + window eviction, an optional prompt switch -- but
every forward runs on a ``DeviceMesh`` of ``torchrun``'s processes::

    torchrun --nproc-per-node 2 examples/distributed_generation.py --mesh sp            # CPU (gloo), Ulysses
    torchrun --nproc-per-node 2 examples/distributed_generation.py --mesh cfg           # CPU, CFG-parallel
    torchrun --nproc-per-node 4 examples/distributed_generation.py --mesh cfg,sp        # CPU, 2 x 2
    torchrun --nproc-per-node 2 examples/distributed_generation.py --device cuda --preset wan2.1-1.3b --check

What changes against one process (the whole diff a model needs):

* ``mesh = ParallelMesh(init_device_mesh(...), branches)``, ``cache = DistributedKVCache(spec, mesh, ...)``
  and ``parallelize(model, mesh)`` (Ulysses hooks on the attention layers);
* each rank publishes the cross-attention caches of its own branches (``mesh.local_branches``);
* a forward is ``cache.prepare_forward(state, seq_len, commit)`` and the model gets this rank's streams
  (``mesh.local_streams``); with Ulysses ``WanCausalDiT`` runs its ``1 / P`` block of tokens through the
  blocks and gathers them before the output head (``WanCausalDiT.sequence_parallel``), so every rank
  returns whole chunks; ``mesh.gather_streams`` collects the branches for the guidance step, which
  every rank then computes identically.

``--check`` also runs the same generation in this process alone (a plain ``KVCache``) and compares the
latents: the two must agree (float32 CPU: rel. error <= 1e-4; bf16 GPU: <= 3e-2); exit status 1 if not.
Rank 0 prints the summary (time per chunk, KV pages and bytes per rank: with Ulysses each rank's pool
holds ``1 / P`` of the heads) and writes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ardiff_modules import KVCache, populate_cross_attention
from ardiff_modules.models.wan_causal_dit import (
    BRANCHES,
    PRESETS,
    WanConfig,
    build_model,
    default_dtype,
    kv_pool_pages,
    make_kv_spec,
)

MESHES = ("sp", "cfg", "cfg,sp")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mesh", choices=MESHES, default="sp",
                   help="sp: Ulysses over every process; cfg: one branch per process (2 processes); cfg,sp: 2 rows "
                        "of world / 2 Ulysses ranks")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--chunks", type=int, default=6)
    p.add_argument("--steps", type=int, default=4, help="denoising forwards per chunk (plus one committing forward)")
    p.add_argument("--cfg-scale", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--switch-at", type=int, default=None, metavar="K", help="switch the prompt before chunk K")
    p.add_argument("--cross-attention", choices=("heads", "tokens"), default="heads",
                   help="Ulysses cross-attention: head shards (default) or each rank's own tokens")
    p.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) the model step")
    p.add_argument("--check", action="store_true", help="also generate in one process and compare the latents")
    p.add_argument("--json", type=Path, default=Path("outputs/distributed_generation.json"))
    args = p.parse_args(argv)
    if args.chunks < 1 or args.steps < 1:
        p.error(f"--chunks / --steps: expected >= 1, got {args.chunks} / {args.steps}")
    return args


def build_mesh(args: argparse.Namespace) -> Any:
    """The ``ParallelMesh`` of ``--mesh`` over every process (collective)."""
    from torch.distributed.device_mesh import init_device_mesh

    from ardiff_modules.distributed import ParallelMesh

    world = dist.get_world_size()
    names = tuple(args.mesh.split(","))
    if names == ("cfg",) and world != len(BRANCHES):
        raise SystemExit(f"--mesh cfg: expected {len(BRANCHES)} processes (one per branch), got {world}")
    if names == ("cfg", "sp") and (world % len(BRANCHES) or world < 2 * len(BRANCHES)):
        raise SystemExit(f"--mesh cfg,sp: expected a multiple of {len(BRANCHES)} processes, at least 4, got {world}")
    shape = (world,) if len(names) == 1 else (len(BRANCHES), world // len(BRANCHES))
    device_mesh = init_device_mesh(args.device, shape, mesh_dim_names=names)
    return ParallelMesh(device_mesh, BRANCHES, cfg_dim="cfg" if "cfg" in names else None,
                        sp_dim="sp" if "sp" in names else None, cross_attention=args.cross_attention)


def generate(args: argparse.Namespace, mesh: Any = None) -> dict[str, Any]:
    """Generate ``args.chunks`` chunks, over ``mesh`` (every rank calls it) or in this process alone (``None``).

    Returns ``{"latents": [chunks * F, C, H, W] float32 CPU, "ms_per_chunk": [...], "pages_used",
    "pool_bytes", "branches"}`` (this rank's pool).
    """
    from ardiff_modules.distributed import DistributedKVCache, parallelize

    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    config = WanConfig.preset(args.preset)
    dtype = default_dtype(device)
    model = build_model(config, seed=args.seed, device=device, dtype=dtype)
    spec = make_kv_spec(config, device)
    if mesh is None:
        cache: Any = KVCache(spec, num_pages=kv_pool_pages(spec), device=device)
        branches = BRANCHES
    else:
        parallelize(model, mesh)  # Ulysses hooks (none for a cfg-only mesh)
        cache = DistributedKVCache(spec, mesh, num_pages=kv_pool_pages(mesh.local_spec(spec)), device=device)
        branches = mesh.local_branches
    # dynamic=False: --check compiles the same code again at the whole model's head count (no dynamic shapes)
    step_fn = torch.compile(model, fullgraph=True, dynamic=False) if args.compile else model
    g = torch.Generator().manual_seed(args.seed + 1)  # the same prompts and noise on every rank
    prompts = [torch.randn(config.text_tokens, config.text_dim, generator=g) for _ in range(2)]
    negative = torch.zeros(config.text_tokens, config.text_dim)
    seq_len, streams = config.chunk_size, len(BRANCHES)
    try:
        state = cache.open_session("stream")

        @torch.no_grad()
        def publish(prompt: torch.Tensor) -> None:
            texts = {"cond": prompt, "uncond": negative}
            for branch in branches:  # this rank's branches only; with Ulysses each layer keeps its heads
                populate_cross_attention(state, branch, [b.cross for b in model.blocks],
                                         model.embed_text(texts[branch].to(device)))

        @torch.no_grad()
        def forward(x: torch.Tensor, t: float, commit: bool) -> torch.Tensor:
            """Both branches' flow predictions ``[2, F, C, H, W]`` (float32), on every rank."""
            xs = x.to(device=device, dtype=dtype).repeat(streams, 1, 1, 1, 1)
            ts = torch.full((streams,), float(t), device=device)
            if mesh is None:
                with state.prepare_forward(BRANCHES, seq_len, commit_current=commit) as fwd:
                    return step_fn(xs, ts, fwd.layers).float()
            with cache.prepare_forward(state, seq_len, commit) as fwd:
                local = step_fn(mesh.local_streams(xs), mesh.local_streams(ts), fwd.layers)
            return mesh.gather_streams(local).float()

        publish(prompts[0])
        timesteps = torch.linspace(1000.0, 0.0, args.steps + 1).tolist()
        noise = torch.Generator().manual_seed(args.seed + 2)
        shape = (1, config.frames_per_chunk, config.in_channels, config.latent_height, config.latent_width)
        frames, ms = [], []
        for k in range(args.chunks):
            if k == args.switch_at:
                state.clear_cross_attention()  # history kept, cross caches replaced
                publish(prompts[1])
            start = time.perf_counter()
            x = torch.randn(shape, generator=noise)
            for t, t_next in zip(timesteps[:-1], timesteps[1:]):
                v = forward(x, t, commit=False).cpu()
                v = v[1:2] + args.cfg_scale * (v[0:1] - v[1:2])  # guidance: identical on every rank
                x = x + (t_next - t) / 1000.0 * v
            forward(x, 0.0, commit=True)  # the clean forward: its K/V become history
            frames.append(x[0])
            ms.append(1e3 * (time.perf_counter() - start))
        stats = cache.stats() if mesh is None else cache.cache.stats()
        return {
            "latents": torch.cat(frames), "ms_per_chunk": ms, "pages_used": stats.pages_used,
            "pool_bytes": stats.pool_bytes, "branches": list(branches),
            "committed_chunks": {b: state.committed_chunks(b) for b in branches},
        }
    finally:
        if mesh is not None:
            parallelize(model, None)
        cache.close()


def run_rank(args: argparse.Namespace) -> dict[str, Any]:
    """Every rank (process group initialised): generate over the mesh, optionally check; rank 0's summary."""
    mesh = build_mesh(args)
    result = generate(args, mesh)
    summary: dict[str, Any] = {
        "mesh": args.mesh, "world": dist.get_world_size(), "preset": args.preset, "device": args.device,
        "chunks": args.chunks, "steps": args.steps, "cross_attention": args.cross_attention,
        "ms_per_chunk_median": sorted(result["ms_per_chunk"])[len(result["ms_per_chunk"]) // 2],
    }
    per_rank: list[Any] = [None] * dist.get_world_size()
    mine = {k: result[k] for k in ("pages_used", "pool_bytes", "branches", "committed_chunks")}
    dist.all_gather_object(per_rank, mine, group=mesh.host_group)
    summary["per_rank"] = per_rank
    if args.check:
        alone = generate(args, None)["latents"]
        err = float((result["latents"] - alone).norm() / alone.norm().clamp_min(1e-12))
        tol = 1e-4 if args.device == "cpu" else 3e-2
        summary.update(rel_error_vs_one_process=err, tolerance=tol, agrees=err <= tol)
    summary["latent_norms"] = [float(f.norm()) for f in result["latents"]]
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("distributed_generation: run under torchrun, e.g. torchrun --nproc-per-node 2 "
              "examples/distributed_generation.py --mesh sp", file=sys.stderr)
        return 2
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=120))
    try:
        summary = run_rank(args)
    finally:
        dist.destroy_process_group()
    if int(os.environ["RANK"]) != 0:
        return 0 if summary.get("agrees", True) else 1
    print(f"mesh {summary['mesh']} over {summary['world']} processes ({args.preset}, {args.device}): "
          f"{args.chunks} chunks, {summary['ms_per_chunk_median']:.1f} ms per chunk (median)")
    for rank, r in enumerate(summary["per_rank"]):
        print(f"  rank {rank}: branches {r['branches']}, {r['pages_used']} KV pages in use, pool "
              f"{r['pool_bytes'] / 2**20:.2f} MiB, committed {r['committed_chunks']}")
    if args.check:
        print(f"check vs one process: rel. error {summary['rel_error_vs_one_process']:.2e} "
              f"(tolerance {summary['tolerance']:.0e}): {'agrees' if summary['agrees'] else 'DIFFERS'}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0 if summary.get("agrees", True) else 1


if __name__ == "__main__":
    raise SystemExit(main())
