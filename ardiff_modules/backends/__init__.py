"""Attention backends and their selection.

``"auto"`` picks FlashInfer on CUDA when it is importable and supports the
dtype / head dim, and the reference backend otherwise; ``"reference"`` and
``"flashinfer"`` force one (the latter raising
:class:`~ardiff_modules.errors.BackendUnavailableError` with the reason).
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from ardiff_modules._logging import warn_once
from ardiff_modules.backends.base import AttentionBackend, AttentionPlan, PlanRequest
from ardiff_modules.backends.reference import ReferenceBackend
from ardiff_modules.errors import BackendUnavailableError

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "reference", "flashinfer")


def flashinfer_available() -> bool:
    """Whether the ``flashinfer`` package can be imported (without importing it)."""
    return importlib.util.find_spec("flashinfer") is not None


def resolve_backend(
    backend: str | AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    *,
    kv_dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """Return a ready backend for ``device``/``dtype``/``head_dim``/``kv_dtype`` (see module docstring)."""
    if isinstance(backend, AttentionBackend):
        backend.check_supported(device, dtype, head_dim, kv_dtype)
        return backend
    if backend not in BACKEND_NAMES:
        raise BackendUnavailableError(f"backend: expected one of {BACKEND_NAMES}, got {backend!r}")
    if backend == "reference":
        return ReferenceBackend()
    if backend == "auto" and device.type != "cuda":
        logger.debug("backend='auto' on %s: the reference backend (FlashInfer needs a CUDA device)", device)
        return ReferenceBackend()
    if backend == "auto" and not flashinfer_available():
        _warn_fallback(
            device, "flashinfer-missing", "the flashinfer package is not installed",
            "pip install 'ardiff_modules[flashinfer]'",
        )
        return ReferenceBackend()
    if device.type != "cuda":
        raise BackendUnavailableError(f"backend 'flashinfer': expected a CUDA device, got {device}")
    if not flashinfer_available():
        raise BackendUnavailableError(
            "backend 'flashinfer': the flashinfer package is not installed "
            "(pip install 'ardiff_modules[flashinfer]')"
        )
    from ardiff_modules.backends.flashinfer import FlashInferBackend

    fi = FlashInferBackend()
    if backend == "auto":
        unsupported = fi.unsupported(device, dtype, head_dim, kv_dtype)
        if unsupported is not None:
            reason, fix = unsupported
            _warn_fallback(device, reason, reason, fix)
            return ReferenceBackend()
        logger.debug("backend='auto' on %s: FlashInfer (dtype %s, head_dim %d)", device, dtype, head_dim)
        return fi
    fi.check_supported(device, dtype, head_dim, kv_dtype)
    return fi


def _warn_fallback(device: torch.device, key: str, reason: str, fix: str) -> None:
    """``backend="auto"`` on CUDA chose the slow reference backend: say why and how to fix it, once per reason."""
    warn_once(
        logger,
        key,
        "backend='auto' on %s: falling back to the reference backend (gather + dense-mask SDPA, several times "
        "slower than FlashInfer) because %s. To fix: %s. Pass backend='reference' to choose it explicitly "
        "(no warning), or backend='flashinfer' to get an error instead of a fallback.",
        device, reason, fix,
    )

__all__ = [
    "AttentionBackend",
    "AttentionPlan",
    "BACKEND_NAMES",
    "PlanRequest",
    "ReferenceBackend",
    "flashinfer_available",
    "resolve_backend",
]
