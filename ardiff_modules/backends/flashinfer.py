"""FlashInfer backend (CUDA): structural sink+window dispatch on paged FA3, masked FA2 fallback.

Structural plan (default): one FlashInfer request per (stream, pending chunk)
whose page list is exactly its visible pages -- sinks + window + pending
chunks ``0..c`` -- with ``causal=False``. No mask memory; FA3 on Hopper. Only
the last page of a request could be partial, and since ``page_size`` divides
``chunk_size`` none is.

Masked plan: the same rows with a per-token custom mask (FA2), for masks that
are not chunk-structured (``prepare_forward(token_mask=...)``).

``plan()`` runs once per forward on the host with CPU int32 indptrs (device
indptrs would force a sync inside FlashInfer); every layer's ``run()`` only
writes its K/V pages and launches the kernel.
"""

from __future__ import annotations

import math

import torch

from ardiff_modules.backends.base import AttentionBackend, AttentionPlan, PlanRequest
from ardiff_modules.errors import BackendUnavailableError, TensorMismatchError

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
WORKSPACE_BYTES = 128 << 20


def _flashinfer():  # noqa: ANN202
    try:
        import flashinfer
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise BackendUnavailableError(
            f"backend 'flashinfer': expected an importable flashinfer package, import failed: {exc}"
        ) from exc
    return flashinfer


def _pinned(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory()


class FlashInferPlan(AttentionPlan):
    """One paged prefill wrapper re-planned every forward; reused across forwards of the same streams."""

    def __init__(self, backend: FlashInferBackend, request: PlanRequest) -> None:
        fi = _flashinfer()
        self.device = request.device
        self.masked = request.token_mask is not None
        self.static = request.static
        layout = request.layout
        rows = layout.num_streams * layout.num_chunks
        self.rows = rows
        workspace = backend.workspace(request.device)
        kernel = "fa2" if self.masked else backend.paged_backend
        if self.static:
            if self.masked:
                raise BackendUnavailableError("static (CUDA-graph) plans with a token_mask are not supported")
            i32 = dict(dtype=torch.int32, device=request.device)
            assert request.max_pages is not None
            self._qo_indptr = torch.zeros(rows + 1, **i32)
            self._kv_indptr = torch.zeros(rows + 1, **i32)
            self._kv_indices = torch.zeros(request.max_pages, **i32)
            self._last_page_len = torch.zeros(rows, **i32)
            self.wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(
                workspace,
                "NHD",
                use_cuda_graph=True,
                qo_indptr_buf=self._qo_indptr,
                paged_kv_indptr_buf=self._kv_indptr,
                paged_kv_indices_buf=self._kv_indices,
                paged_kv_last_page_len_buf=self._last_page_len,
                backend=kernel,
            )
            self.write_pages = torch.zeros(layout.write_pages.numel(), dtype=torch.int64, device=request.device)
        else:
            self.wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=kernel)
            self.write_pages = torch.empty(0, dtype=torch.int64, device=request.device)
        self._planned = None  # CUDA event after the last plan's host->device copies
        self.num_qo_heads = request.num_qo_heads
        self.head_dim = request.head_dim
        self.page_size = layout.page_size
        self.update(request)

    def compatible(self, request: PlanRequest) -> bool:
        layout = request.layout
        return (
            request.static == self.static
            and (request.token_mask is not None) == self.masked
            and request.device == self.device
            and request.num_qo_heads == self.num_qo_heads
            and (not self.static or layout.num_streams * layout.num_chunks == self.rows)
        )

    def update(self, request: PlanRequest) -> None:
        """Re-plan for a new forward (host work, no device sync)."""
        layout = request.layout
        rows = layout.structural_rows
        if self._planned is not None:
            # FlashInfer stages its plan through one pinned host buffer per wrapper: wait until the
            # previous plan's copy has left it (not a device sync: only that copy, long done in practice).
            self._planned.synchronize()
        write_pages = _pinned(layout.write_pages)
        if self.static:
            self.write_pages.copy_(write_pages, non_blocking=True)
        else:
            self.write_pages = write_pages.to(self.device, non_blocking=True)
        indices = _pinned(rows.kv_page_indices).to(self.device, non_blocking=True)
        custom_mask = None
        if request.token_mask is not None:
            custom_mask = _row_masks(layout, request.token_mask.to(self.device))
        self.wrapper.plan(
            rows.qo_indptr,
            rows.kv_page_indptr,
            indices,
            rows.kv_last_page_len,
            request.num_qo_heads,
            request.num_kv_heads,
            request.head_dim,
            layout.page_size,
            custom_mask=custom_mask,
            causal=False,
            q_data_type=request.dtype,
            kv_data_type=request.dtype,
            non_blocking=True,
        )
        self._planned = torch.cuda.Event()
        self._planned.record()

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        if q.shape[1] != self.num_qo_heads:
            raise TensorMismatchError(
                f"flashinfer plan was built for num_qo_heads={self.num_qo_heads} (KVCacheSpec.num_qo_heads), "
                f"got q with {q.shape[1]} heads"
            )
        page_shape = (-1, *k_cache.shape[1:])
        k_cache.index_copy_(0, self.write_pages, k.reshape(page_shape))
        v_cache.index_copy_(0, self.write_pages, v.reshape(page_shape))
        default = 1.0 / math.sqrt(self.head_dim)
        q_scale = None if math.isclose(scale, default, rel_tol=1e-6) else scale / default
        return self.wrapper.run(q, (k_cache, v_cache), q_scale=q_scale)


def _row_masks(layout, token_mask: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """Flatten visibility & token mask per structural row: ``[chunk_size, kv_len_row]`` row-major, concatenated."""
    dense = layout.to_dense().to(token_mask.device) & token_mask
    parts = []
    c = layout.chunk_size
    for s, stream in enumerate(layout.streams):
        history = len(stream.history_pages) * layout.page_size
        for chunk in range(layout.num_chunks):
            kv_len = history + (chunk + 1) * c
            parts.append(dense[s, chunk * c : (chunk + 1) * c, :kv_len].reshape(-1))
    return torch.cat(parts)


class FlashInferBackend(AttentionBackend):
    """Paged FlashInfer attention; FA3 on Hopper (``paged_backend="auto"``), FA2 for masks.

    Parameters
    ----------
    paged_backend:
        FlashInfer kernel family for unmasked plans: ``"auto"`` (FA3 on sm90), ``"fa3"`` or ``"fa2"``.
    """

    name = "flashinfer"

    def __init__(self, paged_backend: str = "auto") -> None:
        if paged_backend not in ("auto", "fa2", "fa3"):
            raise BackendUnavailableError(f"paged_backend: expected 'auto', 'fa2' or 'fa3', got {paged_backend!r}")
        self.paged_backend = paged_backend
        self._workspaces: dict[torch.device, torch.Tensor] = {}

    def check_supported(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
        if device.type != "cuda":
            raise BackendUnavailableError(f"backend 'flashinfer': expected a CUDA device, got {device}")
        if dtype not in SUPPORTED_DTYPES:
            raise BackendUnavailableError(f"backend 'flashinfer': expected dtype in {SUPPORTED_DTYPES}, got {dtype}")
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise BackendUnavailableError(
                f"backend 'flashinfer': expected head_dim in {SUPPORTED_HEAD_DIMS}, got {head_dim}"
            )
        _flashinfer()

    def workspace(self, device: torch.device) -> torch.Tensor:
        """One float workspace per device, shared by every plan (kernels run in stream order)."""
        buf = self._workspaces.get(device)
        if buf is None:
            buf = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            self._workspaces[device] = buf
        return buf

    def plan(self, request: PlanRequest, previous: AttentionPlan | None) -> FlashInferPlan:
        if isinstance(previous, FlashInferPlan) and previous.compatible(request):
            previous.update(request)
            return previous
        return FlashInferPlan(self, request)
