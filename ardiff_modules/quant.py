"""FP8 K/V: per-(layer, K|V, kv-head) static scales, calibrated once, and per-forward query scales.

Granularity. FlashInfer's FP8 FA3 kernels take one float scale per query head and one per K / V
head (``DefaultFP8Attention``: ``scale_q[qo_head] * scale_k[kv_head]`` folds into the softmax scale,
``scale_v[kv_head]`` into the output), constant over all keys of a launch. A forward attends to keys
written by many earlier forwards, so a K/V scale must stay fixed for as long as any page written
with it is resident: scales are **static per (layer, K|V, kv head)**, ``pool.scales [layers, 2,
kv_heads]``. Per-page or per-token scales would need a kernel that reads a scale per key.

Calibration. Unless the user sets scales (:meth:`KVQuantizer.set_scales`, e.g. from a checkpoint),
a layer's scales are set by the first K/V ever written to it: ``amax over its tokens, per head,
* headroom / 448``. The headroom (default 4) lets later chunks be 4x larger than the first one
before anything saturates (values beyond are clamped, never NaN); it costs two binades at the
bottom of e4m3's range (2^-6 .. 448), where values are too small to matter next to the largest
logits. Wan-family models pass q and k through an RMSNorm, which keeps their range stable along
the stream. Calibration is device work (no sync) done once per layer, under a lock, so two threads
cannot calibrate one layer twice and leave pages quantized with a scale that no longer applies.

Queries are not stored: FA3's FP8 path quantizes them per forward with a dynamic per-head scale
(``amax / 448``), which the reference backend does not need (it attends in the compute dtype over
dequantized keys, the semantics the library promises: K/V *stored* in FP8).
"""

from __future__ import annotations

import threading

import torch

#: Largest finite value of ``float8_e4m3fn``.
FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
#: Default factor between the calibrating chunk's amax and the largest representable value.
DEFAULT_HEADROOM = 4.0
# Scales never reach zero: an all-zero first chunk would otherwise divide later chunks by zero.
_MIN_SCALE = 1e-12

QUANTIZED_DTYPES = (torch.float8_e4m3fn,)


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is a storage format that needs scales (FP8)."""
    return dtype in QUANTIZED_DTYPES


def quantize(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, *, clamp: bool = True
) -> torch.Tensor:
    """``x [..., heads, head_dim]`` / ``scale [heads]``, clamped to the format's range, as ``dtype``.

    Three element-wise kernels in ``x``'s own dtype (no float32 copy of a chunk's K/V): multiply by
    the reciprocal scale, clamp, cast. In bf16 the reciprocal is rounded (a per-head bias up to 2^-9
    relative, far below FP8's 2^-4 rounding); every backend and the tests' oracle use this function.
    The clamp matters: torch's cast to ``float8_e4m3fn`` turns out-of-range values into NaN (so +-Inf
    saturates to +-448 * scale; NaN stays NaN).
    """
    limit = torch.finfo(dtype).max
    inverse = scale.float().reciprocal().to(x.dtype)
    scaled = x * inverse[:, None]
    # clamp=False: the caller's scale maps x's amax to the limit (rounding stays below the cast's NaN threshold).
    return (scaled.clamp_(-limit, limit) if clamp else scaled).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x [..., heads, head_dim]`` (FP8) * ``scale [heads]`` as ``dtype``."""
    return (x.float() * scale.float()[:, None]).to(dtype)


def amax_scale(x: torch.Tensor, headroom: float, limit: float = FP8_E4M3_MAX) -> torch.Tensor:
    """Per-head scale ``[heads]`` (float32) that maps ``headroom * amax`` of ``x [tokens, heads, d]`` to ``limit``."""
    amax = torch.linalg.vector_norm(x.detach(), float("inf"), dim=(0, 2)).float()  # one reduction, no |x| copy
    return (amax * (headroom / limit)).clamp_(min=_MIN_SCALE)


def quantize_query(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-head FP8 query for FA3: ``(q8 [tokens, heads, d], scale_q [heads])``, no device sync."""
    scale = amax_scale(q, 1.0)
    return quantize(q, scale, clamp=False), scale


class KVQuantizer:
    """The scales of an FP8 pool and their one-time calibration (one per :class:`~ardiff_modules.pool.KVPool`).

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
        self._calibrated = [False] * scales.shape[0]
        #: Whether any K/V was quantized into the pool (scales can no longer change).
        self.written = False
        self._lock = threading.Lock()

    def calibrated(self, layer: int) -> bool:
        """Whether layer ``layer``'s scales are fixed (set by the user or by its first write)."""
        return self._calibrated[layer]

    @property
    def all_calibrated(self) -> bool:
        return all(self._calibrated)

    def set_scales(self, scales: torch.Tensor) -> None:
        """Fix every layer's scales to ``scales`` ``[num_layers, 2, num_kv_heads]`` (positive, finite).

        Must run before anything is written: pages already quantized with other scales would be read
        back wrong. The caller (``KVCache.set_kv_scales``) checks that and the values.
        """
        with self._lock:
            self.scales.copy_(scales.to(self.scales.device, torch.float32))
            self._calibrated = [True] * len(self._calibrated)

    def calibrate(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Called before ``k``/``v`` ``[tokens, kv_heads, head_dim]`` are quantized into layer ``layer``:
        sets its scales from them if it has none yet (device work, no sync), and marks the pool written."""
        self.written = True
        if not self._calibrated[layer]:
            with self._lock:
                if not self._calibrated[layer]:
                    self.scales[layer, 0].copy_(amax_scale(k, self.headroom))
                    self.scales[layer, 1].copy_(amax_scale(v, self.headroom))
                    self._calibrated[layer] = True

    def quantize_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8 ``k``/``v`` ``[tokens, kv_heads, head_dim]`` for layer ``layer``, calibrating it on first use."""
        self.calibrate(layer, k, v)
        return quantize(k, self.scales[layer, 0], self.dtype), quantize(v, self.scales[layer, 1], self.dtype)

    def layer_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_scale, v_scale)``, each ``[num_kv_heads]`` float32 views of the pool's scales."""
        return self.scales[layer, 0], self.scales[layer, 1]
