"""Session transport benchmark: ``send_sessions`` / ``recv_sessions`` of one Wan2.1-1.3B-shape session between two
processes (issue 45, item 4), against the chunk step and the bytes' plain copies.

**What runs.** Two processes (``torch.multiprocessing``, spawned by this script; rank 0 and rank 1), each with a
``KVCache`` whose pool holds exactly one session of ``--shape`` (the session of ``benchmarks.session_files``: CFG's
two branches, a 512-token text cross cache per branch, kept latents; bf16, ``backend="auto"`` on CUDA). Rank 0
fills the session with chunk steps (``session_files.Engine``: the model, or ``--compute attention``), times its
chunk step and records its next forward; then the session goes back and forth: rank 0 sends it to rank 1
(``send_sessions`` / ``recv_sessions``), rank 1 sends it back, ``--rounds`` times. Each move starts after a
barrier with the device synchronised on both sides; **timed**: the sender's call, from entering
``send_sessions`` to its return (the snapshot, the envelope and its check, the tensors, the receiver's reserve,
copy and open, its "ok": the whole transactional move), and the receiver's call (from entering
``recv_sessions``, which waits for the envelope, to the opened session, the device synchronised). After the
last round the session is back on rank 0: its next forward must equal the recorded one bit for bit (every byte
crossed the link twice per round), its kept latents too, and rank 1's pool must be empty (exit status 1 if not).

**The group** (what carries the tensors under ``--transport wire``, the control messages always).
``--backend auto``: NCCL when there are two CUDA devices (rank ``r`` on
``cuda:r``): the pages go from one pool to the other as device tensors (one gather per lane, no host copy, the
library's path between GPUs). On **one GPU** (``--device cuda`` with a single device) NCCL is not an option --
it refuses two ranks of one communicator on the same device -- so both ranks share ``cuda:0`` over **gloo**,
which carries CPU tensors: each move is gather on the device, then per 64 MiB block a device-to-host copy into a
pinned buffer, loopback TCP between the two processes and a host-to-device copy (the copies overlapping the wire
since stop 51; before, each whole tensor crossed to the host, the wire and back in turn), scatter into the pool.
``--backend gloo`` / ``nccl`` force one. On the CPU (``--device cpu``, the smoke run) gloo.

**The transport** (``--transport``, passed to both calls). ``auto`` (default): two processes of one machine with CUDA
pools move the tensors by **CUDA IPC** -- the receiver maps the sender's gathered pages and copies them device to
device into its pool, no host staging, whatever the group (the group carries only the control messages) -- and
everything else (the CPU) over the group; ``wire`` forces the group (the gloo staging above on one GPU, NCCL with
two); ``ipc`` requires IPC (the run fails with the library's ``TransportUnavailableError`` where it cannot be).
``transport`` in the JSON records the one asked for and the paths the sends took (``send_sessions``' return).
The ``d2d`` baseline (one device copy of the same bytes) bounds what IPC can reach.

**Baselines of the same bytes** (``--link-rounds`` samples each): ``wire`` -- one ``dist.send`` / ``recv`` of a
tensor of the session's bytes over the same group, on the wire's device (gloo: a CPU tensor, loopback TCP;
NCCL: a device tensor); on CUDA ``d2h`` / ``h2d`` (pinned, one copy each way: the staging a gloo move pays twice)
and ``d2d`` (one device-to-device copy). Bytes = what a send carries: the session's distinct pages (one row per
page), the pool's FP8 scales, the cross caches, the kept latents (``sizes``); GB/s = bytes / median time.

Writes ``session_transport.json`` (config, sizes, chunk step, ``moves`` {send, recv}: median / IQR ms, GB/s,
multiple of the chunk step; ``baselines``; ``check``; ``ok``; run metadata) into ``--out DIR`` (default: the
committed result, ``benchmarks/results/session_transport_<device>.json``). Memory at the peak on one GPU: the
sender's gathered pages and the receiver's buffer on the device (each the session's size), and a baseline buffer of
it in host memory.

    bash .gpu/run.sh python3 -m benchmarks.session_transport --out $OUT       # one GPU: CUDA IPC (auto)
    bash .gpu/run.sh python3 -m benchmarks.session_transport --transport wire --out $OUT   # one GPU: gloo staging
    python -m benchmarks.session_transport --device cpu --out /tmp/st         # CPU smoke (tiny, gloo)
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._timing import Stats, fail, parser, result_path, save_json
from benchmarks.session_files import BRANCHES, SHAPES, TIMESTEPS, Engine, max_diff, same


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _row(samples_ms: Sequence[float], nbytes: int, step_ms: float | None) -> dict[str, Any]:
    st = Stats.from_ms(samples_ms)
    return {"stats": {"median_ms": st.median_ms, "p25_ms": st.p25_ms, "p75_ms": st.p75_ms, "iqr_ms": st.iqr_ms,
                      "samples_ms": list(samples_ms)},
            "median_ms": st.median_ms, "bytes": nbytes, "gbps": nbytes / (st.median_ms / 1e3) / 1e9,
            "x_chunk_step": st.median_ms / step_ms if step_ms else None}


def _worker(rank: int, port: int, args: Any, result: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    if args.device == "cuda":
        torch.cuda.set_device(rank if args.backend == "nccl" else 0)
    dist.init_process_group(args.backend, rank=rank, world_size=2)
    try:
        payload = _run(rank, args)
        if rank == 0:
            Path(result).write_text(json.dumps(payload))
    finally:
        dist.destroy_process_group()


def _run(rank: int, args: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import ardiff_modules as am
    from ardiff_modules.host import files, transport
    from ardiff_modules.models.wan_causal_dit import WanConfig, kv_pool_pages, make_kv_spec, torch_threads

    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    config = WanConfig.preset(SHAPES[args.shape])
    spec = make_kv_spec(config, device, BRANCHES)
    pages = kv_pool_pages(spec, slack_chunks=0)
    wire = transport.wire_device(None)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def timed(fn: Any) -> tuple[Any, float]:
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        return out, (time.perf_counter() - t0) * 1e3

    with torch_threads(None, config.name, device.type), torch.no_grad():
        cache = am.KVCache(spec, num_pages=pages, device=device, backend="auto")
        out: dict[str, Any] = {}
        state = None
        if rank == 0:  # the session, its chunk step and its next forward (rank 1 waits at the barrier)
            engine = Engine(args.compute, config, spec, device, dtype, args.seed)
            state = engine.open(cache)
            warmup = spec.sink_chunks + spec.window_chunks + 2
            engine.draw(range(warmup + args.chunks_timed + 1))
            steps = []
            for c in range(warmup + args.chunks_timed):
                _, ms = timed(lambda c=c: engine.chunk_step(state, c))
                if c >= warmup:
                    steps.append(ms)
            probe_chunk = warmup + args.chunks_timed
            reference = engine.probe(state, probe_chunk)
            latents = state.recache_latents().cpu()
            tensors, _ = files.snapshot(cache, [state], "size", device=wire)
            sizes = {"pages_bytes": sum(t.numel() * t.element_size() for n, t in tensors.items()
                                        if n.startswith("pages")),
                     "scales_bytes": sum(t.numel() * t.element_size() for n, t in tensors.items()
                                         if n.startswith("scales")),
                     "cross_bytes": sum(t.numel() * t.element_size() for n, t in tensors.items()
                                        if n.startswith("cross")),
                     "latent_bytes": sum(t.numel() * t.element_size() for n, t in tensors.items()
                                         if n.startswith("latent"))}
            sizes["total_bytes"] = sum(sizes.values())
            del tensors
            out.update(chunk_step=_row(steps, 0, None), sizes=sizes,
                       config={"shape": config.name, "compute": args.compute, "device": str(device),
                               "dtype": str(dtype).removeprefix("torch."), "backend": args.backend,
                               "wire_device": str(wire), "cache_backend": cache.backend.name,
                               "contiguous_extents": cache.extent_chunks is not None, "pool_pages": pages,
                               "bytes_per_page": cache.stats().bytes_per_page, "branches": list(BRANCHES),
                               "forwards_per_chunk_step": len(TIMESTEPS) + 1, "rounds": args.rounds,
                               "gpus": torch.cuda.device_count() if cuda else 0})
        nbytes_box: list[Any] = [out.get("sizes", {}).get("total_bytes")]
        dist.broadcast_object_list(nbytes_box, src=0)
        nbytes = int(nbytes_box[0])
        send_ms: list[float] = []
        recv_ms: list[float] = []
        paths: list[str] = []  # what each send took: "ipc" or "wire"
        for _ in range(args.rounds):
            for sender in (0, 1):  # there and back
                dist.barrier()
                if rank == sender:
                    path, ms = timed(lambda: cache.send_sessions([state], 1 - sender, transport=args.transport))
                    state = None
                    send_ms.append(ms)
                    paths.append(path)
                else:
                    got, ms = timed(lambda: cache.recv_sessions(sender, transport=args.transport))
                    [state] = got
                    recv_ms.append(ms)
        # rank 1's receive times to rank 0
        box: list[Any] = [recv_ms if rank == 1 else None, send_ms if rank == 1 else None, paths if rank == 1 else None]
        dist.broadcast_object_list(box, src=1)
        if rank == 1:
            empty = cache.stats().pages_used == 0 and not cache.sessions
            dist.broadcast_object_list([empty], src=1)
            _baselines(rank, args, nbytes, wire, device)
            return {}
        flag: list[Any] = [None]
        dist.broadcast_object_list(flag, src=1)
        step = out["chunk_step"]["median_ms"]
        # a move there is timed on rank 0 (send) and rank 1 (recv); back: rank 1 (send) and rank 0 (recv)
        out["moves"] = {
            "send_0_to_1": _row([m for i, m in enumerate(send_ms)], nbytes, step),
            "recv_on_1": _row(box[0], nbytes, step),
            "send_1_to_0": _row(box[1], nbytes, step),
            "recv_on_0": _row(recv_ms, nbytes, step),
        }
        out["transport"] = {"requested": args.transport, "used": sorted(set(paths) | set(box[2]))}
        after = engine.probe(state, probe_chunk)
        out["check"] = {
            "forward_bit_identical_after_round_trips": same(after, reference),
            "forward_max_abs_diff": max_diff(after, reference),
            "latents_equal": bool(torch.equal(state.recache_latents().cpu(), latents)),
            "receiver_pool_empty": bool(flag[0]),
        }
        out["ok"] = all(v for k, v in out["check"].items() if k != "forward_max_abs_diff")
        out["baselines"] = _baselines(rank, args, nbytes, wire, device)
        for row in out["baselines"].values():
            row["x_chunk_step"] = row["median_ms"] / step
        state.close()
        return out


def _baselines(rank: int, args: Any, nbytes: int, wire: Any, device: Any) -> dict[str, Any]:
    """The same bytes: one send over the group (rank 0 -> 1), and on CUDA pinned d2h / h2d and a d2d copy."""
    import torch
    import torch.distributed as dist

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    buf = torch.empty(nbytes, dtype=torch.uint8, device=wire)
    wire_ms = []
    for _ in range(args.link_rounds):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(torch.empty(1, dtype=torch.uint8, device=wire), 1)  # the receiver has it all
        else:
            dist.recv(buf, 0)
            sync()
            dist.send(torch.ones(1, dtype=torch.uint8, device=wire), 0)
        sync()
        wire_ms.append((time.perf_counter() - t0) * 1e3)
    del buf
    if rank == 1:
        return {}
    rows = {"wire": _row(wire_ms, nbytes, None)}
    if device.type == "cuda":
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev2 = torch.empty_like(dev)
        for name, (dst, src) in (("d2h", (host, dev)), ("h2d", (dev, host)), ("d2d", (dev2, dev))):
            samples = []
            for _ in range(args.link_rounds):
                sync()
                t0 = time.perf_counter()
                dst.copy_(src, non_blocking=True)
                sync()
                samples.append((time.perf_counter() - t0) * 1e3)
            rows[name] = _row(samples, nbytes, None)
        del dev, host, dev2
    return rows


def build_parser() -> Any:
    p = parser(__doc__)
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="default wan2.1-1.3b on CUDA, tiny on the CPU (wan1.3b: an alias)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available, else cpu")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="the group: auto = nccl with 2+ CUDA devices, else gloo (one GPU: both ranks on cuda:0)")
    p.add_argument("--transport", choices=("auto", "wire", "ipc"), default="auto",
                   help="how the tensors move (send / recv_sessions' transport=): auto = CUDA IPC between CUDA pools "
                        "of one machine, else the group; wire = the group; ipc = CUDA IPC or fail")
    p.add_argument("--compute", choices=("model", "attention"), default="model",
                   help="the chunk step that fills the session: the model (default) or every layer's attention")
    p.add_argument("--chunks-timed", type=int, default=3, help="chunk steps timed after the warm-up (default 3)")
    p.add_argument("--rounds", type=int, default=3, help="round trips rank 0 -> 1 -> 0 (default 3)")
    p.add_argument("--link-rounds", type=int, default=3, help="samples of each baseline (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None,
                   help="folder for session_transport.json (default: benchmarks/results/session_transport_<device>.json)")
    return p


def print_table(payload: dict[str, Any]) -> None:
    cfg = payload["config"]
    used = payload.get("transport", {"requested": "wire", "used": ["wire"]})  # results before --transport
    print(f"{cfg['shape']} on {cfg['device']} over {cfg['backend']} (wire: {cfg['wire_device']}; transport "
          f"{used['requested']} -> {'+'.join(used['used'])}); session "
          f"{payload['sizes']['total_bytes'] / 1e9:.3g} GB; chunk step {payload['chunk_step']['median_ms']:.4g} ms")
    print(f"{'move / baseline':16s} {'median ms':>11s} {'IQR ms':>9s} {'GB/s':>8s} {'x step':>8s}")
    for group in ("moves", "baselines"):
        for name, row in payload[group].items():
            print(f"{name:16s} {row['median_ms']:11.4g} {row['stats']['iqr_ms']:9.3g} {row['gbps']:8.3g} "
                  f"{row['x_chunk_step']:8.3g}")
    print("check: " + ", ".join(f"{k}={v}" for k, v in payload["check"].items()) + f"; ok={payload['ok']}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = build_parser()
    args = p.parse_args(argv)
    if min(args.chunks_timed, args.rounds, args.link_rounds) < 1:
        p.error("--chunks-timed, --rounds and --link-rounds must be >= 1")
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        fail(p.prog, "--device cuda: CUDA is not available (torch.cuda.is_available() is False); "
                     "use --device cpu for a smoke run")
    if args.backend == "auto":
        args.backend = "nccl" if args.device == "cuda" and torch.cuda.device_count() >= 2 else "gloo"
    if args.backend == "nccl" and (args.device != "cuda" or torch.cuda.device_count() < 2):
        fail(p.prog, "--backend nccl: expected --device cuda with 2 CUDA devices (NCCL refuses two ranks on one)")
    if args.transport == "ipc" and args.device != "cuda":
        fail(p.prog, "--transport ipc: expected --device cuda (CUDA IPC shares device memory)")
    if not dist.is_available() or (args.backend == "gloo" and not dist.is_gloo_available()):
        fail(p.prog, f"torch.distributed with {args.backend} is not available")
    if args.shape is None:
        args.shape = "wan2.1-1.3b" if args.device == "cuda" else "tiny"
    with tempfile.TemporaryDirectory(prefix="ardiff_session_transport_") as tmp:
        result = os.path.join(tmp, "rank0.json")
        mp.start_processes(_worker, args=(_free_port(), args, result), nprocs=2, start_method="spawn")
        payload = json.loads(Path(result).read_text())
    print_table(payload)
    save_json(result_path(args.out, "session_transport.json", device=args.device), payload, args=args)
    return payload


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
