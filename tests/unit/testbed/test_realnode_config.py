"""The real node's configuration and images: a node's network and containerd config stay its
own and pull through the local registry; image names map to the registry's paths as the
mirror asks for them; the stand-in base's `vllm` maps `vllm serve` to the simulator and loads
the plugin exactly when vLLM would (its entry point installed, VLLM_PLUGINS allowing it)."""

import os
import subprocess
import sys

import pytest

from vlm_operator.api.crd_spec import DEFAULT_IMAGE
from vlm_testbed.failure_matrix.bed import IMAGE, Bed
from vlm_testbed.realnode import config as cfg
from vlm_testbed.realnode.imagebuild import VLLM_SHIM, VLLM_VERSIONS, vllm_image
from vlm_testbed.realnode.registry import repository_path


def test_nodes_get_their_own_bridge_subnet_a_default_route_and_no_masquerade(tmp_path):
    a, b = cfg.NodeNet(1), cfg.NodeNet(2)
    assert (a.bridge, a.gateway, a.subnet) == ("vlmbr1", "10.244.1.1", "10.244.1.0/24")
    assert a.subnet != b.subnet and a.bridge != b.bridge
    plugin = a.conflist(tmp_path)["plugins"][0]
    assert plugin["ipMasq"] is False and plugin["bridge"] == "vlmbr1"
    assert plugin["isDefaultGateway"] is True  # pods reach this machine's own addresses
    assert plugin["ipam"]["dataDir"] == str(tmp_path)


def test_containerd_config_is_the_nodes_own_and_pulls_through_the_local_registry(tmp_path):
    text = cfg.containerd_config(tmp_path, "ghcr.io/vlm-operator/testbed-pause:1",
                                 "127.0.0.1:5005")
    assert "restrict_oom_score_adj = true" in text
    assert f'address = "{tmp_path}/containerd/containerd.sock"' in text
    assert 'snapshotter = "overlayfs"' in text
    assert str(tmp_path / "containerd" / "runc") in text
    for host in ("docker.io", "ghcr.io"):
        assert (f'registry.mirrors."{host}"]\n  endpoint = ["http://127.0.0.1:5005"]'
                in text), text


@pytest.mark.parametrize(("image", "path"), [
    ("python:3.11-slim", "library/python:3.11-slim"),
    ("docker.io/library/python:3.11-slim", "library/python:3.11-slim"),
    ("vllm/vllm-openai:v0.33.0", "vllm/vllm-openai:v0.33.0"),
    ("ghcr.io/vlm-operator/vllm:v0.33.0", "vlm-operator/vllm:v0.33.0"),
])
def test_image_names_map_to_the_paths_the_mirror_asks_for(image, path):
    assert repository_path(image) == path


def test_a_registry_that_is_not_mirrored_is_refused():
    with pytest.raises(ValueError, match=r"quay\.io/a/b:1: only docker\.io, ghcr\.io"):
        repository_path("quay.io/a/b:1")


def run_shim(tmp_path, plugins: str | None) -> list[str]:
    """The shim's decision and argv: its exec replaced by a print."""
    shim = tmp_path / "vllm"
    shim.write_text(VLLM_SHIM)
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLM_SIM_PATCHED", "VLLM_PLUGINS")}
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    probe = ("import os, sys; os.execv = lambda path, argv: (print(os.environ["
             "'VLM_SIM_PATCHED'], *argv[1:]), sys.exit(0)); "
             f"sys.argv = ['vllm', 'serve', 'org/m', '--port', '8000']; "
             f"exec(open({str(shim)!r}).read())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=env, check=True, timeout=30)
    return out.stdout.split()


def test_vllm_shim_drops_serve_starts_the_simulator_and_loads_an_installed_plugin(tmp_path):
    # this environment has the plugin installed (its vllm.general_plugins entry point)
    assert run_shim(tmp_path, None) == ["1", "-m", "vlm_testbed.vllmsim", "org/m", "--port",
                                        "8000"]
    assert run_shim(tmp_path, "vlm_tokenizer_pool,other")[0] == "1"
    assert run_shim(tmp_path, "other")[0] == "0"  # VLLM_PLUGINS leaves it out


def test_the_images_built_hold_the_default_image_and_the_failure_matrixs_release():
    """On real nodes a bed runs the project's image of the matrix's vLLM release: built."""
    built = {vllm_image(v) for v in VLLM_VERSIONS}
    assert DEFAULT_IMAGE in built
    bed = Bed(None, None, "ns", real_nodes=lambda gpus_per_node, nodes: None)
    assert bed.image in built and bed.image.endswith(IMAGE.rsplit(":", 1)[1])
    assert Bed(None, None, "ns").image == IMAGE  # simulated nodes: the upstream name


def test_a_failing_image_build_step_is_named_with_its_logs_tail(tmp_path):
    from vlm_testbed.controlplane.build import ControlPlaneError
    from vlm_testbed.realnode.imagebuild import _run

    log = tmp_path / "build.log"
    with pytest.raises(ControlPlaneError) as err:
        _run("building images/operator/Dockerfile", ["sh", "-c", "echo no wheel >&2; exit 3"],
             log)
    text = str(err.value)
    assert "building images/operator/Dockerfile failed (exit 3)" in text
    assert "no wheel" in text and str(log) in text


def test_a_machine_without_buildah_is_told_what_installs_it(tmp_path, monkeypatch):
    from vlm_testbed.controlplane.build import ControlPlaneError
    from vlm_testbed.realnode.imagebuild import Buildah

    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    with pytest.raises(ControlPlaneError, match=r"needs buildah \(hack/install-deps\.sh"):
        Buildah(tmp_path / "log")
