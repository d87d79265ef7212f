"""Validation: every problem names its field; all of them are reported at once."""

import copy

import pytest

from vlm_operator.api import crd
from vlm_operator.api.actions import POLICY
from vlm_operator.api.validation import SpecError, parse, validate
from vlm_operator.api.versions import Version


def cr(**spec):
    body = {"model": "Qwen/Qwen3-VL-4B-Instruct", **spec}
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
            "metadata": {"name": "demo", "namespace": "ml"}, "spec": body}


def problems_of(obj):
    return validate(obj)[0]


def test_minimal_spec_gets_schema_defaults():
    vlmd = parse(cr())
    assert vlmd.spec["replicas"] == 1
    assert vlmd.spec["gpusPerReplica"] == 1
    assert vlmd.spec["rendererNumWorkers"] == 1
    assert vlmd.spec["image"] == crd.DEFAULT_IMAGE
    assert vlmd.spec["health"]["tokenizerRetry"] == {
        "threshold": 5, "windowSeconds": 60, "action": "Restart"}
    assert vlmd.spec["health"]["engineDead"]["threshold"] == 1
    assert vlmd.spec["autoscaling"]["mode"] == "Builtin"
    assert vlmd.pool_size == 3  # default image v0.33.0: 1 worker, the loop, the mm thread
    assert vlmd.namespace == "ml"
    assert vlmd.warnings == ()


def test_pool_size_is_one_per_thread_that_uses_the_tokenizer():
    """rendererNumWorkers + the event loop, + vLLM 0.29's multimodal thread (as the plugin)."""
    assert parse(cr(rendererNumWorkers=4, vllmVersion="0.28.0")).pool_size == 5
    assert parse(cr(rendererNumWorkers=64, vllmVersion="0.17.1")).pool_size == 65
    assert parse(cr(rendererNumWorkers=4, vllmVersion="0.29.0")).pool_size == 6
    assert parse(cr(rendererNumWorkers=4, vllmVersion="0.33.0")).pool_size == 6


def test_input_is_not_mutated():
    obj = cr()
    before = copy.deepcopy(obj)
    parse(obj)
    assert obj == before


@pytest.mark.parametrize("spec, expected", [
    ({"model": None}, "spec.model: None is not of type 'string'"),
    ({"replicas": -1}, "spec.replicas: -1 is less than the minimum of 0"),
    ({"gpusPerReplica": 0}, "spec.gpusPerReplica: 0 is less than the minimum of 1"),
    ({"rendererNumWorkers": 0}, "spec.rendererNumWorkers: 0 is less than the minimum of 1"),
    ({"rendererNumWorkers": 65}, "spec.rendererNumWorkers: 65 is greater than the maximum of 64"),
    ({"health": {"engineDead": {"action": "Reboot"}}},
     f"spec.health.engineDead.action: 'Reboot' is not one of {[a.value for a in POLICY]}"),
    ({"health": {"tokenizerRetry": {"threshold": 0}}},
     "spec.health.tokenizerRetry.threshold: 0 is less than the minimum of 1"),
    ({"autoscaling": {"mode": "VPA"}},
     "spec.autoscaling.mode: 'VPA' is not one of ['Builtin', 'HPA', 'KEDA']"),
    ({"vllm": {"dtype": "int3"}}, "spec.vllm.dtype: 'int3' is not one of"),
    ({"replica": 3}, "spec.replica: unknown field"),
    ({"resources": {"requests": {"memory": "lots"}}},
     "spec.resources.requests.memory: 'lots' is not a quantity"),
    ({"vllm": {"extraArgs": ["--enforce-eager", 5]}},
     "spec.vllm.extraArgs[1]: 5 is not of type 'string'"),
    ({"vllm": {"limitMmPerPrompt": {"image": -1}}},
     "spec.vllm.limitMmPerPrompt.image: -1 is less than the minimum of 0"),
    ({"hfTokenSecretRef": {"key": "token"}}, "spec.hfTokenSecretRef.name: is required"),
])
def test_schema_problems_name_the_field(spec, expected):
    found = problems_of(cr(**spec))
    assert any(p.startswith(expected) for p in found), found


def test_missing_model():
    obj = cr()
    del obj["spec"]["model"]
    assert "spec.model: is required" in problems_of(obj)


def test_missing_spec():
    obj = cr()
    del obj["spec"]
    assert "spec: is required" in problems_of(obj)


@pytest.mark.parametrize("spec, expected", [
    ({"gpusPerReplica": 2, "vllm": {"tensorParallelSize": 4}},
     "spec.vllm.tensorParallelSize: 4 is larger than spec.gpusPerReplica (2)"),
    ({"image": "vllm/vllm-openai:latest"},
     "spec.image: cannot tell the vLLM version from 'vllm/vllm-openai:latest' (tag 'latest'); "
     "set spec.vllmVersion"),
    ({"image": "vllm/vllm-openai@sha256:" + "a" * 64},
     "spec.image: cannot tell the vLLM version"),
    ({"image": "vllm/vllm-openai:v0.9.2"},
     "spec.image: vLLM 0.9.2 is older than the oldest supported version 0.11.0"),
    ({"vllmVersion": "0.10.1"}, "spec.vllmVersion: vLLM 0.10.1 is older"),
    ({"vllm": {"mmProcessorKwargs": {"x": float("nan")}}},
     "spec.vllm.mmProcessorKwargs: cannot be passed as JSON"),
    ({"vllm": {"mmProcessorKwargs": {"x": {1, 2}}}},
     "spec.vllm.mmProcessorKwargs: cannot be passed as JSON"),
    ({"vllm": {"extraArgs": ["--enforce-eager", "--port=9000"]}},
     "spec.vllm.extraArgs[1]: --port is managed by the operator"),
    ({"vllm": {"extraArgs": ["--renderer-num-workers", "8"]}},
     "spec.vllm.extraArgs[0]: --renderer-num-workers is managed by the operator: set "
     "spec.rendererNumWorkers instead"),
    ({"vllm": {"extraArgs": ["--hf-token", "hf_abc"]}},
     "spec.vllm.extraArgs[0]: --hf-token is managed by the operator: use spec.hfTokenSecretRef"),
    ({"vllm": {"env": [{"name": "HF_TOKEN", "value": "hf_abc"}]}},
     "spec.vllm.env[0].name: HF_TOKEN is set from spec.hfTokenSecretRef"),
    ({"vllm": {"env": [{"name": "VLLM_API_KEY", "value": "abc"}]}},
     "spec.vllm.env[0]: VLLM_API_KEY looks like a secret"),
    ({"vllm": {"env": [{"name": "VLM_TOKENIZER_POOL_SIZE", "value": "9"}]}},
     "spec.vllm.env[0].name: VLM_TOKENIZER_POOL_SIZE is set from spec.rendererNumWorkers"),
    ({"vllm": {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}},
     "spec.vllm.env[1].name: A is set twice"),
    ({"vllm": {"env": [{"name": "A", "value": "1",
                        "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]}},
     "spec.vllm.env[0]: set value or valueFrom, not both"),
    ({"modelCache": {"claimName": "weights", "size": "10Gi"}},
     "spec.modelCache: set exactly one of claimName"),
    ({"modelCache": {"mountPath": "/models"}}, "spec.modelCache: set exactly one of claimName"),
    ({"modelCache": {"claimName": "weights", "storageClassName": "fast"}},
     "spec.modelCache.storageClassName: only applies with size"),
    ({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}},
     "spec.autoscaling.minReplicas: 5 is larger than spec.autoscaling.maxReplicas (2)"),
    ({"autoscaling": {"enabled": True, "mode": "KEDA", "minReplicas": 0, "maxReplicas": 3}},
     "spec.autoscaling.minReplicas: 0 is not supported in KEDA mode: at zero replicas the "
     "pods' series are gone"),
    ({"autoscaling": {"enabled": True, "mode": "KEDA", "scaleDownDelaySeconds": 7200}},
     "spec.autoscaling.scaleDownDelaySeconds: 7200 is more than 3600 in KEDA mode"),
    ({"autoscaling": {"enabled": True, "mode": "HPA", "scaleDownDelaySeconds": 3601}},
     "spec.autoscaling.scaleDownDelaySeconds: 3601 is more than 3600 in HPA mode"),
    ({"autoscaling": {"enabled": True, "mode": "HPA"},
      "health": {"tokenizerRetry": {"action": "ScaleDown"}}},
     "spec.health.tokenizerRetry.action: ScaleDown is not available in HPA mode: the "
     "HorizontalPodAutoscaler owns spec.replicas"),
    ({"autoscaling": {"enabled": True, "mode": "KEDA"}, "health": {"extraSignatures": [
        {"name": "oom", "regex": "CUDA out of memory", "action": "ScaleDown"}]}},
     "spec.health.extraSignatures[0].action: ScaleDown is not available in KEDA mode"),
    ({"autoscaling": {"enabled": True, "mode": "KEDA", "prometheus": {
        "query": "sum(vllm:num_requests_waiting)"}}},
     'spec.autoscaling.prometheus.query: every selector must carry namespace="ml"'),
    ({"autoscaling": {"enabled": True, "mode": "KEDA", "prometheus": {
        "query": 'sum(x{namespace="ml"}) + sum(y{namespace=~"ml|other"})'}}},
     'spec.autoscaling.prometheus.query: every selector must carry namespace="ml" (an '
     "equality matcher) so the query reads only this namespace's series; y does not"),
    ({"vllm": {"allowedMediaDomains": ["*", "images.example.com"]}},
     'spec.vllm.allowedMediaDomains: "*" allows any host and must be the only entry'),
    ({"vllm": {"allowedMediaDomains": ["http://images.example.com"]}},
     "spec.vllm.allowedMediaDomains[0]: 'http://images.example.com' does not match"),
    ({"vllm": {"extraArgs": ["--allowed-media-domains", "x.example.com"]}},
     "spec.vllm.extraArgs[0]: --allowed-media-domains is managed by the operator: set "
     "spec.vllm.allowedMediaDomains instead"),
    ({"replicas": 1, "health": {"minAvailable": 2}},
     "spec.health.minAvailable: 2 is more than spec.replicas (1)"),
    ({"health": {"minAvailable": 1000000}},
     "spec.health.minAvailable: 1000000 is more than spec.replicas (1)"),
    ({"replicas": 5, "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6},
      "health": {"minAvailable": 3}},
     "spec.health.minAvailable: 3 is more than spec.autoscaling.minReplicas (2)"),
    ({"health": {"engineStalled": {"stallSeconds": 20, "canaryTimeoutSeconds": 20}}},
     "spec.health.engineStalled.canaryTimeoutSeconds: 20 must be less than stallSeconds (20)"),
    ({"health": {"engineStalled": {"stallSeconds": 10}}},  # the default canary timeout is 10
     "spec.health.engineStalled.canaryTimeoutSeconds: 10 must be less than stallSeconds"),
])
def test_semantic_problems_name_the_field(spec, expected):
    found = problems_of(cr(**spec))
    assert any(p.startswith(expected) for p in found), found
    with pytest.raises(SpecError) as info:
        parse(cr(**spec))
    assert info.value.problems == found


@pytest.mark.parametrize("name", ["Demo", "1demo", "demo_x", "a" * 64, "demo-"])
def test_bad_names(name):
    obj = cr()
    obj["metadata"]["name"] = name
    assert any(p.startswith("metadata.name:") for p in problems_of(obj))


def test_wrong_kind_and_api_version():
    obj = cr()
    obj["kind"], obj["apiVersion"] = "Deployment", "apps/v1"
    found = problems_of(obj)
    assert "kind: must be VLMDeployment, got 'Deployment'" in found
    assert f"apiVersion: must be {crd.API_VERSION}, got 'apps/v1'" in found


def test_not_a_mapping():
    assert problems_of(["a"]) == ["(root): a VLMDeployment must be a mapping, got list"]
    assert problems_of({"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                        "metadata": {"name": "x"}, "spec": "model"})


def test_every_problem_reported_at_once():
    found = problems_of(cr(replicas=-1, gpusPerReplica=0, image="vllm/vllm-openai:nightly",
                           vllm={"extraArgs": ["--port", "1"]},
                           health={"engineDead": {"action": "Nope"}}))
    fields = {p.split(":")[0] for p in found}
    assert {"spec.replicas", "spec.gpusPerReplica", "spec.image", "spec.vllm.extraArgs[0]",
            "spec.health.engineDead.action"} <= fields


def test_version_from_explicit_field_wins_over_tag():
    vlmd = parse(cr(image="registry.local:5000/vllm:latest", vllmVersion="0.17.1"))
    assert vlmd.version == Version(0, 17, 1)


def test_version_from_tag():
    assert parse(cr(image="vllm/vllm-openai:v0.20.2")).version == Version(0, 20, 2)
    assert parse(cr(image="registry:5000/x/vllm:0.19.1-pool2")).version == Version(0, 19, 1)


def test_newer_version_is_a_warning_not_an_error():
    vlmd = parse(cr(vllmVersion="0.40.0"))
    assert vlmd.version == Version(0, 40, 0)
    assert any(w.startswith("spec.vllmVersion: vLLM 0.40.0 is newer") for w in vlmd.warnings)


def test_limits_that_hold_the_defaults_and_scaling_to_zero():
    """minAvailable up to the replicas is fine, and so is the default minAvailable 1 with no
    replica (a budget of 1 over no pod holds nothing); autoscaling owns its own limits."""
    assert parse(cr()).spec["health"]["minAvailable"] == 1
    assert parse(cr(replicas=0)).spec["replicas"] == 0
    assert parse(cr(replicas=3, health={"minAvailable": 3}))
    assert parse(cr(autoscaling={"enabled": True, "mode": "KEDA", "minReplicas": 1,
                                 "scaleDownDelaySeconds": 3600}))
    # Builtin mode keeps its own longer delays; a disabled HPA spec is not checked
    assert parse(cr(autoscaling={"enabled": True, "scaleDownDelaySeconds": 7200}))
    assert parse(cr(autoscaling={"enabled": False, "mode": "HPA",
                                 "scaleDownDelaySeconds": 7200},
                    health={"engineDead": {"action": "ScaleDown"}}))


def test_warnings_for_risky_but_valid_specs():
    vlmd = parse(cr(replicas=3, modelCache={"size": "10Gi"}))
    assert any(w.startswith("spec.modelCache.accessModes") for w in vlmd.warnings)
    vlmd = parse(cr(replicas=3, modelCache={"size": "10Gi", "accessModes": ["ReadWriteMany"]}))
    assert vlmd.warnings == ()


def test_secret_env_from_secret_ref_is_fine():
    vlmd = parse(cr(vllm={"env": [{"name": "VLLM_API_KEY", "valueFrom": {
        "secretKeyRef": {"name": "api", "key": "key"}}}]}))
    assert vlmd.spec["vllm"]["env"][0]["name"] == "VLLM_API_KEY"


@pytest.mark.parametrize("extra, expected", [
    ([{"name": "oom", "regex": ".*OOM"}],
     "spec.health.extraSignatures[0].regex: must start with at least 3 literal characters"),
    ([{"name": "oom", "regex": "CUDA (?!out)"}],
     "spec.health.extraSignatures[0].regex: invalid regular expression for RE2 (invalid perl "
     "operator: (?!); RE2 matches in linear time and has no backreferences or lookaround: "
     "https://github.com/google/re2/wiki/Syntax"),
    ([{"name": "oom", "regex": "CUDA out of memory ("}],
     "spec.health.extraSignatures[0].regex: invalid regular expression for RE2 (missing )"),
    ([{"name": "oom", "regex": "CUDA out"}, {"name": "oom", "regex": "NCCL error"}],
     "spec.health.extraSignatures[1].name: duplicate signature name 'oom'"),
    ([{"name": "engine_dead", "regex": "CUDA out"}],
     "spec.health.extraSignatures[0].name: duplicate signature name 'engine_dead'"),
    ([{"name": "Bad-Name", "regex": "CUDA out"}],
     "spec.health.extraSignatures[0].name: 'Bad-Name' does not match"),
    ([{"name": "oom", "regex": "CUDA out", "action": "Reboot"}],
     "spec.health.extraSignatures[0].action: 'Reboot' is not one of"),
])
def test_extra_signature_problems(extra, expected):
    found = problems_of(cr(health={"extraSignatures": extra}))
    assert any(p.startswith(expected) for p in found), found


def test_nested_quantifiers_are_fine_on_re2():
    """RE2 matches them in linear time (tests/unit/api/test_extra_signature_linear_time.py)."""
    assert problems_of(cr(health={"extraSignatures": [
        {"name": "oom", "regex": "CUDA (a+)+"}, {"name": "alt", "regex": "abc(?:x|x)+y"}]})) == []


def test_extra_signatures_get_defaults():
    vlmd = parse(cr(health={"extraSignatures": [{"name": "oom", "regex": "CUDA out of memory"}]}))
    assert vlmd.spec["health"]["extraSignatures"] == [
        {"name": "oom", "regex": "CUDA out of memory", "action": "Restart", "threshold": 1,
         "windowSeconds": 60}]


def env(*pairs, **from_):
    return {"vllm": {"env": [{"name": n, "value": v} for n, v in pairs]
                     + [{"name": n, "valueFrom": {"configMapKeyRef": {"name": "c", "key": k}}}
                        for n, k in from_.items()]}}


@pytest.mark.parametrize("spec, expected", [
    (env(VLLM_LOGGING_PREFIX="prefix"),
     "spec.vllm.env[0].valueFrom: VLLM_LOGGING_PREFIX must be a literal value: the operator "
     "reads vLLM's log with it"),
    (env(("VLLM_LOGGING_PREFIX", "[vllm]\n")),
     "spec.vllm.env[0].value: VLLM_LOGGING_PREFIX must be at most 64 printable characters"),
    (env(("VLLM_LOGGING_PREFIX", "x" * 65)),
     "spec.vllm.env[0].value: VLLM_LOGGING_PREFIX must be at most 64 printable characters"),
    (env(("VLLM_CONFIGURE_LOGGING", "0")),
     "spec.vllm.env[0].value: VLLM_CONFIGURE_LOGGING=0 leaves vLLM's logging unconfigured: its "
     "lines lose the header"),
    (env(("VLLM_CONFIGURE_LOGGING", "yes")),
     "spec.vllm.env[0].value: VLLM_CONFIGURE_LOGGING must be 0 or 1, got 'yes'"),
    (env(VLLM_CONFIGURE_LOGGING="on"),
     "spec.vllm.env[0].valueFrom: VLLM_CONFIGURE_LOGGING must be a literal value"),
    (env(("A", "1"), ("VLLM_LOGGING_LEVEL", "error")),
     "spec.vllm.env[1].value: VLLM_LOGGING_LEVEL=ERROR hides the WARNING lines log-based "
     "remediation acts on"),
    (env(("VLLM_LOGGING_LEVEL", "CRITICAL")),
     "spec.vllm.env[0].value: VLLM_LOGGING_LEVEL=CRITICAL hides the WARNING lines"),
    (env(("VLLM_LOGGING_LEVEL", "loud")),
     "spec.vllm.env[0].value: VLLM_LOGGING_LEVEL 'loud' is not a log level"),
    (env(VLLM_LOGGING_LEVEL="level"),
     "spec.vllm.env[0].valueFrom: VLLM_LOGGING_LEVEL must be a literal value"),
])
def test_logging_settings_that_hide_the_log_are_refused(spec, expected):
    found = problems_of(cr(**spec))
    assert any(p.startswith(expected) for p in found), found


@pytest.mark.parametrize("pairs", [
    [("VLLM_LOGGING_PREFIX", "[vllm] ")], [("VLLM_CONFIGURE_LOGGING", "1")],
    [("VLLM_LOGGING_LEVEL", "warning")], [("VLLM_LOGGING_LEVEL", "DEBUG")],
    [("VLLM_LOGGING_COLOR", "1")],
])
def test_logging_settings_the_operator_reads_are_fine(pairs):
    vlmd = parse(cr(**env(*pairs)))
    assert vlmd.warnings == ()


def test_a_custom_logging_config_is_a_warning():
    vlmd = parse(cr(**env(("VLLM_LOGGING_CONFIG_PATH", "/etc/vllm/logging.json"))))
    assert [w.split(";")[0] for w in vlmd.warnings] == [
        "spec.vllm.env[0]: VLLM_LOGGING_CONFIG_PATH replaces vLLM's log format"]
    assert "LogDetectionOff=True" in vlmd.warnings[0]


def test_a_read_write_once_pod_claim_takes_one_pod_and_no_surge():
    one_pod = {"size": "10Gi", "accessModes": ["ReadWriteOncePod"]}
    found = problems_of(cr(replicas=2, modelCache=one_pod, health={"minAvailable": 1},
                           autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 3}))
    for field in ("spec.replicas: 2", "spec.autoscaling.maxReplicas: 3",
                  "spec.health.minAvailable: 1"):
        assert any(p.startswith(field) and "ReadWriteOncePod" in p for p in found), found
    assert problems_of(cr(replicas=1, modelCache=one_pod, health={"minAvailable": 0})) == []
    # the default minAvailable (1) surges a replacement beside a sick pod: refused too
    assert any(p.startswith("spec.health.minAvailable: 1")
               for p in problems_of(cr(replicas=1, modelCache=one_pod)))
    assert problems_of(cr(replicas=2, modelCache={"size": "10Gi"})) == []  # ReadWriteOnce
