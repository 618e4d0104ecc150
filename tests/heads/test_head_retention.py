"""HeadRetention: parts, files, constructors and their refusals (pure Python)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ardiff_modules as am
from ardiff_modules.core.head_retention import FILE_FORMAT


def test_parts_group_equal_head_counts_across_layers_and_keep_exact_heads() -> None:
    heads = am.HeadRetention(
        {"local": (0, 1), "global": (1, 6)},
        [["global", "local", "local", "global"], ["local"] * 4, ["local", "global", "global", "local"]],
    )
    parts = heads.parts()
    assert [(p.name, p.layers, p.heads) for p in parts] == [
        ("local/2h", (0, 2), ((1, 2), (0, 3))),
        ("local/4h", (1,), ((0, 1, 2, 3),)),
        ("global/2h", (0, 2), ((0, 3), (1, 2))),
    ]
    assert parts[2].policy == am.SinkWindowPolicy(1, 6)
    # (layer, head, chunk) triples one branch holds at its peak: 8 local heads x 2 + 4 global x 8.
    assert heads.resident_head_chunks() == 8 * 2 + 4 * 8


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 4).flatmap(
        lambda h: st.lists(st.lists(st.sampled_from("abc"), min_size=h, max_size=h), min_size=1, max_size=5)
    )
)
def test_parts_cover_every_layer_head_exactly_once(rows: list[list[str]]) -> None:
    heads = am.HeadRetention({"a": (0, 1), "b": (1, 2), "c": (2, 0)}, rows)
    seen: list[tuple[int, int]] = []
    for part in heads.parts():
        assert all(len(h) == part.num_heads for h in part.heads)
        for layer, layer_heads in zip(part.layers, part.heads):
            assert all(rows[layer][h] == part.group for h in layer_heads)
            seen.extend((layer, h) for h in layer_heads)
    assert sorted(seen) == [(layer, h) for layer in range(len(rows)) for h in range(len(rows[0]))]


def test_json_round_trip_and_the_file_format(tmp_path) -> None:
    heads = am.HeadRetention.from_local_heads(3, 4, {"0": [1, 3], 2: [0]}, local=(0, 1), other=(1, 6))
    path = tmp_path / "heads.json"
    heads.to_json(path)
    data = json.loads(path.read_text())
    assert data["format"] == FILE_FORMAT
    assert data["groups"] == {"local": {"sink_chunks": 0, "window_chunks": 1},
                              "other": {"sink_chunks": 1, "window_chunks": 6}}
    assert data["layers"][0] == ["other", "local", "other", "local"]
    assert data["layers"][1] == ["other"] * 4
    assert am.HeadRetention.from_json(path) == heads


def test_per_layer_windows_share_groups_by_retention() -> None:
    heads = am.HeadRetention.per_layer([(1, 6), (0, 2), (1, 6)], num_kv_heads=2)
    assert [(p.name, p.layers) for p in heads.parts()] == [("sink1_window6/2h", (0, 2)), ("sink0_window2/2h", (1,))]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: am.HeadRetention({}, [["a"]]), "non-empty mapping"),
        (lambda: am.HeadRetention({"a": (0, 1)}, [["a", "b"]]), r"group names from \('a',\), got \['b'\]"),
        (lambda: am.HeadRetention({"a": (0, 1)}, [["a", "a"], ["a"]]), "expected 2 kv heads"),
        (lambda: am.HeadRetention({"a": (-1, 1)}, [["a"]]), "sink_chunks"),
        (lambda: am.HeadRetention({"a": {"sink": 1}}, [["a"]]), "sink_chunks / window_chunks"),
        (lambda: am.HeadRetention({"a": 3}, [["a"]]), "RetentionPolicy"),
        (lambda: am.HeadRetention.from_local_heads(2, 2, {5: [0]}), r"layer: expected an int in \[0, 2\)"),
        (lambda: am.HeadRetention.from_local_heads(2, 2, {0: [2]}), r"expected an int in \[0, 2\)"),
        (lambda: am.HeadRetention.from_dict({"groups": {}}), "expected format"),
    ],
)
def test_bad_configurations_name_what_was_expected(make, match) -> None:
    with pytest.raises(am.SpecError, match=match):
        make()


def test_a_file_that_is_not_json_is_a_spec_error(tmp_path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(am.SpecError, match="expected JSON"):
        am.HeadRetention.from_json(path)


def test_only_sink_window_groups_are_written() -> None:
    heads = am.HeadRetention({"m": am.SinkWindowMemoryPolicy(1, 2, 2, 1)}, [["m"]])
    with pytest.raises(am.SpecError, match="SinkWindowMemoryPolicy"):
        heads.to_dict()


# ---------------------------------------------------------------------- issue 40: smaller holes


@pytest.mark.parametrize(
    ("local_heads", "match"),
    [
        ({0: 1}, r"local_heads\[0\]: expected a sequence of head indices \(e.g. \[1, 3\]\), got 1 \(int\)"),
        ({"1": "01"}, r"local_heads\['1'\]: expected a sequence of head indices .*got '01' \(str\)"),
        ({0: b"\x01"}, r"local_heads\[0\]: expected a sequence of head indices .*\(bytes\)"),
        ([[1], [0]], r"local_heads: expected a mapping of layer index -> head indices, got list"),
    ],
)
def test_from_local_heads_refuses_a_bare_head_or_a_list_of_layers(local_heads, match) -> None:
    """``{0: 1}`` used to raise a raw TypeError ('int' object is not iterable); b"\\x01" read as head 1."""
    with pytest.raises(am.SpecError, match=match):
        am.HeadRetention.from_local_heads(2, 2, local_heads)


def test_a_file_that_is_not_utf8_is_a_spec_error_naming_the_file_and_the_byte(tmp_path) -> None:
    path = tmp_path / "latin1.json"
    text = json.dumps(am.HeadRetention.uniform(1, 1, (0, 1)).to_dict())
    path.write_bytes(text.encode()[:-1] + " \"caf\xe9\"}".encode("latin-1"))  # a Latin-1 byte at the end
    offset = len(text) + 4
    with pytest.raises(am.SpecError, match=rf"from_json\('.*latin1.json'\): expected UTF-8 JSON text, got byte "
                                           rf"b'\\xe9' at offset {offset} "):
        am.HeadRetention.from_json(path)


def write_groups(path, groups: dict) -> None:
    path.write_text(json.dumps({"format": FILE_FORMAT, "groups": groups, "layers": [["a"]]}))


def test_a_group_without_window_chunks_is_refused_naming_the_key_and_the_file(tmp_path) -> None:
    """A missing window_chunks used to load as an unbounded window (the whole history resident)."""
    path = tmp_path / "heads.json"
    write_groups(path, {"a": {"sink_chunks": 1}})
    with pytest.raises(am.SpecError, match=r"from_json\('.*heads.json'\): HeadRetention.groups\['a'\]: expected key "
                                           r"'window_chunks' \(an int, or null / None for an unbounded window\), "
                                           r"got keys \['sink_chunks'\]"):
        am.HeadRetention.from_json(path)
    with pytest.raises(am.SpecError, match=r"expected key 'window_chunks'.*got keys \[\]"):
        am.HeadRetention({"a": {}}, [["a"]])
    # Unbounded stays possible, said explicitly; sink_chunks keeps its default of 0.
    write_groups(path, {"a": {"window_chunks": None}})
    assert am.HeadRetention.from_json(path).groups["a"] == am.SinkWindowPolicy(0, None)


def test_a_file_window_past_the_int32_offsets_is_refused_naming_the_file(tmp_path) -> None:
    path = tmp_path / "heads.json"
    write_groups(path, {"a": {"sink_chunks": 0, "window_chunks": 10**12}})
    with pytest.raises(am.SpecError, match=r"from_json\('.*heads.json'\): HeadRetention.groups\['a'\]: expected at "
                                           r"most 2147483646 .*int32.*window_chunks=1000000000000"):
        am.HeadRetention.from_json(path)
