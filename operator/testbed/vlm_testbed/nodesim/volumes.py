"""A pod's volumes on a simulated node: host directories with their Kubernetes meaning, and the
mapping a container's process uses in place of its mount namespace.

Where each volume lives (the kubelet's own layout under the pod's directory):
- emptyDir: <pod dir>/volumes/kubernetes.io~empty-dir/<name>; survives container restarts, goes
  with the pod's directory when the pod is deleted.
- persistentVolumeClaim: the bound PersistentVolume's hostPath (or local) path, else
  <work dir>/volumes/<pv name>; the test bed's provisioner (claims.py) puts its PVs' paths
  there, one per PV, outliving pods.
- downwardAPI: <pod dir>/volumes/kubernetes.io~downward-api/<name>, files written from the pod
  object and rewritten DOWNWARD_API_LAG_S (0.5 s) after a change the pod watch shows.
- configMap / secret: files written once from the object (kubernetes.io~configmap, ~secret).
- hostPath: the path itself. Anything else: an empty per-pod directory.

A process cannot be given a mount namespace here, so a container gets MOUNTS_ENV, a JSON object
{mountPath: host directory}, and every environment value that is a mountPath or lies under one
(HF_HOME=/models, HOME=/home/vllm) is rewritten to the host path; so the stand-in and a real
`vllm serve` read and write the pod's volumes. The variables programs write caches under
(WRITABLE_ENV) that lie under no mount are on the container's writable layer: a directory per
container instance, fresh on every (re)start, as a restarted container's root filesystem is.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .state import field_value, log

MOUNTS_ENV = "VLM_TESTBED_MOUNTS"
# How long after a pod's annotations or labels change its downwardAPI files show it. A change
# to a pod's labels or annotations is an update to the kubelet (pkg/kubelet/config:
# podsDifferSemantically compares them), which syncs the pod; the sync's WaitForAttachAndMount
# marks the pod's volumes for a remount (ReprocessPod, "Atomically updating volumes, like
# Downward API, depend on this"), done by the volume manager's 100 ms loops. A real kubelet
# (v1.20.2 on containerd, bench/results/node-model.md) rewrote the file a median 0.41 s, at
# most 0.50 s, after the change; 0.5 s here. The periodic sync (--sync-frequency, 1 min) is
# the documented bound, which a kubelet frozen or restarted over the change did not come near
# (0.2 s, 5.9 s after its return: bench/results/downward-api-missed-sync.md): pass 60 to model
# that bound.
DOWNWARD_API_LAG_S = 0.5
# Where programs keep caches; under no mount they are on the container's writable layer.
WRITABLE_ENV = ("HOME", "HF_HOME", "HF_HUB_CACHE", "VLLM_CACHE_ROOT", "XDG_CACHE_HOME")
KINDS = {"emptyDir": "empty-dir", "downwardAPI": "downward-api", "configMap": "configmap",
         "secret": "secret"}


def host_path(mounts: dict[str, str], path: str) -> str | None:
    """The host path for a container path that is a mountPath or lies under one (the longest
    mountPath wins, as the innermost mount shadows the outer), else None."""
    if not path.startswith("/"):
        return None
    for mount in sorted(mounts, key=len, reverse=True):
        root = mount.rstrip("/")
        if root and (path == root or path.startswith(root + "/")):
            return mounts[mount] + path[len(root):]
    return None


def container_mounts(container: dict, volumes: dict[str, str]) -> dict[str, str]:
    """{mountPath: host dir} for a container's volumeMounts, given {volume name: host dir};
    subPath selects (and creates) a directory inside the volume."""
    out = {}
    for vm in container.get("volumeMounts") or []:
        base = volumes.get(vm.get("name", ""))
        if base is None:
            continue
        sub = (vm.get("subPath") or "").strip("/")
        target = os.path.join(base, sub) if sub else base
        if sub:
            os.makedirs(target, exist_ok=True)
        out[vm["mountPath"]] = target
    return out


def map_env(env: dict[str, str], mounts: dict[str, str], writable: Path) -> dict[str, str]:
    """The container's environment as its process sees it: values under a mount rewritten to
    the host path, WRITABLE_ENV variables under no mount moved into `writable` (the instance's
    writable layer), HOME there too when the pod does not set it, and MOUNTS_ENV."""
    out = dict(env)
    for key, value in env.items():
        mapped = host_path(mounts, value)
        if mapped is not None:
            out[key] = mapped
        elif key in WRITABLE_ENV and value.startswith("/"):
            out[key] = str(writable / value.lstrip("/"))
    if "HOME" not in env:
        out["HOME"] = str(writable / "root")
    for key in WRITABLE_ENV:
        if out.get(key, "").startswith("/"):
            os.makedirs(out[key], exist_ok=True)
    out[MOUNTS_ENV] = json.dumps(mounts, sort_keys=True)
    return out


def downward_files(pod: dict, source: dict, pod_ip: str) -> dict[str, str]:
    """{relative path: content} of a downwardAPI volume for this pod object."""
    files = {}
    for item in source.get("items") or []:
        ref = item.get("fieldRef")
        if ref:
            files[item["path"]] = field_value(pod, ref.get("fieldPath", ""), pod_ip) or ""
    return files


def write_files(directory: Path, files: dict[str, str]) -> None:
    """Write each file whole (a temporary file renamed over it), so a reader never sees half of
    one, as the kubelet's atomic writer."""
    for rel, content in files.items():
        target = directory / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_text(content)
        os.replace(tmp, target)


def local_volume(pod_dir: Path, volume: dict, pod: dict, pod_ip: str,
                 lookup: Any) -> str | None:
    """Set up a volume that needs nothing from the cluster but the pod (and its Secrets and
    ConfigMaps); None for a persistentVolumeClaim (claims.py)."""
    name = volume["name"]
    if "persistentVolumeClaim" in volume:
        return None
    if "hostPath" in volume:
        path = volume["hostPath"].get("path", "")
        if volume["hostPath"].get("type") in ("DirectoryOrCreate", None, ""):
            os.makedirs(path, exist_ok=True)
        return path
    kind = next((k for k in KINDS if k in volume), None)
    directory = pod_dir / "volumes" / f"kubernetes.io~{KINDS.get(kind, 'other')}" / name
    directory.mkdir(parents=True, exist_ok=True)
    if kind == "downwardAPI":
        write_files(directory, downward_files(pod, volume["downwardAPI"], pod_ip))
    elif kind in ("configMap", "secret"):
        src = volume[kind]
        data = lookup(kind.lower(), src.get("name") or src.get("secretName"), None) or {}
        keys = {i["key"]: i["path"] for i in src.get("items") or []} or {k: k for k in data}
        write_files(directory, {path: data[key] for key, path in keys.items() if key in data})
    elif kind is None:
        log.info("volume %s of %s: %s not simulated, an empty directory", name,
                 pod["metadata"]["name"], ", ".join(k for k in volume if k != "name"))
    return str(directory)
