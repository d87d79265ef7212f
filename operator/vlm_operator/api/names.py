"""The names the operator writes into the cluster and reads back: its API group, version and
kind, the labels and annotations it puts on objects, and kopf's storage keys. One home, so
every module (and the test bed) spells them alike. Pure constants."""

from __future__ import annotations

GROUP = "serving.vlm-operator.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "VLMDeployment"
PLURAL = "vlmdeployments"
SINGULAR = "vlmdeployment"
SHORT_NAMES = ["vlmd"]

# the engine's container in every pod, and the port vLLM serves on (/metrics, /health, /v1)
CONTAINER = "vllm"
PORT = 8000
GPU_RESOURCE = "nvidia.com/gpu"  # the extended resource a replica asks for by default
MANAGER = "vlm-operator"  # app.kubernetes.io/managed-by, and the field manager of our applies

# labels
INSTANCE_LABEL = "app.kubernetes.io/instance"  # the VLMDeployment a child belongs to
# Pods whose label is "false" are out of the Service (draining) but still owned by the Deployment.
IN_SERVICE_LABEL = f"{GROUP}/in-service"

# annotations
# Deployment: extra replicas it runs while replacements for sick pods come up, so a change of
# replicas can be told apart from drift (reconcile/reconciler.py)
SURGE_ANNOTATION = f"{GROUP}/surge"
DRAIN_SINCE = f"{GROUP}/drain-since"  # pod: when the autoscaler took it out
LOG_MARK = f"{GROUP}/log-mark"  # pod annotation: where a fresh log follower resumes
# pod: a pod taken out of the Service because it serves nothing, and the recovery under way
# (JSON: remediation/ladder.Fence); shared with nothing else, unlike the in-service label
FENCE = f"{GROUP}/fence"
# pod: an in-place restart asked of the engine plugin, projected into the container by a
# downwardAPI volume (RESTART_REQUEST_DIR/RESTART_REQUEST_FILE)
RESTART_REQUEST = f"{GROUP}/restart-request"
RESTART_REQUEST_DIR, RESTART_REQUEST_FILE = "/etc/vlm-operator", "restart-request"
RESTART_REQUEST_ENV = "VLM_RESTART_REQUEST_FILE"
# pod: detections up to this time were acted on by an in-place recovery that succeeded
ACTED_UNTIL = f"{GROUP}/acted-until"
# pod: times of its in-place recoveries in the last hour (remediation/suspect.py)
RECOVERED_IN_PLACE = f"{GROUP}/recovered-in-place"
HISTORY = f"{GROUP}/remediations"  # VLMDeployment: JSON list of action times, last hour
IN_FLIGHT = f"{GROUP}/in-flight"  # VLMDeployment: JSON {pod uid: InFlight} of open actions

# kopf's state on our objects: its finalizer, progress and last-handled configuration
STORAGE_PREFIX = GROUP
FINALIZER = f"{STORAGE_PREFIX}/finalizer"
