"""The KV tensors: one K and one V page array per layer, allocated once.

Storage is a single tensor ``kv`` of shape
``[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]`` (NHD pages),
so a page id addresses that page in every layer and each layer's K (and V) is
one contiguous ``[num_pages, page_size, H, D]`` view -- the layout FlashInfer's
paged kernels take as a ``(k_cache, v_cache)`` tuple.
"""

from __future__ import annotations

import torch

from ardiff_modules.errors import SpecError
from ardiff_modules.spec import KVCacheSpec

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    """Resolve a spec dtype name (``"bfloat16"`` ...) to a ``torch.dtype``."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise SpecError(f"dtype: expected one of {tuple(_DTYPES)}, got {name!r}") from None


def bytes_per_page(spec: KVCacheSpec) -> int:
    """Bytes one page costs across all layers, K and V."""
    itemsize = torch.empty((), dtype=torch_dtype(spec.dtype)).element_size()
    return spec.num_layers * 2 * spec.page_size * spec.num_kv_heads * spec.head_dim * itemsize


def pages_for_budget(spec: KVCacheSpec, budget_bytes: int) -> int:
    """Whole pages that fit in ``budget_bytes``."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise SpecError(f"budget_bytes: expected a positive int, got {budget_bytes!r}")
    pages = budget_bytes // bytes_per_page(spec)
    if pages < 1:
        raise SpecError(
            f"budget_bytes: expected at least one page ({bytes_per_page(spec)} bytes), got {budget_bytes}"
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
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise SpecError(f"num_pages: expected an int >= 1, got {num_pages!r}")
        self.spec = spec
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.dtype = torch_dtype(spec.dtype)
        # NOTE: zero-filled, not empty: padded key slots read by masked kernels must
        # never hold NaN/Inf (0 * NaN is NaN even under a zero attention weight).
        self.kv = torch.zeros(
            (spec.num_layers, 2, num_pages, spec.page_size, spec.num_kv_heads, spec.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        self.device = self.kv.device  # "cuda" -> "cuda:0": comparisons with tensors' devices must match

    @classmethod
    def from_bytes(cls, spec: KVCacheSpec, budget_bytes: int, device: torch.device | str = "cpu") -> KVPool:
        """A pool with as many pages as fit in ``budget_bytes``."""
        return cls(spec, pages_for_budget(spec, budget_bytes), device)

    @property
    def bytes_per_page(self) -> int:
        return bytes_per_page(self.spec)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def k_pages(self, layer: int) -> torch.Tensor:
        """K pages of one layer, ``[num_pages, page_size, num_kv_heads, head_dim]`` (a view)."""
        return self.kv[layer, 0]

    def v_pages(self, layer: int) -> torch.Tensor:
        """V pages of one layer, ``[num_pages, page_size, num_kv_heads, head_dim]`` (a view)."""
        return self.kv[layer, 1]

    @staticmethod
    def token_slots(pages: torch.Tensor) -> torch.Tensor:
        """Flat token-slot view ``[num_pages * page_size, H, D]`` of a ``[P, page, H, D]`` page array.

        Slot ``page_id * page_size + offset`` holds token ``offset`` of page ``page_id``.
        """
        return pages.view(-1, pages.shape[-2], pages.shape[-1])
