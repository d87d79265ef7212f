"""Loaded by an operator process started with this folder on PYTHONPATH: kopf's second listing
of the namespaces (its namespace watch's own, after the one it starts with) waits
VLM_TEST_LISTING_DELAY_S seconds, and VLM_TEST_LISTING_MARK is written when the wait begins.
A namespace created then is in neither of kopf's first two listings' events as kopf 1.45 reads
them: the window a loaded machine opens by chance, held open."""

import asyncio
import os

from kopf._cogs.clients import fetching

_listings = {"namespaces": 0}
_fetch_objs = fetching.fetch_objs


async def _slow_second_listing(*, resource, **kwargs):
    if resource.plural == "namespaces":
        _listings["namespaces"] += 1
        if _listings["namespaces"] == 2:
            with open(os.environ["VLM_TEST_LISTING_MARK"], "w") as mark:
                mark.write("waiting")
            await asyncio.sleep(float(os.environ["VLM_TEST_LISTING_DELAY_S"]))
    async for chunk in _fetch_objs(resource=resource, **kwargs):
        yield chunk


fetching.fetch_objs = _slow_second_listing
