"""Plain helpers for e2e tests (fixtures live in conftest.py)."""

from __future__ import annotations

import time
import uuid

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from vlm_operator import crd

SESSION_NS_PREFIX = "e2e-op-"


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
    name = f"{prefix}{uuid.uuid4().hex[:6]}"
    core = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": name}})
    wait_for("default service account",
             lambda: core.read_namespaced_service_account("default", name).secrets)
    return name


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


def patch_cr(api, ns, name, spec):
    return custom(api).patch_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL,
                                                      name, {"spec": spec})


def delete_cr(api, ns, name):
    custom(api).delete_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL, name)


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
