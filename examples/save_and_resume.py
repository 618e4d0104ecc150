"""A stream that outlives its process: save a running session, kill the process, load it in a new one, continue.

Three processes: the first streams ``--save-after`` chunks, saves its session to a safetensors file
(``KVCache.save_sessions``) and is killed (SIGKILL: nothing runs after the save); the second loads the file
(``KVCache.load_sessions``) into a fresh cache and streams the remaining chunks; this one streams the whole video
uninterrupted and checks that every chunk's attention output is bit-identical. The attention layers are called
directly (``chunk_attention`` over seeded q/k/v, a text prompt in cross-attention): the point is the cache.

    python examples/save_and_resume.py                          # CPU, reference backend
    python examples/save_and_resume.py --chunks 8 --save-after 5 --path /tmp/stream.safetensors
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence

import torch

import ardiff_modules as am

BRANCHES = ("cond", "uncond")
SPEC = am.KVCacheSpec(
    num_layers=4, num_kv_heads=4, head_dim=32, chunk_size=64, page_size=16, sink_chunks=1, window_chunks=2,
    branches=BRANCHES, cross_attention=(am.CrossAttentionSpec("text", 8),), dtype="float32",
)


def new_cache() -> am.KVCache:
    return am.KVCache(SPEC, num_pages=64, backend="reference")


def start(cache: am.KVCache) -> am.KVState:
    """A new stream: its session and its prompt (each layer's text K/V, seeded)."""
    state = cache.open_session("video-0")
    g = torch.Generator().manual_seed(1234)
    shape = (8, SPEC.num_kv_heads, SPEC.head_dim)
    for branch in BRANCHES:
        state.populate_cross_attention(
            branch, "text", [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(4)]
        )
    return state


def stream_chunk(state: am.KVState, chunk: int) -> str:
    """One committing forward of both branches; the SHA-256 of every layer's attention output."""
    g = torch.Generator().manual_seed(chunk)
    shape = (len(BRANCHES), SPEC.chunk_size, SPEC.num_kv_heads, SPEC.head_dim)
    digest = hashlib.sha256()
    with state.prepare_forward(BRANCHES, SPEC.chunk_size, commit_current=True) as fwd:
        for layer in fwd.layers:
            q, k, v = (torch.randn(shape, generator=g) for _ in range(3))
            out = am.chunk_attention(q, k, v, layer) + am.cached_cross_attention(q, layer, "text")
            digest.update(out.numpy().tobytes())
    return digest.hexdigest()


def first_process(path: str, save_after: int) -> None:
    """Stream ``save_after`` chunks, save the session, die."""
    cache = new_cache()
    state = start(cache)
    for chunk in range(save_after):
        print(json.dumps({"chunk": chunk, "sha256": stream_chunk(state, chunk)}), flush=True)
    cache.save_sessions(path, [state])
    os.kill(os.getpid(), signal.SIGKILL)  # killed: the file is all that is left of the stream


def second_process(path: str, save_after: int, chunks: int) -> None:
    """Load the session in a fresh cache and stream the rest."""
    cache = new_cache()
    [state] = cache.load_sessions(path)
    assert state.committed_chunks("cond") == save_after
    for chunk in range(save_after, chunks):
        print(json.dumps({"chunk": chunk, "sha256": stream_chunk(state, chunk)}), flush=True)


def _phase(args: list[str], expect_killed: bool) -> list[str]:
    # NOTE: the children import the ardiff_modules this process runs (a checkout's, not only an installed one)
    root = os.path.dirname(os.path.dirname(os.path.abspath(am.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=300, env=env)
    killed = run.returncode == -signal.SIGKILL
    if killed != expect_killed or (not expect_killed and run.returncode):
        raise RuntimeError(f"phase {args[:2]} exited with {run.returncode}:\n{run.stderr}")
    return [json.loads(line)["sha256"] for line in run.stdout.splitlines()]


def run(chunks: int = 6, save_after: int = 3, path: str | None = None, quiet: bool = False) -> dict[str, list[str]]:
    """Both processes, then the uninterrupted stream here; returns the digests of each."""
    with tempfile.TemporaryDirectory() as tmp:
        path = path or os.path.join(tmp, "stream.safetensors")
        common = ["--path", path, "--chunks", str(chunks), "--save-after", str(save_after)]
        before = _phase(["--phase", "first", *common], expect_killed=True)
        after = _phase(["--phase", "second", *common], expect_killed=False)
    cache = new_cache()
    state = start(cache)
    uninterrupted = [stream_chunk(state, chunk) for chunk in range(chunks)]
    resumed = before + after
    for chunk, (a, b) in enumerate(zip(resumed, uninterrupted)):
        if not quiet:
            where = "first process" if chunk < save_after else "second process"
            print(f"chunk {chunk}  {where:14s}  {a[:16]}  {'==' if a == b else '!='} uninterrupted {b[:16]}")
    if resumed != uninterrupted:
        raise SystemExit("the resumed stream differs from the uninterrupted one")
    if not quiet:
        print("bit-identical: the stream survived its process")
    return {"resumed": resumed, "uninterrupted": uninterrupted}


def main(argv: Sequence[str] | None = None) -> dict[str, list[str]] | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--save-after", type=int, default=3, help="chunks streamed before the save and the kill")
    parser.add_argument("--path", default=None, help="the session file (default: a temporary one)")
    parser.add_argument("--phase", choices=("first", "second"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 0 < args.save_after < args.chunks:
        parser.error(f"expected 0 < --save-after < --chunks, got {args.save_after} and {args.chunks}")
    if args.phase == "first":
        first_process(args.path, args.save_after)
    elif args.phase == "second":
        second_process(args.path, args.save_after, args.chunks)
    else:
        return run(args.chunks, args.save_after, args.path)
    return None


if __name__ == "__main__":
    main()
