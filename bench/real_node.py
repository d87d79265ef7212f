"""The real kubelet beside the node simulator's model: what a real node (kubelet v1.20.2 on its
own containerd, realnode.RealNode) does, measured, next to the figure the simulator uses (read
from its constants) and what the simulator does with the same pods and sequence (measured on a
NodeSimulator node of the same control plane).

Measured on one real node with the vLLM stand-in's image: node Ready after the kubelet's start;
pod created -> Ready (the operator's probe periods); a pod annotation change -> the downwardAPI
file inside the container; the container's main process killed -> running and Ready again,
and the back-off before each restart of successive crashes; `kubectl logs` (and --previous
after a restart) through the kubelet; the EndpointSlice after Ready and after readiness fails;
delete with a grace period -> the pod gone.

Usage: .venv/bin/python bench/real_node.py [--downward-samples 7] [--crashes 4]
(needs root; about 7 minutes: the real node, then the same sequence on a simulated node)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from common import ROOT, machine
from vlm_testbed.controlplane import K8S_VERSION, ControlPlane, ready_namespace
from vlm_testbed.nodesim import SIM_LABEL, NodeSimulator
from vlm_testbed.nodesim import state as sim_state
from vlm_testbed.nodesim.volumes import DOWNWARD_API_LAG_S, MOUNTS_ENV
from vlm_testbed.realnode import LocalRegistry, RealNode, build_images
from vlm_testbed.realnode.pods import (
    ANNOTATION,
    CONTROL_DIR,
    CONTROL_FILE,
    container_status,
    endpoint_conditions,
    is_ready,
    running_id,
    standin_pod,
    wait_for,
)

OUT = ROOT / "bench" / "results"
SIM_BACKOFF_BASE_S, SIM_BACKOFF_CAP_S = 10.0, 300.0  # NodeSimulator's defaults


@dataclass
class Side:
    """One kind of node: where its pods go and how a bench reaches into their containers."""

    name: str
    selector: dict[str, str]
    main_pid: Callable[[Any], int | None]  # the container's main process on this host
    read_file: Callable[[Any, str], str | None]  # a file as the container sees it


def real_side(node: RealNode) -> Side:
    return Side("real", {"vlm-testbed/real-node": "true"},
                lambda pod: node.task_pid(running_id(pod) or ""),
                lambda pod, path: node.read_in_container(running_id(pod) or "", path))


def _sim_pid(pod: Any) -> int | None:
    """The simulator runs a container as `python -m vlm_testbed.vllmsim ... --host <pod ip>`."""
    want = ["--host", pod.status.pod_ip]
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "vlm_testbed.vllmsim" in argv and any(
                argv[i:i + 2] == want for i in range(len(argv) - 1)):
            return int(pid)
    return None


def _sim_read(pod: Any, path: str) -> str | None:
    pid = _sim_pid(pod)
    if pid is None:
        return None
    try:
        env = dict(e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().decode(
            errors="replace").split("\0") if "=" in e)
        mounts = json.loads(env[MOUNTS_ENV])
        base = max((m for m in mounts if path.startswith(m + "/")), key=len)
        return Path(mounts[base], path[len(base) + 1:]).read_text()
    except (OSError, KeyError, ValueError):
        return None


SIM_SIDE = Side("sim", {SIM_LABEL: "true"}, _sim_pid, _sim_read)


def _pod(side: Side, name: str) -> dict:
    body = standin_pod(name, labels={"app": side.name})
    body["spec"]["nodeSelector"] = side.selector
    return body


def measure_side(side: Side, api: Any, kubectl: list[str], args: argparse.Namespace) -> dict:
    """The same sequence on one kind of node, in a namespace of its own."""
    r: dict = {}
    v1, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    ns = ready_namespace(api, f"bench-{side.name}-node")
    kubectl = [*kubectl, "-n", ns]
    v1.create_namespaced_service(ns, {"metadata": {"name": "standin"}, "spec": {
        "selector": {"app": side.name}, "ports": [{"port": 8000, "targetPort": 8000}]}})
    names = [f"p{i}" for i in range(args.pods)]

    def read(name: str) -> Any:
        return v1.read_namespaced_pod(name, ns)

    # pod created -> Ready; Ready -> endpoint ready in the EndpointSlice
    starts, to_endpoint = [], []
    for name in names:
        t0 = time.monotonic()
        v1.create_namespaced_pod(ns, _pod(side, name))
        pod = wait_for(f"{name} Ready", lambda name=name: (p := read(name)) and is_ready(p)
                       and p, 120)
        starts.append(time.monotonic() - t0)
        t_ready = time.monotonic()
        wait_for("endpoint ready", lambda pod=pod: (endpoint_conditions(
            custom, ns, pod.status.pod_ip) or {}).get("ready"), 30, 0.02)
        to_endpoint.append(time.monotonic() - t_ready)
    r["pod_create_to_ready_s"] = [round(x, 2) for x in starts]
    r["ready_to_endpointslice_ready_s"] = [round(x, 3) for x in to_endpoint]
    pod = read("p0")
    r["pod_ip"] = pod.status.pod_ip
    pid = side.main_pid(pod)
    env = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    r["gpu_env"] = [e for e in env if e.startswith("NVIDIA_VISIBLE_DEVICES=")]

    # annotation change -> downwardAPI file in the container
    lags = []
    for i in range(1, args.downward_samples + 1):
        t0 = time.monotonic()
        v1.patch_namespaced_pod("p0", ns, {"metadata": {"annotations": {ANNOTATION: str(i)}}})
        wait_for("downwardAPI file", lambda i=i: side.read_file(
            read("p0"), f"{CONTROL_DIR}/{CONTROL_FILE}") == str(i), 120, 0.02)
        lags.append(time.monotonic() - t0)
        time.sleep(0.5)
    r["downward_api_refresh_s"] = [round(x, 3) for x in lags]

    t0 = time.monotonic()
    out = subprocess.run([*kubectl, "logs", "p0"], capture_output=True, text=True)
    r["kubectl_logs"] = {"rc": out.returncode, "lines": len(out.stdout.splitlines()),
                         "seconds": round(time.monotonic() - t0, 3)}

    # kill the main process: in-place restart, then successive crashes' back-off
    restarts = []
    for n in range(1, args.crashes + 1):
        pod = wait_for("running", lambda: (p := read("p0")) and running_id(p) and p, 400)
        cid = running_id(pod)
        pid = wait_for("main pid", lambda pod=pod: side.main_pid(pod), 30)
        t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        seen: dict[str, float] = {}

        def restarted(n=n, seen=seen, cid=cid, t_kill=t_kill):
            p = read("p0")
            st = container_status(p)
            now = time.monotonic() - t_kill
            if st.state.waiting and st.state.waiting.reason == "CrashLoopBackOff":
                seen.setdefault("crash_loop_back_off_shown_s", now)
            if st.restart_count >= n and st.state.running and st.container_id != cid:
                seen.setdefault("running_again_s", now)
                return is_ready(p) and p
            return None

        wait_for(f"restart {n}", restarted, 400)
        seen["ready_again_s"] = time.monotonic() - t_kill
        restarts.append({"crash": n, **{k: round(v, 2) for k, v in seen.items()}})
        if n == 1:
            prev = subprocess.run([*kubectl, "logs", "p0", "--previous"], capture_output=True,
                                  text=True)
            r["kubectl_logs_previous"] = {"rc": prev.returncode,
                                          "lines": len(prev.stdout.splitlines())}
    r["restarts"] = restarts

    # readiness fails (engine dead, process kept alive) -> NotReady -> endpoint not ready
    ip = read("p1").status.pod_ip
    req = urllib.request.Request(
        f"http://{ip}:8000/sim/fault", method="POST",
        headers={"Content-Type": "application/json"},
        data=json.dumps({"fault": "engine_dead", "exit_delay": 3600}).encode())
    with urllib.request.urlopen(req, timeout=5) as rsp:
        rsp.read()
    t0 = time.monotonic()
    wait_for("p1 NotReady", lambda: not is_ready(read("p1")), 60)
    t_nr = time.monotonic() - t0
    wait_for("endpoint not ready", lambda: not (endpoint_conditions(
        custom, ns, ip) or {}).get("ready"), 30, 0.02)
    r["readiness_fail"] = {"health_503_to_not_ready_s": round(t_nr, 2),
                           "to_endpoint_not_ready_s": round(time.monotonic() - t0, 2)}

    # delete with a grace period -> gone (the stand-in exits on SIGTERM), one at a time
    def gone(name: str) -> bool:
        try:
            read(name)
        except ApiException as exc:
            return exc.status == 404
        return False

    deletes = []
    for name in names:
        t0 = time.monotonic()
        v1.delete_namespaced_pod(name, ns, grace_period_seconds=5)
        wait_for(f"{name} gone", lambda name=name: gone(name), 90)
        deletes.append(round(time.monotonic() - t0, 2))
    r["delete_grace5_to_gone_s"] = deletes
    return r


def measure(args: argparse.Namespace) -> dict:
    with LocalRegistry() as registry:
        build_images(registry)
        return measure_on(registry, args)


def measure_on(registry: LocalRegistry, args: argparse.Namespace) -> dict:
    with ControlPlane() as cp, RealNode(cp, registry=registry.address, gpus=4) as node, \
            NodeSimulator(cp.kubeconfig, nodes=1, gpus_per_node=4,
                          name_prefix="sim-node") as _sim, cp.api_client() as api:
        kubectl = [str(cp.kubectl), f"--kubeconfig={cp.kubeconfig}"]
        r = {"node_ready_from_kubelet_start_s": round(node.kubelet_ready_seconds or 0, 2),
             "node_start_total_s": round(node.ready_seconds or 0, 2)}
        r["real"] = measure_side(real_side(node), api, kubectl, args)
        r["sim"] = measure_side(SIM_SIDE, api, kubectl, args)
    return r


def simulator_figures() -> dict:
    return {
        "downward_api_lag_s": DOWNWARD_API_LAG_S,
        "backoff_s": [sim_state.backoff_delay(n, SIM_BACKOFF_BASE_S, SIM_BACKOFF_CAP_S)
                      for n in range(1, 6)],
        "min_grace_s": sim_state.MIN_GRACE_S,
    }


def _fmt(xs: list[float]) -> str:
    return ", ".join(f"{x:g}" for x in xs)


def report(r: dict, sim: dict, info: dict) -> str:
    med = statistics.median
    real, meas = r["real"], r["sim"]
    rr, sr = real["restarts"], meas["restarts"]
    rows = [
        ("Node Ready after start", "registered Ready at once",
         f"{r['node_ready_from_kubelet_start_s']} s after the kubelet starts "
         f"({r['node_start_total_s']} s with certificate, containerd, image import)",
         "each real node adds this to a test bed's start (nodes start side by side)"),
        ("Pod created -> Ready (startup probe every 10 s, readiness every 5 s)",
         f"measured {_fmt(meas['pod_create_to_ready_s'])} s",
         f"{_fmt(real['pod_create_to_ready_s'])} s",
         "about one startup-probe period in both (the first probe comes before the stand-in "
         "listens); the simulator's is the same every time, the real kubelet's spreads by "
         "seconds either way (its probe workers tick on their own): a test must not expect "
         "the simulator's exact figure"),
        ("Ready -> EndpointSlice endpoint ready",
         f"measured median {med(meas['ready_to_endpointslice_ready_s']):.3f} s",
         f"median {med(real['ready_to_endpointslice_ready_s']):.3f} s",
         "the same real controller-manager writes both"),
        ("Annotation change -> downwardAPI file",
         f"{sim['downward_api_lag_s']:g} s (DOWNWARD_API_LAG_S); measured median "
         f"{med(meas['downward_api_refresh_s']):.2f} s",
         f"median {med(real['downward_api_refresh_s']):.2f} s, max "
         f"{max(real['downward_api_refresh_s']):.2f} s ({len(real['downward_api_refresh_s'])} "
         "changes)",
         "the real kubelet remounts on the pod's update event, well under the simulator's "
         "2 s: simulated figures for the operator's restart request are on the safe side"),
        ("Main process killed -> running again (1st crash)",
         f"back-off {sim['backoff_s'][0]:g} s; measured {sr[0]['running_again_s']} s "
         f"(Ready {sr[0]['ready_again_s']} s)",
         f"{rr[0]['running_again_s']} s (Ready {rr[0]['ready_again_s']} s), restartCount 1",
         "in place in both, Ready again after a startup-probe period in both; the real "
         "kubelet notices the exit about a second later (its PLEG relists every second)"),
        ("Kill -> running again, crashes 1..n (CrashLoopBackOff)",
         f"back-off {_fmt(sim['backoff_s'][:len(rr)])} s; measured "
         f"{_fmt([x['running_again_s'] for x in sr])} s",
         f"{_fmt([x['running_again_s'] for x in rr])} s",
         "the simulator restarts exactly on the back-off; the real kubelet 6-11 s after it "
         "here (it looks at a pod in back-off again only when the pod's next sync comes) and "
         "shows CrashLoopBackOff about 5 s after the exit, not at once: crash-loop recovery "
         "figures from the simulator are optimistic by up to a sync period per crash"),
        ("kubectl logs (and --previous after a restart)",
         f"simulator's log server: rc {meas['kubectl_logs']['rc']}, previous rc "
         f"{meas['kubectl_logs_previous']['rc']}",
         f"through the kubelet: rc {real['kubectl_logs']['rc']} "
         f"({real['kubectl_logs']['lines']} lines, {real['kubectl_logs']['seconds']} s), "
         f"previous rc {real['kubectl_logs_previous']['rc']} "
         f"({real['kubectl_logs_previous']['lines']} lines)",
         "the operator's log reading works against a real kubelet"),
        ("/health 503 -> pod NotReady -> endpoint not ready (readiness 5 s x 3)",
         f"measured {meas['readiness_fail']['health_503_to_not_ready_s']} s / "
         f"{meas['readiness_fail']['to_endpoint_not_ready_s']} s",
         f"{real['readiness_fail']['health_503_to_not_ready_s']} s / "
         f"{real['readiness_fail']['to_endpoint_not_ready_s']} s", "3 failed probes in both"),
        ("Delete with grace 5 s -> pod gone (stand-in exits on SIGTERM)",
         f"SIGTERM, at least {sim['min_grace_s']} s to SIGKILL; measured "
         f"{_fmt(meas['delete_grace5_to_gone_s'])} s",
         f"{_fmt(real['delete_grace5_to_gone_s'])} s",
         "the simulator removes the pod as soon as its process exits; the real kubelet "
         "about 10 s later (its status sync and volume teardown before the final delete): "
         "anything that waits for a pod to be gone (a replacement, a drain, scale-down) "
         "takes seconds longer on a real node than the simulator shows"),
    ]
    lines = ["# Real kubelet vs the node simulator", "",
             f"Kubernetes {K8S_VERSION} (the kubelet built from Debian's source package, like "
             f"the control plane), containerd {info['containerd']}, runc {info['runc']}, cgroup "
             "v1; the vLLM stand-in's image on one real node (realnode.RealNode, pod IP "
             f"{real['pod_ip']}, {real['gpu_env']} from the device plugin) and on one "
             "simulated node (nodesim.NodeSimulator, back-off base 10 s, cap 300 s), the same "
             "pod spec (the operator's probe periods) and sequence on the same control plane. "
             f"Machine: {info['cpu']}, {info['cores']} cores, load {info['load_avg'][0]:.1f} "
             f"at the end (another test run shared the machine), {info['platform']}, commit "
             f"{info['commit']}, {info['time']}; the run took {info['duration_s']:.0f} s.",
             "", "Produced by `bench/real_node.py`; raw figures in node-model.json.", "",
             "| behaviour | simulator's figure | real kubelet measured | consequence |",
             "| --- | --- | --- | --- |"]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    lines += ["", "Restarts in detail (seconds after the kill; real / simulator):", "",
              "| crash | back-off modelled | CrashLoopBackOff shown | running again | "
              "Ready again |", "| --- | --- | --- | --- | --- |"]
    for a, b, m in zip(rr, sr, sim["backoff_s"], strict=False):
        lines.append(f"| {a['crash']} | {m:g} | {a.get('crash_loop_back_off_shown_s', '-')} / "
                     f"{b.get('crash_loop_back_off_shown_s', '-')} | {a['running_again_s']} / "
                     f"{b['running_again_s']} | {a['ready_again_s']} / {b['ready_again_s']} |")
    return "\n".join(lines) + "\n"


def versions() -> dict:
    def first_line(cmd: list[str]) -> str:
        out = subprocess.run(cmd, capture_output=True, text=True).stdout.strip()
        return out.splitlines()[0] if out else "?"
    return {"containerd": first_line(["containerd", "--version"]).split()[-1],
            "runc": first_line(["runc", "--version"]).split()[-1]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--downward-samples", type=int, default=7)
    ap.add_argument("--crashes", type=int, default=4)
    ap.add_argument("--pods", type=int, default=3, help="pods started (and deleted) per side")
    ap.add_argument("--render", action="store_true",
                    help="only write node-model.md again from node-model.json")
    args = ap.parse_args()
    if args.render:
        data = json.loads((OUT / "node-model.json").read_text())
        (OUT / "node-model.md").write_text(report(data["real"], data["simulator"],
                                                  data["machine"]))
        return 0
    t0 = time.monotonic()
    r = measure(args)
    info = machine(**versions(), duration_s=round(time.monotonic() - t0, 1))
    sim = simulator_figures()
    OUT.mkdir(exist_ok=True)
    Path(OUT / "node-model.json").write_text(json.dumps(
        {"machine": info, "simulator": sim, "real": r}, indent=1) + "\n")
    md = report(r, sim, info)
    Path(OUT / "node-model.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
