"""Facts the operator and the engine plugin each hold (the plugin is its own distribution and
imports nothing of the operator's): the supported vLLM range and the tokenizer pool's size.
Each is tied here, so a change on one side that the other lacks fails the unit tests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_tokenizer_pool import plugin
from vlm_operator.api import versions
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
