"""lines.py: line splitting with a bounded buffer, and the de-duplication of a resumed
stream's lines."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from vlm_operator.logs import lines
from vlm_operator.logs.lines import Dedupe, LineSplitter


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


def test_dedupe_memory_is_bounded_in_a_flood_second():
    """A pod that writes 200,000 lines in one second: every (stamp, text) of the second was
    kept until the next second."""
    d = Dedupe()
    for i in range(200_000):
        assert d.fresh(5_000_000_000 + i, "x" * 100 + str(i))
    assert len(d.seen) == lines.MAX_DEDUPE
    assert not d.fresh(5_000_000_000, "x" * 100 + "0")  # remembered: dropped on a replay


def test_skipped_chunks_count_their_lines_and_keep_the_line_they_begin():
    """A chunk of a pod over its log budget is dropped without making a line of it: its lines
    are counted, a "\\r" ending one of them is noted, and the line it begins is whole when
    the next chunk is read."""
    splitter = LineSplitter()
    assert splitter.feed(b"first\nhalf") == [b"first"]
    assert splitter.skip(b"-line\r\nsecond\nthi") == (2, True)
    assert splitter.skip(b"rd-and-") == (0, False)
    assert splitter.feed(b"more\nfourth\n") == [b"third-and-more", b"fourth"]
    assert splitter.skip(b"fifth\n") == (1, False)
