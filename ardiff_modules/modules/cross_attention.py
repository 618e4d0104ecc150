"""``CachedCrossAttention``: cross-attention to a named per-session cache of projected K/V, and
``populate_cross_attention``, which projects a context through every layer and publishes it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ardiff_modules.checks import needs_gqa
from ardiff_modules.context import LayerContext
from ardiff_modules.errors import SpecError
from ardiff_modules.modules.common import (
    QKNorm,
    check_context,
    check_input,
    check_layer_context,
    check_options,
    head_geometry,
    merge_heads,
    apply_qk_norm,
    split_heads,
)
from ardiff_modules.modules.functional import cached_cross_attention
from ardiff_modules.modules.loading import copy_from_source, CheckpointLayer, read_source, SourceConfig
from ardiff_modules.modules.naming import ParamNames
from ardiff_modules.modules.self_attention import SequenceParallelHook
from ardiff_modules.spec import require_field_int
from ardiff_modules.session import KVState


class CachedCrossAttention(CheckpointLayer):
    """Cross-attention to a named per-session cache (e.g. ``"text"``) of projected K/V.

    The context is projected once per prompt with :meth:`project_kv` and published for all
    layers with :func:`populate_cross_attention`; every forward reads it from the layer context.

    With ``image_cache_name`` the layer is an image-to-video cross-attention (Wan's
    ``WanI2VCrossAttention``, diffusers' ``WanAttention`` with ``added_kv_proj_dim``): separate image
    K/V projections (and K norm) feed a second cache, and the output is
    ``to_out(attn(q, text) + attn(q, image))``. Publish the image cache with
    ``populate_cross_attention(state, branch, layers, image_context, cache_name=image_cache_name)``.

    Parameters
    ----------
    dim:
        Model width (queries).
    num_heads:
        Query heads.
    cache_name:
        The cross cache this layer reads (a ``CrossAttentionSpec`` name of the KV cache's spec).
    context_dim:
        Width of the context; default ``dim``.
    num_kv_heads, head_dim, qk_norm, bias, eps, param_names:
        As :class:`ChunkSelfAttention`.
    image_cache_name:
        The cross cache of the image context (I2V); ``None`` (default) for text-only layers.
    image_context_dim:
        Width of the image context; default ``context_dim``. Only with ``image_cache_name``.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        cache_name: str = "text",
        *,
        context_dim: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        qk_norm: QKNorm = None,
        bias: bool = True,
        eps: float = 1e-6,
        param_names: ParamNames = "ardiff",
        image_cache_name: str | None = None,
        image_context_dim: int | None = None,
    ) -> None:
        super().__init__()
        owner = "CachedCrossAttention"
        if not isinstance(cache_name, str) or not cache_name:
            raise SpecError(f"{owner}.cache_name: expected a non-empty string, got {cache_name!r}")
        self.num_kv_heads, self.head_dim = head_geometry(owner, dim, num_heads, num_kv_heads, head_dim)
        if context_dim is None:
            context_dim = dim
        require_field_int(owner, "context_dim", context_dim, minimum=1)
        if image_cache_name is not None and (not isinstance(image_cache_name, str) or not image_cache_name
                                             or image_cache_name == cache_name):
            raise SpecError(
                f"{owner}.image_cache_name: expected None or a non-empty string other than "
                f"cache_name={cache_name!r}, got {image_cache_name!r}"
            )
        if image_cache_name is None and image_context_dim is not None:
            raise SpecError(
                f"{owner}.image_context_dim: expected None without image_cache_name, got {image_context_dim!r}"
            )
        if image_cache_name is not None:
            image_context_dim = context_dim if image_context_dim is None else image_context_dim
            require_field_int(owner, "image_context_dim", image_context_dim, minimum=1)
        self.eps = check_options(owner, bias, eps)
        self._init_names(owner, param_names)
        self.cache_name = cache_name
        self.image_cache_name = image_cache_name
        self.dim = dim
        self.context_dim = context_dim
        self.image_context_dim = image_context_dim
        self.num_heads = num_heads
        self.qk_norm = qk_norm
        kv_width = self.num_kv_heads * self.head_dim
        self.norm_q = apply_qk_norm(owner, qk_norm, num_heads, self.head_dim, self.eps)
        self.norm_k = apply_qk_norm(owner, qk_norm, self.num_kv_heads, self.head_dim, self.eps)
        self._register("q", nn.Linear(dim, num_heads * self.head_dim, bias=bias))
        self._register("k", nn.Linear(context_dim, kv_width, bias=bias))
        self._register("v", nn.Linear(context_dim, kv_width, bias=bias))
        self._register("o", nn.Linear(num_heads * self.head_dim, dim, bias=bias))
        if image_context_dim is not None:
            self._register("k_img", nn.Linear(image_context_dim, kv_width, bias=bias))
            self._register("v_img", nn.Linear(image_context_dim, kv_width, bias=bias))
            self._register("norm_k_img", apply_qk_norm(owner, qk_norm, self.num_kv_heads, self.head_dim, self.eps))
        #: Ulysses hook (``ardiff_modules.distributed.parallelize`` sets it): the cached path attends over
        #: head shards and ``populate_cross_attention`` publishes this rank's kv heads. ``None``: one process.
        self.sequence_parallel: SequenceParallelHook | None = None

    @property
    def to_k_img(self) -> nn.Linear:
        """The image-context key projection (``to_k_img`` / ``k_img`` / ``add_k_proj``); I2V layers only."""
        return self._image_role("k_img")  # type: ignore[return-value]

    @property
    def to_v_img(self) -> nn.Linear:
        """The image-context value projection (``to_v_img`` / ``v_img`` / ``add_v_proj``); I2V layers only."""
        return self._image_role("v_img")  # type: ignore[return-value]

    @property
    def norm_k_img(self) -> nn.Module:
        """The image-context key norm (``norm_k_img`` / ``norm_k_img`` / ``norm_added_k``); I2V layers only."""
        return self._image_role("norm_k_img")

    def _image_role(self, role: str) -> nn.Module:
        if self.image_cache_name is None:
            raise SpecError(
                f"CachedCrossAttention.{role}: expected a layer built with image_cache_name, got a text-only one"
            )
        return self._role(role)

    @classmethod
    def from_wan(
        cls, module: nn.Module, cache_name: str = "text", *, image_cache_name: str = "image",
        param_names: ParamNames = "wan",
    ) -> CachedCrossAttention:
        """A layer equal to a Wan2.1 ``WanT2VCrossAttention`` (``q, k, v, o``, ``norm_q`` / ``norm_k``,
        ``num_heads``) or ``WanI2VCrossAttention`` (also ``k_img, v_img, norm_k_img``: the layer then
        reads the image context from ``image_cache_name``), holding a copy of its weights. With the
        default ``param_names="wan"`` its ``state_dict()`` keys equal the module's."""
        owner = "CachedCrossAttention.from_wan"
        config = read_source(owner, module, "wan", "num_heads", cross=True)
        return cls._from_source(owner, module, "wan", config, cache_name, image_cache_name, param_names)

    @classmethod
    def from_diffusers(
        cls, module: nn.Module, cache_name: str = "text", *, image_cache_name: str = "image",
        param_names: ParamNames = "diffusers",
    ) -> CachedCrossAttention:
        """A layer equal to a diffusers ``WanAttention`` cross-attention (``attn2``: ``to_q, to_k, to_v,
        to_out.0``, ``norm_q`` / ``norm_k``, ``heads``; with ``add_k_proj, add_v_proj, norm_added_k`` for
        I2V, read from ``image_cache_name``), holding a copy of its weights. With the default
        ``param_names="diffusers"`` its ``state_dict()`` keys equal the module's. Of a fused module
        (``fuse_projections()``) the layer copies the fused ``to_kv`` / ``to_added_kv`` it runs, split into
        ``to_k, to_v`` / ``add_k_proj, add_v_proj`` (the unfused ones may be stale or deleted)."""
        owner = "CachedCrossAttention.from_diffusers"
        if getattr(module, "is_cross_attention", True) is False:
            raise SpecError(f"{owner}: expected a cross-attention WanAttention (attn2), got a self-attention one")
        config = read_source(owner, module, "diffusers", "heads", cross=True)
        return cls._from_source(owner, module, "diffusers", config, cache_name, image_cache_name, param_names)

    @classmethod
    def _from_source(
        cls, owner: str, module: nn.Module, source: str, c: SourceConfig, cache_name: Any, image_cache_name: Any,
        param_names: Any,
    ) -> CachedCrossAttention:
        with torch.device("meta"):
            layer = cls(
                c.dim, c.num_heads, cache_name, context_dim=c.context_dim, num_kv_heads=c.num_kv_heads,
                head_dim=c.head_dim, qk_norm=c.qk_norm, bias=c.bias, eps=c.eps, param_names=param_names,
                image_cache_name=image_cache_name if c.image_context_dim is not None else None,
                image_context_dim=c.image_context_dim,
            )
        return copy_from_source(owner, layer, module, source)

    def _kv(self, context: torch.Tensor, image: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """3-D ``context`` ``[b, tokens, width]`` -> ``(k, v)`` each ``[b, tokens, kv_heads, head_dim]``."""
        if image:
            k_proj, v_proj, norm = self.to_k_img, self.to_v_img, self.norm_k_img
        else:
            k_proj, v_proj, norm = self.to_k, self.to_v, self.norm_k
        k, v = k_proj(context), v_proj(context)
        if self.qk_norm == "full":
            k = norm(k)
        k, v = (rearrange(t, "b t (h d) -> b t h d", h=self.num_kv_heads, d=self.head_dim) for t in (k, v))
        if self.qk_norm == "head":
            k = norm(k)
        return k, v

    def _is_image(self, owner: str, cache_name: str | None) -> bool:
        if cache_name is None or cache_name == self.cache_name:
            return False
        if self.image_cache_name is not None and cache_name == self.image_cache_name:
            return True
        names = (self.cache_name,) + ((self.image_cache_name,) if self.image_cache_name is not None else ())
        raise SpecError(f"{owner}.cache_name: expected None or one of {names}, got {cache_name!r}")

    def project_kv(self, context: torch.Tensor, cache_name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``context`` ``[tokens, context_dim]`` or diffusers' batched ``[1, tokens, context_dim]`` ->
        ``(k, v)`` each ``[tokens, num_kv_heads, head_dim]``.

        ``cache_name``: ``None`` or ``self.cache_name`` projects the (text) context; ``image_cache_name``
        projects an image context (``[tokens, image_context_dim]``) with the image projections.
        """
        owner = "CachedCrossAttention.project_kv"
        image = self._is_image(owner, cache_name)
        return self._project_kv(owner, context, image)

    def _project_kv(self, owner: str, context: Any, image: bool) -> tuple[torch.Tensor, torch.Tensor]:
        width = self.image_context_dim if image else self.context_dim
        weight = (self.to_k_img if image else self.to_k).weight
        context = check_context(owner, "context", context, width, weight)  # type: ignore[arg-type]
        k, v = self._kv(context, image)
        return k[0], v[0]

    def forward(
        self,
        x: torch.Tensor,
        kv: LayerContext | None = None,
        *,
        context: torch.Tensor | None = None,
        image_context: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x`` ``[streams, seq_len, dim]`` -> ``[streams, seq_len, dim]``.

        With ``kv`` (this layer's ``LayerContext``) it attends to the cached K/V of ``cache_name`` (and
        ``image_cache_name``). Without a cache, pass ``context`` instead: ``[tokens, context_dim]``,
        diffusers' ``[1, tokens, context_dim]`` (both shared by all streams) or ``[streams, tokens,
        context_dim]``, projected and attended directly -- the numbers the cached path gives after
        :func:`populate_cross_attention`; an I2V layer then also needs ``image_context`` (same forms,
        width ``image_context_dim``).

        With both ``kv`` and ``context``, the K/V are projected live from ``context`` when training them is
        possible -- grad mode on and the K/V projections (or the context) require grad: what Self-Forcing's
        checkpointed blocks do, so ``k``, ``v``, ``norm_k`` and whatever made the context (a text embedding) get
        their gradients -- and read from the once-projected cache otherwise (the context is then unused).
        """
        owner = "CachedCrossAttention"
        check_input(owner, "x", x, "[streams, seq_len, dim]", self.dim, self.to_q.weight)
        s = x.shape[0]
        q = split_heads(self.to_q(x), self.num_heads, self.head_dim, self.qk_norm, self.norm_q)
        if kv is not None and (context is not None or image_context is not None):
            if not self.projects_live(context, image_context):
                context = image_context = None  # no gradient to give: the cache
            else:
                kv = None
        if context is None and image_context is None:
            check_layer_context(owner, kv, "cross_kv")
            sp = self.sequence_parallel
            if sp is not None:  # x holds this rank's tokens; the cache this rank's heads
                q = sp.heads_in(q)
            out = cached_cross_attention(q, kv, self.cache_name)  # type: ignore[arg-type]
            if self.image_cache_name is not None:
                out = out + cached_cross_attention(q, kv, self.image_cache_name)  # type: ignore[arg-type]
            if sp is not None:
                out = sp.heads_out(out)
            return self.to_out(merge_heads(out))
        if context is None or (self.image_cache_name is None) != (image_context is None):
            needs = "context and image_context (an I2V layer)" if self.image_cache_name else "context only"
            got = ", ".join(n for n, t in (("context", context), ("image_context", image_context)) if t is not None)
            raise SpecError(f"{owner}: expected {needs} to project the K/V from the context, got {got}")
        out = self._attend(q, check_context(owner, "context", context, self.context_dim, self.to_k.weight, s), False)
        if image_context is not None:
            ctx = check_context(owner, "image_context", image_context, self.image_context_dim, self.to_k_img.weight, s)  # type: ignore[arg-type]
            out = out + self._attend(q, ctx, True)
        return self.to_out(merge_heads(out))

    def projects_live(self, context: torch.Tensor | None, image_context: torch.Tensor | None = None) -> bool:
        """Whether a call given both the cache and ``context`` projects the K/V from the context: grad mode on and
        a K/V projection / norm parameter or a context requires grad."""
        if not torch.is_grad_enabled():
            return False
        roles = ("k", "v", "norm_k") + (("k_img", "v_img", "norm_k_img") if self.image_cache_name is not None else ())
        if any(p.requires_grad for role in roles for p in self._role(role).parameters()):
            return True
        return any(isinstance(t, torch.Tensor) and t.requires_grad for t in (context, image_context))

    def _attend(self, q: torch.Tensor, context: torch.Tensor, image: bool) -> torch.Tensor:
        """``q`` ``[S, n, heads, head_dim]`` to a 3-D context (batch 1 or S) -> ``[S, n, heads, head_dim]``."""
        k, v = self._kv(context, image)
        k, v = k.expand(q.shape[0], -1, -1, -1), v.expand(q.shape[0], -1, -1, -1)
        q, k, v = (rearrange(t, "s n h d -> s h n d") for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=needs_gqa(q.shape[1], k.shape[1]))
        return rearrange(out, "s h n d -> s n h d")

    def extra_repr(self) -> str:
        image = (
            f", image_cache_name={self.image_cache_name!r}, image_context_dim={self.image_context_dim}"
            if self.image_cache_name is not None else ""
        )
        return (
            f"dim={self.dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"cache_name={self.cache_name!r}, context_dim={self.context_dim}{image}, qk_norm={self.qk_norm!r}, "
            f"param_names={self.param_names!r}"
        )


#: What :func:`populate_cross_attention` takes as ``layers``, at the type level: any iterable of modules
#: (an ``nn.ModuleList`` too). ``Tensor`` is there because ``nn.Module.__getattr__`` is typed
#: ``Tensor | Module``, so ``[b.cross_attn for b in model.blocks]`` is a ``list[Tensor | Module]`` to a
#: type checker; every element is checked at run time to be a :class:`CachedCrossAttention`.
CrossAttentionLayers = Iterable[nn.Module | torch.Tensor]


def populate_cross_attention(
    state: KVState,
    kv_branch: str,
    layers: CrossAttentionLayers,
    context: torch.Tensor,
    cache_name: str | None = None,
) -> None:
    """Project ``context`` (``[tokens, context_dim]`` or ``[1, tokens, context_dim]``) through every layer
    and publish atomically.

    ``layers``: one :class:`CachedCrossAttention` per attention layer of the spec, in layer order (a list,
    a generator, an ``nn.ModuleList``); typed as any modules so that ``[b.cross_attn for b in
    model.blocks]`` type-checks. An element of another type raises :class:`SpecError` naming its index
    and type before anything is projected or published (the previous cache stays).

    ``cache_name`` defaults to the layers' (common) ``cache_name``. Naming a layer's
    ``image_cache_name`` projects ``context`` with that layer's image projections (I2V).

    Layers are projected lazily, in order, as ``state.populate_cross_attention`` consumes them, so a
    failure part-way (e.g. out of memory) leaves the previous cache visible.
    """
    owner = "populate_cross_attention"
    # NOTE: duck-typed on the one method it calls (a session; any object that publishes cross caches).
    if not isinstance(state, KVState) and not callable(getattr(state, "populate_cross_attention", None)):
        raise SpecError(f"{owner}.state: expected a KVState, got {type(state).__name__}")
    cross = cross_attention_layers(owner, layers)
    if cache_name is None:
        # Publishing under layer 0's name while another layer reads another cache would be silently wrong.
        names = tuple(layer.cache_name for layer in cross)
        if len(set(names)) != 1:
            raise SpecError(
                f"{owner}.layers: expected one cache_name for all layers (or an explicit cache_name), got {names}"
            )
        cache_name = names[0]
    image = []
    for i, layer in enumerate(cross):
        # An I2V layer must know which of its projections the name means; a text-only layer may
        # publish its projections under any name (as before image caches existed).
        if layer.image_cache_name is not None and cache_name not in (layer.cache_name, layer.image_cache_name):
            raise SpecError(
                f"{owner}.cache_name: expected {layer.cache_name!r} or {layer.image_cache_name!r} "
                f"(layer {i}'s caches), got {cache_name!r}"
            )
        image.append(layer.image_cache_name is not None and cache_name == layer.image_cache_name)

    def projections() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for layer, is_image in zip(cross, image):
            # NOTE: no_grad per layer, never around the yield: a consumer that raises part-way leaves this
            # generator suspended, and a no_grad held across the yield would keep grad mode off for the thread.
            with torch.no_grad():
                k, v = layer._project_kv("CachedCrossAttention.project_kv", context, is_image)
                if layer.sequence_parallel is not None:  # Ulysses: this rank's cache holds its kv heads only
                    k, v = (layer.sequence_parallel.shard_kv_heads(t, layer.num_heads) for t in (k, v))
            yield k, v

    state.populate_cross_attention(kv_branch, cache_name, projections())


def cross_attention_layers(owner: str, layers: object) -> list[CachedCrossAttention]:
    """``layers`` (any iterable) as a list of :class:`CachedCrossAttention`, or :class:`SpecError` naming
    the first element of another type by its index and type (nothing else is touched)."""
    try:
        items = list(layers)  # type: ignore[call-overload]
    except TypeError:  # e.g. a single layer (a Module is not iterable)
        raise SpecError(
            f"{owner}.layers: expected an iterable of CachedCrossAttention (one per layer), got a {type(layers).__name__}"
        ) from None
    if not items:
        raise SpecError(f"{owner}.layers: expected at least one CachedCrossAttention (one per layer), got none")
    for i, layer in enumerate(items):
        if not isinstance(layer, CachedCrossAttention):
            raise SpecError(
                f"{owner}.layers[{i}]: expected CachedCrossAttention items (each block's cross-attention layer), "
                f"got {type(layer).__name__} at {i}"
            )
    return items
