"""Validation of spec.vllm, the engine: its shape (tensor parallelism against the GPUs, the
processor kwargs as JSON, the media domains), the `vllm serve` flags in extraArgs against those
the operator derives from the spec or that put a secret on the command line, in every spelling
vLLM accepts (api/vllm_flags.py), and the container's environment (the names the operator
sets, secrets as literals, and vLLM's logging settings the operator's log reading depends on).
"""

from __future__ import annotations

import json
import re
from typing import Any

from vlm_operator.api import log_signatures, vllm_flags
from vlm_operator.api.crd_spec import VALUE_FLAGS
from vlm_operator.api.schema import section

POOL_SIZE_ENV = "VLM_TOKENIZER_POOL_SIZE"

# Flags the operator derives from spec fields; a second copy in extraArgs would conflict.
MANAGED_FLAGS = {
    "--model": "set spec.model instead",
    "--port": "the operator always serves on port 8000 (port name http)",
    "--served-model-name": "set spec.servedModelName instead",
    "--revision": "set spec.revision instead",
    **{flag: f"set spec.vllm.{field} instead" for field, (flag, _) in VALUE_FLAGS.items()},
    "--tensor-parallel-size": "set spec.vllm.tensorParallelSize instead",
    "-tp": "set spec.vllm.tensorParallelSize instead",
    "--limit-mm-per-prompt": "set spec.vllm.limitMmPerPrompt instead",
    "--mm-processor-kwargs": "set spec.vllm.mmProcessorKwargs instead",
    "--renderer-num-workers": "set spec.rendererNumWorkers instead",
    "--allowed-media-domains": "set spec.vllm.allowedMediaDomains instead",
    "--hf-token": "use spec.hfTokenSecretRef: a token on the command line is visible to "
                  "anyone who can read the pod",
}
# Flags that take a secret: on the command line it is in the pod spec, which anyone who can
# read pods reads.
SECRET_FLAGS = {
    "--api-key": "set VLLM_API_KEY in spec.vllm.env from a Secret (valueFrom.secretKeyRef)",
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
_SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|APIKEY|CREDENTIALS?)$", re.I)


def engine_problems(spec: dict) -> list[str]:
    problems = []
    engine = section(spec, "vllm")
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
        problems += _arg_problems(f"spec.vllm.extraArgs[{i}]", arg)
    domains = engine.get("allowedMediaDomains")
    if isinstance(domains, list) and "*" in domains and len(domains) > 1:
        problems.append("spec.vllm.allowedMediaDomains: \"*\" allows any host and must be the "
                        "only entry")
    problems += _env_problems(engine.get("env"))
    return problems


def _arg_problems(where: str, arg: str) -> list[str]:
    if flag := vllm_flags.listed_flag(arg, MANAGED_FLAGS):
        return [f"{where}: {vllm_flags.spelled(arg, flag)} is managed by the operator: "
                f"{MANAGED_FLAGS[flag]}"]
    if flag := vllm_flags.listed_flag(arg, SECRET_FLAGS):
        return [f"{where}: {vllm_flags.spelled(arg, flag)} takes a secret, which on the command "
                f"line anyone who can read the pod reads: {SECRET_FLAGS[flag]} instead"]
    if flag := vllm_flags.listed_flag(arg, (vllm_flags.CONFIG_FLAG,)):
        return [f"{where}: {vllm_flags.spelled(arg, flag)} reads more flags from a file in the "
                "pod, which the operator cannot read: the flags it manages and those its policy "
                "denies would go unchecked; put the flags in spec.vllm.extraArgs"]
    return []


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
    vLLM's header (logs/matcher.py), which these settings decide."""
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


def engine_warnings(spec: dict) -> list[str]:
    """What the engine's settings leave the operator unable to see."""
    warnings = []
    env = section(spec, "vllm").get("env")
    for i, var in enumerate(env if isinstance(env, list) else []):
        if isinstance(var, dict) and var.get("name") == LOGGING_CONFIG_ENV:
            warnings.append(
                f"spec.vllm.env[{i}]: {LOGGING_CONFIG_ENV} replaces vLLM's log format; log-based "
                "detection (engine death, tokenizer retries, the tokenizer pool's startup line) "
                "reads only lines that keep vLLM's header, and pods whose lines it cannot read "
                "are reported with LogDetectionOff=True")
    return warnings
