"""`vlm-operator run`: configure kopf and start the operator."""

from __future__ import annotations

import argparse
import logging
import os

import kopf
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from prometheus_client import start_http_server

from vlm_operator.autoscaler import Autoscaler
from vlm_operator.kube import Kube
from vlm_operator.logwatch import LogWatch
from vlm_operator.peering import Peering, get_identity
from vlm_operator.periodic import Periodic
from vlm_operator.reconciler import Reconciler

STORAGE_PREFIX = "serving.vlm-operator.dev"
CONNECTION_POOL_SIZE = 64


def _api_client() -> client.ApiClient:
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
    return client.ApiClient(configuration)


def ensure_peering(api: client.ApiClient, name: str, namespaces: list[str]) -> None:
    """kopf only coordinates replicas through a peering object that exists: create it."""
    custom = client.CustomObjectsApi(api)
    body = {"apiVersion": "kopf.dev/v1", "metadata": {"name": name}}
    exact = [ns for ns in namespaces if not any(ch in ns for ch in "*?[")]
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


def configure(settings: kopf.OperatorSettings, args: argparse.Namespace) -> None:
    settings.peering.name = args.peering
    settings.peering.priority = args.priority
    settings.peering.mandatory = not args.standalone
    settings.peering.standalone = args.standalone
    settings.peering.clusterwide = not args.namespaces
    # Our own Events say what happened; kopf's per-handler ones would only add noise.
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = "vlm-operator"
    settings.persistence.finalizer = f"{STORAGE_PREFIX}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=STORAGE_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=STORAGE_PREFIX, key="last-handled-configuration")
    settings.watching.server_timeout = 300
    settings.execution.max_workers = 16


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.kubeconfig:
        os.environ["KUBECONFIG"] = args.kubeconfig
    from vlm_operator import handlers  # registers the handlers on import

    identity = get_identity()

    @kopf.on.startup()
    def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_) -> None:
        configure(settings, args)
        api = _api_client()
        if not args.standalone:
            ensure_peering(api, args.peering, args.namespaces)
        memo.reconciler = Reconciler(Kube(api))
        memo.autoscaler = Autoscaler(memo.reconciler.kube, memo.reconciler.refresh)
        memo.reconciler.report_providers += [memo.autoscaler.reports,
                                             memo.autoscaler.mode_reports]
        peering = None if args.standalone else Peering(
            memo.reconciler.kube, args.peering, identity, args.priority,
            namespaced=bool(args.namespaces))
        memo.logwatch = LogWatch(  # a remediation reads the peering object afresh
            memo.reconciler.kube, memo.reconciler.refresh,
            may_act=(lambda ns: peering.may_act(ns, fresh=True)) if peering else None)
        memo.reconciler.report_providers.append(memo.logwatch.reports)
        memo.autoscaler.failing_pods = memo.logwatch.failing_pods
        memo.periodic = Periodic(
            tick=memo.autoscaler.tick, forget=memo.autoscaler.forget,
            resync=lambda ns, name: handlers.reconcile(memo, ns, name, retry=False),
            may_act=peering.may_act if peering else None).start()
        if args.metrics_port:
            start_http_server(args.metrics_port)

    @kopf.on.cleanup()
    def cleanup(memo: kopf.Memo, **_) -> None:
        memo.periodic.stop()

    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
    kopf.run(clusterwide=not args.namespaces, namespaces=args.namespaces,
             standalone=args.standalone, peering_name=None if args.standalone else args.peering,
             priority=args.priority, liveness_endpoint=liveness, memo=kopf.Memo(),
             identity=identity)
    return 0
