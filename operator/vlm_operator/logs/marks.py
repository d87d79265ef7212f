"""Resume marks: where a follower with nothing in memory starts reading a container's log,
and the kubelet's line stamps the marks are written in.

A fresh operator process does not re-read a long log: the follower (stream.py) writes a resume
mark on the pod (annotation LOG_MARK: the container, the second of the last line handled, what
the log said about the tokenizer pool and engine death) at most once every `mark_every_s` while
lines come, and a follower that finds a mark of the current container starts after the earlier
of that line and the incident windows it must refill (`lookback_s`, at most MAX_REPLAY_S); with
no mark it reads the container's log from its start, as before any mark was written. Pure.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

from vlm_operator.api import annotation_json
from vlm_operator.api.names import LOG_MARK
from vlm_operator.k8s.pods import rfc3339

MAX_REPLAY_S = 900.0  # the most of a log a fresh follower re-reads to refill incident windows
MAX_MARK_TEXT = 256  # characters of the plugin state kept in a mark
MAX_MARK_CHARS = 4096  # a mark's annotation text, at most (the operator writes some 200)


def parse_stamp_ns(stamp: str) -> int | None:
    """RFC3339Nano (the kubelet's timestamps=true prefix) to epoch nanoseconds."""
    head, _, frac = stamp.partition(".")
    zone = "Z"
    if frac:
        digits = frac.rstrip("Z")
        for sign in "+-":
            if sign in digits:
                digits, zone = digits.split(sign, 1)[0], sign + digits.split(sign, 1)[1]
        frac = digits
    elif head.endswith("Z"):
        head = head[:-1]
    try:
        secs = dt.datetime.fromisoformat(head + ("+00:00" if zone == "Z" else zone)).timestamp()
    except ValueError:
        return None
    return int(secs) * 1_000_000_000 + int((frac + "000000000")[:9] or 0)


def stamp_of(ns: int) -> str:
    """Epoch nanoseconds as RFC3339Nano (UTC), the kubelet's line stamp."""
    return f"{rfc3339(ns // 1_000_000_000)[:-1]}.{ns % 1_000_000_000:09d}Z"


@dataclass(frozen=True, slots=True)
class Mark:
    """Where a container's log was read up to, and what had been learnt from it before."""

    container: str  # the containerID it belongs to
    ns: int  # the kubelet's stamp of the last line handled, epoch nanoseconds
    plugin: str | None = None  # Follower.plugin
    engine_dead_at: float | None = None
    readable: bool = False  # a line with vLLM's header had been seen

    def value(self) -> str:
        return json.dumps({"container": self.container, "time": stamp_of(self.ns),
                           "plugin": self.plugin, "engineDeadAt": self.engine_dead_at,
                           "readable": self.readable}, sort_keys=True)


def parse_mark(annotations: Mapping[str, str] | None) -> Mark | None:
    """The LOG_MARK annotation; anything unreadable is no mark (the log is then read from the
    container's start). Whoever may patch the pod can write it: its text is bounded here, and a
    forged one only changes what is reported about that pod."""
    data = annotation_json.read((annotations or {}).get(LOG_MARK), max_chars=MAX_MARK_CHARS)
    if not isinstance(data, dict):
        return None
    try:
        stamp = parse_stamp_ns(str(data["time"])[:64])
        if stamp is None:
            return None
        plugin, dead = data.get("plugin"), data.get("engineDeadAt")
        dead = float(dead) if dead is not None else None
        return Mark(str(data["container"])[:MAX_MARK_TEXT], stamp,
                    str(plugin)[:MAX_MARK_TEXT] if plugin is not None else None,
                    dead if dead is None or math.isfinite(dead) else None,
                    data.get("readable") is True)
    except (KeyError, TypeError, ValueError, OverflowError):
        return None


def resume_point(mark: Mark | None, container: str | None, now: float,
                 lookback_s: float) -> tuple[int | None, Mark | None]:
    """(the epoch nanosecond to start reading the current container's log after, the mark that
    applies) for a follower with nothing in memory. The mark applies to its own container only;
    the replay reaches back `lookback_s` (incident windows) before now, and never starts after
    the mark: where the mark is older, the lines up to and with it are not read again."""
    if mark is None or not container or mark.container != container or \
            mark.ns > (now + 60) * 1e9:
        return None, None
    back = int((now - lookback_s) * 1e9)
    return max(0, min(mark.ns, back - 1)), mark

