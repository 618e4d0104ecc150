"""Host page ids, their refcounts and the host tier's byte budget (pure Python: no torch).

The host tier (:mod:`ardiff_modules.host`) keeps the K/V of suspended sessions in host memory, one host
page per device page it copied out. This is its bookkeeping, the host twin of
:class:`~ardiff_modules.core.allocator.PageAllocator`, with its verbs (:meth:`HostPages.allocate`,
:meth:`~HostPages.incref`, :meth:`~HostPages.decref`): ids, one reference per holder (a page that several
suspended sessions shared is copied once and referenced by each), and the bytes in use (pages plus the
extra bytes of cross-attention caches and kept latents, :meth:`~HostPages.charge`) against a budget::

    device page p (generation g)  --suspend-->  host page h      host_of[(p, g)] = h
    host page h                   --resume--->  device page q    device_of[h]    = (q, g')

The two alias maps are what keeps shared pages shared across the tiers. A device page is named by
``(page id, generation)`` -- one lifetime of that id (:meth:`PageAllocator.generation`): while that
lifetime lasts and the page is a committed page outside any contiguous extent, its bytes never change,
so a later suspend of another holder reuses ``h`` instead of copying again, and a resume whose host
page still has a live device twin takes a reference on it instead of a fresh page.
"""

from __future__ import annotations

from collections.abc import Iterable

from ardiff_modules.checks import require_int
from ardiff_modules.errors import AllocatorError, CapacityError

#: ``(device page id, allocator generation)``: one lifetime of a device page.
DeviceKey = tuple[int, int]


class HostPages:
    """Host page ids with refcounts, alias maps to device page lifetimes, and the bytes in use.

    Parameters
    ----------
    bytes_per_page:
        Bytes of one page (every layer, K and V), as on the device.
    budget_bytes:
        The most bytes the tier may use (pages plus extra bytes), or ``None`` for no bound.
    """

    def __init__(self, bytes_per_page: int, budget_bytes: int | None = None) -> None:
        require_int("HostPages.bytes_per_page", bytes_per_page, minimum=1)
        if budget_bytes is not None:
            require_int("KVCache.host_budget_bytes", budget_bytes, minimum=0)
        self.bytes_per_page = bytes_per_page
        self.budget_bytes = budget_bytes
        self._refcounts: dict[int, int] = {}
        self._next_id = 0
        #: Bytes in use besides pages (suspended sessions' cross caches and latents), see :meth:`charge`.
        self.extra_bytes = 0
        self._host_of: dict[DeviceKey, int] = {}
        self._device_of: dict[int, DeviceKey] = {}

    # ------------------------------------------------------------------ queries
    @property
    def num_pages(self) -> int:
        return len(self._refcounts)

    @property
    def nbytes(self) -> int:
        """Bytes in use now: pages and extra bytes."""
        return self.num_pages * self.bytes_per_page + self.extra_bytes

    def free_bytes(self) -> int | None:
        """Bytes left under the budget (``None``: unbounded)."""
        return None if self.budget_bytes is None else self.budget_bytes - self.nbytes

    def refcount(self, host_page: int) -> int:
        return self._refcounts.get(host_page, 0)

    def pages(self) -> tuple[int, ...]:
        return tuple(sorted(self._refcounts))

    def check_fits(self, what: str, new_pages: int, extra_bytes: int) -> None:
        """Raise :class:`CapacityError` (nothing changed) unless ``new_pages`` pages and ``extra_bytes`` fit."""
        free = self.free_bytes()
        needed = new_pages * self.bytes_per_page + extra_bytes
        if free is not None and needed > free:
            raise CapacityError(
                f"{what}: the host tier needs {needed} bytes ({new_pages} pages of {self.bytes_per_page} bytes "
                f"+ {extra_bytes} bytes of cross caches and latents), only {free} of its budget "
                f"{self.budget_bytes} bytes are free",
                needed=needed,
                free=free,
            )

    def host_copy_of(self, key: DeviceKey) -> int | None:
        """The live host page with the bytes of device page lifetime ``key``, if any."""
        return self._host_of.get(key)

    def device_copy_of(self, host_page: int) -> DeviceKey | None:
        """The device page lifetime last known to have ``host_page``'s bytes (the caller checks it still lives)."""
        return self._device_of.get(host_page)

    # ------------------------------------------------------------------ mutation
    def allocate(self, count: int) -> list[int]:
        """``count`` new host page ids, each with one reference (the caller checked the budget: :meth:`check_fits`).

        NOTE: ids are never reused (a counter, no free list): the host memory behind them is the arena's,
        whose rows are reused; a fresh id can never be mistaken for a dropped page's aliases.
        """
        require_int("HostPages.allocate", count, minimum=0)
        ids = list(range(self._next_id, self._next_id + count))
        self._next_id += count
        for host_page in ids:
            self._refcounts[host_page] = 1
        return ids

    def incref(self, host_pages: Iterable[int]) -> None:
        """One more reference per occurrence (sharing); every page must be held. Validated first."""
        host_pages = tuple(host_pages)
        for host_page in host_pages:
            if host_page not in self._refcounts:
                raise AllocatorError(f"HostPages.incref: host page {host_page} is not held; expected a held page")
        for host_page in host_pages:
            self._refcounts[host_page] += 1

    def decref(self, host_pages: Iterable[int]) -> list[int]:
        """One reference less per occurrence (validated first: nothing changes on an error); return the pages
        no longer held (their aliases forgotten)."""
        drops: dict[int, int] = {}
        for host_page in host_pages:
            drops[host_page] = drops.get(host_page, 0) + 1
        for host_page, n in drops.items():
            if n > self._refcounts.get(host_page, 0):
                raise AllocatorError(
                    f"HostPages.decref: host page {host_page} has {self.refcount(host_page)} reference(s), "
                    f"cannot drop {n}"
                )
        freed = []
        for host_page, n in drops.items():
            self._refcounts[host_page] -= n
            if not self._refcounts[host_page]:
                del self._refcounts[host_page]
                freed.append(host_page)
                key = self._device_of.pop(host_page, None)
                if key is not None and self._host_of.get(key) == host_page:
                    del self._host_of[key]
        return freed

    def link(self, host_page: int, key: DeviceKey) -> None:
        """Record that device page lifetime ``key`` and held ``host_page`` have the same bytes."""
        if host_page not in self._refcounts:
            raise AllocatorError(f"HostPages.link: host page {host_page} is not held; expected a held page")
        old = self._device_of.get(host_page)
        if old is not None and self._host_of.get(old) == host_page:
            del self._host_of[old]
        self._device_of[host_page] = key
        self._host_of[key] = host_page

    def charge(self, nbytes: int) -> None:
        """Count ``nbytes`` extra bytes (cross caches, latents) against the budget (the caller checked it)."""
        self.extra_bytes += nbytes

    def refund(self, nbytes: int) -> None:
        """Stop counting ``nbytes`` extra bytes (a suspended session left the tier)."""
        assert nbytes <= self.extra_bytes, "refunding more extra bytes than charged"
        self.extra_bytes -= nbytes

    def check_invariants(self) -> None:
        """Internal consistency: positive refcounts, alias maps inverse of each other over held pages."""
        assert all(rc >= 1 for rc in self._refcounts.values()), "a held host page has no reference"
        assert set(self._device_of) <= set(self._refcounts), "an alias names a host page not held"
        for key, host_page in self._host_of.items():
            assert self._device_of.get(host_page) == key, f"alias maps disagree on host page {host_page}"
        assert self.extra_bytes >= 0
