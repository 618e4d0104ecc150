"""Session files benchmark: save / load time of one Wan2.1-1.3B-shape session, against the chunk step and the
disk and host-link bandwidth (issue 45, item 4).

**The session.** One session of the Wan2.1-1.3B shape (``--shape wan2.1-1.3b``: 30 layers, 12 KV heads of 128,
chunks of 3 latent frames = 4680 tokens, pages of 120 tokens, sink 1 + window 6 chunks), CFG's two branches
(``cond``, ``uncond``), a ``"text"`` cross-attention cache of 512 tokens per branch, kept latents on (every
committing forward passes ``keep_latents``: the chunk's clean latents ride along in the file). On CUDA bf16,
``backend="auto"`` (FlashInfer, contiguous extents); on the CPU (``--device cpu``, a smoke run whose timings say
nothing about a GPU) float32 and the reference backend, default ``--shape tiny``. The pool holds exactly one
session (``kv_pool_pages(spec, slack_chunks=0)``), a second cache of the same size receives the loads.

**The chunk step** (what everything is compared with), ``--compute model`` (default): the library's Wan causal
DiT (``ardiff_modules.models.wan_causal_dit``, random weights from ``--seed``, eager), 4 denoising forwards
(``commit_current=False``, t = 1000, 750, 500, 250) + 1 committing forward (t = 0, ``keep_latents``), both
branches batched in each forward -- ``end_to_end``'s ``library`` row. ``--compute attention``: only every
layer's ``chunk_attention`` over random q = k = v plus its ``cached_cross_attention``, the same 5 forwards (the
attention-only chunk step; much cheaper than the model's). The session is filled by chunk steps: ``sink +
window + 2`` warm-up steps (the window full and evicted once; their times kept apart, the first pays the
first-use costs), then ``--chunks-timed`` steps, each timed alone (``_timing.each_call``: a step advances the
stream). Every chunk's input is drawn and on the device before any of this is timed.

**Timed** (each stateful call alone between two reads of the synchronising clock, ``_timing.once``; medians and
IQR over the rounds, ``Stats.from_ms``):

* ``save``  -- ``cache.save_sessions(path, [state])`` into a new file in ``--dir`` (default: a temporary folder
  under ``$TMPDIR`` / ``/tmp``, its filesystem recorded): device -> host copy, SHA-256 digests, safetensors
  write. The library does not fsync: ``fsync`` (after each save, timed separately) is what makes it durable,
  ``save + fsync`` the sum per round. Bytes = the file's size; GB/s = bytes / median time (1 GB = 1e9 B).
* ``load``  -- ``cache.load_sessions(path)`` into the second cache (read, digests checked, pages copied to
  fresh device pages, the session opened); the loaded session is closed between rounds. With ``--page-cache
  evict`` (default) the file's pages are dropped from the OS page cache first (fsync, then
  ``posix_fadvise(DONTNEED)``; advisory: ``check.file_resident_before_load`` is the fraction of the file still
  cached then, asked with ``mincore``), so a load reads the disk; ``keep``:
  straight from the page cache, as right after a save. ``--rounds`` rounds (default 3; a round after the second
  starts only if, at the last round's pace, it ends within ``--budget-s`` of the start: ``rounds_done``).
* ``suspend`` / ``resume`` -- ``state.suspend()`` / ``state.resume()``: the host tier (pinned host memory on
  CUDA, the copies on a side stream; the clock synchronises the device, so the copies are inside the time).
  One pair first (it pins the host tier's arena; kept apart as ``ops.suspend_first`` / ``resume_first``), then
  ``--tier-rounds`` pairs.
* Baselines of the same bytes: ``disk_write`` -- plain ``write()`` of a host buffer into a new file in 64 MiB
  blocks (to the page cache, no fsync), ``disk_write_fsync`` -- the same plus ``fsync`` (durable),
  ``disk_read`` -- ``readinto`` of that file after the same eviction as the loads (``--disk-rounds``);
  ``d2h`` / ``h2d`` -- one pinned device <-> host copy of the bytes (``_timing.interleaved``, ``--link-rounds``
  samples of one copy each; CPU: a host memcpy, there is no link); ``pin_ms``: pinning that host buffer.

**Checked** (exit status 1 if not): the loaded session's next forward (the model's, or every layer's
attention; ``commit_current=False``) equals the saved session's own bit for bit (``torch.equal``), its kept
latents (``recache_latents()``) too, and the resumed session's forward equals the same output; the second
cache is empty after the last close. A full ring is attended as one range in slot order (ragged FA3), and a
load or a resume puts every chunk back in the slot it had, so the same keys are summed in the same order at any
point of the rotation and bit for bit is the right test; ``check.ring_offsets_equal_after_load`` /
``_after_resume`` confirm the layouts match, and ``*_max_abs_diff`` tells a reordering (small) from a wrong page
(large) should a comparison fail.

Reported: each operation's median (IQR), bytes, GB/s, and its time as a multiple of the chunk step's median.

Writes ``session_files.json`` (config, sizes, filesystem, ``chunk_step``, ``ops``, ``baselines``, ``check``,
``ok``; run metadata) and ``session_files.png`` (time of save, save + fsync, load, suspend, resume beside the
chunk step, log scale; GB/s beside the disk and link baselines) into ``--out DIR``; by default the committed
results, ``benchmarks/results/session_files_<device>.*``. Disk: one file of the session's size at a time
(about 12.3 GB at wan2.1-1.3b); host memory: about 4x that at the peak (the file's tensors, their digests'
copies, a pinned buffer, the host tier's arena).

    bash .gpu/run.sh python3 -m benchmarks.session_files --out $OUT         # H200: wan2.1-1.3b, bf16
    python -m benchmarks.session_files --device cpu --shape tiny --out /tmp/session_files     # CPU smoke
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._timing import Stats, each_call, fail, interleaved, once, parser, result_path, save_json

SHAPES = {"wan2.1-1.3b": "wan2.1-1.3b", "wan1.3b": "wan2.1-1.3b", "tiny": "tiny"}  #: --shape -> WanConfig preset
BRANCHES = ("cond", "uncond")
TIMESTEPS = (1000.0, 750.0, 500.0, 250.0)  #: the denoising forwards of a chunk step; then one at 0 commits
BLOCK = 64 << 20  #: the raw disk baseline's write / read block


# --------------------------------------------------------------------------------------------- the session
class Engine:
    """One chunk step's work on a session of ``spec`` (the model, or every layer's attention)."""

    def __init__(self, compute: str, config: Any, spec: Any, device: Any, dtype: Any, seed: int) -> None:
        import torch

        from ardiff_modules.models.wan_causal_dit import build_model

        self.compute, self.config, self.spec, self.device, self.dtype, self.seed = (
            compute, config, spec, device, dtype, seed)
        self.model = build_model(config, seed=seed, device=device, dtype=dtype) if compute == "model" else None
        g = torch.Generator().manual_seed(seed + 1)
        if self.model is not None:
            with torch.no_grad():
                cond = self.model.embed_text(torch.randn(config.text_tokens, config.text_dim, generator=g).to(device))
                uncond = self.model.embed_text(torch.zeros(config.text_tokens, config.text_dim, device=device))
            self.texts = {"cond": cond, "uncond": uncond}
        else:
            shape = (config.text_tokens, spec.num_kv_heads, spec.head_dim)
            def kv() -> Any:
                return torch.randn(shape, generator=g).to(device, dtype)

            self.layer_texts = {b: [(kv(), kv()) for _ in range(spec.num_layers)] for b in BRANCHES}
        self.ts = [torch.full((len(BRANCHES),), t, device=device) for t in TIMESTEPS]
        self.t_commit = torch.zeros(len(BRANCHES), device=device)
        self.inputs: dict[int, Any] = {}  #: chunk -> its input on the device (drawn before the timing)
        self.flipped: dict[int, Any] = {}  #: attention: chunk -> its input reversed along the tokens

    def open(self, cache: Any) -> Any:
        """A new session with both branches' text cross-attention caches published."""
        import ardiff_modules as am

        state = cache.open_session("video-0")
        for branch in BRANCHES:
            if self.model is not None:
                am.populate_cross_attention(state, branch, [b.cross for b in self.model.blocks], self.texts[branch])
            else:
                state.populate_cross_attention(branch, "text", self.layer_texts[branch])
        return state

    def latents(self, chunk: int) -> Any:
        """Chunk ``chunk``'s input, the same for both branches: a latent ``[2, frames, C, H, W]`` (model) or
        q = k = v ``[2, chunk_size, heads, head_dim]`` (attention), seeded by the chunk; drawn once, before any
        timing (:meth:`draw`), so a timed chunk step holds no host-side random draw and no host-to-device copy."""
        if chunk not in self.inputs:
            self.draw([chunk])
        return self.inputs[chunk]

    def draw(self, chunks: Sequence[int]) -> None:
        import torch

        c = self.config
        for chunk in chunks:
            g = torch.Generator().manual_seed(self.seed * 1000 + 17 + chunk)
            if self.model is not None:
                shape: tuple[int, ...] = (1, c.frames_per_chunk, c.in_channels, c.latent_height, c.latent_width)
            else:
                shape = (1, self.spec.chunk_size, self.spec.num_kv_heads, self.spec.head_dim)
            x = torch.randn(shape, generator=g).to(device=self.device, dtype=self.dtype)
            self.inputs[chunk] = x.expand(len(BRANCHES), *shape[1:]).contiguous()
            if self.model is None:  # odd layers attend over the chunk reversed: layers differ, a mix-up shows
                self.flipped[chunk] = self.inputs[chunk].flip(1)

    def forward(self, state: Any, chunk: int, i: int, commit: bool, keep_out: bool = False) -> Any:
        """One forward of both branches over chunk ``chunk``'s input (``i``: the timestep's index, 4 = the clean
        one); with ``keep_out`` its output (the model's, or every layer's attention output)."""
        import ardiff_modules as am

        x = self.latents(chunk)
        keep = x if commit else None  # kept latents: the committing forward's clean input
        with state.prepare_forward(BRANCHES, self.spec.chunk_size, commit_current=commit, keep_latents=keep) as fwd:
            if self.model is not None:
                out = self.model(x, self.ts[i] if i < len(self.ts) else self.t_commit, fwd.layers)
                return [out] if keep_out else None
            outs = []
            for n, layer in enumerate(fwd.layers):
                q = x if n % 2 == 0 else self.flipped[chunk]
                out = am.chunk_attention(q, q, q, layer) + am.cached_cross_attention(q, layer, "text")
                if keep_out:
                    outs.append(out)
            return outs if keep_out else None

    def chunk_step(self, state: Any, chunk: int) -> None:
        """4 denoising forwards + 1 committing one over chunk ``chunk``'s input (drawn beforehand)."""
        for i in range(len(TIMESTEPS)):
            self.forward(state, chunk, i, False)
        self.forward(state, chunk, len(TIMESTEPS), True)
        self.inputs.pop(chunk, None)
        self.flipped.pop(chunk, None)

    def probe(self, state: Any, chunk: int) -> list[Any]:
        """The session's next forward (denoising, nothing committed) over chunk ``chunk``'s input, as CPU tensors;
        its pending chunk dropped after (``abort``): the session is left as it was."""
        out = self.forward(state, chunk, 0, False, keep_out=True)
        state.abort()
        return [t.detach().cpu() for t in out]


def same(a: Sequence[Any], b: Sequence[Any]) -> bool:
    import torch

    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def max_diff(a: Sequence[Any], b: Sequence[Any]) -> float | None:
    """The largest absolute difference between two outputs (a diagnostic beside :func:`same`)."""
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return None
    return max((float((x.float() - y.float()).abs().max()) for x, y in zip(a, b)), default=0.0)


def ring_offsets(state: Any) -> dict[str, dict[str, Any]] | None:
    """Each branch's extent (first page) and its history pages as offsets into it (``None``: plain paging): where
    the kernel finds each chunk's keys (a load / resume keeps each chunk's slot)."""
    out = {}
    for b in state.kv_branch_names:
        pages = state.branch_pages(b)
        if not pages.extent:
            return None
        where = {p: i for i, p in enumerate(pages.extent)}
        out[b] = {"extent_start": pages.extent[0], "offsets": [where[p] for c in pages.history for p in c]}
    return out


# --------------------------------------------------------------------------------------------- disk helpers
def filesystem(path: Path) -> dict[str, Any]:
    """The mount holding ``path`` (``/proc/mounts``' longest matching mount point) and its free bytes."""
    real = os.path.realpath(path)
    best: dict[str, Any] = {"mount": None, "fstype": None, "device": None}
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mount, fstype = line.split()[:3]
                prefix = mount.rstrip("/") + "/"
                if (real == mount or real.startswith(prefix)) and len(mount) >= len(best["mount"] or ""):
                    best = {"mount": mount, "fstype": fstype, "device": dev}
    except OSError:
        pass
    usage = shutil.disk_usage(real)
    return {**best, "free_bytes": usage.free, "total_bytes": usage.total, "dir": real}


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def evict(path: Path) -> bool:
    """Drop the (clean: fsync first) file's pages from the OS page cache; advisory. False where unsupported."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def resident_fraction(path: Path) -> float | None:
    """The fraction of ``path``'s pages in the OS page cache (``mincore`` over a read-only mapping of it, through
    ctypes); ``None`` where that cannot be asked (not Linux, no libc)."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            pages = -(-size // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                return None
            import numpy as np

            return float((np.frombuffer(vec, dtype=np.uint8) & 1).mean())
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)


def write_raw(path: Path, view: memoryview) -> None:
    with open(path, "wb", buffering=0) as f:
        for i in range(0, len(view), BLOCK):
            f.write(view[i : i + BLOCK])


def read_raw(path: Path, view: memoryview) -> int:
    got = 0
    with open(path, "rb", buffering=0) as f:
        while got < len(view):
            n = f.readinto(view[got : got + BLOCK])
            if not n:
                break
            got += n
    return got


# --------------------------------------------------------------------------------------------- measurement
def _op(stats: Stats, nbytes: int | None, step_ms: float) -> dict[str, Any]:
    """An operation's row: its stats, bytes, GB/s (bytes / median) and median / the chunk step's median."""
    s = stats.median_ms / 1e3
    return {
        "median_ms": stats.median_ms, "stats": stats.as_dict(), "bytes": nbytes,
        "gbps": nbytes / s / 1e9 if nbytes and s > 0 else None,
        "x_chunk_step": stats.median_ms / step_ms if step_ms > 0 else None,
    }


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.3f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.3f} MB"


def _log(t0: float, text: str) -> None:
    print(f"[{time.monotonic() - t0:7.1f} s] {text}", flush=True)


def bench(args: Any) -> dict[str, Any]:
    import torch

    from ardiff_modules.models.wan_causal_dit import WanConfig, kv_pool_pages, make_kv_spec, torch_threads

    t0 = time.monotonic()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    config = WanConfig.preset(SHAPES[args.shape])
    spec = make_kv_spec(config, device, BRANCHES)  # bf16 on CUDA, float32 on the CPU
    pages = kv_pool_pages(spec, slack_chunks=0)
    history = spec.sink_chunks + spec.window_chunks

    folder = Path(tempfile.mkdtemp(prefix="ardiff_session_files_", dir=args.dir))
    try:
        with torch_threads(None, config.name, device.type):  # 1 thread for the tiny preset on the CPU
            return _bench(args, folder, t0, device, cuda, dtype, config, spec, pages, history)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _bench(args: Any, folder: Path, t0: float, device: Any, cuda: bool, dtype: Any, config: Any, spec: Any,
           pages: int, history: int) -> dict[str, Any]:
    import torch

    import ardiff_modules as am

    extents = {"auto": None, "on": True, "off": False}[args.extents]
    src = am.KVCache(spec, num_pages=pages, device=device, backend="auto", contiguous_extents=extents)
    bpp = src.stats().bytes_per_page
    backend = f"{src.backend.name} (backend='auto')"
    layout = "contiguous extents (ring)" if src.extent_chunks is not None else "plain paging"
    estimate = len(BRANCHES) * history * spec.pages_per_chunk * bpp
    fs = filesystem(folder)
    if fs["free_bytes"] < 1.1 * estimate + (256 << 20):
        fail(args.prog, f"--dir {folder.parent}: needs about {estimate / 1e9:.1f} GB free for one session file, "
                        f"got {fs['free_bytes'] / 1e9:.1f} GB ({fs['fstype']} at {fs['mount']}); pass --dir")
    engine = Engine(args.compute, config, spec, device, dtype, args.seed)
    _log(t0, f"{config.name}: {spec.num_layers} layers, {spec.num_kv_heads} KV heads x {spec.head_dim}, chunk "
             f"{spec.chunk_size} tokens, pages of {spec.page_size}, sink {spec.sink_chunks} + window "
             f"{spec.window_chunks}, {len(BRANCHES)} branches, {src.dtype} on {device} ({src.backend.name}, "
             f"{'contiguous extents' if src.extent_chunks else 'plain paging'}); pool {pages} pages x {bpp} B = "
             f"{pages * bpp / 1e9:.2f} GB; files in {folder} ({fs['fstype']} at {fs['mount']})")
    state = engine.open(src)
    # the window full and evicted once (sink + window + 2); the ring is then rotated, as any stream's is
    warmup = history + 2
    chunk = 0

    def step() -> None:
        nonlocal chunk
        engine.chunk_step(state, chunk)
        chunk += 1

    engine.draw(range(warmup + args.chunks_timed + 1))  # every input on the device before anything is timed
    with torch.no_grad():
        warm, _ = each_call(step, warmup)  # the first one pays first-use costs (kernels, plans)
        steps, _ = each_call(step, args.chunks_timed)
    step_ms = steps.median_ms
    _log(t0, f"chunk step ({args.compute}, 5 forwards, {len(BRANCHES)} streams): {steps}; warm-up steps "
             f"{', '.join(f'{v:.4g}' for v in warm.samples_ms)} ms")
    assert all(state.committed_chunks(b) == warmup + args.chunks_timed for b in BRANCHES)
    with torch.no_grad():
        reference = engine.probe(state, chunk)
    latents_ref = state.recache_latents().cpu()
    offsets = ring_offsets(state)

    # ------------------------------------------------------------------ save / load
    dst = am.KVCache(spec, num_pages=pages, device=device, backend="auto", contiguous_extents=extents)
    path = folder / "session.safetensors"
    save_ms: list[float] = []
    fsync_ms: list[float] = []
    load_ms: list[float] = []
    evicted: list[bool] = []
    resident: list[float | None] = []  #: the file's fraction in the page cache just before each load
    nbytes = 0
    last_round_s = 0.0
    check: dict[str, Any] = {}
    cut = False
    for r in range(args.rounds):
        started = time.monotonic()
        if r >= 2 and started - t0 + last_round_s > args.budget_s:
            cut = True  # the next round would end past --budget-s: stop with the rounds taken
            break
        _, s = once(lambda: src.save_sessions(path, [state]))
        save_ms.append(s * 1e3)
        nbytes = os.path.getsize(path)
        _, s = once(lambda: fsync_file(path))
        fsync_ms.append(s * 1e3)
        if args.page_cache == "evict":
            evicted.append(evict(path))
        resident.append(resident_fraction(path))
        loaded, s = once(lambda: dst.load_sessions(path))
        load_ms.append(s * 1e3)
        if r == 0:  # the loaded session continues like the saved one, bit for bit (once: outside the timings)
            [twin] = loaded
            with torch.no_grad():
                probe = engine.probe(twin, chunk)
            check["load_forward_bit_identical"] = same(probe, reference)
            check["load_forward_max_abs_diff"] = max_diff(probe, reference)
            check["ring_offsets_equal_after_load"] = None if offsets is None else ring_offsets(twin) == offsets
            check["load_latents_equal"] = bool(torch.equal(twin.recache_latents().cpu(), latents_ref))
            check["load_committed_chunks"] = {b: twin.committed_chunks(b) for b in BRANCHES}
        for s_ in loaded:
            s_.close()
        os.remove(path)
        last_round_s = time.monotonic() - started
        _log(t0, f"round {r}: save {save_ms[-1]:.4g} ms, fsync {fsync_ms[-1]:.4g} ms, load {load_ms[-1]:.4g} ms "
                 f"({_size(nbytes)})")
    check["load_pool_empty_after_close"] = dst.stats().pages_used == 0
    dst.close()  # releases its pool's memory
    del dst, loaded, twin
    gc.collect()

    # ------------------------------------------------------------------ suspend / resume (host tier)
    (_, s_first), (_, r_first) = once(state.suspend), once(state.resume)
    sus_ms: list[float] = []
    res_ms: list[float] = []
    for _ in range(args.tier_rounds):
        _, s = once(state.suspend)
        sus_ms.append(s * 1e3)
        _, s = once(state.resume)
        res_ms.append(s * 1e3)
    tier_bytes = _tier_bytes(src, state)
    check["ring_offsets_equal_after_resume"] = None if offsets is None else ring_offsets(state) == offsets
    with torch.no_grad():
        probe = engine.probe(state, chunk)
    check["resume_forward_bit_identical"] = same(probe, reference)
    check["resume_forward_max_abs_diff"] = max_diff(probe, reference)
    _log(t0, f"suspend first {s_first * 1e3:.4g} ms, then {Stats.from_ms(sus_ms)}; resume first "
             f"{r_first * 1e3:.4g} ms, then {Stats.from_ms(res_ms)} ({_size(tier_bytes)})")
    sizes = _sizes(src, state, nbytes)
    state.close()
    src.close()
    del engine, state, src
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()

    # ------------------------------------------------------------------ baselines: disk, host link
    base = baselines(args, folder, nbytes, device, t0)

    ops = {
        "save": _op(Stats.from_ms(save_ms), nbytes, step_ms),
        "fsync_after_save": _op(Stats.from_ms(fsync_ms), nbytes, step_ms),
        "save_fsync": _op(Stats.from_ms([a + b for a, b in zip(save_ms, fsync_ms)]), nbytes, step_ms),
        "load": _op(Stats.from_ms(load_ms), nbytes, step_ms),
        "suspend": _op(Stats.from_ms(sus_ms), tier_bytes, step_ms),
        "resume": _op(Stats.from_ms(res_ms), tier_bytes, step_ms),
        "suspend_first": _op(Stats.from_ms([s_first * 1e3]), tier_bytes, step_ms),
        "resume_first": _op(Stats.from_ms([r_first * 1e3]), tier_bytes, step_ms),
    }
    baseline_rows = {k: _op(v, base["bytes"][k], step_ms) for k, v in base["stats"].items()}
    check["page_cache_evicted"] = all(evicted) if args.page_cache == "evict" else None
    check["file_resident_before_load"] = resident
    check["raw_file_resident_before_read"] = base["resident"]
    ok = bool(check["load_forward_bit_identical"] and check["load_latents_equal"]
              and check["resume_forward_bit_identical"] and check["load_pool_empty_after_close"])
    return {
        "config": {
            "shape": config.name, "compute": args.compute, "device": str(device), "dtype": str(dtype),
            "backend": backend, "layout": layout,
            "layers": spec.num_layers, "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
            "chunk_tokens": spec.chunk_size, "page_size": spec.page_size, "pages_per_chunk": spec.pages_per_chunk,
            "sink_chunks": spec.sink_chunks, "window_chunks": spec.window_chunks, "branches": list(BRANCHES),
            "text_tokens": config.text_tokens, "keep_latents": True, "pool_pages": pages,
            "forwards_per_chunk_step": len(TIMESTEPS) + 1, "warmup_chunk_steps": warmup,
            "chunks_timed": args.chunks_timed, "rounds": args.rounds, "rounds_done": len(save_ms),
            "rounds_cut_by_budget": cut, "budget_s": args.budget_s, "tier_rounds": args.tier_rounds,
            "disk_rounds": args.disk_rounds, "link_rounds": args.link_rounds, "page_cache": args.page_cache,
            "fsync": "save: none inside save_sessions (the library's); fsync_after_save timed separately; "
                     "disk_write: none, disk_write_fsync: write + fsync",
            "gb": "1e9 bytes",
            # older safetensors copy each tensor's bytes while writing; 0.8 writes from the tensors' memory
            "safetensors": _version("safetensors"),
        },
        "filesystem": fs,
        "sizes": sizes,
        "chunk_step": {
            "what": ("the library's Wan causal DiT, eager: 4 denoising + 1 committing forward, CFG's 2 branches "
                     "batched" if args.compute == "model" else
                     "attention only: every layer's chunk_attention + cached_cross_attention, 4 + 1 forwards, "
                     "CFG's 2 branches batched"),
            "median_ms": step_ms, "stats": steps.as_dict(), "warmup_steps_ms": list(warm.samples_ms),
        },
        "ops": ops,
        "baselines": {**baseline_rows, "pin_ms": base["pin_ms"], "link_note": base["link_note"]},
        "check": check,
        "ok": ok,
    }


def _latent_bytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for b in state.kv_branch_names
               for t in state.branch_pages(b).latents.values() if hasattr(t, "element_size"))


def _tier_bytes(cache: Any, state: Any) -> int:
    """Bytes a suspend moves: the distinct committed pages, the cross entries and the kept latents."""
    pages = {p for b in state.kv_branch_names for p in state.branch_pages(b).history_pages()}
    extra = sum(e.nbytes for e in {id(e): e for e in state._cross_entries().values()}.values())
    return len(pages) * cache.stats().bytes_per_page + extra + _latent_bytes(state)


def _sizes(cache: Any, state: Any, file_bytes: int) -> dict[str, Any]:
    pages = {p for b in state.kv_branch_names for p in state.branch_pages(b).history_pages()}
    entries = {id(e): e for e in state._cross_entries().values()}
    latents = _latent_bytes(state)
    return {
        "file_bytes": file_bytes, "pages": len(pages), "bytes_per_page": cache.stats().bytes_per_page,
        "page_bytes": len(pages) * cache.stats().bytes_per_page,
        "cross_bytes": sum(e.nbytes for e in entries.values()), "latent_bytes": latents,
        "committed_chunks_per_branch": {b: len(state.branch_pages(b).history) for b in state.kv_branch_names},
    }


def baselines(args: Any, folder: Path, nbytes: int, device: Any, t0: float) -> dict[str, Any]:
    """Plain file I/O and one pinned copy each way of ``nbytes`` (see the module docstring)."""
    import torch

    cuda = device.type == "cuda"
    host, pin_s = once(lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda))
    if not cuda:
        host.fill_(7)  # touched: no page faults inside the timed writes (pinning touches every page already)
    view = memoryview(host.numpy()).cast("B")
    raw = folder / "raw.bin"
    write_ms, fsync_ms, read_ms = [], [], []
    resident: list[float | None] = []
    for _ in range(args.disk_rounds):
        _, s = once(lambda: write_raw(raw, view), sync_start=False, sync_end=False)
        write_ms.append(s * 1e3)
        _, s = once(lambda: fsync_file(raw), sync_start=False, sync_end=False)
        fsync_ms.append(s * 1e3)
        if args.page_cache == "evict":
            evict(raw)
        resident.append(resident_fraction(raw))
        got, s = once(lambda: read_raw(raw, view), sync_start=False, sync_end=False)
        assert got == nbytes, (got, nbytes)
        read_ms.append(s * 1e3)
        os.remove(raw)
    stats = {
        "disk_write": Stats.from_ms(write_ms),
        "disk_write_fsync": Stats.from_ms([a + b for a, b in zip(write_ms, fsync_ms)]),
        "disk_read": Stats.from_ms(read_ms),
    }
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.fill_(3)
    link = interleaved({"d2h": lambda: host.copy_(dev, non_blocking=cuda),
                        "h2d": lambda: dev.copy_(host, non_blocking=cuda)},
                       inner=1, rounds=args.link_rounds, warmup=1)
    stats.update(link)
    _log(t0, "baselines: " + "; ".join(f"{k} {v} = {nbytes / (v.median_ms / 1e3) / 1e9:.3g} GB/s"
                                       for k, v in stats.items()) + f"; pinning {pin_s * 1e3:.4g} ms")
    del dev, host, view
    return {
        "stats": stats, "bytes": {k: nbytes for k in stats}, "pin_ms": pin_s * 1e3, "resident": resident,
        "link_note": ("pinned host buffer, one copy_(non_blocking=True) per call, the clock synchronising the "
                      "device" if cuda else "CPU: a host memcpy (torch copy_), there is no host link"),
    }


# --------------------------------------------------------------------------------------------- plot, CLI
def plot(payload: dict[str, Any], path: Path) -> Path | None:
    """Left: seconds of save, save + fsync, load, suspend, resume beside the chunk step (log scale, IQR error bars,
    each labelled with its multiple of the chunk step); right: GB/s beside the disk and host-link baselines."""
    from benchmarks._plotting import bars, pyplot, save, wrap

    plt = pyplot()
    if plt is None:
        return None
    ops, base, step, cfg = payload["ops"], payload["baselines"], payload["chunk_step"], payload["config"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), layout="constrained")
    rows = [("chunk step", step), ("save", ops["save"]), ("save + fsync", ops["save_fsync"]),
            ("load", ops["load"]), ("suspend", ops["suspend"]), ("resume", ops["resume"])]
    values = [r["median_ms"] / 1e3 for _, r in rows]
    bounds = [(r["stats"]["p25_ms"] / 1e3, r["stats"]["p75_ms"] / 1e3) for _, r in rows]
    labels = [f"{v:.3g} s" + ("" if i == 0 else f"\n{r['x_chunk_step']:.2g}x step") for i, (v, (_, r))
              in enumerate(zip(values, rows))]
    colors = ["0.45", "tab:blue", "tab:blue", "tab:orange", "tab:green", "tab:green"]
    bars(left, range(len(rows)), values, 0.7, bounds=bounds, labels=labels, color=colors)
    left.set_yscale("log")
    left.set_ylim(min(values) / 2, max(v for _, v in bounds) * 4)
    left.set_xticks(range(len(rows)), [n for n, _ in rows], rotation=20)
    left.axhline(values[0], color="0.45", lw=0.8, ls="--")
    left.set_ylabel("seconds (median, IQR error bars)")
    left.set_title("one session vs one chunk step")
    link = ("D2H pinned", "H2D pinned") if cfg["device"].startswith("cuda") else ("host copy", "host copy back")
    brow = [("save", ops["save"]), ("save+fsync", ops["save_fsync"]), ("load", ops["load"]),
            ("suspend", ops["suspend"]), ("resume", ops["resume"]), ("disk write", base["disk_write"]),
            ("write+fsync", base["disk_write_fsync"]), ("disk read", base["disk_read"]), (link[0], base["d2h"]),
            (link[1], base["h2d"])]
    gbps = [r["gbps"] or 0.0 for _, r in brow]
    gb_bounds = [(r["bytes"] / (r["stats"]["p75_ms"] / 1e3) / 1e9, r["bytes"] / (r["stats"]["p25_ms"] / 1e3) / 1e9)
                 for _, r in brow]
    bars(right, range(len(brow)), gbps, 0.7, bounds=gb_bounds, labels=[f"{v:.3g}" for v in gbps],
         color=["tab:blue"] * 2 + ["tab:orange"] + ["tab:green"] * 2 + ["0.6"] * 3 + ["0.3"] * 2)
    right.set_yscale("log")
    right.set_xticks(range(len(brow)), [n for n, _ in brow], rotation=30)
    right.set_ylabel("GB/s (1e9 B/s) of the session's bytes")
    right.set_title("bandwidth vs plain file I/O and the host link")
    sizes = payload["sizes"]
    gpu = payload.get("env", {}).get("gpu", cfg["device"])
    title = (f"Session files: save / load of one {cfg['shape']} session ({sizes['file_bytes'] / 1e9:.2f} GB file, "
             f"{len(cfg['branches'])} branches, sink {cfg['sink_chunks']} + window {cfg['window_chunks']} chunks), "
             f"{cfg['dtype'].removeprefix('torch.')} on {gpu}; chunk step: {cfg['compute']}; load after page cache "
             f"{cfg['page_cache']}; files on {payload['filesystem'].get('fstype')}")
    fig.suptitle(wrap(title, fig), fontsize=10)
    return save(plt, fig, path)


def build_parser() -> Any:
    p = parser(__doc__)
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="default wan2.1-1.3b on CUDA, tiny on the CPU (wan1.3b: an alias)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available, else cpu")
    p.add_argument("--compute", choices=("model", "attention"), default="model",
                   help="the chunk step: the library's model (default) or every layer's attention only")
    p.add_argument("--chunks-timed", type=int, default=3, help="chunk steps timed after the warm-up (default 3)")
    p.add_argument("--rounds", type=int, default=3, help="save / load rounds (default 3)")
    p.add_argument("--budget-s", type=float, default=120.0,
                   help="a save / load round after the second starts only if, at the last round's pace, it ends "
                        "within this many seconds of the start (default 120; config.rounds_done says how many ran)")
    p.add_argument("--tier-rounds", type=int, default=5, help="suspend / resume pairs after the first (default 5)")
    p.add_argument("--disk-rounds", type=int, default=1, help="plain write / fsync / read rounds (default 1)")
    p.add_argument("--link-rounds", type=int, default=5, help="pinned copies each way (default 5)")
    p.add_argument("--page-cache", choices=("evict", "keep"), default="evict",
                   help="before each load and raw read: evict the file from the page cache (default) or keep it")
    p.add_argument("--dir", type=Path, default=None,
                   help="where the files are written (a temporary folder inside; default: $TMPDIR or /tmp)")
    p.add_argument("--extents", choices=("auto", "on", "off"), default="auto",
                   help="contiguous extents (rings) per branch: auto = the library's default (on with FlashInfer); "
                        "on: also on the CPU's reference backend (the CUDA layout in a smoke run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None,
                   help="folder for session_files.json / .png (default: the committed results, "
                        "benchmarks/results/session_files_<device>.json / .png)")
    return p


def print_table(payload: dict[str, Any]) -> None:
    step = payload["chunk_step"]["median_ms"]
    print(f"chunk step: {step:.4g} ms ({payload['config']['compute']}); file {_size(payload['sizes']['file_bytes'])}")
    print(f"{'operation':20s} {'median ms':>11s} {'IQR ms':>9s} {'GB/s':>8s} {'x step':>8s}")
    for group in ("ops", "baselines"):
        for name, row in payload[group].items():
            if not isinstance(row, dict):
                continue
            gbps = f"{row['gbps']:.3g}" if row["gbps"] else "-"
            print(f"{name:20s} {row['median_ms']:11.4g} {row['stats']['iqr_ms']:9.3g} {gbps:>8s} "
                  f"{row['x_chunk_step']:8.3g}")
    print("check: " + ", ".join(f"{k}={v}" for k, v in payload["check"].items()) + f"; ok={payload['ok']}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = build_parser()
    args = p.parse_args(argv)
    if min(args.chunks_timed, args.rounds, args.tier_rounds, args.disk_rounds, args.link_rounds) < 1:
        p.error("--chunks-timed, --rounds, --tier-rounds, --disk-rounds and --link-rounds must be >= 1")
    import importlib.util

    if importlib.util.find_spec("safetensors") is None:
        fail(p.prog, "needs the safetensors package (pip install 'ardiff_modules[persist]')")
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        fail(p.prog, "--device cuda: CUDA is not available (torch.cuda.is_available() is False); "
                     "use --device cpu --shape tiny for a smoke run")
    if args.shape is None:
        args.shape = "wan2.1-1.3b" if args.device == "cuda" else "tiny"
    if args.dir is not None and not args.dir.is_dir():
        fail(p.prog, f"--dir {args.dir}: expected an existing folder")
    args.prog = p.prog
    payload = bench(args)
    del args.prog
    print_table(payload)
    save_json(result_path(args.out, "session_files.json", device=args.device), payload, args=args)
    plot(payload, result_path(args.out, "session_files.png", device=args.device))
    return payload


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
