"""Named cross-attention caches: per-session entries, their validation, and stacking for a forward.

A session holds, per ``(cache name, branch)``, one immutable :class:`CrossEntry`: K and V of every
layer, ``[num_layers, tokens, heads, head_dim]``, published at once (a failure while producing the
layers leaves the previous entry visible). A forward over several streams reads them stacked to
``[num_layers, num_streams, tokens, heads, head_dim]`` (:class:`CrossStack`), restacked only when a
stream's entry changed; static (CUDA-graph) forwards copy into buffers allocated once, so a captured
graph reads the new prompt. The attention itself is :func:`ardiff_modules.cached_cross_attention`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from ardiff_modules.checks import compute_dtype_mismatch, needs_gqa, require_positive_float
from ardiff_modules.errors import CrossAttentionNotPopulatedError, SpecError, TensorMismatchError, UnknownCacheError
from ardiff_modules.spec import KVCacheSpec

_versions = itertools.count(1)

#: ``(cache name, branch)``.
CrossKey = tuple[str, str]


@dataclass(frozen=True, eq=False)
class CrossEntry:
    """One populated cross-attention cache of one branch: K and V ``[num_layers, tokens, heads, dim]``."""

    k: torch.Tensor
    v: torch.Tensor
    #: Unique per publication: a forward restacks only when some stream's version changed.
    version: int

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


def publish_entry(k: torch.Tensor, v: torch.Tensor) -> CrossEntry:
    """A new entry over ``k`` / ``v`` with a fresh version (a loaded file's entry is a new publication here)."""
    return CrossEntry(k, v, next(_versions))


def check_cache_name(spec: KVCacheSpec, cache_name: str) -> None:
    if cache_name not in spec.cross_attention_names:
        raise UnknownCacheError(
            f"Unknown cross-attention cache {cache_name!r}; expected one of {spec.cross_attention_names}"
        )


def build_entry(
    spec: KVCacheSpec,
    cache_name: str,
    layer_kv: Iterable[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    dtype: torch.dtype,
) -> CrossEntry:
    """Copy ``num_layers`` ``(k, v)`` pairs (each ``[tokens, heads, head_dim]``) into a new entry.

    Validates every layer (shape, device, floating dtype, layer count) and raises
    :class:`TensorMismatchError` before anything is published.
    """
    if not isinstance(layer_kv, Iterable) or isinstance(layer_kv, torch.Tensor):
        raise TensorMismatchError(
            f"populate_cross_attention({cache_name!r}): expected an iterable of {spec.num_layers} (k, v) pairs, "
            f"got {type(layer_kv).__name__}"
        )
    cross = spec.cross_attention_spec(cache_name)
    shape = (cross.tokens, cross.num_kv_heads or spec.num_kv_heads, cross.head_dim or spec.head_dim)
    k_all = torch.empty((spec.num_layers, *shape), dtype=dtype, device=device)
    v_all = torch.empty_like(k_all)
    count = 0
    for layer, pair in enumerate(layer_kv):
        if layer >= spec.num_layers:
            raise TensorMismatchError(
                f"populate_cross_attention({cache_name!r}): expected {spec.num_layers} layers, got more"
            )
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TensorMismatchError(
                f"populate_cross_attention({cache_name!r}) layer {layer}: expected a (k, v) pair, got {pair!r:.80}"
            )
        k, v = pair
        for label, t in (("k", k), ("v", v)):
            _check_layer_tensor(cache_name, layer, label, t, shape, device, dtype)
        k_all[layer].copy_(k.detach())  # a cache holds data, never an autograd graph
        v_all[layer].copy_(v.detach())
        count += 1
    if count != spec.num_layers:
        raise TensorMismatchError(
            f"populate_cross_attention({cache_name!r}): expected {spec.num_layers} layers, got {count}"
        )
    return CrossEntry(k_all, v_all, next(_versions))


def _check_layer_tensor(
    cache_name: str, layer: int, label: str, t: object, shape: tuple[int, ...], device: torch.device,
    dtype: torch.dtype,
) -> None:
    where = f"populate_cross_attention({cache_name!r}) layer {layer} {label}"
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        hint = ""
        if isinstance(t, torch.Tensor) and t.dim() == 3 and tuple(t.shape[1:]) == shape[1:]:
            # The cache holds a fixed token count: a trimmed or over-long prompt would attend to other keys.
            hint = (
                f": {t.shape[0]} tokens where CrossAttentionSpec({cache_name!r}).tokens is {shape[0]} (publish "
                "exactly the tokens the model attends to, e.g. the prompt padded to text_len)"
            )
        raise TensorMismatchError(f"{where}: expected shape {shape} [tokens, heads, head_dim], got {got}{hint}")
    if t.device != device and not (t.device.type == device.type == "cpu"):
        raise TensorMismatchError(f"{where}: expected device {device}, got {t.device}")
    if not t.dtype.is_floating_point:
        raise TensorMismatchError(f"{where}: expected a floating dtype (stored as {dtype}), got {t.dtype}")


def missing_message(name: str, who: str) -> str:
    return (
        f"Cross-attention cache {name!r} was read before it was populated for {who}; "
        "call populate_cross_attention() first"
    )


def not_populated(name: str, branch: str, session_id: str) -> CrossAttentionNotPopulatedError:
    return CrossAttentionNotPopulatedError(
        f"Cross-attention cache {name!r} for KV branch {branch!r} of session {session_id!r} was read before it "
        "was populated"
    )


#: name -> (K, V), each ``[num_layers, num_streams, tokens, heads, dim]``.
Stacked = dict[str, tuple[torch.Tensor, torch.Tensor]]


@dataclass(eq=False)
class CrossStack:
    """The stacked cross caches of one (reused) forward context, and what they were stacked from."""

    #: name -> the entries' versions the current stack holds.
    versions: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: Fixed buffers of static contexts (allocated on first use, then copied into).
    buffers: Stacked = field(default_factory=dict)

    def restack(
        self,
        names: Sequence[str],
        entries: Mapping[str, Sequence[CrossEntry | None]],
        streams: Sequence[str],
        current: Stacked,
        static: bool,
    ) -> tuple[Stacked, dict[str, str], dict[str, tuple[int, ...]]]:
        """Stack each cache's per-stream ``entries`` (``None`` = not populated for that stream).

        ``streams`` names the streams for error messages; ``current`` is what the context
        publishes now. Returns ``(stacked, missing reasons, versions)``; nothing is stored here
        until :meth:`adopt` (so a failed forward leaves this stack as it was).
        """
        stacked: Stacked = {}
        missing: dict[str, str] = {}
        versions: dict[str, tuple[int, ...]] = {}
        for name in names:
            per_stream = entries[name]
            absent = [who for who, e in zip(streams, per_stream) if e is None]
            if absent:
                missing[name] = missing_message(name, ", ".join(absent))
                continue
            present = [e for e in per_stream if e is not None]
            key = tuple(e.version for e in present)
            if self.versions.get(name) == key and name in current:
                stacked[name] = current[name]
            else:
                stacked[name] = self._stack(name, present, static)
            versions[name] = key
        return stacked, missing, versions

    def _stack(self, name: str, entries: list[CrossEntry], static: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if static:
            bufs = self.buffers.get(name)
            if bufs is None:
                bufs = (torch.stack([e.k for e in entries], dim=1), torch.stack([e.v for e in entries], dim=1))
                self.buffers[name] = bufs
            else:
                torch.stack([e.k for e in entries], dim=1, out=bufs[0])
                torch.stack([e.v for e in entries], dim=1, out=bufs[1])
            return bufs
        if len(entries) == 1:  # a view: no copy for a single stream
            return entries[0].k.unsqueeze(1), entries[0].v.unsqueeze(1)
        return torch.stack([e.k for e in entries], dim=1), torch.stack([e.v for e in entries], dim=1)

    def adopt(self, versions: dict[str, tuple[int, ...]]) -> None:
        self.versions = versions


class CrossReader(Protocol):
    """What :func:`cached_cross_attention` reads: a layer context (``ForwardContext.layers[i]``)."""

    def cross_kv(self, name: str) -> tuple[torch.Tensor, torch.Tensor]: ...


def cached_cross_attention(
    q: torch.Tensor, kv: CrossReader, cache_name: str, *, scale: float | None = None
) -> torch.Tensor:
    """Attend ``q`` (``[streams, seq_len, num_heads, head_dim]``) to the named cross cache of each stream.

    Returns ``[streams, seq_len, num_heads, head_dim]``.
    """
    if not hasattr(kv, "cross_kv"):  # duck-typed: benchmarks pass LayerContext look-alikes
        raise SpecError(
            f"cached_cross_attention.kv: expected a LayerContext (one entry of ForwardContext.layers, with "
            f".cross_kv), got {type(kv).__name__}"
        )
    if scale is not None:  # scale 0 would silently attend uniformly
        require_positive_float("cached_cross_attention.scale", scale, optional=True)
    if not isinstance(q, torch.Tensor):
        raise TensorMismatchError(
            f"cached_cross_attention q: expected a [streams, seq_len, heads, head_dim] tensor, got {type(q).__name__}"
        )
    k, v = kv.cross_kv(cache_name)  # [streams, tokens, kv_heads, head_dim]
    if q.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise TensorMismatchError(
            f"cached_cross_attention q: expected shape ({k.shape[0]}, seq_len, a multiple of {k.shape[2]} heads, "
            f"{k.shape[3]}), got {tuple(q.shape)}"
        )
    if q.dtype != k.dtype:  # the cross cache is stored in the compute dtype
        raise TensorMismatchError(compute_dtype_mismatch("cached_cross_attention q", k.dtype, q.dtype))
    if q.device != k.device:
        raise TensorMismatchError(f"cached_cross_attention q: expected device {k.device}, got {q.device}")
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale, enable_gqa=needs_gqa(q.shape[2], k.shape[2])
    )
    return out.transpose(1, 2)


class SessionCrossCaches:
    """A session's published cross-attention caches, ``(cache name, branch) -> CrossEntry`` in ``_cross``
    (``KVState``).

    The session provides ``cache`` (``spec``, ``device``, ``dtype``, ``lock``), ``session_id``, ``num_layers``,
    ``_check_open()`` and ``_check_branch(branch)`` (raises for an unknown branch or a closed session).
    """

    cache: Any
    session_id: str
    _cross: dict[CrossKey, CrossEntry]

    @property
    def num_layers(self) -> int:
        return self.cache.spec.num_layers

    def _check_open(self) -> None:  # pragma: no cover - every session defines it
        raise NotImplementedError

    def _check_branch(self, branch: str) -> None:  # pragma: no cover - every session defines it
        raise NotImplementedError

    def _cross_key(self, kv_branch: str, cache_name: str) -> CrossKey:
        self._check_branch(kv_branch)
        check_cache_name(self.cache.spec, cache_name)
        return cache_name, kv_branch

    def _cross_entries(self) -> dict[CrossKey, CrossEntry]:
        """Every published cross cache of this session, ``(cache name, branch) -> entry`` (a copy)."""
        return dict(self._cross)

    def _cross_entry(self, kv_branch: str, cache_name: str) -> CrossEntry | None:
        """The published cache ``cache_name`` of ``kv_branch`` (``None`` if not populated)."""
        return self._cross.get(self._cross_key(kv_branch, cache_name))

    def is_cross_attention_populated(self, kv_branch: str, cache_name: str) -> bool:
        return self._cross_key(kv_branch, cache_name) in self._cross

    def populate_cross_attention(
        self,
        kv_branch: str,
        cache_name: str,
        layer_kv: Iterable[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Publish one named cache for one branch after every layer was written.

        ``layer_kv`` yields ``num_layers`` ``(k, v)`` pairs, each ``[tokens, heads, head_dim]``,
        consumed once in layer order. If producing, validating or copying any layer fails,
        the previous complete cache (if any) stays visible and nothing changes.
        """
        key = self._cross_key(kv_branch, cache_name)
        entry = build_entry(self.cache.spec, cache_name, layer_kv, self.cache.device, self.cache.dtype)
        with self.cache.lock:
            self._check_open()  # closed by another thread while the layers were produced
            self._cross[key] = entry

    def get_cross_attention_kv(self, kv_branch: str, cache_name: str) -> list[dict[str, torch.Tensor]]:
        """Every layer's ``{"k", "v"}`` (each ``[tokens, heads, head_dim]``, on the cache's device) of a populated
        cache."""
        entry = self._cross_entry(kv_branch, cache_name)
        if entry is None:
            raise not_populated(cache_name, kv_branch, self.session_id)
        entry = self._on_device(entry)
        return [{"k": entry.k[i], "v": entry.v[i]} for i in range(self.num_layers)]

    def _on_device(self, entry: CrossEntry) -> CrossEntry:
        """``entry`` with its tensors on the cache's device: a suspended session's entries are host copies (the
        host tier), read as a device copy so that every call answers as on a resident session."""
        device = torch.device(self.cache.device)
        if entry.k.device.type == device.type:
            return entry
        return CrossEntry(entry.k.to(device), entry.v.to(device), entry.version)

    def clear_cross_attention(self) -> None:
        """Drop every named cross-attention cache (prompt switch); self-attention history is kept."""
        with self.cache.lock:
            self._check_open()
            self._cross.clear()

    def cross_attention_bytes(self) -> int:
        return sum(e.nbytes for e in self._cross.values())

    def _adopt_cross_entries(self, entries: Mapping[tuple[str, str], CrossEntry]) -> None:
        """Share populated cross caches ``(name, branch) -> entry`` by reference (fork, prompt sharing)."""
        self._cross.update(entries)
