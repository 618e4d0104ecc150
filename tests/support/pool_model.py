"""Plain models the property machines compare the library against (test helpers, no library logic).

* :func:`expected_visible` -- the sink + window rule as list slicing;
* :func:`longest_run` -- longest run of consecutive page ids; :func:`runs_holding` -- extents the runs hold;
* :class:`PoolContents` -- what every page of a KV pool must hold: a copy of the pool
  updated only by the writes the *model* says a forward makes (its pending pages, in
  token order). Comparing it bit for bit with the real pool after every step catches
  any write the library makes elsewhere (a stale forward, a committed or shared page,
  a freed page, another cache's pool).
* :func:`token_kv` -- K/V values that identify the write: a unique id per (forward,
  stream, token, layer), exactly representable in float32.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

#: Ids are written as ``(id mod 2**20) * 2**-20``: exact in float32, in [0, 1) (softmax stays tame).
_ID_BITS = 20


def expected_visible(committed: list, sink: int, window: int | None) -> list:
    """First ``sink`` chunks plus the last ``window`` of the remaining ones (plain slicing)."""
    rest = committed[sink:]
    if window is None:
        return committed[:sink] + rest
    # NOTE: rest[-0:] is the whole list, hence the explicit start index.
    return committed[:sink] + rest[max(0, len(rest) - window) :]


def shot_visible(
    committed: list, sink: int, window: int | None, shot_chunks: int, floor: int, shot_start: int | None
) -> list:
    """:func:`expected_visible` with a shot sink and a dropped window (list operations): the first ``sink``, the
    shot's first ``shot_chunks`` after them (from ``shot_start``, those committed), the newest others filling
    ``window`` minus the shot's ``shot_chunks`` (past the sinks); then every non-sink chunk below ``floor``
    (dropped) taken out."""
    n = len(committed)
    pinned = [] if shot_start is None else list(range(max(shot_start, sink), min(shot_start + shot_chunks, n)))
    others = [i for i in range(sink, n) if i not in pinned]
    if window is None:
        keep = sorted(pinned + others)
    else:
        # The shot's whole room (its chunks after the sinks) is reserved from its first commit on.
        begun = shot_start is not None and n > shot_start
        room = window - (len(range(max(shot_start, sink), shot_start + shot_chunks)) if begun else 0)
        keep = sorted(pinned + (others[max(0, len(others) - room) :] if room > 0 else []))
    return committed[: min(sink, n)] + [committed[i] for i in keep if i >= floor]


def longest_run(pages: Iterable[int]) -> int:
    """Length of the longest run of consecutive ids in ``pages``."""
    best = run = 0
    previous = -2
    for p in sorted(pages):
        run = run + 1 if p == previous + 1 else 1
        best, previous = max(best, run), p
    return best


def runs_holding(pages: Iterable[int], size: int) -> int:
    """How many runs of ``size`` consecutive ids the ids ``pages`` hold side by side (each maximal run of
    length ``L`` holds ``L // size``): the extents of ``size`` pages that can still be reserved."""
    total = run = 0
    previous = -2
    for p in sorted(pages):
        if p != previous + 1:
            total, run = total + run // size, 0
        run, previous = run + 1, p
    return total + run // size


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float32 tensor (NaN payloads included), for exact comparison."""
    assert t.dtype == torch.float32, t.dtype
    return t.contiguous().view(torch.int32)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(bits(a), bits(b)))


def token_kv(
    first_id: int, streams: int, tokens: int, layer: int, head_dim: int, heads: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[streams, tokens, heads, head_dim]`` whose every (token, kv head) carries its own id.

    Element ``j`` (flat over stream, token, head) gets id ``first_id + j``: K = (x, layer + 1/4, ...),
    V = (-x, layer - 1/2, ...) with ``x = (id mod 2**20) / 2**20``.
    """
    count = streams * tokens * heads
    ids = torch.arange(first_id, first_id + count, dtype=torch.int64) % (1 << _ID_BITS)
    x = ids.to(torch.float64) / (1 << _ID_BITS)
    k = torch.empty(count, head_dim, dtype=torch.float64)
    v = torch.empty_like(k)
    k[:, :] = layer + 0.25
    v[:, :] = layer - 0.5
    k[:, 0] = x
    v[:, 0] = -x
    k32, v32 = k.to(torch.float32), v.to(torch.float32)
    assert torch.equal(k32.to(torch.float64), k) and torch.equal(v32.to(torch.float64), v), "ids must be exact"
    return k32.view(streams, tokens, heads, head_dim), v32.view(streams, tokens, heads, head_dim)


class PoolContents:
    """The contents a pool ``[layers, 2, pages, page_size, heads, dim]`` must have, per the model."""

    def __init__(self, pool_kv: torch.Tensor) -> None:
        self.kv = pool_kv.detach().clone()

    @property
    def page_size(self) -> int:
        return self.kv.shape[3]

    def write(self, layer: int, pages: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """A forward's ``k``/``v`` ``[tokens, heads, dim]`` of one stream land in ``pages``, token order."""
        shape = (len(pages), *self.kv.shape[3:])
        index = torch.tensor(list(pages), dtype=torch.int64)
        self.kv[layer, 0].index_copy_(0, index, k.reshape(shape).to(self.kv.dtype))
        self.kv[layer, 1].index_copy_(0, index, v.reshape(shape).to(self.kv.dtype))

    def copy(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Page ``src[i]`` copied to ``dst[i]``, every layer, K and V (a re-cache moving a chunk into its ring)."""
        self.kv[:, :, list(dst)] = self.kv[:, :, list(src)]

    def put(self, pages: Sequence[int], data: torch.Tensor) -> None:
        """``data`` ``[layers, 2, len(pages), page_size, heads, dim]`` (values :meth:`pages` returned) now lives in
        ``pages`` (a resume or a load laid a chunk there)."""
        self.kv[:, :, list(pages)] = data

    def pages(self, pages: Sequence[int]) -> torch.Tensor:
        """``[layers, 2, len(pages), page_size, heads, dim]`` (a copy)."""
        return self.kv[:, :, list(pages)].clone()

    def tokens(self, layer: int, kind: int, pages: Sequence[int]) -> torch.Tensor:
        """``[len(pages) * page_size, heads * dim]`` of K (``kind=0``) or V (``kind=1``)."""
        width = self.kv.shape[-2] * self.kv.shape[-1]
        return self.kv[layer, kind, list(pages)].reshape(len(pages) * self.page_size, width)

    def head_tokens(self, layer: int, kind: int, pages: Sequence[int], head: int) -> torch.Tensor:
        """``[len(pages) * page_size, dim]`` of K (``kind=0``) or V (``kind=1``) of one of the pool's heads."""
        return self.kv[layer, kind, list(pages), :, head].reshape(len(pages) * self.page_size, self.kv.shape[-1])

    def finite(self, pages: Sequence[int]) -> bool:
        return bool(torch.isfinite(self.kv[:, :, list(pages)]).all())

    def mismatched_pages(self, pool_kv: torch.Tensor) -> list[int]:
        """Pages whose bits differ between the model and ``pool_kv``."""
        a, b = bits(self.kv), bits(pool_kv)
        diff = (a != b).reshape(a.shape[0], a.shape[1], a.shape[2], -1).any(-1).any(0).any(0)
        return diff.nonzero().flatten().tolist()
