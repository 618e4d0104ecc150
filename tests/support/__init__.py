"""What the tests share: models the library is compared against, helpers that drive it, and fixtures' builders.

Import as ``from tests.support.<module> import ...`` (``tests/`` and its folders are packages; pytest puts the
repository root on ``sys.path``). The fixtures themselves are in ``tests/conftest.py``.

Models and oracles:

* ``streaming_model`` -- a tiny streaming DiT built from the library's modules, the cache-free oracle
  (``NaiveStreaming``), rollout schedules, and ``tiny_model_and_spec`` (the seeded model + its spec).
* ``pool_model`` -- the sink + window rule as list slicing (``expected_visible``), pool contents as the model
  says they must be, K/V that carry their ids.
* ``session_model`` + ``session_machine/`` -- the session state machine (one mixin per subject) and its model.
* ``policies`` -- user retention policies (a valid one, a misbehaving wrapper) and the contract as a predicate.
* ``rolling_buffer`` -- Self-Forcing / LongLive's rolling KV buffer in frames (sink + ``local_attn_size``, the
  current chunk counted; a 1-frame first chunk for image-to-video) and as a contiguous tensor buffer.
* ``training_peers`` -- the reference Wan model over the library, over a cache-free recomputation and over
  Self-Forcing's rolling contiguous buffer, with autograd (one interface; stand-in layer contexts).
* ``wan_rope`` -- Wan2.1's RoPE written independently; ``diffusers_wan`` -- a tiny stock diffusers Wan (needs the
  ``diffusers`` extra).

Helpers:

* ``small_cache`` -- a small float32 cache (``SMALL_SPEC``) and the helpers that drive it through the public API
  (q/k/v, committing forwards, bit copies of the pool, bookkeeping snapshots).
* ``two_sessions`` -- the misuse tests' two sessions with history (``build``) and their snapshot.
* ``recache_rig`` -- sessions driven through the library and the oracle in lock step, for the re-cache tests.
* ``kv_writes`` -- run every layer of a forward once (a commit needs every layer's write).
* ``failures`` -- injected exceptions and a reference backend whose ``plan()`` fails on demand.
* ``gpu`` -- the GPU tests' marks, specs, bf16 model, inputs and tolerances.
* ``distributed_workers`` -- the multi-process tests' rank functions (spawned ranks import this module).
* ``paths`` -- the repository's README, docs, examples, benchmarks and package.
"""
