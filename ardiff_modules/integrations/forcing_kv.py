"""Forcing-KV's own configuration, read unchanged: its head file and its YAML's ``forcingkv:`` block.

::

    from ardiff_modules.integrations.forcing_kv import load_forcing_kv

    cfg = load_forcing_kv("configs_head/forcingkv_heads_selfforcing.json",
                          "configs/forcing-kv/forcingkv_self_forcing_inference.yaml")   # or the block as a dict
    heads = cfg.head_retention(num_layers=30, num_kv_heads=12, chunk_frames=3)  # what is expressible today

What the method keeps (zju-jiyicheng/Forcing-KV at commit ``50ac1f454348e7f0a2e54bde71e1652b20c09fe6``,
``wan/modules/causal_model_forcingkv.py``: ``CausalWanSelfAttention.forward`` / ``dynamic_compression``,
``CausalWanModel._apply_offline_head_allocation`` / ``_forward_inference``; driven by
``pipeline/causal_inference_forcingkv.py``). Units: a *frame* is ``HW`` tokens (one latent frame, 1560 for
Wan2.1 at 480x832); an AR step is a block of **3 frames** (hard-coded: ``current_start_frame // 3``,
``3 * frame_tokens``). ``S`` = ``model_kwargs.sink_size`` frames (outside the block), ``Ls`` / ``Lt`` / ``Ld`` =
``spatial_`` / ``temporal_`` / ``dynamic_context_length`` frames, ``H = max(Ls, Lt)``, ``P`` =
``num_frame_patch``, ``a`` = ``ar_start``.

* **Writes.** Only the clean re-run of a block (timestep ``context_noise``, 0 in every published YAML:
  ``update_cache = t == 0``) writes the cache; the denoising forwards of a block read it. Keys are stored
  after RoPE (never re-rotated). Every forward reads, for each head, ``keys = [kept..., current block]``
  without a mask (the block attends all of itself); the order of the kept parts below is the concatenation
  order of the code (attention does not depend on it).
* **Before the switch** (blocks ``0 .. a``) and **at layer 0 always**: every head keeps the sink (the first
  ``S`` frames of the stream) and the last ``H`` frames after the sink (``local = post_sink[-H:]``, the
  current block included once written).
* **The switch**: after the clean re-run of block ``a`` (``AR_step == ar_start``), each layer ``>= 1``
  splits its heads by the head file: ``static_head`` = the *spatial* heads, ``dynamic_head`` = the
  *temporal* heads. The sinks are copied per group and frozen (a sink of more than ``3 (a + 1)`` frames
  would be cut there); each group's window starts as the last ``Ls`` / ``Lt`` frames of ``local``.
* **Spatial heads** (layers ``>= 1``, blocks ``> a``): sink + the last ``Ls`` frames (a ring of ``Ls * HW``
  tokens) + the current block.
* **Temporal heads** (layers ``>= 1``, blocks ``> a``): sink + *dynamic patches* + the last ``Lt`` frames
  + the current block. With ``dynamic_temporal_enabled: false`` there are no dynamic patches.
* **Dynamic patches** (``dynamic_temporal_enabled``; needs ``1 <= Lt <= 3`` and
  ``round(3 P * sim_retention_ratio) == Ld * P``, which the code checks): at the clean re-run of each block
  after the switch, before the window slides, the *candidates* are the ``T`` frames of the temporal
  window (``T = Lt`` once full) and the first ``3 - T`` frames of the block: the 3 frames leaving the window.
  Each frame is cut into ``P`` patches of ``HW / P`` consecutive tokens (raster order: bands of rows when
  ``P`` divides ``H``). **Layer 1 alone scores**: for candidate frame ``i`` and patch ``p``, the mean over
  the patch's tokens of ``cosine(K[i, tok], K[i + 1, tok])``, ``K`` the RoPE'd keys of layer 1's temporal
  heads concatenated over heads (``[heads * head_dim]`` per token), frame ``i + 1`` the next frame (the last
  candidate against the first frame the window keeps, the *boundary*), on batch row 0 only (applied to
  every row). It keeps the ``Ld * P`` patches with the **lowest** scores (``topk(largest=False)``: the
  least similar to the next frame), sorted by flat index ``i * P + p``. Every layer ``>= 1`` keeps its own
  temporal heads' K/V at those same (frame, patch) positions (a class attribute shares layer 1's indices);
  the selection *replaces* the previous one (it is not cumulative), is read from the next block on, and is
  empty until the first re-run after the switch (and whenever the window is empty). Layer 1 must have a
  temporal head (its code fails otherwise).
* **The realtime file** (``method: forcingkv_realtime``, Krea realtime 14B:
  ``wan/modules/causal_model_forcingkv_realtime.py``): before the switch every head attends every frame written
  (``local_attn_size: -1``; up to 32760 tokens, 21 frames at 480p: the switch comes long before). The switch
  after block ``a``'s first timestep-0 forward splits **every** layer, layer 0 included, by the head file:
  spatial heads keep the sink + the last **1** frame (hard-coded: ``static_keep = frame_tokens``, whatever
  ``spatial_context_length`` says), temporal heads the sink + the last ``Lt`` frames. It has no dynamic patches
  (``dynamic_temporal_enabled`` is read by no code there). It writes at *every* timestep-0 forward: with a
  step list ending at 0 (Krea's ``[1000, 937, 833, 625, 0]``) the last denoising forward appends the block to
  the groups' rings and the clean re-run then attends that block twice (in the ring and as itself) before
  replacing it. This library commits once, at the clean re-run, so the two agree at every forward when no
  denoising step is 0; with Krea's list every denoising forward reads the same frames but the re-run's
  attention (and so the K/V it commits from layer 1 on) differs. The interactive LongLive YAML
  (``switch_frame_indices``: a re-cache of the last frames at each prompt switch, then the groups rebuilt) is
  refused: not re-stated here.
* **Not cache semantics**: ``teacache_*`` skips whole denoising forwards (never the clean re-run),
  ``quantization_enabled`` runs SageAttention; ``use_offline_head`` is read by no code, nor is
  ``model_kwargs.local_attn_size`` by this model file's cache.

The head file: ``{"format", "profile", "num_layers", "num_heads", "description", "layers": [{"layer_idx",
"static_head", "dynamic_head"}, ...]}`` (Self-Forcing, Causal Forcing, RAVEN, LongLive: 30 layers x 12
heads; 134 / 360 heads static for Self-Forcing, Causal Forcing and RAVEN, 154 / 360 for LongLive), or a bare
list of the layer objects (Krea realtime 14B: 40 x 40, 800 static). A head is static when its attention
mass on the last 4 key frames is at least 0.8 of its mass past the first key frames (the files'
description: past the first 3; ``configs_head/head_profile.py``: past the first 1). Layer 0's entry is
present and ignored (layer 0 never splits). Like the published reader this one takes the alias keys
``static_heads`` / ``local_head(s)`` / ``spatial_head(s)`` and ``dynamic_heads`` / ``temporal_head(s)``, a
``layers`` object keyed by layer index, and a ``layer_idx`` overriding the position; unlike it, it refuses
what it would drop or fill in silently (heads out of range or repeated, missing or repeated layers,
non-object entries).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

from ardiff_modules.checks import is_int, require_int
from ardiff_modules.core.frame_retention import FrameWindowPolicy
from ardiff_modules.core.head_retention import HeadRetention
from ardiff_modules.core.phased_retention import PhasedPolicy
from ardiff_modules.core.selected_retention import SelectedFramesPolicy
from ardiff_modules.core.retention import RetentionPolicy, SinkWindowPolicy
from ardiff_modules.errors import SpecError

__all__ = ["FORCING_KV_BLOCK_FRAMES", "ForcingKVConfig", "load_forcing_kv"]

#: Frames per AR step in Forcing-KV's code (``current_start_frame // 3``, ``3 * frame_tokens``).
FORCING_KV_BLOCK_FRAMES = 3
#: The realtime variant's ``method`` (``causal_model_forcingkv_realtime.py``, Krea realtime 14B).
REALTIME = "forcingkv_realtime"
#: Frames the realtime file's spatial heads keep (``static_keep = frame_tokens``, not ``spatial_context_length``).
REALTIME_SPATIAL_FRAMES = 1

PathOrData = Union[str, "os.PathLike[str]", Mapping[str, Any], Sequence[Any]]

_STATIC_KEYS = ("static_head", "static_heads", "local_head", "local_heads", "spatial_head", "spatial_heads")
_DYNAMIC_KEYS = ("dynamic_head", "dynamic_heads", "temporal_head", "temporal_heads")

_REQUIRED = "required"  # the code reads it without a default
_IF_DYNAMIC = "required with dynamic_temporal_enabled"
#: The ``forcingkv:`` block: key -> (kind, default). Defaults are the code's ``getattr`` defaults.
_BLOCK: dict[str, tuple[str, Any]] = {
    "ar_start": ("count", _REQUIRED),
    "spatial_context_length": ("count", 1),
    "temporal_context_length": ("count", 3),
    # NOTE: the forward defaults it to 3, the allocation to 0: without the key the dynamic mode raises.
    "dynamic_context_length": ("count", _IF_DYNAMIC),
    "teacache_enabled": ("bool", _REQUIRED),
    "teacache_threshold": ("number", _REQUIRED),
    "dynamic_temporal_enabled": ("bool", _REQUIRED),
    "num_frame_patch": ("count", _IF_DYNAMIC),
    "sim_retention_ratio": ("number", 0.5),
    "use_offline_head": ("bool", None),
    "offline_head_file": ("str", None),
    "quantization_enabled": ("bool", False),
}
#: Without the dynamic mode: the allocation's 0 dynamic frames, no patch size.
_UNUSED: dict[str, Any] = {"dynamic_context_length": 0, "num_frame_patch": None}


@dataclass(frozen=True)
class ForcingKVConfig:
    """Forcing-KV's configuration (module docstring: what each field makes the cache keep).

    Lengths are in frames. ``static_heads[l]`` / ``dynamic_heads[l]`` are layer ``l``'s spatial / temporal
    K/V head indices (ascending; together ``range(num_heads)``). ``sink_frames`` (``model_kwargs.sink_size``),
    ``num_frame_per_block``, ``context_noise`` and ``method`` come from the rest of the YAML: ``None`` when
    only the ``forcingkv:`` block was given; ``interactive``: the YAML has ``switch_frame_indices`` (prompt
    switches with a re-cache, which :meth:`head_retention` refuses).
    """

    ar_start: int
    spatial_context_length: int
    temporal_context_length: int
    dynamic_context_length: int
    dynamic_temporal_enabled: bool
    num_frame_patch: int | None
    sim_retention_ratio: float
    teacache_enabled: bool
    teacache_threshold: float
    quantization_enabled: bool
    use_offline_head: bool | None
    offline_head_file: str | None
    static_heads: tuple[tuple[int, ...], ...]
    dynamic_heads: tuple[tuple[int, ...], ...]
    num_heads: int
    head_format: str | None = None
    head_profile: str | None = None
    sink_frames: int | None = None
    num_frame_per_block: int | None = None
    context_noise: float | None = None
    method: str | None = None
    interactive: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.static_heads)

    @property
    def dynamic_patches(self) -> int:
        """Patches the temporal heads keep by content (``Ld * P``), 0 when the dynamic mode is off."""
        if not self.dynamic_temporal_enabled or self.num_frame_patch is None:
            return 0
        return self.dynamic_context_length * self.num_frame_patch

    def head_retention(
        self, num_layers: int, num_kv_heads: int, chunk_frames: int, *, sink_frames: int | None = None
    ) -> HeadRetention:
        """The retention groups of this configuration: sink + window policies in chunks, or in frames.

        A chunk is ``chunk_frames`` frames (Forcing-KV's block: 3). Groups: ``"spatial"`` (sink + ``Ls``),
        ``"temporal"`` (sink + ``Lt``); layer 0's heads all go to the group of window ``max(Ls, Lt)``. The
        narrower group is a :class:`~ardiff_modules.core.phased_retention.PhasedPolicy` (the widest window until
        ``ar_start + 1`` chunks are committed) where the switch changes what it keeps. ``method:
        forcingkv_realtime``: spatial sink + 1 frame, temporal sink + ``Lt``, every layer (0 included) split by
        the head file, each group a PhasedPolicy keeping every frame until the switch where that differs.
        ``sink_frames`` overrides the YAML's ``model_kwargs.sink_size`` (needed when only the block was
        loaded). :class:`SpecError` names what is not expressible yet (:func:`_chunk_policies`).
        """
        owner = "ForcingKVConfig.head_retention"
        require_int(f"{owner}.num_layers", num_layers, minimum=1)
        require_int(f"{owner}.num_kv_heads", num_kv_heads, minimum=1)
        require_int(f"{owner}.chunk_frames", chunk_frames, minimum=1)
        if (num_layers, num_kv_heads) != (self.num_layers, self.num_heads):
            raise SpecError(
                f"{owner}: expected the model's geometry to match the head file, got num_layers={num_layers}, "
                f"num_kv_heads={num_kv_heads} for a head file of {self.num_layers} layers x {self.num_heads} heads"
            )
        sink = self.sink_frames if sink_frames is None else require_int(f"{owner}.sink_frames", sink_frames, minimum=0)
        if sink is None:
            raise SpecError(
                f"{owner}: expected sink_frames (Forcing-KV's model_kwargs.sink_size, outside the forcingkv: block), "
                f"got none: pass sink_frames= or load the whole YAML"
            )
        self._check_run(owner, chunk_frames)
        gaps = _phase_gaps(self.ar_start, chunk_frames, sink)
        if gaps:
            raise SpecError(f"{owner}: not yet expressible: {'; '.join(gaps)}")
        if self.method == REALTIME:
            policies, rows = _realtime_policies(self, chunk_frames, sink), []
        else:
            policies, layer0 = _chunk_policies(self, chunk_frames, sink)
            rows = [[layer0] * num_kv_heads]
        for static in self.static_heads[len(rows):]:
            rows.append(["spatial" if h in static else "temporal" for h in range(num_kv_heads)])
        used = {g for row in rows for g in row}
        return HeadRetention({g: p for g, p in policies.items() if g in used}, rows)

    def _check_run(self, owner: str, chunk_frames: int) -> None:
        """The parts of the YAML outside the block that change what the cache keeps."""
        if self.method not in (None, "forcingkv", REALTIME):
            raise SpecError(
                f"{owner}: expected method 'forcingkv' or {REALTIME!r} (causal_model_forcingkv.py and its realtime "
                f"variant, the semantics re-stated here), got {self.method!r} (another model file)"
            )
        if self.interactive:
            raise SpecError(
                f"{owner}: not yet expressible: the interactive pipeline's prompt switches (switch_frame_indices: "
                f"the cache reset, the last frames re-cached with full attention, the head groups rebuilt) are not "
                f"re-stated here; expected a YAML without switch_frame_indices, got one"
            )
        if self.context_noise not in (None, 0):
            raise SpecError(
                f"{owner}: expected context_noise 0, got {self.context_noise} (Forcing-KV writes its cache only "
                f"at timestep 0: this run never writes it)"
            )
        if self.num_frame_per_block is not None and self.num_frame_per_block != chunk_frames:
            raise SpecError(
                f"{owner}: expected chunk_frames to be the YAML's num_frame_per_block={self.num_frame_per_block}, "
                f"got {chunk_frames}"
            )
        if chunk_frames != FORCING_KV_BLOCK_FRAMES:
            raise SpecError(
                f"{owner}: expected chunk_frames={FORCING_KV_BLOCK_FRAMES} (Forcing-KV counts AR steps and "
                f"dynamic candidates in 3-frame blocks), got {chunk_frames}"
            )


def _chunk_policies(
    cfg: ForcingKVConfig, chunk_frames: int, sink_frames: int
) -> tuple[dict[str, RetentionPolicy], str]:
    """``({"spatial": policy, "temporal": policy}, layer 0's group)`` (the caller refused a sink cut at the switch,
    :func:`_phase_gaps`). Whole-chunk sinks and windows give :class:`SinkWindowPolicy` (in chunks); any frame count
    that cuts a chunk (the published configurations: sink 1, windows of 1 frame) gives :class:`FrameWindowPolicy`
    for both groups (chunks trimmed to their kept frames). A group whose window narrows at the switch, where that
    changes what it keeps, is a :class:`PhasedPolicy`: the widest window until ``ar_start + 1`` chunks are
    committed (every head keeps it up to the forward of block ``ar_start``, and its clean re-run writes it), its
    own from the forward of block ``ar_start + 1`` on. Layer 0 goes to the widest group, which never switches.
    """
    sink, spatial, temporal = sink_frames, cfg.spatial_context_length, cfg.temporal_context_length
    layer0 = "temporal" if temporal >= spatial else "spatial"
    framed = bool(sink % chunk_frames or spatial % chunk_frames or temporal % chunk_frames or cfg.dynamic_patches)

    def policy(window: int, selected: bool = False) -> RetentionPolicy:
        if selected:  # the temporal heads' dynamic patches: chosen from layer 1's keys after the switch
            return SelectedFramesPolicy(
                sink, window, chunk_frames, cfg.dynamic_context_length, cfg.num_frame_patch or 1,
                select_from=cfg.ar_start + 1, score_layer=1,
            )
        if framed:
            return FrameWindowPolicy(sink, window, chunk_frames)
        return SinkWindowPolicy(sink // chunk_frames, window // chunk_frames)

    widest = max(spatial, temporal)
    policies: dict[str, RetentionPolicy] = {}
    for name, window in (("spatial", spatial), ("temporal", temporal)):
        selected = name == "temporal" and bool(cfg.dynamic_patches)
        # Until the switch every head keeps the widest window: the same as this group's own while the frames after
        # the sink still fit it, i.e. up to block ar_start, which attends the ar_start blocks committed.
        if window < widest and chunk_frames * cfg.ar_start - sink > window:
            policies[name] = PhasedPolicy(policy(widest), policy(window, selected), cfg.ar_start + 1)
        else:
            policies[name] = policy(window, selected)
    if layer0 == "temporal" and cfg.dynamic_patches:  # layer 0 never selects: the widest window alone
        layer0 = "layer0"
        policies[layer0] = policy(widest)
    return policies, layer0


def _realtime_policies(cfg: ForcingKVConfig, chunk_frames: int, sink_frames: int) -> dict[str, RetentionPolicy]:
    """The realtime file's groups (module docstring): every frame kept until block ``ar_start``'s clean re-run,
    then the sink + 1 frame (spatial) or + ``Lt`` frames (temporal), frames being what a 1-frame window counts."""
    everything = chunk_frames * cfg.ar_start - sink_frames  # the frames after the sink that block ar_start reads
    policies: dict[str, RetentionPolicy] = {}
    for name, window in (("spatial", REALTIME_SPATIAL_FRAMES), ("temporal", cfg.temporal_context_length)):
        own = FrameWindowPolicy(sink_frames, window, chunk_frames)
        if everything > window:
            policies[name] = PhasedPolicy(FrameWindowPolicy(sink_frames, everything, chunk_frames), own,
                                          cfg.ar_start + 1)
        else:
            policies[name] = own
    return policies


def _phase_gaps(ar_start: int, block: int, sink: int) -> list[str]:
    """What changes at the switch after block ``ar_start`` (frames; ``block`` frames a block) that no policy says:
    a sink longer than the blocks before it."""
    if sink <= block * (ar_start + 1):
        return []
    # NOTE: not a PhasedPolicy of two sinks: the sinks freeze at the 3 (ar_start + 1) frames written, and layer 0
    # (which never switches) goes on cutting its post-sink part at sink_size frames of [frozen sink, local, block],
    # eating into its own window: no sink + window rule (causal_model_forcingkv.py, the not-grouped update).
    return [
        f"a sink cut at the switch (the sinks freeze after block ar_start; layer 0 then keeps no sink + window rule): "
        f"expected at most {block} x (ar_start + 1) = {block * (ar_start + 1)} sink frames (the frames written "
        f"before the switch), got {sink}"
    ]


# ---------------------------------------------------------------------------------------------- loading
def load_forcing_kv(head_file: PathOrData, config: PathOrData) -> ForcingKVConfig:
    """Forcing-KV's head file and ``forcingkv:`` block, read unchanged and validated.

    ``head_file``: the path of its JSON (or the parsed JSON). ``config``: the path of its YAML (needs
    PyYAML; a ``.json`` path does not), or a mapping: the whole parsed YAML (with a ``forcingkv`` key: the
    sink, block size, ``context_noise`` and ``method`` are read too) or the block itself.
    :class:`SpecError` names the file, the field, what was expected and what was found.
    """
    head_where, payload = _load(head_file, "head_file", yaml_ok=False)
    cfg_where, data = _load(config, "config", yaml_ok=True)
    if not isinstance(data, Mapping):
        raise SpecError(
            f"{cfg_where}: expected a mapping (the YAML or its forcingkv: block), got {type(data).__name__}"
        )
    whole = "forcingkv" in data
    block = data["forcingkv"] if whole else data
    if not isinstance(block, Mapping):
        raise SpecError(f"{cfg_where}: forcingkv: expected a mapping, got {type(block).__name__}")
    fields = _parse_block(block, f"{cfg_where}: forcingkv")
    heads = _parse_heads(payload, head_where)
    extra = _parse_run(data, cfg_where) if whole else {}
    cfg = ForcingKVConfig(**fields, **heads, **extra)
    if cfg.dynamic_patches and cfg.num_layers > 1 and not cfg.dynamic_heads[1]:
        raise SpecError(
            f"{head_where}: layers[1].dynamic_head: expected at least one temporal head (Forcing-KV scores the "
            f"dynamic patches on layer 1's temporal keys; its code fails without one), got none"
        )
    return cfg


def _load(source: PathOrData, what: str, *, yaml_ok: bool) -> tuple[str, Any]:
    """``(where, parsed)``: a path is read (JSON, or YAML when ``yaml_ok``), data passes as it is."""
    if isinstance(source, (Mapping, list, tuple)):
        return f"load_forcing_kv({what})", source
    if not isinstance(source, (str, os.PathLike)):
        raise SpecError(f"load_forcing_kv({what}): expected a path or parsed data, got {type(source).__name__}")
    path = os.fspath(source)
    where = f"load_forcing_kv({what}={path!r})"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{where}: expected a readable UTF-8 file, got {type(exc).__name__}: {exc}") from exc
    if not yaml_ok or path.endswith(".json"):
        try:
            return where, json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpecError(f"{where}: expected JSON, got {exc}") from exc
    try:
        import yaml  # type: ignore[import-untyped]  # optional (YAML paths only), no stubs required
    except ImportError as exc:
        raise SpecError(
            f"{where}: expected PyYAML to read a YAML file, got none installed: pip install pyyaml, or pass the "
            f"parsed YAML (or its forcingkv: block) as a dict"
        ) from exc
    try:
        return where, yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError(f"{where}: expected YAML, got {exc}") from exc


def _value(where: str, kind: str, value: Any) -> Any:
    """One field checked for its kind: ``count`` (int >= 0), ``bool``, ``number`` (finite), ``str``."""
    if kind == "count":
        return require_int(where, value, minimum=0)
    if kind == "bool":
        if not isinstance(value, bool):
            raise SpecError(f"{where}: expected true or false, got {value!r} ({type(value).__name__})")
        return value
    if kind == "number":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise SpecError(f"{where}: expected a finite number, got {value!r} ({type(value).__name__})")
        return float(value)
    if not isinstance(value, str):
        raise SpecError(f"{where}: expected a string, got {value!r} ({type(value).__name__})")
    return value


def _parse_block(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The ``forcingkv:`` block's fields, each checked, and their agreement in the dynamic mode."""
    unknown = sorted(str(k) for k in block if k not in _BLOCK)
    if unknown:
        raise SpecError(f"{where}: expected keys from {sorted(_BLOCK)}, got also {unknown}")
    dynamic = block.get("dynamic_temporal_enabled")
    out: dict[str, Any] = {}
    for key, (kind, default) in _BLOCK.items():
        if key in block:
            out[key] = _value(f"{where}.{key}", kind, block[key])
        elif default is _REQUIRED or (default is _IF_DYNAMIC and dynamic is True):
            need = "required" if default is _REQUIRED else default
            raise SpecError(f"{where}: expected key {key!r} ({need}), got none")
        else:
            out[key] = _UNUSED[key] if default is _IF_DYNAMIC else default
    out["sim_retention_ratio"] = float(out["sim_retention_ratio"])
    if not 0.0 <= out["sim_retention_ratio"] <= 1.0:
        raise SpecError(f"{where}.sim_retention_ratio: expected a number in [0, 1], got {out['sim_retention_ratio']}")
    if out["dynamic_temporal_enabled"]:
        _check_dynamic(out, where)
    return out


def _check_dynamic(f: dict[str, Any], where: str) -> None:
    """What ``dynamic_compression`` raises on, said before a run."""
    patches = require_int(f"{where}.num_frame_patch", f["num_frame_patch"], minimum=1)
    if not 1 <= f["temporal_context_length"] <= FORCING_KV_BLOCK_FRAMES:
        raise SpecError(
            f"{where}.temporal_context_length: expected 1 to 3 frames with dynamic_temporal_enabled, got "
            f"{f['temporal_context_length']}"
        )
    if f["dynamic_context_length"] > FORCING_KV_BLOCK_FRAMES:
        raise SpecError(
            f"{where}.dynamic_context_length: expected at most 3 frames (the candidates are 3 frames), got "
            f"{f['dynamic_context_length']}"
        )
    # NOTE: Python's round (half to even), as the code's int(round(...)).
    by_ratio = int(round(FORCING_KV_BLOCK_FRAMES * patches * f["sim_retention_ratio"]))
    by_length = f["dynamic_context_length"] * patches
    if by_ratio != by_length:
        raise SpecError(
            f"{where}: expected sim_retention_ratio and dynamic_context_length to keep the same patches: "
            f"round(3 x {patches} x {f['sim_retention_ratio']}) = {by_ratio}, got dynamic_context_length x "
            f"num_frame_patch = {f['dynamic_context_length']} x {patches} = {by_length}"
        )


def _parse_run(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The whole YAML's fields that shape the cache, with the defaults of Forcing-KV's pipeline."""
    kwargs = data.get("model_kwargs", {})
    if not isinstance(kwargs, Mapping):
        raise SpecError(f"{where}: model_kwargs: expected a mapping, got {type(kwargs).__name__}")
    method = data.get("method")
    return {
        "sink_frames": _value(f"{where}: model_kwargs.sink_size", "count", kwargs.get("sink_size", 0)),
        "num_frame_per_block": require_int(
            f"{where}: num_frame_per_block", data.get("num_frame_per_block", 1), minimum=1
        ),
        "context_noise": _value(f"{where}: context_noise", "number", data.get("context_noise", 0)),
        "method": None if method is None else _value(f"{where}: method", "str", method),
        "interactive": "switch_frame_indices" in data,
    }


def _parse_heads(payload: Any, where: str) -> dict[str, Any]:
    """The head file: per layer, the static and dynamic head indices, covering every head exactly once."""
    declared_heads = None
    meta: dict[str, Any] = {"head_format": None, "head_profile": None}
    layers = payload
    if isinstance(payload, Mapping):
        if "layers" not in payload:
            raise SpecError(f"{where}: expected a 'layers' key (or a bare list of layers), got keys {sorted(payload)}")
        layers = payload["layers"]
        declared_heads = payload.get("num_heads")
        if declared_heads is not None:
            require_int(f"{where}: num_heads", declared_heads, minimum=1)
        for key in ("format", "profile"):
            if payload.get(key) is not None:
                meta[f"head_{key}"] = _value(f"{where}: {key}", "str", payload[key])
    items = _layer_items(layers, where)
    found: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for position, item in items:
        index, groups = _parse_layer(item, position, where)
        if index in found:
            raise SpecError(f"{where}: layers: expected each layer_idx once, got {index} twice")
        found[index] = groups
    num_layers = len(found)
    declared_layers = payload.get("num_layers") if isinstance(payload, Mapping) else None
    if declared_layers is not None and declared_layers != num_layers:
        raise SpecError(f"{where}: num_layers: expected the {num_layers} layers listed, got {declared_layers!r}")
    if sorted(found) != list(range(num_layers)):
        raise SpecError(f"{where}: layers: expected layer_idx 0 to {num_layers - 1}, got {sorted(found)}")
    widths = {len(s) + len(d) for s, d in found.values()}
    num_heads = declared_heads if declared_heads is not None else max(widths)
    for index in range(num_layers):
        static, dynamic = found[index]
        if sorted(static + dynamic) != list(range(num_heads)):
            raise SpecError(
                f"{where}: layers[{index}]: expected static_head + dynamic_head to be heads 0 to {num_heads - 1} "
                f"once each, got static {list(static)}, dynamic {list(dynamic)}"
            )
    return {"static_heads": tuple(found[i][0] for i in range(num_layers)),
            "dynamic_heads": tuple(found[i][1] for i in range(num_layers)), "num_heads": num_heads, **meta}


def _layer_items(layers: Any, where: str) -> list[tuple[int, Any]]:
    """``(default layer index, entry)``: a list by position, an object by its (decimal) keys."""
    if isinstance(layers, Mapping):
        items = []
        for key, item in layers.items():
            if not (is_int(key) or (isinstance(key, str) and key.isdigit())):
                raise SpecError(f"{where}: layers: expected layer indices as keys, got {key!r}")
            items.append((int(key), item))
    elif isinstance(layers, (list, tuple)):
        items = list(enumerate(layers))
    else:
        raise SpecError(f"{where}: layers: expected a list of layer objects, got {type(layers).__name__}")
    if not items:
        raise SpecError(f"{where}: layers: expected at least one layer, got none")
    return items


def _parse_layer(item: Any, position: int, where: str) -> tuple[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    """One layer object: ``(layer_idx, (static heads, dynamic heads))``, each ascending."""
    if not isinstance(item, Mapping):
        raise SpecError(
            f"{where}: layers[{position}]: expected an object with static_head / dynamic_head, got {item!r}"
        )
    index = require_int(f"{where}: layers[{position}].layer_idx", item.get("layer_idx", position), minimum=0)
    groups = []
    for names in (_STATIC_KEYS, _DYNAMIC_KEYS):
        heads: list[int] = []
        for name in names:
            value = item.get(name)
            if value is None:
                continue
            if not isinstance(value, (list, tuple)):
                raise SpecError(f"{where}: layers[{position}].{name}: expected a list of head indices, got {value!r}")
            heads += [require_int(f"{where}: layers[{position}].{name}", h, minimum=0) for h in value]
        groups.append(tuple(sorted(heads)))
    return index, (groups[0], groups[1])
