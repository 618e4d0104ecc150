"""Warm starts for servers: walk every forward shape of a spec before the first session arrives, and keep
torch's compiled artifacts across processes.

A fresh process pays one-time costs on its first forwards: kernel loading and FlashInfer's JIT modules,
cuBLAS / workspace allocations, and -- compiled -- dynamo tracing plus inductor's code generation for every
input shape the model sees (a compiled step of the Wan2.1-1.3B stack: ~96 s on the H200). A server that
takes them on its first user's first chunk stalls that user. Two tools move them out of the way:

* :func:`warm_up` runs the generation a spec goes through on **scratch sessions** of the cache -- each chunk
  from the first until the window is full and one chunk was evicted, its denoising forwards then its
  committing forward, one session alone and (``sessions=N``) N sessions batched -- calling the user's model
  on each forward, then closes them. Every shape the model sees later (stream counts, chunk lengths,
  visible history lengths, commit and denoising forwards) has then been compiled / planned / loaded once.
  Nothing of the cache's state outlives it: its sessions are closed, the pages it used are free again in
  the free queue's order of before, other sessions' pages were never written (only free pages are ever
  handed to a scratch session).
* :func:`save_compile_cache` / :func:`load_compile_cache` are thin wrappers over torch's own "mega-cache"
  (``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts``): the inductor, AOTAutograd, autotuning
  and PGO cache entries a process produced, saved to one file and loaded into a fresh process's caches before
  it compiles, so its compiles hit instead of generating code again (dynamo still traces: run
  :func:`warm_up` too for a first chunk without any compile stall). The file is trusted input -- its
  entries are pickles torch runs -- so load only files you wrote yourself, or signed with ``key=``.

A server's start-up, then::

    if os.path.exists(CACHE_FILE):
        am.load_compile_cache(CACHE_FILE)                # before the first compile
    report = am.warm_up(cache, run_forward, setup_session=populate_dummy_prompt, sessions=max_batch)
    am.save_compile_cache(CACHE_FILE)                    # for the next process (no-op when nothing compiled)

``benchmarks/warm_start.py`` measures the time to first chunk of a fresh process cold and warm.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import tempfile
import time
import uuid
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ardiff_modules.cache import KVCache
from ardiff_modules.checks import is_int, require_bool, require_int
from ardiff_modules.context import ForwardContext
from ardiff_modules.core.reservation import settle_free_order
from ardiff_modules.core.retention import RetentionPolicy
from ardiff_modules.errors import (
    CacheClosedError,
    CapacityError,
    CompileCacheError,
    SequenceLengthError,
    SpecError,
    UnknownBranchError,
)
from ardiff_modules.lanes import CacheLane
from ardiff_modules.session import KVState, branch_names

#: DEBUG: one line per warm-up (forwards, shapes, seconds). WARNING: a compile cache of another torch version.
logger = logging.getLogger(__name__)

#: Session ids of :func:`warm_up`'s scratch sessions start with this (then a random tag and an index): a
#: user's id cannot collide with them by accident; ``cache.sessions`` shows them while a warm-up runs.
WARM_UP_PREFIX = "__ardiff_warm_up__"
#: The most chunks :func:`warm_up` looks ahead for a retention policy's history to fill and evict.
MAX_WALK_CHUNKS = 4096
#: First line of a compile-cache file (:func:`save_compile_cache`); a JSON header line and torch's bytes follow.
COMPILE_CACHE_MAGIC = b"ardiff-compile-cache/1\n"


# ------------------------------------------------------------------ the report
@dataclass(frozen=True)
class ForwardShape:
    """One distinct forward a warm-up ran: its streams, pending tokens, the widest stream's visible history
    tokens, and whether it committed."""

    streams: int
    seq_len: int
    history_tokens: int
    commit: bool

    @property
    def visible_keys(self) -> int:
        """Keys the widest stream attends to: its history plus its own pending tokens."""
        return self.history_tokens + self.seq_len


@dataclass(frozen=True)
class WarmUpStage:
    """One session count's walk: ``sessions`` scratch sessions batched in every forward (``streams`` rows),
    ``chunks`` chunks of ``denoising_forwards + 1`` forwards each, the distinct shapes, the wall time (on CUDA
    the device synchronised at the end)."""

    sessions: int
    streams: int
    chunks: int
    forwards: int
    shapes: tuple[ForwardShape, ...]
    seconds: float


@dataclass(frozen=True)
class WarmUpReport:
    """What :func:`warm_up` ran: its stages in order, their total wall time (session set-up included) and the
    allocator's high-water mark after it (``cache.stats().peak_pages_used``, which the warm-up's scratch
    sessions may have raised: ``cache.reset_peak()`` restarts it)."""

    stages: tuple[WarmUpStage, ...]
    seconds: float
    peak_pages_used: int

    @property
    def forwards(self) -> int:
        """Forwards run, all stages."""
        return sum(stage.forwards for stage in self.stages)

    @property
    def shapes(self) -> tuple[ForwardShape, ...]:
        """The distinct forward shapes of all stages, in the order they first ran."""
        return tuple(dict.fromkeys(shape for stage in self.stages for shape in stage.shapes))


@dataclass(frozen=True)
class _Walk:
    """:func:`warm_up`'s arguments, checked: branches per session, session count per stage, tokens of each
    chunk walked, denoising forwards per chunk, static forwards."""

    branches: tuple[str, ...]
    batches: tuple[int, ...]
    lengths: tuple[int, ...]
    denoising: int
    static: bool


# ------------------------------------------------------------------ warm_up
def warm_up(
    cache: KVCache,
    run_forward: Callable[[ForwardContext], object],
    *,
    branches: Sequence[str] | None = None,
    sessions: int | Sequence[int] = 1,
    chunk_lengths: Sequence[int] | None = None,
    max_chunks: int | None = None,
    denoising_forwards: int = 1,
    static: bool = False,
    setup_session: Callable[[KVState], object] | None = None,
) -> WarmUpReport:
    """Run every forward shape a generation of ``cache.spec`` goes through, on scratch sessions, then close them.

    For each stage (a session count, see ``sessions``) the scratch sessions walk the chunks a generation
    walks: chunk ``0, 1, ...`` until a forward saw a full history and its commit evicted a chunk (sink +
    window: ``sinks + window + 1`` chunks; any retention policy: until ``max_history_chunks`` is reached and
    a chunk left) or ``max_chunks``. Per chunk, ``denoising_forwards`` forwards with ``commit_current=False``
    then one with ``commit_current=True``, each over every scratch session's ``branches`` batched in one
    forward (``cache.prepare_forward``, as a real generation prepares them), and ``run_forward(fwd)`` on
    each: the user's model call on the prepared :class:`~ardiff_modules.context.ForwardContext`.

    ``run_forward`` makes the inputs (deterministic dummies are fine: the K/V land in scratch pages only)
    and runs the model exactly as serving does -- the eager model, a :class:`~ardiff_modules.CompiledStep`, a
    :class:`~ardiff_modules.CUDAGraphStep` (``static=True``) -- under the same grad mode (call ``warm_up``
    inside ``torch.no_grad()`` / ``torch.inference_mode()`` if serving does: grad mode is part of a
    compiled graph). It must run every layer on committing forwards, as any commit requires. E.g. with the
    reference model (``ardiff_modules.models.wan_causal_dit``)::

        step = am.CompiledStep(model)
        text = torch.zeros(cfg.text_tokens, cfg.dim, device=device, dtype=dtype)   # a dummy prompt

        def setup_session(state):                       # each scratch session: a prompt in every branch
            for branch in state.kv_branch_names:
                am.populate_cross_attention(state, branch, [b.cross for b in model.blocks], text)

        def run_forward(fwd):                           # fwd.num_streams rows of fwd.seq_len tokens
            frames = fwd.seq_len // cfg.tokens_per_frame
            x = torch.zeros(fwd.num_streams, frames, cfg.in_channels, cfg.latent_height, cfg.latent_width,
                            device=device, dtype=dtype)
            step(x, torch.zeros(fwd.num_streams, device=device), fwd.layers)

        with torch.no_grad():
            report = am.warm_up(cache, run_forward, setup_session=setup_session, sessions=4)

    Parameters
    ----------
    branches:
        The branches of each scratch session batched in every forward, in order (default: all of the spec's,
        e.g. CFG's cond + uncond in one forward).
    sessions:
        ``N``: warm one session alone and, if ``N > 1``, ``N`` sessions batched in one forward (stream
        counts ``len(branches)`` and ``N * len(branches)``); or a sequence of session counts, one stage each.
        A serving engine that batches 1..N sessions passes every count it batches.
    chunk_lengths:
        Tokens of each chunk of the generation in order, the last one repeating (e.g. ``(1560, 4680)``: a
        1-frame first chunk, then 3-frame chunks); default ``(chunk_size,)``. Multiples of ``page_size`` up
        to ``chunk_size``, as :class:`~ardiff_modules.session.ForwardOptions` takes them.
    max_chunks:
        Chunks walked per stage instead of the rule above; needed when the window is unbounded (no chunk is
        ever evicted). Fewer chunks than the rule leave the later history lengths unwarmed.
    denoising_forwards:
        Forwards with ``commit_current=False`` before each chunk's commit (``0``: loops whose last denoising
        forward commits). One is enough for the shapes; more repeat them.
    static:
        Prepare static forwards (``static=True``, CUDA graphs: FlashInfer only).
    setup_session:
        Called once with each scratch session right after it opens, before any forward: publish its
        cross-attention caches (dummy prompts) there. Cross caches a scratch session holds go with it.

    Notes
    -----
    Returns a :class:`WarmUpReport`: forwards, distinct shapes and seconds per stage, and in total.

    **State.** Afterwards the cache is as before: no scratch session is left, the pages in use are the same
    ones (the scratch sessions only ever take free pages, so no other session's K/V is read or written), the
    free queue is back in its order of before (later allocations take the ids they would have taken), the
    forward contexts it made are released. Two things stay: the allocator's high-water mark (see
    :class:`WarmUpReport`), and, on an FP8 pool, K/V were written with the scales (fixed before: see below),
    so ``set_kv_scales`` is refused afterwards. Plans and CUDA graphs belong to a forward context (one per
    batch of streams): a user session's first forward still plans, and captures its own graph, but over
    kernels, compiled code and workspaces the warm-up loaded. What a warm-up leaves warm is the process's:
    compiled graphs, loaded kernel modules, allocator pools.

    **Failures.** Refused before anything changes: a cache other than a :class:`KVCache` or a closed one,
    bad arguments (:class:`SpecError`, :class:`UnknownBranchError`, :class:`SequenceLengthError`), an
    unbounded window without ``max_chunks`` (:class:`SpecError` naming it), an FP8 pool whose scales are not
    all fixed (a scratch commit would fix them from dummy K/V: call ``set_kv_scales`` or warm up after a real
    commit), too few pages for the scratch sessions at their peak beside the open sessions' peaks
    (:class:`CapacityError`; unbounded windows: beside the pages in use), too few forward contexts kept free
    (it would release idle contexts of open sessions, :class:`SpecError` naming ``max_forward_contexts``).
    Whatever ``run_forward`` or ``setup_session`` raises -- ``KeyboardInterrupt`` included -- aborts the open
    forward, closes the scratch sessions and restores the free queue, then propagates.

    Thread safety: other threads may drive their own sessions meanwhile (each forward takes the cache's
    lock, the walk does not hold it); the scratch sessions count as open sessions for admission while it runs.
    """
    walk = _checked_walk(cache, run_forward, branches, sessions, chunk_lengths, max_chunks, denoising_forwards,
                         static, setup_session)
    start = time.perf_counter()
    free_before = [lane.allocator.free_pages() for lane in cache._lanes]  # each lane's queue (retention groups)
    tag = uuid.uuid4().hex[:12]
    scratch: list[KVState] = []
    stages = []
    try:
        for i in range(max(walk.batches)):
            scratch.append(cache.open_session(f"{WARM_UP_PREFIX}{tag}/{i}"))
            if setup_session is not None:
                setup_session(scratch[-1])
        for count in walk.batches:
            stages.append(_walk(cache, scratch[:count], walk, run_forward))
            for state in scratch[:count]:  # the next stage starts from empty branches; prompts kept
                state.reset(keep_cross_attention=cache.spec.cross_attention_names)
    finally:
        with cache.lock:
            for state in scratch:
                state.close()
            for lane, order in zip(cache._lanes, free_before):
                settle_free_order(lane.allocator, order)
    report = WarmUpReport(tuple(stages), time.perf_counter() - start, sum(lane.allocator.peak_used for lane in cache._lanes))
    logger.debug("warm-up: %d forwards, %d distinct shapes, %.3f s", report.forwards, len(report.shapes),
                 report.seconds)
    return report


def _walk(
    cache: KVCache, states: Sequence[KVState], walk: _Walk, run_forward: Callable[[ForwardContext], object]
) -> WarmUpStage:
    """One stage: ``states`` batched in every forward, every chunk of ``walk``; the device synchronised at the end."""
    streams = [(state, branch) for state in states for branch in walk.branches]
    shapes: dict[ForwardShape, None] = {}
    forwards = 0
    start = time.perf_counter()
    for length in walk.lengths:
        history = max(sum(map(len, s.history_chunks(b))) for s, b in streams) * cache.spec.page_size
        lengths = None if length == cache.spec.chunk_size else (length,)
        for commit in (False,) * walk.denoising + (True,):
            fwd = cache.prepare_forward(streams, length, commit, static=walk.static, chunk_lengths=lengths)
            try:
                run_forward(fwd)
            except BaseException:
                fwd.abort()
                raise
            fwd.commit()  # a denoising forward just closes (its pending pages stay for the next one)
            forwards += 1
            shapes[ForwardShape(len(streams), length, history, commit)] = None
    if cache.device.type == "cuda":
        torch.cuda.synchronize(cache.device)
    return WarmUpStage(len(states), len(streams), len(walk.lengths), forwards, tuple(shapes),
                       time.perf_counter() - start)


def walk_chunks(policy: RetentionPolicy, max_chunks: int | None = None) -> int:
    """Chunks :func:`warm_up` walks under ``policy``: ``max_chunks`` if given, else up to and including the first
    chunk whose forward sees ``max_history_chunks`` history chunks and whose commit evicts one.

    Sink ``S`` + window ``W``: ``S + W + 1``. Raises :class:`SpecError` naming ``max_chunks`` for an unbounded
    history, or one that does not fill and evict within :data:`MAX_WALK_CHUNKS` chunks.
    """
    if max_chunks is not None:
        return require_int("warm_up.max_chunks", max_chunks, minimum=1)
    full = policy.max_history_chunks
    if full is None:
        raise SpecError(
            "warm_up.max_chunks: expected the chunks to walk for an unbounded window (window_chunks=None: no chunk "
            "is ever evicted, every history length is a new shape), got None"
        )
    for chunk in range(MAX_WALK_CHUNKS):
        seen = len(policy.history_indices(chunk))  # what chunk's forward attends to
        kept = len(policy.history_indices(chunk + 1))  # after its commit
        if seen == full and kept < chunk + 1:
            return chunk + 1
    raise SpecError(
        f"warm_up.max_chunks: expected {type(policy).__name__}'s history to reach max_history_chunks={full} and "
        f"evict within {MAX_WALK_CHUNKS} chunks, got neither; pass max_chunks"
    )


def _checked_walk(
    cache: object, run_forward: object, branches: Sequence[str] | None, sessions: int | Sequence[int],
    chunk_lengths: Sequence[int] | None, max_chunks: int | None, denoising_forwards: int, static: bool,
    setup_session: object,
) -> _Walk:
    """:func:`warm_up`'s arguments and the cache's room for it, checked before anything changes."""
    if not isinstance(cache, KVCache):
        raise SpecError(f"warm_up.cache: expected a KVCache, got {type(cache).__name__}")
    if cache.is_closed:
        raise CacheClosedError("warm_up: expected an open KVCache, got one that was closed")
    for name, fn, optional in (("run_forward", run_forward, False), ("setup_session", setup_session, True)):
        if not callable(fn) and not (optional and fn is None):
            raise SpecError(f"warm_up.{name}: expected a callable, got {type(fn).__name__}")
    spec = cache.spec
    names = branch_names("warm_up.branches", branches, spec.branches)
    unknown = [b for b in names if b not in spec.branches]
    if unknown:
        raise UnknownBranchError(f"warm_up.branches: unknown KV branch(es) {unknown}; expected names from {spec.branches}")
    if not names or len(set(names)) != len(names):
        raise SpecError(f"warm_up.branches: expected distinct branch names, got {list(names)}")
    batches = _batches(sessions)
    lengths = _chunk_lengths(spec.chunk_size, spec.page_size, chunk_lengths)
    # with retention groups: until every lane's window has filled and evicted (the longest walk)
    chunks = max(walk_chunks(lane.spec.policy, max_chunks) for lane in cache._lanes)
    walk = _Walk(names, batches, tuple(lengths[min(i, len(lengths) - 1)] for i in range(chunks)),
                 require_int("warm_up.denoising_forwards", denoising_forwards, minimum=0),
                 require_bool("warm_up.static", static))
    quantizers = [lane.pool.quantizer for lane in cache._lanes]
    if any(q is not None and not q.all_calibrated for q in quantizers):
        raise SpecError(
            "warm_up: expected an FP8 pool's scales fixed (every layer), got some uncalibrated: a scratch commit "
            "would fix them from the warm-up's dummy K/V; call cache.set_kv_scales(...) first, or warm up after "
            "a real commit"
        )
    for lane in cache._lanes:
        _check_room(cache, lane, walk, chunks)
    _check_contexts(cache, walk)
    return walk


def _batches(sessions: int | Sequence[int]) -> tuple[int, ...]:
    """Session counts, one stage each: ``N`` -> ``(1, N)`` (``(1,)`` for 1); a sequence -> its distinct counts."""
    if is_int(sessions):
        count = require_int("warm_up.sessions", sessions, minimum=1)
        return (1,) if count == 1 else (1, count)
    if isinstance(sessions, (str, bytes)) or not isinstance(sessions, Sequence) or not sessions:
        raise SpecError(f"warm_up.sessions: expected an int >= 1 or a non-empty sequence of them, got {sessions!r}")
    return tuple(dict.fromkeys(require_int("warm_up.sessions[]", n, minimum=1) for n in sessions))


def _chunk_lengths(chunk: int, page: int, lengths: Sequence[int] | None) -> tuple[int, ...]:
    if lengths is None:
        return (chunk,)
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence):
        raise SequenceLengthError(f"warm_up.chunk_lengths: expected a sequence of token counts, got {lengths!r}")
    bad = [n for n in lengths if not is_int(n) or not 0 < n <= chunk or n % page]
    if not lengths or bad:
        raise SequenceLengthError(
            f"warm_up.chunk_lengths: expected multiples of page_size={page} in [{page}, chunk_size={chunk}], got "
            f"{list(lengths)}"
        )
    return tuple(lengths)


def _check_room(cache: KVCache, lane: CacheLane, walk: _Walk, chunks: int) -> None:
    """:class:`CapacityError` unless the scratch sessions fit at their peak in ``lane`` beside the open sessions'
    promised peaks (a uniform cache has one lane; the error then names no lane)."""
    spec = lane.spec
    history = spec.max_history_chunks
    per_stream = min(chunks, history + 1) if history is not None else chunks
    if lane.extent_chunks is not None:
        per_stream = max(per_stream, -(-lane.extent_pages // spec.pages_per_chunk))  # (frame slots: fewer pages)
    needed = max(walk.batches) * len(walk.branches) * per_stream * spec.pages_per_chunk
    with cache.lock:
        free, used = lane.allocator.num_free, lane.allocator.num_used
        resident = len(cache.sessions) - len(cache.tiers().suspended)
        available = free if history is None else max(0, lane.admission.unpromised(free, used, resident, False))
        if needed > available:
            promised = "" if history is None else f", not promised to the {resident} open session(s)' peaks"
            where = "" if lane.part is None else f" of lane {lane.name!r}"
            raise CapacityError(
                f"warm_up: the scratch sessions need up to {needed} pages{where} ({max(walk.batches)} session(s) x "
                f"{len(walk.branches)} branch(es) x {per_stream} chunks x {spec.pages_per_chunk} pages), only "
                f"{available} are free{promised}",
                needed=needed, free=available,
            )


def _check_contexts(cache: KVCache, walk: _Walk) -> None:
    """:class:`SpecError` unless the forward contexts the scratch sessions make fit beside the kept ones."""
    with cache.lock:
        contexts = len(walk.batches) * (len(set(walk.lengths)) if walk.static else 1)
        kept = cache._forwards.num_contexts
        if kept + contexts > cache.max_forward_contexts:
            raise SpecError(
                f"warm_up: expected room for {contexts} forward context(s) beside the {kept} kept "
                f"(KVCache.max_forward_contexts={cache.max_forward_contexts}), got too little: warming up would "
                "release idle contexts of open sessions (their plans and CUDA graphs); warm up before sessions "
                "arrive, or call cache.release_idle_forward_contexts()"
            )


# ------------------------------------------------------------------ torch's compile cache
def save_compile_cache(path: str | os.PathLike[str], *, key: bytes | None = None) -> int:
    """Save this process's compiled artifacts (``torch.compiler.save_cache_artifacts()``) to ``path``; returns the
    bytes written.

    What torch saves: every inductor (FX graph, with its Triton kernels on CUDA), AOTAutograd, autotuning and
    PGO cache entry this process created or used since it started -- cumulative, so a later save holds the
    earlier ones too. The file is one header line naming this format, then a JSON line (torch version, size,
    SHA-256 of the payload, artifact counts, whether it is signed and the signature), then torch's bytes as
    they are; it is written to a temporary file in the same folder and renamed over ``path``
    (``os.replace``), so a reader never sees half a file.

    Parameters
    ----------
    path:
        The file to write (its folder must exist; not a directory).
    key:
        ``None``: an unsigned file, for a process that only loads files it wrote itself. Secret bytes: the file
        carries an HMAC-SHA256 of torch's bytes under ``key`` (never the key), and only
        ``load_compile_cache(path, key=<the same key>)`` loads it. Sign files that cross a trust boundary
        (another machine, a shared folder, a download): see :func:`load_compile_cache`.

    Notes
    -----
    Returns ``0`` and writes nothing (an existing file at ``path`` stays) when torch has nothing to save
    (nothing was compiled, or only by backends without caches, e.g. ``backend="eager"``). A ``path`` that is
    not a ``str`` / ``os.PathLike`` or a ``key`` that is not non-empty bytes is a :class:`SpecError`, a
    directory at ``path`` a :class:`CompileCacheError`, both before anything is saved. Nothing here changes
    torch's configuration.
    """
    path, key = _checked_path("save_compile_cache", path), _checked_key("save_compile_cache", key)
    if path.is_dir():
        raise CompileCacheError(f"save_compile_cache: expected a file path, got the directory {path}")
    result = torch.compiler.save_cache_artifacts()
    if result is None:
        return 0
    payload, info = result
    artifacts = getattr(info, "artifacts", {})
    header: dict[str, object] = {
        "torch": torch.__version__, "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest(),
        "artifacts": {str(kind): len(keys) for kind, keys in artifacts.items()}, "signed": key is not None,
    }
    if key is not None:
        header["hmac_sha256"] = _signature(key, payload)
    data = COMPILE_CACHE_MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + payload
    _write_atomically(path, data)
    return len(data)


def load_compile_cache(path: str | os.PathLike[str], *, key: bytes | None = None) -> bool:
    """Load a file of :func:`save_compile_cache` into torch's caches (``torch.compiler.load_cache_artifacts``);
    returns whether anything was loaded.

    **Trust.** Load only files you wrote yourself, or signed (``key=``). A compile-cache file is code: its
    inductor and AOTAutograd entries are pickles, the inductor ones unpickled by torch while loading (to
    unpack their Triton bundles, on by default), the AOTAutograd ones on a later compile hit; so loading a
    file someone else could write gives them this process. The
    SHA-256 in the header only detects accidental corruption (a crafted file carries a matching one); the
    checks on entry keys below only stop a file from writing outside torch's cache directory. For a file
    that crosses a trust boundary, save and load it with the same secret ``key``: the HMAC-SHA256 is checked
    before any byte of the payload is decoded.

    Call it before the first compile: compiles of the same code, shapes and configuration then hit the loaded
    entries (on CPU, inductor still builds the C++ of each hit; on CUDA the Triton kernels come with them).
    torch writes the entries into its on-disk caches (``TORCHINDUCTOR_CACHE_DIR``) -- that is what loading
    is.

    Parameters
    ----------
    path:
        A file :func:`save_compile_cache` wrote.
    key:
        The key the file was saved with, or ``None`` for an unsigned file.

    Notes
    -----
    Returns ``False`` (loading nothing; a WARNING is logged) for a file saved by another torch version, whose
    entries torch would never use.

    **Failures**, all before torch sees a byte (nothing loaded, nothing written): ``FileNotFoundError``
    naming ``path`` when there is no file; :class:`SpecError` for a ``path`` that is not a ``str`` /
    ``os.PathLike`` (``None``) or a ``key`` that is not non-empty bytes; :class:`CompileCacheError` naming
    the file when it is a directory, is not one of :func:`save_compile_cache` (another format, truncated,
    its checksum wrong), its signature does not match ``key`` (signed but no ``key`` given, unsigned but a
    ``key`` given, another key, or altered), its payload is not torch's mega-cache encoding this library
    can check (version 1, as torch 2.13 writes it), or an entry's key is absolute, holds ``..``, a backslash or a
    drive letter (it would write outside the cache directory). Also a :class:`CompileCacheError` when torch
    cannot read the artifacts. Nothing here changes torch's configuration.
    """
    path, key = _checked_path("load_compile_cache", path), _checked_key("load_compile_cache", key)
    header, payload = _parse_compile_cache(path, _read_compile_cache(path))
    _check_signature(path, header, payload, key)
    if header.get("torch") != torch.__version__:
        logger.warning("load_compile_cache: %s was saved by torch %s, this is torch %s; not loaded (torch only uses "
                       "artifacts of its own version)", path, header.get("torch"), torch.__version__)
        return False
    _check_entry_keys(path, payload)
    info = torch.compiler.load_cache_artifacts(payload)
    if info is None:
        raise CompileCacheError(
            f"load_compile_cache: expected compile artifacts torch {torch.__version__} can read in {path}, got "
            "bytes torch.compiler.load_cache_artifacts refused (see torch's warning above)"
        )
    artifacts = getattr(info, "artifacts", None)
    return True if artifacts is None else any(artifacts.values())


def _checked_path(where: str, path: object) -> Path:
    """``path`` as a :class:`Path`; :class:`SpecError` unless it is a ``str`` or an ``os.PathLike`` of one."""
    name = os.fspath(path) if isinstance(path, os.PathLike) else path
    if not isinstance(name, str):
        raise SpecError(f"{where}.path: expected a str or os.PathLike naming a file, got {path!r} "
                        f"({type(path).__name__})")
    return Path(name)


def _checked_key(where: str, key: object) -> bytes | None:
    """``key`` as bytes, or ``None``; :class:`SpecError` unless it is ``None`` or non-empty bytes.

    NOTE: the message names the key's type (or that it is empty), never its value: errors end up in logs.
    """
    if key is None:
        return None
    if not isinstance(key, (bytes, bytearray)) or not key:
        got = f"empty {type(key).__name__}" if isinstance(key, (bytes, bytearray)) else type(key).__name__
        raise SpecError(f"{where}.key: expected None or non-empty bytes (a secret shared by the processes that save "
                        f"and load the file; a str: .encode() it), got {got}")
    return bytes(key)


def _signature(key: bytes, payload: bytes) -> str:
    """HMAC-SHA256 of torch's bytes under ``key``, in hex (the header's ``hmac_sha256``)."""
    return hmac.new(key, payload, hashlib.sha256).hexdigest()


def _read_compile_cache(path: Path) -> bytes:
    """The bytes of the file at ``path``: ``FileNotFoundError`` / :class:`CompileCacheError` (a directory)."""
    if path.is_dir():
        raise CompileCacheError(
            f"load_compile_cache: expected a file written by save_compile_cache at {path}, got a directory"
        )
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(2, f"load_compile_cache: no compile cache file at {path}", str(path)) from None


def _parse_compile_cache(path: Path, data: bytes) -> tuple[dict[str, object], bytes]:
    """``(header, payload)`` of a compile-cache file, checked: format line, JSON header, size, SHA-256.

    NOTE: the SHA-256 sits in the same file, so it catches accidental corruption (a truncated copy, a flipped
    bit), never tampering: anyone who writes the payload writes its checksum too. ``key=`` is for that.
    """
    if not data.startswith(COMPILE_CACHE_MAGIC):
        raise CompileCacheError(
            f"load_compile_cache: expected a file written by save_compile_cache (first line "
            f"{COMPILE_CACHE_MAGIC.decode().strip()!r}) at {path}, got {data[:24]!r}..."
        )
    line, _, payload = data[len(COMPILE_CACHE_MAGIC):].partition(b"\n")
    try:
        header = json.loads(line)
        size, digest = int(header["bytes"]), str(header["sha256"])
    except (ValueError, KeyError, TypeError, OverflowError) as error:  # OverflowError: int() of an infinite float
        raise CompileCacheError(f"load_compile_cache: the header of {path} is unreadable ({error})") from None
    if len(payload) != size or hashlib.sha256(payload).hexdigest() != digest:
        raise CompileCacheError(
            f"load_compile_cache: expected {size} payload bytes with SHA-256 {digest[:12]}... in {path}, got "
            f"{len(payload)} bytes with another checksum: the file is truncated or corrupt (accidental damage; the "
            "checksum proves nothing about who wrote the file)"
        )
    return header, payload


def _check_signature(path: Path, header: dict[str, object], payload: bytes, key: bytes | None) -> None:
    """:class:`CompileCacheError` unless the file is unsigned and ``key`` is ``None``, or signed with ``key``.

    Files of before the ``signed`` field are unsigned. A signed file loaded without a key is refused too: a
    caller who passes no key expects a file it wrote itself, and one who passes a key must never be
    downgraded to an unsigned file.
    """
    signed, signature = header.get("signed", False), header.get("hmac_sha256")
    if not isinstance(signed, bool) or (signed and not (isinstance(signature, str) and _HEX64.fullmatch(signature))):
        raise CompileCacheError(f"load_compile_cache: the header of {path} is unreadable (expected 'signed' a bool "
                                f"and, if true, 'hmac_sha256' 64 hex digits; got {signed!r}, {signature!r})")
    if signed and key is None:
        raise CompileCacheError(f"load_compile_cache: expected an unsigned file at {path} (no key= given), got a "
                                "file signed with a key: pass the key it was saved with")
    if key is not None and not signed:
        raise CompileCacheError(f"load_compile_cache: expected a file signed with the given key at {path}, got an "
                                "unsigned file: not loaded (re-save it with save_compile_cache(..., key=))")
    if key is not None and not hmac.compare_digest(_signature(key, payload), str(signature)):  # constant time
        raise CompileCacheError(f"load_compile_cache: expected {path} signed with the given key, got another "
                                "HMAC-SHA256: it was signed with another key or altered; not loaded")


# torch's mega-cache payload (torch.utils._appending_byte_serializer, as torch 2.13 writes it), read here without torch
# and without unpickling anything, to see every entry's key before torch writes a file for it:
#
#   crc32 of the rest (4 B) | version = 1 (u64) | per artifact type: type (str), count (u64),
#                                                  count x [key (str), content (bytes)]
#   str = bytes of base64(utf-8); bytes = length (u64) + the bytes; integers big-endian
_MEGA_CACHE_VERSION = 1
#: How an entry's key starts when it is a Windows drive path (``C:`` / ``C:\``): ``os.path.join`` drops the
#: cache directory before it on Windows.
_DRIVE = re.compile(r"[A-Za-z]:")
#: A header's ``hmac_sha256``: checked before ``hmac.compare_digest``, which refuses non-ASCII strings.
_HEX64 = re.compile(r"[0-9a-f]{64}")


def _check_entry_keys(path: Path, payload: bytes) -> None:
    """:class:`CompileCacheError` if an entry's key could make torch write outside its cache directory.

    torch joins each key to a cache directory (``os.path.join(cache_dir, key)``, some under a subfolder), so
    an absolute key replaces the directory and a ``..`` climbs out of it: a file of the crafter's choosing.
    """
    for kind, entry in _mega_cache_keys(path, payload):
        problem = _key_problem(entry)
        if problem is not None:
            raise CompileCacheError(
                f"load_compile_cache: expected entry keys relative to torch's cache directory in {path}, got the "
                f"{kind!r} key {entry[:200]!r} ({problem}): save_compile_cache never writes one; nothing loaded"
            )


def _key_problem(key: str) -> str | None:
    """Why ``key`` is not a plain relative path inside a cache directory, or ``None`` when it is."""
    if not key:
        return "empty"
    if "\x00" in key:
        return "a NUL byte"
    if "\\" in key:  # a separator on Windows: "..\\x" climbs there
        return "a backslash"
    if key.startswith("/") or os.path.isabs(key):
        return "an absolute path"
    if _DRIVE.match(key):
        return "a drive"
    if ".." in key.split("/"):
        return "a '..' component, which climbs out of the cache directory"
    return None


def _mega_cache_keys(path: Path, payload: bytes) -> list[tuple[str, str]]:
    """``(artifact type, key)`` of every entry of torch's payload, decoded as torch decodes it (see above);
    :class:`CompileCacheError` for any other encoding or a malformed one, rather than guessing."""
    reader = _PayloadReader(memoryview(payload))
    try:
        crc = int.from_bytes(reader.take(4), "big")
        if crc != zlib.crc32(memoryview(payload)[4:]):
            raise ValueError("its CRC32 does not match")
        version = reader.uint64()
        if version != _MEGA_CACHE_VERSION:
            raise ValueError(f"encoding version {version}, this library checks version {_MEGA_CACHE_VERSION}")
        keys = []
        while not reader.finished:
            kind, count = reader.text(), reader.uint64()
            for _ in range(count):  # each entry takes >= 16 bytes: a huge count ends at the end of the data
                keys.append((kind, reader.text()))
                reader.take(reader.uint64())  # the content, not read
    except ValueError as error:  # also base64's binascii.Error and UnicodeDecodeError
        raise CompileCacheError(
            f"load_compile_cache: expected torch's compile-cache encoding (version {_MEGA_CACHE_VERSION}, as torch "
            f"2.13 writes it) in {path}, got bytes this library cannot check ({error}); nothing loaded"
        ) from None
    return keys


class _PayloadReader:
    """Reads torch's payload front to back; ``ValueError`` for a read past its end."""

    def __init__(self, data: memoryview) -> None:
        self._data, self._at = data, 0

    @property
    def finished(self) -> bool:
        return self._at == len(self._data)

    def take(self, size: int) -> memoryview:
        if size > len(self._data) - self._at:
            raise ValueError(f"a record of {size} bytes at byte {self._at} runs past the end ({len(self._data)})")
        self._at += size
        return self._data[self._at - size:self._at]

    def uint64(self) -> int:
        return int.from_bytes(self.take(8), "big")

    def text(self) -> str:
        # validate=True: an alphabet-only string decodes the same under torch's lax b64decode, so the key
        # checked here is the key torch writes with.
        return base64.b64decode(self.take(self.uint64()), validate=True).decode("utf-8")


def _write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, flush it to disk, and rename it over ``path``."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
