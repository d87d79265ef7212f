"""vlm_testbed/gateway.py: the extension's InferencePool CRD as published, and as the test
bed's 1.20 apiserver accepts it."""

from __future__ import annotations

import json

from vlm_testbed import gateway


def test_the_published_crd_is_the_extensions_v1_with_its_two_cel_rules():
    doc = gateway.crd()
    assert doc["metadata"]["name"] == "inferencepools.inference.networking.k8s.io"
    assert [v["name"] for v in doc["spec"]["versions"]] == ["v1"]
    text = json.dumps(doc)
    assert text.count('"x-kubernetes-validations"') == 2
    assert '"default": ""' in text
    assert "status" not in doc


def test_for_old_apiservers_only_the_cel_rules_and_the_empty_default_go():
    published, stripped = gateway.crd(), gateway.crd(strip_cel=True)
    text = json.dumps(stripped)
    assert "x-kubernetes-validations" not in text and '"default": ""' not in text
    # everything else is kept: the other defaults, the required fields, the patterns
    assert text.count('"default"') == json.dumps(published).count('"default"') - 1
    spec = stripped["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["required"] == ["selector", "targetPorts"]
    assert spec["properties"]["endpointPickerRef"]["properties"]["failureMode"][
        "default"] == "FailClose"
