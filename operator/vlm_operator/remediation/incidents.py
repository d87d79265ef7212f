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
import functools
import json
import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field

from vlm_operator.api import annotation_json
from vlm_operator.api.actions import Action, recorded
from vlm_operator.api.names import HISTORY, IN_FLIGHT  # noqa: F401 (incidents.HISTORY)
from vlm_operator.k8s.views import Pod

HOUR = 3600.0
MAX_HISTORY = 1000  # remediation times kept on a VLMDeployment (the budget counts far fewer)


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
    """The HISTORY annotation (bounded: annotation_json); unreadable content and entries that
    are not finite times count as no history (and are rewritten). A history longer than an
    hour of remediations could be is cut to its newest MAX_HISTORY times."""
    values = annotation_json.read(raw)
    if not isinstance(values, list):
        return []
    out = []
    for t in values[-MAX_HISTORY:]:
        try:
            t = float(t)
        except (TypeError, ValueError, OverflowError):
            continue
        if math.isfinite(t):
            out.append(stamp(t))
    return out


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
    """An action that takes more than one step: what a fresh operator needs to finish it.

    A Replace runs one extra Deployment replica (`surge`) until its pod can go. Its replacement
    is identified from the cluster, never from memory: the earliest-created pod of the
    VLMDeployment that was not among its pods when the surge began (their uids are `before`)
    and that no other action claimed; once seen, its uid is written into `replacement`. A Replace
    for a pod on a node that is leaving (a drain, a node the cluster autoscaler or Karpenter
    removes) starts without a surge while no GPU is free elsewhere (`surge` False), and lets the
    pod go `node_since` (a drain first seen; None for a cordon alone, which never lets it go) +
    the node drain wait later unless a replacement is on its way by then."""

    action: Action  # SCALE_DOWN (drain, delete, lower replicas) | REPLACE (surge, drain, delete)
    pod: str
    uid: str
    signature: str  # what it acts on: a failure signature, or NODE_DRAIN
    incident: float  # the newest detection it acts on (later ones are a new incident)
    since: float  # when it started (a Replace: when its surge began)
    replicas: int  # spec.replicas when it started: lowered only if still this value
    surge: bool = True  # Replace: an extra Deployment replica runs for it
    before: tuple[str, ...] = ()  # Replace: uids of the VLMDeployment's pods at the surge
    replacement: str = ""  # Replace: uid of the replacement pod, once seen
    tried: bool = False  # Replace: a surge for it was given up (a node drain then only waits)
    drain_since: float | None = None  # Replace: when the pod was taken out of the Service
    node: str = ""  # the pod's node, once seen leaving
    node_since: float | None = None  # when the pod's node was first seen showing a drain
    deleted: bool = False  # Replace: the operator deleted the pod (its PodReplaced said so)


NODE_DRAIN = "node_drain"  # InFlight.signature of a Replace its node's drain asked for
# Actions open on one VLMDeployment at once, at most: one per pod on the nodes being drained,
# or a burst of storms; records past it are dropped (read_in_flight)
MAX_IN_FLIGHT = 64
_OPTIONAL = {"surge": True, "before": (), "replacement": "", "tried": False,
             "drain_since": None, "node": "", "node_since": None, "deleted": False}


@dataclass(frozen=True, slots=True)
class InFlightRead:
    """The IN_FLIGHT annotation as read: the records kept, and what was not kept."""

    records: dict[str, InFlight]
    unreadable: bool = False  # the text is too long, too deep or not JSON: no record kept
    dropped: int = 0  # entries that are no record, or past MAX_IN_FLIGHT
    # entries naming an action this operator does not know (a newer operator's): kept as
    # written (in_flight_value writes them back), never driven, and said
    unknown: dict[str, dict] = field(default_factory=dict)


def read_in_flight(annotations: Mapping[str, str] | None) -> InFlightRead:
    """The IN_FLIGHT annotation by pod uid (bounded: annotation_json). Entries that cannot be
    read are dropped, and so is every record past the first MAX_IN_FLIGHT in uid order: the
    operator never has that many actions open on one VLMDeployment, so more are forged. An
    entry whose action this operator does not know is kept apart, as written."""
    raw = (annotations or {}).get(IN_FLIGHT)
    if not (isinstance(raw, str) or raw is None):
        return InFlightRead({}, unreadable=True)
    records, unknown, unreadable, dropped = _read_text(raw)
    return InFlightRead(dict(records), unreadable, dropped,
                        {uid: json.loads(text) for uid, text in unknown})


@functools.lru_cache(maxsize=32)
def _read_text(raw: str | None) -> tuple[tuple[tuple[str, InFlight], ...],
                                         tuple[tuple[str, str], ...], bool, int]:
    """read_in_flight of one annotation text, kept for the next read of the same text: each
    round reads it several times (whether a round is due, the remediator's round, node
    drains, the autoscaler), and a forged one may be 256 KiB. 32 texts are kept (8 MiB of
    text at most, and the records read from it). The unknown entries come as JSON texts."""
    data = annotation_json.read(raw)
    if data is annotation_json.UNREADABLE or (data is not None and not isinstance(data, dict)):
        return (), (), True, 0
    entries = sorted((data or {}).items())[:MAX_IN_FLIGHT]
    out = tuple((uid, record) for uid, entry in entries
                if (record := _record(uid, entry)) is not None)
    unknown = tuple((uid, json.dumps(entry, sort_keys=True)) for uid, entry in entries
                    if isinstance(entry, dict) and isinstance(entry.get("action"), str)
                    and recorded(entry["action"]) is None)
    return out, unknown, False, len(data or {}) - len(out) - len(unknown)


def _record(uid: str, entry: object) -> InFlight | None:
    """One entry as a record, or None: a missing or mistyped field, an action the operator
    does not record (read_in_flight keeps those apart), a time that is not finite."""
    try:
        action = recorded(entry["action"])
        if action is None:
            return None
        drain_since, node_since = entry.get("drain_since"), entry.get("node_since")
        before = entry.get("before") or ()
        if not isinstance(before, list | tuple):
            return None
        record = InFlight(
            action, str(entry["pod"]), str(uid),
            str(entry.get("signature", "")), float(entry["incident"]),
            float(entry["since"]), int(entry["replicas"]),
            bool(entry.get("surge", True)),
            tuple(str(u) for u in before),
            str(entry.get("replacement") or ""), bool(entry.get("tried", False)),
            None if drain_since is None else float(drain_since),
            str(entry.get("node") or ""),
            None if node_since is None else float(node_since),
            bool(entry.get("deleted", False)))
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError):
        return None
    times = (record.incident, record.since, record.drain_since, record.node_since)
    return record if all(t is None or math.isfinite(t) for t in times) else None


def parse_in_flight(annotations: Mapping[str, str] | None) -> dict[str, InFlight]:
    """The IN_FLIGHT records by pod uid (read_in_flight); none when unreadable."""
    return read_in_flight(annotations).records


def in_flight_value(records: Mapping[str, InFlight],
                    unknown: Mapping[str, dict] | None = None) -> str | None:
    """The annotation value for these records (fields at their defaults left out) and the
    entries of actions this operator does not know, as they were written; None removes the
    annotation."""
    entries = {**(unknown or {}),
               **{uid: {k: list(v) if isinstance(v, tuple) else v
                        for k, v in asdict(r).items()
                        if k != "uid" and (k not in _OPTIONAL or v != _OPTIONAL[k])}
                  for uid, r in records.items()}}
    return json.dumps(entries, sort_keys=True) if entries else None


def surge(annotations: Mapping[str, str] | None) -> int:
    """Extra Deployment replicas while replacements are brought up."""
    return sum(1 for r in parse_in_flight(annotations).values()
               if r.action == Action.REPLACE and r.surge)


def _created(pod: Mapping) -> str:
    return Pod(pod).metadata.get("creationTimestamp") or ""


def replacements(records: Mapping[str, InFlight], pods: Iterable[Mapping]) -> dict[str, str]:
    """The replacement pod (uid) of each Replace with a surge, where one exists: the claimed
    pod while it exists, else the earliest-created pod not among the VLMDeployment's pods when
    its surge began and not claimed by another (older Replaces choose first). A claimed pod that
    is gone (a scale-down by another writer, an eviction) frees its Replace to claim the next
    new pod the ReplicaSet makes."""
    live = {Pod(p).uid: p for p in pods if not Pod(p).deleting}
    surging = sorted(((uid, r) for uid, r in records.items()
                      if r.action == Action.REPLACE and r.surge),
                     key=lambda item: (item[1].since, item[0]))
    out = {uid: r.replacement for uid, r in surging if r.replacement in live}
    taken = set(out.values()) | set(records)
    for uid, record in surging:
        if uid in out:
            continue
        new = sorted((p for u, p in live.items() if u not in record.before and u not in taken),
                     key=lambda p: (_created(p), Pod(p).name))
        if new:
            out[uid] = Pod(new[0]).uid
            taken.add(out[uid])
    return out


def pending_claims(records: Mapping[str, InFlight], pods: Iterable[Mapping]) -> int:
    """GPUs the VLMDeployment is about to take that no node shows as used yet: its pods not
    bound to a node, and the surges whose replacement pod the ReplicaSet has not made yet."""
    pods = [p for p in pods if not Pod(p).deleting]
    unbound = sum(1 for p in pods if not Pod(p).node_name)
    found = replacements(records, pods)
    waiting = sum(1 for uid, r in records.items()
                  if r.action == Action.REPLACE and r.surge and uid not in found)
    return unbound + waiting


def acted_until(uid: str, annotations: Mapping[str, str] | None) -> float | None:
    """The newest incident time already acted on for this pod, while an action on it is in
    flight (a Restart needs no record: the pod is deleting or gone, which the in-progress guard
    and the pod's absence cover)."""
    record = parse_in_flight(annotations).get(uid)
    return record.incident if record is not None else None
