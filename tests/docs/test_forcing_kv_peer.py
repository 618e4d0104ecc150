"""``benchmarks.forcing_kv_peer`` (Forcing-KV's own attention path, ``end_to_end``'s ``forcingkv_own*`` peer) against
the cache-free re-statement of Forcing-KV (``tests/support/forcing_kv_attention.py``) on the CPU, and the benchmark's
CPU smoke run of the variant.

The peer keeps Forcing-KV's caches (full-head sink + window, then per head group a sink, a ring and dynamic
patches) and concatenates them every forward; the re-statement derives every group's keys from all committed frames
by index arithmetic. Equal to 1e-5 in float32 at every forward of a rollout past the switch, with the windows
sliding, the dynamic patches re-chosen at every clean re-run, a ring whose write pointer moves (spatial window of 4
frames: a cat per forward), two CFG rows and GQA.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import ardiff_modules as am
from ardiff_modules import selection
from ardiff_modules.selection import forcing_kv_scores
from benchmarks import end_to_end, forcing_kv_peer
from benchmarks.host_time import stub_flashinfer
from benchmarks.forcing_kv_peer import ForcingKVCache, ForcingKVPeerConfig, wrap_attention, swapped_attention
from benchmarks.baselines import sdpa_attend
from tests.docs.test_benchmarks_smoke import _stub_ragged_wrapper
from tests.support.forcing_kv_attention import ForcingKVCacheFree, ForcingKVSettings
from tests.support.paths import BENCHMARKS
from tests.support.streaming_model import TinyStreamingModel

HW = 4  # tokens per frame: a block of 3 frames is 12 tokens
STATIC = ((3,), (0, 2), (1,))  # layer 0's unused

#: (sink, spatial, temporal, ar_start, dynamic, dynamic frames, patches, ratio, kv heads, static heads)
CASES = {
    "published_like": (1, 1, 1, 1, True, 1, 2, 0.33, 4, STATIC),
    "wider": (2, 2, 3, 2, True, 2, 2, 0.67, 4, STATIC),
    "moving_ring": (1, 4, 2, 1, True, 1, 4, 0.33, 4, STATIC),
    "no_dynamic": (3, 3, 6, 1, False, 0, 1, 0.5, 4, STATIC),
    "gqa": (1, 1, 1, 1, True, 1, 2, 0.33, 2, ((1,), (0,), (1,))),
    "empty_groups": (1, 1, 1, 1, True, 1, 2, 0.33, 4, ((), (), (0, 1, 2, 3))),  # layer 1 all temporal, 2 all spatial
}


def _configs(case: str) -> tuple[ForcingKVPeerConfig, ForcingKVSettings, int]:
    sink, spatial, temporal, ar_start, dynamic, dyn, patches, ratio, kv_heads, static = CASES[case]
    peer = ForcingKVPeerConfig(HW, sink, spatial, temporal, ar_start, static, kv_heads, dynamic=dynamic,
                               dynamic_frames=dyn, num_frame_patch=patches, retention_ratio=ratio)
    restated = ForcingKVSettings(HW, sink, spatial, temporal, ar_start, static, dynamic=dynamic, dynamic_frames=dyn,
                                 num_frame_patch=patches, retention_ratio=ratio)
    return peer, restated, kv_heads


def _rollout_vs_restatement(case: str, attend: Callable[..., torch.Tensor] = sdpa_attend,
                            blocks: int = 9) -> tuple[list[float], ForcingKVCache]:
    """Max |peer - re-statement| per forward: two denoising forwards and the clean re-run per block, 2 CFG rows."""
    peer_cfg, settings, kv_heads = _configs(case)
    peer_cfg.check()
    torch.manual_seed(0)
    model = TinyStreamingModel(kv_heads=kv_heads).eval()
    gen = torch.Generator().manual_seed(1)
    texts = torch.randn(2, 5, model.context_dim, generator=gen)
    restated = ForcingKVCacheFree(model, settings, batch=2)
    restated.set_prompt(texts)
    cache = ForcingKVCache(model, peer_cfg, list(texts), torch.device("cpu"), torch.float32)
    wrappers, diffs = wrap_attention(model, attend), []
    for _ in range(blocks):
        for commit in (False, False, True):
            x = torch.randn(2, 3 * HW, model.dim, generator=gen)
            with swapped_attention(model, wrappers), torch.no_grad():  # the re-statement runs the blocks unswapped
                cache.begin_forward(commit)
                out = model(x, cache.layers)
                cache.end_forward(commit)
            diffs.append(float((out - restated.forward(x, commit)).abs().max()))
    return diffs, cache


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_peer_equals_the_restatement_at_every_forward(case: str) -> None:
    diffs, cache = _rollout_vs_restatement(case)
    assert max(diffs) < 1e-5, diffs
    peer_cfg, state = cache.cfg, cache.forward.state
    assert state.switched and cache.settled
    if peer_cfg.keep_patches:
        assert state.dynamic == peer_cfg.dynamic_tokens  # patches chosen and read
    # A ring longer than a block moves its write pointer: the forwards change chunk after chunk; rings of at most
    # a block are rewritten whole: steady.
    assert cache.steady is (peer_cfg.history_frames <= forcing_kv_peer.BLOCK_FRAMES)
    if case == "moving_ring":
        assert state.spatial_ptr != 0  # the spatial ring is read through a cat


def test_multi_plan_fa3_plans_each_group_shape_once_over_a_stub(monkeypatch: pytest.MonkeyPatch) -> None:
    """The peer's FA3 (a stub FlashInfer computing SDPA): one wrapper per (streams, q_len, kv_len, heads) shape,
    each planned once on its first call (CPU int32 indptrs) and reused by every later forward; the outputs still
    equal the re-statement."""
    made: list = []
    monkeypatch.setitem(sys.modules, "flashinfer",
                        SimpleNamespace(BatchPrefillWithRaggedKVCacheWrapper=_stub_ragged_wrapper(made)))
    attend = forcing_kv_peer.MultiPlanFA3Attend(workspace_bytes=64)
    diffs, _ = _rollout_vs_restatement("published_like", attend)
    assert max(diffs) < 1e-5, diffs
    assert all(len(w.plans) == 1 and (w.layout, w.backend) == ("NHD", "fa3") for w in made)
    shapes = {(w.plans[0]["heads"], w.plans[0]["kv"][-1].item()) for w in made}
    assert len(shapes) == len(made) == attend.plans
    # full heads over block 0, sink + 1 + block (blocks 1 and 2, layer 0 on); per group after the switch
    assert ((4, 4, 8), 2 * 12) in shapes and ((4, 4, 8), 2 * 20) in shapes
    assert all(w.plans[0]["qo"].dtype == torch.int32 and w.plans[0]["qo"].device.type == "cpu" for w in made)
    runs = sum(len(w.runs) for w in made)
    _rollout_vs_restatement("published_like", attend, blocks=2)  # later forwards of known shapes: no plan
    assert attend.plans == len(made) and sum(len(w.runs) for w in made) > runs


def test_visible_keys_follow_the_published_config_through_the_switch() -> None:
    """S 1, Ls Lt Ld 1, a 1, 30 x 12 heads with 134 static: block 0 sees itself, block 1 sink + 1 + block,
    block 2 (switched, no patches yet) sink + 1 + block in every head, block 3 on the temporal heads 1 more frame."""
    cfg = forcing_kv_peer.published_self_forcing(end_to_end.WanConfig.preset("wan2.1-1.3b"))
    assert sum(len(s) for s in cfg.static_heads) == 134 and cfg.num_frame_patch == 6 and cfg.keep_patches == 6
    hw = cfg.frame_tokens
    assert [forcing_kv_peer.visible_keys(cfg, c) / hw for c in range(3)] == [3, 5, 5]
    temporal = sum(12 - len(s) for s in cfg.static_heads[1:])
    assert forcing_kv_peer.visible_keys(cfg, 3) / hw == pytest.approx(5 + temporal / 360)
    assert forcing_kv_peer.visible_keys(cfg, 9) == forcing_kv_peer.visible_keys(cfg, 3)


def test_end_to_end_runs_the_peer_on_the_cpu(tmp_path: Path) -> None:
    """The benchmark's CPU smoke run of ``forcingkv_own`` (SDPA for FA3): other semantics (reported, not checked),
    less KV and fewer FLOPs than the library's full window, video frames/s = 4 x latent frames/s, its config in
    the JSON, every variant in the partial JSON; the compiled and graphed forms are CUDA-only or skipped."""
    argv = ["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--cfg", "off", "--chunks-timed", "1",
            "--variants", "library,forcingkv_own", "--out", str(tmp_path)]
    assert end_to_end.main(argv) == 0
    payload = json.loads((tmp_path / "end_to_end.json").read_text())
    variants = payload["results"]["cfg_off"]["variants"]
    peer, library = variants["forcingkv_own"], variants["library"]
    assert peer["agrees"] is None and 0 < peer["rel_err_vs_library"] < 1
    assert peer["attention_kernel"].startswith("sdpa")
    assert peer["kv_peak_bytes"] < library["kv_peak_bytes"]
    assert peer["flops_per_chunk_step"] < library["flops_per_chunk_step"]
    assert peer["forcing_kv_state"]["switched"] is True and peer["forcing_kv_state"]["dynamic"] > 0
    assert peer["concat_bytes_per_forward"] > 0
    for res in (peer, library):
        assert res["video_frames_per_s"] == pytest.approx(4 * res["latent_frames_per_s"])
    config = payload["config"]["forcing_kv"]
    assert config["num_frame_patch"] == 4 and config["keep_patches"] == 4  # 16-token frames: 6 does not divide
    assert "134/360" in config["heads_source"]
    partial = json.loads((tmp_path / "end_to_end.partial.json").read_text())
    assert set(partial["partial"]["cfg_off"]["clean"]) == {"library", "forcingkv_own"}
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]  # written atomically: no temporary left


DYNAMIC_HEADS = BENCHMARKS / "configs" / "forcingkv_selfforcing_dynamic_wan1.3b.json"
E2E_TINY = ["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--chunks-timed", "2"]


def test_end_to_end_library_heads_equal_the_peer_with_dynamic_patches(tmp_path: Path) -> None:
    """``--heads forcingkv``: the library_heads rows run the peer's own configuration (its head map and numbers
    through ``ForcingKVConfig.head_retention``: a SelectedFramesPolicy temporal group, KV pages of a patch) and give
    Forcing-KV's own path's outputs to 1e-5 in float32 on the CPU, CFG off (one stream) and on (batch row 0
    compared: Forcing-KV selects on row 0 for every row); the check is recorded per row, in the targets and in the
    partial JSON; both sides attend the same keys (FLOPs counted alike), and differ from the full-window library."""
    argv = [*E2E_TINY, "--cfg", "both", "--heads", "forcingkv", "--variants", "library_heads,forcingkv_own",
            "--out", str(tmp_path)]
    assert end_to_end.main(argv) == 0
    payload = json.loads((tmp_path / "end_to_end.json").read_text())
    heads = payload["config"]["heads"]
    assert heads["same_method_as_forcingkv_own"] is True and heads["source"].startswith("forcingkv")
    assert heads["page_size"] == 4 and payload["config"]["page_size"] == 16  # 16-token frames, 4 patches
    assert heads["config"]["groups"]["temporal"] == {"sink_frames": 1, "window_frames": 1, "frames_per_chunk": 3,
                                                     "keep_frames": 1, "patches_per_frame": 4, "select_from": 2,
                                                     "score_layer": 1}
    for setting, rows in (("cfg_off", "all"), ("cfg_on", "row 0")):
        variants = payload["results"][setting]["variants"]
        library, peer = variants["library_heads"], variants["forcingkv_own"]
        assert library["forcingkv_own_reference"] == "forcingkv_own" and library["agrees_with_forcingkv_own"] is True
        assert library["agreement_counted"] is True  # float32: counted in the exit status
        assert library["rel_err_vs_forcingkv_own"] < 1e-5, library["rel_err_vs_forcingkv_own_per_step"]
        assert library["forcingkv_own_rows_compared"].startswith(rows)
        assert library["rel_err_vs_library"] > 1e-3 and peer["rel_err_vs_library"] > 1e-3  # not the full window
        assert library["page_size"] == 4 and variants["library"]["page_size"] == 16
        assert library["visible_keys_per_timed_step"] == pytest.approx(peer["visible_keys_per_timed_step"])
        assert payload["targets"]["same_method_outputs"][setting]["library_heads"]["agrees"] is True
    assert set(payload["targets"]["speedups"]["library_heads_vs_forcingkv_own"]) == {"cfg_on", "cfg_off"}
    partial = json.loads((tmp_path / "end_to_end.partial.json").read_text())["partial"]
    assert partial["cfg_off"]["clean"]["library_heads"]["agrees_with_forcingkv_own"] is True


def test_end_to_end_catches_a_library_choosing_other_patches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check sees the choice: the library's built-in score negated (its temporal heads keep the *most* similar
    patches; the configuration unchanged) disagrees with the peer, and the run exits 1."""
    monkeypatch.setattr(selection, "forcing_kv_scores", lambda c, b, p: -forcing_kv_scores(c, b, p))
    argv = [*E2E_TINY, "--cfg", "off", "--heads", "forcingkv", "--variants", "library_heads,forcingkv_own",
            "--out", str(tmp_path)]
    assert end_to_end.main(argv) == 1
    library = json.loads((tmp_path / "end_to_end.json").read_text())["results"]["cfg_off"]["variants"]["library_heads"]
    assert library["agrees_with_forcingkv_own"] is False and library["rel_err_vs_forcingkv_own"] > 1e-3


def test_a_static_heads_file_is_checked_against_the_peer_without_dynamic_patches(tmp_path: Path) -> None:
    """Forcing-KV's static method (``--forcingkv-dynamic off``) as a file with one group (every head sink 1 frame +
    the last frame, as ``forcingkv_selfforcing_static_wan1.3b.json``): the same policy per head as the peer's, so the
    rows are checked against it -- equal to 1e-5 -- and keep the preset's pages (nothing selects)."""
    path = tmp_path / "static.json"
    am.HeadRetention({"all": am.FrameWindowPolicy(1, 1, 3)}, [["all"] * 4] * 2).to_json(path)
    argv = [*E2E_TINY, "--cfg", "off", "--heads", str(path), "--forcingkv-dynamic", "off",
            "--variants", "library_heads,forcingkv_own", "--out", str(tmp_path)]
    assert end_to_end.main(argv) == 0
    payload = json.loads((tmp_path / "end_to_end.json").read_text())
    assert payload["config"]["heads"]["same_method_as_forcingkv_own"] is True
    library = payload["results"]["cfg_off"]["variants"]["library_heads"]
    assert library["agrees_with_forcingkv_own"] is True and library["rel_err_vs_forcingkv_own"] < 1e-5
    assert library["page_size"] == 16


def test_the_dynamic_heads_file_is_the_peers_configuration_at_wan_shape(tmp_path: Path) -> None:
    """``benchmarks/configs/forcingkv_selfforcing_dynamic_wan1.3b.json`` is what ``--heads forcingkv`` builds at the
    Wan2.1-1.3B shape (the peer's default map: the published per-layer static counts), regenerated byte for byte by
    ``python -m benchmarks.forcing_kv_peer --write-heads``; its patches need 260-token pages (the preset's 120 are
    refused by the spec), and its keys per head are the peer's at every commit count."""
    config = end_to_end.WanConfig.preset("wan2.1-1.3b")
    peer = forcing_kv_peer.published_self_forcing(config)
    heads = am.HeadRetention.from_json(DYNAMIC_HEADS)
    assert heads == forcing_kv_peer.library_head_retention(peer)
    assert heads.groups["temporal"] == am.SelectedFramesPolicy(1, 1, 3, keep_frames=1, patches_per_frame=6,
                                                               select_from=2, score_layer=1)
    assert heads.layers[0] == ("layer0",) * 12
    assert [row.count("spatial") for row in heads.layers[1:]] == list(forcing_kv_peer.PUBLISHED_STATIC_PER_LAYER[1:])
    assert forcing_kv_peer.main(["--write-heads", str(tmp_path / "heads.json")]) == 0
    assert (tmp_path / "heads.json").read_text() == DYNAMIC_HEADS.read_text()
    assert end_to_end.heads_page_size(heads, config) == 260
    static = am.HeadRetention.from_json(BENCHMARKS / "configs" / "forcingkv_selfforcing_static_wan1.3b.json")
    assert end_to_end.heads_page_size(static, config) == 120  # nothing selects: the preset's pages
    spec = dataclasses.replace(end_to_end.make_kv_spec(config, "cpu", ("cond",)), sink_chunks=0, window_chunks=None)
    with pytest.raises(am.SpecError, match="13 page.* patches_per_frame=6"):
        dataclasses.replace(spec, head_retention=heads)
    assert dataclasses.replace(spec, head_retention=heads, page_size=260).pages_per_chunk == 18
    for committed in range(10):
        assert end_to_end.head_visible_keys(heads, config, committed) == pytest.approx(
            forcing_kv_peer.visible_keys(peer, committed))


def test_the_graphed_heads_row_keeps_its_static_plans_at_wan_shape() -> None:
    """The host side of ``library_heads_compiled_graph`` at the Wan2.1-1.3B geometry (12 kv heads of 8 dims, 260-token
    pages; FlashInfer's wrappers stubbed, nothing launched): static forwards, 4 denoising + the committing one a chunk.
    Past the transient every forward reuses one static context whose lane plans are never rebuilt (what a CUDA graph
    captured keeps reading), each lane attends the same number of pages (the temporal lanes: sink + selection + window
    frames besides the chunk), and every temporal lane holds a selection made at the commits (after the forward)."""
    config = end_to_end.WanConfig.preset("wan2.1-1.3b")
    heads = forcing_kv_peer.library_head_retention(forcing_kv_peer.published_self_forcing(config))
    with stub_flashinfer() as backend:
        spec = dataclasses.replace(end_to_end.make_kv_spec(config, "cpu", ("cond",)), sink_chunks=0, window_chunks=None,
                                   page_size=260, head_dim=8, dtype="bfloat16")
        cache = end_to_end.grouped_kv_cache(spec, heads, device="cpu", backend=backend)
        state = cache.open_session()
        seen = []
        for _ in range(8):
            for commit in (False,) * 4 + (True,):
                fwd = state.prepare_forward(("cond",), config.chunk_size, commit_current=commit, static=True)
                for part in fwd._lane_contexts:  # what each layer's op records (a commit needs every layer)
                    part._transaction.mark_written(range(part._write_base, part._write_base + config.num_layers))
                seen.append((id(fwd), tuple(p._plan_epoch for p in fwd._lane_contexts),
                             tuple(len(p._layout.streams[0].history_pages) for p in fwd._lane_contexts)))
                fwd.commit()
        temporal = [lane for lane in cache._lanes if lane.part.group == "temporal"]
        pages = state._lane_pages("cond")
        assert temporal and all(pages[lane.index].selection is not None for lane in temporal)
        assert all(len(pages[lane.index].selection.pages) == 6 for lane in temporal)  # one frame of 6 patches
        settled = seen[3 * 5:]  # from chunk 3 on: the first selection is read
        assert len(set(settled)) == 1, settled[:2]
        counts = dict(zip((lane.index for lane in cache._lanes), settled[0][2]))
        assert all(counts[lane.index] == 3 * 6 for lane in temporal)  # sink, selection, window: a frame of 6 pages each
        state.close()
        cache.close()


@pytest.mark.gpu
def test_fa3_compiled_and_graphed_peers_agree_with_sdpa_on_the_gpu() -> None:
    """On the GPU (bf16, head_dim 128, 24-token frames: 6 patches of 4), the peer eager with FA3, compiled
    (fullgraph, FA3 a custom op) and replayed from CUDA graphs all give the eager SDPA peer's outputs at every
    forward of 7 blocks (the switch, the first patch selection, then settled: two graphs captured and replayed).
    head_dim 128 is Wan's and the GPU bundle's cached FA3 kernel: head_dim 64 made every GPU run JIT-build one."""
    config = end_to_end.WanConfig(name="fkv-gpu", num_layers=3, dim=256, num_heads=2, ffn_dim=512, latent_height=8,
                                  latent_width=12, text_tokens=8, text_dim=32, freq_dim=64)
    device, dtype = torch.device("cuda"), torch.bfloat16
    model = end_to_end.build_model(config, seed=0, device=device, dtype=dtype)
    cfg = forcing_kv_peer.published_self_forcing(config)
    assert cfg.num_frame_patch == 6 and cfg.temporal_heads(1)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        texts = [model.embed_text(torch.randn(config.text_tokens, config.text_dim, generator=g).to(device))]
    latents = [torch.randn(1, 3, config.in_channels, 8, 12, generator=g).to(device, dtype) for _ in range(7)]
    ts = [torch.full((1,), t, device=device) for t in (*end_to_end.TIMESTEPS, 0.0)]

    def rollout(attend: Callable[..., torch.Tensor], fa3: object, graph: bool, compiled: bool) -> tuple[list, object]:
        step = torch.compile(model, dynamic=False, fullgraph=True) if compiled else None
        runner_type = forcing_kv_peer.ForcingKVGraphRunner if graph else forcing_kv_peer.ForcingKVRunner
        outs = []
        with swapped_attention(model, wrap_attention(model, attend)), torch.no_grad():
            runner = runner_type(model, cfg, texts, device, dtype, step, fa3)
            for x in latents:
                for i, t in enumerate(ts):
                    outs.append(runner.forward(x, t, i == len(ts) - 1).float())
        return outs, runner

    reference, _ = rollout(sdpa_attend, None, graph=False, compiled=False)
    fa3 = forcing_kv_peer.MultiPlanFA3Attend()
    eager, _ = rollout(fa3, fa3, graph=False, compiled=False)
    torch._dynamo.reset()
    fa3_op = forcing_kv_peer.MultiPlanFA3Attend()
    graphed, runner = rollout(forcing_kv_peer.traceable_fa3(fa3_op), fa3_op, graph=True, compiled=True)
    assert len(runner.graphs) == 2
    for name, outs in (("eager fa3", eager), ("compiled + graphs", graphed)):
        for i, (out, ref) in enumerate(zip(outs, reference)):
            err = ((out - ref).norm() / ref.norm()).item()
            assert err < 3e-2, (name, i, err)
