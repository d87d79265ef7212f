"""The local demo: a real control plane, a simulated GPU node, the operator and the example.

`python -m vlm_testbed.demo [--keep]`: builds Kubernetes the first time (about 10 minutes), then
shows the example VLMDeployment becoming Ready, kills its engine, and shows what the operator did.
Only the node (kubelet + container runtime) is simulated; vLLM is a stand-in process with vLLM's
HTTP surface and log lines.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from vlm_operator.api import crd
from vlm_testbed.controlplane import ControlPlane, build
from vlm_testbed.nodesim import NodeSimulator
from vlm_testbed.operator_process import OperatorProcess

ROOT = Path(__file__).resolve().parents[3]  # the repository (operator/testbed/vlm_testbed/)
EXAMPLE = ROOT / "manifests/examples/qwen3-vl-4b.yaml"
NAME = "qwen3-vl-4b"


def say(text: str) -> None:
    print(f"\n==> {text}", flush=True)


class Demo:
    def __init__(self, cp: ControlPlane):
        self.cp = cp

    def kubectl(self, *args: str, show: bool = True) -> str:
        cmd = [str(self.cp.kubectl), "--kubeconfig", str(self.cp.kubeconfig), *args]
        if show:
            print(f"$ kubectl {' '.join(args)}", flush=True)
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        text = out.stdout + out.stderr
        if show:
            print(text.rstrip(), flush=True)
        return text

    def wait(self, what: str, check, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check():
                return
            time.sleep(2)
        raise SystemExit(f"demo: {what} did not happen within {timeout:.0f} s")

    def ready(self) -> bool:
        out = self.kubectl("get", "vlmd", NAME, "-o",
                           'jsonpath={.status.conditions[?(@.type=="Ready")].status}', show=False)
        return out.strip() == "True"

    def told(self, pod: dict, reason: str) -> bool:
        """The operator posted an Event of this reason on this pod."""
        events = json.loads(self.kubectl("get", "events", "-o", "json", "--field-selector",
                                         f"involvedObject.name={pod['metadata']['name']}",
                                         show=False))["items"]
        return any(e["reason"] == reason and
                   e.get("source", {}).get("component") == "vlm-operator" for e in events)

    def pod(self) -> dict:
        pods = json.loads(self.kubectl("get", "pods", "-l",
                                       f"app.kubernetes.io/instance={NAME}", "-o", "json",
                                       show=False))["items"]
        running = [p for p in pods if p["status"].get("podIP")
                   and not p["metadata"].get("deletionTimestamp")]
        return running[0]


def provide_model_cache_volume(demo: Demo) -> None:
    """The example asks for a 50Gi PVC; with no storage provisioner, offer a hostPath volume."""
    volume = {"apiVersion": "v1", "kind": "PersistentVolume",
              "metadata": {"name": "demo-model-cache"},
              "spec": {"capacity": {"storage": "100Gi"}, "accessModes": ["ReadWriteOnce"],
                       "hostPath": {"path": "/tmp/vlm-demo-models"},
                       "persistentVolumeReclaimPolicy": "Delete"}}
    subprocess.run([str(demo.cp.kubectl), "--kubeconfig", str(demo.cp.kubeconfig), "apply",
                    "-f", "-"], input=json.dumps(volume), text=True, check=True,
                   capture_output=True)


def run(keep: bool) -> int:
    say("building Kubernetes v1.20.2 from Debian's source (first run only, ~10 minutes)")
    build()
    say("starting etcd, kube-apiserver, kube-controller-manager, kube-scheduler on loopback")
    with ControlPlane(crd.get_all_crds()) as cp:
        demo = Demo(cp)
        say("registering a simulated GPU node (2 x nvidia.com/gpu) and starting the operator")
        with NodeSimulator(cp.kubeconfig, nodes=1, gpus_per_node=2, backoff_base=2.0,
                           name_prefix="demo-gpu-node"), \
                OperatorProcess(cp.kubeconfig, "--standalone") as operator:
            demo.kubectl("get", "nodes", "-o", "custom-columns=NAME:.metadata.name,"
                         "GPUS:.status.allocatable.nvidia\\.com/gpu,READY:.status.conditions[-1]"
                         ".status")
            provide_model_cache_volume(demo)
            say(f"applying {EXAMPLE.relative_to(ROOT)}")
            demo.kubectl("apply", "-f", str(EXAMPLE))
            say("waiting for the VLMDeployment to become Ready")
            demo.wait("Ready", demo.ready, timeout=180)
            demo.kubectl("get", "vlmd")
            demo.kubectl("get", "deployment,service,pdb,pods", "-l",
                         f"app.kubernetes.io/instance={NAME}")
            pod = demo.pod()
            say(f"killing the engine of pod {pod['metadata']['name']} (EngineDeadError; the "
                "process exits 5 s later with code 0, as vLLM's API server does)")
            url = f"http://{pod['status']['podIP']}:8000/sim/fault"
            request = urllib.request.Request(url, data=json.dumps(
                {"fault": "engine_dead", "exit_code": 0}).encode(), method="POST",
                headers={"Content-Type": "application/json"})
            killed = time.time()
            urllib.request.urlopen(request, timeout=5).read()
            demo.wait("the operator's fence", lambda: demo.told(pod, "PodFenced"), timeout=60)
            say(f"the operator fenced the pod (out of the Service; its PodFenced Event, seen "
                f"{time.time() - killed:.1f} s after the engine died by this demo's 2-second "
                "poll; the liveness probe alone takes up to 60 s); the kubelet restarts its "
                "container in place, keeping the pod, its node and its caches")
            demo.wait("the in-place recovery", lambda: demo.told(pod, "PodRecoveredInPlace"),
                      timeout=180)
            say(f"recovered in place {time.time() - killed:.1f} s after the engine died: the "
                "same pod, its container restarted once, back in the Service")
            demo.kubectl("get", "pods", "-l", f"app.kubernetes.io/instance={NAME}")
            demo.wait("Ready again", demo.ready, timeout=120)
            say("what the operator recorded")
            demo.kubectl("get", "events", "--sort-by=.lastTimestamp", "-o",
                         "custom-columns=TYPE:.type,REASON:.reason,OBJECT:.involvedObject.name,"
                         "MESSAGE:.message")
            demo.kubectl("get", "vlmd")
            if keep:
                say("the demo keeps running; in another shell:")
                print(f"export KUBECONFIG={cp.kubeconfig}\nkubectl get vlmd,pods\n"
                      f"operator log: {operator.log_path}\nCtrl-C stops everything.", flush=True)
                try:
                    while True:
                        time.sleep(3600)
                except KeyboardInterrupt:
                    pass
    say("stopped the operator, the simulated node and the control plane")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vlm-operator-demo", description=__doc__.split("\n")[0])
    parser.add_argument("--keep", action="store_true",
                        help="keep everything running at the end and print the KUBECONFIG")
    return run(parser.parse_args(argv).keep)


if __name__ == "__main__":
    sys.exit(main())
