"""Serving benchmark: a trace-driven multi-session server on one device, four policies for idle sessions.

Sessions arrive, stream chunks in bursts, pause (the user thinks / types: idle for some ticks), come back
and stream again, then leave; more sessions take part than the device pool holds at once (``--resident``
sessions at their peak). The same deterministic trace (``--seed``) is played under each policy, one
after another in one process, each on its own fresh ``KVCache`` of ``--resident x pages_per_session()``
pages (admission without the re-cache reserve, ``recache=False``):

* ``suspend`` -- the library's host tier. A new session is admitted with
  ``admit_session(sid, suspend_idle=True)``; a paused session stays resident until its room is needed,
  then it is suspended (``state.suspend()``: its K/V, cross caches and latents to host memory, pinned on
  CUDA). A returning session is resumed (``state.resume()``: a ``TransferHandle``; the copies run on a side
  stream and its next ``prepare_forward`` makes the compute stream wait for them on the device, no host
  sync) as soon as there is device room (made by suspending the least recently used paused session),
  and it streams in the same tick; otherwise it waits.
  The scheduler picks the victim itself (its least recently used *paused* session) and calls
  ``suspend()`` before ``admit_session``, so that each suspend is timed alone; a server would write
  ``admit_session(sid, suspend_idle=paused_sessions)``, which does the same in one call. (Plain
  ``suspend_idle=True`` may pick a session that is between two chunks of an active stream: idle means
  no open forward and no pending chunk, and the sessions of one batched forward share its LRU tick.)
* ``close_idle`` -- vllm-omni's behaviour, the baseline to beat: when room is needed the least recently
  used paused session is closed. When it comes back it is reopened (a new session, its text caches
  populated again) and rebuilds its K/V by re-running its retained chunks (the sinks + window it held,
  ``history_chunk_indices``) through committing forwards, one per chunk (sessions rebuilding in the same
  tick batched together): the **re-prefill**; then it streams in the same tick. (With the ``model``
  compute the rebuilt K/V are not the original ones: a reopened session counts its positions from 0 (the
  library has no start offset), and a chunk's deeper layers see only the replayed history, not the evicted
  chunks its first computation saw; the cost -- the forwards -- is the same. So its outputs are compared
  only before its first rebuild there; ``attention`` mode's K/V are its inputs: compared throughout.)
* ``queue`` -- no host tier: a paused session keeps its room; a new session waits until a resident
  one leaves.
* ``migrate`` -- the session moves to a second replica instead of host memory (TurboServe's migration; what
  vllm-omni's session affinity cannot do). Beside the serving cache the policy holds a second ``KVCache`` of
  ``--replica-resident`` sessions (default ``--resident``: a peer replica of the same size), in this process on
  the same device, standing for another GPU's pool. When room is needed the least recently used paused session
  is moved there (``migrate_out``) -- what ``send_sessions`` / ``recv_sessions`` run minus the wire: the
  snapshot's tensors gathered on the device (one page gather per lane, no host copy), checked and opened on the
  replica (reserve, one page copy), then closed here; when it comes back it is moved back the same way
  (``migrate_in``) as soon as there is room (made by moving another paused session out) and streams in that
  tick. If the replica is full too, the newcomer waits (as ``suspend`` does when the host budget is full).
  **Fairness**: only the serving replica computes, so every policy has the same compute and the same
  ``--resident`` active sessions; the replica is parking memory, as the host tier is for ``suspend`` (there
  unbounded by default, here ``--replica-resident`` sessions). The move is a device-to-device copy within one
  GPU (HBM bandwidth): a lower bound on a move over NVLink or the network between replicas, so the bytes moved
  are reported (``migrate_out`` / ``migrate_in``: host ms, device ms from CUDA events around the move, bytes, GB/s)
  for the time over another link to be derived; ``benchmarks.session_transport`` measures a move between two
  processes.

**CFG and compile.** ``--cfg on`` (default) runs both CFG streams per session, ``--cfg off`` the ``cond`` stream
only; ``--compile`` runs the model as ``torch.compile(model, fullgraph=True, dynamic=False)`` (``library_compiled``
of ``benchmarks.end_to_end``), every batch size of a tick (1..``--resident`` sessions, denoising and committing
forwards, every window fill level) compiled in an untimed warm-up before the calibration and again on each
policy's fresh pool (``config.compile_warmup_s``; ``graphs_compiled_during_play`` per policy counts the graphs
compiled inside the timed trace anyway). The issue-45 setting -- the 1.3B shape compiled with CFG off, the one
that runs in real time, so continuous play ranks the policies -- is ``--compile --cfg off``
(``run_h200.sh serving_compiled_cfg_off``).

Waiting sessions (new and returning) are served first come first served; all sessions need the same
room, so the queue stops at the first that does not fit.

**Ticks.** Each tick the server runs ONE batched chunk step over every active resident session: their
CFG streams (``cond``, ``uncond``) batched into one ``cache.prepare_forward([(state, branch), ...])`` per
forward (one launch per layer), ``--denoise-steps`` denoising forwards (``commit_current=False``,
timesteps 1000, 750, 500, 250 for 4) then one committing forward (t = 0). ``--compute model``: the
library's Wan causal DiT (``ardiff_modules.models.wan_causal_dit``, random weights from ``--seed``) at
``--preset`` (CPU default ``tiny``; CUDA ``wan2.1-1.3b``, alias ``wan1.3b``). ``--compute attention``:
only every layer's ``am.chunk_attention`` over random q/k/v of the preset's shape (the 14B-like shape,
where a whole model per tick would be too slow). Inputs are a deterministic function of (session, chunk,
step): the latent of a chunk (model; the same for every forward of its chunk step, as in
``end_to_end``) or q = k = v (attention) drawn from a generator seeded with (session, chunk[, step]). The
trace is in ticks (arrival tick, bursts of chunks, pause lengths in ticks, chunks per session); time is
the **policy clock**: the sum over the ticks played so far of ``max(measured wall time, tick floor)``. A
tick's wall time is its host part, its device wait and its bookkeeping (the warm-up tick and the outputs
copied for ``--check`` excluded); the **tick floor** (``--tick-seconds``, default one session's chunk step,
measured) is the least a tick lasts: a tick with little or nothing to compute (every resident session
paused, the others waiting) still lets the users' pauses and the waits last, without sleeping (the
server would be idle, waiting for its users). So a pause of ``p`` ticks lasts at least ``p`` chunk steps,
and a policy that leaves the device idle while sessions wait pays for it in time.
A session arriving at tick ``a`` asks at the clock of the start of tick ``a``; a chunk is **delivered**
when the tick that computed it has synchronised the device (``torch.cuda.synchronize``).

Metrics, per policy (``policies.<name>.metrics`` in the JSON):

* ``ttfc_s`` -- time to first chunk of a session: from the start of its arrival tick to the delivery of
  its chunk 0 (waiting for room, resumes or re-prefills of that tick included); p50 / p90 / max over the
  sessions that got one (``ttfc_ticks``: the same in ticks, deterministic).
* ``rtf`` -- real-time factor of a delivered chunk (every chunk but each session's chunk 0, which
  ``ttfc_s`` covers): (its delivery - the moment the user wanted it) / ``--chunk-seconds`` (default 0.75 s
  = 12 frames at 16 fps for Wan's 3 latent frames). The moment it was wanted: the previous chunk's
  delivery within a burst, the start of the return tick for the first chunk after a pause (so waiting
  for room, a resume or a re-prefill shows here). p50 / p90; ``rtf_aggregate`` = the policy clock at the
  end / (chunks delivered x chunk seconds).
* ``continuous_play_ratio`` -- the fraction of chunks (after each session's first) delivered by their
  playback deadline: playback starts when chunk 0 is delivered (``t0``); chunk ``i`` is due at
  ``t0 + i x chunk_seconds + paused_i``, ``paused_i`` being the time the user spent paused before asking
  for chunk ``i`` (each pause from the delivery of its burst's last chunk to the start of the return
  tick: a paused user is not watching).
* ``frames_per_gpu_second`` -- video frames delivered (``chunks x round(chunk_seconds x --fps)``) / the
  policy clock at the end (the seconds the server held the device, idle floors included);
  ``frames_per_busy_second``: / the sum of the ticks' measured wall times (``busy_s``).
* ``resume`` (suspend) -- per ``resume()``: host ms of the call (with the host-side staging copy), device
  ms from a CUDA event recorded on the compute stream just before the call to one recorded on a helper
  stream made to wait on the handle (``handle.order_current_stream()`` under ``torch.cuda.stream``): when
  the copies are done (CPU: the wall time of the call; the CPU handle is complete); as a fraction of one
  chunk step (``chunk_step_ms``, below); bytes moved (the host tier's bytes released by the resume:
  pages, cross caches, latents); effective GB/s = bytes / device time, and its ratio to the measured
  host-to-device link bandwidth. ``suspend``: the same for ``suspend()`` (device time: to an event the
  compute stream records after the call; the library makes that stream wait for the device-to-host
  copies). ``reprefill`` (close_idle): per tick with returning sessions rebuilt, the reopening (admit,
  text caches) and the re-prefill forwards: host ms, device ms (CUDA events around them), forwards, chunks
  re-run, K/V bytes rebuilt (pages x bytes per page), the fraction of a chunk step.
* ``chunk_step_ms`` (``config``) -- one session's chunk step (its CFG streams, ``--denoise-steps`` + 1
  forwards) at its full window, measured before the policies (median of the timed steps after warm-up;
  each step between two device synchronisations).
* ``link_bandwidth`` (run-level) -- measured at the start on CUDA: pinned host-to-device and
  device-to-host copies of ``--link-sizes-mib`` (256 and 1024 MiB), median of 5 copies each timed with
  CUDA events, GB/s. On the CPU a plain memcpy of 16 / 64 MiB (there is no host link).
* ``host_ms_per_tick`` -- host time of a tick: its wall time minus the final device wait, i.e.
  ``perf_counter`` from the tick's start to just before ``torch.cuda.synchronize`` (scheduler, admission,
  suspend / resume calls, ``prepare_forward``, Python and launches) plus the bookkeeping after it (closing
  departing sessions); p50 / p90 over the ticks that ran a forward. (On CUDA, where a tick launches more
  kernels than the launch queue holds, the host blocks on the device inside this part too: an upper bound.)
* ``peak`` -- the most device bytes in use (pages in use x bytes per page), host-tier bytes, sessions
  resident / suspended / waiting over the ticks (``tiers()`` after each tick), and on CUDA
  ``torch.cuda.max_memory_allocated`` over the policy. Per tick (``ticks``): wall / host / device ms,
  sessions active, resident, suspended, waiting, device and host bytes, suspends, resumes, closes,
  re-prefill forwards. Per session (``sessions``): its trace, TTFC, every delivery (tick, time, due,
  on time, RTF), its suspends / resumes / closes / rebuilds.

**Warm-up**: before each policy's trace one untimed tick on its cache: a warm-up session streams a
chunk, goes through the policy's round trip (suspend + resume / close + reopen + re-prefill / nothing)
and streams another chunk, then closes.

**Checks.** ``--check`` (default on for the CPU, off on CUDA): every chunk of every session is compared
with the same chunk of the same session under ``queue``, where no session ever leaves the device (same
inputs, same history): ``suspend`` must equal it for every chunk (and at least one compared chunk must
be the first after a resume when there were resumes), ``migrate`` likewise (the first chunk after a move back),
``close_idle`` for every chunk before a session's first rebuild (``model``; every chunk with ``attention``).
``torch.equal`` on the CPU with CFG on (the reference backend is batch-invariant there; with ``--cfg off`` a
session's lone forward and a batched one round differently on the CPU, so the tolerance applies); on CUDA the batch compositions differ between policies (other kernel
shapes round differently), so the relative error norm must stay within ``--check-tolerance`` (2e-2).
After each policy every session is closed and the pool must be empty (``allocator.num_used == 0``) and
the host tier too (no pages, no bytes), and the migrate replica's pool: ``leak_check``. A failed check prints ``ERROR`` lines and the
exit status is 1 (the JSON is still written).

Writes ``serving.json`` (config, trace, link bandwidth, per policy: metrics, leak check, per-tick and
per-session records, transfers; the check; run metadata) and ``serving.png`` (TTFC and continuous play
per policy; sessions resident / suspended / waiting and device / host bytes over the ticks) into
``--out DIR``; by default the committed results, ``benchmarks/results/serving_<device>.json`` / ``.png``
(a non-default ``--preset`` / ``--compute``: ``serving_<preset>_<compute>_<device>.*``). ``--device cuda``
without CUDA exits 2 with one line.

    python -m benchmarks.serving --device cpu --out /tmp/serving                       # CPU smoke (tiny)
    bash .gpu/run.sh python3 -m benchmarks.serving --out $OUT                          # H200: wan2.1-1.3b model
    bash .gpu/run.sh python3 -m benchmarks.serving --preset wan14b-like --compute attention --out $OUT/14b
    bash .gpu/run.sh python3 -m benchmarks.serving --compile --cfg off --out $OUT/compiled_cfg_off   # issue 45
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import ardiff_modules as am
from ardiff_modules.host import files
from ardiff_modules.host.file_header import encode
from ardiff_modules.models.wan_causal_dit import PRESETS, WanConfig, build_model, make_kv_spec, torch_threads
from benchmarks._timing import environment, fail, parser, result_path, save_json

POLICIES = ("suspend", "close_idle", "queue", "migrate")
#: The CFG streams per session: ``--cfg on`` (default) and ``--cfg off``.
CFG_BRANCHES = {"on": ("cond", "uncond"), "off": ("cond",)}
BRANCHES = CFG_BRANCHES["on"]
ALIASES = {"wan1.3b": "wan2.1-1.3b", "wan14b": "wan14b-like"}
SHORT = {"wan2.1-1.3b": "13b", "wan14b-like": "14b"}
#: ``--sessions`` / ``--resident`` defaults per (device, compute).
DEFAULTS = {
    ("cpu", "model"): {"sessions": 8, "resident": 2},
    ("cpu", "attention"): {"sessions": 8, "resident": 2},
    ("cuda", "model"): {"sessions": 5, "resident": 2},
    ("cuda", "attention"): {"sessions": 10, "resident": 3},
}


# --------------------------------------------------------------------------------- the trace
@dataclasses.dataclass(frozen=True)
class SessionTrace:
    """One user: arrives at tick ``arrival``, streams ``bursts[i]`` chunks, pauses ``pauses[i]`` ticks, ..."""

    sid: str
    index: int
    arrival: int
    bursts: tuple[int, ...]
    pauses: tuple[int, ...]  #: idle ticks after each burst but the last

    @property
    def chunks(self) -> int:
        return sum(self.bursts)


def make_trace(sessions: int, seed: int, *, arrival_gap: tuple[int, int] = (0, 2), bursts: tuple[int, int] = (2, 3),
               burst_chunks: tuple[int, int] = (1, 3), pause_ticks: tuple[int, int] = (3, 6)) -> list[SessionTrace]:
    """A deterministic trace: session ``i`` arrives ``randint(*arrival_gap)`` ticks after session ``i - 1``
    (session 0 at tick 0), streams ``randint(*bursts)`` bursts of ``randint(*burst_chunks)`` chunks with
    ``randint(*pause_ticks)`` idle ticks between them (``random.Random(seed)``, drawn in this order)."""
    rng = random.Random(seed)
    out, tick = [], 0
    for i in range(sessions):
        if i:
            tick += rng.randint(*arrival_gap)
        n = rng.randint(*bursts)
        chunks = tuple(rng.randint(*burst_chunks) for _ in range(n))
        pauses = tuple(rng.randint(*pause_ticks) for _ in range(n - 1))
        out.append(SessionTrace(f"u{i}", i, tick, chunks, pauses))
    return out


def horizon(trace: Sequence[SessionTrace]) -> int:
    """Ticks enough for every policy to finish the trace: the sessions one after another (queue's worst case)."""
    return max(t.arrival for t in trace) + sum(t.chunks + sum(t.pauses) + 1 for t in trace) + 2


# --------------------------------------------------------------------------------- statistics
def pct(values: Sequence[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) with linear interpolation; ``None`` for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = q * (len(xs) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(values: Sequence[float]) -> dict[str, Any]:
    """``{"p50", "p90", "max", "n"}`` (``None`` where there is no value)."""
    return {"p50": pct(values, 0.5), "p90": pct(values, 0.9), "max": max(values) if values else None,
            "n": len(values)}


# --------------------------------------------------------------------------------- compute
class Engine:
    """One batched forward over several sessions at their own chunks: the Wan DiT (``model``) or the layers'
    attention alone (``attention``). Inputs are a function of (session, chunk, step) only."""

    def __init__(self, args: argparse.Namespace, config: WanConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.compute, self.config, self.device, self.dtype, self.seed = args.compute, config, device, dtype, args.seed
        self.branches = CFG_BRANCHES[args.cfg]
        spec = make_kv_spec(config, device, self.branches)
        if self.compute == "attention":  # no cross-attention caches: the layers' self-attention only
            spec = dataclasses.replace(spec, cross_attention=())
        self.spec = dataclasses.replace(spec, dtype=dtype)
        steps = args.denoise_steps
        self.timesteps = [1000.0 * (1 - i / steps) for i in range(steps)] + [0.0]  # the last one commits
        self.generator = torch.Generator(device=device)
        self.model: Any = None
        self.step: Any = None  #: the model, or torch.compile of it (--compile)
        self.params = 0
        if self.compute == "model":
            self.model = build_model(config, seed=args.seed, device=device, dtype=dtype)
            self.params = sum(p.numel() for p in self.model.parameters())
            self.step = self.model
            if args.compile:
                torch._dynamo.reset()
                # Batch sizes 1..resident (and both replicas' pools, fresh per policy): more graphs than the default
                # limit, each compiled in the warm-up before anything is timed (compile_warmup).
                for name in ("recompile_limit", "cache_size_limit"):
                    if hasattr(torch._dynamo.config, name):
                        setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
                if args.compile_scope == "blocks":
                    # Regional compilation (diffusers' compile_repeated_blocks): the 30 blocks share one graph per
                    # batch size (the layer is data in the library's LayerContext), so the compile is ~one block's,
                    # not the whole model's (measured on the H200: 245 s for batch sizes 1..2 whole-model).
                    for block in self.model.blocks:
                        block.compile(fullgraph=True, dynamic=False, backend=args.compile_backend)
                else:
                    self.step = torch.compile(self.model, fullgraph=True, dynamic=False, backend=args.compile_backend)
            with torch.no_grad():
                self.uncond = self.model.embed_text(torch.zeros(config.text_tokens, config.text_dim, device=device))
        c = config
        self.latent_shape = (1, c.frames_per_chunk, c.in_channels, c.latent_height, c.latent_width)
        self.qkv_shape = (len(self.branches), c.chunk_size, c.num_heads, c.head_dim)

    @property
    def forwards_per_step(self) -> int:
        return len(self.timesteps)

    def _randn(self, shape: Sequence[int], *key: int) -> torch.Tensor:
        seed = self.seed
        for k in key:
            seed = seed * 1_000_003 + k + 1
        self.generator.manual_seed(seed % (2**63))
        return torch.randn(tuple(shape), generator=self.generator, device=self.device, dtype=self.dtype)

    def open(self, state: am.KVState, index: int) -> None:
        """A session's conditioning: its text caches (cond: its own prompt, seeded by the session; uncond: zeros)."""
        if self.model is None:
            return
        c = self.config
        text = self._randn((c.text_tokens, c.text_dim), 7_000_000 + index)
        crosses = [block.cross for block in self.model.blocks]
        am.populate_cross_attention(state, "cond", crosses, self.model.embed_text(text))
        if "uncond" in self.branches:
            am.populate_cross_attention(state, "uncond", crosses, self.uncond)

    def forward(self, cache: am.KVCache, members: Sequence[tuple[am.KVState, int, int]], step: int,
                keep: bool = False) -> Any:
        """One forward over ``members`` = ``(state, session index, chunk)``, its CFG streams each, batched in one
        ``prepare_forward``; step ``step`` of the chunk step (the last one commits). Returns the output
        (``keep``: model ``[2n, F, C, H, W]``; attention: every layer's ``[layers, 2n, chunk, heads, dim]``)."""
        commit = step == len(self.timesteps) - 1
        streams = [(state, b) for state, _, _ in members for b in self.branches]
        n = len(streams)
        with cache.prepare_forward(streams, self.spec.chunk_size, commit_current=commit) as fwd:
            if self.model is not None:
                shape = (len(self.branches), *self.latent_shape[1:])  # one latent per session, every stream
                x = torch.cat([self._randn(self.latent_shape, i, chunk).expand(shape) for _, i, chunk in members])
                t = torch.full((n,), self.timesteps[step], device=self.device)
                return self.step(x, t, fwd.layers)
            x = torch.cat([self._randn(self.qkv_shape, index, chunk, step) for _, index, chunk in members])
            outs = [am.chunk_attention(x, x, x, layer) for layer in fwd.layers]
            return torch.stack(outs) if keep else outs[-1]

    def chunk_step(self, cache: am.KVCache, members: Sequence[tuple[am.KVState, int, int]], keep: bool = False) -> Any:
        """The denoising forwards, then the committing one; returns the committing forward's output."""
        for step in range(len(self.timesteps) - 1):
            self.forward(cache, members, step)
        return self.forward(cache, members, len(self.timesteps) - 1, keep)

    def digest(self, out: torch.Tensor, i: int) -> torch.Tensor:
        """Member ``i``'s rows of an output (both of its streams) on the CPU, float32, for the check: all of them,
        or where that is over 4M values (the 14B-like layers' attention outputs) the last layer's and every
        layer's sums per token."""
        nb = len(self.branches)
        rows = out[nb * i : nb * i + nb] if self.model is not None else out[:, nb * i : nb * i + nb]
        if rows.numel() > 1 << 22 and self.model is None:
            rows = torch.cat([rows[-1].flatten().float(), rows.float().sum(dim=(-1, -2)).flatten()])
        return rows.float().cpu()


# --------------------------------------------------------------------------------- device helpers
class Clock:
    """CUDA timing events where the pool is on CUDA; ``None`` (wall time only) on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.aux = torch.cuda.Stream(device) if self.cuda else None

    def event(self) -> Any:
        if not self.cuda:
            return None
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def after_handle(self, handle: Any) -> Any:
        """An event that completes when ``handle``'s copies are done (recorded on a helper stream made to wait
        for them: the compute stream is left to the next ``prepare_forward``)."""
        if not self.cuda:
            return None
        with torch.cuda.stream(self.aux):
            handle.order_current_stream()
            e = torch.cuda.Event(enable_timing=True)
            e.record()
        return e

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    @staticmethod
    def ms(start: Any, end: Any) -> float | None:
        return None if start is None or end is None else float(start.elapsed_time(end))


def link_bandwidth(device: torch.device, sizes_mib: Sequence[int], repeats: int = 5) -> dict[str, Any]:
    """Pinned host->device and device->host copies (CUDA events, median of ``repeats``), GB/s per size; on
    the CPU a plain memcpy (wall time) of each size."""
    out: dict[str, Any] = {"sizes_mib": list(sizes_mib), "repeats": repeats}
    if device.type != "cuda":
        out["method"] = "CPU: torch copy_ between two host tensors (no host link), wall time, median"
        rows = {}
        for mib in sizes_mib:
            a, b = torch.empty(mib << 20, dtype=torch.uint8), torch.empty(mib << 20, dtype=torch.uint8)
            b.copy_(a)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                b.copy_(a)
                times.append(time.perf_counter() - t0)
            rows[str(mib)] = {"gbps": (mib << 20) / statistics.median(times) / 1e9, "samples_s": times}
        out["memcpy"] = rows
        out["h2d_gbps"] = out["d2h_gbps"] = None
        return out
    out["method"] = "pinned host tensor <-> device tensor, copy_(non_blocking=True), CUDA events, median"
    for name in ("h2d", "d2h"):
        out[name] = {}
    for mib in sizes_mib:
        host = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(mib << 20, dtype=torch.uint8, device=device)
        for name, (dst, src) in (("h2d", (dev, host)), ("d2h", (host, dev))):
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            times = []
            for _ in range(repeats):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                dst.copy_(src, non_blocking=True)
                e1.record()
                torch.cuda.synchronize(device)
                times.append(e0.elapsed_time(e1) / 1e3)
            out[name][str(mib)] = {"gbps": (mib << 20) / statistics.median(times) / 1e9, "samples_s": times}
        del host, dev
    largest = str(max(sizes_mib))
    out["h2d_gbps"], out["d2h_gbps"] = out["h2d"][largest]["gbps"], out["d2h"][largest]["gbps"]
    return out


# --------------------------------------------------------------------------------- the server
@dataclasses.dataclass(eq=False)
class Live:
    """A session's state in one policy's run."""

    trace: SessionTrace
    state: am.KVState | None = None
    status: str = "future"  #: future | waiting | active | paused | done
    where: str = "none"  #: none | resident | suspended | closed | replica (migrate: on the second replica)
    chunk: int = 0  #: the next chunk to deliver
    burst: int = 0
    left: int = 0  #: chunks left in the current burst
    return_tick: int = -1
    last_run: int = -1
    arrival_time: float = 0.0
    request_time: float = 0.0  #: when the user wanted the next chunk (policy clock)
    pause_start: float = 0.0
    paused_s: float = 0.0
    t0: float | None = None
    first_tick: int | None = None
    waited_ticks: int = 0
    replay: list[int] = dataclasses.field(default_factory=list)  #: close_idle: chunks to re-prefill
    retained: tuple[int, ...] = ()
    rebuilt: bool = False  #: close_idle: rebuilt at least once (positions restart)
    after_resume: bool = False  #: the next delivered chunk is the first after a resume / rebuild
    deliveries: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    events: list[tuple[int, str]] = dataclasses.field(default_factory=list)

    @property
    def sid(self) -> str:
        return self.trace.sid


class Server:
    """One policy over the trace on a fresh cache (see the module docstring)."""

    def __init__(self, policy: str, engine: Engine, trace: Sequence[SessionTrace], run: Run) -> None:
        self.policy, self.engine, self.run = policy, engine, run
        self.args = run.args
        self.clock_dev = Clock(run.device)
        self.cache = am.KVCache(engine.spec, num_pages=run.pool_pages, device=run.device, backend=run.backend,
                                host_budget_bytes=run.host_budget, contiguous_extents=run.args.extents)
        # migrate: the second replica (another GPU's pool in a fleet), in this process on the same device.
        self.replica = am.KVCache(engine.spec, num_pages=run.replica_pages, device=run.device, backend=run.backend,
                                  contiguous_extents=run.args.extents) if policy == "migrate" else None
        self.sessions = [Live(t) for t in trace]
        self.arrivals: dict[int, list[Live]] = collections.defaultdict(list)
        for s in self.sessions:
            self.arrivals[s.trace.arrival].append(s)
        self.waiting: collections.deque[Live] = collections.deque()
        self.clock = 0.0
        self.ticks: list[dict[str, Any]] = []
        self.transfers: list[dict[str, Any]] = []
        self.outputs: dict[tuple[str, int], dict[str, Any]] = {}
        self.truncated = False

    # ------------------------------------------------------------------ room
    def fits(self) -> bool:
        return self.cache.sessions_that_fit(recache=False) >= 1

    def victims(self) -> list[Live]:
        """Resident paused sessions, least recently used first (the last tick they streamed, then the order
        they paused in)."""
        idle = [s for s in self.sessions if s.where == "resident" and s.status == "paused"]
        return sorted(idle, key=lambda s: (s.last_run, s.trace.index))

    def make_room(self, tick: int, rec: dict[str, Any]) -> bool:
        while not self.fits():
            if self.policy == "queue":
                return False
            victims = self.victims()
            if not victims:
                return False
            v = victims[0]
            if self.policy == "suspend":
                try:
                    self.suspend(v, tick, rec)
                except am.CapacityError:  # the host budget is full: wait
                    return False
            elif self.policy == "migrate":
                if self.replica.sessions_that_fit(recache=False) < 1:  # type: ignore[union-attr]
                    return False  # the second replica is full too: wait
                self.move(v, self.cache, self.replica, tick, rec, "migrate_out")  # type: ignore[arg-type]
            else:
                self.close_idle(v, tick, rec)
        return True

    def suspend(self, s: Live, tick: int, rec: dict[str, Any]) -> None:
        before = self.cache.tiers().host_bytes
        e0 = self.clock_dev.event()
        h0 = time.perf_counter()
        s.state.suspend()  # type: ignore[union-attr]
        host = time.perf_counter() - h0
        e1 = self.clock_dev.event()
        s.where = "suspended"
        s.events.append((tick, "suspended"))
        rec["suspends"] += 1
        self.transfers.append({"kind": "suspend", "sid": s.sid, "tick": tick, "host_ms": host * 1e3,
                               "bytes": self.cache.tiers().host_bytes - before, "_events": (e0, e1)})

    def move(self, s: Live, src: am.KVCache, dst: am.KVCache, tick: int, rec: dict[str, Any], kind: str) -> None:
        """migrate: ``s``'s session from ``src`` to ``dst`` -- what ``send_sessions`` / ``recv_sessions`` do minus
        the wire: the snapshot's tensors gathered on the device (one page gather per lane, no host copy, no
        digests), checked and opened on ``dst`` (reserve, one page copy, open), then closed on ``src``."""
        e0 = self.clock_dev.event()
        h0 = time.perf_counter()
        tensors, header = files.snapshot(src, [s.state], kind, device=dst.device)  # type: ignore[list-item]
        [moved] = files.open_snapshot(dst, kind, encode(header), tensors, None, digests=False)
        s.state.close()  # type: ignore[union-attr]
        host = time.perf_counter() - h0
        e1 = self.clock_dev.event()
        s.state = moved
        inbound = kind == "migrate_in"
        s.where, s.after_resume = ("resident", True) if inbound else ("replica", s.after_resume)
        s.events.append((tick, "migrated_in" if inbound else "migrated_out"))
        rec["migrations"] += 1
        self.transfers.append({"kind": kind, "sid": s.sid, "tick": tick, "host_ms": host * 1e3,
                               "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
                               "_events": (e0, e1)})

    def close_idle(self, s: Live, tick: int, rec: dict[str, Any]) -> None:
        s.retained = self.engine_history(s.state)
        s.state.close()  # type: ignore[union-attr]
        s.state, s.where = None, "closed"
        s.events.append((tick, "closed"))
        rec["closes"] += 1

    @staticmethod
    def engine_history(state: Any) -> tuple[int, ...]:
        return tuple(state.history_chunk_indices(state.kv_branch_names[0]))

    # ------------------------------------------------------------------ placing a waiting session
    def place(self, s: Live, tick: int, rec: dict[str, Any], rebuilding: list[Live]) -> None:
        if s.where == "replica":  # migrate policy, a returning session: back to the replica that computes
            self.move(s, self.replica, self.cache, tick, rec, "migrate_in")  # type: ignore[arg-type]
            return
        if s.where == "suspended":  # suspend policy, a returning session
            before = self.cache.tiers().host_bytes
            e0 = self.clock_dev.event()
            h0 = time.perf_counter()
            handle = s.state.resume()  # type: ignore[union-attr]
            host = time.perf_counter() - h0
            e1 = self.clock_dev.after_handle(handle)
            s.where, s.after_resume = "resident", True
            s.events.append((tick, "resumed"))
            rec["resumes"] += 1
            self.transfers.append({"kind": "resume", "sid": s.sid, "tick": tick, "host_ms": host * 1e3,
                                   "bytes": before - self.cache.tiers().host_bytes, "_events": (e0, e1)})
            return
        suspend_idle = self.policy == "suspend"
        s.state = self.cache.admit_session(s.sid, recache=False, suspend_idle=suspend_idle)
        self.engine.open(s.state, s.trace.index)
        if s.where == "closed":  # close_idle, a returning session: re-prefill its retained chunks
            s.replay, s.rebuilt, s.after_resume = list(s.retained), True, True
            s.events.append((tick, "reopened"))
            rebuilding.append(s)
        s.where = "resident"
        self.reconcile()

    def reconcile(self) -> None:
        """The library suspends nothing on its own here (the scheduler made the room): check it."""
        suspended = set(self.cache.tiers().suspended)
        for s in self.sessions:
            if (s.sid in suspended) != (s.where == "suspended") and s.state is not None:
                raise AssertionError(f"{self.policy}: session {s.sid} suspended behind the scheduler's back")

    def reprefill(self, rebuilding: list[Live], tick: int, rec: dict[str, Any], start: tuple[Any, float]) -> None:
        """close_idle: the rebuilding sessions' retained chunks through committing forwards, batched per depth."""
        depth = max((len(s.replay) for s in rebuilding), default=0)
        forwards = 0
        h0 = time.perf_counter()
        commit_step = self.engine.forwards_per_step - 1
        for j in range(depth):
            members = [(s.state, s.trace.index, s.replay[j]) for s in rebuilding if j < len(s.replay)]
            self.engine.forward(self.cache, members, commit_step)  # type: ignore[arg-type]
            forwards += 1
        host = start[1] + time.perf_counter() - h0
        e1 = self.clock_dev.event()
        rec["reprefill_forwards"] += forwards
        # K/V rebuilt: the history pages (not a contiguous extent's reserved slots)
        states = [s.state for s in rebuilding]
        pages = sum(len(c) for st in states for b in self.engine.branches for c in st.history_chunks(b))  # type: ignore[union-attr]
        self.transfers.append({
            "kind": "reprefill", "sids": [s.sid for s in rebuilding], "tick": tick, "host_ms": host * 1e3,
            "forwards": forwards, "chunks": sum(len(s.replay) for s in rebuilding),
            "bytes": pages * self.cache.stats().bytes_per_page, "_events": (start[0], e1)})
        for s in rebuilding:
            s.replay = []

    # ------------------------------------------------------------------ one tick
    def tick(self, t: int, check: bool) -> dict[str, Any]:
        rec: dict[str, Any] = {"tick": t, "suspends": 0, "resumes": 0, "closes": 0, "reprefill_forwards": 0,
                               "migrations": 0, "admitted": 0}
        start = self.clock
        h0 = time.perf_counter()
        ev0 = self.clock_dev.event()
        for s in self.arrivals.get(t, ()):
            s.status, s.arrival_time, s.request_time = "waiting", start, start
            s.events.append((t, "arrived"))
            self.waiting.append(s)
        for s in self.sessions:
            if s.status == "paused" and s.return_tick == t:
                s.paused_s += start - s.pause_start
                s.request_time = start
                s.events.append((t, "returned"))
                if s.where == "resident":
                    s.status = "active"
                else:
                    s.status = "waiting"
                    self.waiting.append(s)
        rebuilding: list[Live] = []
        reopen_event, reopen_host = None, 0.0  # close_idle: the reopening of returning sessions starts their rebuild
        while self.waiting:
            if not self.make_room(t, rec):
                break
            s = self.waiting.popleft()
            returning_closed = s.where == "closed"
            if returning_closed and reopen_event is None:
                reopen_event = self.clock_dev.event()
            r0 = time.perf_counter()
            self.place(s, t, rec, rebuilding)
            if returning_closed:
                reopen_host += time.perf_counter() - r0
            s.status = "active"
            rec["admitted"] += 1
        if rebuilding:
            self.reprefill(rebuilding, t, rec, (reopen_event, reopen_host))
        active = [s for s in self.sessions if s.status == "active"]
        out = None
        if active:
            members = [(s.state, s.trace.index, s.chunk) for s in active]
            out = self.engine.chunk_step(self.cache, members, keep=check)  # type: ignore[arg-type]
        for s in self.waiting:
            s.waited_ticks += 1
        ev1 = self.clock_dev.event()
        host_a = time.perf_counter() - h0
        self.clock_dev.sync()
        ready = time.perf_counter()
        ready_clock = start + (ready - h0)
        for i, s in enumerate(active):
            self.deliver(s, t, ready_clock)
        end = time.perf_counter()
        wall = end - h0
        span = max(wall, self.run.tick_floor_s)  # an idle or short tick lasts the floor on the policy clock
        self.clock = start + span
        if check and out is not None:  # untimed: the outputs the check compares
            for i, s in enumerate(active):
                d = s.deliveries[-1]
                self.outputs[(s.sid, d["chunk"])] = {
                    "out": self.engine.digest(out, i), "after_resume": d["after_resume"],
                    "rebuilt_before": d["rebuilt_before"]}
        report = self.cache.tiers()
        rec.update(
            wall_ms=wall * 1e3, clock_ms=span * 1e3, host_ms=(host_a + end - ready) * 1e3, device_ms=Clock.ms(ev0, ev1),
            active=len(active), delivered=len(active), resident=len(report.resident),
            suspended=len(report.suspended), waiting=len(self.waiting), device_bytes=report.device_bytes_used,
            host_bytes=report.host_bytes, clock_s=self.clock,
            replica=sum(x.where == "replica" for x in self.sessions),
            replica_bytes=0 if self.replica is None else self.replica.tiers().device_bytes_used,
        )
        self.ticks.append(rec)
        return rec

    def deliver(self, s: Live, t: int, now: float) -> None:
        cs = self.args.chunk_seconds
        c = s.chunk
        first = s.t0 is None
        if first:
            s.t0, s.first_tick = now, t
        due = None if first else s.t0 + c * cs + s.paused_s  # type: ignore[operator]
        s.deliveries.append({
            "chunk": c, "tick": t, "time": now, "due": due, "on_time": None if due is None else now <= due,
            "rtf": None if first else (now - s.request_time) / cs, "after_resume": s.after_resume,
            "rebuilt_before": s.rebuilt,
        })
        s.after_resume = False
        s.request_time, s.last_run = now, t
        s.chunk += 1
        s.left -= 1
        if s.left > 0:
            return
        if s.burst == len(s.trace.bursts) - 1:  # the session leaves
            s.state.close()  # type: ignore[union-attr]
            s.state, s.status, s.where = None, "done", "none"
            s.events.append((t, "left"))
            return
        s.status, s.return_tick, s.pause_start = "paused", t + s.trace.pauses[s.burst] + 1, now
        s.burst += 1
        s.left = s.trace.bursts[s.burst]

    # ------------------------------------------------------------------ warm-up and the whole run
    def warmup(self) -> float:
        """One untimed tick: a warm-up session streams, goes through the policy's round trip, streams, closes."""
        t0 = time.perf_counter()
        state = self.cache.admit_session("warmup", recache=False)
        self.engine.open(state, 10_000)
        self.engine.chunk_step(self.cache, [(state, 10_000, 0)])
        if self.policy == "suspend":
            # A server's warm start: pin the host pages the trace's extra sessions need ahead of time.
            extra = max(0, len(self.sessions) - self.run.resident) + 1
            self.cache.reserve_host(extra * self.cache.pages_per_session() * self.cache.stats().bytes_per_page)
            state.suspend()
            state.resume()
        elif self.policy == "migrate":
            rec: dict[str, Any] = collections.Counter()
            live = Live(SessionTrace("warmup", 10_000, 0, (1,), ()), state=state, where="resident")
            self.move(live, self.cache, self.replica, -1, rec, "migrate_out")  # type: ignore[arg-type]
            self.move(live, self.replica, self.cache, -1, rec, "migrate_in")  # type: ignore[arg-type]
            state = live.state  # type: ignore[assignment]
            self.transfers.clear()
        elif self.policy == "close_idle":
            kept = self.engine_history(state)
            state.close()
            state = self.cache.admit_session("warmup", recache=False)
            self.engine.open(state, 10_000)
            for c in kept:
                self.engine.forward(self.cache, [(state, 10_000, c)], self.engine.forwards_per_step - 1)
        self.engine.chunk_step(self.cache, [(state, 10_000, 1)])
        state.close()
        if self.args.compile:  # this policy's fresh pool under the compiled model: every batch size (untimed)
            compile_warmup(self.engine, self.cache, self.run.resident, chunks=2)
        self.clock_dev.sync()
        return time.perf_counter() - t0

    def play(self, max_ticks: int, check: bool, time_limit: float | None, progress: bool) -> None:
        for s in self.sessions:
            s.left = s.trace.bursts[0]
        begin = time.perf_counter()
        last_print = begin
        for t in range(max_ticks):
            self.tick(t, check)
            if all(s.status == "done" for s in self.sessions):
                break
            now = time.perf_counter()
            if time_limit is not None and now - begin > time_limit:
                self.truncated = True
                print(f"  {self.policy}: --policy-time-limit {time_limit:g} s reached at tick {t}: truncated",
                      flush=True)
                break
            if progress and now - last_print > 10:
                done = sum(len(s.deliveries) for s in self.sessions)
                print(f"  {self.policy}: tick {t}, {done} chunks delivered, {now - begin:.1f} s", flush=True)
                last_print = now

    def close_all(self) -> dict[str, Any]:
        """Close every session left (a truncated run's), then the leak check (pool and host tier empty)."""
        for s in self.sessions:
            if s.state is not None:
                s.state.close()
                s.state = None
        report, stats = self.cache.tiers(), self.cache.stats()
        check = {"device_pages_used": stats.pages_used, "device_pages_free": stats.pages_free,
                 "pool_pages": stats.num_pages, "host_pages": report.host_pages,
                 "host_bytes": report.host_bytes, "resident": len(report.resident), "suspended": len(report.suspended)}
        check["replica_pages_used"] = 0 if self.replica is None else self.replica.stats().pages_used
        check["ok"] = (check["device_pages_used"] == 0 and check["host_pages"] == 0 and check["host_bytes"] == 0
                       and not report.resident and not report.suspended and check["replica_pages_used"] == 0)
        return check


# --------------------------------------------------------------------------------- metrics
def _transfer_rows(server: Server, chunk_step_ms: float | None) -> list[dict[str, Any]]:
    rows = []
    for tr in server.transfers:
        row = {k: v for k, v in tr.items() if k != "_events"}
        device_ms = Clock.ms(*tr["_events"]) if server.clock_dev.cuda else tr["host_ms"]
        row["device_ms"] = device_ms
        row["gbps"] = tr["bytes"] / (device_ms / 1e3) / 1e9 if device_ms else None
        latency = max(device_ms or 0.0, tr["host_ms"])  # what the session waits: the later of the two
        row["latency_ms"] = latency
        row["fraction_of_chunk_step"] = latency / chunk_step_ms if chunk_step_ms else None
        rows.append(row)
    return rows


def _transfer_metrics(rows: Sequence[dict[str, Any]], kind: str, link_gbps: float | None) -> dict[str, Any]:
    sel = [r for r in rows if r["kind"] == kind]
    gbps = [r["gbps"] for r in sel if r["gbps"] is not None]
    out: dict[str, Any] = {
        "count": len(sel),
        "host_ms": summary([r["host_ms"] for r in sel]),
        "device_ms": summary([r["device_ms"] for r in sel if r["device_ms"] is not None]),
        "latency_ms": summary([r["latency_ms"] for r in sel]),
        "fraction_of_chunk_step": summary([r["fraction_of_chunk_step"] for r in sel
                                           if r["fraction_of_chunk_step"] is not None]),
        "bytes_total": sum(r["bytes"] for r in sel),
        "bytes": summary([r["bytes"] for r in sel]),
        "gbps": summary(gbps),
        "gbps_vs_link": (pct(gbps, 0.5) / link_gbps) if gbps and link_gbps else None,
    }
    if kind == "reprefill":
        out["forwards"] = sum(r["forwards"] for r in sel)
        out["chunks"] = sum(r["chunks"] for r in sel)
    return out


def metrics(server: Server, run: Run) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    args = run.args
    sessions, ticks = server.sessions, server.ticks
    ttfc = [s.t0 - s.arrival_time for s in sessions if s.t0 is not None]
    ttfc_ticks = [s.first_tick - s.trace.arrival + 1 for s in sessions if s.first_tick is not None]
    later = [d for s in sessions for d in s.deliveries if d["due"] is not None]
    chunks = sum(len(s.deliveries) for s in sessions)
    clock = sum(r["clock_ms"] for r in ticks) / 1e3
    busy = sum(r["wall_ms"] for r in ticks) / 1e3
    rows = _transfer_rows(server, run.chunk_step_ms)
    link = run.link.get("h2d_gbps") if run.link else None
    link_d2h = run.link.get("d2h_gbps") if run.link else None
    working = [r for r in ticks if r["active"] or r["suspends"] or r["resumes"] or r["reprefill_forwards"]
               or r["migrations"]]
    return {
        "ttfc_s": summary(ttfc),
        "ttfc_ticks": summary(ttfc_ticks),
        "rtf": summary([d["rtf"] for d in later]),
        "rtf_aggregate": clock / (chunks * args.chunk_seconds) if chunks else None,
        "continuous_play_ratio": (sum(bool(d["on_time"]) for d in later) / len(later)) if later else None,
        "chunks_on_time": sum(bool(d["on_time"]) for d in later),
        "chunks_with_deadline": len(later),
        "chunks_delivered": chunks,
        "frames_delivered": chunks * run.frames_per_chunk,
        "clock_s": clock,
        "busy_s": busy,
        "frames_per_gpu_second": chunks * run.frames_per_chunk / clock if clock > 0 else None,
        "frames_per_busy_second": chunks * run.frames_per_chunk / busy if busy > 0 else None,
        "ticks": len(ticks),
        "ticks_with_work": len(working),
        "host_ms_per_tick": summary([r["host_ms"] for r in working]),
        "wall_ms_per_tick": summary([r["wall_ms"] for r in working]),
        "resume": _transfer_metrics(rows, "resume", link),
        "suspend": _transfer_metrics(rows, "suspend", link_d2h),
        "reprefill": _transfer_metrics(rows, "reprefill", None),
        "migrate_out": _transfer_metrics(rows, "migrate_out", None),
        "migrate_in": _transfer_metrics(rows, "migrate_in", None),
        "peak": {
            "device_bytes": max((r["device_bytes"] for r in ticks), default=0),
            "host_bytes": max((r["host_bytes"] for r in ticks), default=0),
            "resident": max((r["resident"] for r in ticks), default=0),
            "suspended": max((r["suspended"] for r in ticks), default=0),
            "waiting": max((r["waiting"] for r in ticks), default=0),
            "replica": max((r["replica"] for r in ticks), default=0),
            "replica_bytes": max((r["replica_bytes"] for r in ticks), default=0),
            "active": max((r["active"] for r in ticks), default=0),
            "cuda_max_allocated_bytes": None,
        },
        "sessions_total": len(sessions),
        "sessions_served": sum(s.t0 is not None for s in sessions),
        "sessions_finished": sum(s.status == "done" for s in sessions),
        "suspends": sum(r["suspends"] for r in ticks),
        "resumes": sum(r["resumes"] for r in ticks),
        "closes": sum(r["closes"] for r in ticks),
        "migrations": sum(r["migrations"] for r in ticks),
        "truncated": server.truncated,
    }, rows


def session_rows(server: Server) -> list[dict[str, Any]]:
    out = []
    for s in server.sessions:
        t = s.trace
        later = [d for d in s.deliveries if d["due"] is not None]
        out.append({
            "sid": t.sid, "arrival_tick": t.arrival, "bursts": list(t.bursts), "pauses": list(t.pauses),
            "chunks": t.chunks, "delivered": len(s.deliveries), "first_chunk_tick": s.first_tick,
            "ttfc_s": None if s.t0 is None else s.t0 - s.arrival_time,
            "ttfc_ticks": None if s.first_tick is None else s.first_tick - t.arrival + 1,
            "waited_ticks": s.waited_ticks, "on_time": sum(bool(d["on_time"]) for d in later),
            "with_deadline": len(later), "paused_s": s.paused_s,
            "suspends": sum(e == "suspended" for _, e in s.events), "resumes": sum(e == "resumed" for _, e in s.events),
            "closes": sum(e == "closed" for _, e in s.events),
            "migrations": sum(e.startswith("migrated") for _, e in s.events), "rebuilds": sum(e == "reopened" for _, e in s.events),
            "events": [list(e) for e in s.events], "deliveries": s.deliveries, "status": s.status,
        })
    return out


# --------------------------------------------------------------------------------- the check
def compare(outputs: dict[str, dict[tuple[str, int], dict[str, Any]]], *, exact: bool, tolerance: float,
            positions_restart: bool) -> dict[str, Any]:
    """Every (session, chunk) of ``suspend`` / ``close_idle`` / ``migrate`` vs ``queue`` (see the module docstring)."""
    reference = outputs.get("queue", {})
    result: dict[str, Any] = {"exact": exact, "tolerance": None if exact else tolerance, "pairs": {}, "ok": True,
                              "mismatches": []}
    for policy in ("suspend", "close_idle", "migrate"):
        got = outputs.get(policy)
        if got is None:
            continue
        pair = {"compared": 0, "equal": 0, "after_resume": 0, "skipped_after_rebuild": 0, "missing_reference": 0,
                "max_abs_diff": 0.0, "max_rel_err": 0.0}
        for key, entry in sorted(got.items()):
            if policy == "close_idle" and positions_restart and entry["rebuilt_before"]:
                pair["skipped_after_rebuild"] += 1
                continue
            ref = reference.get(key)
            if ref is None:
                pair["missing_reference"] += 1
                continue
            a, b = entry["out"], ref["out"]
            diff = (a - b).abs().max().item() if a.numel() else 0.0
            rel = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
            same = torch.equal(a, b) if exact else rel <= tolerance
            pair["compared"] += 1
            pair["equal"] += same
            pair["after_resume"] += bool(entry["after_resume"])
            pair["max_abs_diff"] = max(pair["max_abs_diff"], diff)
            pair["max_rel_err"] = max(pair["max_rel_err"], rel)
            if not same:
                result["ok"] = False
                if len(result["mismatches"]) < 20:
                    result["mismatches"].append({"policy": policy, "sid": key[0], "chunk": key[1], "max_abs_diff": diff,
                                                 "rel_err": rel, "after_resume": entry["after_resume"]})
        result["pairs"][f"{policy}_vs_queue"] = pair
    return result


# --------------------------------------------------------------------------------- the run
@dataclasses.dataclass
class Run:
    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    config: WanConfig
    backend: str
    pool_pages: int = 0
    replica_pages: int = 0
    compile_warmup_s: float | None = None
    pages_per_session: int = 0
    host_budget: int | None = None
    frames_per_chunk: int = 12
    chunk_step_ms: float | None = None
    chunk_step_samples_ms: list[float] = dataclasses.field(default_factory=list)
    link: dict[str, Any] | None = None
    tick_floor_s: float = 0.0
    resident: int = 0
    check: bool = False
    max_ticks: int = 0


def compile_warmup(engine: Engine, cache: am.KVCache, resident: int, chunks: int) -> None:
    """``--compile``: every batch size a tick may run (1..``resident`` sessions), denoising and committing
    forwards, ``chunks`` chunk steps each on ``cache`` (its sessions closed after): the graphs compile here, not in
    a timed tick."""
    for n in range(1, resident + 1):
        states = [cache.admit_session(f"compile{k}", recache=False) for k in range(n)]
        for k, state in enumerate(states):
            engine.open(state, 30_000 + k)
        for c in range(chunks):
            engine.chunk_step(cache, [(state, 30_000 + k, c) for k, state in enumerate(states)])
        for state in states:
            state.close()


def calibrate(engine: Engine, run: Run) -> None:
    """One session's chunk step at its full window: ``sink + window + 2`` steps, the last 2 timed (each alone,
    the device synchronised before and after)."""
    cache = am.KVCache(engine.spec, num_pages=run.pages_per_session, device=run.device, backend=run.backend)
    state = cache.open_session("calibration")
    engine.open(state, 20_000)
    sync = Clock(run.device).sync
    samples = []
    steps = run.config.sink_chunks + run.config.window_chunks + 2
    for c in range(steps):
        sync()
        t0 = time.perf_counter()
        engine.chunk_step(cache, [(state, 20_000, c)])
        sync()
        if c >= steps - 2:
            samples.append((time.perf_counter() - t0) * 1e3)
    state.close()
    cache.close()
    run.chunk_step_samples_ms = samples
    run.chunk_step_ms = statistics.median(samples)


def play_policy(policy: str, engine: Engine, trace: Sequence[SessionTrace], run: Run) -> tuple[dict[str, Any], Any]:
    args, cuda = run.args, run.device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.synchronize(run.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(run.device)
    server = Server(policy, engine, trace, run)
    warm = server.warmup()
    print(f"policy {policy}: warm-up tick {warm:.2f} s (untimed); playing {len(trace)} sessions, "
          f"{sum(t.chunks for t in trace)} chunks, pool of {run.resident} sessions ({run.pool_pages} pages)",
          flush=True)
    graphs = _graphs_compiled()
    t0 = time.perf_counter()
    server.play(run.max_ticks, run.check, args.policy_time_limit, progress=True)
    played = time.perf_counter() - t0
    result_metrics, rows = metrics(server, run)
    # --compile: graphs dynamo compiled inside the timed trace (0 when the warm-up covered every shape)
    result_metrics["graphs_compiled_during_play"] = _graphs_compiled() - graphs if args.compile else None
    if cuda:
        result_metrics["peak"]["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(run.device)
    leak = server.close_all()
    server.cache.close()
    if server.replica is not None:
        server.replica.close()
    m = result_metrics
    print(f"policy {policy}: {m['chunks_delivered']} chunks in {m['ticks']} ticks, {m['clock_s']:.2f} s on its clock, "
          f"{m['busy_s']:.2f} s busy "
          f"({played:.1f} s with the check's copies), {m['sessions_finished']}/{m['sessions_total']} finished; "
          f"{m['suspends']} suspends, {m['resumes']} resumes, {m['closes']} closes, {m['migrations']} migrations; "
          f"leak check "
          f"{'ok' if leak['ok'] else 'FAILED'}", flush=True)
    result = {"metrics": m, "leak_check": leak, "warmup_s": warm, "ticks": server.ticks,
              "sessions": session_rows(server), "transfers": rows}
    outputs = server.outputs
    del server
    gc.collect()
    return result, outputs


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _range(text: str) -> tuple[int, int]:
    parts = [int(p) for p in str(text).replace("-", ",").split(",") if p.strip()]
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or parts[0] < 0 or parts[1] < parts[0]:
        raise argparse.ArgumentTypeError(f"expected LO,HI with 0 <= LO <= HI (or one number), got {text!r}")
    return parts[0], parts[1]


def build_parser() -> argparse.ArgumentParser:
    p = parser(__doc__)
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available, else cpu")
    p.add_argument("--preset", choices=sorted(PRESETS) + sorted(ALIASES), default=None,
                   help="model / attention geometry (default: wan2.1-1.3b on CUDA, tiny on the CPU; "
                        "wan1.3b = wan2.1-1.3b)")
    p.add_argument("--compute", choices=("model", "attention"), default="model",
                   help="per tick: the whole Wan DiT (model, default) or the layers' chunk_attention alone")
    p.add_argument("--cfg", choices=("on", "off"), default="on",
                   help="CFG: on (cond + uncond streams per session, default) or off (cond only: the setting that runs "
                        "in real time at the 1.3B shape, compiled)")
    p.add_argument("--compile", action="store_true",
                   help="model compute: torch.compile(model, fullgraph=True, dynamic=False), every batch size compiled "
                        "in an untimed warm-up (the library_compiled row of benchmarks.end_to_end)")
    p.add_argument("--compile-scope", choices=("model", "blocks"), default="model",
                   help="--compile: the whole model as one graph (default) or each transformer block (regional "
                        "compilation, one graph shared by the blocks: a fraction of the compile time)")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend for --compile (default inductor; the CPU smoke test uses eager)")
    p.add_argument("--replica-resident", type=int, default=None,
                   help="migrate: sessions the second replica's pool holds at their peak (default: --resident, a "
                        "second replica of the same size)")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated subset of {POLICIES} "
                   "(the check needs queue)")
    p.add_argument("--sessions", type=int, default=None,
                   help="sessions in the trace (default: 8 on the CPU, 5 for CUDA model, 10 for CUDA attention)")
    p.add_argument("--resident", type=int, default=None,
                   help="sessions the device pool holds at their peak (default: 2; 3 for CUDA attention)")
    p.add_argument("--ticks", type=int, default=None,
                   help="the most ticks per policy (default: enough for every policy to finish the trace)")
    p.add_argument("--seed", type=int, default=0, help="the trace, the weights and the inputs (default 0)")
    p.add_argument("--arrival-gap", type=_range, default=(0, 2), help="ticks between arrivals, LO,HI (default 0,2)")
    p.add_argument("--bursts", type=_range, default=(2, 3), help="bursts per session, LO,HI (default 2,3)")
    p.add_argument("--burst-chunks", type=_range, default=(1, 3), help="chunks per burst, LO,HI (default 1,3)")
    p.add_argument("--pause-ticks", type=_range, default=(3, 6), help="idle ticks between bursts, LO,HI (default 3,6)")
    p.add_argument("--denoise-steps", type=int, default=4, help="denoising forwards per chunk step (default 4; "
                   "then 1 committing forward)")
    p.add_argument("--chunk-seconds", type=float, default=0.75,
                   help="video seconds per chunk (default 0.75 = 12 frames at 16 fps)")
    p.add_argument("--tick-seconds", type=float, default=None,
                   help="the tick floor: a tick lasts at least this long on the policy clock (default: one session's "
                        "chunk step, measured)")
    p.add_argument("--fps", type=float, default=16.0, help="video frames per second (default 16)")
    p.add_argument("--extents", action=argparse.BooleanOptionalAction, default=None,
                   help="contiguous extents (default: the library's choice; --no-extents: plain paging, which a "
                        "pool sized for R sessions at peak needs once suspends fragment it -- admission counts pages, "
                        "not runs)")
    p.add_argument("--host-budget-gib", type=float, default=None, help="host tier budget (default: unbounded)")
    p.add_argument("--backend", default=None, help="KVCache backend (default: auto on CUDA, reference on the CPU)")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                   help="compare suspend / close_idle outputs with queue's (default: on for the CPU, off on CUDA)")
    p.add_argument("--check-tolerance", type=float, default=2e-2,
                   help="CUDA: the largest relative error norm of a chunk's output vs queue's (default 2e-2)")
    p.add_argument("--link-sizes-mib", default=None,
                   help="sizes of the link bandwidth copies, comma-separated (default 256,1024 on CUDA, 16,64 CPU)")
    p.add_argument("--policy-time-limit", type=float, default=None,
                   help="stop a policy's trace after this many seconds (reported as truncated; default none)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: 1 for tiny on the CPU)")
    p.add_argument("--allow-big-cpu", action="store_true", help="allow a preset other than tiny on the CPU")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for serving.json / .png (default: the committed results, "
                        "benchmarks/results/serving[_<preset>_<compute>]_<device>.json / .png)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        fail(p.prog, "--device cuda: CUDA is not available (torch.cuda.is_available() is False); "
                     "use --device cpu for a smoke run")
    cuda = args.device == "cuda"
    default_preset = "wan2.1-1.3b" if cuda else "tiny"
    args.preset = ALIASES.get(args.preset, args.preset) or default_preset
    args.default_config = args.preset == default_preset and args.compute == "model"
    if args.preset != "tiny" and not cuda and not args.allow_big_cpu:
        p.error(f"--preset {args.preset} on the CPU: expected --device cuda (or pass --allow-big-cpu)")
    for key, value in DEFAULTS[(args.device, args.compute)].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.policies = tuple(dict.fromkeys(x.strip() for x in args.policies.split(",") if x.strip()))
    unknown = [x for x in args.policies if x not in POLICIES]
    if unknown or not args.policies:
        p.error(f"--policies: expected names from {POLICIES}, got {args.policies}")
    if args.sessions < 1 or args.resident < 1 or args.denoise_steps < 0 or args.chunk_seconds <= 0 or args.fps <= 0:
        p.error("--sessions / --resident must be >= 1, --denoise-steps >= 0, --chunk-seconds and --fps > 0")
    if args.compile and args.compute != "model":
        p.error("--compile: expected --compute model (the attention compute has no model to compile)")
    if args.replica_resident is None:
        args.replica_resident = args.resident
    if args.replica_resident < 1:
        p.error("--replica-resident: expected >= 1")
    if args.ticks is not None and args.ticks < 1:
        p.error("--ticks: expected >= 1")
    if args.check is None:
        args.check = not cuda
    if args.check and "queue" not in args.policies:
        p.error("--check compares with the queue policy: keep queue in --policies (or pass --no-check)")
    sizes = args.link_sizes_mib or ("256,1024" if cuda else "16,64")
    args.link_sizes_mib = [int(x) for x in str(sizes).split(",") if x.strip()]
    if args.backend is None:
        args.backend = "auto" if cuda else "reference"
    return args


def _stem(args: argparse.Namespace) -> str:
    if args.out is not None or (args.default_config and args.cfg == "on" and not args.compile):
        return "serving"
    tags = "".join(("_compiled" if args.compile else "", f"_cfg_{args.cfg}" if args.cfg == "off" else ""))
    return f"serving_{SHORT.get(args.preset, args.preset)}_{args.compute}{tags}"


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark per ``argv``; writes the JSON (+ PNG) and returns the payload (``ok``: every check passed)."""
    args = parse_args(argv)
    with torch_threads(args.threads, args.preset, args.device), torch.no_grad():
        return _run(args)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = WanConfig.preset(args.preset)
    r = Run(args, device, dtype, config, args.backend)
    if device.type == "cuda":
        r.link = link_bandwidth(device, args.link_sizes_mib)
        print(f"host link: pinned H2D {r.link['h2d_gbps']:.1f} GB/s, D2H {r.link['d2h_gbps']:.1f} GB/s "
              f"({max(args.link_sizes_mib)} MiB, median of {r.link['repeats']})", flush=True)
    else:
        r.link = link_bandwidth(device, args.link_sizes_mib)
    engine = Engine(args, config, device, dtype)
    probe = am.KVCache(engine.spec, num_pages=1, device=device, backend=args.backend, contiguous_extents=args.extents)
    r.pages_per_session, bpp, backend_name = probe.pages_per_session(), probe.stats().bytes_per_page, probe.backend.name
    extents = probe.extent_chunks
    probe.close()
    r.resident, r.check = args.resident, args.check
    r.pool_pages = args.resident * r.pages_per_session
    r.replica_pages = args.replica_resident * r.pages_per_session
    r.host_budget = None if args.host_budget_gib is None else int(args.host_budget_gib * 2**30)
    r.frames_per_chunk = round(args.chunk_seconds * args.fps)
    trace = make_trace(args.sessions, args.seed, arrival_gap=args.arrival_gap, bursts=args.bursts,
                       burst_chunks=args.burst_chunks, pause_ticks=args.pause_ticks)
    r.max_ticks = args.ticks or horizon(trace)
    print(f"serving: {config.name} ({args.compute}{f', {engine.params / 1e6:.1f}M params' if engine.params else ''}), "
          f"{config.num_layers} layers, chunk {config.chunk_size} tokens, sink {config.sink_chunks} + window "
          f"{config.window_chunks}; {dtype}, {device}, backend {backend_name}"
          f"{' (contiguous extents)' if extents else ''}; {args.sessions} sessions, pool for {args.resident} "
          f"({r.pool_pages} pages x {bpp / 2**20:.2f} MiB = {r.pool_pages * bpp / 2**30:.2f} GiB); "
          f"{args.denoise_steps} + 1 forwards per chunk step, CFG {args.cfg}"
          f"{', compiled (' + args.compile_backend + ', ' + args.compile_scope + ')' if args.compile else ''}",
          flush=True)
    if args.compile:
        t0 = time.perf_counter()
        cache = am.KVCache(engine.spec, num_pages=r.pool_pages, device=device, backend=args.backend,
                           contiguous_extents=args.extents)
        compile_warmup(engine, cache, args.resident, chunks=config.sink_chunks + config.window_chunks + 2)
        cache.close()
        Clock(device).sync()
        r.compile_warmup_s = time.perf_counter() - t0
        print(f"compiled every batch size 1..{args.resident} in {r.compile_warmup_s:.1f} s (untimed)", flush=True)
    calibrate(engine, r)
    r.tick_floor_s = r.chunk_step_ms / 1e3 if args.tick_seconds is None else args.tick_seconds
    print(f"one session's chunk step (full window): {r.chunk_step_ms:.1f} ms; tick floor {r.tick_floor_s * 1e3:.1f} ms",
          flush=True)
    results, outputs = {}, {}
    for policy in args.policies:
        results[policy], outputs[policy] = play_policy(policy, engine, trace, r)
    check: dict[str, Any] = {"enabled": args.check, "ok": True}
    if args.check:
        # NOTE: exact on the CPU with CFG on only: with CFG off a session's forward alone (1 stream) and batched
        # with another (2) round differently on the CPU (rel err ~3e-7 on tiny), so the tolerance applies.
        check.update(compare(outputs, exact=device.type == "cpu" and args.cfg == "on", tolerance=args.check_tolerance,
                             positions_restart=args.compute == "model"))
        for policy, key in (("suspend", "resumes"), ("migrate", "migrations")):
            moves = results.get(policy, {}).get("metrics", {}).get(key, 0)
            after = check["pairs"].get(f"{policy}_vs_queue", {}).get("after_resume", 0)
            check["resumed_chunks_compared" if policy == "suspend" else "migrated_chunks_compared"] = after
            if moves and not after:
                check["ok"] = False
                check["mismatches"].append({"error": f"{policy}: {moves} {key} but no chunk after one was compared"})
    leaks_ok = all(res["leak_check"]["ok"] for res in results.values())
    payload: dict[str, Any] = {
        "env": environment(),
        "config": {
            "preset": config.name, "compute": args.compute, "device": str(device),
            "dtype": str(dtype).removeprefix("torch."),
            "backend": backend_name, "contiguous_extents": extents is not None, "params": engine.params,
            "num_layers": config.num_layers, "num_heads": config.num_heads, "head_dim": config.head_dim,
            "chunk_size": config.chunk_size, "page_size": config.kv_page_size, "sink_chunks": config.sink_chunks,
            "window_chunks": config.window_chunks, "branches": list(engine.branches), "cfg": args.cfg,
            "compiled": bool(args.compile), "compile_backend": args.compile_backend if args.compile else None,
            "compile_scope": args.compile_scope if args.compile else None,
            "compile_warmup_s": r.compile_warmup_s, "denoise_steps": args.denoise_steps,
            "timesteps": engine.timesteps, "forwards_per_chunk_step": engine.forwards_per_step,
            "sessions": args.sessions, "resident": args.resident, "max_ticks": r.max_ticks, "seed": args.seed,
            "arrival_gap": list(args.arrival_gap), "bursts": list(args.bursts), "burst_chunks": list(args.burst_chunks),
            "pause_ticks": list(args.pause_ticks), "chunk_seconds": args.chunk_seconds, "fps": args.fps,
            "frames_per_chunk": r.frames_per_chunk, "pages_per_session": r.pages_per_session, "bytes_per_page": bpp,
            "kv_bytes_per_session": r.pages_per_session * bpp, "pool_pages": r.pool_pages,
            "pool_bytes": r.pool_pages * bpp, "host_budget_bytes": r.host_budget,
            "replica_resident": args.replica_resident if "migrate" in args.policies else None,
            "replica_pool_pages": r.replica_pages if "migrate" in args.policies else None,
            "chunk_step_ms": r.chunk_step_ms, "chunk_step_samples_ms": r.chunk_step_samples_ms,
            "chunk_step": "one session (both CFG streams) at its full window, each step between two device syncs",
            "tick_floor_s": r.tick_floor_s,
            "policies": list(args.policies), "torch_threads": torch.get_num_threads(),
        },
        "trace": [{**dataclasses.asdict(t), "chunks": t.chunks} for t in trace],
        "link_bandwidth": r.link,
        "policies": results,
        "check": check,
        "leaks_ok": leaks_ok,
        "ok": bool(check["ok"] and leaks_ok),
    }
    print_table(payload)
    for line in _errors(payload):
        print(f"ERROR: {line}", file=sys.stderr, flush=True)
    payload["elapsed_s"] = time.perf_counter() - started
    save_json(result_path(args.out, f"{_stem(args)}.json", device=args.device), payload, args=args)
    png = plot(payload, result_path(args.out, f"{_stem(args)}.png", device=args.device))
    payload["png"] = str(png) if png else None
    print(f"done in {payload['elapsed_s']:.1f} s", flush=True)
    return payload


def _errors(payload: dict[str, Any]) -> list[str]:
    out = []
    for name, res in payload["policies"].items():
        if not res["leak_check"]["ok"]:
            out.append(f"{name}: pages or host bytes left after every session closed: {res['leak_check']}")
    check = payload["check"]
    if check["enabled"] and not check["ok"]:
        for m in check["mismatches"][:10]:
            out.append(f"outputs check failed: {m}")
    return out


# --------------------------------------------------------------------------------- output
def _f(v: float | None, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def print_table(payload: dict[str, Any]) -> None:
    cfg = payload["config"]
    print(f"\n{cfg['preset']} / {cfg['compute']} on {cfg['device']}: {cfg['sessions']} sessions, pool for "
          f"{cfg['resident']}; chunk = {cfg['chunk_seconds']} s of video ({cfg['frames_per_chunk']} frames); one "
          f"session's chunk step {cfg['chunk_step_ms']:.1f} ms")
    head = (f"{'policy':<11}{'served':>7}{'TTFC s p50/p90/max':>22}{'TTFC tk':>8}{'RTF p50/p90':>13}"
            f"{'cont.play':>10}{'frames/s':>9}{'host ms/tick':>14}{'resume ms (frac)':>18}{'GB/s':>7}"
            f"{'re-prefill ms':>14}{'peak dev/host MiB':>19}")
    print(head)
    print("-" * len(head))
    for name, res in payload["policies"].items():
        m = res["metrics"]
        t, rtf, host = m["ttfc_s"], m["rtf"], m["host_ms_per_tick"]
        rs, rp = m["resume"], m["reprefill"]
        if not rs["count"] and m.get("migrate_in", {}).get("count"):
            rs = m["migrate_in"]  # migrate: a returning session's move back, in the resume columns
        resume = (f"{_f(rs['latency_ms']['p50'], '.1f')} ({_f(rs['fraction_of_chunk_step']['p50'], '.2f')})"
                  if rs["count"] else "-")
        cp = m["continuous_play_ratio"]
        print(f"{name:<11}{m['sessions_finished']:>3}/{m['sessions_total']:<3}"
              f"{_f(t['p50'], '.3f') + '/' + _f(t['p90'], '.3f') + '/' + _f(t['max'], '.3f'):>22}"
              f"{_f(m['ttfc_ticks']['p90'], '.1f'):>8}"
              f"{_f(rtf['p50']) + '/' + _f(rtf['p90']):>13}{('-' if cp is None else f'{100 * cp:.0f}%'):>10}"
              f"{_f(m['frames_per_gpu_second'], '.1f'):>9}{_f(host['p50'], '.1f') + '/' + _f(host['p90'], '.1f'):>14}"
              f"{resume:>18}{_f(rs['gbps']['p50'], '.1f'):>7}"
              f"{(_f(rp['latency_ms']['p50'], '.1f') if rp['count'] else '-'):>14}"
              f"{_f(m['peak']['device_bytes'] / 2**20, '.1f') + '/' + _f(m['peak']['host_bytes'] / 2**20, '.1f'):>19}")
    print("TTFC tk: TTFC p90 in ticks; RTF: delivery - wanted, over the chunk's seconds; cont.play: chunks by their "
          "deadline; frames/s: per second of the policy clock; host ms/tick p50/p90; resume ms (frac): p50 latency of "
          "a resume (migrate: a move back; fraction of one chunk step); GB/s: its effective bandwidth p50; re-prefill ms: p50")
    link = payload.get("link_bandwidth") or {}
    if link.get("h2d_gbps"):
        print(f"host link (pinned, {max(link['sizes_mib'])} MiB): H2D {link['h2d_gbps']:.1f} GB/s, "
              f"D2H {link['d2h_gbps']:.1f} GB/s")
    check = payload["check"]
    if check["enabled"]:
        def pair(k: str, v: dict[str, Any]) -> str:
            skipped = f", {v['skipped_after_rebuild']} skipped after a rebuild" if v["skipped_after_rebuild"] else ""
            return (f"{k}: {v['equal']}/{v['compared']} equal ({v['after_resume']} after a resume/rebuild{skipped}, "
                    f"max |diff| {v['max_abs_diff']:.2g})")

        pairs = "; ".join(pair(k, v) for k, v in check["pairs"].items())
        print(f"outputs check ({'torch.equal' if check['exact'] else 'rel err <= ' + str(check['tolerance'])}): "
              f"{'ok' if check['ok'] else 'FAILED'} -- {pairs}")
    else:
        print("outputs check: off (--check to enable)")
    print(f"leak check (pool and host tier empty after every session closed): "
          f"{'ok' if payload['leaks_ok'] else 'FAILED'}")


def plot(payload: dict[str, Any], path: Path) -> Path | None:
    """(a) TTFC p50 / p90 / max per policy; (b) continuous play and RTF p50 per policy; (c) sessions resident /
    suspended / waiting over the ticks; (d) device and host-tier MiB over the ticks."""
    from benchmarks._plotting import bars, pyplot, save, wrap

    plt = pyplot()
    if plt is None:
        return None
    policies = payload["policies"]
    names = list(policies)
    colors = {"suspend": "tab:green", "close_idle": "tab:red", "queue": "tab:blue", "migrate": "tab:purple"}
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), layout="constrained")
    ax = axes[0][0]
    width = 0.25
    for k, (q, label) in enumerate((("p50", "p50"), ("p90", "p90"), ("max", "max"))):
        values = [policies[n]["metrics"]["ttfc_s"][q] or 0.0 for n in names]
        bars(ax, [i + (k - 1) * width for i in range(len(names))], values, width, label=f"TTFC {label}",
             labels=[f"{v:.2g}" for v in values], fontsize=7, alpha=0.55 + 0.2 * k)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("time to first chunk, s")
    ax.set_title("(a) time to first chunk (arrival -> chunk 0 delivered)", fontsize=9, loc="left")
    ax.legend(fontsize=7)
    ax = axes[0][1]
    cp = [100 * (policies[n]["metrics"]["continuous_play_ratio"] or 0.0) for n in names]
    rtf = [policies[n]["metrics"]["rtf"]["p50"] for n in names]
    bars(ax, range(len(names)), cp, 0.5, labels=[f"{c:.0f}%\nRTF p50 {_f(r)}" for c, r in zip(cp, rtf)],
         color=[colors.get(n, "0.5") for n in names])
    ax.set_xticks(range(len(names)), names)
    ax.set_ylim(0, 118)
    ax.set_ylabel("chunks delivered by their playback deadline, %")
    ax.set_title(f"(b) continuous play (chunk = {payload['config']['chunk_seconds']} s of video)", fontsize=9,
                 loc="left")
    ax = axes[1][0]
    for k, n in enumerate(names):  # the first policy's lines widest: equal counts overlap
        ticks = policies[n]["ticks"]
        x = [r["tick"] for r in ticks]
        style = {"color": colors.get(n, "0.5"), "drawstyle": "steps-post", "lw": 3.0 - 0.9 * k, "alpha": 0.8}
        ax.plot(x, [r["resident"] for r in ticks], "-", label=f"{n}: resident", **style)
        if any(r["suspended"] for r in ticks):
            ax.plot(x, [r["suspended"] for r in ticks], "--", label=f"{n}: suspended", **style)
        ax.plot(x, [r["waiting"] for r in ticks], ":", label=f"{n}: waiting", **style)
    ax.set_xlabel("tick")
    ax.set_ylabel("sessions")
    ax.set_title("(c) sessions resident / suspended / waiting", fontsize=9, loc="left")
    ax.legend(fontsize=6, ncol=2)
    ax = axes[1][1]
    for k, n in enumerate(names):
        ticks = policies[n]["ticks"]
        x = [r["tick"] for r in ticks]
        style = {"color": colors.get(n, "0.5"), "drawstyle": "steps-post", "lw": 3.0 - 0.9 * k, "alpha": 0.8}
        ax.plot(x, [r["device_bytes"] / 2**20 for r in ticks], "-", label=f"{n}: device", **style)
        if any(r["host_bytes"] for r in ticks):
            ax.plot(x, [r["host_bytes"] / 2**20 for r in ticks], "--", label=f"{n}: host tier", **style)
    ax.axhline(payload["config"]["pool_bytes"] / 2**20, color="k", lw=0.6, label="device pool")
    ax.set_xlabel("tick")
    ax.set_ylabel("KV MiB")
    ax.set_title("(d) KV bytes on the device and in the host tier", fontsize=9, loc="left")
    ax.legend(fontsize=6, ncol=2)
    cfg = payload["config"]
    gpu = payload.get("env", {}).get("gpu", cfg["device"])
    title = (f"Serving {cfg['sessions']} sessions on a pool for {cfg['resident']}: {cfg['preset']} ({cfg['compute']}), "
             f"{cfg['forwards_per_chunk_step']} forwards per chunk step, CFG {cfg.get('cfg', 'on')}"
             f"{', compiled' if cfg.get('compiled') else ''}, {cfg['dtype']}, {gpu}; one "
             f"session's chunk step {cfg['chunk_step_ms']:.1f} ms")
    fig.suptitle(wrap(title, fig, 10), fontsize=10)
    return save(plt, fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; exit status 1 if the outputs check or a leak check failed."""
    payload = run(argv)
    return 0 if payload["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
