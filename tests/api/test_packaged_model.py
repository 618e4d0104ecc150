"""The reference causal Wan model ships in the package (issue 26): ``ardiff_modules.models.wan_causal_dit``.

The wheel's file list is checked by ``.ci/check_dist.py`` (run by ``.ci/run``); these tests hold the cheap
half here: the module is a package module found by the wheel's package discovery, not an example, and
``import ardiff_modules`` still imports neither it nor torch.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest

from tests.support.paths import EXAMPLES, PACKAGE, REPO_ROOT

MODEL = "ardiff_modules.models.wan_causal_dit"


def test_the_model_is_a_module_of_the_package() -> None:
    spec = importlib.util.find_spec(MODEL)
    assert spec is not None and spec.origin is not None, f"{MODEL} is not importable"
    assert spec.origin == str(PACKAGE / "models" / "wan_causal_dit.py"), spec.origin
    assert not (EXAMPLES / "wan_causal_dit.py").exists(), "the model is back in examples/: import it from the package"
    module = importlib.import_module(MODEL)
    for name in ("WanConfig", "PRESETS", "WanCausalDiT", "build_model", "make_kv_spec", "kv_pool_pages", "BRANCHES"):
        assert hasattr(module, name), name


def test_the_wheels_package_discovery_finds_the_models_package() -> None:
    setuptools = pytest.importorskip("setuptools")
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    found = setuptools.find_packages(where=str(REPO_ROOT), include=config["include"], exclude=config.get("exclude", ()))
    assert "ardiff_modules.models" in found, found
    assert not [p for p in found if not p.startswith("ardiff_modules")], found  # no tests / examples / benchmarks


def test_import_ardiff_modules_imports_neither_the_model_nor_torch() -> None:
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(REPO_ROOT)!r})
        import ardiff_modules
        assert "torch" not in sys.modules, "import ardiff_modules imported torch"
        assert {MODEL!r} not in sys.modules and "ardiff_modules.models" not in sys.modules
        print("OK")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "OK", result.stderr
