"""Ulysses sequence parallelism: token shards in, head shards for attention, token shards out.

Each of the ``P`` ranks of a sequence-parallel group holds ``1/P`` of a chunk's tokens (contiguous
blocks: rank ``r`` owns tokens ``[r * n/P, (r + 1) * n/P)``) for everything but attention. Around
attention one all-to-all moves every rank to all ``n`` tokens of ``1/P`` of the heads, and one moves
the output back::

    rank r before:  [S, n/P, H,   D]   (its tokens, every head)        q, k, v after projection + RoPE
          a2a ->    [S, n,   H/P, D]   (every token, its heads)        attention against its pool
          a2a <-    [S, n/P, H,   D]                                   output projection

Each rank's KV pool and cross-attention caches therefore hold only its heads (see
:mod:`~ardiff_modules.distributed.heads` for GQA / MQA). The all-to-alls are
``torch.distributed._functional_collectives``: traceable, so a model compiles with ``fullgraph=True``.
"""

from __future__ import annotations

from typing import Any, Literal, overload

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ardiff_modules.context import LayerContext
from ardiff_modules.cross import CrossReader, cached_cross_attention
from ardiff_modules.distributed.heads import HeadSharding, check_heads, kv_replication
from ardiff_modules.errors import SpecError, TensorMismatchError
from ardiff_modules.modules.functional import chunk_attention

# torch 2.13 renamed the gather (same signature); older torch has only the old name.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


class SequenceParallel:
    """One Ulysses group: its process group, size and this rank's index in it.

    The same object serves every layer (head counts are read from the tensors), and it is what
    :func:`~ardiff_modules.distributed.parallelize` installs as the layers' ``sequence_parallel`` hook.

    Parameters
    ----------
    group:
        The process group of the sequence-parallel ranks (e.g. ``mesh.get_group("sp")``).
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        if not isinstance(group, dist.ProcessGroup):
            raise SpecError(f"SequenceParallel.group: expected a torch.distributed ProcessGroup, got {type(group).__name__}")
        self.group = group
        #: Ranks in the group (the Ulysses degree ``P``).
        self.size: int = dist.get_world_size(group)
        #: This rank's index in the group: it owns token block ``rank`` and head block ``rank``.
        self.rank: int = dist.get_rank(group)

    def __repr__(self) -> str:
        return f"SequenceParallel(size={self.size}, rank={self.rank})"

    def head_sharding(self, num_heads: int, num_kv_heads: int) -> HeadSharding:
        """The heads this rank holds for a layer of ``num_heads`` query / ``num_kv_heads`` kv heads."""
        return HeadSharding(num_heads, num_kv_heads, self.size, self.rank)

    # ------------------------------------------------------------------ tokens
    def shard_tokens(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's contiguous block of ``x`` along ``dim`` (the token dim), ``1/P`` of it."""
        _require_tensor("SequenceParallel.shard_tokens", "x", x)
        if x.shape[dim] % self.size:
            raise TensorMismatchError(
                f"SequenceParallel.shard_tokens x: expected dim {dim} a multiple of the sequence-parallel degree "
                f"{self.size}, got shape {tuple(x.shape)}"
            )
        return x.chunk(self.size, dim=dim)[self.rank]

    def gather_tokens(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """All ranks' blocks of ``x`` concatenated along ``dim`` in rank order (inverse of :meth:`shard_tokens`)."""
        _require_tensor("SequenceParallel.gather_tokens", "x", x)
        if self.size == 1:
            return x
        return _wait(_all_gather(x.contiguous(), dim, self.group))

    def local_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """``positions`` ``[streams, seq_len]`` (a forward's) -> this rank's ``[streams, seq_len / P]``."""
        return self.shard_tokens(positions, dim=1)

    def shard_kv_heads(self, t: torch.Tensor, num_heads: int, dim: int = -2) -> torch.Tensor:
        """This rank's kv heads of ``t`` (heads along ``dim``), e.g. a cross cache ``[tokens, K, D]`` ->
        ``[tokens, K_local, D]``; ``num_heads`` (query heads) decides the GQA rule."""
        _require_tensor("SequenceParallel.shard_kv_heads", "t", t)
        start, stop = self.head_sharding(num_heads, t.shape[dim]).kv_heads_range
        return t.narrow(dim, start, stop - start)

    # ------------------------------------------------------------------ all-to-alls
    def to_head_shards(self, t: torch.Tensor, replicate: int = 1) -> torch.Tensor:
        """``[S, n/P, h, D]`` (this rank's tokens, all heads) -> ``[S, n, h*replicate/P, D]`` (all tokens,
        this rank's heads). ``replicate`` > 1 repeats each head first (kv heads fewer than ranks)."""
        if replicate > 1:
            t = t.repeat_interleave(replicate, dim=2)
        if self.size == 1:
            return t
        s, m, h, d = t.shape
        p = self.size
        # [S, m, P, h/P, D] -> [P, S, m, h/P, D]: dim 0 is what all_to_all_single splits (block j to rank j).
        send = t.reshape(s, m, p, h // p, d).permute(2, 0, 1, 3, 4).contiguous()
        recv = _wait(funcol.all_to_all_single(send, None, None, self.group))
        # recv[j]: rank j's tokens of this rank's heads -> tokens in rank order.
        return recv.permute(1, 0, 2, 3, 4).reshape(s, p * m, h // p, d)

    def to_token_shards(self, t: torch.Tensor) -> torch.Tensor:
        """``[S, n, h/P, D]`` (all tokens, this rank's heads) -> ``[S, n/P, h, D]`` (inverse of
        :meth:`to_head_shards` without replication)."""
        if self.size == 1:
            return t
        s, n, hl, d = t.shape
        p = self.size
        send = t.reshape(s, p, n // p, hl, d).permute(1, 0, 2, 3, 4).contiguous()  # block j: rank j's tokens
        recv = _wait(funcol.all_to_all_single(send, None, None, self.group))
        # recv[j]: this rank's tokens of rank j's heads -> heads in rank order.
        return recv.permute(1, 2, 0, 3, 4).reshape(s, n // p, p * hl, d)

    # ------------------------------------------------------------------ the layers' hook
    def chunk_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerContext, *, scale: float | None = None
    ) -> torch.Tensor:
        """:func:`ulysses_chunk_attention` with this group (what ``ChunkSelfAttention`` calls)."""
        return ulysses_chunk_attention(q, k, v, kv, self, scale=scale)

    def cross_attention(
        self, q: torch.Tensor, kv: CrossReader, cache_name: str, *, scale: float | None = None
    ) -> torch.Tensor:
        """:func:`ulysses_cross_attention` with this group."""
        return ulysses_cross_attention(q, kv, cache_name, self, scale=scale)

    def heads_in(self, q: torch.Tensor) -> torch.Tensor:
        """Query token shards -> head shards (``CachedCrossAttention``'s cached path)."""
        _check_heads_tensor("SequenceParallel.heads_in", "q", q, self.size)
        return self.to_head_shards(q)

    def heads_out(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output head shards -> token shards."""
        return self.to_token_shards(out)


def _wait(t: torch.Tensor) -> torch.Tensor:
    # Eager funcol returns an AsyncCollectiveTensor; wait here so views of it are plain tensors.
    # Under torch.compile the result is a plain tensor and this is a no-op.
    if isinstance(t, funcol.AsyncCollectiveTensor):
        return t.wait()
    return t


def _require_tensor(owner: str, name: str, t: Any) -> None:
    if not isinstance(t, torch.Tensor):
        raise TensorMismatchError(f"{owner} {name}: expected a tensor, got {type(t).__name__}")


def _check_heads_tensor(owner: str, name: str, t: Any, degree: int) -> None:
    _require_tensor(owner, name, t)
    if t.dim() != 4:
        raise TensorMismatchError(
            f"{owner} {name}: expected shape [streams, seq_len / {degree}, heads, head_dim], got {tuple(t.shape)}"
        )


def _check_sequence(owner: str, q: torch.Tensor, kv: Any, sp: SequenceParallel) -> None:
    """This rank's token shard times the degree must be the forward's ``seq_len`` (a shape check: no sync)."""
    positions = getattr(getattr(kv, "forward", None), "positions", None)
    if isinstance(positions, torch.Tensor) and q.shape[1] * sp.size != positions.shape[1]:
        raise TensorMismatchError(
            f"{owner} q: expected this rank's {positions.shape[1] // sp.size} of the forward's {positions.shape[1]} "
            f"tokens (seq_len / {sp.size}) on dim 1, got shape {tuple(q.shape)}"
        )


@overload
def ulysses_chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerContext, sp: SequenceParallel, *,
    scale: float | None = ..., return_lse: Literal[False] = ...,
) -> torch.Tensor: ...


@overload
def ulysses_chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerContext, sp: SequenceParallel, *,
    scale: float | None = ..., return_lse: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor]: ...


def ulysses_chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: LayerContext,
    sp: SequenceParallel,
    *,
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`~ardiff_modules.chunk_attention` over a sequence-parallel group (Ulysses).

    Parameters
    ----------
    q:
        ``[streams, seq_len / P, num_heads, head_dim]``: this rank's tokens, every query head, rotated
        at this rank's positions (``sp.local_positions(kv.positions)``).
    k, v:
        ``[streams, seq_len / P, num_kv_heads, head_dim]``, likewise.
    kv:
        This layer's context from a :class:`~ardiff_modules.distributed.DistributedKVCache` (its pool
        holds this rank's heads).
    sp:
        The group.
    scale, return_lse:
        As in :func:`~ardiff_modules.chunk_attention`.

    Returns
    -------
    ``[streams, seq_len / P, num_heads, head_dim]`` for this rank's tokens (and the float32 LSE
    ``[streams, seq_len / P, num_heads]`` with ``return_lse``).
    """
    owner = "ulysses_chunk_attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_heads_tensor(owner, name, t, sp.size)
    if k.shape[2] != v.shape[2]:
        raise TensorMismatchError(f"{owner} v: expected {k.shape[2]} heads (k's), got shape {tuple(v.shape)}")
    check_heads(owner, q.shape[2], k.shape[2], sp.size)
    _check_sequence(owner, q, kv, sp)
    replicate = kv_replication(k.shape[2], sp.size)
    qh = sp.to_head_shards(q)
    kh, vh = sp.to_head_shards(k, replicate), sp.to_head_shards(v, replicate)
    if not return_lse:
        return sp.to_token_shards(chunk_attention(qh, kh, vh, kv, scale=scale))
    out, lse = chunk_attention(qh, kh, vh, kv, scale=scale, return_lse=True)
    # The LSE moves like a head_dim-1 output: [S, n, H/P] -> [S, n/P, H].
    return sp.to_token_shards(out), sp.to_token_shards(lse.unsqueeze(-1)).squeeze(-1)


def ulysses_cross_attention(
    q: torch.Tensor, kv: CrossReader, cache_name: str, sp: SequenceParallel, *, scale: float | None = None
) -> torch.Tensor:
    """:func:`~ardiff_modules.cached_cross_attention` over a sequence-parallel group.

    ``q`` ``[streams, seq_len / P, num_heads, head_dim]`` (this rank's tokens, every head); the named
    cache holds this rank's kv heads (published through ``populate_cross_attention`` of layers with
    the hook installed, or sharded with :meth:`SequenceParallel.shard_kv_heads`). Returns
    ``[streams, seq_len / P, num_heads, head_dim]``.
    """
    owner = "ulysses_cross_attention"
    _check_heads_tensor(owner, "q", q, sp.size)
    if q.shape[2] % sp.size:
        raise TensorMismatchError(
            f"{owner} q: expected num_heads a multiple of the sequence-parallel degree {sp.size}, got shape "
            f"{tuple(q.shape)}"
        )
    return sp.to_token_shards(cached_cross_attention(sp.to_head_shards(q), kv, cache_name, scale=scale))
