"""Desired child objects of a VLMDeployment. Pure: no API calls, same input -> same output.

The handlers apply what these return; `vlm-operator render` prints it.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from vlm_operator.api import crd_spec, names, versions
from vlm_operator.api.names import (
    CONTAINER,
    GPU_RESOURCE,
    IN_SERVICE_LABEL,
    INSTANCE_LABEL,
    MANAGER,
    PORT,
    RESTART_REQUEST,
    RESTART_REQUEST_DIR,
    RESTART_REQUEST_ENV,
    RESTART_REQUEST_FILE,
    SURGE_ANNOTATION,
)
from vlm_operator.api.validation import POOL_SIZE_ENV, VLMDeployment
from vlm_operator.desired import autoscaler_objects
from vlm_operator.desired.stopping import DRAIN_LIMIT_S, POD_IP_ENV, PRESTOP_SCRIPT, STOP_S
from vlm_operator.k8s.pods import controller_of

RUN_AS_USER = 10001  # the uid of images/vllm (any non-root uid works: HOME is a volume)
# vLLM has an allow-list of media hosts but no "none": a name under .invalid (RFC 2606), which
# never resolves and no URL can name by accident, allows no http(s) media URL at all.
NO_MEDIA_HOST = "media-urls-disabled.invalid"
# Model loads take minutes: allow up to 30 minutes before the startup probe gives up. Probed
# every 2 s, a started server is Ready about 1 s after its /health first answers (every 10 s
# cost 5 s on average, on each cold start, new pod and in-place restart alike); /health is a
# cheap handler, so the extra probes during a start cost nothing that matters.
STARTUP_PERIOD_SECONDS = 2
STARTUP_FAILURE_THRESHOLD = 900
CONTROL_VOLUME = "control"  # the operator's requests to the pod's engine plugin (downwardAPI)


def get_selector_labels(name: str) -> dict[str, str]:
    """What selects the pods of VLMDeployment `name` (Service, PodDisruptionBudget, the scale
    subresource's selector, the operator's own lists): managed-by too, so pods of other apps
    labelled like ours are not selected. Labels alone prove nothing (anyone may set them): the
    operator acts only on pods whose owner chain leads to it (Kube.list_pods)."""
    return {
        "app.kubernetes.io/name": "vllm",
        INSTANCE_LABEL: name,
        "app.kubernetes.io/component": "engine",
        "app.kubernetes.io/managed-by": MANAGER,
    }


def get_labels(name: str) -> dict[str, str]:
    return get_selector_labels(name)


def get_selector(name: str) -> str:
    """The label selector string written to status.selector for the scale subresource."""
    return ",".join(f"{k}={v}" for k, v in get_selector_labels(name).items())


def get_owner_references(vlmd: VLMDeployment) -> list[dict]:
    if not vlmd.uid:
        return []
    return [{
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "name": vlmd.name,
        "uid": vlmd.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }]



def is_controlled_by(obj: dict, uid: str | None) -> bool:
    """Whether `obj`'s controller ownerReference is the VLMDeployment with `uid`."""
    return bool(uid) and (controller_of(obj) or {}).get("uid") == uid


def keep_selector(child: dict, existing: dict | None) -> dict:
    """A Deployment's selector cannot change: one made with an older selector keeps it."""
    if child["kind"] != "Deployment" or existing is None:
        return child
    selector = (existing.get("spec") or {}).get("selector")
    if not selector or selector == child["spec"]["selector"]:
        return child
    return {**child, "spec": {**child["spec"], "selector": selector}}


def may_write(existing: dict | None, uid: str | None) -> bool:
    """Whether the operator may apply a child over `existing` (None: nothing of that name):
    only onto an object this VLMDeployment controls, never onto another app's."""
    return existing is None or is_controlled_by(existing, uid)


def _metadata(vlmd: VLMDeployment, name: str) -> dict:
    meta: dict[str, Any] = {"name": name, "namespace": vlmd.namespace,
                            "labels": get_labels(vlmd.name)}
    owners = get_owner_references(vlmd)
    if owners:
        meta["ownerReferences"] = owners
    return meta


def get_vllm_args(vlmd: VLMDeployment) -> list[str]:
    """`vllm serve` arguments, with only the flags this vLLM version has."""
    spec, engine = vlmd.spec, vlmd.spec["vllm"]
    args = [spec["model"], "--port", str(PORT)]
    for flag, value in (
        ("--served-model-name", spec.get("servedModelName")),
        ("--revision", spec.get("revision")),
        *((flag, engine.get(field)) for field, (flag, _) in crd_spec.VALUE_FLAGS.items()),
    ):
        if value is not None:
            args += [flag, str(value)]
    args += ["--tensor-parallel-size", str(vlmd.tensor_parallel_size)]
    if engine.get("limitMmPerPrompt"):
        args += ["--limit-mm-per-prompt", _json(engine["limitMmPerPrompt"])]
    if "mmProcessorKwargs" in engine:
        args += ["--mm-processor-kwargs", _json(engine["mmProcessorKwargs"])]
    if versions.has_flag(vlmd.version, "--renderer-num-workers"):
        args += ["--renderer-num-workers", str(spec["rendererNumWorkers"])]
    domains = get_media_domains(vlmd)
    if domains is not None:
        args += ["--allowed-media-domains", *domains]
    return args + list(engine.get("extraArgs") or [])


def get_media_domains(vlmd: VLMDeployment) -> list[str] | None:
    """The hosts the engine may fetch media URLs from; None: any (["*"] in the spec). A pod
    fetches what requests name from inside the cluster, so by default no host at all."""
    domains = vlmd.spec["vllm"].get("allowedMediaDomains") or []
    if domains == ["*"]:
        return None
    return list(domains) or [NO_MEDIA_HOST]


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True, allow_nan=False)


def get_env(vlmd: VLMDeployment) -> list[dict]:
    spec = vlmd.spec
    env: list[dict] = [
        {"name": POOL_SIZE_ENV, "value": str(vlmd.pool_size)},
        {"name": "HF_HOME", "value": _cache_mount_path(vlmd)},
        {"name": "VLLM_CACHE_ROOT", "value": get_compile_cache_path(vlmd)},
        {"name": "HOME", "value": "/home/vllm"},
        {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": RESTART_REQUEST_ENV,
         "value": f"{RESTART_REQUEST_DIR}/{RESTART_REQUEST_FILE}"},
    ]
    if get_media_domains(vlmd) is not None:  # a redirect would leave the allowed hosts
        env.append({"name": "VLLM_MEDIA_URL_ALLOW_REDIRECTS", "value": "0"})
    token = spec.get("hfTokenSecretRef")
    if token:
        env.append({"name": "HF_TOKEN", "valueFrom": {
            "secretKeyRef": {"name": token["name"], "key": token["key"]}}})
    return env + copy.deepcopy(spec["vllm"].get("env") or [])


def _cache_mount_path(vlmd: VLMDeployment) -> str:
    return (vlmd.spec.get("modelCache") or {}).get("mountPath", "/models")


def get_compile_cache_path(vlmd: VLMDeployment) -> str:
    """vLLM's cache root (torch.compile artefacts) on the model cache volume, so it lives as
    long as the weights do, under a key of vLLM version and model: no two versions or models
    share one (a cache built by another version is not reused, and never corrupts this one)."""
    model = re.sub(r"[^A-Za-z0-9._-]+", "--", vlmd.spec["model"]).strip("-.")[:100] or "model"
    return f"{_cache_mount_path(vlmd)}/vllm-cache/{vlmd.version}/{model}"


def one_node_cache(vlmd: VLMDeployment) -> bool:
    """The cache is a ReadWriteOnce claim the operator creates: it attaches to one node only,
    so every replica (and a replacement surged beside a sick pod) is placed on that node. A
    pod elsewhere would wait in ContainerCreating on a Multi-Attach error, unseen; placed
    together, one that does not fit stays Pending with the scheduler's reason."""
    cache = vlmd.spec.get("modelCache") or {}
    return "size" in cache and cache.get("accessModes", ["ReadWriteOnce"]) == ["ReadWriteOnce"]


def _affinity(vlmd: VLMDeployment, user: dict | None) -> dict | None:
    if not one_node_cache(vlmd):
        return copy.deepcopy(user) if user else None
    affinity = copy.deepcopy(user or {})
    pod_affinity = affinity.setdefault("podAffinity", {})
    pod_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append({
        "labelSelector": {"matchLabels": get_selector_labels(vlmd.name)},
        "topologyKey": "kubernetes.io/hostname"})
    return affinity


def get_pvc_name(vlmd: VLMDeployment) -> str | None:
    """Name of the PVC the pods mount, or None when the cache is an emptyDir."""
    cache_spec = vlmd.spec.get("modelCache") or {}
    if "claimName" in cache_spec:
        return cache_spec["claimName"]
    if "size" in cache_spec:
        return f"{vlmd.name}-model-cache"
    return None


def _volumes(vlmd: VLMDeployment) -> list[dict]:
    claim = get_pvc_name(vlmd)
    cache_volume = ({"persistentVolumeClaim": {"claimName": claim}} if claim
                    else {"emptyDir": {}})
    return [
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        {"name": "model-cache", **cache_volume},
        {"name": "home", "emptyDir": {}},
        # the operator's in-place restart request (the pod's annotation, refreshed by the
        # kubelet within about a minute), read by the engine plugin: no exec, no endpoint
        {"name": CONTROL_VOLUME, "downwardAPI": {"items": [{
            "path": RESTART_REQUEST_FILE,
            "fieldRef": {"fieldPath": f"metadata.annotations['{RESTART_REQUEST}']"}}]}},
    ]


def _probe(period: int, failures: int, timeout: int = 5) -> dict:
    return {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": period,
            "failureThreshold": failures, "timeoutSeconds": timeout}


def _resources(vlmd: VLMDeployment) -> dict:
    gpus, resource = vlmd.spec["gpusPerReplica"], vlmd.spec["gpuResourceName"]
    user = copy.deepcopy(vlmd.spec.get("resources") or {})
    return {
        # a quantity string: server-side apply (1.20) rejects a bare integer with a 500
        "requests": {**user.get("requests", {}), resource: str(gpus)},
        "limits": {**user.get("limits", {}), resource: str(gpus)},
    }


def get_container(vlmd: VLMDeployment) -> dict:
    return {
        "name": CONTAINER,
        "image": vlmd.spec["image"],
        "imagePullPolicy": "IfNotPresent",
        "command": ["vllm", "serve"],
        "args": get_vllm_args(vlmd),
        "env": get_env(vlmd),
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        "resources": _resources(vlmd),
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "model-cache", "mountPath": _cache_mount_path(vlmd)},
            {"name": "home", "mountPath": "/home/vllm"},
            {"name": CONTROL_VOLUME, "mountPath": RESTART_REQUEST_DIR, "readOnly": True},
        ],
        "startupProbe": _probe(STARTUP_PERIOD_SECONDS, STARTUP_FAILURE_THRESHOLD),
        "readinessProbe": _probe(5, 3),
        "livenessProbe": _probe(10, 6),
        "lifecycle": {"preStop": {"exec": {"command": ["python3", "-c", PRESTOP_SCRIPT]}}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            # vLLM, torch and triton write caches outside the mounted volumes.
            "readOnlyRootFilesystem": False,
        },
    }


def get_pod_template(vlmd: VLMDeployment) -> dict:
    sched = vlmd.spec.get("scheduling") or {}
    pod_spec: dict[str, Any] = {
        "containers": [get_container(vlmd)],
        "volumes": _volumes(vlmd),
        "terminationGracePeriodSeconds": DRAIN_LIMIT_S + STOP_S,
        "enableServiceLinks": False,
        # vLLM never calls the Kubernetes API: a mounted token would only be there to steal.
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        # GPU nodes are commonly tainted nvidia.com/gpu:NoSchedule.
        "tolerations": [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"},
                        *copy.deepcopy(sched.get("tolerations", []))],
    }
    for key in ("nodeSelector", "runtimeClassName", "priorityClassName"):
        if sched.get(key):
            pod_spec[key] = copy.deepcopy(sched[key])
    affinity = _affinity(vlmd, sched.get("affinity"))
    if affinity:
        pod_spec["affinity"] = affinity
    if vlmd.spec.get("serviceAccountName"):  # e.g. cloud workload identity; still no token
        pod_spec["serviceAccountName"] = vlmd.spec["serviceAccountName"]
    return {
        "metadata": {
            "labels": {**get_labels(vlmd.name), IN_SERVICE_LABEL: "true"},
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(PORT),
                "prometheus.io/path": "/metrics",
            },
        },
        "spec": pod_spec,
    }


def get_deployment(vlmd: VLMDeployment, surge: int = 0) -> dict:
    """`surge`: extra replicas while log watching brings up replacements for sick pods that
    still serve (remediation/remediator.py); they go once the sick pods are removed."""
    replicas = vlmd.spec["replicas"]
    surge = surge if replicas else 0
    meta = _metadata(vlmd, vlmd.name)
    if surge:
        meta["annotations"] = {SURGE_ANNOTATION: str(surge)}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": replicas + surge,
            "selector": {"matchLabels": get_selector_labels(vlmd.name)},
            # GPUs are scarce: replace pods one at a time without needing a spare GPU.
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "progressDeadlineSeconds": STARTUP_PERIOD_SECONDS * STARTUP_FAILURE_THRESHOLD + 600,
            "revisionHistoryLimit": 5,
            "template": get_pod_template(vlmd),
        },
    }


def get_service(vlmd: VLMDeployment) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(vlmd, vlmd.name),
        "spec": {
            "type": "ClusterIP",
            "selector": {**get_selector_labels(vlmd.name), IN_SERVICE_LABEL: "true"},
            "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def get_pdb(vlmd: VLMDeployment, api_version: str = "policy/v1",
            unhealthy_pod_eviction: bool = False) -> dict:
    """The PodDisruptionBudget; clusters older than 1.21 only serve policy/v1beta1.

    `unhealthy_pod_eviction`: the apiserver's schema has spec.unhealthyPodEvictionPolicy
    (Kubernetes 1.26+; older ones refuse the unknown field): AlwaysAllow, so a pod that serves
    nothing (not ready) never holds up a node drain."""
    spec: dict[str, Any] = {
        "minAvailable": vlmd.spec["health"]["minAvailable"],
        "selector": {"matchLabels": get_selector_labels(vlmd.name)},
    }
    if unhealthy_pod_eviction and api_version == "policy/v1":
        spec["unhealthyPodEvictionPolicy"] = "AlwaysAllow"
    return {
        "apiVersion": api_version,
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(vlmd, vlmd.name),
        "spec": spec,
    }


def get_pvc(vlmd: VLMDeployment) -> dict | None:
    """The model-cache PVC when the operator is asked to create one."""
    cache_spec = vlmd.spec.get("modelCache") or {}
    if "size" not in cache_spec:
        return None
    spec: dict[str, Any] = {
        "accessModes": list(cache_spec.get("accessModes", ["ReadWriteOnce"])),
        "resources": {"requests": {"storage": cache_spec["size"]}},
    }
    if cache_spec.get("storageClassName"):
        spec["storageClassName"] = cache_spec["storageClassName"]
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": _metadata(vlmd, get_pvc_name(vlmd)), "spec": spec}


def get_children(vlmd: VLMDeployment, pdb_api_version: str = "policy/v1",
                 hpa_api_version: str = "autoscaling/v2", keda: bool = True,
                 surge: int = 0, prometheus_address: str | None = None,
                 unhealthy_pod_eviction: bool = False) -> list[dict]:
    """Every object the VLMDeployment owns, in the order they should be applied.

    `keda`: whether the cluster serves ScaledObjects (without, KEDA mode adds none); `surge`:
    see get_deployment; `prometheus_address`: the Prometheus a ScaledObject queries
    (policy.prometheus_address); `unhealthy_pod_eviction`: see get_pdb.
    """
    pvc = get_pvc(vlmd)
    scaling = autoscaler_objects.get_autoscaling_children(
        vlmd, _metadata(vlmd, vlmd.name), hpa_api_version, keda, prometheus_address)
    return [*([pvc] if pvc else []), get_deployment(vlmd, surge), get_service(vlmd),
            get_pdb(vlmd, pdb_api_version, unhealthy_pod_eviction), *scaling]
