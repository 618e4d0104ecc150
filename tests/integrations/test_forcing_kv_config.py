"""``load_forcing_kv``: Forcing-KV's head file and YAML read unchanged, malformed input refused, and the
``HeadRetention`` of what is expressible today.

The fixtures copy the structure of the published files (zju-jiyicheng/Forcing-KV at 50ac1f4:
``configs_head/forcingkv_heads_selfforcing.json``, ``configs/forcing-kv/forcingkv_self_forcing_inference.yaml``)
with heads of our own. The published files themselves are read too (``tests/data/forcing_kv/``, vendored unmodified,
or a checkout's with ``FORCING_KV_REPO`` set): :func:`test_the_published_head_files` and the tests after it.
"""

from __future__ import annotations

import dataclasses

import json
import math
import os
import sys
from pathlib import Path

import pytest
import yaml

import ardiff_modules as am
from ardiff_modules.integrations.forcing_kv import ForcingKVConfig, load_forcing_kv

#: 30 layers x 12 heads; layer l's static heads: h with (h + l) % 3 == 0 (4 per layer, 120 of 360).
STATIC = [[h for h in range(12) if (h + layer) % 3 == 0] for layer in range(30)]
HEAD_FILE = {
    "format": "forcingkv_offline_head_custom2",
    "profile": "selfforcing_naive_sink_3_thr08",
    "num_layers": 30,
    "num_heads": 12,
    "description": "naive_sink_3_thr08: classify head as static when ... >= 0.800000; otherwise dynamic.",
    "layers": [{"layer_idx": i, "static_head": s, "dynamic_head": [h for h in range(12) if h not in s]}
               for i, s in enumerate(STATIC)],
}
#: The published YAML's layout (comments and keys as there; values of the Self-Forcing inference config).
YAML = """\
denoising_step_list:
- 1000
- 750
- 500
- 250
warp_denoising_step: true # need to remove - 0 in denoising_step_list if warp_denoising_step is true
num_frame_per_block: 3
model_name: pretrained/Wan2.1-T2V-1.3B
model_kwargs:
  local_attn_size: -1
  timestep_shift: 5.0
  sink_size: 1

forcingkv:
  ar_start: 1
  spatial_context_length: 1 # active in forcingkv, unit is HW
  temporal_context_length: 1 # active in forcingkv, unit is HW (3 == old local_context_length 1)
  dynamic_context_length: 1
  # Teacache
  teacache_enabled: false
  teacache_threshold: 0.2
  # Dynamic KV Cache
  dynamic_temporal_enabled: true
  num_frame_patch: 6
  sim_retention_ratio: 0.33
  # Offline Head Classification
  use_offline_head: true
  offline_head_file: configs_head/forcingkv_heads_selfforcing.json
  # FP8 quantization
  quantization_enabled: false

# inference
method: forcingkv
num_output_frames: 21 #21
context_noise: 0
global_sink: true
"""
BLOCK = {"ar_start": 1, "spatial_context_length": 1, "temporal_context_length": 1, "dynamic_context_length": 1,
         "teacache_enabled": False, "teacache_threshold": 0.2, "dynamic_temporal_enabled": True,
         "num_frame_patch": 6, "sim_retention_ratio": 0.33, "use_offline_head": True,
         "offline_head_file": "configs_head/forcingkv_heads_selfforcing.json", "quantization_enabled": False}
#: A block the library expresses: whole 3-frame windows, no dynamic patches.
CHUNKY = dict(BLOCK, spatial_context_length=3, temporal_context_length=6, dynamic_temporal_enabled=False)


def _files(tmp_path: Path, heads: object = HEAD_FILE, yaml_text: str = YAML) -> tuple[Path, Path]:
    head, config = tmp_path / "heads.json", tmp_path / "config.yaml"
    head.write_text(json.dumps(heads, indent=2))
    config.write_text(yaml_text)
    return head, config


def test_the_published_format_from_files(tmp_path: Path) -> None:
    cfg = load_forcing_kv(*_files(tmp_path))
    assert (cfg.ar_start, cfg.spatial_context_length, cfg.temporal_context_length, cfg.dynamic_context_length) == (
        1, 1, 1, 1)
    assert (cfg.dynamic_temporal_enabled, cfg.num_frame_patch, cfg.sim_retention_ratio, cfg.dynamic_patches) == (
        True, 6, 0.33, 6)
    assert (cfg.teacache_enabled, cfg.teacache_threshold, cfg.quantization_enabled, cfg.use_offline_head) == (
        False, 0.2, False, True)
    assert cfg.offline_head_file == "configs_head/forcingkv_heads_selfforcing.json"
    assert (cfg.sink_frames, cfg.num_frame_per_block, cfg.context_noise, cfg.method) == (1, 3, 0, "forcingkv")
    assert (cfg.num_layers, cfg.num_heads, cfg.head_format, cfg.head_profile) == (
        30, 12, "forcingkv_offline_head_custom2", "selfforcing_naive_sink_3_thr08")
    assert [list(s) for s in cfg.static_heads] == STATIC
    assert sum(map(len, cfg.static_heads)) == 120 and sum(map(len, cfg.dynamic_heads)) == 240
    assert cfg.dynamic_heads[1] == (0, 1, 3, 4, 6, 7, 9, 10)


def test_dicts_the_block_alone_and_the_code_defaults() -> None:
    """The block alone leaves the YAML's other fields unknown; keys the code reads with a default take it."""
    whole = load_forcing_kv(HEAD_FILE, {"forcingkv": BLOCK, "model_kwargs": {"sink_size": 2}, "method": "forcingkv"})
    assert (whole.sink_frames, whole.num_frame_per_block, whole.context_noise) == (2, 1, 0)  # pipeline defaults
    alone = load_forcing_kv(HEAD_FILE, BLOCK)
    assert (alone.sink_frames, alone.num_frame_per_block, alone.context_noise, alone.method) == (None,) * 4
    minimal = {k: BLOCK[k] for k in ("ar_start", "teacache_enabled", "teacache_threshold")}
    cfg = load_forcing_kv(HEAD_FILE, dict(minimal, dynamic_temporal_enabled=False))
    assert (cfg.spatial_context_length, cfg.temporal_context_length, cfg.dynamic_context_length) == (1, 3, 0)
    assert (cfg.sim_retention_ratio, cfg.num_frame_patch, cfg.quantization_enabled) == (0.5, None, False)
    assert (cfg.use_offline_head, cfg.offline_head_file, cfg.dynamic_patches) == (None, None, 0)


def test_the_other_head_file_layouts() -> None:
    """A bare list (the realtime 14B file), layers keyed by index, the reader's alias keys, layer_idx first."""
    layers = [{"layer_idx": 1, "spatial_heads": [1], "temporal_heads": [0, 2]},
              {"layer_idx": 0, "local_head": [0], "static_heads": [2], "dynamic_heads": [1]}]
    cfg = load_forcing_kv(layers, CHUNKY)
    assert (cfg.static_heads, cfg.dynamic_heads, cfg.num_heads) == (((0, 2), (1,)), ((1,), (0, 2)), 3)
    keyed = load_forcing_kv({"layers": {"1": layers[0], "0": layers[1]}}, CHUNKY)
    assert keyed.static_heads == cfg.static_heads and keyed.head_format is None


def _layer(static: list, dynamic: list, index: int | None = None) -> dict:
    return {"static_head": static, "dynamic_head": dynamic, **({} if index is None else {"layer_idx": index})}


@pytest.mark.parametrize("payload, message", [
    ({"num_heads": 4, "layers": [_layer([0, 1], [1, 2, 3])]},
     r"layers\[0\]: expected static_head \+ dynamic_head to be heads 0 to 3 once each, got static \[0, 1\], "
     r"dynamic \[1, 2, 3\]"),
    ({"num_heads": 4, "layers": [_layer([0], [1, 2])]}, r"heads 0 to 3 once each, got static \[0\], dynamic \[1, 2\]"),
    ({"num_heads": 2, "layers": [_layer([0], [1, 2])]}, r"heads 0 to 1 once each, got static \[0\], dynamic \[1, 2\]"),
    ({"layers": [_layer([0], [1]), _layer([0], [1, 2])]}, r"layers\[0\]: expected .* heads 0 to 2 once each"),
    ({"layers": [_layer([-1], [0])]}, r"layers\[0\]\.static_head: expected an int >= 0, got -1"),
    ({"layers": [_layer([0], [True])]}, r"layers\[0\]\.dynamic_head: expected an int >= 0, got True \(bool\)"),
    ({"layers": [_layer([0], 1)]}, r"layers\[0\]\.dynamic_head: expected a list of head indices, got 1"),
    ({"layers": [_layer([0], [1], 0), _layer([0], [1], 2)]}, r"layers: expected layer_idx 0 to 1, got \[0, 2\]"),
    ({"layers": [_layer([0], [1], 0), _layer([1], [0], 0)]}, r"expected each layer_idx once, got 0 twice"),
    ({"num_layers": 30, "layers": [_layer([0], [1])]}, r"num_layers: expected the 1 layers listed, got 30"),
    ({"num_heads": "12", "layers": [_layer([0], [1])]}, r"num_heads: expected an int >= 1, got '12' \(str\)"),
    ({"layers": [[0, 1]]}, r"layers\[0\]: expected an object with static_head / dynamic_head, got \[0, 1\]"),
    ({"layers": "all"}, r"layers: expected a list of layer objects, got str"),
    ({"layers": []}, r"layers: expected at least one layer, got none"),
    ({"layers": {"first": _layer([0], [1])}}, r"layers: expected layer indices as keys, got 'first'"),
    ({"heads": []}, r"expected a 'layers' key \(or a bare list of layers\), got keys \['heads'\]"),
])
def test_malformed_head_files_name_the_file_and_expected_vs_actual(
    tmp_path: Path, payload: object, message: str
) -> None:
    head, _ = _files(tmp_path, heads=payload)
    with pytest.raises(am.SpecError, match=rf"load_forcing_kv\(head_file='{head}'\): .*{message}"):
        load_forcing_kv(head, CHUNKY)


@pytest.mark.parametrize("change, message", [
    ({"spatial_context_len": 1}, r"expected keys from \[.*\], got also \['spatial_context_len'\]"),
    ({"ar_start": 1.5}, r"forcingkv\.ar_start: expected an int >= 0, got 1\.5 \(float\)"),
    ({"ar_start": -1}, r"forcingkv\.ar_start: expected an int >= 0, got -1"),
    ({"teacache_enabled": "false"}, r"forcingkv\.teacache_enabled: expected true or false, got 'false' \(str\)"),
    ({"teacache_threshold": float("nan")}, r"forcingkv\.teacache_threshold: expected a finite number, got nan"),
    ({"offline_head_file": 3}, r"forcingkv\.offline_head_file: expected a string, got 3 \(int\)"),
    ({"sim_retention_ratio": 1.5}, r"forcingkv\.sim_retention_ratio: expected a number in \[0, 1\], got 1\.5"),
    ({"temporal_context_length": 4},
     r"forcingkv\.temporal_context_length: expected 1 to 3 frames with dynamic_temporal_enabled, got 4"),
    ({"dynamic_context_length": 4, "sim_retention_ratio": 1.0},
     r"forcingkv\.dynamic_context_length: expected at most 3 frames .*, got 4"),
    ({"sim_retention_ratio": 0.5},
     r"expected sim_retention_ratio and dynamic_context_length to keep the same patches: round\(3 x 6 x 0\.5\) = "
     r"9, got dynamic_context_length x num_frame_patch = 1 x 6 = 6"),
    ({"num_frame_patch": 0}, r"forcingkv\.num_frame_patch: expected an int >= 1, got 0"),
])
def test_malformed_blocks_name_the_field_and_expected_vs_actual(change: dict, message: str) -> None:
    with pytest.raises(am.SpecError, match=rf"^load_forcing_kv\(config\): (forcingkv: )?{message}"):
        load_forcing_kv(HEAD_FILE, dict(BLOCK, **change))


@pytest.mark.parametrize("missing", ["ar_start", "teacache_enabled", "teacache_threshold", "dynamic_temporal_enabled",
                                     "dynamic_context_length", "num_frame_patch"])
def test_keys_the_code_reads_without_a_usable_default_are_required(missing: str) -> None:
    """The last two only with the dynamic mode (the code's defaults for them disagree or fail there)."""
    block = {k: v for k, v in BLOCK.items() if k != missing}
    with pytest.raises(am.SpecError, match=rf"expected key '{missing}' \(required.*\), got none"):
        load_forcing_kv(HEAD_FILE, block)
    if missing in ("dynamic_context_length", "num_frame_patch"):
        assert load_forcing_kv(HEAD_FILE, dict(block, dynamic_temporal_enabled=False)).dynamic_patches == 0


def test_the_dynamic_mode_needs_a_temporal_head_in_layer_1() -> None:
    heads = {"layers": [_layer([], [0, 1]), _layer([0, 1], []), _layer([0], [1])]}
    with pytest.raises(am.SpecError, match=r"layers\[1\]\.dynamic_head: expected at least one temporal head .*none"):
        load_forcing_kv(heads, BLOCK)
    assert load_forcing_kv(heads, CHUNKY).static_heads[1] == (0, 1)  # without dynamic patches: fine


def test_unreadable_files_name_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    head, config = _files(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text("{'layers': ")
    with pytest.raises(am.SpecError, match=rf"load_forcing_kv\(head_file='{bad}'\): expected JSON, got"):
        load_forcing_kv(bad, config)
    with pytest.raises(am.SpecError, match=r"load_forcing_kv\(config='.*nowhere.yaml'\): expected a readable"):
        load_forcing_kv(head, tmp_path / "nowhere.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("forcingkv: [unclosed\n")
    with pytest.raises(am.SpecError, match=rf"load_forcing_kv\(config='{broken}'\): expected YAML, got"):
        load_forcing_kv(head, broken)
    with pytest.raises(am.SpecError, match=r"load_forcing_kv\(config='.*'\): expected a mapping .*, got list"):
        load_forcing_kv(head, _files(tmp_path, yaml_text="- 1\n")[1])
    as_json = tmp_path / "config.json"
    as_json.write_text(json.dumps({"forcingkv": BLOCK}))
    monkeypatch.setitem(sys.modules, "yaml", None)  # `import yaml` raises ImportError
    assert load_forcing_kv(head, as_json).dynamic_patches == 6  # JSON needs no PyYAML
    with pytest.raises(am.SpecError, match=r"expected PyYAML to read a YAML file, .*pass the parsed YAML .* as a dict"):
        load_forcing_kv(head, config)


# ---------------------------------------------------------------------------------------------- head_retention
def test_head_retention_of_an_expressible_configuration() -> None:
    """Sink 3 frames, Ls 3, Lt 6, no dynamic patches, ar_start 1: spatial (1, 1), temporal (1, 2) in chunks;
    layer 0 keeps max(Ls, Lt) on every head, layers >= 1 follow the head file."""
    cfg = load_forcing_kv(HEAD_FILE, {"forcingkv": CHUNKY, "model_kwargs": {"sink_size": 3}, "num_frame_per_block": 3})
    retention = cfg.head_retention(30, 12, 3)
    assert retention == am.HeadRetention(
        {"spatial": (1, 1), "temporal": (1, 2)},
        [["temporal"] * 12] + [["spatial" if h in STATIC[i] else "temporal" for h in range(12)] for i in range(1, 30)],
    )
    wider_spatial = load_forcing_kv(HEAD_FILE, dict(CHUNKY, spatial_context_length=6, temporal_context_length=3))
    assert wider_spatial.head_retention(30, 12, 3, sink_frames=0).layers[0] == ("spatial",) * 12
    all_dynamic = {"layers": [_layer([], [0, 1])] * 2}
    assert set(load_forcing_kv(all_dynamic, CHUNKY).head_retention(2, 2, 3, sink_frames=3).groups) == {"temporal"}


def test_the_published_configuration_is_expressible(tmp_path: Path) -> None:
    """The published configuration: its 1-frame sink and windows are frame policies, its content-selected patches
    a SelectedFramesPolicy of the temporal group (layer 1 scores, from the first commit after the switch); layer 0,
    which never selects, keeps the widest window alone. With the dynamic mode off both groups are frame windows."""
    cfg = load_forcing_kv(*_files(tmp_path))
    retention = cfg.head_retention(30, 12, 3)
    temporal = am.SelectedFramesPolicy(1, 1, 3, keep_frames=1, patches_per_frame=6, select_from=cfg.ar_start + 1,
                                       score_layer=1)
    assert retention.groups == {"spatial": am.FrameWindowPolicy(1, 1, 3), "temporal": temporal,
                                "layer0": am.FrameWindowPolicy(1, 1, 3)}
    assert retention.layers[0] == ("layer0",) * 12
    static = dataclasses.replace(cfg, dynamic_temporal_enabled=False)
    retention = static.head_retention(30, 12, 3)
    assert retention.groups == {"spatial": am.FrameWindowPolicy(1, 1, 3), "temporal": am.FrameWindowPolicy(1, 1, 3)}
    chunky = load_forcing_kv(HEAD_FILE, dict(CHUNKY, ar_start=0))
    with pytest.raises(am.SpecError, match=r"a sink cut at the switch .*expected at most 3 x \(ar_start \+ 1\) = 3 "
                                           r"sink frames .*, got 6"):
        chunky.head_retention(30, 12, 3, sink_frames=6)


@pytest.mark.parametrize("whole, call, message", [
    ({}, dict(num_layers=30, num_kv_heads=12, chunk_frames=3),
     r"expected sink_frames \(Forcing-KV's model_kwargs\.sink_size, outside the forcingkv: block\), got none"),
    ({}, dict(num_layers=30, num_kv_heads=16, chunk_frames=3, sink_frames=3),
     r"got num_layers=30, num_kv_heads=16 for a head file of 30 layers x 12 heads"),
    ({}, dict(num_layers=30, num_kv_heads=12, chunk_frames=1, sink_frames=3),
     r"expected chunk_frames=3 \(Forcing-KV counts AR steps .* in 3-frame blocks\), got 1"),
    ({"num_frame_per_block": 1}, dict(num_layers=30, num_kv_heads=12, chunk_frames=3),
     r"expected chunk_frames to be the YAML's num_frame_per_block=1, got 3"),
    ({"method": "causvid"}, dict(num_layers=30, num_kv_heads=12, chunk_frames=3),
     r"expected method 'forcingkv' or 'forcingkv_realtime' .*, got 'causvid'"),
    ({"context_noise": 10}, dict(num_layers=30, num_kv_heads=12, chunk_frames=3),
     r"expected context_noise 0, got 10\.0 \(Forcing-KV writes its cache only at timestep 0"),
])
def test_head_retention_checks_the_run_it_describes(whole: dict, call: dict, message: str) -> None:
    config = {"forcingkv": CHUNKY, "model_kwargs": {"sink_size": 3}, "num_frame_per_block": 3, **whole} if whole \
        else CHUNKY
    with pytest.raises(am.SpecError, match=rf"ForcingKVConfig\.head_retention.*{message}"):
        load_forcing_kv(HEAD_FILE, config).head_retention(**call)


# ---------------------------------------------------------------------------------------------- published files
#: Forcing-KV's published files (zju-jiyicheng/Forcing-KV at 50ac1f4, vendored unmodified: tests/data/forcing_kv/
#: README.md), or a checkout's with FORCING_KV_REPO set.
PUBLISHED_REPO = Path(os.environ.get("FORCING_KV_REPO") or Path(__file__).resolve().parents[1] / "data" / "forcing_kv")
#: Heads in each published head file: (layers, heads, static pairs).
PUBLISHED = {"selfforcing": (30, 12, 134), "causalforcing": (30, 12, 134), "raven": (30, 12, 134),
             "longlive": (30, 12, 154), "realtime_14b": (40, 40, 800)}
#: The published YAMLs, collected at import (one test each).
PUBLISHED_YAMLS = sorted(p.name for p in (PUBLISHED_REPO / "configs/forcing-kv").glob("*.yaml"))
#: LongLive's interactive run: its prompt switches re-cache the window (the one YAML with switch_frame_indices).
INTERACTIVE = "forcingkv_longlive_interactive_inference.yaml"


def _published(name: str) -> tuple[ForcingKVConfig, dict]:
    """A published YAML loaded with its own head file, and the parsed YAML. The head file is its offline_head_file's
    name under configs_head (the vbench YAMLs give a path on the authors' machine)."""
    path = PUBLISHED_REPO / "configs/forcing-kv" / name
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    head_file = PUBLISHED_REPO / "configs_head" / Path(data["forcingkv"]["offline_head_file"]).name
    return load_forcing_kv(head_file, path), data


def test_the_published_head_files() -> None:
    """Every published head file loads, with the head counts its profile documents (the realtime 14B file a bare
    list)."""
    for name, (layers, heads, static) in PUBLISHED.items():
        cfg = load_forcing_kv(PUBLISHED_REPO / f"configs_head/forcingkv_heads_{name}.json", CHUNKY)
        assert (cfg.num_layers, cfg.num_heads, sum(map(len, cfg.static_heads))) == (layers, heads, static), name


def test_the_published_yamls_are_all_collected() -> None:
    """The parametrized tests below run on what the glob found: an empty or moved folder must fail, not pass."""
    assert len(PUBLISHED_YAMLS) == 13, PUBLISHED_YAMLS
    switching = [n for n in PUBLISHED_YAMLS if "switch_frame_indices" in _published(n)[1]]
    assert switching == [INTERACTIVE]


@pytest.mark.parametrize("name", [n for n in PUBLISHED_YAMLS if n != INTERACTIVE])
def test_a_published_yaml_gives_its_head_retention(name: str) -> None:
    """Each published run (its own head file) is expressible: the sink and block every config shares, then the
    head file's split. Forcing-KV's model file never splits layer 0; the realtime one (Krea 14B) splits every
    layer, so both groups are the head file's alone there."""
    cfg, data = _published(name)
    assert cfg.sink_frames in (0, 1) and cfg.num_frame_per_block == 3 and math.isclose(cfg.teacache_threshold, 0.2)
    retention = cfg.head_retention(cfg.num_layers, cfg.num_heads, 3)
    assert isinstance(retention, am.HeadRetention)
    split = [["spatial" if h in static else "temporal" for h in range(cfg.num_heads)] for static in cfg.static_heads]
    if data["method"] == "forcingkv_realtime":
        assert (cfg.num_layers, cfg.num_heads) == (40, 40)
        assert [list(row) for row in retention.layers] == split
        assert set(retention.groups) == {"spatial", "temporal"}
    else:
        assert data["method"] == "forcingkv"
        assert len(retention.layers[0]) == cfg.num_heads and len(set(retention.layers[0])) == 1
        assert [list(row) for row in retention.layers[1:]] == split[1:]


def test_the_interactive_yaml_is_refused() -> None:
    """LongLive's interactive run re-caches the window with the new prompt at each switch_frame_indices frame:
    no retention says that, so head_retention refuses it (naming the key) rather than describe another run."""
    cfg, _ = _published(INTERACTIVE)
    with pytest.raises(am.SpecError, match=r"switch_frame_indices"):
        cfg.head_retention(cfg.num_layers, cfg.num_heads, 3)
