"""``parallelize``: install the Ulysses hook on a model's attention layers."""

from __future__ import annotations

from torch import nn

from ardiff_modules.distributed.heads import check_heads
from ardiff_modules.distributed.mesh import ParallelMesh
from ardiff_modules.distributed.ulysses import SequenceParallel
from ardiff_modules.errors import SpecError
from ardiff_modules.modules.cross_attention import CachedCrossAttention
from ardiff_modules.modules.self_attention import ChunkSelfAttention


def parallelize(model: nn.Module, mesh: ParallelMesh | SequenceParallel | None) -> int:
    """Make every :class:`~ardiff_modules.ChunkSelfAttention` / :class:`~ardiff_modules.CachedCrossAttention`
    of ``model`` sequence-parallel over ``mesh``'s sp group (``None`` or no sp dimension: remove the hook).

    Afterwards the layers take this rank's tokens (``[streams, seq_len / P, dim]``, e.g.
    ``mesh.scatter(x)``), attend over head shards and return this rank's tokens. Validates every layer's
    head counts first (:class:`SpecError` naming the layer; nothing changed). Returns the layers changed.
    """
    if isinstance(mesh, ParallelMesh):
        sp = mesh.sp
    elif mesh is None or isinstance(mesh, SequenceParallel):
        sp = mesh
    else:
        raise SpecError(f"parallelize.mesh: expected a ParallelMesh, SequenceParallel or None, got {type(mesh).__name__}")
    if not isinstance(model, nn.Module):
        raise SpecError(f"parallelize.model: expected an nn.Module, got {type(model).__name__}")
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, (ChunkSelfAttention, CachedCrossAttention))]
    if sp is not None:
        for name, layer in layers:
            check_heads(f"parallelize: layer {name or type(layer).__name__!r}", layer.num_heads, layer.num_kv_heads, sp.size)
    for _, layer in layers:
        layer.sequence_parallel = sp
    return len(layers)
