"""What other parts use of the Remediator, each a narrow interface: the multi-step actions'
driver (in_flight.py) and the node drain handling (drains.py) an ActionContext, so they never
import the Remediator (which imports them); the detectors (logs/, stalls/) a Reporter, the
periodic round (runtime/rounds.py) a RoundTaker. A test can hand each any object with these
members."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Protocol

from vlm_operator.api.reports import Event
from vlm_operator.k8s.kube import Kube
from vlm_operator.k8s.nodes import Leaving
from vlm_operator.remediation.incidents import InFlight
from vlm_operator.remediation.intake import Owner


class Driver(Protocol):
    def drive(self, namespace: str, name: str) -> None:
        """Make sure a worker takes the VLMDeployment's recorded actions' steps."""


class ActionContext(Protocol):
    kube: Kube
    stopped: threading.Event  # set when the operator stops: workers end
    in_flight: Driver
    engine_dead: Callable[[str], bool]  # the pod (uid)'s current container logged engine death
    leaving_nodes: Callable[[], Mapping[str, Leaving]] | None  # None: not looked for
    # the limits (seconds): a drain, a replacement's start, a node drain's wait for capacity,
    # a surge's wait for a node
    drain_timeout_s: float
    replace_timeout_s: float
    node_drain_wait_s: float
    unschedulable_limit_s: float

    def owner(self, namespace: str, name: str) -> Owner: ...

    def may_act(self, namespace: str) -> bool: ...

    def reconcile(self, namespace: str, name: str) -> None: ...

    def refresh(self, namespace: str, name: str) -> dict | None: ...

    def write_in_flight(self, namespace: str, name: str, owner: Owner, *,
                        add: InFlight | None = None, remove: str | None = None) -> None: ...

    def spare_gpus(self, owner: Owner, pending: int) -> bool | None: ...


class Reporter(Protocol):
    """Where a detector hands what it found."""

    def report(self, namespace: str, name: str, *, uid: str, pod: str, signature: str,
               t: float, count: Callable[[str, float], int], detail: str = "") -> None:
        """A detection of `signature` on the pod at time t (count: the detections in a
        window, for the incident's threshold)."""

    def post_event(self, namespace: str, name: str, pod: dict | None, event: Event,
                   body: dict | None = None) -> None: ...

    def reconcile(self, namespace: str, name: str) -> None:
        """Refresh the VLMDeployment's status (a condition the detector reports changed)."""


class RoundTaker(Protocol):
    def round(self, body: dict, pods: list[dict]) -> None:
        """One VLMDeployment's periodic round: its recorded actions and leaving nodes."""
