"""Builtin autoscaling decisions, the GPU budget, victims, and the HPA/KEDA children."""

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vlm_operator.api.validation import parse
from vlm_operator.autoscaling import recommend as a
from vlm_operator.desired import autoscaler_objects as ab
from vlm_operator.desired import children
from vlm_operator.k8s import gpu_plan
from vlm_operator.k8s import nodes as gpu_budget

POLICY = a.ScalingPolicy(min_replicas=1, max_replicas=8, target=5, scale_down_delay_s=60,
                         multimodal_weight=1.0)


def pods(*waiting, state=a.READY, kv=0.0, ipr=0.0):
    return [a.PodSample(f"p{i}", state=state, metric=w, usage=(kv,), images_per_request=ipr,
                        busy=w) for i, w in enumerate(waiting)]


def run(trace, current=1, policy=POLICY, step=1.0, start=0.0):
    """Feed (pods) per second; apply every decision at once. Returns (replicas, decisions)."""
    history, out = (), []
    for i, sample in enumerate(trace):
        d = a.decide(a.ScalingRequest(sample, current, history, start + i * step, policy))
        history = d.history
        out.append(d)
        current = d.desired
    return current, out


# ---------------------------------------------------------------- load and need

def test_need_is_weighted_metric_over_target_or_kv_pressure():
    assert a.load_need(pods(10, 0), POLICY) == 2.0
    assert a.load_need(pods(5, ipr=2.0), POLICY) == 3.0  # 1 + 1.0 * 2 images per request
    assert a.load_need(pods(0, 0, kv=0.8), POLICY) == 2.0  # busy without a queue
    assert a.load_need(pods(1, state=a.LOADING), POLICY) is None


@pytest.mark.parametrize("prev,cur,last,expected", [
    (None, (10, 5), 0.3, 0.3),  # first scrape: keep what we knew
    ((10, 5), (20, 25), 0.0, 2.0),  # 10 requests, 20 images
    ((10, 5), (10, 5), 1.5, 1.5),  # nothing finished
    ((10, 5), (2, 1), 1.5, 1.5),  # counters reset (pod restarted)
])
def test_images_per_request(prev, cur, last, expected):
    assert a.images_per_request(prev, cur, last) == expected


def test_multimodal_load_scales_further_than_the_same_text_load():
    text, _ = run([pods(10)] * 5)
    images, _ = run([pods(10, ipr=1.0)] * 5)
    assert (text, images) == (2, 4)


# ---------------------------------------------------------------- decisions

def test_load_step_scales_up_within_three_rounds():
    current, ds = run([pods(0)] * 10 + [pods(20)] * 4)
    assert [d.desired for d in ds[-4:]] == [1, 1, 4, 4]
    assert ds[-2].reason == "ScaleUp" and current == 4


def test_single_spike_does_not_scale_up():
    current, ds = run([pods(0)] * 10 + [pods(40)] + [pods(0)] * 10)
    assert current == 1 and {d.reason for d in ds} == {"WithinTarget"}


def test_scale_down_waits_for_the_delay_then_goes_to_what_the_peak_needs():
    loaded = [pods(10, 10, 10, 10)] * 5  # need 8 -> 8 replicas
    idle = [pods(1, 1, 1, 1)] * 120  # need 0.8
    current, ds = run(loaded + idle, current=4)
    reasons = [d.reason for d in ds]
    assert ds[4].desired == 8
    first_down = reasons.index("ScaleDown")
    assert first_down >= 5 + 60  # not before scaleDownDelaySeconds of low load
    assert "ScaleDownDelayed" in reasons[5:first_down]
    assert ds[first_down].desired < 8
    assert current == 1


def test_zero_delay_scales_down_at_once():
    policy = a.ScalingPolicy(min_replicas=1, max_replicas=8, target=5, scale_down_delay_s=0)
    current, _ = run([pods(0, 0, 0)] * 2, current=3, policy=policy)
    assert current == 1


def test_no_scale_down_right_after_operator_start():
    current, ds = run([pods(0, 0, 0)] * 30, current=3)  # 30 s observed < 60 s delay
    assert current == 3 and ds[-1].reason == "ScaleDownDelayed"


@pytest.mark.parametrize("seed", range(5))
def test_steady_noisy_load_changes_replicas_only_at_the_start(seed):
    rng = random.Random(seed)
    trace = [pods(*(max(0.0, rng.gauss(4, 2)) for _ in range(3))) for _ in range(600)]
    _, ds = run(trace, current=3, policy=a.ScalingPolicy(1, 10, 5, 300))
    changes = [i for i in range(1, len(ds)) if ds[i].desired != ds[i - 1].desired]
    assert all(i < 60 for i in changes), changes


def test_bounds():
    policy = a.ScalingPolicy(min_replicas=2, max_replicas=3, target=5, scale_down_delay_s=0)
    assert a.decide(a.ScalingRequest(pods(0), 1, (), 0, policy)).reason == "BelowMinReplicas"
    assert a.decide(a.ScalingRequest(pods(0), 1, (), 0, policy)).desired == 2
    assert a.decide(a.ScalingRequest(pods(0), 5, (), 0, policy)).desired == 3
    _, ds = run([pods(100, 100, 100)] * 3, current=3, policy=policy)
    assert (ds[-1].desired, ds[-1].reason) == (3, "AtMaxReplicas")
    one_round = a.decide(a.ScalingRequest(pods(100, 100), 2, (), 0, policy))
    assert one_round.reason == "WithinTarget"
    _, ds = run([pods(100, 100)] * 3, current=2, policy=policy)
    assert max(d.desired for d in ds) == 3
    _, ds = run([pods(0, 0, 0)] * 3, current=3, policy=policy)
    assert min(d.desired for d in ds) == 2


def test_loading_pods_count_as_capacity_on_the_way():
    # 4 replicas asked for: 1 ready with need 4, 3 still loading -> no further scale-up
    sample = pods(20) + pods(0, 0, 0, state=a.LOADING)
    current, ds = run([sample] * 20, current=4)
    assert current == 4 and {d.reason for d in ds} == {"WithinTarget"}


def test_no_ready_pod_holds():
    d = a.decide(a.ScalingRequest(pods(0, state=a.LOADING), 2, (), 0, POLICY))
    assert (d.desired, d.reason, d.need) == (2, "NoMetrics", None)


def test_one_frozen_request_in_one_recommendation_with_a_closed_reason_out():
    samples = pods(20, 20)
    request = a.ScalingRequest(samples, 2, (), 0.0, POLICY)
    samples.append(a.PodSample("late"))  # the request keeps what it was given
    assert request.pods == tuple(pods(20, 20))
    with pytest.raises(AttributeError):
        request.current = 3  # type: ignore[misc]
    first = a.decide(request)
    assert a.decide(request) == first  # stateless: the same request, the same answer
    assert isinstance(first.reason, a.ScalingReason)
    _, ds = run([pods(0)] * 10 + [pods(40, 40)] * 70 + [pods(0)] * 200, current=2)
    assert {d.reason for d in ds} <= set(a.ScalingReason)
    assert f"{a.ScalingReason.SCALE_UP}" == "ScaleUp"  # status.autoscaling and metric labels


def test_history_is_trimmed():
    _, ds = run([pods(0)] * 500, policy=a.ScalingPolicy(1, 2, 5, 60))
    assert len(ds[-1].history) <= a.keep_seconds(a.ScalingPolicy(1, 2, 5, 60)) + 1


# ---------------------------------------------------------------- GPU budget

GPU = "nvidia.com/gpu"
MIG = "nvidia.com/mig-1g.10gb"


def node(name, gpus=0, ready=True, unschedulable=False, labels=None, taints=(), **extra):
    return {"metadata": {"name": name, "labels": labels or {}},
            "spec": {"unschedulable": unschedulable, "taints": list(taints)},
            "status": {"allocatable": {GPU: str(gpus), "cpu": "16", "memory": "64Gi",
                                       **extra},
                       "conditions": [{"type": "Ready", "status": str(ready)}]}}


def pod(node_name, gpus, phase="Running", resource=GPU, init=0):
    spec = {"nodeName": node_name, "containers": [
        {"resources": {"requests": {resource: str(gpus), "cpu": "1"}}}, {"resources": {}}]}
    if init:
        spec["initContainers"] = [{"resources": {"limits": {resource: str(init)}}}]
    return {"spec": spec, "status": {"phase": phase}}


def budget(nodes, pods_=()):
    views = [v for v in map(gpu_budget.node_of, nodes) if v is not None]
    uses = [u for u in map(gpu_budget.pod_use, pods_) if u is not None]
    return views, gpu_budget.free_by_node(views, uses)


def test_free_by_node_counts_bound_running_pods_per_node():
    nodes, free = budget(
        [node("a", 4), node("b", 8, ready=False), node("c", 2, unschedulable=True),
         node("d", 2, **{MIG: "7"})],
        [pod("a", 1), pod("a", 2), pod("b", 8), pod(None, 4), pod("a", 1, "Succeeded"),
         pod("d", 2, resource=MIG), pod("d", 0, init=1), pod("gone", 3)])
    assert [n.name for n in nodes] == ["a", "d"]  # not Ready and cordoned nodes take nothing
    assert free == {"a": {GPU: 1}, "d": {GPU: 1, MIG: 5}}  # cpu/memory are not counted
    assert gpu_budget.pod_use(pod("a", 0)) is None  # holds no device: not worth keeping


def test_leaving_nodes_are_cordoned_or_tainted_by_an_autoscaler():
    assert gpu_budget.leaving(node("a", 1)) is None
    cordoned = gpu_budget.leaving(node("a", 1, unschedulable=True))
    assert "kubectl cordon" in cordoned.why and not cordoned.drain  # stops new pods only
    for key in ("ToBeDeletedByClusterAutoscaler", "karpenter.sh/disrupted",
                "karpenter.sh/disruption"):
        taint = {"key": key, "value": "x", "effect": "NoSchedule"}
        for unschedulable in (False, True):
            seen = gpu_budget.leaving(node("a", 1, unschedulable=unschedulable, taints=[taint]))
            assert key in seen.why and seen.drain
    assert gpu_budget.leaving(node("a", 1, taints=[{"key": "nvidia.com/gpu",
                                           "effect": "NoSchedule"}])) is None
    # the node cache keeps a leaving node out of the budget, with why it leaves
    state = gpu_budget.node_state(node("a", 1, unschedulable=True))
    assert state.name == "a" and state.budget is None and "cordoned" in state.leaving.why
    assert gpu_budget.node_state(node("b", 1)).budget.name == "b" and gpu_budget.node_state(
        node("b", 1)).leaving is None
    assert gpu_budget.node_state(node("c", 1, ready=False)) is None  # neither


UNSCHEDULABLE = {"key": gpu_budget.UNSCHEDULABLE_TAINT, "effect": "NoSchedule"}


@pytest.mark.parametrize("markers,kw,drain", [
    ("", {"unschedulable": True}, False),
    ("", {"taints": [UNSCHEDULABLE]}, False),  # the cordon's own taint is a cordon
    ("medik8s.io/drain", {"unschedulable": True,
                          "taints": [{"key": "medik8s.io/drain", "effect": "NoSchedule"}]}, True),
    ("example.com/maintenance", {"unschedulable": True,
                                 "labels": {"example.com/maintenance": "x"}}, True),
    ("example.com/maintenance=drain", {"unschedulable": True,
                                       "labels": {"example.com/maintenance": "x"}}, False),
    ("example.com/maintenance=drain", {"unschedulable": True,
                                       "labels": {"example.com/maintenance": "drain"}}, True),
    # naming the cordon's taint makes every cordon a drain, seen by either field
    (gpu_budget.UNSCHEDULABLE_TAINT, {"unschedulable": True}, True),
    (gpu_budget.UNSCHEDULABLE_TAINT, {"taints": [UNSCHEDULABLE]}, True),
])
def test_a_drain_is_told_from_a_cordon_by_its_markers(markers, kw, drain):
    seen = gpu_budget.leaving(node("a", 1, **kw), gpu_budget.parse_markers(markers))
    assert seen.drain is drain, seen
    assert gpu_budget.node_state(node("a", 1, **kw),
                                 gpu_budget.parse_markers(markers)).leaving == seen


def test_a_marker_on_a_node_not_cordoned_is_a_drain_too():
    markers = gpu_budget.parse_markers(" example.com/maintenance , ")
    assert markers == (gpu_budget.Marker("example.com/maintenance"),)
    seen = gpu_budget.leaving(node("a", 1, labels={"example.com/maintenance": ""}), markers)
    assert seen.drain and "example.com/maintenance" in seen.why
    with pytest.raises(ValueError, match="at most 32"):
        gpu_budget.parse_markers(",".join(f"k{i}" for i in range(33)))


def share_gpus(nodes, free, claims):
    """Granted replicas per claim on the nodes there are (plan_gpus without growth)."""
    return {key: share.granted for key, share in gpu_plan.plan_gpus(nodes, free, claims).items()}


def claim(name, prio, desired, current=1, bound=1, gpus=1, resource=GPU, pod_spec=None):
    return gpu_plan.Claim(("ns", name), prio, gpus, current, bound, desired, resource, pod_spec)


def test_replicas_fit_on_one_node_not_across_nodes():
    # the issue's case: two nodes with one free GPU each hold no 2-GPU replica
    nodes, free = budget([node("a", 1), node("b", 1)])
    assert share_gpus(nodes, free, [claim("x", 0, 2, gpus=2)]) == {("ns", "x"): 1}
    assert gpu_plan.largest_free(nodes, free) == 1
    nodes, free = budget([node("a", 1), node("b", 3)])
    assert share_gpus(nodes, free, [claim("x", 0, 3, gpus=2)]) == {("ns", "x"): 2}


def test_best_fit_keeps_the_large_gap_for_the_large_replica():
    nodes, free = budget([node("a", 2), node("b", 1)])
    claims = [claim("small", 10, 2, gpus=1), claim("big", 0, 2, gpus=2)]
    assert share_gpus(nodes, free, claims) == {("ns", "small"): 2, ("ns", "big"): 2}


def test_share_gpus_by_priority():
    nodes, free = budget([node("a", 3)])
    claims = [claim("low", 0, 4), claim("high", 10, 4)]
    assert share_gpus(nodes, free, claims) == {("ns", "high"): 4, ("ns", "low"): 1}
    nodes, free = budget([node("a", 5)])
    assert share_gpus(nodes, free, claims) == {("ns", "high"): 4, ("ns", "low"): 3}


def test_share_gpus_counts_pending_pods_and_gpus_per_replica():
    # `big` already asked for 3 (1 bound): its 2 pending pods take the free GPUs first
    claims = [claim("big", 5, 5, current=3, bound=1, gpus=2), claim("small", 0, 2)]
    for gpus, want in ((4, (3, 1)), (9, (5, 2)), (8, (5, 1))):
        nodes, free = budget([node("a", gpus)])
        assert share_gpus(nodes, free, claims) == {("ns", "big"): want[0],
                                                     ("ns", "small"): want[1]}


def test_share_gpus_never_blocks_scale_down_or_hold():
    nodes, free = budget([node("a", 0)])
    held = claim("x", 0, 1, current=3, bound=3)
    assert share_gpus(nodes, free, [held]) == {("ns", "x"): 1}
    pending = claim("x", 0, 3, current=3, bound=1)
    assert share_gpus(nodes, free, [pending]) == {("ns", "x"): 3}


def test_mig_and_other_resource_names_count_only_themselves():
    nodes, free = budget([node("a", 8, **{MIG: "2"}), node("b", 0, **{"amd.com/gpu": "4"})])
    mig = claim("m", 0, 5, current=0, bound=0, resource=MIG)
    assert share_gpus(nodes, free, [mig]) == {("ns", "m"): 2}
    amd = claim("r", 0, 5, current=0, bound=0, gpus=2, resource="amd.com/gpu")
    assert share_gpus(nodes, free, [amd]) == {("ns", "r"): 2}
    assert gpu_plan.largest_free(nodes, free, MIG) == 2


def spec_of(**scheduling):
    """The pod template a VLMDeployment's pods get (the GPU toleration included)."""
    vlmd = parse({"apiVersion": "serving.vlm-operator.dev/v1alpha1", "kind": "VLMDeployment",
                  "metadata": {"name": "m", "namespace": "ns"},
                  "spec": {"model": "m", "image": "vllm/vllm-openai:v0.20.2",
                           "scheduling": scheduling}})
    return children.get_pod_template(vlmd)["spec"]


def grant(nodes, pod_spec, desired=3):
    views, free = budget(nodes)
    new = claim("x", 0, desired, current=0, bound=0, pod_spec=pod_spec)
    return share_gpus(views, free, [new])[("ns", "x")]


def test_node_selector_and_required_affinity_limit_the_nodes():
    nodes = [node("a100", 2, labels={"gpu": "a100", "gen": "3"}),
             node("h100", 2, labels={"gpu": "h100", "gen": "4"}), node("plain", 2)]
    assert grant(nodes, spec_of(nodeSelector={"gpu": "h100"})) == 2
    term = {"matchExpressions": [{"key": "gen", "operator": "Gt", "values": ["2"]},
                                 {"key": "gpu", "operator": "NotIn", "values": ["h100"]}]}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [term, {"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": ["plain"]}]}]}}}
    assert grant(nodes, spec_of(affinity=affinity), desired=5) == 4  # a100 or plain
    empty = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{}]}}}
    assert grant(nodes, spec_of(affinity=empty)) == 0  # no node at all
    preferred = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 1, "preference": term}]}}
    assert grant(nodes, spec_of(affinity=preferred), desired=7) == 6  # soft: any node


def test_taints_need_tolerations():
    dedicated = {"key": "dedicated", "value": "vlm", "effect": "NoSchedule"}
    nodes = [node("gpu", 2, taints=[{"key": GPU, "effect": "NoSchedule"}]),
             node("team", 2, taints=[dedicated]),
             node("evicting", 2, taints=[{"key": "x", "effect": "NoExecute"}]),
             node("soft", 2, taints=[{"key": "y", "effect": "PreferNoSchedule"}])]
    # the pods tolerate nvidia.com/gpu (builders); PreferNoSchedule never blocks
    assert grant(nodes, spec_of(), desired=9) == 4
    tolerate = [{"key": "dedicated", "operator": "Equal", "value": "vlm"}]
    assert grant(nodes, spec_of(tolerations=tolerate), desired=9) == 6
    wrong = [{"key": "dedicated", "operator": "Equal", "value": "other"}]
    assert grant(nodes, spec_of(tolerations=wrong), desired=9) == 4
    everything = [{"operator": "Exists"}]
    assert grant(nodes, spec_of(tolerations=everything), desired=9) == 8


@given(st.lists(st.integers(0, 8), min_size=1, max_size=6), st.integers(1, 4),
       st.integers(0, 30))
def test_one_claim_gets_exactly_what_fits_per_node(gpus, per_replica, desired):
    nodes, free = budget([node(f"n{i}", g) for i, g in enumerate(gpus)])
    fits = sum(g // per_replica for g in gpus)
    got = share_gpus(nodes, free, [claim("x", 0, desired, current=0, bound=0,
                                           gpus=per_replica)])[("ns", "x")]
    assert got == min(desired, fits)


# ---------------------------------------------------------------- graceful scale-down

def test_victim_order_failing_unbound_loading_idle_newest():
    ps = [a.PodSample("busy", busy=5, created=1), a.PodSample("idle-old", busy=0, created=1),
          a.PodSample("idle-new", busy=0, created=2), a.PodSample("loading", state=a.LOADING),
          a.PodSample("pending", state=a.PENDING),
          a.PodSample("failing", busy=9, failing=True)]
    assert [p.name for p in a.victim_order(ps)] == [
        "failing", "pending", "loading", "idle-new", "idle-old", "busy"]


def test_plan_scale_down_drains_then_deletes():
    ps = [a.PodSample("a", busy=3), a.PodSample("b", busy=1), a.PodSample("c", busy=2)]
    plan = a.plan_scale_down(ps, 2, 3, {}, 0)
    assert plan == a.DrainPlan(["b"], [], [])
    plan = a.plan_scale_down(ps, 2, 3, {"b": 0}, 5)  # still busy
    assert plan == a.DrainPlan([], [], [])
    drained = [a.PodSample("a", busy=3), a.PodSample("b", busy=0), a.PodSample("c", busy=2)]
    assert a.plan_scale_down(drained, 2, 3, {"b": 0}, 6) == a.DrainPlan([], [], ["b"])
    assert a.plan_scale_down(ps, 2, 3, {"b": 0}, a.DRAIN_TIMEOUT_S).delete == ["b"]


def test_a_fenced_pod_goes_first_and_at_once_without_a_drain():
    ps = [a.PodSample("idle", busy=0), a.PodSample("fenced", state=a.LOADING, fenced=True,
                                                   failing=False),
          a.PodSample("failing", busy=9, failing=True)]
    assert next(p.name for p in a.victim_order(ps)) == "fenced"
    assert a.plan_scale_down(ps, 2, 3, {}, 0) == a.DrainPlan([], [], ["fenced"])
    assert a.plan_scale_down(ps, 1, 3, {}, 0) == a.DrainPlan(["failing"], [], ["fenced"])


def test_unknown_load_is_not_zero():
    """Defect: a failed scrape counted as a loading pod with no load: ranked first as a scale-
    down victim, its load 0, and deleted at once while draining."""
    quiet = pods(0, 0, 0)
    unknown = [*pods(0, 0), a.PodSample("slow", state=a.UNKNOWN)]
    policy = a.ScalingPolicy(1, 3, 5, 0)
    _, ds = run([quiet] * 40, current=3, policy=policy)
    assert min(d.desired for d in ds) < 3  # idle pods are scaled down...
    current, ds = run([unknown] * 40, current=3, policy=policy)
    assert current == 3 and ds[-1].reason == "LoadUnknown"  # ...not when one is unknown
    assert "slow" in ds[-1].message
    # the known pods' load is a lower bound: it may still scale up
    current, _ = run([[*pods(30, 30), a.PodSample("slow", state=a.UNKNOWN)]] * 5, current=3,
                     policy=a.ScalingPolicy(1, 20, 5, 0))
    assert current > 3
    alone = a.ScalingRequest([a.PodSample("slow", state=a.UNKNOWN)], 2, (), 0, POLICY)
    assert a.decide(alone).reason == "NoMetrics"
    # never a victim, and a draining one waits out its drain limit
    assert [p.name for p in a.victim_order(unknown)] == ["p0", "p1"]
    plan = a.plan_scale_down(unknown, 2, 3, {"slow": 0}, 10)
    assert plan.delete == []
    assert a.plan_scale_down(unknown, 2, 3, {"slow": 0}, a.DRAIN_TIMEOUT_S).delete == ["slow"]


def drained_pod(name, since="5.000", in_service="false", deleting=False):
    meta = {"name": name, "labels": {"serving.vlm-operator.dev/in-service": in_service},
            "annotations": {a.DRAIN_SINCE: since} if since is not None else {}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta}


def test_drains_are_read_back_from_the_pods():
    assert a.draining_since(drained_pod("a")) == 5.0
    assert a.draining_since(drained_pod("a", in_service="true")) is None  # put back
    assert a.draining_since(drained_pod("a", since=None)) is None  # log watching's, not ours
    assert a.draining_since(drained_pod("a", since="junk")) is None
    pods_ = [drained_pod("a"), drained_pod("b", since=None), drained_pod("c", deleting=True)]
    assert a.stale_drains(pods_, builtin=False) == ["a"]
    assert a.stale_drains(pods_, builtin=True) == []


def test_plan_scale_down_puts_pods_back_when_load_returns():
    ps = [a.PodSample("a", busy=3), a.PodSample("b", busy=1), a.PodSample("c", busy=2)]
    assert a.plan_scale_down(ps, 3, 3, {"b": 0}, 1) == a.DrainPlan([], ["b"], [])
    assert a.plan_scale_down(ps, 2, 3, {"b": 0, "c": 1}, 2) == a.DrainPlan([], ["c"], [])
    assert a.plan_scale_down(ps, 3, 3, {"gone": 0}, 1) == a.DrainPlan([], [], [])


# ---------------------------------------------------------------- HPA and KEDA children

def vlmd(**autoscaling):
    return parse({"apiVersion": "serving.vlm-operator.dev/v1alpha1", "kind": "VLMDeployment",
                  "metadata": {"name": "demo", "namespace": "team", "uid": "u1"},
                  "spec": {"model": "m", "image": "vllm/vllm-openai:v0.20.2",
                           "autoscaling": autoscaling}})


def test_hpa_targets_the_vlmdeployment_on_a_pods_metric():
    obj = vlmd(enabled=True, mode="HPA", minReplicas=0, maxReplicas=4, target=2.5,
               scaleDownDelaySeconds=120)
    objs = children.get_children(obj, hpa_api_version="autoscaling/v2beta2")
    hpa = objs[-1]
    assert (hpa["apiVersion"], hpa["kind"]) == ("autoscaling/v2beta2", "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "serving.vlm-operator.dev/v1alpha1",
                                             "kind": "VLMDeployment", "name": "demo"}
    assert hpa["spec"]["minReplicas"] == 1 and hpa["spec"]["maxReplicas"] == 4
    # the configured metric and, like Builtin mode, the KV-cache usage: the HPA acts on the
    # larger recommendation, so replicas busy without a queue are not scaled away
    assert hpa["spec"]["metrics"] == [
        {"type": "Pods", "pods": {"metric": {"name": "vllm_num_requests_waiting"},
                                  "target": {"type": "AverageValue", "averageValue": "2500m"}}},
        {"type": "Pods", "pods": {"metric": {"name": "vllm_kv_cache_usage_perc"},
                                  "target": {"type": "AverageValue", "averageValue": "800m"}}}]
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 120
    assert hpa["metadata"]["ownerReferences"][0]["uid"] == "u1"
    assert children.get_children(obj)[-1]["apiVersion"] == "autoscaling/v2"
    assert ab.get_unwanted(obj, "autoscaling/v2", True) == [
        ("keda.sh/v1alpha1", "ScaledObject", "demo")]


SELECTOR = '{namespace="team",pod=~"demo-[a-z0-9]+-[a-z0-9]+"}'


def test_scaled_object_and_missing_keda():
    obj = vlmd(enabled=True, mode="KEDA", maxReplicas=3, multimodalWeight=0)
    so = children.get_children(obj, prometheus_address="http://prom:9090")[-1]
    assert (so["apiVersion"], so["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    assert so["spec"]["scaleTargetRef"]["kind"] == "VLMDeployment"
    load, kv = so["spec"]["triggers"]
    assert load["type"] == kv["type"] == "prometheus"
    assert load["metadata"] == {"serverAddress": "http://prom:9090", "threshold": "5",
                                "query": f"sum(vllm:num_requests_waiting{SELECTOR})"}
    assert kv["metadata"] == {"serverAddress": "http://prom:9090", "threshold": "0.8",
                              "query": f"sum(vllm:kv_cache_usage_perc{SELECTOR})"}
    assert [c["kind"] for c in children.get_children(obj, keda=False)] == [
        "Deployment", "Service", "PodDisruptionBudget"]
    # no Prometheus known (validation refuses the spec): no ScaledObject pointing nowhere
    assert children.get_children(obj)[-1]["kind"] == "PodDisruptionBudget"
    assert ab.get_unwanted(obj, "autoscaling/v2", True) == [
        ("autoscaling/v2", "HorizontalPodAutoscaler", "demo")]
    query = 'sum(x{namespace="team"})'
    custom = vlmd(enabled=True, mode="KEDA", prometheus={"query": query})
    assert children.get_children(custom, prometheus_address="http://p")[-1]["spec"][
        "triggers"][0]["metadata"]["query"] == query


def test_keda_default_query_weighs_requests_by_their_images():
    """As Builtin mode does per pod: each request counts 1 + multimodalWeight x the images per
    finished request, here over the whole VLMDeployment, capped while none finished; a model
    without multimodal series reads as 0 images, never as no value."""
    from vlm_operator.api import promql
    scaling = vlmd(enabled=True, mode="KEDA", multimodalWeight=0.5).spec["autoscaling"]
    query = promql.default_query(scaling, "team", "demo")
    assert query == (
        f"sum(vllm:num_requests_waiting{SELECTOR}) * (1 + 0.5 * clamp_max("
        f"(sum(rate(vllm:mm_cache_queries_total{SELECTOR}[2m])) or vector(0)) / clamp_min("
        f"(sum(rate(vllm:request_success_total{SELECTOR}[2m])) or vector(0)), 0.001), 32))")
    assert promql.namespace_problems(query, "team", "q") == []


@pytest.mark.parametrize("scaling", [{}, {"enabled": True}, {"enabled": False, "mode": "HPA"}])
def test_builtin_or_off_has_no_autoscaling_children(scaling):
    obj = vlmd(**scaling)
    assert [c["kind"] for c in children.get_children(obj)] == [
        "Deployment", "Service", "PodDisruptionBudget"]
    assert {k for _, k, _ in ab.get_unwanted(obj, "autoscaling/v2", True)} == {
        "HorizontalPodAutoscaler", "ScaledObject"}
    # a mode the installation does not serve made nothing, and its RBAC may not read them
    assert ab.get_unwanted(obj, "autoscaling/v2", True, served=("Builtin",)) == []


# ---------------------------------------------------------------- reading a pod's /metrics

def test_parse_pod_metrics_of_the_vllm_stand_in():
    from vlm_operator.api.crd import autoscaling_mode
    from vlm_operator.autoscaling.autoscaler import metric_names
    from vlm_operator.podreads.reader import parse_metrics as parse_pod_metrics
    from vlm_testbed import vllmsim

    text = vllmsim.render_metrics(
        'engine="0",model_name="m"',
        {"vllm:num_requests_waiting": 7.0, "vllm:num_requests_running": 2.0,
         "vllm:kv_cache_usage_perc": 0.25},
        {"vllm:request_success_total": 10.0, "vllm:mm_cache_queries_total": 15.0},
        {"vllm:e2e_request_latency_seconds": vllmsim.Histogram()})
    values = parse_pod_metrics(text, metric_names({"autoscaling": {
        "metric": "vllm:num_requests_waiting"}}))
    assert values["vllm:num_requests_waiting"] == 7.0
    assert values["vllm:kv_cache_usage_perc"] == 0.25
    assert values["vllm:request_success_total"] == 10.0
    assert values["vllm:mm_cache_queries_total"] == 15.0
    assert a.images_per_request((0.0, 0.0), (values["vllm:request_success_total"],
                                              values["vllm:mm_cache_queries_total"]), 0) == 1.5
    assert autoscaling_mode({"autoscaling": {"enabled": True}}) == "Builtin"
    assert autoscaling_mode({"autoscaling": {"enabled": True, "mode": "HPA"}}) == "HPA"
    assert autoscaling_mode({"autoscaling": {"enabled": False, "mode": "HPA"}}) is None
    assert autoscaling_mode({}) is None
