"""The getting-started "Use" program, run as copied (a CPU picks its tiny sizes), compiles to one frame over a rollout.

``tests/docs/test_snippets.py`` runs every block of the docs; this test runs this one in-process to also check
what the page promises about it: one compiled graph for the whole rollout (no recompiles) and a flat
sink + window history.
"""

from __future__ import annotations

import linecache

import pytest
import torch

from tests.support.paths import DOCS
from tests.support.snippets import page_blocks, python_view

PAGE = DOCS / "getting_started.md"


def use_block():  # noqa: ANN201 - a tests.support.snippets.Block
    """The first python block after the page's "## Use" heading."""
    text = PAGE.read_text()
    heading = text.count("\n", 0, text.index("\n## Use\n")) + 2
    blocks = [b for b in page_blocks(PAGE) if b.line > heading]
    assert blocks, f"{PAGE.name}: no python block under '## Use'"
    return blocks[0]


@pytest.mark.slow
def test_use_program_runs_compiled_as_one_frame() -> None:
    block = use_block()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() keeps the counters of earlier tests' compilations
    torch.manual_seed(0)
    # NOTE: dynamo reads the source of the functions it compiles through linecache: register the page's
    # python view (the blocks' lines, the markdown blanked) under the page's name.
    filename = str(PAGE)
    view = python_view(PAGE.read_text(), page_blocks(PAGE))
    linecache.cache[filename] = (len(view), None, view.splitlines(True), filename)
    namespace: dict[str, object] = {"__name__": "__main__"}
    with torch._dynamo.config.patch(error_on_recompile=True):
        exec(compile(block.padded(), filename, "exec"), namespace)  # noqa: S102
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert frames == 1, f"expected one compiled frame over the rollout, got {frames}"

    spec, cache, state = namespace["spec"], namespace["cache"], namespace["state"]
    video = namespace["video"]
    assert namespace["device"] == "cpu" or torch.cuda.is_available()
    assert len(video) == namespace["num_chunks"]
    assert all(bool(torch.isfinite(chunk).all()) for chunk in video)
    # After 10 chunks with sink 1 + window 6, each branch keeps exactly 7 chunks resident.
    for branch in ("cond", "uncond"):
        history = state.branch_pages(branch)
        assert history.committed_chunks == namespace["num_chunks"]
        assert len(history.history) == spec.sink_chunks + spec.window_chunks
    cache.close()


def test_use_program_is_the_compiled_model_program() -> None:
    # Fails loudly when the block under "## Use" is no longer the whole-model program the page describes.
    source = use_block().source
    assert "torch.compile(model, fullgraph=True" in source
    assert 'device = "cuda" if torch.cuda.is_available() else "cpu"' in source
    assert "# fragment" not in source.splitlines()[0]
