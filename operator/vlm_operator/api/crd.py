"""The VLMDeployment API: the one definition of the CRD.

`vlm-operator crd`, manifests/crds/, the Helm chart's crds/ and offline validation all read
`get_crd()`; tests fail when the generated files drift from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vlm_operator.api import schema as s

# the CRD's names live in api/names.py; imported here for the CRD and its readers (crd.GROUP)
from vlm_operator.api.names import (  # noqa: F401
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
)

DEFAULT_IMAGE = "ghcr.io/vlm-operator/vllm:v0.33.0"
ACTIONS = ["Restart", "ScaleDown", "Ignore"]
AUTOSCALING_MODES = ["Builtin", "HPA", "KEDA"]
DTYPES = ["auto", "half", "float16", "bfloat16", "float", "float32"]
CONDITION_TYPES = ["Ready", "Progressing", "Degraded", "SpecValid"]


def autoscaling_mode(spec: Mapping[str, Any] | None) -> str | None:
    """The autoscaling mode a spec runs (Builtin, HPA, KEDA; Builtin when it names none, the
    CRD's default); None with autoscaling off. Defaulted or not, every reader asks here."""
    scaling = (spec or {}).get("autoscaling") or {}
    return scaling.get("mode", "Builtin") if scaling.get("enabled") else None


def _signature_policy(what: str, threshold: int, window: int, action: str) -> s.Schema:
    return s.obj(
        f"What to do when {what} shows up in a pod's log.",
        {
            "threshold": s.integer(
                "Detections within windowSeconds that trigger the action.",
                default=threshold, minimum=1, maximum=10000),
            "windowSeconds": s.integer(
                "Length of the sliding window the detections are counted in.",
                default=window, minimum=1, maximum=86400),
            "action": s.string(
                "Restart deletes the pod (its Deployment replaces it); ScaleDown takes it out of "
                "the Service, drains it, then removes it and lowers the replica count; Ignore "
                "only counts.", default=action, enum=ACTIONS),
        },
        default={},
    )


def _env_var() -> s.Schema:
    key_ref = {
        "name": s.string("Name of the object.", min_length=1),
        "key": s.string("Key within the object.", min_length=1),
        "optional": s.boolean("Whether the object or key may be missing."),
    }
    return s.obj(
        "An environment variable for the vLLM container.",
        {
            "name": s.string("Variable name.", min_length=1,
                             pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"),
            "value": s.string("Literal value. Secrets must come through valueFrom."),
            "valueFrom": s.obj("Where the value comes from.", {
                "secretKeyRef": s.obj("A key of a Secret in the same namespace.", key_ref,
                                      required=["name", "key"]),
                "configMapKeyRef": s.obj("A key of a ConfigMap in the same namespace.", key_ref,
                                         required=["name", "key"]),
                "fieldRef": s.obj("A field of the pod.", {
                    "fieldPath": s.string("Path of the field, e.g. metadata.name.",
                                          min_length=1),
                }, required=["fieldPath"]),
            }),
        },
        required=["name"],
    )


def _spec() -> s.Schema:
    return s.obj(
        "The desired state: which model to serve, on what image and hardware, and how the "
        "operator keeps it healthy and scaled.",
        {
            "model": s.string(
                "Hugging Face model id (e.g. Qwen/Qwen3-VL-4B-Instruct) or a path inside the "
                "model cache.", min_length=1, max_length=512),
            "servedModelName": s.string(
                "Name clients use in the OpenAI API; defaults to the model.", max_length=256),
            "revision": s.string("Model revision: a branch, tag or commit.", max_length=256),
            "image": s.string(
                "The vLLM image. The default is this project's patched vLLM image (with the "
                "tokenizer pool plugin).", default=DEFAULT_IMAGE, min_length=1),
            "vllmVersion": s.string(
                "vLLM version inside the image (e.g. 0.20.2). Optional: parsed from the image "
                "tag when absent. Decides which flags are passed.",
                pattern=r"^v?[0-9]+\.[0-9]+(\.[0-9]+)?([-.+a-zA-Z0-9]*)?$"),
            "replicas": s.integer("Number of vLLM pods.", default=1, minimum=0, maximum=1000),
            "gpusPerReplica": s.integer(
                "GPUs per pod, in units of gpuResourceName, all on one node; the "
                "tensor-parallel size defaults to it.",
                default=1, minimum=1, maximum=64),
            "gpuResourceName": s.string(
                "The extended resource the GPUs are requested as: nvidia.com/gpu, a MIG "
                "profile under the mixed strategy (e.g. nvidia.com/mig-1g.10gb), amd.com/gpu. "
                "Builtin autoscaling counts this resource when it fits replicas onto nodes.",
                default="nvidia.com/gpu",
                pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*"
                        r"[A-Za-z0-9])?$"),
            "rendererNumWorkers": s.integer(
                "Renderer worker threads (--renderer-num-workers, vLLM 0.19+). The tokenizer "
                "pool holds one tokenizer per thread that can use it: rendererNumWorkers + 1 "
                "(the event loop), + 2 from vLLM 0.29 (its multimodal thread).",
                default=1, minimum=1, maximum=64),
            "vllm": s.obj(
                "Engine settings passed to `vllm serve`.",
                {
                    "maxModelLen": s.integer("--max-model-len: context length.", minimum=1),
                    "dtype": s.string("--dtype of the weights and activations.", enum=DTYPES),
                    "tensorParallelSize": s.integer(
                        "--tensor-parallel-size; defaults to gpusPerReplica.",
                        minimum=1, maximum=64),
                    "limitMmPerPrompt": s.obj(
                        "--limit-mm-per-prompt: most items per modality in one prompt, e.g. "
                        "{image: 4, video: 0}.",
                        additional={"type": "integer", "minimum": 0}),
                    "mmProcessorKwargs": s.obj(
                        "--mm-processor-kwargs: keyword arguments for the multimodal "
                        "processor, passed as JSON.", preserve_unknown=True),
                    "allowedMediaDomains": s.array(
                        "Hosts whose http(s) image, audio and video URLs the engine may fetch "
                        "for requests (vLLM --allowed-media-domains; redirects are not "
                        "followed). Unset: none, so a request cannot make the pod fetch "
                        "cluster-internal or cloud metadata addresses; data: URLs always "
                        "work. [\"*\"]: any host, redirects followed (vLLM's own default).",
                        s.string("A host name, e.g. images.example.com, or *.",
                                 pattern=r"^(\*|[A-Za-z0-9]([-A-Za-z0-9.]{0,251}[A-Za-z0-9])?)$"),
                        max_items=64),
                    "extraArgs": s.array(
                        "Further `vllm serve` flags, passed last and verbatim.",
                        s.string("One argument."), max_items=128),
                    "env": s.array("Extra environment variables for the vLLM container.",
                                   _env_var(), max_items=128),
                },
                default={},
            ),
            "resources": s.obj(
                "CPU and memory for the vLLM container, beside the GPUs.",
                {
                    "requests": s.obj("Minimum resources.", {
                        "cpu": s.quantity("CPU, e.g. 4 or 500m."),
                        "memory": s.quantity("Memory, e.g. 32Gi."),
                    }),
                    "limits": s.obj("Maximum resources.", {
                        "cpu": s.quantity("CPU, e.g. 8."),
                        "memory": s.quantity("Memory, e.g. 64Gi."),
                    }),
                },
            ),
            "scheduling": s.obj(
                "Where the pods may run.",
                {
                    "nodeSelector": s.string_map("Node labels the pods require."),
                    "tolerations": s.array("Taints the pods tolerate.", s.obj(
                        "A toleration.",
                        {
                            "key": s.string("Taint key."),
                            "operator": s.string("Exists or Equal.", enum=["Exists", "Equal"]),
                            "value": s.string("Taint value."),
                            "effect": s.string(
                                "Taint effect.",
                                enum=["NoSchedule", "PreferNoSchedule", "NoExecute"]),
                            "tolerationSeconds": s.integer(
                                "How long a NoExecute taint is tolerated."),
                        })),
                    "affinity": s.obj("Pod affinity rules, as in a Pod spec.",
                                      preserve_unknown=True),
                    "runtimeClassName": s.string("RuntimeClass, e.g. nvidia."),
                    "priorityClassName": s.string(
                        "PriorityClass of the pods; also ranks VLMDeployments competing for "
                        "free GPUs when autoscaling."),
                },
            ),
            "serviceAccountName": s.string(
                "An existing ServiceAccount of the namespace the pods run as, for cloud "
                "workload identity (which brings its own token). Default: the namespace's "
                "default ServiceAccount. Either way the Kubernetes API token is not mounted: "
                "vLLM never calls the API.", min_length=1, max_length=253,
                pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"),
            "hfTokenSecretRef": s.obj(
                "The Hugging Face token, only ever taken from a Secret.",
                {
                    "name": s.string("Secret name.", min_length=1),
                    "key": s.string("Key in the Secret.", default="token", min_length=1),
                },
                required=["name"],
            ),
            "modelCache": s.obj(
                "Where model weights are cached: an existing PVC (claimName) or one the "
                "operator creates (size). Without it the cache is an emptyDir.",
                {
                    "claimName": s.string("An existing PersistentVolumeClaim.", min_length=1),
                    "size": s.quantity("Size of the PVC the operator creates, e.g. 100Gi."),
                    "storageClassName": s.string("StorageClass of the created PVC."),
                    "accessModes": s.array(
                        "Access modes of the created PVC.",
                        s.string("An access mode.", enum=[
                            "ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany",
                            "ReadWriteOncePod"])),
                    "mountPath": s.string("Where the cache is mounted (HF_HOME).",
                                          default="/models", pattern=r"^/.*"),
                },
            ),
            "health": s.obj(
                "How the operator reacts to failure signatures in the vLLM logs.",
                {
                    "tokenizerRetry": _signature_policy(
                        "`Failed to acquire tokenizer` retry warnings", 5, 60, "Restart"),
                    "engineDead": _signature_policy(
                        "engine death (EngineDeadError)", 1, 60, "Restart"),
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
                                               "other signals).", default="Restart",
                                               enum=ACTIONS),
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
                            "action": s.string("What to do about it.", default="Restart",
                                               enum=ACTIONS),
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
                                               default="Restart", enum=ACTIONS),
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
                },
                default={},
            ),
            "autoscaling": s.obj(
                "Scaling on vLLM's own load signals.",
                {
                    "enabled": s.boolean("Turn autoscaling on.", default=False),
                    "mode": s.string(
                        "Builtin: the operator scrapes the pods itself; HPA: a "
                        "HorizontalPodAutoscaler on a Pods metric (prometheus-adapter); KEDA: "
                        "a ScaledObject with a Prometheus trigger.",
                        default="Builtin", enum=AUTOSCALING_MODES),
                    "minReplicas": s.integer("Fewest replicas.", default=1, minimum=0),
                    "maxReplicas": s.integer("Most replicas.", default=1, minimum=1),
                    "metric": s.string("The vLLM metric scaled on.",
                                       default="vllm:num_requests_waiting", min_length=1),
                    "target": s.number("Target value of the metric per replica.",
                                       default=5, minimum=0),
                    "multimodalWeight": s.number(
                        "Builtin mode: extra load of one image, in requests: a request carrying "
                        "k images counts as 1 + k * multimodalWeight. Images per request are "
                        "observed per pod from vllm:mm_cache_queries_total over "
                        "vllm:request_success_total.", default=1, minimum=0, maximum=100),
                    "scaleDownDelaySeconds": s.integer(
                        "How long load must stay low before replicas are removed.",
                        default=300, minimum=0, maximum=86400),
                    "priority": s.integer(
                        "Rank among VLMDeployments competing for free GPUs (higher first); "
                        "defaults to the pods' PriorityClass value.",
                        minimum=-1000000, maximum=1000000),
                    "prometheus": s.obj(
                        "Prometheus for KEDA mode.",
                        {
                            "serverAddress": s.string("Prometheus URL.", pattern=r"^https?://"),
                            "query": s.string("PromQL query; a default on the metric is used "
                                              "when empty."),
                        },
                    ),
                },
                default={},
            ),
        },
        required=["model"],
    )


def _condition() -> s.Schema:
    return s.obj(
        "One aspect of the VLMDeployment's state.",
        {
            "type": s.string("Ready, Progressing, Degraded, SpecValid, ..."),
            "status": s.string("True, False or Unknown.", enum=["True", "False", "Unknown"]),
            "reason": s.string("A CamelCase reason."),
            "message": s.string("Human-readable detail."),
            "lastTransitionTime": s.string("When status last changed."),
            "observedGeneration": s.integer("The generation the condition was set for."),
        },
        required=["type", "status"],
    )


def _status() -> s.Schema:
    return s.obj(
        "The observed state, written by the operator.",
        {
            "observedGeneration": s.integer("Last generation the operator acted on."),
            "replicas": s.integer("Pods that exist."),
            "readyReplicas": s.integer("Pods that are ready."),
            "selector": s.string("Label selector of the pods, for the scale subresource."),
            "tokenizerPoolSize": s.integer("Tokenizers in each engine's pool."),
            "vllmVersion": s.string("The vLLM version the operator resolved."),
            "conditions": s.array("Current conditions.", _condition(), list_type="map",
                                  list_map_keys=["type"]),
            "lastRemediation": s.obj("The operator's last action on a pod.", {
                "time": s.string("When."),
                "pod": s.string("Which pod."),
                "signature": s.string("What it detected."),
                "action": s.string("What it did."),
                "reason": s.string("Why, or why it held back."),
            }),
            "autoscaling": s.obj("The last scaling decision.", {
                "desiredReplicas": s.integer("Replicas the autoscaler wants."),
                "currentReplicas": s.integer("Replicas when it decided."),
                "reason": s.string("Why."),
                "time": s.string("When."),
            }),
            "kopf": s.obj("Operator framework bookkeeping.", preserve_unknown=True),
        },
    )


def get_schema() -> s.Schema:
    return s.obj(
        "A vision-language model served by vLLM, with a thread-safe tokenizer pool, log "
        "watching and autoscaling.",
        {
            "apiVersion": s.string("The API version."),
            "kind": s.string("The kind."),
            "metadata": {"type": "object"},
            "spec": _spec(),
            "status": _status(),
        },
        required=["spec"],
    )


PRINTER_COLUMNS = [
    {"name": "Model", "type": "string", "jsonPath": ".spec.model"},
    {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {"name": "Pool", "type": "integer", "jsonPath": ".status.tokenizerPoolSize",
     "description": "Tokenizers in each engine's pool"},
    {"name": "vLLM", "type": "string", "jsonPath": ".status.vllmVersion"},
    {"name": "Status", "type": "string",
     "jsonPath": '.status.conditions[?(@.type=="Ready")].reason'},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def get_crd() -> dict:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {"app.kubernetes.io/part-of": "vlm-operator"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
                "categories": ["vlm"],
            },
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": get_schema()},
                "subresources": {
                    "status": {},
                    "scale": {
                        "specReplicasPath": ".spec.replicas",
                        "statusReplicasPath": ".status.replicas",
                        "labelSelectorPath": ".status.selector",
                    },
                },
                "additionalPrinterColumns": PRINTER_COLUMNS,
            }],
        },
    }


def get_peering_crds() -> list[dict]:
    """kopf's peering resources: operator replicas see each other here and never act twice."""
    def peering(kind: str, plural: str, scope: str) -> dict:
        return {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.kopf.dev",
                         "labels": {"app.kubernetes.io/part-of": "vlm-operator"}},
            "spec": {
                "group": "kopf.dev",
                "scope": scope,
                "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
                "versions": [{
                    "name": "v1", "served": True, "storage": True,
                    "schema": {"openAPIV3Schema": s.obj(
                        "Operator replicas that share the work and their priorities.",
                        {"status": s.obj("Heartbeats of the peers.", preserve_unknown=True)},
                        preserve_unknown=True)},
                }],
            },
        }
    return [peering("ClusterKopfPeering", "clusterkopfpeerings", "Cluster"),
            peering("KopfPeering", "kopfpeerings", "Namespaced")]


def get_all_crds() -> list[dict]:
    return [get_crd(), *get_peering_crds()]
