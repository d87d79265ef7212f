"""Plain helpers for e2e tests (fixtures live in conftest.py)."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families

from vlm_operator.api import crd
from vlm_operator.desired import children
from vlm_testbed.controlplane import ready_namespace

SESSION_NS_PREFIX = "e2e-op-"
SESSION_KEDA_PROMETHEUS = "http://prometheus:9090"  # the session operator's admin setting


def wait_for(what, fn, timeout=60.0, interval=0.25):
    """Poll fn until it returns something truthy (404s count as not yet)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except ApiException as exc:
            if exc.status != 404:
                raise
            last = None
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; last: {last!r}")


def make_namespace(api, prefix):
    return ready_namespace(api, f"{prefix}{uuid.uuid4().hex[:6]}")


def cr(name, **spec):
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": name},
            "spec": {"model": "Qwen/Qwen2-VL-2B-Instruct", "image": "vllm/vllm-openai:v0.20.2",
                     **spec}}


def custom(api):
    return client.CustomObjectsApi(api)


def create(api, ns, body):
    return custom(api).create_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL,
                                                       body)


def get_cr(api, ns, name):
    return custom(api).get_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL, name)


def wait_last_remediation(api, ns, name, pod, timeout=30.0):
    """status.lastRemediation once it names `pod`: the record is written after the action."""
    def recorded():
        last = (get_cr(api, ns, name).get("status") or {}).get("lastRemediation") or {}
        return last.get("pod") == pod and last
    return wait_for(f"status.lastRemediation of {name} naming {pod}", recorded, timeout=timeout)


def patch_cr(api, ns, name, spec):
    return custom(api).patch_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL,
                                                      name, {"spec": spec})


def delete_cr(api, ns, name):
    custom(api).delete_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL, name)


def health(**kw):
    """spec.health for the remediation tests: a retry storm is 3 lines within 60 s, acted on
    with a Restart; a pod that serves nothing is restarted as a new pod (NewPod), so these
    tests see an action as the pod's deletion (the default, in-place recovery, is tested in
    test_recovery_e2e.py and the failure matrix); `kw` overrides or adds fields."""
    return {"tokenizerRetry": {"threshold": 3, "windowSeconds": 60, "action": "Restart"},
            "maxRestartsPerHour": 20, "minAvailable": 1, "recovery": "NewPod", **kw}


def condition(obj, type_):
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return c
    return None


def events(api, ns, name, reason=None):
    items = client.CoreV1Api(api).list_namespaced_event(
        ns, field_selector=f"involvedObject.name={name}").items
    return [e for e in items if reason is None or e.reason == reason]


def deployment(api, ns, name):
    return client.AppsV1Api(api).read_namespaced_deployment(name, ns)


def container_args(dep):
    return dep.spec.template.spec.containers[0].args


# -- pods of a VLMDeployment and the vLLM stand-in's control endpoints

def managed_pods(api, ns, name):
    return client.CoreV1Api(api).list_namespaced_pod(
        ns, label_selector=children.get_selector(name)).items


def is_ready(pod):
    return pod.metadata.deletion_timestamp is None and any(
        c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def ready_pods(api, ns, name):
    return [p for p in managed_pods(api, ns, name) if is_ready(p)]


def wait_ready_pods(api, ns, name, n, timeout=90):
    """At least n ready pods of the VLMDeployment (waits); on a timeout the error says where
    each pod stood and what the namespace's Events said, so a miss can be traced."""
    try:
        return wait_for(f"{n} ready pods",
                        lambda: len(r := ready_pods(api, ns, name)) >= n and r, timeout=timeout)
    except AssertionError as exc:
        try:
            where = where_pods_stand(api, ns, name)
        except ApiException as read:
            where = f"(the pods could not be read: {read.status} {read.reason})"
        raise AssertionError(f"{exc}\n{where}") from None


def where_pods_stand(api, ns, name):
    """The VLMDeployment's pods (node, phase, conditions, container states) and the
    namespace's last Events, one line each."""
    lines = []
    for p in managed_pods(api, ns, name):
        conds = {c.type: c.status for c in p.status.conditions or []}
        states = [(c.name, c.restart_count, c.state.to_dict() if c.state else None)
                  for c in p.status.container_statuses or []]
        lines.append(f"pod {p.metadata.name} node={p.spec.node_name} phase={p.status.phase} "
                     f"created={p.metadata.creation_timestamp} conditions={conds} "
                     f"containers={states}")
    lines.append(f"VLMDeployment status: {(get_cr(api, ns, name) or {}).get('status')}")
    evs = client.CoreV1Api(api).list_namespaced_event(ns).items
    evs.sort(key=lambda e: str(e.last_timestamp or e.event_time or e.metadata.creation_timestamp))
    lines += [f"event {e.involved_object.kind}/{e.involved_object.name} {e.reason}: "
              f"{e.message} (x{e.count})" for e in evs[-25:]]
    return "\n".join(lines)


def pod_gone(api, ns, pod):
    """The pod (this uid) is deleting or deleted."""
    name = pod.metadata.labels["app.kubernetes.io/instance"]
    return all(p.metadata.uid != pod.metadata.uid or p.metadata.deletion_timestamp is not None
               for p in managed_pods(api, ns, name))


def sim_post(ip, path, body):
    """POST to the vLLM stand-in's control endpoints (/sim/fault, /sim/log) at the pod IP."""
    req = urllib.request.Request(f"http://{ip}:{children.PORT}{path}",
                                 data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as rsp:
        return json.loads(rsp.read())


def metric(text, name, **labels):
    """Sum of a Prometheus metric's samples whose labels include these, from /metrics text."""
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())
