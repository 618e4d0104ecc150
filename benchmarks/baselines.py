"""The peers' baselines, in one place: what the benchmarks time this library against.

**The rolling buffer of Self-Forcing / LongLive** (``end_to_end``'s ``rolling_*`` variants, ``attention``'s
``rolling_memmove`` write). Per layer one contiguous K and one V buffer ``[streams, (sink + window + 1) *
chunk, heads, dim]``; before the first forward of a new chunk, once the buffer is full, the window is
shifted left by one chunk with a memmove (:func:`roll_window`: ``buf[:, s:-C].copy_(buf[:, s+C:].clone())``);
every forward writes its K/V into the slot after the resident chunks and attends over the prefix
``buf[:, :resident * C + C]``. (The peers also call ``.item()`` on device indices each layer; this
baseline keeps its indices on the host, which only favours it.)

* :class:`RollingKVCache` (with :class:`RollingForward` / :class:`RollingLayer`, the ``LayerContext``
  surface the blocks read) holds the buffers of a model; :func:`swapped_attention` swaps every block's
  ``attn`` for a :class:`RollingSelfAttention` that reuses its projections, norms and RoPE;
  :class:`RollingRunner` drives a chunk step over them (``end_to_end``'s runner interface).
* :class:`RaggedFA3Attend` / :func:`sdpa_attend` / :func:`make_flex_attend`: the attention over that prefix,
  in the peers' ``[streams, tokens, heads, dim]`` layout, with FlashInfer's ragged FA3 (the stand-in for
  ``flash_attn_interface``, what Self-Forcing runs on Hopper: the honest peer), SDPA or ``flex_attention``
  (no mask: the prefix holds exactly the visible keys). :func:`fa3_unavailable_reason` says why FA3
  cannot run here (no CUDA, no FlashInfer, not Hopper, not half precision).
* :func:`rolling_memmove`: one layer's write of that buffer, timed beside the library's writes.

**The contiguous limits** (``attention``): every stream's visible keys held contiguous, attended by
FlashInfer's ragged FA3 (bf16, and FP8 with q/k/v already quantized), torch SDPA and compiled
FlexAttention over a whole timeline with a sink + window block mask (:func:`contiguous_attention`,
:func:`flex_sink_window`).

Imports torch (the buffers and the attention wrapper are modules and tensors): import it where a
benchmark runs, not where its ``--help`` is printed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ardiff_modules as am
from ardiff_modules.models.wan_causal_dit import TEXT, WanConfig
from ardiff_modules.modules.functional import apply_rope


# --------------------------------------------------------------------------------- the rolling buffer
def roll_window(buf: torch.Tensor, keep: int, chunk: int) -> None:
    """Evict the oldest window chunk of ``buf`` ``[streams, tokens, ...]``: memmove the window (everything
    after the first ``keep`` sink tokens) left by ``chunk`` tokens, as the peers do."""
    buf[:, keep:-chunk].copy_(buf[:, keep + chunk :].clone())


class RollingForward:
    """The baseline's per-forward context: what the blocks read from ``kv.forward`` (``positions``)."""

    def __init__(self, chunk_size: int, sink_chunks: int) -> None:
        self.chunk_size = chunk_size
        self.sink_tokens = sink_chunks * chunk_size
        self.positions = torch.empty(0, dtype=torch.int64)  #: [streams, seq] absolute token positions
        self.roll = False  #: shift the window left by one chunk before writing (first forward of a chunk)
        self.slot = 0  #: chunk slot the current chunk's K/V go to


class RollingLayer:
    """One layer's contiguous K / V buffers and cross K / V (the ``LayerContext`` surface the blocks use)."""

    def __init__(self, forward: RollingForward, k: torch.Tensor, v: torch.Tensor,
                 cross: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.forward, self.k, self.v, self.cross = forward, k, v, cross

    @property
    def positions(self) -> torch.Tensor:
        return self.forward.positions

    def cross_kv(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cross[name]

    def write(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Roll if due, write the current chunk's K/V, return the visible prefix (Self-Forcing style)."""
        f = self.forward
        c, n = f.chunk_size, k.shape[1]
        if f.roll:  # evict the oldest window chunk: memmove the rest of the window left by one chunk
            for buf in (self.k, self.v):
                roll_window(buf, f.sink_tokens, c)
        start = f.slot * c
        self.k[:, start : start + n].copy_(k)
        self.v[:, start : start + n].copy_(v)
        return self.k[:, : start + n], self.v[:, : start + n]


class RollingKVCache:
    """Per-layer contiguous buffers of ``sink + window + 1`` chunks for ``streams`` streams, rolled by memmove.

    ``begin_forward`` / ``end_forward`` keep the bookkeeping on the host: the buffer holds ``filled``
    committed chunks (sinks first, then the window oldest first); the current chunk goes to slot
    ``filled``; when a new chunk starts with all ``sink + window + 1`` slots committed, the layers
    roll during that forward.
    """

    def __init__(self, model: nn.Module, config: WanConfig, branches_text: Sequence[torch.Tensor],
                 device: torch.device, dtype: torch.dtype) -> None:
        c = config
        self.chunk = c.chunk_size
        self.slots = c.sink_chunks + c.window_chunks + 1
        self.streams = len(branches_text)
        self.forward = RollingForward(self.chunk, c.sink_chunks)
        self.layers: list[RollingLayer] = []
        shape = (self.streams, self.slots * self.chunk, c.num_heads, c.head_dim)
        with torch.no_grad():
            for block in model.blocks:
                ks, vs = zip(*(block.cross.project_kv(t) for t in branches_text))  # once per layer, like populate
                cross = {TEXT: (torch.stack(ks), torch.stack(vs))}
                k = torch.zeros(shape, device=device, dtype=dtype)
                v = torch.zeros(shape, device=device, dtype=dtype)
                self.layers.append(RollingLayer(self.forward, k, v, cross))
        self.filled = 0  #: committed chunks in the buffer
        self.committed = 0  #: chunks ever committed (absolute positions)
        self.in_chunk = False
        self._arange = torch.arange(self.chunk, device=device, dtype=torch.int64)
        # NOTE: one positions buffer, refilled in place each chunk: a captured CUDA graph reads it at replay.
        self.forward.positions = torch.zeros(self.streams, self.chunk, device=device, dtype=torch.int64)

    def begin_forward(self) -> None:
        f = self.forward
        if not self.in_chunk:  # first forward of a new chunk
            f.roll = self.filled == self.slots
            if f.roll:
                self.filled -= 1
            f.positions.copy_((self._arange + self.committed * self.chunk).expand(self.streams, self.chunk))
            self.in_chunk = True
        f.slot = self.filled

    @property
    def steady(self) -> bool:
        """Whether the buffer is full: every forward from now on writes the last slot (rolling first if due),
        so its shapes and offsets repeat chunk after chunk (what a CUDA graph of the step needs)."""
        return self.in_chunk and self.forward.slot == self.slots - 1

    def end_forward(self, commit: bool) -> None:
        self.forward.roll = False  # later forwards of this chunk overwrite its slot in place
        if commit:
            self.filled += 1
            self.committed += 1
            self.in_chunk = False

    @property
    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.k, layer.v))


class RollingSelfAttention(nn.Module):
    """Drop-in for a block's ``ChunkSelfAttention``: the same projections, norms and RoPE, a rolling buffer."""

    def __init__(self, inner: am.ChunkSelfAttention, attend: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.inner = inner
        self.attend = attend

    def forward(self, x: torch.Tensor, kv: RollingLayer, rope: Any = None) -> torch.Tensor:
        a = self.inner
        s, n, _ = x.shape
        q, k, v = a.project(x)
        positions = kv.forward.positions
        q, k = apply_rope(q, positions, rope), apply_rope(k, positions, rope)
        out = self.cached_attention(q, k, v, kv)  # [s, n, heads, dim]
        return a.to_out(out.reshape(s, n, -1))

    def cached_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: RollingLayer) -> torch.Tensor:
        keys, values = kv.write(k, v)
        return self.attend(q, keys, values)


def sdpa_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[s, n, h, d]`` layouts (flash-attn's, as the peers use) through SDPA's ``[s, h, n, d]`` views."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=q.shape[2] != k.shape[2]
    )
    return out.transpose(1, 2)


#: Head dims FlashInfer's FA3 kernels are built for (others have no FA3 kernel).
FA3_HEAD_DIMS = (64, 128, 256)


def fa3_unavailable_reason(device: torch.device | str, dtype: torch.dtype, head_dim: int | None = None) -> str | None:
    """Why :class:`RaggedFA3Attend` cannot run on ``device`` in ``dtype`` (at ``head_dim``); ``None`` where it can.

    FlashInfer's FA3 backend needs CUDA, the ``flashinfer`` package, a Hopper GPU (sm90),
    bfloat16 / float16 q/k/v and a head dim of :data:`FA3_HEAD_DIMS`. FlashInfer is looked up without
    importing it.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return f"needs CUDA and FlashInfer's FA3 kernels, running on {device.type}"
    if importlib.util.find_spec("flashinfer") is None:
        return "needs the flashinfer package (FA3 kernels): not installed (pip install 'ardiff_modules[flashinfer]')"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"FlashInfer's FA3 backend needs a Hopper GPU (sm90), got sm{major}{minor}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"FA3 needs bfloat16 or float16 q/k/v, got {dtype}"
    if head_dim is not None and head_dim not in FA3_HEAD_DIMS:
        return f"FA3 kernels exist for head_dim in {FA3_HEAD_DIMS}, got {head_dim}"
    return None


class RaggedFA3Attend:
    """:func:`sdpa_attend` with FlashInfer's ragged FA3 (``backend="fa3"``, ``causal=False``): the stand-in
    for ``flash_attn_interface`` over the rolling buffer, what Self-Forcing / LongLive run on Hopper.

    Called per layer as ``attend(q, k, v)``: ``q`` ``[streams, q_len, heads, dim]`` over the visible prefix
    ``k`` / ``v`` ``[streams, kv_len, kv_heads, dim]`` (a view of the layer's buffer); returns
    ``[streams, q_len, heads, dim]``. Every stream attends to its own keys (one ragged request each).

    **One** ``plan()`` per (streams, q_len, kv_len, heads, kv_heads, dim, dtype), shared by every layer:
    the first layer of a forward that sees a new shape plans, the other layers of that forward and later
    forwards of the same shape reuse it. Every layer of a forward has the same shape, so this is one plan
    per new visible-key length (``sink + window + 1`` while the buffer fills) and none once it is full;
    ``plans`` counts them. Indptrs go to ``plan()`` as CPU int32 tensors (CUDA ones force a sync).
    """

    def __init__(self, workspace_bytes: int = 128 << 20) -> None:
        self.workspace_bytes = workspace_bytes
        self.wrapper: Any = None  #: the ragged wrapper, made on the first call (on the query's device)
        self.key: tuple[Any, ...] | None = None  #: the shape the wrapper is planned for
        self.plans = 0  #: plan() calls so far

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s, n, heads, d = q.shape
        keys, kv_heads = k.shape[1], k.shape[2]
        key = (s, n, keys, heads, kv_heads, d, q.dtype)
        if key != self.key:
            self._plan(q.device, key)
        # NOTE: k / v are the prefix buf[:, :kv_len] of a [streams, slots * C, h, d] buffer. With the window
        # full (kv_len == slots * C: every timed step) the prefix is the whole buffer, contiguous, and the
        # reshape is a view (no copy). While the buffer fills, the prefix of 2+ streams is strided: reshape
        # copies it then, as flash_attn's varlen interface would need too.
        out = self.wrapper.run(q.reshape(s * n, heads, d), k.reshape(s * keys, kv_heads, d),
                               v.reshape(s * keys, kv_heads, d))
        return out.view(s, n, heads, d)

    def _plan(self, device: torch.device, key: tuple[Any, ...]) -> None:
        import flashinfer

        s, n, keys, heads, kv_heads, d, dtype = key
        if self.wrapper is None:
            self.workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=device)
            self.wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD", backend="fa3")
        qo_indptr = torch.arange(s + 1, dtype=torch.int32) * n  # CPU: plan() copies them without a sync
        kv_indptr = torch.arange(s + 1, dtype=torch.int32) * keys
        self.wrapper.plan(qo_indptr, kv_indptr, heads, kv_heads, d, causal=False, q_data_type=dtype,
                          kv_data_type=dtype, o_data_type=dtype)
        self.key = key
        self.plans += 1


def make_flex_attend(compiled: bool) -> Callable[..., torch.Tensor]:
    """:func:`sdpa_attend` with ``flex_attention`` (compiled with ``dynamic=False``, or eager: unfused)."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention

    def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with warnings.catch_warnings():  # eager (CPU) flex warns that it is unfused: known, noted in the JSON
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)

    return flex_attend


@contextlib.contextmanager
def swapped_attention(model: nn.Module, attend: Callable[..., torch.Tensor], *, opaque: bool = False) -> Iterator[None]:
    """Replace every block's ``attn`` by a :class:`RollingSelfAttention` around it; restore on exit.

    ``opaque``: hide the cache write + attention from torch.compile (one graph break per layer), as
    the peers' compiled scripts do with a rolling buffer of host-side offsets: traced, every fill
    level and every roll would recompile the whole model.
    """
    originals = [block.attn for block in model.blocks]
    try:
        for block, attn in zip(model.blocks, originals):
            block.attn = RollingSelfAttention(attn, attend)
            if opaque:
                block.attn.cached_attention = torch.compiler.disable(block.attn.cached_attention)
        yield
    finally:
        for block, attn in zip(model.blocks, originals):
            block.attn = attn


class RollingRunner:
    """A model whose attention :func:`swapped_attention` replaced, over a :class:`RollingKVCache` (the
    runner interface of ``end_to_end``: ``forward(x, t, commit)``, ``kv_info()``, ``close()``)."""

    def __init__(self, model: nn.Module, config: WanConfig, texts: Sequence[torch.Tensor], device: torch.device,
                 dtype: torch.dtype, step: Callable[..., torch.Tensor] | None = None) -> None:
        self.step = model if step is None else step
        self.cache = RollingKVCache(model, config, texts, device, dtype)

    def forward(self, x: torch.Tensor, t: torch.Tensor, commit: bool) -> torch.Tensor:
        self.cache.begin_forward()
        out = self.step(x, t, self.cache.layers)
        self.cache.end_forward(commit)
        return out

    def kv_info(self) -> dict[str, Any]:
        return {"kv_peak_bytes": self.cache.kv_bytes, "kv_allocated_bytes": self.cache.kv_bytes,
                "layout": "contiguous per-layer buffer, memmove roll"}

    def close(self) -> None:
        self.cache.layers.clear()


#: The :class:`RaggedFA3Attend` instances the ``ardiff_bench::ragged_fa3`` op dispatches to, by id.
_FA3_ATTENDS: dict[int, RaggedFA3Attend] = {}
_FA3_OP: list[Any] = []


def _ragged_fa3_op() -> Any:
    """``ardiff_bench::ragged_fa3(q, k, v, attend_id) -> out``: a :class:`RaggedFA3Attend` call as a custom op,
    so that ``torch.compile(fullgraph=True)`` traces the peer's whole model with the FA3 call opaque inside one
    graph (as the library's own op is), instead of a graph break per layer. Registered on first use."""
    if not _FA3_OP:

        @torch.library.custom_op("ardiff_bench::ragged_fa3", mutates_args=())
        def ragged_fa3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend_id: int) -> torch.Tensor:
            return _FA3_ATTENDS[attend_id](q, k, v)

        @ragged_fa3.register_fake
        def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend_id: int) -> torch.Tensor:
            return torch.empty_like(q)

        _FA3_OP.append(ragged_fa3)
    return _FA3_OP[0]


def traceable_fa3(attend: RaggedFA3Attend) -> Callable[..., torch.Tensor]:
    """``attend`` behind the ``ardiff_bench::ragged_fa3`` custom op (see :func:`_ragged_fa3_op`)."""
    op = _ragged_fa3_op()
    _FA3_ATTENDS[id(attend)] = attend
    attend_id = id(attend)

    def fa3_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # NOTE: contiguous inputs, as the eager call reshapes them (a view once the buffer is full).
        return op(q.contiguous(), k.contiguous(), v.contiguous(), attend_id)

    return fa3_op


class RollingGraphRunner(RollingRunner):
    """:class:`RollingRunner` with the steady-state forwards replayed from CUDA graphs, as a user of the peer
    would hand-capture them (``mode="reduce-overhead"`` skips graphs whose inputs are mutated: the buffers).

    Once the buffer is full a forward has one of two shapes: the first forward of a chunk (roll, then write the
    last slot) or a later one (write the last slot). Each is run once normally (compiling, planning FA3, loading
    kernels), captured the next time it comes, and replayed from then on; inputs are copied into the graph's
    static ones, positions live in the cache's fixed buffer, the output is cloned (as ``CUDAGraphStep`` does).
    No warm-up runs outside a forward: a roll run twice would shift the window twice.

    While the buffer fills the forwards run the eager ``model`` (the same math, untimed warm-up chunks): compiled
    with ``dynamic=False`` each fill level is a new graph, and compiling all of them did not fit a device call
    (H100, stop 52: ~245 s were not enough after the library's row).
    """

    def __init__(self, model: nn.Module, *args: Any, **kwargs: Any) -> None:
        super().__init__(model, *args, **kwargs)
        self.fill_step = model
        self.seen: set[bool] = set()
        self.graphs: dict[bool, tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def forward(self, x: torch.Tensor, t: torch.Tensor, commit: bool) -> torch.Tensor:
        self.cache.begin_forward()
        key, steady = self.cache.forward.roll, self.cache.steady
        if not steady:
            out = self.fill_step(x, t, self.cache.layers)
        elif key not in self.seen:
            self.seen.add(key)
            out = self.step(x, t, self.cache.layers)
        else:
            if key not in self.graphs:
                static_x, static_t = x.clone(), t.clone()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):  # records only: the replay below runs this forward
                    static_out = self.step(static_x, static_t, self.cache.layers)
                self.graphs[key] = (graph, static_x, static_t, static_out)
            graph, static_x, static_t, static_out = self.graphs[key]
            static_x.copy_(x, non_blocking=True)
            static_t.copy_(t, non_blocking=True)
            graph.replay()
            out = static_out.clone()
        self.cache.end_forward(commit)
        return out

    def close(self) -> None:
        for graph, *_ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        super().close()


def rolling_memmove(k: torch.Tensor, v: torch.Tensor, roll_k: torch.Tensor, roll_v: torch.Tensor, *,
                    sink_tokens: int) -> Callable[[], None]:
    """One layer's write into full rolling buffers ``roll_k`` / ``roll_v`` ``[streams, keys, heads, dim]``:
    shift the window by one chunk, write the new chunk ``k`` / ``v`` ``[streams, chunk, heads, dim]`` at the end."""
    chunk = k.shape[1]

    def rolling() -> None:
        for buf, new in ((roll_k, k), (roll_v, v)):
            roll_window(buf, sink_tokens, chunk)
            buf[:, -chunk:].copy_(new)

    return rolling


# --------------------------------------------------------------------------------- the contiguous limits
@dataclasses.dataclass
class ContiguousAttention:
    """The visible keys of every stream held contiguous, and the kernels over them (see :func:`contiguous_attention`)."""

    fns: dict[str, Callable[[], object]]  #: ragged_fa3, ragged_fa3_fp8, ragged_fa3_again, sdpa
    ragged: Any  #: FlashInfer ragged prefill wrapper planned for bf16 q/k/v
    ragged8: Any  #: the same with FA3's FP8 kernel (q/k/v FP8, bf16 output)
    qs: torch.Tensor  #: the query as SDPA's [streams, heads, chunk, dim] view
    ks: torch.Tensor  #: the keys as [streams, heads, keys, dim]
    vs: torch.Tensor


def contiguous_attention(qf: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, *, streams: int, chunk: int,
                         keys: int) -> ContiguousAttention:
    """Attention of ``qf`` ``[streams * chunk, heads, dim]`` over ``kc`` / ``vc`` ``[streams * keys, heads, dim]``
    (each stream's visible keys, contiguous): the limits the library's paged kernels are read against.

    ``ragged_fa3``: FlashInfer's ragged FA3 (the practical limit); ``ragged_fa3_fp8``: FA3's FP8 kernel
    over the same keys, per-head unit scales, q/k/v quantized beforehand (the FP8 limit);
    ``ragged_fa3_again``: the first call under a second name (their spread is the timing noise);
    ``sdpa``: torch SDPA on the same tensors.
    """
    import flashinfer

    dt, dev = qf.dtype, qf.device
    heads, d = qf.shape[1], qf.shape[2]
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    qo_indptr = torch.arange(streams + 1, dtype=torch.int32) * chunk
    kv_indptr = torch.arange(streams + 1, dtype=torch.int32) * keys
    ragged.plan(qo_indptr, kv_indptr, heads, heads, d, causal=False, q_data_type=dt, kv_data_type=dt)
    fns: dict[str, Callable[[], object]] = {"ragged_fa3": lambda: ragged.run(qf, kc, vc)}
    fp8 = torch.float8_e4m3fn
    ragged8 = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa3")
    ragged8.plan(qo_indptr, kv_indptr, heads, heads, d, causal=False, q_data_type=fp8, kv_data_type=fp8,
                 o_data_type=dt)
    unit = torch.ones(heads, device=dev)
    q8, k8, v8 = qf.to(fp8), kc.to(fp8), vc.to(fp8)
    fns["ragged_fa3_fp8"] = lambda: ragged8.run(q8, k8, v8, unit, unit, unit)
    fns["ragged_fa3_again"] = lambda: ragged.run(qf, kc, vc)
    qs = qf.view(streams, chunk, heads, d).transpose(1, 2)
    ks = kc.view(streams, keys, heads, d).transpose(1, 2)
    vs = vc.view(streams, keys, heads, d).transpose(1, 2)
    fns["sdpa"] = lambda: F.scaled_dot_product_attention(qs, ks, vs)
    return ContiguousAttention(fns, ragged, ragged8, qs, ks, vs)


def flex_sink_window(qs: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, *, chunk: int, sink: int,
                     window: int) -> Callable[[], object]:
    """Compiled FlexAttention of the last chunk's queries ``qs`` ``[streams, heads, chunk, dim]`` over a whole
    timeline ``kt`` / ``vt`` ``[streams, heads, total_chunks * chunk, dim]``, with a block mask keeping the
    ``sink`` first chunks and the ``window`` chunks before the current (last) one."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    total_chunks = kt.shape[2] // chunk
    current = total_chunks - 1

    def sink_window(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        kv_chunk = kv_idx // chunk
        return (kv_chunk < sink) | ((kv_chunk >= current - window) & (kv_chunk <= current))

    def offset_mask(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return sink_window(b, h, q_idx + current * chunk, kv_idx)

    block_mask = create_block_mask(offset_mask, None, None, chunk, total_chunks * chunk, device="cuda")
    flex = torch.compile(flex_attention)
    return lambda: flex(qs, kt, vt, block_mask=block_mask)
