"""``TransferHandle``: a resume's host-to-device copies, in flight on a CUDA side stream or complete (CPU).

A resume returns before its copies finish; the handle records one CUDA event after them. The session's next
``prepare_forward`` makes the current stream wait on it (:meth:`TransferHandle.order_current_stream`, no host
sync); :meth:`TransferHandle.wait` is for reading the resumed tensors some other way.
"""

from __future__ import annotations

import torch


class TransferHandle:
    """A resume's host-to-device copies: :meth:`ready` polls, :meth:`wait` blocks the host until done.

    The session's next ``prepare_forward`` orders the current CUDA stream after the copies by itself;
    ``wait()`` is for reading the resumed tensors some other way (e.g. ``get_cross_attention_kv``).
    """

    def __init__(self, event: torch.cuda.Event | None = None, keep: tuple[object, ...] = ()) -> None:
        self._event = event
        self._keep = keep  # NOTE: the pinned sources must outlive the asynchronous copies that read them

    def ready(self) -> bool:
        """Whether the copies finished (never blocks)."""
        return self._event is None or bool(self._event.query())

    def wait(self) -> None:
        """Block the host until the copies finished (then the pinned sources may go)."""
        if self._event is not None:
            self._event.synchronize()
        self._keep = ()

    def order_current_stream(self) -> None:
        """Make the current CUDA stream wait for the copies (no host sync); a no-op on CPU."""
        if self._event is not None:
            torch.cuda.current_stream(self._event.device).wait_event(self._event)
