"""remediation/execute.py: a decided plan's action started, over the shared fake Kube, with a
Remediator (not started) as the narrow context it is handed in the operator."""

from __future__ import annotations

import json

import pytest

from vlm_operator.api.actions import Action, UnknownAction
from vlm_operator.desired import children
from vlm_operator.remediation.decide import Reason, RemediationPlan
from vlm_operator.remediation.execute import execute
from vlm_operator.remediation.incidents import IN_FLIGHT
from vlm_operator.remediation.intake import Case
from vlm_operator.remediation.remediator import Remediator

from ..fakes import FakeKube
from .test_remediator import NS, storm


def case_of(kube: FakeKube, rem: Remediator, replicas: int = 2) -> Case:
    body = kube.add_vlmd(NS, "vd", replicas=replicas)
    pods = [kube.add_pod(NS, n, owner="vd") for n in ("a", "b")[:replicas]]
    return Case(NS, "vd", rem.owner(NS, "vd"), body, pods, pods[0], storm("uid-a", "a"))


@pytest.fixture
def rem_kube():
    kube = FakeKube()
    rem = Remediator(kube, lambda ns, name: None)
    rem.stop()  # no worker thread: the record stays as started
    return rem, kube


def test_an_action_without_a_start_raises_before_anything_is_written(rem_kube):
    """Ignore is never planned; were it (or a member added without its start here), dispatch
    raises naming the pod, and neither a record, an Event nor a restart happened."""
    rem, kube = rem_kube
    case = case_of(kube, rem)
    restarted = []
    plan = RemediationPlan(Action.IGNORE, Reason.ACT, "ignore it", "a", "uid-a")
    with pytest.raises(UnknownAction, match="the plan for a: unknown action 'Ignore'"):
        execute(rem, lambda c, p: restarted.append(p), case, plan)
    assert not kube.writes() and not restarted


def test_a_restart_goes_to_the_recovery_alone(rem_kube):
    rem, kube = rem_kube
    case = case_of(kube, rem)
    restarted = []
    plan = RemediationPlan(Action.RESTART, Reason.ACT, "restart it", "a", "uid-a")
    execute(rem, lambda c, p: restarted.append((c, p)), case, plan)
    assert restarted == [(case, plan)] and not kube.writes()


@pytest.mark.parametrize(("action", "reason", "out_of_service"), [
    (Action.REPLACE, "PodReplacing", False), (Action.SCALE_DOWN, "ScaleDownStarted", True)])
def test_a_multi_step_action_is_recorded_before_its_pod_is_touched_or_told(
        rem_kube, action, reason, out_of_service):
    rem, kube = rem_kube
    case = case_of(kube, rem)
    execute(rem, lambda c, p: pytest.fail("not a Restart"), case,
            RemediationPlan(action, Reason.ACT, "the storm", "a", "uid-a"))
    writes = kube.writes()
    assert writes[0][0] == "patch_vlmd_annotations"
    record = json.loads(writes[0][3][IN_FLIGHT])["uid-a"]
    assert record["action"] == action and record["replicas"] == 2
    assert ("before" in record) == (action == Action.REPLACE)  # the pods before its surge
    labelled = [c for c in writes if c[0] == "patch_pod"]
    assert bool(labelled) == out_of_service
    if out_of_service:
        assert labelled[0][3] == {children.IN_SERVICE_LABEL: "false"}
    told = [m for _, r, m in kube.messages if r == reason]
    assert told and told[0].startswith("the storm; ")
    assert "uid-a" in rem.owner(NS, "vd").in_flight
