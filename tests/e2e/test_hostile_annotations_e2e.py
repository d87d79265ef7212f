"""Annotations a tenant wrote on its VLMDeployment, against the real apiserver, in-process:
the periodic resync (runtime/periodic.py) calling handlers.reconcile as the operator wires it,
the Reconciler reading and writing the real objects. A nested annotation once raised
RecursionError out of the reconcile and ended the resync round before the VLMDeployments after
it."""

from __future__ import annotations

from types import SimpleNamespace

from kube_helpers import cr, create, deployment, get_cr, wait_for

from vlm_operator import handlers
from vlm_operator.api.names import HISTORY, IN_FLIGHT
from vlm_operator.k8s.kube import Kube
from vlm_operator.reconcile.reconciler import Reconciler
from vlm_operator.runtime.periodic import Periodic


def test_a_nested_annotation_stops_neither_its_own_resync_nor_the_others(api, namespace):
    memo = SimpleNamespace(reconciler=Reconciler(Kube(api)))
    attacker = cr("attacker", replicas=1)
    attacker["metadata"]["annotations"] = {IN_FLIGHT: "[" * 200_000, HISTORY: "[" * 4096}
    names = ("alpha", "attacker", "omega")  # the resync goes in this order
    for name in names:
        create(api, namespace, attacker if name == "attacker" else cr(name, replicas=1))
    periodic = Periodic(tick=lambda body: None, forget=lambda ns, name: None,
                        resync=lambda ns, name: handlers.reconcile(memo, ns, name, retry=False),
                        round_s=3600, resync_s=1.0)
    for name in names:
        periodic.track(get_cr(api, namespace, name))
    periodic.start()
    try:
        for name in names:
            wait_for(f"{name} reconciled by the resync", lambda n=name: (
                get_cr(api, namespace, n).get("status") or {}).get("observedGeneration"))
        # records that cannot be read are no surge: the Deployment runs spec.replicas
        assert deployment(api, namespace, "attacker").spec.replicas == 1
    finally:
        periodic.stop()
