"""Per-head and per-layer retention: which K/V heads of which layers keep which chunks (pure Python).

Heads of a video DiT specialise: some look mostly at the current and the previous frames ("local"
heads), others at the first frame and the whole window. Forcing-KV keeps a short window for the local
heads (halving Causal Forcing's cache), LightX2V sets a window per layer. A :class:`HeadRetention` names
retention *groups* (each a :class:`~ardiff_modules.core.retention.RetentionPolicy`, e.g. sink 0 + window 1
for local heads, sink 1 + window 6 for the rest) and assigns every (layer, K/V head) to one group::

    layer 0:  kv heads  0 1 2 3 4 5 6 7 8 9 10 11
              group     G L L G L L G L L G  L  L       L: local (window 1)   G: global (sink 1 + window 6)
    layer 1:            G G L L L L L L L L  G  G

Storage follows from it. The heads of one group that a layer has form that layer's share of one
*part*; the layers where a group has the same number of heads share one part: one paged pool of
``[part layers, 2, pages, page_size, heads, dim]`` with its own allocator and page ids, its own
retention (so a short group really frees its pages early), its own plan per forward::

    part ("L", 8 heads): layers 0, 1 ...   part ("G", 4 heads): layers 0, 1 ...

so every kernel launch covers heads that share their key ranges (one row set per group, no mask),
and memory is exact: a part stores only the heads it holds, in only the layers that have them.
(A group with a different head count in each layer makes one part per count: more plans per forward,
never more memory.) ``KVCacheSpec`` is the rest of the geometry; :mod:`ardiff_modules.lanes`
builds the parts.

File format (``to_json`` / ``from_json``)::

    {"format": "ardiff_modules.head_retention/1",
     "groups": {"local": {"sink_chunks": 0, "window_chunks": 1},
                "global": {"sink_chunks": 1, "window_chunks": 6}},
     "layers": [["global", "local", ...], ...]}      # one group name per kv head, per layer

Every group names its ``window_chunks`` (``null`` for an unbounded window: a missing key is refused, not
read as unbounded); ``sink_chunks`` defaults to 0. A group counted in frames
(:class:`~ardiff_modules.core.frame_retention.FrameWindowPolicy`) is written
``{"sink_frames": 1, "window_frames": 1, "frames_per_chunk": 3}``; one that changes at a commit
(:class:`~ardiff_modules.core.phased_retention.PhasedPolicy`) ``{"before": {...}, "after": {...}, "at_chunk": 4}``;
one chosen by content (:class:`~ardiff_modules.core.selected_retention.SelectedFramesPolicy`) adds ``keep_frames``,
``patches_per_frame``, ``select_from``, ``score_layer`` to the frame keys.

A per-head classification such as Forcing-KV's (for each layer, the indices of its local heads) goes
through :meth:`HeadRetention.from_local_heads`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ardiff_modules.checks import is_int, require_int
from ardiff_modules.core.frame_retention import FrameWindowPolicy
from ardiff_modules.core.phased_retention import PhasedPolicy
from ardiff_modules.core.selected_retention import SelectedFramesPolicy, selecting
from ardiff_modules.core.retention import RetentionPolicy, SinkWindowPolicy, check_declared, check_index_bound
from ardiff_modules.errors import SpecError

#: A content-selected group's keys (:class:`SelectedFramesPolicy`; its scorer is the built-in one in a file).
_SELECTED_KEYS = ("sink_frames", "window_frames", "frames_per_chunk", "keep_frames", "patches_per_frame", "select_from",
                  "score_layer")

#: The ``"format"`` tag of the JSON files this module writes and reads.
FILE_FORMAT = "ardiff_modules.head_retention/1"


@dataclass(frozen=True)
class HeadPart:
    """The heads of one retention group that several layers hold in equal number: one paged pool.

    ``layers`` are model layer indices, ascending; ``heads[i]`` are the K/V head indices (ascending) of
    the group in layer ``layers[i]``, all of length :attr:`num_heads`.
    """

    group: str
    policy: RetentionPolicy
    layers: tuple[int, ...]
    heads: tuple[tuple[int, ...], ...]

    @property
    def num_heads(self) -> int:
        return len(self.heads[0])

    @property
    def name(self) -> str:
        """``"<group>/<heads>h"``, e.g. ``"local/8h"`` (the part's key in stats and errors)."""
        return f"{self.group}/{self.num_heads}h"


def _policy(owner: str, value: Any) -> RetentionPolicy:
    """A group's policy from a policy object, ``(sink, window)`` or ``{"sink_chunks", "window_chunks"}``."""
    if isinstance(value, Mapping) and "at_chunk" in value:
        unknown = set(value) - {"before", "after", "at_chunk"}
        if unknown or not {"before", "after"} <= set(value):
            raise SpecError(f"{owner}: expected keys before / after / at_chunk, got keys {sorted(map(str, value))}")
        return _policy(owner, PhasedPolicy(_policy(f"{owner}.before", value["before"]),
                                           _policy(f"{owner}.after", value["after"]), value["at_chunk"]))
    if isinstance(value, Mapping) and "keep_frames" in value:
        unknown = set(value) - set(_SELECTED_KEYS)
        if unknown or not {"window_frames", "frames_per_chunk"} <= set(value):
            raise SpecError(
                f"{owner}: expected keys frames_per_chunk / window_frames / keep_frames and optionally sink_frames / "
                f"patches_per_frame / select_from / score_layer, got keys {sorted(map(str, value))}"
            )
        return _policy(owner, SelectedFramesPolicy(**{k: value[k] for k in _SELECTED_KEYS if k in value}))
    if isinstance(value, Mapping) and "frames_per_chunk" in value:
        unknown = set(value) - {"sink_frames", "window_frames", "frames_per_chunk"}
        if unknown or "window_frames" not in value:
            raise SpecError(
                f"{owner}: expected keys frames_per_chunk / window_frames (an int, or null) / sink_frames, got keys "
                f"{sorted(map(str, value))}"
            )
        return _policy(owner, FrameWindowPolicy(value.get("sink_frames", 0), value["window_frames"],
                                                value["frames_per_chunk"]))
    if isinstance(value, Mapping):
        unknown = set(value) - {"sink_chunks", "window_chunks"}
        if unknown:
            raise SpecError(f"{owner}: expected keys sink_chunks / window_chunks, got also {sorted(unknown)}")
        # NOTE: no default for window_chunks: a missing key would silently mean "unbounded" (the whole
        # history resident), which a hand-written file almost never means; null says it explicitly.
        if "window_chunks" not in value:
            raise SpecError(
                f"{owner}: expected key 'window_chunks' (an int, or null / None for an unbounded window), got "
                f"keys {sorted(map(str, value))}"
            )
        value = (value.get("sink_chunks", 0), value["window_chunks"])
    if isinstance(value, tuple) and len(value) == 2:
        sinks, window = value
        require_int(f"{owner}.sink_chunks", sinks, minimum=0)
        if window is not None:
            require_int(f"{owner}.window_chunks", window, minimum=0)
        # Here, not only in SinkWindowPolicy: the message then names the group.
        check_index_bound(owner, sinks, None if window is None else sinks + window,
                          lambda: f"sink_chunks={sinks} + window_chunks={window}")
        return SinkWindowPolicy(sinks, window)
    if isinstance(value, RetentionPolicy):
        sinks, bound = check_declared(value)
        check_index_bound(
            owner, sinks, bound, lambda: f"{type(value).__name__} with sink_chunks={sinks}, max_history_chunks={bound}"
        )
        return value
    raise SpecError(
        f"{owner}: expected a RetentionPolicy, a (sink_chunks, window_chunks) pair or a mapping of them, "
        f"got {type(value).__name__}"
    )


def _policy_dict(name: str, policy: RetentionPolicy) -> dict[str, Any]:
    """A group's policy in the JSON form (:meth:`HeadRetention.to_dict`)."""
    if isinstance(policy, SelectedFramesPolicy):
        if policy.scorer is not None:
            raise SpecError(
                f"HeadRetention.to_dict: expected group {name!r} to score with the built-in rule (a file cannot hold "
                f"a callable), got scorer={policy.scorer!r}"
            )
        return {k: getattr(policy, k) for k in _SELECTED_KEYS}
    if isinstance(policy, FrameWindowPolicy):
        return {"sink_frames": policy.sink_frames, "window_frames": policy.window_frames,
                "frames_per_chunk": policy.frames_per_chunk}
    if isinstance(policy, PhasedPolicy):
        return {"before": _policy_dict(name, policy.before), "after": _policy_dict(name, policy.after),
                "at_chunk": policy.at_chunk}
    if not isinstance(policy, SinkWindowPolicy):
        raise SpecError(
            f"HeadRetention.to_dict: expected sink + window groups (SinkWindowPolicy, FrameWindowPolicy, or a "
            f"PhasedPolicy of them), got group {name!r} with a {type(policy).__name__}"
        )
    return {"sink_chunks": policy.sink_chunks, "window_chunks": policy.window_chunks}


class HeadRetention:
    """Retention groups and the group of every ``(layer, kv head)``.

    Parameters
    ----------
    groups:
        Group name -> its retention: a :class:`~ardiff_modules.core.retention.RetentionPolicy`, a
        ``(sink_chunks, window_chunks)`` pair, or ``{"sink_chunks": ..., "window_chunks": ...}``
        (``window_chunks`` required, ``None`` for an unbounded window; ``sink_chunks`` defaults to 0).
    layers:
        One sequence per layer with one group name per K/V head (every layer the same head count).
    """

    def __init__(self, groups: Mapping[str, Any], layers: Sequence[Sequence[str]]) -> None:
        owner = "HeadRetention"
        if not isinstance(groups, Mapping) or not groups:
            raise SpecError(f"{owner}.groups: expected a non-empty mapping of group names, got {groups!r}")
        self.groups: dict[str, RetentionPolicy] = {}
        for name, value in groups.items():
            if not isinstance(name, str) or not name:
                raise SpecError(f"{owner}.groups: expected non-empty string names, got {name!r}")
            self.groups[name] = _policy(f"{owner}.groups[{name!r}]", value)
        if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not layers:
            raise SpecError(f"{owner}.layers: expected one sequence of group names per layer, got {layers!r}")
        rows: list[tuple[str, ...]] = []
        for i, layer in enumerate(layers):
            row = tuple(layer) if isinstance(layer, Sequence) and not isinstance(layer, str) else layer
            if not isinstance(row, tuple) or not row:
                raise SpecError(f"{owner}.layers[{i}]: expected a non-empty sequence of group names, got {row!r}")
            if rows and len(row) != len(rows[0]):
                raise SpecError(
                    f"{owner}.layers[{i}]: expected {len(rows[0])} kv heads (as layer 0), got {len(row)}"
                )
            unknown = sorted({str(g) for g in row if g not in self.groups})
            if unknown:
                raise SpecError(f"{owner}.layers[{i}]: expected group names from {tuple(self.groups)}, got {unknown}")
            rows.append(row)
        self.layers: tuple[tuple[str, ...], ...] = tuple(rows)

    # ------------------------------------------------------------------ geometry
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_kv_heads(self) -> int:
        return len(self.layers[0])

    def group_of(self, layer: int, head: int) -> str:
        """The group of K/V head ``head`` of layer ``layer``."""
        require_int("HeadRetention.group_of.layer", layer, minimum=0, below=self.num_layers)
        require_int("HeadRetention.group_of.head", head, minimum=0, below=self.num_kv_heads)
        return self.layers[layer][head]

    def restrict(self, kv_heads: Sequence[int]) -> HeadRetention:
        """The assignment of the K/V heads ``kv_heads`` (ascending indices, the same in every layer) alone: what
        a Ulysses rank holding those heads stores. A group none of them follows is dropped; a group whose heads
        land on several ranks becomes a lane on each.

        ::

            HeadRetention(g, [["l", "g"], ["g", "g"]]).restrict([1])  ->  [["g"], ["g"]]  (groups: g)
        """
        owner = "HeadRetention.restrict.kv_heads"
        if isinstance(kv_heads, (str, bytes)) or not isinstance(kv_heads, Sequence) or not kv_heads:
            raise SpecError(f"{owner}: expected a non-empty sequence of kv head indices, got {kv_heads!r}")
        for head in kv_heads:
            require_int(owner, head, minimum=0, below=self.num_kv_heads)
        if list(kv_heads) != sorted(set(kv_heads)):
            raise SpecError(f"{owner}: expected ascending distinct kv head indices, got {list(kv_heads)}")
        rows = [[row[h] for h in kv_heads] for row in self.layers]
        used = {g for row in rows for g in row}
        split = [n for n, p in self.groups.items() if selecting(p) is not None and len(kv_heads) < self.num_kv_heads]
        if split:
            raise SpecError(
                f"{owner}: expected no content-selected group split across ranks (its score layer's keys of every "
                f"head of the group choose the pages: a rank holding some of them would choose other pages), got "
                f"group(s) {split} on a rank holding kv heads {list(kv_heads)} of {self.num_kv_heads}"
            )
        return HeadRetention({name: policy for name, policy in self.groups.items() if name in used}, rows)

    def parts(self) -> tuple[HeadPart, ...]:
        """The pools this assignment needs: one per (group, heads per layer), groups in declaration order."""
        found: dict[tuple[str, int], tuple[list[int], list[tuple[int, ...]]]] = {}
        for layer, row in enumerate(self.layers):
            for group in self.groups:
                heads = tuple(h for h, g in enumerate(row) if g == group)
                if heads:
                    layers, per_layer = found.setdefault((group, len(heads)), ([], []))
                    layers.append(layer)
                    per_layer.append(heads)
        order = list(self.groups)
        keys = sorted(found, key=lambda key: (order.index(key[0]), key[1]))
        return tuple(
            HeadPart(group, self.groups[group], tuple(found[(group, n)][0]), tuple(found[(group, n)][1]))
            for group, n in keys
        )

    def check_geometry(self, owner: str, num_layers: int, num_kv_heads: int) -> None:
        """:class:`SpecError` unless this assignment covers ``num_layers`` layers of ``num_kv_heads`` heads."""
        if (self.num_layers, self.num_kv_heads) != (num_layers, num_kv_heads):
            raise SpecError(
                f"{owner}: expected a head assignment of {num_layers} layers x {num_kv_heads} kv heads (the "
                f"spec's), got {self.num_layers} x {self.num_kv_heads}"
            )

    def resident_head_chunks(self, pending_chunks: int = 1) -> int | None:
        """Peak (layer, kv head, chunk) triples one branch stores: the memory to compare with a uniform cache."""
        total = 0
        for row in self.layers:
            for group in row:
                bound = self.groups[group].max_history_chunks
                if bound is None:
                    return None
                total += bound + pending_chunks
        return total

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def uniform(cls, num_layers: int, num_kv_heads: int, policy: Any, name: str = "all") -> HeadRetention:
        """Every head of every layer in one group (a plain cache, as a head assignment)."""
        require_int("HeadRetention.uniform.num_layers", num_layers, minimum=1)
        require_int("HeadRetention.uniform.num_kv_heads", num_kv_heads, minimum=1)
        return cls({name: policy}, [[name] * num_kv_heads for _ in range(num_layers)])

    @classmethod
    def per_layer(cls, policies: Sequence[Any], num_kv_heads: int) -> HeadRetention:
        """One retention per layer (LightX2V-style windows): layers with equal retention share a group."""
        require_int("HeadRetention.per_layer.num_kv_heads", num_kv_heads, minimum=1)
        checked = [_policy(f"HeadRetention.per_layer.policies[{i}]", p) for i, p in enumerate(policies)]
        groups: dict[str, RetentionPolicy] = {}
        names: list[str] = []
        for policy in checked:
            name = next((n for n, p in groups.items() if p == policy), None)
            if name is None:
                name = _policy_name(policy, len(groups))
                groups[name] = policy
            names.append(name)
        return cls(groups, [[name] * num_kv_heads for name in names])

    @classmethod
    def from_local_heads(
        cls,
        num_layers: int,
        num_kv_heads: int,
        local_heads: Mapping[Any, Sequence[int]],
        *,
        local: Any = (0, 1),
        other: Any = (1, 6),
    ) -> HeadRetention:
        """From a per-layer list of "local" heads (Forcing-KV's classification): those get ``local``, the rest ``other``.

        ``local_heads`` maps a layer index (an int or its decimal string, as JSON keys are) to a sequence of
        head indices (``{0: [1, 3]}``; a bare ``{0: 1}`` is refused); layers it does not name keep every head
        in ``other``.
        """
        owner = "HeadRetention.from_local_heads"
        require_int(f"{owner}.num_layers", num_layers, minimum=1)
        require_int(f"{owner}.num_kv_heads", num_kv_heads, minimum=1)
        if not isinstance(local_heads, Mapping):
            raise SpecError(
                f"{owner}.local_heads: expected a mapping of layer index -> head indices, got "
                f"{type(local_heads).__name__}"
            )
        rows = [["other"] * num_kv_heads for _ in range(num_layers)]
        for key, heads in local_heads.items():
            layer = _layer_key(key, num_layers)
            # NOTE: str / bytes are sequences too, of characters / of ints: b"\x01" would read as head 1.
            if not isinstance(heads, Sequence) or isinstance(heads, (str, bytes, bytearray)):
                raise SpecError(
                    f"{owner}.local_heads[{key!r}]: expected a sequence of head indices (e.g. [1, 3]), got "
                    f"{heads!r} ({type(heads).__name__})"
                )
            for head in heads:
                require_int(f"{owner}.local_heads[{key!r}]", head, minimum=0, below=num_kv_heads)
                rows[layer][head] = "local"
        return cls({"local": local, "other": other}, rows)

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict[str, Any]:
        """The JSON form (module docstring); sink + window groups, in chunks or in frames, can be written."""
        groups = {name: _policy_dict(name, policy) for name, policy in self.groups.items()}
        return {"format": FILE_FORMAT, "groups": groups, "layers": [list(row) for row in self.layers]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HeadRetention:
        if not isinstance(data, Mapping) or data.get("format") != FILE_FORMAT:
            got = data.get("format") if isinstance(data, Mapping) else type(data).__name__
            raise SpecError(f"HeadRetention.from_dict: expected format {FILE_FORMAT!r}, got {got!r}")
        return cls(data.get("groups", {}), data.get("layers", ()))

    def to_json(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> HeadRetention:
        """Load a head configuration written by :meth:`to_json` (or by hand in that format)."""
        where = f"HeadRetention.from_json({os.fspath(path)!r})"
        with open(path, "rb") as f:
            raw = f.read()
        # Decoded whole (not through a text stream, which decodes in blocks): the offset below is the file's.
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SpecError(
                f"{where}: expected UTF-8 JSON text, got byte {raw[exc.start:exc.start + 1]!r} at offset {exc.start} "
                f"({exc.reason})"
            ) from exc
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpecError(f"{where}: expected JSON, got {exc}") from exc
        try:
            return cls.from_dict(data)
        except SpecError as exc:
            # The file's content is wrong: name the file (a project may load several).
            raise SpecError(f"{where}: {exc}") from exc

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, HeadRetention):
            return NotImplemented
        return self.groups == other.groups and self.layers == other.layers

    def __hash__(self) -> int:
        return hash(self.layers)

    def __repr__(self) -> str:
        counts = {g: sum(row.count(g) for row in self.layers) for g in self.groups}
        return (
            f"HeadRetention(layers={self.num_layers}, kv_heads={self.num_kv_heads}, "
            f"groups={ {g: (p.sink_chunks, p.max_history_chunks) for g, p in self.groups.items()} }, "
            f"heads_per_group={counts}, parts={len(self.parts())})"
        )


def _layer_key(key: Any, num_layers: int) -> int:
    if isinstance(key, str) and key.isdigit():
        key = int(key)
    if not is_int(key):
        raise SpecError(f"HeadRetention.from_local_heads: expected layer indices (ints or digit strings), got {key!r}")
    return require_int("HeadRetention.from_local_heads layer", key, minimum=0, below=num_layers)


def _policy_name(policy: RetentionPolicy, index: int) -> str:
    if isinstance(policy, SinkWindowPolicy):
        return f"sink{policy.sink_chunks}_window{policy.window_chunks}"
    return f"group{index}"
