"""The first hour of a platform team, on a real node: `helm install` of charts/vlm-operator runs
the operator as pods of the image built from images/operator/Dockerfile (pulled by the kubelet
from the local registry), with the chart's ServiceAccount and RBAC, non-root on a read-only root
filesystem, its liveness probe, and the vLLM NetworkPolicy; a second release is its standby
(the same peering, a lower priority). A VLMDeployment then gets a pod of the built vLLM image;
when that engine dies the operator in the cluster fences it and the kubelet restarts it in
place; with the active release scaled to 0, the standby takes over.

The apiserver is reached at the control plane's pod_address (the chart's extraEnv): there is
no kube-proxy here to carry the kubernetes Service. The CNI bridge enforces no NetworkPolicy:
the policy is installed and read back, its effect is not tested here (the firewall rows of
the failure matrix cover a dropped or refused operator)."""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from kubernetes import client

from vlm_operator.api import crd
from vlm_operator.api.names import FENCE
from vlm_testbed.chart import install, uninstall
from vlm_testbed.controlplane import ready_namespace
from vlm_testbed.failure_matrix.bed import post
from vlm_testbed.realnode import OPERATOR_IMAGE
from vlm_testbed.realnode.pods import condition, container_status, events, is_ready, wait_for

RELEASES = {"vlm": 100, "vlm-standby": 50}  # release -> peering.priority
# What the pods' ServiceAccount may and may not do: (verb, resource, subresource, where), where
# "app" is the watched namespace, "system" the releases' own and None the cluster
MAY = [("patch", "pods", "", "app"), ("delete", "pods", "", "app"), ("get", "pods", "log", "app"),
       ("create", "deployments.apps", "", "app"), ("create", "events", "", "app"),
       ("patch", "vlmdeployments.serving.vlm-operator.dev", "status", "app"),
       ("list", "nodes", "", None)]
MAY_NOT = [("get", "secrets", "", "app"), ("get", "secrets", "", "system"),
           ("delete", "pods", "", "system"), ("get", "pods", "log", "system"),
           ("create", "pods", "", "app"), ("patch", "nodes", "", None)]


def can_i(api: Any, namespace: str, sa: str, verb: str, resource: str, sub: str,
          where: str | None) -> bool:
    """The apiserver's SubjectAccessReview for the ServiceAccount's token."""
    name, _, group = resource.partition(".")
    attrs = {"verb": verb, "group": group, "resource": name, "subresource": sub,
             **({"namespace": where} if where else {})}
    review = client.AuthorizationV1Api(api).create_subject_access_review({
        "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
        "spec": {"user": f"system:serviceaccount:{namespace}:{sa}", "resourceAttributes": attrs,
                 "groups": ["system:serviceaccounts", f"system:serviceaccounts:{namespace}",
                            "system:authenticated"]}})
    return bool(review.status.allowed)


def test_helm_install_runs_the_operator_as_pods_that_recover_an_engine_in_place(
        control_plane, api, node):
    v1 = client.CoreV1Api(api)
    custom = client.CustomObjectsApi(api)
    suffix = uuid.uuid4().hex[:6]
    system = ready_namespace(api, f"chart-system-{suffix}")
    app = ready_namespace(api, f"chart-app-{suffix}")
    repository, tag = OPERATOR_IMAGE.rsplit(":", 1)
    env = [{"name": k, "value": v} for k, v in control_plane.in_cluster_env().items()]
    try:
        for release, priority in RELEASES.items():
            values = {"image": {"repository": repository, "tag": tag},
                      "watchNamespaces": [app], "networkPolicy": {"enabled": True},
                      "extraEnv": env, "peering": {"priority": priority,
                                                   "create": priority == max(RELEASES.values())}}
            took = install(control_plane.kubeconfig, release, system, values)
            print(f"helm install {release} --wait: {took:.1f} s")
        operators = v1.list_namespaced_pod(system).items
        assert len(operators) == 2 and all(is_ready(p) for p in operators), operators
        for pod in operators:
            release = pod.metadata.labels["app.kubernetes.io/instance"]
            assert pod.spec.node_name == node.name
            assert pod.spec.service_account_name == f"{release}-vlm-operator"
            assert pod.spec.containers[0].image == OPERATOR_IMAGE
            assert pod.spec.containers[0].security_context.read_only_root_filesystem
            pid = wait_for("the operator's process", lambda p=pod: node.task_pid(
                container_status(p, "operator").container_id), 30)
            assert os.stat(f"/proc/{pid}").st_uid == 10001  # runAsUser
            pulled = events(v1, system, pod.metadata.name, "Pulled")
            assert pulled, f"no Pulled Event for {pod.metadata.name}"
        print("operator image pulls:", [events(v1, system, p.metadata.name, "Pulled")
                                        for p in operators])
        # peering: both releases are peers of the first one's peering object (in the watched
        # namespace), each under its pod's name
        names = {p.metadata.name for p in operators}
        wait_for("both operators in the peering object", lambda: {
            peer.split("/")[0] for peer in (custom.get_namespaced_custom_object(
                "kopf.dev", "v1", app, "kopfpeerings", "vlm-operator").get("status") or {})
        } == names, 60, 0.5)
        # what the pods' own ServiceAccount may do, as the apiserver decides for its token: the
        # operator's work in the watched namespace, nothing outside it, no Secrets anywhere
        where = {"app": app, "system": system, None: None}
        for release in RELEASES:
            sa = f"{release}-vlm-operator"
            assert [t for t in MAY if not can_i(api, system, sa, *t[:3], where[t[3]])] == []
            assert [t for t in MAY_NOT if can_i(api, system, sa, *t[:3], where[t[3]])] == []
        policies = client.NetworkingV1Api(api).list_namespaced_network_policy(app).items
        assert policies, "the chart's vLLM NetworkPolicy is not in the watched namespace"

        custom.create_namespaced_custom_object(crd.GROUP, crd.VERSION, app, crd.PLURAL, {
            "apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "m"},
            "spec": {"model": "Qwen/Qwen2-VL-2B-Instruct", "replicas": 1,
                     "vllm": {"env": [{"name": "VLM_SIM_STARTUP_SECONDS", "value": "0"}]}}})
        pod = wait_for("a Ready vLLM pod the in-cluster operator made", lambda: next(
            (p for p in v1.list_namespaced_pod(app).items if is_ready(p)), None), 180, 0.5)
        wait_for("the VLMDeployment Ready", lambda: condition(
            custom, app, "m", "Ready").get("status") == "True", 60, 0.5)

        # the engine dies (a log line, then the process exits 5 s later)
        post(pod.status.pod_ip, "/sim/fault", {"fault": "engine_dead", "exit_delay": 5})
        t1 = time.monotonic()
        wait_for("the operator's fence", lambda: FENCE in (v1.read_namespaced_pod(
            pod.metadata.name, app).metadata.annotations or {}), 60, 0.2)

        def back() -> Any:
            p = v1.read_namespaced_pod(pod.metadata.name, app)
            st = container_status(p)
            return (p.metadata.uid == pod.metadata.uid and st.restart_count >= 1
                    and FENCE not in (p.metadata.annotations or {}) and is_ready(p) and p)

        again = wait_for("recovered in place and unfenced", back, 180, 0.5)
        print(f"engine death -> serving again in place: {time.monotonic() - t1:.1f} s")
        assert container_status(again).restart_count == 1
        assert events(v1, app, pod.metadata.name, "PodFenced")
        assert wait_for("PodRecoveredInPlace", lambda: events(
            v1, app, pod.metadata.name, "PodRecoveredInPlace"), 30, 0.5)
        assert not events(v1, app, pod.metadata.name, "PodRestarted")
        for op in v1.list_namespaced_pod(system).items:  # the operators never restarted
            assert container_status(op, "operator").restart_count == 0, op.status
            # nothing the operator did so far (reconcile, peering, fence, recovery) was refused
            # by the chart's RBAC
            text = v1.read_namespaced_pod_log(op.metadata.name, system, container="operator")
            assert "Forbidden" not in text, [ln for ln in text.splitlines() if "Forbidden" in ln]

        # the active release gone: the standby acts (a new VLMDeployment gets its pod)
        client.AppsV1Api(api).patch_namespaced_deployment_scale(
            "vlm-vlm-operator", system, {"spec": {"replicas": 0}})
        wait_for("the active operator's pod gone", lambda: not v1.list_namespaced_pod(
            system, label_selector="app.kubernetes.io/instance=vlm").items, 60, 0.2)
        (standby,) = v1.list_namespaced_pod(system).items
        t2 = time.monotonic()
        custom.create_namespaced_custom_object(crd.GROUP, crd.VERSION, app, crd.PLURAL, {
            "apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "after"},
            "spec": {"model": "Qwen/Qwen2-VL-2B-Instruct", "replicas": 1}})
        wait_for("the standby's Deployment for the new VLMDeployment", lambda: any(
            d.metadata.name == "after"
            for d in client.AppsV1Api(api).list_namespaced_deployment(app).items), 180, 0.5)
        print(f"the active operator gone -> the standby reconciled a new VLMDeployment: "
              f"{time.monotonic() - t2:.1f} s")
        text = v1.read_namespaced_pod_log(standby.metadata.name, system)
        assert "Created Deployment after" in text and "Forbidden" not in text
    finally:
        logs = [v1.read_namespaced_pod_log(p.metadata.name, system, tail_lines=40)
                for p in v1.list_namespaced_pod(system).items
                if container_status(p, "operator") is not None]
        print("operator logs:", *logs, sep="\n")
        for release in RELEASES:
            uninstall(control_plane.kubeconfig, release, system)
        v1.delete_namespace(app)
        v1.delete_namespace(system)
