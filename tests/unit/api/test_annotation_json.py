"""api/annotation_json.py: JSON from annotation text a tenant may have written is bounded in
length and nesting before it is parsed, and never raises."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vlm_operator.api.annotation_json import MAX_CHARS, MAX_DEPTH, UNREADABLE, read, too_deep


def test_the_operator_s_own_values_read_back():
    value = {"uid": {"action": "Replace", "before": ["a", "b"], "since": 1.5}}
    assert read(json.dumps(value)) == value
    assert read("[1.5, 2]") == [1.5, 2]
    assert read(None) is None and read("") is None  # no annotation: not unreadable


@pytest.mark.parametrize("raw", [
    "[" * 200_000,  # Python's parser raised RecursionError
    "{" * 4096,
    '{"a":' * 5000 + "1" + "}" * 5000,  # well-formed, still too deep
    "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1),
    "not json", '{"a": 1', "\x00", b"[]", 12,
    " " * (MAX_CHARS + 1),
    "[" + "1," * (MAX_CHARS // 2) + "1]",  # too long
])
def test_bad_text_is_unreadable_never_an_exception(raw):
    assert read(raw) is UNREADABLE


def test_brackets_inside_strings_are_not_nesting():
    raw = json.dumps({"reason": "[" * 10_000 + "\\\"{" * 100})
    assert not too_deep(json.loads(raw), 1)
    assert read(raw) == json.loads(raw)
    assert read("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not UNREADABLE


def test_a_lower_length_cap_applies():
    assert read('"' + "a" * 10 + '"', max_chars=8) is UNREADABLE


@given(st.text(max_size=300))
def test_any_text_reads_without_raising(raw):
    read(raw)
    read("[" * 50 + raw)


def test_depth_is_counted_exactly_and_empty_containers_count():
    assert not too_deep([[[]]], 3) and too_deep([[[[]]]], 3)
    assert not too_deep({"a": {"b": [1]}}, 3) and too_deep({"a": {"b": [{}]}}, 3)
    assert too_deep([[], [], [[[[]]]]], 4) and not too_deep([[], [[[]]]], 4)
    assert not too_deep("[[[[[[", 1) and not too_deep(None, 0)
