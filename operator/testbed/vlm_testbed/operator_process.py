"""The operator as a separate process, as in its Pod: for e2e tests, the demo and benchmarks."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from vlm_testbed.controlplane import free_port


class OperatorProcess:
    """`vlm-operator run` against a kubeconfig, with its log in a file and ports of its own.
    `gid`: run it in that group (setpriv; root keeps its user id), so a firewall.Firewall can
    tell its traffic apart."""

    def __init__(self, kubeconfig: str | os.PathLike, *extra_args: str,
                 log_path: str | os.PathLike | None = None, env: dict | None = None,
                 gid: int | None = None):
        self.kubeconfig = str(kubeconfig)
        self.extra_args = list(extra_args)
        self.liveness_port = free_port()
        self.metrics_port = free_port()
        self.log_path = Path(log_path or tempfile.mkstemp(prefix="vlm-operator-",
                                                          suffix=".log")[1])
        self.env = env
        self.gid = gid
        self.proc: subprocess.Popen | None = None

    def start(self, wait: bool = True, timeout: float = 60) -> OperatorProcess:
        args = [sys.executable, "-m", "vlm_operator.cli", "run", "--kubeconfig", self.kubeconfig,
                "--liveness-port", str(self.liveness_port),
                "--metrics-port", str(self.metrics_port), *self.extra_args]
        if self.gid is not None:  # setpriv execs the operator: the pid stays the operator's
            args = ["setpriv", f"--regid={self.gid}", "--keep-groups", *args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "KUBECONFIG": self.kubeconfig,
                                              **(self.env or {})})  # kopf's login reads it
        if wait:
            self.wait_live(timeout)
        return self

    def wait_live(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc and self.proc.poll() is not None:
                raise RuntimeError(f"operator exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(
                        f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=2) as rsp:
                    if rsp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"operator not live after {timeout} s:\n{self.log()[-4000:]}")

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                    timeout=5) as rsp:
            return rsp.read().decode()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 20) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> OperatorProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
