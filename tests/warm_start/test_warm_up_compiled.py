"""After ``warm_up`` a compiled model (``am.CompiledStep``) compiles nothing new over a real generation.

The generation: a 2-token first chunk then 4-token chunks, through the window's eviction, each chunk two
denoising forwards and a committing one, one session alone and two sessions batched. With ``dynamic=False``
every input shape is a graph of its own (stream counts 2 and 4, chunk lengths 2 and 4): without the warm-up
the first session's first chunks compile them (the stall a server's first user would see), with it nothing
compiles. Backend ``"eager"``: dynamo traces and guards as under inductor (what decides a recompile) without
inductor's code generation, so the test stays fast.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import ardiff_modules as am
from tests.support.warm_rig import generate, model_and_spec, populate

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_dynamo")]

LENGTHS = [2] + [4] * 5  # sink 1 + window 2: the window is full and evicting from the 4th chunk on


def _run_forward(step: am.CompiledStep) -> Callable[[am.ForwardContext], None]:
    def run(fwd: am.ForwardContext) -> None:
        step(torch.zeros(fwd.num_streams, fwd.seq_len, 32), fwd.layers)

    return run


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_a_real_generation_compiles_nothing_after_warm_up(warm: bool) -> None:
    model, spec = model_and_spec(chunk=4, page=2, sink=1, window=2)
    cache = am.KVCache(spec, num_pages=128, backend="reference")
    step = am.CompiledStep(model, backend="eager", dynamic=False, warn_recompiles=False)
    if warm:
        with torch.no_grad():
            report = am.warm_up(cache, _run_forward(step), setup_session=lambda s: populate(model, s), sessions=2,
                                chunk_lengths=(2, 4))
        assert report.forwards == 2 * 4 * 2
    before = step.frame_count
    users = [cache.open_session(sid) for sid in ("alice", "bob", "carol")]
    for i, state in enumerate(users):
        populate(model, state, seed=i)
    outs = generate(cache, step, users[:1], LENGTHS, seed=1)  # one session, through eviction
    outs += generate(cache, step, users[1:], LENGTHS, seed=2)  # two sessions batched
    assert users[0].committed_chunks("cond") == len(LENGTHS) > spec.sink_chunks + spec.window_chunks + 1
    new = step.frame_count - before
    if warm:
        assert new == 0, f"the generation compiled {new} new graph(s) after the warm-up"
        assert before == 4  # the warm-up compiled them: (2 or 4 streams) x (2 or 4 tokens)
    else:
        assert new == 4, "without a warm-up the generation compiles its 4 shapes (what the warm-up is for)"
    assert all(torch.isfinite(o).all() for o in outs)
