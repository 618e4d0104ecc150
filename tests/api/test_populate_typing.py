"""``populate_cross_attention`` takes what users actually hold (issue 26, item 6): typed, and checked at run time.

The Use program's pattern ``[b.cross_attn for b in model.blocks]`` is a ``list[Tensor | Module]`` to mypy
(``nn.Module.__getattr__``'s type), so the signature accepts any modules and the function checks each
element. mypy runs over ``typing_snippets/`` (the docs' patterns must pass, ``misuse_populate.py``'s
marked lines must fail), against this checkout's package (``mypy_path``), with a cache under a tmp dir.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from ardiff_modules import SpecError, populate_cross_attention
from tests.support.paths import REPO_ROOT
from tests.support.streaming_model import LibraryStreaming, TEXT, tiny_model_and_spec

SNIPPETS = Path(__file__).parent / "typing_snippets"
MISUSE = SNIPPETS / "misuse_populate.py"
ERROR_LINE = re.compile(r"^(?P<path>[^:]+):(?P<line>\d+): error: (?P<message>.*)$")


@pytest.fixture(scope="module")
def mypy_errors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[int, str]]]:
    """One mypy run over every snippet: file name -> ``(line, message)`` of each error."""
    api = pytest.importorskip("mypy.api", reason="mypy is not installed (pip install -e '.[test]')")
    tmp = tmp_path_factory.mktemp("mypy")
    config = tmp / "mypy.ini"  # not the project's config: only the snippets, this checkout's package
    config.write_text(f"[mypy]\nmypy_path = {REPO_ROOT}\n")
    files = sorted(str(p) for p in SNIPPETS.glob("*.py"))
    assert len(files) >= 3, files
    stdout, stderr, status = api.run([
        "--config-file", str(config), "--cache-dir", str(tmp / "cache"), "--follow-imports=silent",
        "--show-error-codes", "--no-color-output", "--hide-error-context", *files,
    ])
    assert status in (0, 1), f"mypy crashed (status {status}):\n{stdout}\n{stderr}"
    errors: dict[str, list[tuple[int, str]]] = {Path(f).name: [] for f in files}
    for line in stdout.splitlines():
        match = ERROR_LINE.match(line)
        if match:
            errors[Path(match["path"]).name].append((int(match["line"]), match["message"]))
    return errors


@pytest.mark.slow
def test_readme_patterns_type_check(mypy_errors: dict[str, list[tuple[int, str]]]) -> None:
    good = {name: found for name, found in mypy_errors.items() if name != MISUSE.name}
    assert {"readme_use_populate.py", "library_model_populate.py"} <= set(good)
    assert all(not found for found in good.values()), good


@pytest.mark.slow
def test_misuse_is_rejected_by_mypy(mypy_errors: dict[str, list[tuple[int, str]]]) -> None:
    marked = [i for i, text in enumerate(MISUSE.read_text().splitlines(), 1) if text.endswith("# mypy-error")]
    assert len(marked) == 3
    flagged = {line for line, _ in mypy_errors[MISUSE.name]}
    assert flagged == set(marked), mypy_errors[MISUSE.name]


# ------------------------------------------------------------------ run time: the element check
def _published(runner: LibraryStreaming) -> list[torch.Tensor]:
    return [layer["k"].clone() for layer in runner.state.get_cross_attention_kv("cond", TEXT)]


def test_a_non_layer_element_names_its_index_and_type_and_keeps_the_previous_cache() -> None:
    model, spec = tiny_model_and_spec()
    runner = LibraryStreaming(model, spec, 16)
    old = torch.randn(5, model.context_dim)
    populate_cross_attention(runner.state, "cond", [b.cross for b in model.blocks], old)
    before = _published(runner)
    projected = []
    hooks = [b.cross.to_k.register_forward_hook(lambda *a: projected.append(1)) for b in model.blocks]
    layers: list[nn.Module] = [b.cross for b in model.blocks]
    layers[2] = model.blocks[2].attn  # a ChunkSelfAttention where a CachedCrossAttention belongs
    with pytest.raises(SpecError, match=r"populate_cross_attention\.layers\[2\]: .*got ChunkSelfAttention at 2"):
        populate_cross_attention(runner.state, "cond", layers, torch.randn(5, model.context_dim))
    with pytest.raises(SpecError, match=r"layers\[0\]: .*got Tensor at 0"):
        populate_cross_attention(runner.state, "cond", [torch.zeros(3)], torch.randn(5, model.context_dim))
    for hook in hooks:
        hook.remove()
    assert projected == []  # refused before any layer projected the new context
    for a, b in zip(_published(runner), before):
        assert torch.equal(a, b)


def test_a_module_list_is_accepted_at_run_time() -> None:
    model, spec = tiny_model_and_spec()
    runner = LibraryStreaming(model, spec, 16)
    context = torch.randn(5, model.context_dim)
    populate_cross_attention(runner.state, "cond", nn.ModuleList(b.cross for b in model.blocks), context)
    for block, layer in zip(model.blocks, runner.state.get_cross_attention_kv("cond", TEXT)):
        k, _ = block.cross.project_kv(context)
        torch.testing.assert_close(layer["k"], k)
