"""throttle.py: one log line per recurring error, the rest counted."""

from __future__ import annotations

import logging

from vlm_operator.logs.throttle import Throttled


def test_throttled_counts_what_it_holds_back(caplog):
    t = Throttled(every_s=3600)
    logger = logging.getLogger("t")
    with caplog.at_level(logging.INFO, logger="t"):
        assert t.log(logger, logging.INFO, "x %s", 1)
        assert not any(t.log(logger, logging.INFO, "x %s", i) for i in range(5))
        t._last -= 3600
        assert t.log(logger, logging.INFO, "x %s", 2)
    assert [r.getMessage() for r in caplog.records] == [
        "x 1", "x 2 (and 5 more since the last such line)"]
