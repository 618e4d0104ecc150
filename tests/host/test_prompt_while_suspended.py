"""A prompt given while a session is suspended is never lost (issue 40, item 1).

The newer state wins: every cross-attention call answers on a suspended session as on a resident one, and a
resume (or a reset) brings back only the entries the suspend took -- a prompt published, cleared or kept while
suspended is what the next forward reads. The oracle is a twin session that never left.
"""

from __future__ import annotations

import pytest
import torch

import ardiff_modules as am
from tests.support.small_cache import BOTH, CHUNK, make_small_cache, run_layers


def prompt(seed: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A 2-layer "text" cross cache (3 tokens, 2 heads, dim 4) filled with ``seed`` and ``-seed``."""
    return [(torch.full((3, 2, 4), seed + layer), torch.full((3, 2, 4), -seed - layer)) for layer in range(2)]


def publish(state: am.KVState, seed: float) -> None:
    for b in BOTH:
        state.populate_cross_attention(b, "text", prompt(seed))


def read_prompt(state: am.KVState) -> dict[str, float | None]:
    """Per branch, the seed of the published prompt (checked against its full contents), ``None`` if absent."""
    out: dict[str, float | None] = {}
    for b in BOTH:
        if not state.is_cross_attention_populated(b, "text"):
            out[b] = None
            continue
        layers = state.get_cross_attention_kv(b, "text")
        seed = float(layers[0]["k"][0, 0, 0])
        for (k, v), got in zip(prompt(seed), layers):
            assert torch.equal(got["k"], k) and torch.equal(got["v"], v)
            assert got["k"].device == state.cache.device
        out[b] = seed
    return out


def forward_reads(state: am.KVState) -> list[torch.Tensor]:
    """A committing forward; what each of its layers reads of the "text" cache (``[streams, tokens, heads, dim]``)."""
    with state.prepare_forward(BOTH, CHUNK, commit_current=True) as fwd:
        run_layers(fwd.layers, 2, CHUNK)
        return [layer.cross_kv("text")[0].clone() for layer in fwd.layers]


def suspended_session(extents: bool = False) -> tuple[am.KVCache, am.KVState]:
    cache = make_small_cache(contiguous_extents=extents)
    state = cache.open_session("s")
    publish(state, 1.0)
    forward_reads(state)
    state.suspend()
    assert state.is_suspended
    return cache, state


@pytest.mark.parametrize("extents", [False, True], ids=["paged", "extents"])
def test_a_prompt_published_while_suspended_survives_the_resume(extents):
    cache, state = suspended_session(extents)
    assert read_prompt(state) == {"cond": 1.0, "uncond": 1.0}  # answers as when resident
    state.populate_cross_attention("cond", "text", prompt(2.0))  # the user types a new prompt while paused
    assert read_prompt(state) == {"cond": 2.0, "uncond": 1.0}
    state.resume()
    assert read_prompt(state) == {"cond": 2.0, "uncond": 1.0}  # the newer one won; the untouched one came back
    reads = forward_reads(state)
    assert all(float(r[0, 0, 0, 0]) == 2.0 + i and float(r[1, 0, 0, 0]) == 1.0 + i for i, r in enumerate(reads))
    state.close()
    assert cache._allocator.num_used == 0 and cache._host_tier.pages.nbytes == 0


def test_a_clear_while_suspended_stays_cleared():
    cache, state = suspended_session()
    state.clear_cross_attention()
    assert read_prompt(state) == {"cond": None, "uncond": None}
    state.resume()
    assert read_prompt(state) == {"cond": None, "uncond": None}
    publish(state, 3.0)  # and the next prompt is read by the next forward
    assert float(forward_reads(state)[0][0, 0, 0, 0]) == 3.0


def test_a_re_publish_after_a_clear_while_suspended_wins():
    _, state = suspended_session()
    state.clear_cross_attention()
    publish(state, 4.0)
    state.resume()
    assert read_prompt(state) == {"cond": 4.0, "uncond": 4.0}


def test_reset_of_a_suspended_session_keeps_the_prompt_it_was_told_to_keep():
    cache, state = suspended_session()
    state.reset(keep_cross_attention=("text",))
    assert not state.is_suspended and cache._host_tier.num_suspended == 0 and cache._host_tier.pages.nbytes == 0
    assert read_prompt(state) == {"cond": 1.0, "uncond": 1.0}
    assert state.token_offset("cond") == 0
    assert float(forward_reads(state)[1][0, 0, 0, 0]) == 2.0  # layer 1 of prompt 1.0, read on the device
    with pytest.raises(am.SessionNotSuspendedError, match="'s' resident"):
        state.resume()
    _, other = suspended_session()
    other.reset()
    assert read_prompt(other) == {"cond": None, "uncond": None}


def test_sharing_a_suspended_sessions_prompt_gives_device_tensors():
    cache, state = suspended_session()
    other = cache.open_session("t")
    other.share_cross_attention_from(state, "text")
    assert read_prompt(other) == {"cond": 1.0, "uncond": 1.0}
    state.populate_cross_attention("uncond", "text", prompt(5.0))  # does not reach the sharer
    assert read_prompt(other) == {"cond": 1.0, "uncond": 1.0}
    state.resume()
    assert read_prompt(state) == {"cond": 1.0, "uncond": 5.0}


def test_resume_of_a_session_that_is_not_suspended_raises_and_changes_nothing():
    cache = make_small_cache()
    state = cache.open_session("s")
    publish(state, 1.0)
    forward_reads(state)
    used = cache._allocator.num_used
    with pytest.raises(am.SessionNotSuspendedError, match="never suspended, or resumed already") as info:
        state.resume()
    assert isinstance(info.value, RuntimeError)
    state.suspend()
    state.resume()
    with pytest.raises(am.SessionNotSuspendedError):
        state.resume()  # twice
    assert cache._allocator.num_used == used and read_prompt(state) == {"cond": 1.0, "uncond": 1.0}
    state.close()
    with pytest.raises(am.errors.SessionClosedError):
        state.resume()
