"""``KVState.drop_window`` and ``begin_shot`` (a shot sink: ``ShotSinkPolicy``) on a live session (issue 43 item 3).

Checked on the pool, not only on bookkeeping: the sinks' pages keep their bytes and ids, the window's pages are
free (refcount 0), positions run on, the next forward attends the sinks and itself (``to_dense`` over
``key_positions``); misuse raises naming expected and actual and leaves the pool bytes, the free queue, the
refcounts and every session as they were; forks, suspend/resume, session files, contiguous extents, re-cache
rules, relative sinks and FP8 pools keep the shot and the dropped window.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ardiff_modules as am
from tests.support.small_cache import BOTH, CHUNK, SMALL_SPEC, bit_copy, bookkeeping, pages_of, run_layers, tensors

SHOT_SPEC = dataclasses.replace(SMALL_SPEC, sink_chunks=0, window_chunks=None, retention=am.ShotSinkPolicy(1, 2, 1))


def shot_cache(spec: am.KVCacheSpec = SHOT_SPEC, num_pages: int = 40, **kwargs) -> am.KVCache:
    return am.KVCache(spec, num_pages=num_pages, backend="reference", **kwargs)


def step(state: am.KVState, seed: int, commit: bool = True) -> list[torch.Tensor]:
    """One forward of both branches whose queries depend on the positions (what RoPE would see)."""
    with state.prepare_forward(BOTH, CHUNK, commit_current=commit) as fwd:
        outs = []
        for i, layer in enumerate(fwd.layers):
            q, k, v = tensors(2, CHUNK, seed=seed + i)
            q = q * (1 + 0.01 * fwd.positions[..., None, None])
            sinks = {"sink_query": q * 0.5} if fwd.relative_sinks else {}
            outs.append(am.chunk_attention(q, k, v, layer, **sinks))
        return outs


def attended(state: am.KVState, branch: str = "cond") -> list[int]:
    """Key positions the first query of a one-chunk forward of ``branch`` attends (the forward is aborted)."""
    fwd = state.prepare_forward((branch,), CHUNK, commit_current=False)
    try:
        run_layers(fwd.layers, 1)
        dense, keys = fwd.to_dense()[0], fwd.key_positions()[0]
        return sorted(keys[dense[0]].tolist())
    finally:
        fwd.abort()


def span(first_chunk: int, last_chunk: int) -> list[int]:
    return list(range(first_chunk * CHUNK, (last_chunk + 1) * CHUNK))


# ------------------------------------------------------------------ drop_window
def test_drop_window_frees_the_window_keeps_the_sinks_bytes_and_runs_positions_on() -> None:
    cache = shot_cache()
    state = cache.open_session()
    for seed in range(4):
        step(state, seed)
    sinks = {b: state.history_chunks(b)[:1] for b in BOTH}
    window = {b: pages_of(state, b)[len(sinks[b][0]):] for b in BOTH}
    sink_bytes = bit_copy(cache._pool.kv[:, :, [p for b in BOTH for p in sinks[b][0]]])
    offsets = [state.token_offset(b) for b in BOTH]
    state.drop_window()
    for b in BOTH:
        assert state.history_chunks(b) == sinks[b]
        assert state.history_chunk_indices(b) == (0,)
        assert all(cache._allocator.refcount(p) == 0 for p in window[b])
        assert state.token_offset(b) == offsets[BOTH.index(b)] and state.committed_chunks(b) == 4
    assert torch.equal(bit_copy(cache._pool.kv[:, :, [p for b in BOTH for p in sinks[b][0]]]), sink_bytes)
    assert cache._allocator.num_used == 2 * cache.spec.pages_per_chunk
    assert attended(state) == span(0, 0) + span(4, 4)  # sinks + itself, at the running positions
    step(state, 9)
    assert state.history_chunk_indices("cond") == (0, 4)
    assert attended(state) == span(0, 0) + span(4, 5)
    cache._allocator.check_invariants()


def test_drop_window_keeps_the_pending_chunk_a_denoising_forward_left_for_the_clean_forward() -> None:
    cache = shot_cache()
    state = cache.open_session()
    for seed in range(3):
        step(state, seed)
    step(state, 5, commit=False)
    pending = [state.pending_chunks(b) for b in BOTH]
    pending_bytes = bit_copy(cache._pool.kv[:, :, [p for c in pending for chunk in c for p in chunk]])
    state.drop_window()
    assert [state.pending_chunks(b) for b in BOTH] == pending
    assert torch.equal(bit_copy(cache._pool.kv[:, :, [p for c in pending for chunk in c for p in chunk]]), pending_bytes)
    step(state, 6)  # the clean forward reuses them
    assert [state.history_chunks(b)[-1] for b in BOTH] == [c[0] for c in pending]


def test_drop_window_works_under_any_policy_and_on_one_branch() -> None:
    memory = dataclasses.replace(SMALL_SPEC, sink_chunks=0, window_chunks=None,
                                 retention=am.SinkWindowMemoryPolicy(1, 1, 2, 1))
    cache = shot_cache(memory)
    state = cache.open_session()
    for seed in range(6):
        step(state, seed)
    assert state.history_chunk_indices("cond") == (0, 3, 5)
    state.drop_window("cond")
    assert state.history_chunk_indices("cond") == (0,) and state.history_chunk_indices("uncond") == (0, 3, 5)
    for seed in range(6, 10):
        step(state, seed)
    assert state.history_chunk_indices("cond") == (0, 7, 9)  # memory candidates below the drop never come back
    assert state.history_chunk_indices("uncond") == (0, 7, 9)


# ------------------------------------------------------------------ begin_shot
def test_a_shot_sink_stays_until_the_next_shot_and_takes_its_room_from_the_window() -> None:
    cache = shot_cache()
    state = cache.open_session()
    for seed in range(3):
        step(state, seed)
    state.begin_shot()
    step(state, 3)  # chunk 3 starts the shot
    for seed in range(4, 7):
        step(state, seed)
    assert state.history_chunk_indices("cond") == (0, 3, 6)
    assert attended(state) == span(0, 0) + span(3, 3) + span(6, 7)
    state.begin_shot("cond")  # a new shot on one branch: chunk 7
    step(state, 7)
    assert state.history_chunk_indices("cond") == (0, 6, 7)  # the old shot sink went with this commit
    assert state.history_chunk_indices("uncond") == (0, 3, 7)
    step(state, 8)
    assert state.history_chunk_indices("cond") == (0, 7, 8)
    assert cache._allocator.num_used == 2 * 3 * cache.spec.pages_per_chunk  # max_history_chunks stays the bound


def test_a_clean_recache_cut_attends_the_sinks_and_itself_then_pins_it() -> None:
    cache = shot_cache()
    state = cache.open_session()
    for seed in range(5):
        step(state, seed)
    state.begin_shot()
    step(state, 5, commit=False)  # denoising: the full window
    state.drop_window()
    assert attended(state) == span(0, 0) + span(5, 5)
    step(state, 5)
    for seed in range(6, 9):
        step(state, seed)
    assert state.history_chunk_indices("cond") == (0, 5, 8)


# ------------------------------------------------------------------ misuse: specific errors, nothing changed
def unchanged(cache: am.KVCache, fn, exc, match: str) -> None:
    before, pool = bookkeeping(cache), bit_copy(cache._pool.kv)
    with pytest.raises(exc, match=match):
        fn()
    assert bookkeeping(cache) == before and torch.equal(bit_copy(cache._pool.kv), pool)


def test_misuse_names_expected_and_actual_and_changes_nothing() -> None:
    cache = shot_cache()
    state = cache.open_session("s")
    for seed in range(4):
        step(state, seed)
    state.begin_shot()
    fwd = state.prepare_forward(("cond",), CHUNK, commit_current=True)
    for op in (state.drop_window, state.begin_shot):
        unchanged(cache, op, am.PendingContextError, r"expected no open forward .* got one on \['cond'\]")
    run_layers(fwd.layers, 1)
    fwd.commit()
    unchanged(cache, lambda: state.drop_window("video"), am.errors.UnknownBranchError, "expected one of")
    unchanged(cache, lambda: state.drop_window(("cond", "cond")), am.SpecError, "expected distinct branch names")
    unchanged(cache, lambda: state.begin_shot({"cond"}), am.SpecError, "ordered sequence")
    state.suspend()
    unchanged(cache, state.drop_window, am.SessionSuspendedError, "expected a resident session")
    state.resume()
    other = cache.open_session("t")
    other.close()
    unchanged(cache, other.drop_window, am.errors.SessionClosedError, "expected an open session")
    plain = am.KVCache(SMALL_SPEC, num_pages=16, backend="reference")
    p = plain.open_session()
    unchanged(plain, p.begin_shot, am.SpecError, r"pins a shot sink .*got SinkWindowPolicy\(sink_chunks=1")


def test_an_open_denoising_forward_on_another_branch_does_not_block_one_branch() -> None:
    cache = shot_cache()
    state = cache.open_session()
    for seed in range(4):
        step(state, seed)
    fwd = state.prepare_forward(("uncond",), CHUNK, commit_current=False)
    state.drop_window("cond")
    state.begin_shot("cond")
    assert state.history_chunk_indices("cond") == (0,) and fwd._transaction is not None and fwd._transaction.is_open
    fwd.abort()


# ------------------------------------------------------------------ composition
def test_a_fork_keeps_its_window_when_the_parent_drops_it_and_inherits_the_shot() -> None:
    cache = shot_cache()
    parent = cache.open_session("p")
    for seed in range(2):
        step(parent, seed)
    parent.begin_shot()
    for seed in range(2, 5):
        step(parent, seed)
    child = parent.fork("c")
    window = pages_of(parent, "cond")[cache.spec.pages_per_chunk:]
    parent.drop_window()
    assert all(cache._allocator.refcount(p) == 1 for p in window)  # the child's reference
    assert child.history_chunk_indices("cond") == (0, 2, 4)
    for seed in range(5, 8):
        step(child, seed)
    assert child.history_chunk_indices("cond") == (0, 2, 7)  # the inherited shot sink (chunk 2) stays
    child.close()
    parent.close()
    assert cache._allocator.num_used == 0


@pytest.mark.parametrize("how", ["suspend", "save"])
def test_suspend_resume_and_session_files_keep_the_shot_and_the_dropped_window(tmp_path, how) -> None:
    if how == "save":
        pytest.importorskip("safetensors")
    cache, twin_cache = shot_cache(), shot_cache()
    s, twin = cache.open_session("s"), twin_cache.open_session("s")
    for st in (s, twin):
        for seed in range(3):
            step(st, seed)
        st.begin_shot()
        step(st, 3)
        step(st, 4)
        st.drop_window("uncond")
        st.begin_shot("uncond")  # begins at chunk 5, after the drop
    if how == "suspend":
        s.suspend()
        s.resume().wait()  # type: ignore[attr-defined]
        loaded = s
    else:
        path = tmp_path / "s.safetensors"
        cache.save_sessions(path, [s])
        s.close()
        [loaded] = shot_cache().load_sessions(path)
    for seed in range(5, 9):
        got, want = step(loaded, seed), step(twin, seed)
        assert all(torch.equal(x, y) for x, y in zip(got, want)), seed
    for b in BOTH:
        assert loaded.history_chunk_indices(b) == twin.history_chunk_indices(b)
    assert twin.history_chunk_indices("cond") == (0, 3, 8) and twin.history_chunk_indices("uncond") == (0, 5, 8)


def test_a_file_written_before_shots_loads_with_none(tmp_path) -> None:
    pytest.importorskip("safetensors")
    from ardiff_modules.host.file_header import HeaderReader

    reader = HeaderReader("f", SHOT_SPEC, set())
    branch = {"committed_chunks": 2, "committed_tokens": 8, "history": [], "history_index": [],
              "history_start": [], "latents": {}, "recent": {}}
    image = reader.branch(branch, "b")
    assert image.shot_start is None and image.window_floor == 0
    with pytest.raises(am.SessionFileError, match="window_floor"):
        reader.branch({**branch, "window_floor": 3, "shot_start": None}, "b")
    plain = HeaderReader("f", SMALL_SPEC, set())
    with pytest.raises(am.SessionFileError, match="retention pins no shot sink"):
        plain.branch({**branch, "window_floor": 0, "shot_start": 1}, "b")


def test_contiguous_extents_get_the_dropped_slots_back() -> None:
    cache = shot_cache(num_pages=40, contiguous_extents=True)
    state = cache.open_session()
    for seed in range(5):
        step(state, seed)
    extent = set(state.branch_pages("cond").extent)
    state.drop_window()
    state.begin_shot()
    for seed in range(5, 10):
        step(state, seed)
        assert set(pages_of(state, "cond")) <= extent  # every chunk in the ring: no page outside it
    assert state.history_chunk_indices("cond") == (0, 5, 9)
    assert cache._allocator.num_used == 2 * len(extent)


def test_recache_rules_never_rebuild_a_dropped_chunk() -> None:
    spec = dataclasses.replace(SHOT_SPEC, recache=am.RecacheRule.longlive(global_sink=True))
    cache = shot_cache(spec)
    state = cache.open_session()
    for seed in range(5):
        step(state, seed)
    state.drop_window()
    step(state, 5)
    assert state.recache_chunk_indices("cond") == (5,)  # not chunk 4 as context: it was dropped, not evicted
    for seed in range(6, 9):
        step(state, seed)
    assert state.recache_chunk_indices("cond") == (6, 7, 8)  # chunk 6 (evicted after the drop) as context
    with state.prepare_recache() as fwd:
        run_layers(fwd.layers, 2, 3 * CHUNK)
    assert state.history_chunk_indices("cond") == (0, 7, 8)


def test_relative_sinks_sit_before_the_oldest_visible_chunk_the_shot_sink_included() -> None:
    spec = dataclasses.replace(SHOT_SPEC, relative_sinks=True)
    cache = shot_cache(spec)
    state = cache.open_session()
    for seed in range(3):
        step(state, seed)
    state.begin_shot()
    for seed in range(3, 7):
        step(state, seed)
    with state.prepare_forward(("cond",), CHUNK, commit_current=False) as fwd:
        for layer in fwd.layers:
            am.chunk_attention(*tensors(1), layer, sink_query=tensors(1)[0])
        assert fwd.sink_shifts == (3 * CHUNK - CHUNK,)  # the sink ends at 4, the shot sink (chunk 3) starts at 12
    state.drop_window()
    with state.prepare_forward(("cond",), CHUNK, commit_current=True) as fwd:
        outs = [am.chunk_attention(*tensors(1), layer, sink_query=tensors(1)[0]) for layer in fwd.layers]
        assert fwd.sink_shifts == (7 * CHUNK - CHUNK,) and all(torch.isfinite(o).all() for o in outs)


def test_an_fp8_pool_drops_and_pins_like_the_float_one() -> None:
    fp8 = shot_cache(dataclasses.replace(SHOT_SPEC, kv_dtype="float8_e4m3fn"))
    state = fp8.open_session()
    for seed in range(3):
        step(state, seed)
    state.drop_window()
    state.begin_shot()
    step(state, 3)
    for seed in range(4, 7):
        step(state, seed)
    assert state.history_chunk_indices("cond") == (0, 3, 6)
    state.drop_window()  # the shot sink (committed) goes with the window
    assert state.history_chunk_indices("cond") == (0,)
    assert fp8._allocator.num_used == 2 * fp8.spec.pages_per_chunk


def test_a_training_scope_keeps_what_a_dropped_window_released_until_the_backward() -> None:
    """A checkpointed forward with gradients, then ``drop_window`` and every free page poisoned (reuse): the
    recomputation in the backward reads the held pages, so the gradients equal a twin's that never dropped; leaving
    the scope frees the dropped window."""
    from tests.support.training_peers import poison_free_pages

    grads = []
    for drop in (False, True):
        cache = shot_cache()
        state = cache.open_session()
        for seed in range(4):
            step(state, seed)
        q, k, v = (t.requires_grad_() for t in tensors(2, seed=7))
        with am.TrainingScope(cache) as scope:
            with state.prepare_forward(BOTH, CHUNK, commit_current=True) as fwd:
                out = sum(scope.checkpoint(am.chunk_attention, q, k, v, layer).sum() for layer in fwd.layers)
            if drop:
                ppc = cache.spec.pages_per_chunk
                read = [p for b in BOTH for p in pages_of(state, b)[ppc:-ppc]]  # the window the forward read
                state.drop_window()
                assert read and all(cache._allocator.refcount(p) == 1 for p in read)  # held by the scope only
                poison_free_pages(cache)
            out.backward()
        grads.append([t.grad.clone() for t in (q, k, v)])
        if drop:
            assert cache._allocator.num_used == 2 * cache.spec.pages_per_chunk  # the sinks alone
    for got, want in zip(grads[1], grads[0]):
        assert torch.isfinite(got).all() and torch.equal(got, want)
