"""Following one pod's vLLM log through the apiserver: streams, resume, de-duplication.

One thread per pod follows `pods/log?follow=true&timestamps=true`. A dropped stream is resumed
with sinceTime (second precision at the apiserver), dropping the replayed lines of that second by
(timestamp, text), so nothing is counted twice or lost; the high-water mark survives container
restarts, so a previous container's log read after the new one's never counts a line twice.
When restartCount grows, the previous container's log is read once (its tail may not have
reached us before it exited). Lines are split on "\\n" only (signatures.py relies on the "\\r"
vLLM leaves on continuation lines) and cut at MAX_LINE_BYTES, so one endless line costs bounded
memory and linear work.

What a line means is the sink's business (logwatch.LogWatch): `detected`, `extra_signatures`,
and `follower_ended` when the pod is gone.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import threading
import time
from typing import Protocol

from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import ReadTimeoutError

from vlm_operator import builders, signatures
from vlm_operator.kube import Kube, object_path
from vlm_operator.metrics import (
    LOG_LINES,
    LOG_LINES_DEDUPLICATED,
    LOG_LINES_TRUNCATED,
    LOG_RECONNECTS,
)
from vlm_operator.reconciler import owner_name

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 120.0  # a quiet stream is re-opened (cheap: resumed with sinceTime)
CONNECT_TIMEOUT_S = 10.0
RETRY_MIN_S, RETRY_MAX_S = 0.5, 10.0
END_PAUSE_S = 0.5  # after a clean end (the container exited) before looking again
NOT_RUNNING_POLL_S = 0.5
MAX_LINE_BYTES = 64 * 1024


def parse_stamp_ns(stamp: str) -> int | None:
    """RFC3339Nano (the kubelet's timestamps=true prefix) to epoch nanoseconds."""
    head, _, frac = stamp.partition(".")
    zone = "Z"
    if frac:
        digits = frac.rstrip("Z")
        for sign in "+-":
            if sign in digits:
                digits, zone = digits.split(sign, 1)[0], sign + digits.split(sign, 1)[1]
        frac = digits
    elif head.endswith("Z"):
        head = head[:-1]
    try:
        secs = dt.datetime.fromisoformat(head + ("+00:00" if zone == "Z" else zone)).timestamp()
    except ValueError:
        return None
    return int(secs) * 1_000_000_000 + int((frac + "000000000")[:9] or 0)


def since_time(sec: int) -> str:
    return dt.datetime.fromtimestamp(sec, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Dedupe:
    """Lines already seen, for resuming a stream with a second-precision sinceTime."""

    def __init__(self) -> None:
        self.sec = 0
        self.seen: set[tuple[int, str]] = set()

    def fresh(self, ns: int, text: str) -> bool:
        sec = ns // 1_000_000_000
        if sec < self.sec or (ns, text) in self.seen:
            return False
        if sec > self.sec:
            self.sec, self.seen = sec, set()
        self.seen.add((ns, text))
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


ENDED, QUIET, ERROR = "ended", "quiet", "error"


def retry_wait(outcome: str, delay: float, ran_for: float) -> tuple[float, float]:
    """(seconds to wait now, the back-off for the next error) after a stream stopped.

    ENDED: a clean end (the container exited): pause briefly while its status catches up
    instead of polling in a tight loop. QUIET: the read timeout of a healthy idle stream:
    reopen at once. ERROR: exponential back-off, started afresh after a stream that had run
    for a while, so one old failure never slows detection after a quiet period."""
    if outcome == ENDED:
        return END_PAUSE_S, RETRY_MIN_S
    if outcome == QUIET:
        return 0.0, RETRY_MIN_S
    if ran_for > RETRY_MAX_S:
        delay = RETRY_MIN_S
    return delay, min(delay * 2, RETRY_MAX_S)


class Sink(Protocol):
    kube: Kube

    def extra_signatures(self, namespace: str, owner: str) -> tuple: ...

    def detected(self, follower: Follower, det: signatures.Detection, t: float) -> None: ...

    def follower_ended(self, follower: Follower) -> None: ...


def container_status(pod: dict) -> dict:
    return next((c for c in (pod.get("status") or {}).get("containerStatuses") or []
                 if c.get("name") == builders.CONTAINER), {})


def restart_count(pod: dict) -> int:
    return int(container_status(pod).get("restartCount") or 0)


def is_running(pod: dict) -> bool:
    return "running" in (container_status(pod).get("state") or {})


class Follower(threading.Thread):
    """Follows one pod's vllm container log until stopped or the pod is gone."""

    def __init__(self, sink: Sink, pod: dict) -> None:
        meta = pod["metadata"]
        super().__init__(daemon=True, name=f"logs {meta['namespace']}/{meta['name']}")
        self.sink = sink
        self.namespace, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.owner = owner_name(pod) or ""
        self.pod = pod
        self.stopped = threading.Event()
        self.restarts = restart_count(pod)
        self.extra: tuple[signatures.Signature, ...] = ()
        self.scanner = signatures.Scanner()
        self.dedupe = Dedupe()
        # what this container instance said about the tokenizer pool: "active", "inactive:
        # <reason>" (any inactive line wins: one process's active line must not hide another's
        # failure) or None (no startup line yet)
        self.plugin: str | None = None
        self.engine_dead_at: float | None = None
        self.last_line_at: float | None = None  # when the stream last delivered a line
        self._response = None
        self._timer: threading.Timer | None = None

    def recheck_at(self, when: float, fn) -> None:
        """Call fn(self) at epoch time `when` (one pending recheck per follower)."""
        if self._timer is not None and self._timer.is_alive():
            return
        self._timer = threading.Timer(max(0.0, when - time.time()), fn, (self,))
        self._timer.daemon = True
        self._timer.start()

    def stop(self) -> None:
        self.stopped.set()
        if self._timer is not None:
            self._timer.cancel()
        resp = self._response
        if resp is not None:
            with contextlib.suppress(Exception):  # best effort: the read timeout ends it anyway
                resp.shutdown()

    def run(self) -> None:
        try:
            self._follow()
        finally:
            self.sink.follower_ended(self)

    def _follow(self) -> None:
        delay = RETRY_MIN_S
        while not self.stopped.is_set():
            opened, outcome = time.monotonic(), ERROR
            try:
                pod = self.sink.kube.get("v1", "Pod", self.namespace, self.name)
                if pod is None or pod["metadata"]["uid"] != self.uid:
                    return
                self.pod = pod
                restarts = restart_count(pod)
                if restarts > self.restarts:
                    self._stream(previous=True)
                    self.restarts = restarts
                    self._new_instance()
                if not is_running(pod):
                    self.stopped.wait(NOT_RUNNING_POLL_S)
                    continue
                opened = time.monotonic()
                self._stream(previous=False)
                outcome = ENDED
            except ReadTimeoutError:
                outcome = QUIET
            except ApiException as exc:
                if exc.status == 404:
                    return
                if exc.status != 400:  # 400: container not started yet
                    log.info("log of %s/%s: %s %s", self.namespace, self.name, exc.status,
                             exc.reason)
            except Exception as exc:  # never let one pod's stream kill the thread
                if not self.stopped.is_set():
                    log.info("log of %s/%s: %s; reconnecting", self.namespace, self.name, exc)
            LOG_RECONNECTS.inc()
            wait, delay = retry_wait(outcome, delay, time.monotonic() - opened)
            self.stopped.wait(wait)

    def _new_instance(self) -> None:
        """A new container instance: fresh scanner state; the dedupe mark stays (times only
        grow), so a re-read of lines already counted never counts them again."""
        self.scanner = signatures.Scanner(self.extra)
        self.plugin = None
        self.engine_dead_at = None

    def _stream(self, previous: bool) -> None:
        query = [("container", builders.CONTAINER), ("timestamps", "true")]
        query.append(("previous", "true") if previous else ("follow", "true"))
        if self.dedupe.sec:
            query.append(("sinceTime", since_time(self.dedupe.sec)))
        api = self.sink.kube.api
        params = api.param_serialize(
            "GET", object_path("v1", "Pod", self.namespace, self.name) + "/log",
            query_params=query, header_params={"Accept": "*/*"}, auth_settings=["BearerToken"])
        response = api.call_api(*params, _request_timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S))
        raw = response.response
        if not 200 <= response.status <= 299:
            response.read()
            raise ApiException(http_resp=response)
        self._response = raw
        splitter = LineSplitter()
        try:
            for chunk in raw.stream(65536, decode_content=False):
                if self.stopped.is_set():
                    return
                for line in splitter.feed(chunk):
                    self._line(line.decode("utf-8", "replace"))
            rest = splitter.rest()
            if rest and previous:  # a dead container's last line may lack its newline
                self._line(rest.decode("utf-8", "replace"))
        finally:
            LOG_LINES_TRUNCATED.inc(splitter.truncated)
            self._response = None
            raw.release_conn()

    def _line(self, line: str) -> None:
        stamp, _, text = line.partition(" ")
        ns = parse_stamp_ns(stamp)
        if ns is None:  # not the kubelet's prefix: count it, scan it untimed
            ns, text = 0, line
        elif not self.dedupe.fresh(ns, text):
            LOG_LINES_DEDUPLICATED.inc()
            return
        LOG_LINES.inc()
        self.last_line_at = time.time()
        try:
            extra = self.sink.extra_signatures(self.namespace, self.owner)
            if extra is not self.extra:  # the VLMDeployment's extraSignatures changed
                self.extra, self.scanner = extra, signatures.Scanner(extra)
            detections = self.scanner.feed(line)
        except Exception:  # a bad line must never stop the stream
            log.exception("scanner failed on a line of %s/%s", self.namespace, self.name)
            return
        for det in detections:
            if det.new_incident:
                self.sink.detected(self, det, ns / 1e9 if ns else time.time())
