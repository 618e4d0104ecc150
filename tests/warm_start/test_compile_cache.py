"""``save_compile_cache`` / ``load_compile_cache``: the file (atomic, checked) over torch's own mega-cache; crafted
files (entry keys that leave the cache directory, a valid checksum over a hostile payload, signatures: issue 40)
refused before torch sees a byte; and a real round trip -- a fresh process with an empty inductor cache hits the
FX-graph cache after loading the file another process saved, and misses without it."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
import zlib
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
    for kind, items in entries.items():
        serializer.append((kind, [CacheArtifactFactory.create(kind, k, c) for k, c in items]))
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
        # int(1e400) is an OverflowError, not a ValueError: it escaped as a raw builtin
        (lambda d: warm_start.COMPILE_CACHE_MAGIC + b'{"bytes": 1e400, "sha256": "00"}\n' + d,
         r"header of .* is unreadable"),
    ],
    ids=["truncated", "flipped-bit", "other-format", "empty", "bad-header", "infinite-size"],
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


# ------------------------------------------------------------------ crafted files (issue 40): trusted input
@pytest.mark.parametrize("bad", [None, 3, b"compile.bin"], ids=["None", "int", "bytes"])
def test_a_path_that_is_no_path_is_a_spec_error_and_nothing_happens(fake: FakeTorchCache, bad: object) -> None:
    for call in (am.load_compile_cache, am.save_compile_cache):
        with pytest.raises(am.SpecError, match=rf"\.path: expected a str or os\.PathLike naming a file, got {bad!r}"):
            call(bad)  # type: ignore[arg-type]
    assert fake.loaded == [] and fake.saves == 0


def test_a_directory_is_a_compile_cache_error_naming_it(fake: FakeTorchCache, tmp_path: Path) -> None:
    directory = f"expected a file written by save_compile_cache at {tmp_path}, got a directory"
    with pytest.raises(am.CompileCacheError, match=directory):
        am.load_compile_cache(tmp_path)
    with pytest.raises(am.CompileCacheError, match=f"expected a file path, got the directory {tmp_path}"):
        am.save_compile_cache(tmp_path)
    assert fake.loaded == [] and fake.saves == 0 and list(tmp_path.iterdir()) == []


@pytest.fixture
def torch_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """torch's real on-disk cache directory for this test, two folders below ``tmp_path`` (``../..`` stays inside)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torch" / "cache"))
    return tmp_path / "torch" / "cache"


@pytest.mark.parametrize(
    ("kind", "key", "problem"),
    [
        ("autotune", "ABSOLUTE", "an absolute path"),
        ("autotune", "../../outside/pwned", "a '..' component"),
        ("autotune", "bq/../../../outside/pwned", "a '..' component"),
        ("inductor", "ABSOLUTE", "an absolute path"),
        ("aot_autograd", "..", "a '..' component"),
        ("autotune", "..\\..\\outside\\pwned", "a backslash"),
        ("autotune", "C:\\outside\\pwned", "a backslash"),
        ("autotune", "C:outside", "a drive"),
        ("precompile", "", "empty"),
        ("pgo", "job\x00", "a NUL byte"),
    ],
    ids=["absolute", "dotdot", "dotdot-inside", "absolute-inductor", "dotdot-alone", "backslash", "drive-path",
         "drive-relative", "empty", "nul"],
)
def test_an_entry_key_that_leaves_the_cache_directory_is_refused_before_torch_writes(
    tmp_path: Path, torch_cache_dir: Path, kind: str, key: str, problem: str
) -> None:
    # The real torch.compiler.load_cache_artifacts: an autotune entry is written at os.path.join(cache_dir, key).
    target = tmp_path / "outside" / "pwned"
    key = str(target) if key == "ABSOLUTE" else key
    entries = {"autotune": list(TORCH_ENTRIES["autotune"])}  # one bad entry after a good one
    entries.setdefault(kind, []).append((key, b"{}"))
    payload = mega_cache(entries)
    path = tmp_path / "crafted.bin"
    write_cache_file(path, payload)  # its SHA-256 is right: the checksum is no defence
    with pytest.raises(am.CompileCacheError, match="expected entry keys relative to torch's cache directory") as info:
        am.load_compile_cache(path)
    assert f"{kind!r} key {key!r} ({problem}" in str(info.value) and str(path) in str(info.value)
    assert not target.exists() and not (tmp_path / "outside").exists()
    assert not torch_cache_dir.exists()  # not one entry written, the good ones neither


class _RunsOnUnpickle:
    """A pickle that creates ``marker`` when unpickled: a hostile payload's stand-in for arbitrary code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.mkdir, (str(self.marker),)


def _records(*fields: bytes | int) -> bytes:
    """Hand-made mega-cache records: ints as u64, bytes length-prefixed (strings: pass base64 bytes)."""
    return b"".join(f.to_bytes(8, "big") if isinstance(f, int) else len(f).to_bytes(8, "big") + f for f in fields)


def _with_crc(body: bytes) -> bytes:
    return zlib.crc32(body).to_bytes(4, "big") + body


@pytest.mark.parametrize(
    ("craft", "why"),
    [
        (lambda marker: pickle.dumps(_RunsOnUnpickle(marker)), "its CRC32 does not match"),
        (lambda marker: _with_crc(_records(2, b"aW5kdWN0b3I=", 0)), "encoding version 2"),
        (lambda marker: _with_crc(_records(1, b"aW5kdWN0b3I=", 1, b"Zm9v")), "runs past the end"),
        (lambda marker: _with_crc(_records(1, b"aW5kdWN0b3I=", 2**63, b"Zm9v", b"x")), "runs past the end"),
        (lambda marker: _with_crc(_records(1, b"aW5kdWN0b3I=", 1, b"Zm9v\n/../x", b"x")), "Non-base64|Only base64"),
        (lambda marker: _with_crc(_records(1, b"aW5kdWN0b3I=", 1, b"/w==", b"x")), "utf-8"),
        (lambda marker: b"", "runs past the end"),
    ],
    ids=["pickle", "version-2", "truncated", "huge-count", "lax-base64", "not-utf8", "empty"],
)
def test_a_payload_this_library_cannot_check_is_refused_unread(
    fake: FakeTorchCache, tmp_path: Path, craft: Callable[[Path], bytes], why: str
) -> None:
    marker = tmp_path / "code-ran"
    path = tmp_path / "crafted.bin"
    write_cache_file(path, craft(marker))  # a valid checksum over a hostile payload
    with pytest.raises(am.CompileCacheError, match=f"got bytes this library cannot check .*({why})") as info:
        am.load_compile_cache(path)
    assert str(path) in str(info.value)
    assert fake.loaded == [] and not marker.exists()  # torch never saw it, nothing unpickled


KEY = b"\x13server-fleet secret\xfe"


def test_a_signed_file_loads_with_its_key_only(fake: FakeTorchCache, tmp_path: Path) -> None:
    signed, unsigned = tmp_path / "signed.bin", tmp_path / "unsigned.bin"
    am.save_compile_cache(signed, key=KEY)
    am.save_compile_cache(unsigned)
    data = signed.read_bytes()
    header = json.loads(data.split(b"\n")[1])
    assert header["signed"] is True and header["hmac_sha256"] == hmac.new(KEY, fake.payload, hashlib.sha256).hexdigest()
    assert KEY not in data and json.loads(unsigned.read_bytes().split(b"\n")[1])["signed"] is False
    refusals = [
        (signed, None, "expected an unsigned file .* got a file signed with a key"),
        (signed, b"another key", "signed with the given key, got another HMAC-SHA256"),
        (unsigned, KEY, "expected a file signed with the given key .* got an unsigned file"),
    ]
    for path, key, match in refusals:
        with pytest.raises(am.CompileCacheError, match=match):
            am.load_compile_cache(path, key=key)
    assert fake.loaded == []
    assert am.load_compile_cache(signed, key=bytearray(KEY)) is True and am.load_compile_cache(unsigned) is True
    assert fake.loaded == [fake.payload, fake.payload]


def test_a_signed_file_with_another_payload_and_a_fresh_checksum_is_refused(
    fake: FakeTorchCache, tmp_path: Path
) -> None:
    path = tmp_path / "signed.bin"
    am.save_compile_cache(path, key=KEY)
    header = json.loads(path.read_bytes().split(b"\n")[1])
    hostile = mega_cache({"autotune": [(str(tmp_path / "pwned"), b"{}")]})
    write_cache_file(path, hostile, signed=True, hmac_sha256=header["hmac_sha256"])  # signature kept, SHA-256 redone
    with pytest.raises(am.CompileCacheError, match="got another HMAC-SHA256: it was signed with another key or alt"):
        am.load_compile_cache(path, key=KEY)
    for bad in ("not hex", "é" * 64, 7):  # hmac.compare_digest would raise a TypeError on these
        write_cache_file(path, fake.payload, signed=True, hmac_sha256=bad)
        with pytest.raises(am.CompileCacheError, match="'hmac_sha256' 64 hex digits"):
            am.load_compile_cache(path, key=KEY)
    write_cache_file(path, fake.payload, signed="yes")
    with pytest.raises(am.CompileCacheError, match="expected 'signed' a bool"):
        am.load_compile_cache(path)
    assert fake.loaded == []


@pytest.mark.parametrize(("key", "got"), [("hunter2", "got str"), (b"", "got empty bytes"), (1234, "got int")])
def test_a_bad_key_is_a_spec_error_that_never_shows_it(
    fake: FakeTorchCache, tmp_path: Path, key: object, got: str
) -> None:
    am.save_compile_cache(tmp_path / "c.bin")
    fake.saves = 0
    for call in (am.save_compile_cache, am.load_compile_cache):
        with pytest.raises(am.SpecError, match=f"key: expected None or non-empty bytes .*, {got}$") as info:
            call(tmp_path / "c.bin", key=key)  # type: ignore[arg-type]
        assert "hunter2" not in str(info.value) and "1234" not in str(info.value)
    assert fake.loaded == [] and fake.saves == 0


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
