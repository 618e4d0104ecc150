"""One KV branch's pages: resident committed chunks and pending chunks (pure Python).

A chunk is a tuple of page ids (``pages_per_chunk`` of them). The branch holds
one reference on every page it lists; all page bookkeeping goes through the
:class:`~ardiff_modules.allocator.PageAllocator`, eviction arithmetic through
the :class:`~ardiff_modules.window.SinkWindowPolicy`::

    sinks (never evicted) | window (last W committed) | pending (being denoised)
          written once          committed = immutable      overwritten by every
                                                           denoising forward

Committed pages are immutable, which is what makes sharing them by refcount
(forks) safe. Methods validate first and mutate last, so a raised exception
leaves the branch and the allocator unchanged.
"""

from __future__ import annotations

from ardiff_modules.allocator import PageAllocator
from ardiff_modules.window import SinkWindowPolicy

PageChunk = tuple[int, ...]


class BranchHistory:
    """Resident committed chunks, pending chunks and the absolute token offset of one branch."""

    def __init__(self, policy: SinkWindowPolicy, pages_per_chunk: int, chunk_size: int) -> None:
        self.policy = policy
        self.pages_per_chunk = pages_per_chunk
        self.chunk_size = chunk_size
        self.sinks: tuple[PageChunk, ...] = ()
        self.window: tuple[PageChunk, ...] = ()
        self.pending: tuple[PageChunk, ...] = ()
        #: Chunks ever committed (evicted ones included): drives absolute positions.
        self.committed_chunks = 0

    # ------------------------------------------------------------------ queries
    @property
    def token_offset(self) -> int:
        """Absolute position of the first pending token (tokens ever committed)."""
        return self.committed_chunks * self.chunk_size

    @property
    def resident_chunks(self) -> tuple[PageChunk, ...]:
        """Visible committed chunks, oldest first: sinks then window."""
        return self.sinks + self.window

    def history_pages(self) -> list[int]:
        return [page for chunk in self.resident_chunks for page in chunk]

    def pending_pages(self) -> list[int]:
        return [page for chunk in self.pending for page in chunk]

    def referenced_pages(self) -> list[int]:
        """Every page this branch holds a reference on (one entry per reference)."""
        return self.history_pages() + self.pending_pages()

    def pages_needed(self, num_chunks: int) -> int:
        """Free pages that :meth:`set_pending` would have to allocate."""
        return max(0, num_chunks - len(self.pending)) * self.pages_per_chunk

    # ------------------------------------------------------------------ mutation
    def set_pending(self, num_chunks: int, allocator: PageAllocator) -> None:
        """Make the branch hold exactly ``num_chunks`` pending chunks.

        Existing pending pages are reused (denoising forwards overwrite them in
        place); missing chunks are allocated, surplus ones freed. Raises
        :class:`~ardiff_modules.errors.CapacityError` before changing anything.
        """
        have = len(self.pending)
        if num_chunks > have:
            fresh = allocator.allocate((num_chunks - have) * self.pages_per_chunk)
            step = self.pages_per_chunk
            new = tuple(tuple(fresh[i : i + step]) for i in range(0, len(fresh), step))
            self.pending = self.pending + new
        elif num_chunks < have:
            surplus = self.pending[num_chunks:]
            allocator.decref(page for chunk in surplus for page in chunk)
            self.pending = self.pending[:num_chunks]

    def commit_pending(self, allocator: PageAllocator) -> list[int]:
        """Turn pending chunks into history (no copy), evict per the policy; return freed pages."""
        result = self.policy.commit(self.sinks, self.window, self.pending)
        evicted_pages = [page for chunk in result.evicted for page in chunk]
        freed = allocator.decref(evicted_pages)
        self.committed_chunks += len(self.pending)
        self.sinks, self.window, self.pending = result.sinks, result.window, ()
        return freed

    def drop_pending(self, allocator: PageAllocator) -> list[int]:
        """Release pending chunks; history is untouched."""
        freed = allocator.decref(self.pending_pages())
        self.pending = ()
        return freed

    def release(self, allocator: PageAllocator) -> list[int]:
        """Drop every reference (history and pending) and start over at offset 0."""
        freed = allocator.decref(self.referenced_pages())
        self.sinks = self.window = self.pending = ()
        self.committed_chunks = 0
        return freed

    def adopt(self, other: BranchHistory, allocator: PageAllocator) -> None:
        """Share ``other``'s committed history by refcount (a fork): zero pages copied."""
        allocator.incref(other.history_pages())
        self.release(allocator)
        self.sinks, self.window = other.sinks, other.window
        self.committed_chunks = other.committed_chunks
