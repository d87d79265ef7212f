"""When a follower (stream.py) opens a pod's log stream again after it stopped or went quiet, and
how an API error it got reads in one line.

A stream can go quiet while its container still logs: the kubelet (1.20 measured here) serves
`follow` from the file it opened, and a reader that was behind when the kubelet rotated that file
(--container-log-max-size) stays at the renamed file's end while new lines go to the new one.
A pod whose engine heartbeat the follower has read (every few seconds) promises lines, so its
stream is given QUIET_BEATS periods of silence, not READ_TIMEOUT_S: then it is re-opened, resumed
with sinceTime, and the kubelet serves the current file from there."""

from __future__ import annotations

import contextlib
import json

from kubernetes.client.exceptions import ApiException

RETRY_MIN_S, RETRY_MAX_S = 0.5, 10.0
READ_TIMEOUT_S = 120.0  # a quiet stream is re-opened (cheap: resumed with sinceTime)
QUIET_BEATS, QUIET_MIN_S = 4, 20.0  # a heartbeating pod's stream: silence allowed
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


def quiet_s(every: object) -> float | None:
    """The silence a stream of a pod whose engine heartbeat comes every `every` seconds (the
    heartbeat line's field) may keep before it is re-opened: QUIET_BEATS periods, within
    [QUIET_MIN_S, READ_TIMEOUT_S]; None where `every` is no period."""
    try:
        period = float(str(every))
    except ValueError:
        return None
    if not 0 < period < READ_TIMEOUT_S:
        return None
    return min(max(QUIET_BEATS * period, QUIET_MIN_S), READ_TIMEOUT_S)


def hold_to(response: object, quiet: float | None) -> None:
    """Make an open stream's reads time out after `quiet` seconds of silence (None: leave it):
    urllib3 gave its socket the request's read timeout when it connected."""
    sock = getattr(getattr(response, "connection", None), "sock", None)
    if quiet is not None and sock is not None and sock.gettimeout() != quiet:
        sock.settimeout(quiet)
