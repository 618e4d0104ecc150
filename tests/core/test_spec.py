"""KVCacheSpec / CrossAttentionSpec: validation errors, valid specs and derived sizes."""

from __future__ import annotations

import dataclasses

import pytest

from ardiff_modules.errors import ARDiffError, SpecError, UnknownCacheError
from ardiff_modules.spec import SUPPORTED_DTYPES, CrossAttentionSpec, KVCacheSpec

BASE = dict(num_layers=2, num_kv_heads=2, head_dim=4, chunk_size=4, page_size=2)


def make(**overrides):
    return KVCacheSpec(**{**BASE, **overrides})


def assert_spec_error(exc_info, *fragments: str) -> None:
    err = exc_info.value
    assert isinstance(err, SpecError)
    assert isinstance(err, ValueError)
    assert isinstance(err, ARDiffError)
    msg = str(err)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"


# ---------------------------------------------------------------------- valid specs


def test_minimal_spec_defaults():
    spec = make()
    assert spec.sink_chunks == 0
    assert spec.window_chunks is None
    assert spec.branches == ("main",)
    assert spec.cross_attention == ()
    assert spec.dtype == "bfloat16"
    assert spec.pages_per_chunk == 2
    assert spec.max_history_chunks is None
    assert spec.pages_per_branch() is None
    assert spec.pages_per_branch(3) is None
    assert spec.cross_attention_names == ()


def test_full_spec():
    text = CrossAttentionSpec("text", 512)
    image = CrossAttentionSpec("image", 257, num_kv_heads=4, head_dim=64)
    spec = KVCacheSpec(
        num_layers=30,
        num_kv_heads=12,
        head_dim=128,
        chunk_size=4680,
        page_size=120,
        sink_chunks=1,
        window_chunks=6,
        branches=("cond", "uncond"),
        cross_attention=(text, image),
        dtype="float16",
    )
    assert spec.pages_per_chunk == 39
    assert spec.max_history_chunks == 7
    assert spec.pages_per_branch() == 8 * 39
    assert spec.pages_per_branch(1) == 8 * 39
    assert spec.pages_per_branch(2) == 9 * 39
    assert spec.pages_per_branch(0) == 7 * 39
    assert spec.cross_attention_names == ("text", "image")
    assert spec.cross_attention_spec("image") is image
    assert spec.cross_attention_spec("text") is text


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
def test_every_supported_dtype(dtype):
    assert make(dtype=dtype).dtype == dtype


@pytest.mark.parametrize(
    "chunk_size,page_size,expected",
    [(4, 1, 4), (4, 2, 2), (4, 4, 1), (4680, 120, 39), (4680, 8, 585), (1560, 1560, 1), (6, 3, 2)],
)
def test_pages_per_chunk(chunk_size, page_size, expected):
    assert make(chunk_size=chunk_size, page_size=page_size).pages_per_chunk == expected


@pytest.mark.parametrize(
    "sink,window,pending,expected",
    [
        (0, 0, 1, 1 * 2),
        (0, 0, 0, 0),
        (1, 0, 1, 2 * 2),
        (0, 3, 1, 4 * 2),
        (2, 3, 1, 6 * 2),
        (2, 3, 4, 9 * 2),
        (1, 6, 2, 9 * 2),
    ],
)
def test_pages_per_branch(sink, window, pending, expected):
    spec = make(sink_chunks=sink, window_chunks=window)
    assert spec.max_history_chunks == sink + window
    assert spec.pages_per_branch(pending) == expected


def test_window_none_means_unbounded_even_with_sinks():
    spec = make(sink_chunks=3, window_chunks=None)
    assert spec.max_history_chunks is None
    assert spec.pages_per_branch(1) is None


def test_lists_are_stored_as_tuples_and_spec_is_hashable_and_frozen():
    spec = make(branches=["cond", "uncond"], cross_attention=[CrossAttentionSpec("text", 8)])
    assert spec.branches == ("cond", "uncond")
    assert isinstance(spec.cross_attention, tuple)
    assert hash(spec) == hash(make(branches=("cond", "uncond"), cross_attention=(CrossAttentionSpec("text", 8),)))
    assert spec == make(branches=("cond", "uncond"), cross_attention=(CrossAttentionSpec("text", 8),))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.chunk_size = 8  # type: ignore[misc]


def test_single_branch_string_is_not_split_into_characters():
    """``branches="cond"`` must never silently become ('c', 'o', 'n', 'd').

    Either a SpecError (naming the field) or the single branch ("cond",) is acceptable.
    """
    try:
        spec = make(branches="cond")
    except SpecError as err:
        assert "branches" in str(err)
    else:
        assert spec.branches == ("cond",)


def test_cross_attention_spec_unknown_name():
    spec = make(cross_attention=(CrossAttentionSpec("text", 8),))
    with pytest.raises(UnknownCacheError) as exc_info:
        spec.cross_attention_spec("image")
    assert isinstance(exc_info.value, KeyError)
    assert "'image'" in str(exc_info.value)
    assert "'text'" in str(exc_info.value)


# ---------------------------------------------------------------------- KVCacheSpec validation

INT_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "chunk_size", "page_size")


@pytest.mark.parametrize("name", INT_FIELDS)
@pytest.mark.parametrize("bad", [0, -1])
def test_positive_int_fields_below_minimum(name, bad):
    overrides = {name: bad}
    if name == "chunk_size":
        overrides["page_size"] = 1
    with pytest.raises(SpecError) as exc_info:
        make(**overrides)
    assert_spec_error(exc_info, f"KVCacheSpec.{name}", "expected an int >= 1", f"got {bad}")


@pytest.mark.parametrize("name", INT_FIELDS)
@pytest.mark.parametrize("bad,type_name", [(2.0, "float"), ("4", "str"), (True, "bool"), (None, "NoneType")])
def test_positive_int_fields_wrong_type(name, bad, type_name):
    with pytest.raises(SpecError) as exc_info:
        make(**{name: bad})
    assert_spec_error(exc_info, f"KVCacheSpec.{name}", "expected an int >= 1", f"got {bad!r}", type_name)


@pytest.mark.parametrize("bad", [-1, -5])
def test_sink_chunks_negative(bad):
    with pytest.raises(SpecError) as exc_info:
        make(sink_chunks=bad)
    assert_spec_error(exc_info, "KVCacheSpec.sink_chunks", "expected an int >= 0", f"got {bad}")


@pytest.mark.parametrize("bad,type_name", [(1.0, "float"), (None, "NoneType"), (False, "bool")])
def test_sink_chunks_wrong_type(bad, type_name):
    with pytest.raises(SpecError) as exc_info:
        make(sink_chunks=bad)
    assert_spec_error(exc_info, "KVCacheSpec.sink_chunks", "expected an int >= 0", f"got {bad!r}", type_name)


@pytest.mark.parametrize("bad", [-1, -3])
def test_window_chunks_negative(bad):
    with pytest.raises(SpecError) as exc_info:
        make(window_chunks=bad)
    assert_spec_error(exc_info, "KVCacheSpec.window_chunks", "expected an int >= 0", f"got {bad}")


@pytest.mark.parametrize("bad,type_name", [(1.5, "float"), ("6", "str"), (True, "bool")])
def test_window_chunks_wrong_type(bad, type_name):
    with pytest.raises(SpecError) as exc_info:
        make(window_chunks=bad)
    assert_spec_error(exc_info, "KVCacheSpec.window_chunks", "expected an int >= 0", f"got {bad!r}", type_name)


@pytest.mark.parametrize("chunk_size,page_size", [(4, 3), (4680, 7), (4, 8), (6, 4)])
def test_page_size_not_dividing_chunk_size(chunk_size, page_size):
    with pytest.raises(SpecError) as exc_info:
        make(chunk_size=chunk_size, page_size=page_size)
    assert_spec_error(
        exc_info,
        "KVCacheSpec.page_size",
        f"expected a divisor of chunk_size={chunk_size}",
        f"got {page_size}",
        f"remainder {chunk_size % page_size}",
    )


def test_branches_empty():
    with pytest.raises(SpecError) as exc_info:
        make(branches=())
    assert_spec_error(exc_info, "KVCacheSpec.branches", "expected at least one name", "got an empty tuple")


@pytest.mark.parametrize("bad", ["", 3, None])
def test_branches_bad_name(bad):
    with pytest.raises(SpecError) as exc_info:
        make(branches=("cond", bad))
    assert_spec_error(exc_info, "KVCacheSpec.branches", "expected non-empty strings", f"got {bad!r}")


def test_branches_duplicate():
    with pytest.raises(SpecError) as exc_info:
        make(branches=("cond", "uncond", "cond"))
    assert_spec_error(exc_info, "KVCacheSpec.branches", "expected unique names", "('cond', 'uncond', 'cond')")


def test_cross_attention_items_must_be_specs():
    with pytest.raises(SpecError) as exc_info:
        make(cross_attention=(("text", 512),))
    assert_spec_error(exc_info, "KVCacheSpec.cross_attention", "expected CrossAttentionSpec items", "('text', 512)")


def test_cross_attention_duplicate_names():
    with pytest.raises(SpecError) as exc_info:
        make(cross_attention=(CrossAttentionSpec("text", 8), CrossAttentionSpec("text", 16)))
    assert_spec_error(exc_info, "KVCacheSpec.cross_attention", "expected unique cache names", "('text', 'text')")


@pytest.mark.parametrize("bad", ["float64", "bf16", "int8", None])
def test_unsupported_dtype(bad):
    with pytest.raises(SpecError) as exc_info:
        make(dtype=bad)
    assert_spec_error(exc_info, "KVCacheSpec.dtype", "expected one of", "'bfloat16'", f"got {bad!r}")


# ---------------------------------------------------------------------- CrossAttentionSpec validation


def test_cross_attention_spec_valid():
    c = CrossAttentionSpec("text", 512)
    assert (c.name, c.tokens, c.num_kv_heads, c.head_dim) == ("text", 512, None, None)
    c = CrossAttentionSpec("image", 1, num_kv_heads=1, head_dim=1)
    assert (c.num_kv_heads, c.head_dim) == (1, 1)
    assert hash(c) == hash(CrossAttentionSpec("image", 1, num_kv_heads=1, head_dim=1))


@pytest.mark.parametrize("bad", ["", None, 3])
def test_cross_attention_spec_bad_name(bad):
    with pytest.raises(SpecError) as exc_info:
        CrossAttentionSpec(bad, 8)
    assert_spec_error(exc_info, "CrossAttentionSpec.name", "expected a non-empty string", f"got {bad!r}")


@pytest.mark.parametrize("bad", [0, -4])
def test_cross_attention_spec_tokens_below_minimum(bad):
    with pytest.raises(SpecError) as exc_info:
        CrossAttentionSpec("text", bad)
    assert_spec_error(exc_info, "CrossAttentionSpec.tokens", "expected an int >= 1", f"got {bad}")


@pytest.mark.parametrize("bad,type_name", [(8.0, "float"), ("8", "str"), (True, "bool")])
def test_cross_attention_spec_tokens_wrong_type(bad, type_name):
    with pytest.raises(SpecError) as exc_info:
        CrossAttentionSpec("text", bad)
    assert_spec_error(exc_info, "CrossAttentionSpec.tokens", f"got {bad!r}", type_name)


@pytest.mark.parametrize("field_name", ["num_kv_heads", "head_dim"])
@pytest.mark.parametrize("bad", [0, -1, 2.0])
def test_cross_attention_spec_optional_ints(field_name, bad):
    with pytest.raises(SpecError) as exc_info:
        CrossAttentionSpec("text", 8, **{field_name: bad})
    assert_spec_error(exc_info, f"CrossAttentionSpec.{field_name}", "expected an int >= 1", f"got {bad}")


@pytest.mark.parametrize(
    "field_name,bad",
    [
        ("cross_attention", CrossAttentionSpec("text", 8)),  # a bare spec instead of a tuple of specs
        ("cross_attention", None),
        ("branches", None),
    ],
)
def test_non_iterable_collection_fields_raise_spec_error(field_name, bad):
    """A natural misuse (forgetting the tuple) must raise SpecError naming the field, not a bare TypeError."""
    with pytest.raises(SpecError) as exc_info:
        make(**{field_name: bad})
    assert_spec_error(exc_info, f"KVCacheSpec.{field_name}", f"got {bad!r}")


# ---------------------------------------------------------------------- int32 index bound (issue 40)


@pytest.mark.parametrize(
    ("overrides", "field_name", "actual"),
    [
        (dict(window_chunks=10**12), "KVCacheSpec.window_chunks", "sink_chunks=0 + window_chunks=1000000000000"),
        # chunk_size=4: 2**31 - 1 tokens hold 536870911 chunks, one of them pending.
        (dict(sink_chunks=1, window_chunks=536870910), "KVCacheSpec.window_chunks", "window_chunks=536870910"),
        (dict(sink_chunks=10**12), "KVCacheSpec.sink_chunks", "sink_chunks=1000000000000 + window_chunks=None"),
    ],
)
def test_a_window_past_the_kernels_int32_offsets_is_refused_at_the_spec(overrides, field_name, actual):
    with pytest.raises(SpecError) as exc_info:
        make(**overrides)
    assert_spec_error(exc_info, field_name, "expected at most 536870910", "chunk_size=4", "int32", "2147483647", actual)


def test_the_largest_window_the_kernels_can_index_is_accepted():
    assert make(sink_chunks=1, window_chunks=536870909).max_history_chunks == 536870910


def test_a_retention_policy_past_the_int32_offsets_is_refused_naming_it():
    from ardiff_modules.core.retention import SinkWindowMemoryPolicy

    with pytest.raises(SpecError) as exc_info:
        make(retention=SinkWindowMemoryPolicy(1, 2, 1, 10**9))
    assert_spec_error(exc_info, "KVCacheSpec.retention", "SinkWindowMemoryPolicy", "max_history_chunks=1000000003")
