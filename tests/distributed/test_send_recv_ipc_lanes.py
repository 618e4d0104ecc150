"""``send_sessions`` / ``recv_sessions`` by CUDA IPC with caches of more than one uniform pool: retention groups,
FP8 pages with scales, content-selected lanes -- two gloo ranks on the CPU, the CUDA steps faked
(``tests/support/ipc_workers.py``), as in ``test_send_recv_ipc.py``. Each moves every lane's pages (and scales)
through the IPC path, a receive refused after the mapping changes neither side, and the received sessions hold the
sender's pool contents and continue bit-identically to twins that never left.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.distributed.test_multi_process import _spawn
from tests.support import ipc_lane_workers

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)
FP8 = {"kv_dtype": "float8_e4m3fn"}


@pytest.mark.parametrize(
    ("kind", "fields"), [("per-head", {}), ("per-frame", {}), ("uniform", FP8), ("per-layer", FP8)],
    ids=["per-head", "per-frame", "fp8", "per-layer-fp8"],
)
def test_a_grouped_or_fp8_family_moves_by_ipc_or_stays_on_a_refusal(kind: str, fields: dict) -> None:
    """Retention groups (three chunk-window lanes of two page sizes; two frame-window lanes) and FP8 pools (one,
    and one per lane): a receive refused after the mapping (a later lane's copy failing, or -- FP8 -- a pool
    quantized with other scales) leaves every lane of both sides unchanged; the handover brings every lane's pages,
    chunks and scales and continues bit-identically."""
    _spawn(2, ipc_lane_workers.check_ipc_lanes, kind, fields)


def test_a_live_content_selection_moves_by_ipc_or_stays_on_a_refusal() -> None:
    """A parent and its fork after a scoring commit: a refused receive changes nothing; the handover brings each
    selection and its pages (shared again) and the family continues bit-identically (and equal to the
    re-statement)."""
    _spawn(2, ipc_lane_workers.check_ipc_selection)
