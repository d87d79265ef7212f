"""kopf's namespace observer with namespace_discovery's processor: a namespace that reaches kopf
only in a listing (its watch's first listing, or a relisting after 410 Gone) is watched."""

import asyncio

import pytest
from kopf._cogs.structs import references
from kopf._core.reactor import observation

from vlm_operator.runtime import namespace_discovery

PATTERNS = ["team-*"]  # as `vlm-operator run -n "team-*"` hands them to kopf


def listed(name, **meta):
    return {"type": None, "object": {"metadata": {"name": name, **meta}}}


def insights_after(processor, *events):
    notified = []

    async def run():
        insights = references.Insights()
        async def waiter():
            async with insights.revised:
                await insights.revised.wait()
                notified.append(True)

        for event in events:
            task = asyncio.create_task(waiter())
            await asyncio.sleep(0)
            await processor(raw_event=event, namespaces=PATTERNS, insights=insights,
                            stream_pressure=None, resource_indexed=None, operator_indexed=None,
                            consistency_time=None)
            await asyncio.sleep(0)
            task.cancel()
        return insights.namespaces

    return asyncio.run(run()), len(notified)


def test_kopf_alone_drops_a_namespace_it_only_sees_in_a_listing():
    """Why the fix exists: should kopf count listed namespaces itself one day, this fails and
    namespace_discovery can go."""
    namespaces, _ = insights_after(observation.process_discovered_namespace_event,
                                   listed("team-a"))
    assert namespaces == set()


def test_a_listed_namespace_matching_the_patterns_is_watched_and_the_orchestrator_told():
    namespaces, notified = insights_after(namespace_discovery.process_namespace_event,
                                          listed("team-a"), listed("other"))
    assert namespaces == {"team-a"}
    assert notified == 1  # only the change; "other" matches no pattern


def test_events_after_the_listing_still_add_and_remove_namespaces():
    added = {"type": "ADDED", "object": {"metadata": {"name": "team-b"}}}
    gone = {"type": "DELETED", "object": {"metadata": {"name": "team-a"}}}
    namespaces, notified = insights_after(namespace_discovery.process_namespace_event,
                                          listed("team-a"), listed("team-a"), added, gone)
    assert namespaces == {"team-b"}
    assert notified == 3  # team-a listed twice: told once


def test_a_terminating_namespace_in_a_listing_stays_until_it_is_gone():
    terminating = listed("team-a", deletionTimestamp="2026-12-05T00:00:00Z")
    terminating["object"]["status"] = {"conditions": [
        {"type": "NamespaceDeletionContentFailure", "status": "True", "reason": "r"}]}
    namespaces, _ = insights_after(namespace_discovery.process_namespace_event,
                                   listed("team-a"), terminating)
    assert namespaces == {"team-a"}


def test_an_event_without_a_name_changes_nothing():
    namespaces, notified = insights_after(namespace_discovery.process_namespace_event,
                                          {"type": None, "object": {}})
    assert namespaces == set() and notified == 0


@pytest.fixture
def kopf_processor():
    original = observation.process_discovered_namespace_event
    yield
    observation.process_discovered_namespace_event = original


def test_wiring_puts_the_processor_where_kopfs_namespace_observer_reads_it(kopf_processor):
    assert namespace_discovery.count_listed_namespaces()
    assert (observation.process_discovered_namespace_event
            is namespace_discovery.process_namespace_event)
