"""A content selection (``SelectedFramesPolicy``, Forcing-KV's dynamic patches) through the host tier, a file and a
link: suspend -> resume, save -> load, send -> recv carry the selection's pages and bookkeeping, and the stream
continues bit-identically to a twin that never left -- and equal to Forcing-KV's re-statement
(``tests/support/forcing_kv_attention.py``) -- its pages shared with a fork as before; a hostile selection in a
file is refused, nothing changed.

The rollouts are ``tests/integrations/test_forcing_kv_selected.py``'s (the tiny model, 3-frame blocks of 4-token
frames, a temporal group selecting from block ``ar_start + 1`` on).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import ardiff_modules as am
from ardiff_modules.core.branch import branch_image
from tests.integrations.test_forcing_kv_attention import _model
from tests.integrations.test_forcing_kv_selected import HW, Rollout, _cache, _retention, _settings, _temporal_lanes
from tests.support import small_lanes as lanes

#: ((sink, Ls, Lt) frames, ar_start, Ld, P), page size: the published numbers (2 patches of a page), a late switch
#: (a PhasedPolicy around the selection), two frames kept of whole-frame patches; the published numbers with CFG
#: (two branches, each its own selection) and contiguous extents (the chunks come back as rings, the selections
#: as plain pages).
PUBLISHED = (((1, 1, 1), 1, 1, 2), 2)
CONFIGS = {
    "published": {"config": PUBLISHED},
    "phased": {"config": (((1, 2, 1), 2, 1, 2), 2)},
    "two frames": {"config": (((0, 1, 3), 1, 2, 1), 4)},
    "cfg rings": {"config": PUBLISHED, "branches": ("cond", "uncond"), "extents": True, "pages": 200},
}


class Twins(Rollout):
    """:class:`Rollout` (the library and the re-statement) plus a twin session in a cache of its own, with the same
    prompts, driven by the same inputs: the session that never leaves."""

    def __init__(
        self, config: tuple = PUBLISHED, pages: int = 96, branches: tuple[str, ...] = ("cond",), extents: bool = False
    ) -> None:
        (frames, ar_start, ld, patches), page = config
        spec = dataclasses.replace(
            _model().spec(3 * HW, page, 0, None, branches=branches),
            head_retention=_retention(frames, ar_start, ld, patches),
        )
        self.make = lambda: am.KVCache(spec, num_pages=pages, backend="reference", contiguous_extents=extents)
        super().__init__(self.make(), _settings(frames, ar_start, ld, patches))
        self.twin_cache = self.make()
        self.twin = self.twin_cache.open_session()
        texts = torch.randn(len(self.branches), 5, self.model.context_dim, generator=torch.Generator().manual_seed(1))
        for branch, text in zip(self.branches, texts):
            am.populate_cross_attention(self.twin, branch, [b.cross for b in self.model.blocks], text)

    def forward(self, commit: bool, sessions: list[am.KVState]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One forward of every branch of each of ``sessions`` and of the re-statement, the same input."""
        x = torch.randn(len(self.branches), 3 * HW, self.model.dim, generator=self.gen)
        outs = []
        for session in sessions:
            with torch.no_grad(), session.prepare_forward(None, 3 * HW, commit_current=commit) as fwd:
                outs.append(self.model(x, fwd.layers))
        restated = [r.forward(x[i : i + 1], commit)[0] for i, r in enumerate(self.restated)]
        return outs, restated

    def advance(self, blocks: int, check: bool = True) -> None:
        """``blocks`` blocks (a denoising forward, then the commit) of the session and its twin: with ``check``
        each forward bit-equal to the twin's and equal to the re-statement."""
        for _ in range(blocks):
            for commit in (False, True):
                (out, twin), restated = self.forward(commit, [self.session, self.twin])
                if check:
                    assert torch.equal(out, twin)
                    assert max(float((out[i] - r).abs().max()) for i, r in enumerate(restated)) < 1e-5


def selections(cache: am.KVCache, session: am.KVState) -> list[dict[str, object]]:
    """Per lane, per branch: the content selection with host offsets (``None``: none)."""
    return [
        {b: (s.host() if (s := session._lane_pages(b)[lane.index].selection) is not None else None)
         for b in session.kv_branch_names}
        for lane in cache._lanes
    ]


def selection_bytes(cache: am.KVCache, session: am.KVState) -> list[torch.Tensor]:
    """Per temporal lane: the K/V of the cond branch's selection pages, every layer of the lane."""
    out = []
    for lane in _temporal_lanes(cache):
        pages = list(session._lane_pages("cond")[lane.index].selection.pages)
        out.append(lane.pool.kv[:, :, pages].clone())
    return out


def described(cache: am.KVCache, session: am.KVState) -> list[dict[str, object]]:
    """:func:`selections` with each selection's page ids replaced by their count (start, commit, offsets kept)."""
    return [{n: s and s._replace(pages=len(s.pages)) for n, s in lane.items()} for lane in selections(cache, session)]


def same_selection(a_cache: am.KVCache, a: am.KVState, b_cache: am.KVCache, b: am.KVState) -> bool:
    """The same selections (start, commit, offsets: everything but the page ids) holding the same bytes."""
    return described(a_cache, a) == described(b_cache, b) and all(
        torch.equal(x, y) for x, y in zip(selection_bytes(a_cache, a), selection_bytes(b_cache, b))
    )


# ---------------------------------------------------------------------------------------------- suspend / resume
@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_suspended_selection_resumes_and_continues_bit_identically(config: str) -> None:
    """Suspended right after a scoring commit (a selection chosen on the device), resumed into fresh pages: the
    selection comes back (its offsets, start, commit and bytes), and every later forward is bit-equal to the twin
    that never left and equal to the re-statement; twice, at two commits."""
    rollout = Twins(**CONFIGS[config])
    rollout.advance(CONFIGS[config]["config"][0][1] + 2)  # past the first scoring commit
    temporal = [lane.index for lane in _temporal_lanes(rollout.cache)]
    for _ in range(2):
        assert all(s is not None for i in temporal for s in selections(rollout.cache, rollout.session)[i].values())
        before = described(rollout.cache, rollout.session), selection_bytes(rollout.cache, rollout.session)
        used = [lane.allocator.num_used for lane in rollout.cache._lanes]
        rollout.session.suspend()
        assert all(lane.allocator.num_used == 0 for lane in rollout.cache._lanes)
        rollout.session.resume().wait()
        assert [lane.allocator.num_used for lane in rollout.cache._lanes] == used
        assert described(rollout.cache, rollout.session) == before[0]
        assert all(torch.equal(x, y) for x, y in zip(before[1], selection_bytes(rollout.cache, rollout.session)))
        assert same_selection(rollout.cache, rollout.session, rollout.twin_cache, rollout.twin)
        rollout.advance(2)
    lanes.assert_clean(rollout.cache)


def test_a_fork_family_keeps_its_shared_selection_pages_shared_through_the_host_tier() -> None:
    """A parent and its fork share their selection's pages (refcount 2). Suspended one after the other, the host
    tier holds each shared page once; resumed, they share one device copy again (refcount 2, the same page count
    as before) and both continue bit-identically to a twin family."""
    rollout = Twins(pages=160)
    rollout.advance(4)
    child, twin_child = rollout.session.fork(), rollout.twin.fork()
    temporal = _temporal_lanes(rollout.cache)
    used = [lane.allocator.num_used for lane in rollout.cache._lanes]
    shared = [rollout.session._lane_pages("cond")[lane.index].selection.pages for lane in temporal]
    assert all(lane.allocator.refcount(p) == 2 for lane, pages in zip(temporal, shared) for p in pages)
    distinct = [len({p for s in (rollout.session, child) for p in s._lane_pages("cond")[lane.index].history_pages()})
                for lane in rollout.cache._lanes]
    rollout.session.suspend()
    child.suspend()
    assert [store.pages.num_pages for store in rollout.cache._host_tier.stores] == distinct
    for lane, store in zip(rollout.cache._lanes, rollout.cache._host_tier.stores):
        if lane in temporal:  # each selection page held once on the host, referenced by both
            record = rollout.cache._host_tier._suspended[child].lanes[lane.index]
            assert all(store.pages.refcount(h) == 2 for h in record.selections["cond"])
    rollout.session.resume()
    child.resume()
    assert [lane.allocator.num_used for lane in rollout.cache._lanes] == used
    for lane in temporal:
        parent, forked = (s._lane_pages("cond")[lane.index] for s in (rollout.session, child))
        assert forked.selection == parent.selection
        assert all(lane.allocator.refcount(p) == 2 for p in parent.selection.pages)
    for commit in (False, True, False, True):
        (out, out_child, twin, twin_out_child), _ = rollout.forward(
            commit, [rollout.session, child, rollout.twin, twin_child]
        )
        assert torch.equal(out, twin) and torch.equal(out_child, twin_out_child)
    lanes.assert_clean(rollout.cache)


def test_host_admission_counts_one_selection_per_branch() -> None:
    """A suspended branch holds its selection but never a reserved next one: a session's peak host pages count
    the selection once (the device peak twice: a committing forward reserves the next beside it); a suspended
    session at its peak holds exactly that many host pages in each temporal lane."""
    rollout = Twins()
    rollout.advance(5)
    rollout.session.suspend()
    for lane in _temporal_lanes(rollout.cache):
        per_frame, selected = 2, 2  # 2 pages a frame; 1 frame of patches
        kept = (1 + 1) * per_frame  # sink + window frames
        assert lane.admission.host_pages_per_session() == kept + selected
        assert lane.admission.pages_per_session() == kept + 2 * selected + 3 * per_frame
        assert rollout.cache._host_tier.stores[lane.index].pages.num_pages == kept + selected


# ---------------------------------------------------------------------------------------------- save / load
@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_saved_selection_loads_into_a_fresh_cache_and_continues_bit_identically(config: str, tmp_path) -> None:
    """A parent and its fork saved after a scoring commit: the file writes each shared page once (the selection's
    too) and names the selection in the header; loaded into a fresh cache they share it again and continue
    bit-identically to the twin family (and the parent equal to the re-statement). With frame extents each
    member's selection comes back in its own ring's frame slots instead (its keys keep the order they were summed
    in)."""
    rollout = Twins(**{"pages": 160, **CONFIGS[config]})
    rollout.advance(CONFIGS[config]["config"][0][1] + 2)
    child, twin_child = rollout.session.fork("child"), rollout.twin.fork("child")
    path = tmp_path / "selected.safetensors"
    rollout.cache.save_sessions(path, [rollout.session, child])
    with safe_open(str(path), "pt") as f:
        header = json.loads(f.metadata()["ardiff_modules"])
    branches = rollout.branches
    family = [s._lane_pages(b) for s in (rollout.session, child) for b in branches]
    distinct = [len({p for held in family for p in held[i].history_pages()}) for i in range(len(rollout.cache._lanes))]
    assert [lane["pages"] for lane in header["lanes"]] == distinct
    written = [[lane[b].get("selection") for b in branches] for lane in header["sessions"][0]["lanes"]]
    assert any(any(w) for w in written)
    assert written == [[lane[b].get("selection") for b in branches] for lane in header["sessions"][1]["lanes"]]
    fresh = rollout.make()
    parent, loaded_child = fresh.load_sessions(path)
    if not CONFIGS[config].get("extents"):  # every page shared as before
        used = [lane.allocator.num_used for lane in rollout.cache._lanes]
        assert [lane.allocator.num_used for lane in fresh._lanes] == used
    assert same_selection(fresh, parent, rollout.twin_cache, rollout.twin)
    for lane in _temporal_lanes(fresh):
        for b in branches:
            pages = parent._lane_pages(b)[lane.index].selection.pages
            theirs = loaded_child._lane_pages(b)[lane.index].selection.pages
            if not CONFIGS[config].get("extents"):
                assert theirs == pages and all(lane.allocator.refcount(p) == 2 for p in pages)  # shared again
            else:  # each member's copy in the frame slots of its own ring (as ring chunks; the extent's + its ref)
                mine = parent._lane_pages(b)[lane.index]
                assert set(pages) <= set(mine.extent) and set(theirs).isdisjoint(pages)
                assert all(lane.allocator.refcount(p) == 2 for p in (*pages, *theirs))
                assert torch.equal(lane.pool.kv[:, :, list(pages)], lane.pool.kv[:, :, list(theirs)])
    rollout.session, original = parent, rollout.session
    rollout.advance(3)
    for commit in (False, True):
        (out, twin_out), _ = rollout.forward(commit, [loaded_child, twin_child])
        assert torch.equal(out, twin_out)
    lanes.assert_clean(fresh)
    assert original.committed_chunks("cond") + 3 == parent.committed_chunks("cond")  # the saved one, untouched


# ---------------------------------------------------------------------------------------------- send / recv
@pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()), reason="needs gloo"
)
def test_a_selection_is_sent_to_another_process_and_continues_there() -> None:
    """Over gloo: rank 0 sends a parent and its fork after a scoring commit; rank 1 opens them (the shared
    selection pages once) and they continue bit-identically to its own twin family and equal to the
    re-statement."""
    from tests.distributed.test_multi_process import _spawn
    from tests.support import selection_transport

    _spawn(2, selection_transport.check_send_recv_selection)


# ---------------------------------------------------------------------------------------------- hostile files
def _rewrite(path, edit: Callable[[dict], None]):
    """Another file: ``path``'s with its header edited (the tensors and their digests as they were)."""
    with safe_open(str(path), "pt") as f:
        header, data = json.loads(f.metadata()["ardiff_modules"]), {k: f.get_tensor(k) for k in f.keys()}
    edit(header)
    out = path.with_name("edited.safetensors")
    save_file(data, str(out), metadata={"ardiff_modules": json.dumps(header)})
    return out


TEMPORAL = 2  # the first temporal lane of the published configuration (lanes: spatial x2, temporal x2, layer 0)


def _branch(header: dict, lane: int = TEMPORAL) -> dict:
    return header["sessions"][0]["lanes"][lane]["cond"]


def _selection(header: dict, lane: int = TEMPORAL) -> dict:
    return _branch(header, lane)["selection"]


def _move_selection(header: dict) -> None:
    """The temporal lane's selection put in a spatial lane (a frame window: it selects nothing)."""
    _branch(header, 0)["selection"] = _selection(header)


def _set(field: str, value: Callable[[dict], object]) -> Callable[[dict], None]:
    return lambda h: _selection(h).__setitem__(field, value(h))


HOSTILE = {
    "a lane that does not select": (_move_selection, r"lanes\[0\].cond.selection: expected null \(the lane's policy"),
    "not an object": (lambda h: _branch(h).__setitem__("selection", [1]), r"cond.selection: expected a JSON object"),
    "a missing field": (lambda h: _selection(h).pop("start"), r"cond.selection: expected the keys"),
    "too few pages": (_set("pages", lambda h: _selection(h)["pages"][:1]), r"selection.pages: expected 2 pages"),
    "too many pages": (_set("pages", lambda h: _selection(h)["pages"] * 2), r"selection.pages: expected 2 pages"),
    "a page past the tensor": (
        _set("pages", lambda h: [0, h["lanes"][TEMPORAL]["pages"]]), r"selection.pages: expected an int >= 0 and <="
    ),
    "a page twice": (_set("pages", lambda h: [_selection(h)["pages"][0]] * 2), r"selection.pages: expected each page"),
    "a page of a chunk": (
        _set("pages", lambda h: [_branch(h)["history"][0][0], _selection(h)["pages"][1]]),
        r"selection.pages: expected each page once in a branch \(none of its chunks'\)",
    ),
    "made at a later commit": (
        _set("made_at", lambda h: _branch(h)["committed_chunks"]), r"selection.made_at: expected an int >= 0 and <= 4"
    ),
    "made at an older commit": (
        _set("made_at", lambda h: _branch(h)["committed_chunks"] - 2),
        r"selection.made_at: expected the last commit, 4 \(a selection lives until the next commit\), got 3",
    ),
    "another start": (
        _set("start", lambda h: _selection(h)["start"] + 4),
        r"selection.start: expected 44 \(the first candidate frame 11 of commit 4, 4 tokens a frame\), got 48",
    ),
    "offsets not increasing": (_set("offsets", lambda h: [3, 1]), r"selection.offsets: expected 2 increasing offsets"),
    "an offset twice": (_set("offsets", lambda h: [1, 1]), r"selection.offsets: expected 2 increasing offsets"),
    "an offset past the candidates": (
        _set("offsets", lambda h: [1, 6]), r"selection.offsets: expected an int >= 0 and <= 5, got 6"
    ),
    "too few offsets": (_set("offsets", lambda h: [1]), r"selection.offsets: expected 2 increasing offsets"),
}


@pytest.fixture(scope="module")
def saved_selection(tmp_path_factory):
    """A file of one session five blocks in (a selection made at commit 4 in each temporal lane)."""
    rollout = Rollout(_cache(_retention((1, 1, 1), 1, 1, 2), 2), _settings((1, 1, 1), 1, 1, 2))
    rollout.blocks(5)
    path = tmp_path_factory.mktemp("selection") / "s.safetensors"
    rollout.cache.save_sessions(path, [rollout.session])
    return path


def _target() -> tuple[am.KVCache, object]:
    """A cache holding another session (a selection of its own), and everything a refusal must leave as it was."""
    cache = _cache(_retention((1, 1, 1), 1, 1, 2), 2)
    resident = Rollout(cache, _settings((1, 1, 1), 1, 1, 2), seed=3)
    resident.blocks(4)
    return cache, (lanes.everything(cache), selections(cache, resident.session))


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_selection_is_refused_and_changes_nothing(saved_selection, case: str) -> None:
    edit, message = HOSTILE[case]
    with safe_open(str(saved_selection), "pt") as f:
        assert _selection(json.loads(f.metadata()["ardiff_modules"]))["made_at"] == 4  # what the cases edit
    target, before = _target()
    (resident,) = target.sessions.values()
    with pytest.raises(am.SessionFileError, match=message):
        target.load_sessions(_rewrite(saved_selection, edit))
    lanes.assert_unchanged(target, before[0])
    assert selections(target, resident) == before[1] and list(target.sessions) == [resident.session_id]
    assert target.load_sessions(saved_selection, ["loaded"])[0].committed_chunks("cond") == 5  # the file itself loads


def test_a_selection_at_a_commit_that_selects_nothing_is_refused(tmp_path) -> None:
    """A file saved before the first scoring commit (no selection) given one made at its last commit, which scores
    nothing under the policy (``select_from``): refused."""
    rollout = Rollout(_cache(_retention((1, 1, 1), 1, 1, 2), 2), _settings((1, 1, 1), 1, 1, 2))
    rollout.blocks(2)
    assert all(s is None for lane in selections(rollout.cache, rollout.session) for s in lane.values())
    path = tmp_path / "early.safetensors"
    rollout.cache.save_sessions(path, [rollout.session])

    def edit(header: dict) -> None:  # two more pages in the lane's tensor for it (the header is read first)
        n = header["lanes"][TEMPORAL]["pages"]
        header["lanes"][TEMPORAL]["pages"] = n + 2
        _branch(header)["selection"] = {"pages": [n, n + 1], "start": 0, "made_at": 1, "offsets": [0, 1]}

    target, before = _target()
    with pytest.raises(am.SessionFileError, match=r"selection.made_at: expected a commit that selects under "):
        target.load_sessions(_rewrite(path, edit))
    lanes.assert_unchanged(target, before[0])


def test_a_file_without_selections_loads_as_before(saved_selection, tmp_path) -> None:
    """Files of other policies (and a branch between selections) carry no ``selection`` key; ``null`` reads as
    none; the image of a loaded branch is the saved one's."""
    rollout = Rollout(_cache(_retention((1, 1, 1), 1, 1, 2), 2), _settings((1, 1, 1), 1, 1, 2))
    rollout.blocks(5)
    with safe_open(str(saved_selection), "pt") as f:
        header = json.loads(f.metadata()["ardiff_modules"])
    written = [("selection" in lane["cond"]) for lane in header["sessions"][0]["lanes"]]
    assert written == [False, False, True, True, False]
    (loaded,) = _cache(_retention((1, 1, 1), 1, 1, 2), 2).load_sessions(saved_selection)
    for i in range(5):
        mine, theirs = branch_image(loaded._lane_pages("cond")[i]), branch_image(rollout.session._lane_pages("cond")[i])
        assert (mine.selection is None) == (theirs.selection is None)
        if mine.selection is not None:
            assert mine.selection._replace(pages=()) == theirs.selection._replace(pages=())
    nulls = _rewrite(saved_selection, lambda h: [lane["cond"].setdefault("selection", None)
                                                 for lane in h["sessions"][0]["lanes"]])
    (again,) = _cache(_retention((1, 1, 1), 1, 1, 2), 2).load_sessions(nulls)
    assert again.committed_chunks("cond") == 5


def test_a_selection_made_above_a_dropped_window_saves_and_loads(tmp_path) -> None:
    """A selection chosen after ``drop_window`` (candidates counted from the window's floor) is what the file's
    check expects: the load re-states the candidates above the branch's ``window_floor`` (found by the session
    state machine: the check counted them from the sink frames, refusing the file)."""
    policy = am.SelectedFramesPolicy(1, 3, 2, keep_frames=1, select_from=0, score_layer=1)
    spec = am.KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=2, chunk_size=4, page_size=2, dtype="float32",
                          retention=policy)
    cache = am.KVCache(spec, num_pages=64, device="cpu", backend="reference")
    state = cache.open_session()
    gen = torch.Generator().manual_seed(0)

    def step() -> None:
        with state.prepare_forward(None, 4, commit_current=True) as fwd:
            for layer in fwd.layers:
                q, k, v = torch.randn(3, 1, 4, 1, 2, generator=gen)
                am.chunk_attention(q.expand(1, 4, 1, 2), k, v, layer)

    for _ in range(2):
        step()
    state.drop_window()
    for _ in range(2):
        step()
    history = state.branch_pages(spec.branches[0])
    assert history.window_floor == 2 and history.selection is not None
    assert history.selection.start == 4 * 2  # frame 4 (chunk 2's first: the floor), 2 tokens a frame; not frame 3
    path = str(tmp_path / "s.safetensors")
    cache.save_sessions(path, [state])
    [copy] = cache.load_sessions(path, ["copy"])
    assert copy.branch_pages(spec.branches[0]).selection.host() == history.selection.host()._replace(
        pages=copy.branch_pages(spec.branches[0]).selection.pages
    )
