"""The vLLM stand-in's start model (cold, weights cached, everything cached) and its in-place
restart request."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from vlm_testbed.vllmsim.startup import StartCosts, compile_dir, phases, weights_path


def test_defaults_reproduce_the_published_figures():
    costs = StartCosts()
    assert sum(phases(costs, False, False).values()) == pytest.approx(110)  # cold
    assert sum(phases(costs, True, False).values()) == pytest.approx(52)  # weights cached
    assert sum(phases(costs, True, True).values()) == pytest.approx(48)  # compile cache too


def test_env_scales_and_sets_each_phase():
    costs = StartCosts.from_env({"VLM_SIM_TIME_SCALE": "0.01", "VLM_SIM_LOAD_SECONDS": "100",
                                 "VLM_SIM_WEIGHTS_BYTES": "1000",
                                 "VLM_SIM_HUB_BYTES_PER_S": "100"})
    assert phases(costs, False, False) == pytest.approx(
        {"fetch": 0.1, "load": 1.0, "compile": 0.04, "init": 0.28})
    assert set(phases(StartCosts.from_env({"VLM_SIM_TIME_SCALE": "0"}), False,
                      False).values()) == {0.0}
    with pytest.raises(ValueError, match="VLM_SIM_LOAD_SECONDS='x'"):
        StartCosts.from_env({"VLM_SIM_LOAD_SECONDS": "x"})
    with pytest.raises(ValueError, match="must not be negative"):
        StartCosts.from_env({"VLM_SIM_TIME_SCALE": "-1"})


def test_cache_locations_follow_vllm():
    env = {"HOME": "/h"}
    assert str(weights_path(env, "org/m")) == (
        "/h/.cache/huggingface/hub/models--org--m/snapshots/main/model.safetensors")
    assert str(weights_path({"HF_HOME": "/models"}, "org/m")).startswith("/models/hub/")
    assert str(compile_dir(env, "0.32.0", "org/m")).startswith("/h/.cache/vllm/torch_compile")
    assert str(compile_dir({"VLLM_CACHE_ROOT": "/c"}, "0.32.0", "org/m")).startswith("/c/")
    # no two versions (or models) share a compile cache
    assert compile_dir(env, "0.32.0", "org/m") != compile_dir(env, "0.33.0", "org/m")
    assert compile_dir(env, "0.32.0", "org/m") != compile_dir(env, "0.32.0", "org/n")


def run_standin(env: dict[str, str], port: int, until: str, timeout: float = 30) -> list[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "vlm_testbed.vllmsim", "org/tiny-vl", "--port", str(port),
         "--host", "127.0.0.1"], env={**os.environ, "VLM_SIM_STATS_INTERVAL": "0", **env},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if until in line or time.monotonic() > deadline:
                break
    finally:
        proc.terminate()
        proc.wait(10)
    return lines


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cold_then_warm_start(tmp_path):
    env = {"HOME": str(tmp_path / "home"), "HF_HOME": str(tmp_path / "hf"),
           "VLM_SIM_TIME_SCALE": "0", "VLM_SIM_WEIGHTS_BYTES": "123456789"}
    cold = "\n".join(run_standin(env, free_port(), "Starting vLLM server"))
    assert "Time spent downloading weights for org/tiny-vl" in cold
    assert "Compiling a graph for dynamic shape" in cold
    weights = weights_path(env, "org/tiny-vl")
    assert weights.stat().st_size == 123456789  # sparse: the modelled size, not the disk's
    assert weights.stat().st_blocks * 512 < 1_000_000
    warm = "\n".join(run_standin(env, free_port(), "Starting vLLM server"))
    assert "downloading weights" not in warm
    assert "Directly load the compiled graph(s) for dynamic shape from the cache" in warm
    # a new HOME (a new pod's emptyDir) with HF_HOME kept (a claim): weights warm, compile cold
    kept = "\n".join(run_standin({**env, "HOME": str(tmp_path / "home2")}, free_port(),
                                 "Starting vLLM server"))
    assert "downloading weights" not in kept and "Compiling a graph" in kept


def test_restart_request_exits_once_for_a_new_request(tmp_path):
    request = tmp_path / "restart-request"
    request.write_text("r1")
    env = {"HOME": str(tmp_path), "VLM_SIM_TIME_SCALE": "0", "VLM_TOKENIZER_POOL_SIZE": "2",
           "VLM_RESTART_REQUEST_FILE": str(request)}
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "vlm_testbed.vllmsim", "org/tiny-vl", "--port", str(port),
         "--host", "127.0.0.1"], env={**os.environ, "VLM_SIM_STATS_INTERVAL": "0", **env},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "Starting vLLM server" in line:
                break
        time.sleep(2.5)  # the request present at start is never acted on
        assert proc.poll() is None, "".join(lines)
        request.write_text("r2\n")
        assert proc.wait(10) == 0
        out = "".join(lines) + proc.stdout.read()
        assert "vlm-restart-request r2: exiting for an in-place container restart" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
