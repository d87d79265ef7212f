"""How a VLMDeployment's pod stops: the drain limit, the grace periods and the preStop hook.
Pure constants and the hook's script; the pod template (children.py) and the actions that
delete pods (remediation, autoscaling) take them from here."""

from __future__ import annotations

from vlm_operator.api.names import PORT

# The longest the requests in flight on a pod that is going away are waited for (the Builtin
# autoscaler's drain, the pod's preStop hook), and the grace period that leaves vLLM after
# them to stop on SIGTERM. A pod that serves nothing, or that the operator drained itself, is
# deleted with QUICK_GRACE_S instead: dead pods never wait out the drain limit.
DRAIN_LIMIT_S = 120
STOP_S = 30
QUICK_GRACE_S = 10
ENDPOINTS_LAG_S = 2  # for the endpoints and kube-proxy to stop sending a pod new requests
POD_IP_ENV = "VLM_POD_IP"  # the preStop hook reads the pod's own /metrics there
# preStop: the pod's requests finish before SIGTERM (vLLM stops at once on it). It returns at
# once when /health fails (a dead or hung engine serves nothing), else waits ENDPOINTS_LAG_S
# and then until vllm:num_requests_running + waiting read 0 (an unreadable /metrics is not
# zero), at most DRAIN_LIMIT_S in all. Standard library only: every vLLM image has python3.
PRESTOP_SCRIPT = f"""\
import os, time, urllib.request
host = os.environ.get("{POD_IP_ENV}") or "127.0.0.1"
base = "http://%s:{PORT}" % ("[%s]" % host if ":" in host else host)
end = time.monotonic() + {DRAIN_LIMIT_S}
def get(path, timeout):
    with urllib.request.urlopen(base + path, timeout=timeout) as rsp:
        return rsp.read(1 << 22).decode("utf-8", "replace")
def idle():
    try:
        page = get("/metrics", 5)
        return sum(float(line.split()[-1]) for line in page.splitlines() if line.startswith(
            ("vllm:num_requests_running", "vllm:num_requests_waiting"))) == 0
    except Exception:
        return False
try:
    get("/health", 2)
except Exception:
    raise SystemExit(0)
time.sleep({ENDPOINTS_LAG_S})
while time.monotonic() < end and not idle():
    time.sleep(1)
"""
