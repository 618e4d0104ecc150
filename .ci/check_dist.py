"""Build the sdist and the wheel with ``python -m build`` and check them (issue 26, item 5). Run by ``.ci/run``.

* the wheel holds the package, the reference model (``ardiff_modules/models/``) included, and nothing else:
  no tests, examples or benchmarks;
* the sdist is self-testing: it holds tests/, examples/, benchmarks/, docs/, README.md, pyproject.toml;
  installed into a fresh venv (``--system-site-packages``: torch is not downloaded again), the installed
  package has the model; in the unpacked sdist one pytest run collects every test with 0 errors and runs a
  few fast test files (not the whole suite a second time: the rest deselected, ``slow`` ones too).

Usage: ``python3 .ci/check_dist.py [--keep DIR]`` from anywhere (needs ``build``: the ``test`` extra).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import venv
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = ("ardiff_modules/models/__init__.py", "ardiff_modules/models/wan_causal_dit.py")
WHEEL_MUST = (*MODEL, "ardiff_modules/__init__.py", "ardiff_modules/py.typed")
SDIST_MUST = (*MODEL, "README.md", "pyproject.toml", "LICENSE", "mkdocs.yml", "docs/design.md", "tests/conftest.py",
              "tests/support/paths.py",
              "examples/streaming_generation.py", "benchmarks/__init__.py", "benchmarks/end_to_end.py")
SDIST_TREES = ("tests/", "examples/", "benchmarks/", "benchmarks/results/", "docs/")
#: Fast files run from the unpacked sdist: the layering / docs/design.md agreement, the packaged model, the examples
#: (their ``slow`` tests -- a compile, mypy runs -- already ran in the main suite).
FAST_TESTS = ("tests/api", "tests/docs/test_examples.py")


def run(*cmd: str | Path, cwd: Path | None = None) -> str:
    print("+", " ".join(map(str, cmd)), flush=True)
    start = time.perf_counter()
    result = subprocess.run(list(map(str, cmd)), cwd=cwd, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"check_dist: exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    print(f"  ({time.perf_counter() - start:.1f} s)", flush=True)  # where CI's minutes go
    return result.stdout


def check(ok: bool, message: str) -> None:
    if not ok:
        sys.exit(f"check_dist: {message}")


def check_wheel(wheel: Path) -> int:
    names = zipfile.ZipFile(wheel).namelist()
    missing = [n for n in WHEEL_MUST if n not in names]
    check(not missing, f"the wheel lacks {missing}")
    tops = {n.split("/")[0] for n in names}
    stray = sorted(t for t in tops if t != "ardiff_modules" and not t.endswith(".dist-info"))
    check(not stray, f"the wheel holds more than the package: {stray}")
    return len(names)


def check_sdist(sdist: Path, into: Path) -> tuple[int, Path]:
    with tarfile.open(sdist) as tar:
        names = [m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile() and "/" in m.name]
        if hasattr(tarfile, "data_filter"):  # 3.12, and 3.10.12 / 3.11.4 backports
            tar.extractall(into, filter="data")
        else:
            tar.extractall(into)
    missing = [n for n in SDIST_MUST if n not in names]
    missing += [t for t in SDIST_TREES if not any(n.startswith(t) for n in names)]
    check(not missing, f"the sdist lacks {missing}")
    junk = [n for n in names if "__pycache__" in n or n.endswith(".pyc") or "/.hypothesis/" in n]
    check(not junk, f"the sdist holds build junk: {junk[:5]}")
    check("examples/wan_causal_dit.py" not in names, "the model is back in examples/")
    (root,) = into.iterdir()
    return len(names), root


def deselected(root: Path, keep: tuple[str, ...] = FAST_TESTS) -> list[str]:
    """The ``--deselect`` node-id prefixes that leave only ``keep`` to run: every other test file or folder on
    the way down to each kept path (one pytest run then still collects, so imports, the whole tree)."""
    out: list[str] = []

    def walk(folder: Path) -> None:
        for entry in sorted(folder.iterdir()):
            rel = entry.relative_to(root).as_posix()
            if rel in keep:
                continue
            if entry.is_dir() and any(k.startswith(rel + "/") for k in keep):
                walk(entry)
            elif entry.is_dir() or (entry.name.startswith("test_") and entry.suffix == ".py"):
                out.append(rel)

    walk(root / "tests")
    return out


def check_installed_sdist(sdist: Path, root: Path, work: Path) -> None:
    env = work / "venv"
    # No pip of its own (ensurepip takes seconds, and its bundled setuptools would shadow the parent's): the
    # parent's pip installs into it. The sdist was built in an isolated environment by `python -m build`
    # already; here its build requirements come from the parent's site packages (no second build venv).
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env)
    python = env / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--disable-pip-version-check",
        "--no-build-isolation", sdist)
    # From outside the unpacked tree: the *installed* package must carry the model.
    where = run(python, "-c", "import ardiff_modules.models.wan_causal_dit as m; print(m.__file__)", cwd=work).strip()
    check(where.startswith(str(env)), f"the model imported from {where}, not from the venv's installed sdist")
    # One run (one import of every test module, not two): a collection error fails it (exit 2), and the
    # summary must show the rest of the tree collected and deselected.
    skip = [arg for prefix in deselected(root) for arg in ("--deselect", prefix)]
    out = run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *skip, cwd=root)
    summary = out.strip().splitlines()[-1]
    check(re.search(r"\d+ passed.* \d+ deselected", summary) is not None and "error" not in summary,
          f"sdist tests: {summary}")
    print("sdist collection and fast tests:", summary)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keep", type=Path, help="an empty folder to work in (kept), instead of a temporary one")
    args = p.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="check_dist-") as tmp:
        work = args.keep.resolve() if args.keep else Path(tmp)
        check(not work.exists() or not any(work.iterdir()), f"--keep {work}: expected an empty folder")
        dist = work / "dist"
        run(sys.executable, "-m", "build", "--outdir", dist, REPO)
        (sdist,), (wheel,) = sorted(dist.glob("*.tar.gz")), sorted(dist.glob("*.whl"))
        wheel_files = check_wheel(wheel)
        (work / "unpacked").mkdir(parents=True, exist_ok=True)
        sdist_files, root = check_sdist(sdist, work / "unpacked")
        print(f"wheel {wheel.name}: {wheel_files} files; sdist {sdist.name}: {sdist_files} files", flush=True)
        check_installed_sdist(sdist, root, work)
    print(f"check_dist: OK in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
