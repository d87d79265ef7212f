"""Validation of a VLMDeployment: the schema's checks plus what the schema cannot express.

Every problem names its field and says what is wrong; all problems are reported at once so a
user fixes a manifest in one pass. Nothing here raises anything but SpecError.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import jsonschema

from vlm_operator.api import admin_policy, crd, log_signatures, names, promql, versions
from vlm_operator.api.schema import apply_defaults

POOL_SIZE_ENV = "VLM_TOKENIZER_POOL_SIZE"

# Flags the operator derives from spec fields; a second copy in extraArgs would conflict.
MANAGED_FLAGS = {
    "--model": "set spec.model instead",
    "--port": "the operator always serves on port 8000 (port name http)",
    "--served-model-name": "set spec.servedModelName instead",
    "--revision": "set spec.revision instead",
    "--max-model-len": "set spec.vllm.maxModelLen instead",
    "--dtype": "set spec.vllm.dtype instead",
    "--tensor-parallel-size": "set spec.vllm.tensorParallelSize instead",
    "-tp": "set spec.vllm.tensorParallelSize instead",
    "--limit-mm-per-prompt": "set spec.vllm.limitMmPerPrompt instead",
    "--mm-processor-kwargs": "set spec.vllm.mmProcessorKwargs instead",
    "--renderer-num-workers": "set spec.rendererNumWorkers instead",
    "--allowed-media-domains": "set spec.vllm.allowedMediaDomains instead",
    "--hf-token": "use spec.hfTokenSecretRef: a token on the command line is visible to "
                  "anyone who can read the pod",
}

# Environment the operator sets itself.
MANAGED_ENV = {
    POOL_SIZE_ENV: "spec.rendererNumWorkers",
    "HF_TOKEN": "spec.hfTokenSecretRef",
    "HUGGING_FACE_HUB_TOKEN": "spec.hfTokenSecretRef",
    "HF_HOME": "spec.modelCache.mountPath",
    "HOME": "the operator",
    "VLLM_MEDIA_URL_ALLOW_REDIRECTS": "spec.vllm.allowedMediaDomains",
    "VLM_POD_IP": "the operator (the preStop hook reads the pod's /metrics there)",
}
# vLLM's logging settings the operator's log reading depends on (vllm/envs.py, logger.py).
LOGGING_PREFIX_ENV = "VLLM_LOGGING_PREFIX"
LOGGING_ENV = (LOGGING_PREFIX_ENV, "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_LEVEL")
LOGGING_CONFIG_ENV = "VLLM_LOGGING_CONFIG_PATH"
LOG_LEVELS = ("NOTSET", "DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# The HorizontalPodAutoscaler API (and so KEDA's) refuses stabilization windows over an hour.
HPA_MAX_WINDOW_S = 3600
# spec.health policies whose action may be ScaleDown, as (field, path in the spec).
_ACTION_FIELDS = ("tokenizerRetry", "engineDead", "engineStalled", "apiUnresponsive")
_SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|APIKEY|CREDENTIALS?)$", re.I)
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


class SpecError(ValueError):
    """A VLMDeployment that cannot be served; `problems` holds one line per bad field."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


@dataclass(frozen=True)
class VLMDeployment:
    """A validated VLMDeployment with schema defaults applied and its vLLM version resolved."""

    name: str
    namespace: str
    spec: dict[str, Any]
    version: versions.Version
    uid: str | None = None
    generation: int | None = None
    warnings: tuple[str, ...] = field(default=())

    @property
    def pool_size(self) -> int:
        """One tokenizer per thread that can use it, as the engine plugin sizes its pool: the
        renderer workers and the event loop, and from vLLM 0.29 the multimodal thread."""
        return self.spec["rendererNumWorkers"] + (2 if self.version[:2] >= (0, 29) else 1)

    @property
    def tensor_parallel_size(self) -> int:
        return self.spec["vllm"].get("tensorParallelSize") or self.spec["gpusPerReplica"]


@cache
def _spec_schema() -> dict:
    return crd.get_schema()["properties"]["spec"]


def with_defaults(spec: dict) -> dict:
    """The spec with the schema's defaults filled in, as the apiserver would store it."""
    return apply_defaults(spec, _spec_schema())


@cache
def _strict_validator() -> jsonschema.Draft7Validator:
    """The CRD schema, with unknown fields made errors (the apiserver would silently drop them)."""
    return jsonschema.Draft7Validator(_forbid_unknown(crd.get_schema()))


def _forbid_unknown(node: dict) -> dict:
    node = dict(node)
    if "properties" in node:
        node["properties"] = {k: _forbid_unknown(v) for k, v in node["properties"].items()}
        if "additionalProperties" not in node and not node.get(
                "x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
    if isinstance(node.get("items"), dict):
        node["items"] = _forbid_unknown(node["items"])
    return node


def _path(parts) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(root)"


def _schema_problems(obj: dict) -> list[str]:
    problems = []
    for err in _strict_validator().iter_errors(obj):
        where = _path(err.absolute_path)
        if err.validator == "required":
            missing = err.message.split("'")[1]
            problems.append(f"{_path([*err.absolute_path, missing])}: is required")
        elif err.validator == "additionalProperties" and err.validator_value is False:
            extra = sorted(set(err.instance) - set(err.schema.get("properties", {})))
            for key in extra:
                problems.append(f"{_path([*err.absolute_path, key])}: unknown field")
        elif err.validator == "anyOf" or err.schema.get("x-kubernetes-int-or-string"):
            problems.append(f"{where}: {err.instance!r} is not a quantity such as 4, 500m or "
                            "16Gi")
        else:
            problems.append(f"{where}: {err.message}")
    return problems


def _metadata_problems(obj: dict) -> list[str]:
    problems = []
    if obj.get("apiVersion") != names.API_VERSION:
        problems.append(f"apiVersion: must be {names.API_VERSION}, got {obj.get('apiVersion')!r}")
    if obj.get("kind") != names.KIND:
        problems.append(f"kind: must be {names.KIND}, got {obj.get('kind')!r}")
    meta = obj.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    if not isinstance(name, str) or not name:
        problems.append("metadata.name: is required")
    elif len(name) > 63 or not _DNS_1035.match(name):
        problems.append(
            f"metadata.name: {name!r} must be a DNS-1035 label (lower-case letters, digits and "
            "'-', starting with a letter, at most 63 characters): it names the Service")
    return problems


def resolve_version(spec: dict) -> tuple[versions.Version | None, list[str], list[str]]:
    """The vLLM version from spec.vllmVersion or the image tag, with problems and warnings."""
    problems: list[str] = []
    warnings: list[str] = []
    explicit = spec.get("vllmVersion")
    image = spec.get("image") or crd.DEFAULT_IMAGE
    if isinstance(explicit, str):
        version = versions.parse_version(explicit)
        where = "spec.vllmVersion"
        if version is None:
            problems.append(f"spec.vllmVersion: {explicit!r} is not a version like 0.20.2")
            return None, problems, warnings
    else:
        version = versions.version_from_image(image) if isinstance(image, str) else None
        where = "spec.image"
        if version is None:
            tag = versions.image_tag(image) if isinstance(image, str) else None
            what = f"tag {tag!r}" if tag else "no tag"
            problems.append(
                f"spec.image: cannot tell the vLLM version from {image!r} ({what}); "
                "set spec.vllmVersion")
            return None, problems, warnings
    problem = versions.support_problem(version)
    if problem:
        problems.append(f"{where}: {problem}")
        return None, problems, warnings
    if versions.is_newer_than_known(version):
        known = ".".join(map(str, versions.KNOWN_LATEST))
        warnings.append(
            f"{where}: vLLM {version} is newer than the newest version this operator knows "
            f"({known}.x); it is treated like {known}")
    return version, problems, warnings


def _section(spec: dict, key: str) -> dict:
    """spec[key] when it is a mapping, else {}: checks run even on schema-invalid input."""
    value = spec.get(key)
    return value if isinstance(value, dict) else {}


def _engine_problems(spec: dict) -> list[str]:
    problems = []
    engine = _section(spec, "vllm")
    tp, gpus = engine.get("tensorParallelSize"), spec.get("gpusPerReplica")
    if isinstance(tp, int) and isinstance(gpus, int) and tp > gpus:
        problems.append(
            f"spec.vllm.tensorParallelSize: {tp} is larger than spec.gpusPerReplica ({gpus}); "
            "each tensor-parallel rank needs its own GPU")
    if "mmProcessorKwargs" in engine:
        try:
            json.dumps(engine["mmProcessorKwargs"], allow_nan=False)
        except (TypeError, ValueError) as exc:
            problems.append(f"spec.vllm.mmProcessorKwargs: cannot be passed as JSON ({exc})")
    args = engine.get("extraArgs")
    for i, arg in enumerate(args if isinstance(args, list) else []):
        if not isinstance(arg, str):
            continue
        flag = arg.split("=", 1)[0]
        if flag in MANAGED_FLAGS:
            problems.append(f"spec.vllm.extraArgs[{i}]: {flag} is managed by the operator: "
                            f"{MANAGED_FLAGS[flag]}")
    domains = engine.get("allowedMediaDomains")
    if isinstance(domains, list) and "*" in domains and len(domains) > 1:
        problems.append("spec.vllm.allowedMediaDomains: \"*\" allows any host and must be the "
                        "only entry")
    problems += _env_problems(engine.get("env"))
    return problems


def _env_problems(env: Any) -> list[str]:
    problems = []
    seen: set[str] = set()
    for i, var in enumerate(env if isinstance(env, list) else []):
        if not isinstance(var, dict) or not isinstance(var.get("name"), str):
            continue
        name, where = var["name"], f"spec.vllm.env[{i}]"
        if name in seen:
            problems.append(f"{where}.name: {name} is set twice")
        seen.add(name)
        if name in MANAGED_ENV:
            problems.append(f"{where}.name: {name} is set from {MANAGED_ENV[name]}")
        source = var.get("valueFrom")
        if "value" in var and source is not None:
            problems.append(f"{where}: set value or valueFrom, not both")
        if isinstance(source, dict) and len(source) != 1:
            problems.append(f"{where}.valueFrom: needs exactly one of secretKeyRef, "
                            "configMapKeyRef, fieldRef")
        if "value" in var and _SECRET_NAME.search(name):
            problems.append(f"{where}: {name} looks like a secret; take it from a Secret with "
                            "valueFrom.secretKeyRef instead of a literal value")
        if name in LOGGING_ENV:
            problems += _logging_env_problems(name, var, where)
    return problems


def _logging_env_problems(name: str, var: dict, where: str) -> list[str]:
    """vLLM logging settings that would leave the operator unable to read the log: engine
    death, tokenizer retries and the tokenizer pool's startup line are read from lines with
    vLLM's header (logs/signatures.py), which these settings decide."""
    if var.get("valueFrom") is not None:
        return [f"{where}.valueFrom: {name} must be a literal value: the operator reads vLLM's "
                "log with it and cannot know a value taken from a Secret, ConfigMap or field"]
    value = var.get("value")
    if not isinstance(value, str):
        return []
    if name == LOGGING_PREFIX_ENV:
        if len(value) > log_signatures.MAX_LOGGING_PREFIX or not value.isprintable():
            return [f"{where}.value: {name} must be at most {log_signatures.MAX_LOGGING_PREFIX} "
                    "printable characters: it starts every vLLM log line and the operator "
                    "matches it exactly"]
        return []
    if name == "VLLM_CONFIGURE_LOGGING":
        try:
            on = int(value)
        except ValueError:
            return [f"{where}.value: {name} must be 0 or 1, got {value!r} (vLLM reads it as an "
                    "integer and does not start otherwise)"]
        if not on:
            return [f"{where}.value: {name}=0 leaves vLLM's logging unconfigured: its lines "
                    "lose the header (level, time, source file) the operator reads engine "
                    "deaths and tokenizer retries from, and INFO lines are dropped; leave it "
                    "unset or 1"]
        return []
    level = value.strip().upper()
    if level not in LOG_LEVELS:
        return [f"{where}.value: {name} {value!r} is not a log level; one of "
                f"{', '.join(LOG_LEVELS)} (vLLM does not start with another)"]
    if LOG_LEVELS.index(level) > LOG_LEVELS.index("WARNING"):
        return [f"{where}.value: {name}={level} hides the WARNING lines log-based remediation "
                "acts on (tokenizer retries, the tokenizer pool's inactive line) and the pool's "
                "startup line; use WARNING or lower"]
    return []


def _cache_problems(spec: dict) -> list[str]:
    cache_spec = _section(spec, "modelCache")
    if not cache_spec:
        return []
    problems = []
    has_claim, has_size = "claimName" in cache_spec, "size" in cache_spec
    if has_claim == has_size:
        problems.append("spec.modelCache: set exactly one of claimName (an existing PVC) or "
                        "size (a PVC the operator creates)")
    if has_claim:
        for key in ("storageClassName", "accessModes"):
            if key in cache_spec:
                problems.append(f"spec.modelCache.{key}: only applies with size, not claimName")
    return problems


def _signature_problems(spec: dict) -> list[str]:
    stalled = _section(_section(spec, "health"), "engineStalled")
    stall, canary = stalled.get("stallSeconds"), stalled.get("canaryTimeoutSeconds")
    problems = []
    if isinstance(stall, int) and isinstance(canary, int) and canary >= stall:
        problems.append(f"spec.health.engineStalled.canaryTimeoutSeconds: {canary} must be less "
                        f"than stallSeconds ({stall}): the canary is sent that long before a "
                        "stall is declared")
    extra = _section(spec, "health").get("extraSignatures")
    if not isinstance(extra, list) or not all(isinstance(d, dict) for d in extra):
        return problems  # shape errors: the schema check has named them
    try:
        log_signatures.compile_spec_signatures(extra)
    except log_signatures.SignatureConfigError as exc:
        problems.append(str(exc))
    return problems


def _scaling_problems(spec: dict, namespace: str) -> list[str]:
    scaling = _section(spec, "autoscaling")
    problems = []
    low, high = scaling.get("minReplicas"), scaling.get("maxReplicas")
    if isinstance(low, int) and isinstance(high, int) and low > high:
        problems.append(f"spec.autoscaling.minReplicas: {low} is larger than "
                        f"spec.autoscaling.maxReplicas ({high})")
    mode = crd.autoscaling_mode(spec)
    if mode in ("HPA", "KEDA"):
        owner = "the HorizontalPodAutoscaler" if mode == "HPA" else "KEDA's HorizontalPodAutoscaler"
        delay = scaling.get("scaleDownDelaySeconds")
        if isinstance(delay, int) and delay > HPA_MAX_WINDOW_S:
            problems.append(
                f"spec.autoscaling.scaleDownDelaySeconds: {delay} is more than "
                f"{HPA_MAX_WINDOW_S} in {mode} mode: it becomes {owner}'s scale-down "
                f"stabilization window, which the API refuses above {HPA_MAX_WINDOW_S} s; use "
                f"{HPA_MAX_WINDOW_S} or less, or Builtin mode")
        for where, action in _actions(spec):
            if action == "ScaleDown":
                problems.append(
                    f"{where}: ScaleDown is not available in {mode} mode: {owner} owns "
                    "spec.replicas and would restore the lowered count at once (the pod would "
                    "only be restarted after a drain); use Restart")
    if mode == "KEDA":
        if low == 0:
            problems.append(
                "spec.autoscaling.minReplicas: 0 is not supported in KEDA mode: at zero "
                "replicas the pods' series are gone, so the query reads nothing and the "
                "ScaledObject would never scale back up; use 1 or more")
        query = _section(scaling, "prometheus").get("query")
        if isinstance(query, str) and query:
            problems += promql.namespace_problems(query, namespace,
                                                  "spec.autoscaling.prometheus.query")
    return problems


def _actions(spec: dict) -> list[tuple[str, Any]]:
    """(field, action) of every spec.health policy."""
    health = _section(spec, "health")
    out = [(f"spec.health.{key}.action", _section(health, key).get("action"))
           for key in _ACTION_FIELDS]
    extra = health.get("extraSignatures")
    for i, sig in enumerate(extra if isinstance(extra, list) else []):
        if isinstance(sig, dict):
            out.append((f"spec.health.extraSignatures[{i}].action", sig.get("action")))
    return out


def _availability_problems(spec: dict) -> list[str]:
    """minAvailable above the replicas makes a PodDisruptionBudget that refuses every eviction
    (node drains, upgrades and the cluster autoscaler wait on it) and leaves remediation only
    replacements: refused, whether written by mistake or on purpose."""
    min_available = _section(spec, "health").get("minAvailable")
    scaling = _section(spec, "autoscaling")
    if scaling.get("enabled"):
        where, fewest = "spec.autoscaling.minReplicas", scaling.get("minReplicas")
        what = "the fewest replicas autoscaling may leave"
    else:
        where, fewest, what = "spec.replicas", spec.get("replicas"), "the replicas asked for"
    if not isinstance(min_available, int) or not isinstance(fewest, int):
        return []
    most = max(1, fewest)  # no replica: a PodDisruptionBudget of 1 holds nothing
    if min_available <= most:
        return []
    return [f"spec.health.minAvailable: {min_available} is more than {where} ({fewest}), "
            f"{what}: the PodDisruptionBudget would refuse every eviction, so node drains "
            f"could never finish; at most {most}"]


def _warnings(spec: dict) -> list[str]:
    warnings = []
    env = _section(spec, "vllm").get("env")
    for i, var in enumerate(env if isinstance(env, list) else []):
        if isinstance(var, dict) and var.get("name") == LOGGING_CONFIG_ENV:
            warnings.append(
                f"spec.vllm.env[{i}]: {LOGGING_CONFIG_ENV} replaces vLLM's log format; log-based "
                "detection (engine death, tokenizer retries, the tokenizer pool's startup line) "
                "reads only lines that keep vLLM's header, and pods whose lines it cannot read "
                "are reported with LogDetectionOff=True")
    replicas = spec.get("replicas")
    cache_spec, scaling = _section(spec, "modelCache"), _section(spec, "autoscaling")
    high = scaling.get("maxReplicas") if scaling.get("enabled") else None
    most = max(replicas if isinstance(replicas, int) else 1,
               high if isinstance(high, int) else 1)
    if "size" in cache_spec and most > 1 and \
            cache_spec.get("accessModes", ["ReadWriteOnce"]) == ["ReadWriteOnce"]:
        warnings.append("spec.modelCache.accessModes: ReadWriteOnce with more than one replica "
                        "only works when all pods land on one node; use ReadWriteMany")
    return warnings


def validate(obj: Any, rules: admin_policy.Policy | None = None,
             secret_labels: Callable[[str], Mapping[str, str] | None] | None = None,
             priority_value: Callable[[str], int | None] | None = None
             ) -> tuple[list[str], list[str]]:
    """All problems and warnings of a VLMDeployment object, as `field: what is wrong` lines.

    With the operator's policy (`rules`), a spec that is otherwise valid is also checked
    against it; `secret_labels(name)` reads a Secret's labels for its Secret rule,
    `priority_value(name)` a PriorityClass's value for its priority rule."""
    if not isinstance(obj, dict):
        return [f"(root): a VLMDeployment must be a mapping, got {type(obj).__name__}"], []
    problems = _metadata_problems(obj) + _schema_problems(obj)
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return problems, []
    spec = with_defaults(spec)
    _, version_problems, warnings = resolve_version(spec)
    problems += version_problems + _engine_problems(spec) + _cache_problems(spec)
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    namespace = meta.get("namespace") or "default"
    problems += _scaling_problems(spec, namespace) + _availability_problems(spec)
    problems += _signature_problems(spec)
    if rules is not None and not problems:
        problems = admin_policy.problems(spec, rules, secret_labels or (lambda _: None),
                                   priority_value or (lambda _: None))
    return list(dict.fromkeys(problems)), warnings + _warnings(spec)


def parse(obj: Any) -> VLMDeployment:
    """A validated VLMDeployment, or SpecError naming every bad field."""
    problems, warnings = validate(obj)
    if problems:
        raise SpecError(problems)
    spec = with_defaults(obj["spec"])
    version, _, _ = resolve_version(spec)
    meta = obj["metadata"]
    return VLMDeployment(
        name=meta["name"],
        namespace=meta.get("namespace") or "default",
        spec=spec,
        version=version,
        uid=meta.get("uid"),
        generation=meta.get("generation"),
        warnings=tuple(warnings),
    )
