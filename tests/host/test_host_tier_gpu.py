"""The CUDA side of the host tier (pinned host pages, side-stream copies, the resume handle's event)."""

from __future__ import annotations

import pytest
import torch

import ardiff_modules as am
from tests.support.gpu import GPU
from tests.support.small_cache import BOTH, CHUNK, SMALL_SPEC

pytestmark = list(GPU)


@pytest.mark.parametrize("extents", [False, True])
def test_cuda_suspend_resume_matches_a_twin(extents):
    caches = [am.KVCache(SMALL_SPEC, num_pages=64, device="cuda", backend="reference", contiguous_extents=extents)
              for _ in range(2)]
    state, twin = (c.open_session("s") for c in caches)
    g = torch.Generator().manual_seed(0)
    for seed in range(4):
        with state.prepare_forward(BOTH, CHUNK, commit_current=True) as f1, \
                twin.prepare_forward(BOTH, CHUNK, commit_current=True) as f2:
            for l1, l2 in zip(f1.layers, f2.layers):
                q, k, v = (torch.randn(2, CHUNK, 2, 4, generator=g).cuda() for _ in range(3))
                assert torch.equal(am.chunk_attention(q, k, v, l1), am.chunk_attention(q, k, v, l2))
        if seed == 1:
            state.suspend()
            assert caches[0]._allocator.num_used == 0
            tier = caches[0]._host_tier
            assert tier.host_page_tensor(tier.pages.pages()[0]).is_pinned()
            handle = state.resume()
            assert handle.ready() in (True, False)  # an event; the next prepare orders the stream after it
    handle.wait()
    assert handle.ready()


def test_cuda_prompt_published_while_suspended_wins_and_reads_on_the_device():
    cache = am.KVCache(SMALL_SPEC, num_pages=64, device="cuda", backend="reference")
    state = cache.open_session("s")

    def prompt(seed: float):
        return [(torch.full((3, 2, 4), seed + i, device="cuda"), torch.full((3, 2, 4), -seed, device="cuda"))
                for i in range(2)]

    for b in BOTH:
        state.populate_cross_attention(b, "text", prompt(1.0))
    with state.prepare_forward(BOTH, CHUNK, commit_current=True) as fwd:
        for layer in fwd.layers:
            q = torch.randn(2, CHUNK, 2, 4, device="cuda")
            am.chunk_attention(q, q, q, layer)
    state.suspend()
    held = state._cross_entry("uncond", "text")
    assert held is not None and held.k.device.type == "cpu" and held.k.is_pinned()  # the prompt left the device
    got = state.get_cross_attention_kv("uncond", "text")  # answered on the device, as when resident
    assert got[1]["k"].device.type == "cuda" and float(got[1]["k"][0, 0, 0]) == 2.0
    state.populate_cross_attention("cond", "text", prompt(7.0))
    state.resume().wait()
    for b, seed in (("cond", 7.0), ("uncond", 1.0)):
        entry = state._cross_entry(b, "text")
        assert entry is not None and entry.k.device.type == "cuda" and float(entry.k[0, 0, 0, 0]) == seed
    state.close()
    assert cache._allocator.num_used == 0 and cache._host_tier.pages.nbytes == 0


@pytest.mark.parametrize("kind", ["per-head", "per-layer"])
def test_cuda_grouped_suspend_resume_matches_a_twin_in_every_lane(kind):
    """With retention groups: every lane's pages go to pinned rows of its own arena and come back; outputs and
    every lane's history bytes equal a twin's."""
    from tests.support import small_lanes as lanes

    caches = [lanes.make_cache(kind, 64, device="cuda") for _ in range(2)]
    state, twin = (c.open_session("s") for c in caches)
    g = torch.Generator().manual_seed(0)
    for seed in range(5):
        with state.prepare_forward(BOTH, CHUNK, commit_current=True) as f1, \
                twin.prepare_forward(BOTH, CHUNK, commit_current=True) as f2:
            for l1, l2 in zip(f1.layers, f2.layers):
                q, k, v = (torch.randn(2, CHUNK, 2, 4, generator=g).cuda() for _ in range(3))
                assert torch.equal(am.chunk_attention(q, k, v, l1), am.chunk_attention(q, k, v, l2))
        if seed in (1, 3):
            state.suspend()
            tier = caches[0]._host_tier
            assert all(lane.allocator.num_used == 0 for lane in caches[0]._lanes)
            for i, store in enumerate(tier.stores):
                assert store.pages.num_pages > 0 and tier.host_page_tensor(store.pages.pages()[0], i).is_pinned()
            state.resume()
    assert lanes.same_history(caches[0], state, caches[1], twin)
    state.close()
    assert caches[0].tiers().host_bytes == 0
