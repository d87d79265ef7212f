"""The CRD: one definition, described fields, the subresources and columns kubectl relies on."""

import pathlib
import subprocess
import sys

import yaml

from vlm_operator.api import crd, health_signals
from vlm_operator.api.actions import POLICY

ROOT = pathlib.Path(__file__).resolve().parents[3]
GENERATED = ROOT / "charts/vlm-operator/crds/serving.vlm-operator.dev_vlmdeployments.yaml"
PEERING = ROOT / "charts/vlm-operator/crds/kopf.dev_peerings.yaml"


def walk(node, path="spec"):
    yield path, node
    for key, child in (node.get("properties") or {}).items():
        yield from walk(child, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")


def test_names_and_scope():
    spec = crd.get_crd()["spec"]
    assert spec["group"] == "serving.vlm-operator.dev"
    assert spec["scope"] == "Namespaced"
    assert spec["names"]["plural"] == "vlmdeployments"
    assert spec["names"]["shortNames"] == ["vlmd"]
    assert [v["name"] for v in spec["versions"]] == ["v1alpha1"]


def test_status_and_scale_subresources():
    version = crd.get_crd()["spec"]["versions"][0]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}


def test_every_field_is_described():
    schema = crd.get_schema()
    undocumented = [p for p, n in walk(schema["properties"]["spec"])
                    if not n.get("description")]
    undocumented += [p for p, n in walk(schema["properties"]["status"], "status")
                     if not n.get("description")]
    assert undocumented == []


def test_bounds_and_enums():
    spec = crd.get_schema()["properties"]["spec"]["properties"]
    assert spec["rendererNumWorkers"]["minimum"] == 1
    assert spec["rendererNumWorkers"]["maximum"] == 64
    assert spec["rendererNumWorkers"]["default"] == 1
    assert spec["replicas"]["minimum"] == 0
    assert spec["gpusPerReplica"]["minimum"] == 1
    health = spec["health"]["properties"]
    for signature in health_signals.FIELDS:  # every action field takes what POLICY holds
        assert health[signature]["properties"]["action"]["enum"] == [a.value for a in POLICY]
    assert "Restart" in health["engineDead"]["properties"]["action"]["enum"]
    assert spec["autoscaling"]["properties"]["mode"]["enum"] == ["Builtin", "HPA", "KEDA"]
    assert crd.get_schema()["properties"]["spec"]["required"] == ["model"]


def test_printer_columns():
    columns = {c["name"]: c["jsonPath"] for c in
               crd.get_crd()["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert columns["Model"] == ".spec.model"
    assert columns["Ready"] == ".status.readyReplicas"
    assert columns["Desired"] == ".spec.replicas"
    assert columns["Pool"] == ".status.tokenizerPoolSize"
    assert columns["Age"] == ".metadata.creationTimestamp"


def test_cli_prints_the_definition():
    out = subprocess.run([sys.executable, "-m", "vlm_operator.cli", "crd"], check=True,
                         capture_output=True, text=True).stdout
    assert yaml.safe_load(out) == crd.get_crd()


def test_generated_manifest_has_not_drifted():
    assert yaml.safe_load(GENERATED.read_text()) == crd.get_crd(), (
        "the chart's crds/ is stale: run hack/generate.sh")


def test_generated_peering_crds_have_not_drifted():
    assert list(yaml.safe_load_all(PEERING.read_text())) == crd.get_peering_crds()
    assert [c["spec"]["names"]["kind"] for c in crd.get_peering_crds()] == [
        "ClusterKopfPeering", "KopfPeering"]
