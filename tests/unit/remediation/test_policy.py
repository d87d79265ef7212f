"""remediation/policy.py: spec.health read as rules, the budget, back-off."""

from __future__ import annotations

from vlm_operator.api.actions import Action
from vlm_operator.remediation.policy import Rule, backoff_s, health_policy_from_spec

from .builders import policy


def test_policy_defaults_and_mapping():
    pol = policy()
    assert pol.rule_for("tokenizer_retry") == ("tokenizerRetry", Rule(5, 60.0, Action.RESTART))
    assert pol.rule_for("tokenizer_borrow_error")[0] == "tokenizerRetry"
    assert pol.rule_for("engine_dead") == ("engineDead", Rule(1, 60.0, Action.RESTART))
    assert pol.rule_for("plugin_active") is None
    assert (pol.max_restarts_per_hour, pol.min_available) == (6, 1)
    custom = policy(engineDead={"threshold": 2, "windowSeconds": 30, "action": "ScaleDown"},
                    maxRestartsPerHour=1, minAvailable=0)
    assert custom.rule_for("engine_dead")[1] == Rule(2, 30.0, Action.SCALE_DOWN)
    extra = health_policy_from_spec({"health": {"extraSignatures": [
        {"name": "cuda_oom", "regex": "CUDA out of memory", "action": "ScaleDown",
         "threshold": 2}]}})
    assert extra.rule_for("cuda_oom") == ("extra:cuda_oom", Rule(2, 60.0, Action.SCALE_DOWN))
    assert extra.rule_for("engine_dead")[0] == "engineDead"
    # a stall or an unresponsive API server is one verdict: threshold 1
    assert pol.rule_for("engine_stalled") == ("engineStalled", Rule(1, 60.0, Action.RESTART))
    assert pol.rule_for("api_unresponsive") == ("apiUnresponsive", Rule(1, 60.0, Action.RESTART))
    slow = policy(engineStalled={"stallSeconds": 120, "action": "ScaleDown"})
    assert slow.rule_for("engine_stalled")[1] == Rule(1, 240.0, Action.SCALE_DOWN)


def test_backoff_doubles_and_caps():
    assert [backoff_s(n) for n in (1, 2, 3, 4)] == [10, 20, 40, 80]
    assert backoff_s(30) == 600
