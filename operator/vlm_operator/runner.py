"""`vlm-operator run`: configure kopf and start the operator."""

from __future__ import annotations

import argparse
import logging
import os

import kopf
from kubernetes import client, config
from prometheus_client import start_http_server

from vlm_operator.kube import Kube
from vlm_operator.reconciler import Reconciler

STORAGE_PREFIX = "serving.vlm-operator.dev"


def _api_client() -> client.ApiClient:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def configure(settings: kopf.OperatorSettings, args: argparse.Namespace) -> None:
    settings.peering.name = args.peering
    settings.peering.priority = args.priority
    settings.peering.mandatory = True
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
    from vlm_operator import handlers  # noqa: F401  (registers the handlers)

    @kopf.on.startup()
    def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_) -> None:
        configure(settings, args)
        memo.reconciler = Reconciler(Kube(_api_client()))
        if args.metrics_port:
            start_http_server(args.metrics_port)

    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
    kopf.run(clusterwide=not args.namespaces, namespaces=args.namespaces,
             peering_name=args.peering, priority=args.priority, liveness_endpoint=liveness,
             memo=kopf.Memo())
    return 0
