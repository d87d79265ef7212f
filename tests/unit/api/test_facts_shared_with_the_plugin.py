"""Facts the operator and the engine plugin each hold (the plugin is its own distribution and
imports nothing of the operator's): the supported vLLM range (and the default image and README's
range that follow it) and the tokenizer pool's size.
Each is tied here, so a change on one side that the other lacks fails the unit tests."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_tokenizer_pool import plugin
from vlm_operator.api import crd, versions
from vlm_operator.api.validation import VLMDeployment


def test_the_supported_vllm_range_is_the_same_on_both_sides():
    assert (versions.SUPPORTED_MIN[:2], versions.KNOWN_LATEST) == plugin.SUPPORTED
    oldest, newest = plugin.SUPPORTED
    assert plugin.plan_for((*oldest, 0)) is not None and plugin.plan_for((*newest, 9))
    assert plugin.plan_for((oldest[0], oldest[1] - 1, 0)) is None
    assert plugin.plan_for((newest[0], newest[1] + 1, 0)) is None


@pytest.mark.parametrize("minor", range(versions.SUPPORTED_MIN[1], versions.KNOWN_LATEST[1] + 1))
def test_the_pool_the_plugin_makes_is_the_size_the_operator_plans(minor):
    """The operator sizes the pool (status, VLM_TOKENIZER_POOL_SIZE for engines that have no
    renderer workers setting); the plugin sizes it from vLLM's own setting where there is one,
    else from that variable. Both must come to the same number."""
    version = (0, minor, 0)
    for workers in (1, 2, 5):
        planned = VLMDeployment.pool_size.fget(SimpleNamespace(
            spec={"rendererNumWorkers": workers}, version=version))
        made = plugin.pool_size_for(SimpleNamespace(renderer_num_workers=workers),
                                    plugin.plan_for(version), lambda planned=planned: planned)
        assert made == planned, (version, workers)


def test_the_default_image_and_readme_follow_the_supported_range():
    """A new vLLM release is written in api/versions.py (and the plugin): the default image is
    derived from it, and README's one statement of the range must say the same."""
    assert versions.SUPPORTED_MIN <= versions.DEFAULT_RELEASE
    assert versions.DEFAULT_RELEASE[:2] <= versions.KNOWN_LATEST
    release = ".".join(map(str, versions.DEFAULT_RELEASE))
    assert crd.DEFAULT_IMAGE.endswith(f":v{release}")
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    oldest, newest = (".".join(map(str, v[:2])) for v in plugin.SUPPORTED)
    assert f"into every vLLM from {oldest} to {newest}." in readme
