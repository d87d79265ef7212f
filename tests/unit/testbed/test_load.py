"""vlm_testbed.load: which EndpointSlice endpoints take traffic, and a load that counts every
request it starts (answered, or failed and why), on local servers."""

from __future__ import annotations

import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from vlm_testbed.load import LoadClient, ready_endpoints


def test_ready_endpoints_follow_the_ready_condition_and_the_named_port():
    slice_ = {"ports": [{"name": "http", "port": 8000, "protocol": "TCP"}], "endpoints": [
        {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
        {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},  # not ready, terminating
        {"addresses": ["10.0.0.3"]},  # unknown counts as ready
        {"addresses": ["10.0.0.4"], "conditions": {}}]}
    assert ready_endpoints(slice_) == ("10.0.0.1:8000", "10.0.0.3:8000", "10.0.0.4:8000")
    assert ready_endpoints({**slice_, "ports": [{"name": "metrics", "port": 9}]}) == ()
    assert ready_endpoints({"ports": [{"name": "http", "port": 8000}]}) == ()


class Slices:
    """An Informer's reads, set by the test."""

    def __init__(self, *endpoints):
        self.endpoints = [tuple(endpoints)]

    def values(self):
        return list(self.endpoints)

    def start(self):
        return self

    def stop(self):
        pass


def server(status=200):
    ip = f"127.55.{uuid.uuid4().int % 200 + 1}.{uuid.uuid4().int % 200 + 2}"

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            """quiet"""

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(status)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

    httpd = ThreadingHTTPServer((ip, 8000), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"{ip}:8000"


def test_every_request_started_is_counted_once_with_why_it_failed():
    good, good_at = server()
    bad, bad_at = server(500)
    slices = Slices(good_at, bad_at, "127.55.250.250:8000")  # the last refuses connections
    try:
        with LoadClient(slices, rate=60, concurrency=4, sync_s=0.2) as load:
            time.sleep(1.0)
            slices.endpoints = [()]  # no ready endpoint left: kube-proxy rejects
            time.sleep(0.6)
        out = load.result()
    finally:
        good.shutdown()
        bad.shutdown()
    assert out["started"] == out["answered"] + out["failed"] > 60
    assert out["answered"] > 0 and out["endpoints_used"] == 3
    assert set(out["why"]) == {"http_500", "refused", "no_ready_endpoint"}, out
    # spread in turn over the ready endpoints
    assert abs(out["answered"] - out["why"]["http_500"]) <= 2


def test_requests_are_recorded_with_their_endpoint_and_times():
    good, good_at = server()
    bad, bad_at = server(500)
    slices = Slices(good_at, bad_at)
    try:
        with LoadClient(slices, rate=40, concurrency=2, sync_s=0.1) as load:
            time.sleep(0.6)
            cut = time.time()
            slices.endpoints = [(good_at,)]  # the failing one leaves the endpoints
            time.sleep(0.6)
    finally:
        good.shutdown()
        bad.shutdown()
    bad_ip = bad_at.rsplit(":", 1)[0]
    assert load.sent_to(bad_ip, 0) == load.result()["why"]["http_500"] > 0
    assert load.sent_to(bad_ip, cut + 0.3) == 0  # after one sync, none reach it
    assert load.failed_after(cut + 0.3) == 0
    first = load.first_answer_after(cut)
    assert first is not None and first >= cut
