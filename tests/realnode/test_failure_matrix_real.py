"""The failure matrix's node-side rows on real nodes: each row of vlm_testbed.failure_matrix
whose meaning depends on the kubelet (an engine death and the in-place restart or the restart
request through the downwardAPI file, `kubectl drain` with real evictions and the preStop hook, a
cordon) runs on real kubelets of its own (the bed's real_nodes), with the same checks as in
tests/e2e/test_failure_matrix.py. The session's node is cordoned meanwhile, so the rows' pods
land on their own nodes only. The other rows stay on simulated nodes (the e2e phase), where
only the operator's decisions matter or a row needs the simulator's knobs."""

from __future__ import annotations

import contextlib
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes import client

from vlm_testbed.failure_matrix import ROWS, Bed
from vlm_testbed.realnode import real_nodes

sys.path.insert(0, str(Path(__file__).parents[1] / "e2e"))
from test_failure_matrix import CHECKS  # the e2e matrix's checks, row by row

NODE_ROWS = ("engine-dead-exit0-1", "engine-dead-alive-1", "drain-gpu-free", "drain-no-gpu",
             "cordon-no-drain", "late-engine-death-line")


@pytest.fixture
def session_node_cordoned(api: Any, node: Any) -> Iterator[None]:
    v1 = client.CoreV1Api(api)
    v1.patch_node(node.name, {"spec": {"unschedulable": True}})
    try:
        yield
    finally:
        v1.patch_node(node.name, {"spec": {"unschedulable": False}})


@pytest.mark.parametrize("row", [r for r in ROWS if r.id in NODE_ROWS],
                         ids=lambda r: r.id)
def test_node_row_on_real_nodes(row, control_plane, api, registry, operator,
                                session_node_cordoned):
    @contextlib.contextmanager
    def made(gpus_per_node: int, nodes: int) -> Iterator[Any]:
        with real_nodes(control_plane, nodes, registry=registry.address,
                        gpus=gpus_per_node) as started:
            yield SimpleNamespace(node_names=[n.name for n in started])

    # rows with operators of their own stay out of the session operator's namespaces
    prefix = "rn-solo-" if row.own_operator else "realnode-"
    with Bed.new(api, control_plane.kubeconfig, f"{prefix}{uuid.uuid4().hex[:6]}",
                 real_nodes=made) as bed:
        bed.watcher = None if row.own_operator else operator
        CHECKS[row.id](bed.run(row))
