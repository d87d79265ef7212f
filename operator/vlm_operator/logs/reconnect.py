"""When a follower (stream.py) opens a pod's log stream again after it stopped, and how an API
error it got reads in one line."""

from __future__ import annotations

import contextlib
import json

from kubernetes.client.exceptions import ApiException

RETRY_MIN_S, RETRY_MAX_S = 0.5, 10.0
END_WAIT_S = 10.0  # after a clean end (the container exited): the most to wait for its event

ENDED, QUIET, ERROR = "ended", "quiet", "error"


def retry_wait(outcome: str, delay: float, ran_for: float) -> tuple[float, float]:
    """(seconds to wait now, the back-off for the next error) after a stream stopped.

    ENDED: a clean end (the container exited): wait (at most this long) for the pod event
    that says what came of it, instead of polling in a tight loop. QUIET: the read timeout of
    a healthy idle stream:
    reopen at once. ERROR: exponential back-off, started afresh after a stream that had run
    for a while, so one old failure never slows detection after a quiet period."""
    if outcome == ENDED:
        return END_WAIT_S, RETRY_MIN_S
    if outcome == QUIET:
        return 0.0, RETRY_MIN_S
    if ran_for > RETRY_MAX_S:
        delay = RETRY_MIN_S
    return delay, min(delay * 2, RETRY_MAX_S)


def api_reason(exc: ApiException) -> str:
    """An API error in one line: status, reason and the Status message, bounded."""
    message = ""
    with contextlib.suppress(TypeError, ValueError, AttributeError):
        message = str(json.loads(exc.body).get("message") or "")
    text = f"{exc.status} {exc.reason}" + (f": {message}" if message else "")
    return " ".join(text.split())[:300]
