"""Frozen, validated configuration of a KV cache (pure Python, no torch).

A :class:`KVCacheSpec` says how many layers and heads the model has, how video
tokens are grouped into chunks and pages, how many chunks stay visible (sinks
plus a sliding window), which KV branches a session has (e.g. CFG's
``("cond", "uncond")``) and which named cross-attention caches it keeps.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from ardiff_modules.checks import require_int, require_positive_float
from ardiff_modules.errors import SpecError, UnknownCacheError
from ardiff_modules.core.recache import RecacheRule
from ardiff_modules.core.frame_retention import check_frame_geometry
from ardiff_modules.core.selected_retention import check_selection_geometry, selecting, selection_pages_of
from ardiff_modules.core.head_retention import HeadRetention
from ardiff_modules.core.retention import RetentionPolicy, SinkWindowPolicy, check_declared, check_index_bound

#: dtype names accepted by :class:`KVCacheSpec` (resolved to torch dtypes by the pool).
SUPPORTED_DTYPES = ("bfloat16", "float16", "float32")
#: Storage dtypes of the paged K/V: the compute dtypes, and FP8 (per-head scales, see ``quant.py``).
SUPPORTED_KV_DTYPES = (*SUPPORTED_DTYPES, "float8_e4m3fn")

#: How the pending chunks of one multi-chunk forward see each other (the history rule is the same for both):
#: ``"block_causal"`` -- pending query chunk ``c`` sees pending chunks ``0..c`` (Self-Forcing, CausVid);
#: ``"bidirectional"`` -- every pending chunk sees every pending chunk of its stream (Rolling Forcing's
#: jointly denoised window).
PendingAttention = Literal["block_causal", "bidirectional"]
PENDING_ATTENTION_MODES: tuple[str, ...] = get_args(PendingAttention)


def check_pending_attention(owner: str, value: Any) -> PendingAttention:
    """``value`` if it is one of :data:`PENDING_ATTENTION_MODES`, else :class:`SpecError` naming both."""
    if not isinstance(value, str) or value not in PENDING_ATTENTION_MODES:
        raise SpecError(f"{owner}: expected one of {PENDING_ATTENTION_MODES}, got {value!r}")
    return value  # type: ignore[return-value]  # narrowed by the membership test


def dtype_name(value: Any) -> Any:
    """``torch.bfloat16`` -> ``"bfloat16"`` (without importing torch); anything else unchanged."""
    text = str(value)
    if not isinstance(value, str) and type(value).__module__ == "torch" and text.startswith("torch."):
        return text[len("torch.") :]
    return value


def require_field_int(owner: str, name: str, value: Any, *, minimum: int, below: int | None = None) -> int:
    return require_int(f"{owner}.{name}", value, minimum=minimum, below=below)


def require_field_float(owner: str, name: str, value: Any) -> float:
    return require_positive_float(f"{owner}.{name}", value)


def _require_names(owner: str, name: str, values: tuple[str, ...]) -> None:
    if not values:
        raise SpecError(f"{owner}.{name}: expected at least one name, got an empty tuple")
    for value in values:
        if not isinstance(value, str) or not value:
            raise SpecError(f"{owner}.{name}: expected non-empty strings, got {value!r}")
    if len(set(values)) != len(values):
        raise SpecError(f"{owner}.{name}: expected unique names, got {values}")


@dataclass(frozen=True)
class CrossAttentionSpec:
    """One named cross-attention cache (e.g. ``"text"``), stored per session and branch.

    Parameters
    ----------
    name:
        Cache name used by ``populate_cross_attention`` / ``get_cross_attention_kv``.
    tokens:
        Number of context tokens (e.g. 512 padded T5 tokens). K/V per layer are
        ``[tokens, num_kv_heads, head_dim]``.
    num_kv_heads, head_dim:
        Own head count / head dim; ``None`` means the self-attention spec's.
    """

    name: str
    tokens: int
    num_kv_heads: int | None = None
    head_dim: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise SpecError(f"CrossAttentionSpec.name: expected a non-empty string, got {self.name!r}")
        require_field_int("CrossAttentionSpec", "tokens", self.tokens, minimum=1)
        if self.num_kv_heads is not None:
            require_field_int("CrossAttentionSpec", "num_kv_heads", self.num_kv_heads, minimum=1)
        if self.head_dim is not None:
            require_field_int("CrossAttentionSpec", "head_dim", self.head_dim, minimum=1)


@dataclass(frozen=True)
class KVCacheSpec:
    """Geometry and policy of a paged sink+window KV cache.

    Parameters
    ----------
    num_layers:
        Attention layers sharing the pool (one page id addresses a page in every layer).
    num_kv_heads, head_dim:
        K/V heads and head dim of self-attention.
    chunk_size:
        Tokens per autoregressive chunk (e.g. 3 latent frames x 1560 = 4680).
    page_size:
        Tokens per kernel page; must divide ``chunk_size``.
    sink_chunks:
        First committed chunks of a branch that are never evicted.
    window_chunks:
        Most recent committed non-sink chunks kept visible; ``None`` keeps all
        (plain block-causal attention over the whole history, nothing evicted).
    branches:
        Names of the independent KV streams of a session, e.g. ``("cond", "uncond")``.
    cross_attention:
        Named cross-attention caches.
    dtype:
        Compute dtype, one of :data:`SUPPORTED_DTYPES` (a name or the ``torch.dtype``): queries,
        outputs and the cross-attention caches.
    num_qo_heads:
        Query heads of self-attention (a multiple of ``num_kv_heads``; GQA when larger).
        Default ``num_kv_heads``. Kernel plans are built for it once per forward.
    kv_dtype:
        Storage dtype of the paged self-attention K/V, one of :data:`SUPPORTED_KV_DTYPES` (default:
        ``dtype``). K/V are cast to it when written and attended in ``dtype``. ``"float8_e4m3fn"``
        halves the pool's bytes: K/V are quantized with static per-(layer, K|V, kv head) scales
        (``pool.scales``), calibrated by each layer's first write or set with
        ``KVCache.set_kv_scales``; FlashInfer then runs FP8 attention (FA3, queries quantized per
        forward). See :mod:`ardiff_modules.quant`.
    retention:
        A :class:`~ardiff_modules.core.retention.RetentionPolicy` deciding which committed chunks stay
        resident, instead of ``sink_chunks`` / ``window_chunks`` (leave those at their defaults),
        e.g. :class:`~ardiff_modules.core.retention.SinkWindowMemoryPolicy`.
    pending_attention:
        The default rule between the pending chunks of a multi-chunk forward (a forward may override
        it: ``prepare_forward(..., pending_attention=...)``): ``"block_causal"`` (pending chunk ``c``
        sees pending chunks ``0..c``) or ``"bidirectional"`` (each sees all of them: Rolling
        Forcing). History visibility and commits are the same under both.
    relative_sinks:
        Attend the sink chunks at *relative* positions (LongLive 2's relative RoPE, Rolling Forcing's
        re-roped anchor): in every forward a stream's sinks are seen as if their last token sat just
        before its first visible non-sink token (the oldest window chunk, or the first pending chunk
        when no window chunk is resident), so the distance from any query to the sinks stays bounded
        however long the stream. Window and pending keys keep their natural positions. Needs
        ``sink_chunks >= 1`` (or a retention policy with sinks) and a RoPE the layers can evaluate at
        other positions: the layers then also attend with the query rotated at
        ``ForwardContext.sink_positions`` (``chunk_attention(..., sink_query=...)``).
    recache:
        The default :class:`~ardiff_modules.core.recache.RecacheRule` of ``prepare_recache`` (which chunks a
        prompt-switch re-cache rebuilds, how they see each other): block-causal with the sinks kept, or
        ``RecacheRule.longlive()``. It also sizes what a branch remembers of evicted chunks (a rule with
        context chunks or moving sinks rebuilds chunks the window evicted) and admission's re-cache reserve.
    head_retention:
        Retention groups (:class:`~ardiff_modules.core.head_retention.HeadRetention`): which (layer, kv head)
        keeps which chunks, one policy per group (per-head or per-layer windows). The cache then stores each
        group's heads in a *lane* of their own (``ardiff_modules.lanes``) and every forward attends each head
        over what its group keeps. Leave ``sink_chunks`` / ``window_chunks`` / ``retention`` at their
        defaults; a one-group assignment of every head is the uniform cache.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    chunk_size: int
    page_size: int
    sink_chunks: int = 0
    window_chunks: int | None = None
    branches: tuple[str, ...] = ("main",)
    cross_attention: tuple[CrossAttentionSpec, ...] = field(default_factory=tuple)
    dtype: str = "bfloat16"
    num_qo_heads: int | None = None
    kv_dtype: str | None = None
    retention: RetentionPolicy | None = None
    pending_attention: PendingAttention = "block_causal"
    relative_sinks: bool = False
    recache: RecacheRule = field(default_factory=RecacheRule)
    head_retention: HeadRetention | None = None

    def __post_init__(self) -> None:
        owner = "KVCacheSpec"
        for name in ("num_layers", "num_kv_heads", "head_dim", "chunk_size", "page_size"):
            require_field_int(owner, name, getattr(self, name), minimum=1)
        require_field_int(owner, "sink_chunks", self.sink_chunks, minimum=0)
        if self.window_chunks is not None:
            require_field_int(owner, "window_chunks", self.window_chunks, minimum=0)
        if self.chunk_size % self.page_size != 0:
            raise SpecError(
                f"{owner}.page_size: expected a divisor of chunk_size={self.chunk_size}, got {self.page_size} "
                f"(remainder {self.chunk_size % self.page_size})"
            )
        self._normalise_names(owner)
        if self.num_qo_heads is not None:
            require_field_int(owner, "num_qo_heads", self.num_qo_heads, minimum=1)
            if self.num_qo_heads % self.num_kv_heads:
                raise SpecError(
                    f"{owner}.num_qo_heads: expected a multiple of num_kv_heads={self.num_kv_heads}, "
                    f"got {self.num_qo_heads}"
                )
        # Frozen: normalise torch dtypes to their names through object.__setattr__.
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        object.__setattr__(self, "kv_dtype", dtype_name(self.kv_dtype))
        if not isinstance(self.dtype, str) or self.dtype not in SUPPORTED_DTYPES:
            raise SpecError(f"{owner}.dtype: expected one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        kv_dtype = self.kv_dtype
        if kv_dtype is not None and (not isinstance(kv_dtype, str) or kv_dtype not in SUPPORTED_KV_DTYPES):
            raise SpecError(
                f"{owner}.kv_dtype: expected None or one of {SUPPORTED_KV_DTYPES}, got {self.kv_dtype!r}"
            )
        self._check_retention(owner)
        self._check_head_retention(owner)
        self._check_index_bound(owner)
        check_pending_attention(f"{owner}.pending_attention", self.pending_attention)
        if not isinstance(self.relative_sinks, bool):
            raise SpecError(f"{owner}.relative_sinks: expected a bool, got {self.relative_sinks!r}")
        if not isinstance(self.recache, RecacheRule):
            raise SpecError(f"{owner}.recache: expected a RecacheRule, got {type(self.recache).__name__}")
        if self.relative_sinks and self.head_retention is None and self.policy.sink_chunks < 1:
            raise SpecError(
                f"{owner}.relative_sinks: expected sink chunks to move (sink_chunks >= 1), got "
                f"sink_chunks={self.policy.sink_chunks}"
            )

    def _normalise_names(self, owner: str) -> None:
        """``branches`` and ``cross_attention`` as checked tuples (frozen: through ``object.__setattr__``)."""
        # Accept lists (and one bare branch name) for convenience; store tuples so the spec stays hashable.
        if isinstance(self.branches, str):
            object.__setattr__(self, "branches", (self.branches,))
        if isinstance(self.cross_attention, str):
            raise SpecError(
                f"{owner}.cross_attention: expected a tuple of CrossAttentionSpec, got {self.cross_attention!r} "
                f"(a name: use (CrossAttentionSpec({self.cross_attention!r}, tokens),))"
            )
        if isinstance(self.cross_attention, CrossAttentionSpec):
            raise SpecError(
                f"{owner}.cross_attention: expected a tuple of CrossAttentionSpec, got {self.cross_attention!r} "
                "(a single spec: wrap it in a tuple)"
            )
        for name in ("branches", "cross_attention"):
            value = getattr(self, name)
            # Branch order is the default batch order of a forward: a set has none, a dict would
            # silently keep only its keys.
            if isinstance(value, (Set, Mapping)):
                raise SpecError(
                    f"{owner}.{name}: expected an ordered tuple, got {value!r} (a {type(value).__name__})"
                )
            try:
                object.__setattr__(self, name, tuple(value))
            except TypeError:
                raise SpecError(f"{owner}.{name}: expected a tuple, got {value!r}") from None
        _require_names(owner, "branches", self.branches)
        for cross in self.cross_attention:
            if not isinstance(cross, CrossAttentionSpec):
                raise SpecError(f"{owner}.cross_attention: expected CrossAttentionSpec items, got {cross!r}")
        cross_names = tuple(c.name for c in self.cross_attention)
        if len(set(cross_names)) != len(cross_names):
            raise SpecError(f"{owner}.cross_attention: expected unique cache names, got {cross_names}")

    def _check_retention(self, owner: str) -> None:
        if self.retention is None:
            return
        try:
            is_policy = isinstance(self.retention, RetentionPolicy)
        except Exception:  # noqa: BLE001
            # NOTE: Python 3.11's protocol check reads the properties (hasattr): one that raises is there, and
            # check_declared below turns its error into a SpecError naming it.
            is_policy = True
        if not is_policy:
            raise SpecError(
                f"{owner}.retention: expected a RetentionPolicy (sink_chunks, max_history_chunks, "
                f"history_indices), got {type(self.retention).__name__}"
            )
        if (self.sink_chunks, self.window_chunks) != (0, None):
            raise SpecError(
                f"{owner}.retention: expected sink_chunks/window_chunks left at (0, None) when a retention policy "
                f"is given, got ({self.sink_chunks}, {self.window_chunks})"
            )
        # NOTE: the declared counts size admission, extents and fixed buffers; a bad one is refused here,
        # each answer of history_indices() is checked at every commit (core.retention.retain).
        check_declared(self.retention)
        check_frame_geometry(f"{owner}.retention", self.retention, self.chunk_size, self.page_size)
        _check_selection(f"{owner}.retention", self.retention, self.chunk_size, self.page_size)

    def _check_head_retention(self, owner: str) -> None:
        heads = self.head_retention
        if heads is None:
            return
        if not isinstance(heads, HeadRetention):
            raise SpecError(f"{owner}.head_retention: expected a HeadRetention, got {type(heads).__name__}")
        heads.check_geometry(f"{owner}.head_retention", self.num_layers, self.num_kv_heads)
        for name, policy in heads.groups.items():
            check_frame_geometry(f"{owner}.head_retention.groups[{name!r}]", policy, self.chunk_size, self.page_size)
            _check_selection(f"{owner}.head_retention.groups[{name!r}]", policy, self.chunk_size, self.page_size)
        if (self.sink_chunks, self.window_chunks, self.retention) != (0, None, None):
            raise SpecError(
                f"{owner}.head_retention: expected sink_chunks/window_chunks/retention left at (0, None, None) (each "
                f"group has its own retention), got ({self.sink_chunks}, {self.window_chunks}, {self.retention!r})"
            )
        if self.relative_sinks and not any(p.sink_chunks for p in heads.groups.values()):
            raise SpecError(
                f"{owner}.relative_sinks: expected a retention group with sink chunks to move, got groups "
                f"{ {name: p.sink_chunks for name, p in heads.groups.items()} } (sink chunks each)"
            )

    def _check_index_bound(self, owner: str) -> None:
        """The peak tokens of one stream (resident chunks + one pending) fit the kernels' int32 offsets."""
        if self.head_retention is not None:
            for name, policy in self.head_retention.groups.items():
                sinks, bound = check_declared(policy)
                check_index_bound(
                    f"{owner}.head_retention.groups[{name!r}]", sinks, bound,
                    lambda: f"{type(policy).__name__} with sink_chunks={sinks}, max_history_chunks={bound}",
                    self.chunk_size,
                )
            return
        # NOTE: before self.policy builds a SinkWindowPolicy, whose own (per chunk) bound words no chunk_size.
        if self.retention is None:
            bound = None if self.window_chunks is None else self.sink_chunks + self.window_chunks
            check_index_bound(
                f"{owner}.window_chunks" if bound is not None else f"{owner}.sink_chunks", self.sink_chunks, bound,
                lambda: f"sink_chunks={self.sink_chunks} + window_chunks={self.window_chunks}", self.chunk_size,
            )
            return
        sinks, bound = check_declared(self.retention)
        check_index_bound(
            f"{owner}.retention", sinks, bound,
            lambda: f"{type(self.retention).__name__} with sink_chunks={sinks}, max_history_chunks={bound}",
            self.chunk_size,
        )

    @property
    def policy(self) -> RetentionPolicy:
        """The retention policy in force: ``retention``, or sink + window from the two fields.

        Raises :class:`SpecError` with ``head_retention``: each group has its own (``head_retention.groups``).
        """
        if self.head_retention is not None:
            raise SpecError(
                "KVCacheSpec.policy: expected a spec with one retention policy, got one with head_retention "
                f"(groups {tuple(self.head_retention.groups)}: each lane's spec has its group's policy)"
            )
        if self.retention is not None:
            return self.retention
        return SinkWindowPolicy(self.sink_chunks, self.window_chunks)

    @property
    def cache_dtype(self) -> str:
        """Storage dtype of the paged K/V (``kv_dtype`` or ``dtype``)."""
        return self.kv_dtype or self.dtype

    @property
    def query_heads(self) -> int:
        """Query heads of self-attention (``num_qo_heads`` or ``num_kv_heads``)."""
        return self.num_qo_heads if self.num_qo_heads is not None else self.num_kv_heads

    @property
    def pages_per_chunk(self) -> int:
        """Whole pages owned by one chunk."""
        return self.chunk_size // self.page_size

    @property
    def max_history_chunks(self) -> int | None:
        """Most committed chunks a branch keeps (sinks + window by default), ``None`` if unbounded; with
        ``head_retention`` the most any group keeps."""
        if self.head_retention is not None:
            bounds = [p.max_history_chunks for p in self.head_retention.groups.values()]
            return None if None in bounds else max(bounds)  # type: ignore[type-var]
        return self.policy.max_history_chunks

    @property
    def cross_attention_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.cross_attention)

    def cross_attention_spec(self, name: str) -> CrossAttentionSpec:
        for cross in self.cross_attention:
            if cross.name == name:
                return cross
        raise UnknownCacheError(
            f"Unknown cross-attention cache {name!r}; expected one of {self.cross_attention_names}"
        )

    def pages_per_branch(self, pending_chunks: int = 1) -> int | None:
        """Peak pages one branch holds: (sinks + window + pending) chunks; ``None`` if unbounded."""
        require_field_int("KVCacheSpec.pages_per_branch", "pending_chunks", pending_chunks, minimum=0)
        resident = self.max_history_chunks
        if resident is None:
            return None
        return (resident + pending_chunks) * self.pages_per_chunk


def max_attended_pages(spec: KVCacheSpec) -> int | None:
    """Most history pages one branch of ``spec`` attends at once (what fixed-size plan buffers and the compiled
    gradient path's padded history must hold): its policy's ``max_history_chunks`` chunks plus a content
    selection's pages (:class:`~ardiff_modules.core.selected_retention.SelectedFramesPolicy`: they come on top of
    the sink and window); with ``head_retention`` the most any group attends. ``None`` if unbounded."""
    policies = list(spec.head_retention.groups.values()) if spec.head_retention is not None else [spec.policy]
    bounds = []
    for policy in policies:
        chunks = policy.max_history_chunks
        if chunks is None:
            return None
        bounds.append(chunks * spec.pages_per_chunk + selection_pages_of(policy, spec.pages_per_chunk))
    return max(bounds)


def _check_selection(owner: str, policy: object, chunk_size: int, page_size: int) -> None:
    """A content-selected policy's patches are whole pages of its frames (after :func:`check_frame_geometry`)."""
    selected = selecting(policy)
    if selected is not None:
        check_selection_geometry(owner, policy, chunk_size // selected.frames_per_chunk // page_size)
