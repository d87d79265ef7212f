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

RUNNING = CapacitySignal("vllm:num_requests_running", 4, "replicas running full batches")


@pytest.fixture
def two_signals(monkeypatch):
    monkeypatch.setattr(scaling_signals, "SIGNALS", (*scaling_signals.SIGNALS, RUNNING))


def vlmd(**autoscaling):
    return parse({"apiVersion": "serving.vlm-operator.dev/v1alpha1", "kind": "VLMDeployment",
                  "metadata": {"name": "demo", "namespace": "team", "uid": "u1"},
                  "spec": {"model": "m", "image": "vllm/vllm-openai:v0.20.2",
                           "autoscaling": {"enabled": True, **autoscaling}}})


def test_a_new_signal_counts_in_builtin_mode(two_signals):
    policy = recommend.ScalingPolicy(min_replicas=1, max_replicas=8, target=5,
                                     scale_down_delay_s=60, multimodal_weight=0.0)
    pods = [recommend.PodSample(f"p{i}", usage=(0.1, 6.0)) for i in range(2)]
    assert recommend.load_need(pods, policy) == 3.0  # 12 running / 4 per full replica
    assert recommend.load_need([recommend.PodSample("p", usage=(0.8,))], policy) == 1.0
    assert RUNNING.metric in metric_names(vlmd().spec)


def test_a_new_signal_is_an_hpa_metric_and_a_keda_trigger(two_signals):
    hpa = children.get_children(vlmd(mode="HPA"))[-1]
    assert hpa["spec"]["metrics"][-1]["pods"] == {
        "metric": {"name": "vllm_num_requests_running"},
        "target": {"type": "AverageValue", "averageValue": "4"}}
    so = children.get_children(vlmd(mode="KEDA"), prometheus_address="http://p")[-1]
    kv, running = so["spec"]["triggers"][1:]
    assert kv["metadata"]["query"].startswith("sum(vllm:kv_cache_usage_perc{")
    assert running["metadata"]["threshold"] == "4"
    assert running["metadata"]["query"].startswith("sum(vllm:num_requests_running{")
