"""k8s/views.py: typed read-only views over the API's dicts, read as they are."""

from __future__ import annotations

import dataclasses

import pytest

from vlm_operator.api.names import CONTAINER
from vlm_operator.k8s.views import Body, Pod

POD = {
    "metadata": {"name": "p0", "namespace": "ns", "uid": "u0", "resourceVersion": "7",
                 "generation": 2, "labels": {"a": "b"}, "annotations": {"c": "d"},
                 "ownerReferences": [{"kind": "ReplicaSet", "name": "rs", "controller": True}],
                 "creationTimestamp": "2026-01-01T00:00:00Z"},
    "spec": {"nodeName": "n1"},
    "status": {"phase": "Running", "podIP": "10.0.0.5",
               "conditions": [{"type": "Ready", "status": "True"}],
               "containerStatuses": [
                   {"name": "sidecar", "restartCount": 9, "state": {"waiting": {}}},
                   {"name": CONTAINER, "restartCount": 2, "state": {"running": {}}}]},
}


def test_a_pod_reads_as_the_dict_says():
    pod = Pod(POD)
    assert (pod.name, pod.namespace, pod.uid, pod.key) == ("p0", "ns", "u0", ("ns", "p0"))
    assert (pod.resource_version, pod.generation) == ("7", 2)
    assert pod.labels == {"a": "b"} and pod.annotations == {"c": "d"}
    assert pod.owner_references[0]["name"] == "rs"
    assert pod.created_at == 1767225600.0 and pod.deleted_at is None and not pod.deleting
    assert (pod.node_name, pod.pod_ip, pod.phase) == ("n1", "10.0.0.5", "Running")
    assert pod.ready and not pod.not_ready and pod.active
    assert pod.container["restartCount"] == 2 and pod.restart_count == 2 and pod.running


def test_a_view_copies_nothing_and_cannot_be_changed():
    raw = {"metadata": {"labels": {"a": "b"}}}
    pod = Pod(raw)
    assert pod.raw is raw and pod.labels is raw["metadata"]["labels"]
    raw["metadata"]["labels"]["x"] = "y"  # the dict's own change shows through
    assert pod.labels["x"] == "y"
    with pytest.raises(dataclasses.FrozenInstanceError):
        pod.raw = {}  # type: ignore[misc]
    with pytest.raises(TypeError):
        Pod({}).labels["a"] = "b"  # type: ignore[index]  # the empty default is read-only


def test_missing_fields_read_as_empty():
    pod = Pod({})
    assert (pod.name, pod.namespace, pod.uid, pod.generation) == ("", "", None, None)
    assert not pod.labels and not pod.annotations and pod.owner_references == []
    assert pod.created_at is None and not pod.deleting
    assert (pod.node_name, pod.pod_ip, pod.phase) == (None, None, None)
    assert not pod.ready and not pod.not_ready and pod.active
    assert pod.container == {} and pod.restart_count == 0 and not pod.running
    assert Pod({"status": {"podIP": ""}}).pod_ip is None


def test_readiness_and_activity_of_a_pod_being_deleted_or_finished():
    going = {**POD, "metadata": {**POD["metadata"],
                                 "deletionTimestamp": "2026-01-01T00:00:30Z"}}
    assert Pod(going).deleting and Pod(going).deleted_at == 1767225630.0
    assert not Pod(going).ready and not Pod(going).active
    failing = {**going, "status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    assert not Pod(failing).not_ready  # going away: no verdict on it
    assert Pod({**failing, "metadata": {}}).not_ready
    for phase in ("Succeeded", "Failed"):
        assert not Pod({"status": {"phase": phase}}).active


def test_how_long_the_scheduler_refused_a_pod():
    refused = {"status": {"conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "lastTransitionTime": "2026-01-01T00:00:00Z"}]}}
    assert Pod(refused).unschedulable_s(1767225610.0) == 10.0
    assert Pod(refused).unschedulable_s(1767225500.0) == 0.0  # the clock behind: never negative
    assert Pod(POD).unschedulable_s(1767225610.0) == 0.0


def test_a_body_reads_any_object():
    vlmd = {"metadata": {"name": "m", "namespace": "ns", "annotations": {"k": "v"}},
            "spec": {"replicas": 2}, "status": {"phase": "Ready"}}
    body = Body(vlmd)
    assert body.key == ("ns", "m") and body.annotations == {"k": "v"}
    assert body.spec["replicas"] == 2 and body.status["phase"] == "Ready"
    assert Body({}).spec == {} and Body({}).status == {}
