"""The JSON header of a saved-sessions file, written and checked (pure Python: no torch).

A sessions file (:mod:`~ardiff_modules.host.files`) is a safetensors file whose metadata key ``"ardiff_modules"``
holds this header; its tensors are ``pages`` (every distinct committed page once, raw bytes), ``scales`` (the
pool's FP8 scales), ``cross.<i>.k`` / ``cross.<i>.v`` (each distinct cross-attention entry once) and
``latent.<j>`` (each distinct kept latent once)::

    {"format": "ardiff_modules.sessions", "version": 1,
     "spec": {"num_layers": "2", ..., "recache": "RecacheRule(...)"},     # repr() of every KVCacheSpec field
     "pages": 6, "scales_fixed": true, "digests": {"pages": "<sha256>", ...},
     "sessions": [{"id": "s", "cross": [["text", "cond", "cross.0"], ...],
                   "branches": {"cond": {"history": [[0, 1], [2, 3]], "history_index": [0, 4],
                                         "history_start": [0, 16], "committed_chunks": 5,
                                         "committed_tokens": 20, "latents": {"4": "latent.0"},
                                         "recent": {"3": [12, 2]}, "shot_start": null,
                                         "window_floor": 0}, ...}}]}

Two branch fields are written only by the policies that need them (other files stay as above, and a file without
them loads as before, same format version): ``"kept"`` (a frame policy: each history chunk's trim, ``[full pages,
kept offsets]`` or ``null``) and ``"selection"`` (a content-selected lane between two scoring commits: its
selection's pages, first candidate position, the commit that chose it and the chosen offsets among the
candidates' pages; absent or ``null``: none)::

    "cond": {..., "kept": [[6, [0, 1]], [6, [4, 5]]],
             "selection": {"pages": [4, 5], "start": 32, "made_at": 3, "offsets": [1, 3]}}

A page shared by several branches or sessions (a fork, ``share_sinks_from``) is one index of ``pages``, named by
each chunk (or selection) that holds it. Everything read back is checked here (types, ranges, the spec field by
field): a hostile or corrupted header raises :class:`~ardiff_modules.errors.SessionFileError` naming the place.

A cache with retention groups (``KVCacheSpec(head_retention=...)``, one lane per group's head part) writes one
``pages.<lane>`` and one ``scales.<lane>`` tensor per lane, names its retention map and its lanes, and keeps each
session's branches per lane (page indices into that lane's tensor)::

    {..., "head_retention": {"format": "ardiff_modules.head_retention/1", "groups": {...}, "layers": [...]},
     "lanes": [{"name": "l/1h", "layers": [0, 1], "heads": [[0], [1]], "pages": 3}, ...],
     "sessions": [{"id": "s", "cross": [...], "lanes": [{"cond": {...}, "uncond": {...}}, ...]}]}

A file of another retention map or lane layout (or a grouped file in a uniform cache, and back) is refused
(``header.head_retention`` / ``header.lanes``) before the spec is compared; a uniform cache's file is exactly as
above, without these keys.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ardiff_modules.core.branch import BranchImage, PageChunk
from ardiff_modules.core.branch_selection import Selection
from ardiff_modules.core.frame_retention import Kept, kept_offsets, trims_frames
from ardiff_modules.core.head_retention import HeadRetention
from ardiff_modules.core.retention import SinkWindowPolicy, pins_shots
from ardiff_modules.core.selected_retention import candidates_at, selecting
from ardiff_modules.errors import SessionFileError
from ardiff_modules.spec import KVCacheSpec

FORMAT = "ardiff_modules.sessions"
#: The file format's version; a file of another version is refused (naming both).
FORMAT_VERSION = 1
#: The safetensors metadata key holding the header.
METADATA_KEY = "ardiff_modules"


@dataclass(frozen=True)
class SavedSession:
    """One session of a file: per lane, per branch its image (latents as tensor names, chunks as indices into that
    lane's pages); its cross entries as ``(cache name, branch) -> tensor name prefix``."""

    session_id: str
    lanes: tuple[dict[str, BranchImage], ...]
    cross: dict[tuple[str, str], str]

    @property
    def images(self) -> dict[str, BranchImage]:
        """The first lane's images (a uniform cache's only)."""
        return self.lanes[0]


@dataclass(frozen=True)
class LaneLayout:
    """One lane of the loading cache as a file names it: its name, model layers and each layer's kv heads
    (``()`` for a uniform cache's one lane), and its spec (its retention: what a branch's pages are checked
    against)."""

    name: str
    spec: KVCacheSpec
    layers: tuple[int, ...] = ()
    heads: tuple[tuple[int, ...], ...] = ()

    def describe(self) -> dict[str, Any]:
        """The lane's entry in ``header.lanes`` (without its page count)."""
        return {"name": self.name, "layers": list(self.layers), "heads": [list(h) for h in self.heads]}


def retention_map(heads: HeadRetention) -> dict[str, Any]:
    """The retention map a file names: :meth:`HeadRetention.to_dict`; groups of other policies than sink +
    window by their ``repr`` (such a file loads only into a cache of the same map)."""
    if all(isinstance(p, SinkWindowPolicy) for p in heads.groups.values()):
        return heads.to_dict()
    return {
        "format": "repr", "groups": {name: repr(policy) for name, policy in heads.groups.items()},
        "layers": [list(row) for row in heads.layers],
    }


def spec_fields(spec: KVCacheSpec) -> dict[str, str]:
    """``repr`` of every field of ``spec``: what a file must match to load (compared field by field)."""
    return {f.name: repr(getattr(spec, f.name)) for f in dataclasses.fields(spec)}


def encode(header: Mapping[str, Any] | list[Any]) -> str:
    return json.dumps(header, separators=(",", ":"), sort_keys=True)


class HeaderReader:
    """Checks a decoded header against one cache (its spec, the file's tensors); every refusal names the place.

    Parameters
    ----------
    where:
        The operation and its source, for messages (``"load_sessions(path)"``).
    spec:
        The loading cache's spec.
    tensor_names:
        The tensors the file holds.
    """

    def __init__(
        self, where: str, spec: KVCacheSpec, tensor_names: set[str], lanes: tuple[LaneLayout, ...] | None = None
    ) -> None:
        self.where = where
        self.spec = spec
        self.tensor_names = tensor_names
        #: The loading cache's lanes (one, the spec itself, for a uniform cache).
        self.lanes = lanes if lanes is not None else (LaneLayout("all", spec),)
        #: Pages of each lane's tensor the file holds, once :meth:`read` parsed the header.
        self.lane_pages: list[int] = [0] * len(self.lanes)
        #: The decoded header, once :meth:`read` parsed it.
        self.header: dict[str, Any] = {}

    def fail(self, place: str, expected: str, got: object) -> SessionFileError:
        return SessionFileError(f"{self.where}: {place}: expected {expected}, got {got!r:.200}")

    def int_(self, value: object, place: str, minimum: int = 0, maximum: int | None = None) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum or (
            maximum is not None and value > maximum
        ):
            bound = f"an int >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
            raise self.fail(place, bound, value)
        return value

    def list_(self, value: object, place: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(place, "a JSON list", value)
        return value

    def dict_(
        self, value: object, place: str, keys: tuple[str, ...] | None = None, optional: tuple[str, ...] = ()
    ) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(place, "a JSON object", value)
        if keys is not None and sorted(set(value) - set(optional)) != sorted(keys):
            extra = f" (and optionally {sorted(optional)})" if optional else ""
            raise self.fail(place, f"the keys {sorted(keys)}{extra}", sorted(value))
        return value

    def tensor_name(self, value: object, place: str, prefix: str) -> str:
        if not isinstance(value, str) or not value.startswith(prefix):
            raise self.fail(place, f"a tensor name starting with {prefix!r}", value)
        return value

    @property
    def grouped(self) -> bool:
        return self.spec.head_retention is not None

    @property
    def num_pages(self) -> int:
        """Pages of the first lane's tensor (a uniform cache's ``pages``)."""
        return self.lane_pages[0]

    # ------------------------------------------------------------------ the file
    def read(self, text: object) -> list[SavedSession]:
        """The sessions of header ``text`` (the metadata string), checked; :attr:`lane_pages` set."""
        if not isinstance(text, str):
            raise self.fail("metadata", f"a {METADATA_KEY!r} key (a sessions file written by save_sessions)", text)
        try:
            header = json.loads(text)
        except ValueError as e:
            raise self.fail("header", "valid JSON", str(e)) from None
        header = self.header = self.dict_(header, "header")
        if header.get("format") != FORMAT:
            raise self.fail("header.format", repr(FORMAT), header.get("format"))
        if header.get("version") != FORMAT_VERSION:
            raise self.fail("header.version", f"format version {FORMAT_VERSION}", header.get("version"))
        self.check_groups(header)
        self.check_spec(self.dict_(header.get("spec"), "header.spec"))
        if not self.grouped:
            self.lane_pages = [self.int_(header.get("pages"), "header.pages")]
        sessions = self.list_(header.get("sessions"), "header.sessions")
        saved = [self.session(s, f"sessions[{i}]") for i, s in enumerate(sessions)]
        ids = [s.session_id for s in saved]
        if len(set(ids)) != len(ids):
            raise self.fail("header.sessions", "distinct session ids", ids)
        return saved

    def check_groups(self, header: dict[str, Any]) -> None:
        """Refuse a file of another retention map or lane layout (a grouped file in a uniform cache, and back);
        with groups, read each lane's page count."""
        mine = None if self.spec.head_retention is None else retention_map(self.spec.head_retention)
        theirs = header.get("head_retention")
        if theirs != mine:
            expected = "no retention map (this cache has no retention groups)" if mine is None else (
                f"this cache's retention map {encode(mine)}"
            )
            raise self.fail("header.head_retention", expected, theirs if theirs is None else encode(theirs))
        if mine is None:
            if "lanes" in header:
                raise self.fail("header.lanes", "none (this cache has no retention groups)", header["lanes"])
            return
        lanes = self.list_(header.get("lanes"), "header.lanes")
        expected_lanes = [lane.describe() for lane in self.lanes]
        got = [{k: v for k, v in lane.items() if k != "pages"} if isinstance(lane, dict) else lane for lane in lanes]
        if got != expected_lanes:
            raise self.fail("header.lanes", f"this cache's lanes {encode(expected_lanes)}", encode(got))
        self.lane_pages = [self.int_(lane.get("pages"), f"header.lanes[{i}].pages") for i, lane in enumerate(lanes)]

    def check_spec(self, saved: dict[str, Any]) -> None:
        """Refuse a file of another spec, naming the first field that differs."""
        mine = spec_fields(self.spec)
        for name in sorted(set(mine) | set(saved)):
            if saved.get(name) != mine.get(name):
                raise SessionFileError(
                    f"{self.where}: spec field {name!r}: expected {mine.get(name)} (this cache's "
                    f"spec), got {saved.get(name)} (the file's)"
                )

    def session(self, value: object, place: str) -> SavedSession:
        entry = self.dict_(value, place, ("cross", "id", "lanes") if self.grouped else ("branches", "cross", "id"))
        sid = entry["id"]
        if not isinstance(sid, str) or not sid:
            raise self.fail(f"{place}.id", "a non-empty str", sid)
        if self.grouped:
            lanes = self.list_(entry["lanes"], f"{place}.lanes")
            if len(lanes) != len(self.lanes):
                raise self.fail(f"{place}.lanes", f"{len(self.lanes)} lanes' branches", len(lanes))
            images = tuple(self.branches(b, f"{place}.lanes[{i}]", i) for i, b in enumerate(lanes))
            self.check_clock(images, f"{place}.lanes")
        else:
            images = (self.branches(entry["branches"], f"{place}.branches", 0),)
        return SavedSession(sid, images, self.cross(entry["cross"], place))

    def branches(self, value: object, place: str, lane: int) -> dict[str, BranchImage]:
        """One lane's branches of a session."""
        branches = self.dict_(value, place, self.spec.branches)
        return {name: self.branch(branches[name], f"{place}.{name}", lane) for name in self.spec.branches}

    def check_clock(self, lanes: tuple[dict[str, BranchImage], ...], place: str) -> None:
        """Every lane of a stream keeps one clock: the same committed chunks and tokens."""
        for name in self.spec.branches:
            clocks = [(images[name].committed_chunks, images[name].committed_tokens) for images in lanes]
            if len(set(clocks)) != 1:
                raise self.fail(
                    f"{place}[*].{name}", "the same committed_chunks and committed_tokens in every lane", clocks
                )

    def cross(self, value: object, place: str) -> dict[tuple[str, str], str]:
        cross: dict[tuple[str, str], str] = {}
        for i, item in enumerate(self.list_(value, f"{place}.cross")):
            where = f"{place}.cross[{i}]"
            item = self.list_(item, where)
            if len(item) != 3 or item[0] not in self.spec.cross_attention_names or item[1] not in self.spec.branches:
                raise self.fail(
                    where, f"[cache name of {self.spec.cross_attention_names}, branch of {self.spec.branches}, "
                    "tensor]", item,
                )
            if (item[0], item[1]) in cross:
                raise self.fail(where, "each (cache name, branch) once", item[:2])
            cross[(item[0], item[1])] = self.tensor_name(item[2], f"{where}[2]", "cross.")
        return cross

    def branch(self, value: object, place: str, lane: int = 0) -> BranchImage:
        """One branch's image in lane ``lane`` (its pages index that lane's tensor; its retention is the lane's)."""
        b = self.dict_(value, place, _BRANCH_KEYS,
                       (*_SHOT_KEYS, "slots", "kept", "selection", "frame_slots", "selection_slots"))
        # NOTE: positions are int64 on the device: a count past these bounds would load and then overflow in the
        # next forward (a raw error far from the file).
        most = _MAX_POSITION // self.spec.chunk_size
        committed = self.int_(b["committed_chunks"], f"{place}.committed_chunks", 0, most)
        tokens = self.int_(b["committed_tokens"], f"{place}.committed_tokens", 0, committed * self.spec.chunk_size)
        history = self.chunks(b["history"], f"{place}.history", lane)
        index = [self.int_(i, f"{place}.history_index", 0, committed - 1)
                 for i in self.list_(b["history_index"], place)]
        start = [self.int_(s, f"{place}.history_start", 0, tokens) for s in self.list_(b["history_start"], place)]
        if len(index) != len(history) or len(start) != len(history) or index != sorted(set(index)):
            raise self.fail(f"{place}.history_index", f"{len(history)} increasing commit indices and starts", index)
        page_size = self.spec.page_size
        kept = self.kept(b.get("kept", []), f"{place}.kept", history, index, committed, lane)
        ends = [s + (len(c) if k is None else k.full) * page_size for s, c, k in zip(start, history, kept or [None] * len(history))]
        if any(e > s for e, s in zip(ends, start[1:] + [tokens + 1])) or any(e > tokens for e in ends):
            raise self.fail(f"{place}.history_start", f"chunks in order, ending by committed_tokens={tokens}", start)
        recent = {}
        for key, span in self.dict_(b["recent"], f"{place}.recent").items():
            i = self.int_(_int_key(key), f"{place}.recent key", 0, committed - 1)
            span = self.list_(span, f"{place}.recent[{key}]")
            if len(span) != 2 or i in index:
                raise self.fail(f"{place}.recent[{key}]", "[start, pages] of an evicted chunk", span)
            recent[i] = (self.int_(span[0], f"{place}.recent[{key}]", 0, tokens),
                         self.int_(span[1], f"{place}.recent[{key}]", 1, self.spec.pages_per_chunk))
        latents = {}
        for key, name in self.dict_(b["latents"], f"{place}.latents").items():
            i = self.int_(_int_key(key), f"{place}.latents key", 0, committed - 1)
            if i not in index and i not in recent:
                raise self.fail(f"{place}.latents", "latents of resident or remembered chunks only", i)
            latents[i] = self.tensor_name(name, f"{place}.latents[{key}]", "latent.")
        shot_start, floor = self.shots(b, place, committed, index, lane)
        slots = self.slots(b.get("slots", []), f"{place}.slots", len(history), lane)
        selection = self.selection(b.get("selection"), f"{place}.selection", lane, committed, history, floor)
        frame_slots, selection_slots = self.frame_slots(b, place, history, selection)
        return BranchImage(
            tuple(history), tuple(index), tuple(start), committed, tokens, latents, recent, slots, shot_start, floor,
            kept, selection, frame_slots, selection_slots,
        )

    def frame_slots(
        self, b: dict[str, Any], place: str, history: list[PageChunk], selection: Selection | None
    ) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
        """A frame lane's frame slots (absent: none known, a load into a frame extent lays frames out in history
        order): per history chunk one slot per frame of it, and the selection's; all distinct. Where they do not fit
        the loading cache's extent the load falls back to history order (``lane_store.saved_frame_slots``)."""
        if "frame_slots" not in b:
            return (), ()
        items = self.list_(b["frame_slots"], f"{place}.frame_slots")
        most = 1 << 16  # (slot indices are bounded by the loading lane's extent, checked where they are laid out)
        out = tuple(tuple(self.int_(s, f"{place}.frame_slots[{i}]", 0, most)
                          for s in self.list_(item, f"{place}.frame_slots[{i}]")) for i, item in enumerate(items))
        own = tuple(self.int_(s, f"{place}.selection_slots", 0, most)
                    for s in self.list_(b.get("selection_slots", []), f"{place}.selection_slots"))
        taken = [s for ss in out for s in ss] + list(own)
        if len(out) != len(history) or len(set(taken)) != len(taken) or (own and selection is None):
            raise self.fail(f"{place}.frame_slots", f"{len(history)} lists of distinct frame slots, one per history "
                            "chunk, and the selection's (with a selection only)", items)
        return out, own

    def selection(
        self, value: object, place: str, lane: int, committed: int, history: list[PageChunk], floor: int = 0
    ) -> Selection | None:
        """A branch's content selection (``null`` or absent: none; ``pages`` index the lane's tensor). Only a lane
        whose policy selects has one, made by the last commit (a selection lives until the next commit), at the
        candidates that commit scores (above the branch's ``window_floor``, ``floor`` chunks: a dropped window or
        shared sinks); ``keep_frames`` frames of pages, none a chunk's, and one offset among the candidates' pages
        per page, increasing."""
        if value is None:
            return None
        spec = self.lanes[lane].spec
        policy = selecting(spec.policy)
        if policy is None:
            raise self.fail(place, f"null (the lane's policy {spec.policy!r} selects no content)", value)
        s = self.dict_(value, place, ("made_at", "offsets", "pages", "start"))
        per_frame = spec.pages_per_chunk // policy.frames_per_chunk
        size = policy.selected_pages(per_frame)
        pages = [self.int_(p, f"{place}.pages", 0, self.lane_pages[lane] - 1) for p in self.list_(s["pages"], place)]
        if len(pages) != size:
            raise self.fail(
                f"{place}.pages", f"{size} pages (keep_frames={policy.keep_frames} frames of {per_frame})", pages
            )
        if len(set(pages)) != len(pages) or not {p for c in history for p in c}.isdisjoint(pages):
            raise self.fail(f"{place}.pages", "each page once in a branch (none of its chunks')", pages)
        made_at = self.int_(s["made_at"], f"{place}.made_at", 0, committed - 1)
        if made_at != committed - 1:
            raise self.fail(
                f"{place}.made_at", f"the last commit, {committed - 1} (a selection lives until the next commit)",
                made_at,
            )
        found = candidates_at(spec.policy, made_at, floor * policy.frames_per_chunk)
        if found is None:
            raise self.fail(f"{place}.made_at", f"a commit that selects under {spec.policy!r}", made_at)
        tokens = per_frame * spec.page_size
        start = self.int_(s["start"], f"{place}.start")
        if start != found[0] * tokens:
            raise self.fail(
                f"{place}.start", f"{found[0] * tokens} (the first candidate frame {found[0]} of commit {made_at}, "
                f"{tokens} tokens a frame)", start,
            )
        candidates = policy.frames_per_chunk * per_frame
        offsets = [self.int_(o, f"{place}.offsets", 0, candidates - 1) for o in self.list_(s["offsets"], place)]
        if offsets != sorted(set(offsets)) or len(offsets) != len(pages):
            raise self.fail(
                f"{place}.offsets", f"{len(pages)} increasing offsets among the {candidates} candidate pages", offsets
            )
        return Selection(tuple(pages), start, made_at, tuple(offsets))

    def kept(
        self, value: object, place: str, history: list[PageChunk], index: list[int], committed: int, lane: int
    ) -> tuple[Kept | None, ...]:
        """Each history chunk's trim (``[full pages, kept offsets]``, ``null``: whole); ``[]``: none trimmed. Only
        a lane whose policy trims chunks to frames has them, and each must be the one its policy keeps."""
        items = self.list_(value, place)
        spec = self.lanes[lane].spec
        if not trims_frames(spec.policy):
            if items:
                raise self.fail(place, "no trimmed chunks (the lane's policy keeps whole chunks)", items)
            return ()
        per_frame = spec.pages_per_chunk // spec.policy.frames_per_chunk  # type: ignore[attr-defined]
        if len(items) != len(history):
            raise self.fail(place, f"{len(history)} trims, one per history chunk", items)
        out: list[Kept | None] = []
        for j, (item, chunk, i) in enumerate(zip(items, history, index)):
            want = kept_offsets(spec.policy, i, committed, per_frame)
            got = None if item is None else self.list_(item, f"{place}[{j}]")
            trim = None if got is None or len(got) != 2 else Kept(got[0], tuple(self.list_(got[1], f"{place}[{j}]")))
            whole = len(want) == spec.pages_per_chunk
            # (a subset: a fork of the sinks alone holds only their frames)
            if (trim is None and not (whole and got is None)) or (trim is not None and (
                trim.full != spec.pages_per_chunk or not trim.offsets or list(trim.offsets) != sorted(set(trim.offsets))
                or not set(trim.offsets) <= set(want) or len(trim.offsets) == trim.full or len(chunk) != len(trim.offsets)
            )):
                raise self.fail(f"{place}[{j}]", f"chunk {i}'s trim under {spec.policy!r}: increasing offsets among "
                                f"{list(want)} of {spec.pages_per_chunk} pages (null: whole), one per page held", item)
            out.append(trim)
        return tuple(out)

    def slots(self, value: object, place: str, chunks: int, lane: int = 0) -> tuple[int | None, ...]:
        """Each history chunk's extent slot (``null``: none), distinct; ``[]`` (a file without them): none known."""
        items = self.list_(value, place)
        if not items:
            return ()
        bound = (self.lanes[lane].spec.max_history_chunks or 0) + 1
        slots = [None if s is None else self.int_(s, f"{place}[{i}]", 0, bound - 1) for i, s in enumerate(items)]
        taken = [s for s in slots if s is not None]
        if len(slots) != chunks or len(set(taken)) != len(taken):
            raise self.fail(place, f"{chunks} distinct extent slots (or null), one per history chunk", items)
        return tuple(slots)

    def shots(
        self, b: dict[str, Any], place: str, committed: int, index: list[int], lane: int = 0
    ) -> tuple[int | None, int]:
        """A branch's ``shot_start`` (``null``: none; only with a shot policy) and ``window_floor`` (no resident
        non-sink chunk below it); absent in files written before them: none and 0."""
        floor = self.int_(b.get("window_floor", 0), f"{place}.window_floor", 0, committed)
        policy = self.lanes[lane].spec.policy
        sinks = policy.sink_chunks
        if any(sinks <= i < floor for i in index):
            raise self.fail(f"{place}.window_floor", f"no resident non-sink chunk below it ({floor})", index)
        shot = b.get("shot_start")
        if shot is not None:
            if not pins_shots(policy):
                raise self.fail(f"{place}.shot_start", "null (this spec's retention pins no shot sink)", shot)
            shot = self.int_(shot, f"{place}.shot_start", 0, committed)
        return shot, floor

    def chunks(self, value: object, place: str, lane: int = 0) -> list[PageChunk]:
        """History chunks of page indices: each 1..pages_per_chunk distinct pages of the lane's tensor, no page
        twice."""
        chunks = []
        for i, chunk in enumerate(self.list_(value, place)):
            chunk = self.list_(chunk, f"{place}[{i}]")
            if not 1 <= len(chunk) <= self.spec.pages_per_chunk:
                raise self.fail(f"{place}[{i}]", f"1..{self.spec.pages_per_chunk} pages", chunk)
            chunks.append(tuple(self.int_(p, f"{place}[{i}]", 0, self.lane_pages[lane] - 1) for p in chunk))
        bound = self.lanes[lane].spec.max_history_chunks
        if bound is not None and len(chunks) > bound:
            raise self.fail(place, f"at most {bound} resident chunks (sinks + window)", len(chunks))
        pages = [p for c in chunks for p in c]
        if len(set(pages)) != len(pages):
            raise self.fail(place, "each page once in a branch", pages)
        return chunks


#: The fields of one branch in the header.
_BRANCH_KEYS = (
    "committed_chunks", "committed_tokens", "history", "history_index", "history_start", "latents", "recent",
)


#: The fields of one branch a file may lack (written since): ``shot_start`` and ``window_floor``.
_SHOT_KEYS = ("shot_start", "window_floor")


#: The largest token position a loaded session may reach (positions are int64 on the device; 2**53 keeps them
#: exact in float64 RoPE tables too).
_MAX_POSITION = 2**53


def _int_key(key: str) -> object:
    """A JSON object key that should be a commit index (JSON keys are strings; ASCII digits only: ``"²"`` is a
    digit to ``str.isdigit`` but not to ``int``)."""
    return int(key) if key.isascii() and key.isdigit() and len(key) < 19 else key
