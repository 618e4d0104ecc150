"""Sessions saved to a file and loaded back (issue 45): the oracle is a twin cache whose session never left.

Outputs are compared bit for bit (``torch.equal``) on the reference backend; sharing on the allocator's page
counts; "changed nothing" on the pool bytes, the scales and the bookkeeping (free queue order included).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import ardiff_modules as am
from ardiff_modules.host import files
from tests.host.test_suspend_resume import populate, ring_bytes, step
from tests.support.small_cache import BOTH, CHUNK, SMALL_SPEC, bookkeeping, make_small_cache, pages_of, tensors

FP8 = dataclasses.replace(SMALL_SPEC, kv_dtype="float8_e4m3fn")
RELATIVE = dataclasses.replace(SMALL_SPEC, relative_sinks=True)


def twins(spec: am.KVCacheSpec = SMALL_SPEC, **kwargs) -> tuple[am.KVCache, am.KVCache]:
    return tuple(am.KVCache(spec, num_pages=32, backend="reference", **kwargs) for _ in range(2))  # type: ignore


def positional_step(state: am.KVState, seed: int, commit: bool = True) -> list[torch.Tensor]:
    """:func:`step` whose queries depend on the positions (and, with relative sinks, the sink positions): what a
    loaded session must restore for RoPE."""
    keep = torch.full((2, CHUNK, 3), float(seed)) if commit else None
    with state.prepare_forward(BOTH, CHUNK, commit_current=commit, keep_latents=keep) as fwd:
        outs = []
        for i, layer in enumerate(fwd.layers):
            q, k, v = tensors(2, CHUNK, seed=seed + i)
            q = q * (1 + 0.01 * fwd.positions[..., None, None])
            sinks = fwd.sink_positions
            sink_query = None if sinks is None else (q * (1 + 0.02 * sinks[..., None, None])).contiguous()
            outs.append(am.chunk_attention(q.contiguous(), k, v, layer, sink_query=sink_query))
        return outs


def both(a: am.KVState, b: am.KVState, seed: int, commit: bool = True) -> None:
    """One forward of each, equal bit for bit."""
    out, ref = positional_step(a, seed, commit), positional_step(b, seed, commit)
    assert all(torch.equal(x, y) for x, y in zip(out, ref))


def switch_prompt(state: am.KVState) -> list[torch.Tensor]:
    """A mid-stream prompt switch: a new prompt, then the re-cache over the kept latents (its outputs)."""
    state.clear_cross_attention()
    populate(state, seed=11)
    x = state.recache_latents()  # [2, tokens, 3]: the kept latents drive the re-cache's K/V
    qkv = torch.cat([x, x[..., :1]], dim=-1).unsqueeze(2).expand(*x.shape[:2], 2, 4).contiguous()
    with state.prepare_recache() as fwd:
        return [am.chunk_attention(qkv + i, qkv, qkv, layer) for i, layer in enumerate(fwd.layers)]


def snapshot(cache: am.KVCache):
    """Everything a refused load must leave as it was."""
    return bookkeeping(cache), cache._pool.kv.view(torch.uint8).clone(), cache._pool.scales.clone()


def assert_unchanged(cache: am.KVCache, before) -> None:
    books, pool, scales = before
    assert bookkeeping(cache) == books
    assert torch.equal(cache._pool.kv.view(torch.uint8), pool) and torch.equal(cache._pool.scales, scales)
    cache._allocator.check_invariants()


@pytest.mark.parametrize(
    "spec, extents, switch",
    [
        (SMALL_SPEC, False, False),
        (SMALL_SPEC, True, False),
        (FP8, False, False),
        (RELATIVE, False, False),
        (SMALL_SPEC, False, True),
        (SMALL_SPEC, True, True),
    ],
    ids=["paged", "extents", "fp8", "relative-sinks", "prompt-switch", "prompt-switch-extents"],
)
def test_a_saved_and_loaded_session_continues_bit_identically(tmp_path, spec, extents, switch):
    cache, twin_cache = twins(spec, contiguous_extents=extents)
    s, twin = cache.open_session("s"), twin_cache.open_session("s")
    populate(s), populate(twin)
    for seed in range(4):  # past the window: evictions, a remembered chunk, kept latents
        both(s, twin, seed)
    both(s, twin, 4, commit=False)  # a denoising forward, then its commit: mid-chunk is not savable
    both(s, twin, 4)
    path = tmp_path / "s.safetensors"
    cache.save_sessions(path, [s])
    s.close()
    fresh = am.KVCache(spec, num_pages=32, backend="reference", contiguous_extents=extents)
    [loaded] = fresh.load_sessions(path)
    assert loaded.session_id == "s" and fresh.sessions == {"s": loaded}
    assert [loaded.token_offset(b) for b in BOTH] == [twin.token_offset(b) for b in BOTH]
    assert [loaded.history_chunk_indices(b) for b in BOTH] == [twin.history_chunk_indices(b) for b in BOTH]
    assert torch.equal(loaded.recache_latents(), twin.recache_latents())
    if extents:  # each chunk back in the extent slot it had (the twin's): a ragged kernel sums in the same order
        for b in BOTH:
            (slots, ring), (twin_slots, twin_ring) = ring_bytes(fresh, loaded, b), ring_bytes(twin_cache, twin, b)
            assert None not in slots and slots == twin_slots and torch.equal(ring, twin_ring)
    if switch:
        out, ref = switch_prompt(loaded), switch_prompt(twin)
        assert all(torch.equal(x, y) for x, y in zip(out, ref))
    for seed in range(5, 9):
        both(loaded, twin, seed)
    for b in BOTH:
        mine, ref = loaded.get_cross_attention_kv(b, "text"), twin.get_cross_attention_kv(b, "text")
        assert torch.equal(mine[1]["k"], ref[1]["k"])
    if spec is FP8:
        assert torch.equal(fresh._pool.scales, twin_cache._pool.scales)
        with pytest.raises(am.errors.KVScalesFixedError):  # the loaded pages hold K/V quantized with them
            fresh.set_kv_scales(torch.ones_like(fresh._pool.scales))
    fresh._allocator.check_invariants()
    loaded.close()
    assert fresh._allocator.num_used == 0


def test_a_fork_family_keeps_its_page_count_and_shared_prompts_stay_shared(tmp_path):
    cache = make_small_cache()
    a, b = cache.open_session("a"), cache.open_session("b")
    populate(a)
    for seed in range(3):
        step(a, seed)
    child = a.fork("child")
    b.share_sinks_from(a, "cond")
    b.share_cross_attention_from(a, "text")
    step(child, 7)
    path = tmp_path / "family.safetensors"
    cache.save_sessions(path, [a, child, b])
    with safe_open(str(path), "pt") as f:
        assert f.get_tensor("pages").shape[0] == cache._allocator.num_used  # each shared page written once
    fresh = make_small_cache()
    la, lchild, lb = fresh.load_sessions(path)
    assert fresh._allocator.num_used == cache._allocator.num_used
    refcounts = sorted(cache._allocator.refcount(p) for p in cache._allocator.used_pages())
    assert sorted(fresh._allocator.refcount(p) for p in fresh._allocator.used_pages()) == refcounts
    for x, y in ((la, a), (lchild, child), (lb, b)):
        assert [len(set(pages_of(x, n)) & set(pages_of(la, n))) for n in BOTH] == [
            len(set(pages_of(y, n)) & set(pages_of(a, n))) for n in BOTH
        ]
    assert lb._cross_entry("cond", "text") is la._cross_entry("cond", "text")
    for x, y, seed in ((lchild, child, 9), (lb, b, 10), (la, a, 11)):
        assert all(torch.equal(p, q) for p, q in zip(step(x, seed), step(y, seed)))
    fresh._allocator.check_invariants()


def test_saving_changes_nothing_and_refuses_sessions_it_cannot_save(tmp_path):
    cache = make_small_cache()
    s, other = cache.open_session("s"), make_small_cache().open_session("o")
    step(s, 0)
    before = snapshot(cache)
    path = tmp_path / "s.safetensors"
    cache.save_sessions(path, [s])
    assert_unchanged(cache, before)
    path.unlink()
    with pytest.raises(am.SpecError, match=r"expected sessions of this KVCache, got \['o'\]"):
        cache.save_sessions(path, [s, other])
    with pytest.raises(am.SpecError, match="expected an iterable of sessions, got KVState"):
        cache.save_sessions(path, s)
    step(s, 1, commit=False)
    with pytest.raises(am.PendingContextError, match=r"save_sessions 's': expected no open forward"):
        cache.save_sessions(path, [s])
    s.abort()
    s.suspend()
    with pytest.raises(am.SessionSuspendedError, match="save_sessions: expected a resident session"):
        cache.save_sessions(path, [s])
    s.close()
    with pytest.raises(am.errors.SessionClosedError):
        cache.save_sessions(path, [s])
    assert not path.exists() and not list(tmp_path.iterdir())


@pytest.fixture
def saved(tmp_path):
    """A file of two sessions (one with a prompt and kept latents) and a cache that holds other sessions."""
    cache = make_small_cache()
    s, t = cache.open_session("s"), cache.open_session("t")
    populate(s)
    for seed in range(3):
        step(s, seed, latents=True)
    step(t, 5)
    path = tmp_path / "two.safetensors"
    cache.save_sessions(path, [s, t])
    target = make_small_cache(num_pages=24)
    step(target.open_session("resident"), 0)
    return path, target


def rewrite(path, edit: Callable[[dict], None], tensors: Callable[[dict], None] | None = None):
    """Another file: ``path``'s with its header (and tensors) edited -- the digests left as they were."""
    with safe_open(str(path), "pt") as f:
        header, data = json.loads(f.metadata()["ardiff_modules"]), {k: f.get_tensor(k) for k in f.keys()}
    edit(header)
    if tensors is not None:
        tensors(data)
    out = path.with_name("edited.safetensors")
    save_file(data, str(out), metadata={"ardiff_modules": json.dumps(header)})
    return out


def chunk_of(header: dict) -> list:
    return header["sessions"][0]["branches"]["cond"]["history"]


HOSTILE = {
    "version": (lambda h: h.update(version=2), r"header.version: expected format version 1, got 2"),
    "format": (lambda h: h.update(format="x"), r"header.format"),
    "page out of range": (lambda h: chunk_of(h)[0].__setitem__(0, 10**6), r"history\[0\]: expected an int >= 0"),
    "negative page": (lambda h: chunk_of(h)[0].__setitem__(0, -1), r"expected an int >= 0"),
    "bool page": (lambda h: chunk_of(h)[0].__setitem__(0, True), r"expected an int"),
    "too many chunks": (lambda h: chunk_of(h).extend([[0]] * 3), r"at most 3 resident chunks"),
    "page twice": (lambda h: chunk_of(h)[1].__setitem__(0, chunk_of(h)[0][0]), r"each page once in a branch"),
    "chunk too long": (lambda h: chunk_of(h)[0].extend([0, 0]), r"1..2 pages"),
    "unknown branch": (
        lambda h: h["sessions"][0]["branches"].update(extra={}), r"branches: expected the keys \['cond', 'uncond'\]"
    ),
    "positions": (
        lambda h: h["sessions"][0]["branches"]["cond"].update(committed_tokens=1), r"history_start: expected an int"
    ),
    "overlapping chunks": (
        lambda h: h["sessions"][0]["branches"]["cond"].update(history_start=[0, 0, 0]), r"expected chunks in order"
    ),
    "unknown prompt": (lambda h: h["sessions"][0]["cross"][0].__setitem__(0, "img"), r"cross\[0\]: expected \[cache"),
    "missing tensor": (lambda h: h["sessions"][0]["cross"][0].__setitem__(2, "cross.9"), r"tensor 'cross.9.k'"),
    "duplicate ids": (lambda h: h["sessions"][1].update(id="s"), r"distinct session ids"),
    "not json": (None, r"header: expected valid JSON"),
    "no header": (None, r"metadata: expected a 'ardiff_modules' key"),
    "spec": (lambda h: h["spec"].update(window_chunks="3"), r"spec field 'window_chunks': expected 2 .* got 3"),
    # the review's crafted files: loaded, then a raw error in the next forward / a raw ValueError from int()
    "tokens past int64": (
        lambda h: h["sessions"][0]["branches"]["cond"].update(committed_tokens=2**70), r"committed_tokens: expected an int"
    ),
    "tokens past the chunks": (
        lambda h: h["sessions"][0]["branches"]["cond"].update(
            committed_tokens=h["sessions"][0]["branches"]["cond"]["committed_chunks"] * 4 + 1
        ), r"committed_tokens: expected an int >= 0 and <= ",
    ),
    "slot twice": (
        lambda h: h["sessions"][0]["branches"]["cond"].update(slots=[0] * len(chunk_of(h))), r"distinct extent slots"
    ),
    "slot past the extent": (
        lambda h: h["sessions"][0]["branches"]["cond"].update(slots=[99] * len(chunk_of(h))), r"slots\[0\]: expected"
    ),
    "unicode digit key": (
        lambda h: h["sessions"][0]["branches"]["cond"]["latents"].update({"\u00b2": "latent.0"}), r"latents key"
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_or_foreign_header_is_refused_and_changes_nothing(saved, case):
    path, target = saved
    edit, message = HOSTILE[case]
    if case in ("not json", "no header"):
        with safe_open(str(path), "pt") as f:
            data = {k: f.get_tensor(k) for k in f.keys()}
        path = path.with_name("edited.safetensors")
        save_file(data, str(path), metadata={"ardiff_modules": "{"} if case == "not json" else None)
    else:
        path = rewrite(path, edit)
    before = snapshot(target)
    with pytest.raises(am.SessionFileError, match=message) as info:
        target.load_sessions(path)
    assert isinstance(info.value, ValueError)
    assert_unchanged(target, before)
    assert list(target.sessions) == ["resident"]


def test_truncated_corrupted_and_foreign_files_are_refused_and_change_nothing(saved, tmp_path):
    path, target = saved
    data = path.read_bytes()
    cases = {
        "truncated": (data[: len(data) - 7], "cannot be read"),
        "cut header": (data[:20], "cannot be read"),
        "empty": (b"", "cannot be read"),
        "corrupted": (
            data[:-3] + bytes([data[-3] ^ 0x40]) + data[-2:], r"tensor 'pages': expected bytes of SHA-256 .* corrupted"
        ),
    }
    foreign = tmp_path / "foreign.safetensors"
    save_file({"weight": torch.zeros(2)}, str(foreign))
    before = snapshot(target)
    for name, (content, message) in cases.items():
        bad = tmp_path / f"{name.replace(' ', '_')}.safetensors"
        bad.write_bytes(content)
        with pytest.raises(am.SessionFileError, match=message):
            target.load_sessions(bad)
        assert_unchanged(target, before)
    with pytest.raises(am.SessionFileError, match="metadata: expected a 'ardiff_modules' key"):
        target.load_sessions(foreign)
    with pytest.raises(am.SessionFileError, match=r"tensor 'pages': expected \[\d+, 2, 2, 2, 2, 16\] torch.uint8"):
        target.load_sessions(rewrite(path, lambda h: h.update(pages=h["pages"] + 1)))
    digest = files._digest(torch.zeros(3))
    with pytest.raises(am.SessionFileError, match=r"tensor 'pages': expected \[.*uint8, got .*float32"):
        target.load_sessions(rewrite(
            path, lambda h: h["digests"].update(pages=digest), lambda d: d.update(pages=torch.zeros(3))
        ))
    assert_unchanged(target, before)


def test_ids_clash_and_room_are_checked_before_anything_is_allocated(saved):
    path, target = saved
    target.open_session("t")
    before = snapshot(target)
    with pytest.raises(am.errors.SessionIdClashError, match=r"expected ids not open in this cache, got \['t'\]"):
        target.load_sessions(path)
    assert_unchanged(target, before)
    with pytest.raises(am.SpecError, match="a sequence of 2 ids"):
        target.load_sessions(path, ["only-one"])
    with pytest.raises(am.SpecError, match="distinct non-empty ids"):
        target.load_sessions(path, ["x", "x"])
    hog = target.open_session("hog")
    for seed in range(3):
        step(hog, seed)  # 12 more pages: 16 of 24 used, the file needs 16
    before = snapshot(target)
    room = r"load_sessions\(.*two.safetensors\): needed 16 free device pages .* got 8 free of 24"
    with pytest.raises(am.CapacityError, match=room):
        target.load_sessions(path, ["s2", "t2"])
    assert_unchanged(target, before)
    hog.close()
    loaded = target.load_sessions(path, ["s2", "t2"])
    assert [x.session_id for x in loaded] == ["s2", "t2"]
    target._allocator.check_invariants()
    twice = make_small_cache()
    first, again = twice.load_sessions(path), twice.load_sessions(path, ["s3", "t3"])  # two independent families
    assert not set(pages_of(again[0], "cond")) & set(pages_of(first[0], "cond"))
    assert twice._allocator.num_used == 32


def test_fp8_scales_that_differ_from_the_pools_are_refused(tmp_path):
    cache, other = twins(FP8)
    s, o = cache.open_session("s"), other.open_session("o")
    step(s, 0)
    step(o, 3, latents=False)  # the other pool calibrated from other K/V: other scales, already used
    path = tmp_path / "fp8.safetensors"
    cache.save_sessions(path, [s])
    assert not torch.equal(cache._pool.scales, other._pool.scales)
    before = snapshot(other)
    with pytest.raises(am.SessionFileError, match="'kv_scales': expected the FP8 scales this pool already"):
        other.load_sessions(path)
    assert_unchanged(other, before)
    s.close()
    [back] = cache.load_sessions(path)  # the same scales: loads into the pool that wrote it
    assert back.token_offset("cond") == CHUNK


def test_an_interrupted_copy_rolls_the_load_back(saved, monkeypatch):
    path, target = saved
    before = snapshot(target)

    def boom(*args, **kwargs):
        raise KeyboardInterrupt("copy failed")

    monkeypatch.setattr(files, "_copy_pages", boom)
    with pytest.raises(KeyboardInterrupt):
        target.load_sessions(path)
    monkeypatch.undo()
    assert_unchanged(target, before)
    assert len(target.load_sessions(path)) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", [SMALL_SPEC, FP8], ids=["float32", "fp8"])
def test_a_file_crosses_devices_cpu_to_cuda_and_back(tmp_path, spec):
    """CPU -> CUDA -> CPU: the pages arrive as the same bytes, the prompt and latents on the cache's device, and
    back on the CPU the session continues bit-identically to a twin that never left."""
    cpu, twin_cache = twins(spec)
    s, twin = cpu.open_session("s"), twin_cache.open_session("s")
    populate(s), populate(twin)
    for seed in range(4):
        both(s, twin, seed)
    cpu.save_sessions(tmp_path / "a.safetensors", [s])
    cuda = am.KVCache(spec, num_pages=32, device="cuda", backend="reference")
    [on_gpu] = cuda.load_sessions(tmp_path / "a.safetensors")
    for b in BOTH:
        assert torch.equal(cuda._pool.kv[:, :, pages_of(on_gpu, b)].view(torch.uint8).cpu(),
                           cpu._pool.kv[:, :, pages_of(s, b)].view(torch.uint8))
        assert on_gpu._cross_entry(b, "text").k.device.type == "cuda"
    assert on_gpu.recache_latents().device.type == "cuda"
    assert torch.equal(cuda._pool.scales.cpu(), cpu._pool.scales)
    cuda.save_sessions(tmp_path / "b.safetensors", [on_gpu])
    [back] = make_small_cache().load_sessions(tmp_path / "b.safetensors") if spec is SMALL_SPEC else (
        am.KVCache(spec, num_pages=32, backend="reference").load_sessions(tmp_path / "b.safetensors")
    )
    for seed in range(4, 7):
        both(back, twin, seed)


# ------------------------------------------------------------------ retention groups: one pages.<lane> per lane
# (tests/support/small_lanes.py: the small cache uniform, per head (three lanes) and per layer (two lanes))
from tests.support import small_lanes as lanes  # noqa: E402


def lane_twins(kind: str, fields: dict | None = None, **kwargs) -> tuple[am.KVCache, am.KVCache]:
    return tuple(lanes.make_cache(kind, fields=fields, **kwargs) for _ in range(2))  # type: ignore[return-value]


def header_of(path) -> dict:
    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()["ardiff_modules"])


@pytest.mark.parametrize(
    "fields, extents", [({}, False), ({}, True), ({"kv_dtype": "float8_e4m3fn"}, False)], ids=["paged", "extents", "fp8"]
)
@pytest.mark.parametrize("kind", lanes.KINDS)
def test_a_saved_family_continues_bit_identically_in_every_lane_of_a_new_cache(tmp_path, kind, fields, extents):
    """A fork family saved and loaded into a fresh cache: every lane holds the twin's pool contents (chunks, bytes,
    slots, scales), shares what it shared, and continues bit-identically."""
    cache, twin_cache = lane_twins(kind, fields, contiguous_extents=extents)
    families = []
    for c in (cache, twin_cache):
        a = c.open_session("a")
        populate(a)
        for seed in range(4):
            step(a, seed, latents=True)
        child = a.fork("child")
        step(child, 7, latents=True)
        families.append((a, child))
    (a, child), (twin_a, twin_child) = families
    path = tmp_path / "family.safetensors"
    cache.save_sessions(path, [a, child])
    used = [lane.allocator.num_used for lane in cache._lanes]
    refcounts = [sorted(map(lane.allocator.refcount, lane.allocator.used_pages())) for lane in cache._lanes]
    a.close(), child.close()
    fresh = lanes.make_cache(kind, fields=fields, contiguous_extents=extents)
    la, lchild = fresh.load_sessions(path)
    if not extents:  # each page written once and back shared (a ring comes back in its own extent)
        assert [lane.allocator.num_used for lane in fresh._lanes] == used
        assert [sorted(map(lane.allocator.refcount, lane.allocator.used_pages())) for lane in fresh._lanes] == refcounts
    for mine, twin in ((la, twin_a), (lchild, twin_child)):
        assert lanes.same_history(fresh, mine, twin_cache, twin, slots=mine is la or not extents)
        assert torch.equal(mine.recache_latents(), twin.recache_latents()) if kind == "uniform" else True
    assert all(torch.equal(x.pool.scales, y.pool.scales) for x, y in zip(fresh._lanes, twin_cache._lanes))
    for seed in range(8, 11):
        for mine, twin in ((la, twin_a), (lchild, twin_child)):
            assert all(torch.equal(x, y) for x, y in zip(step(mine, seed, latents=True), step(twin, seed, latents=True)))
    for b in BOTH:
        assert torch.equal(lchild.get_cross_attention_kv(b, "text")[1]["k"], twin_child.get_cross_attention_kv(b, "text")[1]["k"])
    lanes.assert_clean(fresh)


def test_a_grouped_file_holds_one_pages_tensor_per_lane_and_names_its_retention_map(tmp_path):
    cache = lanes.make_cache("per-head")
    s = cache.open_session("s")
    for seed in range(3):
        step(s, seed, latents=True)
    cache.save_sessions(tmp_path / "g.safetensors", [s])
    header = header_of(tmp_path / "g.safetensors")
    with safe_open(str(tmp_path / "g.safetensors"), "pt") as f:
        names = set(f.keys())
        for lane in cache._lanes:  # each lane's distinct history pages once, in its own page shape
            pages = f.get_tensor(f"pages.{lane.name}")
            expected = len({p for b in BOTH for c in s._lane_pages(b)[lane.index].history for p in c})
            assert pages.shape[0] == expected and tuple(pages.shape[1:3]) == tuple(lane.pool.kv.shape[:2])
    assert {n for n in names if not n.startswith("latent.")} == {
        f"{kind}.{lane.name}" for lane in cache._lanes for kind in ("pages", "scales")
    }
    assert header["head_retention"] == lanes.PER_HEAD.to_dict() and "pages" not in header
    assert [lane["name"] for lane in header["lanes"]] == ["l/1h", "l/2h", "g/1h"]
    assert set(header["sessions"][0]) == {"cross", "id", "lanes"}


def test_a_uniform_cache_file_is_as_before(tmp_path):
    """No retention keys, one ``pages`` and one ``scales`` tensor, branches per session: the format a uniform
    cache wrote before retention groups."""
    cache = make_small_cache()
    s = cache.open_session("s")
    step(s, 0, latents=True)
    cache.save_sessions(tmp_path / "u.safetensors", [s])
    header = header_of(tmp_path / "u.safetensors")
    assert sorted(header) == ["digests", "format", "pages", "scales_fixed", "sessions", "spec", "version"]
    assert sorted(header["sessions"][0]) == ["branches", "cross", "id"] and header["version"] == 1
    assert sorted(header["digests"]) == ["latent.0", "latent.1", "pages", "scales"]


GROUP_REFUSALS = {
    "another map, the same lanes": (
        "per-head", lambda: lanes.make_cache(
            "uniform", fields=dict(sink_chunks=0, window_chunks=None, head_retention=am.HeadRetention(
                {"l": (0, 1), "g": (1, 2)}, [["g", "l"], ["l", "l"]]))
        ), r"header.head_retention: expected this cache's retention map",
    ),
    "another map's windows": (
        "per-head", lambda: lanes.make_cache(
            "uniform", fields=dict(sink_chunks=0, window_chunks=None, head_retention=am.HeadRetention(
                {"l": (0, 2), "g": (1, 2)}, [["l", "g"], ["l", "l"]]))
        ), r"header.head_retention: expected this cache's retention map",
    ),
    "grouped file, uniform cache": (
        "per-layer", lambda: lanes.make_cache("uniform"),
        r"header.head_retention: expected no retention map \(this cache has no retention groups\)",
    ),
    "one group's file, uniform cache": (
        "one-group", lambda: lanes.make_cache("uniform"),
        r"header.head_retention: expected no retention map \(this cache has no retention groups\)",
    ),
    "uniform file, grouped cache": (
        "uniform", lambda: lanes.make_cache("per-layer"), r"header.head_retention: expected this cache's retention map",
    ),
    "per-layer file, per-head cache": (
        "per-layer", lambda: lanes.make_cache("per-head"), r"header.head_retention: expected this cache's retention map",
    ),
}


@pytest.mark.parametrize("case", list(GROUP_REFUSALS))
def test_a_file_of_another_retention_map_is_refused_and_changes_no_lane(tmp_path, case):
    kind, target_of, message = GROUP_REFUSALS[case]
    cache = lanes.make_cache(kind)
    s = cache.open_session("s")
    for seed in range(3):
        step(s, seed, latents=True)
    cache.save_sessions(tmp_path / "f.safetensors", [s])
    target = target_of()
    step(target.open_session("resident"), 0)
    before = lanes.everything(target)
    with pytest.raises(am.SessionFileError, match=message):
        target.load_sessions(tmp_path / "f.safetensors")
    lanes.assert_unchanged(target, before)
    assert list(target.sessions) == ["resident"]


def _lane_branch(header: dict, lane: int, branch: str = "cond") -> dict:
    return header["sessions"][0]["lanes"][lane][branch]


LANE_HOSTILE = {
    "lanes renamed": (lambda h: h["lanes"][0].update(name="x/1h"), r"header.lanes: expected this cache's lanes"),
    "lanes reordered": (lambda h: h["lanes"].reverse(), r"header.lanes: expected this cache's lanes"),
    "a lane's heads": (lambda h: h["lanes"][0].update(heads=[[1]]), r"header.lanes: expected this cache's lanes"),
    "a lane missing": (lambda h: h["lanes"].pop(), r"header.lanes: expected this cache's lanes"),
    "a session's lane missing": (
        lambda h: h["sessions"][0]["lanes"].pop(), r"sessions\[0\].lanes: expected 3 lanes' branches"
    ),
    "two clocks": (
        lambda h: _lane_branch(h, 1).update(committed_chunks=_lane_branch(h, 1)["committed_chunks"] + 1),
        r"the same committed_chunks and committed_tokens in every lane",
    ),
    "a page past its lane's tensor": (
        lambda h: _lane_branch(h, 0)["history"][0].__setitem__(0, h["lanes"][0]["pages"]), r"lanes\[0\].cond.history"
    ),
    "more chunks than its lane keeps": (  # l/1h keeps one chunk (window 1); g/1h three
        lambda h: _lane_branch(h, 0)["history"].append([0]), r"lanes\[0\].cond.history: expected at most 1 resident"
    ),
    "a branch per uniform file": (
        lambda h: h["sessions"][0].update(branches=h["sessions"][0].pop("lanes")[0]), r"sessions\[0\]: expected the keys"
    ),
}


@pytest.mark.parametrize("case", list(LANE_HOSTILE))
def test_a_hostile_lane_layout_is_refused_and_changes_no_lane(tmp_path, case):
    cache = lanes.make_cache("per-head")
    s = cache.open_session("s")
    for seed in range(4):
        step(s, seed, latents=True)
    path = tmp_path / "g.safetensors"
    cache.save_sessions(path, [s])
    edit, message = LANE_HOSTILE[case]
    target = lanes.make_cache("per-head")
    step(target.open_session("resident"), 0)
    before = lanes.everything(target)
    with pytest.raises(am.SessionFileError, match=message):
        target.load_sessions(rewrite(path, edit))
    lanes.assert_unchanged(target, before)
    assert target.load_sessions(path)[0].committed_chunks("cond") == 4  # the file itself loads


@pytest.mark.parametrize("kind", ["per-head", "per-layer"])
def test_a_grouped_load_checks_room_in_every_lane_then_rolls_every_lane_back(tmp_path, kind, monkeypatch):
    """Room in the first lanes but not the last: refused naming it, nothing allocated; a copy failing in the last
    lane (after the earlier lanes copied): every lane's reservation rolled back exactly."""
    cache = lanes.make_cache(kind)
    s = cache.open_session("s")
    populate(s)
    for seed in range(4):
        step(s, seed, latents=True)
    path = tmp_path / "g.safetensors"
    cache.save_sessions(path, [s])
    target = lanes.make_cache(kind)
    step(target.open_session("resident"), 0)
    last = target._lanes[-1]
    hog = last.allocator.allocate(last.allocator.num_free - 1)
    before = lanes.everything(target)
    with pytest.raises(am.CapacityError, match=f"lane '{last.name}': needed"):
        target.load_sessions(path)
    lanes.assert_unchanged(target, before)
    last.allocator.decref(hog)
    before = lanes.everything(target)
    calls = []
    real = files._copy_pages

    def fail_last(pool, pages, copies):
        calls.append(pool)
        if pool is last.pool:
            raise KeyboardInterrupt("copy failed")
        real(pool, pages, copies)

    monkeypatch.setattr(files, "_copy_pages", fail_last)
    with pytest.raises(KeyboardInterrupt):
        target.load_sessions(path)
    monkeypatch.undo()
    assert len(calls) == len(target._lanes)  # the earlier lanes had copied (into pages now free again)
    lanes.assert_unchanged(target, before, free_bytes=False)
    [loaded] = target.load_sessions(path)
    assert lanes.same_history(target, loaded, cache, s)


def test_grouped_fp8_scales_that_differ_from_a_lanes_pool_are_refused(tmp_path):
    fp8 = {"kv_dtype": "float8_e4m3fn"}
    cache, other = lane_twins("per-layer", fp8)
    s, o = cache.open_session("s"), other.open_session("o")
    step(s, 0)
    step(o, 3)  # the other pool calibrated from other K/V: other scales, already used
    cache.save_sessions(tmp_path / "fp8.safetensors", [s])
    before = lanes.everything(other)
    with pytest.raises(am.SessionFileError, match=r"'kv_scales' \(lane 'sink0_window1/2h'\): expected the FP8"):
        other.load_sessions(tmp_path / "fp8.safetensors")
    lanes.assert_unchanged(other, before)


def test_a_load_refused_by_a_later_lane_leaves_every_lane_s_pool_as_it_was(tmp_path):
    """Extents: the page counts fit every lane, but the last lane's free pages hold no run for an extent, so its
    reservation refuses. Nothing may change -- the earlier lanes' pools included (found by the session state
    machine: the load copied the first lane's pages into its free pages before the last lane reserved)."""
    cache = lanes.make_cache("per-layer", num_pages=96, contiguous_extents=True)
    a = cache.open_session("a")
    populate(a)
    for seed in range(4):
        step(a, seed, latents=True)
    path = tmp_path / "a.safetensors"
    cache.save_sessions(path, [a])
    last = cache._lanes[-1].allocator
    taken = last.allocate(last.num_free)
    last.decref(taken[::2])  # every other page free: enough pages, no run of two
    before = bookkeeping(cache), [lane.pool.kv.view(torch.uint8).clone() for lane in cache._lanes]
    with pytest.raises(am.CapacityError):
        cache.load_sessions(path, ["copy"])
    assert bookkeeping(cache) == before[0]
    for lane, pool in zip(cache._lanes, before[1]):
        assert torch.equal(lane.pool.kv.view(torch.uint8), pool), f"lane {lane.name}: a refused load wrote its pool"
    last.decref(taken[1::2])


def test_large_tensors_are_digested_in_blocks_and_old_plain_digests_still_verify(tmp_path, monkeypatch):
    """Above ``DIGEST_BLOCK_BYTES`` a tensor's digest is a tree of block SHA-256s hashed in parallel (a save's and a
    load's hashing ran at one core's ~1 GB/s); one flipped byte in any block is still caught, and a file written with
    a plain SHA-256 of the same tensor (before block digests) still loads."""
    monkeypatch.setattr(files, "DIGEST_BLOCK_BYTES", 64)  # every pages tensor is many blocks here
    cache = make_small_cache()
    s = cache.open_session("s")
    populate(s)
    for seed in range(3):
        step(s, seed)
    path = tmp_path / "blocks.safetensors"
    cache.save_sessions(path, [s])
    header = json.loads(safe_open(str(path), "pt").metadata()["ardiff_modules"])
    assert header["digests"]["pages"].startswith("tree:")
    with safe_open(str(path), "pt") as f:
        pages = f.get_tensor("pages")
    middle = pages.reshape(-1).view(torch.uint8).numel() // 2
    target = make_small_cache()
    before = snapshot(target)

    def flip(data: dict) -> None:
        raw = data["pages"].reshape(-1).view(torch.uint8)
        raw[middle] ^= 0x40

    with pytest.raises(am.SessionFileError, match=r"tensor 'pages': expected bytes of SHA-256 .* corrupted"):
        target.load_sessions(rewrite(path, lambda h: None, flip))
    assert_unchanged(target, before)
    plain = hashlib.sha256(pages.reshape(-1).view(torch.uint8).numpy()).hexdigest()
    (loaded,) = target.load_sessions(rewrite(path, lambda h: h["digests"].update(pages=plain)))
    assert loaded.committed_chunks("cond") == s.committed_chunks("cond")
