"""The control plane as a background service (`up`, `down`, `env`): a supervisor process holding
it, its state under the cache directory."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .build import build, cache_root
from .cluster import ControlPlane
from .processes import _kill_group, tail


def state_dir() -> Path:
    """Where ``up`` keeps its run dir, kubeconfig path and pid file."""
    return cache_root() / "cluster"


def _read_state() -> dict:
    f = state_dir() / "state.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def _pid_alive(pid: int, needle: str) -> bool:
    """Alive and still the program we started (guards against pid reuse)."""
    try:
        return needle in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


ALREADY_UP = 3  # exit code of a supervisor that found another one holding the state dir


def _up_foreground(manifests: list[str], with_project_crd: bool) -> int:
    sd = state_dir()
    sd.mkdir(parents=True, exist_ok=True)
    # One supervisor per state dir, held for its whole life: a second `up` must not wipe
    # the run dir of one that is still starting.
    lock = open(sd / "up.lock", "w")  # noqa: SIM115 - held until the process exits
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"another control plane is up or starting for {sd}", file=sys.stderr)
        return ALREADY_UP
    print(f"supervisor pid {os.getpid()}", flush=True)
    run = sd / "run"
    shutil.rmtree(run, ignore_errors=True)
    items: list[Any] = list(manifests)
    if with_project_crd:
        from vlm_operator.api.crd import get_crd

        items.insert(0, get_crd())
    stopping = False

    def _on_signal(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    cp = ControlPlane(items, run_dir=run)
    try:
        cp.start()
        state = {
            "pid": os.getpid(), "kubeconfig": str(cp.kubeconfig), "server": cp.server,
            "run_dir": str(run), "kubectl": str(cp.kubectl) if cp.kubectl else None,
            "components": {n: pr.pid for n, pr in cp.procs.items()},
        }
        (sd / "state.json.tmp").write_text(json.dumps(state, indent=1))
        (sd / "state.json.tmp").rename(sd / "state.json")  # readers never see half a file
        (sd / "kubeconfig").unlink(missing_ok=True)
        (sd / "kubeconfig").symlink_to(cp.kubeconfig)
        (sd / "pid").write_text(str(os.getpid()))
        print(f"control plane up in {cp.start_seconds:.1f} s: {cp.server}\n"
              f"export KUBECONFIG={cp.kubeconfig}", flush=True)
        while not stopping:
            dead = cp.dead_components()
            if dead:
                print(f"component(s) exited: {dead}; logs in {run}", file=sys.stderr, flush=True)
                return 1
            time.sleep(1)
        return 0
    finally:
        cp.stop()
        for f in ("state.json", "pid", "kubeconfig"):
            (sd / f).unlink(missing_ok=True)


def cmd_up(args: argparse.Namespace) -> int:
    st = _read_state()
    if st and _pid_alive(st["pid"], "vlm_testbed.controlplane"):
        print(f"already up (pid {st['pid']})\nexport KUBECONFIG={st['kubeconfig']}")
        return 0
    build()
    if args.foreground:
        return _up_foreground(args.manifest, args.with_project_crd)
    sd = state_dir()
    sd.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "vlm_testbed.controlplane", "up", "--foreground"]
    cmd += [f"--manifest={m}" for m in args.manifest]
    if args.with_project_crd:
        cmd.append("--with-project-crd")
    with open(sd / "up.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + args.timeout
    told = False
    while True:
        st = _read_state()
        if st and _pid_alive(st["pid"], "vlm_testbed.controlplane"):
            break
        rc = proc.poll()
        if rc == ALREADY_UP and not told:
            print("another `up` holds this state dir; waiting for it to be ready", flush=True)
            told = True
        failed = rc is not None and rc != ALREADY_UP
        if failed or time.monotonic() > deadline:
            _kill_group(proc)
            print(f"control plane failed to start; {sd / 'up.log'}:\n{tail(sd / 'up.log')}",
                  file=sys.stderr)
            return 1
        time.sleep(0.3)
    st = _read_state()
    print(f"control plane up (pid {st['pid']}): {st['server']}\n"
          f"export KUBECONFIG={st['kubeconfig']}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    st = _read_state()
    if not st:
        print("not running")
        return 0
    pid = st["pid"]
    if _pid_alive(pid, "vlm_testbed.controlplane"):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while _pid_alive(pid, "vlm_testbed.controlplane") and time.monotonic() < deadline:
            time.sleep(0.2)
    # If the supervisor died hard, its components may remain: stop those we recorded.
    for name, cpid in st.get("components", {}).items():
        needle = "etcd" if name == "etcd" else name
        if _pid_alive(cpid, needle):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(cpid, signal.SIGKILL)
    for f in ("state.json", "pid", "kubeconfig"):
        (state_dir() / f).unlink(missing_ok=True)
    print("control plane stopped")
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    st = _read_state()
    if not st:
        print("# control plane not running: hack/cluster.sh up", file=sys.stderr)
        return 1
    print(f"export KUBECONFIG={st['kubeconfig']}")
    if st.get("kubectl"):
        print(f"export PATH={Path(st['kubectl']).parent}:$PATH")
    return 0
