"""`vlm-operator scan-logs FILE...`: run the log signatures over saved vLLM logs.

Prints one JSON object per raw detection (per matching line; detections of one event share an
`incident` number) on stdout and a per-file summary on stderr; the plugin's engine heartbeat
(a line every few seconds, evidence rather than an event) is only counted in the summary.
Streams: constant memory.
Files are read as bytes and split on `\\n` only, so vLLM's `\\r` continuation marks survive;
gzip is recognised by its magic bytes; `-` is stdin.
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import BinaryIO, TextIO

from vlm_operator.api.log_signatures import Signature, SignatureConfigError
from vlm_operator.api.log_signatures import compile_extra_signatures as _compile
from vlm_operator.logs.matcher import Scanner

_GZIP_MAGIC = b"\x1f\x8b"
COUNTED_ONLY = frozenset({"engine_heartbeat"})


def _open(path: str, stdin: BinaryIO | None) -> BinaryIO:
    if path == "-":
        return stdin if stdin is not None else sys.stdin.buffer
    raw = open(path, "rb")  # noqa: SIM115 - closed by the caller
    head = raw.peek(2)[:2] if hasattr(raw, "peek") else b""
    return gzip.GzipFile(fileobj=raw, mode="rb") if head == _GZIP_MAGIC else raw


def _lines(fh: BinaryIO) -> Iterator[str]:
    """Binary line iteration splits on b"\\n" only (never on \\r or Unicode separators)."""
    for raw in fh:
        yield raw.decode("utf-8", "replace")


def _signatures(extra: Iterable) -> tuple[Signature, ...]:
    """Accept compiled signatures or raw definitions (validated here)."""
    extra = list(extra)
    if all(isinstance(s, Signature) for s in extra):
        return tuple(extra)
    return _compile(extra, where="extra_signatures")


def main(paths: list[str], stdout: TextIO, stderr: TextIO, extra_signatures=(),
         logging_prefix: str = "", stdin: BinaryIO | None = None) -> int:
    """Scan each file; exit 0, or 2 if any input (or extra signature) was unusable."""
    try:
        extra = _signatures(extra_signatures)
    except SignatureConfigError as e:
        print(f"scan-logs: {e}", file=stderr)
        return 2
    if not paths:
        print("scan-logs: no input files (use - for stdin)", file=stderr)
        return 2
    rc = 0
    for path in paths:
        name = "<stdin>" if path == "-" else path
        lines = 0
        raw_counts: Counter[str] = Counter()
        incidents: Counter[str] = Counter()
        scanner = Scanner(extra, logging_prefix)
        try:
            fh = _open(path, stdin)
            try:
                for lines, text in enumerate(_lines(fh), 1):
                    for det in scanner.feed(text):
                        raw_counts[det.signature] += 1
                        incidents[det.signature] += det.first
                        if det.signature not in COUNTED_ONLY:
                            stdout.write(json.dumps({"file": name, "line": lines,
                                                     **det.as_dict()}) + "\n")
            finally:
                if path != "-":
                    fh.close()
        except (OSError, EOFError, gzip.BadGzipFile) as e:
            print(f"scan-logs: {name}: unreadable: {e.__class__.__name__}: "
                  f"{getattr(e, 'strerror', None) or e}", file=stderr)
            rc = 2
            if not lines:
                continue
        summary = ", ".join(f"{sig}={raw_counts[sig]} lines/{incidents[sig]} incidents"
                            for sig in sorted(raw_counts)) or "no signatures"
        print(f"{name}: {lines} lines: {summary}", file=stderr)
    return rc
