"""One round per VLMDeployment every second (runtime/periodic.py, on the active replica only): its
pods listed once (from the watch-fed cache: no request), each pod's /metrics read once
(scrape.Scraper: in parallel, each with a deadline, on workers shared fairly between
namespaces), and the readings handed to podreads/reachability.py (reachability for status), stall
detection and, in Builtin mode, the autoscaler; the remediator makes sure every action in flight
has a driver and looks for node drains.

A VLMDeployment with no pod has no round (`due`): nothing to read, nothing to decide, no
round worker taken, unless its Builtin autoscaler has replicas to add (below minReplicas) or
the last round left state to clear."""

from __future__ import annotations

from vlm_operator.api import crd
from vlm_operator.api.validation import SpecError, parse
from vlm_operator.autoscaling.autoscaler import Autoscaler, metric_names
from vlm_operator.autoscaling.recommend import scaling_policy_from_spec
from vlm_operator.desired import children
from vlm_operator.k8s.caches import ClusterCache
from vlm_operator.k8s.views import Body, Pod
from vlm_operator.podreads.reachability import PodReads
from vlm_operator.podreads.reader import Scraper
from vlm_operator.remediation import incidents
from vlm_operator.remediation.context import RoundTaker
from vlm_operator.stalls.verdicts import PROGRESS_METRICS
from vlm_operator.stalls.watch import StallWatch


class Rounds:
    def __init__(self, cluster: ClusterCache, scraper: Scraper, stall_watch: StallWatch,
                 autoscaler: Autoscaler, reads: PodReads, remediator: RoundTaker) -> None:
        self.cluster, self.scraper, self.reads = cluster, scraper, reads
        self.stall_watch, self.autoscaler = stall_watch, autoscaler
        self.remediator = remediator

    def due(self, body: dict) -> bool:
        """Whether the VLMDeployment's round has anything to do (body as for tick). No request:
        the pods come from the cache, without waiting for it (a cache that cannot say yet
        counts as pods: the round then says what is wrong)."""
        meta = Body(body)
        namespace, name = meta.namespace, meta.name
        if self.cluster.has_pods(namespace, name) is not False:
            return True
        if self.reads.tracks(namespace, name):  # pods went: one more round clears their state
            return True
        if incidents.parse_in_flight(meta.annotations):  # an action to drive
            return True
        spec = body.get("spec") or {}
        if crd.autoscaling_mode(spec) != "Builtin":
            return False
        try:
            return int(spec.get("replicas", 1)) < scaling_policy_from_spec(
                spec["autoscaling"]).min_replicas
        except (TypeError, ValueError, KeyError):
            return True  # a spec the round must report on

    def tick(self, body: dict) -> None:
        """body: the plain-dict snapshot runtime/periodic.py keeps (read, never changed)."""
        try:
            vlmd = parse(body)
        except SpecError:
            return
        listed = self.cluster.list_pods(vlmd.namespace, children.get_selector(vlmd.name))
        pods = [p for p in listed if not Pod(p).deleting]
        builtin = crd.autoscaling_mode(vlmd.spec) == "Builtin"
        names = {*PROGRESS_METRICS, *(metric_names(vlmd.spec) if builtin else ())}
        # every running container, ready or not: a hung API server fails its readiness probe
        # long before its liveness probe restarts it, and is still this round's business
        scrapes = self.scraper.scrape((vlmd.namespace, vlmd.name),
                                      [p for p in pods if Pod(p).running], names)
        self.reads.observe(vlmd.namespace, vlmd.name, pods, scrapes)
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
        self.reads.forget(namespace, name)
