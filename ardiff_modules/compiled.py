"""``CompiledStep``: ``torch.compile(model, fullgraph=True)`` that reports a streaming model's compile pitfalls
as this library's errors, next to their cause (docs/guide/porting.md, "3. Compile-friendly inputs").

The pitfalls, which dynamo reports (when it does at all) far from where they come from:

* **a Python number argument** -- a timestep as a float, a chunk counter as an int: dynamo bakes it into
  the graph as a constant, so each new value recompiles. Refused before the call
  (:class:`~ardiff_modules.errors.CompileInputError` naming the argument; ``constants=`` names the ones
  that never change);
* **a library tensor made a Python number inside the model** -- ``int(kv.positions[0, 0])``,
  ``fwd.key_positions().tolist()``: a device sync every forward, a graph break where dynamo cannot capture
  it, a data-dependent guard where the number steers Python (an ``if``, a shape), and a Python int taken
  from positions changes every chunk. Refused when the graph is built (this wrapper's backend reads the
  graph dynamo captured) or when dynamo refuses it (its error is chained);
* **host-side bookkeeping traced into the model** -- ``prepare_forward`` & co. inside the compiled region.

It also counts the graphs it compiled: a recompile after the first frame warns once
(:class:`~ardiff_modules.errors.CompileInputWarning`) with the likely cause, read from what changed between
the calls' inputs. No global compiler setting is read or changed: the wrapper hands ``torch.compile`` its
own backend, which counts and inspects each graph, then passes it to inductor (or the named backend).
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import sysconfig
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ardiff_modules import errors
from ardiff_modules.checks import require_bool
from ardiff_modules.context import ForwardContext, LayerContext
from ardiff_modules.errors import ARDiffError, CompileInputError, CompileInputWarning, SpecError

PACKAGE_DIR = Path(__file__).resolve().parent
#: The library's host-side calls (they allocate, plan, commit, or build host tensors on first use), each with
#: how to keep it out of the compiled model.
_PASS_LAYERS = (
    "once per forward, and pass fwd.layers in: `with state.prepare_forward(...) as fwd: step(x, t, fwd.layers)`"
)
_PASS_RESULT = "and pass its tensor in as an argument (it is built on the host on first use, under a lock)"
HOST_CALLS: dict[str, str] = {
    **dict.fromkeys((
        "prepare_forward", "get_kv_caches", "prepare_paged_context", "prepare_recache", "commit_paged_context",
        "commit", "abort", "populate_cross_attention", "clear_cross_attention", "reset", "recache_latents",
        "open_session", "close", "fork",
    ), _PASS_LAYERS),
    "key_positions": _PASS_RESULT,
    "to_dense": _PASS_RESULT,
}
#: Graph targets (FX ``call_method`` / ``call_function`` names) that turn a tensor into a Python number.
SCALAR_CONVERSIONS = frozenset({"item", "tolist", "_local_scalar_dense", "__int__", "__float__", "__index__"})
INDUCTOR_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_NESTING = 3  # how deep arguments are searched (a tuple of dicts of tensors, not whole object graphs)

FIX_CONVERSION = (
    "Keep it a tensor: compute with kv.positions / fwd.key_positions() as tensors (slice, add, compare; e.g. "
    "kv.positions[:, :1] instead of int(kv.positions[0, 0])), or take host-side numbers outside the compiled "
    "model (fwd.token_offsets, fwd.sink_shifts) and pass them in as tensors"
)
NOTHING_CHANGED = (
    "no argument changed shape, dtype or device since the previous call, so a value the graph specialised on "
    "changed: a Python int / float read inside the model (a counter or attribute updated per chunk, int() or "
    "float() of a tensor, len() of a growing list), a module reassigned, or torch._dynamo.reset()"
)


class CompiledStep:
    """``torch.compile(model, fullgraph=True)`` whose compile pitfalls raise this library's errors.

    Example::

        step = am.CompiledStep(model)                     # model(x, t, layers)
        for t in torch.linspace(1, 0, 5)[:-1]:            # 0-d tensors: no recompile per step
            with state.prepare_forward(("cond", "uncond"), seq_len, commit_current=False) as fwd:
                out = step(x, t, fwd.layers)              # prepare_forward outside the compiled model

    Parameters
    ----------
    model:
        The module or function to compile (called as ``model(*args, **kwargs)``).
    backend, mode, options, dynamic:
        As :func:`torch.compile` (``fullgraph`` is always ``True``). ``mode`` / ``options`` go with a backend
        name; a callable backend takes neither.
    constants:
        Argument names allowed to be Python numbers: values that never change over the rollout. Any other
        Python ``int`` / ``float`` argument (nested in lists, tuples or dicts too) raises
        :class:`CompileInputError` before the call.
    warn_recompiles:
        Warn (once, :class:`CompileInputWarning`) when the model compiles again after its first frame.

    Notes
    -----
    Calls raise :class:`CompileInputError` (chained from dynamo's error where there is one) for the
    pitfalls in the module docstring. Grad mode is part of the graph: a training step (forwards with and
    without gradients) is two frames, neither a recompile to warn about. A library error raised by library code while dynamo traced it (a shape check, say) is
    raised as itself, chained from dynamo's report of it; any other error passes through unchanged.
    """

    def __init__(
        self,
        model: Callable[..., Any],
        *,
        backend: str | Callable[..., Any] = "inductor",
        mode: str | None = None,
        options: dict[str, Any] | None = None,
        dynamic: bool | None = None,
        constants: Collection[str] = (),
        warn_recompiles: bool = True,
    ) -> None:
        owner = "CompiledStep"
        if not callable(model):
            raise SpecError(f"{owner}.model: expected a module or a callable, got {type(model).__name__}")
        if isinstance(constants, str) or not all(isinstance(c, str) for c in constants):
            raise SpecError(f"{owner}.constants: expected a collection of argument names, got {constants!r}")
        if dynamic is not None:
            require_bool(f"{owner}.dynamic", dynamic)
        self.model = model
        self.constants = frozenset(constants)
        self.warn_recompiles = require_bool(f"{owner}.warn_recompiles", warn_recompiles)
        self.name = f"CompiledStep({type(model).__name__ if isinstance(model, nn.Module) else _name(model)})"
        self._backend = _InspectingBackend(self.name, resolve_backend(owner, backend, mode, options, dynamic))
        #: The compiled callable (``torch.compile``'s result), for inspection; call the step instead.
        self.compiled = torch.compile(model, fullgraph=True, dynamic=dynamic, backend=self._backend)
        self._signature = _signature(model)
        self._previous: dict[str, object] | None = None
        self._warned = False
        #: Grad modes a graph was compiled for (a training step compiles one per mode: expected).
        self._grad_modes: set[bool] = set()
        #: Calls that returned.
        self.calls = 0

    @property
    def frame_count(self) -> int:
        """Graphs this step compiled so far (1 for a model that never recompiles)."""
        return self._backend.frames

    @property
    def recompiles(self) -> int:
        """Graphs compiled after the first one."""
        return max(0, self._backend.frames - 1)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Check the inputs, run the compiled model, and report a recompile; returns the model's output."""
        named = self._bind(args, kwargs)
        for path, value in python_numbers(named, self.constants):
            raise CompileInputError(number_message(self.name, path, value))
        fingerprint = fingerprint_inputs(self.model, named)
        before = self._backend.frames
        self._backend.library = library_tensors(named)
        try:
            out = self.compiled(*args, **kwargs)
        except Exception as error:
            mapped = translate_error(self.name, error, lambda: self._cause(fingerprint))
            if mapped is None:
                raise
            raise mapped from error
        finally:
            self._backend.library = {}
        grad_mode = torch.is_grad_enabled()
        recompiled = self._backend.frames > before and grad_mode in self._grad_modes
        if self._backend.frames > before:
            self._grad_modes.add(grad_mode)
        if recompiled and self.warn_recompiles and not self._warned:
            self._warned = True
            warnings.warn(
                f"{self.name}: the model compiled again at call {self.calls + 1} ({self._backend.frames} graphs so "
                f"far); likely cause: {self._cause(fingerprint)}", CompileInputWarning, stacklevel=2,
            )
        self.calls += 1
        self._previous = fingerprint
        return out

    def _cause(self, fingerprint: dict[str, object]) -> str:
        if self._previous is None:
            return "a new compile on the first call (torch._dynamo.reset() or another step of the same code)"
        return explain_changes(self._previous, fingerprint)

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's arguments by name (``*args`` as ``name[i]``); positions where the signature is unknown."""
        if self._signature is not None:
            try:
                bound = self._signature.bind(*args, **kwargs)
            except TypeError:
                pass  # the compiled call raises its own error for a wrong call
            else:
                named: dict[str, Any] = {}
                for name, value in bound.arguments.items():
                    kind = self._signature.parameters[name].kind
                    if kind is inspect.Parameter.VAR_POSITIONAL:
                        named.update((f"{name}[{i}]", v) for i, v in enumerate(value))
                    elif kind is inspect.Parameter.VAR_KEYWORD:
                        named.update(value)
                    else:
                        named[name] = value
                return named
        return {**{f"argument {i}": a for i, a in enumerate(args)}, **kwargs}

    def __repr__(self) -> str:
        return f"{self.name}(frames={self.frame_count}, calls={self.calls})"


# ------------------------------------------------------------------ the backend: counts and inspects
@dataclass
class _Found:
    label: str
    where: str


class _InspectingBackend:
    """A ``torch.compile`` backend: counts the graphs, refuses one that turns a library tensor into a number,
    then hands the graph to the real backend."""

    def __init__(self, owner: str, inner: Callable[..., Any]) -> None:
        self.owner = owner
        self.inner = inner
        self.frames = 0
        #: ``id(tensor)`` -> its name, for the library tensors of the call being compiled.
        self.library: dict[int, str] = {}

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.frames += 1
        found = find_library_conversion(gm, example_inputs, self.library)
        if found is not None:
            raise CompileInputError(conversion_message(self.owner, f"{found.label} (a library tensor)", found.where))
        return self.inner(gm, example_inputs)


def resolve_backend(
    owner: str, backend: object, mode: str | None, options: dict[str, Any] | None, dynamic: bool | None
) -> Callable[..., Any]:
    """What the inspecting backend hands graphs to: ``torch.compile``'s own meaning of ``backend`` / ``mode`` /
    ``options`` (inductor through its public ``torch._inductor.compile`` and ``list_mode_options``)."""
    if callable(backend):
        if mode is not None or options:
            raise SpecError(f"{owner}: mode / options go with a backend name, got a callable backend and "
                            f"mode={mode!r}, options={options!r}")
        return backend
    names = torch.compiler.list_backends(exclude_tags=())
    if not isinstance(backend, str) or backend not in names:
        raise SpecError(f"{owner}.backend: expected a callable or one of {names}, got {backend!r}")
    if options is not None and not isinstance(options, dict):
        raise SpecError(f"{owner}.options: expected None or a dict, got {type(options).__name__}")
    if backend == "inductor":
        if mode is not None and mode not in INDUCTOR_MODES:
            raise SpecError(f"{owner}.mode: expected None or one of {INDUCTOR_MODES}, got {mode!r}")
        import torch._inductor as inductor  # the public entry points of the inductor (torch.compile's docs)

        config = dict(inductor.list_mode_options(mode, dynamic)) if mode not in (None, "default") else {}
        config.update(options or {})
        return functools.partial(inductor.compile, options=config or None)
    kwargs: dict[str, Any] = {"mode": mode} if mode not in (None, "default") else {}
    if options:
        kwargs["options"] = options
    return functools.partial(torch._dynamo.lookup_backend(backend), **kwargs)


def find_library_conversion(
    gm: torch.fx.GraphModule, example_inputs: list[Any], library: Mapping[int, str]
) -> _Found | None:
    """The first node that turns a value computed from a library tensor into a Python number, if any."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    labels: dict[torch.fx.Node, str] = {}
    for node, value in zip(placeholders, example_inputs):
        label = library.get(id(value)) if isinstance(value, torch.Tensor) else None
        # Else its name: dynamo names a graph input after its source, e.g. L['layers'][0].forward.positions ->
        # l_layers_0_forward_positions (a user's own tensor called "positions" is not the library's).
        from_context = "forward_" in node.name or "layout_" in node.name
        if label is None and from_context and names_in_text(node.name):
            label = names_in_text(node.name)[0]
        if label is not None:
            labels[node] = label
    for node in gm.graph.nodes:
        target = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        if node.op in ("call_method", "call_function") and str(target).split(".")[-1] in SCALAR_CONVERSIONS:
            source = _library_source(node, labels)
            if source is not None:
                return _Found(source, _where(node.meta.get("stack_trace")))
    return None


def _library_source(node: torch.fx.Node, labels: Mapping[torch.fx.Node, str]) -> str | None:
    seen, todo = set(), [node]
    while todo:
        current = todo.pop()
        if current in labels:
            return labels[current]
        for parent in current.all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return None


def _where(stack_trace: object) -> str:
    """`` at file:line: `code` `` from an FX node's ``stack_trace``: its innermost frame in the user's code (not
    in this package, torch or the standard library), else its innermost frame; ``""`` without one."""
    if not isinstance(stack_trace, str):
        return ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)', stack_trace)
    if not frames:
        return ""
    user = [f for f in frames if not _is_library_file(f[0])]
    path, line, code = (user or frames)[-1]
    return f" at {Path(path).name}:{line}: `{code.strip()}`"


def _is_library_file(filename: str) -> bool:
    """Whether a frame's file is this package's, torch's or the standard library's (not the user's code)."""
    path = Path(filename).resolve()
    roots = (PACKAGE_DIR, Path(torch.__file__).resolve().parent, Path(sysconfig.get_paths()["stdlib"]).resolve())
    return any(path.is_relative_to(root) for root in roots)


# ------------------------------------------------------------------ inputs
def python_numbers(named: Mapping[str, Any], constants: Collection[str]) -> Iterator[tuple[str, object]]:
    """``(path, value)`` of every Python int / float among the arguments (bools and ``constants`` excepted)."""
    for name, value in named.items():
        if name not in constants:
            yield from _numbers(name, value, 0)


def _numbers(path: str, value: object, depth: int) -> Iterator[tuple[str, object]]:
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, (int, float)):
        yield path, value
    elif depth < _NESTING and isinstance(value, Mapping):
        for key, item in value.items():
            yield from _numbers(f"{path}[{key!r}]", item, depth + 1)
    elif depth < _NESTING and isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _numbers(f"{path}[{i}]", item, depth + 1)


def _contexts(value: object, depth: int = 0) -> Iterator[ForwardContext]:
    if isinstance(value, ForwardContext):
        yield value
    elif isinstance(value, LayerContext):
        yield value.forward
    elif depth < _NESTING and isinstance(value, (list, tuple)):
        for item in value[:1] if value and isinstance(value[0], LayerContext) else value:
            yield from _contexts(item, depth + 1)  # a forward's layers share one ForwardContext
    elif depth < _NESTING and isinstance(value, Mapping):
        for item in value.values():
            yield from _contexts(item, depth + 1)


def library_tensors(named: Mapping[str, Any]) -> dict[int, str]:
    """``id(tensor)`` -> name of each library tensor the arguments' forward contexts hold."""
    found: dict[int, str] = {}
    for fwd in {id(f): f for value in named.values() for f in _contexts(value)}.values():
        # NOTE: not fwd.key_positions(): built on first use (with the dense mask), too dear to build here; a
        # graph input made from it is recognised by its name (dynamo names inputs after their source).
        tensors: list[tuple[str, torch.Tensor | None]] = [
            ("kv.positions", fwd.positions), ("kv.sink_positions", fwd._sink_positions),
            ("kv._handle_id", fwd._handle_id),
        ]
        for layer in fwd.layers:
            tensors += [("kv.sink_positions", layer._sink_positions)]  # (a grouped layer's own; else None)
            tensors += [("kv._layer_id", layer._layer_id), ("the KV pool", layer._kv_pool),
                        ("the KV pool", layer.k_cache), ("the KV pool", layer.v_cache)]
            tensors += [(f"kv.cross_kv({name!r})", t) for name, pair in layer.cross.items() for t in pair]
        found.update((id(t), label) for label, t in tensors if t is not None)
    return found


def names_in_text(text: str) -> list[str]:
    """The library tensors a line of code (or a graph input's name) mentions."""
    names = []
    if "key_positions" in text:
        names.append("fwd.key_positions()")
    if "sink_positions" in text:
        names.append("kv.sink_positions")
    if "positions" in text.replace("key_positions", "").replace("sink_positions", ""):
        names.append("kv.positions")
    return names


def fingerprint_inputs(model: object, named: Mapping[str, Any]) -> dict[str, object]:
    """What a recompile usually follows from: each argument's shape / dtype / device (a forward's layer
    contexts by their layer count, positions' shape and cross caches), grad mode and ``model.training``."""
    prints: dict[str, object] = {"grad mode": torch.is_grad_enabled()}
    if isinstance(model, nn.Module):
        prints["model.training"] = model.training
    for name, value in named.items():
        prints.update(_fingerprint(name, value, 0))
    return prints


def _fingerprint(path: str, value: object, depth: int) -> Iterator[tuple[str, object]]:
    if isinstance(value, torch.Tensor):
        yield path, f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)} on {value.device}"
    elif isinstance(value, (LayerContext, ForwardContext)) or (
        isinstance(value, (list, tuple)) and value and isinstance(value[0], LayerContext)
    ):
        fwd = next(_contexts(value))
        cross = {n: tuple(k.shape) for n, (k, _) in sorted(fwd._cross.items())}
        yield path, (f"{len(fwd.layers)} layer contexts with positions of shape {tuple(fwd.positions.shape)} and "
                     f"cross caches {cross}")
    elif isinstance(value, (bool, int, float, str)) or value is None:
        yield path, value
    elif depth < _NESTING and isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _fingerprint(f"{path}[{i}]", item, depth + 1)
    elif depth < _NESTING and isinstance(value, Mapping):
        for key, item in value.items():
            yield from _fingerprint(f"{path}[{key!r}]", item, depth + 1)
    else:
        yield path, type(value).__name__


def explain_changes(before: Mapping[str, object], after: Mapping[str, object]) -> str:
    """The likely cause of a recompile: what differs between two calls' fingerprints, with the fix."""
    changed = [k for k in after if before.get(k, "<absent>") != after[k]]
    changed += [k for k in before if k not in after]
    if not changed:
        return NOTHING_CHANGED
    parts = [f"`{k}` changed from {before.get(k, '<absent>')} to {after.get(k, '<absent>')}" for k in changed]
    advice = []
    if "grad mode" in changed:
        advice.append("a forward with gradients is its own graph (expected once: training)")
    if "model.training" in changed:
        advice.append("keep model.eval() for the whole rollout")
    if len(advice) < len(changed):
        advice.append("a new chunk count, batch composition or re-cache length is one new graph per shape "
                      "(expected, once per shape: pass warn_recompiles=False, or dynamic=True to share one)")
    return "; ".join(parts) + " -- " + "; ".join(advice)


# ------------------------------------------------------------------ dynamo's errors, translated
def translate_error(owner: str, error: BaseException, cause: Callable[[], str]) -> ARDiffError | None:
    """The library's error for a dynamo error whose cause is a pitfall (``None``: not one, re-raise as is)."""
    import torch._dynamo.exc as exc
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    if isinstance(error, exc.BackendCompilerFailed):
        inner = error.inner_exception
        if isinstance(inner, CompileInputError):
            return CompileInputError(str(inner))
        error = inner if isinstance(inner, GuardOnDataDependentSymNode) else error
    if isinstance(error, exc.FailOnRecompileLimitHit):
        return CompileInputError(f"{owner}: the model hit the recompile limit; likely cause: {cause()}")
    if not isinstance(error, (exc.TorchDynamoException, GuardOnDataDependentSymNode)):
        return None
    raised = library_error(owner, str(error))
    if raised is not None:
        return raised
    frames = list(getattr(error, "real_stack", None) or ())
    for frame in frames:
        if frame.name in HOST_CALLS and Path(frame.filename).resolve().is_relative_to(PACKAGE_DIR):
            return CompileInputError(host_call_message(owner, frame.name, frames[0]))
    text = str(error).split("\nfrom user code:", 1)[0]  # dynamo's explanation, not the user's source lines
    data_dependent = isinstance(error, GuardOnDataDependentSymNode) or any(
        word in text for word in ("data-dependent", "data dependent", ".item()", "tolist", "_local_scalar_dense",
                                  "capture_scalar_outputs")
    )
    if not data_dependent:
        return None
    user = [f for f in frames if not _is_library_file(f.filename)]
    code = " ".join((f.line or "") for f in user) or text
    names = names_in_text(code)
    label = f"{' / '.join(names)} (a library tensor)" if names else "a tensor"
    where = f" at {Path(user[-1].filename).name}:{user[-1].lineno}: `{(user[-1].line or '').strip()}`" if user else ""
    return CompileInputError(conversion_message(owner, label, where))


def library_error(owner: str, text: str) -> ARDiffError | None:
    """The library error that library code raised while dynamo traced it (dynamo reports it as an "observed
    exception" in its message only): rebuilt as the same class and message, or ``None``."""
    match = re.search(r"raised exception (\w+)\((.*)\)\s*$", text, re.M)
    cls = getattr(errors, match[1], None) if match else None
    if match is None or not (isinstance(cls, type) and issubclass(cls, ARDiffError)):
        return None
    try:
        args = ast.literal_eval(f"({match[2]},)")
        return cls(*args)
    except Exception:  # an error with other constructor arguments, or a message that is not a literal
        return None


# ------------------------------------------------------------------ messages
def number_message(owner: str, path: str, value: object) -> str:
    root = path.split("[", 1)[0]
    wrapped = root if root.isidentifier() else "..."
    return (
        f"{owner}: argument `{path}` is a Python {type(value).__name__} ({value!r}) where the compiled model needs "
        "a tensor: torch.compile bakes a Python number into the graph as a constant, so each new value (a "
        f"timestep per denoising step, a counter per chunk) recompiles. Pass torch.tensor({wrapped}) instead (e.g. "
        "timesteps = torch.linspace(1, 0, steps + 1)[:-1], iterated as 0-d tensors), or, for a value that never "
        f"changes, CompiledStep(..., constants=({root!r},))"
    )


def conversion_message(owner: str, label: str, where: str) -> str:
    return (
        f"{owner}: the compiled model turns {label} into a Python number (int() / float() / .item() / .tolist())"
        f"{where}. Under torch.compile that is a device sync every forward, a graph break, or, where the number "
        "steers Python (an if, a range, a shape), a data-dependent guard; and a Python int taken from positions "
        f"changes every chunk (a recompile per chunk). {FIX_CONVERSION}"
    )


def host_call_message(owner: str, call: str, frame: Any) -> str:
    return (
        f"{owner}: {call}() ran inside the compiled model (from {Path(frame.filename).name}:{frame.lineno}): the "
        "library's host-side work (allocation, the plan, commit, host tensors) cannot be traced. Call it outside "
        f"the compiled model, {HOST_CALLS[call]}"
    )


def _name(fn: object) -> str:
    return str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__)


def _signature(model: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(model.forward if isinstance(model, nn.Module) else model)
    except (TypeError, ValueError):  # builtins and some C callables have none
        return None
