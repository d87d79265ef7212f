"""Periodic work on every VLMDeployment: Builtin autoscaling rounds and a slow resync.

Our own threads rather than kopf timers and daemons, which put a finalizer on every
VLMDeployment: deleting one would then hang whenever the operator is not running. kopf's watch
events keep the set of objects here current (handlers.py); `may_act` keeps a replica that kopf's
peering paused from acting (its events stop too, so what it holds here goes stale).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from vlm_operator.autoscaler import is_builtin

AUTOSCALE_SECONDS = 1.0
RESYNC_SECONDS = 300.0  # a safety net: child and pod events drive the real work
TICK_WORKERS = 8
log = logging.getLogger(__name__)
Key = tuple[str, str]


class Periodic:
    def __init__(self, *, tick: Callable[[dict], object], resync: Callable[[str, str], None],
                 forget: Callable[[str, str], None],
                 may_act: Callable[[str], bool] | None = None,
                 autoscale_s: float = AUTOSCALE_SECONDS,
                 resync_s: float = RESYNC_SECONDS) -> None:
        """`tick(body)`: one autoscaling round; `resync(ns, name)`: one reconcile (logs its
        own errors); `forget(ns, name)`: drop autoscaling state; `may_act(ns)`: peering.py."""
        self._tick, self._resync, self._forget = tick, resync, forget
        self._may_act = may_act or (lambda namespace: True)
        self.autoscale_s, self.resync_s = autoscale_s, resync_s
        self._bodies: dict[Key, dict] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(TICK_WORKERS, thread_name_prefix="autoscale")
        self._threads = [
            threading.Thread(target=self._every, args=(autoscale_s, self._autoscale_round, 0.0),
                             daemon=True, name="autoscaler"),
            # the first resync waits a period: on.resume reconciled everything at start
            threading.Thread(target=self._every, args=(resync_s, self._resync_round, resync_s),
                             daemon=True, name="resync")]

    # -- from kopf's watch events
    def track(self, body: dict) -> None:
        meta = body["metadata"]
        with self._lock:
            self._bodies[(meta["namespace"], meta["name"])] = json.loads(json.dumps(body))

    def untrack(self, namespace: str, name: str) -> None:
        with self._lock:
            self._bodies.pop((namespace, name), None)
        self._forget(namespace, name)

    # -- the loops
    def start(self) -> Periodic:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _every(self, seconds: float, fn: Callable[[], None], first_wait: float) -> None:
        """fn every `seconds`, start to start; a slow round delays the next, never overlaps."""
        wait = first_wait
        while not self._stop.wait(wait):
            started = time.monotonic()
            try:
                fn()
            except Exception:  # a round must never end the loop
                if not self._stop.is_set():  # stopping cancels what a round still submits
                    log.exception("periodic %s failed", fn.__name__)
            wait = max(0.0, seconds - (time.monotonic() - started))

    def _mine(self) -> list[dict]:
        with self._lock:
            bodies = list(self._bodies.values())
        return [b for b in bodies if self._may_act(b["metadata"]["namespace"])]

    def _autoscale_round(self) -> None:
        builtin = [b for b in self._mine() if is_builtin(b.get("spec") or {})]
        list(self._pool.map(self._tick_logged, builtin))  # every tick of the round done

    def _tick_logged(self, body: dict) -> None:
        try:
            self._tick(body)
        except Exception:
            meta = body["metadata"]
            log.exception("autoscaling round of %s/%s failed", meta["namespace"], meta["name"])

    def _resync_round(self) -> None:
        for body in self._mine():
            self._resync(body["metadata"]["namespace"], body["metadata"]["name"])
