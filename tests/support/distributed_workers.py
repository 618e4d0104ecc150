"""Worker functions of the multi-process tests (``tests/distributed/test_multi_process.py``), importable by spawned
children (as ``tests.support.distributed_workers``).

Each ``check_*`` runs on every rank of a gloo (CPU) or NCCL (GPU) group created by :func:`run_worker`
and asserts there; ``torch.multiprocessing.spawn`` re-raises a rank's failure (with its traceback) in the
test and terminates the other ranks. The reference is the single-process library run of the same
model (reference backend), computed on every rank.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import faulthandler
import functools
import inspect
import os
import signal
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import ardiff_modules as am
from ardiff_modules.distributed import (
    DistributedForwardError,
    DistributedKVCache,
    ParallelMesh,
    RankDivergenceError,
    parallelize,
    ulysses_chunk_attention,
)
from ardiff_modules.errors import CapacityError, NonFiniteKVError, SequenceLengthError, TensorMismatchError
from tests.support.failures import default_sigint
from tests.support.paths import EXAMPLES
from tests.support.streaming_model import TinyStreamingModel

BRANCHES = ("cond", "uncond")
CHUNK, PAGE = 8, 4
#: The process group's timeout (``init_process_group``): what a ``ParallelMesh`` without ``timeout=`` votes under.
GROUP_TIMEOUT = timedelta(seconds=60)


def run_worker(
    rank: int, world: int, port: int, backend: str, check: Callable[..., None], args: tuple, dump_after_s: float = 0.0
) -> None:
    """``torch.multiprocessing.spawn`` entry point: join the group, run ``check(*args)``, leave.

    ``dump_after_s`` > 0: a rank still running after that many seconds prints every thread's Python stack
    to stderr (once), so a hung test shows where each rank waits before it is killed.
    """
    if dump_after_s > 0:
        faulthandler.dump_traceback_later(dump_after_s, exit=False)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)  # 2-4 ranks share a 2-core CI machine
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=GROUP_TIMEOUT)
    try:
        check(*args)
    finally:
        dist.destroy_process_group()


def warm_up() -> None:
    """One tiny single-process forward: imports what the custom op's first call imports (torch._functorch,
    sympy, ...), so ranks forked after it start warm."""
    torch.manual_seed(0)
    model = TinyStreamingModel(dim=16, heads=2, kv_heads=2, layers=1, context_dim=4).eval()
    spec = model.spec(CHUNK, PAGE, 1, 1, branches=("cond",))
    with am.KVCache(spec, num_pages=8, backend="reference") as cache, torch.no_grad():
        state = cache.open_session()
        am.populate_cross_attention(state, "cond", [b.cross for b in model.blocks], torch.randn(5, 4))
        with state.prepare_forward(("cond",), CHUNK, commit_current=True) as fwd:
            model(torch.randn(1, CHUNK, 16), fwd.layers)


def _device() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def _gpu() -> bool:
    return _device() == "cuda"


def _tol(cpu: float = 1e-5) -> float:
    """Tolerance vs the single-process run: float32 on the CPU, bf16 (FlashInfer) on the GPU."""
    return 2e-2 if _gpu() else cpu


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    return init_device_mesh(_device(), shape, mesh_dim_names=names)


def _setup(
    shape: tuple[int, ...], names: tuple[str, ...], heads: int, kv_heads: int, *, debug: bool = True,
    check_finite: bool = False, relative_sinks: bool = False, cross: str = "heads", timeout: timedelta | None = None,
    groups: am.HeadRetention | None = None,
) -> tuple[TinyStreamingModel, TinyStreamingModel, am.KVCache, DistributedKVCache, ParallelMesh]:
    """Same weights on every rank: a reference model + cache, and a parallelized copy + distributed cache.

    CPU: float32, the reference backend, head_dim 8. GPU: bf16, FlashInfer, head_dim 64 (a size it builds).
    ``timeout``: the mesh's vote timeout (default: the default process group's).
    """
    device = _device()
    backend, dtype, head_dim = ("flashinfer", "bfloat16", 64) if _gpu() else ("reference", "float32", 8)
    torch.manual_seed(0)
    model = TinyStreamingModel(dim=head_dim * heads, heads=heads, kv_heads=kv_heads, layers=2, context_dim=12).eval()
    tdtype = getattr(torch, dtype)
    model = model.to(device, tdtype)
    spec = dataclasses.replace(model.spec(CHUNK, PAGE, 1, 2, branches=BRANCHES), dtype=dtype, num_qo_heads=heads)
    if relative_sinks:  # the layers then pass a sink query through the Ulysses all-to-all
        spec = dataclasses.replace(spec, relative_sinks=True)
    if groups is not None:  # retention groups: one lane per head part (a Ulysses rank restricts them to its heads)
        spec = dataclasses.replace(spec, sink_chunks=0, window_chunks=None, head_retention=groups)
    reference = am.KVCache(spec, num_pages=96, device=device, backend=backend)
    mesh = ParallelMesh(
        _mesh(shape, names), BRANCHES, cfg_dim="cfg" if "cfg" in names else None,
        sp_dim="sp" if "sp" in names else None, cross_attention=cross,  # type: ignore[arg-type]
        **({} if timeout is None else {"timeout": timeout}),
    )
    cache = DistributedKVCache(
        spec, mesh, num_pages=96, device=device, backend=backend, debug_checks=debug, check_finite=check_finite,
    )
    parallel = copy.deepcopy(model)
    parallelize(parallel, mesh)
    return model, parallel, reference, cache, mesh


def _events(seed: int, dim: int, context_dim: int, steps: int = 7, fixed: bool = False) -> list[tuple]:
    """A Self-Forcing-like schedule over both branches: per step 2 denoising + 1 committing forward of
    1-3 chunks, a prompt switch and a reset (``fixed``: always one chunk)."""
    g = torch.Generator().manual_seed(seed)
    events: list[tuple] = [("prompt", torch.randn(2, 5, context_dim, generator=g))]
    for step in range(steps):
        n = 1 if fixed else (1, 2, 1, 3, 1, 1, 2)[step % 7]
        for denoise in range(3):
            events.append(("forward", torch.randn(2, n * CHUNK, dim, generator=g), denoise == 2))
        if step == 3:
            events.append(("prompt", torch.randn(2, 5, context_dim, generator=g)))
        if step == 5 and not fixed:
            events.append(("reset",))
    return events


class _Reference:
    def __init__(self, model: TinyStreamingModel, cache: am.KVCache) -> None:
        self.model, self.cache, self.state = model, cache, cache.open_session("s0")

    def prompt(self, text: torch.Tensor) -> None:
        self.state.clear_cross_attention()
        for i, b in enumerate(BRANCHES):
            am.populate_cross_attention(self.state, b, [blk.cross for blk in self.model.blocks], text[i])

    def forward(self, x: torch.Tensor, commit: bool) -> torch.Tensor:
        with torch.no_grad(), self.state.prepare_forward(BRANCHES, x.shape[1], commit) as fwd:
            return self.model(x, fwd.layers)

    def reset(self) -> None:
        self.state.reset(keep_cross_attention=("text",))


class _Parallel:
    def __init__(self, model: Any, cache: DistributedKVCache, mesh: ParallelMesh, fn: Any = None) -> None:
        self.model, self.cache, self.mesh = model, cache, mesh
        self.fn = model if fn is None else fn
        self.state = cache.open_session("s0")

    def prompt(self, text: torch.Tensor) -> None:
        self.state.clear_cross_attention()
        for i, b in enumerate(BRANCHES):
            if b in self.mesh.local_branches:  # each rank populates only its branches (its heads)
                am.populate_cross_attention(self.state, b, [blk.cross for blk in self.model.blocks], text[i])

    def forward(self, x: torch.Tensor, commit: bool) -> torch.Tensor:
        with torch.no_grad(), self.cache.prepare_forward(self.state, x.shape[1], commit) as fwd:
            return self.fn(self.mesh.scatter(x), fwd.layers)

    def reset(self) -> None:
        self.state.reset(keep_cross_attention=("text",))


def _play(runners: list[Any], events: list[tuple], device: str, dtype: torch.dtype = torch.float32) -> list[list[torch.Tensor]]:
    outs: list[list[torch.Tensor]] = [[] for _ in runners]
    for event in events:
        for i, runner in enumerate(runners):
            if event[0] == "prompt":
                runner.prompt(event[1].to(device, dtype))
            elif event[0] == "reset":
                runner.reset()
            else:
                outs[i].append(runner.forward(event[1].to(device, dtype), event[2]))
    return outs


def _page_tables(state: am.KVState) -> dict[str, tuple]:
    return {b: (state.history_chunks(b), state.pending_chunks(b), state.token_offset(b)) for b in state.kv_branch_names}


def _check_pages_identical(cache: DistributedKVCache, state: am.KVState) -> None:
    """Exact page ids, compared directly (not through the digest): equal within each mesh row."""
    tables: list[Any] = [None] * dist.get_world_size()
    lanes = tuple((lane.name, lane.layers) for lane in cache.cache._lanes)  # Ulysses ranks' groups may differ
    dist.all_gather_object(tables, ((cache.mesh.cfg_rank, lanes), _page_tables(state)))
    rows: dict[Any, list[Any]] = {}
    for coord, table in tables:
        rows.setdefault(coord, []).append(table)
    for coord, row in rows.items():
        assert all(t == row[0] for t in row), f"cfg row {coord}: page tables differ across its sp ranks: {row}"
    assert len({cfg for cfg, _ in rows}) == cache.mesh.cfg_size


def check_rollout(
    shape: tuple[int, ...], names: tuple[str, ...], heads: int, kv_heads: int, relative_sinks: bool = False,
    cross: str = "heads", groups: am.HeadRetention | None = None,
) -> None:
    """Outputs equal the single-process run; page tables identical across replicas; K/V bytes per rank;
    the all-to-alls per forward. ``relative_sinks``: the layers' sink queries go through the all-to-alls
    too. ``cross="tokens"``: cross-attention over token shards (no all-to-all, every head cached)."""
    if relative_sinks and not _has_relative_sinks():
        return
    model, parallel, reference, cache, mesh = _setup(
        shape, names, heads, kv_heads, relative_sinks=relative_sinks, cross=cross, groups=groups,
    )
    device, tdtype, atol = _device(), reference.dtype, _tol()
    events = _events(1, model.dim, model.context_dim)
    runners = [_Reference(model, reference), _Parallel(parallel, cache, mesh)]
    calls: list[int] = []
    if mesh.sp is not None:
        original = mesh.sp.all_to_all
        mesh.sp.all_to_all = lambda send: (calls.append(1), original(send))[1]  # type: ignore[method-assign]
    try:
        expected, actual = _play(runners, events, device, tdtype)
    finally:
        if mesh.sp is not None:
            del mesh.sp.all_to_all
    assert len(actual) == len(expected) > 10
    if mesh.sp is not None:
        # Per forward and block: q/k/v (+ sink query) in one all-to-all with 2+ local streams, else one each;
        # the output; the cross-attention query and output unless cross="tokens".
        fused = len(mesh.local_branches) > 1
        qkv = 1 if fused else 3 + relative_sinks
        per_block = qkv + 1 + (2 if cross == "heads" else 0)
        assert len(calls) == len(actual) * len(model.blocks) * per_block, (len(calls), len(actual), per_block)
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, mesh.scatter(e), atol=atol, rtol=atol, msg=lambda m, i=i: f"forward {i}: {m}")
        torch.testing.assert_close(mesh.gather(a), e, atol=atol, rtol=atol, msg=lambda m, i=i: f"gather {i}: {m}")
    state = runners[1].state
    assert state.kv_branch_names == mesh.local_branches
    assert state.committed_chunks(mesh.local_branches[0]) == runners[0].state.committed_chunks("cond")
    _check_pages_identical(cache, state)
    cache.check_consistency()
    # Each rank stores its heads only: K/V bytes per page shrink by kv_heads / local kv heads.
    local_kv = cache.spec.num_kv_heads
    if groups is None:
        assert cache.cache._pool.bytes_per_page * kv_heads == reference._pool.bytes_per_page * local_kv
    else:  # every lane holds this rank's heads of its group only
        assert sum(lane.spec.num_kv_heads * len(lane.layers) for lane in cache.cache._lanes) == local_kv * 2
    assert cache.spec.num_qo_heads == heads // mesh.sp_size
    entry = state._cross_entry(mesh.local_branches[0], "text")
    cross_kv = kv_heads if cross == "tokens" or mesh.sp is None else local_kv
    assert entry is not None and entry.k.shape[-2] == cross_kv, (entry.k.shape if entry else None, cross_kv)


#: Two layers of 2 kv heads: on a 2-way Ulysses mesh rank 0 holds lanes l (layer 0) and g (layer 1), rank 1 one
#: lane g over both layers (group g lands on both ranks: a lane on each).
GROUPS = am.HeadRetention({"l": (0, 1), "g": (1, 2)}, [["l", "g"], ["g", "g"]])


def check_groups() -> None:
    """Retention groups: a CFG-parallel cache (whole caches per rank) and a Ulysses cache (each rank the groups
    of its heads) equal the single-process grouped cache; a failed vote settles every lane."""
    check_rollout((2,), ("cfg",), 4, 2, groups=GROUPS)
    check_rollout((2,), ("sp",), 4, 2, groups=GROUPS)
    mesh = ParallelMesh(_mesh((2,), ("sp",)), BRANCHES, cfg_dim=None, sp_dim="sp")
    spec = am.KVCacheSpec(num_layers=2, num_kv_heads=2, num_qo_heads=4, head_dim=8, chunk_size=CHUNK, page_size=PAGE,
                          branches=BRANCHES, head_retention=GROUPS)
    local = mesh.local_spec(spec).head_retention
    assert local is not None
    assert local.layers == ((("l",), ("g",)) if mesh.sp_rank == 0 else (("g",), ("g",))), local.layers
    check_failures((2,), ("sp",), 0, groups=GROUPS)
    # Per-layer groups: both Ulysses ranks hold the same two lanes, whose page tables must stay identical
    # (a failed vote settles the second lane's free queue too).
    per_layer = am.HeadRetention({"l": (0, 1), "g": (1, 2)}, [["l", "l"], ["g", "g"]])
    check_failures((2,), ("sp",), 1, groups=per_layer)
    check_vote_undo(per_layer)


def check_relative_sink_groups() -> None:
    """Retention groups with relative sinks: each rank rotates its tokens' sink query for every query head at the
    layer's sink positions (under Ulysses the other ranks' lanes' shifts gathered over the group) -- CFG-parallel
    and Ulysses rollouts of ``ChunkSelfAttention`` layers and of a stock diffusers Wan model equal the
    single-process grouped cache; the forward-level sink positions refuse, each layer's are given."""
    check_rollout((2,), ("cfg",), 4, 2, relative_sinks=True, groups=GROUPS)
    check_rollout((2,), ("sp",), 4, 2, relative_sinks=True, groups=GROUPS)
    check_diffusers((2,), ("sp",), relative_sinks=True, groups=GROUPS)
    check_diffusers((2,), ("cfg",), relative_sinks=True, groups=GROUPS)
    model, parallel, _, cache, mesh = _setup((2,), ("sp",), 4, 2, relative_sinks=True, groups=GROUPS)
    runner = _Parallel(parallel, cache, mesh)
    runner.prompt(torch.randn(2, 5, model.context_dim))
    for _ in range(4):
        runner.forward(torch.randn(2, CHUNK, model.dim), True)
    with cache.prepare_forward(runner.state, CHUNK, False) as fwd:  # chunk 4: g's window slid, l has no sinks
        try:
            fwd.local_sink_positions  # noqa: B018
            raise AssertionError("expected a SpecError")
        except am.SpecError as e:
            assert "layer_sink_positions" in str(e), e
        per_head = fwd.layer_sink_positions(0)  # collective: the ranks' heads gathered
        one_lane = fwd.layer_sink_positions(1)
        fwd.abort()
    half = CHUNK // 2
    mine = torch.arange(4 * CHUNK, 5 * CHUNK)[mesh.sp_rank * half : (mesh.sp_rank + 1) * half]
    assert per_head.shape == (2, half, 4), per_head.shape  # cond and uncond: both on every sp rank
    assert per_head[:, :, :2].tolist() == [[[int(p)] * 2 for p in mine]] * 2  # l (heads 0, 1): natural
    assert per_head[:, :, 2:].tolist() == [[[int(p) - 8] * 2 for p in mine]] * 2  # g (1 + 2): shift 16 - 8
    assert one_lane.tolist() == [[[int(p) - 8] * 4 for p in mine]] * 2  # layer 1: g on both ranks, gathered alike


def _has_relative_sinks() -> bool:
    return "relative_sinks" in {f.name for f in dataclasses.fields(am.KVCacheSpec)}


def _whole_state(cache: DistributedKVCache) -> Any:
    """Every session's page tables, pending pages and extents of this rank, its free-page queue, every page's
    refcount, the allocator's peak, and its kept forward contexts in recency order."""
    sessions = {
        sid: {b: (st.history_chunks(b), st.pending_chunks(b), st.token_offset(b), tuple(st.branch_pages(b).extent))
              for b in st.kv_branch_names}
        for sid, st in sorted(cache.cache.sessions.items())
    }
    contexts = tuple((ctx.streams, ctx.status) for ctx in cache.cache._forwards.contexts())
    allocator = cache.cache._allocator
    refcounts = tuple(allocator.refcount(p) for p in range(allocator.num_pages))
    return sessions, tuple(allocator.free_pages()), refcounts, allocator.peak_used, contexts


def _check_same_state_everywhere(cache: DistributedKVCache, what: str) -> None:
    """Direct comparison (an sp-only mesh: every rank holds the same branches), then the digest check."""
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, _whole_state(cache))
    assert all(s == states[0] for s in states), f"{what}: ranks differ: {states}"
    cache.check_consistency()


def _prepare_failing_on(cache: DistributedKVCache, bad: int, *args: Any, **kwargs: Any) -> None:
    """``cache.prepare_forward(*args, **kwargs)`` with the local prepare failing on rank ``bad`` only."""
    me = dist.get_rank()
    original = cache.cache._forwards.prepare  # what the distributed prepare calls (holding the reservation)
    if me == bad:
        def failing(*a: Any, **k: Any) -> None:
            raise CapacityError("injected on one rank", needed=4, free=0)

        cache.cache._forwards.prepare = failing  # type: ignore[method-assign]
    try:
        cache.prepare_forward(*args, **kwargs)
    except (CapacityError, DistributedForwardError) as e:
        assert isinstance(e, CapacityError if me == bad else DistributedForwardError), e
    else:
        raise AssertionError("expected the prepare to fail on every rank")
    finally:
        cache.cache._forwards.prepare = original  # type: ignore[method-assign]


def check_vote_undo(groups: am.HeadRetention | None = None) -> None:
    """A prepare that fails on one rank leaves every rank in the same state even when the ranks that prepared
    had superseded a kept forward spanning another session, or reserved a contiguous extent; a superseded
    forward handle finishes nothing (not the later forward of its context)."""
    model, parallel, _, cache, mesh = _setup((2,), ("sp",), 4, 2, debug=False, groups=groups)
    device, dtype = _device(), cache.cache.dtype
    text = torch.randn(2, 5, model.context_dim, generator=torch.Generator().manual_seed(3)).to(device, dtype)

    def opened(cache: DistributedKVCache, sid: str) -> am.KVState:
        state = cache.open_session(sid)
        for i, branch in enumerate(BRANCHES):
            am.populate_cross_attention(state, branch, [b.cross for b in parallel.blocks], text[i])
        return state

    x = torch.randn(4, CHUNK, model.dim, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    s1, s2 = opened(cache, "s1"), opened(cache, "s2")
    # 1. A kept denoising forward over [s1, s2]; the next prepare over s1 alone fails on rank 1. Rank 0 had
    #    superseded the kept forward (s2's pending pages kept), rank 1 aborts it whole: s2 must match too.
    with torch.no_grad(), cache.prepare_forward(s2, CHUNK, commit_current=False) as other:  # an idle context
        parallel(mesh.scatter(x[2:]), other.layers)
    with torch.no_grad():
        kept = cache.prepare_forward([s1, s2], CHUNK, commit_current=False)
        parallel(mesh.scatter(x), kept.layers)
    _prepare_failing_on(cache, 1, s1, CHUNK, commit_current=True)
    _check_same_state_everywhere(cache, "after a failed prepare superseding a kept forward")
    assert s2.pending_chunks("cond") == (), "the kept forward's other session kept its pending pages"
    # 2. A superseded handle: committing or aborting it finishes nothing (not the later forward).
    with torch.no_grad():
        first = cache.prepare_forward(s1, CHUNK, commit_current=False)
        parallel(mesh.scatter(x[:2]), first.layers)
        with cache.prepare_forward(s1, CHUNK, commit_current=True) as second:
            first.commit()
            first.abort()
            assert second.context._transaction.is_open and s1.committed_chunks("cond") == 0
            parallel(mesh.scatter(x[:2]), second.layers)
            # A rank's share committed alone (issue 41): refused on every rank, nothing changed, still open.
            for alone in (second.context.commit, lambda: s1.commit_paged_context("cond")):
                try:
                    alone()
                except am.ParticipantCommitError as e:
                    assert "expected DistributedForward" in str(e), e
                else:
                    raise AssertionError("expected a commit of one rank's share alone to be refused")
            assert second.context._transaction.is_open and s1.committed_chunks("cond") == 0
    assert s1.committed_chunks("cond") == 1
    _check_same_state_everywhere(cache, "after finishing a superseded handle")
    # Misuse: specific errors (a bad sessions argument is voted like any failure: no rank hangs).
    from ardiff_modules.errors import SpecError

    for call, error, message in (
        (lambda: cache.prepare_forward(5, CHUNK), SpecError, "expected one or more sessions"),
        (lambda: mesh.scatter(torch.zeros(4)), TensorMismatchError, "with a dim 1"),
        (lambda: ParallelMesh(mesh.mesh, "condu", cfg_dim=None), SpecError, "distinct branch names"),
        (lambda: ParallelMesh(mesh.mesh, ("cond", "cond"), cfg_dim=None), SpecError, "distinct branch names"),
        (lambda: ParallelMesh(DeviceMesh("cpu", [1, 0], mesh_dim_names=("sp",)), BRANCHES, cfg_dim=None),
         SpecError, "ascending"),
    ):
        try:
            call()
        except error as e:
            assert message in str(e), e
        else:
            raise AssertionError(f"expected {error.__name__} ({message})")
    # A bad argument on one rank only: refused there, voted, aborted on the others.
    me = dist.get_rank()
    try:
        cache.prepare_forward(5 if me == 1 else s1, CHUNK, commit_current=True)
    except (SpecError, DistributedForwardError) as e:
        assert isinstance(e, SpecError if me == 1 else DistributedForwardError), e
    else:
        raise AssertionError("expected the prepare to fail on every rank")
    _check_same_state_everywhere(cache, "after misuse")
    cache.close()

    # 3. Contiguous extents: a session's first prepare fails on rank 1; rank 0 had reserved its extent.
    extents = DistributedKVCache(
        cache.global_spec, mesh, num_pages=96, device=device, backend="flashinfer" if _gpu() else "reference",
        contiguous_extents=True,
    )
    s3, s4 = opened(extents, "s3"), opened(extents, "s4")
    _prepare_failing_on(extents, 1, s3, CHUNK, commit_current=True)
    _check_same_state_everywhere(extents, "after a failed first prepare with contiguous extents")
    with torch.no_grad(), extents.prepare_forward(s4, CHUNK, commit_current=True) as fwd:
        parallel(mesh.scatter(x[:2]), fwd.layers)
    _check_same_state_everywhere(extents, "after the next session's forward")
    extents.close()


def check_autograd() -> None:
    """Under autograd the Ulysses path behaves like one process: cross-attention is differentiable w.r.t. its
    query (the summed gradients of the ranks equal one process's), and so is self-attention w.r.t. q, k, v
    (the 8-byte-word copies must not detach them)."""
    from ardiff_modules import CachedCrossAttention, CrossAttentionSpec, KVCacheSpec

    torch.manual_seed(0)
    layer = CachedCrossAttention(32, 4, "text", context_dim=12)
    spec = KVCacheSpec(
        num_layers=1, num_kv_heads=4, head_dim=8, chunk_size=CHUNK, page_size=PAGE, sink_chunks=1, window_chunks=1,
        branches=("cond",), cross_attention=(CrossAttentionSpec("text", 5),), dtype="float32",
    )
    x, text = torch.randn(1, CHUNK, 32), torch.randn(5, 12)
    with am.KVCache(spec, num_pages=16, backend="reference") as one:
        state = one.open_session("s")
        am.populate_cross_attention(state, "cond", [layer], text)
        # a denoising forward: only cross-attention runs (a commit needs every layer's self-attention write)
        with state.prepare_forward(("cond",), CHUNK, commit_current=False) as fwd:
            layer(x, fwd.layers[0]).sum().backward()
    expected = layer.to_q.weight.grad.clone()
    layer.zero_grad(set_to_none=True)
    mesh = ParallelMesh(init_device_mesh("cpu", (2,), mesh_dim_names=("sp",)), ("cond",), cfg_dim=None)
    parallelize(layer, mesh)
    cache = DistributedKVCache(spec, mesh, num_pages=16, backend="reference")
    state = cache.open_session("s")
    am.populate_cross_attention(state, "cond", [layer], text)
    with cache.prepare_forward(state, CHUNK, False) as fwd:
        layer(mesh.scatter(x), fwd.layers[0]).sum().backward()
    grad = layer.to_q.weight.grad
    assert grad is not None, "the query projection got no gradient under Ulysses"
    dist.all_reduce(grad)
    torch.testing.assert_close(grad, expected, atol=1e-5, rtol=1e-5)

    # Self-attention trains too (issue 27): the all-to-alls are differentiable, the summed gradients equal one
    # process's over the whole chunk (no history here: the earlier forward did not commit).
    w = torch.randn(8, 8, requires_grad=True)
    x0 = torch.randn(1, CHUNK // 2, 4, 8)  # the same on both ranks: the chunk is [x0 ; x0]
    q = x0 @ w
    with cache.prepare_forward(state, CHUNK, False) as fwd:
        ulysses_chunk_attention(q, q, q, fwd.layers[0], mesh.sp).sum().backward()
    grad = w.grad.clone()
    dist.all_reduce(grad)
    w_ref = w.detach().clone().requires_grad_()
    full = (torch.cat([x0, x0], dim=1) @ w_ref).transpose(1, 2)
    torch.nn.functional.scaled_dot_product_attention(full, full, full).sum().backward()
    torch.testing.assert_close(grad, w_ref.grad, atol=1e-5, rtol=1e-5)
    cache.close()


def check_submesh() -> None:
    """A ParallelMesh over one slice of a larger mesh (one data-parallel replica of a ("dp", "sp") mesh): each
    replica's host group is built by its own ranks only, and votes stay within the replica."""
    full = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    mesh = ParallelMesh(full["sp"], BRANCHES, cfg_dim=None)
    me = dist.get_rank()
    for bad in range(4):
        failed = mesh.ranks_where(me == bad)
        assert failed == ((bad,) if bad in mesh.ranks else ()), (me, bad, failed, mesh.ranks)


def check_failures(
    shape: tuple[int, ...], names: tuple[str, ...], bad: int, groups: am.HeadRetention | None = None
) -> None:
    """A failure on rank ``bad`` (in the forward, in prepare, NaN K/V, explicit abort) aborts on every rank."""
    model, parallel, reference, cache, mesh = _setup(shape, names, 4, 2, check_finite=True, groups=groups)
    device = _device()
    events = _events(2, model.dim, model.context_dim, steps=4, fixed=True)
    ref, par = _Reference(model, reference), _Parallel(parallel, cache, mesh)
    dtype = reference.dtype
    _play([ref, par], events[:7], device, dtype)  # prompt + 2 committed chunks
    me = dist.get_rank()
    state = par.state
    before = _page_tables(state)
    x = events[1][1].to(device, dtype)

    # 1. An exception inside the `with` block after the model ran, on one rank only.
    try:
        with torch.no_grad(), cache.prepare_forward(state, CHUNK, commit_current=True) as fwd:
            parallel(mesh.scatter(x), fwd.layers)
            if me == bad:
                raise RuntimeError("injected failure")
    except RuntimeError as e:
        if me == bad:
            assert str(e) == "injected failure", e
        else:
            assert isinstance(e, DistributedForwardError) and e.failed_ranks == (bad,), e
    else:
        raise AssertionError("expected the forward to fail on every rank")
    assert _page_tables(state) == before, "history changed by an aborted forward"

    # 2. prepare fails on one rank (out of pages): every rank raises before its model runs.
    _prepare_failing_on(cache, bad, state, CHUNK, commit_current=True)
    assert _page_tables(state) == before

    # 3. NaN/Inf K/V on one rank only (CFG: its own branch; SP: a2a spreads it) -> aborted everywhere.
    poisoned = mesh.scatter(x).clone()
    if me == bad:
        poisoned[:, 0, 0] = float("nan")
    try:
        with torch.no_grad(), cache.prepare_forward(state, CHUNK, commit_current=True) as fwd:
            parallel(poisoned, fwd.layers)
    except (NonFiniteKVError, DistributedForwardError) as e:
        assert isinstance(e, NonFiniteKVError) or e.failed_ranks, e
    else:
        raise AssertionError("expected the NaN forward to abort on every rank")
    assert _page_tables(state) == before

    # 4. An explicit abort, voted: no rank raises.
    with torch.no_grad():
        fwd = cache.prepare_forward(state, CHUNK, commit_current=True)
        parallel(mesh.scatter(x), fwd.layers)
        fwd.abort()
    assert _page_tables(state) == before
    cache.check_consistency()

    # 5. A misuse on every rank (a seq_len that is no page multiple): nothing was prepared anywhere, so
    #    nothing is aborted -- a kept denoising forward stays as it was on every rank.
    with torch.no_grad():
        kept = cache.prepare_forward(state, CHUNK, commit_current=False)
        parallel(mesh.scatter(x), kept.layers)
    pending = {b: state.branch_pages(b).pending for b in mesh.local_branches}
    try:
        cache.prepare_forward(state, CHUNK + 1, commit_current=True)
    except SequenceLengthError:
        pass
    else:
        raise AssertionError("expected a SequenceLengthError on every rank")
    assert {b: state.branch_pages(b).pending for b in mesh.local_branches} == pending, "a failed misuse changed state"
    assert kept.context.is_active, "the kept denoising forward was aborted by a misuse every rank refused"
    kept.abort()
    assert _page_tables(state) == before

    # 6. One rank aborts while the others commit, with debug_checks: every rank reaches the (collective)
    #    consistency check, none is left waiting in it.
    cache.debug_checks = True
    try:
        with torch.no_grad():
            fwd = cache.prepare_forward(state, CHUNK, commit_current=True)
            parallel(mesh.scatter(x), fwd.layers)
        if me == bad:
            fwd.abort()
        else:
            try:
                fwd.commit()
            except DistributedForwardError as e:
                assert e.failed_ranks == (bad,), e
            else:
                raise AssertionError("expected the commit to be voted down")
    finally:
        cache.debug_checks = False
    assert _page_tables(state) == before

    # After all that, the rollout goes on exactly as the reference that never saw those forwards.
    expected, actual = _play([ref, par], events[7:], device, dtype)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, mesh.scatter(e), atol=_tol(), rtol=_tol())
    _check_pages_identical(cache, state)


def _group_timeout(group: Any) -> timedelta:
    """The timeout a gloo group was created with (torch has no public getter)."""
    return group._get_backend(torch.device("cpu")).options._timeout


def check_vote_timeout() -> None:
    """The mesh's vote group waits as long as the process group (``init_process_group(timeout=...)``), or as
    ``ParallelMesh(timeout=...)`` says -- not torch's 30-minute default for a new gloo group."""
    from ardiff_modules.errors import SpecError

    device_mesh = _mesh((2,), ("sp",))
    mesh = ParallelMesh(device_mesh, BRANCHES, cfg_dim=None)
    assert mesh.timeout == GROUP_TIMEOUT and _group_timeout(mesh.host_group) == GROUP_TIMEOUT, mesh.timeout
    explicit = ParallelMesh(device_mesh, BRANCHES, cfg_dim=None, timeout=timedelta(seconds=7))
    assert explicit.timeout == timedelta(seconds=7) == _group_timeout(explicit.host_group), explicit.timeout
    for bad in (7, timedelta(0), timedelta(seconds=-1)):
        try:
            ParallelMesh(device_mesh, BRANCHES, cfg_dim=None, timeout=bad)  # type: ignore[arg-type]
        except SpecError as e:
            assert "ParallelMesh.timeout: expected a positive timedelta" in str(e), e
        else:
            raise AssertionError(f"expected a SpecError for timeout={bad!r}")


def check_peer_lost(mode: str, timeout_s: float) -> None:
    """Rank 1 is lost inside a committing forward that both ranks prepared and ran: ``"kill"`` SIGKILLs it (its
    sockets close, rank 0's commit vote fails at once), ``"hang"`` leaves it alive and silent (rank 0's vote waits
    the mesh's ``timeout``; the test kills rank 1 once rank 0 is done). On rank 0 the commit at ``with`` exit
    raises DistributedForwardError chained from the collective's error, within the timeout; no forward is left
    open, the session and the pool are as before the forward, and a new (local) forward works."""
    timeout = timedelta(seconds=timeout_s)
    model, parallel, _, cache, mesh = _setup((2,), ("cfg",), 4, 2, debug=False, timeout=timeout)
    assert mesh.timeout == timeout
    device, dtype = _device(), cache.cache.dtype
    me = dist.get_rank()
    par = _Parallel(parallel, cache, mesh)
    events = _events(7, model.dim, model.context_dim, steps=1, fixed=True)
    _play([par], events, device, dtype)  # a prompt and one committed chunk, on both ranks
    state, branch = par.state, mesh.local_branches[0]
    before, used = _whole_state(cache)[:2], cache.cache._allocator.num_used
    x = mesh.scatter(events[1][1].to(device, dtype))
    start = time.monotonic()
    try:
        with torch.no_grad(), cache.prepare_forward(state, CHUNK, commit_current=True) as fwd:
            parallel(x, fwd.layers)  # CFG-only: the model runs no collective
            assert state.pending_chunks(branch) and cache.cache._allocator.num_used > used
            if me == 1:
                if mode == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(600)  # hung: never votes (the test kills this rank)
            start = time.monotonic()
    except DistributedForwardError as e:
        elapsed = time.monotonic() - start
        assert isinstance(e.__cause__, RuntimeError) and e.failed_ranks == (), repr(e.__cause__)
        assert f"timeout {timeout_s:g} s" in str(e), e
    else:
        raise AssertionError("expected the commit vote to fail on the survivor")
    if mode == "kill":
        assert elapsed < 5.0, f"the survivor took {elapsed:.1f} s to see its peer's death"
    else:
        assert 0.5 * timeout_s <= elapsed <= timeout_s + 5.0, f"waited {elapsed:.1f} s, timeout {timeout_s} s"
    # No open forward, the pool and the session as before the forward.
    assert state._open_forward(branch) is None and not fwd.context.is_active
    assert _whole_state(cache)[:2] == before and cache.cache._allocator.num_used == used
    fwd.abort()  # finished already: no collective (the group is dead)
    # A new forward of this rank's streams works (locally: the mesh cannot vote any more).
    with torch.no_grad(), state.prepare_forward(mesh.local_branches, CHUNK, commit_current=True) as local:
        parallel(x, local.layers)
    assert state.committed_chunks(branch) == 2 and state._open_forward(branch) is None
    cache.close()
    assert cache.cache._allocator.num_used == 0


def check_out_of_step() -> None:
    """Ranks at different votes, or preparing with different arguments, are refused at the vote on every rank
    (RankDivergenceError) before anything commits, and nothing changes:

    1. rank 1 swallows a KeyboardInterrupt inside a committing forward (aborted there, without a vote) and
       prepares its next forward: that prepare vote meets rank 0's commit vote; neither rank commits, page
       usage is equal, history as before, and the ranks are back in step (the rollout goes on as a reference
       that never saw that forward);
    2. a different ``seq_len``, ``commit_current``, session ids or session order on rank 1: refused at prepare
       on both ranks; a kept denoising forward stays open, nothing else changes either.
    """
    model, parallel, reference, cache, mesh = _setup((2,), ("sp",), 4, 2, debug=False)
    device, dtype = _device(), cache.cache.dtype
    me = dist.get_rank()
    events = _events(8, model.dim, model.context_dim, steps=3, fixed=True)
    ref, par = _Reference(model, reference), _Parallel(parallel, cache, mesh)
    _play([ref, par], events[:4], device, dtype)  # a prompt and one committed chunk
    state = par.state
    x = events[1][1].to(device, dtype)
    before = _whole_state(cache)[:2]

    # 1. A swallowed KeyboardInterrupt on rank 1.
    try:
        with torch.no_grad(), cache.prepare_forward(state, CHUNK, commit_current=True) as fwd:
            parallel(mesh.scatter(x), fwd.layers)  # both ranks ran the model (its all-to-alls)
            if me == 1:
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        assert me == 1
        assert _whole_state(cache)[:2] == before, "the interrupted forward was not aborted locally"
        try:
            cache.prepare_forward(state, CHUNK, commit_current=True)  # rank 1 goes on
        except RankDivergenceError as e:
            assert e.ranks == (1,) and "rank 0 at the finish vote of forward" in str(e), e
        else:
            raise AssertionError("rank 1: expected its next prepare to be refused")
    except RankDivergenceError as e:
        assert me == 0 and e.ranks == (1,), e
        assert "rank 1 at the prepare vote of forward" in str(e), e
    else:
        raise AssertionError(f"rank {me}: expected the commit vote to meet rank 1's next prepare vote")
    assert state.committed_chunks(mesh.local_branches[0]) == 1, "a rank committed"
    assert _whole_state(cache)[:2] == before
    _check_same_state_everywhere(cache, "after a swallowed KeyboardInterrupt")
    expected, actual = _play([ref, par], events[4:7], device, dtype)  # back in step
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, mesh.scatter(e), atol=_tol(), rtol=_tol())

    # 2. Different arguments on rank 1, with a kept denoising forward open.
    other = cache.open_session("s1")
    for i, b in enumerate(BRANCHES):
        am.populate_cross_attention(other, b, [blk.cross for blk in parallel.blocks], events[0][1][i].to(device, dtype))
    with torch.no_grad():
        kept = cache.prepare_forward(state, CHUNK, commit_current=False)
        parallel(mesh.scatter(x), kept.layers)
    before = _whole_state(cache)
    for what, mine, theirs in (
        ("seq_len", (state, CHUNK, True), (state, 2 * CHUNK, True)),
        ("commit_current", (state, CHUNK, True), (state, CHUNK, False)),
        ("session ids", (state, CHUNK, True), (other, CHUNK, True)),
        ("session order", ([state, other], CHUNK, True), ([other, state], CHUNK, True)),
    ):
        try:
            cache.prepare_forward(*(theirs if me == 1 else mine))
        except RankDivergenceError as e:
            assert e.ranks == (1,) and "with the same arguments" in str(e), (what, e)
        else:
            raise AssertionError(f"rank {me}: expected different {what} to be refused at prepare")
        assert _whole_state(cache) == before, f"different {what}: the refused prepare changed state"
        assert kept.context.is_active, f"different {what}: the kept denoising forward was closed"
    _check_same_state_everywhere(cache, "after prepares with different arguments")
    kept.abort()
    expected, actual = _play([ref, par], events[7:], device, dtype)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, mesh.scatter(e), atol=_tol(), rtol=_tol())
    _check_pages_identical(cache, state)
    cache.close()


def check_ctrl_c_in_the_finish_vote() -> None:
    """Rank 1 gets a Ctrl-C while it waits in the finish vote for rank 0 (gloo's all-reduce returns only once
    rank 0 voted too, so rank 0 commits): rank 1 must commit as well, then raise its KeyboardInterrupt --
    aborting there instead left the ranks a chunk apart, silently (the next forwards' numbers still agree)."""
    import threading

    from tests.support.kv_writes import write_every_layer

    mesh = ParallelMesh(_mesh((2,), ("cfg",)), ("cond", "uncond"), cfg_dim="cfg", sp_dim=None)
    spec = am.KVCacheSpec(
        num_layers=2, num_kv_heads=2, head_dim=8, chunk_size=CHUNK, page_size=PAGE, sink_chunks=1, window_chunks=2,
        branches=("cond", "uncond"), dtype="float32",
    )
    cache = DistributedKVCache(spec, mesh, num_pages=64, backend="reference")
    state = cache.open_session("ctrl-c")
    me, branch = dist.get_rank(), mesh.local_branches[0]
    interrupted = False
    try:
        # A rank inherits the suite's SIGINT disposition: ignored when pytest runs in the background / nohup.
        with default_sigint(), cache.prepare_forward(state, CHUNK, commit_current=True) as fwd:
            write_every_layer(fwd.layers)
            if me == 0:
                time.sleep(1.5)  # rank 1 reaches the finish vote first and waits there
            else:
                threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    except KeyboardInterrupt:
        interrupted = True
    assert interrupted == (me == 1), f"rank {me}: interrupted={interrupted}"
    assert state.committed_chunks(branch) == 1, f"rank {me}: {state.committed_chunks(branch)} chunks committed"
    with cache.prepare_forward(state, CHUNK, commit_current=True) as fwd:
        write_every_layer(fwd.layers)
    assert state.committed_chunks(branch) == 2
    cache.close()


def check_votes() -> None:
    check_vote_timeout()
    check_out_of_step()
    check_ctrl_c_in_the_finish_vote()


def check_functional(sp_size: int, heads: int, kv_heads: int) -> None:
    """``ulysses_chunk_attention`` (with LSE) equals ``chunk_attention`` of one process, per rank's tokens,
    with one and two streams and q/k/v fused into one all-to-all or not; a ``sink_query`` is moved to head
    shards like ``q`` and passed on only when given."""
    for branches in (("main",), ("main", "alt")):
        mesh = ParallelMesh(_mesh((sp_size,), ("sp",)), branches, cfg_dim=None, sp_dim="sp")
        for fuse in (None, True, False):
            _check_functional_once(mesh, branches, heads, kv_heads, fuse)
        _check_sink_query(mesh, branches, heads, kv_heads)


def _functional_spec(branches: tuple[str, ...], heads: int, kv_heads: int) -> am.KVCacheSpec:
    return am.KVCacheSpec(num_layers=1, num_kv_heads=kv_heads, num_qo_heads=heads, head_dim=8, chunk_size=CHUNK,
                          page_size=PAGE, sink_chunks=1, window_chunks=1, branches=branches, dtype="float32")


def _check_functional_once(
    mesh: ParallelMesh, branches: tuple[str, ...], heads: int, kv_heads: int, fuse: bool | None
) -> None:
    device, sp = _device(), mesh.sp
    assert sp is not None
    sp.fuse_qkv = fuse
    spec = _functional_spec(branches, heads, kv_heads)
    reference = am.KVCache(spec, num_pages=64, device=device, backend="reference")
    cache = DistributedKVCache(spec, mesh, num_pages=64, device=device, backend="reference")
    ref_state, state = reference.open_session("s"), cache.open_session("s")
    g = torch.Generator().manual_seed(3)
    calls: list[int] = []
    original = sp.all_to_all
    sp.all_to_all = lambda send: (calls.append(1), original(send))[1]  # type: ignore[method-assign]
    recording = _recording_chunk_attention()
    seen, _ = recording.__enter__()
    try:
        for step in range(4):
            s = len(branches)
            q = torch.randn(s, CHUNK, heads, 8, generator=g).to(device)
            k, v = (torch.randn(s, CHUNK, kv_heads, 8, generator=g).to(device) for _ in range(2))
            with ref_state.prepare_forward(branches, CHUNK, commit_current=True) as fwd:
                out, lse = am.chunk_attention(q, k, v, fwd.layers[0], return_lse=True)
            calls.clear()
            with cache.prepare_forward(state, CHUNK, commit_current=True) as dfwd:
                shard = [sp.shard_tokens(t) for t in (q, k, v)]
                local_out, local_lse = ulysses_chunk_attention(*shard, dfwd.layers[0], sp, return_lse=True)
            msg = f"{len(branches)} stream(s), fuse_qkv={fuse}, step {step}"
            torch.testing.assert_close(local_out, sp.shard_tokens(out), atol=1e-5, rtol=1e-5,
                                       msg=lambda m, msg=msg: f"{msg}: {m}")
            torch.testing.assert_close(local_lse, sp.shard_tokens(lse), atol=1e-5, rtol=1e-5,
                                       msg=lambda m, msg=msg: f"{msg}: {m}")
            fused = fuse if fuse is not None else len(branches) > 1
            # q, k, v in one all-to-all when fused (else three), then the output and the LSE.
            assert len(calls) == (1 if fused else 3) + 2, f"{msg}: {len(calls)} all-to-alls"
            assert "sink_query" not in seen[-1], f"{msg}: sink_query=None must not be passed on"
            assert step < 1 or dfwd.positions.shape == (len(branches), CHUNK)
    finally:
        recording.__exit__(None, None, None)
        del sp.all_to_all
        sp.fuse_qkv = None
        cache.close()
        reference.close()


@contextlib.contextmanager
def _recording_chunk_attention() -> Iterator[tuple[list[dict[str, Any]], bool]]:
    """Patch the ``chunk_attention`` the Ulysses path calls with one that records its keywords; yields
    (the keywords of each call, whether the real one takes ``sink_query``). Where it does not yet, a
    given ``sink_query`` is recorded and dropped."""
    from ardiff_modules.distributed import ulysses

    real = ulysses.chunk_attention
    supported = "sink_query" in inspect.signature(real).parameters and "relative_sinks" in {
        f.name for f in dataclasses.fields(am.KVCacheSpec)
    }
    seen: list[dict[str, Any]] = []

    def recording(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: Any, **kwargs: Any) -> Any:
        seen.append(dict(kwargs))
        if not supported:
            kwargs.pop("sink_query", None)
        return real(q, k, v, kv, **kwargs)

    ulysses.chunk_attention = recording  # type: ignore[assignment]
    try:
        yield seen, supported
    finally:
        ulysses.chunk_attention = real  # type: ignore[assignment]


def _check_sink_query(mesh: ParallelMesh, branches: tuple[str, ...], heads: int, kv_heads: int) -> None:
    """Relative sinks through Ulysses: the sink query reaches ``chunk_attention`` as this rank's heads of
    every token (in the fused all-to-all when fused), the output equals the single process's, and
    ``local_sink_positions`` is this rank's block of the forward's ``sink_positions``."""
    device, sp = _device(), mesh.sp
    assert sp is not None
    g = torch.Generator().manual_seed(5)
    start, stop = sp.head_sharding(heads, kv_heads).heads_range
    with _recording_chunk_attention() as (seen, supported):
        extra = {"relative_sinks": True} if supported else {}
        spec = dataclasses.replace(_functional_spec(branches, heads, kv_heads), **extra)
        reference = am.KVCache(spec, num_pages=64, device=device, backend="reference")
        cache = DistributedKVCache(spec, mesh, num_pages=64, device=device, backend="reference")
        ref_state, state = reference.open_session("s"), cache.open_session("s")
        try:
            for step in range(5):  # sink 1 + window 1: the sinks move from step 2 on
                s = len(branches)
                q, sink = (torch.randn(s, CHUNK, heads, 8, generator=g).to(device) for _ in range(2))
                k, v = (torch.randn(s, CHUNK, kv_heads, 8, generator=g).to(device) for _ in range(2))
                with cache.prepare_forward(state, CHUNK, commit_current=True) as dfwd:
                    seen.clear()
                    local = [sp.shard_tokens(t) for t in (q, k, v)]
                    out = ulysses_chunk_attention(*local, dfwd.layers[0], sp, sink_query=sp.shard_tokens(sink))
                    torch.testing.assert_close(seen[-1]["sink_query"], sink[:, :, start:stop], atol=0, rtol=0)
                    if supported:
                        full = dfwd.context.sink_positions
                        assert full is not None and full.shape == (s, CHUNK)
                        assert torch.equal(dfwd.local_sink_positions, sp.shard_tokens(full))
                    else:
                        assert dfwd.local_sink_positions is None
                with ref_state.prepare_forward(branches, CHUNK, commit_current=True) as fwd:
                    kwargs = {"sink_query": sink} if supported else {}
                    expected = am.chunk_attention(q, k, v, fwd.layers[0], **kwargs)
                torch.testing.assert_close(out, sp.shard_tokens(expected), atol=1e-5, rtol=1e-5,
                                           msg=lambda m, step=step: f"relative sinks, step {step}: {m}")
            try:
                with cache.prepare_forward(state, CHUNK, commit_current=True) as dfwd:
                    ulysses_chunk_attention(*local, dfwd.layers[0], sp, sink_query=local[0][:, :, :1])
            except TensorMismatchError as e:
                assert "sink_query: expected q's shape" in str(e), e
            else:
                raise AssertionError("expected a TensorMismatchError for a sink_query unlike q")
        finally:
            cache.close()
            reference.close()


def _raises_on_every_rank(call: Callable[[], Any], own: type[Exception], own_text: str, peer_text: str) -> None:
    """``call()`` fails on rank 1 (with ``own`` containing ``own_text``) and, through the vote, raises on rank 0
    too: a ``DistributedForwardError`` naming rank 1 and containing ``peer_text``."""
    me = dist.get_rank()
    try:
        call()
    except DistributedForwardError as e:
        assert me == 0 and e.failed_ranks == (1,) and peer_text in str(e), e
    except own as e:
        assert me == 1 and own_text in str(e), e
    else:
        raise AssertionError(f"expected the failure on rank 1 to raise on every rank (rank {me} did not)")


def check_graph_votes() -> None:
    """The capture vote: every rank capturing (or replaying) passes, a split raises on every rank before any
    collective; a dynamic forward is refused. (Capture itself needs CUDA: the ``gpu`` tests.)"""
    from ardiff_modules.distributed import DistributedCUDAGraphStep
    from ardiff_modules.errors import SpecError
    from ardiff_modules.graphs import _Captured

    model, parallel, _, cache, mesh = _setup((2,), ("sp",), 4, 2, debug=False)
    step = DistributedCUDAGraphStep(parallel, mesh)
    me = dist.get_rank()
    x = torch.zeros(2, CHUNK // 2, model.dim)
    state = cache.open_session("s0")
    with torch.no_grad(), cache.prepare_forward(state, CHUNK, commit_current=False) as fwd:
        ctx = fwd.context
        assert step.will_capture(fwd) and not fwd.static

        def graph_on(ranks: tuple[int, ...], inputs: torch.Tensor = x) -> None:
            """A stand-in graph of ``ctx`` on ``ranks`` (what the capture vote and the replay checks read)."""
            step.step.discard(ctx)
            if me in ranks:
                step.step._captured[ctx] = _Captured(None, [inputs.clone()], x, (ctx._plan_epoch,), frozenset())

        # The per-call vote: capture if any rank must (its plan was rebuilt), else replay everywhere.
        assert step._decide(ctx, (x,)) is True  # no graph anywhere
        graph_on((0,))
        assert step._decide(ctx, (x,)) is True  # rank 1 must capture: rank 0 recaptures too
        graph_on((0, 1))
        assert step._decide(ctx, (x,)) is False
        # A rank that cannot replay (inputs not as captured) raises there, the others before any collective.
        graph_on((0, 1), x if me == 0 else torch.zeros(2, CHUNK, model.dim))
        _raises_on_every_rank(lambda: step._decide(ctx, (x,)), TensorMismatchError, "as captured", "cannot")
        # Warm-up / capture are all or nothing: a failure on rank 1 raises its own error there and a
        # DistributedForwardError naming it on rank 0, and no rank keeps a graph of ctx.
        ran = []
        step._all_or_none("capture", lambda: ran.append(1), ctx)
        assert ran == [1]

        def fail_on_rank_1() -> None:
            if me == 1:
                raise ValueError("capture failed here")

        graph_on((0, 1))
        _raises_on_every_rank(lambda: step._all_or_none("capture", fail_on_rank_1, ctx), ValueError,
                              "capture failed here", "expected every rank to capture")
        assert step.num_graphs == 0 and step.will_capture(fwd)
        try:
            step(fwd, x)
        except SpecError as e:
            assert "static=True" in str(e), e
        else:
            raise AssertionError("expected a SpecError for a dynamic forward")
    # Leaving a ``with step:`` block frees the graphs at once (before destroy_process_group, pytorch#115388).
    resets = []
    with step:
        step.step._captured[ctx] = _Captured(type("G", (), {"reset": lambda self: resets.append(1)})(), [x], x,
                                             (ctx._plan_epoch,), frozenset())
    assert resets == [1] and step.num_graphs == 0
    for bad in ({"warmup_iters": 0}, {"verify": 1}):
        try:
            DistributedCUDAGraphStep(parallel, mesh, **bad)  # type: ignore[arg-type]
        except SpecError:
            pass
        else:
            raise AssertionError(f"expected a SpecError for {bad}")


def check_compiled(shape: tuple[int, ...], names: tuple[str, ...], backend: str = "eager") -> None:
    """fullgraph=True with functional collectives: equal to the eager single-process run, one frame."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model, parallel, reference, cache, mesh = _setup(shape, names, 4, 2, debug=False)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(parallel, backend=counter, fullgraph=True)
    events = _events(4, model.dim, model.context_dim, steps=6, fixed=True)
    ref, par = _Reference(model, reference), _Parallel(parallel, cache, mesh, fn=compiled)
    dtype, tol = reference.dtype, _tol(1e-4)
    expected, actual = _play([ref, par], events, _device(), dtype)
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, mesh.scatter(e), atol=tol, rtol=tol, msg=lambda m, i=i: f"forward {i}: {m}")
    # An aborted forward and a reset do not recompile either.
    with torch.no_grad():
        fwd = cache.prepare_forward(par.state, CHUNK, commit_current=True)
        compiled(mesh.scatter(events[1][1].to(_device(), dtype)), fwd.layers)
        fwd.abort()
    par.reset()
    _play([par], events[1:4], _device(), dtype)
    assert counter.frame_count == 1, f"expected one compiled frame, got {counter.frame_count}"
    _check_pages_identical(cache, par.state)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def check_graph_rollout(shape: tuple[int, ...], names: tuple[str, ...], relative_sinks: bool = False) -> None:
    """NCCL + FlashInfer: a whole parallelized step (model and output all-gather) captured once per static
    forward context and replayed over a rollout of committing and denoising forwards with a prompt switch
    equals the eager distributed run and the single-GPU run; page tables identical across ranks."""
    from ardiff_modules.distributed import DistributedCUDAGraphStep

    if relative_sinks and not _has_relative_sinks():
        return
    model, parallel, reference, cache, mesh = _setup(shape, names, 4, 2, relative_sinks=relative_sinks)
    graph_cache = DistributedKVCache(
        cache.global_spec, mesh, num_pages=96, device="cuda", backend="flashinfer", debug_checks=True,
    )

    def whole_step(x: torch.Tensor, layers: list) -> torch.Tensor:  # this rank's tokens in, every token out
        return mesh.gather(parallel(x, layers))

    with DistributedCUDAGraphStep(whole_step, mesh) as step:  # graphs freed before destroy_process_group
        _graph_rollout(step, model, parallel, reference, cache, graph_cache, mesh, whole_step)
    assert step.num_graphs == 0
    graph_cache.close()


def _graph_rollout(
    step: Any, model: TinyStreamingModel, parallel: torch.nn.Module, reference: Any, cache: DistributedKVCache,
    graph_cache: DistributedKVCache, mesh: ParallelMesh, whole_step: Callable[..., torch.Tensor],
) -> None:
    """check_graph_rollout's body: the graphed rollout against the eager one and the single GPU."""
    class _Graphed(_Parallel):
        captures = replays = 0

        def forward(self, x: torch.Tensor, commit: bool) -> torch.Tensor:
            with torch.no_grad(), self.cache.prepare_forward(self.state, x.shape[1], commit, static=True) as fwd:
                assert fwd.static
                if step.will_capture(fwd):
                    self.captures += 1
                else:
                    self.replays += 1
                return step(fwd, self.mesh.scatter(x))

    events = _events(6, model.dim, model.context_dim, steps=7, fixed=True)
    ref, eager = _Reference(model, reference), _Parallel(parallel, cache, mesh, fn=whole_step)
    graphed = _Graphed(parallel, graph_cache, mesh)
    expected, eager_out, graph_out = _play([ref, eager, graphed], events, "cuda", reference.dtype)
    assert len(graph_out) == len(expected) == 21
    assert graphed.captures >= 1 and graphed.replays >= len(graph_out) - 3, (graphed.captures, graphed.replays)
    for i, (g, a, e) in enumerate(zip(graph_out, eager_out, expected)):
        assert g.shape == e.shape, (g.shape, e.shape)
        assert _rel(g, a) < 3e-2, f"forward {i}: graph vs eager distributed, rel err {_rel(g, a):.2e}"
        torch.testing.assert_close(g, e, atol=_tol(), rtol=_tol(), msg=lambda m, i=i: f"forward {i} vs single GPU: {m}")
    _check_pages_identical(graph_cache, graphed.state)
    for b in mesh.local_branches:
        assert graphed.state.committed_chunks(b) == eager.state.committed_chunks(b) == ref.state.committed_chunks(b)
    graph_cache.check_consistency()
    # An aborted forward between replays changes nothing; the next step replays and still agrees.
    with torch.no_grad():
        fwd = graph_cache.prepare_forward(graphed.state, CHUNK, commit_current=True, static=True)
        step(fwd, mesh.scatter(events[1][1].to("cuda", reference.dtype)))
        fwd.abort()
    tail = [("forward", torch.randn(2, CHUNK, model.dim, generator=torch.Generator().manual_seed(9)), c)
            for c in (False, True)]
    expected, graph_out = _play([ref, graphed], tail, "cuda", reference.dtype)
    for g, e in zip(graph_out, expected):
        torch.testing.assert_close(g, e, atol=_tol(), rtol=_tol())
    _check_pages_identical(graph_cache, graphed.state)


def check_example(meshes: tuple[str, ...]) -> None:
    """``examples/distributed_generation.py`` on this group for each ``--mesh``: the latents generated over the
    mesh equal the same generation in one process (``--check``, with a prompt switch), and every rank
    generated the same video."""
    import sys

    sys.path.insert(0, str(EXAMPLES))
    import distributed_generation as example

    for mesh in meshes:
        args = example.parse_args(["--mesh", mesh, "--chunks", "5", "--steps", "2", "--switch-at", "3", "--check",
                                   "--device", _device()])
        summary = example.run_rank(args)
        assert summary["agrees"], (mesh, summary["rel_error_vs_one_process"])
        norms = [None] * dist.get_world_size()
        dist.all_gather_object(norms, summary["latent_norms"])
        assert all(n == norms[0] for n in norms), (mesh, norms)
        per_rank = summary["per_rank"]
        assert all(r["committed_chunks"] == dict.fromkeys(r["branches"], 5) for r in per_rank), per_rank
    _check_example_model_per_frame_timesteps(example)


def _check_example_model_per_frame_timesteps(example: Any) -> None:
    """``WanCausalDiT`` under Ulysses with a different timestep per frame (diffusion forcing): each rank's
    block of tokens is modulated by its own tokens' frames (a rank block straddles frames), as in one process."""
    from ardiff_modules.distributed import DistributedKVCache, parallelize

    w = example  # the example module imported ardiff_modules.models.wan_causal_dit
    config = w.WanConfig.preset("tiny")
    mesh = example.build_mesh(example.parse_args(["--mesh", "sp", "--device", _device()]))
    device = torch.device(_device(), torch.cuda.current_device()) if _gpu() else torch.device("cpu")
    model = w.build_model(config, seed=3, device=device)
    spec = w.make_kv_spec(config, device)
    g = torch.Generator().manual_seed(4)
    text = model.embed_text(torch.randn(config.text_tokens, config.text_dim, generator=g).to(device))
    shape = (2, config.frames_per_chunk, config.in_channels, config.latent_height, config.latent_width)
    x = torch.randn(shape, generator=g).to(device, model.patch_embedding.weight.dtype)
    t = torch.tensor([[900.0, 500.0, 100.0], [800.0, 400.0, 0.0]], device=device)[:, : config.frames_per_chunk]
    outs = []
    with torch.no_grad():
        for parallel in (False, True):
            if parallel:
                parallelize(model, mesh)
                cache: Any = DistributedKVCache(spec, mesh, num_pages=w.kv_pool_pages(mesh.local_spec(spec)), device=device)
            else:
                cache = am.KVCache(spec, num_pages=w.kv_pool_pages(spec), device=device)
            state = cache.open_session("s")
            for branch in w.BRANCHES:
                am.populate_cross_attention(state, branch, [b.cross for b in model.blocks], text)
            for commit in (True, False):  # a history chunk, then a chunk attending to it
                if parallel:
                    with cache.prepare_forward(state, config.chunk_size, commit) as fwd:
                        out = model(x, t, fwd.layers)
                else:
                    with state.prepare_forward(w.BRANCHES, config.chunk_size, commit_current=commit) as fwd:
                        out = model(x, t, fwd.layers)
            outs.append(out)
            parallelize(model, None)
            cache.close()
    torch.testing.assert_close(outs[1], outs[0], atol=_tol(1e-5), rtol=_tol(1e-5))


def _call_paged(paged: Any, x: torch.Tensor, t: torch.Tensor, fwd: Any) -> torch.Tensor:
    return paged(x, t, fwd)


def check_diffusers(
    shape: tuple[int, ...], names: tuple[str, ...], cross: str = "heads", relative_sinks: bool = False,
    compiled: bool = False, i2v_fused: bool = False, groups: am.HeadRetention | None = None,
) -> None:
    """A stock diffusers ``WanTransformer3DModel`` made paged for a ``DistributedKVCache``: a rollout with commits,
    denoising forwards, per-token timesteps (Wan2.2 TI2V) on chunks whose rank blocks straddle frames, and a
    prompt switch equals the same model made paged for one process's ``KVCache``. ``compiled``: the distributed
    step runs through ``torch.compile(fullgraph=True)`` (dynamo over the block hooks and the all-to-alls), one
    frame per timestep layout. ``i2v_fused``: an I2V model (image cache beside the text cache) with diffusers'
    fused projections."""
    import importlib.util

    if importlib.util.find_spec("diffusers") is None:  # an optional extra: the single-process tests skip too
        return
    from ardiff_modules.integrations.diffusers import enable_paged_attention, wan_cache_spec
    from tests.support.diffusers_wan import TEXT_DIM, tiny_wan

    mesh = ParallelMesh(_mesh(shape, names), BRANCHES, cfg_dim="cfg" if "cfg" in names else None,
                        sp_dim="sp" if "sp" in names else None, cross_attention=cross)
    model = tiny_wan(2, seed=3, **({"image_dim": 8, "added_kv_proj_dim": 32} if i2v_fused else {}))
    if i2v_fused:
        model.fuse_qkv_projections()
    frames, latent = 3, (4, 4)  # 3 frames x 4 tokens: 12-token chunks, rank blocks of 6 straddle frames
    spec = wan_cache_spec(model, frames_per_chunk=frames, latent_height=latent[0], latent_width=latent[1],
                          text_tokens=6, image_tokens=3 if i2v_fused else None, sink_chunks=1, window_chunks=2,
                          branches=BRANCHES, dtype="float32", relative_sinks=relative_sinks)
    if groups is not None:  # retention groups (per-head sink positions with relative sinks)
        spec = dataclasses.replace(spec, sink_chunks=0, window_chunks=None, head_retention=groups)
    g = torch.Generator().manual_seed(11)
    prompts = {b: [torch.randn(6, TEXT_DIM, generator=g) for _ in range(2)] for b in BRANCHES}
    images = {b: torch.randn(3, 8, generator=g) for b in BRANCHES} if i2v_fused else None
    steps = []
    for chunk in range(5):
        for commit in (False, True):
            x = torch.randn(len(BRANCHES), 4, frames, *latent, generator=g)
            per_token = chunk % 2 == 1  # [streams, seq_len] timesteps, different per frame
            t = (torch.rand(len(BRANCHES), spec.chunk_size, generator=g) * 1000 if per_token
                 else torch.rand(len(BRANCHES), generator=g) * 1000)
            steps.append((chunk, commit, x, t))
    device = _device()
    outs: dict[str, list[torch.Tensor]] = {"one": [], "mesh": []}
    counter = None
    if compiled:
        from torch._dynamo.testing import CompileCounter

        torch._dynamo.reset()
        counter = CompileCounter()
    with torch.no_grad():
        for kind in ("one", "mesh"):
            if kind == "one":
                cache: Any = am.KVCache(spec, num_pages=64, device=device)
                branches = BRANCHES
            else:
                cache = DistributedKVCache(spec, mesh, num_pages=64, device=device)
                branches = mesh.local_branches
            paged = enable_paged_attention(model, cache)
            assert (paged.sequence_parallel is None) == (kind == "one" or mesh.sp is None)
            step: Any = paged
            if counter is not None and kind == "mesh":
                step = torch.compile(functools.partial(_call_paged, paged), backend=counter, fullgraph=True)
            state = cache.open_session("s")
            for chunk, commit, x, t in steps:
                if chunk in (0, 3) and not commit:  # a prompt switch before chunk 3
                    if chunk:
                        state.clear_cross_attention()
                    for b in branches:
                        image = None if images is None else images[b].to(device)
                        paged.set_prompt(state, b, prompts[b][chunk // 3].to(device), image)
                x, t = x.to(device), t.to(device)
                if kind == "one":
                    with state.prepare_forward(BRANCHES, spec.chunk_size, commit_current=commit) as fwd:
                        outs[kind].append(paged(x, t, fwd))
                else:
                    with cache.prepare_forward(state, spec.chunk_size, commit) as fwd:
                        local = step(mesh.local_streams(x), mesh.local_streams(t), fwd)
                    outs[kind].append(mesh.gather_streams(local))
            paged.remove()
            cache.close()
    for i, (a, e) in enumerate(zip(outs["mesh"], outs["one"])):
        torch.testing.assert_close(a, e, atol=_tol(1e-5), rtol=_tol(1e-5), msg=lambda m, i=i: f"forward {i}: {m}")
    if counter is not None:  # [streams] and [streams, seq_len] timesteps: two input layouts, a frame each
        assert counter.frame_count == 2, f"expected 2 compiled frames, got {counter.frame_count}"


def check_all(world: int) -> None:
    """Every scenario of one world size in one process group (process start-up dominates on CPU)."""
    if world == 2:
        check_rollout((2,), ("sp",), 4, 4)        # SP only, MHA
        check_rollout((2,), ("sp",), 4, 2)        # SP only, GQA split
        check_rollout((2,), ("sp",), 4, 1)        # SP only, MQA replicated
        check_rollout((2,), ("cfg",), 4, 2)       # CFG only
        check_rollout((2,), ("sp",), 4, 2, relative_sinks=True)  # sink queries through the fused all-to-all
        check_rollout((2,), ("sp",), 4, 2, cross="tokens")       # cross-attention without all-to-alls
        check_functional(2, 4, 2)
        check_graph_votes()
        check_vote_undo()
        check_autograd()
        check_failures((2,), ("cfg",), 1)
        check_failures((2,), ("sp",), 0)
        check_diffusers((2,), ("sp",))
        check_diffusers((2,), ("sp",), cross="tokens", relative_sinks=True)  # window slides: sink shift > 0
        check_diffusers((2,), ("cfg",))
        check_diffusers((2,), ("sp",), i2v_fused=True)  # image cache + fused projections, one cross all-to-all pair
    else:
        check_rollout((2, 2), ("cfg", "sp"), 4, 2)  # CFG x SP
        check_rollout((2, 2), ("cfg", "sp"), 4, 2, relative_sinks=True)  # one stream: q, k, v, sink unfused
        check_rollout((2, 2), ("cfg", "sp"), 4, 1, cross="tokens")
        check_rollout((4,), ("sp",), 4, 2)          # SP 4 ways, GQA replicated (K=2 < P=4)
        check_functional(4, 4, 1)
        check_submesh()
        check_failures((2, 2), ("cfg", "sp"), 3)
        check_diffusers((2, 2), ("cfg", "sp"))
