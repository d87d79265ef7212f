"""`kubectl drain` on real nodes: the default spec (1 replica, minAvailable 1) on two real
kubelets of one GPU each. The PodDisruptionBudget refuses the drain's eviction while the only
replica serves; the operator starts a replacement on the other node first (pulled there by its
kubelet), and once it serves the eviction goes through: the drain finishes, the old pod's
preStop hook runs in its container (no FailedPreStopHook), there is no moment without a Ready
replica, and one pod is left, on the other node."""

from __future__ import annotations

import subprocess
import time
import uuid

from kubernetes import client

from vlm_operator.api import crd
from vlm_testbed.controlplane import ready_namespace
from vlm_testbed.realnode import real_nodes
from vlm_testbed.realnode.pods import is_ready, wait_for

LABEL = "vlm-testbed/drain-pair"


def test_kubectl_drain_moves_the_only_replica_to_the_other_real_node_without_a_gap(
        control_plane, api, registry, operator):
    v1 = client.CoreV1Api(api)
    custom = client.CustomObjectsApi(api)
    ns = ready_namespace(api, f"realnode-drain-{uuid.uuid4().hex[:6]}")
    pair = uuid.uuid4().hex[:6]
    try:
        with real_nodes(control_plane, 2, registry=registry.address, gpus=1,
                        labels={LABEL: pair}) as nodes:
            custom.create_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL, {
                "apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "d"},
                "spec": {"model": "Qwen/Qwen2-VL-2B-Instruct",
                         "scheduling": {"nodeSelector": {LABEL: pair}},
                         "vllm": {"env": [{"name": "VLM_SIM_STARTUP_SECONDS", "value": "0"}]}}})
            first = wait_for("the only replica Ready", lambda: next(
                (p for p in v1.list_namespaced_pod(ns).items if is_ready(p)), None), 180, 0.5)
            source = first.spec.node_name
            target = next(n.name for n in nodes if n.name != source)
            ready_counts: list[int] = []
            t0 = time.monotonic()
            drain = subprocess.Popen(
                [str(control_plane.kubectl), "--kubeconfig", str(control_plane.kubeconfig),
                 "drain", source, "--ignore-daemonsets", "--delete-emptydir-data",
                 "--timeout=240s"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True)
            try:
                while drain.poll() is None and time.monotonic() - t0 < 260:
                    ready_counts.append(sum(1 for p in v1.list_namespaced_pod(ns).items
                                            if is_ready(p)))
                    time.sleep(0.3)
            finally:
                if drain.poll() is None:
                    drain.kill()
            output = drain.communicate()[0]
            print(f"kubectl drain {source}: {time.monotonic() - t0:.1f} s\n{output[-800:]}")
            assert drain.returncode == 0, output
            assert min(ready_counts) >= 1, ready_counts  # never without a serving replica
            # the evicted pod's ReplicaSet may make one more, Pending (no GPU free), until the
            # operator's replacement takes its place in the Deployment
            pods = wait_for("one pod, on the other node", lambda: (ps := [
                p for p in v1.list_namespaced_pod(ns).items
                if p.metadata.deletion_timestamp is None]) and [
                p.spec.node_name for p in ps] == [target] and ps, 120, 0.5)
            assert first.metadata.name not in {p.metadata.name for p in pods}
            events = v1.list_namespaced_event(ns).items
            assert not [e for e in events if e.reason == "FailedPreStopHook"]
            replacement = pods[0].metadata.name
            pulled = [e.message for e in events if e.reason == "Pulled"
                      and e.involved_object.name == replacement]
            print("replacement's pull on the other node:", pulled)
            assert pulled
    finally:
        v1.delete_namespace(ns)
