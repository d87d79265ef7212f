"""Reconcile passes are serialised and coalesced per object (real threads, a recording Kube)."""

import contextlib
import threading
import time

from vlm_operator.reconcile.reconciler import Reconciler


class SlowKube:
    """Stands in for the apiserver side only: counts passes; each pass takes a while."""

    def __init__(self):
        self.passes = 0
        self.concurrent = 0
        self.most_concurrent = 0
        self.lock = threading.Lock()

    def get_vlmd(self, namespace, name):
        with self.lock:
            self.passes += 1
            self.concurrent += 1
            self.most_concurrent = max(self.most_concurrent, self.concurrent)
        time.sleep(0.2)
        with self.lock:
            self.concurrent -= 1
        return None  # gone: the pass ends here


def test_burst_of_triggers_costs_at_most_two_passes():
    kube = SlowKube()
    rec = Reconciler(kube)
    threads = [threading.Thread(target=rec.reconcile, args=("ns", "a")) for _ in range(20)]
    for t in threads:
        t.start()
        time.sleep(0.005)
    for t in threads:
        t.join()
    assert kube.most_concurrent == 1
    assert 2 <= kube.passes <= 3  # the first pass, then one more for everything that came in
    rec.reconcile("ns", "a")
    assert kube.passes <= 4  # nothing left marked dirty


def test_different_objects_run_in_parallel():
    kube = SlowKube()
    rec = Reconciler(kube)
    threads = [threading.Thread(target=rec.reconcile, args=("ns", f"o{i}")) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert kube.passes == 4 and kube.most_concurrent > 1


def test_an_error_releases_the_object():
    class Failing(SlowKube):
        def get_vlmd(self, namespace, name):
            raise RuntimeError("boom")

    rec = Reconciler(Failing())
    for _ in range(2):
        with contextlib.suppress(RuntimeError):
            rec.reconcile("ns", "a")
    assert rec._running == set()
