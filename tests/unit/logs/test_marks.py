"""marks.py: the kubelet's timestamps, the resume mark and where a fresh follower starts."""

from __future__ import annotations

import json

import pytest

from vlm_operator.api.names import LOG_MARK
from vlm_operator.logs.marks import Mark, parse_mark, parse_stamp_ns, resume_point


def test_stamp_parsing():
    assert parse_stamp_ns("2026-11-30T19:00:00.123456789Z") == 1796065200_123456789
    assert parse_stamp_ns("2026-11-30T19:00:00Z") == 1796065200_000000000
    assert parse_stamp_ns("2026-11-30T20:00:00.5+01:00") == 1796065200_500000000
    assert parse_stamp_ns("INFO") is None


def test_the_resume_mark_round_trip_and_where_a_fresh_follower_starts():
    at = 1796065200_123456789
    mark = Mark("cri://a", at, "inactive: HfRenderer not found", 1796065100.5, True)
    assert json.loads(mark.value())["time"] == "2026-11-30T19:00:00.123456789Z"
    assert parse_mark({LOG_MARK: mark.value()}) == mark
    now = 1796065200 + 3600.0
    # the mark is old: resume after it (nothing after it was handled)
    assert resume_point(mark, "cri://a", now, 60) == (at, mark)
    # the mark is recent: go back far enough to refill the incident windows
    assert resume_point(mark, "cri://a", 1796065210.0, 60)[0] == 1796065150_000000000 - 1
    # another container's mark, none, or one from the future: from the container's start
    assert resume_point(mark, "cri://b", now, 60) == (None, None)
    assert resume_point(None, "cri://a", now, 60) == (None, None)
    assert resume_point(mark, "cri://a", at / 1e9 - 3600, 60) == (None, None)


@pytest.mark.parametrize("raw", ["", "{", "[]", '{"container": "a"}', '{"time": "x"}',
                                 json.dumps({"container": "a", "time": "y" * 5000})])
def test_an_unreadable_mark_is_no_mark(raw):
    assert parse_mark({LOG_MARK: raw}) is None


@pytest.mark.parametrize("raw", ["[" * 4096, "{" * 4096, '{"time":' * 500])
def test_a_nested_mark_is_no_mark_and_never_raises(raw):
    """4,096 characters of `[` passed the length cap and raised RecursionError out of the
    follower that read it."""
    assert parse_mark({LOG_MARK: raw}) is None


def test_a_mark_with_impossible_values_is_no_mark_or_has_them_dropped():
    good = json.loads(Mark("cri://a", 1796065200_000000000).value())
    assert parse_mark({LOG_MARK: json.dumps({**good, "time": "9" * 5000})}) is None
    assert parse_mark({LOG_MARK: json.dumps({**good, "engineDeadAt": 1e999})}) == Mark(
        "cri://a", 1796065200_000000000)  # an infinite time is no time
    assert parse_mark({LOG_MARK: json.dumps({**good, "container": "c" * 5000})}) is None
