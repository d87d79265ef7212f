"""Simulated node side of the local test bed: kubelet + container runtime, nothing else.

The apiserver, scheduler and controllers are real (controlplane.py); only the node is
simulated, because there is no kubelet or container runtime on these machines. A
NodeSimulator registers Nodes, keeps them Ready (Lease heartbeat + status conditions), and for
every pod bound to them runs one local process per container in place of the container:
probes, restarts with back-off, termination (the preStop hook within the grace period, then
SIGTERM, then SIGKILL) and pods/status are done here as the kubelet would.
Container logs are kept per container instance with RFC3339Nano timestamps and served on the
kubelet's HTTPS /containerLogs endpoint, so `kubectl logs [-f] [--previous]` works through the
real apiserver.

Images containing `vllm` run `python -m vlm_testbed.vllmsim` with the container's args after
`serve` (pass `command_for=` to run something else, e.g. a real `vllm serve`); other images run
their command if it exists on this machine, else an idle process.

State and time, as on a real node (figures in the modules named):
- Volumes (volumes.py): emptyDir = <pod dir>/volumes/kubernetes.io~empty-dir/<name>, kept across
  container restarts, deleted with the pod; persistentVolumeClaim = the bound PV's hostPath, a
  directory per PV under <work dir>/volumes that outlives pods; downwardAPI = files from the pod
  object, rewritten `downward_api_lag` (DOWNWARD_API_LAG_S, 0.5 s: the real kubelet's sync on a
  pod update, measured) after the pod watch shows a change; configMap/secret = files; hostPath =
  the path. A process has no mount namespace, so each container gets VLM_TESTBED_MOUNTS = JSON
  {mountPath: host dir}, and env values that are a mountPath or lie under one are rewritten to the
  host path (HF_HOME=/models, HOME=/home/vllm); HOME and cache variables under no mount point into
  the container instance's writable layer, fresh on each restart.
- Claims (claims.py): a provisioner binds every pending claim (no storage class, or
  vlm-testbed-hostpath) to a hostPath PV it creates; the real controller-manager binds them. A
  ReadWriteOnce PV attaches to one node at a time: a pod on another node stays
  ContainerCreating with the attach-detach controller's FailedAttachVolume (Multi-Attach) and
  the kubelet's FailedMount Events until the holding node's pods are gone.
- Images (images.py): `image_pull_seconds` per image, paid once per node, pulls serialized per
  node, Pulling/Pulled Events; 0 by default (VLLM_IMAGE_PULL_S is the real figure).
- Restarts: back-off 10 s doubling to 5 min, forgotten after a run over 10 min
  (state.crashes_after_exit); a container's leftover processes are killed when its main
  process exits, as with PID 1 of its PID namespace.
- The vLLM stand-in's start model (vllmsim.startup) runs at `vllm_time_scale` (0 by default:
  tests start at once; 1: the published figures) where a pod does not set VLM_SIM_TIME_SCALE.

Pods that need no process (annotation vlm-testbed/process=none, or all pods the `light`
predicate picks): Running and Ready at once, status written once, vLLM's HTTP surface answered
from one event loop (LightPod): for clusters of thousands of pods, where a process per pod would
not fit (bench/scale.py).

Pods get loopback IPs (127.x.y.z, one per pod): EndpointSlices accept them, but core/v1
Endpoints validation rejects loopback addresses, so Services' Endpoints stay empty.

Usage: python -m vlm_testbed.nodesim --kubeconfig K --nodes N --gpus-per-node G

Modules: state (container and pod state, pure), processes (a container's process), pods
(PodRunner), volumes (a pod's volumes, the mount mapping), claims (provisioner, attach), images
(pulls per node), events (Events, Go durations), light (LightPod, LightEngines), logserver (the
kubelet's log endpoint), leases (Node registration and heartbeat), simulator (NodeSimulator),
cli (`python -m vlm_testbed.nodesim`).
"""

from .processes import CommandFor, default_command
from .simulator import NodeSimulator
from .state import NO_PROCESS, SIM_LABEL

__all__ = ["NO_PROCESS", "SIM_LABEL", "CommandFor", "NodeSimulator", "default_command"]
