"""How long a new replica takes to serve, from the starts the autoscaler has seen, and when each
replica still starting is expected to be Ready. Pure: pods in, times out.

On a GPU node a replica's start is minutes (an image pull on a new node, the weights, the
compile cache, CUDA graphs), so status.autoscaling shows, for each replica not Ready yet, since
when it starts and when it is expected to serve: the creation time plus the median of the
last STARTS_KEPT starts seen for this VLMDeployment (creation to first Ready). Before any
start was seen the expectation is unknown, and said so, rather than guessed. The decision
itself needs no estimate: replicas still starting count as capacity on the way
(autoscaling/decide.py), so load they will take never scales up again.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping

from vlm_operator.k8s.pods import is_ready, parse_time, ready_condition, rfc3339

STARTS_KEPT = 8
MAX_PENDING_LISTED = 20  # status stays small with a large scale-up


def start_seconds(pod: Mapping) -> float | None:
    """Creation to Ready, for a pod that is Ready (None otherwise, or when unreadable)."""
    if not is_ready(pod):
        return None
    created = parse_time((pod.get("metadata") or {}).get("creationTimestamp"))
    became = parse_time(ready_condition(pod).get("lastTransitionTime"))
    if created is None or became is None or became < created:
        return None
    return became - created


def seen_starts(kept: tuple[tuple[str, float], ...], pods: Iterable[Mapping]
                ) -> tuple[tuple[str, float], ...]:
    """(pod uid, start seconds) of the last STARTS_KEPT pods seen Ready, each once."""
    known = {uid for uid, _ in kept}
    new = []
    for pod in pods:
        uid = (pod.get("metadata") or {}).get("uid")
        seconds = start_seconds(pod)
        if uid and uid not in known and seconds is not None:
            new.append((uid, seconds))
    return (*kept, *new)[-STARTS_KEPT:]


def pending_replicas(pods: Iterable[Mapping], starts: tuple[tuple[str, float], ...]
                     ) -> list[dict]:
    """For each pod not Ready (oldest first): since when it starts and when it is expected to
    be Ready, with what the expectation rests on."""
    typical = statistics.median(s for _, s in starts) if starts else None
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        created = parse_time(meta.get("creationTimestamp"))
        if is_ready(pod) or created is None or meta.get("deletionTimestamp"):
            continue
        entry = {"pod": meta.get("name", ""), "since": rfc3339(created)}
        if typical is None:
            entry["expected"] = "unknown: no start of this VLMDeployment seen yet"
        else:
            entry["expectedReadyTime"] = rfc3339(created + typical)
            entry["expected"] = (f"median start {typical:.0f} s of the last {len(starts)} "
                                 "seen")
        out.append((created, entry))
    return [e for _, e in sorted(out, key=lambda x: x[0])][:MAX_PENDING_LISTED]
