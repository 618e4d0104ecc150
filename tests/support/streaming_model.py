"""A tiny streaming DiT built from the library's modules, and an independent cache-free oracle.

The oracle (:class:`NaiveStreaming`) reimplements the visibility rule (docs/design.md, "Semantics")
with plain Python lists and dense tensors -- no pages, no plan, no
window policy object: visibility is list slicing, the mask is built inline.
It shares only the model's projection weights with the library path.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ardiff_modules import (
    CachedCrossAttention,
    ChunkSelfAttention,
    CrossAttentionSpec,
    KVCache,
    KVCacheSpec,
    populate_cross_attention,
)
from ardiff_modules.modules.rotary import RotaryEmbedding

TEXT = "text"


class TinyBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, context_dim: int, qk_norm: str | None) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = ChunkSelfAttention(dim, heads, num_kv_heads=kv_heads, qk_norm=qk_norm)
        self.norm2 = nn.LayerNorm(dim)
        self.cross = CachedCrossAttention(dim, heads, TEXT, context_dim=context_dim, num_kv_heads=kv_heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, kv, rope):  # noqa: ANN001, ANN201
        x = x + self.attn(self.norm1(x), kv, rope)
        x = x + self.cross(self.norm2(x), kv)
        return x + self.mlp(x)


class TinyStreamingModel(nn.Module):
    def __init__(
        self, dim: int = 32, heads: int = 4, kv_heads: int = 4, layers: int = 3, context_dim: int = 24,
        qk_norm: str | None = "head",
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TinyBlock(dim, heads, kv_heads, context_dim, qk_norm) for _ in range(layers))
        self.rope = RotaryEmbedding(dim // heads)
        self.dim, self.heads, self.kv_heads, self.context_dim = dim, heads, kv_heads, context_dim

    def forward(self, x, layers):  # noqa: ANN001, ANN201
        for block, kv in zip(self.blocks, layers):
            x = block(x, kv, self.rope)
        return x

    def spec(  # noqa: ANN201
        self, chunk_size, page_size, sink, window, branches=("cond", "uncond"), text_tokens=5,  # noqa: ANN001
        pending_attention="block_causal", relative_sinks=False,  # noqa: ANN001
    ):
        return KVCacheSpec(
            num_layers=len(self.blocks), num_kv_heads=self.kv_heads, head_dim=self.dim // self.heads,
            chunk_size=chunk_size, page_size=page_size, sink_chunks=sink, window_chunks=window,
            branches=branches, cross_attention=(CrossAttentionSpec(TEXT, text_tokens),), dtype="float32",
            pending_attention=pending_attention, relative_sinks=relative_sinks,
        )


def tiny_model_and_spec(
    sink: int = 1, window: int | None = 2, kv_dtype: str | None = None, chunk: int = 4, page: int = 2
) -> tuple[TinyStreamingModel, KVCacheSpec]:
    """The default :class:`TinyStreamingModel` (weights seeded with 0, eval mode) and its spec: chunks of ``chunk``
    tokens in pages of ``page``, ``sink`` + ``window`` chunks, CFG branches, float32 (``kv_dtype``: the K/V storage
    dtype, else the same)."""
    torch.manual_seed(0)
    model = TinyStreamingModel().eval()
    spec = model.spec(chunk, page, sink, window)
    if kv_dtype is not None:
        spec = dataclasses.replace(spec, kv_dtype=kv_dtype)
    return model, spec


class LibraryStreaming:
    """Drives the library: batched ``prepare_forward`` and the seed's per-branch API."""

    def __init__(self, model: TinyStreamingModel, spec: KVCacheSpec, num_pages: int, fn=None) -> None:  # noqa: ANN001
        self.model = model
        self.fn = fn if fn is not None else model
        self.cache = KVCache(spec, num_pages=num_pages, backend="reference")
        self.state = self.cache.open_session("s0")

    def forward(
        self, branches: Sequence[str], x: torch.Tensor, commit: bool, chunk_lengths: Sequence[int] | None = None,
        pending_attention: str | None = None,
    ) -> torch.Tensor:
        """``pending_attention``: passed to the library only when not ``None`` (else the spec's default)."""
        rule = {} if pending_attention is None else {"pending_attention": pending_attention}
        if chunk_lengths is not None and len(chunk_lengths) > 1:  # mixed chunk sizes: say them
            with self.state.prepare_forward(branches, x.shape[1], commit, chunk_lengths=chunk_lengths, **rule) as fwd:
                return self.fn(x, fwd.layers)
        if len(branches) == 1:  # the seed's API
            layers = self.state.get_kv_caches(branches[0], x.shape[1], commit_current=commit, **rule)
            out = self.fn(x, layers)
            self.state.commit_paged_context(branches[0])
            return out
        with self.state.prepare_forward(branches, x.shape[1], commit_current=commit, **rule) as fwd:
            return self.fn(x, fwd.layers)

    def set_prompt(self, contexts: dict[str, torch.Tensor]) -> None:
        self.state.clear_cross_attention()
        for branch, context in contexts.items():
            populate_cross_attention(self.state, branch, [b.cross for b in self.model.blocks], context)

    def reset(self) -> None:
        self.state.reset(keep_cross_attention=(TEXT,))


class NaiveStreaming:
    """Cache-free oracle: per branch, the per-layer K/V of every committed chunk in a plain list."""

    def __init__(
        self, model: TinyStreamingModel, chunk_size: int, sink: int, window: int | None,
        memory: tuple[int, int] | None = None, pending_attention: str = "block_causal",
        relative_sinks: bool = False,
    ) -> None:
        """``memory=(every, count)``: also keep the last ``count`` chunks that left the window whose
        position after the sinks is a multiple of ``every`` (``SinkWindowMemoryPolicy``).
        ``pending_attention``: the default rule between pending chunks (a forward may say its own).
        ``relative_sinks``: keep *unrotated* keys and re-rotate every visible key in every forward, the
        sinks at positions shifted to end just before the first visible non-sink key (what the peers do)."""
        self.model, self.chunk, self.sink, self.window = model, chunk_size, sink, window
        self.memory = memory
        self.pending_attention = pending_attention
        self.relative_sinks = relative_sinks
        self.committed: dict[str, list[list[tuple[torch.Tensor, torch.Tensor]]]] = defaultdict(list)
        self.text: dict[str, torch.Tensor] = {}
        #: With gradients on (the training oracle): forwards carry autograd to q and their own K/V; committed
        #: K/V are stored detached (history is a constant, as in every peer).
        self.grad = False

    def visible(self, branch: str) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        chunks = self.committed[branch]
        sinks, rest = chunks[: self.sink], chunks[self.sink :]
        if self.window is None:
            return sinks + rest
        cut = max(0, len(rest) - self.window)
        window, older = rest[cut:], rest[:cut]
        memory: list = []
        if self.memory is not None:
            every, count = self.memory
            memory = [c for i, c in enumerate(older) if i % every == 0][-count:] if count else []
        return sinks + memory + window

    def forward(
        self, branches: Sequence[str], x: torch.Tensor, commit: bool, chunk_lengths: Sequence[int] | None = None,
        pending_attention: str | None = None,
    ) -> torch.Tensor:
        n = x.shape[1]
        if chunk_lengths is None:  # full chunks, or one shorter chunk
            chunk_lengths = [self.chunk] * (n // self.chunk) if n % self.chunk == 0 else [n]
        bidirectional = (pending_attention or self.pending_attention) == "bidirectional"
        outs = []
        for s, branch in enumerate(branches):
            out, chunk_kv = self._stream(branch, x[s : s + 1], list(chunk_lengths), bidirectional)
            outs.append(out)
            if commit:
                self.committed[branch].extend([[(k.detach(), v.detach()) for k, v in c] for c in chunk_kv])
        return torch.cat(outs)

    def resident_indices(self, branch: str) -> list[int]:
        """Commit indices of the chunks :meth:`visible` returns (sinks, memory, window), oldest first."""
        ids = {id(c): i for i, c in enumerate(self.committed[branch])}
        return [ids[id(c)] for c in self.visible(branch)]

    @torch.no_grad()
    def recache(
        self, branches: Sequence[str], latents: dict[str, list[torch.Tensor]], keep_sinks: bool = True,
        rule: tuple[str, str, int] | None = None,
    ) -> torch.Tensor:
        """Prompt-switch re-cache, cache-free: regenerate chunks' K/V under the current prompt.

        ``latents[branch][j]`` ``[tokens, dim]`` is the clean latent of the ``j``-th rebuilt chunk in commit
        order. Without ``rule``: every resident chunk, or every non-sink one with ``keep_sinks``; rebuilt chunk
        ``j`` sees the kept sinks (old K/V) and rebuilt chunks ``0..j``. ``rule = (attention, sinks, context)``
        (``sinks`` one of ``"keep"``, ``"rebuild"``, ``"keep_after_slide"``; moving sinks are not modelled
        here): also the last ``context`` evicted non-sink chunks, attended but not stored; the sinks rebuilt
        (``"rebuild"``, or ``"keep_after_slide"`` while nothing older than the context was evicted) or kept;
        ``"bidirectional"``: every rebuilt chunk sees all of them. Positions: the original ones.
        """
        attention, sink_mode, context_count = rule if rule is not None else (
            "block_causal", "keep" if keep_sinks else "rebuild", 0
        )
        outs = []
        for branch in branches:
            chunks = self.committed[branch]
            starts = [0]
            for c in chunks:
                starts.append(starts[-1] + c[0][0].shape[0])
            indices = self.resident_indices(branch)
            sinks = [i for i in indices if i < self.sink]
            evicted = [i for i in range(len(sinks), len(chunks)) if i not in indices]
            context = evicted[len(evicted) - context_count :] if context_count else []
            slid = len(context) < len(evicted)
            rebuild_sinks = sink_mode == "rebuild" or (sink_mode == "keep_after_slide" and not slid)
            kept = [] if rebuild_sinks else sinks
            rebuilt = sorted(set(indices) - set(kept) | set(context))
            lengths = [chunks[i][0][0].shape[0] for i in rebuilt]
            positions = torch.cat([torch.arange(starts[i], starts[i] + n) for i, n in zip(rebuilt, lengths)])[None]
            x = torch.cat(latents[branch])[None]
            out, chunk_kv = self._stream(
                branch, x, lengths, attention == "bidirectional", positions=positions, history=[chunks[i] for i in kept]
            )
            for i, kv in zip(rebuilt, chunk_kv):
                if i not in context:
                    chunks[i] = kv
            outs.append(out)
        return torch.cat(outs)

    def _stream(  # noqa: ANN202
        self, branch: str, x: torch.Tensor, lengths: list[int] | None = None, bidirectional: bool = False,
        positions: torch.Tensor | None = None, history: list | None = None,
    ):
        with torch.set_grad_enabled(self.grad and torch.is_grad_enabled()):
            return self._stream_layers(branch, x, lengths, bidirectional, positions, history)

    def _stream_layers(  # noqa: ANN202
        self, branch: str, x: torch.Tensor, lengths: list[int] | None, bidirectional: bool,
        positions: torch.Tensor | None, history: list | None,
    ):
        n = x.shape[1]
        if lengths is None:
            lengths = [self.chunk] * (n // self.chunk) if n % self.chunk == 0 else [n]
        # Tokens ever committed (chunks may differ in length): the absolute position of the first new token.
        start = sum(chunk[0][0].shape[0] for chunk in self.committed[branch])
        if positions is None:
            positions = torch.arange(start, start + n)[None]
        if history is None:
            history = self.visible(branch)
        hist_len = sum(c[0][0].shape[0] for c in history)
        key_positions = None
        if self.relative_sinks:  # every visible key re-rotated now, at its (shifted, for sinks) position
            key_positions = self._relative_key_positions(branch, history, positions[0])
        q_chunk = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        mask = torch.ones(n, hist_len + n, dtype=torch.bool)
        # Pending chunks: block-causal, or all of them seen by all (Rolling Forcing); history always visible.
        mask[:, hist_len:] = True if bidirectional else q_chunk[None, :] <= q_chunk[:, None]
        per_layer = []
        h = x
        for layer, block in enumerate(self.model.blocks):
            a = block.attn
            hn = block.norm1(h)
            q, k, v = a.project(hn)
            if self.relative_sinks:
                k0, v0 = k[0], v[0]  # kept unrotated
                keys = torch.cat([c[layer][0] for c in history] + [k0])
                keys = self.model.rope(keys[None], key_positions[None])[0]
                q = self.model.rope(q, positions)
            else:
                q, k = self.model.rope(q, positions), self.model.rope(k, positions)
                k0, v0 = self.store(layer, k[0], v[0])
                keys = torch.cat([c[layer][0] for c in history] + [k0])
            values = torch.cat([c[layer][1] for c in history] + [v0])
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys[None].transpose(1, 2), values[None].transpose(1, 2),
                attn_mask=mask, enable_gqa=a.num_heads != a.num_kv_heads,
            ).transpose(1, 2)
            h = h + a.to_out(o.reshape(1, n, -1))
            c = block.cross
            with torch.no_grad():  # the prompt's K/V are published once: a constant, like the history
                ck, cv = c.project_kv(self.text[branch])
            qc = c.to_q(block.norm2(h)).view(1, n, c.num_heads, c.head_dim)
            oc = F.scaled_dot_product_attention(
                qc.transpose(1, 2), ck[None].transpose(1, 2), cv[None].transpose(1, 2),
                enable_gqa=c.num_heads != c.num_kv_heads,
            ).transpose(1, 2)
            h = h + c.to_out(oc.reshape(1, n, -1))
            h = h + block.mlp(h)
            per_layer.append((k0, v0))
        bounds = [0]
        for length in lengths:
            bounds.append(bounds[-1] + length)
        chunk_kv = [[(k[a:b], v[a:b]) for k, v in per_layer] for a, b in zip(bounds, bounds[1:])]
        return h, chunk_kv

    def _relative_key_positions(self, branch: str, history: list, pending: torch.Tensor) -> torch.Tensor:
        """Positions of the history keys then the ``pending`` ones, sinks moved to end just before the first
        visible non-sink key (the oldest window chunk's first token, else the first pending token)."""
        chunks = self.committed[branch]
        starts, start = {}, 0
        for c in chunks:
            starts[id(c)] = start
            start += c[0][0].shape[0]
        sink_ids = {id(c) for c in chunks[: self.sink]}
        sinks = [c for c in history if id(c) in sink_ids]
        rest = [c for c in history if id(c) not in sink_ids]
        shift = 0
        if sinks:
            sink_end = starts[id(sinks[-1])] + sinks[-1][0][0].shape[0]
            shift = (starts[id(rest[0])] if rest else int(pending[0])) - sink_end
        spans = [
            torch.arange(starts[id(c)], starts[id(c)] + c[0][0].shape[0]) + (shift if id(c) in sink_ids else 0)
            for c in history
        ]
        return torch.cat([*spans, pending])

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What the cache holds for this layer's ``[tokens, kv_heads, head_dim]`` K/V (exactly them here)."""
        return k, v

    def set_prompt(self, contexts: dict[str, torch.Tensor]) -> None:
        self.text = dict(contexts)

    def reset(self) -> None:
        self.committed.clear()


def rollout_events(
    num_chunks: int, chunk_size: int, dim: int, context_dim: int, seed: int = 0, fixed_shape: bool = False,
    short_chunk: int | None = None, pending_attention: str | None = None,
) -> list[tuple]:
    """A Self-Forcing-style schedule: 2 denoising forwards + 1 committing forward per step, CFG batched.

    Includes multi-chunk forwards (1..4 chunks), single-branch forwards through the seed API,
    a prompt switch and a reset. ``fixed_shape`` keeps every forward at one chunk of both branches.
    ``short_chunk`` (tokens, a multiple of the page size below ``chunk_size``): the first chunk
    after the start and after the reset is that short (image-to-video's 1-frame first chunk), and
    some multi-chunk forwards mix a short chunk in (events then carry their ``chunk_lengths``).
    ``pending_attention``: each forward event also carries the rule it asks for -- that value, or with
    ``"alternate"`` one per step cycling ``"bidirectional"``, ``"block_causal"``, ``None`` (the spec's).
    """
    g = torch.Generator().manual_seed(seed)
    branches = ("cond", "uncond")
    events: list[tuple] = [("prompt", {b: torch.randn(5, context_dim, generator=g) for b in branches})]
    chunk_counts = [1, 1, 2, 1, 3, 1, 4, 1, 1, 2, 1, 1]
    done = 0
    step = 0
    while done < num_chunks:
        n = 1 if fixed_shape else chunk_counts[step % len(chunk_counts)]
        rows = branches if fixed_shape or step % 5 != 4 else ("uncond",)
        lengths = [chunk_size] * n
        if short_chunk is not None and step in (0, 10):
            lengths = [short_chunk]
        elif short_chunk is not None and n > 1 and step % 4 != 1:  # a short chunk last, or first (step 4)
            lengths = [chunk_size] * (n - 1) + [short_chunk]
            lengths = lengths[::-1] if step == 4 else lengths
        seq = sum(lengths)
        rule: tuple = ()
        if pending_attention == "alternate":
            rule = (("bidirectional", "block_causal", None)[step % 3],)
        elif pending_attention is not None:
            rule = (pending_attention,)
        for denoise in range(3):
            x = torch.randn(len(rows), seq, dim, generator=g)
            events.append(("forward", rows, x, denoise == 2, tuple(lengths), *rule))
        if step == 5:
            events.append(("prompt", {b: torch.randn(5, context_dim, generator=g) for b in branches}))
        if step == 9:
            events.append(("reset",))
        done += n
        step += 1
    return events


def play_event(runner, event: tuple) -> torch.Tensor | None:  # noqa: ANN001
    """Apply one rollout event; a forward returns its output."""
    if event[0] == "prompt":
        runner.set_prompt(event[1])
    elif event[0] == "reset":
        runner.reset()
    else:
        _, rows, x, commit, lengths, *rule = event  # rule: () or (pending_attention,)
        with torch.no_grad():
            return runner.forward(rows, x, commit, lengths, *rule)
    return None


def play(runner, events) -> list[torch.Tensor]:  # noqa: ANN001
    outs = [play_event(runner, event) for event in events]
    return [out for out in outs if out is not None]
