"""stream.py and reconnect.py: when a follower reconnects, and a follower against a stub API
(not-running pods, previous logs, the logging prefix, failing lines, resume marks, the log
budget)."""

from __future__ import annotations

from vlm_operator.logs.reconnect import (
    END_WAIT_S,
    ENDED,
    ERROR,
    QUIET,
    QUIET_MIN_S,
    READ_TIMEOUT_S,
    RETRY_MAX_S,
    RETRY_MIN_S,
    hold_to,
    quiet_s,
    retry_wait,
)


def test_retry_wait():
    # a clean end (container exit) waits for the pod's event instead of polling the apiserver
    assert retry_wait(ENDED, 8.0, 0.1) == (END_WAIT_S, RETRY_MIN_S) and END_WAIT_S > 0
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


# ---------------------------------------------------------------- a follower against a stub API

import json  # noqa: E402
import logging  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from kubernetes.client.exceptions import ApiException  # noqa: E402

from vlm_operator.api.names import LOG_MARK  # noqa: E402
from vlm_operator.k8s.pods import rfc3339  # noqa: E402
from vlm_operator.logs import stream  # noqa: E402
from vlm_operator.logs.budget import LineBudget  # noqa: E402
from vlm_operator.logs.marks import Mark  # noqa: E402
from vlm_operator.logs.stream import Follower  # noqa: E402

STAMP = "2026-11-30T19:00:00.000000001Z"
ACTIVE = ("(APIServer pid=1) INFO 11-30 19:00:00 [plugin.py:54] vlm-tokenizer-pool active: "
          "vllm=0.32.0 pool_size=3 patched=x")


def pod_of(state="running", restarts=0, container="cri://a", env=(), annotations=None):
    return {"metadata": {"name": "p", "namespace": "ml", "uid": "u",
                         "annotations": annotations or {},
                         "labels": {"app.kubernetes.io/instance": "demo"}},
            "spec": {"containers": [{"name": "vllm", "env": list(env)}]},
            "status": {"containerStatuses": [{"name": "vllm", "restartCount": restarts,
                                              "containerID": container,
                                              "state": {state: {}}}]}}


class Stream:
    """What urllib3 hands the follower for a pods/log request: the body, then its end."""

    status = 200

    def __init__(self, lines):
        self.response = self
        self.body = b"".join(f"{STAMP} {line}\n".encode() for line in lines)

    def stream(self, size, decode_content=False):
        yield self.body

    def release_conn(self):
        pass

    def shutdown(self):
        pass


class Api:
    """The apiserver as the follower's log requests see it: `answer(query)` returns a Stream or
    raises; every request is recorded."""

    def __init__(self, answer):
        self.answer, self.requests = answer, []

    def param_serialize(self, method, path, query_params, header_params, auth_settings):
        return method, path, query_params

    def call_api(self, method, path, query, _request_timeout=None):
        self.requests.append(dict(query))
        return self.answer(dict(query))


class Sink:
    def __init__(self, answer=lambda q: Stream([]), budget=None):
        self.kube = self
        self.budget = budget or LineBudget()
        self.throttles = []
        self.api = Api(answer)
        self.gets, self.marks, self.unreadable, self.ended = 0, [], [], threading.Event()

    def get(self, *args):  # Kube.get: the follower must not poll pods
        self.gets += 1
        return None

    def extra_signatures(self, namespace, owner):
        return ()

    def detected(self, follower, det, t):
        if det.signature == "plugin_active":
            follower.plugin = "active"

    def follower_ended(self, follower):
        self.ended.set()

    def lookback_s(self, namespace, owner):
        return 60.0

    def write_mark(self, follower, mark):
        self.marks.append(mark)

    def previous_unreadable(self, follower, reason):
        self.unreadable.append(reason)

    def log_news(self, follower):
        pass

    def throttled(self, follower, lines):
        self.throttles.append(lines)


def until(what, check, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_pod_that_is_not_running_costs_no_requests_until_its_next_event():
    """A Pending or crash-looping pod's follower GOT the pod twice a second for ever (100
    Pending pods: 200 requests/s). It now waits for the pod's watch event."""
    sink = Sink()
    follower = Follower(sink, pod_of(state="waiting"))
    follower.start()
    try:
        time.sleep(1.5)  # what main did meanwhile: 3 GETs
        assert (sink.gets, sink.api.requests) == (0, [])
        follower.hand(pod_of())  # the event that says it runs
        until("the log stream opened", lambda: sink.api.requests)
        assert sink.api.requests[0]["follow"] == "true" and sink.gets == 0
    finally:
        follower.stop()
    assert sink.ended.wait(5)


def test_a_refused_previous_log_is_reported_and_the_current_container_followed():
    """previous=true answered 400 (the kubelet lost the old container: ContainerStatusUnknown
    after a node restart); the follower retried it for ever and never read the new one."""
    restarted = threading.Event()

    def answer(query):
        if query.get("previous") == "true":
            restarted.set()
            exc = ApiException(status=400, reason="Bad Request")
            exc.body = json.dumps({"message": 'previous terminated container "vllm" in pod "p" '
                                              "not found"})
            raise exc
        return Stream([ACTIVE] if restarted.is_set() else [])  # the new container's line

    sink = Sink(answer)
    follower = Follower(sink, pod_of())
    follower.start()
    try:
        follower.hand(pod_of(restarts=1, container="cri://b"))
        until("the current container read", lambda: follower.plugin == "active")
    finally:
        follower.stop()
    previous = [q for q in sink.api.requests if q.get("previous")]
    assert len(previous) == 1  # not retried: the kubelet said it has no such container
    assert sink.unreadable == ['400 Bad Request: previous terminated container "vllm" in pod '
                               '"p" not found']


def test_the_pods_logging_prefix_is_used():
    """VLLM_LOGGING_PREFIX in the pod's env: without it every line lost its header and every
    signature (and the plugin's startup line) was missed."""
    sink = Sink()
    prefixed = Follower(sink, pod_of(env=[{"name": "VLLM_LOGGING_PREFIX", "value": "[v] "}]))
    prefixed._line(f"{STAMP} [v] {ACTIVE}")
    assert prefixed.plugin == "active" and prefixed.readable
    unknown = Follower(sink, pod_of(env=[{"name": "VLLM_LOGGING_PREFIX", "valueFrom": {
        "configMapKeyRef": {"name": "c", "key": "k"}}}]))
    assert unknown.prefix is None
    told_nothing = Follower(sink, pod_of())
    told_nothing._line(f"{STAMP} [v] {ACTIVE}")
    assert told_nothing.plugin is None and not told_nothing.readable
    assert told_nothing.scanner.foreign == 1  # for the report: it looks like vLLM's log


def test_a_line_the_matcher_fails_on_is_counted_and_logged_once_a_minute(caplog, monkeypatch):
    sink = Sink()
    follower = Follower(sink, pod_of())

    def boom(line):
        raise ValueError("bad line")

    monkeypatch.setattr(follower.scanner, "feed", boom)
    before = stream.LOG_LINE_ERRORS.labels("scan")._value.get()
    with caplog.at_level(logging.INFO, logger="vlm_operator.logs.stream"):
        for i in range(100):
            follower._line(f"{STAMP} line {i}")
    assert stream.LOG_LINE_ERRORS.labels("scan")._value.get() - before == 100
    records = [r for r in caplog.records if r.name == "vlm_operator.logs.stream"]
    assert len(records) == 1 and records[0].exc_info is None
    assert "could not be scanned (ValueError: bad line)" in records[0].getMessage()


def test_a_fresh_follower_resumes_from_the_mark_with_what_it_knew():
    """An operator restart re-read the whole log from the container's start (and a pod that
    floods its log made every restart replay all of it); with the mark, only what follows it
    and the last incident window are read, and the plugin state comes from the mark."""
    mark = Mark("cri://a", (int(time.time()) - 3600) * 1_000_000_000 + 5, "active", None, True)
    sink = Sink()
    follower = Follower(sink, pod_of(annotations={LOG_MARK: mark.value()}))
    follower.start()
    try:
        until("the log stream opened", lambda: sink.api.requests)
    finally:
        follower.stop()
    assert sink.api.requests[0]["sinceTime"] == rfc3339(mark.ns // 1_000_000_000)
    assert follower.plugin == "active" and follower.readable
    # the lines of that second up to the mark were handled before; the ones after were not
    assert not follower.dedupe.fresh(mark.ns, "handled")
    assert follower.dedupe.fresh(mark.ns + 1, "new")


def test_marks_are_written_at_a_bounded_rate_for_the_current_container():
    sink = Sink()
    follower = Follower(sink, pod_of(), mark_every_s=3600)
    follower._container = "cri://a"
    for i in range(50):
        follower._line(f"2026-11-30T19:00:{i:02d}.5Z line {i}")
    assert sink.marks == []  # not before mark_every_s
    follower._mark_at -= 3600
    for i in range(50):
        follower._line(f"2026-11-30T19:01:{i:02d}.5Z line {i}")
    assert [(m.container, m.ns) for m in sink.marks] == [("cri://a", 1796065260_500000000)]


def test_after_a_container_exit_the_log_is_read_again_only_once_its_pod_event_came():
    """The stream ends when the container exits; reopened while the pod still looked like the
    old container running, it would read the new container's log as the old one's and never
    read the previous log. The follower waits for the pod event first."""
    sink = Sink()  # every stream ends at once, as the exited container's does
    follower = Follower(sink, pod_of())
    follower.start()
    try:
        until("the first stream", lambda: sink.api.requests)
        time.sleep(1.0)
        assert len(sink.api.requests) == 1  # no reopening on a stale "running"
        follower.hand(pod_of(restarts=1, container="cri://b"))
        until("the previous log, then the new container's",
              lambda: len(sink.api.requests) >= 3)
    finally:
        follower.stop()
    assert [("previous" in q, "follow" in q) for q in sink.api.requests[:3]] == [
        (False, True), (True, False), (False, True)]


# ---------------------------------------------------------------- the log budget

# a dying engine process's own traceback (no vLLM header): read only line after line, in order
ENGINE_DEATH = ["Traceback (most recent call last):",
                '  File "/v/core.py", line 1, in run_engine_core',
                "    run()",
                "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. "
                "See stack trace (above) for the root cause."]
FLOOD = [f"(APIServer pid=1) INFO 11-30 19:00:00 [logger.py:1] flood {i}" for i in range(20_000)]


class Chunked(Stream):
    """The body in 4 KiB chunks, as a busy stream arrives (lines split across chunks)."""

    def stream(self, size, decode_content=False):
        for i in range(0, len(self.body), 4096):
            yield self.body[i:i + 4096]


class Detecting(Sink):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.detections = []

    def detected(self, follower, det, t):
        self.detections.append((follower.name, det.signature, det.source))


def named(name, namespace):
    pod = pod_of()
    pod["metadata"].update(name=name, namespace=namespace, uid=name)
    return pod


def test_a_flooding_pod_is_throttled_while_engine_deaths_elsewhere_are_read_in_full():
    """Every line of every pod was scanned with the GIL held (about 20 µs each): one pod
    flooding its log took the operator's CPU from every other tenant. Now a pod gets its share
    of the log budget; the lines over it are skipped unread and reported, and a pod within
    its own share, in another namespace or in the flooding one, has every line read: its
    engine death, the traceback around it included, is detected."""
    budget = LineBudget(lines_per_s=1_000, cpu_per_s=10.0, burst_s=1.0, clock=lambda: 0.0)
    sink = Detecting(answer=lambda q: Chunked(FLOOD), budget=budget)
    flooder = Follower(sink, named("flooder", "noisy"))
    flooder._stream(previous=False)
    assert flooder.scanner.headered == 1_000  # its share: 1,000 lines/s, one second of burst
    # the rest skipped, line by line, then whole chunks unsplit: every line counted once
    assert sum(sink.throttles) == 19_000 and len(sink.throttles) > 100
    sink.api.answer = lambda q: Stream(ENGINE_DEATH)
    for name, namespace in (("victim", "other"), ("neighbour", "noisy")):
        Follower(sink, named(name, namespace))._stream(previous=False)
    assert [d for d in sink.detections if d[0] != "flooder"] == [
        ("victim", "engine_dead", "traceback"), ("neighbour", "engine_dead", "traceback")]
    assert sum(sink.throttles) == 19_000  # nothing of theirs was skipped


def test_the_cpu_a_pods_lines_take_is_budgeted_too():
    """Lines that are costly to match (a VLMDeployment's extra signatures) run out the pod's
    CPU share before its line share: 20 ms of CPU (the least a bucket holds) reads far fewer
    than the 20,000 lines its line bucket would let through (each costs microseconds)."""
    budget = LineBudget(lines_per_s=100_000, cpu_per_s=0.001, burst_s=1.0, clock=lambda: 0.0)
    sink = Detecting(answer=lambda q: Stream(FLOOD), budget=budget)
    follower = Follower(sink, named("costly", "noisy"))
    follower._stream(previous=False)
    assert 0 < follower.scanner.headered < len(FLOOD) // 2
    assert sum(sink.throttles) == len(FLOOD) - follower.scanner.headered


# -- a stream that goes quiet while its container still logs (the kubelet's rotation)

HEARTBEAT = ("(EngineCore pid=7) INFO 11-30 19:00:00 [heartbeat.py:162] vlm-engine-heartbeat "
             "every=5 steps=12 in_flight=0 step_s=0.0 step_tokens=0 running=0 waiting=0")


def test_a_heartbeating_pods_stream_may_stay_silent_four_periods_within_bounds():
    assert quiet_s("5") == 20.0 and quiet_s("10") == 40.0
    assert quiet_s("0.5") == QUIET_MIN_S  # never a hair trigger
    assert quiet_s("60") == READ_TIMEOUT_S  # never longer than any stream waits
    assert [quiet_s(x) for x in ("0", "-1", "nan", "x", None, "3600")] == [None] * 6


class Sock:
    def __init__(self):
        self.timeout = READ_TIMEOUT_S

    def gettimeout(self):
        return self.timeout

    def settimeout(self, t):
        self.timeout = t


class Heartbeating(Stream):
    """The body, on a connection whose socket timeout the follower may shorten."""

    def __init__(self, lines):
        super().__init__(lines)
        self.connection = type("Connection", (), {"sock": Sock()})()


def test_the_follower_holds_a_heartbeating_stream_to_what_its_heartbeat_promises():
    """Once the engine heartbeat says every=5, the open stream's reads time out after 20 s of
    silence instead of READ_TIMEOUT_S; a new container starts without the promise."""
    answered = []

    def answer(query):
        answered.append(Heartbeating(["(APIServer pid=1) INFO 11-30 19:00:00 [a.py:1] hi",
                                      HEARTBEAT]))
        return answered[-1]

    follower = Follower(Sink(answer), pod_of())
    follower._stream(previous=False)
    assert follower.quiet_s == 20.0
    assert answered[0].connection.sock.timeout == 20.0
    follower._stream(previous=True)  # a previous container's log keeps the request's timeout
    assert answered[1].connection.sock.timeout == READ_TIMEOUT_S
    follower._new_instance()
    assert follower.quiet_s is None


def test_hold_to_times_out_a_real_stream_that_went_quiet():
    """Against a real server and urllib3: a chunked response that sends a line, then nothing
    while keeping the connection open. Held to 0.3 s, the read raises ReadTimeoutError (the
    follower's QUIET: re-opened at once), long before the request's own read timeout."""
    import http.server

    import urllib3
    from urllib3.exceptions import ReadTimeoutError

    release = threading.Event()

    class Quiet(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            line = f"{STAMP} {HEARTBEAT}\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            self.wfile.flush()
            release.wait(30)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        pool = urllib3.PoolManager()
        resp = pool.request("GET", f"http://127.0.0.1:{server.server_port}/log",
                            preload_content=False, timeout=urllib3.Timeout(connect=5, read=60))
        chunks = resp.stream(65536, decode_content=False)
        assert HEARTBEAT.encode() in next(chunks)
        hold_to(resp, 0.3)
        started = time.monotonic()
        try:
            next(chunks)
            raise AssertionError("the quiet stream was not timed out")
        except ReadTimeoutError:
            pass
        assert time.monotonic() - started < 5
        hold_to(resp, None)  # nothing to hold to: left as it is
    finally:
        release.set()
        server.shutdown()
        server.server_close()
