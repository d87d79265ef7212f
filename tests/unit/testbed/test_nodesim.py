"""Pure decisions of the node simulator (the cluster-facing part is in tests/e2e)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

from vlm_testbed.nodesim.logserver import format_log_line, render_log_lines
from vlm_testbed.nodesim.processes import (
    Container,
    default_command,
    run_pre_stop,
    stop_process_group,
)
from vlm_testbed.nodesim.state import (
    MIN_GRACE_S,
    ContainerView,
    backoff_delay,
    exit_code_of,
    parse_rfc3339_ns,
    pod_phase,
    resolve_env,
    rfc3339nano,
    should_restart,
)

from ..waiting import wait_until


def test_rfc3339nano_trims_like_go():
    assert rfc3339nano(1_700_000_000_123_400_000) == "2023-11-14T22:13:20.1234Z"
    assert rfc3339nano(1_700_000_000_000_000_000) == "2023-11-14T22:13:20Z"
    assert parse_rfc3339_ns("2023-11-14T22:13:20.1234Z") == 1_700_000_000_123_400_000
    assert parse_rfc3339_ns("2023-11-14T23:13:20+01:00") == 1_700_000_000_000_000_000


def test_backoff_is_immediate_then_doubles_and_caps():
    assert [backoff_delay(n, 10, 300) for n in range(1, 8)] == [0, 10, 20, 40, 80, 160, 300]


def test_restart_policy():
    assert should_restart("Always", 0) and should_restart("OnFailure", 1)
    assert not should_restart("OnFailure", 0) and not should_restart("Never", 1)
    assert should_restart("Always", 1, init=True) and not should_restart("Always", 0, init=True)
    assert exit_code_of(-15) == 143 and exit_code_of(3) == 3


def test_vllm_image_runs_the_simulator_on_the_pod_ip():
    c = {"image": "vllm/vllm-openai:v0.11.0", "command": ["vllm", "serve"],
         "args": ["org/m", "--port", "8000"]}
    assert default_command(c, "127.1.2.3") == [
        sys.executable, "-m", "vlm_testbed.vllmsim", "org/m", "--port", "8000",
        "--host", "127.1.2.3"]
    assert default_command({"image": "busybox", "command": ["sh", "-c", "exit 3"]}, "x") == [
        "sh", "-c", "exit 3"]
    assert default_command({"image": "nginx"}, "x")[0] == sys.executable


def test_resolve_env_sources():
    pod = {"metadata": {"name": "p", "namespace": "ns", "labels": {"app": "a"}},
           "spec": {"nodeName": "n"}}
    store = {("secret", "s"): {"token": "t0k"}, ("configmap", "c"): {"A": "1", "B": "2"}}

    def lookup(kind, name, key):
        data = store.get((kind, name))
        return data if key is None or data is None else data.get(key)

    container = {"envFrom": [{"configMapRef": {"name": "c"}, "prefix": "X_"}], "env": [
        {"name": "PLAIN", "value": "v"},
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}},
        {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
        {"name": "MISSING", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k"}}},
        {"name": "BOTH", "value": "$(PLAIN)-$(IP)"}]}
    env = resolve_env(pod, container, "127.1.0.2", lookup)
    assert env == {"X_A": "1", "X_B": "2", "PLAIN": "v", "TOKEN": "t0k", "IP": "127.1.0.2",
                   "APP": "a", "BOTH": "v-127.1.0.2"}


def test_render_log_lines_since_tail_timestamps():
    base = 1_700_000_000_000_000_000
    stored = [format_log_line(base + i * 1_000_000_000, "stdout", f"line {i}") for i in range(5)]
    assert render_log_lines(stored, None, None, False) == [f"line {i}\n" for i in range(5)]
    assert render_log_lines(stored, base + 3_000_000_000, None, False) == ["line 3\n", "line 4\n"]
    assert render_log_lines(stored, None, 2, True) == [
        "2023-11-14T22:13:23Z line 3\n", "2023-11-14T22:13:24Z line 4\n"]
    assert render_log_lines(stored, None, 0, False) == []


def test_pod_phase():
    def v(**kw):
        base = {"ever_started": True, "running": True, "will_restart": True, "last_exit": None,
                "failed_for_good": False}
        return ContainerView(**{**base, **kw})

    assert pod_phase("Always", True, [v(ever_started=False, running=False)]) == "Pending"
    assert pod_phase("Always", False, [v()]) == "Pending"
    assert pod_phase("Always", True, [v(running=False, last_exit=1)]) == "Running"
    done = {"running": False, "will_restart": False}
    assert pod_phase("Never", True, [v(**done, last_exit=0)]) == "Succeeded"
    assert pod_phase("Never", True, [v(**done, last_exit=2, failed_for_good=True)]) == "Failed"


# -- termination as the kubelet does it: the preStop hook within the grace period, SIGTERM with
# what is left of it (at least MIN_GRACE_S), then SIGKILL

CONTAINER = """
import signal, sys, time
log = open(sys.argv[1], "a")
def term(*_):
    log.write("%.2f term\\n" % time.monotonic()); log.flush()
    if sys.argv[2] == "exit":
        sys.exit(0)
signal.signal(signal.SIGTERM, term)
while True:
    time.sleep(0.05)
"""


def container(tmp_path, on_term="exit"):
    log = tmp_path / "events"
    proc = subprocess.Popen([sys.executable, "-c", CONTAINER, str(log), on_term],
                            start_new_session=True)
    done = threading.Event()
    threading.Thread(target=lambda: (proc.wait(), done.set()), daemon=True).start()
    time.sleep(0.3)  # its SIGTERM handler is in place
    return proc, done, log


def hook(seconds, log):
    code = (f"import time; time.sleep({seconds}); "
            f"open({str(log)!r}, 'a').write('%.2f hook\\n' % time.monotonic())")
    return {"exec": {"command": [sys.executable, "-c", code]}}


def events(log):
    return [line.split()[1] for line in log.read_text().splitlines()]


def test_the_pre_stop_hook_finishes_before_sigterm(tmp_path):
    proc, done, log = container(tmp_path)
    stop_process_group(proc.pid, done, 10, lambda timeout: run_pre_stop(
        hook(1, log), timeout, cwd=tmp_path, env=dict(os.environ), host="127.0.0.1",
        container={}))
    assert done.is_set() and events(log) == ["hook", "term"]
    assert proc.returncode == 0


def test_a_hook_that_outlasts_the_grace_period_is_cut_and_sigterm_still_comes(tmp_path):
    proc, done, log = container(tmp_path, on_term="ignore")
    started = time.monotonic()
    failed = []
    stop_process_group(proc.pid, done, 1, lambda timeout: failed.append(run_pre_stop(
        hook(30, log), timeout, cwd=tmp_path, env=dict(os.environ), host="127.0.0.1",
        container={})))
    took = time.monotonic() - started
    # the hook had its second, the process MIN_GRACE_S after SIGTERM, then SIGKILL
    assert events(log) == ["term"] and proc.returncode == -9
    assert 1 + MIN_GRACE_S <= took < 1 + MIN_GRACE_S + 5
    assert failed and "did not finish" in failed[0]


def test_no_hook_sigterm_then_sigkill_after_the_grace(tmp_path):
    proc, done, log = container(tmp_path, on_term="ignore")
    stop_process_group(proc.pid, done, 3)
    assert events(log) == ["term"] and proc.returncode == -9


def test_a_failing_hook_is_reported(tmp_path):
    assert "exited with 3" in run_pre_stop(
        {"exec": {"command": [sys.executable, "-c", "raise SystemExit(3)"]}}, 5, cwd=tmp_path,
        env=dict(os.environ), host="127.0.0.1", container={})
    assert run_pre_stop({"tcpSocket": {"port": 1}}, 1, cwd=tmp_path, env={}, host="x",
                        container={}).startswith("no handler")


def test_a_restart_counts_only_with_the_new_container_and_the_old_one_becomes_last_state(
        tmp_path):
    # between an exit and the next start the kubelet reports the exited container as the
    # current state; restartCount goes up with the new container, never before it (a status
    # with the new count and the old container's start makes a line the old one logged look
    # like the new one's)
    starting, go_on = threading.Event(), threading.Event()

    class Images:
        calls = 0

        def ensure(self, container):
            self.calls += 1
            if self.calls == 2:  # the restart: hold it before the next container starts
                starting.set()
                go_on.wait(10)
            return True

    sim = SimpleNamespace(backoff_base=30.0, backoff_cap=300.0, images=Images(),
                          command_for=lambda spec, ip: ["sh", "-c", "exit 1"])
    pod = SimpleNamespace(dir=tmp_path, spec={"restartPolicy": "Always"}, sim=sim,
                          ip="127.0.0.1", meta={"name": "p", "namespace": "ns", "uid": "u"},
                          key="ns/p", container_env=lambda spec, writable: dict(os.environ),
                          changed=lambda: None)
    init = Container(pod, {"name": "setup", "image": "busybox"}, init=True)
    threading.Thread(target=init.run, daemon=True).start()
    try:
        assert starting.wait(10)
        status = init.status()
        assert status["restartCount"] == 0 and status["lastState"] == {}
        assert status["state"]["terminated"]["exitCode"] == 1
        first_start = status["state"]["terminated"]["startedAt"]
        go_on.set()
        wait_until(lambda: "waiting" in init.status()["state"], timeout=10)
        status = init.status()  # the second exit: back-off, the exited container is lastState
        assert status["restartCount"] == 1
        assert status["state"]["waiting"]["reason"] == "CrashLoopBackOff"
        assert status["lastState"]["terminated"]["exitCode"] == 1
        assert status["lastState"]["terminated"]["startedAt"] >= first_start
        assert len(init.instances) == 2
    finally:
        go_on.set()
        init.stop.set()
