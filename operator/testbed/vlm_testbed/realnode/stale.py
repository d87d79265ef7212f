"""What real nodes leave when their owner dies without stopping them (a test run killed with
SIGKILL): the kubelet, containerd and the namespace holder die with their parent, but the
containers' shims and processes, the bridge and the node's directory stay.

Each node records its owner (pid and start time), directory and bridge under the test bed's
cache (realnode/<index>.json); a later node's start removes what a dead owner left: processes
whose command line or working directory names that node's directory (containerd's shims name
its socket), with every process below them (a container's processes are its shim's children),
then the bridge and the directory. Nothing of a live owner's nodes is touched. A container
whose shim died already is beyond reach here: RealNode.stop kills containers before their
shims for that reason."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
from pathlib import Path

from vlm_testbed.controlplane.build import cache_root

from . import config as cfg


def registry() -> Path:
    d = cache_root() / "realnode"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def record(index: int, root: Path) -> None:
    entry = {"pid": os.getpid(), "start": _start_time(os.getpid()), "root": str(root),
             "bridge": cfg.NodeNet(index).bridge}
    (registry() / f"{index}.json").write_text(json.dumps(entry))


def forget(index: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        (registry() / f"{index}.json").unlink()


def _owner_alive(entry: dict) -> bool:
    return entry.get("start") is not None and _start_time(entry["pid"]) == entry["start"]


def descendants(pids: list[int]) -> list[int]:
    """Every process below these (a shim's container processes are its children)."""
    children: dict[int, list[int]] = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(pid))
    out: list[int] = []
    todo = list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_with_descendants(pids: list[int]) -> None:
    """SIGKILL the processes below first (orphans of a shim would outlive it), then these."""
    for pid in [*descendants(pids), *pids]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _processes_in(root: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            places = [cmdline]
            with contextlib.suppress(OSError):
                places.append(os.readlink(f"/proc/{pid}/cwd"))
            if any(root + "/" in p or p == root for p in places):
                found.append(int(pid))
    return found


def clean_stale() -> list[str]:
    """Remove what nodes of dead owners left; returns their directories. Call under the
    network lock (node._claim_network) so no node is being set up meanwhile."""
    cleaned = []
    for path in sorted(registry().glob("*.json")):
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            path.unlink(missing_ok=True)
            continue
        if _owner_alive(entry):
            continue
        root = entry.get("root", "")
        if not Path(root).name.startswith("vlm-node-"):  # never anything but a node's own
            path.unlink(missing_ok=True)
            continue
        for _ in range(3):
            pids = _processes_in(root)
            if not pids:
                break
            kill_with_descendants(pids)
            time.sleep(0.5)
        if cfg.bridge_exists(entry["bridge"]):
            cfg.ip("link", "del", entry["bridge"], check=False)
        shutil.rmtree(root, ignore_errors=True)
        path.unlink(missing_ok=True)
        cleaned.append(root)
    return cleaned
