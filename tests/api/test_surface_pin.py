"""The public surface, pinned (issue 41 item 6): ``__all__`` and the public members of the objects a program holds.

A name added here is an API promise, a name removed breaks users: neither may happen silently. When a test below
fails on purpose, update the pinned set in this file *and* list the change in CHANGELOG.md (the Unreleased
section: "Added" for a new name, "Removed" / "Changed" with old -> new or "now private: import from X").
Engine internals belong to their owners with a leading underscore (the forward manager owns contexts and
finishes forwards; the pool, the allocator and the host tier are ``KVCache``'s private parts).
"""

from __future__ import annotations

import importlib

import pytest
import torch

import ardiff_modules as am

HOW_TO_CHANGE = (
    "update the pinned set in tests/api/test_surface_pin.py and list the change in CHANGELOG.md "
    "(Unreleased: added names, or removed/renamed ones as 'old -> new' / 'now private: import from X')"
)

ALL = {
    # the cache, its spec and sessions, the contexts a forward hands to layers
    "KVCache", "KVCacheSpec", "CrossAttentionSpec", "KVState", "ForwardContext", "LayerContext", "CacheStats",
    # retention policies and rules
    "RetentionPolicy", "SinkWindowPolicy", "SinkWindowMemoryPolicy", "FrameWindowPolicy", "PhasedPolicy",
    "SelectedFramesPolicy",
    "ShotSinkPolicy", "RecacheRule", "HeadRetention",
    # attention modules, their functional forms, RoPE
    "ChunkSelfAttention", "CachedCrossAttention", "chunk_attention", "cached_cross_attention",
    "populate_cross_attention", "RotaryEmbedding", "VideoRotaryEmbedding", "apply_rope",
    # backends (what ``backend=`` takes)
    "AttentionBackend", "ReferenceBackend", "FlashInferBackend",
    # compile, CUDA graphs, warm starts, training
    "CompiledStep", "CUDAGraphStep", "warm_up", "save_compile_cache", "load_compile_cache", "TrainingScope",
    # exceptions: the base, what a working program handles, what the docs catch (all of them: ardiff_modules.errors)
    "ARDiffError", "SpecError", "CapacityError", "TensorMismatchError", "StreamPositionError", "NonFiniteKVError",
    "CommitFailedError", "KVCalibrationError", "BackendUnavailableError", "PendingContextError",
    "ParticipantCommitError", "SessionSuspendedError", "SessionNotSuspendedError", "SessionFileError",
    "SessionTransferError", "TrainingScopeError", "CompileInputError", "CompileCacheError",
    "CompileInputWarning", "UncommittedForwardsWarning",
}

FORWARD_CONTEXT = {
    "streams", "layers", "positions", "sink_positions", "seq_len", "num_streams", "num_chunks", "chunk_size", "dtype",
    "commit_current", "pending_attention", "relative_sinks", "sink_shifts", "token_offsets", "to_dense",
    "key_positions", "status", "is_active", "commit", "abort",
}

LAYER_CONTEXT = {
    "layer_index", "k_cache", "v_cache", "forward", "cross", "cross_kv", "positions", "sink_positions", "num_streams",
    "seq_len",
}

KV_CACHE = {
    # construction and properties
    "spec", "backend", "device", "dtype", "kv_dtype", "kv_scales", "set_kv_scales", "extent_chunks", "policy",
    "check_finite", "lock", "is_closed", "max_forward_contexts", "close",
    # sessions and forwards
    "sessions", "open_session", "prepare_forward", "prepare_recache", "recache_latents",
    "release_idle_forward_contexts",
    # admission, tiers, stats
    "pages_per_session", "recache_reserve", "sessions_that_fit", "can_admit", "admit_session", "tiers",
    "reserve_host", "stats", "reset_peak",
    # sessions in files and over torch.distributed
    "save_sessions", "load_sessions", "send_sessions", "recv_sessions",
}

KV_STATE = {
    "session_id", "cache", "kv_branch_names", "is_closed", "is_suspended", "num_layers",
    # the seed's session API
    "get_kv_caches", "prepare_paged_context", "commit_paged_context", "populate_cross_attention",
    "is_cross_attention_populated", "get_cross_attention_kv", "clear_cross_attention", "reset", "close",
    # batched forwards, abort, re-cache
    "prepare_forward", "abort", "prepare_recache", "recache_latents", "recache_chunk_indices",
    # what a branch holds
    "token_offset", "committed_chunks", "history_chunks", "history_chunk_indices", "pending_chunks",
    "branch_pages", "pages_in_use", "cross_attention_bytes",
    # sharing and the host tier
    "fork", "share_sinks_from", "share_cross_attention_from", "suspend", "resume",
    # LongLive 2.0's scene cuts
    "drop_window", "begin_shot",
}


def _public(obj: object) -> set[str]:
    return {name for name in dir(obj) if not name.startswith("_")}


def _diff(what: str, found: set[str], pinned: set[str]) -> str:
    return (
        f"the public surface of {what} changed: added {sorted(found - pinned)}, removed {sorted(pinned - found)}; "
        f"if intended, {HOW_TO_CHANGE}"
    )


@pytest.fixture(scope="module")
def live() -> tuple[am.KVCache, am.KVState, am.ForwardContext]:
    spec = am.KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, chunk_size=4, page_size=2, sink_chunks=1,
                          window_chunks=2, branches=("cond", "uncond"),
                          cross_attention=(am.CrossAttentionSpec("text", 3),), dtype="float32")
    cache = am.KVCache(spec, num_pages=32)
    state = cache.open_session("s0")
    fwd = state.prepare_forward(("cond",), 4, commit_current=True)
    q = torch.randn(1, 4, 2, 8)
    for layer in fwd.layers:  # a forward that ran: every lazily set attribute exists
        am.chunk_attention(q, q, q, layer)
    return cache, state, fwd


def test_all_is_pinned() -> None:
    assert len(ALL) == 53  # 50 after issue 41; + FrameWindowPolicy, PhasedPolicy, SelectedFramesPolicy (issue 42)
    assert set(am.__all__) == ALL, _diff("ardiff_modules.__all__", set(am.__all__), ALL)
    # Beyond __all__ the top level holds submodules (``am.errors``, ...), never one of the package's classes or
    # functions: a name dropped from __all__ is gone from the top level too (import it from its module).
    extra = {
        name for name in dir(am)
        if name not in ALL and not name.startswith("_")
        and str(getattr(getattr(am, name), "__module__", "")).startswith("ardiff_modules")
    }
    assert not extra, _diff("import ardiff_modules (names outside __all__)", extra, set())


def test_forward_context_is_pinned(live: tuple[am.KVCache, am.KVState, am.ForwardContext]) -> None:
    fwd = live[2]
    assert _public(fwd) == FORWARD_CONTEXT, _diff("ForwardContext", _public(fwd), FORWARD_CONTEXT)
    assert _public(am.ForwardContext) <= FORWARD_CONTEXT


def test_layer_context_is_pinned(live: tuple[am.KVCache, am.KVState, am.ForwardContext]) -> None:
    layer = live[2].layers[0]
    assert _public(layer) == LAYER_CONTEXT, _diff("LayerContext", _public(layer), LAYER_CONTEXT)


def test_kv_cache_is_pinned(live: tuple[am.KVCache, am.KVState, am.ForwardContext]) -> None:
    cache = live[0]
    assert _public(cache) == KV_CACHE, _diff("KVCache", _public(cache), KV_CACHE)


def test_kv_state_is_pinned(live: tuple[am.KVCache, am.KVState, am.ForwardContext]) -> None:
    state = live[1]
    assert _public(state) == KV_STATE, _diff("KVState", _public(state), KV_STATE)


def test_retention_groups_add_no_public_surface() -> None:
    """A cache with retention groups (``KVCacheSpec(head_retention=...)``) is a plain ``KVCache``: its cache, sessions,
    forward and layer contexts have exactly the pinned members (lanes and shares are private); the removed
    ``HeadGrouped*`` family is gone from the top level and its modules."""
    heads = am.HeadRetention({"l": (0, 1), "g": (1, 2)}, [["l", "g"], ["g", "l"]])
    spec = am.KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, chunk_size=4, page_size=2, branches=("cond",),
                          cross_attention=(am.CrossAttentionSpec("text", 3),), dtype="float32", head_retention=heads)
    cache = am.KVCache(spec, num_pages=32)
    state = cache.open_session("s0")
    fwd = state.prepare_forward(("cond",), 4, commit_current=True)
    q = torch.randn(1, 4, 2, 8)
    for layer in fwd.layers:
        am.chunk_attention(q, q, q, layer)
    for what, obj, pinned in (("KVCache", cache, KV_CACHE), ("KVState", state, KV_STATE),
                              ("ForwardContext", fwd, FORWARD_CONTEXT), ("LayerContext", fwd.layers[0], LAYER_CONTEXT),
                              ("a lane's ForwardContext", fwd._lanes[0], FORWARD_CONTEXT)):
        assert _public(obj) == pinned, _diff(f"{what} (retention groups)", _public(obj), pinned)
    fwd.commit()
    cache.close()
    gone = ("HeadGroupedKVCache", "HeadGroupedSession", "HeadGroupedForward", "HeadGroupedLayer")
    assert not [name for name in gone if hasattr(am, name)]
    for module in ("ardiff_modules.head_cache", "ardiff_modules.head_forward"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(module)


def test_the_message_names_the_change_and_the_changelog() -> None:
    text = _diff("KVCache", {"a", "pool"}, {"a", "stats"})
    assert "added ['pool']" in text and "removed ['stats']" in text and "CHANGELOG.md" in text
