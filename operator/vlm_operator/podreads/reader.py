"""Reading a vLLM pod over HTTP: /metrics and /health, each one bounded exchange
(podreads/podhttp.py: no redirects, a byte cap, one deadline for the whole exchange); the stall
canary has a module of its own (podreads/canary.py).

Unknown is not zero: a read that fails says nothing about load, so callers get an error kind or
None, never 0. Unreachable is not sick: a connection that cannot be made (UNREACHABLE) is kept
apart from a server that accepted it and answered nothing (TIMEOUT), which is evidence.

`Scraper` reads every pod of a round in parallel, on workers shared fairly between tenants
(podreads/fairpool.py), each read against its own deadline, so a round never waits for one slow pod
longer than that deadline, nor for the slow pods of another VLMDeployment; one GET per pod per
round serves both the autoscaler and stall detection.

Caps: METRICS_CAP (2 MiB) is 40 times a real vLLM 0.32.0 /metrics page (about 50 KB, 425
samples, one engine): room for per-engine label sets of data-parallel servers and for LoRA
and speculative-decoding families, while 32 workers reading capped answers at once hold at
most 64 MiB. /health (and the canary's /v1/models and 1-token completion) are small JSON (or
empty): SMALL_CAP (64 KiB).

Only the samples a caller names are parsed: a real vLLM's /metrics is about 50 KB (histogram
buckets, process and GC families), and parsing all of it costs the operator about 8 ms of CPU
per read, once a second per pod; the dozen samples it reads cost a small fraction of that
(bench/results/scrape-cost.md). The lines are found by RE2 (linear time, no backtracking) over
the bytes, matching a name at a line's start and the character after it (no copy of the page
per line); a wanted line longer than LINE_CAP is refused before anything looks at its content,
the label set of the others is checked by RE2 too and the value read with bytes methods, and
at most MAX_SAMPLE_LINES of them are parsed. So no page a pod can serve costs more than about
15 ms of CPU, in calls of a few milliseconds at most (worst pages tried:
bench/results/metrics-parse.md).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Collection
from concurrent.futures import Future, wait
from dataclasses import dataclass

import re2

from vlm_operator.api import names
from vlm_operator.k8s.views import Body, Pod
from vlm_operator.podreads import podhttp
from vlm_operator.podreads.fairpool import FairPool
from vlm_operator.podreads.podhttp import BAD_ANSWER, PodHTTPError

METRICS_TIMEOUT_S = 1.0
HEALTH_TIMEOUT_S = 1.0
METRICS_CAP = 2 * 1024 * 1024
SMALL_CAP = 64 * 1024
# wanted lines of one page: a vLLM server has one per engine and label set, a few dozen (eight
# data-parallel engines: under 300 of the samples a round reads); each costs a few microseconds
MAX_SAMPLE_LINES = 1024
# bytes of one wanted line: 4 times the longest line of a real vLLM 0.32.0 page (1,060 B, the
# label set of vllm:cache_config_info)
LINE_CAP = 4096
SCRAPE_WORKERS = 32
START_BY_S = 0.5  # a round's read not started by then is not read this round (BUSY)
IN_FLIGHT_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
HTTP_ERROR = "http_error"  # an answer with a status other than the one asked for
BUSY = "busy"  # not read this round: its last read still runs, or its share of workers was
# taken until the round stopped waiting; says nothing about the pod
NO_IP = "no-ip"


def _exchange(ip: str, method: str, path: str, timeout_s: float, cap: int,
              **kw) -> podhttp.Answer:
    return podhttp.exchange(ip, names.PORT, method, path, timeout_s=timeout_s, cap=cap, **kw)


@functools.lru_cache(maxsize=64)
def _sample_starts(names: frozenset[str]):  # a compiled RE2 pattern
    """A line's start whose sample is exactly one of `names`: the name, and the label set's
    '{' or the blank that follows it. RE2: one linear pass over the page (a few ms at the
    byte cap), whatever it holds."""
    alternatives = b"|".join(re2.escape(n.encode()) for n in sorted(names))
    return re2.compile(rb"(?m)^(" + alternatives + rb")[{ \t]")


# A sample's label set: quoted values may hold anything escaped. RE2: linear in the line, which
# is at most LINE_CAP bytes.
_LABELS = re2.compile(rb'\{(?:[^"}\n]|"(?:[^"\\\n]|\\.)*")*\}')


def _sample_value(rest: bytes) -> float | None:
    """The value of a sample line from what follows its name (at most LINE_CAP bytes, no
    newline): an optional label set, blanks, the value, an optional integer timestamp; None
    when it is not that. The label set ends at the line's last '}' (neither the value nor the
    timestamp holds one)."""
    if rest.startswith(b"{"):
        close = rest.rfind(b"}")
        if close < 0 or _LABELS.fullmatch(rest[:close + 1]) is None:
            return None
        rest = rest[close + 1:]
    fields = rest.split()
    if rest[:1] not in (b" ", b"\t") or not 1 <= len(fields) <= 2 or (
            len(fields) == 2 and not fields[1].removeprefix(b"-").isdigit()):
        return None
    try:
        return float(fields[0])
    except ValueError:
        return None


def parse_metrics(text: str | bytes, names: Collection[str]) -> dict[str, float]:
    """Sample name -> value summed over label sets (engines, finished reasons), for the
    samples called `names` (exact sample names, e.g. vllm:request_success_total); the other
    lines are skipped by their name, by a regular expression over the bytes. Raises
    ValueError on a wanted line that is not a sample, is longer than LINE_CAP bytes (refused
    before its content is looked at), or on more than MAX_SAMPLE_LINES wanted lines. So the
    work per page is bounded:
    the search for names over at most METRICS_CAP bytes, and for at most MAX_SAMPLE_LINES
    lines of at most LINE_CAP bytes each, one RE2 match and a few bytes methods."""
    if not names:
        return {}
    data = text.encode() if isinstance(text, str) else text
    starts = _sample_starts(frozenset(names))
    out: dict[str, float] = {}
    pos, lines = 0, 0
    while (match := starts.search(data, pos)) is not None:
        lines += 1
        if lines > MAX_SAMPLE_LINES:
            raise ValueError(f"more than {MAX_SAMPLE_LINES} lines of the samples read")
        end = data.find(b"\n", match.end(), match.start() + LINE_CAP + 1)
        if end < 0:
            if len(data) - match.start() > LINE_CAP:
                raise ValueError(f"a line of {match.group(1).decode()} is longer than "
                                 f"{LINE_CAP} bytes")
            end = len(data)
        value = _sample_value(data[match.end() - 1:end])
        if value is None:
            raise ValueError(f"not a sample line: {data[match.start():end][:100]!r}")
        name = match.group(1).decode()
        out[name] = out.get(name, 0.0) + value
        pos = end
    return out


def get_metrics(ip: str, names: Collection[str],
                timeout_s: float = METRICS_TIMEOUT_S) -> dict[str, float]:
    """The samples `names` of the pod's /metrics, within timeout_s in all; raises
    PodHTTPError."""
    answer = _exchange(ip, "GET", "/metrics", timeout_s, METRICS_CAP)
    if answer.status != 200:
        raise PodHTTPError(HTTP_ERROR, f"/metrics answered {answer.status}")
    try:
        return parse_metrics(answer.body, names)
    except ValueError as exc:
        raise PodHTTPError(BAD_ANSWER, f"/metrics does not parse: {exc}") from None


def requests_in_flight(ip: str | None, timeout_s: float = 2.0) -> float | None:
    """Running + waiting requests; None when it cannot be told (no IP, or the read failed:
    a refused or dropped connection says nothing about the requests in flight; whether the
    container runs is read from the pod's status)."""
    if not ip:
        return None
    try:
        values = get_metrics(ip, IN_FLIGHT_METRICS, timeout_s)
    except PodHTTPError:
        return None
    return sum(values.get(name, 0.0) for name in IN_FLIGHT_METRICS)


def health(ip: str | None, timeout_s: float = HEALTH_TIMEOUT_S) -> str | None:
    """GET /health: "ok" (200), "failing" (another status), an error kind of podhttp
    (UNREACHABLE, TIMEOUT, ...), or None (no IP)."""
    if not ip:
        return None
    try:
        answer = _exchange(ip, "GET", "/health", timeout_s, SMALL_CAP)
    except PodHTTPError as exc:
        return exc.kind
    return "ok" if answer.status == 200 else "failing"


@dataclass(frozen=True, slots=True)
class Scrape:
    values: dict[str, float] | None = None
    error: str | None = None  # a podhttp kind, HTTP_ERROR, BUSY or NO_IP; None with values
    detail: str = ""  # what happened, for status messages


class Scraper:
    """One /metrics read per pod per round, in parallel on workers shared fairly between
    namespaces (podreads/fairpool.py), each with its own deadline."""

    def __init__(self, workers: int = SCRAPE_WORKERS,
                 timeout_s: float = METRICS_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._pool = FairPool(workers, "scrape")
        self._lock = threading.Lock()
        self._busy: set[str] = set()  # pod uids whose previous read has not returned

    def stop(self) -> None:
        self._pool.shutdown()

    def scrape(self, key: tuple[str, str], pods: list[dict],
               names: Collection[str]) -> dict[str, Scrape]:
        """Pod name -> its reading of the samples `names` this round, for the pods of the
        VLMDeployment `key` (namespace, name). A pod still busy from an earlier round, or
        whose read could not start within START_BY_S (its namespace's share of the workers
        in use), reads as BUSY."""
        out: dict[str, Scrape] = {}
        futures: dict[str, Future] = {}
        start_by = time.monotonic() + START_BY_S
        for pod in pods:
            meta = Body(pod)
            ip = Pod(pod).pod_ip
            if not ip:
                out[meta.name] = Scrape(error=NO_IP)
                continue
            with self._lock:
                busy = meta.uid in self._busy
                self._busy.add(meta.uid)
            if busy:
                out[meta.name] = Scrape(error=BUSY, detail="its last read still runs")
                continue
            future = self._pool.submit(key, self._one, ip, names, start_by=start_by)
            future.add_done_callback(lambda _, uid=meta.uid: self._done(uid))
            futures[meta.name] = future
        wait(futures.values(), timeout=START_BY_S + self.timeout_s + 0.5)
        for name, future in futures.items():
            if future.done() and not future.cancelled():
                out[name] = future.result()
            else:  # never started, or (rarely) not back yet: it finishes on its own
                future.cancel()
                out[name] = Scrape(error=BUSY, detail="no scrape worker free in time")
        return out

    def _done(self, uid: str) -> None:
        with self._lock:
            self._busy.discard(uid)

    def _one(self, ip: str, names: Collection[str]) -> Scrape:
        try:
            return Scrape(get_metrics(ip, names, self.timeout_s))
        except PodHTTPError as exc:
            return Scrape(error=exc.kind, detail=exc.detail)
