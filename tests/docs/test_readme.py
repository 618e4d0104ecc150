"""The README's "Use" program runs as written (small sizes), compiled, as one frame over a rollout."""

from __future__ import annotations

import linecache
import re

import pytest
import torch
from tests.support.paths import README



# The only lines the test changes: the sizes. Everything else runs exactly as the README shows it.
SIZES = {
    "layers, dim, heads, head_dim, text_dim, text_tokens = 30, 1536, 12, 128, 4096, 512":
        "layers, dim, heads, head_dim, text_dim, text_tokens = 2, 32, 4, 8, 24, 7",
    "frames, height, width, page_size, num_chunks = 3, 30, 52, 120, 20":
        "frames, height, width, page_size, num_chunks = 2, 2, 3, 4, 10",
    'device, dtype, budget = "cuda", torch.bfloat16, 16 << 30':
        'device, dtype, budget = "cpu", torch.float32, 1 << 20',
}


def use_program() -> str:
    """The first ```python block of the README's "## Use" section."""
    text = README.read_text()
    section = text[text.index("\n## Use\n"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "README '## Use' has no python block"
    return match.group(1)


def small_program() -> str:
    source = use_program()
    for written, small in SIZES.items():
        assert source.count(written) == 1, f"README 'Use' no longer contains the sizes line {written!r}"
        source = source.replace(written, small)
    return source


@pytest.mark.slow
def test_readme_use_program_runs_compiled_as_one_frame() -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() keeps the counters of earlier tests' compilations
    torch.manual_seed(0)
    namespace: dict[str, object] = {"__name__": "readme_use"}
    source = small_program()
    # NOTE: the program's own source under its own name: dynamo reads the source of the functions it
    # compiles, and README.md itself (markdown around the block, sizes swapped) is not Python.
    filename = "<README.md: Use>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    with torch._dynamo.config.patch(error_on_recompile=True):
        exec(compile(source, filename, "exec"), namespace)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert frames == 1, f"expected one compiled frame over the rollout, got {frames}"

    spec, cache, state = namespace["spec"], namespace["cache"], namespace["state"]
    video = namespace["video"]
    assert len(video) == namespace["num_chunks"]
    assert all(bool(torch.isfinite(chunk).all()) for chunk in video)
    # After 10 chunks with sink 1 + window 6, each branch keeps exactly 7 chunks resident.
    for branch in ("cond", "uncond"):
        history = state.branch_pages(branch)
        assert history.committed_chunks == namespace["num_chunks"]
        assert len(history.history) == spec.sink_chunks + spec.window_chunks
    cache.close()


def test_readme_use_program_is_the_one_the_test_runs() -> None:
    # Fails loudly when someone edits the README's sizes line without the test (or the block moves).
    source = use_program()
    for written in SIZES:
        assert written in source
    assert "torch.compile(model, fullgraph=True)" in source
