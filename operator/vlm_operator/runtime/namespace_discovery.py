"""kopf's discovery of the namespaces a pattern (`-n 'team-*'`) matches, counting every
namespace a listing holds.

kopf lists the namespaces once at start, then starts its namespace watch. That watch begins
with a listing of its own (as it does again after every expired resource version, 410 Gone),
which kopf hands over as events without a type, and kopf 1.45's namespace observer
(`process_discovered_namespace_event`) drops those. So a namespace created between kopf's two
listings at start, or while the watch was down before a relisting, reaches kopf in no event
it reads: kopf never watches it (until the namespace itself changes), and a VLMDeployment
created there is never reconciled. Seen with a namespace created just after the operator
answered its liveness probe, on a loaded machine (tests/e2e/test_operator.py reproduces it
by slowing kopf's second listing).

`count_listed_namespaces` puts `process_namespace_event` in that observer's place before kopf
starts: a listed namespace counts as an added one, and kopf's orchestrator is told only when
the set of watched namespaces changed. A namespace deleted while the watch was down stays
known until kopf next hears of it, as before (its watchers find nothing there).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


async def process_namespace_event(*, raw_event: dict, namespaces: Any, insights: Any,
                                  **_: Any) -> None:
    """One namespace event or listed namespace (type None) into kopf's insights."""
    from kopf._core.reactor import observation

    name = ((raw_event.get("object") or {}).get("metadata") or {}).get("name")
    if not name:
        return
    async with insights.revised:
        known = name in insights.namespaces
        observation.revise_namespaces(raw_events=[raw_event], insights=insights,
                                      namespaces=namespaces)
        if (name in insights.namespaces) != known:
            insights.revised.notify_all()


def count_listed_namespaces() -> bool:
    """Wire process_namespace_event into kopf's namespace observer (once, before kopf runs);
    False, with a warning, where this kopf has no such observer to replace."""
    try:
        from kopf._core.reactor import observation
    except ImportError:
        observation = None
    if observation is None or not all(
            hasattr(observation, attr) for attr in
            ("process_discovered_namespace_event", "revise_namespaces", "namespace_observer")):
        log.warning("this kopf has no namespace observer to fix: a namespace matching -n that "
                    "is created while kopf lists namespaces may go unwatched")
        return False
    observation.process_discovered_namespace_event = process_namespace_event
    return True
