"""The operator's policy: allowed image prefixes, PriorityClasses (and the autoscaling rank they
bound), Secrets labelled for use, options that run the tenant's code, autoscaling modes and the
Prometheus KEDA may query."""

import pytest

from vlm_operator.api import admin_policy, crd
from vlm_operator.api.admin_policy import AdminPolicy
from vlm_operator.api.validation import validate
from vlm_operator.cli import build_parser
from vlm_operator.reconcile.status import get_status

LABEL = "vlm-operator.dev/referable=true"


def cr(**spec):
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
            "metadata": {"name": "m", "namespace": "ns"},
            "spec": {"model": "m", "image": "reg.example/vllm/vllm-openai:v0.20.2", **spec}}


def labels_of(existing):
    return lambda name: existing.get(name)


def test_off_by_default():
    spec = cr(image="evil.example/miner:v0.20.2", scheduling={
        "priorityClassName": "system-cluster-critical"}, hfTokenSecretRef={"name": "any"})
    assert validate(spec) == validate(spec, AdminPolicy()) == ([], [])


@pytest.mark.parametrize("image,ok", [
    ("reg.example/vllm/vllm-openai:v0.20.2", True),
    ("reg.example/vllm:v0.20.2", True),  # a prefix without / ends at a boundary
    ("reg.example/vllm@sha256:ab", True),
    ("reg.example/vllm-evil/x:v0.20.2", False),
    ("reg.example.evil.io/vllm/x:v0.20.2", False),
    ("docker.io/vllm/vllm-openai:v0.20.2", False),
])
def test_image_prefixes_match_at_a_boundary(image, ok):
    assert admin_policy.image_allowed(image, ("reg.example/vllm",)) is ok
    assert admin_policy.image_allowed(image, ("other/", "reg.example/vllm/")) is (
        ok and image.startswith("reg.example/vllm/"))


def test_image_rule_names_the_field_and_the_rule():
    rules = AdminPolicy(image_prefixes=("reg.example/vllm/",))
    assert validate(cr(), rules) == ([], [])
    problems, _ = validate(cr(image="evil.example/vllm:v0.20.2"), rules)
    assert problems == ["spec.image: 'evil.example/vllm:v0.20.2' is not allowed by the operator's "
                        "policy: images must start with one of 'reg.example/vllm/'"]
    # the default image counts too when spec.image is left out
    spec = cr()
    del spec["spec"]["image"]
    assert validate(spec, rules)[0][0].startswith(f"spec.image: {crd.DEFAULT_IMAGE!r} is not")


def test_priority_class_rule():
    rules = AdminPolicy(priority_classes=("gpu-batch", "gpu-online"))
    assert validate(cr(), rules)[0] == []  # none set: the cluster's default
    assert validate(cr(scheduling={"priorityClassName": "gpu-online"}), rules)[0] == []
    assert validate(cr(scheduling={"priorityClassName": "system-node-critical"}), rules)[0] == [
        "spec.scheduling.priorityClassName: 'system-node-critical' is not allowed by the "
        "operator's policy: allowed PriorityClasses are 'gpu-batch', 'gpu-online'"]


def test_secret_rule_checks_every_reference():
    rules = AdminPolicy(secret_label=LABEL)
    spec = cr(hfTokenSecretRef={"name": "hf"}, vllm={"env": [
        {"name": "A", "value": "1"},
        {"name": "API_KEY", "valueFrom": {"secretKeyRef": {"name": "db", "key": "k"}}},
        {"name": "B", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}},
        {"name": "C", "valueFrom": {"secretKeyRef": {"name": "gone", "key": "k"}}}]})
    existing = {"hf": {"vlm-operator.dev/referable": "true"},
                "db": {"vlm-operator.dev/referable": "false", "team": "a"}}
    problems, _ = validate(spec, rules, labels_of(existing))
    assert problems == [
        "spec.vllm.env[1].valueFrom.secretKeyRef.name: Secret 'db' is not labelled "
        f"{LABEL}; the operator's policy only lets a VLMDeployment use Secrets labelled for it",
        "spec.vllm.env[3].valueFrom.secretKeyRef.name: Secret 'gone' does not exist; the "
        f"operator's policy only allows Secrets labelled {LABEL}"]
    existing["db"]["vlm-operator.dev/referable"] = "true"
    existing["gone"] = {"vlm-operator.dev/referable": "true"}
    assert validate(spec, rules, labels_of(existing))[0] == []
    # a key alone: any value
    assert validate(spec, AdminPolicy(secret_label="team"), labels_of(
        {n: {"team": "x"} for n in ("hf", "db", "gone")}))[0] == []


def test_policy_is_checked_only_on_an_otherwise_valid_spec():
    calls = []
    problems, _ = validate(cr(replicas=-1, hfTokenSecretRef={"name": "hf"}),
                           AdminPolicy(secret_label=LABEL), calls.append)
    assert problems == ["spec.replicas: -1 is less than the minimum of 0"] and calls == []


def test_violations_make_spec_valid_false():
    problems, _ = validate(cr(image="evil/x:v0.20.2"), AdminPolicy(image_prefixes=("ok/",)))
    st = get_status(name="m", generation=1, old={}, vlmd=None, problems=problems,
                    deployment=None, pods=[], now="2026-01-01T00:00:00Z", reports=[])
    (cond,) = [c for c in st["conditions"] if c["type"] == "SpecValid"]
    assert (cond["status"], cond["reason"]) == ("False", "InvalidSpec")
    assert cond["message"].startswith("spec.image: 'evil/x:v0.20.2' is not allowed")


def test_autoscaling_priority_is_bounded_by_the_allowed_priority_classes():
    """Allowing only `low` must not let a tenant rank first for free GPUs through
    spec.autoscaling.priority."""
    values = {"low": 100, "mid": 1000}.get
    rules = AdminPolicy(priority_classes=("low",))
    ranked = cr(autoscaling={"enabled": True, "priority": 1000000})
    assert validate(ranked, AdminPolicy(), priority_value=values)[0] == []  # no rule: any
    assert validate(ranked, rules, priority_value=values)[0] == [
        "spec.autoscaling.priority: 1000000 ranks above the highest allowed PriorityClass value "
        "(100); the operator's policy allows the PriorityClasses 'low', and this rank decides "
        "who gets free GPUs first"]
    assert validate(cr(autoscaling={"priority": 100}), rules, priority_value=values)[0] == []
    assert validate(cr(autoscaling={"priority": 999}), AdminPolicy(
        priority_classes=("low", "mid")), priority_value=values)[0] == []
    # an allowed class that does not exist allows no explicit rank
    problems, _ = validate(cr(autoscaling={"priority": 1}), AdminPolicy(
        priority_classes=("gone",)), priority_value=values)
    assert problems and "none of them exists" in problems[0]


def test_code_options_are_refused_when_the_admin_asks():
    spec = cr(vllm={"extraArgs": ["--enforce-eager", "--trust-remote-code",
                                  "--worker-extension-cls=evil.Ext"],
                    "env": [{"name": "PYTHONPATH", "value": "/tmp/x"},
                            {"name": "VLLM_SERVER_DEV_MODE", "value": "1"},
                            {"name": "HF_ENDPOINT", "value": "http://hub.evil"}]})
    assert validate(spec, AdminPolicy())[0] == []  # off by default
    problems, _ = validate(spec, AdminPolicy(deny_code_options=True))
    assert [p.split(":")[0] for p in problems] == [
        "spec.vllm.extraArgs[1]", "spec.vllm.extraArgs[2]", "spec.vllm.env[0].name",
        "spec.vllm.env[1].name", "spec.vllm.env[2].name"]
    assert problems[0] == ("spec.vllm.extraArgs[1]: --trust-remote-code is not allowed by the "
                           "operator's policy: it runs the model repository's own Python code")


def test_modes_not_served_are_refused():
    rules = AdminPolicy(autoscaling_modes=("Builtin",))
    assert validate(cr(autoscaling={"enabled": True}), rules)[0] == []
    assert validate(cr(autoscaling={"enabled": False, "mode": "HPA"}), rules)[0] == []
    problems, _ = validate(cr(autoscaling={"enabled": True, "mode": "HPA"}), rules)
    assert problems == ["spec.autoscaling.mode: HPA is not served by this installation (it "
                        "serves 'Builtin'; the admin enables modes with the chart's autoscaling "
                        "values)"]


def test_keda_queries_only_a_prometheus_the_admin_named():
    """keda-operator GETs the address from its own network position: the tenant may not pick
    it (cloud metadata, cluster-internal services, another team's Prometheus)."""
    keda = {"enabled": True, "mode": "KEDA"}
    admin = AdminPolicy(prometheus_addresses=("http://prom.monitoring:9090",
                                                "http://prom2.monitoring:9090"))
    assert validate(cr(autoscaling=keda), admin)[0] == []
    assert admin_policy.prometheus_address(cr(autoscaling=keda)["spec"], admin) == \
        "http://prom.monitoring:9090"
    second = cr(autoscaling={**keda, "prometheus": {"serverAddress":
                                                    "http://prom2.monitoring:9090"}})
    assert validate(second, admin)[0] == []
    assert admin_policy.prometheus_address(second["spec"], admin) == "http://prom2.monitoring:9090"
    own = cr(autoscaling={**keda, "prometheus": {"serverAddress": "http://169.254.169.254/"}})
    assert validate(own, admin)[0] == [
        "spec.autoscaling.prometheus.serverAddress: 'http://169.254.169.254/' is not a "
        "Prometheus the operator's policy allows (KEDA queries it from its own network "
        "position); use one of 'http://prom.monitoring:9090', 'http://prom2.monitoring:9090' "
        "or leave it unset"]
    assert validate(own, AdminPolicy())[0][0].endswith(
        "the admin sets the allowed ones with the chart value policy.kedaPrometheusAddresses")
    assert validate(cr(autoscaling=keda), AdminPolicy())[0] == [
        "spec.autoscaling.prometheus.serverAddress: KEDA mode needs a Prometheus, and the "
        "operator has none configured (chart value policy.kedaPrometheusAddresses, flag "
        "--keda-prometheus-address)"]


def test_run_flags():
    args = build_parser().parse_args([
        "run", "--allowed-image-prefix", "a/", "--allowed-image-prefix", "b/",
        "--allowed-priority-class", "gpu", "--secret-label", LABEL])
    assert (args.image_prefixes, args.priority_classes, args.secret_label) == (
        ["a/", "b/"], ["gpu"], LABEL)
    from vlm_operator.runner import get_policy
    assert get_policy(args) == AdminPolicy(("a/", "b/"), ("gpu",), LABEL)
    args = build_parser().parse_args([
        "run", "--deny-code-options", "--autoscaling-mode", "Builtin", "--autoscaling-mode",
        "KEDA", "--keda-prometheus-address", "http://p:9090"])
    assert get_policy(args) == AdminPolicy(
        deny_code_options=True, autoscaling_modes=("Builtin", "KEDA"),
        prometheus_addresses=("http://p:9090",))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--autoscaling-mode", "Manual"])
    for bad in ("bad key", "=x", "a/b/c=d"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["run", "--secret-label", bad])
