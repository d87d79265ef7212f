"""Log watching: which pods the autoscaler should remove first, and what the plugin lines say."""

import time

from vlm_operator.api import health_signals
from vlm_operator.logs.followers import Followers
from vlm_operator.logs.marks import Mark
from vlm_operator.logs.watcher import Follower, LogWatch
from vlm_operator.remediation import findings
from vlm_operator.remediation.policy import health_policy_from_spec
from vlm_operator.remediation.remediator import Remediator
from vlm_operator.stalls.watch import Heartbeats

from ..fakes import FakeKube
from ..fakes import pod as fake_pod


def log_watch(**kw) -> LogWatch:
    """A LogWatch wired as runner.build wires it, on no cluster."""
    followers = Followers()
    remediator = Remediator(None, lambda ns, name: None, engine_dead=followers.engine_dead,
                            plugin_loaded=followers.plugin_loaded,
                            gpu_error=followers.gpu_error).start()
    return LogWatch(None, lambda ns, name: None, remediator, followers, **kw)


def pod(name, owner="demo", ns="ml"):
    return {"metadata": {"name": name, "namespace": ns, "uid": f"uid-{name}",
                         "labels": {"app.kubernetes.io/instance": owner}}}


def test_failing_pods_from_windows_and_findings():
    watch = log_watch()
    try:
        for name in ("a", "b", "c"):
            watch.followers.by_uid[f"uid-{name}"] = Follower(watch, pod(name))  # not started
        watch.followers.by_uid["uid-x"] = Follower(watch, pod("x", owner="other"))
        assert watch.failing_pods("ml", "demo") == set()  # no policy read yet: nothing known
        watch.remediator.owner("ml", "demo").policy = health_policy_from_spec({})
        assert watch.failing_pods("ml", "demo") == set()
        now = time.time()
        watch.windows.add("uid-a", "tokenizerRetry", now - 1, 60)
        watch.windows.add("uid-x", "tokenizerRetry", now - 1, 60)  # another VLMDeployment's
        watch.windows.add("uid-b", "engineDead", now - 3600, 60)  # long out of its window
        watch._findings[("ml", "demo")] = {
            "c": [findings.Finding("CrashLoopBackOff", "c: crash", "c/crash")]}
        assert watch.failing_pods("ml", "demo") == {"a", "c"}
        assert watch.failing_pods("ml", "nobody") == set()
    finally:
        watch.stop()


def test_a_gpu_error_in_the_log_is_what_the_remediator_asks_for():
    """The ladder's input: the CUDA fault a pod's log showed, with its time and text, kept for
    the pod (its GPU outlives its containers)."""
    watch = log_watch()
    try:
        follower = Follower(watch, {"metadata": {"name": "p", "namespace": "ml", "uid": "u"}})
        watch.followers.by_uid["u"] = follower
        assert watch.followers.gpu_error("u") is None
        head = "(EngineCore_DP0 pid=7) ERROR 11-29 07:41:31 [core.py:866] "
        for text in ("EngineCore encountered a fatal error.", "Traceback (most recent call "
                     "last):", '  File "/v/core.py", line 1, in run_engine_core', "    run()",
                     "torch.AcceleratorError: CUDA error: an illegal memory access was "
                     "encountered", "CUDA kernel errors might be asynchronously reported"):
            follower._line(head + text + "\r")
        error = watch.followers.gpu_error("u")
        assert error.text == "CUDA error: an illegal memory access was encountered"
        assert abs(error.at - time.time()) < 3600
        assert watch.followers.gpu_error("other") is None
    finally:
        watch.stop()


def test_any_inactive_plugin_line_makes_the_pod_unpatched():
    """One process's `active` line must not hide another's `inactive`: the
    API server pooled its tokenizer, the engine core could not."""
    from vlm_testbed import vllmsim

    watch = log_watch()
    try:
        follower = Follower(watch, {"metadata": {"name": "p", "namespace": "ml", "uid": "u"}})
        env = {"VLM_TOKENIZER_POOL_SIZE": "5"}
        active = vllmsim.plugin_line("0.20.2", "APIServer", 1, env)
        inactive = vllmsim.plugin_line("0.20.2", "EngineCore", 2,
                                       {**env, "VLM_SIM_PATCHED": "inactive"})
        follower._line(active)
        assert follower.plugin == "active"
        follower._line(inactive)
        follower._line(active)  # a later active line from another process
        assert follower.plugin.startswith("inactive")
        assert findings.pod_findings({}, now=0, engine_dead_at=None,
                                        plugin=follower.plugin)[0].kind == "Unpatched"
    finally:
        watch.stop()


def test_failing_pods_look_only_at_pods_with_incidents():
    """Asked every second per Builtin VLMDeployment: it must not walk every followed pod. A
    follower without incident times is never looked at (here: its owner attribute would
    raise), and a pod forgotten by the windows is no candidate."""

    class Untouchable(Follower):
        @property
        def owner(self):
            raise AssertionError("a pod without incidents was looked at")

        @owner.setter
        def owner(self, value):
            pass

    watch = log_watch()
    try:
        watch.followers.by_uid["uid-a"] = Follower(watch, pod("a"))
        for i in range(50):
            watch.followers.by_uid[f"uid-q{i}"] = Untouchable(watch, pod(f"q{i}"))
        watch.remediator.owner("ml", "demo").policy = health_policy_from_spec({})
        watch.windows.add("uid-a", "tokenizerRetry", time.time() - 1, 60)
        assert watch.windows.uids() == {"uid-a"}
        assert watch.failing_pods("ml", "demo") == {"a"}
        watch.windows.forget("uid-a")
        assert watch.windows.uids() == set() and watch.failing_pods("ml", "demo") == set()
    finally:
        watch.stop()


def test_heartbeats_reach_stall_detection_per_container_and_engine_process():
    """Heartbeat lines go to the store stall detection reads (no incident, no API call),
    keyed by the container instance and the engine process; the pod's log is noted as live."""
    from vlm_testbed import vllmsim

    watch = log_watch(heartbeats=Heartbeats())
    try:
        follower = Follower(watch, {"metadata": {"name": "p", "namespace": "ml", "uid": "u"}})
        for pid, steps in ((7, 3), (8, 9)):
            follower._line("2026-12-01T20:58:03.123Z " + vllmsim.engine_heartbeat_line(
                "0.32.0", pid, 5, (steps, 1, 2.5, 2048, 1, 0)))
        follower._line("2026-12-01T20:58:04.000Z (APIServer pid=1) INFO 12-01 20:58:04 "
                       "[api_server.py:1] something else")
        beats, line_at = watch.heartbeats.of("u", 0)
        assert list(beats) == ["EngineCore"]  # one engine process name: the later pid wins
        b = beats["EngineCore"]
        assert (b.steps, b.in_flight, b.step_s, b.step_tokens, b.every) == (9, 1, 2.5, 2048, 5)
        assert abs(line_at - b.stamp - 0.877) < 1e-6  # log times: the last line, the beat
        assert watch.heartbeats.of("u", 1) == ({}, None)  # another container instance
        assert watch.remediator.known("ml", "") is None  # nothing was reported
        watch.follower_ended(follower)
        assert watch.heartbeats.of("u", 0) == ({}, None)
    finally:
        watch.stop()


def test_a_fresh_follower_rereads_the_longest_log_window_only():
    """Counts in an incident window survive an operator restart by re-reading that much log;
    stall detection's window is not the log's, so it does not lengthen the replay."""
    watch = log_watch()
    try:
        from_log = [s.field for s in health_signals.SIGNALS if s.source == health_signals.LOG]
        health = {field: {"windowSeconds": 5 + 5 * i} for i, field in enumerate(from_log)}
        longest = 5 + 5 * len(from_log)  # an extra signature's window, longer than any of them
        watch.remediator.owner("ml", "demo").policy = health_policy_from_spec({"health": {
            **health, "engineStalled": {"stallSeconds": 600},
            "extraSignatures": [{"name": "oom", "regex": "CUDA out of memory",
                                 "windowSeconds": longest}]}})
        assert watch.lookback_s("ml", "demo") == longest
    finally:
        watch.stop()


def test_heartbeat_store_is_bounded_and_a_new_container_starts_afresh():
    from vlm_operator.stalls.watch import MAX_ENGINES, Heartbeats

    class Log:
        last_line_stamp = 1.0

    store, fields = Heartbeats(), {"every": "5", "steps": "1", "in_flight": "0",
                                   "step_s": "0.0", "step_tokens": "0", "running": "0",
                                   "waiting": "0"}
    for i in range(MAX_ENGINES + 5):
        store.beat("u", 0, f"EngineCore_DP{i}", fields, Log(), 1.0)
    assert len(store.of("u", 0)[0]) == MAX_ENGINES
    store.beat("u", 1, "EngineCore", fields, Log(), 1.0)  # restarted container
    assert list(store.of("u", 1)[0]) == ["EngineCore"] and store.of("u", 0) == ({}, None)


def test_a_flood_of_plugin_lines_is_not_a_status_change_per_line(monkeypatch):
    """Every `inactive` line (each reason its own incident) made the findings change and the
    VLMDeployment's status be published again: a tenant's image printing distinct reasons
    turned each log line into API requests. The first reason is kept; only a change of the
    plugin state is looked at again."""
    from vlm_testbed import vllmsim

    watch = log_watch()
    rechecks = []
    monkeypatch.setattr(watch, "_recheck", rechecks.append)
    try:
        follower = Follower(watch, pod("p"))
        env = {"VLM_TOKENIZER_POOL_SIZE": "5", "VLM_SIM_PATCHED": "inactive"}
        follower._line(vllmsim.plugin_line("0.20.2", "APIServer", 1, {
            "VLM_TOKENIZER_POOL_SIZE": "5"}))
        for i in range(100):
            follower._line(vllmsim.plugin_line("0.20.2", "APIServer", 1, {
                **env, "VLM_SIM_PATCH_REASON": f"reason {i}"}))
        assert follower.plugin == "inactive: reason 0"
        assert len(rechecks) == 3  # the first line with a header, active, then inactive
    finally:
        watch.stop()


ENGINE_DEAD = ("2026-12-01T20:58:03.123Z (EngineCore pid=7) ERROR 12-01 20:58:03 [core.py:866] "
               "EngineCore encountered a fatal error.")


def test_a_labelled_pod_the_operator_did_not_create_is_never_followed_nor_written():
    """Labels prove nothing: a tenant's pod (busybox, no owner) labelled as a VLMDeployment's
    pod got a follower, that VLMDeployment's signatures run on its log, log marks patched on
    it and Events and findings on the VLMDeployment it named. Now only a pod whose owner chain
    leads to the VLMDeployment is followed, and a followed pod whose chain no longer does
    (its owner references edited) gets nothing written: no mark, no detection, no Event."""
    kube = FakeKube()
    kube.add_vlmd("ml", "demo")
    followers = Followers()
    remediator = Remediator(kube, lambda ns, name: None, engine_dead=followers.engine_dead,
                            plugin_loaded=followers.plugin_loaded,
                            gpu_error=followers.gpu_error).start()
    watch = LogWatch(kube, lambda ns, name: None, remediator, followers)
    reports = []
    remediator.report = lambda *args, **kw: reports.append(kw["pod"])
    try:
        intruder = fake_pod("intruder", owner="demo", namespace="ml", running=False)
        intruder["metadata"]["annotations"] = {"blob": "x" * 250_000}
        kube.foreign.add("uid-intruder")
        watch.observe(intruder, False)
        assert watch.followers.get("uid-intruder") is None
        assert kube.writes() == []

        ours = fake_pod("p1", owner="demo", namespace="ml", running=False)
        watch.observe(ours, False)
        follower = watch.followers.get("uid-p1")
        assert follower is not None and follower.vlmd_name == "demo"
        follower._line(ENGINE_DEAD)
        assert reports == ["p1"]  # ours: its engine death goes to remediation
        kube.foreign.add("uid-p1")  # its owner references edited away
        follower._line(ENGINE_DEAD.replace("20:58:03", "21:01:09"))  # a new occurrence
        watch.write_mark(follower, Mark("cri://a", 1, None, None, True))
        watch.previous_unreadable(follower, "400")
        assert reports == ["p1"] and kube.writes() == []
        watch.observe(ours, False)
        assert watch.followers.get("uid-p1") is None  # its follower ended
    finally:
        watch.stop()


def test_a_throttled_pod_is_counted_per_namespace_and_told_once_per_window():
    """Lines skipped over a pod's log budget are counted per namespace, and said once per
    window by a Warning Event on the pod and its VLMDeployment, not once per skipped chunk;
    a pod that is not ours gets none."""
    from vlm_operator.metrics import LOG_LINES_THROTTLED

    kube = FakeKube()
    kube.add_vlmd("ml", "demo")
    watch = LogWatch(kube, lambda ns, name: None, Remediator(kube, lambda ns, name: None),
                     Followers())
    try:
        follower = Follower(watch, fake_pod("p1", owner="demo", namespace="ml"))
        counted = LOG_LINES_THROTTLED.labels("ml")._value.get()
        for _ in range(3):
            watch.throttled(follower, 500)
        assert LOG_LINES_THROTTLED.labels("ml")._value.get() - counted == 1_500
        assert [c[1:] for c in kube.writes()] == [("Pod", "p1", "LogThrottled"),
                                                 ("VLMDeployment", "demo", "LogThrottled")]
        kube.foreign.add("uid-x")
        watch.throttled(Follower(watch, fake_pod("x", owner="other", namespace="ml")), 9)
        assert len(kube.writes()) == 2
    finally:
        watch.stop()
