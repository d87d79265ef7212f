"""Following one pod's vLLM log through the apiserver: the follower thread and its streams.

One thread per pod follows `pods/log?follow=true&timestamps=true`. A dropped or stuck stream
(reconnect.py) is resumed with sinceTime, that second's replayed lines dropped (Dedupe), so nothing
is counted twice or lost; the high-water mark survives container restarts, so a previous
container's log read after the new one's never counts a line twice. When restartCount grows,
the previous container's log is read once (its tail may not have reached us before it exited);
one the kubelet will not serve (it lost the container, e.g. after a node restart: 400) is
skipped and reported, and the current container is followed. Bytes become lines in lines.py
(split on "\\n" only, cut at MAX_LINE_BYTES); a line the matcher fails on is counted and logged
at most once a minute (throttle.py), never with a traceback per line.

A pod that is not running (Pending, ContainerCreating, CrashLoopBackOff, evicted) costs no
requests: its follower waits for the pod's next watch event (`hand`), with one GET only after
NOT_RUNNING_RECHECK_S without any (kopf re-lists every 5 minutes, so only a pod that vanished
without a DELETED event gets there).

A fresh operator process does not re-read a long log: the follower writes a resume mark on the
pod at most once every `mark_every_s` while lines come, and starts where the mark of the current
container says (marks.py).

The prefix vLLM writes before its header (VLLM_LOGGING_PREFIX) is read from the pod's own spec,
never from the log. What a line means is the sink's business (watcher.LogWatch).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Protocol

from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import ReadTimeoutError

from vlm_operator.desired import children
from vlm_operator.k8s.kube import Kube, object_path
from vlm_operator.k8s.pods import kept_pod, rfc3339, vlmd_name
from vlm_operator.k8s.views import Body, Pod
from vlm_operator.logs import marks, matcher
from vlm_operator.logs.budget import LineBudget
from vlm_operator.logs.header import logging_prefix
from vlm_operator.logs.lines import Dedupe, LineSplitter
from vlm_operator.logs.reconnect import (
    ENDED,
    ERROR,
    QUIET,
    READ_TIMEOUT_S,
    RETRY_MAX_S,
    RETRY_MIN_S,
    api_reason,
    hold_to,
    quiet_s,
    retry_wait,
)
from vlm_operator.logs.throttle import Throttled
from vlm_operator.metrics import (
    LOG_LINE_ERRORS,
    LOG_LINES,
    LOG_LINES_DEDUPLICATED,
    LOG_LINES_TRUNCATED,
    LOG_PREVIOUS_UNREADABLE,
    LOG_RECONNECTS,
)
from vlm_operator.remediation.suspect import GpuFault

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
NOT_RUNNING_RECHECK_S = 600.0  # a pod not running and without events this long is read once
PREVIOUS_ATTEMPTS = 4  # reads of a previous container's log before it is given up
MARK_EVERY_S = 300.0  # at most one mark write per pod this often (runner.py: --log-mark-seconds)

class Sink(Protocol):
    kube: Kube
    budget: LineBudget

    def extra_signatures(self, namespace: str, name: str) -> tuple: ...

    def detected(self, follower: Follower, det: matcher.Detection, t: float) -> None: ...

    def follower_ended(self, follower: Follower) -> None: ...

    def lookback_s(self, namespace: str, name: str) -> float: ...

    def write_mark(self, follower: Follower, mark: marks.Mark) -> None: ...

    def previous_unreadable(self, follower: Follower, reason: str) -> None: ...

    def log_news(self, follower: Follower) -> None: ...

    def throttled(self, follower: Follower, lines: int) -> None: ...


class Follower(threading.Thread):
    """Follows one pod's vllm container log until stopped or the pod is gone. The pod object
    comes from the pod's watch events (`hand`), not from polling the apiserver."""

    def __init__(self, sink: Sink, pod: dict, mark_every_s: float = MARK_EVERY_S) -> None:
        meta = Body(pod)
        super().__init__(daemon=True, name=f"logs {meta.namespace}/{meta.name}")
        self.sink = sink
        self.namespace, self.name, self.uid = meta.namespace, meta.name, meta.uid
        self.vlmd_name = vlmd_name(pod) or ""
        self.pod = pod
        self.mark_every_s = mark_every_s
        self.stopped = threading.Event()
        self.woken = threading.Event()  # a pod event came (hand) or the follower stops
        self.restarts = Pod(pod).restart_count
        self.prefix = logging_prefix(pod)  # None: not known (from valueFrom)
        self.extra: tuple[matcher.Signature, ...] = ()
        self.scanner = matcher.Scanner((), self.prefix or "")
        self.dedupe = Dedupe()
        # what this container instance said about the tokenizer pool: "active", "inactive:
        # <reason>" (any inactive line wins: one process's active line must not hide another's
        # failure) or None (no startup line yet)
        self.plugin: str | None = None
        self.engine_dead_at: float | None = None
        self.gpu_error: GpuFault | None = None  # the pod's last one (its GPU outlives containers)
        self.readable_before = False  # the resume mark says vLLM's header was seen before it
        self.reading_since: float | None = None  # when this container's log began to be read
        # the log time (the kubelet's timestamp, else when it came) of the last line delivered
        self.last_line_stamp: float | None = None
        self.quiet_s: float | None = None  # the silence its heartbeat allows (reconnect.py)
        self._response = None
        self._timer: threading.Timer | None = None
        self._resumed = False  # the resume mark is looked at once, for the first container
        self._previous = False  # reading the previous container's log now
        self._container: str | None = None  # the containerID whose log is streamed
        self._last_ns = 0  # stamp of the last line of the current container handled
        self._marked_ns = 0  # ... when the last mark was written
        self._mark_at = time.monotonic()
        self._errors = Throttled()
        self._skipped = 0  # lines over the pod's log budget not yet reported (sink.throttled)
        self._gap = self._gap_cr = False  # lines skipped since the last scanned; one mid-record

    @property
    def readable(self) -> bool:
        """A line with vLLM's header (under the pod's prefix) was seen in this container."""
        return self.readable_before or self.scanner.headered > 0

    def hand(self, pod: dict) -> None:
        """The pod's latest state, from its watch event: look at it now."""
        self.pod = pod
        self.woken.set()

    def recheck_at(self, when: float, fn) -> None:
        """Call fn(self) at epoch time `when` (one pending recheck per follower)."""
        if self._timer is not None and self._timer.is_alive():
            return
        self._timer = threading.Timer(max(0.0, when - time.time()), fn, (self,))
        self._timer.daemon = True
        self._timer.start()

    def stop(self) -> None:
        self.stopped.set()
        self.woken.set()
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
            self.woken.clear()  # before reading self.pod: an event from now on wakes the wait
            pod = self.pod
            opened, outcome = time.monotonic(), ERROR
            try:
                restarts = Pod(pod).restart_count
                if restarts > self.restarts:
                    self._read_previous()
                    self.restarts = restarts
                    self._new_instance()
                if not Pod(pod).running:
                    if not self.woken.wait(NOT_RUNNING_RECHECK_S) and not self._still_there():
                        return
                    continue
                self._resume(pod)
                self._container = Pod(pod).container.get("containerID")
                opened = time.monotonic()
                if self.reading_since is None:
                    self.reading_since = time.time()
                    self.sink.log_news(self)  # the startup line's grace counts from now
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
            if outcome == ENDED:
                self._await_exit_news(wait)
            else:
                self.stopped.wait(wait)

    def _await_exit_news(self, most_s: float) -> None:
        """After a clean end (the container exited), wait for the pod event that says what came
        of it (terminated, waiting, a new container) before the log is read again: a stream
        opened while the pod still looked like the old container running would read the new
        container's log as the old one's, and its restart would go unseen. A stream that ended
        for another reason is reopened after most_s."""
        deadline = time.monotonic() + most_s
        while not self.stopped.is_set():
            pod = Pod(self.pod)
            if (not pod.running or pod.restart_count > self.restarts
                    or pod.container.get("containerID") != self._container):
                return
            left = deadline - time.monotonic()
            if left <= 0 or not self.woken.wait(left):
                return
            self.woken.clear()

    def _still_there(self) -> bool:
        """The safety re-check of a pod not running that had no event for a long time: read
        it once; False when it is gone (or another pod took its name)."""
        pod = self.sink.kube.get("v1", "Pod", self.namespace, self.name)
        if pod is None or Pod(pod).uid != self.uid:
            return False
        self.pod = kept_pod(pod)
        return True

    def _read_previous(self) -> None:
        """The previous container's log, read once. A log the kubelet will not serve (400: it
        has no record of that container, e.g. ContainerStatusUnknown after a node restart) or
        that still fails after PREVIOUS_ATTEMPTS reads is given up and reported: the current
        container is followed in any case."""
        reason = ""
        for attempt in range(PREVIOUS_ATTEMPTS):
            try:
                self._stream(previous=True)
                return
            except ApiException as exc:
                if exc.status == 404:
                    raise
                reason = api_reason(exc)
                if exc.status == 400:
                    break
            except Exception as exc:  # a dropped or timed-out read: try again
                reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
            if self.stopped.wait(min(RETRY_MAX_S, RETRY_MIN_S * 2 ** attempt)):
                return
        LOG_PREVIOUS_UNREADABLE.inc()
        log.info("log of %s/%s: the previous container's log cannot be read (%s); following "
                 "the current one", self.namespace, self.name, reason)
        self.sink.previous_unreadable(self, reason)

    def _new_instance(self) -> None:
        """A new container instance: fresh scanner state; the dedupe mark stays (times only
        grow), so a re-read of lines already counted never counts them again."""
        self.scanner = matcher.Scanner(self.extra, self.prefix or "")
        self._gap = self._gap_cr = False
        self.plugin = None
        self.engine_dead_at = None
        self.readable_before = False
        self.reading_since = None
        self.quiet_s = None
        self._last_ns = self._marked_ns = 0

    def _resume(self, pod: dict) -> None:
        """Once, for the container running when the follower started: where its log was read
        up to by an earlier operator process (the pod's resume mark), and what it said."""
        if self._resumed:
            return
        self._resumed = True
        since, mark = marks.resume_point(
            marks.parse_mark(Pod(pod).annotations),
            Pod(pod).container.get("containerID"), time.time(),
            min(marks.MAX_REPLAY_S, self.sink.lookback_s(self.namespace, self.vlmd_name)))
        if mark is None:
            return
        self.dedupe.sec = max(self.dedupe.sec, since // 1_000_000_000)
        self.dedupe.floor = since
        self.plugin, self.engine_dead_at = mark.plugin, mark.engine_dead_at
        self.readable_before = mark.readable

    def _stream(self, previous: bool) -> None:
        query = [("container", children.CONTAINER), ("timestamps", "true")]
        query.append(("previous", "true") if previous else ("follow", "true"))
        if self.dedupe.sec:
            query.append(("sinceTime", rfc3339(self.dedupe.sec)))
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
        self._previous = previous
        splitter = LineSplitter()
        try:
            for chunk in raw.stream(65536, decode_content=False):
                if self.stopped.is_set():
                    return
                if self.sink.budget.spent(self.namespace, self.uid):  # not split into lines
                    self._skipped_lines(*splitter.skip(chunk))
                else:
                    for line in splitter.feed(chunk):
                        self._offer(line)
                self._report_skipped()
                hold_to(raw, None if previous else self.quiet_s)
            rest = splitter.rest()
            if rest and previous:  # a dead container's last line may lack its newline
                self._offer(rest)
        finally:
            self._report_skipped()
            LOG_LINES_TRUNCATED.inc(splitter.truncated)
            self._response = None
            self._previous = False
            raw.release_conn()

    def _offer(self, raw: bytes) -> None:
        """A line within the pod's log budget (budget.py) is scanned and the CPU it took
        charged; one over it is skipped undecoded, the matcher told of the gap later."""
        budget = self.sink.budget
        if not budget.admit(self.namespace, self.uid):
            return self._skipped_lines(1, raw.endswith(b"\r"))
        started = time.thread_time()
        if self._gap:
            self.scanner.skipped(self._gap_cr)
            self._gap = self._gap_cr = False
        self._line(raw.decode("utf-8", "replace"))
        budget.spend(self.namespace, self.uid, time.thread_time() - started)

    def _skipped_lines(self, lines: int, ended_cr: bool) -> None:
        if lines:  # counted; the matcher is told of the gap before the next line it sees
            self._skipped += lines
            self._gap, self._gap_cr = True, self._gap_cr or ended_cr

    def _report_skipped(self) -> None:
        if self._skipped:
            skipped, self._skipped = self._skipped, 0
            self.sink.throttled(self, skipped)

    def _line(self, line: str) -> None:
        stamp, _, text = line.partition(" ")
        ns = marks.parse_stamp_ns(stamp)
        if ns is None:  # not the kubelet's prefix: count it, scan it untimed
            ns, text = 0, line
        elif not self.dedupe.fresh(ns, text):
            LOG_LINES_DEDUPLICATED.inc()
            return
        LOG_LINES.inc()
        self.last_line_stamp = ns / 1e9 if ns else time.time()
        readable = self.readable
        try:
            extra = self.sink.extra_signatures(self.namespace, self.vlmd_name)
            if extra is not self.extra:  # the VLMDeployment's extraSignatures changed
                self.extra = extra
                self.scanner = matcher.Scanner(extra, self.prefix or "")
            detections = self.scanner.feed(line)
        except Exception as exc:  # a bad line must never stop the stream, nor flood our log
            LOG_LINE_ERRORS.labels("scan").inc()
            self._errors.log(log, logging.WARNING, "log of %s/%s: a line could not be scanned "
                             "(%s: %.200s)", self.namespace, self.name, type(exc).__name__, exc)
            return
        for det in detections:
            if det.signature == "engine_heartbeat":
                self.quiet_s = quiet_s(det.fields.get("every"))
            if det.first:
                self.sink.detected(self, det, ns / 1e9 if ns else time.time())
        if not readable and self.readable:
            self.sink.log_news(self)
        if not self._previous and ns:
            self._last_ns = ns
            self._maybe_mark()

    def _maybe_mark(self) -> None:
        """Write the resume mark when mark_every_s has passed since the last one and lines
        came since (the sink decides whether this replica writes marks)."""
        now = time.monotonic()
        if now - self._mark_at < self.mark_every_s or self._last_ns <= self._marked_ns:
            return
        if not self._container:
            return
        self._mark_at, self._marked_ns = now, self._last_ns
        self.sink.write_mark(self, marks.Mark(
            self._container, self._last_ns,
            self.plugin[:marks.MAX_MARK_TEXT] if self.plugin else None, self.engine_dead_at,
            self.readable))
