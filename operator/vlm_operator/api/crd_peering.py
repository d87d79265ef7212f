"""kopf's peering CRDs, installed beside the VLMDeployment CRD."""

from __future__ import annotations

from vlm_operator.api import schema as s


def get_peering_crds() -> list[dict]:
    """kopf's peering resources: operator replicas see each other here and never act twice."""
    def peering(kind: str, plural: str, scope: str) -> dict:
        return {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.kopf.dev",
                         "labels": {"app.kubernetes.io/part-of": "vlm-operator"}},
            "spec": {
                "group": "kopf.dev",
                "scope": scope,
                "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
                "versions": [{
                    "name": "v1", "served": True, "storage": True,
                    "schema": {"openAPIV3Schema": s.obj(
                        "Operator replicas that share the work and their priorities.",
                        {"status": s.obj("Heartbeats of the peers.", preserve_unknown=True)},
                        preserve_unknown=True)},
                }],
            },
        }
    return [peering("ClusterKopfPeering", "clusterkopfpeerings", "Cluster"),
            peering("KopfPeering", "kopfpeerings", "Namespaced")]
