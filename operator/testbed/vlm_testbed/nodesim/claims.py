"""PersistentVolumeClaims in the test bed: a provisioner that gives each pending claim a
hostPath PersistentVolume (the real kube-controller-manager binds them), and attaching a claim
to a node with its access mode enforced across nodes.

Provisioner: for every Pending claim without a volume whose storageClassName is empty or
STORAGE_CLASS, a PV `pvc-<claim uid>` (the name dynamic provisioners give) with the claim's
capacity, access modes and volume mode, a claimRef to it, reclaim policy Delete and
`pv.kubernetes.io/provisioned-by: PROVISIONER` (so the PV controller leaves deletion to us,
as to any external provisioner), pointing at <work dir>/volumes/<pv name>. When the claim is
deleted (or its PV found Released) the PV and its directory go. Several simulators on one
cluster all provision: the PV's fixed name makes the second create a no-op.

Attach (ReadWriteOnce): a PV whose access modes hold neither ReadWriteMany nor ReadOnlyMany is
attached to one node at a time, recorded on the PV (annotation ATTACHED, written with the PV's
resourceVersion so two nodes cannot both win). Pods on that node share it; a pod on another
node waits, ContainerCreating, while a pod that uses the claim is bound to the holding node and
not finished, with the Events the attach-detach controller and the kubelet write:
FailedAttachVolume `Multi-Attach error for volume "<pv>" Volume is already used by pod(s) <pods>`
once, and FailedMount `Unable to attach or mount volumes: unmounted volumes=[..], unattached
volumes=[..]: timed out waiting for the condition` every MOUNT_TIMEOUT_S.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import events
from .state import SIM_LABEL, log

if TYPE_CHECKING:
    from .pods import PodRunner

PROVISIONER = "vlm-testbed.dev/hostpath"
STORAGE_CLASS = "vlm-testbed-hostpath"
PROVISIONED_BY = "pv.kubernetes.io/provisioned-by"
ATTACHED = "vlm-testbed/attached-node"
# The kubelet's wait for a pod's volumes before it reports FailedMount and retries
# (volumemanager podAttachAndMountTimeout, 2m3s).
MOUNT_TIMEOUT_S = 123.0
MULTI_ATTACH = ("ReadWriteMany", "ReadOnlyMany")


def persistent_volume(claim: dict, directory: Path) -> dict:
    """The PV the provisioner creates for a pending claim."""
    meta, spec = claim["metadata"], claim.get("spec") or {}
    size = ((spec.get("resources") or {}).get("requests") or {}).get("storage", "1Gi")
    return {"apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": f"pvc-{meta['uid']}", "labels": {SIM_LABEL: "true"},
                         "annotations": {PROVISIONED_BY: PROVISIONER}},
            "spec": {"capacity": {"storage": size},
                     "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
                     "volumeMode": spec.get("volumeMode") or "Filesystem",
                     "persistentVolumeReclaimPolicy": "Delete",
                     "storageClassName": spec.get("storageClassName") or "",
                     "hostPath": {"path": str(directory), "type": "DirectoryOrCreate"},
                     "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                                  "namespace": meta["namespace"], "name": meta["name"],
                                  "uid": meta["uid"]}}}


def wants_provisioning(claim: dict) -> bool:
    spec, status = claim.get("spec") or {}, claim.get("status") or {}
    return (status.get("phase", "Pending") == "Pending" and not spec.get("volumeName")
            and not claim["metadata"].get("deletionTimestamp")
            and (spec.get("storageClassName") or "") in ("", STORAGE_CLASS))


def multi_attach_message(pv: str, users: list[str]) -> str:
    return (f'Multi-Attach error for volume "{pv}" Volume is already used by pod(s) '
            f"{', '.join(sorted(users))}")


def uses_claim(pod: dict, claim: str) -> bool:
    return any((v.get("persistentVolumeClaim") or {}).get("claimName") == claim
               for v in (pod.get("spec") or {}).get("volumes") or [])


class Claims:
    """The provisioner's thread and attaching claims for the simulator's pods (uses its core,
    api, work_dir, stopping and mount_timeout)."""

    def __init__(self, sim: Any) -> None:
        self.sim = sim
        self.root = Path(sim.work_dir) / "volumes"

    # -- provisioner
    def run(self) -> None:
        from kubernetes import watch

        core = self.sim.core
        while not self.sim.stopping.is_set():
            try:
                listing = core.list_persistent_volume_claim_for_all_namespaces()
                for claim in listing.items:
                    self._claim(self.sim.api.sanitize_for_serialization(claim), False)
                self._released()
                w = watch.Watch()
                for ev in w.stream(core.list_persistent_volume_claim_for_all_namespaces,
                                   resource_version=listing.metadata.resource_version,
                                   timeout_seconds=30):
                    if self.sim.stopping.is_set():
                        w.stop()
                        return
                    if ev["type"] == "ERROR":
                        break
                    self._claim(self.sim.api.sanitize_for_serialization(ev["object"]),
                                ev["type"] == "DELETED")
            except Exception as exc:  # 410 Gone, network: relist
                if not self.sim.stopping.is_set():
                    log.info("claims watch: %s; relisting", exc)
                    time.sleep(1)

    def _claim(self, claim: dict, deleted: bool) -> None:
        from kubernetes.client.exceptions import ApiException

        pv = f"pvc-{claim['metadata']['uid']}"
        if deleted:
            self._delete(pv)
            return
        if not wants_provisioning(claim):
            return
        directory = self.root / pv
        directory.mkdir(parents=True, exist_ok=True)
        try:
            self.sim.core.create_persistent_volume(persistent_volume(claim, directory))
            log.info("provisioned %s for claim %s/%s", pv, claim["metadata"]["namespace"],
                     claim["metadata"]["name"])
        except ApiException as exc:
            if exc.status != 409:  # 409: another simulator provisioned it
                log.warning("provision %s: %s", pv, exc.reason)

    def _released(self) -> None:
        for pv in self.sim.core.list_persistent_volume(label_selector=SIM_LABEL).items:
            if (pv.metadata.annotations or {}).get(PROVISIONED_BY) == PROVISIONER and (
                    pv.status.phase in ("Released", "Failed")):
                self._delete(pv.metadata.name)

    def _delete(self, name: str) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            pv = self.sim.core.read_persistent_volume(name)
        except ApiException:
            return
        if (pv.metadata.annotations or {}).get(PROVISIONED_BY) != PROVISIONER:
            return
        with contextlib.suppress(ApiException):
            self.sim.core.delete_persistent_volume(name)
        if pv.spec.host_path is not None:
            shutil.rmtree(pv.spec.host_path.path, ignore_errors=True)

    # -- attach and mount
    def mount(self, runner: PodRunner, volume: str, claim: str,
              stop: threading.Event) -> str | None:
        """Wait until the claim is bound and attachable to the runner's node; its host
        directory, or None when the pod stopped first."""
        ns, node = runner.meta["namespace"], runner.spec.get("nodeName", "")
        reported = False
        waiting_since = time.monotonic()
        while not stop.is_set():
            try:
                path, users, pv = self._try_attach(ns, claim, node)
            except Exception as exc:  # API trouble: wait and retry, as the kubelet does
                log.info("mount %s for %s: %s", claim, runner.key, exc)
                path, users, pv = None, [], ""
            if path is not None:
                Path(path).mkdir(parents=True, exist_ok=True)
                return path
            if users and not reported:
                reported = True
                events.record(self.sim.core, runner.pod, "FailedAttachVolume",
                              multi_attach_message(pv, users), warning=True,
                              component="attachdetach-controller")
            if time.monotonic() - waiting_since >= self.sim.mount_timeout:
                waiting_since = time.monotonic()
                unattached = f"[{volume}]" if users else "[]"
                events.record(self.sim.core, runner.pod, "FailedMount",
                              f"Unable to attach or mount volumes: unmounted volumes=[{volume}],"
                              f" unattached volumes={unattached}: timed out waiting for the "
                              "condition", warning=True, host=node)
            stop.wait(1.0)
        return None

    def _try_attach(self, ns: str, claim: str, node: str) -> tuple[str | None, list[str], str]:
        """(host path, [], pv) when attached here; (None, pods holding it elsewhere, pv) when
        not (no pods: the claim is not bound yet)."""
        from kubernetes.client.exceptions import ApiException

        core = self.sim.core
        pvc = core.read_namespaced_persistent_volume_claim(claim, ns)
        if not pvc.spec.volume_name or pvc.status.phase != "Bound":
            return None, [], ""
        pv = core.read_persistent_volume(pvc.spec.volume_name)
        source = pv.spec.host_path or pv.spec.local
        # a PV of another kind (NFS, CSI, ...): a directory of its own stands in for it
        path = source.path if source is not None else str(self.root / pv.metadata.name)
        if set(pv.spec.access_modes or []) & set(MULTI_ATTACH):
            return path, [], pv.metadata.name
        holder = (pv.metadata.annotations or {}).get(ATTACHED)
        if holder and holder != node:
            users = self._users(ns, claim, holder)
            if users:
                return None, users, pv.metadata.name
        if holder != node:
            body = {"metadata": {"annotations": {ATTACHED: node},
                                 "resourceVersion": pv.metadata.resource_version}}
            try:
                core.patch_persistent_volume(pv.metadata.name, body)
            except ApiException as exc:
                if exc.status == 409:  # another node attached it first: look again
                    return None, [], pv.metadata.name
                raise
        return path, [], pv.metadata.name

    def _users(self, ns: str, claim: str, node: str) -> list[str]:
        """Pods bound to `node` that use the claim and have not finished."""
        pods = self.sim.core.list_namespaced_pod(ns, field_selector=f"spec.nodeName={node}")
        return [p.metadata.name for p in pods.items
                if p.status.phase not in ("Succeeded", "Failed")
                and uses_claim(self.sim.api.sanitize_for_serialization(p), claim)]
