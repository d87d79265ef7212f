"""e2e fixtures: a real local control plane (or an existing cluster via --kubeconfig/KUBECONFIG)."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from vlm_testbed.controlplane import (
    ControlPlane,
    api_client_from_kubeconfig,
    build,
    kubectl_path,
    ready_namespace,
)

E2E_DIR = Path(__file__).parent

# A tiny CRD of our own, applied before the controllers start, so the e2e tests can check
# custom resources (the reflect2 fix) and garbage collection of their children.
TEST_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.testbed.vlm.dev"},
    "spec": {
        "group": "testbed.vlm.dev",
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
        "versions": [{
            "name": "v1", "served": True, "storage": True,
            "schema": {"openAPIV3Schema": {
                "type": "object", "x-kubernetes-preserve-unknown-fields": True}},
        }],
    },
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--kubeconfig", default=None,
                     help="run e2e tests against this existing cluster instead of a local one")


def pytest_configure(config: pytest.Config) -> None:
    """Side by side (pytest-xdist, `-n N --dist loadscope`), each worker is a pytest session of
    its own: its own control plane and session operator, and its own loopback pod network,
    VLM_TESTBED_POD_NET plus the worker's number (gw0, gw1, ...)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and os.environ.get("VLM_TESTBED_POD_NET"):
        os.environ["VLM_TESTBED_POD_NET"] = str(
            int(os.environ["VLM_TESTBED_POD_NET"]) + int(worker[2:]))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if E2E_DIR in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)


# Modules whose tests share nothing (each makes its own namespace, node simulator and bed).
INDEPENDENT_MODULES = frozenset({"test_failure_matrix.py"})


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    """Each phase's report on the test item (item.report_call ...), for fixtures that keep
    artifacts of a failed test."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without it, never called
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With `-n N --dist loadscope`: a module's tests go to one worker (they share its fixtures
    and run in their written order), while the tests of INDEPENDENT_MODULES (the failure
    matrix's rows) are dealt one by one to whichever worker is free. Modules with more tests go
    first (xdist's reordering), the single rows last: they fill the workers' ends evenly."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModulesThenRows(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return nodeid if Path(module).name in INDEPENDENT_MODULES else module

    return ModulesThenRows(config, log)


@dataclass
class Cluster:
    """What e2e tests get: a kubeconfig path, kubectl (or None) and an ApiClient factory."""

    kubeconfig: Path
    kubectl: Path | None
    control_plane: ControlPlane | None = None  # None when an existing cluster is used

    def api_client(self) -> Any:
        return api_client_from_kubeconfig(self.kubeconfig)


def _crds() -> list[dict]:
    crds = [TEST_CRD]
    try:
        from vlm_operator.api.crd import get_crd
    except ImportError:
        return crds
    return [get_crd(), *crds]


@pytest.fixture(scope="session")
def cluster(pytestconfig: pytest.Config) -> Iterator[Cluster]:
    existing = pytestconfig.getoption("--kubeconfig", default=None) or os.environ.get("KUBECONFIG")
    if existing:
        found = shutil.which("kubectl")
        yield Cluster(Path(existing), Path(found) if found else kubectl_path())
        return
    capman = pytestconfig.pluginmanager.getplugin("capturemanager")
    with capman.global_and_fixture_disabled():  # show build progress live
        build()
    with ControlPlane(_crds()) as cp:
        assert cp.kubeconfig is not None
        yield Cluster(cp.kubeconfig, cp.kubectl, cp)


@pytest.fixture
def widget_crd() -> dict:
    """The small test CRD the local control plane knows from before its controllers started."""
    return TEST_CRD


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    """A fresh namespace (default ServiceAccount token ready), deleted afterwards."""
    from kubernetes import client

    name = f"e2e-{uuid.uuid4().hex[:8]}"
    with cluster.api_client() as api:
        try:
            yield ready_namespace(api, name)
        finally:
            client.CoreV1Api(api).delete_namespace(name)


# -- the operator under test (shared by the e2e modules)

@pytest.fixture(scope="session")
def api(cluster: Cluster) -> Iterator[Any]:
    """An ApiClient on the cluster, with kopf's peering CRDs installed."""
    from vlm_operator.api import crd
    from vlm_testbed.controlplane import apply_manifests

    with cluster.api_client() as api_client:
        apply_manifests(api_client, crd.get_peering_crds())
        yield api_client


@pytest.fixture(scope="session")
def operator(cluster: Cluster, api: Any) -> Iterator[Any]:
    """One operator process for the session, watching only namespaces named e2e-op-*; in the
    firewall's group where it can be (root), so tests can cut it off from a pod."""
    from kube_helpers import SESSION_KEDA_PROMETHEUS, SESSION_NS_PREFIX

    from vlm_testbed.firewall import OPERATOR_GID
    from vlm_testbed.operator_process import OperatorProcess

    proc = OperatorProcess(cluster.kubeconfig, "--standalone", "-n", f"{SESSION_NS_PREFIX}*",
                           "--keda-prometheus-address", SESSION_KEDA_PROMETHEUS,
                           gid=OPERATOR_GID if os.geteuid() == 0 else None)
    with proc:
        yield proc
    print(proc.log()[-3000:])


@pytest.fixture
def ns(api: Any, operator: Any) -> Iterator[str]:
    """A fresh namespace the session operator watches, deleted afterwards."""
    from kube_helpers import SESSION_NS_PREFIX, make_namespace
    from kubernetes import client

    name = make_namespace(api, SESSION_NS_PREFIX)
    yield name
    client.CoreV1Api(api).delete_namespace(name)


@pytest.fixture
def sim(cluster: Cluster, ns: str) -> Iterator[Any]:
    """A simulated node with 4 GPUs for the test's namespace, running its pods with the vLLM
    stand-in; restarts back off from 1 s."""
    from vlm_testbed.nodesim import NodeSimulator

    with NodeSimulator(cluster.kubeconfig, nodes=1, gpus_per_node=4, backoff_base=1.0,
                       name_prefix=f"sim-{ns}") as s:
        yield s


# -- a real Prometheus (for the e2e modules that read metrics through it)

@dataclass
class Monitoring:
    """The session's Prometheus, configured from the chart rendered into `namespace` (release
    `release`): `docs` are those rendered objects."""

    prometheus: Any
    docs: list[dict]
    namespace: str
    release: str = "vlm-operator"


@pytest.fixture(scope="module")
def monitoring(api: Any, operator: Any) -> Iterator[Monitoring]:
    """One Prometheus for the module that asks for it, scraping what the chart's ServiceMonitor
    and vLLM PodMonitor select, with the scrape configuration the Prometheus Operator generates
    from them, and evaluating the chart's PrometheusRule every second. It lives no longer than
    the module: it scrapes every managed vLLM pod of the cluster and, as Prometheus does,
    follows redirects, so a later test's hostile pods on the same control plane (the failure
    matrix's hostile tenant, side by side on one worker) would see it follow theirs. The chart
    is rendered with the session operator's ports, so its Deployment and Service, once applied
    with a node to run them (test_observability_e2e), route Prometheus to the session operator;
    every managed vLLM pod is a target as soon as it runs. Discovery is kubernetes_sd.py's
    (Debian's prometheus has no Kubernetes discovery)."""
    from kube_helpers import make_namespace
    from kubernetes import client

    from vlm_testbed import chart
    from vlm_testbed.kubernetes_sd import KubernetesSD, with_http_sd
    from vlm_testbed.prometheus import Prometheus, rule_groups, scrape_configs

    namespace = make_namespace(api, "e2e-monitoring-")
    values = {"metrics.port": operator.metrics_port, "livenessPort": operator.liveness_port,
              "metrics.serviceMonitor.enabled": "true", "metrics.serviceMonitor.interval": "1s",
              "metrics.vllmPodMonitor.enabled": "true", "metrics.vllmPodMonitor.interval": "1s",
              "metrics.prometheusRule.enabled": "true",
              "metrics.prometheusRule.remediationStormPerHour": 1,
              "metrics.grafanaDashboard.enabled": "true", "peering.standalone": "true"}
    docs = chart.template("--set", ",".join(f"{k}={v}" for k, v in values.items()),
                          release=Monitoring.release, namespace=namespace)
    try:
        with KubernetesSD(api) as sd, Prometheus(with_http_sd(scrape_configs(docs), sd.url),
                                                 rule_groups(docs)) as prometheus:
            yield Monitoring(prometheus, docs, namespace)
    finally:
        client.CoreV1Api(api).delete_namespace(namespace)

