"""Content-selected retention on the device: score the candidate frames' patches, keep the best, copy them.

A lane under a :class:`~ardiff_modules.core.selected_retention.SelectedFramesPolicy` replaces its selection at the
commits the policy names (``core/branch_selection.py`` says which pages; ``core/transaction.py`` calls
:class:`LaneSelector` once per such commit, for every lane at once). Per retention group:

1. the group's *scoring lane* (the one holding the policy's ``score_layer``) gathers that layer's keys of each
   member's candidate frames and boundary frame: ``[members, frames, frame_tokens, heads * head_dim]``;
2. the scorer rates each patch (built in: :func:`forcing_kv_scores`, Forcing-KV's rule); the ``keep_patches``
   best are chosen per member (``topk``), ascending in position;
3. every lane of the group copies those candidate pages into the member's reserved selection pages (the same
   offsets: lanes differ only in the heads they store), one gather and one scatter of the pool per lane.

Nothing here reads a device value on the host: the chosen offsets stay on the device, with a non-blocking copy
to pinned host memory that :meth:`DeviceOffsets.resolve` waits for only when a cold path asks (a suspend, a
file, a token mask's key positions).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ardiff_modules.core.branch_selection import SelectionJob
from ardiff_modules.core.selected_retention import SelectedFramesPolicy, selecting
from ardiff_modules.errors import SpecError, TensorMismatchError
from ardiff_modules.lanes import CacheLane
from ardiff_modules.quant import is_quantized


def forcing_kv_scores(candidates: torch.Tensor, boundary: torch.Tensor, patches_per_frame: int) -> torch.Tensor:
    """Forcing-KV's patch score (``dynamic_compression``), negated so that higher = keep.

    ``candidates`` ``[streams, frames, tokens, features]``, ``boundary`` ``[streams, tokens, features]`` (the frame
    after them) -> ``[streams, frames, patches_per_frame]``: minus the mean over a patch's tokens of the cosine
    between each candidate's token and the same token of the next frame (the least similar patches are kept).
    """
    chain = torch.cat([candidates, boundary[:, None]], dim=1)
    streams, frames, tokens, features = candidates.shape
    per_patch = tokens // patches_per_frame
    current = chain[:, :-1].reshape(streams, frames, patches_per_frame, per_patch, features)
    following = chain[:, 1:].reshape(streams, frames, patches_per_frame, per_patch, features)
    return -F.cosine_similarity(current, following, dim=-1).mean(dim=3)


class DeviceOffsets:
    """One member's chosen offsets, on the device; :meth:`resolve` reads the pinned host copy (waiting for it)."""

    def __init__(self, host: torch.Tensor, row: int, ready: torch.cuda.Event | None) -> None:
        self._host, self._row, self._ready = host, row, ready

    def resolve(self) -> tuple[int, ...]:
        if self._ready is not None:
            self._ready.synchronize()
        return tuple(int(v) for v in self._host[self._row].tolist())


@dataclass(frozen=True)
class _Group:
    policy: SelectedFramesPolicy
    lanes: tuple[int, ...]
    scoring_lane: int
    scoring_layer: int  # the score layer's index inside the scoring lane
    pages_per_frame: int


class LaneSelector:
    """What a cache's committing forwards call to choose and copy their selections (``ForwardTransaction.select``).

    Built once per cache from its lanes; :func:`lane_selector` returns ``None`` when no lane selects.
    """

    def __init__(self, groups: Sequence[_Group], lanes: Sequence[CacheLane]) -> None:
        self.groups, self.lanes = tuple(groups), tuple(lanes)

    def __call__(self, jobs: list[list[SelectionJob | None]]) -> list[list[DeviceOffsets | None]]:
        """``jobs`` per lane, per member -> the chosen offsets per lane, per member (``None`` where no job)."""
        chosen: list[list[DeviceOffsets | None]] = [[None] * len(lane_jobs) for lane_jobs in jobs]
        # NOTE: every group chooses before any copies: a copy may overwrite the current selection in place (a frame
        # extent's, ``core/branch_frame_extent.py``), so a scorer raising in a later group must find nothing copied
        copies = []
        for group in self.groups:
            scoring = jobs[group.scoring_lane]
            members = [m for m, job in enumerate(scoring) if job is not None]
            if not members:
                continue
            device = self.lanes[group.scoring_lane].pool.kv.device
            per_lane: dict[int, list[SelectionJob]] = {}
            for lane_index in group.lanes:
                lane_jobs = [jobs[lane_index][m] for m in members]
                assert all(j is not None for j in lane_jobs), "a member selects in every lane of its group or none"
                per_lane[lane_index] = lane_jobs  # type: ignore[assignment]
            # each lane's candidate page ids, staged once (the scoring lane's are read by the choice and the copy)
            candidates = {i: _staged([j.candidates for j in js], device) for i, js in per_lane.items()}
            offsets = self._choose(group, per_lane[group.scoring_lane], candidates[group.scoring_lane])
            copies.append((per_lane, candidates, offsets))
            host, ready = _to_host(offsets)
            for lane_index in per_lane:
                for row, m in enumerate(members):
                    chosen[lane_index][m] = DeviceOffsets(host, row, ready)
        for per_lane, candidates, offsets in copies:
            for lane_index, selected in per_lane.items():
                self._copy(self.lanes[lane_index], selected, candidates[lane_index], offsets)
        return chosen

    def _choose(self, group: _Group, jobs: list[SelectionJob], candidates: torch.Tensor) -> torch.Tensor:
        """int64 ``[members, selected pages]``: offsets of the chosen pages among each member's candidates
        (``candidates``: their page ids in the scoring lane, on its device)."""
        policy, lane = group.policy, self.lanes[group.scoring_lane]
        keys = lane.pool.kv[group.scoring_layer, 0]  # [pages, page_size, heads, head_dim]
        device = keys.device
        boundary = _staged([j.boundary for j in jobs], device)
        frames = policy.frames_per_chunk
        tokens = group.pages_per_frame * keys.shape[1]
        features = keys.shape[2] * keys.shape[3]
        # float32, as the attention reads them: an FP8 pool's scales are per (layer, K|V, head), so the raw codes
        # of the heads concatenated would weigh each head by 1 / its scale in the cosine -- dequantized first
        scale = lane.pool.scales[group.scoring_layer, 0].float()[:, None] if is_quantized(keys.dtype) else None
        c, b = (keys[pages].float() if scale is None else keys[pages].float() * scale
                for pages in (candidates, boundary))
        c = c.reshape(len(jobs), frames, tokens, features)
        b = b.reshape(len(jobs), tokens, features)
        patches = policy.patches_per_frame
        if policy.scorer is None:
            scores = forcing_kv_scores(c, b, patches)
        else:
            scores = policy.scorer(c, b)
            if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != (len(jobs), frames, patches):
                raise TensorMismatchError(
                    f"SelectedFramesPolicy.scorer: expected a tensor of shape {(len(jobs), frames, patches)} [streams, "
                    f"frames, patches_per_frame], got {getattr(scores, 'shape', type(scores).__name__)}"
                )
        kept = torch.topk(scores.reshape(len(jobs), frames * patches), policy.keep_patches, dim=1).indices
        kept = kept.sort(dim=1).values  # ascending position: the copies' pages in position order
        per_patch = group.pages_per_frame // patches
        first = (kept // patches) * group.pages_per_frame + (kept % patches) * per_patch
        return (first[:, :, None] + torch.arange(per_patch, device=device)).reshape(len(jobs), -1)

    @staticmethod
    def _copy(lane: CacheLane, jobs: list[SelectionJob], candidates: torch.Tensor, offsets: torch.Tensor) -> None:
        """The chosen candidate pages (``candidates``: the members' candidate page ids in ``lane``) -> each member's
        selection pages, every layer, K and V."""
        device = lane.pool.kv.device
        src = candidates.gather(1, offsets).reshape(-1)
        dst = _staged([p for j in jobs for p in j.destination], device)
        kv = lane.pool.kv
        raw = kv.view(torch.uint8) if is_quantized(kv.dtype) else kv  # (FP8: bits as they are; no FP8 index_copy_)
        raw.index_copy_(2, dst, raw.index_select(2, src))


def _staged(values: Sequence[object], device: torch.device) -> torch.Tensor:
    """int64 page ids on ``device`` without a host sync (pinned staging, a non-blocking copy)."""
    cpu = torch.tensor(values, dtype=torch.int64)
    return cpu if device.type == "cpu" else cpu.pin_memory().to(device, non_blocking=True)


def _to_host(offsets: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A host copy of ``offsets`` that is ready once the returned event is (CPU: at once)."""
    if offsets.device.type != "cuda":
        return offsets, None
    host = torch.empty(offsets.shape, dtype=offsets.dtype, pin_memory=True)
    host.copy_(offsets, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def lane_selector(lanes: Sequence[CacheLane]) -> LaneSelector | None:
    """The selector of a cache whose lanes include content-selected ones, else ``None``. :class:`SpecError` when a
    group's ``score_layer`` holds none of its heads, or its lanes' policies differ."""
    by_group: dict[str, list[int]] = {}
    for lane in lanes:
        if selecting(lane.spec.policy) is not None:
            by_group.setdefault(lane.part.group if lane.part is not None else "all", []).append(lane.index)
    groups = []
    for name, indices in by_group.items():
        policies = {selecting(lanes[i].spec.policy) for i in indices}
        policy = policies.pop()
        assert policy is not None and not policies, "one group, one policy"
        scoring = [i for i in indices if policy.score_layer in lanes[i].layers]
        if not scoring:
            held = sorted({layer for i in indices for layer in lanes[i].layers})
            raise SpecError(
                f"SelectedFramesPolicy.score_layer: expected a layer holding heads of group {name!r} (its layers: "
                f"{held}), got {policy.score_layer}"
            )
        lane = lanes[scoring[0]]
        groups.append(_Group(policy, tuple(indices), lane.index, lane.layers.index(policy.score_layer),
                             lane.spec.pages_per_chunk // policy.frames_per_chunk))
    return LaneSelector(groups, lanes) if groups else None
