"""budget.GpuBudget: whether one more replica fits the free GPUs, for surge replacements, with
the replicas already asked for and not yet on a node counted first."""

import pytest

from vlm_operator.api.validation import parse
from vlm_operator.autoscaling.budget import GpuBudget
from vlm_operator.k8s import gpu_plan, nodes
from vlm_operator.k8s.informer import Stale


class OneNode:
    """The caches' view: one node with 2 GPUs, `free` of them free (None: not known yet)."""

    def __init__(self, free: int | None) -> None:
        self.free = free

    def budget(self):
        if self.free is None:
            raise Stale("nodes not listed yet")
        return ([nodes.Node("n", {}, (), {"nvidia.com/gpu": 2})],
                {"n": {"nvidia.com/gpu": self.free}})


VLMD = parse({"apiVersion": "serving.vlm-operator.dev/v1alpha1", "kind": "VLMDeployment",
              "metadata": {"namespace": "ns", "name": "m"},
              "spec": {"model": "m", "image": "vllm/vllm-openai:v0.20.2", "replicas": 2}})


def test_replica_fits_leaves_the_pending_claims_their_gpus():
    budget = GpuBudget(OneNode(free=1))
    assert budget.replica_fits(VLMD) and budget.replica_fits(VLMD, 0)
    assert not budget.replica_fits(VLMD, 1)  # a surge not on a node yet takes the free GPU
    assert GpuBudget(OneNode(free=2)).replica_fits(VLMD, 1)


def test_an_unknown_budget_is_neither_free_nor_full():
    with pytest.raises(Stale):
        GpuBudget(OneNode(free=None)).replica_fits(VLMD)


# -------------------------------------------- a ReadWriteOnce cache claim pins replicas


class Nodes:
    """The caches' view: nodes name -> (GPUs, free), the GPU pods bound to them, and the
    managed pods no node holds yet."""

    def __init__(self, nodes_, bound=(), unbound=()):
        self.nodes, self.bound, self.unbound = nodes_, list(bound), list(unbound)

    def budget(self):
        return ([nodes.Node(n, {}, (), {"nvidia.com/gpu": g}) for n, (g, _) in self.nodes.items()],
                {n: {"nvidia.com/gpu": f} for n, (_, f) in self.nodes.items()})

    def pod_uses(self):
        return self.bound

    def unbound_uses(self):
        return self.unbound


def use(node, namespace="ns", instance="m", gpus=1):
    return nodes.PodUse(node, {"nvidia.com/gpu": gpus}, namespace, (
        ("app.kubernetes.io/component", "engine"), ("app.kubernetes.io/instance", instance),
        ("app.kubernetes.io/managed-by", "vlm-operator"), ("app.kubernetes.io/name", "vllm")))


def vlmd(name="m", replicas=2, cache=None):
    spec = {"model": "m", "image": "vllm/vllm-openai:v0.20.2", "replicas": replicas}
    if cache is not None:
        spec["modelCache"] = cache
    return parse({"apiVersion": "serving.vlm-operator.dev/v1alpha1", "kind": "VLMDeployment",
                  "metadata": {"namespace": "ns", "name": name}, "spec": spec})


RWO = vlmd(cache={"size": "10Gi"})  # the operator's ReadWriteOnce claim: one node for all


def test_a_replacement_fits_only_on_the_claim_node():
    """The replica on full node a holds the claim: node b's free GPUs take no replacement
    (its pod affinity sends it to a, where it would stay Pending)."""
    cluster = Nodes({"a": (1, 0), "b": (2, 2)}, bound=[use("a")])
    assert not GpuBudget(cluster).replica_fits(RWO)
    assert GpuBudget(cluster).replica_fits(VLMD)  # no claim: any node
    assert GpuBudget(Nodes({"a": (2, 1), "b": (2, 2)}, bound=[use("a")])).replica_fits(RWO)
    # another VLMDeployment's pod on b, or one of another namespace, pins nothing
    other = Nodes({"a": (1, 0), "b": (2, 2)}, bound=[use("a"), use("b", instance="x"),
                                                     use("b", namespace="other")])
    assert not GpuBudget(other).replica_fits(RWO)


def test_a_scale_up_with_a_claim_is_granted_only_on_its_node():
    cluster = Nodes({"a": (2, 1), "b": (4, 4)}, bound=[use("a")])
    budget = GpuBudget(cluster)
    claim = budget.claim(RWO, 0, 1, 1, 4)
    assert claim.beside == frozenset({"a"})
    grant = budget.grant([claim], claim.key)
    assert (grant.granted, grant.most) == (2, 1)  # b's 4 free GPUs are not the claim's


def test_replicas_of_a_claim_none_bound_yet_go_together_on_one_node():
    budget = GpuBudget(Nodes({"a": (1, 1), "b": (1, 1), "c": (3, 2)}))
    claim = budget.claim(RWO, 0, 0, 0, 3)
    assert claim.beside == frozenset()
    assert budget.grant([claim], claim.key).granted == 2  # c holds 2; a and b one each
    plain = budget.claim(VLMD, 0, 0, 0, 3)
    assert budget.grant([plain], plain.key).granted == 3


def test_affinity_nodes_predicts_only_the_pods_own_hostname_affinity():
    labels = {"app.kubernetes.io/instance": "m"}
    term = {"labelSelector": {"matchLabels": labels}, "topologyKey": nodes.HOSTNAME}
    spec = {"affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        term]}}}
    uses = [use("a"), use("b", instance="x")]
    assert nodes.affinity_nodes(spec, "ns", labels, uses) == frozenset({"a"})
    assert nodes.affinity_nodes({}, "ns", labels, uses) is None
    for other in ({**term, "topologyKey": "topology.kubernetes.io/zone"},
                  {**term, "labelSelector": {"matchLabels": {"team": "x"}}},
                  {**term, "namespaces": ["elsewhere"]}):
        spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] = [
            other]
        assert nodes.affinity_nodes(spec, "ns", labels, uses) is None  # the scheduler's call


# ------------------------------------------------ capacity that a node autoscaler adds

def growth():
    """2 GPUs Pending at most per VLMDeployment, 3 in all."""
    return gpu_plan.Growth(per_deployment=2, total=3, timeout_s=600.0)


def test_growth_grants_replicas_no_node_holds_within_its_bounds():
    full = Nodes({"a": (2, 0)})
    assert not GpuBudget(full).replica_fits(VLMD)  # existing nodes only: the default
    budget = GpuBudget(full, growth())
    assert budget.replica_fits(VLMD) and budget.replica_fits(VLMD, 1)
    assert not budget.replica_fits(VLMD, 2)  # 3 GPUs Pending for one VLMDeployment: over 2
    first, second = (budget.claim(vlmd(n), p, 1, 1, 4) for n, p in (("m", 1), ("n", 0)))
    grant = budget.grant([first, second], first.key)
    assert (grant.granted, grant.to_come) == (3, 2)
    assert budget.grant([first, second], second.key)[:2] == (2, 1)  # 3 in all
    assert budget.grant([first, second], first.key, grow=False)[:2] == (1, 0)


def test_growth_counts_what_other_vlmdeployments_left_pending():
    pending = [use("", instance="x", gpus=2), use("", instance="m", gpus=1)]
    budget = GpuBudget(Nodes({"a": (2, 0)}, unbound=pending), growth())
    claim = budget.claim(vlmd("m"), 0, 2, 1, 3)  # m's own Pending pod is among current
    assert budget.grant([claim], claim.key)[:2] == (2, 1)  # 3 in all, x holds 2


def test_a_replica_pinned_to_its_claim_node_never_waits_for_a_new_node():
    budget = GpuBudget(Nodes({"a": (1, 0)}, bound=[use("a")]), growth())
    assert not budget.replica_fits(RWO)


def test_what_is_kept_of_a_gpu_pod_is_bounded():
    labels = {**{f"app.kubernetes.io/k{i:02}": "v" for i in range(20)}, "team": "x"}
    spec = {"containers": [{"resources": {"limits": {"nvidia.com/gpu": "1"}}}]}
    bound = {"metadata": {"namespace": "ns", "labels": labels},
             "spec": {**spec, "nodeName": "a"}, "status": {"phase": "Running"}}
    use = nodes.pod_use(bound)
    assert use.namespace == "ns" and len(use.labels) == nodes.LABELS_KEPT
    assert all(k.startswith("app.kubernetes.io/") for k, _ in use.labels)
    assert nodes.pending_use(bound) is None  # a node holds it
    unbound = {**bound, "spec": spec, "status": {"phase": "Pending"}}
    assert nodes.pending_use(unbound).node == "" and nodes.pod_use(unbound) is None
    going = {**unbound, "metadata": {**unbound["metadata"], "deletionTimestamp": "x"}}
    assert nodes.pending_use(going) is None
