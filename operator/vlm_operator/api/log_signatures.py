"""Log signatures, the vocabulary: the built-in catalogue (`SIGNATURES`) and the users' own
(spec.health.extraSignatures) compiled for RE2. Pure.

A signature's name is part of the API: Events, metrics and the remediation policy name it, and
a user's extra signature may not take a built-in's name. Spec validation (api/validation.py)
compiles users' signatures here, before any log is read; logs/matcher.py matches log lines
against them (its docstring has the threat model these rules serve).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import re2

SEVERITIES = ("info", "warning", "error", "critical")
# The class a signature puts its detections in, shown by `vlm-operator scan-logs` (and asked of
# the definitions it is given): restart (the engine is dead), remediate (the tokenizer race is
# live), event (for a human), record (status and metrics only). The operator does not act on
# the class: what it does about a detection is the VLMDeployment's spec.health rule for the
# signature (remediation/policy.py), and a spec's own signatures are all `remediate`.
# (Named classes, not actions: the operator's actions are api/actions.py's.)
CLASSES = ("restart", "remediate", "event", "record")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
MAX_LOGGING_PREFIX = 64  # characters of VLLM_LOGGING_PREFIX (validation refuses longer ones)


@dataclass(frozen=True, slots=True)
class Pattern:
    """One way a signature shows in the log.

    kind "line": a record-start line with a vLLM header; `files` (basenames) and `levels` limit
    where it may come from (None: any). kind "exception": the first exception line of a trusted
    traceback block; `headerless` also allows Python's own (headerless) traceback printing."""

    variant: str
    regex: re.Pattern[str] | UserRegex
    kind: str = "line"
    files: frozenset[str] | None = None
    levels: frozenset[str] | None = None
    headerless: bool = False


@dataclass(frozen=True, slots=True)
class Signature:
    name: str
    severity: str
    class_: str  # one of CLASSES (spelled "action" in scan-logs' definitions and output)
    patterns: tuple[Pattern, ...]
    merge_window_s: float = 0.0  # detections this close in time form one incident
    builtin: bool = True


def anchored(rx: str) -> re.Pattern[str]:
    return re.compile(rx + r"\Z")


def _p(variant, rx, kind="line", files=None, levels=None, headerless=False) -> Pattern:
    return Pattern(variant, anchored(rx), kind, frozenset(files) if files else None,
                   frozenset(levels) if levels else None, headerless)


_CUDA_ERROR = r"(?:torch\.AcceleratorError|RuntimeError): "
# CUDA's own texts (cudaGetErrorString) of the sticky faults a bad GPU or driver shows
_CUDA_FAULTS = (
    ("illegal_memory_access", r"CUDA error: an illegal memory access was encountered"),
    ("illegal_instruction", r"CUDA error: an illegal instruction was encountered"),
    ("launch_failure", r"CUDA error: unspecified launch failure"),
    ("misaligned_address", r"CUDA error: misaligned address"),
    ("ecc_uncorrectable", r"CUDA error: uncorrectable ECC error encountered"),
)
_DEAD_MSG = r"EngineCore encountered an issue\. See stack trace \(above\) for the root cause\."

SIGNATURES: tuple[Signature, ...] = (
    Signature("tokenizer_retry", "warning", "remediate", (
        # vllm/multimodal/processing.py (0.11 - 0.14), .../processing/context.py (0.15 - 0.20)
        _p("retry", r"Failed to acquire tokenizer in current thread\. "
                    r"Retrying \((?P<attempt>\d+)/(?P<max_tries>\d+)\)\.\.\.",
           files=("processing.py", "context.py"), levels=("WARNING",)),
    )),
    Signature("tokenizer_borrow_error", "error", "remediate", (
        _p("already_borrowed", r"RuntimeError: Already borrowed", kind="exception"),
    )),
    Signature("engine_dead", "critical", "restart", (
        _p("output_handler_failed", r"AsyncLLM output_handler failed\.",
           files=("async_llm.py",), levels=("ERROR",)),
        _p("fatal_error", r"EngineCore encountered a fatal error\.",
           files=("core.py",), levels=("ERROR",)),
        _p("failed_to_start", r"EngineCore failed to start\.",
           files=("core.py",), levels=("ERROR",)),
        # <= 0.19.1 (core_client.py)
        _p("proc_died", r"Engine core proc (?P<engine_proc>[\w.\-]+) died unexpectedly, "
                        r"shutting down client\.",
           files=("core_client.py",), levels=("ERROR",)),
        # 0.23+ (core_client.py), logged with or without the "[shutdown] " tag
        _p("mpclient_exited", r"(?:\[shutdown\] )?MPClient: engine core exited unexpectedly; "
                              r"starting cleanup",
           files=("core_client.py",), levels=("WARNING", "ERROR")),
        # --api-server-count > 1 (vllm/v1/utils.py): logged, then raised
        _p("api_servers_exception", r"Exception occurred while running API servers: "
                                    r"Engine core process (?P<engine_proc>[\w.\-]+) "
                                    r"died unexpectedly\.",
           files=("utils.py",), levels=("ERROR",)),
        _p("process_died", r"RuntimeError: Engine core process (?P<engine_proc>[\w.\-]+) "
                           r"died unexpectedly\.", kind="exception", headerless=True),
        _p("engine_dead_error", r"(?:vllm\.v1\.engine\.exceptions\.)?EngineDeadError: "
                                + _DEAD_MSG, kind="exception", headerless=True),
    ), merge_window_s=60.0),
    # A GPU or driver fault (a sticky CUDA error: the process's CUDA context is lost, the engine
    # dies with it) as the first exception of a traceback vLLM logs: the engine core's, or a
    # tensor-parallel worker's (multiproc_executor.py). torch >= 2.8 raises AcceleratorError,
    # earlier ones RuntimeError; NCCL's own wrapper (vLLM's pynccl) and torch's process group
    # word it their way. `error` names the fault for Events. The node it ran on is suspect
    # (remediation/suspect.py): a restart in place would reuse the same GPU.
    Signature("gpu_error", "critical", "restart", (
        *(_p(variant, _CUDA_ERROR + rf"(?P<error>{text})", kind="exception")
          for variant, text in _CUDA_FAULTS),
        _p("nccl_unhandled_cuda", r"RuntimeError: (?P<error>NCCL error: unhandled cuda error) "
                                  r"\(run with NCCL_DEBUG=INFO for details\)", kind="exception"),
        _p("nccl_backend_cuda", r"(?:torch\.distributed\.)?DistBackendError: NCCL error in: "
                                r"[^\s,]{1,512}:\d{1,6}, (?P<error>unhandled cuda error) "
                                r"\(run with NCCL_DEBUG=INFO for details\)"
                                r"(?:, NCCL version [\w.\-+]{1,32})?", kind="exception"),
    )),
    Signature("plugin_active", "info", "record", (
        _p("active", r"vlm-tokenizer-pool active: vllm=(?P<vllm_version>\S+) "
                     r"pool_size=(?P<pool_size>\d+) patched=(?P<patched>\S*)",
           # WARNING where vLLM's logging level hides INFO (docs/contributing.md)
           files=("plugin.py",), levels=("INFO", "WARNING")),
    )),
    Signature("plugin_inactive", "warning", "event", (
        _p("inactive", r"vlm-tokenizer-pool inactive: vllm=(?P<vllm_version>\S+) "
                       r"reason=(?P<reason>.*)", files=("plugin.py",), levels=("WARNING",)),
    )),
    # the plugin's engine heartbeat (vllm_tokenizer_pool/heartbeat.py): stall detection's input
    Signature("engine_heartbeat", "info", "record", (
        _p("beat", r"vlm-engine-heartbeat every=(?P<every>\d{1,4}(?:\.\d{1,3})?) "
                   r"steps=(?P<steps>\d{1,15}) in_flight=(?P<in_flight>\d{1,4}) "
                   r"step_s=(?P<step_s>\d{1,9}\.\d) step_tokens=(?P<step_tokens>\d{1,12}) "
                   r"running=(?P<running>\d{1,9}) waiting=(?P<waiting>\d{1,9})",
           files=("heartbeat.py",), levels=("INFO",)),
    )),
)


# ---------------------------------------------------------------- extra signatures


class SignatureConfigError(ValueError):
    """A user-supplied signature definition is invalid; the message names the field."""


_NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,62}\Z")
_FILE_RE = re.compile(r"[\w.\-]+\.py\Z")
_SPECIAL = set(".^$*+?{}[]|()\\")
MAX_EXTRA = 32
MAX_REGEX_LEN = 256
MIN_LITERAL_PREFIX = 3
RE2_MAX_MEM = 1 << 20  # per pattern: a bigger automaton is refused when the spec is validated
RE2_SYNTAX = "https://github.com/google/re2/wiki/Syntax"
_EXTRA_KEYS = {"name", "regex", "action", "severity", "files", "levels"}


def _literal_prefix_len(rx: str) -> int:
    n = i = 0
    while i < len(rx):
        c = rx[i]
        if c == "\\" and i + 1 < len(rx) and not rx[i + 1].isalnum():
            i += 2
        elif c in _SPECIAL:
            break
        else:
            i += 1
        if i < len(rx) and rx[i] in "*?{":  # the char just read is optional: not a literal
            break
        n += 1
    return n


class UserRegex:
    """A user's pattern compiled with RE2: matching time is linear in the text's length for
    every pattern RE2 accepts. Equal when the source is (log followers rebuild their scanners
    only when a VLMDeployment's signatures really changed)."""

    __slots__ = ("_compiled", "pattern")

    def __init__(self, pattern: str) -> None:
        options = re2.Options()
        options.max_mem = RE2_MAX_MEM
        options.log_errors = False  # the error reaches the user through SpecValid instead
        self.pattern = pattern
        self._compiled = re2.compile(pattern, options)

    def match(self, text: str) -> Any:
        try:
            return self._compiled.match(text)
        except UnicodeEncodeError:  # lone surrogates: RE2 reads UTF-8, which cannot hold them
            return self._compiled.match(text.encode("utf-8", "replace").decode("utf-8"))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UserRegex) and other.pattern == self.pattern

    def __hash__(self) -> int:
        return hash(self.pattern)

    def __repr__(self) -> str:
        return f"UserRegex({self.pattern!r})"


def _re2_error(exc: Exception) -> str:
    text = exc.args[0] if exc.args else exc
    return text.decode(errors="replace") if isinstance(text, bytes) else str(text)


def compile_extra_signatures(defs: Iterable[Mapping], where: str = "extraSignatures"
                             ) -> tuple[Signature, ...]:
    """Validate and compile user definitions {name, regex, action[, severity, files, levels]}.

    The regex (RE2 syntax) is matched at the start of the message of a record-start line with a
    vLLM header (never a continuation or headerless line), so it inherits the built-in
    guarantees provided it starts with a literal: mid-line user text cannot reach it."""
    out: list[Signature] = []
    seen = {s.name for s in SIGNATURES}
    defs = list(defs)
    if len(defs) > MAX_EXTRA:
        raise SignatureConfigError(f"{where}: at most {MAX_EXTRA} signatures, got {len(defs)}")
    for i, d in enumerate(defs):
        at = f"{where}[{i}]"
        if not isinstance(d, Mapping):
            raise SignatureConfigError(f"{at}: must be a mapping with name, regex, action")
        unknown = sorted(set(d) - _EXTRA_KEYS)
        if unknown:
            raise SignatureConfigError(f"{at}.{unknown[0]}: unknown field")
        name = d.get("name")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise SignatureConfigError(
                f"{at}.name: must match [a-z][a-z0-9_]{{0,62}}, got {name!r}")
        if name in seen:
            raise SignatureConfigError(f"{at}.name: duplicate signature name {name!r}")
        seen.add(name)
        class_ = d.get("action")
        if class_ not in CLASSES:
            raise SignatureConfigError(f"{at}.action: unknown class {class_!r}; one of {CLASSES}")
        severity = d.get("severity", "warning")
        if severity not in SEVERITIES:
            raise SignatureConfigError(
                f"{at}.severity: unknown severity {severity!r}; one of {SEVERITIES}")
        rx = d.get("regex")
        if not isinstance(rx, str) or not rx:
            raise SignatureConfigError(f"{at}.regex: must be a non-empty string")
        if len(rx) > MAX_REGEX_LEN:
            raise SignatureConfigError(
                f"{at}.regex: {len(rx)} characters, at most {MAX_REGEX_LEN}")
        if _literal_prefix_len(rx) < MIN_LITERAL_PREFIX:
            raise SignatureConfigError(
                f"{at}.regex: must start with at least {MIN_LITERAL_PREFIX} literal characters "
                "(it is matched at the start of the message; a leading wildcard would reach "
                "user-controlled text)")
        try:
            compiled = UserRegex(rx)
        except re2.error as e:
            raise SignatureConfigError(
                f"{at}.regex: invalid regular expression for RE2 ({_re2_error(e)}); RE2 matches "
                f"in linear time and has no backreferences or lookaround: {RE2_SYNTAX}"
            ) from None
        files = d.get("files")
        if files is not None and (not isinstance(files, list | tuple) or not files or not all(
                isinstance(f, str) and _FILE_RE.match(f) for f in files)):
            raise SignatureConfigError(
                f"{at}.files: must be a non-empty list of file names like 'core.py'")
        levels = d.get("levels")
        if levels is not None and (not isinstance(levels, list | tuple) or not levels or not all(
                lv in LEVELS for lv in levels)):
            raise SignatureConfigError(f"{at}.levels: must be a non-empty subset of {LEVELS}")
        pattern = Pattern("extra", compiled, "line", frozenset(files) if files else None,
                          frozenset(levels) if levels else None)
        out.append(Signature(name, severity, class_, (pattern,), builtin=False))
    return tuple(out)


def compile_spec_signatures(defs: Iterable[Mapping]) -> tuple[Signature, ...]:
    """A VLMDeployment's spec.health.extraSignatures, compiled. What to do about a detection
    is the CR's policy (remediation/policy.py), so the signature's own class is `remediate`."""
    return compile_extra_signatures(
        [{"name": d.get("name"), "regex": d.get("regex"), "action": "remediate",
          **{k: d[k] for k in ("levels", "files") if d.get(k)}} for d in defs],
        where="spec.health.extraSignatures")
