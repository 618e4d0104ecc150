"""FlashInfer backend (CUDA): ragged FA3 over contiguous extents, structural paged FA3, masked FA2.

Three kernels, chosen per forward on the host:

* ragged FA3 (the fastest): when every stream's visible pages form one run of consecutive
  page ids -- what contiguous extents give one-chunk forwards -- each stream attends to one
  contiguous token range of the pool, unpaged. Streams whose ranges are not adjacent are
  separated by query-less rows, so one launch still covers them all;
* structural paged FA3: one request per (stream, pending chunk) whose page list is exactly
  its visible pages -- sinks + window + pending chunks ``0..c`` -- with ``causal=False``
  (multi-chunk block-causal forwards, shared pages after forks). No mask memory; only the
  last page of a request could be partial, and since ``page_size`` divides ``chunk_size``
  none is. Under ``pending_attention="bidirectional"`` a stream is one request over all its
  pending chunks (and runs ragged when its pages are one run);
* masked FA2: the same rows with a per-token custom mask (``prepare_forward(token_mask=...)``)
  for masks that are not chunk-structured.

``plan()`` runs once per forward on the host with CPU int32 indptrs (device indptrs would
force a sync inside FlashInfer) and is skipped when the rows' lengths repeat (ragged: nothing
to do; paged: the page table is refreshed in place); every
layer's ``run()`` only appends its K/V and launches the kernel.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from ardiff_modules.backends.base import AttentionBackend, AttentionPlan, PlanRequest, fold_softmax_scale
from ardiff_modules.errors import BackendUnavailableError, TensorMismatchError
from ardiff_modules.layout import RaggedRows, page_token_slots
from ardiff_modules.quant import is_quantized, quantize_query

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
WORKSPACE_BYTES = 128 << 20
LN2 = math.log(2.0)

#: Plan decisions (path chosen and why, FlashInfer ``plan()`` called or skipped) at DEBUG, once per
#: forward from ``prepare_forward``; nothing is logged per layer.
logger = logging.getLogger(__name__)


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
    """Kernel plans of one forward, re-planned in place for later forwards of the same streams.

    Per forward, one of three kernels runs: ragged FA3 over one contiguous key range per stream (contiguous
    extents, one pending chunk), paged FA3 with one request per (stream, pending chunk) otherwise, or paged
    FA2 with a custom mask (``token_mask``). Current K/V go into the pending pages (``append_paged_kv_cache``).
    """

    def __init__(self, backend: FlashInferBackend, request: PlanRequest) -> None:
        self.backend = backend
        self.device = request.device
        self.segment = request.segment
        self.masked = request.token_mask is not None
        self.static = request.static
        layout = request.layout
        #: Whether this plan writes the current K/V: not a history-only plan (the sink segment of relative sinks).
        self.writes = layout.pending_visible
        # One row per (stream, pending chunk), or one per stream under pending_attention="bidirectional".
        self.rows = layout.num_rows
        self.num_qo_heads = request.num_qo_heads
        self.head_dim = request.head_dim
        self.page_size = layout.page_size
        #: FP8 pool: K/V quantized on write; FA3 runs FP8 attention (queries quantized per forward,
        #: per head), the masked FA2 path a 16-bit query over FP8 K/V with the scales folded in.
        self.quantizer = request.quantizer
        self.num_kv_heads = request.num_kv_heads
        # FlashInfer's prefill wrappers (untyped), built on first use by _wrapper().
        self._paged: Any | None = None
        self._ragged: Any | None = None
        self._events: dict[str, torch.cuda.Event] = {}
        self._append_key: tuple[int, int] | None = None
        self._ragged_key: tuple | None = None
        self._paged_key: tuple | None = None
        #: FlashInfer ``plan()`` calls made so far (forwards whose row lengths repeat skip it).
        self.kernel_plans = 0
        self._paged_indices: torch.Tensor | None = None
        self._empty_rows: torch.Tensor | None = None
        #: ``(start, end)`` token slots of the ragged key range (ragged mode).
        self.kv_range = (0, 0)
        self.mode = "paged"
        #: Static plans keep one kernel for the graph captured over them: ragged FA3 over the whole
        #: layer with absolute key offsets when the first forward's keys are contiguous per stream,
        #: paged FA3 otherwise. A later forward that needs the other kernel gets a new plan object
        #: (``compatible`` is false), so ``CUDAGraphStep`` captures again.
        self.static_ragged = self.static and self._ragged_eligible(request)
        if self.static:
            if self.masked:
                raise BackendUnavailableError("static (CUDA-graph) plans with a token_mask are not supported")
            assert request.max_pages is not None
            device = request.device
            # Two rows per stream (a query-less row up to the stream's keys, then the stream's row).
            self._ragged_bufs = dict(
                qo_indptr_buf=torch.zeros(2 * layout.num_streams + 1, dtype=torch.int32, device=device),
                kv_indptr_buf=torch.zeros(2 * layout.num_streams + 1, dtype=torch.int32, device=device),
            )
            self._paged_bufs = dict(
                qo_indptr_buf=torch.zeros(self.rows + 1, dtype=torch.int32, device=device),
                paged_kv_indptr_buf=torch.zeros(self.rows + 1, dtype=torch.int32, device=device),
                paged_kv_indices_buf=torch.zeros(request.max_pages, dtype=torch.int32, device=device),
                paged_kv_last_page_len_buf=torch.zeros(self.rows, dtype=torch.int32, device=device),
            )
            if self.writes:
                self._write_pages = torch.zeros(layout.write_pages.numel(), dtype=torch.int32, device=device)
                self._static_write_slots = torch.zeros(
                    layout.seq_len * layout.num_streams, dtype=torch.int64, device=device
                )
        self._write_slots: torch.Tensor | None = None
        self.update(request)

    def compatible(self, request: PlanRequest) -> bool:
        layout = request.layout
        return (
            request.static == self.static
            and request.segment == self.segment
            and request.layout.pending_visible == self.writes
            and (request.token_mask is not None) == self.masked
            and request.device == self.device
            and request.num_qo_heads == self.num_qo_heads
            and request.quantizer is self.quantizer
            and (not self.static or layout.num_rows == self.rows)
            and (not self.static or self._ragged_eligible(request) == self.static_ragged)
        )

    def _ragged_eligible(self, request: PlanRequest) -> bool:
        """Whether this forward can run ragged FA3: unmasked, and each stream's keys are one contiguous range."""
        if request.token_mask is not None:
            return False
        ragged = request.layout.ragged_rows
        return ragged is not None and (not ragged.gap_rows or self.backend.allow_gap_rows)

    # ------------------------------------------------------------------ planning (host, once per forward)
    def _wrapper(self, kind: str):  # noqa: ANN202
        fi = _flashinfer()
        workspace = self.backend.workspace(self.device, self.segment)
        if kind == "ragged":
            if self._ragged is None:
                # FP8 attention exists only as FA3 (Hopper); "auto" could pick FA2, which has no FP8 path.
                kernel = "fa3" if self.fp8 else "auto"
                if self.static:
                    self._ragged = fi.BatchPrefillWithRaggedKVCacheWrapper(
                        workspace, "NHD", use_cuda_graph=True, backend=kernel, **self._ragged_bufs
                    )
                else:
                    self._ragged = fi.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend=kernel)
            return self._ragged
        if self._paged is None:
            kernel = "fa2" if self.masked else self.backend.paged_backend
            if self.fp8 and not self.masked:
                kernel = "fa3"
            if self.static:
                self._paged = fi.BatchPrefillWithPagedKVCacheWrapper(
                    workspace, "NHD", use_cuda_graph=True, backend=kernel, **self._paged_bufs
                )
            else:
                self._paged = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=kernel)
        return self._paged

    def _before_plan(self, kind: str) -> None:
        # FlashInfer stages each plan through one pinned host buffer per wrapper: wait until the previous
        # plan's copy has left it. Not a device sync: only that copy, issued a whole forward ago.
        event = self._events.get(kind)
        if event is not None:
            event.synchronize()

    def _after_plan(self, kind: str) -> None:
        self.kernel_plans += 1
        event = torch.cuda.Event()
        event.record()
        self._events[kind] = event

    def update(self, request: PlanRequest) -> None:
        """Re-plan for a new forward (host work, no device sync): writes, then the ragged or paged rows."""
        layout = request.layout
        if self.writes:
            self._plan_writes(layout)
        ragged = None
        if (self.static_ragged or not self.static) and self._ragged_eligible(request):
            ragged = layout.ragged_rows
        plans = self.kernel_plans
        if ragged is not None and self.static:
            self._plan_ragged(request, absolute_ragged_rows(ragged, layout.num_streams))
        elif ragged is not None:
            self._plan_ragged(request, ragged)
        else:
            self._plan_paged(request)
        if logger.isEnabledFor(logging.DEBUG):
            self._log_decision(request, ragged, planned=self.kernel_plans != plans)

    def _log_decision(self, request: PlanRequest, ragged: RaggedRows | None, planned: bool) -> None:
        """One DEBUG line per forward: the path, why it was chosen, and whether FlashInfer's plan() ran."""
        layout = request.layout
        if self.mode == "ragged":
            assert ragged is not None
            why = "every stream's visible keys are one contiguous range (contiguous extents)"
            if self.static:
                why += "; static: two fixed rows per stream, absolute key offsets into the whole layer"
            elif ragged.gap_rows:
                why += f", {ragged.gap_rows} query-less gap row(s) between streams"
        elif self.mode == "masked":
            why = "a token_mask was given (FA2 with a custom mask)"
        elif self.static:
            why = "static forward (CUDA-graph replay reads fixed page-table buffers)"
        elif layout.rows_per_stream > 1:
            why = f"{layout.num_chunks} pending chunks per stream (block-causal rows)"
        elif layout.ragged_rows is not None:
            why = "streams' key ranges are not adjacent and allow_gap_rows=False"
        else:
            why = (
                "some stream's visible pages are not one contiguous run, or streams are not in page order "
                "(plain paging, or pages shared after a fork)"
            )
        if planned:
            action = "plan() called (new row lengths)"
        elif self.mode == "ragged":
            action = "plan() skipped (row lengths repeat)"
        else:
            action = "plan() skipped (row lengths repeat; page table refreshed in place)"
        logger.debug(
            "flashinfer plan: %s path for %d stream(s) x %d chunk(s), %d tokens each: %s; %s",
            self.mode, layout.num_streams, layout.num_chunks, layout.seq_len, why, action,
        )

    @property
    def fp8(self) -> bool:
        """Whether the pool stores FP8 K/V (the plan then quantizes on write and runs FP8 kernels)."""
        return self.quantizer is not None

    @property
    def takes_fp8_query(self) -> bool:
        """FA3 over an FP8 pool (ragged or paged: fixed for this plan object, whatever its mode); not the
        masked FA2 path, whose 16-bit query carries the K scales folded in."""
        return self.fp8 and not self.masked

    def _q_dtype(self, request: PlanRequest) -> torch.dtype:
        """FA3 over FP8 K/V needs an FP8 query too; the masked FA2 path keeps the 16-bit query."""
        return request.kv_dtype if self.takes_fp8_query else request.dtype

    def _plan_ragged(self, request: PlanRequest, ragged: RaggedRows) -> None:
        key = (
            tuple(ragged.qo_indptr.tolist()), tuple(ragged.kv_indptr.tolist()),
            request.num_qo_heads, request.num_kv_heads, request.head_dim, request.dtype, request.kv_dtype,
        )
        # NOTE: a ragged plan depends only on the row lengths. Once the windows are full they
        # repeat every forward (each stream's range is its whole extent), so FlashInfer's
        # plan() -- most of the host time of a forward -- is skipped in steady state.
        if key != self._ragged_key:
            wrapper = self._wrapper("ragged")
            self._before_plan("ragged")
            wrapper.plan(
                ragged.qo_indptr, ragged.kv_indptr, request.num_qo_heads, request.num_kv_heads,
                request.head_dim, causal=False, q_data_type=self._q_dtype(request), kv_data_type=request.kv_dtype,
                o_data_type=request.dtype,
            )
            self._after_plan("ragged")
            self._ragged_key = key
            self._paged_key = None  # the ragged plan may reuse the workspace: re-plan paged next time
        self.mode = "ragged"
        self.kv_range = (ragged.kv_start, ragged.kv_end)

    def _plan_paged(self, request: PlanRequest) -> None:
        layout = request.layout
        self._ragged_key = None  # the paged wrapper may reuse the workspace: re-plan ragged next time
        rows = layout.structural_rows
        host_indices = _pinned(rows.kv_page_indices)
        wrapper = self._wrapper("paged")
        key = None
        if not self.masked:
            key = (
                tuple(rows.qo_indptr.tolist()), tuple(rows.kv_page_indptr.tolist()),
                tuple(rows.kv_last_page_len.tolist()), request.num_qo_heads, request.num_kv_heads,
                request.head_dim, request.dtype, request.kv_dtype, layout.page_size,
            )
        if key is not None and key == self._paged_key:
            # FlashInfer's schedule depends on the row lengths only; once the windows are full they
            # repeat and only the page ids move, so refresh the page table the kernel reads in place
            # (stream-ordered after the previous forward's launches) instead of calling plan().
            paged_indices = self._paged_indices
            assert paged_indices is not None  # set by the plan() that recorded _paged_key
            paged_indices[: host_indices.numel()].copy_(host_indices, non_blocking=True)
            self.mode = "paged"
            return
        indices = host_indices.to(self.device, non_blocking=True)
        custom_mask = None
        if request.token_mask is not None:
            dense = layout.to_dense().to(self.device) & request.token_mask.to(self.device)
            custom_mask = _row_masks(layout, dense)
            # Queries that see no key get zeros (the backends' contract), whatever FA2 leaves there.
            self._empty_rows = ~dense.any(dim=-1).reshape(-1, 1, 1)
        self._before_plan("paged")
        wrapper.plan(
            rows.qo_indptr, rows.kv_page_indptr, indices, rows.kv_last_page_len,
            request.num_qo_heads, request.num_kv_heads, request.head_dim, layout.page_size,
            custom_mask=custom_mask, non_blocking=True, causal=False, q_data_type=self._q_dtype(request),
            kv_data_type=request.kv_dtype, o_data_type=request.dtype,
        )
        self._after_plan("paged")
        self._paged_indices = self._paged_bufs["paged_kv_indices_buf"] if self.static else indices
        self._paged_key = key if reads_page_table(wrapper, self._paged_indices) else None
        self.mode = "masked" if self.masked else "paged"

    def _plan_writes(self, layout) -> None:  # noqa: ANN001
        """Metadata of ``append_paged_kv_cache``: each stream's pending pages as a page table."""
        streams, tokens = layout.num_streams, layout.seq_len
        pages_per_stream = tokens // layout.page_size
        if self._append_key != (streams, tokens):  # constant for a given batch shape: built once
            dev = self.device
            self._append_batch = torch.arange(streams, dtype=torch.int32, device=dev).repeat_interleave(tokens)
            self._append_pos = torch.arange(tokens, dtype=torch.int32, device=dev).repeat(streams)
            self._append_indptr = torch.arange(streams + 1, dtype=torch.int32, device=dev) * pages_per_stream
            self._append_last = torch.full((streams,), layout.page_size, dtype=torch.int32, device=dev)
            self._append_key = (streams, tokens)
        pages = _pinned(layout.write_pages.to(torch.int32))
        if self.static:
            self._write_pages.copy_(pages, non_blocking=True)
            # A captured compiled graph reads the slots from this buffer: refresh it every forward
            # (device work from the page ids already sent, no second host copy).
            self._write_slots = page_token_slots(self._write_pages, layout.page_size, out=self._static_write_slots)
        else:
            self._write_pages = pages.to(self.device, non_blocking=True)
            self._write_slots = None  # derived on first use: only compiled graphs read it

    @property
    def write_slots(self) -> torch.Tensor:
        """int64 ``[num_streams * seq_len]`` token slots of this forward's current tokens, on the device.

        Read by the compiled write path's gate op (``ops.kv_write_slots_op``), once per layer; eager
        forwards write with ``append_paged_kv_cache`` and never pay for it.
        """
        assert self.writes, "a history-only plan writes nothing (its forward's other plan does)"
        if self._write_slots is None:
            self._write_slots = page_token_slots(self._write_pages, self.page_size)
        return self._write_slots

    def __repr__(self) -> str:
        return (
            f"FlashInferPlan(mode={self.mode!r}, rows={self.rows}, static={self.static}, "
            f"kernel_plans={self.kernel_plans})"
        )

    # ------------------------------------------------------------------ per layer
    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        return_lse: bool = False,
        *,
        layer: int = 0,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # Compiled graphs may hand the op strided inputs; FlashInfer's kernels want dense rows.
        if self.quantizer is not None:
            k, v = self.quantizer.quantize_layer(layer, k, v)
        self._check_heads(q)
        self.write(k.contiguous(), v.contiguous(), k_cache, v_cache)
        return self.attend(q, k_cache, v_cache, scale, return_lse, layer=layer)

    def merge(
        self, out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One FlashInfer ``merge_state`` kernel (it works in base-2 LSE, like its attention kernels)
        instead of the torch merge's several passes; a ``-inf`` LSE (a discarded segment) weighs 0."""
        out, lse = _flashinfer().merge_state(
            out_a.contiguous(), (lse_a / LN2).contiguous(), out_b.contiguous(), (lse_b / LN2).contiguous()
        )
        lse = lse * LN2
        if self.masked:  # a query a token_mask leaves with no key in either segment: merge_state gives NaN
            empty = torch.isneginf(lse_a) & torch.isneginf(lse_b)
            out = out.masked_fill(empty[..., None], 0)
            lse = lse.masked_fill(empty, float("-inf"))
        return out, lse

    def _check_heads(self, q: torch.Tensor) -> None:
        if q.shape[1] != self.num_qo_heads:
            raise TensorMismatchError(
                f"flashinfer plan was built for num_qo_heads={self.num_qo_heads} (KVCacheSpec.num_qo_heads), "
                f"got q with {q.shape[1]} heads"
            )

    def write(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Append the current ``[tokens, kv_heads, head_dim]`` K/V into this forward's pending pages."""
        assert self.writes, "a history-only plan writes nothing (its forward's other plan does)"
        _flashinfer().append_paged_kv_cache(
            k, v, self._append_batch, self._append_pos, (k_cache, v_cache),
            self._write_pages, self._append_indptr, self._append_last,
        )

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        return_lse: bool = False,
        *,
        layer: int = 0,
        q_scale: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The attention kernel alone over one layer's pages (K/V already written); see :meth:`run`.

        ``q_scale`` (float32 ``[heads]``): ``q`` is already the FP8 query of an FA3 plan over an FP8 pool
        (:attr:`takes_fp8_query`; a compiled graph quantized it, ``ops.paged_attention_fp8_op``), so only the
        kernel runs; without it an FP8 plan quantizes ``q`` here.
        """
        self._check_heads(q)  # also here: compiled graphs call attend() directly (ops.paged_attention_op)
        q, extra, v_head_scale = _kernel_query(self, q.contiguous(), scale, layer, q_scale)
        if self.mode == "ragged":
            start, end = self.kv_range
            k_slots = k_cache.view(-1, k_cache.shape[-2], k_cache.shape[-1])
            v_slots = v_cache.view(-1, v_cache.shape[-2], v_cache.shape[-1])
            if not self.static:  # static rows hold absolute offsets: the graph keeps the layer's base pointer
                k_slots, v_slots = k_slots[start:end], v_slots[start:end]
            assert self._ragged is not None  # built by _plan_ragged() (mode "ragged")
            result = self._ragged.run(q, k_slots, v_slots, *extra, return_lse=return_lse)
        else:
            assert self._paged is not None  # built by _plan_paged() (modes "paged" / "masked")
            result = self._paged.run(q, (k_cache, v_cache), *extra, return_lse=return_lse)
        out, lse = result if return_lse else (result, None)
        if v_head_scale is not None:
            out = (out * v_head_scale).to(out.dtype)
        empty_rows = None
        if self.mode == "masked":
            empty_rows = self._empty_rows
            assert empty_rows is not None  # set by _plan_paged() for every masked plan
            out = out.masked_fill(empty_rows, 0)
        if lse is None:
            return out
        # FlashInfer's kernels keep the LSE in base 2 (log2 of the sum of 2^(log2(e) * logit)).
        lse = lse.float() * LN2
        if empty_rows is not None:
            lse = lse.masked_fill(empty_rows[:, :, 0], float("-inf"))
        return out, lse


def _kernel_query(
    plan: FlashInferPlan, q: torch.Tensor, scale: float, layer: int, q_scale: torch.Tensor | None
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor | None]:
    """The query ``plan``'s kernel takes, its extra scale arguments and the per-head output scale (masked FP8).

    ``q`` ``[tokens, heads, head_dim]``; with ``q_scale`` it is already FP8 (quantized by the caller, the
    custom softmax scale folded in before), else it is folded and, on FA3 over an FP8 pool, quantized here.
    """
    quantizer = plan.quantizer
    if q_scale is not None:
        default = math.isclose(scale, plan.head_dim**-0.5, rel_tol=1e-6)
        if quantizer is None or not plan.takes_fp8_query or not default:
            raise TensorMismatchError(
                f"flashinfer attend: expected q_scale only for an FA3 plan over an FP8 pool with the default "
                f"softmax scale (folded into q before quantizing), got {plan!r} with scale {scale}"
            )
        return q, (q_scale, *quantizer.layer_scales(layer)), None  # FA3's DefaultFP8Attention: per-head scales
    # Plans use FlashInfer's default 1/sqrt(d); a custom scale folds into q (its q_scale argument means
    # different things on different kernel paths).
    q = fold_softmax_scale(q, scale)
    if quantizer is None:
        return q, (), None
    k_scale, v_scale = quantizer.layer_scales(layer)
    if plan.mode == "masked":
        # FA2: a 16-bit query over raw FP8 K/V. Per-head scales fold in exactly:
        # softmax(q . (s_k k8)) = softmax((s_k q) . k8) and sum p (s_v v8) = s_v sum p v8.
        group = plan.num_qo_heads // plan.num_kv_heads
        q = (q * k_scale.repeat_interleave(group)[:, None]).to(q.dtype)
        return q, (), v_scale.repeat_interleave(group)[:, None]
    q8, q_scale = quantize_query(q)
    return q8, (q_scale, k_scale, v_scale), None


#: FlashInfer versions whose paged prefill wrapper was checked to (a) keep reading, at run time, the very
#: ``paged_kv_indices`` tensor handed to ``plan()`` (eager) or its ``paged_kv_indices_buf`` (CUDA graphs),
#: in the private field ``_paged_kv_indices_buf``, and (b) schedule from the indptrs alone, never the
#: page ids. ``tests/gpu/test_flashinfer.py::test_flashinfer_reads_the_page_table_it_was_planned_with`` checks both;
#: a version outside this list simply re-plans every forward (correct, ~0.5 ms slower).
PLAN_SKIP_VERSIONS = ("0.7.2.post1",)


def reads_page_table(wrapper, indices: torch.Tensor) -> bool:  # noqa: ANN001
    """Whether refreshing ``indices`` in place re-targets ``wrapper``'s next ``run()`` without ``plan()``.

    The one place this backend relies on a FlashInfer private field (see :data:`PLAN_SKIP_VERSIONS`).
    """
    if _flashinfer().__version__ not in PLAN_SKIP_VERSIONS:
        return False
    return getattr(wrapper, "_paged_kv_indices_buf", None) is indices


def absolute_ragged_rows(ragged: RaggedRows, num_streams: int) -> RaggedRows:
    """``ragged`` as exactly two rows per stream over the whole layer's slots, for CUDA graphs.

    Row ``2 s`` has no queries and spans the keys between stream ``s - 1``'s range and stream
    ``s``'s (possibly none); row ``2 s + 1`` is stream ``s``. Offsets are absolute slots, so the
    kernel's key pointer is the layer's first slot in every forward and the row count never
    changes: what a captured graph needs. Query-less rows cost nothing (no query tiles).
    """
    qo_rel, kv_rel = ragged.qo_indptr.tolist(), ragged.kv_indptr.tolist()
    qo, kv = [0], [0]
    for row in range(len(qo_rel) - 1):
        queries = qo_rel[row + 1] - qo_rel[row]
        if queries == 0:
            continue  # a relative gap row: the fixed gap row before the next stream covers it
        start, end = ragged.kv_start + kv_rel[row], ragged.kv_start + kv_rel[row + 1]
        qo += [qo[-1], qo[-1] + queries]
        kv += [start, end]
    assert len(qo) == 2 * num_streams + 1, f"expected one ragged row per stream, got {(len(qo) - 1) // 2}"
    return RaggedRows(
        qo_indptr=torch.tensor(qo, dtype=torch.int32),
        kv_indptr=torch.tensor(kv, dtype=torch.int32),
        kv_start=0,
        kv_end=kv[-1],
        gap_rows=num_streams,
    )


def _row_masks(layout, dense: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """Flatten the combined mask per structural row: ``[row queries, row keys]`` row-major, concatenated
    (``layout.row_spans``: one row per (stream, chunk), or per stream under the bidirectional rule)."""
    return torch.cat([dense[s, first:end, :keys].reshape(-1) for s, first, end, keys in layout.row_spans])


class FlashInferBackend(AttentionBackend):
    """Paged FlashInfer attention; FA3 on Hopper (``paged_backend="auto"``), FA2 for masks.

    Parameters
    ----------
    paged_backend:
        FlashInfer kernel family for unmasked paged plans: ``"auto"`` (FA3 on sm90), ``"fa3"`` or ``"fa2"``.
    allow_gap_rows:
        Let one ragged launch cover streams whose key ranges are not adjacent.
    """

    name = "flashinfer"

    def __init__(self, paged_backend: str = "auto", *, allow_gap_rows: bool = True) -> None:
        if paged_backend not in ("auto", "fa2", "fa3"):
            raise BackendUnavailableError(f"paged_backend: expected 'auto', 'fa2' or 'fa3', got {paged_backend!r}")
        self.paged_backend = paged_backend
        #: Run ragged even when streams' key ranges are not adjacent (query-less rows skip the gaps).
        self.allow_gap_rows = allow_gap_rows
        self._workspaces: dict[tuple[torch.device, str], torch.Tensor] = {}

    def check_supported(
        self, device: torch.device, dtype: torch.dtype, head_dim: int, kv_dtype: torch.dtype | None = None
    ) -> None:
        unsupported = self.unsupported(device, dtype, head_dim, kv_dtype)
        if unsupported is not None:
            raise BackendUnavailableError(f"backend 'flashinfer': {unsupported[0]}")

    def unsupported(
        self, device: torch.device, dtype: torch.dtype, head_dim: int, kv_dtype: torch.dtype | None = None
    ) -> tuple[str, str] | None:
        """``None`` if this backend can run these shapes, else ``(why not, how to fix it)``."""
        if device.type != "cuda":
            return f"expected a CUDA device, got {device}", "put the KVCache on a CUDA device"
        if dtype not in SUPPORTED_DTYPES:
            return (
                f"expected dtype in {SUPPORTED_DTYPES}, got {dtype}",
                "use KVCacheSpec(dtype='bfloat16') or 'float16' (and the model in that dtype)",
            )
        if kv_dtype is not None and kv_dtype != dtype and not is_quantized(kv_dtype):
            return (
                f"expected kv_dtype equal to dtype={dtype} or float8_e4m3fn (FP8 attention), got {kv_dtype}",
                "leave KVCacheSpec.kv_dtype unset (it defaults to dtype) or use 'float8_e4m3fn'",
            )
        if head_dim not in SUPPORTED_HEAD_DIMS:
            return (
                f"expected head_dim in {SUPPORTED_HEAD_DIMS}, got {head_dim}",
                f"use a model whose head_dim is one of {SUPPORTED_HEAD_DIMS}",
            )
        try:
            _flashinfer()
        except BackendUnavailableError as exc:
            return (
                str(exc).removeprefix("backend 'flashinfer': "),
                "reinstall FlashInfer for this torch / CUDA (pip install 'ardiff_modules[flashinfer]')",
            )
        return None

    def workspace(self, device: torch.device, segment: str = "main") -> torch.Tensor:
        """One float workspace per device and key segment, shared by the plans of that segment (kernels run
        in stream order); the sink segment of relative-position sinks gets its own, so its kernels never
        share scratch with the main segment's within a layer."""
        buf = self._workspaces.get((device, segment))
        if buf is None:
            buf = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            self._workspaces[(device, segment)] = buf
        return buf

    def plan(self, request: PlanRequest, previous: AttentionPlan | None) -> FlashInferPlan:
        if isinstance(previous, FlashInferPlan) and previous.compatible(request):
            previous.update(request)
            return previous
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "flashinfer plan: new plan object (%s): static=%s, token_mask=%s, %d query heads",
                "first forward of these streams" if previous is None else "the previous plan does not fit",
                request.static, request.token_mask is not None, request.num_qo_heads,
            )
        return FlashInferPlan(self, request)

    def __repr__(self) -> str:
        return f"FlashInferBackend(paged_backend={self.paged_backend!r}, allow_gap_rows={self.allow_gap_rows})"
