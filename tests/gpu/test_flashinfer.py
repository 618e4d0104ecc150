"""FlashInfer backend on the GPU: equal to the reference oracle, masked == structural, compile, CUDA graphs.

Run on the GPU machine: ``bash .gpu/run.sh python3 -m pytest -m gpu -q``. Skipped without CUDA/FlashInfer.
"""

from __future__ import annotations

import pytest
import torch

import ardiff_modules as am
from ardiff_modules.graphs import CUDAGraphStep
from tests.support.gpu import DTYPE, GPU, HEAD_DIM, assert_close_bf16, assert_close_model, gpu_model_and_spec, gpu_spec

pytestmark = list(GPU)


def _pair(spec: am.KVCacheSpec, pages: int, extents: bool | None = None) -> tuple[am.KVCache, am.KVCache]:
    return (
        am.KVCache(spec, num_pages=pages, device="cuda", backend="reference"),
        am.KVCache(spec, num_pages=pages, device="cuda", backend="flashinfer", contiguous_extents=extents),
    )


def _attend(fwd: am.ForwardContext, q, k, v) -> list[torch.Tensor]:  # noqa: ANN001
    return [am.chunk_attention(q, k, v, layer) for layer in fwd.layers]


@pytest.mark.parametrize("extents", [True, False], ids=["extents", "paged"])
@pytest.mark.parametrize("page", [8, 120, 240])
@pytest.mark.parametrize("sink,window", [(1, 2), (0, 3), (2, 1)])
def test_flashinfer_equals_reference_over_rollout(page: int, sink: int, window: int, extents: bool) -> None:
    """Pending chunk counts 1..4, windows filling then evicting, 2 branches, 2 sessions batched in one launch.

    With contiguous extents, one-chunk forwards run ragged FA3 (gap rows while windows fill and
    between sessions), multi-chunk forwards paged FA3; without, every forward is paged.
    """
    chunk = 240
    spec = gpu_spec(chunk, page, sink, window)
    ref_cache, fi_cache = _pair(spec, pages=4 * (sink + window + 5) * spec.pages_per_chunk, extents=extents)
    modes = set()
    ref_states = [ref_cache.open_session(f"s{i}") for i in range(2)]
    fi_states = [fi_cache.open_session(f"s{i}") for i in range(2)]
    g = torch.Generator(device="cuda").manual_seed(0)
    for step, n in enumerate([1, 2, 1, 3, 1, 4, 1, 1, 2]):
        streams = 4 if step % 2 == 0 else 2  # 2 sessions x 2 branches, or one session's CFG pair
        for commit in (False, True):
            shape = (streams, n * chunk)
            q = torch.randn(*shape, 4, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
            k = torch.randn(*shape, 2, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
            v = torch.randn(*shape, 2, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
            outs = []
            for cache, states in ((ref_cache, ref_states), (fi_cache, fi_states)):
                pairs = [(s, b) for s in states[: streams // 2] for b in ("cond", "uncond")]
                with cache.prepare_forward(pairs, n * chunk, commit_current=commit) as fwd:
                    outs.append(_attend(fwd, q, k, v))
                    if cache is fi_cache:
                        modes.add(fwd._plan.mode)
            for a, b in zip(*outs):
                assert_close_bf16(b, a)
    assert fi_states[0].committed_chunks("cond") == 16
    # Without extents, plain allocation can still happen to give contiguous pages (then ragged runs too).
    assert modes == {"ragged", "paged"} if extents else "paged" in modes


def test_masked_path_equals_structural_and_reference() -> None:
    chunk, page = 240, 8
    spec = gpu_spec(chunk, page, 1, 2)
    ref_cache, fi_cache = _pair(spec, pages=64 * spec.pages_per_chunk)
    fi_masked = am.KVCache(spec, num_pages=64 * spec.pages_per_chunk, device="cuda", backend="flashinfer")
    caches = (ref_cache, fi_cache, fi_masked)
    states = [c.open_session() for c in caches]
    g = torch.Generator(device="cuda").manual_seed(1)
    for step, n in enumerate([1, 1, 2, 1, 3, 1]):
        q = torch.randn(2, n * chunk, 4, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
        k = torch.randn(2, n * chunk, 2, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
        v = torch.randn_like(k)
        def keys() -> int:
            return max(len(states[0].history_chunks(b)) for b in ("cond", "uncond")) * chunk + n * chunk

        all_true = torch.ones(2, n * chunk, keys(), dtype=torch.bool, device="cuda")
        outs = {}
        for name, cache, state, mask in (
            ("ref", ref_cache, states[0], None),
            ("fa3", fi_cache, states[1], None),
            ("fa2-all-true", fi_masked, states[2], all_true),
        ):
            with cache.prepare_forward([(state, "cond"), (state, "uncond")], n * chunk, True, token_mask=mask) as f:
                outs[name] = _attend(f, q, k, v)[0]
        assert_close_bf16(outs["fa3"], outs["ref"])
        assert_close_bf16(outs["fa2-all-true"], outs["fa3"])
        # A non-structural mask: FA2 masked equals the reference with the same mask (no commit).
        random_mask = torch.rand(2, n * chunk, keys(), device="cuda", generator=g) > 0.3
        masked = []
        for cache, state in ((ref_cache, states[0]), (fi_masked, states[2])):
            fwd = cache.prepare_forward([(state, "cond"), (state, "uncond")], n * chunk, False, token_mask=random_mask)
            masked.append(_attend(fwd, q, k, v)[0])
            state.abort()
        assert_close_bf16(masked[1], masked[0])


def _run_rollout(model, spec, step_fn, *, static: bool, chunks: int = 8, seed: int = 0):  # noqa: ANN001, ANN202
    cache = am.KVCache(spec, num_pages=64, device="cuda", backend="flashinfer")
    state = cache.open_session()
    g = torch.Generator(device="cuda").manual_seed(seed)
    outs = []
    for chunk in range(chunks):
        if chunk in (0, 5):  # prompt switch at chunk 5
            state.clear_cross_attention()
            for b in spec.branches:
                text = torch.randn(16, 64, device="cuda", dtype=DTYPE, generator=g)
                am.populate_cross_attention(state, b, [blk.cross for blk in model.blocks], text)
        for commit in (False, False, True):
            x = torch.randn(2, spec.chunk_size, 512, device="cuda", dtype=DTYPE, generator=g)
            with torch.no_grad(), state.prepare_forward(None, spec.chunk_size, commit, static=static) as fwd:
                outs.append(step_fn(fwd, x))
    return outs


def test_compiled_fullgraph_and_cuda_graph_equal_eager_across_eviction() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    model, spec = gpu_model_and_spec()
    eager = _run_rollout(model, spec, lambda fwd, x: model(x, fwd.layers), static=False)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    comp = _run_rollout(model, spec, lambda fwd, x: compiled(x, fwd.layers), static=False)
    assert counter.frame_count == 1
    graph_step = CUDAGraphStep(model)
    graphed = _run_rollout(model, spec, lambda fwd, x: graph_step(fwd, x), static=True)
    assert graph_step.num_graphs == 1
    for i, (e, c, gr) in enumerate(zip(eager, comp, graphed)):
        rel_c = ((c.float() - e.float()).norm() / e.float().norm()).item()
        rel_g = ((gr.float() - e.float()).norm() / e.float().norm()).item()
        print(f"forward {i}: compiled rel err {rel_c:.2e}, cuda-graph rel err {rel_g:.2e}")
    for e, c, gr in zip(eager, comp, graphed):
        assert_close_model(c, e)
        assert_close_model(gr, e)


def test_custom_scale_and_head_mismatch_error() -> None:
    spec = gpu_spec(240, 120, 0, 2)
    ref_cache, fi_cache = _pair(spec, pages=32)
    q = torch.randn(1, 240, 4, HEAD_DIM, device="cuda", dtype=DTYPE)
    k = torch.randn(1, 240, 2, HEAD_DIM, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    outs = []
    for cache in (ref_cache, fi_cache):
        state = cache.open_session()
        fwd = state.prepare_forward(("cond",), 240)
        outs.append(am.chunk_attention(q, k, v, fwd.layers[0], scale=0.05))
    assert_close_bf16(outs[1], outs[0])
    with pytest.raises(am.TensorMismatchError, match="num_qo_heads=4"):
        am.chunk_attention(torch.randn(1, 240, 2, HEAD_DIM, device="cuda", dtype=DTYPE), k, v, fwd.layers[0])


def test_backend_selection() -> None:
    spec = gpu_spec(240, 120, 0, 2)
    assert am.KVCache(spec, num_pages=8, device="cuda").backend.name == "flashinfer"
    fp32 = am.KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=HEAD_DIM, chunk_size=8, page_size=8, dtype="float32")
    assert am.KVCache(fp32, num_pages=8, device="cuda").backend.name == "reference"
    with pytest.raises(am.BackendUnavailableError, match="dtype"):
        am.KVCache(fp32, num_pages=8, device="cuda", backend="flashinfer")


@pytest.mark.parametrize("extents", [False, True], ids=["paged", "extents"])
def test_paged_plan_skipped_when_row_lengths_repeat(extents: bool) -> None:
    """Steady state (windows full, evicting): page ids move every forward, row lengths do not.

    Two-chunk forwards: always the paged kernel (one-chunk forwards may find their pages
    consecutive and run ragged). The CUDA-graph test covers the static one-chunk paged plan.

    The paged plan is then made once and its page table refreshed in place; outputs must still
    equal the reference at every forward (a stale page table would attend evicted pages).
    """
    chunk, page = 240, 120
    spec = gpu_spec(chunk, page, 1, 2)
    ref_cache, fi_cache = _pair(spec, pages=4 * 8 * spec.pages_per_chunk, extents=extents)
    states = [c.open_session() for c in (ref_cache, fi_cache)]
    g = torch.Generator(device="cuda").manual_seed(3)
    seq = 2 * chunk
    plans = []
    for step in range(10):
        for commit in (False, False, True):
            q = torch.randn(2, seq, 4, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
            k = torch.randn(2, seq, 2, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
            v = torch.randn_like(k)
            outs = []
            for cache, state in zip((ref_cache, fi_cache), states):
                with state.prepare_forward(None, seq, commit_current=commit) as fwd:
                    outs.append(_attend(fwd, q, k, v))
                    if cache is fi_cache:
                        assert fwd._plan.mode == "paged"
                        plans.append(fwd._plan)
            for a, b in zip(*outs):
                assert_close_bf16(b, a)
    plan = plans[-1]
    assert all(p is plan for p in plans[-12:])  # one plan object re-planned in place
    # Windows fill within the first forwards; after that only page ids change.
    assert plan.kernel_plans < len(plans) // 2, (plan.kernel_plans, len(plans))


def test_sessions_batched_in_one_launch_equal_each_session_alone() -> None:
    """Three sessions at different window positions (filling, full, evicting) as rows of one FlashInfer
    plan equal the same sessions run one at a time on FlashInfer (ragged one-chunk and paged two-chunk)."""
    chunk, page = 240, 120
    spec = gpu_spec(chunk, page, 1, 2)
    batched_cache, alone_cache = (
        am.KVCache(spec, num_pages=3 * 16 * spec.pages_per_chunk, device="cuda", backend="flashinfer")
        for _ in range(2)
    )
    names = ("s0", "s1", "s2")
    batched = [batched_cache.open_session(n) for n in names]
    alone = [alone_cache.open_session(n) for n in names]
    g = torch.Generator(device="cuda").manual_seed(5)

    def qkv(streams: int, seq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = torch.randn(streams, seq, 4, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
        k = torch.randn(streams, seq, 2, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
        return q, k, torch.randn_like(k)

    for i in range(3):  # session i commits i + 1 chunks first: windows filling, full, evicting
        for _ in range(i + 1):
            q, k, v = qkv(2, chunk)
            for state in (batched[i], alone[i]):
                with state.prepare_forward(None, chunk, commit_current=True) as fwd:
                    _attend(fwd, q, k, v)
    modes = set()
    for n, commit in ((1, False), (1, True), (2, False), (2, True), (1, True)):
        q, k, v = qkv(6, n * chunk)
        pairs = [(s, b) for s in batched for b in ("cond", "uncond")]
        with batched_cache.prepare_forward(pairs, n * chunk, commit_current=commit) as fwd:
            together = _attend(fwd, q, k, v)
            modes.add(fwd._plan.mode)
        for i, state in enumerate(alone):
            rows = slice(2 * i, 2 * i + 2)
            with state.prepare_forward(None, n * chunk, commit_current=commit) as fwd:
                single = _attend(fwd, q[rows], k[rows], v[rows])
            for a, b in zip(together, single):
                assert_close_bf16(a[rows], b)
    assert modes == {"ragged", "paged"}


def test_flashinfer_reads_the_page_table_it_was_planned_with() -> None:
    """The FlashInfer coupling the paged plan-skip relies on (``reads_page_table``), checked directly.

    (a) the wrapper keeps reading the very page-table tensor given to ``plan()`` (eager) or its
    static buffer (CUDA graphs); (b) its schedule depends on the indptrs only: refreshing the page
    ids in place and running without ``plan()`` equals a fresh plan over the new ids. Fails if a
    FlashInfer upgrade copies the table or schedules from page ids -- then drop that version from
    ``PLAN_SKIP_VERSIONS``.
    """
    import flashinfer

    from ardiff_modules.backends.flashinfer import PLAN_SKIP_VERSIONS, reads_page_table

    assert flashinfer.__version__ in PLAN_SKIP_VERSIONS, flashinfer.__version__
    pages, page, heads = 64, 16, 4
    g = torch.Generator(device="cuda").manual_seed(7)
    k_cache = torch.randn(pages, page, 2, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(2 * 32, heads, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
    qo = torch.tensor([0, 32, 64], dtype=torch.int32)
    kv_indptr = torch.tensor([0, 5, 12], dtype=torch.int32)
    last = torch.full((2,), page, dtype=torch.int32)
    ids_a = torch.randperm(pages, generator=torch.Generator().manual_seed(1))[:12].to(torch.int32)
    ids_b = torch.randperm(pages, generator=torch.Generator().manual_seed(2))[:12].to(torch.int32)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")

    def planned(ids: torch.Tensor, static: bool):  # noqa: ANN202
        bufs = {}
        if static:
            bufs = dict(
                qo_indptr_buf=torch.zeros(3, dtype=torch.int32, device="cuda"),
                paged_kv_indptr_buf=torch.zeros(3, dtype=torch.int32, device="cuda"),
                paged_kv_indices_buf=torch.zeros(16, dtype=torch.int32, device="cuda"),
                paged_kv_last_page_len_buf=torch.zeros(2, dtype=torch.int32, device="cuda"),
            )
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=static, **bufs)
        dev_ids = ids.cuda()
        w.plan(qo, kv_indptr, dev_ids, last, heads, 2, HEAD_DIM, page, causal=False, q_data_type=DTYPE,
               kv_data_type=DTYPE)
        table = bufs["paged_kv_indices_buf"] if static else dev_ids
        return w, table

    for static in (False, True):
        wrapper, table = planned(ids_a, static)
        assert reads_page_table(wrapper, table), "the wrapper no longer reads the planned page table"
        table[: ids_b.numel()].copy_(ids_b.cuda())  # refresh in place, no plan()
        refreshed = wrapper.run(q, (k_cache, v_cache))
        fresh_wrapper, _ = planned(ids_b, static)
        torch.testing.assert_close(refreshed, fresh_wrapper.run(q, (k_cache, v_cache)), atol=0, rtol=0)


@pytest.mark.parametrize("extents", [True, False], ids=["extents", "paged"])
def test_variable_chunk_lengths_equal_reference(extents: bool) -> None:
    """Chunks of different token counts in one branch (a short image-to-video first chunk, mixed
    multi-chunk forwards), two sessions batched: FlashInfer (ragged where the keys are one range,
    paged otherwise) equals the reference backend."""
    chunk, page = 720, 120
    spec = gpu_spec(chunk, page, 1, 2)
    ref_cache, fi_cache = _pair(spec, pages=4 * 10 * spec.pages_per_chunk, extents=extents)
    ref_states = [ref_cache.open_session(f"s{i}") for i in range(2)]
    fi_states = [fi_cache.open_session(f"s{i}") for i in range(2)]
    g = torch.Generator(device="cuda").manual_seed(11)
    modes = set()
    for lengths in [(240,), (720,), (720, 240), (240, 720), (720,), (480,), (720, 720), (720,), (360,)]:
        seq = sum(lengths)
        for commit in (False, True):
            q = torch.randn(4, seq, 4, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
            k = torch.randn(4, seq, 2, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
            v = torch.randn_like(k)
            outs = []
            for cache, states in ((ref_cache, ref_states), (fi_cache, fi_states)):
                pairs = [(s, b) for s in states for b in ("cond", "uncond")]
                with cache.prepare_forward(pairs, seq, commit_current=commit, chunk_lengths=lengths) as fwd:
                    outs.append(_attend(fwd, q, k, v))
                    if cache is fi_cache:
                        modes.add(fwd._plan.mode)
            for a, b in zip(*outs):
                assert_close_bf16(b, a)
    assert fi_states[0].token_offset("cond") == ref_states[0].token_offset("cond") == 240 + 720 + 960 + 960 + 720 + 480 + 1440 + 720 + 360
    assert "paged" in modes
