"""Smoke tests of the examples (CPU, tiny preset): the causal Wan DiT and the streaming generation script."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.support.paths import EXAMPLES, REPO_ROOT

sys.path.insert(0, str(EXAMPLES))

import _report_figure  # noqa: E402
import compiled_generation  # noqa: E402
import streaming_generation  # noqa: E402
from ardiff_modules.models.wan_causal_dit import (  # noqa: E402
    BRANCHES,
    WanConfig,
    build_model,
    kv_pool_pages,
    make_kv_spec,
)

from ardiff_modules import KVCache, TensorMismatchError, populate_cross_attention  # noqa: E402
from ardiff_modules.convert import convert_wan_state_dict  # noqa: E402
from ardiff_modules.masks import chunk_visibility  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_presets_and_kv_spec() -> None:
    tiny = WanConfig.preset("tiny")
    assert (tiny.tokens_per_frame, tiny.chunk_size, tiny.kv_page_size) == (16, 48, 16)
    wan = WanConfig.preset("wan2.1-1.3b")
    assert (wan.head_dim, wan.tokens_per_frame, wan.chunk_size) == (128, 1560, 4680)
    spec = make_kv_spec(wan, "cuda")
    assert spec.dtype == "bfloat16" and spec.page_size == 120 and spec.pages_per_chunk == 39
    assert (spec.sink_chunks, spec.window_chunks, spec.branches) == (1, 6, BRANCHES)
    assert spec.cross_attention[0].name == "text" and spec.cross_attention[0].tokens == 512
    assert kv_pool_pages(spec) == 2 * (1 + 6 + 1) * 39 + 39
    assert make_kv_spec(tiny).dtype == "float32"


def test_model_forward_is_seeded_and_validates_shapes() -> None:
    config = WanConfig.preset("tiny")
    model, again = build_model(config, seed=3), build_model(config, seed=3)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
    spec = make_kv_spec(config)
    cache = KVCache(spec, num_pages=kv_pool_pages(spec))
    state = cache.open_session()
    for branch in BRANCHES:
        text = model.embed_text(torch.randn(config.text_tokens, config.text_dim))
        populate_cross_attention(state, branch, [b.cross for b in model.blocks], text)
    x = torch.randn(2, config.frames_per_chunk, config.in_channels, config.latent_height, config.latent_width)
    with torch.no_grad(), state.prepare_forward(BRANCHES, config.chunk_size, commit_current=False) as fwd:
        out = model(x, torch.tensor([500.0, 500.0]), fwd.layers)
        per_frame = model(x, torch.full((2, config.frames_per_chunk), 500.0), fwd.layers)
        with pytest.raises(TensorMismatchError, match="timestep"):
            model(x, torch.zeros(3), fwd.layers)
        with pytest.raises(TensorMismatchError, match="latents"):
            model(x[..., :4], torch.zeros(2), fwd.layers)
    assert out.shape == x.shape and torch.isfinite(out).all()
    torch.testing.assert_close(per_frame, out)
    state.close()
    assert cache.stats().pages_used == 0


def _wan_rope_reference(x: torch.Tensor, start_frame: int, grid: tuple[int, int, int], theta: float = 10000.0) -> torch.Tensor:
    """Wan2.1's ``rope_apply`` (complex, interleaved pairs) for one sample ``[seq, heads, head_dim]``."""
    f, h, w = grid
    d = x.shape[-1]
    c = d // 2
    split = [c - 2 * (c // 3), c // 3, c // 3]

    def params(dim: int, n: int) -> torch.Tensor:
        angles = torch.outer(torch.arange(n, dtype=torch.float64), 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        return torch.polar(torch.ones_like(angles), angles)

    ft = params(2 * split[0], start_frame + f)[start_frame:]
    fh, fw = params(2 * split[1], h), params(2 * split[2], w)
    freqs = torch.cat(
        [ft.view(f, 1, 1, -1).expand(f, h, w, -1), fh.view(1, h, 1, -1).expand(f, h, w, -1),
         fw.view(1, 1, w, -1).expand(f, h, w, -1)], dim=-1,
    ).reshape(f * h * w, 1, -1)
    xc = torch.view_as_complex(x.double().reshape(x.shape[0], x.shape[1], -1, 2))
    return torch.view_as_real(xc * freqs).flatten(2)


@pytest.mark.parametrize("start_frame", [5, 9_000])
def test_wan_checkpoint_loads_unpermuted_and_gives_wans_rope_attention_scores(start_frame: int) -> None:
    """A checkpoint in Wan's key layout loads strictly (renamed, never permuted) and its q/k with the
    model's RoPE give the scores of Wan's own complex RoPE at that frame offset."""
    config = WanConfig.preset("tiny")
    model = build_model(config, seed=1)
    heads, head_dim = config.num_heads, config.head_dim
    # A "Wan checkpoint": our tensors under Wan's keys (weights are arbitrary, the layout is Wan's).
    wan_sd = {
        key.replace(".attn.", ".self_attn.").replace(".cross.", ".cross_attn."): value.clone()
        for key, value in model.state_dict().items()
    }
    assert "blocks.0.self_attn.q.weight" in wan_sd and "blocks.1.cross_attn.o.bias" in wan_sd
    converted = convert_wan_state_dict(wan_sd, "wan", self_attn="attn", cross_attn="cross")
    fresh = build_model(config, seed=2)
    fresh.load_state_dict(converted)  # strict: every key maps
    for (key, ours), theirs in zip(fresh.state_dict().items(), model.state_dict().values()):
        assert torch.equal(ours, theirs), key  # renamed only: nothing permuted

    g = torch.Generator().manual_seed(0)
    frames = 2
    n = frames * config.tokens_per_frame
    x = torch.randn(1, n, config.dim, generator=g)
    grid = (frames, config.grid_height, config.grid_width)

    def wan_qk(which: str) -> torch.Tensor:  # Wan: norm(linear(x)) in Wan's layout, then complex RoPE
        w, b = wan_sd[f"blocks.0.self_attn.{which}.weight"], wan_sd[f"blocks.0.self_attn.{which}.bias"]
        norm = torch.nn.functional.rms_norm(x @ w.T + b, (config.dim,), wan_sd[f"blocks.0.self_attn.norm_{which}.weight"], config.eps)
        return _wan_rope_reference(norm[0].view(n, heads, head_dim), start_frame, grid)

    positions = torch.arange(start_frame * config.tokens_per_frame, start_frame * config.tokens_per_frame + n)[None]
    q_raw, k_raw, _ = fresh.blocks[0].attn.project(x)
    q = fresh.rope(q_raw, positions)[0].double()
    k = fresh.rope(k_raw, positions)[0].double()
    # The rotated vectors themselves equal Wan's (not only the scores): same pairs, same angles.
    torch.testing.assert_close(q, wan_qk("q"), atol=2e-5, rtol=1e-5)
    expected = torch.einsum("qhd,khd->hqk", wan_qk("q"), wan_qk("k"))
    torch.testing.assert_close(torch.einsum("qhd,khd->hqk", q, k), expected, atol=1e-4, rtol=1e-4)


def test_streaming_example_with_prompt_switch_and_reset(tmp_path: Path) -> None:
    out = tmp_path / "nested" / "stream.png"
    threads = torch.get_num_threads()
    summary = streaming_generation.run(
        ["--chunks", "6", "--steps", "2", "--switch-at", "2", "--reset-at", "5", "--out", str(out), "--no-progress"]
    )
    assert out.read_bytes()[:8] == PNG_MAGIC
    import matplotlib.image

    image = matplotlib.image.imread(out)
    assert image.shape[0] == 64 and image.shape[1] > 6 * 3 * 64  # 18 frames of 8x8 upscaled to 64, plus bars
    config = WanConfig.preset("tiny")
    spec = make_kv_spec(config)
    assert summary["forwards"] == 6 * (2 + 1)
    assert summary["latent_shape"] == (18, config.in_channels, config.latent_height, config.latent_width)
    assert len(summary["events"]) == 2
    # After the reset before chunk 5, one chunk was committed on each branch.
    assert summary["committed_chunks"] == {"cond": 1, "uncond": 1}
    assert summary["token_offset"] == {"cond": config.chunk_size, "uncond": config.chunk_size}
    # Window filled and evicted before the reset: peak = 2 branches x (sink + window + pending) chunks.
    assert summary["peak_pages"] == 2 * spec.pages_per_branch(1) <= summary["num_pages"]
    assert summary["pages_used"] == sum(summary["session_pages"].values())
    assert summary["pages_used_after_close"] == 0
    assert summary["pages_free_after_close"] == summary["num_pages"]
    assert torch.get_num_threads() == threads  # the run's --threads default (1 for tiny) is undone
    # The per-chunk record across the prompt switch (history kept) and the reset (history dropped).
    _check_per_chunk_record(summary, resets=(5,))
    assert summary["events_at"] == [(2, "prompt switch"), (5, "reset")]
    assert (out.parent / "streaming_generation.png").read_bytes()[:8] == PNG_MAGIC


def _resident_chunks(committed: int, sink: int, window: int) -> list[int]:
    """The spec's rule, written out: of ``committed`` chunks (0-based since the stream started), the first
    ``sink`` ones and the last ``window`` of the others stay visible."""
    return [c for c in range(committed) if c < sink or c >= max(sink, committed - window)]


def _check_per_chunk_record(summary: dict, resets: tuple[int, ...] = (), source: str = "to_dense") -> None:
    """The recorded per-chunk data (what the figure draws) against the library's semantics."""
    config = WanConfig.preset("tiny")
    spec = make_kv_spec(config)
    sink, window, ppc = spec.sink_chunks, spec.window_chunks, spec.pages_per_chunk
    geo, rows = summary["geometry"], summary["per_chunk"]
    assert (geo["sink_chunks"], geo["window_chunks"], geo["pages_per_chunk"]) == (sink, window, ppc)
    assert geo["rolling_buffer_tokens_per_branch"] == (sink + window + 1) * spec.chunk_size
    assert len(rows) == summary["chunks"] and summary["warmup_chunks"] == [0]
    start = 0
    for k, row in enumerate(rows):
        if k in resets:
            start = k
        committed = k - start  # chunks committed since the stream (re)started
        resident = _resident_chunks(committed, sink, window)
        assert row["chunk"] == k and row["stream_start_chunk"] == start
        assert row["committed_before"] == {b: committed for b in BRANCHES}
        # Pages while chunk k is denoised: (sink + min(window, committed - sink) + pending) chunks per branch.
        for b in BRANCHES:
            pages = row["pages"][b]
            assert pages["resident"] == len(resident) * ppc, (k, b, pages)
            assert pages["pending"] == ppc, (k, b, pages)
            assert pages["extent_reserved"] == 0  # plain paging on the CPU
            assert pages["referenced"] == pages["resident"] + pages["pending"]  # cache.stats() agrees with history
        assert row["pool_pages_used"] == sum(row["pages"][b]["resident"] + row["pages"][b]["pending"] for b in BRANCHES)
        if committed >= sink + window:  # window full: exactly the rolling buffer's (sink + window + current) chunks
            assert row["pool_pages_used"] * spec.page_size == len(BRANCHES) * geo["rolling_buffer_tokens_per_branch"]
        after = len(_resident_chunks(committed + 1, sink, window)) * ppc  # the commit evicts, pending -> history
        assert row["pages_after_commit"] == {b: after for b in BRANCHES}
        assert row["pool_pages_after_commit"] == len(BRANCHES) * after
        # Visibility, read from the forward's to_dense(): the rule (sinks + window + the pending chunk itself) ...
        expected = [start + c for c in resident] + [k]
        assert row["visibility_source"] == source
        assert row["visible_key_chunks"] == {b: expected for b in BRANCHES}, (k, row["visible_key_chunks"])
        # ... which is also the library's chunk-level picture of the rule (masks.chunk_visibility).
        mask = chunk_visibility(committed, 1, sink, window)[0]
        assert [start + j for j in mask.nonzero().flatten().tolist()] == expected
        assert row["chunk_ms"] > 0
    # The figure's categories follow the record: sinks, window, the query chunk itself, evicted, not yet.
    cats = _report_figure.visibility_categories(summary)
    for k, row in enumerate(rows):
        seen = set(row["visible_key_chunks"]["cond"])
        for j in range(len(rows)):
            want = (
                _report_figure.NOT_YET if j > k
                else _report_figure.PENDING if j == k
                else _report_figure.EVICTED if j not in seen
                else _report_figure.SINK if j < row["stream_start_chunk"] + sink
                else _report_figure.WINDOW
            )
            assert cats[k, j] == want, (k, j)


def _assert_picture(path: Path, colours: tuple[str, ...]) -> None:
    """A real figure: a PNG of README size whose panels are drawn (the visibility colours appear)."""
    import matplotlib.colors
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_MAGIC
    assert path.stat().st_size > 50_000
    image = matplotlib.image.imread(path)[..., :3]
    assert image.shape[0] >= 800 and image.shape[1] >= 1200, image.shape
    assert len(torch.from_numpy(image).reshape(-1, 3).unique(dim=0)) > 1000  # not blank: noise strip, text, bars
    pixels = torch.from_numpy(image).reshape(-1, 3)
    for colour in colours:
        rgb = torch.tensor(matplotlib.colors.to_rgb(colour), dtype=pixels.dtype)
        assert ((pixels - rgb).abs().max(dim=1).values < 2 / 255).sum() > 500, colour


def test_streaming_example_figure_and_per_chunk_data(tmp_path: Path) -> None:
    """The main command's figure and JSON: pages, pool use and visibility per chunk follow the spec's rule."""
    out = tmp_path / "stream.png"
    summary = streaming_generation.run(["--chunks", "8", "--steps", "1", "--out", str(out), "--no-progress"])
    figure, data = tmp_path / "streaming_generation.png", tmp_path / "streaming_generation.json"
    assert summary["figure"] == str(figure) and summary["json"] == str(data)
    _assert_picture(figure, _report_figure.VIS_COLOURS[_report_figure.SINK :])
    recorded = json.loads(data.read_text())
    assert recorded["per_chunk"] == summary["per_chunk"] and recorded["geometry"] == summary["geometry"]
    _check_per_chunk_record(recorded)
    spec = make_kv_spec(WanConfig.preset("tiny"))
    # Eviction happened and shows as a gap: chunk sink + window + 1 is the first to miss one.
    assert _report_figure.first_gap_chunk(recorded) == spec.sink_chunks + spec.window_chunks + 1
    # The pool grows to (sink + window + pending) chunks per branch, then stays flat.
    pool = [row["pool_pages_used"] for row in recorded["per_chunk"]]
    flat = spec.sink_chunks + spec.window_chunks
    assert pool[:flat] == sorted(pool[:flat]) and len(set(pool[flat:])) == 1
    assert pool[-1] == len(BRANCHES) * spec.pages_per_branch(1) == summary["peak_pages"]


def test_streaming_example_large_shapes_read_history_spans(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where to_dense() would be too large (Wan2.1 shapes), visibility comes from the history's spans: same rule."""
    monkeypatch.setattr(streaming_generation.StreamRecorder, "DENSE_LIMIT", 0)
    summary = streaming_generation.run(
        ["--chunks", "6", "--steps", "1", "--out", str(tmp_path / "s.png"), "--no-progress", "--no-plot"]
    )
    _check_per_chunk_record(summary, source="history_spans")


@pytest.mark.parametrize("steps", [1, 2])
def test_streaming_example_last_step_commit(tmp_path: Path, steps: int) -> None:
    """``--commit-forward last_step``: the last denoising forward commits, no clean forward (``steps`` forwards
    per chunk instead of ``steps + 1``). The per-chunk record still follows the spec's rule (the snapshot is
    taken inside the committing forward: with one step, the only one); chunk 0 equals the clean run's (no
    history yet), later chunks differ (their history holds the last denoising forward's K/V)."""
    common = ["--chunks", "6", "--steps", str(steps), "--no-progress", "--no-plot"]
    clean = streaming_generation.run([*common, "--out", str(tmp_path / "clean.png")])
    last = streaming_generation.run([*common, "--commit-forward", "last_step", "--out", str(tmp_path / "last.png")])
    assert (clean["commit_forward"], clean["forwards_per_chunk"], clean["forwards"]) == ("clean", steps + 1, 6 * (steps + 1))
    assert (last["commit_forward"], last["forwards_per_chunk"], last["forwards"]) == ("last_step", steps, 6 * steps)
    _check_per_chunk_record(last)
    assert last["committed_chunks"] == clean["committed_chunks"] == {"cond": 6, "uncond": 6}
    assert last["peak_pages"] == clean["peak_pages"] and last["pages_used_after_close"] == 0
    assert last["chunk_norms"][0] == clean["chunk_norms"][0]
    assert all(a != b for a, b in zip(last["chunk_norms"][1:], clean["chunk_norms"][1:]))


def test_streaming_example_main_exit_status(tmp_path: Path) -> None:
    out = tmp_path / "s.png"
    argv = ["--chunks", "2", "--steps", "1", "--out", str(out), "--no-progress", "--no-plot"]
    assert streaming_generation.main(argv) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert not (tmp_path / "streaming_generation.png").exists()  # --no-plot
    assert len(json.loads((tmp_path / "streaming_generation.json").read_text())["per_chunk"]) == 2
    with pytest.raises(SystemExit):
        streaming_generation.parse_args(["--out", str(out), "--figure", str(out)])  # one file, two outputs
    with pytest.raises(SystemExit):
        streaming_generation.parse_args(["--cuda-graph"])  # needs --device cuda


#: Run before the script: matplotlib, PIL, numpy and tqdm cannot be imported (a bare ``pip install ardiff_modules``).
BLOCK_EXTRAS = """
import importlib.machinery, sys
class _Absent(importlib.machinery.PathFinder):  # the path finder, blind to these names: as if not installed
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in ("matplotlib", "PIL", "numpy", "tqdm"):
            return None
        return super().find_spec(name, path, target)
sys.meta_path[:] = [_Absent if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
"""


def test_streaming_example_no_plot_runs_alone_without_matplotlib_pil_numpy(tmp_path: Path) -> None:
    """The script copied on its own (no ``_report_figure.py`` beside it, as beside a wheel install) runs with
    ``--no-plot`` where matplotlib, PIL and numpy are absent, and still writes the strip PNG and the JSON."""
    import shutil
    import subprocess

    shutil.copy(EXAMPLES / "streaming_generation.py", tmp_path)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCK_EXTRAS)
    argv = ["--chunks", "2", "--steps", "1", "--out", str(tmp_path / "out" / "s.png"), "--no-plot"]
    path = os.pathsep.join(map(str, (tmp_path / "site", REPO_ROOT)))  # this tree's library, not the examples/
    done = subprocess.run(
        [sys.executable, str(tmp_path / "streaming_generation.py"), *argv], capture_output=True, text=True,
        timeout=300, env={**os.environ, "PYTHONPATH": path}, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "out" / "s.png").read_bytes()[:8] == PNG_MAGIC
    assert len(json.loads((tmp_path / "out" / "streaming_generation.json").read_text())["per_chunk"]) == 2


def test_streaming_example_figure_needs_are_checked_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without ``--no-plot``, a missing ``_report_figure.py`` or matplotlib exits 2 at once, naming the fix."""
    argv = ["--out", str(tmp_path / "s.png")]
    monkeypatch.setattr(streaming_generation, "HERE", tmp_path)  # a folder without _report_figure.py
    with pytest.raises(SystemExit) as exc:
        streaming_generation.parse_args(argv)
    assert exc.value.code == 2 and "expected _report_figure.py beside this script" in capsys.readouterr().err
    monkeypatch.undo()
    real = streaming_generation.importlib.util.find_spec
    monkeypatch.setattr(streaming_generation.importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(SystemExit) as exc:
        streaming_generation.parse_args(argv)
    assert exc.value.code == 2 and "expected matplotlib installed" in capsys.readouterr().err
    assert streaming_generation.parse_args([*argv, "--no-plot"]).no_plot  # --no-plot needs neither


def test_strip_png_written_without_matplotlib_reads_back_exactly(tmp_path: Path) -> None:
    """``write_png`` (standard library only) stores every pixel of the strip, rounded to 8 bits."""
    import matplotlib.image

    image = torch.rand(5, 7, 3, generator=torch.Generator().manual_seed(0))
    image[0, 0] = torch.tensor([0.0, 1.0, 0.5])
    streaming_generation.write_png(image, tmp_path / "x.png")
    back = torch.from_numpy(matplotlib.image.imread(tmp_path / "x.png"))
    assert back.shape == (5, 7, 3)
    torch.testing.assert_close(back, (image * 255).round() / 255, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_compiled_example_never_recompiles(tmp_path: Path, capsys: pytest.CaptureFixture[str], fresh_dynamo: None) -> None:
    """The torch.compile'd script (inductor, fullgraph) compiles ONE frame over eviction, a prompt switch and a reset."""
    out = tmp_path / "c.png"
    status = compiled_generation.main(
        ["--chunks", "6", "--steps", "2", "--switch-at", "3", "--reset-at", "5", "--out", str(out), "--no-progress"]
    )
    printed = capsys.readouterr().out
    assert "compiled frames 1 (recompiles: 0)" in printed, printed
    assert status == 0
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_streaming_example_recache_on_switch_and_flat_long_run(tmp_path: Path) -> None:
    """--recache-on-switch rebuilds the window under the new prompt (the frames after the switch change,
    those before do not); --report-every prints flat pages in use."""
    common = ["--chunks", "9", "--steps", "1", "--switch-at", "5", "--no-progress", "--no-plot"]
    plain = streaming_generation.run([*common, "--out", str(tmp_path / "a.png")])
    rebuilt = streaming_generation.run(
        [*common, "--recache-on-switch", "--report-every", "3", "--out", str(tmp_path / "b.png")]
    )
    assert any("re-cached" in e for e in rebuilt["events"])
    # Identical until the switch; the re-cached window changes every chunk after it.
    assert plain["chunk_norms"][:5] == rebuilt["chunk_norms"][:5]
    assert all(x != y for x, y in zip(plain["chunk_norms"][5:], rebuilt["chunk_norms"][5:]))
    assert [r["pages_used"] for r in rebuilt["reports"]] == [18, 18, 18]  # flat once the window is full
    assert rebuilt["pages_used_after_close"] == 0

