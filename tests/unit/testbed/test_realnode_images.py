"""The real node's image layers and configuration: paths reached through host symlinks keep
them (/lib -> usr/lib), modes are readable by the pods' non-root user, the stand-in's `vllm`
maps `vllm serve` to the simulator; a node's network and containerd config stay its own."""

import io
import os
import tarfile

from vlm_testbed.realnode import config as cfg
from vlm_testbed.realnode.images import VLLM_SHIM, _Layer


def test_layer_keeps_symlinks_on_the_way_and_makes_files_readable(tmp_path):
    real = tmp_path / "usr" / "lib"
    real.mkdir(parents=True)
    (real / "libx.so").write_bytes(b"x")
    os.chmod(real / "libx.so", 0o600)
    (tmp_path / "lib").symlink_to("usr/lib")
    buf = io.BytesIO()
    layer = _Layer(buf)
    layer.host(str(tmp_path / "lib" / "libx.so"))
    layer.close()
    with tarfile.open(fileobj=io.BytesIO(buf.getvalue())) as t:
        members = {m.name: m for m in t.getmembers()}
    link = members[str(tmp_path / "lib").lstrip("/")]
    assert link.issym() and link.linkname == "usr/lib"
    f = members[str(real / "libx.so").lstrip("/")]
    assert f.isfile() and f.mode & 0o444 == 0o444
    names = list(members)
    assert names.index(str(tmp_path).lstrip("/")) < names.index(str(real).lstrip("/"))


def test_vllm_shim_drops_serve_and_starts_the_simulator():
    shim = VLLM_SHIM.format(python="/usr/bin/python3", app="/opt/vlm")
    assert shim.startswith("#!/usr/bin/python3\n")
    assert '"-m", "vlm_testbed.vllmsim"' in shim and 'args[:1] == ["serve"]' in shim


def test_nodes_get_their_own_bridge_subnet_and_no_masquerade(tmp_path):
    a, b = cfg.NodeNet(1), cfg.NodeNet(2)
    assert (a.bridge, a.gateway, a.subnet) == ("vlmbr1", "10.244.1.1", "10.244.1.0/24")
    assert a.subnet != b.subnet and a.bridge != b.bridge
    plugin = a.conflist(tmp_path)["plugins"][0]
    assert plugin["ipMasq"] is False and plugin["bridge"] == "vlmbr1"
    assert plugin["ipam"]["dataDir"] == str(tmp_path)


def test_containerd_config_is_the_nodes_own(tmp_path):
    text = cfg.containerd_config(tmp_path, "vlm-testbed.local/pause:1")
    assert "restrict_oom_score_adj = true" in text
    assert f'address = "{tmp_path}/containerd/containerd.sock"' in text
    assert 'snapshotter = "overlayfs"' in text
    assert str(tmp_path / "containerd" / "runc") in text
