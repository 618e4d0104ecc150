"""``ChunkSelfAttention``: self-attention over the current chunk(s) and the cached sink + window history."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from ardiff_modules.context import LayerContext
from ardiff_modules.errors import SpecError
from ardiff_modules.modules.common import (
    QKNorm,
    check_input,
    check_layer_context,
    check_options,
    head_geometry,
    merge_heads,
    apply_qk_norm,
    split_heads,
)
from ardiff_modules.modules.functional import (
    Rope,
    RopeLayout,
    check_rope_layout,
    apply_rope,
    chunk_attention,
    rotate,
)
from ardiff_modules.modules.loading import copy_from_source, CheckpointLayer, read_source, SourceConfig
from ardiff_modules.modules.naming import ParamNames
from ardiff_modules.modules.rotary import check_rope_inputs, RotaryBase


class SequenceParallelHook(Protocol):
    """What a layer's ``sequence_parallel`` attribute provides (``ardiff_modules.distributed.SequenceParallel``).

    With it set, the layer's input ``x`` holds this rank's tokens of the chunk (``seq_len / P``), and the
    hook moves q/k/v to head shards around attention (Ulysses). ``None`` (default): one process.
    """

    def local_positions(self, positions: torch.Tensor) -> torch.Tensor: ...

    def chunk_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerContext,
        *,
        scale: float | None = None,
        sink_query: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def heads_in(self, q: torch.Tensor) -> torch.Tensor: ...

    def heads_out(self, out: torch.Tensor) -> torch.Tensor: ...

    def shard_kv_heads(self, t: torch.Tensor, num_heads: int, dim: int = -2) -> torch.Tensor: ...


class ChunkSelfAttention(CheckpointLayer):
    """Self-attention over the current chunk(s) and the cached sink + window history.

    Projects Q/K/V, optionally RMS-normalises Q and K, applies the RoPE hook at
    the tokens' absolute positions (``kv.positions``), writes K/V into the
    pending pages and attends per the visibility rule, then projects out.

    Parameters
    ----------
    dim:
        Model width.
    num_heads:
        Query heads.
    num_kv_heads:
        K/V heads (GQA when fewer than ``num_heads``); default ``num_heads``.
    head_dim:
        Default ``dim // num_heads``.
    qk_norm:
        ``None``, ``"full"`` (RMSNorm over ``heads * head_dim``, as Wan and diffusers'
        ``rms_norm_across_heads``) or ``"head"``.
    param_names:
        Submodule names: ``"ardiff"`` (``to_q, to_k, to_v, to_out``), ``"wan"`` (``q, k, v, o``) or
        ``"diffusers"`` (``to_q, to_k, to_v, to_out.0``); ``norm_q`` / ``norm_k`` in all three.
    rope_layout:
        Pair layout used when ``forward`` gets a ``(cos, sin)`` pair as ``rope`` (a RoPE module
        carries its own): ``"interleaved"`` (default; Wan / diffusers) or ``"half"``.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        qk_norm: QKNorm = None,
        bias: bool = True,
        eps: float = 1e-6,
        param_names: ParamNames = "ardiff",
        rope_layout: RopeLayout = "interleaved",
    ) -> None:
        super().__init__()
        owner = "ChunkSelfAttention"
        self.num_kv_heads, self.head_dim = head_geometry(owner, dim, num_heads, num_kv_heads, head_dim)
        self.eps = check_options(owner, bias, eps)
        self._init_names(owner, param_names)
        self.rope_layout = check_rope_layout(f"{owner}.rope_layout", rope_layout)
        self.dim = dim
        self.num_heads = num_heads
        self.qk_norm = qk_norm
        self.norm_q = apply_qk_norm(owner, qk_norm, num_heads, self.head_dim, self.eps)
        self.norm_k = apply_qk_norm(owner, qk_norm, self.num_kv_heads, self.head_dim, self.eps)
        self._register("q", nn.Linear(dim, num_heads * self.head_dim, bias=bias))
        self._register("k", nn.Linear(dim, self.num_kv_heads * self.head_dim, bias=bias))
        self._register("v", nn.Linear(dim, self.num_kv_heads * self.head_dim, bias=bias))
        self._register("o", nn.Linear(num_heads * self.head_dim, dim, bias=bias))
        #: Ulysses hook (``ardiff_modules.distributed.parallelize`` sets it); ``None``: single process.
        self.sequence_parallel: SequenceParallelHook | None = None

    @classmethod
    def from_wan(
        cls, module: nn.Module, *, param_names: ParamNames = "wan", rope_layout: RopeLayout = "interleaved"
    ) -> ChunkSelfAttention:
        """A layer equal to a Wan2.1 ``WanSelfAttention`` (or Self-Forcing / CausVid / LongLive's causal
        port: ``q, k, v, o`` Linears, ``norm_q`` / ``norm_k`` RMSNorm or Identity, ``num_heads``),
        holding a copy of its weights on its device and dtype.

        With the default ``param_names="wan"`` the layer's ``state_dict()`` keys equal the module's, so
        ``block.self_attn = ChunkSelfAttention.from_wan(block.self_attn)`` keeps the model's checkpoint
        loading with ``strict=True``. Use a :class:`~ardiff_modules.modules.rotary.VideoRotaryEmbedding`
        (interleaved, as Wan) as its ``rope``.
        """
        owner = "ChunkSelfAttention.from_wan"
        config = read_source(owner, module, "wan", "num_heads", cross=False)
        return cls._from_source(owner, module, "wan", config, param_names, rope_layout)

    @classmethod
    def from_diffusers(
        cls, module: nn.Module, *, param_names: ParamNames = "diffusers", rope_layout: RopeLayout = "interleaved"
    ) -> ChunkSelfAttention:
        """A layer equal to a diffusers ``WanAttention`` self-attention (``attn1``: ``to_q, to_k, to_v,
        to_out.0``, ``norm_q`` / ``norm_k``, ``heads``), holding a copy of its weights.

        With the default ``param_names="diffusers"`` the layer's ``state_dict()`` keys equal the module's
        (fused ``to_qkv`` copies are not carried over). Of a fused module (``fuse_projections()``) the
        layer copies the fused ``to_qkv`` it runs, split into ``to_q, to_k, to_v`` (the unfused ones may
        be stale or deleted).
        """
        owner = "ChunkSelfAttention.from_diffusers"
        if getattr(module, "is_cross_attention", False) is True:
            raise SpecError(f"{owner}: expected a self-attention WanAttention (attn1), got a cross-attention one")
        config = read_source(owner, module, "diffusers", "heads", cross=False)
        return cls._from_source(owner, module, "diffusers", config, param_names, rope_layout)

    @classmethod
    def _from_source(
        cls, owner: str, module: nn.Module, source: str, c: SourceConfig, param_names: Any, rope_layout: Any
    ) -> ChunkSelfAttention:
        with torch.device("meta"):
            layer = cls(
                c.dim, c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, qk_norm=c.qk_norm,
                bias=c.bias, eps=c.eps, param_names=param_names, rope_layout=rope_layout,
            )
        return copy_from_source(owner, layer, module, source)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``[streams, seq_len, dim]`` -> normalised ``q`` ``[streams, seq_len, heads, head_dim]`` and
        ``k``, ``v`` ``[streams, seq_len, kv_heads, head_dim]``, before RoPE (what models with their own
        attention path, and oracles, reuse)."""
        q = split_heads(self.to_q(x), self.num_heads, self.head_dim, self.qk_norm, self.norm_q)
        k = split_heads(self.to_k(x), self.num_kv_heads, self.head_dim, self.qk_norm, self.norm_k)
        v = split_heads(self.to_v(x), self.num_kv_heads, self.head_dim)
        return q, k, v

    def forward(self, x: torch.Tensor, kv: LayerContext, rope: Rope | None = None) -> torch.Tensor:
        """``x`` ``[streams, seq_len, dim]`` -> ``[streams, seq_len, dim]``.

        ``rope``: a RoPE module / callable ``(t, positions) -> t`` evaluated at ``kv.positions``, or a
        ``(cos, sin)`` pair broadcastable to ``[streams, seq_len, 1, head_dim]`` in ``rope_layout``.
        """
        check_input("ChunkSelfAttention", "x", x, "[streams, seq_len, dim]", self.dim, self.to_q.weight)
        check_layer_context("ChunkSelfAttention", kv, "forward")
        q, k, v = self.project(x)
        positions = kv.forward.positions
        sp = self.sequence_parallel
        if sp is not None:  # x holds this rank's tokens: RoPE at their positions, attention over head shards
            positions = sp.local_positions(positions)
        sink_positions = _sink_positions(kv)
        if sink_positions is not None and sp is not None:  # this rank's tokens (every query head: see the hook)
            sink_positions = _local_sink_positions(sp, kv, sink_positions)
        sink_query: torch.Tensor | None
        # the shared table needs the package's rotation itself (a subclass overriding forward goes the generic way)
        if sink_positions is not None and isinstance(rope, RotaryBase) and type(rope).forward is RotaryBase.forward:
            q, k, sink_query = self._rotate_with_sink_query(q, k, positions, sink_positions, rope)
        else:
            sink_query = self._sink_query(q, sink_positions, rope)
            q = apply_rope(q, positions, rope, layout=self.rope_layout)
            k = apply_rope(k, positions, rope, layout=self.rope_layout)
        if sp is None:
            out = chunk_attention(q, k, v, kv, sink_query=sink_query)
        elif sink_query is None:  # a hook written before relative sinks need not know the keyword
            out = sp.chunk_attention(q, k, v, kv)
        else:
            out = sp.chunk_attention(q, k, v, kv, sink_query=sink_query)
        return self.to_out(merge_heads(out))

    @staticmethod
    def _rotate_with_sink_query(
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        sink_positions: torch.Tensor,
        rope: RotaryBase,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q, k, sink query)`` rotated from one ``(cos, sin)`` table over both position sets.

        NOTE: one table read by the q and k rotations is what lets inductor compute it once: a table
        read by a single rotation (the sink query's) was inlined into that fused norm + RoPE kernel and
        its float64 cos / sin recomputed for every head -- 60x slower on an H200 at the Wan2.1-1.3B shape.
        ``positions`` / ``sink_positions``: this rank's tokens' under sequence parallelism.
        """
        check_rope_inputs(type(rope).__name__, q, positions, rope.head_dim)  # what rope.forward checks
        check_rope_inputs(type(rope).__name__, k, positions, rope.head_dim)
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        if sink_positions.dim() == 3:  # per query head (retention groups whose lanes' shifts differ)
            check_rope_inputs(type(rope).__name__, q, sink_positions, rope.head_dim)
            cos, sin = rope.cos_sin(positions, compute)  # [S, n, 1, D]
            sink_cos, sink_sin = rope.cos_sin(sink_positions, compute)  # [S, n, H, 1, D]
            sink_query = rotate(q, sink_cos.squeeze(-2), sink_sin.squeeze(-2), rope.layout)
            return rotate(q, cos, sin, rope.layout), rotate(k, cos, sin, rope.layout), sink_query
        streams = positions.shape[0]
        cos, sin = rope.cos_sin(torch.cat([positions, sink_positions]), compute)  # [2 S, n, 1, D]
        both = rotate(torch.cat([q, q]), cos, sin, rope.layout)
        k = rotate(k, cos[:streams], sin[:streams], rope.layout)
        return both[:streams], k, both[streams:]

    def _sink_query(self, q: torch.Tensor, sink_positions: torch.Tensor | None, rope: Rope | None) -> torch.Tensor | None:
        """With relative sinks: ``q`` rotated at ``sink_positions`` (the layer's ``kv.sink_positions``, this rank's
        tokens under sequence parallelism: the query the sinks are attended with; per query head where the layer's
        retention-group lanes differ)."""
        if sink_positions is None:
            return None
        if rope is not None and not callable(rope):
            raise SpecError(
                "ChunkSelfAttention: expected a RoPE module or callable with relative_sinks (the layer rotates the "
                "sink query at kv.sink_positions), got a (cos, sin) pair evaluated at kv.positions only; pass a "
                "callable, or call chunk_attention(..., sink_query=...) with your own rotation"
            )
        return apply_rope(q, sink_positions, rope, layout=self.rope_layout)

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"qk_norm={self.qk_norm!r}, param_names={self.param_names!r}, rope_layout={self.rope_layout!r}"
        )


def _local_sink_positions(sp: SequenceParallelHook, kv: LayerContext, sink_positions: torch.Tensor) -> torch.Tensor:
    """This rank's tokens' sink positions for every query head: the hook's ``local_sink_positions(kv)`` (retention
    groups: other ranks' lanes' shifts gathered), or ``local_positions`` for a hook that predates it."""
    local = getattr(sp, "local_sink_positions", None)
    return sp.local_positions(sink_positions) if local is None else local(kv)


def _sink_positions(kv: LayerContext) -> torch.Tensor | None:
    """The layer's sink positions (per query head where its retention-group lanes' sinks move by different
    shifts); a stand-in layer context without them (a peer's, duck-typed) gives its forward's."""
    return kv.sink_positions if hasattr(kv, "sink_positions") else kv.forward.sink_positions
