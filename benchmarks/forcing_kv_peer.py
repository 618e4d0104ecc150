"""Forcing-KV's own attention path, the peer for the same method (``end_to_end``'s ``forcingkv_own*`` variants).

What it re-implements (zju-jiyicheng/Forcing-KV at ``50ac1f454348e7f0a2e54bde71e1652b20c09fe6``,
``wan/modules/causal_model_forcingkv.py``: ``CausalWanSelfAttention.forward`` / ``dynamic_compression``,
``CausalWanModel._apply_offline_head_allocation`` / ``_forward_inference``; the library's reading of it is the
docstring of ``ardiff_modules/integrations/forcing_kv.py``, a cache-free re-statement ``tests/support/
forcing_kv_attention.py``). Units: a *frame* is ``HW`` tokens (1560 at Wan2.1 480x832), a block (one AR step,
one chunk) is 3 frames, ``S`` sink frames, ``Ls`` / ``Lt`` / ``Ld`` the spatial / temporal / dynamic context
lengths in frames, ``H = max(Ls, Lt)``, ``P`` patches per frame, ``a`` = ``ar_start``. Per layer:

* **layer 0 always, every layer up to the switch**: one full-head cache, the sink ``[s, S HW, h, d]`` and the
  last ``H`` frames ``[s, H HW, h, d]``; every forward attends ``cat(sink, local, current block)`` (a fresh
  contiguous tensor per forward); the clean re-run rewrites sink (before the switch) and local from that cat.
* **the switch** (after the clean re-run of block ``a``, outside the layers): each layer ``>= 1`` splits its
  heads into *spatial* (the head file's ``static_head``) and *temporal* (``dynamic_head``) groups, each with a
  copy of the sink, a ring of the last ``Ls`` / ``Lt`` frames and (temporal) a fixed buffer of ``Ld HW`` dynamic
  patch tokens. (Like upstream, the full-head sink / local tensors of those layers stay allocated.)
* **after the switch, layers >= 1**, every forward: the current q/k/v's heads gathered per group (upstream: a
  Triton kernel, ``extract_heads_triton``; here ``index_select`` on precomputed device indices), then per group
  ``k = cat(sink, [dynamic,] ring view, current)`` (fresh contiguous tensors; a ring whose write pointer is not
  0 is materialised by one more cat), each group attended by FA3, and the outputs put back in head order
  (upstream ``x[:, :, heads] = x_g`` with a Python list; here ``index_copy_`` on device indices).
* **the clean re-run after the switch** appends the block to both rings (``_ring_append_``); with dynamic
  patches, *before* the temporal ring slides, ``dynamic_compression``: the candidates are the ``T`` frames of the
  temporal window and the first ``3 - T`` frames of the block, each cut into ``P`` patches; **layer 1** scores
  each patch by the mean token cosine of its keys (row 0 of the batch, the layer's temporal heads flattened)
  with the same patch of the next frame, and keeps the ``Ld P`` lowest (``torch.topk(largest=False)``, sorted
  by flat index): on the device, as upstream (no host sync: the count is a host int, the indices stay on the
  device). Every layer ``>= 1`` copies its temporal heads' K/V of those patches into its dynamic buffer
  (``index_select`` over the candidates' patch axis, as upstream's ``_fill_cache_from_chunk_indices_``).
  Cost of the selection, per clean re-run: in every layer >= 1 two cats of the 3 candidate frames (K and V)
  and an ``index_select`` + copy of ``Ld`` frames of tokens; in layer 1 the cosine over ``3 HW`` tokens, a
  mean, a topk of ``3 P`` and a sort.

Only the clean re-run (the commit forward) writes. The host keeps the bookkeeping (valid lengths, ring write
pointers, whether the switch happened: :class:`CacheState`), computed before each forward and shared by every
layer, as upstream keeps it in Python ints. Where this peer departs from upstream it is in its favour:
upstream's ``update_cache = t[0, 0] == 0`` is a device tensor tested in every layer (a host sync per layer), its
TeaCache bookkeeping calls ``.cpu().item()`` on every denoising forward even with TeaCache off, its head
extraction builds the head index tensors from Python lists per call and its FA3 wrapper builds ``cu_seqlens``
per call; here the commit flag is a host bool, the head indices are built once, and FA3 is FlashInfer's ragged
FA3 (``backend="fa3"``, the stand-in for ``flash_attn_interface`` the rolling peers use) with one ``plan()``
per shape (:class:`MultiPlanFA3Attend`). Every write is in place into buffers allocated once (upstream
re-slices the layer-0 / pre-switch caches out of each cat), which keeps the step capturable as a CUDA graph.

The published Self-Forcing configuration is the default (:func:`published_self_forcing`): ``sink_size`` 1 frame,
``ar_start`` 1, spatial 1, temporal 1, dynamic 1 frame, ``num_frame_patch`` 6, ``sim_retention_ratio`` 0.33;
the head map from ``--forcingkv-heads`` (Forcing-KV's head file, read by the library's ``load_forcing_kv``), else
a fixed-seed map with the published file's per-layer static counts (134 of 360 at 30 x 12; other geometries the
same share). Outputs differ from the library's full-window rows (other semantics): reported, not checked.
:func:`library_head_retention` is the library's configuration of the same method (``end_to_end --heads forcingkv``:
the ``library_heads*`` rows, checked equal to this peer's outputs; ``python -m benchmarks.forcing_kv_peer
--write-heads PATH`` writes it as a HeadRetention JSON).

Imports torch: import it where a benchmark runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

import ardiff_modules as am
from ardiff_modules.models.wan_causal_dit import TEXT, WanConfig
from ardiff_modules.modules.functional import apply_rope
from benchmarks.baselines import fa3_unavailable_reason, sdpa_attend, traceable_fa3

#: Frames per AR block (hard-coded 3 in Forcing-KV: ``current_start_frame // 3``).
BLOCK_FRAMES = 3
#: The variants of ``end_to_end``: eager, ``torch.compile(fullgraph=True)`` (FA3 a custom op), and that compiled
#: step's settled forwards replayed from hand-captured CUDA graphs.
VARIANTS = ("forcingkv_own", "forcingkv_own_compiled", "forcingkv_own_compiled_graph")
#: Static (spatial) heads per layer of the published Self-Forcing head file (``configs_head/
#: forcingkv_heads_selfforcing.json`` at 50ac1f4; 134 of 30 x 12); which heads they are is drawn with a seed.
PUBLISHED_STATIC_PER_LAYER = (5, 4, 5, 4, 3, 8, 4, 6, 8, 4, 3, 4, 8, 1, 6, 1, 3, 8, 1, 4, 8, 6, 1, 3, 1, 2, 5, 6, 6, 6)
#: The ``forcingkv:`` block of ``configs/forcing-kv/forcingkv_self_forcing_inference.yaml`` (+ ``sink_size``).
PUBLISHED_SELF_FORCING: dict[str, Any] = {"sink_frames": 1, "ar_start": 1, "spatial_frames": 1, "temporal_frames": 1,
                                          "dynamic_frames": 1, "num_frame_patch": 6, "retention_ratio": 0.33}


# --------------------------------------------------------------------------------- configuration
@dataclasses.dataclass(frozen=True)
class ForcingKVPeerConfig:
    """Forcing-KV's numbers in frames, and each layer's spatial (static) kv heads (layer 0's unused)."""

    frame_tokens: int  #: ``HW``
    sink_frames: int  #: ``S`` (``model_kwargs.sink_size``)
    spatial_frames: int  #: ``Ls``
    temporal_frames: int  #: ``Lt``
    ar_start: int  #: ``a``: the groups apply from block ``a + 1``
    static_heads: tuple[tuple[int, ...], ...]  #: per layer, ascending
    num_kv_heads: int
    dynamic: bool = True  #: ``dynamic_temporal_enabled``
    dynamic_frames: int = 1  #: ``Ld``
    num_frame_patch: int = 6  #: ``P``
    retention_ratio: float = 0.33  #: ``sim_retention_ratio`` (checked against ``Ld P``, as upstream does)
    heads_source: str = ""

    @property
    def history_frames(self) -> int:
        """``H = max(Ls, Lt)``: the full-head window of layer 0 and of every layer before the switch."""
        return max(self.spatial_frames, self.temporal_frames)

    @property
    def keep_patches(self) -> int:
        """Dynamic patches kept (``Ld P``), 0 without the dynamic mode."""
        return self.dynamic_frames * self.num_frame_patch if self.dynamic else 0

    @property
    def dynamic_tokens(self) -> int:
        return self.keep_patches * (self.frame_tokens // self.num_frame_patch) if self.keep_patches else 0

    def temporal_heads(self, layer: int) -> tuple[int, ...]:
        return tuple(h for h in range(self.num_kv_heads) if h not in self.static_heads[layer])

    def check(self) -> None:
        """What Forcing-KV raises on (``ValueError`` here), plus layer 1's temporal head the scoring needs."""
        if self.sink_frames > BLOCK_FRAMES * (self.ar_start + 1):
            raise ValueError(f"sink of {self.sink_frames} frames: Forcing-KV cuts a sink longer than the "
                             f"{BLOCK_FRAMES * (self.ar_start + 1)} frames before the switch (not modelled)")
        if not self.dynamic:
            return
        if not 1 <= self.temporal_frames <= BLOCK_FRAMES:
            raise ValueError(f"dynamic mode: temporal_context_length must be 1-3 frames, got {self.temporal_frames}")
        if self.frame_tokens % self.num_frame_patch:
            raise ValueError(f"frame tokens {self.frame_tokens} not divisible by num_frame_patch "
                             f"{self.num_frame_patch}")
        by_ratio = int(round(BLOCK_FRAMES * self.num_frame_patch * min(1.0, max(0.0, self.retention_ratio))))
        if by_ratio != self.keep_patches:
            raise ValueError(f"dynamic capacity {self.keep_patches} patches and sim_retention_ratio "
                             f"{self.retention_ratio} ({by_ratio} patches) are inconsistent")
        if len(self.static_heads) > 1 and not self.temporal_heads(1):
            raise ValueError("layer 1 scores the dynamic patches with its temporal heads: it has none")

    def to_dict(self) -> dict[str, Any]:
        static = sum(len(s) for s in self.static_heads)
        return {**{k: v for k, v in dataclasses.asdict(self).items() if k != "static_heads"},
                "static_per_layer": [len(s) for s in self.static_heads],
                "static_heads_total": static, "heads_total": len(self.static_heads) * self.num_kv_heads,
                "block_frames": BLOCK_FRAMES, "keep_patches": self.keep_patches}


def frame_patches(frame_tokens: int, wanted: int = 6, ratio: float = 0.33, dynamic_frames: int = 1) -> int:
    """``wanted`` where it divides ``frame_tokens``, else the largest divisor below it that keeps ``round(3 P
    ratio) == Ld P`` (the tiny preset's 16-token frames: 4)."""
    for p in range(wanted, 0, -1):
        if frame_tokens % p == 0 and int(round(BLOCK_FRAMES * p * ratio)) == dynamic_frames * p:
            return p
    raise ValueError(f"no patch count <= {wanted} divides {frame_tokens} tokens at ratio {ratio}")


def synthetic_static_heads(num_layers: int, num_heads: int, seed: int = 0) -> tuple[tuple[int, ...], ...]:
    """A fixed-seed head map: at 30 x 12 the published Self-Forcing file's per-layer static counts
    (:data:`PUBLISHED_STATIC_PER_LAYER`), the heads drawn per layer; elsewhere ``round(134 / 360 x layers x heads)``
    static (layer, head) pairs drawn over the layers, layer 1 keeping a temporal head."""
    rng = random.Random(seed)
    if (num_layers, num_heads) == (len(PUBLISHED_STATIC_PER_LAYER), 12):
        counts = list(PUBLISHED_STATIC_PER_LAYER)
    else:
        pairs = [(layer, h) for layer in range(num_layers) for h in range(num_heads) if (layer, h) != (1, 0)]
        drawn = rng.sample(pairs, min(len(pairs), round(134 / 360 * num_layers * num_heads)))
        counts = [sum(1 for layer, _ in drawn if layer == i) for i in range(num_layers)]
    return tuple(tuple(sorted(rng.sample(range(num_heads), c))) for c in counts)


def published_self_forcing(
    config: WanConfig, *, heads: Path | None = None, seed: int = 0, dynamic: bool = True
) -> ForcingKVPeerConfig:
    """Forcing-KV's published Self-Forcing configuration at ``config``'s geometry: the ``forcingkv:`` block's values
    (:data:`PUBLISHED_SELF_FORCING`; ``num_frame_patch`` lowered by :func:`frame_patches` where 6 does not divide a
    frame), the head map of ``heads`` (Forcing-KV's head file, read by ``load_forcing_kv``) or
    :func:`synthetic_static_heads`. ``dynamic=False``: its ``dynamic_temporal_enabled: false`` (the static method
    the library's ``FrameWindowPolicy`` groups express: sink 1 frame + the last frame for every head)."""
    p = PUBLISHED_SELF_FORCING
    if heads is not None:
        from ardiff_modules.integrations.forcing_kv import load_forcing_kv

        block = {"ar_start": p["ar_start"], "spatial_context_length": p["spatial_frames"],
                 "temporal_context_length": p["temporal_frames"], "dynamic_context_length": p["dynamic_frames"],
                 "teacache_enabled": False, "teacache_threshold": 0.2, "dynamic_temporal_enabled": dynamic,
                 "num_frame_patch": p["num_frame_patch"], "sim_retention_ratio": p["retention_ratio"]}
        loaded = load_forcing_kv(heads, block)
        if (loaded.num_layers, loaded.num_heads) != (config.num_layers, config.num_heads):
            raise ValueError(f"--forcingkv-heads {heads}: {loaded.num_layers} x {loaded.num_heads} heads, the model "
                             f"{config.num_layers} x {config.num_heads}")
        static, source = loaded.static_heads, f"{heads} (load_forcing_kv)"
    else:
        static = synthetic_static_heads(config.num_layers, config.num_heads, seed)
        source = (f"synthetic, seed {seed}: " + ("the published Self-Forcing file's per-layer static counts"
                  if config.num_layers == 30 and config.num_heads == 12 else "134/360 of the heads static"))
    cfg = ForcingKVPeerConfig(
        frame_tokens=config.tokens_per_frame, sink_frames=p["sink_frames"], spatial_frames=p["spatial_frames"],
        temporal_frames=p["temporal_frames"], ar_start=p["ar_start"], static_heads=tuple(static),
        num_kv_heads=config.num_heads, dynamic=dynamic, dynamic_frames=p["dynamic_frames"],
        num_frame_patch=frame_patches(config.tokens_per_frame, p["num_frame_patch"], p["retention_ratio"],
                                      p["dynamic_frames"]),
        retention_ratio=p["retention_ratio"], heads_source=source)
    cfg.check()
    return cfg


def library_head_retention(cfg: ForcingKVPeerConfig) -> am.HeadRetention:
    """The library's :class:`~ardiff_modules.HeadRetention` for the same method as this peer: ``cfg``'s head map and
    numbers handed to the library's reader of Forcing-KV's files (``load_forcing_kv``: its head file's layer objects
    and its ``forcingkv:`` block) and built by ``ForcingKVConfig.head_retention`` -- the ``library_heads*`` rows of
    ``end_to_end --heads forcingkv``. With the dynamic mode the temporal group is a ``SelectedFramesPolicy`` (layer 1
    scores, from block ``ar_start + 1`` on), layer 0 its own group; without it, frame windows only."""
    from ardiff_modules.integrations.forcing_kv import load_forcing_kv

    layers = len(cfg.static_heads)
    head_file = {"format": "benchmarks.forcing_kv_peer", "profile": cfg.heads_source or None, "num_layers": layers,
                 "num_heads": cfg.num_kv_heads,
                 "layers": [{"layer_idx": i, "static_head": list(static), "dynamic_head": list(cfg.temporal_heads(i))}
                            for i, static in enumerate(cfg.static_heads)]}
    block = {"ar_start": cfg.ar_start, "spatial_context_length": cfg.spatial_frames,
             "temporal_context_length": cfg.temporal_frames, "dynamic_context_length": cfg.dynamic_frames,
             "teacache_enabled": False, "teacache_threshold": 0.2, "dynamic_temporal_enabled": cfg.dynamic,
             "num_frame_patch": cfg.num_frame_patch, "sim_retention_ratio": cfg.retention_ratio}
    loaded = load_forcing_kv(head_file, block)
    return loaded.head_retention(layers, cfg.num_kv_heads, BLOCK_FRAMES, sink_frames=cfg.sink_frames)


def skip_reason(name: str, config: WanConfig, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``name`` cannot run here: Forcing-KV's 3-frame blocks; FA3 on CUDA (the CPU attends with SDPA)."""
    if config.frames_per_chunk != BLOCK_FRAMES:
        return f"Forcing-KV's blocks are {BLOCK_FRAMES} frames; preset {config.name} has {config.frames_per_chunk}"
    if device.type == "cuda":
        return fa3_unavailable_reason(device, dtype, config.head_dim)
    if name.endswith("_graph"):
        return "CUDA graphs need CUDA"
    return None


# --------------------------------------------------------------------------------- host bookkeeping
@dataclasses.dataclass(frozen=True)
class CacheState:
    """What every layer's caches hold, in tokens (the same in every layer: lengths do not depend on heads)."""

    switched: bool = False  #: the head groups apply (layers >= 1)
    sink: int = 0  #: full-head sink tokens (layer 0; every layer before the switch)
    local: int = 0  #: full-head window tokens (the last ``H`` frames)
    spatial: int = 0  #: spatial ring: valid tokens
    spatial_ptr: int = 0  #: spatial ring: write pointer
    temporal: int = 0
    temporal_ptr: int = 0
    dynamic: int = 0  #: dynamic patch tokens


def _ring_after_append(ptr: int, valid: int, keep: int, n: int) -> tuple[int, int]:
    """``_ring_append_``'s new ``(write pointer, valid tokens)`` after appending ``n`` tokens to a ring of ``keep``."""
    if keep <= 0:
        return 0, 0
    if n >= keep:
        return 0, keep
    return (ptr + n) % keep, min(keep, valid + n)


def _ring_from_tail(tail: int, keep: int) -> tuple[int, int]:
    """``_allocate_ring_cache``'s ``(write pointer, valid tokens)``: a ring of ``keep`` filled from ``tail`` tokens."""
    if keep <= 0 or tail == 0:
        return 0, 0
    return (0, keep) if tail >= keep else (tail, tail)


def advance(state: CacheState, cfg: ForcingKVPeerConfig, block: int) -> CacheState:
    """The state after the clean re-run of block ``block`` (0-based), the switch included when ``block == a``."""
    hw, chunk = cfg.frame_tokens, BLOCK_FRAMES * cfg.frame_tokens
    sink_cap = cfg.sink_frames * hw
    if not state.switched:
        total = state.sink + state.local + chunk
        sink = min(sink_cap, total)
        local = min(cfg.history_frames * hw, total - sink)
        new = dataclasses.replace(state, sink=sink, local=local)
        if block != cfg.ar_start:
            return new
        sp_keep, tp_keep = cfg.spatial_frames * hw, cfg.temporal_frames * hw
        sp_ptr, sp = _ring_from_tail(min(local, sp_keep), sp_keep)
        tp_ptr, tp = _ring_from_tail(min(local, tp_keep), tp_keep)
        return dataclasses.replace(new, switched=True, spatial=sp, spatial_ptr=sp_ptr, temporal=tp,
                                   temporal_ptr=tp_ptr, dynamic=0)
    local = min(cfg.history_frames * hw, state.local + chunk)  # layer 0: the last H frames after the sink
    sp_ptr, sp = _ring_after_append(state.spatial_ptr, state.spatial, cfg.spatial_frames * hw, chunk)
    tp_ptr, tp = _ring_after_append(state.temporal_ptr, state.temporal, cfg.temporal_frames * hw, chunk)
    dynamic = cfg.dynamic_tokens if cfg.keep_patches and state.temporal >= hw else 0
    return dataclasses.replace(state, local=local, spatial=sp, spatial_ptr=sp_ptr, temporal=tp, temporal_ptr=tp_ptr,
                               dynamic=dynamic)


def states(cfg: ForcingKVPeerConfig, blocks: int) -> list[CacheState]:
    """The state each of blocks ``0 .. blocks - 1`` reads."""
    out = [CacheState()]
    for block in range(blocks - 1):
        out.append(advance(out[-1], cfg, block))
    return out


def visible_keys(cfg: ForcingKVPeerConfig, committed: int) -> float:
    """Mean over (layer, kv head) of the keys one head attends to after ``committed`` blocks (what the FLOPs of a
    step are counted with): layer 0 and every layer before the switch ``sink + local + block``; after it spatial
    heads ``sink + spatial ring + block``, temporal heads ``sink + dynamic + temporal ring + block``."""
    s = states(cfg, committed + 1)[-1]
    chunk, layers, heads = BLOCK_FRAMES * cfg.frame_tokens, len(cfg.static_heads), cfg.num_kv_heads
    full = s.sink + s.local + chunk
    total = full * heads  # layer 0
    for layer in range(1, layers):
        if not s.switched:
            total += full * heads
            continue
        n_s = len(cfg.static_heads[layer])
        total += n_s * (s.sink + s.spatial + chunk) + (heads - n_s) * (s.sink + s.dynamic + s.temporal + chunk)
    return total / (layers * heads)


# --------------------------------------------------------------------------------- the caches
class ForcingKVForward:
    """The per-forward plan every layer reads: positions, the state, whether it commits, the shared selection."""

    def __init__(self, cfg: ForcingKVPeerConfig, streams: int, device: torch.device) -> None:
        self.cfg = cfg
        self.state = CacheState()  #: what the caches hold now
        self.next = CacheState()  #: what they hold after this forward (== state unless it commits)
        self.commit = False
        chunk = BLOCK_FRAMES * cfg.frame_tokens
        self.positions = torch.zeros(streams, chunk, device=device, dtype=torch.int64)  #: refilled in place
        #: layer 1's kept patch indices ``[Ld P]`` (ascending flat ``frame * P + patch``), read by the other layers
        #: of the same forward (upstream: a class attribute); a fixed buffer so that a CUDA graph reads it.
        self.selected = torch.zeros(max(1, cfg.keep_patches), device=device, dtype=torch.int64)


class ForcingKVLayer:
    """One layer's caches (the ``LayerContext`` surface the blocks read: ``positions``, ``cross_kv``).

    Full-head: ``sink_k/v`` ``[s, S HW, h, d]``, ``local_k/v`` ``[s, H HW, h, d]`` (valid prefixes per the state).
    After the switch (layers >= 1), per group ``g`` of ``h_g`` heads: ``sink_g`` ``[s, S HW, h_g, d]``, a ring
    ``[s, L_g HW, h_g, d]``; temporal: ``dyn_k/v`` ``[s, Ld HW, h_t, d]``.
    """

    def __init__(self, index: int, forward: ForcingKVForward, shape: tuple[int, int, int],
                 cross: dict[str, tuple[torch.Tensor, torch.Tensor]], device: torch.device, dtype: torch.dtype) -> None:
        cfg = forward.cfg
        streams, heads, dim = shape
        self.index, self.forward, self.cross = index, forward, cross
        hw = cfg.frame_tokens
        self.sink_k, self.sink_v = (torch.zeros(streams, cfg.sink_frames * hw, heads, dim, device=device, dtype=dtype)
                                    for _ in range(2))
        self.local_k, self.local_v = (torch.zeros(streams, cfg.history_frames * hw, heads, dim, device=device,
                                                  dtype=dtype) for _ in range(2))
        self.grouped = False  #: after the switch: the head groups' tensors below exist (:meth:`switch`)
        empty = self.sink_k[:, :0]
        #: kv head indices of the spatial / temporal group and their query heads (``[h_g]``, ``[h_g x q_per_kv]``)
        self.spatial = self.temporal = self.spatial_q = self.temporal_q = torch.empty(0, dtype=torch.int64)
        #: per group: sink ``[s, S HW, h_g, d]``, ring ``[s, L_g HW, h_g, d]``; temporal: dynamic ``[s, Ld HW, h_t, d]``
        self.sink_s_k = self.sink_s_v = self.ring_s_k = self.ring_s_v = empty
        self.sink_t_k = self.sink_t_v = self.ring_t_k = self.ring_t_v = self.dyn_k = self.dyn_v = empty

    @property
    def positions(self) -> torch.Tensor:
        return self.forward.positions

    def cross_kv(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cross[name]

    def tensors(self) -> list[torch.Tensor]:
        names = ["sink_k", "sink_v", "local_k", "local_v"]
        if self.grouped:
            names += ["sink_s_k", "sink_s_v", "ring_s_k", "ring_s_v", "sink_t_k", "sink_t_v", "ring_t_k", "ring_t_v",
                      "dyn_k", "dyn_v"]
        return [getattr(self, n) for n in names]

    def switch(self, state: CacheState, q_per_kv: int) -> None:
        """``_apply_offline_head_allocation`` for this layer (>= 1): the groups' sinks, rings and dynamic buffer
        from the full-head caches of ``state`` (after the clean re-run of block ``a``)."""
        cfg, hw = self.forward.cfg, self.forward.cfg.frame_tokens
        device = self.sink_k.device
        spatial, temporal = list(cfg.static_heads[self.index]), list(cfg.temporal_heads(self.index))
        self.spatial = torch.tensor(spatial, device=device, dtype=torch.int64)
        self.temporal = torch.tensor(temporal, device=device, dtype=torch.int64)
        self.spatial_q, self.temporal_q = (
            torch.tensor([h * q_per_kv + r for h in heads for r in range(q_per_kv)], device=device, dtype=torch.int64)
            for heads in (spatial, temporal))
        local = (self.local_k[:, :state.local], self.local_v[:, :state.local])

        def ring(src: torch.Tensor, heads: torch.Tensor, frames: int, valid: int) -> torch.Tensor:
            """``_allocate_ring_cache``: ``frames`` frames of ``heads``, the last ``valid`` tokens of ``src`` first."""
            out = torch.zeros(src.shape[0], frames * hw, len(heads), src.shape[3], device=device, dtype=src.dtype)
            out[:, :valid].copy_(src[:, src.shape[1] - valid:].index_select(2, heads))
            return out

        self.sink_s_k, self.sink_s_v = (t.index_select(2, self.spatial) for t in (self.sink_k, self.sink_v))
        self.sink_t_k, self.sink_t_v = (t.index_select(2, self.temporal) for t in (self.sink_k, self.sink_v))
        self.ring_s_k, self.ring_s_v = (ring(t, self.spatial, cfg.spatial_frames, state.spatial) for t in local)
        self.ring_t_k, self.ring_t_v = (ring(t, self.temporal, cfg.temporal_frames, state.temporal) for t in local)
        shape = (local[0].shape[0], cfg.dynamic_tokens, len(temporal), local[0].shape[3])
        self.dyn_k, self.dyn_v = (torch.zeros(shape, device=device, dtype=local[0].dtype) for _ in range(2))
        self.grouped = True

    # ----------------------------------------------------------------- the forward
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: Callable[..., torch.Tensor]
                  ) -> torch.Tensor:
        """``q`` ``[s, 3 HW, heads, d]``, ``k`` / ``v`` ``[s, 3 HW, kv_heads, d]`` (after RoPE) ->
        ``[s, 3 HW, heads, d]``; the clean re-run (``forward.commit``) writes the caches."""
        if self.index == 0 or not self.forward.state.switched:
            return self._full(q, k, v, attend)
        return self._grouped(q, k, v, attend)

    def _full(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: Callable[..., torch.Tensor]
              ) -> torch.Tensor:
        f, s = self.forward, self.forward.state
        k0 = torch.cat([self.sink_k[:, :s.sink], self.local_k[:, :s.local], k], dim=1)
        v0 = torch.cat([self.sink_v[:, :s.sink], self.local_v[:, :s.local], v], dim=1)
        out = attend(q, k0, v0)
        if f.commit:
            n, total = f.next, k0.shape[1]
            if not s.switched:  # sink = k0[:, :S HW] (rewritten with what it held, once full)
                self.sink_k[:, :n.sink].copy_(k0[:, :n.sink])
                self.sink_v[:, :n.sink].copy_(v0[:, :n.sink])
            if n.local:  # local = the last H frames after the sink
                self.local_k[:, :n.local].copy_(k0[:, total - n.local:])
                self.local_v[:, :n.local].copy_(v0[:, total - n.local:])
        return out

    def _grouped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: Callable[..., torch.Tensor]
                 ) -> torch.Tensor:
        f, s = self.forward, self.forward.state
        q_s, q_t = q.index_select(2, self.spatial_q), q.index_select(2, self.temporal_q)
        k_s, v_s = k.index_select(2, self.spatial), v.index_select(2, self.spatial)
        k_t, v_t = k.index_select(2, self.temporal), v.index_select(2, self.temporal)
        ring_sk, ring_sv = (_ring_view(r, s.spatial_ptr, s.spatial) for r in (self.ring_s_k, self.ring_s_v))
        ring_tk, ring_tv = (_ring_view(r, s.temporal_ptr, s.temporal) for r in (self.ring_t_k, self.ring_t_v))
        out = torch.empty_like(q)
        if q_s.shape[2]:
            k1 = torch.cat([self.sink_s_k, ring_sk, k_s], dim=1)
            v1 = torch.cat([self.sink_s_v, ring_sv, v_s], dim=1)
            out.index_copy_(2, self.spatial_q, attend(q_s, k1, v1))
        if q_t.shape[2]:
            k2 = torch.cat([self.sink_t_k, self.dyn_k[:, :s.dynamic], ring_tk, k_t], dim=1)
            v2 = torch.cat([self.sink_t_v, self.dyn_v[:, :s.dynamic], ring_tv, v_t], dim=1)
            out.index_copy_(2, self.temporal_q, attend(q_t, k2, v2))
        if f.commit:
            cfg, hw = f.cfg, f.cfg.frame_tokens
            _ring_append(self.ring_s_k, self.ring_s_v, k_s, v_s, s.spatial_ptr, cfg.spatial_frames * hw)
            if cfg.keep_patches and s.temporal >= hw:  # before the window slides: the frames leaving it
                self._select_patches(ring_tk, ring_tv, k_t, v_t)
            _ring_append(self.ring_t_k, self.ring_t_v, k_t, v_t, s.temporal_ptr, cfg.temporal_frames * hw)
        return out

    def _select_patches(self, old_k: torch.Tensor, old_v: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor
                        ) -> None:
        """``dynamic_compression``: ``old_*`` ``[s, T HW, h_t, d]`` (the temporal window), ``new_*``
        ``[s, 3 HW, h_t, d]`` (the block); layer 1 chooses the ``Ld P`` patches into ``forward.selected``; every
        layer copies its own."""
        f, cfg = self.forward, self.forward.cfg
        hw, p = cfg.frame_tokens, cfg.num_frame_patch
        b, _, h, d = new_k.shape
        kept, per_patch = cfg.keep_patches, hw // p
        frames = old_k.shape[1] // hw
        carried = BLOCK_FRAMES - frames
        new_frames_k = new_k.reshape(b, BLOCK_FRAMES, hw, h, d)
        cand_k = torch.cat([old_k.reshape(b, frames, hw, h, d), new_frames_k[:, :carried]], dim=1)
        cand_v = torch.cat([old_v.reshape(b, frames, hw, h, d), new_v.reshape(b, BLOCK_FRAMES, hw, h, d)[:, :carried]],
                           dim=1)
        if self.index == 1:  # row 0, the next frame of the last candidate is the first the window keeps
            chain = torch.cat([cand_k[:1], new_frames_k[:1, carried:carried + 1]], dim=1)  # [1, 4, HW, h, d]
            current = chain[:, :BLOCK_FRAMES].reshape(1, BLOCK_FRAMES, p, per_patch, -1)
            following = chain[:, 1:].reshape(1, BLOCK_FRAMES, p, per_patch, -1)
            scores = F.cosine_similarity(current, following, dim=-1).mean(dim=3)[0]  # [3, P]
            keep = torch.topk(scores.reshape(-1), k=kept, largest=False, dim=-1).indices
            f.selected.copy_(torch.sort(keep).values)
        for cand, dyn in ((cand_k, self.dyn_k), (cand_v, self.dyn_v)):
            chunks = cand.reshape(b, BLOCK_FRAMES * p, per_patch, h, d).index_select(1, f.selected)
            dyn.copy_(chunks.reshape(b, kept * per_patch, h, d))


def _ring_view(ring: torch.Tensor, ptr: int, valid: int) -> torch.Tensor:
    """``_materialize_ring_view``: the ring's tokens oldest first (a cat when the write pointer is not 0)."""
    if valid == 0:
        return ring[:, :0]
    if valid < ring.shape[1]:
        return ring[:, :valid]
    if ptr == 0:
        return ring
    return torch.cat([ring[:, ptr:], ring[:, :ptr]], dim=1)


def _ring_append(ring_k: torch.Tensor, ring_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ptr: int,
                 keep: int) -> None:
    """``_ring_append_`` of ``k`` / ``v`` ``[s, n, h, d]`` at write pointer ``ptr`` of rings of ``keep`` tokens."""
    n = k.shape[1]
    if keep <= 0 or n == 0:
        return
    for ring, new in ((ring_k, k), (ring_v, v)):
        if n >= keep:
            ring.copy_(new[:, n - keep:])
            continue
        first = min(keep - ptr, n)
        ring[:, ptr:ptr + first].copy_(new[:, :first])
        if n > first:
            ring[:, :n - first].copy_(new[:, first:])


class ForcingKVCache:
    """Every layer's Forcing-KV caches for ``streams`` streams, and the host bookkeeping between forwards."""

    def __init__(self, model: nn.Module, cfg: ForcingKVPeerConfig, texts: Sequence[torch.Tensor],
                 device: torch.device, dtype: torch.dtype) -> None:
        """``model``: blocks with ``attn`` (``ChunkSelfAttention``, or wrapped by :func:`wrap_attention`) and ``cross``
        (``CachedCrossAttention``); ``texts``: one embedded text per stream, ``[tokens, context_dim]``."""
        attn = getattr(model.blocks[0].attn, "inner", model.blocks[0].attn)  # swapped or not
        self.cfg, self.streams = cfg, len(texts)
        self.q_per_kv = attn.num_heads // attn.num_kv_heads
        self.chunk = BLOCK_FRAMES * cfg.frame_tokens
        self.forward = ForcingKVForward(cfg, self.streams, device)
        self.layers: list[ForcingKVLayer] = []
        with torch.no_grad():
            for index, block in enumerate(model.blocks):
                ks, vs = zip(*(block.cross.project_kv(t) for t in texts))  # once per layer, like populate
                self.layers.append(ForcingKVLayer(index, self.forward, (self.streams, attn.num_kv_heads, attn.head_dim),
                                                  {TEXT: (torch.stack(ks), torch.stack(vs))}, device, dtype))
        self.blocks = 0  #: blocks committed (the current one's index)
        self._arange = torch.arange(self.chunk, device=device, dtype=torch.int64)
        self._positions_block = -1
        self.peak_bytes = self.kv_bytes

    def begin_forward(self, commit: bool) -> None:
        f = self.forward
        f.commit = commit
        f.next = advance(f.state, self.cfg, self.blocks) if commit else f.state
        if self._positions_block != self.blocks:  # absolute token positions of the block (RoPE)
            f.positions.copy_((self._arange + self.blocks * self.chunk).expand(self.streams, self.chunk))
            self._positions_block = self.blocks

    def end_forward(self, commit: bool) -> None:
        f = self.forward
        if not commit:
            return
        if f.next.switched and not f.state.switched:  # after the clean re-run of block a
            with torch.no_grad():
                for layer in self.layers[1:]:
                    layer.switch(f.next, self.q_per_kv)
        f.state, f.commit = f.next, False
        self.blocks += 1
        self.peak_bytes = max(self.peak_bytes, self.kv_bytes)

    @property
    def steady(self) -> bool:
        """Whether the forwards repeat chunk after chunk: switched, and a commit leaves the state as it is (rings of
        at most a block, rewritten whole; a longer ring's write pointer moves)."""
        s = self.forward.state
        return s.switched and advance(s, self.cfg, self.blocks) == s

    @property
    def settled(self) -> bool:
        """Past the transient: switched, and every buffer full (what changes from here on is at most the rings'
        write pointers, a few states that recur). The compiled runners compile and capture from here on."""
        s, cfg, hw = self.forward.state, self.cfg, self.cfg.frame_tokens
        return (s.switched and s.local == cfg.history_frames * hw and s.spatial == cfg.spatial_frames * hw
                and s.temporal == cfg.temporal_frames * hw and s.dynamic == cfg.dynamic_tokens)

    @property
    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors())

    def concat_bytes_per_forward(self) -> int:
        """Bytes of the fresh K and V tensors the per-forward concatenations write, summed over the layers (now)."""
        s = self.forward.state
        layer0 = self.layers[0]
        per_head = layer0.sink_k.shape[0] * layer0.sink_k.shape[3] * layer0.sink_k.element_size() * 2
        total = 0
        for layer in self.layers:
            heads = layer.sink_k.shape[2]
            if not layer.grouped or not s.switched:
                total += (s.sink + s.local + self.chunk) * heads * per_head
                continue
            n_s = len(self.cfg.static_heads[layer.index])
            total += n_s * (s.sink + s.spatial + self.chunk) * per_head
            total += (heads - n_s) * (s.sink + s.dynamic + s.temporal + self.chunk) * per_head
        return total


# --------------------------------------------------------------------------------- the model around it
class ForcingKVSelfAttention(nn.Module):
    """Drop-in for a block's ``ChunkSelfAttention``: its projections, norms and RoPE, Forcing-KV's caches."""

    def __init__(self, inner: am.ChunkSelfAttention, attend: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.inner = inner
        self.attend = attend

    def forward(self, x: torch.Tensor, kv: ForcingKVLayer, rope: Any = None) -> torch.Tensor:
        a = self.inner
        s, n, _ = x.shape
        q, k, v = a.project(x)
        positions = kv.forward.positions
        q, k = apply_rope(q, positions, rope), apply_rope(k, positions, rope)
        out = kv.attention(q, k, v, self.attend)  # [s, n, heads, dim]
        return a.to_out(out.reshape(s, n, -1))


def wrap_attention(model: nn.Module, attend: Callable[..., torch.Tensor]) -> list[ForcingKVSelfAttention]:
    """A :class:`ForcingKVSelfAttention` around each block's ``attn`` (for :func:`swapped_attention`)."""
    return [ForcingKVSelfAttention(block.attn, attend) for block in model.blocks]


@contextlib.contextmanager
def swapped_attention(model: nn.Module, wrappers: Sequence[ForcingKVSelfAttention]) -> Iterator[None]:
    """Put ``wrappers`` (:func:`wrap_attention`) in the blocks' ``attn``; restore on exit. The same wrappers swapped
    in again keep a compiled model's graphs valid (its guards check the modules)."""
    originals = [block.attn for block in model.blocks]
    try:
        for block, wrapper in zip(model.blocks, wrappers):
            block.attn = wrapper
        yield
    finally:
        for block, attn in zip(model.blocks, originals):
            block.attn = attn


class MultiPlanFA3Attend:
    """``attend(q, k, v)`` (``[s, n, heads, d]`` over ``[s, keys, kv_heads, d]``) with FlashInfer's ragged FA3, one
    wrapper planned once per (streams, q_len, kv_len, heads, kv_heads, dim, dtype): Forcing-KV's groups have as many
    shapes as distinct per-layer head counts x key lengths (~20 at the published map), each planned on its first
    call and reused (``flash_attn_varlen_func`` needs no plan: re-planning per call would only penalise the peer).
    The wrappers share one float workspace (their calls run one after another); each has its own plan buffers."""

    def __init__(self, workspace_bytes: int = 128 << 20) -> None:
        self.workspace_bytes = workspace_bytes
        self.workspace: torch.Tensor | None = None
        self.wrappers: dict[tuple[Any, ...], Any] = {}
        self.plans = 0

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s, n, heads, d = q.shape
        keys, kv_heads = k.shape[1], k.shape[2]
        key = (s, n, keys, heads, kv_heads, d, q.dtype)
        wrapper = self.wrappers.get(key)
        if wrapper is None:
            wrapper = self._plan(q.device, key)
        out = wrapper.run(q.reshape(s * n, heads, d), k.reshape(s * keys, kv_heads, d),
                          v.reshape(s * keys, kv_heads, d))
        return out.view(s, n, heads, d)

    def _plan(self, device: torch.device, key: tuple[Any, ...]) -> Any:
        import flashinfer

        s, n, keys, heads, kv_heads, d, dtype = key
        if self.workspace is None:
            self.workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=device)
        wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD", backend="fa3")
        wrapper.plan(torch.arange(s + 1, dtype=torch.int32) * n, torch.arange(s + 1, dtype=torch.int32) * keys,
                     heads, kv_heads, d, causal=False, q_data_type=dtype, kv_data_type=dtype, o_data_type=dtype)
        self.wrappers[key] = wrapper
        self.plans += 1
        return wrapper


def make_attend(device: torch.device, compiled: bool) -> tuple[Callable[..., torch.Tensor], Any, str]:
    """``(attend, the FA3 object or None, kernel name)``: FA3 on CUDA (behind the custom op when compiled: no graph
    break), SDPA on the CPU (the FA3 peers' stand-in there)."""
    if device.type != "cuda":
        return sdpa_attend, None, "sdpa (CPU stand-in for FA3)"
    fa3 = MultiPlanFA3Attend()
    # NOTE: the custom op dispatches to any attend(q, k, v) by id; it is typed for RaggedFA3Attend.
    return ((traceable_fa3(cast(Any, fa3)) if compiled else fa3), fa3,
            "flashinfer ragged fa3 (flash_attn_interface stand-in)")


# --------------------------------------------------------------------------------- runners
class ForcingKVRunner:
    """The model with :func:`swapped_attention` over a :class:`ForcingKVCache` (``end_to_end``'s runner interface:
    ``forward(x, t, commit)``, ``kv_info()``, ``close()``).

    ``step``: the compiled model, called once the cache is :attr:`~ForcingKVCache.settled`; the transient first
    chunks (``ar_start + 2`` at the published config) run ``model`` eagerly. Compiled throughout, each of their cache
    states would compile its own graph (8 at the published config, ~2-3 minutes more per run) for forwards that are
    never timed; from the settled state on, a denoising and a clean forward are two graphs."""

    def __init__(self, model: nn.Module, cfg: ForcingKVPeerConfig, texts: Sequence[torch.Tensor], device: torch.device,
                 dtype: torch.dtype, step: Callable[..., torch.Tensor] | None = None, fa3: Any = None) -> None:
        self.model, self.step = model, model if step is None else step
        self.cache = ForcingKVCache(model, cfg, texts, device, dtype)
        self.fa3 = fa3
        self._plans = fa3.plans if fa3 is not None else 0
        self._concat = 0

    def forward(self, x: torch.Tensor, t: torch.Tensor, commit: bool) -> torch.Tensor:
        step = self.step if self.cache.settled else self.model
        self.cache.begin_forward(commit)
        out = step(x, t, self.cache.layers)
        self._concat = self.cache.concat_bytes_per_forward()
        self.cache.end_forward(commit)
        return out

    def kv_info(self) -> dict[str, Any]:
        info = {"kv_peak_bytes": self.cache.peak_bytes, "kv_allocated_bytes": self.cache.kv_bytes,
                "layout": "Forcing-KV: per layer a full-head sink + window, after the switch per head group a sink, "
                          "a ring and (temporal) dynamic patches; concatenated into fresh tensors every forward",
                "concat_bytes_per_forward": self._concat,
                "forcing_kv_state": dataclasses.asdict(self.cache.forward.state)}
        if self.fa3 is not None:
            info["fa3_plans"] = self.fa3.plans - self._plans  # during this run
        return info

    def close(self) -> None:
        self.cache.layers.clear()


class ForcingKVGraphRunner(ForcingKVRunner):
    """:class:`ForcingKVRunner` with the settled forwards replayed from CUDA graphs (as ``baselines.RollingGraphRunner``
    does for the rolling peer): once :attr:`ForcingKVCache.settled`, a forward is keyed by (commit, cache state): at
    the published config two keys (denoising, and the clean re-run with its writes and the patch selection), with
    rings longer than a block one per write pointer. Each is run once normally (compiling, planning FA3), captured
    the next time, replayed from then on; inputs copied into static ones, the output cloned. Every write is in
    place into buffers allocated once, so a replay reads and writes what the capture did. The graphs share one
    memory pool (their replays never overlap)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: set[tuple[bool, CacheState]] = set()
        self.graphs: dict[tuple[bool, CacheState], tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def forward(self, x: torch.Tensor, t: torch.Tensor, commit: bool) -> torch.Tensor:
        key = (commit, self.cache.forward.state)
        settled = self.cache.settled
        self.cache.begin_forward(commit)
        if not settled or key not in self.seen:
            if settled:
                self.seen.add(key)
            out = (self.step if settled else self.model)(x, t, self.cache.layers)
        else:
            if key not in self.graphs:
                static_x, static_t = x.clone(), t.clone()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):  # records only: the replay below runs this forward
                    static_out = self.step(static_x, static_t, self.cache.layers)
                self.graphs[key] = (graph, static_x, static_t, static_out)
            graph, static_x, static_t, static_out = self.graphs[key]
            static_x.copy_(x, non_blocking=True)
            static_t.copy_(t, non_blocking=True)
            graph.replay()
            out = static_out.clone()
        self._concat = self.cache.concat_bytes_per_forward()
        self.cache.end_forward(commit)
        return out

    def kv_info(self) -> dict[str, Any]:
        return {**super().kv_info(), "cuda_graphs": len(self.graphs)}

    def close(self) -> None:
        for graph, *_ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        super().close()


def note(name: str) -> str:
    """The JSON's ``note`` of a ``forcingkv_own*`` row."""
    base = ("Forcing-KV's own attention path (its caches and per-forward concatenation of sink + dynamic + window + "
            "current per head group, FA3 per group; benchmarks/forcing_kv_peer.py), published Self-Forcing config; "
            "other semantics than the library's full-window rows: rel_err_vs_library reported, not checked")
    if name.endswith("_compiled"):
        return base + ("; torch.compile(model, fullgraph=True, dynamic=False), FA3 a custom op, from the settled cache "
                       "state on (the transient first chunks eager: their graphs would only add compile time)")
    if name.endswith("_graph"):
        return base + "; that compiled step's two settled forwards replayed from hand-captured CUDA graphs"
    return base


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.forcing_kv_peer --write-heads PATH``: the library's HeadRetention JSON of the peer's
    configuration at a preset (:func:`library_head_retention` of :func:`published_self_forcing`; the file
    ``benchmarks/configs/forcingkv_selfforcing_dynamic_wan1.3b.json`` is its default output)."""
    import argparse

    from ardiff_modules.models.wan_causal_dit import PRESETS

    p = argparse.ArgumentParser(prog="python -m benchmarks.forcing_kv_peer", description=main.__doc__)
    p.add_argument("--write-heads", type=Path, required=True, metavar="PATH", help="HeadRetention JSON to write")
    p.add_argument("--preset", choices=sorted(PRESETS), default="wan2.1-1.3b")
    p.add_argument("--dynamic", choices=("on", "off"), default="on", help="Forcing-KV's dynamic_temporal_enabled")
    p.add_argument("--forcingkv-heads", type=Path, default=None,
                   help="Forcing-KV's head file (default: the fixed-seed map end_to_end's forcingkv_own* rows use)")
    p.add_argument("--seed", type=int, default=0, help="the fixed-seed map's seed (end_to_end's --seed)")
    args = p.parse_args(argv)
    cfg = published_self_forcing(WanConfig.preset(args.preset), heads=args.forcingkv_heads, seed=args.seed,
                                 dynamic=args.dynamic == "on")
    library_head_retention(cfg).to_json(args.write_heads)
    print(f"wrote {args.write_heads}: {cfg.heads_source}; dynamic {args.dynamic}, {cfg.num_frame_patch} patches a "
          f"frame of {cfg.frame_tokens} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
