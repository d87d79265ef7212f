"""The health signals the operator acts on, each declared once: its spec.health field, the
signatures that count towards it, where it is found, its defaults, and whether it proves the pod
serves nothing. The CRD's spec.health schema (crd_health.py), its validation
(validation_health.py), the health policy the remediation reads (remediation/policy.py) and
the log signature catalogue's entries (log_signatures.py: a test ties each log signal to a
catalogue entry) are derived from this table. A new signal is one entry here, its matcher (a
log signature) or its detector, and its tests. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from vlm_operator.api.actions import Action

LOG, WATCH = "log", "watch"  # found in the pod's log | by the stall watch (stalls/watch.py)


@dataclass(frozen=True, slots=True)
class HealthSignal:
    field: str  # its spec.health key
    signatures: tuple[str, ...]  # the detections that count towards it
    source: str  # LOG or WATCH: a log replay never refills a WATCH signal's window
    what: str  # for the schema: "... shows up in a pod's log" / what it is
    serves_nothing: bool  # proves the pod serves nothing, whatever its readiness says
    threshold: int = 1  # defaults of a LOG signal's policy
    window_s: int = 60
    action: Action = Action.RESTART


SIGNALS: tuple[HealthSignal, ...] = (
    HealthSignal("tokenizerRetry", ("tokenizer_retry", "tokenizer_borrow_error"), LOG,
                 "`Failed to acquire tokenizer` retry warnings", serves_nothing=False,
                 threshold=5),
    HealthSignal("engineDead", ("engine_dead",), LOG, "engine death (EngineDeadError)",
                 serves_nothing=True),
    # a sticky CUDA error loses the process's CUDA context: its engine dies with it
    HealthSignal("gpuError", ("gpu_error",), LOG,
                 "a GPU or driver fault (a CUDA error such as an illegal memory access, an "
                 "uncorrectable ECC error, an unspecified launch failure; NCCL's unhandled cuda "
                 "error) as the first exception of a traceback vLLM logs; with recovery "
                 "InPlace the pod is replaced by a new one, never restarted in place on the "
                 "same GPU", serves_nothing=True),
    HealthSignal("engineStalled", ("engine_stalled",), WATCH, "a hung engine",
                 serves_nothing=True),
    HealthSignal("apiUnresponsive", ("api_unresponsive",), WATCH,
                 "an API server that no longer answers", serves_nothing=True),
)

FIELDS = tuple(s.field for s in SIGNALS)  # spec.health's policies with an action
# signature -> the spec.health field whose policy applies (extraSignatures add their own)
SIGNATURE_FIELD = {sig: s.field for s in SIGNALS for sig in s.signatures}
NOT_FROM_LOG = tuple(sig for s in SIGNALS if s.source == WATCH for sig in s.signatures)
NOT_SERVING = tuple(sig for s in SIGNALS if s.serves_nothing for sig in s.signatures)


def signal(field: str) -> HealthSignal:
    return next(s for s in SIGNALS if s.field == field)
