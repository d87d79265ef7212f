"""Reading a vLLM pod over HTTP: /metrics, /health and the stall canary, always with a
deadline.

Unknown is not zero: a read that fails or times out says nothing about load, so callers get an
error or None, never 0, except where the answer is certain: a refused connection means no
server listens, so no request can be in flight there.

`Scraper` reads every pod of a round in parallel, each against its own deadline (a total one:
a server that drip-feeds its answer cannot hold a thread past it), and a round never waits for
one slow pod longer than that deadline; one GET per pod per round serves both the autoscaler
and stall detection.

Only the samples a caller names are parsed: a real vLLM's /metrics is about 50 KB (histogram
buckets, process and GC families; 425 samples on 0.32.0), and parsing all of it costs the
operator about 8 ms of CPU per read, once a second per pod; the dozen samples it reads cost a
small fraction of that (bench/results/scrape-cost.md).
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from vlm_operator import builders

METRICS_TIMEOUT_S = 1.0
HEALTH_TIMEOUT_S = 1.0
SCRAPE_WORKERS = 32
IN_FLIGHT_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
TIMEOUT, REFUSED, ERROR = "timeout", "refused", "error"
UNAUTHORIZED = "unauthorized"
CANARY_ID_PREFIX = "vlm-operator-canary-"
CANARY_PROMPT = "Hi"


def pod_ip(pod: dict) -> str | None:
    return (pod.get("status") or {}).get("podIP") or None


def _url(ip: str, path: str) -> str:
    return f"http://{ip}:{builders.PORT}{path}"


def parse_metrics(text: str, names: Collection[str]) -> dict[str, float]:
    """Sample name -> value summed over label sets (engines, finished reasons), for the
    samples called `names` (exact sample names, e.g. vllm:request_success_total); the other
    lines are dropped by their name before the parser sees them."""
    prefixes = tuple(names)
    wanted = "\n".join(line for line in text.splitlines()
                       if line.startswith(prefixes)
                       and line.split("{", 1)[0].split(None, 1)[0] in names)
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(wanted):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


def failure(exc: BaseException) -> str:
    """TIMEOUT, REFUSED or ERROR for an exception of urllib or the socket layer."""
    reason = getattr(exc, "reason", exc)
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return TIMEOUT
    if isinstance(reason, ConnectionRefusedError):
        return REFUSED
    return ERROR


def _read(rsp, deadline: float) -> bytes:
    chunks = []
    while chunk := rsp.read1(65536):
        chunks.append(chunk)
        if time.monotonic() > deadline:
            raise TimeoutError("the answer took longer than its deadline")
    return b"".join(chunks)


def get_metrics(ip: str, names: Collection[str],
                timeout_s: float = METRICS_TIMEOUT_S) -> dict[str, float]:
    """The samples `names` of the pod's /metrics, within timeout_s in all; raises OSError
    (refused, timed out) or ValueError (unparseable)."""
    deadline = time.monotonic() + timeout_s
    with urllib.request.urlopen(_url(ip, "/metrics"), timeout=timeout_s) as rsp:
        return parse_metrics(_read(rsp, deadline).decode("utf-8", "replace"), names)


def requests_in_flight(ip: str | None, timeout_s: float = 2.0) -> float | None:
    """Running + waiting requests; 0 when nothing listens; None when it cannot be told."""
    if not ip:
        return None
    try:
        values = get_metrics(ip, IN_FLIGHT_METRICS, timeout_s)
    except (OSError, ValueError) as exc:
        return 0.0 if failure(exc) == REFUSED else None
    return sum(values.get(name, 0.0) for name in IN_FLIGHT_METRICS)


def health(ip: str | None, timeout_s: float = HEALTH_TIMEOUT_S) -> str | None:
    """GET /health: "ok" (200), "failing" (an HTTP error), TIMEOUT, "unreachable", or None
    (no IP)."""
    if not ip:
        return None
    try:
        with urllib.request.urlopen(_url(ip, "/health"), timeout=timeout_s) as rsp:
            return "ok" if rsp.status == 200 else "failing"
    except urllib.error.HTTPError:
        return "failing"
    except OSError as exc:
        return TIMEOUT if failure(exc) == TIMEOUT else "unreachable"


def canary_id() -> str:
    return CANARY_ID_PREFIX + uuid.uuid4().hex[:12]


def canary(ip: str, timeout_s: float, request_id: str) -> str:
    """The smallest completion (max_tokens 1, a fixed 1-token prompt) for the model the pod
    serves: "answered", TIMEOUT, REFUSED, UNAUTHORIZED (HTTP 401/403: an API key guards /v1,
    which the operator does not hold) or ERROR (another HTTP error, no model listed). The
    request id (X-Request-Id) and user field mark it as the operator's in vLLM's logs."""
    deadline = time.monotonic() + timeout_s
    try:
        with urllib.request.urlopen(_url(ip, "/v1/models"), timeout=timeout_s) as rsp:
            model = json.loads(_read(rsp, deadline))["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": CANARY_PROMPT, "max_tokens": 1,
                           "temperature": 0, "user": "vlm-operator-canary"}).encode()
        req = urllib.request.Request(_url(ip, "/v1/completions"), data=body, method="POST",
                                     headers={"Content-Type": "application/json",
                                              "X-Request-Id": request_id})
        left = max(0.1, deadline - time.monotonic())
        with urllib.request.urlopen(req, timeout=left) as rsp:
            _read(rsp, deadline)
        return "answered"
    except urllib.error.HTTPError as exc:
        return UNAUTHORIZED if exc.code in (401, 403) else ERROR
    except (OSError, ValueError, KeyError, IndexError) as exc:
        return failure(exc) if isinstance(exc, OSError) else ERROR


@dataclass(frozen=True, slots=True)
class Scrape:
    values: dict[str, float] | None = None
    error: str | None = None  # TIMEOUT, REFUSED, ERROR, or "no-ip"; None when values came


class Scraper:
    """One /metrics read per pod per round, in parallel, each with its own deadline."""

    def __init__(self, workers: int = SCRAPE_WORKERS,
                 timeout_s: float = METRICS_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="scrape")
        self._lock = threading.Lock()
        self._busy: set[str] = set()  # pod uids whose previous read has not returned

    def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def scrape(self, pods: list[dict], names: Collection[str]) -> dict[str, Scrape]:
        """Pod name -> its reading of the samples `names` this round; pods still busy from an
        earlier round, or not done by the deadline, read as TIMEOUT (their threads finish on
        their own)."""
        out: dict[str, Scrape] = {}
        futures = {}
        for pod in pods:
            meta = pod["metadata"]
            ip = pod_ip(pod)
            if not ip:
                out[meta["name"]] = Scrape(error="no-ip")
                continue
            with self._lock:
                busy = meta["uid"] in self._busy
                self._busy.add(meta["uid"])
            if busy:
                out[meta["name"]] = Scrape(error=TIMEOUT)
                continue
            futures[meta["name"]] = self._pool.submit(self._one, meta["uid"], ip, names)
        wait(futures.values(), timeout=self.timeout_s + 0.5)
        for name, future in futures.items():
            out[name] = future.result() if future.done() else Scrape(error=TIMEOUT)
        return out

    def _one(self, uid: str, ip: str, names: Collection[str]) -> Scrape:
        try:
            return Scrape(get_metrics(ip, names, self.timeout_s))
        except (OSError, ValueError) as exc:
            return Scrape(error=failure(exc) if isinstance(exc, OSError) else ERROR)
        finally:
            with self._lock:
                self._busy.discard(uid)
