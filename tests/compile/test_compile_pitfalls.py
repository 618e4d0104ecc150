"""``am.CompiledStep``: the compile pitfalls a user trips on, raised as the library's errors (issue 26, item 6).

Each pitfall has a model that commits it: ``int()`` / ``.item()`` of ``kv.positions`` / ``fwd.key_positions()``
inside the compiled model, a Python-float timestep, ``prepare_forward`` inside the compiled model, an input
that recompiles; and a clean model runs without a warning and equals eager. Dynamo-only runs use
``backend="eager"`` (tracing is what the pitfalls are about); the clean rollout runs inductor.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import ardiff_modules as am
from tests.support.streaming_model import LibraryStreaming, TinyStreamingModel, play, rollout_events, tiny_model_and_spec

CHUNK = 4


class Pitfall(nn.Module):
    """The tiny streaming model behind a ``forward(x, t, layers)`` that commits one pitfall (``how``)."""

    def __init__(self, model: TinyStreamingModel, how: str) -> None:
        super().__init__()
        self.model, self.how, self.chunk_index = model, how, 0

    def forward(self, x: torch.Tensor, t: torch.Tensor, layers: list[am.LayerContext]) -> torch.Tensor:
        kv = layers[0]
        if self.how == "int_positions":
            x = x + int(kv.positions[0, 0]) / 1000        # a Python int taken from positions
        elif self.how == "branch_on_positions":
            if int(kv.positions[0, 0]) == 0:               # "is this the first chunk?" in Python
                x = x + 1
        elif self.how == "item_key_positions":
            x = x + kv.forward.key_positions().max().item() / 1000
        elif self.how == "python_counter":
            x = x + self.chunk_index / 1000                # a Python number the graph specialises on
        elif self.how == "unknown_cache":
            kv.cross_kv("image")                           # a library check fails while dynamo traces it
        return self.model(x * t, layers)


def runner_and_model(how: str = "clean") -> tuple[LibraryStreaming, Pitfall]:
    model, spec = tiny_model_and_spec()
    runner = LibraryStreaming(model, spec, 64)
    runner.set_prompt({b: torch.randn(5, model.context_dim) for b in spec.branches})
    return runner, Pitfall(model, how)


def forward(runner: LibraryStreaming, step: am.CompiledStep, t: object, chunks: int = 1,
            commit: bool = True, key_positions: bool = False) -> torch.Tensor:
    """One forward of both branches through ``step``; ``key_positions``: build them before the call."""
    with torch.no_grad(), runner.state.prepare_forward(("cond", "uncond"), chunks * CHUNK, commit_current=commit) as fwd:
        if key_positions:
            fwd.key_positions()
        return step(torch.randn(2, chunks * CHUNK, 32), t, fwd.layers)


# ------------------------------------------------------------------ Python numbers: refused before the call
def test_python_float_timestep_is_refused_before_compiling() -> None:
    runner, model = runner_and_model()
    step = am.CompiledStep(model, backend="eager")
    with pytest.raises(am.CompileInputError, match=r"argument `t` is a Python float \(0\.75\).*recompiles\. Pass "
                                                   r"torch\.tensor\(t\) instead") as info:
        forward(runner, step, 0.75)
    assert isinstance(info.value, TypeError) and isinstance(info.value, am.ARDiffError)
    assert step.frame_count == 0 and step.calls == 0
    assert runner.state.committed_chunks("cond") == 0  # the forward the error left was aborted, nothing committed


def test_python_numbers_anywhere_in_the_arguments_and_constants() -> None:
    step = am.CompiledStep(lambda x, options, flag: x * options["scale"][0], backend="eager")
    with pytest.raises(am.CompileInputError, match=r"argument `options\['scale'\]\[0\]` is a Python int \(2\)"):
        step(torch.ones(2), {"scale": [2]}, True)
    assert step.frame_count == 0
    constant = am.CompiledStep(lambda x, options, flag: x * options["scale"][0], backend="eager",
                               constants=("options",))
    torch.testing.assert_close(constant(torch.ones(2), {"scale": [2]}, True), torch.full((2,), 2.0))  # bools pass


def test_backend_arguments_are_checked() -> None:
    with pytest.raises(am.SpecError, match="mode / options go with a backend name"):
        am.CompiledStep(nn.Identity(), backend=lambda gm, inputs: gm, mode="max-autotune")
    with pytest.raises(am.SpecError, match=r"CompiledStep\.backend: expected a callable or one of .*got 'nope'"):
        am.CompiledStep(nn.Identity(), backend="nope")
    with pytest.raises(am.SpecError, match=r"CompiledStep\.mode: expected None or one of .*got 'fast'"):
        am.CompiledStep(nn.Identity(), mode="fast")
    with pytest.raises(am.SpecError, match=r"CompiledStep\.model: expected a module or a callable, got int"):
        am.CompiledStep(3)  # type: ignore[arg-type]


# ------------------------------------------------------------------ library tensors made Python numbers
@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize(("how", "name", "code"), [
    ("int_positions", "kv.positions", "int(kv.positions[0, 0])"),          # dynamo takes it; the graph shows it
    ("branch_on_positions", "kv.positions", "if int(kv.positions[0, 0]) == 0:"),  # dynamo refuses the guard
    ("item_key_positions", "fwd.key_positions()", "kv.forward.key_positions().max().item()"),
])
def test_a_library_tensor_made_a_python_number_is_refused_naming_it(how: str, name: str, code: str) -> None:
    runner, model = runner_and_model(how)
    step = am.CompiledStep(model, backend="eager")
    with pytest.raises(am.CompileInputError) as info:
        forward(runner, step, torch.tensor(0.5), key_positions=True)
    message = str(info.value)
    assert f"turns {name} (a library tensor) into a Python number" in message, message
    assert "test_compile_pitfalls.py:" in message and code in message, message  # where, in the user's code
    assert "Keep it a tensor" in message and "fwd.token_offsets" in message
    assert isinstance(info.value.__cause__, torch._dynamo.exc.TorchDynamoException)  # dynamo's error, chained
    assert runner.state.committed_chunks("cond") == 0


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_prepare_forward_inside_the_compiled_model_is_refused() -> None:
    runner, _ = runner_and_model()
    model = runner.model

    class Inside(nn.Module):
        def forward(self, x: torch.Tensor, state: am.KVState) -> torch.Tensor:
            with state.prepare_forward(("cond", "uncond"), CHUNK, commit_current=True) as fwd:
                return model(x, fwd.layers)

    step = am.CompiledStep(Inside(), backend="eager")
    with pytest.raises(am.CompileInputError, match=r"prepare_forward\(\) ran inside the compiled model \(from "
                                                   r"test_compile_pitfalls\.py:\d+\).*pass fwd\.layers in") as info:
        with torch.no_grad():
            step(torch.randn(2, CHUNK, 32), runner.state)
    assert isinstance(info.value.__cause__, torch._dynamo.exc.Unsupported)
    # Nothing ran for real: the session takes its next forward normally.
    assert runner.state.committed_chunks("cond") == 0
    runner.forward(("cond", "uncond"), torch.randn(2, CHUNK, 32), True)
    assert runner.state.committed_chunks("cond") == 1


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_key_positions_first_built_inside_the_compiled_model_is_refused() -> None:
    """``fwd.key_positions()`` is built on the host on first use (a cached property, under a lock)."""
    runner, model = runner_and_model("item_key_positions")
    step = am.CompiledStep(model, backend="eager")
    with pytest.raises(am.CompileInputError, match=r"key_positions\(\) ran inside the compiled model \(from "
                                                   r"test_compile_pitfalls\.py:\d+\).*pass its tensor in") as info:
        forward(runner, step, torch.tensor(0.5))
    assert isinstance(info.value.__cause__, torch._dynamo.exc.Unsupported)


# ------------------------------------------------------------------ recompiles warn once, with the cause
def _recompile_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, am.CompileInputWarning)]


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_a_recompiling_python_value_warns_once_naming_the_likely_cause() -> None:
    runner, model = runner_and_model("python_counter")
    step = am.CompiledStep(model, backend="eager")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for chunk in range(4):
            model.chunk_index = chunk  # a Python counter per chunk: the pitfall
            forward(runner, step, torch.tensor(0.5))
    assert step.frame_count >= 2 and step.recompiles == step.frame_count - 1
    (message,) = _recompile_warnings(record)  # once, however many recompiles
    assert "the model compiled again at call 2" in message
    assert "no argument changed shape, dtype or device" in message and "a Python int / float read inside" in message


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_a_new_shape_warns_naming_the_argument() -> None:
    runner, model = runner_and_model()
    step = am.CompiledStep(model, backend="eager")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        forward(runner, step, torch.tensor(0.5))
        forward(runner, step, torch.tensor(0.5), chunks=2)
        forward(runner, step, torch.tensor(0.5), chunks=3)  # another recompile: no second warning
    (message,) = _recompile_warnings(record)
    assert "`x` changed from a float32 tensor of shape (2, 4, 32) on cpu to a float32 tensor of shape (2, 8, 32)" \
        in message, message
    assert "positions of shape (2, 8)" in message and "one new graph per shape" in message


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_a_grad_mode_change_is_a_second_frame_not_a_recompile() -> None:
    """A training step compiles a graph per grad mode without a warning; a new shape after that warns."""
    step = am.CompiledStep(nn.Linear(4, 4), backend="eager")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with torch.no_grad():
            step(torch.ones(1, 4))
        step(torch.ones(1, 4))
        assert _recompile_warnings(record) == [] and step.frame_count == 2
        step(torch.ones(3, 4))
    (message,) = _recompile_warnings(record)
    assert "argument 0" in message or "input" in message


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_grad_mode_on_trains_through_the_step() -> None:
    """Forwards with gradients compile too (issue 27): the output carries autograd back to the parameters."""
    runner, model = runner_and_model()
    step = am.CompiledStep(model, backend="eager")
    with runner.state.prepare_forward(("cond", "uncond"), CHUNK, commit_current=True) as fwd:
        out = step(torch.randn(2, CHUNK, 32), torch.tensor(0.5), fwd.layers)
    assert out.requires_grad
    out.square().mean().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_a_library_error_raised_while_tracing_is_raised_as_itself() -> None:
    runner, model = runner_and_model("unknown_cache")
    step = am.CompiledStep(model, backend="eager")
    with pytest.raises(am.errors.UnknownCacheError, match=r"Unknown cross-attention cache 'image'; expected one of "
                                                   r"\('text',\)") as info:
        forward(runner, step, torch.tensor(0.5))
    assert isinstance(info.value.__cause__, torch._dynamo.exc.TorchDynamoException)


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_a_clean_model_runs_a_rollout_as_one_frame_without_warning_and_equals_eager() -> None:
    model, spec = tiny_model_and_spec()
    events = rollout_events(10, CHUNK, model.dim, model.context_dim, fixed_shape=True)
    dynamo, inductor = torch._dynamo.config.get_config_copy(), torch._inductor.config.get_config_copy()
    step = am.CompiledStep(model)  # inductor
    eager = play(LibraryStreaming(model, spec, 64), events)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        actual = play(LibraryStreaming(model, spec, 64, fn=step), events)
    assert _recompile_warnings(record) == []
    assert step.frame_count == 1 and step.calls == len(actual)
    for i, (a, e) in enumerate(zip(actual, eager)):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4, msg=lambda m, i=i: f"forward {i}: {m}")
    # The wrapper brought its own backend: no global compiler setting was changed.
    assert torch._dynamo.config.get_config_copy() == dynamo
    assert torch._inductor.config.get_config_copy() == inductor
