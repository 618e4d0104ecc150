"""The python blocks of the README and the docs pages, and the runner that runs one page's blocks (issue 44).

Rules (the docs' contract, checked by ``tests/docs/test_snippets.py``): every ```` ```python ```` block runs
as copied, alone, on a CPU, from the repository root, in a fresh namespace; a block that cannot be complete
starts with the line ``# fragment`` (at most one per page) and is not run. Blocks in other languages are
not run.

``python -m tests.support.snippets PAGE`` runs PAGE's blocks in this one process, each ``exec``'d in a fresh
namespace dict (a fresh process per page, not per block: the torch import, 2-3 s, is paid once a page).
Each block is compiled under the page's own path with its real line numbers, so a traceback names the
markdown file and line. It prints one ``BLOCK <line> <cpu seconds> <wall seconds>`` line per block run and exits 1 at the
first failing block.
"""

from __future__ import annotations

import linecache
import re
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from tests.support.paths import DOCS, README, REPO_ROOT
FRAGMENT = "# fragment"
#: A fenced block: its opening fence (3+ backticks) and info string, its body, the same fence closing it.
_FENCE = re.compile(r"^(?P<fence>`{3,})(?P<info>[^`\n]*)\n(?P<body>.*?)^(?P=fence)[ \t]*$", re.M | re.S)


@dataclass(frozen=True)
class Block:
    """One ```` ```python ```` block of a page.

    Attributes
    ----------
    page:
        The markdown file, relative to the repository root.
    line:
        The 1-based line of the block's first code line in ``page``.
    source:
        The block's code, as written.
    """

    page: str
    line: int
    source: str

    @property
    def fragment(self) -> bool:
        """Whether the block says it cannot run alone (its first line is ``# fragment``)."""
        return self.source.lstrip("\n").startswith(FRAGMENT)

    def padded(self) -> str:
        """The code preceded by blank lines, so that its line numbers are the page's."""
        return "\n" * (self.line - 1) + self.source


def pages() -> list[Path]:
    """README.md and every ``docs/**/*.md``, in a stable order."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def python_blocks(text: str, page: str) -> list[Block]:
    """The ```` ```python ```` blocks of a markdown ``text`` (``page`` names it), in order."""
    blocks = []
    for match in _FENCE.finditer(text):
        if match.group("info").strip().split(" ")[0] in ("python", "py"):
            line = text.count("\n", 0, match.start("body")) + 1
            blocks.append(Block(page, line, match.group("body")))
    return blocks


def page_blocks(path: Path) -> list[Block]:
    """The python blocks of the file at ``path`` (named relative to the repository root when inside it)."""
    name = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
    return python_blocks(path.read_text(), str(name))


def python_view(text: str, blocks: list[Block]) -> str:
    """``text`` with every line blank except the runnable blocks' code lines.

    NOTE: ``inspect`` (hence torch.compile / dynamo) reads a function's or class's source through
    ``linecache`` by file name and line number, and parses the whole "file" to find a class: registered
    under the page's name, this view is valid Python with the page's line numbers.
    """
    lines = ["\n"] * (text.count("\n") + 1)
    for block in blocks:
        if not block.fragment:
            for offset, code in enumerate(block.source.splitlines(True)):
                lines[block.line - 1 + offset] = code
    return "".join(lines)


def run_page(path: Path) -> int:
    """Run every runnable block of ``path`` here, each in a fresh namespace; 1 at the first failure."""
    text = path.read_text()
    blocks = page_blocks(path)
    filename = str(path)
    view = python_view(text, blocks)
    linecache.cache[filename] = (len(view), None, view.splitlines(True), filename)
    for block in blocks:
        if block.fragment:
            continue
        _reset_compiler()
        start, cpu = time.perf_counter(), time.process_time()
        try:
            exec(compile(block.padded(), filename, "exec"), {"__name__": "__main__"})  # noqa: S102
        except BaseException:  # noqa: BLE001 - the report names the block, then the run stops
            traceback.print_exc()
            print(f"FAILED {block.page}:{block.line}", flush=True)
            return 1
        print(f"BLOCK {block.line} {time.process_time() - cpu:.2f} {time.perf_counter() - start:.2f}", flush=True)
    return 0


def _reset_compiler() -> None:
    """Forget the previous block's compiled frames (as a fresh process would), if dynamo was loaded."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()


if __name__ == "__main__":
    sys.exit(run_page(Path(sys.argv[1]).resolve()))
