"""The CRD's status: what the operator observed and did, written by the operator only."""

from __future__ import annotations

from vlm_operator.api import schema as s

CONDITION_TYPES = ["Ready", "Progressing", "Degraded", "SpecValid"]


def condition() -> s.Schema:
    return s.obj(
        "One aspect of the VLMDeployment's state.",
        {
            "type": s.string("Ready, Progressing, Degraded, SpecValid, ..."),
            "status": s.string("True, False or Unknown.", enum=["True", "False", "Unknown"]),
            "reason": s.string("A CamelCase reason."),
            "message": s.string("Human-readable detail."),
            "lastTransitionTime": s.string("When status last changed."),
            "observedGeneration": s.integer("The generation the condition was set for."),
        },
        required=["type", "status"],
    )


def status() -> s.Schema:
    return s.obj(
        "The observed state, written by the operator.",
        {
            "observedGeneration": s.integer("Last generation the operator acted on."),
            "replicas": s.integer("Pods that exist."),
            "readyReplicas": s.integer("Pods that are ready."),
            "selector": s.string("Label selector of the pods, for the scale subresource."),
            "tokenizerPoolSize": s.integer("Tokenizers in each engine's pool."),
            "vllmVersion": s.string("The vLLM version the operator resolved."),
            "conditions": s.array("Current conditions.", condition(), list_type="map",
                                  list_map_keys=["type"]),
            "lastRemediation": s.obj("The operator's last action on a pod.", {
                "time": s.string("When."),
                "pod": s.string("Which pod."),
                "signature": s.string("What it detected."),
                "action": s.string("What it did."),
                "reason": s.string("Why, or why it held back."),
                "rung": s.string("For a pod that serves nothing: how it is recovered "
                                 "(await-exit, restart-request: in place; delete: a new "
                                 "pod; unfenced: back in the Service)."),
            }),
            "autoscaling": s.obj("The last scaling decision.", {
                "desiredReplicas": s.integer("Replicas the autoscaler wants."),
                "currentReplicas": s.integer("Replicas when it decided."),
                "reason": s.string("Why."),
                "time": s.string("When."),
                "pendingReplicas": s.array(
                    "Replicas not Ready yet: since when each starts and when it is expected "
                    "to serve (its creation plus the median start of the last 8 seen).",
                    s.obj("A replica still starting.", {
                        "pod": s.string("The pod."),
                        "since": s.string("Its creation."),
                        "expectedReadyTime": s.string("When it is expected to be Ready."),
                        "expected": s.string("What the expectation rests on, or why there "
                                             "is none."),
                    })),
            }),
            "kopf": s.obj("Operator framework bookkeeping.", preserve_unknown=True),
        },
    )
