"""Suspend / resume to the host tier (issue 29): the oracle is a twin cache whose session never left.

Outputs are compared bit for bit (``torch.equal``) on the reference backend; sharing is checked on the
allocator's refcounts and on the host tier's pages; "unchanged" on the pool bytes and the bookkeeping.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.core.branch import extent_slots_of
from ardiff_modules.host.tier import HostTier
from tests.support.small_cache import (
    BOTH, CHUNK, SMALL_SPEC, bit_copy, bookkeeping, make_small_cache, pages_of, run_layers,
)


def step(state: am.KVState, seed: int, commit: bool = True, latents: bool = False) -> list[torch.Tensor]:
    """One forward of both branches (its outputs per layer); ``latents`` keeps a latent per chunk."""
    keep = torch.full((2, CHUNK, 3), float(seed)) if latents and commit else None
    with state.prepare_forward(BOTH, CHUNK, commit_current=commit, keep_latents=keep) as fwd:
        return run_layers(fwd.layers, 2, CHUNK, seed)


def populate(state: am.KVState, seed: int = 7) -> None:
    g = torch.Generator().manual_seed(seed)
    for branch in BOTH:
        layers = [(torch.randn(3, 2, 4, generator=g), torch.randn(3, 2, 4, generator=g)) for _ in range(2)]
        state.populate_cross_attention(branch, "text", layers)


def history_bytes(cache: am.KVCache, state: am.KVState) -> dict[str, torch.Tensor]:
    """The K/V of each branch's history pages in history order, every layer: what suspend must preserve."""
    return {b: cache._pool.kv[:, :, pages_of(state, b)].clone() for b in BOTH}


def ring_bytes(cache: am.KVCache, state: am.KVState, branch: str) -> tuple[list[int | None], torch.Tensor]:
    """A ring branch's chunks' extent slots (history order) and the K/V of its occupied slots read in slot order:
    what a ragged kernel reads, in the order it sums them."""
    bp = state.branch_pages(branch)
    slots = list(extent_slots_of(bp))
    step, first = bp.pages_per_chunk, bp.extent[0]
    pages = [first + s * step + i for s, c in sorted(zip(slots, bp.history), key=lambda sc: sc[0]) for i in range(len(c))]
    return slots, cache._pool.kv[:, :, pages].clone()


def assert_clean(cache: am.KVCache) -> None:
    cache._allocator.check_invariants()
    cache._host_tier.pages.check_invariants()


@pytest.mark.parametrize("extents", [False, True], ids=["paged", "extents"])
def test_a_suspended_and_resumed_session_continues_bit_identically(extents):
    twin_cache, cache = (make_small_cache(contiguous_extents=extents) for _ in range(2))
    twin, state = twin_cache.open_session("s"), cache.open_session("s")
    populate(twin), populate(state)
    for seed in range(9):
        if seed % 2 == 1:
            before = history_bytes(cache, state)
            offsets = [state.token_offset(b) for b in BOTH]
            state.suspend()
            assert state.is_suspended and state.pages_in_use() == 0 and cache._allocator.num_used == 0
            handle = state.resume()
            assert handle.ready() and not state.is_suspended
            handle.wait()
            assert [state.token_offset(b) for b in BOTH] == offsets
            after = history_bytes(cache, state)
            assert all(torch.equal(before[b], after[b]) for b in BOTH)
            if extents:  # back as a ring: a fresh extent, each chunk in the slot it had (the twin's), same bytes
                for b in BOTH:
                    (slots, ring), (twin_slots, twin_ring) = ring_bytes(cache, state, b), ring_bytes(twin_cache, twin, b)
                    assert None not in slots and slots == twin_slots and torch.equal(ring, twin_ring)
        for commit in (False, True):
            out, ref = step(state, seed, commit, latents=True), step(twin, seed, commit, latents=True)
            assert all(torch.equal(a, b) for a, b in zip(out, ref))
        assert [state.history_chunk_indices(b) for b in BOTH] == [twin.history_chunk_indices(b) for b in BOTH]
    for b in BOTH:
        mine, ref = state.get_cross_attention_kv(b, "text"), twin.get_cross_attention_kv(b, "text")
        assert torch.equal(mine[1]["v"], ref[1]["v"])
    assert torch.equal(state.recache_latents(), twin.recache_latents())
    assert_clean(cache)
    state.close()
    assert cache._allocator.num_used == 0 and cache._host_tier.pages.num_pages == 0


def test_forks_stay_shared_after_suspend_and_resume_of_one_or_both():
    cache = make_small_cache()
    a = cache.open_session("a")
    for seed in range(3):
        step(a, seed)
    child = a.fork("child")
    shared = {b: pages_of(a, b) for b in BOTH}
    distinct = len({p for b in BOTH for p in shared[b]})
    alloc, host = cache._allocator, cache._host_tier.pages
    # one: the pages stay resident for the parent; resume takes a reference on them again (no copy)
    child.suspend()
    assert all(alloc.refcount(p) == 1 for b in BOTH for p in shared[b]) and host.num_pages == distinct
    child.resume()
    assert {b: pages_of(child, b) for b in BOTH} == shared
    assert all(alloc.refcount(p) == 2 for b in BOTH for p in shared[b]) and host.num_pages == 0
    # both: copied to the host once, back shared in fresh pages
    used_before = alloc.num_used
    child.suspend()
    a.suspend()
    assert alloc.num_used == 0 and host.num_pages == distinct
    assert host.nbytes == distinct * cache._pool.bytes_per_page
    assert all(host.refcount(h) == 2 for h in host.pages())
    a.resume()
    child.resume()
    assert {b: pages_of(child, b) for b in BOTH} == {b: pages_of(a, b) for b in BOTH}
    assert all(alloc.refcount(p) == 2 for b in BOTH for p in pages_of(a, b))
    assert alloc.num_used == used_before and host.num_pages == 0
    # and they diverge correctly afterwards: the child continues as a twin fork would
    twin = make_small_cache().open_session("a")
    for seed in range(3):
        step(twin, seed)
    twin_child = twin.fork("child")
    assert all(torch.equal(x, y) for x, y in zip(step(child, 5), step(twin_child, 5)))
    assert_clean(cache)


def test_shared_sinks_come_back_shared():
    cache = make_small_cache()
    a, b = cache.open_session("a"), cache.open_session("b")
    step(a, 0)
    step(a, 1)
    for branch in BOTH:
        b.share_sinks_from(a, branch)
    sink = a.history_chunks("cond")[0]
    distinct = {p for s in (a, b) for br in BOTH for p in pages_of(s, br)}
    b.suspend()
    a.suspend()
    assert cache._host_tier.pages.num_pages == len(distinct)  # the shared sinks copied once
    b.resume()
    a.resume()
    assert a.history_chunks("cond")[0] == b.history_chunks("cond")[0]
    assert all(cache._allocator.refcount(p) == 2 for p in a.history_chunks("cond")[0])
    assert sink != () and len(a.history_chunks("cond")) == 2
    assert_clean(cache)


def test_a_page_reused_after_its_copy_is_not_taken_for_it():
    """A host page remembers one device page lifetime: once that page is freed and reallocated, resume copies."""
    cache = make_small_cache(num_pages=12)
    a, filler, other = (cache.open_session(n) for n in ("a", "filler", "other"))
    step(a, 0)
    step(a, 1)  # pages 0..7
    child = a.fork("child")
    child.suspend()  # the child's host pages alias a's live pages
    step(filler, 0)  # takes pages 8..11: the next allocation reuses a freed page of a
    a.close()  # a's pages are free now
    step(other, 10)  # and 4 of them are reallocated with other bytes
    assert set(pages_of(other, "cond") + pages_of(other, "uncond")) <= set(range(8))
    filler.close()
    child.resume()
    assert not set(pages_of(child, "cond") + pages_of(child, "uncond")) & set(pages_of(other, "cond"))
    other.close()
    twin = make_small_cache().open_session("a")
    step(twin, 0)
    step(twin, 1)
    twin_child = twin.fork("child")
    assert all(torch.equal(x, y) for x, y in zip(step(child, 5), step(twin_child, 5)))
    assert_clean(cache)


def test_misuse_is_refused_and_changes_nothing():
    cache = make_small_cache()
    s = cache.open_session("s")
    step(s, 0)
    s.suspend()
    with pytest.raises(am.SessionSuspendedError, match="'s' suspended") as info:
        s.prepare_forward(BOTH, CHUNK, commit_current=True)
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(am.SessionSuspendedError, match="already suspended"):
        s.suspend()
    with pytest.raises(am.SessionSuspendedError, match="fork"):
        s.fork()
    with pytest.raises(am.SessionSuspendedError):
        s.prepare_recache()
    assert "suspended" in repr(s)
    s.resume()
    with pytest.raises(am.SessionNotSuspendedError, match="expected a session suspended .* got .s. resident"):
        s.resume()  # resident: refused, nothing changed
    assert not s.is_suspended
    # pending work: a denoising forward left its pending chunk; an open forward
    step(s, 1, commit=False)
    with pytest.raises(am.PendingContextError, match=r"pending work on branch\(es\) \['cond', 'uncond'\]"):
        s.suspend()
    fwd = s.prepare_forward(BOTH, CHUNK, commit_current=True)
    with pytest.raises(am.PendingContextError):
        s.suspend()
    fwd.abort()
    s.abort()
    s.close()
    with pytest.raises(am.errors.SessionClosedError):
        s.suspend()


def test_resume_without_device_room_and_suspend_over_the_host_budget_change_nothing():
    cache = make_small_cache(num_pages=12, host_budget_bytes=10**9)
    s = cache.open_session("s")
    for seed in range(3):
        step(s, seed)
    s.suspend()
    hog = cache.open_session("hog")
    step(hog, 0)
    step(hog, 1)  # 8 of 12 pages: s needs 12
    before, host = bookkeeping(cache), cache._host_tier.pages.nbytes
    with pytest.raises(am.CapacityError, match="resume 's': needed 12 free device pages .* got 4 free of 12"):
        s.resume()
    assert bookkeeping(cache) == before and cache._host_tier.pages.nbytes == host and s.is_suspended
    hog.close()
    s.resume()
    small = make_small_cache(host_budget_bytes=cache._pool.bytes_per_page)
    t = small.open_session("t")
    step(t, 0)
    before, pool = bookkeeping(small), bit_copy(small._pool.kv)
    with pytest.raises(am.CapacityError, match="host tier needs .* only .* of its budget"):
        t.suspend()
    assert bookkeeping(small) == before and torch.equal(bit_copy(small._pool.kv), pool) and not t.is_suspended


def test_close_and_reset_of_a_suspended_session_drop_its_host_pages():
    cache = make_small_cache()
    s, r = cache.open_session("s"), cache.open_session("r")
    populate(r)
    step(s, 0), step(r, 0)
    s.suspend(), r.suspend()
    s.close()
    assert cache._host_tier.num_suspended == 1
    r.reset()
    assert not r.is_suspended and r.token_offset("cond") == 0 and cache._host_tier.pages.nbytes == 0
    assert cache._allocator.num_used == 0
    report = cache.tiers()
    assert report.suspended == () and report.resident == ("r",) and report.host_bytes == 0


@pytest.mark.parametrize("stage", ["suspend", "resume"])
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_interrupted_transfer_leaves_the_session_fully_on_one_side(monkeypatch, stage, error):
    cache = make_small_cache(contiguous_extents=True)
    s = cache.open_session("s")
    populate(s)
    for seed in range(3):
        step(s, seed, latents=True)
    if stage == "resume":
        s.suspend()
    before, pool, host = bookkeeping(cache), bit_copy(cache._pool.kv), cache._host_tier.pages.nbytes

    def boom(*args, **kwargs):
        raise error("copy failed")

    name = "_copy_pages_to_host" if stage == "suspend" else "_copy_to_device"
    monkeypatch.setattr(HostTier, name, boom)
    with pytest.raises(error, match="copy failed"):
        s.suspend() if stage == "suspend" else s.resume()
    monkeypatch.undo()
    assert bookkeeping(cache) == before and torch.equal(bit_copy(cache._pool.kv), pool)
    assert cache._host_tier.pages.nbytes == host and s.is_suspended == (stage == "resume")
    assert_clean(cache)
    if stage == "resume":
        s.resume()
    twin = make_small_cache(contiguous_extents=True).open_session("s")
    populate(twin)
    for seed in range(3):
        step(twin, seed, latents=True)
    assert all(torch.equal(x, y) for x, y in zip(step(s, 9), step(twin, 9)))


@pytest.mark.parametrize("extents", [False, True], ids=["paged", "extents"])
def test_admission_suspends_the_least_recently_used_idle_session(extents):
    # two sessions at their peak (16 pages) + the re-cache reserve (8). With contiguous extents a suspended session
    # frees its whole ring, each history page of which it holds twice (extent + chunk): once counted as not freed.
    cache = make_small_cache(num_pages=2 * 16 + 8, contiguous_extents=extents)
    a = cache.admit_session("a")
    b = cache.admit_session("b")
    for s in (a, b, a):
        step(s, 0)
    with pytest.raises(am.CapacityError):
        cache.admit_session("c")
    assert cache.tiers().suspended == ()
    c = cache.admit_session("c", suspend_idle=True)  # b was used least recently
    report = cache.tiers()
    assert report.suspended == ("b",) and set(report.resident) == {"a", "c"} and report.host_bytes > 0
    assert b.pages_in_use() == 0 and cache._allocator.num_free >= cache.pages_per_session()
    # none idle: a has pending work, c is new but b cannot be resumed on top -> refused, nothing changed
    step(a, 1, commit=False)
    step(c, 0, commit=False)
    before = bookkeeping(cache)
    with pytest.raises(am.CapacityError, match="idle"):
        cache.admit_session("d", suspend_idle=True)
    assert bookkeeping(cache) == before and cache.tiers().suspended == ("b",)
    with pytest.raises(am.SpecError):
        cache.admit_session("d", suspend_idle=1)


@pytest.mark.parametrize("extents", [False, True], ids=["paged", "extents"])
def test_admission_suspends_only_the_sessions_the_server_names(extents):
    cache = make_small_cache(num_pages=2 * 16 + 8, contiguous_extents=extents)  # two sessions at their peak + reserve
    a, b = cache.admit_session("a"), cache.admit_session("b")
    for s in (a, b):  # a is the least recently used, but the server knows b is the paused one
        step(s, 0)
    other = make_small_cache().open_session("x")
    before = bookkeeping(cache)
    for bad, error in ((other, am.SpecError), ([other], am.SpecError), (a, am.SpecError), ("b", am.SpecError)):
        with pytest.raises(error, match="admit_session"):
            cache.admit_session("c", suspend_idle=bad)
        assert bookkeeping(cache) == before and cache.tiers().suspended == ()
    c = cache.admit_session("c", suspend_idle=[b])
    assert cache.tiers().suspended == ("b",) and not a.is_suspended and c.cache is cache
    with pytest.raises(am.CapacityError, match="idle"):  # the only candidate is suspended already
        cache.admit_session("d", suspend_idle=[b])
    assert cache.tiers().suspended == ("b",)


def test_fp8_pages_travel_as_raw_bytes_and_the_scales_stay():
    spec = dataclasses.replace(SMALL_SPEC, kv_dtype="float8_e4m3fn")
    cache, twin_cache = (am.KVCache(spec, num_pages=32, backend="reference") for _ in range(2))
    s, twin = cache.open_session("s"), twin_cache.open_session("s")
    for seed in range(3):
        step(s, seed), step(twin, seed)
    scales = cache._pool.scales.clone()
    before = {b: cache._pool.kv[:, :, pages_of(s, b)].view(torch.uint8).clone() for b in BOTH}
    s.suspend()
    s.resume()
    assert torch.equal(cache._pool.scales, scales)
    assert all(torch.equal(cache._pool.kv[:, :, pages_of(s, b)].view(torch.uint8), before[b]) for b in BOTH)
    assert all(torch.equal(x, y) for x, y in zip(step(s, 5), step(twin, 5)))


def test_a_fork_of_a_ring_is_not_aliased_to_slots_the_ring_rewrites():
    """Extent slots are rewritten in place when the ring wraps (same page, same lifetime): never aliased."""
    caches = [make_small_cache(64, contiguous_extents=True) for _ in range(2)]
    children = []
    for i, cache in enumerate(caches):
        a = cache.open_session("a")
        for seed in range(3):
            step(a, seed)
        children.append(a.fork("child"))
        if i == 0:
            children[0].suspend()
        for seed in range(3, 6):
            step(a, seed)  # wraps the ring: the slots the child read are rewritten (it no longer holds them)
    parents = [cache.sessions["a"] for cache in caches]
    parents[0].suspend()  # its rewritten slots must be copied, not taken for the child's old host pages
    children[0].resume()
    parents[0].resume()
    for mine, twin in ((children[0], children[1]), (parents[0], parents[1])):
        assert all(torch.equal(x, y) for x, y in zip(step(mine, 9), step(twin, 9)))
    assert_clean(caches[0])


def test_sessions_that_fit_on_the_host_tier_counts_peak_sessions_against_the_budget():
    probe = make_small_cache()
    per_session = probe._admission.host_pages_per_session() * probe._pool.bytes_per_page
    probe.close()
    cache = make_small_cache(host_budget_bytes=2 * per_session + per_session // 2)
    assert cache.sessions_that_fit(tier="host") == 2
    states = [cache.open_session(f"s{i}") for i in range(2)]
    for state in states:  # to the peak: sinks + window committed on both branches
        for seed in range(6):
            step(state, seed)
    states[0].suspend()
    # The estimate is the true peak: a suspended session at its peak holds exactly that many host bytes.
    assert cache.tiers().host_bytes == per_session
    assert cache.sessions_that_fit(tier="host") == 1
    states[1].suspend()
    assert cache.sessions_that_fit(tier="host") == 0
    assert cache.sessions_that_fit() >= 1  # the device tier is counted on its own
    cache.close()


def test_sessions_that_fit_refuses_an_unbounded_host_tier_and_an_unknown_tier():
    cache = make_small_cache()
    with pytest.raises(am.SpecError, match="host_budget_bytes=None"):
        cache.sessions_that_fit(tier="host")
    with pytest.raises(am.SpecError, match=r"expected one of \('device', 'host'\), got 'disk'"):
        cache.sessions_that_fit(tier="disk")
    cache.close()


def test_the_arena_keeps_its_rows_for_the_next_suspend_and_reserve_pins_ahead():
    cache = make_small_cache()
    s = cache.open_session("s")
    for seed in range(4):
        step(s, seed)
    arena = cache._host_tier.arena
    assert cache._host_tier.reserve(3 * cache._pool.bytes_per_page) == arena.nbytes == 3 * arena.page_bytes
    s.suspend()
    grown, slabs = arena.capacity_rows, len(arena.slabs)
    assert grown == len(cache._host_tier.pages.pages()) > 3  # the reserved rows first, then one slab more
    assert arena.free_rows == 0 and cache.tiers().host_arena_bytes == arena.nbytes
    s.resume()
    assert arena.free_rows == grown  # every row back, none unpinned
    for _ in range(3):  # round trips reuse the same rows: no new slab
        s.suspend()
        s.resume()
    assert arena.capacity_rows == grown and len(arena.slabs) == slabs == 2
    twin = make_small_cache().open_session("s")
    for seed in range(4):
        step(twin, seed)
    assert all(torch.equal(x, y) for x, y in zip(step(s, 9), step(twin, 9)))


def test_a_suspend_keeps_the_streams_generation_and_a_reset_starts_a_new_one():
    """A resumed stream is the same stream: what a training scope recorded of it (keyed by generation) still
    matches its chunks; a reset starts over at offset 0 and must not match them."""
    cache = make_small_cache()
    state = cache.open_session("s")
    populate(state)
    step(state, 0)
    before = [state.branch_pages(b).generation for b in BOTH]
    state.suspend()
    state.resume().wait()
    assert [state.branch_pages(b).generation for b in BOTH] == before
    state.reset()
    assert [state.branch_pages(b).generation for b in BOTH] == [g + 1 for g in before]


# ------------------------------------------------------------------ retention groups: one record, every lane
# (tests/support/small_lanes.py: the small cache uniform, per head (three lanes) and per layer (two lanes))
from tests.support import small_lanes as lanes  # noqa: E402


@pytest.mark.parametrize("extents", [False, True], ids=["paged", "extents"])
@pytest.mark.parametrize("kind", lanes.KINDS)
def test_every_lane_continues_bit_identically_after_suspend_and_resume(kind, extents):
    """Every lane's pool contents, chunks and slots come back as they were (and as a twin that never left holds
    them); outputs, prompts and kept latents equal the twin's bit for bit."""
    twin_cache, cache = (lanes.make_cache(kind, contiguous_extents=extents) for _ in range(2))
    twin, state = twin_cache.open_session("s"), cache.open_session("s")
    populate(twin), populate(state)
    for seed in range(9):
        if seed % 2 == 1:
            before = lanes.history_bytes(cache, state)
            state.suspend()
            assert state.pages_in_use() == 0 and all(lane.allocator.num_used == 0 for lane in cache._lanes)
            # one host page per distinct history page of each lane
            assert [s.pages.num_pages for s in cache._host_tier.stores] == [
                len({p for b in BOTH for c in r.chunks[b] for p in c}) for r in cache._host_tier._suspended[state].lanes
            ]
            state.resume().wait()
            after = lanes.history_bytes(cache, state)
            assert all(torch.equal(x[b], y[b]) for x, y in zip(before, after) for b in BOTH)
            assert lanes.same_history(cache, state, twin_cache, twin)
        for commit in (False, True):
            out, ref = step(state, seed, commit, latents=True), step(twin, seed, commit, latents=True)
            assert all(torch.equal(a, b) for a, b in zip(out, ref))
    assert lanes.same_history(cache, state, twin_cache, twin)
    for b in BOTH:
        assert torch.equal(state.get_cross_attention_kv(b, "text")[1]["v"], twin.get_cross_attention_kv(b, "text")[1]["v"])
        for mine, ref in zip(state._lane_pages(b), twin._lane_pages(b)):  # every lane keeps its latents
            assert sorted(mine.latents) == sorted(ref.latents)
            assert all(torch.equal(mine.latents[i], ref.latents[i]) for i in mine.latents)
    lanes.assert_clean(cache)
    state.close()
    assert all(lane.allocator.num_used == 0 for lane in cache._lanes)
    assert all(s.pages.num_pages == 0 for s in cache._host_tier.stores) and cache.tiers().host_bytes == 0


@pytest.mark.parametrize("kind", lanes.KINDS)
def test_a_latent_several_lanes_keep_travels_once_and_comes_back_shared(kind):
    cache = lanes.make_cache(kind)
    s = cache.open_session("s")
    for seed in range(3):
        step(s, seed, latents=True)
    kept = {id(t): t for b in BOTH for p in s._lane_pages(b) for t in p.latents.values()}
    s.suspend()
    assert cache.tiers().host_bytes == sum(s_.pages.num_pages * s_.pool.bytes_per_page for s_ in cache._host_tier.stores) + sum(
        t.numel() * t.element_size() for t in kept.values()
    )
    s.resume()
    back = {id(t) for b in BOTH for p in s._lane_pages(b) for t in p.latents.values()}
    assert len(back) == len(kept)  # still one tensor per chunk, shared by the lanes that keep it


@pytest.mark.parametrize("kind", lanes.KINDS)
def test_forks_and_shared_sinks_stay_shared_in_every_lane(kind):
    cache, twin_cache = lanes.make_cache(kind), lanes.make_cache(kind)
    families = []
    for c in (cache, twin_cache):
        a, b = c.open_session("a"), c.open_session("b")
        for seed in range(3):
            step(a, seed)
        child = a.fork("child")
        for branch in BOTH:  # b's sinks are a's (in the lanes that keep sinks; the others only take the clock)
            b.share_sinks_from(a, branch)
        families.append((a, child, b))
    (a, child, b), twins = families
    refcounts = [sorted(map(lane.allocator.refcount, lane.allocator.used_pages())) for lane in cache._lanes]
    distinct = [lane.allocator.num_used for lane in cache._lanes]
    assert any(n > 1 for counts in refcounts for n in counts)  # something is shared
    for s in (child, b, a):
        s.suspend()
    # each lane's shared pages copied to the host once
    assert [s.pages.num_pages for s in cache._host_tier.stores] == distinct
    for s in (a, b, child):
        s.resume()
    # back shared as before: the same pages in use, each with as many holders
    assert [sorted(map(lane.allocator.refcount, lane.allocator.used_pages())) for lane in cache._lanes] == refcounts
    for mine, ref, seed in zip((child, b, a), (twins[1], twins[2], twins[0]), (9, 10, 11)):
        assert all(torch.equal(x, y) for x, y in zip(step(mine, seed), step(ref, seed)))
        assert lanes.same_history(cache, mine, twin_cache, ref)
    lanes.assert_clean(cache)


def _hog(cache: am.KVCache, lane: int, leave: int) -> list[int]:
    """Take every free page of ``lane`` but ``leave`` (straight from its allocator: that lane alone is full)."""
    allocator = cache._lanes[lane].allocator
    return allocator.allocate(allocator.num_free - leave)


@pytest.mark.parametrize("extents", [False, True], ids=["paged", "extents"])
@pytest.mark.parametrize("kind", lanes.KINDS)
def test_a_resume_reserves_in_every_lane_or_none(kind, extents):
    """The last lane without room: refused naming it (with groups), every lane unchanged; with room, it resumes."""
    cache = lanes.make_cache(kind, contiguous_extents=extents)
    s = cache.open_session("s")
    for seed in range(3):
        step(s, seed)
    s.suspend()
    last = len(cache._lanes) - 1
    hog = _hog(cache, last, 1)
    before = lanes.everything(cache)
    message = f"resume 's': lane '{cache._lanes[last].name}': needed" if kind != "uniform" else "resume 's': needed"
    with pytest.raises(am.CapacityError, match=message):
        s.resume()
    lanes.assert_unchanged(cache, before)
    assert s.is_suspended
    cache._lanes[last].allocator.decref(hog)
    s.resume()
    assert not s.is_suspended and s.committed_chunks("cond") == 3
    lanes.assert_clean(cache)


@pytest.mark.parametrize("kind", ["per-head", "per-layer"])
def test_a_later_lane_failing_its_reservation_rolls_back_the_earlier_ones_exactly(kind, monkeypatch):
    """Room checked, then the last lane's reservation fails (fragmentation, an interrupt): every lane is back as
    it was -- free queue order included -- and the session stays suspended."""
    from ardiff_modules.core import reservation as core_reservation
    from ardiff_modules.host import tier

    cache = lanes.make_cache(kind, contiguous_extents=True)
    s = cache.open_session("s")
    for seed in range(3):
        step(s, seed)
    s.suspend()
    before = lanes.everything(cache)
    made = []

    class Failing(core_reservation.ResumeReservation):
        def __init__(self, allocator, fresh, extents):
            super().__init__(allocator, fresh, extents)
            made.append(self)
            if allocator is cache._lanes[-1].allocator:
                self.rollback()
                raise KeyboardInterrupt("the last lane")

    monkeypatch.setattr(tier, "ResumeReservation", Failing)
    with pytest.raises(KeyboardInterrupt, match="the last lane"):
        s.resume()
    monkeypatch.undo()
    assert len(made) == len(cache._lanes) and all(r.spent for r in made)
    lanes.assert_unchanged(cache, before)
    s.resume()


@pytest.mark.parametrize("stage", ["suspend", "resume"])
@pytest.mark.parametrize("kind", ["per-head", "per-layer"])
def test_an_interrupted_grouped_transfer_leaves_every_lane_on_one_side(monkeypatch, kind, stage):
    cache = lanes.make_cache(kind, contiguous_extents=True)
    s = cache.open_session("s")
    populate(s)
    for seed in range(3):
        step(s, seed, latents=True)
    if stage == "resume":
        s.suspend()
    before = lanes.everything(cache)

    def boom(*args, **kwargs):
        raise KeyboardInterrupt("copy failed")

    monkeypatch.setattr(HostTier, "_copy_pages_to_host" if stage == "suspend" else "_copy_to_device", boom)
    with pytest.raises(KeyboardInterrupt, match="copy failed"):
        s.suspend() if stage == "suspend" else s.resume()
    monkeypatch.undo()
    lanes.assert_unchanged(cache, before)
    assert s.is_suspended == (stage == "resume")
    assert all(st.arena.free_rows == st.arena.capacity_rows for st in cache._host_tier.stores) or stage == "resume"


@pytest.mark.parametrize("kind", lanes.KINDS)
def test_one_host_budget_covers_every_lane(kind):
    """The host budget counts every lane's pages: a session whose first lane alone would fit is refused,
    changing nothing; sessions_that_fit(tier='host') counts a session's peak in every lane, exactly."""
    probe = lanes.make_cache(kind)
    per_lane = [lane.admission.host_pages_per_session() * lane.pool.bytes_per_page for lane in probe._lanes]
    per_session = sum(per_lane)
    cache = lanes.make_cache(kind, host_budget_bytes=2 * per_session + per_session // 2)
    assert cache.sessions_that_fit(tier="host") == 2
    states = [cache.open_session(f"s{i}") for i in range(2)]
    for state in states:  # to the peak: every lane's history full on both branches
        for seed in range(6):
            step(state, seed)
    states[0].suspend()
    assert cache.tiers().host_bytes == per_session  # the estimate is the true peak, every lane together
    assert cache.sessions_that_fit(tier="host") == 1
    small = lanes.make_cache(kind, host_budget_bytes=per_session - 1)  # (with groups, the first lane's part fits)
    t = small.open_session("t")
    for seed in range(6):
        step(t, seed)
    before = lanes.everything(small)
    with pytest.raises(am.CapacityError, match="host tier needs .* only .* of its budget"):
        t.suspend()
    lanes.assert_unchanged(small, before)
    assert not t.is_suspended
    report = cache.tiers()
    assert report.device_pages_used == sum(lane.allocator.num_used for lane in cache._lanes)
    assert report.host_pages == sum(s.pages.num_pages for s in cache._host_tier.stores)


@pytest.mark.parametrize("extents", [False, True], ids=["paged", "extents"])
@pytest.mark.parametrize("kind", lanes.KINDS)
def test_admission_suspends_idle_sessions_until_every_lane_has_room(kind, extents):
    """Admission suspends the least recently used idle session(s) until one more session fits at its peak in every
    lane; with no candidate it refuses, changing nothing."""
    cache = lanes.make_cache(kind, 64, contiguous_extents=extents)
    states = []
    while cache.sessions_that_fit() >= 1:
        states.append(cache.admit_session(f"s{len(states)}"))
    assert len(states) >= 2
    for s in states:
        step(s, 0)
    last = cache._lanes[-1]
    with pytest.raises(am.CapacityError):
        cache.admit_session("new")
    before = lanes.everything(cache)
    with pytest.raises(am.CapacityError, match="idle"):
        cache.admit_session("new", suspend_idle=[])  # no candidate: refused, nothing changed
    lanes.assert_unchanged(cache, before)
    new = cache.admit_session("new", suspend_idle=True)
    suspended = cache.tiers().suspended
    assert suspended and suspended[0] == "s0"  # the least recently used first
    assert new.cache is cache and last.allocator.num_free >= 1
    assert all(lane.allocator.num_free >= lane.admission.pages_per_session() for lane in cache._lanes)
    for s in states:
        if s.is_suspended:
            assert s.pages_in_use() == 0


@pytest.mark.parametrize("kind", ["per-head", "per-layer"])
def test_admission_frees_the_lane_that_is_full_not_only_the_first(kind):
    cache = lanes.make_cache(kind, 64)
    a, b = cache.admit_session("a"), cache.admit_session("b")
    for s in (a, b, a):
        step(s, 0)
    lane = cache._lanes[-1]
    last = lane.allocator
    hog = []  # the last lane just too full for one more session; the other lanes keep their room
    while lane.admission.sessions_that_fit(*cache._host_tier.lane_counts(lane), 1, True) >= 1:
        hog += last.allocate(1)
    assert all(
        lane.admission.sessions_that_fit(*cache._host_tier.lane_counts(lane), 1, True) >= 1 for lane in cache._lanes[:-1]
    ) and cache.sessions_that_fit() == 0
    c = cache.admit_session("c", suspend_idle=True)
    assert cache.tiers().suspended == ("b",) and c.session_id == "c"
    last.decref(hog)
    lanes.assert_clean(cache)


@pytest.mark.parametrize("kind", lanes.KINDS)
def test_reserve_host_pins_every_lane_within_the_budget(kind):
    probe = lanes.make_cache(kind)
    per_session = sum(lane.admission.host_pages_per_session() * lane.pool.bytes_per_page for lane in probe._lanes)
    cache = lanes.make_cache(kind, host_budget_bytes=3 * per_session)
    assert cache.reserve_host(2 * per_session) == cache.tiers().host_arena_bytes >= 2 * per_session - sum(
        lane.pool.bytes_per_page for lane in cache._lanes
    )
    assert all(s.arena.capacity_rows > 0 for s in cache._host_tier.stores)
    assert cache.reserve_host(10 * per_session) <= 3 * per_session  # capped by the one budget
    states = [cache.open_session(f"s{i}") for i in range(2)]
    for state in states:
        for seed in range(6):
            step(state, seed)
    rows = [s.arena.capacity_rows for s in cache._host_tier.stores]
    for state in states:
        state.suspend()
    assert [s.arena.capacity_rows for s in cache._host_tier.stores] == rows  # the reserved rows took them
