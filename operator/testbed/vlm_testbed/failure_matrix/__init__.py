"""The failure modes users hit, as runnable scenarios on the local test bed.

Each scenario sets up VLMDeployments on a real control plane with simulated GPU nodes, injects
a fault through the vLLM stand-in (vllmsim), and watches what happens: when the VLMDeployment
was serving again, the fewest ready pods on the way, which pods were touched, and the Events.
`tests/e2e/test_failure_matrix.py` asserts each row's outcome; `bench/failure_matrix.py` times
the same rows with the operator remediating and with remediation off (only the kubelet's
probes, the same pod spec), side by side.

Serving again ("recovered") means: as many pods as spec.replicas are ready, answer /health
with 200, and none of them is a container instance the fault hit (a pod's uid and restart
count); a pod restarted by the kubelet in place counts once its new container serves.

Modules: bed (Bed, Observed and their helpers), rows (ROWS), and the rows' scenarios by what
fails: engine_faults, operator_faults, cluster_faults, node_drains, stalls.
"""

from .bed import DRAIN_WAIT_S, IGNORE_ALL, Bed, Observed, healthy, instance, is_ready
from .cluster_faults import hostile_tenant
from .engine_faults import complete
from .rows import ROWS, Row
from .stalls import API_KEY_ENV, LONG_PROMPT_TOKENS, prompt_done, prompt_tokens

__all__ = [
    "API_KEY_ENV", "DRAIN_WAIT_S", "IGNORE_ALL", "LONG_PROMPT_TOKENS", "ROWS", "Bed", "Observed",
    "Row", "complete", "healthy", "hostile_tenant", "instance", "is_ready", "prompt_done",
    "prompt_tokens",
]
