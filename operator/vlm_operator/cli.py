"""The `vlm-operator` command line."""

from __future__ import annotations

import argparse
import re
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import TextIO

import yaml

from vlm_operator.api import admin_policy, crd, names
from vlm_operator.api.validation import SpecError, parse, validate
from vlm_operator.desired import children, inference_pool
from vlm_operator.k8s import nodes
from vlm_operator.remediation import steps as remediation
from vlm_operator.remediation.ladder import KUBELET_BACKOFF

EXIT_USAGE = 2
# A label key (optional DNS prefix, a name of up to 63 characters), optionally =value.
_LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_SECRET_LABEL = re.compile(
    rf"([a-z0-9]([-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_LABEL_NAME}(=({_LABEL_NAME})?)?\Z")


def _version() -> str:
    try:
        return version("vlm-operator")
    except PackageNotFoundError:
        return "unknown"


def dump_yaml(docs: list[dict], out: TextIO) -> None:
    yaml.safe_dump_all(docs, out, sort_keys=False, explicit_start=True, width=100)


def _load_documents(path: str) -> list:
    if path == "-":
        return [d for d in yaml.safe_load_all(sys.stdin) if d is not None]
    with open(path, encoding="utf-8") as fh:
        return [d for d in yaml.safe_load_all(fh) if d is not None]


def cmd_render(args: argparse.Namespace) -> int:
    try:
        docs = _load_documents(args.filename)
    except OSError as exc:
        print(f"error: cannot read {args.filename}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    except yaml.YAMLError as exc:
        print(f"error: {args.filename} is not valid YAML: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not docs:
        print(f"error: {args.filename} holds no VLMDeployment", file=sys.stderr)
        return EXIT_USAGE
    rules = admin_policy.AdminPolicy(prometheus_addresses=tuple(args.keda_prometheus_addresses))
    rendered, failed = [], False
    for index, doc in enumerate(docs, start=1):
        if isinstance(doc, dict) and args.namespace:
            doc = {**doc, "metadata": {**(doc.get("metadata") or {}),
                                       "namespace": args.namespace}}
        label = _describe(doc, index)
        try:
            problems, _ = validate(doc, rules)
            if problems:
                raise SpecError(problems)
            vlmd = parse(doc)
        except SpecError as exc:
            failed = True
            print(f"error: {args.filename}: {label} is invalid:", file=sys.stderr)
            for problem in exc.problems:
                print(f"  - {problem}", file=sys.stderr)
            continue
        for warning in vlmd.warnings:
            print(f"warning: {args.filename}: {label}: {warning}", file=sys.stderr)
        rendered += children.get_children(
            vlmd, pdb_api_version=args.pdb_api_version,
            prometheus_address=admin_policy.prometheus_address(vlmd.spec, rules))
        rendered += inference_pool.get_gateway_children(vlmd, inference_pools=True)
    if failed:
        return EXIT_USAGE
    dump_yaml(rendered, sys.stdout)
    return 0


def _describe(doc: object, index: int) -> str:
    name = None
    if isinstance(doc, dict) and isinstance(doc.get("metadata"), dict):
        name = doc["metadata"].get("name")
    return f"document {index}" + (f" ({names.KIND} {name})" if name else "")


def cmd_crd(args: argparse.Namespace) -> int:
    dump_yaml(crd.get_peering_crds() if args.peering else [crd.get_crd()], sys.stdout)
    return 0


def cmd_scan_logs(args: argparse.Namespace) -> int:
    from vlm_operator.logs import scan_logs

    return scan_logs.main(args.files, sys.stdout, sys.stderr,
                          logging_prefix=args.logging_prefix)


def cmd_run(args: argparse.Namespace) -> int:
    from vlm_operator import runner

    return runner.run(args)


def _count(text: str) -> int:
    """An argparse type: a whole number from 0 to 10000."""
    if not text.isdigit() or int(text) > 10000:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from 0 to 10000")
    return int(text)


def _seconds_at_least(minimum: float):
    """An argparse type: a finite number of seconds, at least `minimum`."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = minimum - 1
        if not minimum <= value < float("inf"):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a number of seconds >= {minimum:g}")
        return value
    return parse


def _secret_label(text: str) -> str:
    if text and not _SECRET_LABEL.match(text):  # "" (the default): no Secret rule
        raise argparse.ArgumentTypeError(f"{text!r} is not a label key or key=value")
    return text


def _drain_markers(text: str) -> tuple[nodes.Marker, ...]:
    """--node-drain-markers: taint or label keys, each optionally =value, comma-separated."""
    for item in (i.strip() for i in text.split(",")):
        if item and not _SECRET_LABEL.match(item):
            raise argparse.ArgumentTypeError(f"{item!r} is not a taint or label key, or "
                                             "key=value")
    try:
        return nodes.parse_markers(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _keda_prometheus(group) -> None:
    group.add_argument("--keda-prometheus-address", action="append",
                       dest="keda_prometheus_addresses", default=[], metavar="URL",
                       help="a Prometheus KEDA ScaledObjects may query (repeatable); the first "
                            "is used when spec.autoscaling.prometheus.serverAddress is unset, "
                            "and that field may only name one of these")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vlm-operator",
        description="Run vision-language models on Kubernetes with a patched vLLM whose "
                    "tokenizer pool is safe under concurrent multimodal load.",
        epilog="Start with: vlm-operator render -f manifests/examples/qwen3-vl-4b.yaml",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    render = sub.add_parser(
        "render", help="print the objects a VLMDeployment becomes (no cluster needed)",
        description="Validate VLMDeployment manifests and print the Deployment, Service, "
                    "PodDisruptionBudget (and PVC) the operator would create, as YAML. "
                    "Exits 2 naming every bad field when a manifest is invalid.")
    render.add_argument("-f", "--filename", required=True,
                        help="YAML file with one or more VLMDeployments ('-' for stdin)")
    render.add_argument("-n", "--namespace", help="namespace to render into")
    render.add_argument("--pdb-api-version", default="policy/v1",
                        choices=["policy/v1", "policy/v1beta1"],
                        help="PodDisruptionBudget API (policy/v1beta1 before Kubernetes 1.21)")
    _keda_prometheus(render)
    render.set_defaults(func=cmd_render)

    crd_cmd = sub.add_parser("crd", help="print the VLMDeployment CustomResourceDefinition",
                             description="Print the CRD; pipe it to `kubectl apply -f -`.")
    crd_cmd.add_argument("--peering", action="store_true",
                         help="print kopf's peering CRDs instead (needed by `run`: operator "
                              "replicas coordinate through them)")
    crd_cmd.set_defaults(func=cmd_crd)

    scan = sub.add_parser(
        "scan-logs", help="find tokenizer and engine failures in vLLM log files (offline)",
        description="Scan vLLM server logs (plain or .gz, '-' for stdin) for known failure "
                    "signatures. One JSON object per detection on stdout, a summary on "
                    "stderr; exit 2 when an input cannot be read.")
    scan.add_argument("files", nargs="+", metavar="FILE")
    scan.add_argument("--logging-prefix", default="",
                      help="the server's VLLM_LOGGING_PREFIX, if it set one (exact text)")
    scan.set_defaults(func=cmd_scan_logs)

    run = sub.add_parser(
        "run", help="start the operator",
        description="Reconcile VLMDeployments on the cluster from the kubeconfig or the "
                    "in-cluster service account.")
    run.add_argument("-n", "--namespace", action="append", dest="namespaces", default=[],
                     help="watch only this namespace (repeatable; glob patterns such as "
                          "'team-*' allowed); default: all namespaces")
    run.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, then "
                                          "in-cluster)")
    run.add_argument("--peering", default="vlm-operator",
                     help="peering name: operator replicas with the same name never act "
                          "twice (only the highest priority one runs)")
    run.add_argument("--priority", type=int, default=0, help="peering priority")
    run.add_argument("--standalone", action="store_true",
                     help="no peering: for a single replica or local development only")
    run.add_argument("--liveness-port", type=int, default=8080,
                     help="port of the /healthz liveness endpoint (0 disables it)")
    run.add_argument("--metrics-port", type=int, default=9090,
                     help="port of the Prometheus /metrics endpoint (0 disables it)")
    run.add_argument("--shards", type=int, default=1,
                     help="split VLMDeployments across this many operator processes (by a "
                          "hash of namespace/name; docs/scaling.md); default 1")
    run.add_argument("--shard", default="0",
                     help="this process's shard, 0..shards-1, or 'auto': the ordinal of a "
                          "StatefulSet pod (POD_NAME, else the host name)")
    run.add_argument("--node-drain-wait-seconds", type=_seconds_at_least(0),
                     default=remediation.NODE_DRAIN_WAIT_S,
                     metavar="SECONDS",
                     help="how long a node drain (the cluster autoscaler, Karpenter, a "
                          "--node-drain-markers marker) is held for a pod "
                          "spec.health.minAvailable protects while no GPU is free elsewhere "
                          "for its replacement; then the pod is drained and deleted so the "
                          "drain finishes (default "
                          f"{remediation.NODE_DRAIN_WAIT_S:g}); a cordon alone never does")
    run.add_argument("--node-drain-markers", type=_drain_markers, default=(),
                     metavar="KEY[=VALUE],...",
                     help="node taints or labels that show a drain, besides the cluster "
                          "autoscaler's and Karpenter's taints (at most "
                          f"{nodes.MAX_MARKERS}); {nodes.UNSCHEDULABLE_TAINT} makes every "
                          "cordon a drain. Default: none")
    run.add_argument("--kubelet-backoff-seconds", type=_seconds_at_least(0.1),
                     default=KUBELET_BACKOFF.initial_s, metavar="SECONDS",
                     help="the nodes' crash-loop back-off before a container's second restart, "
                          "doubling to --kubelet-max-backoff-seconds (the kubelet's; "
                          "spec.health.recovery InPlace weighs it against a new pod; default "
                          f"{KUBELET_BACKOFF.initial_s:g})")
    run.add_argument("--kubelet-max-backoff-seconds", type=_seconds_at_least(0.1),
                     default=KUBELET_BACKOFF.max_s, metavar="SECONDS",
                     help="the nodes' longest crash-loop back-off (kubelet "
                          "crashLoopBackOff.maxContainerRestartPeriod where set); the kubelet "
                          "forgets a back-off after a run twice this long (default "
                          f"{KUBELET_BACKOFF.max_s:g})")
    run.add_argument("--node-autoscaler-pending-gpus", type=_count, default=0, metavar="GPUS",
                     help="a node autoscaler (cluster-autoscaler, Karpenter) adds GPU nodes for "
                          "Pending pods: surges and Builtin scale-ups that fit no node are "
                          "created Pending, leaving at most this many GPUs Pending in all; "
                          "default 0: existing nodes only")
    run.add_argument("--node-autoscaler-pending-gpus-per-deployment", type=_count, default=None,
                     metavar="GPUS", help="of those, at most this many per VLMDeployment "
                                          "(default: all of them)")
    run.add_argument("--node-autoscaler-timeout-seconds", type=_seconds_at_least(1),
                     default=900.0, metavar="SECONDS",
                     help="how long a replica waits Pending for a node to come before the "
                          "surge is given up or the scale-up given back; default 900")
    run.add_argument("--log-mark-seconds", type=_seconds_at_least(1), default=300.0,
                     help="at most one resume mark per followed pod this often (a pod "
                          "annotation, so a PATCH each: where a restarted operator resumes "
                          "reading its log); at least 1, default 300")
    run.add_argument("--verbose", action="store_true", help="debug logging")
    policy = run.add_argument_group(
        "policy", "What a VLMDeployment may ask for (all off by default); a spec that breaks "
        "the policy gets SpecValid=False naming the field and the rule (docs/security.md)")
    policy.add_argument("--allowed-image-prefix", action="append", dest="image_prefixes",
                        default=[], metavar="PREFIX",
                        help="spec.image must start with one of these (repeatable), e.g. "
                             "registry.example.com/vllm/")
    policy.add_argument("--allowed-priority-class", action="append", dest="priority_classes",
                        default=[], metavar="NAME",
                        help="spec.scheduling.priorityClassName must be one of these "
                             "(repeatable); unset stays allowed")
    policy.add_argument("--secret-label", type=_secret_label, default="",
                        metavar="KEY[=VALUE]",
                        help="only Secrets carrying this label may be referenced "
                             "(hfTokenSecretRef, env secretKeyRef); needs get on Secrets, of "
                             "which the operator reads the metadata only")
    policy.add_argument("--deny-code-options", action="store_true",
                        help="refuse the vLLM flags and environment variables that run code "
                             "or fetch models of the tenant's choosing (--trust-remote-code, "
                             "--worker-extension-cls, PYTHONPATH, HF_ENDPOINT, "
                             "VLLM_SERVER_DEV_MODE, ...: docs/security.md)")
    policy.add_argument("--autoscaling-mode", action="append", dest="autoscaling_modes",
                        choices=crd.AUTOSCALING_MODES, metavar="MODE",
                        help="an autoscaling mode this installation serves (repeatable; "
                             "default: all of Builtin, HPA, KEDA); the others are refused")
    _keda_prometheus(policy)
    policy.add_argument("--inference-pools", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="manage the InferencePools VLMDeployments ask for "
                             "(spec.gateway.inferencePool; needs RBAC on inferencepools); "
                             "--no-inference-pools: such a VLMDeployment is Degraded, "
                             "InferencePoolUnavailable")
    run.set_defaults(func=cmd_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.func is cmd_run and args.kubelet_backoff_seconds > args.kubelet_max_backoff_seconds:
        parser.error(f"--kubelet-backoff-seconds {args.kubelet_backoff_seconds:g} is above "
                     f"--kubelet-max-backoff-seconds {args.kubelet_max_backoff_seconds:g}: the "
                     "back-off doubles from the first up to the second")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
