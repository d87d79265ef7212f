"""Status and Events, decided from spec validity, the Deployment and the pods."""

from vlm_operator.api import crd
from vlm_operator.api.validation import parse
from vlm_operator.reconcile import status

T0, T1 = "2026-11-29T08:00:00Z", "2026-11-29T09:00:00Z"


def vlmd(**spec):
    return parse({"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                  "metadata": {"name": "demo", "namespace": "ml"},
                  "spec": {"model": "m", "vllmVersion": "0.20.2", **spec}})


def deployment(replicas=2, ready=2, updated=2, current=2, generation=3, observed=3,
               progress_reason="NewReplicaSetAvailable"):
    return {"metadata": {"name": "demo", "generation": generation},
            "spec": {"replicas": replicas},
            "status": {"replicas": current, "readyReplicas": ready, "updatedReplicas": updated,
                       "observedGeneration": observed,
                       "conditions": [{"type": "Progressing", "reason": progress_reason,
                                       "message": "deadline"}]}}


def pod(name, waiting=None):
    state = {"waiting": {"reason": waiting}} if waiting else {"running": {}}
    return {"metadata": {"name": name}, "status": {"containerStatuses": [{"state": state}]}}


def get(old=None, obj=None, problems=(), dep=None, pods=(), now=T0, generation=4, reports=(),
        surge=0):
    return status.get_status(name="demo", generation=generation, old=old, vlmd=obj,
                             problems=list(problems), deployment=dep, pods=list(pods), now=now,
                             reports=list(reports), surge=surge)


def cond(st, type_):
    return status.get_condition(st, type_)


def test_all_ready():
    st = get(obj=vlmd(rendererNumWorkers=4), dep=deployment())
    assert st["replicas"] == 2 and st["readyReplicas"] == 2
    assert st["tokenizerPoolSize"] == 5
    assert st["vllmVersion"] == "0.20.2"
    assert st["observedGeneration"] == 4
    assert st["selector"] == ("app.kubernetes.io/name=vllm,app.kubernetes.io/instance=demo,"
                              "app.kubernetes.io/component=engine,"
                              "app.kubernetes.io/managed-by=vlm-operator")
    assert cond(st, "Ready")["status"] == "True"
    assert cond(st, "Ready")["reason"] == "AllReplicasReady"
    assert cond(st, "Progressing")["reason"] == "RolloutComplete"
    assert cond(st, "Degraded")["status"] == "False"
    assert cond(st, "SpecValid")["status"] == "True"


def test_rolling_out():
    st = get(obj=vlmd(), dep=deployment(ready=1, updated=1))
    assert cond(st, "Ready")["status"] == "False"
    assert cond(st, "Ready")["message"] == "1/2 replicas ready"
    assert cond(st, "Progressing")["status"] == "True"
    assert cond(st, "Progressing")["reason"] == "RollingOut"


def test_rollout_not_observed_yet_is_progressing():
    st = get(obj=vlmd(), dep=deployment(generation=4, observed=3))
    assert cond(st, "Progressing")["status"] == "True"


def test_progress_deadline_exceeded_degrades():
    st = get(obj=vlmd(), dep=deployment(ready=0, progress_reason="ProgressDeadlineExceeded"))
    assert cond(st, "Progressing")["reason"] == "ProgressDeadlineExceeded"
    assert cond(st, "Degraded")["status"] == "True"


def test_crash_loop_degrades_and_names_pods():
    st = get(obj=vlmd(), dep=deployment(ready=1),
             pods=[pod("b", "CrashLoopBackOff"), pod("a"), pod("c", "CrashLoopBackOff")])
    degraded = cond(st, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "CrashLoopBackOff"
    assert degraded["message"] == "pods crash-looping: b, c"


def test_no_deployment_yet():
    st = get(obj=vlmd(), dep=None)
    assert cond(st, "Ready")["reason"] == "NoDeployment"
    assert cond(st, "Progressing")["status"] == "True"
    assert st["replicas"] == 0


def test_scaled_to_zero():
    st = get(obj=vlmd(), dep=deployment(replicas=0, ready=0, updated=0, current=0))
    assert cond(st, "Ready")["reason"] == "ScaledToZero"


def test_invalid_spec_keeps_reporting_existing_children():
    st = get(obj=None, problems=["spec.replicas: bad"], dep=deployment())
    spec_valid = cond(st, "SpecValid")
    assert spec_valid["status"] == "False"
    assert spec_valid["reason"] == "InvalidSpec"
    assert spec_valid["message"] == "spec.replicas: bad"
    assert cond(st, "Ready")["status"] == "True"
    assert "tokenizerPoolSize" not in st


def test_transition_time_moves_only_on_flips():
    first = get(obj=vlmd(), dep=deployment(ready=1), now=T0)
    same = get(old=first, obj=vlmd(), dep=deployment(ready=1), now=T1)
    assert cond(same, "Ready")["lastTransitionTime"] == T0
    flipped = get(old=same, obj=vlmd(), dep=deployment(), now=T1)
    assert cond(flipped, "Ready")["lastTransitionTime"] == T1
    assert cond(flipped, "SpecValid")["lastTransitionTime"] == T0


def test_events_on_transitions_only():
    invalid = get(obj=None, problems=["spec.x: bad"], dep=None)
    events = status.get_events({}, invalid)
    assert status.Event("Warning", "InvalidSpec", "spec.x: bad") in events
    assert status.get_events(invalid, get(old=invalid, obj=None, problems=["spec.x: bad"])) == []
    ready = get(old=invalid, obj=vlmd(), dep=deployment())
    events = status.get_events(invalid, ready)
    reasons = {e.reason for e in events}
    assert {"AllReplicasReady", "SpecFixed", "RolloutComplete"} <= reasons
    assert status.get_events(ready, get(old=ready, obj=vlmd(), dep=deployment())) == []
    crashing = get(old=ready, obj=vlmd(), dep=deployment(), pods=[pod("p", "CrashLoopBackOff")])
    assert status.Event("Warning", "CrashLoopBackOff", "pods crash-looping: p") in \
        status.get_events(ready, crashing)


def test_reports_from_other_parts():
    reports = [status.Report("Degraded", "True", "RestartBudgetExhausted", "6 restarts in 1h"),
               status.Report("ScalingLimited", "True", "InsufficientGPUs", "wanted 4, got 2")]
    builtin = vlmd(autoscaling={"enabled": True, "maxReplicas": 4})
    st = get(obj=builtin, dep=deployment(), reports=reports)
    assert cond(st, "Degraded")["reason"] == "RestartBudgetExhausted"
    assert cond(st, "ScalingLimited")["message"] == "wanted 4, got 2"
    assert cond(st, "ScalingLimited")["observedGeneration"] == 4
    crashing = get(obj=vlmd(), dep=deployment(), pods=[pod("p", "CrashLoopBackOff")],
                   reports=reports)
    assert cond(crashing, "Degraded")["reason"] == "CrashLoopBackOff"
    fine = get(obj=vlmd(), dep=deployment(),
               reports=[status.Report("Degraded", "False", "X", "y")])
    assert cond(fine, "Degraded")["reason"] == "AsExpected"


def test_conditions_of_a_feature_turned_off_are_dropped():
    """Defect: ScalingLimited / AutoscalerReady stayed with an old observedGeneration after
    autoscaling was turned off (their providers simply go quiet)."""
    reports = [status.Report("ScalingLimited", "True", "InsufficientGPUs", "wanted 4, got 2")]
    on = get(obj=vlmd(autoscaling={"enabled": True}), dep=deployment(), reports=reports)
    assert cond(on, "ScalingLimited")
    off = get(old=on, obj=vlmd(autoscaling={"enabled": False}), dep=deployment(),
              generation=5)
    assert cond(off, "ScalingLimited") is None
    keda = get(old=on, obj=vlmd(autoscaling={"enabled": True, "mode": "KEDA", "prometheus": {
        "serverAddress": "http://prom:9090"}}),
               dep=deployment(), reports=[status.Report("AutoscalerReady", "True", "x", "y")])
    assert cond(keda, "ScalingLimited") is None and cond(keda, "AutoscalerReady")
    # an invalid spec says nothing about features: conditions stay as they were
    assert cond(get(old=on, obj=None, problems=["bad"], dep=deployment()), "ScalingLimited")


def test_a_failed_apply_is_degraded_with_the_reason_and_an_event():
    failed = status.Report("Degraded", "True", "ApplyFailed",
                           "HorizontalPodAutoscaler demo: 403 Forbidden: no")
    st = get(old=get(obj=vlmd(), dep=deployment()), obj=vlmd(), dep=deployment(),
             pods=[pod("p", "CrashLoopBackOff")], reports=[failed])
    assert cond(st, "Degraded")["reason"] == "ApplyFailed"  # before crash loops: it is why
    assert cond(st, "Degraded")["message"].startswith("HorizontalPodAutoscaler demo: 403")
    ready = get(obj=vlmd(), dep=deployment())
    assert status.Event("Warning", "ApplyFailed", failed.message) in status.get_events(ready, st)


def test_a_surge_replacement_adds_no_requirement():
    during = get(obj=vlmd(), dep=deployment(replicas=2, ready=1, current=2), surge=1)
    assert cond(during, "Ready")["status"] == "True"
    assert cond(during, "Ready")["message"] == "1/1 replicas ready"
    assert cond(get(obj=vlmd(), dep=deployment(replicas=2, ready=1, current=2)),
                "Ready")["status"] == "False"


def test_invalid_spec_gives_one_warning_only():
    invalid = get(obj=None, problems=["spec.x: bad"], dep=None)
    assert [e for e in status.get_events({}, invalid) if e.reason == "InvalidSpec"] == [
        status.Event("Warning", "InvalidSpec", "spec.x: bad")]
    stuck = get(obj=vlmd(), dep=deployment(ready=0, progress_reason="ProgressDeadlineExceeded"))
    assert status.Event("Warning", "ProgressDeadlineExceeded", "deadline") in \
        status.get_events({}, stuck)
