"""Detections in, incidents counted: the per-VLMDeployment state the Remediator keeps between
detections (its policy, the open and held incidents, back-off, what was already reported), and
the bookkeeping on it. No I/O; the Remediator holds `Owner.lock` around all of it."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

from vlm_operator.api import log_signatures
from vlm_operator.api.validation import VLMDeployment
from vlm_operator.metrics import REMEDIATIONS_SKIPPED
from vlm_operator.remediation.decide import RemediationPlan
from vlm_operator.remediation.incidents import Incident, InFlight, expired
from vlm_operator.remediation.policy import HealthPolicy

RECONSIDER_S = 3.0  # held incidents are decided again at least this often
Key = tuple[str, str]  # (pod uid, policy key)


class Owner:
    """Per-VLMDeployment state. `lock` serialises decisions and actions (held across API
    calls); what other threads read is replaced whole, never mutated in place."""

    def __init__(self, namespace: str, name: str) -> None:
        self.namespace, self.name = namespace, name
        self.lock = threading.Lock()
        self.policy: HealthPolicy | None = None
        self.vlmd: VLMDeployment | None = None
        self.extra: tuple[log_signatures.Signature, ...] = ()
        self.history: list[float] = []
        self.in_flight: dict[str, InFlight] = {}
        self.open: dict[Key, Incident] = {}  # (pod uid, policy key) -> incident
        self.held: dict[Key, RemediationPlan] = {}  # why each held incident waits
        self.backoff: dict[str, tuple[int, float]] = {}  # pod uid -> (attempts, until)
        self.told: set[tuple] = set()  # ((uid, key), first, reason) already reported
        # when a detection last had an incident decided (monotonic), and the VLMDeployment
        # last read: a flood of log lines costs no API call each
        self.decided: dict[Key, float] = {}
        self.refreshed_at = -math.inf

    def close(self, key: Key) -> None:
        self.open = {k: v for k, v in self.open.items() if k != key}
        self.held = {k: v for k, v in self.held.items() if k != key}
        self.told = {mark for mark in self.told if mark[0] != key}

    def drop_expired(self) -> None:
        """Incidents past their window close even where this replica may not act (a paused
        standby would otherwise hold them for ever)."""
        now = time.time()
        for key, incident in list(self.open.items()):
            found = self.policy.rule_for(incident.signature) if self.policy else None
            if found is not None and expired(incident, now, found[1].window_s):
                self.close(key)

    def skip_once(self, key: Key, reason: str, incident: Incident | None = None) -> bool:
        """Count a guard once per incident and reason; True the first time."""
        incident = incident or self.open.get(key)
        mark = (key, incident.first if incident else None, reason)
        if mark in self.told:
            return False
        self.told.add(mark)
        REMEDIATIONS_SKIPPED.labels(self.namespace, self.name, reason).inc()
        return True

    def forget(self, uid: str) -> None:
        """The pod is gone: its incidents, reports and back-off with it."""
        for key in [k for k in self.open if k[0] == uid]:
            self.close(key)
        self.told = {mark for mark in self.told if mark[0][0] != uid}
        self.decided = {k: t for k, t in self.decided.items() if k[0] != uid}
        self.backoff.pop(uid, None)


@dataclass(frozen=True, slots=True)
class Case:
    """One open incident with what its decision read from the cluster, read once."""

    namespace: str
    name: str
    owner: Owner
    body: dict  # the VLMDeployment
    pods: list[dict]
    pod: dict  # the incident's pod
    incident: Incident


def due(last: float) -> bool:
    """Whether RECONSIDER_S passed since `last` (monotonic)."""
    return time.monotonic() - last >= RECONSIDER_S
