"""vLLM log signatures: a pure, table-driven matcher for engine log lines.

The operator feeds every line of a vLLM container's log through a `Scanner` (one per pod
container); `vlm-operator scan-logs` does the same offline. A detection names a signature from
`SIGNATURES` (or a user-supplied extra one), its severity, and its class. The
catalogue and the rules for users' signatures live in api/log_signatures.py (spec validation
compiles them too); this module matches lines against them. A line is split into vLLM's
header fields and its message by header.py (the line shape is described there); matching is on
the message, the level and the logger's file name, never on the line number.

Threat model
------------
Attackers are API clients. They control prompts, stop strings, generated output, request ids,
model names, URL paths and query strings, so they control *parts of messages*. What they must
never do is trigger a signature (a restart, an alert) or hide one by forging "pool active".

What vLLM gives us, and what we rely on:
- Request logging formats user text with %r or JSON (`Received request ...: prompt: '...'`),
  uvicorn percent-quotes paths and HTTP forbids raw newlines in the request line, so user text
  arrives inside a line, after a constant start. Every built-in signature is anchored at the
  start of the message and fully matched, and extra signatures are matched at the start of the
  message only and must start with a literal, so mid-line text never matches.
- Extra signatures are the CR author's regexes, run on every line of every pod: they run on
  RE2 (linear in the line's length, whatever the pattern), never on Python's backtracking `re`,
  where one pattern like `abc(?:x|x)+y` would hold the GIL for hours and stall every tenant.
- A single-line signature needs a vLLM header, a level from its list and (for vLLM's own lines)
  a logger file from its allow-list, and must be the first line of a log record.
- vLLM's NewLineFormatter turns every newline inside a record into `\\r\\n` + the same header, so
  a physical line that follows one ending in `\\r` is a continuation: text injected through a
  newline inside a message lands on a continuation line and is never matched as a line of its
  own. This is tracked per process (`(Proc pid=N)`), since processes share stdout.
- Exception lines (`RuntimeError: Already borrowed`, `...EngineDeadError: ...`) are trusted only
  in the first exception line of a well-formed traceback block: a record-start line whose message
  is a constant lead from `TRACEBACK_LEADS` (vLLM's own `logger.exception("...")` texts), then
  `Traceback (most recent call last):`, then at least one `  File ...` frame, all with the same
  header. The exception line starts with the exception type, which the attacker does not choose;
  whatever follows it (a multi-line message, a forged chained traceback) is not trusted, except
  as extra detail of the occurrence already opened (the `Failed to apply <Processor>` link).
- Headerless tracebacks (Python's own printing, e.g. a dying process) count only for signatures
  marked `headerless` (engine death), only when `Traceback (most recent call last):` starts a
  record, and after any headerless exception line the stream of that process is tainted (raw
  multi-line exception messages may follow) until a vLLM header line is seen again.
Residual risk, stated plainly: the guarantee needs the log transport to keep the `\\r` (kubelet,
the pod log API and `kubectl logs` do; `str.splitlines()` and text-mode universal newlines do
not: split on `\\n` only). For a process whose lines never carried a `\\r` (a stripping
transport), the Scanner falls back to grouping a record by its identical header: lines with the
header of a finished traceback are treated as its continuation, but a forged lead line there
can then open a new block. A component outside vLLM's logging that prints attacker-controlled
text with raw newlines to the same stream could forge whole lines; treat `engine_dead` as a
reason to check `/health`, not as proof.

The tenant who owns a pod writes all of its log (their image, their model code) and can forge
any line of it; what they must not do is hurt the shared operator. So every line costs bounded
memory and time whatever it holds: a process name is at most 64 characters and a pid at most 10
digits (a pid_max is at most 2^22; a longer one is no header, so a 5,000-digit "pid" is never
converted to int), line numbers at most 9 digits, and a Scanner keeps the continuation and
traceback state of at most MAX_PROCESSES processes, dropping the one silent for longest (a real
vLLM container has far fewer: see MAX_PROCESSES). A dropped process only loses its pending
continuation mark: its next line is read as a record start, which is what a forged line of
that tenant's own log could do anyway. The logging prefix is the one the pod's spec declares,
never learnt from the log (a prefix taken from text would let that text steer what is a
header); `foreign_header` only says, for reporting, that lines look like vLLM's behind some
other prefix.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from vlm_operator.api.log_signatures import SIGNATURES, Pattern, Signature, anchored
from vlm_operator.logs.header import (
    LogLine,
    foreign_header,
    header_re,
    line_seconds,
    split_line,
    split_with,
)

TRACEBACK_START = "Traceback (most recent call last):"
MAX_MESSAGE = 8192  # messages are cut here before matching (bounds regex work per line)
# Per-process state a Scanner keeps. One vLLM container runs one process per API server
# (--api-server-count, at most the data-parallel size), one engine core per local data-parallel
# rank and one worker per local GPU: at most about 8 + 8 + 16 on a 16-GPU node, plus the key of
# headerless lines. 64 leaves room for processes that restart inside the container (a new pid
# each); only the process silent for longest is ever dropped.
MAX_PROCESSES = 64

# Constant messages vLLM passes to logger.exception() before the tracebacks we read (every
# supported release).
TRACEBACK_LEADS = frozenset({
    "Error in preprocessing prompt inputs",
    "AsyncLLM output_handler failed.",
    "EngineCore encountered a fatal error.",
    "EngineCore failed to start.",
    "Error in chat completion stream generator.",
    "Error in completion stream generator.",
    "WorkerProc hit an exception.",  # a tensor-parallel worker (multiproc_executor.py)
})
_LEAD_RE = anchored(r"Exception occurred while running API servers: [^\r\n]*")
# The one chained link we read after a trusted exception line (raised `from` the last retry).
_FAILED_TO_APPLY = re.compile(r"ValueError: Failed to apply (?P<processor>\w+) on data=")


# ---------------------------------------------------------------- matching


@dataclass(frozen=True, slots=True)
class Detection:
    signature: str
    severity: str
    class_: str  # the signature's (api/log_signatures.CLASSES)
    variant: str
    fields: dict[str, str] = field(default_factory=dict)
    source: str = "line"  # line | traceback | chained
    line: LogLine | None = None
    # which occurrence of a failure this is, numbered by the Scanner from 1 (0 from the stateless
    # match()): detections of one event share it. Not remediation's Incident (a burst of them)
    occurrence: int = 0
    first: bool = True  # the first detection of its occurrence: act on these only

    def as_dict(self) -> dict:
        ln = self.line
        # scan-logs' output keeps its keys: "incident" and "new_incident" name these two
        d = {"signature": self.signature, "severity": self.severity, "action": self.class_,
             "variant": self.variant, "source": self.source, "incident": self.occurrence,
             "new_incident": self.first}
        if ln is not None:
            d.update({"level": ln.level, "time": ln.time, "logger_file": ln.file,
                      "proc": ln.proc, "pid": ln.pid, "k8s_time": ln.k8s_time})
        d.update(self.fields)
        return d


def _first(ln: LogLine, sigs: Iterable[Signature], wanted: Callable[[Pattern], bool],
           source: str) -> Detection | None:
    """The first pattern of `sigs` that `wanted` admits and that matches the line's message."""
    msg = ln.message[:MAX_MESSAGE]
    for sig in sigs:
        for p in sig.patterns:
            if not wanted(p):
                continue
            m = p.regex.match(msg)
            if m:
                return Detection(sig.name, sig.severity, sig.class_, p.variant,
                                 {k: v for k, v in m.groupdict().items() if v is not None},
                                 source, ln)
    return None


def _match_line(ln: LogLine, sigs: Iterable[Signature]) -> Detection | None:
    return _first(ln, sigs, lambda p: p.kind == "line" and (
        not p.levels or ln.level in p.levels) and (not p.files or ln.file in p.files), "line")


def _match_exception(ln: LogLine, headered: bool) -> Detection | None:
    return _first(ln, SIGNATURES, lambda p: p.kind == "exception" and (
        headered or p.headerless), "traceback")


def match(line: str | LogLine, extra: Iterable[Signature] = (), logging_prefix: str = ""
          ) -> Detection | None:
    """Stateless: the single-line signature a line shows, treating it as a record start.

    Exception-line signatures need traceback context and never match here: feed a `Scanner`
    for streams (it also knows which lines are continuations)."""
    ln = split_line(line, logging_prefix) if isinstance(line, str) else line
    if not ln.headered:
        return None
    return _match_line(ln, (*SIGNATURES, *extra))


# ---------------------------------------------------------------- stream state


@dataclass(slots=True)
class _Block:
    """Traceback block in progress for one process."""

    header: tuple | None  # (level, time, file, lineno); None: headerless block
    stage: str  # lead | start | frames | after
    occurrence: int = 0
    signature: str | None = None
    chained_seen: bool = False


@dataclass(slots=True)
class _Proc:
    """What a Scanner keeps about one process of the stream (its `(Proc pid=N)` tag)."""

    cr: bool = False  # its last line ended with \r: its next line is a continuation
    seen_cr: bool = False  # it ended some line with \r (the transport keeps them)
    tainted: bool = False  # after a headerless exception line, until a header line
    block: _Block | None = None


FOREIGN_CHECK_LINES = 1000  # headerless lines looked at for a foreign prefix, per Scanner


class Scanner:
    """Feed lines of one container's log in order; get detections numbered by occurrence.

    `feed` returns every per-line detection (what `scan-logs` prints); detections of one
    event share `occurrence`, and `first` marks the first one, which is what to act on.
    State per process is kept for the MAX_PROCESSES processes heard from last, so memory is
    bounded whatever the log holds. `headered` counts lines with vLLM's header (under the
    prefix); `foreign` counts headerless lines that look like vLLM's behind another prefix
    (checked only while no header was seen, for the first FOREIGN_CHECK_LINES of them)."""

    def __init__(self, extra: Iterable[Signature] = (), logging_prefix: str = "") -> None:
        self.signatures = (*SIGNATURES, *extra)
        self.logging_prefix = logging_prefix
        self._header = header_re(logging_prefix)
        self._procs: OrderedDict[tuple, _Proc] = OrderedDict()
        self._last_occurrence: dict[str, tuple[int, float | None]] = {}
        self._occurrences = 0
        self._now: float | None = None
        self.headered = 0
        self.foreign = 0
        self._foreign_checked = 0

    @property
    def occurrences(self) -> int:
        return self._occurrences

    @property
    def processes(self) -> int:
        """Processes whose state is kept (at most MAX_PROCESSES)."""
        return len(self._procs)

    def _assign(self, det: Detection, prefer: int = 0) -> Detection:
        sig = next(s for s in self.signatures if s.name == det.signature)
        if prefer:
            return _with(det, prefer, False)
        last = self._last_occurrence.get(sig.name)
        if (last and sig.merge_window_s and last[1] is not None and self._now is not None
                and 0 <= self._now - last[1] <= sig.merge_window_s):
            self._last_occurrence[sig.name] = (last[0], self._now)
            return _with(det, last[0], False)
        self._occurrences += 1
        self._last_occurrence[sig.name] = (self._occurrences, self._now)
        return _with(det, self._occurrences, True)

    def _proc(self, key: tuple) -> _Proc:
        proc = self._procs.get(key)
        if proc is None:
            proc = self._procs[key] = _Proc()
            if len(self._procs) > MAX_PROCESSES:
                self._procs.popitem(last=False)  # the process silent for longest
        else:
            self._procs.move_to_end(key)
        return proc

    def feed(self, line: str) -> list[Detection]:
        ln = split_with(line, self._header)
        proc = self._proc((ln.proc, ln.pid))
        continuation = proc.cr
        proc.cr = ln.continued
        t = line_seconds(ln)
        if t is not None:
            self._now = t
        block = proc.block
        if ln.headered:
            self.headered += 1
            proc.tainted = False
            hk = (ln.level, ln.time, ln.file, ln.lineno)
            if ln.continued:
                proc.seen_cr = True
            same = block is not None and block.header == hk
            if continuation or (same and not proc.seen_cr and not (
                    block.stage == "after" and self._is_lead(ln.message))):
                # no-CR fallback: a stream stripped of \r (never seen for this process) groups
                # a record by its identical header, with the weaker guarantee the docstring notes
                if same:
                    return self._advance(proc, block, ln)
                proc.block = None
                return []
            proc.block = None
            out = []
            det = _match_line(ln, self.signatures)
            if det is not None:
                det = self._assign(det)
                out.append(det)
            if self._is_lead(ln.message):
                proc.block = _Block(hk, "lead", det.occurrence if det else 0,
                                    det.signature if det else None)
            return out
        # headerless
        if not self.headered and not self.foreign and \
                self._foreign_checked < FOREIGN_CHECK_LINES:
            self._foreign_checked += 1
            self.foreign += foreign_header(ln.message)
        if block is not None and block.header is None and block.stage != "after":
            return self._advance(proc, block, ln)
        if ln.message == TRACEBACK_START and not continuation and not proc.tainted:
            proc.block = _Block(None, "start")
            return []
        if block is not None and block.header is not None:
            proc.block = None
        return []

    def skipped(self, continued: bool) -> None:
        """Lines of the stream were not fed (the pod was over its log budget, logs/budget.py):
        no traceback block spans the gap, and when a skipped line ended mid-record
        (`continued`: it ended with "\\r"), every process's next line is read as a
        continuation, never as a record start that text inside a record could forge."""
        for proc in self._procs.values():
            proc.block = None
            proc.cr = proc.cr or continued

    @staticmethod
    def _is_lead(message: str) -> bool:
        return message in TRACEBACK_LEADS or _LEAD_RE.match(message) is not None

    def _advance(self, proc: _Proc, b: _Block, ln: LogLine) -> list[Detection]:
        msg = ln.message
        if b.stage == "lead":
            if msg == TRACEBACK_START:
                b.stage = "start"
            else:
                proc.block = None
            return []
        if b.stage in ("start", "frames"):
            if msg.startswith('  File "'):
                b.stage = "frames"
                return []
            if msg.startswith(" ") and b.stage == "frames":
                return []  # source line, caret markers, "[Previous line repeated ...]"
            if b.stage == "start" or not msg or msg[0].isspace():
                proc.block = None
                return []
            # the first exception line: its type is real; the rest of the record is not trusted
            b.stage = "after"
            headered = b.header is not None
            if not headered:
                proc.tainted = True
            det = _match_exception(ln, headered)
            if det is None:
                return []
            prefer = b.occurrence if b.signature == det.signature else 0
            det = self._assign(det, prefer)
            b.occurrence, b.signature = det.occurrence, det.signature
            return [det]
        # after the exception line: only extra detail of the occurrence already open
        if (b.header is not None and b.signature == "tokenizer_borrow_error"
                and not b.chained_seen):
            m = _FAILED_TO_APPLY.match(msg)
            if m:
                b.chained_seen = True
                sig = next(s for s in SIGNATURES if s.name == "tokenizer_borrow_error")
                return [Detection(sig.name, sig.severity, sig.class_, "failed_to_apply",
                                  {"processor": m.group("processor")}, "chained", ln,
                                  b.occurrence, False)]
        return []


def _with(det: Detection, occurrence: int, first: bool) -> Detection:
    return Detection(det.signature, det.severity, det.class_, det.variant, det.fields,
                     det.source, det.line, occurrence, first)
