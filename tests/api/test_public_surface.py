"""The public surface: ``__all__``, one-line reprs, and what the package logs (and does not)."""

from __future__ import annotations

import ast
import inspect
import logging
import re
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import ardiff_modules as am
from ardiff_modules import _logging, errors
from ardiff_modules.backends import resolve_backend
from ardiff_modules.backends.reference import ReferenceBackend
from tests.support.gpu import NEEDS_GPU
from tests.support.paths import REPO_ROOT

REPO = REPO_ROOT
CUDA = torch.device("cuda")  # only named: resolve_backend never touches the device when falling back


def _repr_spec(layers: int = 30, **kw: object) -> am.KVCacheSpec:
    kw = {
        "num_layers": layers, "num_kv_heads": 2, "head_dim": 8, "chunk_size": 4, "page_size": 2,
        "sink_chunks": 1, "window_chunks": 2, "branches": ("cond", "uncond"),
        "cross_attention": (am.CrossAttentionSpec("text", 3),), "dtype": "float32", **kw,
    }
    return am.KVCacheSpec(**kw)  # type: ignore[arg-type]


def _run(fwd: am.ForwardContext) -> None:
    s, n = fwd.positions.shape
    q = torch.randn(s, n, 2, 8)
    for layer in fwd.layers:
        am.chunk_attention(q, q, q, layer)


# ---------------------------------------------------------------------------------------------- __all__


def test_all_is_sorted_unique_and_resolves() -> None:
    assert am.__all__ == sorted(am.__all__)
    assert len(set(am.__all__)) == len(am.__all__)
    for name in am.__all__:
        assert getattr(am, name) is not None, name
    namespace: dict[str, object] = {}
    exec("from ardiff_modules import *", namespace)  # noqa: S102
    assert set(am.__all__) <= set(namespace)


def test_all_names_what_users_use_and_no_internals() -> None:
    public = set(am.__all__)
    for name in (
        "KVCache", "KVCacheSpec", "CrossAttentionSpec", "KVState", "ForwardContext", "LayerContext", "CacheStats",
        "ChunkSelfAttention", "CachedCrossAttention", "RotaryEmbedding", "VideoRotaryEmbedding",
        "chunk_attention", "cached_cross_attention", "apply_rope", "populate_cross_attention", "CUDAGraphStep",
        "CompiledStep", "CompileInputWarning",
        "RetentionPolicy", "SinkWindowPolicy", "SinkWindowMemoryPolicy", "FrameWindowPolicy", "PhasedPolicy",
        "AttentionBackend", "ReferenceBackend", "FlashInferBackend",
    ):
        assert name in public, name
    for internal in ("ForwardLayout", "StreamLayout", "KVPool", "PageAllocator", "ForwardTransaction",
                     "Reservation", "ContextRegistry", "HANDLES", "BranchPages", "PlanRequest", "AttentionPlan"):
        assert internal not in public, internal
        assert internal not in dir(am), internal
    # Every exception class of the package is importable from ardiff_modules.errors (also ``am.errors``); the
    # top level re-exports the base, those a working program handles and those the docs catch (pinned below).
    assert am.errors is errors
    for name, obj in vars(errors).items():
        if inspect.isclass(obj) and issubclass(obj, errors.ARDiffError) and name in public:
            assert getattr(am, name) is obj, name
    assert "ARDiffError" in public
    # What `backend=` accepts is exported: a name or an AttentionBackend instance.
    assert isinstance(am.ReferenceBackend(), am.AttentionBackend)
    assert isinstance(am.FlashInferBackend(), am.AttentionBackend)


@pytest.mark.parametrize("path", [
    "README.md",
    *sorted(str(p.relative_to(REPO)) for p in REPO.glob("docs/**/*.md")),
    *sorted(str(p.relative_to(REPO)) for p in REPO.glob("examples/*.py")),
])
def test_documented_top_level_names_are_exported(path: str) -> None:
    text = (REPO / path).read_text()
    used = set(re.findall(r"\bam\.([A-Za-z_][A-Za-z0-9_]*)", text))
    if path.endswith(".py"):
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module == "ardiff_modules":
                used |= {alias.name for alias in node.names}
    missing = sorted(name for name in used if not name.startswith("__") and name not in am.__all__)
    assert not missing, f"{path} uses ardiff_modules.{missing} which __all__ does not export"


def test_internals_are_not_top_level_names() -> None:
    """The 0.1 deprecation shims are gone: internals resolve from their own modules only."""
    for name in ("KVPool", "ForwardLayout", "PageAllocator", "StreamLayout", "ParamNames", "rotate", "NoSuchThing"):
        with pytest.raises(AttributeError, match=f"no attribute '{name}'"):
            getattr(am, name)


def test_import_without_torch_keeps_the_pure_python_surface() -> None:
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        sys.path.insert(0, {str(REPO)!r})
        import ardiff_modules as am
        spec = am.KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, chunk_size=4, page_size=2)
        am.SinkWindowMemoryPolicy(1, 2, 2, 1), am.SpecError, am.errors.ForwardFinishedError, am.RetentionPolicy
        try:
            am.KVCache
        except ImportError:
            pass
        else:
            raise AssertionError("KVCache imported without torch?")
        assert sys.modules["torch"] is None
        print("OK")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "OK", result.stderr


# ---------------------------------------------------------------------------------------------- reprs


def test_reprs_are_one_short_line_naming_the_key_facts() -> None:
    cache = am.KVCache(_repr_spec(), num_pages=64)
    state = cache.open_session("s0")
    for branch in ("cond", "uncond"):
        state.populate_cross_attention(branch, "text", ((torch.zeros(3, 2, 8),) * 2 for _ in range(30)))
    fwd = state.prepare_forward(("cond", "uncond"), 4, commit_current=True)
    _run(fwd)

    text = repr(fwd)
    assert len(text) < 300 and "\n" not in text, text
    assert text.startswith("ForwardContext(streams=2 [('s0','cond'),('s0','uncond')], seq_len=4, chunks=1"), text
    assert "commit=True" in text and "status='open'" in text and "layers=30" in text, text
    layer = repr(fwd.layers[3])
    assert len(layer) < 200 and "layer=3/30" in layer and "streams=2" in layer and "'text'" in layer, layer
    cache_text = repr(cache)
    assert len(cache_text) < 300 and "\n" not in cache_text, cache_text
    for fact in ("layers=30", "kv_heads=2", "head_dim=8", "/64 used", "sessions=1", "backend='reference'",
                 "device='cpu'", "dtype=float32"):
        assert fact in cache_text, (fact, cache_text)
    state_text = repr(state)
    assert len(state_text) < 300 and "'s0'" in state_text and "'cond': 0" in state_text, state_text
    assert "pending={'cond': 1, 'uncond': 1}" in state_text and "('text',)" in state_text, state_text

    fwd.commit()
    assert "status='committed'" in repr(fwd) and "'cond': 1" in repr(state)
    state.close()
    assert "status='released'" in repr(fwd) and "status='closed'" in repr(state)
    cache.close()
    assert repr(cache).endswith(", closed)")


def test_repr_of_a_wide_batch_stays_bounded() -> None:
    cache = am.KVCache(_repr_spec(layers=2, branches=tuple(f"branch-{i}" for i in range(6))), num_pages=256)
    states = [cache.open_session(f"a-rather-long-session-identifier-{i:04d}") for i in range(8)]
    fwd = cache.prepare_forward([(s, b) for s in states for b in s.kv_branch_names], 4)
    assert len(repr(fwd)) < 300 and "streams=48" in repr(fwd) and "... +" in repr(fwd), repr(fwd)
    assert len(repr(states[0])) < 300 and "... +2" in repr(states[0]), repr(states[0])


def test_reprs_do_not_wait_for_the_cache_lock() -> None:
    cache = am.KVCache(_repr_spec(layers=2), num_pages=16)
    state = cache.open_session()
    fwd = state.prepare_forward(("cond",), 4)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with cache.lock:
            held.set()
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert held.wait(10)
        done: list[str] = []
        reader = threading.Thread(target=lambda: done.extend([repr(cache), repr(state), repr(fwd), repr(fwd.layers[0])]))
        reader.start()
        reader.join(5)
        assert len(done) == 4, "a repr blocked on the cache lock held by another thread"
    finally:
        release.set()
        thread.join()


def test_module_reprs_name_their_configuration() -> None:
    attn = am.ChunkSelfAttention(32, 4, num_kv_heads=2, qk_norm="full", param_names="wan", rope_layout="half")
    first = repr(attn).splitlines()[0:2]
    for fact in ("dim=32", "num_heads=4", "num_kv_heads=2", "head_dim=8", "qk_norm='full'", "param_names='wan'",
                 "rope_layout='half'"):
        assert fact in first[1], (fact, first)
    cross = am.CachedCrossAttention(32, 4, "text", context_dim=24, image_cache_name="image")
    line = repr(cross).splitlines()[1]
    for fact in ("cache_name='text'", "context_dim=24", "image_cache_name='image'", "image_context_dim=24",
                 "num_kv_heads=4", "head_dim=8", "param_names='ardiff'"):
        assert fact in line, (fact, line)
    assert repr(am.VideoRotaryEmbedding(12, 3, 5)) == (
        "VideoRotaryEmbedding(head_dim=12, height=3, width=5, theta=10000.0, layout='interleaved')"
    )
    assert repr(am.RotaryEmbedding(8, layout="half")) == "RotaryEmbedding(head_dim=8, theta=10000.0, layout='half')"
    assert repr(am.ReferenceBackend()) == "ReferenceBackend()"
    assert repr(am.FlashInferBackend()) == "FlashInferBackend(paged_backend='auto', allow_gap_rows=True)"


# ---------------------------------------------------------------------------------------------- logging


@pytest.fixture
def fresh_warnings() -> None:
    _logging._reset_warn_once()
    yield
    _logging._reset_warn_once()


def test_the_library_installs_no_handler_and_sets_no_level() -> None:
    import ardiff_modules.cache  # noqa: F401  (every logger of the package exists once imported)
    import ardiff_modules.integrations.diffusers  # noqa: F401

    root = logging.getLogger("ardiff_modules")
    assert root.handlers == [] and root.level == logging.NOTSET
    names = [name for name in logging.Logger.manager.loggerDict if name.startswith("ardiff_modules.")]
    assert "ardiff_modules.backends" in names and "ardiff_modules.backends.flashinfer" in names
    for name in names:
        logger = logging.getLogger(name)
        assert logger.handlers == [] and logger.level == logging.NOTSET, name


def test_auto_fallback_on_cuda_warns_once_per_reason(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fresh_warnings: None
) -> None:
    import ardiff_modules.backends as backends

    caplog.set_level(logging.WARNING, logger="ardiff_modules")
    monkeypatch.setattr(backends, "flashinfer_available", lambda: False)
    for _ in range(3):
        assert isinstance(resolve_backend("auto", CUDA, torch.bfloat16, 128), ReferenceBackend)
    [record] = caplog.records
    assert record.name == "ardiff_modules.backends" and record.levelno == logging.WARNING
    assert "flashinfer package is not installed" in record.getMessage()
    assert "pip install 'ardiff_modules[flashinfer]'" in record.getMessage()
    assert "backend='reference'" in record.getMessage()

    # Explicit choices and the CPU never warn.
    caplog.clear()
    resolve_backend("reference", CUDA, torch.float32, 12)
    resolve_backend("auto", torch.device("cpu"), torch.float32, 12)
    assert caplog.records == []

    # Unsupported dtype / head_dim: one warning per distinct reason, each naming its fix.
    monkeypatch.setattr(backends, "flashinfer_available", lambda: True)
    for _ in range(2):
        resolve_backend("auto", CUDA, torch.float32, 128)
        resolve_backend("auto", CUDA, torch.bfloat16, 48)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "float32" in messages[0] and "dtype='bfloat16'" in messages[0]
    assert "head_dim" in messages[1] and "48" in messages[1]


def test_fallback_warning_is_once_across_threads(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fresh_warnings: None
) -> None:
    import ardiff_modules.backends as backends

    caplog.set_level(logging.WARNING, logger="ardiff_modules")
    monkeypatch.setattr(backends, "flashinfer_available", lambda: False)
    barrier = threading.Barrier(8)

    def resolve() -> None:
        barrier.wait()
        for _ in range(20):
            resolve_backend("auto", CUDA, torch.bfloat16, 128)

    threads = [threading.Thread(target=resolve) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(caplog.records) == 1


def test_debug_logs_once_per_forward_never_per_layer(caplog: pytest.LogCaptureFixture) -> None:
    counts = []
    for layers in (1, 30):
        cache = am.KVCache(_repr_spec(layers=layers), num_pages=64)
        state = cache.open_session("s0")
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="ardiff_modules"):
            with state.prepare_forward(("cond", "uncond"), 4, commit_current=True) as fwd:
                _run(fwd)
        counts.append(len(caplog.records))
        names = {r.name for r in caplog.records}
        assert names <= {"ardiff_modules.cache", "ardiff_modules.backends.reference"}, names
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert "reference plan" in text and "forward prepared" in text and "forward committed" in text, text
    assert counts[0] == counts[1], counts  # the same lines for 1 and 30 layers


def test_disabled_debug_logging_formats_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = am.KVCache(_repr_spec(layers=2), num_pages=16)
    state = cache.open_session()
    logging.getLogger("ardiff_modules").setLevel(logging.INFO)
    try:
        def boom(self: object) -> str:
            raise AssertionError("formatted a DEBUG message while DEBUG is off")

        monkeypatch.setattr(am.ForwardContext, "__repr__", boom)
        with state.prepare_forward(("cond",), 4, commit_current=True) as fwd:
            _run(fwd)
    finally:
        logging.getLogger("ardiff_modules").setLevel(logging.NOTSET)


@pytest.mark.gpu
@NEEDS_GPU
def test_flashinfer_plan_decisions_are_logged_once_per_forward(caplog: pytest.LogCaptureFixture) -> None:
    spec = am.KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=128, chunk_size=32, page_size=16, sink_chunks=1,
                          window_chunks=1, branches=("cond",), dtype="bfloat16")
    cache = am.KVCache(spec, num_pages=64, device="cuda", backend="flashinfer")
    state = cache.open_session()
    q = torch.randn(1, 32, 2, 128, device="cuda", dtype=torch.bfloat16)
    with caplog.at_level(logging.DEBUG, logger="ardiff_modules.backends.flashinfer"):
        for _ in range(5):  # the window fills, then the row lengths repeat
            with state.prepare_forward(("cond",), 32, commit_current=True) as fwd:
                for layer in fwd.layers:
                    am.chunk_attention(q, q, q, layer)
    plans = [r.getMessage() for r in caplog.records if r.getMessage().startswith("flashinfer plan: ragged")]
    assert len(plans) == 5, [r.getMessage() for r in caplog.records]  # one per forward, not per layer
    assert "contiguous" in plans[0] and "plan() called" in plans[0]
    assert "plan() skipped" in plans[-1]
    paged = am.KVCache(spec, num_pages=64, device="cuda", backend="flashinfer", contiguous_extents=False)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="ardiff_modules.backends.flashinfer"):
        with paged.open_session().prepare_forward(("cond",), 64) as fwd:  # two pending chunks: paged rows
            for layer in fwd.layers:
                am.chunk_attention(torch.cat([q, q], 1), torch.cat([q, q], 1), torch.cat([q, q], 1), layer)
    assert any("paged path" in r.getMessage() and "2 pending chunks" in r.getMessage() for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ]
