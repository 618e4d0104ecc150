"""FP8 K/V: per-(layer, K|V, kv-head) static scales, calibrated once, and per-forward query scales.

Granularity. FlashInfer's FP8 FA3 kernels take one float scale per query head and one per K / V
head (``DefaultFP8Attention``: ``scale_q[qo_head] * scale_k[kv_head]`` folds into the softmax scale,
``scale_v[kv_head]`` into the output), constant over all keys of a launch. A forward attends to keys
written by many earlier forwards, so a K/V scale must stay fixed for as long as any page written
with it is resident: scales are **static per (layer, K|V, kv head)**, ``pool.scales [layers, 2,
kv_heads]``. Per-page or per-token scales would need a kernel that reads a scale per key.

Calibration. Unless the user sets scales (:meth:`KVQuantizer.set_scales`, e.g. from a checkpoint),
a layer's scales come from the K/V of the first forward that writes it: ``amax over its finite
values, per head, * headroom / 448`` (NaN/Inf are ignored). They are *provisional* until a forward
that wrote with them **commits**, which fixes them for the life of the pool; if every forward that
wrote with them finishes otherwise (abort, a denoising forward that completes or is superseded --
its pending pages are rewritten before anyone reads them), the layer is uncalibrated again and the
next write calibrates it afresh. So a poisoned or aborted forward never fixes a scale. The fixing
commit checks the scales once (one device sync, at most once per layer in the pool's life): a head
with no finite nonzero value (e.g. an all-zero first chunk, whose scale would collapse every later
chunk of that head) refuses the commit with :class:`~ardiff_modules.errors.KVCalibrationError`
(the forward is aborted; call ``KVCache.set_kv_scales`` or commit a representative chunk first).
The headroom (default 4) lets later chunks be 4x larger than the calibrating one before anything
saturates (finite values beyond are clamped); it costs two binades at the bottom of e4m3's range
(2^-6 .. 448), where values are too small to matter next to the largest logits. Wan-family models
pass q and k through an RMSNorm, which keeps their range stable along the stream. Calibration is
device work (no sync), under a lock, so two threads cannot calibrate one layer twice.

Non-finite values. NaN stays NaN when quantized and +-Inf becomes NaN too (not a saturated +-448):
a non-finite K/V reads back non-finite, as in a float pool, and ``check_finite`` sees it.

Queries are not stored: FA3's FP8 path quantizes them per forward with a dynamic per-head scale
(``amax / 448``), which the reference backend does not need (it attends in the compute dtype over
dequantized keys, the semantics the library promises: K/V *stored* in FP8).
"""

from __future__ import annotations

import threading
from typing import Literal, Protocol

import torch

from ardiff_modules.errors import KVCalibrationError, SpecError

#: Largest finite value of ``float8_e4m3fn``.
FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
#: Default factor between the calibrating chunk's amax and the largest representable value.
DEFAULT_HEADROOM = 4.0
# Scales never reach zero: an all-zero chunk would otherwise divide by zero (and a scale this small is
# refused at the commit that would fix it: see ``KVQuantizer.check_commit``).
_MIN_SCALE = 1e-12
#: A calibrated scale at (or, by float32 rounding, just above) the floor: the head had no finite nonzero value.
_DEGENERATE_SCALE = _MIN_SCALE * 1.5

QUANTIZED_DTYPES = (torch.float8_e4m3fn,)


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is a storage format that needs scales (FP8)."""
    return dtype in QUANTIZED_DTYPES


def quantize(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, *, clamp: bool = True
) -> torch.Tensor:
    """``x [..., heads, head_dim]`` / ``scale [heads]``, clamped to the format's range, as ``dtype``.

    Four element-wise kernels in ``x``'s own dtype (no float32 copy of a chunk's K/V; fused when
    compiled): multiply by the reciprocal scale, +-Inf to NaN, clamp, cast. In bf16 the reciprocal is
    rounded (a per-head bias up to 2^-9 relative, far below FP8's 2^-4 rounding); every backend and the
    tests' oracle use this function. The clamp matters: torch's cast to ``float8_e4m3fn`` turns
    out-of-range finite values into NaN, the clamp saturates them to +-448 * scale; NaN and +-Inf are
    stored as NaN.
    """
    limit = torch.finfo(dtype).max
    inverse = scale.float().reciprocal().to(x.dtype)
    scaled = x * inverse[:, None]
    if not clamp:  # the caller's scale maps x's amax to the limit (rounding stays below the cast's NaN threshold)
        return scaled.to(dtype)
    # NOTE: +-Inf -> NaN before the clamp, which would saturate it to a finite +-448: a stored Inf must read
    # back non-finite (check_finite must see it), as it would in a float pool.
    nan = float("nan")
    return torch.nan_to_num(scaled, nan=nan, posinf=nan, neginf=nan).clamp_(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x [..., heads, head_dim]`` (FP8) * ``scale [heads]`` as ``dtype``."""
    return (x.float() * scale.float()[:, None]).to(dtype)


def amax_scale(x: torch.Tensor, headroom: float, limit: float = FP8_E4M3_MAX) -> torch.Tensor:
    """Per-head scale ``[heads]`` (float32) that maps ``headroom * amax`` of ``x [tokens, heads, d]`` to ``limit``.

    Two reductions: per ``(token, head)`` row, then per head over the rows. NOTE: as one reduction over
    dims (0, 2), a compiled graph reduced each head in one thread block, fused with the query's FP8 cast
    (H100, Forcing-KV's method: ~240 us a lane launch, 57 ms of a 288 ms chunk step); the per-row pass
    keeps every SM busy and the second pass reads ``tokens x heads`` values. Max is exact in any order,
    so the scale is bit-identical.
    """
    rows = torch.linalg.vector_norm(x.detach(), float("inf"), dim=-1)  # [tokens, heads], no |x| copy
    amax = torch.linalg.vector_norm(rows, float("inf"), dim=0).float()
    return (amax * (headroom / limit)).clamp_(min=_MIN_SCALE)


def finite_amax_scale(x: torch.Tensor, headroom: float, limit: float = FP8_E4M3_MAX) -> torch.Tensor:
    """:func:`amax_scale` over the finite values of ``x`` only (NaN/Inf count as 0): what calibration uses."""
    x = x.detach()
    finite = torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return amax_scale(finite, headroom, limit)


def quantize_query(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-head FP8 query for FA3: ``(q8 [tokens, heads, d], scale_q [heads])``, no device sync."""
    scale = amax_scale(q, 1.0)
    return quantize(q, scale, clamp=False), scale


class Writer(Protocol):
    """A forward that writes K/V (``ForwardTransaction``): its outcome fixes or undoes a calibration."""

    on_close: list

    @property
    def status(self) -> str: ...  # read-only here: a forward's status is one of its own Literal values


#: Per layer: ``"open"`` (no scales yet), ``"provisional"`` (set by writes of forwards not yet finished),
#: ``"fixed"`` (set by the user, or by a committed forward).
LayerState = Literal["open", "provisional", "fixed"]


class KVQuantizer:
    """The scales of an FP8 pool and their calibration (one per :class:`~ardiff_modules.pool.KVPool`).

    Parameters
    ----------
    scales:
        The pool's ``[num_layers, 2 (K, V), num_kv_heads]`` float32 tensor (updated in place, so CUDA
        graphs and plans that hold it see calibrated values).
    dtype:
        The storage dtype (``torch.float8_e4m3fn``).
    headroom:
        See the module docstring.
    """

    def __init__(self, scales: torch.Tensor, dtype: torch.dtype, headroom: float = DEFAULT_HEADROOM) -> None:
        self.scales = scales
        self.dtype = dtype
        self.headroom = float(headroom)
        self._state: list[LayerState] = ["open"] * scales.shape[0]
        #: Per layer, the unfinished forwards that wrote it with its current scales (id -> forward).
        self._writers: list[dict[int, Writer]] = [{} for _ in range(scales.shape[0])]
        #: Every unfinished forward in ``_writers`` (each told us once, through ``on_close``, when it finishes).
        self._registered: dict[int, Writer] = {}
        #: Whether K/V quantized with the current scales may still be held (committed, or pending pages kept
        #: by a denoising forward over fixed scales): the scales can no longer change then.
        self._kept = False
        self._lock = threading.Lock()

    def calibrated(self, layer: int) -> bool:
        """Whether layer ``layer`` has scales (provisional or fixed); a write of an uncalibrated layer sets them."""
        return self._state[layer] != "open"

    def state(self, layer: int) -> LayerState:
        """``"open"``, ``"provisional"`` or ``"fixed"`` (see the module docstring)."""
        return self._state[layer]

    @property
    def all_calibrated(self) -> bool:
        return all(state == "fixed" for state in self._state)

    @property
    def written(self) -> bool:
        """Whether the pool may hold K/V quantized with the current scales (``set_kv_scales`` is refused then)."""
        return self._kept or bool(self._registered)

    def set_scales(self, scales: torch.Tensor) -> None:
        """Fix every layer's scales to ``scales`` ``[num_layers, 2, num_kv_heads]`` (positive, finite).

        Must run before anything is written: pages already quantized with other scales would be read
        back wrong. The caller (``KVCache.set_kv_scales``) checks that and the values.
        """
        with self._lock:
            self.scales.copy_(scales.to(self.scales.device, torch.float32))
            self._state = ["fixed"] * len(self._state)

    def adopt_scales(self, scales: torch.Tensor) -> None:
        """Fix every layer's scales to ``scales`` and hold them: pages quantized with them were just loaded
        (``KVCache.load_sessions``), so a later ``set_kv_scales`` must be refused."""
        self.set_scales(scales)
        with self._lock:
            self._kept = True

    def calibrate(self, layer: int, k: torch.Tensor, v: torch.Tensor, writer: Writer | None = None) -> None:
        """Called before ``k``/``v`` ``[tokens, kv_heads, head_dim]`` are quantized into layer ``layer`` by
        ``writer`` (the open forward): sets the layer's scales from their finite values if it has none
        (device work, no sync) and records ``writer``, whose commit fixes them. ``writer=None`` (a plan
        run outside any forward) fixes them at once."""
        if self._kept and self._state[layer] == "fixed":
            return  # the steady state once something committed: nothing to set or record
        with self._lock:
            if self._state[layer] == "open":
                if k.is_cuda and torch.cuda.is_current_stream_capturing():
                    # NOTE: the scales would be computed inside the graph, i.e. again from every replay's K/V
                    raise SpecError(
                        f"FP8 calibration: expected layer {layer}'s scales to exist before a CUDA-graph capture, got "
                        "an uncalibrated layer; warm the step up first (CUDAGraphStep(warmup_iters >= 1)) or call "
                        "KVCache.set_kv_scales"
                    )
                self.scales[layer, 0].copy_(finite_amax_scale(k, self.headroom))
                self.scales[layer, 1].copy_(finite_amax_scale(v, self.headroom))
                self._state[layer] = "provisional" if writer is not None else "fixed"
            if writer is None:
                self._kept = self._kept or self._state[layer] == "fixed"
                return
            self._record(layer, writer)

    def note_writes(self, layers: frozenset[int] | set[int], writer: Writer) -> None:
        """Record ``writer`` for ``layers`` written without Python running per layer (a CUDA-graph replay);
        their scales must exist (:meth:`calibrated`): a replay cannot calibrate."""
        if self._kept and all(self._state[layer] == "fixed" for layer in layers):
            return
        with self._lock:
            for layer in layers:
                if self._state[layer] == "open":  # CUDAGraphStep captures again first (graphs._stale)
                    raise SpecError(
                        f"FP8: expected layer {layer}'s scales before replaying a graph that writes it, got none"
                    )
                self._record(layer, writer)

    def _record(self, layer: int, writer: Writer) -> None:
        """``writer`` wrote ``layer`` with its current scales (under the lock); told once when it finishes."""
        if writer.status != "open":
            return  # finished meanwhile (another thread): its listener ran already, nothing of it is kept
        if id(writer) not in self._registered:
            self._registered[id(writer)] = writer
            writer.on_close.append(self._finished)
        self._writers[layer][id(writer)] = writer

    def check_commit(self, writer: Writer) -> None:
        """Before ``writer`` commits: refuse (:class:`KVCalibrationError`) if the scales it would fix hold a
        head with no finite nonzero value. One device sync, only when this commit fixes some layer."""
        layers = [i for i, w in enumerate(self._writers) if id(writer) in w and self._state[i] == "provisional"]
        if not layers:
            return
        floor = self.scales[layers].flatten(1).min(dim=1).values.tolist()  # the one sync
        bad = [layer for layer, low in zip(layers, floor) if low <= _DEGENERATE_SCALE]
        if bad:
            heads = (self.scales[bad] <= _DEGENERATE_SCALE).nonzero().tolist()
            named = ", ".join(f"layer {bad[i]} {'KV'[kv]} head {h}" for i, kv, h in heads[:6])
            more = f" (+{len(heads) - 6} more)" if len(heads) > 6 else ""
            raise KVCalibrationError(
                f"FP8 calibration: expected finite nonzero K/V in every head of the first committed forward of "
                f"each layer, got none in {named}{more}: a scale from it would collapse every later value of that "
                "head. The forward was aborted; call KVCache.set_kv_scales(...) with known scales, or first commit "
                "a representative chunk"
            )

    def _finished(self, writer: Writer) -> None:
        """``writer`` finished: its commit fixes the scales it wrote with; any other outcome lets go of them."""
        with self._lock:
            self._registered.pop(id(writer), None)
            committed = writer.status == "committed"
            kept = committed
            for layer, writers in enumerate(self._writers):
                if writers.pop(id(writer), None) is None:
                    continue
                if committed and self._state[layer] == "provisional":
                    self._state[layer] = "fixed"
                elif self._state[layer] == "provisional" and not writers:
                    self._state[layer] = "open"  # nothing written with these scales survives: calibrate afresh
                # pending pages kept by a denoising forward over fixed scales: those scales must stay
                kept = kept or (writer.status in ("completed", "superseded") and self._state[layer] == "fixed")
            self._kept = self._kept or kept

    def quantize_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8 ``k``/``v`` ``[tokens, kv_heads, head_dim]`` for layer ``layer`` (calibrating an uncalibrated
        layer from them first: a plan run outside any forward)."""
        if self._state[layer] == "open":
            self.calibrate(layer, k, v)
        return quantize(k, self.scales[layer, 0], self.dtype), quantize(v, self.scales[layer, 1], self.dtype)

    def layer_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_scale, v_scale)``, each ``[num_kv_heads]`` float32 views of the pool's scales."""
        return self.scales[layer, 0], self.scales[layer, 1]

