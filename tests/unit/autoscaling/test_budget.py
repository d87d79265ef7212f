"""budget.GpuBudget: whether one more replica fits the free GPUs, for surge replacements, with
the replicas already asked for and not yet on a node counted first."""

import pytest

from vlm_operator.api.validation import parse
from vlm_operator.autoscaling.budget import GpuBudget
from vlm_operator.k8s import nodes
from vlm_operator.k8s.caches import Stale


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
