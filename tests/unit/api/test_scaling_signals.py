"""api/scaling_signals.py: a capacity signal declared once reaches every autoscaling mode:
Builtin's need and its scrape, the HPA's Pods metrics and KEDA's triggers."""

from __future__ import annotations

import pytest

from vlm_operator.api import scaling_signals
from vlm_operator.api.scaling_signals import CapacitySignal
from vlm_operator.api.validation import parse
from vlm_operator.autoscaling import recommend
from vlm_operator.autoscaling.autoscaler import metric_names
from vlm_operator.desired import children

ADDED = CapacitySignal("vllm:added_gauge", 4, "a signal this test adds")
BEFORE = len(scaling_signals.SIGNALS)


@pytest.fixture
def two_signals(monkeypatch):
    monkeypatch.setattr(scaling_signals, "SIGNALS", (*scaling_signals.SIGNALS, ADDED))


def vlmd(**autoscaling):
    return parse({"apiVersion": "serving.vlm-operator.dev/v1alpha1", "kind": "VLMDeployment",
                  "metadata": {"name": "demo", "namespace": "team", "uid": "u1"},
                  "spec": {"model": "m", "image": "vllm/vllm-openai:v0.20.2",
                           "autoscaling": {"enabled": True, **autoscaling}}})


def test_a_new_signal_counts_in_builtin_mode(two_signals):
    policy = recommend.ScalingPolicy(min_replicas=1, max_replicas=8, target=5,
                                     scale_down_delay_s=60, multimodal_weight=0.0)
    pods = [recommend.PodSample(f"p{i}", usage=(*(0.0,) * BEFORE, 6.0)) for i in range(2)]
    assert recommend.load_need(pods, policy) == 3.0  # 12 / 4 per full replica
    assert ADDED.metric in metric_names(vlmd().spec)


def test_a_new_signal_is_an_hpa_metric_and_a_keda_trigger(two_signals):
    hpa = children.get_children(vlmd(mode="HPA"))[-1]
    assert len(hpa["spec"]["metrics"]) == 1 + BEFORE + 1
    assert hpa["spec"]["metrics"][-1]["pods"] == {
        "metric": {"name": "vllm_added_gauge"},
        "target": {"type": "AverageValue", "averageValue": "4"}}
    so = children.get_children(vlmd(mode="KEDA"), prometheus_address="http://p")[-1]
    assert len(so["spec"]["triggers"]) == 1 + BEFORE + 1
    added = so["spec"]["triggers"][-1]["metadata"]
    assert added["threshold"] == "4" and added["query"].startswith("sum(vllm:added_gauge{")
