"""The operator's HTTP exchanges with pods (podreads/podhttp.py, through reader.py and
canary.py), against local servers: the vLLM stand-in in its hostile modes (redirects, a huge
/metrics, drip-fed headers), a port nothing listens on, a listener whose queue is full (SYNs
dropped: a connect timeout, as behind a NetworkPolicy that drops), and one that accepts and
never answers."""

from __future__ import annotations

import http.server
import socket
import threading

import pytest

from vlm_operator.api import names
from vlm_operator.podreads import canary, podhttp, reader
from vlm_operator.podreads.podhttp import (
    BAD_ANSWER,
    REDIRECT,
    TIMEOUT,
    TOO_LARGE,
    UNREACHABLE,
    PodHTTPError,
)
from vlm_operator.stalls.verdicts import PROGRESS_METRICS
from vlm_testbed import vllmsim

POD_IP, TARGET_IP = "127.0.41.2", "127.0.41.3"


@pytest.fixture
def target():
    """The address a redirect points to: records every request it gets."""
    server = vllmsim.RecordingServer(TARGET_IP)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def stand_in(monkeypatch):
    """The vLLM stand-in's HTTP side on POD_IP, in this process; names.PORT is its port."""
    sim = vllmsim.Simulator(vllmsim.parse_serve_args(["m", "--host", POD_IP]),
                            {"VLM_SIM_STATS_INTERVAL": "0"})
    handler = type("Handler", (vllmsim.Handler,), {"sim": sim})
    httpd = http.server.ThreadingHTTPServer((POD_IP, 0), handler)
    httpd.daemon_threads = True
    monkeypatch.setattr(names, "PORT", httpd.server_address[1])
    monkeypatch.setattr(vllmsim.Simulator, "emit", lambda self, line, stream=None: None)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield sim
    httpd.shutdown()
    httpd.server_close()


def kind_of(call) -> str:
    with pytest.raises(PodHTTPError) as info:
        call()
    return info.value.kind


def test_a_well_behaved_pod_reads_as_before(stand_in):
    values = reader.get_metrics(POD_IP, PROGRESS_METRICS)
    assert set(values) == set(PROGRESS_METRICS)
    assert reader.health(POD_IP) == "ok"
    assert canary.send(POD_IP, 2.0, canary.new_id()) == canary.ANSWERED
    assert reader.requests_in_flight(POD_IP) == 0.0


def test_redirects_are_never_followed(stand_in, target):
    """Every request the operator makes to a pod meets a redirect to another address: each is
    an error for that pod, and the address it names gets nothing."""
    stand_in.apply_fault({"fault": "redirect", "to": target.url,
                          "paths": ["/metrics", "/health", "/v1/models", "/v1/completions"]})
    assert kind_of(lambda: reader.get_metrics(POD_IP, PROGRESS_METRICS)) == REDIRECT
    assert reader.health(POD_IP) == REDIRECT
    assert canary.send(POD_IP, 2.0, canary.new_id()) == REDIRECT
    assert reader.requests_in_flight(POD_IP) is None
    stand_in.apply_fault({"fault": "redirect", "to": target.url, "status": 307,
                          "paths": ["/v1/completions"]})  # the POST itself redirected
    assert canary.send(POD_IP, 2.0, canary.new_id()) == REDIRECT
    assert target.requests == []


def test_the_redirect_error_says_where_it_pointed(stand_in, target):
    stand_in.apply_fault({"fault": "redirect", "to": target.url})
    with pytest.raises(PodHTTPError) as info:
        reader.get_metrics(POD_IP, PROGRESS_METRICS)
    assert "302" in info.value.detail and target.url in info.value.detail


@pytest.mark.parametrize("length", [False, True], ids=["until-close", "content-length"])
def test_a_huge_metrics_page_is_cut_at_the_cap_and_not_parsed(stand_in, length):
    """100 MB of valid-looking samples (the very names the operator reads): refused at the
    cap, before any parsing; with a Content-Length, before its body is read."""
    stand_in.apply_fault({"fault": "huge_metrics", "bytes": 100_000_000, "length": length})
    with pytest.raises(PodHTTPError) as info:
        reader.get_metrics(POD_IP, reader.IN_FLIGHT_METRICS)
    assert info.value.kind == TOO_LARGE
    assert ("Content-Length 100000000" in info.value.detail) == length


def test_a_page_just_under_the_cap_is_read_but_not_endless_samples(stand_in):
    """Under the cap the page is read (the progress counters are not on this one); made of
    nothing but the samples asked for, it is refused past MAX_SAMPLE_LINES of them rather
    than parsed line by line (a vLLM server has a few dozen)."""
    stand_in.apply_fault({"fault": "huge_metrics", "bytes": reader.METRICS_CAP - 4096})
    assert reader.get_metrics(POD_IP, PROGRESS_METRICS) == {}
    with pytest.raises(PodHTTPError) as info:
        reader.get_metrics(POD_IP, reader.IN_FLIGHT_METRICS)
    assert info.value.kind == BAD_ANSWER and \
        f"more than {reader.MAX_SAMPLE_LINES} lines" in info.value.detail


def test_drip_fed_headers_are_cut_at_the_deadline(stand_in):
    """A header line every 0.5 s, 8 of them: each recv gets bytes well within a second, so a
    per-recv timeout would wait for all of them; the whole exchange's deadline (1 s) ends it,
    on a connection the pod accepted: a timeout, not unreachable."""
    stand_in.apply_fault({"fault": "drip_headers", "interval": 0.5, "lines": 8})
    with pytest.raises(PodHTTPError) as info:
        reader.get_metrics(POD_IP, PROGRESS_METRICS, timeout_s=1.0)
    assert info.value.kind == TIMEOUT and "within 1 s" in info.value.detail
    assert canary.send(POD_IP, 1.0, canary.new_id()) == TIMEOUT  # /v1/models drips too


def test_drip_fed_headers_within_the_deadline_are_an_answer(stand_in):
    stand_in.apply_fault({"fault": "drip_headers", "interval": 0.05, "lines": 4})
    assert set(reader.get_metrics(POD_IP, PROGRESS_METRICS, timeout_s=2.0)) == set(
        PROGRESS_METRICS)


def test_refused_is_unreachable_and_never_zero_in_flight():
    """Nothing listens (a container not started, or a CNI rejecting the operator): the
    connection cannot be made, which says nothing about requests in flight."""
    free = "127.0.41.9"
    assert kind_of(lambda: reader.get_metrics(free, PROGRESS_METRICS)) == UNREACHABLE
    assert reader.health(free) == UNREACHABLE
    assert canary.send(free, 1.0, canary.new_id()) == UNREACHABLE
    assert reader.requests_in_flight(free) is None


@pytest.fixture
def full_listener(monkeypatch):
    """A listener whose accept queue is full: the kernel drops further SYNs, so a connect
    times out, as when a NetworkPolicy drops the operator's packets."""
    server = socket.socket()
    server.bind((POD_IP, 0))
    server.listen(0)
    monkeypatch.setattr(names, "PORT", server.getsockname()[1])
    held = []
    for _ in range(4):
        sock = socket.socket()
        sock.settimeout(0.3)
        try:
            sock.connect((POD_IP, server.getsockname()[1]))
        except OSError:
            sock.close()
            break
        held.append(sock)
    yield server
    for sock in held:
        sock.close()
    server.close()


def test_a_connect_timeout_is_unreachable_not_a_timeout(full_listener):
    with pytest.raises(PodHTTPError) as info:
        reader.get_metrics(POD_IP, PROGRESS_METRICS, timeout_s=0.5)
    assert info.value.kind == UNREACHABLE and "connect timed out" in info.value.detail
    assert reader.health(POD_IP, 0.5) == UNREACHABLE
    assert canary.send(POD_IP, 0.5, canary.new_id()) == UNREACHABLE
    assert reader.requests_in_flight(POD_IP, 0.5) is None


def test_a_server_that_accepts_and_never_answers_is_a_timeout(monkeypatch):
    server = socket.socket()
    server.bind((POD_IP, 0))
    server.listen(8)  # the kernel completes the handshake; nobody ever reads
    monkeypatch.setattr(names, "PORT", server.getsockname()[1])
    try:
        assert kind_of(lambda: reader.get_metrics(POD_IP, PROGRESS_METRICS, 0.5)) == TIMEOUT
        assert reader.health(POD_IP, 0.5) == TIMEOUT
        assert canary.send(POD_IP, 0.5, canary.new_id()) == TIMEOUT
    finally:
        server.close()


class Raw:
    """A server that answers every connection with fixed bytes, then closes."""

    def __init__(self, answer: bytes) -> None:
        self.sock = socket.socket()
        self.sock.bind((POD_IP, 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.answer = answer
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    conn.recv(65536)
                    conn.sendall(self.answer)
                except OSError:
                    pass

    def get(self, cap: int = 1 << 20) -> podhttp.Answer:
        return podhttp.exchange(POD_IP, self.port, "GET", "/", timeout_s=2, cap=cap)


@pytest.fixture
def raw():
    made = []

    def make(answer: bytes) -> Raw:
        made.append(Raw(answer))
        return made[-1]

    yield make
    for server in made:
        server.sock.close()


def test_framings(raw):
    head = b"HTTP/1.1 200 OK\r\n"
    assert raw(head + b"Content-Length: 5\r\n\r\nhelloEXTRA").get().body == b"hello"
    assert raw(head + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n1;x=y\r\n!\r\n"
               b"0\r\nTrailer: t\r\n\r\n").get().body == b"hello!"
    assert raw(b"HTTP/1.0 200 OK\r\n\r\nto the end").get().body == b"to the end"
    assert raw(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n").get(
        ).status == 503


@pytest.mark.parametrize("answer, kind", [
    (b"SSH-2.0-OpenSSH_9.2\r\n\r\n", BAD_ANSWER),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", BAD_ANSWER),
    (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", BAD_ANSWER),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", BAD_ANSWER),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
     + b"1\r\na\r\n" * (podhttp.MAX_CHUNKS + 1) + b"0\r\n\r\n", BAD_ANSWER),
    (b"HTTP/1.1 100 Continue\r\n\r\n", BAD_ANSWER),
    (b"HTTP/1.1 301 Moved\r\nLocation: http://10.0.0.1/\r\n\r\n", REDIRECT),
    (b"HTTP/1.1 200 OK\r\n" + b"X-A: b\r\n" * 200 + b"\r\n", BAD_ANSWER),  # over 100
    (b"HTTP/1.1 200 OK\r\nX-A: " + b"b" * 70000 + b"\r\n\r\n", TOO_LARGE),  # headers' cap
    (b"", BAD_ANSWER),
], ids=["not-http", "short-body", "bad-length", "bad-chunk", "too-many-chunks", "interim",
        "redirect", "too-many-headers", "headers-over-cap", "nothing"])
def test_answers_no_vllm_sends_are_errors_of_their_kind(raw, answer, kind):
    server = raw(answer)
    assert kind_of(server.get) == kind


def test_the_cap_counts_headers_and_body(raw):
    server = raw(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 100)
    assert kind_of(lambda: server.get(cap=120)) == TOO_LARGE
    assert len(server.get(cap=200).body) == 100


def test_only_ip_addresses_are_dialled():
    assert kind_of(lambda: podhttp.exchange("metadata.google.internal", 80, "GET", "/",
                                            timeout_s=1, cap=100)) == BAD_ANSWER
