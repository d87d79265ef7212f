"""The stand-in's HTTP surface (vLLM's paths, the hostile modes, POST /sim/fault and /sim/log)."""

from __future__ import annotations

import json
import sys
import time
import uuid
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING

from .args import authorized
from .engine import count_images, prompt_text
from .loglines import DEAD_MESSAGE, access_line

if TYPE_CHECKING:
    from .engine import Simulator


class Handler(BaseHTTPRequestHandler):
    sim: Simulator
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        """Silence http.server's own log: access lines are written in uvicorn's shape."""

    _headers_begun = False  # a drip-fed answer's status line went out already

    def _send(self, status: int, body, content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else (
            body.encode() if isinstance(body, str) else json.dumps(body).encode())
        if self._headers_begun:
            self._headers_begun = False
        else:
            self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        path = self.path.split("?")[0]
        if not path.startswith("/sim/"):
            self.sim.emit(access_line(self.sim.version, self.sim.pid,
                                      f"{self.client_address[0]}:{self.client_address[1]}",
                                      self.command, path, status))

    def _body(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b"{}"
        return json.loads(raw or b"{}")

    def _hang_if_asked(self) -> None:
        while self.sim.hung.is_set():
            time.sleep(0.2)

    def _refused(self, path: str) -> bool:
        """Answer 401 as vLLM does when an API key guards the path and the request lacks it."""
        if authorized(path, self.headers.get("Authorization"), self.sim.keys):
            return False
        self._send(401, {"error": "Unauthorized"})
        return True

    def _hostile(self, path: str) -> bool:
        """Answer as a hostile mode says, if one covers this path; True when it answered."""
        modes = self.sim.hostile
        if "redirect" in modes and path in modes["redirect"]["paths"]:
            self._redirect(modes["redirect"])
            return True
        if "huge_metrics" in modes and path == "/metrics":
            self._huge(modes["huge_metrics"])
            return True
        if "drip_headers" in modes and path in modes["drip_headers"]["paths"]:
            return not self._drip(modes["drip_headers"])
        return False

    def _redirect(self, spec: dict) -> None:
        self.send_response(int(spec.get("status", 302)))
        self.send_header("Location", str(spec.get("to", "http://169.254.169.254/latest/")))
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _huge(self, spec: dict) -> None:
        """`bytes` of `line` repeated (default: a real sample line); a `line` of about `bytes`
        makes a page of one line, e.g. a sample whose label value never closes."""
        total = int(spec.get("bytes", 100_000_000))
        line = str(spec.get("line", 'vllm:num_requests_running{engine="0",model_name="m"} '
                                    '0.0\n')).encode()
        block = line * max(1, 65536 // len(line))
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        if spec.get("length"):
            self.send_header("Content-Length", str(total))
        else:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        sent = 0
        try:
            while sent < total:
                chunk = block[:total - sent]
                self.wfile.write(chunk)
                sent += len(chunk)
        except OSError:  # the reader hung up: the point
            self.close_connection = True

    def _drip(self, spec: dict) -> bool:
        """The status line, then a header line every interval; False if the reader left."""
        try:
            self.wfile.write(b"HTTP/1.1 200 OK\r\n")
            self.wfile.flush()
            for i in range(int(spec.get("lines", 8))):
                time.sleep(float(spec.get("interval", 0.5)))
                self.wfile.write(f"X-Drip-{i}: {i}\r\n".encode())
                self.wfile.flush()
        except OSError:
            self.close_connection = True
            return False
        self._headers_begun = True
        return True

    def do_GET(self):
        path = self.path.split("?")[0]
        if not path.startswith("/sim/"):
            self._hang_if_asked()
            if self._hostile(path):
                return
        sim = self.sim
        if self._refused(path):
            return
        if path in ("/health", "/ping"):
            self._send(503 if sim.dead else 200, b"", "text/plain")
        elif path == "/version":
            self._send(200, {"version": sim.version})
        elif path == "/v1/models":
            self._send(200, {"object": "list", "data": [
                {"id": sim.args.model_name, "object": "model", "created": int(time.time()),
                 "owned_by": "vllm", "root": sim.args.model,
                 "max_model_len": sim.args.max_model_len or 4096}]})
        elif path == "/metrics":
            time.sleep(sim.metrics_delay)  # an overloaded API server answers late
            self._send(200, sim.metrics_text(), "text/plain; version=0.0.4; charset=utf-8")
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self):
        path = self.path.split("?")[0]
        sim = self.sim
        try:
            body = self._body()
        except (ValueError, json.JSONDecodeError) as exc:
            self._send(400, {"error": {"message": f"invalid JSON: {exc}", "code": 400}})
            return
        if path == "/sim/fault":
            specs = body if isinstance(body, list) else [body]
            try:
                result = [sim.apply_fault(s) for s in specs]
            except (ValueError, TypeError) as exc:
                self._send(400, {"error": str(exc)})
                return
            self._send(200, result)
            return
        if path == "/sim/log":
            stream = sys.stderr if body.get("stream") == "stderr" else sys.stdout
            for line in body.get("lines", []):
                sim.emit(str(line), stream)
            self._send(200, {"written": len(body.get("lines", []))})
            return
        self._hang_if_asked()
        if self._hostile(path):
            return
        if self._refused(path):
            return
        if path not in ("/v1/chat/completions", "/v1/completions"):
            self._send(404, {"detail": "Not Found"})
            return
        if sim.dead:
            self._send(500, {"error": {"message": DEAD_MESSAGE, "type": "EngineDeadError",
                                       "code": 500}})
            return
        chat = path == "/v1/chat/completions"
        messages = body.get("messages") if chat else None
        if chat and not isinstance(messages, list):
            self._send(400, {"error": {"message": "'messages' must be a list", "code": 400}})
            return
        images = count_images(messages) if chat else 0
        text = prompt_text(messages) if chat else str(body.get("prompt", ""))
        prompt_tokens = max(1, len(text) // 4) + 64 * images
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        sim.serve_request(prompt_tokens, images, max_tokens)
        content = "simulated " * max_tokens
        choice = ({"index": 0, "message": {"role": "assistant", "content": content.strip()},
                   "finish_reason": "length"} if chat else
                  {"index": 0, "text": content.strip(), "finish_reason": "length"})
        self._send(200, {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": sim.args.model_name, "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                      "total_tokens": prompt_tokens + max_tokens}})
