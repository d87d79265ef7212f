"""The vLLM plugin against real vLLM code, one venv per vLLM version (hack/test-engine-vllm.sh).

Each scenario runs plugin_probe.py in a fresh interpreter (patches are per process): vLLM's own
plugin loader finds our entry point, then vLLM's own factories build the input processor,
renderer and multimodal processor for a tiny local LLaVA, and the probe reports which tokenizer
objects they hold. Skipped where vLLM is not installed (the main dev venv).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_tokenizer_pool import plugin

HERE = Path(__file__).parent
HEADER = r"(INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d \[plugin\.py:\d+\] "
ACTIVE = re.compile(
    HEADER + r"vlm-tokenizer-pool active: vllm=(\S+) pool_size=(\d+) patched=(\S+)$"
)
INACTIVE = re.compile(HEADER + r"vlm-tokenizer-pool inactive: vllm=(\S+) reason=(.+)$")
ENV_POOL_SIZE = 3  # what the env var asks for (used before 0.19 only)


# ---------------------------------------------------------------- pure decisions (any venv)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0.17.1", (0, 17, 1)),
        ("0.17.1+cpu", (0, 17, 1)),
        ("0.21.0rc1.dev3+g1234abc", (0, 21, 0)),
        ("v0.33", (0, 33, 0)),
        ("dev", None),
        ("", None),
    ],
)
def test_parse_version(text, expected):
    assert plugin.parse_version(text) == expected


def test_plan_per_version_range():
    assert plugin.plan_for((0, 10, 2)) is None
    assert plugin.plan_for((0, 34, 0)) is None
    assert plugin.plan_for((1, 0, 0)) is None
    old = plugin.plan_for((0, 11, 0))
    assert [h.target for h in old.ctor_hooks] == [
        "vllm.inputs.preprocess.InputPreprocessor.__init__",
        "vllm.multimodal.processing.InputProcessingContext.__init__",
    ]
    assert (
        plugin.plan_for((0, 16, 0)).ctor_hooks[0].target == "vllm.renderers.hf.HfRenderer.__init__"
    )
    assert plugin.plan_for((0, 18, 1)).ctor_hooks[0].target == (
        "vllm.renderers.base.BaseRenderer.__init__"
    )
    assert not plugin.plan_for((0, 18, 1)).size_from_model_config
    assert plugin.plan_for((0, 19, 0)).size_from_model_config
    for v in ((0, 21, 0), (0, 23, 0), (0, 33, 0)):
        assert plugin.plan_for(v) == plugin.Plan(replace_thread_pool=True)


def test_pool_size_rule():
    class MC:
        renderer_num_workers = 3

    assert plugin.pool_size_for(MC(), True, lambda: 7) == 4
    assert plugin.pool_size_for(MC(), False, lambda: 7) == 7
    assert plugin.pool_size_for(object(), True, lambda: 7) == 7


def test_startup_lines_follow_the_contract():
    line = plugin.active_line("0.20.2", 4, ["a.B.__init__", "c.D.__init__"])
    assert (
        line
        == "vlm-tokenizer-pool active: vllm=0.20.2 pool_size=4 patched=a.B.__init__,c.D.__init__"
    )
    assert plugin.inactive_line("0.99.0", "bad\n  thing") == (
        "vlm-tokenizer-pool inactive: vllm=0.99.0 reason=bad thing"
    )


# ---------------------------------------------------------------- real vLLM (per-version venv)

vllm_only = pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True).returncode != 0,
    reason="vLLM is not installed in this interpreter (run hack/test-engine-vllm.sh)",
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    sys.path.insert(0, str(HERE))
    import vllm_tiny_model

    return vllm_tiny_model.write_llava(tmp_path_factory.mktemp("llava"))


def _probe(
    model_dir: Path, *extra: str, pool_size: str = str(ENV_POOL_SIZE)
) -> tuple[dict, list[str]]:
    env = dict(os.environ, VLM_TOKENIZER_POOL_SIZE=pool_size, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, str(HERE / "plugin_probe.py"), str(model_dir), *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 0, "\n".join(lines[-60:])
    return json.loads(proc.stdout.strip().splitlines()[-1]), lines


def _version(report: dict) -> tuple[int, int, int]:
    return plugin.parse_version(report["version"])


def _expected_size(report: dict, workers: int) -> int:
    return workers + 1 if _version(report) >= (0, 19, 0) else ENV_POOL_SIZE


@pytest.fixture(scope="module", params=[1, 3], ids=["renderer_workers=1", "renderer_workers=3"])
def probe(request, model_dir):
    """(report, log lines, renderer_num_workers); workers=3 only where vLLM has it (0.19+)."""
    import vllm

    workers = request.param
    if workers > 1 and plugin.parse_version(vllm.__version__) < (0, 19, 0):
        pytest.skip("--renderer-num-workers exists from vLLM 0.19")
    return (*_probe(model_dir, "--renderer-workers", str(workers)), workers)


@vllm_only
def test_startup_line_logged_once_with_contract_format(probe):
    report, lines, workers = probe
    active = [m for m in map(ACTIVE.search, lines) if m]
    assert len(active) == 1, lines
    assert not [line for line in lines if "vlm-tokenizer-pool inactive" in line]
    _, version, size, patched = active[0].groups()
    assert version == report["version"]
    assert int(size) == _expected_size(report, workers)
    expected = (
        {"vllm.tokenizers.hf.maybe_make_thread_pool"}
        if _version(report) >= (0, 21, 0)
        else {h.target for h in plugin.plan_for(_version(report)).ctor_hooks}
    )
    assert expected <= set(patched.split(","))
    ours = {k for k, v in report["targets"].items() if v["ours"]}
    assert set(patched.split(",")) <= ours


@vllm_only
def test_prompt_and_multimodal_tokenizers_are_pooled_with_the_right_size(probe):
    report, _, workers = probe
    size = _expected_size(report, workers)
    for role in [report["prompt"], *report["mm"], report["hf_processor"]]:
        assert role["pooled"], role
        assert role["size"] == size, role
        assert role["encodes_like_plain"], role
    assert report["hf_processor"]["id"] == report["mm"][0]["id"]
    assert report["hf_processor_call_ok"]


@vllm_only
def test_multimodal_tokenizer_sharing_matches_the_version(probe):
    """0.18 - 0.20 give the multimodal processor its own deep copy; the others share one object."""
    report, _, workers = probe
    mm_ids = {m["id"] for m in report["mm"]}
    if (0, 20, 0) <= _version(report) < (0, 21, 0) and workers == 1:
        assert len(mm_ids) == 2  # 0.20's second, read-only processor has its own copy too
    if (0, 18, 0) <= _version(report) < (0, 21, 0):
        assert report["prompt"]["id"] not in mm_ids
    else:
        assert mm_ids == {report["prompt"]["id"]}


@vllm_only
def test_register_again_is_a_no_op(probe):
    report, _, _ = probe
    assert report["second_register_noop"]


@vllm_only
def test_pooled_tokenizer_survives_pickling(probe):
    """vLLM 0.21 - 0.23's own pool unpickles to None; ours gives a pooled tokenizer back."""
    report, _, _ = probe
    assert report["pickled"] is not None
    assert report["pickled"]["pooled"]
    assert report["pickled"]["size"] == report["prompt"]["size"]
    assert report["pickled"]["encodes_like_plain"]


@vllm_only
def test_vllm_thread_pool_function_is_replaced_everywhere_on_0_21_plus(probe):
    report, _, _ = probe
    if _version(report) < (0, 21, 0):
        pytest.skip("vLLM < 0.21 has no maybe_make_thread_pool")
    holders = {k: v for k, v in report["targets"].items() if k.endswith(".maybe_make_thread_pool")}
    assert {"vllm.tokenizers.hf", "vllm.tokenizers", "vllm.renderers.hf"} <= {
        k.rsplit(".", 1)[0] for k in holders
    }
    assert all(v["ours"] for v in holders.values()), holders
    assert len({v["id"] for v in holders.values()}) == 1  # every module holds the same function


@vllm_only
@pytest.mark.parametrize("fake", ["0.99.0", "0.10.2", "not-a-version"])
def test_unknown_version_logs_inactive_and_patches_nothing(model_dir, fake):
    report, lines = _probe(model_dir, "--fake-version", fake)
    inactive = [m for m in map(INACTIVE.search, lines) if m]
    assert len(inactive) == 1, lines
    assert inactive[0].group(1) == "WARNING"
    assert inactive[0].group(2) == fake
    assert not [line for line in lines if "vlm-tokenizer-pool active" in line]
    assert report["second_register_noop"]
    assert not [k for k, v in report["targets"].items() if v["ours"]]


@vllm_only
def test_failed_patch_logs_inactive_and_leaves_vllm_unpatched(model_dir):
    """Claiming 0.21 on an older vLLM: the plan's target (maybe_make_thread_pool) is missing."""
    import vllm

    if plugin.parse_version(vllm.__version__) >= (0, 21, 0):
        pytest.skip("on 0.21+ the targets of every plan exist")
    report, lines = _probe(model_dir, "--fake-version", "0.21.0")
    inactive = [m for m in map(INACTIVE.search, lines) if m]
    assert len(inactive) == 1, lines
    assert inactive[0].group(1) == "WARNING"
    assert inactive[0].group(3).startswith("patch failed: "), inactive[0].group(3)
    assert not [line for line in lines if "vlm-tokenizer-pool active" in line]
    assert not [k for k, v in report["targets"].items() if v["ours"]]


@vllm_only
def test_invalid_pool_size_env_logs_inactive_before_0_21(model_dir):
    """Where the env var sizes the pool, a bad value leaves vLLM unpatched with a warning."""
    import vllm

    if plugin.parse_version(vllm.__version__) >= (0, 21, 0):
        pytest.skip("0.21+ sizes the pool by renderer_num_workers; the env var is not read")
    report, lines = _probe(model_dir, "--fake-version", vllm.__version__, pool_size="0")
    inactive = [m for m in map(INACTIVE.search, lines) if m]
    assert len(inactive) == 1, lines
    assert "VLM_TOKENIZER_POOL_SIZE" in inactive[0].group(3)
    assert not [k for k, v in report["targets"].items() if v["ours"]]
