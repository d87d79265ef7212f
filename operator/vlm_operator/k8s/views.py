"""Typed read-only views of the objects the operator reads most, in the style of kopf's bodies:
a view wraps the API's dict as it is (no copy, nothing rewritten) and names what is read of it,
so a reader writes `Pod(pod).uid` where it wrote `pod["metadata"]["uid"]`. A missing field
reads as empty (None, "", {} or 0), never as a KeyError. No API calls."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from vlm_operator.api.names import CONTAINER
from vlm_operator.k8s.pods import parse_time, ready_condition

_EMPTY: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Body:
    """Any object's metadata, spec and status (a VLMDeployment's body as kopf hands it, a
    Deployment, a Node)."""

    raw: Mapping[str, Any]

    @property
    def metadata(self) -> Mapping[str, Any]:
        return self.raw.get("metadata") or _EMPTY

    @property
    def spec(self) -> Mapping[str, Any]:
        return self.raw.get("spec") or _EMPTY

    @property
    def status(self) -> Mapping[str, Any]:
        return self.raw.get("status") or _EMPTY

    @property
    def name(self) -> str:
        return self.metadata.get("name") or ""

    @property
    def namespace(self) -> str:
        return self.metadata.get("namespace") or ""

    @property
    def key(self) -> tuple[str, str]:
        """(namespace, name): how the operator's per-object state is keyed."""
        return self.namespace, self.name

    @property
    def uid(self) -> str | None:
        return self.metadata.get("uid")

    @property
    def resource_version(self) -> str | None:
        return self.metadata.get("resourceVersion")

    @property
    def generation(self) -> int | None:
        return self.metadata.get("generation")

    @property
    def labels(self) -> Mapping[str, str]:
        return self.metadata.get("labels") or _EMPTY

    @property
    def annotations(self) -> Mapping[str, str]:
        return self.metadata.get("annotations") or _EMPTY

    @property
    def owner_references(self) -> list[Mapping[str, Any]]:
        return self.metadata.get("ownerReferences") or []

    @property
    def created_at(self) -> float | None:
        """metadata.creationTimestamp as epoch seconds; None when absent or unreadable."""
        return parse_time(self.metadata.get("creationTimestamp"))

    @property
    def deleted_at(self) -> float | None:
        """metadata.deletionTimestamp (when the grace period ends) as epoch seconds; None when
        it is not being deleted."""
        return parse_time(self.metadata.get("deletionTimestamp"))

    @property
    def deleting(self) -> bool:
        """It has a deletionTimestamp: the API server is removing it."""
        return bool(self.metadata.get("deletionTimestamp"))


@dataclass(frozen=True, slots=True)
class Pod(Body):
    """A pod: where it runs, the kubelet's view of it and of its vllm container."""

    @property
    def node_name(self) -> str | None:
        return self.spec.get("nodeName")

    @property
    def pod_ip(self) -> str | None:
        return self.status.get("podIP") or None

    @property
    def phase(self) -> str | None:
        return self.status.get("phase")

    @property
    def ready(self) -> bool:
        """The kubelet's view: the Ready condition is True (the readiness probe passes), for a
        pod not being deleted."""
        return not self.deleting and ready_condition(self.raw).get("status") == "True"

    @property
    def not_ready(self) -> bool:
        """The kubelet's view: the Ready condition is False (the readiness probe fails), for a
        pod not being deleted."""
        return not self.deleting and ready_condition(self.raw).get("status") == "False"

    @property
    def active(self) -> bool:
        """What a ReplicaSet counts in status.replicas and keeps spec.replicas of: a pod not
        being deleted and not finished (phase Succeeded or Failed)."""
        return not self.deleting and self.phase not in ("Succeeded", "Failed")

    @property
    def container(self) -> Mapping[str, Any]:
        """The status of the vllm container; {} before it has one."""
        return next((c for c in self.status.get("containerStatuses") or []
                     if c.get("name") == CONTAINER), _EMPTY)

    @property
    def restart_count(self) -> int:
        return int(self.container.get("restartCount") or 0)

    @property
    def running(self) -> bool:
        """The vllm container is running."""
        return "running" in (self.container.get("state") or _EMPTY)

    def unschedulable_s(self, now: float) -> float:
        """How long the scheduler has refused this pod (0: it has not)."""
        for cond in self.status.get("conditions") or []:
            if (cond.get("type") == "PodScheduled" and cond.get("status") == "False"
                    and cond.get("reason") == "Unschedulable"):
                since = parse_time(cond.get("lastTransitionTime"))
                if since is not None:
                    return max(0.0, now - since)
        return 0.0
