"""Fixed HTTP servers for readers' tests and benchmarks: a constant /metrics page, and a server
that records who came (where a hostile pod's redirect points)."""

from __future__ import annotations

from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def page_server(body: bytes, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """A server on a free port answering every GET with `body` (a fixed /metrics page, for
    readers' tests and benchmarks); the caller runs serve_forever."""

    class Page(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    return ThreadingHTTPServer((host, 0), Page)


class RecordingServer(ThreadingHTTPServer):
    """A server on a free port of `host` that answers everything 200 and records each request
    ("METHOD path"): where a hostile pod's redirect points, to show nobody came. Call
    serve_forever (a thread); `url` is an address on it."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.requests: list[str] = []
        recorded = self.requests

        class Record(BaseHTTPRequestHandler):
            def _any(self):
                recorded.append(f"{self.command} {self.path}")
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _any

            def log_message(self, *args):
                pass

        super().__init__((host, 0), Record)
        self.daemon_threads = True
        self.url = f"http://{host}:{self.server_address[1]}/latest/meta-data/"
