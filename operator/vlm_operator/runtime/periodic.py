"""Periodic work on every VLMDeployment: a round every second (runtime/rounds.py: stall detection
and Builtin autoscaling) and a slow resync, watched by the watchdog (runtime/watchdog.py).

Our own threads rather than kopf timers and daemons, which put a finalizer on every
VLMDeployment: deleting one would then hang whenever the operator is not running. kopf's watch
events keep the set of objects here current (handlers.py); `may_act` keeps a replica that kopf's
peering paused from acting (its events stop too, so what it holds here goes stale). A round
never waits for one slow VLMDeployment: one whose last round has not finished is skipped
until it has. Rounds run on TICK_WORKERS workers shared fairly between namespaces
(podreads/fairpool.py), so one tenant's slow rounds take its share of them and no more; a
VLMDeployment whose round has nothing to do (`due`: no pods, runtime/rounds.py) takes none.

Each loop beats the watchdog when it completes a round: "rounds" and "resync" for the loops,
and every VLMDeployment's own round (watchdog.round_loop). A thread of its own checks them every
second; when one stalls or runs again, the VLMDeployments it serves are reconciled so their
OperatorStalled condition says so. A round that fails is logged once, then counted silently
until it works again (200 VLMDeployments failing every second during an apiserver outage would
otherwise bury the log). Every loop isolates each VLMDeployment: what one raises (a tenant's
resource no code can read) is logged and counted, and the others' rounds and resyncs go on.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

from kubernetes.client.exceptions import ApiException

from vlm_operator.k8s.informer import Stale
from vlm_operator.k8s.views import Body
from vlm_operator.metrics import RECONCILES, ROUNDS
from vlm_operator.podreads.fairpool import FairPool
from vlm_operator.runtime.watchdog import ROUND_PREFIX, Watchdog, round_loop

ROUND_SECONDS = 1.0
RESYNC_SECONDS = 300.0  # a safety net: child and pod events drive the real work
RESYNC_SPREAD = 0.8
CHECK_SECONDS = 1.0  # the watchdog's
TICK_WORKERS = 8
PUBLISH_WORKERS = 2
log = logging.getLogger(__name__)
Key = tuple[str, str]


class Periodic:
    def __init__(self, *, tick: Callable[[dict], object], resync: Callable[[str, str], None],
                 forget: Callable[[str, str], None],
                 due: Callable[[dict], bool] | None = None,
                 sweep: Callable[[set[Key]], None] = lambda tracked: None,
                 may_act: Callable[[str], bool] | None = None,
                 watchdog: Watchdog | None = None,
                 round_s: float = ROUND_SECONDS,
                 resync_s: float = RESYNC_SECONDS, check_s: float = CHECK_SECONDS) -> None:
        """`tick(body)`: one round of a VLMDeployment; `resync(ns, name)`: one reconcile (logs
        its own errors); `forget(ns, name)`: drop its round state; `sweep(tracked)`: once a
        resync, drop what is kept for VLMDeployments no longer tracked; `due(body)`: whether
        its round has anything to do (default: always); `may_act(ns)`: k8s/peering.py."""
        self._tick, self._resync, self._forget, self._sweep = tick, resync, forget, sweep
        self._due = due or (lambda body: True)
        self._may_act = may_act or (lambda namespace: True)
        self.watchdog = watchdog or Watchdog()
        self.round_s, self.resync_s = round_s, resync_s
        self._bodies: dict[Key, dict] = {}
        self._ticking: set[Key] = set()  # rounds still running
        self._failing: dict[Key, int] = {}  # rounds failed in a row, while > 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = FairPool(TICK_WORKERS, "round")
        self._publish = ThreadPoolExecutor(PUBLISH_WORKERS, thread_name_prefix="watchdog")
        self._threads = [
            threading.Thread(target=self._every, args=("rounds", round_s, self._round, 0.0),
                             daemon=True, name="rounds"),
            # the first resync waits a period: on.resume reconciled everything at start
            threading.Thread(target=self._every,
                             args=("resync", resync_s, self._resync_round, resync_s),
                             daemon=True, name="resync"),
            threading.Thread(target=self._watch, args=(check_s,), daemon=True,
                             name="watchdog")]

    # -- from kopf's watch events
    def track(self, body: dict) -> None:
        meta = Body(body)
        key = (meta.namespace, meta.name)
        with self._lock:
            new = key not in self._bodies
            self._bodies[key] = json.loads(json.dumps(body))
        if new:  # its round's clock starts now
            self.watchdog.beat(round_loop(*key), self.round_s)

    def untrack(self, namespace: str, name: str) -> None:
        with self._lock:
            self._bodies.pop((namespace, name), None)
            self._failing.pop((namespace, name), None)
        self.watchdog.forget(round_loop(namespace, name))
        self._forget(namespace, name)

    # -- the loops
    def start(self) -> Periodic:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._pool.shutdown()
        self._publish.shutdown(wait=False, cancel_futures=True)

    def _every(self, loop: str, seconds: float, fn: Callable[[], None],
               first_wait: float) -> None:
        """fn every `seconds`, start to start; a slow round delays the next, never overlaps."""
        self.watchdog.beat(loop, max(seconds, first_wait))
        wait = first_wait
        while not self._stop.wait(wait):
            started = time.monotonic()
            try:
                fn()
            except Exception:  # a round must never end the loop
                if not self._stop.is_set():  # stopping cancels what a round still submits
                    log.exception("periodic %s failed", loop)
            self.watchdog.beat(loop, seconds)
            wait = max(0.0, seconds - (time.monotonic() - started))

    def _mine(self) -> list[dict]:
        with self._lock:
            bodies = list(self._bodies.values())
        mine = []
        for body in bodies:
            meta = Body(body)
            if self._may_act(meta.namespace):
                mine.append(body)
            else:  # the active replica runs its rounds: nothing is owed here
                self.watchdog.beat(round_loop(meta.namespace, meta.name), self.round_s)
        return mine

    def _round(self) -> None:
        futures = []
        for body in self._mine():
            key = Body(body).key
            if not self._is_due(body):  # nothing to do: nothing is owed either
                self.watchdog.beat(round_loop(*key), self.round_s)
                continue
            with self._lock:
                if key in self._ticking:  # its last round is still running: skip it
                    continue
                self._ticking.add(key)
            futures.append(self._pool.submit(key, self._tick_logged, key, body))
        wait(futures, timeout=self.round_s)  # the slow ones finish on their own

    def _is_due(self, body: dict) -> bool:
        try:
            return self._due(body)
        except Exception:  # one VLMDeployment's trouble must not stop the others' rounds
            log.exception("deciding whether %s/%s has a round failed",
                          *Body(body).key)
            return True

    def _tick_logged(self, key: Key, body: dict) -> None:
        ROUNDS.inc()
        try:
            self._tick(body)
        except Exception as exc:
            self._failed(key, exc)
        else:
            with self._lock:
                failed = self._failing.pop(key, 0)
            if failed:
                log.info("round of %s/%s works again after %d failed rounds", *key, failed)
        finally:
            with self._lock:
                self._ticking.discard(key)
                tracked = key in self._bodies
            if tracked:
                self.watchdog.beat(round_loop(*key), self.round_s)
            else:  # it went while this round ran: drop what the round kept or wrote again
                self._forget(*key)

    def _failed(self, key: Key, exc: Exception) -> None:
        with self._lock:
            count = self._failing[key] = self._failing.get(key, 0) + 1
        if count > 1:
            return
        if isinstance(exc, (ApiException, Stale)):  # expected trouble: one line says it
            log.warning("round of %s/%s failed: %s (logged again when it works)", *key,
                        str(exc).strip().replace("\n", " "))
        else:
            log.exception("round of %s/%s failed (logged again when it works)", *key)

    def _resync_round(self) -> None:
        """Every VLMDeployment once, spread over RESYNC_SPREAD of the period: 200 reconciles
        at once would be a burst of some 2,000 requests to the apiserver every 5 minutes."""
        with self._lock:
            tracked = set(self._bodies)
        try:
            self._sweep(tracked)
        except Exception:  # what is kept for gone ones stays a round longer; the resync goes on
            log.exception("sweeping what is kept for VLMDeployments no longer tracked failed")
        bodies = self._mine()
        gap = self.resync_s * RESYNC_SPREAD / max(1, len(bodies))
        for i, body in enumerate(bodies):
            if i and self._stop.wait(gap):
                return
            self._resync_one(*Body(body).key)

    def _resync_one(self, namespace: str, name: str) -> None:
        """One VLMDeployment's resync, isolated: whatever it raises (a resource no reconcile
        can read) is logged and counted, and the round goes on with the others."""
        try:
            self._resync(namespace, name)
        except Exception:
            RECONCILES.labels(result="error").inc()
            log.exception("resync of %s/%s failed; the others go on", namespace, name)

    # -- the watchdog
    def _watch(self, check_s: float) -> None:
        while not self._stop.wait(check_s):
            try:
                changed = self.watchdog.check()
            except Exception:  # the watchdog must outlive what it reports
                log.exception("watchdog check failed")
                continue
            if changed:
                self._publish_conditions(changed)

    def _publish_conditions(self, loops: list[str]) -> None:
        """Reconcile the VLMDeployments whose OperatorStalled changed (in threads of their own:
        the reconcile may be what is stuck)."""
        with self._lock:
            tracked = set(self._bodies)
        if any(not loop.startswith(ROUND_PREFIX) for loop in loops):
            keys = tracked
        else:
            keys = {tuple(loop[len(ROUND_PREFIX):].split("/", 1)) for loop in loops} & tracked
        for namespace, name in sorted(keys):
            self._publish.submit(self._resync_one, namespace, name)
