"""What the Kubernetes build makes: the kubelet (and the node's own Go programs) with the control
plane in one `make` when that one is built, on its own only when asked; a cache set stays
complete while the node's binaries are added to it."""

import importlib
import json
from pathlib import Path

b = importlib.import_module("vlm_testbed.controlplane.build")  # the package exports build()


def _cache(d: Path, names: tuple[str, ...]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    files = {}
    for n in names:
        (d / n).write_text("#!/bin/sh\n")
        (d / n).chmod(0o755)
        files[n] = {"sha256": "x", "size": 1}
    (d / b.COMPLETE_MARKER).write_text(json.dumps({"version": b.K8S_VERSION, "files": files}))
    return d


def test_fresh_cache_builds_kubelet_in_the_same_make(tmp_path):
    assert b._needed(tmp_path, force=False, node=None) == b.BINARIES + b.NODE_BINARIES
    assert b._needed(tmp_path, force=False, node=False) == b.BINARIES


def test_cached_control_plane_adds_kubelet_only_when_asked(tmp_path):
    d = _cache(tmp_path / "bin", b.BINARIES)
    assert b.binaries_ready(d) and not b.node_binaries_ready(d)
    assert b._needed(d, force=False, node=None) == ()
    assert b._needed(d, force=False, node=True) == b.NODE_BINARIES


def test_adding_node_binaries_keeps_the_set_complete(tmp_path):
    d = _cache(tmp_path / "bin", b.BINARIES)
    out = tmp_path / "out"
    out.mkdir()
    outputs = {}
    for n in b.NODE_BINARIES:
        (out / n).write_bytes(b"\x7fELF" + n.encode())
        outputs[n] = out / n
    b._add_binaries(outputs, d, make_s=12.3)
    assert b.node_binaries_ready(d) and b.binaries_ready(d)
    manifest = json.loads((d / b.COMPLETE_MARKER).read_text())
    assert set(manifest["files"]) == set(b.BINARIES + b.NODE_BINARIES)
    assert manifest["make_seconds"] == {" ".join(b.NODE_BINARIES): 12}
    assert not [p for p in d.iterdir() if p.name.startswith(".")]


def test_node_go_sources_are_where_the_build_copies_them_from():
    for n in b.NODE_BINARIES:
        if n.startswith("vlm-"):
            assert (b.OWN_GO_SOURCES / n / "main.go").is_file()
