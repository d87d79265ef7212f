"""Leftovers of real nodes: what a dead owner's node left is removed (its processes, those
below them, its directory); a live owner's node is not touched."""

import json
import os
import subprocess
import sys
from pathlib import Path

from vlm_testbed.realnode import stale


def _entry(tmp_path, name, pid, start):
    root = tmp_path / name
    root.mkdir()
    (stale.registry() / f"{name}.json").write_text(json.dumps(
        {"pid": pid, "start": start, "root": str(root), "bridge": "vlmbr-none-x"}))
    return root


def test_dead_owners_node_is_removed_with_its_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("VLM_OPERATOR_CACHE", str(tmp_path / "cache"))
    root = _entry(tmp_path, "vlm-node-dead", 2**22 - 7, "1")
    # a "shim" running in the node's directory, with a child of its own
    shim = subprocess.Popen([sys.executable, "-c", "import subprocess, time; "
                             "subprocess.Popen(['sleep', '60']); time.sleep(60)"], cwd=root)
    try:
        for _ in range(50):
            if stale.descendants([shim.pid]):
                break
            subprocess.run(["sleep", "0.1"])
        child = stale.descendants([shim.pid])[0]
        assert stale.clean_stale() == [str(root)]
        assert shim.wait(5) == -9
        stat = Path(f"/proc/{child}/stat")
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
        assert not root.exists() and not list(stale.registry().iterdir())
    finally:
        shim.kill()


def test_live_owners_node_and_foreign_paths_are_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("VLM_OPERATOR_CACHE", str(tmp_path / "cache"))
    me = stale._start_time(os.getpid())
    live = _entry(tmp_path, "vlm-node-live", os.getpid(), me)
    other = _entry(tmp_path, "not-a-node", 2**22 - 7, "1")
    assert stale.clean_stale() == []
    assert live.exists() and other.exists()
    assert [p.name for p in stale.registry().iterdir()] == ["vlm-node-live.json"]
