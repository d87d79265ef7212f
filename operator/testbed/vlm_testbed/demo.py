"""The local demo: a real control plane, a real GPU node, the operator installed by its chart, and
the example.

`python -m vlm_testbed.demo [--keep] [--simulated]`: builds Kubernetes and the kubelet the first
time (about 15 minutes), builds the project's images (images/, by buildah) into a local
registry, starts a real node (a kubelet on its own containerd and runc, two stand-in GPUs from a
device plugin), installs charts/vlm-operator (the operator runs as a pod of the built image),
then shows the example VLMDeployment becoming Ready, kills its engine, and shows what the
operator and the kubelet did. vLLM is a stand-in process with vLLM's HTTP surface and log lines
(the built vLLM image, plugin included). A real node needs root and what
hack/install-deps.sh installs; `--simulated` keeps the node simulator (no container runtime: the
operator runs as a local process).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import yaml

from vlm_operator.api import crd
from vlm_testbed import chart
from vlm_testbed.controlplane import ControlPlane, build
from vlm_testbed.nodesim import NodeSimulator
from vlm_testbed.operator_process import OperatorProcess

ROOT = Path(__file__).resolve().parents[3]  # the repository (operator/testbed/vlm_testbed/)
EXAMPLE = ROOT / "manifests/examples/qwen3-vl-4b.yaml"
NAME = "qwen3-vl-4b"
FITTED_RESOURCES = {"requests": {"cpu": "250m", "memory": "512Mi"}}


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


MODEL_CACHE_DIR = Path("/tmp/vlm-demo-models")


def provide_model_cache_volume(demo: Demo) -> None:
    """The example asks for a 50Gi PVC; with no storage provisioner, offer a hostPath volume.
    The kubelet applies no fsGroup to a hostPath: the directory is made writable by the pod's
    non-root user here (as an admin prepares such a volume)."""
    MODEL_CACHE_DIR.mkdir(exist_ok=True)
    MODEL_CACHE_DIR.chmod(0o1777)
    volume = {"apiVersion": "v1", "kind": "PersistentVolume",
              "metadata": {"name": "demo-model-cache"},
              "spec": {"capacity": {"storage": "100Gi"}, "accessModes": ["ReadWriteOnce"],
                       "hostPath": {"path": str(MODEL_CACHE_DIR)},
                       "persistentVolumeReclaimPolicy": "Delete"}}
    subprocess.run([str(demo.cp.kubectl), "--kubeconfig", str(demo.cp.kubeconfig), "apply",
                    "-f", "-"], input=json.dumps(volume), text=True, check=True,
                   capture_output=True)


@contextlib.contextmanager
def simulated_cluster() -> Iterator[tuple[ControlPlane, str]]:
    """A control plane, a simulated GPU node and the operator as a local process; yields the
    control plane and where the operator's log is."""
    say("building Kubernetes v1.20.2 from Debian's source (first run only, ~10 minutes)")
    build()
    say("starting etcd, kube-apiserver, kube-controller-manager, kube-scheduler on loopback")
    with ControlPlane(crd.get_all_crds()) as cp:
        say("registering a simulated GPU node (2 x nvidia.com/gpu) and starting the operator")
        with NodeSimulator(cp.kubeconfig, nodes=1, gpus_per_node=2, backoff_base=2.0,
                           name_prefix="demo-gpu-node"), \
                OperatorProcess(cp.kubeconfig, "--standalone") as operator:
            yield cp, str(operator.log_path)


@contextlib.contextmanager
def real_cluster() -> Iterator[tuple[ControlPlane, str]]:
    """A control plane, a real node pulling the built images from the local registry, and the
    operator installed by its chart; yields the control plane and how to read the operator's
    log."""
    from vlm_testbed.realnode import OPERATOR_IMAGE, LocalRegistry, RealNode, build_images
    from vlm_testbed.realnode.config import host_address

    if os.geteuid() != 0:
        raise SystemExit("demo: a real node needs root (or run with --simulated)")
    say("building Kubernetes v1.20.2 and the kubelet from Debian's source (first run only, "
        "~15 minutes)")
    build(node=True)
    with LocalRegistry() as registry:
        say(f"building images/operator/Dockerfile and images/vllm/Dockerfile with buildah; "
            f"pushing them to a local registry at {registry.address}")
        build_images(registry)
        say("starting etcd, kube-apiserver, kube-controller-manager, kube-scheduler")
        with ControlPlane(crd.get_all_crds(), pod_address=host_address()) as cp:
            say("starting a real node: a kubelet on its own containerd and runc, 2 stand-in "
                "GPUs from a device plugin")
            with RealNode(cp, registry=registry.address, gpus=2, name="demo-gpu-node"):
                repository, tag = OPERATOR_IMAGE.rsplit(":", 1)
                say("helm install vlm-operator charts/vlm-operator -n vlm-system (the operator "
                    "runs as a pod of the built image)")
                subprocess.run([str(cp.kubectl), "--kubeconfig", str(cp.kubeconfig), "create",
                                "namespace", "vlm-system"], check=True, capture_output=True)
                took = chart.install(cp.kubeconfig, "vlm-operator", "vlm-system", {
                    "image": {"repository": repository, "tag": tag},
                    "extraEnv": [{"name": k, "value": v}
                                 for k, v in cp.in_cluster_env().items()]})
                print(f"installed and running in {took:.0f} s", flush=True)
                yield cp, "kubectl -n vlm-system logs deploy/vlm-operator"


def run(keep: bool, simulated: bool) -> int:
    with (simulated_cluster() if simulated else real_cluster()) as (cp, operator_log):
        demo = Demo(cp)
        demo.kubectl("get", "nodes", "-o", "custom-columns=NAME:.metadata.name,"
                     "GPUS:.status.allocatable.nvidia\\.com/gpu,READY:.status.conditions[-1]"
                     ".status")
        if not simulated:
            demo.kubectl("-n", "vlm-system", "get", "pods", "-o", "wide")
        provide_model_cache_volume(demo)
        say(f"applying {EXAMPLE.relative_to(ROOT)}")
        if simulated:
            demo.kubectl("apply", "-f", str(EXAMPLE))
        else:  # a GPU server's CPU and memory requests fit no laptop: this machine's share
            example = yaml.safe_load(EXAMPLE.read_text())
            example["spec"]["resources"] = FITTED_RESOURCES
            print(f"(spec.resources set to {FITTED_RESOURCES} to fit this machine)")
            fitted = Path(cp.kubeconfig).parent / EXAMPLE.name
            fitted.write_text(yaml.safe_dump(example))
            demo.kubectl("apply", "-f", str(fitted))
        say("waiting for the VLMDeployment to become Ready")
        demo.wait("Ready", demo.ready, timeout=240)
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
        say("what the operator and the kubelet recorded")
        demo.kubectl("get", "events", "--sort-by=.lastTimestamp", "-o",
                     "custom-columns=TYPE:.type,REASON:.reason,FROM:.source.component,"
                     "OBJECT:.involvedObject.name,MESSAGE:.message")
        demo.kubectl("get", "vlmd")
        if keep:
            say("the demo keeps running; in another shell:")
            print(f"export KUBECONFIG={cp.kubeconfig}\nkubectl get vlmd,pods\n"
                  f"operator log: {operator_log}\nCtrl-C stops everything.", flush=True)
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
    say("stopped everything the demo started")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vlm-operator-demo", description=__doc__.split("\n")[0])
    parser.add_argument("--keep", action="store_true",
                        help="keep everything running at the end and print the KUBECONFIG")
    parser.add_argument("--simulated", action="store_true",
                        help="the node simulator instead of a real node (no root or container "
                             "runtime needed; the operator runs as a local process)")
    args = parser.parse_args(argv)
    return run(args.keep, args.simulated)


if __name__ == "__main__":
    sys.exit(main())
