"""What the parts of the operator tell users about a VLMDeployment: a status condition
(`Report`) or a Kubernetes Event (`Event`). Pure data; reconcile/status.py folds them into the
status."""

from __future__ import annotations

from typing import NamedTuple


class Report(NamedTuple):
    """A condition contributed by another part of the operator (log watching, autoscaling).

    A Degraded=True report wins over the Deployment-derived Degraded=False; other types are set
    as given.
    """

    type: str
    status: str
    reason: str
    message: str


class Event(NamedTuple):
    type: str  # Normal | Warning
    reason: str
    message: str
