"""Run a stock diffusers ``WanTransformer3DModel`` over the paged KV cache, chunk by chunk.

One call installs the hook; the model itself is not edited (its weights, module tree and
state dict are unchanged, and :meth:`PagedWanTransformer.remove` restores its processors)::

    from ardiff_modules.integrations.diffusers import enable_paged_attention, wan_cache_spec

    spec = wan_cache_spec(transformer, frames_per_chunk=3, latent_height=60, latent_width=104,
                          sink_chunks=1, window_chunks=6, branches=("cond", "uncond"), dtype="bfloat16")
    cache = am.KVCache(spec, budget_bytes=16 << 30, device="cuda")
    paged = enable_paged_attention(transformer, cache)
    state = cache.open_session()
    paged.set_prompt(state, "cond", prompt_embeds)            # [1, 512, text_dim], diffusers' encode_prompt
    paged.set_prompt(state, "uncond", negative_prompt_embeds)
    with state.prepare_forward(("cond", "uncond"), spec.chunk_size, commit_current=False) as fwd:
        flow = paged(latents, timestep, fwd)                  # latents [2, C, F, H, W] -> [2, C_out, F, H, W]

What the hook does, per :class:`~diffusers.models.transformers.transformer_wan.WanTransformerBlock`:

- ``attn1`` (self-attention): the model's own ``to_q/to_k/to_v`` (or fused ``to_qkv``), ``norm_q/norm_k``,
  Wan's interleaved RoPE at **absolute** positions, then :func:`ardiff_modules.chunk_attention` (K/V
  written into the pending pages; the query chunk sees sinks + window + pending chunks up to its own).
  diffusers' ``WanRotaryPosEmbed`` counts frames from 0 inside its input; a forward hook on
  ``model.rope`` replaces its tables by ones computed from the forward's token positions
  (``fwd.positions``, which count evicted tokens too): frame ``p // (H' W')``, row and column from
  ``p mod H' W'``, angles in float64 from the integer positions (as diffusers computes its table).
- ``attn2`` (cross-attention): the prompt's K/V are projected once per branch with the model's own
  ``text_embedder``, ``to_k/to_v`` and ``norm_k`` (and, for I2V models, ``image_embedder``,
  ``add_k_proj/add_v_proj`` and ``norm_added_k``) and published with
  :meth:`~ardiff_modules.session.KVState.populate_cross_attention`; every forward reads them through the
  layer context (:func:`ardiff_modules.cached_cross_attention`); the ``encoder_hidden_states`` the
  model receives are not used.

The batch dimension of ``hidden_states`` is the forward's streams, in the order given to
``prepare_forward`` (CFG: cond and uncond in one forward). Outside an active forward (no
:meth:`PagedWanTransformer.activate` / call in progress) the processors run diffusers' original
ones, so the model still works as a plain diffusers model.

diffusers is imported only when a function of this module is called; without it, an
``ImportError`` names the extra: ``pip install 'ardiff_modules[diffusers]'``.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
from collections.abc import Iterator
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
from einops import rearrange

from ardiff_modules.cache import KVCache
from ardiff_modules.checks import is_int, require_int, require_positive_float
from ardiff_modules.context import ForwardContext, LayerContext
from ardiff_modules.errors import SpecError, TensorMismatchError
from ardiff_modules.modules.functional import cached_cross_attention, chunk_attention, rotate
from ardiff_modules.spec import CrossAttentionSpec, KVCacheSpec
from ardiff_modules.session import KVState

if TYPE_CHECKING:  # pragma: no cover - for type checkers only
    from diffusers.models.transformers.transformer_wan import WanAttention

__all__ = [
    "PagedWanCrossAttnProcessor",
    "PagedWanSelfAttnProcessor",
    "PagedWanTransformer",
    "enable_paged_attention",
    "wan_cache_spec",
    "wan_rope_tables",
]

_EXTRA_HINT = "pip install 'ardiff_modules[diffusers]'"

#: A diffusers ``WanTransformer3DModel`` (checked at run time by ``_check_model``). ``Any`` to type
#: checkers: what this module reads off it (``blocks``, ``rope``, ``condition_embedder``, ``config``,
#: calling it) is not in diffusers' type hints, so it is used duck-typed.
_WanModel: TypeAlias = Any

#: Dtypes the model computes in (its patch embedding's weight in one of them: the latents' dtype must match).
_COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: DEBUG when processors are installed / removed; nothing is logged per forward or per block call.
logger = logging.getLogger(__name__)


def _transformer_wan() -> ModuleType:
    """diffusers' ``transformer_wan`` module, or an ImportError naming the extra."""
    try:
        return importlib.import_module("diffusers.models.transformers.transformer_wan")
    except ImportError as exc:  # ModuleNotFoundError included
        raise ImportError(
            f"ardiff_modules.integrations.diffusers needs the diffusers package (0.42.x): {_EXTRA_HINT} "
            f"({exc})"
        ) from exc


def _check_model(owner: str, model: Any) -> None:
    wan = _transformer_wan()
    if not isinstance(model, wan.WanTransformer3DModel):
        raise SpecError(f"{owner}.model: expected a diffusers WanTransformer3DModel, got {type(model).__name__}")


def _has_image_context(model: _WanModel) -> bool:
    return model.blocks[0].attn2.add_k_proj is not None


# ---------------------------------------------------------------------------------------------- RoPE


def wan_rope_tables(
    positions: torch.Tensor,
    *,
    height_tokens: int,
    width_tokens: int,
    axes_dims: tuple[int, int, int],
    theta: float = 10000.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Wan's 3-axis RoPE tables at absolute token positions, in diffusers' layout.

    Parameters
    ----------
    positions:
        int64 ``[streams, seq_len]`` absolute token positions (``fwd.positions``). Tokens are laid
        out frame-major as diffusers' patchified Wan input: ``p = (frame * height_tokens + row) *
        width_tokens + col``.
    height_tokens, width_tokens:
        Post-patch height and width ``H' = H // p_h``, ``W' = W // p_w``.
    axes_dims:
        ``(t_dim, h_dim, w_dim)`` of the model's ``WanRotaryPosEmbed`` (they sum to ``head_dim``).
    theta:
        RoPE base (diffusers' Wan: 10000).
    dtype:
        Dtype of the returned tables (diffusers' buffers are float32); angles are always computed
        in float64 (float32 on MPS) from the integer positions.

    Returns
    -------
    ``(cos, sin)``, each ``[streams, seq_len, 1, head_dim]``, every value repeated for its channel
    pair ``(2i, 2i + 1)`` -- exactly what diffusers' ``WanRotaryPosEmbed`` returns for frames counted
    from 0, but at the absolute frame, row and column of each token. For per-head ``positions``
    ``[streams, seq_len, heads]`` (a layer's ``kv.sink_positions`` where its retention-group lanes'
    sinks move by different shifts) each ``[streams, seq_len, heads, head_dim]``.
    """
    if not isinstance(positions, torch.Tensor) or positions.dim() not in (2, 3) or positions.dtype != torch.int64:
        got = (tuple(positions.shape), positions.dtype) if isinstance(positions, torch.Tensor) else type(positions)
        raise TensorMismatchError(
            f"wan_rope_tables positions: expected int64 [streams, seq_len] (or per head [streams, seq_len, heads]), "
            f"got {got}"
        )
    per_frame = height_tokens * width_tokens
    frame = torch.div(positions, per_frame, rounding_mode="floor")
    in_frame = positions - frame * per_frame
    row = torch.div(in_frame, width_tokens, rounding_mode="floor")
    col = in_frame - row * width_tokens
    angle_dtype = torch.float32 if positions.device.type == "mps" else torch.float64
    angles = []
    for index, dim in zip((frame, row, col), axes_dims):
        # The same expression as diffusers' get_1d_rotary_pos_embed (so positions < rope_max_seq_len
        # reproduce its table bit for bit).
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=angle_dtype, device=positions.device) / dim))
        angles.append(index.to(angle_dtype).unsqueeze(-1) * freqs)
    angle = torch.cat(angles, dim=-1)  # [streams, seq, head_dim / 2] (per head: [streams, seq, heads, head_dim / 2])
    cos = angle.cos().to(dtype).repeat_interleave(2, dim=-1)
    sin = angle.sin().to(dtype).repeat_interleave(2, dim=-1)
    if positions.dim() == 2:  # one table for every head: broadcast over them
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return cos, sin


# ---------------------------------------------------------------------------------------------- hook state


class _Active:
    """The forward the processors serve now (set around each model call, ``None`` otherwise)."""

    def __init__(self) -> None:
        self.forward: ForwardContext | None = None
        #: With relative sinks, per layer: the ``(cos, sin)`` tables at the layer's ``kv.sink_positions`` (set by
        #: the rope hook; layers sharing one sink-position tensor share one pair), else ``None``.
        self.sink_tables: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        #: The Ulysses group (``ardiff_modules.distributed.SequenceParallel``) of a distributed cache, or
        #: ``None``: with it the blocks run this rank's block of tokens and attend over head shards.
        self.sp: Any = None


def _distributed(name: str) -> Any:
    """``ardiff_modules.distributed.cache.<name>`` if that module was imported, else ``None``: nothing made by
    it can exist otherwise, and this module must not import torch.distributed for single-process users."""
    module = sys.modules.get("ardiff_modules.distributed.cache")
    return None if module is None else getattr(module, name)


def _is_distributed_forward(fwd: Any) -> bool:
    cls = _distributed("DistributedForward")
    return cls is not None and isinstance(fwd, cls)


def _local_sink_positions(sp: Any, kv: LayerContext, sink_positions: torch.Tensor) -> torch.Tensor:
    """Under Ulysses: this rank's tokens' sink positions for every query head (``sp.local_sink_positions``)."""
    return sp.local_sink_positions(kv) if hasattr(sp, "local_sink_positions") else sp.local_positions(sink_positions)


def _layer(active: _Active, index: int) -> LayerContext | None:
    fwd = active.forward
    return None if fwd is None else fwd.layers[index]


class PagedWanSelfAttnProcessor:
    """``attn1`` processor of block ``index``: absolute RoPE + :func:`chunk_attention` on the paged cache.

    Called by ``WanAttention.forward(hidden_states [streams, seq, dim], None, None, rotary_emb)``;
    ``rotary_emb`` is the ``(cos, sin)`` pair the model's (hooked) ``rope`` returned, each
    ``[streams, seq, 1, head_dim]``. Returns ``[streams, seq, dim]``. Outside a paged forward it
    delegates to ``fallback`` (diffusers' original processor).
    """

    def __init__(self, active: _Active, index: int, fallback: Any) -> None:
        self.active = active
        self.index = index
        self.fallback = fallback

    def __call__(
        self,
        attn: WanAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        kv = _layer(self.active, self.index)
        if kv is None:
            return self.fallback(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)
        if encoder_hidden_states is not None or attention_mask is not None or rotary_emb is None:
            raise SpecError(
                f"PagedWanSelfAttnProcessor (block {self.index}): expected the stock call (no encoder_hidden_states, "
                "no attention_mask -- use prepare_forward(token_mask=...) -- and the model's rotary_emb), got "
                f"encoder_hidden_states={encoder_hidden_states is not None}, "
                f"attention_mask={attention_mask is not None}, rotary_emb={rotary_emb is not None}"
            )
        if getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        cos, sin = rotary_emb
        sink_query = None
        if kv.forward.relative_sinks:  # the query at the layer's sinks' shifted positions (per head with groups)
            tables = self.active.sink_tables[self.index]
            assert tables is not None  # computed by the rope hook of the same forward
            sink_query = rotate(query, tables[0], tables[1], "interleaved")
        # diffusers' tables repeat each pair's value twice: the package's interleaved rotation.
        query = rotate(query, cos, sin, "interleaved")
        key = rotate(key, cos, sin, "interleaved")
        sp = self.active.sp
        if sp is None:
            out = chunk_attention(query, key, value, kv, sink_query=sink_query)
        elif sink_query is None:  # Ulysses: this rank's tokens in, head shards for attention, its tokens out
            out = sp.chunk_attention(query, key, value, kv)
        else:
            out = sp.chunk_attention(query, key, value, kv, sink_query=sink_query)
        out = out.flatten(2, 3).type_as(query)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)


class PagedWanCrossAttnProcessor:
    """``attn2`` processor of block ``index``: attends to the per-branch cached prompt (and image) K/V.

    ``hidden_states`` ``[streams, seq, dim]`` -> ``[streams, seq, dim]``; the model's
    ``encoder_hidden_states`` are ignored inside a paged forward (the caches hold their projections).
    """

    def __init__(self, active: _Active, index: int, fallback: Any, text_cache: str, image_cache: str | None) -> None:
        self.active = active
        self.index = index
        self.fallback = fallback
        self.text_cache = text_cache
        self.image_cache = image_cache

    def __call__(
        self,
        attn: WanAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        kv = _layer(self.active, self.index)
        if kv is None:
            return self.fallback(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)
        if attention_mask is not None:
            raise SpecError(
                f"PagedWanCrossAttnProcessor (block {self.index}): expected no attention_mask (the stock call), got one"
            )
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        sp = self.active.sp
        # Ulysses: the query to head shards once; text and image outputs summed there (a sum per head),
        # then back to this rank's tokens once (no all-to-all at all with cross_mode="tokens").
        q = query if sp is None else sp.heads_in(query)
        out = cached_cross_attention(q, kv, self.text_cache)
        if self.image_cache is not None:
            out = out + cached_cross_attention(q, kv, self.image_cache)
        out = (out if sp is None else sp.heads_out(out)).flatten(2, 3).type_as(query)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)


class _Activation:
    """Context manager of :meth:`PagedWanTransformer.activate`."""

    def __init__(self, active: _Active, fwd: ForwardContext) -> None:
        self.active = active
        self.fwd = fwd

    def __enter__(self) -> ForwardContext:
        if self.active.forward is not None:
            raise SpecError("PagedWanTransformer.activate: expected no forward active on this model, got one (nested)")
        self.active.forward = self.fwd
        return self.fwd

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.active.forward = None


# ---------------------------------------------------------------------------------------------- handle


class PagedWanTransformer:
    """A stock ``WanTransformer3DModel`` whose attention runs on the paged cache (see the module doc).

    Made by :func:`enable_paged_attention`. Call it once per forward prepared by
    ``state.prepare_forward`` / ``cache.prepare_forward``; it compiles with
    ``torch.compile(fullgraph=True)`` into one graph for a whole rollout.

    Attributes
    ----------
    model:
        The diffusers model (processors installed on every block's ``attn1`` / ``attn2``).
    spec:
        The cache spec the model was checked against (a distributed cache's global spec).
    sequence_parallel:
        The Ulysses group when made for a ``DistributedKVCache`` with an sp dimension (else ``None``):
        the model then takes and returns whole chunks of this rank's streams, and runs this rank's
        ``1 / P`` of the tokens through its blocks (see :func:`enable_paged_attention`).
    text_cache, image_cache:
        Names of the cross-attention caches read by ``attn2`` (``image_cache`` is ``None`` unless the
        model has image context, Wan I2V).
    """

    def __init__(
        self,
        model: _WanModel,
        spec: KVCacheSpec,
        *,
        text_cache: str,
        image_cache: str | None,
        rope_theta: float,
        cache_spec: KVCacheSpec | None = None,
        sequence_parallel: Any = None,
    ) -> None:
        self.model = model
        self.spec = spec
        #: The spec of the caches whose sessions this model serves (a distributed cache's per-rank spec).
        self.cache_spec = spec if cache_spec is None else cache_spec
        self.sequence_parallel = sequence_parallel
        self.text_cache = text_cache
        self.image_cache = image_cache
        self.rope_theta = rope_theta
        rope = model.rope
        self.axes_dims = (int(rope.t_dim), int(rope.h_dim), int(rope.w_dim))
        self.patch_size = tuple(int(p) for p in model.config.patch_size)
        self.text_dim = int(model.config.text_dim)
        self._active = _Active()
        self._active.sp = sequence_parallel
        self._block_hooks: list[Any] = []
        self._rope_hook: Any = None
        # diffusers' processors, restored by remove() and run outside a paged forward.
        self._originals: list[tuple[Any, Any]] = [(b.attn1.processor, b.attn2.processor) for b in model.blocks]
        try:
            for i, (block, (attn1, attn2)) in enumerate(zip(model.blocks, self._originals)):
                block.attn1.set_processor(PagedWanSelfAttnProcessor(self._active, i, attn1))
                block.attn2.set_processor(PagedWanCrossAttnProcessor(self._active, i, attn2, text_cache, image_cache))
            self._rope_hook = rope.register_forward_hook(self._rope_forward_hook)
            if sequence_parallel is not None:
                for i, block in enumerate(model.blocks):
                    hook = functools.partial(self._shard_block_inputs, first=i == 0)
                    self._block_hooks.append(block.register_forward_pre_hook(hook))
                self._block_hooks.append(model.blocks[-1].register_forward_hook(self._gather_block_output))
        except BaseException:
            self._restore_processors()
            for handle in [self._rope_hook, *self._block_hooks]:
                if handle is not None:
                    handle.remove()
            raise
        self._removed = False
        logger.debug(
            "enable_paged_attention: paged processors on %d blocks of %s (text cache %r, image cache %r)",
            len(model.blocks), type(model).__name__, text_cache, image_cache,
        )

    def __repr__(self) -> str:
        state = "removed" if self._removed else ("active" if self._active.forward is not None else "enabled")
        return (
            f"PagedWanTransformer(blocks={len(self.model.blocks)}, text_cache={self.text_cache!r}, "
            f"image_cache={self.image_cache!r}, status={state!r})"
        )

    # ------------------------------------------------------------------ RoPE
    def _rope_forward_hook(
        self, module: torch.nn.Module, args: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        fwd = self._active.forward
        if fwd is None:
            return None  # a plain diffusers call: the stock tables (frames from 0)
        (hidden_states,) = args
        _, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.patch_size
        tokens = (frames // p_t) * (height // p_h) * (width // p_w)
        positions = fwd.positions
        if positions.shape != (hidden_states.shape[0], tokens):
            raise TensorMismatchError(
                f"PagedWanTransformer hidden_states: expected [streams={positions.shape[0]}, C, F, H, W] with "
                f"(F/{p_t})*(H/{p_h})*(W/{p_w}) = {positions.shape[1]} tokens (the forward's seq_len), got "
                f"{tuple(hidden_states.shape)} ({tokens} tokens)"
            )
        # float32 at least: a model cast to bfloat16 also casts diffusers' tables (and would round them).
        dtype = torch.promote_types(output[0].dtype, torch.float32)
        sp = self._active.sp
        self._active.sink_tables = self._sink_tables(fwd, height // p_h, width // p_w, dtype)
        if sp is not None:  # the blocks see this rank's tokens: tables at their positions only
            positions = sp.local_positions(positions)
        return self.rope_tables(positions, height // p_h, width // p_w, dtype)

    def _sink_tables(
        self, fwd: ForwardContext, height_tokens: int, width_tokens: int, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per layer, the ``(cos, sin)`` tables at its ``kv.sink_positions`` (relative sinks; else ``None``s).

        Each layer's own: with retention groups the lanes' sinks move by their own shifts (per query head where
        a layer's lanes differ: tables ``[streams, seq, heads, dim]``). The layers of a forward share few
        distinct sink-position tensors: one pair per distinct tensor (by identity), so a uniform forward
        evaluates one pair as before. Under Ulysses with groups every layer gathers its own (a collective: the
        ranks' lanes, hence their distinct tensors, differ)."""
        if not fwd.relative_sinks:
            return [None] * len(fwd.layers)
        sp = self._active.sp
        seen: list[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = []
        tables: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for kv in fwd.layers:
            sink_positions = kv.sink_positions
            assert sink_positions is not None  # relative sinks: every layer has them
            shared = sp is None or not kv._shares
            pair = next((t for p, t in seen if p is sink_positions), None) if shared else None
            if pair is None:
                local = sink_positions if sp is None else _local_sink_positions(sp, kv, sink_positions)
                pair = self.rope_tables(local, height_tokens, width_tokens, dtype)
                seen.append((sink_positions, pair))
            tables.append(pair)
        return tables

    # ------------------------------------------------------------------ Ulysses
    def _shard_block_inputs(self, module: torch.nn.Module, args: tuple[Any, ...], *, first: bool) -> tuple[Any, ...] | None:
        """Pre-hook of every block (``block(hidden_states, encoder_hidden_states, temb, rotary_emb)``) under
        sequence parallelism: the first block takes this rank's tokens; a per-token ``temb`` (Wan2.2
        TI2V, ``[streams, seq, 6, dim]``) is sharded alike for every block."""
        sp = self._active.sp
        if self._active.forward is None or sp is None:
            return None
        if len(args) < 4:
            raise SpecError(
                "PagedWanTransformer: expected the stock block call block(hidden_states, encoder_hidden_states, temb, "
                f"rotary_emb) under sequence parallelism, got {len(args)} positional arguments"
            )
        hidden_states, encoder_hidden_states, temb, rotary_emb = args[:4]
        if first:
            hidden_states = sp.shard_tokens(hidden_states, dim=1)
        if isinstance(temb, torch.Tensor) and temb.dim() == 4 and temb.shape[1] > 1:  # [S, 1, 6, dim] broadcasts
            temb = sp.shard_tokens(temb, dim=1)
        return (hidden_states, encoder_hidden_states, temb, rotary_emb, *args[4:])

    def _gather_block_output(self, module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor | None:
        """Forward hook of the last block: every rank gets all tokens back for the output head."""
        sp = self._active.sp
        if self._active.forward is None or sp is None:
            return None
        return sp.gather_tokens(output, dim=1)

    def rope_tables(
        self, positions: torch.Tensor, height_tokens: int, width_tokens: int, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This model's RoPE at absolute ``positions`` (int64 ``[streams, seq]``): two ``[streams, seq, 1, dim]``
        (per head ``[streams, seq, heads]``: two ``[streams, seq, heads, dim]``)."""
        return wan_rope_tables(
            positions,
            height_tokens=height_tokens,
            width_tokens=width_tokens,
            axes_dims=self.axes_dims,
            theta=self.rope_theta,
            dtype=dtype,
        )

    # ------------------------------------------------------------------ prompts
    def project_prompt(
        self, encoder_hidden_states: torch.Tensor, image: bool = False
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every block's cross-attention ``(k, v)``, each ``[tokens, heads, head_dim]``, lazily in block order.

        ``encoder_hidden_states`` is ``[tokens, text_dim]`` or ``[1, tokens, text_dim]`` (the text
        encoder's output, before the model's ``text_embedder``); with ``image=True`` it is the image
        encoder's ``[tokens, image_dim]`` / ``[1, tokens, image_dim]`` (before ``image_embedder``).
        Validated now; each layer is projected (without autograd) when the iterator reaches it. Under
        sequence parallelism each ``(k, v)`` holds this rank's kv heads (what its cache stores).
        """
        context = encoder_hidden_states
        if isinstance(context, torch.Tensor) and context.dim() == 3 and context.shape[0] == 1:
            context = context[0]
        width = self.model.config.image_dim if image else self.text_dim
        if not isinstance(context, torch.Tensor) or context.dim() != 2 or context.shape[-1] != width:
            what = "encoder_hidden_states_image" if image else "encoder_hidden_states"
            is_tensor = isinstance(encoder_hidden_states, torch.Tensor)
            got = tuple(encoder_hidden_states.shape) if is_tensor else type(encoder_hidden_states).__name__
            raise TensorMismatchError(
                f"PagedWanTransformer.set_prompt {what}: expected [tokens, {width}] or [1, tokens, {width}], got {got}"
            )
        return self._projections(context, image)

    def _projections(self, context: torch.Tensor, image: bool) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        embedder = self.model.condition_embedder
        with torch.no_grad():  # the same embedder call as the model's forward: [1, tokens, dim]
            context = (embedder.image_embedder if image else embedder.text_embedder)(context.unsqueeze(0))
        for block in self.model.blocks:
            attn = block.attn2
            fused = getattr(attn, "fused_projections", False)
            with torch.no_grad():  # not held across the yield: grad mode is the caller's between layers
                if image:
                    kv = attn.to_added_kv(context).chunk(2, dim=-1) if fused else (
                        attn.add_k_proj(context), attn.add_v_proj(context)
                    )
                    key, value = attn.norm_added_k(kv[0]), kv[1]
                else:
                    kv = attn.to_kv(context).chunk(2, dim=-1) if fused else (attn.to_k(context), attn.to_v(context))
                    key, value = attn.norm_k(kv[0]), kv[1]
            key = rearrange(key[0], "n (h d) -> n h d", h=attn.heads)
            value = rearrange(value[0], "n (h d) -> n h d", h=attn.heads)
            sp = self._active.sp
            if sp is not None:  # this rank's cache holds its kv heads (all of them with cross_mode="tokens")
                key, value = sp.shard_kv_heads(key, attn.heads), sp.shard_kv_heads(value, attn.heads)
            yield key, value

    def set_prompt(
        self,
        state: KVState,
        branch: str,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_image: torch.Tensor | None = None,
    ) -> None:
        """Project a prompt once with the model's own layers and publish it for ``branch`` of ``state``.

        ``encoder_hidden_states``: ``[tokens, text_dim]`` or ``[1, tokens, text_dim]`` with ``tokens``
        the spec's text cache size (diffusers' Wan pipelines pad to 512). I2V models also need
        ``encoder_hidden_states_image`` (``[tokens, image_dim]`` / ``[1, tokens, image_dim]``, the image
        encoder's output). Each cache is published atomically (a failure keeps its previous prompt);
        text and image are two publications. A prompt switch is another ``set_prompt`` (history is kept).
        """
        if not isinstance(state, KVState):
            raise SpecError(f"PagedWanTransformer.set_prompt.state: expected a KVState, got {type(state).__name__}")
        if state.cache.spec is not self.cache_spec and state.cache.spec != self.cache_spec:
            raise SpecError("PagedWanTransformer.set_prompt.state: expected a session of a cache of this model's spec")
        if self.image_cache is None and encoder_hidden_states_image is not None:
            raise SpecError(
                "PagedWanTransformer.set_prompt: got encoder_hidden_states_image but the model has no image context "
                "(added_kv_proj_dim is None)"
            )
        if self.image_cache is not None:
            if encoder_hidden_states_image is None:
                raise SpecError(
                    "PagedWanTransformer.set_prompt: expected encoder_hidden_states_image (an I2V model's attn2 "
                    "reads the image cache too), got None"
                )
            image_kv = self.project_prompt(encoder_hidden_states_image, image=True)
            state.populate_cross_attention(branch, self.image_cache, image_kv)
        state.populate_cross_attention(branch, self.text_cache, self.project_prompt(encoder_hidden_states))

    # ------------------------------------------------------------------ forwards
    def activate(self, fwd: ForwardContext) -> _Activation:
        """Context manager: inside it, calls of ``self.model`` run on ``fwd`` (for callers of the model itself).

        ``with paged.activate(fwd): model(x, t, any_encoder_hidden_states)`` is what :meth:`__call__`
        does; the ``encoder_hidden_states`` given to the model are ignored by ``attn2``.
        """
        return _Activation(self._active, self._check_forward(fwd))

    def _check_forward(self, fwd: Any) -> ForwardContext:
        fwd = getattr(fwd, "context", fwd) if _is_distributed_forward(fwd) else fwd
        if self._removed:
            raise SpecError("PagedWanTransformer: expected an enabled hook, got one removed by remove()")
        if not isinstance(fwd, ForwardContext):
            raise SpecError(
                f"PagedWanTransformer: expected a ForwardContext (from prepare_forward), got {type(fwd).__name__}"
            )
        if len(fwd.layers) != len(self.model.blocks):
            raise SpecError(
                f"PagedWanTransformer: expected a forward of {len(self.model.blocks)} layers, got {len(fwd.layers)}"
            )
        return fwd

    def __call__(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        fwd: ForwardContext,
        *,
        attention_kwargs: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        """One model forward on the paged cache.

        Parameters
        ----------
        hidden_states:
            Latents ``[streams, C, F, H, W]``: stream ``i`` is stream ``i`` of ``fwd`` (e.g. cond, uncond);
            ``(F/p_t)(H/p_h)(W/p_w)`` is the forward's ``seq_len``.
        timestep:
            A tensor: ``[]`` (shared), ``[streams]``, or ``[streams, seq_len]`` (per token, Wan2.2 TI2V).
            A Python number is accepted too, but a tensor keeps a compiled step from recompiling.
        fwd:
            The open forward (``prepare_forward(...)``) of ``len(model.blocks)`` layers; for a model made
            for a ``DistributedKVCache``, that cache's forward (``hidden_states`` then holds this rank's
            streams, whole chunks -- ``mesh.local_streams(latents)``).

        Returns
        -------
        The model's output ``[streams, C_out, F, H, W]``.
        """
        fwd = self._check_forward(fwd)
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 5:
            is_tensor = isinstance(hidden_states, torch.Tensor)
            got = tuple(hidden_states.shape) if is_tensor else type(hidden_states).__name__
            raise TensorMismatchError(f"PagedWanTransformer hidden_states: expected [streams, C, F, H, W], got {got}")
        streams = hidden_states.shape[0]
        if hidden_states.device != fwd.positions.device:
            raise TensorMismatchError(
                f"PagedWanTransformer hidden_states: expected device {fwd.positions.device} (the cache's), got "
                f"{hidden_states.device}"
            )
        # NOTE: checked here, not left to the patch embedding: its conv would raise a bare RuntimeError.
        channels = int(self.model.config.in_channels)
        if hidden_states.shape[1] != channels:
            raise TensorMismatchError(
                f"PagedWanTransformer hidden_states: expected [streams, C={channels} (the model's in_channels), "
                f"F, H, W], got {tuple(hidden_states.shape)}"
            )
        dtype = self.model.patch_embedding.weight.dtype
        # A storage dtype (diffusers' layerwise casting to FP8) is upcast by hooks: only a compute dtype must match.
        if dtype in _COMPUTE_DTYPES and hidden_states.dtype != dtype and not torch.is_autocast_enabled(
            hidden_states.device.type
        ):
            raise TensorMismatchError(
                f"PagedWanTransformer hidden_states: expected dtype {dtype} (the model's; or run under autocast), "
                f"got {hidden_states.dtype}"
            )
        if not isinstance(timestep, torch.Tensor):
            timestep = torch.as_tensor(timestep, device=hidden_states.device)
        if timestep.dim() == 0:
            timestep = timestep.expand(streams)
        if timestep.shape[0] != streams or timestep.dim() > 2:
            raise TensorMismatchError(
                f"PagedWanTransformer timestep: expected [], [{streams}] or [{streams}, seq_len], got "
                f"{tuple(timestep.shape)}"
            )
        # attn2 reads the caches; the model still embeds some encoder_hidden_states: one zero token.
        dummy = hidden_states.new_zeros(streams, 1, self.text_dim)
        active = self._active
        if active.forward is not None:
            raise SpecError("PagedWanTransformer: expected no forward active on this model, got one (nested call)")
        active.forward = fwd
        try:
            out = self.model(
                hidden_states, timestep, dummy, attention_kwargs=attention_kwargs, return_dict=False
            )[0]
        finally:
            active.forward = None
        return out

    # ------------------------------------------------------------------ removal
    def _restore_processors(self) -> None:
        for block, (attn1, attn2) in zip(self.model.blocks, self._originals):
            block.attn1.set_processor(attn1)
            block.attn2.set_processor(attn2)

    def remove(self) -> None:
        """Restore diffusers' processors and RoPE; the model is the stock one again. Idempotent."""
        if self._removed:
            return
        self._rope_hook.remove()
        for handle in self._block_hooks:
            handle.remove()
        self._restore_processors()
        self._removed = True
        logger.debug("PagedWanTransformer.remove: diffusers' processors restored on %d blocks", len(self.model.blocks))


# ---------------------------------------------------------------------------------------------- factories


def _check_rope(model: _WanModel, theta: float) -> None:
    """Our tables equal the model's ``rope`` buffers over its first positions (else the theta is wrong)."""
    rope = model.rope
    n = min(int(rope.max_seq_len), 64)
    axes = (int(rope.t_dim), int(rope.h_dim), int(rope.w_dim))
    idx = torch.arange(n, device=rope.freqs_cos.device)
    offset = 0
    for axis, dim in enumerate(axes):
        # positions that walk axis `axis` only: frames, rows or columns 0..n-1
        height, width = (n, n) if axis == 0 else ((n, 1) if axis == 1 else (1, n))
        per_frame = height * width
        pos = idx * (per_frame if axis == 0 else (width if axis == 1 else 1))
        cos, sin = wan_rope_tables(
            pos[None], height_tokens=height, width_tokens=width, axes_dims=axes, theta=theta, dtype=rope.freqs_cos.dtype
        )
        want_cos = rope.freqs_cos[:n, offset : offset + dim]
        want_sin = rope.freqs_sin[:n, offset : offset + dim]
        got_cos, got_sin = cos[0, :, 0, offset : offset + dim], sin[0, :, 0, offset : offset + dim]
        atol = 1e-5 if rope.freqs_cos.dtype in (torch.float32, torch.float64) else 2e-2  # a model cast to bf16
        if not (torch.allclose(got_cos, want_cos, atol=atol) and torch.allclose(got_sin, want_sin, atol=atol)):
            raise SpecError(
                f"enable_paged_attention.rope_theta: expected the base of the model's rope tables, got {theta} "
                f"(axis {axis} differs from model.rope.freqs_cos/freqs_sin)"
            )
        offset += dim


def enable_paged_attention(
    model: _WanModel,
    spec_or_cache: KVCacheSpec | KVCache,
    *,
    text_cache: str = "text",
    image_cache: str = "image",
    rope_theta: float = 10000.0,
) -> PagedWanTransformer:
    """Install paged attention processors on every block of a stock diffusers ``WanTransformer3DModel``.

    Parameters
    ----------
    model:
        The diffusers model (any dtype / device; the cache must use the same).
    spec_or_cache:
        The :class:`KVCacheSpec` (or the :class:`KVCache`) whose forwards will run the model: one
        layer per block, ``num_kv_heads`` = the model's heads, ``head_dim`` = its
        ``attention_head_dim``, a cross-attention cache ``text_cache`` (and ``image_cache`` for I2V
        models). :func:`wan_cache_spec` builds one. Or a
        :class:`~ardiff_modules.distributed.DistributedKVCache` (checked against its global spec) for
        multi-GPU runs: call the handle with this rank's streams (``mesh.local_streams(latents)``,
        whole chunks) and a forward of that cache; with an sp dimension the model runs this rank's
        ``1 / P`` of the tokens through its blocks (sharded after the patch embedding, a per-token
        ``temb`` alike, RoPE at their positions, attention over head shards, gathered after the last
        block) and returns whole chunks on every rank; ``set_prompt`` publishes this rank's heads.
    text_cache, image_cache:
        Names of the cross-attention caches in the spec.
    rope_theta:
        RoPE base; checked against the model's ``rope`` tables.

    Returns
    -------
    The :class:`PagedWanTransformer` handle: call it per forward, ``set_prompt`` per branch,
    ``remove()`` to restore the stock processors.
    """
    owner = "enable_paged_attention"
    _check_model(owner, model)
    distributed_cache = _distributed("DistributedKVCache")
    cache_spec = None
    sp = None
    if distributed_cache is not None and isinstance(spec_or_cache, distributed_cache):
        spec, cache_spec, sp = spec_or_cache.global_spec, spec_or_cache.spec, spec_or_cache.mesh.sp
    else:
        spec = spec_or_cache.spec if isinstance(spec_or_cache, KVCache) else spec_or_cache
    if not isinstance(spec, KVCacheSpec):
        got = type(spec_or_cache).__name__
        raise SpecError(f"{owner}.spec_or_cache: expected a KVCacheSpec, a KVCache or a DistributedKVCache, got {got}")
    rope_theta = require_positive_float(f"{owner}.rope_theta", rope_theta)
    for block in model.blocks:
        for attn in (block.attn1, block.attn2):
            if isinstance(attn.processor, (PagedWanSelfAttnProcessor, PagedWanCrossAttnProcessor)):
                raise SpecError(f"{owner}: expected a model without paged processors, got one already enabled "
                                "(call remove() on its handle first)")
    config = model.config
    heads, head_dim = int(config.num_attention_heads), int(config.attention_head_dim)
    expected = {"num_layers": len(model.blocks), "num_kv_heads": heads, "query_heads": heads, "head_dim": head_dim}
    for field, value in expected.items():
        if getattr(spec, field) != value:
            raise SpecError(f"{owner}.spec.{field}: expected {value} (the model's), got {getattr(spec, field)}")
    caches = [(text_cache, "text_cache")]
    image = _has_image_context(model)
    if image:
        caches.append((image_cache, "image_cache"))
    for name, label in caches:
        if name not in spec.cross_attention_names:
            raise SpecError(
                f"{owner}.{label}: expected a cross-attention cache of the spec, one of {spec.cross_attention_names}, "
                f"got {name!r}"
            )
        cross = spec.cross_attention_spec(name)
        if (cross.num_kv_heads or spec.num_kv_heads, cross.head_dim or spec.head_dim) != (heads, head_dim):
            raise SpecError(
                f"{owner}: expected cross-attention cache {name!r} with {heads} heads of {head_dim}, got "
                f"{cross.num_kv_heads} heads of {cross.head_dim}"
            )
    _check_rope(model, rope_theta)
    if sp is not None:
        from ardiff_modules.distributed.heads import check_heads

        check_heads(owner, heads, heads, sp.size)
    return PagedWanTransformer(
        model, spec, text_cache=text_cache, image_cache=image_cache if image else None, rope_theta=rope_theta,
        cache_spec=cache_spec, sequence_parallel=sp,
    )


def wan_cache_spec(
    model: _WanModel,
    *,
    frames_per_chunk: int,
    latent_height: int,
    latent_width: int,
    text_tokens: int = 512,
    image_tokens: int | None = None,
    page_size: int | None = None,
    text_cache: str = "text",
    image_cache: str = "image",
    **spec_kwargs: Any,
) -> KVCacheSpec:
    """A :class:`KVCacheSpec` for ``model`` streaming chunks of ``frames_per_chunk`` latent frames.

    ``chunk_size = (frames_per_chunk / p_t) * (latent_height / p_h) * (latent_width / p_w)`` tokens;
    ``page_size`` defaults to one latent frame's tokens. ``text_tokens`` is the text cache's size
    (512 in diffusers' Wan pipelines); I2V models need ``image_tokens`` (the image embedder's output
    length, e.g. 257). Other keyword arguments (``sink_chunks``, ``window_chunks``, ``branches``,
    ``dtype``, ``kv_dtype``, ``retention``) go to :class:`KVCacheSpec`.
    """
    owner = "wan_cache_spec"
    _check_model(owner, model)
    p_t, p_h, p_w = (int(p) for p in model.config.patch_size)
    for name, value, patch in (
        ("frames_per_chunk", frames_per_chunk, p_t),
        ("latent_height", latent_height, p_h),
        ("latent_width", latent_width, p_w),
    ):
        require_int(f"{owner}.{name}", value, minimum=1)
        if value % patch:
            raise SpecError(f"{owner}.{name}: expected a multiple of the patch size {patch}, got {value}")
    per_frame = (latent_height // p_h) * (latent_width // p_w)
    chunk_size = (frames_per_chunk // p_t) * per_frame
    if page_size is None:
        page_size = per_frame
    if not is_int(page_size):
        raise SpecError(f"{owner}.page_size: expected an int, got {page_size!r}")
    heads, head_dim = int(model.config.num_attention_heads), int(model.config.attention_head_dim)
    cross = [CrossAttentionSpec(text_cache, text_tokens)]
    if _has_image_context(model):
        if image_tokens is None:
            raise SpecError(f"{owner}.image_tokens: expected the image context length of this I2V model, got None")
        cross.append(CrossAttentionSpec(image_cache, image_tokens))
    elif image_tokens is not None:
        raise SpecError(f"{owner}.image_tokens: expected None (the model has no image context), got {image_tokens!r}")
    return KVCacheSpec(
        num_layers=len(model.blocks),
        num_kv_heads=heads,
        head_dim=head_dim,
        chunk_size=chunk_size,
        page_size=page_size,
        cross_attention=tuple(cross),
        **spec_kwargs,
    )
