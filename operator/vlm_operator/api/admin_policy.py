"""The cluster admin's policy on what a VLMDeployment may ask for (`vlm-operator run` flags,
the chart's `policy` values): allowed image prefixes, allowed PriorityClasses (which also bound
spec.autoscaling.priority), Secrets referable only when labelled for it, options that run code
of the tenant's choosing, the autoscaling modes this installation serves, and the Prometheus
KEDA may query. All off by default, except that KEDA queries only a Prometheus the admin named.

A VLMDeployment makes the operator create pods, so without a policy its author gets what a
Deployment author gets in the namespace (docs/security.md). Violations are spec problems:
SpecValid=False with a message naming the field and the rule, and nothing is rolled out.
`problems` decides (pure); the API reads its rules need (a Secret's labels, a PriorityClass's
value) are k8s/kube.py's `secret_labels` and `priority_value`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vlm_operator.api import crd, vllm_flags

# Options that make a vLLM pod run code or fetch models chosen at run time rather than what the
# image holds: an allowed image does not bound the code a pod runs while these are allowed.
CODE_ARGS = {
    "--trust-remote-code": "runs the model repository's own Python code",
    "--worker-extension-cls": "imports a class of the tenant's choosing into every worker",
    "--worker-cls": "imports a class of the tenant's choosing as the worker",
    "--tool-parser-plugin": "imports a Python file of the tenant's choosing",
    "--middleware": "imports ASGI middleware of the tenant's choosing",
    "--logits-processors": "imports logits processors of the tenant's choosing",
}
CODE_ENV = {
    "PYTHONPATH": "puts modules of the tenant's choosing ahead of the image's",
    "PYTHONHOME": "replaces the image's Python",
    "LD_PRELOAD": "loads a shared library of the tenant's choosing into every process",
    "HF_ENDPOINT": "fetches models (and with --trust-remote-code, their code) from another hub",
    "VLLM_SERVER_DEV_MODE": "serves vLLM's development endpoints (collective RPC, sleep, "
                            "cache resets) to every client",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "lets clients load adapters at run time",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "unpickles messages between vLLM's processes",
}


@dataclass(frozen=True)
class AdminPolicy:
    image_prefixes: tuple[str, ...] = ()
    priority_classes: tuple[str, ...] = ()
    secret_label: str = ""  # "key=value" or "key" (any value); "": any Secret may be used
    deny_code_options: bool = False  # refuse CODE_ARGS and CODE_ENV
    # the autoscaling modes this installation serves (its RBAC covers their objects)
    autoscaling_modes: tuple[str, ...] = tuple(crd.AUTOSCALING_MODES)
    # The Prometheus servers KEDA may query, the first used when the spec names none.
    prometheus_addresses: tuple[str, ...] = ()

    @property
    def secret_selector(self) -> tuple[str, str | None] | None:
        if not self.secret_label:
            return None
        key, eq, value = self.secret_label.partition("=")
        return key, (value if eq else None)


def image_allowed(image: str, prefixes: tuple[str, ...]) -> bool:
    """`image` starts with a prefix at a boundary: `reg.example/vllm` allows
    `reg.example/vllm:v1` and `reg.example/vllm/x`, never `reg.example/vllm-evil`."""
    for prefix in prefixes:
        if image == prefix or (image.startswith(prefix) and (
                prefix[-1] in "/:@" or image[len(prefix)] in "/:@")):
            return True
    return False


def secret_refs(spec: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(field, Secret name) for every Secret the pods would read."""
    refs = []
    token = spec.get("hfTokenSecretRef")
    if isinstance(token, dict) and isinstance(token.get("name"), str):
        refs.append(("spec.hfTokenSecretRef.name", token["name"]))
    env = (spec.get("vllm") or {}).get("env") if isinstance(spec.get("vllm"), dict) else None
    for i, var in enumerate(env if isinstance(env, list) else []):
        ref = ((var.get("valueFrom") or {}).get("secretKeyRef") or {}) if isinstance(
            var, dict) else {}
        if isinstance(ref, dict) and isinstance(ref.get("name"), str):
            refs.append((f"spec.vllm.env[{i}].valueFrom.secretKeyRef.name", ref["name"]))
    return refs


def prometheus_address(spec: Mapping[str, Any], policy: AdminPolicy) -> str | None:
    """The Prometheus a ScaledObject queries: the spec's (checked against the policy), else
    the first the admin configured."""
    prom = (spec.get("autoscaling") or {}).get("prometheus") or {}
    chosen = prom.get("serverAddress")
    return chosen or (policy.prometheus_addresses[0] if policy.prometheus_addresses else None)


def problems(spec: Mapping[str, Any], policy: AdminPolicy,
             labels_of: Callable[[str], Mapping[str, str] | None],
             priority_of: Callable[[str], int | None] = lambda name: None) -> list[str]:
    """Every way a (schema-valid, defaulted) spec breaks the policy, as `field: why` lines.

    `labels_of(secret)` gives a Secret's labels, None when it does not exist; it is only
    called when the Secret rule is on. `priority_of(class)` gives a PriorityClass's value,
    None when it does not exist; it is only called when PriorityClasses are restricted and the
    spec sets spec.autoscaling.priority."""
    out = []
    image = spec.get("image") or crd.DEFAULT_IMAGE
    if policy.image_prefixes and not image_allowed(image, policy.image_prefixes):
        out.append(f"spec.image: {image!r} is not allowed by the operator's policy: images must "
                   f"start with one of {_listing(policy.image_prefixes)}")
    pc = (spec.get("scheduling") or {}).get("priorityClassName")
    if policy.priority_classes and pc and pc not in policy.priority_classes:
        out.append(f"spec.scheduling.priorityClassName: {pc!r} is not allowed by the operator's "
                   f"policy: allowed PriorityClasses are {_listing(policy.priority_classes)}")
    out += _priority_problems(spec, policy, priority_of)
    if policy.deny_code_options:
        out += _code_problems(spec)
    out += _autoscaling_problems(spec, policy)
    selector = policy.secret_selector
    if selector is not None:
        key, value = selector
        wanted = f"{key}={value}" if value is not None else key
        for where, name in secret_refs(spec):
            labels = labels_of(name)
            if labels is None:
                out.append(f"{where}: Secret {name!r} does not exist; the operator's policy "
                           f"only allows Secrets labelled {wanted}")
            elif key not in labels or (value is not None and labels[key] != value):
                out.append(f"{where}: Secret {name!r} is not labelled {wanted}; the operator's "
                           "policy only lets a VLMDeployment use Secrets labelled for it")
    return out


def _priority_problems(spec: Mapping[str, Any], policy: AdminPolicy,
                       priority_of: Callable[[str], int | None]) -> list[str]:
    """spec.autoscaling.priority ranks a VLMDeployment for free GPUs as a PriorityClass value
    would: where PriorityClasses are restricted, it may not rank above the highest allowed."""
    explicit = (spec.get("autoscaling") or {}).get("priority")
    if not policy.priority_classes or explicit is None:
        return []
    values = {name: value for name in policy.priority_classes
              if (value := priority_of(name)) is not None}
    highest = max(values.values(), default=None)
    if highest is not None and explicit <= highest:
        return []
    ceiling = (f"the highest allowed PriorityClass value ({highest})" if highest is not None
               else "any allowed PriorityClass (none of them exists)")
    return [f"spec.autoscaling.priority: {explicit} ranks above {ceiling}; the operator's "
            f"policy allows the PriorityClasses {_listing(policy.priority_classes)}, and this "
            "rank decides who gets free GPUs first"]


def _code_problems(spec: Mapping[str, Any]) -> list[str]:
    """Options that make the pod run code the image does not hold (CODE_ARGS, CODE_ENV)."""
    engine = spec.get("vllm") or {}
    out = []
    for i, arg in enumerate(engine.get("extraArgs") or []):
        flag = vllm_flags.listed_flag(arg, CODE_ARGS) if isinstance(arg, str) else None
        if flag:  # in any spelling vLLM accepts (api/vllm_flags.py)
            out.append(f"spec.vllm.extraArgs[{i}]: {vllm_flags.spelled(arg, flag)} is not "
                       f"allowed by the operator's policy: it {CODE_ARGS[flag]}")
    for i, var in enumerate(engine.get("env") or []):
        name = var.get("name") if isinstance(var, dict) else None
        if name in CODE_ENV:
            out.append(f"spec.vllm.env[{i}].name: {name} is not allowed by the operator's "
                       f"policy: it {CODE_ENV[name]}")
    return out


def _autoscaling_problems(spec: Mapping[str, Any], policy: AdminPolicy) -> list[str]:
    scaling = spec.get("autoscaling") or {}
    mode = crd.autoscaling_mode(spec)
    if mode is None:
        return []
    if mode not in policy.autoscaling_modes:
        return [f"spec.autoscaling.mode: {mode} is not served by this installation (it serves "
                f"{_listing(policy.autoscaling_modes) or 'no autoscaling'}; the admin enables "
                "modes with the chart's autoscaling values)"]
    if mode != "KEDA":
        return []
    chosen = (scaling.get("prometheus") or {}).get("serverAddress")
    if chosen and chosen not in policy.prometheus_addresses:
        return [f"spec.autoscaling.prometheus.serverAddress: {chosen!r} is not a Prometheus the "
                "operator's policy allows (KEDA queries it from its own network position); "
                + (f"use one of {_listing(policy.prometheus_addresses)} or leave it unset"
                   if policy.prometheus_addresses else "the admin sets the allowed ones with "
                   "the chart value policy.kedaPrometheusAddresses")]
    if not chosen and not policy.prometheus_addresses:
        return ["spec.autoscaling.prometheus.serverAddress: KEDA mode needs a Prometheus, and "
                "the operator has none configured (chart value "
                "policy.kedaPrometheusAddresses, flag --keda-prometheus-address)"]
    return []


def _listing(values: tuple[str, ...]) -> str:
    return ", ".join(repr(v) for v in values)

