"""logfollow.py: line splitting with a bounded buffer, resume de-duplication, the kubelet's
timestamps, and when a follower reconnects."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from vlm_operator.logfollow import (
    END_PAUSE_S,
    ENDED,
    ERROR,
    QUIET,
    RETRY_MAX_S,
    RETRY_MIN_S,
    Dedupe,
    LineSplitter,
    parse_stamp_ns,
    retry_wait,
)


def test_lines_split_on_newline_only_and_keep_carriage_returns():
    s = LineSplitter()
    assert s.feed(b"a\r\nb") == [b"a\r"]
    assert s.feed(b"c\n\n") == [b"bc", b""]
    assert s.rest() == b""


@given(st.lists(st.binary(max_size=40), max_size=30), st.integers(4, 30))
def test_split_equals_bytes_split_with_long_lines_cut(chunks, limit):
    s = LineSplitter(limit)
    got = [line for chunk in chunks for line in s.feed(chunk)] + [s.rest()]
    want = b"".join(chunks).split(b"\n")
    assert got == [line[:limit] for line in want]
    assert s.truncated == sum(len(line) > limit for line in want)


def test_an_endless_line_holds_bounded_memory():
    """Defect: `rest + chunk` grew one buffer per chunk (quadratic) for a line with no
    newline; now at most max_bytes are kept, and the line arrives cut to its start."""
    s = LineSplitter(1024)
    head = b"ERROR 11-30 19:00:00 [core.py:1] EngineCore encountered a fatal error."
    assert s.feed(head) == []
    for _ in range(2000):  # 128 MB of one line
        assert s.feed(b"x" * 65536) == []
        assert s._size <= 1024
    (line,) = s.feed(b"tail\n")
    assert line.startswith(head) and len(line) == 1024 and s.truncated == 1


def test_dedupe_drops_replayed_lines_of_the_resumed_second():
    d = Dedupe()
    assert d.fresh(5_000_000_001, "a") and d.fresh(5_000_000_002, "b")
    assert not d.fresh(5_000_000_001, "a")  # the same line again after a resume
    assert d.fresh(5_000_000_001, "c")  # same second, new text
    assert d.fresh(6_000_000_000, "d") and not d.fresh(5_900_000_000, "e")  # older second


def test_stamp_parsing():
    assert parse_stamp_ns("2026-11-30T19:00:00.123456789Z") == 1796065200_123456789
    assert parse_stamp_ns("2026-11-30T19:00:00Z") == 1796065200_000000000
    assert parse_stamp_ns("2026-11-30T20:00:00.5+01:00") == 1796065200_500000000
    assert parse_stamp_ns("INFO") is None


def test_retry_wait():
    # a clean end (container exit) pauses instead of polling the apiserver in a tight loop
    assert retry_wait(ENDED, 8.0, 0.1) == (END_PAUSE_S, RETRY_MIN_S) and END_PAUSE_S > 0
    # the read timeout of a quiet, healthy stream: reopen now, back-off starts afresh
    assert retry_wait(QUIET, 8.0, 120.0) == (0.0, RETRY_MIN_S)
    # errors back off exponentially up to a cap...
    delay, waits = RETRY_MIN_S, []
    for _ in range(8):
        wait, delay = retry_wait(ERROR, delay, 0.1)
        waits.append(wait)
    assert waits[:3] == [RETRY_MIN_S, 2 * RETRY_MIN_S, 4 * RETRY_MIN_S]
    assert max(waits) == RETRY_MAX_S
    # ...but an error after a stream that had run a while starts from the minimum again
    assert retry_wait(ERROR, RETRY_MAX_S, RETRY_MAX_S + 1)[0] == RETRY_MIN_S
