"""vLLM's log header: one physical line split into what the kubelet and vLLM put in front of
its message. Pure.

Line shape (every supported vLLM), optional parts in brackets:
    [k8s RFC3339Nano time ][(Proc pid=N) ][VLLM_LOGGING_PREFIX][(Proc pid=N) ]LEVEL MM-DD HH:MM:SS
    [file.py:N] message
with optional ANSI colour codes around each header token (vLLM's ColoredFormatter). A line
without that header keeps its k8s time and process tag (a headerless line).

Every field is bounded whatever the line holds (signatures.py has the threat model): a process
name is at most 64 characters, a pid at most 10 digits (a longer one is no header, so a
5,000-digit "pid" is never converted to int), a logger file at most 255 characters and a line
number at most 9 digits. The logging prefix is an exact string from the pod's spec, never a
wildcard and never learnt from the log; `foreign_header` only says, for reporting, that a line
looks like vLLM's behind some other prefix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache

from vlm_operator.api.log_signatures import MAX_LOGGING_PREFIX
from vlm_operator.api.names import CONTAINER
from vlm_operator.api.validation import LOGGING_PREFIX_ENV

_ANSI = r"(?:\x1b\[[0-9;]*m)*"
_K8S_TS = re.compile(
    r"(?P<k8s_time>\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d{1,9})?(?:Z|[+-]\d{2}:\d{2})) "
)
# Process names and pids are bounded (see the threat model in signatures.py): vLLM's names are short
# (APIServer, EngineCore_DP0, VllmWorker-0, Worker_TP1) and Linux pids are at most 2^22.
_PROC = (_ANSI + r"\((?P<{n}>[A-Za-z_][\w.\-]{{0,63}}) pid=(?P<{p}>\d{{1,10}})\)" + _ANSI
         + " ")
_PROC_ONLY = re.compile(_PROC.format(n="proc", p="pid"))
_LEVEL_TIME_FILE = (
    _ANSI + r"(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)" + _ANSI + " "
    + _ANSI + r"(?P<time>\d{2}-\d{2} \d{2}:\d{2}:\d{2})" + _ANSI + " "
    + _ANSI + r"\[(?P<file>[^\]\s:]{1,255}\.py):(?P<lineno>\d{1,9})\]" + _ANSI + "(?: |$)"
)
# How far into a line `foreign_header` looks for vLLM's header behind a prefix it was not told.
_FOREIGN = re.compile(r"[^\r\n]{0," + str(MAX_LOGGING_PREFIX) + "}?(?:"
                      + _PROC.format(n="proc", p="pid") + ")?" + _LEVEL_TIME_FILE)


@lru_cache(maxsize=16)
def header_re(logging_prefix: str) -> re.Pattern[str]:
    """Header regex for one VLLM_LOGGING_PREFIX (an exact string, never a wildcard: a free
    prefix would let the header start in the middle of an attacker-controlled line)."""
    return re.compile(
        "(?:" + _PROC.format(n="proc", p="pid") + ")?"
        + re.escape(logging_prefix)
        + "(?:" + _PROC.format(n="proc2", p="pid2") + ")?"
        + _LEVEL_TIME_FILE
    )


def foreign_header(message: str) -> bool:
    """Whether a line that has no header under the expected prefix shows vLLM's header behind
    some other text (VLLM_LOGGING_PREFIX set where the operator cannot see it, such as the
    image's own ENV). For reporting only: what precedes the header is never used to match."""
    return _FOREIGN.match(message) is not None


@dataclass(frozen=True, slots=True)
class LogLine:
    """One physical line, split into what the runtime and vLLM put in front of the message."""

    message: str
    level: str | None = None  # None: no vLLM header (headerless line)
    time: str | None = None  # vLLM's MM-DD HH:MM:SS
    file: str | None = None  # logger file basename (vLLM may print a relative path)
    lineno: int | None = None
    proc: str | None = None
    pid: int | None = None
    k8s_time: str | None = None
    continued: bool = False  # ended with \r: the next line of this process is a continuation

    @property
    def headered(self) -> bool:
        return self.level is not None


def split_line(line: str, logging_prefix: str = "") -> LogLine:
    """Parse any line; headerless lines keep their k8s time and process prefix."""
    return split_with(line, header_re(logging_prefix))


def split_with(line: str, header: re.Pattern[str]) -> LogLine:
    """split_line with the header regex already made (header_re): a Scanner's per-line path."""
    line = line.rstrip("\n")
    continued = line.endswith("\r")
    line = line.rstrip("\r")
    k8s_time = None
    m = _K8S_TS.match(line)
    if m:
        k8s_time = m.group("k8s_time")
        line = line[m.end():]
    h = header.match(line)
    if h:
        proc = h.group("proc") or h.group("proc2")
        pid = h.group("pid") or h.group("pid2")
        return LogLine(
            message=line[h.end():],
            level=h.group("level"),
            time=h.group("time"),
            file=h.group("file").rsplit("/", 1)[-1],
            lineno=int(h.group("lineno")),
            proc=proc,
            pid=int(pid) if pid else None,
            k8s_time=k8s_time,
            continued=continued,
        )
    p = _PROC_ONLY.match(line)
    if p:
        return LogLine(message=line[p.end():], proc=p.group("proc"), pid=int(p.group("pid")),
                       k8s_time=k8s_time, continued=continued)
    return LogLine(message=line, k8s_time=k8s_time, continued=continued)


def parse_line(line: str, logging_prefix: str = "") -> LogLine | None:
    """The vLLM header fields and message of a line, or None when it has no vLLM header."""
    parsed = split_line(line, logging_prefix)
    return parsed if parsed.headered else None


def line_seconds(ln: LogLine) -> float | None:
    """The line's time in seconds: the kubelet's stamp (epoch), else vLLM's own MM-DD HH:MM:SS
    (comparable only with other such times), else None."""
    if ln.k8s_time:
        ts = ln.k8s_time
        frac = ""
        if "." in ts:
            head, rest = ts.split(".", 1)
            digits = rest.rstrip("Z").split("+")[0].split("-")[0]
            frac = "." + digits[:6]
            ts = head + frac + rest[len(digits):]
        try:
            return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    if ln.time:
        mo, d = int(ln.time[0:2]), int(ln.time[3:5])
        h, mi, s = int(ln.time[6:8]), int(ln.time[9:11]), int(ln.time[12:14])
        return (((mo * 31 + d) * 24 + h) * 60 + mi) * 60 + s
    return None


def logging_prefix(pod: dict) -> str | None:
    """The VLLM_LOGGING_PREFIX the pod's vllm container gets from its spec: "" when unset, None
    when it comes from valueFrom (not knowable here; api/validation.py refuses that for
    VLMDeployments). One set in the image's own ENV is not visible here either: see
    signatures.foreign_header."""
    container = next((c for c in (pod.get("spec") or {}).get("containers") or []
                      if c.get("name") == CONTAINER), {})
    for var in container.get("env") or []:
        if var.get("name") == LOGGING_PREFIX_ENV:
            return None if var.get("valueFrom") else str(var.get("value") or "")
    return ""
