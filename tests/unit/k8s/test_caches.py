"""informer.Informer on a stand-in apiserver: LIST then WATCH, events applied in order, a
410 relists, a watch that RBAC forbids falls back to polling, and a cache that cannot vouch
for what it holds raises Stale."""

import json
import threading

import pytest
from kubernetes.client.exceptions import ApiException

from vlm_operator.api import names
from vlm_operator.desired import children
from vlm_operator.k8s import caches
from vlm_operator.k8s import informer as informers
from vlm_operator.k8s.caches import ClusterCache
from vlm_operator.k8s.informer import Informer, Stale
from vlm_operator.k8s.nodes import parse_markers

from ..waiting import wait_until


def obj(uid, rv, **labels):
    return {"metadata": {"uid": uid, "name": uid, "namespace": "ns", "resourceVersion": rv,
                         "labels": labels, "managedFields": [{"big": "x"}]}}


class Stream:
    def __init__(self, events, hold=None):
        self.data = b"".join(json.dumps(e).encode() + b"\n" for e in events)
        self.hold = hold

    def stream(self, size):
        # split mid-line: the informer must join partial lines
        for i in range(0, len(self.data), 7):
            yield self.data[i:i + 7]
        if self.hold is not None:
            self.hold.wait()

    def release_conn(self):
        pass


class Kube:
    """Pages for LIST, scripted streams (or exceptions) for WATCH; then it blocks."""

    def __init__(self, pages, watches):
        self.pages, self.watches = list(pages), list(watches)
        self.lists, self.queries = 0, []
        self.done = threading.Event()

    def owned_pods(self, pods):
        """The owner-chain check (Kube.owned_pods, tested in test_kube.py): here a label."""
        return [p for p in pods if not p["metadata"]["labels"].get("foreign")]

    def list_page(self, path, query):
        self.lists += 1
        self.queries.append(dict(query))
        return self.pages.pop(0) if len(self.pages) > 1 else self.pages[0]

    def watch(self, path, query, read_timeout_s):
        self.queries.append(dict(query))
        if not self.watches:
            self.done.set()
            return Stream([], hold=threading.Event())
        step = self.watches.pop(0)
        if isinstance(step, Exception):
            raise step
        return Stream(step)



def keep(o):
    return None if o["metadata"]["labels"].get("skip") else o["metadata"]["name"]


def test_list_then_watch_events_in_order_and_410_relists():
    page1 = {"items": [obj("a", "1")], "metadata": {"continue": "t"}}
    page2 = {"items": [obj("b", "2"), obj("s", "2", skip="1")],
             "metadata": {"resourceVersion": "5"}}
    relisted = {"items": [obj("z", "9")], "metadata": {"resourceVersion": "9"}}
    kube = Kube([page1, page2, relisted], [
        [{"type": "ADDED", "object": obj("c", "6")},
         {"type": "MODIFIED", "object": obj("a", "7", skip="1")},  # no longer kept
         {"type": "DELETED", "object": obj("b", "8")},
         {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "8"}}},
         {"type": "ERROR", "object": {"code": 410, "message": "too old"}}]])
    informer = Informer(kube, "test", "/api/v1/pods", keep).start()
    try:
        wait_until(kube.done.is_set)
        assert informer.values() == ["z"]  # the 410 relisted everything
        assert kube.lists == 3  # two pages, then the relist
        watch = kube.queries[2]
        assert (watch["resourceVersion"], watch["allowWatchBookmarks"]) == ("5", "true")
        assert kube.queries[-1]["resourceVersion"] == "9"
    finally:
        informer.stop()


def test_watch_events_change_what_is_held():
    page = {"items": [obj("a", "1"), obj("b", "1")], "metadata": {"resourceVersion": "1"}}
    kube = Kube([page], [[{"type": "ADDED", "object": obj("c", "2")},
                          {"type": "DELETED", "object": obj("a", "3")}]])
    informer = Informer(kube, "test", "/api/v1/pods", keep).start()
    try:
        wait_until(kube.done.is_set)
        assert sorted(informer.values()) == ["b", "c"]
        assert kube.queries[-1]["resourceVersion"] == "3"  # resumed after the last event
    finally:
        informer.stop()


def test_forbidden_watch_polls_and_never_listed_is_stale(monkeypatch, caplog):
    monkeypatch.setattr(informers, "POLL_S", 0.01)
    page = {"items": [obj("a", "1")], "metadata": {"resourceVersion": "1"}}
    kube = Kube([page], [ApiException(status=403, reason="Forbidden")])
    informer = Informer(kube, "test", "/api/v1/pods", keep).start()
    try:
        wait_until(lambda: kube.lists >= 3)  # listing again and again, no more watches
        assert informer.values() == ["a"]
        assert "watch not permitted" in caplog.text
    finally:
        informer.stop()

    monkeypatch.setattr(informers, "SYNC_WAIT_S", 0.05)
    failing = Kube([], [])
    failing.list_page = lambda path, query: (_ for _ in ()).throw(
        ApiException(status=None, reason="no answer"))
    stale = Informer(failing, "down", "/api/v1/nodes", keep).start()
    try:
        with pytest.raises(Stale, match="no answer"):
            stale.values()
    finally:
        stale.stop()


def test_managed_pods_are_served_by_namespace_and_selector_without_managed_fields():
    app = {"app.kubernetes.io/instance": "m", "app.kubernetes.io/name": "vllm"}
    other = {"app.kubernetes.io/instance": "n", "app.kubernetes.io/name": "vllm"}
    page = {"items": [obj("p1", "1", **app), obj("p2", "1", **other),
                      obj("p3", "1", **app, foreign="yes")],
            "metadata": {"resourceVersion": "1"}}
    kube = Kube([page], [])
    cache = ClusterCache(kube)
    try:
        pods = cache.list_pods("ns", "app.kubernetes.io/name=vllm,app.kubernetes.io/instance=m")
        assert [p["metadata"]["name"] for p in pods] == ["p1"]  # p3 is not ours
        assert "managedFields" not in pods[0]["metadata"]
        assert cache.list_pods("other", "app.kubernetes.io/instance=m") == []
        assert kube.queries[0]["labelSelector"] == caches.MANAGED
    finally:
        cache.stop()


def test_a_foreign_labelled_pod_is_not_held_and_ours_only_as_far_as_the_operator_reads_it():
    """A tenant's pod labelled like ours but not made by the operator (no owner chain to a
    VLMDeployment) was held in full, 250 KB annotations included: 200 of them added 100 MiB.
    Now it is not held at all, and of the operator's own pods only what it reads is: its own
    labels and annotations, no managedFields, no tenant annotation, spec and status as they
    are."""
    app = {**children.get_labels("m"), "tenant/extra": "1"}
    blob = {"tenant.example/blob": "x" * 250_000}
    ours = obj("p1", "1", **app)
    ours["metadata"]["annotations"] = {**blob, names.LOG_MARK: "{}",
                                       names.FENCE: "y" * 5_000}
    ours["metadata"]["ownerReferences"] = [
        {"kind": "ReplicaSet", "name": "m-1", "uid": "rs", "controller": True},
        *({"kind": "Thing", "name": f"t{i}", "uid": str(i)} for i in range(1000))]
    ours["spec"] = {"containers": [{"name": "vllm"}], "nodeName": "n1"}
    ours["status"] = {"phase": "Running", "podIP": "10.0.0.1"}
    foreign = obj("p3", "1", **app, foreign="yes")
    foreign["metadata"]["annotations"] = blob
    kube = Kube([{"items": [ours, foreign], "metadata": {"resourceVersion": "1"}}], [])
    cache = ClusterCache(kube)
    try:
        (pod,) = cache.list_pods("ns", children.get_selector("m"))
        held = cache._managed("ns").values()
        assert [p["metadata"]["name"] for p in held] == ["p1"]
        meta = pod["metadata"]
        assert meta["labels"] == children.get_labels("m")
        assert meta["annotations"] == {names.LOG_MARK: "{}"}  # the oversized fence is none
        assert [r["name"] for r in meta["ownerReferences"]] == ["m-1"]
        assert "managedFields" not in meta
        assert (pod["spec"], pod["status"]) == (ours["spec"], ours["status"])
        assert len(json.dumps(held)) < 2_000
    finally:
        cache.stop()


def test_nodes_feed_the_budget_and_the_leaving_nodes():
    def node(name, unschedulable=False, taints=(), labels=None):
        return {"metadata": {"uid": name, "name": name, "resourceVersion": "1",
                             "labels": labels or {}},
                "spec": {"unschedulable": unschedulable, "taints": list(taints)},
                "status": {"allocatable": {"nvidia.com/gpu": "1"},
                           "conditions": [{"type": "Ready", "status": "True"}]}}

    page = {"items": [node("a"), node("b", unschedulable=True), node("c", taints=[
        {"key": "ToBeDeletedByClusterAutoscaler", "value": "1", "effect": "NoSchedule"}]),
        node("d", unschedulable=True, labels={"example.com/maintenance": "drain"})],
        "metadata": {"resourceVersion": "1"}}
    empty = {"items": [], "metadata": {"resourceVersion": "1"}}

    class Paths(Kube):
        def list_page(self, path, query):
            self.lists += 1
            return page if path == "/api/v1/nodes" else empty

    cache = ClusterCache(Paths([page], []), drain_markers=parse_markers(
        "example.com/maintenance=drain"))
    try:
        nodes, free = cache.budget()
        assert [n.name for n in nodes] == ["a"] and free == {"a": {"nvidia.com/gpu": 1}}
        leaving = cache.leaving_nodes()
        assert sorted(leaving) == ["b", "c", "d"] and "cluster autoscaler" in leaving["c"].why
        # a cordon alone is no drain; the autoscaler's taint and the admin's marker are
        assert {n: v.drain for n, v in leaving.items()} == {"b": False, "c": True, "d": True}
    finally:
        cache.stop()


def test_unbound_managed_pods_are_counted_only_when_ours():
    def pending(uid, gpus, owner="ours"):
        pod = obj(uid, "1", **{"app.kubernetes.io/instance": "m"})
        pod["metadata"]["ownerReferences"] = [{"kind": "ReplicaSet", "name": owner,
                                               "controller": True, "uid": owner}]
        pod["spec"] = {"containers": [{"resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}
        pod["status"] = {"phase": "Pending"}
        return pod

    class Owners(Kube):
        def owned_pods(self, pods):
            """The owner check reads what the cache kept: the controller reference."""
            return [p for p in pods if p["metadata"]["ownerReferences"][0]["name"] == "ours"]

    page = {"items": [pending("p1", 2), pending("p2", 1, owner="theirs"), pending("p3", 0)],
            "metadata": {"resourceVersion": "1"}}
    kube = Owners([page], [])
    cache = ClusterCache(kube)
    try:
        (use,) = cache.unbound_uses()  # p2's owner chain is not ours; p3 asks for no GPU
        assert (use.node, use.requests, use.namespace) == ("", {"nvidia.com/gpu": 2}, "ns")
        assert dict(use.labels)["app.kubernetes.io/instance"] == "m"
        assert (kube.queries[0]["fieldSelector"], kube.queries[0]["labelSelector"]) == (
            caches.UNBOUND, caches.MANAGED)
    finally:
        cache.stop()
