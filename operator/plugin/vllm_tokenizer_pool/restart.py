"""An in-place restart on the operator's request, without exec and without an endpoint.

The operator asks a pod whose engine hung (or died while the process is kept alive) to restart
by writing the pod's `serving.vlm-operator.dev/restart-request` annotation; the kubelet
projects it into the container through a downwardAPI volume (on its sync of the updated pod:
about a second), at the path in VLM_RESTART_REQUEST_FILE. In the process vLLM started first
(the API server: no multiprocessing parent), a daemon thread reads that file every second; when
it holds a value other than the one it held when this process started, it logs

    vlm-restart-request <value>: exiting for an in-place container restart

through logger `vllm.vlm_restart_request` and exits the process at once (status 0), so the
kubelet restarts the container in place: same node, image, and emptyDir caches (weights in
HF_HOME, the compile cache under HOME). The container's other processes (the engine core,
its workers) go with its PID namespace. The value seen at start is never acted on, so a
restarted container does not exit again for the request that restarted it. Only the
operator (and whoever may patch the pod anyway) can write the annotation; the file is read
bounded (REQUEST_MAX_BYTES) and nothing in it is interpreted beyond comparing it.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable

from vllm_tokenizer_pool.plugin import emit

logger = logging.getLogger("vllm.vlm_restart_request")

ENV = "VLM_RESTART_REQUEST_FILE"
POLL_S = 1.0
REQUEST_MAX_BYTES = 256


def read_request(path: str) -> str:
    """The request in the file, stripped; "" when there is none or it cannot be read."""
    try:
        with open(path, "rb") as f:
            raw = f.read(REQUEST_MAX_BYTES)
    except OSError:
        return ""
    return raw.decode("utf-8", "replace").strip()


class Watch:
    """Compares the request file against the value seen at start; `check()` says the new
    request, once (None otherwise)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.initial = read_request(path)
        self.acted = False

    def check(self) -> str | None:
        if self.acted:
            return None
        value = read_request(self.path)
        if value and value != self.initial:
            self.acted = True
            return value
        return None


def start(exit_process: Callable[[int], None] = os._exit) -> threading.Thread | None:
    """Start watching where VLM_RESTART_REQUEST_FILE is set, in the process vLLM started first
    only; the thread, or None."""
    path = os.environ.get(ENV, "").strip()
    if not path or multiprocessing.parent_process() is not None:
        return None
    watch = Watch(path)

    def run() -> None:
        while True:
            time.sleep(POLL_S)
            try:
                value = watch.check()
            except Exception:  # never take vLLM down from here
                continue
            if value is not None:
                emit(logging.WARNING, f"vlm-restart-request {value[:REQUEST_MAX_BYTES]}: "
                     "exiting for an in-place container restart", logger, stacklevel=2)
                for handler in logging.getLogger("vllm").handlers + logger.handlers:
                    handler.flush()
                exit_process(0)
                return

    thread = threading.Thread(target=run, daemon=True, name="vlm-restart-request")
    thread.start()
    return thread
