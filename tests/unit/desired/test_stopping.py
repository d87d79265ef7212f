"""The preStop hook: a pod that serves nothing stops at once; one with requests in flight, or
whose load cannot be read, waits for them."""

import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from vlm_operator.api.names import PORT
from vlm_operator.desired import stopping


class FakeEngine:
    """vLLM's /health and /metrics on a loopback address of its own, as the preStop sees them."""

    def __init__(self, running=0.0, metrics_status=200):
        self.running, self.metrics_status = running, metrics_status
        self.ip = f"127.66.{uuid.uuid4().int % 200 + 1}.{uuid.uuid4().int % 200 + 2}"
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                """quiet"""

            def do_GET(self):
                status, body = 200, b""
                if self.path == "/metrics":
                    status = engine.metrics_status
                    body = ('vllm:num_requests_running{engine="0",model_name="m x"} '
                            f'{engine.running}\nvllm:num_requests_waiting{{engine="0"}} 0.0\n'
                            ).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer((self.ip, PORT), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def pre_stop(ip):
    """The pod's preStop hook (children.py runs it as `python3 -c PRESTOP_SCRIPT`)."""
    return subprocess.Popen([sys.executable, "-c", stopping.PRESTOP_SCRIPT],
                            env={stopping.POD_IP_ENV: ip})


def test_pre_stop_returns_at_once_for_a_pod_that_serves_nothing():
    started = time.monotonic()
    assert pre_stop("127.66.250.250").wait(10) == 0  # nothing listens: /health fails
    assert time.monotonic() - started < stopping.ENDPOINTS_LAG_S


def test_pre_stop_waits_for_the_requests_in_flight():
    engine = FakeEngine(running=2)
    try:
        started = time.monotonic()
        proc = pre_stop(engine.ip)
        time.sleep(stopping.ENDPOINTS_LAG_S + 2)
        assert proc.poll() is None, "returned with requests in flight"
        engine.running = 0
        assert proc.wait(10) == 0
        assert time.monotonic() - started >= stopping.ENDPOINTS_LAG_S + 2
    finally:
        engine.stop()


def test_pre_stop_takes_an_unreadable_load_as_busy_not_idle():
    engine = FakeEngine(metrics_status=500)
    try:
        proc = pre_stop(engine.ip)
        time.sleep(stopping.ENDPOINTS_LAG_S + 2)
        assert proc.poll() is None
        engine.metrics_status = 200
        assert proc.wait(10) == 0
    finally:
        engine.stop()
