"""A real Prometheus for the test bed (Debian's `prometheus` package), scraping what the chart's
ServiceMonitor and PodMonitor select, with the scrape configuration the Prometheus Operator
generates from them (pkg/prometheus/promcfg.go: generateServiceMonitorConfig,
generatePodMonitorConfig): the same job names, honor_labels, selector and port filters, target
labels (namespace, service, pod, container, endpoint, job) and sharding rules, for one shard.

What the Prometheus Operator takes from its own Prometheus object is fixed here: in-cluster
discovery (no `apiserverConfig`), and for ServiceMonitors the EndpointSlice role
(`serviceDiscoveryRole: EndpointSlice`; `role="endpoints"` gives its default), because the test
bed's loopback pod IPs never appear in core/v1 Endpoints. Debian's build has no Kubernetes
discovery: kubernetes_sd.py serves the same targets and meta labels over HTTP SD. Fields the
chart does not use are refused, not ignored, so the generated configuration never silently
departs from the operator's.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from vlm_testbed.controlplane.processes import _die_with_parent, _kill_group, free_port, tail

ENDPOINTS, ENDPOINTSLICE = "endpoints", "endpointslice"
SHARD = "0"  # what the operator's config reloader writes for $(SHARD) on a single shard

_SM_ENDPOINT_FIELDS = {"port", "path", "interval", "scrapeTimeout", "scheme", "honorLabels",
                       "relabelings", "metricRelabelings"}
_SM_SPEC_FIELDS = {"selector", "namespaceSelector", "endpoints", "jobLabel", "targetLabels",
                   "podTargetLabels"}
_PM_ENDPOINT_FIELDS = _SM_ENDPOINT_FIELDS
_PM_SPEC_FIELDS = {"selector", "namespaceSelector", "podMetricsEndpoints", "jobLabel",
                   "podTargetLabels"}


def _sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _refuse_unknown(what: str, obj: dict, known: set[str]) -> None:
    unknown = sorted(set(obj) - known)
    if unknown:
        raise ValueError(f"{what}: fields {unknown} are not reproduced by this generator")


def _selector(selector: dict, meta: str) -> list[dict]:
    """matchLabels (sorted) then matchExpressions, as keep/drop rules on `meta` labels."""
    rules = []
    for key in sorted(selector.get("matchLabels") or {}):
        rules.append({"action": "keep",
                      "source_labels": [f"{meta}_label_{_sanitize(key)}",
                                        f"{meta}_labelpresent_{_sanitize(key)}"],
                      "regex": f"({selector['matchLabels'][key]});true"})
    for exp in selector.get("matchExpressions") or []:
        key, op = _sanitize(exp["key"]), exp["operator"]
        if op in ("In", "NotIn"):
            rules.append({"action": "keep" if op == "In" else "drop",
                          "source_labels": [f"{meta}_label_{key}", f"{meta}_labelpresent_{key}"],
                          "regex": f"({'|'.join(exp['values'])});true"})
        else:
            rules.append({"action": "keep" if op == "Exists" else "drop",
                          "source_labels": [f"{meta}_labelpresent_{key}"], "regex": "true"})
    return rules


def _sd(role: str, namespace_selector: dict, own_namespace: str) -> list[dict]:
    sd: dict[str, Any] = {"role": role}
    if not namespace_selector.get("any"):
        sd["namespaces"] = {"names": namespace_selector.get("matchNames") or [own_namespace]}
    return [sd]


def _relabel(configs: list[dict]) -> list[dict]:
    """The monitor's RelabelConfigs in Prometheus' snake_case, action lower-cased."""
    keys = {"sourceLabels": "source_labels", "separator": "separator",
            "targetLabel": "target_label", "regex": "regex", "modulus": "modulus",
            "replacement": "replacement", "action": "action"}
    out = []
    for c in configs:
        _refuse_unknown("relabeling", c, set(keys))
        out.append({keys[k]: (v.lower() if k == "action" else v) for k, v in c.items()})
    return out


def _label_copies(labels: list[str], meta: str) -> list[dict]:
    return [{"source_labels": [f"{meta}_{_sanitize(label)}"], "target_label": _sanitize(label),
             "regex": "(.+)", "replacement": "${1}"} for label in labels]


def _head(job_name: str, ep: dict) -> dict:
    return {"job_name": job_name, "honor_labels": bool(ep.get("honorLabels", False))}


def _tail(job: dict, ep: dict, relabelings: list[dict]) -> dict:
    relabelings += _relabel(ep.get("relabelings") or [])
    relabelings += [{"source_labels": ["__address__"], "target_label": "__tmp_hash",
                     "modulus": 1, "action": "hashmod"},
                    {"source_labels": ["__tmp_hash"], "regex": SHARD, "action": "keep"}]
    job["relabel_configs"] = relabelings
    if ep.get("metricRelabelings"):
        job["metric_relabel_configs"] = _relabel(ep["metricRelabelings"])
    return job


def _endpoint_settings(job: dict, ep: dict) -> None:
    for field, key in (("interval", "scrape_interval"), ("scrapeTimeout", "scrape_timeout"),
                       ("path", "metrics_path"), ("scheme", "scheme")):
        if ep.get(field):
            job[key] = ep[field]


def _job(kind: str, fields: set[str], monitor: dict, i: int, ep: dict,
         role: str) -> dict:
    """The part of endpoint i's scrape job both monitor kinds share: its name, discovery and
    endpoint settings (only `port` endpoints are reproduced)."""
    meta, spec = monitor["metadata"], monitor["spec"]
    _refuse_unknown(f"{kind} endpoint", ep, fields)
    if not ep.get("port"):
        raise ValueError(f"{kind} endpoint: only `port` endpoints are reproduced")
    job = _head(f"{kind[0].lower()}{kind[1:]}/{meta['namespace']}/{meta['name']}/{i}", ep)
    job["kubernetes_sd_configs"] = _sd(role, spec.get("namespaceSelector") or {},
                                       meta["namespace"])
    _endpoint_settings(job, ep)
    return job


def service_monitor_jobs(monitor: dict, role: str = ENDPOINTSLICE) -> list[dict]:
    """One scrape job per endpoint of a ServiceMonitor, as the Prometheus Operator writes it."""
    spec = monitor["spec"]
    _refuse_unknown("ServiceMonitor spec", spec, _SM_SPEC_FIELDS)
    port_label = ("__meta_kubernetes_endpointslice_port_name" if role == ENDPOINTSLICE
                  else "__meta_kubernetes_endpoint_port_name")
    target = [f"__meta_kubernetes_{role}_address_target_kind",
              f"__meta_kubernetes_{role}_address_target_name"]
    jobs = []
    for i, ep in enumerate(spec["endpoints"]):
        job = _job("ServiceMonitor", _SM_ENDPOINT_FIELDS, monitor, i, ep, role)
        rules = [{"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"}]
        rules += _selector(spec["selector"], "__meta_kubernetes_service")
        rules.append({"action": "keep", "source_labels": [port_label], "regex": ep["port"]})
        rules += [
            {"source_labels": target, "separator": ";", "regex": "Node;(.*)",
             "replacement": "${1}", "target_label": "node"},
            {"source_labels": target, "separator": ";", "regex": "Pod;(.*)",
             "replacement": "${1}", "target_label": "pod"},
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"source_labels": ["__meta_kubernetes_pod_container_name"],
             "target_label": "container"},
            {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"],
             "regex": "(Failed|Succeeded)"},
        ]
        rules += _label_copies(spec.get("targetLabels") or [], "__meta_kubernetes_service_label")
        rules += _label_copies(spec.get("podTargetLabels") or [], "__meta_kubernetes_pod_label")
        rules.append({"source_labels": ["__meta_kubernetes_service_name"],
                      "target_label": "job", "replacement": "${1}"})
        rules += _job_label(spec, "__meta_kubernetes_service_label")
        rules.append({"target_label": "endpoint", "replacement": ep["port"]})
        jobs.append(_tail(job, ep, rules))
    return jobs


def _job_label(spec: dict, meta_prefix: str) -> list[dict]:
    """`jobLabel`: the job label taken from the named label of the service or pod, if set."""
    if not spec.get("jobLabel"):
        return []
    return [{"source_labels": [f"{meta_prefix}_{_sanitize(spec['jobLabel'])}"],
             "target_label": "job", "regex": "(.+)", "replacement": "${1}"}]


def pod_monitor_jobs(monitor: dict) -> list[dict]:
    """One scrape job per podMetricsEndpoint of a PodMonitor, as the Prometheus Operator writes
    it (job label `<namespace>/<name>` of the PodMonitor unless jobLabel says otherwise)."""
    meta, spec = monitor["metadata"], monitor["spec"]
    _refuse_unknown("PodMonitor spec", spec, _PM_SPEC_FIELDS)
    jobs = []
    for i, ep in enumerate(spec["podMetricsEndpoints"]):
        job = _job("PodMonitor", _PM_ENDPOINT_FIELDS, monitor, i, ep, "pod")
        rules = [{"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"},
                 {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"],
                  "regex": "(Failed|Succeeded)"}]
        rules += _selector(spec["selector"], "__meta_kubernetes_pod")
        rules += [
            {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"],
             "regex": ep["port"]},
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_pod_container_name"],
             "target_label": "container"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        ]
        rules += _label_copies(spec.get("podTargetLabels") or [], "__meta_kubernetes_pod_label")
        rules.append({"target_label": "job",
                      "replacement": f"{meta['namespace']}/{meta['name']}"})
        rules += _job_label(spec, "__meta_kubernetes_pod_label")
        rules.append({"target_label": "endpoint", "replacement": ep["port"]})
        jobs.append(_tail(job, ep, rules))
    return jobs


def scrape_configs(docs: list[dict], role: str = ENDPOINTSLICE) -> list[dict]:
    """The jobs of every ServiceMonitor, then every PodMonitor, among rendered objects (the
    operator's order)."""
    jobs = []
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":
            jobs += service_monitor_jobs(doc, role)
    for doc in docs:
        if doc["kind"] == "PodMonitor":
            jobs += pod_monitor_jobs(doc)
    return jobs


def rule_groups(docs: list[dict]) -> dict:
    """A Prometheus rule file holding every PrometheusRule's groups (what the operator writes
    into its rules ConfigMap)."""
    return {"groups": [g for d in docs if d["kind"] == "PrometheusRule"
                       for g in d["spec"]["groups"]]}


def adapter_pods_query(rule: dict, metric: str, series_names: list[str], namespace: str,
                       pods: list[str]) -> str:
    """The PromQL prometheus-adapter runs under `rule` for the Pods metric `metric` of these
    pods: the series its seriesQuery found (`series_names`) renamed by the rule's regex, the
    namespace and pod resources as the namespace and pod labels."""
    pattern = re.compile(rule["name"]["matches"])
    replacement = re.sub(r"\$\{(\d+)\}", r"\\g<\1>", rule["name"]["as"])
    names = sorted({n for n in series_names
                    if pattern.fullmatch(n) and pattern.sub(replacement, n) == metric})
    if len(names) != 1:
        raise LookupError(f"{metric}: the rule names {names or 'no series'} so")
    matchers = f'namespace="{namespace}",pod=~"{"|".join(pods)}"'
    return (rule["metricsQuery"].replace("<<.Series>>", names[0])
            .replace("<<.LabelMatchers>>", matchers).replace("<<.GroupBy>>", "pod"))


class Prometheus:
    """`prometheus` on a loopback port with a configuration and rule file of our own; its data
    and log in a temporary directory, removed when it stops. A context manager."""

    def __init__(self, jobs: list[dict], rules: dict | None = None,
                 evaluation_interval: str = "1s", binary: str = "prometheus") -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="vlm-prometheus-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.dir / "prometheus.log"
        config: dict[str, Any] = {"global": {"scrape_interval": "1s",
                                             "evaluation_interval": evaluation_interval},
                                  "scrape_configs": jobs}
        if rules:
            (self.dir / "rules.yaml").write_text(yaml.safe_dump(rules))
            config["rule_files"] = [str(self.dir / "rules.yaml")]
        self.config_path = self.dir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.binary = binary
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60) -> Prometheus:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [self.binary, f"--config.file={self.config_path}",
                 f"--storage.tsdb.path={self.dir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout_s
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not become ready:\n{tail(self.log_path)}")
            time.sleep(0.2)
        return self

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as rsp:
                return rsp.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None:
            _kill_group(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Prometheus:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; the `data` of a successful answer, else a RuntimeError."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as rsp:
                body = json.load(rsp)
        except urllib.error.HTTPError as exc:
            body = json.load(exc)
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query: [{"metric": {labels}, "value": [t, "v"]}, ...]."""
        return self.api("query", query=expr)["result"]

    def series(self, match: str) -> list[dict]:
        return self.api("series", **{"match[]": match})

    def targets(self) -> list[dict]:
        return self.api("targets", state="active")["activeTargets"]

    def alerts(self) -> list[dict]:
        return self.api("alerts")["alerts"]
