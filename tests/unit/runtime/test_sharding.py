"""sharding: every VLMDeployment in exactly one shard, stably; StatefulSet ordinals."""

from collections import Counter

from vlm_operator.runtime.sharding import Shard, ordinal, shard_of


def test_every_vlmdeployment_has_exactly_one_shard_and_they_spread():
    names = [("team-" + str(i % 7), f"model-{i}") for i in range(2000)]
    shards = [Shard(i, 4) for i in range(4)]
    for ns, name in names:
        assert sum(s.owns(ns, name) for s in shards) == 1
    spread = Counter(shard_of(ns, name, 4) for ns, name in names)
    assert min(spread.values()) > 400  # 500 each on average
    assert shard_of("team-1", "model-1", 4) == shard_of("team-1", "model-1", 4)
    assert Shard().owns("any", "thing") and not Shard(0, 2).owns(None, "x")


def test_peering_names_and_ordinals():
    assert Shard(3, 4).peering("vlm-operator") == "vlm-operator-3"
    assert Shard().peering("vlm-operator") == "vlm-operator"
    assert ordinal("vlm-operator-12") == 12 and ordinal("vlm-operator-abc") is None
    assert ordinal("") is None
