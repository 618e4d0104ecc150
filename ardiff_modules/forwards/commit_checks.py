"""The device-side pre-commit check: no NaN/Inf in a committing forward's pending K/V (``check_finite``)."""

from __future__ import annotations

import torch

from ardiff_modules.core.transaction import ForwardTransaction
from ardiff_modules.errors import NonFiniteKVError
from ardiff_modules.pool import KVPool


def check_pending_finite(transaction: ForwardTransaction, pool: KVPool, lane: int = 0) -> None:
    """Read every live stream's pending pages (``[2, layers, pages, page_size, kv_heads, head_dim]`` of the
    pool); on NaN/Inf abort the **whole** forward and raise :class:`NonFiniteKVError` naming the streams.

    One device sync (per lane: ``pool`` is lane ``lane``'s). FP8 pools: NaN and Inf are both stored as NaN
    (``quantize``), so both are detected.
    """
    live = transaction.live_branches(lane)
    owners = [
        (getattr(state, "session_id"), branch, page)
        for (state, branch), b in zip(transaction.members, transaction.lanes[lane].branches)
        if b in live
        for page in b.pending_pages()
    ]
    if not owners:
        return
    pages = torch.tensor([page for _, _, page in owners], dtype=torch.int64, device=pool.device)
    written = pool.kv.index_select(2, pages)
    if pool.quantizer is not None:  # no isfinite for FP8; its NaN survives the cast to float
        written = written.float()
    finite = torch.isfinite(written).transpose(0, 2).reshape(len(owners), -1)
    ok = finite.all(dim=1).tolist()  # the one sync
    bad = sorted({(sid, branch) for (sid, branch, _), fine in zip(owners, ok) if not fine})
    if bad:
        transaction.abort("non-finite K/V")
        raise NonFiniteKVError(
            f"check_finite: expected finite K/V in the pending chunks of a committing forward, got NaN/Inf "
            f"in stream(s) {bad}; the forward was aborted and history is unchanged"
        )
