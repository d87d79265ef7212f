"""Which pods the autoscaler should remove first: those log watching saw failing."""

import time

from vlm_operator import remediation
from vlm_operator.logwatch import Follower, LogWatch


def pod(name, owner="demo", ns="ml"):
    return {"metadata": {"name": name, "namespace": ns, "uid": f"uid-{name}",
                         "labels": {"app.kubernetes.io/instance": owner}}}


def test_failing_pods_from_windows_and_findings():
    watch = LogWatch(kube=None, reconcile=lambda ns, name: None)
    for name in ("a", "b", "c"):
        watch._followers[f"uid-{name}"] = Follower(watch, pod(name))  # not started
    watch._followers["uid-x"] = Follower(watch, pod("x", owner="other"))
    owner = watch._owner("ml", "demo")
    owner.policy = remediation.policy_from_spec({})
    assert watch.failing_pods("ml", "demo") == set()
    now = time.time()
    watch.windows.add("a", "tokenizerRetry", now - 1, 60)
    watch.windows.add("x", "tokenizerRetry", now - 1, 60)  # another VLMDeployment's pod
    watch.windows.add("b", "engineDead", now - 3600, 60)  # long out of its window
    owner.findings["c"] = [remediation.Finding("CrashLoopBackOff", "c: crash", "c/crash")]
    assert watch.failing_pods("ml", "demo") == {"a", "c"}
    assert watch.failing_pods("ml", "nobody") == set()
