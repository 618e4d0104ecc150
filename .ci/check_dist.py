"""Build the sdist and the wheel with ``python -m build`` and check them (issue 26, item 5). Run by ``.ci/run``.

* the wheel holds the package, the reference model (``ardiff_modules/models/``) included, and nothing else:
  no tests, examples or benchmarks;
* the sdist is self-testing: it holds tests/, examples/, benchmarks/, docs/, README.md, pyproject.toml;
  installed into a fresh venv (``--system-site-packages``: torch is not downloaded again), the installed
  package has the model; in the unpacked sdist ``pytest --collect-only`` collects with 0 errors, and a few
  fast test files pass there (not the whole suite a second time).

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
#: Fast files run from the unpacked sdist: the layering / docs/design.md agreement, the packaged model, the examples.
FAST_TESTS = ("tests/api", "tests/docs/test_examples.py")


def run(*cmd: str | Path, cwd: Path | None = None) -> str:
    print("+", " ".join(map(str, cmd)), flush=True)
    result = subprocess.run(list(map(str, cmd)), cwd=cwd, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"check_dist: exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
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


def check_installed_sdist(sdist: Path, root: Path, work: Path) -> None:
    env = work / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=True).create(env)
    python = env / "bin" / "python"
    run(python, "-m", "pip", "install", "-q", "--disable-pip-version-check", sdist)
    # From outside the unpacked tree: the *installed* package must carry the model.
    where = run(python, "-c", "import ardiff_modules.models.wan_causal_dit as m; print(m.__file__)", cwd=work).strip()
    check(where.startswith(str(env)), f"the model imported from {where}, not from the venv's installed sdist")
    out = run(python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", cwd=root)
    summary = out.strip().splitlines()[-1]
    check(re.fullmatch(r"\d+ tests collected in [\d.]+s", summary) is not None, f"collection: {summary}")
    print("sdist collection:", summary)
    out = run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FAST_TESTS, cwd=root)
    print("sdist fast tests:", out.strip().splitlines()[-1])


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
