"""k8s/kube.py: every call has a deadline and keepalive, and no answer is an ApiException."""

import socket
import threading

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from prometheus_client import REGISTRY

from vlm_operator.k8s import kube


@pytest.fixture
def silent_server():
    """Accepts connections and never answers: a frozen (SIGSTOPped) apiserver."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held = []
    stop = threading.Event()

    def accept():
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


def api_client(host):
    cfg = client.Configuration(host=host)
    return kube.ApiClient(kube.configure_connections(cfg))


def finishes(fn):
    """Run fn in a thread; what it raised (it must end: without a deadline it never would)."""
    out = {}

    def run():
        try:
            fn()
        except BaseException as exc:  # handed to the test
            out["exc"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(120)  # the deadline here is 0.2 s: this only catches a call that hangs
    assert not thread.is_alive(), "the call hung"
    return out.get("exc")


def test_kube_calls_to_a_silent_apiserver_end_as_api_exceptions(silent_server, monkeypatch):
    monkeypatch.setattr(kube, "REQUEST_TIMEOUT", (0.2, 0.2))
    before = REGISTRY.get_sample_value("vlm_operator_api_requests_total",
                                       {"verb": "GET", "code": "none"}) or 0
    exc = finishes(lambda: kube.Kube(api_client(silent_server)).get_vlmd("ns", "name"))
    assert isinstance(exc, ApiException) and exc.status is None
    assert "no answer from the apiserver" in exc.reason
    assert REGISTRY.get_sample_value("vlm_operator_api_requests_total",
                                     {"verb": "GET", "code": "none"}) == before + 1
    # a call through the generated API classes gets the same deadline
    exc = finishes(lambda: client.CoreV1Api(api_client(silent_server)).read_namespace("x"))
    assert isinstance(exc, ApiException) and exc.status is None


def test_connections_keep_alive_and_never_resend():
    cfg = kube.configure_connections(client.Configuration())
    options = set(cfg.socket_options)
    assert (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1) in options
    assert (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, kube.KEEPALIVE_IDLE_S) in options
    assert (socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, kube.TCP_USER_TIMEOUT_MS) in options
    assert cfg.retries.read == 0 and cfg.retries.total == 1


class Objects(kube.Kube):
    """Kube with reads from a dict of objects (kind, name) -> body, counting them."""

    def __init__(self, objects):
        self.objects, self.reads = objects, []
        self._owners, self._owners_lock = {}, threading.Lock()

    def get(self, api_version, kind, namespace, name):
        self.reads.append((kind, name))
        return self.objects.get((kind, name))


def ref(kind, name, uid, api_version="apps/v1"):
    return {"apiVersion": api_version, "kind": kind, "name": name, "uid": uid,
            "controller": True}


def thing(name, uid, owner=None, **labels):
    return {"metadata": {"name": name, "uid": uid, "namespace": "ns", "labels": labels,
                         "ownerReferences": [owner] if owner else []}}


def test_only_pods_whose_owner_chain_leads_to_the_vlmdeployment_are_ours():
    """Labels prove nothing: a tenant's pod labelled like ours (instance=m, managed-by) but made
    by its own ReplicaSet or Deployment is never returned, so never scraped, drained or
    deleted."""
    vlmd = ref("VLMDeployment", "m", "v1", "serving.vlm-operator.dev/v1alpha1")
    objects = {
        ("Deployment", "m"): thing("m", "d1", vlmd),
        ("ReplicaSet", "m-abc"): thing("m-abc", "rs1", ref("Deployment", "m", "d1")),
        ("Deployment", "theirs"): thing("theirs", "d2"),
        ("ReplicaSet", "theirs-x"): thing("theirs-x", "rs2", ref("Deployment", "theirs", "d2")),
        ("ReplicaSet", "m-fake"): thing("m-fake", "rs3"),
    }
    k = Objects(objects)
    ours = thing("m-abc-1", "p1", ref("ReplicaSet", "m-abc", "rs1"),
                 **{"app.kubernetes.io/instance": "m"})
    pods = [ours,
            thing("bare", "p2", None, **{"app.kubernetes.io/instance": "m"}),
            thing("t-1", "p3", ref("ReplicaSet", "theirs-x", "rs2"),
                  **{"app.kubernetes.io/instance": "m"}),
            thing("f-1", "p4", ref("ReplicaSet", "m-fake", "rs3"),
                  **{"app.kubernetes.io/instance": "m"}),
            # right chain, another VLMDeployment's instance label: not this one's pod
            thing("m-abc-2", "p5", ref("ReplicaSet", "m-abc", "rs1"),
                  **{"app.kubernetes.io/instance": "n"}),
            # a stale reference: the ReplicaSet of that name now has another uid
            thing("old", "p6", ref("ReplicaSet", "m-abc", "rs-old"),
                  **{"app.kubernetes.io/instance": "m"})]
    assert k.owned_pods(pods) == [ours]
    assert kube.object_path("apps/v1", "ReplicaSet", "ns", "m-abc") == \
        "/apis/apps/v1/namespaces/ns/replicasets/m-abc"
    reads = len(k.reads)
    assert k.owned_pods([ours]) == [ours] and len(k.reads) == reads  # remembered by uid


def test_schema_has_reads_an_openapi_v3_document():
    from vlm_operator.k8s.kube import schema_has

    doc = {"components": {"schemas": {"io.k8s.api.policy.v1.PodDisruptionBudgetSpec": {
        "properties": {"minAvailable": {}, "unhealthyPodEvictionPolicy": {"type": "string"}}}}}}
    spec = "io.k8s.api.policy.v1.PodDisruptionBudgetSpec"
    assert schema_has(doc, spec, "unhealthyPodEvictionPolicy")
    assert not schema_has(doc, spec, "maxUnavailable") and not schema_has({}, spec, "x")


class Discovery(kube.Kube):
    """A Kube whose discovery answers come from `groups` (path -> resources; absent: 404,
    None: a 503), counting the calls."""

    def __init__(self, groups):
        super().__init__(None)
        self.groups, self.calls = groups, []

    def _call(self, method, path, **_):
        self.calls.append(path)
        if path not in self.groups:
            raise ApiException(status=404, reason="Not Found")
        if self.groups[path] is None:
            raise ApiException(status=503, reason="Service Unavailable")
        return {"resources": [{"name": r} for r in self.groups[path]]}


def test_an_inference_pool_crd_installed_while_running_is_seen_on_the_next_ask():
    """A "not served" answer for InferencePools is not kept: the pass after the CRD is
    installed makes the pool, instead of waiting for the next resync. A "served" one is."""
    k = Discovery({})
    assert not k.inference_pools_served()
    k.groups["/apis/inference.networking.k8s.io/v1"] = ["inferencepools", "inferencepools/status"]
    assert k.inference_pools_served()
    calls = len(k.calls)
    assert k.inference_pools_served() and len(k.calls) == calls


def test_discovery_that_fails_is_not_an_absent_api():
    """Unknown is not no: a 503 is raised, never read as 'not installed'."""
    k = Discovery({"/apis/inference.networking.k8s.io/v1": None})
    with pytest.raises(ApiException):
        k.inference_pools_served()
    k = Discovery({"/apis/keda.sh/v1alpha1": ["scaledobjects"]})
    assert k.keda_served() and not k.served("keda.sh/v1alpha1", "scaledjobs")
