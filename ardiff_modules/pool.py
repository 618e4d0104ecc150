"""The KV tensors: one K and one V page array per layer, allocated once.

Storage is a single tensor ``kv`` of shape
``[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]`` (NHD pages),
so a page id addresses that page in every layer and each layer's K (and V) is
one contiguous ``[num_pages, page_size, H, D]`` view -- the layout FlashInfer's
paged kernels take as a ``(k_cache, v_cache)`` tuple.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ardiff_modules.errors import BackendUnavailableError, KVScalesFixedError, SpecError, TensorMismatchError
from ardiff_modules.quant import KVQuantizer, is_quantized
from ardiff_modules.spec import KVCacheSpec, require_field_int

_DTYPES = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


def torch_dtype(name: str) -> torch.dtype:
    """Resolve a spec dtype name (``"bfloat16"`` ...) to a ``torch.dtype``."""
    if not isinstance(name, str) or name not in _DTYPES:  # a list would be unhashable, a torch.dtype unnamed
        raise SpecError(f"dtype: expected one of {tuple(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def _require_spec(owner: str, spec: Any) -> KVCacheSpec:
    if not isinstance(spec, KVCacheSpec):
        raise SpecError(f"{owner}.spec: expected a KVCacheSpec, got {spec!r:.80} ({type(spec).__name__})")
    return spec


def resolve_device(owner: str, device: Any) -> torch.device:
    """``device`` as a ``torch.device`` that exists here (checked before allocating anything)."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise SpecError(
            f"{owner}.device: expected a torch.device or a device string such as 'cpu' or 'cuda:0', got {device!r}"
        ) from None
    if resolved.type == "meta":  # NOTE: tensors there have no data: it would fail only at the first forward
        raise SpecError(
            f"{owner}.device: expected a device that holds data (such as 'cpu' or 'cuda:0'), got {device!r}"
        )
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (resolved.index is not None and resolved.index >= count):
            raise BackendUnavailableError(
                f"{owner}.device: expected an available device (this machine has {count} CUDA device(s)), "
                f"got {device!r}"
            )
    return resolved


def bytes_per_page(spec: KVCacheSpec) -> int:
    """Bytes one page costs across all layers, K and V."""
    _require_spec("bytes_per_page", spec)
    itemsize = torch.empty((), dtype=torch_dtype(spec.cache_dtype)).element_size()
    return spec.num_layers * 2 * spec.page_size * spec.num_kv_heads * spec.head_dim * itemsize


def pages_for_budget(spec: KVCacheSpec, budget_bytes: int) -> int:
    """Whole pages that fit in ``budget_bytes``."""
    _require_spec("pages_for_budget", spec)
    require_field_int("pages_for_budget", "budget_bytes", budget_bytes, minimum=1)
    pages = budget_bytes // bytes_per_page(spec)
    if pages < 1:
        raise SpecError(
            f"pages_for_budget.budget_bytes: expected at least one page ({bytes_per_page(spec)} bytes), "
            f"got {budget_bytes}"
        )
    return pages


class KVPool:
    """Per-layer paged K/V storage on one device.

    Parameters
    ----------
    spec:
        Cache geometry (layers, heads, head dim, page size, dtype).
    num_pages:
        Pages in the pool (shared by every branch and session).
    device:
        Where the tensors live.
    """

    def __init__(self, spec: KVCacheSpec, num_pages: int, device: torch.device | str = "cpu") -> None:
        _require_spec("KVPool", spec)
        require_field_int("KVPool", "num_pages", num_pages, minimum=1)
        self.spec = spec
        self.num_pages = num_pages
        self.device = resolve_device("KVPool", device)
        #: Storage dtype of the K/V pages (``spec.kv_dtype``, default the compute dtype).
        self.dtype = torch_dtype(spec.cache_dtype)
        # NOTE: zero-filled, not empty: padded key slots read by masked kernels must
        # never hold NaN/Inf (0 * NaN is NaN even under a zero attention weight).
        self.kv = torch.zeros(
            (spec.num_layers, 2, num_pages, spec.page_size, spec.num_kv_heads, spec.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        self.device = self.kv.device  # "cuda" -> "cuda:0": comparisons with tensors' devices must match
        #: Dequantization scales ``[num_layers, 2 (K, V), num_kv_heads]`` (float32): the place where a
        #: quantized ``kv_dtype`` keeps per-head scales; ones for the float formats (unused then).
        self.scales = torch.ones((spec.num_layers, 2, spec.num_kv_heads), dtype=torch.float32, device=self.device)
        #: The FP8 scales' calibration (``None`` for the float formats, stored as they are).
        self.quantizer = KVQuantizer(self.scales, self.dtype) if is_quantized(self.dtype) else None

    def set_kv_scales(self, scales: torch.Tensor) -> None:
        """Fix the FP8 scales ``[num_layers, 2 (K, V), num_kv_heads]`` (``KVCache.set_kv_scales``): checked
        (FP8 pool, shape, real values with data, positive and finite, nothing written yet) before any change."""
        quantizer = self.quantizer
        if quantizer is None:
            raise SpecError(
                f"set_kv_scales: expected a cache with kv_dtype='float8_e4m3fn' (scales only apply to FP8 "
                f"K/V), got kv_dtype={self.spec.cache_dtype!r}"
            )
        expected = tuple(self.scales.shape)
        if not isinstance(scales, torch.Tensor) or tuple(scales.shape) != expected:
            got = tuple(scales.shape) if isinstance(scales, torch.Tensor) else type(scales).__name__
            raise TensorMismatchError(
                f"set_kv_scales: expected a tensor of shape {list(expected)} [num_layers, 2 (K, V), "
                f"num_kv_heads], got {got}"
            )
        if scales.is_meta or scales.is_complex() or scales.dtype == torch.bool:
            raise TensorMismatchError(  # NOTE: a meta tensor has no values to read, complex ones no order
                f"set_kv_scales: expected a real-valued tensor with data (any device but meta), got dtype "
                f"{scales.dtype} on {scales.device}"
            )
        values = scales.detach().to("cpu", torch.float32)
        if not bool(torch.isfinite(values).all()) or not bool((values > 0).all()):
            raise TensorMismatchError(
                f"set_kv_scales: expected positive finite scales, got min {float(values.min())}, "
                f"max {float(values.max())}"
            )
        if quantizer.written:
            raise KVScalesFixedError(
                "set_kv_scales: expected to be called before any K/V is written (pages already hold K/V "
                "quantized with the current scales), got a pool that was written to; open a new cache"
            )
        quantizer.set_scales(values)

    @property
    def bytes_per_page(self) -> int:
        return bytes_per_page(self.spec)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def k_pages(self, layer: int) -> torch.Tensor:
        """K pages of one layer, ``[num_pages, page_size, num_kv_heads, head_dim]`` (a view)."""
        # No negative indexing: layer -1 would silently alias the last layer's pages.
        require_field_int("KVPool.k_pages", "layer", layer, minimum=0, below=self.spec.num_layers)
        return self.kv[layer, 0]

    def v_pages(self, layer: int) -> torch.Tensor:
        """V pages of one layer, ``[num_pages, page_size, num_kv_heads, head_dim]`` (a view)."""
        require_field_int("KVPool.v_pages", "layer", layer, minimum=0, below=self.spec.num_layers)
        return self.kv[layer, 1]

    @staticmethod
    def token_slots(pages: torch.Tensor) -> torch.Tensor:
        """Flat token-slot view ``[num_pages * page_size, H, D]`` of a ``[P, page, H, D]`` page array.

        Slot ``page_id * page_size + offset`` holds token ``offset`` of page ``page_id``.
        """
        # Must stay a view (writes through it land in the pool), so no reshape fallback.
        if not isinstance(pages, torch.Tensor) or pages.dim() != 4 or not pages.is_contiguous():
            got = (
                f"{tuple(pages.shape)} (contiguous={pages.is_contiguous()})"
                if isinstance(pages, torch.Tensor)
                else type(pages).__name__
            )
            raise TensorMismatchError(
                f"KVPool.token_slots pages: expected a contiguous [num_pages, page_size, heads, head_dim] tensor, "
                f"got {got}"
            )
        return pages.view(-1, pages.shape[-2], pages.shape[-1])

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy page ``src[i]`` to page ``dst[i]`` in every layer, K and V (raw storage: FP8 bits as they are).

        ``src`` and ``dst``: page ids, equally long, disjoint. Asynchronous on CUDA (no sync).

        NOTE: one strided ``copy_`` per run of pages consecutive in both lists (a chunk's pages usually
        are), not one ``index_copy_``: gathering the sources first would take a temporary as large as
        the copy -- a re-cache's rebuilt chunks, the very memory the copy is there to give back.
        """
        if len(src) != len(dst):
            raise TensorMismatchError(
                f"KVPool.copy_pages: expected as many destinations as sources, got {len(src)} and {len(dst)}"
            )
        start = 0
        for i in range(1, len(src) + 1):
            if i == len(src) or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
                n = i - start
                self.kv[:, :, dst[start] : dst[start] + n].copy_(self.kv[:, :, src[start] : src[start] + n])
                start = i

    def release(self) -> None:
        """Drop the K/V storage (``KVCache.close``); contexts still holding views keep theirs alive."""
        self.kv = self.kv.new_empty((0, *self.kv.shape[1:]))
