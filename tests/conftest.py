"""Shared pytest configuration: hypothesis profiles, the ``gpu`` marker's skip rule, and the shared fixtures.

The tests are laid out by subject (``core/``, ``session/``, ``attention/``, ...); their shared models and
helpers live in ``tests/support/`` (imported as ``tests.support.<module>``), the fixtures here.

Hypothesis profiles (pick one with ``ARDIFF_HYPOTHESIS_PROFILE``, default ``ci``)::

    ci    derandomized (same examples every run), modest example counts: the whole
          property suite stays well under a minute on a 2-core CI runner.
    long  randomized, many more examples and longer stateful runs: for a nightly or
          a local soak, e.g. ``ARDIFF_HYPOTHESIS_PROFILE=long pytest tests/*/test_*_properties.py``.

Parallel runs: ``python -m pytest -q -n auto`` (pytest-xdist, what the README's test command and CI use)
spreads test files over one worker per core; each worker's torch then uses one intra-op thread (workers x
torch's default threads would oversubscribe the cores).

Markers:

    gpu   needs CUDA and FlashInfer; where either is missing the test is skipped with
          the reason (run them on the GPU machine with ``pytest -m gpu``).
    slow  torch.compile runs, stateful property machines, the soak and the thread
          hammer. ``python -m pytest -q -m "not slow"`` is the quick local loop; CI
          runs everything (plain ``python -m pytest -q``).

Fixtures:

    fresh_dynamo    ``torch._dynamo.reset()`` before and after the test (compile tests).
    small_cache     a 32-page cache of :data:`tests.support.small_cache.SMALL_SPEC` (reference backend).
    sigint_raises   Python's default SIGINT handler for the test (tests that send themselves SIGINT: a
                    suite started in the background or under ``nohup`` has SIGINT ignored).
    two_sessions    ``(cache, a, b)`` of :func:`tests.support.two_sessions.build`: two sessions with
                    history, an open denoising forward and populated cross caches (the misuse tests).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

if os.environ.get("PYTEST_XDIST_WORKER"):  # NOTE: one worker per core already fills the cores
    torch.set_num_threads(1)

PROFILE_ENV = "ARDIFF_HYPOTHESIS_PROFILE"

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile(
    "long",
    derandomize=False,
    max_examples=1000,
    stateful_step_count=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)

_profile = os.environ.get(PROFILE_ENV, "ci")
if _profile not in ("ci", "long"):
    raise pytest.UsageError(f"{PROFILE_ENV}: expected 'ci' or 'long', got {_profile!r}")
settings.load_profile(_profile)


def pytest_configure(config: pytest.Config) -> None:
    # Also declared in pyproject.toml; repeated here so the markers exist however pytest is invoked.
    config.addinivalue_line("markers", "gpu: needs CUDA and FlashInfer (run on the GPU machine: pytest -m gpu)")
    config.addinivalue_line(
        "markers",
        "slow: compile runs, long property / soak / thread tests (quick loop: pytest -m 'not slow'; CI runs all)",
    )


def gpu_unavailable_reason() -> str | None:
    """Why ``gpu`` tests cannot run here, or ``None`` when CUDA and FlashInfer are both available."""
    import torch

    missing = []
    if not torch.cuda.is_available():
        missing.append("CUDA is not available (torch.cuda.is_available() is False)")
    if importlib.util.find_spec("flashinfer") is None:
        missing.append("the flashinfer package is not installed (pip install 'ardiff_modules[flashinfer]')")
    if not missing:
        return None
    return "gpu test skipped: " + "; ".join(missing)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in gpu_items:
        item.add_marker(skip)


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """A clean dynamo cache (and compile counters' frames) for the test, and none left behind."""
    import torch

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def sigint_raises() -> Iterator[None]:
    """SIGINT raises ``KeyboardInterrupt`` during the test, whatever disposition the suite started with."""
    from tests.support.failures import default_sigint

    with default_sigint():
        yield


@pytest.fixture
def two_sessions() -> tuple:
    """``(cache, a, b)``: see :func:`tests.support.two_sessions.build` (16 pages)."""
    from tests.support.two_sessions import build

    return build()


@pytest.fixture
def small_cache():  # noqa: ANN201
    """A 32-page :data:`tests.support.small_cache.SMALL_SPEC` cache on the reference backend."""
    from tests.support.small_cache import make_small_cache

    return make_small_cache()
