"""Attention backends and their selection.

``"auto"`` picks FlashInfer on CUDA when it is importable and supports the
dtype / head dim, and the reference backend otherwise; ``"reference"`` and
``"flashinfer"`` force one (the latter raising
:class:`~ardiff_modules.errors.BackendUnavailableError` with the reason).
"""

from __future__ import annotations

import importlib.util

import torch

from ardiff_modules.backends.base import AttentionBackend, AttentionPlan, PlanRequest
from ardiff_modules.backends.reference import ReferenceBackend
from ardiff_modules.errors import BackendUnavailableError

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
    if backend == "auto" and (device.type != "cuda" or not flashinfer_available()):
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
        try:
            fi.check_supported(device, dtype, head_dim, kv_dtype)
        except BackendUnavailableError:
            return ReferenceBackend()
        return fi
    fi.check_supported(device, dtype, head_dim, kv_dtype)
    return fi


__all__ = [
    "AttentionBackend",
    "AttentionPlan",
    "BACKEND_NAMES",
    "PlanRequest",
    "ReferenceBackend",
    "flashinfer_available",
    "resolve_backend",
]
