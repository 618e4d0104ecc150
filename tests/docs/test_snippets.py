"""Every python block of the README and the docs runs as copied, on a CPU, in a fresh process (issue 44).

One subprocess per page (``python -m tests.support.snippets PAGE``), each block ``exec``'d there in a fresh
namespace: the torch import is paid once a page instead of once a block. A failure names the page and the
block's line. ``# fragment`` blocks are skipped, at most one per page.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import README, REPO_ROOT
from tests.support.snippets import Block, page_blocks, pages, python_blocks, python_view

#: CPU seconds one block may take (the rule is "well under ~10 s" on an idle CPU; the torch import counts).
#: CPU time, not wall time: the CI machine is shared, and a loaded machine stretches wall time many times.
BLOCK_CPU_SECONDS = 20
#: Wall seconds a page's process may take, per runnable block and for the interpreter's start.
BLOCK_WALL_SECONDS = 120
STARTUP_WALL_SECONDS = 60

RUNNABLE = [p for p in pages() if any(not b.fragment for b in page_blocks(p))]


def _page_id(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT))


def _tree() -> set[str]:
    """Every file of the work tree but git's, caches and the built site (to see what a page's blocks wrote)."""
    skip = {".git", "__pycache__", ".hypothesis", ".pytest_cache", ".mypy_cache", "site", ".venv", ".gpu"}
    found = set()
    for root, dirs, files in os.walk(REPO_ROOT):
        dirs[:] = [d for d in dirs if d not in skip and not d.endswith(".egg-info")]
        found.update(os.path.join(root, f) for f in files)
    return found


@pytest.mark.parametrize("page", RUNNABLE, ids=_page_id)
def test_page_blocks_run_as_copied(page: Path) -> None:
    runnable = [b for b in page_blocks(page) if not b.fragment]
    before = _tree()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # a CPU, whatever the machine has
    try:
        result = subprocess.run(
            [sys.executable, "-m", "tests.support.snippets", str(page)], cwd=REPO_ROOT, env=env,
            capture_output=True, text=True, timeout=STARTUP_WALL_SECONDS + BLOCK_WALL_SECONDS * len(runnable),
        )
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{_page_id(page)}: its blocks (lines {[b.line for b in runnable]}) ran past {error.timeout} s\n"
                    f"{error.stdout}")
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{_page_id(page)}: a python block failed\n{output[-6000:]}"
    cpu = {int(line): float(s) for line, s in re.findall(r"^BLOCK (\d+) ([\d.]+) [\d.]+$", result.stdout, re.M)}
    assert sorted(cpu) == [b.line for b in runnable], output[-2000:]
    slow = {line: s for line, s in cpu.items() if s > BLOCK_CPU_SECONDS}
    assert not slow, f"{_page_id(page)}: blocks took over {BLOCK_CPU_SECONDS} CPU s (CPU seconds by line): {slow}"
    written = sorted(_tree() - before)
    assert not written, f"{_page_id(page)}: blocks wrote into the repository (use tempfile.mkdtemp()): {written}"


@pytest.mark.parametrize("page", pages(), ids=_page_id)
def test_fragments_are_rare_and_fences_are_found(page: Path) -> None:
    blocks = page_blocks(page)
    fragments = [b.line for b in blocks if b.fragment]
    assert len(fragments) <= 1, f"{_page_id(page)}: {len(fragments)} '# fragment' blocks (lines {fragments}), at most 1"
    # An indented fence (inside a list) would be rendered but never run: keep python blocks at column 0.
    indented = [n for n, line in enumerate(page.read_text().splitlines(), 1) if re.match(r"\s+`{3,}py", line)]
    assert not indented, f"{_page_id(page)}: indented python fences at lines {indented}"


def test_the_readme_and_the_getting_started_page_have_runnable_programs() -> None:
    # The snippet run above is only worth something if it finds the programs.
    for page in (README, REPO_ROOT / "docs" / "getting_started.md"):
        assert page in RUNNABLE, f"{_page_id(page)} has no runnable python block"


def test_extraction_keeps_line_numbers_and_skips_other_languages() -> None:
    text = "# t\n\n```bash\nls\n```\n\n```python\nx = 1\ny = 2\n```\n\n````python\n# fragment\nz\n````\n"
    blocks = python_blocks(text, "page.md")
    assert blocks == [Block("page.md", 8, "x = 1\ny = 2\n"), Block("page.md", 13, "# fragment\nz\n")]
    assert [b.fragment for b in blocks] == [False, True]
    assert blocks[0].padded().splitlines()[7] == "x = 1"
    view = python_view(text, blocks).splitlines()
    assert (view[7], view[8], view[12]) == ("x = 1", "y = 2", "")  # the fragment is not part of the view


def test_a_failing_block_is_reported_with_its_page_and_line(tmp_path: Path) -> None:
    page = tmp_path / "probe.md"
    page.write_text("# probe\n\n```python\nprint('ok')\n```\n\ntext\n\n```python\nx = 1\nraise ValueError(x)\n```\n")
    result = subprocess.run([sys.executable, "-m", "tests.support.snippets", str(page)], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "BLOCK 4 " in result.stdout and f"FAILED {page}:10" in result.stdout
    assert f'File "{page}", line 11' in result.stderr  # the traceback's line is the page's line
