"""What reading tenants' logs may cost the shared operator: a line rate and a CPU rate, shared
between namespaces and, within a namespace, between its pods, as the scrape pool shares its
workers (podreads/fairpool.shares).

A follower scans each line with the GIL held (about 20 µs for a plain line, far more with a
VLMDeployment's extra signatures), so one pod sending 50,000 lines/s would take all of it and
every other thread of the operator would wait. The whole budget is LINES_PER_S lines and
CPU_PER_S seconds of CPU per second. A namespace whose pods logged in the last RECENT_S gets an
even share of it (all of it when alone), and each of its pods that logged then an even share of
the namespace's. Each pod has two token buckets, lines and CPU seconds, refilled at its share
and holding BURST_S of it, but at least MIN_BURST_LINES lines and MIN_BURST_CPU_S (however many
pods share the budget, a traceback of a hundred lines still fits). A line is scanned only while
both of its pod's buckets hold tokens; the line then takes one line token, and the CPU its
handling took (time.thread_time: decoding, the signatures, the detections) is taken from the CPU
bucket afterwards. Lines over the budget are skipped before they are decoded: no regex runs on
them.

No bucket is shared between pods, so a pod within its own share never has a line skipped,
whatever other pods of its namespace or other namespaces send: every one of its lines, an
engine-death line and the traceback around it included, reaches the matcher in order. A
namespace is held to its share because its pods' shares add up to it, not by a bucket its
flooding pod could empty for the others. A pod over its share loses only its own lines.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from vlm_operator.podreads.fairpool import shares

LINES_PER_S = 10_000  # about a fifth of one core at 20 µs a line
CPU_PER_S = 0.25  # seconds of CPU per second, all followers together
BURST_S = 5.0  # a bucket holds this many seconds of its share, and at least:
MIN_BURST_LINES, MIN_BURST_CPU_S = 500, 0.02  # a crash's traceback after a quiet spell fits
RECENT_S = 10.0  # a pod (a namespace) that logged within this counts when shares are made
SWEEP_S = 1.0  # shares are counted again this often
_CPU_UNIT = 1e-6  # CPU shares are made in microseconds (fairpool.shares divides integers)


@dataclass(slots=True)
class _Bucket:
    lines: float
    cpu: float
    at: float  # last refilled
    seen: float  # last line offered


class LineBudget:
    """The buckets of every followed pod; thread-safe (every follower thread asks it)."""

    def __init__(self, lines_per_s: int = LINES_PER_S, cpu_per_s: float = CPU_PER_S,
                 burst_s: float = BURST_S, recent_s: float = RECENT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.lines_per_s, self.burst_s, self.recent_s, self.clock = (
            lines_per_s, burst_s, recent_s, clock)
        self.cpu_us_per_s = round(cpu_per_s / _CPU_UNIT)
        self._lock = threading.Lock()
        self._pods: dict[str, dict[str, _Bucket]] = {}  # namespace -> uid -> bucket
        self._active: dict[str, int] = {}  # namespace -> pods that logged within recent_s
        self._swept = clock()

    def share(self, namespace: str) -> tuple[float, float]:
        """(lines/s, CPU s/s) each pod of `namespace` that logs gets now."""
        with self._lock:
            return self._share(namespace)

    def _share(self, namespace: str) -> tuple[float, float]:
        tenants = len(self._active) + (namespace not in self._active)
        members = self._active.get(namespace, 0) or 1
        return (shares(self.lines_per_s, tenants, members)[1],
                shares(self.cpu_us_per_s, tenants, members)[1] * _CPU_UNIT)

    def admit(self, namespace: str, uid: str) -> bool:
        """Whether the pod's next line is scanned (it takes a line token) or skipped."""
        with self._lock:
            bucket = self._refilled(namespace, uid)
            if bucket.lines >= 1 and bucket.cpu > 0:
                bucket.lines -= 1
                return True
            return False

    def spent(self, namespace: str, uid: str) -> bool:
        """Whether the pod is over its budget now (no token is taken): a follower skips a
        whole chunk of its stream then, without splitting it into lines."""
        with self._lock:
            bucket = self._refilled(namespace, uid)
            return bucket.lines < 1 or bucket.cpu <= 0

    def _refilled(self, namespace: str, uid: str) -> _Bucket:
        """The pod's buckets, refilled at its share up to their size (under the lock)."""
        now = self.clock()
        if now - self._swept >= SWEEP_S:
            self._sweep(now)
        pods = self._pods.setdefault(namespace, {})
        bucket = pods.get(uid)
        if bucket is None or now - bucket.seen > self.recent_s:  # active from now
            self._active[namespace] = self._active.get(namespace, 0) + 1
        lines_rate, cpu_rate = self._share(namespace)
        most_lines = max(lines_rate * self.burst_s, MIN_BURST_LINES)
        most_cpu = max(cpu_rate * self.burst_s, MIN_BURST_CPU_S)
        if bucket is None:  # a new pod starts with full buckets
            bucket = pods[uid] = _Bucket(most_lines, most_cpu, now, now)
        else:
            elapsed = now - bucket.at
            bucket.lines = min(most_lines, bucket.lines + elapsed * lines_rate)
            bucket.cpu = min(most_cpu, bucket.cpu + elapsed * cpu_rate)
            bucket.at = now
        bucket.seen = now
        return bucket

    def spend(self, namespace: str, uid: str, cpu_s: float) -> None:
        """The CPU a scanned line took, from its pod's bucket (it may go below zero: the pod's
        next lines wait until it refilled)."""
        with self._lock:
            bucket = self._pods.get(namespace, {}).get(uid)
            if bucket is not None:
                bucket.cpu -= cpu_s

    def forget(self, namespace: str, uid: str) -> None:
        """The pod's follower ended."""
        with self._lock:
            pods = self._pods.get(namespace)
            if pods is not None and pods.pop(uid, None) is not None and not pods:
                del self._pods[namespace]

    def _sweep(self, now: float) -> None:
        self._swept = now
        active = {}
        for namespace, pods in self._pods.items():
            count = sum(1 for b in pods.values() if now - b.seen <= self.recent_s)
            if count:
                active[namespace] = count
        self._active = active
