"""Log following against the real control plane: what a pod's log, its logging settings and
its node can do to the operator's followers (pods run by the node simulator with the vLLM
stand-in; faults via POST /sim/fault)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from kube_helpers import (
    condition,
    cr,
    create,
    events,
    get_cr,
    health,
    make_namespace,
    managed_pods,
    metric,
    pod_gone,
    sim_post,
    wait_for,
    wait_last_remediation,
    wait_ready_pods,
)
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from vlm_operator.desired import children
from vlm_testbed.nodesim import NodeSimulator
from vlm_testbed.operator_process import OperatorProcess

KEEP_ALIVE = {"name": "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "value": "1"}


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def by_operator(event) -> bool:
    """An Event the operator posted (the simulated kubelet posts its own on pods)."""
    return event.reporting_component == "vlm-operator" or (
        event.source is not None and event.source.component == "vlm-operator")


def test_a_logging_prefix_in_the_spec_keeps_detection_on(api, ns, sim):
    """VLLM_LOGGING_PREFIX in spec.vllm.env: the followers read the pod's prefix, so a retry
    storm written behind it is still acted on (without it no line had a header)."""
    create(api, ns, cr("prefixed", replicas=1, health=health(), vllm={"env": [
        {"name": "VLLM_LOGGING_PREFIX", "value": "[vllm] "}]}))
    (pod,) = wait_ready_pods(api, ns, "prefixed", 1)
    sim_post(pod.status.pod_ip, "/sim/fault", {"fault": "tokenizer_retry", "rate": 20,
                                               "count": 3})
    wait_for("the storm acted on", lambda: pod_gone(api, ns, pod), timeout=30)
    last = wait_last_remediation(api, ns, "prefixed", pod.metadata.name)
    assert (last["pod"], last["signature"]) == (pod.metadata.name, "tokenizer_retry")


def test_a_refused_previous_log_is_reported_and_the_new_container_followed(api, ns, sim,
                                                                           operator):
    """A node restart that lost the runtime's record of the container: its lastState is
    ContainerStatusUnknown without a containerID and `previous=true` answers 400. The follower
    skips it (an Event, a metric) and follows the new container, whose engine death is then
    acted on (the engine stays alive: only the log can tell)."""
    before = metric(operator.metrics(), "vlm_operator_log_previous_unreadable_total")
    create(api, ns, cr("lost", replicas=1, health=health(), vllm={"env": [KEEP_ALIVE]}))
    (pod,) = wait_ready_pods(api, ns, "lost", 1)
    name = pod.metadata.name
    sim.lose_container(ns, name, children.CONTAINER)
    core = client.CoreV1Api(api)

    def restarted():
        p = core.read_namespaced_pod(name, ns)
        (cs,) = p.status.container_statuses
        return cs.restart_count == 1 and cs.state.running and cs.ready and p

    pod = wait_for("the container running again", restarted, timeout=60)
    (cs,) = pod.status.container_statuses
    lost = cs.last_state.terminated
    assert (lost.reason, lost.exit_code, lost.container_id) == ("ContainerStatusUnknown", 137,
                                                               None)
    with pytest.raises(ApiException) as refused:  # what the follower gets, through the apiserver
        core.read_namespaced_pod_log(name, ns, container=children.CONTAINER, previous=True)
    assert refused.value.status == 400
    event = wait_for("the Event", lambda: events(api, ns, name, "PreviousLogUnavailable"),
                     timeout=30)[0]
    assert event.type == "Warning" and "400" in event.message
    assert wait_for("the Event on the VLMDeployment",
                    lambda: events(api, ns, "lost", "PreviousLogUnavailable"))
    assert metric(operator.metrics(), "vlm_operator_log_previous_unreadable_total") == before + 1
    sim_post(pod.status.pod_ip, "/sim/fault", {"fault": "engine_dead"})
    wait_for("the engine death acted on", lambda: pod_gone(api, ns, pod), timeout=30)
    last = wait_last_remediation(api, ns, "lost", name)
    assert (last["pod"], last["signature"], last["action"]) == (name, "engine_dead", "Restart")


def test_pods_that_are_not_running_cost_no_polling(api, cluster):
    """Pending pods (no node with a GPU here): their followers waited by GETting the pod twice
    a second each, for ever. Now they wait for the pods' watch events. An operator of its own,
    so that no other test's objects add requests."""
    ns = make_namespace(api, "e2e-pending-")
    try:
        with OperatorProcess(cluster.kubeconfig, "--standalone", "-n", ns) as op:
            create(api, ns, cr("pending", replicas=4, health=health()))
            wait_for("4 pending pods", lambda: len(managed_pods(api, ns, "pending")) == 4,
                     timeout=60)
            wait_for("the status written", lambda: (c := condition(get_cr(api, ns, "pending"),
                                                                   "Ready")) and c, timeout=30)
            time.sleep(3)  # the pods' first events and the status they cause settle
            before = metric(op.metrics(), "vlm_operator_api_requests_total", verb="GET")
            time.sleep(6)  # 4 pods polled twice a second: 48 GETs
            after = metric(op.metrics(), "vlm_operator_api_requests_total", verb="GET")
        assert after - before < 8, f"{after - before} GETs in 6 s with 4 Pending pods"
    finally:
        client.CoreV1Api(api).delete_namespace(ns)


def test_a_hostile_log_costs_bounded_memory_and_no_traceback_per_line(api, ns, sim, operator):
    """A tenant's image floods its log with 300,000 distinct process tags (state per tag and
    every line of a second were kept: 75 MiB more here) and writes engine-failure lines with
    5,000-digit pids
    (each raised ValueError and logged a traceback). Memory stays flat, nothing is logged per
    line, nothing is acted on, and the pod's later engine death still is."""
    create(api, ns, cr("hostile", replicas=1, health=health(), vllm={"env": [KEEP_ALIVE]}))
    (pod,) = wait_ready_pods(api, ns, "hostile", 1)
    def lines_read():  # scanned, or skipped over the pod's log budget (logs/budget.py)
        text = operator.metrics()
        return (metric(text, "vlm_operator_log_lines_total")
                + metric(text, "vlm_operator_log_lines_throttled_total",
                         vlmdeployment_namespace=ns))

    log_before = len(operator.log())
    lines_before = lines_read()
    rss_before = rss_kib(operator.proc.pid)
    sim_post(pod.status.pod_ip, "/sim/fault", [
        {"fault": "giant_pid", "lines": 500, "digits": 5000},
        {"fault": "proc_flood", "lines": 300_000}])
    wait_for("the flood read", lambda: lines_read() - lines_before >= 300_500, timeout=180,
             interval=1)
    grown_mib = (rss_kib(operator.proc.pid) - rss_before) / 1024
    assert grown_mib < 10, f"the operator grew by {grown_mib:.0f} MiB"
    new_log = operator.log()[log_before:]
    assert "Traceback" not in new_log and "Exceeds the limit" not in new_log
    assert not pod_gone(api, ns, pod)  # a line with no valid header is no engine death
    sim_post(pod.status.pod_ip, "/sim/fault", {"fault": "engine_dead"})
    wait_for("the engine death acted on", lambda: pod_gone(api, ns, pod), timeout=30)


def test_a_restarted_operator_resumes_from_the_mark_not_the_log_start(api, cluster):
    """A fresh operator re-read every followed pod's whole log (a pod that floods its log
    made each restart replay all of it). With the resume mark it reads what follows the mark
    and the last log window (5 s here), and still acts on what comes next."""
    from vlm_operator.logs.marks import parse_mark

    ns = make_namespace(api, "e2e-mark-")
    args = ("--standalone", "-n", ns, "--log-mark-seconds", "1")
    windows = {"tokenizerRetry": {"threshold": 3, "windowSeconds": 5, "action": "Restart"},
               "engineDead": {"windowSeconds": 5}, "gpuError": {"windowSeconds": 5}}
    try:
        with NodeSimulator(cluster.kubeconfig, nodes=1, gpus_per_node=2, backoff_base=1.0,
                           name_prefix=f"sim-{ns}"):
            with OperatorProcess(cluster.kubeconfig, *args) as first:
                create(api, ns, cr("mark", replicas=1, health=health(**windows)))
                (pod,) = wait_ready_pods(api, ns, "mark", 1)
                sim_post(pod.status.pod_ip, "/sim/fault", {"fault": "proc_flood",
                                                           "lines": 20_000})
                wait_for("the flood read", lambda: metric(
                    first.metrics(), "vlm_operator_log_lines_total") >= 20_000, timeout=60)
                core = client.CoreV1Api(api)
                # a mark resumes at the start of its line's second (the kubelet's sinceTime
                # has whole seconds): wait for one from a second after the flood's last, which
                # the pod's periodic lines (stats, heartbeat) bring, so the whole flood is
                # behind it however fast the machine wrote it
                after_flood_ns = (int(time.time()) + 1) * 1_000_000_000

                def marked():
                    annotations = core.read_namespaced_pod(pod.metadata.name, ns).metadata \
                        .annotations or {}
                    mark = parse_mark(annotations)
                    return mark is not None and mark.ns >= after_flood_ns and mark

                mark = wait_for("a resume mark after the flood", marked, timeout=40)
                assert mark.plugin == "active" and mark.readable
                first.proc.kill()
                first.proc.wait(30)
            time.sleep(6)  # past the 5 s windows: nothing of the flood needs a replay
            with OperatorProcess(cluster.kubeconfig, *args) as second:
                sim_post(pod.status.pod_ip, "/sim/fault", {"fault": "tokenizer_retry",
                                                           "rate": 20, "count": 3})
                wait_for("the storm acted on", lambda: pod_gone(api, ns, pod), timeout=30)
                lines = metric(second.metrics(), "vlm_operator_log_lines_total")
                assert lines < 1000, f"the restarted operator re-read {lines:.0f} lines"
    finally:
        client.CoreV1Api(api).delete_namespace(ns)


def test_a_foreign_pod_labelled_as_a_vlmdeployments_is_never_followed_nor_written(api, ns,
                                                                                    sim):
    """A tenant's own pod (a shell, no owner), labelled as the VLMDeployment `victim`'s pods
    are and carrying 250 KB of annotations, forges the plugin's `inactive` line and an engine
    death in its log. It got a follower, `Unpatched` Events on itself and on `victim` and
    `victim`'s Unpatched condition. Now nothing is written for it, and `victim`'s own pod is
    still followed and acted on: its engine death, sent after the foreign pod ran, is."""
    from vlm_testbed.vllmsim import plugin_line, vllm_line

    create(api, ns, cr("victim", replicas=1, health=health(), vllm={"env": [KEEP_ALIVE]}))
    (own,) = wait_ready_pods(api, ns, "victim", 1)
    forged = [plugin_line("0.32.0", "APIServer", 1, {"VLM_TOKENIZER_POOL_SIZE": "4",
                                                     "VLM_SIM_PATCHED": "inactive"}),
              vllm_line("EngineCore", 7, "ERROR", "core.py:866",
                        "EngineCore encountered a fatal error.")]
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(ns, {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "intruder", "labels": children.get_labels("victim"),
                     "annotations": {"tenant.example/blob": "x" * 250_000}},
        "spec": {"nodeName": sim.node_names[0], "containers": [{
            "name": children.CONTAINER, "image": "busybox",
            "command": ["sh", "-c", 'printf "%s\\n" "$0" "$1"; exec sleep 3600', *forged]}]}})
    wait_for("the intruder running", lambda: core.read_namespaced_pod("intruder", ns)
             .status.phase == "Running" and "fatal error" in core.read_namespaced_pod_log(
                 "intruder", ns, container=children.CONTAINER), timeout=60)
    sim_post(own.status.pod_ip, "/sim/fault", {"fault": "engine_dead"})
    wait_for("victim's own engine death acted on", lambda: pod_gone(api, ns, own), timeout=30)
    last = wait_last_remediation(api, ns, "victim", own.metadata.name)
    assert (last["pod"], last["signature"]) == (own.metadata.name, "engine_dead")
    assert [e.reason for e in events(api, ns, "intruder") if by_operator(e)] == []
    assert not any("intruder" in (e.message or "") for e in events(api, ns, "victim"))
    unpatched = condition(get_cr(api, ns, "victim"), "Unpatched")
    assert not unpatched or unpatched["status"] != "True"
    intruder = core.read_namespaced_pod("intruder", ns)
    assert intruder.metadata.deletion_timestamp is None
    assert set(intruder.metadata.annotations) == {"tenant.example/blob"}  # no log mark
