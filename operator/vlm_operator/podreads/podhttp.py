"""The operator's only HTTP client for tenants' pods: every request it sends to a vLLM pod
(/metrics, /health, /v1/models, the canary's completion, a drain's in-flight read) is one
`exchange`.

What a pod answers is hostile input: its image and model code are its tenant's. So an exchange
follows nothing and is bounded in bytes and time:
- No redirect is ever followed. A 3xx answer is an error for that pod (REDIRECT): a pod cannot
  make the operator send a request, from the operator's own network position, to an address it
  names (cloud metadata endpoints, cluster-internal services).
- A byte cap per answer, status line, headers and body together (the caller's, e.g. 2 MiB for
  /metrics: podreads/reader.py says why). Reading stops at the cap and the answer is refused without
  being parsed (TOO_LARGE); a Content-Length above the cap is refused before its body is read.
  At most MAX_CHUNKS chunks of a chunked body (each costs a step of Python: a body of 1-byte
  chunks would otherwise cost seconds of CPU per read).
- One deadline for the whole exchange: connect, request, status line, headers and body. Each
  recv waits only for what is left of it, so a server that drip-feeds its answer (a header
  line every half second) is cut off at the deadline; a timeout per recv, as urllib's, would
  let it hold the read for as long as it keeps sending.
- No decompression (`Accept-Encoding: identity`; an encoded body is not decoded) and no DNS:
  the host is an IP address (a pod's status.podIP), anything else is refused.

What went wrong is kept apart, because the evidence differs:
- UNREACHABLE: no connection could be made (connect timed out, refused, reset or no route).
  The pod may be perfectly healthy behind a NetworkPolicy that drops or rejects the operator's
  traffic while the kubelet's probes, which come from the node, still reach it. Never acted on.
- TIMEOUT: the pod accepted the connection and did not answer in full by the deadline: a
  server that is there and does not answer (stalls/watch.py decides what that is worth).
- TOO_LARGE, REDIRECT, BAD_ANSWER (not HTTP, broken framing, a reset after connecting):
  answers no vLLM server sends; reported, never acted on.
An answer with any other status is returned as it is: callers decide what a 503 means.
"""

from __future__ import annotations

import email.message
import http.client
import io
import ipaddress
import re
import socket
import time
from dataclasses import dataclass

UNREACHABLE, TIMEOUT = "unreachable", "timeout"
TOO_LARGE, REDIRECT, BAD_ANSWER = "too_large", "redirect", "bad_answer"
HEAD_CAP = 64 * 1024  # status line and headers; the answer's cap counts them too
MAX_CHUNKS = 1024
RECV_BYTES = 64 * 1024
_STATUS = re.compile(rb"HTTP/1\.[01] ([0-9]{3})(?: [^\r\n]*)?")
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,8})(?:;[^\r\n]*)?")


class PodHTTPError(Exception):
    """An exchange with a pod that brought no usable answer: `kind` is one of the kinds above
    (UNREACHABLE, TIMEOUT, TOO_LARGE, REDIRECT, BAD_ANSWER), `detail` says what happened."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    headers: email.message.Message
    body: bytes


def exchange(ip: str, port: int, method: str, path: str, *, timeout_s: float, cap: int,
             body: bytes | None = None, headers: dict[str, str] | None = None) -> Answer:
    """One request to ip:port and its answer, within timeout_s in all and cap bytes; raises
    PodHTTPError."""
    deadline = time.monotonic() + timeout_s
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        raise PodHTTPError(BAD_ANSWER, f"{ip!r} is not an IP address") from None
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        _connect(sock, ip, port, deadline, timeout_s)
        try:
            sock.settimeout(_left(deadline))
            sock.sendall(_request(address, port, method, path, body, headers))
            return _receive(sock, deadline, cap)
        except TimeoutError:
            raise PodHTTPError(TIMEOUT, f"connected, but no full answer within {timeout_s:g} s"
                               ) from None
        except OSError as exc:
            raise PodHTTPError(BAD_ANSWER, f"connection broken after connecting: "
                               f"{exc.strerror or exc}") from None


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def _connect(sock: socket.socket, ip: str, port: int, deadline: float,
             timeout_s: float) -> None:
    try:
        sock.settimeout(_left(deadline))
        sock.connect((ip, port))
    except TimeoutError:
        raise PodHTTPError(UNREACHABLE, f"connect timed out after {timeout_s:g} s") from None
    except ConnectionRefusedError:
        raise PodHTTPError(UNREACHABLE, "connection refused") from None
    except OSError as exc:
        raise PodHTTPError(UNREACHABLE, f"cannot connect: {exc.strerror or exc}") from None


def _request(address, port: int, method: str, path: str, body: bytes | None,
             headers: dict[str, str] | None) -> bytes:
    host = f"[{address}]" if address.version == 6 else str(address)
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "User-Agent: vlm-operator",
             "Accept-Encoding: identity", "Connection: close",
             *(f"{k}: {v}" for k, v in (headers or {}).items())]
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


def _receive(sock: socket.socket, deadline: float, cap: int) -> Answer:
    """Read until the answer is complete (its Content-Length, the end of its chunks, or the
    end of the stream), the cap, or the deadline."""
    buf = bytearray()
    head: tuple[int, email.message.Message, int] | None = None  # status, headers, body start
    framing: _Framing | None = None
    eof = False
    while True:
        if head is None:
            end = buf.find(b"\r\n\r\n", max(0, len(buf) - RECV_BYTES - 3))
            if (end < 0 and len(buf) > HEAD_CAP) or end > HEAD_CAP:
                raise PodHTTPError(TOO_LARGE, f"status line and headers over {HEAD_CAP} bytes")
            if end >= 0:
                head = (*_parse_head(bytes(buf[:end])), end + 4)
                framing = _Framing(head[0], head[1], cap - head[2])
        if head is not None:
            with memoryview(buf) as view:  # released before buf grows
                done = framing.body(view[head[2]:], eof)
            if done is not None:
                return Answer(head[0], head[1], done)
        if eof:
            raise PodHTTPError(BAD_ANSWER, "the connection closed before a full answer"
                               if buf else "the connection closed without an answer")
        sock.settimeout(_left(deadline))
        chunk = sock.recv(min(RECV_BYTES, cap + 1 - len(buf)))
        eof = not chunk
        buf += chunk
        if len(buf) > cap:
            raise PodHTTPError(TOO_LARGE, f"the answer is over {cap} bytes")


def _parse_head(raw: bytes) -> tuple[int, email.message.Message]:
    line, _, rest = raw.partition(b"\r\n")
    match = _STATUS.fullmatch(line)
    if match is None:
        raise PodHTTPError(BAD_ANSWER, f"not an HTTP status line: {line[:80]!r}")
    status = int(match.group(1))
    try:
        headers = http.client.parse_headers(io.BytesIO(rest + b"\r\n\r\n"))
    except http.client.HTTPException as exc:
        raise PodHTTPError(BAD_ANSWER, f"bad headers: {exc}") from None
    if 300 <= status < 400:
        location = (headers.get("Location") or "")[:200]
        raise PodHTTPError(REDIRECT, f"answered {status} redirecting to {location!r}; "
                           "redirects are never followed")
    if status < 200:
        raise PodHTTPError(BAD_ANSWER, f"answered {status}, an interim status no request of "
                           "the operator's asks for")
    return status, headers


class _Framing:
    """Where the body ends: no body, Content-Length, chunked, or the end of the stream."""

    def __init__(self, status: int, headers: email.message.Message, room: int) -> None:
        self.length: int | None = None
        self.chunked = "chunked" in (headers.get("Transfer-Encoding") or "").lower()
        self._chunks = _Chunks()
        if status in (204, 304):
            self.length = 0
        elif not self.chunked and headers.get("Content-Length") is not None:
            try:
                self.length = int(headers["Content-Length"])
            except ValueError:
                raise PodHTTPError(BAD_ANSWER, "a Content-Length that is not a number"
                                   ) from None
            if self.length < 0:
                raise PodHTTPError(BAD_ANSWER, "a negative Content-Length")
            if self.length > room:
                raise PodHTTPError(TOO_LARGE, f"Content-Length {self.length} is over the "
                                   f"{room} bytes left under the cap")

    def body(self, data: memoryview, eof: bool) -> bytes | None:
        """The whole body once `data` holds it, else None."""
        if self.chunked:
            return self._chunks.feed(data)
        if self.length is not None:
            return bytes(data[:self.length]) if len(data) >= self.length else None
        return bytes(data) if eof else None


class _Chunks:
    """An incremental reader of a chunked body: each call goes on from where the last one
    stopped, so a body is walked once however many reads it comes in."""

    def __init__(self) -> None:
        self.pos = 0
        self.parts: list[bytes] = []

    def feed(self, data: memoryview) -> bytes | None:
        while True:
            line_end = bytes(data[self.pos:self.pos + 80]).find(b"\r\n")
            if line_end < 0:
                if len(data) - self.pos >= 80:
                    raise PodHTTPError(BAD_ANSWER, "a chunk size line over 80 bytes")
                return None
            match = _CHUNK_SIZE.fullmatch(bytes(data[self.pos:self.pos + line_end]))
            if match is None:
                raise PodHTTPError(BAD_ANSWER, "a bad chunk size line")
            size = int(match.group(1), 16)
            start = self.pos + line_end + 2
            if size == 0:  # then trailer lines, if any, and an empty line
                rest = bytes(data[start:])
                if rest.startswith(b"\r\n") or b"\r\n\r\n" in rest:
                    return b"".join(self.parts)
                return None
            if len(data) < start + size + 2:
                return None
            if bytes(data[start + size:start + size + 2]) != b"\r\n":
                raise PodHTTPError(BAD_ANSWER, "a chunk longer than its size")
            if len(self.parts) >= MAX_CHUNKS:
                raise PodHTTPError(BAD_ANSWER, f"more than {MAX_CHUNKS} chunks")
            self.parts.append(bytes(data[start:start + size]))
            self.pos = start + size + 2
