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
``torch.distributed._functional_collectives``: traceable, so a model compiles with ``fullgraph=True``;
nothing between them reads a device value on the host, so a whole step is also CUDA-graph capturable
on NCCL (see :class:`~ardiff_modules.distributed.DistributedCUDAGraphStep`).

Layouts. ``all_to_all_single`` sends contiguous block ``j`` of dim 0 to rank ``j``, so every send
buffer is ``[P, ...]`` with the destination first::

    head shards, q/k/v (and a sink query) fused into one all-to-all (one copy builds the send buffer):
      send  [P, S, n/P, hq/P + 2 hk/P (+ hq/P), D]    block j: every tensor's head block j, my tokens
      recv  [P, S, n/P, ...]                          block j: rank j's tokens, my heads
      q     recv[..., :hq/P, :] -> [S, n, hq/P, D]    token order = rank order (one copy; S == 1: a
                                                      strided view the attention kernel makes dense)
    token shards (the output):
      send  [P, S, n/P, H/P, D]                       a view when S == 1 (no copy)
      recv  [P, S, n/P, H/P, D] -> [S, n/P, H, D]     one copy (heads in rank order)

With one stream per rank (CFG x SP meshes) separate all-to-alls receive q, k and v as contiguous
views, while a fused receive needs a copy per tensor; :attr:`SequenceParallel.fuse_qkv` therefore
fuses when there are several streams (the copies are needed anyway) unless set otherwise.

Cross-attention (``cross_mode=``, ``ParallelMesh(cross_attention=...)``): ``"heads"`` (default) moves the query to head shards and back
(2 all-to-alls per layer) and the caches hold this rank's kv heads (K/V bytes / ``P``); ``"tokens"``
attends this rank's own tokens with every head -- no all-to-all at all, the same FLOPs -- and the
caches hold every head (a prompt's K/V is small: 512 tokens x 5120 x 2 x 2 bytes = 10 MB per layer
and branch at the Wan-14B width).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ardiff_modules.context import LayerContext
from ardiff_modules.cross import CrossReader, cached_cross_attention
from ardiff_modules.distributed.heads import HeadSharding, check_heads, kv_replication
from ardiff_modules.errors import SpecError, TensorMismatchError
from ardiff_modules.modules.functional import chunk_attention

#: How Ulysses splits cross-attention (see :class:`SequenceParallel`).
CrossMode = Literal["heads", "tokens"]
CROSS_MODES: tuple[str, ...] = ("heads", "tokens")


def check_cross_mode(owner: str, mode: Any) -> None:
    if mode not in CROSS_MODES:
        raise SpecError(f"{owner}: expected one of {CROSS_MODES}, got {mode!r}")


# torch 2.13 renamed the gather (same signature); older torch has only the old name.
all_gather_shards = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


class SequenceParallel:
    """One Ulysses group: its process group, size and this rank's index in it.

    The same object serves every layer (head counts are read from the tensors), and it is what
    :func:`~ardiff_modules.distributed.parallelize` installs as the layers' ``sequence_parallel`` hook.

    Parameters
    ----------
    group:
        The process group of the sequence-parallel ranks (e.g. ``mesh.get_group("sp")``).
    fuse_qkv:
        Move q, k, v (and a sink query) to head shards with one all-to-all instead of one each.
        ``None`` (default): fuse when a forward has more than one stream (see the module docstring).
    cross_mode:
        ``"heads"`` (default): cross-attention over head shards, caches hold this rank's kv heads;
        ``"tokens"``: over this rank's tokens with every head, no all-to-all, caches hold every head
        (build the cache's spec with the same choice: ``ParallelMesh(..., cross_attention=...)``).
    """

    def __init__(
        self, group: dist.ProcessGroup, *, fuse_qkv: bool | None = None, cross_mode: CrossMode = "heads"
    ) -> None:
        if not isinstance(group, dist.ProcessGroup):
            raise SpecError(f"SequenceParallel.group: expected a torch.distributed ProcessGroup, got {type(group).__name__}")
        if fuse_qkv is not None and not isinstance(fuse_qkv, bool):
            raise SpecError(f"SequenceParallel.fuse_qkv: expected None or a bool, got {fuse_qkv!r}")
        check_cross_mode("SequenceParallel.cross_mode", cross_mode)
        #: How cross-attention is split: ``"heads"`` or ``"tokens"`` (see the class docstring).
        self.cross_mode: CrossMode = cross_mode
        self.group = group
        #: Ranks in the group (the Ulysses degree ``P``).
        self.size: int = dist.get_world_size(group)
        #: This rank's index in the group: it owns token block ``rank`` and head block ``rank``.
        self.rank: int = dist.get_rank(group)
        self.fuse_qkv = fuse_qkv

    def __repr__(self) -> str:
        return f"SequenceParallel(size={self.size}, rank={self.rank}, cross_mode={self.cross_mode!r})"

    def head_sharding(self, num_heads: int, num_kv_heads: int) -> HeadSharding:
        """The heads this rank holds for a layer of ``num_heads`` query / ``num_kv_heads`` kv heads."""
        return HeadSharding(num_heads, num_kv_heads, self.size, self.rank)

    # ------------------------------------------------------------------ tokens
    def shard_tokens(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's contiguous block of ``x`` along ``dim`` (the token dim), ``1/P`` of it."""
        _require_tensor("SequenceParallel.shard_tokens", "x", x)
        _check_dim("SequenceParallel.shard_tokens", "x", x, dim)
        if x.shape[dim] % self.size:
            raise TensorMismatchError(
                f"SequenceParallel.shard_tokens x: expected dim {dim} a multiple of the sequence-parallel degree "
                f"{self.size}, got shape {tuple(x.shape)}"
            )
        return x.chunk(self.size, dim=dim)[self.rank]

    def gather_tokens(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """All ranks' blocks of ``x`` concatenated along ``dim`` in rank order (inverse of :meth:`shard_tokens`)."""
        _require_tensor("SequenceParallel.gather_tokens", "x", x)
        _check_dim("SequenceParallel.gather_tokens", "x", x, dim)
        if self.size == 1:
            return x
        return wait_collective(all_gather_shards(x.contiguous(), dim, self.group))

    def local_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """``positions`` ``[streams, seq_len]`` (a forward's) -> this rank's ``[streams, seq_len / P]``; per head
        ``[streams, seq_len, heads]`` -> ``[streams, seq_len / P, heads]`` (the heads unchanged: see
        :meth:`local_sink_positions` for a layer's sink positions, whose heads are this rank's)."""
        return self.shard_tokens(positions, dim=1)

    def local_sink_positions(self, kv: LayerContext) -> torch.Tensor | None:
        """Where to rotate this rank's tokens' sink query, for **every** query head of layer ``kv`` (relative
        sinks; else ``None``): the sink query is rotated before the all-to-all, on this rank's tokens.

        A uniform cache: ``local_positions(kv.sink_positions)``, ``[streams, seq_len / P]`` (one shift for every
        head, the same on every rank). With retention groups each rank's layer holds only its heads' lanes (the
        groups restricted to them), whose shifts the other ranks do not know: the layer's ``[streams, seq_len]``
        / per-head ``[streams, seq_len, heads / P]`` positions are gathered over the group (one all-gather of
        int64, collective: every rank calls it for the layer) into ``[streams, seq_len / P, heads]``."""
        positions = kv.sink_positions
        if positions is None or not getattr(kv, "_shares", None) or self.size == 1:
            return None if positions is None else self.local_positions(positions)
        heads = kv._heads[0]  # this rank's query heads of the layer
        if positions.dim() == 2:
            positions = positions.unsqueeze(-1).expand(-1, -1, heads)
        gathered = self.gather_tokens(positions.contiguous(), dim=2)  # [S, n, H]: head blocks in rank order
        return self.shard_tokens(gathered, dim=1)

    def shard_kv_heads(self, t: torch.Tensor, num_heads: int, dim: int = -2) -> torch.Tensor:
        """The kv heads of a cross-attention cache ``t`` (heads along ``dim``) this rank holds: with
        ``cross_mode="heads"`` its share, ``[tokens, K, D]`` -> ``[tokens, K_local, D]`` (``num_heads``,
        the query heads, decides the GQA rule); with ``"tokens"`` all of them (``t`` unchanged)."""
        _require_tensor("SequenceParallel.shard_kv_heads", "t", t)
        _check_dim("SequenceParallel.shard_kv_heads", "t", t, dim)
        if self.cross_mode == "tokens":
            return t
        start, stop = self.head_sharding(num_heads, t.shape[dim]).kv_heads_range
        return t.narrow(dim, start, stop - start)

    # ------------------------------------------------------------------ all-to-alls
    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        """The group's one collective: ``send`` ``[P, ...]`` (contiguous; block ``j`` goes to rank ``j``) ->
        ``[P, ...]`` (block ``j`` came from rank ``j``).

        Every all-to-all of the Ulysses path goes through here (``benchmarks/multi_gpu.py`` times it, or
        replaces it by a local copy of the same size to measure the step without communication).
        """
        if send.requires_grad and torch.is_grad_enabled():
            # Differentiable (cross-attention is, w.r.t. its query); the plain collective has no backward.
            return wait_collective(funcol.all_to_all_single_autograd(send, None, None, self.group))
        return wait_collective(funcol.all_to_all_single(send, None, None, self.group))

    def to_head_shards(self, t: torch.Tensor, replicate: int = 1) -> torch.Tensor:
        """``[S, n/P, h, D]`` (this rank's tokens, all heads) -> ``[S, n, h*replicate/P, D]`` (all tokens,
        this rank's heads). ``replicate`` > 1 repeats each head first (kv heads fewer than ranks)."""
        _check_heads_tensor("SequenceParallel.to_head_shards", "t", t, self.size)
        if (t.shape[2] * replicate) % self.size:
            raise TensorMismatchError(
                f"SequenceParallel.to_head_shards t: expected heads x replicate ({t.shape[2]} x {replicate}) a "
                f"multiple of the sequence-parallel degree {self.size}, got shape {tuple(t.shape)}"
            )
        if replicate > 1:
            t = t.repeat_interleave(replicate, dim=2)
        if self.size == 1:
            return t
        s, m, h, d = t.shape
        p = self.size
        # [S, m, P, h/P, D] -> [P, S, m, h/P, D]: dim 0 is what all_to_all_single splits (block j to rank j).
        send = _dense(t.reshape(s, m, p, h // p, d).permute(2, 0, 1, 3, 4))
        recv = self.all_to_all(send)
        # recv[j]: rank j's tokens of this rank's heads -> tokens in rank order (a view when S == 1).
        return _dense(recv.permute(1, 0, 2, 3, 4)).view(s, p * m, h // p, d)

    def to_head_shards_many(
        self, tensors: Sequence[torch.Tensor], replicate: Sequence[int] | None = None
    ) -> list[torch.Tensor]:
        """:meth:`to_head_shards` of several tensors ``[S, n/P, h_i, D]`` (same ``S``, ``n/P``, ``D`` and
        dtype) with **one** all-to-all when fused (:attr:`fuse_qkv`); returns ``[S, n, h_i*r_i/P, D]`` each.

        The send buffer is built by one ``torch.cat`` of the permuted views (one copy, the same bytes as
        one copy per tensor); the received tensors are slices of one buffer, made dense by the same
        permute copy :meth:`to_head_shards` needs for ``S > 1``.
        """
        reps = [1] * len(tensors) if replicate is None else list(replicate)
        if len(reps) != len(tensors):
            raise TensorMismatchError(
                f"SequenceParallel.to_head_shards_many replicate: expected {len(tensors)} factors, got {len(reps)}"
            )
        if self.size == 1 or not self._fuse(tensors):
            return [self.to_head_shards(t, r) for t, r in zip(tensors, reps)]
        ts = [t.repeat_interleave(r, dim=2) if r > 1 else t for t, r in zip(tensors, reps)]
        s, m, _, d = ts[0].shape
        p = self.size
        # NOTE: cat writes a fresh contiguous [P, S, m, sum h_i/P, D] from the strided views -- the only
        # copy before the collective; .contiguous() is a no-op guard for layouts cat might choose.
        send = _cat([t.reshape(s, m, p, t.shape[2] // p, d).permute(2, 0, 1, 3, 4) for t in ts], dim=3)
        recv = self.all_to_all(send.contiguous())
        out: list[torch.Tensor] = []
        start = 0
        for t in ts:
            local = t.shape[2] // p
            part = recv.narrow(3, start, local)  # [P, S, m, h_i/P, D]: rank j's tokens of my heads
            out.append(_dense(part.permute(1, 0, 2, 3, 4)).view(s, p * m, local, d))
            start += local
        return out

    def _fuse(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``tensors`` go in one all-to-all (see the module docstring for the ``S == 1`` default)."""
        if len(tensors) < 2:
            return False
        first = tensors[0]
        if any(t.dtype != first.dtype or t.device != first.device or t.shape[:2] != first.shape[:2]
               or t.shape[3] != first.shape[3] for t in tensors[1:]):
            return False
        return first.shape[0] > 1 if self.fuse_qkv is None else self.fuse_qkv

    def to_token_shards(self, t: torch.Tensor) -> torch.Tensor:
        """``[S, n, h/P, D]`` (all tokens, this rank's heads) -> ``[S, n/P, h, D]`` (inverse of
        :meth:`to_head_shards` without replication)."""
        _require_tensor("SequenceParallel.to_token_shards", "t", t)
        if t.dim() != 4 or t.shape[1] % self.size:
            raise TensorMismatchError(
                f"SequenceParallel.to_token_shards t: expected shape [streams, seq_len, heads / {self.size}, head_dim] "
                f"with seq_len a multiple of the sequence-parallel degree {self.size}, got {tuple(t.shape)}"
            )
        if self.size == 1:
            return t
        s, n, hl, d = t.shape
        p = self.size
        # Block j: rank j's tokens. A view (no copy) when S == 1: the permute moves a size-1 dim.
        send = _dense(t.reshape(s, p, n // p, hl, d).permute(1, 0, 2, 3, 4))
        recv = self.all_to_all(send)
        # recv[j]: this rank's tokens of rank j's heads -> heads in rank order (one copy).
        return _dense(recv.permute(1, 2, 0, 3, 4)).view(s, n // p, p * hl, d)

    # ------------------------------------------------------------------ the layers' hook
    def chunk_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerContext, *, scale: float | None = None,
        sink_query: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:func:`ulysses_chunk_attention` with this group (what ``ChunkSelfAttention`` calls)."""
        return ulysses_chunk_attention(q, k, v, kv, self, scale=scale, sink_query=sink_query)

    def cross_attention(
        self, q: torch.Tensor, kv: CrossReader, cache_name: str, *, scale: float | None = None
    ) -> torch.Tensor:
        """:func:`ulysses_cross_attention` with this group."""
        return ulysses_cross_attention(q, kv, cache_name, self, scale=scale)

    def heads_in(self, q: torch.Tensor) -> torch.Tensor:
        """Cross-attention query: token shards -> head shards (``CachedCrossAttention``'s cached path);
        unchanged with ``cross_mode="tokens"``."""
        _check_heads_tensor("SequenceParallel.heads_in", "q", q, self.size)
        return q if self.cross_mode == "tokens" else self.to_head_shards(q)

    def heads_out(self, out: torch.Tensor) -> torch.Tensor:
        """Cross-attention output: head shards -> token shards; unchanged with ``cross_mode="tokens"``."""
        return out if self.cross_mode == "tokens" else self.to_token_shards(out)


def _words(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` viewed as 8-byte words along its last dim (bf16: 4 elements per word), or ``None`` where that
    view does not exist, under ``torch.compile`` (whose generated copies are fused already) or where autograd
    records ``t``."""
    ratio = 8 // t.element_size()
    if (
        ratio <= 1 or t.dim() == 0 or torch.compiler.is_compiling() or t.stride(-1) != 1 or t.shape[-1] % ratio
        or (t.requires_grad and torch.is_grad_enabled())  # an int64 view has no autograd: it would detach t
        or t.storage_offset() % ratio or any(st % ratio for st in t.stride()[:-1])  # torch checks every stride
    ):
        return None
    return t.view(torch.int64)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t.contiguous()``, moving 8-byte words where it can.

    NOTE: the layout copies around the all-to-alls are permutes that keep the last dim contiguous; eager
    PyTorch copies a non-contiguous tensor element by element with per-element index math (its
    vectorised copy needs contiguous inputs), so moving words instead of bf16 elements does 4x fewer
    of them. Bit-identical.
    """
    if t.is_contiguous():
        return t
    words = _words(t)
    return t.contiguous() if words is None else words.contiguous().view(t.dtype)


def _cat(tensors: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat(tensors, dim)`` (``dim`` not the last), moving 8-byte words where every input can."""
    words = [_words(t) for t in tensors]
    mixed = any(t.dtype != tensors[0].dtype for t in tensors)  # words of different dtypes would mix bits
    if mixed or any(w is None for w in words) or dim in (-1, tensors[0].dim() - 1):
        return torch.cat(list(tensors), dim=dim)
    return torch.cat(words, dim=dim).view(tensors[0].dtype)  # type: ignore[arg-type]


def wait_collective(t: torch.Tensor) -> torch.Tensor:
    # Eager funcol returns an AsyncCollectiveTensor; wait here so views of it are plain tensors.
    # Under torch.compile the result is a plain tensor and this is a no-op.
    if isinstance(t, funcol.AsyncCollectiveTensor):
        return t.wait()
    return t


def _require_tensor(owner: str, name: str, t: Any) -> None:
    if not isinstance(t, torch.Tensor):
        raise TensorMismatchError(f"{owner} {name}: expected a tensor, got {type(t).__name__}")


def _check_dim(owner: str, name: str, t: torch.Tensor, dim: int) -> None:
    if not -t.dim() <= dim < t.dim():
        raise TensorMismatchError(f"{owner} {name}: expected a tensor with a dim {dim}, got shape {tuple(t.shape)}")


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
    scale: float | None = ..., return_lse: Literal[False] = ..., sink_query: torch.Tensor | None = ...,
) -> torch.Tensor: ...


@overload
def ulysses_chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerContext, sp: SequenceParallel, *,
    scale: float | None = ..., return_lse: Literal[True], sink_query: torch.Tensor | None = ...,
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
    sink_query: torch.Tensor | None = None,
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
    sink_query:
        Optional, like ``q`` (``[streams, seq_len / P, num_heads, head_dim]``, q's dtype): the query
        rotated at the shifted positions of relative-position sinks (this rank's tokens, every query head,
        rotated at ``sp.local_sink_positions(kv)``: per head with retention groups). Moved to head shards with q (in the same
        fused all-to-all) and passed on as ``chunk_attention(..., sink_query=...)``; with ``None`` the
        keyword is not passed at all.

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
    for name, t in (("k", k), ("v", v)):
        if t.shape[:2] != q.shape[:2] or t.shape[3] != q.shape[3]:
            raise TensorMismatchError(
                f"{owner} {name}: expected q's streams, tokens and head_dim ({q.shape[0]}, {q.shape[1]}, heads, "
                f"{q.shape[3]}), got shape {tuple(t.shape)}"
            )
    if sink_query is not None:
        _check_heads_tensor(owner, "sink_query", sink_query, sp.size)
        if sink_query.shape != q.shape or sink_query.dtype != q.dtype:
            raise TensorMismatchError(
                f"{owner} sink_query: expected q's shape {tuple(q.shape)} and dtype {q.dtype}, got "
                f"{tuple(sink_query.shape)} {sink_query.dtype}"
            )
    check_heads(owner, q.shape[2], k.shape[2], sp.size)
    _check_sequence(owner, q, kv, sp)
    replicate = kv_replication(k.shape[2], sp.size)
    tensors, factors = [q, k, v], [1, replicate, replicate]
    if sink_query is not None:
        tensors.append(sink_query)
        factors.append(1)
    moved = sp.to_head_shards_many(tensors, factors)
    qh, kh, vh = moved[:3]
    # NOTE: the keyword only when given, so this works with a chunk_attention that predates it.
    extra: dict[str, Any] = {} if sink_query is None else {"sink_query": moved[3]}
    if not return_lse:
        return sp.to_token_shards(chunk_attention(qh, kh, vh, kv, scale=scale, **extra))
    out, lse = chunk_attention(qh, kh, vh, kv, scale=scale, return_lse=True, **extra)
    # The LSE moves like a head_dim-1 output: [S, n, H/P] -> [S, n/P, H].
    return sp.to_token_shards(out), sp.to_token_shards(lse.unsqueeze(-1)).squeeze(-1)


def ulysses_cross_attention(
    q: torch.Tensor, kv: CrossReader, cache_name: str, sp: SequenceParallel, *, scale: float | None = None
) -> torch.Tensor:
    """:func:`~ardiff_modules.cached_cross_attention` over a sequence-parallel group.

    ``q`` ``[streams, seq_len / P, num_heads, head_dim]`` (this rank's tokens, every head); the named
    cache holds this rank's kv heads (published through ``populate_cross_attention`` of layers with
    the hook installed, or sharded with :meth:`SequenceParallel.shard_kv_heads`), or every head with
    ``sp.cross_mode == "tokens"`` (then no all-to-all). Returns ``[streams, seq_len / P,
    num_heads, head_dim]``.
    """
    owner = "ulysses_cross_attention"
    _check_heads_tensor(owner, "q", q, sp.size)
    if sp.cross_mode == "tokens":
        return cached_cross_attention(q, kv, cache_name, scale=scale)
    if q.shape[2] % sp.size:
        raise TensorMismatchError(
            f"{owner} q: expected num_heads a multiple of the sequence-parallel degree {sp.size}, got shape "
            f"{tuple(q.shape)}"
        )
    return sp.to_token_shards(cached_cross_attention(sp.to_head_shards(q), kv, cache_name, scale=scale))
