"""The reference Wan model (``ardiff_modules.models.wan_causal_dit``) run three ways with autograd, for the
Self-Forcing training parity tests (issue 27, item 4).

All three run the *same* model object (same weights) through one interface, :class:`WanRunner`:
``set_prompt(texts)``, ``forward(latents, timestep, commit) -> flow``, ``reset()``. Only the K/V cache
differs:

* :class:`LibraryWan` -- the library: one session per batch row (branch ``"cond"``), one batched
  ``cache.prepare_forward`` per model call, the reference backend.
* :class:`CacheFreeWan` -- a cache-free recomputation: each committed chunk's per-layer K/V kept in plain
  lists (detached); a forward attends to the sink chunks, the last ``window`` committed chunks after them
  and its own chunk's K/V, live.
* :class:`RollingBufferWan` -- Self-Forcing's rolling contiguous buffer in *frames* (``sink_size`` +
  ``local_attn_size`` frames, the current chunk counted; ``tests.support.rolling_buffer`` re-states it):
  per layer a zero-initialised ``[streams, local_attn_size * tokens_per_frame, heads, head_dim]`` buffer with
  a global and a local end index; a forward that starts a new chunk rolls the non-sink part left by a copy
  when the chunk does not fit; every forward writes its chunk's K/V at the local end (denoising forwards
  overwrite the same slots, the clean forward is the last overwrite) and attends to the buffer up to it.
  The buffer is written in place under ``no_grad``, so the chunk's K/V are attended as the live tensors
  concatenated after the buffer's older part (the buffer's own copy of them is only what later chunks read).

The peers plug into the model without editing it: each block gets a stand-in layer context
(:class:`PeerLayer`: ``.forward.positions``, ``.forward.sink_positions = None``, ``.k_cache``,
``cross_kv(name)``; the prompt's K/V projected once under ``no_grad`` with ``block.cross.project_kv``, as
``populate_cross_attention`` publishes them) and, while a peer's forward runs, the ``chunk_attention`` that
``ChunkSelfAttention`` calls is replaced (:func:`peer_attention`) by one that hands stand-in contexts to
their peer and every other context to the library.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol
from unittest import mock

import torch
import torch.nn.functional as F

import ardiff_modules as am
from ardiff_modules.models.wan_causal_dit import TEXT, WanCausalDiT, make_kv_spec
from ardiff_modules.modules import self_attention

BRANCH = "cond"  #: CFG off: every batch row is one session's single branch


class WanRunner(Protocol):
    """What a Self-Forcing rollout drives: the model over some K/V cache."""

    def set_prompt(self, texts: Sequence[torch.Tensor]) -> None:
        """One text-encoder state ``[tokens, text_dim]`` per batch row."""

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor, commit: bool) -> torch.Tensor:
        """``latents`` ``[streams, frames, C, H, W]`` of the current chunk, ``timestep`` ``[streams, frames]``
        -> the flow prediction ``[streams, frames, C, H, W]``; ``commit``: the chunk joins the history."""

    def reset(self) -> None:
        """Forget the history (a new video); the prompt is kept."""


class LibraryWan:
    """The model over the library's paged cache: batch row ``i`` is session ``i``'s branch ``"cond"``."""

    def __init__(self, model: WanCausalDiT, streams: int, num_pages: int, live_text: bool = False) -> None:
        self.model = model
        spec = make_kv_spec(model.config, branches=(BRANCH,))
        self.cache = am.KVCache(spec, num_pages=num_pages, backend="reference")
        self.states = [self.cache.open_session(f"video{i}") for i in range(streams)]
        #: forwards with gradients embed and project the text live (``WanCausalDiT.forward(text=...)``)
        self.live_text = live_text
        self.texts: torch.Tensor | None = None

    def set_prompt(self, texts: Sequence[torch.Tensor]) -> None:
        self.texts = torch.stack(list(texts))
        blocks = [b.cross for b in self.model.blocks]
        with torch.no_grad():
            for state, text in zip(self.states, texts, strict=True):
                state.clear_cross_attention()
                am.populate_cross_attention(state, BRANCH, blocks, self.model.embed_text(text))

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor, commit: bool) -> torch.Tensor:
        tokens = latents.shape[1] * self.model.config.tokens_per_frame
        streams = [(state, BRANCH) for state in self.states]
        with self.cache.prepare_forward(streams, tokens, commit_current=commit) as fwd:
            return self.model(latents, timestep, fwd.layers, text=self.texts if self.live_text else None)

    def reset(self) -> None:
        for state in self.states:
            state.reset(keep_cross_attention=(TEXT,))


def poison_free_pages(cache: am.KVCache) -> int:
    """What reuse would do to the pages nobody holds: every free page now reads NaN. Returns their count."""
    free = list(cache._allocator.free_pages())
    cache._pool.kv[:, :, free] = float("nan")
    return len(free)


@contextmanager
def poisoned_before_backward(cache: am.KVCache) -> Iterator[list[int]]:
    """``Tensor.backward`` first overwrites every free page of ``cache`` with NaN (what reuse would leave there);
    yields the list of pages poisoned at each backward."""
    poisoned: list[int] = []
    real = torch.Tensor.backward

    def backward(self: torch.Tensor, *args: object, **kwargs: object) -> None:
        poisoned.append(poison_free_pages(cache))
        real(self, *args, **kwargs)

    with mock.patch.object(torch.Tensor, "backward", backward):
        yield poisoned


# ---------------------------------------------------------------------------------------------------
# The peers' stand-in layer contexts.


@dataclass(eq=False)
class PeerForward:
    """What ``ChunkSelfAttention`` reads from ``kv.forward``: absolute positions ``[streams, tokens]``."""

    positions: torch.Tensor
    sink_positions: None = None


@dataclass(eq=False)
class PeerLayer:
    """A stand-in ``LayerContext`` of one block for a peer's forward."""

    peer: CachePeer
    layer_index: int
    forward: PeerForward
    cross: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    #: ``check_layer_context`` asks for the attribute only (the peer keeps its own K/V).
    k_cache: None = None

    def cross_kv(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt's K and V ``[streams, tokens, heads, head_dim]`` of this layer."""
        return self.cross[name]


@contextmanager
def peer_attention() -> Iterator[None]:
    """While active, ``ChunkSelfAttention`` hands :class:`PeerLayer` contexts to their peer's ``attend``."""
    library = self_attention.chunk_attention

    def dispatch(q, k, v, kv, *, scale=None, return_lse=False, sink_query=None):  # noqa: ANN001, ANN202
        if not isinstance(kv, PeerLayer):
            return library(q, k, v, kv, scale=scale, return_lse=return_lse, sink_query=sink_query)
        if scale is not None or return_lse or sink_query is not None:
            raise NotImplementedError("the peers attend with the default scale, no LSE, no relative sinks")
        return kv.peer.attend(kv.layer_index, q, k, v)

    with mock.patch.object(self_attention, "chunk_attention", dispatch):
        yield


def attend_live(q: torch.Tensor, history_k: torch.Tensor, history_v: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
    """One stream: ``q`` ``[1, n, H, D]`` over ``[history ; live]`` keys (``[1, h, Hkv, D]`` then ``[1, n, Hkv, D]``),
    every key visible (one chunk per forward) -> ``[1, n, H, D]``."""
    keys = torch.cat([history_k, k], dim=1).transpose(1, 2)
    values = torch.cat([history_v, v], dim=1).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


class CachePeer(abc.ABC):
    """The model over a peer's own K/V store; one chunk per forward, batch rows in lock step."""

    def __init__(self, model: WanCausalDiT, streams: int) -> None:
        self.model, self.streams = model, streams
        self.cross: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer, [streams, tokens, heads, dim]
        self.start = 0  #: tokens committed so far: the absolute position of the chunk being denoised
        #: forwards with gradients embed and project the text live (the cross-attention's context path)
        self.live_text = False
        self.texts: torch.Tensor | None = None

    def set_prompt(self, texts: Sequence[torch.Tensor]) -> None:
        if len(texts) != self.streams:
            raise ValueError(f"set_prompt: expected {self.streams} prompts, got {len(texts)}")
        self.texts = torch.stack(list(texts))
        with torch.no_grad():  # published once: a constant, like the library's cross cache
            contexts = [self.model.embed_text(t) for t in texts]
            self.cross = []
            for block in self.model.blocks:
                pairs = [block.cross.project_kv(c) for c in contexts]
                self.cross.append((torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])))

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor, commit: bool) -> torch.Tensor:
        n = latents.shape[1] * self.model.config.tokens_per_frame
        positions = torch.arange(self.start, self.start + n).expand(self.streams, n)
        fwd = PeerForward(positions)
        layers = [PeerLayer(self, i, fwd, {TEXT: pair}) for i, pair in enumerate(self.cross)]
        with peer_attention():
            out = self.model(latents, timestep, layers, text=self.texts if self.live_text else None)
        if commit:
            self.commit()
            self.start += n
        return out

    @abc.abstractmethod
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s attention of the current chunk: ``q`` ``[S, n, H, D]``, rotated ``k``, ``v``
        ``[S, n, Hkv, D]`` -> ``[S, n, H, D]``."""

    @abc.abstractmethod
    def commit(self) -> None:
        """The chunk of the forward that just ran joins the history."""

    def reset(self) -> None:
        self.start = 0


class CacheFreeWan(CachePeer):
    """Cache-free recomputation: committed chunks' K/V in plain lists, visibility by list slicing."""

    def __init__(self, model: WanCausalDiT, streams: int, sink_chunks: int, window_chunks: int) -> None:
        super().__init__(model, streams)
        self.sink, self.window = sink_chunks, window_chunks
        #: per stream, per committed chunk, per layer: (k, v) ``[tokens, Hkv, D]``, detached
        self.committed: list[list[list[tuple[torch.Tensor, torch.Tensor]]]] = [[] for _ in range(streams)]
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> the last forward's K/V

    def visible(self, stream: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        chunks = self.committed[stream]
        rest = chunks[self.sink:]
        return chunks[: self.sink] + rest[max(0, len(rest) - self.window):]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.pending[layer] = (k.detach(), v.detach())
        outs = []
        for s in range(self.streams):
            history = self.visible(s)
            hk = torch.cat([c[layer][0] for c in history] + [k.new_zeros((0, *k.shape[2:]))])[None]
            hv = torch.cat([c[layer][1] for c in history] + [v.new_zeros((0, *v.shape[2:]))])[None]
            outs.append(attend_live(q[s : s + 1], hk, hv, k[s : s + 1], v[s : s + 1]))
        return torch.cat(outs)

    def commit(self) -> None:
        layers = [self.pending[i] for i in range(len(self.model.blocks))]
        for s in range(self.streams):
            self.committed[s].append([(k[s], v[s]) for k, v in layers])

    def reset(self) -> None:
        super().reset()
        self.committed = [[] for _ in range(self.streams)]


@dataclass(eq=False)
class RollingLayer:
    """One layer's contiguous buffers and Self-Forcing's two indices (tokens)."""

    k: torch.Tensor  # [S, buffer_tokens, Hkv, D]
    v: torch.Tensor
    global_end: int = 0  # tokens ever written, up to the last forward's end
    local_end: int = 0  # where that forward's tokens end in the buffer


class RollingBufferWan(CachePeer):
    """Self-Forcing's rolling KV buffer in frames (``sink_size``, ``local_attn_size`` frames, current chunk counted)."""

    def __init__(self, model: WanCausalDiT, streams: int, sink_size: int, local_attn_size: int) -> None:
        super().__init__(model, streams)
        tpf = model.config.tokens_per_frame
        self.sink_tokens, self.buffer_tokens = sink_size * tpf, local_attn_size * tpf
        self.layers: list[RollingLayer] = []
        self.reset()

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        buf, n = self.layers[layer], k.shape[1]
        end = self.start + n
        with torch.no_grad():  # the buffer is a constant written in place, as in every peer
            evicted = 0
            if end > buf.global_end and buf.local_end + n > self.buffer_tokens:  # a new chunk that does not fit
                evicted = buf.local_end + n - self.buffer_tokens  # roll the non-sink part left by that much
                rolled = buf.local_end - evicted - self.sink_tokens
                keep = slice(self.sink_tokens + evicted, self.sink_tokens + evicted + rolled)
                for t in (buf.k, buf.v):
                    t[:, self.sink_tokens : self.sink_tokens + rolled] = t[:, keep].clone()
            local_end = buf.local_end + end - buf.global_end - evicted
            buf.k[:, local_end - n : local_end] = k.detach()
            buf.v[:, local_end - n : local_end] = v.detach()
            buf.global_end, buf.local_end = end, local_end
        # The window ends at the chunk's own slots: attend the older part of it, then the live K/V.
        first = max(0, local_end - self.buffer_tokens)
        older = slice(first, local_end - n)
        return torch.cat([
            attend_live(q[s : s + 1], buf.k[s : s + 1, older], buf.v[s : s + 1, older], k[s : s + 1], v[s : s + 1])
            for s in range(self.streams)
        ])

    def commit(self) -> None:
        """Nothing to do: the clean forward was the last overwrite of the chunk's slots."""

    def reset(self) -> None:
        super().reset()
        c = self.model.config
        shape = (self.streams, self.buffer_tokens, c.num_heads, c.head_dim)
        dtype = self.model.patch_embedding.weight.dtype
        self.layers = [RollingLayer(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                       for _ in self.model.blocks]
