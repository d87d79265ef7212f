"""Container logs as the kubelet keeps and serves them: RFC3339Nano-stamped lines, and the
kubelet's HTTPS /containerLogs endpoint behind `kubectl logs [-f] [--previous]`."""

from __future__ import annotations

import contextlib
import http.server
import ssl
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from .state import log, parse_rfc3339_ns, rfc3339nano

if TYPE_CHECKING:
    from .simulator import NodeSimulator
    from .state import Instance


def format_log_line(ns: int, stream: str, text: str) -> str:
    """The CRI log file format the kubelet reads: `<RFC3339Nano> <stream> F <text>`."""
    return f"{rfc3339nano(ns)} {stream} F {text}\n"


def parse_log_line(line: str) -> tuple[int, str, str] | None:
    parts = line.rstrip("\n").split(" ", 3)
    if len(parts) < 4:
        return None
    return parse_rfc3339_ns(parts[0]), parts[0], parts[3]


def render_log_lines(lines: list[str], since_ns: int | None, tail: int | None,
                     timestamps: bool) -> list[str]:
    """Filter stored lines as the kubelet does for sinceTime/sinceSeconds, tailLines and
    timestamps=true."""
    parsed = [p for p in (parse_log_line(x) for x in lines) if p]
    if since_ns is not None:
        parsed = [p for p in parsed if p[0] >= since_ns]
    if tail is not None and tail >= 0:
        parsed = parsed[len(parsed) - tail:] if tail else []
    return [f"{stamp} {text}\n" if timestamps else f"{text}\n" for _, stamp, text in parsed]


class LogServer(http.server.ThreadingHTTPServer):
    """The kubelet's HTTPS port, serving only GET /containerLogs/{ns}/{pod}/{container}."""

    daemon_threads = True

    def __init__(self, sim: NodeSimulator, cert: Path, key: Path) -> None:
        self.sim = sim
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(str(cert), str(key))
        super().__init__(("127.0.0.1", 0), LogHandler)

    def handle_error(self, request, client_address) -> None:
        log.debug("kubelet log endpoint: error from %s", client_address, exc_info=True)

    def get_request(self):
        sock, addr = self.socket.accept()
        return self.ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr


class LogHandler(http.server.BaseHTTPRequestHandler):
    server: LogServer

    def setup(self) -> None:
        self.request.settimeout(30)
        self.request.do_handshake()
        self.request.settimeout(None)
        super().setup()

    def log_message(self, *args) -> None:
        """Quiet: the apiserver polls and streams a lot."""

    def _text(self, code: int, text: str) -> None:
        data = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        parts = [urllib.parse.unquote(p) for p in url.path.split("/") if p]
        if len(parts) != 4 or parts[0] != "containerLogs":
            self._text(404, "not found")
            return
        q = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query).items()}
        runner = self.server.sim.runner_by_name(parts[1], parts[2])
        container = runner.container(parts[3]) if runner else None
        if not container:
            self._text(404, f'container "{parts[3]}" in pod "{parts[2]}" not found')
            return
        previous = q.get("previous") == "true"
        index = len(container.instances) - (2 if previous else 1)
        if index < 0 or container.instances[index].lost:  # the kubelet: no containerID to read
            what = "previous terminated container" if previous else "container"
            self._text(400, f'{what} "{parts[3]}" in pod "{parts[2]}" '
                       + ("not found" if previous else "is waiting to start: ContainerCreating"))
            return
        inst = container.instances[index]
        since = None
        if "sinceTime" in q:
            since = parse_rfc3339_ns(q["sinceTime"])
        elif "sinceSeconds" in q:
            since = time.time_ns() - int(q["sinceSeconds"]) * 1_000_000_000
        tail = int(q["tailLines"]) if "tailLines" in q else None
        limit = int(q["limitBytes"]) if "limitBytes" in q else None
        follow = q.get("follow") == "true" and not previous
        stamps = q.get("timestamps") == "true"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Connection", "close")
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, ssl.SSLError, OSError):
            self._stream(inst, since, tail, limit, follow, stamps)

    def _stream(self, inst: Instance, since, tail, limit, follow: bool, stamps: bool) -> None:
        """Write the stored lines (filtered), then, with follow, new complete lines until the
        container instance has exited and its log is drained."""
        sent = 0

        def write(lines: list[str]) -> bool:
            nonlocal sent
            for line in lines:
                data = line.encode()
                if limit is not None and sent + len(data) >= limit:
                    self.wfile.write(data[:limit - sent])
                    return False
                self.wfile.write(data)
                sent += len(data)
            self.wfile.flush()
            return True

        with open(inst.log_path, "rb") as f:
            content = f.read()
            cut = content.rfind(b"\n") + 1
            f.seek(cut)
            lines = content[:cut].decode("utf-8", "replace").splitlines()
            if not write(render_log_lines(lines, since, tail, stamps)) or not follow:
                return
            while True:
                pos, seen = f.tell(), inst.lines
                line = f.readline()
                if line.endswith(b"\n"):
                    text = line.decode("utf-8", "replace")
                    if not write(render_log_lines([text], since, None, stamps)):
                        return
                    continue
                f.seek(pos)
                if inst.done.is_set():
                    if not line:
                        return
                    write(render_log_lines([line.decode("utf-8", "replace")], since, None,
                                           stamps))
                    return
                if inst.appended is None:
                    time.sleep(0.1)
                else:  # woken by the next write, not by polling
                    with inst.appended:
                        inst.appended.wait_for(lambda seen=seen: inst.lines != seen, 5.0)


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "kubelet.crt", directory / "kubelet.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "365",
                    "-subj", "/CN=vlm-testbed-kubelet", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key
