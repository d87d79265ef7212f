"""The CRD's spec: the model, image and hardware, the engine's settings (`vllm serve` flags and
environment), resources, scheduling, identity, the model cache; spec.health,
spec.autoscaling and spec.gateway come from their own modules."""

from __future__ import annotations

from vlm_operator.api import schema as s
from vlm_operator.api import versions
from vlm_operator.api.crd_autoscaling import autoscaling
from vlm_operator.api.crd_gateway import gateway
from vlm_operator.api.crd_health import health

DEFAULT_IMAGE = "ghcr.io/vlm-operator/vllm:v" + ".".join(map(str, versions.DEFAULT_RELEASE))
DTYPES = ["auto", "half", "float16", "bfloat16", "float", "float32"]

# spec.vllm fields passed to `vllm serve` as one flag with the field's value as it is, each
# declared once with its schema: desired/children.py writes the flag, validation refuses it in
# extraArgs (validation_engine.MANAGED_FLAGS).
VALUE_FLAGS: dict[str, tuple[str, s.Schema]] = {
    "maxModelLen": ("--max-model-len",
                    s.integer("--max-model-len: context length.", minimum=1)),
    "dtype": ("--dtype", s.string("--dtype of the weights and activations.", enum=DTYPES)),
}


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


def spec() -> s.Schema:
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
                    **{field: schema for field, (_, schema) in VALUE_FLAGS.items()},
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
                        "Access modes of the created PVC. ReadWriteOnce (the default): "
                        "every replica is placed on the claim's node. ReadWriteOncePod: one "
                        "pod at a time, so replicas and maxReplicas at most 1 and "
                        "health.minAvailable 0 (no replacement surged beside a pod).",
                        s.string("An access mode.", enum=[
                            "ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany",
                            "ReadWriteOncePod"])),
                    "mountPath": s.string("Where the cache is mounted (HF_HOME).",
                                          default="/models", pattern=r"^/.*"),
                },
            ),
            "health": health(),
            "autoscaling": autoscaling(),
            "gateway": gateway(),
        },
        required=["model"],
    )
