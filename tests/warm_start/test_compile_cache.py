"""``save_compile_cache`` / ``load_compile_cache``: the file (atomic, checked) over torch's own mega-cache; crafted
files (entry keys that leave the cache directory, a valid checksum over a hostile payload, signatures: issue 40)
refused before torch sees a byte; and a real round trip -- a fresh process with an empty inductor cache hits the
FX-graph cache after loading the file another process saved, and misses without it."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import ardiff_modules as am
from ardiff_modules import warm_start
from tests.support.paths import REPO_ROOT


def mega_cache(entries: dict[str, list[tuple[str, bytes]]]) -> bytes:
    """``{artifact type: [(key, content)]}`` in torch's own encoding, by torch's own serializer (not the library's
    reader): what ``torch.compiler.save_cache_artifacts`` returns."""
    from torch.compiler._cache import CacheArtifactFactory, CacheArtifactManager, _serialize_single_cache
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    CacheArtifactManager._ensure_cache_artifacts_registered()
    serializer = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
    serializer.extend((kind, [CacheArtifactFactory.create(kind, k, c) for k, c in items]) for kind, items in entries.items())
    return serializer.to_bytes()


#: Keys as torch makes them: hashes, autotune's "<dir>/<file>", a PGO job key with colons.
TORCH_ENTRIES = {
    "inductor": [("fzr3kq", b"\x80graph" * 8), ("fab12c", b"\x80graph2")],
    "aot_autograd": [("ak2mz7", b"\x80aot")],
    "autotune": [("bq/bqd4x.best_config", b"{}")],
    "pgo": [("myjob:None:", b"\x80code")],
}


def write_cache_file(path: Path, payload: bytes, **header: object) -> None:
    """A compile-cache file as anyone can write it: this torch, ``payload`` with its correct size and SHA-256."""
    fields = {"torch": torch.__version__, "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest(),
              "artifacts": {}, **header}
    path.write_bytes(warm_start.COMPILE_CACHE_MAGIC + json.dumps(fields).encode() + b"\n" + payload)


class FakeTorchCache:
    """Stands in for ``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts`` (the wrapper's logic alone)."""

    def __init__(self, payload: bytes | None = None) -> None:
        self.payload = mega_cache(TORCH_ENTRIES) if payload is None else payload
        self.loaded: list[bytes] = []
        self.refuse = False
        self.nothing = False
        self.saves = 0

    def save(self) -> tuple[bytes, SimpleNamespace] | None:
        self.saves += 1
        if self.nothing:
            return None
        return self.payload, SimpleNamespace(artifacts={"inductor": ["a", "b"], "aot_autograd": ["c"]})

    def load(self, data: bytes) -> SimpleNamespace | None:
        self.loaded.append(data)
        return None if self.refuse else SimpleNamespace(artifacts={"inductor": ["a"]} if data else {})


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeTorchCache:
    cache = FakeTorchCache()
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", cache.save)
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", cache.load)
    return cache


def test_save_writes_a_checked_file_and_load_hands_torch_its_bytes(fake: FakeTorchCache, tmp_path: Path) -> None:
    path = tmp_path / "compile.bin"
    written = am.save_compile_cache(path)
    data = path.read_bytes()
    assert written == len(data) and data.startswith(warm_start.COMPILE_CACHE_MAGIC) and data.endswith(fake.payload)
    header = json.loads(data.split(b"\n")[1])
    assert header["torch"] == torch.__version__ and header["bytes"] == len(fake.payload)
    assert header["artifacts"] == {"inductor": 2, "aot_autograd": 1}
    assert am.load_compile_cache(str(path)) is True
    assert fake.loaded == [fake.payload]  # exactly torch's bytes
    assert [p.name for p in tmp_path.iterdir()] == ["compile.bin"]  # no temporary file left


def test_nothing_to_save_writes_nothing_and_keeps_an_old_file(fake: FakeTorchCache, tmp_path: Path) -> None:
    path = tmp_path / "compile.bin"
    assert am.save_compile_cache(path) > 0
    old = path.read_bytes()
    fake.nothing = True
    assert am.save_compile_cache(path) == 0
    assert path.read_bytes() == old
    assert am.save_compile_cache(tmp_path / "new.bin") == 0 and not (tmp_path / "new.bin").exists()


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(
    fake: FakeTorchCache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "compile.bin"
    am.save_compile_cache(path)
    old = path.read_bytes()
    fake.payload = b"newer" * 10

    def broken(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(warm_start.os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        am.save_compile_cache(path)
    assert path.read_bytes() == old and [p.name for p in tmp_path.iterdir()] == ["compile.bin"]


def test_a_missing_file_names_its_path(fake: FakeTorchCache, tmp_path: Path) -> None:
    path = tmp_path / "nowhere" / "compile.bin"
    with pytest.raises(FileNotFoundError, match=f"no compile cache file at {path}") as info:
        am.load_compile_cache(path)
    assert info.value.filename == str(path) and fake.loaded == []


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda d: d[:-3], r"truncated or corrupt"),
        (lambda d: d[:-1] + bytes([d[-1] ^ 1]), r"truncated or corrupt"),
        (lambda d: b"not a cache file at all", r"expected a file written by save_compile_cache"),
        (lambda d: b"", r"expected a file written by save_compile_cache"),
        (lambda d: warm_start.COMPILE_CACHE_MAGIC + b"{oops\n" + d, r"header of .* is unreadable"),
    ],
    ids=["truncated", "flipped-bit", "other-format", "empty", "bad-header"],
)
def test_a_corrupt_file_is_a_library_error_naming_it(fake: FakeTorchCache, tmp_path: Path, damage: Callable[[bytes], bytes], match: str) -> None:
    path = tmp_path / "compile.bin"
    am.save_compile_cache(path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(am.CompileCacheError, match=match) as info:
        am.load_compile_cache(path)
    assert str(path) in str(info.value) and isinstance(info.value, ValueError)
    assert fake.loaded == []  # torch never saw the bytes


def test_bytes_torch_refuses_are_a_library_error(fake: FakeTorchCache, tmp_path: Path) -> None:
    path = tmp_path / "compile.bin"
    am.save_compile_cache(path)
    fake.refuse = True
    with pytest.raises(am.CompileCacheError, match=f"load_cache_artifacts refused.*|.*{path.name}"):
        am.load_compile_cache(path)


def test_another_torch_versions_file_is_not_loaded(
    fake: FakeTorchCache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "compile.bin"
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu128")
    am.save_compile_cache(path)
    monkeypatch.undo()
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", fake.load)
    with caplog.at_level(logging.WARNING, logger="ardiff_modules.warm_start"):
        assert am.load_compile_cache(path) is False
    assert fake.loaded == [] and "saved by torch 2.11.0+cu128" in caplog.text


def test_the_wrappers_leave_torchs_configuration_alone(fake: FakeTorchCache, tmp_path: Path) -> None:
    before = (torch._inductor.config.save_config_portable(), torch._dynamo.config.save_config_portable())
    am.save_compile_cache(tmp_path / "c.bin")
    am.load_compile_cache(tmp_path / "c.bin")
    assert (torch._inductor.config.save_config_portable(), torch._dynamo.config.save_config_portable()) == before


# ------------------------------------------------------------------ the real thing, in fresh processes
CHILD = r"""
import json, sys
import torch
import ardiff_modules as am
from torch._dynamo.utils import counters

mode, path = sys.argv[1], sys.argv[2]
loaded = am.load_compile_cache(path) if mode == "load" else None
f = torch.compile(lambda x: (x.sin() * 2 + x.cos()).sum(-1), backend="inductor", fullgraph=True)
f(torch.randn(8, 8))
saved = am.save_compile_cache(path) if mode == "save" else None
print(json.dumps({"loaded": loaded, "saved": saved, "inductor": dict(counters["inductor"])}))
"""


def _cxx() -> str | None:
    return next((shutil.which(c) for c in (os.environ.get("CXX") or "g++", "g++", "c++", "clang++") if shutil.which(c)),
                None)


def _child(mode: str, path: Path, cache_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TORCH_COMPILE"))}
    # One compile thread: no worker pool to start (seconds on a 2-core machine); the child's own environment.
    env.update(TORCHINDUCTOR_CACHE_DIR=str(cache_dir), TORCHINDUCTOR_COMPILE_THREADS="1", PYTHONPATH=str(REPO_ROOT),
               CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-c", CHILD, mode, str(path)], capture_output=True, text=True, env=env, check=False,
                          cwd=REPO_ROOT, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(_cxx() is None, reason="inductor on the CPU needs a C++ compiler (g++ / c++ / clang++): none found")
def test_a_fresh_process_hits_the_fx_graph_cache_after_loading_and_misses_without(tmp_path: Path) -> None:
    path = tmp_path / "compile.bin"
    cold = _child("save", path, tmp_path / "inductor-cold")  # empty cache dir, nothing loaded: compiles
    assert cold["inductor"].get("fxgraph_cache_miss", 0) >= 1 and cold["inductor"].get("fxgraph_cache_hit", 0) == 0
    assert cold["saved"] == path.stat().st_size > 0
    warm = _child("load", path, tmp_path / "inductor-warm")  # another empty cache dir, the file loaded first
    assert warm["loaded"] is True
    assert warm["inductor"].get("fxgraph_cache_hit", 0) >= 1 and warm["inductor"].get("fxgraph_cache_miss", 0) == 0
