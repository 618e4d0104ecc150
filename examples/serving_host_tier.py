"""Serving more sessions than fit on the device: idle sessions are suspended to the host tier.

A trace of sessions arriving, streaming a few chunks, pausing (suspended to host memory), resuming and
leaving. Admission uses ``admit_session(suspend_idle=True)``: when a new session needs device room, the
least recently used idle session is suspended. Per tick it prints the host time, the resume latency, the
sessions resident / suspended and the bytes on each tier. The attention layers are called directly
(``chunk_attention`` over random q/k/v): the point is the cache, not a model.

    python examples/serving_host_tier.py                 # CPU, reference backend
    python examples/serving_host_tier.py --device cuda   # pinned host pages, copies on a side stream
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch

import ardiff_modules as am

BRANCHES = ("cond", "uncond")


def make_cache(device: str, resident_sessions: int) -> am.KVCache:
    spec = am.KVCacheSpec(
        num_layers=4, num_kv_heads=4, head_dim=32, chunk_size=64, page_size=16, sink_chunks=1, window_chunks=2,
        branches=BRANCHES, dtype="float32" if device == "cpu" else "bfloat16",
    )
    probe = am.KVCache(spec, num_pages=1, device="cpu", backend="reference")
    pages = resident_sessions * probe.pages_per_session() + probe.recache_reserve()
    probe.close()
    backend = "reference" if device == "cpu" else "auto"
    # Contiguous extents on both devices: FlashInfer's default layout, so the CPU run admits and suspends as CUDA does.
    return am.KVCache(spec, num_pages=pages, device=device, backend=backend, contiguous_extents=True)


def stream_chunk(cache: am.KVCache, state: am.KVState, seed: int) -> None:
    """One committing forward of both branches: every layer writes its K/V and attends."""
    spec = cache.spec
    g = torch.Generator().manual_seed(seed)
    shape = (len(BRANCHES), spec.chunk_size, spec.num_kv_heads, spec.head_dim)
    with state.prepare_forward(BRANCHES, spec.chunk_size, commit_current=True) as fwd:
        for layer in fwd.layers:
            q, k, v = (torch.randn(shape, generator=g).to(cache.device, cache.dtype) for _ in range(3))
            am.chunk_attention(q, k, v, layer)


def run(device: str = "cpu", ticks: int = 12, resident_sessions: int = 2, quiet: bool = False) -> list[dict]:
    """Play the trace; returns one record per tick."""
    cache = make_cache(device, resident_sessions)
    sessions: dict[str, am.KVState] = {}
    chunks: dict[str, int] = {}
    records = []
    for tick in range(ticks):
        start = time.perf_counter()
        resume_ms = 0.0
        if tick % 2 == 0 and len(sessions) < resident_sessions + 2:  # a new session arrives every other tick
            sid = f"user{tick // 2}"
            sessions[sid] = cache.admit_session(sid, suspend_idle=True)
            chunks[sid] = 0
        for sid, state in list(sessions.items()):
            if state.is_suspended:
                continue
            if chunks[sid] >= 5:  # done: the session leaves
                state.close()
                del sessions[sid]
                continue
            stream_chunk(cache, state, seed=tick * 100 + chunks[sid])
            chunks[sid] += 1
        # a paused session comes back when there is room (resume refuses, changing nothing, when there is not)
        for sid, state in sessions.items():
            if state.is_suspended and cache.stats().pages_free >= cache.pages_per_session():
                t0 = time.perf_counter()
                state.resume().wait()
                resume_ms += (time.perf_counter() - t0) * 1e3
        if device == "cuda":
            torch.cuda.synchronize()
        report = cache.tiers()
        record = {
            "tick": tick, "host_ms": (time.perf_counter() - start) * 1e3, "resume_ms": resume_ms,
            "resident": len(report.resident), "suspended": len(report.suspended),
            "device_bytes": report.device_bytes_used, "host_bytes": report.host_bytes,
        }
        records.append(record)
        if not quiet:
            print(
                f"tick {tick:2d}  host {record['host_ms']:7.2f} ms  resume {resume_ms:6.2f} ms  "
                f"resident {record['resident']}  suspended {record['suspended']}  "
                f"device {record['device_bytes'] / 2**20:6.2f} MiB  host {record['host_bytes'] / 2**20:6.2f} MiB"
            )
    cache.close()
    return records


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--ticks", type=int, default=12)
    parser.add_argument("--resident-sessions", type=int, default=2, help="sessions the device pool holds at peak")
    args = parser.parse_args(argv)
    return run(args.device, args.ticks, args.resident_sessions)


if __name__ == "__main__":
    main()
