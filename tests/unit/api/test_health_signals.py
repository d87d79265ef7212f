"""api/health_signals.py is the one list of the signals the operator acts on: the CRD's
spec.health, the validation's list of action fields, the remediation's policy and the log
signature catalogue all agree with it."""

from __future__ import annotations

from vlm_operator.api import crd, health_signals, log_signatures
from vlm_operator.api.actions import POLICY
from vlm_operator.api.validation_health import health_actions
from vlm_operator.remediation.policy import health_policy_from_spec


def health_schema() -> dict:
    return crd.get_schema()["properties"]["spec"]["properties"]["health"]["properties"]


def test_every_signal_has_its_spec_health_policy_with_the_actions_users_may_choose():
    schema = health_schema()
    for sig in health_signals.SIGNALS:
        action = schema[sig.field]["properties"]["action"]
        assert action["enum"] == [a.value for a in POLICY], sig.field
        assert action["default"] == sig.action.value, sig.field
        if sig.source == health_signals.LOG:
            props = schema[sig.field]["properties"]
            assert (props["threshold"]["default"], props["windowSeconds"]["default"]) == (
                sig.threshold, sig.window_s), sig.field
    # and nothing in spec.health has an action the registry does not know (extraSignatures,
    # each its own, aside)
    with_action = {k for k, v in schema.items() if "action" in v.get("properties", {})}
    assert with_action == set(health_signals.FIELDS)


def test_validation_and_the_policy_read_every_signal():
    assert [f for f, _ in health_actions({})] == [
        f"spec.health.{field}.action" for field in health_signals.FIELDS]
    policy = health_policy_from_spec({})
    assert set(policy.rules) == set(health_signals.FIELDS)
    assert dict(policy.signature_policy) == health_signals.SIGNATURE_FIELD


def test_each_log_signal_is_matched_by_a_catalogue_signature_that_acts_and_no_other_is():
    catalogue = {s.name: s for s in log_signatures.SIGNATURES}
    from_log = [sig for s in health_signals.SIGNALS if s.source == health_signals.LOG
                for sig in s.signatures]
    assert all(catalogue[name].class_ in ("restart", "remediate") for name in from_log)
    assert set(health_signals.NOT_FROM_LOG).isdisjoint(catalogue)
    acting = {n for n, s in catalogue.items() if s.class_ in ("restart", "remediate")}
    assert acting == set(from_log)
