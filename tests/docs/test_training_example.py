"""The training example (issue 27, item 6): a Self-Forcing-style rollout, backward and AdamW step per
training step through the paged cache (CPU, tiny preset).

The JSON it writes is checked against the semantics written out here: the pages a step peaks at and the
references its scope holds follow from sink + window and which chunks run with gradients; after every
step the session is back at sink + window; gradients reach every parameter except the cached prompt's
projections; checkpointing every block changes nothing but the work (the same losses and gradient
norms, each gradient chunk's blocks run twice).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ardiff_modules.models.wan_causal_dit import WanCausalBlock, WanConfig, make_kv_spec
from tests.support.paths import EXAMPLES

sys.path.insert(0, str(EXAMPLES))

import training_rollout  # noqa: E402

SMALL = ["--train-steps", "2", "--chunks", "6", "--steps", "2"]


def _train(tmp_path: Path, name: str, *flags: str) -> dict:
    """Run the example's ``main`` and return the JSON it wrote (the exit status must be 0)."""
    path = tmp_path / f"{name}.json"
    assert training_rollout.main([*SMALL, *flags, "--json", str(path)]) == 0
    return json.loads(path.read_text())


def _expected_pages(chunks: int, grad_chunks: int, sink: int, window: int) -> tuple[int, int]:
    """``(peak chunks, held chunk references)`` of one step, from the rule: chunk ``c``'s forwards see the
    first ``sink`` committed chunks and the last ``window`` others; a forward with gradients (the last
    ``grad_chunks`` chunks) holds what it saw until the step ends; the pool holds the union of the
    history, the pending chunk and the holds."""
    held: set[int] = set()
    refs = peak = 0
    for c in range(chunks):
        history = {j for j in range(c) if j < sink or j >= max(sink, c - window)}
        if c >= chunks - grad_chunks:
            held |= history
            refs += len(history)
        peak = max(peak, len(history | held | {c}))
    return peak, refs


def _no_grad_names(num_layers: int) -> list[str]:
    """What no gradient reaches: the text embedding and each block's prompt K/V projections (cached once)."""
    names = [f"text_embedding.{i}.{w}" for i in (0, 2) for w in ("weight", "bias")]
    for b in range(num_layers):
        names += [f"blocks.{b}.cross.{w}" for w in ("norm_k.weight", "k.weight", "k.bias", "v.weight", "v.bias")]
    return names


def _check_steps(summary: dict, grad_chunks: int) -> None:
    config = WanConfig.preset("tiny")
    spec = make_kv_spec(config, branches=("cond",))
    ppc, sink, window = spec.pages_per_chunk, spec.sink_chunks, spec.window_chunks
    chunks = summary["chunks"]
    assert chunks > sink + window + 1  # the window slid: chunks were evicted while held
    peak, refs = _expected_pages(chunks, grad_chunks, sink, window)
    assert summary["resident_pages"] == (sink + window) * ppc
    assert len(summary["per_step"]) == summary["train_steps"]
    for row in summary["per_step"]:
        assert row["loss"] == row["loss"] and 0 < row["loss"] < float("inf")
        assert 0 < row["grad_norm"] < float("inf") and row["update_norm"] > 0
        assert sorted(row["params_without_grad"]) == sorted(_no_grad_names(config.num_layers))
        assert row["peak_pages"] == peak * ppc, (row, peak)
        assert row["held_pages"] == refs * ppc
        assert row["pages_after_step"] == (sink + window) * ppc
        assert len(row["exit_steps"]) == chunks and all(0 <= e < summary["steps"] for e in row["exit_steps"])
    assert summary["pages_used_after_close"] == 0


def _count_block_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    forward = WanCausalBlock.forward

    def counted(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls[0] += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(WanCausalBlock, "forward", counted)
    return calls


def test_training_example_with_and_without_checkpointing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_block_calls(monkeypatch)
    plain = _train(tmp_path, "plain")
    plain_calls, calls[0] = calls[0], 0
    checkpointed = _train(tmp_path, "checkpointed", "--checkpoint")
    for summary in (plain, checkpointed):
        _check_steps(summary, grad_chunks=summary["chunks"])
    # Recomputation reads what the forward read: the same losses and gradients, to rounding.
    for a, b in zip(plain["per_step"], checkpointed["per_step"], strict=True):
        assert a["exit_steps"] == b["exit_steps"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    # ... and it happened: every gradient chunk's blocks ran once more, in the backward.
    layers = WanConfig.preset("tiny").num_layers
    assert calls[0] - plain_calls == plain["train_steps"] * plain["grad_chunks"] * layers


def test_training_example_gradients_through_the_last_chunks_only(tmp_path: Path) -> None:
    full = _train(tmp_path, "full")
    last = _train(tmp_path, "last", "--grad-chunks", "2")
    _check_steps(last, grad_chunks=2)
    # The first step's rollout is the same (only where gradients flow differs), its gradients are not.
    assert last["per_step"][0]["loss"] == full["per_step"][0]["loss"]
    assert last["per_step"][0]["grad_norm"] != pytest.approx(full["per_step"][0]["grad_norm"], rel=1e-3)
    assert last["per_step"][0]["peak_pages"] < full["per_step"][0]["peak_pages"]


def test_training_example_refuses_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    for flags, message in (
        (["--grad-chunks", "7"], "--grad-chunks: expected 0..6"),
        (["--compile", "--checkpoint"], "--checkpoint with --compile"),
        (["--context-noise", "1000"], "--context-noise: expected a timestep in [0, 1000)"),
    ):
        with pytest.raises(SystemExit):
            training_rollout.parse_args([*SMALL, *flags])
        assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_training_example_is_two_frames_and_equals_eager(tmp_path: Path) -> None:
    """fullgraph=True over forward and backward (aot_eager: dynamo + AOT autograd, no inductor codegen):
    one graph without gradients, one with, for every step; the same losses and gradients as eager."""
    eager = _train(tmp_path, "eager")
    compiled = _train(tmp_path, "compiled", "--compile", "--compile-backend", "aot_eager")
    assert compiled["compiled_frames"] == training_rollout.COMPILED_FRAMES == 2
    _check_steps(compiled, grad_chunks=compiled["chunks"])
    for a, b in zip(eager["per_step"], compiled["per_step"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_training_example_bf16_compute_updates_float32_masters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's precision on the CPU: with bf16 as the default dtype (model and KV pool, as on CUDA) AdamW
    updates float32 masters and the model holds their bf16 rounding; the masters keep what bf16 loses."""
    import torch

    import ardiff_modules.models.wan_causal_dit as wan

    monkeypatch.setattr(wan, "default_dtype", lambda device: torch.bfloat16)
    args = training_rollout.parse_args([*SMALL, "--json", str(tmp_path / "bf16.json")])
    trainer, _ = training_rollout.build_trainer(args)
    assert trainer.cache.spec.dtype == "bfloat16" and trainer.model.patch_embedding.weight.dtype == torch.bfloat16
    before = [p.detach().clone() for p in trainer.optimizer.params]
    row = trainer.train_step(0)
    assert torch.isfinite(torch.tensor(row["loss"])) and row["grad_norm"] > 0
    optimizer = trainer.optimizer
    assert all(m.dtype == torch.float32 and m is not p for p, m in zip(optimizer.params, optimizer.masters))
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(optimizer.params, optimizer.masters))
    # Updates below bf16's resolution: the masters moved where the bf16 weights could not.
    moved = sum(int(((m - b.float()) != 0).sum()) for b, m in zip(before, optimizer.masters))
    visible = sum(int((p != b).sum()) for b, p in zip(before, optimizer.params))
    assert moved > visible > 0
    trainer.state.close()
