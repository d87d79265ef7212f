"""Child processes and local ports of the test bed: a log's tail, stopping a process group,
dying with the parent, a free port, waiting for an endpoint."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path


def tail(path: Path, lines: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            data = f.read().decode("utf-8", "replace")
    except OSError:
        return "(no log)"
    return "\n".join(data.splitlines()[-lines:])


def _kill_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Terminate then kill the process group we created for ``proc``."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _https_ok(url: str, ctx: ssl.SSLContext, timeout_s: float = 2.0) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                         urllib.request.HTTPSHandler(context=ctx))
    try:
        with opener.open(url, timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False


def _http_ok(url: str, timeout_s: float = 2.0) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _die_with_parent() -> None:
    """In the child: get SIGTERM when our process dies, so no control plane is orphaned."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
