"""Validation of a VLMDeployment: the schema's checks plus what the schema cannot express.

Every problem names its field and says what is wrong; all problems are reported at once so a
user fixes a manifest in one pass. Nothing here raises anything but SpecError. This module holds
the entry points (validate, parse), the schema, metadata, version and model cache checks; the
sections have their own: validation_engine.py (spec.vllm: flags, environment, logging),
validation_health.py (spec.health), validation_scaling.py (spec.autoscaling).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import jsonschema

from vlm_operator.api import admin_policy, crd, names, versions
from vlm_operator.api.schema import apply_defaults, section

# the parts' names, for their readers (children.py, logs/stream.py)
from vlm_operator.api.validation_engine import (  # noqa: F401
    LOGGING_PREFIX_ENV,
    POOL_SIZE_ENV,
    engine_problems,
    engine_warnings,
)
from vlm_operator.api.validation_health import availability_problems, signature_problems
from vlm_operator.api.validation_scaling import scaling_problems

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


def _cache_problems(spec: dict) -> list[str]:
    cache_spec = section(spec, "modelCache")
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


def _one_pod_problems(spec: dict) -> list[str]:
    """A ReadWriteOncePod claim is mounted by one pod at a time: a second replica, a surge
    replacement beside a sick pod, or a rolling update's new pod beside the old one could never
    start (Pending, or ContainerCreating with no error the operator sees). Refused: one
    replica, and minAvailable 0, so a sick pod is restarted (deleted, then the new pod mounts
    the claim) rather than replaced first."""
    cache_spec = section(spec, "modelCache")
    if "size" not in cache_spec or "ReadWriteOncePod" not in (cache_spec.get("accessModes")
                                                              or []):
        return []
    why = ("with spec.modelCache.accessModes ReadWriteOncePod only one pod may mount the claim "
           "at a time")
    problems = []
    replicas = spec.get("replicas")
    if isinstance(replicas, int) and replicas > 1:
        problems.append(f"spec.replicas: {replicas} replicas, but {why}; at most 1 (or use "
                        "ReadWriteOnce or ReadWriteMany)")
    scaling = section(spec, "autoscaling")
    high = scaling.get("maxReplicas")
    if scaling.get("enabled") and isinstance(high, int) and high > 1:
        problems.append(f"spec.autoscaling.maxReplicas: {high}, but {why}; at most 1")
    min_available = section(spec, "health").get("minAvailable")
    if isinstance(min_available, int) and min_available > 0:
        problems.append(f"spec.health.minAvailable: {min_available}, but {why}: a replacement "
                        "surged beside a sick pod could never start; set 0 (a sick pod is "
                        "restarted, deleted before its new pod starts)")
    return problems


def _cache_warnings(spec: dict) -> list[str]:
    warnings = []
    replicas = spec.get("replicas")
    cache_spec, scaling = section(spec, "modelCache"), section(spec, "autoscaling")
    high = scaling.get("maxReplicas") if scaling.get("enabled") else None
    most = max(replicas if isinstance(replicas, int) else 1,
               high if isinstance(high, int) else 1)
    if "size" in cache_spec and most > 1 and \
            cache_spec.get("accessModes", ["ReadWriteOnce"]) == ["ReadWriteOnce"]:
        warnings.append("spec.modelCache.accessModes: ReadWriteOnce with more than one replica: "
                        "every replica is placed on the claim's node (pod affinity), and one "
                        "that does not fit there stays Pending; use ReadWriteMany to spread "
                        "them")
    return warnings


def validate(obj: Any, rules: admin_policy.AdminPolicy | None = None,
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
    problems += version_problems + engine_problems(spec) + _cache_problems(spec)
    problems += _one_pod_problems(spec)
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    namespace = meta.get("namespace") or "default"
    name = meta.get("name") if isinstance(meta.get("name"), str) else ""
    problems += scaling_problems(spec, namespace, name) + availability_problems(spec)
    problems += signature_problems(spec)
    if rules is not None and not problems:
        problems = admin_policy.problems(spec, rules, secret_labels or (lambda _: None),
                                   priority_value or (lambda _: None))
    return list(dict.fromkeys(problems)), warnings + engine_warnings(spec) + _cache_warnings(spec)


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
