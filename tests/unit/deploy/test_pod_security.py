"""What the vLLM pods may do with the Kubernetes API: nothing, unless the user names an identity."""

from vlm_operator.api import crd
from vlm_operator.api.validation import parse
from vlm_operator.desired import children


def vlmd(**spec):
    return parse({"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                  "metadata": {"name": "m", "namespace": "ns", "uid": "u"},
                  "spec": {"model": "m", "image": "vllm/vllm-openai:v0.20.2", **spec}})


def test_pods_mount_no_service_account_token():
    pod = children.get_pod_template(vlmd())["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in pod  # the namespace's default, without its token


def test_a_named_service_account_still_gets_no_token():
    pod = children.get_pod_template(vlmd(serviceAccountName="model-reader"))["spec"]
    assert pod["serviceAccountName"] == "model-reader"
    assert pod["automountServiceAccountToken"] is False
