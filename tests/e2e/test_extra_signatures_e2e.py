"""spec.health.extraSignatures on the real control plane: a signature of the user's own restarts
a pod when vLLM logs it, never when a prompt carries the same text, and a spec change takes
effect on pods already being followed."""

from __future__ import annotations

import time

from kube_helpers import (
    condition,
    cr,
    create,
    events,
    get_cr,
    patch_cr,
    pod_gone,
    sim_post,
    wait_for,
    wait_ready_pods,
)

OOM = "CUDA out of memory. Tried to allocate 2.00 GiB"


def health(extra):
    return {"extraSignatures": extra, "maxRestartsPerHour": 20, "minAvailable": 1}


def vllm_line(level, file, message):
    return f"(APIServer pid=7) {level} 11-29 09:00:00 [{file}:42] {message}"


def test_own_signature_restarts_and_prompts_cannot_trigger_it(api, ns, sim, operator):
    create(api, ns, cr("extra", replicas=2, health=health(
        [{"name": "cuda_oom", "regex": "CUDA out of memory", "levels": ["ERROR"]}])))
    a, b = wait_ready_pods(api, ns, "extra", 2)
    # A user's prompt echoed by vLLM's request logger, and the same text at the wrong level.
    sim_post(a.status.pod_ip, "/sim/log", {"lines": [
        vllm_line("INFO", "logger.py", f"Received request chatcmpl-1: prompt: '{OOM}\\n', "
                                       "params: SamplingParams(n=1)"),
        vllm_line("WARNING", "worker.py", OOM),
    ]})
    time.sleep(5)
    assert not pod_gone(api, ns, a)
    sim_post(b.status.pod_ip, "/sim/log", {"lines": [vllm_line("ERROR", "worker.py", OOM)]})
    wait_for("the pod that logged it restarted", lambda: pod_gone(api, ns, b), timeout=30)
    last = wait_for("lastRemediation", lambda: get_cr(api, ns, "extra").get("status", {}).get(
        "lastRemediation"))
    assert (last["pod"], last["signature"], last["action"]) == (b.metadata.name, "cuda_oom",
                                                                 "Restart")
    assert not pod_gone(api, ns, a)
    assert wait_for("Event", lambda: events(api, ns, "extra", "PodRestarted"))


def test_signature_added_later_applies_to_followed_pods(api, ns, sim, operator):
    create(api, ns, cr("later", replicas=2, health=health([])))
    a, _ = wait_ready_pods(api, ns, "later", 2)
    line = vllm_line("ERROR", "core.py", "NCCL error: unhandled system error")
    sim_post(a.status.pod_ip, "/sim/log", {"lines": [line]})
    time.sleep(3)
    assert not pod_gone(api, ns, a)  # not a signature yet
    patch_cr(api, ns, "later", {"health": health([
        {"name": "nccl_error", "regex": "NCCL error", "threshold": 1}])})
    time.sleep(3)  # the operator takes the new spec
    sim_post(a.status.pod_ip, "/sim/log", {"lines": [line]})
    wait_for("restarted on the new signature", lambda: pod_gone(api, ns, a), timeout=30)


def test_backtracking_pattern_neither_stalls_the_operator_nor_passes_bad_syntax(
        api, ns, sim, operator):
    """`abc(?:x|x)+y` took Python's re hours on one 8 KiB line while holding the GIL; on RE2 the
    same pattern and line cost microseconds, so the operator still acts on the next line. A
    pattern RE2 refuses is reported on the object, naming the field."""
    create(api, ns, cr("regex", replicas=2, health=health(
        [{"name": "pathological", "regex": "abc(?:x|x)+y", "levels": ["ERROR"]}])))
    pod, _ = wait_ready_pods(api, ns, "regex", 2)
    sim_post(pod.status.pod_ip, "/sim/log", {"lines": [
        vllm_line("ERROR", "worker.py", "abc" + "x" * 8192),  # no match, adversarially
        vllm_line("ERROR", "worker.py", "abcxxxy"),
    ]})
    wait_for("restarted on the line after the adversarial one", lambda: pod_gone(api, ns, pod),
             timeout=30)
    last = wait_for("lastRemediation", lambda: get_cr(api, ns, "regex").get("status", {}).get(
        "lastRemediation"))
    assert last["signature"] == "pathological"

    create(api, ns, cr("lookahead", health=health(
        [{"name": "oom", "regex": "CUDA(?= out of memory)", "levels": ["ERROR"]}])))
    spec_valid = wait_for("SpecValid", lambda: condition(get_cr(api, ns, "lookahead"),
                                                         "SpecValid"))
    assert spec_valid["status"] == "False"
    assert spec_valid["message"].startswith(
        "spec.health.extraSignatures[0].regex: invalid regular expression for RE2 (invalid "
        "perl operator: (?=)")
