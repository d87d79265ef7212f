"""The CRD's spec.health: how the operator reacts to failure signatures in the vLLM logs, a
stalled engine and an unresponsive API server, and the limits on what it does about them."""

from __future__ import annotations

from vlm_operator.api import schema as s
from vlm_operator.api.actions import POLICY, policy_help
from vlm_operator.api.health_signals import LOG, SIGNALS, signal

POLICY_VALUES = [a.value for a in POLICY]  # spec.health's action fields, as the schema lists them


def signature_policy(what: str, threshold: int, window: int, action: str) -> s.Schema:
    return s.obj(
        f"What to do when {what} shows up in a pod's log.",
        {
            "threshold": s.integer(
                "Detections within windowSeconds that trigger the action.",
                default=threshold, minimum=1, maximum=10000),
            "windowSeconds": s.integer(
                "Length of the sliding window the detections are counted in.",
                default=window, minimum=1, maximum=86400),
            "action": s.string(policy_help(), default=action, enum=POLICY_VALUES),
        },
        default={},
    )


def health() -> s.Schema:
    return s.obj(
        "How the operator reacts to failure signatures in the vLLM logs.",
        {
            **{sig.field: signature_policy(sig.what, sig.threshold, sig.window_s,
                                           sig.action.value)
               for sig in SIGNALS if sig.source == LOG},
            "engineStalled": s.obj(
                "A hung engine: /health still answers but nothing progresses. Where the "
                "vlm-operator plugin runs, its engine heartbeat (a log line every 5 s "
                "from the engine's step loop) decides: a stall is steps standing still "
                "with requests waiting for stallSeconds, one step running past "
                "stallSeconds + its tokens / minTokensPerSecond, or a heartbeat that "
                "stopped while the log went on. Otherwise, when a pod's progress "
                "counters (vllm:generation_tokens_total, vllm:prompt_tokens_total, "
                "vllm:request_success_total) stand still, the operator sends it a "
                "canary, a 1-token completion (request id vlm-operator-canary-*); no "
                "progress and no answer for stallSeconds is a stall. An idle pod "
                "without the heartbeat costs one canary per stallSeconds minus "
                "canaryTimeoutSeconds; a busy one none.",
                {
                    "stallSeconds": s.integer(
                        "Seconds without progress or a canary answer that make a stall.",
                        default=30, minimum=10, maximum=3600),
                    "minTokensPerSecond": s.integer(
                        "The slowest a working engine computes the tokens of one step "
                        "(prompt chunks, decodes and encoder inputs): a step the "
                        "heartbeat reports running may take stallSeconds + its tokens "
                        "/ this before it counts as stalled. Lower it for slow hardware "
                        "(CPU serving).", default=50, minimum=1, maximum=1000000),
                    "canaryTimeoutSeconds": s.integer(
                        "How long the canary may take; it is sent this long before "
                        "stallSeconds run out, so less than stallSeconds.",
                        default=10, minimum=1, maximum=600),
                    "action": s.string("What to do about a stalled pod (as for the "
                                       "other signals).",
                                       default=signal("engineStalled").action.value,
                                       enum=POLICY_VALUES),
                },
                default={},
            ),
            "apiUnresponsive": s.obj(
                "An API server that no longer answers (its event loop blocked): the "
                "operator's /metrics read and then a /health check (5 s) both time out "
                "on connections the pod accepted, and the kubelet agrees (the pod is not "
                "Ready). A pod the operator cannot connect to is never acted on "
                "(PodsReachable). Reported apart from engineStalled.",
                {
                    "timeouts": s.integer(
                        "Consecutive checks where both timed out that trigger the "
                        "action.", default=3, minimum=1, maximum=100),
                    "action": s.string("What to do about it.",
                                       default=signal("apiUnresponsive").action.value,
                                       enum=POLICY_VALUES),
                },
                default={},
            ),
            "extraSignatures": s.array(
                "Your own failure signatures: a regular expression matched at the start "
                "of the message after vLLM's log header (never inside user text such as "
                "prompts), counted and acted on like the built-in ones.",
                s.obj("A failure signature.", {
                    "name": s.string("Signature name, e.g. cuda_oom.",
                                     pattern=r"^[a-z][a-z0-9_]{0,62}$"),
                    "regex": s.string(
                        "RE2 regular expression (https://github.com/google/re2/wiki/"
                        "Syntax), matched from the start of the message in time linear "
                        "in its length: no backreferences or lookaround, and \\z (not "
                        "\\Z) for the end. Must start with at least 3 literal "
                        "characters; the operator refuses other patterns with "
                        "SpecValid=False.",
                        min_length=3, max_length=256),
                    "action": s.string("What to do at the threshold.",
                                       default="Restart", enum=POLICY_VALUES),
                    "threshold": s.integer("Detections within windowSeconds that "
                                           "trigger the action.", default=1,
                                           minimum=1, maximum=10000),
                    "windowSeconds": s.integer("Length of the sliding window.",
                                               default=60, minimum=1, maximum=86400),
                    "levels": s.array("Log levels it applies to (default: all).",
                                      s.string("A level.", enum=[
                                          "DEBUG", "INFO", "WARNING", "ERROR",
                                          "CRITICAL"])),
                    "files": s.array("vLLM source file names it applies to, e.g. "
                                     "core.py (default: all).",
                                     s.string("A file name.")),
                }, required=["name", "regex"]),
                max_items=32),
            "maxRestartsPerHour": s.integer(
                "Most restarts per hour for the whole VLMDeployment; when spent the "
                "operator sets Degraded instead of flapping.",
                default=6, minimum=0, maximum=1000),
            "minAvailable": s.integer(
                "Ready pods that remediation never goes below; also the "
                "PodDisruptionBudget's minAvailable.", default=1, minimum=0),
            "recovery": s.string(
                "How a Restart recovers a pod that serves nothing (engine death, a hung "
                "engine, an unresponsive API server). InPlace (the default): the pod leaves "
                "the Service at once (fenced), then the cheapest "
                "rung that works: the kubelet's in-place container restart when vLLM exits "
                "by itself, else a restart request the engine plugin acts on (projected "
                "into the container, within about a minute), and a new pod only when those "
                "fail, the kubelet's back-off is past a cold start or the node is suspect "
                "(a GPU error in the pod's log, or the pod already recovered in place twice "
                "in the last hour). A pod that still serves (tokenizer retries) is "
                "restarted as with NewPod. NewPod: the pod is deleted and its ReplicaSet "
                "makes a new one (emptyDir caches and the loaded weights lost, maybe another "
                "node: a cold start).",
                default="InPlace", enum=["InPlace", "NewPod"]),
        },
        default={},
    )
