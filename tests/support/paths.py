"""Paths of the repository's files that tests read or run (the README, the docs, the examples, the benchmarks, the package)."""

from __future__ import annotations

from pathlib import Path

#: The repository's root (``tests/support/paths.py`` -> two folders up).
REPO_ROOT = Path(__file__).resolve().parents[2]
README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
EXAMPLES = REPO_ROOT / "examples"
BENCHMARKS = REPO_ROOT / "benchmarks"
PACKAGE = REPO_ROOT / "ardiff_modules"
