"""A thread pool whose workers are shared fairly between tenants: the scrape workers
(podreads/reader.py) and the round workers (runtime/periodic.py).

A job is filed under a key (namespace, VLMDeployment name). The tenant is the namespace: it is
the unit a cluster admin grants, quotas and isolates (RBAC, ResourceQuota, NetworkPolicy), and a
tenant can create as many VLMDeployments in it as it likes, so a share per VLMDeployment would
let it multiply its share by creating more of them. Within a namespace, its share is divided
the same way between its VLMDeployments.

- Shares: a namespace may have at most ceil(workers / N) jobs running, N being the namespaces
  that filed a job in the last RECENT_S (so a namespace alone gets every worker); within it, a
  VLMDeployment at most ceil(that share / its VLMDeployments filed in the last RECENT_S).
  Jobs over their share wait in their queue while the workers serve others.
- Order: a free worker takes the next job round-robin over namespaces, then round-robin over
  that namespace's VLMDeployments, FIFO within one.
- A job may carry `start_by` (monotonic time): one still queued then is dropped (its future
  cancelled) rather than started late: a read that starts after its round stopped waiting
  helps nobody.

So a tenant whose pods hold every read to its deadline takes its share of the workers and no
more: other tenants' jobs find free workers and start at once.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

RECENT_S = 10.0
Key = tuple[str, str]


@dataclass
class _Job:
    future: Future
    fn: Callable[..., Any]
    args: tuple
    start_by: float | None


@dataclass
class _Tenant:
    queues: dict[str, deque[_Job]] = field(default_factory=dict)  # by VLMDeployment
    order: deque[str] = field(default_factory=deque)  # VLMDeployments with queued jobs
    running: dict[str, int] = field(default_factory=dict)
    seen: dict[str, float] = field(default_factory=dict)  # VLMDeployment -> last filed
    total: int = 0  # running, all VLMDeployments


def shares(workers: int, tenants: int, members: int) -> tuple[int, int]:
    """(a namespace's share, a VLMDeployment's share within it) of `workers`, with `tenants`
    namespaces and `members` VLMDeployments of that namespace active."""
    tenant = math.ceil(workers / max(1, tenants))
    return tenant, math.ceil(tenant / max(1, members))


class FairPool:
    def __init__(self, workers: int, name: str, recent_s: float = RECENT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.workers, self.recent_s, self.clock = workers, recent_s, clock
        self._cond = threading.Condition()
        self._tenants: dict[str, _Tenant] = {}
        self._order: deque[str] = deque()  # namespaces with queued jobs
        self._seen: dict[str, float] = {}  # namespace -> last filed
        self._stopped = False
        self._swept = clock()
        self._threads = [threading.Thread(target=self._work, daemon=True, name=f"{name}-{i}")
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, key: Key, fn: Callable[..., Any], *args: Any,
               start_by: float | None = None) -> Future:
        namespace, member = key
        future: Future = Future()
        with self._cond:
            if self._stopped:
                future.cancel()
                return future
            now = self.clock()
            tenant = self._tenants.setdefault(namespace, _Tenant())
            self._seen[namespace] = tenant.seen[member] = now
            tenant.queues.setdefault(member, deque()).append(_Job(future, fn, args, start_by))
            if member not in tenant.order:
                tenant.order.append(member)
            if namespace not in self._order:
                self._order.append(namespace)
            self._cond.notify()
        return future

    def shutdown(self) -> None:
        """Stop the workers after their running jobs; queued jobs are cancelled."""
        with self._cond:
            self._stopped = True
            for tenant in self._tenants.values():
                for queue in tenant.queues.values():
                    for job in queue:
                        job.future.cancel()
                    queue.clear()
            self._cond.notify_all()

    # -- the workers
    def _work(self) -> None:
        while True:
            expired: list[_Job] = []
            with self._cond:
                while True:
                    if self._stopped:
                        return
                    taken = self._take(expired)
                    if taken is not None or expired:
                        break
                    self._cond.wait(1.0)  # shares change as tenants go quiet
            for job in expired:  # outside the lock: cancelling runs the futures' callbacks
                job.future.cancel()
            if taken is None:
                continue
            namespace, member, job = taken
            try:
                if job.future.set_running_or_notify_cancel():
                    try:
                        job.future.set_result(job.fn(*job.args))
                    except BaseException as exc:  # handed to whoever waits on the future
                        job.future.set_exception(exc)
            finally:
                with self._cond:
                    tenant = self._tenants[namespace]
                    tenant.running[member] -= 1
                    tenant.total -= 1
                    self._cond.notify_all()

    def _take(self, expired: list[_Job]) -> tuple[str, str, _Job] | None:
        """The next job a free worker may start, round-robin (the lock held); jobs past their
        start_by on the way are moved to `expired`."""
        now = self.clock()
        if now - self._swept >= 1.0:
            self._swept = now
            self._forget_quiet(now)
        for _ in range(len(self._order)):
            namespace = self._order[0]
            self._order.rotate(-1)
            tenant = self._tenants[namespace]
            tenant_share, member_share = shares(self.workers, len(self._seen),
                                                len(tenant.seen))
            if tenant.total >= tenant_share:
                continue
            for _ in range(len(tenant.order)):
                member = tenant.order[0]
                tenant.order.rotate(-1)
                queue = tenant.queues[member]
                while queue and queue[0].start_by is not None and queue[0].start_by < now:
                    expired.append(queue.popleft())
                if tenant.running.get(member, 0) >= member_share or not queue:
                    continue
                job = queue.popleft()
                tenant.running[member] = tenant.running.get(member, 0) + 1
                tenant.total += 1
                self._tidy(namespace, tenant)
                return namespace, member, job
            self._tidy(namespace, tenant)
        return None

    def _tidy(self, namespace: str, tenant: _Tenant) -> None:
        """Drop empty queues from the round-robin orders."""
        for member in [m for m in tenant.order if not tenant.queues[m]]:
            tenant.order.remove(member)
        if not tenant.order and namespace in self._order:
            self._order.remove(namespace)

    def _forget_quiet(self, now: float) -> None:
        """Namespaces and VLMDeployments that filed nothing for recent_s no longer count."""
        for namespace in [n for n, t in self._seen.items() if now - t > self.recent_s]:
            tenant = self._tenants[namespace]
            if tenant.total or tenant.order:
                continue
            del self._seen[namespace], self._tenants[namespace]
        for tenant in self._tenants.values():
            for member in [m for m, t in tenant.seen.items() if now - t > self.recent_s]:
                if not tenant.running.get(member) and not tenant.queues.get(member):
                    del tenant.seen[member]
                    tenant.queues.pop(member, None)
                    tenant.running.pop(member, None)
