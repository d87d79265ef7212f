"""Bytes of a log stream to lines, and lines already seen: what reading a resumed log stream
needs, whatever the lines say.

Lines are split on "\\n" only (header.py and signatures.py rely on the "\\r" vLLM leaves on
continuation lines) and cut at MAX_LINE_BYTES, so one endless line costs bounded memory and
linear work. A dropped stream is resumed with sinceTime (second precision at the apiserver): the
replayed lines of that second are dropped by (timestamp, text), so nothing is counted twice or
lost.
"""

from __future__ import annotations

MAX_LINE_BYTES = 64 * 1024
MAX_DEDUPE = 4096  # lines of one second remembered for de-duplication (Dedupe)


class Dedupe:
    """Lines already seen, for resuming a stream with a second-precision sinceTime; `floor`:
    lines stamped at or before it were handled by an earlier operator process (its mark).
    Lines of the latest second are remembered by (stamp, hash of the text), at most
    MAX_DEDUPE of them: a log that writes more in one second (a flood) may have a few lines
    counted twice after a reconnect in that second, which incident windows absorb (they count
    each time once), instead of costing memory without bound."""

    def __init__(self) -> None:
        self.sec = 0
        self.floor = 0
        self.seen: set[tuple[int, int]] = set()

    def fresh(self, ns: int, text: str) -> bool:
        sec = ns // 1_000_000_000
        key = (ns, hash(text))
        if sec < self.sec or ns <= self.floor or key in self.seen:
            return False
        if sec > self.sec:
            self.sec, self.seen = sec, set()
        if len(self.seen) < MAX_DEDUPE:
            self.seen.add(key)
        return True


class LineSplitter:
    """Bytes to lines on b"\\n". A line longer than max_bytes keeps its first max_bytes (the
    header and any signature are at its start); the rest is dropped up to its newline."""

    def __init__(self, max_bytes: int = MAX_LINE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._parts: list[bytes] = []
        self._size = 0
        self._cut = False
        self.truncated = 0  # lines cut so far

    def feed(self, chunk: bytes) -> list[bytes]:
        lines, start = [], 0
        while (end := chunk.find(b"\n", start)) >= 0:
            self._keep(chunk[start:end])
            lines.append(self.rest())
            start = end + 1
        self._keep(chunk[start:])
        return lines

    def skip(self, chunk: bytes) -> tuple[int, bool]:
        """Drop the lines `chunk` completes unread, the one begun before it included: (how
        many, whether one of them ended with "\\r"); what follows its last newline is kept as
        the start of the next line. Linear in the chunk, in C: no line object is made."""
        last = chunk.rfind(b"\n")
        if last < 0:
            self._keep(chunk)
            return 0, False
        ended_cr = b"\r\n" in chunk or (chunk.startswith(b"\n") and bool(self._parts)
                                        and self._parts[-1].endswith(b"\r"))
        self._parts, self._size, self._cut = [], 0, False
        self._keep(chunk[last + 1:])
        return chunk.count(b"\n"), ended_cr

    def rest(self) -> bytes:
        """The line so far (emptied)."""
        line = b"".join(self._parts)
        self.truncated += self._cut
        self._parts, self._size, self._cut = [], 0, False
        return line

    def _keep(self, piece: bytes) -> None:
        room = self.max_bytes - self._size
        if len(piece) > room:
            piece, self._cut = piece[:room], True
        if piece:
            self._parts.append(piece)
            self._size += len(piece)

