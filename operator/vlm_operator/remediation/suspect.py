"""When a pod's node is suspect, so that recovering the pod in place (the kubelet restarting its
container on the same node, with the same GPU) is not worth trying: its log showed a GPU or
driver fault (the gpu_error signature), or it already recovered in place MAX_IN_PLACE times
within SUSPECT_WINDOW_S and failed again. remediation/ladder.py then takes a new pod as the
rung. Pure: no I/O, times passed in.

Both inputs outlive the operator process where they have to: the in-place recoveries are
counted on the pod (annotation RECOVERED_IN_PLACE, written with the unfence), so a fresh
operator continues the count; the GPU error is the log follower's (a fresh one reads the
current container's log back over the incident windows), and a round acts on it within a
second by recording the DELETE rung in the pod's fence. The operator never writes the Node: it
did not create it; it says what it suspects in a NodeSuspect Event on the pod.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from vlm_operator.api.names import RECOVERED_IN_PLACE
from vlm_operator.k8s.views import Pod

SUSPECT_WINDOW_S = 3600.0  # how long a GPU error or an in-place recovery counts against a node
MAX_IN_PLACE = 2  # in-place recoveries of one pod in that window before the next is a new pod
MAX_KEPT = 8  # recovery times kept in the annotation
MAX_RAW = 256  # characters of the annotation read (a longer one counts nothing)
CLOCK_SLACK_S = 60.0  # times this far ahead of the operator's clock still count


@dataclass(frozen=True, slots=True)
class GpuFault:
    """A GPU or driver fault the pod's log showed: when (the kubelet's stamp of the line), and
    the fault as CUDA or NCCL words it (the signature's `error` field: constant texts only)."""

    at: float
    text: str


@dataclass(frozen=True, slots=True)
class Suspect:
    node: str
    why: str


def recoveries(annotations: Mapping[str, str] | None, now: float) -> tuple[float, ...]:
    """Times of the pod's in-place recoveries within SUSPECT_WINDOW_S before now. The operator
    writes the annotation, but whoever may patch the pod can too: a value too long, a part that
    is no finite number or outside the window, counts nothing (never an error)."""
    raw = (annotations or {}).get(RECOVERED_IN_PLACE)
    if not isinstance(raw, str) or len(raw) > MAX_RAW:
        return ()
    out = []
    for part in raw.split(",")[:MAX_KEPT]:
        try:
            t = float(part)
        except ValueError:
            continue
        if math.isfinite(t) and now - SUSPECT_WINDOW_S < t <= now + CLOCK_SLACK_S:
            out.append(t)
    return tuple(sorted(out))


def recoveries_value(previous: tuple[float, ...], now: float) -> str:
    """The annotation after one more in-place recovery at `now` (the last MAX_KEPT)."""
    return ",".join(f"{t:.3f}" for t in (*previous, now)[-MAX_KEPT:])


def suspect(pod: Mapping, gpu_error: GpuFault | None, now: float) -> Suspect | None:
    """Why the pod's node is suspect, or None. gpu_error: the last GPU fault its log showed
    (None: none seen)."""
    meta = Pod(pod)
    node = meta.node_name or "(none yet)"
    if gpu_error is not None and now - gpu_error.at <= SUSPECT_WINDOW_S:
        return Suspect(node, f"GPU error on node {node}: {gpu_error.text}; a new pod, not an "
                             "in-place restart on the same GPU")
    done = recoveries(meta.annotations, now)
    if len(done) >= MAX_IN_PLACE:
        return Suspect(node, f"{meta.name} already recovered in place {len(done)} "
                             f"times on node {node} in the last {SUSPECT_WINDOW_S / 60:.0f} "
                             "min; a new pod, not another in-place restart there")
    return None
