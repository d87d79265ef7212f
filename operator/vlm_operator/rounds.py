"""One round per VLMDeployment every second (periodic.py, on the active replica only): its
pods listed once, each pod's /metrics read once (scrape.Scraper: in parallel, each with a
deadline), and the readings handed to stall detection and, in Builtin mode, to the autoscaler;
the remediator makes sure every action in flight has a driver and looks for node drains."""

from __future__ import annotations

from vlm_operator import builders
from vlm_operator.autoscaler import Autoscaler, is_builtin, metric_names
from vlm_operator.kube import Kube
from vlm_operator.logfollow import is_running
from vlm_operator.remediator import Remediator
from vlm_operator.scrape import Scraper
from vlm_operator.spec import SpecError, parse
from vlm_operator.stall_watch import StallWatch
from vlm_operator.stalls import PROGRESS_METRICS


class Rounds:
    def __init__(self, kube: Kube, scraper: Scraper, stall_watch: StallWatch,
                 autoscaler: Autoscaler, remediator: Remediator) -> None:
        self.kube, self.scraper = kube, scraper
        self.stall_watch, self.autoscaler = stall_watch, autoscaler
        self.remediator = remediator

    def tick(self, body: dict) -> None:
        """body: the plain-dict snapshot periodic.py keeps (read, never changed)."""
        try:
            vlmd = parse(body)
        except SpecError:
            return
        listed = self.kube.list_pods(vlmd.namespace, builders.get_selector(vlmd.name))
        pods = [p for p in listed if not p["metadata"].get("deletionTimestamp")]
        builtin = is_builtin(vlmd.spec)
        names = {*PROGRESS_METRICS, *(metric_names(vlmd.spec) if builtin else ())}
        # every running container, ready or not: a hung API server fails its readiness probe
        # long before its liveness probe restarts it, and is still this round's business
        scrapes = self.scraper.scrape([p for p in pods if is_running(p)], names)
        self.stall_watch.observe(vlmd, pods, scrapes)
        if builtin:
            self.autoscaler.tick(body, pods, scrapes)
        else:
            self.autoscaler.forget(vlmd.namespace, vlmd.name)
        self.remediator.round(body, listed)  # last: its API trouble fails only its part

    def forget(self, namespace: str, name: str) -> None:
        """The VLMDeployment is gone (or no longer this replica's)."""
        self.stall_watch.forget(namespace, name)
        self.autoscaler.forget(namespace, name)
