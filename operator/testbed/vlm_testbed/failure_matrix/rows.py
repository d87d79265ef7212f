"""The failure matrix's rows (ROWS): one Row per failure mode, what it does and what it must not."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .bed import DRAIN_WAIT_S, LOGGING_PREFIX
from .capacity import claim_node_full, node_added_by_autoscaler
from .cluster_faults import existing_service, hostile_tenant, previous_log_refused, unreachable
from .engine_faults import (
    crash_loop,
    engine_death,
    saturation,
    storm,
    storm_under_load,
    storm_without_free_gpu,
    storms_on_two_pods_one_gpu,
)
from .node_drains import (
    SLOW_PULL_S,
    cordon_without_drain,
    node_drain,
    replacement_slower_than_the_drain_wait,
)
from .operator_faults import (
    operator_killed_mid_drain,
    operator_killed_mid_incident,
    operator_killed_stale_incident,
    standby_takes_over,
    two_at_once,
)
from .recovery_faults import fenced_under_scale_down, late_engine_death_line, old_restarts
from .stalls import hung_behind_api_key, long_prefill_only_replica

if TYPE_CHECKING:
    from .bed import Bed, Observed


@dataclass(frozen=True)
class Row:
    """One failure mode. `run(bed, health)` sets it up (on the bed's operator), injects the
    fault and returns what it observed; `health` is merged into spec.health (IGNORE_ALL for
    the probes-only comparison). `probes` says whether that comparison means anything."""

    id: str
    what: str
    run: Callable[[Bed, dict | None], Observed]
    probes: bool = True
    own_operator: bool = False  # the row starts (and kills) operator processes itself
    must_not: str = ""  # rows about what must not happen: that, instead of a recovery time


ROWS = [
    Row("engine-dead-exit0-1", "engine death, process exits 0, 1 replica", engine_death(1, 0)),
    Row("engine-dead-exit1-1", "engine death, process exits 1, 1 replica", engine_death(1, 1)),
    Row("engine-dead-alive-1", "engine death, process stays alive, 1 replica",
        engine_death(1, None)),
    Row("engine-dead-exit0-3", "engine death, exits 0, 1 of 3 replicas", engine_death(3, 0)),
    Row("engine-dead-exit1-3", "engine death, exits 1, 1 of 3 replicas", engine_death(3, 1)),
    Row("engine-dead-alive-3", "engine death, stays alive, 1 of 3 replicas",
        engine_death(3, None)),
    Row("engine-dead-all-3", "every engine dead at once (stay alive), 3 replicas",
        engine_death(3, None, hit_all=True)),
    Row("storm-1-of-3", "tokenizer retry storm on 1 of 3 replicas", storm(3, 4)),
    Row("storm-only-gpu-free", "retry storm on the only replica, a GPU free", storm(1, 2)),
    Row("storm-only-no-gpu", "retry storm on the only replica, no GPU free (then one frees)",
        storm_without_free_gpu),
    Row("storm-below-threshold", "4 retry warnings, threshold 5", storm(2, 3, count=4),
        probes=False, must_not="no pod touched, no Event"),
    Row("saturation", "queue full, slow service, /metrics slower than the scrape timeout",
        saturation, probes=False, must_not="no restart, no drain (LoadUnknown holds)"),
    Row("crash-loop-budget", "engine dies at every start: restart budget spent, then raised",
        crash_loop, probes=False,
        must_not="2 restarts then Degraded, no flapping; a 3rd once the budget is raised"),
    Row("operator-killed-mid-incident", "operator SIGKILLed holding an incident, a GPU frees",
        operator_killed_mid_incident, probes=False, own_operator=True),
    Row("operator-killed-stale-incident", "operator SIGKILLed, restarted after the window",
        operator_killed_stale_incident, probes=False, own_operator=True,
        must_not="the replayed old lines are not acted on"),
    Row("operator-killed-mid-drain", "operator SIGKILLed while a ScaleDown drains",
        operator_killed_mid_drain, probes=False, own_operator=True),
    Row("standby-takes-over", "active replica stopped mid-replacement, the standby finishes",
        standby_takes_over, probes=False, own_operator=True),
    Row("two-vlmds-at-once", "two VLMDeployments failing at once", two_at_once),
    Row("engine-dead-logging-prefix", "engine death with VLLM_LOGGING_PREFIX set, exits 0, "
        "1 replica", engine_death(1, 0, env=LOGGING_PREFIX)),
    Row("previous-log-refused", "previous container's log refused (node restart), then the "
        "new container's engine dies", previous_log_refused),
    Row("existing-service", "another app's Service has the VLMDeployment's name",
        existing_service, probes=False,
        must_not="the Service is never changed nor deleted with the VLMDeployment"),
    Row("unreachable-drop", "the operator's traffic to the only replica dropped (connect "
        "timeouts; the kubelet's probes pass)", unreachable("drop"), probes=False,
        must_not="nothing done to the pod; PodsReachable=False, an Event, metrics"),
    Row("unreachable-reject", "the operator's connections to the only replica refused (the "
        "kubelet's probes pass)", unreachable("reject"), probes=False,
        must_not="nothing done to the pod; PodsReachable=False, an Event, metrics"),
    Row("hostile-tenant", "another tenant's pods serve redirects, 100 MB /metrics and "
        "drip-fed headers while the only replica's engine dies (exits 0)", hostile_tenant),
    Row("drain-gpu-free", "kubectl drain of the only replica's node, a GPU free elsewhere, "
        "under load", node_drain(gpu_free=True), probes=False),
    Row("drain-no-gpu", "kubectl drain of the only replica's node, labelled with a drain "
        "marker, no GPU free anywhere", node_drain(gpu_free=False), probes=False,
        own_operator=True,
        must_not=f"held {DRAIN_WAIT_S} s (--node-drain-wait-seconds), then the drain finishes"),
    Row("cordon-no-drain", "a cordon without a drain of the only replica's node (kubectl "
        f"cordon, no drain marker), no GPU free anywhere, for 3 x {DRAIN_WAIT_S} s, then "
        "uncordoned", cordon_without_drain, probes=False, own_operator=True,
        must_not="the only serving replica is never taken out nor deleted for a cordon; the "
                 "uncordon ends the wait"),
    Row("drain-slow-replacement", "kubectl drain of the only replica's node (a drain marker), "
        f"the replacement's start slower than the drain wait ({DRAIN_WAIT_S} s: a "
        f"{SLOW_PULL_S} s image pull on a fresh node), under load",
        replacement_slower_than_the_drain_wait, probes=False, own_operator=True,
        must_not="no serving gap: the replacement is waited for past the drain wait"),
    Row("claim-node-full", "retry storm on the only replica, its ReadWriteOnce cache claim's "
        "node full, a GPU free on another node", claim_node_full, probes=False,
        must_not="held (WaitingForCapacity): no replacement surged, no restart budget spent"),
    Row("node-added-by-autoscaler", "retry storm on the only replica, no GPU free; a node "
        "autoscaler adds a node for the Pending replacement", node_added_by_autoscaler,
        probes=False, own_operator=True),
    Row("storms-two-pods-one-gpu", "retry storms on both of 2 pods, minAvailable 2, one GPU "
        "free", storms_on_two_pods_one_gpu, probes=False),
    Row("replace-under-load", "retry storm on the only replica (a GPU free), steady load",
        storm_under_load(1), probes=False),
    Row("scaledown-under-load", "retry storm on 1 of 2 replicas, ScaleDown, steady load",
        storm_under_load(2, {"tokenizerRetry": {"action": "ScaleDown"}}), probes=False),
    Row("long-prefill-only-replica", "long prefill on the only replica: counters still for 2 "
        "x stallSeconds (10 s)", long_prefill_only_replica, probes=False,
        must_not="no restart; the prompt completes"),
    Row("hung-engine-api-key", "hung engine behind an API key (VLLM_API_KEY from a Secret)",
        hung_behind_api_key),
    Row("fenced-under-builtin-scaledown", "a fenced pod (InPlace) under a Builtin "
        "scale-down: 2 replicas to 1, no load", fenced_under_scale_down, probes=False,
        must_not="the healthy pod is never drained nor deleted; the fenced one goes"),
    Row("late-engine-death-line", "an engine-death line read after the kubelet restarted "
        "the container in place (the operator paused)", late_engine_death_line, probes=False,
        own_operator=True, must_not="the restarted container is not touched, no restart "
        "counted"),
    Row("old-restarts-in-place", "engine death on a pod with 5 restarts the kubelet's "
        "back-off forgot (InPlace)", old_restarts, probes=False, own_operator=True),
]
