"""`vlm-operator run`: configure kopf and start the operator.

This is the one place the operator's long-lived objects are made and wired (`build`), and each
is complete when its constructor returns: nothing is assigned onto an object afterwards. The
order is what makes that possible:

1. what needs nothing of the others: the API wrapper, the watchdog, the watch-fed caches, the
   peering reader, the heartbeat store, the registry of log followers (logs/followers.py), and
   the GPU budget (autoscaling/budget.py), which both the autoscaler (scale-ups) and
   remediation (surge replacements) read;
2. the Remediator, given the budget's `replica_fits` and what the followers know of a pod; log
   watching, given the Remediator and the registry it fills; stall detection, given the
   Remediator; the autoscaler, given the log watcher's `failing_pods`; the pod reads;
3. the rounds over all of these, and last the Reconciler, given every report provider at once.

One cycle is real at run time and cannot be ordered away: log watching, the autoscaler and
the pod reads publish status through `Reconciler.refresh` when a condition of theirs changes,
and the Reconciler asks each of them for those conditions when it publishes. They get `refresh`,
a function that looks the Reconciler up when called (a closure over the name `build` binds it
to last); nothing calls it before `build` returns, since only pod events, detections and the
periodic rounds do, and those start after (kopf's handlers and `Periodic.start`).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

import kopf
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from prometheus_client import start_http_server

from vlm_operator import metrics
from vlm_operator.api.admin_policy import AdminPolicy
from vlm_operator.api.names import FINALIZER, STORAGE_PREFIX
from vlm_operator.autoscaling.autoscaler import Autoscaler
from vlm_operator.autoscaling.budget import GpuBudget
from vlm_operator.k8s.caches import ClusterCache
from vlm_operator.k8s.gpu_plan import Growth
from vlm_operator.k8s.kube import CONNECT_TIMEOUT_S, ApiClient, Kube, configure_connections
from vlm_operator.k8s.peering import Peering, get_identity
from vlm_operator.logs.followers import Followers
from vlm_operator.logs.watcher import LogWatch
from vlm_operator.podreads.reachability import PodReads
from vlm_operator.podreads.reader import Scraper
from vlm_operator.reconcile.reconciler import Reconciler
from vlm_operator.remediation.ladder import KubeletBackoff
from vlm_operator.remediation.remediator import Remediator
from vlm_operator.remediation.steps import UNSCHEDULABLE_S
from vlm_operator.runtime.namespace_discovery import count_listed_namespaces
from vlm_operator.runtime.periodic import Periodic
from vlm_operator.runtime.rounds import Rounds
from vlm_operator.runtime.sharding import Shard, ordinal
from vlm_operator.runtime.watchdog import Watchdog
from vlm_operator.stalls.watch import Heartbeats, StallWatch

CONNECTION_POOL_SIZE = 64
KOPF_REQUEST_TIMEOUT_S = 30.0  # kopf's own requests (its default is 5 minutes)


class RetryForever:
    """kopf's backoffs between failed API requests, never running out: kopf's default list
    (54 s in all) ends its watch streams with an error, which stops the whole operator after
    an apiserver outage of about a minute. Iterable, not Sized: kopf then retries for as long
    as it takes."""

    def __iter__(self):
        return itertools.chain((1, 1, 2, 3, 5, 8), itertools.repeat(10))


def _api_client() -> ApiClient:
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        # the client read $KUBECONFIG at import time, before run() set it: pass it explicitly
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"),
                                client_configuration=configuration)
    # One connection per busy thread (log followers, reconciles, autoscaler rounds): a smaller
    # pool drops connections and pays a TLS handshake for each new one.
    configuration.connection_pool_maxsize = CONNECTION_POOL_SIZE
    return ApiClient(configure_connections(configuration))  # deadlines and keepalive on every call


def is_pattern(namespace: str) -> bool:
    """A kopf namespace glob (or ! exclusion), not one exact namespace."""
    return any(ch in namespace for ch in "*?[!")


def ensure_peering(api: client.ApiClient, name: str, namespaces: list[str]) -> None:
    """kopf only coordinates replicas through a peering object that exists: create it."""
    custom = client.CustomObjectsApi(api)
    body = {"apiVersion": "kopf.dev/v1", "metadata": {"name": name}}
    exact = [ns for ns in namespaces if not is_pattern(ns)]
    if exact != namespaces:
        logging.getLogger(__name__).warning(
            "namespace patterns given: create the KopfPeering %r in the namespaces they match "
            "yourself, or replicas may act twice", name)
    if namespaces:
        creates = [lambda ns=ns: custom.create_namespaced_custom_object(
            "kopf.dev", "v1", ns, "kopfpeerings", {**body, "kind": "KopfPeering"})
            for ns in exact]
    else:
        creates = [lambda: custom.create_cluster_custom_object(
            "kopf.dev", "v1", "clusterkopfpeerings", {**body, "kind": "ClusterKopfPeering"})]
    for create in creates:
        try:
            create()
        except ApiException as exc:
            if exc.status != 409:  # 409: it exists already
                raise


def get_shard(args: argparse.Namespace) -> Shard:
    """--shards/--shard; 'auto' takes the StatefulSet ordinal of POD_NAME (else the host)."""
    index = (ordinal(os.environ.get("POD_NAME") or socket.gethostname())
             if args.shard == "auto" else int(args.shard))
    if index is None or not 0 <= index < max(1, args.shards):
        raise SystemExit(f"--shard {args.shard}: needs a shard in 0..{args.shards - 1} (auto: "
                         "a pod name ending in -<ordinal>)")
    return Shard(index, max(1, args.shards))


def get_policy(args: argparse.Namespace) -> AdminPolicy:
    """The admin's policy from `vlm-operator run`'s flags."""
    return AdminPolicy(
        tuple(args.image_prefixes), tuple(args.priority_classes), args.secret_label,
        deny_code_options=args.deny_code_options,
        autoscaling_modes=tuple(args.autoscaling_modes or AdminPolicy.autoscaling_modes),
        prometheus_addresses=tuple(args.keda_prometheus_addresses))


def configure(settings: kopf.OperatorSettings, args: argparse.Namespace) -> None:
    settings.peering.name = get_shard(args).peering(args.peering)
    settings.peering.priority = args.priority
    settings.peering.mandatory = not args.standalone
    settings.peering.standalone = args.standalone
    settings.peering.clusterwide = not args.namespaces
    # Exact namespaces need no discovery: kopf would list and watch Namespaces (a permission
    # the cluster-wide install does not grant) and retry a refused list for about a minute
    # before serving. CRDs are then those present at start (installed before the operator).
    settings.scanning.disabled = bool(args.namespaces) and not any(
        map(is_pattern, args.namespaces))
    # Our own Events say what happened; kopf's per-handler ones would only add noise.
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = "vlm-operator"
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=STORAGE_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=STORAGE_PREFIX, key="last-handled-configuration")
    settings.watching.server_timeout = 300
    # No call without a deadline, kopf's too; a watch that hears nothing, not even a bookmark,
    # for watching.inactivity_timeout (70 s) is reopened by kopf itself.
    settings.networking.request_timeout = KOPF_REQUEST_TIMEOUT_S
    settings.networking.error_backoffs = RetryForever()
    settings.networking.connect_timeout = CONNECT_TIMEOUT_S
    settings.watching.connect_timeout = CONNECT_TIMEOUT_S
    settings.execution.max_workers = 16


def _not_pool_full(record: logging.LogRecord) -> bool:
    """urllib3 warns whenever a connection does not fit back into a full pool: with more pods
    followed than pooled connections, that is every log stream that ends (thousands of lines a
    minute at 2,000 pods, bench/scale.py), and the connection is only closed."""
    return not record.getMessage().startswith("Connection pool is full")


@dataclass(frozen=True)
class Parts:
    """The operator's long-lived objects, as `build` wired them."""
    reconciler: Reconciler
    watchdog: Watchdog
    cluster: ClusterCache
    budget: GpuBudget
    peering: Peering | None
    remediator: Remediator
    logwatch: LogWatch
    stall_watch: StallWatch
    autoscaler: Autoscaler
    reads: PodReads
    scraper: Scraper
    rounds: Rounds
    periodic: Periodic  # not started yet


def growth(args: argparse.Namespace) -> Growth | None:
    """The GPU capacity a node autoscaler may add (`--node-autoscaler-*`); None: existing
    nodes only."""
    total = args.node_autoscaler_pending_gpus
    if not total:
        return None
    per = args.node_autoscaler_pending_gpus_per_deployment
    return Growth(total if per is None else min(per, total), total,
                  args.node_autoscaler_timeout_seconds)


def build(api: client.ApiClient, args: argparse.Namespace, *, shard: Shard, identity: str,
          peering_name: str, resync: Callable[[str, str], None]) -> Parts:
    """Make and wire the operator's objects in an order where each is complete when made (the
    module's docstring says which). `resync(namespace, name)`: the periodic full reconcile
    (handlers.reconcile, which turns API errors into log lines)."""
    kube = Kube(api)
    watchdog = Watchdog()
    # watch-fed: nodes and GPU pods for the budget, managed pods for the rounds
    cluster = ClusterCache(kube, args.namespaces, watchdog, owns=shard.owns,
                           drain_markers=args.node_drain_markers)
    budget = GpuBudget(cluster, growth(args))
    peering = None if args.standalone else Peering(
        kube, peering_name, identity, args.priority, namespaced=bool(args.namespaces))
    heartbeats = Heartbeats()  # the log followers write the engine heartbeats, rounds read

    def refresh(namespace: str, name: str) -> None:
        """Reconciler.refresh, looked up when called: the Reconciler is made last."""
        reconciler.refresh(namespace, name)

    followers = Followers()  # the log watcher keeps them, the remediator asks about pods
    remediator = Remediator(  # a remediation reads the peering object afresh
        kube, refresh,
        may_act=(lambda ns: peering.may_act(ns, fresh=True)) if peering else None,
        replica_fits=budget.replica_fits, engine_dead=followers.engine_dead,
        plugin_loaded=followers.plugin_loaded, gpu_error=followers.gpu_error,
        leaving_nodes=cluster.leaving_nodes,
        node_drain_wait_s=args.node_drain_wait_seconds,
        kubelet_backoff=KubeletBackoff(args.kubelet_backoff_seconds,
                                       args.kubelet_max_backoff_seconds),
        unschedulable_limit_s=(budget.growth.timeout_s if budget.growth
                               else UNSCHEDULABLE_S)).start()
    logwatch = LogWatch(kube, refresh, remediator, followers,
                        may_mark=peering.may_act if peering else None,
                        mark_every_s=args.log_mark_seconds, heartbeats=heartbeats)
    stall_watch = StallWatch(remediator, heartbeats)
    autoscaler = Autoscaler(kube, refresh, budget=budget, failing_pods=logwatch.failing_pods)
    reads = PodReads(refresh)  # PodsReachable, PodsReadable
    scraper = Scraper()
    rounds = Rounds(cluster, scraper,  # its pod lists come from the cache
                    stall_watch, autoscaler, reads, remediator)
    reconciler = Reconciler(kube, get_policy(args), report_providers=(
        autoscaler.reports, autoscaler.mode_reports, watchdog.reports, logwatch.reports,
        stall_watch.reports, reads.reports), inference_pools=args.inference_pools)

    def forget(namespace: str, name: str) -> None:
        """The VLMDeployment is gone (or another shard's): its round state and series."""
        rounds.forget(namespace, name)
        metrics.forget_vlmd(namespace, name)

    periodic = Periodic(
        tick=rounds.tick, forget=forget, due=rounds.due, sweep=metrics.keep_only,
        resync=resync, may_act=peering.may_act if peering else None, watchdog=watchdog)
    return Parts(reconciler=reconciler, watchdog=watchdog, cluster=cluster, budget=budget,
                 peering=peering, remediator=remediator, logwatch=logwatch,
                 stall_watch=stall_watch, autoscaler=autoscaler, reads=reads, scraper=scraper,
                 rounds=rounds, periodic=periodic)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("urllib3.connectionpool").addFilter(_not_pool_full)
    if args.kubeconfig:
        os.environ["KUBECONFIG"] = args.kubeconfig
    from vlm_operator import handlers  # registers the handlers on import

    identity = get_identity()
    shard = get_shard(args)
    peering_name = shard.peering(args.peering)

    @kopf.on.startup()
    def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_) -> None:
        configure(settings, args)
        api = _api_client()
        if not args.standalone:
            ensure_peering(api, peering_name, args.namespaces)
        parts = build(api, args, shard=shard, identity=identity, peering_name=peering_name,
                      resync=lambda ns, name: handlers.reconcile(memo, ns, name, retry=False))
        memo.reconciler, memo.cluster, memo.autoscaler = (
            parts.reconciler, parts.cluster, parts.autoscaler)
        memo.logwatch, memo.scraper, memo.periodic = parts.logwatch, parts.scraper, parts.periodic
        parts.periodic.start()  # its resync reads memo.reconciler
        if args.metrics_port:
            start_http_server(args.metrics_port)

    @kopf.on.cleanup()
    def cleanup(memo: kopf.Memo, **_) -> None:
        memo.periodic.stop()
        memo.logwatch.stop()
        memo.scraper.stop()
        memo.cluster.stop()

    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
    if any(map(is_pattern, args.namespaces)):
        count_listed_namespaces()
    kopf.run(clusterwide=not args.namespaces, namespaces=args.namespaces,
             standalone=args.standalone, peering_name=None if args.standalone else peering_name,
             priority=args.priority, liveness_endpoint=liveness, identity=identity,
             memo=kopf.Memo(shard=shard, seen={}))  # seen: handlers._news
    return 0
