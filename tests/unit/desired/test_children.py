"""Builders: every field of the desired Deployment, Service, PDB and PVC."""

import json

import pytest

from vlm_operator.api import crd, crd_spec, versions
from vlm_operator.api.validation import parse
from vlm_operator.desired import children, stopping


def vlmd(uid=None, **spec):
    meta = {"name": "demo", "namespace": "ml"}
    if uid:
        meta["uid"] = uid
    return parse({"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": meta,
                  "spec": {"model": "Qwen/Qwen3-VL-4B-Instruct", **spec}})


def container(obj):
    return children.get_deployment(obj)["spec"]["template"]["spec"]["containers"][0]


def env_of(obj):
    return {e["name"]: e for e in container(obj)["env"]}


def flag(args, name):
    return args[args.index(name) + 1] if name in args else None


def test_args_start_with_model_and_port():
    args = container(vlmd())["args"]
    assert args[:3] == ["Qwen/Qwen3-VL-4B-Instruct", "--port", "8000"]
    assert container(vlmd())["command"] == ["vllm", "serve"]


@pytest.mark.parametrize("version, expected", [
    ("0.11.0", None), ("0.17.1", None), ("0.18.1", None), ("0.19.0", "4"), ("0.20.2", "4"),
    ("0.33.0", "4"),
])
def test_renderer_flag_only_where_the_version_has_it(version, expected):
    obj = vlmd(vllmVersion=version, rendererNumWorkers=4)
    assert flag(container(obj)["args"], "--renderer-num-workers") == expected
    # The pool size reaches the engine on every version (+ the multimodal thread from 0.29).
    assert env_of(obj)["VLM_TOKENIZER_POOL_SIZE"]["value"] == ("6" if version == "0.33.0" else "5")


def test_version_from_image_tag_decides_flags():
    old = vlmd(image="vllm/vllm-openai:v0.17.1")
    new = vlmd(image="vllm/vllm-openai:v0.20.2")
    assert "--renderer-num-workers" not in container(old)["args"]
    assert "--renderer-num-workers" in container(new)["args"]
    assert container(new)["image"] == "vllm/vllm-openai:v0.20.2"


def test_engine_flags():
    obj = vlmd(servedModelName="qwen", revision="abc123", gpusPerReplica=2, vllm={
        "maxModelLen": 4096, "dtype": "bfloat16",
        "limitMmPerPrompt": {"video": 0, "image": 4},
        "mmProcessorKwargs": {"max_pixels": 1003520, "fps": [1, 2]},
        "extraArgs": ["--enforce-eager", "--max-num-seqs=64"]})
    args = container(obj)["args"]
    assert flag(args, "--served-model-name") == "qwen"
    assert flag(args, "--revision") == "abc123"
    assert flag(args, "--max-model-len") == "4096"
    assert flag(args, "--dtype") == "bfloat16"
    assert flag(args, "--tensor-parallel-size") == "2"
    assert json.loads(flag(args, "--limit-mm-per-prompt")) == {"image": 4, "video": 0}
    assert json.loads(flag(args, "--mm-processor-kwargs")) == {
        "max_pixels": 1003520, "fps": [1, 2]}
    assert args[-2:] == ["--enforce-eager", "--max-num-seqs=64"]


def test_optional_flags_absent_by_default():
    args = container(vlmd())["args"]
    for name in ("--served-model-name", "--revision", "--max-model-len", "--dtype",
                 "--limit-mm-per-prompt", "--mm-processor-kwargs"):
        assert name not in args
    assert flag(args, "--tensor-parallel-size") == "1"


def test_tensor_parallel_size_explicit():
    args = container(vlmd(gpusPerReplica=4, vllm={"tensorParallelSize": 2}))["args"]
    assert flag(args, "--tensor-parallel-size") == "2"


def test_gpu_limits_and_user_resources():
    res = container(vlmd(gpusPerReplica=2, resources={
        "requests": {"cpu": "4", "memory": "24Gi"}, "limits": {"memory": "48Gi"}}))["resources"]
    assert res["limits"] == {"memory": "48Gi", "nvidia.com/gpu": "2"}
    assert res["requests"] == {"cpu": "4", "memory": "24Gi", "nvidia.com/gpu": "2"}


def test_shm_cache_and_home_volumes():
    pod = children.get_deployment(vlmd())["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"] == {"name": "dshm", "emptyDir": {"medium": "Memory"}}
    assert volumes["model-cache"] == {"name": "model-cache", "emptyDir": {}}
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts == {"dshm": "/dev/shm", "model-cache": "/models", "home": "/home/vllm",
                      "control": "/etc/vlm-operator"}
    assert env_of(vlmd())["HF_HOME"]["value"] == "/models"


def test_the_restart_request_annotation_is_projected_read_only_for_the_plugin():
    pod = children.get_deployment(vlmd())["spec"]["template"]["spec"]
    control = {v["name"]: v for v in pod["volumes"]}["control"]
    assert control["downwardAPI"]["items"] == [{"path": "restart-request", "fieldRef": {
        "fieldPath": "metadata.annotations['serving.vlm-operator.dev/restart-request']"}}]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "control")
    assert mount["readOnly"] is True
    assert env_of(vlmd())["VLM_RESTART_REQUEST_FILE"]["value"] == \
        "/etc/vlm-operator/restart-request"


def test_existing_pvc():
    obj = vlmd(modelCache={"claimName": "weights", "mountPath": "/cache"})
    pod = children.get_deployment(obj)["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model-cache"]["persistentVolumeClaim"] == {"claimName": "weights"}
    assert env_of(obj)["HF_HOME"]["value"] == "/cache"
    assert children.get_pvc(obj) is None
    assert [c["kind"] for c in children.get_children(obj)] == [
        "Deployment", "Service", "PodDisruptionBudget"]


def test_created_pvc():
    obj = vlmd(uid="u-1", modelCache={"size": "50Gi", "storageClassName": "fast",
                                      "accessModes": ["ReadWriteMany"]})
    pvc = children.get_pvc(obj)
    assert pvc["metadata"]["name"] == "demo-model-cache"
    assert pvc["spec"] == {"accessModes": ["ReadWriteMany"], "storageClassName": "fast",
                           "resources": {"requests": {"storage": "50Gi"}}}
    assert pvc["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    pod = children.get_deployment(obj)["spec"]["template"]["spec"]
    claim = {v["name"]: v for v in pod["volumes"]}["model-cache"]["persistentVolumeClaim"]
    assert claim == {"claimName": "demo-model-cache"}
    assert [c["kind"] for c in children.get_children(obj)] == [
        "PersistentVolumeClaim", "Deployment", "Service", "PodDisruptionBudget"]


def test_hf_token_only_from_secret():
    obj = vlmd(hfTokenSecretRef={"name": "hf"})
    assert env_of(obj)["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {
        "secretKeyRef": {"name": "hf", "key": "token"}}}
    assert "HF_TOKEN" not in env_of(vlmd())


def test_user_env_passed_after_managed_env():
    obj = vlmd(vllm={"env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}]})
    names = [e["name"] for e in container(obj)["env"]]
    assert names[-1] == "VLLM_LOGGING_LEVEL"
    assert names[0] == "VLM_TOKENIZER_POOL_SIZE"


def test_probes_sized_for_model_loads():
    c = container(vlmd())
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]


def test_labels_selector_and_scrape_annotations():
    dep = children.get_deployment(vlmd())
    labels = dep["metadata"]["labels"]
    assert labels == {"app.kubernetes.io/name": "vllm", "app.kubernetes.io/instance": "demo",
                      "app.kubernetes.io/component": "engine",
                      "app.kubernetes.io/managed-by": "vlm-operator"}
    template = dep["spec"]["template"]["metadata"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= template["labels"].items()
    assert template["labels"][children.IN_SERVICE_LABEL] == "true"
    assert template["annotations"] == {"prometheus.io/scrape": "true",
                                       "prometheus.io/port": "8000",
                                       "prometheus.io/path": "/metrics"}
    # managed-by selects too: other apps' pods labelled like ours are not selected
    assert children.get_selector("demo") == (
        "app.kubernetes.io/name=vllm,app.kubernetes.io/instance=demo,"
        "app.kubernetes.io/component=engine,app.kubernetes.io/managed-by=vlm-operator")
    assert children.get_service(vlmd())["spec"]["selector"] == {
        **labels, children.IN_SERVICE_LABEL: "true"}
    assert children.get_pdb(vlmd())["spec"]["selector"]["matchLabels"] == labels


def test_a_deployment_keeps_the_selector_it_was_made_with():
    """A Deployment's selector is immutable: one made before the selector gained managed-by
    keeps its own (applying another is refused with 422); a new one gets today's."""
    dep = children.get_deployment(vlmd())
    old = {"spec": {"selector": {"matchLabels": {"app.kubernetes.io/instance": "demo"}}}}
    kept = children.keep_selector(dep, old)
    assert kept["spec"]["selector"] == old["spec"]["selector"]
    assert kept["spec"]["template"] == dep["spec"]["template"]
    assert children.keep_selector(dep, None) == dep
    svc = children.get_service(vlmd())
    assert children.keep_selector(svc, old) == svc


def test_security_context_without_privileges():
    pod = children.get_deployment(vlmd())["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = pod["containers"][0]["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert "privileged" not in sc


def test_scheduling():
    pod = children.get_deployment(vlmd(scheduling={
        "nodeSelector": {"gpu": "h100"}, "runtimeClassName": "nvidia",
        "priorityClassName": "high",
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml",
                         "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"x": 1}}}))["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu": "h100"}
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["priorityClassName"] == "high"
    assert pod["affinity"] == {"nodeAffinity": {"x": 1}}
    assert {"key": "dedicated", "operator": "Equal", "value": "ml",
            "effect": "NoSchedule"} in pod["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists",
            "effect": "NoSchedule"} in pod["tolerations"]
    plain = children.get_deployment(vlmd())["spec"]["template"]["spec"]
    assert "nodeSelector" not in plain and "priorityClassName" not in plain


def test_replicas_and_rollout():
    dep = children.get_deployment(vlmd(replicas=3))
    assert dep["spec"]["replicas"] == 3
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}


def test_service_selects_only_pods_in_service():
    svc = children.get_service(vlmd())
    assert svc["spec"]["selector"][children.IN_SERVICE_LABEL] == "true"
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http",
                                     "protocol": "TCP"}]


def test_pdb():
    pdb = children.get_pdb(vlmd(replicas=2, health={"minAvailable": 2}))
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["minAvailable"] == 2
    assert pdb["spec"]["selector"]["matchLabels"] == children.get_selector_labels("demo")
    assert children.get_pdb(vlmd(), "policy/v1beta1")["apiVersion"] == "policy/v1beta1"


def test_pdb_lets_unhealthy_pods_go_only_where_the_apiserver_has_the_field():
    # 1.26+ (policy/v1 with the field in its schema): a pod that serves nothing never holds
    # up a drain; older apiservers refuse the unknown field in a server-side apply
    assert "unhealthyPodEvictionPolicy" not in children.get_pdb(vlmd())["spec"]
    assert children.get_pdb(vlmd(), "policy/v1", True)["spec"][
        "unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert "unhealthyPodEvictionPolicy" not in children.get_pdb(
        vlmd(), "policy/v1beta1", True)["spec"]
    objs = children.get_children(vlmd(), unhealthy_pod_eviction=True)
    (pdb,) = [c for c in objs if c["kind"] == "PodDisruptionBudget"]
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_termination_lets_requests_finish():
    pod = children.get_deployment(vlmd())["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["lifecycle"]["preStop"]["exec"]["command"] == [
        "python3", "-c", stopping.PRESTOP_SCRIPT]
    # the grace period holds the preStop's longest drain and vLLM's stop after it
    assert pod["terminationGracePeriodSeconds"] == stopping.DRAIN_LIMIT_S + stopping.STOP_S
    assert env_of(vlmd())[stopping.POD_IP_ENV]["valueFrom"] == {
        "fieldRef": {"fieldPath": "status.podIP"}}


def test_owner_references_only_when_uid_known():
    for child in children.get_children(vlmd()):
        assert "ownerReferences" not in child["metadata"]
    for child in children.get_children(vlmd(uid="1234")):
        (ref,) = child["metadata"]["ownerReferences"]
        assert ref == {"apiVersion": crd.API_VERSION, "kind": "VLMDeployment", "name": "demo",
                       "uid": "1234", "controller": True, "blockOwnerDeletion": True}
        assert child["metadata"]["namespace"] == "ml"


def test_is_controlled_by_reads_the_controller_reference():
    (child,) = [c for c in children.get_children(vlmd(uid="1234")) if c["kind"] == "Service"]
    assert children.is_controlled_by(child, "1234")
    assert not children.is_controlled_by(child, "5678")
    assert not children.is_controlled_by(child, None)
    child["metadata"]["ownerReferences"][0]["controller"] = False  # owned, not controlled
    assert not children.is_controlled_by(child, "1234")
    assert not children.is_controlled_by({"metadata": {}}, "1234")


def test_builders_are_pure():
    obj = vlmd(uid="1", vllm={"extraArgs": ["--x"]})
    assert children.get_children(obj) == children.get_children(obj)
    first = children.get_children(obj)
    first[0]["spec"]["template"]["spec"]["containers"][0]["args"].append("--mutated")
    assert "--mutated" not in children.get_children(obj)[0]["spec"]["template"]["spec"][
        "containers"][0]["args"]
    assert obj.spec["vllm"]["extraArgs"] == ["--x"]


def test_returned_objects_share_nothing_with_the_spec():
    obj = vlmd(vllm={"env": [{"name": "A", "value": "1"}]},
               scheduling={"affinity": {"nodeAffinity": {"x": 1}},
                           "tolerations": [{"key": "k", "operator": "Exists"}]},
               resources={"requests": {"cpu": "1"}})
    dep = children.get_deployment(obj)
    pod = dep["spec"]["template"]["spec"]
    pod["containers"][0]["env"][-1]["value"] = "changed"
    pod["affinity"]["nodeAffinity"]["x"] = 2
    pod["tolerations"][-1]["key"] = "changed"
    pod["containers"][0]["resources"]["requests"]["cpu"] = "9"
    assert children.get_deployment(obj) != dep
    assert obj.spec["vllm"]["env"][0]["value"] == "1"


def test_surge_adds_replicas_and_says_so_on_the_deployment():
    plain = children.get_deployment(vlmd(replicas=2))
    assert plain["spec"]["replicas"] == 2
    assert children.SURGE_ANNOTATION not in plain["metadata"].get("annotations", {})
    surged = children.get_deployment(vlmd(replicas=2), surge=1)
    assert surged["spec"]["replicas"] == 3
    assert surged["metadata"]["annotations"] == {children.SURGE_ANNOTATION: "1"}
    stopped = children.get_deployment(vlmd(replicas=0), surge=1)  # scaled to zero: no surge
    assert stopped["spec"]["replicas"] == 0
    assert "annotations" not in stopped["metadata"]


def test_media_urls_are_fetched_only_from_allowed_hosts():
    """A request's image URL is fetched by the pod from inside the cluster: by default no host
    is allowed (data: URLs still work), so requests cannot reach cluster-internal services or
    cloud metadata; listed hosts are allowed without redirects; "*" is vLLM's own default."""
    def engine(**vllm):
        obj = vlmd(vllm=vllm)
        args, env = children.get_vllm_args(obj), {e["name"]: e.get("value")
                                                 for e in children.get_env(obj)}
        return args, env

    args, env = engine()
    i = args.index("--allowed-media-domains")
    assert args[i + 1] == children.NO_MEDIA_HOST and args[i + 2:i + 3] != [children.NO_MEDIA_HOST]
    assert env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0"
    args, env = engine(allowedMediaDomains=["images.example.com", "cdn.example.com"],
                       extraArgs=["--enforce-eager"])
    assert args[-4:] == ["--allowed-media-domains", "images.example.com", "cdn.example.com",
                         "--enforce-eager"]
    assert env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0"
    args, env = engine(allowedMediaDomains=["*"])
    assert "--allowed-media-domains" not in args and "VLLM_MEDIA_URL_ALLOW_REDIRECTS" not in env


def test_the_compile_cache_lives_on_the_cache_volume_per_version_and_model():
    a = vlmd(image="vllm/vllm-openai:v0.20.2", modelCache={"size": "50Gi",
                                                         "accessModes": ["ReadWriteMany"]})
    root = env_of(a)["VLLM_CACHE_ROOT"]["value"]
    assert root == "/models/vllm-cache/0.20.2/Qwen--Qwen3-VL-4B-Instruct"
    assert root.startswith(env_of(a)["HF_HOME"]["value"] + "/")  # survives what HF_HOME does
    b = vlmd(image="vllm/vllm-openai:v0.21.0")
    assert env_of(b)["VLLM_CACHE_ROOT"]["value"] != root  # another version: its own cache
    default = ".".join(map(str, versions.DEFAULT_RELEASE))
    for model, key in (("/weights/../my model", "weights--..--my--model"), ("..", "model")):
        path = env_of(vlmd(model=model))["VLLM_CACHE_ROOT"]["value"]  # the default image's
        assert path == f"/models/vllm-cache/{default}/{key}"  # one path component, never ".."


def test_a_read_write_once_cache_places_every_replica_on_its_node():
    rwo = children.get_deployment(vlmd(replicas=2, modelCache={"size": "50Gi"}))
    terms = rwo["spec"]["template"]["spec"]["affinity"]["podAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms == [{"labelSelector": {"matchLabels": children.get_selector_labels("demo")},
                      "topologyKey": "kubernetes.io/hostname"}]
    user = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "gpu", "operator": "In", "values": ["h100"]}]}]}}}
    both = children.get_deployment(vlmd(modelCache={"size": "50Gi"}, scheduling={
        "affinity": user}))["spec"]["template"]["spec"]["affinity"]
    assert both["nodeAffinity"] == user["nodeAffinity"] and "podAffinity" in both
    for spread in ({"size": "50Gi", "accessModes": ["ReadWriteMany"]}, {"claimName": "w"},
                   None):
        spec = {"modelCache": spread} if spread else {}
        assert "affinity" not in children.get_deployment(vlmd(**spec))["spec"]["template"][
            "spec"]


def test_every_flag_the_operator_writes_is_one_users_may_not_set():
    """The pod's flags come from the spec (get_vllm_args); a user's spec.vllm.extraArgs may not
    carry them (validation_engine.MANAGED_FLAGS). A flag written here and missing there would
    let a user set it twice, with vLLM taking the last."""
    from vlm_operator.api.validation_engine import MANAGED_FLAGS

    obj = vlmd(servedModelName="qwen", revision="abc123", gpusPerReplica=2,
               vllmVersion="0.33.0", rendererNumWorkers=2, vllm={
                   "maxModelLen": 4096, "dtype": "bfloat16", "tensorParallelSize": 2,
                   "limitMmPerPrompt": {"image": 4}, "mmProcessorKwargs": {"fps": 1},
                   "allowedMediaDomains": ["example.com"]})
    written = {a for a in container(obj)["args"] if a.startswith("-")}
    assert len(written) >= 9
    assert written - set(MANAGED_FLAGS) == set()


@pytest.mark.parametrize("field", list(crd_spec.VALUE_FLAGS))
def test_each_value_flag_goes_from_its_field_to_the_pod_and_is_refused_in_extra_args(field):
    """A spec.vllm field declared in crd_spec.VALUE_FLAGS is a schema field, its flag with the
    value on the pod, and a flag extraArgs may not carry: one entry makes all three."""
    from vlm_operator.api.validation import validate

    flag_, schema = crd_spec.VALUE_FLAGS[field]
    value = schema["enum"][-1] if "enum" in schema else 7
    assert field in crd.get_schema()["properties"]["spec"]["properties"]["vllm"]["properties"]
    assert flag(container(vlmd(vllm={field: value}))["args"], flag_) == str(value)
    problems, _ = validate({"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                            "metadata": {"name": "demo", "namespace": "ml"},
                            "spec": {"model": "m", "vllm": {"extraArgs": [flag_, str(value)]}}})
    assert any(flag_ in p and f"spec.vllm.{field}" in p for p in problems), problems
