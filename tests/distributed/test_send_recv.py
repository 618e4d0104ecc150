"""``KVCache.send_sessions`` / ``recv_sessions`` (issue 45 item 2) between two gloo ranks on the CPU."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.distributed.test_multi_process import _spawn
from tests.support import transport_workers

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)


def test_two_ranks_hand_a_fork_family_over_or_keep_it_on_a_refusal() -> None:
    """Refusals on either side (ids, pending work, room) leave the family with the sender, unchanged; the
    handover closes it there and it continues on the receiver bit-identically to a twin, its pages shared."""
    _spawn(2, transport_workers.check_send_recv)


@pytest.mark.parametrize("kind", ["uniform", "per-head", "per-layer", "one-group"])
def test_two_ranks_hand_over_a_grouped_family_or_keep_it_in_every_lane(kind: str) -> None:
    """With retention groups: a receiver of another retention map or without room in one lane refuses before any
    tensor moves (the family stays, every lane unchanged); the handover brings every lane's pages, shared."""
    _spawn(2, transport_workers.check_send_recv_lanes, kind)
