"""The package's structure, held by numbers that may only go down (issue 25).

``lint-imports`` (run by ``.ci/run``) checks the import contracts in ``pyproject.toml``; this file checks
that the code-layout list of docs/design.md *is* that contract, and holds ceilings on what the layering alone
cannot see: private names imported across modules, writes to attributes of another file's class,
modules that change allocator state, long functions and long classes. Lower a ceiling when you bring
a number down; never raise one (restructure instead).
"""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.support.paths import PACKAGE, REPO_ROOT as REPO

#: Ceilings (today's values). Only ever lower them.
MAX_PRIVATE_IMPORTS = 0
MAX_FOREIGN_ATTRIBUTE_WRITES = 1
MAX_ALLOCATOR_MUTATING_MODULES = 3  # besides the allocator itself; all of them in core/
MAX_LONG_FUNCTIONS = 0  # over FUNCTION_LINES code lines
MAX_LONG_CLASSES = 0  # over CLASS_LINES lines
MAX_FACADE_LINES = 322  # KVCache, the class (the target: ~300; a third of it is the user docstrings)
FUNCTION_LINES, CLASS_LINES = 60, 400

#: The allocator's mutating methods (and its peak, written by hand before ``checkpoint``).
ALLOCATOR_MUTATORS = {"allocate", "allocate_contiguous", "decref", "incref", "unallocate", "reorder_free", "reset_peak"}
#: ``(module, receiver)`` of the host tier's own free lists, which speak the allocator's verbs but hold host
#: pages (``HostPages``) and arena rows (``HostArena``), not device pages: not allocator state. The tier keeps
#: them per lane in ``host/lane_store.py`` (``LaneStore``).
HOST_FREE_LISTS = {
    (module, receiver)
    for module in ("ardiff_modules.host.tier", "ardiff_modules.host.lane_store")
    for receiver in ("self.pages", "self.arena")
}


def _module(path: Path) -> str:
    return ".".join(path.with_suffix("").relative_to(REPO).parts).removesuffix(".__init__")


def _trees() -> dict[str, ast.Module]:
    return {_module(p): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


TREES = _trees()


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(trees: dict[str, ast.Module]) -> list[tuple[str, str, str]]:
    """``(importer, module, name)`` for every ``from <package module> import _name`` across modules."""
    found = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ardiff_modules"):
                found += [(module, node.module, a.name) for a in node.names if _is_private(a.name)]
    return found


def _owned_attributes(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Attribute name -> modules whose classes define it (``self.x = ...``, a class-level annotation, a method)."""
    owners: dict[str, set[str]] = defaultdict(set)
    for module, tree in trees.items():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for node in ast.walk(cls):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_self(node.value):
                    owners[node.attr].add(module)
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    owners[node.target.id].add(module)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    owners[node.name].add(module)
    return owners


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def foreign_attribute_writes(trees: dict[str, ast.Module]) -> list[tuple[str, str, int]]:
    """``obj.attr = ...`` (not on ``self``) where ``attr`` belongs to classes of other modules only."""
    owners = _owned_attributes(trees)
    found = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(t, ast.Attribute) and not _is_self(t.value):
                        if owners.get(t.attr) and module not in owners[t.attr]:
                            found.append((module, ast.unparse(t), node.lineno))
    return found


def allocator_mutating_modules(trees: dict[str, ast.Module]) -> set[str]:
    """Modules (the allocator's own excepted) that call an allocator mutator or write ``peak_used``."""
    found = set()
    for module, tree in trees.items():
        for node in ast.walk(tree):
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            if call and node.func.attr in ALLOCATOR_MUTATORS:  # type: ignore[union-attr]
                if (module, ast.unparse(node.func.value)) not in HOST_FREE_LISTS:  # type: ignore[union-attr]
                    found.add(module)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr == "peak_used":
                if not _is_self(node.value):
                    found.add(module)
    return found - {"ardiff_modules.core.allocator"}


def _code_lines(node: ast.AST, lines: list[str]) -> int:
    """Non-blank, non-comment lines of a function, its docstring excluded."""
    body = getattr(node, "body", [])
    doc = 0
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        if isinstance(body[0].value.value, str):
            doc = body[0].end_lineno - body[0].lineno + 1  # type: ignore[operator]
    text = lines[node.lineno - 1 : node.end_lineno]  # type: ignore[attr-defined]
    return sum(1 for line in text if line.strip() and not line.strip().startswith("#")) - doc


def long_definitions(trees: dict[str, ast.Module]) -> tuple[list[tuple[str, str, int]], list[tuple[str, str, int]]]:
    functions, classes = [], []
    for module, tree in trees.items():
        path = REPO / (module.replace(".", "/") + ".py")
        if not path.exists():
            path = REPO / module.replace(".", "/") / "__init__.py"
        lines = path.read_text().splitlines()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = _code_lines(node, lines)
                if n > FUNCTION_LINES:
                    functions.append((module, node.name, n))
            elif isinstance(node, ast.ClassDef):
                n = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if n > CLASS_LINES:
                    classes.append((module, node.name, n))
    return functions, classes


# ------------------------------------------------------------------ the ceilings
def test_private_names_imported_across_modules_stay_under_the_ceiling():
    found = private_imports(TREES)
    assert len(found) <= MAX_PRIVATE_IMPORTS, "\n".join(map(str, found))


def test_writes_to_another_files_class_stay_under_the_ceiling():
    found = foreign_attribute_writes(TREES)
    assert len(found) <= MAX_FOREIGN_ATTRIBUTE_WRITES, "\n".join(map(str, found))


def test_only_the_core_changes_allocator_state():
    found = allocator_mutating_modules(TREES)
    assert all(m.startswith("ardiff_modules.core.") for m in found), sorted(found)
    assert len(found) <= MAX_ALLOCATOR_MUTATING_MODULES, sorted(found)


def test_long_functions_and_classes_stay_under_the_ceilings():
    functions, classes = long_definitions(TREES)
    assert len(functions) <= MAX_LONG_FUNCTIONS, functions
    assert len(classes) <= MAX_LONG_CLASSES, classes


def test_kvcache_is_a_facade():
    tree = TREES["ardiff_modules.cache"]
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KVCache"]
    assert cls.end_lineno - cls.lineno + 1 <= MAX_FACADE_LINES  # type: ignore[operator]


def test_the_metrics_see_what_they_count():
    """Each counter finds a planted case (so a ceiling cannot pass because its counter is blind)."""
    planted = ast.parse(
        "from ardiff_modules.core.branch import _private\n"
        "def f(allocator, ctx):\n"
        "    allocator.decref([1])\n"
        "    allocator.peak_used = 0\n"
        "    ctx.plan = None\n"
    )
    owner = ast.parse("class C:\n    def __init__(self):\n        self.plan = 1\n")
    trees = {"ardiff_modules.planted": planted, "ardiff_modules.owner": owner}
    assert private_imports(trees) == [("ardiff_modules.planted", "ardiff_modules.core.branch", "_private")]
    assert foreign_attribute_writes(trees) == [("ardiff_modules.planted", "ctx.plan", 5)]
    assert allocator_mutating_modules(trees) == {"ardiff_modules.planted"}
    # The host tier's free lists speak the allocator's verbs; its device allocator still counts.
    host = ast.parse("def f(self):\n    self.pages.decref([1])\n    self.arena.allocate(1)\n")
    assert allocator_mutating_modules({"ardiff_modules.host.tier": host}) == set()
    host = ast.parse("def f(self):\n    self.allocator.incref([1])\n")
    assert allocator_mutating_modules({"ardiff_modules.host.tier": host}) == {"ardiff_modules.host.tier"}


# ------------------------------------------------------------------ the layering is the design page's list
def _contract_layers() -> list[list[str]]:
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c["layers"] for c in config["contracts"] if c["type"] == "layers"]
    return [[name.strip().removeprefix("ardiff_modules.") for name in layer.split("|")] for layer in layers]


def _design_layers() -> list[list[str]]:
    """The layers of the "Layout of the code" list in docs/design.md (the docs site's Design page)."""
    text = (REPO / "docs" / "design.md").read_text()
    block = text.split("## Layout of the code", 1)[1].split("```", 2)[1]
    layers = []
    for line in block.splitlines()[1:]:
        if not line.strip() or line.startswith(" "):
            continue  # a continuation of the line above
        names = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        layers.append([n.strip().removesuffix("/").removesuffix(".py") for n in names.split("|")])
    return layers


def test_design_layout_list_is_the_import_contract():
    assert _design_layers() == _contract_layers()


def test_every_package_module_is_in_one_layer():
    listed = {name for layer in _contract_layers() for name in layer}
    top = {m.removeprefix("ardiff_modules.").split(".")[0] for m in TREES if m != "ardiff_modules"}
    assert top == listed, (sorted(top - listed), sorted(listed - top))
