"""The log followers by pod uid: made and ended by the log watcher (logs/watcher.py), asked by
the Remediator what a pod's current container logged (its engine died; the engine plugin runs
there) and what its log showed of its GPU. Built first by runner.py and handed to both, so
neither has to build the other."""

from __future__ import annotations

import threading

from vlm_operator.logs.stream import Follower
from vlm_operator.remediation.suspect import GpuFault


class Followers:
    def __init__(self) -> None:
        self.lock = threading.Lock()  # held by the watcher while it makes or ends one
        self.by_uid: dict[str, Follower] = {}

    def get(self, uid: str) -> Follower | None:
        with self.lock:
            return self.by_uid.get(uid)

    def engine_dead(self, uid: str) -> bool:
        """The pod's current container logged engine death."""
        follower = self.get(uid)
        return follower is not None and follower.engine_dead_at is not None

    def gpu_error(self, uid: str) -> GpuFault | None:
        """The last GPU fault the pod's log showed, in any of its containers (None: none)."""
        follower = self.get(uid)
        return follower.gpu_error if follower is not None else None

    def plugin_loaded(self, uid: str) -> bool:
        """The engine plugin's startup line (active or inactive) is in the pod's current
        container's log: it runs there, and acts on an in-place restart request."""
        follower = self.get(uid)
        return follower is not None and follower.plugin is not None
