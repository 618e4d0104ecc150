"""Forcing-KV's content-selected patches as a SelectedFramesPolicy group, against its re-statement
(tests/support/forcing_kv_attention.py, dynamic mode on): every forward equal, the chosen pages really copied, memory
exact, and every misuse refused with the pool unchanged."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.errors import SequenceLengthError
from ardiff_modules.integrations.forcing_kv import load_forcing_kv
from ardiff_modules.selection import forcing_kv_scores
from tests.integrations.test_forcing_kv_attention import HEADS, HW, STATIC, _block, _model
from tests.support.forcing_kv_attention import ForcingKVCacheFree, ForcingKVSettings

#: (sink, Ls, Lt) frames, ar_start, Ld (dynamic frames), P (patches a frame), page size (tokens; HW = 4 a frame).
CONFIGS = [
    ((1, 1, 1), 1, 1, 2, 2),  # the published numbers (sink 1, Ls = Lt = Ld = 1), 2 patches of a page each
    ((1, 1, 1), 1, 1, 2, 1),  # 2 pages a patch
    ((1, 1, 1), 0, 1, 1, 4),  # whole frames, the switch right after the first block
    ((1, 2, 1), 2, 1, 2, 2),  # a late switch: the temporal group is a PhasedPolicy around the selection
    ((0, 1, 3), 1, 2, 2, 2),  # no sink, the widest temporal window (layer 0 its own group), 2 frames kept
    ((1, 1, 2), 1, 2, 4, 1),  # 4 patches of one token page
    ((1, 3, 1), 3, 1, 2, 2),
    ((3, 3, 3), 1, 3, 1, 4),  # keep every candidate frame
]


def _retention(frames: tuple[int, int, int], ar_start: int, ld: int, patches: int) -> am.HeadRetention:
    sink, spatial, temporal = frames
    block = dict(_block(ar_start), spatial_context_length=spatial, temporal_context_length=temporal,
                 dynamic_temporal_enabled=True, dynamic_context_length=ld, num_frame_patch=patches,
                 sim_retention_ratio=ld / 3)
    return load_forcing_kv(HEADS, block).head_retention(3, 4, 3, sink_frames=sink)


def _settings(frames: tuple[int, int, int], ar_start: int, ld: int, patches: int) -> ForcingKVSettings:
    return ForcingKVSettings(HW, *frames, ar_start, STATIC, True, ld, patches, ld / 3)


def _cache(retention: am.HeadRetention, page: int, branches: tuple[str, ...] = ("cond",), pages: int = 96) -> am.KVCache:
    spec = dataclasses.replace(_model().spec(3 * HW, page, 0, None, branches=branches), head_retention=retention)
    return am.KVCache(spec, num_pages=pages, backend="reference")


class Rollout:
    """The library (one session, one stream per branch) and one batch-1 re-statement per branch, same inputs."""

    def __init__(self, cache: am.KVCache, settings: ForcingKVSettings, seed: int = 1) -> None:
        self.model, self.cache = _model(), cache
        self.session = cache.open_session()
        self.branches = cache.spec.branches
        self.restated = [ForcingKVCacheFree(self.model, settings, batch=1) for _ in self.branches]
        self.gen = torch.Generator().manual_seed(seed)
        texts = torch.randn(len(self.branches), 5, self.model.context_dim, generator=self.gen)
        for branch, text, r in zip(self.branches, texts, self.restated):
            am.populate_cross_attention(self.session, branch, [b.cross for b in self.model.blocks], text)
            r.set_prompt(text[None])

    def step(self, commit: bool, session: am.KVState | None = None) -> float:
        """One forward of every branch; max |library - re-statement|."""
        x = torch.randn(len(self.branches), 3 * HW, self.model.dim, generator=self.gen)
        with torch.no_grad(), (session or self.session).prepare_forward(None, 3 * HW, commit_current=commit) as fwd:
            out = self.model(x, fwd.layers)
        return max(float((out[i] - r.forward(x[i : i + 1], commit)[0]).abs().max()) for i, r in enumerate(self.restated))

    def blocks(self, n: int, denoise: int = 1) -> list[float]:
        return [self.step(commit) for _ in range(n) for commit in [False] * denoise + [True]]


def _temporal_lanes(cache: am.KVCache) -> list:
    return [lane for lane in cache._lanes if lane.part is not None and lane.part.group == "temporal"]


@pytest.mark.parametrize("frames, ar_start, ld, patches, page", CONFIGS)
def test_content_selection_equals_the_restatement(frames: tuple[int, int, int], ar_start: int, ld: int, patches: int,
                                                  page: int) -> None:
    """Every forward of a rollout 6 blocks past the switch (denoising and clean re-run) equals Forcing-KV's cache
    with its dynamic patches to 1e-5: the candidates, layer 1's cosine, the patches kept by every layer >= 1."""
    retention = _retention(frames, ar_start, ld, patches)
    assert any(isinstance(getattr(p, "after", p), am.SelectedFramesPolicy) for p in retention.groups.values())
    diffs = Rollout(_cache(retention, page), _settings(frames, ar_start, ld, patches)).blocks(ar_start + 6)
    assert max(diffs) < 1e-5, diffs


def test_a_wrong_choice_differs_from_the_first_block_that_reads_a_selection() -> None:
    """The re-statement sees the choice: keeping the *most* similar patches (a user scorer, the built-in negated)
    equals Forcing-KV until the first block reading a selection (block ar_start + 2) and differs from there."""
    retention = _retention((1, 1, 1), 1, 1, 2)
    flipped = dataclasses.replace(retention.groups["temporal"], scorer=lambda c, b: -forcing_kv_scores(c, b, 2))
    retention = am.HeadRetention({**retention.groups, "temporal": flipped}, retention.layers)
    diffs = Rollout(_cache(retention, 2), _settings((1, 1, 1), 1, 1, 2)).blocks(6)
    first = 2 * 3  # the denoising forward of block 3
    assert max(diffs[:first]) < 1e-5 and min(diffs[first:]) > 1e-3, diffs


def test_two_branches_select_each_on_its_own_keys() -> None:
    """CFG: each stream chooses from its own keys (Forcing-KV's batch row 0 chooses for every row; the library
    selects per stream, so each branch equals a batch-1 re-statement of its own)."""
    rollout = Rollout(_cache(_retention((1, 1, 1), 1, 1, 2), 2, ("cond", "uncond")), _settings((1, 1, 1), 1, 1, 2))
    assert max(rollout.blocks(6, denoise=2)) < 1e-5


def test_the_selection_pages_hold_the_chosen_candidate_pages() -> None:
    """Pool contents: at each scoring commit the selection's pages receive, in every layer, K and V, exactly the
    candidate pages the re-statement's layer-1 cosine chooses (ascending) -- read before the commit released them."""
    rollout = Rollout(_cache(_retention((1, 1, 1), 1, 1, 2), 2), _settings((1, 1, 1), 1, 1, 2))
    rollout.blocks(2)  # before the first scoring commit
    lanes = _temporal_lanes(rollout.cache)
    for _ in range(3):
        rollout.step(False)
        x = torch.randn(1, 3 * HW, rollout.model.dim)
        with torch.no_grad():
            fwd = rollout.session.prepare_forward(None, 3 * HW, commit_current=True)
            rollout.model(x, fwd.layers)
            rollout.restated[0].forward(x, True)
            jobs = [rollout.session._lane_pages("cond")[lane.index].preview_selection() for lane in lanes]
            written = [lane.pool.kv[:, :, list(job.candidates)].clone() for lane, job in zip(lanes, jobs)]
            fwd.commit()
        frames, kept = rollout.restated[0].selection()  # what the next block reads, by Forcing-KV's rule
        for lane, job, candidates in zip(lanes, jobs, written):
            b = rollout.session._lane_pages("cond")[lane.index]
            assert b.selection.resolved() == tuple(kept.tolist())  # one page a patch here
            assert b.selection.pages == job.destination and b.selection.start == frames[0] * HW
            assert torch.equal(lane.pool.kv[:, :, list(b.selection.pages)], candidates[:, :, list(kept.tolist())])


def test_memory_is_the_sink_the_window_and_the_selection() -> None:
    """Exact memory: past the switch each temporal lane holds sink + window frames + Ld frames of selected pages
    (plus the pending chunk while a block is denoised); the candidates' unchosen pages are gone at the commit."""
    rollout = Rollout(_cache(_retention((1, 1, 1), 1, 1, 2), 2), _settings((1, 1, 1), 1, 1, 2))
    rollout.blocks(5)
    for lane in _temporal_lanes(rollout.cache):
        per_frame = 2
        assert lane.allocator.num_used == (1 + 1 + 1) * per_frame  # sink + window + the selection, nothing pending
        b = rollout.session._lane_pages("cond")[lane.index]
        assert len(b.history_pages()) == 3 * per_frame


def test_an_aborted_commit_leaves_pool_and_selection_unchanged() -> None:
    """A committing forward reserves the next selection's pages; an abort returns them and changes nothing else:
    the selection, the pool's contents and the free list are as before, and the rollout goes on equal."""
    rollout = Rollout(_cache(_retention((1, 1, 1), 1, 1, 2), 2), _settings((1, 1, 1), 1, 1, 2))
    rollout.blocks(4)
    lanes = _temporal_lanes(rollout.cache)
    before = [(lane.allocator.num_used, lane.pool.kv.clone(), rollout.session._lane_pages("cond")[lane.index].selection)
              for lane in lanes]
    x = torch.randn(1, 3 * HW, rollout.model.dim)
    with torch.no_grad():
        fwd = rollout.session.prepare_forward(None, 3 * HW, commit_current=True)
        rollout.model(x, fwd.layers)
        assert all(rollout.session._lane_pages("cond")[lane.index].pending_selection for lane in lanes)
        fwd.abort()
    for lane, (used, kv, selection) in zip(lanes, before):
        b = rollout.session._lane_pages("cond")[lane.index]
        assert lane.allocator.num_used == used and b.selection == selection and not b.pending_selection
        history = torch.tensor(b.history_pages())
        assert torch.equal(lane.pool.kv[:, :, history], kv[:, :, history])
    assert max(rollout.blocks(2)) < 1e-5


def test_no_room_for_the_selection_is_refused_before_anything_changes() -> None:
    """A pool with room for the pending chunk but not for the selection it would make: CapacityError at prepare,
    nothing reserved."""
    retention = _retention((1, 1, 1), 1, 1, 2)
    rollout = Rollout(_cache(retention, 2, pages=12), _settings((1, 1, 1), 1, 1, 2))
    rollout.blocks(3)
    lanes = _temporal_lanes(rollout.cache)
    for lane in lanes:  # fill the lane but for one chunk's pages
        lane.allocator.allocate(lane.allocator.num_free - 6)
    used = [lane.allocator.num_used for lane in lanes]
    with pytest.raises(am.CapacityError, match="needs 8 more pages"):
        rollout.session.prepare_forward(None, 3 * HW, commit_current=True)
    assert [lane.allocator.num_used for lane in lanes] == used


def test_a_multi_chunk_commit_is_refused() -> None:
    """Each chunk's commit scores its own leaving frames: a forward committing two chunks is refused, unchanged."""
    rollout = Rollout(_cache(_retention((1, 1, 1), 1, 1, 2), 2), _settings((1, 1, 1), 1, 1, 2))
    with pytest.raises(SequenceLengthError, match="expected one chunk per committing forward .* got 2 chunks"):
        rollout.session.prepare_forward(None, 6 * HW, commit_current=True)
    assert max(rollout.blocks(4)) < 1e-5


def test_a_scorer_of_the_wrong_shape_aborts_the_commit() -> None:
    """A user scorer answering another shape: TensorMismatchError naming both shapes; the commit is aborted, the
    history and the selection unchanged."""
    retention = _retention((1, 1, 1), 1, 1, 2)
    bad = dataclasses.replace(retention.groups["temporal"], scorer=lambda c, b: c.mean(dim=(2, 3)))
    cache = _cache(am.HeadRetention({**retention.groups, "temporal": bad}, retention.layers), 2)
    rollout = Rollout(cache, _settings((1, 1, 1), 1, 1, 2))
    rollout.blocks(2)
    committed = rollout.session.committed_chunks("cond")
    with pytest.raises(am.TensorMismatchError, match=r"expected a tensor of shape \(1, 3, 2\) .* got torch.Size\(\[1, 3\]\)"):
        rollout.blocks(1)
    assert rollout.session.committed_chunks("cond") == committed


def test_a_fork_shares_the_selection_and_continues_like_its_parent() -> None:
    """A fork shares the selection's pages by refcount (no copy) and its next forwards equal the parent's."""
    rollout = Rollout(_cache(_retention((1, 1, 1), 1, 1, 2), 2, pages=128), _settings((1, 1, 1), 1, 1, 2))
    rollout.blocks(4)
    child = rollout.session.fork()
    for lane in _temporal_lanes(rollout.cache):
        parent, forked = (s._lane_pages("cond")[lane.index] for s in (rollout.session, child))
        assert forked.selection == parent.selection
        assert all(lane.allocator.refcount(p) == 2 for p in parent.selection.pages)
    x = torch.randn(1, 3 * HW, rollout.model.dim)
    outs = []
    for session in (rollout.session, child):
        with torch.no_grad(), session.prepare_forward(None, 3 * HW, commit_current=False) as fwd:
            outs.append(rollout.model(x, fwd.layers))
    assert torch.equal(outs[0], outs[1])


def test_drop_window_and_a_recache_drop_the_selection() -> None:
    """The selection goes with the window (drop_window) and with a re-cache (its K/V are the old prompt's; the
    next scoring commit chooses again): its pages are released."""
    rollout = Rollout(_cache(_retention((1, 1, 1), 1, 1, 2), 2), _settings((1, 1, 1), 1, 1, 2))
    rollout.blocks(4)
    lanes = _temporal_lanes(rollout.cache)
    pages = [rollout.session._lane_pages("cond")[lane.index].selection.pages for lane in lanes]
    rollout.session.drop_window()
    for lane, gone in zip(lanes, pages):
        assert rollout.session._lane_pages("cond")[lane.index].selection is None
        assert all(lane.allocator.refcount(p) == 0 for p in gone)
    # the next commit's older candidates left with the window: it selects nothing (and reserves nothing); the one
    # after selects again from the frames committed since
    for selected in (False, True):
        rollout.step(False)
        rollout.step(True)
        for lane in lanes:
            b = rollout.session._lane_pages("cond")[lane.index]
            assert (b.selection is not None) == selected and not b.pending_selection
    assert sum(lane.allocator.num_used for lane in lanes) == sum(3 * 2 for _ in lanes)
