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

Pods that need no process (annotation vlm-testbed/process=none, or all pods the `light`
predicate picks): Running and Ready at once, status written once, vLLM's HTTP surface answered
from one event loop (LightPod): for clusters of thousands of pods, where a process per pod would
not fit (bench/scale.py).

Pods get loopback IPs (127.x.y.z, one per pod): EndpointSlices accept them, but core/v1
Endpoints validation rejects loopback addresses, so Services' Endpoints stay empty.

Usage: python -m vlm_testbed.nodesim --kubeconfig K --nodes N --gpus-per-node G

Modules: state (container and pod state, pure), processes (a container's process), pods
(PodRunner), light (LightPod, LightEngines), logserver (the kubelet's log endpoint), leases (Node
registration and heartbeat), simulator (NodeSimulator), cli (`python -m vlm_testbed.nodesim`).
"""

from .processes import CommandFor, default_command
from .simulator import NodeSimulator
from .state import NO_PROCESS, SIM_LABEL

__all__ = ["NO_PROCESS", "SIM_LABEL", "CommandFor", "NodeSimulator", "default_command"]
