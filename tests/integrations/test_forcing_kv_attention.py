"""The Forcing-KV re-statement (tests/support/forcing_kv_attention.py) checked on its own, and the part of
``ForcingKVConfig.head_retention`` the library expresses today (frame windows, a switch at ar_start) checked
against it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.integrations.forcing_kv import load_forcing_kv
from tests.support import forcing_kv_attention as fkv
from tests.support.forcing_kv_attention import ForcingKVCacheFree, ForcingKVSettings, select_patches
from tests.support.forcing_kv_realtime import ForcingKVRealtimeCacheFree
from tests.support.streaming_model import NaiveStreaming, TinyStreamingModel

HW = 4  # tokens per frame: a block of 3 frames is 12 tokens
#: The head file of the tiny model (3 layers x 4 kv heads), published format; layer 0's entry is ignored.
HEADS = {"format": "forcingkv_offline_head_custom2", "num_layers": 3, "num_heads": 4, "layers": [
    {"layer_idx": 0, "static_head": [3], "dynamic_head": [0, 1, 2]},
    {"layer_idx": 1, "static_head": [0, 2], "dynamic_head": [1, 3]},
    {"layer_idx": 2, "static_head": [1], "dynamic_head": [0, 2, 3]},
]}
STATIC = ((3,), (0, 2), (1,))


def _model(kv_heads: int = 4) -> TinyStreamingModel:
    torch.manual_seed(0)
    return TinyStreamingModel(kv_heads=kv_heads).eval()


def _rollout(runners: list, blocks: int, batch: int = 1, seed: int = 1) -> list[list[torch.Tensor]]:
    """Two denoising forwards then the clean re-run (commit) per block, the same inputs for every runner."""
    gen = torch.Generator().manual_seed(seed)
    model = runners[0].model
    text = torch.randn(batch, 5, model.context_dim, generator=gen)
    for r in runners:
        r.set_prompt(text)
    outs: list[list[torch.Tensor]] = [[] for _ in runners]
    for _ in range(blocks):
        for commit in (False, False, True):
            x = torch.randn(batch, 3 * HW, model.dim, generator=gen)
            for out, r in zip(outs, runners):
                with torch.no_grad():
                    out.append(r.forward(x, commit))
    return outs


class _Naive:
    """:class:`NaiveStreaming` of one branch, called like the re-statement."""

    def __init__(self, model: TinyStreamingModel, sink: int, window: int | None) -> None:
        self.model, self.naive = model, NaiveStreaming(model, 3 * HW, sink, window)

    def set_prompt(self, text: torch.Tensor) -> None:
        self.naive.set_prompt({"cond": text[0]})

    def forward(self, x: torch.Tensor, commit: bool) -> torch.Tensor:
        return self.naive.forward(("cond",), x, commit)


# ---------------------------------------------------------------------------------------------- the selection
def test_selection_keeps_the_patches_least_similar_to_the_next_frame() -> None:
    """Frames of 4 tokens in 2 patches: frame 1 turns patch 1 by 90 degrees against frame 0 (cosine 0), the
    boundary frame flips patch 0 of frame 2 (cosine -1), everything else repeats (cosine 1)."""
    f0 = torch.tensor([[1.0, 0.0], [0.5, 0.5], [1.0, 0.0], [1.0, 0.0]])
    f1 = f0.clone()
    f1[2:] = torch.tensor([0.0, 1.0])  # patch 1 of frame 1 orthogonal to frame 0's: frame 0 patch 1 scores 0
    f2 = f1.clone()
    boundary = f2.clone()
    boundary[:2] = -f2[:2]  # frame 2 patch 0 scores -1 against the boundary
    candidates = torch.stack([f0, f1, f2])
    assert select_patches(candidates, boundary, 2, 1).tolist() == [4]  # frame 2, patch 0: the lowest
    assert select_patches(candidates, boundary, 2, 2).tolist() == [1, 4]  # ascending flat index frame * P + patch
    assert select_patches(candidates, boundary, 2, 0).tolist() == []


def test_a_patch_scores_the_mean_token_cosine() -> None:
    """Patch 0 of frame 0: token cosines 1 and -1 (mean 0); patch 1: 0.6 each (mean 0.6): patch 0 goes first."""
    f0 = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    f1 = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.6, 0.8], [0.6, 0.8]])
    candidates = torch.stack([f0, f1, f1])
    assert select_patches(candidates, f1, 2, 1).tolist() == [0]


def test_layer_1_scores_the_frames_leaving_the_temporal_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """S=1, Lt=1, switch after block 1: block c reads what the re-run of block c - 1 chose from frames
    3(c-1) - 1 .. 3(c-1) + 1 (the window's frame and the block's first two) against frame 3(c-1) + 2, keys of
    layer 1's temporal heads, row 0; nothing before block 3 (block 1's re-run came before the switch)."""
    calls = []

    def spy(candidates: torch.Tensor, boundary: torch.Tensor, patches: int, keep: int) -> torch.Tensor:
        calls.append((candidates, boundary, patches, keep))
        return select_patches(candidates, boundary, patches, keep)

    monkeypatch.setattr(fkv, "select_patches", spy)
    settings = ForcingKVSettings(HW, 1, 1, 1, 1, STATIC, dynamic=True, dynamic_frames=1, num_frame_patch=2,
                                 retention_ratio=0.33)
    runner = ForcingKVCacheFree(_model(), settings, batch=2)
    _rollout([runner], blocks=5, batch=2)
    assert len(calls) == 2 * 3  # blocks 3 and 4, three forwards each
    for i, block in enumerate((3, 4)):
        first = 3 * (block - 1) - 1
        k1 = [runner.frames[1][f][0][0][:, [1, 3]].flatten(1) for f in range(first, first + 4)]
        candidates, boundary, patches, keep = calls[3 * i]
        torch.testing.assert_close(candidates, torch.stack(k1[:3]), rtol=0, atol=0)
        torch.testing.assert_close(boundary, k1[3], rtol=0, atol=0)
        assert (patches, keep) == (2, 2)


# ---------------------------------------------------------------------------------------------- against dense
@pytest.mark.parametrize("kv_heads, static", [(4, STATIC), (2, ((1,), (0,), (1,)))])
def test_keeping_every_candidate_patch_with_windows_covering_the_stream_is_full_attention(
    kv_heads: int, static: tuple
) -> None:
    """Sink 3 frames, Ls 9, Lt 3, ratio 1.0 (all 6 patches of the 3 frames leaving the window): blocks 0-3
    see every earlier frame (block 3: sink 0-2, dynamic 3-5, window 6-8), so they equal full block-causal
    attention; block 4 does not (its dynamic patches are frames 6-8 and frames 3-5 are gone). MHA and GQA."""
    model = _model(kv_heads)
    settings = ForcingKVSettings(HW, 3, 9, 3, 0, static, dynamic=True, dynamic_frames=3, num_frame_patch=2,
                                 retention_ratio=1.0)
    got, full = _rollout([ForcingKVCacheFree(model, settings, 1), _Naive(model, 0, None)], blocks=5)
    for i in range(12):
        torch.testing.assert_close(got[i], full[i], atol=1e-5, rtol=1e-5, msg=lambda m, i=i: f"forward {i}: {m}")
    assert all((got[i] - full[i]).abs().max() > 1e-3 for i in range(12, 15))


def test_without_dynamic_patches_equal_windows_are_a_sink_and_a_window() -> None:
    """Sink 3 frames, Ls = Lt = 3, dynamic off: every head keeps chunk 0 and the last chunk, before and after
    the switch (a time-invariant sink 1 + window 1 cache)."""
    model = _model()
    settings = ForcingKVSettings(HW, 3, 3, 3, 1, STATIC)
    got, naive = _rollout([ForcingKVCacheFree(model, settings, 1), _Naive(model, 1, 1)], blocks=6)
    for i, (a, b) in enumerate(zip(got, naive)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, i=i: f"forward {i}: {m}")


# ---------------------------------------------------------------------------------------------- against the library
def _library_vs_restatement(
    ar_start: int, retention: am.HeadRetention, frames: tuple[int, int, int] = (3, 3, 6), page: int = 4,
    contiguous_extents: bool | None = None, blocks: int = 7, restatement: type[ForcingKVCacheFree] = ForcingKVCacheFree,
) -> list[float]:
    """Max |library - re-statement| per forward (a denoising one and the commit per block): ``frames`` = (sink, Ls,
    Lt), by default 3, 3, 6; dynamic off, 2 CFG rows, ``blocks`` blocks; ``restatement``: which model file."""
    model = _model()
    spec = dataclasses.replace(model.spec(3 * HW, page, 0, None), head_retention=retention)
    cache = am.KVCache(spec, num_pages=64, backend="reference", contiguous_extents=contiguous_extents)
    session = cache.open_session()
    restated = restatement(model, ForcingKVSettings(HW, *frames, ar_start, STATIC), batch=2)
    gen = torch.Generator().manual_seed(1)
    texts = torch.randn(2, 5, model.context_dim, generator=gen)
    for branch, text in zip(("cond", "uncond"), texts):
        am.populate_cross_attention(session, branch, [b.cross for b in model.blocks], text)
    restated.set_prompt(texts)
    diffs = []
    for _ in range(blocks):
        for commit in (False, True):
            x = torch.randn(2, 3 * HW, model.dim, generator=gen)
            with torch.no_grad(), session.prepare_forward(None, 3 * HW, commit_current=commit) as fwd:
                out = model(x, fwd.layers)
            diffs.append(float((out - restated.forward(x, commit)).abs().max()))
    session.close()
    return diffs


def _block(ar_start: int) -> dict:
    return dict(ar_start=ar_start, spatial_context_length=3, temporal_context_length=6, teacache_enabled=False,
                teacache_threshold=0.2, dynamic_temporal_enabled=False)


def test_the_expressible_head_retention_equals_the_restatement() -> None:
    """Whole-chunk windows, no dynamic patches, switch early enough: the library with the HeadRetention the
    loader builds (layer 0 in the wider temporal group) equals Forcing-KV to 1e-5 at every forward."""
    retention = load_forcing_kv(HEADS, _block(1)).head_retention(3, 4, 3, sink_frames=3)
    assert retention.groups == {"spatial": am.SinkWindowPolicy(1, 1), "temporal": am.SinkWindowPolicy(1, 2)}
    assert retention.layers[0] == ("temporal",) * 4
    assert max(_library_vs_restatement(1, retention)) < 1e-5


#: (sink, Ls, Lt) frames and ar_start values where a group's window narrows at the switch after the widest one
#: was already full (3 ar_start - sink > its window): the loader builds a PhasedPolicy for it. Whole chunks, then
#: frame windows (spatial or temporal the narrower one, with and without a sink).
LATE_SWITCHES = [((3, 3, 6), 3), ((3, 3, 6), 4), ((3, 3, 6), 6), ((0, 3, 6), 2),
                 ((1, 1, 4), 1), ((1, 1, 4), 2), ((1, 1, 4), 4), ((1, 2, 1), 2), ((0, 1, 3), 3), ((2, 2, 5), 3)]


def _late(frames: tuple[int, int, int], ar_start: int) -> am.HeadRetention:
    sink, spatial, temporal = frames
    block = dict(_block(ar_start), spatial_context_length=spatial, temporal_context_length=temporal)
    return load_forcing_kv(HEADS, block).head_retention(3, 4, 3, sink_frames=sink)


def _shifted(retention: am.HeadRetention, by: int) -> am.HeadRetention:
    """``retention`` with every PhasedPolicy switching ``by`` chunks later (earlier for ``by < 0``)."""
    groups = {name: dataclasses.replace(p, at_chunk=p.at_chunk + by) if isinstance(p, am.PhasedPolicy) else p
              for name, p in retention.groups.items()}
    return am.HeadRetention(groups, retention.layers)


@pytest.mark.parametrize("frames, ar_start", LATE_SWITCHES)
def test_a_late_switch_equals_the_restatement(frames: tuple[int, int, int], ar_start: int) -> None:
    """The narrower group keeps the widest window until the clean re-run of block ar_start and its own from the
    forward of block ar_start + 1 on (PhasedPolicy, at_chunk = ar_start + 1); layer 0 and the widest group never
    switch: every forward of a rollout 4 blocks past the switch equals Forcing-KV's cache to 1e-5."""
    retention = _late(frames, ar_start)
    phased = {name: p for name, p in retention.groups.items() if isinstance(p, am.PhasedPolicy)}
    assert len(phased) == 1 and all(p.at_chunk == ar_start + 1 for p in phased.values())
    assert set(retention.layers[0]) == set(retention.groups) - set(phased)  # layer 0: the widest, unphased group
    if any(f % 3 for f in frames):
        assert all(isinstance(p.after, am.FrameWindowPolicy) for p in phased.values())
    diffs = _library_vs_restatement(ar_start, retention, frames, blocks=ar_start + 5)
    assert max(diffs) < 1e-5, diffs


@pytest.mark.parametrize("frames, ar_start", [((3, 3, 6), 3), ((1, 1, 4), 2), ((1, 2, 1), 2)])
@pytest.mark.parametrize("by", [-1, 1])
def test_a_switch_one_chunk_off_differs(frames: tuple[int, int, int], ar_start: int, by: int) -> None:
    """The boundary is exact: switching one commit early (the forward of block ar_start already narrow) or late
    (block ar_start + 1 still wide) differs from Forcing-KV at that forward, and only from there on."""
    diffs = _library_vs_restatement(ar_start, _shifted(_late(frames, ar_start), by), frames, blocks=ar_start + 4)
    first = 2 * (ar_start if by < 0 else ar_start + 1)  # the denoising forward of the first block that differs
    assert max(diffs[:first]) < 1e-5 and diffs[first] > 1e-3, diffs


def test_without_the_phase_a_late_switch_differs() -> None:
    """The re-statement sees the switch: the narrower group's own window from the start (no phase) differs from
    block ar_start's forward on -- the test above can fail."""
    retention = _late((3, 3, 6), 3)
    static = am.HeadRetention({n: p.after if isinstance(p, am.PhasedPolicy) else p
                               for n, p in retention.groups.items()}, retention.layers)
    diffs = _library_vs_restatement(3, static)
    assert max(diffs[:6]) < 1e-5 and diffs[6] > 1e-3


@pytest.mark.parametrize("frames, ar_start", [((1, 1, 1), 1), ((1, 1, 2), 0), ((2, 2, 4), 1), ((0, 1, 3), 0),
                                              ((1, 2, 1), 0)])
@pytest.mark.parametrize("page, extents", [(4, None), (2, None), (2, True)], ids=["frame-page", "half-frame", "ring"])
def test_frame_windows_equal_the_restatement(frames: tuple[int, int, int], ar_start: int, page: int,
                                             extents: bool | None) -> None:
    """Windows and sinks that cut a block (the published Self-Forcing numbers: sink 1 frame, Ls = Lt = 1) as
    FrameWindowPolicy groups: every forward of a rollout past ar_start, windows sliding, equals Forcing-KV's
    cache to 1e-5 -- one or two pages a frame, paged or inside a contiguous ring (attended paged)."""
    sink, spatial, temporal = frames
    block = dict(_block(ar_start), spatial_context_length=spatial, temporal_context_length=temporal)
    retention = load_forcing_kv(HEADS, block).head_retention(3, 4, 3, sink_frames=sink)
    assert all(isinstance(p, am.FrameWindowPolicy) for p in retention.groups.values())
    diffs = _library_vs_restatement(ar_start, retention, frames, page, extents)
    assert max(diffs) < 1e-5, diffs


def test_frame_windows_really_differ_from_chunk_windows() -> None:
    """The re-statement sees the frames: the same groups rounded up to whole chunks differ (the test can fail)."""
    chunky = am.HeadRetention({"spatial": (1, 1), "temporal": (1, 1)},
                              load_forcing_kv(HEADS, _block(1)).head_retention(3, 4, 3, sink_frames=3).layers)
    assert max(_library_vs_restatement(1, chunky, (1, 1, 1))) > 1e-3


# ---------------------------------------------------------------------------------------------- the realtime file
def _realtime(frames: tuple[int, int, int], ar_start: int, spatial_in_yaml: int = 2) -> am.HeadRetention:
    """The retention of a whole realtime YAML (``method: forcingkv_realtime``; ``frames`` = (sink, unused, Lt)).
    Its ``spatial_context_length`` is not 1 on purpose: the realtime file keeps 1 frame whatever it says."""
    sink, _, temporal = frames
    block = dict(_block(ar_start), spatial_context_length=spatial_in_yaml, temporal_context_length=temporal)
    whole = {"forcingkv": block, "method": "forcingkv_realtime", "model_kwargs": {"sink_size": sink},
             "num_frame_per_block": 3, "context_noise": 0}
    return load_forcing_kv(HEADS, whole).head_retention(3, 4, 3)


#: (sink, -, Lt) frames and ar_start: Krea's inference and VBench YAMLs (sink 0 / 1, Lt 3, ar_start 1), a late
#: switch, no switch phase (ar_start 0), a window wider than the history at the switch.
REALTIME = [((0, 1, 3), 1), ((1, 1, 3), 1), ((0, 1, 1), 3), ((1, 1, 2), 0), ((0, 1, 5), 1), ((2, 1, 4), 2)]


@pytest.mark.parametrize("frames, ar_start", REALTIME)
@pytest.mark.parametrize("page, extents", [(4, None), (2, None), (2, True)], ids=["frame-page", "half-frame", "ring"])
def test_the_realtime_file_equals_its_restatement(frames: tuple[int, int, int], ar_start: int, page: int,
                                                   extents: bool | None) -> None:
    """Krea realtime 14B's Forcing-KV file: every head attends every frame until block ar_start's clean re-run,
    then every layer -- layer 0 too -- splits by the head file into sink + 1 frame (static heads) and sink + Lt
    frames (dynamic heads): every forward of a rollout 5 blocks past the switch equals it to 1e-5."""
    retention = _realtime(frames, ar_start)
    assert retention.layers[0] == ("temporal", "temporal", "temporal", "spatial")  # layer 0's entry: static [3]
    diffs = _library_vs_restatement(ar_start, retention, frames, page, extents, blocks=ar_start + 5,
                                    restatement=ForcingKVRealtimeCacheFree)
    assert max(diffs) < 1e-5, diffs


@pytest.mark.parametrize("change", ["layer 0 unsplit", "spatial from the YAML", "no phase"])
def test_the_realtime_restatement_sees_each_rule(change: str) -> None:
    """The test above can fail: the realtime retention with layer 0 kept whole (as the other file does), with the
    YAML's 2-frame spatial window, or with the groups' own windows from the start differs from the re-statement."""
    retention = _realtime((0, 1, 3), 2)
    if change == "layer 0 unsplit":
        retention = am.HeadRetention(retention.groups, [("temporal",) * 4, *retention.layers[1:]])
    elif change == "spatial from the YAML":
        groups = dict(retention.groups, spatial=dataclasses.replace(retention.groups["spatial"],
                                                                    after=am.FrameWindowPolicy(0, 2, 3)))
        retention = am.HeadRetention(groups, retention.layers)
    else:
        retention = am.HeadRetention({n: p.after if isinstance(p, am.PhasedPolicy) else p
                                      for n, p in retention.groups.items()}, retention.layers)
    diffs = _library_vs_restatement(2, retention, (0, 1, 3), blocks=6, restatement=ForcingKVRealtimeCacheFree)
    assert max(diffs) > 1e-3, diffs
