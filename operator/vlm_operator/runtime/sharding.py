"""Static sharding: VLMDeployments split across operator processes.

One process follows every managed pod's log and reads every pod's /metrics each second; past
a few hundred pods that is more than one process (bench/results/scale.md, docs/scaling.md).
With `--shards N --shard I` (or `--shard auto`: I from the pod name's StatefulSet ordinal),
a process handles only the VLMDeployments whose stable hash of namespace/name falls in its
shard, with their children, pods, rounds and log followers. Each shard has a peering object of
its own (`<peering>-<I>`), so a shard's replicas are active/standby among themselves as one
unsharded operator's are. Everything a process acts on is still read from the cluster, so a
shard's standby, or a process of a new shard count, picks up what another left in flight.
"""

from __future__ import annotations

import hashlib
import re
from typing import NamedTuple


def shard_of(namespace: str, name: str, shards: int) -> int:
    """The shard of VLMDeployment namespace/name: stable across processes and releases."""
    digest = hashlib.sha256(f"{namespace}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % shards


def ordinal(pod_name: str) -> int | None:
    """A StatefulSet pod's ordinal (vlm-operator-3 -> 3); None for any other name."""
    found = re.search(r"-(\d+)$", pod_name or "")
    return int(found.group(1)) if found else None


class Shard(NamedTuple):
    index: int = 0
    count: int = 1

    def owns(self, namespace: str | None, name: str | None) -> bool:
        """Whether this process handles VLMDeployment namespace/name (all, unsharded)."""
        if self.count <= 1:
            return True
        return bool(namespace and name) and shard_of(namespace, name, self.count) == self.index

    def peering(self, name: str) -> str:
        return name if self.count <= 1 else f"{name}-{self.index}"
