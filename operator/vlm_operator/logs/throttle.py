"""One log line per minute for an error that recurs on every line: the log watch's own log stays
readable whatever a pod's log holds (stream.py, watcher.py)."""

from __future__ import annotations

import logging
import threading
import time

ERROR_LOG_EVERY_S = 60.0  # one log line per recurring error per follower, the rest counted


class Throttled:
    """One log line per `every_s` for a recurring error; the ones in between are counted and
    the count goes with the next line."""

    def __init__(self, every_s: float = ERROR_LOG_EVERY_S) -> None:
        self.every_s = every_s
        self._last: float | None = None
        self._skipped = 0
        self._lock = threading.Lock()

    def log(self, logger: logging.Logger, level: int, msg: str, *args) -> bool:
        now = time.monotonic()
        with self._lock:
            if self._last is not None and now - self._last < self.every_s:
                self._skipped += 1
                return False
            skipped, self._skipped, self._last = self._skipped, 0, now
        if skipped:
            msg, args = msg + " (and %d more since the last such line)", (*args, skipped)
        logger.log(level, msg, *args)
        return True

