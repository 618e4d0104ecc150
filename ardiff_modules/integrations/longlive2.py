"""LongLive 2.0's scene cuts (``multi_shot_sink``, ``shot_clean_recache``, ``multi_shot_rope_offset``) on a session.

LongLive 2.0 (``NVlabs/LongLive`` @ ``7860ad9``, ``pipeline/causal_diffusion_inference.py``) decides per chunk from
its prompt whether the chunk starts a new shot, and acts on its own contiguous KV buffer (see
:mod:`ardiff_modules.core.shot_sink` for the semantics). :class:`LongLive2Shots` makes the same decisions from the
same inputs and acts on a :class:`~ardiff_modules.KVState` instead; a generation loop calls it at three points::

    shots = LongLive2Shots(prompts, sink_size=8, shot_clean_recache=False, multi_shot_rope_offset=8)
    spec = am.KVCacheSpec(..., retention=shots.policy(local_attn_size=32, frames_per_chunk=8))
    for c in range(num_chunks):
        shots.chunk_start(state, c)              # a scene cut: begin_shot (the chunk will be the shot sink)
        offset = shots.rope_offset(c)            # frames to add to this chunk's RoPE positions
        ...denoising forwards...
        shots.before_clean_forward(state, c)     # shot_clean_recache at a cut: drop_window
        ...the clean forward (commit_current=True)...

Upstream's rules, re-stated: a chunk is a **shot boundary** when it is not chunk 0 and its prompt (``raw_prompts[c]``,
a ``str``) starts with ``scene_cut_prefix`` (``_is_shot_boundary``); a **scene cut** when it is a shot boundary and
``multi_shot_sink`` is on and ``sink_size > 0`` (``_is_scene_cut``). Each shot boundary adds one to the shot index
when ``multi_shot_rope_offset`` is not 0; the chunk's RoPE is shifted by ``shot_index x multi_shot_rope_offset``
frames (the model's RoPE: this class only says by how much).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ardiff_modules.checks import require_bool, require_int
from ardiff_modules.core.shot_sink import ShotSinkPolicy
from ardiff_modules.errors import SpecError
from ardiff_modules.session import KVState

__all__ = ["SCENE_CUT_PREFIX", "LongLive2Shots"]

#: Upstream's ``DEFAULT_SCENE_CUT_PREFIX`` (``utils/dataset.py``).
SCENE_CUT_PREFIX = "The scene transitions. "


@dataclass(frozen=True)
class LongLive2Shots:
    """Upstream's shot decisions for one video's per-chunk ``prompts`` (``raw_prompts``: one ``str`` per chunk).

    ``sink_size`` is upstream's (frames); ``multi_shot_sink`` / ``shot_clean_recache`` / ``multi_shot_rope_offset``
    / ``scene_cut_prefix`` its ``inference`` settings (defaults as upstream's: ``multi_shot_sink`` on in its configs).
    """

    prompts: Sequence[object]
    sink_size: int
    multi_shot_sink: bool = True
    shot_clean_recache: bool = False
    multi_shot_rope_offset: float = 0.0
    scene_cut_prefix: str = SCENE_CUT_PREFIX

    def __post_init__(self) -> None:
        require_int("LongLive2Shots.sink_size", self.sink_size, minimum=0)
        require_bool("LongLive2Shots.multi_shot_sink", self.multi_shot_sink)
        require_bool("LongLive2Shots.shot_clean_recache", self.shot_clean_recache)
        if isinstance(self.multi_shot_rope_offset, bool) or not isinstance(self.multi_shot_rope_offset, (int, float)):
            raise SpecError(
                "LongLive2Shots.multi_shot_rope_offset: expected a number of frames, got "
                f"{self.multi_shot_rope_offset!r}"
            )
        if not isinstance(self.scene_cut_prefix, str):
            raise SpecError(f"LongLive2Shots.scene_cut_prefix: expected a str, got {self.scene_cut_prefix!r}")
        if isinstance(self.prompts, (str, bytes)) or not isinstance(self.prompts, Sequence):
            raise SpecError(
                "LongLive2Shots.prompts: expected one prompt per chunk (a list of str), got "
                f"{type(self.prompts).__name__}"
            )

    def policy(self, *, local_attn_size: int | None, frames_per_chunk: int) -> ShotSinkPolicy:
        """The cache's retention: :meth:`ShotSinkPolicy.from_frames` with this ``sink_size`` (``global_sink_size``
        when ``multi_shot_sink``); without ``multi_shot_sink``, the same buffer that never pins."""
        policy = ShotSinkPolicy.from_frames(
            sink_size=self.sink_size, local_attn_size=local_attn_size, frames_per_chunk=frames_per_chunk
        )
        return policy if self.multi_shot_sink else ShotSinkPolicy(policy.sink_chunks, policy.window_chunks, 0)

    def is_shot_boundary(self, chunk_index: int) -> bool:
        """Upstream's ``_is_shot_boundary``: not chunk 0, and the chunk's prompt starts with the prefix."""
        require_int("LongLive2Shots.is_shot_boundary.chunk_index", chunk_index, minimum=0)
        if chunk_index == 0 or chunk_index >= len(self.prompts):
            return False
        prompt = self.prompts[chunk_index]
        return isinstance(prompt, str) and prompt.startswith(self.scene_cut_prefix)

    def is_scene_cut(self, chunk_index: int) -> bool:
        """Upstream's ``_is_scene_cut``: a shot boundary with ``multi_shot_sink`` on and ``sink_size > 0``."""
        return self.multi_shot_sink and self.sink_size > 0 and self.is_shot_boundary(chunk_index)

    def rope_offset(self, chunk_index: int) -> float:
        """Frames added to chunk ``chunk_index``'s RoPE positions (``shot_index x multi_shot_rope_offset``)."""
        if self.multi_shot_rope_offset == 0:
            return 0.0
        shots = sum(self.is_shot_boundary(c) for c in range(1, chunk_index + 1))
        return shots * float(self.multi_shot_rope_offset)

    def chunk_start(self, state: KVState, chunk_index: int, branches: Sequence[str] | str | None = None) -> bool:
        """Before chunk ``chunk_index``'s forwards: at a scene cut, :meth:`KVState.begin_shot` (the chunk becomes
        the shot sink when its clean forward commits). Returns whether it was a cut."""
        cut = self.is_scene_cut(chunk_index)
        if cut:
            state.begin_shot(branches)
        return cut

    def before_clean_forward(self, state: KVState, chunk_index: int,
                             branches: Sequence[str] | str | None = None) -> bool:
        """After the chunk's denoising forwards, before its clean forward: with ``shot_clean_recache`` at a scene
        cut, :meth:`KVState.drop_window` (upstream's ``_zero_kv_data``). Returns whether the window was dropped."""
        drop = self.shot_clean_recache and self.is_scene_cut(chunk_index)
        if drop:
            state.drop_window(branches)
        return drop
