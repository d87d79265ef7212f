"""The plugin's in-place restart request (vllm_tokenizer_pool/restart.py): a new value in the
projected file exits the process once; the value present at start never does."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from vllm_tokenizer_pool import restart


def test_only_a_value_other_than_the_one_at_start_is_a_request(tmp_path: Path):
    path = tmp_path / "restart-request"
    path.write_text("engine_stalled@1.000\n")  # what restarted this container
    watch = restart.Watch(str(path))
    assert watch.check() is None
    path.write_text("")
    assert watch.check() is None  # the annotation removed: nothing asked
    path.write_text("engine_stalled@2.000")
    assert watch.check() == "engine_stalled@2.000"
    assert watch.check() is None  # once


def test_a_missing_or_huge_file_is_read_safely(tmp_path: Path):
    watch = restart.Watch(str(tmp_path / "absent"))  # the volume not projected yet
    assert watch.initial == "" and watch.check() is None
    big = tmp_path / "big"
    big.write_bytes(b"x" * 10_000_000)
    assert restart.read_request(str(big)) == "x" * restart.REQUEST_MAX_BYTES


def test_the_watch_runs_only_in_the_first_process_and_where_asked(monkeypatch, tmp_path):
    monkeypatch.delenv(restart.ENV, raising=False)
    assert restart.start(lambda code: None) is None
    monkeypatch.setenv(restart.ENV, str(tmp_path / "r"))
    monkeypatch.setattr(restart.multiprocessing, "parent_process", lambda: object())
    assert restart.start(lambda code: None) is None  # an engine core or worker


def test_a_request_exits_with_status_zero_after_its_line(monkeypatch, tmp_path: Path):
    path = tmp_path / "r"
    monkeypatch.setenv(restart.ENV, str(path))
    monkeypatch.setattr(restart, "POLL_S", 0.02)
    exited = []
    done = threading.Event()
    assert restart.start(lambda code: (exited.append(code), done.set())) is not None
    path.write_text("engine_dead@5.000")
    assert done.wait(5)
    assert exited == [0]


def test_the_plugin_exits_a_real_process_on_a_request(tmp_path: Path):
    """register() as vLLM calls it (here without vLLM: the pool says inactive), in a process of
    its own; the file written afterwards ends it with status 0 and the line on its output."""
    path = tmp_path / "restart-request"
    path.write_text("old")
    env = {**os.environ, restart.ENV: str(path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", "from vllm_tokenizer_pool.plugin import register; register(); "
         "import time; print('started', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        seen = []
        while not seen or seen[-1].strip() != "started":  # register() has returned
            seen.append(proc.stdout.readline())
            assert seen[-1], seen
        time.sleep(1.5)  # a poll or more with the old value: no exit
        assert proc.poll() is None
        path.write_text("engine_stalled@7.000")
        out = "".join(seen) + proc.communicate(timeout=20)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0
    assert "vlm-restart-request engine_stalled@7.000: exiting for an in-place container " \
           "restart" in out
