"""How long a new replica takes to serve, from the starts the autoscaler has seen, and when each
replica still starting is expected to be Ready. Pure: pods in, times out.

On a GPU node a replica's start is minutes (an image pull on a new node, the weights, the
compile cache, CUDA graphs), so status.autoscaling shows, for each replica not Ready yet, since
when it starts and when it is expected to serve: the creation time plus the median of the
last STARTS_KEPT starts seen for this VLMDeployment. Before any start was seen the expectation
is unknown, and said so, rather than guessed. The decision itself needs no estimate: replicas
still starting count as capacity on the way (autoscaling/recommend.py), so load they will take
never scales up again.

A start is counted only where it can be dated: creation to the first Ready of the pod's first
container. The Ready condition's lastTransitionTime is its last change, so a pod that flapped
(a failing readiness probe) or restarted in place has a later one; a pod seen Ready the first
time (an operator that just started, or a standby taking over) is therefore never counted. A
pod is watched from a round where it is before its first Ready (not Ready, its vllm container
never restarted and not started yet: the startup probe has not passed), and its start counted
in the first round it is Ready with its container still the first.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from vlm_operator.k8s.pods import is_ready, parse_time, ready_condition, rfc3339
from vlm_operator.k8s.views import Pod

STARTS_KEPT = 8
MAX_PENDING_LISTED = 20  # status stays small with a large scale-up


@dataclass(frozen=True)
class Starts:
    """seen: (pod uid, start seconds) of the last STARTS_KEPT starts counted; watching: the
    uids of pods seen before their first Ready (bounded by the VLMDeployment's pods)."""

    seen: tuple[tuple[str, float], ...] = ()
    watching: frozenset[str] = frozenset()


def before_first_ready(pod: Mapping) -> bool:
    """The pod has not been Ready yet: not Ready, its first container still, and not started
    (the startup probe has not passed; a container that started and is not Ready may be one
    that flapped)."""
    status = Pod(pod).container
    return not is_ready(pod) and Pod(pod).restart_count == 0 and not status.get("started")


def start_seconds(pod: Mapping) -> float | None:
    """Creation to Ready, for a pod that is Ready (None otherwise, or when unreadable)."""
    if not is_ready(pod):
        return None
    created = Pod(pod).created_at
    became = parse_time(ready_condition(pod).get("lastTransitionTime"))
    if created is None or became is None or became < created:
        return None
    return became - created


def seen_starts(kept: Starts, pods: Iterable[Mapping]) -> Starts:
    """Starts counted this round: each pod watched since before its first Ready that is Ready
    now with its first container, once; the pods to watch on."""
    seen, watching = list(kept.seen), set()
    for pod in pods:
        uid = Pod(pod).uid
        if not uid:
            continue
        if before_first_ready(pod):
            watching.add(uid)
        elif uid in kept.watching and Pod(pod).restart_count == 0 and \
                (seconds := start_seconds(pod)) is not None:
            seen.append((uid, seconds))
    return Starts(tuple(seen[-STARTS_KEPT:]), frozenset(watching))


def pending_replicas(pods: Iterable[Mapping], starts: tuple[tuple[str, float], ...]
                     ) -> list[dict]:
    """For each pod not Ready (oldest first): since when it starts and when it is expected to
    be Ready, with what the expectation rests on."""
    typical = statistics.median(s for _, s in starts) if starts else None
    out = []
    for pod in pods:
        meta = Pod(pod)
        created = meta.created_at
        if is_ready(pod) or created is None or meta.deleting:
            continue
        entry = {"pod": meta.name, "since": rfc3339(created)}
        if typical is None:
            entry["expected"] = "unknown: no start of this VLMDeployment seen yet"
        else:
            entry["expectedReadyTime"] = rfc3339(created + typical)
            entry["expected"] = (f"median start {typical:.0f} s of the last {len(starts)} "
                                 "seen")
        out.append((created, entry))
    return [e for _, e in sorted(out, key=lambda x: x[0])][:MAX_PENDING_LISTED]
