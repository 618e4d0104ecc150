"""Self-Forcing's own ``CausalWanModel`` and inference loop over the paged KV cache, unchanged.

One call replaces every block's ``self_attn`` and returns the driver of the cache session::

    from ardiff_modules.integrations.self_forcing import swap_self_attention

    spec = am.KVCacheSpec(num_layers=30, num_kv_heads=12, head_dim=128, chunk_size=3 * 1560, page_size=120,
                          branches=("video",), dtype="bfloat16")      # Self-Forcing's local_attn_size=-1, F=3
    sf = swap_self_attention(pipeline.generator.model, spec, budget_bytes=16 << 30)
    video = pipeline.inference(noise, text_prompts)                  # CausalInferencePipeline, as it is
    sf.finish()                                                      # commit the last chunk's clean forward

Each new ``self_attn`` is a :class:`SelfForcingSelfAttention`: a
:class:`~ardiff_modules.ChunkSelfAttention` made with ``from_wan`` from the block's upstream
``CausalWanSelfAttention`` (same parameter names, so the model's ``state_dict`` and checkpoint loading are
unchanged) whose ``forward`` takes upstream's arguments exactly: ``x, seq_lens, grid_sizes, freqs,
block_mask, kv_cache, current_start, cache_start``.

The binding rule (how upstream's calls become the library's transactional forwards)
-----------------------------------------------------------------------------------
Every model forward is one forward over the pending chunk, prepared by block 0's layer (host work once
per model forward; the other blocks read their layer's context from the shared
:class:`SelfForcingSession`). By its ``current_start`` (tokens, ``frame * frame_seq_length``):

- **the open forward's start**: the open forward is aborted and reopened (a denoising step, or the clean
  re-run: upstream overwrites the chunk's slots each time, so the last overwrite wins);
- **the open start + its length**: the open forward is committed (it was the chunk's clean re-run), then
  the next chunk's forward opens;
- **0** (a new video; after a **replaced** ``kv_cache`` the only start accepted): the session is reset
  (the open forward aborted, the history dropped);
- anything else (a skipped or rewound chunk, a start off the chunk boundaries): refused with
  :class:`~ardiff_modules.errors.StreamPositionError` naming the starts expected.

CausVid (the same ``CausalWanModel`` family) binds the same way: its blocks pass ``current_end`` where
Self-Forcing's pass ``cache_start`` (ignored), its ``kv_cache`` dicts hold ``k`` / ``v`` only and a second video
simply starts again at ``current_start=0`` (a new video: the session is reset), and its attention is global (the
window check expects ``sink_size=0``, ``local_attn_size=-1``).

Image-to-video and video extension run as upstream calls them: ``inference(noise, prompts, initial_latent)``
runs each input block once at timestep 0 (the binding rule commits it when the next block starts), and with
``independent_first_frame`` the video's first chunk is one frame (the image, or a generated first frame: blocks of
``[1, F, F, ...]``). A chunk shorter than ``chunk_size`` is accepted only at ``current_start=0`` (a multiple of
``page_size`` tokens; the spec's policy from ``SinkWindowPolicy.from_frames(..., independent_first_frame=True)``:
sinks and windows count chunks, whatever their lengths).

The last chunk's clean forward stays open until :meth:`SelfForcingSession.finish` commits it (or the
next video resets the session). A replaced ``kv_cache`` is what ``CausalInferencePipeline`` does between
videos: it puts new ``global_end_index`` tensors into the dicts; the layers compare block 0's dict and
that entry by identity (no device read).

What is left to upstream, and what is ignored
---------------------------------------------
- **Cross-attention stays upstream's**: only ``self_attn`` is swapped; each block's ``cross_attn`` keeps
  filling and reading its ``crossattn_cache`` dict as before (and projects the text live, with gradients, where
  upstream's checkpointed blocks pass no ``crossattn_cache``).
- **Training** (``SelfForcingTrainingPipeline``, gradient checkpointing on or off) runs unedited: forwards with
  gradients are held by a scope of the session's own, upstream's history gradients by default
  (``history_grad="straight_through"``), and a recomputation under upstream's own ``torch.utils.checkpoint`` call
  reads the call it recomputes (:mod:`~ardiff_modules.integrations.self_forcing_grad`).
- ``kv_cache``'s tensors are neither read nor written (the K/V live in the paged pool): the pipeline may
  keep allocating them, or pass small placeholder dicts. ``kv_cache=None`` (upstream's cache-free
  training path) is refused.
- ``seq_lens``, ``block_mask`` (the cache-free path's mask) and ``cache_start`` (unused by upstream's
  cached path too) are accepted and ignored.
- **RoPE** is upstream's: each forward's ``(cos, sin)`` comes from the ``freqs`` table it is given, at
  frames ``current_start // (h * w) ..`` and the rows / columns of ``grid_sizes``, as upstream's
  ``causal_rope_apply`` indexes it (computed once per model forward), and by default q and k are rotated as
  upstream rotates them: in float64 (its complex128 product), rounded once to the model's dtype
  (:class:`UpstreamRotation`). The library's own rotation (float32 tables and product, ``rotate``'s rule) is
  about an ulp per rotation away, which a training rollout grows to 1.6e-5 relative on a parameter gradient;
  the integration exists to match upstream, so it pays upstream's float64 (an elementwise pass over q and k per
  layer, as upstream's). ``rope_dtype=torch.float32`` picks the library's rotation instead (cheaper on GPUs
  with slow float64; not upstream's numerics). Nothing outside the integration changes: ``apply_rope`` /
  ``ChunkSelfAttention`` keep rotating in float32 (float64 for a float64 model).

Self-Forcing's hard-coded sizes go into the spec: its 30 blocks are ``num_layers``, its 12 x 128 cache
shape ``num_kv_heads`` x ``head_dim``, ``frame_seq_length`` (1560) times ``num_frame_per_block`` is
``chunk_size``; ``sink_size`` / ``local_attn_size`` (frames) become chunks with
:meth:`~ardiff_modules.SinkWindowPolicy.from_frames`, checked against the upstream modules' own values on
the first forward (``check_window=False`` to run another rule on purpose). Each batch row of upstream's
``x`` is one branch of the session (``branches``, in order; batch ``B`` = ``len(branches)``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import nn

from ardiff_modules.cache import KVCache
from ardiff_modules.checks import is_int
from ardiff_modules.context import ForwardContext, LayerContext
from ardiff_modules.core.retention import SinkWindowPolicy
from ardiff_modules.errors import (
    ForwardFinishedError,
    SequenceLengthError,
    SessionClosedError,
    SpecError,
    StreamPositionError,
    TensorMismatchError,
    UnknownBranchError,
)
from ardiff_modules.integrations.self_forcing_grad import SessionTraining
from ardiff_modules.modules import ChunkSelfAttention, Rope
from ardiff_modules.modules.functional import rotate
from ardiff_modules.session import KVState
from ardiff_modules.spec import KVCacheSpec
from ardiff_modules.training import HistoryGrad, in_recomputation
from ardiff_modules.training.straight_through import check_history_grad

__all__ = [
    "SelfForcingSelfAttention", "SelfForcingSession", "UpstreamRotation", "self_forcing_rope", "swap_layers",
    "swap_self_attention",
]

#: ``(cos, sin)``, each ``[1, seq_len, 1, head_dim]`` (interleaved pairs): one forward's RoPE.
RopePair = tuple[torch.Tensor, torch.Tensor]
#: The dtypes ``rope_dtype`` takes: upstream's float64 rotation, or the library's float32 one.
ROPE_DTYPES = (torch.float64, torch.float32)


class UpstreamRotation:
    """Upstream's ``causal_rope_apply`` rotation of one forward, as a RoPE callable ``(t, positions) -> t``.

    ``t`` is turned in float64 by float64 ``cos`` / ``sin`` (``[1, seq_len, 1, head_dim]``, interleaved pairs,
    from :func:`self_forcing_rope`) and rounded once to ``t``'s dtype: the product upstream computes as
    ``view_as_complex(x.to(float64)) * freqs`` (complex128), term for term (``a c - b d``, ``b c + a d``), and
    its backward likewise in float64. ``positions`` is ignored (the tables are the forward's own).
    """

    __slots__ = ("cos", "sin")

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        if cos.dtype != torch.float64 or sin.dtype != torch.float64:
            raise TensorMismatchError(
                f"UpstreamRotation: expected float64 cos / sin (upstream's complex128 table), got {cos.dtype} / "
                f"{sin.dtype}"
            )
        self.cos, self.sin = cos, sin

    def __call__(self, t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return rotate(t.to(torch.float64), self.cos, self.sin).to(t.dtype)

    def __repr__(self) -> str:
        return f"UpstreamRotation(seq_len={self.cos.shape[1]}, head_dim={self.cos.shape[-1]})"


def self_forcing_rope(freqs: torch.Tensor, grid: tuple[int, int, int], start_frame: int, *, device: torch.device,
                      dtype: torch.dtype) -> RopePair:
    """Upstream's RoPE of one chunk as a ``(cos, sin)`` pair for :func:`~ardiff_modules.apply_rope`.

    ``freqs``: Wan's complex table ``[rows, head_dim // 2]`` (time, row and column sub-tables side by
    side: ``c - 2 (c // 3)``, ``c // 3``, ``c // 3`` columns of ``c = head_dim // 2``); ``grid`` the chunk's
    ``(frames, height, width)`` in tokens; token ``(f, r, w)`` of the chunk turns by the time table at frame
    ``start_frame + f``, the row table at ``r`` and the column table at ``w``. Returns cos and sin
    ``[1, f * h * w, 1, head_dim]``, each pair's value repeated twice (``"interleaved"``), in ``dtype``
    (float32; float64 for a float64 model), on ``device``.
    """
    if not isinstance(freqs, torch.Tensor) or freqs.dim() != 2 or not freqs.is_complex():
        got = f"{tuple(freqs.shape)} {freqs.dtype}" if isinstance(freqs, torch.Tensor) else type(freqs).__name__
        raise TensorMismatchError(f"self_forcing_rope freqs: expected a complex [rows, head_dim // 2] table, got {got}")
    frames, height, width = grid
    rows, c = freqs.shape
    needed = max(start_frame + frames, height, width)
    if needed > rows:
        raise TensorMismatchError(
            f"self_forcing_rope freqs: expected at least {needed} rows (frames {start_frame}.."
            f"{start_frame + frames - 1}, a {height}x{width} grid), got {rows}"
        )
    time, row, col = freqs.split([c - 2 * (c // 3), c // 3, c // 3], dim=1)
    per_frame = height * width
    token = torch.arange(frames * per_frame, device=freqs.device)
    frame_of, inner = token // per_frame, token % per_frame
    angles = torch.cat([time[start_frame + frame_of], row[inner // width], col[inner % width]], dim=-1)
    angles = angles.to(device=device, dtype=torch.complex128)  # [seq_len, c]
    cos = angles.real.repeat_interleave(2, dim=-1).to(dtype)
    sin = angles.imag.repeat_interleave(2, dim=-1).to(dtype)
    return cos[None, :, None], sin[None, :, None]


class SelfForcingSelfAttention(ChunkSelfAttention):
    """A :class:`~ardiff_modules.ChunkSelfAttention` called the way Self-Forcing calls its
    ``CausalWanSelfAttention``; made by :func:`swap_self_attention` (``from_wan`` of the upstream module,
    then bound to the model's :class:`SelfForcingSession` as layer ``layer_index``).

    NOTE: a subclass, not a wrapper holding the layer as a child: a child would prefix every key of the
    block's state dict (``self_attn.layer.q.weight``) and the checkpoint would no longer load as it is.
    """

    session: SelfForcingSession | None = None
    layer_index: int = 0

    def bind(self, session: SelfForcingSession, layer_index: int) -> None:
        """Attend through ``session``'s forwards as layer ``layer_index`` (0 prepares each model forward)."""
        self.session, self.layer_index = session, layer_index

    def bound_session(self) -> SelfForcingSession:
        """The session this layer attends through; :class:`SpecError` for a layer never bound."""
        if self.session is None:
            raise SpecError(
                f"{type(self).__name__}: expected a layer bound to a SelfForcingSession (made by "
                "swap_self_attention), got an unbound one"
            )
        return self.session

    def forward(  # type: ignore[override]  # upstream's signature, on purpose
        self,
        x: torch.Tensor,
        seq_lens: Any,
        grid_sizes: torch.Tensor,
        freqs: torch.Tensor,
        block_mask: Any,
        kv_cache: Any = None,
        current_start: int = 0,
        cache_start: int | None = None,
    ) -> torch.Tensor:
        """``x`` ``[B, L, dim]`` (B = the session's branches, L = one chunk) -> ``[B, L, dim]``.

        ``grid_sizes`` int ``[B, 3]`` (frames, height, width of the chunk in tokens, on the CPU as
        upstream makes it), ``freqs`` Wan's complex RoPE table, ``kv_cache`` this block's dict (only block
        0's identity is read), ``current_start`` the chunk's first token. ``seq_lens``, ``block_mask`` and
        ``cache_start`` are ignored.
        """
        session = self.bound_session()
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters())):
            return self._forward_with_grad(session, x, grid_sizes, freqs, kv_cache, current_start)
        if self.layer_index == 0:
            session.advance(x, grid_sizes, freqs, kv_cache, current_start)
        kv, rope = session.layer(self.layer_index, x, current_start)
        return super().forward(x, kv, rope)

    def _forward_with_grad(self, session: SelfForcingSession, x: torch.Tensor, grid_sizes: torch.Tensor,
                           freqs: torch.Tensor, kv_cache: Any, current_start: int) -> torch.Tensor:
        """:meth:`forward` in grad mode: a first call (recorded for its recomputation), or a checkpoint's
        recomputation in backward (which reads the recorded call, never the session's open forward)."""
        attend = super().forward
        if in_recomputation():
            return session.training.recompute(attend, self.layer_index, x, kv_cache, current_start)
        if self.layer_index == 0:
            session.advance(x, grid_sizes, freqs, kv_cache, current_start)
        kv, rope = session.layer(self.layer_index, x, current_start)
        return session.training.run(attend, self.layer_index, x, kv, rope, kv_cache, current_start)


@dataclass
class OpenForward:
    """The model forward in progress: where it starts, how long it is, its context and RoPE."""

    start: int
    seq_len: int
    forward: ForwardContext
    rope: Rope  #: an :class:`UpstreamRotation`, or a float32 ``(cos, sin)`` pair (``rope_dtype=torch.float32``)


class SelfForcingSession:
    """The cache session one swapped model drives, and the forward its current chunk is in.

    Made by :func:`swap_self_attention`. Block 0's layer calls :meth:`advance` once per model forward
    (the binding rule of the module docstring); every layer reads its context with :meth:`layer`.
    """

    def __init__(
        self, cache: KVCache, *, branches: Sequence[str] | None = None, owns_cache: bool = False,
        upstream_window: tuple[int, int] | None = None, history_grad: HistoryGrad = "straight_through",
        rope_dtype: torch.dtype = torch.float64,
    ) -> None:
        check_history_grad("SelfForcingSession", history_grad)
        check_rope_dtype("SelfForcingSession", rope_dtype)
        if cache.spec.relative_sinks:
            raise SpecError(
                "SelfForcingSession: expected a spec with relative_sinks=False (Self-Forcing attends its sinks at "
                "their own positions), got relative_sinks=True"
            )
        self.branches = _branches(cache.spec, branches)  # checked before the session opens: nothing to undo
        self.cache = cache
        self.state: KVState = cache.open_session()
        self.owns_cache = owns_cache
        #: upstream's ``(sink_size, local_attn_size)`` in frames, checked on the first forward (None: not).
        self.upstream_window = upstream_window
        self._short_first = False  # whether this video's first chunk was shorter (image-to-video)
        self._open: OpenForward | None = None
        self._marker: tuple[Any, Any] | None = None  # block 0's kv_cache dict and its global_end_index
        self._closed = False
        #: Forwards with gradients: the session's training scope and the calls a recomputation finds again.
        self.training = SessionTraining(cache, history_grad)
        #: How q and k are rotated: float64 (upstream's product, :class:`UpstreamRotation`) or float32 (the library's).
        self.rope_dtype = rope_dtype

    def __repr__(self) -> str:
        opened = "none" if self._open is None else f"start={self._open.start}, seq_len={self._open.seq_len}"
        return (f"SelfForcingSession(branches={self.branches}, committed_tokens={self.committed_tokens}, "
                f"open=({opened}), closed={self._closed})")

    # ------------------------------------------------------------------ what users read
    @property
    def forward(self) -> ForwardContext | None:
        """The open forward (the chunk being denoised or its clean re-run), or ``None``."""
        return self._open.forward if self._open is not None else None

    @property
    def current_start(self) -> int | None:
        """``current_start`` of the open forward, or ``None``."""
        return self._open.start if self._open is not None else None

    @property
    def committed_tokens(self) -> int:
        """Tokens committed per branch so far (evicted ones counted): where the next chunk starts."""
        return 0 if self._closed else self.state.token_offset(self.branches[0])

    @property
    def is_closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ called by the layers
    def advance(self, x: torch.Tensor, grid_sizes: torch.Tensor, freqs: torch.Tensor, kv_cache: Any,
                current_start: int) -> None:
        """Block 0 of a model forward: finish the open forward per the binding rule, open this one."""
        self._check_open("advance")
        start = self._start(current_start)
        seq_len = self._check_input(x, start)
        grid = self._grid(grid_sizes, seq_len)
        replaced = self._kv_cache_replaced(kv_cache)
        self._check_window(grid[0], seq_len, start)
        rope = self._rotation(self._rope_tables(freqs, grid, start, x))
        self._settle(start, seq_len, replaced)  # the first change: every check above raised before it
        forward = self.state.prepare_forward(self.branches, seq_len, commit_current=True)
        if any(offset != start for offset in forward.token_offsets):
            forward.abort()
            raise StreamPositionError(
                f"SelfForcingSession: expected the session's branches at token {start}, got {forward.token_offsets}"
            )
        self._open = OpenForward(start, seq_len, forward, rope)
        self._marker = (kv_cache, kv_cache.get("global_end_index") if isinstance(kv_cache, Mapping) else None)

    def layer(self, index: int, x: torch.Tensor, current_start: int) -> tuple[LayerContext, Rope]:
        """Layer ``index``'s context in the open forward and the forward's RoPE pair."""
        self._check_open("layer")
        opened = self._open
        if opened is None:
            raise ForwardFinishedError(
                f"SelfForcingSelfAttention (layer {index}): expected block 0 to have opened the model forward, "
                "got none open (a block called on its own, or after finish())"
            )
        if current_start != opened.start:
            raise StreamPositionError(
                f"SelfForcingSelfAttention (layer {index}): expected current_start={opened.start} (the model "
                f"forward block 0 opened), got {current_start!r}"
            )
        if x.dim() != 3 or x.shape[1] != opened.seq_len:
            raise SequenceLengthError(
                f"SelfForcingSelfAttention (layer {index}): expected x of {opened.seq_len} tokens [B, L, dim], "
                f"got {tuple(x.shape)}"
            )
        return opened.forward.layers[index], opened.rope

    def _rope_tables(self, freqs: torch.Tensor, grid: tuple[int, int, int], start: int, x: torch.Tensor) -> RopePair:
        """The forward's ``(cos, sin)``: float64 for upstream's rotation (or a float64 model), else float32."""
        upstream = self.rope_dtype == torch.float64 or x.dtype == torch.float64
        dtype = torch.float64 if upstream else torch.float32
        return self_forcing_rope(freqs, grid, start // (grid[1] * grid[2]), device=x.device, dtype=dtype)

    @staticmethod
    def _rotation(tables: RopePair) -> Rope:
        """What the layers rotate with: float64 tables as upstream's product, float32 ones as the library's pair."""
        return UpstreamRotation(*tables) if tables[0].dtype == torch.float64 else tables

    # ------------------------------------------------------------------ the binding rule
    def _settle(self, start: int, seq_len: int, replaced: bool) -> None:
        """Finish the open forward as ``start`` says: re-run (abort), next chunk (commit) or new video (reset)."""
        opened = self._open
        following = opened.start + opened.seq_len if opened is not None else self.committed_tokens
        if replaced and start != 0:
            raise StreamPositionError(
                f"SelfForcingSession: expected current_start=0 after the kv_cache was reset (block 0's dict or "
                f"its global_end_index replaced, as between videos), got {start}"
            )
        if opened is not None and start == opened.start and not replaced:
            if seq_len != opened.seq_len:
                raise SequenceLengthError(
                    f"SelfForcingSession: expected a re-run of the chunk at {start} to be {opened.seq_len} tokens, "
                    f"got {seq_len}"
                )
            self._finish(success=False)  # a later overwrite of the same slots: the last one wins
        elif start == following and not replaced:
            self._finish(success=True)  # the open forward was the chunk's clean re-run
        elif start == 0:
            self.reset()  # a new video
        else:
            expected: dict[int, str] = {}  # the first reason of each start, in this order
            if opened is not None:
                expected[opened.start] = "a re-run of the open chunk"
            expected.setdefault(following, "the next chunk")
            expected.setdefault(0, "a new video")
            listed = ", ".join(f"{where} ({what})" for where, what in expected.items())
            raise StreamPositionError(f"SelfForcingSession: expected current_start {listed}, got {start}")

    def _finish(self, success: bool) -> None:
        opened, self._open = self._open, None  # cleared first: a refused commit leaves nothing open
        if opened is None:
            return
        if success:
            opened.forward.commit()
        else:
            opened.forward.abort()

    # ------------------------------------------------------------------ checks (host ints only)
    def _check_open(self, what: str) -> None:
        if self._closed:
            raise SessionClosedError(f"SelfForcingSession.{what}: expected an open session, got one closed by close()")

    @staticmethod
    def _start(current_start: Any) -> int:
        if isinstance(current_start, torch.Tensor) and current_start.numel() == 1:
            current_start = int(current_start)  # one read per model forward (upstream passes an int)
        if not is_int(current_start) or current_start < 0:
            raise StreamPositionError(f"SelfForcingSession: expected current_start an int >= 0, got {current_start!r}")
        return int(current_start)

    def _check_input(self, x: Any, start: int) -> int:
        """``x``'s tokens: one chunk, or at ``current_start=0`` a shorter first chunk (image-to-video's independent
        first frame: upstream's ``independent_first_frame``, with or without ``initial_latent``)."""
        spec = self.cache.spec
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[0] != len(self.branches):
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise TensorMismatchError(
                f"SelfForcingSelfAttention x: expected [{len(self.branches)} (one row per branch {self.branches}), "
                f"seq_len, dim], got {got}"
            )
        tokens = int(x.shape[1])
        first_short = start == 0 and 0 < tokens < spec.chunk_size and tokens % spec.page_size == 0
        if tokens != spec.chunk_size and not first_short:
            raise SequenceLengthError(
                f"SelfForcingSelfAttention x: expected one chunk of chunk_size={spec.chunk_size} tokens "
                f"(num_frame_per_block x frame_seq_length), or at current_start=0 a shorter first chunk of a multiple "
                f"of page_size={spec.page_size} tokens (image-to-video's independent first frame), got {tokens} "
                f"tokens at current_start={start}"
            )
        return tokens

    @staticmethod
    def _grid(grid_sizes: Any, seq_len: int) -> tuple[int, int, int]:
        rows = grid_sizes.tolist() if isinstance(grid_sizes, torch.Tensor) else None
        if not rows or any(not isinstance(r, list) or len(r) != 3 for r in rows) or any(r != rows[0] for r in rows):
            got = tuple(grid_sizes.shape) if isinstance(grid_sizes, torch.Tensor) else type(grid_sizes).__name__
            raise TensorMismatchError(
                f"SelfForcingSelfAttention grid_sizes: expected an int [B, 3] tensor of one (frames, height, width) "
                f"for every row, got {rows if rows is not None else got}"
            )
        frames, height, width = (int(v) for v in rows[0])
        if frames * height * width != seq_len:
            raise TensorMismatchError(
                f"SelfForcingSelfAttention grid_sizes: expected frames x height x width = {seq_len} tokens, got "
                f"{frames} x {height} x {width}"
            )
        return frames, height, width

    def _kv_cache_replaced(self, kv_cache: Any) -> bool:
        if kv_cache is None:
            raise SpecError(
                "SelfForcingSelfAttention: expected kv_cache (a dict per block: the cached inference path), got None "
                "(upstream's cache-free training path is not bound)"
            )
        if self._marker is None:
            return False
        entry = kv_cache.get("global_end_index") if isinstance(kv_cache, Mapping) else None
        return kv_cache is not self._marker[0] or entry is not self._marker[1]

    def _check_window(self, frames_per_chunk: int, seq_len: int, start: int) -> None:
        """Once, at the first full chunk: the spec's sink + window must be upstream's rolling buffer at this chunk
        length (with a 1-frame first chunk when the video began with one: image-to-video)."""
        if self.upstream_window is None:
            return
        if start == 0:
            self._short_first = seq_len < self.cache.spec.chunk_size
        if seq_len < self.cache.spec.chunk_size:
            return  # the short first chunk says nothing of F: checked at the next chunk
        sink_size, local_attn_size = self.upstream_window
        spec = self.cache.spec
        expected = SinkWindowPolicy.from_frames(
            sink_size=sink_size, local_attn_size=local_attn_size, frames_per_chunk=frames_per_chunk,
            independent_first_frame=self._short_first,
        )
        # retention groups: every group's policy (a map with other rules runs with check_window=False)
        groups = spec.head_retention.groups if spec.head_retention is not None else {"": spec.policy}
        policy = next((p for p in groups.values() if p != expected), expected)
        if policy != expected:
            first = ", after a 1-frame first chunk" if self._short_first else ""
            raise SpecError(
                f"SelfForcingSession: expected the spec's retention to be upstream's buffer (sink_size={sink_size}, "
                f"local_attn_size={local_attn_size} frames, {frames_per_chunk} per chunk{first}: {expected}), got "
                f"{policy}; pass check_window=False to swap_self_attention to run another rule on purpose"
            )
        self.upstream_window = None

    # ------------------------------------------------------------------ lifetime
    def finish(self) -> None:
        """Commit the open forward (the last chunk's clean re-run). No-op when none is open."""
        self._check_open("finish")
        self._finish(success=True)

    def reset(self) -> None:
        """Abort the open forward and drop the session's history: the next chunk starts at 0."""
        self._check_open("reset")
        self._finish(success=False)
        self.training.end()
        self.state.reset()
        self._marker = None

    def close(self) -> None:
        """Abort the open forward, close the session (and the cache :func:`swap_self_attention` made).

        Idempotent; every later call of the layers raises :class:`~ardiff_modules.errors.SessionClosedError`.
        """
        if self._closed:
            return
        self._finish(success=False)
        self.training.end()
        self.state.close()
        if self.owns_cache:
            self.cache.close()
        self._closed = True

    def __enter__(self) -> SelfForcingSession:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Commit the last chunk on success (abort on an exception), then :meth:`close`."""
        try:
            if exc_type is None and not self._closed:
                self.finish()
        finally:
            self.close()


def swap_self_attention(
    model: nn.Module,
    cache_or_spec: KVCache | KVCacheSpec,
    *,
    branches: Sequence[str] | None = None,
    num_pages: int | None = None,
    budget_bytes: int | None = None,
    backend: str = "auto",
    check_window: bool = True,
    history_grad: HistoryGrad = "straight_through",
    rope_dtype: torch.dtype = torch.float64,
) -> SelfForcingSession:
    """Replace ``model.blocks[i].self_attn`` (Self-Forcing's ``CausalWanSelfAttention``) by
    :class:`SelfForcingSelfAttention` layers driven by one new :class:`SelfForcingSession`.

    ``cache_or_spec``: a :class:`KVCache` (the session opens in it), or a :class:`KVCacheSpec` for a cache
    made on the model's device (``num_pages`` / ``budget_bytes``; default: one session's peak,
    ``spec.pages_per_branch() x len(branches)``, which needs a bounded window) and closed with the
    session. ``branches``: the session's branches, one per batch row (default ``spec.branches``).
    ``check_window``: on the first forward, refuse a spec whose sink + window is not the upstream modules'
    ``sink_size`` / ``local_attn_size`` buffer. ``history_grad``: how forwards with gradients (training) treat
    the history they read, when no :class:`~ardiff_modules.TrainingScope` of the cache is active around them
    (see :mod:`~ardiff_modules.integrations.self_forcing_grad`): ``"straight_through"`` (upstream's
    ``SelfForcingTrainingPipeline``: later chunks' losses reach earlier chunks' exit-step K/V) or ``"detached"``.
    ``rope_dtype``: ``torch.float64`` rotates q and k as upstream does (its complex128 product, rounded once:
    :class:`UpstreamRotation`; upstream's gradients to 1e-5 through a training rollout), ``torch.float32`` with the
    library's float32 rotation (an ulp per rotation off upstream; no float64 pass on the GPU).
    Every layer is made before any is swapped: a refusal (:class:`SpecError` naming expected and actual) leaves
    the model as it was.
    """
    check_history_grad("swap_self_attention", history_grad)
    check_rope_dtype("swap_self_attention", rope_dtype)
    return swap_layers(
        model, cache_or_spec, SelfForcingSelfAttention, SelfForcingSession, branches=branches, num_pages=num_pages,
        budget_bytes=budget_bytes, backend=backend, check_window=check_window, history_grad=history_grad,
        rope_dtype=rope_dtype,
    )


def check_rope_dtype(owner: str, rope_dtype: Any) -> torch.dtype:
    """``rope_dtype`` is ``torch.float64`` (upstream's rotation) or ``torch.float32``; :class:`SpecError` otherwise."""
    if not isinstance(rope_dtype, torch.dtype) or rope_dtype not in ROPE_DTYPES:
        raise SpecError(
            f"{owner}.rope_dtype: expected torch.float64 (upstream's float64 rotation) or torch.float32 (the "
            f"library's), got {rope_dtype!r}"
        )
    return rope_dtype


def swap_layers(
    model: nn.Module,
    cache_or_spec: KVCache | KVCacheSpec,
    layer_type: type[SelfForcingSelfAttention],
    session_type: type[SelfForcingSession],
    *,
    branches: Sequence[str] | None,
    num_pages: int | None,
    budget_bytes: int | None,
    backend: str,
    check_window: bool,
    peak_pending_chunks: int = 1,
    history_grad: HistoryGrad | None = None,
    rope_dtype: torch.dtype | None = None,
) -> Any:
    """:func:`swap_self_attention` with the layer and session types of an integration (LongLive's too).

    ``peak_pending_chunks``: the pending chunks per branch the default ``num_pages`` makes room for (a
    re-cache rebuilds more than one chunk beside the history it replaces). Returns the ``session_type``.
    """
    blocks = getattr(model, "blocks", None)
    upstream: list[Any] = [getattr(b, "self_attn", None) for b in blocks] if isinstance(blocks, nn.ModuleList) else []
    if not upstream or not all(isinstance(m, nn.Module) for m in upstream):
        raise SpecError(
            f"swap_self_attention: expected a CausalWanModel-shaped model (model.blocks[i].self_attn), got "
            f"{type(model).__name__}"
        )
    if any(isinstance(m, SelfForcingSelfAttention) for m in upstream):
        raise SpecError("swap_self_attention: expected upstream self-attention modules, got a model already swapped")
    weights = list(upstream[0].parameters())
    device = weights[0].device if weights else torch.device("cpu")  # the cache lives where the model does
    cache, owns = _cache_for(cache_or_spec, device, branches, num_pages, budget_bytes, backend, peak_pending_chunks)
    try:
        layers = [_adapter(layer_type, m) for m in upstream]
        _check_geometry(cache, layers)
        window = _upstream_window(upstream[0]) if check_window else None
        extra: dict[str, Any] = {} if history_grad is None else {"history_grad": history_grad}
        if rope_dtype is not None:
            extra["rope_dtype"] = rope_dtype
        session = session_type(cache, branches=branches, owns_cache=owns, upstream_window=window, **extra)
    except BaseException:
        if owns:
            cache.close()
        raise
    assert isinstance(blocks, nn.ModuleList)  # upstream was read from it
    for index, layer in enumerate(layers):
        layer.bind(session, index)
        blocks[index].self_attn = layer
    return session


def _adapter(layer_type: type[SelfForcingSelfAttention], module: nn.Module) -> SelfForcingSelfAttention:
    """``from_wan`` of one upstream ``CausalWanSelfAttention``: a copy of its weights, its names, its device."""
    layer = layer_type.from_wan(module)
    assert isinstance(layer, layer_type)  # from_wan builds ``cls``
    return layer


def _cache_for(
    cache_or_spec: Any, device: torch.device, branches: Sequence[str] | None, num_pages: int | None,
    budget_bytes: int | None, backend: str, peak_pending_chunks: int = 1,
) -> tuple[KVCache, bool]:
    """The cache to open the session in, and whether it was made here (then the session closes it)."""
    if isinstance(cache_or_spec, KVCache):
        if num_pages is not None or budget_bytes is not None:
            raise SpecError(
                "swap_self_attention: expected num_pages / budget_bytes only with a KVCacheSpec (a KVCache has its "
                f"pool), got num_pages={num_pages}, budget_bytes={budget_bytes}"
            )
        return cache_or_spec, False
    if not isinstance(cache_or_spec, KVCacheSpec):
        raise SpecError(f"swap_self_attention: expected a KVCache or a KVCacheSpec, got {type(cache_or_spec).__name__}")
    spec = cache_or_spec
    if num_pages is None and budget_bytes is None:
        per_branch = spec.pages_per_branch(peak_pending_chunks)
        if per_branch is None:
            raise SpecError(
                "swap_self_attention: expected num_pages or budget_bytes for an unbounded window (window_chunks=None, "
                "Self-Forcing's local_attn_size=-1), got neither"
            )
        num_pages = per_branch * len(_branches(spec, branches))
    return KVCache(spec, num_pages=num_pages, budget_bytes=budget_bytes, device=device, backend=backend), True


def _branches(spec: KVCacheSpec, branches: Sequence[str] | None) -> tuple[str, ...]:
    """The session's branches, one per batch row: distinct names of the spec's branches."""
    names = spec.branches if branches is None else tuple(branches) if not isinstance(branches, str) else (branches,)
    if not names or len(set(names)) != len(names):
        raise SpecError(f"SelfForcingSession.branches: expected distinct branch names, one per batch row, got {names}")
    unknown = [b for b in names if b not in spec.branches]
    if unknown:
        raise UnknownBranchError(f"SelfForcingSession.branches: expected names from {spec.branches}, got {unknown}")
    return names


def _check_geometry(cache: KVCache, layers: Sequence[ChunkSelfAttention]) -> None:
    spec = cache.spec
    if len(layers) != spec.num_layers:
        raise SpecError(
            f"swap_self_attention: expected a model of spec.num_layers={spec.num_layers} blocks (Self-Forcing's "
            f"num_transformer_blocks), got {len(layers)}"
        )
    expected = (spec.num_qo_heads or spec.num_kv_heads, spec.num_kv_heads, spec.head_dim)
    for index, layer in enumerate(layers):
        got = (layer.num_heads, layer.num_kv_heads, layer.head_dim)
        if got != expected:
            raise SpecError(
                f"swap_self_attention: expected self-attention of (heads, kv_heads, head_dim)={expected} (the spec; "
                f"Self-Forcing's 12 x 128 cache shape), got {got} in block {index}"
            )
    weight = layers[0].to_q.weight
    if weight.dtype != cache.dtype or weight.device != cache.device:
        raise SpecError(
            f"swap_self_attention: expected the model on the cache's {cache.device} / {cache.dtype}, got "
            f"{weight.device} / {weight.dtype}"
        )


def _upstream_window(module: nn.Module) -> tuple[int, int] | None:
    """Upstream's ``(sink_size, local_attn_size)`` in frames, when the module carries them.

    NOTE: CausVid's ``CausalWanSelfAttention`` carries ``window_size`` and neither of them: its cached path always
    attends everything written so far (no sink, no rolling), which is ``(0, -1)``.
    """
    sink_size, local_attn_size = getattr(module, "sink_size", None), getattr(module, "local_attn_size", None)
    if is_int(sink_size) and is_int(local_attn_size):
        return int(sink_size), int(local_attn_size)  # type: ignore[arg-type]  # is_int: not None
    if sink_size is None and local_attn_size is None and hasattr(module, "window_size"):
        return 0, -1
    return None
