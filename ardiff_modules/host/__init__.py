"""The host tier: suspended sessions' K/V in host memory (one GPU's cache; see ``KVCache.tiers()``).

- :mod:`~ardiff_modules.host.tier`: :class:`HostTier` -- suspend / resume a session (every lane of the cache or
  none), :class:`TierReport`;
- :mod:`~ardiff_modules.host.lane_store`: :class:`~ardiff_modules.host.lane_store.LaneStore`, one lane's host
  pages (ids, arena rows, the copies to and from its device pool), and the one host budget over the lanes;
- :mod:`~ardiff_modules.host.make_room`: which idle sessions to suspend (LRU) so one more fits in every lane;
- :mod:`~ardiff_modules.host.transfer`: :class:`TransferHandle`, a resume's host-to-device copies;
- :mod:`~ardiff_modules.host.arena`: :class:`HostArena`, pinned page rows allocated once and reused;
- :mod:`~ardiff_modules.host.extent_room`: what the free page runs hold in contiguous extents, for admission;
- :mod:`~ardiff_modules.host.files`: sessions saved to / loaded from safetensors files (``KVCache.save_sessions``),
  its header in :mod:`~ardiff_modules.host.file_header`;
- :mod:`~ardiff_modules.host.transport`: sessions sent between processes (``KVCache.send_sessions``).

Its torch-free bookkeeping sits in the core: :class:`~ardiff_modules.core.host_pages.HostPages` (host page
ids and refcounts, the allocator's verbs) and
:class:`~ardiff_modules.core.reservation.ResumeReservation` (a resume's fresh device pages, kept or rolled
back like a forward's reservation).
"""

from ardiff_modules.host.tier import HostTier, TierReport
from ardiff_modules.host.transfer import TransferHandle

__all__ = ["HostTier", "TierReport", "TransferHandle"]
