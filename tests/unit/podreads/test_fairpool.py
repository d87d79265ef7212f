"""fairpool.FairPool: one namespace's jobs that hold their workers cannot starve another's;
within a namespace, one VLMDeployment's cannot starve its siblings'. Jobs block on Events here,
so what is asserted is which jobs start, never how long anything takes."""

from __future__ import annotations

import threading

import pytest

from vlm_operator.podreads.fairpool import FairPool, shares

from ..waiting import wait_until


@pytest.fixture
def pools():
    made = []

    def make(workers, **kw):
        made.append(FairPool(workers, "test", **kw))
        return made[-1]

    yield make
    for pool in made:
        pool.shutdown()


class Jobs:
    """Jobs that block until released; records which started."""

    def __init__(self):
        self.release = threading.Event()
        self.started: list[str] = []
        self.lock = threading.Lock()

    def job(self, name):
        with self.lock:
            self.started.append(name)
        self.release.wait(30)
        return name

    def count(self, prefix):
        with self.lock:
            return sum(1 for n in self.started if n.startswith(prefix))


def test_shares():
    assert shares(32, 1, 1) == (32, 32)  # alone: every worker
    assert shares(32, 2, 1) == (16, 16)
    assert shares(32, 3, 4) == (11, 3)
    assert shares(8, 20, 1) == (1, 1)


def test_a_tenant_holding_its_workers_leaves_the_rest_to_others(pools):
    """Tenant a's jobs never return (pods that hold every read to its deadline); tenant b
    comes next and its job starts at once on a worker a may not take."""
    pool = pools(4)
    jobs = Jobs()
    pool.submit(("b", "x"), lambda: None).result(5)  # b has been seen: two tenants now
    held = [pool.submit(("a", "hostile"), jobs.job, f"a{i}") for i in range(10)]
    wait_until(lambda: jobs.count("a") == 2)  # its share of 4 workers between 2 tenants
    done = pool.submit(("b", "x"), jobs.job, "b0")
    wait_until(lambda: jobs.count("b") == 1)
    assert jobs.count("a") == 2, "a took more than its share"
    jobs.release.set()
    assert done.result(5) == "b0"
    assert [f.result(5) for f in held] == [f"a{i}" for i in range(10)]


def test_alone_a_tenant_gets_every_worker(pools):
    pool = pools(4)
    jobs = Jobs()
    for i in range(6):
        pool.submit(("a", "x"), jobs.job, f"a{i}")
    wait_until(lambda: jobs.count("a") == 4)
    jobs.release.set()


def test_within_a_namespace_vlmdeployments_share_its_workers(pools):
    pool = pools(4)
    jobs = Jobs()
    pool.submit(("a", "quiet"), lambda: None).result(5)
    for i in range(10):
        pool.submit(("a", "noisy"), jobs.job, f"noisy{i}")
    wait_until(lambda: jobs.count("noisy") == 2)
    pool.submit(("a", "quiet"), jobs.job, "quiet")
    wait_until(lambda: jobs.count("quiet") == 1)
    assert jobs.count("noisy") == 2
    jobs.release.set()


def test_tenants_take_turns(pools):
    """One worker: queued jobs of three tenants start round-robin, not in filing order."""
    pool = pools(1)
    gate = threading.Event()
    order = []
    pool.submit(("z", "z"), gate.wait, 30)
    futures = [pool.submit((t, "x"), order.append, f"{t}{i}")
               for t in ("a", "b", "c") for i in range(2)]
    gate.set()
    for future in futures:
        future.result(5)
    assert order == ["a0", "b0", "c0", "a1", "b1", "c1"]


def test_a_job_past_its_start_by_is_dropped_not_started_late(pools):
    pool = pools(1)
    gate = threading.Event()
    pool.submit(("a", "x"), gate.wait, 30)
    ran = []
    late = pool.submit(("b", "x"), ran.append, "late", start_by=0.0)  # long past
    gate.set()
    wait_until(late.done)
    assert late.cancelled() and ran == []


def test_a_failing_job_hands_its_exception_to_the_future(pools):
    pool = pools(1)
    future = pool.submit(("a", "x"), lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        future.result(5)
    assert pool.submit(("a", "x"), lambda: 7).result(5) == 7  # the worker lives on


def test_shutdown_cancels_what_is_queued(pools):
    pool = pools(1)
    gate = threading.Event()
    pool.submit(("a", "x"), gate.wait, 30)
    queued = pool.submit(("a", "x"), lambda: None)
    pool.shutdown()
    gate.set()
    assert queued.cancelled()
    assert pool.submit(("a", "x"), lambda: None).cancelled()
