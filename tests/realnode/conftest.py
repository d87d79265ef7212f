"""Fixtures of the real-node tests: a control plane, the local registry holding the project's
images (built from images/ by buildah), one real node (a real kubelet on its own containerd,
realnode.RealNode, 4 stand-in GPUs) pulling from it, the operator as its own process watching
namespaces named realnode-*. Needs root and what hack/install-deps.sh installs, and the kubelet
(`python -m vlm_testbed.controlplane build`, which this builds when missing)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

NS_PREFIX = "realnode-"
REAL_NODE_DIR = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if REAL_NODE_DIR in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.realnode)
            if os.geteuid() != 0:
                item.add_marker(pytest.mark.skip(reason="a real node needs root"))


@pytest.fixture(scope="session")
def control_plane(pytestconfig: pytest.Config) -> Iterator[Any]:
    from vlm_operator.api.crd import get_crd
    from vlm_testbed.controlplane import ControlPlane, build
    from vlm_testbed.realnode.config import host_address

    capman = pytestconfig.pluginmanager.getplugin("capturemanager")
    with capman.global_and_fixture_disabled():  # show build progress live
        build(node=True)
    with ControlPlane([get_crd()], pod_address=host_address()) as cp:  # pods reach it
        yield cp


@pytest.fixture(scope="session")
def api(control_plane: Any) -> Iterator[Any]:
    from vlm_operator.api import crd
    from vlm_testbed.controlplane import apply_manifests

    with control_plane.api_client() as api_client:
        apply_manifests(api_client, crd.get_peering_crds())
        yield api_client


@pytest.fixture(scope="session")
def registry(pytestconfig: pytest.Config) -> Iterator[Any]:
    """The local registry, holding the project's images built from images/ (and the bases and
    pause image they need)."""
    from vlm_testbed.realnode import LocalRegistry, build_images

    capman = pytestconfig.pluginmanager.getplugin("capturemanager")
    with LocalRegistry() as reg:
        with capman.global_and_fixture_disabled():  # show build progress live
            build_images(reg)
        yield reg


@pytest.fixture(scope="session")
def node(control_plane: Any, registry: Any) -> Iterator[Any]:
    from vlm_testbed.realnode import RealNode

    with RealNode(control_plane, registry=registry.address, gpus=4) as n:
        print(f"real node {n.name} Ready {n.kubelet_ready_seconds:.1f} s after its kubelet "
              f"started ({n.ready_seconds:.1f} s in all)")
        yield n


@pytest.fixture(scope="session")
def operator(control_plane: Any, api: Any) -> Iterator[Any]:
    from vlm_testbed.operator_process import OperatorProcess

    proc = OperatorProcess(control_plane.kubeconfig, "--standalone", "-n", f"{NS_PREFIX}*")
    with proc:
        yield proc
    print(proc.log()[-3000:])


@pytest.fixture
def ns(api: Any, operator: Any, node: Any) -> Iterator[str]:
    from kubernetes import client

    from vlm_testbed.controlplane import ready_namespace

    name = ready_namespace(api, f"{NS_PREFIX}{uuid.uuid4().hex[:6]}")
    yield name
    client.CoreV1Api(api).delete_namespace(name)
