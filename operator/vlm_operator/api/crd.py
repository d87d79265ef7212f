"""The VLMDeployment API: the one definition of the CRD.

`vlm-operator crd`, the Helm chart's crds/ (linked from manifests/crds/) and offline validation
all read `get_crd()`; tests fail when the generated files drift from it. The schema is written
by part: crd_spec.py (the spec), crd_health.py (spec.health), crd_autoscaling.py
(spec.autoscaling), crd_gateway.py (spec.gateway), crd_status.py (the status); crd_peering.py
holds kopf's peering CRDs. The names readers use (`crd.GROUP`, `crd.autoscaling_mode`, ...)
are all reachable here; the actions its fields accept are api/actions.py's.
"""

from __future__ import annotations

from vlm_operator.api import crd_spec, crd_status
from vlm_operator.api import schema as s

# the parts' names, for the CRD's readers (crd.autoscaling_mode, ...)
from vlm_operator.api.crd_autoscaling import AUTOSCALING_MODES, autoscaling_mode  # noqa: F401
from vlm_operator.api.crd_gateway import inference_pool  # noqa: F401
from vlm_operator.api.crd_peering import get_peering_crds
from vlm_operator.api.crd_spec import DEFAULT_IMAGE, DTYPES  # noqa: F401
from vlm_operator.api.crd_status import CONDITION_TYPES  # noqa: F401

# the CRD's names live in api/names.py; imported here for the CRD and its readers (crd.GROUP)
from vlm_operator.api.names import (  # noqa: F401
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
)


def get_schema() -> s.Schema:
    return s.obj(
        "A vision-language model served by vLLM, with a thread-safe tokenizer pool, log "
        "watching and autoscaling.",
        {
            "apiVersion": s.string("The API version."),
            "kind": s.string("The kind."),
            "metadata": {"type": "object"},
            "spec": crd_spec.spec(),
            "status": crd_status.status(),
        },
        required=["spec"],
    )


PRINTER_COLUMNS = [
    {"name": "Model", "type": "string", "jsonPath": ".spec.model"},
    {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {"name": "Pool", "type": "integer", "jsonPath": ".status.tokenizerPoolSize",
     "description": "Tokenizers in each engine's pool"},
    {"name": "vLLM", "type": "string", "jsonPath": ".status.vllmVersion"},
    {"name": "Status", "type": "string",
     "jsonPath": '.status.conditions[?(@.type=="Ready")].reason'},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def get_crd() -> dict:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {"app.kubernetes.io/part-of": "vlm-operator"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
                "categories": ["vlm"],
            },
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": get_schema()},
                "subresources": {
                    "status": {},
                    "scale": {
                        "specReplicasPath": ".spec.replicas",
                        "statusReplicasPath": ".status.replicas",
                        "labelSelectorPath": ".status.selector",
                    },
                },
                "additionalPrinterColumns": PRINTER_COLUMNS,
            }],
        },
    }


def get_all_crds() -> list[dict]:
    return [get_crd(), *get_peering_crds()]
