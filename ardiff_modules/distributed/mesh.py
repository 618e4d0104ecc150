"""``ParallelMesh``: a ``DeviceMesh`` read as CFG-parallel x Ulysses, and what each rank holds.

A 2-D mesh ``("cfg", "sp")`` of shape ``(C, P)`` puts the spec's branches on the ``C`` rows (see
:mod:`~ardiff_modules.distributed.placement`) and shards each chunk's tokens (and attention heads)
over the ``P`` ranks of a row::

    8 GPUs, mesh (2, 4) ("cfg", "sp"), branches ("cond", "uncond"):

            sp 0   sp 1   sp 2   sp 3
    cfg 0:  rank0  rank1  rank2  rank3     "cond":   tokens / heads split 4 ways
    cfg 1:  rank4  rank5  rank6  rank7     "uncond": tokens / heads split 4 ways

Either dimension may be absent (CFG-only, SP-only). Each rank builds a local
:class:`~ardiff_modules.KVCacheSpec` (:meth:`ParallelMesh.local_spec`): its row's branches and its
head shard, so it allocates, plans and stores only its own work.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ardiff_modules.core.head_retention import HeadRetention
from ardiff_modules.core.selected_retention import selecting
from ardiff_modules.distributed.errors import RankDivergenceError
from ardiff_modules.distributed.heads import HeadSharding
from ardiff_modules.distributed.placement import place_branches
from ardiff_modules.distributed.ulysses import CrossMode, SequenceParallel, all_gather_shards, wait_collective, check_cross_mode
from ardiff_modules.errors import SpecError, TensorMismatchError
from ardiff_modules.spec import KVCacheSpec

logger = logging.getLogger(__name__)


class Vote(enum.IntEnum):
    """What a host vote is (every rank's row carries it: ranks at different votes can tell, see
    :meth:`ParallelMesh.host_rows`). Non-zero: an all-zero row is no vote."""

    HOST = 1  #: :meth:`ParallelMesh.host_values` / :meth:`ParallelMesh.ranks_where` (the CUDA-graph votes)
    PREPARE = 2  #: ``DistributedKVCache.prepare_forward``, before the local prepare (the arguments)
    PREPARED = 3  #: ``DistributedKVCache.prepare_forward``, after it (the outcome)
    FINISH = 4  #: ``DistributedForward.commit`` / ``abort`` / ``with`` exit

    @property
    def label(self) -> str:
        return {1: "host vote", 2: "prepare vote", 3: "prepare outcome vote", 4: "finish vote"}[int(self)]


#: Words of one rank's row in every host vote: ``(Vote, forward number, digest, value)``.
HOST_WORDS = 4


class ParallelMesh:
    """CFG-parallel and Ulysses dimensions of a ``DeviceMesh``, the branch placement and the groups.

    Collective: every rank of the mesh constructs it, in the same order relative to other group
    creations (it creates one CPU (gloo) group for host-side votes).

    Parameters
    ----------
    mesh:
        A ``DeviceMesh`` whose dimensions are exactly ``cfg_dim`` and/or ``sp_dim`` (e.g.
        ``init_device_mesh("cuda", (2, 2), mesh_dim_names=("cfg", "sp"))``).
    branches:
        The spec's branches, in batch order.
    cfg_dim, sp_dim:
        Mesh dimension names, or ``None`` for no such parallelism.
    placement:
        Optional ``branch -> cfg coordinate``; default: contiguous equal blocks.
    cross_attention:
        How the sp dimension runs cross-attention: ``"heads"`` (default; head shards, each rank's
        cross caches hold its kv heads) or ``"tokens"`` (each rank's own tokens with every head: no
        all-to-all, the cross caches hold every head). See :class:`SequenceParallel`.
    timeout:
        How long a host vote waits for the other ranks before it fails (a rank hung or gone): a positive
        ``timedelta``. Default: the default process group's (``init_process_group(timeout=...)``), not
        torch's 30-minute default for a new gloo group. The ``DeviceMesh``'s own groups (the all-to-alls)
        keep the timeouts they were created with.
    """

    def __init__(
        self,
        mesh: DeviceMesh,
        branches: Sequence[str],
        *,
        cfg_dim: str | None = "cfg",
        sp_dim: str | None = "sp",
        placement: Mapping[str, int] | None = None,
        cross_attention: CrossMode = "heads",
        timeout: timedelta | None = None,
    ) -> None:
        names = _checked_mesh(mesh, branches, cfg_dim, sp_dim, cross_attention, timeout)
        self.mesh = mesh
        self.cfg_dim, self.sp_dim = cfg_dim, sp_dim
        #: How the sp dimension runs cross-attention (``"heads"`` or ``"tokens"``).
        self.cross_attention: CrossMode = cross_attention
        self.branches = tuple(branches)
        #: CFG-parallel size and this rank's coordinate (1 and 0 without a cfg dimension).
        self.cfg_size = mesh.size(names.index(cfg_dim)) if cfg_dim is not None else 1
        self.cfg_rank = mesh.get_local_rank(cfg_dim) if cfg_dim is not None else 0
        self.cfg_group = mesh.get_group(cfg_dim) if cfg_dim is not None else None
        #: Branches of every cfg coordinate, and this rank's.
        self.placement = place_branches(self.branches, self.cfg_size, placement)
        self.local_branches: tuple[str, ...] = self.placement[self.cfg_rank]
        #: The Ulysses group, or ``None`` without (or with a size-1) sp dimension.
        self.sp: SequenceParallel | None = None
        if sp_dim is not None and mesh.size(names.index(sp_dim)) > 1:
            self.sp = SequenceParallel(mesh.get_group(sp_dim), cross_mode=cross_attention)
        #: Global ranks of the mesh, row-major (cfg, sp).
        self.ranks: tuple[int, ...] = tuple(int(r) for r in mesh.mesh.flatten().tolist())
        self.rank = dist.get_rank()
        #: How long a host vote waits for the other ranks (see ``timeout``).
        self.timeout: timedelta = timeout if timeout is not None else default_group_timeout()
        # NOTE: votes and digests are host data: a gloo group keeps them off the accelerator stream
        # (no device sync per forward under NCCL).
        # use_local_synchronization: only this mesh's ranks call new_group (a slice of a larger mesh, e.g. one
        # data-parallel replica's, is built by its own ranks only; the default needs every rank of the world).
        # timeout: new_group's default is torch's constant (30 min for gloo), whatever init_process_group said.
        self.host_group = dist.new_group(
            list(self.ranks), backend="gloo", use_local_synchronization=True, timeout=self.timeout
        )
        # Row index tensors of local_streams / gather, built once per (device, rows): a host-to-device
        # copy inside a CUDA-graph capture is not allowed, and a step replays with the same shapes.
        self._indices: dict[tuple[str, str, int], torch.Tensor] = {}

    @property
    def sp_size(self) -> int:
        return self.sp.size if self.sp is not None else 1

    @property
    def sp_rank(self) -> int:
        return self.sp.rank if self.sp is not None else 0

    def __repr__(self) -> str:
        return (
            f"ParallelMesh(cfg={self.cfg_size}, sp={self.sp_size}, rank={self.rank}, "
            f"local_branches={self.local_branches})"
        )

    def ranks_where(self, flag: bool) -> tuple[int, ...]:
        """The global ranks of the mesh whose ``flag`` is true, ascending: one all-reduce over the host
        (gloo) group -- a collective, every rank calls it (the votes on failures and captures)."""
        return tuple(r for r, v in zip(self.ranks, self.host_values(int(bool(flag)))) if v)

    def host_values(self, value: int) -> tuple[int, ...]:
        """Every rank's ``value`` (a small int), in :attr:`ranks` order: one all-reduce over the host
        (gloo) group -- a collective, every rank calls it. Raises :class:`RankDivergenceError` on every
        rank if some rank was at another vote (e.g. a forward's)."""
        rows = self.host_rows((Vote.HOST, 0, 0, int(value)))
        check_same_vote(self.ranks, rows, "ParallelMesh.host_values")
        return tuple(row[3] for row in rows)

    def host_rows(self, words: Sequence[int]) -> tuple[tuple[int, ...], ...]:
        """Every rank's :data:`HOST_WORDS` int64 ``words`` ``(Vote, forward number, digest, value)``, in
        :attr:`ranks` order: one all-reduce of ``[ranks, HOST_WORDS]`` over the host (gloo) group.

        NOTE: every host vote has this one shape, whatever it decides, so two ranks at different votes
        (one rank interrupted and gone on) still exchange well-formed rows -- each rank's own words, the
        others zero -- and every rank sees that they differ. Raises what the collective raises (a peer
        gone, :attr:`timeout` passed).
        """
        assert len(words) == HOST_WORDS, words
        values = torch.zeros(len(self.ranks), HOST_WORDS, dtype=torch.int64)
        values[self.ranks.index(self.rank)] = torch.tensor([int(w) for w in words], dtype=torch.int64)
        dist.all_reduce(values, group=self.host_group)
        return tuple(tuple(int(v) for v in row) for row in values.tolist())

    def replica_ranks(self) -> tuple[int, ...]:
        """Global ranks holding the same branches as this one (this row of the mesh)."""
        row = self.cfg_rank * self.sp_size
        return self.ranks[row : row + self.sp_size]

    # ------------------------------------------------------------------ the per-rank spec
    def local_spec(self, spec: KVCacheSpec) -> KVCacheSpec:
        """``spec`` for this rank: its branches, ``num_qo_heads / P`` and its kv heads (GQA rule in
        :mod:`~ardiff_modules.distributed.heads`); cross caches with their own kv heads are sharded too,
        unless ``cross_attention="tokens"`` (then every cross cache keeps every kv head)."""
        if not isinstance(spec, KVCacheSpec):
            raise SpecError(f"ParallelMesh.local_spec: expected a KVCacheSpec, got {type(spec).__name__}")
        if spec.branches != self.branches:
            raise SpecError(
                f"ParallelMesh.local_spec: expected a spec with branches {self.branches} (the mesh's), "
                f"got {spec.branches}"
            )
        heads = HeadSharding(spec.query_heads, spec.num_kv_heads, self.sp_size, self.sp_rank)
        if self.sp_size > 1 and spec.head_retention is None and selecting(spec.policy) is not None:
            raise SpecError(  # (a group of head_retention: HeadRetention.restrict refuses it alike)
                f"ParallelMesh.local_spec: expected no content-selected retention split across the {self.sp_size} "
                "sequence-parallel ranks (its score layer's keys of every head choose the pages: a rank holding some "
                f"of them would choose other pages), got retention={spec.policy!r} on a rank holding kv heads "
                f"{list(range(*heads.kv_heads_range))} of {spec.num_kv_heads}"
            )
        if self.cross_attention == "tokens" and self.sp_size > 1:
            # Every head on every rank: pin the global count (the local spec's num_kv_heads is a share).
            cross = tuple(
                dataclasses.replace(c, num_kv_heads=c.num_kv_heads or spec.num_kv_heads) for c in spec.cross_attention
            )
        else:
            cross = tuple(
                c if c.num_kv_heads is None else dataclasses.replace(
                    c, num_kv_heads=HeadSharding(spec.query_heads, c.num_kv_heads, self.sp_size, self.sp_rank).local_kv_heads
                )
                for c in spec.cross_attention
            )
        return dataclasses.replace(
            spec, branches=self.local_branches, num_kv_heads=heads.local_kv_heads, num_qo_heads=heads.local_heads,
            cross_attention=cross, head_retention=self.local_head_retention(spec, self.sp_rank),
        )

    def local_head_retention(self, spec: KVCacheSpec, sp_rank: int) -> HeadRetention | None:
        """The retention groups of the K/V heads sequence-parallel rank ``sp_rank`` holds (``spec``'s map
        restricted to them: :meth:`HeadRetention.restrict`), or ``None`` for a uniform spec."""
        if spec.head_retention is None or self.sp_size == 1:
            return spec.head_retention
        start, stop = HeadSharding(spec.query_heads, spec.num_kv_heads, self.sp_size, sp_rank).kv_heads_range
        return spec.head_retention.restrict(range(start, stop))

    # ------------------------------------------------------------------ model inputs / outputs
    def local_streams(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of this rank's branches: ``x`` ``[sessions * branches, ...]`` (session-major, the spec's
        branch order) -> ``[sessions * local_branches, ...]`` (the local forward's stream order)."""
        rows = self._local_rows("ParallelMesh.local_streams", x)
        return x if rows is None else x.index_select(0, rows)

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[sessions * branches, seq_len, ...]`` -> this rank's ``[sessions * local_branches,
        seq_len / P, ...]``: its branches, its tokens."""
        x = self.local_streams(x)
        return self.sp.shard_tokens(x, dim=1) if self.sp is not None else x

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`scatter`, on every rank: ``[sessions * local_branches, seq_len / P, ...]`` ->
        ``[sessions * branches, seq_len, ...]`` (one all-gather per mesh dimension)."""
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise TensorMismatchError(f"ParallelMesh.gather x: expected [streams, tokens, ...], got {got}")
        if self.sp is not None:
            x = self.sp.gather_tokens(x, dim=1)
        return self._gather_streams("ParallelMesh.gather", x)

    def gather_streams(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`local_streams`, on every rank: ``[sessions * local_branches, ...]`` (whole
        chunks, e.g. a model that gathers its tokens itself) -> ``[sessions * branches, ...]`` in the
        spec's branch order (one all-gather over the cfg dimension; ``x`` itself without one)."""
        if not isinstance(x, torch.Tensor) or x.dim() < 1:
            raise TensorMismatchError(
                f"ParallelMesh.gather_streams x: expected a tensor [streams, ...], got {type(x).__name__}"
            )
        return self._gather_streams("ParallelMesh.gather_streams", x)

    def _gather_streams(self, owner: str, x: torch.Tensor) -> torch.Tensor:
        if self.cfg_group is None or self.cfg_size == 1:
            return x
        local = len(self.local_branches)
        if x.shape[0] % local:
            raise TensorMismatchError(
                f"{owner} x: expected a multiple of {local} local branch rows, got shape {tuple(x.shape)}"
            )
        sessions = x.shape[0] // local
        stacked = wait_collective(all_gather_shards(x.contiguous(), 0, self.cfg_group))  # [cfg * sessions * local]
        return stacked.index_select(0, self._index("gather", sessions, stacked.device))

    def _local_rows(self, owner: str, x: torch.Tensor) -> torch.Tensor | None:
        if not isinstance(x, torch.Tensor) or x.dim() < 1:
            raise TensorMismatchError(f"{owner} x: expected a tensor [sessions * branches, ...], got {type(x).__name__}")
        if self.cfg_size == 1:
            return None
        total = len(self.branches)
        if x.shape[0] % total:
            raise TensorMismatchError(
                f"{owner} x: expected rows a multiple of the {total} branches {self.branches}, got shape "
                f"{tuple(x.shape)}"
            )
        return self._index("local", x.shape[0] // total, x.device)

    def _index(self, kind: str, sessions: int, device: torch.device) -> torch.Tensor:
        """int64 row indices on ``device`` for ``sessions`` sessions, cached (see ``__init__``).

        ``"local"``: this rank's rows of ``[sessions * branches]`` (session-major, spec order).
        ``"gather"``: rows of the all-gathered ``[cfg * sessions * local]`` (row ``(c, s, j)`` is branch
        ``placement[c][j]`` of session ``s``) in session-major spec order.
        """
        key = (kind, str(device), sessions)
        cached = self._indices.get(key)
        if cached is not None:
            return cached
        if kind == "local":
            index = {b: i for i, b in enumerate(self.branches)}
            total = len(self.branches)
            rows = [s * total + index[b] for s in range(sessions) for b in self.local_branches]
        else:
            local = len(self.local_branches)
            where = {b: (c, j) for c, block in enumerate(self.placement) for j, b in enumerate(block)}
            rows = [where[b][0] * sessions * local + s * local + where[b][1]
                    for s in range(sessions) for b in self.branches]
        tensor = torch.tensor(rows, dtype=torch.int64, device=device)
        self._indices[key] = tensor
        return tensor


def check_same_vote(ranks: Sequence[int], rows: Sequence[Sequence[int]], owner: str) -> None:
    """Raise :class:`RankDivergenceError` (the same on every rank: every rank has the same ``rows``) unless
    every rank's row of a host vote is at the same vote: the same :class:`Vote` and forward number."""
    first = (rows[0][0], rows[0][1])
    bad = tuple(r for r, row in zip(ranks, rows) if (row[0], row[1]) != first)
    if not bad:
        return
    where = ", ".join(f"rank {r} at the {_vote_label(row[0])} of forward {row[1]}" for r, row in zip(ranks, rows))
    raise RankDivergenceError(
        f"{owner}: expected every rank at the same host vote, got {where}: a rank skipped or repeated a collective "
        "call (e.g. it caught an exception inside a forward and went on)",
        ranks=bad,
    )


def _vote_label(kind: int) -> str:
    return Vote(kind).label if kind in Vote._value2member_map_ else f"vote {kind}"


def default_group_timeout() -> timedelta:
    """The default process group's timeout (``init_process_group(timeout=...)``).

    NOTE: torch has no public getter; this reads the backend options of the default group (gloo and NCCL
    both keep ``options._timeout``). Where that is missing, torch's default for a gloo group is returned
    and a warning logged: pass ``ParallelMesh(timeout=...)``.
    """
    group = dist.group.WORLD
    for device in getattr(group, "_device_types", ()):
        try:
            options = getattr(group._get_backend(device), "options", None)  # type: ignore[union-attr]
        except RuntimeError:  # no backend for this device type
            continue
        value = getattr(options, "_timeout", None)
        if isinstance(value, timedelta) and value > timedelta(0):
            return value
    fallback = dist.default_pg_timeout
    logger.warning(
        "ParallelMesh: could not read the default process group's timeout; host votes wait %s "
        "(pass ParallelMesh(timeout=...))", fallback,
    )
    return fallback


def _checked_mesh(
    mesh: DeviceMesh, branches: Sequence[str], cfg_dim: str | None, sp_dim: str | None, cross_attention: CrossMode,
    timeout: timedelta | None,
) -> tuple[str, ...]:
    """``ParallelMesh``'s arguments checked before anything is built; returns the mesh's dimension names."""
    if timeout is not None and (not isinstance(timeout, timedelta) or timeout <= timedelta(0)):
        raise SpecError(
            f"ParallelMesh.timeout: expected a positive timedelta (or None: the process group's), got {timeout!r}"
        )
    if not isinstance(mesh, DeviceMesh):
        raise SpecError(f"ParallelMesh.mesh: expected a torch DeviceMesh, got {type(mesh).__name__}")
    if (
        isinstance(branches, str)
        or not isinstance(branches, Sequence)
        or not branches
        or not all(isinstance(b, str) and b for b in branches)
        or len(set(branches)) != len(branches)
    ):
        raise SpecError(
            f"ParallelMesh.branches: expected a sequence of distinct branch names (the spec's), got {branches!r}"
        )
    names = tuple(mesh.mesh_dim_names or ())
    wanted = tuple(d for d in (cfg_dim, sp_dim) if d is not None)
    if len(set(wanted)) != len(wanted):
        raise SpecError(f"ParallelMesh: expected different cfg_dim and sp_dim, got both {cfg_dim!r}")
    if names != wanted:
        # Another dimension (data parallel, ...) would put independent work under one vote; and the
        # rank order below (rows = cfg coordinates) assumes cfg before sp.
        raise SpecError(
            f"ParallelMesh.mesh: expected mesh dimensions named exactly {wanted}, in that order (cfg_dim, "
            f"sp_dim), got {names}"
        )
    layout = mesh.mesh.tolist()
    flat = mesh.mesh.flatten().tolist()
    if flat != sorted(flat):
        # torch orders a group's members by rank: only then is a rank's coordinate its place in its cfg
        # column and in its sp row (which branches it holds, which token block, how gather orders them).
        raise SpecError(
            "ParallelMesh.mesh: expected ranks ascending in row-major (cfg, sp) order, as init_device_mesh "
            f"lays them out, got {layout}"
        )
    check_cross_mode("ParallelMesh.cross_attention", cross_attention)
    return names
