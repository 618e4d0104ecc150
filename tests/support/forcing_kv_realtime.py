"""Forcing-KV's *realtime* attention cache (Krea realtime 14B), re-stated cache-free from its published code.

Source: zju-jiyicheng/Forcing-KV at ``50ac1f454348e7f0a2e54bde71e1652b20c09fe6``,
``wan/modules/causal_model_forcingkv_realtime.py``: ``CausalWanSelfAttention.forward`` (the grouped and the
full path), ``CausalWanModel._apply_offline_head_allocation`` / ``_forward_inference``. Per layer, in frames,
blocks of 3 frames, ``S`` sink frames (``model_kwargs.sink_size``), ``Lt`` = ``temporal_context_length``,
switch after block ``a`` = ``ar_start``:

* up to block ``a``, every layer, every head: every committed frame (``local_attn_size: -1``: the full path
  never rolls, and reads up to 32760 tokens, more than any rollout here) and the block itself;
* from block ``a + 1``, **every** layer (layer 0 included: the allocation loops over all of them): the head
  file's static heads ``[sink, last 1 frame, block]`` (``static_keep = frame_tokens``: one frame, whatever
  ``spatial_context_length`` says), its dynamic heads ``[sink, last Lt frames, block]``; no dynamic patches.

Writes: at the clean re-run only, as :class:`~tests.support.forcing_kv_attention.ForcingKVCacheFree` models
them (the file writes at every timestep-0 forward; the rollouts here have no denoising step at 0, where the two
are the same).
"""

from __future__ import annotations

from tests.support.forcing_kv_attention import ForcingKVCacheFree

#: Frames the realtime file's static heads keep: ``static_keep = frame_tokens``.
STATIC_FRAMES = 1


class ForcingKVRealtimeCacheFree(ForcingKVCacheFree):
    """The realtime file's caches; ``settings.spatial_frames`` and the dynamic fields are not read (the file
    reads neither)."""

    def selection(self) -> None:
        return None

    def groups(self, layer: int, selection: object) -> list[tuple[list[int], list]]:
        sink, rest = self.sink_and_rest()
        if not self.switched():
            every = list(range(self.kv_heads))
            return [(every, self._frames(layer, sink + rest, every))]
        last = self.last_of(rest)
        static = list(self.s.static_heads[layer])
        dynamic = self.temporal_heads(layer)
        return [
            (static, self._frames(layer, sink + last(STATIC_FRAMES), static)),
            (dynamic, self._frames(layer, sink + last(self.s.temporal_frames), dynamic)),
        ]

