"""Drift is a change of what the operator writes, undone by its apply: a field another writer
keeps (the deployment controller's revision annotation) changing between the reconciler's
read and its apply is not drift, and says nothing; a user's edit of a field the operator writes
is restored and said."""

from __future__ import annotations

import copy

from vlm_operator.reconcile.reconciler import Reconciler

from ..fakes import NAMESPACE, ChildStore

REVISION = "deployment.kubernetes.io/revision"


class OtherWriterBetween(ChildStore):
    """Every child read back as applied; `between(obj)` is another writer's change that lands
    after the reconciler's read and before its apply (the apiserver merges it into what the
    apply returns)."""

    def __init__(self, between) -> None:
        super().__init__(pools_served=False)
        self.between = between

    def get(self, api_version, kind, namespace, name):
        self.calls.append(("get", kind, namespace, name))
        return copy.deepcopy(self.children.get((kind, name)))

    def apply(self, obj):
        after = copy.deepcopy(obj)
        stored = self.children.get((obj["kind"], obj["metadata"]["name"]))
        if stored is not None:
            self.between(stored)
            merged = {**stored["metadata"].get("annotations", {}),
                      **obj["metadata"].get("annotations", {})}
            if merged:
                after["metadata"]["annotations"] = merged
        self.calls.append(("apply", obj["kind"], obj["metadata"]["name"]))
        self.children[(obj["kind"], obj["metadata"]["name"])] = after
        return copy.deepcopy(after)


def events(kube: ChildStore) -> list[str]:
    return [c[3] for c in kube.calls if c[0] == "post_event"]


def two_passes(kube: ChildStore, edit=lambda children: None, **spec) -> list[str]:
    """The first look (children created), `edit` of the children, then a pass on a child's
    change; the Events of the second."""
    body = kube.add_vlmd(NAMESPACE, "vl", replicas=1, **spec)
    body["metadata"]["generation"] = 1
    reconciler = Reconciler(kube, inference_pools=False)
    reconciler.reconcile(NAMESPACE, "vl")
    assert "Created" in events(kube)
    edit(kube.children)
    kube.calls.clear()
    reconciler.reconcile(NAMESPACE, "vl")
    return events(kube)


def revision(deployment: dict) -> None:
    if deployment["kind"] == "Deployment":
        deployment["metadata"].setdefault("annotations", {})[REVISION] = "1"


def test_the_deployment_controllers_revision_landing_between_read_and_apply_is_no_drift():
    assert "DriftRestored" not in two_passes(OtherWriterBetween(revision))


def test_a_users_edit_of_what_the_operator_writes_is_restored_and_said():
    def user_edits(children: dict) -> None:
        children[("Deployment", "vl")]["spec"]["replicas"] = 5

    said = two_passes(OtherWriterBetween(revision), user_edits)
    assert said.count("DriftRestored") == 1, said


def test_nothing_changed_says_nothing():
    assert two_passes(OtherWriterBetween(lambda _: None)) == []
