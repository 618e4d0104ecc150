"""Ranks of ``tests/distributed/test_send_recv_ipc_lanes.py``: the CUDA IPC protocol with its CUDA steps faked
(:func:`~tests.support.ipc_workers.fake_ipc`) moving caches that are more than one uniform pool: retention groups
(a pages and a scales tensor per lane), FP8 pages with their scales, content-selected lanes with a live selection.
Rank 0 sends, rank 1 receives.

Each case: a receive refused after the mapping leaves both sides as they were; then the handover by "IPC" (no
tensor over the group) brings the sender's pool contents (:func:`contents`) and continues bit-identically to a twin
that never left.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

import ardiff_modules as am
from ardiff_modules.host import files
from tests.support import small_lanes as lanes
from tests.support.ipc_workers import _expect, _recv_without_wire, _shared_folder, fake_ipc
from tests.support.transport_workers import _family, step


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


def contents(cache: am.KVCache, state: am.KVState) -> list[dict[str, Any]]:
    """Per lane: its pool's scales (an FP8 pool's calibrated ones), and per branch of ``state`` the K/V bytes of its
    history pages in history order (a selection's pages included), each chunk's index, start and tokens, and its
    content selection (everything but the page ids): what a receiver's pool must hold for the session, page ids
    aside."""
    out = []
    for lane in cache._lanes:
        held: dict[str, Any] = {"scales": _bytes(lane.pool.scales)}
        for b in state.kv_branch_names:
            pages = state._lane_pages(b)[lane.index]
            selection = pages.selection
            held[b] = (
                _bytes(lane.pool.kv[:, :, pages.history_pages()]),
                [(p.history_index, p.history_start, p.committed_tokens) for p in state._lane_pages(b)],
                None if selection is None else selection.host()._replace(pages=len(selection.pages)),
            )
        out.append(held)
    return out


@contextmanager
def copy_fails_into(pool: Any) -> Iterator[None]:
    """``files._copy_pages`` raising for ``pool`` only (the lanes before it copy from the mapped tensors first)."""
    real = files._copy_pages

    def copy(into: Any, pages: torch.Tensor, copies: Any) -> None:
        if into is pool:
            raise RuntimeError("injected")
        real(into, pages, copies)

    files._copy_pages = copy  # type: ignore[assignment]
    try:
        yield
    finally:
        files._copy_pages = real  # type: ignore[assignment]


def _send_refused_then_handed_over(cache: am.KVCache, sessions: list[am.KVState], refusal: str, calls: dict) -> None:
    """Rank 0: the receiver's contents to compare with, a send refused after the mapping (``refusal``: the error it
    names) that changes nothing here (every lane's bookkeeping and bytes, the scales, the selections), then the
    handover by IPC."""
    dist.broadcast_object_list([[contents(cache, s) for s in sessions]], src=0)
    before, held = lanes.everything(cache), [contents(cache, s) for s in sessions]
    _expect(am.SessionTransferError, f"refusal: {refusal}", lambda: cache.send_sessions(sessions, 1, transport="ipc"))
    lanes.assert_unchanged(cache, before)
    assert [contents(cache, s) for s in sessions] == held and calls["shared"] == 1
    dist.barrier()
    assert cache.send_sessions(sessions, 1, transport="ipc") == "ipc" and calls["shared"] == 2
    assert all(s.is_closed for s in sessions) and all(lane.allocator.num_used == 0 for lane in cache._lanes)


def _sent() -> list[Any]:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_ipc_lanes(kind: str, fields: dict[str, Any]) -> None:
    """A fork family of a cache ``kind`` of :mod:`~tests.support.small_lanes` (``fields``: spec fields, e.g. FP8).
    Refused after the mapping by a receiver holding a session of its own -- its last lane's copy failing after the
    earlier lanes copied; with FP8, its pool quantized with other scales -- every lane of both sides unchanged;
    then handed over into a cache without one (FP8: scales adopted), every lane's pages, scales and chunks the
    sender's, continuing bit-identically to a twin."""
    rank = dist.get_rank()
    fp8 = fields.get("kv_dtype") == "float8_e4m3fn"
    calls = fake_ipc(_shared_folder())
    cache = lanes.make_cache(kind, fields=fields, num_pages=48)
    if rank == 0:
        refusal = "SessionFileError" if fp8 else "RuntimeError: injected"
        _send_refused_then_handed_over(cache, list(_family(cache)), refusal, calls)
        return
    sent = _sent()
    other = cache.open_session("other")  # its own K/V (with FP8: its pool's scales calibrated from them)
    step(other, 3, latents=True)
    before, held = lanes.everything(cache), contents(cache, other)
    if fp8:
        _expect(am.SessionFileError, "expected the FP8 scales", lambda: cache.recv_sessions(0, transport="ipc"))
    else:
        with copy_fails_into(cache._lanes[-1].pool):
            _expect(RuntimeError, "injected", lambda: cache.recv_sessions(0, transport="ipc"))
    lanes.assert_unchanged(cache, before, free_bytes=False)
    assert contents(cache, other) == held and calls["mapped"] == 1
    dist.barrier()
    twin_cache, into = lanes.make_cache(kind, fields=fields), lanes.make_cache(kind, fields=fields, num_pages=48)
    twins = _family(twin_cache)
    family = _recv_without_wire(into)
    assert calls["mapped"] == 2 and [contents(into, s) for s in family] == sent
    assert [lane.allocator.num_used for lane in into._lanes] == [lane.allocator.num_used for lane in twin_cache._lanes]
    for seed in range(10, 13):
        for mine, twin in zip(family, twins):
            out, ref = step(mine, seed, latents=True), step(twin, seed, latents=True)
            assert all(torch.equal(x, y) for x, y in zip(out, ref))
    lanes.assert_clean(into)


def check_ipc_selection() -> None:
    """A parent and its fork after a scoring commit (the selection's pages shared): refused after the mapping (a
    temporal lane's copy failing), nothing changed on either side; then handed over by IPC, every lane's pages and
    each selection (start, commit, offsets, bytes) the sender's, the selection pages shared again, and the family
    continuing bit-identically to the twin family (and the parent equal to the re-statement)."""
    from tests.host.test_selection_host import Twins, described
    from tests.integrations.test_forcing_kv_selected import _temporal_lanes
    from tests.support.selection_transport import BLOCKS, check_received_family

    calls = fake_ipc(_shared_folder())
    rollout = Twins(pages=160)
    rollout.advance(BLOCKS, check=False)
    child, twin_child = rollout.session.fork("child"), rollout.twin.fork("child")
    family = [rollout.session, child]
    temporal = [lane.index for lane in _temporal_lanes(rollout.cache)]
    assert all(described(rollout.cache, child)[i]["cond"] is not None for i in temporal)  # live selections
    if dist.get_rank() == 0:
        _send_refused_then_handed_over(rollout.cache, family, "RuntimeError: injected", calls)
        return
    sent = _sent()
    cache = rollout.make()
    with copy_fails_into(_temporal_lanes(cache)[-1].pool):
        _expect(RuntimeError, "injected", lambda: cache.recv_sessions(0, transport="ipc"))
    assert cache.sessions == {} and all(lane.allocator.num_used == 0 for lane in cache._lanes)
    dist.barrier()
    parent, received_child = _recv_without_wire(cache)
    assert calls["mapped"] == 2 and [contents(cache, s) for s in (parent, received_child)] == sent
    check_received_family(rollout, cache, parent, received_child, twin_child)
