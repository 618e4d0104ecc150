"""Multi-GPU streaming: CFG-parallel and Ulysses sequence parallelism on ``torch.distributed``.

Import it explicitly (``import ardiff_modules.distributed``): ``import ardiff_modules`` never imports
``torch.distributed``, and nothing here creates a process group by itself. Typical use, on every rank
(``torchrun --nproc-per-node 4``)::

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from ardiff_modules.distributed import DistributedKVCache, ParallelMesh, parallelize

    dist.init_process_group("nccl")
    device_mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("cfg", "sp"))
    mesh = ParallelMesh(device_mesh, spec.branches)             # cond on row 0, uncond on row 1
    cache = DistributedKVCache(spec, mesh, budget_bytes=..., device="cuda")
    parallelize(model, mesh)                                   # Ulysses hooks on the attention layers
    state = cache.open_session("video-0")
    for branch in mesh.local_branches:
        populate_cross_attention(state, branch, cross_layers, text[branch])
    with cache.prepare_forward(state, seq_len=4680, commit_current=True) as fwd:
        out = model(mesh.scatter(x), fwd.layers)               # this rank's branch, 1/2 of the tokens
    out = mesh.gather(out)                                     # [branches, 4680, dim] on every rank

CUDA graphs (NCCL): prepare with ``static=True`` and run the step through
:class:`DistributedCUDAGraphStep` (every rank captures on the same call, then replays)::

    step = DistributedCUDAGraphStep(model, mesh)
    with cache.prepare_forward(state, seq_len=4680, commit_current=c, static=True) as fwd:
        out = step(fwd, mesh.scatter(x))

Modules: :mod:`.placement` (branch -> cfg rank), :mod:`.heads` (head split, GQA rule), :mod:`.ulysses`
(all-to-alls, functional forms), :mod:`.mesh` (the mesh and per-rank spec), :mod:`.cache` (the voted
forward), :mod:`.digest` (the consistency check), :mod:`.parallelize` (the layer hooks), :mod:`.graphs` (CUDA graphs).
"""

from __future__ import annotations

from ardiff_modules.distributed.cache import DistributedForward, DistributedKVCache
from ardiff_modules.distributed.digest import StateDigest, state_digest
from ardiff_modules.distributed.errors import DistributedForwardError, RankDivergenceError
from ardiff_modules.distributed.graphs import DistributedCUDAGraphStep
from ardiff_modules.distributed.heads import HeadSharding
from ardiff_modules.distributed.mesh import ParallelMesh
from ardiff_modules.distributed.parallelize import parallelize
from ardiff_modules.distributed.placement import place_branches
from ardiff_modules.distributed.ulysses import SequenceParallel, ulysses_chunk_attention, ulysses_cross_attention

__all__ = [
    "DistributedCUDAGraphStep",
    "DistributedForward",
    "DistributedForwardError",
    "DistributedKVCache",
    "HeadSharding",
    "ParallelMesh",
    "RankDivergenceError",
    "SequenceParallel",
    "StateDigest",
    "parallelize",
    "place_branches",
    "state_digest",
    "ulysses_chunk_attention",
    "ulysses_cross_attention",
]
