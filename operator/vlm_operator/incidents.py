"""Incidents and what was done about them. Pure: no I/O, times passed in (epoch seconds).

An incident is a burst of one failure signature on one pod (keyed by the pod's uid and the
spec.health policy key it falls under). Detections are timed by the kubelet's log timestamps,
so a replayed log (a reconnect, an operator restart, a standby taking over) puts every line where
it fell the first time; each time is counted once, in whatever order lines arrive.

Everything an operator needs to finish or undo an action lives in the cluster, never only in
memory: the restart history of the last hour and the actions in flight (a drain before a
ScaleDown, a surge replacement) are annotations on the VLMDeployment, read back by a fresh
operator process.
"""

from __future__ import annotations

import bisect
import json
import threading
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

PREFIX = "serving.vlm-operator.dev"
HISTORY = f"{PREFIX}/remediations"  # VLMDeployment: JSON list of action times, last hour
IN_FLIGHT = f"{PREFIX}/in-flight"  # VLMDeployment: JSON {pod uid: InFlight} of open actions
HOUR = 3600.0
REPLACE, SCALE_DOWN = "Replace", "ScaleDown"


class Windows:
    """Incident times per (pod uid, policy key), each counted once, kept sorted; thread-safe
    (followers add, the autoscaler and the reconciler count)."""

    def __init__(self) -> None:
        self._times: dict[tuple[str, str], list[float]] = {}
        self._lock = threading.Lock()

    def add(self, uid: str, key: str, t: float, window_s: float) -> int:
        """Count an incident at t (again: no change); return how many fall in (t - window_s, t]."""
        with self._lock:
            times = self._times.setdefault((uid, key), [])
            i = bisect.bisect_left(times, t)
            if i == len(times) or times[i] != t:
                times.insert(i, t)
            del times[:bisect.bisect_right(times, times[-1] - window_s)]
            return _between(times, t - window_s, t)

    def count(self, uid: str, key: str, now: float, window_s: float) -> int:
        with self._lock:
            return _between(self._times.get((uid, key), []), now - window_s, now)

    def forget(self, uid: str) -> None:
        with self._lock:
            for k in [k for k in self._times if k[0] == uid]:
                del self._times[k]

    def uids(self) -> set[str]:
        """Pods with incident times kept (in a window or not yet forgotten): the only ones a
        count can find; usually none."""
        with self._lock:
            return {uid for uid, _ in self._times}


def _between(times: list[float], low: float, high: float) -> int:
    """How many of the sorted times fall in (low, high]."""
    return bisect.bisect_right(times, high) - bisect.bisect_right(times, low)


@dataclass(frozen=True, slots=True)
class Incident:
    uid: str
    pod: str
    key: str  # the spec.health policy key (tokenizerRetry, engineDead, extra:<name>)
    signature: str
    first: float
    last: float  # the newest detection counted in it
    count: int  # detections in the rule's window up to `last`
    detail: str = ""  # what was seen, for signals that are not a log line (a stall)


def note(open_incident: Incident | None, *, uid: str, pod: str, key: str, signature: str,
         t: float, count: int, detail: str = "") -> Incident:
    """The open incident after a detection at t with `count` in its window up to t."""
    if open_incident is None:
        return Incident(uid, pod, key, signature, t, t, count, detail)
    if t < open_incident.last:  # a replayed older line: counted in the window, nothing newer
        return open_incident
    return Incident(uid, pod, key, signature, open_incident.first, t, count, detail)


def expired(incident: Incident, now: float, window_s: float) -> bool:
    """An incident is acted on only while its newest detection is inside the rule's window: a
    standby taking over hours later must not act on an old line."""
    return now - incident.last >= window_s


# ---------------------------------------------------------------- restart history

def stamp(t: float) -> float:
    """Times are kept to the millisecond everywhere, so the annotation and memory agree."""
    return round(t, 3)


def parse_history(raw: str | None) -> list[float]:
    """The HISTORY annotation; unreadable content counts as no history (and is rewritten)."""
    if not raw:
        return []
    try:
        values = json.loads(raw)
        return [stamp(float(t)) for t in values] if isinstance(values, list) else []
    except (ValueError, TypeError):
        return []


def merged_history(*sources: Iterable[float], now: float) -> list[float]:
    """One sorted history of the last hour from several copies; the same action counts once."""
    return sorted({stamp(t) for source in sources for t in source if now - HOUR < t})


def history_value(history: Iterable[float]) -> str:
    return json.dumps(sorted(stamp(t) for t in history))


def restarts_in_hour(history: Iterable[float], now: float) -> int:
    return sum(1 for t in history if now - HOUR < t <= now + 1)


# ---------------------------------------------------------------- actions in flight

@dataclass(frozen=True, slots=True)
class InFlight:
    """An action that takes more than one step: what a fresh operator needs to finish it."""

    action: str  # SCALE_DOWN (drain, delete, lower replicas) | REPLACE (surge, delete)
    pod: str
    uid: str
    signature: str
    incident: float  # the newest detection it acts on (later ones are a new incident)
    since: float  # when it started
    replicas: int  # spec.replicas when it started: lowered only if still this value


def parse_in_flight(annotations: Mapping[str, str] | None) -> dict[str, InFlight]:
    """The IN_FLIGHT annotation by pod uid; entries that cannot be read are dropped."""
    raw = (annotations or {}).get(IN_FLIGHT)
    try:
        data = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    out = {}
    for uid, entry in (data.items() if isinstance(data, dict) else ()):
        try:
            record = InFlight(str(entry["action"]), str(entry["pod"]), str(uid),
                              str(entry.get("signature", "")), float(entry["incident"]),
                              float(entry["since"]), int(entry["replicas"]))
        except (KeyError, TypeError, ValueError):
            continue
        if record.action in (REPLACE, SCALE_DOWN):
            out[uid] = record
    return out


def in_flight_value(records: Mapping[str, InFlight]) -> str | None:
    """The annotation value for these records; None removes the annotation."""
    if not records:
        return None
    return json.dumps({uid: {k: v for k, v in asdict(r).items() if k != "uid"}
                       for uid, r in sorted(records.items())}, sort_keys=True)


def surge(annotations: Mapping[str, str] | None) -> int:
    """Extra Deployment replicas while replacements are brought up."""
    return sum(1 for r in parse_in_flight(annotations).values() if r.action == REPLACE)


def acted_until(uid: str, annotations: Mapping[str, str] | None) -> float | None:
    """The newest incident time already acted on for this pod, while an action on it is in
    flight (a Restart needs no record: the pod is deleting or gone, which the in-progress guard
    and the pod's absence cover)."""
    record = parse_in_flight(annotations).get(uid)
    return record.incident if record is not None else None
