"""The package's import graph has no cycle (``TYPE_CHECKING`` imports included).

Parsed with ``ast`` (nothing is imported): every ``import ardiff_modules.x`` / ``from ardiff_modules.x
import ...`` / relative import anywhere in a module, including inside functions and
``if TYPE_CHECKING:`` blocks, is an edge. A package's ``__init__`` is a node of its own; importing a
name from a package counts as importing that package's ``__init__``.
"""

from __future__ import annotations

import ast
from pathlib import Path
from tests.support.paths import PACKAGE




def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            for target in targets:
                # The longest known module the target names (a submodule, or else its package).
                while target and target not in modules and target != "ardiff_modules":
                    target = target.rsplit(".", 1)[0] if "." in target else ""
                if target.startswith("ardiff_modules") and target in modules and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_find_cycle_sees_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "ardiff_modules.cache" in graph and graph["ardiff_modules.cache"], "the parser found no imports"
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])
