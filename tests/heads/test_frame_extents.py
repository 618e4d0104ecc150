"""Contiguous extents of frame slots (``core/branch_frame_extent.py``): a lane that trims chunks to frames, or keeps a
content selection, reserves one run of ``sink + window + selected + chunk`` frame slots per branch, so a one-chunk
forward's visible pages are one run (ragged FA3 on the FlashInfer backend) once the window is full.

Forcing-KV's geometry scaled down (3 frames a chunk, 2 pages a frame, one patch a page): a frame group keeping
sink 1 frame + window 1 frame, and a selected group keeping one frame of patches besides. Every test runs the same
rollout through a cache with extents and one without (reference backend, CPU): outputs equal bit for bit, and the
pages each stream attends hold equal K/V; with extents every forward's layout is ragged-eligible.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.errors import CapacityError
from tests.support.projection_model import ProjectionModel

LAYERS, KV_HEADS, D, DIM, FRAMES, PAGE, P = 2, 2, 4, 6, 3, 2, 2
FT = P * PAGE  # tokens a frame (a patch is one page)
CHUNK = FRAMES * FT
FRAME = am.FrameWindowPolicy(1, 1, FRAMES)
SEL = am.SelectedFramesPolicy(1, 1, FRAMES, keep_frames=1, patches_per_frame=P, select_from=1, score_layer=1)
KINDS = ["groups", "selected"]


def spec_of(kind: str) -> am.KVCacheSpec:
    retention: dict[str, object] = (
        {"retention": SEL} if kind == "selected"
        else {"head_retention": am.HeadRetention({"frame": FRAME, "sel": SEL}, [["frame", "sel"]] * LAYERS)}
    )
    return am.KVCacheSpec(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=D, chunk_size=CHUNK, page_size=PAGE,
                          branches=("cond", "uncond"), dtype="float32", **retention)  # type: ignore[arg-type]


def make(kind: str, extents: bool, pages: int = 400) -> am.KVCache:
    return am.KVCache(spec_of(kind), num_pages=pages, backend="reference", contiguous_extents=extents)


class Twins:
    """The same streams in a cache with frame extents (``a``) and one without (``b``), fed the same latents."""

    def __init__(self, kind: str, pages: int = 400) -> None:
        self.a, self.b = make(kind, True, pages), make(kind, False, pages)
        self.model = ProjectionModel(LAYERS, DIM, KV_HEADS, D)
        self.g = torch.Generator().manual_seed(7)
        self.ragged: list[bool] = []

    def forward(self, pairs: list[tuple[am.KVState, am.KVState]], commit: bool, branches: tuple[str, ...] = ("cond",
                "uncond")) -> torch.Tensor:
        """One forward of every branch of ``pairs`` (``(session in a, its twin in b)``) in both caches: the outputs
        equal bit for bit (returned); whether each lane of ``a``'s forward was ragged-eligible is recorded."""
        x = torch.randn(len(pairs) * len(branches), CHUNK, DIM, generator=self.g)
        outs = []
        for side, cache in enumerate((self.a, self.b)):
            members = [(pair[side], b) for pair in pairs for b in branches]
            with cache.prepare_forward(members, CHUNK, commit) as fwd:
                if side == 0:
                    self.ragged.append(all(c._layout.ragged_rows is not None for c in fwd._lane_contexts))
                outs.append(torch.stack([am.chunk_attention(*self.model.qkv(x, layer, 0), ctx)
                                         for layer, ctx in enumerate(fwd.layers)]))
        assert torch.equal(outs[0], outs[1])
        return outs[0]

    def chunk(self, pairs: list[tuple[am.KVState, am.KVState]], steps: int = 2) -> None:
        """``steps - 1`` denoising forwards and a committing one; then the attended pages hold equal K/V."""
        for step in range(steps):
            self.forward(pairs, step == steps - 1)
        for pair in pairs:
            check_same_pages(self.a, pair[0], self.b, pair[1])


def attended(cache: am.KVCache, state: am.KVState, branch: str) -> Iterator[tuple[object, list[int]]]:
    for lane, h in zip(cache._lanes, state._lane_pages(branch)):
        yield lane, h.history_pages()


def check_same_pages(a: am.KVCache, sa: am.KVState, b: am.KVCache, sb: am.KVState) -> None:
    """Each lane's attended pages of every branch hold the same K/V in both caches (in attention order)."""
    for branch in ("cond", "uncond"):
        for (lane_a, pa), (lane_b, pb) in zip(attended(a, sa, branch), attended(b, sb, branch)):
            assert len(pa) == len(pb)
            assert torch.equal(lane_a.pool.kv[:, :, pa], lane_b.pool.kv[:, :, pb])  # type: ignore[attr-defined]


def in_extent(state: am.KVState) -> bool:
    """Every branch's history and selection pages sit in its extent (frame slots)."""
    return all(set(h.history_pages()) <= set(h.extent) for b in ("cond", "uncond") for h in state._lane_pages(b))


def extent_order(state: am.KVState) -> list[list[int]]:
    """Per branch and lane, the extent offset of each attended page, in attention order (history, then selection):
    the order a ragged kernel sums the keys in, which a resume or a load must keep (bit-identical outputs)."""
    return [[h.extent.index(p) for p in h.history_pages()] for b in ("cond", "uncond") for h in state._lane_pages(b)]


def scattered(order: list[list[int]]) -> bool:
    """Whether some branch's pages are not in ascending extent order (laying them out in history order would move
    them: what makes a layout-preserving test meaningful)."""
    return any(o != sorted(o) for o in order)


def snapshot(cache: am.KVCache, states: list[am.KVState]) -> object:
    """Every refcount and every branch's bookkeeping (pending chunks included)."""
    lanes = [[lane.allocator.refcount(p) for p in range(lane.allocator.num_pages)] for lane in cache._lanes]
    branches = [(h.history, h.history_index, h.history_kept, h.pending, h.pending_selection, h.extent,
                 h.selection.pages if h.selection else None, h.committed_chunks)
                for s in states for b in ("cond", "uncond") for h in s._lane_pages(b)]
    return lanes, branches


# ---------------------------------------------------------------------------------------------- the slots
@pytest.mark.parametrize("kind", KINDS)
def test_frame_lanes_get_frame_slot_extents(kind: str) -> None:
    """Slots: sink + window + selected + one chunk's frames (FrameWindowPolicy(1, 1, 3): 5; the selected lane: 6);
    ``contiguous_extents=False`` (or the CPU default) keeps plain paging."""
    cache = make(kind, True)
    want = {"selected": [6], "groups": [5, 6]}[kind]
    assert [lane.extent_chunks for lane in cache._lanes] == want
    assert all(lane.frame_slots and lane.extent_pages == lane.extent_chunks * P for lane in cache._lanes)
    assert all(lane.extent_chunks is None for lane in make(kind, False)._lanes)
    assert all(lane.extent_chunks is None for lane in am.KVCache(spec_of(kind), num_pages=100, device="cpu")._lanes)


def test_frame_slots_are_the_default_with_flashinfer() -> None:
    """With FlashInfer and a bounded window every lane gets an extent by default: chunk lanes chunk slots, frame lanes
    frame slots (a resume or a load puts each frame back in its slot, so the kernel sums the keys in the same order);
    ``contiguous_extents=False`` pages every lane, the reference backend pages by default."""
    from ardiff_modules.lanes import extent_chunks_of, lane_specs

    specs = [lane for lane, _ in lane_specs(spec_of("groups"))]
    assert [extent_chunks_of(s, "flashinfer", None) for s in specs] == [5, 6]
    assert [extent_chunks_of(s, "flashinfer", True) for s in specs] == [5, 6]
    assert [extent_chunks_of(s, "flashinfer", False) for s in specs] == [None, None]
    assert [extent_chunks_of(s, "reference", None) for s in specs] == [None, None]
    chunk_spec = dataclasses.replace(specs[0], retention=am.SinkWindowPolicy(1, 2))
    assert extent_chunks_of(chunk_spec, "flashinfer", None) == 4


# ---------------------------------------------------------------------------------------------- 1. a long rollout
@pytest.mark.parametrize("kind", KINDS)
def test_a_long_rollout_is_ragged_and_bit_equal_to_plain_paging(kind: str) -> None:
    """12 chunks (two forwards each) of two branches, well past the first selection: every forward with extents is
    ragged-eligible in every lane, its outputs and attended pages equal plain paging's; from the second scoring
    commit on the selection is copied in place (its pages never change) and every kept page sits in the extent."""
    t = Twins(kind)
    pair = (t.a.open_session("s"), t.b.open_session("s"))
    pages: list[object] = []
    for n in range(12):
        t.chunk([pair])
        assert in_extent(pair[0]), n
        pages.append([h.selection.pages if h.selection else None for h in pair[0]._lane_pages("cond")])
    assert all(t.ragged), t.ragged
    assert any(p is not None for p in pages[2])
    assert all(p == pages[2] for p in pages[2:])  # in place: the first selection's pages, every commit after
    pair[0].close()
    assert all(lane.allocator.num_free == lane.allocator.num_pages for lane in t.a._lanes)


# ---------------------------------------------------------------------------------------------- 2. forks
@pytest.mark.parametrize("when", ["before prepare", "between prepare and commit"])
def test_a_fork_sharing_the_selection_keeps_it(when: str) -> None:
    """A fork shares the parent's selection pages: the parent's next scoring commit must not copy into them (made
    before the prepare, or while the scoring forward is open): the fork's pages keep their K/V and its forwards equal
    plain paging's fork, bit for bit; the parent's new selection lands in other pages."""
    t = Twins("groups")
    pair = (t.a.open_session("s"), t.b.open_session("s"))
    for _ in range(4):
        t.chunk([pair])
    old = [h.selection.pages for h in pair[0]._lane_pages("cond") if h.selection]
    assert old
    if when == "before prepare":
        fork = (pair[0].fork("f"), pair[1].fork("f"))
        t.chunk([pair])
    else:
        t.forward([pair], False)
        x = torch.randn(2, CHUNK, DIM, generator=t.g)
        ctxs = []
        for side, cache in enumerate((t.a, t.b)):
            fwd = cache.prepare_forward([(pair[side], "cond"), (pair[side], "uncond")], CHUNK, True)
            ctxs.append(fwd)
        for side, fwd in enumerate(ctxs):
            with fwd:
                for layer, ctx in enumerate(fwd.layers):
                    am.chunk_attention(*t.model.qkv(x, layer, 0), ctx)
                if side == 0:
                    fork = (pair[0].fork("f"), pair[1].fork("f"))
        fork = (fork[0], t.b.sessions["f"])
    held = [lane.pool.kv[:, :, list(p)].clone() for lane, p in zip(t.a._lanes[1:], old)]
    new = [h.selection.pages for h in pair[0]._lane_pages("cond") if h.selection]
    assert new != old
    assert [h.selection.pages for h in fork[0]._lane_pages("cond") if h.selection] == old
    assert all(torch.equal(lane.pool.kv[:, :, list(p)], k) for lane, p, k in zip(t.a._lanes[1:], old, held))
    check_same_pages(t.a, fork[0], t.b, fork[1])
    for _ in range(3):
        t.chunk([fork])
        t.chunk([pair])


# ---------------------------------------------------------------------------------------------- 3. abort, capacity
@pytest.mark.parametrize("kind", KINDS)
def test_an_aborted_scoring_forward_and_a_refused_one_change_nothing(kind: str) -> None:
    """A scoring forward aborted after its layers ran leaves every refcount and every branch as before (its pending
    chunk's frame slots and the reserved selection pages given back); a forward refused for capacity too; the
    rollout then goes on bit-equal to plain paging's (which never saw them)."""
    t = Twins(kind)
    pair = (t.a.open_session("s"), t.b.open_session("s"))
    for _ in range(4):
        t.chunk([pair])
    before = snapshot(t.a, [pair[0]])
    x = torch.randn(2, CHUNK, DIM, generator=torch.Generator().manual_seed(3))
    fwd = t.a.prepare_forward([(pair[0], "cond"), (pair[0], "uncond")], CHUNK, True)
    assert any(h.pending_selection for h in pair[0]._lane_pages("cond"))
    for layer, ctx in enumerate(fwd.layers):
        am.chunk_attention(*t.model.qkv(x, layer, 0), ctx)
    pair[0].abort("cond")
    assert snapshot(t.a, [pair[0]]) == before
    # a second session cannot run beside it in a pool too small: refused, nothing changed
    one = make("selected", True)._lanes[0].admission.pages_per_session()  # (one lane: groups split a budget)
    small = Twins("selected", pages=one + 2)
    spair = (small.a.open_session("s"), small.b.open_session("s"))
    small.chunk([spair])
    other = small.a.open_session("o")
    before = snapshot(small.a, [spair[0], other])
    with pytest.raises(CapacityError):
        small.a.prepare_forward([(other, "cond"), (other, "uncond")], CHUNK, True)
    assert snapshot(small.a, [spair[0], other]) == before
    for _ in range(3):
        t.chunk([pair])
        small.chunk([spair])
    assert all(t.ragged) and all(small.ragged)


# ---------------------------------------------------------------------------------------------- 4. host, files
@pytest.mark.parametrize("kind", KINDS)
def test_suspend_resume_continues_bit_identically_back_in_the_extent(kind: str) -> None:
    """Suspended after a scoring commit, resumed: history and selection come back into frame slots of a fresh
    extent (the same pages in use as before), every later forward ragged and bit-equal to plain paging's."""
    t = Twins(kind)
    pair = (t.a.open_session("s"), t.b.open_session("s"))
    for _ in range(4):
        t.chunk([pair])
    for _ in range(2):
        used = [lane.allocator.num_used for lane in t.a._lanes]
        order = extent_order(pair[0])
        assert scattered(order), order
        pair[0].suspend()
        pair[0].resume().wait()
        assert [lane.allocator.num_used for lane in t.a._lanes] == used
        assert in_extent(pair[0])
        assert extent_order(pair[0]) == order  # every frame back in its slot: the keys' order kept
        check_same_pages(t.a, pair[0], t.b, pair[1])
        t.ragged = []
        for _ in range(3):
            t.chunk([pair])
        assert all(t.ragged), t.ragged


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_continues_bit_identically_back_in_the_extent(kind: str, tmp_path) -> None:
    """Saved after a scoring commit, loaded into a fresh cache with extents: history and selection in frame slots,
    every later forward ragged and bit-equal to plain paging's."""
    t = Twins(kind)
    pair = (t.a.open_session("s"), t.b.open_session("s"))
    for _ in range(4):
        t.chunk([pair])
    path = tmp_path / "s.safetensors"
    order = extent_order(pair[0])
    assert scattered(order), order
    t.a.save_sessions(path, [pair[0]])
    t.a = make(kind, True)
    (loaded,) = t.a.load_sessions(path)
    pair = (loaded, pair[1])
    assert in_extent(loaded)
    assert extent_order(loaded) == order  # every frame back in its slot: the keys' order kept
    check_same_pages(t.a, loaded, t.b, pair[1])
    t.ragged = []
    for _ in range(4):
        t.chunk([pair])
    assert all(t.ragged), t.ragged


def test_a_scorer_raising_in_a_later_group_leaves_an_in_place_selection_as_it_was() -> None:
    """Two selecting groups; the second one's scorer raises at a scoring commit after the first group's selection is
    copied in place from then on: every group chooses before any copies, so the aborted commit leaves the first
    group's selection pages (bookkeeping and K/V) as they were, and the rollout continues bit-equal to plain paging."""
    fail = {"now": False}

    def scorer(c: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if fail["now"]:
            raise RuntimeError("scorer failed")
        return -torch.nn.functional.cosine_similarity(c, torch.cat([c[:, 1:], b[:, None]], 1), dim=-1).mean(-1)[
            ..., None].expand(-1, -1, P).contiguous()

    late = am.SelectedFramesPolicy(1, 1, FRAMES, keep_frames=1, patches_per_frame=P, select_from=1, score_layer=0,
                                   scorer=scorer)
    heads = am.HeadRetention({"sel": SEL, "late": late}, [["sel", "late"]] * LAYERS)
    spec = am.KVCacheSpec(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=D, chunk_size=CHUNK, page_size=PAGE,
                          branches=("cond", "uncond"), dtype="float32", head_retention=heads)
    t = Twins("groups")
    t.a, t.b = (am.KVCache(spec, num_pages=400, backend="reference", contiguous_extents=e) for e in (True, False))
    selector = t.a._forwards.selector
    names = [t.a._lanes[g.scoring_lane].part.group for g in selector.groups]  # type: ignore[union-attr]
    assert names == ["sel", "late"], names  # the raising group comes second: the first one chose (and would copy)
    pair = (t.a.open_session("s"), t.b.open_session("s"))
    for _ in range(4):
        t.chunk([pair])
    first = t.a._lanes[0]
    h = pair[0]._lane_pages("cond")[0]
    assert h.selection is not None and h.selection_in_place(first.allocator)
    before = snapshot(t.a, [pair[0]]), first.pool.kv[:, :, list(h.selection.pages)].clone()
    fail["now"] = True
    for cache, state in zip((t.a, t.b), pair):
        with pytest.raises(RuntimeError, match="scorer failed"):
            with cache.prepare_forward([(state, "cond"), (state, "uncond")], CHUNK, True) as fwd:
                x = torch.randn(2, CHUNK, DIM, generator=torch.Generator().manual_seed(5))
                for layer, ctx in enumerate(fwd.layers):
                    am.chunk_attention(*t.model.qkv(x, layer, 0), ctx)
    assert snapshot(t.a, [pair[0]]) == before[0]
    assert torch.equal(first.pool.kv[:, :, list(h.selection.pages)], before[1])
    fail["now"] = False
    for _ in range(3):
        t.chunk([pair])
    assert all(t.ragged)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda b: b["frame_slots"].__setitem__(-1, b["frame_slots"][0]), "distinct frame slots"),
    (lambda b: b["frame_slots"].pop(), "one per history chunk"),
    (lambda b: b["frame_slots"].__setitem__(0, ["x"]), "expected an int"),
    (lambda b: b.update(selection_slots=[-1]), "expected an int >= 0"),
])
def test_a_file_with_hostile_frame_slots_is_refused_and_changes_nothing(edit, message: str, tmp_path) -> None:
    """A file's frame slots (where each frame sat in its extent) are checked like its pages: one entry per history
    chunk, distinct ints; a refusal leaves the cache unchanged."""
    from ardiff_modules.errors import SessionFileError
    from tests.host.test_save_load import rewrite

    t = Twins("selected")
    pair = (t.a.open_session("s"), t.b.open_session("s"))
    for _ in range(4):
        t.chunk([pair])
    path = tmp_path / "s.safetensors"
    t.a.save_sessions(path, [pair[0]])

    def hostile(header: dict) -> None:
        branch = header["sessions"][0]["branches"]["cond"]
        assert branch["frame_slots"], branch
        edit(branch)

    bad = rewrite(path, hostile)
    target = make("selected", True)
    before = [lane.allocator.num_free for lane in target._lanes]
    with pytest.raises(SessionFileError, match=message):
        target.load_sessions(bad)
    assert [lane.allocator.num_free for lane in target._lanes] == before and not target.sessions


@pytest.mark.parametrize("after_fork", [0, 1], ids=["selection-shared", "selections-own"])
@pytest.mark.parametrize("how", ["suspend", "file"])
def test_a_fork_family_travels_with_its_shared_pages_and_continues_bit_identically(
    how: str, after_fork: int, tmp_path
) -> None:
    """A parent and its fork (sharing the sink, older frames and the selection) suspended and resumed, or saved and
    loaded together: the family holds as many pages as before, the parent's frames are where they were in its
    extent; the fork's shared frames (outside its extent, so attended paged, in history order) come back into its
    own extent in history order (the order its keys were summed in); both continue bit-equal to plain paging's."""
    t = Twins("groups")
    pair = (t.a.open_session("s"), t.b.open_session("s"))
    for _ in range(4):
        t.chunk([pair])
    fork = (pair[0].fork("f"), pair[1].fork("f"))
    for _ in range(after_fork):
        t.chunk([fork])
        t.chunk([pair])
    used = [lane.allocator.num_used for lane in t.a._lanes]
    orders = [extent_order_where_inside(s) for s in (pair[0], fork[0])]
    if how == "suspend":
        for s in (pair[0], fork[0]):
            s.suspend()
        for s in (pair[0], fork[0]):
            s.resume().wait()
        members = (pair[0], fork[0])
    else:
        path = tmp_path / "family.safetensors"
        t.a.save_sessions(path, [pair[0], fork[0]])
        t.a = make("groups", True)
        members = tuple(t.a.load_sessions(path))
    if after_fork:  # (a fork that has not run a forward has no extent yet: a resume reserves it, as for chunk
        # slots, and lays its shared chunks in it -- pages its next forward would have reserved anyway)
        assert [lane.allocator.num_used for lane in t.a._lanes] == used
    for member, before in zip(members, orders):
        after = extent_order_where_inside(member)
        for b, a in zip(before, after):
            assert a == b if None not in b else a == sorted(a), (b, a)  # (sorted: history order, no None)
    assert None not in orders[0][0] and (None in orders[1][0] or not after_fork)  # (the fork partly outside)
    pair, fork = (members[0], pair[1]), (members[1], fork[1])
    for _ in range(3):
        t.chunk([pair])
        t.chunk([fork])


def extent_order_where_inside(state: am.KVState) -> list[list[int | None]]:
    """:func:`extent_order`, ``None`` for a page outside the branch's extent (a fork's shared pages)."""
    return [[h.extent.index(p) if p in h.extent else None for p in h.history_pages()]
            for b in ("cond", "uncond") for h in state._lane_pages(b)]


@pytest.mark.parametrize("kind", KINDS)
def test_a_paged_file_loads_into_frame_slots_in_the_order_its_keys_were_summed(kind: str, tmp_path) -> None:
    """Saved from a cache without extents (paged: keys in history order, the selection after the sink chunks) and
    loaded into one with frame extents: the frames and the selection fill the slots in that order (ascending extent
    offsets in attention order), and the stream goes on bit-equal to the paged twin."""
    t = Twins(kind)
    pair = (t.a.open_session("s"), t.b.open_session("s"))
    for _ in range(4):
        t.chunk([pair])
    path = tmp_path / "paged.safetensors"
    t.b.save_sessions(path, [pair[1]])
    t.a = make(kind, True)
    (loaded,) = t.a.load_sessions(path)
    assert in_extent(loaded)
    order = extent_order(loaded)
    assert all(o == sorted(o) for o in order) and any(o != sorted(o) for o in extent_order(pair[0])), order
    pair = (loaded, pair[1])
    t.ragged = []
    for _ in range(3):
        t.chunk([pair])
    assert all(t.ragged), t.ragged
